//! Where the supervisor's threads hand over to `next_event` (plan §7.4,
//! §7.2): one bounded output queue per command that a pipe reader never
//! waits on (when it is full the reader counts the bytes it discards and a
//! `Dropped` takes the next free slot), one control queue for the
//! essential messages (launcher records, stdin completions), which is never
//! dropped from, and one bounded queue of terminal events
//! (`next_terminal_event`), whose producers (the holders' threads) wait
//! for room while their holders keep the output.
//!
//! Ordering: a command's outputs and its `Dropped` records leave its queue
//! in the order they were read; a stream counts as drained only once its
//! reader saw end of file and nothing of the stream is left in the queue.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rvbox_client_core::process::TerminalProcessEvent;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

/// Output items (chunks of at most 64 KiB, or drop records) one command may
/// have waiting. A chunk read right after another of the same stream is
/// appended to it while it stays within 64 KiB, so this bounds the items
/// of output that alternates between the streams in tiny writes.
pub(crate) const OUTPUT_QUEUE_ITEMS: usize = 1024;
/// Chunk bytes (with [`ITEM_CHARGE`] per item) one command may have
/// waiting, by default (twice the default per-command high watermark).
pub const DEFAULT_COMMAND_HANDOVER_BYTES: u64 = 2 * 1024 * 1024;
/// What one queued item is charged at least, for its bookkeeping: tiny
/// chunks cannot hold more memory than the byte bounds say.
pub(crate) const ITEM_CHARGE: u64 = 256;
/// Chunk bytes (with [`ITEM_CHARGE`] per item) waiting in every output
/// queue together: the hand-over holds at most this much whatever the
/// number of commands (a reader whose chunk does not fit counts it as
/// dropped), so the daemon's memory is bounded by the spool's backlog plus
/// this bound. The default is half the default daemon high watermark.
pub const DEFAULT_HANDOVER_BYTES: u64 = 4 * 1024 * 1024;

/// The hand-over's byte bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoverBounds {
    /// Chunk bytes one command may have waiting.
    pub command_bytes: u64,
    /// Chunk bytes every command together may have waiting.
    pub total_bytes: u64,
}

impl Default for HandoverBounds {
    fn default() -> Self {
        Self {
            command_bytes: DEFAULT_COMMAND_HANDOVER_BYTES,
            total_bytes: DEFAULT_HANDOVER_BYTES,
        }
    }
}

impl HandoverBounds {
    /// The bounds that go with the spool's raw-backlog high watermarks:
    /// twice the per-command one per command, half the daemon one in all
    /// (2 MiB and 4 MiB for the 1 MiB and 8 MiB defaults), and never less
    /// than two whole chunks. A larger configured backlog is then usable
    /// end to end, and the daemon's output in flight stays within
    /// 1.5 times the daemon high watermark.
    #[must_use]
    pub fn for_watermarks(command_high: u64, daemon_high: u64) -> Self {
        let floor = 2 * crate::pipes::READ_CHUNK_BYTES as u64;
        let total_bytes = (daemon_high / 2).max(floor);
        Self {
            command_bytes: command_high.saturating_mul(2).clamp(floor, total_bytes),
            total_bytes,
        }
    }
}
/// Terminal events waiting for `next_terminal_event`, all terminals
/// together (an output event holds at most 16 KiB, so at most 4 MiB wait
/// here). A holder's I/O thread waits for room, and its holder keeps the
/// output meanwhile.
pub(crate) const TERMINAL_QUEUE_EVENTS: usize = 256;
/// How long a waiting terminal producer sleeps between looks at its stop
/// flag.
const TERMINAL_POST_POLL: Duration = Duration::from_millis(100);

/// Essential messages waiting for `next_event`, all commands together. The
/// producers are the supervisor's own threads (never a pipe reader); when
/// it is full they wait for room.
pub(crate) const CONTROL_QUEUE_MESSAGES: usize = 1024;

/// What a queued chunk of `len` bytes counts against the bounds.
fn item_charge(len: u64) -> u64 {
    len.max(ITEM_CHARGE)
}

/// One item of an output queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OutItem {
    /// Bytes read from a pipe.
    Chunk {
        stream: wire::OutputStream,
        observed_ms: i64,
        bytes: Vec<u8>,
    },
    /// Bytes a reader discarded while the queue was full.
    Dropped {
        stream: wire::OutputStream,
        raw_bytes: u64,
        first_ms: i64,
        last_ms: i64,
    },
}

impl OutItem {
    fn stream(&self) -> wire::OutputStream {
        match self {
            Self::Chunk { stream, .. } | Self::Dropped { stream, .. } => *stream,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct DropAcc {
    raw_bytes: u64,
    first_ms: i64,
    last_ms: i64,
}

#[derive(Debug, Default)]
struct StreamState {
    pending: Option<DropAcc>,
    eof: bool,
    queued: usize,
}

impl StreamState {
    fn drained(&self) -> bool {
        self.eof && self.pending.is_none() && self.queued == 0
    }
}

#[derive(Debug, Default)]
struct OutputQueue {
    items: VecDeque<OutItem>,
    /// Chunk bytes in `items`.
    bytes: u64,
    stdout: StreamState,
    stderr: StreamState,
}

impl OutputQueue {
    fn stream_mut(&mut self, s: wire::OutputStream) -> &mut StreamState {
        if s == wire::OutputStream::Stderr {
            &mut self.stderr
        } else {
            &mut self.stdout
        }
    }

    fn push_item(&mut self, item: OutItem) {
        self.stream_mut(item.stream()).queued += 1;
        self.items.push_back(item);
    }

    /// Turns waiting drop counts into items while there is room.
    fn settle(&mut self) {
        for s in [wire::OutputStream::Stdout, wire::OutputStream::Stderr] {
            if self.items.len() >= OUTPUT_QUEUE_ITEMS {
                return;
            }
            if let Some(acc) = self.stream_mut(s).pending.take() {
                self.push_item(OutItem::Dropped {
                    stream: s,
                    raw_bytes: acc.raw_bytes,
                    first_ms: acc.first_ms,
                    last_ms: acc.last_ms,
                });
            }
        }
    }
}

#[derive(Debug)]
struct State<C> {
    generation: u64,
    /// A waker asked the waiting thread to return.
    woken: bool,
    control: VecDeque<(Uuid7, C)>,
    outputs: BTreeMap<Uuid7, OutputQueue>,
    /// Chunk bytes in every output queue.
    queued_bytes: u64,
    /// Terminal events, in order per terminal.
    terminal: VecDeque<TerminalProcessEvent>,
}

/// The hand-over point.
#[derive(Debug)]
pub(crate) struct Hub<C> {
    state: Mutex<State<C>>,
    cond: Condvar,
    bounds: HandoverBounds,
}

/// What remained of a closed output queue.
#[derive(Debug)]
pub(crate) struct Closed {
    pub items: Vec<OutItem>,
    pub stdout_eof: bool,
    pub stderr_eof: bool,
}

impl<C> Hub<C> {
    pub(crate) fn new(bounds: HandoverBounds) -> Self {
        Self {
            bounds,
            state: Mutex::new(State {
                generation: 0,
                woken: false,
                control: VecDeque::new(),
                outputs: BTreeMap::new(),
                queued_bytes: 0,
                terminal: VecDeque::new(),
            }),
            cond: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<C>> {
        // a poisoned lock only means a thread panicked while holding it;
        // the queues themselves stay consistent
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bump(&self, st: &mut State<C>) {
        st.generation = st.generation.wrapping_add(1);
        self.cond.notify_all();
    }

    /// Opens a command's output queue.
    pub(crate) fn open(&self, issue: Uuid7) {
        self.lock().outputs.insert(issue, OutputQueue::default());
    }

    /// A reader's chunk: queued when there is room, else counted as dropped.
    /// Never waits for the consumer.
    pub(crate) fn push_output(
        &self,
        issue: &Uuid7,
        stream: wire::OutputStream,
        bytes: Vec<u8>,
        now_ms: i64,
    ) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(q) = st.outputs.get_mut(issue) else {
            return; // closed: the command is drained
        };
        q.settle();
        let n = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        let max_chunk = u64::try_from(crate::pipes::READ_CHUNK_BYTES).unwrap_or(u64::MAX);
        // the same stream's last chunk, when this one still fits in it
        let no_drops = q.stream_mut(stream).pending.is_none();
        let last_len = match q.items.back() {
            Some(OutItem::Chunk {
                stream: s,
                bytes: b,
                ..
            }) if *s == stream && no_drops => u64::try_from(b.len()).ok(),
            _ => None,
        };
        let joinable = last_len.is_some_and(|l| l.saturating_add(n) <= max_chunk);
        // what this chunk adds to the bounds (an item is charged
        // `item_charge` of its length)
        let charge = match last_len {
            Some(l) if joinable => item_charge(l.saturating_add(n)).saturating_sub(item_charge(l)),
            _ => item_charge(n),
        };
        let room = (joinable || q.items.len() < OUTPUT_QUEUE_ITEMS)
            && q.bytes.saturating_add(charge) <= self.bounds.command_bytes
            && st.queued_bytes.saturating_add(charge) <= self.bounds.total_bytes;
        if room && q.stream_mut(stream).pending.is_none() {
            q.bytes = q.bytes.saturating_add(charge);
            st.queued_bytes = st.queued_bytes.saturating_add(charge);
            match q.items.back_mut() {
                Some(OutItem::Chunk { bytes: last, .. }) if joinable => {
                    // exact, so a joined chunk holds what it is charged
                    last.reserve_exact(bytes.len());
                    last.extend_from_slice(&bytes);
                }
                _ => q.push_item(OutItem::Chunk {
                    stream,
                    observed_ms: now_ms,
                    bytes,
                }),
            }
        } else {
            let s = q.stream_mut(stream);
            if let Some(acc) = &mut s.pending {
                acc.raw_bytes = acc.raw_bytes.saturating_add(n);
                acc.last_ms = now_ms;
            } else {
                s.pending = Some(DropAcc {
                    raw_bytes: n,
                    first_ms: now_ms,
                    last_ms: now_ms,
                });
            }
        }
        self.bump(st);
    }

    /// A reader reached end of file.
    pub(crate) fn eof(&self, issue: &Uuid7, stream: wire::OutputStream) {
        let mut st = self.lock();
        if let Some(q) = st.outputs.get_mut(issue) {
            q.stream_mut(stream).eof = true;
        }
        self.bump(&mut st);
    }

    /// The next output item of a command.
    pub(crate) fn pop_output(&self, issue: &Uuid7) -> Option<OutItem> {
        let mut st = self.lock();
        let st = &mut *st;
        let q = st.outputs.get_mut(issue)?;
        q.settle();
        let item = q.items.pop_front()?;
        if let OutItem::Chunk { bytes, .. } = &item {
            let n = item_charge(u64::try_from(bytes.len()).unwrap_or(u64::MAX));
            q.bytes = q.bytes.saturating_sub(n);
            st.queued_bytes = st.queued_bytes.saturating_sub(n);
        }
        let s = q.stream_mut(item.stream());
        s.queued = s.queued.saturating_sub(1);
        q.settle();
        Some(item)
    }

    /// Whether each stream of a command is drained to end of file.
    pub(crate) fn drained(&self, issue: &Uuid7) -> (bool, bool) {
        let st = self.lock();
        st.outputs
            .get(issue)
            .map_or((true, true), |q| (q.stdout.drained(), q.stderr.drained()))
    }

    /// Closes a command's queue: what is left, in order, with the drop
    /// counts last; later reads are discarded.
    pub(crate) fn close(&self, issue: &Uuid7) -> Closed {
        let mut st = self.lock();
        let Some(mut q) = st.outputs.remove(issue) else {
            return Closed {
                items: Vec::new(),
                stdout_eof: true,
                stderr_eof: true,
            };
        };
        st.queued_bytes = st.queued_bytes.saturating_sub(q.bytes);
        let mut items: Vec<OutItem> = q.items.drain(..).collect();
        for s in [wire::OutputStream::Stdout, wire::OutputStream::Stderr] {
            if let Some(acc) = q.stream_mut(s).pending.take() {
                items.push(OutItem::Dropped {
                    stream: s,
                    raw_bytes: acc.raw_bytes,
                    first_ms: acc.first_ms,
                    last_ms: acc.last_ms,
                });
            }
        }
        Closed {
            items,
            stdout_eof: q.stdout.eof,
            stderr_eof: q.stderr.eof,
        }
    }

    /// Posts an essential message; waits for room (bounded queue) but
    /// never drops it.
    pub(crate) fn post(&self, issue: Uuid7, msg: C) {
        let mut st = self.lock();
        while st.control.len() >= CONTROL_QUEUE_MESSAGES {
            st = self
                .cond
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        st.control.push_back((issue, msg));
        self.bump(&mut st);
    }

    /// Posts a message only if the control queue has room (for
    /// best-effort reports such as diagnostics, whose producer must never
    /// wait); false when it was dropped.
    pub(crate) fn try_post(&self, issue: Uuid7, msg: C) -> bool {
        let mut st = self.lock();
        if st.control.len() >= CONTROL_QUEUE_MESSAGES {
            return false;
        }
        st.control.push_back((issue, msg));
        self.bump(&mut st);
        true
    }

    /// Posts a terminal event; waits for room until `stop` is set (then
    /// false: nobody takes events any more).
    pub(crate) fn post_terminal(&self, ev: TerminalProcessEvent, stop: &AtomicBool) -> bool {
        let mut st = self.lock();
        while st.terminal.len() >= TERMINAL_QUEUE_EVENTS {
            if stop.load(Ordering::Acquire) {
                return false;
            }
            st = match self.cond.wait_timeout(st, TERMINAL_POST_POLL) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        st.terminal.push_back(ev);
        self.bump(&mut st);
        true
    }

    /// The next terminal event.
    pub(crate) fn pop_terminal(&self) -> Option<TerminalProcessEvent> {
        let mut st = self.lock();
        let ev = st.terminal.pop_front()?;
        self.bump(&mut st);
        Some(ev)
    }

    /// Whether a terminal event waits.
    pub(crate) fn terminal_waiting(&self) -> bool {
        !self.lock().terminal.is_empty()
    }

    /// Every waiting essential message.
    pub(crate) fn take_control(&self) -> Vec<(Uuid7, C)> {
        let mut st = self.lock();
        let out: Vec<_> = st.control.drain(..).collect();
        if !out.is_empty() {
            self.bump(&mut st);
        }
        out
    }

    /// Makes a waiting [`Hub::wait`] return, and the next
    /// [`Hub::take_wake`] true (another input is waiting for the thread).
    pub(crate) fn wake(&self) {
        let mut st = self.lock();
        st.woken = true;
        self.bump(&mut st);
    }

    /// Whether a wake came since the last call.
    pub(crate) fn take_wake(&self) -> bool {
        std::mem::take(&mut self.lock().woken)
    }

    /// The change counter (any push, end of file or message).
    pub(crate) fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Waits until something changed since `seen` or `timeout` passed.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) {
        let deadline = crate::procfs::after(timeout);
        let mut st = self.lock();
        while st.generation == seen {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            st = match self.cond.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn issue() -> Uuid7 {
        Uuid7::parse("t", "01890a5d-ac96-774b-bcce-b302099a8057").unwrap()
    }

    #[test]
    fn the_handover_follows_the_spool_watermarks() {
        let d = HandoverBounds::for_watermarks(1 << 20, 8 << 20);
        assert_eq!(d, HandoverBounds::default(), "the defaults go together");
        let big = HandoverBounds::for_watermarks(32 << 20, 64 << 20);
        assert_eq!((big.command_bytes, big.total_bytes), (32 << 20, 32 << 20));
        let tiny = HandoverBounds::for_watermarks(1, 2);
        assert_eq!(
            (tiny.command_bytes, tiny.total_bytes),
            (128 << 10, 128 << 10)
        );
        // a larger bound is used: 8 MiB fits in one command's queue
        let hub: Hub<()> = Hub::new(big);
        let id = issue();
        hub.open(id);
        for _ in 0..128 {
            hub.push_output(&id, wire::OutputStream::Stdout, vec![7; 64 * 1024], 1);
        }
        let mut kept = 0;
        while let Some(item) = hub.pop_output(&id) {
            match item {
                OutItem::Chunk { bytes, .. } => kept += bytes.len(),
                OutItem::Dropped { .. } => panic!("nothing is dropped within the bound"),
            }
        }
        assert_eq!(kept, 8 << 20);
    }

    #[test]
    fn every_queue_together_holds_at_most_the_handover_bound() {
        let hub: Hub<()> = Hub::new(HandoverBounds::default());
        let out = wire::OutputStream::Stdout;
        let ids: Vec<Uuid7> = (0..16u32)
            .map(|n| {
                Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-b302099a80{n:02x}")).unwrap()
            })
            .collect();
        let chunk = 64 * 1024;
        let mut pushed = 0u64;
        for id in &ids {
            hub.open(*id);
            for _ in 0..OUTPUT_QUEUE_ITEMS {
                hub.push_output(id, out, vec![1; chunk], 1);
                pushed += chunk as u64;
            }
        }
        let queued = hub.lock().queued_bytes;
        assert!(queued <= DEFAULT_HANDOVER_BYTES, "{queued}");
        assert_eq!(
            queued, DEFAULT_HANDOVER_BYTES,
            "the bound is used, not undershot"
        );
        // every byte is a chunk or counted dropped, and popping frees room
        let (mut chunks, mut dropped) = (0u64, 0u64);
        for id in &ids {
            while let Some(item) = hub.pop_output(id) {
                match item {
                    OutItem::Chunk { bytes, .. } => chunks += bytes.len() as u64,
                    OutItem::Dropped { raw_bytes, .. } => dropped += raw_bytes,
                }
            }
            let closed = hub.close(id);
            for item in closed.items {
                if let OutItem::Dropped { raw_bytes, .. } = item {
                    dropped += raw_bytes;
                }
            }
        }
        assert_eq!(chunks + dropped, pushed);
        assert_eq!(hub.lock().queued_bytes, 0);
    }

    #[test]
    fn a_full_queue_counts_exact_bytes_and_keeps_order() {
        let hub: Hub<()> = Hub::new(HandoverBounds::default());
        let id = issue();
        hub.open(id);
        let (out, err) = (wire::OutputStream::Stdout, wire::OutputStream::Stderr);
        // alternating streams: one item per chunk, up to the item bound
        let n = OUTPUT_QUEUE_ITEMS + 5;
        for i in 0..n {
            let s = if i % 2 == 0 { out } else { err };
            hub.push_output(&id, s, vec![0; 10], i64::try_from(i).unwrap());
        }
        // room for one item: a drop count takes it
        let first = hub.pop_output(&id).unwrap();
        assert!(matches!(first, OutItem::Chunk { observed_ms: 0, .. }));
        hub.push_output(&id, out, vec![0; 3], 10_000);
        let (mut chunks, mut dropped) = (0u64, 0u64);
        let mut order: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
        let mut last_seen = 0;
        while let Some(item) = hub.pop_output(&id) {
            match item {
                OutItem::Chunk {
                    stream,
                    bytes,
                    observed_ms,
                } => {
                    chunks += bytes.len() as u64;
                    order.entry(stream as i32).or_default().push(observed_ms);
                }
                OutItem::Dropped {
                    stream,
                    raw_bytes,
                    first_ms,
                    last_ms,
                } => {
                    dropped += raw_bytes;
                    order.entry(stream as i32).or_default().push(first_ms);
                    if stream == out {
                        last_seen = last_seen.max(last_ms);
                    }
                }
            }
        }
        assert_eq!(chunks + dropped + 10, 10 * n as u64 + 3);
        // past the item bound stdout's chunks are dropped (the last item is
        // stderr's), while stderr's still join its last item
        assert_eq!(dropped, 3 * 10 + 3);
        assert_eq!(last_seen, 10_000);
        for (stream, o) in &order {
            assert!(o.windows(2).all(|w| w[0] <= w[1]), "{stream}: {o:?}");
        }
        assert_eq!(hub.drained(&id), (false, false));
        hub.eof(&id, out);
        hub.eof(&id, err);
        assert_eq!(hub.drained(&id), (true, true));
        assert_eq!(hub.lock().queued_bytes, 0, "every charge was given back");
    }

    #[test]
    fn tiny_chunks_of_one_stream_join_the_last_one() {
        let hub: Hub<()> = Hub::new(HandoverBounds::default());
        let id = issue();
        hub.open(id);
        let out = wire::OutputStream::Stdout;
        for i in 0..10_000u32 {
            hub.push_output(&id, out, i.to_le_bytes().to_vec(), 1);
        }
        let mut items = Vec::new();
        while let Some(item) = hub.pop_output(&id) {
            items.push(item);
        }
        let joined: Vec<u8> = items
            .iter()
            .flat_map(|i| match i {
                OutItem::Chunk { bytes, .. } => bytes.clone(),
                OutItem::Dropped { .. } => panic!("tiny output was dropped"),
            })
            .collect();
        let want: Vec<u8> = (0..10_000u32).flat_map(u32::to_le_bytes).collect();
        assert_eq!(joined, want);
        assert!(items.len() <= 2, "{} items", items.len());
        assert_eq!(hub.lock().queued_bytes, 0);
    }

    #[test]
    fn eof_counts_only_once_the_stream_is_delivered() {
        let hub: Hub<()> = Hub::new(HandoverBounds::default());
        let id = issue();
        hub.open(id);
        hub.push_output(&id, wire::OutputStream::Stderr, vec![1], 1);
        hub.eof(&id, wire::OutputStream::Stderr);
        assert!(!hub.drained(&id).1);
        let closed = hub.close(&id);
        assert_eq!(closed.items.len(), 1);
        assert!(closed.stderr_eof && !closed.stdout_eof);
        // closed: later reads are discarded
        hub.push_output(&id, wire::OutputStream::Stderr, vec![1], 2);
        assert!(hub.pop_output(&id).is_none());
    }
}
