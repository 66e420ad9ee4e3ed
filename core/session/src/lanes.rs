//! The two-lane write schedule one socket writer owns (plan §6.1,
//! R-6.1-08/09/10/12/13).
//!
//! The control lane (Ping/Pong/Close, welcome/fencing, protocol errors,
//! acks, reconciliation) is drained first in bounded bursts, then one data
//! frame, so data still progresses. A full control lane is a session-fatal
//! invariant; a full data lane hands the frame back so the work stays
//! durable and is offered again when [`WriteScheduler::data_has_room`].

use std::collections::VecDeque;

use thiserror::Error;

use crate::wire::Lane;

/// Frames the control lane holds.
pub const CONTROL_LANE_CAPACITY: usize = 256;
/// Frames the data lane holds.
pub const DATA_LANE_CAPACITY: usize = 64;
/// Control frames written before one waiting data frame gets its turn.
pub const CONTROL_BURST: usize = 16;

/// A lane was full; the frame comes back to the caller.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{lane:?} lane is full")]
pub struct LaneFull<T> {
    /// Which lane.
    pub lane: Lane,
    /// The frame that did not fit.
    pub frame: T,
}

/// Two bounded FIFO lanes with control priority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteScheduler<T> {
    control: VecDeque<T>,
    data: VecDeque<T>,
    burst: usize,
}

impl<T> Default for WriteScheduler<T> {
    fn default() -> Self {
        // allocated as frames come (the bounds are checked by length): an
        // idle connection holds no lane memory
        Self {
            control: VecDeque::new(),
            data: VecDeque::new(),
            burst: 0,
        }
    }
}

impl<T> WriteScheduler<T> {
    /// Queues a frame on `lane`.
    ///
    /// # Errors
    /// [`LaneFull`] with the frame. For [`Lane::Control`] the caller must
    /// close the session with `INTERNAL_ERROR` (R-6.1-12); for
    /// [`Lane::Data`] it keeps the work durable and retries later (R-6.1-13).
    pub fn push(&mut self, lane: Lane, frame: T) -> Result<(), LaneFull<T>> {
        let (queue, cap) = match lane {
            Lane::Control => (&mut self.control, CONTROL_LANE_CAPACITY),
            Lane::Data => (&mut self.data, DATA_LANE_CAPACITY),
        };
        if queue.len() >= cap {
            return Err(LaneFull { lane, frame });
        }
        queue.push_back(frame);
        Ok(())
    }

    /// Whether the data lane can take another frame.
    #[must_use]
    pub fn data_has_room(&self) -> bool {
        self.data.len() < DATA_LANE_CAPACITY
    }

    /// Frames waiting on `lane`.
    #[must_use]
    pub fn len(&self, lane: Lane) -> usize {
        match lane {
            Lane::Control => self.control.len(),
            Lane::Data => self.data.len(),
        }
    }

    /// Whether both lanes are empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.control.is_empty() && self.data.is_empty()
    }

    /// The next frame to write: up to [`CONTROL_BURST`] control frames, then
    /// one data frame if any waits, and so on.
    pub fn next_frame(&mut self) -> Option<(Lane, T)> {
        let data_waits = !self.data.is_empty();
        if !self.control.is_empty() && (self.burst < CONTROL_BURST || !data_waits) {
            self.burst = self.burst.saturating_add(1);
            return self.control.pop_front().map(|f| (Lane::Control, f));
        }
        self.burst = 0;
        self.data.pop_front().map(|f| (Lane::Data, f))
    }
}
