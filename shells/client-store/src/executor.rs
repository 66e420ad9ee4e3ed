//! The client store as the client core's executor: every [`ClientOp`]
//! performed against the store and answered with its [`ClientCompletion`].
//! A failure is logged (never with payloads), counted, and answered as
//! `Failed`: nothing of that step is durable.

use rvbox_client_core::ops::{
    AcceptOutcome, ClientCompletion, ClientOp, ScriptOutcome, WrapperSource,
};
use rvbox_storage::StoreError;

use crate::records::Materialize;
use crate::store::{Accepted, ClientStore};

impl ClientStore {
    /// Performs one durable step of the client core.
    pub fn perform(
        &mut self,
        policy: &rvbox_client_core::accept::AcceptPolicy,
        op: &ClientOp,
        now_ms: i64,
    ) -> ClientCompletion {
        let done = |r: Result<(), StoreError>| r.map(|()| ClientCompletion::Done);
        let result = match op {
            ClientOp::Accept(d) => self.accept(policy, d, now_ms).map(|a| {
                ClientCompletion::Accepted(match a {
                    Accepted::New => AcceptOutcome::New,
                    Accepted::Repeat {
                        revision,
                        resolved_shell,
                    } => AcceptOutcome::Repeat {
                        revision,
                        resolved_shell,
                    },
                    Accepted::Refused(r) => AcceptOutcome::Refused(r),
                })
            }),
            ClientOp::Spool(op) => Ok(ClientCompletion::Spool(self.perform_spool(op, now_ms))),
            ClientOp::Generation(g) => done(self.record_generation(*g)),
            ClientOp::Tombstones { issues } => {
                self.tombstones_of(issues).map(ClientCompletion::Tombstones)
            }
            ClientOp::Reconcile {
                terminate,
                discard,
                revisions,
            } => done(self.apply_reconcile(terminate, discard, revisions)),
            ClientOp::Materialize { issue, cwd, source } => {
                let content = match source {
                    WrapperSource::Text(t) => Ok(t.clone().into_bytes()),
                    WrapperSource::Script => self
                        .script_len(issue)
                        .and_then(|len| self.script_range(issue, 0, len)),
                };
                content
                    .and_then(|c| self.materialize(issue, cwd, &policy.cwd_roots, &c))
                    .map(|m| match m {
                        Materialize::Written(wrapper_path) => {
                            ClientCompletion::Materialized { wrapper_path }
                        }
                        Materialize::Refused(reason) => {
                            self.metrics.wrapper_refusals.inc();
                            ClientCompletion::MaterializeRefused(reason)
                        }
                    })
            }
            ClientOp::LaunchPrepared { issue, identity } => {
                done(self.launch_prepared(issue, identity))
            }
            ClientOp::LaunchAuthorized { issue } => done(self.launch_authorized(issue)),
            ClientOp::Running { issue } => done(self.launch_running(issue)),
            ClientOp::Unprepared { issue } => done(self.launch_unprepared(issue)),
            ClientOp::Ended { issue, lifecycle } => done(self.launch_ended(issue, *lifecycle)),
            ClientOp::ScriptChunk { issue, chunk } => {
                self.script_chunk(issue, chunk, now_ms).map(|outcome| {
                    let step = match &outcome {
                        ScriptOutcome::Invalid(_) => Some("invalid"),
                        ScriptOutcome::Mismatch(_) => Some("mismatch"),
                        ScriptOutcome::Received { .. } | ScriptOutcome::Committed => None,
                    };
                    if let Some(step) = step {
                        self.metrics
                            .script_verification_failures
                            .get_or_create(&crate::metrics::StepLabel { step })
                            .inc();
                    }
                    ClientCompletion::Script(outcome)
                })
            }
            ClientOp::StdinWrite { issue, write } => {
                self.stdin_write(issue, write).map(ClientCompletion::Stdin)
            }
            ClientOp::StdinWritten { issue, write_seq } => {
                done(self.stdin_written(issue, *write_seq))
            }
            ClientOp::Finish { issue } => done(self.finish_acknowledged(issue, now_ms).map(|_| ())),
            ClientOp::TerminalOpening {
                terminal,
                resolved_shell,
                open,
            } => done(self.terminal_opening(terminal, *resolved_shell, open, now_ms)),
            ClientOp::TerminalOpened { terminal, holder } => {
                done(self.terminal_opened(terminal, holder))
            }
            ClientOp::TerminalClosed { terminal, closed } => {
                done(self.terminal_closed(terminal, closed))
            }
            ClientOp::TerminalsExpire { closed_before_ms } => {
                done(self.expire_terminals(*closed_before_ms).map(|_| ()))
            }
        };
        match result {
            Ok(c) => c,
            Err(e) => {
                if matches!(op, ClientOp::Accept(_)) {
                    self.metrics.accept_failures.inc();
                }
                tracing::error!(error = %e, "client store step failed");
                ClientCompletion::Failed(e.to_string())
            }
        }
    }

    fn script_len(&self, issue: &rvbox_domain::ids::Uuid7) -> Result<u64, StoreError> {
        use rusqlite::params;
        use rvbox_storage::db::Cached as _;
        self.conn
            .query_row_cached(
                "SELECT script_len FROM commands WHERE issue_uuid = ?1 AND script_committed = 1",
                params![issue.as_bytes().as_slice()],
                |r| r.get::<_, Option<i64>>(0),
            )
            .map_err(|e| StoreError::sqlite("read script length", e))?
            .map(|n| u64::try_from(n).unwrap_or(0))
            .ok_or_else(|| {
                StoreError::Integrity(format!("command {issue} has no committed script"))
            })
    }
}
