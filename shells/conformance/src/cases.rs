//! The cases. Each takes a fresh, empty backend.

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_store_port::audit::Caller;
use rvbox_store_port::commands::{Knowledge, ReconcileWrite, ServerTerminal};
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::ops::{Backend, Completion, OpResult, OpToken, PortError, StoreOp};
use rvbox_store_port::sessions::SessionFence;

use crate::support::*;

const CLIENT: &str = "web-1";

// ---- sessions -------------------------------------------------------------

/// The first registration installs generation 1; a newer one, decided on
/// the record as it stands, fences it and installs generation 2.
pub fn register_installs_a_live_session_and_a_newer_one_fences_it(b: &mut dyn Backend) {
    assert_eq!(client(b, CLIENT), None, "a client never seen has no record");
    let first = registration(CLIENT, INSTANCE, None);
    let r = op(b, StoreOp::Register(first.clone()));
    assert_eq!(r, Ok(Completion::Registered { generation: 1 }));
    let rec = client(b, CLIENT).unwrap();
    assert_eq!(rec.generation, 1);
    assert_eq!(rec.instance_id, Some(INSTANCE));
    let live = rec.live.unwrap();
    assert_eq!(live.session_id, first.session_id);
    assert_eq!(live.generation, 1);
    assert_eq!(live.opened_ms, NOW);

    let second = registration(CLIENT, INSTANCE, Some(&rec));
    assert_eq!(second.fence, Some(first.session_id));
    let r = op(b, StoreOp::Register(second.clone()));
    assert_eq!(r, Ok(Completion::Registered { generation: 2 }));
    let rec = client(b, CLIENT).unwrap();
    assert_eq!(rec.generation, 2);
    assert_eq!(rec.live.unwrap().session_id, second.session_id);
}

/// A registration decided on a record that changed since (another
/// generation, another live session) is `CONFLICT`, and nothing changes.
pub fn register_refuses_a_stale_decision_and_changes_nothing(b: &mut dyn Backend) {
    let seen_before = None;
    live_session(b, CLIENT);
    let rec = client(b, CLIENT).unwrap();
    // decided before the first registration: generation 0, no live session
    let stale = registration(CLIENT, INSTANCE, seen_before);
    assert_eq!(
        refused(&op(b, StoreOp::Register(stale))),
        Some(Code::Conflict)
    );
    // the right generation, but not fencing the live session
    let mut unfenced = registration(CLIENT, INSTANCE, Some(&rec));
    unfenced.fence = None;
    assert_eq!(
        refused(&op(b, StoreOp::Register(unfenced))),
        Some(Code::Conflict)
    );
    // a grant that does not exist
    let mut granted = registration(CLIENT, INSTANCE, Some(&rec));
    granted.consume_grant = Some(12345);
    assert_eq!(
        refused(&op(b, StoreOp::Register(granted))),
        Some(Code::Conflict)
    );
    assert_eq!(client(b, CLIENT).unwrap(), rec, "nothing changed");
}

/// A refused live-conflict claim is recorded with its instance and time;
/// the latest claim replaces an earlier one, and that instance's own
/// registration clears it.
pub fn a_refused_live_claim_is_recorded_and_cleared_by_that_instance(b: &mut dyn Backend) {
    live_session(b, CLIENT);
    let other = [7u8; 16];
    let r = op(
        b,
        StoreOp::RecordPendingClaim {
            client_id: CLIENT.into(),
            instance_id: [6u8; 16],
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    let r = b.perform(
        NOW + 5,
        StoreOp::RecordPendingClaim {
            client_id: CLIENT.into(),
            instance_id: other,
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    let rec = client(b, CLIENT).unwrap();
    assert_eq!(rec.pending_claim, Some((other, NOW + 5)));
    // that instance registers (as a takeover would let it)
    let reg = registration(CLIENT, other, Some(&rec));
    assert!(matches!(
        op(b, StoreOp::Register(reg)),
        Ok(Completion::Registered { generation: 2 })
    ));
    let rec = client(b, CLIENT).unwrap();
    assert_eq!(rec.pending_claim, None);
    assert_eq!(rec.instance_id, Some(other));
}

/// Closing a session ends it once; closing it again changes nothing, and
/// the client then has no live session (its generation stays).
pub fn close_session_ends_the_live_session_once(b: &mut dyn Backend) {
    let s = live_session(b, CLIENT);
    for _ in 0..2 {
        let r = op(
            b,
            StoreOp::CloseSession {
                session_id: s.session_id,
                reason: "connection lost".into(),
            },
        );
        assert_eq!(r, Ok(Completion::Done));
        let rec = client(b, CLIENT).unwrap();
        assert_eq!(rec.live, None);
        assert_eq!(rec.generation, 1);
    }
    // the next registration needs no fence
    let rec = client(b, CLIENT).unwrap();
    let reg = registration(CLIENT, INSTANCE, Some(&rec));
    assert_eq!(reg.fence, None);
    assert_eq!(
        op(b, StoreOp::Register(reg)),
        Ok(Completion::Registered { generation: 2 })
    );
}

// ---- commands -------------------------------------------------------------

/// The same `RunCommand` twice answers the same response and creates one
/// command, queued at revision 1.
pub fn run_command_is_idempotent_by_request_id(b: &mut dyn Backend) {
    let id = new_id();
    let request = run_request(&id, CLIENT, "make test");
    let first = op(
        b,
        StoreOp::RunCommand {
            request: request.clone(),
            caller: Caller::local(),
        },
    );
    let Ok(Completion::RunCommand(response)) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(response.issue_uuid, text(&id));
    let again = b.perform(
        NOW + 1000,
        StoreOp::RunCommand {
            request,
            caller: Caller::local(),
        },
    );
    assert_eq!(again, first, "an exact replay answers the stored response");
    let v = view(b, &id);
    assert_eq!(v.lifecycle, Lifecycle::Queued);
    assert_eq!(v.revision, 1);
    assert_eq!(v.client_id, CLIENT);
    assert_eq!(v.issue_time_ms, NOW);
    assert_eq!(v.last_event_seq, 0);
}

/// A `request_id` reused with other content is `CONFLICT` and does nothing;
/// an invalid request names its field.
pub fn run_command_refuses_a_reused_request_id_with_other_content(b: &mut dyn Backend) {
    let id = new_id();
    let r = op(
        b,
        StoreOp::RunCommand {
            request: run_request(&id, CLIENT, "make test"),
            caller: Caller::local(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let r = op(
        b,
        StoreOp::RunCommand {
            request: run_request(&id, CLIENT, "rm -rf /tmp/x"),
            caller: Caller::local(),
        },
    );
    assert_eq!(refused(&r), Some(Code::Conflict), "{r:?}");
    let mut bad = run_request(&new_id(), CLIENT, "true");
    bad.request_id = "not-a-uuid".into();
    let r = op(
        b,
        StoreOp::RunCommand {
            request: bad,
            caller: Caller::local(),
        },
    );
    let Err(PortError::Refused(e)) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.field().contains("request_id"), "{e:?}");
}

/// Dispatch and acceptance are compare-and-sets on the revision and
/// lifecycle the decision saw: a stale one is `CONFLICT` and changes
/// nothing.
pub fn dispatch_and_acceptance_check_the_revision_they_saw(b: &mut dyn Backend) {
    let issue = run(b, CLIENT);
    let s = live_session(b, CLIENT);
    let dispatch_at = |revision, write| StoreOp::Dispatch {
        issue,
        revision,
        write,
        session: s,
    };
    assert_eq!(
        refused(&op(b, dispatch_at(2, true))),
        Some(Code::Conflict),
        "a revision the command never had"
    );
    assert_eq!(
        refused(&op(b, dispatch_at(1, false))),
        Some(Code::Conflict),
        "sent again, but it was never dispatched"
    );
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Queued);
    let r = op(b, dispatch_at(1, true));
    let Ok(Completion::Spec(spec)) = &r else {
        panic!("{r:?}")
    };
    assert!(spec.source.is_some(), "the stored spec comes back");
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Dispatched);
    assert_eq!(
        refused(&op(b, dispatch_at(1, true))),
        Some(Code::Conflict),
        "dispatched already"
    );
    assert!(
        matches!(op(b, dispatch_at(1, false)), Ok(Completion::Spec(_))),
        "sent again while still dispatched at the revision"
    );
    let accept_at = |revision| StoreOp::RecordAccepted {
        issue,
        revision,
        resolved_shell: 1,
        session: s,
    };
    assert_eq!(refused(&op(b, accept_at(7))), Some(Code::Conflict));
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Dispatched);
    assert_eq!(op(b, accept_at(1)), Ok(Completion::Done));
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Accepted);
    assert_eq!(refused(&op(b, accept_at(1))), Some(Code::Conflict));
}

/// A transient negative acceptance returns the command to the queue, where
/// it can be dispatched again.
pub fn requeue_returns_a_dispatched_command_to_the_queue(b: &mut dyn Backend) {
    let issue = run(b, CLIENT);
    let s = live_session(b, CLIENT);
    dispatch(b, &issue, s);
    let r = op(
        b,
        StoreOp::Requeue {
            issue,
            revision: 1,
            session: s,
        },
    );
    assert_eq!(r, Ok(Completion::Requeued(Lifecycle::Queued)));
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Queued);
    let again = op(
        b,
        StoreOp::Requeue {
            issue,
            revision: 1,
            session: s,
        },
    );
    assert_eq!(
        refused(&again),
        Some(Code::Conflict),
        "no longer dispatched"
    );
    dispatch(b, &issue, s);
    assert_eq!(view(b, &issue).lifecycle, Lifecycle::Dispatched);
}

/// A permanent negative acceptance ends the command `rejected`, with a
/// terminal time; it cannot be ended twice.
pub fn a_rejection_ends_a_dispatched_command(b: &mut dyn Backend) {
    let issue = run(b, CLIENT);
    let s = live_session(b, CLIENT);
    dispatch(b, &issue, s);
    let reject = StoreOp::FinishByServer {
        issue,
        from: vec![Lifecycle::Dispatched],
        revision: 1,
        how: ServerTerminal::Rejected,
        rejection: Some(rvbox_proto::v1::ErrorDetail {
            code: rvbox_proto::v1::ErrorCode::Unsupported as i32,
            reason: "no such shell".into(),
            ..Default::default()
        }),
        session: Some(s),
    };
    assert_eq!(op(b, reject.clone()), Ok(Completion::Done));
    let v = view(b, &issue);
    assert_eq!(v.lifecycle, Lifecycle::Rejected);
    assert_eq!(refused(&op(b, reject)), Some(Code::Conflict));
}

// ---- fencing (docs/scaleout.md) -------------------------------------------

/// How the write's session stopped being the client's live one.
#[derive(Debug, Clone, Copy)]
enum Stale {
    /// A newer registration of the same client fenced it.
    Replaced,
    /// Its connection closed.
    Closed,
    /// It is another client's live session.
    OtherClient,
    /// It never existed.
    Unknown,
}

const STALE: [Stale; 4] = [
    Stale::Replaced,
    Stale::Closed,
    Stale::OtherClient,
    Stale::Unknown,
];

const OTHER: &str = "db-1";

/// The session a write carries, made stale the given way (`None`: live).
fn session(b: &mut dyn Backend, stale: Option<Stale>) -> SessionFence {
    let mine = live_session(b, CLIENT);
    match stale {
        None => mine,
        Some(Stale::Replaced) => {
            live_session(b, CLIENT);
            mine
        }
        Some(Stale::Closed) => {
            let r = op(
                b,
                StoreOp::CloseSession {
                    session_id: mine.session_id,
                    reason: "test".into(),
                },
            );
            assert_eq!(r, Ok(Completion::Done));
            mine
        }
        Some(Stale::OtherClient) => live_session(b, OTHER),
        Some(Stale::Unknown) => SessionFence {
            session_id: new_id(),
        },
    }
}

/// What a write needs before it: the command's lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    Queued,
    Dispatched,
    Running,
}

fn command(b: &mut dyn Backend, start: Start) -> [u8; 16] {
    // the other client exists, so it can have a live session
    run(b, OTHER);
    match start {
        Start::Running => running(b, CLIENT).0,
        Start::Queued => run(b, CLIENT),
        Start::Dispatched => {
            let issue = run(b, CLIENT);
            let s = live_session(b, CLIENT);
            dispatch(b, &issue, s);
            issue
        }
    }
}

fn late_incident(issue: &[u8; 16]) -> NewIncident {
    NewIncident {
        kind: rvbox_proto::v1::IncidentKind::LateAfterExpiry,
        scope_kind: rvbox_proto::v1::ScopeKind::Command,
        scope_key: text(issue),
        client_id: Some(CLIENT.into()),
        issue_uuid: Some(*issue),
        summary: "accepted after its queue expiry".into(),
        evidence: Vec::new(),
        data_loss: false,
    }
}

/// One fenced operation: its name, what it needs, and how it is made.
type Write = (&'static str, Start, fn([u8; 16], SessionFence) -> StoreOp);

/// Every operation the core issues for a connection, with what it needs.
fn writes() -> Vec<Write> {
    vec![
        ("dispatch", Start::Queued, |issue, session| {
            StoreOp::Dispatch {
                issue,
                revision: 1,
                write: true,
                session,
            }
        }),
        (
            "dispatch sent again",
            Start::Dispatched,
            |issue, session| StoreOp::Dispatch {
                issue,
                revision: 1,
                write: false,
                session,
            },
        ),
        ("record accepted", Start::Dispatched, |issue, session| {
            StoreOp::RecordAccepted {
                issue,
                revision: 1,
                resolved_shell: 0,
                session,
            }
        }),
        ("accept late", Start::Dispatched, |issue, session| {
            StoreOp::AcceptLate {
                issue,
                revision: 1,
                resolved_shell: 0,
                incident: late_incident(&issue),
                session,
            }
        }),
        ("requeue", Start::Dispatched, |issue, session| {
            StoreOp::Requeue {
                issue,
                revision: 1,
                session,
            }
        }),
        ("reject", Start::Dispatched, |issue, session| {
            StoreOp::FinishByServer {
                issue,
                from: vec![Lifecycle::Dispatched],
                revision: 1,
                how: ServerTerminal::Rejected,
                rejection: None,
                session: Some(session),
            }
        }),
        ("reconcile", Start::Dispatched, |issue, session| {
            StoreOp::ApplyReconciliation {
                client_id: CLIENT.into(),
                session,
                writes: vec![ReconcileWrite::Requeue { issue, revision: 1 }],
                incidents: Vec::new(),
            }
        }),
        ("append events", Start::Running, |issue, session| {
            let mut ev = output_event(&issue, 2, b"hello\n");
            ev.session = Some(session);
            StoreOp::AppendEvents { events: vec![ev] }
        }),
    ]
}

/// The refusal of a write, wherever the operation reports it.
fn refusal(result: &OpResult) -> Option<Code> {
    match result {
        Err(PortError::Refused(e)) => Some(e.code()),
        Ok(Completion::Appended(report)) => match report.outcomes.as_slice() {
            [EventOutcome::Refused(e)] => Some(e.code()),
            _ => None,
        },
        _ => None,
    }
}

fn state(b: &mut dyn Backend, issue: &[u8; 16]) -> (Lifecycle, u64, u64, bool) {
    let v = view(b, issue);
    (v.lifecycle, v.revision, v.last_event_seq, v.expired_pending)
}

/// Every write made for a connection is refused `STALE_SESSION`, changing
/// nothing, once its session was replaced, closed, is another client's,
/// or never existed. Each case runs in its own fresh backend state: the
/// commands are new, so one case cannot see another's.
pub fn every_connection_write_is_refused_once_its_session_is_not_live(b: &mut dyn Backend) {
    for (name, start, make) in writes() {
        for stale in STALE {
            let issue = command(b, start);
            let fence = session(b, Some(stale));
            let before = state(b, &issue);
            let result = op(b, make(issue, fence));
            assert_eq!(
                refusal(&result),
                Some(Code::StaleSession),
                "{name} with a {stale:?} session: {result:?}"
            );
            assert_eq!(
                state(b, &issue),
                before,
                "{name} with a {stale:?} session changed the command"
            );
        }
    }
}

/// With its live session, each of those writes commits.
pub fn every_connection_write_commits_with_its_live_session(b: &mut dyn Backend) {
    for (name, start, make) in writes() {
        let issue = command(b, start);
        let fence = session(b, None);
        let result = op(b, make(issue, fence));
        assert_eq!(refusal(&result), None, "{name}: {result:?}");
        assert!(result.is_ok(), "{name}: {result:?}");
    }
}

/// In one batch, a fenced dispatch and a fenced event are refused alone:
/// the other writes of the batch commit.
pub fn a_fenced_write_in_a_batch_leaves_the_others_alone(b: &mut dyn Backend) {
    let (running_issue, _) = running(b, CLIENT);
    let queued = run(b, CLIENT);
    let other = run(b, CLIENT);
    let old = live_session(b, CLIENT);
    let new = live_session(b, CLIENT);
    let dispatch = |issue, session| StoreOp::Dispatch {
        issue,
        revision: 1,
        write: true,
        session,
    };
    let mut stale_event = output_event(&running_issue, 2, b"stale\n");
    stale_event.session = Some(old);
    let mut live_event = output_event(&running_issue, 2, b"live\n");
    live_event.session = Some(new);
    let done = b.perform_batch(vec![
        (OpToken(1), NOW, dispatch(queued, old)),
        (OpToken(2), NOW, dispatch(other, new)),
        (
            OpToken(3),
            NOW,
            StoreOp::AppendEvents {
                events: vec![stale_event],
            },
        ),
        (
            OpToken(4),
            NOW,
            StoreOp::AppendEvents {
                events: vec![live_event],
            },
        ),
    ]);
    let tokens: Vec<u64> = done.iter().map(|(t, _)| t.0).collect();
    assert_eq!(tokens, vec![1, 2, 3, 4], "completions keep the batch order");
    assert_eq!(refusal(&done[0].1), Some(Code::StaleSession));
    assert!(
        matches!(done[1].1, Ok(Completion::Spec(_))),
        "{:?}",
        done[1]
    );
    assert_eq!(refusal(&done[2].1), Some(Code::StaleSession));
    assert_eq!(refusal(&done[3].1), None, "{:?}", done[3]);
    assert_eq!(view(b, &queued).lifecycle, Lifecycle::Queued);
    assert_eq!(view(b, &other).lifecycle, Lifecycle::Dispatched);
    assert_eq!(view(b, &running_issue).last_event_seq, 2);
}

// ---- reads ----------------------------------------------------------------

/// The reads dispatch and reconciliation make: the client's non-terminal
/// commands by id, dispatch candidates (queued in issue order, then
/// dispatched), what the server knows of an id (a row, a tombstone, or
/// nothing), and queue expiry.
pub fn reads_answer_what_dispatch_and_reconciliation_need(b: &mut dyn Backend) {
    let s = live_session(b, CLIENT);
    let first = run(b, CLIENT);
    let second = run(b, CLIENT);
    let third = run(b, CLIENT);
    let other = run(b, "db-1");
    dispatch(b, &second, s);
    // third is rejected: terminal, with a tombstone
    dispatch(b, &third, s);
    let r = op(
        b,
        StoreOp::FinishByServer {
            issue: third,
            from: vec![Lifecycle::Dispatched],
            revision: 1,
            how: ServerTerminal::Rejected,
            rejection: None,
            session: Some(s),
        },
    );
    assert_eq!(r, Ok(Completion::Done));

    let Ok(Completion::Commands(rows)) = op(
        b,
        StoreOp::NonTerminalCommands {
            client_id: CLIENT.into(),
        },
    ) else {
        panic!("NonTerminalCommands")
    };
    let mut want = vec![first, second];
    want.sort_unstable();
    assert_eq!(
        rows.iter().map(|v| v.issue_uuid).collect::<Vec<_>>(),
        want,
        "non-terminal commands of this client, by id"
    );

    let Ok(Completion::Commands(rows)) = op(
        b,
        StoreOp::DispatchCandidates {
            client_id: CLIENT.into(),
            limit: 10,
        },
    ) else {
        panic!("DispatchCandidates")
    };
    assert_eq!(
        rows.iter()
            .map(|v| (v.issue_uuid, v.lifecycle))
            .collect::<Vec<_>>(),
        vec![(first, Lifecycle::Queued), (second, Lifecycle::Dispatched)]
    );

    let missing = new_id();
    let Ok(Completion::Knowledge(known)) = op(
        b,
        StoreOp::Knowledge {
            issues: vec![missing, third, other],
        },
    ) else {
        panic!("Knowledge")
    };
    assert_eq!(known.len(), 3);
    assert_eq!(known[0], (missing, Knowledge::Missing));
    assert!(
        matches!(
            known[1].1,
            Knowledge::Terminal {
                lifecycle: Lifecycle::Rejected,
                ..
            }
        ),
        "{known:?}"
    );
    assert!(
        matches!(
            known[2].1,
            Knowledge::Terminal {
                lifecycle: Lifecycle::Queued,
                ..
            }
        ),
        "{known:?}"
    );
    assert_eq!(known[1].0, third);
}

/// A command past its queue expiry is due while queued; once dispatched
/// and marked expired pending, it is due no more.
pub fn expiry_lists_due_commands_and_the_pending_mark_ends_it(b: &mut dyn Backend) {
    let s = live_session(b, CLIENT);
    let id = new_id();
    let mut request = run_request(&id, CLIENT, "sleep 1");
    request.queue_ttl = Some(prost_types::Duration {
        seconds: 60,
        nanos: 0,
    });
    let r = op(
        b,
        StoreOp::RunCommand {
            request,
            caller: Caller::local(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let due = |b: &mut dyn Backend, at: i64| match b.perform(at, StoreOp::ExpiryDue { limit: 10 }) {
        Ok(Completion::Commands(rows)) => rows.iter().map(|v| v.issue_uuid).collect::<Vec<_>>(),
        other => panic!("ExpiryDue: {other:?}"),
    };
    assert!(due(b, NOW + 59_000).is_empty());
    assert_eq!(due(b, NOW + 60_000), vec![id]);
    dispatch(b, &id, s);
    assert_eq!(
        due(b, NOW + 60_000),
        vec![id],
        "dispatched and not yet marked"
    );
    assert_eq!(
        refused(&op(
            b,
            StoreOp::MarkExpiredPending {
                issue: id,
                revision: 9
            }
        )),
        Some(Code::Conflict)
    );
    let r = op(
        b,
        StoreOp::MarkExpiredPending {
            issue: id,
            revision: 1,
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    assert!(view(b, &id).expired_pending);
    assert!(due(b, NOW + 60_000).is_empty());
}

/// A script is stored whole and read back by any range, across its
/// chunks; its size is the raw size.
pub fn a_script_is_read_back_by_range(b: &mut dyn Backend) {
    let script: Vec<u8> = (0..700_000u32)
        .map(|n| (n.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let id = new_id();
    let mut request = run_request(&id, CLIENT, "");
    request.spec = Some(rvbox_proto::v1::ExecutionSpec {
        source: Some(rvbox_proto::v1::execution_spec::Source::Script(
            rvbox_proto::v1::ScriptDescriptor {
                display_basename: "deploy.sh".into(),
                size_bytes: script.len() as u64,
                sha256: rvbox_segment::sha256(&script).to_vec(),
            },
        )),
        ..Default::default()
    });
    request.script = script.clone();
    let r = op(
        b,
        StoreOp::RunCommand {
            request,
            caller: Caller::local(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(view(b, &id).script_bytes, script.len() as u64);
    assert_eq!(
        op(b, StoreOp::ScriptInfo { issue: id }),
        Ok(Completion::Script {
            lifecycle: Lifecycle::Queued,
            size: Some(script.len() as u64)
        })
    );
    for (offset, len) in [
        (0u64, 1000u64),
        (262_000, 2_000),
        (524_287, 300_000),
        (699_999, 10),
    ] {
        let r = op(
            b,
            StoreOp::ScriptRange {
                issue: id,
                offset,
                len,
            },
        );
        let end = (offset + len).min(script.len() as u64) as usize;
        assert_eq!(
            r,
            Ok(Completion::ScriptBytes(
                script[offset as usize..end].to_vec()
            )),
            "range {offset}+{len}"
        );
    }
    assert_eq!(
        op(
            b,
            StoreOp::ScriptRange {
                issue: id,
                offset: 700_000,
                len: 10
            }
        ),
        Ok(Completion::ScriptBytes(Vec::new())),
        "past the end"
    );
    let text = run(b, CLIENT);
    assert_eq!(
        op(b, StoreOp::ScriptInfo { issue: text }),
        Ok(Completion::Script {
            lifecycle: Lifecycle::Queued,
            size: None
        })
    );
}

// ---- signals ----------------------------------------------------------------

fn signal(
    b: &mut dyn Backend,
    id: &[u8; 16],
    issue: &[u8; 16],
    kind: rvbox_proto::v1::SignalKind,
) -> OpResult {
    op(
        b,
        StoreOp::SignalCommand {
            request: rvbox_proto::v1::SignalCommandRequest {
                request_id: text(id),
                issue_uuid: text(issue),
                signal: kind as i32,
            },
            caller: Caller::local(),
        },
    )
}

/// A signal to a queued command cancels it; to a dispatched one it is a
/// higher revision, a pending signal and a frame to deliver. Each is
/// idempotent by `request_id`, and an ended command refuses signals.
pub fn signals_cancel_queued_work_and_are_delivered_to_held_work(b: &mut dyn Backend) {
    use rvbox_proto::v1::SignalKind;
    let s = live_session(b, CLIENT);
    let queued = run(b, CLIENT);
    let held = run(b, CLIENT);
    dispatch(b, &held, s);

    let id = new_id();
    let r = signal(b, &id, &queued, SignalKind::Term);
    let Ok(Completion::Signal(outcome)) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(outcome.response.revision, 2);
    assert_eq!(
        outcome.response.lifecycle,
        Lifecycle::Cancelled.to_wire() as i32
    );
    assert_eq!(outcome.deliver, None);
    assert!(!outcome.replayed);
    assert_eq!(view(b, &queued).lifecycle, Lifecycle::Cancelled);
    let again = signal(b, &id, &queued, SignalKind::Term);
    let Ok(Completion::Signal(replay)) = &again else {
        panic!("{again:?}")
    };
    assert!(replay.replayed);
    assert_eq!(replay.response, outcome.response);
    assert_eq!(
        refused(&signal(b, &id, &queued, SignalKind::Kill)),
        Some(Code::Conflict),
        "the same request_id with another signal"
    );
    assert!(
        refused(&signal(b, &new_id(), &queued, SignalKind::Kill)).is_some(),
        "an ended command takes no signal"
    );

    let r = signal(b, &new_id(), &held, SignalKind::Kill);
    let Ok(Completion::Signal(outcome)) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(outcome.response.revision, 2);
    assert_eq!(outcome.client_id, CLIENT);
    let frame = outcome.deliver.clone().unwrap();
    assert_eq!(frame.revision, 2);
    assert_eq!(frame.signal, SignalKind::Kill as i32);
    let v = view(b, &held);
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Dispatched, 2));
    assert_eq!(
        op(b, StoreOp::PendingSignals { issues: vec![held] }),
        Ok(Completion::PendingSignals(vec![frame]))
    );
    // a dispatched command with a pending signal never goes back to the
    // queue: it ends cancelled
    assert_eq!(
        op(
            b,
            StoreOp::Requeue {
                issue: held,
                revision: 2,
                session: s
            }
        ),
        Ok(Completion::Requeued(Lifecycle::Cancelled))
    );
    assert_eq!(
        op(b, StoreOp::PendingSignals { issues: vec![held] }),
        Ok(Completion::PendingSignals(Vec::new())),
        "an ended command has no pending signal"
    );
}

// ---- stdin ------------------------------------------------------------------

fn append_stdin(b: &mut dyn Backend, id: &[u8; 16], issue: &[u8; 16], data: &[u8]) -> OpResult {
    op(
        b,
        StoreOp::AppendStdin {
            request: rvbox_proto::v1::AppendStdinRequest {
                request_id: text(id),
                issue_uuid: text(issue),
                data: data.to_vec(),
                newline: rvbox_proto::v1::StdinNewline::Append as i32,
            },
            caller: Caller::local(),
        },
    )
}

fn stdin_response(r: &OpResult) -> rvbox_store_port::stdin::StdinOutcome {
    match r {
        Ok(Completion::Stdin(o)) => (**o).clone(),
        other => panic!("stdin: {other:?}"),
    }
}

/// Stdin is numbered writes: an append splits at 256 KiB with the newline
/// last, a replay answers the same writes with their delivery as it is
/// now, the client's acknowledgement settles a write, a close is a last
/// write, and nothing is taken after it.
pub fn stdin_writes_are_numbered_settled_by_acks_and_closed_once(b: &mut dyn Backend) {
    use rvbox_proto::v1::{StdinAck, StdinDelivery};
    use rvbox_store_port::stdin::StdinResponse;
    let (issue, session) = running(b, CLIENT);
    let first_id = new_id();
    let first = stdin_response(&append_stdin(b, &first_id, &issue, b"hello"));
    let StdinResponse::Append(r) = &first.response else {
        panic!("{first:?}")
    };
    assert_eq!((r.first_write_seq, r.last_write_seq), (1, 1));
    assert_eq!(r.delivery, StdinDelivery::Pending as i32);
    assert!(!first.replayed);
    assert_eq!(first.lifecycle, Lifecycle::Running);

    let big = vec![b'x'; 600 * 1024];
    let second = stdin_response(&append_stdin(b, &new_id(), &issue, &big));
    let StdinResponse::Append(r) = &second.response else {
        panic!("{second:?}")
    };
    assert_eq!((r.first_write_seq, r.last_write_seq), (2, 4));

    let Ok(Completion::StdinWrites(pending)) = op(
        b,
        StoreOp::PendingStdin {
            issue,
            after_seq: 0,
            max_bytes: 1 << 20,
            max_writes: 16,
        },
    ) else {
        panic!("PendingStdin")
    };
    assert_eq!(
        pending
            .writes
            .iter()
            .map(|w| (w.write_seq, w.raw_length, w.newline))
            .collect::<Vec<_>>(),
        vec![
            (1, 5, rvbox_proto::v1::StdinNewline::Append as i32),
            (2, 262_144, rvbox_proto::v1::StdinNewline::Raw as i32),
            (3, 262_144, rvbox_proto::v1::StdinNewline::Raw as i32),
            (4, 90_112, rvbox_proto::v1::StdinNewline::Append as i32),
        ]
    );
    assert!(!pending.more);

    // the client wrote the first one
    let ack = StdinAck {
        write_seq: 1,
        delivery: StdinDelivery::Written as i32,
        ..Default::default()
    };
    let mut ev = lifecycle_event(&issue, 2, Lifecycle::Running);
    ev.body = rvbox_store_port::events::EventBody::Other {
        kind: rvbox_store_port::events::body_kind::STDIN_ACK,
        encoded: prost::Message::encode_to_vec(&ack),
    };
    ev.session = Some(session);
    let r = op(b, StoreOp::AppendEvents { events: vec![ev] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    let replay = stdin_response(&append_stdin(b, &first_id, &issue, b"hello"));
    assert!(replay.replayed);
    let StdinResponse::Append(r) = &replay.response else {
        panic!("{replay:?}")
    };
    assert_eq!(r.delivery, StdinDelivery::Written as i32, "as it is now");
    let Ok(Completion::StdinWrites(pending)) = op(
        b,
        StoreOp::PendingStdin {
            issue,
            after_seq: 0,
            max_bytes: 1 << 20,
            max_writes: 16,
        },
    ) else {
        panic!("PendingStdin")
    };
    assert_eq!(pending.writes.first().map(|w| w.write_seq), Some(2));

    let close = op(
        b,
        StoreOp::CloseStdin {
            request: rvbox_proto::v1::CloseStdinRequest {
                request_id: text(&new_id()),
                issue_uuid: text(&issue),
            },
            caller: Caller::local(),
        },
    );
    let StdinResponse::Close(c) = stdin_response(&close).response else {
        panic!("{close:?}")
    };
    assert_eq!(c.write_seq, 5);
    assert_eq!(
        refused(&append_stdin(b, &new_id(), &issue, b"late")),
        Some(Code::FailedPrecondition),
        "stdin is closed"
    );
    assert_eq!(
        refused(&append_stdin(b, &first_id, &issue, b"other")),
        Some(Code::Conflict),
        "a request_id reused with other data"
    );
}

// ---- takeover -----------------------------------------------------------------

fn authorize(b: &mut dyn Backend, id: &[u8; 16], client_id: &str, instance: &[u8; 16]) -> OpResult {
    op(
        b,
        StoreOp::AuthorizeTakeover {
            request: rvbox_proto::v1::AuthorizeClientTakeoverRequest {
                request_id: text(id),
                client_id: client_id.into(),
                client_instance_id: any_uuid_text(instance),
            },
            caller: Caller::local(),
            ttl_ms: 60_000,
        },
    )
}

/// A takeover grant admits exactly the instance of the pending claim, once,
/// until it expires; a grant for another instance is refused, and the
/// refusal is the request's stored result.
pub fn a_takeover_grant_admits_exactly_the_pending_claim_once(b: &mut dyn Backend) {
    // instance ids are UUIDs of any version; these are v4 shaped
    let claimant: [u8; 16] = {
        let mut i = new_id();
        i[6] = 0x40 | (i[6] & 0x0f);
        i
    };
    let stranger: [u8; 16] = {
        let mut i = new_id();
        i[6] = 0x40 | (i[6] & 0x0f);
        i
    };
    live_session(b, CLIENT);
    let r = op(
        b,
        StoreOp::RecordPendingClaim {
            client_id: CLIENT.into(),
            instance_id: claimant,
        },
    );
    assert_eq!(r, Ok(Completion::Done));

    let refused_id = new_id();
    let r = authorize(b, &refused_id, CLIENT, &stranger);
    assert_eq!(refused(&r), Some(Code::FailedPrecondition), "{r:?}");
    assert_eq!(
        authorize(b, &refused_id, CLIENT, &stranger),
        r,
        "the refusal is the stored result"
    );
    assert_eq!(
        refused(&authorize(b, &new_id(), "nobody-1", &claimant)),
        Some(Code::NotFound)
    );

    let id = new_id();
    let r = authorize(b, &id, CLIENT, &claimant);
    let Ok(Completion::Takeover(response)) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(
        response.grant_expiry_time.as_ref().map(|t| t.seconds),
        Some((NOW + 60_000) / 1000)
    );
    assert_eq!(authorize(b, &id, CLIENT, &claimant), r, "a replay");
    let rec = client(b, CLIENT).unwrap();
    let grant = rec.grant.unwrap();
    assert_eq!(grant.instance_id, claimant);
    assert_eq!(grant.expires_ms, NOW + 60_000);

    let mut reg = registration(CLIENT, claimant, Some(&rec));
    reg.consume_grant = Some(grant.id);
    assert_eq!(
        op(b, StoreOp::Register(reg.clone())),
        Ok(Completion::Registered { generation: 2 })
    );
    let rec = client(b, CLIENT).unwrap();
    assert_eq!(rec.grant, None, "consumed");
    assert_eq!(rec.instance_id, Some(claimant));
    // the same grant admits nobody again
    let mut again = registration(CLIENT, claimant, Some(&rec));
    again.consume_grant = Some(grant.id);
    assert_eq!(
        refused(&op(b, StoreOp::Register(again))),
        Some(Code::Conflict)
    );
}

// ---- incidents ----------------------------------------------------------------

/// An incident request names what is wrong with it before anything is
/// looked up: its ids, then the note; an id with no incident is
/// `NOT_FOUND`.
pub fn incident_requests_name_what_is_wrong(b: &mut dyn Backend) {
    let repair = |request_id: String, incident_id: String| StoreOp::RepairIncident {
        request: rvbox_proto::v1::RepairStorageIncidentRequest {
            request_id,
            incident_id,
        },
        caller: Caller::local(),
    };
    let acknowledge = |incident_id: String, note: &str| StoreOp::AcknowledgeIncident {
        request: rvbox_proto::v1::AcknowledgeStorageIncidentRequest {
            request_id: text(&new_id()),
            incident_id,
            note: note.into(),
        },
        caller: Caller::local(),
    };
    let field = |r: &OpResult| match r {
        Err(PortError::Refused(e)) => (e.code(), e.field().to_owned()),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        field(&op(b, repair("x".into(), text(&new_id())))),
        (Code::InvalidArgument, "request_id".into())
    );
    assert_eq!(
        field(&op(b, repair(text(&new_id()), "not-an-id".into()))),
        (Code::InvalidArgument, "incident_id".into())
    );
    assert_eq!(
        field(&op(b, repair(text(&new_id()), text(&new_id())))),
        (Code::NotFound, "incident_id".into())
    );
    assert_eq!(
        field(&op(b, acknowledge(text(&new_id()), ""))).0,
        Code::InvalidArgument,
        "an empty note"
    );
    assert_eq!(
        field(&op(b, acknowledge(text(&new_id()), "seen, accepted"))),
        (Code::NotFound, "incident_id".into())
    );
}

// ---- maintenance -------------------------------------------------------------

fn maintain(b: &mut dyn Backend, wall_ms: i64) -> rvbox_store_port::maintenance::MaintenanceReport {
    match b.perform(wall_ms, StoreOp::Maintain) {
        Ok(Completion::Maintained(r)) => r,
        other => panic!("Maintain: {other:?}"),
    }
}

/// A maintenance pass reclaims terminal commands older than the terminal
/// retention (30 days by default), keeping each one's replay tombstone,
/// and never a running command or one that ended recently.
pub fn maintenance_reclaims_aged_terminal_commands_keeping_their_tombstones(b: &mut dyn Backend) {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let (done, session) = running(b, "web-1");
    let mut ev = lifecycle_event(&done, 2, Lifecycle::Succeeded);
    ev.session = Some(session);
    let r = op(b, StoreOp::AppendEvents { events: vec![ev] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    let (active, _) = running(b, "web-2");
    let queued = run(b, "web-3");

    // nothing is old enough yet
    let r = maintain(b, NOW + DAY_MS);
    assert_eq!(r.evicted_aged, 0, "{r:?}");
    assert_eq!(view(b, &done).lifecycle, Lifecycle::Succeeded);

    // 31 days later the finished command goes; its tombstone stays
    let r = maintain(b, NOW + 31 * DAY_MS);
    assert_eq!(r.evicted_aged, 1, "{r:?}");
    assert_eq!(r.evictions_failed, 0, "{r:?}");
    let tombstoned = |b: &mut dyn Backend| {
        let Ok(Completion::Knowledge(known)) = op(b, StoreOp::Knowledge { issues: vec![done] })
        else {
            panic!("Knowledge")
        };
        matches!(known[0].1, Knowledge::Tombstoned { .. })
    };
    assert!(tombstoned(b));
    assert!(
        b.perform(NOW, StoreOp::CommandView { issue: done })
            .is_err(),
        "the command's row is gone"
    );
    assert_eq!(view(b, &active).lifecycle, Lifecycle::Running);
    assert_eq!(view(b, &queued).lifecycle, Lifecycle::Queued);
    // its request id is answered from the tombstone, never run again
    let _ = b.perform(
        NOW + 31 * DAY_MS,
        StoreOp::RunCommand {
            request: run_request(&done, "web-1", "uptime"),
            caller: Caller::local(),
        },
    );
    assert!(tombstoned(b), "the request id was not run again");
    // a second pass finds nothing more
    let r = maintain(b, NOW + 31 * DAY_MS);
    assert_eq!(r.evicted_aged, 0, "{r:?}");
}

/// A maintenance pass forgets a client idle for the terminal retention
/// that has no command, no live session and no live takeover grant; a
/// client that comes back starts above every generation it had.
pub fn maintenance_prunes_idle_clients_above_their_generations(b: &mut dyn Backend) {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    // idle: registered twice, then its session closed
    live_session(b, "idle-1");
    let s = live_session(b, "idle-1");
    let r = op(
        b,
        StoreOp::CloseSession {
            session_id: s.session_id,
            reason: "connection lost".into(),
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    assert_eq!(client(b, "idle-1").unwrap().generation, 2);
    // kept: a live session, and a command
    live_session(b, "live-1");
    run(b, "busy-1");

    let r = maintain(b, NOW + DAY_MS);
    assert_eq!(r.clients_pruned, 0, "{r:?}");
    assert!(client(b, "idle-1").is_some());

    let r = maintain(b, NOW + 31 * DAY_MS);
    assert_eq!(r.clients_pruned, 1, "{r:?}");
    assert!(
        client(b, "idle-1").is_none(),
        "the idle client is forgotten"
    );
    assert!(client(b, "live-1").is_some());
    assert!(client(b, "busy-1").is_some());
    // it comes back above the generation it had
    live_session(b, "idle-1");
    assert!(client(b, "idle-1").unwrap().generation > 2);
}
