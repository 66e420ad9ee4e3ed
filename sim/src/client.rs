//! A simulated client daemon that speaks the agent protocol (plan §6-§7).
//!
//! [`SimClient`] is sans-IO like the cores it talks to: the world feeds
//! [`ClientInput`]s through [`SimClient::handle`] and timer expiries through
//! [`SimClient::handle_timeout`], then drains [`SimClient::poll_effect`]
//! (connect, send an item) and re-arms one timer at
//! [`SimClient::poll_timeout`].
//!
//! Its state is split like a real daemon's:
//!
//! - [`DurableState`] survives [`SimClient::crash_restart`]: the instance
//!   id, accepted command records with their spool (unsequenced events,
//!   and sequenced events pinned until acknowledged) and, for a script
//!   command, its upload (descriptor, received prefix, committed flag),
//!   and the tombstone FIFO. Every durable change is one atomic step
//!   taken before anything that depends on it is sent (acceptance before
//!   `CommandAccepted`, a script chunk before its `ScriptUploadStatus`,
//!   the launch before `RUNNING`, a tombstone only after the terminal
//!   ack). A script command launches only once its script is committed.
//! - Everything else (connection, session, timers, running processes) is
//!   volatile and lost on a crash. A command whose process was running
//!   when the daemon died ends `INTERRUPTED` (outcome uncertain) and is
//!   never launched again; an accepted command that never launched may
//!   still launch.
//!
//! Honest behaviour follows the spec-mapping reconnect order: hello ->
//! welcome -> complete snapshot -> apply `ReconcileResult` durably ->
//! `ClientCapacity` -> replay assigned events -> assign and send new ones.
//! Event sequences are assigned contiguously per command only when an
//! event enters the send windows (1 MiB per command, 8 MiB per session,
//! cost = encoded `CommandEvent` length, as the session core counts).
//!
//! [`Adversary`] modes make some clients misbehave on purpose; the
//! [`Ledger`] records what the invariant checker needs (acceptances,
//! starts, acknowledged events and their content digests).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use prost::Message as _;
use rvbox_domain::error::{Code, DomainError, RetryClass};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::limits::{
    DEFAULT_CLIENT_MAX_QUEUED, DEFAULT_CLIENT_MAX_RUNNING, DEFAULT_COMMAND_SEND_WINDOW_BYTES,
    DEFAULT_HEARTBEAT_IDLE_MS, DEFAULT_LIVENESS_TIMEOUT_MS, DEFAULT_RECONNECT_INITIAL_MS,
    DEFAULT_RECONNECT_MAX_MS, DEFAULT_RECONNECT_STABLE_RESET_MS, DEFAULT_SESSION_SEND_WINDOW_BYTES,
    MAX_ENVELOPE_BYTES, MAX_RAW_CHUNK_BYTES, MAX_SCRIPT_BYTES, MAX_SCRIPT_CHUNK_BYTES,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;

use crate::invariants::{body_digest, body_kind};
use crate::net::{ConnId, Item, NetEvent, close_code};
use crate::rng::{SimRng, uuid_text};

/// Minors of major 1 this client speaks.
pub const SUPPORTED_MINORS: &[u32] = &[0];
/// The protocol major.
pub const PROTOCOL_MAJOR: u32 = 1;
/// Most retained command records (the snapshot record ceiling of
/// `rvbox-reconcile`).
pub const MAX_RECORDS: usize = 16_384;
/// Length of the tombstone FIFO (the real default is 1,000,000; a
/// simulated run never completes that many commands).
pub const MAX_TOMBSTONES: usize = 100_000;
/// Most unsequenced events one command may hold.
pub const MAX_PENDING_EVENTS_PER_COMMAND: usize = 1_024;
/// Most events (unsequenced plus unacknowledged) one command's spool
/// holds. Output beyond [`MAX_PENDING_EVENTS_PER_COMMAND`] is skipped;
/// a stdin write or signal that finds the spool full is not applied (not
/// answered), so the server sends it again later: backpressure, never a
/// lost essential event.
pub const MAX_SPOOL_EVENTS_PER_COMMAND: usize = 4_096;
/// Ceiling of [`ClientConfig::max_output_chunks`].
pub const MAX_OUTPUT_CHUNKS: u32 = 256;
/// Ceiling of [`ClientConfig::max_step_ms`].
pub const MAX_STEP_MS: u64 = 10 * 60_000;
/// Most effects waiting to be drained; the world drains after every input.
pub const MAX_EFFECTS: usize = 262_144;
/// Byte budget of one `ClientSnapshot` chunk (1 MiB envelope minus the
/// envelope header headroom `rvbox-reconcile` reserves).
pub const SNAPSHOT_CHUNK_BUDGET_BYTES: usize = 1_048_576 - 1_024;
/// Most rows of a `ReconcileRequest` (agent.proto: <= 10,000).
pub const MAX_RECONCILE_ROWS: usize = 10_000;
/// Most UUIDs the ledger tracks for acceptances and starts.
pub const MAX_LEDGER_COMMANDS: usize = 1_000_000;
/// Most acknowledged events waiting in the ledger for the checker.
pub const MAX_LEDGER_NEW_ACKS: usize = 1_000_000;
/// Most frames a window-overrun misbehaviour sends.
pub const MAX_OVERRUN_FRAMES: u64 = 320;
/// Longest garbage frame of the malformed-bytes misbehaviour.
pub const MAX_MALFORMED_BYTES: u64 = 64;
/// Most server-violation notes kept for the report.
pub const MAX_VIOLATION_NOTES: usize = 64;
/// zstd level of output chunks.
pub const ZSTD_LEVEL: i32 = 3;
/// Smallest send window the config accepts (one full output event fits).
pub const MIN_WINDOW_BYTES: u64 = 128 * 1024;

/// A misbehaviour a client can be configured with. Each fires at most once
/// per session, with [`ClientConfig::adversary_permille`] per opportunity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Adversary {
    /// Sends an envelope carrying an older generation (expect close 4001).
    StaleGeneration,
    /// Re-sends an event it already sent this session with the same
    /// `event_seq` and different content (expect a protocol-error fence;
    /// the store must keep the first content).
    ConflictingDuplicate,
    /// Repeats its largest event of the session until the server's
    /// per-command window is exceeded (expect a protocol-error close).
    WindowOverrun,
    /// Sends random bytes as a binary frame (expect close 1002).
    MalformedBytes,
    /// A second installation claiming an existing client id with its own
    /// instance id (see [`SimClient::second_instance`]); expect
    /// `LIVE_CONFLICT` while the other instance is live. It behaves
    /// honestly otherwise. The world must not let two instances of one
    /// client id both run: a command accepted by one and requeued to the
    /// other would legitimately run twice.
    SecondInstance,
}

/// Configuration of one simulated client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// The client id (host-name text).
    pub client_id: String,
    /// Advertised `max_running` (1..=1024).
    pub max_running: u32,
    /// Advertised `max_queued` (0..=10000).
    pub max_queued: u32,
    /// Chance of a transient refusal (local storage pressure) per fresh
    /// dispatch.
    pub transient_permille: u32,
    /// Most output chunks a command writes (0..=[`MAX_OUTPUT_CHUNKS`]).
    pub max_output_chunks: u32,
    /// Largest raw output chunk (1..=65536).
    pub max_chunk_raw_bytes: u32,
    /// Longest pause between two outputs of a process.
    pub max_step_ms: u64,
    /// Chance a command exits non-zero.
    pub fail_permille: u32,
    /// Wall-clock UTC milliseconds at simulated time 0 (observed times and
    /// queue expiry use `wall_epoch_ms + now`).
    pub wall_epoch_ms: i64,
    /// Most items per snapshot chunk (small values exercise chunking).
    pub snapshot_chunk_items: usize,
    /// Own per-command window; the smaller of this and the server's.
    pub command_window_bytes: u64,
    /// Own per-session window; the smaller of this and the server's.
    pub session_window_bytes: u64,
    /// Misbehaviour, if any.
    pub adversary: Option<Adversary>,
    /// Chance per opportunity that the misbehaviour fires.
    pub adversary_permille: u32,
}

impl ClientConfig {
    /// Defaults: the real client's capacity and windows, short commands.
    #[must_use]
    pub fn new(client_id: impl Into<String>) -> Self {
        Self {
            client_id: client_id.into(),
            max_running: u32::try_from(DEFAULT_CLIENT_MAX_RUNNING).unwrap_or(16),
            max_queued: u32::try_from(DEFAULT_CLIENT_MAX_QUEUED).unwrap_or(100),
            transient_permille: 0,
            max_output_chunks: 4,
            max_chunk_raw_bytes: 4_096,
            max_step_ms: 500,
            fail_permille: 100,
            wall_epoch_ms: 1_800_000_000_000,
            snapshot_chunk_items: 4_096,
            command_window_bytes: DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            session_window_bytes: DEFAULT_SESSION_SEND_WINDOW_BYTES,
            adversary: None,
            adversary_permille: 0,
        }
    }

    /// Checks every bound.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field: &'static str, reason: String| Err(ConfigError { field, reason });
        if let Err(e) = ClientId::parse("client_id", &self.client_id) {
            return err("client_id", e.to_string());
        }
        if !(1..=1024).contains(&self.max_running) {
            return err(
                "max_running",
                format!("{} not in 1..=1024", self.max_running),
            );
        }
        if self.max_queued > 10_000 {
            return err(
                "max_queued",
                format!("{} not in 0..=10000", self.max_queued),
            );
        }
        if self.max_output_chunks > MAX_OUTPUT_CHUNKS {
            return err(
                "max_output_chunks",
                format!("{} above {MAX_OUTPUT_CHUNKS}", self.max_output_chunks),
            );
        }
        if self.max_chunk_raw_bytes == 0
            || u64::from(self.max_chunk_raw_bytes) > MAX_RAW_CHUNK_BYTES
        {
            return err(
                "max_chunk_raw_bytes",
                format!(
                    "{} not in 1..={MAX_RAW_CHUNK_BYTES}",
                    self.max_chunk_raw_bytes
                ),
            );
        }
        if self.max_step_ms > MAX_STEP_MS {
            return err(
                "max_step_ms",
                format!("{} above {MAX_STEP_MS}", self.max_step_ms),
            );
        }
        if self.snapshot_chunk_items == 0 {
            return err("snapshot_chunk_items", "must be at least 1".into());
        }
        if self.command_window_bytes < MIN_WINDOW_BYTES
            || self.session_window_bytes < self.command_window_bytes
        {
            return err(
                "command_window_bytes",
                format!(
                    "windows {} / {} must satisfy {MIN_WINDOW_BYTES} <= command <= session",
                    self.command_window_bytes, self.session_window_bytes
                ),
            );
        }
        Ok(())
    }
}

/// A configuration value out of bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field.
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "client config {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// What the world tells the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientInput {
    /// The [`ClientEffect::Connect`] succeeded with this connection.
    Connected(ConnId),
    /// The [`ClientEffect::Connect`] failed (partition, refused).
    ConnectFailed,
    /// The network delivered something to this client.
    Delivered {
        /// The connection.
        conn: ConnId,
        /// What arrived.
        event: NetEvent,
    },
}

/// What the client asks the world to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEffect {
    /// Open a connection and answer with [`ClientInput::Connected`] or
    /// [`ClientInput::ConnectFailed`].
    Connect,
    /// Send an item on a connection (client to server).
    Send {
        /// The connection.
        conn: ConnId,
        /// The item.
        item: Item,
    },
}

/// Where the connection loop is (plan §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkPhase {
    /// Waiting before the next attempt.
    Backoff,
    /// Waiting for the world to answer [`ClientEffect::Connect`].
    Connecting,
    /// Hello sent, waiting for the welcome.
    Hello,
    /// Welcomed; reconciling.
    Reconciling,
    /// Reconciled: capacity reported, events flowing.
    Active,
}

/// One command acknowledgement recorded for the invariant checker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckedEvent {
    /// The command.
    pub issue: Uuid7,
    /// The acknowledged sequence.
    pub event_seq: u64,
    /// Content digest as the store computes `command_events.content_sha256`
    /// (see [`crate::invariants::content_digest`]).
    pub digest: [u8; 32],
}

/// What the invariant checker needs to know about a client. It is the
/// simulator's observation, not client state: it survives crashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// The terminal lifecycle this client reported for each command it
    /// ended itself (ran to an exit, terminated, cancelled before launch).
    outcomes: BTreeMap<Uuid7, Lifecycle>,
    accepted: BTreeMap<Uuid7, u32>,
    starts: BTreeMap<Uuid7, u32>,
    new_accepts: Vec<Uuid7>,
    new_starts: Vec<Uuid7>,
    new_acks: Vec<AckedEvent>,
    acked_total: u64,
    overflowed: bool,
}

/// What a [`Ledger`] recorded since the last [`Ledger::take_new`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerDelta {
    /// Fresh positive acceptances, in order.
    pub accepts: Vec<Uuid7>,
    /// Process starts, in order.
    pub starts: Vec<Uuid7>,
    /// Acknowledged events, in order.
    pub acks: Vec<AckedEvent>,
}

impl Ledger {
    /// Fresh (non-repeat) positive acceptances per command; must be <= 1.
    #[must_use]
    pub fn accepted(&self) -> &BTreeMap<Uuid7, u32> {
        &self.accepted
    }

    /// Process starts per command; must be <= 1.
    #[must_use]
    pub fn starts(&self) -> &BTreeMap<Uuid7, u32> {
        &self.starts
    }

    /// The terminal lifecycle the client reported per command it ended.
    #[must_use]
    pub fn outcomes(&self) -> &BTreeMap<Uuid7, Lifecycle> {
        &self.outcomes
    }

    /// Acknowledged events not yet taken by the checker.
    #[must_use]
    pub fn pending_acks(&self) -> &[AckedEvent] {
        &self.new_acks
    }

    /// Takes everything recorded since the last call.
    pub fn take_new(&mut self) -> LedgerDelta {
        LedgerDelta {
            accepts: std::mem::take(&mut self.new_accepts),
            starts: std::mem::take(&mut self.new_starts),
            acks: std::mem::take(&mut self.new_acks),
        }
    }

    /// Every event ever acknowledged to this client.
    #[must_use]
    pub fn acked_total(&self) -> u64 {
        self.acked_total
    }

    /// True once a bound was hit and something went unrecorded (the
    /// checker reports it: a run must not silently stop checking).
    #[must_use]
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    fn bump(
        map: &mut BTreeMap<Uuid7, u32>,
        delta: &mut Vec<Uuid7>,
        issue: Uuid7,
        overflowed: &mut bool,
    ) {
        if (!map.contains_key(&issue) && map.len() >= MAX_LEDGER_COMMANDS)
            || delta.len() >= MAX_LEDGER_NEW_ACKS
        {
            *overflowed = true;
            return;
        }
        let n = map.entry(issue).or_insert(0);
        *n = n.saturating_add(1);
        delta.push(issue);
    }

    /// A fresh positive acceptance (for clients outside this module).
    pub(crate) fn note_accept_pub(&mut self, issue: Uuid7) {
        self.note_accept(issue);
    }

    /// A process start (user code ran).
    pub(crate) fn note_start_pub(&mut self, issue: Uuid7) {
        self.note_start(issue);
    }

    /// An acknowledged event and its content digest.
    pub(crate) fn note_ack_pub(&mut self, issue: Uuid7, event_seq: u64, digest: [u8; 32]) {
        self.note_ack(issue, event_seq, digest);
    }

    /// The terminal lifecycle the client reported (the first one).
    pub(crate) fn note_outcome_pub(&mut self, issue: Uuid7, to: Lifecycle) {
        self.outcomes.entry(issue).or_insert(to);
    }

    fn note_accept(&mut self, issue: Uuid7) {
        Self::bump(
            &mut self.accepted,
            &mut self.new_accepts,
            issue,
            &mut self.overflowed,
        );
    }

    fn note_start(&mut self, issue: Uuid7) {
        Self::bump(
            &mut self.starts,
            &mut self.new_starts,
            issue,
            &mut self.overflowed,
        );
    }

    fn note_ack(&mut self, issue: Uuid7, event_seq: u64, digest: [u8; 32]) {
        self.acked_total = self.acked_total.saturating_add(1);
        if self.new_acks.len() >= MAX_LEDGER_NEW_ACKS {
            self.overflowed = true;
            return;
        }
        self.new_acks.push(AckedEvent {
            issue,
            event_seq,
            digest,
        });
    }
}

/// Counters of what the client did and saw (conventions rule 7).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientCounters {
    /// Script chunks refused for a command the client does not hold.
    pub script_chunks_refused: u64,
    /// Connection attempts.
    pub connects: u64,
    /// Failed connection attempts.
    pub connect_failures: u64,
    /// Welcomes received.
    pub welcomes: u64,
    /// Snapshots sent (complete, all chunks).
    pub snapshots: u64,
    /// Snapshot chunks sent.
    pub snapshot_chunks: u64,
    /// `ReconcileResult`s applied.
    pub reconciled: u64,
    /// Commands terminated by a `ReconcileResult`.
    pub reconcile_terminated: u64,
    /// Records discarded by a `ReconcileResult`.
    pub reconcile_discarded: u64,
    /// Dispatches received.
    pub dispatches: u64,
    /// Fresh positive acceptances.
    pub accepted: u64,
    /// Repeat dispatches answered with the existing acceptance.
    pub idempotent_repeats: u64,
    /// Transient refusals.
    pub transient_refusals: u64,
    /// Permanent refusals (tombstone hits included).
    pub permanent_refusals: u64,
    /// Dispatches refused as already executed (tombstone hit).
    pub already_executed: u64,
    /// Processes started.
    pub started: u64,
    /// Commands finished (any terminal).
    pub finished: u64,
    /// Commands interrupted by a crash.
    pub interrupted_by_crash: u64,
    /// Signals handled.
    pub signals: u64,
    /// Cancels before launch.
    pub cancelled_before_launch: u64,
    /// Events created (spool).
    pub events_created: u64,
    /// Events sent for the first time.
    pub events_sent: u64,
    /// Events re-sent after a reconnect.
    pub events_replayed: u64,
    /// Events acknowledged.
    pub events_acked: u64,
    /// Events acknowledged by a resume row rather than an `EventAck`.
    pub events_acked_by_resume: u64,
    /// Commands tombstoned.
    pub tombstoned: u64,
    /// Pings sent.
    pub pings: u64,
    /// Liveness timeouts.
    pub liveness_timeouts: u64,
    /// Close frames received.
    pub closes_received: u64,
    /// Connections lost without a Close frame.
    pub connections_lost: u64,
    /// `ControlError`s received.
    pub control_errors: u64,
    /// Crash-restarts.
    pub crashes: u64,
    /// Misbehaviours performed (adversarial modes).
    pub misbehaviours: u64,
    /// Protocol violations by the server seen by this client.
    pub server_violations: u64,
    /// Messages this client does not implement (PTY).
    pub unsupported_messages: u64,
    /// Script chunks accepted (appending or exact replays).
    pub script_chunks_accepted: u64,
    /// Accepted script chunks that started below the durable prefix (an
    /// exact replay of stored bytes, possibly extending past them).
    pub script_chunk_replays: u64,
    /// Scripts whose whole length and SHA-256 were verified (committed).
    pub scripts_committed: u64,
    /// Items for a connection that is no longer current.
    pub stale_connection_items: u64,
    /// Effects dropped because nobody drained them (a world bug).
    pub effects_overflow: u64,
    /// Output chunks not produced because compression failed or the
    /// pending spool was full.
    pub output_skipped: u64,
    /// Stdin writes or signals left unanswered because the spool was full.
    pub backpressured: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct PendingEvent {
    observed_ms: i64,
    body: Body,
    digest: [u8; 32],
}

#[derive(Debug, Clone, PartialEq)]
struct AssignedEvent {
    event: wire::CommandEvent,
    cost: u64,
    digest: [u8; 32],
}

/// The upload of a script command's bytes (durable, part of its
/// [`Record`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ScriptUpload {
    /// `ScriptDescriptor.size_bytes` (1..=10 MiB).
    size: u64,
    /// `ScriptDescriptor.sha256`.
    sha256: [u8; 32],
    /// The received contiguous prefix (never longer than `size`); released
    /// once committed (the real daemon has materialized its file then).
    data: Vec<u8>,
    /// Whole length and SHA-256 verified: the command may launch.
    committed: bool,
}

impl ScriptUpload {
    /// The durable contiguous prefix in raw bytes.
    fn received(&self) -> u64 {
        if self.committed {
            self.size
        } else {
            to_u64(self.data.len())
        }
    }
}

/// One retained command (durable).
#[derive(Debug, Clone, PartialEq)]
struct Record {
    request_hash: [u8; 32],
    revision: u64,
    resolved_shell: i32,
    accept_order: u64,
    /// Accepted, Running or terminal.
    local: Lifecycle,
    started: bool,
    /// Terminated by a `ReconcileResult`: the server has no live record,
    /// so nothing is sent; a later reconciliation discards it.
    orphaned: bool,
    last_signal_revision: u64,
    last_stdin_seq: u64,
    stdin_closed: bool,
    pending: VecDeque<PendingEvent>,
    assigned: VecDeque<AssignedEvent>,
    last_assigned: u64,
    acked: u64,
    /// The script upload of a script command; `None` for command text.
    script: Option<ScriptUpload>,
}

impl Record {
    fn in_flight_bytes(&self) -> u64 {
        self.assigned
            .iter()
            .fold(0u64, |acc, a| acc.saturating_add(a.cost))
    }

    fn spool_full(&self) -> bool {
        self.pending.len().saturating_add(self.assigned.len()) >= MAX_SPOOL_EVENTS_PER_COMMAND
    }

    /// Whether its source allows a launch: command text, or a committed
    /// script.
    fn launchable(&self) -> bool {
        self.script.as_ref().is_none_or(|s| s.committed)
    }

    fn fully_acked_terminal(&self) -> bool {
        self.local.is_terminal()
            && !self.orphaned
            && self.pending.is_empty()
            && self.assigned.is_empty()
            && self.acked == self.last_assigned
    }
}

/// A read-only view of one retained command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordView {
    /// Local public lifecycle.
    pub lifecycle: Lifecycle,
    /// Highest revision applied.
    pub revision: u64,
    /// Whether its process was started.
    pub started: bool,
    /// Terminated by reconciliation (nothing more is sent).
    pub orphaned: bool,
    /// Highest sequence assigned.
    pub last_assigned_event_seq: u64,
    /// Highest sequence acknowledged.
    pub acked_event_seq: u64,
    /// Unsequenced events.
    pub pending_events: usize,
    /// Sequenced, unacknowledged events.
    pub assigned_events: usize,
    /// The script upload, for a script command.
    pub script: Option<ScriptView>,
}

/// A read-only view of one command's script upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptView {
    /// Declared size (`ScriptDescriptor.size_bytes`).
    pub size_bytes: u64,
    /// Durable contiguous prefix received (the size once committed).
    pub received_bytes: u64,
    /// Length and SHA-256 verified; launch-eligible.
    pub committed: bool,
}

/// The client's durable store: what survives [`SimClient::crash_restart`].
#[derive(Debug, Clone, PartialEq)]
pub struct DurableState {
    instance_id: [u8; 16],
    records: BTreeMap<Uuid7, Record>,
    tombstones: BTreeMap<Uuid7, [u8; 32]>,
    tombstone_fifo: VecDeque<Uuid7>,
    next_accept_order: u64,
    last_generation: u64,
}

impl DurableState {
    fn new(instance_id: [u8; 16]) -> Self {
        Self {
            instance_id,
            records: BTreeMap::new(),
            tombstones: BTreeMap::new(),
            tombstone_fifo: VecDeque::new(),
            next_accept_order: 1,
            last_generation: 0,
        }
    }

    /// Canonical text of the durable instance id (UUIDv4).
    #[must_use]
    pub fn instance_id(&self) -> String {
        uuid_text(&self.instance_id)
    }

    /// Retained commands, ascending.
    #[must_use]
    pub fn records(&self) -> Vec<(Uuid7, RecordView)> {
        self.records.iter().map(|(id, r)| (*id, view(r))).collect()
    }

    /// One retained command.
    #[must_use]
    pub fn record(&self, issue: &Uuid7) -> Option<RecordView> {
        self.records.get(issue).map(view)
    }

    /// The received prefix of an uncommitted script upload (`None` for
    /// command text, a committed script or an unknown command).
    #[must_use]
    pub fn script_prefix(&self, issue: &Uuid7) -> Option<&[u8]> {
        self.records
            .get(issue)
            .and_then(|r| r.script.as_ref())
            .filter(|s| !s.committed)
            .map(|s| s.data.as_slice())
    }

    /// Whether the command is in the tombstone FIFO.
    #[must_use]
    pub fn is_tombstoned(&self, issue: &Uuid7) -> bool {
        self.tombstones.contains_key(issue)
    }

    /// Tombstones held.
    #[must_use]
    pub fn tombstone_count(&self) -> usize {
        self.tombstones.len()
    }

    /// The highest generation welcomed so far.
    #[must_use]
    pub fn last_generation(&self) -> u64 {
        self.last_generation
    }

    fn tombstone(&mut self, issue: Uuid7, hash: [u8; 32]) {
        self.records.remove(&issue);
        if self.tombstones.insert(issue, hash).is_none() {
            self.tombstone_fifo.push_back(issue);
        }
        while self.tombstone_fifo.len() > MAX_TOMBSTONES {
            if let Some(old) = self.tombstone_fifo.pop_front() {
                self.tombstones.remove(&old);
            }
        }
    }
}

fn view(r: &Record) -> RecordView {
    RecordView {
        lifecycle: r.local,
        revision: r.revision,
        started: r.started,
        orphaned: r.orphaned,
        last_assigned_event_seq: r.last_assigned,
        acked_event_seq: r.acked,
        pending_events: r.pending.len(),
        assigned_events: r.assigned.len(),
        script: r.script.as_ref().map(|s| ScriptView {
            size_bytes: s.size,
            received_bytes: s.received(),
            committed: s.committed,
        }),
    }
}

/// A live session's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Live {
    session_id: String,
    generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Link {
    Backoff {
        until: u64,
    },
    Connecting,
    Hello {
        conn: ConnId,
    },
    Reconciling {
        conn: ConnId,
        live: Live,
        round: Option<u64>,
    },
    Active {
        conn: ConnId,
        live: Live,
        since: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    Succeeded,
    Failed(i32),
}

/// A running process: lives outside the network session but dies with
/// the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Process {
    next_at: u64,
    chunks_left: u32,
    exit: Exit,
}

#[derive(Debug, Clone)]
struct Volatile {
    link: Link,
    last_inbound: u64,
    ping_sent: bool,
    attempt: u32,
    effects: VecDeque<ClientEffect>,
    processes: BTreeMap<Uuid7, Process>,
    command_window: u64,
    session_window: u64,
    /// Highest sequence sent per command on the current session.
    sent_upto: BTreeMap<Uuid7, u64>,
    last_capacity: Option<(u32, u32)>,
    misbehaved: bool,
    /// The first frame of this session's misbehaviour, until the world
    /// takes it to check the server's answer.
    misbehaviour: Option<(ConnId, Adversary, Vec<u8>)>,
    last_sent: Option<wire::CommandEvent>,
    largest_sent: Option<(u64, wire::CommandEvent)>,
    /// Script windows on this connection: per command, the largest prefix
    /// reported (snapshot or status) and the end of the furthest chunk
    /// received, to check the server's 1 MiB / 8 MiB windows.
    script_window: BTreeMap<Uuid7, (u64, u64)>,
}

impl Volatile {
    fn new(now: u64, config: &ClientConfig) -> Self {
        Self {
            link: Link::Backoff { until: now },
            last_inbound: now,
            ping_sent: false,
            attempt: 0,
            effects: VecDeque::new(),
            processes: BTreeMap::new(),
            command_window: config.command_window_bytes,
            session_window: config.session_window_bytes,
            sent_upto: BTreeMap::new(),
            last_capacity: None,
            misbehaved: false,
            misbehaviour: None,
            last_sent: None,
            largest_sent: None,
            script_window: BTreeMap::new(),
        }
    }
}

/// Script bytes the server may have in flight per command beyond the
/// prefix the client reported (plan §7.3).
const SCRIPT_WINDOW_BYTES: u64 = 1024 * 1024;
/// The same over all commands of one connection.
const SCRIPT_SESSION_WINDOW_BYTES: u64 = 8 * 1024 * 1024;
/// Received script bytes between two progress reports.
const SCRIPT_STATUS_EVERY_BYTES: u64 = 512 * 1024;

/// A simulated client daemon.
#[derive(Debug, Clone)]
pub struct SimClient {
    config: ClientConfig,
    client_id: ClientId,
    rng: SimRng,
    durable: DurableState,
    vol: Volatile,
    ledger: Ledger,
    counters: ClientCounters,
    violation_notes: Vec<String>,
}

fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000).saturating_mul(1_000_000)).unwrap_or(0),
    }
}

fn timestamp_ms(ts: &prost_types::Timestamp) -> i64 {
    ts.seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(ts.nanos.div_euclid(1_000_000)))
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn encoded_len_u64<M: prost::Message>(m: &M) -> u64 {
    to_u64(m.encoded_len())
}

/// Compresses `raw` as one zstd frame with content size and checksum
/// (common.proto `Compression.ZSTD`).
fn zstd_frame(raw: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut c = zstd::bulk::Compressor::new(ZSTD_LEVEL)?;
    c.set_parameter(zstd::stream::raw::CParameter::ChecksumFlag(true))?;
    c.set_parameter(zstd::stream::raw::CParameter::ContentSizeFlag(true))?;
    c.compress(raw)
}

fn signal_info(kind: wire::SignalKind) -> Option<(i32, &'static str)> {
    match kind {
        wire::SignalKind::Hup => Some((1, "SIGHUP")),
        wire::SignalKind::Int => Some((2, "SIGINT")),
        wire::SignalKind::Term => Some((15, "SIGTERM")),
        wire::SignalKind::Kill => Some((9, "SIGKILL")),
        wire::SignalKind::Usr1 | wire::SignalKind::Usr2 | wire::SignalKind::Unspecified => None,
    }
}

impl SimClient {
    /// A fresh installation: its instance id is drawn from `rng` (the
    /// client's stream) once and kept for life.
    ///
    /// # Errors
    /// [`ConfigError`] when the config is out of bounds.
    pub fn new(config: ClientConfig, mut rng: SimRng) -> Result<Self, ConfigError> {
        config.validate()?;
        let client_id =
            ClientId::parse("client_id", &config.client_id).map_err(|e| ConfigError {
                field: "client_id",
                reason: e.to_string(),
            })?;
        let instance = rng.uuid_v4();
        let vol = Volatile::new(0, &config);
        Ok(Self {
            config,
            client_id,
            rng,
            durable: DurableState::new(instance),
            vol,
            ledger: Ledger::default(),
            counters: ClientCounters::default(),
            violation_notes: Vec::new(),
        })
    }

    /// A second installation claiming this client's id: same config with
    /// [`Adversary::SecondInstance`], a new instance id, empty state.
    #[must_use]
    pub fn second_instance(&self, mut rng: SimRng) -> Self {
        let mut config = self.config.clone();
        config.adversary = Some(Adversary::SecondInstance);
        let instance = rng.uuid_v4();
        let vol = Volatile::new(0, &config);
        Self {
            client_id: self.client_id.clone(),
            config,
            rng,
            durable: DurableState::new(instance),
            vol,
            ledger: Ledger::default(),
            counters: ClientCounters::default(),
            violation_notes: Vec::new(),
        }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The client id.
    #[must_use]
    pub fn client_id(&self) -> &str {
        self.client_id.as_str()
    }

    /// The durable instance id text.
    #[must_use]
    pub fn instance_id(&self) -> String {
        self.durable.instance_id()
    }

    /// The durable state.
    #[must_use]
    pub fn durable(&self) -> &DurableState {
        &self.durable
    }

    /// The ledger.
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The ledger, to take new acknowledgements from.
    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// The counters.
    #[must_use]
    pub fn counters(&self) -> &ClientCounters {
        &self.counters
    }

    /// Notes on server protocol violations seen (bounded).
    #[must_use]
    pub fn violation_notes(&self) -> &[String] {
        &self.violation_notes
    }

    /// Where the connection loop is.
    #[must_use]
    pub fn phase(&self) -> LinkPhase {
        match self.vol.link {
            Link::Backoff { .. } => LinkPhase::Backoff,
            Link::Connecting => LinkPhase::Connecting,
            Link::Hello { .. } => LinkPhase::Hello,
            Link::Reconciling { .. } => LinkPhase::Reconciling,
            Link::Active { .. } => LinkPhase::Active,
        }
    }

    /// The current connection, if any.
    #[must_use]
    pub fn connection(&self) -> Option<ConnId> {
        match &self.vol.link {
            Link::Hello { conn } | Link::Reconciling { conn, .. } | Link::Active { conn, .. } => {
                Some(*conn)
            }
            Link::Backoff { .. } | Link::Connecting => None,
        }
    }

    /// The welcomed session's id and generation.
    #[must_use]
    pub fn session(&self) -> Option<(&str, u64)> {
        match &self.vol.link {
            Link::Reconciling { live, .. } | Link::Active { live, .. } => {
                Some((live.session_id.as_str(), live.generation))
            }
            _ => None,
        }
    }

    /// Commands running and accepted-but-waiting (the `ClientCapacity`
    /// values).
    #[must_use]
    pub fn capacity(&self) -> (u32, u32) {
        let mut running = 0u32;
        let mut queued = 0u32;
        for r in self.durable.records.values() {
            match r.local {
                Lifecycle::Running => running = running.saturating_add(1),
                Lifecycle::Accepted => queued = queued.saturating_add(1),
                _ => {}
            }
        }
        (running, queued)
    }

    /// The next effect to perform.
    #[must_use]
    pub fn poll_effect(&mut self) -> Option<ClientEffect> {
        self.vol.effects.pop_front()
    }

    /// When [`Self::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        let link = match &self.vol.link {
            Link::Backoff { until } => Some(*until),
            Link::Connecting => None,
            Link::Hello { .. } | Link::Reconciling { .. } | Link::Active { .. } => {
                let dead = self
                    .vol
                    .last_inbound
                    .saturating_add(DEFAULT_LIVENESS_TIMEOUT_MS);
                if self.vol.ping_sent {
                    Some(dead)
                } else {
                    Some(
                        self.vol
                            .last_inbound
                            .saturating_add(DEFAULT_HEARTBEAT_IDLE_MS),
                    )
                }
            }
        };
        let process = self.vol.processes.values().map(|p| p.next_at).min();
        match (link, process) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds one input at `now`.
    pub fn handle(&mut self, now: u64, input: ClientInput) {
        match input {
            ClientInput::Connected(conn) => self.on_connected(now, conn),
            ClientInput::ConnectFailed => {
                self.counters.connect_failures = self.counters.connect_failures.saturating_add(1);
                if self.vol.link == Link::Connecting {
                    self.enter_backoff(now);
                }
            }
            ClientInput::Delivered { conn, event } => self.on_delivered(now, conn, event),
        }
        self.settle(now);
    }

    /// Runs every timer due at `now` (idempotent).
    pub fn handle_timeout(&mut self, now: u64) {
        self.run_processes(now);
        match self.vol.link.clone() {
            Link::Backoff { until } if now >= until => {
                self.vol.link = Link::Connecting;
                self.counters.connects = self.counters.connects.saturating_add(1);
                self.push_effect(ClientEffect::Connect);
            }
            Link::Hello { conn } | Link::Reconciling { conn, .. } | Link::Active { conn, .. } => {
                let idle = now.saturating_sub(self.vol.last_inbound);
                if idle >= DEFAULT_LIVENESS_TIMEOUT_MS {
                    self.counters.liveness_timeouts =
                        self.counters.liveness_timeouts.saturating_add(1);
                    self.link_down(now, Some(close_code::LIVENESS_TIMEOUT));
                } else if idle >= DEFAULT_HEARTBEAT_IDLE_MS && !self.vol.ping_sent {
                    self.vol.ping_sent = true;
                    self.counters.pings = self.counters.pings.saturating_add(1);
                    self.push_effect(ClientEffect::Send {
                        conn,
                        item: Item::Ping,
                    });
                }
            }
            Link::Backoff { .. } | Link::Connecting => {}
        }
        self.settle(now);
    }

    /// The daemon crashes and restarts at `now`: the connection and all
    /// volatile state are lost; records, spool, tombstones and the
    /// instance id survive. Running processes die with the daemon and
    /// their commands end `INTERRUPTED`. Returns the connection that was
    /// open, which the world hands to `Net::crash` (client side).
    pub fn crash_restart(&mut self, now: u64) -> Option<ConnId> {
        let conn = self.connection();
        self.counters.crashes = self.counters.crashes.saturating_add(1);
        let running: Vec<Uuid7> = self
            .durable
            .records
            .iter()
            .filter(|(_, r)| r.local == Lifecycle::Running)
            .map(|(id, _)| *id)
            .collect();
        self.vol = Volatile::new(now, &self.config);
        for issue in running {
            // plan §4.2: from launch_authorized on, an uncertain outcome
            // is interrupted and never launched again.
            self.finish(
                now,
                issue,
                Lifecycle::Interrupted,
                None,
                None,
                "client daemon restarted while the command ran; outcome uncertain",
            );
            self.counters.interrupted_by_crash =
                self.counters.interrupted_by_crash.saturating_add(1);
        }
        conn
    }

    // ---- plumbing -----------------------------------------------------------

    fn push_effect(&mut self, effect: ClientEffect) {
        if self.vol.effects.len() >= MAX_EFFECTS {
            self.counters.effects_overflow = self.counters.effects_overflow.saturating_add(1);
            return;
        }
        self.vol.effects.push_back(effect);
    }

    fn send_item(&mut self, conn: ConnId, item: Item) {
        self.push_effect(ClientEffect::Send { conn, item });
    }

    fn send_payload(&mut self, payload: Payload) {
        let (conn, session_id, generation) = match &self.vol.link {
            Link::Reconciling { conn, live, .. } | Link::Active { conn, live, .. } => {
                (*conn, live.session_id.clone(), live.generation)
            }
            Link::Hello { conn } => (*conn, String::new(), 0),
            Link::Backoff { .. } | Link::Connecting => return,
        };
        let env = wire::Envelope {
            session_id,
            generation,
            payload: Some(payload),
        };
        self.send_item(conn, Item::Binary(env.encode_to_vec()));
    }

    fn wall_ms(&self, now: u64) -> i64 {
        self.config
            .wall_epoch_ms
            .saturating_add(i64::try_from(now).unwrap_or(i64::MAX))
    }

    fn note_violation(&mut self, what: String) {
        self.counters.server_violations = self.counters.server_violations.saturating_add(1);
        if self.violation_notes.len() < MAX_VIOLATION_NOTES {
            self.violation_notes.push(what);
        }
    }

    /// A server protocol violation: note it and close the connection.
    fn violation(&mut self, now: u64, what: String, code: u16) {
        self.note_violation(what);
        self.link_down(now, Some(code));
    }

    fn enter_backoff(&mut self, now: u64) {
        // plan §7.1: full-jitter exponential backoff from 1 s to 60 s.
        let shift = self.vol.attempt.min(16);
        let cap = DEFAULT_RECONNECT_INITIAL_MS
            .saturating_mul(1u64 << shift)
            .min(DEFAULT_RECONNECT_MAX_MS);
        self.vol.attempt = self.vol.attempt.saturating_add(1);
        let delay = self.rng.range_inclusive(0..=cap);
        self.vol.link = Link::Backoff {
            until: now.saturating_add(delay),
        };
    }

    /// Leaves the current connection (sending a Close frame with `close`
    /// when given) and backs off.
    fn link_down(&mut self, now: u64, close: Option<u16>) {
        if let Link::Active { since, .. } = self.vol.link
            && now.saturating_sub(since) >= DEFAULT_RECONNECT_STABLE_RESET_MS
        {
            // plan §7.1: reset only after 60 stable seconds
            self.vol.attempt = 0;
        }
        if let (Some(conn), Some(code)) = (self.connection(), close) {
            self.send_item(conn, Item::Close { code });
        }
        self.vol.sent_upto.clear();
        self.vol.script_window.clear();
        self.vol.last_capacity = None;
        self.vol.misbehaved = false;
        self.vol.last_sent = None;
        self.vol.largest_sent = None;
        self.vol.ping_sent = false;
        self.enter_backoff(now);
    }

    /// After every input: launch what fits, report capacity, move events.
    fn settle(&mut self, now: u64) {
        self.schedule_starts(now);
        if matches!(self.vol.link, Link::Active { .. }) {
            self.report_capacity();
            self.pump();
        }
    }

    // ---- connection -----------------------------------------------------

    fn on_connected(&mut self, now: u64, conn: ConnId) {
        if self.vol.link != Link::Connecting {
            // not asked for: close it at once
            self.send_item(
                conn,
                Item::Close {
                    code: close_code::NORMAL,
                },
            );
            return;
        }
        self.vol.link = Link::Hello { conn };
        self.vol.last_inbound = now;
        self.vol.ping_sent = false;
        let hello = self.hello();
        self.send_payload(Payload::ClientHello(hello));
    }

    /// The hello this client sends (plan §6.2; bounds of the session
    /// core's `validate_hello`).
    #[must_use]
    pub fn hello(&self) -> wire::ClientHello {
        wire::ClientHello {
            client_id: self.client_id.as_str().to_owned(),
            client_instance_id: self.durable.instance_id(),
            protocol_major: PROTOCOL_MAJOR,
            supported_minors: SUPPORTED_MINORS.to_vec(),
            capabilities: Some(wire::Capabilities {
                platform: Some(wire::Platform {
                    os: "linux".into(),
                    arch: "x86_64".into(),
                    os_release: "rvbox-sim".into(),
                }),
                software_version: concat!(env!("CARGO_PKG_VERSION"), "-sim").into(),
                shells: vec![
                    wire::ShellCapability {
                        shell_type: wire::ShellType::Sh as i32,
                        platform_default: true,
                    },
                    wire::ShellCapability {
                        shell_type: wire::ShellType::Bash as i32,
                        platform_default: false,
                    },
                ],
                profiles: vec![wire::ProfileFlag::Light as i32],
                max_running: self.config.max_running,
                max_queued: self.config.max_queued,
                supervision_mode: wire::SupervisionMode::Fallback as i32,
            }),
            cwd_policy: Some(wire::CwdPolicy {
                default_cwd: "/srv".into(),
                allowed_roots: vec!["/srv".into(), "/tmp".into()],
            }),
        }
    }

    fn on_delivered(&mut self, now: u64, conn: ConnId, event: NetEvent) {
        if self.connection() != Some(conn) {
            self.counters.stale_connection_items =
                self.counters.stale_connection_items.saturating_add(1);
            return;
        }
        match event {
            NetEvent::Opened => {}
            NetEvent::Closed { .. } => {
                self.counters.connections_lost = self.counters.connections_lost.saturating_add(1);
                self.link_down(now, None);
            }
            NetEvent::Item(Item::Ping) => {
                self.inbound(now);
                self.send_item(conn, Item::Pong);
            }
            NetEvent::Item(Item::Pong) => self.inbound(now),
            NetEvent::Item(Item::Close { .. }) => {
                self.counters.closes_received = self.counters.closes_received.saturating_add(1);
                self.link_down(now, None);
            }
            NetEvent::Item(Item::Binary(bytes)) => self.on_frame(now, &bytes),
        }
    }

    fn inbound(&mut self, now: u64) {
        self.vol.last_inbound = now;
        self.vol.ping_sent = false;
    }

    fn on_frame(&mut self, now: u64, bytes: &[u8]) {
        if to_u64(bytes.len()) > MAX_ENVELOPE_BYTES {
            self.violation(
                now,
                format!("a {} byte frame exceeds the envelope limit", bytes.len()),
                close_code::MESSAGE_TOO_BIG,
            );
            return;
        }
        let Ok(env) = wire::Envelope::decode(bytes) else {
            self.violation(
                now,
                "an envelope that does not decode".into(),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        let Some(payload) = env.payload else {
            self.violation(
                now,
                "an envelope without payload".into(),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        self.inbound(now);
        match self.vol.link.clone() {
            Link::Hello { .. } => match payload {
                Payload::ServerWelcome(w) => {
                    self.on_welcome(now, &env.session_id, env.generation, w)
                }
                Payload::ControlError(_) => {
                    self.counters.control_errors = self.counters.control_errors.saturating_add(1);
                }
                other => self.violation(
                    now,
                    format!("{} before the welcome", payload_name(&other)),
                    close_code::PROTOCOL_ERROR,
                ),
            },
            Link::Reconciling { live, .. } | Link::Active { live, .. } => {
                if env.session_id != live.session_id || env.generation != live.generation {
                    self.violation(
                        now,
                        format!(
                            "an envelope for generation {} on live generation {}",
                            env.generation, live.generation
                        ),
                        close_code::STALE_SESSION,
                    );
                    return;
                }
                self.route(now, live.generation, payload);
            }
            Link::Backoff { .. } | Link::Connecting => {}
        }
    }

    fn on_welcome(
        &mut self,
        now: u64,
        env_session: &str,
        env_generation: u64,
        w: wire::ServerWelcome,
    ) {
        let Link::Hello { conn } = self.vol.link else {
            return;
        };
        let sid_ok = (16..=64).contains(&env_session.len()) && env_session.is_ascii();
        if !sid_ok
            || env_generation == 0
            || w.session_id != env_session
            || w.generation != env_generation
            || w.protocol_major != PROTOCOL_MAJOR
            || !SUPPORTED_MINORS.contains(&w.negotiated_minor)
        {
            self.violation(
                now,
                "a welcome whose session fields or version do not match".into(),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        if env_generation <= self.durable.last_generation {
            // another instance of this client id may have registered in
            // between, but the generation counter never goes back
            self.note_violation(format!(
                "welcome generation {env_generation} not above the last seen {}",
                self.durable.last_generation
            ));
        }
        self.durable.last_generation = self.durable.last_generation.max(env_generation);
        self.counters.welcomes = self.counters.welcomes.saturating_add(1);
        if let Some(limits) = &w.limits {
            if limits.command_window_bytes > 0 {
                self.vol.command_window = self
                    .config
                    .command_window_bytes
                    .min(limits.command_window_bytes);
            }
            if limits.session_window_bytes > 0 {
                self.vol.session_window = self
                    .config
                    .session_window_bytes
                    .min(limits.session_window_bytes);
            }
        }
        self.vol.link = Link::Reconciling {
            conn,
            live: Live {
                session_id: env_session.to_owned(),
                generation: env_generation,
            },
            round: None,
        };
    }

    fn route(&mut self, now: u64, generation: u64, payload: Payload) {
        let active = matches!(self.vol.link, Link::Active { .. });
        match payload {
            Payload::ControlError(_) => {
                self.counters.control_errors = self.counters.control_errors.saturating_add(1);
            }
            Payload::ReconcileRequest(req) => self.on_reconcile_request(now, &req),
            Payload::ReconcileResult(res) => self.on_reconcile_result(now, &res),
            Payload::EventAck(ack) => self.on_event_ack(now, &ack),
            Payload::ServerWelcome(_) => self.violation(
                now,
                "a second welcome on one session".into(),
                close_code::PROTOCOL_ERROR,
            ),
            other if !active => self.violation(
                now,
                format!("{} before the ReconcileResult", payload_name(&other)),
                close_code::PROTOCOL_ERROR,
            ),
            Payload::Dispatch(d) => self.on_dispatch(now, generation, &d),
            Payload::Signal(s) => self.on_signal(now, &s),
            Payload::StdinWrite(w) => self.on_stdin(now, &w),
            Payload::PtyOpen(p) => {
                self.counters.unsupported_messages =
                    self.counters.unsupported_messages.saturating_add(1);
                let error = DomainError::new(Code::Unsupported, "the simulated client has no PTY");
                self.send_payload(Payload::PtyOpened(wire::PtyOpened {
                    pty_session_id: p.pty_session_id,
                    outcome: wire::AcceptOutcome::Permanent as i32,
                    error: Some(error.to_detail()),
                    resolved_shell: wire::ShellType::Unspecified as i32,
                }));
            }
            Payload::ScriptChunk(c) => self.on_script_chunk(now, &c),
            Payload::PtyInput(_)
            | Payload::PtyResize(_)
            | Payload::PtyAttach(_)
            | Payload::PtyOutputAck(_)
            | Payload::PtyDetach(_)
            | Payload::PtyClose(_) => {
                self.counters.unsupported_messages =
                    self.counters.unsupported_messages.saturating_add(1);
            }
            other => self.violation(
                now,
                format!("{} is a client-to-server message", payload_name(&other)),
                close_code::PROTOCOL_ERROR,
            ),
        }
    }

    // ---- reconciliation ---------------------------------------------------

    fn on_reconcile_request(&mut self, now: u64, req: &wire::ReconcileRequest) {
        let (conn, live) = match &self.vol.link {
            Link::Reconciling { conn, live, .. } | Link::Active { conn, live, .. } => {
                (*conn, live.clone())
            }
            _ => return,
        };
        if req.round == 0 || req.rows.len() > MAX_RECONCILE_ROWS {
            self.violation(
                now,
                format!(
                    "a ReconcileRequest with round {} and {} rows",
                    req.round,
                    req.rows.len()
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        // a new round: dispatch waits for its result again
        self.vol.link = Link::Reconciling {
            conn,
            live,
            round: Some(req.round),
        };
        self.vol.last_capacity = None;
        let chunks = self.snapshot_chunks(req.round, &req.rows);
        // the prefixes reported here are the base of the server's windows
        for (id, r) in &self.durable.records {
            if let Some(script) = r.script.as_ref().filter(|s| !s.committed) {
                let prefix = script.received();
                self.vol.script_window.insert(*id, (prefix, prefix));
            }
        }
        self.counters.snapshots = self.counters.snapshots.saturating_add(1);
        for chunk in chunks {
            self.counters.snapshot_chunks = self.counters.snapshot_chunks.saturating_add(1);
            self.send_payload(Payload::ClientSnapshot(chunk));
        }
    }

    /// The complete snapshot of `round`, split into chunks: records (every
    /// retained command) first, then tombstones matching requested rows,
    /// each list ascending across chunks (plan §6.4).
    fn snapshot_chunks(
        &self,
        round: u64,
        rows: &[wire::ReconcileRow],
    ) -> Vec<wire::ClientSnapshot> {
        let records: Vec<wire::SnapshotRecord> = self
            .durable
            .records
            .iter()
            .map(|(id, r)| wire::SnapshotRecord {
                issue_uuid: id.to_string(),
                request_hash: r.request_hash.to_vec(),
                revision: r.revision,
                lifecycle: r.local.to_wire() as i32,
                last_assigned_event_seq: r.last_assigned,
                acked_event_seq: r.acked,
                script_received_bytes: r.script.as_ref().map_or(0, ScriptUpload::received),
            })
            .collect();

        let requested: BTreeSet<Uuid7> = rows
            .iter()
            .filter_map(|row| Uuid7::parse("reconcile_request.rows", &row.issue_uuid).ok())
            .collect();
        let tombstones: Vec<wire::SnapshotTombstone> = requested
            .iter()
            .filter_map(|id| {
                self.durable
                    .tombstones
                    .get(id)
                    .map(|hash| wire::SnapshotTombstone {
                        issue_uuid: id.to_string(),
                        request_hash: hash.to_vec(),
                    })
            })
            .collect();
        let new_chunk = |index: u32| wire::ClientSnapshot {
            round,
            chunk_index: index,
            final_chunk: false,
            store_health: wire::ScopeState::Ready as i32,
            records: Vec::new(),
            tombstones: Vec::new(),
        };
        let mut chunks = Vec::new();
        let mut current = new_chunk(0);
        let mut size = current.encoded_len().saturating_add(16);
        let mut items = 0usize;
        let max_items = self.config.snapshot_chunk_items;
        let fits = |size: usize, add: usize, items: usize| {
            items < max_items && size.saturating_add(add) <= SNAPSHOT_CHUNK_BUDGET_BYTES
        };
        for r in records {
            let add = r.encoded_len().saturating_add(4);
            if items > 0 && !fits(size, add, items) {
                let index = current.chunk_index.saturating_add(1);
                chunks.push(std::mem::replace(&mut current, new_chunk(index)));
                size = current.encoded_len().saturating_add(16);
                items = 0;
            }
            size = size.saturating_add(add);
            items = items.saturating_add(1);
            current.records.push(r);
        }
        for t in tombstones {
            let add = t.encoded_len().saturating_add(4);
            if items > 0 && !fits(size, add, items) {
                let index = current.chunk_index.saturating_add(1);
                chunks.push(std::mem::replace(&mut current, new_chunk(index)));
                size = current.encoded_len().saturating_add(16);
                items = 0;
            }
            size = size.saturating_add(add);
            items = items.saturating_add(1);
            current.tombstones.push(t);
        }
        current.final_chunk = true;
        chunks.push(current);
        chunks
    }

    fn on_reconcile_result(&mut self, now: u64, res: &wire::ReconcileResult) {
        let Link::Reconciling {
            conn,
            live,
            round: Some(round),
        } = self.vol.link.clone()
        else {
            self.violation(
                now,
                "a ReconcileResult without a pending snapshot".into(),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        let checked = match check_result(res, round) {
            Ok(c) => c,
            Err(e) => {
                self.violation(
                    now,
                    format!("ReconcileResult refused: {e}"),
                    close_code::PROTOCOL_ERROR,
                );
                return;
            }
        };
        // plan §6.4: durably record terminate/discard intents before
        // reporting capacity.
        for issue in &checked.terminate {
            self.reconcile_terminate(*issue);
        }
        for issue in &checked.discard {
            let discard = self
                .durable
                .records
                .get(issue)
                .map(|r| (r.local.is_terminal(), r.request_hash));
            match discard {
                Some((true, hash)) => {
                    self.durable.tombstone(*issue, hash);
                    self.counters.reconcile_discarded =
                        self.counters.reconcile_discarded.saturating_add(1);
                    self.counters.tombstoned = self.counters.tombstoned.saturating_add(1);
                }
                Some((false, _)) => {
                    self.note_violation(format!("ReconcileResult discards active command {issue}"))
                }
                None => {}
            }
        }
        let mut sent_upto = BTreeMap::new();
        for (issue, (revision, durable_seq)) in &checked.resume {
            let Some(rec) = self.durable.records.get_mut(issue) else {
                continue;
            };
            rec.revision = rec.revision.max(*revision);
            if *durable_seq > rec.last_assigned {
                let last = rec.last_assigned;
                self.note_violation(format!(
                    "resume {issue}: durable_event_seq {durable_seq} above assigned {last}"
                ));
                continue;
            }
            // the server holds these durably: an implicit acknowledgement
            self.ack_upto(*issue, *durable_seq, true);
            sent_upto.insert(*issue, *durable_seq);
        }
        // records the result did not mention resume from their own ack
        for (issue, rec) in &self.durable.records {
            if !rec.orphaned && !sent_upto.contains_key(issue) {
                sent_upto.insert(*issue, rec.acked);
            }
        }
        self.vol.sent_upto = sent_upto;
        self.counters.reconciled = self.counters.reconciled.saturating_add(1);
        self.vol.link = Link::Active {
            conn,
            live,
            since: now,
        };
        self.vol.last_capacity = None;
    }

    fn reconcile_terminate(&mut self, issue: Uuid7) {
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return;
        };
        self.counters.reconcile_terminated = self.counters.reconcile_terminated.saturating_add(1);
        self.vol.processes.remove(&issue);
        if !rec.local.is_terminal() {
            rec.local = if rec.started {
                Lifecycle::Terminated
            } else {
                Lifecycle::Cancelled
            };
            self.counters.finished = self.counters.finished.saturating_add(1);
        }
        // the server has no live record: nothing more is sent for it
        rec.orphaned = true;
        rec.pending.clear();
        rec.assigned.clear();
    }

    // ---- dispatch ---------------------------------------------------------

    fn refuse(&mut self, d: &wire::Dispatch, outcome: wire::AcceptOutcome, error: DomainError) {
        match outcome {
            wire::AcceptOutcome::Transient => {
                self.counters.transient_refusals =
                    self.counters.transient_refusals.saturating_add(1);
            }
            _ => {
                self.counters.permanent_refusals =
                    self.counters.permanent_refusals.saturating_add(1);
            }
        }
        let mut error = error;
        if let Ok(id) = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid) {
            error = error.with_issue(id);
        }
        self.send_payload(Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: d.issue_uuid.clone(),
            revision: d.revision,
            outcome: outcome as i32,
            error: Some(error.to_detail()),
            resolved_shell: wire::ShellType::Unspecified as i32,
        }));
    }

    fn accept(&mut self, d: &wire::Dispatch, resolved_shell: i32) {
        self.send_payload(Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: d.issue_uuid.clone(),
            revision: d.revision,
            outcome: wire::AcceptOutcome::Positive as i32,
            error: None,
            resolved_shell,
        }));
    }

    fn on_dispatch(&mut self, now: u64, generation: u64, d: &wire::Dispatch) {
        self.counters.dispatches = self.counters.dispatches.saturating_add(1);
        // plan §6.2: the client rejects a dispatch for another generation
        if d.generation != generation {
            self.violation(
                now,
                format!(
                    "dispatch {} for generation {} on generation {generation}",
                    d.issue_uuid, d.generation
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        let Ok(issue) = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid) else {
            self.note_violation(format!("dispatch with issue_uuid {:?}", d.issue_uuid));
            self.refuse(
                d,
                wire::AcceptOutcome::Permanent,
                DomainError::new(Code::InvalidArgument, "issue_uuid is not canonical UUIDv7")
                    .with_field("dispatch.issue_uuid"),
            );
            return;
        };
        let Ok(hash) = <[u8; 32]>::try_from(d.request_hash.as_slice()) else {
            self.note_violation(format!("dispatch {issue} with a malformed request_hash"));
            self.refuse(
                d,
                wire::AcceptOutcome::Permanent,
                DomainError::new(Code::InvalidArgument, "request_hash is not 32 bytes")
                    .with_field("dispatch.request_hash"),
            );
            return;
        };
        let Some(spec) = d.spec.as_ref() else {
            self.refuse(
                d,
                wire::AcceptOutcome::Permanent,
                DomainError::new(Code::InvalidArgument, "dispatch carries no spec")
                    .with_field("dispatch.spec"),
            );
            return;
        };
        if command_hash(&self.client_id, spec).0 != hash {
            self.note_violation(format!(
                "dispatch {issue}: request_hash does not match its spec"
            ));
            self.refuse(
                d,
                wire::AcceptOutcome::Permanent,
                DomainError::new(Code::Conflict, "request_hash does not match the spec")
                    .with_field("dispatch.request_hash"),
            );
            return;
        }
        if d.revision == 0 {
            self.refuse(
                d,
                wire::AcceptOutcome::Permanent,
                DomainError::new(Code::InvalidArgument, "revision 0")
                    .with_field("dispatch.revision"),
            );
            return;
        }
        // plan §7.3 step 2: active table and tombstones before capacity
        if let Some(rec) = self.durable.records.get_mut(&issue) {
            if rec.orphaned && rec.request_hash == hash {
                // terminated by reconciliation: it may have run, and no
                // event will ever be sent for it
                self.counters.already_executed = self.counters.already_executed.saturating_add(1);
                self.refuse(
                    d,
                    wire::AcceptOutcome::Permanent,
                    DomainError::new(Code::AlreadyExecuted, "this command was ended here"),
                );
            } else if rec.request_hash == hash {
                rec.revision = rec.revision.max(d.revision);
                let shell = rec.resolved_shell;
                self.counters.idempotent_repeats =
                    self.counters.idempotent_repeats.saturating_add(1);
                self.accept(d, shell);
            } else {
                self.refuse(
                    d,
                    wire::AcceptOutcome::Permanent,
                    DomainError::new(
                        Code::Conflict,
                        "issue_uuid is held with another request hash",
                    ),
                );
            }
            return;
        }
        if let Some(stored) = self.durable.tombstones.get(&issue).copied() {
            if stored == hash {
                self.counters.already_executed = self.counters.already_executed.saturating_add(1);
                self.refuse(
                    d,
                    wire::AcceptOutcome::Permanent,
                    DomainError::new(Code::AlreadyExecuted, "this command already ran here"),
                );
            } else {
                self.refuse(
                    d,
                    wire::AcceptOutcome::Permanent,
                    DomainError::new(
                        Code::Conflict,
                        "issue_uuid was executed here with another request hash",
                    ),
                );
            }
            return;
        }
        let (shell, script) = match self.check_spec(spec) {
            Ok(checked) => checked,
            Err(error) => {
                self.refuse(d, wire::AcceptOutcome::Permanent, error);
                return;
            }
        };
        if let Some(expiry) = &d.queue_expiry_time
            && self.wall_ms(now) >= timestamp_ms(expiry)
        {
            // Transient: the server expires it (dispatched -> queued ->
            // expired) instead of marking it rejected.
            self.refuse(
                d,
                wire::AcceptOutcome::Transient,
                DomainError::new(
                    Code::FailedPrecondition,
                    "the queue expiry has passed by the client clock",
                )
                .with_retry(RetryClass::Transient),
            );
            return;
        }
        let (running, queued) = self.capacity();
        let has_slot = running < self.config.max_running || queued < self.config.max_queued;
        if !has_slot || self.durable.records.len() >= MAX_RECORDS {
            self.refuse(
                d,
                wire::AcceptOutcome::Transient,
                DomainError::new(Code::CapacityExhausted, "no running or queued slot is free"),
            );
            return;
        }
        if self.rng.chance(self.config.transient_permille) {
            self.refuse(
                d,
                wire::AcceptOutcome::Transient,
                DomainError::new(Code::Unavailable, "local storage is busy; retry later"),
            );
            return;
        }
        // plan §7.3 step 4: the acceptance is durable before the answer
        let order = self.durable.next_accept_order;
        self.durable.next_accept_order = order.saturating_add(1);
        self.durable.records.insert(
            issue,
            Record {
                request_hash: hash,
                revision: d.revision,
                resolved_shell: shell,
                accept_order: order,
                local: Lifecycle::Accepted,
                started: false,
                orphaned: false,
                last_signal_revision: 0,
                last_stdin_seq: 0,
                stdin_closed: false,
                pending: VecDeque::new(),
                assigned: VecDeque::new(),
                last_assigned: 0,
                acked: 0,
                script,
            },
        );
        self.ledger.note_accept(issue);
        self.counters.accepted = self.counters.accepted.saturating_add(1);
        self.accept(d, shell);
    }

    /// Source, shell, profile and working-directory policy (plan §7.3
    /// step 1); returns the resolved shell and, for a script source, its
    /// empty upload.
    fn check_spec(
        &self,
        spec: &wire::ExecutionSpec,
    ) -> Result<(i32, Option<ScriptUpload>), DomainError> {
        let script = match &spec.source {
            Some(wire::execution_spec::Source::CommandText(t)) if !t.is_empty() => None,
            Some(wire::execution_spec::Source::Script(d)) => Some(check_descriptor(d)?),
            _ => {
                return Err(DomainError::new(
                    Code::InvalidArgument,
                    "spec has no command text or script",
                )
                .with_field("spec.source"));
            }
        };
        let shell = match wire::ShellType::try_from(spec.shell_type) {
            Ok(wire::ShellType::Unspecified) => wire::ShellType::Sh,
            Ok(s @ (wire::ShellType::Sh | wire::ShellType::Bash)) => s,
            _ => {
                return Err(
                    DomainError::new(Code::Unsupported, "shell is not available here")
                        .with_field("spec.shell_type"),
                );
            }
        };
        if spec
            .profile_flags
            .iter()
            .any(|p| *p != wire::ProfileFlag::Light as i32)
        {
            return Err(
                DomainError::new(Code::Unsupported, "profile is not enforceable here")
                    .with_field("spec.profile_flags"),
            );
        }
        let cwd_ok = spec.cwd.is_empty()
            || ["/srv", "/tmp"].iter().any(|root| {
                spec.cwd == *root
                    || spec
                        .cwd
                        .strip_prefix(root)
                        .is_some_and(|rest| rest.starts_with('/'))
            });
        if !cwd_ok {
            return Err(DomainError::new(
                Code::InvalidArgument,
                "cwd is not under an allowed root",
            )
            .with_field("spec.cwd"));
        }
        Ok((shell as i32, script))
    }

    // ---- processes ------------------------------------------------------

    fn schedule_starts(&mut self, now: u64) {
        loop {
            let (running, _) = self.capacity();
            if running >= self.config.max_running {
                return;
            }
            let next = self
                .durable
                .records
                .iter()
                .filter(|(_, r)| {
                    r.local == Lifecycle::Accepted && !r.started && !r.orphaned && r.launchable()
                })
                .min_by_key(|(_, r)| r.accept_order)
                .map(|(id, _)| *id);
            let Some(issue) = next else {
                return;
            };
            self.start(now, issue);
        }
    }

    fn start(&mut self, now: u64, issue: Uuid7) {
        let chunks = u32::try_from(
            self.rng
                .range_inclusive(0..=u64::from(self.config.max_output_chunks)),
        )
        .unwrap_or(0);
        let exit = if self.rng.chance(self.config.fail_permille) {
            Exit::Failed(i32::try_from(self.rng.range_inclusive(1..=255)).unwrap_or(1))
        } else {
            Exit::Succeeded
        };
        let step = self.rng.range_inclusive(0..=self.config.max_step_ms);
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return;
        };
        // launch authorized (durable) before user code runs
        rec.started = true;
        rec.local = Lifecycle::Running;
        let revision = rec.revision;
        self.ledger.note_start(issue);
        self.counters.started = self.counters.started.saturating_add(1);
        self.push_lifecycle(now, issue, Lifecycle::Running, revision, None, "");
        self.vol.processes.insert(
            issue,
            Process {
                next_at: now.saturating_add(step),
                chunks_left: chunks,
                exit,
            },
        );
    }

    fn run_processes(&mut self, now: u64) {
        let due: Vec<Uuid7> = self
            .vol
            .processes
            .iter()
            .filter(|(_, p)| p.next_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for issue in due {
            // bounded: each pass consumes one chunk or ends the process
            for _ in 0..=MAX_OUTPUT_CHUNKS {
                let Some(p) = self.vol.processes.get(&issue).copied() else {
                    break;
                };
                if p.next_at > now {
                    break;
                }
                if p.chunks_left > 0 {
                    self.emit_output(now, issue);
                    let step = self.rng.range_inclusive(0..=self.config.max_step_ms);
                    if let Some(p) = self.vol.processes.get_mut(&issue) {
                        p.chunks_left -= 1;
                        p.next_at = now.saturating_add(step);
                    }
                } else {
                    self.vol.processes.remove(&issue);
                    match p.exit {
                        Exit::Succeeded => {
                            self.finish(now, issue, Lifecycle::Succeeded, Some(0), None, "");
                        }
                        Exit::Failed(code) => {
                            self.finish(now, issue, Lifecycle::Failed, Some(code), None, "");
                        }
                    }
                }
            }
        }
    }

    fn emit_output(&mut self, now: u64, issue: Uuid7) {
        let len = usize::try_from(
            self.rng
                .range_inclusive(1..=u64::from(self.config.max_chunk_raw_bytes)),
        )
        .unwrap_or(1);
        // half the chunks are text-like (compressible), half noise
        let raw = if self.rng.chance(500) {
            let line = b"sim output line 0123456789 abcdefghijklmnopqrstuvwxyz\n";
            line.iter().copied().cycle().take(len).collect::<Vec<u8>>()
        } else {
            self.rng.bytes(len)
        };
        let stream = if self.rng.chance(750) {
            wire::OutputStream::Stdout
        } else {
            wire::OutputStream::Stderr
        };
        let Ok(payload) = zstd_frame(&raw) else {
            self.counters.output_skipped = self.counters.output_skipped.saturating_add(1);
            return;
        };
        let digest = rvbox_segment::sha256(&raw);
        let body = Body::Output(wire::OutputChunk {
            stream: stream as i32,
            stored_length: u32::try_from(payload.len()).unwrap_or(u32::MAX),
            payload,
            raw_length: u32::try_from(raw.len()).unwrap_or(u32::MAX),
        });
        self.push_event(now, issue, body, digest);
    }

    /// Ends a command locally with a terminal lifecycle event.
    fn finish(
        &mut self,
        now: u64,
        issue: Uuid7,
        to: Lifecycle,
        exit_code: Option<i32>,
        signal: Option<(i32, &'static str)>,
        reason: &str,
    ) {
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return;
        };
        if rec.local.is_terminal() {
            return;
        }
        rec.local = to;
        let revision = rec.revision;
        self.vol.processes.remove(&issue);
        self.counters.finished = self.counters.finished.saturating_add(1);
        let exit = wire::ExitResult {
            lifecycle: to.to_wire() as i32,
            exit_code,
            signal_number: signal.map(|s| s.0),
            signal_name: signal.map(|s| s.1.to_owned()).unwrap_or_default(),
        };
        self.push_lifecycle(now, issue, to, revision, Some(exit), reason);
    }

    fn push_lifecycle(
        &mut self,
        now: u64,
        issue: Uuid7,
        to: Lifecycle,
        revision: u64,
        exit_result: Option<wire::ExitResult>,
        reason: &str,
    ) {
        if to.is_terminal()
            && self
                .durable
                .records
                .get(&issue)
                .is_some_and(|r| !r.orphaned)
        {
            self.ledger.outcomes.entry(issue).or_insert(to);
        }
        let change = wire::LifecycleChange {
            lifecycle: to.to_wire() as i32,
            revision,
            exit_result,
            reason: reason.to_owned(),
        };
        let digest = body_digest(body_kind::LIFECYCLE, &change.encode_to_vec());
        self.push_event(now, issue, Body::Lifecycle(change), digest);
    }

    fn push_event(&mut self, now: u64, issue: Uuid7, body: Body, digest: [u8; 32]) {
        let observed_ms = self.wall_ms(now);
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return;
        };
        if rec.orphaned {
            return;
        }
        let essential = !matches!(body, Body::Output(_));
        if !essential && (rec.pending.len() >= MAX_PENDING_EVENTS_PER_COMMAND || rec.spool_full()) {
            self.counters.output_skipped = self.counters.output_skipped.saturating_add(1);
            return;
        }
        rec.pending.push_back(PendingEvent {
            observed_ms,
            body,
            digest,
        });
        self.counters.events_created = self.counters.events_created.saturating_add(1);
    }

    // ---- signals and stdin ----------------------------------------------

    fn on_signal(&mut self, now: u64, s: &wire::Signal) {
        let Ok(issue) = Uuid7::parse("signal.issue_uuid", &s.issue_uuid) else {
            self.violation(
                now,
                format!("signal with issue_uuid {:?}", s.issue_uuid),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        let kind = wire::SignalKind::try_from(s.signal).unwrap_or(wire::SignalKind::Unspecified);
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            // unknown or tombstoned: reconciliation settles it
            return;
        };
        if s.revision <= rec.last_signal_revision || rec.orphaned {
            return;
        }
        if rec.spool_full() {
            self.counters.backpressured = self.counters.backpressured.saturating_add(1);
            return;
        }
        rec.last_signal_revision = s.revision;
        rec.revision = rec.revision.max(s.revision);
        let (local, started) = (rec.local, rec.started);
        self.counters.signals = self.counters.signals.saturating_add(1);
        match local {
            // plan §6.4: launch not authorized yet -> a revisioned cancel
            Lifecycle::Accepted if !started => {
                self.counters.cancelled_before_launch =
                    self.counters.cancelled_before_launch.saturating_add(1);
                self.finish(
                    now,
                    issue,
                    Lifecycle::Cancelled,
                    None,
                    None,
                    "cancelled before launch",
                );
            }
            Lifecycle::Running => {
                let result = wire::SignalResult {
                    revision: s.revision,
                    signal: s.signal,
                    outcome: wire::SignalOutcome::Delivered as i32,
                    reason: String::new(),
                };
                let digest = body_digest(body_kind::SIGNAL_RESULT, &result.encode_to_vec());
                self.push_event(now, issue, Body::SignalResult(result), digest);
                if let Some(info) = signal_info(kind) {
                    self.finish(
                        now,
                        issue,
                        Lifecycle::Terminated,
                        None,
                        Some(info),
                        "ended by a signal sent through RVBox",
                    );
                }
            }
            // the terminal event is already the last event
            _ => {}
        }
    }

    fn on_stdin(&mut self, now: u64, w: &wire::StdinWrite) {
        let Ok(issue) = Uuid7::parse("stdin_write.issue_uuid", &w.issue_uuid) else {
            self.violation(
                now,
                format!("stdin write with issue_uuid {:?}", w.issue_uuid),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return;
        };
        if rec.local.is_terminal() || rec.orphaned || w.write_seq <= rec.last_stdin_seq {
            return;
        }
        if rec.spool_full() {
            self.counters.backpressured = self.counters.backpressured.saturating_add(1);
            return;
        }
        if w.write_seq != rec.last_stdin_seq.saturating_add(1) {
            let last = rec.last_stdin_seq;
            self.note_violation(format!(
                "stdin write {} of {issue} after {last}",
                w.write_seq
            ));
            return;
        }
        rec.last_stdin_seq = w.write_seq;
        let written = rec.started && !rec.stdin_closed;
        rec.stdin_closed |= w.close_after;
        let ack = wire::StdinAck {
            write_seq: w.write_seq,
            delivery: if written {
                wire::StdinDelivery::Written
            } else {
                wire::StdinDelivery::Discarded
            } as i32,
            closed: rec.stdin_closed,
            reason: if written {
                String::new()
            } else {
                "stdin is not open".into()
            },
        };
        let digest = body_digest(body_kind::STDIN_ACK, &ack.encode_to_vec());
        self.push_event(now, issue, Body::StdinAck(ack), digest);
    }

    // ---- script uploads -----------------------------------------------------

    /// A `ScriptChunk` (plan §7.3 script dispatch): accepted only at the
    /// durable contiguous prefix or as an exact replay of stored bytes
    /// (anything past the prefix is appended); every accepted chunk is
    /// answered with the cumulative prefix, and the full length is
    /// verified against the descriptor's SHA-256 before the command may
    /// launch.
    fn on_script_chunk(&mut self, now: u64, c: &wire::ScriptChunk) {
        let Ok(issue) = Uuid7::parse("script_chunk.issue_uuid", &c.issue_uuid) else {
            self.violation(
                now,
                format!("script chunk with issue_uuid {:?}", c.issue_uuid),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        // unknown or tombstoned (no record), or ended by reconciliation:
        // the server's upload is stale; refuse it so the server ends it
        let held = self
            .durable
            .records
            .get(&issue)
            .filter(|r| !r.orphaned)
            .is_some();
        if !held {
            self.counters.script_chunks_refused =
                self.counters.script_chunks_refused.saturating_add(1);
            self.send_payload(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid.clone(),
                received_bytes: 0,
                state: wire::ScriptUploadState::Rejected as i32,
                error: Some(
                    DomainError::new(Code::NotFound, "the client does not hold this command")
                        .to_detail(),
                ),
            }));
            return;
        }
        let Some(rec) = self.durable.records.get(&issue) else {
            return;
        };
        let Some(script) = rec.script.as_ref() else {
            self.note_violation(format!(
                "script chunk for {issue}, a command without a script"
            ));
            return;
        };
        if script.committed {
            // a re-sent upload (e.g. after a repeated acceptance): say it
            // is whole again, so the server ends it
            let size = script.size;
            self.send_payload(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid.clone(),
                received_bytes: size,
                state: wire::ScriptUploadState::Committed as i32,
                error: None,
            }));
            return;
        }
        let raw = match decode_chunk(c, script.size) {
            Ok(raw) => raw,
            Err(e) => {
                self.violation(
                    now,
                    format!("script chunk {issue} at {}: {e}", c.offset),
                    close_code::PROTOCOL_ERROR,
                );
                return;
            }
        };
        // the server keeps at most 1 MiB per command, and 8 MiB per
        // connection, beyond the prefix this client reported
        let end = c.offset.saturating_add(u64::from(c.raw_length));
        let (reported, seen) = self
            .vol
            .script_window
            .get(&issue)
            .copied()
            .unwrap_or((0, 0));
        let mut in_flight = end.saturating_sub(reported);
        for (id, (r, s)) in &self.vol.script_window {
            if *id != issue {
                in_flight = in_flight.saturating_add(s.saturating_sub(*r));
            }
        }
        if end > reported.saturating_add(SCRIPT_WINDOW_BYTES)
            || in_flight > SCRIPT_SESSION_WINDOW_BYTES
        {
            self.violation(
                now,
                format!(
                    "script chunk {issue} ending at {end} is past the window (prefix reported {reported}, {in_flight} bytes in flight on the connection)"
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        let prefix = to_u64(script.data.len());
        if c.offset > prefix {
            self.violation(
                now,
                format!(
                    "script chunk {issue} at {} leaves a hole after the prefix {prefix}",
                    c.offset
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        // the part below the prefix must be exactly the stored bytes
        let overlap = usize::try_from(prefix.saturating_sub(c.offset))
            .unwrap_or(usize::MAX)
            .min(raw.len());
        let start = usize::try_from(c.offset).unwrap_or(usize::MAX);
        let stored = script.data.get(start..start.saturating_add(overlap));
        if stored.is_none() || stored != raw.get(..overlap) {
            self.violation(
                now,
                format!(
                    "script chunk {issue} at {} changes bytes already received",
                    c.offset
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        let replay = c.offset < prefix;
        let Some(script) = self
            .durable
            .records
            .get_mut(&issue)
            .and_then(|r| r.script.as_mut())
        else {
            return;
        };
        // durable (appended and synced) before the status reports it
        if let Some(tail) = raw.get(overlap..) {
            script.data.extend_from_slice(tail);
        }
        let received = to_u64(script.data.len());
        let complete = received == script.size;
        let verified = complete && rvbox_segment::sha256(&script.data) == script.sha256;
        if verified {
            // the launch gate opens; the bytes now live in the (simulated)
            // materialized file, so the copy is released
            script.committed = true;
            script.data = Vec::new();
        }
        self.counters.script_chunks_accepted =
            self.counters.script_chunks_accepted.saturating_add(1);
        if replay {
            self.counters.script_chunk_replays =
                self.counters.script_chunk_replays.saturating_add(1);
        }
        if complete && !verified {
            self.violation(
                now,
                format!("script {issue}: the {received} bytes received do not match the descriptor's SHA-256"),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        // progress is reported every 512 KiB (half the window, so the
        // server never waits on it), at once for a replay (the server may
        // be resending what this client holds and must learn to skip
        // ahead), and at the end
        let state = if verified {
            self.counters.scripts_committed = self.counters.scripts_committed.saturating_add(1);
            self.vol.script_window.remove(&issue);
            wire::ScriptUploadState::Committed
        } else if replay || received.saturating_sub(reported) >= SCRIPT_STATUS_EVERY_BYTES {
            self.vol
                .script_window
                .insert(issue, (reported.max(received), seen.max(end)));
            wire::ScriptUploadState::Receiving
        } else {
            self.vol
                .script_window
                .insert(issue, (reported, seen.max(end)));
            return;
        };
        self.send_payload(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
            issue_uuid: c.issue_uuid.clone(),
            received_bytes: received,
            state: state as i32,
            error: None,
        }));
    }

    // ---- acknowledgements -------------------------------------------------

    fn on_event_ack(&mut self, now: u64, ack: &wire::EventAck) {
        let Ok(issue) = Uuid7::parse("event_ack.issue_uuid", &ack.issue_uuid) else {
            self.violation(
                now,
                format!("event ack with issue_uuid {:?}", ack.issue_uuid),
                close_code::PROTOCOL_ERROR,
            );
            return;
        };
        let Some(rec) = self.durable.records.get(&issue) else {
            return;
        };
        if ack.durable_event_seq > rec.last_assigned {
            let last = rec.last_assigned;
            self.violation(
                now,
                format!(
                    "ack {issue} up to {} above the last assigned {last}",
                    ack.durable_event_seq
                ),
                close_code::PROTOCOL_ERROR,
            );
            return;
        }
        self.ack_upto(issue, ack.durable_event_seq, false);
    }

    /// Drops every assigned event up to `seq` (cumulative), records them
    /// in the ledger, and tombstones a fully acknowledged terminal
    /// command. Returns how many events were acknowledged.
    fn ack_upto(&mut self, issue: Uuid7, seq: u64, by_resume: bool) -> u64 {
        let Some(rec) = self.durable.records.get_mut(&issue) else {
            return 0;
        };
        let mut n = 0u64;
        while rec
            .assigned
            .front()
            .is_some_and(|a| a.event.event_seq <= seq)
        {
            if let Some(a) = rec.assigned.pop_front() {
                self.ledger.note_ack(issue, a.event.event_seq, a.digest);
                n = n.saturating_add(1);
            }
        }
        rec.acked = rec.acked.max(seq);
        let tombstone = rec.fully_acked_terminal().then_some(rec.request_hash);
        if by_resume {
            self.counters.events_acked_by_resume =
                self.counters.events_acked_by_resume.saturating_add(n);
        } else {
            self.counters.events_acked = self.counters.events_acked.saturating_add(n);
        }
        if let Some(hash) = tombstone {
            // plan §7.1: after the terminal ack the record becomes a
            // tombstone (UUID + request hash) in one step
            self.durable.tombstone(issue, hash);
            self.vol.sent_upto.remove(&issue);
            self.counters.tombstoned = self.counters.tombstoned.saturating_add(1);
        }
        n
    }

    // ---- sending ----------------------------------------------------------

    fn report_capacity(&mut self) {
        let cap = self.capacity();
        if self.vol.last_capacity == Some(cap) {
            return;
        }
        self.vol.last_capacity = Some(cap);
        self.send_payload(Payload::ClientCapacity(wire::ClientCapacity {
            running: cap.0,
            queued: cap.1,
            max_running: self.config.max_running,
            max_queued: self.config.max_queued,
        }));
    }

    fn send_event(&mut self, event: &wire::CommandEvent, cost: u64) {
        self.send_payload(Payload::CommandEvent(event.clone()));
        self.vol.last_sent = Some(event.clone());
        if self
            .vol
            .largest_sent
            .as_ref()
            .is_none_or(|(c, _)| cost > *c)
        {
            self.vol.largest_sent = Some((cost, event.clone()));
        }
    }

    /// Replays assigned events after each command's resume position, then
    /// assigns and sends new events round-robin within the windows.
    fn pump(&mut self) {
        self.maybe_misbehave();
        if !matches!(self.vol.link, Link::Active { .. }) {
            return;
        }
        // replay, in per-command order
        let mut replay: Vec<(wire::CommandEvent, u64)> = Vec::new();
        for (issue, rec) in &self.durable.records {
            if rec.orphaned {
                continue;
            }
            let upto = self.vol.sent_upto.get(issue).copied().unwrap_or(rec.acked);
            for a in rec.assigned.iter().filter(|a| a.event.event_seq > upto) {
                replay.push((a.event.clone(), a.cost));
            }
        }
        for (event, cost) in replay {
            if let Ok(issue) = Uuid7::parse("issue", &event.issue_uuid) {
                self.vol.sent_upto.insert(issue, event.event_seq);
            }
            self.counters.events_replayed = self.counters.events_replayed.saturating_add(1);
            self.send_event(&event, cost);
        }
        // assign new events within the windows
        let mut total: u64 = self
            .durable
            .records
            .values()
            .filter(|r| !r.orphaned)
            .fold(0u64, |acc, r| acc.saturating_add(r.in_flight_bytes()));
        let keys: Vec<Uuid7> = self
            .durable
            .records
            .iter()
            .filter(|(_, r)| !r.orphaned && !r.pending.is_empty())
            .map(|(id, _)| *id)
            .collect();
        let mut open: BTreeSet<Uuid7> = keys.iter().copied().collect();
        while !open.is_empty() {
            for issue in &keys {
                if !open.contains(issue) {
                    continue;
                }
                match self.assign_one(*issue, total) {
                    Some((event, cost)) => {
                        total = total.saturating_add(cost);
                        self.vol.sent_upto.insert(*issue, event.event_seq);
                        self.counters.events_sent = self.counters.events_sent.saturating_add(1);
                        self.send_event(&event, cost);
                    }
                    None => {
                        open.remove(issue);
                    }
                }
            }
        }
    }

    /// Moves the next pending event of `issue` into the window if it fits,
    /// assigning the next contiguous `event_seq`.
    fn assign_one(&mut self, issue: Uuid7, total: u64) -> Option<(wire::CommandEvent, u64)> {
        let command_window = self.vol.command_window;
        let session_window = self.vol.session_window;
        let rec = self.durable.records.get_mut(&issue)?;
        let next = rec.pending.front()?;
        let event = wire::CommandEvent {
            issue_uuid: issue.to_string(),
            event_seq: rec.last_assigned.saturating_add(1),
            observed_time: Some(timestamp(next.observed_ms)),
            body: Some(next.body.clone()),
        };
        let cost = encoded_len_u64(&event);
        if rec.in_flight_bytes().saturating_add(cost) > command_window
            || total.saturating_add(cost) > session_window
        {
            return None;
        }
        let digest = next.digest;
        rec.pending.pop_front();
        rec.last_assigned = event.event_seq;
        rec.assigned.push_back(AssignedEvent {
            event: event.clone(),
            cost,
            digest,
        });
        Some((event, cost))
    }

    // ---- adversarial modes --------------------------------------------------

    fn maybe_misbehave(&mut self) {
        let Some(kind) = self.config.adversary else {
            return;
        };
        if kind == Adversary::SecondInstance || self.vol.misbehaved {
            return;
        }
        let Link::Active { conn, live, .. } = self.vol.link.clone() else {
            return;
        };
        if !self.rng.chance(self.config.adversary_permille) {
            return;
        }
        let before = self.vol.effects.len();
        let done = match kind {
            Adversary::StaleGeneration => {
                let env = wire::Envelope {
                    session_id: live.session_id.clone(),
                    generation: live.generation.saturating_sub(1),
                    payload: Some(Payload::ClientCapacity(wire::ClientCapacity {
                        running: 0,
                        queued: 0,
                        max_running: self.config.max_running,
                        max_queued: self.config.max_queued,
                    })),
                };
                self.send_item(conn, Item::Binary(env.encode_to_vec()));
                true
            }
            Adversary::MalformedBytes => {
                let n =
                    usize::try_from(self.rng.range_inclusive(1..=MAX_MALFORMED_BYTES)).unwrap_or(1);
                let bytes = self.rng.bytes(n);
                self.send_item(conn, Item::Binary(bytes));
                true
            }
            Adversary::ConflictingDuplicate => match self.vol.last_sent.clone() {
                Some(ev) => match self.conflicting(ev) {
                    Some(bad) => {
                        self.send_payload(Payload::CommandEvent(bad));
                        true
                    }
                    None => false,
                },
                None => false,
            },
            Adversary::WindowOverrun => match self.vol.largest_sent.clone() {
                Some((_, ev)) => {
                    // what the server charges each copy against the window
                    let cost = rvbox_session::event_window_cost(&ev).max(1);
                    let n = self.vol.command_window / cost + 2;
                    if n <= MAX_OVERRUN_FRAMES {
                        for _ in 0..n {
                            self.send_payload(Payload::CommandEvent(ev.clone()));
                        }
                        true
                    } else {
                        false
                    }
                }
                None => false,
            },
            Adversary::SecondInstance => false,
        };
        if done {
            self.vol.misbehaved = true;
            self.counters.misbehaviours = self.counters.misbehaviours.saturating_add(1);
            if let Some(ClientEffect::Send {
                item: Item::Binary(bytes),
                ..
            }) = self.vol.effects.get(before)
            {
                self.vol.misbehaviour = Some((conn, kind, bytes.clone()));
            }
        }
    }

    /// The first frame of a misbehaviour sent since the last call: the
    /// connection, the kind, and the bytes (the world checks the server's
    /// answer once that frame reaches it).
    pub fn take_misbehaviour(&mut self) -> Option<(ConnId, Adversary, Vec<u8>)> {
        self.vol.misbehaviour.take()
    }

    /// The same `(issue, event_seq)` with a different content digest.
    fn conflicting(&mut self, mut ev: wire::CommandEvent) -> Option<wire::CommandEvent> {
        match ev.body.as_mut()? {
            Body::Output(o) => {
                let raw_len = usize::try_from(o.raw_length).ok()?;
                let mut raw = self.rng.bytes(raw_len.max(1));
                if let Some(b) = raw.first_mut() {
                    *b = b.wrapping_add(1);
                }
                let payload = zstd_frame(&raw).ok()?;
                o.stored_length = u32::try_from(payload.len()).ok()?;
                o.raw_length = u32::try_from(raw.len()).ok()?;
                o.payload = payload;
            }
            Body::Lifecycle(l) => l.reason = format!("{} (conflicting duplicate)", l.reason),
            Body::SignalResult(s) => s.reason = format!("{} (conflicting duplicate)", s.reason),
            Body::StdinAck(a) => a.reason = format!("{} (conflicting duplicate)", a.reason),
            _ => return None,
        }
        Some(ev)
    }
}

fn payload_name(p: &Payload) -> &'static str {
    match p {
        Payload::ClientHello(_) => "ClientHello",
        Payload::ServerWelcome(_) => "ServerWelcome",
        Payload::ControlError(_) => "ControlError",
        Payload::Dispatch(_) => "Dispatch",
        Payload::CommandAccepted(_) => "CommandAccepted",
        Payload::ScriptChunk(_) => "ScriptChunk",
        Payload::ScriptUploadStatus(_) => "ScriptUploadStatus",
        Payload::StdinWrite(_) => "StdinWrite",
        Payload::Signal(_) => "Signal",
        Payload::CommandEvent(_) => "CommandEvent",
        Payload::EventAck(_) => "EventAck",
        Payload::ClientCapacity(_) => "ClientCapacity",
        Payload::ReconcileRequest(_) => "ReconcileRequest",
        Payload::ClientSnapshot(_) => "ClientSnapshot",
        Payload::ReconcileResult(_) => "ReconcileResult",
        Payload::PtyOpen(_) => "PtyOpen",
        Payload::PtyOpened(_) => "PtyOpened",
        Payload::PtyInput(_) => "PtyInput",
        Payload::PtyInputAck(_) => "PtyInputAck",
        Payload::PtyResize(_) => "PtyResize",
        Payload::PtyAttach(_) => "PtyAttach",
        Payload::PtyOutput(_) => "PtyOutput",
        Payload::PtyOutputAck(_) => "PtyOutputAck",
        Payload::PtyDetach(_) => "PtyDetach",
        Payload::PtyClose(_) => "PtyClose",
        Payload::PtyClosed(_) => "PtyClosed",
    }
}

/// The client's check of a script source (common.proto
/// `ScriptDescriptor`): a non-empty display name, a size of 1..=10 MiB
/// and a 32-byte SHA-256. Returns the (empty) upload to keep.
fn check_descriptor(d: &wire::ScriptDescriptor) -> Result<ScriptUpload, DomainError> {
    if d.display_basename.is_empty() {
        return Err(
            DomainError::new(Code::InvalidArgument, "the script display name is empty")
                .with_field("spec.script.display_basename"),
        );
    }
    if !(1..=MAX_SCRIPT_BYTES).contains(&d.size_bytes) {
        return Err(DomainError::new(
            Code::InvalidArgument,
            format!(
                "script size {} is not in 1..={MAX_SCRIPT_BYTES}",
                d.size_bytes
            ),
        )
        .with_field("spec.script.size_bytes"));
    }
    let Ok(sha256) = <[u8; 32]>::try_from(d.sha256.as_slice()) else {
        return Err(DomainError::new(
            Code::InvalidArgument,
            format!("script sha256 is {} bytes, not 32", d.sha256.len()),
        )
        .with_field("spec.script.sha256"));
    };
    Ok(ScriptUpload {
        size: d.size_bytes,
        sha256,
        data: Vec::new(),
        committed: false,
    })
}

/// Validates one `ScriptChunk` of a script of `size` bytes (agent.proto
/// `ScriptChunk`) and returns its raw bytes: compression NONE or ZSTD,
/// `stored_length` equal to the payload (checked before decoding),
/// `raw_length` in 1..=256 KiB and equal to the decoded length (zstd is
/// decoded with `raw_length` as its bound), the chunk's SHA-256,
/// `declared_size` equal to the descriptor's, and `offset + raw_length`
/// within it without overflow. Where the chunk lands relative to the
/// prefix is the caller's check.
fn decode_chunk(c: &wire::ScriptChunk, size: u64) -> Result<Vec<u8>, String> {
    let compression =
        wire::Compression::try_from(c.compression).unwrap_or(wire::Compression::Unspecified);
    if compression == wire::Compression::Unspecified {
        return Err(format!("compression value {}", c.compression));
    }
    if usize::try_from(c.stored_length).ok() != Some(c.payload.len()) {
        return Err(format!(
            "stored_length {} but the payload has {} bytes",
            c.stored_length,
            c.payload.len()
        ));
    }
    let raw_length = u64::from(c.raw_length);
    if !(1..=MAX_SCRIPT_CHUNK_BYTES).contains(&raw_length) {
        return Err(format!(
            "raw_length {} is not in 1..={MAX_SCRIPT_CHUNK_BYTES}",
            c.raw_length
        ));
    }
    if c.declared_size != size {
        return Err(format!(
            "declared_size {} differs from the descriptor's {size}",
            c.declared_size
        ));
    }
    if c.offset
        .checked_add(raw_length)
        .is_none_or(|end| end > size)
    {
        return Err(format!(
            "offset {} + raw_length {} passes the declared size {size}",
            c.offset, c.raw_length
        ));
    }
    let raw = match compression {
        wire::Compression::Zstd => {
            let bound = usize::try_from(c.raw_length).map_err(|e| e.to_string())?;
            zstd::bulk::decompress(&c.payload, bound)
                .map_err(|e| format!("the zstd payload does not decode within raw_length: {e}"))?
        }
        _ => c.payload.clone(),
    };
    if to_u64(raw.len()) != raw_length {
        return Err(format!(
            "decodes to {} bytes but raw_length is {}",
            raw.len(),
            c.raw_length
        ));
    }
    if rvbox_segment::sha256(&raw).as_slice() != c.raw_sha256.as_slice() {
        return Err("raw_sha256 does not match the chunk's bytes".into());
    }
    Ok(raw)
}

/// A `ReconcileResult` the client checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CheckedResult {
    terminate: Vec<Uuid7>,
    discard: Vec<Uuid7>,
    /// issue -> (revision, durable_event_seq)
    resume: BTreeMap<Uuid7, (u64, u64)>,
}

/// The client's check of a received result (the same rules as
/// `rvbox_reconcile::check_result`, which is not a dependency of this
/// crate): round, digest, canonical ascending distinct lists, one fate per
/// uuid, revisions from 1.
fn check_result(res: &wire::ReconcileResult, round: u64) -> Result<CheckedResult, String> {
    if res.round != round {
        return Err(format!("answers round {}, expected {round}", res.round));
    }
    let count = res
        .terminate_local_issue_uuids
        .len()
        .saturating_add(res.discard_local_terminal_issue_uuids.len())
        .saturating_add(res.resume.len());
    if count > MAX_RECORDS {
        return Err(format!("{count} entries exceed {MAX_RECORDS}"));
    }
    let mut unsealed = res.clone();
    unsealed.result_digest.clear();
    if res.result_digest.as_slice() != rvbox_segment::sha256(&unsealed.encode_to_vec()).as_slice() {
        return Err("result_digest does not match the result".into());
    }
    let sorted = |list: &str, texts: Vec<&str>| -> Result<Vec<Uuid7>, String> {
        let mut out: Vec<Uuid7> = Vec::with_capacity(texts.len());
        for text in texts {
            let id = Uuid7::parse("reconcile_result.issue_uuid", text)
                .map_err(|e| format!("{list}: {e}"))?;
            if out.last().is_some_and(|prev| *prev >= id) {
                return Err(format!("{list}: {id} is not strictly ascending"));
            }
            out.push(id);
        }
        Ok(out)
    };
    let terminate = sorted(
        "terminate",
        res.terminate_local_issue_uuids
            .iter()
            .map(String::as_str)
            .collect(),
    )?;
    let discard = sorted(
        "discard",
        res.discard_local_terminal_issue_uuids
            .iter()
            .map(String::as_str)
            .collect(),
    )?;
    let resume_ids = sorted(
        "resume",
        res.resume.iter().map(|r| r.issue_uuid.as_str()).collect(),
    )?;
    let mut fates = BTreeSet::new();
    for id in terminate.iter().chain(&discard).chain(&resume_ids) {
        if !fates.insert(*id) {
            return Err(format!("{id} appears in more than one list"));
        }
    }
    let mut resume = BTreeMap::new();
    for (id, row) in resume_ids.into_iter().zip(&res.resume) {
        if row.revision == 0 {
            return Err(format!("resume {id}: revision 0"));
        }
        resume.insert(id, (row.revision, row.durable_event_seq));
    }
    Ok(CheckedResult {
        terminate,
        discard,
        resume,
    })
}
