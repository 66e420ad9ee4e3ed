//! The maintenance pass on PostgreSQL (plan §5.4), run by the replica
//! holding the maintenance duty: the oldest resolved incidents trimmed
//! beyond their cap, terminal commands reclaimed after the terminal
//! retention, and whole terminal commands evicted, oldest first, from a
//! client over its quota and then from a server over its own. The
//! selection rules are the SQLite store's (`rvbox_retention`:
//! `select_aged`, `select_evictions`).
//!
//! Each eviction is one transaction: the command's row is locked and
//! checked again (terminal, retained, no open incident), its tombstone
//! kept, the row deleted (its events, output chunks, stdin, signals and
//! scripts go with it by cascade), and its whole charge released from its
//! client and the server. Every transaction first checks that this
//! replica still holds the maintenance duty, so a replica that lost it
//! evicts nothing.
//!
//! The audit log (`audit_log`) is trimmed oldest first: rows older than
//! the audit retention (when set), and rows beyond the audit budget. Its
//! size is counted incrementally in `audit_usage` by this pass alone:
//! rows at least [`AUDIT_COUNT_LAG_MS`] old are added once, and deleted
//! rows are subtracted as they go.
//!
//! Clients idle for the terminal retention, with no command, no live
//! session and no live takeover grant, are forgotten, the generation floor
//! first raised above theirs (as the SQLite store's registry does). A
//! registration racing the deletion on another replica either updates the
//! client's row first (its last-seen time then keeps it) or waits for the
//! deletion and starts the client again above the floor.
//!
//! Done fleet runs go once their commands are gone, or after the terminal
//! retention (`crate::fleet::prune_done_runs_in`), and so do closed
//! interactive terminals with their recordings (`crate::pty::prune_closed`).
//!
//! Not here: rotation of running commands' output. A command's window
//! and total are kept by the append path (`crate::events`), and output
//! under a client's or the server's quota held by active commands alone
//! is dropped on arrival with a truncation row rather than rotated.

use postgres::Transaction;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_retention::{Candidate, Need, OwnerNeed, Usage, select_aged, select_evictions};
use rvbox_store::retention::RotationCause;
use rvbox_store_port::maintenance::MaintenanceReport;
use rvbox_store_port::replica::{Duty, ReplicaId};

use crate::sessions::{global_charged, to_i64, to_u64};
use crate::{Fail, PgStore};

/// Most candidate commands one selection considers (the oldest first).
const MAX_CANDIDATES: i64 = 10_000;
/// Most over-quota clients one pass relieves.
const MAX_CLIENTS_PER_PASS: i64 = 1_000;
/// Audit rows are counted once they are this old: a transaction that
/// wrote one has committed or ended by then (write sessions end a
/// transaction idle for 5 s).
pub(crate) const AUDIT_COUNT_LAG_MS: i64 = 60_000;
/// Audit rows one statement deletes; one pass deletes at most
/// [`AUDIT_TRIM_BATCHES`] such batches.
const AUDIT_TRIM_BATCH: i64 = 5_000;
/// Batches of audit rows one pass deletes at most.
const AUDIT_TRIM_BATCHES: u32 = 20;

/// What one eviction found.
enum Evicted {
    /// Deleted; its charge released.
    Freed(u64),
    /// Still active, gone already, or under an open incident.
    Skipped { dirty: bool },
}

/// Whether `replica` holds `duty` now (always, for a store that never
/// joined as a replica: one server alone runs every duty).
pub(crate) fn holds(
    tx: &mut Transaction<'_>,
    replica: Option<ReplicaId>,
    duty: Duty,
) -> Result<bool, Fail> {
    let Some(r) = replica else {
        return Ok(true);
    };
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM duties WHERE name = $1 AND replica_id = $2 AND epoch = $3
           AND lease_expires > now()",
        &[&duty.name(), &r.id.as_slice(), &to_i64(r.epoch)],
    )
    .map_err(Fail::db("check the maintenance duty"))?
    .is_some())
}

/// Retained, terminal commands with no open incident, oldest first;
/// one client's when given.
fn candidates(tx: &mut Transaction<'_>, client: Option<&str>) -> Result<Vec<Candidate>, Fail> {
    let rows = crate::prep::query(
        tx,
        "SELECT c.issue_time_ms, c.issue_uuid, c.client_id, c.terminal_time_ms, c.charged_bytes
         FROM commands c
         WHERE c.retention = 'retained' AND c.terminal_time_ms IS NOT NULL
           AND ($1::text IS NULL OR c.client_id = $1)
           AND NOT EXISTS (SELECT 1 FROM storage_incidents i
                           WHERE i.state = 1 AND i.issue_uuid = c.issue_uuid)
         ORDER BY c.issue_time_ms, c.issue_uuid
         LIMIT $2",
        &[&client, &MAX_CANDIDATES],
    )
    .map_err(Fail::db("list retention candidates"))?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let id = <[u8; 16]>::try_from(r.get::<_, Vec<u8>>(1).as_slice()).ok()?;
            Some(Candidate {
                issue_time_unix_ms: r.get(0),
                issue_uuid: id,
                owner: r.get(2),
                terminal_time_unix_ms: r.get(3),
                charged: to_u64(r.get(4)),
            })
        })
        .collect())
}

/// Most idle clients one pass forgets.
const MAX_IDLE_CLIENTS_PER_PASS: i64 = 1_000;

/// Forgets clients last seen before `before` with no command, no live
/// session and no live takeover grant, raising the generation floor above
/// theirs first; returns how many.
fn prune_idle_clients(tx: &mut Transaction<'_>, before: i64, now_ms: i64) -> Result<u64, Fail> {
    let idle: Vec<String> = crate::prep::query(
        tx,
        "SELECT c.client_id FROM clients c
         WHERE COALESCE(c.last_seen_ms, 0) < $1
           AND NOT EXISTS (SELECT 1 FROM commands m WHERE m.client_id = c.client_id)
           AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.client_id = c.client_id AND s.live)
           AND NOT EXISTS (SELECT 1 FROM pty_sessions p WHERE p.client_id = c.client_id)
           AND NOT EXISTS (SELECT 1 FROM takeover_authorizations t
                           WHERE t.client_id = c.client_id AND t.consumed_ms IS NULL
                             AND t.voided_ms IS NULL AND t.expires_ms > $2)
         ORDER BY COALESCE(c.last_seen_ms, 0), c.client_id
         LIMIT $3
         FOR UPDATE OF c SKIP LOCKED",
        &[&before, &now_ms, &MAX_IDLE_CLIENTS_PER_PASS],
    )
    .map_err(Fail::db("list idle clients"))?
    .iter()
    .map(|r| r.get(0))
    .collect();
    if idle.is_empty() {
        return Ok(0);
    }
    // the rows are locked: a registration waits for this transaction; one
    // that updated a row first has moved its last-seen time past `before`
    crate::prep::execute(
        tx,
        "UPDATE quota_totals SET generation_floor = GREATEST(generation_floor,
             COALESCE((SELECT max(generation) FROM clients WHERE client_id = ANY($1)), 0))
         WHERE id = 1",
        &[&idle],
    )
    .map_err(Fail::db("raise the generation floor"))?;
    let n = crate::prep::execute(
        tx,
        "DELETE FROM clients WHERE client_id = ANY($1) AND COALESCE(last_seen_ms, 0) < $2",
        &[&idle, &before],
    )
    .map_err(Fail::db("prune idle clients"))?;
    Ok(n)
}

/// Deletes one terminal command, keeping its tombstone, and releases its
/// charge.
fn evict(
    tx: &mut Transaction<'_>,
    output: &mut dyn crate::output::OutputStore,
    issue: &[u8; 16],
    now_ms: i64,
    tombstone_cap: u64,
) -> Result<Evicted, Fail> {
    let Some(row) = crate::prep::query_opt(
        tx,
        "SELECT client_id, lifecycle, retention, terminal_time_ms, charged_bytes, closeout_held,
                request_hash
         FROM commands WHERE issue_uuid = $1 FOR UPDATE",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("lock the command to evict"))?
    else {
        return Ok(Evicted::Skipped { dirty: false });
    };
    let client: String = row.get(0);
    let lifecycle = Lifecycle::from_wire(i32::try_from(row.get::<_, i64>(1)).unwrap_or(0))
        .unwrap_or(Lifecycle::Interrupted);
    let retained = row.get::<_, String>(2) == "retained";
    let terminal: Option<i64> = row.get(3);
    if !retained || terminal.is_none() || !lifecycle.is_terminal() {
        return Ok(Evicted::Skipped { dirty: false });
    }
    let open = crate::prep::query_opt(
        tx,
        "SELECT 1 FROM storage_incidents WHERE state = 1 AND issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("check the command's incidents"))?
    .is_some();
    if open {
        return Ok(Evicted::Skipped { dirty: true });
    }
    let charged = to_u64(row.get(4));
    let held = to_u64(row.get(5));
    let request_hash: Vec<u8> = row.get(6);
    let owner: i64 = crate::prep::query_one(
        tx,
        "SELECT charged_bytes FROM clients WHERE client_id = $1 FOR UPDATE",
        &[&client],
    )
    .map_err(Fail::db("read the client's usage"))?
    .get(0);
    let global = global_charged(tx)?;
    let after = rvbox_retention::release_command(&Usage {
        command: charged,
        held_closeout: held,
        owner: to_u64(owner),
        global,
        free_space: 0,
    })
    .map_err(|e| Fail::Integrity(format!("releasing an evicted command's charge: {e}")))?;
    crate::commands::insert_tombstone(
        tx,
        issue,
        &request_hash,
        &client,
        lifecycle,
        terminal.unwrap_or(now_ms),
        tombstone_cap,
    )?;
    crate::prep::execute(
        tx,
        "DELETE FROM commands WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("delete the evicted command"))?;
    output.removed(tx, issue, 1, u64::MAX)?;
    let freed = to_i64(charged);
    crate::prep::execute(
        tx,
        "UPDATE clients SET charged_bytes = $2 WHERE client_id = $1",
        &[&client, &to_i64(after.owner)],
    )
    .map_err(Fail::db("release the client's usage"))?;
    crate::prep::execute(
        tx,
        "UPDATE quota_totals SET command_charged = command_charged - $1 WHERE id = 1",
        &[&freed],
    )
    .map_err(Fail::db("release the server's usage"))?;
    Ok(Evicted::Freed(charged))
}

impl PgStore {
    /// Runs one maintenance pass (see the module docs).
    ///
    /// # Errors
    /// A database failure; an eviction that fails leaves its command as
    /// it was.
    pub(crate) fn maintain(&mut self, now_ms: i64) -> Result<MaintenanceReport, Fail> {
        let replica = self.replica();
        let mut report = MaintenanceReport::default();
        let cap = to_i64(rvbox_store::incidents::MAX_RESOLVED_INCIDENTS);
        let trimmed = self.in_tx("trim resolved incidents", |tx, _| {
            if !holds(tx, replica, Duty::Maintenance)? {
                return Ok(None);
            }
            let n = crate::prep::execute(
                tx,
                "DELETE FROM storage_incidents WHERE incident_id IN (
                     SELECT incident_id FROM storage_incidents WHERE state <> 1
                     ORDER BY resolved_ms DESC, incident_id DESC OFFSET $1)",
                &[&cap],
            )
            .map_err(Fail::db("trim resolved incidents"))?;
            Ok(Some(n))
        })?;
        let Some(trimmed) = trimmed else {
            tracing::info!("maintenance skipped: this replica does not hold the duty");
            return Ok(report);
        };
        report.incidents_trimmed = trimmed;

        // age reclamation (0 disables), independent of byte pressure
        let retention_ms = self.opts.terminal_retention_ms;
        if retention_ms > 0 {
            let all = self.in_tx("list retention candidates", |tx, _| candidates(tx, None))?;
            for issue in &select_aged(&all, now_ms, retention_ms).uuids {
                self.evict_counted(issue, now_ms, true, &mut report)?;
            }
        }

        // quota eviction: per client, then server-wide
        let tiers = self.opts.tiers.clone();
        let slack = self.opts.eviction_slack_bytes;
        let owner_limit = tiers.per_owner_total.saturating_sub(slack);
        let over: Vec<(String, u64)> = self.in_tx("list clients over quota", |tx, _| {
            Ok(crate::prep::query(
                tx,
                "SELECT client_id, charged_bytes FROM clients WHERE charged_bytes > $1
                 ORDER BY client_id LIMIT $2",
                &[&to_i64(owner_limit), &MAX_CLIENTS_PER_PASS],
            )
            .map_err(Fail::db("list clients over quota"))?
            .iter()
            .map(|r| (r.get::<_, String>(0), to_u64(r.get(1))))
            .collect())
        })?;
        for (client, used) in over {
            let need = Need {
                owner: Some(OwnerNeed {
                    owner: client.clone(),
                    bytes: used.saturating_sub(owner_limit),
                }),
                global: 0,
            };
            let mine = self.in_tx("list retention candidates", |tx, _| {
                candidates(tx, Some(&client))
            })?;
            let mut freed = 0u64;
            for issue in &select_evictions(&mine, &need).commands.uuids {
                freed =
                    freed.saturating_add(self.evict_counted(issue, now_ms, false, &mut report)?);
            }
            let missing = need
                .owner
                .as_ref()
                .map_or(0, |o| o.bytes)
                .saturating_sub(freed);
            let left = if missing > 0 {
                self.pressure_rotate(
                    Some(&client),
                    missing,
                    RotationCause::ClientQuota,
                    now_ms,
                    &mut report,
                )?
            } else {
                0
            };
            if left > 0 {
                report.owner_shortfall = report.owner_shortfall.saturating_add(left);
                tracing::warn!(client_id = %client, shortfall = left,
                    "client over its quota with active data only; new unreserved data is refused");
            }
        }
        let global_limit = tiers.global_total.saturating_sub(slack);
        let global = self.in_tx("read global usage", |tx, _| global_charged(tx))?;
        if global > global_limit {
            let need = Need {
                owner: None,
                global: global - global_limit,
            };
            let all = self.in_tx("list retention candidates", |tx, _| candidates(tx, None))?;
            let mut freed = 0u64;
            for issue in &select_evictions(&all, &need).commands.uuids {
                freed =
                    freed.saturating_add(self.evict_counted(issue, now_ms, false, &mut report)?);
            }
            let missing = need.global.saturating_sub(freed);
            report.global_shortfall = if missing > 0 {
                self.pressure_rotate(
                    None,
                    missing,
                    RotationCause::GlobalQuota,
                    now_ms,
                    &mut report,
                )?
            } else {
                0
            };
            if report.global_shortfall > 0 {
                tracing::warn!(
                    shortfall = report.global_shortfall,
                    "server over its quota with active data only; new unreserved data is refused"
                );
            }
        }
        report.audit_rotated = self.trim_audit(now_ms)?;
        // idle clients go after the terminal retention (0 keeps them)
        if retention_ms > 0 {
            let before = now_ms.saturating_sub(to_i64(retention_ms));
            report.clients_pruned = self.in_tx("prune idle clients", |tx, _| {
                if !holds(tx, replica, Duty::Maintenance)? {
                    return Ok(0);
                }
                prune_idle_clients(tx, before, now_ms)
            })?;
            if report.clients_pruned > 0 {
                tracing::info!(clients = report.clients_pruned, "idle clients pruned");
            }
        }
        // done fleet runs go with their commands, or after the retention
        let cap = self.opts.tombstone_cap;
        report.fleet_runs_pruned = self.in_tx("prune done fleet runs", |tx, _| {
            if !holds(tx, replica, Duty::Maintenance)? {
                return Ok(0);
            }
            crate::fleet::prune_done_runs_in(tx, now_ms, retention_ms, cap)
        })?;
        // closed terminals go with their recordings after the retention
        report.terminals_pruned = self.in_tx("prune closed terminals", |tx, _| {
            if !holds(tx, replica, Duty::Maintenance)? {
                return Ok(0);
            }
            crate::pty::prune_closed(tx, now_ms, retention_ms)
        })?;
        if report.terminals_pruned > 0 {
            tracing::info!(
                terminals = report.terminals_pruned,
                "closed terminals pruned with their recordings"
            );
        }
        tracing::info!(
            incidents_trimmed = report.incidents_trimmed,
            audit_rows_trimmed = report.audit_rotated,
            evicted_quota = report.evicted_quota,
            evicted_aged = report.evicted_aged,
            evictions_failed = report.evictions_failed,
            skipped_dirty = report.skipped_dirty,
            terminals_pruned = report.terminals_pruned,
            "maintenance pass"
        );
        Ok(report)
    }

    /// Counts the audit rows old enough, then deletes the oldest while
    /// they are older than the retention or the log is over its budget;
    /// returns the rows deleted.
    fn trim_audit(&mut self, now_ms: i64) -> Result<u64, Fail> {
        let replica = self.replica();
        let budget = to_i64(self.opts.audit_budget_bytes);
        let retention = self.opts.audit_retention_ms;
        let oldest_kept = if retention > 0 {
            now_ms.saturating_sub(to_i64(retention))
        } else {
            i64::MIN
        };
        let mut deleted = 0u64;
        for _ in 0..AUDIT_TRIM_BATCHES {
            let n = self.in_tx("trim the audit log", |tx, _| {
                if !holds(tx, replica, Duty::Maintenance)? {
                    return Ok(0);
                }
                let usage = crate::prep::query_one(
                    tx,
                    "SELECT counted_seq, bytes FROM audit_usage WHERE id = 1 FOR UPDATE",
                    &[],
                )
                .map_err(Fail::db("read the audit usage"))?;
                let (mut counted, mut bytes): (i64, i64) = (usage.get(0), usage.get(1));
                // the rows not counted yet, up to the first one that is
                // not old enough (replicas' clocks differ: a later row may
                // be older than an earlier one, and no row is skipped)
                let cutoff = now_ms.saturating_sub(AUDIT_COUNT_LAG_MS);
                let upto: i64 = crate::prep::query_one(
                    tx,
                    "SELECT COALESCE(
                         (SELECT min(seq) - 1 FROM audit_log WHERE seq > $1 AND time_ms >= $2),
                         (SELECT max(seq) FROM audit_log WHERE seq > $1),
                         $1)",
                    &[&counted, &cutoff],
                )
                .map_err(Fail::db("count the audit log"))?
                .get(0);
                let add: i64 = crate::prep::query_one(
                    tx,
                    "SELECT COALESCE(sum(octet_length(record)), 0)::bigint
                     FROM audit_log WHERE seq > $1 AND seq <= $2",
                    &[&counted, &upto],
                )
                .map_err(Fail::db("count the audit log"))?
                .get(0);
                counted = upto.max(counted);
                bytes = bytes.saturating_add(add);
                // of the oldest rows, those too old, and as many as cover
                // what is over the budget
                let excess = bytes.saturating_sub(budget).max(0);
                let rows = crate::prep::query(
                    tx,
                    "DELETE FROM audit_log WHERE seq IN (
                         SELECT seq FROM (
                             SELECT seq, time_ms, octet_length(record) AS len,
                                    sum(octet_length(record)) OVER (ORDER BY seq) AS run
                             FROM (SELECT seq, time_ms, record FROM audit_log
                                   ORDER BY seq LIMIT $3) o) w
                         WHERE w.time_ms < $1 OR w.run - w.len < $2)
                     RETURNING seq, octet_length(record)::bigint",
                    &[&oldest_kept, &excess, &AUDIT_TRIM_BATCH],
                )
                .map_err(Fail::db("trim the audit log"))?;
                for r in &rows {
                    // only what was counted is subtracted
                    if r.get::<_, i64>(0) <= counted {
                        bytes = bytes.saturating_sub(r.get::<_, i64>(1));
                    }
                }
                crate::prep::execute(
                    tx,
                    "UPDATE audit_usage SET counted_seq = $1, bytes = $2 WHERE id = 1",
                    &[&counted, &bytes.max(0)],
                )
                .map_err(Fail::db("record the audit usage"))?;
                Ok(rows.len() as u64)
            })?;
            deleted = deleted.saturating_add(n);
            if n < AUDIT_TRIM_BATCH.unsigned_abs() {
                break;
            }
        }
        if deleted > 0 {
            tracing::info!(rows = deleted, "audit log trimmed");
        }
        Ok(deleted)
    }

    /// Evicts one command under the duty, counting the outcome; the bytes
    /// freed.
    /// Relieves `need` charged bytes from active commands' output (plan
    /// §5.4: "if active data alone creates pressure, rotate/drop output
    /// with markers"): the oldest output of each active command of the
    /// client (the server), oldest command first, each in a transaction of
    /// its own under the maintenance duty; returns what is still missing.
    fn pressure_rotate(
        &mut self,
        client: Option<&str>,
        need: u64,
        cause: RotationCause,
        now_ms: i64,
        report: &mut MaintenanceReport,
    ) -> Result<u64, Fail> {
        let replica = self.replica();
        let active: Vec<[u8; 16]> = self.in_tx("list active commands", |tx, _| {
            Ok(crate::prep::query(
                tx,
                "SELECT c.issue_uuid FROM commands c
                 WHERE ($1::text IS NULL OR c.client_id = $1) AND c.retention = 'retained'
                   AND c.terminal_time_ms IS NULL
                   AND EXISTS (SELECT 1 FROM command_events e
                               WHERE e.issue_uuid = c.issue_uuid AND e.body_kind = 4)
                 ORDER BY c.issue_time_ms, c.issue_uuid LIMIT $2",
                &[&client, &MAX_CLIENTS_PER_PASS],
            )
            .map_err(Fail::db("list active commands"))?
            .iter()
            .filter_map(|r| crate::sessions::blob16(Some(r.get(0))))
            .collect())
        })?;
        let mut missing = need;
        let mut output =
            std::mem::replace(&mut self.output, Box::new(crate::output::DatabaseChunks));
        for issue in active {
            if missing == 0 {
                break;
            }
            let want = missing;
            let r = self.in_tx("rotate under quota pressure", |tx, _| {
                if !holds(tx, replica, Duty::Maintenance)? {
                    return Ok(None);
                }
                // the command, held against its appends; still active?
                let Some(row) = crate::prep::query_opt(
                    tx,
                    "SELECT client_id FROM commands
                     WHERE issue_uuid = $1 AND terminal_time_ms IS NULL AND retention = 'retained'
                     FOR UPDATE",
                    &[&issue.as_slice()],
                )
                .map_err(Fail::db("lock an active command"))?
                else {
                    return Ok(None);
                };
                let owner: String = row.get(0);
                let marker = rvbox_store::retention::truncation_row_charge(cause.reason())
                    .map_err(|e| Fail::Integrity(e.to_string()))?;
                // as much as helps: anything that frees more than its row
                let Some(r) = crate::events::rotate_oldest(
                    tx,
                    output.as_mut(),
                    &issue,
                    marker.saturating_add(1),
                    want.saturating_add(marker),
                    cause,
                    now_ms,
                )?
                else {
                    return Ok(None);
                };
                let released = to_i64(r.released);
                crate::prep::execute(
                    tx,
                    "UPDATE commands SET charged_bytes = charged_bytes - $2,
                         output_charged = output_charged - $3
                     WHERE issue_uuid = $1",
                    &[&issue.as_slice(), &released, &to_i64(r.removed)],
                )
                .map_err(Fail::db("release rotated output"))?;
                crate::prep::execute(
                    tx,
                    "UPDATE clients SET charged_bytes = charged_bytes - $2 WHERE client_id = $1",
                    &[&owner, &released],
                )
                .map_err(Fail::db("release rotated output"))?;
                crate::prep::execute(
                    tx,
                    "UPDATE quota_totals SET command_charged = command_charged - $1 WHERE id = 1",
                    &[&released],
                )
                .map_err(Fail::db("release rotated output"))?;
                Ok(Some(r.released))
            });
            match r {
                Ok(Some(released)) => {
                    missing = missing.saturating_sub(released);
                    report.rotations += 1;
                    report.pressure_rotations += 1;
                }
                Ok(None) => {}
                Err(e) => {
                    self.output = output;
                    return Err(e);
                }
            }
        }
        self.output = output;
        Ok(missing)
    }

    fn evict_counted(
        &mut self,
        issue: &[u8; 16],
        now_ms: i64,
        aged: bool,
        report: &mut MaintenanceReport,
    ) -> Result<u64, Fail> {
        let replica = self.replica();
        let mut output =
            std::mem::replace(&mut self.output, Box::new(crate::output::DatabaseChunks));
        let outcome = self.in_tx("evict a command", |tx, opts| {
            if !holds(tx, replica, Duty::Maintenance)? {
                return Ok(None);
            }
            evict(tx, output.as_mut(), issue, now_ms, opts.tombstone_cap).map(Some)
        });
        self.output = output;
        match outcome {
            Ok(Some(Evicted::Freed(n))) => {
                if aged {
                    report.evicted_aged += 1;
                } else {
                    report.evicted_quota += 1;
                }
                tracing::info!(
                    cause = if aged { "terminal_age" } else { "quota" },
                    charged = n,
                    "command evicted"
                );
                Ok(n)
            }
            Ok(Some(Evicted::Skipped { dirty: true })) => {
                report.skipped_dirty += 1;
                Ok(0)
            }
            Ok(Some(Evicted::Skipped { dirty: false }) | None) => Ok(0),
            Err(e) => {
                report.evictions_failed += 1;
                tracing::error!(error = %e, "eviction failed; the command stays as it was");
                Ok(0)
            }
        }
    }
}
