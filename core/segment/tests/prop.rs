#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Property tests: any damage never panics and always yields a consistent
//! decision; undamaged segments are Clean with every record.

mod common;

use common::{LIMITS, UUID};
use proptest::prelude::*;
use rvbox_segment::{
    ByteRange, Compression, Kind, RecordMeta, Recovery, Scan, Stream, decode, encode, scan, sha256,
};

#[derive(Debug, Clone)]
struct Spec {
    kind: Kind,
    zstd: bool,
    payload: Vec<u8>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0usize..6,
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(|(k, zstd, payload)| Spec {
            kind: Kind::ALL[k],
            zstd,
            payload,
        })
}

fn build(specs: &[Spec]) -> (Vec<u8>, Vec<(u64, u64, RecordMeta)>) {
    let mut buf = Vec::new();
    let mut recs = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let seq = i as u64 + 1;
        let meta = RecordMeta {
            issue_uuid: if s.kind == Kind::Audit { [0; 16] } else { UUID },
            seq,
            observed_unix_ms: seq as i64 * 10,
            receipt_unix_ms: seq as i64 * 11,
            kind: s.kind,
            stream: match s.kind {
                Kind::Output if seq.is_multiple_of(2) => Stream::Stderr,
                Kind::Output => Stream::Stdout,
                _ => Stream::None,
            },
            compression: if s.zstd {
                Compression::Zstd
            } else {
                Compression::None
            },
            raw_len: if s.zstd {
                s.payload.len() as u32 * 2
            } else {
                s.payload.len() as u32
            },
            sha256: sha256(&s.payload),
        };
        let bytes = encode(&meta, &s.payload, &LIMITS).unwrap();
        recs.push((buf.len() as u64, bytes.len() as u64, meta));
        buf.extend_from_slice(&bytes);
    }
    (buf, recs)
}

#[derive(Debug, Clone)]
enum Damage {
    None,
    Truncate(prop::sample::Index),
    Flip(prop::sample::Index, u8),
    Overwrite(prop::sample::Index, Vec<u8>),
    Append(Vec<u8>),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        Just(Damage::None),
        any::<prop::sample::Index>().prop_map(Damage::Truncate),
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, m)| Damage::Flip(i, m)),
        (
            any::<prop::sample::Index>(),
            proptest::collection::vec(any::<u8>(), 1..40)
        )
            .prop_map(|(i, b)| Damage::Overwrite(i, b)),
        proptest::collection::vec(any::<u8>(), 1..300).prop_map(Damage::Append),
    ]
}

fn apply(buf: &mut Vec<u8>, d: &Damage) {
    match d {
        Damage::None => {}
        Damage::Truncate(i) => {
            let at = i.index(buf.len() + 1);
            buf.truncate(at);
        }
        Damage::Flip(i, m) => {
            if !buf.is_empty() {
                let at = i.index(buf.len());
                buf[at] ^= m;
            }
        }
        Damage::Overwrite(i, bytes) => {
            if !buf.is_empty() {
                let at = i.index(buf.len());
                for (j, b) in bytes.iter().enumerate() {
                    if let Some(x) = buf.get_mut(at + j) {
                        *x = *b;
                    }
                }
            }
        }
        Damage::Append(bytes) => buf.extend_from_slice(bytes),
    }
}

/// Invariants every scan result must satisfy, whatever the input.
fn check_invariants(buf: &[u8], committed_end: u64, s: &Scan) {
    // Records and lost ranges tile 0..committed_end exactly, in order.
    let lost: &[ByteRange] = match &s.recovery {
        Recovery::CommittedDamage {
            lost,
            tail_beyond_committed,
        } => {
            assert!(!lost.is_empty());
            assert_eq!(*tail_beyond_committed, buf.len() as u64 > committed_end);
            lost
        }
        Recovery::TruncateTail { from } => {
            assert_eq!(*from, committed_end);
            assert!(buf.len() as u64 > committed_end);
            &[]
        }
        Recovery::Clean => {
            assert_eq!(buf.len() as u64, committed_end);
            &[]
        }
    };
    let mut pieces: Vec<(u64, u64, bool)> = s
        .records
        .iter()
        .map(|r| (r.offset, r.offset + r.len, true))
        .chain(lost.iter().map(|l| (l.start, l.end, false)))
        .collect();
    pieces.sort();
    let mut at = 0u64;
    for (start, end, _) in &pieces {
        assert_eq!(*start, at, "gap or overlap at {at}: {pieces:?}");
        assert!(end > start);
        at = *end;
    }
    assert_eq!(at, committed_end, "{pieces:?}");
    // Lost ranges are sorted and never adjacent (merged).
    for w in lost.windows(2) {
        assert!(w[0].end < w[1].start);
    }
    // Every listed record really decodes there, within the committed range.
    for r in &s.records {
        let end = (committed_end as usize).min(buf.len());
        let d = decode(&buf[r.offset as usize..end], &LIMITS).unwrap();
        assert_eq!(d.meta, r.meta);
        assert_eq!(d.len, r.len);
    }
    // The unbroken prefix.
    let mut prefix = 0;
    for r in &s.records {
        if r.offset == prefix {
            prefix += r.len;
        } else {
            break;
        }
    }
    assert_eq!(s.valid_prefix_end, prefix);
    assert_eq!(s.damage.is_empty(), lost.is_empty());
    assert!(s.lost_seqs_hint.len() <= s.damage.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn undamaged_segment_is_clean_with_every_record(specs in proptest::collection::vec(spec(), 0..8)) {
        let (buf, recs) = build(&specs);
        let s = scan(&buf, buf.len() as u64, &LIMITS);
        prop_assert_eq!(&s.recovery, &Recovery::Clean);
        prop_assert_eq!(s.records.len(), recs.len());
        for (got, (off, len, meta)) in s.records.iter().zip(&recs) {
            prop_assert_eq!((got.offset, got.len, &got.meta), (*off, *len, meta));
        }
        prop_assert_eq!(s.valid_prefix_end, buf.len() as u64);
    }

    #[test]
    fn undamaged_with_uncommitted_records_truncates_the_tail(
        specs in proptest::collection::vec(spec(), 1..8),
        k in any::<prop::sample::Index>(),
    ) {
        let (buf, recs) = build(&specs);
        let k = k.index(recs.len());
        let committed = recs[k].0;
        let s = scan(&buf, committed, &LIMITS);
        prop_assert_eq!(&s.recovery, &Recovery::TruncateTail { from: committed });
        prop_assert_eq!(s.records.len(), k);
        check_invariants(&buf, committed, &s);
    }

    #[test]
    fn random_damage_never_panics_and_stays_consistent(
        specs in proptest::collection::vec(spec(), 0..8),
        dmg in proptest::collection::vec(damage(), 0..3),
        committed_choice in any::<prop::sample::Index>(),
        committed_on_boundary in any::<bool>(),
    ) {
        let (mut buf, recs) = build(&specs);
        let committed = if committed_on_boundary {
            let ends: Vec<u64> = std::iter::once(0).chain(recs.iter().map(|r| r.0 + r.1)).collect();
            ends[committed_choice.index(ends.len())]
        } else {
            committed_choice.index(buf.len() + 64) as u64
        };
        for d in &dmg {
            apply(&mut buf, d);
        }
        let s = scan(&buf, committed, &LIMITS);
        check_invariants(&buf, committed, &s);
        // Decoding at every offset never panics either.
        for i in 0..buf.len().min(400) {
            let _ = decode(&buf[i..], &LIMITS);
        }
    }

    /// One damaged byte in a committed record loses exactly that record and
    /// nothing else (random payloads do not imitate a valid record).
    #[test]
    fn one_flip_loses_exactly_one_record(
        specs in proptest::collection::vec(spec(), 1..8),
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let (mut buf, recs) = build(&specs);
        let committed = buf.len() as u64;
        let k = which.index(recs.len());
        let (off, len, _) = &recs[k];
        let i = *off as usize + at.index(*len as usize);
        buf[i] ^= mask;
        let s = scan(&buf, committed, &LIMITS);
        prop_assert_eq!(
            &s.recovery,
            &Recovery::CommittedDamage {
                lost: vec![ByteRange { start: *off, end: off + len }],
                tail_beyond_committed: false,
            }
        );
        let expected: Vec<u64> = recs.iter().filter(|r| r.0 != *off).map(|r| r.0).collect();
        let got: Vec<u64> = s.records.iter().map(|r| r.offset).collect();
        prop_assert_eq!(got, expected);
        check_invariants(&buf, committed, &s);
    }
}
