#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The executor on a real store: consecutive appends of many commands
//! (as many connections send them) become one durable group, each
//! operation keeps its own outcomes and acknowledgements, and any other
//! operation between them ends the group so the order of the batch holds.

#[path = "../../store/tests/support/mod.rs"]
mod support;

use rvbox_engine::Executor;
use rvbox_store::events::EventOutcome;
use rvbox_store_port::ops::{Completion, OpToken, StoreOp};
use support::*;

fn appended(r: &rvbox_store_port::ops::OpResult) -> &rvbox_store_port::events::AppendReport {
    match r {
        Ok(Completion::Appended(a)) => a,
        other => panic!("not an append: {other:?}"),
    }
}

#[test]
fn appends_of_many_commands_share_one_group_and_keep_their_own_acks() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let ids: Vec<[u8; 16]> = (0..8)
        .map(|n| running_command(&mut store, &format!("web-{n}")))
        .collect();
    let mut exec = Executor::new(store);
    let ops: Vec<(OpToken, i64, StoreOp)> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            (
                OpToken(n as u64 + 1),
                NOW,
                StoreOp::AppendEvents {
                    events: vec![
                        output(id, 2, &chunk(2, 1000)),
                        output(id, 3, &chunk(3, 1000)),
                    ],
                },
            )
        })
        .collect();
    let done = exec.perform_batch(ops);
    assert_eq!(
        exec.group_stats(),
        (1, 8),
        "eight operations, one durable group"
    );
    assert_eq!(done.len(), 8);
    for (n, (token, result)) in done.iter().enumerate() {
        assert_eq!(
            *token,
            OpToken(n as u64 + 1),
            "completions keep the batch order"
        );
        let a = appended(result);
        assert_eq!(
            a.outcomes,
            vec![EventOutcome::Appended, EventOutcome::Appended]
        );
        assert_eq!(a.acked.len(), 1, "only its own command's acknowledgement");
        assert_eq!(a.acked.get(&ids[n]), Some(&3));
    }
    for id in &ids {
        assert_eq!(verify_output(exec.store(), id), vec![2, 3]);
    }
    assert_counters(exec.store());
}

#[test]
fn another_operation_ends_the_group_so_order_holds() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let a = running_command(&mut store, "web-1");
    let b = running_command(&mut store, "web-2");
    let mut exec = Executor::new(store);
    let done = exec.perform_batch(vec![
        (
            OpToken(1),
            NOW,
            StoreOp::AppendEvents {
                events: vec![output(&a, 2, &chunk(2, 100))],
            },
        ),
        (OpToken(2), NOW, StoreOp::CommandView { issue: a }),
        (
            OpToken(3),
            NOW,
            StoreOp::AppendEvents {
                events: vec![output(&b, 2, &chunk(2, 100))],
            },
        ),
    ]);
    assert_eq!(exec.group_stats(), (2, 2));
    match &done[1].1 {
        Ok(Completion::View(v)) => {
            assert_eq!(v.last_event_seq, 2, "the view reads the append before it")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(appended(&done[2].1).acked.get(&b), Some(&2));
}

#[test]
fn a_refused_event_in_a_group_refuses_only_its_own_operation() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let a = running_command(&mut store, "web-1");
    let b = running_command(&mut store, "web-2");
    let mut exec = Executor::new(store);
    let done = exec.perform_batch(vec![
        (
            OpToken(1),
            NOW,
            StoreOp::AppendEvents {
                // a gap: sequence 5 after 1
                events: vec![output(&a, 5, &chunk(5, 100))],
            },
        ),
        (
            OpToken(2),
            NOW,
            StoreOp::AppendEvents {
                events: vec![output(&b, 2, &chunk(2, 100))],
            },
        ),
    ]);
    assert!(matches!(
        appended(&done[0].1).outcomes[0],
        EventOutcome::Refused(_)
    ));
    assert_eq!(appended(&done[1].1).outcomes, vec![EventOutcome::Appended]);
    assert_eq!(appended(&done[1].1).acked.get(&b), Some(&2));
    assert_eq!(verify_output(exec.store(), &b), vec![2]);
}

#[test]
fn a_dispatch_sent_again_is_refused_once_the_command_changed() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let id = new_id();
    store
        .run_command(&run_request(&id, "web-1", "make test"), NOW)
        .unwrap();
    store
        .record_transition(&id, rvbox_domain::lifecycle::Lifecycle::Dispatched)
        .unwrap();
    let revision = store.command_view(&id).unwrap().revision;
    let session = live_session(&mut store, "web-1");
    let mut exec = Executor::new(store);
    let again = |revision| StoreOp::Dispatch {
        issue: id,
        revision,
        write: false,
        session,
    };
    match exec.perform(NOW, again(revision)) {
        Ok(Completion::Spec(spec)) => assert!(spec.source.is_some()),
        other => panic!("{other:?}"),
    }
    // a signal decided since the dispatch decision raised the revision
    exec.store_mut().bump_revision(&id, revision).unwrap();
    match exec.perform(NOW, again(revision)) {
        Err(rvbox_store_port::ops::PortError::Refused(e)) => {
            assert_eq!(e.code(), rvbox_domain::error::Code::Conflict);
        }
        other => panic!("a stale resend must be refused: {other:?}"),
    }
}

#[test]
fn control_reads_are_served_beside_the_executor_thread_not_behind_it() {
    use rvbox_engine::ExecutorThread;
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let id = running_command(&mut store, "web-1");
    let (park, reached, release) = Park::at(rvbox_store::crash::points::EVENT_AFTER_FSYNC);
    store.set_crash_hook(park);
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel(16);
    let reads = store.read_handle();
    let exec = ExecutorThread::spawn(store, done_tx).unwrap();
    let reader = reads.open().unwrap();
    exec.submit(vec![(
        OpToken(1),
        NOW,
        StoreOp::AppendEvents {
            events: vec![output(&id, 2, &chunk(2, 1000))],
        },
    )])
    .unwrap();
    reached.recv().unwrap();
    // the writer is parked inside its group: the read answers at once,
    // from the last committed state
    let view = reader.command_view(&id).unwrap();
    assert_eq!(view.last_event_seq, 1);
    assert!(
        done_rx.try_recv().is_err(),
        "no completion before the commit"
    );
    release.send(()).unwrap();
    let done = done_rx.recv().unwrap();
    assert_eq!(appended(&done[0].1).outcomes, vec![EventOutcome::Appended]);
    assert_eq!(reader.command_view(&id).unwrap().last_event_seq, 2);
    exec.stop().unwrap();
}

/// A queued command (`RunCommand` only).
fn queued_command(store: &mut rvbox_store::Store, client: &str) -> [u8; 16] {
    let id = new_id();
    store
        .run_command(&run_request(&id, client, "uptime"), NOW)
        .unwrap();
    id
}

fn lifecycle_of(store: &rvbox_store::Store, id: &[u8; 16]) -> rvbox_domain::lifecycle::Lifecycle {
    store.command_view(id).unwrap().lifecycle
}

/// Records the crash points passed, and how many writes were durable at
/// each (read through a second connection, so an uncommitted write does
/// not count).
#[derive(Debug, Default)]
struct Points(std::sync::Mutex<Vec<&'static str>>);

impl rvbox_store::crash::CrashHook for Points {
    fn at(&self, point: &'static str) {
        self.0.lock().unwrap().push(point);
    }
}

#[test]
fn single_command_writes_share_one_commit_and_a_refusal_stays_its_own() {
    use rvbox_domain::lifecycle::Lifecycle;
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let a = queued_command(&mut store, "web-1");
    let b = queued_command(&mut store, "web-2");
    let c = queued_command(&mut store, "web-3");
    let web = [1, 2, 3].map(|n| live_session(&mut store, &format!("web-{n}")));
    let points = std::sync::Arc::new(Points::default());
    store.set_crash_hook(points.clone());
    let mut exec = Executor::new(store);
    let done = exec.perform_batch(vec![
        (
            OpToken(1),
            NOW,
            StoreOp::Dispatch {
                issue: a,
                revision: 1,
                write: true,
                session: web[0],
            },
        ),
        // a stale decision: refused, and nothing else of the group undone
        (
            OpToken(2),
            NOW,
            StoreOp::RecordAccepted {
                issue: b,
                revision: 1,
                resolved_shell: 0,
                session: web[1],
            },
        ),
        (OpToken(3), NOW, StoreOp::CommandView { issue: a }),
        (
            OpToken(4),
            NOW,
            StoreOp::Dispatch {
                issue: c,
                revision: 1,
                write: true,
                session: web[2],
            },
        ),
        (
            OpToken(5),
            NOW,
            StoreOp::RecordAccepted {
                issue: a,
                revision: 1,
                resolved_shell: 0,
                session: web[0],
            },
        ),
    ]);
    assert_eq!(
        exec.write_group_stats(),
        (1, 5),
        "one transaction for the run"
    );
    let tokens: Vec<u64> = done.iter().map(|(t, _)| t.0).collect();
    assert_eq!(
        tokens,
        vec![1, 2, 3, 4, 5],
        "completions keep the batch order"
    );
    assert!(
        matches!(done[0].1, Ok(Completion::Spec(_))),
        "{:?}",
        done[0].1
    );
    match &done[1].1 {
        Err(rvbox_store_port::ops::PortError::Refused(e)) => {
            assert_eq!(e.code(), rvbox_domain::error::Code::Conflict);
        }
        other => panic!("a stale acceptance is refused: {other:?}"),
    }
    match &done[2].1 {
        Ok(Completion::View(v)) => assert_eq!(
            v.lifecycle,
            Lifecycle::Dispatched,
            "a read in the group sees the group's earlier write"
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(done[3].1, Ok(Completion::Spec(_))));
    assert!(matches!(done[4].1, Ok(Completion::Done)), "{:?}", done[4].1);
    assert_eq!(lifecycle_of(exec.store(), &a), Lifecycle::Accepted);
    assert_eq!(lifecycle_of(exec.store(), &b), Lifecycle::Queued);
    assert_eq!(lifecycle_of(exec.store(), &c), Lifecycle::Dispatched);
    // the crash points of the three writes, each after the one commit
    assert_eq!(
        *points.0.lock().unwrap(),
        vec![
            rvbox_store::crash::points::DISPATCH_AFTER_COMMIT,
            rvbox_store::crash::points::DISPATCH_AFTER_COMMIT,
            rvbox_store::crash::points::ACCEPT_AFTER_COMMIT,
        ]
    );
    // durable: a fresh process sees every write of the group
    drop(exec);
    let store = open(dir.path());
    assert_eq!(lifecycle_of(&store, &a), Lifecycle::Accepted);
    assert_eq!(lifecycle_of(&store, &c), Lifecycle::Dispatched);
    assert_counters(&store);
}

#[test]
fn a_write_group_never_committed_keeps_nothing_and_announces_nothing() {
    use rvbox_domain::lifecycle::Lifecycle;
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let a = queued_command(&mut store, "web-1");
    let b = queued_command(&mut store, "web-2");
    let points = std::sync::Arc::new(Points::default());
    store.set_crash_hook(points.clone());
    {
        let mut group = store.write_group().unwrap();
        group.mark_dispatched(None, &a, 1).unwrap();
        group.mark_dispatched(None, &b, 1).unwrap();
        assert_eq!(group.writes(), 2);
        assert_eq!(
            group.store().command_view(&a).unwrap().lifecycle,
            Lifecycle::Dispatched,
            "visible inside the group"
        );
        // dropped: the process died before the commit
    }
    assert!(
        points.0.lock().unwrap().is_empty(),
        "no after-commit point without a commit"
    );
    assert_eq!(lifecycle_of(&store, &a), Lifecycle::Queued);
    assert_eq!(lifecycle_of(&store, &b), Lifecycle::Queued);
    // and the store takes the next write as usual
    store.mark_dispatched(&a, 1).unwrap();
    assert_eq!(lifecycle_of(&store, &a), Lifecycle::Dispatched);
    assert_eq!(
        *points.0.lock().unwrap(),
        vec![rvbox_store::crash::points::DISPATCH_AFTER_COMMIT]
    );
    assert_counters(&store);
}
