//! [`ClientStore`]: opening the state directory, the identity check, and
//! the commit steps of acceptance and of the terminal acknowledgement.

use std::path::Path;
use std::sync::Arc;

use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use rvbox_client_core::accept::{
    AcceptDecision, AcceptPolicy, Capacity, CheckedDispatch, ExistingCommand, decide_acceptance,
    metadata_charge,
};
use rvbox_domain::ids::{InstanceId, Uuid7};
use rvbox_proto::v1 as wire;
use rvbox_storage::StoreError;
use rvbox_storage::crash::{CrashHook, NoCrash};
use rvbox_storage::db::{self, Cached as _, DbOptions, Migration};
use rvbox_storage::entropy::Entropy;
use rvbox_storage::fs::StoreFs;
use rvbox_storage::lock::InstanceLock;

use crate::crash;
use crate::identity::{self, IdentityFile};
use crate::incidents::{self, IDENTITY_SCOPE, LocalIncident, NewLocalIncident};
use crate::layout::ClientLayout;
use crate::metrics::ClientStoreMetrics;
use crate::recovery::RecoveryReport;
use crate::spool::OpenSegments;

/// Every migration of the client store, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: include_str!("migrations/0001_initial.sql"),
    },
    Migration {
        version: 2,
        sql: include_str!("migrations/0002_loss_run.sql"),
    },
    Migration {
        version: 3,
        sql: include_str!("migrations/0003_terminals.sql"),
    },
];

/// Default length of the tombstone FIFO (plan §7.1).
pub const DEFAULT_TOMBSTONES: u64 = 1_000_000;

/// How the client store is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientStoreOptions {
    /// SQLite durability and busy timeout.
    pub db: DbOptions,
    /// Tombstone FIFO length (`spool.tombstones`).
    pub tombstone_cap: u64,
}

impl Default for ClientStoreOptions {
    fn default() -> Self {
        Self {
            db: DbOptions::default(),
            tombstone_cap: DEFAULT_TOMBSTONES,
        }
    }
}

/// Local health (plan §7.1): dirty while any local incident is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalHealth {
    /// Nothing is damaged.
    Ready,
    /// An incident is open; `rvbox repair` lists it.
    Dirty,
}

impl LocalHealth {
    /// The wire scope state a snapshot reports.
    #[must_use]
    pub fn scope_state(self) -> wire::ScopeState {
        match self {
            Self::Ready => wire::ScopeState::Ready,
            Self::Dirty => wire::ScopeState::DirtyReadable,
        }
    }
}

/// The result of one acceptance transaction.
#[derive(Debug, Clone, PartialEq)]
pub enum Accepted {
    /// A new record is durable; answer positively.
    New,
    /// An exact duplicate; answer with its acceptance (the stored revision
    /// is now `revision`).
    Repeat {
        /// The stored revision.
        revision: u64,
        /// The shell the command was accepted under.
        resolved_shell: wire::ShellType,
    },
    /// Refused; nothing was written.
    Refused(rvbox_client_core::accept::Refusal),
}

/// The maintained counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Commands holding a running slot.
    pub running: u64,
    /// Accepted commands waiting for a running slot.
    pub queued: u64,
    /// Command records.
    pub commands: u64,
    /// Tombstones held.
    pub tombstones: u64,
    /// Metadata reserved by accepted commands.
    pub metadata_bytes: u64,
    /// Command-owned payload bytes stored.
    pub stored_bytes: u64,
}

/// The client daemon's store. One per state directory, held under its
/// lock.
#[derive(Debug)]
pub struct ClientStore {
    layout: ClientLayout,
    pub(crate) fs: Arc<dyn StoreFs>,
    pub(crate) entropy: Arc<dyn Entropy>,
    pub(crate) hook: Arc<dyn CrashHook>,
    pub(crate) conn: Connection,
    opts: ClientStoreOptions,
    instance: Option<InstanceId>,
    pub(crate) open_segments: OpenSegments,
    pub(crate) codec: crate::spool::Codec,
    pub(crate) metrics: ClientStoreMetrics,
    recovery: RecoveryReport,
    _lock: InstanceLock,
}

fn u64_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn read_meta(conn: &Connection, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
    conn.query_row_cached(
        "SELECT value FROM client_meta WHERE key = ?1",
        params![key],
        |r| r.get(0),
    )
    .optional()
    .map_err(|e| StoreError::sqlite("read client_meta", e))
}

fn write_meta(conn: &Connection, key: &str, value: &[u8]) -> Result<(), StoreError> {
    conn.execute_cached(
        "INSERT INTO client_meta (key, value) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        params![key, value],
    )
    .map(|_| ())
    .map_err(|e| StoreError::sqlite("write client_meta", e))
}

const META_INSTANCE: &str = "instance_id";

fn read_counters(conn: &Connection) -> Result<Counters, StoreError> {
    conn.query_row_cached(
        "SELECT running, queued, commands, tombstones, metadata_bytes, stored_bytes
         FROM counters WHERE id = 1",
        [],
        |r| {
            Ok(Counters {
                running: u64_of(r.get(0)?),
                queued: u64_of(r.get(1)?),
                commands: u64_of(r.get(2)?),
                tombstones: u64_of(r.get(3)?),
                metadata_bytes: u64_of(r.get(4)?),
                stored_bytes: u64_of(r.get(5)?),
            })
        },
    )
    .map_err(|e| StoreError::sqlite("read counters", e))
}

impl ClientStore {
    /// Opens (creating if needed) the client store in `layout`: takes the
    /// lock, creates the private directories, opens the database and runs
    /// the migrations, then checks the identity (see [`crate::identity`]).
    /// A fresh installation gets its identity here, durably, before anything
    /// could register with it.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another process holds the store;
    /// [`StoreError`] for I/O, SQLite and schema failures. A damaged
    /// identity is not an error: the store opens dirty, with an incident.
    pub fn open(
        layout: ClientLayout,
        fs: Arc<dyn StoreFs>,
        entropy: Arc<dyn Entropy>,
        opts: ClientStoreOptions,
        now_ms: i64,
    ) -> Result<Self, StoreError> {
        Self::open_with_hook(layout, fs, entropy, Arc::new(NoCrash), opts, now_ms)
    }

    /// [`Self::open`] with a crash hook installed from the start (the
    /// identity is written during open).
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_with_hook(
        layout: ClientLayout,
        fs: Arc<dyn StoreFs>,
        entropy: Arc<dyn Entropy>,
        hook: Arc<dyn CrashHook>,
        opts: ClientStoreOptions,
        now_ms: i64,
    ) -> Result<Self, StoreError> {
        fs.ensure_private_dir(layout.root())
            .map_err(|e| StoreError::io("create state directory", layout.root(), e))?;
        let lock = InstanceLock::acquire(&layout.lock_file())?;
        layout.create(fs.as_ref())?;
        let mut conn = db::open(&layout.db_file(), opts.db)?;
        db::migrate(&mut conn, MIGRATIONS, now_ms)?;
        let mut store = Self {
            layout,
            fs,
            entropy,
            hook,
            conn,
            opts,
            instance: None,
            open_segments: OpenSegments::default(),
            codec: crate::spool::Codec::default(),
            metrics: ClientStoreMetrics::default(),
            recovery: RecoveryReport::default(),
            _lock: lock,
        };
        store.instance = store.check_identity(now_ms)?;
        store.recovery = store.recover(now_ms)?;
        tracing::info!(
            state_dir = %store.layout.root().display(),
            health = ?store.health()?,
            "client store opened"
        );
        Ok(store)
    }

    /// What recovery did at open.
    #[must_use]
    pub fn recovery_report(&self) -> RecoveryReport {
        self.recovery
    }

    /// The store's metrics (the shell registers them).
    #[must_use]
    pub fn metrics(&self) -> &ClientStoreMetrics {
        &self.metrics
    }

    /// Installs the crash hook.
    pub fn set_crash_hook(&mut self, hook: Arc<dyn CrashHook>) {
        self.hook = hook;
    }

    /// The state directory.
    #[must_use]
    pub fn layout(&self) -> &ClientLayout {
        &self.layout
    }

    /// The installation's identity; `None` while it is damaged (the daemon
    /// must not register: `rvbox repair` first).
    #[must_use]
    pub fn instance_id(&self) -> Option<InstanceId> {
        self.instance
    }

    /// Local health.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn health(&self) -> Result<LocalHealth, StoreError> {
        Ok(if incidents::open_count(&self.conn)? == 0 {
            LocalHealth::Ready
        } else {
            LocalHealth::Dirty
        })
    }

    /// The store health a snapshot reports (plan §6.4, R-6.4-33): an open
    /// incident of the whole store (the identity, the database) is
    /// essential corruption, and the server then completes no
    /// reconciliation and dispatches nothing; damage scoped to one
    /// command or one output segment is already explicit in that command's
    /// events (markers, an interrupted end), and the store stays READY.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn reconcile_health(&self) -> Result<wire::ScopeState, StoreError> {
        let essential: bool = self
            .conn
            .query_row_cached(
                "SELECT EXISTS (SELECT 1 FROM incidents WHERE state = 1 AND scope_kind = ?1)",
                params![wire::ScopeKind::GlobalStore as i32],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read open incidents", e))?;
        Ok(if essential {
            wire::ScopeState::Unavailable
        } else {
            wire::ScopeState::Ready
        })
    }

    fn has_history(&self) -> Result<bool, StoreError> {
        let c = read_counters(&self.conn)?;
        Ok(c.commands > 0 || c.tombstones > 0)
    }

    fn identity_incident(&self, summary: String, now_ms: i64) -> Result<(), StoreError> {
        incidents::record(
            &self.conn,
            self.entropy.as_ref(),
            &NewLocalIncident {
                kind: wire::IncidentKind::ChecksumMismatch,
                scope_kind: wire::ScopeKind::GlobalStore,
                scope_key: IDENTITY_SCOPE.into(),
                evidence: summary.clone().into_bytes(),
                summary,
            },
            now_ms,
        )
        .map(|_| ())
    }

    /// The identity decision (module docs of [`crate::identity`]).
    fn check_identity(&self, now_ms: i64) -> Result<Option<InstanceId>, StoreError> {
        let path = self.layout.identity_file();
        let recorded = read_meta(&self.conn, META_INSTANCE)?
            .and_then(|v| <[u8; 16]>::try_from(v.as_slice()).ok())
            .map(InstanceId::from_random_bytes);
        match identity::read(self.fs.as_ref(), &path) {
            IdentityFile::Valid(id) => match recorded {
                None => {
                    // the file is durable before the copy is recorded
                    write_meta(&self.conn, META_INSTANCE, id.as_bytes())?;
                    Ok(Some(id))
                }
                Some(r) if r == id => Ok(Some(id)),
                Some(r) => {
                    self.identity_incident(
                        format!(
                            "the identity file names instance {id}, but this store belongs to instance {r}"
                        ),
                        now_ms,
                    )?;
                    Ok(None)
                }
            },
            IdentityFile::Damaged(why) => {
                self.identity_incident(
                    format!("the identity file {} is damaged: {why}", path.display()),
                    now_ms,
                )?;
                Ok(None)
            }
            IdentityFile::Absent => {
                if recorded.is_some() || self.has_history()? {
                    self.identity_incident(
                        format!(
                            "the identity file {} is missing, but this store holds state",
                            path.display()
                        ),
                        now_ms,
                    )?;
                    return Ok(None);
                }
                let id = identity::mint(self.entropy.as_ref(), &path)?;
                identity::write(self.fs.as_ref(), &path, &id, self.hook.as_ref())?;
                write_meta(&self.conn, META_INSTANCE, id.as_bytes())?;
                tracing::info!(instance_id = %id, "new client installation");
                Ok(Some(id))
            }
        }
    }

    /// Local incidents, open first.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn incidents(&self) -> Result<Vec<LocalIncident>, StoreError> {
        incidents::list(&self.conn)
    }

    /// Repairs an open incident where a repair exists: a damaged or missing
    /// identity file is rewritten from the store's copy. Returns what
    /// happened, for the operator.
    ///
    /// # Errors
    /// [`StoreError::Layout`] when the incident is unknown, not open, or
    /// has no repair (acknowledge it instead); I/O and SQLite failures.
    pub fn repair(&mut self, incident_id: &[u8; 16], now_ms: i64) -> Result<String, StoreError> {
        let inc = self.open_incident(incident_id)?;
        if inc.scope_key != IDENTITY_SCOPE {
            return Err(not_repairable(
                self.layout.root(),
                "this incident has no automatic repair; acknowledge it with a note",
            ));
        }
        let Some(id) = read_meta(&self.conn, META_INSTANCE)?
            .and_then(|v| <[u8; 16]>::try_from(v.as_slice()).ok())
            .map(InstanceId::from_random_bytes)
        else {
            return Err(not_repairable(
                self.layout.root(),
                "the store holds no copy of the identity; acknowledge the incident to start a new installation",
            ));
        };
        identity::write(
            self.fs.as_ref(),
            &self.layout.identity_file(),
            &id,
            self.hook.as_ref(),
        )?;
        incidents::resolve(&self.conn, incident_id, None, now_ms)?;
        self.instance = Some(id);
        Ok(format!("identity file rewritten for instance {id}"))
    }

    /// Acknowledges an open incident with an operator note. For a damaged
    /// identity without a copy, this is the operator's decision to start a
    /// new installation: a new identity is created, never silently.
    ///
    /// # Errors
    /// [`StoreError::Layout`] when the incident is unknown or not open, or
    /// the note is empty; I/O and SQLite failures.
    pub fn acknowledge(
        &mut self,
        incident_id: &[u8; 16],
        note: &str,
        now_ms: i64,
    ) -> Result<String, StoreError> {
        if note.trim().is_empty() {
            return Err(not_repairable(
                self.layout.root(),
                "an acknowledgement needs a note saying why",
            ));
        }
        let inc = self.open_incident(incident_id)?;
        let mut outcome = String::from("acknowledged");
        if inc.scope_key == IDENTITY_SCOPE && self.instance.is_none() {
            let recorded = read_meta(&self.conn, META_INSTANCE)?;
            if recorded.is_some() {
                return Err(not_repairable(
                    self.layout.root(),
                    "the store holds a copy of the identity; repair the incident instead",
                ));
            }
            let path = self.layout.identity_file();
            let id = identity::mint(self.entropy.as_ref(), &path)?;
            identity::write(self.fs.as_ref(), &path, &id, self.hook.as_ref())?;
            write_meta(&self.conn, META_INSTANCE, id.as_bytes())?;
            self.instance = Some(id);
            outcome = format!("acknowledged; new installation with instance {id}");
        }
        incidents::resolve(&self.conn, incident_id, Some(note), now_ms)?;
        Ok(outcome)
    }

    fn open_incident(&self, incident_id: &[u8; 16]) -> Result<LocalIncident, StoreError> {
        match incidents::get(&self.conn, incident_id)? {
            Some(inc) if inc.state == wire::IncidentState::Open => Ok(inc),
            Some(_) => Err(not_repairable(
                self.layout.root(),
                "the incident is already repaired or acknowledged",
            )),
            None => Err(not_repairable(self.layout.root(), "no such incident")),
        }
    }

    /// The maintained counters.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn counters(&self) -> Result<Counters, StoreError> {
        read_counters(&self.conn)
    }

    /// The counters recounted from the rows (the counter check compares
    /// the two; a mismatch is a bug or damage).
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn recount(&self) -> Result<Counters, StoreError> {
        self.conn
            .query_row_cached(
                "SELECT
                    (SELECT COUNT(*) FROM commands WHERE slot = 2),
                    (SELECT COUNT(*) FROM commands WHERE slot = 1),
                    (SELECT COUNT(*) FROM commands),
                    (SELECT COUNT(*) FROM tombstones),
                    (SELECT COALESCE(SUM(metadata_charge), 0) FROM commands),
                    (SELECT COALESCE(SUM(stored_len), 0) FROM spool_entries
                        WHERE segment_ordinal IS NOT NULL)
                      + (SELECT COALESCE(SUM(len), 0) FROM script_chunks)",
                [],
                |r| {
                    Ok(Counters {
                        running: u64_of(r.get(0)?),
                        queued: u64_of(r.get(1)?),
                        commands: u64_of(r.get(2)?),
                        tombstones: u64_of(r.get(3)?),
                        metadata_bytes: u64_of(r.get(4)?),
                        stored_bytes: u64_of(r.get(5)?),
                    })
                },
            )
            .map_err(|e| StoreError::sqlite("recount", e))
    }

    /// Acceptance as one durable transition (plan §7.3 steps 2-4): reads
    /// the active record, the tombstone and the counters, decides with
    /// [`decide_acceptance`], inserts the record with its queued slot and
    /// metadata reservation (or raises a repeat's revision), and commits
    /// with `synchronous=FULL` before returning. A failure before the
    /// commit leaves nothing; the caller answers it as a transient refusal.
    ///
    /// # Errors
    /// [`StoreError`] when the transaction fails.
    pub fn accept(
        &mut self,
        policy: &AcceptPolicy,
        d: &CheckedDispatch,
        now_ms: i64,
    ) -> Result<Accepted, StoreError> {
        // the filesystem's free space, measured with every acceptance (one
        // that cannot be measured is logged and not held against the
        // command: a full disk still fails the write itself)
        let free_space = match self.fs.free_space(self.layout.root()) {
            Ok(free) => Some(free),
            Err(e) => {
                tracing::warn!(error = %e, dir = %self.layout.root().display(), "free space of the state directory not measured");
                None
            }
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin acceptance", e))?;
        let issue = d.issue.as_bytes().as_slice();
        let existing = tx
            .query_row_cached(
                "SELECT request_hash, revision, resolved_shell, intent FROM commands
                 WHERE issue_uuid = ?1",
                params![issue],
                |r| {
                    let hash: Vec<u8> = r.get(0)?;
                    Ok(ExistingCommand {
                        request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or_default(),
                        revision: u64_of(r.get(1)?),
                        resolved_shell: wire::ShellType::try_from(r.get::<_, i32>(2)?)
                            .unwrap_or_default(),
                        terminate_intent: r.get::<_, i64>(3)? != 0,
                    })
                },
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read command", e))?;
        let tombstone = tx
            .query_row_cached(
                "SELECT request_hash FROM tombstones WHERE issue_uuid = ?1",
                params![issue],
                |r| r.get::<_, Vec<u8>>(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read tombstone", e))?
            .map(|h| <[u8; 32]>::try_from(h.as_slice()).unwrap_or_default());
        let c = read_counters(&tx)?;
        let capacity = Capacity {
            running: c.running,
            queued: c.queued,
            records: c.commands,
            charged_bytes: c.metadata_bytes.saturating_add(c.stored_bytes),
            free_space,
        };
        let outcome = match decide_acceptance(policy, d, existing, tombstone, capacity) {
            AcceptDecision::Refuse(r) => return Ok(Accepted::Refused(r)),
            AcceptDecision::Repeat {
                revision,
                resolved_shell,
            } => {
                tx.execute_cached(
                    "UPDATE commands SET revision = ?2 WHERE issue_uuid = ?1 AND revision < ?2",
                    params![issue, i64_of(revision)],
                )
                .map_err(|e| StoreError::sqlite("raise revision", e))?;
                Accepted::Repeat {
                    revision,
                    resolved_shell,
                }
            }
            AcceptDecision::Insert => {
                let (script_len, script_sha) = match d.script {
                    Some((len, sha)) => (Some(i64_of(len)), Some(sha.to_vec())),
                    None => (None, None),
                };
                tx.execute_cached(
                    "INSERT INTO commands (issue_uuid, request_hash, revision, generation,
                         accepted_ms, spec, resolved_shell, queue_expiry_ms, slot,
                         metadata_charge, lifecycle, launch, script_len, script_sha256)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 1, ?9, ?10, 1, ?11, ?12)",
                    params![
                        issue,
                        d.request_hash.as_slice(),
                        i64_of(d.revision),
                        i64_of(d.generation),
                        now_ms,
                        d.spec.encode_to_vec(),
                        d.resolved_shell as i32,
                        d.queue_expiry_ms,
                        i64_of(metadata_charge(policy, d)),
                        wire::Lifecycle::Accepted as i32,
                        script_len,
                        script_sha,
                    ],
                )
                .map_err(|e| StoreError::sqlite("insert accepted command", e))?;
                Accepted::New
            }
        };
        self.hook.at(crash::ACCEPT_BEFORE_COMMIT);
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit acceptance", e))?;
        self.hook.at(crash::ACCEPT_AFTER_COMMIT);
        Ok(outcome)
    }

    /// The tombstone's request hash for `issue`, if it is in the FIFO.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn tombstone(&self, issue: &Uuid7) -> Result<Option<[u8; 32]>, StoreError> {
        self.conn
            .query_row_cached(
                "SELECT request_hash FROM tombstones WHERE issue_uuid = ?1",
                params![issue.as_bytes().as_slice()],
                |r| r.get::<_, Vec<u8>>(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read tombstone", e))
            .map(|h| h.map(|h| <[u8; 32]>::try_from(h.as_slice()).unwrap_or_default()))
    }

    /// The server acknowledged the terminal event of `issue`: the command's
    /// rows go (its spool entries, segments, chunks and stdin with it), a
    /// tombstone takes its place, and the FIFO drops its oldest entries past
    /// the cap, in one transaction. Returns false when the command is not
    /// held (an earlier acknowledgement already did this).
    ///
    /// # Errors
    /// [`StoreError`] when the transaction fails.
    pub fn finish_acknowledged(&mut self, issue: &Uuid7, now_ms: i64) -> Result<bool, StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin terminal acknowledgement", e))?;
        let key = issue.as_bytes().as_slice();
        let Some((hash, wrapper)) = tx
            .query_row_cached(
                "SELECT request_hash, wrapper_path FROM commands WHERE issue_uuid = ?1",
                params![key],
                |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, Option<String>>(1)?)),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read command", e))?
        else {
            return Ok(false);
        };
        let freed: i64 = tx
            .query_row_cached(
                "SELECT (SELECT COALESCE(SUM(stored_len), 0) FROM spool_entries
                         WHERE issue_uuid = ?1 AND segment_ordinal IS NOT NULL)
                      + (SELECT COALESCE(SUM(len), 0) FROM script_chunks WHERE issue_uuid = ?1)",
                params![key],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("sum remaining stored bytes", e))?;
        let has_script: bool = tx
            .query_row_cached(
                "SELECT EXISTS (SELECT 1 FROM segments WHERE issue_uuid = ?1 AND kind = 3)",
                params![key],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("find script segment", e))?;
        let segments: Vec<u32> = {
            let mut stmt = tx
                .prepare_cached("SELECT ordinal FROM segments WHERE issue_uuid = ?1 AND kind = 1")
                .map_err(|e| StoreError::sqlite("list segments", e))?;
            let rows = stmt
                .query_map(params![key], |r| r.get(0))
                .map_err(|e| StoreError::sqlite("list segments", e))?;
            rows.collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("list segments", e))?
        };
        tx.execute_cached("DELETE FROM commands WHERE issue_uuid = ?1", params![key])
            .map_err(|e| StoreError::sqlite("remove command", e))?;
        tx.execute_cached(
            "UPDATE counters SET stored_bytes = stored_bytes - ?1 WHERE id = 1",
            params![freed],
        )
        .map_err(|e| StoreError::sqlite("release command bytes", e))?;
        let serial: i64 = tx
            .query_row_cached(
                "UPDATE counters SET tombstone_serial = tombstone_serial + 1 WHERE id = 1
                 RETURNING tombstone_serial",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("advance tombstone serial", e))?;
        tx.execute_cached(
            "INSERT INTO tombstones (serial, issue_uuid, request_hash, acked_ms)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (issue_uuid) DO NOTHING",
            params![serial, key, hash, now_ms],
        )
        .map_err(|e| StoreError::sqlite("write tombstone", e))?;
        // the FIFO: entries at or below serial - cap go, oldest first (by
        // the primary key; normally exactly one)
        let floor = serial.saturating_sub(i64_of(self.opts.tombstone_cap));
        let rotated = tx
            .execute_cached("DELETE FROM tombstones WHERE serial <= ?1", params![floor])
            .map_err(|e| StoreError::sqlite("rotate tombstones", e))?;
        if rotated > 0 {
            self.hook.at(crash::TOMBSTONE_ROTATE_BEFORE_COMMIT);
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit terminal acknowledgement", e))?;
        self.metrics.tombstones_written.inc();
        if rotated > 0 {
            self.metrics
                .tombstones_rotated
                .inc_by(u64::try_from(rotated).unwrap_or(0));
        }
        self.hook.at(crash::TERMINAL_ACK_AFTER_COMMIT);
        let key = *issue.as_bytes();
        self.open_segments.forget_command(&key);
        self.remove_segment_files(&key, &segments);
        if has_script {
            self.remove_script_file(&key);
        }
        // a command that ended without its slot release (one reconciliation
        // ended, or one that never ran) still has its wrapper here
        if let Some(path) = wrapper {
            self.remove_wrapper(std::path::Path::new(&path));
        }
        Ok(true)
    }

    /// Closes the store the way a crash leaves it (no WAL checkpoint).
    pub fn close_as_crashed(self) {
        if let Err(e) = self.conn.set_db_config(
            rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            true,
        ) {
            tracing::warn!(error = %e, "could not disable the closing checkpoint");
        }
    }
}

fn not_repairable(root: &Path, reason: &str) -> StoreError {
    StoreError::Layout {
        path: root.to_path_buf(),
        reason: reason.into(),
    }
}
