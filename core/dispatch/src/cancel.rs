//! Kill / cancel and the launch-cancel race, server side (plan §6.4;
//! R-6.4-35..38, R-6.4-12).
//!
//! "Handle pre-start `kill` locally only for work that has never been
//! dispatched. For dispatched or accepted work, persist a higher revision and
//! send the revisioned signal while retaining the existing visible lifecycle
//! until the client resolves the race."
//!
//! Every signal takes the next revision, a queued cancel included (the
//! control response reports it). The control `request_id` is mapped to that
//! revision by the caller's mutation table; the agent [`wire::Signal`]
//! carries only issue, revision and signal, so the request id can never
//! cross the agent protocol (R-6.4-38).
//!
//! The client resolves the race with the domain's
//! [`CommandState::resolve_cancel`]: before launch authorization it reports a
//! revisioned `cancelled` lifecycle; after it, it delivers the signal and
//! later reports the actual outcome. [`apply_lifecycle_evidence`] applies
//! that evidence under the domain's revision rules.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{
    CommandState, Lifecycle, Phase, Revision, RevisionOrder, TransitionError,
};
use rvbox_proto::v1 as wire;
use thiserror::Error;

use crate::write::StateWrite;

/// What a signal request does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignalDecision {
    /// Never dispatched: terminal `cancelled` on the server, at the next
    /// revision. No frame is sent.
    CancelQueued {
        /// `queued@r -> cancelled@r+1`.
        write: StateWrite,
        /// The revision assigned to the request.
        revision: Revision,
    },
    /// Dispatched, accepted or running: durably take the next revision with
    /// the visible lifecycle unchanged, then send `after_durable`.
    Deliver {
        /// `phase@r -> phase@r+1`.
        write: StateWrite,
        /// The revision assigned to the request.
        revision: Revision,
        /// The visible lifecycle, unchanged until the client resolves it.
        lifecycle: Lifecycle,
        /// The revisioned signal, to send (after any pending `Dispatch`
        /// frame, on the data lane) only once `write` is durable; resend it
        /// after a reconnect while the recorded revision is still above the
        /// last answered one.
        after_durable: wire::Signal,
    },
}

impl SignalDecision {
    /// The revision assigned to the request.
    #[must_use]
    pub fn revision(&self) -> Revision {
        match self {
            Self::CancelQueued { revision, .. } | Self::Deliver { revision, .. } => *revision,
        }
    }

    /// The visible lifecycle to answer the control request with.
    #[must_use]
    pub fn lifecycle(&self) -> Lifecycle {
        match self {
            Self::CancelQueued { .. } => Lifecycle::Cancelled,
            Self::Deliver { lifecycle, .. } => *lifecycle,
        }
    }
}

/// A signal request that cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SignalError {
    /// The signal is unspecified or unknown.
    #[error("signal {0} is unspecified or unknown")]
    Kind(i32),
    /// The command is terminal: no signal after terminal.
    #[error("command is already {0}; it cannot be signalled")]
    Terminal(Lifecycle),
    /// The domain refused the write.
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

impl SignalError {
    /// The control-API error: `INVALID_ARGUMENT` on `signal`, or
    /// `ILLEGAL_TRANSITION` for a terminal command.
    #[must_use]
    pub fn to_domain_error(&self) -> DomainError {
        match self {
            Self::Kind(_) => {
                DomainError::new(Code::InvalidArgument, self.to_string()).with_field("signal")
            }
            Self::Terminal(_) => DomainError::new(Code::IllegalTransition, self.to_string()),
            Self::Transition(e) => DomainError::from(e.clone()),
        }
    }
}

/// Decides a signal (`kill`, or any other kind) for command `issue` in
/// `state`.
///
/// # Errors
/// [`SignalError`] for an unspecified signal, a terminal command or an
/// exhausted revision counter.
pub fn decide_signal(
    issue: Uuid7,
    state: CommandState,
    kind: i32,
) -> Result<SignalDecision, SignalError> {
    let kind = match wire::SignalKind::try_from(kind) {
        Ok(wire::SignalKind::Unspecified) | Err(_) => return Err(SignalError::Kind(kind)),
        Ok(k) => k,
    };
    if state.phase().is_terminal() {
        return Err(SignalError::Terminal(state.lifecycle()));
    }
    let (write, revision) = StateWrite::at(state).bump()?;
    if state.phase() == Phase::Queued {
        // plan §6.4: never dispatched, so the server alone decides.
        return Ok(SignalDecision::CancelQueued {
            write: write.then(Phase::Cancelled)?,
            revision,
        });
    }
    Ok(SignalDecision::Deliver {
        write,
        revision,
        lifecycle: state.lifecycle(),
        after_durable: wire::Signal {
            issue_uuid: issue.to_string(),
            revision: revision.0,
            signal: kind as i32,
        },
    })
}

/// How an evidence revision relates to the recorded one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevisionCheck {
    /// Made under the current revision.
    Current,
    /// Made under an older revision, before the client saw a later signal
    /// (e.g. launch was authorized before the cancel arrived). The fact is
    /// kept; the recorded revision is not lowered (revisions only grow).
    Stale {
        /// Revision the client acted under.
        incoming: Revision,
        /// Recorded revision.
        current: Revision,
    },
}

/// What a client `LifecycleChange` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// Advance to the actual lifecycle.
    Advance {
        /// The compare-and-set write (the revision is kept).
        write: StateWrite,
        /// How the evidence revision relates to the recorded one.
        revision: RevisionCheck,
    },
    /// Already at that lifecycle: nothing to write.
    Repeat,
}

/// Client lifecycle evidence that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EvidenceError {
    /// `lifecycle` is unspecified or unknown.
    #[error("lifecycle_change.lifecycle {0} is unspecified or unknown")]
    Lifecycle(i32),
    /// A lifecycle only the server sets (queued, dispatched, accepted,
    /// expired).
    #[error("lifecycle_change.lifecycle {0} is not reported by a client")]
    NotClientEvidence(Lifecycle),
    /// `revision` is 0.
    #[error("lifecycle_change.revision must be at least 1")]
    ZeroRevision,
    /// A revision the server never issued.
    #[error("lifecycle_change.revision {incoming} is above the recorded revision {current}")]
    FutureRevision {
        /// Offered.
        incoming: u64,
        /// Recorded.
        current: u64,
    },
    /// The edge is not legal from the recorded state (e.g. `cancelled` after
    /// `running`, or anything after a terminal state): a contradiction the
    /// caller records as an incident, never applied.
    #[error(transparent)]
    Contradiction(#[from] TransitionError),
}

impl EvidenceError {
    /// `PROTOCOL_ERROR` naming the field; a contradiction keeps the
    /// domain's code.
    #[must_use]
    pub fn to_domain_error(&self) -> DomainError {
        let field = match self {
            Self::Lifecycle(_) | Self::NotClientEvidence(_) => "lifecycle_change.lifecycle",
            Self::ZeroRevision | Self::FutureRevision { .. } => "lifecycle_change.revision",
            Self::Contradiction(e) => return DomainError::from(e.clone()),
        };
        DomainError::new(Code::ProtocolError, self.to_string()).with_field(field)
    }
}

/// The server-side path to an actual client phase. The server never sees
/// the client's internal launch phases, so `running` from `accepted`
/// records the edges the client necessarily took.
fn path_to(from: Phase, to: Phase) -> &'static [Phase] {
    match (from, to) {
        (Phase::Accepted, Phase::Running) => &[
            Phase::LaunchPrepared,
            Phase::LaunchAuthorized,
            Phase::Running,
        ],
        (Phase::LaunchPrepared, Phase::Running) => &[Phase::LaunchAuthorized, Phase::Running],
        _ => &[],
    }
}

/// Applies a client `LifecycleChange` to the recorded `state`.
///
/// Revisions follow the domain rule ([`CommandState::observe_revision`]):
/// a revision above the recorded one was never issued and is refused; an
/// older one is evidence made before the client saw a later signal, so the
/// actual lifecycle is kept (plan §6.4 "retain [...] actual terminal
/// outcome") while the recorded revision stays.
///
/// # Errors
/// [`EvidenceError`]; nothing is written then.
pub fn apply_lifecycle_evidence(
    state: CommandState,
    change: &wire::LifecycleChange,
) -> Result<Evidence, EvidenceError> {
    let to = Lifecycle::from_wire(change.lifecycle)
        .map_err(|_| EvidenceError::Lifecycle(change.lifecycle))?;
    let to_phase = match to {
        Lifecycle::Running => Phase::Running,
        Lifecycle::Succeeded => Phase::Succeeded,
        Lifecycle::Failed => Phase::Failed,
        Lifecycle::Terminated => Phase::Terminated,
        Lifecycle::Interrupted => Phase::Interrupted,
        Lifecycle::Rejected => Phase::Rejected,
        Lifecycle::Cancelled => Phase::Cancelled,
        Lifecycle::Queued | Lifecycle::Dispatched | Lifecycle::Accepted | Lifecycle::Expired => {
            return Err(EvidenceError::NotClientEvidence(to));
        }
    };
    if change.revision == 0 {
        return Err(EvidenceError::ZeroRevision);
    }
    let incoming = Revision(change.revision);
    let mut probe = state;
    let revision = match probe.observe_revision(incoming) {
        Ok(RevisionOrder::Same) => RevisionCheck::Current,
        Ok(RevisionOrder::Newer) => {
            return Err(EvidenceError::FutureRevision {
                incoming: incoming.0,
                current: state.revision().0,
            });
        }
        Err(_) => RevisionCheck::Stale {
            incoming,
            current: state.revision(),
        },
    };
    if state.lifecycle() == to {
        return Ok(Evidence::Repeat);
    }
    let path = path_to(state.phase(), to_phase);
    let mut write = StateWrite::at(state);
    if path.is_empty() {
        write = write.then(to_phase)?;
    } else {
        for p in path {
            write = write.then(*p)?;
        }
    }
    Ok(Evidence::Advance { write, revision })
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use rvbox_domain::lifecycle::{CancelResolution, Edge};

    use super::*;
    use crate::capacity::SessionCapacity;
    use crate::decide::{CommandView, DispatchDecision, SessionGate, decide};
    use crate::testutil::issue;

    const TERM: i32 = wire::SignalKind::Term as i32;

    fn change(l: Lifecycle, rev: u64) -> wire::LifecycleChange {
        wire::LifecycleChange {
            lifecycle: l.to_wire() as i32,
            revision: rev,
            ..Default::default()
        }
    }

    /// The store's compare-and-set: applies only if the row is at `from`.
    fn apply(row: &mut CommandState, w: &StateWrite) -> bool {
        if *row != w.from() {
            return false;
        }
        *row = w.to();
        true
    }

    fn advance(state: CommandState, c: &wire::LifecycleChange) -> (CommandState, RevisionCheck) {
        match apply_lifecycle_evidence(state, c).unwrap() {
            Evidence::Advance { write, revision } => (write.to(), revision),
            Evidence::Repeat => panic!("not a repeat"),
        }
    }

    /// R-6.5-14: cancellation before launch. Queued: terminal `cancelled`
    /// on the server, no frame. Dispatched: a revisioned signal, lifecycle
    /// unchanged until the client's revisioned `cancelled`.
    #[test]
    fn cancellation_before_launch() {
        let queued = CommandState::from_parts(Phase::Queued, Revision(1));
        let d = decide_signal(issue(1), queued, TERM).unwrap();
        assert_eq!(d.lifecycle(), Lifecycle::Cancelled);
        assert_eq!(d.revision(), Revision(2));
        let SignalDecision::CancelQueued { write, .. } = d else {
            panic!()
        };
        assert_eq!(write.from(), queued);
        assert_eq!(
            write.to(),
            CommandState::from_parts(Phase::Cancelled, Revision(2))
        );
        assert_eq!(write.edges(), [Edge::Cancel]);

        let dispatched = CommandState::from_parts(Phase::Dispatched, Revision(1));
        let d = decide_signal(issue(1), dispatched, TERM).unwrap();
        assert_eq!(
            d.lifecycle(),
            Lifecycle::Dispatched,
            "visible lifecycle kept"
        );
        let SignalDecision::Deliver {
            write,
            after_durable,
            ..
        } = d
        else {
            panic!()
        };
        assert!(!write.changes_phase());
        assert_eq!(write.to().revision(), Revision(2));
        assert_eq!(after_durable.revision, 2);
        // client side: the Dispatch arrives, then the Signal before launch
        let mut client = CommandState::from_parts(Phase::Accepted, Revision(1));
        client
            .observe_revision(Revision(after_durable.revision))
            .unwrap();
        assert_eq!(client.resolve_cancel(), CancelResolution::Cancel);
        // server: positive acceptance came first, then the cancelled evidence
        let server = CommandState::from_parts(Phase::Accepted, Revision(2));
        let (s, rev) = advance(server, &change(Lifecycle::Cancelled, 2));
        assert_eq!(s, CommandState::from_parts(Phase::Cancelled, Revision(2)));
        assert_eq!(rev, RevisionCheck::Current);
    }

    /// R-6.5-15: the launch/cancel race, both ways, with the client's real
    /// compare-and-transition.
    #[test]
    fn launch_cancel_race() {
        // the server signals an accepted command: revision 1 -> 2
        let server = CommandState::from_parts(Phase::Accepted, Revision(1));
        let SignalDecision::Deliver {
            write,
            after_durable,
            ..
        } = decide_signal(issue(1), server, wire::SignalKind::Kill as i32).unwrap()
        else {
            panic!()
        };
        let server = write.to();
        let signal_rev = Revision(after_durable.revision);

        // (a) cancel wins: the launcher was prepared under revision 1
        let mut client = CommandState::from_parts(Phase::LaunchPrepared, Revision(1));
        client.observe_revision(signal_rev).unwrap();
        assert!(matches!(
            client.compare_and_transition(Revision(1), Phase::LaunchAuthorized),
            Err(TransitionError::StaleRevision { .. })
        ));
        assert_eq!(client.resolve_cancel(), CancelResolution::Cancel);
        client
            .compare_and_transition(signal_rev, Phase::Cancelled)
            .unwrap();
        let (s, rev) = advance(server, &change(client.lifecycle(), client.revision().0));
        assert_eq!(s.lifecycle(), Lifecycle::Cancelled);
        assert_eq!(rev, RevisionCheck::Current);

        // (b) launch wins: authorized under revision 1 before the signal
        let mut client = CommandState::from_parts(Phase::LaunchPrepared, Revision(1));
        client
            .compare_and_transition(Revision(1), Phase::LaunchAuthorized)
            .unwrap();
        client
            .compare_and_transition(Revision(1), Phase::Running)
            .unwrap();
        let (s, rev) = advance(server, &change(Lifecycle::Running, 1));
        assert_eq!(s, CommandState::from_parts(Phase::Running, Revision(2)));
        assert_eq!(
            rev,
            RevisionCheck::Stale {
                incoming: Revision(1),
                current: Revision(2)
            },
            "actual running kept; the revision is not lowered"
        );
        client.observe_revision(signal_rev).unwrap();
        assert_eq!(client.resolve_cancel(), CancelResolution::DeliverSignal);
        // a `cancelled` claim after running contradicts authorization
        assert!(matches!(
            apply_lifecycle_evidence(s, &change(Lifecycle::Cancelled, 2)),
            Err(EvidenceError::Contradiction(_))
        ));
        let (end, rev) = advance(s, &change(Lifecycle::Terminated, 2));
        assert_eq!(end.lifecycle(), Lifecycle::Terminated);
        assert_eq!(rev, RevisionCheck::Current);
    }

    /// The server-side race between the dispatcher and a cancel of a queued
    /// command: both decide from `queued@1`; whichever write lands first
    /// wins, and the loser's compare-and-set does nothing.
    #[test]
    fn dispatch_and_queued_cancel_race_through_the_compare_and_set() {
        let start = CommandState::from_parts(Phase::Queued, Revision(1));
        let view = CommandView {
            issue: issue(1),
            state: start,
            queue_expiry_ms: None,
            retry_not_before_ms: None,
        };
        let report = wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 1,
            max_queued: 0,
        };

        // cancel lands first: the dispatch write fails, no frame, shadow freed
        let mut row = start;
        let mut cap = SessionCapacity::new();
        cap.apply_report(&report).unwrap();
        let DispatchDecision::Dispatch {
            write: Some(dw), ..
        } = decide(&view, SessionGate::Ready, &mut cap, 0)
        else {
            panic!()
        };
        let SignalDecision::CancelQueued { write: cw, .. } =
            decide_signal(issue(1), start, TERM).unwrap()
        else {
            panic!()
        };
        assert!(apply(&mut row, &cw));
        assert!(!apply(&mut row, &dw));
        assert!(cap.release(issue(1)).is_some());
        assert_eq!(row.lifecycle(), Lifecycle::Cancelled);

        // dispatch lands first: the cancel write fails; re-decided, it
        // becomes a revisioned signal
        let mut row = start;
        assert!(apply(&mut row, &dw));
        assert!(!apply(&mut row, &cw));
        let SignalDecision::Deliver { write, .. } = decide_signal(issue(1), row, TERM).unwrap()
        else {
            panic!()
        };
        assert!(apply(&mut row, &write));
        assert_eq!(
            row,
            CommandState::from_parts(Phase::Dispatched, Revision(2))
        );
    }

    #[test]
    fn signal_refusals() {
        let s = CommandState::from_parts(Phase::Running, Revision(1));
        assert_eq!(decide_signal(issue(1), s, 0), Err(SignalError::Kind(0)));
        assert_eq!(decide_signal(issue(1), s, 99), Err(SignalError::Kind(99)));
        assert_eq!(SignalError::Kind(0).to_domain_error().field(), "signal");
        for p in Phase::ALL.into_iter().filter(|p| p.is_terminal()) {
            let e = decide_signal(issue(1), CommandState::from_parts(p, Revision(4)), TERM)
                .unwrap_err();
            assert_eq!(e, SignalError::Terminal(p.lifecycle()));
            assert_eq!(e.to_domain_error().code(), Code::IllegalTransition);
        }
        let e = decide_signal(
            issue(1),
            CommandState::from_parts(Phase::Running, Revision(u64::MAX)),
            TERM,
        )
        .unwrap_err();
        assert_eq!(
            e,
            SignalError::Transition(TransitionError::RevisionExhausted)
        );
        // running: a plain revisioned signal of the requested kind
        let SignalDecision::Deliver { after_durable, .. } =
            decide_signal(issue(1), s, wire::SignalKind::Usr1 as i32).unwrap()
        else {
            panic!()
        };
        // R-6.4-38: the agent Signal has exactly these fields, no request id
        let wire::Signal {
            issue_uuid,
            revision,
            signal,
        } = after_durable;
        assert_eq!(issue_uuid, issue(1).to_string());
        assert_eq!(revision, 2);
        assert_eq!(signal, wire::SignalKind::Usr1 as i32);
    }

    #[test]
    fn evidence_refusals_and_repeats() {
        let s = CommandState::from_parts(Phase::Accepted, Revision(2));
        assert_eq!(
            apply_lifecycle_evidence(s, &change(Lifecycle::Running, 3)),
            Err(EvidenceError::FutureRevision {
                incoming: 3,
                current: 2
            })
        );
        assert_eq!(
            apply_lifecycle_evidence(s, &change(Lifecycle::Running, 0)),
            Err(EvidenceError::ZeroRevision)
        );
        for l in [
            Lifecycle::Queued,
            Lifecycle::Dispatched,
            Lifecycle::Accepted,
            Lifecycle::Expired,
        ] {
            let e = apply_lifecycle_evidence(s, &change(l, 2)).unwrap_err();
            assert_eq!(e, EvidenceError::NotClientEvidence(l));
            assert_eq!(e.to_domain_error().field(), "lifecycle_change.lifecycle");
        }
        let mut bad = change(Lifecycle::Running, 2);
        bad.lifecycle = 0;
        assert_eq!(
            apply_lifecycle_evidence(s, &bad),
            Err(EvidenceError::Lifecycle(0))
        );
        // accepted -> running records the client's launch edges
        let Evidence::Advance { write, .. } =
            apply_lifecycle_evidence(s, &change(Lifecycle::Running, 2)).unwrap()
        else {
            panic!()
        };
        assert_eq!(write.edges(), [Edge::Prepare, Edge::Authorize, Edge::Exec]);
        let running = write.to();
        assert_eq!(
            apply_lifecycle_evidence(running, &change(Lifecycle::Running, 2)),
            Ok(Evidence::Repeat)
        );
        // terminal is immutable: a different outcome is a contradiction
        let done = CommandState::from_parts(Phase::Succeeded, Revision(2));
        let e = apply_lifecycle_evidence(done, &change(Lifecycle::Failed, 2)).unwrap_err();
        assert!(matches!(
            e,
            EvidenceError::Contradiction(TransitionError::FromTerminal { .. })
        ));
        assert_eq!(e.to_domain_error().code(), Code::IllegalTransition);
        // dispatched -> running skips the acceptance: refused
        let d = CommandState::from_parts(Phase::Dispatched, Revision(1));
        assert!(apply_lifecycle_evidence(d, &change(Lifecycle::Running, 1)).is_err());
        // accepted -> rejected (preparation failed) is client evidence
        let (r, _) = advance(s, &change(Lifecycle::Rejected, 2));
        assert_eq!(r.lifecycle(), Lifecycle::Rejected);
    }

    /// R-6.4-12: after a late acceptance (revision bumped for TERM), every
    /// actual event is kept and the lifecycle follows the actual outcome,
    /// including a success that beat the TERM.
    #[test]
    fn actual_outcome_after_late_acceptance_is_kept() {
        let accepted_late = CommandState::from_parts(Phase::Accepted, Revision(2));
        let (running, rev) = advance(accepted_late, &change(Lifecycle::Running, 1));
        assert!(matches!(rev, RevisionCheck::Stale { .. }));
        let (done, _) = advance(running, &change(Lifecycle::Succeeded, 1));
        assert_eq!(
            done,
            CommandState::from_parts(Phase::Succeeded, Revision(2))
        );
    }
}
