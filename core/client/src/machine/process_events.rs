//! Process events and the end of a command: the supervisor's reports
//! (ready, running, output, stdin written, diagnostics, exit, drained)
//! turned into spooled events, the outcome of an exit, the terminal event,
//! and the reaping of launches recorded before a restart.

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;

use super::signals::signal_name;
use super::{ClientCore, LaunchPhase, MAX_REAP_ATTEMPTS, Pending, REAP_RETRY_MS};
use crate::ops::ClientOp;
use crate::process::{CommandProcessEvent, Exit, LaunchFailure, ProcessEvent};

/// Why a command that ran while the daemon stopped without its orderly
/// shutdown has incomplete output.
const LOST_AT_RESTART_REASON: &str = "the client daemon stopped while the command ran: output written after the last captured chunk was not captured";

impl ClientCore {
    /// Spools the terminal event and releases the slot. The terminal event
    /// is always the last.
    pub(super) fn end(
        &mut self,
        wall_ms: i64,
        issue: Uuid7,
        lifecycle: wire::Lifecycle,
        exit: Option<wire::ExitResult>,
        reason: &str,
    ) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if r.phase == LaunchPhase::Ended {
            return;
        }
        r.phase = LaunchPhase::Ended;
        r.lifecycle = lifecycle;
        r.running_slot = false;
        let revision = r.revision;
        let terminate = r.terminate;
        self.stats.ended += 1;
        if terminate {
            // the server holds no live record: nothing is sent; the record
            // goes straight to its tombstone
            self.spool.discard(issue);
            self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
            return;
        }
        if r.unaccountable {
            r.lifecycle = wire::Lifecycle::Interrupted;
            self.spool_incomplete_and_interrupted(issue, wall_ms, revision);
            return;
        }
        let mut reason = reason.to_owned();
        reason.truncate(1024);
        let exit_result = exit.unwrap_or(wire::ExitResult {
            lifecycle: lifecycle as i32,
            exit_code: None,
            signal_number: None,
            signal_name: String::new(),
        });
        // the slot is released once the terminal entry is durable
        // (SpoolOutput::TerminalDurable), never before
        self.spool_event(
            issue,
            wall_ms,
            Body::Lifecycle(wire::LifecycleChange {
                lifecycle: lifecycle as i32,
                revision,
                exit_result: Some(exit_result),
                reason,
            }),
        );
    }

    pub(super) fn spool_event(&mut self, issue: Uuid7, wall_ms: i64, body: Body) {
        if let Err(e) = self.spool.event(issue, wall_ms, body) {
            // a command ended or unknown to the spool: nothing to record
            debug_assert!(
                !matches!(e, crate::spool::SpoolError::Full(_)),
                "essential reserve exhausted: {e}"
            );
        }
    }

    // ---- process events ----------------------------------------------------------

    pub(super) fn process(&mut self, now_ms: u64, wall_ms: i64, ev: CommandProcessEvent) {
        let issue = ev.issue;
        match ev.event {
            ProcessEvent::Ready(identity) => {
                let Some(r) = self.records.get_mut(&issue) else {
                    return;
                };
                if r.phase != LaunchPhase::Preparing {
                    return;
                }
                r.phase = LaunchPhase::RecordingPrepared(identity.clone());
                self.store(
                    ClientOp::LaunchPrepared { issue, identity },
                    Pending::Prepared(issue),
                );
            }
            ProcessEvent::Failed(f) => self.launch_failed(now_ms, wall_ms, issue, f),
            ProcessEvent::Running => {
                let Some(r) = self.records.get_mut(&issue) else {
                    return;
                };
                if let LaunchPhase::Released(id) = r.phase.clone() {
                    r.phase = LaunchPhase::Running(id);
                    r.lifecycle = wire::Lifecycle::Running;
                    let revision = r.revision;
                    // RUNNING is spooled at once, before any output of the
                    // tree can be (the spool's order is the command's)
                    self.spool_event(
                        issue,
                        wall_ms,
                        Body::Lifecycle(wire::LifecycleChange {
                            lifecycle: wire::Lifecycle::Running as i32,
                            revision,
                            exit_result: None,
                            reason: String::new(),
                        }),
                    );
                    self.store(ClientOp::Running { issue }, Pending::Running(issue));
                }
            }
            ProcessEvent::Output {
                stream,
                observed_ms,
                bytes,
            } => {
                if self.records.get(&issue).is_some_and(|r| !r.terminate) {
                    let _ = self.spool.output(issue, stream, observed_ms, bytes);
                }
            }
            ProcessEvent::Dropped {
                stream,
                raw_bytes,
                first_ms,
                last_ms,
            } => {
                let _ = self
                    .spool
                    .dropped_upstream(issue, stream, raw_bytes, first_ms, last_ms);
            }
            ProcessEvent::StdinWritten { write_seq } => {
                let closed = self.records.get(&issue).is_some_and(|r| r.stdin_closed);
                self.store(
                    ClientOp::StdinWritten { issue, write_seq },
                    Pending::StdinWritten,
                );
                self.spool_event(
                    issue,
                    wall_ms,
                    Body::StdinAck(wire::StdinAck {
                        write_seq,
                        delivery: wire::StdinDelivery::Written as i32,
                        closed,
                        reason: String::new(),
                    }),
                );
            }
            ProcessEvent::Diagnostics(d) => {
                // only while the tree runs, and never from the reserve
                // kept for lifecycle events and markers
                let running = self.records.get(&issue).is_some_and(|r| {
                    matches!(r.phase, LaunchPhase::Running(_)) && r.exit.is_none()
                });
                if running {
                    // refused at the entry cap: the next change is sent
                    let _ = self.spool.diagnostics(issue, wall_ms, d);
                }
            }
            ProcessEvent::Exited(exit) => {
                if let Some(r) = self.records.get_mut(&issue) {
                    r.exit = Some(exit);
                }
            }
            ProcessEvent::Drained { incomplete } => self.drained(wall_ms, issue, incomplete),
        }
    }

    fn drained(&mut self, wall_ms: i64, issue: Uuid7, incomplete: Vec<wire::OutputStream>) {
        let Some(r) = self.records.get(&issue) else {
            return;
        };
        match r.phase {
            LaunchPhase::Aborting => {
                // the launcher is gone without running anything
                let (cancelled, terminate) = (r.cancel_pending, r.terminate);
                if terminate {
                    self.end(wall_ms, issue, wire::Lifecycle::Cancelled, None, "");
                } else if let Some((revision, kind)) = cancelled {
                    self.signal_result(
                        issue,
                        wall_ms,
                        revision,
                        kind,
                        wire::SignalOutcome::CancelledBeforeLaunch,
                        "",
                    );
                    self.end(
                        wall_ms,
                        issue,
                        wire::Lifecycle::Cancelled,
                        None,
                        "cancelled before launch",
                    );
                } else if self.shutting_down {
                    // verified dead before release: it may run after the restart
                } else {
                    // a failed durable step aborted it: try again later
                    self.launch_failed(
                        0,
                        wall_ms,
                        issue,
                        LaunchFailure::Transient("aborted".into()),
                    );
                }
            }
            LaunchPhase::Running(_) | LaunchPhase::Released(_) => {
                if !incomplete.is_empty() {
                    let mut streams: Vec<i32> = incomplete.iter().map(|s| *s as i32).collect();
                    streams.sort_unstable();
                    streams.dedup();
                    self.spool_event(
                        issue,
                        wall_ms,
                        Body::Incomplete(wire::OutputIncomplete {
                            streams,
                            reason: "output pipes were still open after the drain grace period"
                                .into(),
                        }),
                    );
                }
                let (lifecycle, exit) = self.outcome(issue);
                if self.shutting_down {
                    // plan §7.4: an orderly shutdown terminates surviving
                    // trees and reports them interrupted
                    self.stats.interrupted += 1;
                    self.end(
                        wall_ms,
                        issue,
                        wire::Lifecycle::Interrupted,
                        None,
                        "the client daemon shut down while the command ran",
                    );
                } else {
                    self.end(wall_ms, issue, lifecycle, Some(exit), "");
                }
            }
            _ => {
                // drained before running (a failed exec): the Failed event
                // ends it; nothing else to do
            }
        }
    }

    /// plan, spec-mapping: succeeded = exit 0; failed = non-zero or a signal
    /// not sent through RVBox; terminated = ended by a signal sent through
    /// RVBox.
    fn outcome(&self, issue: Uuid7) -> (wire::Lifecycle, wire::ExitResult) {
        let r = self.records.get(&issue);
        let signalled = r.is_some_and(|r| r.signalled);
        let exit = r.and_then(|r| r.exit);
        let (lifecycle, code, signal) = match exit {
            Some(Exit::Code(0)) if !signalled => (wire::Lifecycle::Succeeded, Some(0), None),
            Some(Exit::Code(c)) if !signalled => (wire::Lifecycle::Failed, Some(c), None),
            Some(Exit::Code(c)) => (wire::Lifecycle::Terminated, Some(c), None),
            Some(Exit::Signal(n)) if signalled => (wire::Lifecycle::Terminated, None, Some(n)),
            Some(Exit::Signal(n)) => (wire::Lifecycle::Failed, None, Some(n)),
            None => (wire::Lifecycle::Interrupted, None, None),
        };
        (
            lifecycle,
            wire::ExitResult {
                lifecycle: lifecycle as i32,
                exit_code: code,
                signal_number: signal,
                signal_name: signal.map(signal_name).unwrap_or_default().to_owned(),
            },
        )
    }

    /// A command that ran while the daemon stopped without its orderly
    /// shutdown: what it wrote after the last spooled chunk (in its pipes,
    /// or read and not yet spooled) was not captured, so its output is
    /// marked incomplete before the terminal event, never a silent gap.
    fn lost_at_restart(&mut self, issue: Uuid7, wall_ms: i64) {
        self.spool_incomplete(issue, wall_ms, LOST_AT_RESTART_REASON);
    }

    /// Ends a command of before the restart `INTERRUPTED` for `reason`,
    /// its output marked incomplete first.
    fn interrupted_at_restart(&mut self, issue: Uuid7, wall_ms: i64, reason: &str) {
        self.stats.interrupted += 1;
        self.lost_at_restart(issue, wall_ms);
        self.end(wall_ms, issue, wire::Lifecycle::Interrupted, None, reason);
    }

    pub(super) fn reaped(&mut self, now_ms: u64, wall_ms: i64, issue: Uuid7, gone: bool) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let LaunchPhase::Reaping { authorized } = r.phase else {
            return;
        };
        if !gone && authorized {
            // not verifiably gone, so not killed: the slot stays taken and
            // the check is tried again; after the last try the command ends
            // interrupted, its tree possibly still alive (never launched
            // again either way)
            r.reap_attempts = r.reap_attempts.saturating_add(1);
            if r.reap_attempts < MAX_REAP_ATTEMPTS {
                r.retry_at = Some(now_ms.saturating_add(REAP_RETRY_MS));
                return;
            }
            self.stats.unverified_trees += 1;
            self.interrupted_at_restart(
                issue,
                wall_ms,
                "the client restarted while the command ran, and could not verify that its process tree is gone; it may still be running",
            );
            return;
        }
        // a prepared launch that cannot be verified gone never ran user
        // code and never can (its release channel died with the daemon):
        // like a gone one, it may be launched again
        if authorized {
            // plan §7.4 step 5: authorized but uncertain: killed as a tree,
            // ends interrupted, never launched again
            self.interrupted_at_restart(
                issue,
                wall_ms,
                "the client restarted while the command ran; its outcome is unknown",
            );
        } else {
            r.phase = LaunchPhase::Accepted;
            r.running_slot = false;
            self.store(ClientOp::Unprepared { issue }, Pending::Unprepared(issue));
        }
    }
}
