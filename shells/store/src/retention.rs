//! Server retention (plan §5.4 items 1-4 and 6): command output window
//! rotation, the one whole-command delete primitive used by quota eviction
//! and age reclamation, and the crash-safe sweeper of the deletion
//! directory.
//!
//! Decisions come from `rvbox-retention` (`plan_output_rotation`,
//! `plan_pressure_rotation`, `release`, `release_command`,
//! `tombstones_to_drop`); this module applies them inside SQLite
//! transactions and moves files only through [`crate::fs::StoreFs`].
//!
//! File deletion is always two-phase: a transaction lists every file to
//! delete in `pending_deletions` (canonical source name plus a
//! collision-proof name inside `trash/`), then the files are moved into
//! `trash/` and removed, and only then are the rows dropped. A crash at any
//! point leaves rows the sweeper ([`Store::sweep`]) finishes on the next
//! start or maintenance pass. Nothing is ever deleted by glob or by a name
//! that came from a client.

use crate::db::Cached as _;
use std::path::PathBuf;

use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_proto::v1 as wire;
use rvbox_retention::{
    CHARGE_VERSION, ChargeKind, RotationPlan, SegmentUsage, Usage, charge, plan_output_rotation,
    release, release_command, tombstones_to_drop,
};
use rvbox_segment::{parse_audit_file_name, parse_segment_file_name, segment_file_name};

use crate::entropy::uuid_v7;
use crate::error::StoreError;
use crate::events::{EventAppend, EventBody};
use crate::incidents::NewIncident;
use crate::store::{Store, to_i64, to_u64};

/// Named crash points of retention (conventions rule 8).
pub mod points {
    /// A rotation's metadata committed; its files are not yet moved.
    pub const ROTATE_AFTER_MARK: &str = "store.rotate.after_mark";
    /// A command is marked `evicting`; its files are not yet moved.
    pub const EVICT_AFTER_MARK: &str = "store.evict.after_mark";
    /// The command's files are in `trash/`; its rows still exist.
    pub const EVICT_AFTER_MOVE: &str = "store.evict.after_move";
    /// The command's rows are deleted; its trash files are not yet removed.
    pub const EVICT_AFTER_DELETE: &str = "store.evict.after_delete";
    /// Every point, for tests that iterate them.
    pub const ALL: [&str; 4] = [
        ROTATE_AFTER_MARK,
        EVICT_AFTER_MARK,
        EVICT_AFTER_MOVE,
        EVICT_AFTER_DELETE,
    ];
}

/// Most pending deletions one sweep handles (the rest wait for the next).
pub const MAX_SWEEP_FILES: u32 = 100_000;
/// Most stale `evicting` commands one sweep rolls forward.
pub const MAX_ROLL_FORWARD: u32 = 10_000;

const REASON_WINDOW: &str =
    "server retention: the command's oldest output left its 10 MiB output window";
const REASON_TOTAL: &str =
    "server retention: the command's oldest output was rotated to stay within its total";
const REASON_CLIENT_QUOTA: &str =
    "server retention: active output rotated under the per-client storage quota";
const REASON_GLOBAL_QUOTA: &str =
    "server retention: active output rotated under the server-wide storage quota";

const DROP_TOTAL: &str = "server retention: output and diagnostics dropped on arrival: the command's total is held by data that cannot rotate";
const DROP_CLIENT_QUOTA: &str = "server retention: output and diagnostics dropped on arrival: the per-client quota is held by active data that cannot rotate";
const DROP_GLOBAL_QUOTA: &str = "server retention: output and diagnostics dropped on arrival: the server-wide quota is held by active data that cannot rotate";

/// Why output is rotated: decides the recorded `TruncationSource`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotationCause {
    /// The 10 MiB per-command output window.
    CommandWindow,
    /// The 32 MiB per-command total.
    CommandTotal,
    /// Per-client quota pressure from active data alone.
    ClientQuota,
    /// Server-wide quota pressure from active data alone.
    GlobalQuota,
}

impl RotationCause {
    /// The wire source recorded on the truncation row.
    #[must_use]
    pub fn source(self) -> wire::TruncationSource {
        match self {
            Self::CommandWindow => wire::TruncationSource::ServerCommandWindow,
            Self::CommandTotal => wire::TruncationSource::ServerCommandTotal,
            Self::ClientQuota => wire::TruncationSource::ServerClientQuota,
            Self::GlobalQuota => wire::TruncationSource::ServerGlobalQuota,
        }
    }

    /// The reason of a truncation row that stands for rotated output.
    #[must_use]
    pub fn reason(self) -> &'static str {
        match self {
            Self::CommandWindow => REASON_WINDOW,
            Self::CommandTotal => REASON_TOTAL,
            Self::ClientQuota => REASON_CLIENT_QUOTA,
            Self::GlobalQuota => REASON_GLOBAL_QUOTA,
        }
    }

    /// The reason of a truncation row that stands for output dropped on
    /// arrival (plan §5.4 item 3: "if active data alone creates pressure,
    /// rotate/drop output with markers").
    pub fn drop_reason(self) -> &'static str {
        match self {
            Self::CommandWindow | Self::CommandTotal => DROP_TOTAL,
            Self::ClientQuota => DROP_CLIENT_QUOTA,
            Self::GlobalQuota => DROP_GLOBAL_QUOTA,
        }
    }
}

/// Why an event refused at `tier` is dropped on arrival with a marker,
/// or `None` when it stays refused: the command's own total (or closeout
/// reserve) is full, or the client's (the server's) quota is held and
/// `relievable` says nothing there can be reclaimed (scope `Some(client)`
/// or `None` for the server). Shared by both stores; what "relievable"
/// means is each store's own.
///
/// # Errors
/// What `relievable` fails with.
pub fn drop_cause_of<E>(
    tier: rvbox_retention::Tier,
    client: &str,
    mut relievable: impl FnMut(Option<&str>) -> Result<bool, E>,
) -> Result<Option<RotationCause>, E> {
    use rvbox_retention::Tier;
    Ok(match tier {
        Tier::CommandTotal | Tier::CloseoutReserve => Some(RotationCause::CommandTotal),
        Tier::OwnerTotal if !relievable(Some(client))? => Some(RotationCause::ClientQuota),
        Tier::GlobalTotal if !relievable(None)? => Some(RotationCause::GlobalQuota),
        _ => None,
    })
}

/// What a truncation row records for an event dropped on arrival
/// (stream, raw bytes, stored bytes), or `None` when the event may never
/// be dropped: output, and the other events that are not essential
/// (diagnostics, the profile result), may. Refusing one of those for ever
/// would hold back every later event of the command, its terminal one
/// too. Shared by both stores.
#[must_use]
pub fn droppable(
    body: &rvbox_store_port::events::EventBody,
    class: rvbox_retention::Class,
) -> Option<(u8, u64, u64)> {
    use rvbox_store_port::events::EventBody;
    match body {
        EventBody::Output {
            stream,
            raw_len,
            stored,
            ..
        } => Some((stream.as_u8(), u64::from(*raw_len), stored.len() as u64)),
        EventBody::Other { .. } if class == rvbox_retention::Class::Ordinary => Some((0, 0, 0)),
        _ => None,
    }
}

/// The charge of a truncation row with `reason`.
pub fn truncation_row_charge(reason: &str) -> Result<u64, StoreError> {
    charge(
        CHARGE_VERSION,
        ChargeKind::TruncationRow,
        reason.len() as u64,
    )
    .map_err(|e| StoreError::Integrity(e.to_string()))
}

/// Why a whole command is deleted (logged; the tombstone stays either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionCause {
    /// Per-client quota.
    ClientQuota,
    /// Server-wide quota.
    GlobalQuota,
    /// Terminal age.
    TerminalAge,
    /// Finishing an eviction a crash or failure interrupted.
    RollForward,
}

impl EvictionCause {
    /// Stable name for logs.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::ClientQuota => "client_quota",
            Self::GlobalQuota => "global_quota",
            Self::TerminalAge => "terminal_age",
            Self::RollForward => "roll_forward",
        }
    }
}

/// One applied output rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// Command.
    pub issue_uuid: [u8; 16],
    /// Segment ordinals rotated, oldest first.
    pub ordinals: Vec<u32>,
    /// Removed event range (inclusive), from the event metadata.
    pub first_seq: u64,
    /// Last removed event.
    pub last_seq: u64,
    /// Exact raw bytes removed.
    pub raw_bytes: u64,
    /// Exact stored bytes removed.
    pub stored_bytes: u64,
    /// Net charged bytes released from every counter (segment charges, with
    /// the rotated events' rows, minus the truncation row).
    pub released: u64,
    /// The recorded source.
    pub source: wire::TruncationSource,
}

/// What one whole-command delete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictOutcome {
    /// Deleted; `freed` charged bytes left the client and global counters.
    Evicted {
        /// Bytes released.
        freed: u64,
    },
    /// Not deleted: no such command (already gone).
    Gone,
    /// Not deleted: the command is not terminal (never evicted).
    Active,
    /// Not deleted: an unresolved incident concerns the command.
    Dirty,
    /// The delete failed part-way; the command stays `evicting`, a
    /// `FAILED_EVICTION` incident records it, and the sweeper rolls it
    /// forward later.
    Failed,
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Stale `evicting` commands completed.
    pub rolled_forward: u64,
    /// Stale evictions that failed again.
    pub roll_forward_failed: u64,
    /// Trash files removed (pending deletion rows completed).
    pub files_removed: u64,
    /// Pending deletions that could not be completed this time.
    pub files_failed: u64,
}

/// A pending deletion row.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub(crate) file_name: String,
    pub(crate) origin: Origin,
    pub(crate) source_name: Option<String>,
}

/// Directory a pending file came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    Segments,
    Audit,
}

impl Origin {
    fn as_str(self) -> &'static str {
        match self {
            Self::Segments => "segments",
            Self::Audit => "audit",
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn uuid_text(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

fn blob16(v: &[u8]) -> [u8; 16] {
    <[u8; 16]>::try_from(v).unwrap_or([0; 16])
}

/// A trash name is `<canonical name>.<32 hex>.del`: store-made, no separator,
/// no dot-dot. Anything else read back from the database is refused.
fn valid_trash_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".del") else {
        return false;
    };
    let Some((source, suffix)) = stem.rsplit_once('.') else {
        return false;
    };
    suffix.len() == 32
        && suffix.bytes().all(|b| b.is_ascii_hexdigit())
        && (parse_segment_file_name(source).is_some() || parse_audit_file_name(source).is_some())
}

/// Lists `source_name` (in `origin`) for deletion under a fresh,
/// collision-proof trash name; returns that name.
pub(crate) fn queue_deletion(
    tx: &Connection,
    entropy: &dyn crate::entropy::Entropy,
    origin: Origin,
    source_name: &str,
    issue: Option<&[u8; 16]>,
    now_ms: i64,
) -> Result<String, StoreError> {
    let unique = uuid_v7(entropy, now_ms).map_err(|e| StoreError::io("mint trash name", "", e))?;
    let file_name = format!("{source_name}.{}.del", hex(&unique));
    tx.execute_cached(
        "INSERT INTO pending_deletions (file_name, issue_uuid, queued_ms, origin, source_name)
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            file_name,
            issue.map(|i| i.as_slice()),
            now_ms,
            origin.as_str(),
            source_name
        ],
    )
    .map_err(|e| StoreError::sqlite("queue file deletion", e))?;
    Ok(file_name)
}

fn pending_rows(
    conn: &Connection,
    issue: Option<&[u8; 16]>,
    limit: u32,
) -> Result<Vec<Pending>, StoreError> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT file_name, origin, source_name FROM pending_deletions
             WHERE ?1 IS NULL OR issue_uuid = ?1 ORDER BY queued_ms, file_name LIMIT ?2",
        )
        .map_err(|e| StoreError::sqlite("list pending deletions", e))?;
    let rows = stmt
        .query_map(params![issue.map(|i| i.as_slice()), limit], |r| {
            let origin: String = r.get(1)?;
            Ok(Pending {
                file_name: r.get(0)?,
                origin: if origin == "audit" {
                    Origin::Audit
                } else {
                    Origin::Segments
                },
                source_name: r.get(2)?,
            })
        })
        .map_err(|e| StoreError::sqlite("list pending deletions", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list pending deletions", e))
}

fn open_incident_for(conn: &Connection, issue: &[u8; 16]) -> Result<bool, StoreError> {
    conn.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM storage_incidents WHERE state = 1 AND issue_uuid = ?1
                        AND kind <> ?2)",
        params![issue.as_slice(), wire::IncidentKind::FailedEviction as i32],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("check open incidents", e))
}

/// One live output segment row.
#[derive(Debug, Clone, Copy)]
struct SegRow {
    ordinal: u32,
    sealed: bool,
    damaged: bool,
    first_seq: u64,
    last_seq: u64,
    charged: u64,
}

fn live_output_segments(conn: &Connection, issue: &[u8; 16]) -> Result<Vec<SegRow>, StoreError> {
    // damaged segments keep their recorded loss and are neither counted nor
    // rotated here (plan §5.5: resolving never rewrites recorded loss)
    let mut stmt = conn
        .prepare_cached(
            "SELECT ordinal, state, COALESCE(first_seq, 0), COALESCE(last_seq, 0), charged_bytes
             FROM command_segments WHERE issue_uuid = ?1 AND state IN ('active', 'sealed', 'damaged')
               AND ordinal > 0
             ORDER BY ordinal",
        )
        .map_err(|e| StoreError::sqlite("list output segments", e))?;
    let rows = stmt
        .query_map(params![issue.as_slice()], |r| {
            let state: String = r.get(1)?;
            Ok(SegRow {
                ordinal: r.get(0)?,
                sealed: state != "active",
                damaged: state == "damaged",
                first_seq: to_u64(r.get(2)?),
                last_seq: to_u64(r.get(3)?),
                charged: to_u64(r.get(4)?),
            })
        })
        .map_err(|e| StoreError::sqlite("list output segments", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list output segments", e))
}

fn marker_charge(cause: RotationCause) -> Result<u64, StoreError> {
    charge(
        CHARGE_VERSION,
        ChargeKind::TruncationRow,
        cause.reason().len() as u64,
    )
    .map_err(|e| StoreError::Integrity(e.to_string()))
}

#[derive(Debug, Clone)]
struct CmdCounters {
    client_id: String,
    charged: u64,
    output_charged: u64,
    held: u64,
    retention: String,
    terminal: Option<i64>,
    lifecycle: i64,
    request_hash: Vec<u8>,
}

fn load_counters(conn: &Connection, issue: &[u8; 16]) -> Result<Option<CmdCounters>, StoreError> {
    conn.query_row_cached(
        "SELECT client_id, charged_bytes, output_charged, closeout_held, retention,
                terminal_time_ms, lifecycle, request_hash
         FROM commands WHERE issue_uuid = ?1",
        params![issue.as_slice()],
        |r| {
            Ok(CmdCounters {
                client_id: r.get(0)?,
                charged: to_u64(r.get(1)?),
                output_charged: to_u64(r.get(2)?),
                held: to_u64(r.get(3)?),
                retention: r.get(4)?,
                terminal: r.get(5)?,
                lifecycle: r.get(6)?,
                request_hash: r.get(7)?,
            })
        },
    )
    .optional()
    .map_err(|e| StoreError::sqlite("load command counters", e))
}

fn counter_mismatch(e: &rvbox_retention::CounterUnderflow) -> StoreError {
    StoreError::Integrity(format!("retention release: {e}"))
}

impl Store {
    /// Plans the output rotation one command needs so that `incoming`
    /// more charged output bytes fit its window and total; `None` when
    /// nothing must (or can) rotate.
    fn plan_command_rotation(
        &self,
        issue: &[u8; 16],
        incoming: u64,
    ) -> Result<Option<(RotationPlan, RotationCause)>, StoreError> {
        let Some(c) = load_counters(&self.conn, issue)? else {
            return Ok(None);
        };
        if c.retention != "retained" {
            return Ok(None);
        }
        let tiers = &self.opts.tiers;
        let segs = live_output_segments(&self.conn, issue)?;
        let output_used = segs.iter().fold(0u64, |a, s| a.saturating_add(s.charged));
        let cause = if output_used.saturating_add(incoming) > tiers.command_output_window {
            RotationCause::CommandWindow
        } else if c.charged.saturating_add(incoming) > tiers.command_total {
            RotationCause::CommandTotal
        } else {
            return Ok(None);
        };
        let usages: Vec<SegmentUsage> = segs
            .iter()
            .map(|s| SegmentUsage {
                ordinal: s.ordinal,
                charged: s.charged,
                sealed: s.sealed,
                first_seq: s.first_seq,
                last_seq: s.last_seq,
                // every committed server segment is acknowledged; follower
                // snapshots do not exist yet. A damaged segment keeps its
                // recorded loss and is a barrier: rotation never reaches
                // past it, so no truncation range can cover its loss rows.
                pinned: s.damaged,
            })
            .collect();
        let usage = Usage {
            command: c.charged,
            held_closeout: c.held,
            owner: 0,
            global: 0,
            free_space: 0,
        };
        let marker = marker_charge(cause)?;
        let plan = plan_output_rotation(tiers, &usage, &usages, incoming, marker);
        if plan.rotate.is_empty() {
            if !plan.fits {
                tracing::warn!(
                    issue_uuid = %uuid_text(issue),
                    incoming,
                    "output cannot fit the command window even after rotation"
                );
            }
            return Ok(None);
        }
        Ok(Some((plan, cause)))
    }

    /// The append-path rotation step (plan §5.4 item 2): for each command
    /// with new output in `batch`, rotates its oldest sealed output
    /// segments so the batch's output fits the command's output window and
    /// total. Runs before the batch is planned, in its own transaction; a
    /// failure to move the rotated files is left to the sweeper.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn rotate_for_append(
        &mut self,
        batch: &[EventAppend],
        now_ms: i64,
    ) -> Result<Vec<Rotation>, StoreError> {
        // per command: (sum of new output charges, largest one)
        let mut incoming: std::collections::BTreeMap<[u8; 16], (u64, u64)> =
            std::collections::BTreeMap::new();
        // per command: (last event seq, output charged, charged)
        let mut last: std::collections::BTreeMap<[u8; 16], (u64, u64, u64)> =
            std::collections::BTreeMap::new();
        for ev in batch {
            let EventBody::Output { stored, .. } = &ev.body else {
                continue;
            };
            let seen = match last.get(&ev.issue_uuid) {
                Some(v) => v.0,
                None => {
                    let v: Option<(i64, i64, i64)> = self
                        .conn
                        .prepare_cached(
                            "SELECT last_event_seq, output_charged, charged_bytes FROM commands WHERE issue_uuid = ?1",
                        )
                        .and_then(|mut st| {
                            st.query_row(params![ev.issue_uuid.as_slice()], |r| {
                                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                            })
                        })
                        .optional()
                        .map_err(|e| StoreError::sqlite("read last event", e))?;
                    let v = v.map_or((u64::MAX, 0, 0), |(a, b, c)| {
                        (to_u64(a), to_u64(b), to_u64(c))
                    });
                    last.insert(ev.issue_uuid, v);
                    v.0
                }
            };
            if ev.event_seq <= seen {
                continue; // a duplicate (or an unknown command): stores nothing
            }
            let c = charge(
                CHARGE_VERSION,
                ChargeKind::OutputRecord,
                rvbox_segment::RECORD_OVERHEAD.saturating_add(stored.len() as u64),
            )
            .map_err(|e| StoreError::Integrity(e.to_string()))?;
            let slot = incoming.entry(ev.issue_uuid).or_insert((0, 0));
            slot.0 = slot.0.saturating_add(c);
            slot.1 = slot.1.max(c);
        }
        let mut done = Vec::new();
        let (window, total) = (
            self.opts.tiers.command_output_window,
            self.opts.tiers.command_total,
        );
        for (issue, (sum, largest)) in incoming {
            // the common case costs nothing more: the batch fits both
            let (_, output, charged) = last.get(&issue).copied().unwrap_or((0, 0, 0));
            if output.saturating_add(sum) <= window && charged.saturating_add(sum) <= total {
                continue;
            }
            let planned = match self.plan_command_rotation(&issue, sum)? {
                Some(p) => Some(p),
                None if sum > largest => self.plan_command_rotation(&issue, largest)?,
                None => None,
            };
            if let Some((plan, cause)) = planned {
                match self.apply_rotation(&issue, &plan.rotate, cause, now_ms) {
                    Ok(Some(r)) => done.push(r),
                    Ok(None) => {}
                    // one command's rotation failing must not fail the
                    // whole group: its output is refused by Reserve instead
                    Err(e) => tracing::error!(
                        issue_uuid = %uuid_text(&issue),
                        error = %e,
                        "output rotation failed"
                    ),
                }
            }
        }
        Ok(done)
    }

    /// Rotates whatever a command's window or total already exceeds (a
    /// maintenance pass, e.g. after the tiers were lowered).
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn rotate_due(
        &mut self,
        issue: &[u8; 16],
        now_ms: i64,
    ) -> Result<Option<Rotation>, StoreError> {
        match self.plan_command_rotation(issue, 0)? {
            Some((plan, cause)) => self.apply_rotation(issue, &plan.rotate, cause, now_ms),
            None => Ok(None),
        }
    }

    /// Applies a rotation of `ordinals` (oldest sealed segments of one
    /// command): one transaction marks them `rotated`, records the
    /// truncation row with the exact removed range and byte totals from the
    /// event metadata, queues the files for deletion and releases their
    /// charge from the command, client and global counters; then the files
    /// are moved to `trash/` and removed. Returns `None` when the segments
    /// changed in between (nothing done).
    pub(crate) fn apply_rotation(
        &mut self,
        issue: &[u8; 16],
        ordinals: &[u32],
        cause: RotationCause,
        now_ms: i64,
    ) -> Result<Option<Rotation>, StoreError> {
        if ordinals.is_empty() {
            return Ok(None);
        }
        let marker = marker_charge(cause)?;
        let entropy = std::sync::Arc::clone(&self.entropy);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin rotation", e))?;
        let Some(c) = load_counters(&tx, issue)? else {
            return Ok(None);
        };
        if c.retention != "retained" {
            return Ok(None);
        }
        let (mut first, mut last) = (u64::MAX, 0u64);
        let (mut raw, mut stored, mut events, mut seg_charged) = (0u64, 0u64, 0u64, 0u64);
        let mut mask = 0u8;
        for ordinal in ordinals {
            let row: Option<(String, i64)> = tx
                .query_row_cached(
                    "SELECT state, charged_bytes FROM command_segments WHERE issue_uuid = ?1 AND ordinal = ?2",
                    params![issue.as_slice(), ordinal],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("recheck segment", e))?;
            match row {
                Some((state, ch)) if state == "sealed" => {
                    seg_charged = seg_charged.saturating_add(to_u64(ch));
                }
                _ => return Ok(None), // never the active one; the plan went stale
            }
            let (lo, hi, r, s, n, m): (Option<i64>, Option<i64>, i64, i64, i64, i64) = tx
                .query_row_cached(
                    "SELECT MIN(event_seq), MAX(event_seq), COALESCE(SUM(raw_len), 0),
                            COALESCE(SUM(stored_len), 0), COUNT(*),
                            COALESCE(MAX(stream = 1), 0) | (COALESCE(MAX(stream = 2), 0) << 1)
                     FROM command_events WHERE issue_uuid = ?1 AND segment_ordinal = ?2",
                    params![issue.as_slice(), ordinal],
                    |r| {
                        Ok((
                            r.get(0)?,
                            r.get(1)?,
                            r.get(2)?,
                            r.get(3)?,
                            r.get(4)?,
                            r.get(5)?,
                        ))
                    },
                )
                .map_err(|e| StoreError::sqlite("total rotated events", e))?;
            if let (Some(lo), Some(hi)) = (lo, hi) {
                first = first.min(to_u64(lo));
                last = last.max(to_u64(hi));
            }
            raw = raw.saturating_add(to_u64(r));
            stored = stored.saturating_add(to_u64(s));
            events = events.saturating_add(to_u64(n));
            mask |= u8::try_from(m & 3).unwrap_or(0);
        }
        // output dropped on arrival between the rotated segments has a
        // truncation row of its own inside this range: it becomes part of
        // this row (ranges never overlap), its row's charge is released
        let mut absorbed_ids = Vec::new();
        let mut absorbed_charge = 0u64;
        if first <= last {
            let rows: Vec<(i64, i64, i64, Option<i64>, String)> = {
                let mut st = tx
                    .prepare_cached(
                        "SELECT id, COALESCE(raw_bytes, 0), COALESCE(stored_bytes, 0), stream_mask, reason
                         FROM output_truncations
                         WHERE issue_uuid = ?1 AND first_seq > ?2 AND last_seq < ?3",
                    )
                    .map_err(|e| StoreError::sqlite("find dropped ranges", e))?;
                st.query_map(
                    params![issue.as_slice(), to_i64(first), to_i64(last)],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
                )
                .map_err(|e| StoreError::sqlite("find dropped ranges", e))?
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("find dropped ranges", e))?
            };
            for (id, r, s, m, reason) in rows {
                raw = raw.saturating_add(to_u64(r));
                stored = stored.saturating_add(to_u64(s));
                mask |= m.and_then(|m| u8::try_from(m & 3).ok()).unwrap_or(0);
                absorbed_charge = absorbed_charge.saturating_add(truncation_row_charge(&reason)?);
                absorbed_ids.push(id);
            }
        }
        if events == 0 || seg_charged.saturating_add(absorbed_charge) <= marker {
            tracing::warn!(
                issue_uuid = %uuid_text(issue),
                segments = ordinals.len(),
                "rotation would free nothing; skipped"
            );
            return Ok(None);
        }
        let released = seg_charged.saturating_add(absorbed_charge) - marker;
        for id in &absorbed_ids {
            tx.execute_cached("DELETE FROM output_truncations WHERE id = ?1", params![id])
                .map_err(|e| StoreError::sqlite("absorb a dropped range", e))?;
        }
        let owner = crate::store::client_charged(&tx, &c.client_id)?;
        let global = crate::store::global_charged(&tx)?;
        let after = release(
            &Usage {
                command: c.charged,
                held_closeout: c.held,
                owner,
                global,
                free_space: 0,
            },
            released,
            true,
        )
        .map_err(|e| counter_mismatch(&e))?;
        let output_after = c
            .output_charged
            .checked_sub(seg_charged)
            .ok_or_else(|| StoreError::Integrity("output counter below its segments".into()))?;
        tx.execute_cached(
            "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
                 source, reason, recorded_ms, stream_mask)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                issue.as_slice(),
                to_i64(first),
                to_i64(last),
                to_i64(raw),
                to_i64(stored),
                cause.source() as i32,
                cause.reason(),
                now_ms,
                (mask > 0).then_some(i64::from(mask))
            ],
        )
        .map_err(|e| StoreError::sqlite("record retention truncation", e))?;
        for ordinal in ordinals {
            // the truncation row stands for the rotated events: their rows
            // go with their records, so the command's total holds only the
            // output still retained (a repeat of a rotated sequence is a
            // duplicate because the range covers it)
            tx.execute_cached(
                "DELETE FROM command_events WHERE issue_uuid = ?1 AND segment_ordinal = ?2",
                params![issue.as_slice(), ordinal],
            )
            .map_err(|e| StoreError::sqlite("delete rotated event rows", e))?;
            tx.execute_cached(
                "UPDATE command_segments SET state = 'rotated' WHERE issue_uuid = ?1 AND ordinal = ?2",
                params![issue.as_slice(), ordinal],
            )
            .map_err(|e| StoreError::sqlite("mark segment rotated", e))?;
            let name = segment_file_name(issue, *ordinal)
                .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))?;
            queue_deletion(
                &tx,
                entropy.as_ref(),
                Origin::Segments,
                &name,
                Some(issue),
                now_ms,
            )?;
        }
        tx.execute_cached(
            "UPDATE commands SET charged_bytes = ?2, output_charged = ?3 WHERE issue_uuid = ?1",
            params![
                issue.as_slice(),
                to_i64(after.command),
                to_i64(output_after)
            ],
        )
        .map_err(|e| StoreError::sqlite("release rotated output", e))?;
        crate::store::apply_owner_global(&tx, &c.client_id, after.owner, after.global)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit rotation", e))?;
        let source = cause.source();
        self.metrics
            .rotations
            .get_or_create(&crate::metrics::CauseLabel {
                cause: source.as_str_name(),
            })
            .inc();
        tracing::info!(
            issue_uuid = %uuid_text(issue),
            segments = ordinals.len(),
            first_seq = first,
            last_seq = last,
            raw_bytes = raw,
            released,
            source = source.as_str_name(),
            "output rotated"
        );
        // the cached active file is never one of these, but never keep a
        // handle on a rotated file
        if self
            .open_segments
            .get(issue)
            .is_some_and(|s| ordinals.contains(&s.ordinal))
        {
            self.open_segments.remove(issue);
        }
        self.hook.at(points::ROTATE_AFTER_MARK);
        if let Err(e) = self.finish_pending(Some(issue)) {
            tracing::warn!(issue_uuid = %uuid_text(issue), error = %e,
                "rotated files not yet removed; the sweeper finishes them");
        }
        Ok(Some(Rotation {
            issue_uuid: *issue,
            ordinals: ordinals.to_vec(),
            first_seq: first,
            last_seq: last,
            raw_bytes: raw,
            stored_bytes: stored,
            released,
            source,
        }))
    }

    /// Moves each pending file (of one command, or all) into `trash/` if it
    /// is still in place, removes it, and drops its row. Returns how many
    /// completed. A source file is only moved when no live row names it.
    pub(crate) fn finish_pending(&mut self, issue: Option<&[u8; 16]>) -> Result<u64, StoreError> {
        let rows = pending_rows(&self.conn, issue, MAX_SWEEP_FILES)?;
        if rows.is_empty() {
            return Ok(0);
        }
        let trash = self.layout.trash_dir();
        let mut moved_from: std::collections::BTreeSet<PathBuf> = std::collections::BTreeSet::new();
        let mut done = Vec::new();
        let mut first_error = None;
        for row in &rows {
            match self.finish_one(row, &mut moved_from) {
                Ok(()) => done.push(row.file_name.clone()),
                Err(e) => {
                    tracing::warn!(file = %row.file_name, error = %e, "pending deletion not completed");
                    first_error.get_or_insert(e);
                }
            }
        }
        for dir in moved_from.iter().chain(std::iter::once(&trash)) {
            self.fs
                .sync_dir(dir)
                .map_err(|e| StoreError::io("sync directory after deletion", dir, e))?;
        }
        for name in &done {
            self.conn
                .execute_cached(
                    "DELETE FROM pending_deletions WHERE file_name = ?1",
                    params![name],
                )
                .map_err(|e| StoreError::sqlite("complete pending deletion", e))?;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(done.len() as u64),
        }
    }

    fn finish_one(
        &self,
        row: &Pending,
        moved_from: &mut std::collections::BTreeSet<PathBuf>,
    ) -> Result<(), StoreError> {
        if !valid_trash_name(&row.file_name) {
            return Err(StoreError::Integrity(format!(
                "pending deletion with a name the store never makes: {}",
                row.file_name
            )));
        }
        let trash_path = self.layout.trash_dir().join(&row.file_name);
        if let Some(source) = &row.source_name {
            let (dir, live) = match row.origin {
                Origin::Segments => {
                    let (issue, ordinal) = parse_segment_file_name(source).ok_or_else(|| {
                        StoreError::Integrity(
                            "pending deletion source is not a segment name".into(),
                        )
                    })?;
                    let state: Option<String> = self
                        .conn
                        .query_row_cached(
                            "SELECT s.state FROM command_segments s JOIN commands c
                               ON c.issue_uuid = s.issue_uuid
                             WHERE s.issue_uuid = ?1 AND s.ordinal = ?2",
                            params![issue.as_slice(), ordinal],
                            |r| r.get(0),
                        )
                        .optional()
                        .map_err(|e| StoreError::sqlite("check segment row", e))?;
                    let evicting: bool = self
                        .conn
                        .query_row_cached(
                            "SELECT EXISTS (SELECT 1 FROM commands WHERE issue_uuid = ?1 AND retention = 'evicting')",
                            params![issue.as_slice()],
                            |r| r.get(0),
                        )
                        .map_err(|e| StoreError::sqlite("check eviction state", e))?;
                    // a live segment never moves; an evicting command's
                    // files move (either order is safe: rows follow)
                    let live = !evicting && state.is_some_and(|s| s != "rotated");
                    (self.layout.segment_dir(&issue), live)
                }
                Origin::Audit => {
                    let ordinal = parse_audit_file_name(source).ok_or_else(|| {
                        StoreError::Integrity("pending deletion source is not an audit name".into())
                    })?;
                    let live: bool = self
                        .conn
                        .query_row_cached(
                            "SELECT EXISTS (SELECT 1 FROM audit_segments WHERE ordinal = ?1)",
                            params![to_i64(ordinal)],
                            |r| r.get(0),
                        )
                        .map_err(|e| StoreError::sqlite("check audit row", e))?;
                    (self.layout.audit_dir(), live)
                }
            };
            if !live {
                let from = dir.join(source);
                match self.fs.rename(&from, &trash_path) {
                    Ok(()) => {
                        moved_from.insert(dir);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io("move file to trash", &from, e)),
                }
            }
        }
        match self.fs.remove_file(&trash_path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("remove trash file", &trash_path, e)),
        }
    }

    /// The one whole-command delete primitive (plan §5.4): quota eviction
    /// and age reclamation both call it, so their crash behaviour cannot
    /// diverge. Steps: (1) one transaction rechecks the command is
    /// terminal, retained and free of unresolved incidents, ensures its
    /// tombstone (FIFO cap in the same transaction), marks it `evicting`
    /// and queues every owned segment file for deletion; (2) the files move
    /// to `trash/` under collision-proof names; (3) one transaction deletes
    /// the rows and releases the command's whole charge (`release_command`);
    /// (4) the trash files are removed. A failure after (1) records a
    /// `FAILED_EVICTION` incident; the sweeper rolls the command forward.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed before anything changed.
    pub fn evict_command(
        &mut self,
        issue: &[u8; 16],
        cause: EvictionCause,
        now_ms: i64,
    ) -> Result<EvictOutcome, StoreError> {
        let entropy = std::sync::Arc::clone(&self.entropy);
        let cap = self.opts.tombstone_cap;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin eviction", e))?;
        let Some(c) = load_counters(&tx, issue)? else {
            return Ok(EvictOutcome::Gone);
        };
        if c.retention == "retained" {
            let Some(terminal_ms) = c.terminal else {
                return Ok(EvictOutcome::Active);
            };
            if c.lifecycle < 5 {
                return Ok(EvictOutcome::Active);
            }
            if open_incident_for(&tx, issue)? {
                return Ok(EvictOutcome::Dirty);
            }
            ensure_tombstone(&tx, issue, &c, terminal_ms, cap)?;
            tx.execute_cached(
                "UPDATE commands SET retention = 'evicting' WHERE issue_uuid = ?1 AND retention = 'retained'",
                params![issue.as_slice()],
            )
            .map_err(|e| StoreError::sqlite("mark evicting", e))?;
            let ordinals: Vec<u32> = {
                let mut stmt = tx
                    .prepare_cached(
                        "SELECT ordinal FROM command_segments WHERE issue_uuid = ?1 AND state <> 'rotated'
                         ORDER BY ordinal",
                    )
                    .map_err(|e| StoreError::sqlite("list command segments", e))?;
                let rows = stmt
                    .query_map(params![issue.as_slice()], |r| r.get(0))
                    .map_err(|e| StoreError::sqlite("list command segments", e))?;
                rows.collect::<Result<Vec<_>, _>>()
                    .map_err(|e| StoreError::sqlite("list command segments", e))?
            };
            for ordinal in ordinals {
                let name = segment_file_name(issue, ordinal)
                    .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))?;
                queue_deletion(
                    &tx,
                    entropy.as_ref(),
                    Origin::Segments,
                    &name,
                    Some(issue),
                    now_ms,
                )?;
            }
            tx.commit()
                .map_err(|e| StoreError::sqlite("commit eviction mark", e))?;
            tracing::info!(
                issue_uuid = %uuid_text(issue),
                client_id = %c.client_id,
                cause = cause.name(),
                charged = c.charged,
                "command marked evicting"
            );
            self.hook.at(points::EVICT_AFTER_MARK);
        } else {
            drop(tx);
        }
        self.open_segments.remove(issue);
        match self.complete_eviction(issue, now_ms) {
            Ok(freed) => {
                self.metrics
                    .evictions
                    .get_or_create(&crate::metrics::CauseLabel {
                        cause: cause.name(),
                    })
                    .inc();
                tracing::info!(
                    issue_uuid = %uuid_text(issue),
                    cause = cause.name(),
                    freed,
                    "command evicted"
                );
                Ok(EvictOutcome::Evicted { freed })
            }
            Err(e) => {
                tracing::error!(issue_uuid = %uuid_text(issue), error = %e, "eviction failed");
                self.metrics.eviction_failures.inc();
                self.record_failed_eviction(issue, &c.client_id, &e, now_ms)?;
                Ok(EvictOutcome::Failed)
            }
        }
    }

    /// Steps (2)-(4) of an eviction already marked `evicting`; also the
    /// roll-forward of a stale one. Idempotent.
    fn complete_eviction(&mut self, issue: &[u8; 16], now_ms: i64) -> Result<u64, StoreError> {
        // (2) move every queued file of the command into trash/
        let rows = pending_rows(&self.conn, Some(issue), MAX_SWEEP_FILES)?;
        let mut moved_from = std::collections::BTreeSet::new();
        for row in &rows {
            if let Some(source) = &row.source_name {
                if !valid_trash_name(&row.file_name) || parse_segment_file_name(source).is_none() {
                    return Err(StoreError::Integrity(
                        "pending deletion names a file the store never makes".into(),
                    ));
                }
                let from = self.layout.segment_file(source).ok_or_else(|| {
                    StoreError::Integrity(
                        "pending deletion names a file the store never makes".into(),
                    )
                })?;
                let to = self.layout.trash_dir().join(&row.file_name);
                match self.fs.rename(&from, &to) {
                    Ok(()) => {
                        if let Some(dir) = from.parent() {
                            moved_from.insert(dir.to_path_buf());
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io("move segment to trash", &from, e)),
                }
            }
        }
        for dir in moved_from
            .iter()
            .chain(std::iter::once(&self.layout.trash_dir()))
        {
            self.fs
                .sync_dir(dir)
                .map_err(|e| StoreError::io("sync directory after move", dir, e))?;
        }
        self.hook.at(points::EVICT_AFTER_MOVE);
        // (3) delete the rows and release the whole charge
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin eviction delete", e))?;
        let freed = match load_counters(&tx, issue)? {
            Some(c) if c.retention == "evicting" => {
                let owner = crate::store::client_charged(&tx, &c.client_id)?;
                let global = crate::store::global_charged(&tx)?;
                let after = release_command(&Usage {
                    command: c.charged,
                    held_closeout: c.held,
                    owner,
                    global,
                    free_space: 0,
                })
                .map_err(|e| counter_mismatch(&e))?;
                tx.execute_cached(
                    "DELETE FROM commands WHERE issue_uuid = ?1 AND retention = 'evicting'",
                    params![issue.as_slice()],
                )
                .map_err(|e| StoreError::sqlite("delete evicted command", e))?;
                crate::store::apply_owner_global(&tx, &c.client_id, after.owner, after.global)?;
                // the roll-forward is the safe repair of a failed eviction
                tx.execute_cached(
                    "UPDATE storage_incidents SET state = 2, resolved_ms = ?3
                     WHERE state = 1 AND kind = ?2 AND issue_uuid = ?1",
                    params![
                        issue.as_slice(),
                        wire::IncidentKind::FailedEviction as i32,
                        now_ms
                    ],
                )
                .map_err(|e| StoreError::sqlite("resolve failed eviction", e))?;
                c.charged
            }
            Some(_) => {
                return Err(StoreError::Integrity(
                    "command left the evicting state during its eviction".into(),
                ));
            }
            None => 0, // already deleted: only files may remain
        };
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit eviction delete", e))?;
        self.hook.at(points::EVICT_AFTER_DELETE);
        // (4) remove the trash files; leftovers wait for the sweeper
        if let Err(e) = self.finish_pending(Some(issue)) {
            tracing::warn!(issue_uuid = %uuid_text(issue), error = %e,
                "evicted files not yet removed; the sweeper finishes them");
        }
        Ok(freed)
    }

    fn record_failed_eviction(
        &mut self,
        issue: &[u8; 16],
        client_id: &str,
        err: &StoreError,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let already: bool = self
            .conn
            .query_row_cached(
                "SELECT EXISTS (SELECT 1 FROM storage_incidents WHERE state = 1 AND kind = ?2 AND issue_uuid = ?1)",
                params![issue.as_slice(), wire::IncidentKind::FailedEviction as i32],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("check failed eviction incident", e))?;
        if already {
            return Ok(());
        }
        let (kind, what) = match err {
            StoreError::Io { source, .. }
                if source.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) =>
            {
                (wire::IncidentKind::FailedEviction, "disk full")
            }
            StoreError::Io { .. } => (wire::IncidentKind::FailedEviction, "file operation failed"),
            _ => (wire::IncidentKind::FailedEviction, "metadata update failed"),
        };
        self.record_incident(
            &NewIncident {
                kind,
                scope_kind: wire::ScopeKind::Command,
                scope_key: uuid_text(issue),
                client_id: Some(client_id.to_owned()),
                issue_uuid: Some(*issue),
                summary: format!(
                    "eviction of the command did not complete ({what}); it is marked evicting and will be rolled forward"
                ),
                evidence: err.to_string().into_bytes(),
                data_loss: false,
            },
            now_ms,
            false,
        )?;
        Ok(())
    }

    /// The crash-safe sweeper (plan §5.4): rolls every command left
    /// `evicting` forward, then completes every pending file deletion
    /// (moving a file into `trash/` first if the crash came before its
    /// move). Runs at startup from [`Store::recover`] and in every
    /// maintenance pass; idempotent.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn sweep(&mut self, now_ms: i64) -> Result<SweepReport, StoreError> {
        let mut report = SweepReport::default();
        let stale: Vec<([u8; 16], String)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT issue_uuid, client_id FROM commands WHERE retention = 'evicting'
                     ORDER BY issue_time_ms, issue_uuid LIMIT ?1",
                )
                .map_err(|e| StoreError::sqlite("list stale evictions", e))?;
            let rows = stmt
                .query_map(params![MAX_ROLL_FORWARD], |r| {
                    let id: Vec<u8> = r.get(0)?;
                    Ok((blob16(&id), r.get(1)?))
                })
                .map_err(|e| StoreError::sqlite("list stale evictions", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("list stale evictions", e))?
        };
        for (issue, client) in stale {
            self.open_segments.remove(&issue);
            match self.complete_eviction(&issue, now_ms) {
                Ok(freed) => {
                    report.rolled_forward += 1;
                    tracing::info!(issue_uuid = %uuid_text(&issue), freed, "stale eviction rolled forward");
                }
                Err(e) => {
                    report.roll_forward_failed += 1;
                    tracing::error!(issue_uuid = %uuid_text(&issue), error = %e, "roll-forward failed");
                    self.record_failed_eviction(&issue, &client, &e, now_ms)?;
                }
            }
        }
        let before: i64 = self
            .conn
            .query_row_cached("SELECT COUNT(*) FROM pending_deletions", [], |r| r.get(0))
            .map_err(|e| StoreError::sqlite("count pending deletions", e))?;
        let result = self.finish_pending(None);
        let after: i64 = self
            .conn
            .query_row_cached("SELECT COUNT(*) FROM pending_deletions", [], |r| r.get(0))
            .map_err(|e| StoreError::sqlite("count pending deletions", e))?;
        report.files_removed = to_u64(before.saturating_sub(after));
        if let Err(e) = result {
            report.files_failed = to_u64(after);
            tracing::warn!(error = %e, pending = after, "sweeper left pending deletions");
        }
        if report.rolled_forward + report.files_removed + report.roll_forward_failed > 0 {
            tracing::info!(
                rolled_forward = report.rolled_forward,
                roll_forward_failed = report.roll_forward_failed,
                files_removed = report.files_removed,
                files_failed = report.files_failed,
                "retention sweep"
            );
        }
        Ok(report)
    }
}

/// Ensures the compact tombstone of a command about to be deleted exists
/// (it was written with the terminal state; the FIFO may have dropped it),
/// enforcing the FIFO cap in the same transaction (plan §5.4).
fn ensure_tombstone(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    c: &CmdCounters,
    terminal_ms: i64,
    cap: u64,
) -> Result<(), StoreError> {
    let inserted = tx
        .execute_cached(
            "INSERT INTO command_tombstones (issue_uuid, request_hash, client_id, lifecycle, terminal_ms)
             VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (issue_uuid) DO NOTHING",
            params![issue.as_slice(), c.request_hash, c.client_id, c.lifecycle, terminal_ms],
        )
        .map_err(|e| StoreError::sqlite("ensure tombstone", e))?;
    if inserted > 0 {
        let count: i64 = tx
            .query_row_cached(
                "SELECT tombstones FROM quota_totals WHERE id = 1",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read tombstone count", e))?;
        let drop = tombstones_to_drop(to_u64(count), cap);
        if drop > 0 {
            tx.execute_cached(
                "DELETE FROM command_tombstones WHERE seq IN (SELECT seq FROM command_tombstones ORDER BY seq LIMIT ?1)",
                params![to_i64(drop)],
            )
            .map_err(|e| StoreError::sqlite("trim tombstones", e))?;
        }
    }
    Ok(())
}
