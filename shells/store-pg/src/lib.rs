//! The RVBox server store on PostgreSQL 15+ (docs/scaleout.md): the store
//! port for several server replicas on one database.
//!
//! Owns: the PostgreSQL schema and its migrations, one transaction per
//! store operation (READ COMMITTED, with the rows a decision depends on
//! locked `FOR UPDATE`, and the write's session locked `FOR SHARE`), the
//! retry of transactions PostgreSQL aborted for a conflict (serialization
//! failure, deadlock, a concurrent insert of the same key), and the audit
//! records of every effect in the effect's own transaction.
//!
//! Pure decisions come from the same crates the SQLite store uses
//! (validation and hashes from `rvbox-domain`, charges and reservations
//! from `rvbox-retention`, audit records from `rvbox-store`), so both
//! backends decide alike; the conformance suite (`rvbox-conformance`)
//! runs the same tests against both.
//!
//! Must never: answer an operation before its transaction committed;
//! build SQL from anything but constants (every value is a parameter);
//! log a connection string's password.

mod audit;
mod commands;
mod error;
mod events;
mod fleet;
mod incidents;
mod maintenance;
mod mutations;
pub mod notify;
pub use reader::{PgReader, PgReaders};
pub mod output;
mod pty;
mod reader;
mod reads;
mod replicas;
mod scrub;
mod sessions;
mod signals;
mod stdin;

use postgres::{Client, IsolationLevel, NoTls, Transaction};
use rvbox_store_port::ops::{Backend, Completion, OpResult, OpToken, PortError, StoreOp};

pub use error::Fail;
pub use rvbox_store::StoreOptions;

/// The schema migrations, in order (each applied once, in one
/// transaction, under an advisory lock so concurrent replicas starting
/// together apply each exactly once).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../migrations/0001_initial.sql")),
    (
        2,
        "postgres",
        include_str!("../migrations/0002_postgres.sql"),
    ),
    (
        3,
        "replicas",
        include_str!("../migrations/0003_replicas.sql"),
    ),
    (
        4,
        "audit_usage",
        include_str!("../migrations/0004_audit_usage.sql"),
    ),
    (
        5,
        "pty_sessions",
        include_str!("../migrations/0005_pty_sessions.sql"),
    ),
    (
        6,
        "audit_chain",
        include_str!("../migrations/0006_audit_chain.sql"),
    ),
];

/// Named crash points of the PostgreSQL store (conventions rule 8).
pub mod points {
    /// Every statement of the operation ran; its transaction has not
    /// committed.
    pub const BEFORE_COMMIT: &str = "store_pg.before_commit";
    /// The operation's transaction committed; nothing answered yet.
    pub const AFTER_COMMIT: &str = "store_pg.after_commit";
}

/// The advisory lock key of migrations (any constant shared by replicas).
const MIGRATION_LOCK: i64 = 0x5256_424f_5800_0001;

/// How many times a transaction PostgreSQL aborted for a conflict runs
/// again before the operation fails `UNAVAILABLE`.
const MAX_ATTEMPTS: u32 = 8;

/// How long the database lets a write transaction of this store sit idle
/// (its process paused or wedged between two statements) before it ends
/// the session and releases its locks: the rows it locked `FOR SHARE`
/// (a client's session) would otherwise hold back the registration of
/// that client on another replica for as long as the pause lasts. The
/// store's own transactions never wait between statements.
pub const IDLE_IN_TRANSACTION: &str = "5s";

/// Connects a write session: its transactions may sit idle for at most
/// [`IDLE_IN_TRANSACTION`].
fn open_session(conninfo: &str, what: &'static str) -> Result<Client, Fail> {
    let mut client = Client::connect(conninfo, NoTls).map_err(Fail::db(what))?;
    client
        .batch_execute(&format!(
            "SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}'"
        ))
        .map_err(Fail::db("set the idle transaction limit"))?;
    Ok(client)
}

/// Prepared statements of the hot paths, per connection and thread: a
/// statement sent as text costs a round trip to prepare it and one to run
/// it; a cached one costs one. Each store connection has its own id (a
/// new one after a reconnect), set for the thread by [`PgStore::in_tx`],
/// so a statement is only ever run on the connection that prepared it.
pub(crate) mod prep {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    use postgres::{Statement, Transaction};

    /// Most statements kept per thread; past it the cache starts over.
    const MAX: usize = 256;

    thread_local! {
        static CURRENT: Cell<u64> = const { Cell::new(0) };
        static CACHE: RefCell<HashMap<(u64, &'static str), Statement>> =
            RefCell::new(HashMap::new());
    }

    /// The connection the thread's transactions run on from now on.
    pub(crate) fn enter(conn: u64) {
        CURRENT.set(conn);
    }

    /// Forgets the statements of `conn` (after a failure on it).
    pub(crate) fn forget(conn: u64) {
        CACHE.with_borrow_mut(|c| c.retain(|(k, _), _| *k != conn));
    }

    /// Runs `sql` (prepared once) and returns its rows.
    pub(crate) fn query(
        tx: &mut Transaction<'_>,
        sql: &'static str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>, postgres::Error> {
        let s = stmt(tx, sql)?;
        tx.query(&s, params)
    }

    /// Runs `sql` (prepared once) and returns its one row or none.
    pub(crate) fn query_opt(
        tx: &mut Transaction<'_>,
        sql: &'static str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Option<postgres::Row>, postgres::Error> {
        let s = stmt(tx, sql)?;
        tx.query_opt(&s, params)
    }

    /// Runs `sql` (prepared once) and returns its one row.
    pub(crate) fn query_one(
        tx: &mut Transaction<'_>,
        sql: &'static str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<postgres::Row, postgres::Error> {
        let s = stmt(tx, sql)?;
        tx.query_one(&s, params)
    }

    /// Runs `sql` (prepared once) and returns the rows it changed.
    pub(crate) fn execute(
        tx: &mut Transaction<'_>,
        sql: &'static str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<u64, postgres::Error> {
        let s = stmt(tx, sql)?;
        tx.execute(&s, params)
    }

    /// `sql` prepared on the current connection, once.
    fn stmt(tx: &mut Transaction<'_>, sql: &'static str) -> Result<Statement, postgres::Error> {
        let conn = CURRENT.get();
        if let Some(s) = CACHE.with_borrow(|c| c.get(&(conn, sql)).cloned()) {
            return Ok(s);
        }
        let s = tx.prepare(sql)?;
        CACHE.with_borrow_mut(|c| {
            if c.len() >= MAX {
                c.clear();
            }
            c.insert((conn, sql), s.clone());
        });
        Ok(s)
    }
}

/// Ids of store connections (see [`prep`]).
static NEXT_CONN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn next_conn() -> u64 {
    NEXT_CONN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The store on PostgreSQL.
pub struct PgStore {
    client: Client,
    /// This connection's id for the statement cache ([`prep`]).
    conn_id: u64,
    /// Kept to reconnect after the connection was lost; never logged.
    conninfo: String,
    hook: std::sync::Arc<dyn rvbox_store::crash::CrashHook>,
    opts: StoreOptions,
    output: Box<dyn output::OutputStore>,
    entropy: std::sync::Arc<dyn rvbox_store::entropy::Entropy>,
    /// This process as a replica, once joined: the owner of the sessions
    /// it registers.
    replica: Option<rvbox_store_port::replica::ReplicaId>,
    lease_times: rvbox_store_port::replica::LeaseTimes,
    /// Where the background scrub's cycle stands.
    scrub: scrub::ScrubState,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the connection string: it may carry a password
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

impl PgStore {
    /// Connects with a `postgres` connection string (key=value or URL) and
    /// applies the migrations this build knows.
    ///
    /// # Errors
    /// When the database cannot be reached or a migration fails.
    pub fn connect(conninfo: &str, opts: StoreOptions) -> Result<Self, Fail> {
        let client = open_session(conninfo, "connect")?;
        let mut store = Self {
            client,
            conn_id: next_conn(),
            conninfo: conninfo.to_owned(),
            hook: std::sync::Arc::new(rvbox_store::crash::NoCrash),
            opts,
            output: Box::new(output::DatabaseChunks),
            entropy: std::sync::Arc::new(rvbox_store::entropy::OsEntropy),
            replica: None,
            lease_times: rvbox_store_port::replica::LeaseTimes::default(),
            scrub: scrub::ScrubState::default(),
        };
        store.migrate()?;
        Ok(store)
    }

    /// Applies the migrations not yet applied; returns how many ran.
    ///
    /// # Errors
    /// A database failure; nothing of the failing migration is kept.
    pub fn migrate(&mut self) -> Result<usize, Fail> {
        let mut tx = self
            .client
            .transaction()
            .map_err(Fail::db("begin migrations"))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .map_err(Fail::db("lock migrations"))?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS rvbox_migrations (
                 version    bigint PRIMARY KEY,
                 name       text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .map_err(Fail::db("create the migrations table"))?;
        let mut ran = 0;
        for (version, name, sql) in MIGRATIONS {
            let done = tx
                .query_opt(
                    "SELECT 1 FROM rvbox_migrations WHERE version = $1",
                    &[version],
                )
                .map_err(Fail::db("read the applied migrations"))?
                .is_some();
            if done {
                continue;
            }
            tx.batch_execute(sql)
                .map_err(Fail::db("apply a migration"))?;
            tx.execute(
                "INSERT INTO rvbox_migrations (version, name) VALUES ($1, $2)",
                &[version, name],
            )
            .map_err(Fail::db("record a migration"))?;
            tracing::info!(version, name, "PostgreSQL schema migration applied");
            ran += 1;
        }
        tx.commit().map_err(Fail::db("commit migrations"))?;
        Ok(ran)
    }

    /// Keeps output bytes in `output` instead of the database's
    /// `output_chunks` table (an object store; readers need the same, see
    /// [`PgReader::set_output_store`]).
    pub fn set_output_store(&mut self, output: Box<dyn output::OutputStore>) {
        self.output = output;
    }

    /// Installs a crash hook: it runs at [`points::BEFORE_COMMIT`] and
    /// [`points::AFTER_COMMIT`] of every transaction (tests kill the
    /// connection or the process there).
    pub fn set_crash_hook(&mut self, hook: std::sync::Arc<dyn rvbox_store::crash::CrashHook>) {
        self.hook = hook;
    }

    /// The server process id of the store's connection (tests terminate
    /// it from another connection).
    ///
    /// # Errors
    /// A database failure.
    pub fn backend_pid(&mut self) -> Result<i32, Fail> {
        self.ensure_connected()?;
        let pid = self
            .client
            .query_one("SELECT pg_backend_pid()", &[])
            .map_err(Fail::db("read backend pid"));
        match pid {
            Ok(row) => Ok(row.get(0)),
            // terminated a moment ago, before the client saw it close
            Err(e) if e.is_connection_lost() => {
                self.client = open_session(&self.conninfo, "reconnect")?;
                self.conn_id = next_conn();
                Ok(self
                    .client
                    .query_one("SELECT pg_backend_pid()", &[])
                    .map_err(Fail::db("read backend pid"))?
                    .get(0))
            }
            Err(e) => Err(e),
        }
    }

    /// Connects again when the connection was lost (a killed backend, a
    /// restarted or failed-over server). What was in flight then was
    /// answered `UNAVAILABLE`: nothing of it committed, or its commit's
    /// answer was lost, and the caller's retry meets the compare-and-set
    /// or the idempotency row.
    fn ensure_connected(&mut self) -> Result<(), Fail> {
        if !self.client.is_closed() {
            return Ok(());
        }
        tracing::warn!("PostgreSQL connection lost; connecting again");
        self.client = open_session(&self.conninfo, "reconnect")?;
        self.conn_id = next_conn();
        Ok(())
    }

    /// Runs `f` in one READ COMMITTED transaction and commits it; runs it
    /// again, from the start, when PostgreSQL aborted it for a conflict
    /// with another transaction, at most [`MAX_ATTEMPTS`] times. A lost
    /// connection is never retried here: the commit may have happened.
    pub(crate) fn in_tx<T>(
        &mut self,
        what: &'static str,
        mut f: impl FnMut(&mut Transaction<'_>, &StoreOptions) -> Result<T, Fail>,
    ) -> Result<T, Fail> {
        self.ensure_connected()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            prep::enter(self.conn_id);
            let hook = std::sync::Arc::clone(&self.hook);
            // set once COMMIT is sent: from then on the outcome of a lost
            // connection is unknown, and the transaction never runs again
            let mut committing = false;
            let result: Result<T, Fail> = (|| {
                let mut tx = self
                    .client
                    .build_transaction()
                    .isolation_level(IsolationLevel::ReadCommitted)
                    .start()
                    .map_err(Fail::db(what))?;
                let v = f(&mut tx, &self.opts)?;
                hook.at(points::BEFORE_COMMIT);
                committing = true;
                tx.commit().map_err(Fail::db(what))?;
                hook.at(points::AFTER_COMMIT);
                Ok(v)
            })();
            if result.is_err() {
                // a cached statement may be what failed
                prep::forget(self.conn_id);
            }
            match result {
                Err(e) if e.is_retryable() && attempt < MAX_ATTEMPTS => {
                    tracing::debug!(what, attempt, error = %e, "transaction aborted by a conflict; running it again");
                }
                Err(e) if !committing && e.is_connection_lost() && attempt < MAX_ATTEMPTS => {
                    // nothing was committed: connect again and run it again
                    tracing::warn!(what, error = %e, "connection lost before the commit; running the transaction again on a new one");
                    self.client = open_session(&self.conninfo, "reconnect")?;
                    self.conn_id = next_conn();
                }
                other => return other,
            }
        }
    }

    /// The stored output chunks of `issue` from `from_seq`, in order, at
    /// most `max` (check each with [`output::OutputChunk::raw`]).
    ///
    /// # Errors
    /// A database failure.
    pub fn output_chunks(
        &mut self,
        issue: &[u8; 16],
        from_seq: u64,
        max: usize,
    ) -> Result<Vec<output::OutputChunk>, Fail> {
        let mut out = std::mem::replace(&mut self.output, Box::new(output::DatabaseChunks));
        let r = self.in_tx("read output", |tx, _| out.get(tx, issue, from_seq, max));
        self.output = out;
        r
    }

    /// A fresh incident id (UUIDv7 at `now_ms`).
    pub(crate) fn incident_id(&self, now_ms: i64) -> Result<[u8; 16], Fail> {
        rvbox_store::entropy::uuid_v7(self.entropy.as_ref(), now_ms)
            .map_err(|e| Fail::Integrity(format!("mint incident id: {e}")))
    }

    /// Performs one operation.
    fn perform_one(&mut self, wall_ms: i64, op: StoreOp) -> OpResult {
        let name = op.name();
        let result = match op {
            StoreOp::LoadClient { client_id } => {
                self.client_record(&client_id).map(Completion::Client)
            }
            StoreOp::Register(reg) => self
                .register_session(&reg, wall_ms)
                .map(|generation| Completion::Registered { generation }),
            StoreOp::RecordPendingClaim {
                client_id,
                instance_id,
            } => self
                .record_pending_claim(&client_id, &instance_id, wall_ms)
                .map(|()| Completion::Done),
            StoreOp::CloseSession { session_id, reason } => self
                .close_session(&session_id, &reason, wall_ms)
                .map(|()| Completion::Done),
            StoreOp::Audit(records) => self
                .session_audits(&records, wall_ms)
                .map(|()| Completion::Done),
            StoreOp::RunCommand { request, caller } => self
                .run_command(&request, &caller, wall_ms)
                .map(Completion::RunCommand),
            StoreOp::CommandView { issue } => self.command_view(&issue).map(Completion::View),
            StoreOp::Dispatch {
                issue,
                revision,
                write,
                session,
            } => self
                .dispatch(session, &issue, revision, write)
                .map(|spec| Completion::Spec(Box::new(spec))),
            StoreOp::RecordAccepted {
                issue,
                revision,
                resolved_shell,
                session,
            } => self
                .record_accepted(session, &issue, revision, resolved_shell)
                .map(|()| Completion::Done),
            StoreOp::Requeue {
                issue,
                revision,
                session,
            } => self
                .requeue(session, &issue, revision, wall_ms)
                .map(Completion::Requeued),
            StoreOp::FinishByServer {
                issue,
                from,
                revision,
                how,
                rejection,
                session,
            } => self
                .finish_by_server(
                    session,
                    &issue,
                    &from,
                    revision,
                    how,
                    rejection.as_ref(),
                    wall_ms,
                )
                .map(|()| Completion::Done),
            StoreOp::AcceptLate {
                issue,
                revision,
                resolved_shell,
                incident,
                session,
            } => self
                .accept_late(
                    session,
                    &issue,
                    revision,
                    resolved_shell,
                    &incident,
                    wall_ms,
                )
                .map(|_| Completion::Done),
            StoreOp::ApplyReconciliation {
                client_id,
                session,
                writes,
                incidents,
            } => self
                .apply_reconciliation(session, &client_id, &writes, &incidents, wall_ms)
                .map(|_| Completion::Done),
            StoreOp::RecordIncident(incident) => self
                .record_incident(&incident, wall_ms)
                .map(|()| Completion::Done),
            StoreOp::NonTerminalCommands { client_id } => self
                .non_terminal_commands(&client_id)
                .map(Completion::Commands),
            StoreOp::DispatchCandidates { client_id, limit } => self
                .dispatch_candidates(&client_id, limit)
                .map(Completion::Commands),
            StoreOp::Knowledge { issues } => self.knowledge(&issues).map(Completion::Knowledge),
            StoreOp::ExpiryDue { limit } => {
                self.expiry_due(wall_ms, limit).map(Completion::Commands)
            }
            StoreOp::PendingSignals { issues } => self
                .pending_signals(&issues)
                .map(Completion::PendingSignals),
            StoreOp::ScriptInfo { issue } => self
                .script_info(&issue)
                .map(|(lifecycle, size)| Completion::Script { lifecycle, size }),
            StoreOp::ScriptRange { issue, offset, len } => self
                .script_range(&issue, offset, len)
                .map(Completion::ScriptBytes),
            StoreOp::PendingStdin {
                issue,
                after_seq,
                max_bytes,
                max_writes,
            } => self
                .pending_stdin(&issue, after_seq, max_bytes, max_writes)
                .map(Completion::StdinWrites),
            StoreOp::MarkExpiredPending { issue, revision } => self
                .mark_expired_pending(&issue, revision)
                .map(|()| Completion::Done),
            StoreOp::SignalCommand { request, caller } => self
                .signal_command(&request, &caller, wall_ms)
                .map(Completion::Signal),
            StoreOp::PtyMutation {
                mutation,
                caller,
                limits,
            } => self
                .pty_mutation(&mutation, &caller, limits, wall_ms)
                .map(|o| Completion::Pty(Box::new(o))),
            StoreOp::PtyApply {
                client_id,
                session,
                reports,
                recording_bytes,
            } => self
                .pty_apply(&client_id, session, &reports, recording_bytes, wall_ms)
                .map(Completion::PtyApplied),
            StoreOp::PtyResume { client_id } => {
                self.pty_resume(&client_id).map(Completion::PtyResume)
            }
            StoreOp::PtyIdle {
                idle_before_ms,
                limit,
            } => self
                .pty_idle(idle_before_ms, limit)
                .map(Completion::PtyIdle),
            StoreOp::AppendStdin { request, caller } => self
                .append_stdin(&request, &caller, wall_ms)
                .map(|o| Completion::Stdin(Box::new(o))),
            StoreOp::CloseStdin { request, caller } => self
                .close_stdin(&request, &caller, wall_ms)
                .map(|o| Completion::Stdin(Box::new(o))),
            StoreOp::AuthorizeTakeover {
                request,
                caller,
                ttl_ms,
            } => self
                .authorize_takeover(&request, &caller, ttl_ms, wall_ms)
                .map(Completion::Takeover),
            StoreOp::RepairIncident { request, caller } => self
                .repair_incident(&request, &caller, wall_ms)
                .map(|i| Completion::Incident(Box::new(i))),
            StoreOp::AcknowledgeIncident { request, caller } => self
                .acknowledge_incident(&request, &caller, wall_ms)
                .map(|i| Completion::Incident(Box::new(i))),
            StoreOp::AppendEvents { events } => self
                .append_events(&events, wall_ms)
                .map(Completion::Appended),
            StoreOp::Maintain => self.maintain(wall_ms).map(Completion::Maintained),
            StoreOp::Scrub => self.scrub(wall_ms).map(Completion::Scrubbed),
            StoreOp::RunFleet { request, caller } => self
                .run_fleet(&request, &caller, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o))),
            StoreOp::FleetAction { action, caller } => self
                .fleet_action(&action, &caller, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o))),
            StoreOp::FleetPump { limit } => self
                .fleet_pump(limit, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o))),
        };
        result.map_err(|e| {
            if let Fail::Refused(d) = &e {
                tracing::debug!(op = name, code = d.code().as_str(), "operation refused");
            } else {
                tracing::error!(op = name, error = %e, "store operation failed");
            }
            e.into_port()
        })
    }
}

impl Backend for PgStore {
    fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        ops.into_iter()
            .map(|(token, wall_ms, op)| (token, self.perform_one(wall_ms, op)))
            .collect()
    }
}

/// A failure as the port reports it.
impl From<Fail> for PortError {
    fn from(e: Fail) -> Self {
        e.into_port()
    }
}
