#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The group journal (journal.rs): groups touching many segment files are
//! made durable by one journal flush, and recovery re-appends from it what a
//! power cut took from the segment files. Real SQLite, real files, power
//! cuts simulated by the fault-injecting filesystem.

mod support;

use std::path::Path;
use std::sync::Arc;

use rvbox_store::crash::{CrashHook, points};
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::{CrashMode, FaultKind, FaultOp, FaultyFs, StoreFs};
use rvbox_store::layout::Layout;
use rvbox_store::recovery::RecoveryReport;
use rvbox_store::{Store, StoreOptions};
use support::*;

const COMMANDS: usize = 8;

fn reopen(dir: &Path, fs: &FaultyFs) -> (Store, RecoveryReport) {
    let fs: Arc<dyn StoreFs> = Arc::new(fs.clone());
    let mut s = Store::open(
        Layout::new(dir),
        fs,
        Arc::new(rvbox_store::entropy::OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let r = s.recover(NOW).unwrap();
    (s, r)
}

fn journal_len(dir: &Path) -> u64 {
    std::fs::metadata(Layout::new(dir).journal_file())
        .unwrap()
        .len()
}

/// `COMMANDS` running commands and `groups` groups, each appending one
/// chunk of `size` bytes to every command.
fn fill(s: &mut Store, groups: u64, size: usize) -> Vec<[u8; 16]> {
    let ids: Vec<_> = (0..COMMANDS)
        .map(|i| running_command(s, &format!("host-{i}")))
        .collect();
    for g in 0..groups {
        let seq = 2 + g;
        let batch: Vec<_> = ids
            .iter()
            .map(|id| output(id, seq, &chunk(seq, size)))
            .collect();
        let r = s.append_events(&batch, NOW).unwrap();
        assert!(r.outcomes.iter().all(|o| *o == EventOutcome::Appended));
    }
    ids
}

fn assert_intact(s: &Store, ids: &[[u8; 16]], last: u64) {
    for id in ids {
        assert_eq!(last_seq(s, id), last);
        assert_eq!(verify_output(s, id), (2..=last).collect::<Vec<_>>());
    }
    assert!(
        rvbox_store::incidents::open(s.db(), 10).unwrap().is_empty(),
        "no incident: nothing was lost"
    );
    assert_counters(s);
}

#[test]
fn a_group_touching_many_segments_is_made_durable_by_one_journal_frame() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let (mut s, _) = reopen(dir.path(), &fs);
    fill(&mut s, 3, 1000);
    assert_eq!(s.metrics().journal_groups.get(), 3);
    assert!(journal_len(dir.path()) > 3 * 8 * 1000);
    // a group of fewer files syncs them directly
    let id = running_command(&mut s, "solo");
    s.append_events(&[output(&id, 2, b"alone")], NOW).unwrap();
    assert_eq!(s.metrics().journal_groups.get(), 3);
}

#[test]
fn a_power_cut_after_journal_commits_loses_no_acknowledged_event() {
    for mode in [CrashMode::LoseUnsynced, CrashMode::Tear { keep: 700 }] {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let (mut s, _) = reopen(dir.path(), &fs);
        let ids = fill(&mut s, 5, 1000);
        drop(s);
        // the segment files lose everything since their last sync; only the
        // journal held the group's bytes durably
        assert!(fs.crash(mode).unwrap() > 0);
        let (s, report) = reopen(dir.path(), &fs);
        assert_eq!(report.journal_frames, 5, "{mode:?}");
        assert_eq!(report.journal_segments_redone, COMMANDS as u64, "{mode:?}");
        assert_eq!(report.segments_damaged, 0, "{mode:?}");
        assert_intact(&s, &ids, 6);
        // recovery checkpointed: the journal is empty and a second power cut
        // right now loses nothing either
        assert_eq!(journal_len(dir.path()), 0);
        drop(s);
        fs.crash(CrashMode::LoseUnsynced).unwrap();
        let (s, report) = reopen(dir.path(), &fs);
        assert_eq!(report.journal_frames, 0);
        assert_eq!(report.segments_damaged, 0);
        assert_intact(&s, &ids, 6);
    }
}

#[derive(Debug)]
struct StopAt(&'static str);

impl CrashHook for StopAt {
    fn at(&self, point: &'static str) {
        if point == self.0 {
            panic!("stop at {point}");
        }
    }
}

#[test]
fn a_journaled_group_that_never_committed_is_not_replayed() {
    for mode in [CrashMode::LoseUnsynced, CrashMode::Tear { keep: 300 }] {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let (mut s, _) = reopen(dir.path(), &fs);
        let ids = fill(&mut s, 2, 1000);
        // the next group's frame is durable, then the server dies before
        // the metadata transaction
        s.set_crash_hook(Arc::new(StopAt(points::EVENT_AFTER_FSYNC)));
        let batch: Vec<_> = ids
            .iter()
            .map(|id| output(id, 4, &chunk(4, 1000)))
            .collect();
        let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            s.append_events(&batch, NOW)
        }));
        assert!(died.is_err());
        drop(s);
        fs.crash(mode).unwrap();
        let (s, report) = reopen(dir.path(), &fs);
        assert_eq!(report.journal_frames, 3, "{mode:?}");
        assert_eq!(report.segments_damaged, 0, "{mode:?}");
        // the acknowledged groups are back; the unacknowledged one is not
        assert_intact(&s, &ids, 3);
    }
}

#[test]
fn a_journal_failure_acknowledges_nothing_and_the_next_group_lands() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let (mut s, _) = reopen(dir.path(), &fs);
    let ids = fill(&mut s, 1, 500);
    let before = journal_len(dir.path());
    let group = |seq: u64| -> Vec<_> {
        ids.iter()
            .map(|id| output(id, seq, &chunk(seq, 500)))
            .collect()
    };
    // the group's only sync is the journal's: it fails
    fs.inject(FaultOp::Sync, FaultKind::Io);
    assert!(s.append_events(&group(3), NOW).is_err());
    assert_eq!(
        journal_len(dir.path()),
        before,
        "the failed frame is cut off"
    );
    for id in &ids {
        assert_eq!(last_seq(&s, id), 2);
    }
    s.append_events(&group(3), NOW).unwrap();
    drop(s);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let (s, report) = reopen(dir.path(), &fs);
    assert_eq!(report.segments_damaged, 0);
    assert_intact(&s, &ids, 3);
}

#[test]
fn a_full_journal_is_checkpointed_and_a_later_power_cut_still_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let (mut s, _) = reopen(dir.path(), &fs);
    // 8 x 64 KiB per group: a 16 MiB journal fills after about 30 groups
    let ids = fill(&mut s, 40, 64 * 1024);
    assert_eq!(s.metrics().journal_groups.get(), 40);
    assert!(s.metrics().journal_checkpoints.get() >= 1);
    assert!(journal_len(dir.path()) <= rvbox_store::journal::JOURNAL_CAPACITY);
    drop(s);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let (s, report) = reopen(dir.path(), &fs);
    assert!(
        report.journal_frames < 40,
        "frames before the checkpoint are gone"
    );
    assert_eq!(report.segments_damaged, 0);
    assert_intact(&s, &ids, 41);
}

#[test]
fn an_explicit_checkpoint_empties_the_journal_and_old_frames_never_apply_again() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let (mut s, _) = reopen(dir.path(), &fs);
    let ids = fill(&mut s, 3, 800);
    let journal = Layout::new(dir.path()).journal_file();
    let old_frames = std::fs::read(&journal).unwrap();
    s.checkpoint_journal().unwrap();
    assert_eq!(journal_len(dir.path()), 0);
    // one more group after the checkpoint
    let batch: Vec<_> = ids.iter().map(|id| output(id, 5, &chunk(5, 800))).collect();
    s.append_events(&batch, NOW).unwrap();
    drop(s);
    // a stale copy of the old epoch's frames written after the new one
    // (as if a truncation had not reached the disk) is never replayed
    let mut stale = std::fs::read(&journal).unwrap();
    stale.extend_from_slice(&old_frames);
    std::fs::write(&journal, &stale).unwrap();
    let (s, report) = reopen(dir.path(), &fs);
    assert_eq!(report.journal_frames, 1);
    assert_eq!(report.segments_damaged, 0);
    assert_intact(&s, &ids, 5);
}

#[test]
fn a_group_too_large_for_one_frame_syncs_the_filesystem_instead() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let (mut s, _) = reopen(dir.path(), &fs);
    let ids = fill(&mut s, 0, 0);
    // 8 commands x 3 chunks of 64 KiB: about 1.5 MiB, above one frame
    let batch: Vec<_> = ids
        .iter()
        .flat_map(|id| (2..=4).map(|seq| output(id, seq, &chunk(seq, 64 * 1024))))
        .collect();
    s.append_events(&batch, NOW).unwrap();
    assert_eq!(s.metrics().journal_groups.get(), 0);
    assert_eq!(journal_len(dir.path()), 0);
    drop(s);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let (s, report) = reopen(dir.path(), &fs);
    assert_eq!(report.journal_frames, 0);
    assert_eq!(report.segments_damaged, 0);
    assert_intact(&s, &ids, 4);
}
