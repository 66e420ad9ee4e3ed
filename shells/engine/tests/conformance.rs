#![allow(clippy::expect_used)]
//! The store-port conformance suite on the SQLite store, through the
//! executor the server runs.

#[path = "../../store/tests/support/mod.rs"]
mod support;

use rvbox_engine::Executor;
use rvbox_store_port::ops::{Backend, OpResult, OpToken, StoreOp};

/// A fresh store in its own temporary directory, with a reader beside
/// its writer (as the server's control reads have).
struct Sqlite {
    exec: Executor,
    reader: Box<dyn rvbox_store::reader::ControlReads>,
    _dir: tempfile::TempDir,
}

impl Backend for Sqlite {
    fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        self.exec.perform_batch(ops)
    }
}

fn fresh() -> Sqlite {
    fresh_with(rvbox_store::StoreOptions::default())
}

/// [`fresh`], with `opts`.
fn fresh_with(opts: rvbox_store::StoreOptions) -> Sqlite {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = support::open_with(
        dir.path(),
        std::sync::Arc::new(rvbox_store::fs::RealFs),
        opts,
    );
    let reader = Box::new(store.read_handle().open().expect("a reader"));
    Sqlite {
        exec: Executor::new(store),
        reader,
        _dir: dir,
    }
}

impl rvbox_conformance::reads::WithReads for Sqlite {
    fn reads(&mut self) -> &mut dyn rvbox_store::reader::ControlReads {
        self.reader.as_mut()
    }
}

rvbox_conformance::suite!(fresh);

mod reads {
    use super::fresh;
    rvbox_conformance::read_suite!(fresh);
}

mod pty {
    use super::fresh_with;
    rvbox_conformance::pty_suite!(fresh_with);
}
