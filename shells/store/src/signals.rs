//! Signals decided by the server (plan §6.4, R-6.4-35..38, R-6.4-11).
//!
//! `SignalCommand` is an operator mutation, idempotent by `request_id`: the
//! lookup, the decision (taken by the dispatch core on the command as this
//! transaction reads it), the higher revision, the pending signal and the
//! stored response commit together. A replay returns the stored response;
//! the control `request_id` never reaches the agent protocol, only the
//! revision it was given does.
//!
//! A signal for work the client may hold is kept in `command_signals` until
//! the command ends, so it can be sent again after a reconnect or a
//! re-delivery: a partition between the decision and the frame never loses
//! a kill. Delivery is at least once; the client ignores a revision it has
//! already handled.

use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{Transaction, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;

use crate::commands::CommandView;
use crate::error::StoreError;
use crate::incidents::NewIncident;
use crate::mutations::{self, Assigned, OpError, Owner, Stored};
use crate::store::{Store, to_i64, to_u64};

/// Most pending signals one command holds: one per signal kind (a newer
/// signal of a kind replaces the older, as pending POSIX signals coalesce).
pub const MAX_PENDING_SIGNALS: u64 = 6;

pub use rvbox_store_port::signals::{SignalOutcome, SignalPlan};

fn uuid_text(b: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*b).hyphenated().to_string()
}

/// Raises the revision from `view.revision` by one and, for a delivered
/// signal, keeps it pending; inside the caller's transaction.
pub(crate) fn raise_revision(
    tx: &Transaction<'_>,
    view: &CommandView,
    signal: Option<wire::SignalKind>,
    now_ms: i64,
) -> Result<u64, OpError> {
    let next = view
        .revision
        .checked_add(1)
        .ok_or_else(|| StoreError::Integrity("revision overflow".into()))?;
    tx.execute_cached(
        "UPDATE commands SET revision = ?2 WHERE issue_uuid = ?1",
        params![view.issue_uuid.as_slice(), to_i64(next)],
    )
    .map_err(|e| StoreError::sqlite("raise revision", e))?;
    if let Some(kind) = signal {
        tx.execute_cached(
            "INSERT INTO command_signals (issue_uuid, signal, revision, created_ms)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (issue_uuid, signal) DO UPDATE
                 SET revision = excluded.revision, created_ms = excluded.created_ms",
            params![
                view.issue_uuid.as_slice(),
                kind as i32,
                to_i64(next),
                now_ms
            ],
        )
        .map_err(|e| StoreError::sqlite("record pending signal", e))?;
    }
    Ok(next)
}

impl Store {
    /// `SignalCommand` (plan §6.4, R-6.4-35..38), idempotent by
    /// `request_id`. `decide` is the dispatch core's decision on the
    /// command as this transaction reads it.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a malformed id or signal, `NOT_FOUND`,
    /// `CONFLICT` for a `request_id` used for another request, the
    /// decision's refusal (e.g. `FAILED_PRECONDITION` for a terminal
    /// command), `UNAVAILABLE`, or a store failure.
    pub fn signal_command(
        &mut self,
        req: &wire::SignalCommandRequest,
        decide: impl FnOnce(&CommandView) -> Result<SignalPlan, DomainError>,
        now_ms: i64,
    ) -> Result<SignalOutcome, OpError> {
        self.signal_command_as(req, &crate::operator::Caller::local(), decide, now_ms)
    }

    /// [`Store::signal_command`] for a named caller: its audit record
    /// commits in the signal's own transaction; a refusal or a replay is
    /// audited on its own.
    ///
    /// # Errors
    /// As [`Store::signal_command`].
    pub fn signal_command_as(
        &mut self,
        req: &wire::SignalCommandRequest,
        caller: &crate::operator::Caller,
        decide: impl FnOnce(&CommandView) -> Result<SignalPlan, DomainError>,
        now_ms: i64,
    ) -> Result<SignalOutcome, OpError> {
        let mut rec = crate::audit::AuditRecord::control(caller, "SignalCommand", now_ms);
        rec.issue_uuid = Uuid7::parse("issue_uuid", &req.issue_uuid)
            .ok()
            .map(|u| *u.as_bytes());
        rec.detail = wire::SignalKind::try_from(req.signal)
            .map(|k| k.as_str_name().to_owned())
            .unwrap_or_default();
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = self.signal_command_in(req, decide, &mut intent, now_ms);
        self.audit_unwritten(&mut intent, &result, now_ms);
        result
    }

    fn signal_command_in(
        &mut self,
        req: &wire::SignalCommandRequest,
        decide: impl FnOnce(&CommandView) -> Result<SignalPlan, DomainError>,
        intent: &mut crate::audit::AuditIntent,
        now_ms: i64,
    ) -> Result<SignalOutcome, OpError> {
        let request_id = Uuid7::parse("request_id", &req.request_id).map_err(DomainError::from)?;
        let issue = *Uuid7::parse("issue_uuid", &req.issue_uuid)
            .map_err(DomainError::from)?
            .as_bytes();
        let kind = match wire::SignalKind::try_from(req.signal) {
            Ok(wire::SignalKind::Unspecified) => {
                return Err(OpError::Refused(
                    DomainError::new(Code::InvalidArgument, "signal must be set")
                        .with_field("signal"),
                ));
            }
            Err(_) => {
                return Err(OpError::Refused(
                    DomainError::new(
                        Code::InvalidArgument,
                        format!(
                            "signal {} is not a known signal kind (HUP, INT, TERM, KILL, USR1, USR2)",
                            req.signal
                        ),
                    )
                    .with_field("signal"),
                ));
            }
            Ok(k) => k,
        };
        let canonical = wire::SignalCommandRequest {
            request_id: String::new(),
            issue_uuid: uuid_text(&issue),
            signal: req.signal,
        };
        let hash = request_hash("SignalCommand", &canonical);
        let owner = Owner::Command(&issue);
        let cap = self.opts.tombstone_cap;
        let (tx, view) = self.begin_on(&issue)?;
        if let Some(stored) = mutations::lookup(&tx, &request_id, "SignalCommand", &hash, owner)? {
            return match stored {
                Ok(bytes) => {
                    let response =
                        wire::SignalCommandResponse::decode(bytes.as_slice()).map_err(|_| {
                            StoreError::Integrity("stored signal response does not decode".into())
                        })?;
                    Ok(SignalOutcome {
                        response,
                        deliver: None,
                        replayed: true,
                        client_id: view.client_id,
                    })
                }
                Err(detail) => Err(OpError::Refused(crate::incidents::detail_to_error(&detail))),
            };
        }
        let plan = decide(&view).map_err(OpError::Refused)?;
        let (revision, lifecycle, deliver) = match plan {
            SignalPlan::CancelQueued => {
                if view.lifecycle != Lifecycle::Queued {
                    return Err(OpError::Refused(DomainError::new(
                        Code::Conflict,
                        "only a queued command is cancelled by the server",
                    )));
                }
                let next = raise_revision(&tx, &view, None, now_ms)?;
                crate::commands::finish_in(
                    &tx,
                    &issue,
                    &view,
                    Lifecycle::Cancelled,
                    None,
                    now_ms,
                    cap,
                )?;
                (next, Lifecycle::Cancelled, None)
            }
            SignalPlan::Deliver => {
                if view.lifecycle.is_terminal() || view.lifecycle == Lifecycle::Queued {
                    return Err(OpError::Refused(DomainError::new(
                        Code::Conflict,
                        "a signal is delivered only to work the client may hold",
                    )));
                }
                let next = raise_revision(&tx, &view, Some(kind), now_ms)?;
                let frame = wire::Signal {
                    issue_uuid: uuid_text(&issue),
                    revision: next,
                    signal: kind as i32,
                };
                (next, view.lifecycle, Some(frame))
            }
        };
        let response = wire::SignalCommandResponse {
            issue_uuid: uuid_text(&issue),
            revision,
            lifecycle: lifecycle.to_wire() as i32,
        };
        let stored: Stored = Ok(response.encode_to_vec());
        intent.write_in(&tx, Ok(()))?;
        mutations::record(
            &tx,
            &request_id,
            "SignalCommand",
            &hash,
            owner,
            &stored,
            Assigned {
                write_seq: None,
                revision: Some(revision),
            },
            now_ms,
        )?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit signal", e))?;
        self.hook.at(crate::crash::points::SIGNAL_AFTER_COMMIT);
        if lifecycle == Lifecycle::Cancelled {
            self.metrics.command_transition(lifecycle.as_str());
        } else {
            self.metrics.signals_recorded.inc();
        }
        tracing::info!(
            signal = kind.as_str_name(),
            revision,
            to = lifecycle.as_str(),
            "signal recorded"
        );
        Ok(SignalOutcome {
            response,
            deliver,
            replayed: false,
            client_id: view.client_id,
        })
    }

    /// A late acceptance (plan §6.4, R-6.4-11): dispatched -> accepted at
    /// `revision`, the late-after-expiry incident, the next (termination)
    /// revision and the pending TERM, all in one transaction, so a crash
    /// never leaves late work accepted without its termination. Returns
    /// the Signal to send.
    ///
    /// # Errors
    /// `CONFLICT` when the command is not dispatched at `revision`,
    /// `NOT_FOUND`, `UNAVAILABLE`, or a store failure.
    pub fn accept_late(
        &mut self,
        session: Option<crate::sessions::SessionFence>,
        issue: &[u8; 16],
        revision: u64,
        resolved_shell: i32,
        incident: &NewIncident,
        now_ms: i64,
    ) -> Result<wire::Signal, OpError> {
        let id = crate::entropy::uuid_v7(self.entropy.as_ref(), now_ms)
            .map_err(|e| StoreError::io("mint incident id", "", e))?;
        let (tx, view) = self.begin_for(session, issue)?;
        crate::commands::accept_in(&tx, &view, revision, resolved_shell)?;
        let next = raise_revision(&tx, &view, Some(wire::SignalKind::Term), now_ms)?;
        crate::incidents::insert(&tx, id, incident, now_ms)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit late acceptance", e))?;
        self.hook.at(crate::crash::points::ACCEPT_LATE_AFTER_COMMIT);
        self.metrics.command_transition("accepted");
        self.metrics
            .incidents
            .get_or_create(&crate::metrics::KindLabel {
                kind: incident.kind.as_str_name(),
            })
            .inc();
        self.metrics.signals_recorded.inc();
        self.health.refresh(&self.conn)?;
        tracing::warn!(
            revision = next,
            "late acceptance: accepted and termination recorded"
        );
        Ok(wire::Signal {
            issue_uuid: uuid_text(issue),
            revision: next,
            signal: wire::SignalKind::Term as i32,
        })
    }

    /// The signals still to be resolved for a command that has not ended,
    /// oldest first (at most [`MAX_PENDING_SIGNALS`]); empty once it ended.
    ///
    /// # Errors
    /// A store failure.
    pub fn pending_signals(&self, issue: &[u8; 16]) -> Result<Vec<wire::Signal>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT s.revision, s.signal FROM command_signals s
                 JOIN commands c ON c.issue_uuid = s.issue_uuid
                 WHERE s.issue_uuid = ?1 AND c.lifecycle < 5
                 ORDER BY s.revision LIMIT ?2",
            )
            .map_err(|e| StoreError::sqlite("prepare pending signals", e))?;
        let rows = stmt
            .query_map(
                params![issue.as_slice(), to_i64(MAX_PENDING_SIGNALS)],
                |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i32>(1)?)),
            )
            .map_err(|e| StoreError::sqlite("read pending signals", e))?;
        let text = uuid_text(issue);
        let mut out = Vec::new();
        for row in rows {
            let (revision, signal) =
                row.map_err(|e| StoreError::sqlite("read pending signal", e))?;
            out.push(wire::Signal {
                issue_uuid: text.clone(),
                revision: to_u64(revision),
                signal,
            });
        }
        Ok(out)
    }
}
