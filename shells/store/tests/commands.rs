#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Server-side command transitions for dispatch and reconciliation on
//! real SQLite (plan §6.4).

mod support;

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::commands::{Knowledge, ServerTerminal, decode_rejection};
use rvbox_store::incidents::NewIncident;
use rvbox_store::mutations::OpError;
use support::*;

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

fn queued(s: &mut Store, client: &str, at: i64, ttl_ms: Option<u64>) -> [u8; 16] {
    let id = new_id();
    let mut req = run_request(&id, client, "true");
    req.queue_ttl = ttl_ms.map(|ms| prost_types::Duration {
        seconds: i64::try_from(ms / 1000).unwrap(),
        nanos: 0,
    });
    s.run_command(&req, at).unwrap();
    id
}

fn lifecycle(s: &Store, id: &[u8; 16]) -> Lifecycle {
    s.command_view(id).unwrap().lifecycle
}

#[test]
fn dispatch_order_and_compare_and_set_transitions() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let a = queued(&mut s, "web-1", NOW + 2, None);
    let b = queued(&mut s, "web-1", NOW + 1, None);
    let _other = queued(&mut s, "web-2", NOW, None);
    let q = s.queued_commands("web-1", 10).unwrap();
    assert_eq!(
        q.iter().map(|c| c.issue_uuid).collect::<Vec<_>>(),
        vec![b, a],
        "issue time order, one client only"
    );
    assert_eq!(q[0].revision, 1);
    assert_eq!(q[0].queue_expiry_ms, Some(NOW + 1 + 15 * 60_000));

    s.mark_dispatched(&b, 1).unwrap();
    assert_eq!(lifecycle(&s, &b), Lifecycle::Dispatched);
    // a second dispatch decision on the same stale view changes nothing
    assert_eq!(code(s.mark_dispatched(&b, 1).unwrap_err()), Code::Conflict);
    assert_eq!(
        code(s.record_accepted(&b, 2, 0).unwrap_err()),
        Code::Conflict
    );
    assert_eq!(s.requeue(None, &b, 1, NOW).unwrap(), Lifecycle::Queued);
    assert_eq!(lifecycle(&s, &b), Lifecycle::Queued);
    s.mark_dispatched(&b, 1).unwrap();
    s.record_accepted(&b, 1, wire::ShellType::Sh as i32)
        .unwrap();
    assert_eq!(lifecycle(&s, &b), Lifecycle::Accepted);
    assert_eq!(
        code(s.requeue(None, &b, 1, NOW).unwrap_err()),
        Code::Conflict,
        "accepted work never returns to the queue"
    );
    let rows = s.non_terminal_commands("web-1").unwrap();
    let mut sorted = vec![a, b];
    sorted.sort_unstable();
    assert_eq!(
        rows.iter().map(|c| c.issue_uuid).collect::<Vec<_>>(),
        sorted
    );
    assert_counters(&s);
}

#[test]
fn server_terminal_decisions_release_headroom_and_leave_a_tombstone() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let expired = queued(&mut s, "web-1", NOW, None);
    let rejected = queued(&mut s, "web-1", NOW, None);
    let held_before: i64 = s
        .db()
        .query_row(
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();

    s.finish_by_server(
        None,
        &expired,
        &[Lifecycle::Queued],
        1,
        ServerTerminal::Expired,
        None,
        None,
        NOW + 10,
    )
    .unwrap();
    assert_eq!(lifecycle(&s, &expired), Lifecycle::Expired);
    assert!(matches!(
        s.command_knowledge(&expired).unwrap(),
        Knowledge::Terminal {
            lifecycle: Lifecycle::Expired,
            ..
        }
    ));

    s.mark_dispatched(&rejected, 1).unwrap();
    let reason = rvbox_domain::error::DomainError::new(Code::InvalidArgument, "cwd outside roots")
        .with_field("spec.cwd")
        .to_detail();
    // a decision made on a stale lifecycle is refused
    assert_eq!(
        code(
            s.finish_by_server(
                None,
                &rejected,
                &[Lifecycle::Queued],
                1,
                ServerTerminal::Rejected,
                Some(&reason),
                None,
                NOW
            )
            .unwrap_err()
        ),
        Code::Conflict
    );
    s.finish_by_server(
        None,
        &rejected,
        &[Lifecycle::Dispatched],
        1,
        ServerTerminal::Rejected,
        Some(&reason),
        None,
        NOW + 10,
    )
    .unwrap();
    let stored: Vec<u8> = s
        .db()
        .query_row(
            "SELECT rejection FROM commands WHERE issue_uuid = ?1",
            [rejected.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(decode_rejection(&stored).unwrap(), reason);
    let tombstones: i64 = s
        .db()
        .query_row("SELECT COUNT(*) FROM command_tombstones", [], |r| r.get(0))
        .unwrap();
    assert_eq!(tombstones, 2);
    let held_after: i64 = s
        .db()
        .query_row(
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        held_before - held_after,
        2 * 64 * 1024,
        "both commands' closeout headroom went back"
    );
    // an ended command cannot end again
    assert_eq!(
        code(
            s.finish_by_server(
                None,
                &expired,
                &[Lifecycle::Expired],
                1,
                ServerTerminal::Cancelled,
                None,
                None,
                NOW
            )
            .unwrap_err()
        ),
        Code::IllegalTransition
    );
    assert_counters(&s);
}

#[test]
fn an_interruption_records_its_incident_in_the_same_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let incident = NewIncident {
        kind: wire::IncidentKind::ClientStateLoss,
        scope_kind: wire::ScopeKind::Command,
        scope_key: text(&id),
        client_id: Some("web-1".into()),
        issue_uuid: Some(id),
        summary: "the client's snapshot lacks a running command".into(),
        evidence: Vec::new(),
        data_loss: false,
    };
    s.finish_by_server(
        None,
        &id,
        &[Lifecycle::Accepted, Lifecycle::Running],
        1,
        ServerTerminal::Interrupted,
        None,
        Some(&incident),
        NOW + 5,
    )
    .unwrap();
    assert_eq!(lifecycle(&s, &id), Lifecycle::Interrupted);
    let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].kind, wire::IncidentKind::ClientStateLoss);
    assert_counters(&s);
}

#[test]
fn expiry_lists_queued_and_dispatched_work_and_the_indicator_changes_no_lifecycle() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let q = queued(&mut s, "web-1", NOW, Some(1_000));
    let d = queued(&mut s, "web-1", NOW, Some(2_000));
    let never = queued(&mut s, "web-1", NOW, Some(0));
    let later = queued(&mut s, "web-1", NOW, Some(60_000));
    s.mark_dispatched(&d, 1).unwrap();
    assert!(s.expiry_due(NOW + 999, 10).unwrap().is_empty());
    let due = s.expiry_due(NOW + 2_000, 10).unwrap();
    assert_eq!(
        due.iter().map(|c| c.issue_uuid).collect::<Vec<_>>(),
        vec![q, d]
    );
    assert_eq!(s.command_view(&never).unwrap().queue_expiry_ms, None);
    assert_eq!(
        s.command_view(&later).unwrap().queue_expiry_ms,
        Some(NOW + 60_000)
    );

    s.mark_expired_pending(&d, 1).unwrap();
    let v = s.command_view(&d).unwrap();
    assert!(v.expired_pending);
    assert_eq!(v.lifecycle, Lifecycle::Dispatched);
    assert_eq!(
        s.expiry_due(NOW + 2_000, 10)
            .unwrap()
            .iter()
            .map(|c| c.issue_uuid)
            .collect::<Vec<_>>(),
        vec![q],
        "an indicated command is not listed again"
    );
    // a kill of dispatched work: a higher revision first
    assert_eq!(s.bump_revision(&d, 1).unwrap(), 2);
    assert_eq!(code(s.bump_revision(&d, 1).unwrap_err()), Code::Conflict);
    assert_eq!(s.command_view(&d).unwrap().revision, 2);
}

#[test]
fn knowledge_of_unknown_commands_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    assert_eq!(s.command_knowledge(&new_id()).unwrap(), Knowledge::Missing);
}

#[test]
fn a_reconciliation_round_is_all_or_nothing_and_opens_each_incident_once() {
    use rvbox_store::commands::ReconcileWrite;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let requeued = queued(&mut s, "web-1", NOW, None);
    let advanced = queued(&mut s, "web-1", NOW, None);
    let lost = running_command(&mut s, "web-1");
    s.mark_dispatched(&requeued, 1).unwrap();
    s.mark_dispatched(&advanced, 1).unwrap();
    let incident = NewIncident {
        kind: wire::IncidentKind::ClientStateLoss,
        scope_kind: wire::ScopeKind::Command,
        scope_key: text(&lost),
        client_id: Some("web-1".into()),
        issue_uuid: Some(lost),
        summary: "running command absent from the snapshot".into(),
        evidence: Vec::new(),
        data_loss: false,
    };
    let writes = [
        ReconcileWrite::Requeue {
            issue: requeued,
            revision: 1,
        },
        ReconcileWrite::Advance {
            issue: advanced,
            revision: 1,
            to: Lifecycle::Running,
        },
        ReconcileWrite::Interrupt {
            issue: lost,
            revision: 1,
        },
    ];
    // one stale write (a revision that moved) and nothing at all is written
    let mut stale = writes;
    stale[2] = ReconcileWrite::Interrupt {
        issue: lost,
        revision: 7,
    };
    assert_eq!(
        code(
            s.apply_reconciliation(None, "web-1", &stale, std::slice::from_ref(&incident), NOW)
                .unwrap_err()
        ),
        Code::Conflict
    );
    assert_eq!(lifecycle(&s, &requeued), Lifecycle::Dispatched);
    assert_eq!(lifecycle(&s, &advanced), Lifecycle::Dispatched);
    assert!(rvbox_store::incidents::open(s.db(), 10).unwrap().is_empty());

    assert_eq!(
        s.apply_reconciliation(None, "web-1", &writes, std::slice::from_ref(&incident), NOW)
            .unwrap(),
        1
    );
    assert_eq!(lifecycle(&s, &requeued), Lifecycle::Queued);
    assert_eq!(
        lifecycle(&s, &advanced),
        Lifecycle::Running,
        "dispatched -> accepted -> running"
    );
    assert_eq!(lifecycle(&s, &lost), Lifecycle::Interrupted);
    // the same decision again opens no second incident
    assert_eq!(
        s.apply_reconciliation(None, "web-1", &[], std::slice::from_ref(&incident), NOW)
            .unwrap(),
        0
    );
    assert_eq!(rvbox_store::incidents::open(s.db(), 10).unwrap().len(), 1);
    assert_counters(&s);
}

#[test]
fn a_lifecycle_event_reconciliation_already_applied_is_still_stored() {
    use rvbox_store::commands::ReconcileWrite;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = queued(&mut s, "web-1", NOW, None);
    s.mark_dispatched(&id, 1).unwrap();
    // the client's snapshot says running: reconciliation advances it
    s.apply_reconciliation(
        None,
        "web-1",
        &[ReconcileWrite::Advance {
            issue: id,
            revision: 1,
            to: Lifecycle::Running,
        }],
        &[],
        NOW,
    )
    .unwrap();
    // then the client replays its RUNNING event, which the server never stored
    let r = s
        .append_events(&[support::lifecycle(&id, 1, Lifecycle::Running)], NOW)
        .unwrap();
    assert_eq!(
        r.outcomes,
        vec![rvbox_store::events::EventOutcome::Appended]
    );
    assert_eq!(lifecycle(&s, &id), Lifecycle::Running);
    assert_eq!(s.command_view(&id).unwrap().last_event_seq, 1);
    // a real regression is still refused
    let r = s
        .append_events(&[support::lifecycle(&id, 2, Lifecycle::Queued)], NOW)
        .unwrap();
    assert!(matches!(
        r.outcomes[0],
        rvbox_store::events::EventOutcome::Refused(_)
    ));
    assert_counters(&s);
}

#[test]
fn protocol_incidents_are_recorded_but_gate_no_mutation() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let late = NewIncident {
        kind: wire::IncidentKind::LateAfterExpiry,
        scope_kind: wire::ScopeKind::Command,
        scope_key: text(&id),
        client_id: Some("web-1".into()),
        issue_uuid: Some(id),
        summary: "accepted after its queue expiry".into(),
        evidence: Vec::new(),
        data_loss: false,
    };
    s.record_protocol_incident(&late, NOW).unwrap();
    assert_eq!(rvbox_store::incidents::open(s.db(), 10).unwrap().len(), 1);
    // plan §6.4: every actual event after a late acceptance is kept
    let r = s
        .append_events(&[output(&id, 2, b"still running")], NOW)
        .unwrap();
    assert_eq!(
        r.outcomes,
        vec![rvbox_store::events::EventOutcome::Appended]
    );
    assert!(
        !rvbox_store::incidents::is_dirty(s.db(), wire::ScopeKind::Command, &text(&id)).unwrap()
    );
    // a storage incident on the same scope does gate it
    let storage = NewIncident {
        kind: wire::IncidentKind::ChecksumMismatch,
        ..late
    };
    s.record_protocol_incident(&storage, NOW).unwrap();
    let r = s.append_events(&[output(&id, 3, b"refused")], NOW).unwrap();
    assert!(matches!(
        r.outcomes[0],
        rvbox_store::events::EventOutcome::Refused(_)
    ));
}

#[test]
fn a_requeued_command_past_its_expiry_is_expired_not_left_pending() {
    use rvbox_store::commands::ReconcileWrite;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = queued(&mut s, "web-1", NOW, Some(1_000));
    s.mark_dispatched(&id, 1).unwrap();
    // past its TTL while dispatched: the indicator, no lifecycle change
    s.mark_expired_pending(&id, 1).unwrap();
    assert!(s.expiry_due(NOW + 5_000, 10).unwrap().is_empty());
    // reconciliation finds the client does not hold it: back to the queue
    s.apply_reconciliation(
        None,
        "web-1",
        &[ReconcileWrite::Requeue {
            issue: id,
            revision: 1,
        }],
        &[],
        NOW + 5_000,
    )
    .unwrap();
    let v = s.command_view(&id).unwrap();
    assert_eq!(v.lifecycle, Lifecycle::Queued);
    assert!(
        !v.expired_pending,
        "a requeued command is certainly not held"
    );
    // so the expiry pass sees it and it can end expired
    assert_eq!(
        s.expiry_due(NOW + 5_000, 10)
            .unwrap()
            .iter()
            .map(|c| c.issue_uuid)
            .collect::<Vec<_>>(),
        vec![id]
    );
}

#[test]
fn a_queued_row_the_client_holds_advances_through_dispatched_with_its_incident() {
    // R-6.4-34: the server requeued a command whose acceptance it never
    // learned; the client's snapshot holds it accepted or running
    use rvbox_store::commands::ReconcileWrite;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let to_accepted = queued(&mut s, "web-1", NOW, None);
    let to_running = queued(&mut s, "web-1", NOW, None);
    let incident = NewIncident {
        kind: wire::IncidentKind::ReconciliationContradiction,
        scope_kind: wire::ScopeKind::Command,
        scope_key: text(&to_running),
        client_id: Some("web-1".into()),
        issue_uuid: Some(to_running),
        summary: "queued on the server, running on the client".into(),
        evidence: Vec::new(),
        data_loss: false,
    };
    let writes = [
        ReconcileWrite::Advance {
            issue: to_accepted,
            revision: 1,
            to: Lifecycle::Accepted,
        },
        ReconcileWrite::Advance {
            issue: to_running,
            revision: 1,
            to: Lifecycle::Running,
        },
    ];
    s.apply_reconciliation(None, "web-1", &writes, std::slice::from_ref(&incident), NOW)
        .unwrap();
    assert_eq!(
        s.command_view(&to_accepted).unwrap().lifecycle,
        Lifecycle::Accepted
    );
    assert_eq!(
        s.command_view(&to_running).unwrap().lifecycle,
        Lifecycle::Running
    );
    let open = s.list_incidents(None, None, 10).unwrap();
    assert!(
        open.iter().any(|i| i.issue_uuid == Some(to_running)),
        "the contradiction incident commits with the round"
    );
}
