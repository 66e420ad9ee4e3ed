//! Interactive terminals (docs/terminals.md; the port's values are in
//! [`rvbox_store_port::pty`]).
//!
//! Each operator mutation (open, input, resize, close) commits with its
//! idempotency row (owner: the terminal's client), so a retry with the
//! same `request_id` gets the same answer and changes nothing. Input is
//! numbered in that transaction and stays in `pty_inputs` until the client
//! acknowledges it. What a client reports (opened, input acknowledged,
//! output, closed) is applied in one transaction per batch, fenced by the
//! session it arrived on: output is recorded by byte offset, an exact
//! repeat is recognised by its offset, and bytes the client's ring had
//! lost are a cut record, never a silent gap.
//!
//! The recording of each terminal is bounded (`PtyLimits::recording_bytes`):
//! past it the oldest records go, and an attach or a replay from before
//! the oldest output kept starts with a cut marker.
//!
//! The pure parts (the mutations' checks, refusals, audit records, hashes
//! and stored answers, and the read rules over a [`PtySource`]) are the
//! PostgreSQL store's too, so both backends decide and answer alike.

use prost::Message as _;
use rusqlite::{Connection, OptionalExtension as _, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_store_port::pty::{
    MAX_PENDING_PTY_INPUT_BYTES, MAX_PENDING_PTY_INPUTS, MAX_PTY_REASON_BYTES, OutputPlan,
    PtyApplied, PtyLimits, PtyMutation, PtyOutcome, PtyReport, PtyResume, PtyView, check_mutation,
    normalize_open, plan_output,
};
use rvbox_store_port::sessions::SessionFence;

use crate::db::Cached as _;
use crate::error::StoreError;
use crate::mutations::{self, Assigned, OpError, Owner};
use crate::store::{Store, to_i64, to_timestamp, to_u64};

/// `pty_records.kind`: output bytes at `pos`.
pub const REC_OUTPUT: i64 = 1;
/// `pty_records.kind`: input `pos` (its `input_seq`).
pub const REC_INPUT: i64 = 2;
/// `pty_records.kind`: a resize to `pos` columns and `aux` rows.
pub const REC_RESIZE: i64 = 3;
/// `pty_records.kind`: output lost on the client between `aux` and `pos`.
pub const REC_CUT: i64 = 4;

const OPENING: i64 = wire::PtyState::Opening as i64;
const OPEN: i64 = wire::PtyState::Open as i64;
const CLOSED: i64 = wire::PtyState::Closed as i64;

/// The reason kept when an operator closes a terminal.
pub const CLOSED_BY_OPERATOR: &str = "closed by an operator";
/// The reason kept when the idle timeout closes a terminal.
pub const IDLE_TIMEOUT: &str = "idle timeout";

const VIEW_COLUMNS: &str = "pty_session_id, client_id, state, open_frame, shell_type, rows, cols,
     opened_ms, closed_ms, last_activity_ms, output_offset, recorded_bytes, input_seq,
     input_acked, close_requested, close_reason, exit_result";

fn uuid_text(b: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*b).hyphenated().to_string()
}

/// The reason a closed terminal keeps, from the client's `PtyClosed`
/// reason and the row: the client's own words, except that a hang-up the
/// server asked for (the client says [`CLOSED_BY_OPERATOR`], knowing only
/// that a close came) keeps the server's reason for asking, which names
/// who asked (an operator, or the idle timeout); no words at all keep the
/// server's reason, or say the shell ended.
#[must_use]
pub fn closed_reason(client_reason: &str, view: &PtyView) -> String {
    let asked = view.close_requested && !view.info.close_reason.is_empty();
    if client_reason.is_empty() || (asked && client_reason == CLOSED_BY_OPERATOR) {
        if view.info.close_reason.is_empty() {
            "the shell ended".to_owned()
        } else {
            view.info.close_reason.clone()
        }
    } else {
        bounded_reason(client_reason)
    }
}

/// `reason` cut to [`MAX_PTY_REASON_BYTES`] on a character boundary.
#[must_use]
pub fn bounded_reason(reason: &str) -> String {
    if reason.len() <= MAX_PTY_REASON_BYTES {
        return reason.to_owned();
    }
    let mut end = MAX_PTY_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_owned()
}

/// A terminal's row as every store backend keeps it (the columns of
/// `pty_sessions` that [`PtyView`] is made of).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtyRow {
    /// `pty_session_id` (16 bytes).
    pub pty_session_id: Vec<u8>,
    /// `client_id`.
    pub client_id: String,
    /// `state` (a `PtyState`).
    pub state: i64,
    /// `open_frame` (an encoded `PtyOpen`).
    pub open_frame: Vec<u8>,
    /// `shell_type`.
    pub shell_type: i64,
    /// `rows`.
    pub rows: i64,
    /// `cols`.
    pub cols: i64,
    /// `opened_ms`.
    pub opened_ms: i64,
    /// `closed_ms`.
    pub closed_ms: Option<i64>,
    /// `last_activity_ms`.
    pub last_activity_ms: i64,
    /// `output_offset`.
    pub output_offset: i64,
    /// `recorded_bytes`.
    pub recorded_bytes: i64,
    /// `input_seq`.
    pub input_seq: i64,
    /// `input_acked`.
    pub input_acked: i64,
    /// `close_requested`.
    pub close_requested: bool,
    /// `close_reason`.
    pub close_reason: String,
    /// `exit_result` (an encoded `ExitResult`).
    pub exit_result: Option<Vec<u8>>,
}

/// The terminal a stored row describes.
///
/// # Errors
/// [`StoreError::Integrity`] when the row's id or encoded frames are
/// malformed.
pub fn view_from_row(row: PtyRow) -> Result<PtyView, StoreError> {
    let id = <[u8; 16]>::try_from(row.pty_session_id.as_slice())
        .map_err(|_| StoreError::Integrity("pty_session_id is not 16 bytes".into()))?;
    let open = wire::PtyOpen::decode(row.open_frame.as_slice())
        .map_err(|_| StoreError::Integrity("a stored PtyOpen does not decode".into()))?;
    let exit_result = row
        .exit_result
        .map(|b| wire::ExitResult::decode(b.as_slice()))
        .transpose()
        .map_err(|_| StoreError::Integrity("a stored ExitResult does not decode".into()))?;
    Ok(PtyView {
        info: wire::PtySessionInfo {
            pty_session_id: uuid_text(&id),
            client_id: row.client_id,
            state: i32::try_from(row.state).unwrap_or(0),
            opened_time: Some(to_timestamp(row.opened_ms)),
            closed_time: row.closed_ms.map(to_timestamp),
            output_offset: to_u64(row.output_offset),
            rows: u32::try_from(row.rows).unwrap_or(0),
            cols: u32::try_from(row.cols).unwrap_or(0),
            exit_result,
            viewers: 0,
            last_activity_time: Some(to_timestamp(row.last_activity_ms)),
            close_reason: row.close_reason,
            shell_type: i32::try_from(row.shell_type).unwrap_or(0),
            recorded_bytes: to_u64(row.recorded_bytes),
        },
        open,
        input_seq: to_u64(row.input_seq),
        input_acked: to_u64(row.input_acked),
        close_requested: row.close_requested,
    })
}

fn row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<PtyRow> {
    let close_requested: i64 = r.get(14)?;
    Ok(PtyRow {
        pty_session_id: r.get(0)?,
        client_id: r.get(1)?,
        state: r.get(2)?,
        open_frame: r.get(3)?,
        shell_type: r.get(4)?,
        rows: r.get(5)?,
        cols: r.get(6)?,
        opened_ms: r.get(7)?,
        closed_ms: r.get(8)?,
        last_activity_ms: r.get(9)?,
        output_offset: r.get(10)?,
        recorded_bytes: r.get(11)?,
        input_seq: r.get(12)?,
        input_acked: r.get(13)?,
        close_requested: close_requested == 1,
        close_reason: r.get(15)?,
        exit_result: r.get(16)?,
    })
}

fn view_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<Result<PtyView, StoreError>> {
    Ok(view_from_row(row_of(r)?))
}

/// One terminal, if the server has it.
///
/// # Errors
/// A store failure.
pub fn load_view(conn: &Connection, id: &[u8; 16]) -> Result<Option<PtyView>, StoreError> {
    conn.query_row_cached(
        &format!("SELECT {VIEW_COLUMNS} FROM pty_sessions WHERE pty_session_id = ?1"),
        params![id.as_slice()],
        view_of,
    )
    .optional()
    .map_err(|e| StoreError::sqlite("read terminal", e))?
    .transpose()
}

/// The refusal of a mutation or a read of a terminal the server does not
/// have.
#[must_use]
pub fn not_found(id: &[u8; 16]) -> OpError {
    OpError::Refused(
        DomainError::new(
            Code::NotFound,
            format!("no terminal {} on this server", uuid_text(id)),
        )
        .with_field("pty_session_id"),
    )
}

/// The refusal of input (or a resize) to a closed terminal.
#[must_use]
pub fn closed_error(v: &PtyView) -> OpError {
    let why = if v.info.close_reason.is_empty() {
        "closed".to_owned()
    } else {
        v.info.close_reason.clone()
    };
    OpError::Refused(
        DomainError::new(
            Code::FailedPrecondition,
            format!("the terminal is closed ({why})"),
        )
        .with_field("pty_session_id"),
    )
}

/// The audit record of a mutation, and whether the mutation is audited
/// (opens and closes are; input never is: it may hold a password).
#[must_use]
pub fn mutation_audit(
    m: &PtyMutation,
    caller: &crate::operator::Caller,
    now_ms: i64,
) -> (crate::audit::AuditRecord, bool) {
    let audited = matches!(m, PtyMutation::Open(_) | PtyMutation::Close(_));
    let mut rec = crate::audit::AuditRecord::control(caller, m.method(), now_ms);
    if let PtyMutation::Open(r) = m {
        rec.client_id = Some(r.client_id.clone());
        rec.detail = format!(
            "terminal {} {}x{} {}",
            r.request_id,
            r.cols,
            r.rows,
            wire::ShellType::try_from(r.shell_type).map_or("shell unknown", |s| s.as_str_name())
        );
        rec = rec.with_env_names(r.env.keys());
    }
    if let PtyMutation::Close(r) = m {
        rec.detail = format!("terminal {}", r.pty_session_id);
    }
    (rec, audited)
}

/// The request hash a mutation's idempotency row keeps (the request
/// without its `request_id`).
#[must_use]
pub fn mutation_hash(m: &PtyMutation) -> rvbox_domain::hash::RequestHash {
    let mut canonical = m.clone();
    match &mut canonical {
        PtyMutation::Open(r) => {
            *r = normalize_open(r);
            r.request_id.clear();
            request_hash("OpenPtySession", r)
        }
        PtyMutation::Write(r) => {
            r.request_id.clear();
            request_hash("WritePtyInput", r)
        }
        PtyMutation::Resize(r) => {
            r.request_id.clear();
            request_hash("ResizePtySession", r)
        }
        PtyMutation::Close(r) => {
            r.request_id.clear();
            request_hash("ClosePtySession", r)
        }
    }
}

/// The refusal of an open on a client that never registered.
#[must_use]
pub fn unknown_client(client: &str) -> OpError {
    OpError::Refused(
        DomainError::new(
            Code::NotFound,
            format!(
                "no client {client:?} has registered with this server; a terminal opens only on a known client"
            ),
        )
        .with_field("client_id"),
    )
}

/// Checks an open against the bounds, given the terminals not closed of
/// its client (`mine`) and of the server (`all`).
///
/// # Errors
/// `CAPACITY_EXHAUSTED` naming the bound reached.
pub fn check_open_limits(
    client: &str,
    mine: u64,
    all: u64,
    limits: PtyLimits,
) -> Result<(), OpError> {
    if mine >= u64::from(limits.per_client) {
        return Err(OpError::Refused(
            DomainError::new(
                Code::CapacityExhausted,
                format!(
                    "client {client:?} has {mine} terminals open; terminals.max_per_client is {}; close one first",
                    limits.per_client
                ),
            )
            .with_field("client_id"),
        ));
    }
    if all >= u64::from(limits.per_server) {
        return Err(OpError::Refused(DomainError::new(
            Code::CapacityExhausted,
            format!(
                "this server has {all} terminals open; terminals.max_open is {}; close one first",
                limits.per_server
            ),
        )));
    }
    Ok(())
}

/// Checks an input of `len` bytes against what waits unacknowledged
/// (`count` inputs of `bytes` bytes).
///
/// # Errors
/// `CAPACITY_EXHAUSTED` naming `data`.
pub fn check_pending_input(count: u64, bytes: u64, len: usize) -> Result<(), OpError> {
    if count >= MAX_PENDING_PTY_INPUTS
        || bytes.saturating_add(len as u64) > MAX_PENDING_PTY_INPUT_BYTES
    {
        return Err(OpError::Refused(
            DomainError::new(
                Code::CapacityExhausted,
                format!(
                    "the terminal has {count} inputs ({bytes} bytes) its client has not acknowledged; at most {MAX_PENDING_PTY_INPUTS} inputs and {MAX_PENDING_PTY_INPUT_BYTES} bytes wait; retry once the client catches up"
                ),
            )
            .with_field("data"),
        ));
    }
    Ok(())
}

/// The open frame of the terminal `id` an open asks for.
#[must_use]
pub fn open_frame(id: &[u8; 16], r: &wire::OpenPtySessionRequest) -> wire::PtyOpen {
    wire::PtyOpen {
        pty_session_id: uuid_text(id),
        shell_type: r.shell_type,
        cwd: r.cwd.clone(),
        env: r.env.clone(),
        rows: r.rows,
        cols: r.cols,
        profile_flags: normalize_open(r).profile_flags,
    }
}

/// The stored answer of a fresh mutation of terminal `id` (`input_seq`:
/// the number a write got).
#[must_use]
pub fn fresh_response(m: &PtyMutation, id: &[u8; 16], input_seq: u64) -> Vec<u8> {
    let pty_session_id = uuid_text(id);
    match m {
        PtyMutation::Open(_) => wire::OpenPtySessionResponse { pty_session_id }.encode_to_vec(),
        PtyMutation::Write(_) => wire::WritePtyInputResponse {
            pty_session_id,
            input_seq,
        }
        .encode_to_vec(),
        PtyMutation::Resize(_) => wire::ResizePtySessionResponse { pty_session_id }.encode_to_vec(),
        PtyMutation::Close(_) => wire::ClosePtySessionResponse { pty_session_id }.encode_to_vec(),
    }
}

/// The `input_seq` a replayed mutation's stored answer holds (a write's),
/// or its stored refusal.
///
/// # Errors
/// The stored refusal, or [`StoreError::Integrity`] when the stored
/// answer does not decode.
pub fn replayed_input_seq(
    m: &PtyMutation,
    stored: mutations::Stored,
) -> Result<Option<u64>, OpError> {
    match m {
        PtyMutation::Write(_) => Ok(Some(
            decode_stored::<wire::WritePtyInputResponse>(stored)?.input_seq,
        )),
        _ => {
            stored.map_err(|d| OpError::Refused(crate::incidents::detail_to_error(&d)))?;
            Ok(None)
        }
    }
}

/// Records a window size (`rows` x `cols`).
fn record_size(
    tx: &Transaction<'_>,
    id: &[u8; 16],
    opened_ms: i64,
    now_ms: i64,
    rows: u32,
    cols: u32,
) -> Result<(), StoreError> {
    record(
        tx,
        id,
        opened_ms,
        now_ms,
        REC_RESIZE,
        u64::from(cols),
        u64::from(rows),
        &[],
    )
}

/// Appends one record and charges it, inside `tx`.
#[allow(clippy::too_many_arguments)]
fn record(
    tx: &Transaction<'_>,
    id: &[u8; 16],
    opened_ms: i64,
    now_ms: i64,
    kind: i64,
    pos: u64,
    aux: u64,
    data: &[u8],
) -> Result<(), StoreError> {
    let seq: i64 = tx
        .query_row_cached(
            "UPDATE pty_sessions SET next_rec_seq = next_rec_seq + 1,
                 recorded_bytes = recorded_bytes + ?2
             WHERE pty_session_id = ?1 RETURNING next_rec_seq - 1",
            params![id.as_slice(), data.len() as i64],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("number a terminal record", e))?;
    tx.execute_cached(
        "INSERT INTO pty_records (pty_session_id, rec_seq, at_ms, kind, pos, aux, data)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            id.as_slice(),
            seq,
            now_ms.saturating_sub(opened_ms).max(0),
            kind,
            to_i64(pos),
            to_i64(aux),
            data
        ],
    )
    .map_err(|e| StoreError::sqlite("insert a terminal record", e))?;
    Ok(())
}

/// Closed terminals one maintenance pass removes at most.
pub const PRUNE_BATCH: usize = 256;

/// What the quotas leave for the recording of `id` (a terminal of
/// `client_id`): the client's quota less its charged command bytes and
/// its other recordings, within the server's quota less every charged
/// byte and every other recording.
fn recording_room(
    tx: &Transaction<'_>,
    client_id: &str,
    id: &[u8; 16],
    tiers: &rvbox_retention::Tiers,
) -> Result<u64, StoreError> {
    let read = |e| StoreError::sqlite("read the quota left for a recording", e);
    let client_charged: i64 = tx
        .query_row_cached(
            "SELECT COALESCE((SELECT charged_bytes FROM clients WHERE client_id = ?1), 0)",
            params![client_id],
            |r| r.get(0),
        )
        .map_err(read)?;
    let (client_others, all_others): (i64, i64) = tx
        .query_row_cached(
            "SELECT COALESCE(SUM(CASE WHEN client_id = ?1 THEN recorded_bytes ELSE 0 END), 0),
                    COALESCE(SUM(recorded_bytes), 0)
             FROM pty_sessions WHERE pty_session_id <> ?2",
            params![client_id, id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(read)?;
    let global = crate::store::global_charged(tx)?;
    let client_room = tiers
        .per_owner_total
        .saturating_sub(to_u64(client_charged))
        .saturating_sub(to_u64(client_others));
    let global_room = tiers
        .global_total
        .saturating_sub(global)
        .saturating_sub(to_u64(all_others));
    Ok(client_room.min(global_room))
}

/// Closed terminals older than `retention_ms` (0 keeps them) go with
/// their recordings, at most `limit` a pass; returns how many went.
///
/// # Errors
/// A store failure (nothing of the pass committed).
pub(crate) fn prune_closed(
    conn: &mut rusqlite::Connection,
    now_ms: i64,
    retention_ms: u64,
    limit: usize,
) -> Result<u64, StoreError> {
    if retention_ms == 0 {
        return Ok(0);
    }
    let before = now_ms.saturating_sub(to_i64(retention_ms));
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| StoreError::sqlite("begin terminal pruning", e))?;
    let ids: Vec<Vec<u8>> = {
        let mut stmt = tx
            .prepare_cached(
                "SELECT pty_session_id FROM pty_sessions
                 WHERE state = 3 AND closed_ms < ?1 ORDER BY closed_ms LIMIT ?2",
            )
            .map_err(|e| StoreError::sqlite("prepare terminal pruning", e))?;
        let rows = stmt
            .query_map(params![before, limit as i64], |r| r.get(0))
            .map_err(|e| StoreError::sqlite("read terminals to prune", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("read terminals to prune", e))?
    };
    for id in &ids {
        for sql in [
            "DELETE FROM pty_records WHERE pty_session_id = ?1",
            "DELETE FROM pty_inputs WHERE pty_session_id = ?1",
            "DELETE FROM pty_sessions WHERE pty_session_id = ?1",
        ] {
            tx.execute_cached(sql, params![id])
                .map_err(|e| StoreError::sqlite("prune a closed terminal", e))?;
        }
    }
    tx.commit()
        .map_err(|e| StoreError::sqlite("commit terminal pruning", e))?;
    Ok(ids.len() as u64)
}

/// Drops the oldest records of `id` while its recording is over `cap`.
fn trim_recording(tx: &Transaction<'_>, id: &[u8; 16], cap: u64) -> Result<(), StoreError> {
    let recorded: i64 = tx
        .query_row_cached(
            "SELECT recorded_bytes FROM pty_sessions WHERE pty_session_id = ?1",
            params![id.as_slice()],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("read recording size", e))?;
    let mut over = to_u64(recorded).saturating_sub(cap);
    if over == 0 {
        return Ok(());
    }
    let mut doomed: Vec<(i64, u64)> = Vec::new();
    {
        let mut stmt = tx
            .prepare_cached(
                "SELECT rec_seq, length(data) FROM pty_records WHERE pty_session_id = ?1
                 ORDER BY rec_seq",
            )
            .map_err(|e| StoreError::sqlite("prepare recording trim", e))?;
        let mut rows = stmt
            .query(params![id.as_slice()])
            .map_err(|e| StoreError::sqlite("read recording for trim", e))?;
        while over > 0
            && let Some(r) = rows
                .next()
                .map_err(|e| StoreError::sqlite("read recording for trim", e))?
        {
            let seq: i64 = r
                .get(0)
                .map_err(|e| StoreError::sqlite("read recording for trim", e))?;
            let len: i64 = r
                .get(1)
                .map_err(|e| StoreError::sqlite("read recording for trim", e))?;
            let len = to_u64(len);
            over = over.saturating_sub(len);
            doomed.push((seq, len));
        }
    }
    let Some(&(last, _)) = doomed.last() else {
        return Ok(());
    };
    let freed: u64 = doomed.iter().map(|(_, l)| l).sum();
    tx.execute_cached(
        "DELETE FROM pty_records WHERE pty_session_id = ?1 AND rec_seq <= ?2",
        params![id.as_slice(), last],
    )
    .map_err(|e| StoreError::sqlite("trim recording", e))?;
    tx.execute_cached(
        "UPDATE pty_sessions SET recorded_bytes = max(recorded_bytes - ?2, 0)
         WHERE pty_session_id = ?1",
        params![id.as_slice(), to_i64(freed)],
    )
    .map_err(|e| StoreError::sqlite("trim recording", e))?;
    tracing::info!(bytes = freed, "terminal recording trimmed to its cap");
    Ok(())
}

fn decode_stored<T: prost::Message + Default>(stored: mutations::Stored) -> Result<T, OpError> {
    let bytes = stored.map_err(|d| OpError::Refused(crate::incidents::detail_to_error(&d)))?;
    T::decode(bytes.as_slice()).map_err(|_| {
        OpError::Store(StoreError::Integrity(
            "a stored terminal answer does not decode".into(),
        ))
    })
}

impl Store {
    /// An operator mutation of a terminal (`OpenPtySession`,
    /// `WritePtyInput`, `ResizePtySession`, `ClosePtySession`), idempotent
    /// by `request_id`; opens and closes are audited with `caller` (input
    /// is recorded, never audited: it may hold a password).
    ///
    /// # Errors
    /// A refusal naming the field or the state that forbids it, or a
    /// store failure.
    pub fn pty_mutation_as(
        &mut self,
        m: &PtyMutation,
        caller: &crate::operator::Caller,
        limits: PtyLimits,
        now_ms: i64,
    ) -> Result<PtyOutcome, OpError> {
        let method = m.method();
        let (rec, audited) = mutation_audit(m, caller, now_ms);
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = check_mutation(m)
            .map_err(OpError::Refused)
            .and_then(|c| self.pty_mutation_in(m, &c, limits, &mut intent, audited, now_ms));
        if audited {
            self.audit_unwritten(&mut intent, &result, now_ms);
        }
        if let Ok(o) = &result
            && !o.replayed
        {
            tracing::info!(
                method,
                terminal = %o.view.info.pty_session_id,
                client = %o.view.info.client_id,
                input_seq = o.input_seq,
                "terminal mutation recorded"
            );
        }
        result
    }

    fn pty_mutation_in(
        &mut self,
        m: &PtyMutation,
        c: &rvbox_store_port::pty::CheckedMutation,
        limits: PtyLimits,
        intent: &mut crate::audit::AuditIntent,
        audited: bool,
        now_ms: i64,
    ) -> Result<PtyOutcome, OpError> {
        let id = c.pty_session_id;
        // the client owns the idempotency row: an open names it, the other
        // mutations find it through their terminal
        let client = match &c.client_id {
            Some(client) => client.clone(),
            None => {
                load_view(&self.conn, &id)?
                    .ok_or_else(|| not_found(&id))?
                    .info
                    .client_id
            }
        };
        self.health
            .check_writable(&[(wire::ScopeKind::Client, client.as_str())])?;
        let request_id = Uuid7::from_bytes("request_id", c.request_id)
            .map_err(|e| OpError::Refused(DomainError::from(e)))?;
        let hash = mutation_hash(m);
        let method = m.method();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin terminal mutation", e))?;
        let owner = Owner::Client(&client);
        if let Some(stored) = mutations::lookup(&tx, &request_id, method, &hash, owner)? {
            let input_seq = replayed_input_seq(m, stored)?;
            let view = load_view(&tx, &id)?.ok_or_else(|| not_found(&id))?;
            return Ok(PtyOutcome {
                view,
                input_seq,
                replayed: true,
            });
        }
        let mut input_seq = None;
        let response: Vec<u8> = match m {
            PtyMutation::Open(r) => {
                let known: bool = tx
                    .query_row_cached(
                        "SELECT EXISTS (SELECT 1 FROM clients WHERE client_id = ?1)",
                        params![client],
                        |r| r.get(0),
                    )
                    .map_err(|e| StoreError::sqlite("look up the terminal's client", e))?;
                if !known {
                    return Err(unknown_client(&client));
                }
                let (mine, all): (i64, i64) = tx
                    .query_row_cached(
                        "SELECT COUNT(*) FILTER (WHERE client_id = ?1), COUNT(*)
                         FROM pty_sessions WHERE state <> 3",
                        params![client],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .map_err(|e| StoreError::sqlite("count open terminals", e))?;
                check_open_limits(&client, to_u64(mine), to_u64(all), limits)?;
                let open = open_frame(&id, r);
                tx.execute_cached(
                    "INSERT INTO pty_sessions (pty_session_id, client_id, state, open_frame,
                         shell_type, rows, cols, opened_ms, last_activity_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8)",
                    params![
                        id.as_slice(),
                        client,
                        OPENING,
                        open.encode_to_vec(),
                        i64::from(r.shell_type),
                        i64::from(r.rows),
                        i64::from(r.cols),
                        now_ms
                    ],
                )
                .map_err(|e| StoreError::sqlite("insert terminal", e))?;
                // the recording starts with the size at open (its
                // asciicast header)
                record_size(&tx, &id, now_ms, now_ms, r.rows, r.cols)?;
                fresh_response(m, &id, 0)
            }
            PtyMutation::Write(r) => {
                let view = load_view(&tx, &id)?.ok_or_else(|| not_found(&id))?;
                if view.closed() || view.close_requested {
                    return Err(closed_error(&view));
                }
                let (count, bytes): (i64, i64) = tx
                    .query_row_cached(
                        "SELECT COUNT(*), COALESCE(SUM(length(data)), 0) FROM pty_inputs
                         WHERE pty_session_id = ?1",
                        params![id.as_slice()],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .map_err(|e| StoreError::sqlite("count pending terminal input", e))?;
                check_pending_input(to_u64(count), to_u64(bytes), r.data.len())?;
                let seq = view.input_seq.saturating_add(1);
                tx.execute_cached(
                    "INSERT INTO pty_inputs (pty_session_id, input_seq, data) VALUES (?1, ?2, ?3)",
                    params![id.as_slice(), to_i64(seq), r.data],
                )
                .map_err(|e| StoreError::sqlite("insert terminal input", e))?;
                tx.execute_cached(
                    "UPDATE pty_sessions SET input_seq = ?2, last_activity_ms = ?3
                     WHERE pty_session_id = ?1",
                    params![id.as_slice(), to_i64(seq), now_ms],
                )
                .map_err(|e| StoreError::sqlite("number terminal input", e))?;
                let opened = opened_ms(&view);
                record(&tx, &id, opened, now_ms, REC_INPUT, seq, 0, &r.data)?;
                trim_recording(&tx, &id, limits.recording_bytes)?;
                input_seq = Some(seq);
                fresh_response(m, &id, seq)
            }
            PtyMutation::Resize(r) => {
                let view = load_view(&tx, &id)?.ok_or_else(|| not_found(&id))?;
                if view.closed() {
                    return Err(closed_error(&view));
                }
                tx.execute_cached(
                    "UPDATE pty_sessions SET rows = ?2, cols = ?3 WHERE pty_session_id = ?1",
                    params![id.as_slice(), i64::from(r.rows), i64::from(r.cols)],
                )
                .map_err(|e| StoreError::sqlite("resize terminal", e))?;
                let opened = opened_ms(&view);
                record_size(&tx, &id, opened, now_ms, r.rows, r.cols)?;
                fresh_response(m, &id, 0)
            }
            PtyMutation::Close(_) => {
                // closing a closed terminal is answered as done
                tx.execute_cached(
                    "UPDATE pty_sessions SET close_requested = 1,
                         close_reason = CASE WHEN close_reason = '' THEN ?2 ELSE close_reason END
                     WHERE pty_session_id = ?1 AND state <> 3",
                    params![id.as_slice(), CLOSED_BY_OPERATOR],
                )
                .map_err(|e| StoreError::sqlite("close terminal", e))?;
                fresh_response(m, &id, 0)
            }
        };
        if audited {
            intent.write_in(&tx, Ok(()))?;
        }
        mutations::record(
            &tx,
            &request_id,
            method,
            &hash,
            owner,
            &Ok(response),
            Assigned {
                write_seq: input_seq,
                revision: None,
            },
            now_ms,
        )?;
        let view = load_view(&tx, &id)?.ok_or_else(|| not_found(&id))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit terminal mutation", e))?;
        Ok(PtyOutcome {
            view,
            input_seq,
            replayed: false,
        })
    }

    /// What `client_id` reported of its terminals, applied in order in one
    /// transaction fenced by `session`: one outcome per report.
    ///
    /// # Errors
    /// `STALE_SESSION` when `session` is no longer the client's live one
    /// (nothing is applied), or a store failure.
    pub fn pty_apply(
        &mut self,
        client_id: &str,
        session: Option<&SessionFence>,
        reports: &[PtyReport],
        recording_bytes: u64,
        now_ms: i64,
    ) -> Result<Vec<PtyApplied>, OpError> {
        self.health
            .check_writable(&[(wire::ScopeKind::Client, client_id)])?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin terminal reports", e))?;
        crate::sessions::check_fence(&tx, &self.metrics.writes_fenced, session, client_id)?;
        let mut out = Vec::with_capacity(reports.len());
        let mut touched: Vec<[u8; 16]> = Vec::new();
        for report in reports {
            let applied = apply_one(&tx, client_id, report, now_ms)?;
            if let Ok(u) = Uuid7::parse("pty_session_id", report.id())
                && matches!(report, PtyReport::Output(_))
                && matches!(applied, PtyApplied::Recorded { .. })
                && !touched.contains(u.as_bytes())
            {
                touched.push(*u.as_bytes());
            }
            out.push(applied);
        }
        for id in &touched {
            // a recording shares the client's and the server's quotas with
            // command output, which goes first: it is trimmed (oldest
            // records first, the cut marked) to what they leave
            let room = recording_room(&tx, client_id, id, &self.opts.tiers)?;
            trim_recording(&tx, id, recording_bytes.min(room))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit terminal reports", e))?;
        Ok(out)
    }

    /// The terminals of `client_id` that are not closed, oldest first,
    /// each with its pending input.
    ///
    /// # Errors
    /// A store failure.
    pub fn pty_resume(&self, client_id: &str) -> Result<Vec<PtyResume>, StoreError> {
        let views = {
            let mut stmt = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {VIEW_COLUMNS} FROM pty_sessions WHERE client_id = ?1 AND state <> 3
                     ORDER BY opened_ms, pty_session_id"
                ))
                .map_err(|e| StoreError::sqlite("prepare terminal resume", e))?;
            let rows = stmt
                .query_map(params![client_id], view_of)
                .map_err(|e| StoreError::sqlite("read terminals to resume", e))?;
            let mut views = Vec::new();
            for r in rows {
                views.push(r.map_err(|e| StoreError::sqlite("read terminals to resume", e))??);
            }
            views
        };
        let mut out = Vec::with_capacity(views.len());
        for view in views {
            let id = Uuid7::parse("pty_session_id", &view.info.pty_session_id).map_err(|_| {
                StoreError::Integrity("a stored terminal id is not a UUIDv7".into())
            })?;
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT input_seq, data FROM pty_inputs WHERE pty_session_id = ?1
                     ORDER BY input_seq LIMIT ?2",
                )
                .map_err(|e| StoreError::sqlite("prepare pending terminal input", e))?;
            let rows = stmt
                .query_map(
                    params![id.as_bytes().as_slice(), to_i64(MAX_PENDING_PTY_INPUTS)],
                    |r| {
                        Ok(wire::PtyInput {
                            pty_session_id: view.info.pty_session_id.clone(),
                            input_seq: to_u64(r.get(0)?),
                            data: r.get(1)?,
                        })
                    },
                )
                .map_err(|e| StoreError::sqlite("read pending terminal input", e))?;
            let mut inputs = Vec::new();
            for r in rows {
                inputs.push(r.map_err(|e| StoreError::sqlite("read pending terminal input", e))?);
            }
            out.push(PtyResume { view, inputs });
        }
        Ok(out)
    }

    /// Terminals idle since before `idle_before_ms` and not yet asked to
    /// close: each is asked to close, with the reason [`IDLE_TIMEOUT`].
    ///
    /// # Errors
    /// A store failure.
    pub fn pty_idle(&mut self, idle_before_ms: i64, limit: usize) -> Result<Vec<PtyView>, OpError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin terminal idle pass", e))?;
        let ids: Vec<Vec<u8>> = {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT pty_session_id FROM pty_sessions
                     WHERE state <> 3 AND close_requested = 0 AND last_activity_ms < ?1
                     ORDER BY last_activity_ms LIMIT ?2",
                )
                .map_err(|e| StoreError::sqlite("prepare idle terminals", e))?;
            let rows = stmt
                .query_map(params![idle_before_ms, limit as i64], |r| r.get(0))
                .map_err(|e| StoreError::sqlite("read idle terminals", e))?;
            rows.collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("read idle terminals", e))?
        };
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let Ok(id) = <[u8; 16]>::try_from(id.as_slice()) else {
                continue;
            };
            tx.execute_cached(
                "UPDATE pty_sessions SET close_requested = 1, close_reason = ?2
                 WHERE pty_session_id = ?1",
                params![id.as_slice(), IDLE_TIMEOUT],
            )
            .map_err(|e| StoreError::sqlite("close idle terminal", e))?;
            if let Some(v) = load_view(&tx, &id)? {
                out.push(v);
            }
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit terminal idle pass", e))?;
        Ok(out)
    }
}

/// When a terminal opened (Unix ms).
#[must_use]
pub fn opened_ms(v: &PtyView) -> i64 {
    v.info.opened_time.as_ref().map_or(0, |t| {
        t.seconds.saturating_mul(1000) + i64::from(t.nanos / 1_000_000)
    })
}

fn protocol(why: String) -> PtyApplied {
    PtyApplied::Refused(DomainError::new(Code::ProtocolError, why))
}

fn apply_one(
    tx: &Transaction<'_>,
    client_id: &str,
    report: &PtyReport,
    now_ms: i64,
) -> Result<PtyApplied, StoreError> {
    let Ok(uuid) = Uuid7::parse("pty_session_id", report.id()) else {
        return Ok(protocol(format!(
            "pty_session_id {:?} is not a canonical UUIDv7",
            report.id()
        )));
    };
    let id = *uuid.as_bytes();
    let Some(view) = load_view(tx, &id)? else {
        return Ok(PtyApplied::Unknown);
    };
    if view.info.client_id != client_id {
        return Ok(PtyApplied::Unknown);
    }
    let end = view.info.output_offset;
    let done = |offset: u64, closed: bool| PtyApplied::Recorded {
        output_offset: offset,
        closed,
    };
    if view.closed() {
        // a closed terminal takes nothing more: repeats are harmless
        return Ok(done(end, true));
    }
    let opened = opened_ms(&view);
    match report {
        PtyReport::Opened(m) => {
            if view.info.state == OPENING as i32 {
                if m.outcome == wire::AcceptOutcome::Positive as i32 {
                    tx.execute_cached(
                        "UPDATE pty_sessions SET state = ?2, last_activity_ms = ?3
                         WHERE pty_session_id = ?1",
                        params![id.as_slice(), OPEN, now_ms],
                    )
                    .map_err(|e| StoreError::sqlite("mark terminal open", e))?;
                    tracing::info!(terminal = %view.info.pty_session_id, "terminal opened on its client");
                } else {
                    let reason = m.error.as_ref().map_or_else(
                        || "the client refused to open the terminal".to_owned(),
                        |e| {
                            // the client's words are bounded like every
                            // stored reason
                            bounded_reason(&format!(
                                "the client refused to open the terminal: {}",
                                e.reason
                            ))
                        },
                    );
                    close_row(tx, &id, None, &reason, now_ms)?;
                    tracing::warn!(terminal = %view.info.pty_session_id, reason = %reason, "terminal refused by its client");
                    return Ok(done(end, true));
                }
            }
            Ok(done(end, false))
        }
        PtyReport::InputAck(m) => {
            if m.input_seq > view.input_seq {
                return Ok(protocol(format!(
                    "pty_input_ack acknowledges input_seq {} of a terminal given only {}",
                    m.input_seq, view.input_seq
                )));
            }
            if m.input_seq > view.input_acked {
                tx.execute_cached(
                    "DELETE FROM pty_inputs WHERE pty_session_id = ?1 AND input_seq <= ?2",
                    params![id.as_slice(), to_i64(m.input_seq)],
                )
                .map_err(|e| StoreError::sqlite("settle terminal input", e))?;
                tx.execute_cached(
                    "UPDATE pty_sessions SET input_acked = ?2 WHERE pty_session_id = ?1",
                    params![id.as_slice(), to_i64(m.input_seq)],
                )
                .map_err(|e| StoreError::sqlite("settle terminal input", e))?;
            }
            Ok(done(end, false))
        }
        PtyReport::Output(m) => {
            let (cut, at, fresh, end) = match plan_output(end, m) {
                OutputPlan::Protocol(why) => return Ok(protocol(why)),
                OutputPlan::Gap { output_offset } => {
                    return Ok(PtyApplied::Gap { output_offset });
                }
                OutputPlan::Record {
                    cut,
                    at,
                    fresh,
                    end,
                } => (cut, at, fresh, end),
            };
            if let Some((resume, from)) = cut {
                record(tx, &id, opened, now_ms, REC_CUT, resume, from, &[])?;
                tracing::warn!(
                    terminal = %view.info.pty_session_id,
                    lost = resume - from,
                    "terminal output lost on the client; recorded as a cut"
                );
            }
            if !fresh.is_empty() {
                record(tx, &id, opened, now_ms, REC_OUTPUT, at, 0, fresh)?;
            }
            if end != view.info.output_offset {
                tx.execute_cached(
                    "UPDATE pty_sessions SET output_offset = ?2, last_activity_ms = ?3
                     WHERE pty_session_id = ?1",
                    params![id.as_slice(), to_i64(end), now_ms],
                )
                .map_err(|e| StoreError::sqlite("advance terminal output", e))?;
            }
            Ok(done(end, false))
        }
        PtyReport::Closed(m) => {
            if m.final_offset > end {
                // output the client could not send before the end: the
                // recording says so
                record(tx, &id, opened, now_ms, REC_CUT, m.final_offset, end, &[])?;
                tx.execute_cached(
                    "UPDATE pty_sessions SET output_offset = ?2 WHERE pty_session_id = ?1",
                    params![id.as_slice(), to_i64(m.final_offset)],
                )
                .map_err(|e| StoreError::sqlite("advance terminal output", e))?;
            }
            let reason = closed_reason(&m.reason, &view);
            close_row(tx, &id, m.exit_result.as_ref(), &reason, now_ms)?;
            tracing::info!(terminal = %view.info.pty_session_id, reason = %reason, "terminal closed");
            Ok(done(m.final_offset.max(end), true))
        }
    }
}

fn close_row(
    tx: &Transaction<'_>,
    id: &[u8; 16],
    exit: Option<&wire::ExitResult>,
    reason: &str,
    now_ms: i64,
) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE pty_sessions SET state = ?2, closed_ms = ?3, exit_result = ?4, close_reason = ?5,
             last_activity_ms = ?3
         WHERE pty_session_id = ?1",
        params![
            id.as_slice(),
            CLOSED,
            now_ms,
            exit.map(prost::Message::encode_to_vec),
            reason
        ],
    )
    .map_err(|e| StoreError::sqlite("close terminal", e))?;
    // input never written now never will be
    tx.execute_cached(
        "DELETE FROM pty_inputs WHERE pty_session_id = ?1",
        params![id.as_slice()],
    )
    .map_err(|e| StoreError::sqlite("drop terminal input", e))?;
    Ok(())
}

/// One stored record of a terminal's recording (the columns of
/// `pty_records`), as every store backend keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordRow {
    /// `rec_seq`.
    pub rec_seq: i64,
    /// `at_ms`.
    pub at_ms: i64,
    /// `kind` ([`REC_OUTPUT`], [`REC_INPUT`], [`REC_RESIZE`], [`REC_CUT`]).
    pub kind: i64,
    /// `pos`.
    pub pos: i64,
    /// `aux`.
    pub aux: i64,
    /// `data`.
    pub data: Vec<u8>,
}

/// Records one read of a recording takes at most (before its byte
/// bound).
pub const MAX_RECORDS_PER_READ: usize = 1024;

/// What the terminal reads need of a store backend, in one snapshot.
pub trait PtySource {
    /// One terminal's row, if the server has it.
    ///
    /// # Errors
    /// A store failure.
    fn pty_row(&mut self, id: &[u8; 16]) -> Result<Option<PtyRow>, StoreError>;
    /// At most `limit` terminals (of `client`, or of every client when it
    /// is empty) whose `(opened_ms, pty_session_id)` sorts before
    /// `(before_ms, before_id)`, newest first.
    ///
    /// # Errors
    /// A store failure.
    fn pty_rows_before(
        &mut self,
        client: &str,
        before_ms: i64,
        before_id: &[u8],
        limit: usize,
    ) -> Result<Vec<PtyRow>, StoreError>;
    /// At most `limit` records of `id` after `after_rec_seq`, in order.
    ///
    /// # Errors
    /// A store failure.
    fn pty_records(
        &mut self,
        id: &[u8; 16],
        after_rec_seq: u64,
        limit: usize,
    ) -> Result<Vec<RecordRow>, StoreError>;
}

/// `ListPtySessions` over any backend: one page, newest first (`viewers`
/// is the serving server's to fill).
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size, client id or token, or a store
/// failure.
pub fn list_page(
    src: &mut dyn PtySource,
    key: [u8; 32],
    req: &wire::ListPtySessionsRequest,
) -> Result<wire::ListPtySessionsResponse, OpError> {
    use rvbox_domain::token::{TokenCodec, TokenKey, TokenKind, encode_filters};
    let limit = crate::records::page_size(req.page_size).map_err(OpError::Refused)?;
    if let Some(c) = &req.client_id {
        rvbox_domain::ids::ClientId::parse("client_id", c)
            .map_err(|e| OpError::Refused(DomainError::from(e)))?;
    }
    let client = req.client_id.clone().unwrap_or_default();
    let filters = encode_filters(&[("client_id", client.as_bytes())]);
    let codec = TokenCodec::new(TokenKey::new(key));
    let malformed = || {
        OpError::Refused(
            DomainError::new(Code::InvalidArgument, "page_token is malformed")
                .with_field("page_token"),
        )
    };
    let after = if req.page_token.is_empty() {
        None
    } else {
        let pos = codec
            .open(TokenKind::PtyPage, &filters, &req.page_token)
            .map_err(|e| crate::records::token_error(&e))?;
        Some(crate::records::time_and_id(&pos).ok_or_else(malformed)?)
    };
    // no token: before every terminal (17 bytes of 0xff sort after any id)
    let (after_ms, after_id) =
        after.map_or((i64::MAX, vec![0xff_u8; 17]), |(ms, id)| (ms, id.to_vec()));
    let rows = src.pty_rows_before(&client, after_ms, &after_id, limit as usize + 1)?;
    let mut sessions = Vec::with_capacity(rows.len());
    for row in rows {
        sessions.push(view_from_row(row)?.info);
    }
    let more = sessions.len() > limit as usize;
    sessions.truncate(limit as usize);
    let next_page_token = match (more, sessions.last()) {
        (true, Some(last)) => {
            let ms = last
                .opened_time
                .as_ref()
                .map_or(0, |t| t.seconds * 1000 + i64::from(t.nanos / 1_000_000));
            let id = Uuid7::parse("pty_session_id", &last.pty_session_id).map_err(|_| {
                StoreError::Integrity("a stored terminal id is not a UUIDv7".into())
            })?;
            let mut pos = ms.to_be_bytes().to_vec();
            pos.extend_from_slice(id.as_bytes());
            codec
                .seal(TokenKind::PtyPage, &filters, &pos)
                .map_err(|e| crate::records::token_error(&e))?
        }
        _ => String::new(),
    };
    Ok(wire::ListPtySessionsResponse {
        sessions,
        next_page_token,
    })
}

/// One terminal's record for operators, over any backend.
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn info_of(src: &mut dyn PtySource, id: &[u8; 16]) -> Result<wire::PtySessionInfo, OpError> {
    let row = src.pty_row(id)?.ok_or_else(|| not_found(id))?;
    Ok(view_from_row(row)?.info)
}

/// The records of `id` after `after_rec_seq`, in order, while they fit in
/// `max_bytes` of data (at least one), over any backend.
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn records_of(
    src: &mut dyn PtySource,
    id: &[u8; 16],
    after_rec_seq: u64,
    max_bytes: usize,
) -> Result<Vec<rvbox_store_port::pty::PtyRecord>, OpError> {
    use rvbox_store_port::pty::{PtyRecord, PtyRecordKind};
    if src.pty_row(id)?.is_none() {
        return Err(not_found(id));
    }
    let rows = src.pty_records(id, after_rec_seq, MAX_RECORDS_PER_READ)?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for r in rows {
        if !out.is_empty() && bytes.saturating_add(r.data.len()) > max_bytes {
            break;
        }
        bytes = bytes.saturating_add(r.data.len());
        let kind = match r.kind {
            REC_OUTPUT => PtyRecordKind::Output {
                offset: to_u64(r.pos),
            },
            REC_INPUT => PtyRecordKind::Input {
                input_seq: to_u64(r.pos),
            },
            REC_RESIZE => PtyRecordKind::Resize {
                cols: u32::try_from(r.pos).unwrap_or(0),
                rows: u32::try_from(r.aux).unwrap_or(0),
            },
            REC_CUT => PtyRecordKind::Cut {
                from: to_u64(r.aux),
                to: to_u64(r.pos),
            },
            other => {
                return Err(OpError::Store(StoreError::Integrity(format!(
                    "terminal record kind {other} is unknown"
                ))));
            }
        };
        out.push(PtyRecord {
            rec_seq: to_u64(r.rec_seq),
            at_ms: to_u64(r.at_ms),
            kind,
            data: r.data,
        });
    }
    Ok(out)
}

/// The terminal reads over one SQLite connection.
struct SqliteSource<'a>(&'a Connection);

impl PtySource for SqliteSource<'_> {
    fn pty_row(&mut self, id: &[u8; 16]) -> Result<Option<PtyRow>, StoreError> {
        self.0
            .query_row_cached(
                &format!("SELECT {VIEW_COLUMNS} FROM pty_sessions WHERE pty_session_id = ?1"),
                params![id.as_slice()],
                row_of,
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read terminal", e))
    }

    fn pty_rows_before(
        &mut self,
        client: &str,
        before_ms: i64,
        before_id: &[u8],
        limit: usize,
    ) -> Result<Vec<PtyRow>, StoreError> {
        let mut stmt = self
            .0
            .prepare_cached(&format!(
                "SELECT {VIEW_COLUMNS} FROM pty_sessions
                 WHERE (?1 = '' OR client_id = ?1) AND (opened_ms, pty_session_id) < (?2, ?3)
                 ORDER BY opened_ms DESC, pty_session_id DESC LIMIT ?4"
            ))
            .map_err(|e| StoreError::sqlite("prepare terminal list", e))?;
        let rows = stmt
            .query_map(
                params![client, before_ms, before_id, to_i64(limit as u64)],
                row_of,
            )
            .map_err(|e| StoreError::sqlite("list terminals", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("list terminals", e))
    }

    fn pty_records(
        &mut self,
        id: &[u8; 16],
        after_rec_seq: u64,
        limit: usize,
    ) -> Result<Vec<RecordRow>, StoreError> {
        let mut stmt = self
            .0
            .prepare_cached(
                "SELECT rec_seq, at_ms, kind, pos, aux, data FROM pty_records
                 WHERE pty_session_id = ?1 AND rec_seq > ?2 ORDER BY rec_seq LIMIT ?3",
            )
            .map_err(|e| StoreError::sqlite("prepare terminal records", e))?;
        let rows = stmt
            .query_map(
                params![id.as_slice(), to_i64(after_rec_seq), to_i64(limit as u64)],
                |r| {
                    Ok(RecordRow {
                        rec_seq: r.get(0)?,
                        at_ms: r.get(1)?,
                        kind: r.get(2)?,
                        pos: r.get(3)?,
                        aux: r.get(4)?,
                        data: r.get(5)?,
                    })
                },
            )
            .map_err(|e| StoreError::sqlite("read terminal records", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("read terminal records", e))
    }
}

/// `ListPtySessions`: one page, newest first (`viewers` is the serving
/// server's to fill).
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size, client id or token, or a store
/// failure.
pub fn list(
    conn: &Connection,
    key: [u8; 32],
    req: &wire::ListPtySessionsRequest,
) -> Result<wire::ListPtySessionsResponse, OpError> {
    list_page(&mut SqliteSource(conn), key, req)
}

/// One terminal's record for operators.
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn info(conn: &Connection, id: &[u8; 16]) -> Result<wire::PtySessionInfo, OpError> {
    info_of(&mut SqliteSource(conn), id)
}

/// The records of `id` after `after_rec_seq`, in order, while they fit in
/// `max_bytes` of data (at least one).
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn records_after(
    conn: &Connection,
    id: &[u8; 16],
    after_rec_seq: u64,
    max_bytes: usize,
) -> Result<Vec<rvbox_store_port::pty::PtyRecord>, OpError> {
    records_of(&mut SqliteSource(conn), id, after_rec_seq, max_bytes)
}
