//! Startup recovery (plan §5.1 steps 3-5, §5.3).
//!
//! A start scans only the segments that may hold an uncommitted tail or
//! carry no verified fact (docs/storage.md, "Start-up"); the background
//! scrub (`scrub.rs`) applies the same verdicts to every sealed segment
//! later. Each scanned file is checked against its
//! `committed_end`: bytes beyond it were never acknowledged and are cut
//! (an `UNCOMMITTED_TAIL` incident is recorded already repaired, so history
//! shows it); a missing or corrupt committed range is never "fixed" by
//! moving the offset back: the segment is marked damaged, its lost events
//! become `STORAGE_LOSS` truncation rows, and an open incident with
//! `data_loss` makes the command's scope dirty until an operator
//! acknowledges it. Segment files with no row (created by a batch that
//! never committed) are left to the scrub's orphan sweep, or replaced when
//! a new segment needs the name. Each step is idempotent, so a crash during
//! recovery is recovered by running it again, and one bad segment never
//! stops the others.

use crate::db::Cached as _;
use rusqlite::{TransactionBehavior, params};
use rvbox_proto::v1 as wire;
use rvbox_segment::{ByteRange, Recovery};

use crate::db;
use crate::entropy::uuid_v7;
use crate::error::StoreError;
use crate::incidents::{self, NewIncident};
use std::sync::Arc;

use crate::store::{Store, record_limits, to_i64, to_u64};

/// What recovery did (progress counters; no payload bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments scanned.
    pub segments_scanned: u64,
    /// Segments whose uncommitted tail was cut.
    pub tails_truncated: u64,
    /// Bytes cut from uncommitted tails.
    pub tail_bytes: u64,
    /// Segments found damaged inside their committed range.
    pub segments_damaged: u64,
    /// Events lost with them.
    pub events_lost: u64,
    /// Orphan segment files removed (0 at a start: the background scrub's
    /// orphan sweep removes them, see [`crate::scrub::ScrubReport`]).
    pub orphans_removed: u64,
    /// Valid group journal frames of the current epoch found.
    pub journal_frames: u64,
    /// Segments whose committed bytes were re-appended from the journal.
    pub journal_segments_redone: u64,
    /// Live sessions closed by the restart.
    pub sessions_closed: u64,
    /// Incidents recorded.
    pub incidents: u64,
    /// Non-terminal commands whose essential state failed verification and
    /// were interrupted.
    pub commands_interrupted: u64,
    /// Whether `PRAGMA quick_check` passed.
    pub integrity_ok: bool,
    /// The last segment that failed, as `uuid-hex/ordinal` (never a path).
    pub last_failure: Option<String>,
}

#[derive(Debug)]
pub(crate) struct SegRow {
    pub(crate) issue: [u8; 16],
    pub(crate) ordinal: u32,
    pub(crate) committed_end: u64,
    pub(crate) client_id: String,
}

/// What applying one segment's scan did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The committed range read back clean, nothing beyond it.
    Clean,
    /// A tail was cut or damage recorded.
    Repaired,
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().fold(String::with_capacity(32), |mut s, b| {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn evidence(ranges: &[ByteRange], committed_end: u64, file_len: u64) -> Vec<u8> {
    // a small, self-describing text record; kept immutable with the incident
    let mut out = format!("committed_end={committed_end} file_len={file_len} lost=");
    for r in ranges {
        out.push_str(&format!("{}..{},", r.start, r.end));
    }
    out.into_bytes()
}

/// Attempts of the start-up integrity check before an I/O failure is
/// reported as such.
pub const INTEGRITY_CHECK_ATTEMPTS: u32 = 3;

/// What the start-up integrity check found.
#[derive(Debug)]
pub(crate) enum Integrity {
    /// `ok`.
    Ok,
    /// SQLite's findings: real damage (an integrity incident).
    Findings(StoreError),
    /// The check itself could not run (every attempt failed reading the
    /// database): not corruption.
    Io(StoreError),
}

/// Runs `check` up to `attempts` times: findings (and a database SQLite
/// calls malformed) are final at once, a failure to read the database (an
/// I/O error, a lock) is tried again after a short pause (50 ms,
/// doubling), and reported as I/O when it persists.
pub(crate) fn integrity_check(
    mut check: impl FnMut() -> Result<(), StoreError>,
    attempts: u32,
    mut pause: impl FnMut(std::time::Duration),
) -> Integrity {
    let mut wait = std::time::Duration::from_millis(50);
    let mut attempt = 1;
    loop {
        match check() {
            Ok(()) => return Integrity::Ok,
            // findings, and a database SQLite calls malformed: damage
            Err(e) if !unreadable(&e) => return Integrity::Findings(e),
            Err(e) if attempt >= attempts => return Integrity::Io(e),
            Err(e) => {
                tracing::warn!(error = %e, attempt, "the SQLite integrity check failed to run; trying again");
                pause(wait);
                wait = wait.saturating_mul(2);
                attempt += 1;
            }
        }
    }
}

/// Whether `e` says the database could not be read (an I/O error, or a
/// lock held elsewhere), as opposed to something read and found damaged.
fn unreadable(e: &StoreError) -> bool {
    match e {
        StoreError::Sqlite {
            source: rusqlite::Error::SqliteFailure(f, _),
            ..
        } => matches!(
            f.code,
            rusqlite::ErrorCode::SystemIoFailure
                | rusqlite::ErrorCode::DatabaseBusy
                | rusqlite::ErrorCode::DatabaseLocked
        ),
        StoreError::Io { .. } => true,
        _ => false,
    }
}

/// The start-up integrity check (`PRAGMA quick_check`), running on the
/// recovery pool on its own connection beside the scope recovery (plan
/// §5.1: global readiness waits for it; client scopes do not).
#[derive(Debug)]
pub struct StartupCheck {
    handle: Option<std::thread::JoinHandle<Result<bool, StoreError>>>,
    /// The verdict, once it was waited for.
    settled: Option<Result<bool, StoreError>>,
}

impl StartupCheck {
    /// Waits for the check: `Ok(true)` when it passed, `Ok(false)` when it
    /// found damage (recorded as a `SQLITE_INTEGRITY_FAILURE` incident, the
    /// store unavailable), and an error when it could not read the
    /// database (an I/O failure, not corruption; the store unavailable and
    /// the start to be tried again).
    ///
    /// # Errors
    /// The I/O failure.
    pub fn wait(mut self) -> Result<bool, StoreError> {
        self.settle();
        self.settled.take().unwrap_or(Ok(true))
    }

    fn settle(&mut self) -> &Result<bool, StoreError> {
        if let Some(h) = self.handle.take() {
            self.settled = Some(h.join().unwrap_or_else(|_| {
                Err(StoreError::Integrity(
                    "the integrity check's thread panicked".into(),
                ))
            }));
        }
        self.settled.get_or_insert(Ok(true))
    }

    /// Whether the check has finished.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.handle
            .as_ref()
            .is_none_or(std::thread::JoinHandle::is_finished)
    }
}

impl Drop for StartupCheck {
    fn drop(&mut self) {
        // never leave the check running unobserved past its handle
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The body of the integrity check's thread: the check that gates global
/// readiness (the structure of every table and its indexes,
/// `PRAGMA quick_check(TABLE)` with CHECK constraints left out, on
/// [`RECOVERY_WORKERS`] connections at once, after one sequential read of
/// the database file), then, with the store ready, the unrestricted
/// `PRAGMA quick_check` (every CHECK constraint of every row, and the page
/// accounting: no page used twice, none lost) on this connection.
fn run_startup_check(
    db_file: &std::path::Path,
    opts: db::DbOptions,
    health: &crate::health::Health,
    metrics: &crate::metrics::StoreMetrics,
    entropy: &dyn crate::entropy::Entropy,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let started = std::time::Instant::now();
    prefetch(db_file);
    // opening the connection reads the database too: an attempt opens it
    // when the last one could not
    let mut conn: Option<rusqlite::Connection> = None;
    let verdict = integrity_check(
        || {
            if conn.is_none() {
                conn = Some(db::open(db_file, opts)?);
            }
            match conn.as_ref() {
                Some(c) => quick_check_tables(db_file, opts, c),
                None => Ok(()),
            }
        },
        INTEGRITY_CHECK_ATTEMPTS,
        std::thread::sleep,
    );
    match verdict {
        Integrity::Ok => {
            health.integrity_passed();
            metrics.recovered("integrity_checked", 1);
            tracing::info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "SQLite integrity check of every table passed"
            );
            let Some(c) = conn.as_ref() else {
                return Ok(true);
            };
            // the page accounting, with the store serving
            match db::quick_check(c) {
                Ok(()) => {
                    tracing::info!(
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "SQLite integrity check of the whole file passed"
                    );
                    Ok(true)
                }
                Err(e) if unreadable(&e) => {
                    // nothing is known to be damaged, and the store has
                    // served since the tables passed: say so loudly
                    metrics.recovered("integrity_check_io_error", 1);
                    tracing::error!(error = %e, "the SQLite integrity check of the whole file could not read the database (an I/O error, not a finding)");
                    Ok(true)
                }
                Err(e) => {
                    record_integrity_failure(
                        conn, db_file, opts, health, metrics, entropy, &e, now_ms,
                    );
                    Ok(false)
                }
            }
        }
        Integrity::Io(e) => {
            // the check could not read the database: nothing is known to
            // be damaged, so no integrity incident; the store stays
            // unavailable and the start fails, to be tried again
            health.integrity_failed();
            metrics.recovered("integrity_check_io_error", 1);
            tracing::error!(error = %e, attempts = INTEGRITY_CHECK_ATTEMPTS, "the SQLite integrity check could not read the database (an I/O error, not a finding); the store stays unavailable");
            Err(e)
        }
        Integrity::Findings(e) => {
            record_integrity_failure(conn, db_file, opts, health, metrics, entropy, &e, now_ms);
            Ok(false)
        }
    }
}

/// Reads the database file once from start to end, so the integrity check
/// that follows finds its pages in the page cache instead of reading them
/// one at a time in b-tree order (best effort: an error here is the
/// check's to meet and report).
fn prefetch(db_file: &std::path::Path) {
    use std::io::Read as _;
    let Ok(mut f) = std::fs::File::open(db_file) else {
        return;
    };
    let mut buf = vec![0u8; 1 << 20];
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
}

/// `PRAGMA quick_check(TABLE)` for every table of the schema (its rows,
/// its indexes, their b-trees), on [`RECOVERY_WORKERS`] connections at
/// once, the largest tables first.
fn quick_check_tables(
    db_file: &std::path::Path,
    opts: db::DbOptions,
    conn: &rusqlite::Connection,
) -> Result<(), StoreError> {
    quick_check_tables_from(db_file, opts, conn, PARALLEL_TABLE_CHECK_BYTES)
}

/// [`quick_check_tables`] with the size from which the workers check.
fn quick_check_tables_from(
    db_file: &std::path::Path,
    opts: db::DbOptions,
    conn: &rusqlite::Connection,
    parallel_from: u64,
) -> Result<(), StoreError> {
    let bad = |e| StoreError::sqlite("quick_check", e);
    let mut tables: Vec<String> = {
        let mut stmt = conn
            .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")
            .map_err(bad)?;
        stmt.query_map([], |r| r.get(0))
            .map_err(bad)?
            .collect::<Result<_, _>>()
            .map_err(bad)?
    };
    tables.push("sqlite_schema".into());
    // the tables that grow with the history go first (a shared queue: the
    // workers take the next one when done)
    const LARGEST: [&str; 5] = [
        "command_events",
        "commands",
        "control_mutations",
        "command_segments",
        "command_tombstones",
    ];
    tables.sort_by_key(|t| LARGEST.iter().position(|l| l == t).unwrap_or(LARGEST.len()));
    let size = std::fs::metadata(db_file).map_or(u64::MAX, |m| m.len());
    if size < parallel_from {
        // a small database: checked on this connection, one table after
        // the other (the workers' connections and threads would cost more
        // than they save); CHECK constraints are left out here too, and
        // put back for the whole-file check that follows
        conn.execute_batch("PRAGMA ignore_check_constraints = ON")
            .map_err(bad)?;
        let mut findings = Vec::new();
        let mut failed = None;
        for table in &tables {
            match check_table(conn, table) {
                Ok(rows) => findings.extend(rows),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // put back before anything else uses the connection; a table's
        // own error is the one reported
        let restored = conn.execute_batch("PRAGMA ignore_check_constraints = OFF");
        if let Some(e) = failed {
            return Err(e);
        }
        restored.map_err(bad)?;
        return if findings.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Integrity(findings.join("; ")))
        };
    }
    tables.reverse(); // popped from the end
    let queue = std::sync::Mutex::new(tables);
    let findings = std::sync::Mutex::new(Vec::<String>::new());
    let failure = std::sync::Mutex::new(None::<StoreError>);
    std::thread::scope(|scope| {
        for _ in 0..RECOVERY_WORKERS {
            scope.spawn(|| {
                let worker = match db::open(db_file, opts) {
                    Ok(c) => c,
                    Err(e) => {
                        if let Ok(mut f) = failure.lock() {
                            f.get_or_insert(e);
                        }
                        return;
                    }
                };
                // the b-trees, their cells and NOT NULL are checked here;
                // the CHECK constraints of every row (several times the
                // cost) with the whole-file check that follows readiness.
                // This connection only reads, so the setting changes no
                // write.
                if let Err(e) = worker.execute_batch("PRAGMA ignore_check_constraints = ON") {
                    if let Ok(mut f) = failure.lock() {
                        f.get_or_insert(StoreError::sqlite("quick_check", e));
                    }
                    return;
                }
                loop {
                    let next = queue.lock().ok().and_then(|mut q| q.pop());
                    let Some(table) = next else { break };
                    match check_table(&worker, &table) {
                        Ok(rows) => {
                            if let Ok(mut f) = findings.lock() {
                                f.extend(rows);
                            }
                        }
                        Err(e) => {
                            if let Ok(mut f) = failure.lock() {
                                f.get_or_insert(e);
                            }
                            break;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    let findings = findings.into_inner().unwrap_or_default();
    if findings.is_empty() {
        Ok(())
    } else {
        Err(StoreError::Integrity(findings.join("; ")))
    }
}

/// Database files from this size on have their tables checked on
/// [`RECOVERY_WORKERS`] connections at once; smaller ones on the check's
/// own connection.
pub const PARALLEL_TABLE_CHECK_BYTES: u64 = 64 * 1024 * 1024;

/// `PRAGMA quick_check(TABLE)` of one table: its findings, each named
/// after the table (none when it is sound).
fn check_table(conn: &rusqlite::Connection, table: &str) -> Result<Vec<String>, StoreError> {
    let sql = format!("PRAGMA quick_check(\"{}\")", table.replace('"', "\"\""));
    let rows = conn
        .prepare(&sql)
        .and_then(|mut st| {
            st.query_map([], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|e| StoreError::sqlite("quick_check", e))?;
    if rows.len() == 1 && rows.first().is_some_and(|r| r == "ok") {
        return Ok(Vec::new());
    }
    Ok(rows.into_iter().map(|r| format!("{table}: {r}")).collect())
}

/// Records what the integrity check found: the store unavailable, a
/// `SQLITE_INTEGRITY_FAILURE` incident (held in memory when the database
/// cannot take it).
#[allow(clippy::too_many_arguments)]
fn record_integrity_failure(
    conn: Option<rusqlite::Connection>,
    db_file: &std::path::Path,
    opts: db::DbOptions,
    health: &crate::health::Health,
    metrics: &crate::metrics::StoreMetrics,
    entropy: &dyn crate::entropy::Entropy,
    e: &StoreError,
    now_ms: i64,
) {
    health.integrity_failed();
    metrics.recovered("integrity_failed", 1);
    tracing::error!(error = %e, "SQLite integrity check failed");
    let incident = NewIncident {
        kind: wire::IncidentKind::SqliteIntegrityFailure,
        scope_kind: wire::ScopeKind::GlobalStore,
        scope_key: String::new(),
        client_id: None,
        issue_uuid: None,
        summary: "SQLite reported integrity problems; stop the server and run rvbox-server repair"
            .into(),
        evidence: e.to_string().into_bytes(),
        data_loss: false,
    };
    let recorded = uuid_v7(entropy, now_ms)
        .map_err(|e| StoreError::io("mint incident id", "", e))
        .and_then(|id| {
            let mut conn = match conn {
                Some(c) => c,
                None => db::open(db_file, opts)?,
            };
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| StoreError::sqlite("begin incident", e))?;
            incidents::insert(&tx, id, &incident, now_ms)?;
            tx.commit()
                .map_err(|e| StoreError::sqlite("commit incident", e))?;
            health.refresh(&conn)
        });
    match recorded {
        Ok(()) => {
            metrics
                .incidents
                .get_or_create(&crate::metrics::KindLabel {
                    kind: incident.kind.as_str_name(),
                })
                .inc();
        }
        Err(write_error) => {
            // the database cannot even take the incident: keep it in
            // memory, visible through health, until offline repair
            tracing::error!(error = %write_error, "integrity incident held in memory only");
            health.set_bootstrap(&incident, now_ms);
        }
    }
}

impl Store {
    /// Runs recovery and waits for the integrity check; see
    /// [`Store::begin_recovery`]. Safe to run more than once. The store is
    /// globally ready when it returns, unless the integrity check found
    /// damage (`integrity_ok` false, the store unavailable).
    ///
    /// # Errors
    /// [`StoreError`] when the database itself cannot be used, including
    /// an integrity check that could not read it; a bad segment is
    /// recorded as an incident and recovery moves on.
    pub fn recover(&mut self, now_ms: i64) -> Result<RecoveryReport, StoreError> {
        let (mut report, check) = self.begin_recovery(now_ms)?;
        report.integrity_ok = report.integrity_ok && check.wait()?;
        if report.integrity_ok {
            self.health.refresh(&self.conn)?;
        } else {
            report.incidents += 1;
        }
        Ok(report)
    }

    /// The bounded part of a start (docs/storage.md, "Start-up"): starts the
    /// integrity check on its own thread, then, beside it, finishes stale
    /// evictions, replays the group journal, scans the segments that could
    /// hold an uncommitted tail or were never verified (active ones, and
    /// sealed or blob ones without the verified fact), closes the prior
    /// sessions and checks the essential state of every non-terminal
    /// command. When it returns the client, command and segment scopes
    /// serve; the global scope is ready once the returned check passes.
    /// Everything proportional to the store's history (re-verifying sealed
    /// segments, the orphan sweep, the counter recount) is left to the
    /// background scrub ([`Store::scrub`]).
    ///
    /// # Errors
    /// [`StoreError`] when the database cannot be used.
    pub fn begin_recovery(
        &mut self,
        now_ms: i64,
    ) -> Result<(RecoveryReport, StartupCheck), StoreError> {
        let mut report = RecoveryReport {
            integrity_ok: true,
            ..Default::default()
        };
        self.health.set_recovering();
        self.health.integrity_running();
        let check = {
            let (db_file, opts) = (self.layout.db_file(), self.opts.db);
            let (health, metrics) = (self.health.clone(), self.metrics.clone());
            let entropy = Arc::clone(&self.entropy);
            std::thread::Builder::new()
                .name("rvbox-integrity".into())
                .spawn(move || {
                    run_startup_check(&db_file, opts, &health, &metrics, entropy.as_ref(), now_ms)
                })
                .map_err(|e| StoreError::io("start the integrity check", "", e))?
        };
        let mut check = StartupCheck {
            handle: Some(check),
            settled: None,
        };
        match self.recover_scopes(&mut report, now_ms) {
            Ok(()) => Ok((report, check)),
            Err(e) => {
                // the scope recovery could not use the database: when the
                // integrity check finds it damaged, that is the verdict (an
                // incident, unavailable); otherwise the start fails
                if matches!(check.settle(), Ok(false)) {
                    report.integrity_ok = false;
                    tracing::error!(error = %e, "scope recovery stopped on a damaged database");
                    return Ok((report, check));
                }
                self.health.set_unavailable();
                Err(e)
            }
        }
    }

    fn recover_scopes(
        &mut self,
        report: &mut RecoveryReport,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        self.open_segments.clear();
        // plan §5.4: finish stale evictions and pending deletions first, so
        // files an eviction already moved are never mistaken for loss
        self.sweep(now_ms)?;
        // committed bytes a power cut took from segment files come back
        // from the group journal before anything is judged lost
        let replay = self.replay_journal()?;
        report.journal_frames = replay.frames;
        report.journal_segments_redone = replay.segments_redone;
        let rows = self.unverified_segments()?;
        let fs = self.fs.clone();
        for batch in rows.chunks(RECOVERY_BATCH) {
            // read and scan on the bounded pool; apply the verdicts here, in
            // order, on the single writer
            let scanned = scan_all(fs.as_ref(), &self.layout, self.opts.seal_bytes, batch);
            let mut clean = Vec::new();
            for (row, result) in batch.iter().zip(scanned) {
                report.segments_scanned += 1;
                match self.recover_segment(row, result, now_ms, report) {
                    Ok(Verdict::Clean) => clean.push(row),
                    Ok(Verdict::Repaired) => {}
                    Err(e) => {
                        // one bad segment never stops recovery of the others
                        let key = format!("{}/{}", hex(&row.issue), row.ordinal);
                        tracing::error!(segment = %key, error = %e, "segment recovery failed");
                        report.last_failure = Some(key);
                    }
                }
            }
            self.mark_verified(&clean)?;
        }
        // plan §5.4/§5.5: audit segment recovery (retention.rs, audit.rs)
        self.recover_retention(now_ms)?;
        report.sessions_closed = to_u64(
            self.conn
                .execute_cached(
                    "UPDATE sessions SET live = 0, closed_ms = ?1, close_reason = 'server restarted' WHERE live = 1",
                    params![now_ms],
                )
                .map_err(|e| StoreError::sqlite("close prior sessions", e))? as i64,
        );
        report.commands_interrupted += self.verify_essential_state(now_ms)?;
        // every segment byte is in its own file now (redone ones included)
        self.checkpoint_journal()?;
        // the background scrub starts its cycle afresh
        self.scrub = crate::scrub::ScrubState::default();
        self.health.recovered(&self.conn)?;
        let m = &self.metrics;
        m.recovered("command_interrupted", report.commands_interrupted);
        m.recovered("tail_truncated", report.tails_truncated);
        m.recovered("segment_damaged", report.segments_damaged);
        m.recovered("journal_redone", report.journal_segments_redone);
        m.recovered("session_closed", report.sessions_closed);
        tracing::info!(
            segments = report.segments_scanned,
            tails = report.tails_truncated,
            damaged = report.segments_damaged,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "store scopes recovered; the integrity check gates global readiness"
        );
        Ok(())
    }

    /// Records the verified fact for sealed and blob segments that scanned
    /// clean (active ones may still grow and never carry it).
    pub(crate) fn mark_verified(&mut self, rows: &[&SegRow]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin verified facts", e))?;
        for row in rows {
            tx.execute_cached(
                "UPDATE command_segments SET verified = 1
                 WHERE issue_uuid = ?1 AND ordinal = ?2 AND state IN ('sealed', 'blob')
                   AND committed_end = ?3 AND verified = 0",
                params![row.issue.as_slice(), row.ordinal, to_i64(row.committed_end)],
            )
            .map_err(|e| StoreError::sqlite("record a verified segment", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit verified facts", e))
    }

    /// Re-verifies every live segment of one command and applies the
    /// verdicts exactly as recovery does: call it when a read found a
    /// stored record failing verification. Damage inside the committed
    /// range becomes `STORAGE_LOSS` truncation rows, the segment is marked
    /// damaged (kept as evidence) and an open incident makes the command's
    /// scope dirty; readers then get an explicit truncation where the error
    /// was, never a silent gap. Appends continue in a new segment.
    ///
    /// # Errors
    /// [`StoreError`] when the database cannot be used.
    pub fn reverify_command(
        &mut self,
        issue: &[u8; 16],
        now_ms: i64,
    ) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport {
            integrity_ok: true,
            ..Default::default()
        };
        let rows = self.live_segments_of(issue)?;
        // the active file may be replaced by a damaged one's successor
        self.open_segments.remove(issue);
        for row in &rows {
            report.segments_scanned += 1;
            let scanned = scan_segment(self.fs.as_ref(), &self.layout, self.opts.seal_bytes, row);
            if let Err(e) = self.recover_segment(row, scanned, now_ms, &mut report) {
                let key = format!("{}/{}", hex(&row.issue), row.ordinal);
                tracing::error!(segment = %key, error = %e, "segment re-verification failed");
                report.last_failure = Some(key);
            }
        }
        self.health.refresh(&self.conn)?;
        self.metrics
            .recovered("segment_damaged", report.segments_damaged);
        tracing::warn!(
            segments = report.segments_scanned,
            damaged = report.segments_damaged,
            events_lost = report.events_lost,
            "command output re-verified after a read failed verification"
        );
        Ok(report)
    }

    /// The live segments a start scans: active ones and sealed or blob ones
    /// without the verified fact (their partial index, migration 6), and
    /// the script blob of every non-terminal command (essential state, plan
    /// §5.1 item 5); a few rows however long the history.
    fn unverified_segments(&self) -> Result<Vec<SegRow>, StoreError> {
        self.segment_rows(
            "SELECT s.issue_uuid, s.ordinal, s.committed_end, c.client_id
             FROM command_segments s JOIN commands c ON c.issue_uuid = s.issue_uuid
             WHERE s.verified = 0 AND s.state IN ('active', 'sealed', 'blob')
               AND c.retention = 'retained'
             UNION
             SELECT s.issue_uuid, s.ordinal, s.committed_end, c.client_id
             FROM commands c JOIN command_segments s ON s.issue_uuid = c.issue_uuid AND s.ordinal = 0
             WHERE c.lifecycle < 5 AND s.state = 'blob' AND c.retention = 'retained'
             ORDER BY 1, 2",
            [],
        )
    }

    /// Every live segment of one command.
    fn live_segments_of(&self, issue: &[u8; 16]) -> Result<Vec<SegRow>, StoreError> {
        self.segment_rows(
            "SELECT s.issue_uuid, s.ordinal, s.committed_end, c.client_id
             FROM command_segments s JOIN commands c ON c.issue_uuid = s.issue_uuid
             WHERE s.issue_uuid = ?1 AND s.state IN ('active', 'sealed', 'blob')
               AND c.retention = 'retained'
             ORDER BY s.ordinal",
            [issue.as_slice()],
        )
    }

    pub(crate) fn segment_rows(
        &self,
        sql: &str,
        args: impl rusqlite::Params,
    ) -> Result<Vec<SegRow>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(sql)
            .map_err(|e| StoreError::sqlite("list segments", e))?;
        let rows = stmt
            .query_map(args, |r| {
                let issue: Vec<u8> = r.get(0)?;
                Ok(SegRow {
                    issue: <[u8; 16]>::try_from(issue.as_slice()).unwrap_or([0; 16]),
                    ordinal: r.get(1)?,
                    committed_end: to_u64(r.get(2)?),
                    client_id: r.get(3)?,
                })
            })
            .map_err(|e| StoreError::sqlite("list segments", e))?;
        rows.collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sqlite("list segments", e))
    }

    pub(crate) fn recover_segment(
        &mut self,
        row: &SegRow,
        scanned: Result<ScannedSegment, StoreError>,
        now_ms: i64,
        report: &mut RecoveryReport,
    ) -> Result<Verdict, StoreError> {
        let ScannedSegment {
            path,
            scan: result,
            file_len,
            max_len,
        } = scanned?;
        match result.recovery {
            Recovery::Clean if file_len <= max_len => Ok(Verdict::Clean),
            Recovery::Clean | Recovery::TruncateTail { .. } => {
                let cut = rvbox_storage::segment_io::cut_tail(
                    self.fs.as_ref(),
                    &path,
                    row.committed_end,
                )?;
                report.tails_truncated += 1;
                report.tail_bytes = report.tail_bytes.saturating_add(cut);
                self.record_incident(
                    &NewIncident {
                        kind: wire::IncidentKind::UncommittedTail,
                        scope_kind: wire::ScopeKind::Segment,
                        scope_key: format!("{}/{}", hex(&row.issue), row.ordinal),
                        client_id: Some(row.client_id.clone()),
                        issue_uuid: Some(row.issue),
                        summary: format!(
                            "{cut} unacknowledged bytes beyond the committed end were truncated"
                        ),
                        evidence: evidence(&[], row.committed_end, file_len),
                        data_loss: false,
                    },
                    now_ms,
                    true,
                )?;
                report.incidents += 1;
                Ok(Verdict::Repaired)
            }
            Recovery::CommittedDamage {
                lost,
                tail_beyond_committed,
            } => {
                if tail_beyond_committed {
                    rvbox_storage::segment_io::cut_tail(
                        self.fs.as_ref(),
                        &path,
                        row.committed_end,
                    )?;
                }
                let missing = file_len < row.committed_end;
                let lost_events = self.mark_damaged(row, &lost, missing, file_len, now_ms)?;
                report.segments_damaged += 1;
                report.events_lost = report.events_lost.saturating_add(lost_events);
                report.incidents += 1;
                if row.ordinal == crate::blobs::BLOB_ORDINAL {
                    // the script is essential state: without it the command
                    // cannot run; interrupt it (its UUID never runs again)
                    if self.interrupt_if_active(&row.issue, now_ms)? {
                        report.commands_interrupted += 1;
                    }
                }
                Ok(Verdict::Repaired)
            }
        }
    }

    /// Records a committed-range loss: segment `damaged`, one `STORAGE_LOSS`
    /// truncation row per contiguous run of lost events (exact totals from
    /// their metadata rows), and one open incident; all in one transaction.
    fn mark_damaged(
        &mut self,
        row: &SegRow,
        lost: &[ByteRange],
        missing: bool,
        file_len: u64,
        now_ms: i64,
    ) -> Result<u64, StoreError> {
        let id = uuid_v7(self.entropy.as_ref(), now_ms)
            .map_err(|e| StoreError::io("mint incident id", "", e))?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin damage record", e))?;
        // events of this segment whose record starts in a lost range
        let mut stmt = tx
            .prepare_cached(
                "SELECT event_seq, segment_offset, raw_len, stored_len FROM command_events
                 WHERE issue_uuid = ?1 AND segment_ordinal = ?2 ORDER BY event_seq",
            )
            .map_err(|e| StoreError::sqlite("list segment events", e))?;
        let events: Vec<(u64, u64, u64, u64)> = stmt
            .query_map(params![row.issue.as_slice(), row.ordinal], |r| {
                Ok((
                    to_u64(r.get(0)?),
                    to_u64(r.get(1)?),
                    to_u64(r.get(2)?),
                    to_u64(r.get(3)?),
                ))
            })
            .map_err(|e| StoreError::sqlite("list segment events", e))?
            .collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("list segment events", e))?;
        drop(stmt);
        let is_lost = |off: u64| lost.iter().any(|r| r.start <= off && off < r.end);
        let mut runs: Vec<(u64, u64, u64, u64)> = Vec::new(); // first, last, raw, stored
        for (seq, _, raw, stored) in events.iter().copied().filter(|e| is_lost(e.1)) {
            match runs.last_mut() {
                Some(run) if run.1.saturating_add(1) == seq => {
                    run.1 = seq;
                    run.2 = run.2.saturating_add(raw);
                    run.3 = run.3.saturating_add(stored);
                }
                _ => runs.push((seq, seq, raw, stored)),
            }
        }
        let lost_events: u64 = runs.iter().map(|r| r.1 - r.0 + 1).sum();
        let scope_key = format!("{}/{}", hex(&row.issue), row.ordinal);
        let kind = if missing {
            wire::IncidentKind::MissingCommittedBytes
        } else {
            wire::IncidentKind::ChecksumMismatch
        };
        let new = NewIncident {
            kind,
            scope_kind: wire::ScopeKind::Command,
            scope_key: uuid::Uuid::from_bytes(row.issue).hyphenated().to_string(),
            client_id: Some(row.client_id.clone()),
            issue_uuid: Some(row.issue),
            summary: if row.ordinal == crate::blobs::BLOB_ORDINAL {
                format!(
                    "the command's script blob lost {} committed bytes; the command cannot run",
                    lost.iter().map(ByteRange::len).sum::<u64>()
                )
            } else {
                format!(
                    "segment {} lost {} committed bytes ({lost_events} events); the output is marked truncated",
                    row.ordinal,
                    lost.iter().map(ByteRange::len).sum::<u64>()
                )
            },
            evidence: evidence(lost, row.committed_end, file_len),
            data_loss: true,
        };
        incidents::insert(&tx, id, &new, now_ms)?;
        self.metrics
            .incidents
            .get_or_create(&crate::metrics::KindLabel {
                kind: new.kind.as_str_name(),
            })
            .inc();
        for (first, last, raw, stored) in &runs {
            tx.execute_cached(
                "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
                     source, reason, incident_id, recorded_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![
                    row.issue.as_slice(),
                    to_i64(*first),
                    to_i64(*last),
                    to_i64(*raw),
                    to_i64(*stored),
                    wire::TruncationSource::StorageLoss as i32,
                    "committed output lost in server storage",
                    id.as_slice(),
                    now_ms
                ],
            )
            .map_err(|e| StoreError::sqlite("record storage-loss truncation", e))?;
        }
        tx.execute_cached(
            "UPDATE command_segments SET state = 'damaged' WHERE issue_uuid = ?1 AND ordinal = ?2",
            params![row.issue.as_slice(), row.ordinal],
        )
        .map_err(|e| StoreError::sqlite("mark segment damaged", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit damage record", e))?;
        tracing::error!(segment = %scope_key, events_lost = lost_events, "committed segment range lost");
        Ok(lost_events)
    }

    /// Inserts an incident; `repaired` records it already resolved (a safe
    /// repair that ran automatically).
    pub(crate) fn record_incident(
        &mut self,
        new: &NewIncident,
        now_ms: i64,
        repaired: bool,
    ) -> Result<[u8; 16], StoreError> {
        let id = uuid_v7(self.entropy.as_ref(), now_ms)
            .map_err(|e| StoreError::io("mint incident id", "", e))?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin incident", e))?;
        incidents::insert(&tx, id, new, now_ms)?;
        self.metrics
            .incidents
            .get_or_create(&crate::metrics::KindLabel {
                kind: new.kind.as_str_name(),
            })
            .inc();
        if repaired {
            tx.execute_cached(
                "UPDATE storage_incidents SET state = 2, resolved_ms = ?2 WHERE incident_id = ?1",
                params![id.as_slice(), now_ms],
            )
            .map_err(|e| StoreError::sqlite("resolve incident", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit incident", e))?;
        self.hook.at(crate::crash::points::INCIDENT_AFTER_COMMIT);
        self.health.refresh(&self.conn)?;
        Ok(id)
    }
}

impl Store {
    /// Verifies the essential state of every non-terminal command (its
    /// immutable spec decodes and hashes to the stored request hash). A
    /// command that fails is interrupted, keeps its tombstone so its UUID
    /// never runs again, and gets an open incident; nothing else is touched
    /// (plan §5.3: essential-state corruption interrupts only the affected
    /// command). Returns how many were interrupted.
    fn verify_essential_state(&mut self, now_ms: i64) -> Result<u64, StoreError> {
        type Row = (Vec<u8>, String, Vec<u8>, Vec<u8>);
        let rows: Vec<Row> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT issue_uuid, client_id, request_hash, spec_zstd FROM commands
                     WHERE lifecycle < 5 AND essential_trusted = 1 AND retention = 'retained'",
                )
                .map_err(|e| StoreError::sqlite("list active commands", e))?;
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .map_err(|e| StoreError::sqlite("list active commands", e))?
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("list active commands", e))?
        };
        let cap = usize::try_from(rvbox_domain::limits::MAX_EXECUTION_SPEC_BYTES).unwrap_or(0);
        let mut interrupted = 0u64;
        for (issue, client, hash, spec_zstd) in rows {
            let Ok(issue) = <[u8; 16]>::try_from(issue.as_slice()) else {
                continue;
            };
            let trusted = zstd::bulk::decompress(&spec_zstd, cap)
                .ok()
                .and_then(|raw| {
                    <wire::ExecutionSpec as prost::Message>::decode(raw.as_slice()).ok()
                })
                .zip(rvbox_domain::ids::ClientId::parse("client_id", &client).ok())
                .is_some_and(|(spec, client)| {
                    rvbox_domain::hash::command_hash(&client, &spec)
                        .as_bytes()
                        .as_slice()
                        == hash.as_slice()
                });
            if trusted {
                continue;
            }
            self.interrupt_untrusted(&issue, &client, &hash, true, now_ms)?;
            interrupted += 1;
        }
        Ok(interrupted)
    }

    /// Interrupts a non-terminal command whose blob segment was found
    /// damaged (the damage incident is already recorded). Returns whether
    /// the command was active.
    fn interrupt_if_active(&mut self, issue: &[u8; 16], now_ms: i64) -> Result<bool, StoreError> {
        let row: Option<(String, Vec<u8>, i64)> = self
            .conn
            .query_row_cached(
                "SELECT client_id, request_hash, lifecycle FROM commands WHERE issue_uuid = ?1",
                params![issue.as_slice()],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                other => Err(other),
            })
            .map_err(|e| StoreError::sqlite("read command", e))?;
        match row {
            Some((client, hash, lifecycle)) if lifecycle < 5 => {
                self.interrupt_untrusted(issue, &client, &hash, false, now_ms)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn interrupt_untrusted(
        &mut self,
        issue: &[u8; 16],
        client: &str,
        hash: &[u8],
        with_incident: bool,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let id = uuid_v7(self.entropy.as_ref(), now_ms)
            .map_err(|e| StoreError::io("mint incident id", "", e))?;
        let key = uuid::Uuid::from_bytes(*issue).hyphenated().to_string();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin interrupt", e))?;
        let new = NewIncident {
            kind: wire::IncidentKind::ChecksumMismatch,
            scope_kind: wire::ScopeKind::Command,
            scope_key: key.clone(),
            client_id: Some(client.to_owned()),
            issue_uuid: Some(*issue),
            summary: "the command's immutable spec or request hash failed verification; the command was interrupted".into(),
            evidence: b"essential_state=spec_or_request_hash".to_vec(),
            data_loss: true,
        };
        if with_incident {
            incidents::insert(&tx, id, &new, now_ms)?;
        }
        tx.execute_cached(
            "UPDATE commands SET lifecycle = ?2, terminal_time_ms = MAX(?3, issue_time_ms), essential_trusted = 0
             WHERE issue_uuid = ?1",
            params![issue.as_slice(), wire::Lifecycle::Interrupted as i32, now_ms],
        )
        .map_err(|e| StoreError::sqlite("interrupt command", e))?;
        if hash.len() == 32 {
            tx.execute_cached(
                "INSERT INTO command_tombstones (issue_uuid, request_hash, client_id, lifecycle, terminal_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (issue_uuid) DO NOTHING",
                params![issue.as_slice(), hash, client, wire::Lifecycle::Interrupted as i32, now_ms],
            )
            .map_err(|e| StoreError::sqlite("insert tombstone", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit interrupt", e))?;
        if !with_incident {
            tracing::error!(issue_uuid = %key, "command interrupted: its script blob is damaged");
            return Ok(());
        }
        self.metrics
            .incidents
            .get_or_create(&crate::metrics::KindLabel {
                kind: new.kind.as_str_name(),
            })
            .inc();
        tracing::error!(issue_uuid = %key, "command essential state untrusted; interrupted");
        Ok(())
    }
}

use rvbox_storage::segment_io::ScannedSegment;

/// Reads and scans one segment (no writes): the part of recovery that the
/// bounded pool runs in parallel. The buffer lives only while scanning.
fn scan_segment(
    fs: &dyn crate::fs::StoreFs,
    layout: &crate::layout::Layout,
    seal_bytes: u64,
    row: &SegRow,
) -> Result<ScannedSegment, StoreError> {
    let path = layout
        .segment_path(&row.issue, row.ordinal)
        .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))?;
    let limits = if row.ordinal == crate::blobs::BLOB_ORDINAL {
        crate::blobs::script_limits()
    } else {
        record_limits()
    };
    // A sealed or active segment is never larger than the seal size plus
    // one record.
    rvbox_storage::segment_io::read_and_scan(fs, &path, row.committed_end, seal_bytes, &limits)
}

/// Threads of the recovery pool.
pub const RECOVERY_WORKERS: usize = 2;
/// Segments read and scanned per round of the pool (bounds what is held at once).
const RECOVERY_BATCH: usize = 256;

/// Scans `rows` on a bounded pool of threads, in order of `rows`.
pub(crate) fn scan_all(
    fs: &dyn crate::fs::StoreFs,
    layout: &crate::layout::Layout,
    seal_bytes: u64,
    rows: &[SegRow],
) -> Vec<Result<ScannedSegment, StoreError>> {
    let per = rows.len().div_ceil(RECOVERY_WORKERS).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(per)
            .map(|chunk| {
                let n = chunk.len();
                let h = scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|row| scan_segment(fs, layout, seal_bytes, row))
                        .collect::<Vec<_>>()
                });
                (n, h)
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|(n, h)| {
                // one result per row, even if a worker died
                h.join().unwrap_or_else(|_| {
                    (0..n)
                        .map(|_| Err(StoreError::Integrity("a recovery worker panicked".into())))
                        .collect()
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod integrity_tests {
    use super::*;

    /// A database of two tables, the second's root page scribbled over
    /// when `damage`.
    fn database(dir: &std::path::Path, damage: bool) -> std::path::PathBuf {
        let file = dir.join("t.sqlite3");
        {
            let c = db::open(&file, db::DbOptions::default()).unwrap();
            c.execute_batch(
                "CREATE TABLE a (x INTEGER NOT NULL CHECK (x >= 0));
                 CREATE TABLE b (y TEXT NOT NULL);
                 CREATE INDEX b_y ON b (y);",
            )
            .unwrap();
            for i in 0..400 {
                c.execute("INSERT INTO a VALUES (?1)", [i]).unwrap();
                c.execute("INSERT INTO b VALUES (?1)", [format!("row {i:>60}")])
                    .unwrap();
            }
        } // closed: the WAL is checkpointed into the file
        if damage {
            let root: i64 = rusqlite::Connection::open(&file)
                .unwrap()
                .query_row(
                    "SELECT rootpage FROM sqlite_schema WHERE name = 'b'",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            let mut bytes = std::fs::read(&file).unwrap();
            let at = (usize::try_from(root).unwrap() - 1) * 4096;
            for x in &mut bytes[at..at + 4096] {
                *x = 0x5a;
            }
            std::fs::write(&file, &bytes).unwrap();
        }
        file
    }

    #[test]
    fn tables_are_checked_alike_on_the_workers_and_on_one_connection() {
        let mut verdicts = Vec::new();
        for parallel_from in [0, u64::MAX] {
            let dir = tempfile::tempdir().unwrap();
            let sound = database(dir.path(), false);
            let c = db::open(&sound, db::DbOptions::default()).unwrap();
            quick_check_tables_from(&sound, db::DbOptions::default(), &c, parallel_from).unwrap();
            // CHECK constraints are enforced again on the connection
            let ignored: i64 = c
                .query_row("PRAGMA ignore_check_constraints", [], |r| r.get(0))
                .unwrap();
            assert_eq!(ignored, 0, "parallel_from {parallel_from}");
            drop(c);

            let dir = tempfile::tempdir().unwrap();
            let damaged = database(dir.path(), true);
            let c = db::open(&damaged, db::DbOptions::default()).unwrap();
            let e = quick_check_tables_from(&damaged, db::DbOptions::default(), &c, parallel_from)
                .expect_err("the damaged table is found");
            verdicts.push(e.to_string());
        }
        assert_eq!(verdicts[0], verdicts[1]);
        assert!(verdicts[0].contains("malformed"), "{verdicts:?}");
    }

    fn io_error() -> StoreError {
        StoreError::sqlite(
            "quick_check",
            rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR),
                None,
            ),
        )
    }

    #[test]
    fn a_transient_read_error_is_tried_again_and_passes() {
        let mut calls = 0;
        let mut pauses = Vec::new();
        let r = integrity_check(
            || {
                calls += 1;
                if calls < 3 { Err(io_error()) } else { Ok(()) }
            },
            3,
            |d| pauses.push(d.as_millis()),
        );
        assert!(matches!(r, Integrity::Ok), "{r:?}");
        assert_eq!(pauses, vec![50, 100]);
    }

    #[test]
    fn a_persistent_read_error_is_io_and_never_a_finding() {
        let mut calls = 0;
        let r = integrity_check(
            || {
                calls += 1;
                Err(io_error())
            },
            3,
            |_| {},
        );
        assert!(matches!(r, Integrity::Io(_)), "{r:?}");
        assert_eq!(calls, 3);
    }

    #[test]
    fn a_malformed_database_is_a_finding_not_an_io_error() {
        let r = integrity_check(
            || {
                Err(StoreError::sqlite(
                    "quick_check",
                    rusqlite::Error::SqliteFailure(
                        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
                        None,
                    ),
                ))
            },
            3,
            |_| panic!("no retry for damage"),
        );
        assert!(matches!(r, Integrity::Findings(_)), "{r:?}");
    }

    #[test]
    fn findings_are_final_at_once() {
        let mut calls = 0;
        let r = integrity_check(
            || {
                calls += 1;
                Err(StoreError::Integrity("row 3 missing from index".into()))
            },
            3,
            |_| {},
        );
        assert!(matches!(r, Integrity::Findings(_)), "{r:?}");
        assert_eq!(calls, 1);
    }
}
