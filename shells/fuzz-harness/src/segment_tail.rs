//! Target `segment_tail`: recovery of a segment file's tail after a crash
//! (`rvbox_segment::scan`: walk the records from offset 0, resynchronize
//! after damage, decide `Clean`, `TruncateTail` or `CommittedDamage`
//! against the database's committed end) and the group journal decoder
//! (`rvbox_segment::journal::decode_frames`).
//!
//! The first byte chooses the input's shape: any bytes with the committed
//! end at their length or drawn from the input; or a real segment (records
//! encoded here from the input's bytes) whose tail is then cut, extended
//! with garbage, or damaged at one byte, the committed end at a record
//! boundary; or any bytes, and real journal frames cut or damaged, through
//! the journal decoder. Checks, on every scan:
//!
//! - no panic, and the same answer twice;
//! - the records and the lost ranges tile `0..committed_end` exactly:
//!   records in order, wholly inside the committed range and the buffer,
//!   lost ranges sorted, disjoint, non-adjacent and non-empty;
//! - every record decodes again at its offset to the same header;
//! - the verdict matches: `Clean` is exactly the committed bytes,
//!   `TruncateTail` cuts at the committed end of a longer buffer,
//!   `CommittedDamage` has lost ranges and a damage report;
//! - the recovered prefix re-scans `Clean` with the same records;
//! - a real segment with no damage inside its committed range recovers
//!   every committed record.
//!
//! On every journal decode: entries inside the valid length, the valid
//! length a frame boundary that decodes again to the same entries with no
//! stop, and real undamaged frames decoded whole.

use rvbox_segment::journal::{JournalEntry, decode_frames, encode_frame};
use rvbox_segment::{
    Compression, Kind, Limits, RecordMeta, Recovery, Scan, Stream, decode, encode, scan, sha256,
};

use crate::Source;

/// The limits the store uses (64 KiB raw chunks and their bound).
fn limits() -> Limits {
    rvbox_store::store::record_limits()
}

fn small_limits() -> Limits {
    Limits {
        max_stored_len: 512,
        max_raw_len: 512,
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut src = Source::new(data);
    match src.u8() % 4 {
        0 => {
            let buf = src.rest();
            check_scan(buf, buf.len() as u64, &limits());
            check_scan(buf, buf.len() as u64, &small_limits());
            check_journal(buf, 1, 1 << 20);
        }
        1 => {
            let committed = u64::from(src.u16());
            let buf = src.rest();
            check_scan(buf, committed, &limits());
            check_journal(buf, committed, 4096);
        }
        2 => real_segment(&mut src),
        _ => real_journal(&mut src),
    }
}

fn check_scan(buf: &[u8], committed_end: u64, limits: &Limits) -> Scan {
    let s = scan(buf, committed_end, limits);
    assert_eq!(
        s,
        scan(buf, committed_end, limits),
        "the scan is a function of its input"
    );
    let buf_len = buf.len() as u64;

    // records and lost ranges tile 0..committed_end
    let lost: &[rvbox_segment::ByteRange] = match &s.recovery {
        Recovery::CommittedDamage { lost, .. } => lost,
        _ => &[],
    };
    for w in lost.windows(2) {
        if let [a, b] = w {
            assert!(
                a.end < b.start,
                "lost ranges are sorted, disjoint, non-adjacent"
            );
        }
    }
    let mut tiles: Vec<(u64, u64)> = s
        .records
        .iter()
        .map(|r| (r.offset, r.offset + r.len))
        .collect();
    tiles.extend(lost.iter().map(|r| (r.start, r.end)));
    tiles.sort_unstable();
    let mut at = 0u64;
    for (start, end) in &tiles {
        assert!(start < end, "no empty record or lost range");
        assert_eq!(
            *start, at,
            "records and lost ranges tile the committed range"
        );
        at = *end;
    }
    assert_eq!(
        at, committed_end,
        "records and lost ranges reach the committed end"
    );

    for r in &s.records {
        assert!(
            r.offset + r.len <= committed_end.min(buf_len),
            "a record lies in the committed bytes"
        );
        let bytes = buf
            .get(r.offset as usize..(r.offset + r.len) as usize)
            .expect("a record lies in the buffer");
        let d = decode(bytes, limits).expect("a scanned record decodes again");
        assert_eq!(
            (d.len, &d.meta),
            (r.len, &r.meta),
            "the same record decodes again"
        );
    }
    assert!(s.valid_prefix_end <= committed_end.min(buf_len));
    for d in &s.damage {
        assert!(
            d.offset <= committed_end,
            "damage is reported inside the committed range"
        );
    }

    match &s.recovery {
        Recovery::Clean => {
            assert_eq!(
                buf_len, committed_end,
                "clean is exactly the committed bytes"
            );
            assert_eq!(s.valid_prefix_end, committed_end);
            assert!(s.damage.is_empty());
        }
        Recovery::TruncateTail { from } => {
            assert_eq!(*from, committed_end, "the tail is cut at the committed end");
            assert!(buf_len > committed_end, "only a longer buffer has a tail");
            assert_eq!(
                s.valid_prefix_end, committed_end,
                "the committed range is intact"
            );
        }
        Recovery::CommittedDamage {
            lost,
            tail_beyond_committed,
        } => {
            assert!(!lost.is_empty(), "damage names what was lost");
            assert!(!s.damage.is_empty(), "damage says why");
            assert_eq!(*tail_beyond_committed, buf_len > committed_end);
        }
    }

    // the recovered prefix re-scans clean with the same records
    let prefix_end = s.valid_prefix_end;
    let prefix = buf
        .get(..prefix_end as usize)
        .expect("the prefix is in the buffer");
    let again = scan(prefix, prefix_end, limits);
    assert_eq!(
        again.recovery,
        Recovery::Clean,
        "the recovered prefix is clean"
    );
    let before: Vec<_> = s
        .records
        .iter()
        .filter(|r| r.offset + r.len <= prefix_end)
        .collect();
    assert_eq!(
        again.records.iter().collect::<Vec<_>>(),
        before,
        "the recovered prefix holds the same records"
    );
    s
}

fn meta_of(src: &mut Source<'_>, stored: &[u8], seq: u64) -> (RecordMeta, Vec<u8>) {
    let kind = *src.pick(&Kind::ALL).unwrap_or(&Kind::Event);
    let stream = match kind {
        Kind::Output if src.bool() => Stream::Stderr,
        Kind::Output => Stream::Stdout,
        _ => Stream::None,
    };
    let zstd = src.u8() < 64;
    let (compression, payload, raw) = if zstd {
        let z = zstd::bulk::compress(stored, 1).expect("compression of fuzz bytes");
        (Compression::Zstd, z, stored.to_vec())
    } else {
        (Compression::None, stored.to_vec(), stored.to_vec())
    };
    let issue = if kind == Kind::Audit {
        [0; 16]
    } else {
        [seq as u8; 16]
    };
    (
        RecordMeta {
            issue_uuid: issue,
            seq,
            observed_unix_ms: 1_800_000_000_000,
            receipt_unix_ms: 1_800_000_000_001,
            kind,
            stream,
            compression,
            raw_len: u32::try_from(raw.len()).unwrap_or(u32::MAX),
            sha256: sha256(&raw),
        },
        payload,
    )
}

fn real_segment(src: &mut Source<'_>) {
    let limits = limits();
    let count = 1 + usize::from(src.u8() % 6);
    let mut buf = Vec::new();
    let mut ends = Vec::new();
    for seq in 1..=count as u64 {
        let stored = src.bytes(96).to_vec();
        let (meta, payload) = meta_of(src, &stored, seq);
        let rec = encode(&meta, &payload, &limits).expect("a record within the limits encodes");
        buf.extend_from_slice(&rec);
        ends.push(buf.len() as u64);
    }
    let committed = *src.pick(&ends).unwrap_or(&0);
    let committed_records = ends.iter().filter(|e| **e <= committed).count();
    let mut damaged_inside = false;
    match src.u8() % 5 {
        // a torn tail: cut anywhere after the committed end
        0 => {
            let len = buf.len() as u64;
            let cut = committed + u64::from(src.u16()) % (len - committed + 1);
            buf.truncate(cut as usize);
        }
        // garbage after the last record
        1 => buf.extend_from_slice(src.bytes(200)),
        // one byte changed anywhere
        2 => {
            // never empty: every record is at least its overhead
            let at = usize::from(src.u16()) % buf.len().max(1);
            let flip = src.u8() | 1;
            if let Some(b) = buf.get_mut(at) {
                *b ^= flip;
            }
            damaged_inside = (at as u64) < committed;
        }
        // cut inside the committed range: committed bytes missing
        3 => {
            let cut = u64::from(src.u16()) % (committed + 1);
            buf.truncate(cut as usize);
            damaged_inside = cut < committed;
        }
        _ => {}
    }
    let s = check_scan(&buf, committed, &limits);
    if !damaged_inside {
        assert_eq!(
            s.records.len(),
            committed_records,
            "every committed record of an undamaged range is recovered"
        );
        assert!(
            !matches!(s.recovery, Recovery::CommittedDamage { .. }),
            "no damage is reported where there is none"
        );
    }
}

fn check_journal(buf: &[u8], epoch: u64, max_payload: u32) {
    let j = decode_frames(buf, epoch, max_payload);
    assert!(j.valid_len <= buf.len() as u64);
    for e in &j.entries {
        assert!(e.range.start <= e.range.end && e.range.end as u64 <= j.valid_len);
        assert!(e.frame < j.frames, "an entry belongs to a valid frame");
    }
    assert_eq!(
        j.stop.is_none(),
        j.valid_len == buf.len() as u64,
        "no stop means the whole buffer"
    );
    let prefix = buf
        .get(..j.valid_len as usize)
        .expect("the valid prefix is in the buffer");
    let again = decode_frames(prefix, epoch, max_payload);
    assert_eq!(
        again.stop, None,
        "the valid prefix ends on a frame boundary"
    );
    assert_eq!((again.entries, again.frames), (j.entries, j.frames));
}

fn real_journal(src: &mut Source<'_>) {
    let epoch = u64::from(src.u8() % 3);
    let frames = 1 + usize::from(src.u8() % 4);
    let mut buf = Vec::new();
    let mut entries_total = 0;
    for _ in 0..frames {
        let n = usize::from(src.u8() % 3);
        let bodies: Vec<Vec<u8>> = (0..n).map(|_| src.bytes(64).to_vec()).collect();
        let entries: Vec<JournalEntry<'_>> = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| JournalEntry {
                issue_uuid: [i as u8; 16],
                ordinal: i as u32,
                offset: 0,
                bytes: b,
            })
            .collect();
        entries_total += entries.len();
        buf.extend(encode_frame(epoch, &entries).expect("a small frame encodes"));
    }
    let whole = buf.len();
    let intact = match src.u8() % 4 {
        0 => {
            let cut = usize::from(src.u16()) % (whole + 1);
            buf.truncate(cut);
            cut == whole
        }
        1 => {
            if !buf.is_empty() {
                let at = usize::from(src.u16()) % buf.len();
                let flip = src.u8() | 1;
                if let Some(b) = buf.get_mut(at) {
                    *b ^= flip;
                }
            }
            buf.is_empty()
        }
        2 => {
            buf.extend_from_slice(src.bytes(64));
            true
        }
        _ => true,
    };
    check_journal(&buf, epoch, 1 << 20);
    if intact {
        let j = decode_frames(&buf, epoch, 1 << 20);
        assert!(j.frames >= frames, "undamaged frames decode whole");
        assert!(
            j.entries.len() >= entries_total,
            "every entry of undamaged frames"
        );
    }
}
