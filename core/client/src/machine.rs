//! [`ClientCore`]: the client daemon's protocol logic composed from the
//! link, acceptance, spool and launch machines (plan §7), in the shape of
//! the server core: `handle(now, wall, Input)`, `#[must_use] poll_output`,
//! `poll_timeout`.
//!
//! Every durable step is an [`Output::Store`] with a [`Token`], and the
//! core learns it happened only from a later [`Input::Completion`]; every
//! supervisor step is an [`Output::Supervise`], answered by process events.
//! Nothing is acknowledged to the server before its completion:
//!
//! - `CommandAccepted` (positive) only after the acceptance transaction;
//! - a `ScriptUploadStatus` only after the chunk is synced;
//! - the release byte only after `launch_authorized` is durable, which
//!   follows `launch_prepared`, which follows the launcher's ready report
//!   (`accepted -> launch_prepared -> launch_authorized -> running`, no
//!   shortcut; a cancellation seen while the launcher is blocked aborts it);
//! - capacity only after a `ReconcileResult` is applied durably.
//!
//! After a restart, a launch that was prepared but not authorized is
//! reaped (the launcher verified dead) and may run later; one that was
//! authorized is reaped and ends `INTERRUPTED`, never launched again.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{MAX_SCRIPT_CHUNK_BYTES, MAX_STDIN_WRITE_BYTES};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;

use crate::accept::{AcceptPolicy, Refusal, check_dispatch};
use crate::link::{Link, LinkConfig, LinkEffect, snapshot_chunks};
use crate::ops::{
    AcceptOutcome, ClientCompletion, ClientOp, ScriptOutcome, StdinOutcome, SuperviseOp, Token,
    WrapperSource,
};
use crate::process::{
    CommandProcessEvent, Exit, LaunchFailure, LaunchIdentity, LaunchSpec, ProcessEvent,
    ResourceLimits,
};
use crate::spool::{RestoredCommand, Spool, SpoolLimits, SpoolOutput, SpoolToken};

/// How far beyond the reported prefix the server may stream a script
/// (agent.proto: 1 MiB per command).
pub const SCRIPT_WINDOW_BYTES: u64 = 1024 * 1024;
/// Progress is reported at least every this many bytes (half the window,
/// so the server never waits on it).
pub const SCRIPT_STATUS_EVERY_BYTES: u64 = 512 * 1024;
/// Delay before a launch that failed transiently is tried again.
pub const LAUNCH_RETRY_MS: u64 = 5_000;
/// Most outputs waiting to be drained.
pub const MAX_OUTPUTS: usize = 262_144;
/// Most durable steps in flight at once (the executor's queue bound).
pub const MAX_PENDING_OPS: usize = 65_536;

/// The launch state of one record (plan §7.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchPhase {
    /// Accepted; waiting for a running slot (and a committed script).
    Accepted,
    /// The wrapper file is being written.
    Materializing,
    /// The blocked launcher is starting.
    Preparing,
    /// `launch_prepared` is being made durable.
    RecordingPrepared(LaunchIdentity),
    /// `launch_prepared` is durable.
    Prepared(LaunchIdentity),
    /// `launch_authorized` is being made durable.
    Authorizing(LaunchIdentity),
    /// Released; waiting for `exec`.
    Released(LaunchIdentity),
    /// Running.
    Running(LaunchIdentity),
    /// Aborted before release; waiting for the launcher to be gone.
    Aborting,
    /// A recorded launch of before a restart is being reaped.
    Reaping {
        /// Whether it had been authorized (then it ends interrupted).
        authorized: bool,
    },
    /// The terminal event is spooled.
    Ended,
}

/// What the store holds for one command, for [`ClientCore::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct RestoredRecord {
    /// The command.
    pub issue: Uuid7,
    /// Its immutable request hash.
    pub request_hash: [u8; 32],
    /// Its revision.
    pub revision: u64,
    /// The shell it was accepted under.
    pub resolved_shell: wire::ShellType,
    /// The normalized spec.
    pub spec: wire::ExecutionSpec,
    /// The client's lifecycle view.
    pub lifecycle: wire::Lifecycle,
    /// 1 accepted, 2 prepared, 3 authorized, 4 running, 5 ended.
    pub launch: u8,
    /// The recorded launch identity.
    pub identity: Option<LaunchIdentity>,
    /// Reconciliation told this client to end it.
    pub terminate_intent: bool,
    /// Reconciliation told this client the server holds its terminal
    /// record: it only waits for its tombstone.
    pub discard_intent: bool,
    /// Script length and SHA-256, for a script source.
    pub script: Option<(u64, [u8; 32])>,
    /// Durable script prefix.
    pub script_received: u64,
    /// Whether the script is committed.
    pub script_committed: bool,
    /// The wrapper file, once materialized.
    pub wrapper_path: Option<String>,
    /// Next stdin write expected.
    pub stdin_next_seq: u64,
    /// Whether stdin is closed.
    pub stdin_closed: bool,
}

/// Configuration of the client core.
#[derive(Debug, Clone)]
pub struct ClientCoreConfig {
    /// Execution policy and capacity.
    pub policy: AcceptPolicy,
    /// The network session.
    pub link: LinkConfig,
    /// The spool.
    pub spool: SpoolLimits,
    /// The canonical executable of each configured shell.
    pub shell_paths: BTreeMap<i32, String>,
    /// Compiled resource controls of each enabled profile flag.
    pub profiles: BTreeMap<i32, ResourceLimits>,
    /// The hello sent on every connection.
    pub hello: wire::ClientHello,
}

/// An input of the client core.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The transport opened.
    Opened,
    /// The transport closed, with the peer's close code.
    Closed(Option<u16>),
    /// A binary frame.
    Frame(Vec<u8>),
    /// A WebSocket Ping.
    Ping,
    /// A WebSocket Pong.
    Pong,
    /// A durable step ended.
    Completion(Token, ClientCompletion),
    /// A process event.
    Process(CommandProcessEvent),
    /// A signal was sent (or not) to a tree.
    Signalled {
        /// The command.
        issue: Uuid7,
        /// The signal.
        kind: wire::SignalKind,
        /// Its revision.
        revision: u64,
        /// What happened.
        outcome: wire::SignalOutcome,
    },
    /// An orphan of before a restart was dealt with.
    Reaped {
        /// The command.
        issue: Uuid7,
        /// Whether the recorded tree is verified gone.
        gone: bool,
    },
    /// Orderly shutdown.
    Shutdown,
}

/// An output of the client core.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Open a transport.
    Dial,
    /// Send a binary frame.
    Send(Vec<u8>),
    /// Send a WebSocket Ping.
    SendPing,
    /// Send a WebSocket Pong.
    SendPong,
    /// Close the transport.
    Close(u16),
    /// Perform a durable step; report [`Input::Completion`].
    Store(Token, ClientOp),
    /// Perform a supervisor step.
    Supervise(SuperviseOp),
    /// Read the sequenced events `first_seq..=last_seq` of `issue` back
    /// from the store and send each as a `CommandEvent` in an envelope of
    /// this session.
    SendEvents {
        /// The command.
        issue: Uuid7,
        /// First sequence.
        first_seq: u64,
        /// Last sequence.
        last_seq: u64,
        /// The session's id.
        session_id: String,
        /// The session's generation.
        generation: u64,
    },
}

/// Counters for metrics and the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoreStats {
    /// Positive acceptances sent (new).
    pub accepted: u64,
    /// Exact repeats answered.
    pub repeats: u64,
    /// Refusals sent.
    pub refusals: u64,
    /// Launches released.
    pub launched: u64,
    /// Commands ended locally.
    pub ended: u64,
    /// Launches aborted before release.
    pub aborted: u64,
    /// Commands interrupted by a restart.
    pub interrupted: u64,
    /// Commands finished into tombstones.
    pub finished: u64,
    /// Durable steps that failed.
    pub store_failures: u64,
    /// Completions for no pending step.
    pub stray_completions: u64,
    /// Protocol errors found in server messages.
    pub protocol_errors: u64,
    /// Commands whose output could no longer be accounted for.
    pub unaccountable: u64,
    /// Commands ended interrupted with a tree that could not be verified
    /// gone.
    pub unverified_trees: u64,
}

/// The launch identity no process has: what is reaped for a record that
/// has none.
fn null_identity() -> LaunchIdentity {
    LaunchIdentity {
        launcher_pid: 0,
        process_group: 0,
        birth_ticks: 0,
        cgroup: None,
    }
}

/// Most times a command's lost terminal event is spooled again.
pub const MAX_TERMINAL_ATTEMPTS: u32 = 3;
/// Times a recorded, authorized tree that cannot be verified gone after a
/// restart is checked again before the command ends interrupted.
pub const MAX_REAP_ATTEMPTS: u32 = 10;
/// Between those checks.
pub const REAP_RETRY_MS: u64 = 30_000;

/// Why a command that ran while the daemon stopped without its orderly
/// shutdown has incomplete output.
const LOST_AT_RESTART_REASON: &str = "the client daemon stopped while the command ran: output written after the last captured chunk was not captured";

/// Why a command whose output could not be recorded ends interrupted.
const UNACCOUNTABLE_REASON: &str =
    "the client could not record the command's output durably; its output is incomplete";

#[derive(Debug, Clone, PartialEq)]
struct Record {
    request_hash: [u8; 32],
    revision: u64,
    resolved_shell: wire::ShellType,
    spec: wire::ExecutionSpec,
    cwd: String,
    lifecycle: wire::Lifecycle,
    phase: LaunchPhase,
    terminate: bool,
    script: Option<(u64, [u8; 32])>,
    script_received: u64,
    script_committed: bool,
    /// The prefix last reported to the server.
    script_reported: u64,
    wrapper: Option<String>,
    stdin_next: u64,
    stdin_closed: bool,
    last_signal_revision: u64,
    /// A signal sent through RVBox reached the tree.
    signalled: bool,
    cancel_pending: Option<(u64, wire::SignalKind)>,
    exit: Option<Exit>,
    retry_at: Option<u64>,
    order: u64,
    running_slot: bool,
    /// An essential entry or marker of it could not be made durable.
    unaccountable: bool,
    /// Times a lost terminal event was spooled again.
    terminal_attempts: u32,
    /// Times a recorded tree could not be verified gone after a restart.
    reap_attempts: u32,
    /// The recorded launch identity a restart reaps.
    reap_identity: Option<LaunchIdentity>,
}

impl Record {
    fn launchable(&self) -> bool {
        self.phase == LaunchPhase::Accepted
            && !self.terminate
            && (self.script.is_none() || self.script_committed)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Pending {
    Accept(
        Box<wire::Dispatch>,
        Box<crate::accept::CheckedDispatch>,
        u64,
    ),
    Spool(SpoolToken),
    Generation,
    Tombstones(u64),
    Reconcile(Box<rvbox_reconcile::CheckedResult>),
    Materialize(Uuid7),
    Prepared(Uuid7),
    Authorized(Uuid7),
    Running(Uuid7),
    Unprepared(Uuid7),
    Ended(Uuid7),
    Script(Uuid7, u64, u64),
    Stdin(Uuid7, u64, bool),
    StdinWritten,
    Finish(Uuid7),
}

/// The client daemon's protocol core.
#[derive(Debug)]
pub struct ClientCore {
    config: ClientCoreConfig,
    link: Link,
    spool: Spool,
    records: BTreeMap<Uuid7, Record>,
    pending: BTreeMap<Token, Pending>,
    next_token: u64,
    next_order: u64,
    last_capacity: Option<(u32, u32)>,
    generation: u64,
    out: VecDeque<Output>,
    stats: CoreStats,
    shutting_down: bool,
    wall: i64,
    /// What the next snapshot reports (the store shell keeps it current).
    store_health: wire::ScopeState,
}

fn normalize_cwd(policy: &AcceptPolicy, spec: &wire::ExecutionSpec) -> String {
    if spec.cwd.is_empty() {
        policy.default_cwd.clone()
    } else {
        spec.cwd.clone()
    }
}

fn lifecycle_of(launch: u8, lifecycle: wire::Lifecycle) -> wire::Lifecycle {
    match launch {
        4 => wire::Lifecycle::Running,
        5 => lifecycle,
        _ => wire::Lifecycle::Accepted,
    }
}

fn signal_number(kind: wire::SignalKind) -> Option<(i32, &'static str)> {
    match kind {
        wire::SignalKind::Hup => Some((1, "SIGHUP")),
        wire::SignalKind::Int => Some((2, "SIGINT")),
        wire::SignalKind::Term => Some((15, "SIGTERM")),
        wire::SignalKind::Kill => Some((9, "SIGKILL")),
        wire::SignalKind::Usr1 => Some((10, "SIGUSR1")),
        wire::SignalKind::Usr2 => Some((12, "SIGUSR2")),
        wire::SignalKind::Unspecified => None,
    }
}

fn signal_name(n: i32) -> &'static str {
    match n {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "",
    }
}

impl ClientCore {
    /// The core at startup, over what the store holds. `generation_floor`
    /// is the highest generation this installation has seen; `seed`
    /// seeds the reconnect jitter. Recorded launches of before the restart
    /// are reaped first.
    ///
    /// # Errors
    /// A spool error when the store holds more commands than the spool
    /// tracks.
    pub fn new(
        config: ClientCoreConfig,
        records: Vec<RestoredRecord>,
        spool: Vec<RestoredCommand>,
        generation_floor: u64,
        seed: u64,
        now_ms: u64,
    ) -> Result<Self, crate::spool::SpoolError> {
        let link = Link::new(
            config.link,
            config.hello.clone(),
            generation_floor,
            seed,
            now_ms,
        );
        let mut core = Self {
            spool: Spool::new(config.spool),
            link,
            records: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_token: 1,
            next_order: 1,
            last_capacity: None,
            generation: generation_floor,
            out: VecDeque::new(),
            stats: CoreStats::default(),
            shutting_down: false,
            wall: 0,
            store_health: wire::ScopeState::Ready,
            config,
        };
        for c in spool {
            core.spool.restore(c)?;
        }
        for r in records {
            let cwd = normalize_cwd(&core.config.policy, &r.spec);
            let order = core.next_order;
            core.next_order += 1;
            let terminal = core.spool.terminal_lifecycle(&r.issue);
            let mut lifecycle = lifecycle_of(r.launch, r.lifecycle);
            if r.launch != 5
                && let Some(l) = terminal
            {
                // the terminal event is durable (the tree was drained before
                // it was spooled); only the slot release is left
                lifecycle = l;
                core.store(
                    ClientOp::Ended {
                        issue: r.issue,
                        lifecycle: l,
                    },
                    Pending::Ended(r.issue),
                );
            }
            if r.launch == 5
                && !r.terminate_intent
                && (r.discard_intent || core.spool.entry_count(&r.issue) == 0)
            {
                // every event was acknowledged before the restart, or the
                // server said it holds the terminal record: only the
                // tombstone is left
                core.spool.discard(r.issue);
            }
            let phase = match (r.launch, r.identity.clone()) {
                (5, _) => LaunchPhase::Ended,
                _ if terminal.is_some() => LaunchPhase::Ended,
                (2, Some(_)) => LaunchPhase::Reaping { authorized: false },
                (3 | 4, Some(_)) => LaunchPhase::Reaping { authorized: true },
                (3 | 4, None) => LaunchPhase::Reaping { authorized: true },
                _ => LaunchPhase::Accepted,
            };
            if !core.spool_has(&r.issue) && phase != LaunchPhase::Ended {
                core.spool.open_command(r.issue)?;
            }
            if r.terminate_intent {
                core.spool.mute(r.issue);
            }
            if let (LaunchPhase::Reaping { .. }, Some(identity)) = (&phase, r.identity.clone()) {
                core.push(Output::Supervise(SuperviseOp::Reap {
                    issue: r.issue,
                    identity,
                }));
            } else if let LaunchPhase::Reaping { .. } = phase {
                // authorized without an identity cannot happen (prepared
                // comes first); end it as uncertain
                core.push(Output::Supervise(SuperviseOp::Reap {
                    issue: r.issue,
                    identity: null_identity(),
                }));
            }
            core.records.insert(
                r.issue,
                Record {
                    request_hash: r.request_hash,
                    revision: r.revision,
                    resolved_shell: r.resolved_shell,
                    spec: r.spec,
                    cwd,
                    lifecycle,
                    running_slot: matches!(phase, LaunchPhase::Reaping { .. }),
                    phase,
                    terminate: r.terminate_intent,
                    script: r.script,
                    script_received: r.script_received,
                    script_committed: r.script_committed,
                    script_reported: r.script_received,
                    wrapper: r.wrapper_path,
                    stdin_next: r.stdin_next_seq,
                    stdin_closed: r.stdin_closed,
                    last_signal_revision: 0,
                    signalled: false,
                    cancel_pending: None,
                    exit: None,
                    retry_at: None,
                    order,
                    unaccountable: false,
                    terminal_attempts: 0,
                    reap_attempts: 0,
                    reap_identity: r.identity.clone(),
                },
            );
        }
        // records that only wait for their tombstone finish now
        core.drain_spool();
        core.drain_link(now_ms);
        Ok(core)
    }

    fn spool_has(&self, issue: &Uuid7) -> bool {
        self.spool.cursors(issue).is_some()
    }

    /// The client store's health as a snapshot reports it: anything but
    /// READY means the server completes no reconciliation and dispatches
    /// nothing until it is READY again (plan §6.4).
    pub fn set_store_health(&mut self, health: wire::ScopeState) {
        self.store_health = health;
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// The spool's counters.
    #[must_use]
    pub fn spool_stats(&self) -> crate::spool::SpoolStats {
        self.spool.stats()
    }

    /// The daemon's raw output backlog in the spool (bytes not yet sent
    /// and acknowledged).
    #[must_use]
    pub fn spool_backlog(&self) -> u64 {
        self.spool.backlog()
    }

    /// The link's phase.
    #[must_use]
    pub fn link_phase(&self) -> crate::link::Phase {
        self.link.phase()
    }

    /// The link's counters.
    #[must_use]
    pub fn link_stats(&self) -> crate::link::LinkStats {
        self.link.stats()
    }

    /// Records held (active and terminal-unacknowledged).
    #[must_use]
    pub fn record_count(&self) -> usize {
        self.records.len()
    }

    /// The launch phase of `issue`.
    #[must_use]
    pub fn phase_of(&self, issue: &Uuid7) -> Option<&LaunchPhase> {
        self.records.get(issue).map(|r| &r.phase)
    }

    /// (running, queued) as reported.
    #[must_use]
    pub fn capacity(&self) -> (u32, u32) {
        let running = self.records.values().filter(|r| r.running_slot).count();
        let queued = self
            .records
            .values()
            .filter(|r| !r.running_slot && r.phase == LaunchPhase::Accepted && !r.terminate)
            .count();
        (
            u32::try_from(running).unwrap_or(u32::MAX),
            u32::try_from(queued).unwrap_or(u32::MAX),
        )
    }

    /// The next output.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    fn push(&mut self, o: Output) {
        debug_assert!(self.out.len() < MAX_OUTPUTS, "client outputs not drained");
        self.out.push_back(o);
    }

    fn token(&mut self) -> Token {
        let t = Token(self.next_token);
        self.next_token = self.next_token.wrapping_add(1).max(1);
        t
    }

    fn store(&mut self, op: ClientOp, pending: Pending) {
        debug_assert!(
            self.pending.len() < MAX_PENDING_OPS,
            "too many durable steps in flight"
        );
        let t = self.token();
        self.pending.insert(t, pending);
        self.push(Output::Store(t, op));
    }

    /// The one deadline of the core: the link's, and launch retries.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        let retry = self.records.values().filter_map(|r| r.retry_at).min();
        match (self.link.poll_timeout(), retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Timers. Idempotent.
    pub fn handle_timeout(&mut self, now_ms: u64, wall_ms: i64) {
        self.wall = wall_ms;
        self.link.handle_timeout(now_ms);
        let mut reap = Vec::new();
        for (id, r) in &mut self.records {
            if r.retry_at.is_some_and(|t| t <= now_ms) {
                r.retry_at = None;
                if let LaunchPhase::Reaping { .. } = r.phase {
                    // no recorded identity: the null one, which no process has
                    let identity = r.reap_identity.clone().unwrap_or_else(null_identity);
                    reap.push((*id, identity));
                }
            }
        }
        for (issue, identity) in reap {
            self.push(Output::Supervise(SuperviseOp::Reap { issue, identity }));
        }
        self.drain_link(now_ms);
        self.settle(now_ms, wall_ms);
    }

    /// One input.
    pub fn handle(&mut self, now_ms: u64, wall_ms: i64, input: Input) {
        self.wall = wall_ms;
        match input {
            Input::Opened => self.link.opened(now_ms),
            Input::Closed(code) => self.link.closed(now_ms, code),
            Input::Frame(bytes) => self.link.frame(now_ms, &bytes),
            Input::Ping => self.link.ping(now_ms),
            Input::Pong => self.link.pong(now_ms),
            Input::Completion(token, result) => self.completed(now_ms, wall_ms, token, result),
            Input::Process(ev) => self.process(now_ms, wall_ms, ev),
            Input::Signalled {
                issue,
                kind,
                revision,
                outcome,
            } => self.signalled(wall_ms, issue, kind, revision, outcome),
            Input::Reaped { issue, gone } => self.reaped(now_ms, wall_ms, issue, gone),
            Input::Shutdown => {
                self.shutting_down = true;
                self.link.shutdown();
                self.push(Output::Supervise(SuperviseOp::StopAll));
            }
        }
        self.drain_link(now_ms);
        self.settle(now_ms, wall_ms);
    }

    /// Moves the link's effects out, and handles what it hands up.
    fn drain_link(&mut self, now_ms: u64) {
        while let Some(e) = self.link.poll_effect() {
            match e {
                LinkEffect::Dial => self.push(Output::Dial),
                LinkEffect::Send(b) => self.push(Output::Send(b)),
                LinkEffect::SendPing => self.push(Output::SendPing),
                LinkEffect::SendPong => self.push(Output::SendPong),
                LinkEffect::Close(c) => self.push(Output::Close(c)),
                LinkEffect::Welcomed(s) => {
                    self.spool
                        .set_session_windows(s.command_window, s.session_window);
                    if s.generation > self.generation {
                        self.generation = s.generation;
                        self.store(ClientOp::Generation(s.generation), Pending::Generation);
                    }
                }
                LinkEffect::Reconcile { round, rows } => {
                    let issues: Vec<Uuid7> = rows
                        .iter()
                        .filter_map(|r| Uuid7::parse("reconcile_request.rows", &r.issue_uuid).ok())
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    self.store(ClientOp::Tombstones { issues }, Pending::Tombstones(round));
                }
                LinkEffect::Reconciled(checked) => {
                    let revisions = checked
                        .resume
                        .iter()
                        .map(|(id, r)| (*id, r.revision.0))
                        .collect();
                    let op = ClientOp::Reconcile {
                        terminate: checked.terminate.clone(),
                        discard: checked.discard.clone(),
                        revisions,
                    };
                    self.store(op, Pending::Reconcile(Box::new(checked)));
                }
                LinkEffect::Message(p) => self.message(now_ms, p),
                LinkEffect::Down => {
                    self.spool.session_closed();
                    self.last_capacity = None;
                }
            }
        }
    }

    fn send(&mut self, payload: Payload) {
        if self.link.send(payload).is_ok() {
            self.drain_link_sends();
        }
    }

    fn drain_link_sends(&mut self) {
        // sending only queues Send effects; move them out in order
        while let Some(e) = self.link.poll_effect() {
            match e {
                LinkEffect::Send(b) => self.push(Output::Send(b)),
                LinkEffect::Close(c) => self.push(Output::Close(c)),
                other => {
                    // no other effect comes from a send
                    debug_assert!(false, "unexpected link effect on send: {other:?}");
                }
            }
        }
    }

    fn protocol_error(&mut self, now_ms: u64) {
        self.stats.protocol_errors += 1;
        self.link.protocol_error(now_ms);
    }

    fn message(&mut self, now_ms: u64, payload: Payload) {
        match payload {
            Payload::Dispatch(d) => self.dispatch(now_ms, d),
            Payload::EventAck(ack) => {
                let Ok(issue) = Uuid7::parse("event_ack.issue_uuid", &ack.issue_uuid) else {
                    self.protocol_error(now_ms);
                    return;
                };
                match self.spool.on_ack(issue, ack.durable_event_seq) {
                    Ok(()) | Err(crate::spool::SpoolError::UnknownCommand(_)) => {}
                    Err(_) => self.protocol_error(now_ms),
                }
            }
            Payload::Signal(s) => self.signal(now_ms, s),
            Payload::StdinWrite(w) => self.stdin(now_ms, w),
            Payload::ScriptChunk(c) => self.script_chunk(now_ms, c),
            Payload::PtyOpen(p) => {
                let error = DomainError::new(Code::Unsupported, "this client has no PTY support");
                self.send(Payload::PtyOpened(wire::PtyOpened {
                    pty_session_id: p.pty_session_id,
                    outcome: wire::AcceptOutcome::Permanent as i32,
                    error: Some(error.to_detail()),
                    resolved_shell: wire::ShellType::Unspecified as i32,
                }));
            }
            // PTY traffic for sessions this client never opened
            _ => {}
        }
    }

    // ---- acceptance ------------------------------------------------------

    fn dispatch(&mut self, now_ms: u64, d: wire::Dispatch) {
        let generation = self.link.session().map_or(0, |s| s.generation);
        // the wall clock of the expiry check comes with the input
        match check_dispatch(&self.config.policy, generation, self.wall, &d) {
            Err(Refusal::Fence { .. }) => self.protocol_error(now_ms),
            Err(r) => self.refuse(&d, &r),
            Ok(checked) => {
                let checked = Box::new(checked);
                let op = ClientOp::Accept(checked.clone());
                self.store(op, Pending::Accept(Box::new(d), checked, generation));
            }
        }
    }

    fn refuse(&mut self, d: &wire::Dispatch, r: &Refusal) {
        if let Some(answer) = r.answer(d) {
            self.stats.refusals += 1;
            self.send(Payload::CommandAccepted(answer));
        }
    }

    fn accepted(
        &mut self,
        d: &wire::Dispatch,
        checked: &crate::accept::CheckedDispatch,
        generation: u64,
        outcome: AcceptOutcome,
    ) {
        let same_session = self
            .link
            .session()
            .is_some_and(|s| s.generation == generation);
        match outcome {
            AcceptOutcome::Refused(r) => {
                if same_session {
                    self.refuse(d, &r);
                }
            }
            AcceptOutcome::Repeat {
                revision,
                resolved_shell,
            } => {
                if let Some(issue) = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid).ok()
                    && let Some(r) = self.records.get_mut(&issue)
                {
                    r.revision = r.revision.max(revision);
                }
                self.stats.repeats += 1;
                if same_session {
                    self.send(Payload::CommandAccepted(wire::CommandAccepted {
                        issue_uuid: d.issue_uuid.clone(),
                        revision: d.revision,
                        outcome: wire::AcceptOutcome::Positive as i32,
                        error: None,
                        resolved_shell: resolved_shell as i32,
                    }));
                }
            }
            AcceptOutcome::New => {
                let order = self.next_order;
                self.next_order += 1;
                if self.spool.open_command(checked.issue).is_err() {
                    return;
                }
                self.records.insert(
                    checked.issue,
                    Record {
                        request_hash: checked.request_hash,
                        revision: checked.revision,
                        resolved_shell: checked.resolved_shell,
                        cwd: checked.cwd.clone(),
                        spec: checked.spec.clone(),
                        lifecycle: wire::Lifecycle::Accepted,
                        phase: LaunchPhase::Accepted,
                        terminate: false,
                        script: checked.script,
                        script_received: 0,
                        script_committed: false,
                        script_reported: 0,
                        wrapper: None,
                        stdin_next: 1,
                        stdin_closed: false,
                        last_signal_revision: 0,
                        signalled: false,
                        cancel_pending: None,
                        exit: None,
                        retry_at: None,
                        order,
                        running_slot: false,
                        unaccountable: false,
                        terminal_attempts: 0,
                        reap_attempts: 0,
                        reap_identity: None,
                    },
                );
                self.stats.accepted += 1;
                if same_session {
                    self.send(Payload::CommandAccepted(wire::CommandAccepted {
                        issue_uuid: d.issue_uuid.clone(),
                        revision: d.revision,
                        outcome: wire::AcceptOutcome::Positive as i32,
                        error: None,
                        resolved_shell: checked.resolved_shell as i32,
                    }));
                }
            }
        }
    }
}

impl ClientCore {
    // ---- completions -------------------------------------------------------

    fn completed(&mut self, now_ms: u64, wall_ms: i64, token: Token, result: ClientCompletion) {
        let Some(pending) = self.pending.remove(&token) else {
            self.stats.stray_completions += 1;
            return;
        };
        if let ClientCompletion::Failed(_) = &result {
            self.stats.store_failures += 1;
        }
        match pending {
            Pending::Accept(d, checked, generation) => {
                let outcome = match result {
                    ClientCompletion::Accepted(o) => o,
                    // plan §7.3 step 4: a failure before the commit is a
                    // transient refusal and leaves no partial command
                    _ => AcceptOutcome::Refused(Refusal::Answer {
                        outcome: wire::AcceptOutcome::Transient,
                        error: DomainError::new(
                            Code::Unavailable,
                            "the client's local store could not record the command; retry later",
                        )
                        .with_retry(rvbox_domain::error::RetryClass::Transient),
                    }),
                };
                self.accepted(&d, &checked, generation, outcome);
            }
            Pending::Spool(st) => {
                let done = match result {
                    ClientCompletion::Spool(c) => c,
                    _ => crate::spool::SpoolCompletion::Failed,
                };
                self.spool.completed(st, done);
            }
            Pending::Generation => {}
            Pending::Tombstones(round) => {
                let tombs = match result {
                    ClientCompletion::Tombstones(t) => t,
                    // without the lookups the snapshot cannot be complete:
                    // leave the session, the next one asks again
                    _ => {
                        self.protocol_error_local(now_ms);
                        return;
                    }
                };
                self.answer_snapshot(round, tombs);
            }
            Pending::Reconcile(checked) => {
                if !matches!(result, ClientCompletion::Done) {
                    self.protocol_error_local(now_ms);
                    return;
                }
                self.apply_reconcile(now_ms, wall_ms, &checked);
            }
            Pending::Materialize(issue) => match result {
                ClientCompletion::Materialized { wrapper_path } => {
                    self.prepare(issue, wrapper_path);
                }
                other => {
                    let reason = match other {
                        ClientCompletion::Failed(r) => r,
                        _ => "the wrapper file could not be written".into(),
                    };
                    // a local file failure is transient
                    self.launch_failed(now_ms, wall_ms, issue, LaunchFailure::Transient(reason));
                }
            },
            Pending::Prepared(issue) => {
                if result == ClientCompletion::Done {
                    self.prepared(issue);
                } else {
                    // not durable: the launcher must not run; abort it
                    self.abort(issue);
                }
            }
            Pending::Authorized(issue) => {
                if result == ClientCompletion::Done {
                    if let Some(r) = self.records.get_mut(&issue)
                        && let LaunchPhase::Authorizing(id) = r.phase.clone()
                    {
                        r.phase = LaunchPhase::Released(id);
                        self.stats.launched += 1;
                        self.push(Output::Supervise(SuperviseOp::Release(issue)));
                    }
                } else {
                    self.abort(issue);
                }
            }
            Pending::Running(_) | Pending::Unprepared(_) | Pending::Ended(_) => {}
            Pending::Script(issue, offset, prefix) => {
                self.script_stored(now_ms, wall_ms, issue, offset < prefix, result);
            }
            Pending::Stdin(issue, write_seq, close_after) => {
                if let ClientCompletion::Stdin(StdinOutcome::Stored(bytes)) = result {
                    self.stdin_durable(issue, write_seq, bytes, close_after);
                    return;
                }
                // not durable, so not acknowledged: this write is expected
                // again (and every later one in flight, which the store
                // refuses as out of order), and the session ends so that
                // the server resends from it after reconnecting (stdin was
                // open before it, or it would not have been stored)
                if let Some(r) = self.records.get_mut(&issue)
                    && r.stdin_next > write_seq
                {
                    r.stdin_next = write_seq;
                    r.stdin_closed = false;
                }
                if matches!(result, ClientCompletion::Stdin(StdinOutcome::Invalid(_))) {
                    self.protocol_error(now_ms);
                } else {
                    self.protocol_error_local(now_ms);
                }
            }
            // a failure leaves the written copy until the record goes
            Pending::StdinWritten => {}
            Pending::Finish(issue) => {
                if result == ClientCompletion::Done {
                    self.records.remove(&issue);
                    self.stats.finished += 1;
                }
            }
        }
    }

    /// A local failure that makes the snapshot or its application
    /// impossible: leave the session; the next one starts over.
    fn protocol_error_local(&mut self, now_ms: u64) {
        self.link.protocol_error(now_ms);
    }

    // ---- reconciliation ------------------------------------------------------

    fn answer_snapshot(&mut self, round: u64, tombs: Vec<(Uuid7, [u8; 32])>) {
        let mut records = Vec::with_capacity(self.records.len());
        for (id, r) in &self.records {
            if r.terminate {
                continue;
            }
            let (last, acked) = self.spool.cursors(id).unwrap_or((0, 0));
            records.push(wire::SnapshotRecord {
                issue_uuid: id.to_string(),
                request_hash: r.request_hash.to_vec(),
                revision: r.revision,
                lifecycle: r.lifecycle as i32,
                last_assigned_event_seq: last,
                acked_event_seq: acked,
                script_received_bytes: r.script_received,
            });
        }
        let tombstones = tombs
            .into_iter()
            .map(|(id, hash)| wire::SnapshotTombstone {
                issue_uuid: id.to_string(),
                request_hash: hash.to_vec(),
            })
            .collect();
        let health = self.store_health;
        for r in self.records.values_mut() {
            r.script_reported = r.script_received;
        }
        self.link
            .send_snapshot(round, snapshot_chunks(round, health, records, tombstones));
        self.drain_link_sends();
    }

    fn apply_reconcile(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        checked: &rvbox_reconcile::CheckedResult,
    ) {
        for issue in &checked.terminate {
            self.terminate_here(wall_ms, *issue);
        }
        for issue in &checked.discard {
            self.spool.discard(*issue);
        }
        let mut resume = BTreeMap::new();
        for (issue, r) in &checked.resume {
            if let Some(rec) = self.records.get_mut(issue) {
                rec.revision = rec.revision.max(r.revision.0);
            }
            resume.insert(*issue, r.durable_event_seq);
        }
        self.link.activate(now_ms);
        self.spool.session_active(&resume);
        self.last_capacity = None;
    }

    /// Reconciliation says the server holds no live record: stop the tree
    /// (if any), and send nothing more for the command.
    fn terminate_here(&mut self, _wall_ms: i64, issue: Uuid7) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        r.terminate = true;
        self.spool.mute(issue);
        match r.phase.clone() {
            LaunchPhase::Running(_) | LaunchPhase::Released(_) => {
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind: wire::SignalKind::Kill,
                    revision: 0,
                }));
            }
            LaunchPhase::Prepared(_)
            | LaunchPhase::Preparing
            | LaunchPhase::RecordingPrepared(_)
            | LaunchPhase::Authorizing(_) => self.abort(issue),
            LaunchPhase::Accepted | LaunchPhase::Ended => {
                self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
                self.spool.discard(issue);
            }
            LaunchPhase::Materializing | LaunchPhase::Aborting | LaunchPhase::Reaping { .. } => {}
        }
    }

    // ---- the launch sequence ---------------------------------------------------

    fn settle(&mut self, _now_ms: u64, _wall_ms: i64) {
        self.drain_spool();
        if self.shutting_down {
            return;
        }
        self.schedule();
        self.drain_spool();
        if self.link.is_active() {
            let now = self.capacity();
            if self.last_capacity != Some(now) {
                let report = Payload::ClientCapacity(wire::ClientCapacity {
                    running: now.0,
                    queued: now.1,
                    max_running: self.config.policy.max_running,
                    max_queued: self.config.policy.max_queued,
                });
                if self.link.send(report).is_ok() {
                    self.last_capacity = Some(now);
                    self.drain_link_sends();
                }
            }
        }
    }

    fn drain_spool(&mut self) {
        while let Some(o) = self.spool.poll_output() {
            match o {
                SpoolOutput::Store(op) => {
                    let st = op.token();
                    self.store(ClientOp::Spool(op), Pending::Spool(st));
                }
                SpoolOutput::Send {
                    issue,
                    first_seq,
                    last_seq,
                } => self.push_send_events(issue, first_seq, last_seq),
                SpoolOutput::Finished { issue } => {
                    self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
                }
                SpoolOutput::TerminalDurable { issue } => {
                    let lifecycle = self
                        .records
                        .get(&issue)
                        .map_or(wire::Lifecycle::Interrupted, |r| r.lifecycle);
                    self.store(ClientOp::Ended { issue, lifecycle }, Pending::Ended(issue));
                }
                SpoolOutput::Unaccountable {
                    issue,
                    terminal_lost,
                } => self.unaccountable(issue, terminal_lost),
            }
        }
    }

    /// plan §7.2 (R-7.2-13): an essential entry or a marker could not be
    /// made durable, so the command's output can no longer be accounted
    /// for. The tree is killed, and the command ends `INTERRUPTED` after an
    /// `OutputIncomplete` event, never as a complete run; a lost terminal
    /// event is spooled again in that form, at most
    /// [`MAX_TERMINAL_ATTEMPTS`] times (a store that keeps failing leaves
    /// the command to the next start's recovery).
    fn unaccountable(&mut self, issue: Uuid7, terminal_lost: bool) {
        self.stats.unaccountable += 1;
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        r.unaccountable = true;
        if !terminal_lost {
            if matches!(
                r.phase,
                LaunchPhase::Running(_) | LaunchPhase::Released(_) | LaunchPhase::Authorizing(_)
            ) {
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind: wire::SignalKind::Kill,
                    revision: 0,
                }));
            }
            return;
        }
        if r.terminal_attempts >= MAX_TERMINAL_ATTEMPTS {
            return;
        }
        r.terminal_attempts += 1;
        let revision = r.revision;
        r.lifecycle = wire::Lifecycle::Interrupted;
        self.spool_incomplete_and_interrupted(issue, wall, revision);
    }

    /// Marks both output streams of `issue` incomplete, for `reason`.
    fn spool_incomplete(&mut self, issue: Uuid7, wall_ms: i64, reason: &str) {
        self.spool_event(
            issue,
            wall_ms,
            Body::Incomplete(wire::OutputIncomplete {
                streams: vec![
                    wire::OutputStream::Stdout as i32,
                    wire::OutputStream::Stderr as i32,
                ],
                reason: reason.into(),
            }),
        );
    }

    fn spool_incomplete_and_interrupted(&mut self, issue: Uuid7, wall_ms: i64, revision: u64) {
        self.spool_incomplete(issue, wall_ms, UNACCOUNTABLE_REASON);
        self.spool_event(
            issue,
            wall_ms,
            Body::Lifecycle(wire::LifecycleChange {
                lifecycle: wire::Lifecycle::Interrupted as i32,
                revision,
                exit_result: Some(wire::ExitResult {
                    lifecycle: wire::Lifecycle::Interrupted as i32,
                    exit_code: None,
                    signal_number: None,
                    signal_name: String::new(),
                }),
                reason: UNACCOUNTABLE_REASON.into(),
            }),
        );
    }

    /// The shell reads `first_seq..=last_seq` back from the store and sends
    /// them: a `Send` of the spool becomes an output the shell resolves.
    fn push_send_events(&mut self, issue: Uuid7, first_seq: u64, last_seq: u64) {
        if let Some(s) = self.link.session() {
            let (session_id, generation) = (s.session_id.clone(), s.generation);
            self.push(Output::SendEvents {
                issue,
                first_seq,
                last_seq,
                session_id,
                generation,
            });
        }
    }

    fn schedule(&mut self) {
        let max = usize::try_from(self.config.policy.max_running).unwrap_or(usize::MAX);
        loop {
            let running = self.records.values().filter(|r| r.running_slot).count();
            if running >= max {
                return;
            }
            let next = self
                .records
                .iter()
                .filter(|(_, r)| r.launchable() && r.retry_at.is_none())
                .min_by_key(|(_, r)| r.order)
                .map(|(id, _)| *id);
            let Some(issue) = next else {
                return;
            };
            let Some(r) = self.records.get_mut(&issue) else {
                return;
            };
            r.running_slot = true;
            r.phase = LaunchPhase::Materializing;
            let source = match &r.spec.source {
                Some(wire::execution_spec::Source::CommandText(t)) => {
                    WrapperSource::Text(t.clone())
                }
                _ => WrapperSource::Script,
            };
            let cwd = r.cwd.clone();
            self.store(
                ClientOp::Materialize { issue, cwd, source },
                Pending::Materialize(issue),
            );
        }
    }

    fn limits_of(&self, spec: &wire::ExecutionSpec) -> ResourceLimits {
        let mut l = ResourceLimits::default();
        for f in &spec.profile_flags {
            if let Some(p) = self.config.profiles.get(f) {
                l.cpu_max = l.cpu_max.or(p.cpu_max);
                l.cpu_weight = l.cpu_weight.or(p.cpu_weight);
                l.memory_max = l.memory_max.or(p.memory_max);
                l.memory_high = l.memory_high.or(p.memory_high);
                l.pids_max = l.pids_max.or(p.pids_max);
                l.io_max.extend(p.io_max.iter().copied());
            }
        }
        l
    }

    fn prepare(&mut self, issue: Uuid7, wrapper_path: String) {
        let Some(r) = self.records.get(&issue) else {
            return;
        };
        if r.phase != LaunchPhase::Materializing {
            return;
        }
        let shell = r.resolved_shell;
        let Some(shell_path) = self.config.shell_paths.get(&(shell as i32)).cloned() else {
            let reason = format!("{} is not configured on this host", shell.as_str_name());
            self.launch_failed(0, self.wall, issue, LaunchFailure::Permanent(reason));
            return;
        };
        let spec = LaunchSpec {
            issue,
            shell,
            shell_path,
            wrapper_path: wrapper_path.clone(),
            cwd: r.cwd.clone(),
            env: r
                .spec
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            limits: self.limits_of(&r.spec),
        };
        if let Some(r) = self.records.get_mut(&issue) {
            r.wrapper = Some(wrapper_path);
            r.phase = LaunchPhase::Preparing;
        }
        self.push(Output::Supervise(SuperviseOp::Prepare(Box::new(spec))));
    }

    /// `launch_prepared` is durable: recheck the revision and a pending
    /// cancellation while the launcher is blocked (plan §7.4 step 3).
    fn prepared(&mut self, issue: Uuid7) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let LaunchPhase::RecordingPrepared(id) = r.phase.clone() else {
            return;
        };
        if r.cancel_pending.is_some() || r.terminate || self.shutting_down {
            r.phase = LaunchPhase::Prepared(id);
            self.abort(issue);
            return;
        }
        r.phase = LaunchPhase::Authorizing(id);
        self.store(
            ClientOp::LaunchAuthorized { issue },
            Pending::Authorized(issue),
        );
    }

    fn abort(&mut self, issue: Uuid7) {
        if let Some(r) = self.records.get_mut(&issue) {
            r.phase = LaunchPhase::Aborting;
            self.stats.aborted += 1;
            self.push(Output::Supervise(SuperviseOp::Abort(issue)));
        }
    }

    fn launch_failed(&mut self, now_ms: u64, wall_ms: i64, issue: Uuid7, f: LaunchFailure) {
        match f {
            LaunchFailure::Permanent(reason) => {
                self.end(wall_ms, issue, wire::Lifecycle::Rejected, None, &reason);
            }
            LaunchFailure::Transient(_) => {
                if let Some(r) = self.records.get_mut(&issue) {
                    r.phase = LaunchPhase::Accepted;
                    r.running_slot = false;
                    r.retry_at = Some(now_ms.saturating_add(LAUNCH_RETRY_MS));
                    self.store(ClientOp::Unprepared { issue }, Pending::Unprepared(issue));
                }
            }
        }
    }

    /// Spools the terminal event and releases the slot. The terminal event
    /// is always the last.
    fn end(
        &mut self,
        wall_ms: i64,
        issue: Uuid7,
        lifecycle: wire::Lifecycle,
        exit: Option<wire::ExitResult>,
        reason: &str,
    ) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if r.phase == LaunchPhase::Ended {
            return;
        }
        r.phase = LaunchPhase::Ended;
        r.lifecycle = lifecycle;
        r.running_slot = false;
        let revision = r.revision;
        let terminate = r.terminate;
        self.stats.ended += 1;
        if terminate {
            // the server holds no live record: nothing is sent; the record
            // goes straight to its tombstone
            self.spool.discard(issue);
            self.store(ClientOp::Finish { issue }, Pending::Finish(issue));
            return;
        }
        if r.unaccountable {
            r.lifecycle = wire::Lifecycle::Interrupted;
            self.spool_incomplete_and_interrupted(issue, wall_ms, revision);
            return;
        }
        let mut reason = reason.to_owned();
        reason.truncate(1024);
        let exit_result = exit.unwrap_or(wire::ExitResult {
            lifecycle: lifecycle as i32,
            exit_code: None,
            signal_number: None,
            signal_name: String::new(),
        });
        // the slot is released once the terminal entry is durable
        // (SpoolOutput::TerminalDurable), never before
        self.spool_event(
            issue,
            wall_ms,
            Body::Lifecycle(wire::LifecycleChange {
                lifecycle: lifecycle as i32,
                revision,
                exit_result: Some(exit_result),
                reason,
            }),
        );
    }

    /// Spools the result of a signal sent through RVBox.
    fn signal_result(
        &mut self,
        issue: Uuid7,
        wall_ms: i64,
        revision: u64,
        kind: wire::SignalKind,
        outcome: wire::SignalOutcome,
        reason: &str,
    ) {
        self.spool_event(
            issue,
            wall_ms,
            Body::SignalResult(wire::SignalResult {
                revision,
                signal: kind as i32,
                outcome: outcome as i32,
                reason: reason.to_owned(),
            }),
        );
    }

    fn spool_event(&mut self, issue: Uuid7, wall_ms: i64, body: Body) {
        if let Err(e) = self.spool.event(issue, wall_ms, body) {
            // a command ended or unknown to the spool: nothing to record
            debug_assert!(
                !matches!(e, crate::spool::SpoolError::Full(_)),
                "essential reserve exhausted: {e}"
            );
        }
    }

    // ---- process events ----------------------------------------------------------

    fn process(&mut self, now_ms: u64, wall_ms: i64, ev: CommandProcessEvent) {
        let issue = ev.issue;
        match ev.event {
            ProcessEvent::Ready(identity) => {
                let Some(r) = self.records.get_mut(&issue) else {
                    return;
                };
                if r.phase != LaunchPhase::Preparing {
                    return;
                }
                r.phase = LaunchPhase::RecordingPrepared(identity.clone());
                self.store(
                    ClientOp::LaunchPrepared { issue, identity },
                    Pending::Prepared(issue),
                );
            }
            ProcessEvent::Failed(f) => self.launch_failed(now_ms, wall_ms, issue, f),
            ProcessEvent::Running => {
                let Some(r) = self.records.get_mut(&issue) else {
                    return;
                };
                if let LaunchPhase::Released(id) = r.phase.clone() {
                    r.phase = LaunchPhase::Running(id);
                    r.lifecycle = wire::Lifecycle::Running;
                    let revision = r.revision;
                    // RUNNING is spooled at once, before any output of the
                    // tree can be (the spool's order is the command's)
                    self.spool_event(
                        issue,
                        wall_ms,
                        Body::Lifecycle(wire::LifecycleChange {
                            lifecycle: wire::Lifecycle::Running as i32,
                            revision,
                            exit_result: None,
                            reason: String::new(),
                        }),
                    );
                    self.store(ClientOp::Running { issue }, Pending::Running(issue));
                }
            }
            ProcessEvent::Output {
                stream,
                observed_ms,
                bytes,
            } => {
                if self.records.get(&issue).is_some_and(|r| !r.terminate) {
                    let _ = self.spool.output(issue, stream, observed_ms, bytes);
                }
            }
            ProcessEvent::Dropped {
                stream,
                raw_bytes,
                first_ms,
                last_ms,
            } => {
                let _ = self
                    .spool
                    .dropped_upstream(issue, stream, raw_bytes, first_ms, last_ms);
            }
            ProcessEvent::StdinWritten { write_seq } => {
                let closed = self.records.get(&issue).is_some_and(|r| r.stdin_closed);
                self.store(
                    ClientOp::StdinWritten { issue, write_seq },
                    Pending::StdinWritten,
                );
                self.spool_event(
                    issue,
                    wall_ms,
                    Body::StdinAck(wire::StdinAck {
                        write_seq,
                        delivery: wire::StdinDelivery::Written as i32,
                        closed,
                        reason: String::new(),
                    }),
                );
            }
            ProcessEvent::Diagnostics(d) => {
                // only while the tree runs, and never from the reserve
                // kept for lifecycle events and markers
                let running = self.records.get(&issue).is_some_and(|r| {
                    matches!(r.phase, LaunchPhase::Running(_)) && r.exit.is_none()
                });
                if running {
                    // refused at the entry cap: the next change is sent
                    let _ = self.spool.diagnostics(issue, wall_ms, d);
                }
            }
            ProcessEvent::Exited(exit) => {
                if let Some(r) = self.records.get_mut(&issue) {
                    r.exit = Some(exit);
                }
            }
            ProcessEvent::Drained { incomplete } => self.drained(wall_ms, issue, incomplete),
        }
    }

    fn drained(&mut self, wall_ms: i64, issue: Uuid7, incomplete: Vec<wire::OutputStream>) {
        let Some(r) = self.records.get(&issue) else {
            return;
        };
        match r.phase {
            LaunchPhase::Aborting => {
                // the launcher is gone without running anything
                let (cancelled, terminate) = (r.cancel_pending, r.terminate);
                if terminate {
                    self.end(wall_ms, issue, wire::Lifecycle::Cancelled, None, "");
                } else if let Some((revision, kind)) = cancelled {
                    self.spool_event(
                        issue,
                        wall_ms,
                        Body::SignalResult(wire::SignalResult {
                            revision,
                            signal: kind as i32,
                            outcome: wire::SignalOutcome::CancelledBeforeLaunch as i32,
                            reason: String::new(),
                        }),
                    );
                    self.end(
                        wall_ms,
                        issue,
                        wire::Lifecycle::Cancelled,
                        None,
                        "cancelled before launch",
                    );
                } else if self.shutting_down {
                    // verified dead before release: it may run after the restart
                } else {
                    // a failed durable step aborted it: try again later
                    self.launch_failed(
                        0,
                        wall_ms,
                        issue,
                        LaunchFailure::Transient("aborted".into()),
                    );
                }
            }
            LaunchPhase::Running(_) | LaunchPhase::Released(_) => {
                if !incomplete.is_empty() {
                    let mut streams: Vec<i32> = incomplete.iter().map(|s| *s as i32).collect();
                    streams.sort_unstable();
                    streams.dedup();
                    self.spool_event(
                        issue,
                        wall_ms,
                        Body::Incomplete(wire::OutputIncomplete {
                            streams,
                            reason: "output pipes were still open after the drain grace period"
                                .into(),
                        }),
                    );
                }
                let (lifecycle, exit) = self.outcome(issue);
                if self.shutting_down {
                    // plan §7.4: an orderly shutdown terminates surviving
                    // trees and reports them interrupted
                    self.stats.interrupted += 1;
                    self.end(
                        wall_ms,
                        issue,
                        wire::Lifecycle::Interrupted,
                        None,
                        "the client daemon shut down while the command ran",
                    );
                } else {
                    self.end(wall_ms, issue, lifecycle, Some(exit), "");
                }
            }
            _ => {
                // drained before running (a failed exec): the Failed event
                // ends it; nothing else to do
            }
        }
    }

    /// plan, spec-mapping: succeeded = exit 0; failed = non-zero or a signal
    /// not sent through RVBox; terminated = ended by a signal sent through
    /// RVBox.
    fn outcome(&self, issue: Uuid7) -> (wire::Lifecycle, wire::ExitResult) {
        let r = self.records.get(&issue);
        let signalled = r.is_some_and(|r| r.signalled);
        let exit = r.and_then(|r| r.exit);
        let (lifecycle, code, signal) = match exit {
            Some(Exit::Code(0)) if !signalled => (wire::Lifecycle::Succeeded, Some(0), None),
            Some(Exit::Code(c)) if !signalled => (wire::Lifecycle::Failed, Some(c), None),
            Some(Exit::Code(c)) => (wire::Lifecycle::Terminated, Some(c), None),
            Some(Exit::Signal(n)) if signalled => (wire::Lifecycle::Terminated, None, Some(n)),
            Some(Exit::Signal(n)) => (wire::Lifecycle::Failed, None, Some(n)),
            None => (wire::Lifecycle::Interrupted, None, None),
        };
        (
            lifecycle,
            wire::ExitResult {
                lifecycle: lifecycle as i32,
                exit_code: code,
                signal_number: signal,
                signal_name: signal.map(signal_name).unwrap_or_default().to_owned(),
            },
        )
    }

    /// A command that ran while the daemon stopped without its orderly
    /// shutdown: what it wrote after the last spooled chunk (in its pipes,
    /// or read and not yet spooled) was not captured, so its output is
    /// marked incomplete before the terminal event, never a silent gap.
    fn lost_at_restart(&mut self, issue: Uuid7, wall_ms: i64) {
        self.spool_incomplete(issue, wall_ms, LOST_AT_RESTART_REASON);
    }

    fn reaped(&mut self, now_ms: u64, wall_ms: i64, issue: Uuid7, gone: bool) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let LaunchPhase::Reaping { authorized } = r.phase else {
            return;
        };
        if !gone && authorized {
            // not verifiably gone, so not killed: the slot stays taken and
            // the check is tried again; after the last try the command ends
            // interrupted, its tree possibly still alive (never launched
            // again either way)
            r.reap_attempts = r.reap_attempts.saturating_add(1);
            if r.reap_attempts < MAX_REAP_ATTEMPTS {
                r.retry_at = Some(now_ms.saturating_add(REAP_RETRY_MS));
                return;
            }
            self.stats.interrupted += 1;
            self.stats.unverified_trees += 1;
            self.lost_at_restart(issue, wall_ms);
            self.end(
                wall_ms,
                issue,
                wire::Lifecycle::Interrupted,
                None,
                "the client restarted while the command ran, and could not verify that its process tree is gone; it may still be running",
            );
            return;
        }
        // a prepared launch that cannot be verified gone never ran user
        // code and never can (its release channel died with the daemon):
        // like a gone one, it may be launched again
        if authorized {
            // plan §7.4 step 5: authorized but uncertain: killed as a tree,
            // ends interrupted, never launched again
            self.stats.interrupted += 1;
            self.lost_at_restart(issue, wall_ms);
            self.end(
                wall_ms,
                issue,
                wire::Lifecycle::Interrupted,
                None,
                "the client restarted while the command ran; its outcome is unknown",
            );
        } else {
            r.phase = LaunchPhase::Accepted;
            r.running_slot = false;
            self.store(ClientOp::Unprepared { issue }, Pending::Unprepared(issue));
        }
    }

    // ---- signals -----------------------------------------------------------------

    fn signal(&mut self, now_ms: u64, s: wire::Signal) {
        let Ok(issue) = Uuid7::parse("signal.issue_uuid", &s.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let kind = wire::SignalKind::try_from(s.signal).unwrap_or(wire::SignalKind::Unspecified);
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            // unknown or tombstoned: reconciliation settles it
            return;
        };
        if s.revision <= r.last_signal_revision || r.terminate {
            return;
        }
        r.last_signal_revision = s.revision;
        r.revision = r.revision.max(s.revision);
        match r.phase.clone() {
            LaunchPhase::Accepted => {
                r.cancel_pending = Some((s.revision, kind));
                self.signal_result(
                    issue,
                    wall,
                    s.revision,
                    kind,
                    wire::SignalOutcome::CancelledBeforeLaunch,
                    "",
                );
                self.end(
                    wall,
                    issue,
                    wire::Lifecycle::Cancelled,
                    None,
                    "cancelled before launch",
                );
            }
            LaunchPhase::Materializing
            | LaunchPhase::Preparing
            | LaunchPhase::RecordingPrepared(_) => {
                // the launcher is not authorized: abort once it is prepared
                r.cancel_pending = Some((s.revision, kind));
            }
            LaunchPhase::Prepared(_) => {
                r.cancel_pending = Some((s.revision, kind));
                self.abort(issue);
            }
            LaunchPhase::Authorizing(_) | LaunchPhase::Released(_) | LaunchPhase::Running(_) => {
                if signal_number(kind).is_none() {
                    self.signal_result(
                        issue,
                        wall,
                        s.revision,
                        kind,
                        wire::SignalOutcome::Failed,
                        "unsupported signal",
                    );
                    return;
                }
                self.push(Output::Supervise(SuperviseOp::Signal {
                    issue,
                    kind,
                    revision: s.revision,
                }));
            }
            LaunchPhase::Ended => {
                self.signal_result(
                    issue,
                    wall,
                    s.revision,
                    kind,
                    wire::SignalOutcome::NoOpAfterExit,
                    "",
                );
            }
            LaunchPhase::Aborting | LaunchPhase::Reaping { .. } => {}
        }
    }

    fn signalled(
        &mut self,
        wall_ms: i64,
        issue: Uuid7,
        kind: wire::SignalKind,
        revision: u64,
        outcome: wire::SignalOutcome,
    ) {
        if revision == 0 {
            // an internal kill (reconciliation, unaccountable output)
            return;
        }
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if outcome == wire::SignalOutcome::Delivered {
            r.signalled = true;
        }
        if r.phase == LaunchPhase::Ended {
            return;
        }
        self.spool_event(
            issue,
            wall_ms,
            Body::SignalResult(wire::SignalResult {
                revision,
                signal: kind as i32,
                outcome: outcome as i32,
                reason: String::new(),
            }),
        );
    }

    // ---- stdin --------------------------------------------------------------------

    fn stdin(&mut self, now_ms: u64, w: wire::StdinWrite) {
        let Ok(issue) = Uuid7::parse("stdin_write.issue_uuid", &w.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if w.write_seq < r.stdin_next || r.terminate {
            return; // a replay: acknowledged already (or being)
        }
        if w.write_seq != r.stdin_next {
            self.protocol_error(now_ms);
            return;
        }
        // the store decodes the payload and checks it against the raw
        // length and digest; the envelope's fields are checked here
        let compression = wire::Compression::try_from(w.compression).ok();
        let newline = wire::StdinNewline::try_from(w.newline).ok();
        if u64::from(w.raw_length) > MAX_STDIN_WRITE_BYTES
            || usize::try_from(w.stored_length).ok() != Some(w.payload.len())
            || w.raw_sha256.len() != 32
            || !matches!(
                compression,
                Some(wire::Compression::None | wire::Compression::Zstd)
            )
            || !matches!(
                newline,
                Some(wire::StdinNewline::Append | wire::StdinNewline::Raw)
            )
        {
            self.protocol_error(now_ms);
            return;
        }
        r.stdin_next = w.write_seq.saturating_add(1);
        let open = matches!(
            r.phase,
            LaunchPhase::Running(_) | LaunchPhase::Released(_) | LaunchPhase::Authorizing(_)
        ) && !r.stdin_closed;
        if w.close_after {
            r.stdin_closed = true;
        }
        if !open {
            let closed = r.stdin_closed;
            self.spool_event(
                issue,
                wall,
                Body::StdinAck(wire::StdinAck {
                    write_seq: w.write_seq,
                    delivery: wire::StdinDelivery::Discarded as i32,
                    closed,
                    reason: "stdin is not open".into(),
                }),
            );
            return;
        }
        let (write_seq, close_after) = (w.write_seq, w.close_after);
        self.store(
            ClientOp::StdinWrite {
                issue,
                write: Box::new(w),
            },
            Pending::Stdin(issue, write_seq, close_after),
        );
    }

    fn stdin_durable(&mut self, issue: Uuid7, write_seq: u64, bytes: Vec<u8>, close_after: bool) {
        if !self.records.contains_key(&issue) {
            return;
        }
        self.push(Output::Supervise(SuperviseOp::WriteStdin {
            issue,
            write_seq,
            bytes,
        }));
        // this write's own close: a later write's close waits for it
        if close_after {
            self.push(Output::Supervise(SuperviseOp::CloseStdin(issue)));
        }
    }

    // ---- scripts ------------------------------------------------------------------

    fn script_chunk(&mut self, now_ms: u64, c: wire::ScriptChunk) {
        let Ok(issue) = Uuid7::parse("script_chunk.issue_uuid", &c.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let Some(r) = self.records.get(&issue).filter(|r| !r.terminate) else {
            // not held (or ended by reconciliation): refuse, so the server
            // ends its upload
            self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid,
                received_bytes: 0,
                state: wire::ScriptUploadState::Rejected as i32,
                error: Some(
                    DomainError::new(Code::NotFound, "the client does not hold this command")
                        .to_detail(),
                ),
            }));
            return;
        };
        let Some((size, _)) = r.script else {
            self.protocol_error(now_ms);
            return;
        };
        if r.script_committed {
            self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid,
                received_bytes: size,
                state: wire::ScriptUploadState::Committed as i32,
                error: None,
            }));
            return;
        }
        let raw = u64::from(c.raw_length);
        let end = c.offset.checked_add(raw);
        // placement and window: at the prefix or an exact replay below it,
        // within the declared size and the server's 1 MiB window
        let ok = (1..=MAX_SCRIPT_CHUNK_BYTES).contains(&raw)
            && c.declared_size == size
            && end.is_some_and(|e| e <= size)
            && c.offset <= r.script_received
            && end.is_some_and(|e| e <= r.script_reported.saturating_add(SCRIPT_WINDOW_BYTES));
        if !ok {
            self.protocol_error(now_ms);
            return;
        }
        let prefix = r.script_received;
        let offset = c.offset;
        self.store(
            ClientOp::ScriptChunk {
                issue,
                chunk: Box::new(c),
            },
            Pending::Script(issue, offset, prefix),
        );
    }

    fn script_stored(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        issue: Uuid7,
        replay: bool,
        result: ClientCompletion,
    ) {
        let outcome = match result {
            ClientCompletion::Script(o) => o,
            // a local write failure: nothing advanced; the server resends
            _ => return,
        };
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let id = issue.to_string();
        match outcome {
            ScriptOutcome::Invalid(_) => self.protocol_error(now_ms),
            ScriptOutcome::Mismatch(reason) => {
                self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                    issue_uuid: id,
                    received_bytes: 0,
                    state: wire::ScriptUploadState::Rejected as i32,
                    error: Some(DomainError::new(Code::InvalidArgument, &reason).to_detail()),
                }));
                self.end(wall_ms, issue, wire::Lifecycle::Rejected, None, &reason);
            }
            ScriptOutcome::Committed => {
                let size = r.script.map_or(0, |(s, _)| s);
                r.script_received = size;
                r.script_committed = true;
                r.script_reported = size;
                self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                    issue_uuid: id,
                    received_bytes: size,
                    state: wire::ScriptUploadState::Committed as i32,
                    error: None,
                }));
            }
            ScriptOutcome::Received { received } => {
                r.script_received = r.script_received.max(received);
                // a replay is answered at once: the server may be resending
                // what this client holds and must learn to skip ahead
                let due = received.saturating_sub(r.script_reported) >= SCRIPT_STATUS_EVERY_BYTES;
                if due || replay {
                    r.script_reported = r.script_received;
                    let received = r.script_received;
                    self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                        issue_uuid: id,
                        received_bytes: received,
                        state: wire::ScriptUploadState::Receiving as i32,
                        error: None,
                    }));
                }
            }
        }
    }
}
