//! I/O side shared by the two RVBox daemons (`rvbox-server`, `rvbox`).
//!
//! Owns: the real [`HostProbe`] (stat, canonicalize, effective uid, host
//! name), the command-line flags generated from the configuration key
//! registry, reading the one configuration file, `--check-config`,
//! tracing set-up, the manual page, and the systemd service notifications
//! ([`notify`]).
//!
//! Must never: decide what a configuration means (that is `rvbox-config`),
//! read the process environment into a configuration, open a store, bind a
//! listener or launch a child.

pub mod notify;

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use rvbox_config::registry::{Daemon, Kind};
use rvbox_config::{
    ClientConfig, ConfigErrors, FileKind, FileStat, FlagValue, HostProbe, LogFormat, LogLevel,
    ObservabilityConfig, ServerConfig, load_client, load_server,
};

/// Exit status: success.
pub const EXIT_OK: i32 = 0;
/// Exit status: the configuration is invalid or unreadable.
pub const EXIT_CONFIG: i32 = 2;

/// Largest configuration file read (bytes); a longer file is refused
/// before it is held in memory.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1024 * 1024;

/// Clap argument id of `--config`.
pub const ARG_CONFIG: &str = "config";
/// Clap argument id of `--check-config`.
pub const ARG_CHECK_CONFIG: &str = "check-config";

/// The real host, read through the filesystem and `/proc`. It never reads
/// the process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealHost;

impl HostProbe for RealHost {
    fn stat(&self, path: &Path) -> Result<Option<FileStat>, String> {
        match std::fs::metadata(path) {
            Ok(meta) => {
                let ft = meta.file_type();
                let kind = if ft.is_dir() {
                    FileKind::Dir
                } else if ft.is_file() {
                    FileKind::Regular
                } else if ft.is_socket() {
                    FileKind::Socket
                } else {
                    FileKind::Other
                };
                Ok(Some(FileStat {
                    kind,
                    mode: meta.mode() & 0o7777,
                    uid: meta.uid(),
                    dev: meta.dev(),
                    ino: meta.ino(),
                    size: meta.size(),
                    mtime_ns: i128::from(meta.mtime()) * 1_000_000_000
                        + i128::from(meta.mtime_nsec()),
                }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    fn canonicalize(&self, path: &Path) -> Result<PathBuf, String> {
        std::fs::canonicalize(path).map_err(|e| e.to_string())
    }

    fn current_uid(&self) -> u32 {
        effective_uid().unwrap_or(u32::MAX)
    }

    fn host_name(&self) -> Option<String> {
        let text = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
        let name = text.trim();
        (!name.is_empty()).then(|| name.to_owned())
    }
}

/// The effective uid from `/proc/self/status` (`Uid: real effective ...`).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

fn value_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Duration => "DURATION",
        Kind::Bytes => "BYTES",
        Kind::Count => "N",
        Kind::Bool => "BOOL",
        Kind::Choice(_) => "WORD",
        Kind::Path | Kind::OptionalPath | Kind::PathList | Kind::ForeignPath => "PATH",
        Kind::UrlList => "URL",
        Kind::SocketAddr | Kind::OptionalSocketAddr => "ADDR",
        Kind::Text | Kind::TextList => "TEXT",
        Kind::Labels => "KEY=VALUE",
    }
}

/// Adds one long flag per registry key of `daemon` (`storage.data_dir` ->
/// `--storage-data-dir`). The flags have no defaults: only flags actually
/// given override the file.
pub fn add_config_flags(mut cmd: Command, daemon: Daemon) -> Command {
    for def in daemon.keys() {
        let action = if def.kind.is_list() {
            ArgAction::Append
        } else {
            ArgAction::Set
        };
        cmd = cmd.arg(
            Arg::new(def.path)
                .long(def.flag_name())
                .value_name(value_name(def.kind))
                .help(def.doc)
                .help_heading("Configuration overrides (take precedence over the file)")
                .num_args(1)
                .allow_hyphen_values(true)
                .action(action),
        );
    }
    cmd
}

/// The full command line of a daemon: `--config`, `--check-config`,
/// `--help`, `--version` and every registry flag.
pub fn daemon_command(daemon: Daemon, about: &'static str) -> Command {
    let cmd = Command::new(daemon.binary())
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .arg(
            Arg::new(ARG_CONFIG)
                .long("config")
                .value_name("FILE")
                .help(format!("Configuration file [default: {}]", daemon.default_config_path()))
                .num_args(1)
                .action(ArgAction::Set),
        )
        .arg(
            Arg::new(ARG_CHECK_CONFIG)
                .long("check-config")
                .value_name("FILE")
                .help("Validate FILE exactly as at start-up, print the effective configuration and exit (0 valid, 2 invalid); touches no state")
                .num_args(1)
                .conflicts_with(ARG_CONFIG)
                .action(ArgAction::Set),
        );
    add_config_flags(cmd, daemon)
}

/// Name of the `man` subcommand of both daemons.
pub const MAN_SUBCOMMAND: &str = "man";

/// The `man` subcommand: prints the daemon's manual page.
pub fn man_command() -> Command {
    Command::new(MAN_SUBCOMMAND)
        .about("Print this program's manual page (roff, section 8) to stdout and exit")
}

/// Writes the manual page (section 8: a system daemon) of `cmd`, generated
/// from the same clap definition the daemon parses its command line with.
///
/// # Errors
/// Writing to `out` failed.
pub fn write_man_page(cmd: Command, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    clap_mangen::Man::new(cmd).section("8").render(out)
}

/// `man`: prints the manual page of `cmd` to stdout; the exit status.
pub fn print_man_page(cmd: Command) -> i32 {
    let mut out = std::io::stdout().lock();
    match write_man_page(cmd, &mut out).and_then(|()| std::io::Write::flush(&mut out)) {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("cannot write the manual page: {e}");
            1
        }
    }
}

/// The registry flags that were given on the command line (and only those).
pub fn given_flags(matches: &ArgMatches, daemon: Daemon) -> Vec<FlagValue> {
    let mut out = Vec::new();
    for def in daemon.keys() {
        if matches.value_source(def.path) != Some(ValueSource::CommandLine) {
            continue;
        }
        let values: Vec<String> = matches
            .get_many::<String>(def.path)
            .map(|v| v.cloned().collect())
            .unwrap_or_default();
        out.push(FlagValue {
            key: def.path.to_owned(),
            values,
        });
    }
    out
}

/// Why a configuration could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read, is too large, or is not UTF-8.
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The configuration is invalid.
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every error found.
        errors: ConfigErrors,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Read { path, reason } => write!(f, "{}: {reason}", path.display()),
            LoadError::Invalid { path, errors } => {
                f.write_str(errors.render(&path.display().to_string()).trim_end())
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// Reads exactly one configuration file as UTF-8, bounded in size.
pub fn read_config_file(path: &Path) -> Result<String, LoadError> {
    let read_err = |reason: String| LoadError::Read {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path)
        .map_err(|e| read_err(format!("cannot read configuration file: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| read_err(format!("cannot read configuration file: {e}")))?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_CONFIG_FILE_BYTES {
        return Err(read_err(format!(
            "configuration file is larger than {MAX_CONFIG_FILE_BYTES} bytes"
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        read_err(format!(
            "configuration file is not valid UTF-8 (first invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Reads and validates a server configuration with the given flags.
pub fn load_server_config(
    path: &Path,
    flags: &[FlagValue],
    probe: &dyn HostProbe,
) -> Result<ServerConfig, LoadError> {
    let text = read_config_file(path)?;
    load_server(&path.display().to_string(), &text, flags, probe).map_err(|errors| {
        LoadError::Invalid {
            path: path.to_path_buf(),
            errors,
        }
    })
}

/// Reads and validates a client configuration with the given flags.
pub fn load_client_config(
    path: &Path,
    flags: &[FlagValue],
    probe: &dyn HostProbe,
) -> Result<ClientConfig, LoadError> {
    let text = read_config_file(path)?;
    load_client(&path.display().to_string(), &text, flags, probe).map_err(|errors| {
        LoadError::Invalid {
            path: path.to_path_buf(),
            errors,
        }
    })
}

/// A validated configuration of either daemon.
#[derive(Debug, Clone)]
pub enum Loaded {
    /// `rvbox-server`.
    Server(Box<ServerConfig>),
    /// `rvbox`.
    Client(Box<ClientConfig>),
}

impl Loaded {
    /// The effective-configuration summary.
    pub fn summary(&self) -> &str {
        match self {
            Loaded::Server(c) => c.summary(),
            Loaded::Client(c) => c.summary(),
        }
    }

    /// Conspicuous warnings.
    pub fn warnings(&self) -> &[String] {
        match self {
            Loaded::Server(c) => c.warnings(),
            Loaded::Client(c) => c.warnings(),
        }
    }

    /// `[observability]`.
    pub fn observability(&self) -> &ObservabilityConfig {
        match self {
            Loaded::Server(c) => &c.observability,
            Loaded::Client(c) => &c.observability,
        }
    }
}

/// Loads `path` for `daemon` with the flags given in `matches`: the one
/// production path used by a start and by `--check-config`.
pub fn load(daemon: Daemon, path: &Path, matches: &ArgMatches) -> Result<Loaded, LoadError> {
    let flags = given_flags(matches, daemon);
    match daemon {
        Daemon::Server => {
            load_server_config(path, &flags, &RealHost).map(|c| Loaded::Server(Box::new(c)))
        }
        Daemon::Client => {
            load_client_config(path, &flags, &RealHost).map(|c| Loaded::Client(Box::new(c)))
        }
    }
}

/// `--check-config`: prints the summary to stdout and returns
/// [`EXIT_OK`], or prints every error to stderr (one per line) and returns
/// [`EXIT_CONFIG`]. Opens no store, binds nothing, changes nothing.
pub fn check_config(daemon: Daemon, path: &Path, matches: &ArgMatches) -> i32 {
    match load(daemon, path, matches) {
        Ok(loaded) => {
            print!("{}", loaded.summary());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("{e}");
            eprintln!(
                "{}: configuration {} is invalid",
                daemon.binary(),
                path.display()
            );
            EXIT_CONFIG
        }
    }
}

/// Libraries whose trace lines carry whole frames, bodies or queries
/// (tungstenite logs every WebSocket frame, so command text and
/// environment values would reach the log): never below `debug`,
/// whatever `observability.log_level` says.
pub const PAYLOAD_LOGGING_CRATES: [&str; 10] = [
    "tungstenite",
    "tokio_tungstenite",
    "h2",
    "hyper",
    "hyper_util",
    "tonic",
    "tower",
    "rustls",
    "tokio_postgres",
    "postgres",
];

/// The log filter of `level`: that level for everything, at most `debug`
/// for [`PAYLOAD_LOGGING_CRATES`].
#[must_use]
pub fn log_filter(level: tracing::Level) -> tracing_subscriber::EnvFilter {
    let capped = level.min(tracing::Level::DEBUG);
    let mut directives = vec![level.as_str().to_ascii_lowercase()];
    for c in PAYLOAD_LOGGING_CRATES {
        directives.push(format!("{c}={}", capped.as_str().to_ascii_lowercase()));
    }
    tracing_subscriber::EnvFilter::builder().parse_lossy(directives.join(","))
}

/// Installs the global tracing subscriber on stderr per `[observability]`.
/// Harmless when one is already installed.
pub fn init_tracing(config: &ObservabilityConfig) {
    let level = match config.log_level {
        LogLevel::Error => tracing::Level::ERROR,
        LogLevel::Warn => tracing::Level::WARN,
        LogLevel::Info => tracing::Level::INFO,
        LogLevel::Debug => tracing::Level::DEBUG,
        LogLevel::Trace => tracing::Level::TRACE,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(log_filter(level))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match config.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// The start-up of a daemon up to its runtime: `--check-config` when
/// asked (its status as the error), else the configuration gate, tracing,
/// the warnings and the effective-configuration summary. `Ok` carries the
/// validated configuration; `Err` the exit status to return at once.
///
/// # Errors
/// The exit status when the daemon must not run: [`EXIT_OK`] or
/// [`EXIT_CONFIG`] after `--check-config`, [`EXIT_CONFIG`] for an invalid
/// configuration.
pub fn start(daemon: Daemon, matches: &ArgMatches) -> Result<Loaded, i32> {
    if let Some(path) = matches.get_one::<String>(ARG_CHECK_CONFIG) {
        return Err(check_config(daemon, Path::new(path), matches));
    }
    let path = matches.get_one::<String>(ARG_CONFIG).map_or_else(
        || PathBuf::from(daemon.default_config_path()),
        PathBuf::from,
    );
    let loaded = match load(daemon, &path, matches) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            eprintln!(
                "{}: configuration {} is invalid",
                daemon.binary(),
                path.display()
            );
            return Err(EXIT_CONFIG);
        }
    };
    init_tracing(loaded.observability());
    for w in loaded.warnings() {
        tracing::warn!("{w}");
    }
    tracing::info!(config = %loaded.summary(), "effective configuration");
    Ok(loaded)
}
