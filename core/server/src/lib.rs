//! RVBox server core (plan §6.1-§6.4).
//!
//! Owns: the composition of the pure cores for every connection of one
//! server: a [`rvbox_session::Session`] per connection, registration and
//! fencing, reconciliation rounds ([`rvbox_reconcile`]), capacity, dispatch
//! and acceptance ([`rvbox_dispatch`]), event ingest, operator signals and
//! script uploads. It is sans-IO in the session core's shape:
//!
//! ```text
//! input:   core.handle(now_ms, wall_ms, Input)   // a frame, a completion, a control call, a timer
//! output:  core.poll_output() -> Option<Output>  // a frame on a lane, a store operation with a
//!                                                // token, a control answer, a close, an audit record
//! time:    core.poll_timeout() -> Option<u64>    // one monotonic deadline; the shell arms one timer
//! ```
//!
//! Every store read or write is an [`Output::Store`] with an [`OpToken`],
//! answered later by [`Input::Completion`] with the same token (the store
//! port, [`rvbox_store_port::ops`]). Nothing that depends on a write is
//! sent before its completion: the welcome after the registration, a
//! `Dispatch` after `dispatched`, an `EventAck` after the append, the
//! `ReconcileResult` after its decisions. A crash between an operation and
//! its completion, or between a completion and the frame it announces,
//! loses only what the protocol retries.
//!
//! After every [`ServerCore::handle`] the caller drains
//! [`ServerCore::poll_output`] until it returns `None` and performs the
//! outputs in order; there is one output queue and no re-entrant drain.
//!
//! Must never: read a clock or the OS RNG (time comes with every input,
//! randomness from the injected [`Entropy`]), perform I/O, send a frame
//! before the completion it announces, or iterate a `HashMap` into
//! anything observable.

mod accept;
pub mod audit;
mod connections;
mod convert;
mod dispatch;
pub mod fleet;
pub mod ingest;
pub use ingest::GroupPolicy;
pub mod pty;
mod reconcile;
mod registration;
mod signals;
pub mod stdin;
mod timed;
pub mod upload;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use rvbox_dispatch::{ReadyQueue, RetryPolicy};
use rvbox_proto::v1 as wire;
use rvbox_session::SessionConfig;
pub use rvbox_store_port::audit::Caller;
use rvbox_store_port::entropy::Entropy;
use rvbox_store_port::ops::{Completion, OpResult, OpToken, PortError, StoreOp};

pub use connections::{ConnId, WRITER_WINDOW};
pub use convert::{event_append, knowledge, phase_of, state_of, uuid_text};
pub use ingest::{
    GROUP_MAX_BYTES, GROUP_MAX_EVENTS, GROUPS_IN_FLIGHT, INGEST_QUANTUM_BYTES,
    INGEST_QUEUE_PER_CONNECTION, IngestQueue, Queued,
};
pub use pty::{PtyAnswer, PtyPolicy};
pub use reconcile::MAX_STALE_ROUNDS;
pub use signals::signal_plan;

use connections::{ClientState, Conn};

/// Most connections the core tracks.
pub const MAX_CONNECTIONS: usize = 65_536;
/// Most queued commands one dispatch turn looks at for one client.
pub const DISPATCH_SCAN: usize = 64;
/// Most commands one expiry pass handles.
pub const EXPIRY_BATCH: usize = 256;
/// Queue expiry is decided at most this often (the TTL has second
/// resolution; the pass reads an index).
pub const EXPIRY_INTERVAL_MS: u64 = 1_000;
/// A retention and maintenance pass runs this often (plan §5.4: rotation,
/// quota and age eviction, the tombstone FIFO, pending deletions and audit
/// rotation are the maintenance worker's, never the receive path's).
pub const MAINTENANCE_INTERVAL_MS: u64 = 60_000;
/// After an event is refused for a full quota tier, the next maintenance
/// pass runs this soon after the last one: its pressure rotation makes the
/// room the refused client's retry needs (plan §5.4 item 3). Waiting the
/// whole interval let a client whose own active output filled its tier
/// store only a few hundred events a minute, closed at every refusal.
pub const QUOTA_MAINTENANCE_MIN_MS: u64 = 2_000;
/// A slice of the store's background scrub (re-verification of sealed
/// segments, the orphan sweep, the counter recount) is asked for at most
/// this often, and only while no other store operation is in flight: it
/// yields to live traffic.
pub const SCRUB_INTERVAL_MS: u64 = 200;
/// Under constant traffic a slice still goes this long after the last one,
/// so a busy store is still verified.
pub const SCRUB_STARVED_MS: u64 = 2_000;
/// After a slice that found nothing to do, the next is asked for this
/// much later.
pub const SCRUB_IDLE_INTERVAL_MS: u64 = 60_000;
/// Most store operations in flight at once. A connection's own operations
/// are bounded by its session windows; this bounds them all, and an input
/// that would need more closes its connection (`INGRESS_OVERLOAD`)
/// instead of queueing without limit.
pub const MAX_PENDING_OPS: usize = 1 << 20;

/// Identifies one control call until its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A control-plane call the core answers.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlCall {
    /// `RunCommand` (plan §9.1), idempotent by `request_id`.
    RunCommand(wire::RunCommandRequest),
    /// `SignalCommand` (plan §6.4, R-6.4-35..38), idempotent by
    /// `request_id`.
    SignalCommand(wire::SignalCommandRequest),
    /// `RepairStorageIncident` (plan §5.4, §9.1), idempotent by
    /// `request_id`.
    RepairStorageIncident(wire::RepairStorageIncidentRequest),
    /// `AcknowledgeStorageIncident` (plan §5.4, §9.1), idempotent by
    /// `request_id`.
    AcknowledgeStorageIncident(wire::AcknowledgeStorageIncidentRequest),
    /// `AuthorizeClientTakeover` (plan §6.2), idempotent by `request_id`.
    AuthorizeClientTakeover(wire::AuthorizeClientTakeoverRequest),
    /// `AppendStdin` (plan §9.1), idempotent by `request_id`.
    AppendStdin(wire::AppendStdinRequest),
    /// `CloseStdin` (plan §9.1), idempotent by `request_id`.
    CloseStdin(wire::CloseStdinRequest),
    /// `RunFleet`, idempotent by `request_id`.
    RunFleet(wire::RunFleetRequest),
    /// `SignalFleetRun`, `CancelFleetRun`, `PauseFleetRun` or
    /// `ResumeFleetRun`, idempotent by `request_id`.
    FleetAction(rvbox_store_port::fleet::FleetAction),
    /// `OpenPtySession`, `WritePtyInput`, `ResizePtySession` or
    /// `ClosePtySession`, idempotent by `request_id`.
    Pty(rvbox_store_port::pty::PtyMutation),
    /// A viewer attached to a terminal (`AttachPtySession`) or left it:
    /// audited, answered at once.
    PtyViewer {
        /// The terminal.
        pty_session_id: String,
        /// The terminal's client.
        client_id: String,
        /// Attached (true) or detached.
        attach: bool,
        /// The output offset the viewer asked from (attach) or had
        /// reached (detach).
        offset: u64,
    },
}

/// The answer to a [`ControlCall`].
#[derive(Debug, Clone, PartialEq)]
pub enum ControlAnswer {
    /// `RunCommand`.
    RunCommand(Result<wire::RunCommandResponse, PortError>),
    /// `SignalCommand`.
    SignalCommand(Result<wire::SignalCommandResponse, PortError>),
    /// `RepairStorageIncident`: the incident, now repaired.
    RepairStorageIncident(Result<wire::RepairStorageIncidentResponse, PortError>),
    /// `AcknowledgeStorageIncident`: the incident, now acknowledged.
    AcknowledgeStorageIncident(Result<wire::AcknowledgeStorageIncidentResponse, PortError>),
    /// `AuthorizeClientTakeover`: the one-shot grant.
    AuthorizeClientTakeover(Result<wire::AuthorizeClientTakeoverResponse, PortError>),
    /// `AppendStdin`: the writes assigned, durable.
    AppendStdin(Result<wire::AppendStdinResponse, PortError>),
    /// `CloseStdin`: the close write assigned, durable.
    CloseStdin(Result<wire::CloseStdinResponse, PortError>),
    /// A fleet mutation: its answer, durable.
    Fleet(Result<Box<rvbox_store_port::fleet::FleetAnswer>, PortError>),
    /// A terminal mutation: its answer, durable.
    Pty(Result<Box<PtyAnswer>, PortError>),
}

/// Something that happened, for the core to handle.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A new connection (after the WebSocket upgrade).
    Connected {
        /// Connection.
        conn: ConnId,
    },
    /// A complete binary WebSocket message.
    Frame {
        /// Connection.
        conn: ConnId,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// A WebSocket Pong.
    Pong {
        /// Connection.
        conn: ConnId,
    },
    /// A WebSocket Ping from the client: answered with [`Output::Pong`]
    /// on the control lane.
    Ping {
        /// Connection.
        conn: ConnId,
    },
    /// The peer closed, or the transport failed.
    Disconnected {
        /// Connection.
        conn: ConnId,
    },
    /// The connection's writer could not queue a frame: its data lane is
    /// full (a slow reader) or its control lane is.
    LaneFull {
        /// Connection.
        conn: ConnId,
        /// Whether the control lane was full (session-fatal).
        control: bool,
    },
    /// The persistence queue of the connection is full: the shell could
    /// not take a delivered event.
    IngressQueueFull {
        /// Connection.
        conn: ConnId,
    },
    /// The connection's writer wrote one frame it was given (an
    /// [`Output::Frame`] or [`Output::Ping`]): room for the next.
    Written {
        /// Connection.
        conn: ConnId,
    },
    /// A store operation finished.
    Completion {
        /// The operation's token.
        token: OpToken,
        /// Its outcome.
        result: OpResult,
    },
    /// A control-plane call.
    Control {
        /// Identifies the answer.
        request: RequestId,
        /// Who called (transport and principal), audited with the effect.
        caller: Caller,
        /// The call.
        call: ControlCall,
    },
    /// The timer armed at [`ServerCore::poll_timeout`] fired (or any
    /// wake-up: handling it early is harmless).
    Timeout,
    /// The single-runner duties this server now holds (on one box all of
    /// them, which is also the start; on several replicas, those whose
    /// lease it holds: docs/scaleout.md).
    Duties {
        /// The duties held.
        held: Vec<rvbox_store_port::replica::Duty>,
    },
    /// Whether this server serves clients: a replica whose lease ended
    /// stops until it has joined again (`SERVICE_RESTART` to every connection, new ones refused, no duty).
    Serving {
        /// Serving.
        serving: bool,
    },
    /// Another replica wrote work for `client` (a command, or with
    /// `issue` a signal or stdin of that command): if this server holds
    /// the client's connection it looks for the work at once
    /// (docs/scaleout.md). Harmless when nothing is new.
    Wake {
        /// The client.
        client: String,
        /// The command whose signal or stdin is new.
        issue: Option<[u8; 16]>,
    },
    /// Wake-ups may have been missed (the listener reconnected, or the
    /// periodic poll): every connected client looks for its work, and a
    /// release pass goes if this server holds the pump duty.
    WakeAll,
    /// A fleet run may release now (one was created or resumed, or a late
    /// target joined, on another replica): if this server holds the pump
    /// duty, a release pass goes at once.
    FleetWake,
    /// The TLS proxy verified connection `conn`'s client certificate, which
    /// names `client_id` (`server.client_identity = "tls-client-cert"`):
    /// its hello must claim exactly that client. Handed right after
    /// [`Input::Connected`].
    Certified {
        /// Connection.
        conn: ConnId,
        /// The certificate's client id (its subject's CN).
        client_id: String,
    },
    /// Audit records no store effect carries, from the edges: an
    /// operator's reads and requests refused before they reached the store
    /// (`caller` set), agent upgrades refused (`caller` unset). Written
    /// within their rate limits (the operator bucket is larger).
    Audit(Vec<rvbox_store_port::audit::SessionAudit>),
}

/// Something the caller must do, in order.
// The queue is drained after every input, so it stays short; boxing the
// store operation would cost an allocation per operation instead.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send this binary WebSocket message (an encoded envelope).
    Frame {
        /// Connection.
        conn: ConnId,
        /// Control or data lane (the writer drains control first).
        control: bool,
        /// The encoded envelope.
        bytes: Vec<u8>,
    },
    /// Send a WebSocket Ping.
    Ping {
        /// Connection.
        conn: ConnId,
    },
    /// Send a WebSocket Pong (the answer to the client's Ping).
    Pong {
        /// Connection.
        conn: ConnId,
    },
    /// Close the connection with this reason (the core has forgotten it).
    Close {
        /// Connection.
        conn: ConnId,
        /// Why.
        reason: wire::CloseReason,
    },
    /// Perform this store operation; answer with [`Input::Completion`]
    /// carrying `token`.
    Store {
        /// The token of the completion.
        token: OpToken,
        /// Wall-clock time of the decision (ms), for the rows it writes.
        wall_ms: i64,
        /// The operation.
        op: StoreOp,
    },
    /// The answer to a control call.
    Reply {
        /// The call.
        request: RequestId,
        /// The answer.
        answer: ControlAnswer,
    },
    /// A session audit record.
    Audit {
        /// Connection.
        conn: ConnId,
        /// Client id, once known.
        client: Option<String>,
        /// The record.
        audit: rvbox_session::Audit,
    },
    /// A session counter increment.
    Metric(rvbox_session::Metric),
}

/// What the core counts (bounded names; the shell exports them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Dispatch waits not kept because [`MAX_DISPATCH_WAITS`] were
    /// waiting to be taken.
    pub dispatch_waits_dropped: u64,
    /// Registrations accepted.
    pub registered: u64,
    /// Live-conflict rejections.
    pub live_conflicts: u64,
    /// Sessions fenced by a newer one.
    pub fenced: u64,
    /// Connections closed because the store refused a write made for
    /// them: their session was no longer live (a newer one replaced it,
    /// on this server or another replica).
    pub writes_fenced: u64,
    /// Wake-ups from other replicas for a client connected here.
    pub wakeups: u64,
    /// Reconciliation rounds written.
    pub reconciled: u64,
    /// Reconciliation snapshots refused (invalid, or client store not ready).
    pub reconcile_refused: u64,
    /// Commands kept by a reconciliation round whose client had events
    /// acknowledged that the store no longer holds (recorded as lost).
    pub events_lost_at_reconcile: u64,
    /// Dispatch frames sent.
    pub dispatched: u64,
    /// Positive acceptances applied.
    pub accepted: u64,
    /// Acceptances that arrived after the queue expiry (terminated).
    pub late_acceptances: u64,
    /// Transient rejections (requeued with backoff).
    pub requeued: u64,
    /// Permanent rejections.
    pub rejected: u64,
    /// `ALREADY_EXECUTED` answers: commands ended `interrupted` because
    /// their client had run them before (a server store older than the
    /// client's).
    pub already_executed: u64,
    /// Commands expired by the server.
    pub expired: u64,
    /// Events made durable.
    pub events_durable: u64,
    /// Events refused by the store.
    pub events_refused: u64,
    /// Decisions refused by the store's compare-and-set (stale view).
    pub stale_decisions: u64,
    /// `SignalCommand` requests answered (fresh or replayed).
    pub signals: u64,
    /// Storage incidents an operator repaired or acknowledged.
    pub incidents_resolved: u64,
    /// Takeover grants an operator created (fresh or replayed).
    pub takeovers_authorized: u64,
    /// Pending signals queued again after an acceptance or a
    /// reconciliation.
    pub signals_sent_again: u64,
    /// `AppendStdin` and `CloseStdin` requests answered (fresh or
    /// replayed).
    pub stdin_mutations: u64,
    /// Stdin writes sent (again after a reconnect included).
    pub stdin_writes_sent: u64,
    /// Stdin acknowledgements made durable.
    pub stdin_acks: u64,
    /// Pending stdin reads that failed (the connection closed; the writes
    /// go after the client reconnects).
    pub stdin_failures: u64,
    /// Script uploads started (after an acceptance or a reconciliation).
    pub script_uploads: u64,
    /// Script chunks sent.
    pub script_chunks: u64,
    /// Script uploads the client committed.
    pub scripts_committed: u64,
    /// Script uploads the client refused, or ended for a command that
    /// launched or ended meanwhile.
    pub scripts_refused: u64,
    /// Script reads that failed (the connection closed; the upload resumes
    /// after the client reconnects).
    pub script_upload_failures: u64,
    /// Store operations that failed (not refusals).
    pub store_failures: u64,
    /// Completions whose token the core did not issue, or that did not
    /// match the operation (counted, never trusted).
    pub foreign_completions: u64,
    /// Randomness the injected source could not give.
    pub entropy_failures: u64,
    /// Connections closed because their persistence queue was full.
    pub ingest_queue_full: u64,
    /// Times the ingress gate closed or opened.
    pub gate_changes: u64,
    /// Maintenance passes completed.
    pub maintenance_passes: u64,
    /// Maintenance passes brought forward by a quota refusal.
    pub maintenance_hastened: u64,
    /// Background scrub slices completed.
    pub scrub_slices: u64,
    /// Segments the background scrub read back and checked.
    pub scrub_segments_verified: u64,
    /// Whole commands evicted by maintenance (quota or age).
    pub evicted: u64,
    /// Idle clients maintenance deleted.
    pub clients_pruned: u64,
    /// Audit records maintenance moved from the outbox to segments.
    pub audits_flushed: u64,
    /// Session audit records without an effect, written.
    pub audits_written: u64,
    /// Session audit records without an effect, suppressed by the rate
    /// limit.
    pub audits_suppressed: u64,
    /// Output rotations applied by maintenance.
    pub rotations: u64,
    /// Reconciliation rounds started again because their decisions met
    /// rows that had changed since the request.
    pub rounds_restarted: u64,
    /// Sessions closed because their control lane was full.
    pub control_lane_full: u64,
    /// Data frames refused by a full data lane after the room check (never
    /// expected).
    pub data_lane_full: u64,
    /// Data messages that waited for room on a full data lane.
    pub data_lane_waits: u64,
    /// Fleet release passes completed.
    pub fleet_passes: u64,
    /// Fleet targets released (their commands created).
    pub fleet_released: u64,
    /// Terminal mutations answered (fresh or replayed).
    pub pty_mutations: u64,
    /// Terminal reports of clients recorded.
    pub pty_reports: u64,
    /// Terminal output that did not continue the recording (attached
    /// again from the recorded end).
    pub pty_gaps: u64,
    /// Terminal reports refused as protocol errors.
    pub pty_refused: u64,
    /// Terminal reads or groups that failed.
    pub pty_failures: u64,
    /// Terminal sync reads completed.
    pub pty_syncs: u64,
    /// Terminal input frames sent.
    pub pty_inputs_sent: u64,
    /// Clients whose idle terminals an idle pass closed.
    pub pty_idle_closed: u64,
    /// Connections closed because their terminal reports exceeded the
    /// queue bound.
    pub pty_queue_full: u64,
}

/// What the core waits for, by token.
#[derive(Debug)]
enum Pending {
    Registration(registration::Pending),
    Reconcile(reconcile::Pending),
    Dispatch(dispatch::Pending),
    Accept(accept::Pending),
    Ingest(ingest::Pending),
    Signal(signals::Pending),
    Upload(upload::Pending),
    Stdin(stdin::Pending),
    Fleet(fleet::Pending),
    Pty(pty::Pending),
    /// An operator's takeover grant.
    Takeover {
        request: RequestId,
    },
    /// An operator's incident repair or acknowledgement.
    Incident {
        request: RequestId,
        acknowledge: bool,
    },
    /// A write whose outcome changes nothing but a log line and a counter.
    Background(&'static str),
    /// A maintenance pass.
    Maintenance,
    /// A slice of the background scrub.
    Scrub,
}

impl Pending {
    /// The connection a fenced write was made for.
    fn fenced_conn(&self) -> Option<ConnId> {
        match self {
            Self::Accept(accept::Pending::Write { conn, .. })
            | Self::Dispatch(dispatch::Pending::Dispatch { conn, .. })
            | Self::Reconcile(reconcile::Pending::Apply { conn, .. })
            | Self::Pty(pty::Pending::Apply { conn, .. }) => Some(*conn),
            _ => None,
        }
    }
}

/// Most dispatch waits kept until [`ServerCore::take_dispatch_waits`].
pub const MAX_DISPATCH_WAITS: usize = 4096;

/// The server core (see the crate docs).
#[derive(Debug)]
pub struct ServerCore {
    entropy: Arc<dyn Entropy>,
    config: SessionConfig,
    retry: RetryPolicy,
    /// Boxed: a map node then holds pointers, not eleven whole
    /// connections (most of which would be empty slots).
    conns: timed::Timed<ConnId, Box<Conn>, u64>,
    clients: timed::Timed<String, ClientState, i64>,
    ready: ReadyQueue<String>,
    out: VecDeque<Output>,
    pending: BTreeMap<OpToken, Pending>,
    next_token: u64,
    /// Connections whose session has effects to drain.
    dirty: BTreeSet<ConnId>,
    /// Events waiting for an append group (plan §6.1 persistence fairness).
    ingest: ingest::IngestQueue,
    /// The server-wide 64 MiB / 32 MiB ingress admission gate.
    gate: rvbox_session::IngressGate,
    /// Append groups with the store.
    groups_in_flight: usize,
    /// When an append group is issued.
    group_policy: ingest::GroupPolicy,
    /// Lifetime of an operator's takeover grant.
    takeover_ttl_ms: u64,
    /// When the oldest queued event arrived (monotonic), while any is
    /// queued.
    ingest_since: Option<u64>,
    /// Commands whose acceptance is being read or written: their events
    /// wait, so the store sees them in the order the client sent them.
    barrier: BTreeSet<rvbox_domain::ids::Uuid7>,
    stats: EngineStats,
    /// How long each command dispatched since the last
    /// [`ServerCore::take_dispatch_waits`] waited from its creation (wall
    /// ms), at most [`MAX_DISPATCH_WAITS`]; more are counted in
    /// [`EngineStats::dispatch_waits_dropped`].
    dispatch_waits: Vec<u64>,
    /// The rate limit of session audit records without an effect.
    audits: audit::AuditLimiter,
    /// The rate limit of operator records (reads, edge refusals).
    operator_audits: audit::AuditLimiter,
    /// Monotonic time of the last queue-expiry pass.
    last_expiry_ms: Option<u64>,
    /// The single-runner duties this server runs: all of them on one box;
    /// on several replicas, those whose lease it holds (docs/scaleout.md).
    duties: std::collections::BTreeSet<rvbox_store_port::replica::Duty>,
    /// Whether clients are served: false while a replica's lease is lost.
    serving: bool,
    /// An expiry read is in flight.
    expiry_running: bool,
    /// Monotonic time of the last maintenance pass.
    last_maintenance_ms: Option<u64>,
    /// A maintenance pass is in flight.
    maintenance_running: bool,
    /// An event was refused for quota since the last pass began: the next
    /// pass comes after [`QUOTA_MAINTENANCE_MIN_MS`].
    maintenance_asked: bool,
    /// Monotonic time of the last scrub slice asked for.
    last_scrub_ms: Option<u64>,
    /// The earliest monotonic time of the next scrub slice.
    next_scrub_ms: u64,
    /// A scrub slice is in flight.
    scrub_running: bool,
    /// The fleet runs as the core sees them (the release pump).
    fleet: fleet::FleetState,
    /// The terminal policy (`terminals.*`).
    pty_policy: PtyPolicy,
    /// An idle pass is in flight.
    pty_idle_running: bool,
    /// Monotonic time of the last idle pass.
    last_pty_idle_ms: Option<u64>,
    now_ms: u64,
    wall_ms: i64,
}

impl ServerCore {
    /// A core for a server whose store has recovered.
    #[must_use]
    pub fn new(entropy: Arc<dyn Entropy>, config: SessionConfig, retry: RetryPolicy) -> Self {
        Self {
            entropy,
            config,
            retry,
            conns: timed::Timed::new(|c| c.session.poll_timeout()),
            clients: timed::Timed::new(|s| s.wake_wall_ms),
            ready: ReadyQueue::new(),
            out: VecDeque::new(),
            pending: BTreeMap::new(),
            next_token: 1,
            dirty: BTreeSet::new(),
            ingest: ingest::IngestQueue::default(),
            gate: rvbox_session::IngressGate::default(),
            groups_in_flight: 0,
            group_policy: ingest::GroupPolicy::default(),
            takeover_ttl_ms: rvbox_domain::limits::DEFAULT_TAKEOVER_GRANT_TTL_MS,
            ingest_since: None,
            barrier: BTreeSet::new(),
            stats: EngineStats::default(),
            dispatch_waits: Vec::new(),
            audits: audit::AuditLimiter::default(),
            operator_audits: audit::AuditLimiter::operator(),
            last_expiry_ms: None,
            duties: rvbox_store_port::replica::Duty::ALL.into_iter().collect(),
            serving: true,
            expiry_running: false,
            last_maintenance_ms: None,
            maintenance_running: false,
            maintenance_asked: false,
            last_scrub_ms: None,
            next_scrub_ms: 0,
            scrub_running: false,
            fleet: fleet::FleetState::default(),
            pty_policy: PtyPolicy::default(),
            pty_idle_running: false,
            last_pty_idle_ms: None,
            now_ms: 0,
            wall_ms: 0,
        }
    }

    /// Sets the lifetime of an operator's takeover grant
    /// (`session.takeover_grant_ttl`).
    pub fn set_takeover_ttl(&mut self, ttl_ms: u64) {
        self.takeover_ttl_ms = ttl_ms.max(1);
    }

    /// Sets when append groups are issued (see [`ingest::GroupPolicy`]).
    pub fn set_group_policy(&mut self, policy: ingest::GroupPolicy) {
        self.group_policy = policy;
    }

    /// Writes edge audit records within their rate limits, in one store
    /// operation.
    fn edge_audits(&mut self, records: Vec<rvbox_store_port::audit::SessionAudit>) {
        let mut admitted = Vec::with_capacity(records.len());
        for r in records {
            let limiter = if r.caller.is_some() {
                &mut self.operator_audits
            } else {
                &mut self.audits
            };
            let out = limiter.admit_record(self.now_ms, r);
            if out.is_empty() {
                self.stats.audits_suppressed += 1;
            } else {
                self.stats.audits_written += 1;
                admitted.extend(out);
            }
        }
        if !admitted.is_empty() {
            self.store(StoreOp::Audit(admitted), Pending::Background("edge audit"));
        }
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// How long each command first dispatched since the last call waited
    /// from its creation to its dispatch being durable (wall ms; the
    /// dispatch latency of plan §11.1), oldest first.
    pub fn take_dispatch_waits(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.dispatch_waits)
    }

    /// Connections currently open.
    #[must_use]
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Clients with dispatch state (at most one per open connection).
    #[must_use]
    pub fn tracked_clients(&self) -> usize {
        self.clients.len()
    }

    /// Store operations issued and not yet completed.
    #[must_use]
    pub fn pending_ops(&self) -> usize {
        self.pending.len()
    }

    /// The next output to perform, in order.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// Sets the single-runner duties this server runs (by default all of
    /// them). A duty it does not hold is never started here: its timer
    /// neither fires nor wakes the core. One already running finishes.
    fn set_duties(&mut self, held: &[rvbox_store_port::replica::Duty]) {
        // a replica that stopped serving takes no duty back, whatever a
        // late lease renewal says
        let held: std::collections::BTreeSet<_> = if self.serving {
            held.iter().copied().collect()
        } else {
            std::collections::BTreeSet::new()
        };
        if held != self.duties {
            if held.contains(&rvbox_store_port::replica::Duty::FleetPump)
                && !self
                    .duties
                    .contains(&rvbox_store_port::replica::Duty::FleetPump)
            {
                // runs another replica pumped may be live
                self.fleet_wake();
            }
            tracing::info!(
                duties = ?held.iter().map(|d| d.name()).collect::<Vec<_>>(),
                "single-runner duties changed"
            );
            self.duties = held;
        }
    }

    /// Whether this server serves clients. A replica whose lease ended
    /// (docs/scaleout.md) stops: every connection closes with
    /// `SERVICE_RESTART` (its clients reconnect, through nginx, to another
    /// replica) and new ones are refused, until it has joined again. It
    /// runs no duty meanwhile.
    fn set_serving(&mut self, serving: bool) {
        if serving == self.serving {
            return;
        }
        self.serving = serving;
        if serving {
            tracing::info!("serving clients again");
            return;
        }
        self.duties.clear();
        let conns: Vec<ConnId> = self.conns.keys().copied().collect();
        tracing::error!(
            connections = conns.len(),
            "the replica lease is lost: closing every connection and running no duty"
        );
        for conn in conns {
            self.close(conn, wire::CloseReason::ServiceRestart);
        }
    }

    /// Work written elsewhere for `client` (see [`Input::Wake`]).
    fn wake(&mut self, client: &str, issue: Option<[u8; 16]>) {
        let Some(conn) = self.clients.get(client).and_then(|st| st.conn) else {
            return;
        };
        self.stats.wakeups += 1;
        self.mark_ready(client);
        self.pty_sync(conn);
        if let Some(issue) = issue {
            self.store(
                StoreOp::PendingSignals {
                    issues: vec![issue],
                },
                Pending::Signal(crate::signals::Pending::Resend { conn }),
            );
            if let Ok(id) = rvbox_domain::ids::Uuid7::from_bytes("issue_uuid", issue) {
                self.wake_stdin(conn, id);
            }
        }
    }

    /// Every connected client looks for its work (see [`Input::WakeAll`]).
    fn wake_all(&mut self) {
        let ready: Vec<String> = self
            .clients
            .iter()
            .filter(|(_, st)| st.conn.is_some())
            .map(|(c, _)| c.clone())
            .collect();
        for client in &ready {
            self.mark_ready(client);
        }
        self.fleet_wake();
    }

    /// A run may be live that this server has not seen: the next release
    /// pass goes at once, and a pass already in flight (which may have read
    /// before that run committed) cannot say that none is.
    fn fleet_wake(&mut self) {
        self.fleet.live = true;
        self.fleet.more = true;
        self.fleet.epoch += 1;
    }

    /// Whether this server runs `duty`.
    #[must_use]
    pub fn runs(&self, duty: rvbox_store_port::replica::Duty) -> bool {
        self.duties.contains(&duty)
    }

    /// The earliest monotonic deadline: a session timer, the next queue
    /// expiry pass, or the end of a dispatch backoff.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        use rvbox_store_port::replica::Duty;
        let sessions = self.conns.earliest();
        let expiry = if self.expiry_running || !self.runs(Duty::Expiry) {
            None
        } else {
            Some(
                self.last_expiry_ms
                    .map_or(self.now_ms, |t| t.saturating_add(EXPIRY_INTERVAL_MS)),
            )
        };
        let wake = self.clients.earliest().map(|w| {
            let wait = u64::try_from(w.saturating_sub(self.wall_ms)).unwrap_or(0);
            self.now_ms.saturating_add(wait)
        });
        let maintenance = if self.maintenance_running || !self.runs(Duty::Maintenance) {
            None
        } else {
            Some(self.last_maintenance_ms.map_or(self.now_ms, |t| {
                t.saturating_add(self.maintenance_interval())
            }))
        };
        let group = self.group_due_at();
        let scrub = (!self.scrub_running && self.runs(Duty::Scrub)).then(|| self.scrub_due_at());
        let fleet = self
            .fleet
            .due_at(self.now_ms)
            .filter(|_| self.runs(Duty::FleetPump));
        let idle = self.pty_idle_due().filter(|_| self.runs(Duty::Maintenance));
        [
            sessions,
            expiry,
            wake,
            maintenance,
            group,
            scrub,
            fleet,
            idle,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Handles one input at monotonic `now_ms` and wall-clock `wall_ms`.
    /// A `now_ms` earlier than a previous one is taken as the previous one.
    pub fn handle(&mut self, now_ms: u64, wall_ms: i64, input: Input) {
        self.now_ms = now_ms.max(self.now_ms);
        self.wall_ms = wall_ms;
        match input {
            Input::Connected { conn } => self.connect(conn),
            Input::Frame { conn, bytes } => {
                self.session_input(conn, rvbox_session::Input::Binary(bytes));
            }
            Input::Pong { conn } => self.session_input(conn, rvbox_session::Input::Pong),
            Input::Ping { conn } => self.ping(conn),
            Input::Disconnected { conn } => self.disconnected(conn),
            Input::LaneFull { conn, control } => {
                let input = if control {
                    rvbox_session::Input::ControlLaneFull
                } else {
                    // a reader too slow for its data lane: the session is
                    // closed rather than buffered without limit
                    rvbox_session::Input::IngressQueueFull
                };
                self.session_input(conn, input);
            }
            Input::IngressQueueFull { conn } => {
                self.session_input(conn, rvbox_session::Input::IngressQueueFull);
            }
            Input::Written { conn } => self.written(conn),
            Input::Completion { token, result } => self.complete(token, result),
            Input::Control {
                request,
                caller,
                call,
            } => self.control(request, caller, call),
            Input::Timeout => self.timeout(),
            Input::Duties { held } => self.set_duties(&held),
            Input::Serving { serving } => self.set_serving(serving),
            Input::Wake { client, issue } => self.wake(&client, issue),
            Input::WakeAll => self.wake_all(),
            Input::FleetWake => self.fleet_wake(),
            Input::Audit(records) => self.edge_audits(records),
            Input::Certified { conn, client_id } => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.session.set_certified(client_id);
                }
            }
        }
        // every session effect the input caused, then a fair dispatch turn
        // for each client that became ready (a turn only issues reads), and
        // the next append groups
        self.drain_sessions();
        self.dispatch_pass();
        self.pump_ingest();
        self.drain_sessions();
        // the deadlines the input moved, indexed for the next poll_timeout
        self.conns.refresh();
        self.clients.refresh();
        #[cfg(debug_assertions)]
        self.check_invariants();
    }

    /// The core's own invariants, asserted after every input in debug
    /// builds (the simulator's `cargo test` batch runs them), so a seed
    /// that breaks one fails at the cause.
    #[cfg(debug_assertions)]
    fn check_invariants(&self) {
        debug_assert!(self.pending.len() <= MAX_PENDING_OPS);
        debug_assert!(self.groups_in_flight <= ingest::GROUPS_IN_FLIGHT);
        debug_assert!(self.dirty.is_empty(), "every session effect was performed");
        debug_assert!(self.clients.len() <= self.conns.len());
        debug_assert_eq!(
            self.conns.earliest(),
            self.conns
                .values()
                .filter_map(|c| c.session.poll_timeout())
                .min(),
            "the deadline index agrees with every session"
        );
        debug_assert_eq!(
            self.clients.earliest(),
            self.clients.values().filter_map(|s| s.wake_wall_ms).min(),
            "the backoff index agrees with every client"
        );
        for (client, st) in self.clients.iter() {
            let live = st.conn.and_then(|c| self.conns.get(&c));
            debug_assert!(
                live.is_some_and(|c| c.client.as_deref() == Some(client.as_str())),
                "a client's dispatch state belongs to its live connection"
            );
            debug_assert!(
                st.in_flight.keys().all(|i| st.capacity.holds(*i)),
                "a command in flight holds its capacity slot"
            );
        }
        for c in self.conns.values() {
            debug_assert!(c.writer_credit <= connections::WRITER_WINDOW);
            debug_assert!(c.uploads.in_flight() <= upload::SCRIPT_SESSION_WINDOW_BYTES);
        }
        let ingest_groups = self
            .pending
            .values()
            .filter(|p| matches!(p, Pending::Ingest(_)))
            .count();
        debug_assert_eq!(ingest_groups, self.groups_in_flight);
    }

    /// Replaces the ingress gate's watermarks (plan §4.3 defaults
    /// 64 MiB / 32 MiB).
    ///
    /// # Errors
    /// Unless `low < high`.
    pub fn set_ingress_watermarks(
        &mut self,
        high: u64,
        low: u64,
    ) -> Result<(), rvbox_session::GateConfigError> {
        self.gate = rvbox_session::IngressGate::new(high, low)?;
        Ok(())
    }

    /// Event bytes admitted and not yet durable, and whether new output is
    /// admitted.
    #[must_use]
    pub fn ingress(&self) -> (u64, bool) {
        (self.gate.level(), self.gate.is_open())
    }

    fn timeout(&mut self) {
        use rvbox_store_port::replica::Duty;
        let now = self.now_ms;
        let due: Vec<ConnId> = self.conns.due(now);
        for conn in due {
            self.session_input(conn, rvbox_session::Input::Timeout);
        }
        if !self.expiry_running
            && self.runs(Duty::Expiry)
            && self
                .last_expiry_ms
                .is_none_or(|t| now >= t.saturating_add(EXPIRY_INTERVAL_MS))
        {
            self.last_expiry_ms = Some(now);
            self.expiry_running = true;
            self.store(
                StoreOp::ExpiryDue {
                    limit: EXPIRY_BATCH,
                },
                Pending::Dispatch(dispatch::Pending::ExpiryDue),
            );
        }
        if !self.maintenance_running
            && self.runs(Duty::Maintenance)
            && self
                .last_maintenance_ms
                .is_none_or(|t| now >= t.saturating_add(self.maintenance_interval()))
        {
            if self.maintenance_asked {
                self.stats.maintenance_hastened += 1;
                tracing::info!("maintenance pass brought forward by a quota refusal");
            }
            self.maintenance_asked = false;
            self.last_maintenance_ms = Some(now);
            self.maintenance_running = self.store(StoreOp::Maintain, Pending::Maintenance);
        }
        if !self.scrub_running && self.runs(Duty::Scrub) && now >= self.scrub_due_at() {
            self.last_scrub_ms = Some(now);
            self.scrub_running = self.store(StoreOp::Scrub, Pending::Scrub);
        }
        if self.runs(Duty::FleetPump) {
            self.fleet_timeout();
        }
        if self.runs(Duty::Maintenance) {
            self.pty_idle_pass();
        }
        self.wake_backoffs();
    }

    /// How long after the last maintenance pass the next is due.
    fn maintenance_interval(&self) -> u64 {
        if self.maintenance_asked {
            QUOTA_MAINTENANCE_MIN_MS
        } else {
            MAINTENANCE_INTERVAL_MS
        }
    }

    fn control(&mut self, request: RequestId, caller: Caller, call: ControlCall) {
        match call {
            ControlCall::RunCommand(req) => {
                let client = req.client_id.clone();
                self.store(
                    StoreOp::RunCommand {
                        request: req,
                        caller,
                    },
                    Pending::Dispatch(dispatch::Pending::RunCommand { request, client }),
                );
            }
            ControlCall::SignalCommand(req) => {
                self.store(
                    StoreOp::SignalCommand {
                        request: req,
                        caller,
                    },
                    Pending::Signal(signals::Pending::Command { request }),
                );
            }
            ControlCall::RepairStorageIncident(req) => {
                self.store(
                    StoreOp::RepairIncident {
                        request: req,
                        caller,
                    },
                    Pending::Incident {
                        request,
                        acknowledge: false,
                    },
                );
            }
            ControlCall::AuthorizeClientTakeover(req) => {
                self.store(
                    StoreOp::AuthorizeTakeover {
                        request: req,
                        caller,
                        ttl_ms: self.takeover_ttl_ms,
                    },
                    Pending::Takeover { request },
                );
            }
            ControlCall::AppendStdin(req) => {
                self.store(
                    StoreOp::AppendStdin {
                        request: req,
                        caller,
                    },
                    Pending::Stdin(stdin::Pending::Mutation {
                        request,
                        close: false,
                    }),
                );
            }
            ControlCall::CloseStdin(req) => {
                self.store(
                    StoreOp::CloseStdin {
                        request: req,
                        caller,
                    },
                    Pending::Stdin(stdin::Pending::Mutation {
                        request,
                        close: true,
                    }),
                );
            }
            ControlCall::RunFleet(req) => {
                self.store(
                    StoreOp::RunFleet {
                        request: req,
                        caller,
                    },
                    Pending::Fleet(fleet::Pending::Mutation { request }),
                );
            }
            ControlCall::FleetAction(action) => {
                self.store(
                    StoreOp::FleetAction { action, caller },
                    Pending::Fleet(fleet::Pending::Mutation { request }),
                );
            }
            ControlCall::Pty(mutation) => self.pty_mutation(request, caller, mutation),
            ControlCall::PtyViewer {
                pty_session_id,
                client_id,
                attach,
                offset,
            } => self.pty_viewer(request, &caller, &pty_session_id, client_id, attach, offset),
            ControlCall::AcknowledgeStorageIncident(req) => {
                self.store(
                    StoreOp::AcknowledgeIncident {
                        request: req,
                        caller,
                    },
                    Pending::Incident {
                        request,
                        acknowledge: true,
                    },
                );
            }
        }
    }

    /// An incident repaired or acknowledged: the answer, and every
    /// connected client looked at again for work (a cleared scope may
    /// have been holding its dispatch).
    fn incident_done(&mut self, request: RequestId, acknowledge: bool, result: OpResult) {
        let incident = match result {
            Ok(Completion::Incident(i)) => Ok(*i),
            Ok(_) => {
                self.mismatch("incident");
                Err(PortError::Unavailable(
                    "completion does not match the incident operation".into(),
                ))
            }
            Err(e) => Err(e),
        };
        if let Ok(i) = &incident {
            tracing::info!(
                incident_id = %i.incident_id,
                state = i.state,
                acknowledge,
                "storage incident resolved by an operator"
            );
            self.stats.incidents_resolved += 1;
            let clients: Vec<String> = self
                .clients
                .iter()
                .filter(|(_, st)| st.ready)
                .map(|(c, _)| c.clone())
                .collect();
            for c in clients {
                self.mark_ready(&c);
            }
        }
        let answer = if acknowledge {
            ControlAnswer::AcknowledgeStorageIncident(
                incident.map(|i| wire::AcknowledgeStorageIncidentResponse { incident: Some(i) }),
            )
        } else {
            ControlAnswer::RepairStorageIncident(
                incident.map(|i| wire::RepairStorageIncidentResponse { incident: Some(i) }),
            )
        };
        self.out.push_back(Output::Reply { request, answer });
    }

    /// Issues a store operation and remembers what its completion is for.
    /// Returns false (and issues nothing) when the pending-operation bound
    /// is reached.
    fn can_issue(&self) -> bool {
        self.pending.len() < MAX_PENDING_OPS
    }

    /// When the next scrub slice may go: not before its interval, and,
    /// while other store operations are in flight, only once the last
    /// slice is [`SCRUB_STARVED_MS`] old.
    fn scrub_due_at(&self) -> u64 {
        if self.pending.is_empty() {
            return self.next_scrub_ms;
        }
        let starved = self
            .last_scrub_ms
            .map_or(SCRUB_STARVED_MS, |t| t.saturating_add(SCRUB_STARVED_MS));
        self.next_scrub_ms.max(starved)
    }

    /// The session a connection's writes are fenced by, once registered.
    fn fence_of(&self, conn: ConnId) -> Option<rvbox_store_port::sessions::SessionFence> {
        self.conns
            .get(&conn)
            .and_then(|c| c.session_key)
            .map(|session_id| rvbox_store_port::sessions::SessionFence { session_id })
    }

    fn store(&mut self, op: StoreOp, pending: Pending) -> bool {
        if !self.can_issue() {
            tracing::error!(
                op = op.name(),
                limit = MAX_PENDING_OPS,
                "too many store operations in flight; not issued"
            );
            self.stats.store_failures += 1;
            return false;
        }
        let token = OpToken(self.next_token);
        self.next_token += 1;
        self.pending.insert(token, pending);
        self.out.push_back(Output::Store {
            token,
            wall_ms: self.wall_ms,
            op,
        });
        true
    }

    fn complete(&mut self, token: OpToken, result: OpResult) {
        let Some(pending) = self.pending.remove(&token) else {
            tracing::warn!(token = token.0, "completion for an operation not in flight");
            self.stats.foreign_completions += 1;
            return;
        };
        if let Err(PortError::Unavailable(detail)) = &result {
            self.stats.store_failures += 1;
            tracing::error!(detail = %detail, "store operation failed");
        }
        if let Err(PortError::Refused(e)) = &result
            && e.code() == rvbox_domain::error::Code::StaleSession
            && let Some(conn) = pending.fenced_conn()
        {
            self.write_fenced(conn);
        }
        match pending {
            Pending::Registration(p) => self.registration_done(p, result),
            Pending::Reconcile(p) => self.reconcile_done(p, result),
            Pending::Dispatch(p) => self.dispatch_done(p, result),
            Pending::Accept(p) => self.accept_done(p, result),
            Pending::Ingest(p) => self.ingest_done(p, result),
            Pending::Incident {
                request,
                acknowledge,
            } => self.incident_done(request, acknowledge, result),
            Pending::Takeover { request } => {
                let answer = match result {
                    Ok(Completion::Takeover(r)) => {
                        tracing::info!(client_id = %r.client_id, "takeover authorized by an operator");
                        self.stats.takeovers_authorized += 1;
                        Ok(r)
                    }
                    Ok(_) => {
                        self.mismatch("authorize_takeover");
                        Err(PortError::Unavailable(
                            "completion does not match AuthorizeClientTakeover".into(),
                        ))
                    }
                    Err(e) => Err(e),
                };
                self.out.push_back(Output::Reply {
                    request,
                    answer: ControlAnswer::AuthorizeClientTakeover(answer),
                });
            }
            Pending::Signal(p) => self.signal_done(p, result),
            Pending::Upload(p) => self.upload_done(p, result),
            Pending::Stdin(p) => self.stdin_done(p, result),
            Pending::Fleet(p) => self.fleet_done(p, result),
            Pending::Pty(p) => self.pty_done(p, result),
            Pending::Scrub => {
                self.scrub_running = false;
                match result {
                    Ok(Completion::Scrubbed(r)) => {
                        self.stats.scrub_slices += 1;
                        self.stats.scrub_segments_verified += r.segments_verified;
                        let wait = if r.idle {
                            SCRUB_IDLE_INTERVAL_MS
                        } else {
                            SCRUB_INTERVAL_MS
                        };
                        self.next_scrub_ms = self.now_ms.saturating_add(wait);
                        if r.segments_damaged > 0 || r.counter_mismatches > 0 {
                            tracing::error!(
                                segments_damaged = r.segments_damaged,
                                counter_mismatches = r.counter_mismatches,
                                "background scrub found damage"
                            );
                        }
                    }
                    Ok(_) => self.mismatch("scrub"),
                    Err(e) => {
                        self.next_scrub_ms = self.now_ms.saturating_add(SCRUB_IDLE_INTERVAL_MS);
                        tracing::error!(error = %e, "background scrub slice failed");
                    }
                }
            }
            Pending::Maintenance => {
                self.maintenance_running = false;
                match result {
                    Ok(Completion::Maintained(r)) => {
                        self.stats.maintenance_passes += 1;
                        self.stats.evicted += r.evicted_quota + r.evicted_aged;
                        self.stats.rotations += r.rotations;
                        self.stats.clients_pruned += r.clients_pruned;
                        self.stats.audits_flushed += r.audit_flushed;
                        tracing::debug!(
                            rotations = r.rotations,
                            evicted_quota = r.evicted_quota,
                            evicted_aged = r.evicted_aged,
                            evictions_failed = r.evictions_failed,
                            "maintenance pass"
                        );
                    }
                    Ok(_) => self.mismatch("maintain"),
                    Err(e) => tracing::error!(error = %e, "maintenance pass failed"),
                }
            }
            Pending::Background(what) => {
                if let Err(e) = result {
                    self.stats.stale_decisions += 1;
                    tracing::warn!(error = %e, what, "store write not applied");
                }
            }
        }
    }

    /// A completion of the wrong shape for its operation: counted, and the
    /// operation treated as failed.
    fn mismatch(&mut self, what: &'static str) {
        self.stats.foreign_completions += 1;
        tracing::error!(what, "completion does not match its operation");
    }

    fn random_u64(&mut self) -> Option<u64> {
        let mut b = [0u8; 8];
        match self.entropy.fill(&mut b) {
            Ok(()) => Some(u64::from_le_bytes(b)),
            Err(e) => {
                self.stats.entropy_failures += 1;
                tracing::error!(error = %e, "no randomness");
                None
            }
        }
    }
}
