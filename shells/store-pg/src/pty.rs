//! Interactive terminals on PostgreSQL (docs/terminals.md), as
//! `rvbox_store::pty` keeps them on SQLite, whose pure checks, refusals,
//! audit records and stored answers this module shares.
//!
//! Each operator mutation (open, input, resize, close) commits with its
//! idempotency row (owner: the terminal's client), so a retry with the
//! same `request_id` gets the same answer and changes nothing, on any
//! replica. The terminal's row is locked `FOR UPDATE` before a decision
//! reads it (input is numbered there), and opens are serialised by an
//! advisory lock so the bounds per client and per server hold across
//! replicas. Every fresh mutation wakes the replica holding the client's
//! connection (`NOTIFY rvbox_client`), and so does the idle pass for the
//! terminals it asks to close.
//!
//! What a client reports is applied in one transaction per batch, fenced
//! by the session it arrived on (the session's row locked `FOR SHARE`):
//! output is recorded by byte offset (an exact repeat is recognised by
//! its offset, an overlap stored once), and bytes the client's ring had
//! lost are a cut record, never a silent gap. The recording of each
//! terminal is bounded by the configured cap and by what the client's and
//! the server's quotas leave after command output; past it the oldest
//! records go. Terminals whose recording grew or that closed wake their
//! viewers on every replica (`NOTIFY rvbox_command`).

use std::collections::BTreeSet;

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_store::mutations::{Assigned, Owner};
use rvbox_store::pty::{
    CLOSED_BY_OPERATOR, IDLE_TIMEOUT, PRUNE_BATCH, PtyRow, REC_CUT, REC_INPUT, REC_OUTPUT,
    REC_RESIZE, RecordRow, check_open_limits, check_pending_input, closed_error, closed_reason,
    fresh_response, mutation_audit, mutation_hash, not_found, open_frame, opened_ms,
    replayed_input_seq, unknown_client, view_from_row,
};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::pty::{
    CheckedMutation, MAX_PENDING_PTY_INPUTS, OutputPlan, PtyApplied, PtyLimits, PtyMutation,
    PtyOutcome, PtyReport, PtyResume, PtyView, check_mutation, plan_output,
};
use rvbox_store_port::sessions::SessionFence;

use crate::audit::write_in;
use crate::sessions::{check_fence, global_charged, to_i64, to_u64};
use crate::{Fail, PgStore, mutations};

const OPENING: i64 = wire::PtyState::Opening as i64;
const OPEN: i64 = wire::PtyState::Open as i64;
const CLOSED: i64 = wire::PtyState::Closed as i64;

/// The advisory lock that serialises terminal opens across replicas (the
/// bounds count the terminals not closed).
const OPEN_LOCK: i64 = 0x5256_424f_5800_0002;

/// The columns [`row_of`] reads, in its order.
macro_rules! view_columns {
    () => {
        "pty_session_id, client_id, state, open_frame, shell_type, rows, cols, opened_ms,
         closed_ms, last_activity_ms, output_offset, recorded_bytes, input_seq, input_acked,
         close_requested, close_reason, exit_result"
    };
}
pub(crate) use view_columns;

/// A terminal's row from a row of [`view_columns`].
///
/// # Errors
/// A column of an unexpected type.
pub(crate) fn row_of(r: &postgres::Row) -> Result<PtyRow, postgres::Error> {
    Ok(PtyRow {
        pty_session_id: r.try_get(0)?,
        client_id: r.try_get(1)?,
        state: r.try_get(2)?,
        open_frame: r.try_get(3)?,
        shell_type: r.try_get(4)?,
        rows: r.try_get(5)?,
        cols: r.try_get(6)?,
        opened_ms: r.try_get(7)?,
        closed_ms: r.try_get(8)?,
        last_activity_ms: r.try_get(9)?,
        output_offset: r.try_get(10)?,
        recorded_bytes: r.try_get(11)?,
        input_seq: r.try_get(12)?,
        input_acked: r.try_get(13)?,
        close_requested: r.try_get(14)?,
        close_reason: r.try_get(15)?,
        exit_result: r.try_get(16)?,
    })
}

/// A record of the recording from `rec_seq, at_ms, kind, pos, aux, data`.
///
/// # Errors
/// A column of an unexpected type.
pub(crate) fn record_row_of(r: &postgres::Row) -> Result<RecordRow, postgres::Error> {
    Ok(RecordRow {
        rec_seq: r.try_get(0)?,
        at_ms: r.try_get(1)?,
        kind: r.try_get(2)?,
        pos: r.try_get(3)?,
        aux: r.try_get(4)?,
        data: r.try_get(5)?,
    })
}

fn view(r: &postgres::Row) -> Result<PtyView, Fail> {
    let row = row_of(r).map_err(Fail::db("decode a terminal"))?;
    Ok(view_from_row(row)?)
}

/// One terminal, if the server has it; `lock` takes its row `FOR UPDATE`.
fn load_view(tx: &mut Transaction<'_>, id: &[u8; 16], lock: bool) -> Result<Option<PtyView>, Fail> {
    let sql = if lock {
        concat!(
            "SELECT ",
            view_columns!(),
            " FROM pty_sessions WHERE pty_session_id = $1 FOR UPDATE"
        )
    } else {
        concat!(
            "SELECT ",
            view_columns!(),
            " FROM pty_sessions WHERE pty_session_id = $1"
        )
    };
    crate::prep::query_opt(tx, sql, &[&id.as_slice()])
        .map_err(Fail::db("read terminal"))?
        .map(|r| view(&r))
        .transpose()
}

/// Records a window size (`rows` x `cols`).
fn record_size(
    tx: &mut Transaction<'_>,
    id: &[u8; 16],
    opened_ms: i64,
    now_ms: i64,
    rows: u32,
    cols: u32,
) -> Result<(), Fail> {
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

/// Appends one record and charges it to the recording.
#[allow(clippy::too_many_arguments)]
fn record(
    tx: &mut Transaction<'_>,
    id: &[u8; 16],
    opened_ms: i64,
    now_ms: i64,
    kind: i64,
    pos: u64,
    aux: u64,
    data: &[u8],
) -> Result<(), Fail> {
    let seq: i64 = crate::prep::query_one(
        tx,
        "UPDATE pty_sessions SET next_rec_seq = next_rec_seq + 1,
             recorded_bytes = recorded_bytes + $2
         WHERE pty_session_id = $1 RETURNING next_rec_seq - 1",
        &[&id.as_slice(), &to_i64(data.len() as u64)],
    )
    .map_err(Fail::db("number a terminal record"))?
    .try_get(0)
    .map_err(Fail::db("number a terminal record"))?;
    crate::prep::execute(
        tx,
        "INSERT INTO pty_records (pty_session_id, rec_seq, at_ms, kind, pos, aux, data)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &id.as_slice(),
            &seq,
            &now_ms.saturating_sub(opened_ms).max(0),
            &kind,
            &to_i64(pos),
            &to_i64(aux),
            &data,
        ],
    )
    .map_err(Fail::db("insert a terminal record"))?;
    Ok(())
}

/// What the quotas leave for the recording of `id` (a terminal of
/// `client_id`): the client's quota less its charged command bytes and
/// its other recordings, within the server's quota less every charged
/// byte and every other recording.
fn recording_room(
    tx: &mut Transaction<'_>,
    client_id: &str,
    id: &[u8; 16],
    tiers: &rvbox_retention::Tiers,
) -> Result<u64, Fail> {
    let read = Fail::db("read the quota left for a recording");
    let client_charged: i64 = crate::prep::query_one(
        tx,
        "SELECT COALESCE((SELECT charged_bytes FROM clients WHERE client_id = $1), 0)",
        &[&client_id],
    )
    .map_err(&read)?
    .try_get(0)
    .map_err(&read)?;
    let others = crate::prep::query_one(
        tx,
        "SELECT COALESCE(SUM(CASE WHEN client_id = $1 THEN recorded_bytes ELSE 0 END), 0)::bigint,
                COALESCE(SUM(recorded_bytes), 0)::bigint
         FROM pty_sessions WHERE pty_session_id <> $2",
        &[&client_id, &id.as_slice()],
    )
    .map_err(&read)?;
    let client_others: i64 = others.try_get(0).map_err(&read)?;
    let all_others: i64 = others.try_get(1).map_err(&read)?;
    let global = global_charged(tx)?;
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

/// Drops the oldest records of `id` while its recording is over `cap`.
fn trim_recording(tx: &mut Transaction<'_>, id: &[u8; 16], cap: u64) -> Result<(), Fail> {
    let read = Fail::db("read recording for trim");
    let recorded: i64 = crate::prep::query_one(
        tx,
        "SELECT recorded_bytes FROM pty_sessions WHERE pty_session_id = $1",
        &[&id.as_slice()],
    )
    .map_err(Fail::db("read recording size"))?
    .try_get(0)
    .map_err(Fail::db("read recording size"))?;
    let over = to_u64(recorded).saturating_sub(cap);
    if over == 0 {
        return Ok(());
    }
    // the oldest records whose bytes cover what is over: up to the first
    // one where the running total reaches it (every record when none does)
    let upto = crate::prep::query_opt(
        tx,
        "SELECT rec_seq, run FROM (
             SELECT rec_seq, SUM(octet_length(data)) OVER (ORDER BY rec_seq)::bigint AS run
             FROM pty_records WHERE pty_session_id = $1) w
         WHERE run >= $2 ORDER BY rec_seq LIMIT 1",
        &[&id.as_slice(), &to_i64(over)],
    )
    .map_err(&read)?;
    let (last, freed): (Option<i64>, i64) = match upto {
        Some(r) => (
            Some(r.try_get(0).map_err(&read)?),
            r.try_get(1).map_err(&read)?,
        ),
        None => {
            let r = crate::prep::query_one(
                tx,
                "SELECT MAX(rec_seq), COALESCE(SUM(octet_length(data)), 0)::bigint
                 FROM pty_records WHERE pty_session_id = $1",
                &[&id.as_slice()],
            )
            .map_err(&read)?;
            (r.try_get(0).map_err(&read)?, r.try_get(1).map_err(&read)?)
        }
    };
    let Some(last) = last else {
        return Ok(());
    };
    crate::prep::execute(
        tx,
        "DELETE FROM pty_records WHERE pty_session_id = $1 AND rec_seq <= $2",
        &[&id.as_slice(), &last],
    )
    .map_err(Fail::db("trim recording"))?;
    crate::prep::execute(
        tx,
        "UPDATE pty_sessions SET recorded_bytes = GREATEST(recorded_bytes - $2, 0)
         WHERE pty_session_id = $1",
        &[&id.as_slice(), &freed],
    )
    .map_err(Fail::db("trim recording"))?;
    tracing::info!(bytes = freed, "terminal recording trimmed to its cap");
    Ok(())
}

/// Ends a terminal: closed with its exit and reason; its pending input
/// goes (input never written now never will be).
fn close_row(
    tx: &mut Transaction<'_>,
    id: &[u8; 16],
    exit: Option<&wire::ExitResult>,
    reason: &str,
    now_ms: i64,
) -> Result<(), Fail> {
    let exit = exit.map(prost::Message::encode_to_vec);
    crate::prep::execute(
        tx,
        "UPDATE pty_sessions SET state = $2, closed_ms = $3, exit_result = $4, close_reason = $5,
             last_activity_ms = $3
         WHERE pty_session_id = $1",
        &[&id.as_slice(), &CLOSED, &now_ms, &exit, &reason],
    )
    .map_err(Fail::db("close terminal"))?;
    crate::prep::execute(
        tx,
        "DELETE FROM pty_inputs WHERE pty_session_id = $1",
        &[&id.as_slice()],
    )
    .map_err(Fail::db("drop terminal input"))?;
    Ok(())
}

fn protocol(why: String) -> PtyApplied {
    PtyApplied::Refused(DomainError::new(Code::ProtocolError, why))
}

/// Applies one report of `client_id` (see the module docs).
#[allow(clippy::too_many_lines)]
fn apply_one(
    tx: &mut Transaction<'_>,
    client_id: &str,
    report: &PtyReport,
    now_ms: i64,
) -> Result<PtyApplied, Fail> {
    let Ok(uuid) = Uuid7::parse("pty_session_id", report.id()) else {
        return Ok(protocol(format!(
            "pty_session_id {:?} is not a canonical UUIDv7",
            report.id()
        )));
    };
    let id = *uuid.as_bytes();
    let Some(view) = load_view(tx, &id, true)? else {
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
                    crate::prep::execute(
                        tx,
                        "UPDATE pty_sessions SET state = $2, last_activity_ms = $3
                         WHERE pty_session_id = $1",
                        &[&id.as_slice(), &OPEN, &now_ms],
                    )
                    .map_err(Fail::db("mark terminal open"))?;
                    tracing::info!(terminal = %view.info.pty_session_id, "terminal opened on its client");
                } else {
                    let reason = m.error.as_ref().map_or_else(
                        || "the client refused to open the terminal".to_owned(),
                        |e| {
                            // the client's words are bounded like every
                            // stored reason
                            rvbox_store::pty::bounded_reason(&format!(
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
                crate::prep::execute(
                    tx,
                    "DELETE FROM pty_inputs WHERE pty_session_id = $1 AND input_seq <= $2",
                    &[&id.as_slice(), &to_i64(m.input_seq)],
                )
                .map_err(Fail::db("settle terminal input"))?;
                crate::prep::execute(
                    tx,
                    "UPDATE pty_sessions SET input_acked = $2 WHERE pty_session_id = $1",
                    &[&id.as_slice(), &to_i64(m.input_seq)],
                )
                .map_err(Fail::db("settle terminal input"))?;
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
                crate::prep::execute(
                    tx,
                    "UPDATE pty_sessions SET output_offset = $2, last_activity_ms = $3
                     WHERE pty_session_id = $1",
                    &[&id.as_slice(), &to_i64(end), &now_ms],
                )
                .map_err(Fail::db("advance terminal output"))?;
            }
            Ok(done(end, false))
        }
        PtyReport::Closed(m) => {
            if m.final_offset > end {
                // output the client could not send before the end: the
                // recording says so
                record(tx, &id, opened, now_ms, REC_CUT, m.final_offset, end, &[])?;
                crate::prep::execute(
                    tx,
                    "UPDATE pty_sessions SET output_offset = $2 WHERE pty_session_id = $1",
                    &[&id.as_slice(), &to_i64(m.final_offset)],
                )
                .map_err(Fail::db("advance terminal output"))?;
            }
            let reason = closed_reason(&m.reason, &view);
            close_row(tx, &id, m.exit_result.as_ref(), &reason, now_ms)?;
            tracing::info!(terminal = %view.info.pty_session_id, reason = %reason, "terminal closed");
            Ok(done(m.final_offset.max(end), true))
        }
    }
}

/// Closed terminals older than `retention_ms` (0 keeps them) go with
/// their recordings and pending input (by cascade), at most
/// [`PRUNE_BATCH`] a pass; returns how many went.
pub(crate) fn prune_closed(
    tx: &mut Transaction<'_>,
    now_ms: i64,
    retention_ms: u64,
) -> Result<u64, Fail> {
    if retention_ms == 0 {
        return Ok(0);
    }
    let before = now_ms.saturating_sub(to_i64(retention_ms));
    crate::prep::execute(
        tx,
        "DELETE FROM pty_sessions WHERE pty_session_id IN (
             SELECT pty_session_id FROM pty_sessions
             WHERE state = 3 AND closed_ms < $1 ORDER BY closed_ms LIMIT $2
             FOR UPDATE SKIP LOCKED)",
        &[&before, &to_i64(PRUNE_BATCH as u64)],
    )
    .map_err(Fail::db("prune closed terminals"))
}

impl PgStore {
    /// An operator mutation of a terminal (`OpenPtySession`,
    /// `WritePtyInput`, `ResizePtySession`, `ClosePtySession`), idempotent
    /// by `request_id`; opens and closes are audited with `caller` (in the
    /// mutation's transaction, or on their own after a refusal or a
    /// replay), input never is.
    pub(crate) fn pty_mutation(
        &mut self,
        m: &PtyMutation,
        caller: &Caller,
        limits: PtyLimits,
        now_ms: i64,
    ) -> Result<PtyOutcome, Fail> {
        let method = m.method();
        let (rec, audited) = mutation_audit(m, caller, now_ms);
        let result = check_mutation(m)
            .map_err(Fail::Refused)
            .and_then(|c| self.pty_mutation_in(m, &c, limits, audited.then_some(&rec), now_ms));
        if audited && !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        match &result {
            Ok(o) if !o.replayed => tracing::info!(
                method,
                terminal = %o.view.info.pty_session_id,
                client = %o.view.info.client_id,
                input_seq = o.input_seq,
                "terminal mutation recorded"
            ),
            Err(Fail::Refused(e)) => tracing::info!(
                method,
                code = e.code().as_str(),
                field = e.field(),
                "terminal mutation refused"
            ),
            _ => {}
        }
        result
    }

    #[allow(clippy::too_many_lines)]
    fn pty_mutation_in(
        &mut self,
        m: &PtyMutation,
        c: &CheckedMutation,
        limits: PtyLimits,
        audit: Option<&rvbox_store::audit::AuditRecord>,
        now_ms: i64,
    ) -> Result<PtyOutcome, Fail> {
        let id = c.pty_session_id;
        let request_id =
            Uuid7::from_bytes("request_id", c.request_id).map_err(DomainError::from)?;
        let hash = mutation_hash(m);
        let method = m.method();
        self.in_tx(method, |tx, _| {
            // the client owns the idempotency row: an open names it, the
            // other mutations find it through their terminal
            let client = match &c.client_id {
                Some(client) => client.clone(),
                None => {
                    load_view(tx, &id, false)?
                        .ok_or_else(|| not_found(&id))?
                        .info
                        .client_id
                }
            };
            crate::incidents::check_writable(tx, &[(wire::ScopeKind::Client, client.as_str())])?;
            let owner = Owner::Client(&client);
            if let Some(stored) = mutations::lookup(tx, &request_id, method, &hash, owner)? {
                let input_seq = replayed_input_seq(m, stored)?;
                let view = load_view(tx, &id, false)?.ok_or_else(|| not_found(&id))?;
                return Ok(PtyOutcome {
                    view,
                    input_seq,
                    replayed: true,
                });
            }
            let mut input_seq = None;
            match m {
                PtyMutation::Open(r) => {
                    // the bounds count every terminal not closed: opens on
                    // every replica take their turn
                    crate::prep::execute(tx, "SELECT pg_advisory_xact_lock($1)", &[&OPEN_LOCK])
                        .map_err(Fail::db("lock terminal opens"))?;
                    let known = crate::prep::query_opt(
                        tx,
                        "SELECT 1 FROM clients WHERE client_id = $1",
                        &[&client],
                    )
                    .map_err(Fail::db("look up the terminal's client"))?
                    .is_some();
                    if !known {
                        return Err(unknown_client(&client).into());
                    }
                    let count = Fail::db("count open terminals");
                    let row = crate::prep::query_one(
                        tx,
                        "SELECT COUNT(*) FILTER (WHERE client_id = $1), COUNT(*)
                         FROM pty_sessions WHERE state <> 3",
                        &[&client],
                    )
                    .map_err(&count)?;
                    let mine: i64 = row.try_get(0).map_err(&count)?;
                    let all: i64 = row.try_get(1).map_err(&count)?;
                    check_open_limits(&client, to_u64(mine), to_u64(all), limits)?;
                    let open = open_frame(&id, r);
                    crate::prep::execute(
                        tx,
                        "INSERT INTO pty_sessions (pty_session_id, client_id, state, open_frame,
                             shell_type, rows, cols, opened_ms, last_activity_ms)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)",
                        &[
                            &id.as_slice(),
                            &client,
                            &OPENING,
                            &open.encode_to_vec(),
                            &i64::from(r.shell_type),
                            &i64::from(r.rows),
                            &i64::from(r.cols),
                            &now_ms,
                        ],
                    )
                    .map_err(Fail::db("insert terminal"))?;
                    // the recording starts with the size at open (its
                    // asciicast header)
                    record_size(tx, &id, now_ms, now_ms, r.rows, r.cols)?;
                }
                PtyMutation::Write(r) => {
                    let view = load_view(tx, &id, true)?.ok_or_else(|| not_found(&id))?;
                    if view.closed() || view.close_requested {
                        return Err(closed_error(&view).into());
                    }
                    let pending = Fail::db("count pending terminal input");
                    let row = crate::prep::query_one(
                        tx,
                        "SELECT COUNT(*), COALESCE(SUM(octet_length(data)), 0)::bigint
                         FROM pty_inputs WHERE pty_session_id = $1",
                        &[&id.as_slice()],
                    )
                    .map_err(&pending)?;
                    let count: i64 = row.try_get(0).map_err(&pending)?;
                    let bytes: i64 = row.try_get(1).map_err(&pending)?;
                    check_pending_input(to_u64(count), to_u64(bytes), r.data.len())?;
                    let seq = view.input_seq.saturating_add(1);
                    crate::prep::execute(
                        tx,
                        "INSERT INTO pty_inputs (pty_session_id, input_seq, data)
                         VALUES ($1, $2, $3)",
                        &[&id.as_slice(), &to_i64(seq), &r.data],
                    )
                    .map_err(Fail::db("insert terminal input"))?;
                    crate::prep::execute(
                        tx,
                        "UPDATE pty_sessions SET input_seq = $2, last_activity_ms = $3
                         WHERE pty_session_id = $1",
                        &[&id.as_slice(), &to_i64(seq), &now_ms],
                    )
                    .map_err(Fail::db("number terminal input"))?;
                    let opened = opened_ms(&view);
                    record(tx, &id, opened, now_ms, REC_INPUT, seq, 0, &r.data)?;
                    trim_recording(tx, &id, limits.recording_bytes)?;
                    input_seq = Some(seq);
                }
                PtyMutation::Resize(r) => {
                    let view = load_view(tx, &id, true)?.ok_or_else(|| not_found(&id))?;
                    if view.closed() {
                        return Err(closed_error(&view).into());
                    }
                    crate::prep::execute(
                        tx,
                        "UPDATE pty_sessions SET rows = $2, cols = $3 WHERE pty_session_id = $1",
                        &[&id.as_slice(), &i64::from(r.rows), &i64::from(r.cols)],
                    )
                    .map_err(Fail::db("resize terminal"))?;
                    let opened = opened_ms(&view);
                    record_size(tx, &id, opened, now_ms, r.rows, r.cols)?;
                }
                PtyMutation::Close(_) => {
                    // closing a closed terminal is answered as done
                    crate::prep::execute(
                        tx,
                        "UPDATE pty_sessions SET close_requested = true,
                             close_reason = CASE WHEN close_reason = '' THEN $2
                                                 ELSE close_reason END
                         WHERE pty_session_id = $1 AND state <> 3",
                        &[&id.as_slice(), &CLOSED_BY_OPERATOR],
                    )
                    .map_err(Fail::db("close terminal"))?;
                }
            }
            let response = fresh_response(m, &id, input_seq.unwrap_or(0));
            if let Some(rec) = audit {
                write_in(tx, rec, Ok(()))?;
            }
            // the replica holding the client's connection sends the frame
            crate::notify::client(tx, &client, None)?;
            mutations::record(
                tx,
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
            let view = load_view(tx, &id, false)?.ok_or_else(|| not_found(&id))?;
            Ok(PtyOutcome {
                view,
                input_seq,
                replayed: false,
            })
        })
    }

    /// What `client_id` reported of its terminals, applied in order in one
    /// transaction fenced by `session`: one outcome per report.
    pub(crate) fn pty_apply(
        &mut self,
        client_id: &str,
        session: SessionFence,
        reports: &[PtyReport],
        recording_bytes: u64,
        now_ms: i64,
    ) -> Result<Vec<PtyApplied>, Fail> {
        self.in_tx("apply terminal reports", |tx, opts| {
            crate::incidents::check_writable(tx, &[(wire::ScopeKind::Client, client_id)])?;
            check_fence(tx, Some(session), client_id)?;
            let mut out = Vec::with_capacity(reports.len());
            // terminals whose recording grew (trimmed to their room after)
            let mut touched: Vec<[u8; 16]> = Vec::new();
            // terminals whose viewers have something new
            let mut changed: BTreeSet<[u8; 16]> = BTreeSet::new();
            for report in reports {
                let applied = apply_one(tx, client_id, report, now_ms)?;
                if let Ok(u) = Uuid7::parse("pty_session_id", report.id())
                    && let PtyApplied::Recorded { closed, .. } = applied
                {
                    if matches!(report, PtyReport::Output(_)) {
                        if !touched.contains(u.as_bytes()) {
                            touched.push(*u.as_bytes());
                        }
                        changed.insert(*u.as_bytes());
                    }
                    if closed {
                        changed.insert(*u.as_bytes());
                    }
                }
                out.push(applied);
            }
            for id in &touched {
                // a recording shares the client's and the server's quotas
                // with command output, which goes first: it is trimmed
                // (oldest records first, the cut marked) to what they leave
                let room = recording_room(tx, client_id, id, &opts.tiers)?;
                trim_recording(tx, id, recording_bytes.min(room))?;
            }
            crate::notify::commands(tx, &changed)?;
            Ok(out)
        })
    }

    /// The terminals of `client_id` that are not closed, oldest first,
    /// each with its pending input.
    pub(crate) fn pty_resume(&mut self, client_id: &str) -> Result<Vec<PtyResume>, Fail> {
        self.in_tx("read terminals to resume", |tx, _| {
            let rows = crate::prep::query(
                tx,
                concat!(
                    "SELECT ",
                    view_columns!(),
                    " FROM pty_sessions WHERE client_id = $1 AND state <> 3
                      ORDER BY opened_ms, pty_session_id"
                ),
                &[&client_id],
            )
            .map_err(Fail::db("read terminals to resume"))?;
            let mut out = Vec::with_capacity(rows.len());
            for r in &rows {
                let view = view(r)?;
                let id = Uuid7::parse("pty_session_id", &view.info.pty_session_id)
                    .map_err(|_| Fail::Integrity("a stored terminal id is not a UUIDv7".into()))?;
                let read = Fail::db("read pending terminal input");
                let inputs = crate::prep::query(
                    tx,
                    "SELECT input_seq, data FROM pty_inputs WHERE pty_session_id = $1
                     ORDER BY input_seq LIMIT $2",
                    &[&id.as_bytes().as_slice(), &to_i64(MAX_PENDING_PTY_INPUTS)],
                )
                .map_err(&read)?
                .iter()
                .map(|i| {
                    Ok(wire::PtyInput {
                        pty_session_id: view.info.pty_session_id.clone(),
                        input_seq: to_u64(i.try_get(0).map_err(&read)?),
                        data: i.try_get(1).map_err(&read)?,
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
                out.push(PtyResume { view, inputs });
            }
            Ok(out)
        })
    }

    /// Terminals idle since before `idle_before_ms` and not yet asked to
    /// close: each is asked to close, with the reason [`IDLE_TIMEOUT`],
    /// and its client's replica is woken. A terminal another transaction
    /// holds is busy, not idle: the pass skips it.
    pub(crate) fn pty_idle(
        &mut self,
        idle_before_ms: i64,
        limit: usize,
    ) -> Result<Vec<PtyView>, Fail> {
        let views = self.in_tx("close idle terminals", |tx, _| {
            let read = Fail::db("read idle terminals");
            let ids: Vec<Vec<u8>> = crate::prep::query(
                tx,
                "SELECT pty_session_id FROM pty_sessions
                 WHERE state <> 3 AND NOT close_requested AND last_activity_ms < $1
                 ORDER BY last_activity_ms LIMIT $2
                 FOR UPDATE SKIP LOCKED",
                &[&idle_before_ms, &to_i64(limit as u64)],
            )
            .map_err(&read)?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(&read)?;
            let mut out = Vec::with_capacity(ids.len());
            let mut clients: BTreeSet<String> = BTreeSet::new();
            for id in ids {
                let Ok(id) = <[u8; 16]>::try_from(id.as_slice()) else {
                    continue;
                };
                crate::prep::execute(
                    tx,
                    "UPDATE pty_sessions SET close_requested = true, close_reason = $2
                     WHERE pty_session_id = $1",
                    &[&id.as_slice(), &IDLE_TIMEOUT],
                )
                .map_err(Fail::db("close idle terminal"))?;
                if let Some(v) = load_view(tx, &id, false)? {
                    clients.insert(v.info.client_id.clone());
                    out.push(v);
                }
            }
            for client in &clients {
                crate::notify::client(tx, client, None)?;
            }
            Ok(out)
        })?;
        if !views.is_empty() {
            tracing::info!(
                terminals = views.len(),
                "terminals idle past the timeout asked to close"
            );
        }
        Ok(views)
    }
}
