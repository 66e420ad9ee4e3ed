//! Signals: a revisioned `Signal` from the server cancels a command not
//! yet launched, aborts a blocked launcher, or goes to the running tree;
//! the result of each is spooled as a `SignalResult`.

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;

use super::{ClientCore, LaunchPhase, Output};
use crate::ops::SuperviseOp;

fn signal_number(kind: wire::SignalKind) -> Option<(i32, &'static str)> {
    match kind {
        wire::SignalKind::Hup => Some((1, "SIGHUP")),
        wire::SignalKind::Int => Some((2, "SIGINT")),
        wire::SignalKind::Term => Some((15, "SIGTERM")),
        wire::SignalKind::Kill => Some((9, "SIGKILL")),
        wire::SignalKind::Usr1 => Some((10, "SIGUSR1")),
        wire::SignalKind::Usr2 => Some((12, "SIGUSR2")),
        wire::SignalKind::Unspecified => None,
    }
}

pub(super) fn signal_name(n: i32) -> &'static str {
    match n {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "",
    }
}

impl ClientCore {
    // ---- signals -----------------------------------------------------------------

    pub(super) fn signal(&mut self, now_ms: u64, s: wire::Signal) {
        let Ok(issue) = Uuid7::parse("signal.issue_uuid", &s.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let kind = wire::SignalKind::try_from(s.signal).unwrap_or(wire::SignalKind::Unspecified);
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            // unknown or tombstoned: reconciliation settles it
            return;
        };
        if s.revision <= r.last_signal_revision || r.terminate {
            return;
        }
        r.last_signal_revision = s.revision;
        r.revision = r.revision.max(s.revision);
        match r.phase.clone() {
            LaunchPhase::Accepted => {
                r.cancel_pending = Some((s.revision, kind));
                self.signal_result(
                    issue,
                    wall,
                    s.revision,
                    kind,
                    wire::SignalOutcome::CancelledBeforeLaunch,
                    "",
                );
                self.end(
                    wall,
                    issue,
                    wire::Lifecycle::Cancelled,
                    None,
                    "cancelled before launch",
                );
            }
            LaunchPhase::Materializing
            | LaunchPhase::Preparing
            | LaunchPhase::RecordingPrepared(_) => {
                // the launcher is not authorized: abort once it is prepared
                r.cancel_pending = Some((s.revision, kind));
            }
            LaunchPhase::Prepared(_) => {
                r.cancel_pending = Some((s.revision, kind));
                self.abort(issue);
            }
            LaunchPhase::Authorizing(_) | LaunchPhase::Released(_) | LaunchPhase::Running(_) => {
                if signal_number(kind).is_none() {
                    self.signal_result(
                        issue,
                        wall,
                        s.revision,
                        kind,
                        wire::SignalOutcome::Failed,
                        "unsupported signal",
                    );
                    return;
                }
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind,
                    revision: s.revision,
                }));
            }
            LaunchPhase::Ended => {
                self.signal_result(
                    issue,
                    wall,
                    s.revision,
                    kind,
                    wire::SignalOutcome::NoOpAfterExit,
                    "",
                );
            }
            LaunchPhase::Aborting | LaunchPhase::Reaping { .. } => {}
        }
    }

    pub(super) fn signalled(
        &mut self,
        wall_ms: i64,
        issue: Uuid7,
        kind: wire::SignalKind,
        revision: u64,
        outcome: wire::SignalOutcome,
    ) {
        if revision == 0 {
            // an internal kill (reconciliation, unaccountable output)
            return;
        }
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if outcome == wire::SignalOutcome::Delivered {
            r.signalled = true;
        }
        if r.phase == LaunchPhase::Ended {
            return;
        }
        self.signal_result(issue, wall_ms, revision, kind, outcome, "");
    }

    /// Spools the result of a signal sent through RVBox.
    pub(super) fn signal_result(
        &mut self,
        issue: Uuid7,
        wall_ms: i64,
        revision: u64,
        kind: wire::SignalKind,
        outcome: wire::SignalOutcome,
        reason: &str,
    ) {
        self.spool_event(
            issue,
            wall_ms,
            Body::SignalResult(wire::SignalResult {
                revision,
                signal: kind as i32,
                outcome: outcome as i32,
                reason: reason.to_owned(),
            }),
        );
    }
}
