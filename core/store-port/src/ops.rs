//! The store operations the server core asks for and the completions that
//! answer them (conventions rule 3: a store write is an output with a
//! token; its completion is a later input).
//!
//! Every operation is one atomic step of the backend (one transaction, or
//! one group commit for appends): it either happened whole or not at all,
//! and the core learns which only from the [`Completion`] carrying its
//! token. A backend may perform operations of different connections in
//! any order that keeps each connection's own order, and may group the
//! [`StoreOp::AppendEvents`] of many connections into one durable commit.
//!
//! A write made for a connection carries the session it was made for
//! ([`SessionFence`]: on `Dispatch`, `RecordAccepted`, `AcceptLate`,
//! `Requeue`, `ApplyReconciliation`, a rejecting `FinishByServer`, and on
//! every event of `AppendEvents`). The backend checks in the write's own
//! transaction that the session is still its client's live one, and
//! refuses it `STALE_SESSION` otherwise, changing nothing; the core then
//! closes that connection. With several server replicas on one database,
//! this is what keeps a paused or partitioned replica from committing for
//! a client that reconnected elsewhere (docs/scaleout.md).

use rvbox_domain::error::DomainError;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;

use crate::audit::{Caller, SessionAudit};
use crate::commands::{CommandView, Knowledge, ReconcileWrite, ServerTerminal};
use crate::events::{AppendReport, EventAppend};
use crate::incidents::NewIncident;
use crate::pty::{PtyApplied, PtyLimits, PtyMutation, PtyOutcome, PtyReport, PtyResume, PtyView};
use crate::sessions::{ClientRecord, Registration, SessionFence};
use crate::signals::SignalOutcome;
use crate::stdin::{StdinOutcome, StdinWrites};

/// Identifies one operation until its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpToken(pub u64);

/// One operation on the store.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreOp {
    /// Reads a client's record. -> [`Completion::Client`]
    LoadClient {
        /// Client id.
        client_id: String,
    },
    /// Installs a registration (re-checked in its transaction), with the
    /// audit records of the registration and of the session it fences.
    /// -> [`Completion::Registered`]
    Register(Registration),
    /// Records a refused live-conflict claim and its audit record.
    /// -> [`Completion::Done`]
    RecordPendingClaim {
        /// Client id.
        client_id: String,
        /// The refused instance.
        instance_id: [u8; 16],
    },
    /// Ends a session row, with its audit record (the reason as its
    /// detail) in the same transaction. -> [`Completion::Done`]
    CloseSession {
        /// Session id.
        session_id: [u8; 16],
        /// Why (bounded text).
        reason: String,
    },
    /// Every non-terminal command of a client. -> [`Completion::Commands`]
    NonTerminalCommands {
        /// Client id.
        client_id: String,
    },
    /// What the server knows of commands absent from a client's
    /// non-terminal rows. -> [`Completion::Knowledge`]
    Knowledge {
        /// Commands, in the order the answer keeps.
        issues: Vec<[u8; 16]>,
    },
    /// A reconciliation round's decisions and incidents, all or nothing.
    /// -> [`Completion::Done`]
    ApplyReconciliation {
        /// Client id.
        client_id: String,
        /// The session the round ran on.
        session: SessionFence,
        /// Decisions.
        writes: Vec<ReconcileWrite>,
        /// Incidents the round opens.
        incidents: Vec<NewIncident>,
    },
    /// Records an incident that gates no scope. -> [`Completion::Done`]
    RecordIncident(NewIncident),
    /// Queued commands of a client in dispatch order, then its dispatched
    /// ones. -> [`Completion::Commands`]
    DispatchCandidates {
        /// Client id.
        client_id: String,
        /// Most rows of each kind.
        limit: usize,
    },
    /// queued -> dispatched at `revision` (when `write`), and the stored
    /// spec of the command. Without `write` the command must still be
    /// dispatched at `revision` (else `CONFLICT`): nothing changed it since
    /// the decision. -> [`Completion::Spec`]
    Dispatch {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
        /// Whether the transition is written (false: a dispatched command
        /// sent again).
        write: bool,
        /// The session it is dispatched on.
        session: SessionFence,
    },
    /// Reads one command. -> [`Completion::View`]
    CommandView {
        /// Command.
        issue: [u8; 16],
    },
    /// dispatched -> accepted. -> [`Completion::Done`]
    RecordAccepted {
        /// Command.
        issue: [u8; 16],
        /// Dispatched revision.
        revision: u64,
        /// The shell the client resolved.
        resolved_shell: i32,
        /// The session the acceptance arrived on.
        session: SessionFence,
    },
    /// A late acceptance, its incident, a higher revision and a pending
    /// TERM, in one transaction. -> [`Completion::Done`]
    AcceptLate {
        /// Command.
        issue: [u8; 16],
        /// Dispatched revision.
        revision: u64,
        /// The shell the client resolved.
        resolved_shell: i32,
        /// The `LATE_AFTER_EXPIRY` incident.
        incident: NewIncident,
        /// The session the acceptance arrived on.
        session: SessionFence,
    },
    /// dispatched -> queued (or cancelled when signalled).
    /// -> [`Completion::Requeued`]
    Requeue {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
        /// The session whose client's answer decided it.
        session: SessionFence,
    },
    /// A server decision that ends a command. -> [`Completion::Done`]
    FinishByServer {
        /// Command.
        issue: [u8; 16],
        /// Lifecycles it may end from.
        from: Vec<Lifecycle>,
        /// Revision the decision saw.
        revision: u64,
        /// How it ends.
        how: ServerTerminal,
        /// The rejection detail, for `Rejected`.
        rejection: Option<wire::ErrorDetail>,
        /// The session whose client's answer decided it; `None` for a
        /// decision of the server's own (queue expiry).
        session: Option<SessionFence>,
    },
    /// Sets the "expired pending reconciliation" indicator.
    /// -> [`Completion::Done`]
    MarkExpiredPending {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
    },
    /// Commands whose queue expiry passed. -> [`Completion::Commands`]
    ExpiryDue {
        /// Most rows.
        limit: usize,
    },
    /// Makes sequenced events durable; a backend may group these across
    /// connections into one commit. -> [`Completion::Appended`]
    AppendEvents {
        /// The events, in order.
        events: Vec<EventAppend>,
    },
    /// `SignalCommand`, idempotent by `request_id`: the backend applies
    /// the dispatch core's signal rule to the command as the operation's
    /// transaction reads it. -> [`Completion::Signal`]
    SignalCommand {
        /// The request.
        request: wire::SignalCommandRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// Signals still pending for commands. -> [`Completion::PendingSignals`]
    PendingSignals {
        /// Commands.
        issues: Vec<[u8; 16]>,
    },
    /// A command's lifecycle and raw script size. -> [`Completion::Script`]
    ScriptInfo {
        /// Command.
        issue: [u8; 16],
    },
    /// Raw script bytes from `offset`, at most `len`.
    /// -> [`Completion::ScriptBytes`]
    ScriptRange {
        /// Command.
        issue: [u8; 16],
        /// Raw offset.
        offset: u64,
        /// Most bytes.
        len: u64,
    },
    /// `RunFleet`, idempotent by `request_id`: the run, its targets and the
    /// first released commands in one transaction. -> [`Completion::Fleet`]
    RunFleet {
        /// The request.
        request: wire::RunFleetRequest,
        /// Who asked.
        caller: Caller,
    },
    /// A fleet mutation other than `RunFleet`, idempotent by `request_id`.
    /// -> [`Completion::Fleet`]
    FleetAction {
        /// The mutation.
        action: crate::fleet::FleetAction,
        /// Who asked.
        caller: Caller,
    },
    /// One release pass over the live fleet runs: releases what their rate
    /// allows (at most `limit` targets), stops runs at `max_errors`, ends
    /// done runs. -> [`Completion::Fleet`]
    FleetPump {
        /// Most targets released.
        limit: usize,
    },
    /// `RunCommand`, idempotent by `request_id`. -> [`Completion::RunCommand`]
    RunCommand {
        /// The request.
        request: wire::RunCommandRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// `RepairStorageIncident`, idempotent by `request_id`: the kind's safe
    /// repair, or a stored `REQUIRES_ACKNOWLEDGEMENT` refusal, with its
    /// audit record in the same transaction. -> [`Completion::Incident`]
    RepairIncident {
        /// The request.
        request: wire::RepairStorageIncidentRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// `AcknowledgeStorageIncident`, idempotent by `request_id`: the loss
    /// accepted with the operator's note, audited in the same
    /// transaction. -> [`Completion::Incident`]
    AcknowledgeIncident {
        /// The request.
        request: wire::AcknowledgeStorageIncidentRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// `AuthorizeClientTakeover`, idempotent by `request_id`: a one-shot
    /// grant for exactly the client's pending claim, expiring `ttl_ms`
    /// after it is made, audited with the caller.
    /// -> [`Completion::Takeover`]
    AuthorizeTakeover {
        /// The request.
        request: wire::AuthorizeClientTakeoverRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
        /// Lifetime of the grant.
        ttl_ms: u64,
    },
    /// `AppendStdin`, idempotent by `request_id`: the data as numbered
    /// writes of at most 256 KiB, their charges and the stored response,
    /// audited with the caller, in one transaction. -> [`Completion::Stdin`]
    AppendStdin {
        /// The request.
        request: wire::AppendStdinRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// `CloseStdin`, idempotent by `request_id`: a close-only write after
    /// every earlier one. -> [`Completion::Stdin`]
    CloseStdin {
        /// The request.
        request: wire::CloseStdinRequest,
        /// Who asked (audited with the effect).
        caller: Caller,
    },
    /// The pending (unacknowledged) writes of a command that has not
    /// ended, after `after_seq`, in order: as many as fit in `max_bytes`
    /// of payload and `max_writes`. -> [`Completion::StdinWrites`]
    PendingStdin {
        /// Command.
        issue: [u8; 16],
        /// Writes up to this one were sent already.
        after_seq: u64,
        /// Payload bytes the window has room for.
        max_bytes: u64,
        /// Writes the window has room for.
        max_writes: u64,
    },
    /// An operator mutation of a terminal, idempotent by `request_id`,
    /// audited with the caller, in one transaction (an input gets its
    /// `input_seq` there). -> [`Completion::Pty`]
    PtyMutation {
        /// The mutation.
        mutation: PtyMutation,
        /// Who asked (audited with the effect).
        caller: Caller,
        /// The configured bounds an open is checked against.
        limits: PtyLimits,
    },
    /// What a client reported of its terminals, in arrival order, in one
    /// transaction: openings, input acknowledgements, output (recorded by
    /// offset) and closes. -> [`Completion::PtyApplied`]
    PtyApply {
        /// The client.
        client_id: String,
        /// The session the reports arrived on.
        session: SessionFence,
        /// The reports.
        reports: Vec<PtyReport>,
        /// Recording kept per terminal (bytes).
        recording_bytes: u64,
    },
    /// The terminals of a client that are not closed, with their pending
    /// input, for sending again after a reconnect.
    /// -> [`Completion::PtyResume`]
    PtyResume {
        /// The client.
        client_id: String,
    },
    /// Terminals idle (no input or output) since before `idle_before_ms`
    /// and not yet asked to close: each is marked asked to close, with
    /// the reason `idle timeout`. -> [`Completion::PtyIdle`]
    PtyIdle {
        /// Last activity before this (Unix ms) is idle.
        idle_before_ms: i64,
        /// Most terminals one pass marks.
        limit: usize,
    },
    /// Session audit records that no effect carries (rate-limited by the
    /// core). -> [`Completion::Done`]
    Audit(Vec<SessionAudit>),
    /// One retention and maintenance pass (plan §5.4: rotation, quota and
    /// age eviction, the tombstone FIFO, pending deletions, audit
    /// rotation). -> [`Completion::Maintained`]
    Maintain,
    /// One bounded slice of the background scrub (re-verification of
    /// sealed segments, the orphan sweep, the counter recount).
    /// -> [`Completion::Scrubbed`]
    Scrub,
}

impl StoreOp {
    /// A bounded name for logs, metrics and traces.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::LoadClient { .. } => "load_client",
            Self::Register(_) => "register",
            Self::RecordPendingClaim { .. } => "record_pending_claim",
            Self::CloseSession { .. } => "close_session",
            Self::NonTerminalCommands { .. } => "non_terminal_commands",
            Self::Knowledge { .. } => "knowledge",
            Self::ApplyReconciliation { .. } => "apply_reconciliation",
            Self::RecordIncident(_) => "record_incident",
            Self::DispatchCandidates { .. } => "dispatch_candidates",
            Self::Dispatch { .. } => "dispatch",
            Self::CommandView { .. } => "command_view",
            Self::RecordAccepted { .. } => "record_accepted",
            Self::AcceptLate { .. } => "accept_late",
            Self::Requeue { .. } => "requeue",
            Self::FinishByServer { .. } => "finish_by_server",
            Self::MarkExpiredPending { .. } => "mark_expired_pending",
            Self::ExpiryDue { .. } => "expiry_due",
            Self::AppendEvents { .. } => "append_events",
            Self::SignalCommand { .. } => "signal_command",
            Self::PendingSignals { .. } => "pending_signals",
            Self::ScriptInfo { .. } => "script_info",
            Self::ScriptRange { .. } => "script_range",
            Self::RunCommand { .. } => "run_command",
            Self::RunFleet { .. } => "run_fleet",
            Self::FleetAction { .. } => "fleet_action",
            Self::FleetPump { .. } => "fleet_pump",
            Self::RepairIncident { .. } => "repair_incident",
            Self::AuthorizeTakeover { .. } => "authorize_takeover",
            Self::AcknowledgeIncident { .. } => "acknowledge_incident",
            Self::AppendStdin { .. } => "append_stdin",
            Self::CloseStdin { .. } => "close_stdin",
            Self::PendingStdin { .. } => "pending_stdin",
            Self::PtyMutation { .. } => "pty_mutation",
            Self::PtyApply { .. } => "pty_apply",
            Self::PtyResume { .. } => "pty_resume",
            Self::PtyIdle { .. } => "pty_idle",
            Self::Audit(_) => "audit",
            Self::Maintain => "maintain",
            Self::Scrub => "scrub",
        }
    }

    /// Whether the operation only reads.
    #[must_use]
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            Self::LoadClient { .. }
                | Self::NonTerminalCommands { .. }
                | Self::Knowledge { .. }
                | Self::DispatchCandidates { .. }
                | Self::CommandView { .. }
                | Self::ExpiryDue { .. }
                | Self::PendingSignals { .. }
                | Self::ScriptInfo { .. }
                | Self::ScriptRange { .. }
                | Self::PendingStdin { .. }
                | Self::PtyResume { .. }
        )
    }
}

/// The successful answer to one operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Completion {
    /// The operation committed; it has no value.
    Done,
    /// [`StoreOp::LoadClient`].
    Client(Option<ClientRecord>),
    /// [`StoreOp::Register`]: the installed generation.
    Registered {
        /// Generation.
        generation: u64,
    },
    /// Rows, in the order the operation defines.
    Commands(Vec<CommandView>),
    /// [`StoreOp::Knowledge`], in request order.
    Knowledge(Vec<([u8; 16], Knowledge)>),
    /// [`StoreOp::Dispatch`]: the stored spec.
    Spec(Box<wire::ExecutionSpec>),
    /// [`StoreOp::CommandView`].
    View(CommandView),
    /// [`StoreOp::Requeue`]: where the command went.
    Requeued(Lifecycle),
    /// [`StoreOp::AppendEvents`].
    Appended(AppendReport),
    /// [`StoreOp::SignalCommand`].
    Signal(SignalOutcome),
    /// [`StoreOp::PendingSignals`], in request order.
    PendingSignals(Vec<wire::Signal>),
    /// [`StoreOp::ScriptInfo`].
    Script {
        /// Lifecycle.
        lifecycle: Lifecycle,
        /// Raw script size; `None` for command text.
        size: Option<u64>,
    },
    /// [`StoreOp::ScriptRange`]: the bytes (empty past the end).
    ScriptBytes(Vec<u8>),
    /// [`StoreOp::RunCommand`].
    RunCommand(wire::RunCommandResponse),
    /// A fleet operation's outcome.
    Fleet(Box<crate::fleet::FleetOutcome>),
    /// [`StoreOp::RepairIncident`], [`StoreOp::AcknowledgeIncident`]: the
    /// incident as it now is.
    Incident(Box<wire::StorageIncident>),
    /// [`StoreOp::AuthorizeTakeover`].
    Takeover(wire::AuthorizeClientTakeoverResponse),
    /// [`StoreOp::AppendStdin`], [`StoreOp::CloseStdin`].
    Stdin(Box<StdinOutcome>),
    /// [`StoreOp::PendingStdin`].
    StdinWrites(StdinWrites),
    /// [`StoreOp::PtyMutation`].
    Pty(Box<PtyOutcome>),
    /// [`StoreOp::PtyApply`]: one outcome per report, in order.
    PtyApplied(Vec<PtyApplied>),
    /// [`StoreOp::PtyResume`]: the terminals, oldest first.
    PtyResume(Vec<PtyResume>),
    /// [`StoreOp::PtyIdle`]: the terminals now asked to close.
    PtyIdle(Vec<PtyView>),
    /// [`StoreOp::Maintain`].
    Maintained(crate::maintenance::MaintenanceReport),
    /// [`StoreOp::Scrub`].
    Scrubbed(crate::maintenance::ScrubReport),
}

/// Why an operation did not happen. Either way nothing of it committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortError {
    /// The domain refused it (a stale compare-and-set, a refused request);
    /// stable, part of the operation's result.
    Refused(DomainError),
    /// The backend failed (I/O, corruption, unavailable scope); the detail
    /// is for logs, never for a peer.
    Unavailable(String),
}

impl PortError {
    /// The domain view: a backend failure is `UNAVAILABLE` for the caller,
    /// with no internal detail.
    #[must_use]
    pub fn to_domain(&self) -> DomainError {
        match self {
            Self::Refused(e) => e.clone(),
            Self::Unavailable(_) => DomainError::new(
                rvbox_domain::error::Code::Unavailable,
                "the server store could not complete the operation; retry with the same request_id",
            ),
        }
    }
}

impl std::fmt::Display for PortError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(e) => write!(f, "{e}"),
            Self::Unavailable(s) => write!(f, "store unavailable: {s}"),
        }
    }
}

/// One operation's outcome.
pub type OpResult = Result<Completion, PortError>;

/// A store backend: performs batches of operations (conventions rule 3:
/// the core's store writes are outputs with tokens, their completions
/// later inputs). The SQLite store's executor and the PostgreSQL store
/// both implement it, and the conformance suite runs the same tests
/// against each through it.
pub trait Backend {
    /// Performs `ops` in order (a backend may group consecutive ones into
    /// one durable commit, as the module docs allow) and returns one
    /// completion per operation, in the same order. No completion is
    /// returned before the commit that made its write durable.
    fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)>;

    /// The last step of a graceful stop, after every operation: what the
    /// backend keeps waiting for a later write (the SQLite store's audit
    /// outbox) is made final. Never fails the stop; failures are logged.
    fn close(&mut self, _wall_ms: i64) {}

    /// Performs one operation.
    fn perform(&mut self, wall_ms: i64, op: StoreOp) -> OpResult {
        self.perform_batch(vec![(OpToken(0), wall_ms, op)])
            .pop()
            .map_or_else(
                || {
                    Err(PortError::Unavailable(
                        "the backend answered no completion".into(),
                    ))
                },
                |(_, r)| r,
            )
    }
}
