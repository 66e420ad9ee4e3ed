//! The validated `rvbox` (client daemon) configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{ObservabilityConfig, observability, require_at_most, require_below};
use crate::decode::{FlagValue, Value, decode_file};
use crate::error::ConfigErrors;
use crate::paths::{existing_dir, existing_file, private_dir, within};
use crate::probe::HostProbe;
use crate::profiles::{ProfilesConfig, build_profiles};
use crate::registry::Daemon;
use crate::render::render;
use crate::resolve::Resolved;
use crate::shells::{ShellKind, ShellsConfig, check_windows_path, resolve_shell};

/// `[client]`: identity, routing and state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientIdentityConfig {
    /// The client id (hostname text).
    pub client_id: String,
    /// Server URLs in order of preference.
    pub server_urls: Vec<String>,
    /// CA bundle for wss:// (`None`: system roots).
    pub ca_file: Option<PathBuf>,
    /// The client certificate chain and key presented for wss:// (`None`:
    /// none).
    pub tls_identity: Option<(PathBuf, PathBuf)>,
    /// The private state directory.
    pub state_dir: PathBuf,
    /// Labels advertised in the hello.
    pub labels: rvbox_domain::labels::Labels,
}

/// `[exec]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecConfig {
    /// Canonical allowed CWD roots.
    pub allowed_cwd_roots: Vec<PathBuf>,
    /// Canonical default CWD.
    pub default_cwd: PathBuf,
    /// Commands run at once.
    pub max_running: u64,
    /// Accepted commands waiting for a slot.
    pub max_queued: u64,
    /// Drain grace after the root process exits.
    pub drain_grace: Duration,
    /// TERM-to-KILL grace.
    pub kill_grace: Duration,
    /// Diagnostics sampling interval.
    pub diagnostics_interval: Duration,
    /// No-progress time before `suspected_hung`.
    pub suspected_hung_after: Duration,
}

impl ExecConfig {
    /// True when a canonical directory lies under an allowed root.
    pub fn cwd_allowed(&self, canonical_dir: &Path) -> bool {
        self.allowed_cwd_roots
            .iter()
            .any(|root| within(canonical_dir, root))
    }
}

/// `[reconnect]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconnectConfig {
    /// First backoff cap.
    pub initial: Duration,
    /// Largest backoff cap.
    pub max: Duration,
    /// Stable time before the backoff resets.
    pub stable_reset: Duration,
}

/// `[session]` of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientSessionConfig {
    /// Ping after this much inbound silence.
    pub heartbeat_idle: Duration,
    /// Close after this much inbound silence.
    pub liveness_timeout: Duration,
}

/// `[spool]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpoolConfig {
    /// Compressed output window per command.
    pub command_output_window: u64,
    /// Command quota.
    pub command_total: u64,
    /// Daemon quota.
    pub daemon_total: u64,
    /// Closeout reserve per command.
    pub closeout_reserve: u64,
    /// Emergency free-space floor.
    pub free_space_floor: u64,
    /// Tombstone FIFO length.
    pub tombstones: u64,
}

/// `[flow]` of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientFlowConfig {
    /// Per-command raw backlog high watermark.
    pub command_high_watermark: u64,
    /// Per-command raw backlog low watermark.
    pub command_low_watermark: u64,
    /// Daemon raw backlog high watermark.
    pub daemon_high_watermark: u64,
    /// Daemon raw backlog low watermark.
    pub daemon_low_watermark: u64,
    /// Unacknowledged bytes per command.
    pub command_send_window: u64,
    /// Unacknowledged bytes per session.
    pub session_send_window: u64,
}

/// `[terminals]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientTerminalsConfig {
    /// Terminals open (or opening) at once on this host.
    pub max_open: u64,
}

/// The validated, immutable `rvbox` configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientConfig {
    /// `[client]`.
    pub client: ClientIdentityConfig,
    /// `[shells]`, resolved.
    pub shells: ShellsConfig,
    /// `[exec]`.
    pub exec: ExecConfig,
    /// `[terminals]`.
    pub terminals: ClientTerminalsConfig,
    /// `[reconnect]`.
    pub reconnect: ReconnectConfig,
    /// `[session]`.
    pub session: ClientSessionConfig,
    /// `[spool]`.
    pub spool: SpoolConfig,
    /// `[flow]`.
    pub flow: ClientFlowConfig,
    /// `[profiles.*]`.
    pub profiles: ProfilesConfig,
    /// `[observability]`.
    pub observability: ObservabilityConfig,
    warnings: Vec<String>,
    summary: String,
}

impl ClientConfig {
    /// Conspicuous warnings, also in the summary.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The redacted, normalized effective configuration, stable key order.
    pub fn summary(&self) -> &str {
        &self.summary
    }
}

/// Checks client id text: 1-128 ASCII letters, digits, '.', '-', '_'.
pub fn check_client_id(id: &str) -> Result<(), String> {
    // One rule for every surface: the domain's client-id parser.
    rvbox_domain::ids::ClientId::parse("client.client_id", id)
        .map(|_| ())
        .map_err(|e| match e {
            rvbox_domain::ids::IdError::Empty { .. } => "must not be empty".to_owned(),
            other => other.to_string().replacen("client.client_id ", "", 1),
        })
}

/// Checks a server URL: `ws://` or `wss://`, a host, no credentials,
/// whitespace or fragment.
pub fn check_server_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("wss://")
        .or_else(|| url.strip_prefix("ws://"))
        .ok_or_else(|| format!("{url:?} must start with ws:// or wss://"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    if authority.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    if authority.contains('@') {
        return Err(format!("{url:?} must not carry credentials (user@host)"));
    }
    if url.contains('#') || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{url:?} must not contain spaces or a fragment"));
    }
    Ok(())
}

fn path_list_text(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.display().to_string()).collect()
}

/// Decodes, merges and validates a client configuration.
pub fn load_client(
    source: &str,
    text: &str,
    flags: &[FlagValue],
    probe: &dyn HostProbe,
) -> Result<ClientConfig, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let doc = decode_file(Daemon::Client, text, &mut errors);
    if errors.errors.iter().any(|e| e.key == "toml") {
        return Err(errors);
    }
    let mut r = Resolved::build(Daemon::Client, &doc, flags, probe, &mut errors);
    let e = &mut errors;

    // [client]
    let client_id = r.text("client.client_id");
    if client_id.is_empty() && matches!(r.origin("client.client_id"), crate::error::Origin::Default)
    {
        e.push(r.error(
            "client.client_id",
            "the host reports no usable host name; set client.client_id",
        ));
    } else if let Err(msg) = check_client_id(&client_id) {
        e.push(r.error("client.client_id", msg));
    }
    let server_urls = r.list("client.server_urls");
    if server_urls.is_empty() {
        e.push(r.error("client.server_urls", "at least one server URL is required"));
    }
    for (i, url) in server_urls.iter().enumerate() {
        if let Err(msg) = check_server_url(url) {
            e.push(r.error("client.server_urls", msg));
        } else if server_urls.iter().take(i).any(|u| u == url) {
            e.push(r.error("client.server_urls", format!("{url:?} is listed twice")));
        }
    }
    let label_items = r.list("client.labels");
    let labels =
        rvbox_domain::labels::Labels::from_assignments(label_items.iter().map(String::as_str))
            .unwrap_or_else(|err| {
                e.push(r.error("client.labels", err.0));
                rvbox_domain::labels::Labels::default()
            });
    let ca_text = r.text("client.ca_file");
    let ca_file = if ca_text.is_empty() {
        None
    } else {
        match existing_file(probe, &ca_text) {
            Ok(p) => {
                r.normalize("client.ca_file", Value::Text(p.display().to_string()));
                Some(p)
            }
            Err(msg) => {
                e.push(r.error("client.ca_file", msg));
                None
            }
        }
    };
    let mut tls_file = |key: &'static str| {
        let text = r.text(key);
        if text.is_empty() {
            return None;
        }
        match existing_file(probe, &text) {
            Ok(p) => {
                r.normalize(key, Value::Text(p.display().to_string()));
                Some(p)
            }
            Err(msg) => {
                e.push(r.error(key, msg));
                None
            }
        }
    };
    let tls_cert = tls_file("client.tls_cert_file");
    let tls_key = tls_file("client.tls_key_file");
    let tls_identity = match (tls_cert, tls_key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            if r.text("client.tls_cert_file").is_empty() != r.text("client.tls_key_file").is_empty()
            {
                e.push(r.error(
                    "client.tls_cert_file",
                    "client.tls_cert_file and client.tls_key_file are set together or not at all",
                ));
            }
            None
        }
    };
    let state_dir = match private_dir(probe, &r.text("client.state_dir")) {
        Ok(p) => p,
        Err(msg) => {
            e.push(r.error("client.state_dir", msg));
            PathBuf::from(r.text("client.state_dir"))
        }
    };
    r.normalize(
        "client.state_dir",
        Value::Text(state_dir.display().to_string()),
    );

    // [shells]: plan §4.3 item 6, resolved once, no environment.
    let mut resolved = Vec::new();
    for (kind, key) in [
        (ShellKind::Sh, "shells.sh"),
        (ShellKind::Bash, "shells.bash"),
    ] {
        let text = r.text(key);
        if text.is_empty() {
            continue;
        }
        match resolve_shell(probe, kind, &text) {
            Ok(shell) => {
                r.normalize(key, Value::Text(shell.executable().display().to_string()));
                resolved.push(shell);
            }
            Err(msg) => {
                e.push(r.error(key, msg));
                r.mark_failed(key);
            }
        }
    }
    let mut foreign = Vec::new();
    for (kind, key) in [
        (ShellKind::Cmd, "shells.cmd"),
        (ShellKind::PowerShell, "shells.powershell"),
    ] {
        let text = r.text(key);
        if text.is_empty() {
            continue;
        }
        match check_windows_path(&text) {
            Ok(()) => foreign.push((kind, text)),
            Err(msg) => e.push(r.error(key, msg)),
        }
    }
    let default_text = r.text("shells.default");
    let default = ShellKind::parse(&default_text).unwrap_or(ShellKind::Sh);
    if !default.is_current_platform() {
        e.push(r.error(
            "shells.default",
            format!("{default} is a Windows shell and cannot be the default on this platform (use sh or bash)"),
        ));
    } else if !resolved.iter().any(|s| s.kind() == default)
        && !r.failed(&format!("shells.{default}"))
    {
        e.push(r.error(
            "shells.default",
            format!(
                "{default} is not a validated shell here: set shells.{default} to its absolute path"
            ),
        ));
    }

    // [exec]
    let mut roots: Vec<PathBuf> = Vec::new();
    let root_texts = r.list("exec.allowed_cwd_roots");
    if root_texts.is_empty() {
        e.push(r.error(
            "exec.allowed_cwd_roots",
            "at least one allowed CWD root is required",
        ));
    }
    for text in &root_texts {
        match existing_dir(probe, text) {
            Ok(p) if roots.contains(&p) => {
                e.push(r.error(
                    "exec.allowed_cwd_roots",
                    format!("{} is listed twice", p.display()),
                ));
            }
            Ok(p) => roots.push(p),
            Err(msg) => {
                e.push(r.error("exec.allowed_cwd_roots", msg));
                r.mark_failed("exec.allowed_cwd_roots");
            }
        }
    }
    r.normalize(
        "exec.allowed_cwd_roots",
        Value::List(path_list_text(&roots)),
    );
    let default_cwd = match existing_dir(probe, &r.text("exec.default_cwd")) {
        Ok(p) => {
            if !r.failed("exec.allowed_cwd_roots") && !roots.iter().any(|root| within(&p, root)) {
                e.push(r.pair_error(
                    "exec.default_cwd",
                    "exec.allowed_cwd_roots",
                    format!(
                        "exec.default_cwd ({}) must lie under one of exec.allowed_cwd_roots",
                        p.display()
                    ),
                ));
            }
            r.normalize("exec.default_cwd", Value::Text(p.display().to_string()));
            p
        }
        Err(msg) => {
            e.push(r.error("exec.default_cwd", msg));
            PathBuf::from(r.text("exec.default_cwd"))
        }
    };

    // plan §4.3 item 8: cross-field invariants.
    require_at_most(&r, "reconnect.initial", "reconnect.max", e);
    require_below(&r, "session.heartbeat_idle", "session.liveness_timeout", e);
    require_below(&r, "spool.closeout_reserve", "spool.command_total", e);
    require_below(&r, "spool.command_total", "spool.daemon_total", e);
    require_at_most(&r, "spool.command_output_window", "spool.command_total", e);
    // a command is accepted only when its worst case fits its total: the
    // output window, the stdin it may hold and its closeout reserve must
    // leave room for at least the smallest command
    let streams = [
        "spool.command_output_window",
        "flow.command_send_window",
        "spool.closeout_reserve",
    ];
    if !streams.iter().any(|k| r.failed(k)) && !r.failed("spool.command_total") {
        let need = streams
            .iter()
            .map(|k| r.num(k))
            .fold(0u64, u64::saturating_add);
        if need >= r.num("spool.command_total") {
            e.push(r.error(
                "spool.command_total",
                format!(
                    "must be above spool.command_output_window + flow.command_send_window + spool.closeout_reserve ({need} bytes): every command is accepted only when its worst case fits"
                ),
            ));
        }
    }
    require_below(
        &r,
        "flow.command_low_watermark",
        "flow.command_high_watermark",
        e,
    );
    require_below(
        &r,
        "flow.daemon_low_watermark",
        "flow.daemon_high_watermark",
        e,
    );
    require_at_most(
        &r,
        "flow.command_high_watermark",
        "flow.daemon_high_watermark",
        e,
    );
    require_below(&r, "flow.command_send_window", "spool.command_total", e);
    require_below(&r, "flow.session_send_window", "spool.daemon_total", e);
    require_at_most(
        &r,
        "flow.command_send_window",
        "flow.session_send_window",
        e,
    );

    let profiles = build_profiles(&doc.profiles, e);
    let observability = observability(&r, e);
    if !errors.is_empty() {
        return Err(errors);
    }
    let warnings = Vec::new();
    let summary = render(Daemon::Client, source, &r, Some(&profiles), &warnings);
    Ok(ClientConfig {
        client: ClientIdentityConfig {
            client_id,
            server_urls,
            ca_file,
            tls_identity,
            state_dir,
            labels,
        },
        shells: ShellsConfig::new(resolved, default, foreign),
        exec: ExecConfig {
            allowed_cwd_roots: roots,
            default_cwd,
            max_running: r.num("exec.max_running"),
            max_queued: r.num("exec.max_queued"),
            drain_grace: r.duration("exec.drain_grace"),
            kill_grace: r.duration("exec.kill_grace"),
            diagnostics_interval: r.duration("exec.diagnostics_interval"),
            suspected_hung_after: r.duration("exec.suspected_hung_after"),
        },
        terminals: ClientTerminalsConfig {
            max_open: r.num("terminals.max_open"),
        },
        reconnect: ReconnectConfig {
            initial: r.duration("reconnect.initial"),
            max: r.duration("reconnect.max"),
            stable_reset: r.duration("reconnect.stable_reset"),
        },
        session: ClientSessionConfig {
            heartbeat_idle: r.duration("session.heartbeat_idle"),
            liveness_timeout: r.duration("session.liveness_timeout"),
        },
        spool: SpoolConfig {
            command_output_window: r.num("spool.command_output_window"),
            command_total: r.num("spool.command_total"),
            daemon_total: r.num("spool.daemon_total"),
            closeout_reserve: r.num("spool.closeout_reserve"),
            free_space_floor: r.num("spool.free_space_floor"),
            tombstones: r.num("spool.tombstones"),
        },
        flow: ClientFlowConfig {
            command_high_watermark: r.num("flow.command_high_watermark"),
            command_low_watermark: r.num("flow.command_low_watermark"),
            daemon_high_watermark: r.num("flow.daemon_high_watermark"),
            daemon_low_watermark: r.num("flow.daemon_low_watermark"),
            command_send_window: r.num("flow.command_send_window"),
            session_send_window: r.num("flow.session_send_window"),
        },
        profiles,
        observability,
        warnings,
        summary,
    })
}
