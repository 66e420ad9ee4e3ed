//! Classification of `CommandAccepted` (plan §6.4; R-6.4-11/15..18).
//!
//! "Classify a negative `CommandAccepted` before changing lifecycle." The
//! frame is validated against the dispatched command first (issue, the
//! revision the `Dispatch` carried, outcome, error detail); any mismatch is
//! an error and decides nothing. Then:
//!
//! - `POSITIVE`: `dispatched -> accepted`, recording the resolved shell. If
//!   the queue expiry had passed (a late acceptance), the same transaction
//!   also records a `LATE_AFTER_EXPIRY` incident and takes a higher
//!   termination revision; a best-effort `TERM` [`wire::Signal`] is sent only
//!   after that transaction is durable ([`Acceptance::after_durable`]).
//!   Every later actual event is kept (see [`crate::apply_lifecycle_evidence`]).
//! - `TRANSIENT`: `dispatched -> queued` with a full-jitter backoff under the
//!   original TTL; when the retry could only happen at or after the expiry,
//!   the command expires instead (`dispatched -> queued -> expired` in one
//!   write: the client definitely did not take it, so it is queued work
//!   whose TTL ran out, not an uncertain dispatch).
//! - `PERMANENT`: terminal `rejected` with the bounded structured reason.
//!
//! `failed` is never produced here: it is reserved for a process that
//! reached `running` (R-6.4-18).

use rvbox_domain::error::{Code, DomainError, bound_reason};
use rvbox_domain::ids::{IdError, Uuid7};
use rvbox_domain::lifecycle::{CommandState, Phase, Revision, TransitionError};
use rvbox_proto::v1 as wire;
use thiserror::Error;

use crate::backoff::RetryPolicy;
use crate::capacity::ShadowSettle;
use crate::expiry::is_past;
use crate::write::StateWrite;

/// Longest `ErrorDetail.field` kept (common.proto: <= 256 bytes).
pub const MAX_ERROR_FIELD_BYTES: usize = 256;

/// The stored command an answer is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchedCommand {
    /// The command.
    pub issue: Uuid7,
    /// Stored phase and current revision (higher than
    /// `dispatched_revision` when a signal was taken while in flight).
    pub state: CommandState,
    /// The revision the `Dispatch` frame on this session carried
    /// ([`crate::DispatchOrder::revision`]).
    pub dispatched_revision: Revision,
    /// Stored absolute queue expiry; `None` for an indefinite TTL.
    pub queue_expiry_ms: Option<i64>,
    /// Transient rejections so far (drives the backoff exponent).
    pub transient_rejections: u32,
}

/// An incident the caller persists in the decision's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncidentIntent {
    /// Always `LATE_AFTER_EXPIRY` here.
    pub kind: wire::IncidentKind,
    /// The command.
    pub issue: Uuid7,
    /// The stored expiry that had passed.
    pub queue_expiry_ms: i64,
    /// Server wall time the late evidence was classified.
    pub observed_wall_ms: i64,
}

/// A positive answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acceptance {
    /// Step 1, one transaction: `dispatched -> accepted` (at a bumped
    /// termination revision when late), together with `resolved_shell` and
    /// `incident`.
    pub write: StateWrite,
    /// The shell the client will run (recorded on the command).
    pub resolved_shell: wire::ShellType,
    /// `LATE_AFTER_EXPIRY` when the TTL had passed while dispatched.
    pub incident: Option<IncidentIntent>,
    /// Step 2, only after step 1 is durable: best-effort `TERM` at the new
    /// revision (late acceptance only). Carries no control request id.
    pub after_durable: Option<wire::Signal>,
}

/// A transient answer within the TTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requeue {
    /// `dispatched -> queued`.
    pub write: StateWrite,
    /// Store as the command's backoff: no dispatch before this wall time
    /// (always before the expiry).
    pub not_before_wall_ms: i64,
    /// Store as the new transient rejection count.
    pub transient_rejections: u32,
    /// The client's reason, bounded.
    pub detail: wire::ErrorDetail,
}

/// A transient answer whose retry cannot happen before the expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransientExpiry {
    /// `dispatched -> queued -> expired`.
    pub write: StateWrite,
    /// The client's reason, bounded.
    pub detail: wire::ErrorDetail,
}

/// A permanent answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `dispatched -> rejected` (`dispatched -> interrupted` for
    /// [`AcceptDecision::AlreadyExecuted`]).
    pub write: StateWrite,
    /// The structured reason to persist on the command record, bounded.
    pub detail: wire::ErrorDetail,
}

/// What one `CommandAccepted` decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceptDecision {
    /// Positive.
    Accept(Acceptance),
    /// Transient, retry later.
    Requeue(Requeue),
    /// Transient, but the TTL leaves no time to retry.
    Expire(TransientExpiry),
    /// Permanent.
    Reject(Rejection),
    /// Permanent `ALREADY_EXECUTED`: the client ran this very command
    /// before (its tombstone ledger holds it) and this server does not
    /// know its end, as after a restore from an older backup. Plan §7.3:
    /// stale state, not a rejection; the command ends `interrupted`, its
    /// detail saying why, so that a command that ran never looks
    /// rejected (and never invites a rerun as if it had not run).
    AlreadyExecuted(Rejection),
    /// An exact repeat of an answer already applied: nothing to write.
    Repeat,
}

impl AcceptDecision {
    /// What the answer does to the session's shadow for this command.
    #[must_use]
    pub fn shadow(&self) -> ShadowSettle {
        match self {
            Self::Accept(_) | Self::Repeat => ShadowSettle::AwaitReport,
            Self::Requeue(_) | Self::Expire(_) | Self::Reject(_) | Self::AlreadyExecuted(_) => {
                ShadowSettle::Release
            }
        }
    }
}

/// A `CommandAccepted` that does not match the dispatched command.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AcceptError {
    /// `issue_uuid` is not canonical UUIDv7.
    #[error(transparent)]
    Issue(IdError),
    /// `issue_uuid` names another command.
    #[error("command_accepted.issue_uuid {got} is not the dispatched command {expected}")]
    IssueMismatch {
        /// Received.
        got: Uuid7,
        /// Dispatched.
        expected: Uuid7,
    },
    /// `revision` differs from the dispatched revision.
    #[error("command_accepted.revision {got} does not match the dispatched revision {dispatched}")]
    Revision {
        /// Received.
        got: u64,
        /// Carried by the Dispatch.
        dispatched: u64,
    },
    /// `outcome` is unspecified or unknown.
    #[error("command_accepted.outcome {0} is unspecified or unknown")]
    Outcome(i32),
    /// A negative outcome without `error`.
    #[error("command_accepted.error is required for a negative outcome")]
    MissingError,
    /// A positive outcome with `error`.
    #[error("command_accepted.error must be absent for a positive outcome")]
    UnexpectedError,
    /// `error.code` is unspecified or unknown.
    #[error("command_accepted.error.code {0} is unspecified or unknown")]
    ErrorCode(i32),
    /// `error.retry_class` is unspecified or unknown.
    #[error("command_accepted.error.retry_class {0} is unspecified or unknown")]
    RetryClass(i32),
    /// `error.retry_class` contradicts `outcome`.
    #[error("command_accepted.error.retry_class contradicts the {outcome} outcome")]
    RetryClassMismatch {
        /// `TRANSIENT` or `PERMANENT`.
        outcome: &'static str,
    },
    /// A positive outcome without a known resolved shell.
    #[error("command_accepted.resolved_shell {0} is unspecified or unknown")]
    Shell(i32),
    /// The command is not `dispatched` and this is not a repeat of the
    /// answer already applied: a conflicting duplicate.
    #[error("command_accepted for a command that is {phase}, not dispatched")]
    NotDispatched {
        /// Stored phase.
        phase: Phase,
    },
    /// The domain refused the write (e.g. revision exhausted).
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

impl AcceptError {
    /// Dotted name of the offending field; empty for state conflicts.
    #[must_use]
    pub fn field(&self) -> &'static str {
        match self {
            Self::Issue(e) => e.field(),
            Self::IssueMismatch { .. } => "command_accepted.issue_uuid",
            Self::Revision { .. } => "command_accepted.revision",
            Self::Outcome(_) => "command_accepted.outcome",
            Self::MissingError | Self::UnexpectedError => "command_accepted.error",
            Self::ErrorCode(_) => "command_accepted.error.code",
            Self::RetryClass(_) | Self::RetryClassMismatch { .. } => {
                "command_accepted.error.retry_class"
            }
            Self::Shell(_) => "command_accepted.resolved_shell",
            Self::NotDispatched { .. } | Self::Transition(_) => "",
        }
    }

    /// The peer broke the agent protocol (`PROTOCOL_ERROR`, plan §4.2: a
    /// conflicting duplicate fences the session); a domain refusal keeps its
    /// own code.
    #[must_use]
    pub fn to_domain_error(&self) -> DomainError {
        match self {
            Self::Transition(e) => DomainError::from(e.clone()),
            other => {
                DomainError::new(Code::ProtocolError, other.to_string()).with_field(other.field())
            }
        }
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary.
fn bound_text(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default().to_owned()
}

/// A permanent answer saying the client already executed the command.
fn already_executed(detail: Option<&wire::ErrorDetail>) -> bool {
    detail.is_some_and(|d| Code::from_wire(d.code) == Some(Code::AlreadyExecuted))
}

/// Checks a negative answer's detail and keeps a bounded copy.
fn negative_detail(
    detail: &wire::ErrorDetail,
    outcome: wire::AcceptOutcome,
    issue: Uuid7,
) -> Result<wire::ErrorDetail, AcceptError> {
    if Code::from_wire(detail.code).is_none() {
        return Err(AcceptError::ErrorCode(detail.code));
    }
    let retry = match wire::RetryClass::try_from(detail.retry_class) {
        Ok(r @ (wire::RetryClass::Transient | wire::RetryClass::Permanent)) => r,
        Ok(wire::RetryClass::Unspecified) | Err(_) => {
            return Err(AcceptError::RetryClass(detail.retry_class));
        }
    };
    // plan §6.4: only *explicitly* transient pressure is retried.
    match (outcome, retry) {
        (wire::AcceptOutcome::Transient, wire::RetryClass::Transient)
        | (wire::AcceptOutcome::Permanent, wire::RetryClass::Permanent) => {}
        (wire::AcceptOutcome::Transient, _) => {
            return Err(AcceptError::RetryClassMismatch {
                outcome: "TRANSIENT",
            });
        }
        _ => {
            return Err(AcceptError::RetryClassMismatch {
                outcome: "PERMANENT",
            });
        }
    }
    Ok(wire::ErrorDetail {
        code: detail.code,
        retry_class: detail.retry_class,
        reason: bound_reason(&detail.reason),
        field: bound_text(&detail.field, MAX_ERROR_FIELD_BYTES),
        issue_uuid: Some(issue.to_string()),
        ..Default::default()
    })
}

/// Classifies `msg` against `cmd` at `now_wall_ms`. `random` is the jitter
/// entropy for a transient answer.
///
/// # Errors
/// [`AcceptError`] when the frame does not match the dispatched command or
/// conflicts with the stored state; nothing is decided then.
pub fn classify_acceptance(
    cmd: &DispatchedCommand,
    msg: &wire::CommandAccepted,
    now_wall_ms: i64,
    random: u64,
    policy: &RetryPolicy,
) -> Result<AcceptDecision, AcceptError> {
    let issue =
        Uuid7::parse("command_accepted.issue_uuid", &msg.issue_uuid).map_err(AcceptError::Issue)?;
    if issue != cmd.issue {
        return Err(AcceptError::IssueMismatch {
            got: issue,
            expected: cmd.issue,
        });
    }
    let outcome = match wire::AcceptOutcome::try_from(msg.outcome) {
        Ok(
            o @ (wire::AcceptOutcome::Positive
            | wire::AcceptOutcome::Transient
            | wire::AcceptOutcome::Permanent),
        ) => o,
        Ok(wire::AcceptOutcome::Unspecified) | Err(_) => {
            return Err(AcceptError::Outcome(msg.outcome));
        }
    };
    if msg.revision != cmd.dispatched_revision.0 {
        return Err(AcceptError::Revision {
            got: msg.revision,
            dispatched: cmd.dispatched_revision.0,
        });
    }
    let detail = match (outcome, &msg.error) {
        (wire::AcceptOutcome::Positive, Some(_)) => return Err(AcceptError::UnexpectedError),
        (wire::AcceptOutcome::Positive, None) => None,
        (_, None) => return Err(AcceptError::MissingError),
        (_, Some(d)) => Some(negative_detail(d, outcome, issue)?),
    };
    // resolved_shell is read only for a positive answer; on a negative it
    // carries nothing and is ignored.
    let shell = match (outcome, wire::ShellType::try_from(msg.resolved_shell)) {
        (wire::AcceptOutcome::Positive, Ok(wire::ShellType::Unspecified) | Err(_)) => {
            return Err(AcceptError::Shell(msg.resolved_shell));
        }
        (_, Ok(s)) => s,
        (_, Err(_)) => wire::ShellType::Unspecified,
    };

    let phase = cmd.state.phase();
    if phase != Phase::Dispatched {
        let repeat = match outcome {
            wire::AcceptOutcome::Positive => !matches!(phase, Phase::Queued | Phase::Expired),
            wire::AcceptOutcome::Transient => phase == Phase::Queued,
            _ if already_executed(detail.as_ref()) => phase == Phase::Interrupted,
            _ => phase == Phase::Rejected,
        };
        return if repeat {
            Ok(AcceptDecision::Repeat)
        } else {
            Err(AcceptError::NotDispatched { phase })
        };
    }

    let at = StateWrite::at(cmd.state);
    match (outcome, detail) {
        (wire::AcceptOutcome::Positive, _) => {
            let write = at.then(Phase::Accepted)?;
            let Some(expiry) = cmd.queue_expiry_ms.filter(|e| now_wall_ms >= *e) else {
                return Ok(AcceptDecision::Accept(Acceptance {
                    write,
                    resolved_shell: shell,
                    incident: None,
                    after_durable: None,
                }));
            };
            // plan §6.4: persist the incident and a higher termination
            // revision before sending best-effort TERM.
            let (write, revision) = write.bump()?;
            Ok(AcceptDecision::Accept(Acceptance {
                write,
                resolved_shell: shell,
                incident: Some(IncidentIntent {
                    kind: wire::IncidentKind::LateAfterExpiry,
                    issue,
                    queue_expiry_ms: expiry,
                    observed_wall_ms: now_wall_ms,
                }),
                after_durable: Some(wire::Signal {
                    issue_uuid: issue.to_string(),
                    revision: revision.0,
                    signal: wire::SignalKind::Term as i32,
                }),
            }))
        }
        (wire::AcceptOutcome::Transient, Some(detail)) => {
            let requeue = at.then(Phase::Queued)?;
            let delay = policy.delay_ms(cmd.transient_rejections, random);
            let not_before = now_wall_ms.saturating_add(i64::try_from(delay).unwrap_or(i64::MAX));
            // plan §6.4: the retry stays under the original TTL.
            if is_past(cmd.queue_expiry_ms, not_before) {
                return Ok(AcceptDecision::Expire(TransientExpiry {
                    write: requeue.then(Phase::Expired)?,
                    detail,
                }));
            }
            Ok(AcceptDecision::Requeue(Requeue {
                write: requeue,
                not_before_wall_ms: not_before,
                transient_rejections: cmd.transient_rejections.saturating_add(1),
                detail,
            }))
        }
        (_, Some(detail)) if already_executed(Some(&detail)) => {
            Ok(AcceptDecision::AlreadyExecuted(Rejection {
                write: at.then(Phase::Interrupted)?,
                detail,
            }))
        }
        (_, Some(detail)) => Ok(AcceptDecision::Reject(Rejection {
            write: at.then(Phase::Rejected)?,
            detail,
        })),
        // a negative without detail was refused above
        (_, None) => Err(AcceptError::MissingError),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use proptest::prelude::*;
    use rvbox_domain::lifecycle::{Edge, Lifecycle};
    use rvbox_domain::limits::MAX_REASON_BYTES;

    use super::*;
    use crate::capacity::SessionCapacity;
    use crate::testutil::issue;

    const T0: i64 = 1_700_000_000_000;
    const TTL_END: i64 = T0 + 900_000;

    fn dispatched(rev: u64) -> DispatchedCommand {
        DispatchedCommand {
            issue: issue(7),
            state: CommandState::from_parts(Phase::Dispatched, Revision(rev)),
            dispatched_revision: Revision(rev),
            queue_expiry_ms: Some(TTL_END),
            transient_rejections: 0,
        }
    }

    fn positive(rev: u64) -> wire::CommandAccepted {
        wire::CommandAccepted {
            issue_uuid: issue(7).to_string(),
            revision: rev,
            outcome: wire::AcceptOutcome::Positive as i32,
            error: None,
            resolved_shell: wire::ShellType::Bash as i32,
        }
    }

    fn negative(outcome: wire::AcceptOutcome, code: Code, reason: &str) -> wire::CommandAccepted {
        let retry = match outcome {
            wire::AcceptOutcome::Transient => wire::RetryClass::Transient,
            _ => wire::RetryClass::Permanent,
        };
        wire::CommandAccepted {
            issue_uuid: issue(7).to_string(),
            revision: 1,
            outcome: outcome as i32,
            error: Some(wire::ErrorDetail {
                code: code.to_wire() as i32,
                retry_class: retry as i32,
                reason: reason.to_owned(),
                field: "spec.profile_flags".to_owned(),
                ..Default::default()
            }),
            resolved_shell: 0,
        }
    }

    fn classify(
        cmd: &DispatchedCommand,
        msg: &wire::CommandAccepted,
        now: i64,
    ) -> Result<AcceptDecision, AcceptError> {
        classify_acceptance(cmd, msg, now, 0xdead_beef, &RetryPolicy::default())
    }

    #[test]
    fn positive_accepts_and_records_the_shell() {
        let AcceptDecision::Accept(a) = classify(&dispatched(1), &positive(1), T0).unwrap() else {
            panic!()
        };
        assert_eq!(a.write.from().phase(), Phase::Dispatched);
        assert_eq!(
            a.write.to(),
            CommandState::from_parts(Phase::Accepted, Revision(1))
        );
        assert_eq!(a.write.edges(), [Edge::Accept]);
        assert_eq!(a.resolved_shell, wire::ShellType::Bash);
        assert_eq!(a.incident, None);
        assert_eq!(a.after_durable, None);
        // a repeat of the same positive answer decides nothing
        let mut cmd = dispatched(1);
        cmd.state = a.write.to();
        assert_eq!(classify(&cmd, &positive(1), T0), Ok(AcceptDecision::Repeat));
        assert_eq!(AcceptDecision::Repeat.shadow(), ShadowSettle::AwaitReport);
    }

    /// Late acceptance after expiry: accept the actual evidence, then the
    /// incident and a higher revision in one write, then TERM after it.
    #[test]
    fn late_acceptance_is_accepted_then_terminated_in_order() {
        let AcceptDecision::Accept(a) = classify(&dispatched(1), &positive(1), TTL_END).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            a.write.to(),
            CommandState::from_parts(Phase::Accepted, Revision(2))
        );
        assert_eq!(
            a.write.to().lifecycle(),
            Lifecycle::Accepted,
            "not a false terminal"
        );
        let incident = a.incident.unwrap();
        assert_eq!(incident.kind, wire::IncidentKind::LateAfterExpiry);
        assert_eq!(incident.queue_expiry_ms, TTL_END);
        assert_eq!(incident.observed_wall_ms, TTL_END);
        let signal = a.after_durable.unwrap();
        assert_eq!(
            signal,
            wire::Signal {
                issue_uuid: issue(7).to_string(),
                revision: 2,
                signal: wire::SignalKind::Term as i32,
            }
        );
        assert!(
            signal.revision > a.write.from().revision().0,
            "TERM carries the persisted termination revision"
        );
        assert_eq!(
            signal.revision,
            a.write.to().revision().0,
            "TERM revision is the one persisted first"
        );
        // one second before the expiry: an ordinary acceptance
        let AcceptDecision::Accept(b) =
            classify(&dispatched(1), &positive(1), TTL_END - 1).unwrap()
        else {
            panic!()
        };
        assert!(b.incident.is_none() && b.after_durable.is_none());
    }

    /// R-6.5-12: permanent rejection is terminal `rejected` with the bounded
    /// structured reason, never `failed`.
    #[test]
    fn permanent_rejection() {
        let long = "x".repeat(10_000);
        let msg = negative(wire::AcceptOutcome::Permanent, Code::Unsupported, &long);
        let d = classify(&dispatched(1), &msg, T0).unwrap();
        assert_eq!(d.shadow(), ShadowSettle::Release);
        let AcceptDecision::Reject(r) = d else {
            panic!()
        };
        assert_eq!(r.write.to().lifecycle(), Lifecycle::Rejected);
        assert_eq!(r.write.edges(), [Edge::Reject]);
        assert_eq!(r.detail.code, Code::Unsupported.to_wire() as i32);
        assert_eq!(r.detail.field, "spec.profile_flags");
        assert!(r.detail.reason.len() <= usize::try_from(MAX_REASON_BYTES).unwrap());
        assert_eq!(r.detail.issue_uuid, Some(issue(7).to_string()));
        // its repeat decides nothing
        let mut cmd = dispatched(1);
        cmd.state = r.write.to();
        assert_eq!(classify(&cmd, &msg, T0), Ok(AcceptDecision::Repeat));
    }

    /// R-7.3-07: `ALREADY_EXECUTED` is stale state, not a rejection: the
    /// command ends `interrupted` with the client's detail; its repeat
    /// decides nothing, and a command already rejected is not "repeated"
    /// by it.
    #[test]
    fn already_executed_ends_interrupted_never_rejected() {
        let msg = negative(
            wire::AcceptOutcome::Permanent,
            Code::AlreadyExecuted,
            "the command already ran here",
        );
        let d = classify(&dispatched(1), &msg, T0).unwrap();
        assert_eq!(d.shadow(), ShadowSettle::Release);
        let AcceptDecision::AlreadyExecuted(r) = d else {
            panic!("{d:?}")
        };
        assert_eq!(r.write.to().lifecycle(), Lifecycle::Interrupted);
        assert_eq!(r.detail.code, Code::AlreadyExecuted.to_wire() as i32);
        assert_eq!(r.detail.reason, "the command already ran here");
        let mut cmd = dispatched(1);
        cmd.state = r.write.to();
        assert_eq!(classify(&cmd, &msg, T0), Ok(AcceptDecision::Repeat));
        // a command rejected for another reason: a conflicting duplicate
        let other = negative(wire::AcceptOutcome::Permanent, Code::Unsupported, "x");
        let AcceptDecision::Reject(rej) = classify(&dispatched(1), &other, T0).unwrap() else {
            panic!()
        };
        cmd.state = rej.write.to();
        assert!(matches!(
            classify(&cmd, &msg, T0),
            Err(AcceptError::NotDispatched { .. })
        ));
    }

    /// R-6.5-13: transient rejection requeues with a bounded backoff under
    /// the TTL; when no retry fits before the expiry it expires instead.
    #[test]
    fn transient_rejection() {
        let msg = negative(
            wire::AcceptOutcome::Transient,
            Code::CapacityExhausted,
            "queue full",
        );
        let policy = RetryPolicy::default();
        let mut cmd = dispatched(1);
        let mut c = SessionCapacity::new();
        c.apply_report(&wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 1,
            max_queued: 0,
        })
        .unwrap();
        c.reserve(cmd.issue).unwrap();
        for attempt in 0..10u32 {
            let d = classify_acceptance(&cmd, &msg, T0, u64::MAX, &policy).unwrap();
            assert!(
                c.settle(cmd.issue, d.shadow()),
                "definite rejection releases the shadow"
            );
            let AcceptDecision::Requeue(r) = d else {
                panic!()
            };
            assert_eq!(r.write.to().phase(), Phase::Queued);
            assert_eq!(r.write.edges(), [Edge::Requeue]);
            assert_eq!(r.transient_rejections, attempt + 1);
            let delay = r.not_before_wall_ms - T0;
            assert!(delay >= 0 && delay <= i64::try_from(policy.cap_ms(attempt)).unwrap());
            assert!(delay <= 60_000);
            assert!(r.not_before_wall_ms < TTL_END);
            cmd.transient_rejections = r.transient_rejections;
            c.reserve(cmd.issue).unwrap();
        }
        // near the expiry: the jittered retry would land at/after it
        let cmd = DispatchedCommand {
            transient_rejections: 6,
            ..dispatched(1)
        };
        let d = classify_acceptance(&cmd, &msg, TTL_END - 1, 59_999, &policy).unwrap();
        let AcceptDecision::Expire(e) = d else {
            panic!("{d:?}")
        };
        assert_eq!(e.write.to().lifecycle(), Lifecycle::Expired);
        assert_eq!(e.write.edges(), [Edge::Requeue, Edge::Expire]);
        assert_eq!(e.detail.code, Code::CapacityExhausted.to_wire() as i32);
        // a zero delay just before the expiry still retries
        let d = classify_acceptance(&cmd, &msg, TTL_END - 1, 0, &policy).unwrap();
        assert!(matches!(d, AcceptDecision::Requeue(_)));
        // already past it
        assert!(matches!(
            classify_acceptance(&cmd, &msg, TTL_END, 0, &policy).unwrap(),
            AcceptDecision::Expire(_)
        ));
        // indefinite TTL: always requeued
        let cmd = DispatchedCommand {
            queue_expiry_ms: None,
            ..cmd
        };
        assert!(matches!(
            classify_acceptance(&cmd, &msg, i64::MAX - 1, u64::MAX, &policy).unwrap(),
            AcceptDecision::Requeue(_)
        ));
    }

    #[test]
    fn malformed_answers_are_refused_before_any_change() {
        let cmd = dispatched(3);
        let ok = positive(3);
        let cases: Vec<(wire::CommandAccepted, &str)> = vec![
            (
                wire::CommandAccepted {
                    issue_uuid: "nope".into(),
                    ..ok.clone()
                },
                "command_accepted.issue_uuid",
            ),
            (
                wire::CommandAccepted {
                    issue_uuid: issue(8).to_string(),
                    ..ok.clone()
                },
                "command_accepted.issue_uuid",
            ),
            (
                wire::CommandAccepted {
                    revision: 2,
                    ..ok.clone()
                },
                "command_accepted.revision",
            ),
            (
                wire::CommandAccepted {
                    outcome: 0,
                    ..ok.clone()
                },
                "command_accepted.outcome",
            ),
            (
                wire::CommandAccepted {
                    outcome: 9,
                    ..ok.clone()
                },
                "command_accepted.outcome",
            ),
            (
                wire::CommandAccepted {
                    resolved_shell: 0,
                    ..ok.clone()
                },
                "command_accepted.resolved_shell",
            ),
            (
                wire::CommandAccepted {
                    error: Some(wire::ErrorDetail::default()),
                    ..ok.clone()
                },
                "command_accepted.error",
            ),
        ];
        for (msg, field) in cases {
            let err = classify(&cmd, &msg, T0).unwrap_err();
            assert_eq!(err.field(), field, "{msg:?}");
            assert_eq!(err.to_domain_error().code(), Code::ProtocolError);
        }
        let mut neg = negative(wire::AcceptOutcome::Transient, Code::Unavailable, "busy");
        neg.revision = 3;
        let mut missing = neg.clone();
        missing.error = None;
        assert_eq!(classify(&cmd, &missing, T0), Err(AcceptError::MissingError));
        let mut bad_code = neg.clone();
        bad_code.error.as_mut().unwrap().code = 0;
        assert_eq!(
            classify(&cmd, &bad_code, T0),
            Err(AcceptError::ErrorCode(0))
        );
        let mut bad_class = neg.clone();
        bad_class.error.as_mut().unwrap().retry_class = 0;
        assert_eq!(
            classify(&cmd, &bad_class, T0),
            Err(AcceptError::RetryClass(0))
        );
        let mut mismatch = neg.clone();
        mismatch.error.as_mut().unwrap().retry_class = wire::RetryClass::Permanent as i32;
        assert_eq!(
            classify(&cmd, &mismatch, T0),
            Err(AcceptError::RetryClassMismatch {
                outcome: "TRANSIENT"
            })
        );
        // a conflicting answer for a command no longer dispatched
        let accepted = DispatchedCommand {
            state: CommandState::from_parts(Phase::Accepted, Revision(3)),
            ..cmd
        };
        assert_eq!(
            classify(&accepted, &neg, T0),
            Err(AcceptError::NotDispatched {
                phase: Phase::Accepted
            })
        );
        let expired = DispatchedCommand {
            state: CommandState::from_parts(Phase::Expired, Revision(3)),
            ..cmd
        };
        assert!(matches!(
            classify(&expired, &ok, T0),
            Err(AcceptError::NotDispatched { .. })
        ));
    }

    /// A signal taken while in flight raised the current revision; the
    /// answer still carries the dispatched revision and is accepted.
    #[test]
    fn answer_matches_the_dispatched_revision_not_the_current_one() {
        let cmd = DispatchedCommand {
            state: CommandState::from_parts(Phase::Dispatched, Revision(2)),
            ..dispatched(1)
        };
        let AcceptDecision::Accept(a) = classify(&cmd, &positive(1), T0).unwrap() else {
            panic!()
        };
        assert_eq!(
            a.write.to(),
            CommandState::from_parts(Phase::Accepted, Revision(2))
        );
        assert!(classify(&cmd, &positive(2), T0).is_err());
    }

    proptest! {
        /// No answer ever produces `failed` (or anything but accepted,
        /// queued, expired, rejected, and interrupted for a command its
        /// client already executed), and a requeue always stays under the
        /// TTL.
        #[test]
        fn answers_never_fail_a_command_and_retries_stay_under_the_ttl(
            outcome in 1i32..=4,
            earlier in 0u32..40,
            random in any::<u64>(),
            now_offset in -1_000_000i64..100_000,
        ) {
            let cmd = DispatchedCommand { transient_rejections: earlier, ..dispatched(1) };
            let msg = match outcome {
                1 => positive(1),
                2 => negative(wire::AcceptOutcome::Transient, Code::QuotaExceeded, "full"),
                3 => negative(wire::AcceptOutcome::Permanent, Code::AlreadyExecuted, "ran"),
                _ => negative(wire::AcceptOutcome::Permanent, Code::Conflict, "hash"),
            };
            let now = TTL_END + now_offset;
            let d = classify_acceptance(&cmd, &msg, now, random, &RetryPolicy::default()).unwrap();
            match d {
                AcceptDecision::Accept(a) => prop_assert_eq!(a.write.to().phase(), Phase::Accepted),
                AcceptDecision::Requeue(r) => {
                    prop_assert!(r.not_before_wall_ms < TTL_END);
                    prop_assert!(r.not_before_wall_ms - now <= 60_000);
                }
                AcceptDecision::Expire(e) => prop_assert_eq!(e.write.to().phase(), Phase::Expired),
                AcceptDecision::Reject(r) => prop_assert_eq!(r.write.to().phase(), Phase::Rejected),
                AcceptDecision::AlreadyExecuted(r) => {
                    prop_assert_eq!(r.write.to().phase(), Phase::Interrupted);
                }
                AcceptDecision::Repeat => prop_assert!(false, "dispatched is never a repeat"),
            }
        }
    }
}
