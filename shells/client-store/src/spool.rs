//! The spool's durable steps (plan §7.1-§7.2): the client store performs
//! what the spool core ([`rvbox_client_core::spool`]) asks for.
//!
//! - An output chunk is compressed as one zstd frame with its content size
//!   and checksum, written as one record of the shared segment format to
//!   the command's spool segment, synced, and only then indexed in the
//!   transaction that moves the segment's committed end (the server's
//!   committed-offset discipline). An event body is small and kept in the
//!   metadata row.
//! - An assignment gives a run of entries their wire sequences in one
//!   transaction, and a release deletes what a cumulative acknowledgement
//!   covers, with the spool segments it leaves empty.
//! - A rotation deletes one spool segment and its entries and writes the
//!   `CLIENT_SPOOL` markers that replace them, in one transaction.
//! - Sending reads events back by sequence and verifies every output
//!   record (record CRC, zstd frame, SHA-256 of the raw bytes) before it
//!   leaves; a record that fails is never sent.

use std::collections::BTreeMap;

use prost::Message as _;
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use rvbox_client_core::spool::{
    AppendItem, RestoredCommand, RestoredEntry, RestoredItem, SpoolCompletion, SpoolOp,
};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::MAX_RAW_CHUNK_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_segment::{Compression, Kind, Limits, RecordMeta, Stream, decode, segment_file_name};
use rvbox_storage::StoreError;
use rvbox_storage::db::Cached as _;
use rvbox_storage::fs::SegmentFile;

use crate::crash;
use crate::store::ClientStore;

/// zstd level of spooled output. Level 1 compresses log text faster than
/// level 3 and, for 64 KiB chunks, about as well (9.6x against 8.2x on the
/// benchmark's log text, `docs/benchmarks.md`).
pub const ZSTD_LEVEL: i32 = 1;
/// Most spool segment files kept open at once.
pub const MAX_OPEN_SEGMENTS: usize = 64;
/// Most events one read-back returns.
pub const MAX_READ_EVENTS: u64 = 1024;
/// Longest encoded event body kept in a metadata row.
pub const MAX_EVENT_BODY_BYTES: usize = 64 * 1024;

/// Record limits of a spool segment: one raw chunk and its zstd bound.
#[must_use]
pub fn spool_limits() -> Limits {
    let raw = u32::try_from(MAX_RAW_CHUNK_BYTES).unwrap_or(u32::MAX);
    Limits {
        max_stored_len: raw.saturating_add(raw / 64).saturating_add(1024),
        max_raw_len: raw,
    }
}

/// Open spool segment files, by command and ordinal.
#[derive(Debug, Default)]
pub(crate) struct OpenSegments {
    files: BTreeMap<([u8; 16], u32), Box<dyn SegmentFile>>,
}

impl OpenSegments {
    pub(crate) fn forget(&mut self, issue: &[u8; 16], segment: u32) {
        self.files.remove(&(*issue, segment));
    }

    pub(crate) fn forget_command(&mut self, issue: &[u8; 16]) {
        self.files.retain(|(i, _), _| i != issue);
    }
}

fn wire_stream(s: Stream) -> wire::OutputStream {
    match s {
        Stream::Stdout => wire::OutputStream::Stdout,
        Stream::Stderr => wire::OutputStream::Stderr,
        Stream::None => wire::OutputStream::Unspecified,
    }
}

fn record_stream(s: wire::OutputStream) -> Stream {
    match s {
        wire::OutputStream::Stdout => Stream::Stdout,
        wire::OutputStream::Stderr => Stream::Stderr,
        wire::OutputStream::Unspecified => Stream::None,
    }
}

/// The oneof tag of a body (the `kind` column).
fn body_kind(b: &Body) -> i64 {
    match b {
        Body::Output(_) => 4,
        Body::Lifecycle(_) => 5,
        Body::Truncation(_) => 6,
        Body::Incomplete(_) => 7,
        Body::SignalResult(_) => 8,
        Body::StdinAck(_) => 9,
        Body::Diagnostics(_) => 10,
        Body::ProfileResult(_) => 11,
    }
}

fn encode_body(b: &Body) -> Vec<u8> {
    wire::CommandEvent {
        body: Some(b.clone()),
        ..Default::default()
    }
    .encode_to_vec()
}

fn decode_body(bytes: &[u8]) -> Result<Body, StoreError> {
    wire::CommandEvent::decode(bytes)
        .ok()
        .and_then(|e| e.body)
        .ok_or_else(|| StoreError::Integrity("a spooled event body does not decode".into()))
}

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

/// One sequenced entry as read back for sending.
struct SentRow {
    seq: u64,
    ordinal: i64,
    observed_ms: i64,
    stream: i32,
    raw_len: u32,
    sha: Vec<u8>,
    segment: Option<u32>,
    offset: Option<i64>,
    body: Option<Vec<u8>>,
}

/// The store's zstd contexts, made once and reused for every chunk (a
/// fresh context per chunk costs more than compressing a small one).
#[derive(Default)]
pub(crate) struct Codec {
    compressor: Option<zstd::bulk::Compressor<'static>>,
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec").finish_non_exhaustive()
    }
}

impl Codec {
    /// One zstd frame with its content size and checksum.
    fn frame(&mut self, raw: &[u8]) -> std::io::Result<Vec<u8>> {
        let c = match &mut self.compressor {
            Some(c) => c,
            None => {
                let mut c = zstd::bulk::Compressor::new(ZSTD_LEVEL)?;
                c.set_parameter(zstd::stream::raw::CParameter::ChecksumFlag(true))?;
                c.set_parameter(zstd::stream::raw::CParameter::ContentSizeFlag(true))?;
                self.compressor.insert(c)
            }
        };
        c.compress(raw)
    }

    /// The raw bytes of one frame, at most `capacity` of them.
    fn unframe(&mut self, frame: &[u8], capacity: usize) -> std::io::Result<Vec<u8>> {
        let d = match &mut self.decompressor {
            Some(d) => d,
            None => self.decompressor.insert(zstd::bulk::Decompressor::new()?),
        };
        d.decompress(frame, capacity)
    }
}

impl ClientStore {
    /// Performs one durable step of the spool and says how it ended. A
    /// failure is logged (never with payload bytes), counted, and reported
    /// as [`SpoolCompletion::Failed`]; nothing of the step is durable then.
    pub fn perform_spool(&mut self, op: &SpoolOp, now_ms: i64) -> SpoolCompletion {
        let result = match op {
            SpoolOp::Append {
                issue,
                ordinal,
                observed_ms,
                item,
                ..
            } => self
                .spool_append(issue, *ordinal, *observed_ms, item, now_ms)
                .map(|stored| match stored {
                    Some(stored_len) => SpoolCompletion::AppendedOutput { stored_len },
                    None => SpoolCompletion::Done,
                }),
            SpoolOp::Assign {
                issue,
                ordinals,
                first_seq,
                ..
            } => self
                .spool_assign(issue, ordinals, *first_seq)
                .map(|()| SpoolCompletion::Done),
            SpoolOp::Release {
                issue, upto_seq, ..
            } => self
                .spool_release(issue, *upto_seq)
                .map(|()| SpoolCompletion::Done),
            SpoolOp::Rotate {
                issue,
                segment,
                removed,
                markers,
                ..
            } => self
                .spool_rotate(issue, *segment, removed, markers)
                .map(|()| SpoolCompletion::Done),
            SpoolOp::PersistLoss {
                issue,
                marker_ordinal,
                run,
                ..
            } => self
                .record_loss_run(issue, *marker_ordinal, run)
                .map(|()| SpoolCompletion::Done),
        };
        match result {
            Ok(done) => done,
            Err(e) => {
                self.metrics.spool_failures.inc();
                tracing::error!(error = %e, "spool step failed");
                self.record_spool_failure(&[op.issue()], &e, now_ms);
                SpoolCompletion::Failed
            }
        }
    }

    /// Records an open loss run's totals on its command, unless an entry
    /// at or after the run's marker ordinal was appended since (that entry
    /// closed the run, and nothing is left to record). One autocommit
    /// statement.
    fn record_loss_run(
        &mut self,
        issue: &Uuid7,
        marker_ordinal: u64,
        run: &wire::OutputTruncation,
    ) -> Result<(), StoreError> {
        self.conn
            .execute_cached(
                "UPDATE commands SET loss_run = ?2 WHERE issue_uuid = ?1 AND next_ordinal <= ?3",
                params![
                    issue.as_bytes().as_slice(),
                    run.encode_to_vec(),
                    i64_of(marker_ordinal)
                ],
            )
            .map_err(|e| StoreError::sqlite("record loss run", e))?;
        self.hook.at(crash::SPOOL_LOSS_AFTER_COMMIT);
        Ok(())
    }

    /// plan §7.2 (R-7.2-13): a spool write that failed leaves the
    /// commands it concerned unaccountable, so local health turns dirty
    /// with one open incident per command (best effort: the store that
    /// just failed may refuse this too, which is logged).
    fn record_spool_failure(&mut self, issues: &[Uuid7], e: &StoreError, now_ms: i64) {
        let os = match e {
            StoreError::Io { source, .. } => Some(source.kind()),
            _ => None,
        };
        let full = os == Some(std::io::ErrorKind::StorageFull)
            || matches!(e, StoreError::Sqlite { source, .. }
                if source.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull));
        let kind = if full {
            wire::IncidentKind::DiskExhaustion
        } else if os == Some(std::io::ErrorKind::PermissionDenied) {
            wire::IncidentKind::PermissionError
        } else {
            wire::IncidentKind::SqliteIntegrityFailure
        };
        for issue in issues {
            let incident = crate::incidents::NewLocalIncident {
                kind,
                scope_kind: wire::ScopeKind::Command,
                scope_key: issue.to_string(),
                summary: format!(
                    "a spool write for command {issue} failed; the step is tried again, and if it keeps failing the command's output is incomplete and it ends interrupted"
                ),
                evidence: e.to_string().into_bytes(),
            };
            if let Err(e2) =
                crate::incidents::record(&self.conn, self.entropy.as_ref(), &incident, now_ms)
            {
                tracing::error!(%issue, error = %e2, "the spool failure could not be recorded as an incident");
            }
        }
    }

    fn segment_file(
        &mut self,
        issue: &[u8; 16],
        segment: u32,
        committed_end: Option<u64>,
    ) -> Result<&mut Box<dyn SegmentFile>, StoreError> {
        let key = (*issue, segment);
        if !self.open_segments.files.contains_key(&key) {
            if self.open_segments.files.len() >= MAX_OPEN_SEGMENTS
                && let Some(first) = self.open_segments.files.keys().next().copied()
            {
                self.open_segments.files.remove(&first);
            }
            let name = segment_file_name(issue, segment).ok_or_else(|| {
                StoreError::Integrity("spool segment ordinal out of range".into())
            })?;
            let dir = self.layout().spool_dir();
            let path = dir.join(name);
            let file = match committed_end {
                Some(_) => self
                    .fs
                    .open(&path)
                    .map_err(|e| StoreError::io("open spool segment", &path, e))?,
                None => {
                    // a file without a row is debris of an uncommitted append
                    match self.fs.remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(StoreError::io("remove stale segment", &path, e)),
                    }
                    let f = self
                        .fs
                        .create_new(&path)
                        .map_err(|e| StoreError::io("create spool segment", &path, e))?;
                    self.hook.at(crash::SPOOL_SEGMENT_AFTER_CREATE);
                    self.fs
                        .sync_dir(&dir)
                        .map_err(|e| StoreError::io("sync spool directory", &dir, e))?;
                    f
                }
            };
            self.open_segments.files.insert(key, file);
        }
        self.open_segments
            .files
            .get_mut(&key)
            .ok_or_else(|| StoreError::Integrity("spool segment vanished".into()))
    }

    /// Appends one entry; returns the stored length of an output chunk.
    fn spool_append(
        &mut self,
        issue: &Uuid7,
        ordinal: u64,
        observed_ms: i64,
        item: &AppendItem,
        now_ms: i64,
    ) -> Result<Option<u32>, StoreError> {
        let mut out = self.append_group(&[(issue, ordinal, observed_ms, item)], now_ms)?;
        Ok(out.pop().flatten())
    }

    /// Performs a run of consecutive spool appends (of any commands) as one
    /// durable group: every output record is written to its segment, each
    /// touched segment is synced once, and one transaction indexes every
    /// entry and moves every committed end. Answers each op in order; a
    /// failure fails the whole group (nothing of it is durable).
    pub fn perform_spool_appends(&mut self, ops: &[&SpoolOp], now_ms: i64) -> Vec<SpoolCompletion> {
        let items: Vec<(&Uuid7, u64, i64, &AppendItem)> = ops
            .iter()
            .filter_map(|op| match op {
                SpoolOp::Append {
                    issue,
                    ordinal,
                    observed_ms,
                    item,
                    ..
                } => Some((issue, *ordinal, *observed_ms, item)),
                _ => None,
            })
            .collect();
        if items.len() != ops.len() {
            // not a run of appends: perform them one by one
            return ops
                .iter()
                .map(|op| self.perform_spool(op, now_ms))
                .collect();
        }
        match self.append_group(&items, now_ms) {
            Ok(stored) => stored
                .into_iter()
                .map(|s| match s {
                    Some(stored_len) => SpoolCompletion::AppendedOutput { stored_len },
                    None => SpoolCompletion::Done,
                })
                .collect(),
            Err(e) => {
                self.metrics.spool_failures.inc();
                tracing::error!(error = %e, entries = items.len(), "spool append group failed");
                let mut issues: Vec<Uuid7> = items.iter().map(|(i, ..)| **i).collect();
                issues.sort_unstable();
                issues.dedup();
                self.record_spool_failure(&issues, &e, now_ms);
                vec![SpoolCompletion::Failed; items.len()]
            }
        }
    }

    fn append_group(
        &mut self,
        items: &[(&Uuid7, u64, i64, &AppendItem)],
        now_ms: i64,
    ) -> Result<Vec<Option<u32>>, StoreError> {
        /// One entry ready for its index row.
        struct Row {
            key: [u8; 16],
            ordinal: u64,
            observed_ms: i64,
            kind: i64,
            stream: i32,
            raw_len: u32,
            stored_len: u32,
            sha: [u8; 32],
            place: Option<(u32, u64)>,
            body: Option<Vec<u8>>,
        }
        let mut rows: Vec<Row> = Vec::with_capacity(items.len());
        // per segment: (committed end before the group, end after it)
        let mut ends: BTreeMap<([u8; 16], u32), (Option<u64>, u64)> = BTreeMap::new();
        let hook = self.hook.clone();
        let mut outputs = false;
        let mut events = false;
        for (issue, ordinal, observed_ms, item) in items {
            let key = *issue.as_bytes();
            match item {
                AppendItem::Event(body) => {
                    events = true;
                    let bytes = encode_body(body);
                    if bytes.len() > MAX_EVENT_BODY_BYTES {
                        return Err(StoreError::Integrity(format!(
                            "an event body of {} bytes is over {MAX_EVENT_BODY_BYTES}",
                            bytes.len()
                        )));
                    }
                    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                    rows.push(Row {
                        key,
                        ordinal: *ordinal,
                        observed_ms: *observed_ms,
                        kind: body_kind(body),
                        stream: 0,
                        raw_len: len,
                        stored_len: len,
                        sha: rvbox_segment::sha256(&bytes),
                        place: None,
                        body: Some(bytes),
                    });
                }
                AppendItem::Output {
                    stream,
                    segment,
                    bytes,
                } => {
                    outputs = true;
                    let raw_len = u32::try_from(bytes.len())
                        .ok()
                        .filter(|n| u64::from(*n) <= MAX_RAW_CHUNK_BYTES && *n > 0)
                        .ok_or_else(|| {
                            StoreError::Integrity(format!(
                                "an output chunk of {} bytes is outside 1..={MAX_RAW_CHUNK_BYTES}",
                                bytes.len()
                            ))
                        })?;
                    let sha = rvbox_segment::sha256(bytes);
                    let stored = self
                        .codec
                        .frame(bytes)
                        .map_err(|e| StoreError::io("compress output", "", e))?;
                    let meta = RecordMeta {
                        issue_uuid: key,
                        seq: *ordinal,
                        observed_unix_ms: *observed_ms,
                        receipt_unix_ms: now_ms,
                        kind: Kind::Output,
                        stream: record_stream(*stream),
                        compression: Compression::Zstd,
                        raw_len,
                        sha256: sha,
                    };
                    let record = rvbox_segment::encode(&meta, &stored, &spool_limits())
                        .map_err(|e| StoreError::Integrity(format!("encode spool record: {e}")))?;
                    let stored_len = u32::try_from(stored.len()).unwrap_or(u32::MAX);
                    let seg = (key, *segment);
                    let (committed, offset) = match ends.get(&seg) {
                        Some((c, end)) => (*c, *end),
                        None => {
                            let c: Option<i64> = self
                                .conn
                                .query_row_cached(
                                    "SELECT committed_end FROM segments
                                     WHERE issue_uuid = ?1 AND kind = 1 AND ordinal = ?2",
                                    params![key.as_slice(), segment],
                                    |r| r.get(0),
                                )
                                .optional()
                                .map_err(|e| StoreError::sqlite("read spool segment", e))?;
                            let c = c.map(u64_of);
                            let file = self.segment_file(&key, *segment, c)?;
                            let at = c.unwrap_or(0);
                            let len = file
                                .len()
                                .map_err(|e| StoreError::io("stat spool segment", "", e))?;
                            if len != at {
                                // a tail of an append whose commit never happened
                                file.truncate(at)
                                    .map_err(|e| StoreError::io("cut spool tail", "", e))?;
                            }
                            (c, at)
                        }
                    };
                    // the file exists now (opened or created above)
                    let file = self.segment_file(&key, *segment, Some(offset))?;
                    file.append(&record)
                        .map_err(|e| StoreError::io("write spool record", "", e))?;
                    ends.insert(seg, (committed, offset.saturating_add(record.len() as u64)));
                    rows.push(Row {
                        key,
                        ordinal: *ordinal,
                        observed_ms: *observed_ms,
                        kind: 4,
                        stream: *stream as i32,
                        raw_len,
                        stored_len,
                        sha,
                        place: Some((*segment, offset)),
                        body: None,
                    });
                }
            }
        }
        if outputs {
            hook.at(crash::SPOOL_APPEND_BEFORE_FSYNC);
            for (key, segment) in ends.keys() {
                let file = self.segment_file(key, *segment, Some(0))?;
                file.sync_data()
                    .map_err(|e| StoreError::io("sync spool segment", "", e))?;
            }
            hook.at(crash::SPOOL_APPEND_AFTER_FSYNC);
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin spool append", e))?;
        let mut stored_total: i64 = 0;
        for r in &rows {
            match (&r.place, &r.body) {
                (Some((segment, offset)), _) => {
                    tx.execute_cached(
                        "INSERT INTO spool_entries (issue_uuid, local_ordinal, kind, stream,
                             observed_ms, raw_len, stored_len, payload_sha256, segment_ordinal,
                             segment_offset)
                         VALUES (?1, ?2, 4, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                        params![
                            r.key.as_slice(),
                            i64_of(r.ordinal),
                            r.stream,
                            r.observed_ms,
                            r.raw_len,
                            r.stored_len,
                            r.sha.as_slice(),
                            segment,
                            i64_of(*offset)
                        ],
                    )
                    .map_err(|e| StoreError::sqlite("insert spool output", e))?;
                    stored_total = stored_total.saturating_add(i64::from(r.stored_len));
                }
                (None, body) => {
                    tx.execute_cached(
                        "INSERT INTO spool_entries (issue_uuid, local_ordinal, kind, stream,
                             observed_ms, raw_len, stored_len, payload_sha256, body)
                         VALUES (?1, ?2, ?3, 0, ?4, ?5, ?5, ?6, ?7)",
                        params![
                            r.key.as_slice(),
                            i64_of(r.ordinal),
                            r.kind,
                            r.observed_ms,
                            r.raw_len,
                            r.sha.as_slice(),
                            body
                        ],
                    )
                    .map_err(|e| StoreError::sqlite("insert spool event", e))?;
                }
            }
            // any entry closes the command's open loss run (its marker is
            // the first entry after the run), so what was recorded goes
            tx.execute_cached(
                "UPDATE commands SET next_ordinal = MAX(next_ordinal, ?2), loss_run = NULL
                 WHERE issue_uuid = ?1",
                params![r.key.as_slice(), i64_of(r.ordinal.saturating_add(1))],
            )
            .map_err(|e| StoreError::sqlite("advance ordinal", e))?;
        }
        for ((key, segment), (_, end)) in &ends {
            tx.execute_cached(
                "INSERT INTO segments (issue_uuid, ordinal, kind, committed_end)
                 VALUES (?1, ?2, 1, ?3)
                 ON CONFLICT (issue_uuid, kind, ordinal) DO UPDATE SET committed_end = ?3",
                params![key.as_slice(), segment, i64_of(*end)],
            )
            .map_err(|e| StoreError::sqlite("advance committed end", e))?;
        }
        if stored_total > 0 {
            tx.execute_cached(
                "UPDATE counters SET stored_bytes = stored_bytes + ?1 WHERE id = 1",
                params![stored_total],
            )
            .map_err(|e| StoreError::sqlite("charge spool bytes", e))?;
        }
        if events {
            self.hook.at(crash::SPOOL_EVENT_BEFORE_COMMIT);
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit spool append", e))?;
        if outputs {
            self.hook.at(crash::SPOOL_APPEND_AFTER_COMMIT);
        }
        if events {
            self.hook.at(crash::SPOOL_EVENT_AFTER_COMMIT);
        }
        Ok(rows.iter().map(|r| r.place.map(|_| r.stored_len)).collect())
    }

    fn spool_assign(
        &mut self,
        issue: &Uuid7,
        ordinals: &[u64],
        first_seq: u64,
    ) -> Result<(), StoreError> {
        let key = issue.as_bytes().as_slice();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin assignment", e))?;
        let mut seq = first_seq;
        for o in ordinals {
            let n = tx
                .execute_cached(
                    "UPDATE spool_entries SET event_seq = ?3
                     WHERE issue_uuid = ?1 AND local_ordinal = ?2 AND event_seq IS NULL",
                    params![key, i64_of(*o), i64_of(seq)],
                )
                .map_err(|e| StoreError::sqlite("assign sequence", e))?;
            if n != 1 {
                return Err(StoreError::Integrity(format!(
                    "entry {o} of {issue} is missing or already sequenced"
                )));
            }
            seq = seq.saturating_add(1);
        }
        tx.execute_cached(
            "UPDATE commands SET next_event_seq = ?2 WHERE issue_uuid = ?1",
            params![key, i64_of(seq)],
        )
        .map_err(|e| StoreError::sqlite("advance sequence", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit assignment", e))?;
        self.hook.at(crash::SPOOL_ASSIGN_AFTER_COMMIT);
        Ok(())
    }

    fn empty_segments(&self, key: &[u8]) -> Result<Vec<u32>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT s.ordinal FROM segments s WHERE s.issue_uuid = ?1 AND s.kind = 1
                 AND NOT EXISTS (SELECT 1 FROM spool_entries e
                     WHERE e.issue_uuid = s.issue_uuid AND e.segment_ordinal = s.ordinal)",
            )
            .map_err(|e| StoreError::sqlite("find empty segments", e))?;
        let rows = stmt
            .query_map(params![key], |r| r.get::<_, u32>(0))
            .map_err(|e| StoreError::sqlite("find empty segments", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("find empty segments", e))
    }

    pub(crate) fn remove_segment_files(&mut self, key: &[u8; 16], segments: &[u32]) {
        let dir = self.layout().spool_dir();
        for s in segments {
            self.open_segments.forget(key, *s);
            if let Some(name) = segment_file_name(key, *s) {
                let path = dir.join(name);
                match self.fs.remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    // recovery removes files without a row
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "could not remove a spool segment")
                    }
                }
            }
        }
    }

    fn spool_release(&mut self, issue: &Uuid7, upto_seq: u64) -> Result<(), StoreError> {
        let key = *issue.as_bytes();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin release", e))?;
        let freed: i64 = tx
            .query_row_cached(
                "SELECT COALESCE(SUM(stored_len), 0) FROM spool_entries
                 WHERE issue_uuid = ?1 AND event_seq <= ?2 AND segment_ordinal IS NOT NULL",
                params![key.as_slice(), i64_of(upto_seq)],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("sum released bytes", e))?;
        tx.execute_cached(
            "DELETE FROM spool_entries WHERE issue_uuid = ?1 AND event_seq <= ?2",
            params![key.as_slice(), i64_of(upto_seq)],
        )
        .map_err(|e| StoreError::sqlite("release entries", e))?;
        tx.execute_cached(
            "UPDATE commands SET acked_event_seq = MAX(acked_event_seq, ?2) WHERE issue_uuid = ?1",
            params![key.as_slice(), i64_of(upto_seq)],
        )
        .map_err(|e| StoreError::sqlite("record acknowledgement", e))?;
        tx.execute_cached(
            "UPDATE counters SET stored_bytes = stored_bytes - ?1 WHERE id = 1",
            params![freed],
        )
        .map_err(|e| StoreError::sqlite("release spool bytes", e))?;
        let empty = {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT s.ordinal FROM segments s WHERE s.issue_uuid = ?1 AND s.kind = 1
                     AND NOT EXISTS (SELECT 1 FROM spool_entries e
                         WHERE e.issue_uuid = s.issue_uuid AND e.segment_ordinal = s.ordinal)",
                )
                .map_err(|e| StoreError::sqlite("find empty segments", e))?;
            let rows = stmt
                .query_map(params![key.as_slice()], |r| r.get::<_, u32>(0))
                .map_err(|e| StoreError::sqlite("find empty segments", e))?;
            rows.collect::<Result<Vec<u32>, _>>()
                .map_err(|e| StoreError::sqlite("find empty segments", e))?
        };
        for s in &empty {
            tx.execute_cached(
                "DELETE FROM segments WHERE issue_uuid = ?1 AND kind = 1 AND ordinal = ?2",
                params![key.as_slice(), s],
            )
            .map_err(|e| StoreError::sqlite("remove empty segment", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit release", e))?;
        self.hook.at(crash::SPOOL_RELEASE_AFTER_COMMIT);
        self.remove_segment_files(&key, &empty);
        Ok(())
    }

    fn spool_rotate(
        &mut self,
        issue: &Uuid7,
        segment: u32,
        removed: &[u64],
        markers: &[(u64, i64, wire::OutputTruncation)],
    ) -> Result<(), StoreError> {
        let key = *issue.as_bytes();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin rotation", e))?;
        let pinned: i64 = tx
            .query_row_cached(
                "SELECT COUNT(*) FROM spool_entries
                 WHERE issue_uuid = ?1 AND segment_ordinal = ?2 AND event_seq IS NOT NULL",
                params![key.as_slice(), segment],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("check rotation", e))?;
        if pinned != 0 {
            return Err(StoreError::Integrity(format!(
                "segment {segment} of {issue} holds sequenced entries; it cannot rotate"
            )));
        }
        let freed: i64 = tx
            .query_row_cached(
                "SELECT COALESCE(SUM(stored_len), 0) FROM spool_entries
                 WHERE issue_uuid = ?1 AND segment_ordinal = ?2",
                params![key.as_slice(), segment],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("sum rotated bytes", e))?;
        tx.execute_cached(
            "DELETE FROM spool_entries WHERE issue_uuid = ?1 AND segment_ordinal = ?2",
            params![key.as_slice(), segment],
        )
        .map_err(|e| StoreError::sqlite("rotate entries", e))?;
        for o in removed {
            // every removed ordinal lay in the segment
            let gone: Option<i64> = tx
                .query_row_cached(
                    "SELECT 1 FROM spool_entries WHERE issue_uuid = ?1 AND local_ordinal = ?2",
                    params![key.as_slice(), i64_of(*o)],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("check rotated entry", e))?;
            if gone.is_some() {
                return Err(StoreError::Integrity(format!(
                    "entry {o} of {issue} is not in segment {segment}"
                )));
            }
        }
        for (ordinal, observed_ms, t) in markers {
            let body = Body::Truncation(t.clone());
            let bytes = encode_body(&body);
            let sha = rvbox_segment::sha256(&bytes);
            let len = i64_of(bytes.len() as u64);
            tx.execute_cached(
                "INSERT INTO spool_entries (issue_uuid, local_ordinal, kind, stream, observed_ms,
                     raw_len, stored_len, payload_sha256, body)
                 VALUES (?1, ?2, 6, 0, ?3, ?4, ?4, ?5, ?6)
                 ON CONFLICT (issue_uuid, local_ordinal) DO UPDATE SET
                     raw_len = excluded.raw_len, stored_len = excluded.stored_len,
                     payload_sha256 = excluded.payload_sha256, body = excluded.body
                 WHERE event_seq IS NULL AND segment_ordinal IS NULL",
                params![
                    key.as_slice(),
                    i64_of(*ordinal),
                    observed_ms,
                    len,
                    sha.as_slice(),
                    bytes
                ],
            )
            .map_err(|e| StoreError::sqlite("write spool marker", e))?;
        }
        tx.execute_cached(
            "DELETE FROM segments WHERE issue_uuid = ?1 AND kind = 1 AND ordinal = ?2",
            params![key.as_slice(), segment],
        )
        .map_err(|e| StoreError::sqlite("remove rotated segment", e))?;
        tx.execute_cached(
            "UPDATE counters SET stored_bytes = stored_bytes - ?1 WHERE id = 1",
            params![freed],
        )
        .map_err(|e| StoreError::sqlite("release rotated bytes", e))?;
        self.hook.at(crash::SPOOL_ROTATE_BEFORE_COMMIT);
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit rotation", e))?;
        self.hook.at(crash::SPOOL_ROTATE_AFTER_COMMIT);
        self.remove_segment_files(&key, &[segment]);
        Ok(())
    }

    /// The sequenced events `first_seq..=last_seq` of `issue` (at most
    /// [`MAX_READ_EVENTS`]), each output record verified before it is
    /// returned.
    ///
    /// # Errors
    /// [`StoreError::Integrity`] naming the entry when a record fails its
    /// checks or a sequence is missing; I/O and SQLite failures.
    pub fn read_events(
        &mut self,
        issue: &Uuid7,
        first_seq: u64,
        last_seq: u64,
    ) -> Result<Vec<wire::CommandEvent>, StoreError> {
        let key = *issue.as_bytes();
        let last = last_seq.min(first_seq.saturating_add(MAX_READ_EVENTS - 1));
        let rows: Vec<SentRow> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT event_seq, local_ordinal, observed_ms, stream, raw_len,
                         payload_sha256, segment_ordinal, segment_offset, body
                     FROM spool_entries WHERE issue_uuid = ?1 AND event_seq BETWEEN ?2 AND ?3
                     ORDER BY event_seq",
                )
                .map_err(|e| StoreError::sqlite("read spool", e))?;
            let mapped = stmt
                .query_map(
                    params![key.as_slice(), i64_of(first_seq), i64_of(last)],
                    |r| {
                        Ok(SentRow {
                            seq: u64_of(r.get(0)?),
                            ordinal: r.get(1)?,
                            observed_ms: r.get(2)?,
                            stream: r.get(3)?,
                            raw_len: r.get(4)?,
                            sha: r.get(5)?,
                            segment: r.get(6)?,
                            offset: r.get(7)?,
                            body: r.get(8)?,
                        })
                    },
                )
                .map_err(|e| StoreError::sqlite("read spool", e))?;
            mapped
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("read spool", e))?
        };
        let mut out = Vec::with_capacity(rows.len());
        let mut expect = first_seq;
        for SentRow {
            seq,
            ordinal,
            observed_ms,
            stream,
            raw_len,
            sha,
            segment,
            offset,
            body,
        } in rows
        {
            if seq != expect {
                return Err(StoreError::Integrity(format!(
                    "sequence {expect} of {issue} is missing from the spool"
                )));
            }
            expect = expect.saturating_add(1);
            let body = match (segment, offset, body) {
                (_, _, Some(bytes)) => decode_body(&bytes)?,
                (Some(segment), Some(offset), None) => {
                    match self.read_output(&key, segment, u64_of(offset), raw_len, &sha) {
                        Ok(stored) => Body::Output(wire::OutputChunk {
                            stream,
                            stored_length: u32::try_from(stored.len()).unwrap_or(u32::MAX),
                            payload: stored,
                            raw_length: raw_len,
                        }),
                        Err(e) if is_damage(&e) => {
                            // the stored copy is damaged: the sequence is
                            // sent as an explicit gap of exactly its bytes,
                            // never as altered output and never holding up
                            // the session (plan §5.5, R1)
                            self.record_damaged_read(issue, segment, &e);
                            Body::Truncation(damaged_marker(stream, raw_len, seq, observed_ms))
                        }
                        Err(e) => return Err(e),
                    }
                }
                _ => {
                    return Err(StoreError::Integrity(format!(
                        "entry {ordinal} of {issue} has neither a body nor a record"
                    )));
                }
            };
            out.push(wire::CommandEvent {
                issue_uuid: issue.to_string(),
                event_seq: seq,
                observed_time: Some(timestamp(observed_ms)),
                body: Some(body),
            });
        }
        if expect <= last {
            return Err(StoreError::Integrity(format!(
                "sequence {expect} of {issue} is missing from the spool"
            )));
        }
        Ok(out)
    }

    /// A damaged output record found while reading it for sending: one
    /// open incident for its segment (dirty local health until repaired or
    /// acknowledged).
    fn record_damaged_read(&mut self, issue: &Uuid7, segment: u32, e: &StoreError) {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.metrics.incidents.inc();
        tracing::error!(%issue, segment, error = %e, "a spooled output record is damaged; it is sent as a truncation marker");
        let incident = crate::incidents::NewLocalIncident {
            kind: wire::IncidentKind::ChecksumMismatch,
            scope_kind: wire::ScopeKind::Segment,
            scope_key: format!("{}/{segment}", crate::recovery::hex(issue.as_bytes())),
            summary: format!(
                "an output record of command {issue} in spool segment {segment} is damaged; it was sent as a truncation marker"
            ),
            evidence: e.to_string().into_bytes(),
        };
        if let Err(e2) =
            crate::incidents::record(&self.conn, self.entropy.as_ref(), &incident, now_ms)
        {
            tracing::error!(%issue, error = %e2, "the damaged record could not be recorded as an incident");
        }
    }

    /// Reads one output record and verifies it: record framing and CRC,
    /// the zstd frame (bounded by the raw length), and the raw SHA-256.
    /// Returns the stored (compressed) payload.
    fn read_output(
        &mut self,
        key: &[u8; 16],
        segment: u32,
        offset: u64,
        raw_len: u32,
        sha: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let limits = spool_limits();
        let max = rvbox_segment::RECORD_OVERHEAD + u64::from(limits.max_stored_len);
        let committed: i64 = self
            .conn
            .query_row_cached(
                "SELECT committed_end FROM segments WHERE issue_uuid = ?1 AND kind = 1 AND ordinal = ?2",
                params![key.as_slice(), segment],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read spool segment", e))?;
        let committed = u64_of(committed);
        let file = self.segment_file(key, segment, Some(committed))?;
        let avail = committed.saturating_sub(offset).min(max);
        let mut buf = vec![0u8; usize::try_from(avail).unwrap_or(0)];
        file.read_exact_at(&mut buf, offset)
            .map_err(|e| StoreError::io("read spool record", "", e))?;
        let bad = |what: &str| {
            StoreError::Integrity(format!(
                "spool record at {offset} of segment {segment}: {what}"
            ))
        };
        let rec = decode(&buf, &limits).map_err(|e| bad(&e.to_string()))?;
        if rec.meta.issue_uuid != *key || rec.meta.raw_len != raw_len || rec.meta.sha256 != sha {
            return Err(bad("its header does not match its index row"));
        }
        let raw = self
            .codec
            .unframe(rec.payload, raw_len as usize)
            .map_err(|_| bad("its zstd frame does not decode"))?;
        if raw.len() != raw_len as usize || rvbox_segment::sha256(&raw) != rec.meta.sha256 {
            return Err(bad("its raw bytes do not match their SHA-256"));
        }
        Ok(rec.payload.to_vec())
    }

    /// Every command's spool as the store holds it, for the spool core at
    /// startup.
    ///
    /// # Errors
    /// SQLite failures, and an entry whose body does not decode.
    pub fn restore_spool(&self) -> Result<Vec<RestoredCommand>, StoreError> {
        let mut commands: BTreeMap<[u8; 16], RestoredCommand> = BTreeMap::new();
        {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT issue_uuid, next_ordinal, next_event_seq, acked_event_seq, loss_run
                     FROM commands",
                )
                .map_err(|e| StoreError::sqlite("read commands", e))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, Vec<u8>>(0)?,
                        u64_of(r.get(1)?),
                        u64_of(r.get(2)?),
                        u64_of(r.get(3)?),
                        r.get::<_, Option<Vec<u8>>>(4)?,
                    ))
                })
                .map_err(|e| StoreError::sqlite("read commands", e))?;
            for row in rows {
                let (id, next_ordinal, next_seq, acked, loss) =
                    row.map_err(|e| StoreError::sqlite("read commands", e))?;
                let loss_run = loss
                    .map(|b| {
                        wire::OutputTruncation::decode(b.as_slice()).map_err(|e| {
                            StoreError::Integrity(format!(
                                "a recorded loss run does not decode: {e}"
                            ))
                        })
                    })
                    .transpose()?;
                let key = <[u8; 16]>::try_from(id.as_slice())
                    .map_err(|_| StoreError::Integrity("a command id is not 16 bytes".into()))?;
                let issue = Uuid7::from_bytes("issue_uuid", key)
                    .map_err(|_| StoreError::Integrity("a command id is not a UUIDv7".into()))?;
                commands.insert(
                    key,
                    RestoredCommand {
                        issue,
                        next_ordinal,
                        next_seq,
                        acked,
                        entries: Vec::new(),
                        loss_run,
                    },
                );
            }
        }
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT issue_uuid, local_ordinal, event_seq, observed_ms, stream, raw_len,
                     stored_len, segment_ordinal, body
                 FROM spool_entries ORDER BY issue_uuid, local_ordinal",
            )
            .map_err(|e| StoreError::sqlite("read spool", e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, Vec<u8>>(0)?,
                    u64_of(r.get(1)?),
                    r.get::<_, Option<i64>>(2)?.map(u64_of),
                    r.get::<_, i64>(3)?,
                    r.get::<_, i32>(4)?,
                    r.get::<_, u32>(5)?,
                    r.get::<_, u32>(6)?,
                    r.get::<_, Option<u32>>(7)?,
                    r.get::<_, Option<Vec<u8>>>(8)?,
                ))
            })
            .map_err(|e| StoreError::sqlite("read spool", e))?;
        for row in rows {
            let (id, ordinal, seq, observed_ms, stream, raw_len, stored_len, segment, body) =
                row.map_err(|e| StoreError::sqlite("read spool", e))?;
            let Some(c) = <[u8; 16]>::try_from(id.as_slice())
                .ok()
                .and_then(|k| commands.get_mut(&k))
            else {
                continue;
            };
            let item = match (segment, body) {
                (_, Some(b)) => RestoredItem::Event(decode_body(&b)?),
                (Some(segment), None) => RestoredItem::Output {
                    stream: wire_stream(match stream {
                        1 => Stream::Stdout,
                        2 => Stream::Stderr,
                        _ => Stream::None,
                    }),
                    raw_len,
                    stored_len,
                    segment,
                },
                (None, None) => {
                    return Err(StoreError::Integrity(format!(
                        "entry {ordinal} of {} has neither a body nor a record",
                        c.issue
                    )));
                }
            };
            c.entries.push(RestoredEntry {
                ordinal,
                seq,
                observed_ms,
                item,
            });
        }
        Ok(commands.into_values().collect())
    }

    /// Spool segments of `issue` that no entry references (for tests and
    /// the counter check).
    ///
    /// # Errors
    /// SQLite failures.
    pub fn unreferenced_segments(&self, issue: &Uuid7) -> Result<Vec<u32>, StoreError> {
        self.empty_segments(issue.as_bytes().as_slice())
    }
}

/// Whether a read failure means the stored bytes are damaged or missing
/// (as opposed to a failure that may pass).
fn is_damage(e: &StoreError) -> bool {
    match e {
        StoreError::Integrity(_) => true,
        StoreError::Io { source, .. } => source.kind() == std::io::ErrorKind::UnexpectedEof,
        _ => false,
    }
}

/// The marker sent in place of the output record at `seq` whose stored
/// copy is damaged: exactly its raw bytes, on its stream.
fn damaged_marker(stream: i32, raw_len: u32, seq: u64, observed_ms: i64) -> wire::OutputTruncation {
    wire::OutputTruncation {
        source: wire::TruncationSource::ClientSpool as i32,
        streams: vec![stream],
        reason: "the client's stored copy of this output is damaged".into(),
        first_removed_event_seq: Some(seq),
        last_removed_event_seq: Some(seq),
        raw_bytes: u64::from(raw_len),
        compressed_bytes: None,
        first_observed_time: Some(timestamp(observed_ms)),
        last_observed_time: Some(timestamp(observed_ms)),
    }
}
