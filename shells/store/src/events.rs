//! The event append path (plan §5.3): validate, append to segment files,
//! fsync (one group commit for the whole batch), then one metadata
//! transaction advancing each segment's `committed_end`; only then may the
//! caller acknowledge. Nothing in a batch is acknowledged unless the whole
//! batch is durable.

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::events::{SeqVerdict, check_event_seq};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_retention::{
    CHARGE_VERSION, ChargeKind, Class, Usage, charge, release_closeout, reserve, tombstones_to_drop,
};
use rvbox_segment::journal::JournalEntry;
use rvbox_segment::{Compression, Kind, RecordMeta, encode, sha256};

use crate::crash::points;
use crate::error::StoreError;
use crate::retention::{RotationCause, truncation_row_charge};
use crate::store::{OpenSegment, Store, record_limits, to_i64, to_u64};

pub use rvbox_store_port::events::body_kind;

/// A group touching at least this many segment files is made durable with
/// one `syncfs` of the data filesystem instead of one `fdatasync` per file
/// (each of which would commit the filesystem journal on its own).
pub const SYNCFS_THRESHOLD: usize = 4;

/// Largest encoded non-output event body kept inline in the database.
pub const MAX_INLINE_BODY_BYTES: usize = 16 * 1024;

pub use rvbox_store_port::events::{AppendReport, EventAppend, EventBody, EventOutcome};

#[derive(Debug, Clone)]
struct CmdView {
    client_id: String,
    lifecycle: Lifecycle,
    last_seq: u64,
    charged: u64,
    output_charged: u64,
    held_closeout: u64,
    request_hash: Vec<u8>,
    dirty: bool,
}

#[derive(Debug)]
struct PendingEvent {
    issue: [u8; 16],
    seq: u64,
    observed_ms: i64,
    kind: u8,
    stream: u8,
    raw_len: u64,
    stored_len: u64,
    digest: [u8; 32],
    segment: Option<(u32, u64)>,
    inline: Option<Vec<u8>>,
    lifecycle: Option<(Lifecycle, Option<i32>, Option<i32>)>,
    /// A `StdinAck` that settles a pending write: (write_seq, delivery).
    stdin_ack: Option<(u64, i32)>,
    /// Output or diagnostics dropped on arrival: no row, a truncation row
    /// in its place
    /// (a new one, or the one that ends just before it extended).
    dropped: Option<Dropped>,
}

/// An output (or diagnostics) event dropped on arrival under quota pressure that nothing
/// can relieve (plan §5.4 item 3).
#[derive(Debug, Clone, Copy)]
struct Dropped {
    cause: RotationCause,
    new_row: bool,
}

#[derive(Debug, Default)]
struct PendingSegment {
    new_file: bool,
    sealed_before: Option<u32>,
    bytes: Vec<u8>,
    first_seq: Option<u64>,
    last_seq: u64,
    stream_mask: u8,
    stored: u64,
    raw: u64,
    charged: u64,
}

/// `query_row` through SQLite's prepared-statement cache: the append path
/// runs the same few statements for every event.
fn cached_row<T>(
    conn: &rusqlite::Connection,
    sql: &str,
    params: impl rusqlite::Params,
    f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    conn.prepare_cached(sql)?.query_row(params, f)
}

fn refuse(code: Code, reason: impl AsRef<str>) -> EventOutcome {
    EventOutcome::Refused(DomainError::new(code, reason))
}

fn lifecycle_of(raw: i64) -> Lifecycle {
    Lifecycle::from_wire(i32::try_from(raw).unwrap_or(0)).unwrap_or(Lifecycle::Interrupted)
}

fn load_view(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<Option<CmdView>, StoreError> {
    cached_row(
        tx,
        "SELECT client_id, lifecycle, last_event_seq, charged_bytes, output_charged, closeout_held,
                request_hash, essential_trusted
         FROM commands WHERE issue_uuid = ?1",
        params![issue.as_slice()],
        |r| {
            Ok(CmdView {
                client_id: r.get(0)?,
                lifecycle: lifecycle_of(r.get(1)?),
                last_seq: to_u64(r.get(2)?),
                charged: to_u64(r.get(3)?),
                output_charged: to_u64(r.get(4)?),
                held_closeout: to_u64(r.get(5)?),
                request_hash: r.get(6)?,
                dirty: !r.get::<_, bool>(7)?,
            })
        },
    )
    .optional()
    .map_err(|e| StoreError::sqlite("load command", e))
}

fn stored_digest(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    seq: u64,
) -> Result<Option<[u8; 32]>, StoreError> {
    let v: Option<Vec<u8>> = cached_row(
        tx,
        "SELECT content_sha256 FROM command_events WHERE issue_uuid = ?1 AND event_seq = ?2",
        params![issue.as_slice(), to_i64(seq)],
        |r| r.get(0),
    )
    .optional()
    .map_err(|e| StoreError::sqlite("load event digest", e))?;
    Ok(v.and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok()))
}

fn next_ordinal(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<u32, StoreError> {
    let max: i64 = cached_row(
        tx,
        "SELECT COALESCE(MAX(ordinal), 0) FROM command_segments WHERE issue_uuid = ?1",
        params![issue.as_slice()],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("next segment ordinal", e))?;
    u32::try_from(max.saturating_add(1))
        .map_err(|_| StoreError::Integrity("segment ordinal overflow".into()))
}

/// Validates an output body and returns the SHA-256 of its raw bytes.
/// Pure (with a reused decompression context): every store backend
/// checks output by it.
///
/// # Errors
/// `PROTOCOL_ERROR` naming what is wrong with the chunk.
pub fn check_output(
    dctx: &mut zstd::bulk::Decompressor<'static>,
    compression: Compression,
    raw_len: u32,
    stored: &[u8],
) -> Result<[u8; 32], DomainError> {
    let limits = record_limits();
    if raw_len > limits.max_raw_len {
        return Err(DomainError::new(
            Code::ProtocolError,
            format!(
                "output chunk declares {raw_len} raw bytes; the limit is {}",
                limits.max_raw_len
            ),
        ));
    }
    if stored.len() > limits.max_stored_len as usize {
        return Err(DomainError::new(
            Code::ProtocolError,
            "output chunk is larger than its compression bound",
        ));
    }
    match compression {
        Compression::None => {
            if stored.len() != raw_len as usize {
                return Err(DomainError::new(
                    Code::ProtocolError,
                    "uncompressed output chunk length differs from its declared raw length",
                ));
            }
            Ok(sha256(stored))
        }
        Compression::Zstd => {
            // bounded: never allocates more than the declared raw length
            let raw = dctx.decompress(stored, raw_len as usize).map_err(|_| {
                DomainError::new(
                    Code::ProtocolError,
                    "output chunk does not decompress within its declared raw length",
                )
            })?;
            if raw.len() != raw_len as usize {
                return Err(DomainError::new(
                    Code::ProtocolError,
                    format!(
                        "output chunk decompresses to {} bytes, not the declared {raw_len}",
                        raw.len()
                    ),
                ));
            }
            Ok(sha256(&raw))
        }
    }
}

/// The content identity of a non-output event body (its kind, then its
/// encoding), compared when an event is sent again.
#[must_use]
pub fn other_digest(kind: u8, encoded: &[u8]) -> [u8; 32] {
    let mut buf = Vec::with_capacity(encoded.len() + 1);
    buf.push(kind);
    buf.extend_from_slice(encoded);
    sha256(&buf)
}

impl Store {
    /// Appends a batch of events as one group commit (see the module docs).
    /// Refused events are reported per event and store nothing; the rest of
    /// the batch proceeds.
    ///
    /// # Errors
    /// [`StoreError`] when a file or the database failed: then nothing of
    /// the batch is durable or acknowledged, and the touched segments are
    /// cut back to their committed length.
    pub fn append_events(
        &mut self,
        batch: &[EventAppend],
        now_ms: i64,
    ) -> Result<AppendReport, StoreError> {
        if let Err(e) = self.health.check_serving() {
            // recovering or unusable: refuse everything, acknowledge nothing
            return Ok(AppendReport {
                outcomes: batch
                    .iter()
                    .map(|_| EventOutcome::Refused(e.clone()))
                    .collect(),
                acked: BTreeMap::new(),
            });
        }
        // plan §5.4 item 2: rotate the oldest sealed output of a command the
        // batch would push past its output window or total (retention.rs)
        // Only output that will be appended may cause a rotation: never an
        // event for an unknown, finished or untrusted command, a repeat, an
        // out-of-sequence event or an invalid chunk.
        let eligible = self.rotation_candidates(batch)?;
        if !eligible.is_empty() {
            self.rotate_for_append(&eligible, now_ms)?;
        }
        let free = self.free_space()?;
        let tiers = self.opts.tiers.clone();
        let seal_bytes = self.opts.seal_bytes;
        let tombstone_cap = self.opts.tombstone_cap;
        let limits = record_limits();

        // Segment state the batch starts from: (ordinal, committed length).
        let mut base: BTreeMap<[u8; 16], (u32, u64)> = BTreeMap::new();
        let mut views: BTreeMap<[u8; 16], CmdView> = BTreeMap::new();
        let mut owners: BTreeMap<String, u64> = BTreeMap::new();
        let mut sessions_seen: BTreeMap<[u8; 16], Option<String>> = BTreeMap::new();
        let mut batch_digests: BTreeMap<([u8; 16], u64), [u8; 32]> = BTreeMap::new();
        let mut stdin_settled: std::collections::BTreeSet<([u8; 16], u64)> =
            std::collections::BTreeSet::new();
        let mut pending: Vec<PendingEvent> = Vec::new();
        let mut segs: BTreeMap<([u8; 16], u32), PendingSegment> = BTreeMap::new();
        let mut current: BTreeMap<[u8; 16], (u32, u64)> = BTreeMap::new();
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut global;
        // output dropped on arrival in this batch: per command, the last
        // dropped sequence and why (a run extends one truncation row)
        let mut drops: BTreeMap<[u8; 16], (u64, RotationCause)> = BTreeMap::new();

        // ---- 1. validate and plan (a read transaction) --------------------
        {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Deferred)
                .map_err(|e| StoreError::sqlite("begin append planning", e))?;
            global = crate::store::global_charged(&tx)?;
            for ev in batch {
                let issue = ev.issue_uuid;
                let view = match views.entry(issue) {
                    std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::btree_map::Entry::Vacant(v) => {
                        match load_view(&tx, &issue)? {
                            Some(loaded) => v.insert(loaded),
                            None => {
                                outcomes.push(refuse(
                                    Code::ProtocolError,
                                    "event for an unknown command",
                                ));
                                continue;
                            }
                        }
                    }
                };
                if view.dirty {
                    outcomes.push(refuse(
                        Code::Unavailable,
                        "the command's stored state is under an open storage incident",
                    ));
                    continue;
                }
                // fencing (docs/scaleout.md): the session the event came
                // on must still be its client's live one. One writer holds
                // the database from here to the commit, so the answer
                // still holds when the batch commits.
                if let Some(fence) = &ev.session {
                    let owner = match sessions_seen.entry(fence.session_id) {
                        std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                        std::collections::btree_map::Entry::Vacant(v) => {
                            v.insert(crate::sessions::live_session_owner(&tx, fence)?)
                        }
                    };
                    if let Err(e) = crate::sessions::fence_verdict(
                        &self.metrics.writes_fenced,
                        owner.as_deref(),
                        &view.client_id,
                    ) {
                        outcomes.push(EventOutcome::Refused(e));
                        continue;
                    }
                }
                let scope = uuid::Uuid::from_bytes(issue).hyphenated().to_string();
                if let Err(e) = self.health.check_writable(&[
                    (rvbox_proto::v1::ScopeKind::Command, scope.as_str()),
                    (rvbox_proto::v1::ScopeKind::Client, view.client_id.as_str()),
                ]) {
                    outcomes.push(EventOutcome::Refused(e));
                    continue;
                }
                // content identity and validation
                let (kind, digest) = match &ev.body {
                    EventBody::Output {
                        compression,
                        raw_len,
                        stored,
                        ..
                    } => match check_output(&mut self.dctx.0, *compression, *raw_len, stored) {
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
                if let EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } =
                    &ev.body
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
                        None => stored_digest(&tx, &issue, ev.event_seq)?,
                    }
                } else {
                    None
                };
                // an event dropped on arrival keeps no row to compare a
                // repeat with: its truncation row answers for it
                if stored.is_none()
                    && ev.event_seq != 0
                    && ev.event_seq <= view.last_seq
                    && dropped_at(&tx, &issue, ev.event_seq)?
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
                        // plan §6.4: reconciliation may already have advanced
                        // the command to this lifecycle from the client's
                        // snapshot; the event itself is still stored
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
                // a stdin acknowledgement settles its write (and frees its
                // payload's charge) in this transaction, once the event
                // itself is charged
                let mut stdin_ack = None;
                if let EventBody::Other { kind, encoded } = &ev.body
                    && *kind == body_kind::STDIN_ACK
                {
                    let Ok(ack) =
                        <rvbox_proto::v1::StdinAck as prost::Message>::decode(encoded.as_slice())
                    else {
                        outcomes.push(refuse(Code::ProtocolError, "stdin_ack does not decode"));
                        continue;
                    };
                    match crate::stdin::check_ack(&tx, &issue, &ack)? {
                        Err(e) => {
                            outcomes.push(EventOutcome::Refused(e));
                            continue;
                        }
                        Ok(Some(stored)) if !stdin_settled.contains(&(issue, ack.write_seq)) => {
                            stdin_ack = Some((
                                ack.write_seq,
                                ack.delivery,
                                crate::stdin::settled_release(stored)?,
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
                        let class = if *kind == body_kind::DIAGNOSTICS
                            || *kind == body_kind::PROFILE_RESULT
                        {
                            Class::Ordinary
                        } else {
                            Class::Essential
                        };
                        (ChargeKind::EventRow, class, encoded.len() as u64)
                    }
                };
                let charged = charge(CHARGE_VERSION, charge_kind, bytes)
                    .map_err(|e| StoreError::Integrity(e.to_string()))?;
                let owner_used = match owners.get(&view.client_id) {
                    Some(v) => *v,
                    None => crate::store::client_charged(&tx, &view.client_id)?,
                };
                let usage = Usage {
                    command: view.charged,
                    held_closeout: view.held_closeout,
                    owner: owner_used,
                    global,
                    free_space: free,
                };
                let droppable = crate::retention::droppable(&ev.body, class);
                let r = match reserve(&tiers, &usage, charge_kind, class, charged, true) {
                    Ok(r) => r,
                    Err(refusal)
                        if let Some((stream, raw_len, stored_len)) = droppable
                            && let Some(cause) =
                                drop_cause(&tx, refusal.tier, &view.client_id)? =>
                    {
                        // plan §5.4 item 3: active data alone holds the
                        // quota and nothing can be rotated or evicted to
                        // make room: the event is dropped with a marker
                        // (charged as essential, so the command's closeout
                        // headroom pays for it), never refused for ever
                        let reason = cause.drop_reason();
                        let extends = drops
                            .get(&issue)
                            .is_some_and(|(last, c)| *last + 1 == ev.event_seq && *c == cause)
                            || drop_row_ends_at(&tx, &issue, ev.event_seq - 1, cause)?;
                        let marker = if extends {
                            0
                        } else {
                            truncation_row_charge(reason)?
                        };
                        match reserve(
                            &tiers,
                            &usage,
                            ChargeKind::TruncationRow,
                            Class::Essential,
                            marker,
                            true,
                        ) {
                            Ok(m) => {
                                view.charged = m.command_after;
                                view.held_closeout = m.held_closeout_after;
                                owners.insert(view.client_id.clone(), m.owner_after);
                                global = m.global_after;
                                view.last_seq = ev.event_seq;
                                batch_digests.insert((issue, ev.event_seq), digest);
                                drops.insert(issue, (ev.event_seq, cause));
                                tracing::warn!(
                                    issue_uuid = %uuid::Uuid::from_bytes(issue),
                                    event_seq = ev.event_seq,
                                    body_kind = kind,
                                    raw_len,
                                    tier = refusal.tier.name(),
                                    "event dropped on arrival: its quota is held by data that cannot rotate"
                                );
                                self.metrics
                                    .output_dropped
                                    .get_or_create(&crate::metrics::CauseLabel {
                                        cause: cause.source().as_str_name(),
                                    })
                                    .inc();
                                pending.push(PendingEvent {
                                    issue,
                                    seq: ev.event_seq,
                                    observed_ms: ev.observed_ms,
                                    kind,
                                    stream,
                                    raw_len,
                                    stored_len,
                                    digest,
                                    segment: None,
                                    inline: None,
                                    lifecycle: None,
                                    stdin_ack: None,
                                    dropped: Some(Dropped {
                                        cause,
                                        new_row: !extends,
                                    }),
                                });
                                outcomes.push(EventOutcome::Appended);
                                continue;
                            }
                            Err(refusal) => {
                                outcomes.push(quota_refused(
                                    &self.metrics,
                                    &refusal,
                                    "even as a marker",
                                ));
                                continue;
                            }
                        }
                    }
                    Err(refusal) => {
                        outcomes.push(quota_refused(&self.metrics, &refusal, "as it came"));
                        continue;
                    }
                };
                view.charged = r.command_after;
                view.held_closeout = r.held_closeout_after;
                owners.insert(view.client_id.clone(), r.owner_after);
                global = r.global_after;
                if let Some((write_seq, _, freed)) = stdin_ack {
                    let after = crate::stdin::usage_after_settle(
                        &Usage {
                            command: view.charged,
                            held_closeout: view.held_closeout,
                            owner: r.owner_after,
                            global,
                            free_space: free,
                        },
                        freed,
                    )?;
                    view.charged = after.command;
                    owners.insert(view.client_id.clone(), after.owner);
                    global = after.global;
                    stdin_settled.insert((issue, write_seq));
                }
                view.last_seq = ev.event_seq;
                batch_digests.insert((issue, ev.event_seq), digest);
                if let Some((to, _, _)) = lifecycle {
                    view.lifecycle = to;
                }

                // placement
                let mut p = PendingEvent {
                    issue,
                    seq: ev.event_seq,
                    observed_ms: ev.observed_ms,
                    kind,
                    stream: 0,
                    raw_len: 0,
                    stored_len: 0,
                    digest,
                    segment: None,
                    inline: None,
                    lifecycle,
                    stdin_ack: stdin_ack.map(|(seq, delivery, _)| (seq, delivery)),
                    dropped: None,
                };
                match &ev.body {
                    EventBody::Output {
                        stream,
                        compression,
                        raw_len,
                        stored,
                    } => {
                        view.output_charged = view.output_charged.saturating_add(charged);
                        let meta = RecordMeta {
                            issue_uuid: issue,
                            seq: ev.event_seq,
                            observed_unix_ms: ev.observed_ms,
                            receipt_unix_ms: now_ms,
                            kind: Kind::Output,
                            stream: *stream,
                            compression: *compression,
                            raw_len: *raw_len,
                            sha256: digest,
                        };
                        let record = match encode(&meta, stored, &limits) {
                            Ok(r) => r,
                            Err(e) => {
                                return Err(StoreError::Integrity(format!(
                                    "validated record does not encode: {}",
                                    e.code()
                                )));
                            }
                        };
                        // where the record goes: the active segment, unless it would pass the seal size
                        if let std::collections::btree_map::Entry::Vacant(slot) =
                            current.entry(issue)
                        {
                            let start = match self.open_segments.get(&issue) {
                                Some(s) => Some((s.ordinal, s.committed)),
                                None => active_segment(&tx, &issue)?,
                            };
                            match start {
                                Some(s) => {
                                    slot.insert(s);
                                    base.insert(issue, s);
                                }
                                None => {
                                    let ordinal = next_ordinal(&tx, &issue)?;
                                    slot.insert((ordinal, 0));
                                    segs.insert(
                                        (issue, ordinal),
                                        PendingSegment {
                                            new_file: true,
                                            ..Default::default()
                                        },
                                    );
                                }
                            }
                        }
                        let (mut ordinal, mut len) = current.get(&issue).copied().unwrap_or((1, 0));
                        let rec_len = record.len() as u64;
                        if len > 0 && len.saturating_add(rec_len) > seal_bytes {
                            let next = ordinal.checked_add(1).ok_or_else(|| {
                                StoreError::Integrity("segment ordinal overflow".into())
                            })?;
                            segs.insert(
                                (issue, next),
                                PendingSegment {
                                    new_file: true,
                                    sealed_before: Some(ordinal),
                                    ..Default::default()
                                },
                            );
                            ordinal = next;
                            len = 0;
                        }
                        let seg = segs.entry((issue, ordinal)).or_default();
                        seg.bytes.extend_from_slice(&record);
                        seg.first_seq.get_or_insert(ev.event_seq);
                        seg.last_seq = ev.event_seq;
                        seg.stream_mask |= stream.as_u8();
                        seg.stored = seg.stored.saturating_add(stored.len() as u64);
                        seg.raw = seg.raw.saturating_add(u64::from(*raw_len));
                        seg.charged = seg.charged.saturating_add(charged);
                        p.stream = stream.as_u8();
                        p.raw_len = u64::from(*raw_len);
                        p.stored_len = stored.len() as u64;
                        p.segment = Some((ordinal, len));
                        current.insert(issue, (ordinal, len.saturating_add(rec_len)));
                    }
                    EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } => {
                        p.inline = Some(encoded.clone());
                        p.stored_len = encoded.len() as u64;
                        p.raw_len = encoded.len() as u64;
                    }
                }
                pending.push(p);
                outcomes.push(EventOutcome::Appended);
            }
            tx.commit()
                .map_err(|e| StoreError::sqlite("end append planning", e))?;
        }

        // ---- 2. write and fsync (group commit) ----------------------------
        let mut failing = None;
        if let Err(e) = self.write_segments(&segs, &base, &mut failing) {
            self.rollback_segments(&base, &segs);
            self.metrics.groups_failed.inc();
            if let Some(issue) = failing {
                // One command's file failed: record it against that command
                // so its scope turns dirty and the next groups refuse only
                // its events; every other command carries on.
                self.record_command_io_failure(&issue, &e, now_ms);
            }
            return Err(e);
        }

        // ---- 3. what the batch seals, read back: "verified at seal" -------
        let sealing = self.sealing_segments(&pending, &segs, &base, &current)?;
        let verified = self.verify_sealing(&sealing);

        // ---- 4. one metadata transaction ----------------------------------
        let commit = self.commit_batch(
            &pending,
            &segs,
            &views,
            &owners,
            global,
            now_ms,
            tombstone_cap,
            &verified,
        );
        if let Err(e) = commit {
            self.rollback_segments(&base, &segs);
            self.metrics.groups_failed.inc();
            return Err(e);
        }
        self.hook.at(points::EVENT_AFTER_COMMIT);
        for (issue, (ordinal, len)) in &current {
            if let Some(open) = self.open_segments.get_mut(issue) {
                open.ordinal = *ordinal;
                open.committed = *len;
            }
        }
        // a terminal command's segment is sealed: nothing appends to it again
        for p in &pending {
            if p.lifecycle.is_some_and(|(to, _, _)| to.is_terminal()) {
                self.open_segments.remove(&p.issue);
            }
        }
        let acked = batch
            .iter()
            .filter_map(|ev| {
                views
                    .get(&ev.issue_uuid)
                    .map(|v| (ev.issue_uuid, v.last_seq))
            })
            .collect();
        self.count_outcomes(&outcomes, &segs);
        Ok(AppendReport { outcomes, acked })
    }

    fn count_outcomes(
        &self,
        outcomes: &[EventOutcome],
        segs: &BTreeMap<([u8; 16], u32), PendingSegment>,
    ) {
        let m = &self.metrics;
        let mut appended = 0u64;
        for o in outcomes {
            match o {
                EventOutcome::Appended => appended += 1,
                EventOutcome::Duplicate => {
                    m.events_duplicate.inc();
                }
                EventOutcome::Refused(e) => m.event_refused(e.code().as_str()),
            }
        }
        m.events_appended.inc_by(appended);
        m.groups_committed.inc();
        m.group_events.observe(appended as f64);
        m.segments_created
            .inc_by(segs.values().filter(|s| s.new_file).count() as u64);
    }

    fn record_command_io_failure(&mut self, issue: &[u8; 16], error: &StoreError, now_ms: i64) {
        let no_space = matches!(error, StoreError::Io { source, .. }
            if source.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()));
        let kind = if no_space {
            rvbox_proto::v1::IncidentKind::DiskExhaustion
        } else {
            rvbox_proto::v1::IncidentKind::PermissionError
        };
        let client = cached_row(
            &self.conn,
            "SELECT client_id FROM commands WHERE issue_uuid = ?1",
            params![issue.as_slice()],
            |r| r.get::<_, String>(0),
        )
        .ok();
        let incident = crate::incidents::NewIncident {
            kind,
            scope_kind: rvbox_proto::v1::ScopeKind::Command,
            scope_key: uuid::Uuid::from_bytes(*issue).hyphenated().to_string(),
            client_id: client,
            issue_uuid: Some(*issue),
            summary: "a segment file of this command could not be written; its events wait until the condition is repaired".into(),
            evidence: error.to_string().into_bytes(),
            data_loss: false,
        };
        if let Err(e) = self.record_incident(&incident, now_ms, false) {
            tracing::error!(error = %e, "incident for a failed segment write not recorded");
        }
    }

    /// The output events of `batch` that may cause a rotation: those of a
    /// command whose new output would pass its output window or total, and
    /// that would pass validation (the next contiguous sequence of a known,
    /// non-terminal, trusted command, with a chunk that decompresses to its
    /// declared length). Chunks are decompressed here only for commands
    /// that would need a rotation, so the common path validates once.
    fn rotation_candidates(
        &mut self,
        batch: &[EventAppend],
    ) -> Result<Vec<EventAppend>, StoreError> {
        if !batch
            .iter()
            .any(|e| matches!(e.body, EventBody::Output { .. }))
        {
            return Ok(Vec::new());
        }
        struct Cmd {
            next: Option<u64>,
            output: u64,
            charged: u64,
            incoming: u64,
            events: Vec<usize>,
        }
        let mut cmds: BTreeMap<[u8; 16], Cmd> = BTreeMap::new();
        for (i, ev) in batch.iter().enumerate() {
            let cmd = match cmds.entry(ev.issue_uuid) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    let row: Option<(i64, i64, bool, i64, i64)> = cached_row(
                        &self.conn,
                        "SELECT lifecycle, last_event_seq, essential_trusted, output_charged, charged_bytes
                         FROM commands WHERE issue_uuid = ?1",
                        params![ev.issue_uuid.as_slice()],
                        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
                    )
                    .optional()
                    .map_err(|e| StoreError::sqlite("load command", e))?;
                    let (next, output, charged) =
                        row.map_or((None, 0, 0), |(lc, last, trusted, o, c)| {
                            let next = (trusted && !lifecycle_of(lc).is_terminal())
                                .then(|| to_u64(last).saturating_add(1));
                            (next, to_u64(o), to_u64(c))
                        });
                    v.insert(Cmd {
                        next,
                        output,
                        charged,
                        incoming: 0,
                        events: Vec::new(),
                    })
                }
            };
            let Some(expected) = cmd.next else { continue };
            if ev.event_seq < expected {
                continue; // a repeat stores nothing
            }
            if ev.event_seq > expected {
                cmd.next = None; // a gap: nothing more of it appends
                continue;
            }
            cmd.next = Some(expected.saturating_add(1));
            match &ev.body {
                EventBody::Output { stored, .. } => {
                    let c = charge(
                        CHARGE_VERSION,
                        ChargeKind::OutputRecord,
                        rvbox_segment::RECORD_OVERHEAD.saturating_add(stored.len() as u64),
                    )
                    .map_err(|e| StoreError::Integrity(e.to_string()))?;
                    cmd.incoming = cmd.incoming.saturating_add(c);
                    cmd.events.push(i);
                }
                EventBody::Lifecycle { to, .. } if to.is_terminal() => cmd.next = None,
                _ => {}
            }
        }
        let (window, total) = (
            self.opts.tiers.command_output_window,
            self.opts.tiers.command_total,
        );
        let mut out = Vec::new();
        for cmd in cmds.values() {
            let over = cmd.output.saturating_add(cmd.incoming) > window
                || cmd.charged.saturating_add(cmd.incoming) > total;
            if !over {
                continue; // no rotation: nothing to validate twice
            }
            for &i in &cmd.events {
                let Some(ev) = batch.get(i) else { continue };
                let EventBody::Output {
                    compression,
                    raw_len,
                    stored,
                    ..
                } = &ev.body
                else {
                    continue;
                };
                if check_output(&mut self.dctx.0, *compression, *raw_len, stored).is_err() {
                    break; // this chunk is refused, and nothing after it appends
                }
                out.push(ev.clone());
            }
        }
        Ok(out)
    }

    /// Appends each pending segment's bytes, syncs every touched file and,
    /// for new files, the segment directory.
    fn write_segments(
        &mut self,
        segs: &BTreeMap<([u8; 16], u32), PendingSegment>,
        base: &BTreeMap<[u8; 16], (u32, u64)>,
        failing: &mut Option<[u8; 16]>,
    ) -> Result<(), StoreError> {
        let dir = self.layout.segments_dir();
        // the fan-out directories that got a new file: synced before the
        // metadata that names the file commits
        let mut created = std::collections::BTreeSet::new();
        let mut first_write = true;
        // Files that received bytes in this batch but left the cache before
        // the sync (a segment sealed mid-batch, or evicted by the open-file
        // bound): they are synced with the rest, never dropped unsynced.
        let mut retired: Vec<Box<dyn crate::fs::SegmentFile>> = Vec::new();
        let mut touched: std::collections::BTreeSet<([u8; 16], u32)> =
            std::collections::BTreeSet::new();
        for ((issue, ordinal), seg) in segs {
            if seg.bytes.is_empty() && !seg.new_file {
                continue;
            }
            // an error until the next iteration belongs to this command
            *failing = Some(*issue);
            let path = self
                .layout
                .segment_path(issue, *ordinal)
                .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))?;
            let needs_open = self
                .open_segments
                .get(issue)
                .is_none_or(|s| s.ordinal != *ordinal);
            if needs_open {
                let file = if seg.new_file {
                    let f = crate::store::create_segment_file(self.fs.as_ref(), &path)
                        .map_err(|e| StoreError::io("create segment", &path, e))?;
                    created.insert(self.layout.segment_dir(issue));
                    self.hook.at(points::SEGMENT_CREATED);
                    f
                } else {
                    let mut f = self
                        .fs
                        .open(&path)
                        .map_err(|e| StoreError::io("open segment", &path, e))?;
                    // bytes beyond the committed end were never acknowledged
                    let committed = base.get(issue).map_or(0, |b| b.1);
                    if f.len()
                        .map_err(|e| StoreError::io("stat segment", &path, e))?
                        > committed
                    {
                        f.truncate(committed)
                            .map_err(|e| StoreError::io("truncate uncommitted tail", &path, e))?;
                    }
                    f
                };
                if self.open_segments.len() >= self.opts.max_open_segments
                    && let Some(k) = self.open_segments.keys().find(|k| *k != issue).copied()
                    && let Some(old) = self.open_segments.remove(&k)
                    && touched.contains(&(k, old.ordinal))
                {
                    retired.push(old.file);
                }
                if let Some(old) = self.open_segments.remove(issue)
                    && touched.contains(&(*issue, old.ordinal))
                {
                    retired.push(old.file);
                }
                let committed = if seg.new_file {
                    0
                } else {
                    base.get(issue).map_or(0, |b| b.1)
                };
                self.open_segments.insert(
                    *issue,
                    OpenSegment {
                        ordinal: *ordinal,
                        file,
                        committed,
                    },
                );
            }
            let Some(open) = self.open_segments.get_mut(issue) else {
                continue;
            };
            if first_write && seg.bytes.len() > 1 {
                // the torn-write crash point: half of the first record lands
                let half = seg.bytes.len() / 2;
                let (a, b) = seg.bytes.split_at(half);
                open.file
                    .append(a)
                    .map_err(|e| StoreError::io("append segment", &path, e))?;
                self.hook.at(points::EVENT_MID_RECORD);
                open.file
                    .append(b)
                    .map_err(|e| StoreError::io("append segment", &path, e))?;
                first_write = false;
            } else {
                open.file
                    .append(&seg.bytes)
                    .map_err(|e| StoreError::io("append segment", &path, e))?;
            }
            touched.insert((*issue, *ordinal));
        }
        // from here on a failure is the filesystem's, not one command's
        *failing = None;
        self.hook.at(points::EVENT_BEFORE_FSYNC);
        if touched.len() >= SYNCFS_THRESHOLD {
            // one sequential journal flush covers every touched file
            // (journal.rs), when the group fits a frame
            let entries: Vec<JournalEntry<'_>> = segs
                .iter()
                .filter(|(_, seg)| !seg.bytes.is_empty())
                .map(|((issue, ordinal), seg)| JournalEntry {
                    issue_uuid: *issue,
                    ordinal: *ordinal,
                    offset: if seg.new_file {
                        0
                    } else {
                        base.get(issue).map_or(0, |b| b.1)
                    },
                    bytes: &seg.bytes,
                })
                .collect();
            if self.journal_group(&entries, &created)? {
                self.hook.at(points::EVENT_AFTER_FSYNC);
                return Ok(());
            }
            // otherwise one filesystem flush covers every touched file and new entry
            self.fs
                .sync_filesystem(&dir)
                .map_err(|e| StoreError::io("sync segment filesystem", &dir, e))?;
            self.hook.at(points::EVENT_AFTER_FSYNC);
            return Ok(());
        }
        for file in &mut retired {
            file.sync_data()
                .map_err(|e| StoreError::io("sync segment", &dir, e))?;
        }
        for ((issue, ordinal), seg) in segs {
            if seg.bytes.is_empty() {
                continue;
            }
            if let Some(open) = self.open_segments.get_mut(issue)
                && open.ordinal == *ordinal
            {
                open.file.sync_data().map_err(|e| {
                    StoreError::io("sync segment", dir.join(format!("{ordinal}")), e)
                })?;
            }
        }
        let dirs: Vec<&std::path::Path> = created.iter().map(std::path::PathBuf::as_path).collect();
        self.fs
            .sync_dirs(&dirs)
            .map_err(|(dir, e)| StoreError::io("sync segment directory", dir, e))?;
        self.hook.at(points::EVENT_AFTER_FSYNC);
        Ok(())
    }

    /// Cuts touched segments back to their committed length after a failed
    /// batch; a segment that cannot be cut is dropped from the cache and is
    /// cut when next opened (the same rule as recovery).
    fn rollback_segments(
        &mut self,
        base: &BTreeMap<[u8; 16], (u32, u64)>,
        segs: &BTreeMap<([u8; 16], u32), PendingSegment>,
    ) {
        for (issue, _) in segs.keys() {
            let keep = base.get(issue).map_or(0, |b| b.1);
            let ok = self.open_segments.get_mut(issue).is_some_and(|s| {
                s.file.truncate(keep).is_ok() && {
                    s.committed = keep;
                    true
                }
            });
            if !ok {
                self.open_segments.remove(issue);
            }
        }
        // a newly created file that never got a row is an orphan; recovery
        // removes orphans, and a retry creates the next ordinal afresh
        for ((issue, ordinal), seg) in segs {
            if seg.new_file && base.get(issue).is_none_or(|b| b.0 != *ordinal) {
                self.open_segments
                    .retain(|k, s| !(k == issue && s.ordinal == *ordinal));
                if let Some(path) = self.layout.segment_path(issue, *ordinal) {
                    let _ = self.fs.remove_file(&path);
                }
            }
        }
        tracing::error!(
            segments = segs.len(),
            "event batch failed; nothing acknowledged"
        );
    }

    /// The segments this batch seals, each with its committed end once the
    /// batch commits: the full segment a new one follows, and the segment
    /// of every command the batch makes terminal (migration 6 seals it in
    /// the terminal transition).
    fn sealing_segments(
        &self,
        pending: &[PendingEvent],
        segs: &BTreeMap<([u8; 16], u32), PendingSegment>,
        base: &BTreeMap<[u8; 16], (u32, u64)>,
        current: &BTreeMap<[u8; 16], (u32, u64)>,
    ) -> Result<Vec<([u8; 16], u32, u64)>, StoreError> {
        let end_after = |issue: &[u8; 16], ordinal: u32| {
            let before = base
                .get(issue)
                .filter(|b| b.0 == ordinal)
                .map_or(0, |b| b.1);
            let added = segs
                .get(&(*issue, ordinal))
                .map_or(0, |s| s.bytes.len() as u64);
            before.saturating_add(added)
        };
        let mut out = Vec::new();
        for ((issue, _), seg) in segs {
            if let Some(prev) = seg.sealed_before {
                out.push((*issue, prev, end_after(issue, prev)));
            }
        }
        for p in pending {
            if !p.lifecycle.is_some_and(|(to, _, _)| to.is_terminal()) {
                continue;
            }
            let last = match current.get(&p.issue) {
                Some(c) => Some(*c),
                None => match self.open_segments.get(&p.issue) {
                    Some(o) => Some((o.ordinal, o.committed)),
                    None => cached_row(
                        &self.conn,
                        "SELECT ordinal, committed_end FROM command_segments WHERE issue_uuid = ?1 AND state = 'active'",
                        params![p.issue.as_slice()],
                        |r| Ok((r.get::<_, u32>(0)?, to_u64(r.get(1)?))),
                    )
                    .optional()
                    .map_err(|e| StoreError::sqlite("find active segment", e))?,
                },
            };
            if let Some((ordinal, end)) = last.filter(|l| l.1 > 0) {
                out.push((p.issue, ordinal, end));
            }
        }
        Ok(out)
    }

    /// Reads back each segment being sealed and checks every record of its
    /// committed range; returns the clean ones. One that is not clean keeps
    /// no fact: the next start (or the background scrub) scans it and
    /// records what it finds.
    fn verify_sealing(&self, sealing: &[([u8; 16], u32, u64)]) -> Vec<([u8; 16], u32, u64)> {
        let limits = record_limits();
        sealing
            .iter()
            .copied()
            .filter(|(issue, ordinal, end)| {
                let Some(path) = self.layout.segment_path(issue, *ordinal) else {
                    return false;
                };
                let clean = rvbox_storage::segment_io::read_and_scan(
                    self.fs.as_ref(),
                    &path,
                    *end,
                    self.opts.seal_bytes,
                    &limits,
                )
                .is_ok_and(|s| {
                    s.file_len == *end && matches!(s.scan.recovery, rvbox_segment::Recovery::Clean)
                });
                if !clean {
                    self.metrics.recovered("seal_verify_failed", 1);
                    tracing::error!(ordinal, "a segment being sealed did not read back clean; it is scanned again at the next start");
                }
                clean
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn commit_batch(
        &mut self,
        pending: &[PendingEvent],
        segs: &BTreeMap<([u8; 16], u32), PendingSegment>,
        views: &BTreeMap<[u8; 16], CmdView>,
        owners: &BTreeMap<String, u64>,
        global: u64,
        now_ms: i64,
        tombstone_cap: u64,
        verified: &[([u8; 16], u32, u64)],
    ) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin append commit", e))?;
        for ((issue, ordinal), seg) in segs {
            if let Some(prev) = seg.sealed_before {
                tx.prepare_cached("UPDATE command_segments SET state = 'sealed' WHERE issue_uuid = ?1 AND ordinal = ?2 AND state = 'active'").and_then(|mut st| st.execute(params![issue.as_slice(), prev]))
                .map_err(|e| StoreError::sqlite("seal segment", e))?;
            }
            if seg.new_file {
                tx.prepare_cached("INSERT INTO command_segments (issue_uuid, ordinal, created_ms) VALUES (?1, ?2, ?3)").and_then(|mut st| st.execute(params![issue.as_slice(), ordinal, now_ms]))
                .map_err(|e| StoreError::sqlite("insert segment", e))?;
            }
            tx.prepare_cached(
                "UPDATE command_segments SET
                     committed_end = committed_end + ?3,
                     first_seq = COALESCE(first_seq, ?4),
                     last_seq = COALESCE(?5, last_seq),
                     stream_mask = stream_mask | ?6,
                     stored_bytes = stored_bytes + ?7,
                     raw_bytes = raw_bytes + ?8,
                     charged_bytes = charged_bytes + ?9
                 WHERE issue_uuid = ?1 AND ordinal = ?2",
            )
            .and_then(|mut st| {
                st.execute(params![
                    issue.as_slice(),
                    ordinal,
                    seg.bytes.len() as i64,
                    seg.first_seq.map(to_i64),
                    seg.first_seq.map(|_| to_i64(seg.last_seq)),
                    i64::from(seg.stream_mask),
                    to_i64(seg.stored),
                    to_i64(seg.raw),
                    to_i64(seg.charged)
                ])
            })
            .map_err(|e| StoreError::sqlite("advance committed_end", e))?;
        }
        for p in pending {
            if let Some(d) = p.dropped {
                record_dropped(&tx, p, d, now_ms)?;
                continue;
            }
            tx.prepare_cached("INSERT INTO command_events (issue_uuid, event_seq, observed_ms, receipt_ms, body_kind,
                     stream, raw_len, stored_len, content_sha256, segment_ordinal, segment_offset, inline_body)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)").and_then(|mut st| st.execute(params![
                    p.issue.as_slice(),
                    to_i64(p.seq),
                    p.observed_ms,
                    now_ms,
                    p.kind,
                    p.stream,
                    to_i64(p.raw_len),
                    to_i64(p.stored_len),
                    p.digest.as_slice(),
                    p.segment.map(|s| s.0),
                    p.segment.map(|s| to_i64(s.1)),
                    p.inline
                ]))
            .map_err(|e| StoreError::sqlite("insert event", e))?;
            if let Some((to, code, signal)) = p.lifecycle {
                let terminal = to.is_terminal().then_some(now_ms);
                tx.prepare_cached("UPDATE commands SET lifecycle = ?2, terminal_time_ms = COALESCE(MAX(?3, issue_time_ms), terminal_time_ms),
                         exit_code = COALESCE(?4, exit_code), exit_signal = COALESCE(?5, exit_signal)
                     WHERE issue_uuid = ?1").and_then(|mut st| st.execute(params![p.issue.as_slice(), to.to_wire() as i32, terminal, code, signal]))
                .map_err(|e| StoreError::sqlite("apply lifecycle", e))?;
                if to.is_terminal() {
                    crate::stdin::discard_pending(&tx, &p.issue)?;
                }
            }
            if let Some((write_seq, delivery)) = p.stdin_ack
                && crate::stdin::settle(&tx, &p.issue, write_seq, delivery)?
            {
                self.metrics
                    .stdin_acks
                    .get_or_create(&crate::metrics::DeliveryLabel {
                        delivery: if delivery == rvbox_proto::v1::StdinDelivery::Written as i32 {
                            "written"
                        } else {
                            "discarded"
                        },
                    })
                    .inc();
            }
        }
        let mut owners = owners.clone();
        let mut global = global;
        for (issue, v) in views {
            let (mut charged, mut held) = (v.charged, v.held_closeout);
            if v.lifecycle.is_terminal() && held > 0 {
                // the command is closed: its unused closeout headroom goes back
                let usage = Usage {
                    command: charged,
                    held_closeout: held,
                    owner: owners.get(&v.client_id).copied().unwrap_or(0),
                    global,
                    free_space: 0,
                };
                if let Ok(after) = release_closeout(&usage) {
                    charged = after.command;
                    held = after.held_closeout;
                    owners.insert(v.client_id.clone(), after.owner);
                    global = after.global;
                }
            }
            tx.prepare_cached(
                "UPDATE commands SET last_event_seq = ?2, charged_bytes = ?3, output_charged = ?4,
                     closeout_held = ?5 WHERE issue_uuid = ?1",
            )
            .and_then(|mut st| {
                st.execute(params![
                    issue.as_slice(),
                    to_i64(v.last_seq),
                    to_i64(charged),
                    to_i64(v.output_charged),
                    to_i64(held)
                ])
            })
            .map_err(|e| StoreError::sqlite("update command", e))?;
            if v.lifecycle.is_terminal() {
                insert_tombstone(&tx, issue, v, now_ms, tombstone_cap)?;
            }
        }
        for (client, used) in &owners {
            tx.prepare_cached("UPDATE clients SET charged_bytes = ?2 WHERE client_id = ?1")
                .and_then(|mut st| st.execute(params![client, to_i64(*used)]))
                .map_err(|e| StoreError::sqlite("update client usage", e))?;
        }
        crate::store::set_global_charged(&tx, global)?;
        // the durable "verified at seal" fact, only for exactly the bytes read back
        for (issue, ordinal, end) in verified {
            tx.prepare_cached(
                "UPDATE command_segments SET verified = 1
                 WHERE issue_uuid = ?1 AND ordinal = ?2 AND state = 'sealed' AND committed_end = ?3",
            )
            .and_then(|mut st| st.execute(params![issue.as_slice(), ordinal, to_i64(*end)]))
            .map_err(|e| StoreError::sqlite("record a verified seal", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit events", e))
    }
}

/// An event Reserve refused: logged, counted by tier, answered
/// `QUOTA_EXCEEDED` (transient).
fn quota_refused(
    metrics: &crate::metrics::StoreMetrics,
    refusal: &rvbox_retention::Refusal,
    how: &str,
) -> EventOutcome {
    tracing::warn!(tier = refusal.tier.name(), how, "event refused by quota");
    metrics
        .quota_refusals
        .get_or_create(&crate::metrics::TierLabel {
            tier: refusal.tier.name(),
        })
        .inc();
    refuse(Code::QuotaExceeded, refusal.to_string())
}

/// Why an output (or diagnostics) event refused at `tier` is dropped with a marker
/// instead, or `None` when it stays refused: the command's own total is
/// held by data that cannot rotate (the append path already rotated what
/// it could), or the client's (the server's) quota is, with no terminal
/// command to evict and no sealed output of an active command to rotate
/// (what maintenance would do).
fn drop_cause(
    tx: &Transaction<'_>,
    tier: rvbox_retention::Tier,
    client: &str,
) -> Result<Option<RotationCause>, StoreError> {
    let relievable = |scope: Option<&str>| -> Result<bool, StoreError> {
        cached_row(
            tx,
            "SELECT EXISTS (SELECT 1 FROM commands c
                 WHERE (?1 IS NULL OR c.client_id = ?1) AND c.retention = 'retained'
                   AND NOT EXISTS (SELECT 1 FROM storage_incidents i
                                   WHERE i.state = 1 AND i.issue_uuid = c.issue_uuid)
                   AND (c.terminal_time_ms IS NOT NULL
                        OR EXISTS (SELECT 1 FROM command_segments s
                                   WHERE s.issue_uuid = c.issue_uuid AND s.state = 'sealed')))",
            params![scope],
            |r| r.get::<_, bool>(0),
        )
        .map_err(|e| StoreError::sqlite("look for relief under quota", e))
    };
    crate::retention::drop_cause_of(tier, client, relievable)
}

/// Whether a truncation row of output dropped on arrival for `cause` ends
/// at `seq`.
fn drop_row_ends_at(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    seq: u64,
    cause: RotationCause,
) -> Result<bool, StoreError> {
    cached_row(
        tx,
        "SELECT EXISTS (SELECT 1 FROM output_truncations
             WHERE issue_uuid = ?1 AND last_seq = ?2 AND source = ?3 AND reason = ?4)",
        params![
            issue.as_slice(),
            to_i64(seq),
            cause.source() as i32,
            cause.drop_reason()
        ],
        |r| r.get::<_, bool>(0),
    )
    .map_err(|e| StoreError::sqlite("find a dropped range", e))
}

/// Whether `seq` is output dropped on arrival (no row; a truncation row
/// covers it).
fn dropped_at(tx: &Transaction<'_>, issue: &[u8; 16], seq: u64) -> Result<bool, StoreError> {
    cached_row(
        tx,
        "SELECT EXISTS (SELECT 1 FROM output_truncations
             WHERE issue_uuid = ?1 AND first_seq <= ?2 AND last_seq >= ?2)",
        params![issue.as_slice(), to_i64(seq)],
        |r| r.get::<_, bool>(0),
    )
    .map_err(|e| StoreError::sqlite("find a dropped event", e))
}

/// Writes the truncation row of an event dropped on arrival: a new
/// one, or the one of the same cause ending just before it, extended.
fn record_dropped(
    tx: &Transaction<'_>,
    p: &PendingEvent,
    d: Dropped,
    now_ms: i64,
) -> Result<(), StoreError> {
    let reason = d.cause.drop_reason();
    let changed = if d.new_row {
        tx.prepare_cached(
            "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
                 source, reason, recorded_ms, stream_mask)
             VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6, ?7, NULLIF(?8, 0))",
        )
        .and_then(|mut st| {
            st.execute(params![
                p.issue.as_slice(),
                to_i64(p.seq),
                to_i64(p.raw_len),
                to_i64(p.stored_len),
                d.cause.source() as i32,
                reason,
                now_ms,
                i64::from(p.stream)
            ])
        })
    } else {
        tx.prepare_cached(
            "UPDATE output_truncations SET last_seq = ?2, raw_bytes = raw_bytes + ?3,
                 stored_bytes = stored_bytes + ?4,
                 stream_mask = NULLIF(COALESCE(stream_mask, 0) | ?5, 0)
             WHERE issue_uuid = ?1 AND last_seq = ?6 AND source = ?7 AND reason = ?8",
        )
        .and_then(|mut st| {
            st.execute(params![
                p.issue.as_slice(),
                to_i64(p.seq),
                to_i64(p.raw_len),
                to_i64(p.stored_len),
                i64::from(p.stream),
                to_i64(p.seq.saturating_sub(1)),
                d.cause.source() as i32,
                reason
            ])
        })
    }
    .map_err(|e| StoreError::sqlite("record dropped output", e))?;
    if changed != 1 {
        return Err(StoreError::Integrity(format!(
            "dropped output at event_seq {}: {changed} truncation rows written",
            p.seq
        )));
    }
    Ok(())
}

/// The command's active segment, if any: (ordinal, committed_end).
fn active_segment(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
) -> Result<Option<(u32, u64)>, StoreError> {
    cached_row(tx,
        "SELECT ordinal, committed_end FROM command_segments WHERE issue_uuid = ?1 AND state = 'active'",
        params![issue.as_slice()],
        |r| Ok((r.get::<_, u32>(0)?, to_u64(r.get(1)?))),
    )
    .optional()
    .map_err(|e| StoreError::sqlite("find active segment", e))
}

/// Inserts the replay tombstone in the same transaction as the terminal
/// state, then enforces the FIFO cap in that transaction too (plan §5.4: no
/// delete/insert gap).
fn insert_tombstone(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    v: &CmdView,
    now_ms: i64,
    cap: u64,
) -> Result<(), StoreError> {
    insert_tombstone_row(
        tx,
        issue,
        &v.request_hash,
        &v.client_id,
        v.lifecycle,
        now_ms,
        cap,
    )
}

/// Inserts a command's replay tombstone and enforces the FIFO cap, inside
/// the caller's transaction (the one recording the terminal state).
pub(crate) fn insert_tombstone_row(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    request_hash: &[u8],
    client_id: &str,
    lifecycle: Lifecycle,
    now_ms: i64,
    cap: u64,
) -> Result<(), StoreError> {
    tx.prepare_cached("INSERT INTO command_tombstones (issue_uuid, request_hash, client_id, lifecycle, terminal_ms)
         VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (issue_uuid) DO NOTHING").and_then(|mut st| st.execute(params![issue.as_slice(), request_hash, client_id, lifecycle.to_wire() as i32, now_ms]))
    .map_err(|e| StoreError::sqlite("insert tombstone", e))?;
    // the maintained count (migration 5), never a scan of the FIFO
    let count: i64 = cached_row(
        tx,
        "SELECT tombstones FROM quota_totals WHERE id = 1",
        [],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("read tombstone count", e))?;
    let drop = tombstones_to_drop(to_u64(count), cap);
    if drop > 0 {
        tx.prepare_cached("DELETE FROM command_tombstones WHERE seq IN (SELECT seq FROM command_tombstones ORDER BY seq LIMIT ?1)").and_then(|mut st| st.execute(params![to_i64(drop)]))
        .map_err(|e| StoreError::sqlite("trim tombstones", e))?;
    }
    Ok(())
}
