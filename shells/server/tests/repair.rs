#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The offline repair tool against a real store: it refuses a live store,
//! lists a recorded loss, refuses to "repair" it, and acknowledges it.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::events::{EventAppend, EventBody};
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

const NOW: i64 = 1_800_000_000_000;

fn repair(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rvbox-server"))
        .arg("repair")
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

fn open(dir: &Path) -> Store {
    let mut s = Store::open(
        Layout::new(dir),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    s.recover(NOW).unwrap();
    s
}

/// A store whose only command has one committed output record corrupted.
fn damaged_store(dir: &Path) {
    let mut s = open(dir);
    let id = uuid_v7(&OsEntropy, NOW).unwrap();
    let req = wire::RunCommandRequest {
        request_id: uuid::Uuid::from_bytes(id).hyphenated().to_string(),
        client_id: "web-1".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("backup".into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    };
    s.run_command(&req, NOW).unwrap();
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    let running = EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: 1,
        observed_ms: NOW,
        body: EventBody::Lifecycle {
            to: Lifecycle::Running,
            exit_code: None,
            exit_signal: None,
            encoded: vec![4],
        },
    };
    let out = EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: 2,
        observed_ms: NOW,
        body: EventBody::Output {
            stream: rvbox_segment::Stream::Stdout,
            compression: rvbox_segment::Compression::Zstd,
            raw_len: 5,
            stored: zstd::bulk::compress(b"hello", 1).unwrap(),
        },
    };
    s.append_events(&[running, out], NOW).unwrap();
    drop(s);
    let seg = Layout::new(dir).segment_path(&id, 1).unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let n = bytes.len();
    bytes[n - 8] ^= 0xff;
    std::fs::write(&seg, bytes).unwrap();
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn lists_refuses_to_repair_loss_and_acknowledges_it() {
    let dir = tempfile::tempdir().unwrap();
    damaged_store(dir.path());

    let out = repair(dir.path(), &["list"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    assert!(
        text.contains("checksum_mismatch") && text.contains("open"),
        "{text}"
    );
    let id = text
        .lines()
        .nth(2)
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();

    let out = repair(dir.path(), &["repair", &id]);
    assert_eq!(
        out.status.code(),
        Some(i32::from(Code::RequiresAcknowledgement.exit_status()))
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("acknowledge"));

    let out = repair(
        dir.path(),
        &["acknowledge", &id, "--note", "disk replaced; output lost"],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout(&out).contains("acknowledged"));

    let out = repair(dir.path(), &["list"]);
    assert!(stdout(&out).contains("no open storage incidents"));
    let out = repair(dir.path(), &["list", "--all"]);
    assert!(stdout(&out).contains("acknowledged"));
}

#[test]
fn refuses_a_live_store_and_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let live = open(dir.path());
    let out = repair(dir.path(), &["list"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("stop the server first"));
    drop(live);
    assert_eq!(repair(dir.path(), &["list"]).status.code(), Some(0));

    let empty = tempfile::tempdir().unwrap();
    let out = repair(empty.path(), &["list"]);
    assert_eq!(out.status.code(), Some(5));
    assert!(
        !empty.path().join("db").exists(),
        "repair must not create a store"
    );
}
