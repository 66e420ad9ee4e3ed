//! Operator signals (plan §6.4, R-6.4-35..38).

use rvbox_proto::v1 as wire;

/// What the dispatch core decided for a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalPlan {
    /// Never dispatched: the server ends it `cancelled` (R-6.4-35).
    CancelQueued,
    /// The client may hold it: a higher revision and a revisioned Signal
    /// (R-6.4-36); the visible lifecycle stays.
    Deliver,
}

/// The outcome of a `SignalCommand`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalOutcome {
    /// The response (stored; a replay returns the same).
    pub response: wire::SignalCommandResponse,
    /// The frame to send now, for a fresh `Deliver` decision.
    pub deliver: Option<wire::Signal>,
    /// True when this was a replay of an earlier request.
    pub replayed: bool,
    /// The command's client (where `deliver` goes).
    pub client_id: String,
}
