//! The WAL checkpointer: copying committed pages from the write-ahead log
//! into the database file runs on a thread and a connection of its own,
//! never inside the writer's commits.
//!
//! SQLite's default checkpoints on the committing connection whenever the
//! WAL passes 1,000 pages. That copy writes every page the last thousand
//! frames touched back into the database file and flushes it, and its cost
//! follows the store's history: at 1,000,000 commands the pages of a
//! checkpoint lie spread over a 1 GiB file, and the writer spent about
//! 90 µs per command lifecycle in it (against 20 µs at 10,000). Here the
//! writer only appends to the WAL and syncs it (what makes a commit
//! durable); this thread runs `PRAGMA wal_checkpoint(PASSIVE)` every
//! [`CHECKPOINT_INTERVAL`] while idle and every [`CHECKPOINT_BUSY_INTERVAL`]
//! while the last one copied frames, which never blocks the writer or a
//! reader and copies what no open snapshot still needs. The WAL restarts from its
//! beginning at the writer's next commit once a checkpoint copied all of
//! it.
//!
//! The writer keeps SQLite's own checkpoint at [`WRITER_FALLBACK_PAGES`]
//! as a bound: if this thread falls behind or fails, the WAL stops growing
//! there (docs/storage.md, "SQLite"). Crash safety is SQLite's: a
//! checkpoint cut short leaves the frames in the WAL, replayed at the next
//! open.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::db;
use crate::error::StoreError;

/// How often an idle checkpointer looks at the WAL.
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(100);

/// How soon it looks again after a checkpoint that copied frames: under
/// traffic it follows the writer closely, so that the writer's own
/// checkpoint finds (almost) everything copied and only restarts the WAL.
pub const CHECKPOINT_BUSY_INTERVAL: Duration = Duration::from_millis(5);

/// The writer's own checkpoint threshold (pages of the WAL, 16 MiB at the
/// 4 KiB page size). The WAL restarts from its beginning only when a
/// checkpoint has copied all of it before the next commit, which under
/// constant traffic is this one: it bounds the WAL (and what a start after
/// a crash reads of it), and copies only what the checkpointer has not.
pub const WRITER_FALLBACK_PAGES: u32 = 4_096;

/// Checkpointer counters, shared with the store's metrics.
#[derive(Clone, Debug, Default)]
pub struct CheckpointMetrics {
    /// Checkpoints that copied frames.
    pub checkpoints: prometheus_client::metrics::counter::Counter,
    /// Frames copied into the database file.
    pub frames: prometheus_client::metrics::counter::Counter,
    /// Checkpoints that failed (the writer's fallback bounds the WAL).
    pub errors: prometheus_client::metrics::counter::Counter,
    /// Frames in the WAL at the last checkpoint.
    pub wal_frames: prometheus_client::metrics::gauge::Gauge,
    /// Of those, the frames already copied (the lag is the difference).
    pub wal_backfilled: prometheus_client::metrics::gauge::Gauge,
}

#[derive(Debug, Default)]
struct Control {
    stop: bool,
}

/// The running checkpointer; stopping it (or dropping it) joins its
/// thread and closes its connection.
#[derive(Debug)]
pub struct Checkpointer {
    control: Arc<(Mutex<Control>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Opens the checkpointer's connection to `db_file` and starts its
    /// thread.
    ///
    /// # Errors
    /// Opening the connection, or spawning the thread.
    pub fn start(
        db_file: &Path,
        opts: db::DbOptions,
        metrics: CheckpointMetrics,
    ) -> Result<Self, StoreError> {
        let conn = db::open(db_file, opts)?;
        // the writer checkpoints when the last connection closes; this one
        // never does (a store closed as crashed must leave its WAL)
        conn.set_db_config(
            rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            true,
        )
        .map_err(|e| StoreError::sqlite("turn off the checkpointer's checkpoint on close", e))?;
        let control: Arc<(Mutex<Control>, Condvar)> = Arc::default();
        let theirs = Arc::clone(&control);
        let handle = std::thread::Builder::new()
            .name("rvbox-checkpoint".into())
            .spawn(move || run(&conn, &theirs, &metrics))
            .map_err(|e| StoreError::io("spawn the WAL checkpointer", db_file, e))?;
        Ok(Self {
            control,
            handle: Some(handle),
        })
    }

    fn stop(&mut self) {
        let (lock, cv) = &*self.control;
        lock.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        cv.notify_all();
        if let Some(h) = self.handle.take()
            && h.join().is_err()
        {
            tracing::error!("the WAL checkpointer's thread panicked");
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(conn: &rusqlite::Connection, control: &(Mutex<Control>, Condvar), m: &CheckpointMetrics) {
    let (lock, cv) = control;
    // SQLite reports the frames copied since the WAL last restarted
    let mut backfilled = 0i64;
    let mut interval = CHECKPOINT_INTERVAL;
    loop {
        {
            let guard = lock.lock().unwrap_or_else(PoisonError::into_inner);
            let (guard, _) = cv
                .wait_timeout_while(guard, interval, |c| !c.stop)
                .unwrap_or_else(PoisonError::into_inner);
            if guard.stop {
                return;
            }
        }
        match checkpoint(conn) {
            Ok((log, total)) => {
                m.wal_frames.set(log);
                m.wal_backfilled.set(total);
                // a smaller total: the WAL restarted since the last look
                let copied = if total >= backfilled {
                    total - backfilled
                } else {
                    total
                };
                backfilled = total;
                interval = if copied > 0 {
                    CHECKPOINT_BUSY_INTERVAL
                } else {
                    CHECKPOINT_INTERVAL
                };
                if copied > 0 {
                    m.checkpoints.inc();
                    m.frames.inc_by(copied.unsigned_abs());
                }
            }
            Err(e) => {
                m.errors.inc();
                tracing::warn!(error = %e, "WAL checkpoint failed; the writer's fallback bounds the WAL");
            }
        }
    }
}

/// One passive checkpoint: the WAL's frames, and those copied so far.
fn checkpoint(conn: &rusqlite::Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use db::Cached as _;

    #[test]
    fn the_checkpointer_copies_the_wal_while_the_writer_only_appends() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.sqlite3");
        let w = db::open(&file, db::DbOptions::default()).unwrap();
        w.execute_batch("PRAGMA wal_autocheckpoint = 0; CREATE TABLE t (x BLOB)")
            .unwrap();
        let m = CheckpointMetrics::default();
        let c = Checkpointer::start(&file, db::DbOptions::default(), m.clone()).unwrap();
        // one transaction of 200 pages: its frames are the WAL's (the WAL
        // restarts only at a later write)
        w.execute_batch("BEGIN").unwrap();
        for _ in 0..200 {
            w.execute_cached("INSERT INTO t VALUES (zeroblob(3000))", [])
                .unwrap();
        }
        w.execute_batch("COMMIT").unwrap();
        let t = std::time::Instant::now();
        let done = || m.wal_frames.get() >= 200 && m.wal_backfilled.get() == m.wal_frames.get();
        while !done() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            done(),
            "frames copied: {} of {}",
            m.wal_backfilled.get(),
            m.wal_frames.get()
        );
        assert!(m.frames.get() >= 200);
        assert!(m.checkpoints.get() >= 1);
        assert_eq!(m.errors.get(), 0);
        drop(c);
        // the rows are in the database file: a connection that never saw
        // the WAL reads them after the writer left without checkpointing
        w.set_db_config(
            rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            true,
        )
        .unwrap();
        drop(w);
        std::fs::remove_file(dir.path().join("t.sqlite3-wal")).unwrap();
        let r = db::open(&file, db::DbOptions::default()).unwrap();
        let n: i64 = r
            .query_row_cached("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 200);
    }
}
