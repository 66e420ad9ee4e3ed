//! The real client (the client runtime over the client store, as the
//! simulator runs it) against a scripted server: valid frames, the
//! reconnect order, windows, idempotent acceptance across crashes,
//! signals, the adversary layer on its frames, determinism and script
//! uploads.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeMap;

use common::{
    Harness, Seen, ServerCmd, WALL_EPOCH_MS, accepted, events, lifecycle_of, quiet_programs,
};
use prost::Message as _;
use rvbox_client_core::link::Phase as LinkPhase;
use rvbox_client_core::machine::LaunchPhase;
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, InstanceId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_sim::host::{Adversary, ClientConfig};
use rvbox_sim::invariants::content_digest;
use rvbox_sim::rng::Seeds;

fn config() -> ClientConfig {
    let mut c = ClientConfig::new("web-01");
    c.programs = quiet_programs();
    c
}

fn is_backoff(h: &Harness) -> bool {
    matches!(h.client.phase(), Some(LinkPhase::Backoff { .. }))
}

fn is_active(h: &Harness) -> bool {
    matches!(h.client.phase(), Some(LinkPhase::Active { .. }))
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

fn id(issue: &str) -> Uuid7 {
    Uuid7::parse("t", issue).unwrap()
}

fn terminal_of(seen: &[Seen], issue: &str) -> Option<Lifecycle> {
    events(seen)
        .iter()
        .filter(|e| e.issue_uuid == issue)
        .filter_map(lifecycle_of)
        .find(|l| l.is_terminal())
}

#[test]
fn a_full_session_speaks_valid_frames() {
    let mut h = Harness::new(config(), 1);
    let hello = h.connect();
    check_hello(&hello);
    assert_eq!(hello.client_instance_id, h.client.instance_id());
    assert!(matches!(
        h.client.phase(),
        Some(LinkPhase::Reconciling { .. })
    ));

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
    assert!(is_active(&h));

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
    assert_eq!(h.client.records(), 0);
    for issue in &issues {
        assert!(h.client.tombstoned(&id(issue)));
        assert_eq!(h.client.ledger().accepted()[&id(issue)], 1);
        assert_eq!(h.client.ledger().starts()[&id(issue)], 1);
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
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn never_accepts_or_starts_a_uuid_twice_across_crashes() {
    let mut cfg = config();
    cfg.max_running = 1;
    cfg.programs.max_step_ms = 1_000;
    cfg.programs.max_chunks = 5;
    let mut h = Harness::new(cfg, 2);
    h.connect();
    h.reconcile();
    let (a, s1) = h.dispatch_new("sleep 1");
    let (b, s2) = h.dispatch_new("sleep 2");
    assert_eq!(accepted(&s1).len() + accepted(&s2).len(), 2);
    let mut seen = s1;
    seen.extend(s2);
    // a runs, b waits (max_running 1); the acceptances were "lost": the
    // server never recorded them, and the daemon crashes
    assert!(matches!(
        h.client.launch_phase(&id(&a)),
        Some(LaunchPhase::Running(_))
    ));
    assert_eq!(h.client.launch_phase(&id(&b)), Some(LaunchPhase::Accepted));
    let conn = h.client.crash_restart(h.now);
    assert_eq!(conn, h.conn);
    h.conn = None;
    h.connect();
    let (chunks, after) = h.reconcile();
    let recs: Vec<&str> = chunks
        .iter()
        .flat_map(|c| c.records.iter().map(|r| r.issue_uuid.as_str()))
        .collect();
    let mut want = vec![a.as_str(), b.as_str()];
    want.sort_unstable();
    assert_eq!(recs, want, "snapshot lists both retained commands, sorted");
    // the authorized launch of before the crash ends interrupted, never
    // runs again
    seen.extend(after);
    // the server repeats both dispatches: idempotent, no new acceptance
    for issue in [&a, &b] {
        let again = h.redispatch(issue);
        let acc = accepted(&again);
        assert_eq!(acc[0].outcome, wire::AcceptOutcome::Positive as i32);
        seen.extend(again);
    }
    assert_eq!(h.client.core_stats().repeats, 2);
    seen.extend(h.advance(h.now + 30_000));
    assert_eq!(terminal_of(&seen, &a), Some(Lifecycle::Interrupted));
    // crash again mid-way, then finish everything
    h.client.crash_restart(h.now);
    h.conn = None;
    h.connect();
    let (_, after) = h.reconcile();
    seen.extend(after);
    h.run_to_quiet(seen, h.now + 120_000);
    assert_eq!(h.client.records(), 0);
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
    for i in [id(&a), id(&b)] {
        assert_eq!(ledger.accepted()[&i], 1);
        assert!(ledger.starts().get(&i).copied().unwrap_or(0) <= 1);
    }
    assert_eq!(ledger.starts()[&id(&a)], 1);
    // every event sent under one sequence had one content
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
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn windows_bound_unacknowledged_events_and_replay_resumes_after_durable() {
    let mut cfg = config();
    cfg.programs.max_chunks = 40;
    cfg.programs.max_chunk = 16_384;
    cfg.programs.max_step_ms = 0;
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
    // acknowledge part of the command with the most events in flight,
    // then lose the connection
    let counts = by_command(&evs);
    let first = counts
        .iter()
        .max_by_key(|(_, l)| l.len())
        .map(|(k, _)| k.clone())
        .unwrap();
    let firsts: Vec<&wire::CommandEvent> = evs.iter().filter(|e| e.issue_uuid == first).collect();
    let half = firsts[firsts.len() / 2].event_seq;
    h.deliver(Payload::EventAck(wire::EventAck {
        issue_uuid: first.clone(),
        durable_event_seq: half,
    }));
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
    // the capacity, and the replay of this command from half + 2
    assert!(
        after
            .iter()
            .any(|s| matches!(s.payload(), Some(Payload::ClientCapacity(_))))
    );
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
    assert_eq!(h.client.records(), 0);
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn snapshots_list_every_record_sorted_under_the_envelope_budget() {
    let mut cfg = config();
    cfg.max_running = 1;
    cfg.max_queued = 10;
    cfg.programs.max_step_ms = 100_000;
    let mut h = Harness::new(cfg, 4);
    h.connect();
    h.reconcile();
    for i in 0..5 {
        h.dispatch_new(&format!("true {i}"));
    }
    h.disconnect();
    h.connect();
    let (chunks, _) = h.reconcile();
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.chunk_index as usize, i);
        assert_eq!(c.final_chunk, i + 1 == chunks.len());
        assert_eq!(c.store_health, wire::ScopeState::Ready as i32);
        assert!(c.encoded_len() < 1 << 20);
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
    cfg.programs.max_chunks = 50;
    cfg.programs.max_step_ms = 1_000;
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
    seen.extend(h.advance(h.now + 1_000));
    let cmds = by_command(&events(&seen));
    let w = &cmds[&waiting];
    let Some(Body::Lifecycle(l)) = &w.last().unwrap().body else {
        panic!("{w:?}")
    };
    assert_eq!(l.lifecycle, wire::Lifecycle::Cancelled as i32);
    let r: Vec<_> = cmds[&running]
        .iter()
        .map(|e| e.body.clone().unwrap())
        .collect();
    let results: Vec<&wire::SignalResult> = r
        .iter()
        .filter_map(|b| match b {
            Body::SignalResult(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 1, "one result per revision: {r:?}");
    assert_eq!(results[0].revision, 2);
    assert_eq!(results[0].outcome, wire::SignalOutcome::Delivered as i32);
    assert!(matches!(&r[r.len() - 1], Body::Lifecycle(l)
        if l.lifecycle == wire::Lifecycle::Terminated as i32
            && l.exit_result.as_ref().unwrap().signal_name == "SIGKILL"));
    // the process got KILL once; the waiting command never ran
    let log = h.process.lock().unwrap();
    assert_eq!(
        log.get(&id(&running)).unwrap().signals,
        vec![wire::SignalKind::Kill]
    );
    assert!(log.get(&id(&waiting)).is_none());
    drop(log);
    assert!(!h.client.ledger().starts().contains_key(&id(&waiting)));
}

#[test]
fn reconcile_terminates_and_discards_what_the_server_lacks() {
    let mut cfg = config();
    cfg.programs.max_step_ms = 100_000;
    cfg.programs.max_chunks = 10;
    let mut h = Harness::new(cfg, 6);
    h.connect();
    h.reconcile();
    let (issue, _) = h.dispatch_new("sleep 1000");
    // the server forgets it (e.g. restored from an older backup)
    h.server.clear();
    h.disconnect();
    h.connect();
    let (_, after) = h.reconcile();
    assert!(
        events(&after).is_empty(),
        "nothing is sent for it: {after:?}"
    );
    let later = h.advance(h.now + 1_000);
    assert!(events(&later).is_empty(), "{later:?}");
    // the tree was killed, and the record finished into a tombstone
    let log = h.process.lock().unwrap();
    assert_eq!(
        log.get(&id(&issue)).unwrap().signals,
        vec![wire::SignalKind::Kill]
    );
    drop(log);
    assert_eq!(h.client.records(), 0);
    assert!(h.client.tombstoned(&id(&issue)));
    // the next round knows nothing of it either; nothing is sent for it
    h.disconnect();
    h.connect();
    let (chunks, after) = h.reconcile();
    assert!(chunks.iter().all(|c| c.records.is_empty()));
    assert!(events(&after).is_empty(), "{after:?}");
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
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
    assert_eq!(h.client.link_stats().violations, 1);
    assert!(is_backoff(&h));
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
    assert!(is_backoff(&h));
}

fn adversarial(kind: Adversary, seed: u64) -> Harness {
    let mut cfg = config();
    cfg.adversary = Some(kind);
    cfg.adversary_permille = 1000;
    cfg.programs.max_chunk = 65_536;
    cfg.programs.max_chunks = 20;
    cfg.programs.max_step_ms = 0;
    let mut h = Harness::new(cfg, seed);
    h.connect();
    h.reconcile();
    h
}

/// The adversary layer adds frames to the real client's own; it never
/// changes what the client sent.
#[test]
fn the_adversary_layer_misbehaves_once_per_session_on_the_real_clients_frames() {
    // stale generation: an envelope with the previous generation
    let mut h = adversarial(Adversary::StaleGeneration, 10);
    let _ = h.dispatch_new("x");
    assert!(
        h.log
            .iter()
            .any(|s| matches!(s, Seen::Env(e) if e.generation + 1 == h.generation))
    );
    assert_eq!(h.client.counters().misbehaviours, 1);
    let _ = h.dispatch_new("y");
    assert_eq!(h.client.counters().misbehaviours, 1, "once per session");

    // malformed bytes: a frame that is no envelope of this session
    let mut h = adversarial(Adversary::MalformedBytes, 11);
    let _ = h.dispatch_new("x");
    assert_eq!(h.client.counters().misbehaviours, 1);
    assert!(h.log.iter().any(|s| match s {
        Seen::Raw(_) => true,
        Seen::Env(e) => e.session_id != h.session_id,
        _ => false,
    }));

    // conflicting and exact duplicates: the same (issue, seq), other or
    // the same content
    for (kind, conflicting) in [
        (Adversary::ConflictingDuplicate, true),
        (Adversary::ExactDuplicate, false),
    ] {
        let mut h = adversarial(kind, 12);
        let (_, mut seen) = h.dispatch_new("x");
        seen.extend(h.advance(h.now + 10));
        let evs = events(&h.log);
        let mut by_seq: BTreeMap<(String, u64), Vec<[u8; 32]>> = BTreeMap::new();
        for e in &evs {
            by_seq
                .entry((e.issue_uuid.clone(), e.event_seq))
                .or_default()
                .push(content_digest(e).unwrap());
        }
        let repeated: Vec<&Vec<[u8; 32]>> = by_seq.values().filter(|d| d.len() > 1).collect();
        assert_eq!(repeated.len(), 1, "{kind:?}: one event sent twice");
        assert_eq!(
            repeated[0].iter().any(|x| *x != repeated[0][0]),
            conflicting,
            "{kind:?}"
        );
    }

    // window overrun: more unacknowledged bytes for one command than the
    // server's window
    let mut h = adversarial(Adversary::WindowOverrun, 13);
    let mut issues = Vec::new();
    for _ in 0..10 {
        let (issue, mut seen) = h.dispatch_new("x");
        issues.push(issue);
        seen.extend(h.advance(h.now + 10));
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
    let sent = per_issue.values().copied().max().unwrap();
    assert!(sent > 1 << 20, "only {sent} bytes");
}

#[test]
fn a_second_instance_has_its_own_identity() {
    let h = Harness::new(config(), 14);
    let dir = tempfile::tempdir().unwrap();
    let (instance, hello) = h
        .client
        .twin_hello(Seeds::new(14).client(1), dir.path().join("twin"))
        .unwrap();
    assert_ne!(instance, h.client.instance_id());
    let env = wire::Envelope::decode(hello.as_slice()).unwrap();
    let Some(Payload::ClientHello(hello)) = env.payload else {
        panic!("not a hello: {env:?}")
    };
    assert_eq!(hello.client_id, h.client.client_id());
    assert_eq!(hello.client_instance_id, instance);
    check_hello(&hello);
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
        // the hello names the host's working directory, a fresh temporary
        // directory each run: everything else must be the same
        let log: Vec<Seen> = h
            .log
            .iter()
            .cloned()
            .map(|s| match s {
                Seen::Env(mut e) => {
                    if let Some(Payload::ClientHello(hello)) = e.payload.as_mut() {
                        hello.cwd_policy = None;
                    }
                    Seen::Env(e)
                }
                other => other,
            })
            .collect();
        (log, *h.client.counters(), h.client.instance_id().to_owned())
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    assert!(a.0.len() > 10);
}

// ---- script uploads --------------------------------------------------------

/// The largest raw script chunk.
const SCRIPT_CHUNK: usize = 262_144;
/// The server's per-command script window (bytes beyond the last
/// `received_bytes` in flight).
const SCRIPT_WINDOW: usize = 1_048_576;

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
    let hash = command_hash(&h.client_id(), &check_execution_spec(&spec).unwrap())
        .0
        .to_vec();
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

fn started(h: &Harness, issue: &str) -> bool {
    h.client.ledger().starts().contains_key(&id(issue))
}

#[test]
fn a_script_reports_its_durable_prefix_commits_then_launches_once() {
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
    assert!(
        events(&seen).is_empty(),
        "launched before the upload: {seen:?}"
    );
    assert_eq!(
        h.client.launch_phase(&id(&issue)),
        Some(LaunchPhase::Accepted)
    );
    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 0, SCRIPT_CHUNK));
    seen.extend(send_chunk(
        &mut h,
        chunk(&issue, &body, SCRIPT_CHUNK, SCRIPT_CHUNK),
    ));
    let st = statuses(&seen);
    assert!(!st.is_empty(), "no progress reported");
    assert!(
        st.windows(2)
            .all(|w| w[0].received_bytes <= w[1].received_bytes)
    );
    assert!(
        st.iter()
            .all(|s| s.state == wire::ScriptUploadState::Receiving as i32
                && s.received_bytes as usize <= 2 * SCRIPT_CHUNK)
    );
    // a text command behind it runs; the script does not before its
    // commit (no launch before the whole is verified)
    let (text, s) = h.dispatch_new("echo behind");
    seen.extend(s);
    seen.extend(h.advance(h.now + 60_000));
    h.ack_all(&seen);
    assert!(started(&h, &text));
    assert!(!started(&h, &issue));
    assert!(events(&seen).iter().all(|e| e.issue_uuid != issue));
    // the last chunk: COMMITTED with the size, then RUNNING
    let seen = send_chunk(
        &mut h,
        chunk(&issue, &body, 2 * SCRIPT_CHUNK, 600_000 - 2 * SCRIPT_CHUNK),
    );
    let st = statuses(&seen);
    let last = st.last().expect("no status");
    assert_eq!(last.received_bytes, 600_000);
    assert_eq!(last.state, wire::ScriptUploadState::Committed as i32);
    h.advance(h.now + 1_000);
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().scripts_committed, 1);
    // a chunk after the commit stores nothing and is answered COMMITTED
    let again = send_chunk(&mut h, chunk(&issue, &body, 0, 10));
    let st = statuses(&again);
    assert!(
        st.iter()
            .all(|s| s.state == wire::ScriptUploadState::Committed as i32),
        "{st:?}"
    );
    let seen = h.advance(h.now + 60_000);
    h.run_to_quiet(seen, h.now + 60_000);
    assert_eq!(h.client.ledger().starts()[&id(&issue)], 1);
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn exact_replays_of_script_bytes_are_accepted_and_may_extend_the_prefix() {
    let mut h = Harness::new(config(), 21);
    h.connect();
    h.reconcile();
    let body = script_body(5_000, 2);
    let (issue, _) = dispatch_script(&mut h, &body);
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    // the same chunk again, a chunk inside the prefix, a chunk
    // overlapping it exactly and running past it, a zstd chunk
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    send_chunk(&mut h, chunk(&issue, &body, 200, 300));
    send_chunk(&mut h, chunk(&issue, &body, 500, 1_500));
    let mut z = chunk(&issue, &body, 2_000, 1_000);
    z.compression = wire::Compression::Zstd as i32;
    z.payload = zstd::bulk::compress(&body[2_000..3_000], 3).unwrap();
    z.stored_length = z.payload.len() as u32;
    send_chunk(&mut h, z);
    assert_eq!(h.client.counters().script_chunk_replays, 3);
    assert!(!started(&h, &issue));
    let seen = send_chunk(&mut h, chunk(&issue, &body, 3_000, 2_000));
    assert_eq!(
        statuses(&seen).last().map(|s| (s.received_bytes, s.state)),
        Some((5_000, wire::ScriptUploadState::Committed as i32))
    );
    h.advance(h.now + 1_000);
    assert!(started(&h, &issue));
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn a_changed_overlap_or_a_hole_closes_the_session_and_keeps_the_prefix() {
    let mut h = Harness::new(config(), 22);
    h.connect();
    h.reconcile();
    let body = script_body(10_000, 3);
    let (issue, _) = dispatch_script(&mut h, &body);
    send_chunk(&mut h, chunk(&issue, &body, 0, 4_000));
    // a changed overlap: consistent in itself (its own SHA-256 matches)
    let mut other = body.clone();
    other[3_500] ^= 0xff;
    let seen = send_chunk(&mut h, chunk(&issue, &other, 3_000, 2_000));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    assert!(is_backoff(&h));
    h.conn = None;
    // after the reconnect the snapshot reports the untouched prefix
    h.connect();
    let (chunks, _) = h.reconcile();
    assert_eq!(chunks[0].records[0].script_received_bytes, 4_000);
    // a hole: an offset past the prefix
    let seen = send_chunk(&mut h, chunk(&issue, &body, 5_000, 1_000));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    h.conn = None;
    h.connect();
    let (chunks, _) = h.reconcile();
    assert_eq!(chunks[0].records[0].script_received_bytes, 4_000);
    // the honest rest still commits and launches
    let seen = serve_script(&mut h, &issue, &body, 4_000);
    assert!(!seen.contains(&Seen::Close(1002)));
    h.advance(h.now + 1_000);
    assert!(started(&h, &issue));
}

#[test]
fn malformed_script_chunks_close_the_session_and_change_nothing() {
    let mut h = Harness::new(config(), 23);
    h.connect();
    h.reconcile();
    let body = script_body(300_000, 4);
    let (issue, _) = dispatch_script(&mut h, &body);
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    let good = || chunk(&issue, &body, 1_000, 1_000);
    type Edit = Box<dyn Fn(&mut wire::ScriptChunk)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "unspecified compression",
            Box::new(|c| c.compression = wire::Compression::Unspecified as i32),
        ),
        ("unknown compression", Box::new(|c| c.compression = 9)),
        ("stored_length", Box::new(|c| c.stored_length += 1)),
        (
            "raw_length above the payload",
            Box::new(|c| c.raw_length += 1),
        ),
        ("raw_length 0", Box::new(|c| c.raw_length = 0)),
        ("raw_sha256", Box::new(|c| c.raw_sha256[0] ^= 1)),
        ("raw_sha256 length", Box::new(|c| c.raw_sha256.truncate(31))),
        ("declared_size", Box::new(|c| c.declared_size += 1)),
        (
            "past the declared size",
            Box::new(|c| c.offset = 300_000 - 999),
        ),
        ("offset overflow", Box::new(|c| c.offset = u64::MAX - 10)),
        (
            "zstd that is not zstd",
            Box::new(|c| c.compression = wire::Compression::Zstd as i32),
        ),
        (
            "zstd larger than raw_length",
            Box::new(|c| {
                let bigger = vec![7u8; 2_000];
                c.compression = wire::Compression::Zstd as i32;
                c.payload = zstd::bulk::compress(&bigger, 3).unwrap();
                c.stored_length = c.payload.len() as u32;
            }),
        ),
    ];
    for (name, edit) in &cases {
        let mut c = good();
        edit(&mut c);
        let seen = send_chunk(&mut h, c);
        assert!(seen.contains(&Seen::Close(1002)), "{name}: {seen:?}");
        assert!(statuses(&seen).is_empty(), "{name}");
        h.conn = None;
        h.connect();
        let (chunks, _) = h.reconcile();
        assert_eq!(chunks[0].records[0].script_received_bytes, 1_000, "{name}");
    }
    // a raw chunk above 256 KiB
    let seen = send_chunk(&mut h, chunk(&issue, &body, 1_000, SCRIPT_CHUNK + 1));
    assert!(seen.contains(&Seen::Close(1002)), "{seen:?}");
    h.conn = None;
    h.connect();
    h.reconcile();
    assert!(!started(&h, &issue));
    assert_eq!(h.client.counters().script_chunks_accepted, 1);
}

#[test]
fn a_wrong_whole_script_never_launches() {
    let mut h = Harness::new(config(), 24);
    h.connect();
    h.reconcile();
    let body = script_body(2_000, 5);
    // the descriptor promises other bytes of the same length
    let mut promised = body.clone();
    promised[0] ^= 1;
    let (issue, _) = dispatch_script(&mut h, &promised);
    send_chunk(&mut h, chunk(&issue, &body, 0, 1_000));
    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 1_000, 1_000));
    seen.extend(h.advance(h.now + 60_000));
    assert_eq!(h.client.counters().scripts_committed, 0);
    assert!(
        statuses(&seen)
            .iter()
            .all(|s| s.state != wire::ScriptUploadState::Committed as i32),
        "{seen:?}"
    );
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
    let mut seen = h.deliver(Payload::Signal(wire::Signal {
        issue_uuid: issue.clone(),
        revision: 2,
        signal: wire::SignalKind::Term as i32,
    }));
    seen.extend(h.advance(h.now + 1_000));
    assert_eq!(terminal_of(&seen, &issue), Some(Lifecycle::Cancelled));
    let _ = send_chunk(&mut h, chunk(&issue, &body, 50_000, 50_000));
    h.advance(h.now + 60_000);
    assert!(!started(&h, &issue));
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}

#[test]
fn script_state_survives_a_crash_and_the_snapshot_reports_the_prefix() {
    let mut h = Harness::new(config(), 26);
    h.connect();
    h.reconcile();
    let body = script_body(700_000, 7);
    let (issue, _) = dispatch_script(&mut h, &body);
    let (text, _) = h.dispatch_new("sleep 1");
    send_chunk(&mut h, chunk(&issue, &body, 0, SCRIPT_CHUNK));
    send_chunk(&mut h, chunk(&issue, &body, SCRIPT_CHUNK, 37_856));
    h.client.crash_restart(h.now);
    h.conn = None;
    h.connect();
    let (chunks, after) = h.reconcile();
    let by_id: BTreeMap<&str, u64> = chunks
        .iter()
        .flat_map(|c| c.records.iter())
        .map(|r| (r.issue_uuid.as_str(), r.script_received_bytes))
        .collect();
    assert_eq!(by_id[issue.as_str()], 300_000);
    assert_eq!(by_id[text.as_str()], 0);
    assert!(events(&after).iter().all(|e| e.issue_uuid != issue));
    // the server resumes from the reported prefix (one replayed chunk
    // first, as after a re-acceptance)
    let mut seen = send_chunk(&mut h, chunk(&issue, &body, 200_000, 100_000));
    seen.extend(serve_script(&mut h, &issue, &body, 300_000));
    h.advance(h.now + 1_000);
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().script_chunk_replays, 1);
    // once committed, a crash keeps it committed and reports the size
    h.client.crash_restart(h.now);
    h.conn = None;
    h.connect();
    let (chunks, _) = h.reconcile();
    let rec = chunks
        .iter()
        .flat_map(|c| c.records.iter())
        .find(|r| r.issue_uuid == issue)
        .unwrap();
    assert_eq!(rec.script_received_bytes, 700_000);
    assert_eq!(h.client.ledger().starts()[&id(&issue)], 1);
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
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
    assert_eq!(h.client.counters().script_chunks_accepted, 6);
    assert_eq!(
        st.last().map(|s| (s.received_bytes, s.state)),
        Some((1_500_000, wire::ScriptUploadState::Committed as i32))
    );
    assert!(
        st.iter()
            .all(|s| s.issue_uuid == issue && s.error.is_none())
    );
    for s in &h.log {
        if let Seen::Env(e) = s {
            assert!(e.encoded_len() <= 1 << 20);
        }
    }
    h.advance(h.now + 1_000);
    assert!(started(&h, &issue));
    assert_eq!(h.client.counters().scripts_committed, 1);
    let all = h.log.clone();
    h.run_to_quiet(all, h.now + 60_000);
    assert!(h.client.tombstoned(&id(&issue)));
    assert_eq!(
        h.client.counters().server_violations,
        0,
        "{:?}",
        h.client.violation_notes()
    );
}
