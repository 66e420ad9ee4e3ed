#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The store-port conformance suite on the PostgreSQL store: one private
//! PostgreSQL instance on loopback for the test, a fresh database per
//! case.

use std::sync::atomic::{AtomicU32, Ordering};

use rvbox_store_pg::{PgStore, StoreOptions};
use rvbox_testkit::Postgres;

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

/// A fresh database on `pg`, migrated, and the store on it.
fn fresh(pg: &Postgres) -> PgStore {
    let db = format!("case_{}", NEXT_DB.fetch_add(1, Ordering::Relaxed));
    pg.psql("postgres", &format!("CREATE DATABASE {db}"));
    PgStore::connect(&pg.conninfo(&db), StoreOptions::default()).expect("store on a fresh database")
}

/// The store and a reader on a fresh database.
struct WithReader {
    store: PgStore,
    reader: rvbox_store_pg::PgReader,
}

impl rvbox_store_port::ops::Backend for WithReader {
    fn perform_batch(
        &mut self,
        ops: Vec<(
            rvbox_store_port::ops::OpToken,
            i64,
            rvbox_store_port::ops::StoreOp,
        )>,
    ) -> Vec<(
        rvbox_store_port::ops::OpToken,
        rvbox_store_port::ops::OpResult,
    )> {
        self.store.perform_batch(ops)
    }
}

impl rvbox_conformance::reads::WithReads for WithReader {
    fn reads(&mut self) -> &mut dyn rvbox_store::reader::ControlReads {
        &mut self.reader
    }
}

fn fresh_with_reader(pg: &Postgres) -> WithReader {
    let store = fresh(pg);
    let reader = store.readers().open_pg().expect("a reader");
    WithReader { store, reader }
}

#[test]
fn conformance_on_postgres() {
    let pg = Postgres::start();
    rvbox_conformance::run_suite!(|| fresh(&pg));
    rvbox_conformance::run_read_suite!(|| fresh_with_reader(&pg));
}
