//! `rvbox`: the RVBox client daemon.
//!
//! Owns: the process entry point — command line, configuration gate, the
//! blocked-launcher mode, the offline `repair` tool, the `man` page and the
//! client runtime ([`daemon`], [`net`]) that dials the server and runs
//! commands on this host. Must never: dial out or launch a child before the
//! configuration has validated, or run anything for `--check-config` beyond
//! validation.

mod daemon;
mod health;
mod net;
mod outbox;
mod repair;

const ABOUT: &str =
    "RVBox client daemon: dials the server over WebSocket and runs commands on this host";

fn main() {
    // plan §7.4: the blocked launcher is an internal mode of this binary;
    // it is dispatched before anything else (no configuration, no logging)
    #[cfg(unix)]
    {
        let mut args = std::env::args_os().skip(1);
        let mode = args.next();
        let is = |m: &str| mode.as_deref() == Some(std::ffi::OsStr::new(m));
        if is(rvbox_supervisor::LAUNCHER_MODE_ARG) {
            std::process::exit(rvbox_supervisor::launcher_main(args.collect()));
        }
        // a terminal's holder, and its shell's first step (docs/terminals.md)
        if is(rvbox_supervisor::HOLDER_MODE_ARG) {
            std::process::exit(rvbox_supervisor::holder_main(args.collect()));
        }
        if is(rvbox_supervisor::CHILD_MODE_ARG) {
            std::process::exit(rvbox_supervisor::child_main(args.collect()));
        }
    }
    let daemon = rvbox_config::Daemon::Client;
    let command = rvbox_daemon_common::daemon_command(daemon, ABOUT)
        .subcommand(repair::command())
        .subcommand(rvbox_daemon_common::man_command());
    let matches = command.clone().get_matches();
    let status = match matches.subcommand() {
        Some(("repair", m)) => repair::run(m),
        Some((rvbox_daemon_common::MAN_SUBCOMMAND, _)) => {
            rvbox_daemon_common::print_man_page(command)
        }
        _ => match rvbox_daemon_common::start(daemon, &matches) {
            Ok(rvbox_daemon_common::Loaded::Client(config)) => daemon::run(*config),
            Ok(rvbox_daemon_common::Loaded::Server(_)) => daemon::EXIT_START,
            Err(status) => status,
        },
    };
    std::process::exit(status);
}
