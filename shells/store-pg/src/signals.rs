//! `SignalCommand` on PostgreSQL (as `rvbox_store::signals`): idempotent
//! by `request_id`, the dispatch core's signal rule applied to the command
//! as the transaction reads it (row locked), the higher revision and the
//! pending signal, or the cancellation of a queued command, with the audit
//! record, in one transaction.

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::audit::AuditRecord;
use rvbox_store::incidents::detail_to_error;
use rvbox_store::mutations::{Assigned, Owner, Stored};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::signals::{SignalOutcome, SignalPlan};

use crate::audit::write_in;
use crate::commands::{finish_in, load_view};
use crate::sessions::to_i64;
use crate::{Fail, PgStore, mutations};

fn uuid_text(b: &[u8; 16]) -> String {
    Uuid7::from_bytes("issue_uuid", *b)
        .map(|u| u.to_string())
        .unwrap_or_default()
}

/// Raises the command's revision by one and, with `kind`, records the
/// signal as pending at the new revision (one pending row per kind);
/// returns the new revision.
pub(crate) fn raise_revision(
    tx: &mut Transaction<'_>,
    view: &CommandView,
    kind: Option<wire::SignalKind>,
    now_ms: i64,
) -> Result<u64, Fail> {
    let issue = view.issue_uuid;
    let next = view
        .revision
        .checked_add(1)
        .ok_or_else(|| Fail::Integrity("revision overflow".into()))?;
    crate::prep::execute(
        tx,
        "UPDATE commands SET revision = $2 WHERE issue_uuid = $1",
        &[&issue.as_slice(), &to_i64(next)],
    )
    .map_err(Fail::db("raise revision"))?;
    if let Some(kind) = kind {
        crate::prep::execute(
            tx,
            "INSERT INTO command_signals (issue_uuid, signal, revision, created_ms)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (issue_uuid, signal) DO UPDATE
                 SET revision = excluded.revision, created_ms = excluded.created_ms",
            &[
                &issue.as_slice(),
                &i64::from(kind as i32),
                &to_i64(next),
                &now_ms,
            ],
        )
        .map_err(Fail::db("record pending signal"))?;
    }
    Ok(next)
}

impl PgStore {
    /// `SignalCommand`, audited with `caller`: in the signal's own
    /// transaction, or on its own after a refusal or a replay.
    pub(crate) fn signal_command(
        &mut self,
        req: &wire::SignalCommandRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<SignalOutcome, Fail> {
        let caller = rvbox_store::operator::Caller {
            transport: caller.transport.clone(),
            principal: caller.principal.clone(),
        };
        let mut rec = AuditRecord::control(&caller, "SignalCommand", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        rec.detail = wire::SignalKind::try_from(req.signal)
            .map(|k| k.as_str_name().to_owned())
            .unwrap_or_default();
        let result = self.signal_command_in(req, &rec, now_ms);
        if !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        result
    }

    fn signal_command_in(
        &mut self,
        req: &wire::SignalCommandRequest,
        rec: &AuditRecord,
        now_ms: i64,
    ) -> Result<SignalOutcome, Fail> {
        let request_id = Uuid7::parse("request_id", &req.request_id).map_err(DomainError::from)?;
        let issue = *Uuid7::parse("issue_uuid", &req.issue_uuid)
            .map_err(DomainError::from)?
            .as_bytes();
        let kind = match wire::SignalKind::try_from(req.signal) {
            Ok(wire::SignalKind::Unspecified) => {
                return Err(
                    DomainError::new(Code::InvalidArgument, "signal must be set")
                        .with_field("signal")
                        .into(),
                );
            }
            Err(_) => {
                return Err(DomainError::new(
                    Code::InvalidArgument,
                    format!(
                        "signal {} is not a known signal kind (HUP, INT, TERM, KILL, USR1, USR2)",
                        req.signal
                    ),
                )
                .with_field("signal")
                .into());
            }
            Ok(k) => k,
        };
        let canonical = wire::SignalCommandRequest {
            request_id: String::new(),
            issue_uuid: uuid_text(&issue),
            signal: req.signal,
        };
        let hash = request_hash("SignalCommand", &canonical);
        let outcome = self.in_tx("SignalCommand", |tx, opts| {
            let view = load_view(tx, &issue, true)?;
            let owner = Owner::Command(&issue);
            if let Some(stored) = mutations::lookup(tx, &request_id, "SignalCommand", &hash, owner)?
            {
                return match stored {
                    Ok(bytes) => Ok(SignalOutcome {
                        response: wire::SignalCommandResponse::decode(bytes.as_slice()).map_err(
                            |_| Fail::Integrity("stored signal response does not decode".into()),
                        )?,
                        deliver: None,
                        replayed: true,
                        client_id: view.client_id,
                    }),
                    Err(detail) => Err(Fail::Refused(detail_to_error(&detail))),
                };
            }
            let plan = rvbox_server_core::signal_plan(&view, req.signal)?;
            let next = view
                .revision
                .checked_add(1)
                .ok_or_else(|| Fail::Integrity("revision overflow".into()))?;
            let (lifecycle, deliver) = match plan {
                SignalPlan::CancelQueued => {
                    if view.lifecycle != Lifecycle::Queued {
                        return Err(Fail::refused(
                            Code::Conflict,
                            "only a queued command is cancelled by the server",
                        ));
                    }
                    raise_revision(tx, &view, None, now_ms)?;
                    finish_in(
                        tx,
                        &view,
                        Lifecycle::Cancelled,
                        None,
                        now_ms,
                        opts.tombstone_cap,
                    )?;
                    (Lifecycle::Cancelled, None)
                }
                SignalPlan::Deliver => {
                    if view.lifecycle.is_terminal() || view.lifecycle == Lifecycle::Queued {
                        return Err(Fail::refused(
                            Code::Conflict,
                            "a signal is delivered only to work the client may hold",
                        ));
                    }
                    raise_revision(tx, &view, Some(kind), now_ms)?;
                    let frame = wire::Signal {
                        issue_uuid: uuid_text(&issue),
                        revision: next,
                        signal: kind as i32,
                    };
                    (view.lifecycle, Some(frame))
                }
            };
            let response = wire::SignalCommandResponse {
                issue_uuid: uuid_text(&issue),
                revision: next,
                lifecycle: lifecycle.to_wire() as i32,
            };
            let stored: Stored = Ok(response.encode_to_vec());
            write_in(tx, rec, Ok(()))?;
            if deliver.is_some() {
                crate::notify::client(tx, &view.client_id, Some(&issue))?;
            }
            mutations::record(
                tx,
                &request_id,
                "SignalCommand",
                &hash,
                owner,
                &stored,
                Assigned {
                    write_seq: None,
                    revision: Some(next),
                },
                now_ms,
            )?;
            Ok(SignalOutcome {
                response,
                deliver,
                replayed: false,
                client_id: view.client_id,
            })
        })?;
        if !outcome.replayed {
            tracing::info!(
                signal = kind.as_str_name(),
                revision = outcome.response.revision,
                "signal recorded"
            );
        }
        Ok(outcome)
    }
}
