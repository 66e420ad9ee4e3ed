//! `rvbox-server`: the durable RVBox server daemon.
//!
//! Owns: the process entry point — command line, configuration gate, the
//! offline `repair` and `audit` tools and the server runtime ([`daemon`]). Must never: bind a
//! listener or open the store before the configuration has validated, or
//! run anything for `--check-config` beyond validation.

mod agent;
mod audit_cli;
mod control;
mod core_loop;
mod daemon;
mod fleet_follow;
mod jsonrpc;
mod metrics;
mod pty_follow;
mod repair;
mod replica;
mod state;
mod writer_queue;

const ABOUT: &str =
    "RVBox server: durable command queue, agent WebSocket endpoint and control socket";

fn main() {
    let daemon = rvbox_config::Daemon::Server;
    let matches = rvbox_daemon_common::daemon_command(daemon, ABOUT)
        .subcommand(repair::command())
        .subcommand(audit_cli::command())
        .get_matches();
    let status = match matches.subcommand() {
        Some(("repair", m)) => repair::run(m),
        Some(("audit", m)) => audit_cli::run(m),
        _ => match rvbox_daemon_common::start(daemon, &matches) {
            Ok(rvbox_daemon_common::Loaded::Server(config)) => daemon::run(*config),
            Ok(rvbox_daemon_common::Loaded::Client(_)) => daemon::EXIT_START,
            Err(status) => status,
        },
    };
    std::process::exit(status);
}
