#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Crash tests (plan §5.3, §5.6): a real child process is killed at each
//! named commit point of the append path, and after a restart every event
//! it reported acknowledged is intact, nothing it did not acknowledge was
//! ever reported durable, the counters equal a recount, and appending goes
//! on. A second suite simulates power cuts through the fault-injecting
//! filesystem, losing or tearing every un-synced byte.
//!
//! The child is this same test binary, re-run with `--exact crash_child`
//! and the crash point in its environment.

mod support;

use std::io::{BufRead, BufReader};
use std::panic::AssertUnwindSafe;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use rvbox_store::crash::{CrashHook, points};
use rvbox_store::fs::{CrashMode, FaultyFs, RealFs, StoreFs};
use rvbox_store::{Store, StoreOptions};
use support::*;

const CHILD_ENV: &str = "RVBOX_STORE_CRASH_CHILD";
const DIR_ENV: &str = "RVBOX_STORE_CRASH_DIR";
const ID_ENV: &str = "RVBOX_STORE_CRASH_ID";
const BATCH: u64 = 3;
const BATCHES: u64 = 12;
const CHUNK: usize = 1500;

/// Small segments, so new files (and the directory sync) happen often.
fn options() -> StoreOptions {
    StoreOptions {
        seal_bytes: 8 * 1024,
        ..StoreOptions::default()
    }
}

/// Aborts the process the `after`-th time `point` is reached.
#[derive(Debug)]
struct AbortAt {
    point: String,
    after: u32,
    hits: AtomicU32,
}

impl CrashHook for AbortAt {
    fn at(&self, point: &'static str) {
        if point == self.point && self.hits.fetch_add(1, Ordering::SeqCst) + 1 >= self.after {
            std::process::abort();
        }
    }
}

/// Panics (a power cut, in-process) the `after`-th time `point` is reached.
#[derive(Debug)]
struct StopAt {
    point: &'static str,
    after: u32,
    hits: AtomicU32,
}

impl CrashHook for StopAt {
    fn at(&self, point: &'static str) {
        if point == self.point && self.hits.fetch_add(1, Ordering::SeqCst) + 1 >= self.after {
            panic!("power cut at {point}");
        }
    }
}

/// Writes a line straight to the process's stdout (not the test harness's
/// capture buffer) and flushes it, so the parent sees it before any crash.
fn say(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

/// The sequence in an `ACK <seq>` line; the harness may print its own text
/// before it on the same line.
fn ack_of(line: &str) -> Option<u64> {
    line.find("ACK ")
        .and_then(|i| line.get(i + 4..))
        .map(|n| n.trim().parse().unwrap())
}

fn decode_id(text: &str) -> [u8; 16] {
    *uuid::Uuid::parse_str(text).unwrap().as_bytes()
}

/// The child: appends batches of output to every command named in its
/// environment (one group per batch: with four commands or more, a group
/// made durable by the group journal), printing `ACK <seq>` after each
/// batch the store reported durable, until the hook kills it.
#[test]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return; // only meaningful as a child process of the tests below
    };
    let (point, after) = spec.split_once('@').unwrap();
    let dir = std::env::var(DIR_ENV).unwrap();
    let ids: Vec<[u8; 16]> = std::env::var(ID_ENV)
        .unwrap()
        .split(',')
        .map(decode_id)
        .collect();
    let mut store = open_with(std::path::Path::new(&dir), Arc::new(RealFs), options());
    store.set_crash_hook(Arc::new(AbortAt {
        point: point.to_owned(),
        after: after.parse().unwrap(),
        hits: AtomicU32::new(0),
    }));
    // every command has the same durable sequence: each group holds all
    let mut next = last_seq(&store, &ids[0]) + 1;
    for _ in 0..BATCHES {
        let batch: Vec<_> = ids
            .iter()
            .flat_map(|id| (next..next + BATCH).map(|seq| output(id, seq, &chunk(seq, CHUNK))))
            .collect();
        let report = store.append_events(&batch, NOW).unwrap();
        let acked = ids.iter().map(|id| report.acked[id]).min().unwrap();
        say(&format!("ACK {acked}"));
        next += BATCH;
    }
    say("DONE");
}

fn prepare(dir: &std::path::Path) -> [u8; 16] {
    prepare_many(dir, 1)[0]
}

fn prepare_many(dir: &std::path::Path, n: usize) -> Vec<[u8; 16]> {
    let mut s = open_with(dir, Arc::new(RealFs), options());
    (0..n)
        .map(|i| running_command(&mut s, &format!("web-{i}")))
        .collect()
}

/// Everything a restart must show after a crash, given the highest
/// sequence the child reported acknowledged.
fn check_after_restart(dir: &std::path::Path, id: &[u8; 16], acked: u64) -> Store {
    let mut s = open_with(dir, Arc::new(RealFs), options());
    let durable = last_seq(&s, id);
    assert!(
        durable >= acked,
        "acknowledged {acked} but only {durable} is durable"
    );
    // every durable event reads back intact from its segment, contiguously
    let seqs = verify_output(&s, id);
    assert_eq!(seqs, (2..=durable).collect::<Vec<_>>());
    for seq in 2..=durable {
        let digest: Vec<u8> = s
            .db()
            .query_row(
                "SELECT content_sha256 FROM command_events WHERE issue_uuid = ?1 AND event_seq = ?2",
                rusqlite::params![id.as_slice(), i64::try_from(seq).unwrap()],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(
            digest,
            rvbox_segment::sha256(&chunk(seq, CHUNK)),
            "event {seq}"
        );
    }
    assert_counters(&s);
    // and the store goes on from there
    let next = durable + 1;
    let r = s
        .append_events(&[output(id, next, &chunk(next, CHUNK))], NOW)
        .unwrap();
    assert_eq!(r.acked[id], next);
    s
}

fn run_child(dir: &std::path::Path, id: &[u8; 16], point: &str, after: u32) -> (bool, u64) {
    run_child_many(dir, std::slice::from_ref(id), point, after)
}

fn run_child_many(dir: &std::path::Path, ids: &[[u8; 16]], point: &str, after: u32) -> (bool, u64) {
    let exe = std::env::current_exe().unwrap();
    let ids_env: Vec<String> = ids.iter().map(text).collect();
    let mut child = Command::new(exe)
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{point}@{after}"))
        .env(DIR_ENV, dir)
        .env(ID_ENV, ids_env.join(","))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // the `running` event (seq 1) was acknowledged before the child started
    let mut acked = 1;
    let mut done = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(n) = ack_of(&line) {
            acked = n;
        }
        if line.trim_end().ends_with("DONE") {
            done = true;
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.success(), done, "child status {status:?}");
    (done, acked)
}

#[test]
fn a_process_killed_at_every_commit_point_loses_nothing_acknowledged() {
    for point in points::ALL {
        for after in [1, 2, 5] {
            let dir = tempfile::tempdir().unwrap();
            let id = prepare(dir.path());
            let (finished, acked) = run_child(dir.path(), &id, point, after);
            assert!(
                !finished,
                "{point}@{after}: the crash point was never reached"
            );
            let s = check_after_restart(dir.path(), &id, acked);
            let durable = last_seq(&s, &id) - 1; // minus the append just made
            if point == points::EVENT_AFTER_COMMIT {
                // committed but killed before the acknowledgement went out
                assert_eq!(durable, acked + BATCH, "{point}@{after}");
            } else {
                // the crashed batch never committed: nothing beyond the last ack
                assert_eq!(durable, acked, "{point}@{after}");
            }
        }
    }
}

#[test]
fn a_process_killed_at_every_commit_point_of_a_journaled_group_loses_nothing_acknowledged() {
    // six commands per group: above the journal threshold, so the flush at
    // each point is the group journal's
    for point in points::ALL {
        for after in [1, 3] {
            let dir = tempfile::tempdir().unwrap();
            let ids = prepare_many(dir.path(), 6);
            let (finished, acked) = run_child_many(dir.path(), &ids, point, after);
            assert!(
                !finished,
                "{point}@{after}: the crash point was never reached"
            );
            for id in &ids {
                let s = check_after_restart(dir.path(), id, acked);
                let durable = last_seq(&s, id) - 1; // minus the append just made
                if point == points::EVENT_AFTER_COMMIT {
                    assert_eq!(durable, acked + BATCH, "{point}@{after}");
                } else {
                    assert_eq!(durable, acked, "{point}@{after}");
                }
            }
        }
    }
}

#[test]
fn a_process_killed_at_random_moments_loses_nothing_acknowledged() {
    // SIGKILL from outside, not at a named point: after a varying number of acks
    for stop_after_acks in [1u64, 3, 6] {
        let dir = tempfile::tempdir().unwrap();
        let id = prepare(dir.path());
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "never@1")
            .env(DIR_ENV, dir.path())
            .env(ID_ENV, text(&id))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut acked = 1;
        let mut seen = 0;
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        while let Some(Ok(line)) = lines.next() {
            if let Some(n) = ack_of(&line) {
                acked = n;
                seen += 1;
                if seen == stop_after_acks {
                    let _ = child.kill();
                    break;
                }
            }
        }
        // acks already printed before the kill landed still count
        for line in lines.map_while(Result::ok) {
            if let Some(n) = ack_of(&line) {
                acked = n;
            }
        }
        child.wait().unwrap();
        check_after_restart(dir.path(), &id, acked);
    }
}

#[test]
fn power_cuts_lose_only_unacknowledged_bytes() {
    let cases = [
        (points::EVENT_MID_RECORD, CrashMode::LoseUnsynced),
        (points::EVENT_MID_RECORD, CrashMode::Tear { keep: 100 }),
        (points::EVENT_BEFORE_FSYNC, CrashMode::Tear { keep: 3000 }),
        (points::EVENT_AFTER_FSYNC, CrashMode::LoseUnsynced),
        (points::EVENT_AFTER_COMMIT, CrashMode::LoseUnsynced),
        (points::SEGMENT_CREATED, CrashMode::LoseUnsynced),
    ];
    for (point, mode) in cases {
        for after in [1, 3] {
            let dir = tempfile::tempdir().unwrap();
            let id = prepare(dir.path());
            let fs = FaultyFs::new();
            let mut acked = 1;
            {
                let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
                let mut s = open_with(dir.path(), fs_dyn, options());
                s.set_crash_hook(Arc::new(StopAt {
                    point,
                    after,
                    hits: AtomicU32::new(0),
                }));
                let mut next = 2;
                let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    for _ in 0..BATCHES {
                        let batch: Vec<_> = (next..next + BATCH)
                            .map(|seq| output(&id, seq, &chunk(seq, CHUNK)))
                            .collect();
                        let r = s.append_events(&batch, NOW).unwrap();
                        acked = r.acked[&id];
                        next += BATCH;
                    }
                }));
                assert!(crashed.is_err(), "{point}@{after} was never reached");
            }
            let dropped = fs.crash(mode).unwrap();
            if point == points::EVENT_MID_RECORD || point == points::EVENT_BEFORE_FSYNC {
                assert!(
                    dropped > 0,
                    "{point}@{after}: the power cut had nothing to drop"
                );
            }
            check_after_restart(dir.path(), &id, acked);
        }
    }
}

#[test]
fn files_leaving_the_open_file_cache_mid_batch_are_still_synced() {
    // one open segment at a time: every batch switches files for two commands
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let opts = StoreOptions {
        max_open_segments: 1,
        ..options()
    };
    let (a, b);
    {
        let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
        let mut s = open_with(dir.path(), fs_dyn, opts.clone());
        a = running_command(&mut s, "web-1");
        b = running_command(&mut s, "web-2");
        for round in 0..4u64 {
            let seq = 2 + round;
            let batch = vec![
                output(&a, seq, &chunk(seq, CHUNK)),
                output(&b, seq, &chunk(seq, CHUNK)),
            ];
            let r = s.append_events(&batch, NOW).unwrap();
            assert_eq!((r.acked[&a], r.acked[&b]), (seq, seq));
        }
    }
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let s = open_with(dir.path(), Arc::new(RealFs), opts);
    assert_eq!(verify_output(&s, &a), vec![2, 3, 4, 5]);
    assert_eq!(verify_output(&s, &b), vec![2, 3, 4, 5]);
    assert_counters(&s);
}

#[test]
fn groups_made_durable_by_the_group_journal_survive_a_power_cut() {
    // six commands per batch: above the journal threshold
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let mut acked = Vec::new();
    let ids: Vec<[u8; 16]>;
    {
        let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
        let mut s = open_with(dir.path(), fs_dyn, options());
        ids = (0..6)
            .map(|i| running_command(&mut s, &format!("web-{i}")))
            .collect();
        s.set_crash_hook(Arc::new(StopAt {
            point: points::EVENT_MID_RECORD,
            after: 4,
            hits: AtomicU32::new(0),
        }));
        let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            for seq in 2..20u64 {
                let batch: Vec<_> = ids
                    .iter()
                    .map(|id| output(id, seq, &chunk(seq, CHUNK)))
                    .collect();
                let r = s.append_events(&batch, NOW).unwrap();
                acked.push(r.acked[&ids[0]]);
            }
        }));
        assert!(crashed.is_err());
    }
    assert_eq!(acked, vec![2, 3, 4]);
    assert!(fs.crash(CrashMode::LoseUnsynced).unwrap() > 0);
    for id in &ids {
        check_after_restart(dir.path(), id, 4);
    }
}
