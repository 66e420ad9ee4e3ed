//! Script uploads (plan §7.3): chunks verified and kept at validated
//! offsets in the command's script segment, the durable contiguous prefix
//! advanced only after the bytes are synced, and the whole script verified
//! against its descriptor before the command may launch.
//!
//! A chunk is accepted when its offset is the durable prefix, or when the
//! part below the prefix is an exact replay of stored bytes (the rest is
//! appended). Holes, changed bytes, bad lengths or checksums, data past the
//! declared size and chunks after the commit are refused without writing.

use rusqlite::{OptionalExtension, TransactionBehavior, params};
use rvbox_client_core::ops::ScriptOutcome;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{MAX_SCRIPT_BYTES, MAX_SCRIPT_CHUNK_BYTES};
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Kind, Limits, RecordMeta, Stream, decode, segment_file_name};
use rvbox_storage::StoreError;
use rvbox_storage::db::Cached as _;

use crate::crash;
use crate::store::ClientStore;

/// The script segment's ordinal (one per command).
pub const SCRIPT_SEGMENT: u32 = 1;

/// Record limits of a script segment: one chunk, stored raw.
#[must_use]
pub fn script_limits() -> Limits {
    let max = u32::try_from(MAX_SCRIPT_CHUNK_BYTES).unwrap_or(u32::MAX);
    Limits {
        max_stored_len: max,
        max_raw_len: max,
    }
}

/// Bytes a script segment can hold: the largest script plus one record of
/// framing per chunk at its smallest chunk size.
#[must_use]
pub fn script_seal_bytes() -> u64 {
    MAX_SCRIPT_BYTES.saturating_add(MAX_SCRIPT_BYTES / 16)
}

fn u64_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The chunk's raw bytes, checked against everything it says about itself
/// and the descriptor's size.
fn decode_chunk(c: &wire::ScriptChunk, size: u64) -> Result<Vec<u8>, String> {
    let compression = wire::Compression::try_from(c.compression)
        .map_err(|_| format!("compression {} is unknown", c.compression))?;
    if usize::try_from(c.stored_length).ok() != Some(c.payload.len()) {
        return Err(format!(
            "stored_length {} but the payload has {} bytes",
            c.stored_length,
            c.payload.len()
        ));
    }
    let raw_length = u64::from(c.raw_length);
    if !(1..=MAX_SCRIPT_CHUNK_BYTES).contains(&raw_length) {
        return Err(format!(
            "raw_length {raw_length} is not in 1..={MAX_SCRIPT_CHUNK_BYTES}"
        ));
    }
    if c.declared_size != size {
        return Err(format!(
            "declared_size {} differs from the descriptor's {size}",
            c.declared_size
        ));
    }
    if c.offset
        .checked_add(raw_length)
        .is_none_or(|end| end > size)
    {
        return Err(format!(
            "offset {} + raw_length {raw_length} passes the declared size {size}",
            c.offset
        ));
    }
    decode_payload(compression, &c.payload, c.raw_length, &c.raw_sha256)
}

/// The raw bytes of a payload the server sent (a script chunk or a stdin
/// write), checked against its raw length and SHA-256: `NONE`, or one
/// zstd frame that decodes within the raw length.
pub(crate) fn decode_payload(
    compression: wire::Compression,
    payload: &[u8],
    raw_length: u32,
    raw_sha256: &[u8],
) -> Result<Vec<u8>, String> {
    let raw = match compression {
        wire::Compression::Zstd => zstd::bulk::decompress(payload, raw_length as usize)
            .map_err(|_| "the zstd payload does not decode within raw_length".to_string())?,
        wire::Compression::None => payload.to_vec(),
        wire::Compression::Unspecified => return Err("compression is unspecified".into()),
    };
    if raw.len() as u64 != u64::from(raw_length) {
        return Err(format!(
            "decodes to {} bytes but raw_length is {raw_length}",
            raw.len()
        ));
    }
    if rvbox_segment::sha256(&raw).as_slice() != raw_sha256 {
        return Err("raw_sha256 does not match the payload's bytes".into());
    }
    Ok(raw)
}

struct ScriptRow {
    len: u64,
    sha: [u8; 32],
    received: u64,
    committed: bool,
}

impl ClientStore {
    pub(crate) fn remove_script_file(&self, key: &[u8; 16]) {
        if let Some(name) = segment_file_name(key, SCRIPT_SEGMENT) {
            let path = self.layout().scripts_dir().join(name);
            match self.fs.remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "could not remove a script segment")
                }
            }
        }
    }

    fn script_row(&self, issue: &Uuid7) -> Result<Option<ScriptRow>, StoreError> {
        self.conn
            .query_row_cached(
                "SELECT script_len, script_sha256, script_received, script_committed
                 FROM commands WHERE issue_uuid = ?1",
                params![issue.as_bytes().as_slice()],
                |r| {
                    Ok((
                        r.get::<_, Option<i64>>(0)?,
                        r.get::<_, Option<Vec<u8>>>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, i64>(3)?,
                    ))
                },
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read script state", e))
            .map(|row| {
                row.and_then(|(len, sha, received, committed)| {
                    Some(ScriptRow {
                        len: u64_of(len?),
                        sha: <[u8; 32]>::try_from(sha?.as_slice()).ok()?,
                        received: u64_of(received),
                        committed: committed != 0,
                    })
                })
            })
    }

    /// Reads raw script bytes `start..end` back from the stored chunks,
    /// each record verified (framing, CRC, SHA-256).
    ///
    /// # Errors
    /// [`StoreError::Integrity`] when a record is damaged or a range is
    /// missing; I/O and SQLite failures.
    pub fn script_range(
        &mut self,
        issue: &Uuid7,
        start: u64,
        end: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let key = *issue.as_bytes();
        let rows: Vec<(i64, i64, i64)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT offset, len, segment_offset FROM script_chunks
                     WHERE issue_uuid = ?1 AND offset < ?3 AND offset + len > ?2 ORDER BY offset",
                )
                .map_err(|e| StoreError::sqlite("read script chunks", e))?;
            let mapped = stmt
                .query_map(params![key.as_slice(), i64_of(start), i64_of(end)], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .map_err(|e| StoreError::sqlite("read script chunks", e))?;
            mapped
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("read script chunks", e))?
        };
        let name = segment_file_name(&key, SCRIPT_SEGMENT)
            .ok_or_else(|| StoreError::Integrity("script segment name".into()))?;
        let path = self.layout().scripts_dir().join(name);
        let file = self
            .fs
            .open(&path)
            .map_err(|e| StoreError::io("open script segment", &path, e))?;
        let limits = script_limits();
        let mut out = Vec::with_capacity(usize::try_from(end.saturating_sub(start)).unwrap_or(0));
        let mut at = start;
        for (offset, len, seg_off) in rows {
            let (offset, len) = (u64_of(offset), u64_of(len));
            if offset > at {
                return Err(StoreError::Integrity(format!(
                    "script bytes {at}..{offset} of {issue} are missing"
                )));
            }
            let mut buf =
                vec![0u8; usize::try_from(len + rvbox_segment::RECORD_OVERHEAD).unwrap_or(0)];
            file.read_exact_at(&mut buf, u64_of(seg_off))
                .map_err(|e| StoreError::io("read script record", &path, e))?;
            let rec = decode(&buf, &limits)
                .map_err(|e| StoreError::Integrity(format!("script record of {issue}: {e}")))?;
            if rvbox_segment::sha256(rec.payload) != rec.meta.sha256 {
                return Err(StoreError::Integrity(format!(
                    "script record at {offset} of {issue} does not match its SHA-256"
                )));
            }
            let from = usize::try_from(at - offset).unwrap_or(0);
            let to = usize::try_from(end.min(offset + len) - offset).unwrap_or(0);
            out.extend_from_slice(rec.payload.get(from..to).unwrap_or_default());
            at = end.min(offset + len);
        }
        if at < end {
            return Err(StoreError::Integrity(format!(
                "script bytes {at}..{end} of {issue} are missing"
            )));
        }
        Ok(out)
    }

    /// One script chunk (module docs). Returns what it did; a
    /// [`ScriptOutcome::Invalid`] writes nothing.
    ///
    /// # Errors
    /// I/O and SQLite failures (nothing advanced; the server resends).
    pub fn script_chunk(
        &mut self,
        issue: &Uuid7,
        c: &wire::ScriptChunk,
        now_ms: i64,
    ) -> Result<ScriptOutcome, StoreError> {
        let Some(row) = self.script_row(issue)? else {
            return Ok(ScriptOutcome::Invalid("the command has no script".into()));
        };
        if row.committed {
            return Ok(ScriptOutcome::Committed);
        }
        let raw = match decode_chunk(c, row.len) {
            Ok(raw) => raw,
            Err(why) => return Ok(ScriptOutcome::Invalid(why)),
        };
        if c.offset > row.received {
            return Ok(ScriptOutcome::Invalid(format!(
                "offset {} leaves a hole after the durable prefix {}",
                c.offset, row.received
            )));
        }
        let end = c.offset + raw.len() as u64;
        let overlap_end = end.min(row.received);
        if overlap_end > c.offset {
            let stored = self.script_range(issue, c.offset, overlap_end)?;
            let n = stored.len();
            if raw.get(..n) != Some(stored.as_slice()) {
                return Ok(ScriptOutcome::Invalid(format!(
                    "the chunk at {} changes bytes already received",
                    c.offset
                )));
            }
        }
        if end > row.received {
            let tail = raw
                .get(usize::try_from(row.received - c.offset).unwrap_or(0)..)
                .unwrap_or_default();
            self.append_script(issue, row.received, tail, now_ms)?;
        }
        let received = end.max(row.received);
        if received < row.len {
            return Ok(ScriptOutcome::Received { received });
        }
        self.commit_script(issue, row.len, &row.sha)
    }

    /// The whole script is durable: verify it against the descriptor and
    /// make the command launch-eligible.
    fn commit_script(
        &mut self,
        issue: &Uuid7,
        len: u64,
        sha: &[u8; 32],
    ) -> Result<ScriptOutcome, StoreError> {
        let all = self.script_range(issue, 0, len)?;
        if rvbox_segment::sha256(&all) != *sha {
            return Ok(ScriptOutcome::Mismatch(
                "the received script does not match the descriptor's SHA-256".into(),
            ));
        }
        self.conn
            .execute_cached(
                "UPDATE commands SET script_committed = 1 WHERE issue_uuid = ?1",
                params![issue.as_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("commit script", e))?;
        self.hook.at(crash::SCRIPT_COMMIT_AFTER_COMMIT);
        Ok(ScriptOutcome::Committed)
    }

    /// Recovery: a script whose every byte became durable before a crash
    /// that came before its verification is verified now. The server
    /// sends no more chunks for it (the client's prefix is complete), so
    /// without this the command would wait for ever. Returns the commands
    /// committed now and those whose bytes do not match (left for the
    /// incident the caller records).
    pub(crate) fn finish_complete_scripts(&mut self) -> Result<(u64, Vec<Uuid7>), StoreError> {
        let rows: Vec<(Vec<u8>, i64, Vec<u8>)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT issue_uuid, script_len, script_sha256 FROM commands
                     WHERE script_committed = 0 AND script_len IS NOT NULL
                       AND script_received = script_len",
                )
                .map_err(|e| StoreError::sqlite("find complete scripts", e))?;
            let mapped = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .map_err(|e| StoreError::sqlite("find complete scripts", e))?;
            mapped
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("find complete scripts", e))?
        };
        let mut committed = 0u64;
        let mut mismatched = Vec::new();
        for (id, len, sha) in rows {
            let (Ok(key), Ok(sha)) = (
                <[u8; 16]>::try_from(id.as_slice()),
                <[u8; 32]>::try_from(sha.as_slice()),
            ) else {
                continue;
            };
            let Ok(issue) = Uuid7::from_bytes("issue_uuid", key) else {
                continue;
            };
            match self.commit_script(&issue, u64_of(len), &sha)? {
                ScriptOutcome::Committed => committed += 1,
                _ => mismatched.push(issue),
            }
        }
        Ok((committed, mismatched))
    }

    fn append_script(
        &mut self,
        issue: &Uuid7,
        offset: u64,
        bytes: &[u8],
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let key = *issue.as_bytes();
        let meta = RecordMeta {
            issue_uuid: key,
            seq: offset,
            observed_unix_ms: now_ms,
            receipt_unix_ms: now_ms,
            kind: Kind::Script,
            stream: Stream::None,
            compression: Compression::None,
            raw_len: u32::try_from(bytes.len()).unwrap_or(u32::MAX),
            sha256: rvbox_segment::sha256(bytes),
        };
        let record = rvbox_segment::encode(&meta, bytes, &script_limits())
            .map_err(|e| StoreError::Integrity(format!("encode script record: {e}")))?;
        let committed: Option<i64> = self
            .conn
            .query_row_cached(
                "SELECT committed_end FROM segments WHERE issue_uuid = ?1 AND ordinal = ?2 AND kind = 3",
                params![key.as_slice(), SCRIPT_SEGMENT],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read script segment", e))?;
        let dir = self.layout().scripts_dir();
        let name = segment_file_name(&key, SCRIPT_SEGMENT)
            .ok_or_else(|| StoreError::Integrity("script segment name".into()))?;
        let path = dir.join(name);
        let mut file = match committed {
            Some(_) => self
                .fs
                .open(&path)
                .map_err(|e| StoreError::io("open script segment", &path, e))?,
            None => {
                match self.fs.remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io("remove stale script segment", &path, e)),
                }
                let f = self
                    .fs
                    .create_new(&path)
                    .map_err(|e| StoreError::io("create script segment", &path, e))?;
                self.fs
                    .sync_dir(&dir)
                    .map_err(|e| StoreError::io("sync scripts directory", &dir, e))?;
                f
            }
        };
        let at = committed.map_or(0, u64_of);
        let len = file
            .len()
            .map_err(|e| StoreError::io("stat script segment", &path, e))?;
        if len != at {
            file.truncate(at)
                .map_err(|e| StoreError::io("cut script tail", &path, e))?;
        }
        file.append(&record)
            .map_err(|e| StoreError::io("write script record", &path, e))?;
        file.sync_data()
            .map_err(|e| StoreError::io("sync script segment", &path, e))?;
        self.hook.at(crash::SCRIPT_CHUNK_AFTER_FSYNC);
        let end = at + record.len() as u64;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin script chunk", e))?;
        tx.execute_cached(
            "INSERT INTO segments (issue_uuid, ordinal, kind, committed_end) VALUES (?1, ?2, 3, ?3)
             ON CONFLICT (issue_uuid, kind, ordinal) DO UPDATE SET committed_end = ?3",
            params![key.as_slice(), SCRIPT_SEGMENT, i64_of(end)],
        )
        .map_err(|e| StoreError::sqlite("advance script segment", e))?;
        tx.execute_cached(
            "INSERT INTO script_chunks (issue_uuid, offset, len, raw_sha256, segment_ordinal, segment_offset)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                key.as_slice(),
                i64_of(offset),
                i64_of(bytes.len() as u64),
                meta.sha256.as_slice(),
                SCRIPT_SEGMENT,
                i64_of(at)
            ],
        )
        .map_err(|e| StoreError::sqlite("index script chunk", e))?;
        tx.execute_cached(
            "UPDATE commands SET script_received = ?2 WHERE issue_uuid = ?1",
            params![key.as_slice(), i64_of(offset + bytes.len() as u64)],
        )
        .map_err(|e| StoreError::sqlite("advance script prefix", e))?;
        tx.execute_cached(
            "UPDATE counters SET stored_bytes = stored_bytes + ?1 WHERE id = 1",
            params![i64_of(bytes.len() as u64)],
        )
        .map_err(|e| StoreError::sqlite("charge script bytes", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit script chunk", e))?;
        self.hook.at(crash::SCRIPT_CHUNK_AFTER_COMMIT);
        Ok(())
    }
}
