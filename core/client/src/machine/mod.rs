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
//!
//! This module holds the types, the input and output plumbing and the
//! routing of server messages; each concern has a submodule of its own:
//! `launch` (acceptance and the launch sequence), `process_events`
//! (process events and the end of a command), `signals`, `stdin`,
//! `scripts`, `terminals` (PTY sessions and their holders), and
//! `completions` (store completions, reconciliation and the spool's
//! outputs).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;

use crate::accept::AcceptPolicy;
use crate::link::{Link, LinkConfig, LinkEffect};
use crate::ops::{ClientCompletion, ClientOp, SuperviseOp, Token};
use crate::process::{
    CommandProcessEvent, Exit, LaunchIdentity, ResourceLimits, TerminalProcessEvent,
};
use crate::spool::{RestoredCommand, Spool, SpoolLimits, SpoolToken};

mod completions;
mod launch;
mod process_events;
mod scripts;
mod signals;
mod stdin;
pub mod terminals;

use launch::normalize_cwd;
pub use terminals::{RestoredTerminal, TerminalLimits, TerminalPhase, TerminalStats};

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
    /// Terminal bounds.
    pub terminals: TerminalLimits,
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
    /// A terminal event.
    Terminal(TerminalProcessEvent),
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
    /// Send a binary frame on the control lane (in order with every
    /// other frame of it).
    Send(Vec<u8>),
    /// Send a binary frame on the data lane (terminal traffic): it never
    /// holds up the control lane or the heartbeats.
    SendData(Vec<u8>),
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
    TermOpening(Uuid7),
    TermOpened(Uuid7),
    TermClosed(Uuid7),
    TermExpire,
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
    /// The terminals.
    terminals: terminals::Terminals,
}

fn lifecycle_of(launch: u8, lifecycle: wire::Lifecycle) -> wire::Lifecycle {
    match launch {
        4 => wire::Lifecycle::Running,
        5 => lifecycle,
        _ => wire::Lifecycle::Accepted,
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
            terminals: terminals::Terminals::default(),
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
            Input::Terminal(ev) => self.terminal_event(ev),
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
                LinkEffect::SendData(b) => self.push(Output::SendData(b)),
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
                    self.terminals_down();
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
                LinkEffect::SendData(b) => self.push(Output::SendData(b)),
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
            Payload::PtyOpen(_)
            | Payload::PtyInput(_)
            | Payload::PtyResize(_)
            | Payload::PtyAttach(_)
            | Payload::PtyOutputAck(_)
            | Payload::PtyDetach(_)
            | Payload::PtyClose(_) => self.pty_message(now_ms, payload),
            _ => {}
        }
    }
}
