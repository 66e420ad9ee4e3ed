//! The recovery decision for one segment (plan §5.1 step 4, §5.3,
//! R-5.3-14/15/18/20).
//!
//! The DB's `committed_end_offset` is the truth: bytes beyond it were never
//! acknowledged and may be truncated; bytes inside it that are missing or
//! fail to decode are damage that is reported, never "repaired" by moving
//! the offset back. The decision is a pure function of the bytes, so running
//! it again after a crash at any repair step gives the same answer.

use crate::format::{DecodeError, HEADER_LEN, Limits, MAGIC, RecordMeta, decode, parse_header};

/// A half-open byte range `start..end` of a segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteRange {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl ByteRange {
    /// Number of bytes in the range.
    pub const fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range holds no bytes.
    pub const fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// A valid record inside the committed range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Offset of the record's first byte in the segment.
    pub offset: u64,
    /// Whole record length (header + payload + trailing CRC).
    pub len: u64,
    /// The record's header fields.
    pub meta: RecordMeta,
}

/// One decode failure that started a lost range: where, and why (for the
/// incident and logs; never payload bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Offset where a record was expected.
    pub offset: u64,
    /// Why it did not decode there. A committed range that ends early (short
    /// file, or `committed_end` inside a record) is `Truncated`.
    pub error: DecodeError,
}

/// What the shell must do with the segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// The file is exactly the committed records; nothing to do.
    Clean,
    /// The committed range is intact and there are bytes beyond it (a
    /// complete or torn unacknowledged tail): truncate the file to `from`
    /// (`== committed_end`). R-5.3-14.
    TruncateTail {
        /// Truncate the file to this length (the committed end).
        from: u64,
    },
    /// Bytes inside `0..committed_end` are missing or fail to decode
    /// (R-5.3-15/18): keep `committed_end`, keep the evidence, mark `lost`
    /// unavailable and open an incident. A tail beyond the committed end may
    /// still be truncated, but only after the incident is recorded.
    CommittedDamage {
        /// Ranges inside `0..committed_end` that cannot be trusted, sorted,
        /// disjoint and non-adjacent. They may extend past the bytes the
        /// file actually has (a short file).
        lost: Vec<ByteRange>,
        /// Whether the buffer held bytes beyond `committed_end`.
        tail_beyond_committed: bool,
    },
}

/// Result of [`scan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Valid records wholly inside `0..committed_end`, in file order,
    /// including those found after a damaged range by resynchronizing.
    /// Bounded: one entry per record present (each is at least 132 bytes).
    /// Records beyond `committed_end` are never listed: they are
    /// unacknowledged.
    pub records: Vec<ScannedRecord>,
    /// End of the last valid record of the unbroken run starting at 0.
    pub valid_prefix_end: u64,
    /// The decision.
    pub recovery: Recovery,
    /// `seq` of committed records whose header verified but whose payload
    /// did not (bad record CRC, or cut short): which events were lost, when
    /// that is determinable. Records destroyed beyond their header are not
    /// listed, so this is a hint, not the complete set.
    pub lost_seqs_hint: Vec<u64>,
    /// The decode failure that began each damaged stretch, in file order
    /// (at most one per lost range before adjacent ranges are merged).
    pub damage: Vec<Damage>,
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Appends `start..end`, merging with the previous range when they touch.
fn push_lost(lost: &mut Vec<ByteRange>, start: u64, end: u64) {
    if end <= start {
        return;
    }
    if let Some(last) = lost.last_mut()
        && last.end >= start
    {
        last.end = last.end.max(end);
        return;
    }
    lost.push(ByteRange { start, end });
}

/// The next offset after `from` where a whole valid record lies inside
/// `committed`. Cost: one magic compare per offset; the header CRC only where
/// the magic matches; the record CRC only where the header verified.
fn resync(committed: &[u8], from: usize, limits: &Limits) -> Option<usize> {
    let last_start = committed.len().checked_sub(HEADER_LEN)?;
    (from..=last_start).find(|&q| {
        committed
            .get(q..)
            .is_some_and(|rest| rest.starts_with(&MAGIC) && decode(rest, limits).is_ok())
    })
}

/// Walks the records of one segment from offset 0 and decides its recovery.
///
/// `buf` is what the shell read from the start of the file: at most
/// `committed_end` plus a bounded tail. If it is shorter than
/// `committed_end`, the missing bytes are damage. The caller must still
/// check each record's `issue_uuid`/`seq` against its metadata: a record
/// found by resynchronizing is valid bytes, not proof of identity.
///
/// Damage handling: a record whose header verifies but whose payload or
/// trailing CRC does not is lost with its exact extent (the header CRC
/// vouches for its length) and the walk continues after it. A record whose
/// header does not verify is lost up to the next offset where a whole valid
/// record starts inside the committed range, or to `committed_end` if there
/// is none. The walk always advances and stops at the end of the buffer.
///
/// Cost: one decode per record; in damaged stretches one magic compare per
/// byte offset, a header CRC only where the magic matches, and a record CRC
/// only where a header CRC also verified (bounded by the limits). Only bytes
/// this format wrote (e.g. a segment file captured as output) can make that
/// last case frequent.
pub fn scan(buf: &[u8], committed_end: u64, limits: &Limits) -> Scan {
    let committed_len = usize::try_from(committed_end).map_or(buf.len(), |c| c.min(buf.len()));
    let committed = buf.get(..committed_len).unwrap_or(&[]);
    let buf_len = to_u64(buf.len());

    let mut records = Vec::new();
    let mut lost: Vec<ByteRange> = Vec::new();
    let mut lost_seqs_hint = Vec::new();
    let mut damage = Vec::new();
    let mut valid_prefix_end = 0u64;
    let mut unbroken = true;
    let mut pos = 0usize;

    while pos < committed_len {
        let Some(rest) = committed.get(pos..) else {
            break;
        };
        let offset = to_u64(pos);
        match decode(rest, limits) {
            Ok(rec) => {
                let Some(next) = usize::try_from(rec.len)
                    .ok()
                    .and_then(|l| pos.checked_add(l))
                else {
                    break;
                };
                records.push(ScannedRecord {
                    offset,
                    len: rec.len,
                    meta: rec.meta,
                });
                pos = next;
                if unbroken {
                    valid_prefix_end = to_u64(pos);
                }
            }
            Err(error) => {
                unbroken = false;
                damage.push(Damage { offset, error });
                if let Ok(header) = parse_header(rest, limits) {
                    // Trusted extent: the header CRC verified record_len.
                    lost_seqs_hint.push(header.meta.seq);
                    let end = usize::try_from(header.record_len)
                        .ok()
                        .and_then(|l| pos.checked_add(l))
                        .filter(|&end| end <= committed_len);
                    match end {
                        Some(end) => {
                            push_lost(&mut lost, offset, to_u64(end));
                            pos = end;
                        }
                        None => {
                            // Cut short by the committed end or the file end.
                            push_lost(&mut lost, offset, committed_end);
                            pos = committed_len;
                        }
                    }
                } else {
                    match pos
                        .checked_add(1)
                        .and_then(|from| resync(committed, from, limits))
                    {
                        Some(next) => {
                            push_lost(&mut lost, offset, to_u64(next));
                            pos = next;
                        }
                        None => {
                            push_lost(&mut lost, offset, committed_end);
                            pos = committed_len;
                        }
                    }
                }
            }
        }
    }

    // A file shorter than committed_end that ended on a record boundary.
    let reached = lost
        .last()
        .map_or(to_u64(committed_len), |l| l.end.max(to_u64(committed_len)));
    if reached < committed_end {
        damage.push(Damage {
            offset: reached,
            error: DecodeError::Truncated {
                needed: committed_end.saturating_sub(reached),
                have: 0,
            },
        });
        push_lost(&mut lost, reached, committed_end);
    }

    let tail_beyond_committed = buf_len > committed_end;
    let recovery = if !lost.is_empty() {
        Recovery::CommittedDamage {
            lost,
            tail_beyond_committed,
        }
    } else if tail_beyond_committed {
        Recovery::TruncateTail {
            from: committed_end,
        }
    } else {
        Recovery::Clean
    };
    Scan {
        records,
        valid_prefix_end,
        recovery,
        lost_seqs_hint,
        damage,
    }
}
