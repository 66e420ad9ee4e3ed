//! The RVBox client runtime: the thin loop around the client core (plan
//! §7, conventions rule 11). Each input goes to one `ClientCore::handle`;
//! every output is then performed: durable steps against the client store
//! (their completions fed back as inputs), supervisor steps against a
//! [`Supervisor`], frames handed to the transport through [`Wire`]; the one
//! timer is re-armed at the core's deadline.
//!
//! Owns: the order outputs are performed in, reading sequenced events back
//! from the spool for sending, and the mapping of supervisor answers to
//! inputs. The clocks come from an [`Env`]: the system's in production
//! ([`SystemEnv`]), the simulator's own there, which also sees every store
//! operation (to inject a storage failure, and to keep its ledger). The
//! simulator runs this same loop; it has no copy of it.
//!
//! Must never: decide anything of the protocol (the core does), hold a
//! frame the core has not released, or block on the network: the
//! transport is the caller's, and this loop only queues frames for it.

pub mod profiles;
pub mod settings;

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime};

use prost::Message as _;
use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::machine::{ClientCore, ClientCoreConfig, Input, Output};
use rvbox_client_core::ops::{ClientCompletion, ClientOp, SuperviseOp};
use rvbox_client_core::process::{
    CommandProcessEvent, HolderLoss, LaunchFailure, ProcessEvent, TerminalEvent,
    TerminalProcessEvent,
};
use rvbox_client_core::spool::SpoolOp;
use rvbox_client_store::{ClientStore, StoreError};
use rvbox_proto::v1 as wire;
use rvbox_supervisor::{OrphanOutcome, Supervisor, SupervisorError};

/// What the transport is asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wire {
    /// Open a connection to the server.
    Dial,
    /// Send one binary frame on the control lane.
    Binary(Vec<u8>),
    /// Send one binary frame on the data lane (terminal traffic): the
    /// transport writes the control lane, pings and pongs first.
    Data(Vec<u8>),
    /// Send a WebSocket Ping.
    Ping,
    /// Send a WebSocket Pong.
    Pong,
    /// Close the connection with this code.
    Close(u16),
}

/// Most frames waiting for the transport. The core's send windows bound
/// what it releases; this is the backstop.
pub const MAX_WIRE: usize = 65_536;
/// Most frame bytes waiting for the transport (the backstop in bytes:
/// the session send window, 8 MiB by default, and terminal traffic fit
/// many times over).
pub const MAX_WIRE_BYTES: usize = 64 * 1024 * 1024;
/// Most heartbeats (pings and pongs) waiting for the transport; they wait
/// apart from every other frame, and one more than this is dropped (a
/// heartbeat carries nothing, and the next one replaces it).
pub const MAX_HEARTBEATS: usize = 16;
/// Most rounds one settle performs before returning.
pub const MAX_STEPS: usize = 1_000_000;
/// Most process events handled together (their appends are one group).
pub const MAX_EVENTS_PER_PUMP: usize = 256;

/// The bytes a frame holds (a link step counts as none).
fn wire_len(w: &Wire) -> usize {
    match w {
        Wire::Binary(b) | Wire::Data(b) => b.len(),
        Wire::Dial | Wire::Ping | Wire::Pong | Wire::Close(_) => 0,
    }
}

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The store failed.
    #[error("client store: {0}")]
    Store(#[from] StoreError),
    /// The store holds more than the spool can track.
    #[error("client spool: {0}")]
    Spool(#[from] rvbox_client_core::spool::SpoolError),
}

/// What the loop needs from its surroundings besides the store and the
/// supervisor: the two clocks, and a look at every store operation.
pub trait Env {
    /// Monotonic milliseconds (only differences matter).
    fn now_ms(&self) -> u64;
    /// Wall-clock UTC milliseconds since the Unix epoch.
    fn wall_ms(&self) -> i64;
    /// A store operation about to be performed. An answer replaces the
    /// store's (a storage failure the simulator injects before anything
    /// commits); production answers `None`.
    fn intercept(&mut self, _op: &ClientOp) -> Option<ClientCompletion> {
        None
    }
    /// A store operation's completion, as the core is about to see it.
    fn completed(&mut self, _op: &ClientOp, _done: &ClientCompletion) {}
}

/// The production environment: the system's clocks, the store untouched.
#[derive(Debug, Clone, Copy)]
pub struct SystemEnv {
    start: Instant,
}

impl SystemEnv {
    /// Monotonic time counts from now.
    #[must_use]
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Default for SystemEnv {
    fn default() -> Self {
        Self::new()
    }
}

impl Env for SystemEnv {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn wall_ms(&self) -> i64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// The loop's state.
#[derive(Debug)]
pub struct Runtime<S: Supervisor, E: Env = SystemEnv> {
    core: ClientCore,
    store: ClientStore,
    supervisor: S,
    env: E,
    policy: AcceptPolicy,
    wire: VecDeque<Wire>,
    /// Bytes of the frames in `wire`.
    wire_bytes: usize,
    /// Pings and pongs, apart from `wire` so frames never delay them.
    heartbeats: VecDeque<Wire>,
    /// Heartbeats dropped because [`MAX_HEARTBEATS`] were waiting.
    heartbeats_dropped: u64,
    /// Connections ended because the transport queue was full.
    wire_overflows: u64,
    inputs: VecDeque<Input>,
    /// Replays that took more than one read-back of the spool (a run of
    /// pinned events longer than one read returns).
    long_replays: u64,
}

impl<S: Supervisor> Runtime<S> {
    /// The runtime over an opened store, on the system's clocks: restores
    /// the records and the spool, and starts the core (which reaps
    /// recorded launches first).
    ///
    /// # Errors
    /// [`RuntimeError`] when the store cannot be read back.
    pub fn new(
        config: ClientCoreConfig,
        store: ClientStore,
        supervisor: S,
        seed: u64,
    ) -> Result<Self, RuntimeError> {
        Self::with_env(config, store, supervisor, SystemEnv::new(), seed)
    }
}

impl<S: Supervisor, E: Env> Runtime<S, E> {
    /// The runtime over an opened store in `env`.
    ///
    /// # Errors
    /// [`RuntimeError`] when the store cannot be read back.
    pub fn with_env(
        config: ClientCoreConfig,
        store: ClientStore,
        supervisor: S,
        env: E,
        seed: u64,
    ) -> Result<Self, RuntimeError> {
        let records = store.restore_records()?;
        let spool = store.restore_spool()?;
        let floor = store.last_generation()?;
        let terminals = store.restore_terminals()?;
        let policy = config.policy.clone();
        let mut core = ClientCore::new(config, records, spool, floor, seed, env.now_ms())?;
        if !terminals.is_empty() {
            tracing::info!(
                terminals = terminals.len(),
                "terminal records restored; open ones are adopted"
            );
        }
        core.restore_terminals(terminals, env.wall_ms());
        let mut rt = Self {
            core,
            store,
            supervisor,
            env,
            policy,
            wire: VecDeque::new(),
            wire_bytes: 0,
            heartbeats: VecDeque::new(),
            heartbeats_dropped: 0,
            wire_overflows: 0,
            inputs: VecDeque::new(),
            long_replays: 0,
        };
        rt.refresh_health();
        rt.settle();
        Ok(rt)
    }

    fn now_ms(&self) -> u64 {
        self.env.now_ms()
    }

    fn wall_ms(&self) -> i64 {
        self.env.wall_ms()
    }

    /// The environment.
    #[must_use]
    pub fn env(&self) -> &E {
        &self.env
    }

    /// The environment, mutably.
    pub fn env_mut(&mut self) -> &mut E {
        &mut self.env
    }

    /// The supervisor, mutably.
    pub fn supervisor_mut(&mut self) -> &mut S {
        &mut self.supervisor
    }

    /// The core (for health and counters).
    #[must_use]
    pub fn core(&self) -> &ClientCore {
        &self.core
    }

    /// The store (for health and counters).
    #[must_use]
    pub fn store(&self) -> &ClientStore {
        &self.store
    }

    /// The supervisor.
    #[must_use]
    pub fn supervisor(&self) -> &S {
        &self.supervisor
    }

    /// Replays that needed more than one read-back of the spool since the
    /// last call (the simulator's coverage of long replays).
    pub fn take_long_replays(&mut self) -> u64 {
        std::mem::take(&mut self.long_replays)
    }

    /// The frames released for the transport: the waiting heartbeats,
    /// then every other frame in order.
    pub fn take_wire(&mut self) -> Vec<Wire> {
        self.wire_bytes = 0;
        self.heartbeats
            .drain(..)
            .chain(self.wire.drain(..))
            .collect()
    }

    /// The waiting heartbeats (pings and pongs), which a transport sends
    /// on a lane no other frame can block.
    pub fn take_heartbeats(&mut self) -> Vec<Wire> {
        self.heartbeats.drain(..).collect()
    }

    /// The next frame for the transport other than a heartbeat, in order
    /// (a transport with a bounded queue takes one at a time while it has
    /// room, and the rest wait here, within [`MAX_WIRE`] and
    /// [`MAX_WIRE_BYTES`]).
    pub fn pop_wire(&mut self) -> Option<Wire> {
        let w = self.wire.pop_front()?;
        self.wire_bytes = self.wire_bytes.saturating_sub(wire_len(&w));
        Some(w)
    }

    /// Frames and their bytes waiting for the transport (heartbeats
    /// apart).
    #[must_use]
    pub fn wire_pending(&self) -> (usize, usize) {
        (self.wire.len(), self.wire_bytes)
    }

    /// Heartbeats dropped and connections ended because the transport
    /// queue was full, since start.
    #[must_use]
    pub fn wire_stats(&self) -> (u64, u64) {
        (self.heartbeats_dropped, self.wire_overflows)
    }

    /// One input from the transport (or shutdown), then everything it
    /// causes. A frame is preceded by a refresh of the store health the
    /// next snapshot reports.
    pub fn input(&mut self, input: Input) {
        if matches!(input, Input::Frame(_)) {
            self.refresh_health();
        }
        self.inputs.push_back(input);
        self.settle();
    }

    fn refresh_health(&mut self) {
        let health = self.store.reconcile_health().unwrap_or_else(|e| {
            tracing::error!(error = %e, "client store health unreadable; reporting it unavailable");
            wire::ScopeState::Unavailable
        });
        self.core.set_store_health(health);
    }

    /// How long until the core's deadline (`None`: no timer).
    #[must_use]
    pub fn until_deadline(&self) -> Option<Duration> {
        self.core
            .poll_timeout()
            .map(|t| Duration::from_millis(t.saturating_sub(self.now_ms())))
    }

    /// Fires the core's timer if it is due.
    pub fn tick(&mut self) {
        let now = self.now_ms();
        if self.core.poll_timeout().is_some_and(|t| t <= now) {
            self.core.handle_timeout(now, self.wall_ms());
            self.settle();
        }
    }

    /// Waits at most `timeout` for one process event, then takes every
    /// event already waiting (at most [`MAX_EVENTS_PER_PUMP`] of the
    /// commands' and as many of the terminals') and handles them together,
    /// so that their spool appends share one durable group. Returns
    /// whether any came.
    pub fn pump_processes(&mut self, timeout: Duration) -> bool {
        let mut any = false;
        if let Some(first) = self.supervisor.next_event(timeout) {
            any = true;
            self.inputs.push_back(Input::Process(first));
            for _ in 1..MAX_EVENTS_PER_PUMP {
                match self.supervisor.next_event(Duration::ZERO) {
                    Some(ev) => self.inputs.push_back(Input::Process(ev)),
                    None => break,
                }
            }
        }
        for _ in 0..MAX_EVENTS_PER_PUMP {
            match self.supervisor.next_terminal_event() {
                Some(ev) => {
                    any = true;
                    log_terminal_event(&ev);
                    self.inputs.push_back(Input::Terminal(ev));
                }
                None => break,
            }
        }
        if any {
            self.settle();
        }
        any
    }

    /// Handles every queued input, then performs every output they caused
    /// (consecutive spool appends as one group), and again until nothing
    /// is left.
    fn settle(&mut self) {
        for _ in 0..MAX_STEPS {
            let mut handled = false;
            while let Some(input) = self.inputs.pop_front() {
                let now = self.now_ms();
                let wall = self.wall_ms();
                self.core.handle(now, wall, input);
                handled = true;
            }
            let mut outs = Vec::new();
            while let Some(o) = self.core.poll_output() {
                outs.push(o);
            }
            if outs.is_empty() && !handled && self.inputs.is_empty() {
                return;
            }
            self.perform_all(outs);
        }
        tracing::error!("the client core did not settle within the step bound");
    }

    fn perform_all(&mut self, outs: Vec<Output>) {
        let mut group: Vec<(rvbox_client_core::ops::Token, Box<SpoolOp>)> = Vec::new();
        for out in outs {
            match out {
                Output::Store(t, ClientOp::Spool(op)) if matches!(*op, SpoolOp::Append { .. }) => {
                    group.push((t, op));
                }
                other => {
                    self.flush_appends(&mut group);
                    self.perform(other);
                }
            }
        }
        self.flush_appends(&mut group);
    }

    fn flush_appends(&mut self, group: &mut Vec<(rvbox_client_core::ops::Token, Box<SpoolOp>)>) {
        if group.is_empty() {
            return;
        }
        let ops: Vec<&SpoolOp> = group.iter().map(|(_, op)| op.as_ref()).collect();
        let wall = self.wall_ms();
        let done = self.store.perform_spool_appends(&ops, wall);
        for ((t, _), d) in group.drain(..).zip(done) {
            self.inputs
                .push_back(Input::Completion(t, ClientCompletion::Spool(d)));
        }
    }

    fn push_wire(&mut self, w: Wire) {
        if matches!(w, Wire::Ping | Wire::Pong) {
            if self.heartbeats.len() >= MAX_HEARTBEATS {
                self.heartbeats_dropped += 1;
                tracing::debug!("heartbeat queue full; heartbeat dropped");
            } else {
                self.heartbeats.push_back(w);
            }
            return;
        }
        let len = wire_len(&w);
        if self.wire.len() >= MAX_WIRE || self.wire_bytes.saturating_add(len) > MAX_WIRE_BYTES {
            // the transport stopped draining: drop the connection rather
            // than grow; the spool resends everything pinned
            tracing::warn!(
                frames = self.wire.len(),
                bytes = self.wire_bytes,
                "transport queue full; closing the connection"
            );
            self.wire_overflows += 1;
            self.wire.clear();
            self.wire_bytes = 0;
            self.heartbeats.clear();
            self.abandon_session();
            return;
        }
        self.wire_bytes += len;
        self.wire.push_back(w);
    }

    fn perform(&mut self, out: Output) {
        match out {
            Output::Dial => self.push_wire(Wire::Dial),
            Output::Send(b) => self.push_wire(Wire::Binary(b)),
            Output::SendData(b) => self.push_wire(Wire::Data(b)),
            Output::SendPing => self.push_wire(Wire::Ping),
            Output::SendPong => self.push_wire(Wire::Pong),
            Output::Close(c) => self.push_wire(Wire::Close(c)),
            Output::SendEvents {
                issue,
                first_seq,
                last_seq,
                session_id,
                generation,
            } => self.send_events(&issue, first_seq, last_seq, &session_id, generation),
            Output::Store(token, op) => {
                let done = match self.env.intercept(&op) {
                    Some(injected) => injected,
                    None => {
                        let wall = self.wall_ms();
                        self.store.perform(&self.policy, &op, wall)
                    }
                };
                self.env.completed(&op, &done);
                self.inputs.push_back(Input::Completion(token, done));
            }
            Output::Supervise(op) => self.supervise(op),
        }
    }

    /// Sends every event of the run `first_seq..=last_seq`, read back from
    /// the spool in batches (one read returns at most
    /// [`rvbox_client_store::spool::MAX_READ_EVENTS`]; a replay after a
    /// long partition can be many times that). A run the store cannot
    /// return whole is never sent in part: the session ends (the store
    /// records the damage) and the next one replays from the server's
    /// durable position.
    fn send_events(
        &mut self,
        issue: &rvbox_domain::ids::Uuid7,
        first_seq: u64,
        last_seq: u64,
        session_id: &str,
        generation: u64,
    ) {
        let mut next = first_seq;
        while next <= last_seq {
            let events = match self.store.read_events(issue, next, last_seq) {
                Ok(events) if !events.is_empty() => events,
                Ok(_) => {
                    tracing::error!(%issue, next, last_seq, "sequenced events are missing from the spool");
                    self.abandon_session();
                    return;
                }
                Err(e) => {
                    // a damaged record is never sent; the session ends and
                    // the store is dirty (recovery records the incident)
                    tracing::error!(error = %e, "spooled events could not be read back");
                    self.abandon_session();
                    return;
                }
            };
            if next == first_seq
                && events.len()
                    < usize::try_from(last_seq.saturating_sub(first_seq).saturating_add(1))
                        .unwrap_or(usize::MAX)
            {
                self.long_replays = self.long_replays.saturating_add(1);
                tracing::debug!(%issue, first_seq, last_seq, read = events.len(), "a replay longer than one read-back of the spool");
            }
            next = next.saturating_add(u64::try_from(events.len()).unwrap_or(u64::MAX));
            for e in events {
                let env = wire::Envelope {
                    session_id: session_id.to_owned(),
                    generation,
                    payload: Some(wire::envelope::Payload::CommandEvent(e)),
                };
                self.push_wire(Wire::Binary(env.encode_to_vec()));
            }
        }
    }

    /// Ends the connection from this side (1011) and tells the core.
    fn abandon_session(&mut self) {
        self.push_wire(Wire::Close(1011));
        self.inputs.push_back(Input::Closed(None));
    }

    fn supervise(&mut self, op: SuperviseOp) {
        match op {
            SuperviseOp::Prepare(spec) => {
                let issue = spec.issue;
                if let Err(e) = self.supervisor.prepare(*spec) {
                    self.inputs.push_back(Input::Process(CommandProcessEvent {
                        issue,
                        event: ProcessEvent::Failed(LaunchFailure::Transient(e.to_string())),
                    }));
                }
            }
            SuperviseOp::Release(issue) => {
                if let Err(e) = self.supervisor.release(&issue) {
                    tracing::error!(error = %e, "release failed");
                    self.supervisor.abort(&issue);
                }
            }
            SuperviseOp::Abort(issue) => self.supervisor.abort(&issue),
            SuperviseOp::Signal {
                issue,
                kind,
                revision,
            } => {
                let outcome = self.supervisor.signal(&issue, kind);
                self.inputs.push_back(Input::Signalled {
                    issue,
                    kind,
                    revision,
                    outcome,
                });
            }
            SuperviseOp::WriteStdin {
                issue,
                write_seq,
                bytes,
            } => {
                if let Err(e) = self.supervisor.write_stdin(&issue, write_seq, bytes) {
                    tracing::warn!(error = %e, "stdin write refused");
                }
            }
            SuperviseOp::CloseStdin(issue) => self.supervisor.close_stdin(&issue),
            SuperviseOp::Reap { issue, identity } => {
                let outcome = self.supervisor.reap_orphan(&issue, &identity);
                self.inputs.push_back(Input::Reaped {
                    issue,
                    gone: matches!(outcome, OrphanOutcome::Gone | OrphanOutcome::Killed),
                });
            }
            SuperviseOp::StopAll => self.supervisor.stop_all(),
            SuperviseOp::StartTerminal(spec) => {
                let terminal = spec.terminal;
                if let Err(e) = self.supervisor.start_terminal(*spec) {
                    tracing::warn!(%terminal, error = %e, "terminal holder not started");
                    let failure = match e {
                        SupervisorError::NoTerminals => LaunchFailure::Permanent(e.to_string()),
                        _ => LaunchFailure::Transient(e.to_string()),
                    };
                    self.terminal_input(terminal, TerminalEvent::Failed(failure));
                }
            }
            SuperviseOp::AdoptTerminal { terminal, holder } => {
                if let Err(e) = self.supervisor.adopt_terminal(&terminal, &holder) {
                    tracing::warn!(%terminal, error = %e, "terminal holder not adopted");
                    self.terminal_lost(terminal, &e);
                }
            }
            SuperviseOp::AttachTerminal { terminal, from } => {
                if let Err(e) = self.supervisor.attach_terminal(&terminal, from) {
                    tracing::warn!(%terminal, from, error = %e, "terminal attach refused");
                    self.terminal_lost(terminal, &e);
                }
            }
            SuperviseOp::TerminalInput {
                terminal,
                seq,
                bytes,
            } => {
                if let Err(e) = self.supervisor.terminal_input(&terminal, seq, bytes) {
                    // not acknowledged: the server sends it again
                    tracing::warn!(%terminal, seq, error = %e, "terminal input refused");
                    self.terminal_lost(terminal, &e);
                }
            }
            SuperviseOp::ResizeTerminal {
                terminal,
                rows,
                cols,
            } => {
                if let Err(e) = self.supervisor.resize_terminal(&terminal, rows, cols) {
                    tracing::warn!(%terminal, rows, cols, error = %e, "terminal resize refused");
                    self.terminal_lost(terminal, &e);
                }
            }
            SuperviseOp::CloseTerminal(terminal) => {
                if let Err(e) = self.supervisor.close_terminal(&terminal) {
                    tracing::warn!(%terminal, error = %e, "terminal close refused");
                    self.terminal_lost(terminal, &e);
                }
            }
        }
    }

    fn terminal_input(&mut self, terminal: rvbox_domain::ids::Uuid7, event: TerminalEvent) {
        self.inputs
            .push_back(Input::Terminal(TerminalProcessEvent { terminal, event }));
    }

    /// A terminal the supervisor has no holder of (its thread ended, or it
    /// has no terminals at all) is lost; a busy queue only loses that one
    /// step (input is sent again by the server after a reconnect).
    fn terminal_lost(&mut self, terminal: rvbox_domain::ids::Uuid7, e: &SupervisorError) {
        if matches!(
            e,
            SupervisorError::UnknownTerminal(_) | SupervisorError::NoTerminals
        ) {
            self.terminal_input(
                terminal,
                TerminalEvent::Lost {
                    loss: HolderLoss::Gone,
                    detail: e.to_string(),
                },
            );
        }
    }

    /// Ends the runtime the way a crash does (tests): the store closes
    /// without a checkpoint; running trees are left to the next start's
    /// reaping.
    pub fn crash(self) -> S {
        self.crash_into_parts().0
    }

    /// Ends the runtime the way a crash does, keeping the supervisor and
    /// the environment (the simulator starts the next runtime with them).
    pub fn crash_into_parts(self) -> (S, E) {
        self.store.close_as_crashed();
        (self.supervisor, self.env)
    }

    /// Ends the runtime in order (after a stop): its store (closed when
    /// dropped), supervisor and environment.
    pub fn into_parts(self) -> (ClientStore, S, E) {
        (self.store, self.supervisor, self.env)
    }
}

/// A structured log line for each terminal state change (never output or
/// keys).
fn log_terminal_event(ev: &TerminalProcessEvent) {
    let terminal = ev.terminal;
    match &ev.event {
        TerminalEvent::Started(h) => {
            tracing::info!(%terminal, pid = h.pid, cgroup = ?h.cgroup, "terminal holder running");
        }
        TerminalEvent::Failed(f) => {
            tracing::warn!(%terminal, failure = ?f, "terminal start failed")
        }
        TerminalEvent::Adopted => tracing::info!(%terminal, "terminal holder adopted"),
        TerminalEvent::Exited { exit, final_offset } => {
            tracing::info!(%terminal, ?exit, final_offset, "terminal shell ended");
        }
        TerminalEvent::Lost { loss, detail } => {
            tracing::warn!(%terminal, ?loss, %detail, "terminal holder lost");
        }
        TerminalEvent::Output { .. } | TerminalEvent::InputAcked { .. } => {}
    }
}
