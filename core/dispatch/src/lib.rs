//! RVBox dispatch core (plan §6.4, server side).
//!
//! Owns the decisions between a durable `queued` command and a client that
//! took it: per-session client capacity with shadow reservations for
//! in-flight dispatches ([`SessionCapacity`]), the fair global ready queue
//! with one serialized worker per client ([`ReadyQueue`]), the dispatch /
//! wait / expire decision ([`decide()`]), the absolute queue expiry and its
//! derived "expired pending reconciliation" indicator ([`expiry`]),
//! classification of `CommandAccepted` with bounded jittered backoff
//! ([`classify_acceptance`], [`RetryPolicy`]), and the kill / launch-cancel
//! race as seen by the server ([`decide_signal`], [`apply_lifecycle_evidence`]).
//!
//! Every decision is a plain value: a compare-and-set [`StateWrite`] the
//! store applies in a transaction, an incident intent, a frame to send only
//! after the write is durable. The core never assumes a write happened.
//!
//! Must never: do I/O, read a clock, draw randomness, spawn threads or read
//! the environment. Wall time (`now_wall_ms`) and jitter entropy
//! (`random: u64`) are arguments. Reconciliation of a reconnecting client's
//! snapshot is not here (`rvbox-reconcile` owns it).

#![warn(missing_docs)]

pub mod accept;
pub mod backoff;
pub mod cancel;
pub mod capacity;
pub mod decide;
pub mod expiry;
pub mod ready;
pub mod write;

pub use accept::{
    AcceptDecision, AcceptError, Acceptance, DispatchedCommand, IncidentIntent,
    MAX_ERROR_FIELD_BYTES, Rejection, Requeue, TransientExpiry, classify_acceptance,
};
pub use backoff::{MAX_RETRY_BACKOFF_MS, RetryPolicy, RetryPolicyError};
pub use cancel::{
    Evidence, EvidenceError, RevisionCheck, SignalDecision, SignalError, apply_lifecycle_evidence,
    decide_signal,
};
pub use capacity::{
    CapacityError, CapacityReport, MAX_CLIENT_QUEUED, MAX_CLIENT_RUNNING, MIN_CLIENT_RUNNING,
    Refusal, SessionCapacity, ShadowSettle, ShadowState, Slot,
};
pub use decide::{CommandView, DispatchDecision, DispatchOrder, SessionGate, WaitReason, decide};
pub use expiry::{
    ExpiryDecision, check_expiry, is_past, late_pending_reconciliation, queue_expiry_ms,
};
pub use ready::{MAX_TRACKED_CLIENTS, ReadyError, ReadyQueue};
pub use write::StateWrite;

#[cfg(test)]
pub(crate) mod testutil {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use rvbox_domain::ids::Uuid7;

    /// A distinct UUIDv7 per `n` (`n < 2^48`).
    pub(crate) fn issue(n: u64) -> Uuid7 {
        let mut b = [0u8; 16];
        b[..6].copy_from_slice(&[0x01, 0x90, 0x00, 0x00, 0x00, 0x00]);
        b[6] = 0x70;
        b[8] = 0x80;
        b[10..16].copy_from_slice(&n.to_be_bytes()[2..8]);
        Uuid7::from_bytes("test.issue_uuid", b).unwrap()
    }
}
