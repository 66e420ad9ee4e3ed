//! Acceptance (plan §6.4): a `CommandAccepted` for a command in flight on
//! the session is classified by the dispatch core, the shadow slot is
//! settled at once (a repeated answer finds nothing in flight), the
//! command's current revision is read (a signal decided while it was in
//! flight raised it), and the decision's write follows. Pending signals
//! and the script upload start only after a positive acceptance commits.

use rvbox_dispatch::{AcceptDecision, DispatchedCommand, classify_acceptance};
use rvbox_domain::error::Code;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store_port::commands::ServerTerminal;
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore, signals};

#[derive(Debug)]
pub(crate) enum Pending {
    /// The command's current revision, for the decision's write.
    View {
        conn: ConnId,
        client: String,
        dispatched: DispatchedCommand,
        decision: Box<AcceptDecision>,
        resolved_shell: i32,
    },
    /// The decision's write.
    Write {
        conn: ConnId,
        client: String,
        issue: Uuid7,
        then: After,
    },
}

/// What follows a committed acceptance write.
#[derive(Debug, Clone, Copy)]
pub(crate) enum After {
    /// Accepted: pending signals go, the script upload starts.
    Accepted,
    /// A transient answer past the TTL: a requeued command then expires.
    ExpireIfQueued { revision: u64 },
    /// Nothing.
    Nothing,
}

impl ServerCore {
    pub(crate) fn accepted(&mut self, conn: ConnId, issue: Uuid7, message: &wire::CommandAccepted) {
        let Some(client) = self.client_of(conn) else {
            return;
        };
        let Some(dispatched) = self
            .clients
            .get(&client)
            .and_then(|st| st.in_flight.get(&issue).copied())
        else {
            // not dispatched on this session: a late or foreign answer
            tracing::warn!(issue_uuid = %issue, "CommandAccepted for a command not in flight");
            return;
        };
        // jitter only spreads retries; without randomness they are not spread
        let random = self.random_u64().unwrap_or(0);
        let decision =
            match classify_acceptance(&dispatched, message, self.wall_ms, random, &self.retry) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(error = %e, "CommandAccepted refused");
                    self.close(conn, wire::CloseReason::ProtocolError);
                    return;
                }
            };
        if let Some(st) = self.clients.get_mut(&client) {
            st.capacity.settle(issue, decision.shadow());
            st.in_flight.remove(&issue);
            // no dispatch turn sends it again before its answer's write
            // is done (the candidates would still show it dispatched)
            st.dispatching.insert(issue);
            self.barrier.insert(issue);
            if let AcceptDecision::Requeue(r) = &decision {
                st.backoff
                    .insert(issue, (r.not_before_wall_ms, r.transient_rejections));
                st.wake_wall_ms = Some(
                    st.wake_wall_ms
                        .map_or(r.not_before_wall_ms, |w| w.min(r.not_before_wall_ms)),
                );
            }
        }
        let issued = self.store(
            StoreOp::CommandView {
                issue: *issue.as_bytes(),
            },
            Any::Accept(Pending::View {
                conn,
                client: client.clone(),
                dispatched,
                decision: Box::new(decision),
                resolved_shell: message.resolved_shell,
            }),
        );
        if !issued {
            self.unblock(&client, issue);
        }
    }

    /// The acceptance of `issue` is no longer being written: dispatch turns
    /// and the command's events go on.
    fn unblock(&mut self, client: &str, issue: Uuid7) {
        if let Some(st) = self.clients.get_mut(client) {
            st.dispatching.remove(&issue);
        }
        self.barrier.remove(&issue);
        self.mark_ready(client);
    }

    pub(crate) fn accept_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::View {
                conn,
                client,
                dispatched,
                decision,
                resolved_shell,
            } => {
                // a signal decided while the command was in flight raised
                // the stored revision; the acceptance answers the dispatch
                // either way
                let revision = match result {
                    Ok(Completion::View(v)) if v.lifecycle == Lifecycle::Dispatched => v.revision,
                    _ => dispatched.state.revision().0,
                };
                self.write_decision(
                    conn,
                    &client,
                    dispatched.issue,
                    revision,
                    &decision,
                    resolved_shell,
                );
            }
            Pending::Write {
                conn,
                client,
                issue,
                then,
            } => {
                // freed capacity, or a requeued command after its backoff
                self.unblock(&client, issue);
                let result = match result {
                    // already applied (a repeat across a reconnect)
                    Err(PortError::Refused(e)) if e.code() == Code::Conflict => {
                        Ok(Completion::Done)
                    }
                    other => other,
                };
                match (result, then) {
                    (Ok(_), After::Accepted) => {
                        let id = *issue.as_bytes();
                        // every signal still pending for it, a late TERM
                        // included: the client ignores revisions it has seen
                        self.store(
                            StoreOp::PendingSignals { issues: vec![id] },
                            Any::Signal(signals::Pending::Resend { conn }),
                        );
                        self.start_upload(conn, issue, 0);
                    }
                    (
                        Ok(Completion::Requeued(Lifecycle::Queued)),
                        After::ExpireIfQueued { revision },
                    ) => {
                        self.store(
                            StoreOp::FinishByServer {
                                issue: *issue.as_bytes(),
                                from: vec![Lifecycle::Queued],
                                revision,
                                how: ServerTerminal::Expired,
                                rejection: None,
                                session: None,
                            },
                            Any::Background("expire after a transient answer"),
                        );
                    }
                    // signalled meanwhile: it ended cancelled instead
                    (Ok(_), _) => {}
                    (Err(e), _) => {
                        self.stats.stale_decisions += 1;
                        tracing::warn!(error = %e, "acceptance not applied");
                    }
                }
            }
        }
    }

    fn write_decision(
        &mut self,
        conn: ConnId,
        client: &str,
        issue: Uuid7,
        revision: u64,
        decision: &AcceptDecision,
        resolved_shell: i32,
    ) {
        let id = *issue.as_bytes();
        let Some(session) = self.fence_of(conn) else {
            // the connection is gone: its client's next session reconciles
            self.unblock(client, issue);
            return;
        };
        let (op, then) = match decision {
            AcceptDecision::Accept(acc) => {
                self.stats.accepted += 1;
                match &acc.incident {
                    // plan §6.4: a late acceptance after the TTL passed: the
                    // acceptance, the incident and a higher termination
                    // revision are durable together before the TERM is sent
                    Some(late) => {
                        self.stats.late_acceptances += 1;
                        let incident = NewIncident {
                            kind: late.kind,
                            scope_kind: wire::ScopeKind::Command,
                            scope_key: issue.to_string(),
                            client_id: Some(client.to_owned()),
                            issue_uuid: Some(id),
                            summary: format!(
                                "accepted after its queue expiry ({} ms) while dispatched; terminated",
                                late.queue_expiry_ms
                            ),
                            evidence: Vec::new(),
                            data_loss: false,
                        };
                        (
                            StoreOp::AcceptLate {
                                issue: id,
                                revision,
                                resolved_shell,
                                incident,
                                session,
                            },
                            After::Accepted,
                        )
                    }
                    None => (
                        StoreOp::RecordAccepted {
                            issue: id,
                            revision,
                            resolved_shell,
                            session,
                        },
                        After::Accepted,
                    ),
                }
            }
            AcceptDecision::Repeat => (
                StoreOp::RecordAccepted {
                    issue: id,
                    revision,
                    resolved_shell,
                    session,
                },
                After::Accepted,
            ),
            AcceptDecision::Requeue(_) => {
                self.stats.requeued += 1;
                (
                    StoreOp::Requeue {
                        issue: id,
                        revision,
                        session,
                    },
                    After::Nothing,
                )
            }
            AcceptDecision::Expire(_) => {
                self.stats.expired += 1;
                (
                    StoreOp::Requeue {
                        issue: id,
                        revision,
                        session,
                    },
                    After::ExpireIfQueued { revision },
                )
            }
            AcceptDecision::AlreadyExecuted(r) => {
                self.stats.already_executed += 1;
                tracing::warn!(
                    client = %client,
                    issue_uuid = %issue,
                    reason = %r.detail.reason,
                    "the client already executed a command this server dispatched: ended interrupted"
                );
                (
                    StoreOp::FinishByServer {
                        issue: id,
                        from: vec![Lifecycle::Dispatched],
                        revision,
                        how: ServerTerminal::Interrupted,
                        rejection: Some(already_executed_detail(r.detail.clone())),
                        session: Some(session),
                    },
                    After::Nothing,
                )
            }
            AcceptDecision::Reject(r) => {
                self.stats.rejected += 1;
                (
                    StoreOp::FinishByServer {
                        issue: id,
                        from: vec![Lifecycle::Dispatched],
                        revision,
                        how: ServerTerminal::Rejected,
                        rejection: Some(r.detail.clone()),
                        session: Some(session),
                    },
                    After::Nothing,
                )
            }
        };
        let issued = self.store(
            op,
            Any::Accept(Pending::Write {
                conn,
                client: client.to_owned(),
                issue,
                then,
            }),
        );
        if !issued {
            self.unblock(client, issue);
        }
    }
}

/// The detail kept on a command its client already executed: the
/// client's words, and what they mean here.
fn already_executed_detail(mut d: wire::ErrorDetail) -> wire::ErrorDetail {
    d.reason = rvbox_domain::error::bound_reason(&format!(
        "the client already executed this command ({}); this server does not have its end, as when the server's store is older than the client's (a restore from backup): it is not run again",
        d.reason
    ));
    d
}
