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
    fresh_named(pg).1
}

/// A fresh database's name, and the store on it.
fn fresh_named(pg: &Postgres) -> (String, PgStore) {
    fresh_named_with(pg, StoreOptions::default())
}

/// A fresh database's name, and the store on it with `opts`.
fn fresh_named_with(pg: &Postgres, opts: StoreOptions) -> (String, PgStore) {
    let db = format!("case_{}", NEXT_DB.fetch_add(1, Ordering::Relaxed));
    pg.psql("postgres", &format!("CREATE DATABASE {db}"));
    let store = PgStore::connect(&pg.conninfo(&db), opts).expect("store on a fresh database");
    (db, store)
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
    fresh_with_options(pg, StoreOptions::default())
}

/// The store with `opts` and a reader on a fresh database.
fn fresh_with_options(pg: &Postgres, opts: StoreOptions) -> WithReader {
    let (_, store) = fresh_named_with(pg, opts);
    let reader = store.readers().open_pg().expect("a reader");
    WithReader { store, reader }
}

/// Output bytes kept outside the database, as an object store keeps them:
/// a map shared by the store and its readers.
type ChunkMap = std::collections::BTreeMap<([u8; 16], u64), rvbox_store_pg::output::OutputChunk>;

#[derive(Debug, Clone, Default)]
struct MemoryChunks(std::sync::Arc<std::sync::Mutex<ChunkMap>>);

/// The databases a test made.
static MEMORY_DBS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl rvbox_store_pg::output::OutputStore for MemoryChunks {
    fn put(
        &mut self,
        _tx: &mut postgres::Transaction<'_>,
        chunks: &[rvbox_store_pg::output::OutputChunk],
    ) -> Result<(), rvbox_store_pg::Fail> {
        let mut m = self.0.lock().unwrap();
        for c in chunks {
            m.insert((c.issue_uuid, c.event_seq), c.clone());
        }
        Ok(())
    }

    fn get(
        &mut self,
        _tx: &mut postgres::Transaction<'_>,
        issue: &[u8; 16],
        from_seq: u64,
        max: usize,
    ) -> Result<Vec<rvbox_store_pg::output::OutputChunk>, rvbox_store_pg::Fail> {
        let m = self.0.lock().unwrap();
        Ok(m.range((*issue, from_seq)..=(*issue, u64::MAX))
            .take(max)
            .map(|(_, c)| c.clone())
            .collect())
    }

    fn scan(
        &mut self,
        _tx: &mut postgres::Transaction<'_>,
        after: Option<([u8; 16], u64)>,
        max: usize,
    ) -> Result<Vec<rvbox_store_pg::output::OutputChunk>, rvbox_store_pg::Fail> {
        let m = self.0.lock().unwrap();
        let from = after.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        Ok(m.range((from, std::ops::Bound::Unbounded))
            .take(max)
            .map(|(_, c)| c.clone())
            .collect())
    }

    fn removed(
        &mut self,
        _tx: &mut postgres::Transaction<'_>,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<(), rvbox_store_pg::Fail> {
        self.0
            .lock()
            .unwrap()
            .retain(|(i, s), _| !(i == issue && (first..=last).contains(s)));
        Ok(())
    }
}

/// The store and a reader on a fresh database, with their output bytes in
/// one `MemoryChunks` map instead of the database.
fn fresh_with_memory(pg: &Postgres, chunks: &MemoryChunks) -> WithReader {
    let (db, mut store) = fresh_named(pg);
    MEMORY_DBS.lock().unwrap().push(db);
    store.set_output_store(Box::new(chunks.clone()));
    let mut reader = store.readers().open_pg().expect("a reader");
    reader.set_output_store(Box::new(chunks.clone()));
    WithReader { store, reader }
}

/// Every output byte goes through the output store: with the bytes kept
/// outside the database, the whole suite passes and `output_chunks` stays
/// empty (an S3-compatible store can take the bytes).
#[test]
fn conformance_with_output_outside_the_database() {
    let pg = Postgres::start();
    let chunks = MemoryChunks::default();
    rvbox_conformance::run_suite!(|| fresh_with_memory(&pg, &chunks));
    rvbox_conformance::run_read_suite!(|| fresh_with_memory(&pg, &chunks));
    assert!(
        !chunks.0.lock().unwrap().is_empty(),
        "the suite's output went to the output store"
    );
    for db in MEMORY_DBS.lock().unwrap().iter() {
        assert_eq!(
            pg.psql(db, "SELECT count(*) FROM output_chunks"),
            "0",
            "{db}: no byte in the database"
        );
    }
}

#[test]
fn conformance_on_postgres() {
    let pg = Postgres::start();
    rvbox_conformance::run_suite!(|| fresh(&pg));
    rvbox_conformance::run_read_suite!(|| fresh_with_reader(&pg));
    rvbox_conformance::run_pty_suite!(|opts| fresh_with_options(&pg, opts));
}
