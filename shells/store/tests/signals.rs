#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! `SignalCommand` on real SQLite (plan §6.4, R-6.4-35..38): idempotent by
//! `request_id` across a reopen, one transaction for revision, pending
//! signal and stored response, pending signals kept until the command ends.

mod support;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::commands::CommandView;
use rvbox_store::incidents::NewIncident;
use rvbox_store::mutations::OpError;
use rvbox_store::signals::{MAX_PENDING_SIGNALS, SignalPlan};
use support::*;

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

/// The dispatch core's rule, as the engine applies it.
fn plan(v: &CommandView) -> Result<SignalPlan, DomainError> {
    match v.lifecycle {
        Lifecycle::Queued => Ok(SignalPlan::CancelQueued),
        l if l.is_terminal() => Err(DomainError::new(
            Code::FailedPrecondition,
            "the command already ended",
        )),
        _ => Ok(SignalPlan::Deliver),
    }
}

fn request(id: &[u8; 16], kind: wire::SignalKind) -> wire::SignalCommandRequest {
    wire::SignalCommandRequest {
        request_id: text(&new_id()),
        issue_uuid: text(id),
        signal: kind as i32,
    }
}

fn accepted(s: &mut Store) -> [u8; 16] {
    let id = new_id();
    s.run_command(&run_request(&id, "web-1", "sleep 60"), NOW)
        .unwrap();
    s.mark_dispatched(&id, 1).unwrap();
    s.record_accepted(&id, 1, wire::ShellType::Sh as i32)
        .unwrap();
    id
}

#[test]
fn a_queued_command_is_cancelled_by_the_server_and_nothing_is_left_pending() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    s.run_command(&run_request(&id, "web-1", "true"), NOW)
        .unwrap();
    let out = s
        .signal_command(&request(&id, wire::SignalKind::Kill), plan, NOW + 1)
        .unwrap();
    assert_eq!(out.response.lifecycle, wire::Lifecycle::Cancelled as i32);
    assert_eq!(out.response.revision, 2);
    assert!(out.deliver.is_none(), "no frame for work never dispatched");
    let v = s.command_view(&id).unwrap();
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Cancelled, 2));
    assert!(s.pending_signals(&id).unwrap().is_empty());
    // and a second signal on it is refused: it already ended
    assert_eq!(
        code(
            s.signal_command(&request(&id, wire::SignalKind::Kill), plan, NOW + 2)
                .unwrap_err()
        ),
        Code::FailedPrecondition
    );
}

#[test]
fn a_replay_after_a_reopen_answers_the_same_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = accepted(&mut s);
    let req = request(&id, wire::SignalKind::Term);
    let first = s.signal_command(&req, plan, NOW + 1).unwrap();
    assert!(!first.replayed);
    assert_eq!(first.response.revision, 2);
    assert_eq!(first.response.lifecycle, wire::Lifecycle::Accepted as i32);
    let frame = first.deliver.clone().unwrap();
    assert_eq!(
        (frame.revision, frame.signal),
        (2, wire::SignalKind::Term as i32)
    );
    drop(s);

    let mut s = open(dir.path());
    let again = s
        .signal_command(&req, |_| panic!("a replay decides nothing"), NOW + 2)
        .unwrap();
    assert!(again.replayed);
    assert_eq!(again.response, first.response);
    assert!(again.deliver.is_none());
    assert_eq!(s.command_view(&id).unwrap().revision, 2);
    assert_eq!(s.pending_signals(&id).unwrap(), vec![frame]);

    // the same id for a different request is a conflict, and no work
    let other = wire::SignalCommandRequest {
        signal: wire::SignalKind::Kill as i32,
        ..req.clone()
    };
    assert_eq!(
        code(s.signal_command(&other, plan, NOW + 3).unwrap_err()),
        Code::Conflict
    );
    assert_eq!(s.command_view(&id).unwrap().revision, 2);
}

#[test]
fn a_refused_decision_writes_nothing_and_the_request_id_stays_usable() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = accepted(&mut s);
    let req = request(&id, wire::SignalKind::Term);
    let refused = s
        .signal_command(
            &req,
            |_| Err(DomainError::new(Code::FailedPrecondition, "not now")),
            NOW + 1,
        )
        .unwrap_err();
    assert_eq!(code(refused), Code::FailedPrecondition);
    assert_eq!(s.command_view(&id).unwrap().revision, 1);
    assert!(s.pending_signals(&id).unwrap().is_empty());
    let ok = s.signal_command(&req, plan, NOW + 2).unwrap();
    assert_eq!(ok.response.revision, 2);
}

#[test]
fn malformed_requests_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = accepted(&mut s);
    let mut bad_id = request(&id, wire::SignalKind::Term);
    bad_id.request_id = "not-a-uuid".into();
    let e = s
        .signal_command(&bad_id, plan, NOW)
        .unwrap_err()
        .to_domain();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(e.field(), "request_id");
    let unset = request(&id, wire::SignalKind::Unspecified);
    let e = s.signal_command(&unset, plan, NOW).unwrap_err().to_domain();
    assert_eq!((e.code(), e.field()), (Code::InvalidArgument, "signal"));
    let unknown = request(&new_id(), wire::SignalKind::Term);
    assert_eq!(
        code(s.signal_command(&unknown, plan, NOW).unwrap_err()),
        Code::NotFound
    );
}

#[test]
fn pending_signals_coalesce_by_kind_and_end_with_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = accepted(&mut s);
    // many signals of one kind keep one row, at the newest revision
    for i in 0..40u64 {
        let r = s
            .signal_command(&request(&id, wire::SignalKind::Hup), plan, NOW + 1)
            .unwrap();
        assert_eq!(r.response.revision, i + 2);
    }
    // a kill is never refused, however many signals came before
    let kill = s
        .signal_command(&request(&id, wire::SignalKind::Kill), plan, NOW + 2)
        .unwrap();
    assert_eq!(kill.response.revision, 42);
    let pending = s.pending_signals(&id).unwrap();
    assert_eq!(
        pending
            .iter()
            .map(|p| (p.signal, p.revision))
            .collect::<Vec<_>>(),
        vec![
            (wire::SignalKind::Hup as i32, 41),
            (wire::SignalKind::Kill as i32, 42)
        ],
        "oldest first, one per kind"
    );
    assert!(u64::try_from(pending.len()).unwrap() <= MAX_PENDING_SIGNALS);

    // the command ends: nothing is pending any more
    s.finish_by_server(
        None,
        &id,
        &[Lifecycle::Accepted],
        42,
        rvbox_store::commands::ServerTerminal::Interrupted,
        None,
        None,
        NOW + 3,
    )
    .unwrap();
    assert!(s.pending_signals(&id).unwrap().is_empty());
}

#[test]
fn signalled_work_the_client_never_held_is_cancelled_not_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    s.run_command(&run_request(&id, "web-1", "sleep 60"), NOW)
        .unwrap();
    s.mark_dispatched(&id, 1).unwrap();
    let out = s
        .signal_command(&request(&id, wire::SignalKind::Term), plan, NOW + 1)
        .unwrap();
    assert_eq!(out.response.lifecycle, wire::Lifecycle::Dispatched as i32);
    // the client proves it never held it (a transient refusal, or absence
    // from its snapshot): launch was never authorized
    assert_eq!(
        s.requeue(None, &id, 2, NOW + 2).unwrap(),
        Lifecycle::Cancelled
    );
    let v = s.command_view(&id).unwrap();
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Cancelled, 2));
    assert!(s.queued_commands("web-1", 10).unwrap().is_empty());

    // the same through a reconciliation round
    let other = new_id();
    s.run_command(&run_request(&other, "web-1", "sleep 60"), NOW)
        .unwrap();
    s.mark_dispatched(&other, 1).unwrap();
    s.signal_command(&request(&other, wire::SignalKind::Kill), plan, NOW + 3)
        .unwrap();
    s.apply_reconciliation(
        None,
        "web-1",
        &[rvbox_store::commands::ReconcileWrite::Requeue {
            issue: other,
            revision: 2,
        }],
        &[],
        NOW + 4,
    )
    .unwrap();
    assert_eq!(
        s.command_view(&other).unwrap().lifecycle,
        Lifecycle::Cancelled
    );

    // without a pending signal a requeue is a requeue
    let plain = new_id();
    s.run_command(&run_request(&plain, "web-1", "true"), NOW)
        .unwrap();
    s.mark_dispatched(&plain, 1).unwrap();
    assert_eq!(
        s.requeue(None, &plain, 1, NOW + 5).unwrap(),
        Lifecycle::Queued
    );
}

#[test]
fn a_late_acceptance_commits_acceptance_incident_revision_and_term_together() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    s.run_command(&run_request(&id, "web-1", "sleep 60"), NOW)
        .unwrap();
    s.mark_dispatched(&id, 1).unwrap();
    let incident = NewIncident {
        kind: wire::IncidentKind::LateAfterExpiry,
        scope_kind: wire::ScopeKind::Command,
        scope_key: text(&id),
        client_id: Some("web-1".into()),
        issue_uuid: Some(id),
        summary: "accepted after its queue expiry".into(),
        evidence: Vec::new(),
        data_loss: false,
    };
    let shell = wire::ShellType::Sh as i32;
    // a stale view changes nothing
    assert_eq!(
        code(
            s.accept_late(None, &id, 7, shell, &incident, NOW)
                .unwrap_err()
        ),
        Code::Conflict
    );
    assert_eq!(
        s.command_view(&id).unwrap().lifecycle,
        Lifecycle::Dispatched
    );
    assert!(s.list_incidents(None, None, 10).unwrap().is_empty());
    let term = s.accept_late(None, &id, 1, shell, &incident, NOW).unwrap();
    assert_eq!(
        (term.revision, term.signal),
        (2, wire::SignalKind::Term as i32)
    );
    let v = s.command_view(&id).unwrap();
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Accepted, 2));
    assert_eq!(s.pending_signals(&id).unwrap(), vec![term]);
    let incidents = s.list_incidents(None, None, 10).unwrap();
    assert_eq!(incidents.len(), 1);
    assert_eq!(incidents[0].kind, wire::IncidentKind::LateAfterExpiry);
}
