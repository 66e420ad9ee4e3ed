#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The recovery decision for one segment: every verdict and the exact lost
//! ranges (plan §5.3, R-5.3-14/15/18/20).

mod common;

use common::{LIMITS, record, segment};
use rvbox_segment::{ByteRange, DecodeError, Limits, Recovery, Scan, scan};

fn range(start: u64, end: u64) -> ByteRange {
    ByteRange { start, end }
}

fn offsets(s: &Scan) -> Vec<u64> {
    s.records.iter().map(|r| r.offset).collect()
}

fn seqs(s: &Scan) -> Vec<u64> {
    s.records.iter().map(|r| r.meta.seq).collect()
}

const LENS: [usize; 5] = [10, 0, 300, 5, 64];

#[test]
fn clean_segment() {
    let (buf, recs) = segment(&LENS);
    let s = scan(&buf, buf.len() as u64, &LIMITS);
    assert_eq!(s.recovery, Recovery::Clean);
    assert_eq!(s.records.len(), LENS.len());
    for (got, (off, len, meta)) in s.records.iter().zip(&recs) {
        assert_eq!((got.offset, got.len, &got.meta), (*off, *len, meta));
    }
    assert_eq!(s.valid_prefix_end, buf.len() as u64);
    assert!(s.lost_seqs_hint.is_empty());
    assert!(s.damage.is_empty());
}

#[test]
fn empty_file_with_committed_zero_is_clean() {
    let s = scan(&[], 0, &LIMITS);
    assert_eq!(s.recovery, Recovery::Clean);
    assert!(s.records.is_empty());
    assert_eq!(s.valid_prefix_end, 0);
}

#[test]
fn uncommitted_complete_tail_is_truncated() {
    let (buf, recs) = segment(&LENS);
    for (k, rec) in recs.iter().enumerate() {
        let committed = rec.0; // records 0..k committed, k.. are tail
        let s = scan(&buf, committed, &LIMITS);
        assert_eq!(
            s.recovery,
            Recovery::TruncateTail { from: committed },
            "k={k}"
        );
        assert_eq!(s.records.len(), k, "tail records are never listed");
        assert_eq!(s.valid_prefix_end, committed);
        assert!(s.damage.is_empty());
    }
}

#[test]
fn torn_tail_at_every_length_is_truncated() {
    let (mut buf, _) = segment(&LENS[..3]);
    let committed = buf.len() as u64;
    let (_, extra) = record(99, 50);
    for cut in 1..extra.len() {
        buf.truncate(committed as usize);
        buf.extend_from_slice(&extra[..cut]);
        let s = scan(&buf, committed, &LIMITS);
        assert_eq!(
            s.recovery,
            Recovery::TruncateTail { from: committed },
            "cut={cut}"
        );
        assert_eq!(s.records.len(), 3);
    }
}

#[test]
fn garbage_beyond_committed_is_truncated() {
    let (mut buf, _) = segment(&LENS);
    let committed = buf.len() as u64;
    buf.extend_from_slice(&[0xAB; 1000]);
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(s.recovery, Recovery::TruncateTail { from: committed });
    assert_eq!(s.records.len(), LENS.len());

    let s0 = scan(b"RVSG garbage", 0, &LIMITS);
    assert_eq!(s0.recovery, Recovery::TruncateTail { from: 0 });
    assert!(s0.records.is_empty());
}

#[test]
fn file_shorter_than_committed_on_a_record_boundary() {
    let (buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    let short = &buf[..recs[3].0 as usize];
    let s = scan(short, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(recs[3].0, committed)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(seqs(&s), vec![1, 2, 3]);
    assert_eq!(s.valid_prefix_end, recs[3].0);
    assert_eq!(s.damage.len(), 1);
    assert_eq!(s.damage[0].offset, recs[3].0);
    assert_eq!(s.damage[0].error.code(), "truncated");
    assert!(s.lost_seqs_hint.is_empty());

    // Every byte missing: nothing read at all.
    let s = scan(&[], committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(0, committed)],
            tail_beyond_committed: false
        }
    );
}

#[test]
fn file_shorter_than_committed_inside_a_record() {
    let (buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    let (off, len, _) = recs[2];
    for cut in off + 1..off + len {
        let s = scan(&buf[..cut as usize], committed, &LIMITS);
        assert_eq!(
            s.recovery,
            Recovery::CommittedDamage {
                lost: vec![range(off, committed)],
                tail_beyond_committed: false
            },
            "cut={cut}"
        );
        assert_eq!(seqs(&s), vec![1, 2]);
        // The header survived: the lost event is known.
        let expect_hint: Vec<u64> = if cut >= off + 128 { vec![3] } else { vec![] };
        assert_eq!(s.lost_seqs_hint, expect_hint, "cut={cut}");
    }
}

/// Any single corrupted byte of a middle record loses exactly that record;
/// the records after it are still found (header damage by resync, payload
/// damage by the header's verified length).
#[test]
fn corrupted_middle_record_loses_exactly_its_range() {
    let (buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    for k in [0usize, 2, 3] {
        let (off, len, ref meta) = recs[k];
        for i in off..off + len {
            let mut bad = buf.clone();
            bad[i as usize] ^= 0x20;
            let s = scan(&bad, committed, &LIMITS);
            assert_eq!(
                s.recovery,
                Recovery::CommittedDamage {
                    lost: vec![range(off, off + len)],
                    tail_beyond_committed: false
                },
                "record {k} byte {i}"
            );
            let expected: Vec<u64> = recs.iter().filter(|r| r.0 != off).map(|r| r.0).collect();
            assert_eq!(offsets(&s), expected, "record {k} byte {i}");
            assert_eq!(s.valid_prefix_end, off);
            assert_eq!(s.damage.len(), 1);
            assert_eq!(s.damage[0].offset, off);
            if i >= off + 128 {
                assert_eq!(s.damage[0].error, DecodeError::BadRecordCrc);
                assert_eq!(s.lost_seqs_hint, vec![meta.seq]);
            } else {
                assert!(s.lost_seqs_hint.is_empty());
            }
        }
    }
}

#[test]
fn corrupted_last_committed_record() {
    let (mut buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    let (off, _, _) = recs[4];
    buf[off as usize + 130] ^= 1; // payload
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(off, committed)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(s.records.len(), 4);
    assert_eq!(s.lost_seqs_hint, vec![5]);

    // Same with an uncommitted tail after it, and with the header hit.
    buf[off as usize + 130] ^= 1;
    buf[off as usize + 3] ^= 1; // magic
    let (_, tail) = record(6, 20);
    buf.extend_from_slice(&tail);
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(off, committed)],
            tail_beyond_committed: true
        }
    );
    assert_eq!(s.records.len(), 4, "the valid tail record is not listed");
    assert_eq!(s.damage[0].error, DecodeError::BadMagic);
}

#[test]
fn committed_end_inside_a_record_is_damage() {
    let (buf, recs) = segment(&LENS);
    let (off, len, _) = recs[2];
    for committed in [
        off + 1,
        off + 50,
        off + 127,
        off + 128,
        off + 200,
        off + len - 1,
    ] {
        let s = scan(&buf, committed, &LIMITS);
        assert_eq!(
            s.recovery,
            Recovery::CommittedDamage {
                lost: vec![range(off, committed)],
                tail_beyond_committed: true
            },
            "committed={committed}"
        );
        assert_eq!(seqs(&s), vec![1, 2]);
        assert_eq!(s.damage[0].error.code(), "truncated");
    }
    // On the record's own boundary it is fine.
    assert_eq!(
        scan(&buf, off + len, &LIMITS).recovery,
        Recovery::TruncateTail { from: off + len }
    );
}

#[test]
fn junk_between_records_is_lost_exactly() {
    let (_, a) = record(1, 30);
    let (_, b) = record(2, 40);
    let mut buf = a.clone();
    buf.extend_from_slice(b"RVSG\x01\x00junk");
    buf.extend_from_slice(&b);
    let committed = buf.len() as u64;
    let s = scan(&buf, committed, &LIMITS);
    let junk_start = a.len() as u64;
    let junk_end = junk_start + 10;
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(junk_start, junk_end)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(offsets(&s), vec![0, junk_end]);
}

#[test]
fn consecutive_damaged_records_merge_into_one_range() {
    let (mut buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    buf[recs[2].0 as usize + 140] ^= 1; // payload of record 2: trusted extent
    buf[recs[3].0 as usize + 10] ^= 1; // header of record 3: resync
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(recs[2].0, recs[4].0)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(seqs(&s), vec![1, 2, 5]);
    assert_eq!(s.damage.len(), 2);
    assert_eq!(s.lost_seqs_hint, vec![3]);
}

#[test]
fn two_separate_damaged_ranges() {
    let (mut buf, recs) = segment(&LENS);
    let committed = buf.len() as u64;
    buf[recs[0].0 as usize + 20] ^= 1;
    buf[recs[3].0 as usize + 20] ^= 1;
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(0, recs[1].0), range(recs[3].0, recs[4].0)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(seqs(&s), vec![2, 3, 5]);
    assert_eq!(s.valid_prefix_end, 0);
}

#[test]
fn resync_ignores_a_valid_record_crossing_committed_end() {
    let (_, a) = record(1, 30);
    let (_, b) = record(2, 40);
    let mut buf = vec![0u8; 7];
    buf.extend_from_slice(&a);
    buf.extend_from_slice(&b);
    let committed = 7 + a.len() as u64 + 150; // inside b, past its header
    let s = scan(&buf, committed, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(0, 7), range(7 + a.len() as u64, committed)],
            tail_beyond_committed: true
        }
    );
    assert_eq!(offsets(&s), vec![7]);
    assert_eq!(s.lost_seqs_hint, vec![2]);
}

#[test]
fn all_garbage_committed_range_is_lost() {
    let buf = vec![0x5a; 4096];
    let s = scan(&buf, 4000, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(0, 4000)],
            tail_beyond_committed: true
        }
    );
    assert!(s.records.is_empty());
    assert_eq!(s.valid_prefix_end, 0);
    assert_eq!(s.damage.len(), 1);
}

#[test]
fn records_above_the_limits_count_as_damage() {
    let (buf, recs) = segment(&LENS);
    let tight = Limits {
        max_stored_len: 100,
        max_raw_len: 100,
    };
    let s = scan(&buf, buf.len() as u64, &tight);
    let (off, len, _) = recs[2]; // the 300-byte record
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(off, off + len)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(s.damage[0].error.code(), "too_large");
    assert_eq!(seqs(&s), vec![1, 2, 4, 5]);
}

/// Recovery is a pure function: the same bytes give the same answer, and
/// applying TruncateTail yields Clean (R-5.3-20).
#[test]
fn scan_is_idempotent_and_truncation_converges() {
    let (mut buf, _) = segment(&LENS);
    let committed = buf.len() as u64;
    buf.extend_from_slice(&record(6, 33).1[..70]);
    let first = scan(&buf, committed, &LIMITS);
    assert_eq!(first, scan(&buf, committed, &LIMITS));
    let Recovery::TruncateTail { from } = first.recovery else {
        panic!("expected TruncateTail")
    };
    buf.truncate(from as usize);
    let after = scan(&buf, committed, &LIMITS);
    assert_eq!(after.recovery, Recovery::Clean);
    assert_eq!(after.records, first.records);
}

/// A large damaged region full of magic bytes is scanned in bounded time:
/// one magic compare per offset, one header CRC where the magic matches.
#[test]
fn large_magic_filled_damage_is_bounded() {
    let (_, good) = record(1, 10);
    let mut buf = Vec::new();
    while buf.len() < 256 * 1024 {
        buf.extend_from_slice(b"RVSG");
    }
    let junk = buf.len() as u64;
    buf.extend_from_slice(&good);
    let s = scan(&buf, buf.len() as u64, &LIMITS);
    assert_eq!(
        s.recovery,
        Recovery::CommittedDamage {
            lost: vec![range(0, junk)],
            tail_beyond_committed: false
        }
    );
    assert_eq!(offsets(&s), vec![junk]);
}
