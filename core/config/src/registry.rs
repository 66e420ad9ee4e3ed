//! The key registry: one static table per daemon that names every
//! configuration key once. Decoding, defaults, flag generation, the
//! effective-configuration summary, the reference documentation test and
//! the example-file test are all driven by these tables (plan §4.3 item 3).

use rvbox_domain::limits as l;

/// Which daemon a configuration belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Daemon {
    /// `rvbox-server`.
    Server,
    /// `rvbox` (the client daemon).
    Client,
}

impl Daemon {
    /// The binary name.
    pub fn binary(self) -> &'static str {
        match self {
            Daemon::Server => "rvbox-server",
            Daemon::Client => "rvbox",
        }
    }

    /// The registry of this daemon's keys.
    pub fn keys(self) -> &'static [KeyDef] {
        match self {
            Daemon::Server => SERVER_KEYS,
            Daemon::Client => CLIENT_KEYS,
        }
    }

    /// The compiled default configuration file path.
    pub fn default_config_path(self) -> &'static str {
        match self {
            Daemon::Server => "/etc/rvbox/server.toml",
            Daemon::Client => "/etc/rvbox/client.toml",
        }
    }
}

/// What kind of value a key takes; decides how TOML text and flag text are
/// parsed and how the summary renders it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A duration string with a unit (`"10s"`); never a bare number.
    Duration,
    /// A byte size: non-negative TOML integer or IEC string (`"64KiB"`).
    Bytes,
    /// A non-negative TOML integer.
    Count,
    /// A TOML boolean.
    Bool,
    /// Free text (validated by the section's rules).
    Text,
    /// One of a fixed set of words.
    Choice(&'static [&'static str]),
    /// An absolute path on this host.
    Path,
    /// An absolute path on this host, or `""` for none.
    OptionalPath,
    /// A list of absolute paths.
    PathList,
    /// A list of `ws://` / `wss://` URLs, in order of preference.
    UrlList,
    /// A list of text values.
    TextList,
    /// A socket address `ip:port`.
    SocketAddr,
    /// A socket address, or `""` for disabled.
    OptionalSocketAddr,
    /// A path on another platform (Windows): syntax-checked only, `""` unset.
    ForeignPath,
    /// A table of `key = "value"` labels (held as sorted `key=value`
    /// items; a flag gives one `key=value` per occurrence).
    Labels,
}

impl Kind {
    /// A short name for documentation and messages.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Duration => "duration",
            Kind::Bytes => "byte size",
            Kind::Count => "integer",
            Kind::Bool => "boolean",
            Kind::Text => "string",
            Kind::Choice(_) => "choice",
            Kind::Path => "path",
            Kind::OptionalPath => "path or \"\"",
            Kind::PathList => "list of paths",
            Kind::UrlList => "list of URLs",
            Kind::TextList => "list of strings",
            Kind::SocketAddr => "socket address",
            Kind::OptionalSocketAddr => "socket address or \"\"",
            Kind::ForeignPath => "Windows path or \"\"",
            Kind::Labels => "table of labels",
        }
    }

    /// True for kinds that hold a list (flags may repeat).
    pub fn is_list(self) -> bool {
        matches!(
            self,
            Kind::PathList | Kind::UrlList | Kind::TextList | Kind::Labels
        )
    }

    /// True for the numeric kinds (duration, bytes, count).
    pub fn is_numeric(self) -> bool {
        matches!(self, Kind::Duration | Kind::Bytes | Kind::Count)
    }
}

/// The compiled default of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultValue {
    /// Milliseconds, bytes or a count, by the key's kind.
    Num(u64),
    /// A boolean.
    Bool(bool),
    /// Text (including paths and addresses); `""` means unset.
    Text(&'static str),
    /// A list.
    List(&'static [&'static str]),
    /// The host name reported by the host probe (the client id).
    HostName,
}

/// The upper bound of a numeric key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// No upper bound beyond what the value type holds.
    None,
    /// A v1 hard ceiling: part of the wire contract, may be lowered, never
    /// raised.
    Ceiling(u64),
    /// A sanity maximum of this implementation.
    Max(u64),
}

impl Limit {
    /// The bound, if any.
    pub fn value(self) -> Option<u64> {
        match self {
            Limit::None => None,
            Limit::Ceiling(v) | Limit::Max(v) => Some(v),
        }
    }
}

/// What zero means for a numeric key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero {
    /// Zero is refused.
    Refused,
    /// Zero is allowed and means this (e.g. "disables age reclamation").
    Means(&'static str),
}

/// One configuration key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDef {
    /// Dotted path, `section.key`.
    pub path: &'static str,
    /// Value kind.
    pub kind: Kind,
    /// Compiled default.
    pub default: DefaultValue,
    /// Lowest allowed nonzero value of a numeric key.
    pub min: u64,
    /// Upper bound of a numeric key.
    pub limit: Limit,
    /// What zero means.
    pub zero: Zero,
    /// Never print the value (the summary shows `<redacted>`).
    pub redact: bool,
    /// One-line meaning, used by the documentation and the examples.
    pub doc: &'static str,
}

impl KeyDef {
    const fn base(
        path: &'static str,
        kind: Kind,
        default: DefaultValue,
        doc: &'static str,
    ) -> Self {
        Self {
            path,
            kind,
            default,
            min: 1,
            limit: Limit::None,
            zero: Zero::Refused,
            redact: false,
            doc,
        }
    }

    /// A duration key with a default in milliseconds.
    pub const fn duration(path: &'static str, default_ms: u64, doc: &'static str) -> Self {
        Self::base(path, Kind::Duration, DefaultValue::Num(default_ms), doc)
    }

    /// A byte-size key.
    pub const fn bytes(path: &'static str, default: u64, doc: &'static str) -> Self {
        Self::base(path, Kind::Bytes, DefaultValue::Num(default), doc)
    }

    /// A count key.
    pub const fn count(path: &'static str, default: u64, doc: &'static str) -> Self {
        Self::base(path, Kind::Count, DefaultValue::Num(default), doc)
    }

    /// A boolean key.
    pub const fn boolean(path: &'static str, default: bool, doc: &'static str) -> Self {
        Self::base(path, Kind::Bool, DefaultValue::Bool(default), doc)
    }

    /// A text-like key (text, path, address, choice, foreign path).
    pub const fn text(
        path: &'static str,
        kind: Kind,
        default: &'static str,
        doc: &'static str,
    ) -> Self {
        Self::base(path, kind, DefaultValue::Text(default), doc)
    }

    /// A list key.
    pub const fn list(
        path: &'static str,
        kind: Kind,
        default: &'static [&'static str],
        doc: &'static str,
    ) -> Self {
        Self::base(path, kind, DefaultValue::List(default), doc)
    }

    /// Sets a v1 hard ceiling.
    pub const fn ceiling(mut self, ceiling: u64) -> Self {
        self.limit = Limit::Ceiling(ceiling);
        self
    }

    /// Sets a sanity maximum.
    pub const fn max(mut self, max: u64) -> Self {
        self.limit = Limit::Max(max);
        self
    }

    /// Sets the lowest allowed nonzero value.
    pub const fn min(mut self, min: u64) -> Self {
        self.min = min;
        self
    }

    /// Allows zero, with its meaning.
    pub const fn zero_means(mut self, meaning: &'static str) -> Self {
        self.zero = Zero::Means(meaning);
        self
    }

    /// The section (the part before the first dot).
    pub fn section(&self) -> &'static str {
        self.path.split_once('.').map_or(self.path, |(s, _)| s)
    }

    /// The key name inside its section.
    pub fn name(&self) -> &'static str {
        self.path.split_once('.').map_or(self.path, |(_, k)| k)
    }

    /// The generated long flag name without the leading dashes:
    /// `storage.data_dir` -> `storage-data-dir`.
    pub fn flag_name(&self) -> String {
        self.path.replace(['.', '_'], "-")
    }
}

/// The default configuration file directory's policy is documented in
/// docs/configuration.md; these non-numeric defaults are not wire limits.
pub mod defaults {
    /// Default agent listener (nginx terminates TLS and proxies here).
    pub const AGENT_LISTEN: &str = "127.0.0.1:7700";
    /// Default HTTP path of the agent WebSocket endpoint.
    pub const AGENT_PATH: &str = "/rvbox/agent";
    /// Default server data directory.
    pub const SERVER_DATA_DIR: &str = "/var/lib/rvbox-server";
    /// Default control runtime directory.
    pub const CONTROL_RUNTIME_DIR: &str = "/run/rvbox-server";
    /// Default control socket.
    pub const CONTROL_SOCKET: &str = "/run/rvbox-server/control.sock";
    /// Default client state directory.
    pub const CLIENT_STATE_DIR: &str = "/var/lib/rvbox";
    /// Default ordered server URL list.
    pub const SERVER_URLS: &[&str] = &["wss://localhost/rvbox/agent"];
    /// Most server URLs a client may list.
    pub const MAX_SERVER_URLS: u64 = 16;
    /// Most allowed CWD roots.
    pub const MAX_CWD_ROOTS: u64 = 64;
    /// Most allowed WebSocket origins.
    pub const MAX_ALLOWED_ORIGINS: u64 = 64;
    /// Longest Unix socket path (`sun_path` holds 108 bytes with the NUL).
    pub const MAX_SOCKET_PATH_BYTES: usize = 107;
}

const SYNC_CHOICES: &[&str] = &["full", "extra"];
const IDENTITY_CHOICES: &[&str] = &["self-reported", "tls-client-cert"];
const STORE_CHOICES: &[&str] = &["sqlite", "postgres"];
const LOG_LEVELS: &[&str] = &["error", "warn", "info", "debug", "trace"];
const LOG_FORMATS: &[&str] = &["text", "json"];
/// Shell names accepted by `shells.default`.
pub const SHELL_CHOICES: &[&str] = &["sh", "bash", "cmd", "powershell"];

/// Every `rvbox-server` key, in summary order (most important first within
/// each section).
pub static SERVER_KEYS: &[KeyDef] = &[
    // [server]
    KeyDef::text("server.agent_listen", Kind::SocketAddr, defaults::AGENT_LISTEN,
        "Address the agent WebSocket listener binds (plain HTTP; nginx terminates TLS in front of it)."),
    KeyDef::text("server.agent_path", Kind::Text, defaults::AGENT_PATH,
        "HTTP path of the agent WebSocket endpoint; must start with '/'."),
    KeyDef::list("server.allowed_origins", Kind::TextList, &[],
        "Origins (scheme://host[:port]) allowed on a WebSocket upgrade. Agents send no Origin header; an upgrade that carries an Origin not listed here is refused.")
        .max(defaults::MAX_ALLOWED_ORIGINS),
    KeyDef::text("server.client_identity", Kind::Choice(IDENTITY_CHOICES), "self-reported",
        "How a client's identity is established: self-reported (the plan's v1 behaviour: the client_id of the hello is believed; any host that reaches the agent endpoint can claim any client id) or tls-client-cert (nginx verifies a client certificate and passes its subject in server.client_cert_header; a hello whose client_id is not the certificate's CN is refused, and only connections from server.trusted_proxies are accepted)."),
    KeyDef::text("server.client_cert_header", Kind::Text, "x-rvbox-client-subject",
        "When server.client_identity is tls-client-cert: the request header carrying the verified certificate's subject DN (nginx: $ssl_client_s_dn); trusted only from server.trusted_proxies."),
    KeyDef::list("server.trusted_proxies", Kind::TextList, &[],
        "When server.client_identity is tls-client-cert: the IP addresses of the TLS proxies (nginx) whose client-certificate header is believed; an upgrade from any other address is refused. Required (at least one) in that mode.")
        .max(defaults::MAX_ALLOWED_ORIGINS),
    KeyDef::text("server.store", Kind::Choice(STORE_CHOICES), "sqlite",
        "Where the server stores everything: sqlite (one server, storage.data_dir) or postgres (one of several replicas sharing the database named by postgres.conninfo; docs/scaleout.md)."),
    // [postgres]
    KeyDef::text("postgres.conninfo", Kind::Text, "",
        "PostgreSQL connection string (key=value, e.g. \"host=/run/postgresql dbname=rvbox user=rvbox\"), required when server.store = \"postgres\". It must not hold a password: name a file in postgres.password_file."),
    KeyDef::text("postgres.password_file", Kind::OptionalPath, "",
        "File holding the PostgreSQL password (its first line), readable by the server alone (mode 0600 or 0400); \"\" for none (peer or certificate authentication)."),
    // [storage]
    KeyDef::text("storage.data_dir", Kind::Path, defaults::SERVER_DATA_DIR,
        "Private directory holding the SQLite database (db/), output segments (segments/) and audit segments (audit/)."),
    KeyDef::text("storage.sqlite_synchronous", Kind::Choice(SYNC_CHOICES), "full",
        "SQLite synchronous mode: full or extra (both are durable on power loss)."),
    KeyDef::bytes("storage.command_output_window", l::DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
        "Compressed rolling output window kept per command; older output is dropped with a truncation record. At least one sealed segment plus one incoming chunk.")
        .min(l::MIN_COMMAND_OUTPUT_WINDOW_BYTES),
    KeyDef::bytes("storage.command_total", l::DEFAULT_COMMAND_TOTAL_BYTES,
        "Total stored bytes per command, all kinds together (the command quota)."),
    KeyDef::bytes("storage.per_client_total", l::DEFAULT_SERVER_PER_CLIENT_BYTES,
        "Stored command bytes per client."),
    KeyDef::bytes("storage.server_total", l::DEFAULT_SERVER_TOTAL_BYTES,
        "Server-wide stored command bytes."),
    KeyDef::bytes("storage.closeout_reserve", l::DEFAULT_CLOSEOUT_RESERVE_BYTES,
        "Bytes reserved inside every accepted command's quota for terminal and loss closeout metadata."),
    KeyDef::duration("storage.terminal_retention", l::DEFAULT_TERMINAL_RETENTION_MS,
        "Age after which a terminal command is reclaimed.")
        .zero_means("age reclamation is disabled (only quotas reclaim)"),
    KeyDef::duration("storage.scrub_interval", l::DEFAULT_SCRUB_INTERVAL_MS,
        "Time from the end of one background scrub cycle (re-verification of every sealed segment, the orphan sweep, the counter recount) to the start of the next; a cycle also starts at every start.")
        .zero_means("only the cycle that follows each start runs"),
    KeyDef::bytes("storage.free_space_floor", l::DEFAULT_SERVER_FREE_SPACE_FLOOR_BYTES,
        "Emergency filesystem free-space floor; below it the server refuses new output."),
    KeyDef::count("storage.tombstones", l::DEFAULT_SERVER_TOMBSTONES,
        "Length of the compact command tombstone FIFO.")
        .ceiling(l::MAX_TOMBSTONES),
    KeyDef::bytes("storage.segment_seal_size", l::DEFAULT_SEGMENT_SEAL_BYTES,
        "An active output segment is sealed when it reaches this size."),
    KeyDef::duration("storage.group_commit_max_delay", l::DEFAULT_GROUP_COMMIT_MAX_DELAY_MS,
        "Longest a group commit waits to batch more appends.")
        .max(l::SECOND_MS),
    KeyDef::count("storage.group_commit_max_batch", l::DEFAULT_GROUP_COMMIT_MAX_BATCH,
        "Most appends in one group commit.")
        .ceiling(l::MAX_GROUP_COMMIT_BATCH),
    // [audit]
    KeyDef::bytes("audit.max_bytes", l::DEFAULT_AUDIT_BYTES,
        "Audit storage budget; the oldest audit segments rotate out when it is full."),
    KeyDef::duration("audit.retention", l::DEFAULT_AUDIT_RETENTION_MS,
        "Age after which audit records rotate out.")
        .zero_means("age rotation is disabled (quota-only rotation)"),
    // [queue]
    KeyDef::duration("queue.ttl", l::DEFAULT_QUEUE_TTL_MS,
        "How long a command may wait for server-confirmed acceptance before it expires.")
        .zero_means("commands wait indefinitely"),
    KeyDef::count("queue.max_per_client", l::DEFAULT_SERVER_QUEUE_PER_CLIENT,
        "Commands the server holds queued for one client."),
    KeyDef::count("queue.max_total", l::DEFAULT_SERVER_QUEUE_TOTAL,
        "Commands the server holds queued across all clients."),
    KeyDef::duration("queue.retry_initial", l::DEFAULT_DISPATCH_RETRY_INITIAL_MS,
        "First backoff after a transient dispatch rejection."),
    KeyDef::duration("queue.retry_max", l::DEFAULT_DISPATCH_RETRY_MAX_MS,
        "Largest backoff after repeated transient dispatch rejections."),
    // [session]
    KeyDef::duration("session.heartbeat_idle", l::DEFAULT_HEARTBEAT_IDLE_MS,
        "Send a Ping after this long without an inbound frame."),
    KeyDef::duration("session.liveness_timeout", l::DEFAULT_LIVENESS_TIMEOUT_MS,
        "Close a session after this long without an inbound frame."),
    KeyDef::duration("session.reconcile_timeout", l::DEFAULT_RECONCILE_TIMEOUT_MS,
        "Close a session (RECONCILE_TIMEOUT) whose reconciliation is not complete this long after its welcome."),
    KeyDef::duration("session.takeover_grant_ttl", l::DEFAULT_TAKEOVER_GRANT_TTL_MS,
        "Lifetime of a one-shot live-conflict takeover grant."),
    // [terminals]
    KeyDef::duration("terminals.idle_timeout", 12 * 3600 * 1000,
        "Close a terminal after this long with no input or output.")
        .zero_means("terminals are never closed for idleness"),
    KeyDef::count("terminals.max_per_client", 8,
        "Terminals open (or opening) at once on one client host.")
        .ceiling(1024).min(1),
    KeyDef::count("terminals.max_open", 256,
        "Terminals open (or opening) at once across the server.")
        .ceiling(65_536).min(1),
    KeyDef::bytes("terminals.recording_bytes", 64 * 1024 * 1024,
        "Recording kept per terminal (output, input and resizes); the oldest records go first, and a viewer or a replay gets a marker where they were.")
        .min(1024 * 1024),
    // [flow]
    KeyDef::bytes("flow.command_send_window", l::DEFAULT_COMMAND_SEND_WINDOW_BYTES,
        "Unacknowledged bytes per command in each direction: script chunks the server sends, and client events it accepts (announced in the welcome; a client sends within the smaller of its own window and this one)."
    ).ceiling(l::DEFAULT_COMMAND_SEND_WINDOW_BYTES).min(l::MIN_SEND_WINDOW_BYTES),
    KeyDef::bytes("flow.session_send_window", l::DEFAULT_SESSION_SEND_WINDOW_BYTES,
        "Unacknowledged bytes per session in each direction (announced in the welcome like the command window).")
        .ceiling(l::DEFAULT_SESSION_SEND_WINDOW_BYTES).min(l::MIN_SEND_WINDOW_BYTES),
    KeyDef::bytes("flow.ingress_high_watermark", l::DEFAULT_SERVER_HIGH_WATERMARK_BYTES,
        "Server-wide ingress backlog at which the server stops reading agent output."),
    KeyDef::bytes("flow.ingress_low_watermark", l::DEFAULT_SERVER_LOW_WATERMARK_BYTES,
        "Server-wide ingress backlog at which reading resumes."),
    // [limits]
    KeyDef::bytes("limits.max_envelope", l::MAX_ENVELOPE_BYTES,
        "Largest decoded agent envelope (one WebSocket binary message).")
        .ceiling(l::MAX_ENVELOPE_BYTES),
    KeyDef::bytes("limits.max_control_request", l::MAX_CONTROL_REQUEST_BYTES,
        "Largest decoded control gRPC request.")
        .ceiling(l::MAX_CONTROL_REQUEST_BYTES),
    // [control]
    KeyDef::text("control.runtime_dir", Kind::Path, defaults::CONTROL_RUNTIME_DIR,
        "Runtime directory of the control socket; must not be group- or world-writable."),
    KeyDef::text("control.socket_path", Kind::Path, defaults::CONTROL_SOCKET,
        "Control gRPC Unix socket (mode 0600); must lie directly inside control.runtime_dir."),
    KeyDef::count("control.default_page_size", l::DEFAULT_PAGE_SIZE,
        "Page size of a list request that gives none.")
        .ceiling(l::MAX_PAGE_SIZE),
    KeyDef::count("control.max_page_size", l::MAX_PAGE_SIZE,
        "Largest page size a list request may ask for.")
        .ceiling(l::MAX_PAGE_SIZE),
    KeyDef::bytes("control.default_output_page", l::DEFAULT_OUTPUT_PAGE_BYTES,
        "Bytes one GetOutput page returns when the request gives no size.")
        .ceiling(l::MAX_OUTPUT_PAGE_BYTES),
    KeyDef::bytes("control.max_output_page", l::MAX_OUTPUT_PAGE_BYTES,
        "Most bytes one GetOutput page may ask for.")
        .ceiling(l::MAX_OUTPUT_PAGE_BYTES),
    // [jsonrpc]
    KeyDef::boolean("jsonrpc.enabled", false,
        "Enable the unauthenticated JSON-RPC adapter. Anyone who can reach it controls every client."),
    KeyDef::text("jsonrpc.listen", Kind::SocketAddr, l::DEFAULT_JSONRPC_LISTEN,
        "JSON-RPC bind address; a non-loopback address draws a loud warning."),
    KeyDef::bytes("jsonrpc.max_body", l::MAX_JSONRPC_BODY_BYTES,
        "Largest JSON-RPC HTTP request body.")
        .ceiling(l::MAX_JSONRPC_BODY_BYTES),
    // [observability]
    KeyDef::text("observability.log_level", Kind::Choice(LOG_LEVELS), "info",
        "Log level: error, warn, info, debug or trace."),
    KeyDef::text("observability.log_format", Kind::Choice(LOG_FORMATS), "text",
        "Log format: text or json (one object per line)."),
    KeyDef::text("observability.metrics_listen", Kind::OptionalSocketAddr, "",
        "Address of the metrics/health HTTP listener; \"\" disables it."),
];

/// Every `rvbox` (client daemon) key, in summary order.
pub static CLIENT_KEYS: &[KeyDef] = &[
    // [client]
    KeyDef {
        min: 1,
        ..KeyDef::base("client.client_id", Kind::Text, DefaultValue::HostName,
            "This host's client id: 1-128 ASCII characters of hostname text (letters, digits, '.', '-', '_'). Defaults to the host name.")
    },
    KeyDef::list("client.server_urls", Kind::UrlList, defaults::SERVER_URLS,
        "Server URLs (ws:// or wss://) in order of preference; the daemon fails over to the next on a transport error or stall.")
        .max(defaults::MAX_SERVER_URLS),
    KeyDef::text("client.ca_file", Kind::OptionalPath, "",
        "PEM file of CA certificates trusted for wss:// URLs; \"\" uses the system roots. Its contents are never logged."),
    KeyDef::text("client.tls_cert_file", Kind::OptionalPath, "",
        "PEM certificate chain presented to the TLS proxy for wss:// URLs, required by a server whose server.client_identity is tls-client-cert (its CN must be client.client_id); \"\" presents none. Set together with client.tls_key_file."),
    KeyDef::text("client.tls_key_file", Kind::OptionalPath, "",
        "PEM private key of client.tls_cert_file; owner-only (mode 0600 or stricter). Its contents are never logged."),
    KeyDef::text("client.state_dir", Kind::Path, defaults::CLIENT_STATE_DIR,
        "Private directory holding the client identity, acceptance records and the output spool."),
    KeyDef::list("client.labels", Kind::Labels, &[],
        "Labels operators select this client by, a table of strings such as {role=\"web\", zone=\"eu-west\"}: at most 32; keys 1-63 ASCII letters, digits, '.', '_', '-', '/'; values 0-128 ASCII letters, digits and . _ - / : @ +. The flag takes key=value and may repeat."),
    // [shells]
    KeyDef::text("shells.sh", Kind::OptionalPath, "/bin/sh",
        "Absolute path of the POSIX sh executable; \"\" disables sh."),
    KeyDef::text("shells.bash", Kind::OptionalPath, "/bin/bash",
        "Absolute path of bash; \"\" disables bash."),
    KeyDef::text("shells.cmd", Kind::ForeignPath, "",
        "Windows only: path of cmd.exe. Syntax-checked on Linux and never advertised."),
    KeyDef::text("shells.powershell", Kind::ForeignPath, "",
        "Windows only: path of powershell.exe. Syntax-checked on Linux and never advertised."),
    KeyDef::text("shells.default", Kind::Choice(SHELL_CHOICES), "sh",
        "Shell used when a request names none; must be one of the validated shells of this platform."),
    // [exec]
    KeyDef::list("exec.allowed_cwd_roots", Kind::PathList, &["/"],
        "Existing directories under which a command's or a terminal's working directory must lie: checked by name at acceptance, and again with every symbolic link resolved immediately before it starts (a link inside a root that leads out of it is refused).")
        .max(defaults::MAX_CWD_ROOTS),
    KeyDef::text("exec.default_cwd", Kind::Path, "/",
        "Working directory of a command that names none; must lie under an allowed root."),
    KeyDef::count("exec.max_running", l::DEFAULT_CLIENT_MAX_RUNNING,
        "Commands this client runs at once."),
    KeyDef::count("exec.max_queued", l::DEFAULT_CLIENT_MAX_QUEUED,
        "Accepted commands held waiting for a running slot."),
    KeyDef::duration("exec.drain_grace", l::DEFAULT_DRAIN_GRACE_MS,
        "Grace after the root process exits for the process tree and pipes to drain."),
    KeyDef::duration("exec.kill_grace", l::DEFAULT_KILL_GRACE_MS,
        "Grace between TERM and KILL when RVBox stops a process tree."),
    KeyDef::duration("exec.diagnostics_interval", l::DEFAULT_DIAGNOSTICS_INTERVAL_MS,
        "Diagnostics sampling interval."),
    KeyDef::duration("exec.suspected_hung_after", l::DEFAULT_SUSPECTED_HUNG_MS,
        "No observable progress for this long sets the diagnostic suspected_hung flag."),
    // [terminals]
    KeyDef::count("terminals.max_open", 16,
        "Terminals open (or opening) at once on this host; beyond it an open is refused TRANSIENT.")
        .ceiling(1024).min(1),
    // [reconnect]
    KeyDef::duration("reconnect.initial", l::DEFAULT_RECONNECT_INITIAL_MS,
        "First reconnect backoff cap (full jitter below it)."),
    KeyDef::duration("reconnect.max", l::DEFAULT_RECONNECT_MAX_MS,
        "Largest reconnect backoff cap."),
    KeyDef::duration("reconnect.stable_reset", l::DEFAULT_RECONNECT_STABLE_RESET_MS,
        "A session must stay up this long before the backoff resets."),
    // [session]
    KeyDef::duration("session.heartbeat_idle", l::DEFAULT_HEARTBEAT_IDLE_MS,
        "Send a Ping after this long without an inbound frame."),
    KeyDef::duration("session.liveness_timeout", l::DEFAULT_LIVENESS_TIMEOUT_MS,
        "Close the session after this long without an inbound frame."),
    // [spool]
    KeyDef::bytes("spool.command_output_window", l::DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
        "Compressed rolling output window kept per command in the spool."),
    KeyDef::bytes("spool.command_total", l::DEFAULT_COMMAND_TOTAL_BYTES,
        "Total spooled bytes per command (the command quota): a command is accepted only when its worst case fits (metadata and closeout reserve, script, output window and the stdin it may hold; above, a permanent TOO_LARGE refusal naming this key), and its output window keeps it within for its whole life."),
    KeyDef::bytes("spool.daemon_total", l::DEFAULT_CLIENT_DAEMON_BYTES,
        "Total spooled command bytes of this client daemon."),
    KeyDef::bytes("spool.closeout_reserve", l::DEFAULT_CLOSEOUT_RESERVE_BYTES,
        "Bytes reserved inside every accepted command's quota for closeout metadata."),
    KeyDef::bytes("spool.free_space_floor", l::DEFAULT_CLIENT_FREE_SPACE_FLOOR_BYTES,
        "Emergency free-space floor of the state directory's filesystem, measured with every acceptance: below it no new command is accepted (a transient refusal naming this key; the server retries with backoff)."),
    KeyDef::count("spool.tombstones", l::DEFAULT_CLIENT_TOMBSTONES,
        "Length of the compact command tombstone FIFO.")
        .ceiling(l::MAX_TOMBSTONES),
    // [flow]
    KeyDef::bytes("flow.command_high_watermark", l::DEFAULT_COMMAND_HIGH_WATERMARK_BYTES,
        "Raw-output backlog per command at which output enters loss mode. The pipe readers' hand-over grows with the two high watermarks (twice this per command, half flow.daemon_high_watermark in all), so output in flight stays within 1.5 times flow.daemon_high_watermark. A child is never blocked: a burst larger than the backlog that the spool cannot make durable in time goes into CLIENT_OVERLOAD markers."),
    KeyDef::bytes("flow.command_low_watermark", l::DEFAULT_COMMAND_LOW_WATERMARK_BYTES,
        "Raw-output backlog per command at which loss mode ends."),
    KeyDef::bytes("flow.daemon_high_watermark", l::DEFAULT_CLIENT_HIGH_WATERMARK_BYTES,
        "Raw-output backlog of the whole daemon at which output enters loss mode."),
    KeyDef::bytes("flow.daemon_low_watermark", l::DEFAULT_CLIENT_LOW_WATERMARK_BYTES,
        "Raw-output backlog of the whole daemon at which loss mode ends."),
    KeyDef::bytes("flow.command_send_window", l::DEFAULT_COMMAND_SEND_WINDOW_BYTES,
        "Unacknowledged event bytes sent per command (the smaller of this and the server's window from the welcome).")
        .ceiling(l::DEFAULT_COMMAND_SEND_WINDOW_BYTES).min(l::MIN_SEND_WINDOW_BYTES),
    KeyDef::bytes("flow.session_send_window", l::DEFAULT_SESSION_SEND_WINDOW_BYTES,
        "Unacknowledged event bytes sent per session (the smaller of this and the server's window from the welcome).")
        .ceiling(l::DEFAULT_SESSION_SEND_WINDOW_BYTES).min(l::MIN_SEND_WINDOW_BYTES),
    // [observability]
    KeyDef::text("observability.log_level", Kind::Choice(LOG_LEVELS), "info",
        "Log level: error, warn, info, debug or trace."),
    KeyDef::text("observability.log_format", Kind::Choice(LOG_FORMATS), "text",
        "Log format: text or json (one object per line)."),
    KeyDef::text("observability.metrics_listen", Kind::OptionalSocketAddr, "",
        "Address of the metrics/health HTTP listener; \"\" disables it."),
];

/// Keys of one `[profiles.NAME]` table (client only). Profiles are set in
/// the file only; they have no flags.
pub static PROFILE_KEYS: &[KeyDef] = &[
    KeyDef::boolean(
        "enabled",
        true,
        "Advertise and accept this profile; false keeps it configured but unavailable.",
    ),
    KeyDef::list(
        "required_controls",
        Kind::TextList,
        &[],
        "Essential controls (cpu_max, cpu_weight, memory_max, memory_high, pids_max, io_max); a command is rejected rather than run without them. Must not be empty.",
    ),
    KeyDef::count(
        "cpu_quota_us",
        0,
        "cpu.max quota in microseconds per period (at least 1000).",
    )
    .min(1_000),
    KeyDef::count(
        "cpu_period_us",
        0,
        "cpu.max period in microseconds (1000 to 1000000).",
    )
    .min(1_000)
    .max(1_000_000),
    KeyDef::count("cpu_weight", 0, "cpu.weight (1 to 10000).").max(10_000),
    KeyDef::bytes("memory_max", 0, "memory.max: hard memory limit."),
    KeyDef::bytes(
        "memory_high",
        0,
        "memory.high: throttling threshold (not above memory_max).",
    ),
    KeyDef::count("pids_max", 0, "pids.max: most processes and threads."),
];

/// Keys of one `[profiles.NAME.io."MAJOR:MINOR"]` device rule.
pub static IO_RULE_KEYS: &[KeyDef] = &[
    KeyDef::bytes("read_bps", 0, "io.max rbps: read bytes per second."),
    KeyDef::bytes("write_bps", 0, "io.max wbps: write bytes per second."),
    KeyDef::count("read_iops", 0, "io.max riops: read operations per second."),
    KeyDef::count(
        "write_iops",
        0,
        "io.max wiops: write operations per second.",
    ),
];

/// Looks up a key of a daemon by dotted path.
pub fn find(daemon: Daemon, path: &str) -> Option<&'static KeyDef> {
    daemon.keys().iter().find(|k| k.path == path)
}

/// Keys earlier versions accepted and nothing ever read, with why they
/// went: a configuration that still sets one is refused with that reason
/// rather than a bare "unknown key" (docs/configuration.md, "Removed
/// keys").
pub const REMOVED: &[(Daemon, &str, &str)] = &[
    (
        Daemon::Server,
        "limits.max_execution_spec",
        REMOVED_PROTOCOL_LIMIT,
    ),
    (
        Daemon::Server,
        "limits.max_raw_chunk",
        REMOVED_PROTOCOL_LIMIT,
    ),
    (Daemon::Server, "limits.max_script", REMOVED_PROTOCOL_LIMIT),
    (
        Daemon::Server,
        "limits.max_script_chunk",
        REMOVED_PROTOCOL_LIMIT,
    ),
    (
        Daemon::Server,
        "limits.max_stdin_write",
        REMOVED_PROTOCOL_LIMIT,
    ),
    (Daemon::Server, "limits.max_reason", REMOVED_PROTOCOL_LIMIT),
    (
        Daemon::Server,
        "limits.max_incident_note",
        REMOVED_PROTOCOL_LIMIT,
    ),
];

const REMOVED_PROTOCOL_LIMIT: &str = "removed: this limit is fixed by the v1 protocol (announced to every client in AgentLimits, docs/protocol.md) and was never read from the configuration; delete the line";

/// Why `path` was removed, when it is a removed key of `daemon`.
#[must_use]
pub fn removed(daemon: Daemon, path: &str) -> Option<&'static str> {
    REMOVED
        .iter()
        .find(|(d, p, _)| *d == daemon && *p == path)
        .map(|(_, _, why)| *why)
}

/// The sections of a daemon, in registry order, without repeats.
pub fn sections(daemon: Daemon) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for key in daemon.keys() {
        let section = key.section();
        if !out.contains(&section) {
            out.push(section);
        }
    }
    out
}
