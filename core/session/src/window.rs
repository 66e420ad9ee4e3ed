//! Event ingest bookkeeping: per-command sequencing and the unacknowledged
//! send windows (plan §6.1, R-6.1-06), and the server-wide ingress
//! admission hysteresis (R-6.1-17/18).
//!
//! The window measure is the encoded length of the `CommandEvent` message
//! ([`event_window_cost`]); the client spool counts the same value, so a
//! compliant client never trips the server's check.

use std::collections::{BTreeMap, VecDeque};

use prost::Message as _;
use rvbox_domain::events::{SeqError, SeqVerdict, check_event_seq};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{
    DEFAULT_SERVER_HIGH_WATERMARK_BYTES, DEFAULT_SERVER_LOW_WATERMARK_BYTES,
};
use rvbox_proto::v1 as wire;
use thiserror::Error;

/// Most unacknowledged events one session may have in flight, whatever
/// their size. Bounds the per-command release queues; a client with this
/// many tiny events outstanding is closed with `INGRESS_OVERLOAD` (no ack;
/// it retries after reconnect).
pub const MAX_UNACKED_EVENTS_PER_SESSION: usize = 65_536;
/// Most commands one session tracks at once. The client runs at most 1024
/// and reconciliation lists at most 10 000, so this is never reached by a
/// compliant client.
pub const MAX_TRACKED_COMMANDS_PER_SESSION: usize = 16_384;
/// Capacity of a session's descriptor queue of events held back while the
/// ingress gate is closed (plan §6.1 "bounded descriptor queue"): as many
/// as the session may have unacknowledged, so that an honest client,
/// which stops at its send windows when nothing is acknowledged, waits
/// for the gate instead of being closed. (A smaller queue closed a client
/// replaying thousands of short events after a partition again and again,
/// each session storing only what came before the gate closed.) The
/// windows bound the held bytes.
pub const HELD_EVENTS_CAPACITY: usize = MAX_UNACKED_EVENTS_PER_SESSION;

/// Window cost of one event: its encoded `CommandEvent` length.
#[must_use]
pub fn event_window_cost(event: &wire::CommandEvent) -> u64 {
    u64::try_from(event.encoded_len()).unwrap_or(u64::MAX)
}

/// Whether an event body is bulk output, which the ingress gate holds back.
/// Every other body (lifecycle, truncation, incomplete, signal result, stdin
/// ack, diagnostics, profile result) uses the lifecycle/control reserve.
#[must_use]
pub fn is_gated_body(event: &wire::CommandEvent) -> bool {
    matches!(event.body, Some(wire::command_event::Body::Output(_)))
}

/// A change of the server-wide ingress gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateChange {
    /// The backlog went above the high watermark: hold new output.
    Closed,
    /// The backlog fell below the low watermark: resume admission.
    Opened,
}

/// More bytes released than were admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("ingress gate released {released} bytes but only {level} are admitted")]
pub struct GateUnderflow {
    /// Bytes currently admitted.
    pub level: u64,
    /// Bytes the caller tried to release.
    pub released: u64,
}

/// Low watermark not below the high one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("ingress low watermark {low} is not below high watermark {high}")]
pub struct GateConfigError {
    /// High watermark.
    pub high: u64,
    /// Low watermark.
    pub low: u64,
}

/// Server-wide ingress admission hysteresis (plan §6.1: 64 MiB / 32 MiB).
///
/// Closes when the admitted-but-not-durable backlog is strictly above
/// `high` and reopens only when it is strictly below `low` (the plan's
/// "above high" / "below low"). The shell owns one gate, counts each
/// delivered event descriptor in ([`Self::admit`]) and each durable one out
/// ([`Self::release`]), and broadcasts a change to every session as
/// [`crate::Input::IngressGate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngressGate {
    high: u64,
    low: u64,
    level: u64,
    open: bool,
}

impl Default for IngressGate {
    fn default() -> Self {
        Self {
            high: DEFAULT_SERVER_HIGH_WATERMARK_BYTES,
            low: DEFAULT_SERVER_LOW_WATERMARK_BYTES,
            level: 0,
            open: true,
        }
    }
}

impl IngressGate {
    /// An open gate with the given watermarks.
    ///
    /// # Errors
    /// [`GateConfigError`] unless `low < high`.
    pub fn new(high: u64, low: u64) -> Result<Self, GateConfigError> {
        if low >= high {
            return Err(GateConfigError { high, low });
        }
        Ok(Self {
            high,
            low,
            level: 0,
            open: true,
        })
    }

    /// Whether new output may be admitted.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Bytes admitted and not yet durable.
    #[must_use]
    pub fn level(&self) -> u64 {
        self.level
    }

    /// Counts `bytes` of admitted event descriptors.
    pub fn admit(&mut self, bytes: u64) -> Option<GateChange> {
        self.level = self.level.saturating_add(bytes);
        if self.open && self.level > self.high {
            self.open = false;
            return Some(GateChange::Closed);
        }
        None
    }

    /// Counts `bytes` out once they are durable (or abandoned).
    ///
    /// # Errors
    /// [`GateUnderflow`] when more is released than admitted; the level is
    /// then left unchanged.
    pub fn release(&mut self, bytes: u64) -> Result<Option<GateChange>, GateUnderflow> {
        self.level = self.level.checked_sub(bytes).ok_or(GateUnderflow {
            level: self.level,
            released: bytes,
        })?;
        if !self.open && self.level < self.low {
            self.open = true;
            return Ok(Some(GateChange::Opened));
        }
        Ok(None)
    }
}

/// Why an event was not admitted to the window.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum AdmitError {
    /// Sequence 0 or a gap: protocol error.
    #[error("{0}")]
    Sequence(SeqError),
    /// The command's unacknowledged bytes would exceed its window.
    #[error("command window exceeded: {in_flight} + {cost} > {limit} unacknowledged bytes")]
    CommandWindow {
        in_flight: u64,
        cost: u64,
        limit: u64,
    },
    /// The session's unacknowledged bytes would exceed its window.
    #[error("session window exceeded: {in_flight} + {cost} > {limit} unacknowledged bytes")]
    SessionWindow {
        in_flight: u64,
        cost: u64,
        limit: u64,
    },
    /// Too many events in flight (bounded queue).
    #[error("more than {MAX_UNACKED_EVENTS_PER_SESSION} unacknowledged events")]
    TooManyEvents,
    /// Too many commands tracked (bounded map).
    #[error("more than {MAX_TRACKED_COMMANDS_PER_SESSION} commands in flight")]
    TooManyCommands,
}

impl AdmitError {
    /// Whether the peer broke the protocol (as opposed to overloading us).
    pub(crate) fn is_protocol_error(&self) -> bool {
        matches!(
            self,
            Self::Sequence(_) | Self::CommandWindow { .. } | Self::SessionWindow { .. }
        )
    }
}

/// One command's ingest state in this session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct CommandWindow {
    /// Highest contiguous event_seq received (durable baseline or later).
    received: u64,
    /// Highest event_seq acknowledged in this session (or the baseline).
    acked: u64,
    /// Unacknowledged events in arrival order: (event_seq, cost).
    in_flight: VecDeque<(u64, u64)>,
    /// Sum of the costs in `in_flight`.
    bytes: u64,
    /// Events of this command held back by the ingress gate.
    held: usize,
    /// Sequence of the terminal lifecycle event once received.
    terminal_seq: Option<u64>,
}

impl CommandWindow {
    fn finished(&self) -> bool {
        self.in_flight.is_empty()
            && self.held == 0
            && self.terminal_seq.is_some_and(|t| self.acked >= t)
    }
}

/// Result of a durable report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Durable {
    /// Cumulative sequence to acknowledge, if an ack is due.
    pub(crate) ack: Option<u64>,
    /// Window bytes released.
    pub(crate) released_bytes: u64,
}

/// Commands whose terminal event this session acknowledged that it still
/// remembers, with that terminal sequence: an exact repeat of one of their
/// events is a repeat (re-acknowledged once the store compared it), not a
/// new command starting past 1. Oldest forgotten first.
pub(crate) const MAX_FINISHED_REMEMBERED: usize = 1024;

/// Per-session ingest state over all commands (BTreeMap: deterministic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Windows {
    commands: BTreeMap<Uuid7, CommandWindow>,
    /// Finished commands and their terminal sequence (bounded FIFO).
    finished: BTreeMap<Uuid7, u64>,
    finished_order: VecDeque<Uuid7>,
    bytes: u64,
    events: usize,
    command_limit: u64,
    session_limit: u64,
}

impl Windows {
    pub(crate) fn new(command_limit: u64, session_limit: u64) -> Self {
        Self {
            commands: BTreeMap::new(),
            finished: BTreeMap::new(),
            finished_order: VecDeque::new(),
            bytes: 0,
            events: 0,
            command_limit,
            session_limit,
        }
    }

    /// Unacknowledged bytes in this session.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.bytes
    }

    /// Seeds a command's baseline from a written `ReconcileResult` resume
    /// row; a command already tracked keeps its state.
    pub(crate) fn seed(&mut self, issue: Uuid7, durable_seq: u64) -> Result<(), AdmitError> {
        if self.commands.contains_key(&issue) {
            return Ok(());
        }
        if self.commands.len() >= MAX_TRACKED_COMMANDS_PER_SESSION {
            return Err(AdmitError::TooManyCommands);
        }
        self.commands.insert(
            issue,
            CommandWindow {
                received: durable_seq,
                acked: durable_seq,
                ..CommandWindow::default()
            },
        );
        Ok(())
    }

    /// Admits one event into the window. Returns whether it repeats an
    /// already received sequence (the store decides identical or
    /// conflicting by content; plan §4.2). Nothing changes on error.
    pub(crate) fn admit(
        &mut self,
        issue: Uuid7,
        event_seq: u64,
        cost: u64,
        terminal: bool,
    ) -> Result<bool, AdmitError> {
        let (received, cmd_bytes) = match self.commands.get(&issue) {
            Some(c) => (c.received, c.bytes),
            None if self.commands.len() >= MAX_TRACKED_COMMANDS_PER_SESSION => {
                return Err(AdmitError::TooManyCommands);
            }
            // finished in this session: its events up to the terminal one
            // are repeats
            None => match self.finished.get(&issue) {
                Some(last) => (*last, 0),
                // plan §4.2: a command first seen in this session starts at 1.
                None => (0, 0),
            },
        };
        let repeat = if event_seq != 0 && event_seq <= received {
            true
        } else {
            // Content digests are the store's business; here only the
            // sequence shape (zero, next, gap) is decided.
            match check_event_seq(received, event_seq, None, &[0; 32]) {
                Ok(SeqVerdict::Append) => false,
                Ok(SeqVerdict::Duplicate) => true,
                Err(e) => return Err(AdmitError::Sequence(e)),
            }
        };
        if cmd_bytes.saturating_add(cost) > self.command_limit {
            return Err(AdmitError::CommandWindow {
                in_flight: cmd_bytes,
                cost,
                limit: self.command_limit,
            });
        }
        if self.bytes.saturating_add(cost) > self.session_limit {
            return Err(AdmitError::SessionWindow {
                in_flight: self.bytes,
                cost,
                limit: self.session_limit,
            });
        }
        if self.events >= MAX_UNACKED_EVENTS_PER_SESSION {
            return Err(AdmitError::TooManyEvents);
        }
        let entry = self
            .commands
            .entry(issue)
            .or_insert_with(|| match self.finished.get(&issue) {
                // tracked again until the repeat is answered
                Some(last) => CommandWindow {
                    received: *last,
                    acked: *last,
                    terminal_seq: Some(*last),
                    ..CommandWindow::default()
                },
                None => CommandWindow::default(),
            });
        entry.in_flight.push_back((event_seq, cost));
        entry.bytes = entry.bytes.saturating_add(cost);
        if !repeat {
            entry.received = event_seq;
            if terminal {
                entry.terminal_seq = Some(event_seq);
            }
        }
        self.bytes = self.bytes.saturating_add(cost);
        self.events = self.events.saturating_add(1);
        Ok(repeat)
    }

    fn remember_finished(&mut self, issue: Uuid7, last: u64) {
        if self.finished.insert(issue, last).is_none() {
            self.finished_order.push_back(issue);
            if self.finished_order.len() > MAX_FINISHED_REMEMBERED
                && let Some(oldest) = self.finished_order.pop_front()
            {
                self.finished.remove(&oldest);
            }
        }
    }

    /// Counts one held event of `issue` (ordering: later events of a command
    /// with held events are held too).
    pub(crate) fn set_held(&mut self, issue: Uuid7, held: bool) {
        if let Some(c) = self.commands.get_mut(&issue) {
            c.held = if held {
                c.held.saturating_add(1)
            } else {
                c.held.saturating_sub(1)
            };
        }
    }

    /// Whether `issue` has events held back.
    pub(crate) fn has_held(&self, issue: &Uuid7) -> bool {
        self.commands.get(issue).is_some_and(|c| c.held > 0)
    }

    /// The store made every event of `issue` up to `durable_seq` durable:
    /// release their window bytes and say whether an ack is due (the
    /// cumulative sequence advanced, or a repeat awaiting its answer was
    /// released). Unknown commands are ignored.
    pub(crate) fn durable(&mut self, issue: Uuid7, durable_seq: u64) -> Durable {
        let Some(c) = self.commands.get_mut(&issue) else {
            return Durable {
                ack: None,
                released_bytes: 0,
            };
        };
        let before_len = c.in_flight.len();
        let mut released_bytes = 0u64;
        c.in_flight.retain(|(seq, cost)| {
            if *seq <= durable_seq {
                released_bytes = released_bytes.saturating_add(*cost);
                false
            } else {
                true
            }
        });
        let released_events = before_len.saturating_sub(c.in_flight.len());
        c.bytes = c.bytes.saturating_sub(released_bytes);
        self.bytes = self.bytes.saturating_sub(released_bytes);
        self.events = self.events.saturating_sub(released_events);
        let advanced = durable_seq > c.acked;
        if advanced {
            c.acked = durable_seq;
            // The store is the authority: never expect a sequence it holds.
            c.received = c.received.max(durable_seq);
        }
        let ack = (advanced || released_events > 0).then_some(c.acked);
        if c.finished() {
            let last = c.acked;
            self.commands.remove(&issue);
            self.remember_finished(issue, last);
        }
        Durable {
            ack,
            released_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ISSUE: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    #[test]
    fn gate_thresholds_are_strict() {
        let mut g = IngressGate::new(100, 50).unwrap();
        assert_eq!(g.admit(100), None);
        assert!(g.is_open());
        assert_eq!(g.admit(1), Some(GateChange::Closed));
        assert_eq!(g.release(51), Ok(None));
        assert_eq!(g.level(), 50);
        assert!(!g.is_open());
        assert_eq!(g.release(1), Ok(Some(GateChange::Opened)));
        assert_eq!(
            g.release(50),
            Err(GateUnderflow {
                level: 49,
                released: 50
            })
        );
        assert_eq!(g.level(), 49);
        assert!(IngressGate::new(50, 50).is_err());
    }

    #[test]
    fn finished_commands_are_forgotten() {
        let issue = Uuid7::parse("x", ISSUE).unwrap();
        let mut w = Windows::new(1000, 8000);
        assert_eq!(w.admit(issue, 1, 10, false), Ok(false));
        assert_eq!(w.admit(issue, 2, 10, true), Ok(false));
        let d = w.durable(issue, 2);
        assert_eq!(d.ack, Some(2));
        assert_eq!(d.released_bytes, 20);
        assert!(w.commands.is_empty());
        assert_eq!(w.in_flight_bytes(), 0);
    }

    #[test]
    fn a_repeat_after_the_terminal_ack_is_a_repeat() {
        let issue = Uuid7::parse("x", ISSUE).unwrap();
        let mut w = Windows::new(1000, 8000);
        assert_eq!(w.admit(issue, 1, 10, false), Ok(false));
        assert_eq!(w.admit(issue, 2, 10, true), Ok(false));
        assert_eq!(w.durable(issue, 2).ack, Some(2));
        assert!(w.commands.is_empty());
        // an exact copy of event 1 or 2 arrives after the terminal ack
        assert_eq!(w.admit(issue, 1, 10, false), Ok(true));
        assert_eq!(w.in_flight_bytes(), 10);
        // answered by re-acknowledging the terminal sequence
        assert_eq!(w.durable(issue, 1).ack, Some(2));
        assert!(w.commands.is_empty());
        assert_eq!(w.in_flight_bytes(), 0);
        // past the terminal event nothing may follow
        assert!(matches!(
            w.admit(issue, 4, 10, false),
            Err(AdmitError::Sequence(SeqError::Gap { .. }))
        ));
    }

    #[test]
    fn finished_commands_are_remembered_within_a_bound() {
        let mut w = Windows::new(1000, 8000);
        for i in 0..(MAX_FINISHED_REMEMBERED as u64 + 10) {
            let issue = Uuid7::parse("x", &format!("01890a5d-ac96-774b-bcce-{i:012x}")).unwrap();
            assert_eq!(w.admit(issue, 1, 10, true), Ok(false));
            assert_eq!(w.durable(issue, 1).ack, Some(1));
        }
        assert_eq!(w.finished.len(), MAX_FINISHED_REMEMBERED);
        assert_eq!(w.finished_order.len(), MAX_FINISHED_REMEMBERED);
    }

    #[test]
    fn nothing_changes_on_refusal() {
        let issue = Uuid7::parse("x", ISSUE).unwrap();
        let mut w = Windows::new(100, 8000);
        assert_eq!(w.admit(issue, 1, 60, false), Ok(false));
        assert!(matches!(
            w.admit(issue, 2, 41, false),
            Err(AdmitError::CommandWindow { .. })
        ));
        assert!(matches!(
            w.admit(issue, 3, 1, false),
            Err(AdmitError::Sequence(SeqError::Gap {
                expected: 2,
                got: 3
            }))
        ));
        assert_eq!(w.admit(issue, 2, 40, false), Ok(false));
        assert_eq!(w.in_flight_bytes(), 100);
    }
}
