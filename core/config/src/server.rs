//! The validated `rvbox-server` configuration.

use core::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{
    ObservabilityConfig, observability, require_at_most, require_below, socket_addr,
};
use crate::decode::{FlagValue, Value, decode_file};
use crate::error::ConfigErrors;
use crate::paths::{examine, examine_path, private_dir, within};
use crate::probe::{FileKind, HostProbe};
use crate::registry::{Daemon, defaults};
use crate::render::render;
use crate::resolve::Resolved;
use rvbox_domain::limits as l;

/// `[server]`: the agent endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentConfig {
    /// Listener address (behind the TLS-terminating proxy).
    pub listen: SocketAddr,
    /// HTTP path of the WebSocket endpoint.
    pub path: String,
    /// Allowed `Origin` values; an upgrade carrying another Origin is refused.
    pub allowed_origins: Vec<String>,
    /// How a client's identity is established.
    pub identity: ClientIdentity,
}

/// `server.client_identity`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientIdentity {
    /// The hello's `client_id` is believed (the plan's v1 behaviour).
    SelfReported,
    /// The TLS proxy verified a client certificate: its subject arrives in
    /// `header`, believed only from `trusted_proxies`; the hello's
    /// `client_id` must be the subject's CN.
    TlsClientCert {
        /// `server.client_cert_header`, lowercase.
        header: String,
        /// `server.trusted_proxies`.
        trusted_proxies: Vec<std::net::IpAddr>,
    },
}

/// Where the server stores everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// One server on SQLite and segment files in `storage.data_dir`.
    Sqlite,
    /// One of several replicas on a shared PostgreSQL database.
    Postgres(PostgresConfig),
}

/// `[postgres]`: the shared database of replicas.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresConfig {
    /// The connection string, without a password.
    pub conninfo: String,
    /// The file holding the password, if any.
    pub password_file: Option<PathBuf>,
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("conninfo", &self.conninfo)
            .field("password_file", &self.password_file)
            .finish()
    }
}

/// Checks a PostgreSQL connection string: `key=value` pairs (values may
/// be single-quoted), no password among them.
///
/// # Errors
/// What is wrong, naming the key.
pub fn check_conninfo(text: &str) -> Result<(), String> {
    if text.trim().is_empty() {
        return Err("is required when server.store = \"postgres\"".into());
    }
    for scheme in ["postgres://", "postgresql://"] {
        if let Some(rest) = text.strip_prefix(scheme) {
            let authority = rest.split(['/', '?']).next().unwrap_or("");
            let userinfo = authority.rsplit_once('@').map_or("", |(u, _)| u);
            let query = rest.split_once('?').map_or("", |(_, q)| q);
            if userinfo.contains(':')
                || query
                    .split('&')
                    .any(|kv| kv.to_ascii_lowercase().starts_with("password="))
            {
                return Err("holds a password; put it in postgres.password_file".into());
            }
            return Ok(());
        }
    }
    for pair in conninfo_keys(text)? {
        if pair.eq_ignore_ascii_case("password") {
            return Err("holds a password; put it in postgres.password_file".into());
        }
    }
    Ok(())
}

/// The keys of a `key=value` connection string.
fn conninfo_keys(text: &str) -> Result<Vec<String>, String> {
    let mut keys = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let Some(eq) = rest.find('=') else {
            return Err(format!("{rest:?} is not key=value"));
        };
        let key = rest[..eq].trim();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(format!("{:?} is not key=value", &rest[..eq]));
        }
        keys.push(key.to_owned());
        rest = rest[eq + 1..].trim_start();
        if let Some(quoted) = rest.strip_prefix('\'') {
            // a quoted value; \' and \\ are escapes
            let mut end = None;
            let mut escaped = false;
            for (i, c) in quoted.char_indices() {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '\'' {
                    end = Some(i);
                    break;
                }
            }
            let Some(end) = end else {
                return Err(format!("the value of {key} has no closing quote"));
            };
            rest = quoted[end + 1..].trim_start();
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            rest = rest[end..].trim_start();
        }
    }
    Ok(keys)
}

/// SQLite synchronous mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqliteSynchronous {
    /// `PRAGMA synchronous = FULL`.
    Full,
    /// `PRAGMA synchronous = EXTRA`.
    Extra,
}

/// `[storage]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StorageConfig {
    /// The data directory (canonical when it exists).
    pub data_dir: PathBuf,
    /// `data_dir/db`: the SQLite database.
    pub db_dir: PathBuf,
    /// `data_dir/segments`: output segments.
    pub segments_dir: PathBuf,
    /// `data_dir/audit`: audit segments.
    pub audit_dir: PathBuf,
    /// SQLite synchronous mode.
    pub sqlite_synchronous: SqliteSynchronous,
    /// Compressed rolling output window per command, bytes.
    pub command_output_window: u64,
    /// Command quota, bytes.
    pub command_total: u64,
    /// Per-client quota, bytes.
    pub per_client_total: u64,
    /// Server-wide quota, bytes.
    pub server_total: u64,
    /// Closeout reserve inside each command quota, bytes.
    pub closeout_reserve: u64,
    /// Terminal command age reclamation; `None` = disabled.
    pub terminal_retention: Option<Duration>,
    /// Background scrub cycle interval; `None` = only the cycle after each start.
    pub scrub_interval: Option<Duration>,
    /// Emergency free-space floor, bytes.
    pub free_space_floor: u64,
    /// Tombstone FIFO length.
    pub tombstones: u64,
    /// Segment seal size, bytes.
    pub segment_seal_size: u64,
    /// Group-commit delay bound.
    pub group_commit_max_delay: Duration,
    /// Group-commit batch bound.
    pub group_commit_max_batch: u64,
}

/// `[audit]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditConfig {
    /// Audit storage budget, bytes.
    pub max_bytes: u64,
    /// Age rotation; `None` = quota-only rotation.
    pub retention: Option<Duration>,
}

/// `[queue]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueConfig {
    /// Queue TTL; `None` = commands wait indefinitely.
    pub ttl: Option<Duration>,
    /// Commands queued per client.
    pub max_per_client: u64,
    /// Commands queued server-wide.
    pub max_total: u64,
    /// First transient-rejection backoff.
    pub retry_initial: Duration,
    /// Largest transient-rejection backoff.
    pub retry_max: Duration,
}

/// `[session]` of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSessionConfig {
    /// Ping after this much inbound silence.
    pub heartbeat_idle: Duration,
    /// Close after this much inbound silence.
    pub liveness_timeout: Duration,
    /// Close a session not reconciled this long after its welcome.
    pub reconcile_timeout: Duration,
    /// One-shot takeover grant lifetime.
    pub takeover_grant_ttl: Duration,
}

/// `[terminals]` of the server (docs/terminals.md).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TerminalsConfig {
    /// Idle terminals close after this; `None` = never.
    pub idle_timeout: Option<Duration>,
    /// Terminals per client host.
    pub max_per_client: u64,
    /// Terminals across the server.
    pub max_open: u64,
    /// Recording kept per terminal (bytes).
    pub recording_bytes: u64,
}

/// `[flow]` of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerFlowConfig {
    /// Unacknowledged bytes per command.
    pub command_send_window: u64,
    /// Unacknowledged bytes per session.
    pub session_send_window: u64,
    /// Server-wide ingress high watermark.
    pub ingress_high_watermark: u64,
    /// Server-wide ingress low watermark.
    pub ingress_low_watermark: u64,
}

/// `[limits]`: protocol limits, each at most its v1 ceiling.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProtocolLimits {
    /// Decoded agent envelope.
    pub max_envelope: u64,
    /// Decoded control gRPC request.
    pub max_control_request: u64,
}

/// `[control]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ControlConfig {
    /// Runtime directory of the socket.
    pub runtime_dir: PathBuf,
    /// The control Unix socket, directly inside `runtime_dir`.
    pub socket_path: PathBuf,
    /// Default list page size.
    pub default_page_size: u64,
    /// Largest list page size.
    pub max_page_size: u64,
    /// Default GetOutput page bytes.
    pub default_output_page: u64,
    /// Largest GetOutput page bytes.
    pub max_output_page: u64,
}

/// `[jsonrpc]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct JsonRpcConfig {
    /// Whether the unauthenticated adapter runs.
    pub enabled: bool,
    /// Bind address.
    pub listen: SocketAddr,
    /// Largest request body.
    pub max_body: u64,
}

impl JsonRpcConfig {
    /// True when enabled on a non-loopback address (allowed, but warned).
    pub fn is_exposed(&self) -> bool {
        self.enabled && !self.listen.ip().is_loopback()
    }
}

/// The validated, immutable `rvbox-server` configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerConfig {
    /// `[server]`.
    pub agent: AgentConfig,
    /// `server.store` and `[postgres]`.
    pub store: StoreBackend,
    /// `[storage]`.
    pub storage: StorageConfig,
    /// `[audit]`.
    pub audit: AuditConfig,
    /// `[queue]`.
    pub queue: QueueConfig,
    /// `[session]`.
    pub session: ServerSessionConfig,
    /// `[terminals]`.
    pub terminals: TerminalsConfig,
    /// `[flow]`.
    pub flow: ServerFlowConfig,
    /// `[limits]`.
    pub limits: ProtocolLimits,
    /// `[control]`.
    pub control: ControlConfig,
    /// `[jsonrpc]`.
    pub jsonrpc: JsonRpcConfig,
    /// `[observability]`.
    pub observability: ObservabilityConfig,
    warnings: Vec<String>,
    summary: String,
}

impl ServerConfig {
    /// Conspicuous warnings (e.g. exposed JSON-RPC), also in the summary.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The redacted, normalized effective configuration, stable key order.
    pub fn summary(&self) -> &str {
        &self.summary
    }
}

fn optional(d: Duration) -> Option<Duration> {
    if d.is_zero() { None } else { Some(d) }
}

/// Decodes, merges and validates a server configuration. `source` names
/// the file in the summary; `flags` are the explicitly given flags only.
pub fn load_server(
    source: &str,
    text: &str,
    flags: &[FlagValue],
    probe: &dyn HostProbe,
) -> Result<ServerConfig, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let doc = decode_file(Daemon::Server, text, &mut errors);
    if errors.errors.iter().any(|e| e.key == "toml") {
        return Err(errors);
    }
    let mut r = Resolved::build(Daemon::Server, &doc, flags, probe, &mut errors);
    let e = &mut errors;

    // [server]
    let listen = socket_addr(&r, "server.agent_listen", e);
    let path = r.text("server.agent_path");
    if !path.starts_with('/')
        || path
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '?' || c == '#')
    {
        e.push(r.error(
            "server.agent_path",
            format!("{path:?} must start with '/' and contain no spaces, '?' or '#'"),
        ));
    }
    let allowed_origins = r.list("server.allowed_origins");
    for (i, origin) in allowed_origins.iter().enumerate() {
        if let Err(msg) = check_origin(origin) {
            e.push(r.error("server.allowed_origins", msg));
        } else if allowed_origins.iter().take(i).any(|o| o == origin) {
            e.push(r.error(
                "server.allowed_origins",
                format!("{origin:?} is listed twice"),
            ));
        }
    }

    let identity = match r.text("server.client_identity").as_str() {
        "tls-client-cert" => {
            let header = r.text("server.client_cert_header").to_ascii_lowercase();
            if header.is_empty()
                || !header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                e.push(r.error(
                    "server.client_cert_header",
                    format!("{header:?} is not an HTTP header name (letters, digits, '-', '_')"),
                ));
            }
            let mut trusted_proxies = Vec::new();
            for text in r.list("server.trusted_proxies") {
                match text.parse::<std::net::IpAddr>() {
                    Ok(ip) if !trusted_proxies.contains(&ip) => trusted_proxies.push(ip),
                    Ok(_) => e.push(r.error(
                        "server.trusted_proxies",
                        format!("{text:?} is listed twice"),
                    )),
                    Err(_) => e.push(r.error(
                        "server.trusted_proxies",
                        format!("{text:?} is not an IP address"),
                    )),
                }
            }
            if r.list("server.trusted_proxies").is_empty() {
                e.push(r.error(
                    "server.trusted_proxies",
                    "must list the TLS proxy's address when server.client_identity = \"tls-client-cert\"",
                ));
            }
            ClientIdentity::TlsClientCert {
                header,
                trusted_proxies,
            }
        }
        _ => ClientIdentity::SelfReported,
    };

    // [storage] paths
    let data_dir = match private_dir(probe, &r.text("storage.data_dir")) {
        Ok(p) => p,
        Err(msg) => {
            e.push(r.error("storage.data_dir", msg));
            r.mark_failed("storage.data_dir");
            PathBuf::from(r.text("storage.data_dir"))
        }
    };
    let mut subdirs = Vec::new();
    for name in ["db", "segments", "audit"] {
        let joined = data_dir.join(name);
        match examine_path(probe, &joined) {
            Ok(ex) => {
                if let Some(stat) = ex.stat
                    && stat.kind != FileKind::Dir
                {
                    e.push(r.error(
                        "storage.data_dir",
                        format!("{} exists and is not a directory", joined.display()),
                    ));
                }
                subdirs.push((name, ex.path));
            }
            Err(msg) => {
                e.push(r.error("storage.data_dir", msg));
                subdirs.push((name, joined));
            }
        }
    }
    for (i, (a_name, a)) in subdirs.iter().enumerate() {
        for (b_name, b) in subdirs.iter().skip(i + 1) {
            if within(a, b) || within(b, a) {
                e.push(r.error(
                    "storage.data_dir",
                    format!(
                        "data subdirectories {a_name}/ and {b_name}/ collapse into one another ({} and {}); each must be a distinct directory",
                        a.display(),
                        b.display()
                    ),
                ));
            }
        }
    }
    let dir_of = |name: &str| {
        subdirs
            .iter()
            .find(|(n, _)| *n == name)
            .map_or_else(|| data_dir.join(name), |(_, p)| p.clone())
    };
    let (db_dir, segments_dir, audit_dir) = (dir_of("db"), dir_of("segments"), dir_of("audit"));
    r.normalize(
        "storage.data_dir",
        Value::Text(data_dir.display().to_string()),
    );

    // [control] runtime directory and socket policy
    let runtime_dir = match runtime_dir(probe, &r.text("control.runtime_dir")) {
        Ok(p) => p,
        Err(msg) => {
            e.push(r.error("control.runtime_dir", msg));
            r.mark_failed("control.runtime_dir");
            PathBuf::from(r.text("control.runtime_dir"))
        }
    };
    if !r.failed("control.runtime_dir")
        && !r.failed("storage.data_dir")
        && (within(&runtime_dir, &data_dir) || within(&data_dir, &runtime_dir))
    {
        e.push(r.pair_error(
            "control.runtime_dir",
            "storage.data_dir",
            format!(
                "control.runtime_dir ({}) and storage.data_dir ({}) must not contain one another",
                runtime_dir.display(),
                data_dir.display()
            ),
        ));
    }
    let socket_path = match socket_path(probe, &r.text("control.socket_path"), &runtime_dir) {
        Ok(p) => p,
        Err(msg) => {
            if !r.failed("control.runtime_dir") {
                e.push(r.error("control.socket_path", msg));
            }
            PathBuf::from(r.text("control.socket_path"))
        }
    };
    r.normalize(
        "control.runtime_dir",
        Value::Text(runtime_dir.display().to_string()),
    );
    r.normalize(
        "control.socket_path",
        Value::Text(socket_path.display().to_string()),
    );

    // plan §4.3 item 8: cross-field invariants.
    require_below(&r, "storage.closeout_reserve", "storage.command_total", e);
    require_below(&r, "storage.command_total", "storage.per_client_total", e);
    require_below(&r, "storage.command_total", "storage.server_total", e);
    require_at_most(&r, "storage.per_client_total", "storage.server_total", e);
    require_at_most(
        &r,
        "storage.command_output_window",
        "storage.command_total",
        e,
    );
    require_below(&r, "flow.command_send_window", "storage.command_total", e);
    require_below(
        &r,
        "flow.session_send_window",
        "storage.per_client_total",
        e,
    );
    require_at_most(
        &r,
        "flow.command_send_window",
        "flow.session_send_window",
        e,
    );
    require_below(
        &r,
        "flow.ingress_low_watermark",
        "flow.ingress_high_watermark",
        e,
    );
    require_at_most(&r, "queue.max_per_client", "queue.max_total", e);
    require_at_most(&r, "queue.retry_initial", "queue.retry_max", e);
    require_below(&r, "session.heartbeat_idle", "session.liveness_timeout", e);
    require_at_most(&r, "control.default_page_size", "control.max_page_size", e);
    require_at_most(
        &r,
        "control.default_output_page",
        "control.max_output_page",
        e,
    );
    // the protocol's fixed limits must fit in one envelope and one
    // control request (a spec of the largest size travels in both)
    for (key, fixed, what) in [
        (
            "limits.max_envelope",
            l::MAX_EXECUTION_SPEC_BYTES,
            "the largest ExecutionSpec",
        ),
        (
            "limits.max_envelope",
            l::MAX_RAW_CHUNK_BYTES,
            "the largest output chunk",
        ),
        (
            "limits.max_envelope",
            l::MAX_SCRIPT_CHUNK_BYTES,
            "the largest script chunk or stdin write",
        ),
        (
            "limits.max_control_request",
            l::MAX_EXECUTION_SPEC_BYTES,
            "the largest ExecutionSpec",
        ),
    ] {
        if !r.failed(key) && r.num(key) <= fixed {
            e.push(r.error(
                key,
                format!("must be above {what} ({fixed} bytes, fixed by the protocol)"),
            ));
        }
    }

    // server.store and [postgres]
    let store = if r.text("server.store") == "postgres" {
        let conninfo = r.text("postgres.conninfo");
        if let Err(msg) = check_conninfo(&conninfo) {
            e.push(r.error("postgres.conninfo", msg));
        }
        let file = r.text("postgres.password_file");
        StoreBackend::Postgres(PostgresConfig {
            conninfo,
            password_file: (!file.is_empty()).then(|| PathBuf::from(file)),
        })
    } else {
        StoreBackend::Sqlite
    };

    // [jsonrpc]
    let jsonrpc_listen = socket_addr(&r, "jsonrpc.listen", e);
    let observability = observability(&r, e);

    let mut warnings = Vec::new();
    let jsonrpc_enabled = r.flag("jsonrpc.enabled");
    if let Some(addr) = jsonrpc_listen
        && jsonrpc_enabled
        && !addr.ip().is_loopback()
    {
        warnings.push(format!(
                "JSON-RPC is enabled on non-loopback address {addr}: it is UNAUTHENTICATED, anyone who can reach it can run commands on every client"
            ));
    }

    let (Some(listen), Some(jsonrpc_listen)) = (listen, jsonrpc_listen) else {
        return Err(errors);
    };
    if !errors.is_empty() {
        return Err(errors);
    }
    let summary = render(Daemon::Server, source, &r, None, &warnings);
    Ok(ServerConfig {
        agent: AgentConfig {
            listen,
            path,
            allowed_origins,
            identity,
        },
        store,
        storage: StorageConfig {
            data_dir,
            db_dir,
            segments_dir,
            audit_dir,
            sqlite_synchronous: if r.text("storage.sqlite_synchronous") == "extra" {
                SqliteSynchronous::Extra
            } else {
                SqliteSynchronous::Full
            },
            command_output_window: r.num("storage.command_output_window"),
            command_total: r.num("storage.command_total"),
            per_client_total: r.num("storage.per_client_total"),
            server_total: r.num("storage.server_total"),
            closeout_reserve: r.num("storage.closeout_reserve"),
            terminal_retention: optional(r.duration("storage.terminal_retention")),
            scrub_interval: optional(r.duration("storage.scrub_interval")),
            free_space_floor: r.num("storage.free_space_floor"),
            tombstones: r.num("storage.tombstones"),
            segment_seal_size: r.num("storage.segment_seal_size"),
            group_commit_max_delay: r.duration("storage.group_commit_max_delay"),
            group_commit_max_batch: r.num("storage.group_commit_max_batch"),
        },
        audit: AuditConfig {
            max_bytes: r.num("audit.max_bytes"),
            retention: optional(r.duration("audit.retention")),
        },
        queue: QueueConfig {
            ttl: optional(r.duration("queue.ttl")),
            max_per_client: r.num("queue.max_per_client"),
            max_total: r.num("queue.max_total"),
            retry_initial: r.duration("queue.retry_initial"),
            retry_max: r.duration("queue.retry_max"),
        },
        session: ServerSessionConfig {
            heartbeat_idle: r.duration("session.heartbeat_idle"),
            liveness_timeout: r.duration("session.liveness_timeout"),
            reconcile_timeout: r.duration("session.reconcile_timeout"),
            takeover_grant_ttl: r.duration("session.takeover_grant_ttl"),
        },
        terminals: TerminalsConfig {
            idle_timeout: optional(r.duration("terminals.idle_timeout")),
            max_per_client: r.num("terminals.max_per_client"),
            max_open: r.num("terminals.max_open"),
            recording_bytes: r.num("terminals.recording_bytes"),
        },
        flow: ServerFlowConfig {
            command_send_window: r.num("flow.command_send_window"),
            session_send_window: r.num("flow.session_send_window"),
            ingress_high_watermark: r.num("flow.ingress_high_watermark"),
            ingress_low_watermark: r.num("flow.ingress_low_watermark"),
        },
        limits: ProtocolLimits {
            max_envelope: r.num("limits.max_envelope"),
            max_control_request: r.num("limits.max_control_request"),
        },
        control: ControlConfig {
            runtime_dir,
            socket_path,
            default_page_size: r.num("control.default_page_size"),
            max_page_size: r.num("control.max_page_size"),
            default_output_page: r.num("control.default_output_page"),
            max_output_page: r.num("control.max_output_page"),
        },
        jsonrpc: JsonRpcConfig {
            enabled: jsonrpc_enabled,
            listen: jsonrpc_listen,
            max_body: r.num("jsonrpc.max_body"),
        },
        observability,
        warnings,
        summary,
    })
}

/// `scheme://host[:port]` with scheme http or https and nothing after.
fn check_origin(origin: &str) -> Result<(), String> {
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .ok_or_else(|| format!("origin {origin:?} must start with http:// or https://"))?;
    if rest.is_empty()
        || rest.contains(['/', '?', '#', '@'])
        || rest.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "origin {origin:?} must be scheme://host[:port] with no path, query or user"
        ));
    }
    Ok(())
}

/// Control runtime directory policy: absolute; when it exists, a directory
/// owned by root or this user that is not group- or world-writable.
fn runtime_dir(probe: &dyn HostProbe, text: &str) -> Result<PathBuf, String> {
    let ex = examine(probe, text)?;
    if let Some(stat) = ex.stat {
        if stat.kind != FileKind::Dir {
            return Err(format!(
                "{} exists and is not a directory",
                ex.path.display()
            ));
        }
        let uid = probe.current_uid();
        if stat.uid != 0 && stat.uid != uid {
            return Err(format!(
                "{} is owned by uid {}, neither root nor this user",
                ex.path.display(),
                stat.uid
            ));
        }
        if stat.is_group_or_world_writable() {
            return Err(format!(
                "{} is group- or world-writable (mode {:o}); the control socket needs a private runtime directory",
                ex.path.display(),
                stat.mode
            ));
        }
    }
    Ok(ex.path)
}

/// Control socket policy: directly inside the runtime directory, a path
/// short enough for `sun_path`, and when it exists a (stale) socket, never
/// another kind of file.
fn socket_path(probe: &dyn HostProbe, text: &str, runtime_dir: &Path) -> Result<PathBuf, String> {
    let normalized = crate::paths::normalize_absolute(text)?;
    let (Some(parent), Some(name)) = (normalized.parent(), normalized.file_name()) else {
        return Err(format!(
            "{text:?} must name a socket file inside control.runtime_dir"
        ));
    };
    let parent = examine_path(probe, parent)?.path;
    if parent != runtime_dir {
        return Err(format!(
            "{} must lie directly inside control.runtime_dir ({})",
            normalized.display(),
            runtime_dir.display()
        ));
    }
    let path = parent.join(name);
    if path.as_os_str().len() > defaults::MAX_SOCKET_PATH_BYTES {
        return Err(format!(
            "{} is longer than {} bytes, too long for a Unix socket",
            path.display(),
            defaults::MAX_SOCKET_PATH_BYTES
        ));
    }
    if let Some(stat) = probe
        .stat(&path)
        .map_err(|e| format!("cannot examine {}: {e}", path.display()))?
        && stat.kind != FileKind::Socket
    {
        return Err(format!(
            "{} exists and is not a socket; RVBox never replaces another file",
            path.display()
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod conninfo_tests {
    use super::check_conninfo;

    #[test]
    fn a_password_in_the_connection_string_is_refused_by_name() {
        for ok in [
            "host=/run/postgresql dbname=rvbox user=rvbox",
            "host=db.example port=5432 dbname='rv box' user=rvbox sslmode=require",
            "postgres://rvbox@db.example/rvbox?sslmode=require",
        ] {
            assert_eq!(check_conninfo(ok), Ok(()), "{ok}");
        }
        for bad in [
            "host=db password=hunter2 dbname=rvbox",
            "host=db PASSWORD = 'a b' dbname=rvbox",
            "postgres://rvbox:hunter2@db/rvbox",
            "postgresql://rvbox@db/rvbox?sslmode=require&password=x",
        ] {
            let e = check_conninfo(bad).unwrap_err();
            assert!(e.contains("password_file"), "{bad}: {e}");
        }
        assert!(check_conninfo("").unwrap_err().contains("required"));
        assert!(check_conninfo("host").unwrap_err().contains("key=value"));
        assert!(check_conninfo("dbname='x").unwrap_err().contains("quote"));
    }
}
