//! Store completions and reconciliation: every completion routed to the
//! step that waited for it, the snapshot answered and a `ReconcileResult`
//! applied, and after every input the spool's outputs moved out (events
//! to send, durable terminal events, output that can no longer be
//! accounted for) and capacity reported.

use std::collections::BTreeMap;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;

use super::{ClientCore, LaunchPhase, MAX_TERMINAL_ATTEMPTS, Output, Pending};
use crate::accept::Refusal;
use crate::link::snapshot_chunks;
use crate::ops::{AcceptOutcome, ClientCompletion, ClientOp, StdinOutcome, SuperviseOp, Token};
use crate::process::LaunchFailure;
use crate::spool::SpoolOutput;

/// Why a command whose output could not be recorded ends interrupted.
const UNACCOUNTABLE_REASON: &str =
    "the client could not record the command's output durably; its output is incomplete";

impl ClientCore {
    // ---- completions -------------------------------------------------------

    pub(super) fn completed(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        token: Token,
        result: ClientCompletion,
    ) {
        let Some(pending) = self.pending.remove(&token) else {
            self.stats.stray_completions += 1;
            return;
        };
        if let ClientCompletion::Failed(_) = &result {
            self.stats.store_failures += 1;
        }
        match pending {
            Pending::Accept(d, checked, generation) => {
                let outcome = match result {
                    ClientCompletion::Accepted(o) => o,
                    // plan §7.3 step 4: a failure before the commit is a
                    // transient refusal and leaves no partial command
                    _ => AcceptOutcome::Refused(Refusal::Answer {
                        outcome: wire::AcceptOutcome::Transient,
                        error: DomainError::new(
                            Code::Unavailable,
                            "the client's local store could not record the command; retry later",
                        )
                        .with_retry(rvbox_domain::error::RetryClass::Transient),
                    }),
                };
                self.accepted(&d, &checked, generation, outcome);
            }
            Pending::Spool(st) => {
                let done = match result {
                    ClientCompletion::Spool(c) => c,
                    _ => crate::spool::SpoolCompletion::Failed,
                };
                self.spool.completed(st, done);
            }
            Pending::Generation => {}
            Pending::Tombstones(round) => {
                let tombs = match result {
                    ClientCompletion::Tombstones(t) => t,
                    // without the lookups the snapshot cannot be complete:
                    // leave the session, the next one asks again
                    _ => {
                        self.protocol_error_local(now_ms);
                        return;
                    }
                };
                self.answer_snapshot(round, tombs);
            }
            Pending::Reconcile(checked) => {
                if !matches!(result, ClientCompletion::Done) {
                    self.protocol_error_local(now_ms);
                    return;
                }
                self.apply_reconcile(now_ms, wall_ms, &checked);
            }
            Pending::Materialize(issue) => match result {
                ClientCompletion::Materialized { wrapper_path } => {
                    self.prepare(issue, wrapper_path);
                }
                ClientCompletion::MaterializeRefused(reason) => {
                    self.launch_failed(now_ms, wall_ms, issue, LaunchFailure::Permanent(reason));
                }
                other => {
                    let reason = match other {
                        ClientCompletion::Failed(r) => r,
                        _ => "the wrapper file could not be written".into(),
                    };
                    // a local file failure is transient
                    self.launch_failed(now_ms, wall_ms, issue, LaunchFailure::Transient(reason));
                }
            },
            Pending::Prepared(issue) => {
                if result == ClientCompletion::Done {
                    self.prepared(issue);
                } else {
                    // not durable: the launcher must not run; abort it
                    self.abort(issue);
                }
            }
            Pending::Authorized(issue) => {
                if result == ClientCompletion::Done {
                    if let Some(r) = self.records.get_mut(&issue)
                        && let LaunchPhase::Authorizing(id) = r.phase.clone()
                    {
                        r.phase = LaunchPhase::Released(id);
                        self.stats.launched += 1;
                        self.push(Output::Supervise(SuperviseOp::Release(issue)));
                    }
                } else {
                    self.abort(issue);
                }
            }
            Pending::Running(_) | Pending::Unprepared(_) | Pending::Ended(_) => {}
            Pending::Script(issue, offset, prefix) => {
                self.script_stored(now_ms, wall_ms, issue, offset < prefix, result);
            }
            Pending::Stdin(issue, write_seq, close_after) => {
                if let ClientCompletion::Stdin(StdinOutcome::Stored(bytes)) = result {
                    self.stdin_durable(issue, write_seq, bytes, close_after);
                    return;
                }
                // not durable, so not acknowledged: this write is expected
                // again (and every later one in flight, which the store
                // refuses as out of order), and the session ends so that
                // the server resends from it after reconnecting (stdin was
                // open before it, or it would not have been stored)
                if let Some(r) = self.records.get_mut(&issue)
                    && r.stdin_next > write_seq
                {
                    r.stdin_next = write_seq;
                    r.stdin_closed = false;
                }
                if matches!(result, ClientCompletion::Stdin(StdinOutcome::Invalid(_))) {
                    self.protocol_error(now_ms);
                } else {
                    self.protocol_error_local(now_ms);
                }
            }
            // a failure leaves the written copy until the record goes
            Pending::StdinWritten => {}
            Pending::Finish(issue) => {
                if result == ClientCompletion::Done {
                    self.records.remove(&issue);
                    self.stats.finished += 1;
                }
            }
            p @ (Pending::TermOpening(_)
            | Pending::TermOpened(_)
            | Pending::TermClosed(_)
            | Pending::TermExpire) => self.terminal_completed(p, result),
        }
    }

    /// A local failure that makes the snapshot or its application
    /// impossible: leave the session; the next one starts over.
    fn protocol_error_local(&mut self, now_ms: u64) {
        self.link.protocol_error(now_ms);
    }

    // ---- reconciliation ------------------------------------------------------

    fn answer_snapshot(&mut self, round: u64, tombs: Vec<(Uuid7, [u8; 32])>) {
        let mut records = Vec::with_capacity(self.records.len());
        for (id, r) in &self.records {
            if r.terminate {
                continue;
            }
            let (last, acked) = self.spool.cursors(id).unwrap_or((0, 0));
            records.push(wire::SnapshotRecord {
                issue_uuid: id.to_string(),
                request_hash: r.request_hash.to_vec(),
                revision: r.revision,
                lifecycle: r.lifecycle as i32,
                last_assigned_event_seq: last,
                acked_event_seq: acked,
                script_received_bytes: r.script_received,
            });
        }
        let tombstones = tombs
            .into_iter()
            .map(|(id, hash)| wire::SnapshotTombstone {
                issue_uuid: id.to_string(),
                request_hash: hash.to_vec(),
            })
            .collect();
        let health = self.store_health;
        for r in self.records.values_mut() {
            r.script_reported = r.script_received;
        }
        self.link
            .send_snapshot(round, snapshot_chunks(round, health, records, tombstones));
        self.drain_link_sends();
    }

    fn apply_reconcile(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        checked: &rvbox_reconcile::CheckedResult,
    ) {
        for issue in &checked.terminate {
            self.terminate_here(wall_ms, *issue);
        }
        for issue in &checked.discard {
            self.spool.discard(*issue);
        }
        let mut resume = BTreeMap::new();
        for (issue, r) in &checked.resume {
            if let Some(rec) = self.records.get_mut(issue) {
                rec.revision = rec.revision.max(r.revision.0);
            }
            resume.insert(*issue, r.durable_event_seq);
        }
        self.link.activate(now_ms);
        self.spool.session_active(&resume);
        self.last_capacity = None;
    }

    /// Reconciliation says the server holds no live record: stop the tree
    /// (if any), and send nothing more for the command.
    fn terminate_here(&mut self, _wall_ms: i64, issue: Uuid7) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        r.terminate = true;
        self.spool.mute(issue);
        match r.phase.clone() {
            LaunchPhase::Running(_) | LaunchPhase::Released(_) => {
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind: wire::SignalKind::Kill,
                    revision: 0,
                }));
            }
            LaunchPhase::Prepared(_)
            | LaunchPhase::Preparing
            | LaunchPhase::RecordingPrepared(_)
            | LaunchPhase::Authorizing(_) => self.abort(issue),
            LaunchPhase::Accepted | LaunchPhase::Ended => {
                self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
                self.spool.discard(issue);
            }
            LaunchPhase::Materializing | LaunchPhase::Aborting | LaunchPhase::Reaping { .. } => {}
        }
    }

    // ---- settling: the spool's outputs and capacity -------------------------

    pub(super) fn settle(&mut self, _now_ms: u64, wall_ms: i64) {
        self.drain_spool();
        self.expire_terminals(wall_ms);
        if self.shutting_down {
            return;
        }
        self.schedule();
        self.drain_spool();
        if self.link.is_active() {
            let now = self.capacity();
            if self.last_capacity != Some(now) {
                let report = Payload::ClientCapacity(wire::ClientCapacity {
                    running: now.0,
                    queued: now.1,
                    max_running: self.config.policy.max_running,
                    max_queued: self.config.policy.max_queued,
                });
                if self.link.send(report).is_ok() {
                    self.last_capacity = Some(now);
                    self.drain_link_sends();
                }
            }
        }
    }

    pub(super) fn drain_spool(&mut self) {
        while let Some(o) = self.spool.poll_output() {
            match o {
                SpoolOutput::Store(op) => {
                    let st = op.token();
                    self.store(ClientOp::Spool(op), Pending::Spool(st));
                }
                SpoolOutput::Send {
                    issue,
                    first_seq,
                    last_seq,
                } => self.push_send_events(issue, first_seq, last_seq),
                SpoolOutput::Finished { issue } => {
                    self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
                }
                SpoolOutput::TerminalDurable { issue } => {
                    let lifecycle = self
                        .records
                        .get(&issue)
                        .map_or(wire::Lifecycle::Interrupted, |r| r.lifecycle);
                    self.store(ClientOp::Ended { issue, lifecycle }, Pending::Ended(issue));
                }
                SpoolOutput::Unaccountable {
                    issue,
                    terminal_lost,
                } => self.unaccountable(issue, terminal_lost),
            }
        }
    }

    /// plan §7.2 (R-7.2-13): an essential entry or a marker could not be
    /// made durable, so the command's output can no longer be accounted
    /// for. The tree is killed, and the command ends `INTERRUPTED` after an
    /// `OutputIncomplete` event, never as a complete run; a lost terminal
    /// event is spooled again in that form, at most
    /// [`MAX_TERMINAL_ATTEMPTS`] times (a store that keeps failing leaves
    /// the command to the next start's recovery).
    fn unaccountable(&mut self, issue: Uuid7, terminal_lost: bool) {
        self.stats.unaccountable += 1;
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        r.unaccountable = true;
        if !terminal_lost {
            if matches!(
                r.phase,
                LaunchPhase::Running(_) | LaunchPhase::Released(_) | LaunchPhase::Authorizing(_)
            ) {
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind: wire::SignalKind::Kill,
                    revision: 0,
                }));
            }
            return;
        }
        if r.terminal_attempts >= MAX_TERMINAL_ATTEMPTS {
            return;
        }
        r.terminal_attempts += 1;
        let revision = r.revision;
        r.lifecycle = wire::Lifecycle::Interrupted;
        self.spool_incomplete_and_interrupted(issue, wall, revision);
    }

    /// Marks both output streams of `issue` incomplete, for `reason`.
    pub(super) fn spool_incomplete(&mut self, issue: Uuid7, wall_ms: i64, reason: &str) {
        self.spool_event(
            issue,
            wall_ms,
            Body::Incomplete(wire::OutputIncomplete {
                streams: vec![
                    wire::OutputStream::Stdout as i32,
                    wire::OutputStream::Stderr as i32,
                ],
                reason: reason.into(),
            }),
        );
    }

    pub(super) fn spool_incomplete_and_interrupted(
        &mut self,
        issue: Uuid7,
        wall_ms: i64,
        revision: u64,
    ) {
        self.spool_incomplete(issue, wall_ms, UNACCOUNTABLE_REASON);
        self.spool_event(
            issue,
            wall_ms,
            Body::Lifecycle(wire::LifecycleChange {
                lifecycle: wire::Lifecycle::Interrupted as i32,
                revision,
                exit_result: Some(wire::ExitResult {
                    lifecycle: wire::Lifecycle::Interrupted as i32,
                    exit_code: None,
                    signal_number: None,
                    signal_name: String::new(),
                }),
                reason: UNACCOUNTABLE_REASON.into(),
            }),
        );
    }

    /// The shell reads `first_seq..=last_seq` back from the store and sends
    /// them: a `Send` of the spool becomes an output the shell resolves.
    fn push_send_events(&mut self, issue: Uuid7, first_seq: u64, last_seq: u64) {
        if let Some(s) = self.link.session() {
            let (session_id, generation) = (s.session_id.clone(), s.generation);
            self.push(Output::SendEvents {
                issue,
                first_seq,
                last_seq,
                session_id,
                generation,
            });
        }
    }
}
