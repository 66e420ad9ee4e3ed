//! Store metrics (plan §11.1): counters for every state change and failure
//! of the store, with bounded labels only (an error code, a quota tier, an
//! incident kind, a recovery step, a retention cause), never a command or
//! client id. The server shell registers them with its Prometheus registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A stable RVBox error code name (`QUOTA_EXCEEDED`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    /// Event name.
    pub event: &'static str,
}

/// Label of an error code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// Error code name.
    pub code: &'static str,
}

/// A quota tier name (`owner_total`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// Tier name.
    pub tier: &'static str,
}

/// How a stdin write was settled (`written`, `discarded`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeliveryLabel {
    /// Delivery.
    pub delivery: &'static str,
}

/// An incident kind name (`INCIDENT_KIND_CHECKSUM_MISMATCH`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Incident kind.
    pub kind: &'static str,
}

/// A recovery step (`tail_truncated`, `segment_damaged`, `orphan_removed`,
/// `session_closed`, `integrity_failed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabel {
    /// Step name.
    pub step: &'static str,
}

/// A retention cause (`client_quota`, `terminal_age`, a truncation source, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// Cause name.
    pub cause: &'static str,
}

/// A lifecycle a server-side transition moved a command to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabel {
    /// Target lifecycle (or `requeued`, `expired_pending`).
    pub to: &'static str,
}

fn group_sizes() -> Histogram {
    Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0])
}

/// Every store metric. Cheap to clone (shared counters).
#[derive(Clone, Debug)]
pub struct StoreMetrics {
    /// Events made durable.
    pub events_appended: Counter,
    /// Identical repeats acknowledged again.
    pub events_duplicate: Counter,
    /// Events refused, by code.
    pub events_refused: Family<CodeLabel, Counter>,
    /// Groups made durable.
    pub groups_committed: Counter,
    /// Groups that failed (nothing acknowledged).
    pub groups_failed: Counter,
    /// Events per durable group.
    pub group_events: Histogram,
    /// Segment files created.
    pub segments_created: Counter,
    /// Command write groups committed (several single-command writes in
    /// one transaction).
    pub write_groups_committed: Counter,
    /// Command write groups rolled back (none of their writes kept).
    pub write_groups_failed: Counter,
    /// Writes per committed command write group.
    pub write_group_writes: Histogram,
    /// Groups made durable through the group journal.
    pub journal_groups: Counter,
    /// Server-side command transitions, by target.
    pub command_transitions: Family<TransitionLabel, Counter>,
    /// Client sessions registered.
    pub sessions_registered: Counter,
    /// Live sessions fenced by a newer registration.
    pub sessions_fenced: Counter,
    /// Registrations rejected as a live conflict (pending claim recorded).
    pub live_conflicts: Counter,
    /// Writes refused because the session they were made for is no longer
    /// its client's live one (fencing, docs/scaleout.md).
    pub writes_fenced: Counter,
    /// Group journal checkpoints.
    pub journal_checkpoints: Counter,
    /// The WAL checkpointer's counters (checkpoint.rs).
    pub checkpoint: crate::checkpoint::CheckpointMetrics,
    /// Signals recorded for delivery (operator signals and late-acceptance
    /// terminations).
    pub signals_recorded: Counter,
    /// Stdin writes recorded for delivery (`AppendStdin`, `CloseStdin`).
    pub stdin_writes: Counter,
    /// Stdin writes settled by the client's acknowledgement, by delivery
    /// (`written`, `discarded`).
    pub stdin_acks: Family<DeliveryLabel, Counter>,
    /// Commands created (`RunCommand`).
    pub commands_created: Counter,
    /// Commands refused, by code.
    pub commands_refused: Family<CodeLabel, Counter>,
    /// Reserve refusals, by tier.
    pub quota_refusals: Family<TierLabel, Counter>,
    /// Storage incidents recorded, by kind.
    pub incidents: Family<KindLabel, Counter>,
    /// Recovery actions, by step.
    pub recovery: Family<StepLabel, Counter>,
    /// Background scrub actions, by step.
    pub scrub: Family<StepLabel, Counter>,
    /// Output rotations, by truncation source.
    pub rotations: Family<CauseLabel, Counter>,
    /// Output events dropped at arrival (a truncation record in their
    /// place) because active data alone filled a quota, by source.
    pub output_dropped: Family<CauseLabel, Counter>,
    /// Whole commands evicted, by cause.
    pub evictions: Family<CauseLabel, Counter>,
    /// Evictions that failed (recorded as incidents, rolled forward later).
    pub eviction_failures: Counter,
    /// Audit records moved into audit segments.
    pub audit_records: Counter,
    /// Outbox flushes that failed (the records stay in the outbox).
    pub audit_flush_failures: Counter,
    /// Best-effort audit records dropped because the outbox was full.
    pub audit_dropped: Counter,
    /// Closed sessions deleted beyond the kept number per client.
    pub sessions_pruned: Counter,
    /// Idle clients deleted by maintenance.
    pub clients_pruned: Counter,
    /// Fleet run events by kind.
    pub fleet_runs: Family<EventLabel, Counter>,
    /// Fleet targets released (commands created for them).
    pub fleet_targets_released: Counter,
    /// Scripts that failed verification, by stage (`upload`: the bytes do
    /// not match their descriptor; `readback`: the written segment did not
    /// read back clean).
    pub script_verification_failures: Family<StepLabel, Counter>,
    /// Ranges of events a client had acknowledged that the store no
    /// longer held (a restore from an older backup), recorded as lost at
    /// reconciliation.
    pub events_lost_at_reconcile: Counter,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self {
            events_appended: Counter::default(),
            events_duplicate: Counter::default(),
            events_refused: Family::default(),
            groups_committed: Counter::default(),
            groups_failed: Counter::default(),
            group_events: group_sizes(),
            segments_created: Counter::default(),
            write_groups_committed: Counter::default(),
            write_groups_failed: Counter::default(),
            write_group_writes: Histogram::new([
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
            ]),
            journal_groups: Counter::default(),
            command_transitions: Family::default(),
            sessions_registered: Counter::default(),
            sessions_fenced: Counter::default(),
            live_conflicts: Counter::default(),
            writes_fenced: Counter::default(),
            journal_checkpoints: Counter::default(),
            checkpoint: crate::checkpoint::CheckpointMetrics::default(),
            signals_recorded: Counter::default(),
            stdin_writes: Counter::default(),
            stdin_acks: Family::default(),
            commands_created: Counter::default(),
            commands_refused: Family::default(),
            quota_refusals: Family::default(),
            incidents: Family::default(),
            recovery: Family::default(),
            scrub: Family::default(),
            rotations: Family::default(),
            output_dropped: Family::default(),
            evictions: Family::default(),
            eviction_failures: Counter::default(),
            audit_records: Counter::default(),
            audit_flush_failures: Counter::default(),
            audit_dropped: Counter::default(),
            sessions_pruned: Counter::default(),
            clients_pruned: Counter::default(),
            fleet_runs: Family::default(),
            fleet_targets_released: Counter::default(),
            script_verification_failures: Family::default(),
            events_lost_at_reconcile: Counter::default(),
        }
    }
}

impl StoreMetrics {
    /// Counts a fleet run event (`created`, `refused`, `signalled`,
    /// `cancelled`, `paused`, `resumed`).
    pub fn fleet_event(&self, event: &'static str) {
        self.fleet_runs.get_or_create(&EventLabel { event }).inc();
    }

    /// Counts fleet targets released (their commands created).
    pub fn fleet_released(&self, n: usize) {
        self.fleet_targets_released.inc_by(n as u64);
    }

    /// Counts a script that failed verification at `stage`.
    pub fn script_verification(&self, stage: &'static str) {
        self.script_verification_failures
            .get_or_create(&StepLabel { step: stage })
            .inc();
    }

    /// Counts a server-side command transition.
    pub fn command_transition(&self, to: &'static str) {
        self.command_transitions
            .get_or_create(&TransitionLabel { to })
            .inc();
    }

    /// Registers every metric under the `rvbox_store` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("rvbox_store");
        r.register(
            "script_verification_failures",
            "Scripts that failed verification, by step (upload: bytes differ from their descriptor; readback: the written segment did not read back clean)",
            self.script_verification_failures.clone(),
        );
        r.register(
            "events_appended",
            "Events made durable",
            self.events_appended.clone(),
        );
        r.register(
            "events_duplicate",
            "Identical repeated events acknowledged again",
            self.events_duplicate.clone(),
        );
        r.register(
            "events_refused",
            "Events refused, by error code",
            self.events_refused.clone(),
        );
        r.register(
            "groups_committed",
            "Event groups made durable",
            self.groups_committed.clone(),
        );
        r.register(
            "groups_failed",
            "Event groups that failed; nothing was acknowledged",
            self.groups_failed.clone(),
        );
        r.register(
            "group_events",
            "Events per durable group",
            self.group_events.clone(),
        );
        r.register(
            "segments_created",
            "Segment files created",
            self.segments_created.clone(),
        );
        r.register(
            "write_groups_committed",
            "Command write groups committed (single-command writes sharing one transaction)",
            self.write_groups_committed.clone(),
        );
        r.register(
            "write_groups_failed",
            "Command write groups rolled back; none of their writes was kept",
            self.write_groups_failed.clone(),
        );
        r.register(
            "write_group_writes",
            "Writes per committed command write group",
            self.write_group_writes.clone(),
        );
        r.register(
            "journal_groups",
            "Groups made durable through the group journal",
            self.journal_groups.clone(),
        );
        r.register(
            "command_transitions",
            "Server-side command transitions, by target lifecycle",
            self.command_transitions.clone(),
        );
        r.register(
            "sessions_registered",
            "Client sessions registered",
            self.sessions_registered.clone(),
        );
        r.register(
            "sessions_fenced",
            "Live sessions fenced by a newer registration",
            self.sessions_fenced.clone(),
        );
        r.register(
            "live_conflicts",
            "Registrations rejected as a live conflict",
            self.live_conflicts.clone(),
        );
        r.register(
            "writes_fenced",
            "Writes refused because their session is no longer its client's live one",
            self.writes_fenced.clone(),
        );
        r.register(
            "journal_checkpoints",
            "Group journal checkpoints",
            self.journal_checkpoints.clone(),
        );
        r.register(
            "wal_checkpoints",
            "WAL checkpoints that copied frames into the database file",
            self.checkpoint.checkpoints.clone(),
        );
        r.register(
            "wal_frames_checkpointed",
            "WAL frames copied into the database file by the checkpointer",
            self.checkpoint.frames.clone(),
        );
        r.register(
            "wal_checkpoint_errors",
            "WAL checkpoints that failed",
            self.checkpoint.errors.clone(),
        );
        r.register(
            "wal_frames",
            "Frames in the WAL at the last checkpoint",
            self.checkpoint.wal_frames.clone(),
        );
        r.register(
            "wal_frames_backfilled",
            "Frames of the WAL already copied into the database file at the last checkpoint",
            self.checkpoint.wal_backfilled.clone(),
        );
        r.register(
            "signals_recorded",
            "Signals recorded for delivery to a client",
            self.signals_recorded.clone(),
        );
        r.register(
            "stdin_writes",
            "Stdin writes recorded for delivery to a client",
            self.stdin_writes.clone(),
        );
        r.register(
            "stdin_acks",
            "Stdin writes the client acknowledged, by delivery",
            self.stdin_acks.clone(),
        );
        r.register(
            "commands_created",
            "Commands created",
            self.commands_created.clone(),
        );
        r.register(
            "commands_refused",
            "Commands refused, by error code",
            self.commands_refused.clone(),
        );
        r.register(
            "quota_refusals",
            "Reserve refusals, by quota tier",
            self.quota_refusals.clone(),
        );
        r.register(
            "incidents",
            "Storage incidents recorded, by kind",
            self.incidents.clone(),
        );
        r.register(
            "recovery_actions",
            "Recovery actions, by step",
            self.recovery.clone(),
        );
        r.register(
            "scrub_actions",
            "Background scrub actions (re-verification, orphan sweep, recount), by step",
            self.scrub.clone(),
        );
        r.register(
            "events_lost_at_reconcile",
            "Ranges of events a client had acknowledged that the store no longer held (restored from an older backup), recorded as lost at reconciliation",
            self.events_lost_at_reconcile.clone(),
        );
        r.register(
            "rotations",
            "Output rotations, by truncation source",
            self.rotations.clone(),
        );
        r.register(
            "output_dropped",
            "Output events dropped at arrival under quota pressure from active data alone, by truncation source",
            self.output_dropped.clone(),
        );
        r.register(
            "evictions",
            "Whole commands evicted, by cause",
            self.evictions.clone(),
        );
        r.register(
            "eviction_failures",
            "Evictions that failed (recorded as incidents, rolled forward later)",
            self.eviction_failures.clone(),
        );
        r.register(
            "audit_records",
            "Audit records moved into audit segments",
            self.audit_records.clone(),
        );
        r.register(
            "audit_flush_failures",
            "Audit outbox flushes that failed; the records stay durable in the outbox",
            self.audit_flush_failures.clone(),
        );
        r.register(
            "audit_dropped",
            "Session audit records dropped because the audit outbox was full",
            self.audit_dropped.clone(),
        );
        r.register(
            "sessions_pruned",
            "Closed sessions deleted beyond the kept number per client",
            self.sessions_pruned.clone(),
        );
        r.register(
            "clients_pruned",
            "Idle clients (no command, no live session) deleted by maintenance",
            self.clients_pruned.clone(),
        );
        r.register(
            "fleet_runs",
            "Fleet run events: created, refused, signalled, cancelled, paused, resumed",
            self.fleet_runs.clone(),
        );
        r.register(
            "fleet_targets_released",
            "Fleet targets released (their commands created)",
            self.fleet_targets_released.clone(),
        );
    }

    /// Counts one refused event.
    pub fn event_refused(&self, code: &'static str) {
        self.events_refused.get_or_create(&CodeLabel { code }).inc();
    }

    /// Counts one recovery action.
    pub fn recovered(&self, step: &'static str, n: u64) {
        self.recovery.get_or_create(&StepLabel { step }).inc_by(n);
    }

    /// Counts background scrub actions (nothing when `n` is 0).
    pub fn scrubbed(&self, step: &'static str, n: u64) {
        if n > 0 {
            self.scrub.get_or_create(&StepLabel { step }).inc_by(n);
        }
    }
}

/// The Prometheus text exposition of a registry.
///
/// # Errors
/// When encoding fails (it writes to a `String`, so only on a formatting bug).
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_with_bounded_labels() {
        let m = StoreMetrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        m.events_appended.inc_by(3);
        m.event_refused("PROTOCOL_ERROR");
        m.quota_refusals
            .get_or_create(&TierLabel {
                tier: "owner_total",
            })
            .inc();
        m.group_events.observe(64.0);
        let text = render(&reg).unwrap();
        assert!(
            text.contains("rvbox_store_events_appended_total 3"),
            "{text}"
        );
        assert!(
            text.contains("rvbox_store_events_refused_total{code=\"PROTOCOL_ERROR\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("rvbox_store_quota_refusals_total{tier=\"owner_total\"} 1"),
            "{text}"
        );
    }
}
