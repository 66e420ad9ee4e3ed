//! The store handle: opening a data directory, and the operations that
//! create commands (plan §5.1, §5.2, §6.4 "RunCommand persists a queued
//! command before returning").

use crate::db::Cached as _;
use std::collections::BTreeMap;
use std::sync::Arc;

use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::{command_hash, request_hash};
use rvbox_domain::limits;
use rvbox_domain::validate::check_run_command;
use rvbox_proto::v1 as wire;
use rvbox_retention::{CHARGE_VERSION, ChargeKind, Class, Tiers, Usage, charge, reserve};
use rvbox_segment::Limits;

use crate::crash::{CrashHook, NoCrash};
use crate::db::{self, DbOptions};
use crate::entropy::Entropy;
use crate::error::StoreError;
use crate::fs::{SegmentFile, StoreFs};
use crate::identity;
use crate::layout::{InstanceLock, Layout};
use crate::mutations::{self, Assigned, OpError, Owner, Stored};

/// Everything the store needs from the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// SQLite durability and busy timeout.
    pub db: DbOptions,
    /// Quota tiers and field maxima.
    pub tiers: Tiers,
    /// A segment is sealed once it reaches this many bytes.
    pub seal_bytes: u64,
    /// Default queue TTL in ms; 0 = indefinite.
    pub queue_ttl_ms: u64,
    /// Queued commands per client.
    pub queue_max_per_client: u64,
    /// Queued commands in all.
    pub queue_max_total: u64,
    /// Command tombstone FIFO length.
    pub tombstone_cap: u64,
    /// Most segment files kept open at once.
    pub max_open_segments: usize,
    /// Terminal commands are reclaimed this long after their terminal time;
    /// 0 disables age reclamation (plan §5.4 item 4).
    pub terminal_retention_ms: u64,
    /// Maintenance evicts terminal commands until each client and the
    /// server have at least this much room below their tiers (plan §5.4
    /// item 3); 0 evicts only when a tier is exceeded.
    pub eviction_slack_bytes: u64,
    /// The separate audit byte budget (plan §5.4 item 5).
    pub audit_budget_bytes: u64,
    /// Audit segments whose newest record is this old rotate; 0 (the
    /// default) disables the age trigger, not the byte budget.
    pub audit_retention_ms: u64,
    /// The background scrub starts a new cycle (re-verification of every
    /// sealed segment, orphan sweep, counter recount) this long after the
    /// last one finished, and at every start; 0 runs only the start's.
    pub scrub_interval_ms: u64,
}

impl StoreOptions {
    /// The server-wide usage up to which a new client is admitted: the
    /// server-wide tier less the eviction slack (the level maintenance
    /// evicts down to), so registry rows, which eviction cannot free, do not
    /// push terminal history out; the slack counts for at most a quarter
    /// of a small tier.
    #[must_use]
    pub fn registry_limit(&self) -> u64 {
        let total = self.tiers.global_total;
        total.saturating_sub(self.eviction_slack_bytes.min(total / 4))
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            db: DbOptions::default(),
            tiers: Tiers::server_defaults(),
            seal_bytes: limits::DEFAULT_SEGMENT_SEAL_BYTES,
            queue_ttl_ms: limits::DEFAULT_QUEUE_TTL_MS,
            queue_max_per_client: limits::DEFAULT_SERVER_QUEUE_PER_CLIENT,
            queue_max_total: limits::DEFAULT_SERVER_QUEUE_TOTAL,
            tombstone_cap: limits::DEFAULT_SERVER_TOMBSTONES,
            max_open_segments: 256,
            terminal_retention_ms: limits::DEFAULT_TERMINAL_RETENTION_MS,
            eviction_slack_bytes: limits::DEFAULT_COMMAND_TOTAL_BYTES,
            audit_budget_bytes: limits::DEFAULT_AUDIT_BYTES,
            audit_retention_ms: limits::DEFAULT_AUDIT_RETENTION_MS,
            scrub_interval_ms: limits::DEFAULT_SCRUB_INTERVAL_MS,
        }
    }
}

/// Record limits of command segments: an output chunk is at most 64 KiB raw
/// and its stored form at most the zstd bound of that.
#[must_use]
pub fn record_limits() -> Limits {
    let raw = u32::try_from(limits::MAX_RAW_CHUNK_BYTES).unwrap_or(u32::MAX);
    let stored =
        u32::try_from(rvbox_retention::zstd_bound(limits::MAX_RAW_CHUNK_BYTES)).unwrap_or(u32::MAX);
    Limits {
        max_stored_len: stored,
        max_raw_len: raw,
    }
}

/// The writer connection's SQLite page cache, KiB.
pub const WRITER_CACHE_KIB: u64 = 32 * 1024;

/// Creates the file of a segment no row names yet (a new ordinal, or the
/// blob of a command being created), and its fan-out directory with the
/// first file in it. A file already there holds only bytes of a batch that
/// never committed, an orphan the background sweep has not reached yet: it
/// is removed and the file created afresh, so a start never has to sweep
/// orphans before it serves. The caller syncs the file's directory.
pub(crate) fn create_segment_file(
    fs: &dyn StoreFs,
    path: &std::path::Path,
) -> std::io::Result<Box<dyn SegmentFile>> {
    let first = match fs.create_new(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                fs.ensure_private_dir(dir)?;
            }
            fs.create_new(path)
        }
        other => other,
    };
    match first {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            tracing::warn!(
                file = %path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(),
                "a segment file no row names (left by a batch that never committed) is replaced"
            );
            fs.remove_file(path)?;
            fs.create_new(path)
        }
        other => other,
    }
}

/// Decompresses a small stored blob (an execution spec) of at most `cap`
/// bytes with a context reused by the calling thread: creating one costs
/// more than decompressing a spec, and a fleet run reads thousands.
pub(crate) fn decompress_small(bytes: &[u8], cap: usize) -> std::io::Result<Vec<u8>> {
    thread_local! {
        static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    DCTX.with(|cell| {
        let mut slot = cell.try_borrow_mut().map_err(std::io::Error::other)?;
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new()?);
        }
        match slot.as_mut() {
            Some(d) => d.decompress(bytes, cap),
            None => zstd::bulk::decompress(bytes, cap),
        }
    })
}

/// A reusable zstd decompression context.
pub(crate) struct Dctx(pub(crate) zstd::bulk::Decompressor<'static>);

impl std::fmt::Debug for Dctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dctx")
    }
}

/// An open segment the writer appends to.
#[derive(Debug)]
pub(crate) struct OpenSegment {
    pub(crate) ordinal: u32,
    pub(crate) file: Box<dyn SegmentFile>,
    /// Bytes known committed (equal to the database's `committed_end`).
    pub(crate) committed: u64,
}

/// The server store. One value per data directory and process; it holds
/// the single-instance lock for its whole life.
#[derive(Debug)]
pub struct Store {
    pub(crate) layout: Layout,
    pub(crate) fs: Arc<dyn StoreFs>,
    pub(crate) entropy: Arc<dyn Entropy>,
    /// The WAL checkpointer (declared before the writer's connection, so
    /// it stops and closes first).
    _checkpointer: crate::checkpoint::Checkpointer,
    pub(crate) conn: Connection,
    pub(crate) opts: StoreOptions,
    pub(crate) hook: Arc<dyn CrashHook>,
    pub(crate) open_segments: BTreeMap<[u8; 16], OpenSegment>,
    /// The group journal; `None` once it failed and could not be cut back.
    pub(crate) journal: Option<crate::journal::GroupJournal>,
    /// Reused zstd context for validating output (creating one per chunk
    /// costs more than decompressing 1 KiB).
    pub(crate) dctx: Dctx,
    pub(crate) metrics: crate::metrics::StoreMetrics,
    pub(crate) health: crate::health::Health,
    /// Audited writes leave flushing the outbox to maintenance until this
    /// wall time (a flush failed).
    pub(crate) audit_flush_backoff_until: i64,
    /// Where the background scrub's cycle stands.
    pub(crate) scrub: crate::scrub::ScrubState,
    /// Where maintenance's rotation-due check goes on (a slice per pass).
    pub(crate) rotation_cursor: Option<[u8; 16]>,
    server_id: [u8; 16],
    token_key: [u8; identity::TOKEN_KEY_LEN],
    _lock: InstanceLock,
}

impl Store {
    /// Opens (creating on first boot) the store in `layout`: takes the
    /// single-instance lock, creates the private directories, opens SQLite
    /// with checked PRAGMAs, applies migrations, and loads the server id and
    /// token key. Segment recovery is a separate step ([`Store::recover`]).
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another process holds the directory, or
    /// any I/O, SQLite, migration or integrity failure.
    pub fn open(
        layout: Layout,
        fs: Arc<dyn StoreFs>,
        entropy: Arc<dyn Entropy>,
        opts: StoreOptions,
        now_ms: i64,
    ) -> Result<Self, StoreError> {
        fs.ensure_private_dir(layout.root())
            .map_err(|e| StoreError::io("create data directory", layout.root(), e))?;
        let lock = InstanceLock::acquire(&layout.lock_file())?;
        layout.create(fs.as_ref())?;
        layout.migrate_flat_segments(fs.as_ref())?;
        let mut conn = db::open(&layout.db_file(), opts.db)?;
        // the writer's page cache: the upper levels of every hot index stay
        // in it however large the history grows (SQLite's default is 2 MiB)
        conn.execute_batch(&format!("PRAGMA cache_size = -{}", WRITER_CACHE_KIB))
            .map_err(|e| StoreError::sqlite("set the page cache size", e))?;
        // statement journals (a statement with triggers, or a savepoint of a
        // write group, inside a larger transaction) stay in memory: on a
        // file they cost one write per page touched; they hold at most the
        // pages one statement or one grouped write changes
        conn.execute_batch("PRAGMA temp_store = MEMORY")
            .map_err(|e| StoreError::sqlite("keep statement journals in memory", e))?;
        // checkpoints run on the checkpointer's thread (checkpoint.rs); the
        // writer's own is the bound for when that one falls behind
        conn.execute_batch(&format!(
            "PRAGMA wal_autocheckpoint = {}",
            crate::checkpoint::WRITER_FALLBACK_PAGES
        ))
        .map_err(|e| StoreError::sqlite("set the writer's checkpoint threshold", e))?;
        db::migrate(&mut conn, now_ms)?;
        let metrics = crate::metrics::StoreMetrics::default();
        let checkpointer = crate::checkpoint::Checkpointer::start(
            &layout.db_file(),
            opts.db,
            metrics.checkpoint.clone(),
        )?;
        let server_id = identity::server_id(&conn, entropy.as_ref(), now_ms)?;
        let journal = crate::journal::open(fs.as_ref(), &layout, &conn)?;
        let token_key =
            identity::token_key(fs.as_ref(), &layout.token_key_file(), entropy.as_ref())?;
        tracing::info!(data_dir = %layout.root().display(), "store opened");
        Ok(Self {
            layout,
            fs,
            entropy,
            _checkpointer: checkpointer,
            conn,
            opts,
            hook: Arc::new(NoCrash),
            open_segments: BTreeMap::new(),
            journal: Some(journal),
            metrics,
            health: crate::health::Health::default(),
            dctx: Dctx(
                zstd::bulk::Decompressor::new()
                    .map_err(|e| StoreError::io("create zstd context", "", e))?,
            ),
            audit_flush_backoff_until: i64::MIN,
            scrub: crate::scrub::ScrubState::default(),
            rotation_cursor: None,
            server_id,
            token_key,
            _lock: lock,
        })
    }

    /// Closes the store the way a crash leaves it: SQLite does not
    /// checkpoint the WAL on close, so the next open replays it, as after a
    /// power cut (the simulator's crashes; an ordinary drop checkpoints).
    pub fn close_as_crashed(self) {
        if let Err(e) = self.conn.set_db_config(
            rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            true,
        ) {
            tracing::warn!(error = %e, "checkpoint on close not turned off");
        }
    }

    /// Installs a crash hook (tests and the simulator).
    pub fn set_crash_hook(&mut self, hook: Arc<dyn CrashHook>) {
        self.hook = hook;
    }

    /// The store's metrics (register them with the server's registry).
    #[must_use]
    pub fn metrics(&self) -> &crate::metrics::StoreMetrics {
        &self.metrics
    }

    /// A shared handle on the store's scoped health: readable from other
    /// threads while the writer recovers (liveness, readiness, dirty scopes).
    #[must_use]
    pub fn health(&self) -> crate::health::Health {
        self.health.clone()
    }

    /// This store's server id.
    #[must_use]
    pub fn server_id(&self) -> [u8; 16] {
        self.server_id
    }

    /// The page-token key.
    #[must_use]
    pub fn token_key(&self) -> [u8; identity::TOKEN_KEY_LEN] {
        self.token_key
    }

    /// The data-directory layout.
    #[must_use]
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Read access to the metadata database (queries only; every write goes
    /// through the store's own operations).
    #[must_use]
    pub fn db(&self) -> &Connection {
        &self.conn
    }

    /// Calls `f` with the text of every statement the writer connection
    /// starts (`None` stops): the query-plan check of the per-operation
    /// statements, and diagnostics.
    ///
    /// # Errors
    /// A SQLite failure.
    pub fn trace_statements<F>(&mut self, f: Option<F>) -> Result<(), StoreError>
    where
        F: FnMut(&str) + Send + 'static,
    {
        trace_statements(&mut self.conn, f)
    }

    /// Free bytes on the store's filesystem.
    pub(crate) fn free_space(&self) -> Result<u64, StoreError> {
        let dir = self.layout.segments_dir();
        self.fs
            .free_space(&dir)
            .map_err(|e| StoreError::io("measure free space", dir, e))
    }

    /// `RunCommand`: validates the request, then in one transaction checks
    /// idempotency and the replay tombstone, the queue limits and every
    /// quota tier, and persists the command as `queued`. Returns only once
    /// the row is durable (plan §6.4).
    ///
    /// # Errors
    /// [`OpError::Refused`] for invalid requests, conflicts, full queues or
    /// quota refusals; [`OpError::Store`] when the store failed (nothing
    /// committed).
    pub fn run_command(
        &mut self,
        req: &wire::RunCommandRequest,
        now_ms: i64,
    ) -> Result<wire::RunCommandResponse, OpError> {
        self.run_command_as(req, &crate::operator::Caller::local(), now_ms)
    }

    /// [`Store::run_command`] for a named caller: its audit record (caller,
    /// client, command, digest, environment key names, outcome) commits in
    /// the command's own transaction; a refusal or a replay, which commits
    /// nothing, is audited on its own.
    ///
    /// # Errors
    /// As [`Store::run_command`].
    pub fn run_command_as(
        &mut self,
        req: &wire::RunCommandRequest,
        caller: &crate::operator::Caller,
        now_ms: i64,
    ) -> Result<wire::RunCommandResponse, OpError> {
        let mut intent = crate::audit::AuditIntent::control(
            crate::audit::AuditRecord::run_command(caller, req, now_ms),
        );
        let result = self.run_command_inner(req, &mut intent, now_ms);
        self.audit_unwritten(&mut intent, &result, now_ms);
        match &result {
            Ok(_) => {
                self.metrics.commands_created.inc();
            }
            Err(e) => {
                let code = e.to_domain().code().as_str();
                self.metrics
                    .commands_refused
                    .get_or_create(&crate::metrics::CodeLabel { code })
                    .inc();
                tracing::warn!(code, "RunCommand refused");
            }
        };
        result
    }

    fn run_command_inner(
        &mut self,
        req: &wire::RunCommandRequest,
        intent: &mut crate::audit::AuditIntent,
        now_ms: i64,
    ) -> Result<wire::RunCommandResponse, OpError> {
        let valid = check_run_command(req).inspect_err(|e| {
            if e.field() == "script" && e.code() == Code::InvalidArgument {
                self.metrics.script_verification("upload");
                tracing::warn!(reason = %e.reason(), "script refused: its bytes do not match its descriptor");
            }
        })?;
        self.health
            .check_writable(&[(wire::ScopeKind::Client, valid.client_id.as_str())])?;
        let issue = *valid.issue_uuid.as_bytes();
        let mut canonical = req.clone();
        canonical.request_id.clear();
        canonical.spec = Some(valid.spec.clone());
        let mutation_hash = request_hash("RunCommand", &canonical);
        let hash = command_hash(&valid.client_id, &valid.spec);
        let free = self.free_space()?;
        let opts = self.opts.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin RunCommand", e))?;
        let owner = Owner::Command(&issue);
        if let Some(stored) =
            mutations::lookup(&tx, &valid.issue_uuid, "RunCommand", &mutation_hash, owner)?
        {
            return decode_stored(stored);
        }
        if tombstoned(&tx, &issue)? {
            return Err(DomainError::new(
                Code::AlreadyExecuted,
                "a command with this issue_uuid already ran and its history was reclaimed; use a new request_id",
            )
            .with_field("request_id")
            .into());
        }
        if command_exists(&tx, &issue)? {
            // the id names a command created by another kind of request
            return Err(DomainError::new(
                Code::Conflict,
                "request_id is already the issue_uuid of another command",
            )
            .with_field("request_id")
            .into());
        }
        let spec_raw = valid.spec.encode_to_vec();
        let spec_zstd = zstd::bulk::compress(&spec_raw, 3)
            .map_err(|e| StoreError::io("compress execution spec", "", e))?;
        // A small script (at most 64 KiB compressed and 256 KiB raw) stays
        // inline in its payload row; a larger one goes
        // to the command's blob segment (blobs.rs), written durably below
        // before this transaction names it.
        let (script, blob) = if req.script.is_empty() {
            (None, None)
        } else {
            let z = zstd::bulk::compress(&req.script, 3)
                .map_err(|e| StoreError::io("compress script", "", e))?;
            // inline only what is one upload chunk raw, so reading a range
            // of an inline script never decodes more than 256 KiB
            if z.len() <= crate::blobs::INLINE_SCRIPT_MAX
                && req.script.len() as u64 <= rvbox_domain::limits::MAX_SCRIPT_CHUNK_BYTES
            {
                (Some(z), None)
            } else {
                let blob = crate::blobs::prepare_script(&issue, &req.script, now_ms)?;
                (None, Some(blob))
            }
        };
        let row = CommandRow {
            issue: &issue,
            client_id: valid.client_id.as_str(),
            spec: &valid.spec,
            spec_zstd: &spec_zstd,
            spec_raw_len: spec_raw.len(),
            request_hash: &hash,
            script_inline: script.as_deref(),
            script_stored: blob.as_ref().map(|b| b.stored_total),
            queue_ttl_ms: valid.queue_ttl_ms.unwrap_or(opts.queue_ttl_ms),
        };
        let (r, expiry_ms) = insert_command_in(&tx, &opts, free, &row, now_ms)?;
        if let Some(b) = &blob {
            let verified = crate::blobs::write_blob(self.fs.as_ref(), &self.layout, &issue, b)?;
            if !verified {
                self.metrics.script_verification("readback");
                tracing::warn!(
                    "script segment did not read back clean; it is scanned at the next start"
                );
            }
            self.hook.at(crate::crash::points::BLOB_AFTER_SYNC);
            let charged = charge(CHARGE_VERSION, ChargeKind::ScriptPayload, b.stored_total)
                .map_err(|e| StoreError::Integrity(e.to_string()))?;
            crate::blobs::record_blob(&tx, &issue, b, charged, verified, now_ms)?;
        }
        apply_owner_global(&tx, valid.client_id.as_str(), r.owner_after, r.global_after)?;
        let response = wire::RunCommandResponse {
            issue_uuid: valid.issue_uuid.to_string(),
            queue_expiry_time: expiry_ms.map(to_timestamp),
        };
        let stored: Stored = Ok(response.encode_to_vec());
        intent.write_in(&tx, Ok(()))?;
        mutations::record(
            &tx,
            &valid.issue_uuid,
            "RunCommand",
            &mutation_hash,
            owner,
            &stored,
            Assigned {
                write_seq: None,
                revision: Some(1),
            },
            now_ms,
        )?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit RunCommand", e))?;
        self.hook.at(crate::crash::points::RUN_COMMAND_AFTER_COMMIT);
        tracing::info!(
            issue_uuid = %valid.issue_uuid,
            client_id = %valid.client_id,
            charged = r.added,
            "command queued"
        );
        Ok(response)
    }
}

/// A new command's row as [`insert_command_in`] writes it.
pub(crate) struct CommandRow<'a> {
    /// The command id.
    pub(crate) issue: &'a [u8; 16],
    /// Its client.
    pub(crate) client_id: &'a str,
    /// The validated, normalized spec.
    pub(crate) spec: &'a wire::ExecutionSpec,
    /// The spec, encoded and compressed.
    pub(crate) spec_zstd: &'a [u8],
    /// Length of the encoded spec.
    pub(crate) spec_raw_len: usize,
    /// The command's request hash (client id and spec).
    pub(crate) request_hash: &'a rvbox_domain::hash::RequestHash,
    /// A compressed script kept inline in its payload row.
    pub(crate) script_inline: Option<&'a [u8]>,
    /// The stored size of a script the caller writes to a blob segment.
    pub(crate) script_stored: Option<u64>,
    /// Queue TTL (0: indefinite).
    pub(crate) queue_ttl_ms: u64,
}

/// Creates a queued command inside the caller's transaction: the queue
/// limits, the client's registry row, the reservation of every quota tier
/// (row, closeout headroom, mutation row, spec, script), the row and an
/// inline script. Returns the reservation (the caller applies its owner
/// and global totals once any blob is recorded) and the queue expiry.
///
/// # Errors
/// [`OpError::Refused`] for full queues or quota refusals, or a store
/// failure.
pub(crate) fn insert_command_in(
    tx: &Transaction<'_>,
    opts: &StoreOptions,
    free: u64,
    row: &CommandRow<'_>,
    now_ms: i64,
) -> Result<(rvbox_retention::Reservation, Option<i64>), OpError> {
    check_queue_limits(tx, row.client_id, opts)?;
    crate::registry::ensure_client(tx, row.client_id, opts.registry_limit())?;
    let script_stored = row
        .script_inline
        .map(|z| z.len() as u64)
        .or(row.script_stored);
    let usage = Usage {
        command: 0,
        held_closeout: 0,
        owner: client_charged(tx, row.client_id)?,
        global: global_charged(tx)?,
        free_space: free,
    };
    let r = reserve_creation(&opts.tiers, usage, row.spec_zstd, script_stored)?;
    let expiry_ms = if row.queue_ttl_ms == 0 {
        None
    } else {
        Some(now_ms.saturating_add(i64::try_from(row.queue_ttl_ms).unwrap_or(i64::MAX)))
    };
    tx.execute_cached(
        "INSERT INTO commands (issue_uuid, client_id, issue_time_ms, queue_expiry_ms, lifecycle,
             revision, request_hash, spec_zstd, spec_raw_len, charged_bytes, closeout_held,
             charge_version)
         VALUES (?1, ?2, ?3, ?4, 1, 1, ?5, ?6, ?7, ?8, ?9, ?10)",
        params![
            row.issue.as_slice(),
            row.client_id,
            now_ms,
            expiry_ms,
            row.request_hash.as_bytes().as_slice(),
            row.spec_zstd,
            row.spec_raw_len as i64,
            to_i64(r.command_after),
            to_i64(r.held_closeout_after),
            CHARGE_VERSION
        ],
    )
    .map_err(|e| StoreError::sqlite("insert command", e))?;
    if let (Some(z), Some(wire::execution_spec::Source::Script(d))) =
        (row.script_inline, &row.spec.source)
    {
        tx.execute_cached(
            "INSERT INTO command_payloads (issue_uuid, kind, ordinal, compression, raw_len,
                 stored_len, sha256, inline_bytes)
             VALUES (?1, ?2, 0, 1, ?3, ?4, ?5, ?6)",
            params![
                row.issue.as_slice(),
                rvbox_segment::Kind::Script.as_u8(),
                to_i64(d.size_bytes),
                z.len() as i64,
                d.sha256.as_slice(),
                z
            ],
        )
        .map_err(|e| StoreError::sqlite("store script", e))?;
    }
    Ok((r, expiry_ms))
}

fn decode_stored(stored: Stored) -> Result<wire::RunCommandResponse, OpError> {
    match stored {
        Ok(bytes) => wire::RunCommandResponse::decode(bytes.as_slice()).map_err(|_| {
            OpError::Store(StoreError::Integrity(
                "stored RunCommand result does not decode".into(),
            ))
        }),
        Err(detail) => Err(OpError::Refused(
            DomainError::new(
                Code::from_wire(detail.code).unwrap_or(Code::Internal),
                &detail.reason,
            )
            .with_field(detail.field),
        )),
    }
}

pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(crate) fn to_timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

/// Reserves a new command's row (with its closeout headroom), its spec and
/// its script, each under its own field maximum, all or nothing: a refusal
/// of any item refuses the command (the transaction is not committed).
/// Pure: every store backend reserves a new command with it.
///
/// # Errors
/// `QUOTA_EXCEEDED` naming the field, or an integrity failure of the
/// charge formula.
pub fn reserve_creation(
    tiers: &Tiers,
    usage: Usage,
    spec_zstd: &[u8],
    script_stored: Option<u64>,
) -> Result<rvbox_retention::Reservation, OpError> {
    let mut items = vec![
        (ChargeKind::CommandRow, Class::CommandCreation, 0u64),
        (ChargeKind::MutationRow, Class::Ordinary, 0),
        (
            ChargeKind::SpecPayload,
            Class::Ordinary,
            spec_zstd.len() as u64,
        ),
    ];
    if let Some(stored) = script_stored {
        items.push((ChargeKind::ScriptPayload, Class::Ordinary, stored));
    }
    let mut usage = usage;
    let mut last = None;
    let mut added = 0u64;
    for (kind, class, bytes) in items {
        let charged = charge(CHARGE_VERSION, kind, bytes)
            .map_err(|e| StoreError::Integrity(e.to_string()))?;
        let r = reserve(tiers, &usage, kind, class, charged, true).map_err(|refusal| {
            tracing::warn!(
                tier = refusal.tier.name(),
                kind = kind.name(),
                "command refused by quota"
            );
            OpError::Refused(
                DomainError::new(Code::QuotaExceeded, refusal.to_string()).with_field(
                    if kind == ChargeKind::ScriptPayload {
                        "script"
                    } else {
                        "spec"
                    },
                ),
            )
        })?;
        usage.command = r.command_after;
        usage.held_closeout = r.held_closeout_after;
        usage.owner = r.owner_after;
        usage.global = r.global_after;
        added = added.saturating_add(r.added);
        last = Some(r);
    }
    let mut r = last.ok_or_else(|| StoreError::Integrity("no creation items".into()))?;
    r.added = added;
    Ok(r)
}

pub(crate) fn tombstoned(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<bool, StoreError> {
    tx.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM command_tombstones WHERE issue_uuid = ?1)",
        params![issue.as_slice()],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("check tombstone", e))
}

pub(crate) fn command_exists(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<bool, StoreError> {
    tx.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM commands WHERE issue_uuid = ?1)",
        params![issue.as_slice()],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("check command", e))
}

fn check_queue_limits(
    tx: &Transaction<'_>,
    client: &str,
    opts: &StoreOptions,
) -> Result<(), OpError> {
    // maintained counters (migration 5), never a scan of the commands
    let per_client: i64 = tx
        .query_row_cached(
            "SELECT COALESCE((SELECT queued FROM queued_by_client WHERE client_id = ?1), 0)",
            params![client],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("read queued commands", e))?;
    let total: i64 = tx
        .query_row_cached("SELECT queued FROM quota_totals WHERE id = 1", [], |r| {
            r.get(0)
        })
        .map_err(|e| StoreError::sqlite("read queued commands", e))?;
    Ok(queue_room(to_u64(per_client), to_u64(total), opts)?)
}

/// Whether the queues have room for one more command: the client holds
/// `per_client` queued commands and the server `total`. Pure: every store
/// backend checks a new command by it.
///
/// # Errors
/// `CAPACITY_EXHAUSTED` naming the full queue.
pub fn queue_room(per_client: u64, total: u64, opts: &StoreOptions) -> Result<(), DomainError> {
    if per_client >= opts.queue_max_per_client {
        return Err(DomainError::new(
            Code::CapacityExhausted,
            format!(
                "client already has {per_client} queued commands (queue.max_per_client = {})",
                opts.queue_max_per_client
            ),
        )
        .with_field("client_id"));
    }
    if total >= opts.queue_max_total {
        return Err(DomainError::new(
            Code::CapacityExhausted,
            format!(
                "the server already holds {total} queued commands (queue.max_total = {})",
                opts.queue_max_total
            ),
        ));
    }
    Ok(())
}

impl Store {
    /// The operation counters and a full recount (a check, not a hot path).
    ///
    /// # Errors
    /// A store failure.
    pub fn operation_counts(&self) -> Result<OperationCounts, StoreError> {
        operation_counts_on(&self.conn)
    }
}

/// [`Store::operation_counts`] on any connection (the scrub's snapshot).
pub(crate) fn operation_counts_on(conn: &Connection) -> Result<OperationCounts, StoreError> {
    {
        let bad = |e| StoreError::sqlite("recount operation counters", e);
        let (queued, tombstones, queued_now, tombstones_now): (i64, i64, i64, i64) = conn
            .query_row_cached(
                "SELECT queued, tombstones,
                        (SELECT COUNT(*) FROM commands WHERE lifecycle IN (1, 2)),
                        (SELECT COUNT(*) FROM command_tombstones)
                 FROM quota_totals WHERE id = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .map_err(bad)?;
        let mut stmt = conn
            .prepare_cached(
                "SELECT client_id, counter, recount FROM (
                     SELECT q.client_id, q.queued AS counter,
                            (SELECT COUNT(*) FROM commands m
                             WHERE m.client_id = q.client_id AND m.lifecycle IN (1, 2)) AS recount
                     FROM queued_by_client q
                     UNION ALL
                     SELECT m.client_id, 0, COUNT(*) FROM commands m
                     WHERE m.lifecycle IN (1, 2)
                       AND NOT EXISTS (SELECT 1 FROM queued_by_client q WHERE q.client_id = m.client_id)
                     GROUP BY m.client_id)
                 WHERE counter <> recount OR counter = 0
                 ORDER BY client_id",
            )
            .map_err(bad)?;
        let queued_clients = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, to_u64(r.get(1)?), to_u64(r.get(2)?)))
            })
            .map_err(bad)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad)?;
        Ok(OperationCounts {
            queued: (to_u64(queued), to_u64(queued_now)),
            tombstones: (to_u64(tombstones), to_u64(tombstones_now)),
            queued_clients,
            fleet_runs: crate::fleet::fleet_count_mismatches(conn)?,
        })
    }
}

/// Calls `f` with the text of every statement `conn` starts (`None`
/// stops).
pub(crate) fn trace_statements<F>(conn: &mut Connection, f: Option<F>) -> Result<(), StoreError>
where
    F: FnMut(&str) + Send + 'static,
{
    let codes = rusqlite::trace::TraceEventCodes::SQLITE_TRACE_STMT;
    let result = match f {
        Some(mut f) => conn.trace_v2(
            codes,
            Some(move |e: rusqlite::trace::TraceEvent<'_>| {
                if let rusqlite::trace::TraceEvent::Stmt(stmt, _) = e {
                    f(&stmt.sql());
                }
            }),
        ),
        None => conn.trace_v2(codes, None::<fn(rusqlite::trace::TraceEvent<'_>)>),
    };
    result.map_err(|e| StoreError::sqlite("set statement trace", e))
}

pub(crate) fn client_charged(tx: &Connection, client: &str) -> Result<u64, StoreError> {
    let v: Option<i64> = tx
        .query_row_cached(
            "SELECT charged_bytes FROM clients WHERE client_id = ?1",
            params![client],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("read client usage", e))?;
    Ok(to_u64(v.unwrap_or(0)))
}

/// The server-wide usage every reservation sees: the command bytes plus
/// the client registry's charge ([`crate::registry`]).
pub(crate) fn global_charged(tx: &Connection) -> Result<u64, StoreError> {
    let v: i64 = tx
        .query_row_cached(
            "SELECT command_charged FROM quota_totals WHERE id = 1",
            [],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("read global usage", e))?;
    Ok(to_u64(v).saturating_add(crate::registry::charged(tx)?))
}

/// Stores a server-wide usage computed from [`global_charged`]: the
/// command bytes are what it holds beyond the registry's charge (which no
/// command write changes).
pub(crate) fn set_global_charged(tx: &Connection, global_after: u64) -> Result<(), StoreError> {
    let commands = global_after.saturating_sub(crate::registry::charged(tx)?);
    tx.execute_cached(
        "UPDATE quota_totals SET command_charged = ?1 WHERE id = 1",
        params![to_i64(commands)],
    )
    .map_err(|e| StoreError::sqlite("update global usage", e))?;
    Ok(())
}

pub(crate) fn apply_owner_global(
    tx: &Transaction<'_>,
    client: &str,
    owner_after: u64,
    global_after: u64,
) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE clients SET charged_bytes = ?2 WHERE client_id = ?1",
        params![client, to_i64(owner_after)],
    )
    .map_err(|e| StoreError::sqlite("update client usage", e))?;
    set_global_charged(tx, global_after)
}

/// Charged-byte counters compared with a full recount of the rows they
/// summarize (plan §5.2: "Add migration invariant queries that recompute
/// charged totals").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterCheck {
    /// Clients whose counter differs: (client, counter, recount).
    pub clients: Vec<(String, u64, u64)>,
    /// Global counter and the sum of client counters.
    pub global: (u64, u64),
    /// Registry row counters (clients, sessions) and their recount.
    pub registry: crate::registry::RegistryCounts,
    /// Operation counters (queued commands, tombstones) and their recount.
    pub operations: OperationCounts,
}

/// The maintained counts that gate operations, beside their recount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationCounts {
    /// Queued commands in all: (counter, recount).
    pub queued: (u64, u64),
    /// Tombstones: (counter, recount).
    pub tombstones: (u64, u64),
    /// Clients whose queued counter differs: (client, counter, recount).
    pub queued_clients: Vec<(String, u64, u64)>,
    /// Fleet runs whose target counters differ from a recount of their
    /// targets: (run, counters, recount).
    pub fleet_runs: Vec<(
        String,
        rvbox_domain::fleet::Counts,
        rvbox_domain::fleet::Counts,
    )>,
}

impl OperationCounts {
    /// True when every counter equals its recount.
    #[must_use]
    pub fn consistent(&self) -> bool {
        self.queued.0 == self.queued.1
            && self.tombstones.0 == self.tombstones.1
            && self.queued_clients.is_empty()
            && self.fleet_runs.is_empty()
    }
}

impl CounterCheck {
    /// True when every counter equals its recount.
    #[must_use]
    pub fn consistent(&self) -> bool {
        self.clients.is_empty()
            && self.global.0 == self.global.1
            && self.registry.counters == self.registry.recount
            && self.operations.consistent()
    }
}

impl Store {
    /// Recounts every charged-byte counter from the rows below it.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn check_counters(&self) -> Result<CounterCheck, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT c.client_id, c.charged_bytes,
                        COALESCE((SELECT SUM(charged_bytes) FROM commands m WHERE m.client_id = c.client_id), 0)
                 FROM clients c
                 WHERE c.charged_bytes <> COALESCE((SELECT SUM(charged_bytes) FROM commands m
                                                   WHERE m.client_id = c.client_id), 0)
                 ORDER BY c.client_id",
            )
            .map_err(|e| StoreError::sqlite("recount clients", e))?;
        let clients = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, to_u64(r.get(1)?), to_u64(r.get(2)?)))
            })
            .map_err(|e| StoreError::sqlite("recount clients", e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sqlite("recount clients", e))?;
        let global: i64 = self
            .conn
            .query_row_cached(
                "SELECT command_charged FROM quota_totals WHERE id = 1",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read global usage", e))?;
        let global = to_u64(global);
        let sum: i64 = self
            .conn
            .query_row_cached(
                "SELECT COALESCE(SUM(charged_bytes), 0) FROM clients",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("recount global", e))?;
        Ok(CounterCheck {
            clients,
            global: (global, to_u64(sum)),
            registry: self.registry_counts()?,
            operations: self.operation_counts()?,
        })
    }
}

impl Store {
    /// Applies a server-side, non-terminal lifecycle transition (dispatch,
    /// acceptance, requeue after a transient rejection), checked against
    /// the lifecycle table. Terminal lifecycles arrive as client events
    /// ([`Store::append_events`]), which also write the replay tombstone.
    ///
    /// # Errors
    /// `NOT_FOUND`, `ILLEGAL_TRANSITION`, or a store failure.
    pub fn record_transition(
        &mut self,
        issue: &[u8; 16],
        to: rvbox_domain::lifecycle::Lifecycle,
    ) -> Result<(), OpError> {
        if to.is_terminal() {
            return Err(DomainError::new(
                Code::IllegalTransition,
                "terminal lifecycles are recorded from the client's terminal event",
            )
            .into());
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin transition", e))?;
        let current: Option<i64> = tx
            .query_row_cached(
                "SELECT lifecycle FROM commands WHERE issue_uuid = ?1",
                params![issue.as_slice()],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read lifecycle", e))?;
        let current = current.ok_or_else(|| DomainError::new(Code::NotFound, "no such command"))?;
        let from =
            rvbox_domain::lifecycle::Lifecycle::from_wire(i32::try_from(current).unwrap_or(0))
                .map_err(DomainError::from)?;
        from.check_transition(to).map_err(DomainError::from)?;
        tx.execute_cached(
            "UPDATE commands SET lifecycle = ?2 WHERE issue_uuid = ?1",
            params![issue.as_slice(), to.to_wire() as i32],
        )
        .map_err(|e| StoreError::sqlite("apply transition", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit transition", e))?;
        self.hook.at(crate::crash::points::TRANSITION_AFTER_COMMIT);
        tracing::info!(from = from.as_str(), to = to.as_str(), "command transition");
        Ok(())
    }
}

/// A recovered store on the real filesystem in `dir`, for the unit tests
/// of this crate.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn test_store(dir: &std::path::Path) -> Store {
    let mut s = Store::open(
        Layout::new(dir),
        Arc::new(crate::fs::RealFs),
        Arc::new(crate::entropy::OsEntropy),
        StoreOptions::default(),
        0,
    )
    .unwrap();
    s.recover(0).unwrap();
    s
}
