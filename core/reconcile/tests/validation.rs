#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Validation before any decision (plan §6.4, R-6.4-27), the unhealthy
//! client store (R-6.4-33) and inconsistent caller input.

mod common;

use common::*;
use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use rvbox_reconcile::{
    Action, Disposition, InvalidSnapshot, List, LostEvents, ReconcileError, Resume,
    ServerInputError, ServerKnown, Source, reconcile,
};

fn invalid(err: ReconcileError) -> InvalidSnapshot {
    assert_eq!(err.disposition(), Disposition::ProtocolError);
    assert_eq!(err.code(), Code::ProtocolError);
    match err {
        ReconcileError::InvalidSnapshot(e) => {
            let incident = e.incident();
            assert_eq!(
                incident.kind,
                wire::IncidentKind::ReconciliationContradiction
            );
            assert_eq!(incident.issue_uuid, e.issue_uuid());
            e
        }
        other => panic!("{other:?}"),
    }
}

fn server_bug(err: ReconcileError) -> ServerInputError {
    assert_eq!(err.disposition(), Disposition::ServerBug);
    assert_eq!(err.code(), Code::Internal);
    match err {
        ReconcileError::ServerInput(e) => e,
        other => panic!("{other:?}"),
    }
}

fn other_hash_record(i: u32, lc: Lifecycle) -> wire::SnapshotRecord {
    let mut r = rec(i, lc, 1, 0, 0);
    r.request_hash = hash(i + 1000).as_bytes().to_vec();
    r
}

// ---- immutable request hash ----

#[test]
fn record_with_another_request_hash_is_invalid() {
    let err = run(
        &[row(1, Phase::Dispatched, 1, 0)],
        &no_known(),
        &snap(vec![other_hash_record(1, Lifecycle::Accepted)], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::RequestHashMismatch { issue_uuid, list: List::Records, .. } if issue_uuid == uuid(1)
    ));
}

#[test]
fn tombstone_with_another_request_hash_is_invalid_not_stale_server() {
    let mut t = tomb(1);
    t.request_hash = hash(99).as_bytes().to_vec();
    let err = run(
        &[row(1, Phase::Running, 1, 0)],
        &no_known(),
        &snap(vec![], vec![t]),
    )
    .unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::RequestHashMismatch {
            list: List::Tombstones,
            ..
        }
    ));
}

#[test]
fn record_hash_differing_from_server_terminal_or_tombstone_is_invalid() {
    for k in [terminal(1, Lifecycle::Succeeded, 0), tombstoned(1)] {
        let err = run(
            &[],
            &known(&[(1, k)]),
            &snap(vec![other_hash_record(1, Lifecycle::Succeeded)], vec![]),
        )
        .unwrap_err();
        assert!(matches!(
            invalid(err),
            InvalidSnapshot::RequestHashMismatch { .. }
        ));
    }
}

// ---- revision monotonicity ----

#[test]
fn client_revision_above_the_server_is_invalid() {
    let err = run(
        &[row(1, Phase::Accepted, 2, 0)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Accepted, 3, 0, 0)], vec![]),
    )
    .unwrap_err();
    assert_eq!(
        invalid(err),
        InvalidSnapshot::RevisionAboveServer {
            issue_uuid: uuid(1),
            client: Revision(3),
            server: Revision(2)
        }
    );
}

// ---- lifecycle monotonicity / terminal immutability ----

#[test]
fn client_lifecycle_behind_the_server_is_invalid() {
    let err = run(
        &[row(1, Phase::Running, 1, 0)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Accepted, 1, 0, 0)], vec![]),
    )
    .unwrap_err();
    assert_eq!(
        invalid(err),
        InvalidSnapshot::LifecycleUnreachable {
            issue_uuid: uuid(1),
            server: Lifecycle::Running,
            client: Lifecycle::Accepted
        }
    );
}

#[test]
fn pre_launch_terminal_after_the_server_saw_running_is_invalid() {
    for lc in [Lifecycle::Cancelled, Lifecycle::Rejected] {
        let err = run(
            &[row(1, Phase::Running, 1, 0)],
            &no_known(),
            &snap(vec![rec(1, lc, 1, 0, 0)], vec![]),
        )
        .unwrap_err();
        assert!(matches!(
            invalid(err),
            InvalidSnapshot::LifecycleUnreachable { .. }
        ));
    }
}

// ---- event-sequence bounds ----

#[test]
fn client_assigned_below_the_server_durable_seq_is_invalid() {
    let err = run(
        &[row(1, Phase::Running, 1, 5)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 4, 4)], vec![]),
    )
    .unwrap_err();
    assert_eq!(
        invalid(err),
        InvalidSnapshot::AssignedBelowDurable {
            issue_uuid: uuid(1),
            assigned: 4,
            durable: 5
        }
    );
    // the same bound against a stored terminal command
    let err = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Succeeded, 5))]),
        &snap(vec![rec(1, Lifecycle::Succeeded, 1, 4, 4)], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::AssignedBelowDurable { .. }
    ));
}

#[test]
fn client_acked_above_the_server_durable_seq_of_a_live_command_is_a_recorded_loss() {
    // the server acknowledged events 6..=7 and no longer holds them (a
    // restore from an older backup): the client deleted them, so the
    // range is recorded lost, the command kept, and delivery resumes
    // after the client's acknowledged position
    let out = run(
        &[row(1, Phase::Running, 1, 5)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 9, 7)], vec![]),
    )
    .unwrap();
    let resume = Resume {
        revision: Revision(1),
        durable_event_seq: 7,
        script_resume_offset: 0,
    };
    assert_eq!(
        out.actions()[0].action,
        Action::Keep {
            from: Phase::Running,
            advance_to: None,
            resume,
            lost: Some(LostEvents {
                first_event_seq: 6,
                last_event_seq: 7
            }),
        }
    );
    assert_eq!(out.result().resume[0].durable_event_seq, 7);
    let incident = &out.incidents()[0];
    assert_eq!(
        incident.kind,
        wire::IncidentKind::ReconciliationContradiction
    );
    assert!(incident.data_loss);
    assert!(
        incident.summary.contains("events 6..=7 are lost"),
        "{}",
        incident.summary
    );
    // acked == durable loses nothing
    let out = run(
        &[row(1, Phase::Running, 1, 5)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 9, 5)], vec![]),
    )
    .unwrap();
    assert!(matches!(
        out.actions()[0].action,
        Action::Keep { lost: None, .. }
    ));
    assert!(out.incidents().is_empty());
}

#[test]
fn client_acked_above_the_server_durable_seq_of_a_terminal_command_is_invalid() {
    let err = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Failed, 2))]),
        &snap(vec![rec(1, Lifecycle::Failed, 1, 3, 3)], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::AckedAboveDurable { .. }
    ));
}

#[test]
fn seq_bounds_at_the_edges_are_valid() {
    // assigned == durable == acked is the fully delivered case
    run(
        &[row(1, Phase::Running, 1, 5)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 5, 5)], vec![]),
    )
    .unwrap();
}

// ---- script prefix ----

#[test]
fn script_prefix_for_command_text_is_invalid() {
    let mut r = rec(1, Lifecycle::Accepted, 1, 0, 0);
    r.script_received_bytes = 1;
    let err = run(
        &[row(1, Phase::Accepted, 1, 0)],
        &no_known(),
        &snap(vec![r], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::ScriptForCommandText { received: 1, .. }
    ));
}

#[test]
fn script_prefix_beyond_the_script_size_is_invalid() {
    let mut s = row(1, Phase::Accepted, 1, 0);
    s.source = Source::Script {
        size_bytes: 100,
        upload_committed: false,
    };
    let mut r = rec(1, Lifecycle::Accepted, 1, 0, 0);
    r.script_received_bytes = 101;
    let err = run(&[s], &no_known(), &snap(vec![r.clone()], vec![])).unwrap_err();
    assert!(matches!(
        invalid(err),
        InvalidSnapshot::ScriptBeyondSize {
            received: 101,
            size: 100,
            ..
        }
    ));
    r.script_received_bytes = 100;
    run(&[s], &no_known(), &snap(vec![r], vec![])).unwrap();
}

// ---- matching UUID ----

#[test]
fn tombstone_for_an_unrequested_uuid_is_invalid() {
    let err = run(
        &[row(1, Phase::Queued, 1, 0)],
        &no_known(),
        &snap(vec![], vec![tomb(2)]),
    )
    .unwrap_err();
    assert_eq!(
        invalid(err),
        InvalidSnapshot::UnrequestedTombstone {
            issue_uuid: uuid(2)
        }
    );
}

// ---- all or nothing ----

#[test]
fn one_invalid_row_after_many_valid_ones_yields_no_outcome() {
    // 50 valid rows first in uuid order, then one bad record last: an
    // implementation that decides row by row would already have output.
    let mut rows: Vec<_> = (1..=50).map(|i| row(i, Phase::Dispatched, 1, 0)).collect();
    rows.push(row(51, Phase::Running, 1, 3));
    let mut records: Vec<_> = (1..=50)
        .map(|i| rec(i, Lifecycle::Accepted, 1, 0, 0))
        .collect();
    records.push(rec(51, Lifecycle::Running, 1, 2, 2));
    let err = run(&rows, &no_known(), &snap(records, vec![])).unwrap_err();
    assert_eq!(invalid(err).issue_uuid(), uuid(51));
}

#[test]
fn the_first_violation_in_uuid_order_is_reported() {
    let rows = [row(1, Phase::Running, 1, 5), row(2, Phase::Running, 1, 0)];
    let records = vec![
        rec(1, Lifecycle::Running, 1, 5, 5),
        other_hash_record(2, Lifecycle::Running),
    ];
    let mut t = tomb(3);
    t.request_hash = vec![0; 32];
    let err = run(&rows, &no_known(), &snap(records, vec![t])).unwrap_err();
    assert_eq!(invalid(err).issue_uuid(), uuid(2));
}

// ---- unhealthy client store (R-6.4-33) ----

#[test]
fn a_client_store_that_is_not_ready_cannot_complete_reconciliation() {
    for health in [
        wire::ScopeState::Recovering,
        wire::ScopeState::DirtyReadable,
        wire::ScopeState::Unavailable,
    ] {
        let mut c = chunk(
            ROUND,
            0,
            true,
            vec![rec(1, Lifecycle::Running, 1, 0, 0)],
            vec![],
        );
        c.store_health = health as i32;
        let s = assemble(ROUND, &[c]).unwrap();
        assert_eq!(s.store_health(), health);
        // A snapshot that would otherwise reconcile fine.
        let err = run(&[row(1, Phase::Running, 1, 0)], &no_known(), &s).unwrap_err();
        assert_eq!(err, ReconcileError::ClientStoreNotReady { health });
        assert_eq!(err.disposition(), Disposition::ClientNotReady);
        assert_eq!(err.code(), Code::Unavailable);
    }
}

#[test]
fn not_ready_wins_over_row_violations_because_the_evidence_is_untrusted() {
    let mut c = chunk(
        ROUND,
        0,
        true,
        vec![other_hash_record(1, Lifecycle::Running)],
        vec![],
    );
    c.store_health = wire::ScopeState::DirtyReadable as i32;
    let err = run(
        &[row(1, Phase::Running, 1, 0)],
        &no_known(),
        &assemble(ROUND, &[c]).unwrap(),
    )
    .unwrap_err();
    assert_eq!(err.disposition(), Disposition::ClientNotReady);
}

// ---- caller input (a server bug, never the client's fault) ----

#[test]
fn duplicate_server_rows_are_refused() {
    let r = row(1, Phase::Queued, 1, 0);
    let err = run(&[r, r], &no_known(), &snap(vec![], vec![])).unwrap_err();
    assert_eq!(
        server_bug(err),
        ServerInputError::DuplicateRow {
            issue_uuid: uuid(1)
        }
    );
}

#[test]
fn terminal_server_rows_are_refused() {
    let err = run(
        &[row(1, Phase::Succeeded, 1, 0)],
        &no_known(),
        &snap(vec![], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        server_bug(err),
        ServerInputError::TerminalRow { .. }
    ));
}

#[test]
fn server_revision_zero_and_bad_script_sizes_are_refused() {
    let err = run(
        &[row(1, Phase::Queued, 0, 0)],
        &no_known(),
        &snap(vec![], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        server_bug(err),
        ServerInputError::RevisionZero { .. }
    ));
    for size_bytes in [0, 10 * 1024 * 1024 + 1] {
        let mut r = row(1, Phase::Queued, 1, 0);
        r.source = Source::Script {
            size_bytes,
            upload_committed: false,
        };
        let err = run(&[r], &no_known(), &snap(vec![], vec![])).unwrap_err();
        assert!(matches!(
            server_bug(err),
            ServerInputError::BadScriptSize { .. }
        ));
    }
}

#[test]
fn an_unlisted_record_without_a_lookup_is_refused() {
    let err = run(
        &[],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 0, 0)], vec![]),
    )
    .unwrap_err();
    assert_eq!(
        server_bug(err),
        ServerInputError::MissingKnown {
            issue_uuid: uuid(1)
        }
    );
}

#[test]
fn a_lookup_for_a_listed_row_is_refused() {
    let err = run(
        &[row(1, Phase::Queued, 1, 0)],
        &known(&[(1, ServerKnown::Missing)]),
        &snap(vec![], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        server_bug(err),
        ServerInputError::KnownForListedRow { .. }
    ));
}

#[test]
fn a_terminal_lookup_with_a_live_lifecycle_is_refused() {
    let err = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Running, 0))]),
        &snap(vec![rec(1, Lifecycle::Running, 1, 0, 0)], vec![]),
    )
    .unwrap_err();
    assert!(matches!(
        server_bug(err),
        ServerInputError::KnownNotTerminal { .. }
    ));
}

#[test]
fn round_zero_and_round_mismatch_are_refused() {
    let s = snap(vec![], vec![]);
    let err = reconcile(0, &[], &no_known(), &s).unwrap_err();
    assert_eq!(server_bug(err), ServerInputError::RoundZero);
    let err = reconcile(2, &[], &no_known(), &s).unwrap_err();
    assert_eq!(
        server_bug(err),
        ServerInputError::RoundMismatch {
            expected: 2,
            snapshot: 1
        }
    );
}

#[test]
fn more_rows_than_one_request_carries_are_refused() {
    let rows: Vec<_> = (0..=10_000u32)
        .map(|i| row(i, Phase::Queued, 1, 0))
        .collect();
    let err = run(&rows, &no_known(), &snap(vec![], vec![])).unwrap_err();
    assert!(matches!(
        server_bug(err),
        ServerInputError::TooManyRows { count: 10_001, .. }
    ));
    run(&rows[..10_000], &no_known(), &snap(vec![], vec![])).unwrap();
}

#[test]
fn unrelated_lookups_are_ignored() {
    let out = run(
        &[],
        &known(&[(7, ServerKnown::Missing)]),
        &snap(vec![], vec![]),
    )
    .unwrap();
    assert!(out.actions().is_empty());
}
