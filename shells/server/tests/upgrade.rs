//! A data directory written by the server of schema version 11 (the one
//! before the audit chain, migration 12; fixtures/store-v11/README.md says
//! how it was made) opened by this binary: a backup of the stopped old
//! store is taken and restored (the restore migrates it), the server
//! starts on the fixture (migration 12 applies, the integrity check
//! passes), serves every command and every byte of its output as the old
//! server stored it, and after a graceful stop `rvbox-server audit verify`
//! passes, the records written before the upgrade counted as unchained.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rvbox_testkit::{Stack, bin, text};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/store-v11/data.tar.gz")
}

fn server_tool(args: &[&str]) -> Output {
    Command::new(bin("rvbox-server"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// What the old server ran (fixtures/store-v11/README.md): command text,
/// lifecycle, and the output the old server served for it (both streams
/// in event order: the client sent that stderr line first).
fn expected() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    vec![
        (
            "echo hello from the old schema",
            "LIFECYCLE_SUCCEEDED",
            b"hello from the old schema\n".to_vec(),
        ),
        (
            "printf 'to stdout\\n'; printf 'to stderr\\n' >&2; exit 3",
            "LIFECYCLE_FAILED",
            b"to stderr\nto stdout\n".to_vec(),
        ),
        (
            "seq 1 3000",
            "LIFECYCLE_SUCCEEDED",
            (1..=3000)
                .map(|i| format!("{i}\n"))
                .collect::<String>()
                .into_bytes(),
        ),
        (
            "echo written after the audit flush",
            "LIFECYCLE_SUCCEEDED",
            b"written after the audit flush\n".to_vec(),
        ),
    ]
}

fn number_after(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in {text}"));
    text[at + label.len()..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {label:?} in {text}"))
}

#[test]
fn a_store_of_the_previous_schema_opens_serves_and_verifies() {
    let mut s = Stack::configured();
    let dir = s.dir.path().to_path_buf();
    let untar = Command::new("tar")
        .arg("-xzf")
        .arg(fixture())
        .arg("-C")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(untar.status.success(), "{}", text(&untar.stderr));
    let data = dir.join("data");
    let data_arg = data.to_str().unwrap();

    // a backup of the stopped old store, restored by this binary
    let pre = dir.join("pre-upgrade");
    let said = ok(&server_tool(&[
        "backup",
        "--data-dir",
        data_arg,
        "--to",
        pre.to_str().unwrap(),
    ]));
    assert!(said.contains("schema version 11"), "{said}");
    assert!(said.contains(", 4 commands,"), "{said}");
    let said = ok(&server_tool(&[
        "restore",
        "--from",
        pre.to_str().unwrap(),
        "--data-dir",
        dir.join("restored").to_str().unwrap(),
    ]));
    assert!(said.contains("no open storage incidents"), "{said}");

    // the server on the old directory: migration 12, then ready
    s.start_server();
    let out = s.rvc(&["-o", "json", "list", "web-1"]);
    let v: serde_json::Value = serde_json::from_slice(&ok(&out).into_bytes()).unwrap();
    let commands = v["commands"].as_array().unwrap().clone();
    assert_eq!(commands.len(), 4, "{v}");
    for (command, lifecycle, bytes) in expected() {
        let c = commands
            .iter()
            .find(|c| c["spec"]["commandText"] == command)
            .unwrap_or_else(|| panic!("{command:?} is not listed: {v}"));
        assert_eq!(c["lifecycle"], lifecycle, "{c}");
        let id = c["issueUuid"].as_str().unwrap();
        let out = s.rvc(&["output", "web-1", id]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_eq!(out.stdout, bytes, "{command}");
        assert!(out.stderr.is_empty(), "{command}: {}", text(&out.stderr));
    }
    let incidents = s.rvc(&["-o", "json", "storage", "incidents"]);
    let v: serde_json::Value = serde_json::from_slice(&ok(&incidents).into_bytes()).unwrap();
    assert!(v["incidents"].as_array().is_none_or(Vec::is_empty), "{v}");
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());

    // the audit log: the old records unchained, the rest chained
    let said = ok(&server_tool(&["audit", "--data-dir", data_arg, "verify"]));
    assert!(
        said.contains("ok: every committed record matches the chain"),
        "{said}"
    );
    assert_eq!(
        number_after(&said, "unchained (older) records "),
        4,
        "{said}"
    );
    assert!(number_after(&said, "  chained records ") >= 2, "{said}");
    assert_eq!(number_after(&said, "waiting in the outbox "), 0, "{said}");
    let said = ok(&server_tool(&["repair", "--data-dir", data_arg, "list"]));
    assert!(said.contains("no open storage incidents"), "{said}");
    let said = ok(&server_tool(&[
        "backup",
        "--data-dir",
        data_arg,
        "--to",
        dir.join("post-upgrade").to_str().unwrap(),
    ]));
    assert!(said.contains("schema version 12"), "{said}");
}
