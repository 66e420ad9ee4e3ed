#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Chunked snapshot assembly: order, round, sorting, duplicates, bounds.

mod common;

use common::*;
use rvbox_domain::error::Code;
use rvbox_domain::ids::IdError;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_reconcile::limits::{
    MAX_CHUNK_BYTES, MAX_SNAPSHOT_CHUNKS, MAX_SNAPSHOT_RECORDS, MAX_SNAPSHOT_TOMBSTONES,
};
use rvbox_reconcile::{Assembly, List, SnapshotAssembler, SnapshotError};

fn push(
    asm: SnapshotAssembler,
    c: &wire::ClientSnapshot,
) -> Result<SnapshotAssembler, SnapshotError> {
    match asm.push(c)? {
        Assembly::Incomplete(a) => Ok(a),
        Assembly::Complete(_) => panic!("completed early"),
    }
}

fn r(i: u32) -> wire::SnapshotRecord {
    rec(i, Lifecycle::Running, 1, 0, 0)
}

#[test]
fn a_single_final_chunk_completes() {
    let s = assemble(
        ROUND,
        &[chunk(ROUND, 0, true, vec![r(1), r(2)], vec![tomb(3)])],
    )
    .unwrap();
    assert_eq!(s.round(), ROUND);
    assert_eq!(s.store_health(), wire::ScopeState::Ready);
    assert_eq!(
        s.records().map(|x| x.issue_uuid).collect::<Vec<_>>(),
        vec![uuid(1), uuid(2)]
    );
    assert_eq!(s.tombstone(&uuid(3)), Some(&hash(3)));
}

#[test]
fn only_the_final_chunk_completes() {
    let asm = SnapshotAssembler::new(ROUND);
    let asm = push(asm, &chunk(ROUND, 0, false, vec![r(1)], vec![])).unwrap();
    assert_eq!(asm.next_chunk_index(), 1);
    let asm = push(asm, &chunk(ROUND, 1, false, vec![], vec![tomb(2)])).unwrap();
    match asm
        .push(&chunk(ROUND, 2, true, vec![r(3)], vec![]))
        .unwrap()
    {
        Assembly::Complete(s) => {
            assert_eq!(s.records().count(), 2);
            assert_eq!(s.tombstones().count(), 1);
        }
        Assembly::Incomplete(_) => panic!("final chunk did not complete"),
    }
}

#[test]
fn a_chunk_out_of_order_is_refused() {
    let err = SnapshotAssembler::new(ROUND)
        .push(&chunk(ROUND, 1, true, vec![], vec![]))
        .unwrap_err();
    assert_eq!(
        err,
        SnapshotError::ChunkOutOfOrder {
            expected: 0,
            got: 1
        }
    );
    assert_eq!(err.code(), Code::ProtocolError);
    // a repeated chunk index
    let asm = push(
        SnapshotAssembler::new(ROUND),
        &chunk(ROUND, 0, false, vec![r(1)], vec![]),
    )
    .unwrap();
    assert_eq!(
        asm.push(&chunk(ROUND, 0, true, vec![r(2)], vec![]))
            .unwrap_err(),
        SnapshotError::ChunkOutOfOrder {
            expected: 1,
            got: 0
        }
    );
}

#[test]
fn a_chunk_of_another_round_is_refused() {
    let asm = push(
        SnapshotAssembler::new(3),
        &chunk(3, 0, false, vec![], vec![]),
    )
    .unwrap();
    assert_eq!(
        asm.push(&chunk(2, 1, true, vec![], vec![])).unwrap_err(),
        SnapshotError::WrongRound {
            chunk_index: 1,
            expected: 3,
            got: 2
        }
    );
}

#[test]
fn unsorted_records_are_refused_within_and_across_chunks() {
    let err = assemble(ROUND, &[chunk(ROUND, 0, true, vec![r(2), r(1)], vec![])]).unwrap_err();
    assert_eq!(
        err,
        SnapshotError::NotSorted {
            chunk_index: 0,
            list: List::Records,
            issue_uuid: uuid(1),
            previous: uuid(2)
        }
    );
    let err = assemble(
        ROUND,
        &[
            chunk(ROUND, 0, false, vec![r(5)], vec![]),
            chunk(ROUND, 1, true, vec![r(4)], vec![]),
        ],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::NotSorted { chunk_index: 1, .. }
    ));
}

#[test]
fn unsorted_tombstones_are_refused() {
    let err = assemble(
        ROUND,
        &[
            chunk(ROUND, 0, false, vec![], vec![tomb(8)]),
            chunk(ROUND, 1, true, vec![], vec![tomb(7)]),
        ],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::NotSorted {
            chunk_index: 1,
            list: List::Tombstones,
            ..
        }
    ));
}

#[test]
fn duplicates_are_refused_within_and_across_chunks() {
    let err = assemble(ROUND, &[chunk(ROUND, 0, true, vec![r(1), r(1)], vec![])]).unwrap_err();
    assert_eq!(
        err,
        SnapshotError::Duplicate {
            chunk_index: 0,
            list: List::Records,
            issue_uuid: uuid(1)
        }
    );
    let err = assemble(
        ROUND,
        &[
            chunk(ROUND, 0, false, vec![], vec![tomb(1)]),
            chunk(ROUND, 1, true, vec![], vec![tomb(1)]),
        ],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::Duplicate {
            chunk_index: 1,
            list: List::Tombstones,
            ..
        }
    ));
}

#[test]
fn a_uuid_both_record_and_tombstone_is_refused() {
    let err = assemble(ROUND, &[chunk(ROUND, 0, true, vec![r(1)], vec![tomb(1)])]).unwrap_err();
    assert_eq!(
        err,
        SnapshotError::RecordAndTombstone {
            chunk_index: 0,
            issue_uuid: uuid(1)
        }
    );
    let err = assemble(
        ROUND,
        &[
            chunk(ROUND, 0, false, vec![], vec![tomb(4)]),
            chunk(ROUND, 1, true, vec![r(4)], vec![]),
        ],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::RecordAndTombstone { chunk_index: 1, .. }
    ));
}

#[test]
fn non_canonical_or_non_v7_uuids_are_refused_with_their_position() {
    let good = uuid(0x00ab_cdef).to_string();
    assert_ne!(good, good.to_uppercase());
    let cases = [
        (good.to_uppercase(), "not canonical"),
        (String::new(), "empty"),
        (good.replace('-', ""), "unhyphenated"),
        // version nibble 4
        (format!("{}4{}", &good[..14], &good[15..]), "v4"),
    ];
    for (text, what) in cases {
        let mut bad = r(2);
        bad.issue_uuid = text;
        let err = assemble(ROUND, &[chunk(ROUND, 0, true, vec![r(1), bad], vec![])]).unwrap_err();
        match err {
            SnapshotError::BadIssueUuid {
                chunk_index: 0,
                list: List::Records,
                position: 1,
                source,
            } => assert!(
                matches!(
                    source,
                    IdError::NotCanonical { .. }
                        | IdError::Empty { .. }
                        | IdError::WrongVersion { .. }
                ),
                "{what}"
            ),
            other => panic!("{what}: {other:?}"),
        }
    }
    let mut t = tomb(1);
    t.issue_uuid = "nope".into();
    assert!(matches!(
        assemble(ROUND, &[chunk(ROUND, 0, true, vec![], vec![t])]).unwrap_err(),
        SnapshotError::BadIssueUuid {
            list: List::Tombstones,
            position: 0,
            ..
        }
    ));
}

#[test]
fn request_hashes_must_be_exactly_32_bytes() {
    for len in [0usize, 31, 33] {
        let mut bad = r(1);
        bad.request_hash = vec![7; len];
        assert_eq!(
            assemble(ROUND, &[chunk(ROUND, 0, true, vec![bad], vec![])]).unwrap_err(),
            SnapshotError::BadRequestHash {
                chunk_index: 0,
                list: List::Records,
                issue_uuid: uuid(1),
                len
            }
        );
        let mut t = tomb(1);
        t.request_hash = vec![7; len];
        assert!(matches!(
            assemble(ROUND, &[chunk(ROUND, 0, true, vec![], vec![t])]).unwrap_err(),
            SnapshotError::BadRequestHash {
                list: List::Tombstones,
                ..
            }
        ));
    }
}

#[test]
fn record_lifecycles_a_client_never_holds_are_refused() {
    for lc in [Lifecycle::Queued, Lifecycle::Dispatched, Lifecycle::Expired] {
        let err = assemble(
            ROUND,
            &[chunk(ROUND, 0, true, vec![rec(1, lc, 1, 0, 0)], vec![])],
        )
        .unwrap_err();
        assert!(
            matches!(err, SnapshotError::NotLocalLifecycle { lifecycle, .. } if lifecycle == lc),
            "{lc}"
        );
    }
    for raw in [0, 99] {
        let mut bad = r(1);
        bad.lifecycle = raw;
        assert!(matches!(
            assemble(ROUND, &[chunk(ROUND, 0, true, vec![bad], vec![])]).unwrap_err(),
            SnapshotError::UnknownLifecycle { raw: got, .. } if got == raw
        ));
    }
}

#[test]
fn record_field_bounds_are_checked() {
    let err = assemble(
        ROUND,
        &[chunk(
            ROUND,
            0,
            true,
            vec![rec(1, Lifecycle::Running, 0, 0, 0)],
            vec![],
        )],
    )
    .unwrap_err();
    assert!(matches!(err, SnapshotError::RevisionZero { .. }));
    let err = assemble(
        ROUND,
        &[chunk(
            ROUND,
            0,
            true,
            vec![rec(1, Lifecycle::Running, 1, 3, 4)],
            vec![],
        )],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::AckedAboveAssigned {
            acked: 4,
            assigned: 3,
            ..
        }
    ));
    let mut big = r(1);
    big.script_received_bytes = 10 * 1024 * 1024 + 1;
    assert!(matches!(
        assemble(ROUND, &[chunk(ROUND, 0, true, vec![big], vec![])]).unwrap_err(),
        SnapshotError::ScriptTooLarge { .. }
    ));
}

#[test]
fn store_health_must_be_known_and_the_same_in_every_chunk() {
    let mut c = chunk(ROUND, 0, true, vec![], vec![]);
    c.store_health = wire::ScopeState::Unspecified as i32;
    assert!(matches!(
        assemble(ROUND, &[c]).unwrap_err(),
        SnapshotError::UnknownStoreHealth { raw: 0, .. }
    ));
    let c0 = chunk(ROUND, 0, false, vec![], vec![]);
    let mut c1 = chunk(ROUND, 1, true, vec![], vec![]);
    c1.store_health = wire::ScopeState::DirtyReadable as i32;
    assert_eq!(
        assemble(ROUND, &[c0, c1]).unwrap_err(),
        SnapshotError::StoreHealthChanged {
            chunk_index: 1,
            first: wire::ScopeState::Ready,
            got: wire::ScopeState::DirtyReadable
        }
    );
}

#[test]
fn record_total_is_bounded_at_the_limit() {
    let all: Vec<_> = (0..=u32::try_from(MAX_SNAPSHOT_RECORDS).unwrap())
        .map(r)
        .collect();
    // Exactly the limit, in envelope-sized chunks, completes.
    let at_limit = &all[..MAX_SNAPSHOT_RECORDS];
    let chunks: Vec<_> = at_limit
        .chunks(8_000)
        .enumerate()
        .map(|(i, c)| chunk(ROUND, u32::try_from(i).unwrap(), false, c.to_vec(), vec![]))
        .collect();
    let mut asm = SnapshotAssembler::new(ROUND);
    for c in &chunks {
        asm = push(asm, c).unwrap();
    }
    let n = u32::try_from(chunks.len()).unwrap();
    let done = asm
        .clone()
        .push(&chunk(ROUND, n, true, vec![], vec![]))
        .unwrap();
    assert!(matches!(done, Assembly::Complete(s) if s.records().count() == MAX_SNAPSHOT_RECORDS));
    // One more is refused.
    let err = asm
        .push(&chunk(
            ROUND,
            n,
            true,
            vec![all[MAX_SNAPSHOT_RECORDS].clone()],
            vec![],
        ))
        .unwrap_err();
    assert_eq!(
        err,
        SnapshotError::TooManyRecords {
            chunk_index: n,
            count: MAX_SNAPSHOT_RECORDS + 1,
            limit: MAX_SNAPSHOT_RECORDS
        }
    );
}

#[test]
fn tombstone_total_is_bounded_at_the_limit() {
    let all: Vec<_> = (0..=u32::try_from(MAX_SNAPSHOT_TOMBSTONES).unwrap())
        .map(tomb)
        .collect();
    let ok = assemble(
        ROUND,
        &[chunk(
            ROUND,
            0,
            true,
            vec![],
            all[..MAX_SNAPSHOT_TOMBSTONES].to_vec(),
        )],
    )
    .unwrap();
    assert_eq!(ok.tombstones().count(), MAX_SNAPSHOT_TOMBSTONES);
    let err = assemble(ROUND, &[chunk(ROUND, 0, true, vec![], all)]).unwrap_err();
    assert!(matches!(err, SnapshotError::TooManyTombstones { .. }));
}

#[test]
fn an_oversized_chunk_is_refused() {
    // ~14,000 records encode to more than 1 MiB while staying under the
    // record total.
    let records: Vec<_> = (0..14_000).map(r).collect();
    let c = chunk(ROUND, 0, true, records, vec![]);
    match assemble(ROUND, &[c]).unwrap_err() {
        SnapshotError::ChunkTooLarge { bytes, limit, .. } => {
            assert_eq!(limit, MAX_CHUNK_BYTES);
            assert!(bytes > MAX_CHUNK_BYTES);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_chunk_count_is_bounded() {
    let mut asm = SnapshotAssembler::new(ROUND);
    let last = u32::try_from(MAX_SNAPSHOT_CHUNKS).unwrap();
    for i in 0..last {
        asm = push(asm, &chunk(ROUND, i, false, vec![], vec![])).unwrap();
    }
    assert_eq!(
        asm.push(&chunk(ROUND, last, true, vec![], vec![]))
            .unwrap_err(),
        SnapshotError::TooManyChunks {
            chunk_index: last,
            limit: MAX_SNAPSHOT_CHUNKS
        }
    );
}
