//! Heartbeat, liveness and reconnect backoff (plan §6.3, R-6.3-*).
//!
//! Only monotonic milliseconds go in. Wall-clock time is not an input here
//! at all, so a wall-clock adjustment cannot move a deadline (R-6.3-06/11).
//! The same policy runs at both ends; the client shell reuses these types.

use rvbox_domain::limits::{
    DEFAULT_RECONNECT_INITIAL_MS, DEFAULT_RECONNECT_MAX_MS, DEFAULT_RECONNECT_STABLE_RESET_MS,
};

/// What a liveness timer tick asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LivenessAction {
    /// Nothing is due.
    Nothing,
    /// Send one WebSocket Ping (once per silent period).
    Ping,
    /// Close the session: no inbound frame for the liveness timeout.
    Close,
}

/// Inbound-activity tracker: Ping after `idle_ms` of silence, close after
/// `timeout_ms` (plan §6.3). Both thresholds are inclusive: at exactly
/// 10 000 ms of silence the Ping is due, at exactly 30 000 ms the close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Liveness {
    idle_ms: u64,
    timeout_ms: u64,
    last_inbound_ms: u64,
    pinged: bool,
}

impl Liveness {
    /// Starts counting silence at `now_ms` (the connection was accepted).
    #[must_use]
    pub fn new(now_ms: u64, idle_ms: u64, timeout_ms: u64) -> Self {
        Self {
            idle_ms,
            timeout_ms,
            last_inbound_ms: now_ms,
            pinged: false,
        }
    }

    /// A valid inbound frame (any envelope, Pong or Ping) arrived at `now_ms`
    /// (R-6.3-01). Time never runs backwards here: an earlier `now_ms` than
    /// the last one is ignored.
    pub fn on_inbound(&mut self, now_ms: u64) {
        if now_ms >= self.last_inbound_ms {
            self.last_inbound_ms = now_ms;
        }
        self.pinged = false;
    }

    /// Monotonic time of the last inbound frame.
    #[must_use]
    pub fn last_inbound_ms(&self) -> u64 {
        self.last_inbound_ms
    }

    /// The next instant something is due: the Ping if not yet sent in this
    /// silent period, otherwise the close.
    #[must_use]
    pub fn deadline(&self) -> u64 {
        let after = if self.pinged {
            self.timeout_ms
        } else {
            self.idle_ms
        };
        self.last_inbound_ms.saturating_add(after)
    }

    /// Evaluates the timers at `now_ms`; idempotent for repeated ticks.
    pub fn on_timeout(&mut self, now_ms: u64) -> LivenessAction {
        let silent = now_ms.saturating_sub(self.last_inbound_ms);
        if silent >= self.timeout_ms {
            LivenessAction::Close
        } else if silent >= self.idle_ms && !self.pinged {
            self.pinged = true;
            LivenessAction::Ping
        } else {
            LivenessAction::Nothing
        }
    }
}

/// Reconnect backoff with full jitter that resets only after a continuous
/// stable session of `stable_reset_ms` (plan §6.3, R-6.3-08). The random
/// draw comes from the caller's seeded RNG.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    initial_ms: u64,
    max_ms: u64,
    stable_reset_ms: u64,
    attempt: u32,
    connected_since_ms: Option<u64>,
}

/// Doublings after which the cap no longer grows (2^20 s is far above any
/// sane maximum, and the shift stays in range).
const MAX_BACKOFF_DOUBLINGS: u32 = 20;

impl Default for Backoff {
    fn default() -> Self {
        Self::new(
            DEFAULT_RECONNECT_INITIAL_MS,
            DEFAULT_RECONNECT_MAX_MS,
            DEFAULT_RECONNECT_STABLE_RESET_MS,
        )
    }
}

impl Backoff {
    /// A backoff starting at `initial_ms`, capped at `max_ms`.
    #[must_use]
    pub fn new(initial_ms: u64, max_ms: u64, stable_reset_ms: u64) -> Self {
        Self {
            initial_ms,
            max_ms,
            stable_reset_ms,
            attempt: 0,
            connected_since_ms: None,
        }
    }

    /// Failed attempts since the last reset.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The current cap: `min(max, initial * 2^attempt)`.
    #[must_use]
    pub fn cap_ms(&self) -> u64 {
        let shift = self.attempt.min(MAX_BACKOFF_DOUBLINGS);
        self.initial_ms
            .saturating_mul(1u64 << shift)
            .min(self.max_ms)
    }

    /// The next delay, drawn uniformly in `0..=cap` from `random`, and one
    /// more attempt counted.
    pub fn next_delay_ms(&mut self, random: u64) -> u64 {
        let cap = self.cap_ms();
        self.attempt = self.attempt.saturating_add(1);
        random % cap.saturating_add(1)
    }

    /// A session became established (welcome received) at `now_ms`.
    pub fn on_connected(&mut self, now_ms: u64) {
        self.connected_since_ms = Some(now_ms);
    }

    /// Whether the current session has been up continuously for the
    /// stable period at `now_ms` (inclusive: exactly 60 s is stable).
    #[must_use]
    pub fn is_stable(&self, now_ms: u64) -> bool {
        self.connected_since_ms
            .is_some_and(|since| now_ms.saturating_sub(since) >= self.stable_reset_ms)
    }

    /// The session ended at `now_ms`. Resets the attempt counter only when
    /// it had been stable; returns whether it did.
    pub fn on_disconnected(&mut self, now_ms: u64) -> bool {
        let stable = self.is_stable(now_ms);
        self.connected_since_ms = None;
        if stable {
            self.attempt = 0;
        }
        stable
    }
}
