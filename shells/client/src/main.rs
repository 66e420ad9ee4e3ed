//! `rvbox`: the RVBox client daemon.
//!
//! Owns: the process entry point — command line, configuration gate and
//! (later) the client runtime that dials the server and runs commands on
//! this host. Must never: dial out or launch a child before the
//! configuration has validated, or run anything for `--check-config` beyond
//! validation.

fn main() {
    let status = rvbox_daemon_common::run_daemon(
        rvbox_config::Daemon::Client,
        "RVBox client daemon: dials the server over WebSocket and runs commands on this host",
    );
    std::process::exit(status);
}
