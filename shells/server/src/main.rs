//! `rvbox-server`: the durable RVBox server daemon.
//!
//! Owns: the process entry point — command line, configuration gate and
//! (later) the server runtime. Must never: bind a listener or open the store
//! before the configuration has validated, or run anything for
//! `--check-config` beyond validation.

fn main() {
    let status = rvbox_daemon_common::run_daemon(
        rvbox_config::Daemon::Server,
        "RVBox server: durable command queue, agent WebSocket endpoint and control socket",
    );
    std::process::exit(status);
}
