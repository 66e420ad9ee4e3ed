//! Acceptance as one durable transition and the tombstone FIFO (plan
//! §7.1, §7.3; R-7.3-01..10, R-7.1-03).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;

use rvbox_client_core::accept::Refusal;
use rvbox_client_store::crash::{
    ACCEPT_AFTER_COMMIT, ACCEPT_BEFORE_COMMIT, TERMINAL_ACK_AFTER_COMMIT,
    TOMBSTONE_ROTATE_BEFORE_COMMIT,
};
use rvbox_client_store::{Accepted, ClientStore, ClientStoreOptions};
use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_storage::fs::{CrashMode, FaultyFs};
use support::{NOW, StopAt, checked, open, open_on, open_with, policy, reopen_after_crash};

fn refusal(a: Accepted) -> (wire::AcceptOutcome, Code) {
    match a {
        Accepted::Refused(Refusal::Answer { outcome, error }) => (outcome, error.code()),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn assert_counted(store: &ClientStore) {
    assert_eq!(store.counters().unwrap(), store.recount().unwrap());
}

#[test]
fn a_new_command_is_inserted_once_and_a_repeat_counts_no_second_slot() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let p = policy();
    let d = checked(1, "echo one");
    assert_eq!(store.accept(&p, &d, NOW).unwrap(), Accepted::New);
    let after_first = store.counters().unwrap();
    assert_eq!((after_first.queued, after_first.commands), (1, 1));
    assert!(after_first.metadata_bytes > p.closeout_reserve);
    assert_counted(&store);

    // the same dispatch again, and again with a higher revision
    assert_eq!(
        store.accept(&p, &d, NOW + 1).unwrap(),
        Accepted::Repeat {
            revision: 1,
            resolved_shell: wire::ShellType::Sh
        }
    );
    let mut raised = d.clone();
    raised.revision = 4;
    assert_eq!(
        store.accept(&p, &raised, NOW + 2).unwrap(),
        Accepted::Repeat {
            revision: 4,
            resolved_shell: wire::ShellType::Sh
        }
    );
    // a lower revision does not lower the stored one
    assert_eq!(
        store.accept(&p, &d, NOW + 3).unwrap(),
        Accepted::Repeat {
            revision: 4,
            resolved_shell: wire::ShellType::Sh
        }
    );
    assert_eq!(store.counters().unwrap(), after_first);

    // the same id with other content is a permanent conflict
    let mut other = checked(1, "echo other");
    other.issue = d.issue;
    assert_eq!(
        refusal(store.accept(&p, &other, NOW).unwrap()),
        (wire::AcceptOutcome::Permanent, Code::Conflict)
    );
    assert_counted(&store);
}

#[test]
fn capacity_is_the_servers_admission_rule_and_refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let p = policy(); // 2 running + 2 queued
    for n in 1..=4 {
        assert_eq!(
            store.accept(&p, &checked(n, "true"), NOW).unwrap(),
            Accepted::New
        );
    }
    let full = store.counters().unwrap();
    assert_eq!(
        refusal(store.accept(&p, &checked(5, "true"), NOW).unwrap()),
        (wire::AcceptOutcome::Transient, Code::CapacityExhausted)
    );
    assert_eq!(store.counters().unwrap(), full);
    // a budget too small for one more command's metadata
    let mut tight = policy();
    tight.max_queued = 100;
    tight.storage_budget = full.metadata_bytes + 1;
    assert_eq!(
        refusal(store.accept(&tight, &checked(6, "true"), NOW).unwrap()),
        (wire::AcceptOutcome::Transient, Code::QuotaExceeded)
    );
    assert_counted(&store);
}

#[test]
fn an_acknowledged_terminal_becomes_a_tombstone_that_refuses_a_replay() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let p = policy();
    let d = checked(1, "echo once");
    store.accept(&p, &d, NOW).unwrap();
    assert!(store.finish_acknowledged(&d.issue, NOW + 5).unwrap());
    assert!(
        !store.finish_acknowledged(&d.issue, NOW + 6).unwrap(),
        "a second acknowledgement finds nothing"
    );
    let c = store.counters().unwrap();
    assert_eq!(
        (c.commands, c.queued, c.tombstones, c.metadata_bytes),
        (0, 0, 1, 0)
    );
    assert_eq!(store.tombstone(&d.issue).unwrap(), Some(d.request_hash));
    assert_eq!(
        refusal(store.accept(&p, &d, NOW + 7).unwrap()),
        (wire::AcceptOutcome::Permanent, Code::AlreadyExecuted)
    );
    let mut other = checked(1, "echo changed");
    other.issue = d.issue;
    assert_eq!(
        refusal(store.accept(&p, &other, NOW + 8).unwrap()),
        (wire::AcceptOutcome::Permanent, Code::Conflict)
    );
    assert_counted(&store);
}

#[test]
fn the_tombstone_fifo_keeps_the_newest_entries_up_to_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open_with(
        dir.path(),
        ClientStoreOptions {
            tombstone_cap: 3,
            ..ClientStoreOptions::default()
        },
    );
    let mut p = policy();
    p.max_queued = 100;
    let ds: Vec<_> = (1..=5).map(|n| checked(n, "true")).collect();
    for d in &ds {
        store.accept(&p, d, NOW).unwrap();
        store.finish_acknowledged(&d.issue, NOW).unwrap();
    }
    assert_eq!(store.counters().unwrap().tombstones, 3);
    for (i, d) in ds.iter().enumerate() {
        let held = store.tombstone(&d.issue).unwrap().is_some();
        assert_eq!(held, i >= 2, "tombstone {i}");
    }
    assert_counted(&store);
}

fn crash_at(point: &'static str, then: impl FnOnce(&mut ClientStore)) -> ClientStore {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let mut store = open_on(&root, fs.clone(), Arc::new(rvbox_storage::crash::NoCrash));
    store.set_crash_hook(Arc::new(StopAt::new(point)));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| then(&mut store)));
    assert!(crashed.is_err(), "{point} was not reached");
    store.close_as_crashed();
    let reopened = reopen_after_crash(&root, &fs, CrashMode::LoseUnsynced);
    // keep the directory alive with the store
    std::mem::forget(dir);
    reopened
}

#[test]
fn a_crash_before_the_acceptance_commit_leaves_no_partial_command() {
    let d = checked(1, "echo x");
    let mut store = crash_at(ACCEPT_BEFORE_COMMIT, |s| {
        s.accept(&policy(), &d, NOW).unwrap();
    });
    assert_eq!(store.counters().unwrap().commands, 0);
    assert_counted(&store);
    // the server's retry is a first acceptance
    assert_eq!(store.accept(&policy(), &d, NOW).unwrap(), Accepted::New);
}

#[test]
fn a_crash_after_the_acceptance_commit_keeps_it_and_a_retry_is_the_same_acceptance() {
    let d = checked(1, "echo x");
    let mut store = crash_at(ACCEPT_AFTER_COMMIT, |s| {
        s.accept(&policy(), &d, NOW).unwrap();
    });
    assert_eq!(store.counters().unwrap().commands, 1);
    assert_eq!(
        store.accept(&policy(), &d, NOW).unwrap(),
        Accepted::Repeat {
            revision: 1,
            resolved_shell: wire::ShellType::Sh
        }
    );
    assert_counted(&store);
}

#[test]
fn a_crash_around_the_terminal_acknowledgement_is_all_or_nothing() {
    let d = checked(1, "echo x");
    // after the commit: the tombstone holds
    let mut store = crash_at(TERMINAL_ACK_AFTER_COMMIT, |s| {
        s.accept(&policy(), &d, NOW).unwrap();
        s.finish_acknowledged(&d.issue, NOW).unwrap();
    });
    assert_eq!(store.tombstone(&d.issue).unwrap(), Some(d.request_hash));
    assert_eq!(store.counters().unwrap().commands, 0);
    assert!(matches!(
        store.accept(&policy(), &d, NOW).unwrap(),
        Accepted::Refused(_)
    ));
    assert_counted(&store);
}

#[test]
fn a_crash_inside_a_rotation_keeps_the_command_and_the_old_tombstones() {
    let ds: Vec<_> = (1..=3).map(|n| checked(n, "true")).collect();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let mut store = open_on(&root, fs.clone(), Arc::new(rvbox_storage::crash::NoCrash));
    drop(store);
    store = rvbox_client_store::ClientStore::open_with_hook(
        rvbox_client_store::ClientLayout::new(&root),
        fs.clone(),
        Arc::new(rvbox_storage::entropy::OsEntropy),
        Arc::new(rvbox_storage::crash::NoCrash),
        ClientStoreOptions {
            tombstone_cap: 2,
            ..ClientStoreOptions::default()
        },
        NOW,
    )
    .unwrap();
    let p = policy();
    for d in &ds {
        store.accept(&p, d, NOW).unwrap();
    }
    store.finish_acknowledged(&ds[0].issue, NOW).unwrap();
    store.finish_acknowledged(&ds[1].issue, NOW).unwrap();
    store.set_crash_hook(Arc::new(StopAt::new(TOMBSTONE_ROTATE_BEFORE_COMMIT)));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.finish_acknowledged(&ds[2].issue, NOW).unwrap();
    }));
    assert!(crashed.is_err());
    store.close_as_crashed();
    let store = reopen_after_crash(&root, &fs, CrashMode::LoseUnsynced);
    assert_eq!(
        store.counters().unwrap().commands,
        1,
        "the third is still held"
    );
    assert!(store.tombstone(&ds[0].issue).unwrap().is_some());
    assert!(store.tombstone(&ds[2].issue).unwrap().is_none());
    assert_counted(&store);
}

/// `spool.free_space_floor`: the filesystem of the state directory is
/// measured with every acceptance; below the floor a new command is
/// refused as transient, naming the key, and nothing is stored; a
/// command already held is still answered as a repeat.
#[test]
fn below_the_free_space_floor_a_new_command_is_refused_as_transient() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let d = checked(1, "echo held");
    assert_eq!(store.accept(&policy(), &d, NOW).unwrap(), Accepted::New);
    let mut p = policy();
    // more than any disk here has free
    p.free_space_floor = u64::MAX / 2;
    let fresh = checked(2, "echo new");
    match store.accept(&p, &fresh, NOW + 1).unwrap() {
        Accepted::Refused(Refusal::Answer { outcome, error }) => {
            assert_eq!(
                (outcome, error.code()),
                (wire::AcceptOutcome::Transient, Code::QuotaExceeded)
            );
            assert!(
                error.reason().contains("spool.free_space_floor"),
                "{}",
                error.reason()
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(store.counters().unwrap().commands, 1, "nothing stored");
    assert!(matches!(
        store.accept(&p, &d, NOW + 2).unwrap(),
        Accepted::Repeat { .. }
    ));
}
