//! The fair global ready queue across clients (plan §6.4; R-6.4-07).
//!
//! "The dispatcher uses one serialized worker per client plus a fair global
//! ready queue, so [...] an offline/noisy client cannot starve others."
//!
//! Round robin with one dispatch decision per turn:
//!
//! - [`ReadyQueue::mark_ready`] puts a client at the tail of the rotation
//!   unless it is already waiting there; marking again never moves it
//!   forward, so a client with 10,000 ready commands holds one place in line,
//!   the same as a client with one.
//! - [`ReadyQueue::next_turn`] hands out the first waiting client whose worker is
//!   free and claims that worker; a client whose worker is busy keeps its
//!   place. The worker makes one decision and calls
//!   [`ReadyQueue::finish`]; if the client still has ready work it marks
//!   itself ready again and rejoins at the tail.
//! - [`ReadyQueue::begin`] claims a client's worker out of turn (e.g. to
//!   apply a capacity report under the same serialization) without touching
//!   its place in line.
//! - An offline client is simply not re-marked when its turn finds no
//!   session, and [`ReadyQueue::remove`] drops a client outright.
//!
//! So a client waiting in the rotation is handed out before any client that
//! joined behind it: with `N` clients, at most `N - 1` other turns pass
//! before its own (while workers are free). Iteration is deterministic
//! (`VecDeque` + `BTreeMap`), and the number of tracked clients is bounded by
//! [`MAX_TRACKED_CLIENTS`].

use std::collections::{BTreeMap, VecDeque};

use thiserror::Error;

/// Most clients the ready queue tracks at once (waiting or busy). A server
/// with more clients that have ready work leaves the excess durable and
/// finds it on its next scan.
pub const MAX_TRACKED_CLIENTS: usize = 65_536;

/// A refused ready-queue operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ReadyError {
    /// The tracked-client bound is reached.
    #[error("the ready queue already tracks {limit} clients")]
    Full {
        /// The bound.
        limit: usize,
    },
    /// The client's serialized worker is already claimed.
    #[error("the client's dispatch worker is busy")]
    Busy,
    /// `finish` for a client whose worker was not claimed.
    #[error("the client's dispatch worker is not busy")]
    NotBusy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Entry {
    /// Waiting in `rotation` (at most once).
    waiting: bool,
    /// Its worker is claimed.
    busy: bool,
}

/// Round-robin ready queue over client keys `K` (e.g. `ClientId`).
#[derive(Debug, Clone)]
pub struct ReadyQueue<K> {
    rotation: VecDeque<K>,
    entries: BTreeMap<K, Entry>,
    limit: usize,
}

impl<K: Ord + Clone> Default for ReadyQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Clone> ReadyQueue<K> {
    /// An empty queue bounded by [`MAX_TRACKED_CLIENTS`].
    #[must_use]
    pub fn new() -> Self {
        Self::with_limit(MAX_TRACKED_CLIENTS)
    }

    /// An empty queue with a lower bound (tests, small deployments). The
    /// bound never exceeds [`MAX_TRACKED_CLIENTS`].
    #[must_use]
    pub fn with_limit(limit: usize) -> Self {
        Self {
            rotation: VecDeque::new(),
            entries: BTreeMap::new(),
            limit: limit.min(MAX_TRACKED_CLIENTS),
        }
    }

    /// The tracked-client bound.
    #[must_use]
    pub fn limit(&self) -> usize {
        self.limit
    }

    fn entry_or_insert(&mut self, client: &K) -> Result<&mut Entry, ReadyError> {
        if !self.entries.contains_key(client) && self.entries.len() >= self.limit {
            return Err(ReadyError::Full { limit: self.limit });
        }
        Ok(self.entries.entry(client.clone()).or_default())
    }

    /// `client` has ready work. Returns true when it joined the tail of the
    /// rotation, false when it was already waiting (its place is kept).
    ///
    /// # Errors
    /// [`ReadyError::Full`] when a new client would exceed the bound.
    pub fn mark_ready(&mut self, client: &K) -> Result<bool, ReadyError> {
        let entry = self.entry_or_insert(client)?;
        if entry.waiting {
            return Ok(false);
        }
        entry.waiting = true;
        self.rotation.push_back(client.clone());
        Ok(true)
    }

    /// The next client to serve: the first waiting client whose worker is
    /// free. Its worker is claimed; call [`Self::finish`] after one decision.
    pub fn next_turn(&mut self) -> Option<K> {
        let entries = &self.entries;
        let at = self
            .rotation
            .iter()
            .position(|k| entries.get(k).is_some_and(|e| !e.busy))?;
        let client = self.rotation.remove(at)?;
        if let Some(e) = self.entries.get_mut(&client) {
            e.waiting = false;
            e.busy = true;
        }
        Some(client)
    }

    /// Claims `client`'s worker out of turn; its place in line is kept.
    ///
    /// # Errors
    /// [`ReadyError::Busy`] when already claimed; [`ReadyError::Full`] at
    /// the bound.
    pub fn begin(&mut self, client: &K) -> Result<(), ReadyError> {
        let entry = self.entry_or_insert(client)?;
        if entry.busy {
            return Err(ReadyError::Busy);
        }
        entry.busy = true;
        Ok(())
    }

    /// Releases `client`'s worker. A client that is not waiting is no
    /// longer tracked.
    ///
    /// # Errors
    /// [`ReadyError::NotBusy`] when the worker was not claimed.
    pub fn finish(&mut self, client: &K) -> Result<(), ReadyError> {
        let Some(entry) = self.entries.get_mut(client) else {
            return Err(ReadyError::NotBusy);
        };
        if !entry.busy {
            return Err(ReadyError::NotBusy);
        }
        entry.busy = false;
        if !entry.waiting {
            self.entries.remove(client);
        }
        Ok(())
    }

    /// Drops `client` from the rotation (deleted, or known to be offline).
    /// A claimed worker stays claimed until its `finish`, so serialization
    /// holds even across a removal.
    pub fn remove(&mut self, client: &K) {
        self.rotation.retain(|k| k != client);
        match self.entries.get_mut(client) {
            Some(e) if e.busy => e.waiting = false,
            Some(_) => {
                self.entries.remove(client);
            }
            None => {}
        }
    }

    /// Whether `client`'s worker is claimed.
    #[must_use]
    pub fn is_busy(&self, client: &K) -> bool {
        self.entries.get(client).is_some_and(|e| e.busy)
    }

    /// Whether `client` waits in the rotation.
    #[must_use]
    pub fn is_waiting(&self, client: &K) -> bool {
        self.entries.get(client).is_some_and(|e| e.waiting)
    }

    /// Clients waiting in the rotation.
    #[must_use]
    pub fn waiting_len(&self) -> usize {
        self.rotation.len()
    }

    /// Clients tracked (waiting or busy).
    #[must_use]
    pub fn tracked_len(&self) -> usize {
        self.entries.len()
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

    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A noisy client with 10,000 ready commands and a quiet client with one:
    /// the quiet one is served within one round.
    #[test]
    fn noisy_client_cannot_starve_a_quiet_one() {
        let mut q = ReadyQueue::new();
        let mut noisy_left = 10_000u32;
        for _ in 0..noisy_left {
            q.mark_ready(&"noisy").unwrap();
        }
        assert_eq!(q.waiting_len(), 1, "one place in line however much work");
        // the noisy client is served first and re-marks itself
        assert_eq!(q.next_turn(), Some("noisy"));
        q.mark_ready(&"quiet").unwrap();
        noisy_left -= 1;
        q.mark_ready(&"noisy").unwrap();
        q.finish(&"noisy").unwrap();
        let mut served = Vec::new();
        while let Some(c) = q.next_turn() {
            served.push(c);
            if c == "noisy" {
                noisy_left -= 1;
                if noisy_left > 0 {
                    q.mark_ready(&c).unwrap();
                }
            }
            q.finish(&c).unwrap();
        }
        assert_eq!(served[0], "quiet");
        assert_eq!(served.iter().filter(|c| **c == "quiet").count(), 1);
        assert_eq!(served.len(), 10_000);
        assert_eq!(q.tracked_len(), 0);
    }

    #[test]
    fn one_decision_per_client_at_a_time() {
        let mut q = ReadyQueue::new();
        q.mark_ready(&1).unwrap();
        q.mark_ready(&2).unwrap();
        assert_eq!(q.next_turn(), Some(1));
        // 1 gets more work while busy: it waits behind 2, never in parallel
        q.mark_ready(&1).unwrap();
        assert_eq!(q.begin(&1), Err(ReadyError::Busy));
        assert_eq!(q.next_turn(), Some(2));
        assert_eq!(q.next_turn(), None, "1 is waiting but its worker is busy");
        q.finish(&1).unwrap();
        assert_eq!(q.next_turn(), Some(1));
        assert_eq!(q.finish(&3), Err(ReadyError::NotBusy));
        q.finish(&1).unwrap();
        q.finish(&2).unwrap();
        assert_eq!(q.finish(&2), Err(ReadyError::NotBusy));
    }

    #[test]
    fn begin_out_of_turn_keeps_the_place_in_line() {
        let mut q = ReadyQueue::new();
        for c in [1, 2, 3] {
            q.mark_ready(&c).unwrap();
        }
        q.begin(&1).unwrap(); // e.g. a capacity report for client 1
        assert_eq!(q.next_turn(), Some(2), "1 is busy; 2 goes");
        q.finish(&1).unwrap();
        assert!(q.is_waiting(&1));
        assert_eq!(q.next_turn(), Some(1), "1 kept its place ahead of 3");
        assert_eq!(q.next_turn(), Some(3));
    }

    #[test]
    fn an_offline_client_drops_out_and_remove_keeps_serialization() {
        let mut q = ReadyQueue::new();
        q.mark_ready(&"offline").unwrap();
        q.mark_ready(&"online").unwrap();
        // offline's turn finds no session: it is not re-marked
        assert_eq!(q.next_turn(), Some("offline"));
        q.finish(&"offline").unwrap();
        assert_eq!(q.next_turn(), Some("online"));
        q.mark_ready(&"online").unwrap();
        q.remove(&"online");
        assert!(q.is_busy(&"online"));
        assert!(!q.is_waiting(&"online"));
        assert_eq!(q.begin(&"online"), Err(ReadyError::Busy));
        q.finish(&"online").unwrap();
        assert_eq!(q.tracked_len(), 0);
        assert_eq!(q.next_turn(), None);
        q.mark_ready(&"gone").unwrap();
        q.remove(&"gone");
        assert_eq!(q.tracked_len(), 0);
        assert_eq!(q.next_turn(), None);
    }

    #[test]
    fn the_tracked_client_bound_holds_at_the_limit() {
        let mut q = ReadyQueue::new();
        assert_eq!(q.limit(), MAX_TRACKED_CLIENTS);
        for c in 0..MAX_TRACKED_CLIENTS {
            q.mark_ready(&c).unwrap();
        }
        assert_eq!(
            q.mark_ready(&MAX_TRACKED_CLIENTS),
            Err(ReadyError::Full {
                limit: MAX_TRACKED_CLIENTS
            })
        );
        assert_eq!(
            q.begin(&MAX_TRACKED_CLIENTS),
            Err(ReadyError::Full {
                limit: MAX_TRACKED_CLIENTS
            })
        );
        // a tracked client can still be re-marked at the bound
        assert_eq!(q.mark_ready(&0), Ok(false));
        let c = q.next_turn().unwrap();
        q.finish(&c).unwrap();
        assert_eq!(q.mark_ready(&MAX_TRACKED_CLIENTS), Ok(true));
        assert_eq!(
            ReadyQueue::<u8>::with_limit(usize::MAX).limit(),
            MAX_TRACKED_CLIENTS
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Client gains `n` ready commands.
        Work(u8, u8),
        /// Serve the next client; it handles one command, re-marks if more.
        Serve,
        /// Client goes offline: its work stays durable but it leaves.
        Offline(u8),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// No client with ready work waits more than N turns, N = clients.
        #[test]
        fn nobody_waits_more_than_one_round(
            clients in 2u8..8,
            ops in proptest::collection::vec(
                prop_oneof![
                    3 => (any::<u8>(), 1u8..50).prop_map(|(c, n)| Op::Work(c, n)),
                    6 => Just(Op::Serve),
                    1 => any::<u8>().prop_map(Op::Offline),
                ],
                1..400,
            ),
        ) {
            let mut q = ReadyQueue::new();
            let mut work: BTreeMap<u8, u32> = BTreeMap::new();
            // turns served since the client started waiting
            let mut waited: BTreeMap<u8, usize> = BTreeMap::new();
            let n = usize::from(clients);
            for op in ops {
                match op {
                    Op::Work(c, k) => {
                        let c = c % clients;
                        *work.entry(c).or_default() += u32::from(k);
                        if q.mark_ready(&c).unwrap() {
                            waited.insert(c, 0);
                        }
                    }
                    Op::Offline(c) => {
                        let c = c % clients;
                        q.remove(&c);
                        waited.remove(&c);
                    }
                    Op::Serve => {
                        let Some(c) = q.next_turn() else {
                            prop_assert!(waited.is_empty());
                            continue;
                        };
                        let w = waited.remove(&c).unwrap();
                        prop_assert!(w < n, "client {c} waited {w} turns with {n} clients");
                        for v in waited.values_mut() {
                            *v += 1;
                        }
                        let left = work.entry(c).or_default();
                        *left = left.saturating_sub(1);
                        if *left > 0 && q.mark_ready(&c).unwrap() {
                            waited.insert(c, 0);
                        }
                        q.finish(&c).unwrap();
                    }
                }
                prop_assert!(q.tracked_len() <= n);
                prop_assert_eq!(q.waiting_len(), waited.len());
            }
        }
    }
}
