//! The spool core over the real client store (plan §7.1-§7.2): output
//! compressed into checksummed segment records, sequences assigned and
//! pinned in SQLite, read back verified, kept across restarts, released by
//! acknowledgements; and a power cut at every spool commit point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use rvbox_client_core::spool::{
    SEGMENT_RAW_BYTES, Spool, SpoolCompletion, SpoolLimits, SpoolOutput,
};
use rvbox_client_store::crash;
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions, LocalHealth};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_storage::crash::NoCrash;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::{CrashMode, FaultyFs, StoreFs};
use support::{NOW, StopAt, checked, open, policy};

const OUT: wire::OutputStream = wire::OutputStream::Stdout;
const ERR: wire::OutputStream = wire::OutputStream::Stderr;

/// Runs the spool's outputs against the store until nothing is left;
/// collects what was sent and what finished.
fn run(
    spool: &mut Spool,
    store: &mut ClientStore,
    sent: &mut Vec<wire::CommandEvent>,
    finished: &mut Vec<Uuid7>,
) {
    let mut steps = 0u32;
    while let Some(o) = spool.poll_output() {
        steps += 1;
        assert!(steps < 1_000_000, "the spool never settles");
        match o {
            SpoolOutput::Store(op) => {
                let done = store.perform_spool(&op, NOW);
                spool.completed(op.token(), done);
            }
            SpoolOutput::Send {
                issue,
                first_seq,
                last_seq,
            } => {
                let evs = store.read_events(&issue, first_seq, last_seq).unwrap();
                assert_eq!(evs.len() as u64, last_seq - first_seq + 1);
                sent.extend(evs);
            }
            SpoolOutput::Finished { issue } => {
                store.finish_acknowledged(&issue, NOW).unwrap();
                finished.push(issue);
            }
            SpoolOutput::Unaccountable { issue, .. } => panic!("{issue} unaccountable"),
            SpoolOutput::TerminalDurable { .. } => {}
        }
    }
}

fn chunk(n: u32, len: usize, random: bool) -> Vec<u8> {
    let mut x = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|i| {
            if random {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x & 0xff) as u8
            } else {
                b"abcdefgh"[(i + n as usize) % 8]
            }
        })
        .collect()
}

/// The raw bytes of the sent output events, per stream, checked in order.
fn raw_of(sent: &[wire::CommandEvent]) -> BTreeMap<i32, Vec<u8>> {
    let mut out: BTreeMap<i32, Vec<u8>> = BTreeMap::new();
    let mut seqs: BTreeMap<String, u64> = BTreeMap::new();
    for ev in sent {
        let last = seqs.entry(ev.issue_uuid.clone()).or_insert(0);
        if ev.event_seq <= *last {
            continue; // a replay after a reconnect
        }
        assert_eq!(ev.event_seq, *last + 1, "sequences are contiguous");
        *last = ev.event_seq;
        if let Some(Body::Output(c)) = &ev.body {
            assert_eq!(c.stored_length as usize, c.payload.len());
            let raw = zstd::bulk::decompress(&c.payload, c.raw_length as usize).unwrap();
            assert_eq!(raw.len(), c.raw_length as usize);
            out.entry(c.stream).or_default().extend(raw);
        }
    }
    out
}

fn accepted(store: &mut ClientStore, n: u32) -> Uuid7 {
    let d = checked(n, "echo spool");
    store.accept(&policy(), &d, NOW).unwrap();
    d.issue
}

fn ack_everything(spool: &mut Spool, sent: &[wire::CommandEvent]) {
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for ev in sent {
        let e = last.entry(ev.issue_uuid.clone()).or_insert(0);
        *e = (*e).max(ev.event_seq);
    }
    for (id, seq) in last {
        let id = Uuid7::parse("t", &id).unwrap();
        let _ = spool.on_ack(id, seq);
    }
}

fn lifecycle(l: wire::Lifecycle) -> Body {
    Body::Lifecycle(wire::LifecycleChange {
        lifecycle: l as i32,
        ..Default::default()
    })
}

#[test]
fn output_round_trips_byte_for_byte_and_survives_a_restart_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let id = accepted(&mut store, 1);
    let mut spool = Spool::new(SpoolLimits::default());
    spool.open_command(id).unwrap();
    let (mut sent, mut finished) = (Vec::new(), Vec::new());
    let mut want: BTreeMap<i32, Vec<u8>> = BTreeMap::new();
    spool
        .event(id, NOW, lifecycle(wire::Lifecycle::Running))
        .unwrap();
    for n in 0..40u32 {
        let (stream, bytes) = if n % 3 == 0 {
            (ERR, chunk(n, 1 + (n as usize * 997) % 65_536, true))
        } else {
            (OUT, chunk(n, 40_000, false))
        };
        want.entry(stream as i32).or_default().extend(&bytes);
        spool.output(id, stream, NOW + i64::from(n), bytes).unwrap();
        run(&mut spool, &mut store, &mut sent, &mut finished);
    }
    spool.session_active(&BTreeMap::new());
    run(&mut spool, &mut store, &mut sent, &mut finished);
    assert_eq!(store.counters().unwrap(), store.recount().unwrap());
    let first_pass = sent.clone();
    assert!(!first_pass.is_empty());

    // restart before any acknowledgement: the same sequences, the same bytes
    drop(spool);
    drop(store);
    let mut store = open(dir.path());
    assert_eq!(store.health().unwrap(), LocalHealth::Ready);
    let mut spool = Spool::new(SpoolLimits::default());
    for c in store.restore_spool().unwrap() {
        spool.restore(c).unwrap();
    }
    let mut again = Vec::new();
    spool.session_active(&BTreeMap::new());
    run(&mut spool, &mut store, &mut again, &mut finished);
    assert_eq!(
        again.get(..first_pass.len()),
        Some(first_pass.as_slice()),
        "pinned events are immutable on retry"
    );
    for _ in 0..20 {
        ack_everything(&mut spool, &again);
        run(&mut spool, &mut store, &mut again, &mut finished);
    }
    assert_eq!(raw_of(&again), want, "every byte, in order, per stream");
    spool
        .event(id, NOW, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    run(&mut spool, &mut store, &mut again, &mut finished);
    ack_everything(&mut spool, &again);
    run(&mut spool, &mut store, &mut again, &mut finished);
    assert_eq!(finished, vec![id]);
    assert!(store.tombstone(&id).unwrap().is_some());
    let left = std::fs::read_dir(dir.path().join("spool")).unwrap().count();
    assert_eq!(left, 0, "no history remains after the ack and cleanup");
    let c = store.counters().unwrap();
    assert_eq!((c.commands, c.stored_bytes), (0, 0));
    assert_eq!(c, store.recount().unwrap());
}

#[test]
fn a_damaged_committed_record_is_sent_as_an_exact_marker_and_the_store_is_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let id = accepted(&mut store, 1);
    let mut spool = Spool::new(SpoolLimits::default());
    spool.open_command(id).unwrap();
    let (mut sent, mut finished) = (Vec::new(), Vec::new());
    spool.output(id, OUT, NOW, chunk(1, 5000, true)).unwrap();
    run(&mut spool, &mut store, &mut sent, &mut finished);
    drop(spool);
    drop(store);
    // flip a payload byte inside the committed record
    let seg = std::fs::read_dir(dir.path().join("spool"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[200] ^= 0x40;
    std::fs::write(&seg, &bytes).unwrap();
    let mut store = open(dir.path());
    assert_eq!(store.health().unwrap(), LocalHealth::Dirty);
    assert_eq!(store.recovery_report().segments_damaged, 1);
    assert_eq!(
        store.reconcile_health().unwrap(),
        wire::ScopeState::Ready,
        "damaged output is not essential: the client keeps working"
    );
    let mut spool = Spool::new(SpoolLimits::default());
    for c in store.restore_spool().unwrap() {
        spool.restore(c).unwrap();
    }
    spool.session_active(&BTreeMap::new());
    // the assignment succeeds (metadata); the read-back finds the damage
    // and sends an explicit gap of exactly the record's bytes in its place,
    // so the session (and every other command) goes on
    while let Some(o) = spool.poll_output() {
        match o {
            SpoolOutput::Store(op) => {
                let done = store.perform_spool(&op, NOW);
                spool.completed(op.token(), done);
            }
            SpoolOutput::Send {
                issue,
                first_seq,
                last_seq,
            } => {
                let events = store.read_events(&issue, first_seq, last_seq).unwrap();
                assert_eq!(events.len(), 1);
                assert_eq!(events[0].event_seq, first_seq);
                match &events[0].body {
                    Some(Body::Truncation(t)) => {
                        assert_eq!(t.source, wire::TruncationSource::ClientSpool as i32);
                        assert_eq!(t.streams, vec![OUT as i32]);
                        assert_eq!(t.raw_bytes, 5000, "exactly the damaged record's bytes");
                        assert_eq!(t.first_removed_event_seq, Some(first_seq));
                        assert_eq!(t.last_removed_event_seq, Some(first_seq));
                    }
                    other => panic!("damaged output was sent as {other:?}"),
                }
                assert_eq!(store.health().unwrap(), LocalHealth::Dirty);
                return;
            }
            other => panic!("{other:?}"),
        }
    }
    panic!("nothing was sent");
}

/// One workload on the fault-injecting filesystem with a crash at `point`
/// (its `nth` hit), then a power cut, a reopen, and the checks.
fn crash_case(point: &'static str, nth: u32) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let open_on = |hook: Arc<dyn rvbox_storage::crash::CrashHook>| {
        ClientStore::open_with_hook(
            ClientLayout::new(&root),
            fs.clone() as Arc<dyn StoreFs>,
            Arc::new(OsEntropy),
            hook,
            ClientStoreOptions::default(),
            NOW,
        )
        .unwrap()
    };
    let limits = SpoolLimits {
        output_window: 2 * SEGMENT_RAW_BYTES,
        ..SpoolLimits::default()
    };
    let mut store = open_on(Arc::new(NoCrash));
    let id = accepted(&mut store, 1);
    store.set_crash_hook(Arc::new(StopAt::nth(point, nth)));
    let mut spool = Spool::new(limits);
    spool.open_command(id).unwrap();
    let mut sent = Vec::new();
    let mut finished = Vec::new();
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for n in 0..64u32 {
            spool
                .output(id, OUT, NOW, chunk(n, 64 * 1024, true))
                .unwrap();
            if n % 8 == 7 {
                spool
                    .event(id, NOW, Body::StdinAck(wire::StdinAck::default()))
                    .unwrap();
            }
            run(&mut spool, &mut store, &mut sent, &mut finished);
            if n == 40 {
                spool.session_active(&BTreeMap::new());
            }
            if n > 40 {
                ack_everything(&mut spool, &sent);
            }
            run(&mut spool, &mut store, &mut sent, &mut finished);
        }
    }));
    assert!(crashed.is_err(), "{point} #{nth} was never reached");
    store.close_as_crashed();
    drop(spool);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let mut store = open_on(Arc::new(NoCrash));
    assert_eq!(
        store.health().unwrap(),
        LocalHealth::Ready,
        "{point}: a crash leaves no damage"
    );
    assert_eq!(
        store.counters().unwrap(),
        store.recount().unwrap(),
        "{point}"
    );
    // everything restored is readable, and the command still completes
    let mut spool = Spool::new(limits);
    for c in store.restore_spool().unwrap() {
        spool.restore(c).unwrap();
    }
    let mut resent = Vec::new();
    spool.session_active(&BTreeMap::new());
    run(&mut spool, &mut store, &mut resent, &mut finished);
    // what was sent before the crash is sent again unchanged where pinned
    for ev in &resent {
        if let Some(before) = sent.iter().find(|e| e.event_seq == ev.event_seq) {
            assert_eq!(before, ev, "{point}: seq {} changed", ev.event_seq);
        }
    }
    spool
        .event(id, NOW, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    for _ in 0..100 {
        run(&mut spool, &mut store, &mut resent, &mut finished);
        ack_everything(&mut spool, &resent);
        if !finished.is_empty() {
            break;
        }
    }
    run(&mut spool, &mut store, &mut resent, &mut finished);
    assert_eq!(finished, vec![id], "{point}");
    let mut all = sent.clone();
    all.extend(resent);
    let _ = raw_of(&all); // contiguous across the crash
    assert_eq!(
        store.counters().unwrap(),
        store.recount().unwrap(),
        "{point}"
    );
    let left = std::fs::read_dir(root.join("spool")).unwrap().count();
    assert_eq!(left, 0, "{point}: no debris");
}

#[test]
fn a_power_cut_at_every_spool_commit_point_loses_nothing_committed() {
    for (point, nth) in [
        (crash::SPOOL_SEGMENT_AFTER_CREATE, 2),
        (crash::SPOOL_APPEND_BEFORE_FSYNC, 5),
        (crash::SPOOL_APPEND_AFTER_FSYNC, 5),
        (crash::SPOOL_APPEND_AFTER_COMMIT, 5),
        (crash::SPOOL_EVENT_BEFORE_COMMIT, 2),
        (crash::SPOOL_EVENT_AFTER_COMMIT, 2),
        (crash::SPOOL_ASSIGN_AFTER_COMMIT, 2),
        (crash::SPOOL_RELEASE_AFTER_COMMIT, 2),
        (crash::SPOOL_ROTATE_BEFORE_COMMIT, 1),
        (crash::SPOOL_ROTATE_AFTER_COMMIT, 1),
    ] {
        crash_case(point, nth);
    }
}

#[test]
fn a_spool_write_that_fails_makes_local_health_dirty_with_an_incident_for_the_command() {
    use rvbox_storage::fs::{FaultKind, FaultOp};
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultyFs::new());
    let mut store = ClientStore::open(
        ClientLayout::new(dir.path().join("state")),
        fs.clone() as Arc<dyn StoreFs>,
        Arc::new(OsEntropy),
        ClientStoreOptions::default(),
        NOW,
    )
    .unwrap();
    let id = accepted(&mut store, 1);
    let mut spool = Spool::new(SpoolLimits::default());
    spool.open_command(id).unwrap();
    spool.output(id, OUT, NOW, chunk(1, 4096, true)).unwrap();
    fs.inject(FaultOp::Append, FaultKind::NoSpace);
    let mut failed = Vec::new();
    while let Some(o) = spool.poll_output() {
        if let SpoolOutput::Store(op) = o {
            let done = store.perform_spool(&op, NOW);
            failed.push(done == SpoolCompletion::Failed);
            spool.completed(op.token(), done);
        }
    }
    // the output append failed; the exact marker in its place did not
    assert_eq!(
        failed,
        vec![true, false],
        "the append failed, then its marker was stored"
    );
    assert_eq!(store.health().unwrap(), LocalHealth::Dirty);
    let incidents = store.incidents().unwrap();
    assert_eq!(incidents.len(), 1, "{incidents:?}");
    assert_eq!(incidents[0].kind, wire::IncidentKind::DiskExhaustion);
    assert_eq!(incidents[0].scope_kind, wire::ScopeKind::Command);
    assert_eq!(incidents[0].scope_key, id.to_string());
}

#[test]
fn a_crash_in_loss_mode_still_ends_in_a_marker_of_the_recorded_totals() {
    use rvbox_client_core::spool::LOSS_RECORD_STEP;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let open_fs = || support::open_on(&root, fs.clone() as Arc<dyn StoreFs>, Arc::new(NoCrash));
    let mut store = open_fs();
    let id = accepted(&mut store, 1);
    let mut spool = Spool::new(SpoolLimits::default());
    spool.open_command(id).unwrap();
    let (mut sent, mut finished) = (Vec::new(), Vec::new());
    // nothing is made durable while the child writes: the backlog passes
    // the 1 MiB high watermark and output is dropped, over two seconds
    let mut dropped = 0u64;
    for (n, at) in (0..60u32).map(|n| (n, NOW + i64::from(n) * 50)) {
        let bytes = chunk(n, 64 * 1024, true);
        let len = bytes.len() as u64;
        if spool.output(id, OUT, at, bytes).unwrap() == rvbox_client_core::spool::Taken::Dropped {
            dropped += len;
        }
    }
    assert!(dropped > LOSS_RECORD_STEP, "{dropped}");
    run(&mut spool, &mut store, &mut sent, &mut finished);
    // the daemon dies in loss mode, before any marker
    store.close_as_crashed();
    drop(spool);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let mut store = open_fs();
    let restored = store.restore_spool().unwrap();
    let run_of = restored[0]
        .loss_run
        .clone()
        .expect("the open loss run was recorded");
    assert_eq!(run_of.source, wire::TruncationSource::ClientOverload as i32);
    assert!(
        run_of.raw_bytes <= dropped && run_of.raw_bytes + LOSS_RECORD_STEP >= dropped,
        "recorded {} of {dropped}",
        run_of.raw_bytes
    );
    assert!(
        run_of.raw_bytes > 64 * 1024,
        "it was recorded again as it grew"
    );
    // the restart closes it into its marker before the command's next event
    let mut spool = Spool::new(SpoolLimits::default());
    for c in restored {
        spool.restore(c).unwrap();
    }
    spool
        .event(id, NOW + 10_000, lifecycle(wire::Lifecycle::Interrupted))
        .unwrap();
    spool.session_active(&BTreeMap::new());
    for _ in 0..100 {
        run(&mut spool, &mut store, &mut sent, &mut finished);
        if sent
            .iter()
            .any(|e| matches!(e.body, Some(Body::Lifecycle(_))))
        {
            break;
        }
        ack_everything(&mut spool, &sent);
    }
    let bodies: Vec<&Body> = sent.iter().filter_map(|e| e.body.as_ref()).collect();
    let kinds: Vec<&str> = bodies
        .iter()
        .map(|b| match b {
            Body::Output(_) => "output",
            Body::Truncation(_) => "marker",
            Body::Lifecycle(_) => "lifecycle",
            _ => "other",
        })
        .collect();
    let n = bodies.len();
    assert!(n >= 2, "{kinds:?}");
    match (bodies[n - 2], bodies[n - 1]) {
        (Body::Truncation(t), Body::Lifecycle(_)) => {
            assert_eq!(t.raw_bytes, run_of.raw_bytes);
            assert_eq!(t.source, wire::TruncationSource::ClientOverload as i32);
        }
        _ => panic!("{kinds:?}"),
    }
    // and nothing is recorded any more
    assert!(store.restore_spool().unwrap()[0].loss_run.is_none());
}

#[test]
fn stdin_writes_are_stored_only_in_order_so_a_failed_one_is_never_skipped() {
    use rvbox_client_core::ops::StdinOutcome;
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let id = accepted(&mut store, 1);
    let write = |seq: u64, bytes: &[u8]| wire::StdinWrite {
        issue_uuid: id.to_string(),
        write_seq: seq,
        compression: wire::Compression::None as i32,
        payload: bytes.to_vec(),
        raw_length: bytes.len() as u32,
        stored_length: bytes.len() as u32,
        raw_sha256: rvbox_segment::sha256(bytes).to_vec(),
        newline: wire::StdinNewline::Raw as i32,
        close_after: false,
    };
    // write 1 fails its digest: nothing is stored, and write 2 (already
    // sent behind it) is refused as out of order
    let mut bad = write(1, b"one");
    bad.raw_sha256[0] ^= 1;
    assert!(matches!(
        store.stdin_write(&id, &bad).unwrap(),
        StdinOutcome::Invalid(_)
    ));
    let err = store.stdin_write(&id, &write(2, b"two")).unwrap_err();
    assert!(err.to_string().contains("not the next one"), "{err}");
    // resent in order, both are stored
    assert_eq!(
        store.stdin_write(&id, &write(1, b"one")).unwrap(),
        StdinOutcome::Stored(b"one".to_vec())
    );
    assert_eq!(
        store.stdin_write(&id, &write(2, b"two")).unwrap(),
        StdinOutcome::Stored(b"two".to_vec())
    );
    assert!(
        store.stdin_write(&id, &write(2, b"two")).is_err(),
        "no write twice"
    );
}
