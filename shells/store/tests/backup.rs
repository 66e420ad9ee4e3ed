#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Online backup and restore on real files (docs/operations.md, "Backup
//! and restore"): the store stays open (its lock held) while the backup
//! runs, and output is committed between the backup's steps. The restored
//! store must hold exactly what the database copy calls committed: output
//! committed before the copy (even after the pre-copy of its file) is
//! there byte for byte, output committed after it is not, nothing needs
//! cutting at restore, and every segment verifies. A file removed under
//! the catch-up starts the backup again; a file the live store already
//! lacked is reported as damage; a backup that does not match its
//! manifest is refused before anything is written. A script stored in its
//! own blob segment comes back whole.

mod support;

use std::path::Path;
use std::sync::Arc;

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::backup::{
    self, BackupError, BackupFile, MANIFEST, RestoreError, Stage, read_manifest, restore_files,
    verify_backup,
};
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};
use support::*;

const LEN: usize = 3000;

fn small_segments(dir: &Path) -> Store {
    open_with(
        dir,
        Arc::new(RealFs),
        StoreOptions {
            seal_bytes: 8 * 1024,
            ..StoreOptions::default()
        },
    )
}

fn append(s: &mut Store, id: &[u8; 16], from: u64, to: u64) {
    for q in from..=to {
        let r = s
            .append_events(&[output(id, q, &chunk(q, LEN))], NOW)
            .unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    }
}

fn expected(from: u64, to: u64) -> Vec<u8> {
    (from..=to).flat_map(|q| chunk(q, LEN)).collect()
}

/// Every output byte the store serves for `id`, in event order.
fn served(s: &Store, id: &[u8; 16]) -> Vec<u8> {
    use wire::output_item::Item;
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = s
            .get_output(&wire::GetOutputRequest {
                request_id: String::new(),
                issue_uuid: text(id),
                streams: vec![
                    wire::OutputStream::Stdout as i32,
                    wire::OutputStream::Stderr as i32,
                ],
                max_bytes: 4 << 20,
                page_token: token.clone(),
            })
            .unwrap();
        for item in &page.items {
            match item.item.as_ref().unwrap() {
                Item::Data(d) => all.extend_from_slice(&d.data),
                other => panic!("unexpected item {other:?}"),
            }
        }
        if page.next_page_token.is_empty() || page.items.is_empty() {
            return all;
        }
        token = page.next_page_token;
    }
}

fn script_request(id: &[u8; 16], body: &[u8]) -> wire::RunCommandRequest {
    let mut req = run_request(id, "web-1", "unused");
    req.spec = Some(wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::Script(
            wire::ScriptDescriptor {
                display_basename: "deploy.sh".into(),
                size_bytes: body.len() as u64,
                sha256: rvbox_segment::sha256(body).to_vec(),
            },
        )),
        ..Default::default()
    });
    req.script = body.to_vec();
    req
}

fn restore(from: &Path, to: &Path) -> Store {
    let fs = RealFs;
    let m = read_manifest(&fs, from).unwrap();
    verify_backup(&fs, from, &m).unwrap();
    restore_files(&fs, from, &m, &Layout::new(to)).unwrap();
    let (mut s, report) = open_with_report(to, Arc::new(RealFs), StoreOptions::default());
    assert!(report.integrity_ok, "{report:?}");
    assert_eq!(
        report.tails_truncated, 0,
        "a byte past a committed end was copied: {report:?}"
    );
    assert_eq!(report.segments_damaged, 0, "{report:?}");
    let scrub = s.scrub_cycle(NOW).unwrap();
    assert_eq!(scrub.segments_damaged, 0, "{scrub:?}");
    assert_eq!(scrub.counter_mismatches, 0, "{scrub:?}");
    s
}

fn open_incidents(s: &Store) -> usize {
    s.list_incidents(Some(wire::IncidentState::Open), None, 100)
        .unwrap()
        .len()
}

#[test]
fn a_live_stores_backup_restores_exactly_what_its_database_copy_committed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut s = small_segments(&data);
    // a finished command over several sealed segments
    let done = running_command(&mut s, "web-1");
    append(&mut s, &done, 2, 20);
    s.append_events(&[lifecycle(&done, 21, Lifecycle::Succeeded)], NOW)
        .unwrap();
    // a command still writing
    let live = running_command(&mut s, "web-1");
    append(&mut s, &live, 2, 10);
    // a queued command whose script is too large to stay inline: its blob
    // segment (ordinal 0)
    let scripted = new_id();
    let body = chunk(7, 200_000);
    s.run_command(&script_request(&scripted, &body), NOW)
        .unwrap();
    s.flush_audit(NOW).unwrap();
    let layout = s.layout().clone();
    let to = dir.path().join("backup");
    let mut late = None;
    let report = backup::backup(&RealFs, &layout, &to, 3, NOW, &mut |n, stage| match stage {
        // committed after the pre-copy, before the database copy: in the backup
        Stage::Precopied => {
            append(&mut s, &live, 11, 30);
            let fresh = running_command(&mut s, "web-2");
            append(&mut s, &fresh, 2, 5);
            late = Some(fresh);
        }
        // committed after the database copy: not in the backup
        Stage::DatabaseCopied => {
            assert_eq!(n, 1);
            append(&mut s, &live, 31, 40);
        }
        Stage::Start => {}
    })
    .unwrap();
    let fresh = late.unwrap();
    assert_eq!(report.attempts, 1);
    assert!(report.damaged.is_empty(), "{report:?}");
    assert!(report.token_key);
    assert!(report.caught_up_bytes > 0, "{report:?}");
    assert_eq!(report.commands, 4);
    assert!(
        report.segments >= 7 && report.audit_segments >= 1,
        "{report:?}"
    );
    assert!(to.join(MANIFEST).exists());
    // the live store went on: the backup held no lock and changed nothing
    append(&mut s, &live, 41, 42);
    assert_eq!(served(&s, &live), expected(2, 42));
    let token_key = std::fs::read(layout.token_key_file()).unwrap();

    let restored_dir = dir.path().join("restored");
    let r = restore(&to, &restored_dir);
    assert_eq!(served(&r, &done), expected(2, 20));
    assert_eq!(served(&r, &live), expected(2, 30));
    assert_eq!(last_seq(&r, &live), 30);
    assert_eq!(served(&r, &fresh), expected(2, 5));
    assert_eq!(r.script(&scripted).unwrap(), Some(body));
    assert_eq!(r.server_id(), s.server_id());
    assert_eq!(
        std::fs::read(Layout::new(&restored_dir).token_key_file()).unwrap(),
        token_key
    );
    let audit = r.verify_audit().unwrap();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    assert!(audit.chained > 0);
    assert_eq!(open_incidents(&r), 0);
    assert_counters(&r);
    drop(r);

    // a second restore into the same place is refused
    let fs = RealFs;
    let m = read_manifest(&fs, &to).unwrap();
    assert!(matches!(
        restore_files(&fs, &to, &m, &Layout::new(&restored_dir)),
        Err(RestoreError::TargetNotEmpty(_))
    ));
    // one changed byte in one segment: refused before anything is written
    let seg = m
        .files
        .iter()
        .find(|e| matches!(e.file, BackupFile::Segment { .. }))
        .unwrap();
    let rel = seg.file.relative().unwrap();
    let path = to.join(&rel);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[200] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    match verify_backup(&fs, &to, &m) {
        Err(RestoreError::Mismatch { file, reason }) => {
            assert_eq!(file, rel);
            assert!(reason.contains("SHA-256"), "{reason}");
        }
        other => panic!("a changed file was not refused: {other:?}"),
    }
    // and a backup directory is not a data directory to back up into
    assert!(matches!(
        backup::backup(&RealFs, &layout, &to, 1, NOW, &mut |_, _| {}),
        Err(BackupError::TargetNotEmpty(_))
    ));
}

/// Moves a file out of the way and back (standing in for retention, which
/// removes a file only after the database stopped naming it).
fn hide(path: &Path) {
    std::fs::rename(path, path.with_extension("away")).unwrap();
}

fn unhide(path: &Path) {
    let away = path.with_extension("away");
    if away.exists() {
        std::fs::rename(away, path).unwrap();
    }
}

#[test]
fn a_file_removed_during_the_catch_up_starts_the_backup_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = small_segments(&dir.path().join("data"));
    let live = running_command(&mut s, "web-1");
    append(&mut s, &live, 2, 4);
    let layout = s.layout().clone();
    let active = |s: &Store| {
        let ordinal: u32 = s
            .db()
            .query_row(
                "SELECT ordinal FROM command_segments WHERE issue_uuid = ?1 AND state = 'active'",
                [live.as_slice()],
                |r| r.get(0),
            )
            .unwrap();
        layout.segment_path(&live, ordinal).unwrap()
    };
    let mut next = 5;
    let mut hidden: Option<std::path::PathBuf> = None;

    // the first attempt loses its file after the database copy; the second keeps it
    let to = dir.path().join("b1");
    let report = backup::backup(&RealFs, &layout, &to, 3, NOW, &mut |n, stage| match stage {
        Stage::Start => {
            if let Some(p) = hidden.take() {
                unhide(&p);
            }
        }
        Stage::Precopied => {
            append(&mut s, &live, next, next);
            next += 1;
        }
        Stage::DatabaseCopied if n == 1 => {
            let p = active(&s);
            hide(&p);
            hidden = Some(p);
        }
        Stage::DatabaseCopied => {}
    })
    .unwrap();
    assert_eq!(report.attempts, 2, "{report:?}");
    assert!(report.damaged.is_empty(), "{report:?}");
    let r = restore(&to, &dir.path().join("r1"));
    assert_eq!(served(&r, &live), expected(2, 6));
    drop(r);

    // every attempt loses it: the backup says which file and leaves no manifest
    let to = dir.path().join("b2");
    let err = backup::backup(&RealFs, &layout, &to, 2, NOW, &mut |_, stage| match stage {
        Stage::Start => {
            if let Some(p) = hidden.take() {
                unhide(&p);
            }
        }
        Stage::Precopied => {
            append(&mut s, &live, next, next);
            next += 1;
        }
        Stage::DatabaseCopied => {
            let p = active(&s);
            hide(&p);
            hidden = Some(p);
        }
    })
    .unwrap_err();
    if let Some(p) = hidden.take() {
        unhide(&p);
    }
    match err {
        BackupError::Removed { file, attempts } => {
            assert_eq!(attempts, 2);
            assert!(file.starts_with("segments/"), "{file}");
        }
        other => panic!("expected a removed file, got {other:?}"),
    }
    assert!(!to.join(MANIFEST).exists());
    assert!(read_manifest(&RealFs, &to).is_err());
}

#[test]
fn a_segment_the_live_store_already_lacks_is_reported_as_damage() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = small_segments(&dir.path().join("data"));
    let done = running_command(&mut s, "web-1");
    append(&mut s, &done, 2, 12);
    s.append_events(&[lifecycle(&done, 13, Lifecycle::Succeeded)], NOW)
        .unwrap();
    let lost = s.layout().segment_path(&done, 1).unwrap();
    std::fs::remove_file(&lost).unwrap();
    let layout = s.layout().clone();
    let to = dir.path().join("backup");
    let report = backup::backup(&RealFs, &layout, &to, 3, NOW, &mut |_, _| {}).unwrap();
    assert_eq!(report.attempts, 1, "damage is not retried");
    assert_eq!(
        report.damaged,
        vec![
            BackupFile::Segment {
                issue: done,
                ordinal: 1
            }
            .relative()
            .unwrap()
        ]
    );
    // the restore finds it again, as the live store would: an incident
    let fs = RealFs;
    let m = read_manifest(&fs, &to).unwrap();
    verify_backup(&fs, &to, &m).unwrap();
    let restored = dir.path().join("restored");
    restore_files(&fs, &to, &m, &Layout::new(&restored)).unwrap();
    let mut r = open(&restored);
    let scrub = r.scrub_cycle(NOW).unwrap();
    assert!(scrub.segments_damaged >= 1, "{scrub:?}");
    assert!(open_incidents(&r) >= 1);
}
