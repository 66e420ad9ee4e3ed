//! Operator stdin (plan §5.2 `stdin_writes`, §9.1 `AppendStdin` and
//! `CloseStdin`, R-5.4-05, R-5.4-11).
//!
//! `AppendStdin` and `CloseStdin` are operator mutations, idempotent by
//! `request_id`: the lookup, the numbered writes (an append of up to 1 MiB
//! is split into writes of at most 256 KiB, the newline, if any, on the
//! last), their charges, the stored response and the audit record commit
//! together. A replay returns the same `write_seq` assignment with the
//! delivery recorded since.
//!
//! A write stays pending until the client's `StdinAck` event settles it
//! (written or discarded, in the event append's own transaction, which
//! also frees the payload and its charge but a small row remainder); the
//! server core sends pending writes in order within its windows and sends
//! them again after a reconnect, and the client ignores a write it holds.
//! When the command ends, writes still pending are discarded: no process
//! is left to read them.

use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{OptionalExtension as _, Transaction, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{MAX_STDIN_APPEND_BYTES, MAX_STDIN_WRITE_BYTES};
use rvbox_proto::v1 as wire;
use rvbox_retention::{CHARGE_VERSION, ChargeKind, Class, Usage, charge, release, reserve};

use crate::error::StoreError;
use crate::mutations::{self, Assigned, OpError, Owner, Stored};
use crate::store::{Store, to_i64, to_u64};

pub use rvbox_store_port::stdin::{
    MAX_PENDING_STDIN_BYTES, MAX_PENDING_STDIN_WRITES, StdinOutcome, StdinResponse, StdinWrites,
};

/// `stdin_writes.delivery`: waiting for the client's acknowledgement.
const PENDING: i64 = 1;
/// `stdin_writes.delivery`: written to the child's stdin.
const WRITTEN: i64 = 2;
/// `stdin_writes.delivery`: not written (stdin closed, or the process
/// gone).
const DISCARDED: i64 = 3;

/// Payloads shorter than this are stored as they are: zstd cannot win.
const COMPRESS_MIN_BYTES: usize = 64;

fn uuid_text(b: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*b).hyphenated().to_string()
}

fn delivery_of(v: i64) -> wire::StdinDelivery {
    match v {
        WRITTEN => wire::StdinDelivery::Written,
        DISCARDED => wire::StdinDelivery::Discarded,
        _ => wire::StdinDelivery::Pending,
    }
}

/// One write of a mutation, before it is numbered.
#[derive(Debug)]
pub struct Piece<'a> {
    /// Its raw bytes (at most 256 KiB).
    pub data: &'a [u8],
    /// A newline follows the bytes.
    pub newline: bool,
    /// Stdin closes after it.
    pub close: bool,
}

/// The writes of an append: pieces of at most 256 KiB, the newline on the
/// last one (an empty append with a newline is one newline-only write).
fn split(data: &[u8], newline: bool) -> Vec<Piece<'_>> {
    let size = usize::try_from(MAX_STDIN_WRITE_BYTES).unwrap_or(usize::MAX);
    let mut pieces: Vec<Piece<'_>> = data
        .chunks(size)
        .map(|data| Piece {
            data,
            newline: false,
            close: false,
        })
        .collect();
    match pieces.last_mut() {
        Some(last) => last.newline = newline,
        None => pieces.push(Piece {
            data: &[],
            newline,
            close: false,
        }),
    }
    pieces
}

/// What the two mutations share once their requests are checked (pure:
/// every store backend checks and splits stdin requests by it).
#[derive(Debug)]
pub struct Mutation<'a> {
    /// `AppendStdin` or `CloseStdin`.
    pub method: &'static str,
    /// The request's id.
    pub request_id: Uuid7,
    /// The command.
    pub issue: [u8; 16],
    /// The request hash (idempotency).
    pub hash: rvbox_domain::hash::RequestHash,
    /// The writes it makes, in order.
    pub pieces: Vec<Piece<'a>>,
}

/// The pending writes of a command, counted (bounded by
/// [`MAX_PENDING_STDIN_WRITES`] rows, so the count is bounded too).
fn pending_totals(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<(u64, u64), StoreError> {
    tx.query_row_cached(
        "SELECT COUNT(*), COALESCE(SUM(raw_len), 0) FROM stdin_writes
         WHERE issue_uuid = ?1 AND delivery = 1",
        params![issue.as_slice()],
        |r| Ok((to_u64(r.get(0)?), to_u64(r.get(1)?))),
    )
    .map_err(|e| StoreError::sqlite("count pending stdin", e))
}

/// The last write of a command (`write_seq`, close intent), if any.
fn last_write(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<Option<(u64, bool)>, StoreError> {
    tx.query_row_cached(
        "SELECT write_seq, close FROM stdin_writes WHERE issue_uuid = ?1
         ORDER BY write_seq DESC LIMIT 1",
        params![issue.as_slice()],
        |r| Ok((to_u64(r.get(0)?), r.get::<_, i64>(1)? == 1)),
    )
    .optional()
    .map_err(|e| StoreError::sqlite("read last stdin write", e))
}

fn delivery_at(
    conn: &rusqlite::Connection,
    issue: &[u8; 16],
    write_seq: u64,
) -> Result<Option<wire::StdinDelivery>, StoreError> {
    conn.query_row_cached(
        "SELECT delivery FROM stdin_writes WHERE issue_uuid = ?1 AND write_seq = ?2",
        params![issue.as_slice(), to_i64(write_seq)],
        |r| r.get::<_, i64>(0),
    )
    .optional()
    .map(|d| d.map(delivery_of))
    .map_err(|e| StoreError::sqlite("read stdin delivery", e))
}

/// Discards the writes of `issue` still pending, inside the caller's
/// transaction (the command ended: no process reads them). Their charge
/// stays until the whole command record goes.
pub(crate) fn discard_pending(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE stdin_writes SET delivery = 3, payload = x'' WHERE issue_uuid = ?1 AND delivery = 1",
        params![issue.as_slice()],
    )
    .map_err(|e| StoreError::sqlite("discard pending stdin", e))?;
    Ok(())
}

/// What settling one write by a `StdinAck` frees: its payload and every
/// part of its charge but what the remaining metadata row costs.
pub fn settled_release(stored_len: u64) -> Result<u64, StoreError> {
    let whole = charge(CHARGE_VERSION, ChargeKind::StdinWrite, stored_len)
        .map_err(|e| StoreError::Integrity(e.to_string()))?;
    let row = charge(CHARGE_VERSION, ChargeKind::EventRow, 0)
        .map_err(|e| StoreError::Integrity(e.to_string()))?;
    Ok(whole.saturating_sub(row))
}

/// A `StdinAck` checked against the write it names: the write's stored
/// length when it is still pending (the caller frees it), `None` when it
/// was settled already (a repeat changes nothing).
///
/// # Errors
/// `PROTOCOL_ERROR` for a write the server never assigned or a delivery
/// that is not written or discarded.
pub(crate) fn check_ack(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    ack: &wire::StdinAck,
) -> Result<Result<Option<u64>, DomainError>, StoreError> {
    if !matches!(
        wire::StdinDelivery::try_from(ack.delivery),
        Ok(wire::StdinDelivery::Written | wire::StdinDelivery::Discarded)
    ) {
        return Ok(Err(DomainError::new(
            Code::ProtocolError,
            "stdin_ack.delivery must be WRITTEN or DISCARDED",
        )));
    }
    let row: Option<(i64, i64)> = tx
        .query_row_cached(
            "SELECT delivery, stored_len FROM stdin_writes WHERE issue_uuid = ?1 AND write_seq = ?2",
            params![issue.as_slice(), to_i64(ack.write_seq)],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("read stdin write", e))?;
    Ok(match row {
        None => Err(DomainError::new(
            Code::ProtocolError,
            format!(
                "stdin_ack.write_seq {} names a write the server never assigned",
                ack.write_seq
            ),
        )),
        Some((PENDING, stored)) => Ok(Some(to_u64(stored))),
        Some(_) => Ok(None),
    })
}

/// Settles one write by its acknowledgement, inside the event append's
/// transaction; true when it was pending.
pub(crate) fn settle(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    write_seq: u64,
    delivery: i32,
) -> Result<bool, StoreError> {
    let to = if delivery == wire::StdinDelivery::Written as i32 {
        WRITTEN
    } else {
        DISCARDED
    };
    let n = tx
        .execute_cached(
            "UPDATE stdin_writes SET delivery = ?3, payload = x''
             WHERE issue_uuid = ?1 AND write_seq = ?2 AND delivery = 1",
            params![issue.as_slice(), to_i64(write_seq), to],
        )
        .map_err(|e| StoreError::sqlite("settle stdin write", e))?;
    Ok(n == 1)
}

/// A write's stored form: (compression, bytes), compressed only when that
/// wins.
///
/// # Errors
/// When compression fails.
pub fn encode_piece(data: &[u8]) -> Result<(i64, Vec<u8>), StoreError> {
    if data.len() >= COMPRESS_MIN_BYTES {
        let z =
            zstd::bulk::compress(data, 1).map_err(|e| StoreError::io("compress stdin", "", e))?;
        if z.len() < data.len() {
            return Ok((1, z));
        }
    }
    Ok((0, data.to_vec()))
}

impl Store {
    /// `AppendStdin` (plan §9.1), idempotent by `request_id`, audited
    /// with `caller`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` naming the field (ids, `newline`, empty raw
    /// data), `TOO_LARGE` past 1 MiB, `NOT_FOUND`, `CONFLICT` for a reused
    /// `request_id`, `FAILED_PRECONDITION` for an ended command or closed
    /// stdin, `CAPACITY_EXHAUSTED` past the pending bound,
    /// `QUOTA_EXCEEDED`, `UNAVAILABLE`, or a store failure.
    pub fn append_stdin_as(
        &mut self,
        req: &wire::AppendStdinRequest,
        caller: &crate::operator::Caller,
        now_ms: i64,
    ) -> Result<StdinOutcome, OpError> {
        let mut rec = crate::audit::AuditRecord::control(caller, "AppendStdin", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        // sizes only: never the bytes (plan §9.3)
        rec.detail = format!(
            "{} bytes, {}",
            req.data.len(),
            wire::StdinNewline::try_from(req.newline)
                .map_or("newline unknown", |n| n.as_str_name())
        );
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = append_mutation(req)
            .map_err(OpError::Refused)
            .and_then(|m| self.stdin_in(&m, &mut intent, now_ms));
        self.audit_unwritten(&mut intent, &result, now_ms);
        result
    }

    /// `CloseStdin` (plan §9.1): a close-only write after every earlier
    /// one, idempotent by `request_id`, audited with `caller`.
    ///
    /// # Errors
    /// As [`Store::append_stdin_as`].
    pub fn close_stdin_as(
        &mut self,
        req: &wire::CloseStdinRequest,
        caller: &crate::operator::Caller,
        now_ms: i64,
    ) -> Result<StdinOutcome, OpError> {
        let mut rec = crate::audit::AuditRecord::control(caller, "CloseStdin", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = close_mutation(req)
            .map_err(OpError::Refused)
            .and_then(|m| self.stdin_in(&m, &mut intent, now_ms));
        self.audit_unwritten(&mut intent, &result, now_ms);
        result
    }

    fn stdin_in(
        &mut self,
        m: &Mutation<'_>,
        intent: &mut crate::audit::AuditIntent,
        now_ms: i64,
    ) -> Result<StdinOutcome, OpError> {
        let free = self.free_space()?;
        let tiers = self.opts.tiers.clone();
        let owner = Owner::Command(&m.issue);
        let refusals = self.metrics.quota_refusals.clone();
        let (tx, view) = self.begin_on(&m.issue)?;
        if let Some(stored) = mutations::lookup(&tx, &m.request_id, m.method, &m.hash, owner)? {
            let bytes =
                stored.map_err(|d| OpError::Refused(crate::incidents::detail_to_error(&d)))?;
            let response = decode_response(m.method, &bytes)?;
            let response = refresh(&tx, &m.issue, response)?;
            return Ok(StdinOutcome {
                response,
                replayed: true,
                client_id: view.client_id,
                lifecycle: view.lifecycle,
            });
        }
        if view.lifecycle.is_terminal() {
            return Err(OpError::Refused(
                DomainError::new(
                    Code::FailedPrecondition,
                    format!(
                        "the command has ended ({}); its stdin is gone",
                        view.lifecycle.as_str()
                    ),
                )
                .with_field("issue_uuid"),
            ));
        }
        let last = last_write(&tx, &m.issue)?;
        if last.is_some_and(|(_, closed)| closed) {
            return Err(OpError::Refused(
                DomainError::new(Code::FailedPrecondition, "the command's stdin is closed")
                    .with_field("issue_uuid"),
            ));
        }
        let (pending_writes, pending_bytes) = pending_totals(&tx, &m.issue)?;
        let new_bytes: u64 = m.pieces.iter().map(|p| p.data.len() as u64).sum();
        if pending_writes.saturating_add(m.pieces.len() as u64) > MAX_PENDING_STDIN_WRITES
            || pending_bytes.saturating_add(new_bytes) > MAX_PENDING_STDIN_BYTES
        {
            return Err(OpError::Refused(
                DomainError::new(
                    Code::CapacityExhausted,
                    format!(
                        "the command has {pending_writes} stdin writes ({pending_bytes} bytes) its client has not acknowledged yet; \
                         at most {MAX_PENDING_STDIN_WRITES} writes and {MAX_PENDING_STDIN_BYTES} bytes wait; retry once the client catches up"
                    ),
                )
                .with_field("data"),
            ));
        }
        // charges: every write, then the stored result (essential)
        let (charged, held): (i64, i64) = tx
            .query_row_cached(
                "SELECT charged_bytes, closeout_held FROM commands WHERE issue_uuid = ?1",
                params![m.issue.as_slice()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(|e| StoreError::sqlite("load command usage", e))?;
        let mut usage = Usage {
            command: to_u64(charged),
            held_closeout: to_u64(held),
            owner: crate::store::client_charged(&tx, &view.client_id)?,
            global: crate::store::global_charged(&tx)?,
            free_space: free,
        };
        let mut encoded = Vec::with_capacity(m.pieces.len());
        let mut items = Vec::with_capacity(m.pieces.len() + 1);
        for p in &m.pieces {
            let (compression, stored) = encode_piece(p.data)?;
            // closing stdin carries no data and happens once: it is part of
            // the command's closeout (a process that reads to end of file
            // ends only with it), so the closeout headroom pays for it when
            // the command's total is full
            let class = if p.close && p.data.is_empty() {
                Class::Essential
            } else {
                Class::Ordinary
            };
            items.push((ChargeKind::StdinWrite, class, stored.len() as u64));
            encoded.push((compression, stored));
        }
        items.push((ChargeKind::MutationRow, Class::Essential, 0));
        for (kind, class, bytes) in items {
            let c = charge(CHARGE_VERSION, kind, bytes)
                .map_err(|e| StoreError::Integrity(e.to_string()))?;
            let r = reserve(&tiers, &usage, kind, class, c, true).map_err(|refusal| {
                tracing::warn!(tier = refusal.tier.name(), "stdin refused by quota");
                refusals
                    .get_or_create(&crate::metrics::TierLabel {
                        tier: refusal.tier.name(),
                    })
                    .inc();
                OpError::Refused(
                    DomainError::new(Code::QuotaExceeded, refusal.to_string()).with_field("data"),
                )
            })?;
            usage.command = r.command_after;
            usage.held_closeout = r.held_closeout_after;
            usage.owner = r.owner_after;
            usage.global = r.global_after;
        }
        tx.execute_cached(
            "UPDATE commands SET charged_bytes = ?2, closeout_held = ?3 WHERE issue_uuid = ?1",
            params![
                m.issue.as_slice(),
                to_i64(usage.command),
                to_i64(usage.held_closeout)
            ],
        )
        .map_err(|e| StoreError::sqlite("charge stdin", e))?;
        crate::store::apply_owner_global(&tx, &view.client_id, usage.owner, usage.global)?;
        let first = last.map_or(1, |(seq, _)| seq.saturating_add(1));
        let mut seq = first;
        for (p, (compression, stored)) in m.pieces.iter().zip(&encoded) {
            tx.execute_cached(
                "INSERT INTO stdin_writes (issue_uuid, write_seq, compression, raw_len, stored_len,
                     sha256, payload, newline, close, delivery)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 1)",
                params![
                    m.issue.as_slice(),
                    to_i64(seq),
                    compression,
                    p.data.len() as i64,
                    stored.len() as i64,
                    rvbox_segment::sha256(p.data).as_slice(),
                    stored,
                    i64::from(p.newline),
                    i64::from(p.close),
                ],
            )
            .map_err(|e| StoreError::sqlite("insert stdin write", e))?;
            seq = seq.saturating_add(1);
        }
        let last_seq = seq.saturating_sub(1);
        let (response, stored) = fresh_response(m, first, last_seq);
        intent.write_in(&tx, Ok(()))?;
        mutations::record(
            &tx,
            &m.request_id,
            m.method,
            &m.hash,
            owner,
            &stored,
            Assigned {
                write_seq: Some(last_seq),
                revision: None,
            },
            now_ms,
        )?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit stdin", e))?;
        self.hook.at(crate::crash::points::STDIN_AFTER_COMMIT);
        self.metrics.stdin_writes.inc_by(m.pieces.len() as u64);
        tracing::info!(
            method = m.method,
            first_write_seq = first,
            last_write_seq = last_seq,
            bytes = new_bytes,
            "stdin recorded"
        );
        Ok(StdinOutcome {
            response,
            replayed: false,
            client_id: view.client_id,
            lifecycle: view.lifecycle,
        })
    }

    /// The pending writes of `issue` after `after_seq`, in order, while
    /// they fit in `max_bytes` of raw payload and `max_writes` (the
    /// server's in-flight windows); nothing unless the command runs (the
    /// client writes only into a running process).
    ///
    /// # Errors
    /// A store failure.
    pub fn pending_stdin(
        &self,
        issue: &[u8; 16],
        after_seq: u64,
        max_bytes: u64,
        max_writes: u64,
    ) -> Result<StdinWrites, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT s.write_seq, s.compression, s.raw_len, s.stored_len, s.sha256, s.payload,
                        s.newline, s.close
                 FROM stdin_writes s JOIN commands c ON c.issue_uuid = s.issue_uuid
                 WHERE s.issue_uuid = ?1 AND s.write_seq > ?2 AND s.delivery = 1 AND c.lifecycle = 4
                 ORDER BY s.write_seq LIMIT ?3",
            )
            .map_err(|e| StoreError::sqlite("prepare pending stdin", e))?;
        let limit = max_writes.min(MAX_PENDING_STDIN_WRITES).saturating_add(1);
        let mut rows = stmt
            .query(params![issue.as_slice(), to_i64(after_seq), to_i64(limit)])
            .map_err(|e| StoreError::sqlite("read pending stdin", e))?;
        let text = uuid_text(issue);
        let mut out = StdinWrites::default();
        let mut bytes = 0u64;
        while let Some(r) = rows
            .next()
            .map_err(|e| StoreError::sqlite("read pending stdin", e))?
        {
            let raw_len = to_u64(r.get(2).map_err(|e| StoreError::sqlite("read stdin", e))?);
            let full = out.writes.len() as u64 >= max_writes
                || bytes.saturating_add(raw_len.max(1)) > max_bytes;
            if full {
                out.more = true;
                break;
            }
            bytes = bytes.saturating_add(raw_len.max(1));
            let get = |e| StoreError::sqlite("read stdin", e);
            let compression: i64 = r.get(1).map_err(get)?;
            let stored_len: i64 = r.get(3).map_err(get)?;
            out.writes.push(wire::StdinWrite {
                issue_uuid: text.clone(),
                write_seq: to_u64(r.get(0).map_err(get)?),
                compression: if compression == 1 {
                    wire::Compression::Zstd as i32
                } else {
                    wire::Compression::None as i32
                },
                payload: r.get(5).map_err(get)?,
                raw_length: u32::try_from(raw_len).unwrap_or(u32::MAX),
                stored_length: u32::try_from(stored_len).unwrap_or(u32::MAX),
                raw_sha256: r.get(4).map_err(get)?,
                newline: if r.get::<_, i64>(6).map_err(get)? == 1 {
                    wire::StdinNewline::Append as i32
                } else {
                    wire::StdinNewline::Raw as i32
                },
                close_after: r.get::<_, i64>(7).map_err(get)? == 1,
            });
        }
        Ok(out)
    }
}

/// Usage after settling writes: their release, command-scoped.
pub fn usage_after_settle(usage: &Usage, freed: u64) -> Result<Usage, StoreError> {
    release(usage, freed, true).map_err(|e| StoreError::Integrity(e.to_string()))
}

/// An `AppendStdin` request checked and split into writes.
///
/// # Errors
/// `INVALID_ARGUMENT` or `TOO_LARGE` naming the field.
pub fn append_mutation(req: &wire::AppendStdinRequest) -> Result<Mutation<'_>, DomainError> {
    let request_id = Uuid7::parse("request_id", &req.request_id)?;
    let issue = *Uuid7::parse("issue_uuid", &req.issue_uuid)?.as_bytes();
    let newline = match wire::StdinNewline::try_from(req.newline) {
        Ok(wire::StdinNewline::Append) => true,
        Ok(wire::StdinNewline::Raw) => false,
        _ => {
            return Err(DomainError::new(
                Code::InvalidArgument,
                format!(
                    "newline must be STDIN_NEWLINE_APPEND or STDIN_NEWLINE_RAW, not {}",
                    req.newline
                ),
            )
            .with_field("newline"));
        }
    };
    if req.data.len() as u64 > MAX_STDIN_APPEND_BYTES {
        return Err(DomainError::new(
            Code::TooLarge,
            format!(
                "data is {} bytes; one append takes at most {MAX_STDIN_APPEND_BYTES}",
                req.data.len()
            ),
        )
        .with_field("data"));
    }
    if req.data.is_empty() && !newline {
        return Err(DomainError::new(
            Code::InvalidArgument,
            "data is empty and newline is RAW: the append would write nothing",
        )
        .with_field("data"));
    }
    let canonical = wire::AppendStdinRequest {
        request_id: String::new(),
        issue_uuid: uuid_text(&issue),
        data: req.data.clone(),
        newline: req.newline,
    };
    Ok(Mutation {
        method: "AppendStdin",
        request_id,
        issue,
        hash: request_hash("AppendStdin", &canonical),
        pieces: split(&req.data, newline),
    })
}

/// A `CloseStdin` request checked: one close-only write.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the field.
pub fn close_mutation(req: &wire::CloseStdinRequest) -> Result<Mutation<'static>, DomainError> {
    let request_id = Uuid7::parse("request_id", &req.request_id)?;
    let issue = *Uuid7::parse("issue_uuid", &req.issue_uuid)?.as_bytes();
    let canonical = wire::CloseStdinRequest {
        request_id: String::new(),
        issue_uuid: uuid_text(&issue),
    };
    Ok(Mutation {
        method: "CloseStdin",
        request_id,
        issue,
        hash: request_hash("CloseStdin", &canonical),
        pieces: vec![Piece {
            data: &[],
            newline: false,
            close: true,
        }],
    })
}

/// The response of a mutation that numbered writes `first..=last`, and
/// its stored form (pure: every store backend answers so).
pub fn fresh_response(m: &Mutation<'_>, first: u64, last: u64) -> (StdinResponse, Stored) {
    let response = if m.method == "CloseStdin" {
        StdinResponse::Close(wire::CloseStdinResponse {
            issue_uuid: uuid_text(&m.issue),
            write_seq: last,
            delivery: wire::StdinDelivery::Pending as i32,
        })
    } else {
        StdinResponse::Append(wire::AppendStdinResponse {
            issue_uuid: uuid_text(&m.issue),
            first_write_seq: first,
            last_write_seq: last,
            delivery: wire::StdinDelivery::Pending as i32,
        })
    };
    let stored: Stored = Ok(match &response {
        StdinResponse::Append(r) => r.encode_to_vec(),
        StdinResponse::Close(r) => r.encode_to_vec(),
    });
    (response, stored)
}

/// A stored stdin response, decoded.
///
/// # Errors
/// When the stored bytes do not decode.
pub fn decode_response(method: &str, bytes: &[u8]) -> Result<StdinResponse, OpError> {
    let bad = |_| StoreError::Integrity(format!("stored {method} response does not decode"));
    Ok(if method == "CloseStdin" {
        StdinResponse::Close(wire::CloseStdinResponse::decode(bytes).map_err(bad)?)
    } else {
        StdinResponse::Append(wire::AppendStdinResponse::decode(bytes).map_err(bad)?)
    })
}

/// A replayed response with the delivery of its last write as it is now.
fn refresh(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    response: StdinResponse,
) -> Result<StdinResponse, StoreError> {
    Ok(match response {
        StdinResponse::Append(mut r) => {
            if let Some(d) = delivery_at(tx, issue, r.last_write_seq)? {
                r.delivery = d as i32;
            }
            StdinResponse::Append(r)
        }
        StdinResponse::Close(mut r) => {
            if let Some(d) = delivery_at(tx, issue, r.write_seq)? {
                r.delivery = d as i32;
            }
            StdinResponse::Close(r)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_append_splits_at_the_write_ceiling_with_the_newline_last() {
        let data = vec![b'x'; 600 * 1024];
        let p = split(&data, true);
        assert_eq!(
            p.iter()
                .map(|p| (p.data.len(), p.newline))
                .collect::<Vec<_>>(),
            vec![(262_144, false), (262_144, false), (90_112, true)]
        );
        let p = split(&[], true);
        assert_eq!(p.len(), 1);
        assert!(p[0].data.is_empty() && p[0].newline);
        assert_eq!(split(b"ab", false).len(), 1);
    }

    #[test]
    fn settling_keeps_the_row_charge_only() {
        let freed = settled_release(1000).unwrap();
        let whole = charge(CHARGE_VERSION, ChargeKind::StdinWrite, 1000).unwrap();
        assert_eq!(
            whole - freed,
            charge(CHARGE_VERSION, ChargeKind::EventRow, 0).unwrap()
        );
    }
}
