//! Invariants checked after every simulation step (architecture.md "The
//! simulator"): no command UUID runs twice, no acknowledged event is lost
//! or changed, every sequence gap is a truncation record, lifecycles move
//! only along legal edges, revisions and generations only grow, quota
//! counters equal a recount, and a client never has two live sessions.
//!
//! [`Checker`] keeps what it saw in earlier steps. It reads the store only
//! through `Store::db()` (queries) and `Store::check_counters`, and the
//! clients only through their [`Ledger`]s. Work per step is bounded: the
//! commands that changed since the last step plus a round-robin sweep of
//! [`SWEEP_COMMANDS_PER_STEP`] others are checked in depth
//! ([`Checker::full_check`] checks them all).

use rvbox_store::db::Cached as _;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_store::Store;

use crate::host::Ledger;
use crate::rng::uuid_text;

/// Commands checked in depth per step besides the changed ones.
pub const SWEEP_COMMANDS_PER_STEP: usize = 64;
/// Most acknowledged events the checker remembers; beyond it the run
/// fails with [`Invariant::CheckerBounds`] rather than silently checking
/// less.
pub const MAX_TRACKED_ACKED_EVENTS: usize = 4_000_000;
/// Most commands the checker remembers.
pub const MAX_TRACKED_COMMANDS: usize = 1_000_000;
/// Most violations one check returns.
pub const MAX_VIOLATIONS_PER_CHECK: usize = 256;
/// Largest raw length [`content_digest`] decompresses.
pub const MAX_DIGEST_RAW_BYTES: usize = 64 * 1024;

/// `CommandEvent.body` field numbers: the store's `command_events.body_kind`.
pub use rvbox_store::events::body_kind;

/// Content digest of a non-output body, as the store computes
/// `command_events.content_sha256`: SHA-256 of the body kind byte followed
/// by the prost encoding of the body message.
#[must_use]
pub fn body_digest(kind: u8, encoded: &[u8]) -> [u8; 32] {
    let mut buf = Vec::with_capacity(encoded.len().saturating_add(1));
    buf.push(kind);
    buf.extend_from_slice(encoded);
    rvbox_segment::sha256(&buf)
}

/// Why [`content_digest`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DigestError {
    /// The event has no body.
    NoBody,
    /// The output payload does not decompress to its raw length.
    BadOutput,
}

impl fmt::Display for DigestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoBody => f.write_str("event has no body"),
            Self::BadOutput => f.write_str("output payload does not decompress to its raw length"),
        }
    }
}

impl std::error::Error for DigestError {}

/// The digest the store keeps for `event`: SHA-256 of the raw
/// (decompressed) bytes for output, [`body_digest`] for every other body.
/// It assumes the server stores a non-output body as the prost encoding
/// of the body message (what `EventBody::{Lifecycle, Other}.encoded` must
/// hold).
///
/// # Errors
/// [`DigestError`] for a bodiless event or undecodable output.
pub fn content_digest(event: &wire::CommandEvent) -> Result<[u8; 32], DigestError> {
    let (kind, encoded) = match event.body.as_ref().ok_or(DigestError::NoBody)? {
        Body::Output(o) => {
            let raw_len = usize::try_from(o.raw_length).map_err(|_| DigestError::BadOutput)?;
            if raw_len > MAX_DIGEST_RAW_BYTES {
                return Err(DigestError::BadOutput);
            }
            let raw =
                zstd::bulk::decompress(&o.payload, raw_len).map_err(|_| DigestError::BadOutput)?;
            if raw.len() != raw_len {
                return Err(DigestError::BadOutput);
            }
            return Ok(rvbox_segment::sha256(&raw));
        }
        Body::Lifecycle(b) => (body_kind::LIFECYCLE, b.encode_to_vec()),
        Body::Truncation(b) => (body_kind::TRUNCATION, b.encode_to_vec()),
        Body::Incomplete(b) => (body_kind::INCOMPLETE, b.encode_to_vec()),
        Body::SignalResult(b) => (body_kind::SIGNAL_RESULT, b.encode_to_vec()),
        Body::StdinAck(b) => (body_kind::STDIN_ACK, b.encode_to_vec()),
        Body::Diagnostics(b) => (body_kind::DIAGNOSTICS, b.encode_to_vec()),
        Body::ProfileResult(b) => (body_kind::PROFILE_RESULT, b.encode_to_vec()),
    };
    Ok(body_digest(kind, &encoded))
}

/// The invariants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// No command UUID is accepted fresh or started more than once, by any
    /// client.
    SingleExecution,
    /// Every event the server acknowledged is stored with the same content,
    /// unless retention reclaimed the command or a truncation row covers it.
    AckedEventDurable,
    /// Lifecycles move only along legal edges; a command never vanishes
    /// while non-terminal.
    LegalLifecycle,
    /// A command's event sequences are exactly `1..=last_event_seq`, each
    /// missing one covered by a truncation row.
    ContiguousSequence,
    /// Command revisions never decrease.
    RevisionMonotonic,
    /// Client generations never decrease.
    GenerationMonotonic,
    /// Charged-byte counters equal a recount.
    QuotaCounters,
    /// At most one live session per client.
    OneLiveSession,
    /// The checker or a ledger hit a bound and stopped recording.
    CheckerBounds,
    /// A fleet run's counters equal its targets' states, each released
    /// target's state is its command's, an unreleased target has no
    /// command, and no run has more in flight than its `max_parallel`.
    FleetRuns,
}

impl Invariant {
    /// Stable name for traces and reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::SingleExecution => "single_execution",
            Self::AckedEventDurable => "acked_event_durable",
            Self::LegalLifecycle => "legal_lifecycle",
            Self::ContiguousSequence => "contiguous_sequence",
            Self::RevisionMonotonic => "revision_monotonic",
            Self::GenerationMonotonic => "generation_monotonic",
            Self::QuotaCounters => "quota_counters",
            Self::OneLiveSession => "one_live_session",
            Self::CheckerBounds => "checker_bounds",
            Self::FleetRuns => "fleet_runs",
        }
    }
}

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which one.
    pub invariant: Invariant,
    /// The command concerned (canonical text), if any.
    pub issue_uuid: Option<String>,
    /// The client concerned, if any.
    pub client_id: Option<String>,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant {} violated", self.invariant.name())?;
        if let Some(issue) = &self.issue_uuid {
            write!(f, " for command {issue}")?;
        }
        if let Some(client) = &self.client_id {
            write!(f, " (client {client})")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// The store could not be read (not a violation: the check did not run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckError {
    /// What was being read.
    pub what: &'static str,
    /// The underlying error.
    pub detail: String,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant check could not {}: {}",
            self.what, self.detail
        )
    }
}

impl std::error::Error for CheckError {}

fn sql<E: fmt::Display>(what: &'static str) -> impl FnOnce(E) -> CheckError {
    move |e| CheckError {
        what,
        detail: e.to_string(),
    }
}

fn blob16(v: &[u8]) -> Option<[u8; 16]> {
    <[u8; 16]>::try_from(v).ok()
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn lifecycle_index(l: Lifecycle) -> usize {
    Lifecycle::ALL.iter().position(|x| *x == l).unwrap_or(0)
}

/// `reach[a][b]`: a path of one or more legal public edges leads from
/// `Lifecycle::ALL[a]` to `Lifecycle::ALL[b]`.
fn reachability() -> Vec<Vec<bool>> {
    let n = Lifecycle::ALL.len();
    let mut reach: Vec<Vec<bool>> = Lifecycle::ALL
        .iter()
        .map(|a| {
            Lifecycle::ALL
                .iter()
                .map(|b| a.check_transition(*b).is_ok())
                .collect()
        })
        .collect();
    for k in 0..n {
        for i in 0..n {
            let via = reach
                .get(i)
                .and_then(|r| r.get(k))
                .copied()
                .unwrap_or(false);
            if !via {
                continue;
            }
            let row_k: Vec<bool> = reach.get(k).cloned().unwrap_or_default();
            if let Some(row_i) = reach.get_mut(i) {
                for (cell, through) in row_i.iter_mut().zip(row_k) {
                    *cell |= through;
                }
            }
        }
    }
    reach
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Observed {
    lifecycle: Lifecycle,
    revision: u64,
    last_event_seq: u64,
    truncations: u64,
}

/// What the ledger deltas told the checker about one command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Executions {
    accepts: u32,
    starts: u32,
    clients: BTreeSet<String>,
}

/// Steps between two recounts of the quota and registry counters.
pub const COUNTER_CHECK_EVERY: u64 = 8;

/// The invariant checker; keeps the previous step's observations.
#[derive(Debug, Clone)]
pub struct Checker {
    reach: Vec<Vec<bool>>,
    last: BTreeMap<[u8; 16], Observed>,
    acked: BTreeMap<[u8; 16], BTreeMap<u64, [u8; 32]>>,
    acked_count: usize,
    executions: BTreeMap<Uuid7, Executions>,
    generations: BTreeMap<String, u64>,
    dirty: BTreeSet<[u8; 16]>,
    sweep_after: Option<[u8; 16]>,
    bounds_reported: bool,
    checks: u64,
    /// The store's tombstone FIFO length: once it is full, a reclaimed
    /// command may have lost its tombstone too (plan §5.4: the FIFO is
    /// bounded), and its disappearance is retention, not loss.
    tombstone_cap: Option<u64>,
    /// Most commands it tracks ([`MAX_TRACKED_COMMANDS`]).
    max_commands: usize,
    /// Most acknowledged events it tracks ([`MAX_TRACKED_ACKED_EVENTS`]).
    max_acked_events: usize,
}

impl Default for Checker {
    fn default() -> Self {
        Self::new()
    }
}

impl Checker {
    /// Tells the checker the store's tombstone FIFO length.
    pub fn set_tombstone_cap(&mut self, cap: u64) {
        self.tombstone_cap = Some(cap);
    }

    /// A checker that has seen nothing yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            reach: reachability(),
            last: BTreeMap::new(),
            acked: BTreeMap::new(),
            acked_count: 0,
            executions: BTreeMap::new(),
            generations: BTreeMap::new(),
            dirty: BTreeSet::new(),
            sweep_after: None,
            bounds_reported: false,
            checks: 0,
            tombstone_cap: None,
            max_commands: MAX_TRACKED_COMMANDS,
            max_acked_events: MAX_TRACKED_ACKED_EVENTS,
        }
    }

    /// A checker with smaller bounds than [`MAX_TRACKED_COMMANDS`] and
    /// [`MAX_TRACKED_ACKED_EVENTS`] (never larger), for the tests that
    /// watch it stop recording and say so.
    #[must_use]
    pub fn with_bounds(commands: usize, acked_events: usize) -> Self {
        Self {
            max_commands: commands.min(MAX_TRACKED_COMMANDS),
            max_acked_events: acked_events.min(MAX_TRACKED_ACKED_EVENTS),
            ..Self::new()
        }
    }

    /// Acknowledged events being tracked.
    #[must_use]
    pub fn tracked_acked_events(&self) -> usize {
        self.acked_count
    }

    /// Store checks run so far.
    #[must_use]
    pub fn checks(&self) -> u64 {
        self.checks
    }

    fn reachable(&self, from: Lifecycle, to: Lifecycle) -> bool {
        self.reach
            .get(lifecycle_index(from))
            .and_then(|r| r.get(lifecycle_index(to)))
            .copied()
            .unwrap_or(false)
    }

    fn bounds(&mut self, out: &mut Vec<Violation>, detail: String) {
        if !self.bounds_reported {
            self.bounds_reported = true;
            out.push(Violation {
                invariant: Invariant::CheckerBounds,
                issue_uuid: None,
                client_id: None,
                detail,
            });
        }
    }

    /// Takes what `ledger` recorded since the last call: fresh acceptances
    /// and starts (single execution across every client) and acknowledged
    /// events (checked against the store by [`Self::check_store`]).
    pub fn absorb(&mut self, client_id: &str, ledger: &mut Ledger) -> Vec<Violation> {
        let mut out = Vec::new();
        if ledger.overflowed() {
            self.bounds(
                &mut out,
                format!("the ledger of client {client_id} overflowed"),
            );
        }
        let delta = ledger.take_new();
        for (issue, starts) in delta
            .accepts
            .iter()
            .map(|i| (*i, false))
            .chain(delta.starts.iter().map(|i| (*i, true)))
        {
            if !self.executions.contains_key(&issue) && self.executions.len() >= self.max_commands {
                self.bounds(&mut out, "too many commands to track executions".into());
                continue;
            }
            let e = self.executions.entry(issue).or_default();
            e.clients.insert(client_id.to_owned());
            let (n, what) = if starts {
                e.starts = e.starts.saturating_add(1);
                (e.starts, "started")
            } else {
                e.accepts = e.accepts.saturating_add(1);
                (e.accepts, "accepted")
            };
            if n > 1 {
                let clients: Vec<&str> = e.clients.iter().map(String::as_str).collect();
                out.push(Violation {
                    invariant: Invariant::SingleExecution,
                    issue_uuid: Some(issue.to_string()),
                    client_id: Some(client_id.to_owned()),
                    detail: format!("{what} {n} times (by clients {clients:?})"),
                });
            }
        }
        for ack in delta.acks {
            let key = *ack.issue.as_bytes();
            if !self.acked.contains_key(&key) && self.acked.len() >= self.max_commands {
                self.bounds(
                    &mut out,
                    "too many commands with acknowledged events".into(),
                );
                continue;
            }
            let per = self.acked.entry(key).or_default();
            match per.get(&ack.event_seq) {
                Some(d) if *d != ack.digest => out.push(Violation {
                    invariant: Invariant::AckedEventDurable,
                    issue_uuid: Some(ack.issue.to_string()),
                    client_id: Some(client_id.to_owned()),
                    detail: format!(
                        "event_seq {} acknowledged with two different contents",
                        ack.event_seq
                    ),
                }),
                Some(_) => {}
                None => {
                    if self.acked_count >= self.max_acked_events {
                        self.bounds(&mut out, "too many acknowledged events to track".into());
                        continue;
                    }
                    per.insert(ack.event_seq, ack.digest);
                    self.acked_count = self.acked_count.saturating_add(1);
                }
            }
            self.dirty.insert(key);
        }
        out.truncate(MAX_VIOLATIONS_PER_CHECK);
        out
    }

    /// [`Self::absorb`] every ledger, then [`Self::check_store`].
    ///
    /// # Errors
    /// [`CheckError`] when the store cannot be read.
    pub fn check<'a>(
        &mut self,
        store: &Store,
        ledgers: impl IntoIterator<Item = (&'a str, &'a mut Ledger)>,
    ) -> Result<Vec<Violation>, CheckError> {
        let mut out = Vec::new();
        for (client, ledger) in ledgers {
            out.extend(self.absorb(client, ledger));
        }
        out.extend(self.check_store(store)?);
        out.truncate(MAX_VIOLATIONS_PER_CHECK);
        Ok(out)
    }

    /// One step's store checks: every command's lifecycle, revision and
    /// last sequence against the previous step; the changed commands plus
    /// a sweep in depth (sequences, acknowledged events); counters,
    /// sessions and generations.
    ///
    /// # Errors
    /// [`CheckError`] when the store cannot be read.
    pub fn check_store(&mut self, store: &Store) -> Result<Vec<Violation>, CheckError> {
        self.run(store, false)
    }

    /// Like [`Self::check_store`], but checks every command in depth.
    ///
    /// # Errors
    /// [`CheckError`] when the store cannot be read.
    pub fn full_check(&mut self, store: &Store) -> Result<Vec<Violation>, CheckError> {
        self.run(store, true)
    }

    fn run(&mut self, store: &Store, full: bool) -> Result<Vec<Violation>, CheckError> {
        self.checks = self.checks.saturating_add(1);
        // one read transaction for the whole check: one consistent view,
        // and one lock cycle instead of one per query
        let view = store
            .db()
            .unchecked_transaction()
            .map_err(sql("begin the check's read transaction"))?;
        let r = self.run_in(store, full);
        view.rollback()
            .map_err(sql("end the check's read transaction"))?;
        r
    }

    fn run_in(&mut self, store: &Store, full: bool) -> Result<Vec<Violation>, CheckError> {
        let mut out = Vec::new();
        self.scan_commands(store, &mut out)?;
        if full {
            let all: Vec<[u8; 16]> = self.last.keys().chain(self.acked.keys()).copied().collect();
            self.dirty.extend(all);
        } else {
            self.sweep();
        }
        let dirty = std::mem::take(&mut self.dirty);
        for issue in dirty {
            self.check_command(store, issue, &mut out)?;
            if out.len() >= MAX_VIOLATIONS_PER_CHECK {
                break;
            }
        }
        // counters are recounted over every command: every
        // COUNTER_CHECK_EVERY-th step and in every full check (a wrong
        // counter stays wrong until rebuilt, so it is still caught)
        if full || self.checks.is_multiple_of(COUNTER_CHECK_EVERY) {
            self.check_counters(store, &mut out)?;
        }
        self.check_sessions(store, &mut out)?;
        self.check_fleets(store, &mut out)?;
        out.truncate(MAX_VIOLATIONS_PER_CHECK);
        Ok(out)
    }

    fn check_fleets(&mut self, store: &Store, out: &mut Vec<Violation>) -> Result<(), CheckError> {
        let problems =
            rvbox_store::fleet::fleet_problems(store.db()).map_err(sql("check the fleet runs"))?;
        for detail in problems {
            out.push(Violation {
                invariant: Invariant::FleetRuns,
                issue_uuid: None,
                client_id: None,
                detail,
            });
        }
        Ok(())
    }

    fn sweep(&mut self) {
        let start = self.sweep_after;
        let mut picked: Vec<[u8; 16]> = match start {
            Some(after) => self
                .last
                .range((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded))
                .map(|(k, _)| *k)
                .take(SWEEP_COMMANDS_PER_STEP)
                .collect(),
            None => Vec::new(),
        };
        if picked.len() < SWEEP_COMMANDS_PER_STEP {
            let more = SWEEP_COMMANDS_PER_STEP - picked.len();
            let wrap: Vec<[u8; 16]> = self
                .last
                .keys()
                .take_while(|k| start.is_none_or(|s| **k <= s))
                .take(more)
                .copied()
                .collect();
            picked.extend(wrap);
        }
        self.sweep_after = picked.last().copied();
        self.dirty.extend(picked);
    }

    fn scan_commands(&mut self, store: &Store, out: &mut Vec<Violation>) -> Result<(), CheckError> {
        let db = store.db();
        let mut stmt = db
            .prepare_cached("SELECT issue_uuid, lifecycle, revision, last_event_seq FROM commands")
            .map_err(sql("prepare the command scan"))?;
        let rows: Vec<(Vec<u8>, i64, i64, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .map_err(sql("scan commands"))?
            .collect::<Result<_, _>>()
            .map_err(sql("scan commands"))?;
        let mut trunc_stmt = db
            .prepare_cached(
                "SELECT issue_uuid, COUNT(*) FROM output_truncations GROUP BY issue_uuid",
            )
            .map_err(sql("prepare the truncation count"))?;
        let truncs: BTreeMap<Vec<u8>, i64> = trunc_stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(sql("count truncations"))?
            .collect::<Result<_, _>>()
            .map_err(sql("count truncations"))?;
        let mut present = BTreeSet::new();
        for (blob, lifecycle, revision, last_seq) in rows {
            let Some(issue) = blob16(&blob) else {
                continue;
            };
            present.insert(issue);
            let text = Some(uuid_text(&issue));
            let Ok(lc) = Lifecycle::from_wire(i32::try_from(lifecycle).unwrap_or(0)) else {
                out.push(Violation {
                    invariant: Invariant::LegalLifecycle,
                    issue_uuid: text,
                    client_id: None,
                    detail: format!("stored lifecycle {lifecycle} is not a lifecycle"),
                });
                continue;
            };
            let now = Observed {
                lifecycle: lc,
                revision: to_u64(revision),
                last_event_seq: to_u64(last_seq),
                truncations: truncs.get(blob.as_slice()).copied().map_or(0, to_u64),
            };
            match self.last.get(&issue).copied() {
                None => {
                    if lc != Lifecycle::Queued && !self.reachable(Lifecycle::Queued, lc) {
                        out.push(Violation {
                            invariant: Invariant::LegalLifecycle,
                            issue_uuid: text.clone(),
                            client_id: None,
                            detail: format!("first seen {lc}, unreachable from queued"),
                        });
                    }
                    self.dirty.insert(issue);
                }
                Some(prev) => {
                    if prev.lifecycle != lc && !self.reachable(prev.lifecycle, lc) {
                        out.push(Violation {
                            invariant: Invariant::LegalLifecycle,
                            issue_uuid: text.clone(),
                            client_id: None,
                            detail: format!("moved {} -> {lc}", prev.lifecycle),
                        });
                    }
                    if now.revision < prev.revision {
                        out.push(Violation {
                            invariant: Invariant::RevisionMonotonic,
                            issue_uuid: text.clone(),
                            client_id: None,
                            detail: format!(
                                "revision went from {} to {}",
                                prev.revision, now.revision
                            ),
                        });
                    }
                    if now.last_event_seq < prev.last_event_seq {
                        out.push(Violation {
                            invariant: Invariant::ContiguousSequence,
                            issue_uuid: text.clone(),
                            client_id: None,
                            detail: format!(
                                "last_event_seq went from {} to {}",
                                prev.last_event_seq, now.last_event_seq
                            ),
                        });
                    }
                    if now.last_event_seq != prev.last_event_seq
                        || now.truncations != prev.truncations
                    {
                        self.dirty.insert(issue);
                    }
                }
            }
            if !self.last.contains_key(&issue) && self.last.len() >= self.max_commands {
                self.bounds(out, "too many commands to track lifecycles".into());
                continue;
            }
            self.last.insert(issue, now);
        }
        let gone: Vec<([u8; 16], Observed)> = self
            .last
            .iter()
            .filter(|(k, _)| !present.contains(*k))
            .map(|(k, v)| (*k, *v))
            .collect();
        for (issue, prev) in gone {
            // plan §5.4: retention reclaims terminal commands only. A
            // command can end and be reclaimed between two observations
            // (its terminal event and an eviction in one executor batch):
            // its tombstone then says how it ended.
            let ended_unseen = !prev.lifecycle.is_terminal()
                && db
                    .query_row_cached(
                        "SELECT COALESCE((SELECT lifecycle FROM command_tombstones
                             WHERE issue_uuid = ?1), 0)",
                        [issue.as_slice()],
                        |r| r.get::<_, i64>(0),
                    )
                    .map_err(sql("read a tombstone"))
                    .map(|l| {
                        i32::try_from(l)
                            .ok()
                            .and_then(|l| Lifecycle::from_wire(l).ok())
                            .is_some_and(Lifecycle::is_terminal)
                    })?;
            if !prev.lifecycle.is_terminal() && !ended_unseen {
                out.push(Violation {
                    invariant: Invariant::LegalLifecycle,
                    issue_uuid: Some(uuid_text(&issue)),
                    client_id: None,
                    detail: format!("vanished from the store while {}", prev.lifecycle),
                });
            }
            self.last.remove(&issue);
            if self.acked.contains_key(&issue) {
                self.dirty.insert(issue);
            }
        }
        Ok(())
    }

    fn check_command(
        &mut self,
        store: &Store,
        issue: [u8; 16],
        out: &mut Vec<Violation>,
    ) -> Result<(), CheckError> {
        let db = store.db();
        let text = uuid_text(&issue);
        let mut ev_stmt = db
            .prepare_cached(
                "SELECT event_seq, content_sha256 FROM command_events
                 WHERE issue_uuid = ?1 ORDER BY event_seq",
            )
            .map_err(sql("prepare the event read"))?;
        let events: BTreeMap<i64, Vec<u8>> = ev_stmt
            .query_map([issue.as_slice()], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(sql("read events"))?
            .collect::<Result<_, _>>()
            .map_err(sql("read events"))?;
        let mut tr_stmt = db
            .prepare_cached(
                "SELECT first_seq, last_seq FROM output_truncations
                 WHERE issue_uuid = ?1 AND first_seq IS NOT NULL ORDER BY first_seq",
            )
            .map_err(sql("prepare the truncation read"))?;
        let ranges: Vec<(u64, u64)> = tr_stmt
            .query_map([issue.as_slice()], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
            })
            .map_err(sql("read truncations"))?
            .map(|row| row.map(|(a, b)| (to_u64(a), to_u64(b))))
            .collect::<Result<_, _>>()
            .map_err(sql("read truncations"))?;
        let covered = |seq: u64| ranges.iter().any(|(a, b)| *a <= seq && seq <= *b);

        if let Some(obs) = self.last.get(&issue).copied() {
            // sequences: rows within 1..=last, every missing one covered
            let last = obs.last_event_seq;
            if let Some((seq, _)) = events.iter().find(|(s, _)| **s < 1 || to_u64(**s) > last) {
                out.push(Violation {
                    invariant: Invariant::ContiguousSequence,
                    issue_uuid: Some(text.clone()),
                    client_id: None,
                    detail: format!("event row {seq} outside 1..={last}"),
                });
            }
            let mut seq = 1u64;
            while seq <= last {
                let have = i64::try_from(seq).is_ok_and(|s| events.contains_key(&s));
                if !have && !covered(seq) {
                    out.push(Violation {
                        invariant: Invariant::ContiguousSequence,
                        issue_uuid: Some(text.clone()),
                        client_id: None,
                        detail: format!(
                            "event_seq {seq} of 1..={last} is missing and no truncation covers it"
                        ),
                    });
                    break;
                }
                seq = seq.saturating_add(1);
            }
        }

        let Some(acked) = self.acked.get(&issue) else {
            return Ok(());
        };
        if !self.last.contains_key(&issue) {
            // the command row is gone: reclaimed by retention (its replay
            // tombstone remains) or lost
            let tombstoned: bool = db
                .query_row_cached(
                    "SELECT EXISTS (SELECT 1 FROM command_tombstones WHERE issue_uuid = ?1)",
                    [issue.as_slice()],
                    |r| r.get(0),
                )
                .map_err(sql("read tombstones"))?;
            let fifo_full = match self.tombstone_cap {
                Some(cap) => {
                    let n: i64 = db
                        .query_row_cached("SELECT COUNT(*) FROM command_tombstones", [], |r| {
                            r.get(0)
                        })
                        .map_err(sql("count tombstones"))?;
                    u64::try_from(n).is_ok_and(|n| n >= cap)
                }
                None => false,
            };
            if !tombstoned && !fifo_full {
                out.push(Violation {
                    invariant: Invariant::AckedEventDurable,
                    issue_uuid: Some(text),
                    client_id: None,
                    detail: format!(
                        "{} acknowledged events are gone with their command, which has no tombstone",
                        acked.len()
                    ),
                });
            }
            let n = acked.len();
            self.acked.remove(&issue);
            self.acked_count = self.acked_count.saturating_sub(n);
            return Ok(());
        }
        for (seq, digest) in acked {
            let row = i64::try_from(*seq).ok().and_then(|s| events.get(&s));
            match row {
                Some(stored) if stored.as_slice() == digest.as_slice() => {}
                Some(_) => {
                    out.push(Violation {
                        invariant: Invariant::AckedEventDurable,
                        issue_uuid: Some(text.clone()),
                        client_id: None,
                        detail: format!(
                            "acknowledged event_seq {seq} is stored with other content"
                        ),
                    });
                }
                None if covered(*seq) => {}
                None => {
                    out.push(Violation {
                        invariant: Invariant::AckedEventDurable,
                        issue_uuid: Some(text.clone()),
                        client_id: None,
                        detail: format!(
                            "acknowledged event_seq {seq} is missing and no truncation covers it"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    fn check_counters(
        &mut self,
        store: &Store,
        out: &mut Vec<Violation>,
    ) -> Result<(), CheckError> {
        let c = store
            .check_counters()
            .map_err(sql("recount quota counters"))?;
        for (client, counter, recount) in &c.clients {
            out.push(Violation {
                invariant: Invariant::QuotaCounters,
                issue_uuid: None,
                client_id: Some(client.clone()),
                detail: format!("charged_bytes {counter} but the recount is {recount}"),
            });
        }
        if c.global.0 != c.global.1 {
            out.push(Violation {
                invariant: Invariant::QuotaCounters,
                issue_uuid: None,
                client_id: None,
                detail: format!(
                    "global command_charged {} but clients sum to {}",
                    c.global.0, c.global.1
                ),
            });
        }
        if c.registry.counters != c.registry.recount {
            out.push(Violation {
                invariant: Invariant::QuotaCounters,
                issue_uuid: None,
                client_id: None,
                detail: format!(
                    "registry counters (clients, sessions) {:?} but the recount is {:?}",
                    c.registry.counters, c.registry.recount
                ),
            });
        }
        Ok(())
    }

    fn check_sessions(
        &mut self,
        store: &Store,
        out: &mut Vec<Violation>,
    ) -> Result<(), CheckError> {
        let db = store.db();
        let mut stmt = db
            .prepare_cached(
                "SELECT client_id, COUNT(*) FROM sessions WHERE live = 1
                 GROUP BY client_id HAVING COUNT(*) > 1 ORDER BY client_id",
            )
            .map_err(sql("prepare the live-session count"))?;
        let doubles: Vec<(String, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(sql("count live sessions"))?
            .collect::<Result<_, _>>()
            .map_err(sql("count live sessions"))?;
        for (client, n) in doubles {
            out.push(Violation {
                invariant: Invariant::OneLiveSession,
                issue_uuid: None,
                client_id: Some(client),
                detail: format!("{n} live sessions"),
            });
        }
        let mut gen_stmt = db
            .prepare_cached("SELECT client_id, generation FROM clients ORDER BY client_id")
            .map_err(sql("prepare the generation read"))?;
        let gens: Vec<(String, i64)> = gen_stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(sql("read generations"))?
            .collect::<Result<_, _>>()
            .map_err(sql("read generations"))?;
        for (client, generation) in gens {
            let generation = to_u64(generation);
            if let Some(prev) = self.generations.get(&client).copied()
                && generation < prev
            {
                out.push(Violation {
                    invariant: Invariant::GenerationMonotonic,
                    issue_uuid: None,
                    client_id: Some(client.clone()),
                    detail: format!("generation went from {prev} to {generation}"),
                });
            }
            if self.generations.contains_key(&client) || self.generations.len() < self.max_commands
            {
                self.generations.insert(client, generation);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;

    #[test]
    fn reachability_follows_the_edge_table() {
        let c = Checker::new();
        use Lifecycle as L;
        assert!(c.reachable(L::Queued, L::Running));
        assert!(c.reachable(L::Dispatched, L::Succeeded));
        assert!(c.reachable(L::Dispatched, L::Queued));
        assert!(c.reachable(L::Queued, L::Queued)); // via dispatched
        assert!(!c.reachable(L::Running, L::Accepted));
        assert!(!c.reachable(L::Succeeded, L::Failed));
        assert!(!c.reachable(L::Running, L::Cancelled));
        assert!(!c.reachable(L::Expired, L::Succeeded));
    }

    #[test]
    fn content_digest_matches_the_store_rules() {
        let raw = b"hello output".to_vec();
        let ev = wire::CommandEvent {
            issue_uuid: String::new(),
            event_seq: 1,
            observed_time: None,
            body: Some(Body::Output(wire::OutputChunk {
                stream: 1,
                payload: zstd::bulk::compress(&raw, 1).unwrap(),
                raw_length: 12,
                stored_length: 0,
            })),
        };
        assert_eq!(content_digest(&ev).unwrap(), rvbox_segment::sha256(&raw));
        let change = wire::LifecycleChange {
            lifecycle: wire::Lifecycle::Running as i32,
            revision: 1,
            exit_result: None,
            reason: String::new(),
        };
        let mut tagged = vec![body_kind::LIFECYCLE];
        tagged.extend(change.encode_to_vec());
        let ev = wire::CommandEvent {
            body: Some(Body::Lifecycle(change)),
            ..ev
        };
        assert_eq!(content_digest(&ev).unwrap(), rvbox_segment::sha256(&tagged));
        let none = wire::CommandEvent { body: None, ..ev };
        assert_eq!(content_digest(&none), Err(DigestError::NoBody));
    }
}
