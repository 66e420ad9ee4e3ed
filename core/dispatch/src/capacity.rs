//! Client capacity with shadow reservations (plan §6.4; R-6.4-02/03/05/06).
//!
//! The server may dispatch while `running < max_running || queued <
//! max_queued` (R-6.4-02), where the counts are the client's last report
//! *plus* the server's in-flight dispatches that report cannot know yet (the
//! shadows). One [`SessionCapacity`] belongs to one session and is mutated
//! only through `&mut self`, so reservations and capacity updates of a
//! session are serialized by construction (R-6.4-03).
//!
//! # When a shadow is released (R-6.4-06)
//!
//! - **Positive `CommandAccepted`**: the shadow is not dropped at once; it
//!   becomes [`ShadowState::AcceptedAwaitingReport`] and is dropped by the
//!   next `ClientCapacity`, which counts the command. Dropping it earlier
//!   would let the server dispatch against a report that does not include
//!   the command yet. This relies on the client contract "a client sends
//!   `CommandAccepted` before the `ClientCapacity` that counts it" (both
//!   travel in order on one socket); a client that reports first is only
//!   over-counted until its following report, never oversubscribed.
//! - **Definite rejection** (transient or permanent negative answer), or the
//!   caller's own aborted dispatch (the `dispatched` write failed before the
//!   frame was queued): released at once; the client holds no slot.
//! - **Session close**: everything is cleared, the report too. A new session
//!   dispatches nothing until its first `ClientCapacity`.
//!
//! # The admission rule
//!
//! A reservation is granted only when `running + queued + shadows <
//! max_running + max_queued`. With per-class shadows this implies the plan's
//! `running + shadow_running < max_running || queued + shadow_queued <
//! max_queued`, and it also covers a shadow taken as a running slot that the
//! client places in its queue (or the reverse) because a command finished in
//! between: per-class checks alone can oversubscribe there. The slot class
//! is a running slot if one is free, otherwise a queued slot (R-6.4-05). The
//! number of shadows therefore never exceeds `max_running + max_queued` of
//! the report it was admitted under.

use std::collections::BTreeMap;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use thiserror::Error;

/// Smallest `max_running` a client may report (common.proto Capabilities).
pub const MIN_CLIENT_RUNNING: u32 = 1;
/// Largest `max_running` a client may report, and the ceiling for `running`.
pub const MAX_CLIENT_RUNNING: u32 = 1024;
/// Largest `max_queued` a client may report, and the ceiling for `queued`.
pub const MAX_CLIENT_QUEUED: u32 = 10_000;

/// A validated `ClientCapacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityReport {
    /// Commands running on the client.
    pub running: u32,
    /// Commands accepted and waiting for a running slot.
    pub queued: u32,
    /// The client's running limit, `1..=1024`.
    pub max_running: u32,
    /// The client's queue limit, `0..=10000`.
    pub max_queued: u32,
}

/// A `ClientCapacity` that breaks the protocol; each variant names its field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum CapacityError {
    /// `max_running` outside `1..=1024`.
    #[error("client_capacity.max_running is {0}; it must be 1..=1024")]
    MaxRunning(u32),
    /// `max_queued` above 10000.
    #[error("client_capacity.max_queued is {0}; it must be 0..=10000")]
    MaxQueued(u32),
    /// `running` above the protocol ceiling of 1024.
    #[error("client_capacity.running is {0}; no client may run more than 1024")]
    Running(u32),
    /// `queued` above the protocol ceiling of 10000.
    #[error("client_capacity.queued is {0}; no client may queue more than 10000")]
    Queued(u32),
}

impl CapacityError {
    /// Dotted name of the offending field.
    #[must_use]
    pub fn field(&self) -> &'static str {
        match self {
            Self::MaxRunning(_) => "client_capacity.max_running",
            Self::MaxQueued(_) => "client_capacity.max_queued",
            Self::Running(_) => "client_capacity.running",
            Self::Queued(_) => "client_capacity.queued",
        }
    }

    /// The peer broke the agent protocol: `PROTOCOL_ERROR` naming the field.
    #[must_use]
    pub fn to_domain_error(&self) -> DomainError {
        DomainError::new(Code::ProtocolError, self.to_string()).with_field(self.field())
    }
}

impl CapacityReport {
    /// Validates a wire report.
    ///
    /// Counts above the client's *current* limits are accepted: a client that
    /// lowered its limits across a restart may still hold more than the new
    /// limit, and the admission rule simply refuses until it drains. Counts
    /// above the protocol ceilings are refused.
    ///
    /// # Errors
    /// [`CapacityError`] naming the first bad field.
    pub fn from_wire(msg: &wire::ClientCapacity) -> Result<Self, CapacityError> {
        if !(MIN_CLIENT_RUNNING..=MAX_CLIENT_RUNNING).contains(&msg.max_running) {
            return Err(CapacityError::MaxRunning(msg.max_running));
        }
        if msg.max_queued > MAX_CLIENT_QUEUED {
            return Err(CapacityError::MaxQueued(msg.max_queued));
        }
        if msg.running > MAX_CLIENT_RUNNING {
            return Err(CapacityError::Running(msg.running));
        }
        if msg.queued > MAX_CLIENT_QUEUED {
            return Err(CapacityError::Queued(msg.queued));
        }
        Ok(Self {
            running: msg.running,
            queued: msg.queued,
            max_running: msg.max_running,
            max_queued: msg.max_queued,
        })
    }

    /// `max_running + max_queued`: total slots, at most 11024.
    #[must_use]
    pub fn total_slots(&self) -> u64 {
        u64::from(self.max_running) + u64::from(self.max_queued)
    }
}

/// Which client slot a shadow holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// An immediate running slot.
    Running,
    /// A client queue slot.
    Queued,
}

/// Where a shadow is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowState {
    /// Dispatch frame sent or about to be; no answer yet.
    InFlight,
    /// Positively accepted; the next `ClientCapacity` counts it.
    AcceptedAwaitingReport,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shadow {
    slot: Slot,
    state: ShadowState,
}

/// What an answer to a dispatch does to its shadow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowSettle {
    /// Positive: keep it until the next capacity report.
    AwaitReport,
    /// Definite rejection or aborted dispatch: drop it now.
    Release,
}

/// Why no slot was reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `ClientCapacity` on this session yet (the client reports only
    /// after applying `ReconcileResult`).
    NoReport,
    /// This command already holds a shadow on this session: it is in flight.
    AlreadyReserved,
    /// Every slot is taken, counting shadows.
    Full {
        /// `running + queued + shadows` as the server counts it.
        counted: u64,
        /// `max_running + max_queued`.
        slots: u64,
    },
}

/// One session's view of client capacity plus its in-flight shadows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionCapacity {
    report: Option<CapacityReport>,
    shadows: BTreeMap<Uuid7, Shadow>,
}

impl SessionCapacity {
    /// A fresh session: no report, no shadows.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The last valid report.
    #[must_use]
    pub fn report(&self) -> Option<CapacityReport> {
        self.report
    }

    /// Applies a `ClientCapacity`: validates it, adopts it, and drops every
    /// shadow whose positive acceptance it now counts. Returns how many
    /// shadows were dropped. An invalid report changes nothing.
    ///
    /// # Errors
    /// [`CapacityError`] naming the bad field.
    pub fn apply_report(&mut self, msg: &wire::ClientCapacity) -> Result<usize, CapacityError> {
        let report = CapacityReport::from_wire(msg)?;
        let before = self.shadows.len();
        self.shadows
            .retain(|_, s| s.state != ShadowState::AcceptedAwaitingReport);
        self.report = Some(report);
        Ok(before - self.shadows.len())
    }

    /// Whether a reservation would be granted now, and for which slot.
    ///
    /// # Errors
    /// The [`Refusal`] [`Self::reserve`] would return.
    pub fn check(&self, issue: Uuid7) -> Result<Slot, Refusal> {
        let Some(report) = self.report else {
            return Err(Refusal::NoReport);
        };
        if self.shadows.contains_key(&issue) {
            return Err(Refusal::AlreadyReserved);
        }
        let (shadow_running, shadow_queued) = self.shadow_counts();
        let counted =
            u64::from(report.running) + u64::from(report.queued) + shadow_running + shadow_queued;
        let slots = report.total_slots();
        if counted >= slots {
            return Err(Refusal::Full { counted, slots });
        }
        // plan §6.4: a running slot when immediately available, otherwise a
        // queued slot; the total check above guarantees one class has room.
        if u64::from(report.running) + shadow_running < u64::from(report.max_running) {
            Ok(Slot::Running)
        } else {
            Ok(Slot::Queued)
        }
    }

    /// Reserves a slot for `issue` before its dispatch frame is queued.
    ///
    /// # Errors
    /// [`Refusal`] when there is no report, the command is already in
    /// flight on this session, or every slot is counted.
    pub fn reserve(&mut self, issue: Uuid7) -> Result<Slot, Refusal> {
        let slot = self.check(issue)?;
        self.shadows.insert(
            issue,
            Shadow {
                slot,
                state: ShadowState::InFlight,
            },
        );
        Ok(slot)
    }

    /// Records a positive acceptance: the shadow waits for the next report.
    /// Returns false when `issue` holds no shadow here.
    pub fn accepted(&mut self, issue: Uuid7) -> bool {
        match self.shadows.get_mut(&issue) {
            Some(s) => {
                s.state = ShadowState::AcceptedAwaitingReport;
                true
            }
            None => false,
        }
    }

    /// Drops the shadow of `issue` (definite rejection, or the caller's
    /// dispatch was aborted before its frame was queued). Returns the slot
    /// it held.
    pub fn release(&mut self, issue: Uuid7) -> Option<Slot> {
        self.shadows.remove(&issue).map(|s| s.slot)
    }

    /// Applies an answer's effect on the shadow of `issue`.
    pub fn settle(&mut self, issue: Uuid7, settle: ShadowSettle) -> bool {
        match settle {
            ShadowSettle::AwaitReport => self.accepted(issue),
            ShadowSettle::Release => self.release(issue).is_some(),
        }
    }

    /// The session closed: clears every shadow and the report. Returns how
    /// many shadows were dropped.
    pub fn close(&mut self) -> usize {
        let n = self.shadows.len();
        self.shadows.clear();
        self.report = None;
        n
    }

    /// Whether `issue` holds a shadow (is in flight or awaiting a report).
    #[must_use]
    pub fn holds(&self, issue: Uuid7) -> bool {
        self.shadows.contains_key(&issue)
    }

    /// The state of the shadow of `issue`.
    #[must_use]
    pub fn shadow_state(&self, issue: Uuid7) -> Option<ShadowState> {
        self.shadows.get(&issue).map(|s| s.state)
    }

    /// Number of shadows.
    #[must_use]
    pub fn shadow_len(&self) -> usize {
        self.shadows.len()
    }

    /// `(running, queued)` shadows.
    #[must_use]
    pub fn shadow_counts(&self) -> (u64, u64) {
        self.shadows
            .values()
            .fold((0, 0), |(r, q), s| match s.slot {
                Slot::Running => (r + 1, q),
                Slot::Queued => (r, q + 1),
            })
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

    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;
    use crate::testutil::issue;

    fn cap(running: u32, queued: u32, max_running: u32, max_queued: u32) -> wire::ClientCapacity {
        wire::ClientCapacity {
            running,
            queued,
            max_running,
            max_queued,
        }
    }

    #[test]
    fn validation_names_the_field() {
        let cases = [
            (cap(0, 0, 0, 0), "client_capacity.max_running"),
            (cap(0, 0, 1025, 0), "client_capacity.max_running"),
            (cap(0, 0, 1, 10_001), "client_capacity.max_queued"),
            (cap(1025, 0, 1024, 0), "client_capacity.running"),
            (cap(0, 10_001, 1, 10_000), "client_capacity.queued"),
        ];
        for (msg, field) in cases {
            let err = CapacityReport::from_wire(&msg).unwrap_err();
            assert_eq!(err.field(), field, "{msg:?}");
            let d = err.to_domain_error();
            assert_eq!(d.code(), Code::ProtocolError);
            assert_eq!(d.field(), field);
        }
        assert!(CapacityReport::from_wire(&cap(0, 0, 1, 0)).is_ok());
        assert!(CapacityReport::from_wire(&cap(1024, 10_000, 1024, 10_000)).is_ok());
        // over the current limit (lowered across a restart) is legal
        assert!(CapacityReport::from_wire(&cap(20, 5, 4, 0)).is_ok());
        let mut c = SessionCapacity::new();
        c.apply_report(&cap(0, 0, 2, 1)).unwrap();
        assert!(c.apply_report(&cap(0, 0, 0, 1)).is_err());
        assert_eq!(
            c.report().unwrap().max_running,
            2,
            "a bad report changes nothing"
        );
    }

    #[test]
    fn nothing_is_reserved_before_the_first_report() {
        let mut c = SessionCapacity::new();
        assert_eq!(c.reserve(issue(1)), Err(Refusal::NoReport));
        assert_eq!(c.shadow_len(), 0);
    }

    /// R-6.5-08: the full client queue. Running slots first, then queued
    /// slots, then refusal; a finished command frees exactly one slot.
    #[test]
    fn full_client_queue() {
        let mut c = SessionCapacity::new();
        c.apply_report(&cap(0, 0, 2, 3)).unwrap();
        let slots: Vec<_> = (1..=5).map(|n| c.reserve(issue(n)).unwrap()).collect();
        assert_eq!(
            slots,
            [
                Slot::Running,
                Slot::Running,
                Slot::Queued,
                Slot::Queued,
                Slot::Queued
            ]
        );
        assert_eq!(
            c.reserve(issue(6)),
            Err(Refusal::Full {
                counted: 5,
                slots: 5
            })
        );
        assert_eq!(c.reserve(issue(1)), Err(Refusal::AlreadyReserved));
        // all five accepted; the report that counts them releases the shadows
        for n in 1..=5 {
            assert!(c.accepted(issue(n)));
        }
        assert_eq!(
            c.reserve(issue(6)),
            Err(Refusal::Full {
                counted: 5,
                slots: 5
            }),
            "accepted shadows still count until the report"
        );
        assert_eq!(c.apply_report(&cap(2, 3, 2, 3)).unwrap(), 5);
        assert_eq!(c.shadow_len(), 0);
        assert!(matches!(c.reserve(issue(6)), Err(Refusal::Full { .. })));
        // one command finished; the client promoted one queued command
        c.apply_report(&cap(2, 2, 2, 3)).unwrap();
        assert_eq!(c.reserve(issue(6)), Ok(Slot::Queued));
        assert!(matches!(c.reserve(issue(7)), Err(Refusal::Full { .. })));
    }

    #[test]
    fn a_zero_queue_client_takes_only_running_slots() {
        let mut c = SessionCapacity::new();
        c.apply_report(&cap(0, 0, 1, 0)).unwrap();
        assert_eq!(c.reserve(issue(1)), Ok(Slot::Running));
        assert!(matches!(c.reserve(issue(2)), Err(Refusal::Full { .. })));
    }

    #[test]
    fn rejection_releases_at_once_and_close_clears_everything() {
        let mut c = SessionCapacity::new();
        c.apply_report(&cap(0, 0, 1, 0)).unwrap();
        c.reserve(issue(1)).unwrap();
        assert!(c.settle(issue(1), ShadowSettle::Release));
        assert!(!c.settle(issue(1), ShadowSettle::Release));
        assert_eq!(c.reserve(issue(2)), Ok(Slot::Running));
        assert!(c.settle(issue(2), ShadowSettle::AwaitReport));
        assert_eq!(
            c.shadow_state(issue(2)),
            Some(ShadowState::AcceptedAwaitingReport)
        );
        assert_eq!(c.close(), 1);
        assert_eq!(c.report(), None);
        assert_eq!(c.reserve(issue(3)), Err(Refusal::NoReport));
    }

    /// The case per-class checks alone get wrong: a queued-slot shadow lands
    /// in a running slot freed meanwhile, so a later running-slot shadow
    /// lands in the queue. The total rule refuses the third dispatch.
    #[test]
    fn class_mismatch_cannot_oversubscribe() {
        let mut c = SessionCapacity::new();
        c.apply_report(&cap(1, 0, 1, 1)).unwrap();
        assert_eq!(c.reserve(issue(1)), Ok(Slot::Queued));
        c.apply_report(&cap(0, 0, 1, 1)).unwrap(); // a command finished
        assert_eq!(c.reserve(issue(2)), Ok(Slot::Running));
        // the client ran 1 and queued 2; it reports 1 first
        assert!(c.accepted(issue(1)));
        c.apply_report(&cap(1, 0, 1, 1)).unwrap();
        // per class: running 1 + shadow_running 1 >= 1, queued 0 + 0 < 1 would
        // admit a third; the client then has running 1, queued 1: full.
        assert!(matches!(c.reserve(issue(3)), Err(Refusal::Full { .. })));
    }

    /// A simulated client that follows the protocol: it answers each
    /// Dispatch in order, sends `CommandAccepted` before the capacity report
    /// that counts it, may reject transiently or permanently, finishes
    /// commands and reports, and may lose its session at any time.
    #[derive(Debug, Clone)]
    enum Op {
        Reserve,
        DeliverToClient(u8),
        DeliverToServer,
        Finish,
        Close,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Reserve),
            4 => any::<u8>().prop_map(Op::DeliverToClient),
            4 => Just(Op::DeliverToServer),
            2 => Just(Op::Finish),
            1 => Just(Op::Close),
        ]
    }

    enum Up {
        Accepted(Uuid7),
        Rejected(Uuid7),
        Report(wire::ClientCapacity),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// R-6.4-02/03/05/06: whatever the interleaving, every dispatch the
        /// client receives finds a free slot, and shadows stay bounded.
        #[test]
        fn never_oversubscribed(
            max_running in 1u32..4,
            max_queued in 0u32..4,
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let mut server = SessionCapacity::new();
            let (mut running, mut queued) = (0u32, 0u32);
            let mut down: VecDeque<Uuid7> = VecDeque::new();
            let report = |r, q| cap(r, q, max_running, max_queued);
            let mut up: VecDeque<Up> = VecDeque::from([Up::Report(report(0, 0))]);
            let mut next = 1u64;
            for op in ops {
                match op {
                    Op::Reserve => {
                        if server.reserve(issue(next)).is_ok() {
                            down.push_back(issue(next));
                        }
                        next += 1;
                    }
                    Op::DeliverToClient(roll) => {
                        let Some(id) = down.pop_front() else { continue };
                        // the client's own acceptance rule
                        let free = running < max_running || queued < max_queued;
                        prop_assert!(free, "oversubscribed: running {running} queued {queued}");
                        if roll % 5 == 0 {
                            up.push_back(Up::Rejected(id));
                        } else {
                            if running < max_running { running += 1 } else { queued += 1 }
                            up.push_back(Up::Accepted(id));
                            up.push_back(Up::Report(report(running, queued)));
                        }
                    }
                    Op::DeliverToServer => match up.pop_front() {
                        Some(Up::Accepted(id)) => { server.settle(id, ShadowSettle::AwaitReport); }
                        Some(Up::Rejected(id)) => { server.settle(id, ShadowSettle::Release); }
                        Some(Up::Report(r)) => { server.apply_report(&r).unwrap(); }
                        None => {}
                    },
                    Op::Finish => {
                        if running > 0 {
                            running -= 1;
                            if queued > 0 { queued -= 1; running += 1; }
                            up.push_back(Up::Report(report(running, queued)));
                        }
                    }
                    Op::Close => {
                        // in-flight frames die with the session; the client
                        // reports afresh on the next one
                        server.close();
                        down.clear();
                        up.clear();
                        up.push_back(Up::Report(report(running, queued)));
                    }
                }
                let slots = usize::try_from(max_running + max_queued).unwrap();
                prop_assert!(server.shadow_len() <= slots);
                prop_assert!(running + queued <= max_running + max_queued);
            }
        }
    }
}
