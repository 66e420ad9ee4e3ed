//! `rvc`: the operator CLI of RVBox.
//!
//! Owns: argument parsing and rendering for an operator at a terminal. It
//! talks only to `rvbox-server`'s `Control` gRPC service on the server's
//! mode-0600 Unix socket and must never open the server's database or files.

use std::process::ExitCode;

use clap::{Arg, Command};

/// Default path of the server's control socket (`control.socket_path`).
const DEFAULT_SOCKET: &str = "/run/rvbox-server/control.sock";

fn cli() -> Command {
    Command::new("rvc")
        .version(env!("CARGO_PKG_VERSION"))
        .about(
            "Operator CLI for RVBox: run and follow commands on client hosts through rvbox-server",
        )
        .long_about(
            "Operator CLI for RVBox. rvc talks to rvbox-server's Control service over the \
             server's Unix socket (mode 0600) and never touches the server's storage.\n\n\
             This build answers --help and --version only: the server's control API \
             (stat, run, append, close-stdin, kill, storage, client takeover) is not \
             served yet, so rvc has no operations to offer.",
        )
        .arg(
            Arg::new("socket")
                .long("socket")
                .value_name("PATH")
                .default_value(DEFAULT_SOCKET)
                .help("Path of rvbox-server's control socket"),
        )
}

fn main() -> ExitCode {
    let matches = match cli().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            // clap prints help/version to stdout with exit 0 and usage errors to stderr with 2.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let socket = matches
        .get_one::<String>("socket")
        .map_or(DEFAULT_SOCKET, String::as_str);
    eprintln!(
        "rvc: no operation given, and this build has none yet (the control API at {socket} is not served by rvbox-server yet); see `rvc --help`"
    );
    ExitCode::from(2)
}

#[cfg(test)]
mod tests {
    use super::cli;

    #[test]
    fn cli_definition_is_consistent() {
        cli().debug_assert();
    }
}
