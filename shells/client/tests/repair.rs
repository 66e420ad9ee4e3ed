//! `rvbox repair --state-dir DIR` (plan §7.1): lists, repairs and
//! acknowledges local incidents offline, and refuses a live store.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;

fn open(root: &Path) -> ClientStore {
    ClientStore::open(
        ClientLayout::new(root),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        ClientStoreOptions::default(),
        0,
    )
    .unwrap()
}

fn repair(root: &Path, args: &[&str]) -> (i32, String, String) {
    // Another test of this binary may be forking a child right now;
    // between fork and exec the child holds a copy of every descriptor,
    // the just-dropped store's lock file included, so the tool may briefly
    // find the store locked (exit 4): try again for a moment rather than
    // flake.
    let mut tries = 0;
    loop {
        let out = Command::new(env!("CARGO_BIN_EXE_rvbox"))
            .arg("repair")
            .arg("--state-dir")
            .arg(root)
            .args(args)
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or(-1);
        if code == 4 && tries < 100 {
            tries += 1;
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        return (
            code,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
    }
}

fn damage_identity(root: &Path) {
    let file = root.join("instance_id");
    let mut b = std::fs::read(&file).unwrap();
    b[9] ^= 0x55;
    std::fs::write(&file, b).unwrap();
}

#[test]
fn a_damaged_identity_is_listed_repaired_and_then_clean() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let id = open(&root).instance_id().unwrap();
    damage_identity(&root);

    let (code, out, err) = repair(&root, &["list"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("checksum_mismatch"), "{out}");
    assert!(out.contains("damaged"), "{out}");
    let incident = out
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();

    let (code, out, err) = repair(&root, &["repair", &incident]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&id.to_string()), "{out}");
    let (code, out, _) = repair(&root, &["list"]);
    assert_eq!(code, 0);
    assert!(out.contains("no open local incidents"), "{out}");
    let (code, out, _) = repair(&root, &["list", "--all"]);
    assert_eq!(code, 0);
    assert!(out.contains("repaired"), "{out}");
    assert_eq!(open(&root).instance_id(), Some(id));
    // a second repair of the same incident is refused
    let (code, _, err) = repair(&root, &["repair", &incident]);
    assert_eq!(code, 6, "{err}");
}

#[test]
fn a_live_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let live = open(&root);
    let (code, _, err) = repair(&root, &["list"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("stop the client daemon"), "{err}");
    drop(live);
    assert_eq!(repair(&root, &["list"]).0, 0);
}

#[test]
fn acknowledging_a_lost_identity_without_a_copy_starts_a_new_installation() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let old = open(&root).instance_id().unwrap();
    damage_identity(&root);
    {
        let c = rusqlite::Connection::open(root.join("db/client.sqlite3")).unwrap();
        c.execute("DELETE FROM client_meta WHERE key = 'instance_id'", [])
            .unwrap();
    }
    let (_, out, _) = repair(&root, &["list"]);
    let incident = out
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();
    let (code, _, err) = repair(&root, &["repair", &incident]);
    assert_eq!(code, 6);
    assert!(err.contains("acknowledge"), "{err}");
    let (code, out, err) = repair(
        &root,
        &["acknowledge", &incident, "--note", "disk replaced"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("new installation"), "{out}");
    let new = open(&root).instance_id().unwrap();
    assert_ne!(new, old);
}

#[test]
fn a_directory_without_a_store_and_a_bad_id_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = repair(dir.path(), &["list"]);
    assert_eq!(code, 5);
    assert!(err.contains("no RVBox client store"), "{err}");
    let root = dir.path().join("state");
    drop(open(&root));
    let (code, _, err) = repair(&root, &["repair", "not-a-uuid"]);
    assert_eq!(code, 2);
    assert!(err.contains("UUID"), "{err}");
}
