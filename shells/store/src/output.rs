//! Reading stored output back (plan §9.1 `GetOutput` and the history part of
//! `FollowCommand`; wire contract P-CT-036..049; spec-mapping R1).
//!
//! Two readers over the same stored history:
//!
//! - [`Store::get_output`] returns raw (decompressed) output bytes in event
//!   order, page by page. A page is bounded by `max_bytes` and may end
//!   inside an event; the opaque `next_page_token` (sealed with
//!   [`TokenCodec`], bound to the issue uuid and the stream selection)
//!   carries the command, the next event, the byte offset inside it and the
//!   snapshot boundary: the command's `last_event_seq` when the first page
//!   was read. Pages of one pass never go past that boundary, so appends
//!   between pages neither duplicate nor skip bytes; once a pass reaches its
//!   boundary, the token of a command that may still produce events
//!   continues after it with a fresh boundary (empty only when the command
//!   is terminal and its last event was covered).
//! - [`Store::events_after`] returns every client event after a follow
//!   cursor (output still compressed, as `FollowCommand` carries it), with
//!   the server's retention/storage-loss items before the events they
//!   precede, and an explicit [`CursorReset`] for a cursor ahead of the log.
//!
//! Removed output is never a silent gap: an output event inside a range of
//! `output_truncations` (rotation or storage loss) is not read; instead the
//! range is reported once, before the first event at or after its start —
//! and again at the start of a page or batch whose resume point lies inside
//! it (the resume point was removed, P-CT-049). Every record read from a
//! segment is verified (header and record CRCs with [`record_limits`], the
//! header against the event row, bounded decompression, SHA-256 of the raw
//! bytes against the row's `content_sha256`); a record that fails is an
//! error naming the event, never skipped, and the caller re-verifies the
//! command with [`Store::reverify_command`] so that the loss is recorded
//! (truncation rows and an incident) and later reads report it. Inline bodies are checked against
//! their row digest the same way.
//!
//! Both readers run inside one read transaction (a consistent view of the
//! metadata) and allocate only bounded amounts per record.

use crate::db::Cached as _;
use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, Row, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::limits::{DEFAULT_OUTPUT_PAGE_BYTES, MAX_OUTPUT_PAGE_BYTES};
use rvbox_domain::token::{OutputPosition, TokenCodec, TokenKey, TokenKind, encode_filters};
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Kind, Stream, decode, encoded_len, sha256};

use crate::error::StoreError;
use crate::events::body_kind;
use crate::fs::SegmentFile;
use crate::mutations::OpError;
use crate::store::{Store, record_limits};

/// Most items (data, markers, retention) in one `GetOutput` page.
pub const MAX_PAGE_ITEMS: usize = 4096;
/// Most event rows one `GetOutput` page examines (lifecycle, diagnostics
/// and removed output cost no bytes but still take time); the page then
/// ends with a token at the next row.
pub const MAX_PAGE_SCAN_ROWS: u64 = 65_536;
/// Most client events one [`Store::events_after`] batch returns.
pub const MAX_HISTORY_EVENTS: usize = 1024;
/// A history batch stops once its event bodies reach this many bytes.
pub const MAX_HISTORY_BYTES: u64 = 4 * 1024 * 1024;
/// Segment files one read keeps open at once.
const MAX_OPEN_FILES: usize = 16;

/// Stream-selection bits (equal to the on-disk stream codes).
const STDOUT_BIT: u8 = 1;
const STDERR_BIT: u8 = 2;
const BOTH: u8 = STDOUT_BIT | STDERR_BIT;

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

/// A validated `GetOutputRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputQuery {
    /// The command.
    pub issue_uuid: Uuid7,
    /// Selected streams: bit 1 stdout, bit 2 stderr.
    pub stream_mask: u8,
    /// Raw data bytes the page may hold (1..=4 MiB; 0 on the wire = 1 MiB).
    pub max_bytes: u64,
    /// The page token, when one was given.
    pub page_token: Option<String>,
}

fn invalid(field: &str, reason: impl AsRef<str>) -> DomainError {
    DomainError::new(Code::InvalidArgument, reason).with_field(field)
}

/// Validates a `GetOutputRequest`: canonical UUIDv7 `issue_uuid`, 1..=2
/// distinct streams sorted ascending (never UNSPECIFIED), `max_bytes` in
/// 1..=4 MiB with 0 meaning the 1 MiB default. `request_id` is ignored (a
/// read). The token is only checked by [`Store::get_output`], which holds
/// the key.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the field.
pub fn check_get_output(req: &wire::GetOutputRequest) -> Result<OutputQuery, DomainError> {
    let issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)?;
    if req.streams.is_empty() || req.streams.len() > 2 {
        return Err(invalid(
            "streams",
            format!(
                "select 1 or 2 streams (STDOUT, STDERR); got {}",
                req.streams.len()
            ),
        ));
    }
    let mut mask = 0u8;
    let mut previous = 0i32;
    for s in &req.streams {
        let bit = match wire::OutputStream::try_from(*s) {
            Ok(wire::OutputStream::Stdout) => STDOUT_BIT,
            Ok(wire::OutputStream::Stderr) => STDERR_BIT,
            _ => {
                return Err(invalid(
                    "streams",
                    format!("stream value {s} is not STDOUT or STDERR"),
                ));
            }
        };
        if *s <= previous {
            return Err(invalid(
                "streams",
                "streams must be distinct and sorted ascending",
            ));
        }
        previous = *s;
        mask |= bit;
    }
    let max_bytes = match u64::from(req.max_bytes) {
        0 => DEFAULT_OUTPUT_PAGE_BYTES,
        n if n > MAX_OUTPUT_PAGE_BYTES => {
            return Err(invalid(
                "max_bytes",
                format!("max_bytes {n} is above the limit of {MAX_OUTPUT_PAGE_BYTES}"),
            ));
        }
        n => n,
    };
    Ok(OutputQuery {
        issue_uuid,
        stream_mask: mask,
        max_bytes,
        page_token: (!req.page_token.is_empty()).then(|| req.page_token.clone()),
    })
}

/// The filters an output token is bound to: the command and the stream
/// selection (the page size may change between pages).
#[must_use]
pub fn output_filters(issue: &[u8; 16], stream_mask: u8) -> Vec<u8> {
    encode_filters(&[
        ("issue_uuid", issue.as_slice()),
        ("streams", &[stream_mask]),
    ])
}

// ---------------------------------------------------------------------------
// Items
// ---------------------------------------------------------------------------

/// A server-side removal of sequenced output (an `output_truncations` row):
/// retention rotation or storage loss. Never sequenced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedRange {
    /// Why it was removed.
    pub source: wire::TruncationSource,
    /// First removed event (inclusive).
    pub first_seq: u64,
    /// Last removed event (inclusive).
    pub last_seq: u64,
    /// Streams that lost bytes (bit 1 stdout, bit 2 stderr); both when the
    /// row does not say and no removed event row tells.
    pub stream_mask: u8,
    /// Exact removed raw bytes, when known.
    pub raw_bytes: Option<u64>,
    /// Exact removed stored bytes, when known.
    pub stored_bytes: Option<u64>,
    /// When the server recorded the removal (Unix ms).
    pub recorded_ms: i64,
    /// Operator-readable reason.
    pub reason: String,
    /// The storage incident of a `STORAGE_LOSS`.
    pub incident_id: Option<[u8; 16]>,
}

impl RemovedRange {
    /// The wire form.
    #[must_use]
    pub fn to_wire(&self) -> wire::RetentionTruncation {
        wire::RetentionTruncation {
            source: self.source as i32,
            first_event_seq: self.first_seq,
            last_event_seq: self.last_seq,
            streams: streams_of(self.stream_mask),
            raw_bytes: self.raw_bytes,
            stored_bytes: self.stored_bytes,
            recorded_time: Some(timestamp(self.recorded_ms)),
            reason: self.reason.clone(),
            incident_id: self
                .incident_id
                .map(|id| uuid::Uuid::from_bytes(id).hyphenated().to_string()),
        }
    }

    fn covers(&self, seq: u64) -> bool {
        self.first_seq <= seq && seq <= self.last_seq
    }
}

/// A follow cursor the server cannot serve because it is ahead of the log
/// (spec-mapping R1): the stream continues after `resumed_after_event_seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorReset {
    /// The cursor asked for.
    pub requested_after_event_seq: u64,
    /// Where the history continues after (the command's last event).
    pub resumed_after_event_seq: u64,
    /// Operator-readable explanation.
    pub reason: String,
}

impl CursorReset {
    /// The wire form.
    #[must_use]
    pub fn to_wire(&self) -> wire::CursorReset {
        wire::CursorReset {
            requested_after_event_seq: self.requested_after_event_seq,
            resumed_after_event_seq: self.resumed_after_event_seq,
            reason: self.reason.clone(),
        }
    }
}

/// The stored body of one client event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryBody {
    /// Output, as stored (verified): `stored` is the payload the client sent.
    Output {
        /// Stdout or stderr.
        stream: Stream,
        /// How `stored` is encoded.
        compression: Compression,
        /// Raw length.
        raw_len: u32,
        /// Stored bytes.
        stored: Vec<u8>,
    },
    /// Any other body: `kind` is the `CommandEvent.body` field number
    /// ([`body_kind`]) and `encoded` the encoded message.
    Inline {
        /// Body field number.
        kind: u8,
        /// Encoded body.
        encoded: Vec<u8>,
    },
}

/// One client event of the history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryEvent {
    /// Wire sequence.
    pub event_seq: u64,
    /// Client-observed time (Unix ms).
    pub observed_ms: i64,
    /// Server receipt time (Unix ms).
    pub receipt_ms: i64,
    /// Body.
    pub body: HistoryBody,
}

impl HistoryEvent {
    /// The wire form (`ReceivedEvent`); output travels zstd-encoded, so a
    /// chunk the client stored uncompressed is compressed here.
    ///
    /// # Errors
    /// [`StoreError::Integrity`] when an inline body does not decode.
    pub fn to_wire(&self, issue: &Uuid7) -> Result<wire::ReceivedEvent, StoreError> {
        let body = match &self.body {
            HistoryBody::Output {
                stream,
                compression,
                raw_len,
                stored,
            } => {
                let payload = match compression {
                    Compression::Zstd => stored.clone(),
                    Compression::None => zstd::bulk::compress(stored, 1)
                        .map_err(|e| StoreError::io("compress output for the wire", "", e))?,
                };
                wire::command_event::Body::Output(wire::OutputChunk {
                    stream: i32::from(stream.as_u8()),
                    stored_length: u32::try_from(payload.len()).unwrap_or(u32::MAX),
                    payload,
                    raw_length: *raw_len,
                })
            }
            HistoryBody::Inline { kind, encoded } => decode_inline(self.event_seq, *kind, encoded)?,
        };
        Ok(received(
            issue,
            self.event_seq,
            self.observed_ms,
            self.receipt_ms,
            body,
        ))
    }
}

/// One item of a [`Store::events_after`] batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryItem {
    /// A sequenced client event: the only item that advances a cursor.
    Event(HistoryEvent),
    /// Server retention/storage-loss metadata for the events it precedes
    /// (or for the range the cursor points into). Not sequenced.
    Retention(RemovedRange),
    /// The cursor was ahead of the log.
    Reset(CursorReset),
    /// The batch reached the command's last event: history is complete up
    /// to `last_event_seq`; the follower switches to live events. (No wire
    /// item; a batch that stopped at its limit does not end with this.)
    CaughtUp {
        /// The command's last event at the time of the read.
        last_event_seq: u64,
    },
}

impl HistoryItem {
    /// The wire `FollowCommand` item; `None` for [`HistoryItem::CaughtUp`].
    ///
    /// # Errors
    /// As [`HistoryEvent::to_wire`].
    pub fn to_wire(
        &self,
        issue: &Uuid7,
    ) -> Result<Option<wire::FollowCommandResponse>, StoreError> {
        use wire::follow_command_response::Item;
        let item = match self {
            Self::Event(e) => Item::Event(e.to_wire(issue)?),
            Self::Retention(r) => Item::Retention(r.to_wire()),
            Self::Reset(r) => Item::Reset(r.to_wire()),
            Self::CaughtUp { .. } => return Ok(None),
        };
        Ok(Some(wire::FollowCommandResponse { item: Some(item) }))
    }
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn u64_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn streams_of(mask: u8) -> Vec<i32> {
    let mask = if mask & BOTH == 0 { BOTH } else { mask & BOTH };
    let mut out = Vec::with_capacity(2);
    if mask & STDOUT_BIT != 0 {
        out.push(wire::OutputStream::Stdout as i32);
    }
    if mask & STDERR_BIT != 0 {
        out.push(wire::OutputStream::Stderr as i32);
    }
    out
}

fn mask_of(streams: &[i32]) -> u8 {
    streams.iter().fold(0u8, |m, s| match *s {
        1 => m | STDOUT_BIT,
        2 => m | STDERR_BIT,
        _ => m,
    })
}

fn integrity(issue: &[u8; 16], seq: u64, what: impl std::fmt::Display) -> StoreError {
    StoreError::Integrity(format!(
        "stored output of command {} event {seq} failed verification: {what}",
        uuid::Uuid::from_bytes(*issue).hyphenated()
    ))
}

fn received(
    issue: &Uuid7,
    seq: u64,
    observed_ms: i64,
    receipt_ms: i64,
    body: wire::command_event::Body,
) -> wire::ReceivedEvent {
    wire::ReceivedEvent {
        event: Some(wire::CommandEvent {
            issue_uuid: issue.to_string(),
            event_seq: seq,
            observed_time: Some(timestamp(observed_ms)),
            body: Some(body),
        }),
        receipt_time: Some(timestamp(receipt_ms)),
    }
}

/// Decodes an inline body into its `CommandEvent` member.
fn decode_inline(
    seq: u64,
    kind: u8,
    encoded: &[u8],
) -> Result<wire::command_event::Body, StoreError> {
    use wire::command_event::Body;
    let bad = |e: prost::DecodeError| {
        StoreError::Integrity(format!(
            "stored body of event {seq} (kind {kind}) does not decode: {e}"
        ))
    };
    Ok(match kind {
        body_kind::LIFECYCLE => {
            Body::Lifecycle(wire::LifecycleChange::decode(encoded).map_err(bad)?)
        }
        body_kind::TRUNCATION => {
            Body::Truncation(wire::OutputTruncation::decode(encoded).map_err(bad)?)
        }
        body_kind::INCOMPLETE => {
            Body::Incomplete(wire::OutputIncomplete::decode(encoded).map_err(bad)?)
        }
        body_kind::SIGNAL_RESULT => {
            Body::SignalResult(wire::SignalResult::decode(encoded).map_err(bad)?)
        }
        body_kind::STDIN_ACK => Body::StdinAck(wire::StdinAck::decode(encoded).map_err(bad)?),
        body_kind::DIAGNOSTICS => {
            Body::Diagnostics(wire::Diagnostics::decode(encoded).map_err(bad)?)
        }
        body_kind::PROFILE_RESULT => {
            Body::ProfileResult(wire::ProfileResult::decode(encoded).map_err(bad)?)
        }
        other => {
            return Err(StoreError::Integrity(format!(
                "stored event {seq} has unknown body kind {other}"
            )));
        }
    })
}

// ---------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------

/// A command as the output readers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputCommand {
    /// Its last stored event.
    pub last_event_seq: u64,
    /// Whether it ended.
    pub terminal: bool,
}

/// Where the output read rules (the pages of `GetOutput`, the history of
/// `FollowCommand`, removed ranges and resume points) find their rows and
/// bytes: one implementation of the rules, one source per store backend.
/// The SQLite store's source reads its database and segment files; the
/// PostgreSQL store's reads its tables and output chunks. A source reads
/// one snapshot for the whole read.
pub trait OutputSource {
    /// The command (`NOT_FOUND`, saying whether its history was reclaimed,
    /// when it is gone or being reclaimed).
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    fn command(&mut self, issue: &Uuid7) -> Result<OutputCommand, OpError>;
    /// Event rows with sequences in `[first, last]`, in order, at most
    /// `limit`; inline bodies of every kind with `all_bodies`, else only of
    /// output markers.
    ///
    /// # Errors
    /// A store failure.
    fn events(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        all_bodies: bool,
        limit: usize,
    ) -> Result<Vec<EventRow>, StoreError>;
    /// The removed range containing `seq` (the one starting last at or
    /// before it), or with `after` the first starting after it.
    ///
    /// # Errors
    /// A store failure.
    fn removed(
        &mut self,
        issue: &[u8; 16],
        seq: u64,
        after: bool,
    ) -> Result<Option<RemovedRow>, StoreError>;
    /// The streams of the output events in `[first, last]` (bit 1 stdout,
    /// bit 2 stderr; 0 when there are none).
    ///
    /// # Errors
    /// A store failure.
    fn output_streams(&mut self, issue: &[u8; 16], first: u64, last: u64)
    -> Result<u8, StoreError>;
    /// The first event in `[first, last]` that is not output.
    ///
    /// # Errors
    /// A store failure.
    fn first_non_output(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<Option<u64>, StoreError>;
    /// The first (or with `last_one` the last) output event in `[first,
    /// last]` of a stream in `sel`.
    ///
    /// # Errors
    /// A store failure.
    fn output_event(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        sel: u8,
        last_one: bool,
    ) -> Result<Option<u64>, StoreError>;
    /// An output event's bytes, read back and verified against its row.
    ///
    /// # Errors
    /// [`StoreError::Integrity`] naming the event when they fail.
    fn output(&mut self, issue: &[u8; 16], row: &EventRow) -> Result<Verified, StoreError>;
}

/// Rows a source returns per call while a read walks the events.
const EVENT_ROWS_PER_FETCH: usize = 512;

fn load_command(conn: &Connection, issue: &Uuid7) -> Result<OutputCommand, OpError> {
    let row: Option<(i64, i64, String)> = conn
        .query_row_cached(
            "SELECT last_event_seq, lifecycle, retention FROM commands WHERE issue_uuid = ?1",
            params![issue.as_bytes().as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("load command for output", e))?;
    match row {
        Some((last, lifecycle, retention)) => output_command(issue, last, lifecycle, &retention),
        None => {
            let reclaimed: bool = conn
                .query_row_cached(
                    "SELECT EXISTS (SELECT 1 FROM command_tombstones WHERE issue_uuid = ?1)",
                    params![issue.as_bytes().as_slice()],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::sqlite("check tombstone", e))?;
            Err(missing_command(issue, reclaimed))
        }
    }
}

/// A command row as the output readers see it (`NOT_FOUND` while its
/// history is being reclaimed). Every source reads a command so.
///
/// # Errors
/// `NOT_FOUND` while retention reclaims it.
pub fn output_command(
    issue: &Uuid7,
    last_event_seq: i64,
    lifecycle: i64,
    retention: &str,
) -> Result<OutputCommand, OpError> {
    if retention != "retained" {
        return Err(DomainError::new(
            Code::NotFound,
            "the command's history is being reclaimed by retention",
        )
        .with_field("issue_uuid")
        .with_issue(*issue)
        .into());
    }
    Ok(OutputCommand {
        last_event_seq: u64_of(last_event_seq),
        terminal: Lifecycle::from_wire(i32::try_from(lifecycle).unwrap_or(0))
            .is_ok_and(Lifecycle::is_terminal),
    })
}

/// The refusal for a command with no row: reclaimed (it has a tombstone)
/// or never known.
#[must_use]
pub fn missing_command(issue: &Uuid7, reclaimed: bool) -> OpError {
    let reason = if reclaimed {
        "the command's history was reclaimed by retention"
    } else {
        "no such command"
    };
    DomainError::new(Code::NotFound, reason)
        .with_field("issue_uuid")
        .with_issue(*issue)
        .into()
}

/// One `command_events` row.
#[derive(Debug, Clone)]
pub struct EventRow {
    /// Sequence.
    pub seq: u64,
    /// Client-observed time (Unix ms).
    pub observed_ms: i64,
    /// Server receipt time (Unix ms).
    pub receipt_ms: i64,
    /// Body kind.
    pub kind: u8,
    /// Stream code of output.
    pub stream: u8,
    /// Raw length.
    pub raw_len: u64,
    /// Stored length.
    pub stored_len: u64,
    /// Content SHA-256.
    pub digest: Vec<u8>,
    /// Where a segment holds the output record (SQLite store).
    pub segment: Option<(u32, u64)>,
    /// The inline body, when fetched.
    pub inline: Option<Vec<u8>>,
}

/// Event rows in `[?2, ?3]`, at most `?5`; `inline_body` only for the
/// kinds `?4` selects (`0` = all, else output markers only), so skipped
/// bodies are never fetched.
const EVENTS_SQL: &str = "SELECT event_seq, observed_ms, receipt_ms, body_kind, stream, raw_len,
        stored_len, content_sha256, segment_ordinal, segment_offset,
        CASE WHEN ?4 = 0 OR body_kind IN (6, 7) THEN inline_body END
     FROM command_events WHERE issue_uuid = ?1 AND event_seq >= ?2 AND event_seq <= ?3
     ORDER BY event_seq LIMIT ?5";

fn event_row(r: &Row<'_>) -> rusqlite::Result<EventRow> {
    let ordinal: Option<u32> = r.get(8)?;
    let offset: Option<i64> = r.get(9)?;
    Ok(EventRow {
        seq: u64_of(r.get(0)?),
        observed_ms: r.get(1)?,
        receipt_ms: r.get(2)?,
        kind: r.get(3)?,
        stream: r.get(4)?,
        raw_len: u64_of(r.get(5)?),
        stored_len: u64_of(r.get(6)?),
        digest: r.get(7)?,
        segment: ordinal.zip(offset.map(u64_of)),
        inline: r.get(10)?,
    })
}

const REMOVED_COLUMNS: &str = "source, first_seq, last_seq, stream_mask, raw_bytes, stored_bytes,
        recorded_ms, reason, incident_id";

/// One removed range as stored: source, first and last sequence, stream
/// mask, raw and stored bytes, when, reason, incident.
pub type RemovedRow = (
    i32,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    i64,
    String,
    Option<Vec<u8>>,
);

fn removed_row(r: &Row<'_>) -> rusqlite::Result<RemovedRow> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
    ))
}

/// Walks a command's removed ranges (non-overlapping, ordered by start) in
/// step with an event walk, fetching one row at a time from the source.
struct RemovedWalk {
    issue: [u8; 16],
    next: Option<RemovedRange>,
    current: Option<RemovedRange>,
}

impl RemovedWalk {
    /// Starts at the range containing `seq`, or the first one after it.
    fn new(src: &mut dyn OutputSource, issue: [u8; 16], seq: u64) -> Result<Self, StoreError> {
        let mut walk = Self {
            issue,
            next: None,
            current: None,
        };
        walk.next = match walk.containing(src, seq)? {
            Some(r) => Some(r),
            None => walk.first_after(src, seq)?,
        };
        Ok(walk)
    }

    fn fetch(
        &self,
        src: &mut dyn OutputSource,
        seq: u64,
        after: bool,
    ) -> Result<Option<RemovedRange>, StoreError> {
        let Some((source, first, last, mask, raw, stored, recorded, reason, incident)) =
            src.removed(&self.issue, seq, after)?
        else {
            return Ok(None);
        };
        let (first_seq, last_seq) = (u64_of(first), u64_of(last));
        let mask = match mask.and_then(|m| u8::try_from(m & i64::from(BOTH)).ok()) {
            Some(m) if m != 0 => m,
            // the streams of the output events it removed; both when none
            // tells
            _ => match src.output_streams(&self.issue, first_seq, last_seq)? & BOTH {
                0 => BOTH,
                m => m,
            },
        };
        Ok(Some(RemovedRange {
            source: wire::TruncationSource::try_from(source)
                .unwrap_or(wire::TruncationSource::Unspecified),
            first_seq,
            last_seq,
            stream_mask: mask,
            raw_bytes: raw.map(u64_of),
            stored_bytes: stored.map(u64_of),
            recorded_ms: recorded,
            reason,
            incident_id: incident.and_then(|b| <[u8; 16]>::try_from(b.as_slice()).ok()),
        }))
    }

    fn containing(
        &self,
        src: &mut dyn OutputSource,
        seq: u64,
    ) -> Result<Option<RemovedRange>, StoreError> {
        Ok(self.fetch(src, seq, false)?.filter(|r| r.last_seq >= seq))
    }

    fn first_after(
        &self,
        src: &mut dyn OutputSource,
        seq: u64,
    ) -> Result<Option<RemovedRange>, StoreError> {
        self.fetch(src, seq, true)
    }

    /// The ranges that start at or before `seq` and were not passed yet,
    /// in order (each becomes the current range).
    fn advance_to(
        &mut self,
        src: &mut dyn OutputSource,
        seq: u64,
    ) -> Result<Vec<RemovedRange>, StoreError> {
        let mut out = Vec::new();
        while let Some(next) = self.next.take() {
            if next.first_seq > seq {
                self.next = Some(next);
                break;
            }
            self.next = self.first_after(src, next.last_seq)?;
            out.push(next.clone());
            self.current = Some(next);
        }
        Ok(out)
    }

    /// Where the next range not passed yet starts.
    fn next_start(&self) -> Option<u64> {
        self.next.as_ref().map(|r| r.first_seq)
    }

    /// Whether `seq` (already advanced to) lies in a removed range.
    fn covers(&self, seq: u64) -> bool {
        self.current.as_ref().is_some_and(|r| r.covers(seq))
    }
}

// ---------------------------------------------------------------------------
// Verified segment reads
// ---------------------------------------------------------------------------

/// An output record read back and verified.
#[derive(Debug)]
pub struct Verified {
    /// Its stream.
    pub stream: Stream,
    /// How `stored` is encoded.
    pub compression: Compression,
    /// Raw length.
    pub raw_len: u32,
    /// The bytes as stored.
    pub stored: Vec<u8>,
    /// The raw bytes.
    pub raw: Vec<u8>,
}

struct SegmentReader<'s> {
    store: &'s ReadSide<'s>,
    issue: [u8; 16],
    files: BTreeMap<u32, (Box<dyn SegmentFile>, u64)>,
    dctx: zstd::bulk::Decompressor<'static>,
}

impl<'s> SegmentReader<'s> {
    fn new(store: &'s ReadSide<'s>) -> Result<Self, StoreError> {
        Ok(Self {
            store,
            issue: [0; 16],
            files: BTreeMap::new(),
            dctx: zstd::bulk::Decompressor::new()
                .map_err(|e| StoreError::io("create zstd context", "", e))?,
        })
    }

    fn path(&self, ordinal: u32) -> Result<PathBuf, StoreError> {
        self.store
            .layout
            .segment_path(&self.issue, ordinal)
            .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))
    }

    /// The open file of a segment and its committed end.
    fn file(&mut self, seq: u64, ordinal: u32) -> Result<&(Box<dyn SegmentFile>, u64), StoreError> {
        if !self.files.contains_key(&ordinal) {
            let row: Option<(i64, String)> = self
                .store
                .conn
                .prepare_cached(
                    "SELECT committed_end, state FROM command_segments
                     WHERE issue_uuid = ?1 AND ordinal = ?2",
                )
                .and_then(|mut st| {
                    st.query_row(params![self.issue.as_slice(), ordinal], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })
                    .optional()
                })
                .map_err(|e| StoreError::sqlite("read segment row", e))?;
            let (committed, state) = row.ok_or_else(|| {
                integrity(
                    &self.issue,
                    seq,
                    format_args!("segment {ordinal} has no row"),
                )
            })?;
            if state == "rotated" {
                return Err(integrity(
                    &self.issue,
                    seq,
                    format_args!("segment {ordinal} was rotated but no truncation covers it"),
                ));
            }
            let path = self.path(ordinal)?;
            let file = self
                .store
                .fs
                .open(&path)
                .map_err(|e| StoreError::io("open segment for reading", &path, e))?;
            if self.files.len() >= MAX_OPEN_FILES {
                self.files.pop_first();
            }
            self.files.insert(ordinal, (file, u64_of(committed)));
        }
        self.files
            .get(&ordinal)
            .ok_or_else(|| integrity(&self.issue, seq, format_args!("segment {ordinal} not open")))
    }

    /// Reads and verifies the record of an output event of `issue`.
    fn read(&mut self, issue: &[u8; 16], row: &EventRow) -> Result<Verified, StoreError> {
        if *issue != self.issue {
            self.files.clear();
            self.issue = *issue;
        }
        let issue = self.issue;
        let seq = row.seq;
        let fail = |what: &dyn std::fmt::Display| integrity(&issue, seq, what);
        let (ordinal, offset) = row
            .segment
            .ok_or_else(|| fail(&"output event has no segment reference"))?;
        let limits = record_limits();
        let stored_len = u32::try_from(row.stored_len)
            .ok()
            .filter(|n| *n <= limits.max_stored_len)
            .ok_or_else(|| fail(&"stored length above the record limit"))?;
        let raw_len = u32::try_from(row.raw_len)
            .ok()
            .filter(|n| *n <= limits.max_raw_len)
            .ok_or_else(|| fail(&"raw length above the record limit"))?;
        let want_stream =
            Stream::from_u8(row.stream).ok_or_else(|| fail(&"unknown stream code"))?;
        let record_len = encoded_len(stored_len);
        let path = self.path(ordinal)?;
        let (file, committed) = self.file(seq, ordinal)?;
        if offset
            .checked_add(record_len)
            .is_none_or(|end| end > *committed)
        {
            return Err(fail(&format_args!(
                "record at {ordinal}:{offset} lies beyond the segment's committed end"
            )));
        }
        // bounded: record_len <= 132 + max_stored_len (checked above)
        let mut buf = vec![0u8; usize::try_from(record_len).unwrap_or(0)];
        file.read_exact_at(&mut buf, offset)
            .map_err(|e| StoreError::io("read output record", &path, e))?;
        let rec = decode(&buf, &limits)
            .map_err(|e| fail(&format_args!("record at {ordinal}:{offset}: {}", e.code())))?;
        let m = &rec.meta;
        if m.issue_uuid != issue
            || m.seq != seq
            || m.kind != Kind::Output
            || m.stream != want_stream
            || m.raw_len != raw_len
            || rec.payload.len() != stored_len as usize
            || m.sha256.as_slice() != row.digest.as_slice()
        {
            return Err(fail(&format_args!(
                "record at {ordinal}:{offset} does not match its event row"
            )));
        }
        let raw = match m.compression {
            Compression::None => rec.payload.to_vec(),
            // bounded: never more than the declared raw length
            Compression::Zstd => self
                .dctx
                .decompress(rec.payload, raw_len as usize)
                .map_err(|_| fail(&"payload does not decompress within its raw length"))?,
        };
        if raw.len() != raw_len as usize || sha256(&raw).as_slice() != row.digest.as_slice() {
            return Err(fail(&"SHA-256 of the raw bytes differs from the event row"));
        }
        Ok(Verified {
            stream: want_stream,
            compression: m.compression,
            raw_len,
            stored: rec.payload.to_vec(),
            raw,
        })
    }
}

/// The SQLite store's [`OutputSource`]: its database (the caller's read
/// transaction) and its segment files.
struct SqliteSource<'s> {
    conn: &'s Connection,
    segments: SegmentReader<'s>,
}

impl<'s> SqliteSource<'s> {
    fn new(side: &'s ReadSide<'s>) -> Result<Self, StoreError> {
        Ok(Self {
            conn: side.conn,
            segments: SegmentReader::new(side)?,
        })
    }

    fn probe(&self, sql: &str, p: impl rusqlite::Params) -> Result<Option<u64>, StoreError> {
        self.conn
            .prepare_cached(sql)
            .and_then(|mut st| st.query_row(p, |r| r.get::<_, i64>(0)).optional())
            .map(|v| v.map(u64_of))
            .map_err(|e| StoreError::sqlite("read output events", e))
    }
}

impl OutputSource for SqliteSource<'_> {
    fn command(&mut self, issue: &Uuid7) -> Result<OutputCommand, OpError> {
        load_command(self.conn, issue)
    }

    fn events(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        all_bodies: bool,
        limit: usize,
    ) -> Result<Vec<EventRow>, StoreError> {
        let bad = |e| StoreError::sqlite("read output events", e);
        let mut stmt = self.conn.prepare_cached(EVENTS_SQL).map_err(bad)?;
        let rows = stmt
            .query_map(
                params![
                    issue.as_slice(),
                    i64_of(first),
                    i64_of(last),
                    i64::from(!all_bodies),
                    i64_of(limit as u64)
                ],
                event_row,
            )
            .map_err(bad)?;
        rows.collect::<Result<Vec<_>, _>>().map_err(bad)
    }

    fn removed(
        &mut self,
        issue: &[u8; 16],
        seq: u64,
        after: bool,
    ) -> Result<Option<RemovedRow>, StoreError> {
        let sql = if after {
            format!(
                "SELECT {REMOVED_COLUMNS} FROM output_truncations
                 WHERE issue_uuid = ?1 AND first_seq IS NOT NULL AND first_seq > ?2
                 ORDER BY first_seq LIMIT 1"
            )
        } else {
            format!(
                "SELECT {REMOVED_COLUMNS} FROM output_truncations
                 WHERE issue_uuid = ?1 AND first_seq IS NOT NULL AND first_seq <= ?2
                 ORDER BY first_seq DESC LIMIT 1"
            )
        };
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut st| {
                st.query_row(params![issue.as_slice(), i64_of(seq)], removed_row)
                    .optional()
            })
            .map_err(|e| StoreError::sqlite("read output truncations", e))
    }

    fn output_streams(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<u8, StoreError> {
        let m: i64 = self
            .conn
            .prepare_cached(
                "SELECT COALESCE(MAX(stream = 1), 0) | (COALESCE(MAX(stream = 2), 0) << 1)
                 FROM command_events WHERE issue_uuid = ?1 AND event_seq >= ?2 AND event_seq <= ?3
                   AND body_kind = 4",
            )
            .and_then(|mut st| {
                st.query_row(
                    params![issue.as_slice(), i64_of(first), i64_of(last)],
                    |r| r.get(0),
                )
            })
            .map_err(|e| StoreError::sqlite("read removed streams", e))?;
        Ok(u8::try_from(m & i64::from(BOTH)).unwrap_or(0))
    }

    fn first_non_output(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.probe(
            "SELECT event_seq FROM command_events
             WHERE issue_uuid = ?1 AND event_seq >= ?2 AND event_seq <= ?3 AND body_kind <> 4
             ORDER BY event_seq LIMIT 1",
            params![issue.as_slice(), i64_of(first), i64_of(last)],
        )
    }

    fn output_event(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        sel: u8,
        last_one: bool,
    ) -> Result<Option<u64>, StoreError> {
        let sql = if last_one {
            "SELECT event_seq FROM command_events
             WHERE issue_uuid = ?1 AND event_seq >= ?2 AND event_seq <= ?3 AND body_kind = 4
               AND (stream & ?4) <> 0 ORDER BY event_seq DESC LIMIT 1"
        } else {
            "SELECT event_seq FROM command_events
             WHERE issue_uuid = ?1 AND event_seq >= ?2 AND event_seq <= ?3 AND body_kind = 4
               AND (stream & ?4) <> 0 ORDER BY event_seq LIMIT 1"
        };
        self.probe(
            sql,
            params![
                issue.as_slice(),
                i64_of(first),
                i64_of(last),
                i64::from(sel)
            ],
        )
    }

    fn output(&mut self, issue: &[u8; 16], row: &EventRow) -> Result<Verified, StoreError> {
        self.segments.read(issue, row)
    }
}

/// Checks an inline body against its row digest (`sha256(kind || body)`,
/// as the append path computed it) and returns it.
fn verified_inline<'r>(issue: &[u8; 16], row: &'r EventRow) -> Result<&'r [u8], StoreError> {
    let body = row
        .inline
        .as_deref()
        .ok_or_else(|| integrity(issue, row.seq, "event has no stored body"))?;
    let mut buf = Vec::with_capacity(body.len().saturating_add(1));
    buf.push(row.kind);
    buf.extend_from_slice(body);
    if sha256(&buf).as_slice() != row.digest.as_slice() {
        return Err(integrity(
            issue,
            row.seq,
            "SHA-256 of the stored body differs from the event row",
        ));
    }
    Ok(body)
}

// ---------------------------------------------------------------------------
// GetOutput
// ---------------------------------------------------------------------------

/// Where a page starts.
#[derive(Debug, Clone, Copy)]
struct Start {
    seq: u64,
    offset: u64,
    snapshot: u64,
}

fn bad_token(reason: &str) -> OpError {
    invalid("page_token", reason).into()
}

/// What the control reads need: a connection (the writer's or a
/// read-only one), the files, and the data directory's token key. Every
/// read runs in one read transaction, so it sees one committed snapshot.
pub(crate) struct ReadSide<'a> {
    pub(crate) conn: &'a Connection,
    pub(crate) fs: &'a dyn crate::fs::StoreFs,
    pub(crate) layout: &'a crate::layout::Layout,
    pub(crate) token_key: [u8; crate::identity::TOKEN_KEY_LEN],
}

impl Store {
    /// The read side over the writer's own connection.
    pub(crate) fn read_side(&self) -> ReadSide<'_> {
        ReadSide {
            conn: &self.conn,
            fs: self.fs.as_ref(),
            layout: &self.layout,
            token_key: self.token_key(),
        }
    }

    /// `GetOutput` on the writer's connection (see [`ReadSide::get_output`];
    /// the control plane reads through a [`StoreReader`](crate::StoreReader)).
    ///
    /// # Errors
    /// As [`StoreReader::get_output`](crate::StoreReader::get_output).
    pub fn get_output(
        &self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError> {
        self.read_side().get_output(req)
    }

    /// A command's stored history after an event (see
    /// [`StoreReader::events_after`](crate::StoreReader::events_after)).
    ///
    /// # Errors
    /// As [`StoreReader::events_after`](crate::StoreReader::events_after).
    pub fn events_after(
        &self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError> {
        self.read_side().events_after(issue, after_event_seq, limit)
    }
}

impl ReadSide<'_> {
    /// The codec of this data directory's tokens.
    fn output_codec(&self) -> TokenCodec {
        TokenCodec::new(TokenKey::new(self.token_key))
    }

    /// `GetOutput` (see [`output_page`]) on this store, in one read
    /// transaction.
    ///
    /// # Errors
    /// As [`output_page`].
    pub(crate) fn get_output(
        &self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError> {
        let tx = self
            .conn
            .unchecked_transaction()
            .map_err(|e| StoreError::sqlite("begin output read", e))?;
        let mut src = SqliteSource::new(self)?;
        let out = output_page(&mut src, &self.output_codec(), req);
        drop(tx);
        out
    }

    /// History for `FollowCommand` (see [`history`]) on this store, in one
    /// read transaction.
    ///
    /// # Errors
    /// As [`history`].
    pub(crate) fn events_after(
        &self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError> {
        let tx = self
            .conn
            .unchecked_transaction()
            .map_err(|e| StoreError::sqlite("begin history read", e))?;
        let mut src = SqliteSource::new(self)?;
        let out = history(&mut src, issue, after_event_seq, limit);
        drop(tx);
        out
    }
}

/// `GetOutput`: one page of a command's raw output (see the module
/// docs). Items come in event order: `Data` (raw bytes of one event of
/// a selected stream, or the part of it that fits, with its offset and
/// the observed and receipt times), `Marker` (the client's
/// `OutputTruncation`/`OutputIncomplete` events touching a selected
/// stream), and `Retention` (server removals touching a selected stream,
/// before the events they precede). `retained_range` is the first and
/// last event of a selected stream whose output is still held, up to the
/// snapshot boundary (`0, 0` when none is).
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad request or a refused `page_token`
/// (malformed, altered, from another data directory, another kind, or
/// other filters), `NOT_FOUND` for an unknown or reclaimed command, and
/// [`OpError::Store`] when the store failed or a stored record failed
/// verification.
pub fn output_page(
    src: &mut dyn OutputSource,
    codec: &TokenCodec,
    req: &wire::GetOutputRequest,
) -> Result<wire::GetOutputResponse, OpError> {
    let q = check_get_output(req)?;
    let issue = *q.issue_uuid.as_bytes();
    let filters = output_filters(&issue, q.stream_mask);
    let position = match &q.page_token {
        None => None,
        Some(t) => {
            let bytes = codec
                .open(TokenKind::Output, &filters, t)
                .map_err(DomainError::from)?;
            let p = OutputPosition::decode(&bytes).map_err(DomainError::from)?;
            if p.issue_uuid != issue {
                return Err(bad_token("page_token was issued for another command"));
            }
            Some(p)
        }
    };
    let cmd = src.command(&q.issue_uuid)?;
    let start = match position {
        None => Start {
            seq: 1,
            offset: 0,
            snapshot: cmd.last_event_seq,
        },
        Some(p) => {
            if p.event_seq == 0
                || p.snapshot_seq > cmd.last_event_seq
                || p.event_seq > cmd.last_event_seq.saturating_add(1)
                || (p.event_seq > p.snapshot_seq && p.byte_offset != 0)
            {
                return Err(bad_token(
                    "page_token does not match this command's stored history",
                ));
            }
            if p.event_seq > p.snapshot_seq {
                // the previous pass ended at its boundary: a new pass
                // starts after it with a fresh boundary
                Start {
                    seq: p.event_seq,
                    offset: 0,
                    snapshot: cmd.last_event_seq,
                }
            } else {
                Start {
                    seq: p.event_seq,
                    offset: p.byte_offset,
                    snapshot: p.snapshot_seq,
                }
            }
        }
    };
    let page = read_page(src, &q, start)?;
    let retained = retained_range(src, &issue, start.snapshot, q.stream_mask)?;
    let next_page_token = match page.resume {
        Some((seq, offset)) => seal(codec, &filters, &issue, seq, offset, start.snapshot)?,
        None if cmd.terminal && start.snapshot >= cmd.last_event_seq => String::new(),
        None => seal(codec, &filters, &issue, page.continue_at, 0, start.snapshot)?,
    };
    Ok(wire::GetOutputResponse {
        items: page.items,
        retained_range: Some(retained),
        next_page_token,
    })
}

fn read_page(src: &mut dyn OutputSource, q: &OutputQuery, start: Start) -> Result<Page, OpError> {
    use wire::output_item::Item;
    let issue = *q.issue_uuid.as_bytes();
    let sel = q.stream_mask;
    let mut page = Page {
        items: Vec::new(),
        resume: None,
        continue_at: start.seq,
    };
    if start.seq > start.snapshot {
        return Ok(page);
    }
    let mut removed = RemovedWalk::new(src, issue, start.seq)?;
    let mut budget = q.max_bytes;
    let mut scanned = 0u64;
    let mut next = start.seq;
    'rows: loop {
        let batch = src.events(&issue, next, start.snapshot, false, EVENT_ROWS_PER_FETCH)?;
        let fetched = batch.len();
        for row in batch {
            next = row.seq.saturating_add(1);
            let offset = if row.seq == start.seq {
                start.offset
            } else {
                0
            };
            if budget == 0 || page.items.len() >= MAX_PAGE_ITEMS || scanned >= MAX_PAGE_SCAN_ROWS {
                page.resume = Some((row.seq, offset));
                break 'rows;
            }
            scanned += 1;
            for range in removed.advance_to(src, row.seq)? {
                if range.stream_mask & sel != 0 {
                    page.items.push(wire::OutputItem {
                        item: Some(Item::Retention(range.to_wire())),
                    });
                }
            }
            match row.kind {
                body_kind::OUTPUT => {
                    if removed.covers(row.seq) || row.stream & sel == 0 {
                        continue;
                    }
                    let v = src.output(&issue, &row)?;
                    let len = v.raw.len() as u64;
                    if len == 0 {
                        continue; // an empty chunk holds no bytes to return
                    }
                    if offset >= len {
                        return Err(bad_token(
                            "page_token points past the end of its event's output",
                        ));
                    }
                    let take = budget.min(len - offset);
                    let end = offset.saturating_add(take);
                    let data = v
                        .raw
                        .get(
                            usize::try_from(offset).unwrap_or(usize::MAX)
                                ..usize::try_from(end).unwrap_or(usize::MAX),
                        )
                        .map(<[u8]>::to_vec)
                        .ok_or_else(|| integrity(&issue, row.seq, "output slice out of range"))?;
                    page.items.push(wire::OutputItem {
                        item: Some(Item::Data(wire::OutputData {
                            event_seq: row.seq,
                            stream: i32::from(v.stream.as_u8()),
                            offset: u32::try_from(offset).unwrap_or(u32::MAX),
                            data,
                            observed_time: Some(timestamp(row.observed_ms)),
                            receipt_time: Some(timestamp(row.receipt_ms)),
                        })),
                    });
                    budget -= take;
                    if end < len {
                        page.resume = Some((row.seq, end));
                        break 'rows;
                    }
                }
                body_kind::TRUNCATION | body_kind::INCOMPLETE => {
                    if offset != 0 {
                        return Err(bad_token(
                            "page_token points inside an event without output bytes",
                        ));
                    }
                    let body = verified_inline(&issue, &row)?;
                    let decoded = decode_inline(row.seq, row.kind, body)?;
                    let mask = match &decoded {
                        wire::command_event::Body::Truncation(t) => mask_of(&t.streams),
                        wire::command_event::Body::Incomplete(i) => mask_of(&i.streams),
                        _ => 0,
                    };
                    // a marker naming no known stream concerns every stream
                    if mask == 0 || mask & sel != 0 {
                        page.items.push(wire::OutputItem {
                            item: Some(Item::Marker(received(
                                &q.issue_uuid,
                                row.seq,
                                row.observed_ms,
                                row.receipt_ms,
                                decoded,
                            ))),
                        });
                    }
                }
                _ => {}
            }
        }
        if fetched < EVENT_ROWS_PER_FETCH {
            break;
        }
    }
    if page.resume.is_none() {
        // ranges after the last row read, up to the pass's boundary: no
        // row follows them to bring them up (rotated and dropped events
        // keep no row), so they are reported here, as many as the page
        // holds; the next page starts at the first one left
        while let Some(first) = removed.next_start().filter(|f| *f <= start.snapshot) {
            if page.items.len() >= MAX_PAGE_ITEMS {
                page.resume = Some((first, 0));
                break;
            }
            for range in removed.advance_to(src, first)? {
                if range.stream_mask & sel != 0 {
                    page.items.push(wire::OutputItem {
                        item: Some(Item::Retention(range.to_wire())),
                    });
                }
            }
        }
    }
    // never resume inside a removed range this page already reported
    // (that would report it again): skip its removed output events
    page.resume = match page.resume {
        Some((seq, 0)) => Some((resume_point(src, &removed, seq)?, 0)),
        other => other,
    };
    page.continue_at = resume_point(src, &removed, start.snapshot.saturating_add(1))?;
    Ok(page)
}

/// History for `FollowCommand`: the client events after
/// `after_event_seq`, in order, at most `limit` of them (clamped to
/// 1..=[`MAX_HISTORY_EVENTS`], and the batch also stops once its bodies
/// reach [`MAX_HISTORY_BYTES`]). Output bodies are the stored bytes
/// (verified, still compressed); other bodies are the stored encoded
/// messages (verified against their digest).
///
/// Server removals come as [`HistoryItem::Retention`] right before the
/// first event at or after their start; a removed output event itself is
/// not returned (its range says what was lost), and a cursor inside a
/// removed range gets that range first. Retention items never move the
/// cursor: the caller continues after the last [`HistoryItem::Event`].
/// A cursor ahead of the log gets a [`HistoryItem::Reset`] naming where
/// the history continues. A batch that reached the command's last event
/// ends with [`HistoryItem::CaughtUp`].
///
/// # Errors
/// `NOT_FOUND` for an unknown or reclaimed command; [`OpError::Store`]
/// when the store failed or a stored record failed verification.
pub fn history(
    src: &mut dyn OutputSource,
    issue: &[u8; 16],
    after_event_seq: u64,
    limit: usize,
) -> Result<Vec<HistoryItem>, OpError> {
    let id = Uuid7::from_bytes("issue_uuid", *issue).map_err(DomainError::from)?;
    let limit = limit.clamp(1, MAX_HISTORY_EVENTS);
    let cmd = src.command(&id)?;
    let last = cmd.last_event_seq;
    let mut items = Vec::new();
    if after_event_seq > last {
        items.push(HistoryItem::Reset(CursorReset {
                requested_after_event_seq: after_event_seq,
                resumed_after_event_seq: last,
                reason: format!(
                    "the cursor {after_event_seq} is ahead of the command's stored events (last {last}); continuing after {last}"
                ),
            }));
        items.push(HistoryItem::CaughtUp {
            last_event_seq: last,
        });
        return Ok(items);
    }
    let first = after_event_seq.saturating_add(1);
    let mut removed = RemovedWalk::new(src, *issue, first)?;
    let (mut events, mut bytes, mut stopped) = (0usize, 0u64, false);
    let mut next = first;
    'rows: loop {
        let batch = src.events(issue, next, last, true, EVENT_ROWS_PER_FETCH)?;
        let fetched = batch.len();
        for row in batch {
            next = row.seq.saturating_add(1);
            if events >= limit || bytes >= MAX_HISTORY_BYTES {
                stopped = true;
                break 'rows;
            }
            for range in removed.advance_to(src, row.seq)? {
                items.push(HistoryItem::Retention(range));
            }
            let body = if row.kind == body_kind::OUTPUT {
                if removed.covers(row.seq) {
                    continue;
                }
                let v = src.output(issue, &row)?;
                bytes = bytes.saturating_add(v.stored.len() as u64);
                HistoryBody::Output {
                    stream: v.stream,
                    compression: v.compression,
                    raw_len: v.raw_len,
                    stored: v.stored,
                }
            } else {
                let body = verified_inline(issue, &row)?.to_vec();
                bytes = bytes.saturating_add(body.len() as u64);
                HistoryBody::Inline {
                    kind: row.kind,
                    encoded: body,
                }
            };
            items.push(HistoryItem::Event(HistoryEvent {
                event_seq: row.seq,
                observed_ms: row.observed_ms,
                receipt_ms: row.receipt_ms,
                body,
            }));
            events += 1;
        }
        if fetched < EVENT_ROWS_PER_FETCH {
            break;
        }
    }
    if !stopped {
        for range in removed.advance_to(src, last)? {
            items.push(HistoryItem::Retention(range));
        }
        items.push(HistoryItem::CaughtUp {
            last_event_seq: last,
        });
    }
    Ok(items)
}

#[derive(Debug)]
struct Page {
    items: Vec<wire::OutputItem>,
    /// Where the next page starts when this one stopped early.
    resume: Option<(u64, u64)>,
    /// Where the next pass starts when this page reached the boundary.
    continue_at: u64,
}

/// `seq`, or when it lies inside the removed range the walk reported
/// last, the first event after it that the range did not remove (an
/// inline event inside the range, or the event after the range).
fn resume_point(
    src: &mut dyn OutputSource,
    walk: &RemovedWalk,
    seq: u64,
) -> Result<u64, StoreError> {
    let Some(range) = walk.current.as_ref().filter(|r| r.covers(seq)) else {
        return Ok(seq);
    };
    let inline = src.first_non_output(&walk.issue, seq, range.last_seq)?;
    Ok(inline.unwrap_or(range.last_seq.saturating_add(1)))
}

fn seal(
    codec: &TokenCodec,
    filters: &[u8],
    issue: &[u8; 16],
    event_seq: u64,
    byte_offset: u64,
    snapshot_seq: u64,
) -> Result<String, OpError> {
    let position = OutputPosition {
        issue_uuid: *issue,
        event_seq,
        byte_offset,
        snapshot_seq,
    };
    codec
        .seal(TokenKind::Output, filters, &position.encode())
        .map_err(|e| StoreError::Integrity(format!("sealing an output token failed: {e}")).into())
}

/// First and last event of a selected stream at or below `snapshot` whose
/// output is still held (`0, 0` when none is). Each step jumps a whole
/// removed range, so the cost is bounded by the number of ranges.
fn retained_range(
    src: &mut dyn OutputSource,
    issue: &[u8; 16],
    snapshot: u64,
    sel: u8,
) -> Result<wire::RetainedRange, StoreError> {
    let none = wire::RetainedRange {
        first_event_seq: 0,
        last_event_seq: 0,
    };
    let walk = RemovedWalk {
        issue: *issue,
        next: None,
        current: None,
    };
    let mut cur = 1u64;
    let first = loop {
        let Some(e) = src.output_event(issue, cur, snapshot, sel, false)? else {
            return Ok(none);
        };
        match walk.containing(src, e)? {
            Some(r) => cur = r.last_seq.saturating_add(1),
            None => break e,
        }
    };
    let mut cur = snapshot;
    let last = loop {
        let Some(e) = src.output_event(issue, first, cur, sel, true)? else {
            break first;
        };
        match walk.containing(src, e)? {
            Some(r) => cur = r.first_seq.saturating_sub(1),
            None => break e,
        }
    };
    Ok(wire::RetainedRange {
        first_event_seq: first,
        last_event_seq: last,
    })
}
