#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Fencing by session at the store port (docs/scaleout.md): every write
//! made for a connection carries the session it was made for, and the
//! store refuses it `STALE_SESSION`, changing nothing, once that session
//! is no longer its client's live one: fenced by a newer registration,
//! closed, or another client's. With its live session the same write
//! commits. Driven through the executor, as the server core issues them.

#[path = "../../store/tests/support/mod.rs"]
mod support;

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_engine::Executor;
use rvbox_store::Store;
use rvbox_store::events::EventOutcome;
use rvbox_store::sessions::SessionFence;
use rvbox_store_port::commands::{ReconcileWrite, ServerTerminal};
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::ops::{Completion, OpResult, OpToken, PortError, StoreOp};
use support::*;

const CLIENT: &str = "web-1";

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

/// The session a write carries, made stale the given way (`None`: live).
fn session(store: &mut Store, stale: Option<Stale>) -> SessionFence {
    let mine = live_session(store, CLIENT);
    match stale {
        None => mine,
        Some(Stale::Replaced) => {
            live_session(store, CLIENT);
            mine
        }
        Some(Stale::Closed) => {
            assert!(
                store
                    .close_session(&mine.session_id, false, "test", NOW)
                    .unwrap()
            );
            mine
        }
        Some(Stale::OtherClient) => live_session(store, "db-1"),
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

fn command(store: &mut Store, start: Start) -> [u8; 16] {
    // the other client exists, so its session can be live
    store
        .run_command(&run_request(&new_id(), "db-1", "true"), NOW)
        .unwrap();
    match start {
        Start::Running => running_command(store, CLIENT),
        Start::Queued | Start::Dispatched => {
            let id = new_id();
            store
                .run_command(&run_request(&id, CLIENT, "uptime"), NOW)
                .unwrap();
            if start == Start::Dispatched {
                store.mark_dispatched(&id, 1).unwrap();
            }
            id
        }
    }
}

fn incident(id: &[u8; 16]) -> NewIncident {
    NewIncident {
        kind: rvbox_proto::v1::IncidentKind::LateAfterExpiry,
        scope_kind: rvbox_proto::v1::ScopeKind::Command,
        scope_key: text(id),
        client_id: Some(CLIENT.into()),
        issue_uuid: Some(*id),
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
                incident: incident(&issue),
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
            let mut ev = output(&issue, 2, &chunk(2, 100));
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

fn state(store: &Store, id: &[u8; 16]) -> (Lifecycle, u64, u64, bool) {
    let v = store.command_view(id).unwrap();
    (v.lifecycle, v.revision, v.last_event_seq, v.expired_pending)
}

#[test]
fn every_connection_write_is_refused_once_its_session_is_not_live() {
    for (name, start, op) in writes() {
        for stale in STALE {
            let dir = tempfile::tempdir().unwrap();
            let mut store = open(dir.path());
            let id = command(&mut store, start);
            let fence = session(&mut store, Some(stale));
            let before = state(&store, &id);
            let fenced_before = store.metrics().writes_fenced.get();
            let mut exec = Executor::new(store);
            // alone, and as part of a batch (a write group or an append
            // group), where it must not take the others down with it
            let result = exec.perform(NOW, op(id, fence));
            assert_eq!(
                refusal(&result),
                Some(Code::StaleSession),
                "{name} with a {stale:?} session: {result:?}"
            );
            assert_eq!(
                state(exec.store(), &id),
                before,
                "{name} with a {stale:?} session changed the command"
            );
            assert_eq!(
                exec.store().metrics().writes_fenced.get(),
                fenced_before + 1,
                "{name}: the refusal is counted"
            );
        }
    }
}

#[test]
fn every_connection_write_commits_with_its_live_session() {
    for (name, start, op) in writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = open(dir.path());
        let id = command(&mut store, start);
        let fence = session(&mut store, None);
        let mut exec = Executor::new(store);
        let result = exec.perform(NOW, op(id, fence));
        assert_eq!(refusal(&result), None, "{name}: {result:?}");
        assert!(result.is_ok(), "{name}: {result:?}");
        assert_eq!(exec.store().metrics().writes_fenced.get(), 0);
    }
}

#[test]
fn a_fenced_write_in_a_group_leaves_the_others_of_the_group_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let queued = command(&mut store, Start::Queued);
    let other = command(&mut store, Start::Queued);
    let running = command(&mut store, Start::Running);
    let old = live_session(&mut store, CLIENT);
    let new = live_session(&mut store, CLIENT);
    let mut exec = Executor::new(store);
    let dispatch = |issue, session| StoreOp::Dispatch {
        issue,
        revision: 1,
        write: true,
        session,
    };
    let mut stale_event = output(&running, 2, &chunk(2, 100));
    stale_event.session = Some(old);
    let mut live_event = output(&running, 2, &chunk(2, 100));
    live_event.session = Some(new);
    let done = exec.perform_batch(vec![
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
    assert_eq!(refusal(&done[0].1), Some(Code::StaleSession));
    assert!(
        matches!(done[1].1, Ok(Completion::Spec(_))),
        "{:?}",
        done[1]
    );
    assert_eq!(refusal(&done[2].1), Some(Code::StaleSession));
    assert_eq!(refusal(&done[3].1), None, "{:?}", done[3]);
    let s = exec.store();
    assert_eq!(
        s.command_view(&queued).unwrap().lifecycle,
        Lifecycle::Queued
    );
    assert_eq!(
        s.command_view(&other).unwrap().lifecycle,
        Lifecycle::Dispatched
    );
    assert_eq!(s.command_view(&running).unwrap().last_event_seq, 2);
    assert_eq!(verify_output(s, &running), vec![2]);
}
