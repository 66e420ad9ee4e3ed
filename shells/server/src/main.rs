//! `rvbox-server`: the durable RVBox server daemon.
//!
//! Owns: the process entry point — command line, configuration gate, the
//! offline `repair` and `audit` tools, `backup` and `restore`, the `man`
//! page and the server runtime ([`daemon`]). Must never: bind a
//! listener or open the store before the configuration has validated, or
//! run anything for `--check-config` beyond validation.

mod agent;
mod audit_cli;
mod backup_cli;
mod control;
mod core_loop;
mod daemon;
mod edge_audit;
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
    let command = rvbox_daemon_common::daemon_command(daemon, ABOUT)
        .subcommand(repair::command())
        .subcommand(audit_cli::command())
        .subcommand(backup_cli::backup_command())
        .subcommand(backup_cli::restore_command())
        .subcommand(rvbox_daemon_common::man_command());
    let matches = command.clone().get_matches();
    let status = match matches.subcommand() {
        Some(("repair", m)) => repair::run(m),
        Some(("audit", m)) => audit_cli::run(m),
        Some(("backup", m)) => backup_cli::run_backup(m),
        Some(("restore", m)) => backup_cli::run_restore(m),
        Some((rvbox_daemon_common::MAN_SUBCOMMAND, _)) => {
            rvbox_daemon_common::print_man_page(command)
        }
        _ => match rvbox_daemon_common::start(daemon, &matches) {
            Ok(rvbox_daemon_common::Loaded::Server(config)) => daemon::run(*config),
            Ok(rvbox_daemon_common::Loaded::Client(_)) => daemon::EXIT_START,
            Err(status) => status,
        },
    };
    std::process::exit(status);
}
