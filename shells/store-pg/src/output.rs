//! Where output bytes live on PostgreSQL: behind [`OutputStore`], so an
//! object store (S3-compatible) can take the bytes later while the
//! metadata stays in the database.
//!
//! A chunk is one output event's bytes exactly as the client compressed
//! them, with the SHA-256 of the raw bytes: reading one back decompresses
//! it within its declared raw length and checks the digest, so a damaged
//! or substituted chunk is never served as output.

use postgres::Transaction;
use rvbox_segment::{Compression, Stream};

use crate::Fail;

/// One output event's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// Command.
    pub issue_uuid: [u8; 16],
    /// Its event sequence.
    pub event_seq: u64,
    /// Stdout or stderr.
    pub stream: Stream,
    /// How `stored` is encoded.
    pub compression: Compression,
    /// The raw length.
    pub raw_len: u32,
    /// SHA-256 of the raw bytes.
    pub sha256: [u8; 32],
    /// The bytes as the client sent them.
    pub stored: Vec<u8>,
}

impl OutputChunk {
    /// The raw bytes, verified against the chunk's length and digest.
    ///
    /// # Errors
    /// [`Fail::Integrity`] naming the chunk when it does not decompress to
    /// its raw length or its digest differs.
    pub fn raw(&self) -> Result<Vec<u8>, Fail> {
        let bad = |what: &str| {
            Fail::Integrity(format!(
                "output chunk {} of command {} {what}",
                self.event_seq,
                uuid_text(&self.issue_uuid)
            ))
        };
        let raw = match self.compression {
            Compression::None => self.stored.clone(),
            Compression::Zstd => zstd::bulk::decompress(&self.stored, self.raw_len as usize)
                .map_err(|_| bad("does not decompress within its raw length"))?,
        };
        if raw.len() != self.raw_len as usize {
            return Err(bad("has another length than it declares"));
        }
        if rvbox_segment::sha256(&raw) != self.sha256 {
            return Err(bad("does not match its SHA-256"));
        }
        Ok(raw)
    }
}

fn uuid_text(b: &[u8; 16]) -> String {
    rvbox_domain::ids::Uuid7::from_bytes("issue_uuid", *b)
        .map(|u| u.to_string())
        .unwrap_or_else(|_| "(invalid id)".into())
}

/// Where output chunks are kept. `put` runs inside the metadata
/// transaction that records the events: a store in the database writes
/// them in it; an object store makes them durable before it returns, so
/// the transaction commits only what is already durable (an object whose
/// transaction then fails is an orphan for the sweep, never a gap).
pub trait OutputStore: std::fmt::Debug + Send {
    /// Makes `chunks` durable with the transaction `tx`.
    ///
    /// # Errors
    /// A storage failure: the transaction must not commit.
    fn put(&mut self, tx: &mut Transaction<'_>, chunks: &[OutputChunk]) -> Result<(), Fail>;

    /// The chunks of `issue` with sequences from `from_seq`, in order, at
    /// most `max`.
    ///
    /// # Errors
    /// A storage failure.
    fn get(
        &mut self,
        tx: &mut Transaction<'_>,
        issue: &[u8; 16],
        from_seq: u64,
        max: usize,
    ) -> Result<Vec<OutputChunk>, Fail>;

    /// The chunks after `after` in (command id, sequence) order across
    /// every command (from the first when `None`), at most `max`: the
    /// background scrub's walk.
    ///
    /// # Errors
    /// A storage failure.
    fn scan(
        &mut self,
        tx: &mut Transaction<'_>,
        after: Option<([u8; 16], u64)>,
        max: usize,
    ) -> Result<Vec<OutputChunk>, Fail>;

    /// The chunks of `issue` with sequences in `first..=last` leave the
    /// store (a rotation, an eviction), in the transaction `tx` that
    /// deletes their event rows. A store in the database has nothing to
    /// do: its rows go with their events' (a foreign key). An object store
    /// records the objects for deletion once `tx` committed, never before,
    /// so a transaction that fails loses nothing.
    ///
    /// # Errors
    /// A storage failure: the transaction must not commit.
    fn removed(
        &mut self,
        tx: &mut Transaction<'_>,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<(), Fail>;
}

/// One chunk from its row: event_seq, stream, compression, raw_len,
/// sha256, stored (after the command id when `with_issue`).
fn chunk_of(r: &postgres::Row, issue: Option<[u8; 16]>) -> Result<OutputChunk, Fail> {
    let at = usize::from(issue.is_none());
    let issue = match issue {
        Some(i) => i,
        None => <[u8; 16]>::try_from(r.get::<_, Vec<u8>>(0).as_slice())
            .map_err(|_| Fail::Integrity("output chunk command id".into()))?,
    };
    let sha: Vec<u8> = r.get(at + 4);
    Ok(OutputChunk {
        issue_uuid: issue,
        event_seq: u64::try_from(r.get::<_, i64>(at)).unwrap_or(0),
        stream: u8::try_from(r.get::<_, i64>(at + 1))
            .ok()
            .and_then(Stream::from_u8)
            .ok_or_else(|| Fail::Integrity("output chunk stream unknown".into()))?,
        compression: u8::try_from(r.get::<_, i64>(at + 2))
            .ok()
            .and_then(Compression::from_u8)
            .ok_or_else(|| Fail::Integrity("output chunk compression unknown".into()))?,
        raw_len: u32::try_from(r.get::<_, i64>(at + 3))
            .map_err(|_| Fail::Integrity("output chunk raw length".into()))?,
        sha256: <[u8; 32]>::try_from(sha.as_slice())
            .map_err(|_| Fail::Integrity("output chunk digest length".into()))?,
        stored: r.get(at + 5),
    })
}

/// Output chunks in the `output_chunks` table of the same database.
#[derive(Debug, Default, Clone, Copy)]
pub struct DatabaseChunks;

impl OutputStore for DatabaseChunks {
    fn put(&mut self, tx: &mut Transaction<'_>, chunks: &[OutputChunk]) -> Result<(), Fail> {
        if chunks.is_empty() {
            return Ok(());
        }
        let ids: Vec<&[u8]> = chunks.iter().map(|c| c.issue_uuid.as_slice()).collect();
        let seqs: Vec<i64> = chunks
            .iter()
            .map(|c| i64::try_from(c.event_seq).unwrap_or(i64::MAX))
            .collect();
        let streams: Vec<i64> = chunks.iter().map(|c| i64::from(c.stream.as_u8())).collect();
        let comps: Vec<i64> = chunks
            .iter()
            .map(|c| i64::from(c.compression.as_u8()))
            .collect();
        let raw: Vec<i64> = chunks.iter().map(|c| i64::from(c.raw_len)).collect();
        let digests: Vec<&[u8]> = chunks.iter().map(|c| c.sha256.as_slice()).collect();
        let stored: Vec<&[u8]> = chunks.iter().map(|c| c.stored.as_slice()).collect();
        // the group's chunks in one statement
        crate::prep::execute(
            tx,
            "INSERT INTO output_chunks (issue_uuid, event_seq, stream, compression, raw_len,
                 sha256, stored)
             SELECT * FROM UNNEST($1::bytea[], $2::int8[], $3::int8[], $4::int8[], $5::int8[],
                                  $6::bytea[], $7::bytea[])",
            &[&ids, &seqs, &streams, &comps, &raw, &digests, &stored],
        )
        .map_err(Fail::db("store output chunks"))?;
        Ok(())
    }

    fn get(
        &mut self,
        tx: &mut Transaction<'_>,
        issue: &[u8; 16],
        from_seq: u64,
        max: usize,
    ) -> Result<Vec<OutputChunk>, Fail> {
        let rows = crate::prep::query(
            tx,
            "SELECT event_seq, stream, compression, raw_len, sha256, stored
                 FROM output_chunks WHERE issue_uuid = $1 AND event_seq >= $2
                 ORDER BY event_seq LIMIT $3",
            &[
                &issue.as_slice(),
                &i64::try_from(from_seq).unwrap_or(i64::MAX),
                &i64::try_from(max).unwrap_or(i64::MAX),
            ],
        )
        .map_err(Fail::db("read output chunks"))?;
        rows.iter().map(|r| chunk_of(r, Some(*issue))).collect()
    }

    fn scan(
        &mut self,
        tx: &mut Transaction<'_>,
        after: Option<([u8; 16], u64)>,
        max: usize,
    ) -> Result<Vec<OutputChunk>, Fail> {
        let (issue, seq) = after.unwrap_or(([0; 16], 0));
        crate::prep::query(
            tx,
            "SELECT issue_uuid, event_seq, stream, compression, raw_len, sha256, stored
             FROM output_chunks WHERE (issue_uuid, event_seq) > ($1, $2)
             ORDER BY issue_uuid, event_seq LIMIT $3",
            &[
                &issue.as_slice(),
                &i64::try_from(seq).unwrap_or(i64::MAX),
                &i64::try_from(max).unwrap_or(i64::MAX),
            ],
        )
        .map_err(Fail::db("scan output chunks"))?
        .iter()
        .map(|r| chunk_of(r, None))
        .collect()
    }

    fn removed(
        &mut self,
        _tx: &mut Transaction<'_>,
        _issue: &[u8; 16],
        _first: u64,
        _last: u64,
    ) -> Result<(), Fail> {
        // the rows went with their events' rows (ON DELETE CASCADE)
        Ok(())
    }
}
