//! The installation's identity (plan §7.1, R-7.1-05..07): created once,
//! atomically; a damaged or missing file makes the store dirty and goes
//! through repair, never a silent new installation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use rvbox_client_store::crash::IDENTITY_BEFORE_RENAME;
use rvbox_client_store::identity::{self, IDENTITY_LEN};
use rvbox_client_store::{ClientStore, LocalHealth, StoreError};
use rvbox_storage::fs::{CrashMode, FaultyFs};
use support::{NOW, StopAt, open, open_on, reopen_after_crash};

#[test]
fn a_fresh_store_creates_one_private_identity_and_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let store = open(&root);
    let id = store.instance_id().expect("a fresh store has an identity");
    assert_eq!(store.health().unwrap(), LocalHealth::Ready);
    let file = root.join("instance_id");
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(meta.len(), IDENTITY_LEN as u64);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let dir_mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700);
    // a second process is refused while the first holds the store
    assert!(matches!(
        ClientStore::open(
            rvbox_client_store::ClientLayout::new(&root),
            Arc::new(rvbox_storage::fs::RealFs),
            Arc::new(rvbox_storage::entropy::OsEntropy),
            Default::default(),
            NOW,
        ),
        Err(StoreError::Locked { .. })
    ));
    drop(store);
    for _ in 0..3 {
        assert_eq!(open(&root).instance_id(), Some(id));
    }
}

#[test]
fn a_damaged_identity_is_dirty_until_repaired_from_the_stores_copy() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let id = open(&root).instance_id().unwrap();
    let file = root.join("instance_id");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[10] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();

    let store = open(&root);
    assert_eq!(
        store.instance_id(),
        None,
        "a damaged identity is never used"
    );
    assert_eq!(store.health().unwrap(), LocalHealth::Dirty);
    assert_eq!(
        store.reconcile_health().unwrap(),
        rvbox_proto::v1::ScopeState::Unavailable,
        "a damaged identity is essential: no reconciliation completes"
    );
    let incidents = store.incidents().unwrap();
    assert_eq!(incidents.len(), 1);
    assert!(
        incidents[0].summary.contains("damaged"),
        "{}",
        incidents[0].summary
    );
    drop(store);
    // opening again records no second incident for the same damage
    let mut store = open(&root);
    assert_eq!(store.incidents().unwrap().len(), 1);
    // the file was not replaced by a new identity
    assert_eq!(std::fs::read(&file).unwrap(), bytes);

    let incident = store.incidents().unwrap()[0].incident_id;
    let said = store.repair(&incident, NOW + 1).unwrap();
    assert!(said.contains(&id.to_string()), "{said}");
    assert_eq!(store.instance_id(), Some(id));
    assert_eq!(store.health().unwrap(), LocalHealth::Ready);
    // a resolved incident cannot be repaired again
    assert!(store.repair(&incident, NOW + 2).is_err());
    drop(store);
    let store = open(&root);
    assert_eq!(store.instance_id(), Some(id));
    assert_eq!(store.health().unwrap(), LocalHealth::Ready);
}

#[test]
fn a_missing_identity_of_a_store_with_state_is_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let id = open(&root).instance_id().unwrap();
    std::fs::remove_file(root.join("instance_id")).unwrap();
    let mut store = open(&root);
    assert_eq!(store.instance_id(), None);
    assert_eq!(store.health().unwrap(), LocalHealth::Dirty);
    assert!(!root.join("instance_id").exists(), "no silent new identity");
    let incident = store.incidents().unwrap()[0].incident_id;
    store.repair(&incident, NOW + 1).unwrap();
    assert_eq!(store.instance_id(), Some(id));
}

#[test]
fn without_a_copy_only_an_acknowledged_incident_starts_a_new_installation() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let id = open(&root).instance_id().unwrap();
    // damage the file and remove the store's copy: nothing to repair from
    std::fs::write(root.join("instance_id"), b"garbage").unwrap();
    {
        let c = rusqlite::Connection::open(root.join("db/client.sqlite3")).unwrap();
        c.execute("DELETE FROM client_meta WHERE key = 'instance_id'", [])
            .unwrap();
    }
    let mut store = open(&root);
    assert_eq!(store.instance_id(), None);
    let incident = store.incidents().unwrap()[0].incident_id;
    let refused = store.repair(&incident, NOW + 1).unwrap_err().to_string();
    assert!(refused.contains("acknowledge"), "{refused}");
    assert!(store.acknowledge(&incident, "  ", NOW + 1).is_err());
    let said = store
        .acknowledge(&incident, "disk replaced; re-enrolling", NOW + 2)
        .unwrap();
    let new = store.instance_id().unwrap();
    assert_ne!(new, id);
    assert!(said.contains(&new.to_string()), "{said}");
    assert_eq!(store.health().unwrap(), LocalHealth::Ready);
    let listed = store.incidents().unwrap();
    assert_eq!(
        listed[0].note.as_deref(),
        Some("disk replaced; re-enrolling")
    );
    drop(store);
    assert_eq!(open(&root).instance_id(), Some(new));
}

#[test]
fn a_crash_before_the_rename_leaves_no_identity_and_no_debris() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let hook = Arc::new(StopAt::new(IDENTITY_BEFORE_RENAME));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        open_on(&root, fs.clone(), hook)
    }));
    assert!(
        crashed.is_err(),
        "the hook stops the open before the rename"
    );
    assert!(!root.join("instance_id").exists());
    let store = reopen_after_crash(&root, &fs, CrashMode::LoseUnsynced);
    let id = store
        .instance_id()
        .expect("nothing was registered: a new id");
    assert!(!root.join("instance_id.tmp").exists());
    assert_eq!(
        identity::read(&rvbox_storage::fs::RealFs, &root.join("instance_id")),
        identity::IdentityFile::Valid(id)
    );
}
