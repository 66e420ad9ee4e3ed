//! The simulated client against a scripted server: valid frames, the
//! reconnect order, windows, idempotent acceptance across crashes,
//! signals, adversarial modes and determinism.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeMap;

use common::{Harness, Seen, accepted, events, lifecycle_of, snapshots};
use prost::Message as _;
use rvbox_domain::ids::{ClientId, InstanceId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_sim::client::{Adversary, ClientConfig, LinkPhase, SimClient};
use rvbox_sim::invariants::content_digest;
use rvbox_sim::rng::Seeds;

fn config() -> ClientConfig {
    let mut c = ClientConfig::new("web-01");
    c.max_output_chunks = 3;
    c.max_chunk_raw_bytes = 2_000;
    c.max_step_ms = 200;
    c
}

/// The session core's `validate_hello` rules, checked by hand
/// (rvbox-session is not a dependency of this crate).
fn check_hello(h: &wire::ClientHello) {
    assert_eq!(h.protocol_major, 1);
    assert!((1..=16).contains(&h.supported_minors.len()));
    assert!(h.supported_minors.windows(2).all(|w| w[0] < w[1]));
    assert!(h.supported_minors.contains(&0));
    ClientId::parse("client_id", &h.client_id).unwrap();
    InstanceId::parse("client_instance_id", &h.client_instance_id).unwrap();
    let c = h.capabilities.as_ref().unwrap();
    let p = c.platform.as_ref().unwrap();
    assert!(!p.os.is_empty() && p.os.len() <= 32);
    assert!(!p.arch.is_empty() && p.arch.len() <= 32);
    assert!(p.os_release.len() <= 128);
    assert!(c.software_version.len() <= 64);
    assert!((1..=4).contains(&c.shells.len()));
    let mut kinds: Vec<i32> = c.shells.iter().map(|s| s.shell_type).collect();
    assert!(kinds.iter().all(|k| matches!(
        wire::ShellType::try_from(*k),
        Ok(t) if t != wire::ShellType::Unspecified
    )));
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(kinds.len(), c.shells.len());
    assert_eq!(c.shells.iter().filter(|s| s.platform_default).count(), 1);
    assert!(c.profiles.len() <= 10);
    assert!(c.profiles.windows(2).all(|w| w[0] < w[1]));
    assert!(c.profiles.iter().all(|p| matches!(
        wire::ProfileFlag::try_from(*p),
        Ok(f) if f != wire::ProfileFlag::Unspecified
    )));
    assert!((1..=1024).contains(&c.max_running));
    assert!(c.max_queued <= 10_000);
    assert!(matches!(
        wire::SupervisionMode::try_from(c.supervision_mode),
        Ok(m) if m != wire::SupervisionMode::Unspecified
    ));
    let cwd = h.cwd_policy.as_ref().unwrap();
    assert!(cwd.default_cwd.starts_with('/'));
    assert!(cwd.allowed_roots.len() <= 64);
    assert!(cwd.allowed_roots.iter().all(|r| r.starts_with('/')));
}

/// Checks one command's events: contiguous from 1, RUNNING first, one
/// terminal last with an exit result, valid output chunks, digests.
fn check_command_events(evs: &[wire::CommandEvent]) {
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e.event_seq, u64::try_from(i).unwrap() + 1, "{evs:?}");
        assert!(e.observed_time.is_some());
        content_digest(e).unwrap();
        if let Some(Body::Output(o)) = &e.body {
            assert!((1..=65_536).contains(&o.raw_length));
            assert_eq!(o.stored_length as usize, o.payload.len());
            // zstd frame header: magic, then a descriptor with the
            // checksum flag (bit 2) and a content size
            assert_eq!(&o.payload[..4], &[0x28, 0xb5, 0x2f, 0xfd]);
            assert_ne!(o.payload[4] & 0x04, 0, "no content checksum");
            let raw = zstd::bulk::decompress(&o.payload, o.raw_length as usize).unwrap();
            assert_eq!(raw.len(), o.raw_length as usize);
        }
    }
    assert_eq!(lifecycle_of(&evs[0]), Some(Lifecycle::Running));
    let last = evs.last().unwrap();
    let Some(Body::Lifecycle(l)) = &last.body else {
        panic!("last event is not a lifecycle: {last:?}");
    };
    assert!(Lifecycle::from_wire(l.lifecycle).unwrap().is_terminal());
    assert_eq!(
        l.exit_result.as_ref().unwrap().lifecycle,
        l.lifecycle,
        "exit_result carries the terminal lifecycle"
    );
    assert!(
        evs[..evs.len() - 1]
            .iter()
            .all(|e| !lifecycle_of(e).is_some_and(Lifecycle::is_terminal)),
        "a terminal event is always the last"
    );
}

fn by_command(evs: &[wire::CommandEvent]) -> BTreeMap<String, Vec<wire::CommandEvent>> {
    let mut m: BTreeMap<String, Vec<wire::CommandEvent>> = BTreeMap::new();
    for e in evs {
        m.entry(e.issue_uuid.clone()).or_default().push(e.clone());
    }
    m
}

#[test]
fn a_full_session_speaks_valid_frames() {
    let mut h = Harness::new(config(), 1);
    let hello = h.connect();
    check_hello(&hello);
    assert_eq!(hello.client_instance_id, h.client.instance_id());
    assert_eq!(h.client.phase(), LinkPhase::Reconciling);

    let (chunks, after) = h.reconcile();
    assert_eq!(chunks.len(), 1);
    let c = &chunks[0];
    assert_eq!(
        (c.round, c.chunk_index, c.final_chunk),
        (1, 0, true),
        "{c:?}"
    );
    assert_eq!(c.store_health, wire::ScopeState::Ready as i32);
    assert!(c.records.is_empty() && c.tombstones.is_empty());
    // capacity right after the result, nothing else
    assert!(matches!(
        after.as_slice(),
        [Seen::Env(wire::Envelope {
            payload: Some(Payload::ClientCapacity(_)),
            ..
        })]
    ));
    assert_eq!(h.client.phase(), LinkPhase::Active);

    let mut seen = Vec::new();
    let mut issues = Vec::new();
    for i in 0..5 {
        let (issue, s) = h.dispatch_new(&format!("echo {i}"));
        let acc = accepted(&s);
        assert_eq!(acc.len(), 1);
        assert_eq!(acc[0].outcome, wire::AcceptOutcome::Positive as i32);
        assert_eq!(acc[0].revision, 1);
        assert_eq!(acc[0].resolved_shell, wire::ShellType::Sh as i32);
        assert!(acc[0].error.is_none());
        issues.push(issue);
        seen.extend(s);
    }
    seen.extend(h.advance(60_000));
    // every envelope after the welcome carries the live session fields
    for s in &seen {
        let Seen::Env(e) = s else {
            assert!(matches!(s, Seen::Ping), "{s:?}");
            continue;
        };
        assert_eq!(
            (e.session_id.as_str(), e.generation),
            (h.session_id.as_str(), h.generation)
        );
    }
    let cmds = by_command(&events(&seen));
    assert_eq!(cmds.len(), 5);
    for evs in cmds.values() {
        check_command_events(evs);
    }
    // acks turn every record into a tombstone
    h.ack_all(&seen);
    assert!(h.client.durable().records().is_empty());
    for issue in &issues {
        let id = Uuid7::parse("t", issue).unwrap();
        assert!(h.client.durable().is_tombstoned(&id));
        assert_eq!(h.client.ledger().accepted()[&id], 1);
        assert_eq!(h.client.ledger().starts()[&id], 1);
    }
    assert_eq!(
        h.client.ledger().pending_acks().len(),
        cmds.values().map(Vec::len).sum::<usize>()
    );
    // a stale server dispatching again hits the tombstone
    let again = h.redispatch(&issues[0]);
    let a = &accepted(&again)[0];
    assert_eq!(a.outcome, wire::AcceptOutcome::Permanent as i32);
    assert_eq!(
        a.error.as_ref().unwrap().code,
        wire::ErrorCode::AlreadyExecuted as i32
    );
    assert_eq!(h.client.counters().server_violations, 0);
}

#[test]
fn never_accepts_or_starts_a_uuid_twice_across_crashes() {
    let mut cfg = config();
    cfg.max_running = 1;
    cfg.max_step_ms = 1_000;
    cfg.max_output_chunks = 5;
    let mut h = Harness::new(cfg, 2);
    h.connect();
    h.reconcile();
    let (a, s1) = h.dispatch_new("sleep 1");
    let (b, s2) = h.dispatch_new("sleep 2");
    assert_eq!(accepted(&s1).len() + accepted(&s2).len(), 2);
    let ida = Uuid7::parse("t", &a).unwrap();
    let idb = Uuid7::parse("t", &b).unwrap();
    // a runs, b waits (max_running 1); the acceptances were "lost": the
    // server never recorded them, and the daemon crashes
    assert_eq!(
        h.client.durable().record(&ida).unwrap().lifecycle,
        Lifecycle::Running
    );
    assert_eq!(
        h.client.durable().record(&idb).unwrap().lifecycle,
        Lifecycle::Accepted
    );
    let conn = h.client.crash_restart(h.now);
    assert_eq!(conn, h.conn);
    h.conn = None;
    // the running command is interrupted, the waiting one may still run
    assert_eq!(
        h.client.durable().record(&ida).unwrap().lifecycle,
        Lifecycle::Interrupted
    );
    h.connect();
    let (chunks, _) = h.reconcile();
    let recs: Vec<&str> = chunks
        .iter()
        .flat_map(|c| c.records.iter().map(|r| r.issue_uuid.as_str()))
        .collect();
    let mut want = vec![a.as_str(), b.as_str()];
    want.sort_unstable();
    assert_eq!(recs, want, "snapshot lists both retained commands, sorted");
    // the server repeats both dispatches: idempotent, no new acceptance
    for issue in [&a, &b] {
        let seen = h.redispatch(issue);
        let acc = accepted(&seen);
        assert_eq!(acc[0].outcome, wire::AcceptOutcome::Positive as i32);
    }
    assert_eq!(h.client.counters().idempotent_repeats, 2);
    let mut seen = h.advance(h.now + 30_000);
    // crash again mid-way, then finish everything
    h.client.crash_restart(h.now);
    h.conn = None;
    h.connect();
    let (_, after) = h.reconcile();
    seen.extend(after);
    h.run_to_quiet(seen, h.now + 120_000);
    assert!(
        h.client.durable().records().is_empty(),
        "{:?}",
        h.client.durable().records()
    );
    h.client.crash_restart(h.now);
    h.conn = None;
    h.connect();
    h.reconcile();
    for issue in [&a, &b] {
        let seen = h.redispatch(issue);
        assert_eq!(
            accepted(&seen)[0].error.as_ref().unwrap().code,
            wire::ErrorCode::AlreadyExecuted as i32
        );
    }
    let ledger = h.client.ledger();
    for id in [ida, idb] {
        assert_eq!(ledger.accepted()[&id], 1);
        assert!(ledger.starts().get(&id).copied().unwrap_or(0) <= 1);
    }
    assert_eq!(ledger.starts()[&ida], 1);
    assert_eq!(h.client.counters().interrupted_by_crash, 1);
    // every event the server stored came from one content per sequence
    let mut contents: BTreeMap<(String, u64), Vec<u8>> = BTreeMap::new();
    for e in events(&h.log) {
        let d = content_digest(&e).unwrap().to_vec();
        let prev = contents
            .entry((e.issue_uuid.clone(), e.event_seq))
            .or_insert(d.clone());
        assert_eq!(
            *prev, d,
            "replay changed event {} {}",
            e.issue_uuid, e.event_seq
        );
    }
}

#[test]
fn windows_bound_unacknowledged_events_and_replay_resumes_after_durable() {
    let mut cfg = config();
    cfg.max_output_chunks = 40;
    cfg.max_chunk_raw_bytes = 16_384;
    cfg.max_step_ms = 0;
    cfg.command_window_bytes = 128 * 1024;
    cfg.session_window_bytes = 256 * 1024;
    let mut h = Harness::new(cfg, 3);
    h.connect();
    h.reconcile();
    let mut seen = Vec::new();
    for i in 0..4 {
        seen.extend(h.dispatch_new(&format!("yes {i}")).1);
    }
    seen.extend(h.advance(h.now + 1_000));
    let cost = |e: &wire::CommandEvent| e.encoded_len() as u64;
    let evs = events(&seen);
    let total: u64 = evs.iter().map(cost).sum();
    assert!(total <= 256 * 1024, "session window exceeded: {total}");
    for (_, list) in by_command(&evs) {
        let per: u64 = list.iter().map(cost).sum();
        assert!(per <= 128 * 1024, "command window exceeded: {per}");
    }
    assert!(
        total > 128 * 1024,
        "the session window should have filled: {total}"
    );
    // acknowledge part of one command, then lose the connection
    let first = evs[0].issue_uuid.clone();
    let firsts: Vec<&wire::CommandEvent> = evs.iter().filter(|e| e.issue_uuid == first).collect();
    let half = firsts[firsts.len() / 2].event_seq;
    h.deliver(Payload::EventAck(wire::EventAck {
        issue_uuid: first.clone(),
        durable_event_seq: half,
    }));
    h.server.get_mut(&first).unwrap().durable = half;
    // the server stored one more event than it acknowledged
    h.server.get_mut(&first).unwrap().durable = half + 1;
    h.disconnect();
    h.connect();
    let (chunks, after) = h.reconcile();
    let rec = chunks[0]
        .records
        .iter()
        .find(|r| r.issue_uuid == first)
        .unwrap();
    assert_eq!(rec.acked_event_seq, half);
    assert!(rec.last_assigned_event_seq > half + 1);
    // capacity first, then the replay of this command from half + 2
    assert!(matches!(
        after[0].payload(),
        Some(Payload::ClientCapacity(_))
    ));
    let replay = events(&after);
    let mine: Vec<u64> = replay
        .iter()
        .filter(|e| e.issue_uuid == first)
        .map(|e| e.event_seq)
        .collect();
    assert_eq!(mine.first().copied(), Some(half + 2));
    assert!(mine.windows(2).all(|w| w[1] == w[0] + 1));
    // replayed events are byte-identical to the first sending
    for e in &replay {
        let orig = evs
            .iter()
            .find(|o| o.issue_uuid == e.issue_uuid && o.event_seq == e.event_seq);
        if let Some(o) = orig {
            assert_eq!(o, e);
        }
    }
    // and everything completes once acks flow
    h.run_to_quiet(after, h.now + 60_000);
    assert!(h.client.durable().records().is_empty());
    assert_eq!(h.client.counters().server_violations, 0);
}

#[test]
fn snapshots_are_chunked_and_sorted() {
    let mut cfg = config();
    cfg.snapshot_chunk_items = 2;
    cfg.max_running = 1;
    cfg.max_step_ms = 100_000;
    let mut h = Harness::new(cfg, 4);
    h.connect();
    h.reconcile();
    for i in 0..5 {
        h.dispatch_new(&format!("true {i}"));
    }
    h.disconnect();
    h.connect();
    let (chunks, _) = h.reconcile();
    assert_eq!(chunks.len(), 3);
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.chunk_index as usize, i);
        assert_eq!(c.final_chunk, i == 2);
        assert_eq!(c.store_health, wire::ScopeState::Ready as i32);
        assert!(c.records.len() <= 2);
    }
    let ids: Vec<Uuid7> = chunks
        .iter()
        .flat_map(|c| c.records.iter())
        .map(|r| Uuid7::parse("t", &r.issue_uuid).unwrap())
        .collect();
    assert_eq!(ids.len(), 5);
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn signals_cancel_before_launch_and_terminate_after() {
    let mut cfg = config();
    cfg.max_running = 1;
    cfg.max_output_chunks = 50;
    cfg.max_step_ms = 1_000;
    let mut h = Harness::new(cfg, 5);
    h.connect();
    h.reconcile();
    let (running, _) = h.dispatch_new("sleep 100");
    let (waiting, _) = h.dispatch_new("sleep 200");
    let mut seen = h.deliver(Payload::Signal(wire::Signal {
        issue_uuid: waiting.clone(),
        revision: 2,
        signal: wire::SignalKind::Term as i32,
    }));
    seen.extend(h.deliver(Payload::Signal(wire::Signal {
        issue_uuid: running.clone(),
        revision: 2,
        signal: wire::SignalKind::Kill as i32,
    })));
    // a repeat of the same revision changes nothing
    seen.extend(h.deliver(Payload::Signal(wire::Signal {
        issue_uuid: running.clone(),
        revision: 2,
        signal: wire::SignalKind::Kill as i32,
    })));
    let cmds = by_command(&events(&seen));
    let w = &cmds[&waiting];
    assert_eq!(w.len(), 1);
    let Some(Body::Lifecycle(l)) = &w[0].body else {
        panic!()
    };
    assert_eq!(l.lifecycle, wire::Lifecycle::Cancelled as i32);
    assert_eq!(l.revision, 2);
    let r: Vec<_> = cmds[&running]
        .iter()
        .map(|e| e.body.clone().unwrap())
        .collect();
    assert!(matches!(&r[r.len() - 2], Body::SignalResult(s)
        if s.revision == 2 && s.outcome == wire::SignalOutcome::Delivered as i32));
    assert!(matches!(&r[r.len() - 1], Body::Lifecycle(l)
        if l.lifecycle == wire::Lifecycle::Terminated as i32
            && l.exit_result.as_ref().unwrap().signal_name == "SIGKILL"));
    assert_eq!(h.client.counters().signals, 2);
    assert_eq!(h.client.counters().cancelled_before_launch, 1);
    let wid = Uuid7::parse("t", &waiting).unwrap();
    assert!(!h.client.ledger().starts().contains_key(&wid));
}

#[test]
fn reconcile_terminates_and_discards_what_the_server_lacks() {
    let mut cfg = config();
    cfg.max_step_ms = 100_000;
    let mut h = Harness::new(cfg, 6);
    h.connect();
    h.reconcile();
    let (issue, _) = h.dispatch_new("sleep 1000");
    let id = Uuid7::parse("t", &issue).unwrap();
    // the server forgets it (e.g. restored from an older backup)
    h.server.clear();
    h.disconnect();
    h.connect();
    let (_, after) = h.reconcile();
    assert!(
        events(&after).is_empty(),
        "nothing is sent for it: {after:?}"
    );
    let rec = h.client.durable().record(&id).unwrap();
    assert!(rec.orphaned);
    assert_eq!(rec.lifecycle, Lifecycle::Terminated);
    assert_eq!(h.client.counters().reconcile_terminated, 1);
    // the next round discards the terminal record into a tombstone
    h.disconnect();
    h.connect();
    h.reconcile();
    assert!(h.client.durable().record(&id).is_none());
    assert!(h.client.durable().is_tombstoned(&id));
}

#[test]
fn a_bad_reconcile_result_is_refused() {
    let mut h = Harness::new(config(), 7);
    h.connect();
    h.round += 1;
    let round = h.round;
    h.deliver(Payload::ReconcileRequest(wire::ReconcileRequest {
        round,
        rows: Vec::new(),
    }));
    let mut bad = wire::ReconcileResult {
        round,
        ..Default::default()
    };
    bad.result_digest = vec![0; 32];
    let seen = h.deliver(Payload::ReconcileResult(bad));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert_eq!(h.client.counters().server_violations, 1);
    assert_eq!(h.client.phase(), LinkPhase::Backoff);
}

#[test]
fn stale_session_fields_close_the_connection() {
    let mut h = Harness::new(config(), 8);
    h.connect();
    let sid = h.session_id.clone();
    let seen = h.send_env(
        &sid,
        h.generation + 1,
        Payload::EventAck(wire::EventAck::default()),
    );
    assert!(seen.contains(&Seen::Close(4001)), "{seen:?}");
}

#[test]
fn liveness_pings_then_gives_up() {
    let mut h = Harness::new(config(), 9);
    h.auto_pong = false;
    h.connect();
    let t0 = h.now;
    let seen = h.advance(t0 + 10_000);
    assert_eq!(seen, vec![Seen::Ping]);
    let seen = h.advance(t0 + 30_000);
    assert_eq!(seen, vec![Seen::Close(4002)]);
    assert_eq!(h.client.counters().liveness_timeouts, 1);
    assert_eq!(h.client.phase(), LinkPhase::Backoff);
}

fn adversarial(kind: Adversary, seed: u64) -> Harness {
    let mut cfg = config();
    cfg.adversary = Some(kind);
    cfg.adversary_permille = 1000;
    cfg.max_chunk_raw_bytes = 65_536;
    cfg.max_output_chunks = 20;
    cfg.max_step_ms = 0;
    let mut h = Harness::new(cfg, seed);
    h.connect();
    h.reconcile();
    h
}

#[test]
fn adversaries_misbehave_once_per_session() {
    // stale generation: an envelope with the previous generation
    let mut h = adversarial(Adversary::StaleGeneration, 10);
    let (_, seen) = h.dispatch_new("x");
    let _ = seen;
    assert!(
        h.log
            .iter()
            .any(|s| matches!(s, Seen::Env(e) if e.generation + 1 == h.generation))
    );
    assert_eq!(h.client.counters().misbehaviours, 1);

    // malformed bytes: a frame that is not a valid envelope of this session
    let mut h = adversarial(Adversary::MalformedBytes, 11);
    assert_eq!(h.client.counters().misbehaviours, 1);
    assert!(h.log.iter().any(|s| match s {
        Seen::Raw(_) => true,
        Seen::Env(e) => e.session_id != h.session_id,
        _ => false,
    }));
    let _ = h.dispatch_new("x");
    assert_eq!(h.client.counters().misbehaviours, 1, "once per session");

    // conflicting duplicate: same (issue, seq), other content
    let mut h = adversarial(Adversary::ConflictingDuplicate, 12);
    let (_, mut seen) = h.dispatch_new("x");
    seen.extend(h.advance(h.now + 10));
    h.ack_all(&[]);
    let evs = events(&h.log);
    let mut by_seq: BTreeMap<(String, u64), Vec<[u8; 32]>> = BTreeMap::new();
    for e in &evs {
        by_seq
            .entry((e.issue_uuid.clone(), e.event_seq))
            .or_default()
            .push(content_digest(e).unwrap());
    }
    assert!(
        by_seq
            .values()
            .any(|d| d.len() > 1 && d.iter().any(|x| *x != d[0])),
        "no conflicting duplicate sent"
    );

    // window overrun: more unacknowledged bytes for one command than 1 MiB
    let mut h = adversarial(Adversary::WindowOverrun, 13);
    let mut issues = Vec::new();
    for _ in 0..10 {
        let (issue, mut seen) = h.dispatch_new("x");
        issues.push(issue);
        seen.extend(h.advance(h.now + 10));
        // the next input (an ack) finds a large event sent this session
        h.ack_all(&seen);
        if h.client.counters().misbehaviours > 0 {
            break;
        }
    }
    assert_eq!(h.client.counters().misbehaviours, 1);
    let mut per_issue: BTreeMap<String, u64> = BTreeMap::new();
    for e in events(&h.log) {
        *per_issue.entry(e.issue_uuid.clone()).or_default() += e.encoded_len() as u64;
    }
    assert_eq!(per_issue.len(), issues.len());
    let sent = per_issue.values().copied().max().unwrap();
    assert!(sent > 1 << 20, "only {sent} bytes");
}

#[test]
fn a_second_instance_has_its_own_identity() {
    let a = SimClient::new(config(), Seeds::new(14).client(0)).unwrap();
    let b = a.second_instance(Seeds::new(14).client(1));
    assert_eq!(a.client_id(), b.client_id());
    assert_ne!(a.instance_id(), b.instance_id());
    assert_eq!(b.config().adversary, Some(Adversary::SecondInstance));
    check_hello(&b.hello());
}

#[test]
fn same_seed_same_trace() {
    let run = || {
        let mut h = Harness::new(config(), 42);
        h.connect();
        h.reconcile();
        let mut seen = Vec::new();
        for i in 0..3 {
            seen.extend(h.dispatch_new(&format!("echo {i}")).1);
        }
        h.run_to_quiet(seen, 30_000);
        h.client.crash_restart(h.now);
        h.conn = None;
        h.connect();
        h.reconcile();
        (
            h.log.clone(),
            h.client.counters().clone(),
            h.client.instance_id(),
        )
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    assert!(a.0.len() > 10);
}

#[test]
fn config_bounds_are_checked() {
    let mut c = config();
    c.max_running = 0;
    assert_eq!(c.validate().unwrap_err().field, "max_running");
    let mut c = config();
    c.client_id = "bad id".into();
    assert_eq!(c.validate().unwrap_err().field, "client_id");
    let mut c = config();
    c.command_window_bytes = 1024;
    assert!(c.validate().is_err());
    let mut c = config();
    c.max_chunk_raw_bytes = 65_537;
    assert!(c.validate().is_err());
    assert!(config().validate().is_ok());
    let _ = snapshots(&[]);
}
