#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! A start does bounded work (docs/storage.md, "Start-up"): it reads only
//! the segments that may hold an uncommitted tail or were never verified,
//! orphans and sealed segments are left to the background scrub, and a
//! file a batch left behind never stops the next write.

mod support;

use std::sync::Arc;

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::incidents;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};
use support::*;

fn small_segments() -> StoreOptions {
    StoreOptions {
        seal_bytes: 8 * 1024,
        ..StoreOptions::default()
    }
}

fn reopen(
    dir: &std::path::Path,
    opts: StoreOptions,
) -> (Store, rvbox_store::recovery::RecoveryReport) {
    open_with_report(dir, Arc::new(rvbox_store::fs::RealFs), opts)
}

/// A command that wrote `chunks` chunks of 3000 bytes, finished or not.
fn command_with_output(s: &mut Store, chunks: u64, finish: bool) -> [u8; 16] {
    let id = running_command(s, "web-1");
    for seq in 2..2 + chunks {
        s.append_events(&[output(&id, seq, &chunk(seq, 3000))], NOW)
            .unwrap();
    }
    if finish {
        s.append_events(&[lifecycle(&id, 2 + chunks, Lifecycle::Succeeded)], NOW)
            .unwrap();
    }
    id
}

fn segments(s: &Store, id: &[u8; 16]) -> Vec<(u32, String, i64)> {
    s.db()
        .prepare("SELECT ordinal, state, verified FROM command_segments WHERE issue_uuid = ?1 ORDER BY ordinal")
        .unwrap()
        .query_map([id.as_slice()], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn a_segment_is_verified_when_it_is_sealed_and_a_terminal_command_has_no_active_segment() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_with(
        dir.path(),
        Arc::new(rvbox_store::fs::RealFs),
        small_segments(),
    );
    let running = command_with_output(&mut s, 7, false);
    let done = command_with_output(&mut s, 7, true);
    // 3000-byte chunks in 8 KiB segments: two per segment
    let sealed =
        |v: &[(u32, String, i64)]| v.iter().filter(|r| r.1 == "sealed" && r.2 == 1).count();
    let r = segments(&s, &running);
    assert_eq!(r.len(), 4, "{r:?}");
    assert_eq!(sealed(&r), 3, "{r:?}");
    assert_eq!(r[3].1, "active");
    assert_eq!(r[3].2, 0, "an active segment never carries the fact");
    let d = segments(&s, &done);
    assert_eq!(d.len(), 4, "{d:?}");
    assert_eq!(
        sealed(&d),
        4,
        "the terminal event seals and verifies the last one: {d:?}"
    );
    assert_eq!(verify_output(&s, &done), (2..9).collect::<Vec<_>>());
}

#[test]
fn a_start_reads_only_active_and_unverified_segments() {
    let dir = tempfile::tempdir().unwrap();
    let running;
    {
        let mut s = open_with(
            dir.path(),
            Arc::new(rvbox_store::fs::RealFs),
            small_segments(),
        );
        for _ in 0..20 {
            command_with_output(&mut s, 5, true);
        }
        running = command_with_output(&mut s, 5, false);
        // a sealed segment nobody verified (as a server-side terminal
        // transition leaves it): the start reads it and records the fact
        s.db()
            .execute(
                "UPDATE command_segments SET verified = 0 WHERE issue_uuid = ?1 AND ordinal = 1",
                [running.as_slice()],
            )
            .unwrap();
    }
    let (s, report) = reopen(dir.path(), small_segments());
    // 21 commands of 3 segments each: the running one's active segment and
    // its unverified sealed one, nothing else
    assert_eq!(report.segments_scanned, 2, "{report:?}");
    assert!(report.integrity_ok);
    assert_eq!(segments(&s, &running)[0].2, 1, "verified by the start");
    drop(s);
    let (_, report) = reopen(dir.path(), small_segments());
    assert_eq!(
        report.segments_scanned, 1,
        "only the active segment: {report:?}"
    );
}

#[test]
fn damage_in_a_verified_segment_is_found_by_the_background_scrub() {
    let dir = tempfile::tempdir().unwrap();
    let done;
    {
        let mut s = open_with(
            dir.path(),
            Arc::new(rvbox_store::fs::RealFs),
            small_segments(),
        );
        done = command_with_output(&mut s, 5, true);
    }
    let path = Layout::new(dir.path()).segment_path(&done, 2).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[400] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let (mut s, report) = reopen(dir.path(), small_segments());
    assert_eq!(report.segments_damaged, 0, "a start does not read it");
    assert!(incidents::open(s.db(), 10).unwrap().is_empty());
    let r = s.scrub_cycle(NOW).unwrap();
    assert!(r.cycle_completed, "{r:?}");
    assert_eq!(r.segments_damaged, 1, "{r:?}");
    assert!(r.segments_verified >= 3, "{r:?}");
    let open = incidents::open(s.db(), 10).unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].kind, wire::IncidentKind::ChecksumMismatch);
    assert!(open[0].data_loss);
    // the lost events are an explicit truncation, the rest reads
    assert_eq!(verify_output(&s, &done), vec![2, 3, 6]);
    // the command's scope is dirty: health says so
    assert_eq!(s.health().report(NOW).scopes.len(), 3);
    // a second cycle finds nothing new
    let r = s.scrub_cycle(NOW).unwrap();
    assert_eq!(r.segments_damaged, 0, "{r:?}");
    assert_counters(&s);
}

#[test]
fn a_file_a_batch_left_behind_never_stops_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    let running;
    {
        let mut s = open_with(
            dir.path(),
            Arc::new(rvbox_store::fs::RealFs),
            small_segments(),
        );
        running = command_with_output(&mut s, 2, false);
    }
    let layout = Layout::new(dir.path());
    // the next segment's file, as a batch that never committed leaves it
    std::fs::write(
        layout.segment_path(&running, 2).unwrap(),
        b"never committed",
    )
    .unwrap();
    let (mut s, _) = reopen(dir.path(), small_segments());
    for seq in 4..8 {
        let r = s
            .append_events(&[output(&running, seq, &chunk(seq, 3000))], NOW)
            .unwrap();
        assert_eq!(
            r.outcomes,
            vec![rvbox_store::events::EventOutcome::Appended]
        );
    }
    assert_eq!(verify_output(&s, &running), (2..8).collect::<Vec<_>>());
    assert!(incidents::open(s.db(), 10).unwrap().is_empty());
    assert_counters(&s);
}

#[test]
fn a_slice_before_global_readiness_does_nothing_and_asks_again_soon() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = open_with(
            dir.path(),
            Arc::new(rvbox_store::fs::RealFs),
            small_segments(),
        );
        command_with_output(&mut s, 5, true);
    }
    let mut s = Store::open(
        Layout::new(dir.path()),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(rvbox_store::entropy::OsEntropy),
        small_segments(),
        NOW,
    )
    .unwrap();
    // before the start has recovered anything
    let r = s.scrub(NOW).unwrap();
    assert_eq!(r.segments_verified, 0);
    assert!(
        !r.idle,
        "not idle: the core asks again at the short interval"
    );
    s.recover(NOW).unwrap();
    let r = s.scrub(NOW).unwrap();
    assert!(r.segments_verified > 0, "{r:?}");
}

#[test]
fn the_background_scrub_yields_in_bounded_slices() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_with(
        dir.path(),
        Arc::new(rvbox_store::fs::RealFs),
        small_segments(),
    );
    for _ in 0..30 {
        command_with_output(&mut s, 5, true);
    }
    let mut slices = 0;
    let mut verified = 0;
    loop {
        let r = s.scrub(NOW).unwrap();
        slices += 1;
        assert!(
            r.segments_verified <= 2 * rvbox_store::scrub::SEGMENTS_PER_SLICE as u64,
            "{r:?}"
        );
        verified += r.segments_verified;
        if r.cycle_completed {
            break;
        }
        assert!(slices < 100, "the cycle ends");
    }
    assert_eq!(verified, 90, "every sealed segment once");
    assert!(slices >= 3, "{slices} slices");
    // done: idle until the next cycle is due
    assert!(s.scrub(NOW + 1).unwrap().idle);
    let later = NOW + i64::try_from(StoreOptions::default().scrub_interval_ms).unwrap();
    assert!(!s.scrub(later).unwrap().idle, "a new cycle starts when due");
}

/// The writer's commits never copy the WAL into the database file at
/// SQLite's default 1,000 pages: the checkpointer's thread does, and the
/// writer's own checkpoint waits for the 4,096-page bound.
#[test]
fn the_wal_is_checkpointed_off_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let pages: i64 = s
        .db()
        .query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        pages,
        i64::from(rvbox_store::checkpoint::WRITER_FALLBACK_PAGES)
    );
    for i in 0..50 {
        command_with_output(&mut s, 2, i % 2 == 0);
    }
    let m = s.metrics().checkpoint.clone();
    let t = std::time::Instant::now();
    while m.frames.get() == 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(m.frames.get() > 0, "the checkpointer copied nothing");
    assert!(m.checkpoints.get() >= 1);
    assert_eq!(m.errors.get(), 0);
}
