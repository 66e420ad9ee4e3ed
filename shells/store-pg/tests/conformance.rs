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

#[test]
fn conformance_on_postgres() {
    let pg = Postgres::start();
    rvbox_conformance::run_suite!(|| fresh(&pg));
}
