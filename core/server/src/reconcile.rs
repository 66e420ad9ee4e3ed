//! Reconciliation rounds (plan §6.4): the client's non-terminal rows are
//! read, the request is sent, the snapshot assembled, what the server
//! knows of the rest is read, the matrix decides, every decision and
//! incident commits in one operation, and only then is the
//! `ReconcileResult` sent, pending signals sent again, uploads resumed and
//! the client made ready for dispatch.

use std::collections::BTreeMap;

use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Phase;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_reconcile::{
    Action, Assembly, CompleteSnapshot, Outcome, ReconcileError, ServerCommand, SnapshotAssembler,
    Source, build_request, reconcile,
};
use rvbox_session::Input as SessionInput;
use rvbox_store_port::commands::ReconcileWrite;
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};

/// Rounds in a row a session may restart because their decisions met
/// changed rows before it is closed (`STORAGE_UNAVAILABLE`): the rows of
/// an honest client change only as fast as operators act on them.
pub const MAX_STALE_ROUNDS: u32 = 4;

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore, convert, signals};

#[derive(Debug)]
pub(crate) enum Pending {
    /// The client's non-terminal rows, for a new round.
    Rows { conn: ConnId, generation: u64 },
    /// What the server knows of commands outside those rows.
    Knowledge {
        conn: ConnId,
        round: u64,
        snapshot: Box<CompleteSnapshot>,
    },
    /// The round's decisions.
    Apply {
        conn: ConnId,
        round: u64,
        outcome: Box<Outcome>,
    },
}

/// The store writes of a round's decisions.
fn writes_of(outcome: &Outcome, rows: &[ServerCommand]) -> Vec<ReconcileWrite> {
    let mut writes = Vec::new();
    for a in outcome.actions() {
        let Some(row) = rows.iter().find(|r| r.issue_uuid == a.issue_uuid) else {
            continue;
        };
        let issue = *a.issue_uuid.as_bytes();
        let revision = row.revision.0;
        match a.action {
            Action::Requeue {
                from: Phase::Dispatched,
            } => writes.push(ReconcileWrite::Requeue { issue, revision }),
            Action::Requeue { .. } => {}
            Action::Keep {
                advance_to, lost, ..
            } => {
                if let Some(to) = advance_to
                    && to != row.phase.lifecycle()
                {
                    writes.push(ReconcileWrite::Advance {
                        issue,
                        revision,
                        to,
                    });
                }
                if let Some(l) = lost {
                    writes.push(ReconcileWrite::LostEvents {
                        issue,
                        revision,
                        first_event_seq: l.first_event_seq,
                        last_event_seq: l.last_event_seq,
                    });
                }
            }
            Action::Interrupt { .. } => {
                writes.push(ReconcileWrite::Interrupt { issue, revision });
            }
        }
    }
    writes
}

impl ServerCore {
    fn round_conn(&self, conn: ConnId, round: u64) -> bool {
        self.conns.get(&conn).is_some_and(|c| c.round == round)
    }

    pub(crate) fn reconcile_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Rows { conn, generation } => {
                if self
                    .conns
                    .get(&conn)
                    .is_none_or(|c| c.generation != generation)
                {
                    return;
                }
                match result {
                    Ok(Completion::Commands(rows)) => self.start_round(conn, &rows),
                    Ok(_) => {
                        self.mismatch("non_terminal_commands");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "reconciliation rows not readable");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                }
            }
            Pending::Knowledge {
                conn,
                round,
                snapshot,
            } => {
                if !self.round_conn(conn, round) {
                    return;
                }
                match result {
                    Ok(Completion::Knowledge(k)) => {
                        let mut known = BTreeMap::new();
                        for (issue, k) in k {
                            if let Ok(id) = Uuid7::from_bytes("issue_uuid", issue) {
                                known.insert(id, convert::knowledge(&k));
                            }
                        }
                        self.decide_round(conn, round, &snapshot, &known);
                    }
                    Ok(_) => {
                        self.mismatch("knowledge");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "command knowledge not readable");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                }
            }
            Pending::Apply {
                conn,
                round,
                outcome,
            } => {
                if !self.round_conn(conn, round) {
                    return;
                }
                match result {
                    Ok(Completion::Done) => self.round_written(conn, &outcome),
                    Ok(_) => {
                        self.mismatch("apply_reconciliation");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                    Err(PortError::Refused(e))
                        if self
                            .conns
                            .get(&conn)
                            .is_some_and(|c| c.stale_rounds < MAX_STALE_ROUNDS) =>
                    {
                        // nothing was written: the rows changed since the
                        // request (a signal raised a revision, a command
                        // ended); a new round starts from the state as it
                        // is now
                        self.stats.stale_decisions += 1;
                        self.stats.rounds_restarted += 1;
                        tracing::info!(error = %e, "reconciliation decided on stale rows; a new round starts");
                        let generation = self.conns.get_mut(&conn).map_or(0, |c| {
                            c.stale_rounds += 1;
                            c.generation
                        });
                        if let Some(client) = self.client_of(conn) {
                            self.store(
                                StoreOp::NonTerminalCommands { client_id: client },
                                Any::Reconcile(Pending::Rows { conn, generation }),
                            );
                        }
                    }
                    Err(e) => {
                        // nothing was written; the client reconnects and a
                        // new round starts from the state as it is now
                        self.stats.stale_decisions += 1;
                        tracing::warn!(error = %e, "reconciliation not applied");
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                    }
                }
            }
        }
    }

    /// Sends a `ReconcileRequest` listing every non-terminal command.
    fn start_round(&mut self, conn: ConnId, rows: &[rvbox_store_port::commands::CommandView]) {
        let rows: Vec<ServerCommand> = rows.iter().filter_map(convert::server_command).collect();
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.round = c.round.saturating_add(1);
        match build_request(c.round, &rows) {
            Ok(req) => {
                c.assembler = Some(SnapshotAssembler::new(c.round));
                c.rows = rows;
                if !self.send(conn, Payload::ReconcileRequest(req)) {
                    tracing::error!("reconcile request not sent");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "reconcile request not built");
                self.close(conn, wire::CloseReason::InternalError);
            }
        }
    }

    /// A `ClientSnapshot` chunk.
    pub(crate) fn snapshot(&mut self, conn: ConnId, chunk: &wire::ClientSnapshot) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(asm) = c.assembler.take() else {
            tracing::warn!("snapshot chunk with no round open");
            self.close(conn, wire::CloseReason::ProtocolError);
            return;
        };
        let complete = match asm.push(chunk) {
            Ok(Assembly::Incomplete(next)) => {
                c.assembler = Some(next);
                return;
            }
            Ok(Assembly::Complete(s)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "snapshot chunk refused");
                self.stats.reconcile_refused += 1;
                self.close(conn, wire::CloseReason::ProtocolError);
                return;
            }
        };
        let round = c.round;
        let lookups: Vec<[u8; 16]> = complete
            .lookups_needed(&c.rows)
            .iter()
            .map(|i| *i.as_bytes())
            .collect();
        if lookups.is_empty() {
            self.decide_round(conn, round, &complete, &BTreeMap::new());
        } else {
            self.store(
                StoreOp::Knowledge { issues: lookups },
                Any::Reconcile(Pending::Knowledge {
                    conn,
                    round,
                    snapshot: Box::new(complete),
                }),
            );
        }
    }

    fn decide_round(
        &mut self,
        conn: ConnId,
        round: u64,
        snapshot: &CompleteSnapshot,
        known: &BTreeMap<Uuid7, rvbox_reconcile::ServerKnown>,
    ) {
        let (Some(c), Some(client)) = (self.conns.get(&conn), self.client_of(conn)) else {
            return;
        };
        let Some(session_id) = c.session_key else {
            return;
        };
        let outcome = match reconcile(round, &c.rows, known, snapshot) {
            Ok(o) => o,
            Err(e) => {
                self.stats.reconcile_refused += 1;
                self.refuse_snapshot(conn, &e);
                return;
            }
        };
        // plan §6.4: every decision durable, in one transaction, before
        // the result is sent
        let writes = writes_of(&outcome, &c.rows);
        let incidents: Vec<NewIncident> = outcome
            .incidents()
            .iter()
            .map(|i| NewIncident {
                kind: i.kind,
                scope_kind: wire::ScopeKind::Command,
                scope_key: i.issue_uuid.to_string(),
                client_id: Some(client.clone()),
                issue_uuid: Some(*i.issue_uuid.as_bytes()),
                summary: i.summary.clone(),
                evidence: Vec::new(),
                data_loss: i.data_loss,
            })
            .collect();
        for a in outcome.actions() {
            if let Action::Keep { lost: Some(l), .. } = a.action {
                self.stats.events_lost_at_reconcile += 1;
                tracing::error!(
                    client_id = %client,
                    issue_uuid = %a.issue_uuid,
                    first_event_seq = l.first_event_seq,
                    last_event_seq = l.last_event_seq,
                    "the client had events acknowledged that the store no longer holds; they are recorded as lost"
                );
            }
        }
        self.store(
            StoreOp::ApplyReconciliation {
                client_id: client,
                session: rvbox_store_port::sessions::SessionFence { session_id },
                writes,
                incidents,
            },
            Any::Reconcile(Pending::Apply {
                conn,
                round,
                outcome: Box::new(outcome),
            }),
        );
    }

    fn round_written(&mut self, conn: ConnId, outcome: &Outcome) {
        self.stats.reconciled += 1;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.stale_rounds = 0;
        }
        let Some(client) = self.client_of(conn) else {
            return;
        };
        self.session_input(
            conn,
            SessionInput::ReconcileWritten(outcome.result().clone()),
        );
        // plan §6.4: a signal decided while the client was away (or whose
        // frame was lost with the connection) goes again, after the result
        let kept: Vec<[u8; 16]> = outcome
            .actions()
            .iter()
            .filter(|a| matches!(a.action, Action::Keep { .. }))
            .map(|a| *a.issue_uuid.as_bytes())
            .collect();
        // stdin still pending goes again from its first write (the client
        // ignores writes it holds)
        for issue in &kept {
            if let Ok(id) = Uuid7::from_bytes("issue_uuid", *issue) {
                self.wake_stdin(conn, id);
            }
        }
        if !kept.is_empty() {
            self.store(
                StoreOp::PendingSignals { issues: kept },
                Any::Signal(signals::Pending::Resend { conn }),
            );
        }
        // and script uploads not yet committed resume from the client's
        // durable prefix
        let rows = self
            .conns
            .get(&conn)
            .map(|c| c.rows.clone())
            .unwrap_or_default();
        for resume in &outcome.result().resume {
            let Ok(issue) = Uuid7::parse("resume.issue_uuid", &resume.issue_uuid) else {
                continue;
            };
            let uploading = rows.iter().any(|r| {
                r.issue_uuid == issue
                    && matches!(
                        r.source,
                        Source::Script {
                            upload_committed: false,
                            ..
                        }
                    )
            });
            if uploading {
                self.start_upload(conn, issue, resume.script_resume_offset);
            }
        }
        if let Some(st) = self.clients.get_mut(&client)
            && st.conn == Some(conn)
        {
            st.ready = true;
        }
        self.mark_ready(&client);
        self.pty_live(conn);
    }

    fn refuse_snapshot(&mut self, conn: ConnId, e: &ReconcileError) {
        tracing::warn!(error = %e, "reconciliation snapshot refused; nothing applied");
        if let ReconcileError::InvalidSnapshot(inv) = e
            && let Some(client) = self.client_of(conn)
        {
            let i = inv.incident();
            let new = NewIncident {
                kind: i.kind,
                scope_kind: wire::ScopeKind::Client,
                scope_key: client.clone(),
                client_id: Some(client),
                issue_uuid: Some(*i.issue_uuid.as_bytes()),
                summary: i.summary,
                evidence: Vec::new(),
                data_loss: false,
            };
            self.store(
                StoreOp::RecordIncident(new),
                Any::Background("contradiction incident"),
            );
        }
        let reason = match e {
            ReconcileError::ClientStoreNotReady { .. } => wire::CloseReason::StorageUnavailable,
            _ => wire::CloseReason::ProtocolError,
        };
        self.close(conn, reason);
    }
}
