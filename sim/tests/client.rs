//! The simulated client against a scripted server: valid frames, the
//! reconnect order, windows, idempotent acceptance across crashes,
//! signals, adversarial modes, determinism and script uploads.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeMap;

use common::{Harness, Seen, ServerCmd, WALL_EPOCH_MS, accepted, events, lifecycle_of, snapshots};
use prost::Message as _;
use rvbox_domain::hash::command_hash;
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

// ---- script uploads --------------------------------------------------------

/// The server's per-command script window (bytes beyond the last
/// `received_bytes` in flight).
const SCRIPT_WINDOW: usize = 1_048_576;
/// The largest raw script chunk.
const SCRIPT_CHUNK: usize = 262_144;

fn script_body(len: usize, seed: u64) -> Vec<u8> {
    rvbox_sim::rng::SimRng::new(seed).bytes(len)
}

fn script_spec(body: &[u8]) -> wire::ExecutionSpec {
    wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::Script(
            wire::ScriptDescriptor {
                display_basename: "job.sh".into(),
                size_bytes: body.len() as u64,
                sha256: rvbox_segment::sha256(body).to_vec(),
            },
        )),
        ..Default::default()
    }
}

/// A fresh script command for this client, dispatched at revision 1.
fn dispatch_script(h: &mut Harness, body: &[u8]) -> (String, Vec<Seen>) {
    let issue = h
        .rng
        .uuid_v7_text(u64::try_from(WALL_EPOCH_MS).unwrap() + h.now);
    let spec = script_spec(body);
    let hash = command_hash(&h.client_id(), &spec).0.to_vec();
    h.server.insert(
        issue.clone(),
        ServerCmd {
            hash,
            revision: 1,
            durable: 0,
            terminal: false,
            spec: Some(spec),
        },
    );
    let seen = h.redispatch(&issue);
    (issue, seen)
}

/// An honest uncompressed chunk of `body[offset..offset + len]`.
fn chunk(issue: &str, body: &[u8], offset: usize, len: usize) -> wire::ScriptChunk {
    let raw = &body[offset..offset + len];
    wire::ScriptChunk {
        issue_uuid: issue.into(),
        offset: offset as u64,
        declared_size: body.len() as u64,
        compression: wire::Compression::None as i32,
        payload: raw.to_vec(),
        raw_length: len as u32,
        stored_length: len as u32,
        raw_sha256: rvbox_segment::sha256(raw).to_vec(),
    }
}

fn send_chunk(h: &mut Harness, c: wire::ScriptChunk) -> Vec<Seen> {
    h.deliver(Payload::ScriptChunk(c))
}

fn statuses(seen: &[Seen]) -> Vec<wire::ScriptUploadStatus> {
    seen.iter()
        .filter_map(|s| match s.payload() {
            Some(Payload::ScriptUploadStatus(st)) => Some(st.clone()),
            _ => None,
        })
        .collect()
}

fn status(issue: &str, received: u64, state: wire::ScriptUploadState) -> wire::ScriptUploadStatus {
    wire::ScriptUploadStatus {
        issue_uuid: issue.into(),
        received_bytes: received,
        state: state as i32,
        error: None,
    }
}

/// Serves `body` from `from` as the server does: contiguous chunks of at
/// most 256 KiB, at most 1 MiB beyond the last reported `received_bytes`
/// in flight, more after each batch of statuses; until COMMITTED.
fn serve_script(h: &mut Harness, issue: &str, body: &[u8], from: usize) -> Vec<Seen> {
    let (mut sent, mut received) = (from, from);
    let mut all = Vec::new();
    for _ in 0..100 {
        let limit = body.len().min(received + SCRIPT_WINDOW);
        assert!(sent < limit, "the window is closed at {sent}");
        let mut batch = Vec::new();
        while sent < limit {
            let len = SCRIPT_CHUNK.min(limit - sent);
            batch.extend(send_chunk(h, chunk(issue, body, sent, len)));
            sent += len;
        }
        let last = statuses(&batch).last().cloned().expect("no status");
        all.extend(batch);
        if last.state == wire::ScriptUploadState::Committed as i32 {
            return all;
        }
        assert!(last.received_bytes as usize > received, "no progress");
        received = last.received_bytes as usize;
    }
    panic!("the upload never committed");
}

fn record(h: &Harness, issue: &str) -> rvbox_sim::client::RecordView {
    h.client
        .durable()
        .record(&Uuid7::parse("t", issue).unwrap())
        .unwrap()
}

fn started(h: &Harness, issue: &str) -> bool {
    h.client
        .ledger()
        .starts()
        .contains_key(&Uuid7::parse("t", issue).unwrap())
}

#[test]
fn a_script_in_order_reports_its_prefix_commits_then_launches() {
    let mut cfg = config();
    cfg.max_running = 1;
    let mut h = Harness::new(cfg, 20);
    h.connect();
    h.reconcile();
    let body = script_body(600_000, 1);
    let (issue, seen) = dispatch_script(&mut h, &body);
    let acc = accepted(&seen);
    assert_eq!(acc.len(), 1);
    assert_eq!(acc[0].outcome, wire::AcceptOutcome::Positive as i32);
    assert_eq!(acc[0].resolved_shell, wire::ShellType::Sh as i32);
    assert!(
        events(&seen).is_empty(),
        "launched before the upload: {seen:?}"
    );
    // accepted, waiting for its bytes: queued, never started
    assert_eq!(h.client.capacity(), (0, 1));
    let v = record(&h, &issue);
    assert_eq!(v.lifecycle, Lifecycle::Accepted);
    assert!(!v.started);
    let s = v.script.unwrap();
    assert_eq!(
        (s.size_bytes, s.received_bytes, s.committed),
        (600_000, 0, false)
    );

    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 0, SCRIPT_CHUNK));
    seen.extend(send_chunk(
        &mut h,
        chunk(&issue, &body, SCRIPT_CHUNK, SCRIPT_CHUNK),
    ));
    // progress is reported every 512 KiB, not per chunk
    assert_eq!(
        statuses(&seen),
        vec![status(&issue, 524_288, wire::ScriptUploadState::Receiving)]
    );
    // the status travels on the live session
    for s in &seen {
        let Seen::Env(e) = s else { panic!("{s:?}") };
        assert_eq!(
            (e.session_id.as_str(), e.generation),
            (h.session_id.as_str(), h.generation)
        );
    }
    // a text command behind it runs; the script does not, however long
    // it waits (no launch before commit, no head-of-line blocking)
    let (text, s) = h.dispatch_new("echo behind");
    seen.extend(s);
    seen.extend(h.advance(h.now + 60_000));
    h.ack_all(&seen);
    assert!(started(&h, &text));
    assert!(!started(&h, &issue));
    assert!(events(&seen).iter().all(|e| e.issue_uuid != issue));
    assert_eq!(record(&h, &issue).lifecycle, Lifecycle::Accepted);
    assert_eq!(
        h.client
            .durable()
            .script_prefix(&Uuid7::parse("t", &issue).unwrap()),
        Some(&body[..524_288])
    );

    // the last chunk: COMMITTED with the size, then RUNNING
    let seen = send_chunk(&mut h, chunk(&issue, &body, 524_288, 600_000 - 524_288));
    let st = statuses(&seen);
    assert_eq!(
        st,
        vec![status(&issue, 600_000, wire::ScriptUploadState::Committed)]
    );
    let status_at = seen
        .iter()
        .position(|s| matches!(s.payload(), Some(Payload::ScriptUploadStatus(_))))
        .unwrap();
    let running_at = seen
        .iter()
        .position(
            |s| matches!(s.payload(), Some(Payload::CommandEvent(e)) if e.issue_uuid == issue),
        )
        .expect("not launched after the commit");
    assert!(status_at < running_at);
    assert_eq!(lifecycle_of(&events(&seen)[0]), Some(Lifecycle::Running));
    assert!(started(&h, &issue));
    let s = record(&h, &issue).script.unwrap();
    assert_eq!((s.received_bytes, s.committed), (600_000, true));
    let c = h.client.counters();
    assert_eq!(c.script_chunks_accepted, 3);
    assert_eq!(c.script_chunk_replays, 0);
    assert_eq!(c.scripts_committed, 1);
    // a chunk after the commit (a re-sent upload) stores nothing and is
    // answered COMMITTED again, so the server ends that upload
    let again = send_chunk(&mut h, chunk(&issue, &body, 0, 10));
    assert_eq!(
        statuses(&again),
        vec![status(&issue, 600_000, wire::ScriptUploadState::Committed)]
    );
    assert_eq!(h.client.counters().script_chunks_accepted, 3);
    // it runs to the end like any command and becomes a tombstone
    h.run_to_quiet(seen, h.now + 60_000);
    assert!(h.client.durable().records().is_empty());
    assert_eq!(h.client.counters().server_violations, 0);
    assert_eq!(h.client.counters().unsupported_messages, 0);
}

#[test]
fn exact_replays_are_accepted_and_may_extend_the_prefix() {
    let mut h = Harness::new(config(), 21);
    h.connect();
    h.reconcile();
    let body = script_body(5_000, 2);
    let (issue, _) = dispatch_script(&mut h, &body);
    let id = Uuid7::parse("t", &issue).unwrap();
    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    // the same chunk again (a re-send after a reconnect or re-acceptance)
    seen.extend(send_chunk(&mut h, chunk(&issue, &body, 0, 1_000)));
    // a chunk inside the prefix
    seen.extend(send_chunk(&mut h, chunk(&issue, &body, 200, 300)));
    // a chunk overlapping the prefix exactly and running past it
    seen.extend(send_chunk(&mut h, chunk(&issue, &body, 500, 1_500)));
    // a zstd chunk at the prefix
    let mut z = chunk(&issue, &body, 2_000, 1_000);
    z.compression = wire::Compression::Zstd as i32;
    z.payload = zstd::bulk::compress(&body[2_000..3_000], 3).unwrap();
    z.stored_length = z.payload.len() as u32;
    seen.extend(send_chunk(&mut h, z));
    let got: Vec<(u64, i32)> = statuses(&seen)
        .iter()
        .map(|s| (s.received_bytes, s.state))
        .collect();
    let recv = wire::ScriptUploadState::Receiving as i32;
    // a replay is answered at once (the server learns to skip ahead); new
    // bytes only every 512 KiB, so the zstd chunk at the prefix is silent
    assert_eq!(got, vec![(1_000, recv), (1_000, recv), (2_000, recv)]);
    assert_eq!(h.client.durable().script_prefix(&id), Some(&body[..3_000]));
    assert_eq!(h.client.counters().script_chunk_replays, 3);
    assert_eq!(h.client.counters().script_chunks_accepted, 5);
    assert!(!started(&h, &issue));
    let seen = send_chunk(&mut h, chunk(&issue, &body, 3_000, 2_000));
    assert_eq!(
        statuses(&seen),
        vec![status(&issue, 5_000, wire::ScriptUploadState::Committed)]
    );
    assert!(started(&h, &issue));
    assert_eq!(h.client.durable().script_prefix(&id), None, "released");
    assert_eq!(h.client.counters().server_violations, 0);
}

#[test]
fn a_changed_overlap_or_a_hole_is_a_server_violation() {
    let mut h = Harness::new(config(), 22);
    h.connect();
    h.reconcile();
    let body = script_body(10_000, 3);
    let (issue, _) = dispatch_script(&mut h, &body);
    let id = Uuid7::parse("t", &issue).unwrap();
    send_chunk(&mut h, chunk(&issue, &body, 0, 4_000));

    // a changed overlap: consistent in itself (its own SHA-256 matches)
    let mut other = body.clone();
    other[3_500] ^= 0xff;
    let seen = send_chunk(&mut h, chunk(&issue, &other, 3_000, 2_000));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert!(statuses(&seen).is_empty());
    assert_eq!(h.client.counters().server_violations, 1);
    assert!(h.client.violation_notes()[0].contains("changes bytes already received"));
    assert_eq!(h.client.phase(), LinkPhase::Backoff);
    assert_eq!(h.client.durable().script_prefix(&id), Some(&body[..4_000]));
    h.conn = None;

    // after the reconnect the snapshot reports the untouched prefix
    h.connect();
    let (chunks, _) = h.reconcile();
    assert_eq!(chunks[0].records[0].script_received_bytes, 4_000);
    // a hole: an offset past the prefix
    let seen = send_chunk(&mut h, chunk(&issue, &body, 5_000, 1_000));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert_eq!(h.client.counters().server_violations, 2);
    assert!(h.client.violation_notes()[1].contains("leaves a hole after the prefix 4000"));
    assert_eq!(h.client.durable().script_prefix(&id), Some(&body[..4_000]));
    h.conn = None;

    // the honest rest still commits and launches
    h.connect();
    h.reconcile();
    let seen = serve_script(&mut h, &issue, &body, 4_000);
    assert!(!seen.contains(&Seen::Close(1002)));
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().server_violations, 2);
    assert_eq!(h.client.counters().script_chunk_replays, 0);
}

#[test]
fn malformed_chunks_are_server_violations_and_change_nothing() {
    let mut h = Harness::new(config(), 23);
    h.connect();
    h.reconcile();
    let body = script_body(300_000, 4);
    let (issue, _) = dispatch_script(&mut h, &body);
    let id = Uuid7::parse("t", &issue).unwrap();
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    let good = || chunk(&issue, &body, 1_000, 1_000);
    type Edit = Box<dyn Fn(&mut wire::ScriptChunk)>;
    let cases: Vec<(&str, &str, Edit)> = vec![
        (
            "unspecified compression",
            "compression value 0",
            Box::new(|c| c.compression = wire::Compression::Unspecified as i32),
        ),
        (
            "unknown compression",
            "compression value 9",
            Box::new(|c| c.compression = 9),
        ),
        (
            "stored_length",
            "stored_length",
            Box::new(|c| c.stored_length += 1),
        ),
        (
            "raw_length above the payload",
            "decodes to 1000 bytes",
            Box::new(|c| c.raw_length += 1),
        ),
        (
            "raw_length 0",
            "raw_length 0 is not",
            Box::new(|c| c.raw_length = 0),
        ),
        (
            "raw_sha256",
            "raw_sha256",
            Box::new(|c| c.raw_sha256[0] ^= 1),
        ),
        (
            "raw_sha256 length",
            "raw_sha256",
            Box::new(|c| c.raw_sha256.truncate(31)),
        ),
        (
            "declared_size",
            "declared_size",
            Box::new(|c| c.declared_size += 1),
        ),
        (
            "past the declared size",
            "passes the declared size",
            Box::new(|c| c.offset = 300_000 - 999),
        ),
        (
            "offset overflow",
            "passes the declared size",
            Box::new(|c| c.offset = u64::MAX - 10),
        ),
        (
            "zstd that is not zstd",
            "zstd payload",
            Box::new(|c| c.compression = wire::Compression::Zstd as i32),
        ),
        (
            "zstd larger than raw_length",
            "zstd payload",
            Box::new(|c| {
                let bigger = vec![7u8; 2_000];
                c.compression = wire::Compression::Zstd as i32;
                c.payload = zstd::bulk::compress(&bigger, 3).unwrap();
                c.stored_length = c.payload.len() as u32;
            }),
        ),
    ];
    let mut violations = 0;
    for (name, want, edit) in &cases {
        let mut c = good();
        edit(&mut c);
        let seen = send_chunk(&mut h, c);
        violations += 1;
        assert!(seen.contains(&Seen::Close(1002)), "{name}: {seen:?}");
        assert!(statuses(&seen).is_empty(), "{name}");
        assert_eq!(h.client.counters().server_violations, violations, "{name}");
        let note = h.client.violation_notes().last().unwrap();
        assert!(note.contains(want), "{name}: {note}");
        assert_eq!(
            h.client.durable().script_prefix(&id),
            Some(&body[..1_000]),
            "{name}"
        );
        h.conn = None;
        h.connect();
        h.reconcile();
    }
    // a raw chunk above 256 KiB
    let seen = send_chunk(&mut h, chunk(&issue, &body, 1_000, SCRIPT_CHUNK + 1));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    let note = h.client.violation_notes().last().unwrap();
    assert!(note.contains("raw_length 262145 is not"), "{note}");
    h.conn = None;
    h.connect();
    h.reconcile();
    // a chunk for an unknown or tombstoned command is refused (the server
    // ends that upload), not a violation; a chunk for a command-text
    // command is a noted violation without a close
    let before = h.client.counters().server_violations;
    let unknown = h.rng.uuid_v7_text(u64::try_from(WALL_EPOCH_MS).unwrap());
    let seen = send_chunk(&mut h, chunk(&unknown, &body, 0, 10));
    assert_eq!(
        statuses(&seen)
            .iter()
            .map(|s| (s.received_bytes, s.state))
            .collect::<Vec<_>>(),
        vec![(0, wire::ScriptUploadState::Rejected as i32)]
    );
    assert_eq!(h.client.counters().script_chunks_refused, 1);
    assert_eq!(h.client.counters().server_violations, before);
    let (text, _) = h.dispatch_new("echo text");
    let seen = send_chunk(&mut h, chunk(&text, &body, 0, 10));
    assert!(!seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert!(statuses(&seen).is_empty());
    assert_eq!(h.client.counters().server_violations, before + 1);
    let note = h.client.violation_notes().last().unwrap();
    assert!(note.contains("a command without a script"), "{note}");
    assert_eq!(h.client.phase(), LinkPhase::Active);
    assert!(!started(&h, &issue));
    assert_eq!(h.client.counters().script_chunks_accepted, 1);
}

#[test]
fn a_wrong_whole_script_is_a_violation_and_never_launches() {
    let mut h = Harness::new(config(), 24);
    h.connect();
    h.reconcile();
    let body = script_body(2_000, 5);
    // the descriptor promises other bytes of the same length
    let mut promised = body.clone();
    promised[0] ^= 1;
    let (issue, _) = dispatch_script(&mut h, &promised);
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    let seen = send_chunk(&mut h, chunk(&issue, &body, 1_000, 1_000));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert!(statuses(&seen).is_empty());
    assert_eq!(h.client.counters().server_violations, 1);
    assert_eq!(h.client.counters().scripts_committed, 0);
    assert!(h.client.violation_notes()[0].contains("do not match the descriptor's SHA-256"));
    let s = record(&h, &issue).script.unwrap();
    assert!(!s.committed);
    h.conn = None;
    h.advance(h.now + 60_000);
    assert!(!started(&h, &issue));
}

#[test]
fn a_signal_before_the_commit_cancels_before_launch() {
    let mut h = Harness::new(config(), 25);
    h.connect();
    h.reconcile();
    let body = script_body(100_000, 6);
    let (issue, _) = dispatch_script(&mut h, &body);
    send_chunk(&mut h, chunk(&issue, &body, 0, 50_000));
    let seen = h.deliver(Payload::Signal(wire::Signal {
        issue_uuid: issue.clone(),
        revision: 2,
        signal: wire::SignalKind::Term as i32,
    }));
    let evs = events(&seen);
    assert_eq!(evs.len(), 1);
    assert_eq!(lifecycle_of(&evs[0]), Some(Lifecycle::Cancelled));
    assert_eq!(h.client.counters().cancelled_before_launch, 1);
    // the rest of the upload commits but the command never launches
    let seen = send_chunk(&mut h, chunk(&issue, &body, 50_000, 50_000));
    assert_eq!(
        statuses(&seen),
        vec![status(&issue, 100_000, wire::ScriptUploadState::Committed)]
    );
    h.advance(h.now + 60_000);
    assert!(!started(&h, &issue));
    assert_eq!(h.client.counters().server_violations, 0);
}

#[test]
fn script_state_survives_a_crash_and_the_snapshot_reports_the_prefix() {
    let mut h = Harness::new(config(), 26);
    h.connect();
    h.reconcile();
    let body = script_body(700_000, 7);
    let (issue, _) = dispatch_script(&mut h, &body);
    let (text, _) = h.dispatch_new("sleep 1");
    let id = Uuid7::parse("t", &issue).unwrap();
    send_chunk(&mut h, chunk(&issue, &body, 0, SCRIPT_CHUNK));
    send_chunk(&mut h, chunk(&issue, &body, SCRIPT_CHUNK, 37_856));
    assert_eq!(record(&h, &issue).script.unwrap().received_bytes, 300_000);

    h.client.crash_restart(h.now);
    h.conn = None;
    // durable: the prefix and the descriptor, not started
    let v = record(&h, &issue);
    assert_eq!(v.lifecycle, Lifecycle::Accepted);
    assert!(!v.started);
    let s = v.script.unwrap();
    assert_eq!(
        (s.size_bytes, s.received_bytes, s.committed),
        (700_000, 300_000, false)
    );
    assert_eq!(
        h.client.durable().script_prefix(&id),
        Some(&body[..300_000])
    );
    h.connect();
    let (chunks, after) = h.reconcile();
    let by_id: BTreeMap<&str, u64> = chunks
        .iter()
        .flat_map(|c| c.records.iter())
        .map(|r| (r.issue_uuid.as_str(), r.script_received_bytes))
        .collect();
    assert_eq!(by_id[issue.as_str()], 300_000);
    assert_eq!(by_id[text.as_str()], 0);
    // the client only waits: nothing for the script is sent by itself
    assert!(statuses(&after).is_empty());
    assert!(events(&after).iter().all(|e| e.issue_uuid != issue));
    // the server resumes from the reported prefix (one replayed chunk
    // first, as after a re-acceptance)
    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 200_000, 100_000));
    seen.extend(serve_script(&mut h, &issue, &body, 300_000));
    assert_eq!(statuses(&seen)[0].received_bytes, 300_000);
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().script_chunk_replays, 1);

    // once committed, a crash keeps it committed and reports the size
    h.client.crash_restart(h.now);
    h.conn = None;
    let v = record(&h, &issue);
    assert_eq!(v.lifecycle, Lifecycle::Interrupted);
    let s = v.script.unwrap();
    assert_eq!((s.received_bytes, s.committed), (700_000, true));
    h.connect();
    let (chunks, _) = h.reconcile();
    let rec = chunks
        .iter()
        .flat_map(|c| c.records.iter())
        .find(|r| r.issue_uuid == issue)
        .unwrap();
    assert_eq!(rec.script_received_bytes, 700_000);
    assert_eq!(h.client.ledger().starts()[&id], 1);
    assert_eq!(h.client.counters().server_violations, 0);
}

#[test]
fn a_one_and_a_half_megabyte_script_arrives_in_windowed_chunks() {
    let mut h = Harness::new(config(), 27);
    h.connect();
    h.reconcile();
    let body = script_body(1_500_000, 8);
    let (issue, _) = dispatch_script(&mut h, &body);
    let seen = serve_script(&mut h, &issue, &body, 0);
    let st = statuses(&seen);
    // six chunks (five of 256 KiB and one of 189,280 bytes), progress every
    // 512 KiB, then the commit
    assert_eq!(h.client.counters().script_chunks_accepted, 6);
    assert_eq!(
        st.iter()
            .map(|s| (s.received_bytes, s.state))
            .collect::<Vec<_>>(),
        vec![
            (524_288, wire::ScriptUploadState::Receiving as i32),
            (1_048_576, wire::ScriptUploadState::Receiving as i32),
            (1_500_000, wire::ScriptUploadState::Committed as i32),
        ]
    );
    assert!(
        st.iter()
            .all(|s| s.issue_uuid == issue && s.error.is_none())
    );
    // every frame fits the envelope limit
    for s in &h.log {
        if let Seen::Env(e) = s {
            assert!(e.encoded_len() <= 1 << 20);
        }
    }
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().scripts_committed, 1);
    h.run_to_quiet(seen, h.now + 60_000);
    let id = Uuid7::parse("t", &issue).unwrap();
    assert!(h.client.durable().is_tombstoned(&id));
    assert_eq!(h.client.counters().server_violations, 0);
}
