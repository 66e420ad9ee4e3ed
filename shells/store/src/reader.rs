//! A read-only view of the store for other threads (plan §5.1: "liveness,
//! incident inspection, and unaffected scopes remain available throughout
//! best-effort recovery"; plan §6.1: control reads never wait behind the
//! writer).
//!
//! The writer ([`Store`](crate::Store)) is single-threaded and may be busy
//! recovering or flushing a group; a [`StoreReader`] has its own read-only
//! SQLite connection (WAL readers never block the writer and the writer
//! never blocks them), so the control plane answers `GetCommand`,
//! `FollowCommand` history, `GetOutput` and incident listings meanwhile.
//! It can never write: the connection is opened read-only and
//! `query_only`.
//!
//! Each read runs in one read transaction, so it sees one committed
//! snapshot. A snapshot may name a segment file that the writer's
//! retention removed after the snapshot began (the file is unlinked only
//! after the removal commits); such a read is retried on a fresh snapshot,
//! which reports the removal as a retention record instead.

use std::sync::Arc;

use rusqlite::{Connection, OpenFlags};
use rvbox_proto::v1 as wire;

use crate::commands::CommandView;
use crate::db::DbOptions;
use crate::error::StoreError;
use crate::fs::StoreFs;
use crate::health::Health;
use crate::identity::TOKEN_KEY_LEN;
use crate::incidents::{self, Incident};
use crate::layout::Layout;
use crate::mutations::OpError;
use crate::output::{HistoryItem, ReadSide};

/// How many snapshots a read tries when segment files vanish under it.
pub const READ_ATTEMPTS: usize = 3;

/// A read-only connection to a store's metadata and segments.
pub struct StoreReader {
    conn: Connection,
    fs: Arc<dyn StoreFs>,
    layout: Layout,
    token_key: [u8; TOKEN_KEY_LEN],
    health: Health,
}

impl std::fmt::Debug for StoreReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreReader")
            .field("data_dir", &self.layout.root())
            .finish_non_exhaustive()
    }
}

impl StoreReader {
    /// Opens a read-only connection to the database in `layout`. The
    /// writer must have opened the store first (which creates the database
    /// and the token key); [`Store::reader`](crate::Store::reader) is the
    /// usual way in.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`] when the database cannot be opened.
    pub fn open(
        layout: &Layout,
        fs: Arc<dyn StoreFs>,
        token_key: [u8; TOKEN_KEY_LEN],
        opts: DbOptions,
        health: Health,
    ) -> Result<Self, StoreError> {
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
        Ok(Self {
            conn,
            fs,
            layout: layout.clone(),
            token_key,
            health,
        })
    }

    /// Calls `f` with the text of every statement this connection starts
    /// (`None` stops): the query-plan check of the reads, and diagnostics.
    ///
    /// # Errors
    /// A SQLite failure.
    pub fn trace_statements<F>(&mut self, f: Option<F>) -> Result<(), StoreError>
    where
        F: FnMut(&str) + Send + 'static,
    {
        crate::store::trace_statements(&mut self.conn, f)
    }

    fn side(&self) -> ReadSide<'_> {
        ReadSide {
            conn: &self.conn,
            fs: self.fs.as_ref(),
            layout: &self.layout,
            token_key: self.token_key,
        }
    }

    /// Runs a read, again on a fresh snapshot when a segment file it named
    /// was removed under it.
    fn retrying<T>(
        &self,
        what: &str,
        read: impl Fn(&ReadSide<'_>) -> Result<T, OpError>,
    ) -> Result<T, OpError> {
        let mut attempt = 1;
        loop {
            match read(&self.side()) {
                Err(OpError::Store(StoreError::Io { source, .. }))
                    if source.kind() == std::io::ErrorKind::NotFound && attempt < READ_ATTEMPTS =>
                {
                    tracing::debug!(
                        read = what,
                        attempt,
                        "segment removed under a read; retrying on a fresh snapshot"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// `GetCommand`: one command's stored state.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    pub fn command_view(&self, issue: &[u8; 16]) -> Result<CommandView, OpError> {
        crate::commands::load_view(&self.conn, issue)
    }

    /// `GetOutput`: one page of a command's raw output (see
    /// [`Store::get_output`](crate::Store::get_output) for the page rules).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad request or page token, `NOT_FOUND` for
    /// an unknown or reclaimed command, and [`OpError::Store`] when the
    /// store failed or a stored record failed verification.
    pub fn get_output(
        &self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError> {
        self.retrying("get_output", |side| side.get_output(req))
    }

    /// `FollowCommand` history: a command's stored events after
    /// `after_event_seq`, at most `limit` (see
    /// [`Store::events_after`](crate::Store::events_after)).
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown or reclaimed command; [`OpError::Store`]
    /// when the store failed or a stored record failed verification.
    pub fn events_after(
        &self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError> {
        self.retrying("events_after", |side| {
            side.events_after(issue, after_event_seq, limit)
        })
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

    /// Runs `read` in one read transaction: every statement of it sees the
    /// same committed snapshot.
    fn snapshot<T>(
        &self,
        read: impl FnOnce(&Connection) -> Result<T, OpError>,
    ) -> Result<T, OpError> {
        let tx = self
            .conn
            .unchecked_transaction()
            .map_err(|e| StoreError::sqlite("begin read", e))?;
        let out = read(&tx);
        // a read-only transaction: ending it commits nothing
        drop(tx);
        out
    }

    /// `GetCommand`: one command's operator record.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    pub fn command_record(&self, issue: &[u8; 16]) -> Result<wire::CommandRecord, OpError> {
        self.snapshot(|c| crate::records::command_record(c, &self.health, issue))
    }

    /// `ListCommands`: one page (see [`crate::records::list_commands`]).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad page size or token, or a store failure.
    pub fn list_commands(
        &self,
        req: &wire::ListCommandsRequest,
    ) -> Result<wire::ListCommandsResponse, OpError> {
        self.snapshot(|c| crate::records::list_commands(c, &self.health, self.token_key, req))
    }

    /// `ListClients`: one page by client id.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad page size or token, or a store failure.
    pub fn list_clients(
        &self,
        req: &wire::ListClientsRequest,
    ) -> Result<wire::ListClientsResponse, OpError> {
        self.snapshot(|c| crate::records::list_clients(c, &self.health, self.token_key, req))
    }

    /// `ListStorageIncidents`: one page, newest first.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad page size, state or token, or a store
    /// failure.
    pub fn incident_page(
        &self,
        req: &wire::ListStorageIncidentsRequest,
    ) -> Result<wire::ListStorageIncidentsResponse, OpError> {
        self.snapshot(|c| crate::records::list_incidents(c, self.token_key, req))
    }

    /// `GetClient`: one client.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    pub fn get_client(
        &self,
        client_id: &str,
        now_ms: i64,
    ) -> Result<wire::GetClientResponse, OpError> {
        self.snapshot(|c| crate::records::get_client(c, &self.health, client_id, now_ms))
    }

    /// `GetFleetRun`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    pub fn get_fleet_run(
        &self,
        req: &wire::GetFleetRunRequest,
    ) -> Result<wire::GetFleetRunResponse, OpError> {
        self.snapshot(|c| {
            crate::fleet::get_fleet_run(&mut crate::fleet::SqliteFleetReads::new(c), req)
        })
    }

    /// `ListFleetRuns`: one page, newest first.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, or a store failure.
    pub fn list_fleet_runs(
        &self,
        req: &wire::ListFleetRunsRequest,
    ) -> Result<wire::ListFleetRunsResponse, OpError> {
        self.snapshot(|c| {
            crate::fleet::list_fleet_runs(
                &mut crate::fleet::SqliteFleetReads::new(c),
                self.token_key,
                req,
            )
        })
    }

    /// `ListFleetTargets`: one page by client id.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    pub fn list_fleet_targets(
        &self,
        req: &wire::ListFleetTargetsRequest,
    ) -> Result<wire::ListFleetTargetsResponse, OpError> {
        self.snapshot(|c| {
            crate::fleet::list_fleet_targets(
                &mut crate::fleet::SqliteFleetReads::new(c),
                self.token_key,
                req,
            )
        })
    }

    /// A fleet run's record and its targets changed after `after_seq`, in
    /// change order, at most `limit`, from one snapshot.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    pub fn fleet_changes(
        &self,
        run: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<(wire::FleetRunRecord, Vec<wire::FleetTarget>), OpError> {
        self.snapshot(|c| {
            crate::fleet::fleet_changes(
                &mut crate::fleet::SqliteFleetReads::new(c),
                run,
                after_seq,
                limit,
            )
        })
    }

    /// The store's scoped health (shared with the writer).
    #[must_use]
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// One incident by id.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn incident(&self, id: &[u8; 16]) -> Result<Option<Incident>, StoreError> {
        incidents::get(&self.conn, id)
    }
}

/// What opens readers of one store, for the threads that serve control
/// reads (cheap to clone and `Send`; the writer may be on its own thread).
#[derive(Clone)]
pub struct ReadHandle {
    fs: Arc<dyn StoreFs>,
    layout: Layout,
    token_key: [u8; TOKEN_KEY_LEN],
    db: DbOptions,
    health: Health,
}

impl std::fmt::Debug for ReadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadHandle")
            .field("data_dir", &self.layout.root())
            .finish_non_exhaustive()
    }
}

impl ReadHandle {
    /// Opens one more read-only connection.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`] when the database cannot be opened.
    pub fn open(&self) -> Result<StoreReader, StoreError> {
        StoreReader::open(
            &self.layout,
            Arc::clone(&self.fs),
            self.token_key,
            self.db,
            self.health.clone(),
        )
    }
}

impl crate::Store {
    /// What opens read-only connections to this store for other threads:
    /// the control plane's reads (see the module docs).
    #[must_use]
    pub fn read_handle(&self) -> ReadHandle {
        ReadHandle {
            fs: Arc::clone(&self.fs),
            layout: self.layout.clone(),
            token_key: self.token_key(),
            db: self.opts.db,
            health: self.health(),
        }
    }

    /// One read-only connection to this store.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`] when the database cannot be opened.
    pub fn reader(&self) -> Result<StoreReader, StoreError> {
        self.read_handle().open()
    }
}

/// The reads the control service makes, the same for every store backend:
/// the SQLite store's [`StoreReader`] answers them, and so does the
/// PostgreSQL store's reader. Each reader is used by one thread at a time.
pub trait ControlReads: Send {
    /// `ListClients`: one page by client id.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad page size or token, or a store failure.
    fn list_clients(
        &mut self,
        req: &wire::ListClientsRequest,
    ) -> Result<wire::ListClientsResponse, OpError>;
    /// `GetClient`.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    fn get_client(
        &mut self,
        client_id: &str,
        now_ms: i64,
    ) -> Result<wire::GetClientResponse, OpError>;
    /// `ListCommands`: one page.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a bad page size or token, or a store failure.
    fn list_commands(
        &mut self,
        req: &wire::ListCommandsRequest,
    ) -> Result<wire::ListCommandsResponse, OpError>;
    /// `GetCommand`.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    fn command_record(&mut self, issue: &[u8; 16]) -> Result<wire::CommandRecord, OpError>;
    /// `GetOutput`: one page of a command's raw output.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    fn get_output(
        &mut self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError>;
    /// `FollowCommand` history after `after_event_seq`, at most `limit`.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    fn events_after(
        &mut self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError>;
    /// `ListStorageIncidents`: one page, newest first.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, or a store failure.
    fn incident_page(
        &mut self,
        req: &wire::ListStorageIncidentsRequest,
    ) -> Result<wire::ListStorageIncidentsResponse, OpError>;
    /// `GetFleetRun`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    fn get_fleet_run(
        &mut self,
        req: &wire::GetFleetRunRequest,
    ) -> Result<wire::GetFleetRunResponse, OpError>;
    /// `ListFleetRuns`: one page, newest first.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, or a store failure.
    fn list_fleet_runs(
        &mut self,
        req: &wire::ListFleetRunsRequest,
    ) -> Result<wire::ListFleetRunsResponse, OpError>;
    /// `ListFleetTargets`: one page by client id.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    fn list_fleet_targets(
        &mut self,
        req: &wire::ListFleetTargetsRequest,
    ) -> Result<wire::ListFleetTargetsResponse, OpError>;
    /// A fleet run's record and its targets changed after `after_seq`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
    fn fleet_changes(
        &mut self,
        run: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<(wire::FleetRunRecord, Vec<wire::FleetTarget>), OpError>;
    /// `ListPtySessions`: one page, newest first.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, or a store failure; `UNSUPPORTED` on a backend
    /// without terminals.
    fn list_pty_sessions(
        &mut self,
        _req: &wire::ListPtySessionsRequest,
    ) -> Result<wire::ListPtySessionsResponse, OpError> {
        Err(no_terminals())
    }
    /// One terminal.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure; `UNSUPPORTED` on a backend without
    /// terminals.
    fn pty_session(&mut self, _id: &[u8; 16]) -> Result<wire::PtySessionInfo, OpError> {
        Err(no_terminals())
    }
    /// A terminal's records after `after_rec_seq`, within `max_bytes` of
    /// data (at least one record).
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure; `UNSUPPORTED` on a backend without
    /// terminals.
    fn pty_records(
        &mut self,
        _id: &[u8; 16],
        _after_rec_seq: u64,
        _max_bytes: usize,
    ) -> Result<Vec<rvbox_store_port::pty::PtyRecord>, OpError> {
        Err(no_terminals())
    }
}

/// The refusal of a backend that keeps no terminals.
#[must_use]
pub fn no_terminals() -> OpError {
    OpError::Refused(rvbox_domain::error::DomainError::new(
        rvbox_domain::error::Code::Unsupported,
        "terminals are not served on this server's store backend",
    ))
}

/// What opens [`ControlReads`] readers of one store.
pub trait ReaderSource: Send + Sync {
    /// A new reader.
    ///
    /// # Errors
    /// When the store cannot be opened for reading.
    fn open_reader(&self) -> Result<Box<dyn ControlReads>, StoreError>;
}

impl std::fmt::Debug for dyn ReaderSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReaderSource")
    }
}

impl std::fmt::Debug for dyn ControlReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlReads")
    }
}

impl ReaderSource for ReadHandle {
    fn open_reader(&self) -> Result<Box<dyn ControlReads>, StoreError> {
        Ok(Box::new(self.open()?))
    }
}

impl ControlReads for StoreReader {
    fn list_pty_sessions(
        &mut self,
        req: &wire::ListPtySessionsRequest,
    ) -> Result<wire::ListPtySessionsResponse, OpError> {
        let key = self.token_key;
        self.snapshot(|c| crate::pty::list(c, key, req))
    }
    fn pty_session(&mut self, id: &[u8; 16]) -> Result<wire::PtySessionInfo, OpError> {
        self.snapshot(|c| crate::pty::info(c, id))
    }
    fn pty_records(
        &mut self,
        id: &[u8; 16],
        after_rec_seq: u64,
        max_bytes: usize,
    ) -> Result<Vec<rvbox_store_port::pty::PtyRecord>, OpError> {
        self.snapshot(|c| crate::pty::records_after(c, id, after_rec_seq, max_bytes))
    }
    fn list_clients(
        &mut self,
        req: &wire::ListClientsRequest,
    ) -> Result<wire::ListClientsResponse, OpError> {
        StoreReader::list_clients(self, req)
    }
    fn get_client(
        &mut self,
        client_id: &str,
        now_ms: i64,
    ) -> Result<wire::GetClientResponse, OpError> {
        StoreReader::get_client(self, client_id, now_ms)
    }
    fn list_commands(
        &mut self,
        req: &wire::ListCommandsRequest,
    ) -> Result<wire::ListCommandsResponse, OpError> {
        StoreReader::list_commands(self, req)
    }
    fn command_record(&mut self, issue: &[u8; 16]) -> Result<wire::CommandRecord, OpError> {
        StoreReader::command_record(self, issue)
    }
    fn get_output(
        &mut self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError> {
        StoreReader::get_output(self, req)
    }
    fn events_after(
        &mut self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError> {
        StoreReader::events_after(self, issue, after_event_seq, limit)
    }
    fn incident_page(
        &mut self,
        req: &wire::ListStorageIncidentsRequest,
    ) -> Result<wire::ListStorageIncidentsResponse, OpError> {
        StoreReader::incident_page(self, req)
    }
    fn get_fleet_run(
        &mut self,
        req: &wire::GetFleetRunRequest,
    ) -> Result<wire::GetFleetRunResponse, OpError> {
        StoreReader::get_fleet_run(self, req)
    }
    fn list_fleet_runs(
        &mut self,
        req: &wire::ListFleetRunsRequest,
    ) -> Result<wire::ListFleetRunsResponse, OpError> {
        StoreReader::list_fleet_runs(self, req)
    }
    fn list_fleet_targets(
        &mut self,
        req: &wire::ListFleetTargetsRequest,
    ) -> Result<wire::ListFleetTargetsResponse, OpError> {
        StoreReader::list_fleet_targets(self, req)
    }
    fn fleet_changes(
        &mut self,
        run: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<(wire::FleetRunRecord, Vec<wire::FleetTarget>), OpError> {
        StoreReader::fleet_changes(self, run, after_seq, limit)
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
        let store = Store::open(
            layout.clone(),
            Arc::new(RealFs),
            Arc::new(OsEntropy),
            StoreOptions::default(),
            0,
        )
        .unwrap();
        let reader = store.reader().unwrap();
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
