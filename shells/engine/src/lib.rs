//! RVBox server engine shell (plan §6.1): the pure server core
//! ([`rvbox_server_core::ServerCore`]) and the store [`Executor`] in one
//! synchronous loop.
//!
//! Owns: the [`Executor`], which performs the core's store operations on
//! the real store and grows each run of appends into one durable group;
//! and [`Engine`], a driver for callers that run the core and the
//! executor on one thread (the simulator's scripted scenarios, tests and
//! tools): after every input it drains the core's outputs, performs
//! every store operation (grouping appends), feeds each completion back
//! as an input, and keeps the frames, pings, closes and control answers
//! for the caller. It decides nothing of the protocol.
//!
//! Must never: read a clock or the OS RNG itself (time comes with every
//! call, randomness from the injected [`Entropy`]), or hand a frame to
//! the caller before the completion it announces reached the core.

mod executor;
pub mod settings;
pub mod thread;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use rvbox_dispatch::RetryPolicy;
use rvbox_proto::v1 as wire;
use rvbox_server_core::{ControlAnswer, ControlCall, Input, RequestId, ServerCore};
use rvbox_session::SessionConfig;
use rvbox_store::Store;
use rvbox_store::commands::{CommandView, Knowledge};
use rvbox_store::mutations::OpError;
use rvbox_store_port::entropy::Entropy;
use rvbox_store_port::ops::{OpResult, OpToken, PortError, StoreOp};

pub use executor::Executor;
/// What the driver hands its caller: only the connection outputs of the
/// core's [`rvbox_server_core::Output`] (`Frame`, `Ping`, `Pong`, `Close`);
/// store operations, answers, audit records and metrics stay inside.
pub use rvbox_server_core::Output;
pub use rvbox_server_core::audit::AUDIT_BURST;
pub use rvbox_server_core::upload::{
    MAX_UPLOADS_PER_CONNECTION, SCRIPT_CHUNK_BYTES, SCRIPT_SESSION_WINDOW_BYTES,
    SCRIPT_WINDOW_BYTES,
};
pub use rvbox_server_core::{
    Caller, ConnId, DISPATCH_SCAN, EXPIRY_BATCH, EXPIRY_INTERVAL_MS, EngineStats, GroupPolicy,
    MAX_CONNECTIONS, event_append,
};
pub use settings::{ServerSettings, SettingsError, server_settings};
pub use thread::{CompletionSink, ExecutorThread, PassReport};

/// The core and the executor on one thread (see the crate docs).
#[derive(Debug)]
pub struct Engine {
    core: ServerCore,
    exec: Executor,
    out: VecDeque<Output>,
    replies: BTreeMap<RequestId, ControlAnswer>,
    next_request: u64,
    /// Session counters the core emitted (bounded names).
    metrics: BTreeMap<(&'static str, Option<&'static str>), u64>,
    /// The latest monotonic and wall-clock times an input carried.
    last: (u64, i64),
    /// Store operations wait for [`Engine::perform`] and their completions
    /// for [`Engine::deliver`] instead of running at once.
    deferred: bool,
    /// Issued by the core, not yet performed.
    queued: VecDeque<(OpToken, i64, StoreOp)>,
    /// Performed, their completions not yet handed to the core.
    done: VecDeque<(OpToken, OpResult)>,
    /// Report every frame written as soon as it is handed out (a writer
    /// that never blocks); off, the caller reports [`Engine::written`].
    auto_written: bool,
    /// Frames handed out and not yet reported written, per connection.
    unwritten: Vec<ConnId>,
    /// Who the control calls of this driver are audited as.
    caller: rvbox_server_core::Caller,
}

impl Engine {
    /// An engine over a recovered `store`.
    #[must_use]
    pub fn new(store: Store, entropy: Arc<dyn Entropy>, config: SessionConfig) -> Self {
        let mut core = ServerCore::new(entropy, config, RetryPolicy::default());
        // one input at a time, each answered before the next: no batching
        // delay (`with_settings` and `set_group_policy` give the configured
        // one)
        core.set_group_policy(rvbox_server_core::GroupPolicy::immediate());
        Self::from_core(store, core)
    }

    /// Sets when append groups go to the store.
    pub fn set_group_policy(&mut self, policy: rvbox_server_core::GroupPolicy) {
        self.core.set_group_policy(policy);
    }

    /// Sets the terminal policy (`terminals.*`).
    pub fn set_pty_policy(&mut self, policy: rvbox_server_core::PtyPolicy) {
        self.core.set_pty_policy(policy);
    }

    fn from_core(store: Store, core: ServerCore) -> Self {
        Self {
            core,
            exec: Executor::new(store),
            out: VecDeque::new(),
            replies: BTreeMap::new(),
            next_request: 1,
            metrics: BTreeMap::new(),
            last: (0, 0),
            deferred: false,
            queued: VecDeque::new(),
            done: VecDeque::new(),
            auto_written: true,
            unwritten: Vec::new(),
            caller: rvbox_server_core::Caller::local(),
        }
    }

    /// Names the caller the following control calls are audited as
    /// (transport and principal; `local` until set).
    pub fn set_caller(&mut self, caller: rvbox_server_core::Caller) {
        self.caller = caller;
    }

    /// An engine over a recovered `store` (opened with
    /// `settings.store`), with the configured session limits, retry
    /// backoff and ingress watermarks.
    ///
    /// # Errors
    /// When the ingress watermarks are refused (`low < high` is the
    /// configuration's own rule).
    pub fn with_settings(
        store: Store,
        entropy: Arc<dyn Entropy>,
        settings: &ServerSettings,
    ) -> Result<Self, rvbox_session::GateConfigError> {
        let mut core = ServerCore::new(entropy, settings.session.clone(), settings.retry);
        core.set_ingress_watermarks(settings.ingress.0, settings.ingress.1)?;
        core.set_group_policy(settings.group);
        core.set_takeover_ttl(settings.takeover_ttl_ms);
        core.set_pty_policy(settings.pty);
        Ok(Self::from_core(store, core))
    }

    /// The store (read access for callers and checkers).
    #[must_use]
    pub fn store(&self) -> &Store {
        self.exec.store()
    }

    /// The store, for what is not yet an operation of the port.
    pub fn store_mut(&mut self) -> &mut Store {
        self.exec.store_mut()
    }

    /// Gives the store back (a crash or a shutdown drops the rest).
    #[must_use]
    pub fn into_store(self) -> Store {
        self.exec.into_store()
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &EngineStats {
        self.core.stats()
    }

    /// Session counters emitted so far, by name and reason label.
    #[must_use]
    pub fn session_metrics(&self) -> &BTreeMap<(&'static str, Option<&'static str>), u64> {
        &self.metrics
    }

    /// Append groups committed and the append operations they carried.
    #[must_use]
    pub fn group_stats(&self) -> (u64, u64) {
        self.exec.group_stats()
    }

    /// Connections currently open.
    #[must_use]
    pub fn connections(&self) -> usize {
        self.core.connections()
    }

    /// The next output to perform, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// The core's next monotonic deadline.
    #[must_use]
    pub fn next_deadline(&self) -> Option<u64> {
        self.core.poll_timeout()
    }

    /// A new connection (after the WebSocket upgrade).
    pub fn connect(&mut self, now_ms: u64, conn: ConnId) {
        let wall = self.last_wall();
        self.input(now_ms, wall, Input::Connected { conn });
    }

    /// A binary frame arrived on `conn`.
    pub fn frame(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId, bytes: Vec<u8>) {
        self.input(now_ms, wall_ms, Input::Frame { conn, bytes });
    }

    /// A Pong arrived on `conn`.
    pub fn pong(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, Input::Pong { conn });
    }

    /// A Ping arrived on `conn` (answered with [`Output::Pong`]).
    pub fn ping(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, Input::Ping { conn });
    }

    /// The peer closed, or the transport failed.
    pub fn disconnected(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, Input::Disconnected { conn });
    }

    /// The single-runner duties this engine runs (see
    /// [`Input::Duties`]).
    pub fn set_duties(&mut self, held: &[rvbox_store_port::replica::Duty]) {
        let (now, wall) = self.last;
        self.input(
            now,
            wall,
            Input::Duties {
                held: held.to_vec(),
            },
        );
    }

    /// Whether this engine serves clients (see [`Input::Serving`]).
    pub fn set_serving(&mut self, serving: bool) {
        let (now, wall) = self.last;
        self.input(now, wall, Input::Serving { serving });
    }

    /// Another replica wrote work for `client` (see [`Input::Wake`]).
    pub fn wake(&mut self, client: &str, issue: Option<[u8; 16]>) {
        let (now, wall) = self.last;
        self.input(
            now,
            wall,
            Input::Wake {
                client: client.to_owned(),
                issue,
            },
        );
    }

    /// Wake-ups may have been missed: see [`Input::WakeAll`].
    pub fn wake_all(&mut self) {
        let (now, wall) = self.last;
        self.input(now, wall, Input::WakeAll);
    }

    /// A fleet run may release now (created elsewhere): see
    /// [`Input::FleetWake`].
    pub fn fleet_wake(&mut self) {
        let (now, wall) = self.last;
        self.input(now, wall, Input::FleetWake);
    }

    /// Timers: session deadlines due at `now_ms`, queue expiry, backoff
    /// wake-ups and a dispatch pass.
    pub fn tick(&mut self, now_ms: u64, wall_ms: i64) {
        self.input(now_ms, wall_ms, Input::Timeout);
    }

    /// `RunCommand` through the core: the store persists the queued
    /// command before this returns, and its client gets a dispatch turn.
    ///
    /// # Errors
    /// As [`Store::run_command`], as a port error.
    pub fn run_command(
        &mut self,
        req: &wire::RunCommandRequest,
        wall_ms: i64,
    ) -> Result<wire::RunCommandResponse, PortError> {
        let now = self.last_now();
        match self.call(now, wall_ms, ControlCall::RunCommand(req.clone())) {
            Some(ControlAnswer::RunCommand(r)) => r,
            _ => Err(PortError::Unavailable("RunCommand got no answer".into())),
        }
    }

    /// `RunFleet` through the core: the run, its targets and the first
    /// released commands are durable before this returns.
    ///
    /// # Errors
    /// As [`Store::run_fleet_as`], as a port error.
    pub fn run_fleet(
        &mut self,
        req: &wire::RunFleetRequest,
        wall_ms: i64,
    ) -> Result<wire::RunFleetResponse, PortError> {
        let now = self.last_now();
        match self.call(now, wall_ms, ControlCall::RunFleet(req.clone())) {
            Some(ControlAnswer::Fleet(Ok(a))) => match *a {
                rvbox_store_port::fleet::FleetAnswer::Run(r) => Ok(r),
                _ => Err(PortError::Unavailable("RunFleet got another answer".into())),
            },
            Some(ControlAnswer::Fleet(Err(e))) => Err(e),
            _ => Err(PortError::Unavailable("RunFleet got no answer".into())),
        }
    }

    /// A fleet action (`SignalFleetRun`, `CancelFleetRun`, `PauseFleetRun`,
    /// `ResumeFleetRun`) through the core.
    ///
    /// # Errors
    /// As [`Store::fleet_action_as`], as a port error.
    pub fn fleet_action(
        &mut self,
        action: rvbox_store_port::fleet::FleetAction,
        wall_ms: i64,
    ) -> Result<rvbox_store_port::fleet::FleetAnswer, PortError> {
        let now = self.last_now();
        match self.call(now, wall_ms, ControlCall::FleetAction(action)) {
            Some(ControlAnswer::Fleet(r)) => r.map(|a| *a),
            _ => Err(PortError::Unavailable(
                "the fleet action got no answer".into(),
            )),
        }
    }

    /// `SignalCommand` from the control plane (plan §6.4, R-6.4-35..38),
    /// idempotent by `request_id`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, `FAILED_PRECONDITION` for a terminal
    /// command, `CONFLICT` for a reused `request_id`, `CAPACITY_EXHAUSTED`
    /// for too many unresolved signals, or a store failure.
    pub fn signal_command(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        req: &wire::SignalCommandRequest,
    ) -> Result<wire::SignalCommandResponse, PortError> {
        match self.call(now_ms, wall_ms, ControlCall::SignalCommand(req.clone())) {
            Some(ControlAnswer::SignalCommand(r)) => r,
            _ => Err(PortError::Unavailable("SignalCommand got no answer".into())),
        }
    }

    /// `AuthorizeClientTakeover` through the core (plan §6.2), idempotent
    /// by `request_id`.
    ///
    /// # Errors
    /// The refusal or store failure.
    pub fn authorize_takeover(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        req: &wire::AuthorizeClientTakeoverRequest,
    ) -> Result<wire::AuthorizeClientTakeoverResponse, PortError> {
        match self.call(
            now_ms,
            wall_ms,
            ControlCall::AuthorizeClientTakeover(req.clone()),
        ) {
            Some(ControlAnswer::AuthorizeClientTakeover(r)) => r,
            _ => Err(PortError::Unavailable(
                "AuthorizeClientTakeover got no answer".into(),
            )),
        }
    }

    /// `AppendStdin` through the core, answered when its store operation
    /// completes (the executor runs deferred operations until then).
    ///
    /// # Errors
    /// The refusal or store failure.
    pub fn append_stdin(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        req: &wire::AppendStdinRequest,
    ) -> Result<wire::AppendStdinResponse, PortError> {
        match self.call(now_ms, wall_ms, ControlCall::AppendStdin(req.clone())) {
            Some(ControlAnswer::AppendStdin(r)) => r,
            _ => Err(PortError::Unavailable("AppendStdin got no answer".into())),
        }
    }

    /// `CloseStdin` through the core.
    ///
    /// # Errors
    /// The refusal or store failure.
    pub fn close_stdin(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        req: &wire::CloseStdinRequest,
    ) -> Result<wire::CloseStdinResponse, PortError> {
        match self.call(now_ms, wall_ms, ControlCall::CloseStdin(req.clone())) {
            Some(ControlAnswer::CloseStdin(r)) => r,
            _ => Err(PortError::Unavailable("CloseStdin got no answer".into())),
        }
    }

    /// A terminal mutation (`OpenPtySession`, `WritePtyInput`,
    /// `ResizePtySession`, `ClosePtySession`) through the core.
    ///
    /// # Errors
    /// The refusal or store failure.
    pub fn pty(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        mutation: rvbox_store_port::pty::PtyMutation,
    ) -> Result<rvbox_server_core::PtyAnswer, PortError> {
        match self.call(now_ms, wall_ms, ControlCall::Pty(mutation)) {
            Some(ControlAnswer::Pty(r)) => r.map(|a| *a),
            _ => Err(PortError::Unavailable(
                "the terminal mutation got no answer".into(),
            )),
        }
    }

    /// A viewer attached to a terminal from `offset`, or left it at
    /// `offset` (`AttachPtySession`'s audit), through the core.
    ///
    /// # Errors
    /// When the core gave no answer.
    pub fn pty_viewer(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        pty_session_id: &str,
        client_id: &str,
        attach: bool,
        offset: u64,
    ) -> Result<(), PortError> {
        let call = ControlCall::PtyViewer {
            pty_session_id: pty_session_id.to_owned(),
            client_id: client_id.to_owned(),
            attach,
            offset,
        };
        match self.call(now_ms, wall_ms, call) {
            Some(ControlAnswer::Pty(r)) => r.map(|_| ()),
            _ => Err(PortError::Unavailable(
                "the terminal viewer call got no answer".into(),
            )),
        }
    }

    fn call(&mut self, now_ms: u64, wall_ms: i64, call: ControlCall) -> Option<ControlAnswer> {
        let request = RequestId(self.next_request);
        self.next_request += 1;
        self.input(
            now_ms,
            wall_ms,
            Input::Control {
                request,
                caller: self.caller.clone(),
                call,
            },
        );
        // deferred: everything queued goes through until the answer is in
        while !self.replies.contains_key(&request) {
            if !self.step_all(now_ms, wall_ms) {
                break;
            }
        }
        self.replies.remove(&request)
    }

    fn last_now(&self) -> u64 {
        self.last.0
    }

    fn last_wall(&self) -> i64 {
        self.last.1
    }

    /// Defers store operations (the simulator's executor): they wait for
    /// [`Engine::perform`], and their completions for [`Engine::deliver`],
    /// so a crash can fall between an operation and its completion, or
    /// between a completion and the frames it announces. A control call
    /// still returns its answer: it performs and delivers everything
    /// queued until the answer is there.
    pub fn set_deferred(&mut self, on: bool) {
        self.deferred = on;
    }

    /// Whether every frame counts as written as soon as it is handed out
    /// (the default); off, the caller reports each with
    /// [`Engine::written`], as a socket writer does.
    pub fn set_auto_written(&mut self, on: bool) {
        self.auto_written = on;
    }

    /// The writer of `conn` wrote one frame it was handed.
    pub fn written(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, Input::Written { conn });
    }

    /// Replaces the ingress gate's watermarks (tests use small ones).
    ///
    /// # Errors
    /// Unless `low < high`.
    pub fn set_ingress_watermarks(
        &mut self,
        high: u64,
        low: u64,
    ) -> Result<(), rvbox_session::GateConfigError> {
        self.core.set_ingress_watermarks(high, low)
    }

    /// Event bytes admitted and not yet durable, and whether the ingress
    /// gate admits new output.
    #[must_use]
    pub fn ingress(&self) -> (u64, bool) {
        self.core.ingress()
    }

    /// Operations issued and not yet performed.
    #[must_use]
    pub fn queued_ops(&self) -> usize {
        self.queued.len()
    }

    /// Operations performed whose completion the core has not had yet.
    #[must_use]
    pub fn undelivered(&self) -> usize {
        self.done.len()
    }

    /// Performs up to `max` queued operations as one batch (a run of
    /// appends among them is one durable group); their completions wait
    /// for [`Engine::deliver`]. Returns how many were performed.
    pub fn perform(&mut self, max: usize) -> usize {
        let n = max.min(self.queued.len());
        let batch: Vec<_> = self.queued.drain(..n).collect();
        let done = self.exec.perform_batch(batch);
        self.done.extend(done);
        n
    }

    /// Hands up to `max` completions to the core, in the order their
    /// operations were performed. Returns how many.
    pub fn deliver(&mut self, now_ms: u64, wall_ms: i64, max: usize) -> usize {
        self.last = (now_ms.max(self.last.0), wall_ms);
        let mut n = 0;
        while n < max {
            let Some((token, result)) = self.done.pop_front() else {
                break;
            };
            n += 1;
            self.core.handle(
                self.last.0,
                self.last.1,
                Input::Completion { token, result },
            );
            self.settle();
        }
        n
    }

    /// Performs and delivers everything queued until the core issues
    /// nothing more (deferred mode's way to settle at once).
    pub fn run_until_idle(&mut self, now_ms: u64, wall_ms: i64) {
        while self.step_all(now_ms, wall_ms) {}
    }

    /// Performs every queued operation and delivers every completion;
    /// false when there was nothing to do.
    fn step_all(&mut self, now_ms: u64, wall_ms: i64) -> bool {
        let performed = self.perform(usize::MAX);
        let delivered = self.deliver(now_ms, wall_ms, usize::MAX);
        performed > 0 || delivered > 0
    }

    /// One input, then every output drained.
    fn input(&mut self, now_ms: u64, wall_ms: i64, input: Input) {
        self.last = (now_ms.max(self.last.0), wall_ms);
        self.core.handle(now_ms, wall_ms, input);
        self.settle();
    }

    /// Drains the core's outputs; unless deferred, performs the store
    /// operations (appends grouped) and feeds each completion back until
    /// the core has nothing left.
    fn settle(&mut self) {
        loop {
            self.collect_outputs();
            if self.auto_written && !self.unwritten.is_empty() {
                for conn in std::mem::take(&mut self.unwritten) {
                    self.core
                        .handle(self.last.0, self.last.1, Input::Written { conn });
                }
                continue;
            }
            if self.deferred || self.queued.is_empty() {
                return;
            }
            let batch: Vec<_> = self.queued.drain(..).collect();
            for (token, result) in self.exec.perform_batch(batch) {
                self.core.handle(
                    self.last.0,
                    self.last.1,
                    Input::Completion { token, result },
                );
            }
        }
    }

    fn collect_outputs(&mut self) {
        while let Some(o) = self.core.poll_output() {
            match o {
                rvbox_server_core::Output::Store { token, wall_ms, op } => {
                    self.queued.push_back((token, wall_ms, op));
                }
                frame @ (Output::Frame { .. } | Output::Ping { .. } | Output::Pong { .. }) => {
                    if self.auto_written
                        && let Output::Frame { conn, .. }
                        | Output::Ping { conn }
                        | Output::Pong { conn } = &frame
                    {
                        self.unwritten.push(*conn);
                    }
                    self.out.push_back(frame);
                }
                close @ Output::Close { .. } => self.out.push_back(close),
                rvbox_server_core::Output::Reply { request, answer } => {
                    self.replies.insert(request, answer);
                }
                rvbox_server_core::Output::Audit {
                    conn,
                    client,
                    audit,
                } => {
                    tracing::warn!(
                        conn,
                        client = client.as_deref().unwrap_or(""),
                        kind = ?audit.kind,
                        detail = %audit.detail,
                        "session audit"
                    );
                }
                rvbox_server_core::Output::Metric(m) => {
                    *self.metrics.entry((m.name, m.reason)).or_default() += 1;
                }
            }
        }
    }

    /// The server's view of a known command (for callers and tests).
    ///
    /// # Errors
    /// As [`Store::command_view`].
    pub fn command(&self, issue: &[u8; 16]) -> Result<CommandView, OpError> {
        self.exec.store().command_view(issue)
    }

    /// Canonical text of a UUID's bytes.
    #[must_use]
    pub fn uuid_text(bytes: &[u8; 16]) -> String {
        rvbox_server_core::uuid_text(bytes)
    }

    /// Maps store knowledge for tests and tools.
    #[must_use]
    pub fn knowledge(k: &Knowledge) -> rvbox_reconcile::ServerKnown {
        rvbox_server_core::knowledge(k)
    }

    /// Whether the command source of a row is a script (for tools).
    #[must_use]
    pub fn is_script(source: &rvbox_reconcile::Source) -> bool {
        matches!(source, rvbox_reconcile::Source::Script { .. })
    }
}
