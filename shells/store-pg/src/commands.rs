//! Commands on PostgreSQL: creation (`RunCommand`, idempotent by
//! `request_id`), the view dispatch and reconciliation read, and the
//! server's lifecycle writes, each a compare-and-set on the command row
//! locked `FOR UPDATE`, under the session check of the connection it was
//! made for (as `rvbox_store::commands` and `write_group` do on SQLite).
//!
//! Byte counters change by deltas (`charged_bytes = charged_bytes + $d`)
//! in the writing transaction, never by absolute values computed
//! elsewhere, so concurrent replicas never lose an update.

use postgres::Transaction;
use postgres::types::ToSql;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::{command_hash, request_hash};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::validate::check_run_command;
use rvbox_proto::v1 as wire;
use rvbox_retention::{CHARGE_VERSION, Usage, release_closeout, tombstones_to_drop};
use rvbox_store::audit::AuditRecord;
use rvbox_store::mutations::{Assigned, Owner, Stored};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::commands::{CommandView, ReconcileWrite, ServerTerminal};
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::sessions::SessionFence;

use crate::audit::write_in;
use crate::mutations;
use crate::sessions::{check_fence, ensure_client, global_charged, to_i64, to_u64};
use crate::{Fail, PgStore, StoreOptions};

pub(crate) const VIEW_COLUMNS: &str =
    "c.issue_uuid, c.client_id, c.lifecycle, c.revision, c.request_hash,
    c.last_event_seq, c.issue_time_ms, c.queue_expiry_ms, c.expired_pending,
    COALESCE((SELECT SUM(p.raw_len) FROM command_payloads p
              WHERE p.issue_uuid = c.issue_uuid AND p.kind = 3), 0)::bigint";

pub(crate) fn view_of(r: &postgres::Row) -> CommandView {
    let issue: Vec<u8> = r.get(0);
    let hash: Vec<u8> = r.get(4);
    CommandView {
        issue_uuid: <[u8; 16]>::try_from(issue.as_slice()).unwrap_or([0; 16]),
        client_id: r.get(1),
        lifecycle: lifecycle_of(r.get(2)),
        revision: to_u64(r.get(3)),
        request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or([0; 32]),
        last_event_seq: to_u64(r.get(5)),
        issue_time_ms: r.get(6),
        queue_expiry_ms: r.get(7),
        expired_pending: r.get(8),
        script_bytes: to_u64(r.get(9)),
    }
}

fn lifecycle_of(raw: i64) -> Lifecycle {
    Lifecycle::from_wire(i32::try_from(raw).unwrap_or(0)).unwrap_or(Lifecycle::Interrupted)
}

fn wire_lifecycle(l: Lifecycle) -> i64 {
    i64::from(l.to_wire() as i32)
}

/// The command's view; `lock` takes its row `FOR UPDATE` (every write
/// starts so: the compare-and-set then holds until the commit).
pub(crate) fn load_view(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    lock: bool,
) -> Result<CommandView, Fail> {
    let sql = if lock {
        format!("SELECT {VIEW_COLUMNS} FROM commands c WHERE c.issue_uuid = $1 FOR UPDATE OF c")
    } else {
        format!("SELECT {VIEW_COLUMNS} FROM commands c WHERE c.issue_uuid = $1")
    };
    tx.query_opt(sql.as_str(), &[&issue.as_slice()])
        .map_err(Fail::db("load command"))?
        .map(|r| view_of(&r))
        .ok_or_else(|| Fail::refused(Code::NotFound, "no such command"))
}

/// The compare-and-set every write starts with.
fn expect(view: &CommandView, lifecycle: &[Lifecycle], revision: u64) -> Result<(), Fail> {
    if !lifecycle.contains(&view.lifecycle) || view.revision != revision {
        return Err(Fail::refused(
            Code::Conflict,
            format!(
                "the command is {} at revision {}, not what the decision saw",
                view.lifecycle.as_str(),
                view.revision
            ),
        ));
    }
    Ok(())
}

fn set_lifecycle(tx: &mut Transaction<'_>, issue: &[u8; 16], to: Lifecycle) -> Result<(), Fail> {
    crate::prep::execute(
        tx,
        "UPDATE commands SET lifecycle = $2 WHERE issue_uuid = $1",
        &[&issue.as_slice(), &wire_lifecycle(to)],
    )
    .map_err(Fail::db("record transition"))?;
    Ok(())
}

/// Changes the client's and the server-wide command charges by deltas.
fn add_charges(
    tx: &mut Transaction<'_>,
    client_id: &str,
    owner_delta: i64,
    global_delta: i64,
) -> Result<(), Fail> {
    if owner_delta != 0 {
        crate::prep::execute(
            tx,
            "UPDATE clients SET charged_bytes = charged_bytes + $2 WHERE client_id = $1",
            &[&client_id, &owner_delta],
        )
        .map_err(Fail::db("update client usage"))?;
    }
    if global_delta != 0 {
        crate::prep::execute(
            tx,
            "UPDATE quota_totals SET command_charged = command_charged + $1 WHERE id = 1",
            &[&global_delta],
        )
        .map_err(Fail::db("update global usage"))?;
    }
    Ok(())
}

fn client_charged(tx: &mut Transaction<'_>, client_id: &str) -> Result<u64, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT charged_bytes FROM clients WHERE client_id = $1",
        &[&client_id],
    )
    .map_err(Fail::db("read client usage"))?
    .map_or(0, |r| to_u64(r.get(0))))
}

fn delta(after: u64, before: u64) -> i64 {
    to_i64(after).saturating_sub(to_i64(before))
}

/// The terminal write of a server decision: lifecycle and terminal time,
/// rejection reason, closeout headroom released, pending stdin discarded,
/// the replay tombstone.
pub(crate) fn finish_in(
    tx: &mut Transaction<'_>,
    view: &CommandView,
    to: Lifecycle,
    rejection: Option<&wire::ErrorDetail>,
    now_ms: i64,
    cap: u64,
) -> Result<(), Fail> {
    let issue = view.issue_uuid;
    let row = crate::prep::query_one(
        tx,
        "SELECT charged_bytes, closeout_held FROM commands WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("load command usage"))?;
    let usage = Usage {
        command: to_u64(row.get(0)),
        held_closeout: to_u64(row.get(1)),
        owner: client_charged(tx, &view.client_id)?,
        global: global_charged(tx)?,
        free_space: 0,
    };
    let after = release_closeout(&usage).map_err(|e| Fail::Integrity(e.to_string()))?;
    crate::prep::execute(
        tx,
        "UPDATE commands SET lifecycle = $2, terminal_time_ms = GREATEST($3, issue_time_ms),
                 rejection = COALESCE($4, rejection), charged_bytes = $5, closeout_held = 0,
                 output_charged = LEAST(output_charged, $5)
             WHERE issue_uuid = $1",
        &[
            &issue.as_slice(),
            &wire_lifecycle(to),
            &now_ms,
            &rejection.map(prost::Message::encode_to_vec),
            &to_i64(after.command),
        ],
    )
    .map_err(Fail::db("finish command"))?;
    crate::prep::execute(
        tx,
        "UPDATE stdin_writes SET delivery = 3, payload = '\\x'::bytea
         WHERE issue_uuid = $1 AND delivery = 1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("discard pending stdin"))?;
    add_charges(
        tx,
        &view.client_id,
        delta(after.owner, usage.owner),
        delta(after.global, usage.global),
    )?;
    insert_tombstone(
        tx,
        &issue,
        &view.request_hash,
        &view.client_id,
        to,
        now_ms,
        cap,
    )
}

/// dispatched -> queued at `revision`: the client certainly does not hold
/// the command. With a signal pending, launch was never authorized and it
/// ends `cancelled` instead. Returns where it went.
fn requeue_in(
    tx: &mut Transaction<'_>,
    view: &CommandView,
    revision: u64,
    now_ms: i64,
    cap: u64,
) -> Result<Lifecycle, Fail> {
    expect(view, &[Lifecycle::Dispatched], revision)?;
    let issue = view.issue_uuid;
    crate::prep::execute(
        tx,
        "UPDATE commands SET expired_pending = false WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("clear expired pending"))?;
    let signalled = crate::prep::query_opt(
        tx,
        "SELECT 1 FROM command_signals WHERE issue_uuid = $1 LIMIT 1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("look up pending signals"))?
    .is_some();
    if signalled {
        finish_in(tx, view, Lifecycle::Cancelled, None, now_ms, cap)?;
        return Ok(Lifecycle::Cancelled);
    }
    set_lifecycle(tx, &issue, Lifecycle::Queued)?;
    Ok(Lifecycle::Queued)
}

/// A command's replay tombstone, and the FIFO held to its cap.
pub(crate) fn insert_tombstone(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    request_hash: &[u8],
    client_id: &str,
    lifecycle: Lifecycle,
    now_ms: i64,
    cap: u64,
) -> Result<(), Fail> {
    crate::prep::execute(tx, "INSERT INTO command_tombstones (issue_uuid, request_hash, client_id, lifecycle, terminal_ms)
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (issue_uuid) DO NOTHING",
        &[
            &issue.as_slice(),
            &request_hash,
            &client_id,
            &wire_lifecycle(lifecycle),
            &now_ms,
        ],
    )
    .map_err(Fail::db("insert tombstone"))?;
    let count: i64 =
        crate::prep::query_one(tx, "SELECT tombstones FROM quota_totals WHERE id = 1", &[])
            .map_err(Fail::db("read tombstone count"))?
            .get(0);
    let drop = tombstones_to_drop(to_u64(count), cap);
    if drop > 0 {
        crate::prep::execute(
            tx,
            "DELETE FROM command_tombstones WHERE seq IN
                 (SELECT seq FROM command_tombstones ORDER BY seq LIMIT $1)",
            &[&to_i64(drop)],
        )
        .map_err(Fail::db("trim tombstones"))?;
    }
    Ok(())
}

fn decode_stored(stored: Stored) -> Result<wire::RunCommandResponse, Fail> {
    match stored {
        Ok(bytes) => wire::RunCommandResponse::decode(bytes.as_slice())
            .map_err(|_| Fail::Integrity("stored RunCommand result does not decode".into())),
        Err(detail) => Err(DomainError::new(
            Code::from_wire(detail.code).unwrap_or(Code::Internal),
            &detail.reason,
        )
        .with_field(detail.field)
        .into()),
    }
}

fn to_timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

/// The queue limits of a new command, from the maintained counters.
fn check_queue_limits(
    tx: &mut Transaction<'_>,
    client: &str,
    opts: &StoreOptions,
) -> Result<(), Fail> {
    let per_client: i64 = crate::prep::query_one(
        tx,
        "SELECT COALESCE((SELECT queued FROM queued_by_client WHERE client_id = $1), 0)::bigint",
        &[&client],
    )
    .map_err(Fail::db("read queued commands"))?
    .get(0);
    let total: i64 =
        crate::prep::query_one(tx, "SELECT queued FROM quota_totals WHERE id = 1", &[])
            .map_err(Fail::db("read queued commands"))?
            .get(0);
    Ok(rvbox_store::store::queue_room(
        to_u64(per_client),
        to_u64(total),
        opts,
    )?)
}

/// Whether retention reclaimed a command with this id (its tombstone).
pub(crate) fn tombstoned(tx: &mut Transaction<'_>, issue: &[u8; 16]) -> Result<bool, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM command_tombstones WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("check tombstone"))?
    .is_some())
}

/// Whether a command has this id.
pub(crate) fn command_exists(tx: &mut Transaction<'_>, issue: &[u8; 16]) -> Result<bool, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM commands WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("check command"))?
    .is_some())
}

/// A script chunk as stored: raw length, zstd bytes, SHA-256 of the raw
/// bytes.
pub(crate) type ScriptChunk = (usize, Vec<u8>, [u8; 32]);

/// A script in chunks of one upload piece each, compressed one by one, so
/// a range read decompresses only the chunks it covers.
pub(crate) fn script_chunks(raw: &[u8]) -> Result<Vec<ScriptChunk>, Fail> {
    let piece = usize::try_from(rvbox_domain::limits::MAX_SCRIPT_CHUNK_BYTES).unwrap_or(1 << 18);
    raw.chunks(piece.max(1))
        .map(|raw| {
            zstd::bulk::compress(raw, 3)
                .map(|z| (raw.len(), z, rvbox_segment::sha256(raw)))
                .map_err(|e| Fail::Integrity(format!("compress script: {e}")))
        })
        .collect()
}

/// A command to create.
pub(crate) struct NewCommand<'a> {
    pub(crate) issue: &'a [u8; 16],
    pub(crate) client_id: &'a str,
    pub(crate) spec: &'a wire::ExecutionSpec,
    pub(crate) spec_zstd: &'a [u8],
    pub(crate) spec_raw_len: usize,
    pub(crate) hash: &'a [u8; 32],
    pub(crate) script: &'a [ScriptChunk],
    /// 0: indefinite.
    pub(crate) queue_ttl_ms: u64,
}

/// Creates a command (queued, revision 1) with its script, under the
/// queue limits and the quotas, charging its client and the server;
/// returns its queue expiry. The caller checked that its id is fresh.
pub(crate) fn insert_command_in(
    tx: &mut Transaction<'_>,
    opts: &StoreOptions,
    new: &NewCommand<'_>,
    now_ms: i64,
) -> Result<Option<i64>, Fail> {
    let client_id = new.client_id;
    check_queue_limits(tx, client_id, opts)?;
    ensure_client(tx, client_id, opts)?;
    let usage = Usage {
        command: 0,
        held_closeout: 0,
        owner: client_charged(tx, client_id)?,
        global: global_charged(tx)?,
        // the database server's own disk; PostgreSQL refuses writes when
        // it is full
        free_space: u64::MAX,
    };
    let script_stored =
        (!new.script.is_empty()).then(|| new.script.iter().map(|c| c.1.len() as u64).sum::<u64>());
    let r = rvbox_store::store::reserve_creation(&opts.tiers, usage, new.spec_zstd, script_stored)
        .map_err(|e| match e {
            rvbox_store::mutations::OpError::Refused(d) => Fail::Refused(d),
            rvbox_store::mutations::OpError::Store(s) => Fail::Integrity(s.to_string()),
        })?;
    let expiry_ms = if new.queue_ttl_ms == 0 {
        None
    } else {
        Some(now_ms.saturating_add(i64::try_from(new.queue_ttl_ms).unwrap_or(i64::MAX)))
    };
    let params: [&(dyn ToSql + Sync); 10] = [
        &new.issue.as_slice(),
        &client_id,
        &now_ms,
        &expiry_ms,
        &new.hash.as_slice(),
        &new.spec_zstd,
        &i64::try_from(new.spec_raw_len).unwrap_or(i64::MAX),
        &to_i64(r.command_after),
        &to_i64(r.held_closeout_after),
        &i64::from(CHARGE_VERSION),
    ];
    crate::prep::execute(
        tx,
        "INSERT INTO commands (issue_uuid, client_id, issue_time_ms, queue_expiry_ms,
             lifecycle, revision, request_hash, spec_zstd, spec_raw_len, charged_bytes,
             closeout_held, charge_version)
         VALUES ($1, $2, $3, $4, 1, 1, $5, $6, $7, $8, $9, $10)",
        &params,
    )
    .map_err(Fail::db("insert command"))?;
    if let Some(wire::execution_spec::Source::Script(_)) = &new.spec.source {
        for (ordinal, (raw_len, z, sha)) in new.script.iter().enumerate() {
            crate::prep::execute(
                tx,
                "INSERT INTO command_payloads (issue_uuid, kind, ordinal, compression,
                     raw_len, stored_len, sha256, inline_bytes)
                 VALUES ($1, $2, $3, 1, $4, $5, $6, $7)",
                &[
                    &new.issue.as_slice(),
                    &i64::from(rvbox_segment::Kind::Script.as_u8()),
                    &i64::try_from(ordinal).unwrap_or(i64::MAX),
                    &i64::try_from(*raw_len).unwrap_or(i64::MAX),
                    &i64::try_from(z.len()).unwrap_or(i64::MAX),
                    &sha.as_slice(),
                    z,
                ],
            )
            .map_err(Fail::db("store script"))?;
        }
    }
    add_charges(
        tx,
        client_id,
        delta(r.owner_after, usage.owner),
        delta(r.global_after, usage.global),
    )?;
    Ok(expiry_ms)
}

impl PgStore {
    /// `RunCommand`, idempotent by `request_id`, audited in its
    /// transaction (on its own after a refusal).
    pub(crate) fn run_command(
        &mut self,
        req: &wire::RunCommandRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::RunCommandResponse, Fail> {
        let caller = rvbox_store::operator::Caller {
            transport: caller.transport.clone(),
            principal: caller.principal.clone(),
        };
        let record = AuditRecord::run_command(&caller, req, now_ms);
        let mut audited = false;
        let result = self.run_command_inner(req, &record, &mut audited, now_ms);
        if !audited {
            self.audit_alone(&record, &result);
        }
        if let Err(Fail::Refused(e)) = &result {
            tracing::warn!(code = e.code().as_str(), "RunCommand refused");
        }
        result
    }

    fn run_command_inner(
        &mut self,
        req: &wire::RunCommandRequest,
        record: &AuditRecord,
        audited: &mut bool,
        now_ms: i64,
    ) -> Result<wire::RunCommandResponse, Fail> {
        let valid = check_run_command(req)?;
        let issue = *valid.issue_uuid.as_bytes();
        let mut canonical = req.clone();
        canonical.request_id.clear();
        canonical.spec = Some(valid.spec.clone());
        let mutation_hash = request_hash("RunCommand", &canonical);
        let hash = command_hash(&valid.client_id, &valid.spec);
        let spec_raw = valid.spec.encode_to_vec();
        let spec_zstd = zstd::bulk::compress(&spec_raw, 3)
            .map_err(|e| Fail::Integrity(format!("compress execution spec: {e}")))?;
        let script = script_chunks(&req.script)?;
        let client_id = valid.client_id.as_str();
        let outcome = self.in_tx("RunCommand", |tx, opts| {
            crate::incidents::check_writable(tx, &[(rvbox_proto::v1::ScopeKind::Client, client_id)])?;
            if let Some(stored) = mutations::lookup(
                tx,
                &valid.issue_uuid,
                "RunCommand",
                &mutation_hash,
                Owner::Command(&issue),
            )?
            {
                return Ok((true, decode_stored(stored)));
            }
            if tombstoned(tx, &issue)? {
                return Err(DomainError::new(
                    Code::AlreadyExecuted,
                    "a command with this issue_uuid already ran and its history was reclaimed; use a new request_id",
                )
                .with_field("request_id")
                .into());
            }
            if command_exists(tx, &issue)? {
                return Err(DomainError::new(
                    Code::Conflict,
                    "request_id is already the issue_uuid of another command",
                )
                .with_field("request_id")
                .into());
            }
            let new = NewCommand {
                issue: &issue,
                client_id,
                spec: &valid.spec,
                spec_zstd: &spec_zstd,
                spec_raw_len: spec_raw.len(),
                hash: hash.as_bytes(),
                script: &script,
                queue_ttl_ms: valid.queue_ttl_ms.unwrap_or(opts.queue_ttl_ms),
            };
            let expiry_ms = insert_command_in(tx, opts, &new, now_ms)?;
            let response = wire::RunCommandResponse {
                issue_uuid: valid.issue_uuid.to_string(),
                queue_expiry_time: expiry_ms.map(to_timestamp),
            };
            let stored: Stored = Ok(response.encode_to_vec());
            write_in(tx, record, Ok(()))?;
            crate::notify::client(tx, client_id, None)?;
            mutations::record(
                tx,
                &valid.issue_uuid,
                "RunCommand",
                &mutation_hash,
                Owner::Command(&issue),
                &stored,
                Assigned::default(),
                now_ms,
            )?;
            Ok((false, Ok(response)))
        })?;
        let (replay, response) = outcome;
        *audited = !replay;
        if !replay {
            tracing::info!(client_id, "command created");
        }
        response
    }

    /// One command, as dispatch and reconciliation see it.
    pub(crate) fn command_view(&mut self, issue: &[u8; 16]) -> Result<CommandView, Fail> {
        self.in_tx("load command", |tx, _| load_view(tx, issue, false))
    }

    /// Begins a write on one command made for `session`: the session
    /// check, then the command row locked.
    fn begin_on(
        tx: &mut Transaction<'_>,
        session: Option<SessionFence>,
        issue: &[u8; 16],
    ) -> Result<CommandView, Fail> {
        // the client of the command decides whose session must be live;
        // read it unlocked first (it never changes), lock the session,
        // then the command
        let client: Option<String> = crate::prep::query_opt(
            tx,
            "SELECT client_id FROM commands WHERE issue_uuid = $1",
            &[&issue.as_slice()],
        )
        .map_err(Fail::db("load command"))?
        .map(|r| r.get(0));
        let Some(client) = client else {
            return Err(Fail::refused(Code::NotFound, "no such command"));
        };
        let key = rvbox_store::fleet::uuid_text(issue);
        crate::incidents::check_writable(
            tx,
            &[
                (rvbox_proto::v1::ScopeKind::Command, key.as_str()),
                (rvbox_proto::v1::ScopeKind::Client, client.as_str()),
            ],
        )?;
        check_fence(tx, session, &client)?;
        load_view(tx, issue, true)
    }

    /// queued -> dispatched at `revision` (when `write`), or a dispatched
    /// command sent again (still dispatched at `revision`); the stored
    /// spec either way.
    pub(crate) fn dispatch(
        &mut self,
        session: SessionFence,
        issue: &[u8; 16],
        revision: u64,
        write: bool,
    ) -> Result<wire::ExecutionSpec, Fail> {
        let spec_zstd = self.in_tx("dispatch", |tx, _| {
            let view = Self::begin_on(tx, Some(session), issue)?;
            if write {
                expect(&view, &[Lifecycle::Queued], revision)?;
                set_lifecycle(tx, issue, Lifecycle::Dispatched)?;
            } else if view.lifecycle != Lifecycle::Dispatched || view.revision != revision {
                return Err(Fail::refused(
                    Code::Conflict,
                    "the command changed since the dispatch decision",
                ));
            }
            let spec: Vec<u8> = crate::prep::query_one(
                tx,
                "SELECT spec_zstd FROM commands WHERE issue_uuid = $1",
                &[&issue.as_slice()],
            )
            .map_err(Fail::db("read execution spec"))?
            .get(0);
            Ok(spec)
        })?;
        if write {
            tracing::debug!(revision, "command dispatched");
        }
        let cap = usize::try_from(rvbox_domain::limits::MAX_EXECUTION_SPEC_BYTES).unwrap_or(0);
        zstd::bulk::decompress(&spec_zstd, cap)
            .ok()
            .and_then(|raw| wire::ExecutionSpec::decode(raw.as_slice()).ok())
            .ok_or_else(|| Fail::Integrity("the execution spec does not decode".into()))
    }

    /// dispatched -> accepted at `revision`, with the client's shell.
    pub(crate) fn record_accepted(
        &mut self,
        session: SessionFence,
        issue: &[u8; 16],
        revision: u64,
        resolved_shell: i32,
    ) -> Result<(), Fail> {
        self.in_tx("record acceptance", |tx, _| {
            let view = Self::begin_on(tx, Some(session), issue)?;
            expect(&view, &[Lifecycle::Dispatched], revision)?;
            crate::prep::execute(
                tx,
                "UPDATE commands SET lifecycle = $2, resolved_shell = $3 WHERE issue_uuid = $1",
                &[
                    &issue.as_slice(),
                    &wire_lifecycle(Lifecycle::Accepted),
                    &i64::from(resolved_shell),
                ],
            )
            .map_err(Fail::db("record acceptance"))?;
            Ok(())
        })?;
        tracing::info!(revision, "command accepted by its client");
        Ok(())
    }

    /// dispatched -> queued (or cancelled, when a signal is pending).
    pub(crate) fn requeue(
        &mut self,
        session: SessionFence,
        issue: &[u8; 16],
        revision: u64,
        now_ms: i64,
    ) -> Result<Lifecycle, Fail> {
        let to = self.in_tx("requeue", |tx, opts| {
            let view = Self::begin_on(tx, Some(session), issue)?;
            requeue_in(tx, &view, revision, now_ms, opts.tombstone_cap)
        })?;
        tracing::info!(revision, to = to.as_str(), "command returned to the queue");
        Ok(to)
    }

    /// Ends a command by a server decision, from one of `from` at
    /// `revision`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish_by_server(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        from: &[Lifecycle],
        revision: u64,
        how: ServerTerminal,
        rejection: Option<&wire::ErrorDetail>,
        now_ms: i64,
    ) -> Result<(), Fail> {
        let to = how.lifecycle();
        self.in_tx("finish command", |tx, opts| {
            let view = Self::begin_on(tx, session, issue)?;
            expect(&view, from, revision)?;
            view.lifecycle
                .check_transition(to)
                .map_err(|e| Fail::Refused(DomainError::from(e)))?;
            finish_in(tx, &view, to, rejection, now_ms, opts.tombstone_cap)
        })?;
        tracing::info!(to = to.as_str(), revision, "command ended by the server");
        Ok(())
    }

    /// A late acceptance: dispatched -> accepted at `revision`, the next
    /// (termination) revision with its pending TERM, and the
    /// late-after-expiry incident, in one transaction.
    pub(crate) fn accept_late(
        &mut self,
        session: SessionFence,
        issue: &[u8; 16],
        revision: u64,
        resolved_shell: i32,
        incident: &NewIncident,
        now_ms: i64,
    ) -> Result<u64, Fail> {
        let id = self.incident_id(now_ms)?;
        let next = self.in_tx("accept late", |tx, _| {
            let view = Self::begin_on(tx, Some(session), issue)?;
            expect(&view, &[Lifecycle::Dispatched], revision)?;
            let next = view
                .revision
                .checked_add(1)
                .ok_or_else(|| Fail::Integrity("revision overflow".into()))?;
            crate::prep::execute(
                tx,
                "UPDATE commands SET lifecycle = $2, resolved_shell = $3, revision = $4
                 WHERE issue_uuid = $1",
                &[
                    &issue.as_slice(),
                    &wire_lifecycle(Lifecycle::Accepted),
                    &i64::from(resolved_shell),
                    &to_i64(next),
                ],
            )
            .map_err(Fail::db("record late acceptance"))?;
            crate::prep::execute(
                tx,
                "INSERT INTO command_signals (issue_uuid, signal, revision, created_ms)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (issue_uuid, signal) DO UPDATE
                     SET revision = excluded.revision, created_ms = excluded.created_ms",
                &[
                    &issue.as_slice(),
                    &i64::from(wire::SignalKind::Term as i32),
                    &to_i64(next),
                    &now_ms,
                ],
            )
            .map_err(Fail::db("record pending signal"))?;
            crate::incidents::insert(tx, id, incident, now_ms)?;
            Ok(next)
        })?;
        tracing::warn!(
            revision = next,
            "late acceptance: accepted and termination recorded"
        );
        Ok(next)
    }

    /// Every decision of a reconciliation round and its incidents, in one
    /// transaction, each re-checking the revision its decision saw (any
    /// moved: `CONFLICT`, nothing written). An incident of a kind already
    /// open on the same scope is not opened again. Returns how many
    /// incidents opened.
    pub(crate) fn apply_reconciliation(
        &mut self,
        session: SessionFence,
        client_id: &str,
        writes: &[ReconcileWrite],
        incidents: &[NewIncident],
        now_ms: i64,
    ) -> Result<usize, Fail> {
        let mut ids = Vec::with_capacity(incidents.len());
        for _ in incidents {
            ids.push(self.incident_id(now_ms)?);
        }
        let opened = self.in_tx("apply reconciliation", |tx, opts| {
            let mut lost = Vec::new();
            crate::incidents::check_writable(
                tx,
                &[(rvbox_proto::v1::ScopeKind::Client, client_id)],
            )?;
            check_fence(tx, Some(session), client_id)?;
            for w in writes {
                match *w {
                    ReconcileWrite::Requeue { issue, revision } => {
                        let view = load_view(tx, &issue, true)?;
                        requeue_in(tx, &view, revision, now_ms, opts.tombstone_cap)?;
                    }
                    ReconcileWrite::Advance {
                        issue,
                        revision,
                        to,
                    } => {
                        let view = load_view(tx, &issue, true)?;
                        expect(&view, &[view.lifecycle], revision)?;
                        // a queued row the client holds walks through
                        // dispatched, then as far as the client is
                        let mut at = view.lifecycle;
                        for step in [
                            Lifecycle::Dispatched,
                            Lifecycle::Accepted,
                            Lifecycle::Running,
                        ] {
                            if at == to {
                                break;
                            }
                            if at.check_transition(step).is_ok() {
                                at = step;
                            }
                        }
                        if at != to {
                            return Err(Fail::refused(
                                Code::IllegalTransition,
                                format!(
                                    "no legal path from {} to {}",
                                    view.lifecycle.as_str(),
                                    to.as_str()
                                ),
                            ));
                        }
                        set_lifecycle(tx, &issue, to)?;
                    }
                    ReconcileWrite::Interrupt { issue, revision } => {
                        let view = load_view(tx, &issue, true)?;
                        expect(&view, &[view.lifecycle], revision)?;
                        view.lifecycle
                            .check_transition(Lifecycle::Interrupted)
                            .map_err(|e| Fail::Refused(DomainError::from(e)))?;
                        finish_in(
                            tx,
                            &view,
                            Lifecycle::Interrupted,
                            None,
                            now_ms,
                            opts.tombstone_cap,
                        )?;
                    }
                    ReconcileWrite::LostEvents {
                        issue,
                        revision,
                        first_event_seq,
                        last_event_seq,
                    } => {
                        let view = load_view(tx, &issue, true)?;
                        expect(&view, &[view.lifecycle], revision)?;
                        rvbox_store_port::commands::check_lost_range(
                            view.last_event_seq,
                            first_event_seq,
                            last_event_seq,
                        )
                        .map_err(Fail::Refused)?;
                        crate::prep::execute(
                            tx,
                            "UPDATE commands SET last_event_seq = $2 WHERE issue_uuid = $1",
                            &[&issue.as_slice(), &to_i64(last_event_seq)],
                        )
                        .map_err(Fail::db("move past lost events"))?;
                        lost.push((issue, first_event_seq, last_event_seq));
                    }
                }
            }
            let mut opened = 0usize;
            for (new, id) in incidents.iter().zip(&ids) {
                if !crate::incidents::open(tx, new)? {
                    crate::incidents::insert(tx, *id, new, now_ms)?;
                    opened += 1;
                }
            }
            for (issue, first, last) in &lost {
                // the incident the round opened (or found open) for it
                let incident: Option<Vec<u8>> = crate::prep::query_opt(
                    tx,
                    "SELECT incident_id FROM storage_incidents
                         WHERE state = 1 AND kind = $1 AND issue_uuid = $2
                         ORDER BY detected_ms DESC LIMIT 1",
                    &[
                        &i64::from(
                            rvbox_proto::v1::IncidentKind::ReconciliationContradiction as i32,
                        ),
                        &issue.as_slice(),
                    ],
                )
                .map_err(Fail::db("find the loss incident"))?
                .map(|r| r.get(0));
                crate::prep::execute(
                    tx,
                    "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes,
                         stored_bytes, source, reason, incident_id, recorded_ms)
                     VALUES ($1, $2, $3, NULL, NULL, $4, $5, $6, $7)",
                    &[
                        &issue.as_slice(),
                        &to_i64(*first),
                        &to_i64(*last),
                        &i64::from(rvbox_proto::v1::TruncationSource::StorageLoss as i32),
                        &rvbox_store_port::commands::LOST_AT_RECONCILE_REASON,
                        &incident,
                        &now_ms,
                    ],
                )
                .map_err(Fail::db("record lost events"))?;
            }
            Ok((opened, lost.len()))
        })?;
        let (opened, lost) = opened;
        if lost > 0 {
            tracing::error!(
                client_id,
                ranges = lost,
                "events the client had acknowledged are not in the store; recorded as lost"
            );
        }
        tracing::info!(
            client_id,
            writes = writes.len(),
            incidents = opened,
            "reconciliation applied"
        );
        Ok(opened)
    }

    /// Records a protocol incident that gates no scope.
    pub(crate) fn record_incident(
        &mut self,
        incident: &NewIncident,
        now_ms: i64,
    ) -> Result<(), Fail> {
        let id = self.incident_id(now_ms)?;
        self.in_tx("record incident", |tx, _| {
            crate::incidents::insert(tx, id, incident, now_ms)
        })
    }
}
