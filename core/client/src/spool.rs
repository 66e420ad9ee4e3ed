//! The spool core (plan §7.1-§7.2): one durable, command-local order for
//! every event a command produces, wire sequences assigned only on
//! admission to the send windows, and bounded work and storage with
//! explicit truncation markers for every gap.
//!
//! # The order of one command
//!
//! Every entry (an output chunk, a lifecycle change, a signal result, a
//! stdin acknowledgement, a truncation marker, an incomplete-output note)
//! gets the command's next `local_ordinal` when the spool takes it, and is
//! made durable by a [`SpoolOp::Append`] whose completion is a later
//! [`Spool::completed`]. Only durable entries are admitted to the send
//! windows, in ordinal order: [`SpoolOp::Assign`] durably gives a run of
//! them the next contiguous `event_seq`s (pinning them), and only after its
//! completion does [`SpoolOutput::Send`] hand the run to the sender, which
//! reads it back from the store. A pinned entry is immutable and is sent
//! again after every reconnect until a cumulative `EventAck` covers it;
//! then [`SpoolOp::Release`] deletes it. The terminal lifecycle entry is
//! always the command's last; once it is acknowledged the command is
//! [`SpoolOutput::Finished`].
//!
//! # Bounded work before the disk: watermarks and loss mode
//!
//! The raw backlog is the raw bytes taken from the pipes whose append is
//! not yet durable, per command and for the daemon. Taking a chunk that
//! would cross a high watermark (1 MiB per command, 8 MiB per daemon by
//! default) enters loss mode, scoped to the command or to the whole
//! daemon: its output chunks are counted and dropped instead of queued,
//! and loss mode ends only when both relevant backlogs are below their low
//! watermarks (256 KiB, 4 MiB). Dropped bytes accumulate in one open loss
//! run per command, closed into one `CLIENT_OVERLOAD` `OutputTruncation`
//! (exact raw-byte total, observation interval, the streams, no event range
//! and no compressed size, since neither ever existed) before the next
//! kept chunk, before any essential entry, and before the terminal entry.
//! Essential entries are never dropped: they do not count against the
//! backlog and have reserved entry capacity.
//!
//! # Bounded storage: rolling caps
//!
//! Durable output is capped per command by a rolling window of compressed
//! bytes (10 MiB) and for the daemon (256 MiB of command-owned output).
//! Past a cap, the oldest sealed spool segment whose output is all durable
//! and unsequenced is rotated away ([`SpoolOp::Rotate`]): its entries are
//! deleted and each maximal run of removed ordinals is replaced, in place,
//! by a `CLIENT_SPOOL` marker (merged into an adjacent earlier one). The
//! marker is a normal entry: it gets a normal wire sequence when admitted,
//! so no sequence is ever skipped or invented. Pinned entries are never
//! rotated; they are bounded by the 1 MiB per-command send window.
//!
//! Every count the spool keeps is bounded: entries per command and for the
//! daemon, commands, and the output queue.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{
    DEFAULT_CLIENT_DAEMON_BYTES, DEFAULT_CLIENT_HIGH_WATERMARK_BYTES,
    DEFAULT_CLIENT_LOW_WATERMARK_BYTES, DEFAULT_COMMAND_HIGH_WATERMARK_BYTES,
    DEFAULT_COMMAND_LOW_WATERMARK_BYTES, DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
    DEFAULT_COMMAND_SEND_WINDOW_BYTES, DEFAULT_SESSION_SEND_WINDOW_BYTES, MAX_RAW_CHUNK_BYTES,
    MAX_REASON_BYTES,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use thiserror::Error;

/// Bytes (raw output plus record framing) an output segment takes before
/// the next one starts; rotation frees whole segments.
pub const SEGMENT_RAW_BYTES: u64 = 1024 * 1024;
/// Framing of one segment record (the shared format's header and CRC).
pub const RECORD_FRAMING: u64 = 132;
/// Most entries one command holds. Output past it is dropped into loss
/// mode; essential entries have [`ESSENTIAL_RESERVE`] more.
pub const MAX_ENTRIES_PER_COMMAND: usize = 16_384;
/// Entries reserved per command for essential events beyond
/// [`MAX_ENTRIES_PER_COMMAND`].
pub const ESSENTIAL_RESERVE: usize = 1_024;
/// Most entries the daemon's spool holds; output past it is dropped.
pub const MAX_ENTRIES: usize = 262_144;
/// Entries of one command at which its oldest unsequenced segment is
/// rotated, as past its byte window: small output fills the entry cap
/// long before 10 MiB, and the rolling window then keeps the newest output
/// (rotating the oldest into `CLIENT_SPOOL` markers) instead of dropping
/// the newest.
pub const ROTATE_AT_ENTRIES: usize = MAX_ENTRIES_PER_COMMAND / 4 * 3;
/// Entries of the daemon at which the command with the most entries has
/// its oldest unsequenced segment rotated.
pub const ROTATE_AT_DAEMON_ENTRIES: usize = MAX_ENTRIES / 4 * 3;
/// Most commands the spool tracks (the client's record ceiling).
pub const MAX_COMMANDS: usize = 16_384;
/// Most outputs waiting to be drained; the shell drains after every input.
pub const MAX_OUTPUTS: usize = 65_536;
/// Most entries one `Assign` covers.
pub const MAX_ASSIGN_RUN: usize = 256;

/// The spool's limits (`flow.*` and `spool.*` of the client configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpoolLimits {
    /// Per-command raw backlog that enters loss mode.
    pub command_high: u64,
    /// Per-command raw backlog below which loss mode may end.
    pub command_low: u64,
    /// Daemon raw backlog that enters loss mode.
    pub daemon_high: u64,
    /// Daemon raw backlog below which loss mode may end.
    pub daemon_low: u64,
    /// Unacknowledged wire bytes per command.
    pub command_window: u64,
    /// Unacknowledged wire bytes per session.
    pub session_window: u64,
    /// Durable compressed output one command holds (rolling window).
    pub output_window: u64,
    /// Durable compressed output the daemon holds.
    pub daemon_output: u64,
}

impl Default for SpoolLimits {
    fn default() -> Self {
        Self {
            command_high: DEFAULT_COMMAND_HIGH_WATERMARK_BYTES,
            command_low: DEFAULT_COMMAND_LOW_WATERMARK_BYTES,
            daemon_high: DEFAULT_CLIENT_HIGH_WATERMARK_BYTES,
            daemon_low: DEFAULT_CLIENT_LOW_WATERMARK_BYTES,
            command_window: DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            session_window: DEFAULT_SESSION_SEND_WINDOW_BYTES,
            output_window: DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
            daemon_output: DEFAULT_CLIENT_DAEMON_BYTES,
        }
    }
}

/// Limits that cannot work together.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("spool limits: {0}")]
pub struct LimitsError(pub String);

impl SpoolLimits {
    /// Checks the relations the spool relies on.
    ///
    /// # Errors
    /// [`LimitsError`] naming the relation.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let chunk_cost = MAX_RAW_CHUNK_BYTES + 1024;
        let checks = [
            (
                self.command_low < self.command_high,
                "command low watermark must be below its high",
            ),
            (
                self.daemon_low < self.daemon_high,
                "daemon low watermark must be below its high",
            ),
            (
                self.command_high <= self.daemon_high,
                "command high watermark must not exceed the daemon's",
            ),
            (
                self.command_window >= chunk_cost,
                "command send window must hold one full output event",
            ),
            (
                self.command_window <= self.session_window,
                "command send window must not exceed the session's",
            ),
            (
                self.output_window >= 2 * SEGMENT_RAW_BYTES,
                "command output window must hold two spool segments",
            ),
            (
                self.output_window <= self.daemon_output,
                "command output window must not exceed the daemon's",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, what)) => Err(LimitsError((*what).into())),
            None => Ok(()),
        }
    }
}

/// A completion token of the spool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SpoolToken(pub u64);

/// What an append makes durable.
#[derive(Debug, Clone, PartialEq)]
pub enum AppendItem {
    /// Raw output bytes: compressed, written as one record of the command's
    /// spool segment `segment`, and indexed.
    Output {
        /// The stream.
        stream: wire::OutputStream,
        /// The command's spool segment ordinal (from 1).
        segment: u32,
        /// The raw bytes (at most 64 KiB).
        bytes: Vec<u8>,
    },
    /// A small event body, kept in the metadata.
    Event(Body),
}

/// A durable step the spool asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum SpoolOp {
    /// Insert one entry at `ordinal`.
    Append {
        /// Completion token.
        token: SpoolToken,
        /// The command.
        issue: Uuid7,
        /// Its local ordinal.
        ordinal: u64,
        /// Observed wall time.
        observed_ms: i64,
        /// What to store.
        item: AppendItem,
    },
    /// Give the entries `ordinals` (ascending, contiguous in the command's
    /// order) the wire sequences `first_seq..`, in one transaction.
    Assign {
        /// Completion token.
        token: SpoolToken,
        /// The command.
        issue: Uuid7,
        /// The entries.
        ordinals: Vec<u64>,
        /// The first sequence; the rest follow contiguously.
        first_seq: u64,
    },
    /// Delete the entries with a sequence up to `upto_seq` and record it as
    /// the server's acknowledgement; delete spool segments left empty.
    Release {
        /// Completion token.
        token: SpoolToken,
        /// The command.
        issue: Uuid7,
        /// The cumulative acknowledgement.
        upto_seq: u64,
    },
    /// Delete spool segment `segment` and the entries `removed`, and write
    /// (insert or replace) the `CLIENT_SPOOL` markers, in one transaction.
    Rotate {
        /// Completion token.
        token: SpoolToken,
        /// The command.
        issue: Uuid7,
        /// The segment.
        segment: u32,
        /// Entries removed.
        removed: Vec<u64>,
        /// Markers at these ordinals (each replaces a run, or grows an
        /// earlier marker in place).
        markers: Vec<(u64, i64, wire::OutputTruncation)>,
    },
    /// Record the open loss run's known totals (as the `CLIENT_OVERLOAD`
    /// marker it will become) on the command, so that a crash in loss
    /// mode still ends in its marker; applied only while the command's
    /// next ordinal is `marker_ordinal` (the marker's place: any later
    /// append has closed the run, and clears what was recorded).
    PersistLoss {
        /// Completion token.
        token: SpoolToken,
        /// The command.
        issue: Uuid7,
        /// The ordinal the run's marker will take.
        marker_ordinal: u64,
        /// The marker as it stands.
        run: wire::OutputTruncation,
    },
}

impl SpoolOp {
    /// Its token.
    #[must_use]
    pub fn token(&self) -> SpoolToken {
        match self {
            Self::Append { token, .. }
            | Self::Assign { token, .. }
            | Self::Release { token, .. }
            | Self::Rotate { token, .. }
            | Self::PersistLoss { token, .. } => *token,
        }
    }

    /// The command it concerns.
    #[must_use]
    pub fn issue(&self) -> Uuid7 {
        match self {
            Self::Append { issue, .. }
            | Self::Assign { issue, .. }
            | Self::Release { issue, .. }
            | Self::Rotate { issue, .. }
            | Self::PersistLoss { issue, .. } => *issue,
        }
    }
}

/// What the spool hands the shell.
#[derive(Debug, Clone, PartialEq)]
pub enum SpoolOutput {
    /// Perform a durable step and report its completion.
    Store(Box<SpoolOp>),
    /// Send the durable, sequenced events `first_seq..=last_seq` of `issue`
    /// (read back from the store).
    Send {
        /// The command.
        issue: Uuid7,
        /// First sequence.
        first_seq: u64,
        /// Last sequence.
        last_seq: u64,
    },
    /// The command's terminal event is acknowledged and every entry is
    /// released: it can become a tombstone.
    Finished {
        /// The command.
        issue: Uuid7,
    },
    /// The command's terminal entry is durable (its slot can be released
    /// and its wrapper removed).
    TerminalDurable {
        /// The command.
        issue: Uuid7,
    },
    /// A marker could not be made durable: the command's output can no
    /// longer be accounted for. The command must be interrupted and the
    /// store marked dirty (plan §7.2).
    Unaccountable {
        /// The command.
        issue: Uuid7,
        /// The entry that failed was the command's terminal event: a new
        /// terminal event may (and must) be spooled in its place.
        terminal_lost: bool,
    },
}

/// How a durable step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpoolCompletion {
    /// An output append: the stored (compressed) length.
    AppendedOutput {
        /// Stored bytes.
        stored_len: u32,
    },
    /// Any other step succeeded.
    Done,
    /// The step failed; nothing of it is durable.
    Failed,
}

/// Whether an output chunk was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// It will be made durable.
    Kept,
    /// It was counted into a loss run and dropped.
    Dropped,
}

/// A misuse of the spool by its caller or a peer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpoolError {
    /// The command is not in the spool.
    #[error("command {0} is not in the spool")]
    UnknownCommand(Uuid7),
    /// An entry after the terminal entry.
    #[error("command {0} already has its terminal event")]
    AfterTerminal(Uuid7),
    /// The essential-entry reserve is exhausted (a runaway producer).
    #[error("command {0} holds the most entries it may")]
    Full(Uuid7),
    /// The spool tracks the most commands it may.
    #[error("the spool tracks the most commands it may")]
    TooManyCommands,
    /// An acknowledgement beyond what was assigned: a protocol error.
    #[error("acknowledgement {acked} for command {issue} is beyond its last sequence {last}")]
    AckBeyondAssigned {
        /// The command.
        issue: Uuid7,
        /// The acknowledgement.
        acked: u64,
        /// The last assigned sequence.
        last: u64,
    },
}

/// Counters for metrics and the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpoolStats {
    /// Output chunks kept.
    pub chunks_kept: u64,
    /// Output chunks dropped in loss mode.
    pub chunks_dropped: u64,
    /// Raw bytes dropped in loss mode.
    pub raw_bytes_dropped: u64,
    /// `CLIENT_OVERLOAD` markers written.
    pub overload_markers: u64,
    /// `CLIENT_SPOOL` markers written or grown.
    pub spool_markers: u64,
    /// Output entries the store failed to keep, replaced by markers.
    pub store_failure_markers: u64,
    /// Segments rotated away.
    pub segments_rotated: u64,
    /// Times loss mode was entered (command or daemon).
    pub loss_entered: u64,
    /// Entries assigned a wire sequence.
    pub assigned: u64,
    /// Entries sent again after a reconnect.
    pub replayed: u64,
    /// Failed durable steps.
    pub failures: u64,
    /// Completions for no pending step (late or foreign).
    pub stray_completions: u64,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Output {
        stream: wire::OutputStream,
        raw_len: u32,
        stored_len: u32,
        segment: u32,
    },
    Event(Body),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Its append is in flight.
    Appending,
    /// Durable, not sequenced.
    Durable,
    /// Its `Assign` is in flight.
    Assigning,
    /// Durable and sequenced (pinned).
    Pinned,
}

#[derive(Debug, Clone, PartialEq)]
struct Entry {
    ordinal: u64,
    seq: Option<u64>,
    observed_ms: i64,
    kind: Kind,
    state: State,
    cost: u64,
}

impl Entry {
    fn is_spool_marker(&self) -> Option<&wire::OutputTruncation> {
        match &self.kind {
            Kind::Event(Body::Truncation(t))
                if t.source == wire::TruncationSource::ClientSpool as i32 =>
            {
                Some(t)
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct LossRun {
    streams: BTreeSet<i32>,
    raw_bytes: u64,
    first_ms: i64,
    last_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
struct CommandSpool {
    next_ordinal: u64,
    next_seq: u64,
    acked: u64,
    entries: VecDeque<Entry>,
    backlog: u64,
    loss: bool,
    run: Option<LossRun>,
    stored: u64,
    segment: u32,
    segment_raw: u64,
    terminal: bool,
    in_flight: u64,
    releasing: bool,
    /// An assignment failed: none is tried again until the next
    /// acknowledgement, session or durable entry (no spinning on a store
    /// that keeps failing).
    assign_blocked: bool,
    /// Raw bytes and last observation of the open loss run as last
    /// recorded (0: nothing recorded).
    loss_recorded: (u64, i64),
    /// A `PersistLoss` is in flight.
    loss_recording: bool,
    /// Failed appends of entries still in place, by ordinal.
    append_failures: BTreeMap<u64, u32>,
    /// Reconciliation ended the command here because the server holds no
    /// live record of it: nothing of it is sent any more (the server
    /// would refuse events of a command it does not know).
    muted: bool,
    /// A rotation failed: none is tried again until an append succeeds.
    rotate_blocked: bool,
}

impl CommandSpool {
    fn new(next_ordinal: u64, next_seq: u64, acked: u64) -> Self {
        Self {
            next_ordinal,
            next_seq,
            acked,
            entries: VecDeque::new(),
            backlog: 0,
            loss: false,
            run: None,
            stored: 0,
            segment: 1,
            segment_raw: 0,
            terminal: false,
            in_flight: 0,
            releasing: false,
            assign_blocked: false,
            loss_recorded: (0, 0),
            loss_recording: false,
            append_failures: BTreeMap::new(),
            rotate_blocked: false,
            muted: false,
        }
    }

    fn last_assigned(&self) -> u64 {
        self.next_seq.saturating_sub(1)
    }
}

/// An entry the store holds, for [`Spool::restore`].
#[derive(Debug, Clone, PartialEq)]
pub struct RestoredEntry {
    /// Its ordinal.
    pub ordinal: u64,
    /// Its sequence, when assigned.
    pub seq: Option<u64>,
    /// Observed wall time.
    pub observed_ms: i64,
    /// Output (stream, raw and stored length, segment) or an event body.
    pub item: RestoredItem,
}

/// The body of a [`RestoredEntry`].
#[derive(Debug, Clone, PartialEq)]
pub enum RestoredItem {
    /// An output chunk.
    Output {
        /// Its stream.
        stream: wire::OutputStream,
        /// Raw length.
        raw_len: u32,
        /// Stored length.
        stored_len: u32,
        /// Its segment.
        segment: u32,
    },
    /// An event body.
    Event(Body),
}

/// One command as the store holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoredCommand {
    /// The command.
    pub issue: Uuid7,
    /// The next ordinal.
    pub next_ordinal: u64,
    /// The next wire sequence.
    pub next_seq: u64,
    /// The server's last cumulative acknowledgement.
    pub acked: u64,
    /// Its entries, in ordinal order.
    pub entries: Vec<RestoredEntry>,
    /// The loss run open at the crash, as recorded (its marker).
    pub loss_run: Option<wire::OutputTruncation>,
}

/// The daemon's spool.
#[derive(Debug)]
pub struct Spool {
    limits: SpoolLimits,
    /// The send windows of the configuration; `limits` holds the live
    /// session's (never larger).
    configured_windows: (u64, u64),
    commands: BTreeMap<Uuid7, CommandSpool>,
    pending: BTreeMap<SpoolToken, (Uuid7, Pending)>,
    next_token: u64,
    entries: usize,
    backlog: u64,
    daemon_loss: bool,
    stored: u64,
    active: bool,
    session_in_flight: u64,
    /// The command admitted last: the next pump starts after it, so the
    /// session window goes round-robin across commands.
    admitted_last: Option<Uuid7>,
    out: VecDeque<SpoolOutput>,
    stats: SpoolStats,
}

#[derive(Debug, Clone, PartialEq)]
enum Pending {
    PersistLoss {
        marker_ordinal: u64,
        raw: u64,
        last_ms: i64,
    },
    Append {
        ordinal: u64,
        raw: u64,
    },
    Assign {
        ordinals: Vec<u64>,
        first_seq: u64,
    },
    Release,
    Rotate {
        markers: Vec<u64>,
        /// The entries the rotation removed or changed, as they were.
        undo: Vec<Entry>,
        /// Stored bytes it freed.
        freed: u64,
    },
}

fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The exact encoded length of the `CommandEvent` of an output entry, as
/// the server's window counts it (`rvbox_session::event_window_cost`),
/// without building its payload.
#[must_use]
pub fn output_event_cost(
    issue: &Uuid7,
    seq: u64,
    observed_ms: i64,
    stream: wire::OutputStream,
    raw_len: u32,
    stored_len: u32,
) -> u64 {
    use prost::encoding::encoded_len_varint;
    let chunk = wire::OutputChunk {
        stream: stream as i32,
        payload: Vec::new(),
        raw_length: raw_len,
        stored_length: stored_len,
    };
    let empty_inner = len_u64(chunk.encoded_len());
    let stored = u64::from(stored_len);
    let payload_field = if stored == 0 {
        0
    } else {
        1 + len_u64(encoded_len_varint(stored)) + stored
    };
    let inner = empty_inner + payload_field;
    let event = wire::CommandEvent {
        issue_uuid: issue.to_string(),
        event_seq: seq,
        observed_time: Some(timestamp(observed_ms)),
        body: Some(Body::Output(chunk)),
    };
    let empty = len_u64(event.encoded_len());
    empty - len_u64(encoded_len_varint(empty_inner)) - empty_inner
        + len_u64(encoded_len_varint(inner))
        + inner
}

fn event_cost(issue: &Uuid7, seq: u64, observed_ms: i64, body: &Body) -> u64 {
    let event = wire::CommandEvent {
        issue_uuid: issue.to_string(),
        event_seq: seq,
        observed_time: Some(timestamp(observed_ms)),
        body: Some(body.clone()),
    };
    len_u64(event.encoded_len())
}

/// Whether `body` is a terminal lifecycle change (the domain's lifecycle
/// table decides, cancelled included).
fn is_terminal(body: &Body) -> bool {
    match body {
        Body::Lifecycle(l) => rvbox_domain::lifecycle::Lifecycle::from_wire(l.lifecycle)
            .is_ok_and(rvbox_domain::lifecycle::Lifecycle::is_terminal),
        _ => false,
    }
}

fn overload_marker(run: &LossRun) -> wire::OutputTruncation {
    wire::OutputTruncation {
        source: wire::TruncationSource::ClientOverload as i32,
        streams: run.streams.iter().copied().collect(),
        reason: "the client dropped output while its raw backlog was above the high watermark"
            .into(),
        first_removed_event_seq: None,
        last_removed_event_seq: None,
        raw_bytes: run.raw_bytes,
        compressed_bytes: None,
        first_observed_time: Some(timestamp(run.first_ms)),
        last_observed_time: Some(timestamp(run.last_ms)),
    }
}

/// A loss run's totals are recorded when it opens, then again once it has
/// grown by this many raw bytes (at most every
/// [`LOSS_RECORD_MIN_INTERVAL_MS`]) or once [`LOSS_RECORD_INTERVAL_MS`]
/// passed with any growth, one record at a time: a crash in loss mode
/// loses at most the growth since the last record.
pub const LOSS_RECORD_STEP: u64 = 1024 * 1024;
/// See [`LOSS_RECORD_STEP`].
pub const LOSS_RECORD_MIN_INTERVAL_MS: i64 = 100;
/// See [`LOSS_RECORD_STEP`].
pub const LOSS_RECORD_INTERVAL_MS: i64 = 1000;

/// The loss run a marker describes (for a restore).
fn run_of(t: &wire::OutputTruncation) -> LossRun {
    let ms = |ts: &Option<prost_types::Timestamp>| {
        ts.as_ref().map_or(0, |t| {
            t.seconds
                .saturating_mul(1000)
                .saturating_add(i64::from(t.nanos) / 1_000_000)
        })
    };
    LossRun {
        streams: t.streams.iter().copied().collect(),
        raw_bytes: t.raw_bytes,
        first_ms: ms(&t.first_observed_time),
        last_ms: ms(&t.last_observed_time),
    }
}

/// Appends of one entry tried before its command's output is given up as
/// unaccountable.
pub const MAX_APPEND_ATTEMPTS: u32 = 3;

/// The reason of the marker that replaces output the store failed to keep.
const STORE_FAILED_REASON: &str = "the client could not store this output";

const SPOOL_REASON: &str =
    "the client rotated unsent output away to stay within its local storage caps";

impl Spool {
    /// A spool with `limits` (validated by the caller with
    /// [`SpoolLimits::validate`]).
    #[must_use]
    pub fn new(limits: SpoolLimits) -> Self {
        debug_assert!(limits.validate().is_ok(), "{:?}", limits.validate());
        Self {
            configured_windows: (limits.command_window, limits.session_window),
            limits,
            commands: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_token: 1,
            entries: 0,
            backlog: 0,
            daemon_loss: false,
            stored: 0,
            active: false,
            session_in_flight: 0,
            admitted_last: None,
            out: VecDeque::new(),
            stats: SpoolStats::default(),
        }
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> SpoolStats {
        self.stats
    }

    /// A session was welcomed with these windows (the smaller of ours and
    /// the server's, plan §6.1): nothing more than they allow is admitted
    /// while it lasts. A server whose window is below the configured one
    /// would close the session as a protocol error otherwise.
    pub fn set_session_windows(&mut self, command: u64, session: u64) {
        let (c, s) = self.configured_windows;
        self.limits.command_window = c.min(command.max(1));
        self.limits.session_window = s.min(session.max(1));
    }

    /// The windows admission now uses (command, session).
    #[must_use]
    pub fn windows(&self) -> (u64, u64) {
        (self.limits.command_window, self.limits.session_window)
    }

    /// The daemon's raw backlog.
    #[must_use]
    pub fn backlog(&self) -> u64 {
        self.backlog
    }

    /// Durable compressed output held.
    #[must_use]
    pub fn stored(&self) -> u64 {
        self.stored
    }

    /// Whether the daemon-wide loss mode is on.
    #[must_use]
    pub fn daemon_loss(&self) -> bool {
        self.daemon_loss
    }

    /// Whether `issue` drops output now.
    #[must_use]
    pub fn dropping(&self, issue: &Uuid7) -> bool {
        self.daemon_loss || self.commands.get(issue).is_some_and(|c| c.loss)
    }

    /// The lifecycle of `issue`'s terminal entry, when it is in the spool.
    #[must_use]
    pub fn terminal_lifecycle(&self, issue: &Uuid7) -> Option<wire::Lifecycle> {
        let c = self.commands.get(issue)?;
        c.entries.iter().rev().find_map(|e| match &e.kind {
            Kind::Event(Body::Lifecycle(l)) if is_terminal(&Body::Lifecycle(l.clone())) => {
                wire::Lifecycle::try_from(l.lifecycle).ok()
            }
            _ => None,
        })
    }

    /// Entries held for `issue` (pinned and unsequenced).
    #[must_use]
    pub fn entry_count(&self, issue: &Uuid7) -> usize {
        self.commands.get(issue).map_or(0, |c| c.entries.len())
    }

    /// The last sequence assigned to `issue`, and its acknowledgement.
    #[must_use]
    pub fn cursors(&self, issue: &Uuid7) -> Option<(u64, u64)> {
        self.commands
            .get(issue)
            .map(|c| (c.last_assigned(), c.acked))
    }

    /// Wire bytes in flight (assigned, unacknowledged) for the session.
    #[must_use]
    pub fn session_in_flight(&self) -> u64 {
        self.session_in_flight
    }

    /// The next output, if any.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<SpoolOutput> {
        self.out.pop_front()
    }

    fn push(&mut self, o: SpoolOutput) {
        debug_assert!(self.out.len() < MAX_OUTPUTS, "spool outputs not drained");
        self.out.push_back(o);
    }

    fn token(&mut self) -> SpoolToken {
        let t = SpoolToken(self.next_token);
        self.next_token = self.next_token.wrapping_add(1).max(1);
        t
    }

    /// Starts the spool of a newly accepted command.
    ///
    /// # Errors
    /// [`SpoolError::TooManyCommands`].
    pub fn open_command(&mut self, issue: Uuid7) -> Result<(), SpoolError> {
        if self.commands.contains_key(&issue) {
            return Ok(());
        }
        if self.commands.len() >= MAX_COMMANDS {
            return Err(SpoolError::TooManyCommands);
        }
        self.commands.insert(issue, CommandSpool::new(1, 1, 0));
        Ok(())
    }

    /// Loads a command as the store holds it (at startup). Its sequenced
    /// entries are pinned and sent again once a session is active.
    ///
    /// # Errors
    /// [`SpoolError::TooManyCommands`].
    pub fn restore(&mut self, r: RestoredCommand) -> Result<(), SpoolError> {
        if self.commands.len() >= MAX_COMMANDS && !self.commands.contains_key(&r.issue) {
            return Err(SpoolError::TooManyCommands);
        }
        let mut c = CommandSpool::new(r.next_ordinal, r.next_seq, r.acked);
        if let Some(t) = &r.loss_run {
            // closed into its marker before the command's next entry
            let run = run_of(t);
            c.loss_recorded = (run.raw_bytes, run.last_ms);
            c.run = Some(run);
        }
        for e in r.entries {
            let state = if e.seq.is_some() {
                State::Pinned
            } else {
                State::Durable
            };
            let kind = match e.item {
                RestoredItem::Output {
                    stream,
                    raw_len,
                    stored_len,
                    segment,
                } => {
                    c.stored = c.stored.saturating_add(u64::from(stored_len));
                    c.segment = c.segment.max(segment);
                    Kind::Output {
                        stream,
                        raw_len,
                        stored_len,
                        segment,
                    }
                }
                RestoredItem::Event(body) => {
                    if is_terminal(&body) {
                        c.terminal = true;
                    }
                    Kind::Event(body)
                }
            };
            let mut entry = Entry {
                ordinal: e.ordinal,
                seq: e.seq,
                observed_ms: e.observed_ms,
                kind,
                state,
                cost: 0,
            };
            if let Some(seq) = e.seq {
                entry.cost = self.cost_of(&r.issue, &entry, seq);
                c.in_flight = c.in_flight.saturating_add(entry.cost);
            }
            c.entries.push_back(entry);
        }
        // new output goes to a fresh segment
        c.segment = c.segment.saturating_add(1);
        self.stored = self.stored.saturating_add(c.stored);
        self.entries = self.entries.saturating_add(c.entries.len());
        self.session_in_flight = self.session_in_flight.saturating_add(c.in_flight);
        if let Some(old) = self.commands.insert(r.issue, c) {
            self.forget_counts(&old);
        }
        Ok(())
    }

    fn forget_counts(&mut self, c: &CommandSpool) {
        self.stored = self.stored.saturating_sub(c.stored);
        self.entries = self.entries.saturating_sub(c.entries.len());
        self.session_in_flight = self.session_in_flight.saturating_sub(c.in_flight);
        self.backlog = self.backlog.saturating_sub(c.backlog);
    }

    fn cost_of(&self, issue: &Uuid7, e: &Entry, seq: u64) -> u64 {
        match &e.kind {
            Kind::Output {
                stream,
                raw_len,
                stored_len,
                ..
            } => output_event_cost(issue, seq, e.observed_ms, *stream, *raw_len, *stored_len),
            Kind::Event(body) => event_cost(issue, seq, e.observed_ms, body),
        }
    }

    /// Takes one raw output chunk read from a pipe (at most 64 KiB; a
    /// longer one is the caller's bug and is split by the caller). In loss
    /// mode, or when it would cross a high watermark, it is counted into
    /// the command's loss run and dropped.
    ///
    /// # Errors
    /// [`SpoolError::UnknownCommand`], [`SpoolError::AfterTerminal`].
    pub fn output(
        &mut self,
        issue: Uuid7,
        stream: wire::OutputStream,
        observed_ms: i64,
        bytes: Vec<u8>,
    ) -> Result<Taken, SpoolError> {
        debug_assert!(len_u64(bytes.len()) <= MAX_RAW_CHUNK_BYTES);
        debug_assert!(!bytes.is_empty());
        let raw = len_u64(bytes.len());
        let limits = self.limits;
        let daemon_backlog = self.backlog;
        let daemon_full = self.entries >= MAX_ENTRIES;
        let c = self
            .commands
            .get_mut(&issue)
            .ok_or(SpoolError::UnknownCommand(issue))?;
        if c.terminal {
            return Err(SpoolError::AfterTerminal(issue));
        }
        let full = daemon_full || c.entries.len() >= MAX_ENTRIES_PER_COMMAND;
        if !c.loss && !full && c.backlog.saturating_add(raw) > limits.command_high {
            c.loss = true;
            self.stats.loss_entered += 1;
        }
        if !self.daemon_loss && !full && daemon_backlog.saturating_add(raw) > limits.daemon_high {
            self.daemon_loss = true;
            self.stats.loss_entered += 1;
        }
        if c.loss || self.daemon_loss || full {
            let run = c.run.get_or_insert_with(|| LossRun {
                streams: BTreeSet::new(),
                raw_bytes: 0,
                first_ms: observed_ms,
                last_ms: observed_ms,
            });
            run.streams.insert(stream as i32);
            run.raw_bytes = run.raw_bytes.saturating_add(raw);
            run.last_ms = run.last_ms.max(observed_ms);
            self.stats.chunks_dropped += 1;
            self.stats.raw_bytes_dropped = self.stats.raw_bytes_dropped.saturating_add(raw);
            self.record_loss(issue);
            return Ok(Taken::Dropped);
        }
        self.close_run(issue);
        let Some(c) = self.commands.get_mut(&issue) else {
            return Err(SpoolError::UnknownCommand(issue));
        };
        if c.segment_raw >= SEGMENT_RAW_BYTES {
            c.segment = c.segment.saturating_add(1);
            c.segment_raw = 0;
        }
        // a segment fills by what its records take on disk at most: the
        // raw bytes plus the record framing
        c.segment_raw = c
            .segment_raw
            .saturating_add(raw.saturating_add(RECORD_FRAMING));
        let segment = c.segment;
        let raw_len = u32::try_from(raw).unwrap_or(u32::MAX);
        let entry = Entry {
            ordinal: c.next_ordinal,
            seq: None,
            observed_ms,
            kind: Kind::Output {
                stream,
                raw_len,
                stored_len: 0,
                segment,
            },
            state: State::Appending,
            cost: 0,
        };
        c.backlog = c.backlog.saturating_add(raw);
        self.backlog = self.backlog.saturating_add(raw);
        self.stats.chunks_kept += 1;
        self.append(
            issue,
            entry,
            AppendItem::Output {
                stream,
                segment,
                bytes,
            },
            raw,
        );
        Ok(Taken::Kept)
    }

    /// Output dropped before it reached the spool (a pipe reader whose
    /// hand-off queue was full): counted into the loss run exactly like a
    /// chunk the spool dropped.
    ///
    /// # Errors
    /// [`SpoolError::UnknownCommand`].
    pub fn dropped_upstream(
        &mut self,
        issue: Uuid7,
        stream: wire::OutputStream,
        raw_bytes: u64,
        first_ms: i64,
        last_ms: i64,
    ) -> Result<(), SpoolError> {
        let c = self
            .commands
            .get_mut(&issue)
            .ok_or(SpoolError::UnknownCommand(issue))?;
        if raw_bytes == 0 {
            return Ok(());
        }
        let run = c.run.get_or_insert_with(|| LossRun {
            streams: BTreeSet::new(),
            raw_bytes: 0,
            first_ms,
            last_ms,
        });
        run.streams.insert(stream as i32);
        run.raw_bytes = run.raw_bytes.saturating_add(raw_bytes);
        run.first_ms = run.first_ms.min(first_ms);
        run.last_ms = run.last_ms.max(last_ms);
        self.stats.raw_bytes_dropped = self.stats.raw_bytes_dropped.saturating_add(raw_bytes);
        self.record_loss(issue);
        Ok(())
    }

    /// Records the open loss run of `issue` when it is new, or has grown by
    /// [`LOSS_RECORD_STEP`] over [`LOSS_RECORD_INTERVAL_MS`] since it was
    /// last recorded (plan §7.2: known totals are persisted).
    fn record_loss(&mut self, issue: Uuid7) {
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        let Some(run) = &c.run else {
            return;
        };
        let (recorded, at) = c.loss_recorded;
        let elapsed = run.last_ms.saturating_sub(at);
        let due = recorded == 0
            || (run.raw_bytes >= recorded.saturating_add(LOSS_RECORD_STEP)
                && elapsed >= LOSS_RECORD_MIN_INTERVAL_MS)
            || (run.raw_bytes > recorded && elapsed >= LOSS_RECORD_INTERVAL_MS);
        if !due || c.loss_recording || run.raw_bytes == recorded {
            return;
        }
        let marker = overload_marker(run);
        let (raw, last_ms) = (run.raw_bytes, run.last_ms);
        let marker_ordinal = c.next_ordinal;
        c.loss_recording = true;
        let token = self.token();
        self.pending.insert(
            token,
            (
                issue,
                Pending::PersistLoss {
                    marker_ordinal,
                    raw,
                    last_ms,
                },
            ),
        );
        self.push(SpoolOutput::Store(Box::new(SpoolOp::PersistLoss {
            token,
            issue,
            marker_ordinal,
            run: marker,
        })));
    }

    /// Takes one essential event (lifecycle, signal result, stdin
    /// acknowledgement, incomplete output, diagnostics). An open loss run
    /// is closed into its marker first. A terminal lifecycle change is the
    /// command's last entry.
    ///
    /// # Errors
    /// [`SpoolError::UnknownCommand`], [`SpoolError::AfterTerminal`],
    /// [`SpoolError::Full`] when even the essential reserve is exhausted.
    pub fn event(&mut self, issue: Uuid7, observed_ms: i64, body: Body) -> Result<(), SpoolError> {
        let c = self
            .commands
            .get(&issue)
            .ok_or(SpoolError::UnknownCommand(issue))?;
        if c.terminal {
            return Err(SpoolError::AfterTerminal(issue));
        }
        if c.entries.len() >= MAX_ENTRIES_PER_COMMAND + ESSENTIAL_RESERVE - 1 {
            return Err(SpoolError::Full(issue));
        }
        self.close_run(issue);
        let terminal = is_terminal(&body);
        let Some(c) = self.commands.get_mut(&issue) else {
            return Err(SpoolError::UnknownCommand(issue));
        };
        c.terminal = terminal;
        let entry = Entry {
            ordinal: c.next_ordinal,
            seq: None,
            observed_ms,
            kind: Kind::Event(body.clone()),
            state: State::Appending,
            cost: 0,
        };
        self.append(issue, entry, AppendItem::Event(body), 0);
        Ok(())
    }

    /// Spools a diagnostics event (plan §7.5): like [`Spool::event`], but
    /// refused rather than taken from the essential reserve when the
    /// command's entries are at their cap, so diagnostics never crowd out
    /// a lifecycle event or a marker.
    ///
    /// # Errors
    /// As [`Spool::event`]; [`SpoolError::Full`] at the entry cap.
    pub fn diagnostics(
        &mut self,
        issue: Uuid7,
        observed_ms: i64,
        d: wire::Diagnostics,
    ) -> Result<(), SpoolError> {
        let c = self
            .commands
            .get(&issue)
            .ok_or(SpoolError::UnknownCommand(issue))?;
        if c.entries.len() >= MAX_ENTRIES_PER_COMMAND {
            return Err(SpoolError::Full(issue));
        }
        self.event(issue, observed_ms, Body::Diagnostics(d))
    }

    /// Closes the open loss run of `issue` into its `CLIENT_OVERLOAD`
    /// marker (uses the essential reserve).
    fn close_run(&mut self, issue: Uuid7) {
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        let Some(run) = c.run.take() else {
            return;
        };
        // the marker's append clears what was recorded of the run
        c.loss_recorded = (0, 0);
        let marker = overload_marker(&run);
        let entry = Entry {
            ordinal: c.next_ordinal,
            seq: None,
            observed_ms: run.last_ms,
            kind: Kind::Event(Body::Truncation(marker.clone())),
            state: State::Appending,
            cost: 0,
        };
        self.stats.overload_markers += 1;
        self.append(issue, entry, AppendItem::Event(Body::Truncation(marker)), 0);
    }

    fn append(&mut self, issue: Uuid7, entry: Entry, item: AppendItem, raw: u64) {
        let token = self.token();
        let ordinal = entry.ordinal;
        let observed_ms = entry.observed_ms;
        if let Some(c) = self.commands.get_mut(&issue) {
            debug_assert!(c.entries.back().is_none_or(|e| e.ordinal < ordinal));
            c.next_ordinal = ordinal.saturating_add(1);
            c.entries.push_back(entry);
            self.entries = self.entries.saturating_add(1);
        }
        self.pending
            .insert(token, (issue, Pending::Append { ordinal, raw }));
        self.push(SpoolOutput::Store(Box::new(SpoolOp::Append {
            token,
            issue,
            ordinal,
            observed_ms,
            item,
        })));
    }

    fn leave_loss(&mut self) {
        let limits = self.limits;
        if self.daemon_loss && self.backlog < limits.daemon_low {
            self.daemon_loss = false;
        }
        let daemon_low = self.backlog < limits.daemon_low;
        for c in self.commands.values_mut() {
            if c.loss && daemon_low && c.backlog < limits.command_low {
                c.loss = false;
            }
        }
    }

    /// A durable step ended.
    pub fn completed(&mut self, token: SpoolToken, result: SpoolCompletion) {
        let Some((issue, pending)) = self.pending.remove(&token) else {
            self.stats.stray_completions += 1;
            return;
        };
        if result == SpoolCompletion::Failed {
            self.stats.failures += 1;
        }
        match pending {
            Pending::PersistLoss {
                marker_ordinal,
                raw,
                last_ms,
            } => {
                if let Some(c) = self.commands.get_mut(&issue) {
                    c.loss_recording = false;
                    // still the same run (its marker not yet placed)
                    if result != SpoolCompletion::Failed
                        && c.run.is_some()
                        && c.next_ordinal == marker_ordinal
                    {
                        c.loss_recorded = (raw, last_ms);
                    }
                }
                // a failed record is tried again at the next drop, not now
                if result != SpoolCompletion::Failed {
                    self.record_loss(issue);
                }
            }
            Pending::Append { ordinal, raw } => self.appended(issue, ordinal, raw, &result),
            Pending::Assign {
                ordinals,
                first_seq,
            } => self.assigned(issue, &ordinals, first_seq, &result),
            Pending::Release => {
                if let Some(c) = self.commands.get_mut(&issue) {
                    c.releasing = false;
                }
                self.maybe_finished(issue);
            }
            Pending::Rotate {
                markers,
                undo,
                freed,
            } => self.rotated(issue, &markers, undo, freed, &result),
        }
        self.leave_loss();
        self.rotate_if_over();
        self.pump();
    }

    fn appended(&mut self, issue: Uuid7, ordinal: u64, raw: u64, result: &SpoolCompletion) {
        self.backlog = self.backlog.saturating_sub(raw);
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        c.backlog = c.backlog.saturating_sub(raw);
        let Some(pos) = c.entries.iter().position(|e| e.ordinal == ordinal) else {
            return;
        };
        match result {
            SpoolCompletion::Failed => {
                // nothing of it is durable. The entry keeps its place, so
                // nothing after it is admitted (the terminal event
                // included) until it is: output, whose bytes are gone,
                // becomes an exact CLIENT_SPOOL marker there; an event is
                // appended again. After MAX_APPEND_ATTEMPTS the entry goes
                // and the command's output is unaccountable.
                let attempts = c.append_failures.entry(ordinal).or_insert(0);
                *attempts = attempts.saturating_add(1);
                let give_up = *attempts >= MAX_APPEND_ATTEMPTS;
                let Some(e) = c.entries.get_mut(pos) else {
                    return;
                };
                if give_up {
                    let kind = e.kind.clone();
                    c.entries.remove(pos);
                    c.append_failures.remove(&ordinal);
                    self.entries = self.entries.saturating_sub(1);
                    let terminal_lost = matches!(&kind, Kind::Event(b) if is_terminal(b));
                    if terminal_lost {
                        c.terminal = false;
                    }
                    self.push(SpoolOutput::Unaccountable {
                        issue,
                        terminal_lost,
                    });
                    return;
                }
                if let Kind::Output {
                    stream, raw_len, ..
                } = e.kind
                {
                    let ts = Some(timestamp(e.observed_ms));
                    e.kind = Kind::Event(Body::Truncation(wire::OutputTruncation {
                        source: wire::TruncationSource::ClientSpool as i32,
                        streams: vec![stream as i32],
                        reason: STORE_FAILED_REASON.into(),
                        first_removed_event_seq: None,
                        last_removed_event_seq: None,
                        raw_bytes: u64::from(raw_len),
                        compressed_bytes: None,
                        first_observed_time: ts,
                        last_observed_time: ts,
                    }));
                    self.stats.store_failure_markers += 1;
                }
                let (observed_ms, item) = match &e.kind {
                    Kind::Event(b) => (e.observed_ms, AppendItem::Event(b.clone())),
                    Kind::Output { .. } => return,
                };
                e.state = State::Appending;
                let token = self.token();
                self.pending
                    .insert(token, (issue, Pending::Append { ordinal, raw: 0 }));
                self.push(SpoolOutput::Store(Box::new(SpoolOp::Append {
                    token,
                    issue,
                    ordinal,
                    observed_ms,
                    item,
                })));
            }
            SpoolCompletion::AppendedOutput { stored_len } => {
                c.assign_blocked = false;
                c.rotate_blocked = false;
                if let Some(e) = c.entries.get_mut(pos) {
                    if let Kind::Output { stored_len: s, .. } = &mut e.kind {
                        *s = *stored_len;
                    }
                    e.state = State::Durable;
                }
                c.stored = c.stored.saturating_add(u64::from(*stored_len));
                self.stored = self.stored.saturating_add(u64::from(*stored_len));
            }
            SpoolCompletion::Done => {
                c.assign_blocked = false;
                c.rotate_blocked = false;
                c.append_failures.remove(&ordinal);
                let mut terminal = false;
                if let Some(e) = c.entries.get_mut(pos) {
                    debug_assert!(matches!(e.kind, Kind::Event(_)), "output needs its size");
                    e.state = State::Durable;
                    terminal = matches!(&e.kind, Kind::Event(b) if is_terminal(b));
                }
                if terminal {
                    self.push(SpoolOutput::TerminalDurable { issue });
                }
            }
        }
    }

    fn assigned(
        &mut self,
        issue: Uuid7,
        ordinals: &[u64],
        first_seq: u64,
        result: &SpoolCompletion,
    ) {
        let active = self.active;
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        let failed = *result == SpoolCompletion::Failed;
        let mut last = None;
        let mut freed = 0u64;
        for e in c
            .entries
            .iter_mut()
            .filter(|e| ordinals.contains(&e.ordinal))
        {
            if failed {
                // not durable: the sequences were never given out
                freed = freed.saturating_add(e.cost);
                e.state = State::Durable;
                e.seq = None;
                e.cost = 0;
            } else {
                e.state = State::Pinned;
                last = e.seq.or(last);
            }
        }
        if failed {
            // one Assign per command is in flight at a time, so these were
            // the last sequences handed out
            c.next_seq = first_seq;
            c.assign_blocked = true;
            c.in_flight = c.in_flight.saturating_sub(freed);
            self.session_in_flight = self.session_in_flight.saturating_sub(freed);
            return;
        }
        if let Some(last_seq) = last
            && active
            && !c.muted
        {
            self.push(SpoolOutput::Send {
                issue,
                first_seq,
                last_seq,
            });
        }
    }

    fn rotated(
        &mut self,
        issue: Uuid7,
        markers: &[u64],
        undo: Vec<Entry>,
        freed: u64,
        result: &SpoolCompletion,
    ) {
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        if *result == SpoolCompletion::Failed {
            // nothing of the rotation is durable: the store still holds the
            // rotated entries and the markers as they were, so memory goes
            // back to them (while the rotation was in flight its markers
            // held every later entry back, so nothing else moved), and no
            // rotation is tried again until the store takes an append
            let touched: BTreeSet<u64> = undo
                .iter()
                .map(|e| e.ordinal)
                .chain(markers.iter().copied())
                .collect();
            let before = c.entries.len();
            c.entries.retain(|e| !touched.contains(&e.ordinal));
            let dropped_now = before - c.entries.len();
            let restored = undo.len();
            c.entries.extend(undo);
            c.entries.make_contiguous().sort_by_key(|e| e.ordinal);
            self.entries = self
                .entries
                .saturating_sub(dropped_now)
                .saturating_add(restored);
            c.stored = c.stored.saturating_add(freed);
            self.stored = self.stored.saturating_add(freed);
            c.rotate_blocked = true;
            return;
        }
        for e in c.entries.iter_mut() {
            if markers.contains(&e.ordinal) && e.state == State::Appending {
                e.state = State::Durable;
            }
        }
    }

    /// The session became active: sends every pinned entry again, from the
    /// server's durable position where reconciliation gave one (`resume`:
    /// command, durable sequence), then admits new entries. An `Assign`
    /// still in flight sends its run when it completes.
    pub fn session_active(&mut self, resume: &BTreeMap<Uuid7, u64>) {
        let issues: Vec<Uuid7> = self.commands.keys().copied().collect();
        for issue in issues {
            if let Some(durable) = resume.get(&issue).copied()
                && let Err(e) = self.on_ack(issue, durable)
            {
                // a resume beyond what this client sent is the server's
                // contradiction; everything pinned is sent again
                debug_assert!(matches!(e, SpoolError::AckBeyondAssigned { .. }));
            }
            let Some(c) = self.commands.get(&issue).filter(|c| !c.muted) else {
                continue;
            };
            let mut pinned = c
                .entries
                .iter()
                .filter(|e| e.state == State::Pinned)
                .filter_map(|e| e.seq)
                .filter(|s| *s > c.acked);
            let first = pinned.next();
            let last = pinned.next_back().or(first);
            if let (Some(first_seq), Some(last_seq)) = (first, last) {
                let n = last_seq.saturating_sub(first_seq).saturating_add(1);
                self.stats.replayed = self.stats.replayed.saturating_add(n);
                self.push(SpoolOutput::Send {
                    issue,
                    first_seq,
                    last_seq,
                });
            }
        }
        self.active = true;
        for c in self.commands.values_mut() {
            c.assign_blocked = false;
        }
        self.pump();
    }

    /// The session ended: nothing is sent until the next one is active.
    pub fn session_closed(&mut self) {
        self.active = false;
    }

    /// A cumulative `EventAck` for `issue` up to `seq`.
    ///
    /// # Errors
    /// [`SpoolError::AckBeyondAssigned`] (the session closes as a protocol
    /// error); an acknowledgement of an unknown command is ignored by the
    /// caller (the command may be finished already).
    pub fn on_ack(&mut self, issue: Uuid7, seq: u64) -> Result<(), SpoolError> {
        let Some(c) = self.commands.get_mut(&issue) else {
            return Err(SpoolError::UnknownCommand(issue));
        };
        // only what was durably assigned (and so could have been sent)
        // can be acknowledged
        let last = c
            .entries
            .iter()
            .rev()
            .filter(|e| e.state == State::Pinned)
            .find_map(|e| e.seq)
            .unwrap_or(c.acked)
            .max(c.acked);
        if seq > last {
            return Err(SpoolError::AckBeyondAssigned {
                issue,
                acked: seq,
                last,
            });
        }
        if seq <= c.acked {
            return Ok(());
        }
        c.acked = seq;
        c.assign_blocked = false;
        let mut freed = 0u64;
        let mut freed_stored = 0u64;
        let mut removed = 0usize;
        while let Some(front) = c.entries.front() {
            let Some(s) = front.seq else { break };
            if s > seq || front.state != State::Pinned {
                break;
            }
            freed = freed.saturating_add(front.cost);
            if let Kind::Output { stored_len, .. } = front.kind {
                freed_stored = freed_stored.saturating_add(u64::from(stored_len));
            }
            c.entries.pop_front();
            removed += 1;
        }
        c.in_flight = c.in_flight.saturating_sub(freed);
        c.stored = c.stored.saturating_sub(freed_stored);
        c.releasing = true;
        self.session_in_flight = self.session_in_flight.saturating_sub(freed);
        self.stored = self.stored.saturating_sub(freed_stored);
        self.entries = self.entries.saturating_sub(removed);
        let token = self.token();
        self.pending.insert(token, (issue, Pending::Release));
        self.push(SpoolOutput::Store(Box::new(SpoolOp::Release {
            token,
            issue,
            upto_seq: seq,
        })));
        self.pump();
        Ok(())
    }

    /// Reconciliation ended `issue` here (the server holds no live record
    /// of it): none of its entries is sent again, and none is admitted.
    pub fn mute(&mut self, issue: Uuid7) {
        if let Some(c) = self.commands.get_mut(&issue) {
            c.muted = true;
        }
    }

    /// Reconciliation says the server holds this command's terminal state:
    /// the local terminal record is discarded as if acknowledged.
    pub fn discard(&mut self, issue: Uuid7) {
        if let Some(c) = self.commands.remove(&issue) {
            self.forget_counts(&c);
            self.push(SpoolOutput::Finished { issue });
        }
    }

    fn maybe_finished(&mut self, issue: Uuid7) {
        let done = self
            .commands
            .get(&issue)
            .is_some_and(|c| c.terminal && c.entries.is_empty() && !c.releasing && c.run.is_none());
        if done && let Some(c) = self.commands.remove(&issue) {
            self.forget_counts(&c);
            self.push(SpoolOutput::Finished { issue });
        }
    }

    /// Admits durable entries to the send windows, per command in ordinal
    /// order, round-robin across commands.
    pub fn pump(&mut self) {
        if !self.active {
            return;
        }
        let issues: Vec<Uuid7> = match self.admitted_last {
            Some(last) => {
                use std::ops::Bound::{Excluded, Included, Unbounded};
                self.commands
                    .range((Excluded(last), Unbounded))
                    .chain(self.commands.range((Unbounded, Included(last))))
                    .map(|(k, _)| *k)
                    .collect()
            }
            None => self.commands.keys().copied().collect(),
        };
        for issue in issues {
            if self.admit(issue) {
                self.admitted_last = Some(issue);
            }
        }
    }

    /// Admits what fits of `issue`; true when anything was.
    fn admit(&mut self, issue: Uuid7) -> bool {
        let limits = self.limits;
        let session_room = limits.session_window.saturating_sub(self.session_in_flight);
        let Some(c) = self.commands.get(&issue) else {
            return false;
        };
        // one Assign in flight per command keeps sequences contiguous
        if c.muted || c.assign_blocked || c.entries.iter().any(|e| e.state == State::Assigning) {
            return false;
        }
        let mut room = limits
            .command_window
            .saturating_sub(c.in_flight)
            .min(session_room);
        let mut seq = c.next_seq;
        let mut picked: Vec<(u64, u64, u64)> = Vec::new();
        for e in c.entries.iter().filter(|e| e.seq.is_none()) {
            if e.state != State::Durable || picked.len() >= MAX_ASSIGN_RUN {
                break;
            }
            let cost = self.cost_of(&issue, e, seq);
            if cost > room {
                break;
            }
            room -= cost;
            picked.push((e.ordinal, seq, cost));
            seq += 1;
        }
        if picked.is_empty() {
            return false;
        }
        let Some(c) = self.commands.get_mut(&issue) else {
            return false;
        };
        let first_seq = c.next_seq;
        let mut total = 0u64;
        for (ordinal, s, cost) in &picked {
            if let Some(e) = c.entries.iter_mut().find(|e| e.ordinal == *ordinal) {
                e.seq = Some(*s);
                e.cost = *cost;
                e.state = State::Assigning;
                total = total.saturating_add(*cost);
            }
        }
        c.next_seq = seq;
        c.in_flight = c.in_flight.saturating_add(total);
        self.session_in_flight = self.session_in_flight.saturating_add(total);
        self.stats.assigned = self.stats.assigned.saturating_add(len_u64(picked.len()));
        let ordinals: Vec<u64> = picked.iter().map(|(o, _, _)| *o).collect();
        let token = self.token();
        self.pending.insert(
            token,
            (
                issue,
                Pending::Assign {
                    ordinals: ordinals.clone(),
                    first_seq,
                },
            ),
        );
        self.push(SpoolOutput::Store(Box::new(SpoolOp::Assign {
            token,
            issue,
            ordinals,
            first_seq,
        })));
        true
    }

    /// Rotates the oldest unsequenced segment of any command over its
    /// window, and of the largest command while the daemon is over its cap.
    fn rotate_if_over(&mut self) {
        let limits = self.limits;
        let over: Vec<Uuid7> = self
            .commands
            .iter()
            .filter(|(_, c)| {
                c.stored > limits.output_window || c.entries.len() >= ROTATE_AT_ENTRIES
            })
            .map(|(id, _)| *id)
            .collect();
        for issue in over {
            self.rotate_one(issue);
        }
        if self.entries >= ROTATE_AT_DAEMON_ENTRIES
            && let Some(issue) = self
                .commands
                .iter()
                .max_by_key(|(id, c)| (c.entries.len(), std::cmp::Reverse(**id)))
                .map(|(id, _)| *id)
        {
            self.rotate_one(issue);
        }
        if self.stored > limits.daemon_output
            && let Some(issue) = self
                .commands
                .iter()
                .max_by_key(|(id, c)| (c.stored, std::cmp::Reverse(**id)))
                .map(|(id, _)| *id)
        {
            self.rotate_one(issue);
        }
    }

    fn rotate_one(&mut self, issue: Uuid7) {
        let Some(c) = self.commands.get_mut(&issue) else {
            return;
        };
        if c.rotate_blocked
            || c.entries.iter().any(|e| {
                e.state == State::Appending && matches!(e.kind, Kind::Event(Body::Truncation(_)))
            })
        {
            // a marker of an earlier rotation is still in flight, or one
            // failed and the store has not taken an append since
            return;
        }
        // the oldest segment whose output entries are all durable and
        // unsequenced; the current segment is sealed first if it is the one
        let mut segments: BTreeMap<u32, bool> = BTreeMap::new();
        for e in &c.entries {
            if let Kind::Output { segment, .. } = e.kind {
                let ok = e.seq.is_none() && e.state == State::Durable;
                let slot = segments.entry(segment).or_insert(true);
                *slot = *slot && ok;
            }
        }
        let Some(segment) = segments.iter().find(|(_, ok)| **ok).map(|(s, _)| *s) else {
            return;
        };
        if segment == c.segment {
            c.segment = c.segment.saturating_add(1);
            c.segment_raw = 0;
        }
        // runs of removed entries, and their markers
        let mut removed = Vec::new();
        let mut markers: Vec<(u64, i64, wire::OutputTruncation)> = Vec::new();
        let mut freed_stored = 0u64;
        let mut kept: VecDeque<Entry> = VecDeque::with_capacity(c.entries.len());
        let mut in_run = false;
        // what a failed rotation puts back (the store still holds it)
        let original: VecDeque<Entry> = c.entries.clone();
        for e in c.entries.drain(..) {
            let take = matches!(e.kind, Kind::Output { segment: s, .. } if s == segment);
            if !take {
                in_run = false;
                kept.push_back(e);
                continue;
            }
            let Kind::Output {
                stream,
                raw_len,
                stored_len,
                ..
            } = e.kind
            else {
                continue;
            };
            removed.push(e.ordinal);
            freed_stored = freed_stored.saturating_add(u64::from(stored_len));
            // grow the marker of this run, or an adjacent earlier marker that
            // is still unsequenced, or start one at this ordinal
            let grow = if in_run {
                kept.back_mut()
            } else {
                kept.back_mut()
                    .filter(|m| m.seq.is_none() && m.is_spool_marker().is_some())
            };
            let grow_marker = grow.and_then(|m| match &mut m.kind {
                Kind::Event(Body::Truncation(t)) => Some((m.ordinal, &mut m.state, t)),
                _ => None,
            });
            match grow_marker {
                Some((ordinal, state, t)) => {
                    if !t.streams.contains(&(stream as i32)) {
                        t.streams.push(stream as i32);
                        t.streams.sort_unstable();
                    }
                    t.raw_bytes = t.raw_bytes.saturating_add(u64::from(raw_len));
                    t.compressed_bytes = Some(
                        t.compressed_bytes
                            .unwrap_or(0)
                            .saturating_add(u64::from(stored_len)),
                    );
                    t.last_observed_time = Some(timestamp(e.observed_ms));
                    *state = State::Appending;
                    let t = t.clone();
                    match markers.iter_mut().find(|(o, _, _)| *o == ordinal) {
                        Some(m) => m.2 = t,
                        None => markers.push((ordinal, e.observed_ms, t)),
                    }
                }
                None => {
                    let t = wire::OutputTruncation {
                        source: wire::TruncationSource::ClientSpool as i32,
                        streams: vec![stream as i32],
                        reason: SPOOL_REASON.into(),
                        first_removed_event_seq: None,
                        last_removed_event_seq: None,
                        raw_bytes: u64::from(raw_len),
                        compressed_bytes: Some(u64::from(stored_len)),
                        first_observed_time: Some(timestamp(e.observed_ms)),
                        last_observed_time: Some(timestamp(e.observed_ms)),
                    };
                    markers.push((e.ordinal, e.observed_ms, t.clone()));
                    kept.push_back(Entry {
                        ordinal: e.ordinal,
                        seq: None,
                        observed_ms: e.observed_ms,
                        kind: Kind::Event(Body::Truncation(t)),
                        state: State::Appending,
                        cost: 0,
                    });
                    self.entries = self.entries.saturating_add(1);
                }
            }
            in_run = true;
        }
        c.entries = kept;
        c.stored = c.stored.saturating_sub(freed_stored);
        self.stored = self.stored.saturating_sub(freed_stored);
        self.entries = self.entries.saturating_sub(removed.len());
        // a run's marker keeps the run's first ordinal: it is not removed
        removed.retain(|o| !markers.iter().any(|(m, _, _)| m == o));
        for (_, _, t) in &mut markers {
            let cap = usize::try_from(MAX_REASON_BYTES).unwrap_or(usize::MAX);
            t.reason.truncate(cap);
        }
        self.stats.segments_rotated += 1;
        self.stats.spool_markers = self
            .stats
            .spool_markers
            .saturating_add(len_u64(markers.len()));
        let touched: BTreeSet<u64> = removed
            .iter()
            .copied()
            .chain(markers.iter().map(|(o, _, _)| *o))
            .collect();
        let undo: Vec<Entry> = original
            .into_iter()
            .filter(|e| touched.contains(&e.ordinal))
            .collect();
        let token = self.token();
        self.pending.insert(
            token,
            (
                issue,
                Pending::Rotate {
                    markers: markers.iter().map(|(o, _, _)| *o).collect(),
                    undo,
                    freed: freed_stored,
                },
            ),
        );
        self.push(SpoolOutput::Store(Box::new(SpoolOp::Rotate {
            token,
            issue,
            segment,
            removed,
            markers,
        })));
    }
}
