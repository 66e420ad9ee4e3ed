#![allow(clippy::expect_used)]
//! The store-port conformance suite on the SQLite store, through the
//! executor the server runs.

#[path = "../../store/tests/support/mod.rs"]
mod support;

use rvbox_engine::Executor;
use rvbox_store_port::ops::{Backend, OpResult, OpToken, StoreOp};

/// A fresh store in its own temporary directory.
struct Sqlite {
    exec: Executor,
    _dir: tempfile::TempDir,
}

impl Backend for Sqlite {
    fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        self.exec.perform_batch(ops)
    }
}

fn fresh() -> Sqlite {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = support::open(dir.path());
    Sqlite {
        exec: Executor::new(store),
        _dir: dir,
    }
}

rvbox_conformance::suite!(fresh);
