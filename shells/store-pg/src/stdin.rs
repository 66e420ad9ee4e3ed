//! `AppendStdin` and `CloseStdin` on PostgreSQL (as `rvbox_store::stdin`,
//! whose pure request checks and splitting it uses): idempotent by
//! `request_id`, the writes numbered after the last one on the locked
//! command row, bounded by the pending-write caps, charged, and audited,
//! in one transaction.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_retention::{CHARGE_VERSION, ChargeKind, Class, Usage, charge, reserve};
use rvbox_store::audit::AuditRecord;
use rvbox_store::incidents::detail_to_error;
use rvbox_store::mutations::{Assigned, Owner};
use rvbox_store::stdin::{
    Mutation, append_mutation, close_mutation, decode_response, encode_piece, fresh_response,
};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::stdin::{
    MAX_PENDING_STDIN_BYTES, MAX_PENDING_STDIN_WRITES, StdinOutcome, StdinResponse,
};

use crate::audit::write_in;
use crate::commands::load_view;
use crate::sessions::{global_charged, to_i64, to_u64};
use crate::{Fail, PgStore, mutations};

fn delivery_of(v: i64) -> wire::StdinDelivery {
    match v {
        2 => wire::StdinDelivery::Written,
        3 => wire::StdinDelivery::Discarded,
        _ => wire::StdinDelivery::Pending,
    }
}

fn integrity(e: impl std::fmt::Display) -> Fail {
    Fail::Integrity(e.to_string())
}

fn op_fail(e: rvbox_store::mutations::OpError) -> Fail {
    match e {
        rvbox_store::mutations::OpError::Refused(d) => Fail::Refused(d),
        rvbox_store::mutations::OpError::Store(s) => Fail::Integrity(s.to_string()),
    }
}

impl PgStore {
    /// `AppendStdin`, audited with `caller`.
    pub(crate) fn append_stdin(
        &mut self,
        req: &wire::AppendStdinRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<StdinOutcome, Fail> {
        let mut rec = AuditRecord::control(&operator(caller), "AppendStdin", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        // sizes only: never the bytes
        rec.detail = format!(
            "{} bytes, {}",
            req.data.len(),
            wire::StdinNewline::try_from(req.newline)
                .map_or("newline unknown", |n| n.as_str_name())
        );
        let result = append_mutation(req)
            .map_err(Fail::Refused)
            .and_then(|m| self.stdin_in(&m, &rec, now_ms));
        if !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        result
    }

    /// `CloseStdin`, audited with `caller`.
    pub(crate) fn close_stdin(
        &mut self,
        req: &wire::CloseStdinRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<StdinOutcome, Fail> {
        let mut rec = AuditRecord::control(&operator(caller), "CloseStdin", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        let result = close_mutation(req)
            .map_err(Fail::Refused)
            .and_then(|m| self.stdin_in(&m, &rec, now_ms));
        if !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        result
    }

    #[allow(clippy::too_many_lines)]
    fn stdin_in(
        &mut self,
        m: &Mutation<'_>,
        rec: &AuditRecord,
        now_ms: i64,
    ) -> Result<StdinOutcome, Fail> {
        let mut encoded = Vec::with_capacity(m.pieces.len());
        for p in &m.pieces {
            encoded.push(encode_piece(p.data).map_err(integrity)?);
        }
        let new_bytes: u64 = m.pieces.iter().map(|p| p.data.len() as u64).sum();
        let outcome = self.in_tx(m.method, |tx, opts| {
            let view = load_view(tx, &m.issue, true)?;
            let owner = Owner::Command(&m.issue);
            if let Some(stored) = mutations::lookup(tx, &m.request_id, m.method, &m.hash, owner)? {
                let bytes = stored.map_err(|d| Fail::Refused(detail_to_error(&d)))?;
                let mut response = decode_response(m.method, &bytes).map_err(op_fail)?;
                // the delivery of its last write as it is now
                let last = match &response {
                    StdinResponse::Append(r) => r.last_write_seq,
                    StdinResponse::Close(r) => r.write_seq,
                };
                let delivery = crate::prep::query_opt(tx, "SELECT delivery FROM stdin_writes WHERE issue_uuid = $1 AND write_seq = $2",
                        &[&m.issue.as_slice(), &to_i64(last)],
                    )
                    .map_err(Fail::db("read stdin delivery"))?
                    .map(|r| delivery_of(r.get(0)) as i32);
                if let Some(d) = delivery {
                    match &mut response {
                        StdinResponse::Append(r) => r.delivery = d,
                        StdinResponse::Close(r) => r.delivery = d,
                    }
                }
                return Ok(StdinOutcome {
                    response,
                    replayed: true,
                    client_id: view.client_id,
                    lifecycle: view.lifecycle,
                });
            }
            if view.lifecycle.is_terminal() {
                return Err(DomainError::new(
                    Code::FailedPrecondition,
                    format!(
                        "the command has ended ({}); its stdin is gone",
                        view.lifecycle.as_str()
                    ),
                )
                .with_field("issue_uuid")
                .into());
            }
            let last = crate::prep::query_opt(tx, "SELECT write_seq, close FROM stdin_writes WHERE issue_uuid = $1
                     ORDER BY write_seq DESC LIMIT 1",
                    &[&m.issue.as_slice()],
                )
                .map_err(Fail::db("read last stdin write"))?
                .map(|r| (to_u64(r.get(0)), r.get::<_, bool>(1)));
            if last.is_some_and(|(_, closed)| closed) {
                return Err(DomainError::new(
                    Code::FailedPrecondition,
                    "the command's stdin is closed",
                )
                .with_field("issue_uuid")
                .into());
            }
            let row = crate::prep::query_one(tx, "SELECT COUNT(*), COALESCE(SUM(raw_len), 0)::bigint FROM stdin_writes
                     WHERE issue_uuid = $1 AND delivery = 1",
                    &[&m.issue.as_slice()],
                )
                .map_err(Fail::db("count pending stdin"))?;
            let (pending_writes, pending_bytes) = (to_u64(row.get(0)), to_u64(row.get(1)));
            if pending_writes.saturating_add(m.pieces.len() as u64) > MAX_PENDING_STDIN_WRITES
                || pending_bytes.saturating_add(new_bytes) > MAX_PENDING_STDIN_BYTES
            {
                return Err(DomainError::new(
                    Code::CapacityExhausted,
                    format!(
                        "the command has {pending_writes} stdin writes ({pending_bytes} bytes) its client has not acknowledged yet; \
                         at most {MAX_PENDING_STDIN_WRITES} writes and {MAX_PENDING_STDIN_BYTES} bytes wait; retry once the client catches up"
                    ),
                )
                .with_field("data")
                .into());
            }
            // charges: every write, then the stored result (essential)
            let row = crate::prep::query_one(tx, "SELECT charged_bytes, closeout_held FROM commands WHERE issue_uuid = $1",
                    &[&m.issue.as_slice()],
                )
                .map_err(Fail::db("load command usage"))?;
            let owner_before = crate::prep::query_opt(tx, "SELECT charged_bytes FROM clients WHERE client_id = $1",
                    &[&view.client_id],
                )
                .map_err(Fail::db("read client usage"))?
                .map_or(0, |r| to_u64(r.get(0)));
            let global_before = global_charged(tx)?;
            let mut usage = Usage {
                command: to_u64(row.get(0)),
                held_closeout: to_u64(row.get(1)),
                owner: owner_before,
                global: global_before,
                free_space: u64::MAX,
            };
            let mut items = Vec::with_capacity(m.pieces.len() + 1);
            for (p, (_, stored)) in m.pieces.iter().zip(&encoded) {
                // closing stdin carries no data and happens once: the
                // command's closeout headroom pays for it
                let class = if p.close && p.data.is_empty() {
                    Class::Essential
                } else {
                    Class::Ordinary
                };
                items.push((ChargeKind::StdinWrite, class, stored.len() as u64));
            }
            items.push((ChargeKind::MutationRow, Class::Essential, 0));
            for (kind, class, bytes) in items {
                let c = charge(CHARGE_VERSION, kind, bytes).map_err(integrity)?;
                let r = reserve(&opts.tiers, &usage, kind, class, c, true).map_err(|refusal| {
                    tracing::warn!(tier = refusal.tier.name(), "stdin refused by quota");
                    Fail::Refused(
                        DomainError::new(Code::QuotaExceeded, refusal.to_string())
                            .with_field("data"),
                    )
                })?;
                usage.command = r.command_after;
                usage.held_closeout = r.held_closeout_after;
                usage.owner = r.owner_after;
                usage.global = r.global_after;
            }
            crate::prep::execute(tx, "UPDATE commands SET charged_bytes = $2, closeout_held = $3 WHERE issue_uuid = $1",
                &[
                    &m.issue.as_slice(),
                    &to_i64(usage.command),
                    &to_i64(usage.held_closeout),
                ],
            )
            .map_err(Fail::db("charge stdin"))?;
            crate::prep::execute(tx, "UPDATE clients SET charged_bytes = charged_bytes + $2 WHERE client_id = $1",
                &[
                    &view.client_id,
                    &to_i64(usage.owner).saturating_sub(to_i64(owner_before)),
                ],
            )
            .map_err(Fail::db("update client usage"))?;
            crate::prep::execute(tx, "UPDATE quota_totals SET command_charged = command_charged + $1 WHERE id = 1",
                &[&to_i64(usage.global).saturating_sub(to_i64(global_before))],
            )
            .map_err(Fail::db("update global usage"))?;
            let first = last.map_or(1, |(seq, _)| seq.saturating_add(1));
            let mut seq = first;
            for (p, (compression, stored)) in m.pieces.iter().zip(&encoded) {
                crate::prep::execute(tx, "INSERT INTO stdin_writes (issue_uuid, write_seq, compression, raw_len,
                         stored_len, sha256, payload, newline, close, delivery)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1)",
                    &[
                        &m.issue.as_slice(),
                        &to_i64(seq),
                        compression,
                        &i64::try_from(p.data.len()).unwrap_or(i64::MAX),
                        &i64::try_from(stored.len()).unwrap_or(i64::MAX),
                        &rvbox_segment::sha256(p.data).as_slice(),
                        stored,
                        &p.newline,
                        &p.close,
                    ],
                )
                .map_err(Fail::db("insert stdin write"))?;
                seq = seq.saturating_add(1);
            }
            let last_seq = seq.saturating_sub(1);
            let (response, stored) = fresh_response(m, first, last_seq);
            write_in(tx, rec, Ok(()))?;
            crate::notify::client(tx, &view.client_id, Some(&m.issue))?;
            mutations::record(
                tx,
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
            Ok(StdinOutcome {
                response,
                replayed: false,
                client_id: view.client_id,
                lifecycle: view.lifecycle,
            })
        })?;
        if !outcome.replayed {
            tracing::info!(method = m.method, bytes = new_bytes, "stdin recorded");
        }
        Ok(outcome)
    }
}

/// The store's caller type from the port's.
pub(crate) fn operator(caller: &Caller) -> rvbox_store::operator::Caller {
    rvbox_store::operator::Caller {
        transport: caller.transport.clone(),
        principal: caller.principal.clone(),
    }
}
