//! A read-only view of the store for other threads (plan §5.1: "liveness,
//! incident inspection, and unaffected scopes remain available throughout
//! best-effort recovery").
//!
//! The writer ([`Store`](crate::Store)) is single-threaded and may be busy
//! recovering or flushing; a [`StoreReader`] has its own read-only SQLite
//! connection (WAL readers never block the writer), so the control plane
//! can answer incident listings meanwhile. It can never write.

use rusqlite::{Connection, OpenFlags};
use rvbox_proto::v1 as wire;

use crate::db::DbOptions;
use crate::error::StoreError;
use crate::incidents::{self, Incident};
use crate::layout::Layout;

/// A read-only connection to a store's metadata.
#[derive(Debug)]
pub struct StoreReader {
    conn: Connection,
}

impl StoreReader {
    /// Opens a read-only connection to the database in `layout` (the
    /// writer must have opened the store first, which creates it).
    ///
    /// # Errors
    /// [`StoreError::Sqlite`] when the database cannot be opened.
    pub fn open(layout: &Layout, opts: DbOptions) -> Result<Self, StoreError> {
        let conn = Connection::open_with_flags(
            layout.db_file(),
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::sqlite("open read-only database", e))?;
        conn.busy_timeout(opts.busy_timeout)
            .map_err(|e| StoreError::sqlite("set busy_timeout", e))?;
        conn.execute_batch("PRAGMA query_only = ON; PRAGMA trusted_schema = OFF;")
            .map_err(|e| StoreError::sqlite("set read-only pragmas", e))?;
        crate::db::cache_statements(&conn)?;
        Ok(Self { conn })
    }

    /// A page of incidents, newest first (see [`incidents::list`]).
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn list_incidents(
        &self,
        state: Option<wire::IncidentState>,
        after: Option<(i64, [u8; 16])>,
        limit: u32,
    ) -> Result<Vec<Incident>, StoreError> {
        incidents::list(&self.conn, state, after, limit)
    }

    /// One incident by id.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn incident(&self, id: &[u8; 16]) -> Result<Option<Incident>, StoreError> {
        incidents::get(&self.conn, id)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::entropy::OsEntropy;
    use crate::fs::RealFs;
    use crate::{Store, StoreOptions};

    #[test]
    fn the_reader_cannot_write() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let _store = Store::open(
            layout.clone(),
            Arc::new(RealFs),
            Arc::new(OsEntropy),
            StoreOptions::default(),
            0,
        )
        .unwrap();
        let reader = StoreReader::open(&layout, DbOptions::default()).unwrap();
        assert!(reader.list_incidents(None, None, 10).unwrap().is_empty());
        assert!(
            reader
                .conn
                .execute("DELETE FROM storage_incidents", [])
                .is_err()
        );
        assert!(
            reader
                .conn
                .execute("INSERT INTO clients (client_id) VALUES ('x')", [])
                .is_err()
        );
    }
}
