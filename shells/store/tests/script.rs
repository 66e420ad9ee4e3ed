#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Scripts as command-owned blobs (plan §5.2, §5.3): small ones inline,
//! large ones in the command's blob segment under the committed-offset
//! protocol, read back verified, recovered like every segment.

mod support;

use std::sync::Arc;

use rvbox_proto::v1 as wire;
use rvbox_store::StoreOptions;
use rvbox_store::fs::{FaultKind, FaultOp, FaultyFs, StoreFs};
use rvbox_store::incidents;
use rvbox_store::mutations::OpError;
use support::*;

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

fn blob_path(dir: &std::path::Path, id: &[u8; 16]) -> std::path::PathBuf {
    rvbox_store::layout::Layout::new(dir)
        .segment_path(id, 0)
        .unwrap()
}

#[test]
fn a_small_script_stays_inline_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    let body = b"#!/bin/sh\necho deploying\n".to_vec();
    s.run_command(&script_request(&id, &body), NOW).unwrap();
    assert_eq!(s.script(&id).unwrap(), Some(body));
    assert!(!blob_path(dir.path(), &id).exists());
    let text_cmd = new_id();
    s.run_command(&run_request(&text_cmd, "web-1", "uptime"), NOW)
        .unwrap();
    assert_eq!(s.script(&text_cmd).unwrap(), None);
    assert_counters(&s);
}

#[test]
fn a_large_script_goes_to_its_blob_segment_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    let body = chunk(7, 3 * 1024 * 1024 + 123); // incompressible, 13 chunks
    s.run_command(&script_request(&id, &body), NOW).unwrap();
    assert!(blob_path(dir.path(), &id).exists());
    // private: the file is 0600, every directory below the data
    // directory 0700 (scripts are stored in plaintext)
    let mode = |p: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    };
    let blob = blob_path(dir.path(), &id);
    assert_eq!(mode(&blob), 0o600, "{}", blob.display());
    let mut d = blob.parent().unwrap();
    while d != dir.path() {
        assert_eq!(mode(d), 0o700, "{}", d.display());
        d = d.parent().unwrap();
    }
    let (state, end): (String, i64) = s
        .db()
        .query_row(
            "SELECT state, committed_end FROM command_segments WHERE issue_uuid = ?1 AND ordinal = 0",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(state, "blob");
    assert_eq!(
        u64::try_from(end).unwrap(),
        std::fs::metadata(blob_path(dir.path(), &id)).unwrap().len()
    );
    assert_eq!(s.script(&id).unwrap().unwrap(), body);
    // a replay stores nothing again and returns the same answer
    let again = s.run_command(&script_request(&id, &body), NOW).unwrap();
    assert_eq!(again.issue_uuid, text(&id));
    assert_counters(&s);
    drop(s);
    // a restart keeps it and recovery finds it clean
    let s = open(dir.path());
    assert_eq!(s.script(&id).unwrap().unwrap(), body);
    assert!(incidents::list(s.db(), None, None, 10).unwrap().is_empty());
}

#[test]
fn a_failed_blob_write_commits_nothing_and_a_retry_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
    let mut s = open_with(dir.path(), fs_dyn, StoreOptions::default());
    let id = new_id();
    let body = chunk(9, 512 * 1024);
    fs.inject(FaultOp::Sync, FaultKind::NoSpace);
    assert!(matches!(
        s.run_command(&script_request(&id, &body), NOW),
        Err(OpError::Store(_))
    ));
    assert!(!blob_path(dir.path(), &id).exists());
    let rows: i64 = s
        .db()
        .query_row("SELECT COUNT(*) FROM commands", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rows, 0);
    s.run_command(&script_request(&id, &body), NOW).unwrap();
    assert_eq!(s.script(&id).unwrap().unwrap(), body);
    assert_counters(&s);
}

#[test]
fn a_damaged_blob_interrupts_its_command_with_an_incident() {
    let dir = tempfile::tempdir().unwrap();
    let id = new_id();
    let body = chunk(11, 700 * 1024);
    {
        let mut s = open(dir.path());
        s.run_command(&script_request(&id, &body), NOW).unwrap();
    }
    let path = blob_path(dir.path(), &id);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[300_000] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let s = open(dir.path());
    let lifecycle: i64 = s
        .db()
        .query_row(
            "SELECT lifecycle FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(lifecycle, wire::Lifecycle::Interrupted as i64);
    let open_incidents = incidents::open(s.db(), 10).unwrap();
    assert_eq!(open_incidents.len(), 1);
    assert!(
        open_incidents[0].summary.contains("script"),
        "{}",
        open_incidents[0].summary
    );
    assert!(
        s.script(&id).is_err(),
        "a damaged script is an error, never partial bytes"
    );
    let tomb: i64 = s
        .db()
        .query_row(
            "SELECT COUNT(*) FROM command_tombstones WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tomb, 1);
}

#[test]
fn evicting_a_finished_command_removes_its_blob_segment() {
    use rvbox_domain::lifecycle::Lifecycle;
    use rvbox_store::retention::{EvictOutcome, EvictionCause};
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    s.run_command(&script_request(&id, &chunk(13, 600 * 1024)), NOW)
        .unwrap();
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    s.append_events(
        &[
            lifecycle(&id, 1, Lifecycle::Running),
            lifecycle(&id, 2, Lifecycle::Succeeded),
        ],
        NOW,
    )
    .unwrap();
    assert!(blob_path(dir.path(), &id).exists());
    assert!(matches!(
        s.evict_command(&id, EvictionCause::TerminalAge, NOW),
        Ok(EvictOutcome::Evicted { .. })
    ));
    assert!(!blob_path(dir.path(), &id).exists());
    assert_counters(&s);
}

#[test]
fn script_ranges_read_only_the_overlapping_chunks_and_join_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let big = new_id();
    let body = chunk(11, 3 * 1024 * 1024 + 123); // 13 stored chunks
    s.run_command(&script_request(&big, &body), NOW).unwrap();
    let size = body.len() as u64;
    // windows that start and end inside, on and across chunk boundaries
    for (from, len) in [
        (0u64, 1usize),
        (0, 256 * 1024),
        (256 * 1024 - 1, 2),
        (300_000, 1024 * 1024),
        (size - 10, 1024 * 1024),
        (size, 100),
        (size + 5, 100),
    ] {
        let (total, got) = s.script_range(&big, from, len).unwrap().unwrap();
        assert_eq!(total, size);
        let lo = usize::try_from(from.min(size)).unwrap();
        let hi = usize::try_from((from + len as u64).min(size)).unwrap();
        assert_eq!(got, body[lo..hi.max(lo)], "range {from}+{len}");
    }
    // consecutive windows rebuild the script
    let mut rebuilt = Vec::new();
    while (rebuilt.len() as u64) < size {
        let (_, part) = s
            .script_range(&big, rebuilt.len() as u64, 200_000)
            .unwrap()
            .unwrap();
        assert!(!part.is_empty());
        rebuilt.extend_from_slice(&part);
    }
    assert_eq!(rebuilt, body);

    // an inline script, and a text command
    let small = new_id();
    let inline = b"#!/bin/sh\necho hello\n".to_vec();
    s.run_command(&script_request(&small, &inline), NOW)
        .unwrap();
    assert_eq!(
        s.script_range(&small, 3, 5).unwrap(),
        Some((inline.len() as u64, inline[3..8].to_vec()))
    );
    let text_cmd = new_id();
    s.run_command(&run_request(&text_cmd, "web-1", "uptime"), NOW)
        .unwrap();
    assert_eq!(s.script_range(&text_cmd, 0, 10).unwrap(), None);
    assert_eq!(s.script_size(&text_cmd).unwrap(), None);
    assert_eq!(s.script_size(&big).unwrap(), Some(size));

    // a script that compresses well but is over one chunk raw is not kept
    // inline: a range of it never decodes more than 256 KiB
    let repetitive = new_id();
    let body = vec![b'#'; 300_000];
    s.run_command(&script_request(&repetitive, &body), NOW)
        .unwrap();
    assert!(blob_path(dir.path(), &repetitive).exists());
    assert_eq!(
        s.script_range(&repetitive, 299_990, 100).unwrap(),
        Some((300_000, body[299_990..].to_vec()))
    );
}

/// A script whose bytes do not match their descriptor is refused naming
/// `script`, nothing is stored, and the refusal is counted as a script
/// verification failure (plan §11.1); a matching one is not counted.
#[test]
fn a_script_that_does_not_match_its_descriptor_is_refused_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let failures = |s: &rvbox_store::Store| {
        s.metrics()
            .script_verification_failures
            .get_or_create(&rvbox_store::metrics::StepLabel { step: "upload" })
            .get()
    };
    let id = new_id();
    s.run_command(&script_request(&id, b"echo fine\n"), NOW)
        .unwrap();
    assert_eq!(failures(&s), 0);
    let bad = new_id();
    let mut req = script_request(&bad, b"echo fine\n");
    req.script = b"echo evil\n".to_vec();
    match s.run_command(&req, NOW) {
        Err(OpError::Refused(e)) => {
            assert_eq!(e.field(), "script");
            assert!(e.reason().contains("SHA-256"), "{}", e.reason());
        }
        other => panic!("expected a refusal: {other:?}"),
    }
    assert_eq!(failures(&s), 1);
    assert_eq!(s.script(&bad).ok().flatten(), None);
}
