//! Queue expiry (plan §6.4; R-6.4-08..14, spec-mapping "Expiry").
//!
//! The TTL applies until server-confirmed acceptance. The absolute
//! `queue_expiry_time` is fixed once, at creation, from the server clock
//! ([`queue_expiry_ms`]) and never recomputed after a configuration change
//! or a retry: every function here takes the stored absolute value.
//!
//! - `queued` (never dispatched, or returned to the queue by a definite
//!   answer) past it: terminal `expired`.
//! - `dispatched` past it: acceptance is uncertain, so the lifecycle is
//!   kept and a derived "expired pending reconciliation" indicator is shown;
//!   no terminal event is written.
//! - `accepted` or later: no effect.
//!
//! A time `t` is past the expiry when `t >= expiry`, the same boundary the
//! client applies when it refuses a dispatch already past it.

use rvbox_domain::lifecycle::{CommandState, Phase};

use crate::write::StateWrite;

/// The absolute expiry for a command created at `created_wall_ms` with
/// `ttl_ms`; `None` for an indefinite TTL (0). Saturates at `i64::MAX`.
#[must_use]
pub fn queue_expiry_ms(created_wall_ms: i64, ttl_ms: u64) -> Option<i64> {
    if ttl_ms == 0 {
        return None;
    }
    let ttl = i64::try_from(ttl_ms).unwrap_or(i64::MAX);
    Some(created_wall_ms.saturating_add(ttl))
}

/// Whether `now_wall_ms` is past `queue_expiry_ms` (never, without a TTL).
#[must_use]
pub fn is_past(queue_expiry_ms: Option<i64>, now_wall_ms: i64) -> bool {
    queue_expiry_ms.is_some_and(|e| now_wall_ms >= e)
}

/// The derived indicator: dispatched, past its TTL, acceptance unknown.
#[must_use]
pub fn late_pending_reconciliation(
    phase: Phase,
    queue_expiry_ms: Option<i64>,
    now_wall_ms: i64,
) -> bool {
    phase == Phase::Dispatched && is_past(queue_expiry_ms, now_wall_ms)
}

/// What the expiry index should do with one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpiryDecision {
    /// Indefinite TTL.
    NoTtl,
    /// Not yet; look again at `at_wall_ms`.
    NotDue {
        /// The stored absolute expiry.
        at_wall_ms: i64,
    },
    /// Queued and past it: write terminal `expired` (compare-and-set on
    /// phase and revision, R-6.4-14).
    Expire(StateWrite),
    /// Dispatched and past it: show the derived indicator; write no
    /// lifecycle change (R-6.4-10).
    LatePendingReconciliation,
    /// Accepted or later (terminal included): the TTL no longer applies.
    NotApplicable,
}

/// Decides expiry for a command at `now_wall_ms`.
#[must_use]
pub fn check_expiry(
    state: CommandState,
    queue_expiry_ms: Option<i64>,
    now_wall_ms: i64,
) -> ExpiryDecision {
    if !matches!(state.phase(), Phase::Queued | Phase::Dispatched) {
        return ExpiryDecision::NotApplicable;
    }
    let Some(at) = queue_expiry_ms else {
        return ExpiryDecision::NoTtl;
    };
    if now_wall_ms < at {
        return ExpiryDecision::NotDue { at_wall_ms: at };
    }
    match StateWrite::at(state).then(Phase::Expired) {
        Ok(write) => ExpiryDecision::Expire(write),
        // only `dispatched` lacks the edge here
        Err(_) => ExpiryDecision::LatePendingReconciliation,
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

    use rvbox_domain::lifecycle::{Edge, Lifecycle, Revision};
    use rvbox_domain::limits::DEFAULT_QUEUE_TTL_MS;

    use super::*;

    const T0: i64 = 1_700_000_000_000;

    #[test]
    fn expiry_is_absolute_and_fixed_at_creation() {
        assert_eq!(queue_expiry_ms(T0, 0), None);
        assert_eq!(
            queue_expiry_ms(T0, DEFAULT_QUEUE_TTL_MS),
            Some(T0 + 900_000)
        );
        assert_eq!(queue_expiry_ms(T0, u64::MAX), Some(i64::MAX));
        assert_eq!(queue_expiry_ms(i64::MAX - 1, 5), Some(i64::MAX));
        let e = queue_expiry_ms(T0, 1_000);
        assert!(!is_past(e, T0 + 999));
        assert!(is_past(e, T0 + 1_000));
        assert!(!is_past(None, i64::MAX));
    }

    /// Expiry of queued vs dispatched vs accepted (R-6.4-09/10).
    #[test]
    fn queued_expires_dispatched_is_protected_accepted_is_untouched() {
        let e = Some(T0);
        let queued = CommandState::from_parts(Phase::Queued, Revision(3));
        let ExpiryDecision::Expire(w) = check_expiry(queued, e, T0) else {
            panic!("queued past its TTL must expire")
        };
        assert_eq!(w.from(), queued);
        assert_eq!(
            w.to(),
            CommandState::from_parts(Phase::Expired, Revision(3))
        );
        assert_eq!(w.edges(), [Edge::Expire]);
        assert_eq!(
            check_expiry(queued, e, T0 - 1),
            ExpiryDecision::NotDue { at_wall_ms: T0 }
        );
        assert_eq!(check_expiry(queued, None, i64::MAX), ExpiryDecision::NoTtl);

        let dispatched = CommandState::from_parts(Phase::Dispatched, Revision(1));
        assert_eq!(
            check_expiry(dispatched, e, T0 + 1),
            ExpiryDecision::LatePendingReconciliation
        );
        assert!(late_pending_reconciliation(Phase::Dispatched, e, T0));
        assert!(!late_pending_reconciliation(Phase::Dispatched, e, T0 - 1));
        assert!(!late_pending_reconciliation(Phase::Queued, e, T0));

        for p in Phase::ALL {
            if matches!(p, Phase::Queued | Phase::Dispatched) {
                continue;
            }
            let s = CommandState::from_parts(p, Revision(1));
            assert_eq!(
                check_expiry(s, e, T0 + 1),
                ExpiryDecision::NotApplicable,
                "{p}"
            );
            assert!(!late_pending_reconciliation(p, e, T0 + 1));
        }
        // never a terminal `expired` for anything but queued
        for p in Phase::ALL {
            let s = CommandState::from_parts(p, Revision(1));
            if let ExpiryDecision::Expire(w) = check_expiry(s, e, T0) {
                assert_eq!(p, Phase::Queued);
                assert_eq!(w.to().lifecycle(), Lifecycle::Expired);
            }
        }
    }
}
