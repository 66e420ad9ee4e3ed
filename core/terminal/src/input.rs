//! Keys typed into a terminal, delivered to its PTY exactly once.
//!
//! Each viewer (one `rvc shell` or `rvc attach`) has an id of its own and
//! numbers its input frames 1, 2, 3... in the order typed. The viewer
//! keeps every frame until the holder acknowledges it (cumulatively), up
//! to a bound ([`DEFAULT_HELD`]): keys typed while disconnected wait
//! there, and on reattach every unacknowledged frame is sent again in
//! order. The holder's [`InputGate`] remembers, per viewer, the last frame
//! it wrote to the PTY, so a frame sent twice is written once and a frame
//! after a gap is refused until the missing ones arrive.

use std::collections::{BTreeMap, VecDeque};

/// The keys a viewer holds unacknowledged unless configured: 4 KiB.
pub const DEFAULT_HELD: usize = 4096;

/// The viewers a holder remembers unless configured.
pub const DEFAULT_VIEWERS: usize = 64;

/// A viewer's id (a UUID's bytes, drawn by the viewer).
pub type ViewerId = [u8; 16];

/// One numbered piece of input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its number in its viewer's sequence, from 1.
    pub seq: u64,
    /// The bytes typed.
    pub bytes: Vec<u8>,
}

/// Keys refused because the viewer already holds as many as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{held} bytes of input are waiting for the terminal to acknowledge them, and {more} more would pass the limit of {limit}"
)]
pub struct Full {
    /// Bytes held now.
    pub held: usize,
    /// Bytes refused.
    pub more: usize,
    /// The limit.
    pub limit: usize,
}

/// A viewer's input, numbered and held until acknowledged.
#[derive(Debug, Clone)]
pub struct KeyBuffer {
    limit: usize,
    next: u64,
    unacked: VecDeque<Frame>,
    held: usize,
}

impl KeyBuffer {
    /// An empty buffer holding at most `limit` unacknowledged bytes.
    #[must_use]
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            next: 1,
            unacked: VecDeque::new(),
            held: 0,
        }
    }

    /// Numbers `bytes` as the next frame and holds it; returns it to send
    /// now if connected. Empty input makes no frame.
    ///
    /// # Errors
    /// [`Full`] when holding it would pass the limit: nothing is held, and
    /// the caller tells the user those keys were not sent.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Option<Frame>, Full> {
        if bytes.is_empty() {
            return Ok(None);
        }
        if self.held.saturating_add(bytes.len()) > self.limit {
            return Err(Full {
                held: self.held,
                more: bytes.len(),
                limit: self.limit,
            });
        }
        let frame = Frame {
            seq: self.next,
            bytes: bytes.to_vec(),
        };
        self.next += 1;
        self.held += bytes.len();
        self.unacked.push_back(frame.clone());
        Ok(Some(frame))
    }

    /// The holder wrote every frame up to `seq`: they are dropped.
    pub fn ack(&mut self, seq: u64) {
        while self.unacked.front().is_some_and(|f| f.seq <= seq) {
            if let Some(f) = self.unacked.pop_front() {
                self.held -= f.bytes.len();
            }
        }
    }

    /// Every frame not yet acknowledged, oldest first: what a reattach
    /// sends again.
    pub fn unacked(&self) -> impl Iterator<Item = &Frame> {
        self.unacked.iter()
    }

    /// Bytes held unacknowledged.
    #[must_use]
    pub fn held(&self) -> usize {
        self.held
    }

    /// Forgets every held frame (the terminal no longer knows this
    /// viewer); returns how many bytes were dropped, for the user.
    pub fn discard(&mut self) -> usize {
        let n = self.held;
        self.unacked.clear();
        self.held = 0;
        n
    }
}

impl Default for KeyBuffer {
    fn default() -> Self {
        Self::new(DEFAULT_HELD)
    }
}

/// What the holder does with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it to the PTY; it is recorded as written.
    Write,
    /// Already written: acknowledge again, write nothing.
    Duplicate,
    /// Frames before it are missing: write nothing; the viewer resends
    /// from `expected`.
    Gap {
        /// The next frame the holder can write.
        expected: u64,
    },
    /// The holder does not know this viewer and the frame is not its
    /// first: it cannot tell what was written before, so it writes
    /// nothing, and the viewer drops its held keys and says so.
    Unknown,
}

/// The holder's record of the input each viewer has had written.
#[derive(Debug, Clone)]
pub struct InputGate {
    max: usize,
    /// Per viewer: the last frame written, and when it was last heard
    /// from (a counter, for forgetting the longest silent first).
    viewers: BTreeMap<ViewerId, (u64, u64)>,
    tick: u64,
}

impl InputGate {
    /// A gate remembering at most `max_viewers` viewers (at least one).
    #[must_use]
    pub fn new(max_viewers: usize) -> Self {
        Self {
            max: max_viewers.max(1),
            viewers: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Decides frame `seq` of `viewer`.
    pub fn offer(&mut self, viewer: ViewerId, seq: u64) -> Verdict {
        self.tick += 1;
        let tick = self.tick;
        let Some((last, heard)) = self.viewers.get_mut(&viewer) else {
            if seq != 1 {
                return Verdict::Unknown;
            }
            self.remember(viewer, 1);
            return Verdict::Write;
        };
        *heard = tick;
        if seq <= *last {
            Verdict::Duplicate
        } else if seq == *last + 1 {
            *last = seq;
            Verdict::Write
        } else {
            Verdict::Gap {
                expected: *last + 1,
            }
        }
    }

    /// The last frame of `viewer` written to the PTY (0: none).
    #[must_use]
    pub fn acked(&self, viewer: &ViewerId) -> u64 {
        self.viewers.get(viewer).map_or(0, |v| v.0)
    }

    /// Viewers remembered.
    #[must_use]
    pub fn len(&self) -> usize {
        self.viewers.len()
    }

    /// Whether no viewer is remembered.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.viewers.is_empty()
    }

    /// The gate's record, for the holder to keep across its own restart.
    #[must_use]
    pub fn snapshot(&self) -> Vec<(ViewerId, u64)> {
        self.viewers.iter().map(|(v, (s, _))| (*v, *s)).collect()
    }

    /// A gate continuing a record from [`Self::snapshot`].
    #[must_use]
    pub fn restored(max_viewers: usize, record: &[(ViewerId, u64)]) -> Self {
        let mut g = Self::new(max_viewers);
        for (v, s) in record {
            g.remember(*v, *s);
        }
        g
    }

    fn remember(&mut self, viewer: ViewerId, seq: u64) {
        self.tick += 1;
        if self.viewers.len() >= self.max && !self.viewers.contains_key(&viewer) {
            // forget the viewer silent longest: if it comes back, its
            // held keys are refused as Unknown, never written twice
            if let Some(old) = self
                .viewers
                .iter()
                .min_by_key(|(_, (_, heard))| *heard)
                .map(|(v, _)| *v)
            {
                self.viewers.remove(&old);
            }
        }
        self.viewers.insert(viewer, (seq, self.tick));
    }
}

impl Default for InputGate {
    fn default() -> Self {
        Self::new(DEFAULT_VIEWERS)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const V: ViewerId = [1; 16];
    const W: ViewerId = [2; 16];

    #[test]
    fn keys_held_past_the_limit_are_refused_whole() {
        let mut k = KeyBuffer::new(4);
        assert!(k.push(b"ab").unwrap().is_some());
        assert_eq!(
            k.push(b"cde"),
            Err(Full {
                held: 2,
                more: 3,
                limit: 4
            })
        );
        k.ack(1);
        assert_eq!(k.push(b"cde").unwrap().unwrap().seq, 2);
        assert_eq!(k.held(), 3);
    }

    #[test]
    fn the_gate_writes_each_frame_once_and_refuses_a_gap() {
        let mut g = InputGate::new(4);
        assert_eq!(g.offer(V, 1), Verdict::Write);
        assert_eq!(g.offer(V, 1), Verdict::Duplicate);
        assert_eq!(g.offer(V, 3), Verdict::Gap { expected: 2 });
        assert_eq!(g.offer(V, 2), Verdict::Write);
        assert_eq!(g.offer(W, 2), Verdict::Unknown);
        assert_eq!(g.offer(W, 1), Verdict::Write);
        assert_eq!(g.acked(&V), 2);
        let again = InputGate::restored(4, &g.snapshot());
        assert_eq!(again.acked(&V), 2);
    }

    #[test]
    fn a_forgotten_viewer_is_refused_not_written_twice() {
        let mut g = InputGate::new(1);
        assert_eq!(g.offer(V, 1), Verdict::Write);
        assert_eq!(g.offer(W, 1), Verdict::Write);
        assert_eq!(g.len(), 1);
        assert_eq!(g.offer(V, 2), Verdict::Unknown);
    }

    proptest! {
        /// Over any run of typing, acknowledgements lost, reconnects
        /// resending everything held and frames duplicated on the way, the
        /// PTY receives exactly the keys typed, in order, once.
        #[test]
        fn every_key_typed_reaches_the_pty_once(
            steps in proptest::collection::vec((0u8..5, proptest::collection::vec(any::<u8>(), 1..6)), 1..120),
        ) {
            let mut k = KeyBuffer::new(64);
            let mut g = InputGate::new(4);
            let mut typed = Vec::new();
            let mut pty = Vec::new();
            let mut connected = true;
            let mut deliver = |f: &Frame, k: &mut KeyBuffer, ack_lost: bool| {
                if g.offer(V, f.seq) == Verdict::Write {
                    pty.extend_from_slice(&f.bytes);
                }
                if !ack_lost {
                    k.ack(g.acked(&V));
                }
            };
            for (action, bytes) in steps {
                match action {
                    0 | 1 => {
                        if let Ok(Some(f)) = k.push(&bytes) {
                            typed.extend_from_slice(&bytes);
                            if connected {
                                deliver(&f, &mut k, action == 1);
                            }
                        }
                    }
                    2 => connected = false,
                    _ => {
                        // reattach: everything held goes again, twice
                        connected = true;
                        let held: Vec<Frame> = k.unacked().cloned().collect();
                        for f in held.iter().chain(held.iter()) {
                            deliver(f, &mut k, false);
                        }
                    }
                }
            }
            let held: Vec<Frame> = k.unacked().cloned().collect();
            for f in &held {
                deliver(f, &mut k, false);
            }
            prop_assert_eq!(pty, typed);
            prop_assert_eq!(k.held(), 0);
        }
    }
}
