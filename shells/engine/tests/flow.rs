#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! One client through the whole engine on a real store: hello, welcome,
//! reconciliation, capacity, dispatch, acceptance, events and acks; then a
//! same-instance replacement that fences the first connection, and a
//! different instance rejected as a live conflict.

use prost::Message as _;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_engine::{Engine, Output};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_store::entropy::OsEntropy;

mod support;
use support::{WALL, engine, hello};

const INSTANCE_A: &str = "6f1c2a4e-8b3d-4c5e-9f70-1a2b3c4d5e6f";
const INSTANCE_B: &str = "7f1c2a4e-8b3d-4c5e-9f70-1a2b3c4d5e6f";

/// Drains the engine; returns decoded frames per connection and closes.
type Drained = (Vec<(u64, wire::Envelope)>, Vec<(u64, wire::CloseReason)>);

fn drain(e: &mut Engine) -> Drained {
    let mut frames = Vec::new();
    let mut closes = Vec::new();
    while let Some(o) = e.poll_output() {
        match o {
            Output::Frame { conn, bytes, .. } => {
                frames.push((conn, wire::Envelope::decode(bytes.as_slice()).unwrap()));
            }
            Output::Close { conn, reason } => closes.push((conn, reason)),
            _ => {}
        }
    }
    (frames, closes)
}

fn env(session: &str, generation: u64, p: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: session.into(),
        generation,
        payload: Some(p),
    }
    .encode_to_vec()
}

/// `make` for `web-1`, with a queue TTL when given.
fn run_request(id: &[u8; 16], queue_ttl: Option<prost_types::Duration>) -> wire::RunCommandRequest {
    wire::RunCommandRequest {
        request_id: Engine::uuid_text(id),
        client_id: "web-1".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("make".into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl,
    }
}

fn run(e: &mut Engine, id: &[u8; 16]) {
    e.run_command(&run_request(id, None), WALL).unwrap();
}

fn new_id() -> [u8; 16] {
    rvbox_store::entropy::uuid_v7(&OsEntropy, WALL).unwrap()
}

/// Registers `web-1` on connection 1, reconciles, reports capacity, and
/// accepts one queued command `cmd` at times 0..=5. Returns the session id
/// and the dispatch.
fn accepted_command(e: &mut Engine, cmd: &[u8; 16]) -> (String, wire::Dispatch) {
    let (sid, d) = dispatched_command(e, cmd);
    e.frame(
        5,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::CommandAccepted(wire::CommandAccepted {
                issue_uuid: d.issue_uuid.clone(),
                revision: d.revision,
                outcome: wire::AcceptOutcome::Positive as i32,
                error: None,
                resolved_shell: wire::ShellType::Sh as i32,
            }),
        ),
    );
    assert_eq!(e.command(cmd).unwrap().lifecycle, Lifecycle::Accepted);
    (sid, d)
}

/// As [`accepted_command`], up to the dispatch (times 0..=4).
fn dispatched_command(e: &mut Engine, cmd: &[u8; 16]) -> (String, wire::Dispatch) {
    run(e, cmd);

    e.connect(0, 1);
    e.frame(1, WALL, 1, hello(INSTANCE_A));
    let (frames, closes) = drain(e);
    assert!(closes.is_empty(), "{closes:?}");
    let Some(Payload::ServerWelcome(w)) = &frames[0].1.payload else {
        panic!("{frames:?}")
    };
    assert_eq!(w.generation, 1);
    let sid = w.session_id.clone();
    let Some(Payload::ReconcileRequest(r)) = &frames[1].1.payload else {
        panic!("{frames:?}")
    };
    assert_eq!(r.rows.len(), 1, "the queued command is listed");

    // an empty, healthy snapshot: the queued command stays queued
    e.frame(
        2,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::ClientSnapshot(wire::ClientSnapshot {
                round: r.round,
                chunk_index: 0,
                final_chunk: true,
                store_health: wire::ScopeState::Ready as i32,
                records: vec![],
                tombstones: vec![],
            }),
        ),
    );
    let (frames, _) = drain(e);
    assert!(matches!(
        frames[0].1.payload,
        Some(Payload::ReconcileResult(_))
    ));
    // nothing is dispatched before capacity is known
    assert_eq!(e.stats().dispatched, 0);
    e.frame(
        3,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::ClientCapacity(wire::ClientCapacity {
                running: 0,
                queued: 0,
                max_running: 2,
                max_queued: 0,
            }),
        ),
    );
    e.tick(4, WALL);
    let (frames, _) = drain(e);
    let d = frames
        .iter()
        .find_map(|(_, f)| match &f.payload {
            Some(Payload::Dispatch(d)) => Some(d.clone()),
            _ => None,
        })
        .expect("dispatched");
    assert_eq!(d.generation, 1);
    assert_eq!(e.command(cmd).unwrap().lifecycle, Lifecycle::Dispatched);
    (sid, d)
}

/// A client whose tombstone ledger holds the command (it ran there; this
/// store is older, as after a restore from backup) answers
/// `ALREADY_EXECUTED`: the command ends interrupted, never rejected, its
/// record saying why, and it is never dispatched again; any other
/// permanent answer still rejects.
#[test]
fn a_command_its_client_already_executed_ends_interrupted_never_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let cmd = new_id();
    let (sid, d) = dispatched_command(&mut e, &cmd);
    let negative = |code: rvbox_domain::error::Code, reason: &str| {
        Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: d.issue_uuid.clone(),
            revision: d.revision,
            outcome: wire::AcceptOutcome::Permanent as i32,
            error: Some(wire::ErrorDetail {
                code: code.to_wire() as i32,
                retry_class: wire::RetryClass::Permanent as i32,
                reason: reason.into(),
                field: "dispatch.issue_uuid".into(),
                ..Default::default()
            }),
            resolved_shell: 0,
        })
    };
    let ran = negative(
        rvbox_domain::error::Code::AlreadyExecuted,
        "the command already ran here",
    );
    e.frame(5, WALL, 1, env(&sid, 1, ran.clone()));
    let (_, closes) = drain(&mut e);
    assert!(closes.is_empty(), "{closes:?}");
    assert_eq!(e.command(&cmd).unwrap().lifecycle, Lifecycle::Interrupted);
    let health = e.store().health();
    let record = rvbox_store::records::command_record(e.store().db(), &health, &cmd).unwrap();
    let why = record.rejection.as_ref().expect("the detail is kept");
    assert!(
        why.reason.contains("already executed") && why.reason.contains("already ran here"),
        "{why:?}"
    );
    assert_eq!(e.stats().already_executed, 1);
    // the same answer again (a retransmission) changes nothing
    e.frame(6, WALL, 1, env(&sid, 1, ran));
    let (frames, closes) = drain(&mut e);
    assert!(closes.is_empty(), "{closes:?}");
    assert!(
        !frames
            .iter()
            .any(|(_, f)| matches!(f.payload, Some(Payload::Dispatch(_)))),
        "never dispatched again"
    );
    assert_eq!(e.command(&cmd).unwrap().lifecycle, Lifecycle::Interrupted);

    // another permanent answer is a rejection
    let other = new_id();
    run(&mut e, &other);
    e.tick(7, WALL);
    let (frames, _) = drain(&mut e);
    let d2 = frames
        .iter()
        .find_map(|(_, f)| match &f.payload {
            Some(Payload::Dispatch(d)) => Some(d.clone()),
            _ => None,
        })
        .expect("dispatched");
    e.frame(
        8,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::CommandAccepted(wire::CommandAccepted {
                issue_uuid: d2.issue_uuid.clone(),
                revision: d2.revision,
                outcome: wire::AcceptOutcome::Permanent as i32,
                error: Some(wire::ErrorDetail {
                    code: rvbox_domain::error::Code::Unsupported.to_wire() as i32,
                    retry_class: wire::RetryClass::Permanent as i32,
                    reason: "no such profile".into(),
                    field: "spec.profile_flags".into(),
                    ..Default::default()
                }),
                resolved_shell: 0,
            }),
        ),
    );
    assert_eq!(e.command(&other).unwrap().lifecycle, Lifecycle::Rejected);
}

#[test]
fn a_client_registers_reconciles_receives_work_and_gets_acks_only_when_durable() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let cmd = new_id();
    let (sid, d) = accepted_command(&mut e, &cmd);
    let event = |seq: u64, body: wire::command_event::Body| wire::CommandEvent {
        issue_uuid: d.issue_uuid.clone(),
        event_seq: seq,
        observed_time: None,
        body: Some(body),
    };
    e.frame(
        6,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::CommandEvent(event(
                1,
                wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                    lifecycle: wire::Lifecycle::Running as i32,
                    revision: 1,
                    exit_result: None,
                    reason: String::new(),
                }),
            )),
        ),
    );
    let raw = b"hello\n".to_vec();
    e.frame(
        7,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::CommandEvent(event(
                2,
                wire::command_event::Body::Output(wire::OutputChunk {
                    stream: wire::OutputStream::Stdout as i32,
                    payload: zstd::bulk::compress(&raw, 1).unwrap(),
                    raw_length: 6,
                    stored_length: u32::try_from(zstd::bulk::compress(&raw, 1).unwrap().len())
                        .unwrap(),
                }),
            )),
        ),
    );
    let (frames, closes) = drain(&mut e);
    assert!(closes.is_empty(), "{closes:?}");
    let acks: Vec<u64> = frames
        .iter()
        .filter_map(|(_, f)| match &f.payload {
            Some(Payload::EventAck(a)) => Some(a.durable_event_seq),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![1, 2]);
    assert_eq!(e.command(&cmd).unwrap().lifecycle, Lifecycle::Running);
    assert_eq!(e.command(&cmd).unwrap().last_event_seq, 2);

    // the same instance reconnects: the first connection is fenced
    e.connect(10, 2);
    e.frame(11, WALL + 10, 2, hello(INSTANCE_A));
    let (frames, closes) = drain(&mut e);
    assert!(
        closes.contains(&(1, wire::CloseReason::SessionFenced)),
        "{closes:?}"
    );
    let w2 = frames
        .iter()
        .find_map(|(c, f)| match &f.payload {
            Some(Payload::ServerWelcome(w)) if *c == 2 => Some(w.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(w2.generation, 2);

    // a different instance while 2 is live: rejected, claim recorded
    e.connect(20, 3);
    e.frame(21, WALL + 20, 3, hello(INSTANCE_B));
    let (_, closes) = drain(&mut e);
    assert!(
        closes.contains(&(3, wire::CloseReason::HelloRejected)),
        "{closes:?}"
    );
    let rec = e.store().client_record("web-1").unwrap().unwrap();
    assert!(rec.pending_claim.is_some());
    assert_eq!(rec.generation, 2);
    let c = e.store().check_counters().unwrap();
    assert!(c.consistent());
}

#[test]
fn the_session_audit_trail_commits_with_its_effects_and_floods_are_rate_limited() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    e.set_caller(rvbox_engine::Caller {
        transport: "grpc-unix".into(),
        principal: "uid:1000".into(),
    });
    run(&mut e, &new_id());

    // a hello that fails validation changes nothing durable: its own record
    e.connect(0, 9);
    e.frame(1, WALL, 9, hello("not-a-uuid"));
    // a registered session closed for traffic of another session: the
    // close row names why, in the same transaction
    e.connect(2, 1);
    e.frame(3, WALL, 1, hello(INSTANCE_A));
    let (frames, _) = drain(&mut e);
    assert!(
        frames
            .iter()
            .any(|(c, f)| *c == 1 && matches!(f.payload, Some(Payload::ServerWelcome(_))))
    );
    e.frame(
        4,
        WALL,
        1,
        env(
            "00000000-0000-7000-8000-000000000000",
            1,
            Payload::ClientCapacity(wire::ClientCapacity::default()),
        ),
    );
    let (_, closes) = drain(&mut e);
    assert_eq!(closes.len(), 1, "{closes:?}");
    e.run_until_idle(5, WALL);

    let trail: Vec<(String, String, String)> = e
        .store()
        .read_audit(0, 100)
        .unwrap()
        .into_iter()
        .map(|(_, r)| (r.transport, r.action, r.detail))
        .collect();
    let actions: Vec<&str> = trail.iter().map(|t| t.1.as_str()).collect();
    assert_eq!(
        actions,
        vec![
            "RunCommand",
            "HelloRejected",
            "SessionRegistered",
            "SessionClosed"
        ],
        "{trail:?}"
    );
    assert_eq!(trail[0].0, "grpc-unix");
    assert!(trail[1..].iter().all(|t| t.0 == "agent-wss"));
    assert!(trail[3].2.contains("StaleSession"), "{trail:?}");

    // a flood of bad hellos is cut to the bucket; the rest is counted
    for n in 0..500u64 {
        e.connect(10, 100 + n);
        e.frame(10, WALL, 100 + n, hello("not-a-uuid"));
        let _ = drain(&mut e);
    }
    e.run_until_idle(10, WALL);
    let stats = e.stats().clone();
    assert_eq!(
        stats.audits_written + stats.audits_suppressed,
        501,
        "{stats:?}"
    );
    assert!(stats.audits_written <= u64::from(rvbox_engine::AUDIT_BURST));
    let records = e.store().read_audit(0, 10_000).unwrap().len() as u64;
    assert_eq!(records, 3 + stats.audits_written);
}

#[test]
fn appends_go_at_once_to_an_idle_store_gather_behind_a_group_and_a_full_group_goes_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let cmd = new_id();
    let (sid, d) = accepted_command(&mut e, &cmd);
    e.set_group_policy(rvbox_engine::GroupPolicy {
        max_delay_ms: 10,
        max_events: 4,
    });
    let output = |seq: u64| {
        let raw = vec![b'x'; 100];
        let stored = zstd::bulk::compress(&raw, 1).unwrap();
        env(
            &sid,
            1,
            Payload::CommandEvent(wire::CommandEvent {
                issue_uuid: d.issue_uuid.clone(),
                event_seq: seq,
                observed_time: None,
                body: Some(if seq == 1 {
                    wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                        lifecycle: wire::Lifecycle::Running as i32,
                        revision: 1,
                        exit_result: None,
                        reason: String::new(),
                    })
                } else {
                    wire::command_event::Body::Output(wire::OutputChunk {
                        stream: wire::OutputStream::Stdout as i32,
                        raw_length: 100,
                        stored_length: u32::try_from(stored.len()).unwrap(),
                        payload: stored,
                    })
                }),
            }),
        )
    };
    let acks = |frames: &[(u64, wire::Envelope)]| {
        frames
            .iter()
            .filter(|(_, f)| matches!(f.payload, Some(Payload::EventAck(_))))
            .count()
    };
    // the store's answers wait for `deliver`, so a group stays in flight
    e.set_deferred(true);
    let groups_before = e.group_stats().0;
    let groups = |e: &mut Engine| {
        e.perform(usize::MAX);
        e.group_stats().0 - groups_before
    };
    // an idle store: a lone event goes at once
    e.frame(100, WALL, 1, output(1));
    assert_eq!(groups(&mut e), 1, "the first event does not wait");
    // two more arrive while that group is being written: they wait for
    // the delay (or for it to complete)
    for seq in 2..=3 {
        e.frame(100, WALL, 1, output(seq));
    }
    assert_eq!(groups(&mut e), 1, "events behind a group gather");
    assert_eq!(
        e.next_deadline(),
        Some(110),
        "the timer is the group's delay"
    );
    e.tick(109, WALL);
    assert_eq!(groups(&mut e), 1);
    e.tick(110, WALL);
    assert_eq!(groups(&mut e), 2, "one group for both, at the delay");
    let (frames, _) = drain(&mut e);
    assert_eq!(acks(&frames), 0, "nothing is acknowledged before its group");
    e.run_until_idle(111, WALL);
    let (frames, _) = drain(&mut e);
    assert!(acks(&frames) >= 1, "{frames:?}");
    assert_eq!(e.command(&cmd).unwrap().last_event_seq, 3);
    // with a group in flight, four more fill a group: it goes at once,
    // without the delay
    e.frame(200, WALL, 1, output(4));
    assert_eq!(groups(&mut e), 3);
    for seq in 5..=8 {
        e.frame(200, WALL, 1, output(seq));
    }
    assert_eq!(groups(&mut e), 4, "a full group does not wait");
    e.run_until_idle(201, WALL);
    drain(&mut e);
    assert_eq!(e.command(&cmd).unwrap().last_event_seq, 8);
}

/// Another server replica registered a newer session of the client behind
/// this engine's back (docs/scaleout.md): the store's session row moved
/// on, this engine still holds the old connection. Its next write for that
/// connection is refused `STALE_SESSION`, nothing of it is stored, and the
/// connection closes fenced.
#[test]
fn a_write_for_a_session_another_replica_replaced_is_refused_and_closes_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let cmd = new_id();
    let (sid, d) = accepted_command(&mut e, &cmd);
    let rec = e.store().client_record("web-1").unwrap().unwrap();
    let live = rec.live.unwrap();
    e.store_mut()
        .register_session(
            &rvbox_store::sessions::Registration {
                client_id: "web-1".into(),
                instance_id: live.instance_id,
                expected_generation: rec.generation,
                session_id: new_id(),
                fence: Some(live.session_id),
                consume_grant: None,
                capabilities: wire::Capabilities::default(),
                cwd_policy: None,
                labels: String::new(),
            },
            WALL + 1,
        )
        .unwrap();
    e.frame(
        6,
        WALL,
        1,
        env(
            &sid,
            1,
            Payload::CommandEvent(wire::CommandEvent {
                issue_uuid: d.issue_uuid.clone(),
                event_seq: 1,
                observed_time: None,
                body: Some(wire::command_event::Body::Lifecycle(
                    wire::LifecycleChange {
                        lifecycle: wire::Lifecycle::Running as i32,
                        revision: 1,
                        exit_result: None,
                        reason: String::new(),
                    },
                )),
            }),
        ),
    );
    let (frames, closes) = drain(&mut e);
    assert_eq!(closes, vec![(1, wire::CloseReason::SessionFenced)]);
    assert!(
        !frames
            .iter()
            .any(|(_, f)| matches!(f.payload, Some(Payload::EventAck(_)))),
        "nothing acknowledged: {frames:?}"
    );
    assert_eq!(e.stats().writes_fenced, 1);
    let v = e.command(&cmd).unwrap();
    assert_eq!(v.lifecycle, Lifecycle::Accepted);
    assert_eq!(v.last_event_seq, 0);
    assert_eq!(e.store().metrics().writes_fenced.get(), 1);
    // the newer session is untouched: this engine never closed it
    let after = e.store().client_record("web-1").unwrap().unwrap();
    assert_eq!(after.generation, rec.generation + 1);
    assert!(after.live.is_some());
}

/// A duty this server does not hold (on several replicas, another one
/// holds it) never runs here: a command past its queue TTL stays queued
/// until the duty comes back.
#[test]
fn a_duty_not_held_never_runs_and_runs_again_once_held() {
    use rvbox_store_port::replica::Duty;
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let id = new_id();
    let req = run_request(
        &id,
        Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        }),
    );
    e.run_command(&req, WALL).unwrap();
    let held: Vec<Duty> = Duty::ALL
        .into_iter()
        .filter(|d| *d != Duty::Expiry)
        .collect();
    e.set_duties(&held);
    for t in 1..10u64 {
        e.tick(t * 10_000, WALL + i64::try_from(t * 10_000).unwrap());
        drain(&mut e);
    }
    assert_eq!(e.command(&id).unwrap().lifecycle, Lifecycle::Queued);
    e.set_duties(&Duty::ALL);
    e.tick(100_000, WALL + 100_000);
    drain(&mut e);
    assert_eq!(e.command(&id).unwrap().lifecycle, Lifecycle::Expired);
}

/// A replica that lost its lease closes every connection and takes no new
/// one until it serves again; its session rows end.
#[test]
fn a_replica_that_lost_its_lease_closes_its_connections_and_takes_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let cmd = new_id();
    accepted_command(&mut e, &cmd);
    e.set_serving(false);
    let (_, closes) = drain(&mut e);
    assert_eq!(closes, vec![(1, wire::CloseReason::ServiceRestart)]);
    assert_eq!(e.connections(), 0);
    assert_eq!(
        e.store().client_record("web-1").unwrap().unwrap().live,
        None,
        "the session row ended"
    );
    e.connect(10, 2);
    let (_, closes) = drain(&mut e);
    assert_eq!(closes, vec![(2, wire::CloseReason::ServiceRestart)]);
    e.set_serving(true);
    e.connect(20, 3);
    e.frame(21, WALL, 3, hello(INSTANCE_A));
    let (frames, closes) = drain(&mut e);
    assert!(closes.is_empty(), "{closes:?}");
    assert!(
        frames
            .iter()
            .any(|(c, f)| *c == 3 && matches!(f.payload, Some(Payload::ServerWelcome(_)))),
        "{frames:?}"
    );
}

/// A command another replica stored for a client connected here (written
/// straight into the store, behind this engine's back) is dispatched when
/// the wake-up arrives, and not before: the engine never polls the store
/// on its own.
#[test]
fn work_another_replica_stored_is_dispatched_on_its_wake_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let first = new_id();
    let (_, _) = accepted_command(&mut e, &first);
    let other = new_id();
    e.store_mut()
        .run_command(&run_request(&other, None), WALL)
        .unwrap();
    for t in 6..10u64 {
        e.tick(t, WALL);
        let (frames, _) = drain(&mut e);
        assert!(
            !frames
                .iter()
                .any(|(_, f)| matches!(f.payload, Some(Payload::Dispatch(_)))),
            "nothing dispatched without a wake-up: {frames:?}"
        );
    }
    assert_eq!(e.command(&other).unwrap().lifecycle, Lifecycle::Queued);
    e.wake("web-1", None);
    let (frames, _) = drain(&mut e);
    assert!(
        frames
            .iter()
            .any(|(_, f)| matches!(&f.payload, Some(Payload::Dispatch(d)) if d.issue_uuid == Engine::uuid_text(&other))),
        "dispatched on the wake-up: {frames:?}"
    );
    assert_eq!(e.stats().wakeups, 1);
    // a wake-up for a client not connected here does nothing
    e.wake("web-2", None);
    assert_eq!(e.stats().wakeups, 1);
}

/// A fleet run another replica created is released by the replica holding
/// the pump duty at once on its wake-up, though its last pass had found no
/// live run; without the wake-up, no pass goes.
#[test]
fn a_fleet_run_another_replica_created_is_pumped_on_its_wake_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let first = new_id();
    let (_, _) = accepted_command(&mut e, &first);
    // the first pass finds no live run: the pump stops
    for t in 6..10u64 {
        e.tick(t * 1_000, WALL);
        drain(&mut e);
    }
    let passes = e.stats().fleet_passes;
    assert!(passes >= 1);
    // a paused run with one pending target, written behind the engine's back
    let run = new_id();
    let req = wire::RunFleetRequest {
        request_id: Engine::uuid_text(&run),
        selection: Some(wire::FleetSelection {
            client_ids: vec!["web-1".into()],
            ..Default::default()
        }),
        spec: run_request(&run, None).spec,
        max_parallel: Some(wire::FleetLimit {
            limit: Some(wire::fleet_limit::Limit::Count(1)),
        }),
        ..Default::default()
    };
    let caller = rvbox_store::operator::Caller::local();
    e.store_mut().run_fleet_as(&req, &caller, WALL).unwrap();
    for t in 10..20u64 {
        e.tick(t * 1_000, WALL);
        drain(&mut e);
    }
    assert_eq!(e.stats().fleet_passes, passes, "no pass without a wake-up");
    e.fleet_wake();
    e.tick(21_000, WALL);
    drain(&mut e);
    assert_eq!(e.stats().fleet_passes, passes + 1, "a pass on the wake-up");
}
