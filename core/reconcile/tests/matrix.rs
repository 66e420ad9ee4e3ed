#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! One test per row of the plan §6.4 reconciliation matrix, the complete
//! active + terminal-unacknowledged case, and the lost/repeated result.

mod common;

use std::collections::BTreeMap;

use common::*;
use prost::Message as _;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use rvbox_reconcile::{
    Action, InterruptReason, Resume, ServerAction, ServerKnown, Source, check_result, result_digest,
};

fn only_action(outcome: &rvbox_reconcile::Outcome) -> Action {
    assert_eq!(outcome.actions().len(), 1, "{:?}", outcome.actions());
    outcome.actions()[0].action
}

fn empty_lists(result: &wire::ReconcileResult) -> bool {
    result.terminate_local_issue_uuids.is_empty()
        && result.discard_local_terminal_issue_uuids.is_empty()
        && result.resume.is_empty()
}

// ---- row 1: queued/dispatched absent from a healthy complete snapshot ----

#[test]
fn row1_queued_absent_remains_queued() {
    let out = run(
        &[row(1, Phase::Queued, 1, 0)],
        &no_known(),
        &snap(vec![], vec![]),
    )
    .unwrap();
    assert_eq!(
        only_action(&out),
        Action::Requeue {
            from: Phase::Queued
        }
    );
    assert!(out.incidents().is_empty());
    assert!(empty_lists(out.result()));
}

#[test]
fn row1_dispatched_absent_returns_to_queued() {
    let out = run(
        &[row(1, Phase::Dispatched, 2, 0)],
        &no_known(),
        &snap(vec![], vec![]),
    )
    .unwrap();
    assert_eq!(
        only_action(&out),
        Action::Requeue {
            from: Phase::Dispatched
        }
    );
    assert!(out.incidents().is_empty());
    assert!(empty_lists(out.result()));
}

// ---- row 2: dispatched/accepted/running with a matching retained record ----

#[test]
fn row2_dispatched_with_accepted_record_keeps_and_advances_to_accepted() {
    let out = run(
        &[row(1, Phase::Dispatched, 2, 0)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Accepted, 2, 0, 0)], vec![]),
    )
    .unwrap();
    let resume = Resume {
        revision: Revision(2),
        durable_event_seq: 0,
        script_resume_offset: 0,
    };
    assert_eq!(
        only_action(&out),
        Action::Keep {
            from: Phase::Dispatched,
            advance_to: Some(Lifecycle::Accepted),
            resume,
            lost: None,
        }
    );
    assert!(out.incidents().is_empty());
    assert_eq!(
        out.result().resume,
        vec![wire::ResumeRow {
            issue_uuid: uuid(1).to_string(),
            revision: 2,
            durable_event_seq: 0,
            script_resume_offset: 0
        }]
    );
}

#[test]
fn row2_accepted_with_running_record_keeps_highest_valid_revision_and_resumes_events() {
    // The client applied revision 2; the server has since taken revision 3
    // (a signal): the highest valid revision is the server's.
    let out = run(
        &[row(1, Phase::Accepted, 3, 4)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 2, 9, 4)], vec![]),
    )
    .unwrap();
    assert_eq!(
        only_action(&out),
        Action::Keep {
            from: Phase::Accepted,
            advance_to: Some(Lifecycle::Running),
            resume: Resume {
                revision: Revision(3),
                durable_event_seq: 4,
                script_resume_offset: 0
            },
            lost: None,
        }
    );
    let r = &out.result().resume[0];
    assert_eq!((r.revision, r.durable_event_seq), (3, 4));
}

#[test]
fn row2_running_with_running_record_keeps_without_advancing() {
    let out = run(
        &[row(1, Phase::Running, 1, 5)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 5, 5)], vec![]),
    )
    .unwrap();
    match only_action(&out) {
        Action::Keep { advance_to, .. } => assert_eq!(advance_to, None),
        other => panic!("{other:?}"),
    }
}

#[test]
fn row2_launch_phases_render_as_accepted_and_advance_to_running() {
    let out = run(
        &[row(1, Phase::LaunchAuthorized, 1, 0)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 1, 0)], vec![]),
    )
    .unwrap();
    match only_action(&out) {
        Action::Keep { advance_to, .. } => assert_eq!(advance_to, Some(Lifecycle::Running)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn row2_script_resume_offset_is_the_client_prefix_until_committed() {
    let mut r = row(1, Phase::Accepted, 1, 0);
    let mut record = rec(1, Lifecycle::Accepted, 1, 0, 0);
    record.script_received_bytes = 400;
    let s = snap(vec![record], vec![]);

    r.source = Source::Script {
        size_bytes: 1000,
        upload_committed: false,
    };
    let out = run(&[r], &no_known(), &s).unwrap();
    assert_eq!(out.result().resume[0].script_resume_offset, 400);

    r.source = Source::Script {
        size_bytes: 1000,
        upload_committed: true,
    };
    let out = run(&[r], &no_known(), &s).unwrap();
    assert_eq!(out.result().resume[0].script_resume_offset, 0);
}

#[test]
fn row2_client_terminal_unacknowledged_is_kept_to_deliver_its_terminal_event() {
    // Finished while offline: the server still needs events 7..=10.
    let out = run(
        &[row(1, Phase::Running, 1, 6)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Succeeded, 1, 10, 6)], vec![]),
    )
    .unwrap();
    match only_action(&out) {
        Action::Keep {
            advance_to, resume, ..
        } => {
            assert_eq!(advance_to, None, "terminal values come from events");
            assert_eq!(resume.durable_event_seq, 6);
        }
        other => panic!("{other:?}"),
    }
    assert!(out.result().discard_local_terminal_issue_uuids.is_empty());
    assert_eq!(out.result().resume.len(), 1);
}

// ---- row 3: any non-terminal with a matching tombstone ----

#[test]
fn row3_matching_tombstone_interrupts_every_non_terminal_phase_as_stale_server() {
    for phase in [
        Phase::Queued,
        Phase::Dispatched,
        Phase::Accepted,
        Phase::LaunchPrepared,
        Phase::LaunchAuthorized,
        Phase::Running,
    ] {
        let out = run(
            &[row(1, phase, 2, 0)],
            &no_known(),
            &snap(vec![], vec![tomb(1)]),
        )
        .unwrap();
        assert_eq!(
            only_action(&out),
            Action::Interrupt {
                from: phase,
                reason: InterruptReason::StaleServer
            },
            "{phase}"
        );
        assert_eq!(out.incidents().len(), 1);
        assert_eq!(out.incidents()[0].kind, wire::IncidentKind::StaleServer);
        assert_eq!(out.incidents()[0].issue_uuid, uuid(1));
        // replay suppressed: nothing for the client to resume
        assert!(empty_lists(out.result()));
    }
}

// ---- row 4: accepted/running absent ----

#[test]
fn row4_accepted_or_running_absent_interrupts_with_client_state_loss() {
    for phase in [
        Phase::Accepted,
        Phase::LaunchPrepared,
        Phase::LaunchAuthorized,
        Phase::Running,
    ] {
        let out = run(&[row(1, phase, 1, 3)], &no_known(), &snap(vec![], vec![])).unwrap();
        assert_eq!(
            only_action(&out),
            Action::Interrupt {
                from: phase,
                reason: InterruptReason::ClientStateLoss
            }
        );
        assert_eq!(out.incidents()[0].kind, wire::IncidentKind::ClientStateLoss);
        assert!(empty_lists(out.result()));
    }
}

// ---- row 5: missing or contradictory terminal while the client is active ----

fn assert_terminated(out: &rvbox_reconcile::Outcome) {
    assert!(out.actions().is_empty(), "no server command is invented");
    assert_eq!(out.result().terminate_local_issue_uuids, strings(&[1]));
    assert!(out.result().discard_local_terminal_issue_uuids.is_empty());
    assert!(out.result().resume.is_empty());
    assert_eq!(out.incidents().len(), 1);
    assert_eq!(
        out.incidents()[0].kind,
        wire::IncidentKind::ReconciliationContradiction
    );
}

#[test]
fn row5_client_active_and_server_missing_terminates_locally_with_incident() {
    for lc in [Lifecycle::Accepted, Lifecycle::Running] {
        let out = run(
            &[],
            &known(&[(1, ServerKnown::Missing)]),
            &snap(vec![rec(1, lc, 1, 3, 0)], vec![]),
        )
        .unwrap();
        assert_terminated(&out);
    }
}

#[test]
fn row5_client_active_and_server_tombstoned_terminates_locally_with_incident() {
    let out = run(
        &[],
        &known(&[(1, tombstoned(1))]),
        &snap(vec![rec(1, Lifecycle::Running, 1, 0, 0)], vec![]),
    )
    .unwrap();
    assert_terminated(&out);
}

#[test]
fn row5_client_active_and_server_terminal_terminates_locally_with_incident() {
    let out = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Interrupted, 2))]),
        &snap(vec![rec(1, Lifecycle::Running, 1, 5, 2)], vec![]),
    )
    .unwrap();
    assert_terminated(&out);
}

// ---- row 6: missing/tombstoned or fully stored terminal, client terminal ----

#[test]
fn row6_client_terminal_and_server_missing_is_discarded() {
    let out = run(
        &[],
        &known(&[(1, ServerKnown::Missing)]),
        &snap(vec![rec(1, Lifecycle::Failed, 1, 4, 4)], vec![]),
    )
    .unwrap();
    assert_eq!(
        out.result().discard_local_terminal_issue_uuids,
        strings(&[1])
    );
    assert!(out.result().terminate_local_issue_uuids.is_empty());
    assert!(out.actions().is_empty());
    assert!(out.incidents().is_empty());
}

#[test]
fn row6_client_terminal_and_server_tombstoned_is_discarded() {
    let out = run(
        &[],
        &known(&[(1, tombstoned(1))]),
        &snap(vec![rec(1, Lifecycle::Cancelled, 2, 0, 0)], vec![]),
    )
    .unwrap();
    assert_eq!(
        out.result().discard_local_terminal_issue_uuids,
        strings(&[1])
    );
    assert!(out.incidents().is_empty());
}

#[test]
fn row6_lost_final_event_ack_fully_stored_terminal_is_discarded_without_incident() {
    // The server stored event 7 (terminal) but its EventAck was lost.
    let out = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Succeeded, 7))]),
        &snap(vec![rec(1, Lifecycle::Succeeded, 1, 7, 6)], vec![]),
    )
    .unwrap();
    assert_eq!(
        out.result().discard_local_terminal_issue_uuids,
        strings(&[1])
    );
    assert!(out.incidents().is_empty());
}

#[test]
fn row6_contradicting_terminal_is_discarded_with_incident_and_server_kept() {
    // Different terminal value.
    let out = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Interrupted, 3))]),
        &snap(vec![rec(1, Lifecycle::Succeeded, 1, 3, 3)], vec![]),
    )
    .unwrap();
    assert_eq!(
        out.result().discard_local_terminal_issue_uuids,
        strings(&[1])
    );
    assert!(out.actions().is_empty(), "terminal immutability");
    assert_eq!(
        out.incidents()[0].kind,
        wire::IncidentKind::ReconciliationContradiction
    );
    // Same value but the client holds events the server never stored.
    let out = run(
        &[],
        &known(&[(1, terminal(1, Lifecycle::Succeeded, 3))]),
        &snap(vec![rec(1, Lifecycle::Succeeded, 1, 5, 3)], vec![]),
    )
    .unwrap();
    assert_eq!(
        out.result().discard_local_terminal_issue_uuids,
        strings(&[1])
    );
    assert_eq!(out.incidents().len(), 1);
}

// ---- outside the matrix ----

#[test]
fn queued_row_the_client_holds_is_kept_not_redispatched_with_contradiction() {
    let out = run(
        &[row(1, Phase::Queued, 1, 0)],
        &no_known(),
        &snap(vec![rec(1, Lifecycle::Running, 1, 2, 0)], vec![]),
    )
    .unwrap();
    match only_action(&out) {
        Action::Keep {
            from, advance_to, ..
        } => {
            assert_eq!(from, Phase::Queued);
            assert_eq!(advance_to, Some(Lifecycle::Running));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        out.incidents()[0].kind,
        wire::IncidentKind::ReconciliationContradiction
    );
}

// ---- the complete case (plan §6.5) ----

/// Server rows 1..=7 and unlisted records 8..=10:
/// 1 dispatched, client accepted      -> keep, advance to accepted
/// 2 running, client running          -> keep, resume after 3
/// 3 running, client succeeded unacked-> keep (terminal-unacknowledged)
/// 4 queued, absent                   -> remain queued
/// 5 dispatched, absent               -> requeue
/// 6 accepted, absent                 -> interrupt, client state loss
/// 7 dispatched, client tombstone     -> interrupt, stale server
/// 8 stored terminal, client terminal -> discard (lost final ack)
/// 9 missing, client running          -> terminate + incident
/// 10 tombstoned, client failed       -> discard
fn complete_case() -> (
    Vec<rvbox_reconcile::ServerCommand>,
    BTreeMap<rvbox_domain::ids::Uuid7, ServerKnown>,
    Vec<wire::SnapshotRecord>,
    Vec<wire::SnapshotTombstone>,
) {
    let mut r3 = row(3, Phase::Running, 2, 4);
    r3.source = Source::Script {
        size_bytes: 50,
        upload_committed: true,
    };
    let rows = vec![
        row(1, Phase::Dispatched, 1, 0),
        row(2, Phase::Running, 1, 3),
        r3,
        row(4, Phase::Queued, 1, 0),
        row(5, Phase::Dispatched, 1, 0),
        row(6, Phase::Accepted, 1, 0),
        row(7, Phase::Dispatched, 1, 0),
    ];
    let known = known(&[
        (8, terminal(8, Lifecycle::Failed, 5)),
        (9, ServerKnown::Missing),
        (10, tombstoned(10)),
    ]);
    let mut c3 = rec(3, Lifecycle::Succeeded, 2, 9, 4);
    c3.script_received_bytes = 50;
    let records = vec![
        rec(1, Lifecycle::Accepted, 1, 0, 0),
        rec(2, Lifecycle::Running, 1, 6, 3),
        c3,
        rec(8, Lifecycle::Failed, 1, 5, 4),
        rec(9, Lifecycle::Running, 1, 2, 0),
        rec(10, Lifecycle::Failed, 1, 1, 1),
    ];
    (rows, known, records, vec![tomb(7)])
}

#[test]
fn complete_active_and_terminal_unacknowledged_reconciliation() {
    let (rows, known, records, tombstones) = complete_case();
    let out = run(&rows, &known, &snap(records, tombstones)).unwrap();

    let actions: Vec<(u32, Action)> = out
        .actions()
        .iter()
        .map(|a| {
            let i = (1..=10).find(|i| uuid(*i) == a.issue_uuid).unwrap();
            (i, a.action)
        })
        .collect();
    let keep = |from, advance_to, revision, durable| Action::Keep {
        from,
        advance_to,
        resume: Resume {
            revision: Revision(revision),
            durable_event_seq: durable,
            script_resume_offset: 0,
        },
        lost: None,
    };
    assert_eq!(
        actions,
        vec![
            (1, keep(Phase::Dispatched, Some(Lifecycle::Accepted), 1, 0)),
            (2, keep(Phase::Running, None, 1, 3)),
            (3, keep(Phase::Running, None, 2, 4)),
            (
                4,
                Action::Requeue {
                    from: Phase::Queued
                }
            ),
            (
                5,
                Action::Requeue {
                    from: Phase::Dispatched
                }
            ),
            (
                6,
                Action::Interrupt {
                    from: Phase::Accepted,
                    reason: InterruptReason::ClientStateLoss
                }
            ),
            (
                7,
                Action::Interrupt {
                    from: Phase::Dispatched,
                    reason: InterruptReason::StaleServer
                }
            ),
        ]
    );
    let result = out.result();
    assert_eq!(result.round, ROUND);
    assert_eq!(result.terminate_local_issue_uuids, strings(&[9]));
    assert_eq!(result.discard_local_terminal_issue_uuids, strings(&[8, 10]));
    let resume: Vec<_> = result
        .resume
        .iter()
        .map(|r| {
            (
                r.issue_uuid.clone(),
                r.revision,
                r.durable_event_seq,
                r.script_resume_offset,
            )
        })
        .collect();
    assert_eq!(
        resume,
        vec![
            (uuid(1).to_string(), 1, 0, 0),
            (uuid(2).to_string(), 1, 3, 0),
            (uuid(3).to_string(), 2, 4, 0),
        ]
    );
    let kinds: Vec<_> = out
        .incidents()
        .iter()
        .map(|i| (i.issue_uuid, i.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (uuid(6), wire::IncidentKind::ClientStateLoss),
            (uuid(7), wire::IncidentKind::StaleServer),
            (uuid(9), wire::IncidentKind::ReconciliationContradiction),
        ]
    );
    assert_eq!(result.result_digest, result_digest(result).to_vec());
    assert_eq!(out.digest().to_vec(), result.result_digest);
    let checked = check_result(result, ROUND).unwrap();
    assert_eq!(checked.terminate, vec![uuid(9)]);
    assert_eq!(checked.resume.len(), 3);
}

// ---- lost and repeated ReconcileResult (plan §6.5, R-6.4-32) ----

#[test]
fn repeated_snapshot_gives_byte_identical_result_and_digest() {
    let (rows, known, records, tombstones) = complete_case();
    let first = run(&rows, &known, &snap(records.clone(), tombstones.clone())).unwrap();
    // the same snapshot again, split differently, rows queried in reverse
    let chunks = split(
        ROUND,
        &records,
        &tombstones,
        &[false, true, false, true, true, false],
        &[],
        true,
    );
    assert!(chunks.len() > 2);
    let mut reversed = rows.clone();
    reversed.reverse();
    let second = run(&reversed, &known, &assemble(ROUND, &chunks).unwrap()).unwrap();
    assert_eq!(
        first.result().encode_to_vec(),
        second.result().encode_to_vec()
    );
    assert_eq!(first.digest(), second.digest());
    assert_eq!(first, second);
}

/// Applies an outcome to a model of the server store, the way the caller's
/// reconciliation transaction would.
fn apply(
    rows: &[rvbox_reconcile::ServerCommand],
    known: &mut BTreeMap<rvbox_domain::ids::Uuid7, ServerKnown>,
    actions: &[ServerAction],
) -> Vec<rvbox_reconcile::ServerCommand> {
    let mut next = Vec::new();
    for r in rows {
        let a = actions
            .iter()
            .find(|a| a.issue_uuid == r.issue_uuid)
            .unwrap();
        match a.action {
            Action::Requeue { .. } => next.push(rvbox_reconcile::ServerCommand {
                phase: Phase::Queued,
                ..*r
            }),
            Action::Keep { advance_to, .. } => {
                let phase = match advance_to {
                    Some(Lifecycle::Accepted) => Phase::Accepted,
                    Some(Lifecycle::Running) => Phase::Running,
                    _ => r.phase,
                };
                next.push(rvbox_reconcile::ServerCommand { phase, ..*r });
            }
            Action::Interrupt { .. } => {
                known.insert(
                    r.issue_uuid,
                    ServerKnown::Terminal {
                        request_hash: r.request_hash,
                        lifecycle: Lifecycle::Interrupted,
                        durable_event_seq: r.durable_event_seq,
                    },
                );
            }
        }
    }
    next
}

#[test]
fn lost_result_is_recomputed_identically_from_the_next_complete_snapshot() {
    let (rows, mut known, records, tombstones) = complete_case();
    let first = run(&rows, &known, &snap(records.clone(), tombstones.clone())).unwrap();
    // The server committed the round; the result frame was lost, so the
    // client applied nothing and reconnects (a new session, round 1).
    let rows2 = apply(&rows, &mut known, first.actions());
    assert_ne!(rows2, rows, "the first round changed server state");
    // The client answers the new request: same records, tombstones only
    // for requested rows.
    let requested: Vec<_> = rows2.iter().map(|r| r.issue_uuid.to_string()).collect();
    let tombstones2: Vec<_> = tombstones
        .into_iter()
        .filter(|t| requested.contains(&t.issue_uuid))
        .collect();
    let snapshot2 = snap(records, tombstones2);
    let lookups = snapshot2.lookups_needed(&rows2);
    let known2: BTreeMap<_, _> = lookups.iter().map(|u| (*u, known[u])).collect();
    let second = run(&rows2, &known2, &snapshot2).unwrap();
    assert_eq!(
        first.result().encode_to_vec(),
        second.result().encode_to_vec()
    );
    assert_eq!(first.digest(), second.digest());
    // Re-applying is idempotent: no further state change.
    assert_eq!(apply(&rows2, &mut known.clone(), second.actions()), rows2);
    // Repeated incident intents keep their idempotency keys.
    for i in second.incidents() {
        assert!(
            first
                .incidents()
                .iter()
                .any(|f| f.kind == i.kind && f.issue_uuid == i.issue_uuid),
            "{i:?}"
        );
    }
}
