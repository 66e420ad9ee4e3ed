//! Command-owned blobs outside SQLite (plan §5.2 `command_payloads`, §5.3
//! "Apply this committed-offset protocol to command blob ... segments").
//!
//! A script whose compressed form is small stays inline in its payload row.
//! A larger one is written, before any metadata names it, as checksummed
//! `Kind::Script` records (at most 256 KiB raw each) into the command's blob
//! segment (ordinal 0, state `blob`): exclusive create, append, `fdatasync`,
//! directory sync; only then does the transaction that creates the command
//! insert one payload row per chunk and the segment row with its
//! `committed_end`. A crash before that commit leaves a file no row names,
//! which recovery removes.

use crate::db::Cached as _;

use rusqlite::params;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::limits;
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Kind, Limits, RecordMeta, Stream, decode, encode, sha256};

use crate::error::StoreError;
use crate::fs::StoreFs;
use crate::mutations::OpError;
use crate::store::{Store, to_i64, to_u64};

/// Largest compressed script kept inline in its payload row.
pub const INLINE_SCRIPT_MAX: usize = 64 * 1024;
/// The ordinal of a command's blob segment (output segments start at 1).
pub const BLOB_ORDINAL: u32 = 0;

/// Record limits of blob segments: 256 KiB raw per chunk.
#[must_use]
pub fn script_limits() -> Limits {
    let raw = limits::MAX_SCRIPT_CHUNK_BYTES;
    Limits {
        max_raw_len: u32::try_from(raw).unwrap_or(u32::MAX),
        max_stored_len: u32::try_from(rvbox_retention::zstd_bound(raw)).unwrap_or(u32::MAX),
    }
}

/// One chunk as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlobChunk {
    pub(crate) offset: u64,
    pub(crate) raw_len: u64,
    pub(crate) stored_len: u64,
    pub(crate) sha256: [u8; 32],
}

/// A script encoded as blob-segment records, not yet written.
#[derive(Debug)]
pub(crate) struct PreparedBlob {
    pub(crate) bytes: Vec<u8>,
    pub(crate) chunks: Vec<BlobChunk>,
    pub(crate) stored_total: u64,
    pub(crate) raw_total: u64,
}

/// Compresses `raw` chunk by chunk into checksummed records.
pub(crate) fn prepare_script(
    issue: &[u8; 16],
    raw: &[u8],
    now_ms: i64,
) -> Result<PreparedBlob, StoreError> {
    let chunk_len = usize::try_from(limits::MAX_SCRIPT_CHUNK_BYTES).unwrap_or(256 * 1024);
    let lim = script_limits();
    let mut out = PreparedBlob {
        bytes: Vec::new(),
        chunks: Vec::new(),
        stored_total: 0,
        raw_total: 0,
    };
    for (i, piece) in raw.chunks(chunk_len.max(1)).enumerate() {
        let stored =
            zstd::bulk::compress(piece, 3).map_err(|e| StoreError::io("compress script", "", e))?;
        let digest = sha256(piece);
        let meta = RecordMeta {
            issue_uuid: *issue,
            seq: i as u64,
            observed_unix_ms: now_ms,
            receipt_unix_ms: now_ms,
            kind: Kind::Script,
            stream: Stream::None,
            compression: Compression::Zstd,
            raw_len: u32::try_from(piece.len()).unwrap_or(u32::MAX),
            sha256: digest,
        };
        let record = encode(&meta, &stored, &lim).map_err(|e| {
            StoreError::Integrity(format!("script chunk does not encode: {}", e.code()))
        })?;
        out.chunks.push(BlobChunk {
            offset: out.bytes.len() as u64,
            raw_len: piece.len() as u64,
            stored_len: stored.len() as u64,
            sha256: digest,
        });
        out.stored_total = out.stored_total.saturating_add(stored.len() as u64);
        out.raw_total = out.raw_total.saturating_add(piece.len() as u64);
        out.bytes.extend_from_slice(&record);
    }
    Ok(out)
}

/// Writes the blob segment durably: exclusive create, append, sync, and a
/// directory sync, then reads it back and checks every record. Returns
/// whether it read back clean (the durable "verified" fact its row gets;
/// one that did not is scanned at the next start). On failure the partial
/// file is removed (best effort; the orphan sweep removes any file no row
/// names).
pub(crate) fn write_blob(
    fs: &dyn StoreFs,
    layout: &crate::layout::Layout,
    issue: &[u8; 16],
    blob: &PreparedBlob,
) -> Result<bool, StoreError> {
    let dir = layout.segment_dir(issue);
    let dir = dir.as_path();
    let path = layout
        .segment_path(issue, BLOB_ORDINAL)
        .ok_or_else(|| StoreError::Integrity("blob segment name".into()))?;
    let result = (|| {
        let mut f = crate::store::create_segment_file(fs, &path)
            .map_err(|e| StoreError::io("create blob segment", &path, e))?;
        f.append(&blob.bytes)
            .and_then(|()| f.sync_data())
            .map_err(|e| StoreError::io("write blob segment", &path, e))?;
        fs.sync_dir(dir)
            .map_err(|e| StoreError::io("sync segment directory", dir, e))
    })();
    if result.is_err() {
        let _ = fs.remove_file(&path);
    }
    result?;
    let end = blob.bytes.len() as u64;
    Ok(
        rvbox_storage::segment_io::read_and_scan(fs, &path, end, end, &script_limits()).is_ok_and(
            |s| s.file_len == end && matches!(s.scan.recovery, rvbox_segment::Recovery::Clean),
        ),
    )
}

/// Inserts the payload rows and the blob segment row (inside the
/// transaction that creates the command).
pub(crate) fn record_blob(
    tx: &rusqlite::Transaction<'_>,
    issue: &[u8; 16],
    blob: &PreparedBlob,
    charged: u64,
    verified: bool,
    now_ms: i64,
) -> Result<(), StoreError> {
    tx.execute_cached(
        "INSERT INTO command_segments (issue_uuid, ordinal, committed_end, state, stored_bytes, raw_bytes,
             charged_bytes, created_ms, verified)
         VALUES (?1, ?2, ?3, 'blob', ?4, ?5, ?6, ?7, ?8)",
        params![
            issue.as_slice(),
            BLOB_ORDINAL,
            blob.bytes.len() as i64,
            to_i64(blob.stored_total),
            to_i64(blob.raw_total),
            to_i64(charged),
            now_ms,
            i64::from(verified)
        ],
    )
    .map_err(|e| StoreError::sqlite("record blob segment", e))?;
    for (i, c) in blob.chunks.iter().enumerate() {
        tx.execute_cached(
            "INSERT INTO command_payloads (issue_uuid, kind, ordinal, compression, raw_len, stored_len,
                 sha256, segment_ordinal, segment_offset)
             VALUES (?1, ?2, ?3, 1, ?4, ?5, ?6, ?7, ?8)",
            params![
                issue.as_slice(),
                Kind::Script.as_u8(),
                i as i64,
                to_i64(c.raw_len),
                to_i64(c.stored_len),
                c.sha256.as_slice(),
                BLOB_ORDINAL,
                to_i64(c.offset)
            ],
        )
        .map_err(|e| StoreError::sqlite("record script chunk", e))?;
    }
    Ok(())
}

fn integrity(what: &str) -> OpError {
    OpError::Store(StoreError::Integrity(format!(
        "stored script failed verification: {what}"
    )))
}

/// One stored script chunk row: ordinal, raw length, stored length,
/// SHA-256 of the raw bytes, inline zstd bytes, or its offset in the blob
/// segment.
type ChunkRow = (i64, i64, i64, Vec<u8>, Option<Vec<u8>>, Option<i64>);

/// A script's descriptor and chunk rows, with its blob segment opened when
/// a row lives there.
struct StoredScript {
    desc: wire::ScriptDescriptor,
    rows: Vec<ChunkRow>,
    file: Option<Box<dyn crate::fs::SegmentFile>>,
}

impl Store {
    /// The stored execution spec of a command (what its `Dispatch`
    /// carries).
    ///
    /// # Errors
    /// `NOT_FOUND`, an integrity failure when the stored spec does not
    /// decode, or a store failure.
    pub fn execution_spec(&self, issue: &[u8; 16]) -> Result<wire::ExecutionSpec, OpError> {
        let spec: Option<(Vec<u8>,)> = self
            .conn
            .prepare_cached("SELECT spec_zstd FROM commands WHERE issue_uuid = ?1")
            .and_then(|mut st| st.query_row(params![issue.as_slice()], |r| Ok((r.get(0)?,))))
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                other => Err(other),
            })
            .map_err(|e| StoreError::sqlite("read command", e))?;
        let Some((spec_zstd,)) = spec else {
            return Err(DomainError::new(Code::NotFound, "no such command").into());
        };
        let cap = usize::try_from(limits::MAX_EXECUTION_SPEC_BYTES).unwrap_or(0);
        crate::store::decompress_small(&spec_zstd, cap)
            .ok()
            .and_then(|raw| <wire::ExecutionSpec as prost::Message>::decode(raw.as_slice()).ok())
            .ok_or_else(|| integrity("the execution spec does not decode"))
    }

    /// The descriptor and chunk rows of a scripted command; `None` for one
    /// that runs command text.
    fn script_descriptor(
        &self,
        issue: &[u8; 16],
    ) -> Result<Option<wire::ScriptDescriptor>, OpError> {
        let spec = self.execution_spec(issue)?;
        let Some(wire::execution_spec::Source::Script(desc)) = spec.source else {
            return Ok(None);
        };
        Ok(Some(desc))
    }

    fn stored_script(&self, issue: &[u8; 16]) -> Result<Option<StoredScript>, OpError> {
        let Some(desc) = self.script_descriptor(issue)? else {
            return Ok(None);
        };
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT ordinal, raw_len, stored_len, sha256, inline_bytes, segment_offset
                 FROM command_payloads WHERE issue_uuid = ?1 AND kind = ?2 ORDER BY ordinal",
            )
            .map_err(|e| StoreError::sqlite("read script", e))?;
        let rows: Vec<ChunkRow> = stmt
            .query_map(params![issue.as_slice(), Kind::Script.as_u8()], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            })
            .map_err(|e| StoreError::sqlite("read script", e))?
            .collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("read script", e))?;
        let file = if rows.iter().any(|r| r.5.is_some()) {
            let path = self
                .layout
                .segment_path(issue, BLOB_ORDINAL)
                .ok_or_else(|| integrity("blob segment name"))?;
            Some(
                self.fs
                    .open(&path)
                    .map_err(|_| integrity("the blob segment is missing"))?,
            )
        } else {
            None
        };
        Ok(Some(StoredScript { desc, rows, file }))
    }

    /// Decodes and verifies chunk `i` of `script`.
    fn script_chunk(
        issue: &[u8; 16],
        script: &StoredScript,
        i: usize,
        row: &ChunkRow,
    ) -> Result<Vec<u8>, OpError> {
        let max = usize::try_from(limits::MAX_SCRIPT_BYTES).unwrap_or(0);
        let (ordinal, raw_len, stored_len, digest, inline, offset) = row;
        if to_u64(*ordinal) != i as u64 {
            return Err(integrity("a chunk is missing"));
        }
        let raw_len = usize::try_from(*raw_len).map_err(|_| integrity("chunk length"))?;
        if raw_len > max {
            return Err(integrity("the script is larger than 10 MiB"));
        }
        let raw = match (inline, offset, &script.file) {
            (Some(z), _, _) => {
                zstd::bulk::decompress(z, max).map_err(|_| integrity("inline bytes"))?
            }
            (None, Some(off), Some(f)) => {
                let len = rvbox_segment::encoded_len(
                    u32::try_from(*stored_len).map_err(|_| integrity("chunk length"))?,
                );
                let mut buf =
                    vec![0u8; usize::try_from(len).map_err(|_| integrity("chunk length"))?];
                f.read_exact_at(&mut buf, to_u64(*off))
                    .map_err(|_| integrity("short blob segment"))?;
                let rec = decode(&buf, &script_limits()).map_err(|e| integrity(e.code()))?;
                if rec.meta.issue_uuid != *issue
                    || rec.meta.seq != i as u64
                    || rec.meta.kind != Kind::Script
                {
                    return Err(integrity("record identity"));
                }
                zstd::bulk::decompress(rec.payload, raw_len)
                    .map_err(|_| integrity("chunk bytes"))?
            }
            _ => return Err(integrity("a chunk has no bytes")),
        };
        if raw.len() != raw_len || sha256(&raw).as_slice() != digest.as_slice() {
            return Err(integrity("chunk digest"));
        }
        Ok(raw)
    }

    /// The script bytes of a scripted command, verified chunk by chunk and
    /// as a whole against the descriptor's SHA-256 and size; `None` for a
    /// command that runs command text.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown command; a store integrity error when a
    /// stored chunk is missing or fails its checks.
    pub fn script(&self, issue: &[u8; 16]) -> Result<Option<Vec<u8>>, OpError> {
        let Some(script) = self.stored_script(issue)? else {
            return Ok(None);
        };
        let max = usize::try_from(limits::MAX_SCRIPT_BYTES).unwrap_or(0);
        let mut out = Vec::new();
        for (i, row) in script.rows.iter().enumerate() {
            let raw = Self::script_chunk(issue, &script, i, row)?;
            if out.len().saturating_add(raw.len()) > max {
                return Err(integrity("the script is larger than 10 MiB"));
            }
            out.extend_from_slice(&raw);
        }
        let desc = &script.desc;
        if out.len() as u64 != desc.size_bytes || sha256(&out).as_slice() != desc.sha256.as_slice()
        {
            return Err(integrity("size or SHA-256 differs from the descriptor"));
        }
        Ok(Some(out))
    }

    /// The script size of a scripted command, from its descriptor alone;
    /// `None` for a command that runs command text.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown command; a store integrity error when the
    /// stored spec does not decode.
    pub fn script_size(&self, issue: &[u8; 16]) -> Result<Option<u64>, OpError> {
        Ok(self.script_descriptor(issue)?.map(|d| d.size_bytes))
    }

    /// Up to `max_len` script bytes from raw offset `from` (for the upload
    /// to the client), reading and verifying only the stored chunks that
    /// overlap the range; with the script's total size. `None` for a
    /// command that runs command text. Empty at or past the end.
    ///
    /// # Errors
    /// As [`Store::script`].
    pub fn script_range(
        &self,
        issue: &[u8; 16],
        from: u64,
        max_len: usize,
    ) -> Result<Option<(u64, Vec<u8>)>, OpError> {
        let Some(script) = self.stored_script(issue)? else {
            return Ok(None);
        };
        let size = script.desc.size_bytes;
        let end = from.saturating_add(max_len as u64).min(size);
        let mut out = Vec::new();
        let mut at = 0u64;
        for (i, row) in script.rows.iter().enumerate() {
            if at >= end {
                break;
            }
            let len = to_u64(row.1);
            let next = at.saturating_add(len);
            if next > from {
                let raw = Self::script_chunk(issue, &script, i, row)?;
                let lo = usize::try_from(from.saturating_sub(at)).unwrap_or(usize::MAX);
                let hi = usize::try_from(end.min(next).saturating_sub(at)).unwrap_or(0);
                let part = raw.get(lo..hi).ok_or_else(|| integrity("chunk length"))?;
                out.extend_from_slice(part);
            }
            at = next;
        }
        if at < end {
            return Err(integrity(
                "the stored chunks are shorter than the descriptor",
            ));
        }
        Ok(Some((size, out)))
    }
}
