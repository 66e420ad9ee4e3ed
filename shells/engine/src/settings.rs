//! The validated server configuration, as the store, the session core and
//! the dispatch core take it: one mapping, so no key is read in two places
//! and none is left at its default by omission.

use rvbox_config::{ServerConfig, SqliteSynchronous};
use rvbox_dispatch::{RetryPolicy, RetryPolicyError};
use rvbox_session::{ServerIdentity, SessionConfig};
use rvbox_store::StoreOptions;
use rvbox_store::db::Synchronous;

/// What a server runs with, from its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    /// The store's options.
    pub store: StoreOptions,
    /// Every session's configuration.
    pub session: SessionConfig,
    /// The transient-rejection backoff.
    pub retry: RetryPolicy,
    /// The ingress gate's high and low watermarks (bytes).
    pub ingress: (u64, u64),
    /// When append groups go to the store (`storage.group_commit_*`).
    pub group: rvbox_server_core::GroupPolicy,
    /// Lifetime of an operator's takeover grant
    /// (`session.takeover_grant_ttl`).
    pub takeover_ttl_ms: u64,
    /// The terminal policy (`terminals.*`).
    pub pty: rvbox_server_core::PtyPolicy,
}

/// A configuration the cores cannot take (the configuration's own
/// validation makes these unreachable; they are named, not assumed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The retry keys.
    #[error("queue.retry_initial / queue.retry_max: {0}")]
    Retry(#[from] RetryPolicyError),
    /// The session keys.
    #[error("session or flow limits: {0}")]
    Session(String),
    /// The group-commit keys.
    #[error("storage.group_commit_max_batch: {0}")]
    GroupCommit(String),
}

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Maps a validated configuration.
///
/// # Errors
/// [`SettingsError`] naming the keys the cores refuse.
pub fn server_settings(
    cfg: &ServerConfig,
    identity: ServerIdentity,
) -> Result<ServerSettings, SettingsError> {
    let mut store = StoreOptions::default();
    store.db.synchronous = match cfg.storage.sqlite_synchronous {
        SqliteSynchronous::Full => Synchronous::Full,
        SqliteSynchronous::Extra => Synchronous::Extra,
    };
    store.tiers.command_total = cfg.storage.command_total;
    store.tiers.closeout_reserve = cfg.storage.closeout_reserve;
    store.tiers.command_output_window = cfg.storage.command_output_window;
    store.tiers.per_owner_total = cfg.storage.per_client_total;
    store.tiers.global_total = cfg.storage.server_total;
    store.tiers.free_space_floor = cfg.storage.free_space_floor;
    store.seal_bytes = cfg.storage.segment_seal_size;
    store.tombstone_cap = cfg.storage.tombstones;
    store.terminal_retention_ms = cfg.storage.terminal_retention.map_or(0, ms);
    store.scrub_interval_ms = cfg.storage.scrub_interval.map_or(0, ms);
    store.queue_ttl_ms = cfg.queue.ttl.map_or(0, ms);
    store.queue_max_per_client = cfg.queue.max_per_client;
    store.queue_max_total = cfg.queue.max_total;
    store.audit_budget_bytes = cfg.audit.max_bytes;
    store.audit_retention_ms = cfg.audit.retention.map_or(0, ms);

    let mut session = SessionConfig::new(identity);
    session.limits.heartbeat_idle_ms = ms(cfg.session.heartbeat_idle);
    session.limits.liveness_timeout_ms = ms(cfg.session.liveness_timeout);
    session.hello_timeout_ms = ms(cfg.session.liveness_timeout);
    session.reconcile_timeout_ms = ms(cfg.session.reconcile_timeout);
    session.limits.max_envelope_bytes = cfg.limits.max_envelope;
    session.limits.command_window_bytes = cfg.flow.command_send_window;
    session.limits.session_window_bytes = cfg.flow.session_send_window;
    session
        .validate()
        .map_err(|e| SettingsError::Session(e.to_string()))?;

    let retry = RetryPolicy::new(ms(cfg.queue.retry_initial), ms(cfg.queue.retry_max))?;
    Ok(ServerSettings {
        store,
        session,
        retry,
        ingress: (
            cfg.flow.ingress_high_watermark,
            cfg.flow.ingress_low_watermark,
        ),
        group: rvbox_server_core::GroupPolicy {
            max_delay_ms: ms(cfg.storage.group_commit_max_delay),
            max_events: usize::try_from(cfg.storage.group_commit_max_batch)
                .map_err(|_| SettingsError::GroupCommit("out of range".into()))?,
        },
        takeover_ttl_ms: ms(cfg.session.takeover_grant_ttl),
        pty: rvbox_server_core::PtyPolicy {
            limits: rvbox_store_port::pty::PtyLimits {
                per_client: u32::try_from(cfg.terminals.max_per_client).unwrap_or(u32::MAX),
                per_server: u32::try_from(cfg.terminals.max_open).unwrap_or(u32::MAX),
                recording_bytes: cfg.terminals.recording_bytes,
            },
            idle_timeout_ms: cfg.terminals.idle_timeout.map_or(0, ms),
        },
    })
}
