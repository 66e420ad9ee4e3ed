//! The event append path on PostgreSQL: one transaction for a whole
//! append group (group commit: one transaction per group), with the same
//! rules as the SQLite store's append (`rvbox_store::events`):
//! content identity and validation, the sequence rules, lifecycle edges,
//! stdin acknowledgements, quota reservation, closeout release and the
//! replay tombstone of a terminal event.
//!
//! The commands a group touches are locked `FOR UPDATE` in one statement,
//! in id order (so two groups never deadlock on them), and each event's
//! session `FOR SHARE`: a replica that lost the client can no longer
//! commit its events.
//!
//! A running command's output is a rolling window, as on SQLite: when new
//! output would pass the command's output window
//! (`storage.command_output_window`) or its total (`storage.command_total`),
//! its oldest output events are rotated out in the group's transaction
//! (their rows and chunks deleted, one truncation row standing for them,
//! their charge released), so the command keeps its *last* bytes. Output
//! over a client's (the server's) quota is refused, transiently, while
//! maintenance can relieve it (a terminal command to evict, or an active
//! command's output to rotate, `crate::maintenance`); with nothing to
//! relieve it, or past the command's own total after rotation, it is
//! dropped on arrival with a truncation row.

use std::collections::{BTreeMap, BTreeSet};

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::events::{SeqVerdict, check_event_seq};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_retention::{
    CHARGE_VERSION, ChargeKind, Class, Usage, charge, release_closeout, reserve,
};
use rvbox_store::events::{MAX_INLINE_BODY_BYTES, check_output, other_digest};
use rvbox_store::retention::RotationCause;
use rvbox_store_port::events::{AppendReport, EventAppend, EventBody, EventOutcome, body_kind};

use crate::output::{OutputChunk, OutputStore};
use crate::sessions::{global_charged, to_i64, to_u64};
use crate::{Fail, PgStore, StoreOptions};

/// What a group reads of a command, and carries forward event by event.
#[derive(Debug, Clone)]
struct CmdView {
    client_id: String,
    lifecycle: Lifecycle,
    last_seq: u64,
    charged: u64,
    output_charged: u64,
    held_closeout: u64,
    request_hash: Vec<u8>,
    /// Its stored state is under an open storage incident.
    dirty: bool,
}

/// One event the group stores.
#[derive(Debug)]
struct Accepted {
    issue: [u8; 16],
    seq: u64,
    observed_ms: i64,
    kind: u8,
    stream: u8,
    raw_len: u64,
    stored_len: u64,
    digest: [u8; 32],
    inline: Option<Vec<u8>>,
    lifecycle: Option<(Lifecycle, Option<i32>, Option<i32>)>,
    stdin_ack: Option<(u64, i32)>,
}

fn refuse(code: Code, reason: impl AsRef<str>) -> EventOutcome {
    EventOutcome::Refused(DomainError::new(code, reason))
}

fn lifecycle_of(raw: i64) -> Lifecycle {
    Lifecycle::from_wire(i32::try_from(raw).unwrap_or(0)).unwrap_or(Lifecycle::Interrupted)
}

// The group's rows are looked up by joining an array of keys, never by
// `key = ANY($1)`. PostgreSQL plans a prepared statement once for the
// table's size then, and keeps that plan until something invalidates it;
// planned while `commands` was small, `= ANY($1)` became a scan of the
// whole table testing every row against every key of the array (an array
// parameter is never hashed), 64 keys times thousands of rows per group:
// 2-3 ms a group and growing with the table. A join costs one probe per
// row at worst (a hash join) and one index lookup per key once the
// table is large, whatever plan is cached.

/// The group's commands, locked in key order.
pub(crate) const LOCK_COMMANDS: &str =
    "SELECT c.issue_uuid, c.client_id, c.lifecycle, c.last_event_seq, c.charged_bytes,
            c.output_charged, c.closeout_held, c.request_hash, c.essential_trusted
     FROM unnest($1::bytea[]) AS u(i) JOIN commands c ON c.issue_uuid = u.i
     ORDER BY c.issue_uuid FOR UPDATE OF c";

/// The group's live sessions, locked `FOR SHARE` in key order.
pub(crate) const LIVE_SESSIONS: &str = "SELECT s.session_id, s.client_id,
            s.owner_replica IS NULL OR EXISTS (
                SELECT 1 FROM replicas r
                WHERE r.replica_id = s.owner_replica AND r.epoch = s.owner_epoch
                  AND r.lease_expires > now())
     FROM unnest($1::bytea[]) AS u(i) JOIN sessions s ON s.session_id = u.i
     WHERE s.live
     ORDER BY s.session_id FOR SHARE OF s";

/// The charged bytes of the group's clients.
pub(crate) const CLIENT_USAGE: &str = "SELECT c.client_id, c.charged_bytes
     FROM unnest($1::text[]) AS u(i) JOIN clients c ON c.client_id = u.i COLLATE \"C\"";

/// The group's commands, locked in id order.
fn lock_views(
    tx: &mut Transaction<'_>,
    issues: &BTreeSet<[u8; 16]>,
) -> Result<BTreeMap<[u8; 16], CmdView>, Fail> {
    let ids: Vec<&[u8]> = issues.iter().map(<[u8; 16]>::as_slice).collect();
    let rows = crate::prep::query(tx, LOCK_COMMANDS, &[&ids])
        .map_err(Fail::db("lock the group's commands"))?;
    let mut out = BTreeMap::new();
    for r in rows {
        let id: Vec<u8> = r.get(0);
        let Ok(id) = <[u8; 16]>::try_from(id.as_slice()) else {
            continue;
        };
        out.insert(
            id,
            CmdView {
                client_id: r.get(1),
                lifecycle: lifecycle_of(r.get(2)),
                last_seq: to_u64(r.get(3)),
                charged: to_u64(r.get(4)),
                output_charged: to_u64(r.get(5)),
                held_closeout: to_u64(r.get(6)),
                request_hash: r.get(7),
                dirty: !r.get::<_, bool>(8),
            },
        );
    }
    Ok(out)
}

/// The live sessions among `fences`, locked `FOR SHARE` in id order: each
/// with its client, and whether it counts for writes (its replica's lease
/// is live, or it belongs to no replica), as `check_fence` decides for
/// one write.
fn live_sessions(
    tx: &mut Transaction<'_>,
    fences: &BTreeSet<[u8; 16]>,
) -> Result<BTreeMap<[u8; 16], (String, bool)>, Fail> {
    if fences.is_empty() {
        return Ok(BTreeMap::new());
    }
    let ids: Vec<&[u8]> = fences.iter().map(<[u8; 16]>::as_slice).collect();
    let rows = crate::prep::query(tx, LIVE_SESSIONS, &[&ids])
        .map_err(Fail::db("check the events' sessions"))?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let id = <[u8; 16]>::try_from(r.get::<_, Vec<u8>>(0).as_slice()).ok()?;
            Some((id, (r.get(1), r.get(2))))
        })
        .collect())
}

/// The charged bytes of `clients`, by client.
fn client_usage(
    tx: &mut Transaction<'_>,
    clients: &BTreeSet<&str>,
) -> Result<BTreeMap<String, u64>, Fail> {
    let ids: Vec<&str> = clients.iter().copied().collect();
    let rows =
        crate::prep::query(tx, CLIENT_USAGE, &[&ids]).map_err(Fail::db("read client usage"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, String>(0), to_u64(r.get(1))))
        .collect())
}

fn stored_digest(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    seq: u64,
) -> Result<Option<[u8; 32]>, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT content_sha256 FROM command_events WHERE issue_uuid = $1 AND event_seq = $2",
        &[&issue.as_slice(), &to_i64(seq)],
    )
    .map_err(Fail::db("load event digest"))?
    .and_then(|r| <[u8; 32]>::try_from(r.get::<_, Vec<u8>>(0).as_slice()).ok()))
}

/// A `StdinAck` checked against its write: the write's stored length
/// while it is pending, `None` once settled.
fn check_ack(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    ack: &rvbox_proto::v1::StdinAck,
) -> Result<Result<Option<u64>, DomainError>, Fail> {
    use rvbox_proto::v1::StdinDelivery;
    if !matches!(
        StdinDelivery::try_from(ack.delivery),
        Ok(StdinDelivery::Written | StdinDelivery::Discarded)
    ) {
        return Ok(Err(DomainError::new(
            Code::ProtocolError,
            "stdin_ack.delivery must be WRITTEN or DISCARDED",
        )));
    }
    let row = crate::prep::query_opt(
        tx,
        "SELECT delivery, stored_len FROM stdin_writes WHERE issue_uuid = $1 AND write_seq = $2",
        &[&issue.as_slice(), &to_i64(ack.write_seq)],
    )
    .map_err(Fail::db("read stdin write"))?;
    Ok(match row {
        None => Err(DomainError::new(
            Code::ProtocolError,
            format!(
                "stdin_ack.write_seq {} names a write the server never assigned",
                ack.write_seq
            ),
        )),
        Some(r) if r.get::<_, i64>(0) == 1 => Ok(Some(to_u64(r.get(1)))),
        Some(_) => Ok(None),
    })
}

/// An output (or diagnostics) event dropped on arrival under quota
/// pressure that nothing can relieve (plan §5.4 item 3).
struct DroppedEvent {
    issue: [u8; 16],
    seq: u64,
    stream: u8,
    raw_len: u64,
    stored_len: u64,
    cause: RotationCause,
    new_row: bool,
}

/// Why an event refused at `tier` is dropped with a marker instead, or
/// `None` when it stays refused (transiently): the command's own total
/// is full, or the client's (the server's) quota is held with nothing
/// maintenance could relieve: no terminal command to evict and no stored
/// output of an active command to rotate (as the SQLite store decides).
/// Output that maintenance can relieve is refused, transiently, until it
/// has.
fn drop_cause(
    tx: &mut Transaction<'_>,
    tier: rvbox_retention::Tier,
    client: &str,
) -> Result<Option<RotationCause>, Fail> {
    let relievable = |scope: Option<&str>| -> Result<bool, Fail> {
        Ok(crate::prep::query_one(
            tx,
            "SELECT EXISTS (SELECT 1 FROM commands c
                 WHERE ($1::text IS NULL OR c.client_id = $1) AND c.retention = 'retained'
                   AND NOT EXISTS (SELECT 1 FROM storage_incidents i
                                   WHERE i.state = 1 AND i.issue_uuid = c.issue_uuid)
                   AND (c.terminal_time_ms IS NOT NULL
                        OR EXISTS (SELECT 1 FROM command_events e
                                   WHERE e.issue_uuid = c.issue_uuid AND e.body_kind = 4)))",
            &[&scope],
        )
        .map_err(Fail::db("look for relief under quota"))?
        .get(0))
    };
    rvbox_store::retention::drop_cause_of(tier, client, relievable)
}

/// Whether a truncation row of output dropped on arrival for `cause` ends
/// at `seq`.
fn drop_row_ends_at(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    seq: u64,
    cause: RotationCause,
) -> Result<bool, Fail> {
    Ok(crate::prep::query_one(
        tx,
        "SELECT EXISTS (SELECT 1 FROM output_truncations
             WHERE issue_uuid = $1 AND last_seq = $2 AND source = $3 AND reason = $4)",
        &[
            &issue.as_slice(),
            &to_i64(seq),
            &i64::from(cause.source() as i32),
            &cause.drop_reason(),
        ],
    )
    .map_err(Fail::db("find a dropped range"))?
    .get(0))
}

/// Whether `seq` is output dropped on arrival (no row; a truncation row
/// covers it).
fn dropped_at(tx: &mut Transaction<'_>, issue: &[u8; 16], seq: u64) -> Result<bool, Fail> {
    Ok(crate::prep::query_one(
        tx,
        "SELECT EXISTS (SELECT 1 FROM output_truncations
             WHERE issue_uuid = $1 AND first_seq <= $2 AND last_seq >= $2)",
        &[&issue.as_slice(), &to_i64(seq)],
    )
    .map_err(Fail::db("find a dropped event"))?
    .get(0))
}

/// Writes the truncation row of an event dropped on arrival: a new one,
/// or the one of the same cause ending just before it, extended.
fn record_dropped(tx: &mut Transaction<'_>, d: &DroppedEvent, now_ms: i64) -> Result<(), Fail> {
    let source = i64::from(d.cause.source() as i32);
    let reason = d.cause.drop_reason();
    let changed = if d.new_row {
        crate::prep::execute(
            tx,
            "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
                 source, reason, recorded_ms, stream_mask)
             VALUES ($1, $2, $2, $3, $4, $5, $6, $7, NULLIF($8::bigint, 0))",
            &[
                &d.issue.as_slice(),
                &to_i64(d.seq),
                &to_i64(d.raw_len),
                &to_i64(d.stored_len),
                &source,
                &reason,
                &now_ms,
                &i64::from(d.stream),
            ],
        )
    } else {
        crate::prep::execute(
            tx,
            "UPDATE output_truncations SET last_seq = $2, raw_bytes = raw_bytes + $3,
                 stored_bytes = stored_bytes + $4,
                 stream_mask = NULLIF(COALESCE(stream_mask, 0) | $5::bigint, 0)
             WHERE issue_uuid = $1 AND last_seq = $6 AND source = $7 AND reason = $8",
            &[
                &d.issue.as_slice(),
                &to_i64(d.seq),
                &to_i64(d.raw_len),
                &to_i64(d.stored_len),
                &i64::from(d.stream),
                &to_i64(d.seq.saturating_sub(1)),
                &source,
                &reason,
            ],
        )
    }
    .map_err(Fail::db("record dropped output"))?;
    if changed != 1 {
        return Err(Fail::Integrity(format!(
            "dropped output at event_seq {}: {changed} truncation rows written",
            d.seq
        )));
    }
    Ok(())
}

/// Most output events one page of a rotation reads.
const ROTATION_PAGE: i64 = 1_024;
/// A rotation frees this much more than the incoming output needs (at
/// most an eighth of the window), so a command streaming past its window
/// rotates once per such step, not at every event.
const ROTATION_SLACK: u64 = 1 << 20;

/// What a rotation removed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rotated {
    /// Charged bytes of the rotated events.
    pub(crate) removed: u64,
    /// Charge released in all: the rotated events and the absorbed
    /// dropped ranges' rows, less the new truncation row's.
    pub(crate) released: u64,
}

/// Rotates a command's oldest output out, in the caller's transaction
/// (the command's row locked by it): the oldest output events, up to the
/// first one a truncation covers (damaged, a barrier), until `target`
/// charged bytes are removed; dropped ranges inside are absorbed into the
/// one truncation row (source and reason of `cause`). Nothing is rotated
/// unless at least `need` is removed and more is released than the new
/// row's charge. The caller moves the counters by what it returns.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotate_oldest(
    tx: &mut Transaction<'_>,
    output: &mut dyn OutputStore,
    issue: &[u8; 16],
    need: u64,
    target: u64,
    cause: RotationCause,
    now_ms: i64,
) -> Result<Option<Rotated>, Fail> {
    let marker =
        rvbox_store::retention::truncation_row_charge(cause.reason()).map_err(integrity)?;
    // the command's truncation ranges: a covered output event is a barrier
    let ranges: Vec<(i64, i64, i64)> = crate::prep::query(
        tx,
        "SELECT first_seq, last_seq, id FROM output_truncations
         WHERE issue_uuid = $1 AND first_seq IS NOT NULL ORDER BY first_seq",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("read the command's truncations"))?
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect();
    let covered = |seq: i64| ranges.iter().any(|(a, b, _)| *a <= seq && seq <= *b);
    let (mut first, mut last) = (None::<i64>, 0i64);
    let (mut removed, mut raw, mut stored) = (0u64, 0u64, 0u64);
    let mut mask = 0i64;
    let mut after = 0i64;
    'pages: while removed < target {
        let rows = crate::prep::query(
            tx,
            "SELECT event_seq, raw_len, stored_len, stream FROM command_events
             WHERE issue_uuid = $1 AND body_kind = 4 AND event_seq > $2
             ORDER BY event_seq LIMIT $3",
            &[&issue.as_slice(), &after, &ROTATION_PAGE],
        )
        .map_err(Fail::db("read output to rotate"))?;
        if rows.is_empty() {
            break;
        }
        for r in &rows {
            let seq: i64 = r.get(0);
            after = seq;
            if covered(seq) || removed >= target {
                break 'pages;
            }
            let stored_len = to_u64(r.get(2));
            let c = charge(
                CHARGE_VERSION,
                ChargeKind::OutputRecord,
                rvbox_segment::RECORD_OVERHEAD.saturating_add(stored_len),
            )
            .map_err(integrity)?;
            first.get_or_insert(seq);
            last = seq;
            removed = removed.saturating_add(c);
            raw = raw.saturating_add(to_u64(r.get(1)));
            stored = stored.saturating_add(stored_len);
            mask |= match r.get::<_, i64>(3) {
                1 => 1,
                2 => 2,
                _ => 0,
            };
        }
    }
    let Some(first) = first else {
        return Ok(None);
    };
    if removed < need {
        return Ok(None);
    }
    // output dropped on arrival inside the range joins its row
    let mut absorbed = 0u64;
    let inside: Vec<i64> = ranges
        .iter()
        .filter(|(a, b, _)| *a > first && *b < last)
        .map(|(_, _, id)| *id)
        .collect();
    for id in &inside {
        let row = crate::prep::query_one(
            tx,
            "SELECT COALESCE(raw_bytes, 0), COALESCE(stored_bytes, 0),
                    COALESCE(stream_mask, 3), reason
             FROM output_truncations WHERE id = $1",
            &[id],
        )
        .map_err(Fail::db("read a dropped range"))?;
        raw = raw.saturating_add(to_u64(row.get(0)));
        stored = stored.saturating_add(to_u64(row.get(1)));
        mask |= row.get::<_, i64>(2) & 3;
        absorbed = absorbed.saturating_add(
            rvbox_store::retention::truncation_row_charge(&row.get::<_, String>(3))
                .map_err(integrity)?,
        );
    }
    if removed.saturating_add(absorbed) <= marker {
        return Ok(None);
    }
    for id in &inside {
        crate::prep::execute(tx, "DELETE FROM output_truncations WHERE id = $1", &[id])
            .map_err(Fail::db("absorb a dropped range"))?;
    }
    let released = removed.saturating_add(absorbed) - marker;
    crate::prep::execute(
        tx,
        "DELETE FROM command_events
         WHERE issue_uuid = $1 AND body_kind = 4 AND event_seq >= $2 AND event_seq <= $3",
        &[&issue.as_slice(), &first, &last],
    )
    .map_err(Fail::db("delete rotated output"))?;
    output.removed(tx, issue, to_u64(first), to_u64(last))?;
    crate::prep::execute(
        tx,
        "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
             source, reason, recorded_ms, stream_mask)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULLIF($9::bigint, 0))",
        &[
            &issue.as_slice(),
            &first,
            &last,
            &to_i64(raw),
            &to_i64(stored),
            &i64::from(cause.source() as i32),
            &cause.reason(),
            &now_ms,
            &mask,
        ],
    )
    .map_err(Fail::db("record rotated output"))?;
    tracing::info!(
        issue_uuid = %rvbox_store::fleet::uuid_text(issue),
        first_seq = first,
        last_seq = last,
        released,
        cause = cause.source().as_str_name(),
        "output rotated"
    );
    Ok(Some(Rotated { removed, released }))
}

/// Rotates a command's oldest output so that `incoming` more charged
/// output bytes fit its output window and its total (the SQLite store's
/// rule, `rvbox_retention::plan_output_rotation`, with events for
/// segments), freeing a slack beyond the need; nothing when the need
/// cannot be met. Updates the view, the client's and the server's usage;
/// returns whether it rotated.
#[allow(clippy::too_many_arguments)]
fn rotate_for(
    tx: &mut Transaction<'_>,
    opts: &StoreOptions,
    output: &mut dyn OutputStore,
    issue: &[u8; 16],
    view: &mut CmdView,
    owners: &mut BTreeMap<String, (u64, u64)>,
    global: &mut u64,
    incoming: u64,
    now_ms: i64,
) -> Result<bool, Fail> {
    let tiers = &opts.tiers;
    let over_window = view.output_charged.saturating_add(incoming) > tiers.command_output_window;
    let over_total = view.charged.saturating_add(incoming) > tiers.command_total;
    if !over_window && !over_total {
        return Ok(false);
    }
    let cause = if over_window {
        RotationCause::CommandWindow
    } else {
        RotationCause::CommandTotal
    };
    let marker =
        rvbox_store::retention::truncation_row_charge(cause.reason()).map_err(integrity)?;
    let need = view
        .output_charged
        .saturating_add(incoming)
        .saturating_sub(tiers.command_output_window)
        .max(
            view.charged
                .saturating_add(marker)
                .saturating_add(incoming)
                .saturating_sub(tiers.command_total),
        );
    let target = need.saturating_add(ROTATION_SLACK.min(tiers.command_output_window / 8));
    let Some(r) = rotate_oldest(tx, output, issue, need, target, cause, now_ms)? else {
        tracing::warn!(
            issue_uuid = %rvbox_store::fleet::uuid_text(issue),
            incoming,
            "output cannot fit the command window even after rotation"
        );
        return Ok(false);
    };
    let owner = owners.get(&view.client_id).map_or(0, |o| o.1);
    let after = rvbox_retention::release(
        &Usage {
            command: view.charged,
            held_closeout: view.held_closeout,
            owner,
            global: *global,
            free_space: u64::MAX,
        },
        r.released,
        true,
    )
    .map_err(integrity)?;
    view.charged = after.command;
    view.output_charged = view.output_charged.checked_sub(r.removed).ok_or_else(|| {
        Fail::Integrity("a command's output counter is below its output events".into())
    })?;
    if let Some(o) = owners.get_mut(&view.client_id) {
        o.1 = after.owner;
    }
    *global = after.global;
    Ok(true)
}

fn integrity(e: impl std::fmt::Display) -> Fail {
    Fail::Integrity(e.to_string())
}

/// The group's decisions, event by event, and what they leave behind.
struct Plan {
    outcomes: Vec<EventOutcome>,
    accepted: Vec<Accepted>,
    chunks: Vec<OutputChunk>,
    /// Events dropped on arrival, in order: a truncation row each (new, or
    /// the one ending just before extended).
    dropped: Vec<DroppedEvent>,
    views: BTreeMap<[u8; 16], CmdView>,
    /// Per client: charged bytes before the group and after it.
    owners: BTreeMap<String, (u64, u64)>,
    global_before: u64,
    global: u64,
}

/// Decides every event of the batch (the SQLite store's planning rules).
#[allow(clippy::too_many_lines)]
fn plan(
    tx: &mut Transaction<'_>,
    dctx: &mut zstd::bulk::Decompressor<'static>,
    opts: &StoreOptions,
    batch: &[EventAppend],
    output: &mut dyn OutputStore,
    now_ms: i64,
) -> Result<Plan, Fail> {
    let issues: BTreeSet<[u8; 16]> = batch.iter().map(|e| e.issue_uuid).collect();
    let mut views = lock_views(tx, &issues)?;
    let global_before = global_charged(tx)?;
    let mut global = global_before;
    // every session and client of the group, read once each
    let fences: BTreeSet<[u8; 16]> = batch
        .iter()
        .filter_map(|e| e.session.map(|f| f.session_id))
        .collect();
    let sessions = live_sessions(tx, &fences)?;
    let clients: BTreeSet<&str> = views.values().map(|v| v.client_id.as_str()).collect();
    // the scopes under an open incident (plan §5.1): usually none
    let keys: Vec<String> = issues.iter().map(rvbox_store::fleet::uuid_text).collect();
    let scopes: Vec<(wire::ScopeKind, &str)> = keys
        .iter()
        .map(|k| (wire::ScopeKind::Command, k.as_str()))
        .chain(clients.iter().map(|c| (wire::ScopeKind::Client, *c)))
        .collect();
    let dirty = crate::incidents::dirty_scopes(tx, &scopes)?;
    let mut owners: BTreeMap<String, (u64, u64)> = client_usage(tx, &clients)?
        .into_iter()
        .map(|(c, v)| (c, (v, v)))
        .collect();
    let mut batch_digests: BTreeMap<([u8; 16], u64), [u8; 32]> = BTreeMap::new();
    let mut stdin_settled: BTreeSet<([u8; 16], u64)> = BTreeSet::new();
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut accepted = Vec::new();
    let mut chunks = Vec::new();
    let mut dropped: Vec<DroppedEvent> = Vec::new();
    // per command: the last event dropped in this group, and why
    let mut drops: BTreeMap<[u8; 16], (u64, RotationCause)> = BTreeMap::new();
    for ev in batch {
        let issue = ev.issue_uuid;
        let Some(view) = views.get_mut(&issue) else {
            outcomes.push(refuse(Code::ProtocolError, "event for an unknown command"));
            continue;
        };
        if view.dirty {
            outcomes.push(refuse(
                Code::Unavailable,
                "the command's stored state is under an open storage incident",
            ));
            continue;
        }
        if !dirty.is_empty() {
            let key = rvbox_store::fleet::uuid_text(&issue);
            if let Some(e) = crate::incidents::gate(
                &dirty,
                &[
                    (wire::ScopeKind::Command, key.as_str()),
                    (wire::ScopeKind::Client, view.client_id.as_str()),
                ],
            ) {
                outcomes.push(EventOutcome::Refused(e));
                continue;
            }
        }
        if let Some(fence) = &ev.session {
            let refusal = match sessions.get(&fence.session_id) {
                Some((o, true)) if *o == view.client_id => None,
                Some((o, false)) if *o == view.client_id => {
                    Some("the write's session belongs to a server replica whose lease ended")
                }
                Some(_) => Some("the write's session belongs to another client"),
                None => Some("the write's session is no longer its client's live session"),
            };
            if let Some(reason) = refusal {
                tracing::warn!(reason, "event refused: its session is not live");
                outcomes.push(refuse(Code::StaleSession, reason));
                continue;
            }
        }
        let (kind, digest) = match &ev.body {
            EventBody::Output {
                compression,
                raw_len,
                stored,
                ..
            } => match check_output(dctx, *compression, *raw_len, stored) {
                Ok(d) => (body_kind::OUTPUT, d),
                Err(e) => {
                    outcomes.push(EventOutcome::Refused(e));
                    continue;
                }
            },
            EventBody::Lifecycle { encoded, .. } => (
                body_kind::LIFECYCLE,
                other_digest(body_kind::LIFECYCLE, encoded),
            ),
            EventBody::Other { kind, encoded } => (*kind, other_digest(*kind, encoded)),
        };
        if let EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } = &ev.body
            && encoded.len() > MAX_INLINE_BODY_BYTES
        {
            outcomes.push(refuse(Code::ProtocolError, "event body exceeds 16 KiB"));
            continue;
        }
        if !(body_kind::OUTPUT..=body_kind::PROFILE_RESULT).contains(&kind) {
            outcomes.push(refuse(
                Code::ProtocolError,
                format!("unknown event body kind {kind}"),
            ));
            continue;
        }
        // sequence rules
        let stored = if ev.event_seq <= view.last_seq {
            match batch_digests.get(&(issue, ev.event_seq)) {
                Some(d) => Some(*d),
                None => stored_digest(tx, &issue, ev.event_seq)?,
            }
        } else {
            None
        };
        // output dropped on arrival has no row: a truncation row covers
        // it, and the same event sent again is a duplicate
        if stored.is_none()
            && ev.event_seq != 0
            && ev.event_seq <= view.last_seq
            && dropped_at(tx, &issue, ev.event_seq)?
        {
            outcomes.push(EventOutcome::Duplicate);
            continue;
        }
        match check_event_seq(view.last_seq, ev.event_seq, stored.as_ref(), &digest) {
            Ok(SeqVerdict::Duplicate) => {
                outcomes.push(EventOutcome::Duplicate);
                continue;
            }
            Ok(SeqVerdict::Append) => {}
            Err(e) => {
                outcomes.push(refuse(Code::ProtocolError, e.to_string()));
                continue;
            }
        }
        if view.lifecycle.is_terminal() {
            outcomes.push(refuse(
                Code::ProtocolError,
                "event after the command's terminal event",
            ));
            continue;
        }
        let lifecycle = match &ev.body {
            EventBody::Lifecycle {
                to,
                exit_code,
                exit_signal,
                ..
            } => {
                // reconciliation may already have advanced the command to
                // this lifecycle; the event itself is still stored
                if *to != view.lifecycle
                    && let Err(e) = view.lifecycle.check_transition(*to)
                {
                    outcomes.push(refuse(Code::ProtocolError, e.to_string()));
                    continue;
                }
                Some((*to, *exit_code, *exit_signal))
            }
            _ => None,
        };
        let mut stdin_ack = None;
        if let EventBody::Other { kind, encoded } = &ev.body
            && *kind == body_kind::STDIN_ACK
        {
            let Ok(ack) = rvbox_proto::v1::StdinAck::decode(encoded.as_slice()) else {
                outcomes.push(refuse(Code::ProtocolError, "stdin_ack does not decode"));
                continue;
            };
            match check_ack(tx, &issue, &ack)? {
                Err(e) => {
                    outcomes.push(EventOutcome::Refused(e));
                    continue;
                }
                Ok(Some(stored)) if !stdin_settled.contains(&(issue, ack.write_seq)) => {
                    stdin_ack = Some((
                        ack.write_seq,
                        ack.delivery,
                        rvbox_store::stdin::settled_release(stored).map_err(integrity)?,
                    ));
                }
                Ok(_) => {}
            }
        }
        // quota
        let (charge_kind, class, bytes) = match &ev.body {
            EventBody::Output { stored, .. } => (
                ChargeKind::OutputRecord,
                Class::Ordinary,
                rvbox_segment::RECORD_OVERHEAD + stored.len() as u64,
            ),
            EventBody::Lifecycle { encoded, .. } => {
                (ChargeKind::EventRow, Class::Essential, encoded.len() as u64)
            }
            EventBody::Other { kind, encoded } => {
                let class = if *kind == body_kind::DIAGNOSTICS || *kind == body_kind::PROFILE_RESULT
                {
                    Class::Ordinary
                } else {
                    Class::Essential
                };
                (ChargeKind::EventRow, class, encoded.len() as u64)
            }
        };
        let charged = charge(CHARGE_VERSION, charge_kind, bytes).map_err(integrity)?;
        let owner_used = owners.entry(view.client_id.clone()).or_insert((0, 0)).1;
        let usage = Usage {
            command: view.charged,
            held_closeout: view.held_closeout,
            owner: owner_used,
            global,
            free_space: u64::MAX,
        };
        let usage = if charge_kind == ChargeKind::OutputRecord
            && rotate_for(
                tx,
                opts,
                output,
                &issue,
                view,
                &mut owners,
                &mut global,
                charged,
                now_ms,
            )? {
            Usage {
                command: view.charged,
                held_closeout: view.held_closeout,
                owner: owners.get(&view.client_id).map_or(0, |o| o.1),
                global,
                free_space: u64::MAX,
            }
        } else {
            usage
        };
        let droppable = rvbox_store::retention::droppable(&ev.body, class);
        let r = match reserve(&opts.tiers, &usage, charge_kind, class, charged, true) {
            Ok(r) => r,
            Err(refusal)
                if let Some((stream, raw_len, stored_len)) = droppable
                    && let Some(cause) = drop_cause(tx, refusal.tier, &view.client_id)? =>
            {
                // plan §5.4 item 3: data that cannot be reclaimed holds the
                // quota: the event is dropped with a marker (charged as
                // essential, so the command's closeout headroom pays for
                // it), never refused for ever
                let reason = cause.drop_reason();
                let extends = drops
                    .get(&issue)
                    .is_some_and(|(last, c)| *last + 1 == ev.event_seq && *c == cause)
                    || drop_row_ends_at(tx, &issue, ev.event_seq - 1, cause)?;
                let marker = if extends {
                    0
                } else {
                    rvbox_store::retention::truncation_row_charge(reason).map_err(integrity)?
                };
                match reserve(
                    &opts.tiers,
                    &usage,
                    ChargeKind::TruncationRow,
                    Class::Essential,
                    marker,
                    true,
                ) {
                    Ok(m) => {
                        view.charged = m.command_after;
                        view.held_closeout = m.held_closeout_after;
                        if let Some(o) = owners.get_mut(&view.client_id) {
                            o.1 = m.owner_after;
                        }
                        global = m.global_after;
                        view.last_seq = ev.event_seq;
                        batch_digests.insert((issue, ev.event_seq), digest);
                        drops.insert(issue, (ev.event_seq, cause));
                        tracing::warn!(
                            event_seq = ev.event_seq,
                            body_kind = kind,
                            raw_len,
                            tier = refusal.tier.name(),
                            "event dropped on arrival: its quota is held by data that cannot be reclaimed"
                        );
                        dropped.push(DroppedEvent {
                            issue,
                            seq: ev.event_seq,
                            stream,
                            raw_len,
                            stored_len,
                            cause,
                            new_row: !extends,
                        });
                        outcomes.push(EventOutcome::Appended);
                        continue;
                    }
                    Err(refusal) => {
                        tracing::warn!(
                            tier = refusal.tier.name(),
                            "event refused by quota, even as a marker"
                        );
                        outcomes.push(refuse(Code::QuotaExceeded, refusal.to_string()));
                        continue;
                    }
                }
            }
            Err(refusal) => {
                tracing::warn!(
                    tier = refusal.tier.name(),
                    kind = charge_kind.name(),
                    "event refused by quota"
                );
                outcomes.push(refuse(Code::QuotaExceeded, refusal.to_string()));
                continue;
            }
        };
        view.charged = r.command_after;
        view.held_closeout = r.held_closeout_after;
        let mut owner_after = r.owner_after;
        global = r.global_after;
        if let Some((write_seq, _, freed)) = stdin_ack {
            let after = rvbox_store::stdin::usage_after_settle(
                &Usage {
                    command: view.charged,
                    held_closeout: view.held_closeout,
                    owner: owner_after,
                    global,
                    free_space: u64::MAX,
                },
                freed,
            )
            .map_err(integrity)?;
            view.charged = after.command;
            owner_after = after.owner;
            global = after.global;
            stdin_settled.insert((issue, write_seq));
        }
        if let Some(o) = owners.get_mut(&view.client_id) {
            o.1 = owner_after;
        }
        view.last_seq = ev.event_seq;
        batch_digests.insert((issue, ev.event_seq), digest);
        if let Some((to, _, _)) = lifecycle {
            view.lifecycle = to;
        }
        let mut a = Accepted {
            issue,
            seq: ev.event_seq,
            observed_ms: ev.observed_ms,
            kind,
            stream: 0,
            raw_len: 0,
            stored_len: 0,
            digest,
            inline: None,
            lifecycle,
            stdin_ack: stdin_ack.map(|(seq, delivery, _)| (seq, delivery)),
        };
        match &ev.body {
            EventBody::Output {
                stream,
                compression,
                raw_len,
                stored,
            } => {
                view.output_charged = view.output_charged.saturating_add(charged);
                a.stream = stream.as_u8();
                a.raw_len = u64::from(*raw_len);
                a.stored_len = stored.len() as u64;
                chunks.push(OutputChunk {
                    issue_uuid: issue,
                    event_seq: ev.event_seq,
                    stream: *stream,
                    compression: *compression,
                    raw_len: *raw_len,
                    sha256: digest,
                    stored: stored.clone(),
                });
            }
            EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } => {
                a.inline = Some(encoded.clone());
                a.stored_len = encoded.len() as u64;
                a.raw_len = encoded.len() as u64;
            }
        }
        accepted.push(a);
        outcomes.push(EventOutcome::Appended);
    }
    Ok(Plan {
        outcomes,
        accepted,
        chunks,
        dropped,
        views,
        owners,
        global_before,
        global,
    })
}

/// Writes what the plan accepted, in the plan's transaction.
#[allow(clippy::too_many_lines)]
fn write(
    tx: &mut Transaction<'_>,
    output: &mut dyn OutputStore,
    plan: &mut Plan,
    now_ms: i64,
    tombstone_cap: u64,
) -> Result<(), Fail> {
    // the group's events in one statement
    let acc = &plan.accepted;
    let ids: Vec<&[u8]> = acc.iter().map(|a| a.issue.as_slice()).collect();
    let seqs: Vec<i64> = acc.iter().map(|a| to_i64(a.seq)).collect();
    let observed: Vec<i64> = acc.iter().map(|a| a.observed_ms).collect();
    let kinds: Vec<i64> = acc.iter().map(|a| i64::from(a.kind)).collect();
    let streams: Vec<i64> = acc.iter().map(|a| i64::from(a.stream)).collect();
    let raw: Vec<i64> = acc.iter().map(|a| to_i64(a.raw_len)).collect();
    let stored: Vec<i64> = acc.iter().map(|a| to_i64(a.stored_len)).collect();
    let digests: Vec<&[u8]> = acc.iter().map(|a| a.digest.as_slice()).collect();
    let inline: Vec<Option<&[u8]>> = acc.iter().map(|a| a.inline.as_deref()).collect();
    if !acc.is_empty() {
        crate::prep::execute(
            tx,
            "INSERT INTO command_events (issue_uuid, event_seq, observed_ms, receipt_ms, body_kind,
                 stream, raw_len, stored_len, content_sha256, inline_body)
             SELECT u.i, u.s, u.o, $4, u.k, u.st, u.rl, u.sl, u.d, u.b
             FROM UNNEST($1::bytea[], $2::int8[], $3::int8[], $5::int8[], $6::int8[],
                         $7::int8[], $8::int8[], $9::bytea[], $10::bytea[])
                  AS u(i, s, o, k, st, rl, sl, d, b)",
            &[
                &ids, &seqs, &observed, &now_ms, &kinds, &streams, &raw, &stored, &digests, &inline,
            ],
        )
        .map_err(Fail::db("insert events"))?;
    }
    // lifecycle changes and stdin acknowledgements (few), in order
    for a in acc {
        if let Some((to, code, signal)) = a.lifecycle {
            let terminal = to.is_terminal().then_some(now_ms);
            // a terminal time never before the issue time; a non-terminal
            // lifecycle keeps the one it has
            crate::prep::execute(
                tx,
                "UPDATE commands SET lifecycle = $2,
                     terminal_time_ms = CASE WHEN $3::bigint IS NULL THEN terminal_time_ms
                                             ELSE GREATEST($3, issue_time_ms) END,
                     exit_code = COALESCE($4, exit_code), exit_signal = COALESCE($5, exit_signal)
                 WHERE issue_uuid = $1",
                &[
                    &a.issue.as_slice(),
                    &i64::from(to.to_wire() as i32),
                    &terminal,
                    &code.map(i64::from),
                    &signal.map(i64::from),
                ],
            )
            .map_err(Fail::db("apply lifecycle"))?;
            if to.is_terminal() {
                crate::prep::execute(
                    tx,
                    "UPDATE stdin_writes SET delivery = 3, payload = '\\x'::bytea
                     WHERE issue_uuid = $1 AND delivery = 1",
                    &[&a.issue.as_slice()],
                )
                .map_err(Fail::db("discard pending stdin"))?;
            }
        }
        if let Some((write_seq, delivery)) = a.stdin_ack {
            let to: i64 = if delivery == rvbox_proto::v1::StdinDelivery::Written as i32 {
                2
            } else {
                3
            };
            crate::prep::execute(
                tx,
                "UPDATE stdin_writes SET delivery = $3, payload = '\\x'::bytea
                 WHERE issue_uuid = $1 AND write_seq = $2 AND delivery = 1",
                &[&a.issue.as_slice(), &to_i64(write_seq), &to],
            )
            .map_err(Fail::db("settle stdin write"))?;
        }
    }
    for d in &plan.dropped {
        record_dropped(tx, d, now_ms)?;
    }
    output.put(tx, &plan.chunks)?;
    let mut global = plan.global;
    let touched: BTreeSet<[u8; 16]> = plan
        .accepted
        .iter()
        .map(|a| a.issue)
        .chain(plan.dropped.iter().map(|d| d.issue))
        .collect();
    // every touched command's counters in one statement
    let mut rows: Vec<([u8; 16], i64, i64, i64, i64)> = Vec::with_capacity(touched.len());
    let mut terminal: Vec<[u8; 16]> = Vec::new();
    for issue in &touched {
        let Some(v) = plan.views.get(issue) else {
            continue;
        };
        let (mut charged, mut held) = (v.charged, v.held_closeout);
        if v.lifecycle.is_terminal() && held > 0 {
            // the command is closed: its unused closeout headroom goes back
            let owner = plan.owners.get(&v.client_id).map_or(0, |o| o.1);
            let usage = Usage {
                command: charged,
                held_closeout: held,
                owner,
                global,
                free_space: 0,
            };
            if let Ok(after) = release_closeout(&usage) {
                charged = after.command;
                held = after.held_closeout;
                if let Some(o) = plan.owners.get_mut(&v.client_id) {
                    o.1 = after.owner;
                }
                global = after.global;
            }
        }
        rows.push((
            *issue,
            to_i64(v.last_seq),
            to_i64(charged),
            to_i64(v.output_charged.min(charged)),
            to_i64(held),
        ));
        if v.lifecycle.is_terminal() {
            terminal.push(*issue);
        }
    }
    if !rows.is_empty() {
        let ids: Vec<&[u8]> = rows.iter().map(|r| r.0.as_slice()).collect();
        let last: Vec<i64> = rows.iter().map(|r| r.1).collect();
        let charged: Vec<i64> = rows.iter().map(|r| r.2).collect();
        let output: Vec<i64> = rows.iter().map(|r| r.3).collect();
        let held: Vec<i64> = rows.iter().map(|r| r.4).collect();
        crate::prep::execute(
            tx,
            "UPDATE commands c SET last_event_seq = u.l, charged_bytes = u.c,
                 output_charged = u.o, closeout_held = u.h
             FROM UNNEST($1::bytea[], $2::int8[], $3::int8[], $4::int8[], $5::int8[])
                  AS u(i, l, c, o, h)
             WHERE c.issue_uuid = u.i",
            &[&ids, &last, &charged, &output, &held],
        )
        .map_err(Fail::db("update commands"))?;
    }
    for issue in &terminal {
        if let Some(v) = plan.views.get(issue) {
            crate::commands::insert_tombstone(
                tx,
                issue,
                &v.request_hash,
                &v.client_id,
                v.lifecycle,
                now_ms,
                tombstone_cap,
            )?;
        }
    }
    // the followers of each command that has new events, on any replica
    crate::notify::commands(tx, &touched)?;
    let mut clients: Vec<&str> = Vec::new();
    let mut deltas: Vec<i64> = Vec::new();
    for (client, (before, after)) in &plan.owners {
        let d = to_i64(*after).saturating_sub(to_i64(*before));
        if d != 0 {
            clients.push(client);
            deltas.push(d);
        }
    }
    if !clients.is_empty() {
        crate::prep::execute(
            tx,
            "UPDATE clients c SET charged_bytes = c.charged_bytes + u.d
             FROM UNNEST($1::text[], $2::int8[]) AS u(i, d)
             WHERE c.client_id = u.i",
            &[&clients, &deltas],
        )
        .map_err(Fail::db("update client usage"))?;
    }
    let d = to_i64(global).saturating_sub(to_i64(plan.global_before));
    if d != 0 {
        crate::prep::execute(
            tx,
            "UPDATE quota_totals SET command_charged = command_charged + $1 WHERE id = 1",
            &[&d],
        )
        .map_err(Fail::db("update global usage"))?;
    }
    Ok(())
}

impl PgStore {
    /// Appends a group of events in one transaction; refused events are
    /// reported per event and store nothing, the rest commit together.
    pub(crate) fn append_events(
        &mut self,
        batch: &[EventAppend],
        now_ms: i64,
    ) -> Result<AppendReport, Fail> {
        let mut dctx = zstd::bulk::Decompressor::new()
            .map_err(|e| Fail::Integrity(format!("zstd decompression context: {e}")))?;
        let mut output =
            std::mem::replace(&mut self.output, Box::new(crate::output::DatabaseChunks));
        let result = self.in_tx("append events", |tx, opts| {
            let mut plan = plan(tx, &mut dctx, opts, batch, output.as_mut(), now_ms)?;
            write(tx, output.as_mut(), &mut plan, now_ms, opts.tombstone_cap)?;
            // per command of the batch: its highest contiguous durable
            // sequence (a cumulative EventAck)
            let acked = batch
                .iter()
                .filter_map(|e| {
                    plan.views
                        .get(&e.issue_uuid)
                        .map(|v| (e.issue_uuid, v.last_seq))
                })
                .collect();
            Ok(AppendReport {
                outcomes: std::mem::take(&mut plan.outcomes),
                acked,
            })
        });
        self.output = output;
        result
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use rvbox_testkit::Postgres;

    /// The plan PostgreSQL caches for `sql` when it builds a generic plan
    /// for the tables as they are (here: empty, as at a first start).
    fn generic_plan(pg: &Postgres, db: &str, sql: &str, param: &str) -> String {
        pg.psql(
            db,
            &format!(
                "SET plan_cache_mode = force_generic_plan;
                 PREPARE p({param}) AS {sql};
                 EXPLAIN EXECUTE p('{{}}')"
            ),
        )
    }

    #[test]
    fn the_append_path_never_tests_each_row_against_an_array() {
        let pg = Postgres::start();
        pg.psql("postgres", "CREATE DATABASE plans");
        drop(
            crate::PgStore::connect(&pg.conninfo("plans"), crate::StoreOptions::default()).unwrap(),
        );
        for (sql, param) in [
            (super::LOCK_COMMANDS, "bytea[]"),
            (super::LIVE_SESSIONS, "bytea[]"),
            (super::CLIENT_USAGE, "text[]"),
        ] {
            let plan = generic_plan(&pg, "plans", sql, param);
            assert!(
                !plan.contains("ANY"),
                "a cached plan that tests every row against every key:\n{plan}"
            );
        }
    }
}
