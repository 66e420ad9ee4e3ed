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
    rvbox_conformance::run_cases!(
        || fresh(&pg);
        register_installs_a_live_session_and_a_newer_one_fences_it,
        register_refuses_a_stale_decision_and_changes_nothing,
        a_refused_live_claim_is_recorded_and_cleared_by_that_instance,
        close_session_ends_the_live_session_once,
        run_command_is_idempotent_by_request_id,
        run_command_refuses_a_reused_request_id_with_other_content,
        dispatch_and_acceptance_check_the_revision_they_saw,
        requeue_returns_a_dispatched_command_to_the_queue,
        a_rejection_ends_a_dispatched_command,
    );
}
