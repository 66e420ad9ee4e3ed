//! RVBox client cores: the client daemon's protocol decisions (plan §7),
//! as pure state machines and functions.
//!
//! Owns: the composed client core ([`machine::ClientCore`]: every input
//! in, every durable and supervisor step out as a value with a token), the
//! client store port ([`ops`]), the network session ([`link`]: backoff, connecting, hello,
//! reconciling, active, closing; the server's heartbeat policy; envelope
//! and session-field checks; snapshot chunks), the acceptance decision for a `Dispatch` ([`accept`]: validation
//! of the generation, ids, request hash, revision, shell, profile, working
//! directory and expiry; the duplicate and tombstone checks; capacity) and
//! the spool ([`spool`]: one durable command-local order, wire sequences
//! on admission to the send windows, watermarks and loss mode, rolling
//! caps, truncation markers), and the values every supervisor speaks
//! ([`process`]: launch specs, launcher identities, process events; terminal
//! specs, holder identities and terminal events), and the client's side of
//! the terminals ([`machine::terminals`]).
//!
//! Must never: do I/O, read a clock, draw randomness, spawn threads or read
//! the environment. Time arrives with every input; durability is always a
//! later input (a completion), never assumed (conventions rules 1-3). The
//! client store applies these decisions inside its transactions; the shell
//! performs the rest.
#![warn(missing_docs)]

pub mod accept;
pub mod link;
pub mod machine;
pub mod ops;
pub mod process;
pub mod spool;

/// The terminal core the client's parts share (the holder's decisions,
/// the output ring by offset, the input gate), for a supervisor that
/// models a holder with the real code.
pub use rvbox_terminal as terminal;

pub use accept::{
    AcceptDecision, AcceptPolicy, Capacity, CheckedDispatch, ExistingCommand, MAX_COMMAND_RECORDS,
    Refusal, check_dispatch, decide_acceptance,
};
pub use machine::{ClientCore, ClientCoreConfig, Input, Output, RestoredRecord};
