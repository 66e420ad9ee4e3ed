//! The viewer of one terminal (`rvc shell`, `rvc attach`) as a state
//! machine without I/O: typed keys, stream items, answers and timers go
//! in with the time (`handle`), and what to do comes out (`poll_effect`,
//! drained after every input), with one deadline (`poll_timeout`). The
//! shell in `terminal.rs` performs the effects and reports their outcome
//! as later inputs (docs/terminals.md, "Output by byte offset" and "Input
//! exactly once").
//!
//! It keeps:
//! - the offset just past the last output byte printed: a reattach asks
//!   from there, and bytes at or below it are never printed again; a gap
//!   the server names (`PtyCut`), or one it does not, is said as one
//!   marker line;
//! - typed keys in a [`KeyBuffer`] (4 KiB), each frame with a request id
//!   of its own, sent one at a time in order and dropped only when the
//!   server answers it; after a reconnect the unanswered frames go again,
//!   in order, with their original request ids, so the server stores each
//!   once; past the bound typing is refused with a bell and a notice;
//! - the escape scanner: `~.` detaches (nothing typed after it is sent),
//!   `~?` prints the help;
//! - the local window size, sent when it changes and again after a
//!   failure.
//!
//! Must never: print a byte twice, send frames out of order or two at a
//! time, forget a held frame that was not answered (except by saying
//! so), or do anything after it asked to exit.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rvbox_proto::v1 as wire;
use rvbox_terminal::escape::{Action, EscapeScanner, HELP};
use rvbox_terminal::input::{DEFAULT_HELD, KeyBuffer};

/// Bytes of typed input held until the server answers them (4 KiB, the
/// bound docs/terminals.md sets for the viewer).
pub(crate) const HELD_KEYS: usize = DEFAULT_HELD;
/// The first pause before a reattach or a resent frame (doubling up to
/// [`MAX_PAUSE`]).
pub(crate) const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two reattach attempts.
pub(crate) const MAX_PAUSE: Duration = Duration::from_secs(5);
/// How long a detach waits for keys typed before it to be answered.
pub(crate) const DETACH_DRAIN: Duration = Duration::from_secs(2);
/// The largest window side the control API takes (rows and columns are
/// 1..=1000).
pub(crate) const MAX_SIDE: u16 = 1000;

/// What happened, as the shell saw it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input {
    /// Keys read from rvc's stdin.
    Typed(Vec<u8>),
    /// rvc's stdin reached its end: nothing more is typed (the view goes
    /// on until the terminal closes or a signal stops rvc).
    StdinEnded,
    /// An `AttachPtySession` stream asked from [`Viewer::offset`] is open.
    Attached,
    /// Output bytes at a cumulative offset.
    Output {
        /// Offset of the first byte.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// The asked offset had left the ring: output resumes at
    /// `ring_start_offset`.
    Cut {
        /// The offset asked for.
        requested_offset: u64,
        /// Where output resumes.
        ring_start_offset: u64,
    },
    /// The terminal closed (the stream ends after it).
    Closed(Box<wire::PtySessionInfo>),
    /// The stream ended without a close, or could not be opened, for a
    /// reason worth another try (UNAVAILABLE, the transport).
    StreamLost {
        /// What happened, for the status line.
        reason: String,
    },
    /// The server refused the attach for good.
    AttachRefused {
        /// rvc's exit status for it.
        status: u8,
        /// The server's message.
        message: String,
    },
    /// The server stored frame `seq`.
    Written {
        /// The frame.
        seq: u64,
    },
    /// Frame `seq` was not stored.
    WriteFailed {
        /// The frame.
        seq: u64,
        /// Worth sending again with the same request id (the server was
        /// unreachable, unavailable or full); otherwise the held keys are
        /// given up and the user is told.
        retry: bool,
        /// What the server (or the transport) said.
        message: String,
    },
    /// The local window has this size now.
    Resized {
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// The server recorded the size sent.
    ResizeDone {
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// The size sent was not recorded.
    ResizeFailed {
        /// Worth sending again.
        retry: bool,
        /// What was said.
        message: String,
    },
    /// A signal (number) asks rvc to stop: it detaches.
    Signal(i32),
    /// The deadline of [`Viewer::poll_timeout`] may have passed.
    Timeout,
}

/// What the shell does.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Effect {
    /// Open an `AttachPtySession` stream from `from`.
    Attach {
        /// The offset to resume from.
        from: u64,
    },
    /// Send one `WritePtyInput`.
    Write {
        /// The frame's number (reported back in `Written`/`WriteFailed`).
        seq: u64,
        /// Its request id: the same every time this frame is sent.
        request_id: String,
        /// The keys.
        data: Vec<u8>,
    },
    /// Send one `ResizePtySession`.
    Resize {
        /// Its request id.
        request_id: String,
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// Write output bytes to stdout.
    Print(Vec<u8>),
    /// Say one status line on stderr (without its line end).
    Notice(String),
    /// Ring the bell: typed keys were refused.
    Bell,
    /// Stop viewing (nothing follows).
    Exit(End),
}

/// Why the view ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum End {
    /// `~.`: the terminal keeps running.
    Detached,
    /// The terminal closed.
    Closed(Box<wire::PtySessionInfo>),
    /// A signal stopped rvc; the terminal keeps running.
    Signalled(i32),
    /// The server refused the attach.
    Refused {
        /// rvc's exit status.
        status: u8,
        /// The server's message.
        message: String,
    },
    /// No progress for the retry window: rvc gave up reconnecting.
    GaveUp,
}

/// The state of the output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// An attach is under way.
    Attaching,
    /// The stream is open.
    Up,
    /// Lost; the next attach goes at this time.
    Waiting(Instant),
}

/// One terminal's viewer.
pub(crate) struct Viewer<R> {
    terminal: String,
    /// Just past the last output byte printed.
    offset: u64,
    link: Link,
    /// The pause before the next reattach.
    pause: Duration,
    /// The last time the server was heard from (or the view began).
    progress_at: Instant,
    /// How long without progress before giving up.
    give_up: Duration,
    keys: KeyBuffer,
    /// The request id of each held frame, in the order of `keys`.
    ids: VecDeque<(u64, String)>,
    /// The frame whose `WritePtyInput` is out.
    in_flight: Option<u64>,
    /// Sending held frames waits until then (after a failure).
    write_at: Option<Instant>,
    write_pause: Duration,
    escapes: EscapeScanner,
    new_id: R,
    size_wanted: Option<(u16, u16)>,
    size_done: Option<(u16, u16)>,
    /// The request id of the size being sent, with that size.
    resize_id: Option<(String, (u16, u16))>,
    resize_in_flight: bool,
    resize_at: Option<Instant>,
    /// `~.` was typed: waiting (until this time) for the held keys.
    detaching: Option<Instant>,
    said_reconnecting: bool,
    catching_up: bool,
    said_full: bool,
    ended: bool,
    effects: VecDeque<Effect>,
}

impl<R> std::fmt::Debug for Viewer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Viewer")
            .field("terminal", &self.terminal)
            .field("offset", &self.offset)
            .field("link", &self.link)
            .field("held", &self.keys.held())
            .field("in_flight", &self.in_flight)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<R: FnMut() -> String> Viewer<R> {
    /// A viewer of `terminal` whose first attach, from `from`, is under
    /// way (the shell makes it and reports `Attached`). `known_size`: the
    /// window size the terminal already has (the one it was opened with).
    /// `give_up`: how long without the server before it stops trying.
    /// `new_id` draws a fresh request id (a UUIDv7).
    pub(crate) fn new(
        terminal: &str,
        from: u64,
        now: Instant,
        give_up: Duration,
        known_size: Option<(u16, u16)>,
        new_id: R,
    ) -> Self {
        Self {
            terminal: terminal.to_owned(),
            offset: from,
            link: Link::Attaching,
            pause: FIRST_PAUSE,
            progress_at: now,
            give_up,
            keys: KeyBuffer::new(HELD_KEYS),
            ids: VecDeque::new(),
            in_flight: None,
            write_at: None,
            write_pause: FIRST_PAUSE,
            escapes: EscapeScanner::default(),
            new_id,
            size_wanted: known_size,
            size_done: known_size,
            resize_id: None,
            resize_in_flight: false,
            resize_at: None,
            detaching: None,
            said_reconnecting: false,
            catching_up: false,
            said_full: false,
            ended: false,
            effects: VecDeque::new(),
        }
    }

    /// Just past the last output byte printed.
    #[cfg(test)]
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes that can still be typed before the held keys are full.
    pub(crate) fn room(&self) -> usize {
        HELD_KEYS - self.keys.held()
    }

    /// Whether the view has ended.
    #[cfg(test)]
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// The next thing to do, in order.
    #[must_use]
    pub(crate) fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// The one time at which [`Input::Timeout`] is due.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        if self.ended {
            return None;
        }
        let reattach = match self.link {
            Link::Waiting(at) => Some(at),
            _ => None,
        };
        // a resend waits for the link: while it is down, the attach is
        // the only deadline (a past resend time would wake the loop
        // again and again for nothing)
        let up = self.link == Link::Up;
        let write = self
            .write_at
            .filter(|_| up && self.in_flight.is_none() && !self.ids.is_empty());
        let resize = self
            .resize_at
            .filter(|_| up && !self.resize_in_flight && self.size_wanted != self.size_done);
        [reattach, write, resize, self.detaching]
            .into_iter()
            .flatten()
            .min()
    }

    /// Takes one input; then drain [`Self::poll_effect`].
    pub(crate) fn handle(&mut self, now: Instant, input: Input) {
        if self.ended {
            return;
        }
        match input {
            Input::Typed(bytes) => self.typed(now, &bytes),
            Input::StdinEnded => {}
            Input::Attached => self.attached(now),
            Input::Output { offset, data } => {
                self.heard(now);
                self.output(offset, &data);
            }
            Input::Cut {
                requested_offset,
                ring_start_offset,
            } => {
                self.heard(now);
                debug_assert!(requested_offset <= ring_start_offset);
                if ring_start_offset > self.offset {
                    self.cut(ring_start_offset - self.offset);
                    self.offset = ring_start_offset;
                }
            }
            Input::Closed(info) => self.closed(info),
            Input::StreamLost { reason } => self.lost(now, &reason),
            Input::AttachRefused { status, message } => {
                self.say_unsent("were not sent");
                self.exit(End::Refused { status, message });
            }
            Input::Written { seq } => self.written(now, seq),
            Input::WriteFailed {
                seq,
                retry,
                message,
            } => self.write_failed(now, seq, retry, &message),
            Input::Resized { rows, cols } => {
                if rows == 0 || cols == 0 {
                    // the window's size is unknown: nothing to send
                    return;
                }
                self.size_wanted = Some((rows.min(MAX_SIDE), cols.min(MAX_SIDE)));
                self.pump_resize(now);
            }
            Input::ResizeDone { rows, cols } => {
                self.resize_in_flight = false;
                self.resize_at = None;
                self.size_done = Some((rows, cols));
                self.pump_resize(now);
            }
            Input::ResizeFailed { retry, message } => {
                self.resize_in_flight = false;
                if retry {
                    self.resize_at = Some(now + self.pause);
                } else {
                    self.notice(format!("[rvc: the window size was not sent: {message}]"));
                    // that size is given up; a later change is sent
                    self.size_done = self.size_wanted;
                }
            }
            Input::Signal(n) => {
                self.say_unsent("may not have reached the terminal");
                self.say_detached();
                self.exit(End::Signalled(n));
            }
            Input::Timeout => self.timeout(now),
        }
    }

    fn typed(&mut self, now: Instant, bytes: &[u8]) {
        if self.detaching.is_some() {
            // nothing typed after `~.` is sent
            return;
        }
        for action in self.escapes.feed(bytes) {
            match action {
                Action::Send(keys) => self.hold(&keys),
                Action::Help => self.notice(HELP.trim_end().to_owned()),
                Action::Detach => {
                    self.begin_detach(now);
                    return;
                }
            }
        }
        self.pump_writes(now);
    }

    fn hold(&mut self, keys: &[u8]) {
        match self.keys.push(keys) {
            Ok(Some(frame)) => {
                self.said_full = false;
                let id = (self.new_id)();
                self.ids.push_back((frame.seq, id));
            }
            Ok(None) => {}
            Err(full) => {
                self.effects.push_back(Effect::Bell);
                if !self.said_full {
                    self.said_full = true;
                    self.notice(format!(
                        "[rvc: {} keys not sent: {} bytes already wait for the terminal to take them (at most {}); type again once it catches up]",
                        full.more, full.held, full.limit
                    ));
                }
            }
        }
        debug_assert_eq!(
            self.ids.len(),
            self.keys.unacked().count(),
            "one request id per held frame"
        );
    }

    /// Sends the oldest held frame when the stream is up and no frame is
    /// out: frames go one at a time, so the server numbers them in the
    /// order typed.
    fn pump_writes(&mut self, now: Instant) {
        if self.link != Link::Up || self.in_flight.is_some() {
            return;
        }
        if self.write_at.is_some_and(|at| now < at) {
            return;
        }
        self.write_at = None;
        let Some(frame) = self.keys.unacked().next() else {
            return;
        };
        let Some((seq, id)) = self.ids.front() else {
            debug_assert!(false, "a held frame without its request id");
            return;
        };
        debug_assert_eq!(*seq, frame.seq);
        self.in_flight = Some(frame.seq);
        self.effects.push_back(Effect::Write {
            seq: frame.seq,
            request_id: id.clone(),
            data: frame.bytes.clone(),
        });
    }

    fn pump_resize(&mut self, now: Instant) {
        if self.link != Link::Up || self.resize_in_flight {
            return;
        }
        if self.resize_at.is_some_and(|at| now < at) {
            return;
        }
        self.resize_at = None;
        let Some(size) = self.size_wanted else { return };
        if self.size_done == Some(size) {
            return;
        }
        let id = match &self.resize_id {
            // the same size again (after a failure) keeps its request id
            Some((id, s)) if *s == size => id.clone(),
            _ => {
                let id = (self.new_id)();
                self.resize_id = Some((id.clone(), size));
                id
            }
        };
        self.resize_in_flight = true;
        self.effects.push_back(Effect::Resize {
            request_id: id,
            rows: size.0,
            cols: size.1,
        });
    }

    fn heard(&mut self, now: Instant) {
        self.progress_at = now;
        self.pause = FIRST_PAUSE;
    }

    fn attached(&mut self, now: Instant) {
        if self.link == Link::Up {
            debug_assert!(false, "attached twice");
            return;
        }
        self.link = Link::Up;
        self.progress_at = now;
        if self.said_reconnecting {
            self.said_reconnecting = false;
            let held = self.keys.held();
            if held > 0 {
                self.catching_up = true;
                self.notice(format!("[rvc: catching up {held} keys]"));
            } else {
                self.notice("[rvc: reconnected]".to_owned());
            }
        }
        // held frames go again at once, in order, with their ids
        self.write_at = None;
        self.write_pause = FIRST_PAUSE;
        self.resize_at = None;
        self.pump_writes(now);
        self.pump_resize(now);
    }

    fn output(&mut self, offset: u64, data: &[u8]) {
        let Some(end) = offset.checked_add(data.len() as u64) else {
            self.notice(format!(
                "[rvc: output at offset {offset} is past the largest offset; skipped]"
            ));
            return;
        };
        if end <= self.offset {
            // printed before a reattach
            return;
        }
        if offset > self.offset {
            // a gap the server did not name is still said
            self.cut(offset - self.offset);
            self.offset = offset;
        }
        let skip = usize::try_from(self.offset - offset).unwrap_or(usize::MAX);
        let fresh = data.get(skip..).unwrap_or_default();
        debug_assert!(!fresh.is_empty());
        self.effects.push_back(Effect::Print(fresh.to_vec()));
        self.offset = end;
    }

    fn cut(&mut self, n: u64) {
        self.notice(format!("[rvc: {n} bytes of output were cut]"));
    }

    fn closed(&mut self, info: Box<wire::PtySessionInfo>) {
        let reason = if info.close_reason.is_empty() {
            "closed".to_owned()
        } else {
            info.close_reason.clone()
        };
        let how = exit_text(info.exit_result.as_ref());
        self.notice(format!(
            "[rvc: terminal {} closed: {reason}; {how}]",
            self.terminal
        ));
        self.say_unsent("were not delivered: the terminal closed first");
        self.exit(End::Closed(info));
    }

    fn lost(&mut self, now: Instant, reason: &str) {
        if self.detaching.is_some() {
            self.finish_detach();
            return;
        }
        if now.duration_since(self.progress_at) >= self.give_up {
            self.notice(format!(
                "[rvc: gave up reconnecting after {} s without the server ({reason}); rvc attach {} --from {} to return]",
                self.give_up.as_secs(),
                self.terminal,
                self.offset
            ));
            self.say_unsent("were not delivered");
            self.exit(End::GaveUp);
            return;
        }
        if !self.said_reconnecting {
            self.said_reconnecting = true;
            self.catching_up = false;
            self.notice("[rvc: reconnecting…]".to_owned());
        }
        self.link = Link::Waiting(now + self.pause);
        self.pause = (self.pause * 2).min(MAX_PAUSE);
    }

    fn written(&mut self, now: Instant, seq: u64) {
        if self.in_flight != Some(seq) {
            debug_assert!(false, "an answer for frame {seq} that was not out");
            return;
        }
        self.in_flight = None;
        self.heard(now);
        self.write_pause = FIRST_PAUSE;
        self.keys.ack(seq);
        while self.ids.front().is_some_and(|(s, _)| *s <= seq) {
            self.ids.pop_front();
        }
        if self.detaching.is_some() {
            if self.ids.is_empty() {
                self.finish_detach();
            } else {
                self.pump_writes(now);
            }
            return;
        }
        if self.ids.is_empty() && self.catching_up {
            self.catching_up = false;
            self.notice("[rvc: caught up]".to_owned());
        }
        self.pump_writes(now);
    }

    fn write_failed(&mut self, now: Instant, seq: u64, retry: bool, message: &str) {
        if self.in_flight != Some(seq) {
            debug_assert!(false, "a failure for frame {seq} that was not out");
            return;
        }
        self.in_flight = None;
        if retry {
            // the same frame goes again, with the same request id
            self.write_at = Some(now + self.write_pause);
            self.write_pause = (self.write_pause * 2).min(MAX_PAUSE);
            return;
        }
        let n = self.keys.discard();
        self.ids.clear();
        self.notice(format!("[rvc: {n} keys were not sent: {message}]"));
        if self.detaching.is_some() {
            self.finish_detach();
        }
    }

    fn timeout(&mut self, now: Instant) {
        if let Some(at) = self.detaching
            && now >= at
        {
            self.finish_detach();
            return;
        }
        if let Link::Waiting(at) = self.link
            && now >= at
        {
            self.link = Link::Attaching;
            self.effects.push_back(Effect::Attach { from: self.offset });
        }
        self.pump_writes(now);
        self.pump_resize(now);
    }

    fn begin_detach(&mut self, now: Instant) {
        if self.ids.is_empty() || self.link != Link::Up {
            self.finish_detach();
            return;
        }
        // keys typed before `~.` are given a moment to be stored
        self.detaching = Some(now + DETACH_DRAIN);
        self.pump_writes(now);
    }

    fn finish_detach(&mut self) {
        self.say_unsent("typed before the detach may not have reached the terminal");
        self.say_detached();
        self.exit(End::Detached);
    }

    fn say_detached(&mut self) {
        self.notice(format!(
            "[rvc: detached from {t} at offset {o}; rvc attach {t} to return]",
            t = self.terminal,
            o = self.offset
        ));
    }

    fn say_unsent(&mut self, what: &str) {
        let n = self.keys.held();
        if n > 0 {
            self.notice(format!("[rvc: {n} keys {what}]"));
        }
    }

    fn notice(&mut self, text: String) {
        self.effects.push_back(Effect::Notice(text));
    }

    fn exit(&mut self, end: End) {
        self.ended = true;
        self.effects.push_back(Effect::Exit(end));
    }
}

/// How a terminal's shell ended, in words.
pub(crate) fn exit_text(r: Option<&wire::ExitResult>) -> String {
    match r {
        Some(wire::ExitResult {
            exit_code: Some(c), ..
        }) => format!("exit status {c}"),
        Some(wire::ExitResult {
            signal_number: Some(n),
            signal_name,
            ..
        }) if signal_name.is_empty() => format!("ended by signal {n}"),
        Some(wire::ExitResult {
            signal_number: Some(_),
            signal_name,
            ..
        }) => format!("ended by {signal_name}"),
        _ => "no exit status".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    type Ids = Box<dyn FnMut() -> String>;

    const T: &str = "0199aaaa-0000-7000-8000-000000000001";

    fn ids() -> Ids {
        let mut n = 0;
        Box::new(move || {
            n += 1;
            format!("id-{n}")
        })
    }

    /// A viewer from offset `from`, its first attach answered.
    fn viewer(from: u64) -> (Viewer<Ids>, Instant) {
        let now = Instant::now();
        let mut v = Viewer::new(T, from, now, Duration::from_secs(60), Some((24, 80)), ids());
        v.handle(now, Input::Attached);
        assert!(drain(&mut v).is_empty());
        (v, now)
    }

    fn drain(v: &mut Viewer<Ids>) -> Vec<Effect> {
        std::iter::from_fn(|| v.poll_effect()).collect()
    }

    fn printed(effects: &[Effect]) -> Vec<u8> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Print(b) => Some(b.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn notices(effects: &[Effect]) -> Vec<String> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Notice(n) => Some(n.clone()),
                _ => None,
            })
            .collect()
    }

    fn writes(effects: &[Effect]) -> Vec<(u64, String, Vec<u8>)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Write {
                    seq,
                    request_id,
                    data,
                } => Some((*seq, request_id.clone(), data.clone())),
                _ => None,
            })
            .collect()
    }

    fn out(offset: u64, data: &[u8]) -> Input {
        Input::Output {
            offset,
            data: data.to_vec(),
        }
    }

    fn lost() -> Input {
        Input::StreamLost {
            reason: "UNAVAILABLE".into(),
        }
    }

    /// Loses the stream and reattaches at the deadline; returns the
    /// offset asked and the effects of the reattach.
    fn reattach(v: &mut Viewer<Ids>, now: &mut Instant) -> (u64, Vec<Effect>) {
        v.handle(*now, lost());
        let said = drain(v);
        assert!(
            said.iter().all(|e| matches!(e, Effect::Notice(_))),
            "nothing is sent while the stream is down: {said:?}"
        );
        // the next deadlines (a resend's may come first) until the attach
        let from = loop {
            *now = v.poll_timeout().unwrap();
            v.handle(*now, Input::Timeout);
            let e = drain(v);
            match e.as_slice() {
                [] => {}
                [Effect::Attach { from }] => break *from,
                _ => panic!("only an attach while the stream is down: {e:?}"),
            }
        };
        v.handle(*now, Input::Attached);
        (from, drain(v))
    }

    #[test]
    fn a_reattach_asks_from_the_printed_offset_and_prints_no_byte_twice() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, out(0, b"$ ls\r\n"));
        v.handle(now, out(6, b"a b\r\n$ "));
        let first = printed(&drain(&mut v));
        assert_eq!(first, b"$ ls\r\na b\r\n$ ");
        assert_eq!(v.offset(), 13);

        let (from, said) = reattach(&mut v, &mut now);
        assert_eq!(from, 13, "from just past the last byte printed");
        assert!(notices(&said).contains(&"[rvc: reconnected]".to_owned()));
        // the server repeats what was printed, then goes on
        v.handle(now, out(6, b"a b\r\n$ "));
        v.handle(now, out(10, b"\n$ echo"));
        v.handle(now, out(17, b" hi"));
        let again = printed(&drain(&mut v));
        assert_eq!(again, b"echo hi", "only the bytes after offset 13");
        assert_eq!(v.offset(), 20);
    }

    #[test]
    fn the_first_attach_and_reattaches_use_the_given_offset() {
        let (mut v, mut now) = viewer(500);
        v.handle(now, out(400, b"old"));
        assert!(drain(&mut v).is_empty(), "before --from: not printed");
        v.handle(now, out(500, b"new"));
        assert_eq!(printed(&drain(&mut v)), b"new");
        assert_eq!(reattach(&mut v, &mut now).0, 503);
    }

    #[test]
    fn held_keys_are_resent_in_order_with_their_ids_and_dropped_only_when_answered() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, Input::Typed(b"ls".to_vec()));
        let e = drain(&mut v);
        assert_eq!(writes(&e), vec![(1, "id-1".into(), b"ls".to_vec())]);
        // typed while frame 1 is out: held, not sent
        v.handle(now, Input::Typed(b"\r".to_vec()));
        v.handle(now, Input::Typed(b"pwd".to_vec()));
        assert!(writes(&drain(&mut v)).is_empty(), "one frame out at a time");

        // the stream breaks before frame 1 is answered, and its write
        // fails too; more keys are typed while disconnected
        v.handle(now, lost());
        v.handle(
            now,
            Input::WriteFailed {
                seq: 1,
                retry: true,
                message: "transport".into(),
            },
        );
        v.handle(now, Input::Typed(b"\r".to_vec()));
        let e = drain(&mut v);
        assert!(writes(&e).is_empty(), "nothing sent while down: {e:?}");
        assert!(notices(&e).contains(&"[rvc: reconnecting…]".to_owned()));
        assert_eq!(v.room(), HELD_KEYS - 7);

        now = v.poll_timeout().unwrap();
        v.handle(now, Input::Timeout);
        assert_eq!(drain(&mut v), vec![Effect::Attach { from: 0 }]);
        v.handle(now, Input::Attached);
        let e = drain(&mut v);
        assert!(notices(&e).contains(&"[rvc: catching up 7 keys]".to_owned()));
        // the oldest unanswered frame again, with its original id
        assert_eq!(writes(&e), vec![(1, "id-1".into(), b"ls".to_vec())]);
        let mut sent = vec![];
        for seq in 1..=4 {
            v.handle(now, Input::Written { seq });
            let e = drain(&mut v);
            sent.extend(writes(&e));
            if seq == 4 {
                assert!(notices(&e).contains(&"[rvc: caught up]".to_owned()));
            }
        }
        assert_eq!(
            sent,
            vec![
                (2, "id-2".into(), b"\r".to_vec()),
                (3, "id-3".into(), b"pwd".to_vec()),
                (4, "id-4".into(), b"\r".to_vec()),
            ],
            "in order, each with the id it was first sent with"
        );
        assert_eq!(v.room(), HELD_KEYS, "dropped once answered");
        assert_eq!(v.poll_timeout(), None);
    }

    #[test]
    fn a_frame_is_held_until_answered_even_across_several_reattaches() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, Input::Typed(b"x".to_vec()));
        assert_eq!(writes(&drain(&mut v)).len(), 1);
        for _ in 0..3 {
            v.handle(
                now,
                Input::WriteFailed {
                    seq: 1,
                    retry: true,
                    message: "UNAVAILABLE".into(),
                },
            );
            let (_, e) = reattach(&mut v, &mut now);
            assert_eq!(writes(&e), vec![(1, "id-1".into(), b"x".to_vec())]);
            assert_eq!(v.room(), HELD_KEYS - 1);
        }
        v.handle(now, Input::Written { seq: 1 });
        assert_eq!(v.room(), HELD_KEYS);
    }

    #[test]
    fn a_retryable_write_failure_sends_the_same_frame_again_after_a_pause() {
        let (mut v, now) = viewer(0);
        v.handle(now, Input::Typed(b"a".to_vec()));
        drain(&mut v);
        v.handle(
            now,
            Input::WriteFailed {
                seq: 1,
                retry: true,
                message: "CAPACITY_EXHAUSTED".into(),
            },
        );
        assert!(drain(&mut v).is_empty());
        let at = v.poll_timeout().unwrap();
        assert_eq!(at, now + FIRST_PAUSE);
        v.handle(at, Input::Timeout);
        assert_eq!(
            writes(&drain(&mut v)),
            vec![(1, "id-1".into(), b"a".to_vec())]
        );
    }

    #[test]
    fn a_full_buffer_refuses_typing_with_a_bell_and_one_notice() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, lost());
        drain(&mut v);
        let chunk = vec![b'a'; 1024];
        for _ in 0..4 {
            v.handle(now, Input::Typed(chunk.clone()));
        }
        assert_eq!(v.room(), 0);
        v.handle(now, Input::Typed(b"b".to_vec()));
        v.handle(now, Input::Typed(b"c".to_vec()));
        let e = drain(&mut v);
        assert_eq!(e.iter().filter(|e| **e == Effect::Bell).count(), 2);
        let n = notices(&e);
        assert_eq!(n.len(), 1, "said once: {n:?}");
        assert!(n[0].starts_with("[rvc: 1 keys not sent"), "{n:?}");
        // the refused keys are not held: once everything held is
        // answered, exactly the 4 KiB typed before went out
        now = v.poll_timeout().unwrap();
        v.handle(now, Input::Timeout);
        drain(&mut v);
        v.handle(now, Input::Attached);
        let mut sent = writes(&drain(&mut v));
        for seq in 1..=4 {
            v.handle(now, Input::Written { seq });
            sent.extend(writes(&drain(&mut v)));
        }
        let bytes: Vec<u8> = sent.into_iter().flat_map(|(_, _, d)| d).collect();
        assert_eq!(bytes, vec![b'a'; 4096]);
        v.handle(now, Input::Typed(b"d".to_vec()));
        let e = drain(&mut v);
        assert_eq!(writes(&e), vec![(5, "id-5".into(), b"d".to_vec())]);
    }

    #[test]
    fn tilde_dot_detaches_and_nothing_is_sent_after_it() {
        let (mut v, now) = viewer(0);
        v.handle(now, out(0, b"$ "));
        drain(&mut v);
        v.handle(now, Input::Typed(b"~.rm -rf /\r".to_vec()));
        let e = drain(&mut v);
        assert!(writes(&e).is_empty(), "{e:?}");
        assert_eq!(
            notices(&e),
            vec![format!(
                "[rvc: detached from {T} at offset 2; rvc attach {T} to return]"
            )]
        );
        assert_eq!(e.last(), Some(&Effect::Exit(End::Detached)));
        assert!(v.ended());
        // nothing after it, whatever comes
        v.handle(now, Input::Typed(b"echo hi\r".to_vec()));
        v.handle(now, out(2, b"more"));
        v.handle(now, lost());
        v.handle(now, Input::Timeout);
        assert!(drain(&mut v).is_empty());
        assert_eq!(v.poll_timeout(), None);
    }

    #[test]
    fn a_detach_lets_keys_typed_before_it_be_stored_first() {
        let (mut v, now) = viewer(0);
        v.handle(now, Input::Typed(b"ls\r~.".to_vec()));
        let e = drain(&mut v);
        assert_eq!(writes(&e), vec![(1, "id-1".into(), b"ls\r".to_vec())]);
        assert!(!v.ended(), "waits for the answer");
        v.handle(now, Input::Typed(b"whoami\r".to_vec()));
        assert!(drain(&mut v).is_empty(), "typed after ~.: never sent");
        v.handle(now, Input::Written { seq: 1 });
        let e = drain(&mut v);
        assert!(writes(&e).is_empty());
        assert_eq!(e.last(), Some(&Effect::Exit(End::Detached)));

        // without an answer it gives up after the drain time and says so
        let (mut v, now) = viewer(0);
        v.handle(now, Input::Typed(b"ls\r~.".to_vec()));
        drain(&mut v);
        let at = v.poll_timeout().unwrap();
        assert_eq!(at, now + DETACH_DRAIN);
        v.handle(at, Input::Timeout);
        let e = drain(&mut v);
        assert_eq!(
            notices(&e)[0],
            "[rvc: 3 keys typed before the detach may not have reached the terminal]"
        );
        assert_eq!(e.last(), Some(&Effect::Exit(End::Detached)));
    }

    #[test]
    fn tilde_question_mark_prints_help_and_a_double_tilde_sends_one() {
        let (mut v, now) = viewer(0);
        v.handle(now, Input::Typed(b"~?".to_vec()));
        let e = drain(&mut v);
        assert!(notices(&e)[0].contains("~."), "{e:?}");
        assert!(writes(&e).is_empty());
        v.handle(now, Input::Typed(b"~~".to_vec()));
        assert_eq!(
            writes(&drain(&mut v)),
            vec![(1, "id-1".into(), b"~".to_vec())]
        );
    }

    #[test]
    fn a_cut_prints_one_marker_and_output_goes_on_from_the_ring() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, out(0, b"abc"));
        drain(&mut v);
        reattach(&mut v, &mut now);
        v.handle(
            now,
            Input::Cut {
                requested_offset: 3,
                ring_start_offset: 1000,
            },
        );
        v.handle(now, out(1000, b"xyz"));
        let e = drain(&mut v);
        assert_eq!(
            e,
            vec![
                Effect::Notice("[rvc: 997 bytes of output were cut]".into()),
                Effect::Print(b"xyz".to_vec()),
            ]
        );
        assert_eq!(v.offset(), 1003);
        // a gap the server does not name is said all the same
        v.handle(now, out(1010, b"!"));
        let e = drain(&mut v);
        assert_eq!(
            notices(&e),
            vec!["[rvc: 7 bytes of output were cut]".to_owned()]
        );
        assert_eq!(printed(&e), b"!");
    }

    #[test]
    fn the_close_says_its_reason_and_status_and_ends_the_view() {
        let (mut v, now) = viewer(0);
        let info = wire::PtySessionInfo {
            close_reason: "the shell exited".into(),
            exit_result: Some(wire::ExitResult {
                lifecycle: wire::Lifecycle::Failed as i32,
                exit_code: Some(3),
                ..Default::default()
            }),
            ..Default::default()
        };
        v.handle(now, Input::Closed(Box::new(info.clone())));
        let e = drain(&mut v);
        assert_eq!(
            notices(&e),
            vec![format!(
                "[rvc: terminal {T} closed: the shell exited; exit status 3]"
            )]
        );
        assert_eq!(e.last(), Some(&Effect::Exit(End::Closed(Box::new(info)))));
    }

    #[test]
    fn reattaches_back_off_up_to_five_seconds_and_give_up_without_progress() {
        let now = Instant::now();
        let mut v = Viewer::new(T, 0, now, Duration::from_secs(20), None, ids());
        v.handle(now, Input::Attached);
        let mut t = now;
        let mut pauses = vec![];
        loop {
            v.handle(t, lost());
            if v.ended() {
                break;
            }
            let at = v.poll_timeout().unwrap();
            pauses.push(at - t);
            t = at;
            v.handle(t, Input::Timeout);
            assert_eq!(drain(&mut v).last(), Some(&Effect::Attach { from: 0 }));
        }
        assert_eq!(pauses[0], FIRST_PAUSE);
        assert!(pauses.iter().all(|p| *p <= MAX_PAUSE));
        assert_eq!(pauses.last(), Some(&MAX_PAUSE));
        let e = drain(&mut v);
        assert_eq!(e.last(), Some(&Effect::Exit(End::GaveUp)));
        assert!(notices(&e).iter().any(|n| n.contains("--from 0")));
    }

    #[test]
    fn the_window_size_is_sent_when_it_changes_and_again_after_a_failure() {
        let (mut v, mut now) = viewer(0);
        v.handle(now, Input::Resized { rows: 24, cols: 80 });
        assert!(drain(&mut v).is_empty(), "the size it was opened with");
        v.handle(
            now,
            Input::Resized {
                rows: 50,
                cols: 2000,
            },
        );
        let e = drain(&mut v);
        assert_eq!(
            e,
            vec![Effect::Resize {
                request_id: "id-1".into(),
                rows: 50,
                cols: MAX_SIDE
            }]
        );
        v.handle(
            now,
            Input::ResizeFailed {
                retry: true,
                message: "UNAVAILABLE".into(),
            },
        );
        v.handle(now, lost());
        drain(&mut v);
        now = v.poll_timeout().unwrap();
        v.handle(now, Input::Timeout);
        drain(&mut v);
        v.handle(now, Input::Attached);
        let e = drain(&mut v);
        assert!(e.contains(&Effect::Resize {
            request_id: "id-1".into(),
            rows: 50,
            cols: MAX_SIDE
        }));
        v.handle(
            now,
            Input::ResizeDone {
                rows: 50,
                cols: MAX_SIDE,
            },
        );
        v.handle(now, Input::Resized { rows: 0, cols: 0 });
        assert!(drain(&mut v).is_empty());
    }

    #[test]
    fn a_signal_detaches_and_names_keys_not_delivered() {
        let (mut v, now) = viewer(0);
        v.handle(now, lost());
        v.handle(now, Input::Typed(b"abc".to_vec()));
        drain(&mut v);
        v.handle(now, Input::Signal(15));
        let e = drain(&mut v);
        assert_eq!(
            notices(&e)[0],
            "[rvc: 3 keys may not have reached the terminal]"
        );
        assert_eq!(e.last(), Some(&Effect::Exit(End::Signalled(15))));
    }

    #[test]
    fn a_final_write_refusal_gives_up_the_held_keys_and_says_so() {
        let (mut v, now) = viewer(0);
        v.handle(now, Input::Typed(b"a".to_vec()));
        v.handle(now, Input::Typed(b"b".to_vec()));
        drain(&mut v);
        v.handle(
            now,
            Input::WriteFailed {
                seq: 1,
                retry: false,
                message: "FAILED_PRECONDITION: the terminal is closed".into(),
            },
        );
        let e = drain(&mut v);
        assert_eq!(
            notices(&e),
            vec!["[rvc: 2 keys were not sent: FAILED_PRECONDITION: the terminal is closed]"]
        );
        assert_eq!(v.room(), HELD_KEYS);
        v.handle(now, Input::Typed(b"c".to_vec()));
        assert_eq!(
            writes(&drain(&mut v)),
            vec![(3, "id-3".into(), b"c".to_vec())]
        );
    }
}
