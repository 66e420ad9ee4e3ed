//! The terminal's output by byte offset.
//!
//! The holder counts every byte the PTY produced since the terminal
//! opened; offset `n` is the position just after the `n`th byte. It keeps
//! the last bytes in a ring of bounded size. When the ring overflows it
//! drops its oldest bytes, and a little more up to the end of a line when
//! one ends close by, so that a viewer reattaching from the ring's start
//! begins on a fresh line. A reattach from an offset still in the ring
//! gets exactly the bytes after it; one from an offset already dropped
//! gets the whole ring and the count of bytes it will never see.

use std::collections::VecDeque;

/// The ring's size unless configured: 1 MiB.
pub const DEFAULT_CAPACITY: usize = 1 << 20;

/// How far past the bytes it must drop a trim looks for a line end (and
/// never past half the ring); with none that close it cuts mid-line.
pub const LINE_SEARCH: usize = 4096;

/// A reattach from an offset the terminal has not reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("offset {from} is past the terminal's output, which ends at offset {end}")]
pub struct OffsetAhead {
    /// The offset asked for.
    pub from: u64,
    /// The offset after the last byte produced.
    pub end: u64,
}

/// What a reattach from an offset gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The offset of the first byte of `bytes`.
    pub offset: u64,
    /// Bytes between the offset asked for and `offset` that left the
    /// ring: zero when the replay is exact.
    pub cut: u64,
    /// The bytes from `offset` to the end of the output.
    pub bytes: Vec<u8>,
}

/// The last output bytes of a terminal, by offset.
#[derive(Debug, Clone)]
pub struct OutputRing {
    cap: usize,
    buf: VecDeque<u8>,
    /// The offset of `buf`'s first byte.
    start: u64,
}

impl OutputRing {
    /// An empty ring keeping at most `capacity` bytes (at least one).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            cap: capacity.max(1),
            buf: VecDeque::new(),
            start: 0,
        }
    }

    /// An empty ring that continues a terminal whose output already ended
    /// at `end` (a holder that lost its ring keeps counting).
    #[must_use]
    pub fn resumed_at(capacity: usize, end: u64) -> Self {
        Self {
            start: end,
            ..Self::new(capacity)
        }
    }

    /// The most bytes the ring keeps.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The offset of the oldest byte kept.
    #[must_use]
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The offset after the newest byte: every byte ever produced.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.buf.len() as u64)
    }

    /// Bytes kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether nothing is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Appends output; returns the new end offset.
    pub fn push(&mut self, bytes: &[u8]) -> u64 {
        // of a write larger than the ring only its tail can stay
        let skip = bytes.len().saturating_sub(self.cap);
        if skip > 0 {
            self.start = self
                .start
                .saturating_add(self.buf.len() as u64)
                .saturating_add(skip as u64);
            self.buf.clear();
        }
        self.buf.extend(bytes.get(skip..).unwrap_or_default());
        self.trim();
        self.end()
    }

    /// Drops the oldest bytes past the capacity, up to the end of a line
    /// when one ends within [`LINE_SEARCH`] bytes and half the ring.
    fn trim(&mut self) {
        let need = self.buf.len().saturating_sub(self.cap);
        if need == 0 {
            return;
        }
        let cut = self
            .buf
            .range(need - 1..)
            .take(LINE_SEARCH.min(self.cap / 2))
            .position(|b| *b == b'\n')
            .map_or(need, |at| need + at);
        self.buf.drain(..cut);
        self.start = self.start.saturating_add(cut as u64);
    }

    /// The output from offset `from`: exact when `from` is still in the
    /// ring, else the whole ring and how many bytes were cut.
    ///
    /// # Errors
    /// [`OffsetAhead`] when `from` is past the end of the output.
    pub fn since(&self, from: u64) -> Result<Replay, OffsetAhead> {
        let end = self.end();
        if from > end {
            return Err(OffsetAhead { from, end });
        }
        let offset = from.max(self.start);
        let skip = usize::try_from(offset - self.start).unwrap_or(usize::MAX);
        Ok(Replay {
            offset,
            cut: offset - from,
            bytes: self
                .buf
                .range(skip.min(self.buf.len())..)
                .copied()
                .collect(),
        })
    }
}

impl Default for OutputRing {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_reattach_inside_the_ring_is_exact() {
        let mut r = OutputRing::new(64);
        r.push(b"one\ntwo\n");
        r.push(b"three\n");
        let got = r.since(4).unwrap();
        assert_eq!(
            got,
            Replay {
                offset: 4,
                cut: 0,
                bytes: b"two\nthree\n".to_vec()
            }
        );
        assert_eq!(r.since(14).unwrap().bytes, b"");
        assert_eq!(r.since(15), Err(OffsetAhead { from: 15, end: 14 }));
    }

    #[test]
    fn an_overflow_drops_whole_lines_and_says_how_much_a_late_reattach_lost() {
        let mut r = OutputRing::new(10);
        r.push(b"aaaa\nbbbb\n");
        assert_eq!(r.start(), 0);
        r.push(b"cc");
        // two bytes too many: the first line goes whole
        assert_eq!(r.start(), 5);
        assert_eq!(
            r.since(0).unwrap(),
            Replay {
                offset: 5,
                cut: 5,
                bytes: b"bbbb\ncc".to_vec()
            }
        );
    }

    #[test]
    fn a_line_longer_than_the_search_is_cut_mid_line() {
        let mut r = OutputRing::new(8);
        let long = vec![b'x'; LINE_SEARCH + 100];
        r.push(&long);
        r.push(b"\n");
        assert_eq!(r.len(), 8);
        assert_eq!(r.end(), long.len() as u64 + 1);
    }

    #[test]
    fn a_write_larger_than_the_ring_keeps_its_tail() {
        let mut r = OutputRing::new(4);
        r.push(b"ab");
        r.push(b"0123456789");
        assert_eq!(r.end(), 12);
        assert_eq!(
            r.since(0).unwrap(),
            Replay {
                offset: 8,
                cut: 8,
                bytes: b"6789".to_vec()
            }
        );
    }

    #[test]
    fn a_resumed_ring_keeps_counting() {
        let mut r = OutputRing::resumed_at(16, 1000);
        r.push(b"hi");
        assert_eq!(r.end(), 1002);
        assert_eq!(r.since(10).unwrap().cut, 990);
    }

    proptest! {
        /// Against the whole output kept aside: every reattach gets the
        /// output's exact tail from its offset or from the ring's start,
        /// with the gap counted, and the ring never passes its capacity.
        #[test]
        fn every_reattach_matches_the_whole_output(
            cap in 1usize..200,
            writes in proptest::collection::vec(
                proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'a'), Just(b'b')], 0..90),
                0..40,
            ),
            pick in 0u64..4000,
        ) {
            let mut r = OutputRing::new(cap);
            let mut all = Vec::new();
            for w in &writes {
                r.push(w);
                all.extend_from_slice(w);
                prop_assert!(r.len() <= cap);
                prop_assert_eq!(r.end(), all.len() as u64);
            }
            let from = pick % (all.len() as u64 + 1);
            let got = r.since(from).unwrap();
            prop_assert_eq!(got.offset, from.max(r.start()));
            prop_assert_eq!(got.cut, got.offset - from);
            prop_assert_eq!(&got.bytes[..], &all[got.offset as usize..]);
        }
    }
}
