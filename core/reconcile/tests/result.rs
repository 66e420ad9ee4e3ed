#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The wire result: digest, the client's check, the request, and the
//! worst-case sizes behind the limits.

mod common;

use std::collections::BTreeMap;

use common::*;
use prost::Message as _;
use rvbox_domain::lifecycle::{Lifecycle, Phase};
use rvbox_domain::limits::MAX_SCRIPT_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_reconcile::limits::{
    MAX_RECONCILE_ROWS, MAX_RESULT_BYTES, MAX_SNAPSHOT_RECORDS, RESUME_ROW_MAX_BYTES,
    UUID_ENTRY_BYTES,
};
use rvbox_reconcile::{
    Assembly, ResultError, ResultList, ServerInputError, ServerKnown, SnapshotAssembler, Source,
    build_request, check_result, reconcile, result_digest,
};
use sha2::{Digest as _, Sha256};

fn sample() -> wire::ReconcileResult {
    let out = run(
        &[
            row(1, Phase::Dispatched, 1, 0),
            row(3, Phase::Running, 2, 4),
        ],
        &known(&[
            (2, ServerKnown::Missing),
            (4, terminal(4, Lifecycle::Failed, 1)),
        ]),
        &snap(
            vec![
                rec(1, Lifecycle::Accepted, 1, 0, 0),
                rec(2, Lifecycle::Running, 1, 0, 0),
                rec(3, Lifecycle::Running, 2, 6, 4),
                rec(4, Lifecycle::Failed, 1, 1, 1),
            ],
            vec![],
        ),
    )
    .unwrap();
    out.result().clone()
}

fn reseal(mut r: wire::ReconcileResult) -> wire::ReconcileResult {
    r.result_digest = result_digest(&r).to_vec();
    r
}

#[test]
fn the_digest_is_sha256_of_the_encoding_without_the_digest() {
    let r = sample();
    let mut unsealed = r.clone();
    unsealed.result_digest.clear();
    let expected = Sha256::digest(unsealed.encode_to_vec());
    assert_eq!(r.result_digest.as_slice(), expected.as_slice());
    assert_eq!(r.result_digest.len(), 32);
    // the digest ignores whatever digest the message carries
    assert_eq!(result_digest(&r), result_digest(&unsealed));
}

#[test]
fn a_checked_result_returns_its_lists() {
    let r = sample();
    let c = check_result(&r, ROUND).unwrap();
    assert_eq!(c.terminate, vec![uuid(2)]);
    assert_eq!(c.discard, vec![uuid(4)]);
    assert_eq!(
        c.resume.keys().copied().collect::<Vec<_>>(),
        vec![uuid(1), uuid(3)]
    );
    assert_eq!(c.resume[&uuid(3)].durable_event_seq, 4);
    assert_eq!(c.digest.to_vec(), r.result_digest);
}

#[test]
fn a_tampered_or_missing_digest_is_refused() {
    let mut r = sample();
    r.resume[0].durable_event_seq += 1;
    assert_eq!(check_result(&r, ROUND), Err(ResultError::DigestMismatch));
    let mut r = sample();
    r.result_digest.pop();
    assert_eq!(check_result(&r, ROUND), Err(ResultError::DigestMismatch));
}

#[test]
fn the_client_refuses_a_result_for_another_round() {
    assert_eq!(
        check_result(&sample(), 2),
        Err(ResultError::WrongRound {
            expected: 2,
            got: 1
        })
    );
}

#[test]
fn the_client_refuses_unsorted_duplicate_or_shared_entries() {
    let mut r = sample();
    r.discard_local_terminal_issue_uuids = strings(&[5, 4]);
    assert!(matches!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::NotSorted {
            list: ResultList::Discard,
            ..
        })
    ));
    let mut r = sample();
    r.terminate_local_issue_uuids = strings(&[2, 2]);
    assert!(matches!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::Duplicate {
            list: ResultList::Terminate,
            ..
        })
    ));
    let mut r = sample();
    r.terminate_local_issue_uuids = strings(&[2, 4]);
    assert_eq!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::InSeveralLists {
            issue_uuid: uuid(4)
        })
    );
    let mut r = sample();
    r.resume.swap(0, 1);
    assert!(matches!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::NotSorted {
            list: ResultList::Resume,
            ..
        })
    ));
    let mut r = sample();
    r.resume[0].revision = 0;
    assert!(matches!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::RevisionZero { .. })
    ));
    let mut r = sample();
    r.terminate_local_issue_uuids[0] = r.terminate_local_issue_uuids[0].to_uppercase();
    r.terminate_local_issue_uuids[0].push('x');
    assert!(matches!(
        check_result(&reseal(r), ROUND),
        Err(ResultError::BadIssueUuid {
            list: ResultList::Terminate,
            position: 0,
            ..
        })
    ));
}

#[test]
fn the_request_lists_rows_sorted_whatever_the_query_order() {
    let rows = [
        row(3, Phase::Running, 2, 7),
        row(1, Phase::Queued, 1, 0),
        row(2, Phase::LaunchPrepared, 1, 0),
    ];
    let req = build_request(4, &rows).unwrap();
    assert_eq!(req.round, 4);
    let ids: Vec<_> = req.rows.iter().map(|r| r.issue_uuid.clone()).collect();
    assert_eq!(ids, strings(&[1, 2, 3]));
    assert_eq!(req.rows[1].lifecycle, wire::Lifecycle::Accepted as i32);
    assert_eq!(
        req.rows[2],
        wire::ReconcileRow {
            issue_uuid: uuid(3).to_string(),
            durable_event_seq: 7,
            revision: 2,
            request_hash: hash(3).as_bytes().to_vec(),
            lifecycle: wire::Lifecycle::Running as i32,
        }
    );
    assert_eq!(build_request(0, &rows), Err(ServerInputError::RoundZero));
    assert!(matches!(
        build_request(1, &[rows[0], rows[0]]),
        Err(ServerInputError::DuplicateRow { .. })
    ));
}

#[test]
fn the_largest_request_fits_one_envelope() {
    let rows: Vec<_> = (0..u32::try_from(MAX_RECONCILE_ROWS).unwrap())
        .map(|i| row(i, Phase::Running, u64::MAX, u64::MAX))
        .collect();
    let req = build_request(u64::MAX, &rows).unwrap();
    assert!(
        req.encoded_len() <= MAX_RESULT_BYTES,
        "{}",
        req.encoded_len()
    );
}

#[test]
fn the_largest_result_fits_one_envelope() {
    // Every requested row kept with maximal varints, plus as many unlisted
    // records as the snapshot limit leaves, each one uuid entry.
    let n_rows = u32::try_from(MAX_RECONCILE_ROWS).unwrap();
    let n_all = u32::try_from(MAX_SNAPSHOT_RECORDS).unwrap();
    let rows: Vec<_> = (0..n_rows)
        .map(|i| {
            let mut r = row(i, Phase::Running, u64::MAX, u64::MAX);
            r.source = Source::Script {
                size_bytes: MAX_SCRIPT_BYTES,
                upload_committed: false,
            };
            r
        })
        .collect();
    let records: Vec<_> = (0..n_all)
        .map(|i| {
            let mut r = rec(i, Lifecycle::Running, u64::MAX, u64::MAX, u64::MAX);
            if i < n_rows {
                r.script_received_bytes = MAX_SCRIPT_BYTES - 1;
            } else {
                r.last_assigned_event_seq = 0;
                r.acked_event_seq = 0;
            }
            r
        })
        .collect();
    let known: BTreeMap<_, _> = (n_rows..n_all)
        .map(|i| (uuid(i), ServerKnown::Missing))
        .collect();
    let mut asm = SnapshotAssembler::new(u64::MAX);
    let chunks: Vec<_> = records.chunks(8_000).collect();
    let mut done = None;
    for (i, c) in chunks.iter().enumerate() {
        let mut ch = chunk(
            u64::MAX,
            u32::try_from(i).unwrap(),
            i + 1 == chunks.len(),
            c.to_vec(),
            vec![],
        );
        ch.round = u64::MAX;
        match asm.push(&ch).unwrap() {
            Assembly::Incomplete(a) => asm = a,
            Assembly::Complete(s) => {
                done = Some(s);
                break;
            }
        }
    }
    let s = done.unwrap();
    let out = reconcile(u64::MAX, &rows, &known, &s).unwrap();
    assert_eq!(out.result().resume.len(), MAX_RECONCILE_ROWS);
    assert_eq!(
        out.result().terminate_local_issue_uuids.len(),
        MAX_SNAPSHOT_RECORDS - MAX_RECONCILE_ROWS
    );
    let len = out.result().encoded_len();
    assert!(len <= MAX_RESULT_BYTES, "{len} > {MAX_RESULT_BYTES}");
    // and the per-entry bounds the limit's rationale uses hold
    let bound = 11
        + 34
        + MAX_RECONCILE_ROWS * RESUME_ROW_MAX_BYTES
        + (MAX_SNAPSHOT_RECORDS - MAX_RECONCILE_ROWS) * UUID_ENTRY_BYTES;
    assert!(len <= bound, "{len} > {bound}");
    assert!(bound <= MAX_RESULT_BYTES);
}
