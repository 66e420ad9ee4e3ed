//! `rvbox-server`: the durable RVBox server daemon.
//!
//! Owns: the process entry point — command line, configuration gate, the
//! offline `repair` tool and (later) the server runtime. Must never: bind a
//! listener or open the store before the configuration has validated, or
//! run anything for `--check-config` beyond validation.

mod repair;

const ABOUT: &str =
    "RVBox server: durable command queue, agent WebSocket endpoint and control socket";

fn main() {
    let daemon = rvbox_config::Daemon::Server;
    let matches = rvbox_daemon_common::daemon_command(daemon, ABOUT)
        .subcommand(repair::command())
        .get_matches();
    let status = match matches.subcommand() {
        Some(("repair", m)) => repair::run(m),
        _ => rvbox_daemon_common::run_with_matches(daemon, &matches),
    };
    std::process::exit(status);
}
