//! Bounded, jittered backoff after a transient dispatch rejection (plan
//! §6.4; R-6.4-16): "returns `dispatched -> queued` with bounded jittered
//! backoff and remains under the original TTL".
//!
//! Exponential caps from `initial_ms` doubling per earlier transient
//! rejection up to `max_ms`, with full jitter: the delay is uniform in
//! `[0, cap]`. The entropy is a caller-supplied `u64`; the core draws none.

use rvbox_domain::limits::{
    DAY_MS, DEFAULT_DISPATCH_RETRY_INITIAL_MS, DEFAULT_DISPATCH_RETRY_MAX_MS,
};
use thiserror::Error;

/// Ceiling for `queue.retry_max`: one day. A longer backoff would only hide
/// a command that the queue TTL should decide about.
pub const MAX_RETRY_BACKOFF_MS: u64 = DAY_MS;

/// A retry policy that cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RetryPolicyError {
    /// `queue.retry_initial` is zero.
    #[error("queue.retry_initial must be at least 1 ms")]
    ZeroInitial,
    /// `queue.retry_initial` is above `queue.retry_max`.
    #[error("queue.retry_initial ({initial_ms} ms) is above queue.retry_max ({max_ms} ms)")]
    InitialAboveMax {
        /// Initial backoff.
        initial_ms: u64,
        /// Largest backoff.
        max_ms: u64,
    },
    /// `queue.retry_max` above [`MAX_RETRY_BACKOFF_MS`].
    #[error("queue.retry_max ({0} ms) is above the ceiling of one day")]
    MaxTooLarge(u64),
}

/// The backoff bounds (`queue.retry_initial`, `queue.retry_max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    initial_ms: u64,
    max_ms: u64,
}

impl Default for RetryPolicy {
    /// 1 s doubling to 60 s.
    fn default() -> Self {
        Self {
            initial_ms: DEFAULT_DISPATCH_RETRY_INITIAL_MS,
            max_ms: DEFAULT_DISPATCH_RETRY_MAX_MS,
        }
    }
}

impl RetryPolicy {
    /// A policy with `1 <= initial_ms <= max_ms <= MAX_RETRY_BACKOFF_MS`.
    ///
    /// # Errors
    /// [`RetryPolicyError`] naming the bad key.
    pub fn new(initial_ms: u64, max_ms: u64) -> Result<Self, RetryPolicyError> {
        if initial_ms == 0 {
            return Err(RetryPolicyError::ZeroInitial);
        }
        if max_ms > MAX_RETRY_BACKOFF_MS {
            return Err(RetryPolicyError::MaxTooLarge(max_ms));
        }
        if initial_ms > max_ms {
            return Err(RetryPolicyError::InitialAboveMax { initial_ms, max_ms });
        }
        Ok(Self { initial_ms, max_ms })
    }

    /// First cap.
    #[must_use]
    pub fn initial_ms(&self) -> u64 {
        self.initial_ms
    }

    /// Largest cap.
    #[must_use]
    pub fn max_ms(&self) -> u64 {
        self.max_ms
    }

    /// The cap after `earlier` transient rejections: `initial * 2^earlier`,
    /// at most `max_ms`.
    #[must_use]
    pub fn cap_ms(&self, earlier: u32) -> u64 {
        1u64.checked_shl(earlier)
            .and_then(|m| self.initial_ms.checked_mul(m))
            .map_or(self.max_ms, |c| c.min(self.max_ms))
    }

    /// The full-jitter delay after `earlier` transient rejections:
    /// `random mod (cap + 1)`, so uniform in `[0, cap]` up to a negligible
    /// modulo bias.
    #[must_use]
    pub fn delay_ms(&self, earlier: u32, random: u64) -> u64 {
        // cap <= MAX_RETRY_BACKOFF_MS, so cap + 1 cannot overflow
        random % (self.cap_ms(earlier) + 1)
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

    use super::*;

    #[test]
    fn caps_double_from_initial_to_max() {
        let p = RetryPolicy::default();
        let caps: Vec<_> = (0..9).map(|n| p.cap_ms(n)).collect();
        assert_eq!(
            caps,
            [
                1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
        assert_eq!(p.cap_ms(63), 60_000);
        assert_eq!(p.cap_ms(64), 60_000);
        assert_eq!(p.cap_ms(u32::MAX), 60_000);
        assert_eq!(p.delay_ms(0, u64::MAX), u64::MAX % 1_001);
        assert_eq!(p.delay_ms(0, 1_000), 1_000);
        assert_eq!(p.delay_ms(0, 1_001), 0);
    }

    #[test]
    fn policy_validation() {
        assert_eq!(RetryPolicy::new(0, 5), Err(RetryPolicyError::ZeroInitial));
        assert_eq!(
            RetryPolicy::new(6, 5),
            Err(RetryPolicyError::InitialAboveMax {
                initial_ms: 6,
                max_ms: 5
            })
        );
        assert_eq!(
            RetryPolicy::new(1, MAX_RETRY_BACKOFF_MS + 1),
            Err(RetryPolicyError::MaxTooLarge(MAX_RETRY_BACKOFF_MS + 1))
        );
        let p = RetryPolicy::new(MAX_RETRY_BACKOFF_MS, MAX_RETRY_BACKOFF_MS).unwrap();
        assert_eq!(
            p.delay_ms(u32::MAX, u64::MAX),
            u64::MAX % (MAX_RETRY_BACKOFF_MS + 1)
        );
    }

    proptest! {
        #[test]
        fn delay_is_bounded(
            initial in 1u64..10_000,
            extra in 0u64..100_000,
            earlier in any::<u32>(),
            random in any::<u64>(),
        ) {
            let p = RetryPolicy::new(initial, initial + extra).unwrap();
            let cap = p.cap_ms(earlier);
            prop_assert!(cap >= initial && cap <= p.max_ms());
            prop_assert!(p.delay_ms(earlier, random) <= cap);
            prop_assert!(p.cap_ms(earlier.saturating_add(1)) >= cap);
        }
    }
}
