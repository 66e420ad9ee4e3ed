//! The serialized maintenance pass (plan §5.4: "a single serialized
//! maintenance worker, never on the WebSocket receive loop").
//!
//! [`Store::maintain`] runs, in order: the sweeper (stale evictions and
//! pending file deletions), rotation a command's window or total already
//! exceeds, 30-day age reclamation, quota eviction of whole terminal
//! commands (per client, then server-wide), pressure rotation of active
//! output when terminal data alone cannot relieve a tier, audit
//! rotation, and the audit outbox flush. The store is single-writer (`&mut self`), so a pass never
//! races an append. Candidates come from bounded pages; a pass that could
//! not finish leaves the rest for the next one.

use rusqlite::{Connection, params};
use rvbox_retention::{
    Candidate, Need, OwnerNeed, SegmentUsage, plan_pressure_rotation, select_aged, select_evictions,
};

use crate::error::StoreError;
use crate::retention::{EvictOutcome, EvictionCause, RotationCause};
use crate::store::{Store, to_u64};

/// Most candidate commands one selection considers (the oldest first).
pub const MAX_CANDIDATES: u32 = 10_000;
/// Most over-quota clients one pass relieves.
pub const MAX_CLIENTS_PER_PASS: u32 = 1_000;
/// Commands one pass checks for due rotation (a slice by key; the next
/// pass goes on from there and wraps around).
pub const ROTATION_CHECKS_PER_PASS: u32 = 10_000;

pub use rvbox_store_port::maintenance::MaintenanceReport;

fn candidates(
    conn: &Connection,
    client: Option<&str>,
    terminal_only: bool,
) -> Result<Vec<Candidate>, StoreError> {
    // retained commands with no unresolved incident, oldest (issue_time, uuid)
    // first; terminal commands only for eviction, active ones for pressure
    let mut stmt = conn
        .prepare_cached(
            "SELECT c.issue_time_ms, c.issue_uuid, c.client_id, c.terminal_time_ms, c.charged_bytes
             FROM commands c
             WHERE c.retention = 'retained'
               AND (?1 IS NULL OR c.client_id = ?1)
               AND ((?2 = 1 AND c.terminal_time_ms IS NOT NULL)
                 OR (?2 = 0 AND c.terminal_time_ms IS NULL))
               AND NOT EXISTS (SELECT 1 FROM storage_incidents i
                               WHERE i.state = 1 AND i.issue_uuid = c.issue_uuid)
             ORDER BY c.issue_time_ms, c.issue_uuid
             LIMIT ?3",
        )
        .map_err(|e| StoreError::sqlite("list retention candidates", e))?;
    let rows = stmt
        .query_map(
            params![client, i64::from(terminal_only), MAX_CANDIDATES],
            |r| {
                let id: Vec<u8> = r.get(1)?;
                Ok(Candidate {
                    issue_time_unix_ms: r.get(0)?,
                    issue_uuid: <[u8; 16]>::try_from(id.as_slice()).unwrap_or([0; 16]),
                    owner: r.get(2)?,
                    terminal_time_unix_ms: r.get(3)?,
                    charged: to_u64(r.get(4)?),
                })
            },
        )
        .map_err(|e| StoreError::sqlite("list retention candidates", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list retention candidates", e))
}

fn over_clients(conn: &Connection, threshold: u64) -> Result<Vec<(String, u64)>, StoreError> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT client_id, charged_bytes FROM clients WHERE charged_bytes > ?1
             ORDER BY client_id LIMIT ?2",
        )
        .map_err(|e| StoreError::sqlite("list clients over quota", e))?;
    let rows = stmt
        .query_map(
            params![crate::store::to_i64(threshold), MAX_CLIENTS_PER_PASS],
            |r| Ok((r.get::<_, String>(0)?, to_u64(r.get(1)?))),
        )
        .map_err(|e| StoreError::sqlite("list clients over quota", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list clients over quota", e))
}

fn count_eviction(outcome: EvictOutcome, aged: bool, report: &mut MaintenanceReport) {
    match outcome {
        EvictOutcome::Evicted { .. } if aged => report.evicted_aged += 1,
        EvictOutcome::Evicted { .. } => report.evicted_quota += 1,
        EvictOutcome::Failed => report.evictions_failed += 1,
        EvictOutcome::Dirty => report.skipped_dirty += 1,
        EvictOutcome::Gone | EvictOutcome::Active => {}
    }
}

impl Store {
    /// Runs one maintenance pass (see the module docs).
    ///
    /// # Errors
    /// [`StoreError`] when the database failed; file failures become
    /// incidents and pending work instead.
    pub fn maintain(&mut self, now_ms: i64) -> Result<MaintenanceReport, StoreError> {
        if !matches!(
            self.health.global(),
            crate::health::ScopeState::Ready | crate::health::ScopeState::DirtyReadable
        ) {
            // evictions and rotations are global decisions: not before the
            // start's integrity check passed, never on an unusable store
            tracing::debug!("maintenance skipped: the store is not globally ready");
            return Ok(MaintenanceReport::default());
        }
        let mut report = MaintenanceReport {
            incidents_trimmed: crate::incidents::trim_resolved(
                &self.conn,
                crate::incidents::MAX_RESOLVED_INCIDENTS,
            )?,
            ..MaintenanceReport::default()
        };
        let sweep = self.sweep(now_ms)?;
        report.rolled_forward = sweep.rolled_forward;
        report.files_swept = sweep.files_removed;

        // rotation a window or total already exceeds (e.g. lowered tiers):
        // a slice of the commands by key per pass, never a walk of them all
        let due = self.rotation_due_slice()?;
        for issue in due {
            match self.rotate_due(&issue, now_ms) {
                Ok(Some(_)) => report.rotations += 1,
                Ok(None) => {}
                // one command's failure never stops the rest of the pass
                Err(e) => tracing::error!(error = %e, "due rotation failed"),
            }
        }

        // age reclamation (0 disables), independent of byte pressure
        let retention_ms = self.opts.terminal_retention_ms;
        if retention_ms > 0 {
            let aged = select_aged(&candidates(&self.conn, None, true)?, now_ms, retention_ms);
            for issue in &aged.uuids {
                let outcome = self.evict_command(issue, EvictionCause::TerminalAge, now_ms)?;
                count_eviction(outcome, true, &mut report);
            }
        }

        // quota eviction: per client, then server-wide
        let tiers = self.opts.tiers.clone();
        let slack = self.opts.eviction_slack_bytes;
        let owner_limit = tiers.per_owner_total.saturating_sub(slack);
        for (client, used) in over_clients(&self.conn, owner_limit)? {
            let need = Need {
                owner: Some(OwnerNeed {
                    owner: client.clone(),
                    bytes: used.saturating_sub(owner_limit),
                }),
                global: 0,
            };
            let selection = select_evictions(&candidates(&self.conn, Some(&client), true)?, &need);
            let mut freed = 0u64;
            for issue in &selection.commands.uuids {
                if let EvictOutcome::Evicted { freed: f } =
                    self.count_eviction_ret(issue, EvictionCause::ClientQuota, now_ms, &mut report)?
                {
                    freed = freed.saturating_add(f);
                }
            }
            let missing = need
                .owner
                .as_ref()
                .map_or(0, |o| o.bytes)
                .saturating_sub(freed);
            if missing > 0 {
                let left = self.pressure_rotate(
                    Some(&client),
                    missing,
                    RotationCause::ClientQuota,
                    now_ms,
                    &mut report,
                )?;
                report.owner_shortfall = report.owner_shortfall.saturating_add(left);
                if left > 0 {
                    tracing::warn!(client_id = %client, shortfall = left,
                        "client over its quota with active data only; new unreserved data is refused");
                }
            }
        }
        let global_limit = tiers.global_total.saturating_sub(slack);
        let global = crate::store::global_charged(&self.conn)?;
        if global > global_limit {
            let need = Need {
                owner: None,
                global: global - global_limit,
            };
            let selection = select_evictions(&candidates(&self.conn, None, true)?, &need);
            let mut freed = 0u64;
            for issue in &selection.commands.uuids {
                if let EvictOutcome::Evicted { freed: f } =
                    self.count_eviction_ret(issue, EvictionCause::GlobalQuota, now_ms, &mut report)?
                {
                    freed = freed.saturating_add(f);
                }
            }
            let missing = need.global.saturating_sub(freed);
            if missing > 0 {
                let left = self.pressure_rotate(
                    None,
                    missing,
                    RotationCause::GlobalQuota,
                    now_ms,
                    &mut report,
                )?;
                report.global_shortfall = left;
                if left > 0 {
                    tracing::warn!(
                        shortfall = left,
                        "server over its quota with active data only; new unreserved data is refused"
                    );
                }
            }
        }

        report.audit_rotated = self.rotate_audit(0, now_ms)?;
        // idle clients go after the terminal retention (0 keeps them)
        match self.prune_idle_clients(now_ms, self.opts.terminal_retention_ms) {
            Ok(n) => report.clients_pruned = n,
            Err(e) => tracing::warn!(error = %e, "idle clients not pruned"),
        }
        // done fleet runs go with their commands, or after the retention
        match crate::fleet::prune_done_runs(
            &mut self.conn,
            now_ms,
            self.opts.terminal_retention_ms,
            self.opts.tombstone_cap,
        ) {
            Ok(n) => report.fleet_runs_pruned = n,
            Err(e) => tracing::warn!(error = %e, "done fleet runs not pruned"),
        }
        // closed terminals go with their recordings after the retention
        match crate::pty::prune_closed(
            &mut self.conn,
            now_ms,
            self.opts.terminal_retention_ms,
            crate::pty::PRUNE_BATCH,
        ) {
            Ok(n) => report.terminals_pruned = n,
            Err(e) => tracing::warn!(error = %e, "closed terminals not pruned"),
        }
        // the audit outbox goes to its segments; what cannot move now stays
        // durable for the next pass
        match self.flush_audit(now_ms) {
            Ok(n) => report.audit_flushed = n,
            Err(e) => {
                self.metrics.audit_flush_failures.inc();
                tracing::warn!(error = %e, "audit outbox not flushed; it stays durable");
            }
        }
        tracing::info!(
            audit_flushed = report.audit_flushed,
            rolled_forward = report.rolled_forward,
            files_swept = report.files_swept,
            rotations = report.rotations,
            evicted_quota = report.evicted_quota,
            evicted_aged = report.evicted_aged,
            evictions_failed = report.evictions_failed,
            audit_rotated = report.audit_rotated,
            "maintenance pass"
        );
        Ok(report)
    }

    /// The commands of this pass's slice whose output window or total a
    /// tier already exceeds.
    fn rotation_due_slice(&mut self) -> Result<Vec<[u8; 16]>, StoreError> {
        // an empty blob sorts before every key: the first slice
        let after = self.rotation_cursor.map_or_else(Vec::new, |c| c.to_vec());
        let rows: Vec<(Vec<u8>, bool)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT issue_uuid, retention = 'retained' AND (output_charged > ?1 OR charged_bytes > ?2)
                     FROM commands WHERE issue_uuid > ?3 ORDER BY issue_uuid LIMIT ?4",
                )
                .map_err(|e| StoreError::sqlite("list rotation due", e))?;
            stmt.query_map(
                params![
                    crate::store::to_i64(self.opts.tiers.command_output_window),
                    crate::store::to_i64(self.opts.tiers.command_total),
                    after,
                    ROTATION_CHECKS_PER_PASS
                ],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(|e| StoreError::sqlite("list rotation due", e))?
            .collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("list rotation due", e))?
        };
        let full = rows.len() >= ROTATION_CHECKS_PER_PASS as usize;
        self.rotation_cursor = rows
            .last()
            .filter(|_| full)
            .and_then(|(id, _)| <[u8; 16]>::try_from(id.as_slice()).ok());
        Ok(rows
            .into_iter()
            .filter(|(_, due)| *due)
            .filter_map(|(id, _)| <[u8; 16]>::try_from(id.as_slice()).ok())
            .collect())
    }

    fn count_eviction_ret(
        &mut self,
        issue: &[u8; 16],
        cause: EvictionCause,
        now_ms: i64,
        report: &mut MaintenanceReport,
    ) -> Result<EvictOutcome, StoreError> {
        let outcome = self.evict_command(issue, cause, now_ms)?;
        count_eviction(outcome, false, report);
        Ok(outcome)
    }

    /// Relieves `need` bytes from active commands' output (plan §5.4: "if
    /// active data alone creates pressure, rotate/drop output with
    /// markers"), oldest command first; returns what is still missing.
    fn pressure_rotate(
        &mut self,
        client: Option<&str>,
        need: u64,
        cause: RotationCause,
        now_ms: i64,
        report: &mut MaintenanceReport,
    ) -> Result<u64, StoreError> {
        let mut missing = need;
        let marker = rvbox_retention::charge(
            rvbox_retention::CHARGE_VERSION,
            rvbox_retention::ChargeKind::TruncationRow,
            256,
        )
        .map_err(|e| StoreError::Integrity(e.to_string()))?;
        for c in candidates(&self.conn, client, false)? {
            if missing == 0 {
                break;
            }
            let segs = self.segment_usage(&c.issue_uuid)?;
            let plan = plan_pressure_rotation(&segs, missing, marker);
            if plan.rotate.is_empty() {
                continue;
            }
            if let Some(r) = self.apply_rotation(&c.issue_uuid, &plan.rotate, cause, now_ms)? {
                missing = missing.saturating_sub(r.released);
                report.rotations += 1;
                report.pressure_rotations += 1;
            }
        }
        Ok(missing)
    }

    /// A command's live output segments for a pressure plan, each charged
    /// at what rotating it releases (its records and their event rows).
    fn segment_usage(&self, issue: &[u8; 16]) -> Result<Vec<SegmentUsage>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT ordinal, state, COALESCE(first_seq, 0), COALESCE(last_seq, 0), charged_bytes
                 FROM command_segments WHERE issue_uuid = ?1 AND state IN ('active', 'sealed')
                 ORDER BY ordinal",
            )
            .map_err(|e| StoreError::sqlite("list output segments", e))?;
        let rows = stmt
            .query_map(params![issue.as_slice()], |r| {
                let state: String = r.get(1)?;
                Ok(SegmentUsage {
                    ordinal: r.get(0)?,
                    charged: to_u64(r.get(4)?),
                    sealed: state == "sealed",
                    first_seq: to_u64(r.get(2)?),
                    last_seq: to_u64(r.get(3)?),
                    pinned: false,
                })
            })
            .map_err(|e| StoreError::sqlite("list output segments", e))?;
        rows.collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sqlite("list output segments", e))
    }

    /// Startup part of retention, called from [`Store::recover`] after the
    /// sweeper ([`Store::sweep`]) and command segment recovery: audit
    /// segment recovery.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn recover_retention(&mut self, now_ms: i64) -> Result<(), StoreError> {
        let audit = self.recover_audit(now_ms)?;
        tracing::info!(
            audit_segments = audit.segments_scanned,
            audit_tails = audit.tails_truncated,
            audit_damaged = audit.segments_damaged,
            audit_orphans = audit.orphans_removed,
            "retention recovery finished"
        );
        Ok(())
    }
}
