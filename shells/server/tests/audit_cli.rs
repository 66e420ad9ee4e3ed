//! The audit log offline through `rvbox-server audit` (docs/storage.md,
//! "The audit chain"): a server that ran commands and stopped has its
//! whole audit log in segments; `verify` passes and prints the head,
//! `list` shows the operator's commands, and an edited record (its
//! checksums made to match) fails `verify` with exit 6 naming the segment.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Command;

use rvbox_testkit::{Stack, bin, text};

fn audit(s: &Stack, args: &[&str]) -> std::process::Output {
    Command::new(bin("rvbox-server"))
        .arg("audit")
        .arg("--data-dir")
        .arg(s.dir.path().join("data"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_stopped_servers_audit_log_verifies_and_an_edited_record_does_not() {
    let mut s = Stack::new();
    for i in 0..3 {
        let out = s.rvc(&["run", "web-1", &format!("echo {i}")]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    // a live server's store is locked
    let locked = audit(&s, &["verify"]);
    assert_eq!(locked.status.code(), Some(4), "{}", text(&locked.stderr));
    assert!(text(&locked.stderr).contains("stop the server first"));
    s.stop_client();
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());

    let ok = audit(&s, &["verify"]);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}{}",
        text(&ok.stdout),
        text(&ok.stderr)
    );
    let out = text(&ok.stdout);
    assert!(
        out.contains("ok: every committed record matches the chain"),
        "{out}"
    );
    assert!(
        out.contains("waiting in the outbox 0"),
        "the stop flushed the outbox: {out}"
    );
    let listed = text(&audit(&s, &["list"]).stdout);
    assert_eq!(
        listed
            .lines()
            .filter(|l| l.contains(" RunCommand ok client=web-1"))
            .count(),
        3,
        "{listed}"
    );

    // edit a RunCommand record: its action and every checksum recomputed
    let dir = s.dir.path().join("data/audit");
    let seg = dir.join(rvbox_segment::audit_file_name(1).unwrap());
    let bytes = std::fs::read(&seg).unwrap();
    let limits = rvbox_store::audit::audit_limits();
    let mut out = Vec::new();
    let mut off = 0;
    let mut edited = false;
    while off < bytes.len() {
        let d = rvbox_segment::decode(&bytes[off..], &limits).unwrap();
        let len = rvbox_segment::encoded_len(u32::try_from(d.payload.len()).unwrap()) as usize;
        let mut raw = zstd::bulk::decompress(d.payload, d.meta.raw_len as usize).unwrap();
        let mut rec = rvbox_store::audit::AuditRecord::decode(&raw).unwrap();
        if !edited && rec.action == "RunCommand" {
            rec.action = "GetCommand".into();
            raw = rec.encode();
            edited = true;
        }
        let mut meta = d.meta.clone();
        meta.raw_len = u32::try_from(raw.len()).unwrap();
        meta.sha256 = rvbox_segment::sha256(&raw);
        let stored = zstd::bulk::compress(&raw, 3).unwrap();
        out.extend(rvbox_segment::encode(&meta, &stored, &limits).unwrap());
        off += len;
    }
    assert!(edited);
    std::fs::write(&seg, &out).unwrap();
    let bad = audit(&s, &["verify"]);
    assert_eq!(bad.status.code(), Some(6), "{}", text(&bad.stdout));
    assert!(
        text(&bad.stdout).contains("problem: audit segment"),
        "{}",
        text(&bad.stdout)
    );
}
