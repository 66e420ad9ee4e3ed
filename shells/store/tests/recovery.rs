#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Recovery on real files (plan §5.1, §5.3, §5.6): uncommitted tails are
//! cut, committed damage becomes truncation metadata plus an open incident
//! and never moves `committed_end` back, orphans go, and recovery is
//! idempotent.

mod support;

use std::io::Write;
use std::path::PathBuf;

use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::incidents;
use support::*;

fn segment_path(s: &Store, id: &[u8; 16], ordinal: u32) -> PathBuf {
    s.layout().segment_path(id, ordinal).unwrap()
}

fn committed_end(s: &Store, id: &[u8; 16], ordinal: u32) -> i64 {
    s.db()
        .query_row(
            "SELECT committed_end FROM command_segments WHERE issue_uuid = ?1 AND ordinal = ?2",
            rusqlite::params![id.as_slice(), ordinal],
            |r| r.get(0),
        )
        .unwrap()
}

fn segment_state(s: &Store, id: &[u8; 16], ordinal: u32) -> String {
    s.db()
        .query_row(
            "SELECT state FROM command_segments WHERE issue_uuid = ?1 AND ordinal = ?2",
            rusqlite::params![id.as_slice(), ordinal],
            |r| r.get(0),
        )
        .unwrap()
}

fn prepared(dir: &std::path::Path) -> (PathBuf, [u8; 16], i64) {
    let mut s = open(dir);
    let id = running_command(&mut s, "web-1");
    let batch: Vec<_> = (2..=4)
        .map(|seq| output(&id, seq, &chunk(seq, 2000)))
        .collect();
    s.append_events(&batch, NOW).unwrap();
    (segment_path(&s, &id, 1), id, committed_end(&s, &id, 1))
}

#[test]
fn uncommitted_tail_is_truncated_and_recorded_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let (path, id, end) = prepared(dir.path());
    // a crashed batch left a complete record and a torn one beyond committed_end
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&[0x52, 0x56, 0x53, 0x47, 1, 0, 128]).unwrap();
    drop(f);
    let mut s = open(dir.path());
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        u64::try_from(end).unwrap()
    );
    assert_eq!(committed_end(&s, &id, 1), end);
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4]);
    let all = incidents::list(s.db(), None, None, 10).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].kind, wire::IncidentKind::UncommittedTail);
    assert_eq!(all[0].state, wire::IncidentState::Repaired);
    // idempotent: another recovery finds nothing to do
    let again = s.recover(NOW + 1).unwrap();
    assert_eq!((again.tails_truncated, again.incidents), (0, 0));
    // and appends continue where the committed data ends
    s.append_events(&[output(&id, 5, b"next")], NOW).unwrap();
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4, 5]);
    assert_counters(&s);
}

#[test]
fn corrupted_final_record_becomes_truncation_metadata_and_an_open_incident() {
    let dir = tempfile::tempdir().unwrap();
    let (path, id, end) = prepared(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 10;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let mut s = open(dir.path());
    // the committed offset never moves back, and the evidence stays on disk
    assert_eq!(committed_end(&s, &id, 1), end);
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(segment_state(&s, &id, 1), "damaged");
    let (first, last_seq, source): (i64, i64, i64) = s
        .db()
        .query_row(
            "SELECT first_seq, last_seq, source FROM output_truncations WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!((first, last_seq), (4, 4));
    assert_eq!(source, wire::TruncationSource::StorageLoss as i64);
    let open_incidents = incidents::open(s.db(), 10).unwrap();
    assert_eq!(open_incidents.len(), 1);
    assert_eq!(open_incidents[0].kind, wire::IncidentKind::ChecksumMismatch);
    assert!(open_incidents[0].data_loss);
    assert!(incidents::is_dirty(s.db(), wire::ScopeKind::Command, &text(&id)).unwrap());
    // a second recovery does not record the loss twice
    let again = s.recover(NOW + 1).unwrap();
    assert_eq!(again.segments_damaged, 0);
    assert_eq!(incidents::open(s.db(), 10).unwrap().len(), 1);
    // the command's scope is dirty: its events wait (nothing acknowledged)
    let r = s
        .append_events(&[output(&id, 5, b"after damage")], NOW)
        .unwrap();
    assert!(
        matches!(&r.outcomes[0], rvbox_store::events::EventOutcome::Refused(e)
            if e.code() == rvbox_domain::error::Code::Unavailable)
    );
    assert_ne!(r.acked.get(&id), Some(&5));
    // once the operator accepts the loss, new output goes to a fresh segment
    let incident = incidents::open(s.db(), 10).unwrap().remove(0);
    s.acknowledge_incident(
        &wire::AcknowledgeStorageIncidentRequest {
            request_id: text(&new_id()),
            incident_id: text(&incident.id),
            note: "disk replaced; one chunk lost".into(),
        },
        &rvbox_store::operator::Caller {
            transport: "test".into(),
            principal: String::new(),
        },
        NOW,
    )
    .unwrap();
    s.append_events(&[output(&id, 5, b"after damage")], NOW)
        .unwrap();
    assert_eq!(verify_output(&s, &id), vec![5]);
    assert_counters(&s);
}

#[test]
fn short_committed_range_is_missing_committed_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (path, id, end) = prepared(dir.path());
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(u64::try_from(end).unwrap() - 100).unwrap();
    drop(f);
    let s = open(dir.path());
    assert_eq!(committed_end(&s, &id, 1), end);
    let open_incidents = incidents::open(s.db(), 10).unwrap();
    assert_eq!(open_incidents.len(), 1);
    assert_eq!(
        open_incidents[0].kind,
        wire::IncidentKind::MissingCommittedBytes
    );
    let lost: i64 = s
        .db()
        .query_row(
            "SELECT last_seq - first_seq + 1 FROM output_truncations WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(lost, 1, "only the record cut short is lost");
}

#[test]
fn corrupt_committed_middle_keeps_the_records_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, id, _) = prepared(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    // damage the second record's payload (records start at 0, r1, r2)
    let first_len = rvbox_segment::decode(&bytes, &rvbox_store::store::record_limits())
        .unwrap()
        .len as usize;
    bytes[first_len + 200] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let s = open(dir.path());
    let (first, last): (i64, i64) = s
        .db()
        .query_row(
            "SELECT first_seq, last_seq FROM output_truncations WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((first, last), (3, 3), "exactly the damaged event is lost");
}

#[test]
fn orphan_segments_are_removed_and_foreign_files_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (_, id, _) = prepared(dir.path());
    let layout = rvbox_store::layout::Layout::new(dir.path());
    let orphan = layout.segment_path(&id, 7).unwrap();
    std::fs::write(&orphan, b"never committed").unwrap();
    let foreign = layout.segment_dir(&id).join("README.operator");
    std::fs::write(&foreign, b"keep me").unwrap();
    let mut s = open(dir.path());
    // orphans only cost space: the background scrub removes them
    assert!(orphan.exists());
    assert_eq!(s.scrub_cycle(NOW).unwrap().orphans_removed, 1);
    assert!(!orphan.exists());
    assert!(foreign.exists());
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4]);
}

#[test]
fn segment_files_of_the_flat_layout_move_into_their_directories() {
    let dir = tempfile::tempdir().unwrap();
    let (path, id, _) = prepared(dir.path());
    // the layout of earlier versions: every file directly in segments/
    let root = dir.path().join("segments");
    let flat = root.join(path.file_name().unwrap());
    std::fs::rename(&path, &flat).unwrap();
    std::fs::write(root.join("README.operator"), b"keep me").unwrap();
    let s = open(dir.path());
    assert!(!flat.exists());
    assert!(path.exists(), "moved to {}", path.display());
    assert!(root.join("README.operator").exists());
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4]);
    assert!(incidents::open(s.db(), 10).unwrap().is_empty());
}

#[test]
fn restart_closes_prior_live_sessions() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = open(dir.path());
        s.db()
            .execute("INSERT INTO clients (client_id) VALUES ('web-1')", [])
            .unwrap();
        s.db()
            .execute(
                "INSERT INTO sessions (session_id, client_id, instance_id, generation, opened_ms, live)
                 VALUES (zeroblob(16), 'web-1', zeroblob(16), 1, 0, 1)",
                [],
            )
            .unwrap();
    }
    let mut s = open(dir.path());
    let live: i64 = s
        .db()
        .query_row("SELECT COUNT(*) FROM sessions WHERE live = 1", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(live, 0);
    assert_eq!(s.recover(NOW).unwrap().sessions_closed, 0);
}

#[test]
fn counter_drift_is_recorded_and_rebuilt_by_the_background_recount() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = open(dir.path());
        running_command(&mut s, "web-1");
        s.db()
            .execute(
                "UPDATE clients SET charged_bytes = charged_bytes + 4096",
                [],
            )
            .unwrap();
        assert!(!s.check_counters().unwrap().consistent());
    }
    let mut s = open(dir.path());
    // a start no longer recounts; the scrub's recount finds and rebuilds
    assert!(!s.check_counters().unwrap().consistent());
    let r = s.scrub_cycle(NOW).unwrap();
    assert_eq!((r.counter_mismatches, r.cycle_completed), (1, true));
    assert_counters(&s);
    let all = incidents::list(s.db(), None, None, 10).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].kind, wire::IncidentKind::CounterMismatch);
    assert_eq!(all[0].state, wire::IncidentState::Repaired);
}
