#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! An I/O error during the start-up integrity check is not corruption
//! (docs/storage.md, "SQLite"): reads of the database fail with EIO under a
//! fault-injecting file layer (`tests/fault/eio_preload.c`, loaded with
//! `LD_PRELOAD` into a child process, failing the reads of every open of
//! the database after the writer's and the checkpointer's: the integrity
//! check's), and the store retries, then reports an I/O
//! failure (unavailable, counted, the start fails) without an integrity
//! incident; a transient error passes on a retry.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rvbox_store::health::ScopeState;
use rvbox_store::incidents;
use rvbox_store::layout::Layout;
use rvbox_store::metrics::StepLabel;
use rvbox_store::{Store, StoreOptions};
use support::*;

/// Builds the fault-injecting layer with the system C compiler.
fn shim(out: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fault/eio_preload.c");
    let lib = out.join("libeio_preload.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .arg("-lpthread")
        .status()
        .expect("a C compiler (cc) builds the fault-injecting file layer; install gcc");
    assert!(
        status.success(),
        "the fault-injecting file layer did not build"
    );
    lib
}

fn store_with_history(dir: &Path) {
    let mut s = open(dir);
    for i in 0..200 {
        let id = running_command(&mut s, &format!("web-{}", i % 5));
        s.append_events(&[output(&id, 2, &chunk(i, 2000))], NOW)
            .unwrap();
    }
}

/// Runs the child test below with the layer loaded.
fn run_child(dir: &Path, lib: &Path, reads: &str, expect: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_starts_under_read_errors",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_PRELOAD", lib)
        .env("RVBOX_FAULT_PATH", "/rvbox.sqlite3")
        // the writer's connection is the first open of the database and
        // the WAL checkpointer's the second; the integrity check's reads
        // (its prefetch, its connections) come after
        .env("RVBOX_FAULT_OPEN", "3")
        .env("RVBOX_FAULT_READS", reads)
        .env("RVBOX_FAULT_CHILD_DIR", dir)
        .env("RVBOX_FAULT_EXPECT", expect)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child: opens the store under the layer and checks what the start
/// reports. Does nothing outside a child.
#[test]
fn child_starts_under_read_errors() {
    let Some(dir) = std::env::var_os("RVBOX_FAULT_CHILD_DIR") else {
        return;
    };
    let expect = std::env::var("RVBOX_FAULT_EXPECT").unwrap();
    let mut s = Store::open(
        Layout::new(PathBuf::from(dir)),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(rvbox_store::entropy::OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let result = s.recover(NOW);
    let io_errors = s
        .metrics()
        .recovery
        .get_or_create(&StepLabel {
            step: "integrity_check_io_error",
        })
        .get();
    match expect.as_str() {
        "io" => {
            let e = result.expect_err("the start fails on an unreadable database");
            let text = e.to_string();
            assert!(
                text.to_ascii_lowercase().contains("i/o") || text.contains("IoErr"),
                "an I/O error, not a finding: {text}"
            );
            assert_eq!(s.health().global(), ScopeState::Unavailable);
            assert!(!s.health().report(NOW).ready);
            assert_eq!(io_errors, 1);
        }
        "passes" => {
            let report = result.unwrap();
            assert!(report.integrity_ok);
            assert_eq!(s.health().global(), ScopeState::Ready);
            assert_eq!(io_errors, 0);
        }
        other => panic!("unknown expectation {other}"),
    }
    // never an integrity incident for an I/O error
    assert!(incidents::list(s.db(), None, None, 10).unwrap().is_empty());
}

#[test]
fn a_read_error_in_the_start_up_integrity_check_is_not_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    store_with_history(&data);
    let lib = shim(dir.path());
    // every read of the check's connection fails: three attempts, then an
    // I/O failure
    run_child(&data, &lib, "-1", "io");
    // a transient error (the first two reads) passes on a retry
    run_child(&data, &lib, "2", "passes");
    // nothing was damaged: the store starts and serves, with no incident
    let s = open(&data);
    assert_eq!(s.health().global(), ScopeState::Ready);
    assert!(incidents::list(s.db(), None, None, 10).unwrap().is_empty());
    assert_counters(&s);
}
