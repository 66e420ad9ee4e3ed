//! The server daemon's own metrics (plan §11.1), beside the store's: every
//! label is a bounded name (a close reason, a refusal cause, a session
//! counter and its reason), never a client id or a command UUID.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A session counter and its reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SessionLabel {
    /// Counter name (the session core's bounded set).
    pub(crate) name: &'static str,
    /// Reason, or empty.
    pub(crate) reason: &'static str,
}

/// A bounded reason word.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    /// The reason.
    pub(crate) reason: &'static str,
}

/// Every metric of the daemon shell.
#[derive(Debug, Default)]
pub(crate) struct ServerMetrics {
    /// Agent connections the core holds.
    pub(crate) connections: Gauge,
    /// Session counters the core emitted.
    pub(crate) sessions: Family<SessionLabel, Counter>,
    /// Connections closed by the core, by close reason.
    pub(crate) closes: Family<ReasonLabel, Counter>,
    /// Upgrade requests refused before a WebSocket existed, by cause.
    pub(crate) upgrades_refused: Family<ReasonLabel, Counter>,
    /// Messages refused by the reader before decode, by cause.
    pub(crate) messages_refused: Family<ReasonLabel, Counter>,
    /// Connections closed because the core's inbox was full.
    pub(crate) inbox_full: Counter,
    /// Frame bytes waiting in the core's inbox (its byte bound).
    pub(crate) inbox_bytes: Gauge,
    /// Frames not written within the write deadline.
    pub(crate) write_timeouts: Counter,
    /// `accept` failures, by cause (`fd_limit`, `other`).
    pub(crate) accept_errors: Family<ReasonLabel, Counter>,
    /// The soft limit on open file descriptors, read at startup.
    pub(crate) fd_limit: Gauge,
    /// 1 once the store has recovered and the core serves.
    pub(crate) ready: Gauge,
    /// Times a batch found the executor gone.
    pub(crate) executor_gone: Counter,
    /// Terminal events of the core, by event (docs/terminals.md).
    pub(crate) terminals: Family<ReasonLabel, Counter>,
    /// The core's terminal counters last exported.
    terminals_seen: std::sync::Mutex<[u64; TERMINAL_EVENTS.len()]>,
    /// Store pass and dispatch latencies.
    pub(crate) latencies: Latencies,
    /// Store operations answered `UNAVAILABLE` (a store failure, not a
    /// refusal), by operation.
    pub(crate) store_failures: Family<OpLabel, Counter>,
    /// Store operations submitted to the executor and not yet performed.
    pub(crate) store_queued: Gauge,
    /// Edge audit records dropped before the core (its queue full, or the
    /// core not serving).
    pub(crate) edge_audits_dropped: Counter,
    /// Dispatch waits the core could not keep between two exports.
    dispatch_waits_dropped: Counter,
    dispatch_dropped_seen: std::sync::atomic::AtomicU64,
}

/// A store operation's bounded name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabel {
    /// `StoreOp::name`.
    pub(crate) op: &'static str,
}

/// The latency histograms.
#[derive(Debug)]
pub(crate) struct Latencies {
    /// One pass of the store executor: its operations, transactions and
    /// durable commits (seconds).
    pub(crate) store_pass: Histogram,
    /// From a command's creation to its dispatch being durable (seconds).
    pub(crate) dispatch: Histogram,
}

impl Default for Latencies {
    fn default() -> Self {
        Self {
            store_pass: Histogram::new([
                0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            dispatch: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 60.0, 300.0, 3600.0,
                86_400.0,
            ]),
        }
    }
}

/// The terminal counters of the core, by their bounded event name.
const TERMINAL_EVENTS: [&str; 9] = [
    "mutation",
    "report_recorded",
    "gap",
    "report_refused",
    "failure",
    "sync",
    "input_sent",
    "idle_closed",
    "queue_full",
];

impl ServerMetrics {
    /// Counts one session counter.
    pub(crate) fn session(&self, name: &'static str, reason: Option<&'static str>) {
        self.sessions
            .get_or_create(&SessionLabel {
                name,
                reason: reason.unwrap_or(""),
            })
            .inc();
    }

    /// Exports what the core's terminal counters moved since the last call.
    pub(crate) fn terminal_stats(&self, s: &rvbox_server_core::EngineStats) {
        let now = [
            s.pty_mutations,
            s.pty_reports,
            s.pty_gaps,
            s.pty_refused,
            s.pty_failures,
            s.pty_syncs,
            s.pty_inputs_sent,
            s.pty_idle_closed,
            s.pty_queue_full,
        ];
        let Ok(mut seen) = self.terminals_seen.lock() else {
            return;
        };
        for ((reason, n), last) in TERMINAL_EVENTS.iter().zip(now).zip(seen.iter_mut()) {
            if n > *last {
                self.terminals
                    .get_or_create(&ReasonLabel { reason })
                    .inc_by(n - *last);
                *last = n;
            }
        }
    }

    /// Records one pass of the store executor.
    pub(crate) fn store_pass(&self, pass: &rvbox_engine::PassReport) {
        self.latencies
            .store_pass
            .observe(pass.elapsed.as_secs_f64());
        for op in &pass.failed {
            self.store_failures.get_or_create(&OpLabel { op }).inc();
        }
        self.store_queued
            .set(i64::try_from(pass.queued).unwrap_or(i64::MAX));
    }

    /// Records the dispatch waits the core measured (ms), and the ones it
    /// could not keep (its running count).
    pub(crate) fn dispatch_waits(&self, waits: &[u64], dropped_total: u64) {
        for ms in waits {
            #[allow(clippy::cast_precision_loss)]
            self.latencies.dispatch.observe(*ms as f64 / 1000.0);
        }
        let seen = self
            .dispatch_dropped_seen
            .swap(dropped_total, std::sync::atomic::Ordering::Relaxed);
        if dropped_total > seen {
            self.dispatch_waits_dropped.inc_by(dropped_total - seen);
        }
    }

    /// Counts one close by the core.
    pub(crate) fn closed(&self, reason: &'static str) {
        self.closes.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts one refused upgrade.
    pub(crate) fn upgrade_refused(&self, reason: &'static str) {
        self.upgrades_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Counts one refused message.
    pub(crate) fn message_refused(&self, reason: &'static str) {
        self.messages_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Registers every metric under the `rvbox_server` prefix.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("rvbox_server");
        r.register(
            "agent_connections",
            "Agent connections the server core holds",
            self.connections.clone(),
        );
        r.register(
            "session_events",
            "Session state changes and failures, by counter and reason",
            self.sessions.clone(),
        );
        r.register(
            "terminal_events",
            "Terminal mutations, client reports, gaps, refusals, failures, syncs, input frames, idle closes and queue overflows of the server core, by event",
            self.terminals.clone(),
        );
        r.register(
            "agent_closes",
            "Agent connections closed by the server, by close reason",
            self.closes.clone(),
        );
        r.register(
            "agent_upgrades_refused",
            "WebSocket upgrade requests refused, by cause",
            self.upgrades_refused.clone(),
        );
        r.register(
            "agent_messages_refused",
            "Agent messages refused before decode, by cause",
            self.messages_refused.clone(),
        );
        r.register(
            "inbox_full",
            "Agent connections closed because the core's inbox was full",
            self.inbox_full.clone(),
        );
        r.register(
            "inbox_bytes",
            "Agent frame bytes waiting in the core's inbox",
            self.inbox_bytes.clone(),
        );
        r.register(
            "write_timeouts",
            "Agent frames not written within the write deadline",
            self.write_timeouts.clone(),
        );
        r.register(
            "accept_errors",
            "Failed accepts on the agent listener, by cause",
            self.accept_errors.clone(),
        );
        r.register(
            "fd_limit",
            "Soft limit on open file descriptors at startup",
            self.fd_limit.clone(),
        );
        r.register(
            "ready",
            "1 once the store has recovered and the server serves",
            self.ready.clone(),
        );
        r.register(
            "store_pass_seconds",
            "One pass of the store executor: its operations, transactions and durable commits (the store's write latency)",
            self.latencies.store_pass.clone(),
        );
        r.register(
            "store_failures",
            "Store operations that failed (answered UNAVAILABLE; refusals are not counted), by operation",
            self.store_failures.clone(),
        );
        r.register(
            "store_queued_ops",
            "Store operations handed to the executor and not yet performed",
            self.store_queued.clone(),
        );
        r.register(
            "dispatch_seconds",
            "From a command's creation to its dispatch being durable (the dispatch latency)",
            self.latencies.dispatch.clone(),
        );
        r.register(
            "edge_audits_dropped",
            "Audit records of reads and edge refusals dropped before the core (queue full or the core not serving); the core's rate limit counts its own in session_events",
            self.edge_audits_dropped.clone(),
        );
        r.register(
            "dispatch_waits_dropped",
            "Dispatch latencies not recorded because too many waited to be exported",
            self.dispatch_waits_dropped.clone(),
        );
        r.register(
            "executor_gone",
            "Store operation batches that found the executor stopped",
            self.executor_gone.clone(),
        );
    }
}
