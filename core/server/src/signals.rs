//! Operator signals (plan §6.4, R-6.4-11, R-6.4-35..38): `SignalCommand`
//! commits its revision, pending signal and stored response in one
//! operation before the revisioned `Signal` goes to the client's live,
//! reconciled session; pending signals go again after every
//! reconciliation that keeps the command and every acceptance.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::ops::{Completion, OpResult, PortError};
use rvbox_store_port::signals::SignalPlan;

use crate::connections::ConnId;
use crate::{ControlAnswer, Output, RequestId, ServerCore, convert};

#[derive(Debug)]
pub(crate) enum Pending {
    /// `SignalCommand`.
    Command { request: RequestId },
    /// Pending signals to send again on a connection.
    Resend { conn: ConnId },
}

/// The dispatch core's signal rule for the command as a store
/// transaction reads it: a never-dispatched command is cancelled by the
/// server; anything the client may hold gets a revisioned signal. The
/// store applies it inside the `SignalCommand` transaction.
///
/// # Errors
/// `FAILED_PRECONDITION` naming `issue_uuid` for a command no signal
/// applies to (terminal), or an invalid stored id.
pub fn signal_plan(v: &CommandView, signal: i32) -> Result<SignalPlan, DomainError> {
    let id = Uuid7::from_bytes("issue_uuid", v.issue_uuid)?;
    match rvbox_dispatch::decide_signal(id, convert::state_of(v), signal) {
        Ok(rvbox_dispatch::SignalDecision::CancelQueued { .. }) => Ok(SignalPlan::CancelQueued),
        Ok(rvbox_dispatch::SignalDecision::Deliver { .. }) => Ok(SignalPlan::Deliver),
        Err(e) => {
            Err(DomainError::new(Code::FailedPrecondition, e.to_string()).with_field("issue_uuid"))
        }
    }
}

impl ServerCore {
    pub(crate) fn signal_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Command { request } => {
                let answer = match result {
                    Ok(Completion::Signal(outcome)) => {
                        self.stats.signals += 1;
                        if let Some(frame) = outcome.deliver {
                            let live = self
                                .clients
                                .get(&outcome.client_id)
                                .filter(|st| st.ready)
                                .and_then(|st| st.conn);
                            if let Some(conn) = live
                                && !self.send(conn, Payload::Signal(frame))
                            {
                                tracing::warn!(
                                    "signal not queued; sent after the next reconciliation"
                                );
                            }
                        }
                        Ok(outcome.response)
                    }
                    Ok(_) => {
                        self.mismatch("signal_command");
                        Err(PortError::Unavailable(
                            "completion does not match SignalCommand".into(),
                        ))
                    }
                    Err(e) => Err(e),
                };
                self.out.push_back(Output::Reply {
                    request,
                    answer: ControlAnswer::SignalCommand(answer),
                });
            }
            Pending::Resend { conn } => match result {
                Ok(Completion::PendingSignals(frames)) => {
                    // at least once; the client ignores a revision it has
                    // handled
                    for frame in frames {
                        self.stats.signals_sent_again += 1;
                        if !self.send(conn, Payload::Signal(frame)) {
                            tracing::warn!(
                                "pending signal not queued; sent after the next reconciliation"
                            );
                            return;
                        }
                    }
                }
                Ok(_) => self.mismatch("pending_signals"),
                Err(e) => tracing::error!(error = %e, "pending signals not readable"),
            },
        }
    }
}
