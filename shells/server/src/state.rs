//! What the daemon's tasks share: the configuration they read, the
//! metrics, the store's health once it is open, and the way into the
//! core once it serves.
//!
//! Every lock here guards a pointer-sized value or the metrics registry
//! and is held only to copy or render; none is held across I/O.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use prometheus_client::registry::Registry;
use rvbox_proto::v1 as wire;
use rvbox_store::health::Health;
use tokio::sync::mpsc;

use crate::core_loop::ToCore;
use crate::metrics::ServerMetrics;

/// The daemon's shared state.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The daemon's own metrics.
    pub(crate) metrics: Arc<ServerMetrics>,
    registry: RwLock<Registry>,
    /// `server.agent_path`.
    pub(crate) agent_path: String,
    /// `server.allowed_origins`.
    pub(crate) allowed_origins: Vec<String>,
    /// `limits.max_envelope`.
    pub(crate) max_envelope: usize,
    /// `server.client_identity` (and its header and proxies).
    pub(crate) identity: rvbox_config::ClientIdentity,
    /// The next agent connection id.
    pub(crate) next_conn: AtomicU64,
    health: OnceLock<Health>,
    core: RwLock<Option<mpsc::Sender<ToCore>>>,
    /// Why the store could not be opened, when it could not.
    failed: OnceLock<String>,
    /// Agent sockets whose tasks still run.
    live_sockets: AtomicUsize,
    sockets_gone: tokio::sync::Notify,
    /// Edge audit records on their way to the core (`edge_audit`).
    edge_audits: OnceLock<mpsc::Sender<rvbox_store_port::audit::SessionAudit>>,
}

/// Counts one agent socket until dropped.
#[derive(Debug)]
pub(crate) struct LiveSocket<'a>(&'a Shared);

impl Drop for LiveSocket<'_> {
    fn drop(&mut self) {
        if self.0.live_sockets.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.sockets_gone.notify_waiters();
        }
    }
}

impl Shared {
    pub(crate) fn new(
        agent_path: String,
        allowed_origins: Vec<String>,
        max_envelope: usize,
        identity: rvbox_config::ClientIdentity,
    ) -> Self {
        let metrics = Arc::new(ServerMetrics::default());
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        Self {
            metrics,
            registry: RwLock::new(registry),
            agent_path,
            allowed_origins,
            max_envelope,
            identity,
            next_conn: AtomicU64::new(1),
            health: OnceLock::new(),
            core: RwLock::new(None),
            failed: OnceLock::new(),
            live_sockets: AtomicUsize::new(0),
            sockets_gone: tokio::sync::Notify::new(),
            edge_audits: OnceLock::new(),
        }
    }

    /// Where edge audit records go (`edge_audit::start`).
    pub(crate) fn set_edge_audits(&self, tx: mpsc::Sender<rvbox_store_port::audit::SessionAudit>) {
        let _ = self.edge_audits.set(tx);
    }

    /// Hands an edge audit record towards the core; never waits (a full
    /// queue, or none yet, drops it, counted).
    pub(crate) fn edge_audit(&self, record: rvbox_store_port::audit::SessionAudit) {
        let sent = self
            .edge_audits
            .get()
            .is_some_and(|tx| tx.try_send(record).is_ok());
        if !sent {
            self.metrics.edge_audits_dropped.inc();
        }
    }

    /// An agent socket's tasks start; they end when the guard drops.
    pub(crate) fn socket_started(&self) -> LiveSocket<'_> {
        self.live_sockets.fetch_add(1, Ordering::AcqRel);
        LiveSocket(self)
    }

    /// Waits until every agent socket's tasks ended (their close frames
    /// written), at most `max`; returns how many were still running.
    pub(crate) async fn sockets_ended(&self, max: std::time::Duration) -> usize {
        let until = tokio::time::Instant::now() + max;
        loop {
            let waiting = self.sockets_gone.notified();
            tokio::pin!(waiting);
            waiting.as_mut().enable();
            let live = self.live_sockets.load(Ordering::Acquire);
            if live == 0 {
                return 0;
            }
            if tokio::time::timeout_at(until, waiting).await.is_err() {
                return self.live_sockets.load(Ordering::Acquire);
            }
        }
    }

    /// Adds metrics to the registry (the store's, once it is open).
    pub(crate) fn register(&self, f: impl FnOnce(&mut Registry)) {
        if let Ok(mut r) = self.registry.write() {
            f(&mut r);
        }
    }

    /// The Prometheus text of every registered metric.
    pub(crate) fn render_metrics(&self) -> Result<String, String> {
        let r = self
            .registry
            .read()
            .map_err(|_| "metrics registry poisoned".to_owned())?;
        rvbox_store::metrics::render(&r).map_err(|e| e.to_string())
    }

    /// The store's health, once the store is open.
    pub(crate) fn set_health(&self, health: Health) {
        let _ = self.health.set(health);
    }

    /// The store could not be opened or recovered.
    pub(crate) fn set_failed(&self, why: String) {
        let _ = self.failed.set(why);
    }

    /// The core starts serving.
    pub(crate) fn set_core(&self, tx: Option<mpsc::Sender<ToCore>>) {
        if let Ok(mut c) = self.core.write() {
            self.metrics.ready.set(i64::from(tx.is_some()));
            *c = tx;
        }
    }

    /// The way into the core while it serves.
    pub(crate) fn core(&self) -> Option<mpsc::Sender<ToCore>> {
        self.core.read().ok().and_then(|c| c.clone())
    }

    /// Global readiness: the store recovered with every required scope
    /// ready, and the core serving.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        if let Some(why) = self.failed.get() {
            return Err(format!("store failed to open: {why}"));
        }
        let Some(health) = self.health.get() else {
            return Err("store opening".into());
        };
        let report = health.report(crate::core_loop::Clock::wall_ms());
        if !report.ready {
            let states: Vec<String> = report
                .scopes
                .iter()
                .filter(|s| s.state != wire::ScopeState::Ready as i32)
                .map(|s| {
                    format!(
                        "{} {} {}",
                        wire::ScopeKind::try_from(s.scope_kind)
                            .map_or("UNKNOWN", |k| k.as_str_name()),
                        s.scope_key,
                        wire::ScopeState::try_from(s.state).map_or("UNKNOWN", |k| k.as_str_name())
                    )
                })
                .collect();
            return Err(states.join(", "));
        }
        if self.core().is_none() {
            return Err("server core not serving".into());
        }
        Ok(())
    }
}
