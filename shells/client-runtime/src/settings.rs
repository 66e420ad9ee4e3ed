//! The validated client configuration as the client core and the
//! supervisor take it: one mapping, so no key is read in two places and
//! none is left at its default by omission.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::ClientCoreConfig;
use rvbox_client_core::process::Supervision;
use rvbox_client_core::spool::SpoolLimits;
use rvbox_config::{ClientConfig, ShellKind};
use rvbox_domain::ids::{ClientId, InstanceId};
use rvbox_proto::v1 as wire;

use crate::profiles::CompiledProfiles;

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn shell_type(kind: ShellKind) -> wire::ShellType {
    match kind {
        ShellKind::Sh => wire::ShellType::Sh,
        ShellKind::Bash => wire::ShellType::Bash,
        ShellKind::Cmd => wire::ShellType::Cmd,
        ShellKind::PowerShell => wire::ShellType::Powershell,
    }
}

fn path_text(p: &std::path::Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A configuration the core cannot take (the configuration's own
/// validation makes these unreachable; named, not assumed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientSettingsError {
    /// `client.client_id`.
    #[error("client.client_id: {0}")]
    ClientId(String),
    /// A count above what the wire carries.
    #[error("{0}: above 4294967295")]
    Count(&'static str),
    /// No shell is advertised.
    #[error("shells: no shell of this platform validated")]
    NoShell,
}

/// Maps a validated configuration, the installation's identity, how the
/// supervisor supervises and the profiles compiled against it.
///
/// # Errors
/// [`ClientSettingsError`] naming the key the core refuses.
pub fn client_core_config(
    cfg: &ClientConfig,
    instance: &InstanceId,
    supervision: Supervision,
    profiles: &CompiledProfiles,
) -> Result<ClientCoreConfig, ClientSettingsError> {
    let client_id = ClientId::parse("client.client_id", &cfg.client.client_id)
        .map_err(|e| ClientSettingsError::ClientId(e.to_string()))?;
    let shells: Vec<wire::ShellType> = cfg
        .shells
        .advertised()
        .into_iter()
        .map(shell_type)
        .collect();
    if shells.is_empty() {
        return Err(ClientSettingsError::NoShell);
    }
    let default_shell = shell_type(cfg.shells.default_kind());
    let shell_paths: BTreeMap<i32, String> = cfg
        .shells
        .advertised()
        .into_iter()
        .filter_map(|k| {
            cfg.shells
                .executable_for(k)
                .map(|s| (shell_type(k) as i32, path_text(s.executable())))
        })
        .collect();
    let max_running = u32::try_from(cfg.exec.max_running)
        .map_err(|_| ClientSettingsError::Count("exec.max_running"))?;
    let max_queued = u32::try_from(cfg.exec.max_queued)
        .map_err(|_| ClientSettingsError::Count("exec.max_queued"))?;
    let cwd_roots: Vec<String> = cfg
        .exec
        .allowed_cwd_roots
        .iter()
        .map(|p| path_text(p))
        .collect();
    let default_cwd = path_text(&cfg.exec.default_cwd);
    let hello = wire::ClientHello {
        client_id: client_id.as_str().to_owned(),
        client_instance_id: instance.to_string(),
        protocol_major: 1,
        supported_minors: vec![0],
        capabilities: Some(wire::Capabilities {
            platform: Some(wire::Platform {
                os: std::env::consts::OS.into(),
                arch: std::env::consts::ARCH.into(),
                os_release: os_release(),
            }),
            software_version: env!("CARGO_PKG_VERSION").into(),
            shells: shells
                .iter()
                .map(|s| wire::ShellCapability {
                    shell_type: *s as i32,
                    platform_default: *s == default_shell,
                })
                .collect(),
            profiles: profiles.advertised(),
            max_running,
            max_queued,
            supervision_mode: supervision.to_wire() as i32,
        }),
        cwd_policy: Some(wire::CwdPolicy {
            default_cwd: default_cwd.clone(),
            allowed_roots: cwd_roots.clone(),
        }),
        labels: cfg.client.labels.to_wire(),
    };
    Ok(ClientCoreConfig {
        policy: AcceptPolicy {
            client_id,
            shells,
            default_shell,
            profiles: profiles.enforceable.clone(),
            cwd_roots,
            default_cwd,
            max_running,
            max_queued,
            closeout_reserve: cfg.spool.closeout_reserve,
            storage_budget: cfg.spool.daemon_total,
            command_total: cfg.spool.command_total,
            command_streams: cfg
                .spool
                .command_output_window
                .saturating_add(cfg.flow.command_send_window),
            free_space_floor: cfg.spool.free_space_floor,
        },
        link: LinkConfig {
            reconnect_initial_ms: ms(cfg.reconnect.initial),
            reconnect_max_ms: ms(cfg.reconnect.max),
            stable_reset_ms: ms(cfg.reconnect.stable_reset),
            heartbeat_idle_ms: ms(cfg.session.heartbeat_idle),
            liveness_timeout_ms: ms(cfg.session.liveness_timeout),
            command_window: cfg.flow.command_send_window,
            session_window: cfg.flow.session_send_window,
        },
        spool: SpoolLimits {
            command_high: cfg.flow.command_high_watermark,
            command_low: cfg.flow.command_low_watermark,
            daemon_high: cfg.flow.daemon_high_watermark,
            daemon_low: cfg.flow.daemon_low_watermark,
            command_window: cfg.flow.command_send_window,
            session_window: cfg.flow.session_send_window,
            output_window: cfg.spool.command_output_window,
            daemon_output: cfg.spool.daemon_total,
        },
        shell_paths,
        profiles: profiles.limits.clone(),
        hello,
        terminals: rvbox_client_core::machine::TerminalLimits {
            // at most 1024 (the key's ceiling)
            max_open: u32::try_from(cfg.terminals.max_open).unwrap_or(u32::MAX),
        },
    })
}

/// The supervisor's configuration: the launcher (this binary), the run
/// directory under the state directory, the exec timings, and the shells
/// with the identities the configuration recorded at validation.
#[must_use]
pub fn supervisor_config(
    cfg: &ClientConfig,
    launcher: PathBuf,
) -> rvbox_supervisor::SupervisorConfig {
    let mut c = rvbox_supervisor::SupervisorConfig::new(launcher, cfg.client.state_dir.join("run"));
    c.drain_grace = cfg.exec.drain_grace;
    c.kill_grace = cfg.exec.kill_grace;
    c.diagnostics_interval = cfg.exec.diagnostics_interval;
    c.suspected_hung_after = cfg.exec.suspected_hung_after;
    c.cwd_roots.clone_from(&cfg.exec.allowed_cwd_roots);
    c.handover = rvbox_supervisor::HandoverBounds::for_watermarks(
        cfg.flow.command_high_watermark,
        cfg.flow.daemon_high_watermark,
    );
    for kind in cfg.shells.advertised() {
        if let Some(s) = cfg.shells.executable_for(kind) {
            c.shells.insert(s.executable().to_path_buf(), s.identity());
        }
    }
    c
}

/// The kernel release (`uname -r`), bounded; empty when unreadable.
fn os_release() -> String {
    let s = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    // the wire bound is 64 bytes; cut at a character boundary
    let mut out = String::new();
    for c in s.trim_end().chars() {
        if out.len() + c.len_utf8() > 64 {
            break;
        }
        out.push(c);
    }
    out
}
