//! `rvbox-faultproxy`: a TCP fault proxy for chaos drills and the R8
//! harness. It sits between RVBox clients and the server (or nginx) and,
//! on command, drops connections, delays bytes, cuts a stream after an
//! exact byte count (mid-frame), blackholes a path without closing it,
//! holds bytes and releases them in one burst, refuses new connections,
//! and switches a route to another upstream. Several named routes (paths)
//! run in one proxy, each with its own faults.
//!
//! Owns: the listeners, the proxied connections and their faults, the
//! control socket's one-line protocol.
//!
//! Must never: look inside the bytes it carries, buffer without a bound,
//! or change a byte it forwards (a fault delays, withholds or cuts;
//! it never corrupts).

pub mod command;
pub mod control;
pub mod proxy;

pub use command::{Command, Dir, Target};
pub use proxy::{ApplyError, BackgroundProxy, Proxy, RouteSpec, RouteStats};
