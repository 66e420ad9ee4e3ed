//! The dispatch decision for one command on its client's session (plan
//! §6.4; R-6.4-02/04/08/09/16).
//!
//! The caller (the client's serialized worker, see [`crate::ReadyQueue`])
//! reads the command and calls [`decide`]. On [`DispatchDecision::Dispatch`]
//! a shadow slot is already reserved; the caller then
//!
//! 1. applies the `queued -> dispatched` [`StateWrite`] (absent for a
//!    redispatch) and makes it durable, and only then
//! 2. queues the `Dispatch` frame carrying [`DispatchOrder::revision`] and
//!    [`DispatchOrder::queue_expiry_ms`] on the data lane (R-6.4-04).
//!
//! If the write does not happen (the row moved, e.g. a racing cancel, or the
//! store failed) the caller sends nothing and calls
//! [`crate::SessionCapacity::release`].
//!
//! A `dispatched` command that holds no shadow on the current session was
//! dispatched on an earlier session whose answer never arrived (a lost
//! acceptance): it is sent again with its current revision, and the client
//! answers an exact repeat with its existing acceptance (plan §7.3). It is
//! not sent again once past its queue expiry: the client would refuse it,
//! and reconciliation decides instead.

use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{CommandState, Phase, Revision};

use crate::capacity::{Refusal, SessionCapacity, Slot};
use crate::expiry::is_past;
use crate::write::StateWrite;

/// Whether the client's current session may receive dispatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionGate {
    /// No live session.
    Offline,
    /// A live session whose `ReconcileResult` has not been written yet
    /// (plan §6.4: dispatch stays disabled until it has).
    Reconciling,
    /// Live, and this session's `ReconcileResult` was written.
    Ready,
}

/// What the dispatcher knows about one stored command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandView {
    /// The command.
    pub issue: Uuid7,
    /// Stored phase and revision.
    pub state: CommandState,
    /// Stored absolute queue expiry; `None` for an indefinite TTL.
    pub queue_expiry_ms: Option<i64>,
    /// Stored backoff after a transient rejection: not before this wall
    /// time.
    pub retry_not_before_ms: Option<i64>,
}

/// The frame to send once the dispatch write is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchOrder {
    /// The command.
    pub issue: Uuid7,
    /// `Dispatch.revision`: the current revision. The matching
    /// `CommandAccepted` must carry it.
    pub revision: Revision,
    /// `Dispatch.queue_expiry_time`, unchanged since creation.
    pub queue_expiry_ms: Option<i64>,
    /// The shadow slot reserved for it.
    pub slot: Slot,
}

/// Why nothing is sent now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitReason {
    /// The client has no live session.
    NoSession,
    /// The session is still reconciling.
    Reconciling,
    /// Backing off after a transient rejection.
    Backoff {
        /// Retry at or after this wall time.
        until_wall_ms: i64,
    },
    /// Already in flight on this session; its answer is pending.
    InFlight,
    /// Dispatched, past its queue expiry, acceptance unknown: the derived
    /// "expired pending reconciliation" state. Never sent again.
    LatePendingReconciliation,
    /// No client slot, counting shadows.
    NoCapacity(Refusal),
}

/// The dispatcher's decision for one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchDecision {
    /// A slot is reserved: durably apply `write` (if any), then send `order`.
    Dispatch {
        /// `queued -> dispatched`; `None` when re-sending a `dispatched`
        /// command on a new session.
        write: Option<StateWrite>,
        /// The frame contents.
        order: DispatchOrder,
    },
    /// Queued past its expiry: write terminal `expired` instead.
    Expire(StateWrite),
    /// Keep it; nothing to send now.
    Wait(WaitReason),
    /// Not dispatch work any more (accepted, running or terminal).
    NotDispatchable(Phase),
}

/// Decides what to do with `cmd` for a session in `gate` with `capacity`.
/// Reserves the shadow slot when the decision is `Dispatch`.
pub fn decide(
    cmd: &CommandView,
    gate: SessionGate,
    capacity: &mut SessionCapacity,
    now_wall_ms: i64,
) -> DispatchDecision {
    let phase = cmd.state.phase();
    if !matches!(phase, Phase::Queued | Phase::Dispatched) {
        return DispatchDecision::NotDispatchable(phase);
    }
    // plan §6.4: expiry applies whether or not the client is online.
    if is_past(cmd.queue_expiry_ms, now_wall_ms) {
        return match StateWrite::at(cmd.state).then(Phase::Expired) {
            Ok(write) => DispatchDecision::Expire(write),
            Err(_) => DispatchDecision::Wait(WaitReason::LatePendingReconciliation),
        };
    }
    match gate {
        SessionGate::Offline => return DispatchDecision::Wait(WaitReason::NoSession),
        SessionGate::Reconciling => return DispatchDecision::Wait(WaitReason::Reconciling),
        SessionGate::Ready => {}
    }
    if phase == Phase::Dispatched && capacity.holds(cmd.issue) {
        return DispatchDecision::Wait(WaitReason::InFlight);
    }
    if phase == Phase::Queued
        && let Some(until) = cmd.retry_not_before_ms.filter(|t| now_wall_ms < *t)
    {
        return DispatchDecision::Wait(WaitReason::Backoff {
            until_wall_ms: until,
        });
    }
    let write = if phase == Phase::Queued {
        match StateWrite::at(cmd.state).then(Phase::Dispatched) {
            Ok(w) => Some(w),
            Err(_) => return DispatchDecision::NotDispatchable(phase),
        }
    } else {
        None
    };
    match capacity.reserve(cmd.issue) {
        Ok(slot) => DispatchDecision::Dispatch {
            write,
            order: DispatchOrder {
                issue: cmd.issue,
                revision: cmd.state.revision(),
                queue_expiry_ms: cmd.queue_expiry_ms,
                slot,
            },
        },
        Err(refusal) => DispatchDecision::Wait(WaitReason::NoCapacity(refusal)),
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

    use rvbox_domain::lifecycle::Edge;
    use rvbox_proto::v1 as wire;

    use super::*;
    use crate::capacity::ShadowSettle;
    use crate::testutil::issue;

    const T0: i64 = 1_700_000_000_000;

    fn view(n: u64, phase: Phase) -> CommandView {
        CommandView {
            issue: issue(n),
            state: CommandState::from_parts(phase, Revision(1)),
            queue_expiry_ms: Some(T0 + 60_000),
            retry_not_before_ms: None,
        }
    }

    fn ready_capacity(max_running: u32, max_queued: u32) -> SessionCapacity {
        let mut c = SessionCapacity::new();
        c.apply_report(&wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running,
            max_queued,
        })
        .unwrap();
        c
    }

    #[test]
    fn queued_is_dispatched_with_a_write_before_the_frame() {
        let mut c = ready_capacity(1, 0);
        let v = view(1, Phase::Queued);
        let DispatchDecision::Dispatch { write, order } =
            decide(&v, SessionGate::Ready, &mut c, T0)
        else {
            panic!()
        };
        let w = write.unwrap();
        assert_eq!(w.to().phase(), Phase::Dispatched);
        assert_eq!(w.edges(), [Edge::Dispatch]);
        assert_eq!(order.revision, Revision(1));
        assert_eq!(order.queue_expiry_ms, v.queue_expiry_ms);
        assert_eq!(order.slot, Slot::Running);
        assert!(c.holds(v.issue));
        // the next command finds the client full
        assert_eq!(
            decide(&view(2, Phase::Queued), SessionGate::Ready, &mut c, T0),
            DispatchDecision::Wait(WaitReason::NoCapacity(Refusal::Full {
                counted: 1,
                slots: 1
            }))
        );
    }

    #[test]
    fn dispatch_waits_for_a_reconciled_session_and_a_report() {
        let v = view(1, Phase::Queued);
        let mut c = SessionCapacity::new();
        assert_eq!(
            decide(&v, SessionGate::Offline, &mut c, T0),
            DispatchDecision::Wait(WaitReason::NoSession)
        );
        assert_eq!(
            decide(&v, SessionGate::Reconciling, &mut c, T0),
            DispatchDecision::Wait(WaitReason::Reconciling)
        );
        assert_eq!(
            decide(&v, SessionGate::Ready, &mut c, T0),
            DispatchDecision::Wait(WaitReason::NoCapacity(Refusal::NoReport))
        );
        assert_eq!(c.shadow_len(), 0);
    }

    /// R-6.5-09: dispatch retry after a lost acceptance. The command stays
    /// `dispatched`, is not re-sent on the same session, and is re-sent with
    /// no lifecycle write after reconnect.
    #[test]
    fn lost_acceptance_is_retried_after_reconnect() {
        let mut c = ready_capacity(4, 0);
        let queued = view(1, Phase::Queued);
        assert!(matches!(
            decide(&queued, SessionGate::Ready, &mut c, T0),
            DispatchDecision::Dispatch { write: Some(_), .. }
        ));
        let dispatched = CommandView {
            state: CommandState::from_parts(Phase::Dispatched, Revision(1)),
            ..queued
        };
        assert_eq!(
            decide(&dispatched, SessionGate::Ready, &mut c, T0 + 1),
            DispatchDecision::Wait(WaitReason::InFlight)
        );
        // the session dies before CommandAccepted arrives
        c.close();
        assert_eq!(
            decide(&dispatched, SessionGate::Offline, &mut c, T0 + 2),
            DispatchDecision::Wait(WaitReason::NoSession)
        );
        assert_eq!(
            decide(&dispatched, SessionGate::Reconciling, &mut c, T0 + 3),
            DispatchDecision::Wait(WaitReason::Reconciling)
        );
        c.apply_report(&wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 4,
            max_queued: 0,
        })
        .unwrap();
        let DispatchDecision::Dispatch { write, order } =
            decide(&dispatched, SessionGate::Ready, &mut c, T0 + 4)
        else {
            panic!("re-sent after reconnect")
        };
        assert_eq!(write, None, "the lifecycle stays dispatched");
        assert_eq!(order.revision, Revision(1));
        assert!(c.holds(dispatched.issue));
        // the replayed positive answer settles it like any other
        assert!(c.settle(dispatched.issue, ShadowSettle::AwaitReport));
    }

    #[test]
    fn expiry_wins_over_dispatch_and_dispatched_is_protected() {
        let mut c = ready_capacity(4, 0);
        let queued = view(1, Phase::Queued);
        let at = queued.queue_expiry_ms.unwrap();
        let DispatchDecision::Expire(w) = decide(&queued, SessionGate::Offline, &mut c, at) else {
            panic!("a queued command past its TTL expires, online or not")
        };
        assert_eq!(w.to().phase(), Phase::Expired);
        assert_eq!(c.shadow_len(), 0);
        let dispatched = view(1, Phase::Dispatched);
        assert_eq!(
            decide(&dispatched, SessionGate::Ready, &mut c, at),
            DispatchDecision::Wait(WaitReason::LatePendingReconciliation)
        );
        assert_eq!(c.shadow_len(), 0, "never re-sent past its expiry");
        let no_ttl = CommandView {
            queue_expiry_ms: None,
            ..queued
        };
        assert!(matches!(
            decide(&no_ttl, SessionGate::Ready, &mut c, i64::MAX),
            DispatchDecision::Dispatch { .. }
        ));
    }

    #[test]
    fn backoff_delays_a_requeued_command() {
        let mut c = ready_capacity(4, 0);
        let v = CommandView {
            retry_not_before_ms: Some(T0 + 5_000),
            ..view(1, Phase::Queued)
        };
        assert_eq!(
            decide(&v, SessionGate::Ready, &mut c, T0 + 4_999),
            DispatchDecision::Wait(WaitReason::Backoff {
                until_wall_ms: T0 + 5_000
            })
        );
        assert!(matches!(
            decide(&v, SessionGate::Ready, &mut c, T0 + 5_000),
            DispatchDecision::Dispatch { .. }
        ));
    }

    #[test]
    fn accepted_and_terminal_are_not_dispatch_work() {
        let mut c = ready_capacity(4, 0);
        for p in Phase::ALL {
            if matches!(p, Phase::Queued | Phase::Dispatched) {
                continue;
            }
            assert_eq!(
                decide(&view(1, p), SessionGate::Ready, &mut c, T0 + 120_000),
                DispatchDecision::NotDispatchable(p)
            );
        }
        assert_eq!(c.shadow_len(), 0);
    }
}
