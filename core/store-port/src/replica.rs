//! Replica leases and single-runner duties (docs/scaleout.md), as values
//! and a pure keeper: the server replicas of one PostgreSQL database each
//! hold a lease on the database clock, and each duty (expiry, maintenance,
//! scrub, the fleet pump, the janitor) runs on the one replica holding the
//! duty's lease.
//!
//! The keeper decides, on the replica's own monotonic clock, when to renew
//! and when the replica must consider itself fenced: when no renewal
//! succeeded within [`LeaseTimes::self_fence_ms`] of the moment the last
//! successful one *started*. The database extends a lease by
//! [`LeaseTimes::lease_ms`] from its own `now()`, which is never before
//! that start, so a replica always fences itself before any other replica
//! can take its lease over (the margin absorbs clock-rate differences).

/// A replica's identity in the database: a random id per process, and the
/// epoch the database gave it when it joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId {
    /// Random per process start.
    pub id: [u8; 16],
    /// From the database's sequence when the replica joined.
    pub epoch: u64,
}

/// The lease durations (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimes {
    /// How long one renewal extends a lease, on the database clock.
    pub lease_ms: u64,
    /// How often a replica renews.
    pub renew_every_ms: u64,
    /// After how long without a successful renewal (measured from the
    /// start of the last successful one) a replica fences itself; less
    /// than `lease_ms`.
    pub self_fence_ms: u64,
}

impl Default for LeaseTimes {
    fn default() -> Self {
        Self {
            lease_ms: 10_000,
            renew_every_ms: 3_000,
            self_fence_ms: 7_000,
        }
    }
}

impl LeaseTimes {
    /// Whether the times keep their promise: renewals come more often than
    /// self-fencing, and self-fencing comes before the lease ends.
    #[must_use]
    pub fn is_sound(&self) -> bool {
        self.renew_every_ms > 0
            && self.renew_every_ms < self.self_fence_ms
            && self.self_fence_ms < self.lease_ms
    }
}

/// The single-runner duties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Duty {
    /// Queue expiry of commands.
    Expiry,
    /// Retention and maintenance passes.
    Maintenance,
    /// The background scrub.
    Scrub,
    /// Fleet releases.
    FleetPump,
    /// Ending the sessions of replicas whose lease expired.
    Janitor,
}

impl Duty {
    /// Every duty.
    pub const ALL: [Duty; 5] = [
        Duty::Expiry,
        Duty::Maintenance,
        Duty::Scrub,
        Duty::FleetPump,
        Duty::Janitor,
    ];

    /// Its name in the database, logs and metrics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Expiry => "expiry",
            Self::Maintenance => "maintenance",
            Self::Scrub => "scrub",
            Self::FleetPump => "fleet_pump",
            Self::Janitor => "janitor",
        }
    }
}

/// What the keeper says about the lease at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// The replica may write and serve.
    Live,
    /// No renewal succeeded in time: the replica must stop writing and
    /// close its sockets, and join again (with a new epoch) to go on.
    Fenced,
}

/// A replica's view of its own lease (pure: the caller passes its
/// monotonic time in milliseconds).
#[derive(Debug, Clone)]
pub struct LeaseKeeper {
    times: LeaseTimes,
    /// When the last successful renewal (or the join) started.
    valid_from: Option<u64>,
    /// When the next renewal is due.
    next_renewal: u64,
    fenced: bool,
}

impl LeaseKeeper {
    /// A keeper for a replica that has not joined yet (fenced).
    #[must_use]
    pub fn new(times: LeaseTimes) -> Self {
        Self {
            times,
            valid_from: None,
            next_renewal: 0,
            fenced: true,
        }
    }

    /// The lease times.
    #[must_use]
    pub fn times(&self) -> LeaseTimes {
        self.times
    }

    /// A join or renewal that started at `started` succeeded.
    pub fn renewed(&mut self, started: u64) {
        if self.fenced && self.valid_from.is_some() {
            // a fenced replica does not come back by a late renewal: it
            // joins again with a new epoch
            return;
        }
        self.valid_from = Some(self.valid_from.map_or(started, |v| v.max(started)));
        self.next_renewal = started.saturating_add(self.times.renew_every_ms);
        self.fenced = false;
    }

    /// A renewal failed (the database refused it or could not be
    /// reached) at `now`: try again soon.
    pub fn failed(&mut self, now: u64) {
        self.next_renewal = now
            .saturating_add(self.times.renew_every_ms / 3)
            .max(now + 1);
    }

    /// When the next renewal is due.
    #[must_use]
    pub fn next_renewal(&self) -> u64 {
        self.next_renewal
    }

    /// The moment the replica fences itself unless a renewal succeeds.
    #[must_use]
    pub fn fences_at(&self) -> Option<u64> {
        self.valid_from
            .map(|v| v.saturating_add(self.times.self_fence_ms))
    }

    /// The lease's state at `now`; once fenced, it stays fenced.
    pub fn state(&mut self, now: u64) -> LeaseState {
        if !self.fenced && self.fences_at().is_some_and(|t| now >= t) {
            self.fenced = true;
        }
        if self.fenced {
            LeaseState::Fenced
        } else {
            LeaseState::Live
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_times_are_sound_and_unsound_ones_are_told() {
        assert!(LeaseTimes::default().is_sound());
        let late = LeaseTimes {
            lease_ms: 5_000,
            renew_every_ms: 3_000,
            self_fence_ms: 7_000,
        };
        assert!(!late.is_sound(), "fencing after the lease ends");
    }

    #[test]
    fn a_replica_fences_itself_before_its_lease_can_end_and_stays_fenced() {
        let times = LeaseTimes::default();
        let mut k = LeaseKeeper::new(times);
        assert_eq!(k.state(0), LeaseState::Fenced, "not joined");
        k.renewed(1_000);
        assert_eq!(k.state(1_000), LeaseState::Live);
        assert_eq!(k.next_renewal(), 4_000);
        // renewals succeed: live on
        k.renewed(4_000);
        assert_eq!(k.state(10_999), LeaseState::Live);
        assert_eq!(k.fences_at(), Some(11_000));
        // the database extends to at least 4_000 + 10_000 on its clock;
        // the replica stops at 11_000 on its own
        k.failed(7_000);
        assert_eq!(k.next_renewal(), 8_000);
        assert_eq!(k.state(11_000), LeaseState::Fenced);
        // a renewal answered late does not bring it back
        k.renewed(10_500);
        assert_eq!(k.state(11_500), LeaseState::Fenced);
    }

    #[test]
    fn an_older_renewal_answered_late_never_moves_the_lease_back() {
        let mut k = LeaseKeeper::new(LeaseTimes::default());
        k.renewed(5_000);
        k.renewed(2_000);
        assert_eq!(k.fences_at(), Some(12_000));
    }

    #[test]
    fn duty_names_are_distinct() {
        let mut names: Vec<_> = Duty::ALL.iter().map(|d| d.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Duty::ALL.len());
    }
}
