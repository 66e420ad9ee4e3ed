//! The background scrub: the work proportional to the store's history that
//! a start no longer does before it is ready (docs/storage.md,
//! "Start-up"), done after ready in bounded slices that yield to live
//! traffic. The server core asks for a slice only while the store has no
//! other work; each slice reads at most a few segments, one segment
//! directory, or a page of command rows.
//!
//! One cycle runs, in order:
//!
//! 1. **re-verification** of every sealed and blob segment (a cursor over
//!    `command_segments`): damage is handled exactly as recovery does, an
//!    incident and a dirty scope, and readers get explicit truncations;
//!    a clean segment gains the verified fact;
//! 2. **the orphan sweep**, one segment directory per slice: files no row
//!    names (bytes of a batch that never committed) are removed; names
//!    RVBox did not make are left alone;
//! 3. **the counter recount** of plan §5.2 on a read snapshot of its own
//!    (so a recount spread over many slices is still one consistent view):
//!    each client's charged total against the sum of its commands, then the
//!    server-wide, registry and operation counters. A mismatch is a
//!    `COUNTER_MISMATCH` incident, repaired at once by rebuilding the
//!    derivable counters.
//!
//! Every slice first verifies a few sealed segments that have no verified
//! fact yet (sealed by a transition that did not read them back), so they
//! never wait for a whole cycle. A cycle starts at every start and then
//! once per `scrub_interval_ms`.

use crate::db::Cached as _;
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};
use rvbox_proto::v1 as wire;
use rvbox_segment::parse_segment_file_name;

use crate::error::StoreError;
use crate::incidents::NewIncident;
use crate::recovery::{RecoveryReport, SegRow, Verdict};
use crate::store::{Store, to_i64, to_u64};

pub use rvbox_store_port::maintenance::ScrubReport;

/// Most segments one slice re-verifies.
pub const SEGMENTS_PER_SLICE: usize = 32;
/// Most committed segment bytes one slice reads (a slice always reads at
/// least one segment).
pub const BYTES_PER_SLICE: u64 = 4 * 1024 * 1024;
/// Most command rows one slice of the recount reads.
pub const ROWS_PER_SLICE: u32 = 10_000;
/// Most directory entries one directory may hold for the orphan sweep.
pub const MAX_DIR_ENTRIES: usize = 1_000_000;
/// A slice of the orphan sweep goes on to the next directory until it has
/// checked this many entries (a slice always sweeps at least one).
pub const ENTRIES_PER_SLICE: u64 = 4096;

/// Where the scrub's cycle stands (in memory: a start begins a new cycle).
#[derive(Debug, Default)]
pub(crate) struct ScrubState {
    phase: Phase,
    /// When the last cycle finished (wall ms).
    finished_ms: Option<i64>,
}

#[derive(Debug, Default)]
enum Phase {
    /// Re-verifying sealed and blob segments after this key.
    #[default]
    Verify,
    VerifyAfter([u8; 16], u32),
    /// Sweeping the segment directory with this index.
    Orphans(usize),
    /// Recounting on a read snapshot.
    Counters(Box<Recount>),
    /// The cycle is finished.
    Done,
}

#[derive(Debug)]
struct Recount {
    snapshot: Connection,
    /// The client being summed and where its commands' walk stands.
    client: Option<ClientSum>,
    /// The last client finished.
    after_client: Option<String>,
    /// Clients whose counter differed: (client, counter, recount).
    mismatched: Vec<(String, u64, u64)>,
    clients: u64,
}

#[derive(Debug)]
struct ClientSum {
    client_id: String,
    counter: u64,
    sum: u64,
    /// The last command summed: (issue_time_ms, issue_uuid).
    after: Option<(i64, Vec<u8>)>,
}

impl Store {
    /// Runs one bounded slice of the background scrub (see the module
    /// docs). `idle` in the report says there is nothing to do until the
    /// next cycle is due.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed; damage found becomes
    /// incidents, never an error.
    pub fn scrub(&mut self, now_ms: i64) -> Result<ScrubReport, StoreError> {
        let mut report = ScrubReport::default();
        match self.health.global() {
            crate::health::ScopeState::Ready | crate::health::ScopeState::DirtyReadable => {}
            // the start's integrity check still runs: nothing to judge
            // against yet, but soon (not idle: the next slice comes at the
            // short interval)
            crate::health::ScopeState::Recovering => return Ok(report),
            // unusable until repaired: nothing to do
            crate::health::ScopeState::Unavailable => {
                report.idle = true;
                return Ok(report);
            }
        }
        self.verify_unverified(&mut report, now_ms)?;
        let phase = std::mem::take(&mut self.scrub.phase);
        self.scrub.phase = match phase {
            Phase::Verify => self.reverify_slice(None, &mut report, now_ms)?,
            Phase::VerifyAfter(issue, ordinal) => {
                self.reverify_slice(Some((issue, ordinal)), &mut report, now_ms)?
            }
            Phase::Orphans(i) => self.orphan_slice(i, &mut report)?,
            Phase::Counters(r) => self.recount_slice(r, &mut report, now_ms)?,
            Phase::Done => {
                let interval = self.opts.scrub_interval_ms;
                let due = interval > 0
                    && self
                        .scrub
                        .finished_ms
                        .is_none_or(|t| now_ms >= t.saturating_add(to_i64(interval)));
                if due {
                    tracing::info!("background scrub cycle started");
                    Phase::Verify
                } else {
                    report.idle = report.segments_verified == 0;
                    Phase::Done
                }
            }
        };
        if report.cycle_completed {
            self.scrub.finished_ms = Some(now_ms);
        }
        let m = &self.metrics;
        m.scrubbed("segment_verified", report.segments_verified);
        m.scrubbed("segment_damaged", report.segments_damaged);
        m.scrubbed("orphan_removed", report.orphans_removed);
        m.scrubbed("client_recounted", report.clients_recounted);
        m.scrubbed("counter_mismatch", report.counter_mismatches);
        m.scrubbed("cycle_completed", u64::from(report.cycle_completed));
        Ok(report)
    }

    /// Runs slices until the current cycle ends (tests, the offline tools):
    /// every sealed segment re-verified, every directory swept, every
    /// counter recounted.
    ///
    /// # Errors
    /// As [`Store::scrub`].
    pub fn scrub_cycle(&mut self, now_ms: i64) -> Result<ScrubReport, StoreError> {
        let mut total = ScrubReport::default();
        self.scrub = ScrubState::default();
        if self.health.global() == crate::health::ScopeState::Recovering {
            return Ok(total);
        }
        loop {
            let r = self.scrub(now_ms)?;
            total.segments_verified += r.segments_verified;
            total.segments_damaged += r.segments_damaged;
            total.orphans_removed += r.orphans_removed;
            total.clients_recounted += r.clients_recounted;
            total.counter_mismatches += r.counter_mismatches;
            if r.cycle_completed || r.idle {
                total.cycle_completed = r.cycle_completed;
                return Ok(total);
            }
        }
    }

    /// Verifies up to a slice of sealed or blob segments that carry no
    /// verified fact (their partial index, migration 6).
    fn verify_unverified(
        &mut self,
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let rows = self.segment_rows(
            "SELECT s.issue_uuid, s.ordinal, s.committed_end, c.client_id
             FROM command_segments s JOIN commands c ON c.issue_uuid = s.issue_uuid
             WHERE s.verified = 0 AND s.state IN ('active', 'sealed', 'blob') AND s.state <> 'active'
               AND c.retention = 'retained'
             ORDER BY s.issue_uuid, s.ordinal LIMIT ?1",
            params![SEGMENTS_PER_SLICE as i64],
        )?;
        self.verify_rows(&rows, report, now_ms)
    }

    /// Scans `rows` and applies the verdicts as recovery does.
    fn verify_rows(
        &mut self,
        rows: &[SegRow],
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let scanned =
            crate::recovery::scan_all(self.fs.as_ref(), &self.layout, self.opts.seal_bytes, rows);
        let mut clean = Vec::new();
        let mut recovery = RecoveryReport::default();
        for (row, result) in rows.iter().zip(scanned) {
            report.segments_verified += 1;
            match self.recover_segment(row, result, now_ms, &mut recovery) {
                Ok(Verdict::Clean) => clean.push(row),
                Ok(Verdict::Repaired) => {}
                Err(e) => {
                    self.metrics.scrubbed("segment_failed", 1);
                    tracing::error!(ordinal = row.ordinal, error = %e, "background verification of a segment failed");
                }
            }
        }
        if recovery.segments_damaged > 0 {
            // the damaged commands' scopes turn dirty now
            self.health.refresh(&self.conn)?;
            tracing::error!(
                damaged = recovery.segments_damaged,
                events_lost = recovery.events_lost,
                "background verification found damaged segments; their scopes are dirty"
            );
        }
        report.segments_damaged += recovery.segments_damaged;
        self.mark_verified(&clean)
    }

    /// One slice of the cycle's re-verification.
    fn reverify_slice(
        &mut self,
        after: Option<([u8; 16], u32)>,
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<Phase, StoreError> {
        let (issue, ordinal) = after.unwrap_or(([0; 16], 0));
        let first = after.is_none();
        let mut rows = self.segment_rows(
            "SELECT s.issue_uuid, s.ordinal, s.committed_end, c.client_id
             FROM command_segments s JOIN commands c ON c.issue_uuid = s.issue_uuid
             WHERE (s.issue_uuid, s.ordinal) > (?1, ?2) AND s.state IN ('sealed', 'blob')
               AND c.retention = 'retained'
             ORDER BY s.issue_uuid, s.ordinal LIMIT ?3",
            params![
                issue.as_slice(),
                if first { -1 } else { i64::from(ordinal) },
                SEGMENTS_PER_SLICE as i64
            ],
        )?;
        let full = rows.len() >= SEGMENTS_PER_SLICE;
        // the byte budget: at least one segment per slice
        let mut bytes = 0u64;
        let keep = rows
            .iter()
            .take_while(|r| {
                let first = bytes == 0;
                bytes = bytes.saturating_add(r.committed_end);
                first || bytes <= BYTES_PER_SLICE
            })
            .count();
        let cut = keep < rows.len();
        rows.truncate(keep);
        self.verify_rows(&rows, report, now_ms)?;
        Ok(match rows.last() {
            Some(last) if full || cut => Phase::VerifyAfter(last.issue, last.ordinal),
            _ => Phase::Orphans(0),
        })
    }

    /// One slice of the orphan sweep: directories from `index` on, until
    /// [`ENTRIES_PER_SLICE`] entries were checked.
    fn orphan_slice(
        &mut self,
        index: usize,
        report: &mut ScrubReport,
    ) -> Result<Phase, StoreError> {
        let dirs = self.layout.segment_dirs();
        let mut next = index;
        let mut entries = 0u64;
        while let Some(dir) = dirs.get(next) {
            let (checked, removed) = self.remove_orphans_in(dir)?;
            entries = entries.saturating_add(checked);
            report.orphans_removed += removed;
            next += 1;
            if entries >= ENTRIES_PER_SLICE {
                return Ok(Phase::Orphans(next));
            }
        }
        self.begin_recount()
    }

    /// Removes the segment files in `dir` that no row names: they hold only
    /// bytes of batches that never committed (between two store calls no
    /// batch is in flight, so a file without a row is never one being
    /// written). Names RVBox did not make are left alone (and logged).
    /// Returns the entries checked and the files removed.
    pub(crate) fn remove_orphans_in(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<(u64, u64), StoreError> {
        let names = match self.fs.list(dir, MAX_DIR_ENTRIES) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
            Err(e) => {
                // orphans only cost space; never let them stop the scrub
                tracing::error!(error = %e, "segment directory not listed; orphan files left in place");
                return Ok((0, 0));
            }
        };
        let checked = names.len() as u64;
        let mut removed = 0u64;
        for name in names {
            let Some((issue, ordinal)) = parse_segment_file_name(&name) else {
                tracing::warn!(file = %name, "unrecognised file in the segment directory left alone");
                continue;
            };
            let known: bool = self
                .conn
                .query_row_cached(
                    "SELECT EXISTS (SELECT 1 FROM command_segments WHERE issue_uuid = ?1 AND ordinal = ?2)",
                    params![issue.as_slice(), ordinal],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::sqlite("check segment row", e))?;
            if !known {
                match self.fs.remove_file(&dir.join(&name)) {
                    Ok(()) => removed += 1,
                    Err(e) => {
                        tracing::error!(file = %name, error = %e, "orphan segment not removed")
                    }
                }
            }
        }
        if removed > 0 {
            tracing::info!(files = removed, "orphan segment files removed");
            if let Err(e) = self.fs.sync_dir(dir) {
                tracing::error!(error = %e, "segment directory not synced after orphan removal");
            }
        }
        Ok((checked, removed))
    }

    /// Opens the recount's read snapshot.
    fn begin_recount(&mut self) -> Result<Phase, StoreError> {
        let snapshot = Connection::open_with_flags(
            self.layout.db_file(),
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::sqlite("open the recount snapshot", e))?;
        snapshot
            .busy_timeout(self.opts.db.busy_timeout)
            .map_err(|e| StoreError::sqlite("set busy_timeout", e))?;
        // a read transaction held across slices: one consistent view
        snapshot
            .execute_batch("PRAGMA query_only = ON; BEGIN; SELECT 1 FROM quota_totals;")
            .map_err(|e| StoreError::sqlite("begin the recount snapshot", e))?;
        Ok(Phase::Counters(Box::new(Recount {
            snapshot,
            client: None,
            after_client: None,
            mismatched: Vec::new(),
            clients: 0,
        })))
    }

    /// One slice of the recount: up to [`ROWS_PER_SLICE`] command rows.
    fn recount_slice(
        &mut self,
        mut r: Box<Recount>,
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<Phase, StoreError> {
        let mut budget = ROWS_PER_SLICE;
        loop {
            let Some(mut c) = r.client.take() else {
                // the next client
                let next: Option<(String, i64)> = r
                    .snapshot
                    .query_row_cached(
                        "SELECT client_id, charged_bytes FROM clients
                         WHERE client_id > ?1 ORDER BY client_id LIMIT 1",
                        params![r.after_client.as_deref().unwrap_or("")],
                        |row| Ok((row.get(0)?, row.get(1)?)),
                    )
                    .optional()
                    .map_err(|e| StoreError::sqlite("recount: next client", e))?;
                match next {
                    Some((client_id, counter)) => {
                        r.client = Some(ClientSum {
                            client_id,
                            counter: to_u64(counter),
                            sum: 0,
                            after: None,
                        });
                        continue;
                    }
                    None => return self.finish_recount(*r, report, now_ms),
                }
            };
            if budget == 0 {
                r.client = Some(c);
                return Ok(Phase::Counters(r));
            }
            // a page of this client's commands, newest first by its index
            let asked = budget;
            let (t, id) = c.after.clone().unwrap_or((i64::MAX, vec![0xff; 17]));
            let page: Vec<(i64, Vec<u8>, i64)> = {
                let mut stmt = r
                    .snapshot
                    .prepare_cached(
                        "SELECT issue_time_ms, issue_uuid, charged_bytes FROM commands
                         WHERE client_id = ?1 AND (issue_time_ms, issue_uuid) < (?2, ?3)
                         ORDER BY issue_time_ms DESC, issue_uuid DESC LIMIT ?4",
                    )
                    .map_err(|e| StoreError::sqlite("recount: commands", e))?;
                stmt.query_map(params![c.client_id, t, id, asked], |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?))
                })
                .map_err(|e| StoreError::sqlite("recount: commands", e))?
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("recount: commands", e))?
            };
            let n = u32::try_from(page.len()).unwrap_or(u32::MAX).min(asked);
            budget -= n;
            for (_, _, charged) in &page {
                c.sum = c.sum.saturating_add(to_u64(*charged));
            }
            match page.last() {
                // a full page: more may follow, in this slice or the next
                Some((t, id, _)) if n == asked => {
                    c.after = Some((*t, id.clone()));
                    r.client = Some(c);
                }
                _ => {
                    r.clients += 1;
                    report.clients_recounted += 1;
                    if c.sum != c.counter {
                        r.mismatched.push((c.client_id.clone(), c.counter, c.sum));
                    }
                    r.after_client = Some(c.client_id);
                    // a client costs at least one row of the budget
                    budget = budget.saturating_sub(1);
                }
            }
        }
    }

    /// The last slice of the recount: the server-wide, registry and
    /// operation counters in the same snapshot, then the verdict.
    fn finish_recount(
        &mut self,
        r: Recount,
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<Phase, StoreError> {
        let global: (i64, i64) = r
            .snapshot
            .query_row_cached(
                "SELECT command_charged, (SELECT COALESCE(SUM(charged_bytes), 0) FROM clients)
                 FROM quota_totals WHERE id = 1",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .map_err(|e| StoreError::sqlite("recount global", e))?;
        let check = crate::store::CounterCheck {
            clients: r.mismatched,
            global: (to_u64(global.0), to_u64(global.1)),
            registry: crate::registry::registry_counts_on(&r.snapshot)?,
            operations: crate::store::operation_counts_on(&r.snapshot)?,
        };
        let _ = r.snapshot.execute_batch("COMMIT");
        drop(r.snapshot);
        if !check.consistent() {
            report.counter_mismatches += 1;
            self.repair_counters(&check, now_ms)?;
        }
        report.cycle_completed = true;
        tracing::info!(
            clients = r.clients,
            consistent = check.consistent(),
            "background scrub cycle finished"
        );
        Ok(Phase::Done)
    }

    /// A counter differed from its recount: a `COUNTER_MISMATCH` incident,
    /// repaired at once by rebuilding the derivable counters, which
    /// discards nothing.
    pub(crate) fn repair_counters(
        &mut self,
        check: &crate::store::CounterCheck,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        tracing::error!(
            clients = check.clients.len(),
            "counters differ from a recount; rebuilding them"
        );
        let summary = format!(
            "{} client counter(s) and the global counter ({} recorded, {} recounted) differed from a recount; rebuilt",
            check.clients.len(),
            check.global.0,
            check.global.1
        );
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin counter rebuild", e))?;
        crate::operator::rebuild_counters(&tx)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit counter rebuild", e))?;
        self.record_incident(
            &NewIncident {
                kind: wire::IncidentKind::CounterMismatch,
                scope_kind: wire::ScopeKind::GlobalStore,
                scope_key: String::new(),
                client_id: None,
                issue_uuid: None,
                summary,
                evidence: format!("{:?}", check.clients).into_bytes(),
                data_loss: false,
            },
            now_ms,
            true,
        )?;
        Ok(())
    }
}
