//! `rvc`: the operator CLI of RVBox.
//!
//! Owns: argument parsing and rendering for an operator at a terminal. It
//! talks only to `rvbox-server`'s `Control` gRPC service on the server's
//! mode-0600 Unix socket and must never open the server's database or files.
//!
//! Every mutation carries one UUIDv7 `request_id`, created before the
//! socket is dialed (or given with `--request-id`) and reused for every
//! retry of the invocation; for `run` it is the new command's UUID.

mod conn;
mod exit;
mod fleet;
mod follow;
mod out;
mod output;
mod render;
mod replay;
mod script;
mod stdin;
mod terminal;
mod tty;
mod viewer;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use rvbox_proto::v1 as wire;

use crate::conn::Control;
use crate::exit::Failure;
use crate::out::{Format, emit};

/// Default path of the server's control socket (`control.socket_path`).
const DEFAULT_SOCKET: &str = "/run/rvbox-server/control.sock";

#[derive(Debug, Parser)]
#[command(
    name = "rvc",
    version,
    about = "Operator CLI for RVBox: run and follow commands on client hosts through rvbox-server",
    long_about = "Operator CLI for RVBox. rvc talks to rvbox-server's Control service over the \
                  server's Unix socket (mode 0600) and never touches the server's storage.\n\n\
                  Exit status: the remote command's own status for `run` and `follow` \
                  (128+N when a signal N ended it); 11-28 for a refusal by the server \
                  (10 + the RVBox error code); 29-33 for a command that ended without \
                  running to completion; for `shell` and `attach` the shell's own status \
                  when the terminal closes, 36 after a `~.` detach; 69 when the server \
                  cannot be reached; 130 when rvc itself is interrupted (the command \
                  keeps running). See docs/cli.md.",
    disable_help_subcommand = true,
    max_term_width = 80
)]
struct Cli {
    /// Path of rvbox-server's control socket; several, separated by commas,
    /// for replicas of one database (a call that fails moves to the next).
    #[arg(long, global = true, value_name = "PATH", env = "RVC_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: String,
    /// Idempotency key of this invocation's mutation (canonical UUIDv7);
    /// a new one is created when absent. Reads ignore it.
    #[arg(long, global = true, value_name = "UUID")]
    request_id: Option<String>,
    /// `text` for a person, or `json`: one document per result, per line
    /// (the service's answer in canonical proto3 JSON).
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Format::Text, value_name = "FORMAT")]
    output: Format,
    /// How long a call is retried (with the same request) while the
    /// server is unreachable or its connection breaks: `60s`, `5m`; `0s`
    /// gives up at the first failure.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        env = "RVC_RETRY_FOR",
        default_value = "60s"
    )]
    retry_for: String,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Queue a command on a client and, unless --background, follow its
    /// output to the end (rvc exits with the command's status). With
    /// --target, --label, --clients or --all: on every matching client
    /// (a fleet run; see `rvc fleet`).
    Run(Box<RunArgs>),
    /// Follow a command's output from its start (or after --after) to the
    /// end.
    Follow {
        /// The command's UUID.
        issue_uuid: String,
        /// Continue after this event sequence (0: from the start).
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        after: u64,
    },
    /// Without arguments: every client. With CLIENT: its commands. With
    /// CLIENT UUID: one command's lifecycle and history.
    Stat {
        /// A client id.
        client_id: Option<String>,
        /// A command UUID.
        issue_uuid: Option<String>,
        /// Every client's commands, newest first.
        #[arg(long, conflicts_with_all = ["client_id", "issue_uuid"])]
        all: bool,
        /// Only clients (or commands of clients) whose labels match this
        /// selector: `role=web`, `zone=eu-*`, `role!=db`, `canary`,
        /// `!canary`; repeat it or join terms with commas (all must hold).
        #[arg(long = "label", value_name = "SELECTOR", conflicts_with = "issue_uuid")]
        labels: Vec<String>,
        /// Only clients whose id matches this glob (`web-*`, `?`).
        #[arg(long, value_name = "GLOB", conflicts_with_all = ["client_id", "issue_uuid", "all"])]
        target: Option<String>,
        /// Continue a listing from the token the previous page printed.
        #[arg(long, value_name = "TOKEN")]
        page: Option<String>,
        /// Rows per page (1-1000; the server's default when absent).
        #[arg(long, value_name = "N")]
        per_page: Option<u32>,
    },
    /// A command's stored output by pages: one page (and the token of the
    /// next), or with --follow every page until the command ends.
    Output {
        /// The client id.
        client_id: String,
        /// The command's UUID.
        issue_uuid: String,
        /// Which streams: both (interleaved in event order), stdout or
        /// stderr.
        #[arg(long, value_enum, default_value_t = output::Streams::Both)]
        stream: output::Streams,
        /// Put the time the client observed it before each line.
        #[arg(long)]
        timestamped: bool,
        /// Raw bytes per page (1-4194304; the server's default when absent).
        #[arg(long, value_name = "N")]
        max_bytes: Option<u32>,
        /// Continue from the token the previous page printed.
        #[arg(long, value_name = "TOKEN")]
        page: Option<String>,
        /// Read on, page after page, until the command ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// List commands, newest first: one client's, or every client's.
    List {
        /// A client id; absent: every client.
        client_id: Option<String>,
        /// Only commands of clients whose labels match this selector
        /// (as for `rvc stat --label`).
        #[arg(long = "label", value_name = "SELECTOR")]
        labels: Vec<String>,
        /// Continue from the token the previous page printed.
        #[arg(long, value_name = "TOKEN")]
        page: Option<String>,
        /// Rows per page (1-1000).
        #[arg(long, value_name = "N")]
        per_page: Option<u32>,
    },
    /// Send a signal to a command's process tree: HUP, INT, TERM (the
    /// default), KILL, USR1 or USR2, with or without the SIG prefix.
    Kill {
        /// `[SIGNAL] CLIENT UUID`.
        #[arg(num_args = 2..=3, value_names = ["SIGNAL", "CLIENT", "UUID"])]
        args: Vec<String>,
    },
    /// Write to a running command's stdin: TEXT (with a newline unless
    /// --raw), a file's bytes, or rvc's own stdin until end of file
    /// (--attach). rvc waits for the client to write it.
    #[command(
        group(clap::ArgGroup::new("input").required(true).args(["text", "file", "attach"])),
        override_usage = "rvc append [OPTIONS] CLIENT UUID (TEXT | --file PATH | --attach)"
    )]
    Append {
        /// The client id.
        client_id: String,
        /// The command's UUID.
        issue_uuid: String,
        /// The text to write.
        text: Option<String>,
        /// Write this file's bytes as they are.
        #[arg(long, value_name = "PATH")]
        file: Option<std::path::PathBuf>,
        /// Stream rvc's own stdin until end of file (stdin stays open:
        /// close it with close-stdin).
        #[arg(long)]
        attach: bool,
        /// No newline after TEXT.
        #[arg(long, alias = "no-newline", requires = "text")]
        raw: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Close a command's stdin after every earlier write (the process
    /// reads end of file).
    CloseStdin {
        /// The client id.
        client_id: String,
        /// The command's UUID.
        issue_uuid: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// A client's registration: show it (with a refused claim by another
    /// instance), or authorize that instance to take the client over.
    #[command(subcommand)]
    Client(ClientCmd),
    /// Storage incidents of the server: list them, repair one, or accept
    /// its loss with a note.
    #[command(subcommand)]
    Storage(StorageCmd),
    /// Fleet runs (`rvc run --target/--label/--clients/--all`): list them,
    /// show one, its targets, follow it, cancel, pause or resume it, or
    /// signal its running targets.
    #[command(subcommand)]
    Fleet(FleetCmd),
    /// Open a terminal on a client and show it here (its id is printed on
    /// stderr first): keys go to the remote shell, `~.` detaches and
    /// leaves it running, `~?` lists the escapes. rvc exits with the
    /// shell's status when it ends.
    Shell(Box<ShellArgs>),
    /// Show an open terminal from an output offset (the start by
    /// default) and type into it, as `shell` does after opening one.
    Attach {
        /// The terminal's id.
        terminal_id: String,
        /// Show the output after this byte offset (0: from the start).
        #[arg(long, default_value_t = 0, value_name = "OFFSET")]
        from: u64,
    },
    /// List terminals, newest first: every client's, or one client's.
    Terminals {
        /// A client id; absent: every client.
        client_id: Option<String>,
    },
    /// One terminal: close it, or replay its recording.
    #[command(subcommand)]
    Terminal(TerminalCmd),
    /// Print the completion script for a shell (bash, zsh or fish) to
    /// stdout, e.g. `rvc completions bash > /etc/bash_completion.d/rvc`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: CompletionShell,
    },
    /// Print rvc's manual page (roff) to stdout, e.g.
    /// `rvc man > /usr/local/share/man/man1/rvc.1`.
    Man,
}

#[derive(Debug, Subcommand)]
enum TerminalCmd {
    /// End a terminal: its client hangs up the shell, and every viewer
    /// sees the close.
    Close {
        /// The terminal's id.
        terminal_id: String,
    },
    /// Play a terminal's recording back on stdout with its pauses, or
    /// write it as it is (asciicast v2).
    Replay {
        /// The terminal's id.
        terminal_id: String,
        /// Play this many times as fast (0.5: half as fast); 0 plays
        /// without pauses.
        #[arg(long, default_value_t = 1.0, value_name = "X")]
        speed: f64,
        /// No pause longer than this (e.g. 2s).
        #[arg(long, value_name = "DURATION")]
        max_pause: Option<String>,
        /// Write the asciicast v2 document itself.
        #[arg(long)]
        raw: bool,
    },
}

#[derive(Debug, Subcommand)]
enum FleetCmd {
    /// Fleet runs, newest first.
    List {
        /// Continue from the token the previous page printed.
        #[arg(long, value_name = "TOKEN")]
        page: Option<String>,
        /// Rows per page (1-1000).
        #[arg(long, value_name = "N")]
        per_page: Option<u32>,
    },
    /// One run: what it runs, on which selection, at which rate, its
    /// counts by state and its slowest hosts.
    Show {
        /// The fleet run's id.
        run: String,
    },
    /// A run's targets by client id: state, result, time, command UUID.
    Targets {
        /// The fleet run's id.
        run: String,
        /// Only targets in this state: pending, queued, running,
        /// succeeded, failed, unreachable, cancelled or skipped.
        #[arg(long, value_name = "STATE")]
        state: Option<String>,
        /// Only targets whose client's labels match this selector now:
        /// `zone=eu-*`, `role!=db`, `!canary`; repeat it or join terms with
        /// commas (all must hold).
        #[arg(long = "label", value_name = "SELECTOR")]
        labels: Vec<String>,
    },
    /// Follow a run to its end, showing each host's output as it ends
    /// (rvc exits as `rvc run` does for a fleet).
    Follow {
        /// The fleet run's id.
        run: String,
        /// Continue after this change position (0: every target).
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        after: u64,
        /// Collapse hosts with identical output and exit status.
        #[arg(long)]
        group: bool,
        /// Write each host's output to files in DIR.
        #[arg(long, value_name = "DIR", conflicts_with = "group")]
        output_dir: Option<std::path::PathBuf>,
    },
    /// Stop a run: targets not yet running are cancelled, running ones
    /// get TERM.
    Cancel {
        /// The fleet run's id.
        run: String,
    },
    /// Release no new target until resumed (running ones go on).
    Pause {
        /// The fleet run's id.
        run: String,
    },
    /// Release targets of a paused run again.
    Resume {
        /// The fleet run's id.
        run: String,
    },
    /// Send a signal (TERM by default) to every running target.
    Kill {
        /// `[SIGNAL] RUN`.
        #[arg(num_args = 1..=2, value_names = ["SIGNAL", "RUN"])]
        args: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum ClientCmd {
    /// One client: its state, a claim another instance made while it was
    /// connected, a takeover grant, and its storage scopes that are not
    /// ready.
    Show {
        /// The client id.
        client_id: String,
    },
    /// Let exactly this instance (as `client show` prints it) take the
    /// client over at its next connection; the grant is one-shot and
    /// expires (session.takeover_grant_ttl, 5 minutes by default).
    Takeover {
        /// The client id.
        client_id: String,
        /// The claiming instance (UUID).
        instance_id: String,
    },
}

#[derive(Debug, Subcommand)]
enum StorageCmd {
    /// Open incidents, newest first (with --all, also the repaired and
    /// acknowledged ones).
    Incidents {
        /// Every state, not only open incidents.
        #[arg(long)]
        all: bool,
        /// Continue from the token the previous page printed.
        #[arg(long, value_name = "TOKEN")]
        page: Option<String>,
        /// Rows per page (1-1000).
        #[arg(long, value_name = "N")]
        per_page: Option<u32>,
    },
    /// Run an incident's safe repair (nothing committed is discarded); an
    /// incident that lost data is refused: acknowledge it instead.
    Repair {
        /// The incident's id.
        incident_id: String,
    },
    /// Accept an incident's loss with a note (kept in its history and
    /// audited); its scope serves again.
    Acknowledge {
        /// The incident's id.
        incident_id: String,
        /// Why the loss is accepted (1-4096 bytes).
        #[arg(long, value_name = "TEXT")]
        note: String,
    },
}

/// The shells completions are generated for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

/// Writes a completion script or the manual page generated from rvc's own
/// argument definitions (they cannot drift from what rvc accepts).
fn generate(cmd: &Cmd) -> Option<u8> {
    use clap::CommandFactory as _;
    let mut out = std::io::stdout().lock();
    let written = match cmd {
        Cmd::Completions { shell } => {
            let shell = match shell {
                CompletionShell::Bash => clap_complete::Shell::Bash,
                CompletionShell::Zsh => clap_complete::Shell::Zsh,
                CompletionShell::Fish => clap_complete::Shell::Fish,
            };
            clap_complete::generate(shell, &mut Cli::command(), "rvc", &mut out);
            Ok(())
        }
        Cmd::Man => clap_mangen::Man::new(Cli::command()).render(&mut out),
        _ => return None,
    };
    Some(
        match written.and_then(|()| std::io::Write::flush(&mut out)) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rvc: cannot write to stdout: {e}");
                exit::INTERNAL
            }
        },
    )
}

/// How long a stdin command waits for the client's acknowledgement.
#[derive(Debug, Args)]
struct WaitArgs {
    /// Return once the server has it durably; do not wait for the client.
    #[arg(long)]
    no_wait: bool,
    /// How long to wait for the client (e.g. 30s); the data stays durable
    /// and is written when the client gets it.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    wait_for: String,
}

impl WaitArgs {
    fn wait(&self) -> Result<Option<std::time::Duration>, Failure> {
        if self.no_wait {
            return Ok(None);
        }
        let ms = rvbox_config::units::parse_duration(&self.wait_for)
            .map_err(|e| Failure::usage(format!("--wait-for {:?}: {e}", self.wait_for)))?;
        Ok(Some(std::time::Duration::from_millis(ms)))
    }
}

#[derive(Debug, Args)]
struct ShellArgs {
    /// The client id.
    client_id: String,
    /// Working directory on the client (within its allowed roots).
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    /// Shell: sh, bash, cmd or powershell (the client's default when
    /// absent).
    #[arg(long, value_name = "TYPE")]
    shell: Option<String>,
    /// An environment variable for the shell (repeatable): K=V, or K for
    /// the value K has in rvc's own environment (kept out of rvc's argv);
    /// TERM is rvc's own unless given.
    #[arg(long = "env", value_name = "K=V|K")]
    env: Vec<String>,
    /// A resource profile the shell runs under, enforced by the client as
    /// for run (repeatable): light, cpu-low|medium|high,
    /// mem-low|medium|high, disk-low|medium|high.
    #[arg(long = "profile", value_name = "FLAG")]
    profiles: Vec<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Queue it and print its UUID; do not follow.
    #[arg(long)]
    background: bool,
    /// Working directory on the client (within its allowed roots).
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    /// Shell: sh, bash, cmd or powershell (the client's default when
    /// absent).
    #[arg(long, value_name = "TYPE")]
    shell: Option<String>,
    /// An environment variable for the command (repeatable): K=V, or K
    /// for the value K has in rvc's own environment (kept out of rvc's
    /// argv, which other local accounts can read).
    #[arg(long = "env", value_name = "K=V|K")]
    env: Vec<String>,
    /// A resource profile the client enforces (repeatable): light,
    /// cpu-low|medium|high, mem-low|medium|high, disk-low|medium|high.
    #[arg(long = "profile", value_name = "FLAG")]
    profiles: Vec<String>,
    /// How long the command may wait for its client (e.g. 15m; 0s: no
    /// limit); the server's default when absent.
    #[arg(long, value_name = "DURATION")]
    queue_ttl: Option<String>,
    /// Run this script file (at most 10 MiB; 256 KiB for a fleet)
    /// instead of command text: uploaded with the command, verified by
    /// the client, then run with the shell.
    #[arg(long, value_name = "PATH")]
    script: Option<std::path::PathBuf>,
    #[command(flatten)]
    fleet: fleet::FleetFlags,
    /// The client id, then the command text (words are joined with
    /// spaces). With --target, --label, --clients or --all there is no
    /// client id: every word is the command.
    #[arg(value_name = "CLIENT COMMAND", num_args = 0.., trailing_var_arg = true, allow_hyphen_values = true)]
    words: Vec<String>,
}

impl RunArgs {
    /// The client (none for a fleet) and the command words, checked.
    fn split(&self) -> Result<(Option<String>, Vec<String>), Failure> {
        let (client, command) = if self.fleet.is_fleet() {
            (None, self.words.clone())
        } else {
            let mut words = self.words.clone().into_iter();
            let client = words.next().ok_or_else(|| {
                Failure::usage(
                    "run takes CLIENT COMMAND..., or --target/--label/--clients/--all and COMMAND...",
                )
            })?;
            (Some(client), words.collect())
        };
        match (&self.script, command.is_empty()) {
            (None, true) => Err(Failure::usage("run needs a command (or --script PATH)")),
            (Some(_), false) => Err(Failure::usage(
                "run takes a command or --script PATH, not both",
            )),
            _ => Ok((client, command)),
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints help/version to stdout with exit 0 and usage
            // errors to stderr with 2
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let Some(command) = cli.command else {
        eprintln!("rvc: no operation given; see `rvc --help`");
        return ExitCode::from(2);
    };
    if let Some(code) = generate(&command) {
        return ExitCode::from(code);
    }
    match rvbox_config::units::parse_duration(&cli.retry_for) {
        Ok(ms) if std::time::Duration::from_millis(ms) <= conn::MAX_RETRY_FOR => {
            conn::set_retry_for(std::time::Duration::from_millis(ms));
        }
        Ok(_) => {
            eprintln!(
                "rvc: --retry-for {:?}: at most {} hours",
                cli.retry_for,
                conn::MAX_RETRY_FOR.as_secs() / 3600
            );
            return ExitCode::from(exit::USAGE);
        }
        Err(e) => {
            eprintln!("rvc: --retry-for {:?}: {e}", cli.retry_for);
            return ExitCode::from(exit::USAGE);
        }
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rvc: cannot start: {e}");
            return ExitCode::from(exit::INTERNAL);
        }
    };
    let format = cli.output;
    let status = rt.block_on(dispatch(&cli.socket, cli.request_id, format, command));
    ExitCode::from(match status {
        Ok(code) => code,
        Err(f) if format == Format::Json => f.report_json(),
        Err(f) => f.report(),
    })
}

/// The request id of this invocation: given, or a new UUIDv7.
fn request_id(given: Option<String>) -> Result<String, Failure> {
    match given {
        Some(text) => {
            rvbox_domain::ids::Uuid7::parse("--request-id", &text)
                .map_err(|e| Failure::usage(format!("--request-id: {e}")))?;
            Ok(text)
        }
        None => Ok(uuid::Uuid::now_v7().hyphenated().to_string()),
    }
}

async fn dispatch(
    socket: &str,
    given_id: Option<String>,
    fmt: Format,
    cmd: Cmd,
) -> Result<u8, Failure> {
    match cmd {
        Cmd::Run(args) => {
            // created before dialing, reused by every retry
            let id = request_id(given_id)?;
            let (client, words) = args.split()?;
            let Some(client_id) = client else {
                return run_fleet(socket, &id, &args, &words, fmt).await;
            };
            let mut req = run_request(&id, &args, &client_id, &words)?;
            let mut control = Control::new(socket);
            let resp = match &args.script {
                Some(path) => {
                    let s = script::load(path)?;
                    let size = s.descriptor.size_bytes;
                    let name = s.descriptor.display_basename.clone();
                    if let Some(spec) = req.spec.as_mut() {
                        spec.source = Some(wire::execution_spec::Source::Script(s.descriptor));
                    }
                    req.script = s.bytes;
                    let request_id = req.request_id.clone();
                    script::run_command(&mut control, req, size, &name)
                        .await
                        .map_err(|f| f.with_run_lookup(&request_id, &client_id))?
                }
                None => control
                    .retrying(|mut c| {
                        let req = req.clone();
                        async move { c.run_command(req).await }
                    })
                    .await
                    .map_err(|f| f.with_run_lookup(&req.request_id, &client_id))?,
            };
            if fmt == Format::Text {
                eprintln!("{}", resp.issue_uuid);
            }
            if args.background {
                emit(fmt, "RunCommandResponse", &resp, || {
                    format!("{}\n", resp.issue_uuid)
                })?;
                return Ok(0);
            }
            if fmt == Format::Json {
                emit(fmt, "RunCommandResponse", &resp, String::new)?;
            }
            follow::follow(&mut control, &resp.issue_uuid, 0, Some(&client_id), fmt).await
        }
        Cmd::Follow { issue_uuid, after } => {
            let mut control = Control::new(socket);
            follow::follow(&mut control, &issue_uuid, after, None, fmt).await
        }
        Cmd::Stat {
            client_id,
            issue_uuid,
            all,
            labels,
            target,
            page,
            per_page,
        } => {
            let mut control = Control::new(socket);
            let selector = labels.join(",");
            match (client_id, issue_uuid, all) {
                (client, Some(issue), _) => {
                    let r = command_of(&mut control, &issue, client.as_deref()).await?;
                    let claim = client_of(&mut control, &r.client_id).await?;
                    let resp = wire::GetCommandResponse { command: Some(r) };
                    emit(fmt, "GetCommandResponse", &resp, || {
                        resp.command
                            .as_ref()
                            .map(|c| render::command(c, &claim))
                            .unwrap_or_default()
                    })?;
                    Ok(0)
                }
                (Some(client), None, _) => {
                    if fmt == Format::Text {
                        let c = client_of(&mut control, &client).await?;
                        print!("{}", render::client(&c));
                        println!();
                    }
                    let q = Listing {
                        client_id: Some(client),
                        selector,
                        page,
                        per_page,
                    };
                    list(&mut control, q, fmt).await
                }
                (None, None, true) => {
                    let q = Listing {
                        client_id: None,
                        selector,
                        page,
                        per_page,
                    };
                    list(&mut control, q, fmt).await
                }
                (None, None, false) => {
                    let req = wire::ListClientsRequest {
                        request_id: String::new(),
                        page_size: per_page.unwrap_or(0),
                        page_token: page.unwrap_or_default(),
                        selector: selector.clone(),
                        client_glob: target.clone().unwrap_or_default(),
                    };
                    let resp = control
                        .retrying(|mut c| {
                            let req = req.clone();
                            async move { c.list_clients(req).await }
                        })
                        .await?;
                    emit(fmt, "ListClientsResponse", &resp, || {
                        let mut t = render::clients(&resp.clients);
                        if !resp.next_page_token.is_empty() {
                            t.push_str(&format!(
                                "more: rvc stat{}{} --page {}\n",
                                filter_flags(&selector),
                                target
                                    .as_ref()
                                    .map(|g| format!(" --target '{g}'"))
                                    .unwrap_or_default(),
                                resp.next_page_token
                            ));
                        }
                        t
                    })?;
                    Ok(0)
                }
            }
        }
        Cmd::List {
            client_id,
            labels,
            page,
            per_page,
        } => {
            let mut control = Control::new(socket);
            let q = Listing {
                client_id,
                selector: labels.join(","),
                page,
                per_page,
            };
            list(&mut control, q, fmt).await
        }
        Cmd::Output {
            client_id,
            issue_uuid,
            stream,
            timestamped,
            max_bytes,
            page,
            follow,
        } => {
            let mut control = Control::new(socket);
            let r = output::Request {
                client: client_id,
                issue: issue_uuid,
                streams: stream,
                timestamped,
                max_bytes,
                page,
                follow,
            };
            output::output(&mut control, r, fmt).await
        }
        Cmd::Kill { args } => {
            let (signal, client, issue) = kill_args(&args)?;
            let id = request_id(given_id)?;
            let mut control = Control::new(socket);
            // the command named must be the client's: a kill never lands
            // on another host's command by a mistyped client id
            command_of(&mut control, &issue, Some(&client)).await?;
            let req = wire::SignalCommandRequest {
                request_id: id,
                issue_uuid: issue.clone(),
                signal: signal as i32,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.signal_command(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "SignalCommandResponse", &resp, || {
                format!(
                    "{} {}: revision {}\n",
                    render::signal_name(signal),
                    issue,
                    resp.revision
                )
            })?;
            Ok(0)
        }
        Cmd::Append {
            client_id,
            issue_uuid,
            text,
            file,
            attach,
            raw,
            wait,
        } => {
            let source = match (text, file, attach) {
                (Some(text), _, _) => stdin::Source::Text {
                    text,
                    newline: !raw,
                },
                (None, Some(path), _) => stdin::Source::File(path),
                (None, None, _) => stdin::Source::Attach,
            };
            let wait = wait.wait()?;
            let mut control = Control::new(socket);
            stdin::append(
                &mut control,
                given_id,
                &client_id,
                &issue_uuid,
                source,
                wait,
                fmt,
            )
            .await
        }
        Cmd::CloseStdin {
            client_id,
            issue_uuid,
            wait,
        } => {
            let wait = wait.wait()?;
            let mut control = Control::new(socket);
            stdin::close(&mut control, given_id, &client_id, &issue_uuid, wait, fmt).await
        }
        Cmd::Shell(args) => {
            no_json(fmt, "shell")?;
            // created before dialing, reused by every retry: the
            // terminal's id
            let id = request_id(given_id)?;
            let open = open_request(&args)?;
            let mut control = Control::new(socket);
            terminal::shell(&mut control, id, open).await
        }
        Cmd::Attach { terminal_id, from } => {
            no_json(fmt, "attach")?;
            let mut control = Control::new(socket);
            terminal::view(&mut control, &terminal_id, from, None).await
        }
        Cmd::Terminals { client_id } => {
            let mut control = Control::new(socket);
            terminal::list(&mut control, client_id, fmt).await
        }
        Cmd::Terminal(cmd) => terminal_cmd(socket, given_id, fmt, cmd).await,
        Cmd::Storage(cmd) => storage(socket, given_id, fmt, cmd).await,
        Cmd::Fleet(cmd) => fleet_cmd(socket, given_id, fmt, cmd).await,
        Cmd::Client(cmd) => client(socket, given_id, fmt, cmd).await,
        // main writes these before any runtime exists
        c @ (Cmd::Completions { .. } | Cmd::Man) => Ok(generate(&c).unwrap_or(0)),
    }
}

/// One command's record, checked to belong to `client` when given.
async fn command_of(
    control: &mut Control,
    issue: &str,
    client: Option<&str>,
) -> Result<wire::CommandRecord, Failure> {
    let req = wire::GetCommandRequest {
        request_id: String::new(),
        issue_uuid: issue.to_owned(),
    };
    let resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.get_command(req).await }
        })
        .await?;
    let record = resp
        .command
        .ok_or_else(|| Failure::internal("GetCommand answered without a command"))?;
    if let Some(client) = client
        && record.client_id != client
    {
        return Err(Failure::not_found(format!(
            "command {issue} belongs to client {}, not {client}",
            record.client_id
        )));
    }
    Ok(record)
}

/// One client's registration.
async fn client_of(
    control: &mut Control,
    client_id: &str,
) -> Result<wire::GetClientResponse, Failure> {
    let req = wire::GetClientRequest {
        request_id: String::new(),
        client_id: client_id.to_owned(),
    };
    control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.get_client(req).await }
        })
        .await
}

async fn client(
    socket: &str,
    given_id: Option<String>,
    fmt: Format,
    cmd: ClientCmd,
) -> Result<u8, Failure> {
    let mut control = Control::new(socket);
    match cmd {
        ClientCmd::Show { client_id } => {
            let resp = client_of(&mut control, &client_id).await?;
            emit(fmt, "GetClientResponse", &resp, || render::client(&resp))?;
            Ok(0)
        }
        ClientCmd::Takeover {
            client_id,
            instance_id,
        } => {
            let req = wire::AuthorizeClientTakeoverRequest {
                request_id: request_id(given_id)?,
                client_id,
                client_instance_id: instance_id,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.authorize_client_takeover(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "AuthorizeClientTakeoverResponse", &resp, || {
                format!(
                    "{}: instance {} may take it over at its next connection, until {}\n",
                    resp.client_id,
                    resp.client_instance_id,
                    render::time_text(resp.grant_expiry_time.as_ref())
                )
            })?;
            Ok(0)
        }
    }
}

async fn storage(
    socket: &str,
    given_id: Option<String>,
    fmt: Format,
    cmd: StorageCmd,
) -> Result<u8, Failure> {
    let mut control = Control::new(socket);
    match cmd {
        StorageCmd::Incidents {
            all,
            page,
            per_page,
        } => {
            let req = wire::ListStorageIncidentsRequest {
                request_id: String::new(),
                page_size: per_page.unwrap_or(0),
                page_token: page.unwrap_or_default(),
                state: (!all).then_some(wire::IncidentState::Open as i32),
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.list_storage_incidents(req).await }
                })
                .await?;
            emit(fmt, "ListStorageIncidentsResponse", &resp, || {
                let mut t = render::incidents(&resp.incidents);
                if !resp.next_page_token.is_empty() {
                    let all = if all { " --all" } else { "" };
                    t.push_str(&format!(
                        "more: rvc storage incidents{all} --page {}\n",
                        resp.next_page_token
                    ));
                }
                t
            })?;
            Ok(0)
        }
        StorageCmd::Repair { incident_id } => {
            let req = wire::RepairStorageIncidentRequest {
                request_id: request_id(given_id)?,
                incident_id,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.repair_storage_incident(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "RepairStorageIncidentResponse", &resp, || {
                render::incidents(resp.incident.as_slice())
            })?;
            Ok(0)
        }
        StorageCmd::Acknowledge { incident_id, note } => {
            let req = wire::AcknowledgeStorageIncidentRequest {
                request_id: request_id(given_id)?,
                incident_id,
                note,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.acknowledge_storage_incident(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "AcknowledgeStorageIncidentResponse", &resp, || {
                render::incidents(resp.incident.as_slice())
            })?;
            Ok(0)
        }
    }
}

/// What `rvc list` (and `rvc stat CLIENT` / `--all`) asks for.
struct Listing {
    client_id: Option<String>,
    selector: String,
    page: Option<String>,
    per_page: Option<u32>,
}

/// The `--label` flag that repeats a selector in a "more:" hint.
fn filter_flags(selector: &str) -> String {
    if selector.is_empty() {
        String::new()
    } else {
        format!(" --label '{selector}'")
    }
}

async fn list(control: &mut Control, q: Listing, fmt: Format) -> Result<u8, Failure> {
    let Listing {
        client_id,
        selector,
        page,
        per_page,
    } = q;
    let req = wire::ListCommandsRequest {
        request_id: String::new(),
        client_id: client_id.clone(),
        page_size: per_page.unwrap_or(0),
        page_token: page.unwrap_or_default(),
        selector: selector.clone(),
    };
    let resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.list_commands(req).await }
        })
        .await?;
    emit(fmt, "ListCommandsResponse", &resp, || {
        let mut t = render::commands(&resp.commands);
        if !resp.next_page_token.is_empty() {
            let flags = filter_flags(&selector);
            match &client_id {
                Some(c) => t.push_str(&format!(
                    "more: rvc list {c}{flags} --page {}\n",
                    resp.next_page_token
                )),
                None => t.push_str(&format!(
                    "more: rvc list{flags} --page {}\n",
                    resp.next_page_token
                )),
            }
        }
        t
    })?;
    Ok(0)
}

fn parse_signal(text: &str) -> Option<wire::SignalKind> {
    let upper = text.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    Some(match name {
        "HUP" => wire::SignalKind::Hup,
        "INT" => wire::SignalKind::Int,
        "TERM" => wire::SignalKind::Term,
        "KILL" => wire::SignalKind::Kill,
        "USR1" => wire::SignalKind::Usr1,
        "USR2" => wire::SignalKind::Usr2,
        _ => return None,
    })
}

fn kill_args(args: &[String]) -> Result<(wire::SignalKind, String, String), Failure> {
    match args {
        [client, issue] => Ok((wire::SignalKind::Term, client.clone(), issue.clone())),
        [sig, client, issue] => {
            let kind = parse_signal(sig).ok_or_else(|| {
                Failure::usage(format!(
                    "unknown signal {sig:?}; use HUP, INT, TERM, KILL, USR1 or USR2 (SIG prefix optional)"
                ))
            })?;
            Ok((kind, client.clone(), issue.clone()))
        }
        _ => Err(Failure::usage("kill takes [SIGNAL] CLIENT UUID")),
    }
}

async fn fleet_cmd(
    socket: &str,
    given_id: Option<String>,
    fmt: Format,
    cmd: FleetCmd,
) -> Result<u8, Failure> {
    let mut control = Control::new(socket);
    match cmd {
        FleetCmd::List { page, per_page } => {
            let req = wire::ListFleetRunsRequest {
                request_id: String::new(),
                page_size: per_page.unwrap_or(0),
                page_token: page.unwrap_or_default(),
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.list_fleet_runs(req).await }
                })
                .await?;
            emit(fmt, "ListFleetRunsResponse", &resp, || {
                let mut t = fleet::runs_table(&resp.runs);
                if !resp.next_page_token.is_empty() {
                    t.push_str(&format!(
                        "more: rvc fleet list --page {}\n",
                        resp.next_page_token
                    ));
                }
                t
            })?;
            Ok(0)
        }
        FleetCmd::Show { run } => {
            let req = wire::GetFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: run.clone(),
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.get_fleet_run(req).await }
                })
                .await?;
            let targets = if fmt == Format::Text {
                fleet::all_targets(&mut control, &run, 0, "").await?
            } else {
                Vec::new()
            };
            emit(fmt, "GetFleetRunResponse", &resp, || {
                resp.run
                    .as_ref()
                    .map(|r| fleet::record_text(r, &targets))
                    .unwrap_or_default()
            })?;
            Ok(0)
        }
        FleetCmd::Targets { run, state, labels } => {
            let state = state
                .as_deref()
                .map(fleet::parse_state)
                .transpose()?
                .unwrap_or(0);
            let targets = fleet::all_targets(&mut control, &run, state, &labels.join(",")).await?;
            let resp = wire::ListFleetTargetsResponse {
                targets,
                next_page_token: String::new(),
            };
            emit(fmt, "ListFleetTargetsResponse", &resp, || {
                fleet::targets_table(&resp.targets)
            })?;
            Ok(0)
        }
        FleetCmd::Follow {
            run,
            after,
            group,
            output_dir,
        } => {
            let view = fleet::View { group, output_dir };
            fleet::watch(&mut control, &run, after, view, fmt).await
        }
        FleetCmd::Cancel { run } => {
            let req = wire::CancelFleetRunRequest {
                request_id: request_id(given_id)?,
                fleet_run_id: run,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.cancel_fleet_run(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "CancelFleetRunResponse", &resp, || {
                let summary = resp.run.as_ref().map(fleet::summary).unwrap_or_default();
                format!(
                    "cancelled {} target(s) before they ran; sent TERM to {}\n{summary}\n",
                    resp.cancelled, resp.signalled
                )
            })?;
            Ok(0)
        }
        FleetCmd::Pause { run } => {
            let req = wire::PauseFleetRunRequest {
                request_id: request_id(given_id)?,
                fleet_run_id: run,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.pause_fleet_run(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "PauseFleetRunResponse", &resp, || {
                resp.run.as_ref().map(fleet::state_line).unwrap_or_default()
            })?;
            Ok(0)
        }
        FleetCmd::Resume { run } => {
            let req = wire::ResumeFleetRunRequest {
                request_id: request_id(given_id)?,
                fleet_run_id: run,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.resume_fleet_run(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "ResumeFleetRunResponse", &resp, || {
                resp.run.as_ref().map(fleet::state_line).unwrap_or_default()
            })?;
            Ok(0)
        }
        FleetCmd::Kill { args } => {
            let (signal, run) = match args.as_slice() {
                [run] => (wire::SignalKind::Term, run.clone()),
                [sig, run] => (
                    parse_signal(sig).ok_or_else(|| {
                        Failure::usage(format!(
                            "unknown signal {sig:?}; use HUP, INT, TERM, KILL, USR1 or USR2 (SIG prefix optional)"
                        ))
                    })?,
                    run.clone(),
                ),
                _ => return Err(Failure::usage("fleet kill takes [SIGNAL] RUN")),
            };
            let req = wire::SignalFleetRunRequest {
                request_id: request_id(given_id)?,
                fleet_run_id: run,
                signal: signal as i32,
            };
            let resp = control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.signal_fleet_run(req).await }
                })
                .await
                .map_err(|f| f.with_request_id(&req.request_id))?;
            emit(fmt, "SignalFleetRunResponse", &resp, || {
                format!(
                    "sent {} to {} running target(s)\n",
                    render::signal_name(signal),
                    resp.signalled
                )
            })?;
            Ok(0)
        }
    }
}

/// `rvc run` on a fleet: the same spec, every target the flags select.
async fn run_fleet(
    socket: &str,
    id: &str,
    args: &RunArgs,
    words: &[String],
    fmt: Format,
) -> Result<u8, Failure> {
    let one = run_request(id, args, "fleet", words)?;
    let mut req = wire::RunFleetRequest {
        request_id: id.to_owned(),
        spec: one.spec,
        queue_ttl: one.queue_ttl,
        ..Default::default()
    };
    if let Some(path) = &args.script {
        let s = script::load(path)?;
        if let Some(spec) = req.spec.as_mut() {
            spec.source = Some(wire::execution_spec::Source::Script(s.descriptor));
        }
        req.script = s.bytes;
    }
    args.fleet.apply(&mut req)?;
    let mut control = Control::new(socket);
    fleet::run(&mut control, req, args.fleet.view(), args.background, fmt).await
}

/// `--shell TYPE`.
fn shell_type(text: Option<&str>) -> Result<wire::ShellType, Failure> {
    match text.map(str::to_ascii_lowercase).as_deref() {
        None => Ok(wire::ShellType::Unspecified),
        Some("sh") => Ok(wire::ShellType::Sh),
        Some("bash") => Ok(wire::ShellType::Bash),
        Some("cmd") => Ok(wire::ShellType::Cmd),
        Some("powershell") => Ok(wire::ShellType::Powershell),
        Some(other) => Err(Failure::usage(format!(
            "--shell {other:?}: use sh, bash, cmd or powershell"
        ))),
    }
}

/// `--env K=V` or `--env K`, repeated.
fn env_of(pairs: &[String]) -> Result<std::collections::BTreeMap<String, String>, Failure> {
    env_from(pairs, |k| std::env::var_os(k))
}

/// `--env K=V` gives K the value V; `--env K` gives it the value K has in
/// rvc's own environment, so a secret need not be in rvc's argv (which
/// other local accounts can read while rvc runs); an unset or non-UTF-8
/// K is a usage error naming it.
fn env_from(
    pairs: &[String],
    lookup: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<std::collections::BTreeMap<String, String>, Failure> {
    let mut env = std::collections::BTreeMap::new();
    for kv in pairs {
        let (k, v) = match kv.split_once('=') {
            Some((k, v)) => (k, v.to_owned()),
            None => {
                let Some(v) = lookup(kv) else {
                    return Err(Failure::usage(format!(
                        "--env {}: it is not set in rvc's environment (write KEY=VALUE, or set {} first)",
                        render::visible(kv),
                        render::visible(kv)
                    )));
                };
                let Ok(v) = v.into_string() else {
                    return Err(Failure::usage(format!(
                        "--env {}: its value in rvc's environment is not UTF-8",
                        render::visible(kv)
                    )));
                };
                (kv.as_str(), v)
            }
        };
        if k.is_empty() {
            return Err(Failure::usage(format!(
                "--env {}: the name is empty",
                render::visible(kv)
            )));
        }
        env.insert(k.to_owned(), v);
    }
    Ok(env)
}

/// `--profile FLAG`, repeated.
fn profile_flags(names: &[String]) -> Result<Vec<i32>, Failure> {
    let mut flags = Vec::new();
    for p in names {
        let name = format!("PROFILE_FLAG_{}", p.to_ascii_uppercase().replace('-', "_"));
        let flag = wire::ProfileFlag::from_str_name(&name)
            .filter(|f| *f != wire::ProfileFlag::Unspecified)
            .ok_or_else(|| {
                Failure::usage(format!(
                    "--profile {p:?}: use light, cpu-low, cpu-medium, cpu-high, mem-low, mem-medium, mem-high, disk-low, disk-medium or disk-high"
                ))
            })?;
        flags.push(flag as i32);
    }
    Ok(flags)
}

/// What `rvc shell` opens, checked before anything is sent.
fn open_request(args: &ShellArgs) -> Result<terminal::Open, Failure> {
    let shell_type = shell_type(args.shell.as_deref())?;
    let env = env_of(&args.env)?;
    let profile_flags = profile_flags(&args.profiles)?;
    Ok(terminal::Open {
        client: args.client_id.clone(),
        shell_type,
        cwd: args.cwd.clone().unwrap_or_default(),
        env,
        profile_flags,
    })
}

/// `shell` and `attach` draw a terminal: there is no JSON form of it.
fn no_json(fmt: Format, what: &str) -> Result<(), Failure> {
    if fmt == Format::Json {
        return Err(Failure::usage(format!(
            "rvc {what} shows a terminal and has no JSON output; `rvc terminals -o json` lists terminals and `rvc terminal replay --raw` gives a recording"
        )));
    }
    Ok(())
}

async fn terminal_cmd(
    socket: &str,
    given_id: Option<String>,
    fmt: Format,
    cmd: TerminalCmd,
) -> Result<u8, Failure> {
    match cmd {
        TerminalCmd::Close { terminal_id } => {
            let id = request_id(given_id)?;
            let mut control = Control::new(socket);
            terminal::close(&mut control, id, terminal_id, fmt).await
        }
        TerminalCmd::Replay {
            terminal_id,
            speed,
            max_pause,
            raw,
        } => {
            if !speed.is_finite() || speed < 0.0 {
                return Err(Failure::usage(format!(
                    "--speed {speed}: use a number of times as fast, 0 or more (0: no pauses)"
                )));
            }
            let max_pause_ms = max_pause
                .as_deref()
                .map(|t| {
                    rvbox_config::units::parse_duration(t)
                        .map_err(|e| Failure::usage(format!("--max-pause {t:?}: {e}")))
                })
                .transpose()?;
            let pace = replay::Pace {
                speed,
                max_pause_ms,
            };
            let mut control = Control::new(socket);
            replay::replay(&mut control, &terminal_id, pace, raw, fmt).await
        }
    }
}

fn run_request(
    id: &str,
    args: &RunArgs,
    client_id: &str,
    words: &[String],
) -> Result<wire::RunCommandRequest, Failure> {
    let shell_type = shell_type(args.shell.as_deref())?;
    let env = env_of(&args.env)?;
    let profile_flags = profile_flags(&args.profiles)?;
    let queue_ttl = match &args.queue_ttl {
        None => None,
        Some(text) => {
            let ms = rvbox_config::units::parse_duration(text)
                .map_err(|e| Failure::usage(format!("--queue-ttl {text:?}: {e}")))?;
            Some(prost_types::Duration {
                seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
                nanos: i32::try_from((ms % 1000) * 1_000_000).unwrap_or(0),
            })
        }
    };
    Ok(wire::RunCommandRequest {
        request_id: id.to_owned(),
        client_id: client_id.to_owned(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(words.join(" "))),
            shell_type: shell_type as i32,
            cwd: args.cwd.clone().unwrap_or_default(),
            env,
            profile_flags,
        }),
        script: Vec::new(),
        queue_ttl,
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn an_env_name_alone_takes_its_value_from_rvc_s_environment() {
        let lookup = |k: &str| (k == "TOKEN").then(|| std::ffi::OsString::from("s3cret=x"));
        let pairs = |p: &[&str]| p.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let env = env_from(&pairs(&["A=1", "TOKEN", "B="]), lookup).unwrap();
        assert_eq!(
            env.into_iter().collect::<Vec<_>>(),
            [
                ("A".to_owned(), "1".to_owned()),
                ("B".to_owned(), String::new()),
                ("TOKEN".to_owned(), "s3cret=x".to_owned())
            ]
        );
        let unset = env_from(&pairs(&["MISSING"]), lookup).unwrap_err();
        assert_eq!(unset.status(), 2);
        assert!(
            unset
                .message()
                .contains("--env MISSING: it is not set in rvc's environment"),
            "{}",
            unset.message()
        );
        let empty = env_from(&pairs(&["=v"]), lookup).unwrap_err();
        assert!(
            empty.message().contains("the name is empty"),
            "{}",
            empty.message()
        );
        let not_utf8 = env_from(&pairs(&["RAW"]), |_| {
            use std::os::unix::ffi::OsStringExt as _;
            Some(std::ffi::OsString::from_vec(vec![0xff]))
        })
        .unwrap_err();
        assert!(
            not_utf8.message().contains("is not UTF-8"),
            "{}",
            not_utf8.message()
        );
    }

    fn shell_args(args: &[&str]) -> ShellArgs {
        let cli = Cli::try_parse_from(["rvc", "shell"].iter().chain(args)).unwrap();
        match cli.command {
            Some(Cmd::Shell(a)) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shell_takes_resource_profiles_as_run_does() {
        let open = open_request(&shell_args(&[
            "web-1",
            "--profile",
            "mem-low",
            "--profile",
            "CPU-HIGH",
        ]))
        .unwrap();
        assert_eq!(open.client, "web-1");
        assert_eq!(
            open.profile_flags,
            vec![
                wire::ProfileFlag::MemLow as i32,
                wire::ProfileFlag::CpuHigh as i32
            ]
        );
        let none = open_request(&shell_args(&["web-1"])).unwrap();
        assert!(none.profile_flags.is_empty());
        let bad = open_request(&shell_args(&["web-1", "--profile", "turbo"])).unwrap_err();
        assert!(bad.message().contains("--profile \"turbo\""), "{bad:?}");
    }

    #[test]
    fn signals_take_an_optional_prefix_in_any_case() {
        assert_eq!(parse_signal("sigkill"), Some(wire::SignalKind::Kill));
        assert_eq!(parse_signal("USR2"), Some(wire::SignalKind::Usr2));
        assert_eq!(parse_signal("SIGSTOP"), None);
    }
}
