//! RVBox server protocol engine (plan §6.1-§6.4).
//!
//! Owns: the composition of the pure cores with the store, for every
//! connection of one server: a [`rvbox_session::Session`] per connection,
//! registration and fencing through the store, reconciliation rounds
//! ([`rvbox_reconcile`]), capacity, dispatch and acceptance
//! ([`rvbox_dispatch`]), and event ingest through
//! [`rvbox_store::Store::append_events`]. It is synchronous and
//! single-threaded: the caller (the tokio shell, or the simulator) hands it
//! one input at a time with the monotonic and wall clocks, then drains
//! [`Engine::poll_output`] and arms one timer at [`Engine::next_deadline`].
//!
//! Store writes happen inside the call that needs them and are complete
//! when it returns: a frame that depends on a write is emitted only after
//! the write committed (welcome after registration, `Dispatch` after
//! `dispatched`, `EventAck` after the events are durable, the
//! `ReconcileResult` after its decisions). A crash between two calls loses
//! only frames not yet sent, which the protocol retries.
//!
//! Must never: read a clock or the OS RNG itself (time comes with every
//! call, randomness from the injected [`Entropy`]), send a frame before the
//! write it announces, or iterate a `HashMap` into anything observable.

mod convert;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use rvbox_dispatch::{
    AcceptDecision, CommandView as DispatchView, DispatchDecision, DispatchedCommand, ReadyQueue,
    RetryPolicy, SessionCapacity, SessionGate, classify_acceptance, decide,
};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{CommandState, Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_reconcile::{
    Action, Assembly, ReconcileError, ServerCommand, ServerKnown, SnapshotAssembler, Source,
    build_request, reconcile,
};
use rvbox_session::{
    ClientMessage, Effect, Input, Registration as Decision, RegistrationToken, Session,
    SessionConfig, SessionId,
};
use rvbox_store::Store;
use rvbox_store::commands::{CommandView, Knowledge, ReconcileWrite, ServerTerminal};
use rvbox_store::entropy::Entropy;
use rvbox_store::events::EventOutcome;
use rvbox_store::incidents::NewIncident;
use rvbox_store::mutations::OpError;
use rvbox_store::signals::SignalPlan;

pub use convert::event_append;

/// A connection, numbered by the caller.
pub type ConnId = u64;

/// Most connections the engine tracks.
pub const MAX_CONNECTIONS: usize = 65_536;
/// Most queued commands one dispatch turn looks at for one client.
pub const DISPATCH_SCAN: usize = 64;
/// Most commands one expiry pass handles.
pub const EXPIRY_BATCH: usize = 256;

/// Something the caller must do on a connection, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Close the connection with this reason.
    Close {
        /// Connection.
        conn: ConnId,
        /// Why.
        reason: wire::CloseReason,
    },
}

/// What the engine counts (bounded names; the shell exports them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Registrations accepted.
    pub registered: u64,
    /// Live-conflict rejections.
    pub live_conflicts: u64,
    /// Sessions fenced by a newer one.
    pub fenced: u64,
    /// Reconciliation rounds written.
    pub reconciled: u64,
    /// Reconciliation snapshots refused (invalid, or client store not ready).
    pub reconcile_refused: u64,
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
    /// Pending signals queued again after an acceptance or a
    /// reconciliation.
    pub signals_sent_again: u64,
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
}

#[derive(Debug)]
struct Conn {
    session: Session,
    client: Option<String>,
    /// The store session id of this connection once registered.
    session_key: Option<[u8; 16]>,
    generation: u64,
    round: u64,
    assembler: Option<SnapshotAssembler>,
    rows: Vec<ServerCommand>,
    /// Script uploads in progress on this connection (plan §7.3 "script
    /// dispatch"), by command.
    uploads: BTreeMap<Uuid7, Upload>,
}

/// One script upload to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Upload {
    /// Total raw size.
    size: u64,
    /// Next raw offset to send.
    sent: u64,
    /// The client's durable contiguous prefix, as last reported.
    received: u64,
}

#[derive(Debug, Default)]
struct ClientState {
    conn: Option<ConnId>,
    ready: bool,
    capacity: SessionCapacity,
    in_flight: BTreeMap<Uuid7, DispatchedCommand>,
    backoff: BTreeMap<Uuid7, (i64, u32)>,
    /// Earliest end of a backoff: the client has work again then.
    wake_wall_ms: Option<i64>,
}

/// The engine (see the crate docs).
#[derive(Debug)]
pub struct Engine {
    store: Store,
    entropy: Arc<dyn Entropy>,
    config: SessionConfig,
    retry: RetryPolicy,
    conns: BTreeMap<ConnId, Conn>,
    clients: BTreeMap<String, ClientState>,
    ready: ReadyQueue<String>,
    out: VecDeque<Output>,
    stats: EngineStats,
    /// Monotonic time of the last queue-expiry pass.
    last_expiry_ms: Option<u64>,
}

/// Raw bytes of one `ScriptChunk` (the protocol's per-chunk ceiling).
pub const SCRIPT_CHUNK_BYTES: u64 = 256 * 1024;
/// Script bytes in flight per command beyond the client's durable prefix:
/// the server never streams a script without progress acknowledgements.
pub const SCRIPT_WINDOW_BYTES: u64 = 1024 * 1024;
/// Script bytes in flight on one connection, over all its uploads (the
/// 8 MiB per-session data window).
pub const SCRIPT_SESSION_WINDOW_BYTES: u64 = 8 * 1024 * 1024;
/// Most script uploads one connection runs at once (a client's accepted
/// commands are bounded far below this).
pub const MAX_UPLOADS_PER_CONNECTION: usize = 1024;

/// Queue expiry is decided at most this often (the TTL has second
/// resolution; the pass reads an index).
pub const EXPIRY_INTERVAL_MS: u64 = 1_000;

fn uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h.get(0..8).unwrap_or_default(),
        h.get(8..12).unwrap_or_default(),
        h.get(12..16).unwrap_or_default(),
        h.get(16..20).unwrap_or_default(),
        h.get(20..32).unwrap_or_default()
    )
}

fn phase_of(l: Lifecycle) -> Phase {
    match l {
        Lifecycle::Queued => Phase::Queued,
        Lifecycle::Dispatched => Phase::Dispatched,
        Lifecycle::Accepted => Phase::Accepted,
        Lifecycle::Running => Phase::Running,
        Lifecycle::Succeeded => Phase::Succeeded,
        Lifecycle::Failed => Phase::Failed,
        Lifecycle::Terminated => Phase::Terminated,
        Lifecycle::Interrupted => Phase::Interrupted,
        Lifecycle::Expired => Phase::Expired,
        Lifecycle::Rejected => Phase::Rejected,
        Lifecycle::Cancelled => Phase::Cancelled,
    }
}

fn state_of(v: &CommandView) -> CommandState {
    CommandState::from_parts(phase_of(v.lifecycle), Revision(v.revision))
}

impl Engine {
    /// An engine over a recovered `store`.
    #[must_use]
    pub fn new(store: Store, entropy: Arc<dyn Entropy>, config: SessionConfig) -> Self {
        Self {
            store,
            entropy,
            config,
            retry: RetryPolicy::default(),
            conns: BTreeMap::new(),
            clients: BTreeMap::new(),
            ready: ReadyQueue::new(),
            out: VecDeque::new(),
            stats: EngineStats::default(),
            last_expiry_ms: None,
        }
    }

    /// The store (read access for callers and checkers).
    #[must_use]
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The store, for control operations (`RunCommand`, ...).
    pub fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    /// Gives the store back (a crash or a shutdown drops the rest).
    #[must_use]
    pub fn into_store(self) -> Store {
        self.store
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Connections currently open.
    #[must_use]
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// The next output to perform, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// The earliest monotonic deadline of any session.
    #[must_use]
    pub fn next_deadline(&self) -> Option<u64> {
        self.conns
            .values()
            .filter_map(|c| c.session.poll_timeout())
            .min()
    }

    /// A new connection (after the WebSocket upgrade).
    pub fn connect(&mut self, now_ms: u64, conn: ConnId) {
        if self.conns.len() >= MAX_CONNECTIONS {
            self.out.push_back(Output::Close {
                conn,
                reason: wire::CloseReason::IngressOverload,
            });
            return;
        }
        match Session::new(now_ms, self.config.clone()) {
            Ok(session) => {
                self.conns.insert(
                    conn,
                    Conn {
                        session,
                        client: None,
                        session_key: None,
                        generation: 0,
                        round: 0,
                        assembler: None,
                        rows: Vec::new(),
                        uploads: BTreeMap::new(),
                    },
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "session configuration refused");
                self.out.push_back(Output::Close {
                    conn,
                    reason: wire::CloseReason::InternalError,
                });
            }
        }
    }

    /// A binary frame arrived on `conn`.
    pub fn frame(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId, bytes: Vec<u8>) {
        self.input(now_ms, wall_ms, conn, Input::Binary(bytes));
    }

    /// A Pong arrived on `conn`.
    pub fn pong(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, conn, Input::Pong);
    }

    /// The peer closed, or the transport failed.
    pub fn disconnected(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        self.input(now_ms, wall_ms, conn, Input::PeerClosed);
        self.drop_conn(conn, wall_ms, "connection closed");
    }

    /// Timers: session deadlines due at `now_ms`, queue expiry, and a
    /// dispatch pass.
    pub fn tick(&mut self, now_ms: u64, wall_ms: i64) {
        let due: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.session.poll_timeout().is_some_and(|d| d <= now_ms))
            .map(|(id, _)| *id)
            .collect();
        for conn in due {
            self.input(now_ms, wall_ms, conn, Input::Timeout);
        }
        if self
            .last_expiry_ms
            .is_none_or(|t| now_ms >= t.saturating_add(EXPIRY_INTERVAL_MS))
        {
            self.last_expiry_ms = Some(now_ms);
            self.expire(wall_ms);
        }
        self.dispatch_pass(now_ms, wall_ms);
    }

    fn input(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId, input: Input) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.session.handle(now_ms, input);
        self.drain(now_ms, wall_ms, conn);
    }

    /// Performs a session's effects until it has none left.
    fn drain(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId) {
        let mut guard = 0u32;
        loop {
            guard += 1;
            if guard > 100_000 {
                tracing::error!("session produced unbounded effects; closing");
                self.close(conn, wire::CloseReason::InternalError, wall_ms);
                return;
            }
            let Some(effect) = self
                .conns
                .get_mut(&conn)
                .and_then(|c| c.session.poll_effect())
            else {
                return;
            };
            match effect {
                Effect::Send { lane, envelope } => {
                    self.out.push_back(Output::Frame {
                        conn,
                        control: lane == rvbox_session::Lane::Control,
                        bytes: prost::Message::encode_to_vec(&envelope),
                    });
                }
                Effect::Ping => self.out.push_back(Output::Ping { conn }),
                Effect::Close { reason } => {
                    self.out.push_back(Output::Close { conn, reason });
                    self.drop_conn(conn, wall_ms, rvbox_session::close_text(reason));
                    return;
                }
                Effect::Register { token, hello } => {
                    self.register(now_ms, wall_ms, conn, token, &hello);
                }
                Effect::Deliver(msg) => self.deliver(now_ms, wall_ms, conn, msg),
                Effect::Audit(a) => {
                    tracing::warn!(kind = ?a.kind, detail = %a.detail, "session audit");
                }
                Effect::Metric(_) => {}
            }
        }
    }

    fn close(&mut self, conn: ConnId, reason: wire::CloseReason, wall_ms: i64) {
        self.out.push_back(Output::Close { conn, reason });
        self.drop_conn(conn, wall_ms, rvbox_session::close_text(reason));
    }

    fn drop_conn(&mut self, conn: ConnId, wall_ms: i64, why: &str) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        if let Some(key) = c.session_key
            && let Err(e) = self.store.close_session(&key, false, why, wall_ms)
        {
            tracing::error!(error = %e, "session close not recorded");
        }
        if let Some(client) = c.client
            && let Some(st) = self.clients.get_mut(&client)
            && st.conn == Some(conn)
        {
            st.conn = None;
            st.ready = false;
            st.capacity.close();
            st.in_flight.clear();
            self.ready.remove(&client);
        }
    }

    fn random_session_id(&self) -> Option<([u8; 16], SessionId)> {
        let mut b = [0u8; 16];
        self.entropy.fill(&mut b).ok()?;
        let text: String = b.iter().map(|x| format!("{x:02x}")).collect();
        SessionId::parse(&text).ok().map(|s| (b, s))
    }

    fn register(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        conn: ConnId,
        token: RegistrationToken,
        hello: &rvbox_session::ValidHello,
    ) {
        let client = hello.client_id.as_str().to_owned();
        let reject = |engine: &mut Self, error: DomainError| {
            engine.input(
                now_ms,
                wall_ms,
                conn,
                Input::RegistrationRejected { token, error },
            );
        };
        let record = match self.store.client_record(&client) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "client record not readable");
                return reject(
                    self,
                    DomainError::new(Code::Unavailable, "server store unavailable"),
                );
            }
        };
        let core_record = convert::client_record(record.as_ref());
        let Some((key, session_id)) = self.random_session_id() else {
            return reject(
                self,
                DomainError::new(Code::Unavailable, "no randomness for a session id"),
            );
        };
        let wall = u64::try_from(wall_ms).unwrap_or(0);
        let decision =
            match rvbox_session::decide_registration(&core_record, hello, session_id.clone(), wall)
            {
                Ok(d) => d,
                Err(e) => {
                    return reject(
                        self,
                        DomainError::new(Code::FailedPrecondition, e.to_string()),
                    );
                }
            };
        match decision {
            Decision::RejectLiveConflict { claim, .. } => {
                let instance = *claim.instance.as_bytes();
                if let Err(e) = self.store.record_pending_claim(&client, &instance, wall_ms) {
                    tracing::error!(error = %e, "pending claim not recorded");
                }
                self.stats.live_conflicts += 1;
                reject(
                    self,
                    DomainError::new(
                        Code::LiveConflict,
                        "another instance of this client id is connected; an operator can authorize a takeover",
                    ),
                );
            }
            Decision::Accept(acc) => {
                let fence_key = record.as_ref().and_then(|r| r.live).map(|l| l.session_id);
                let grant_id = if acc.consume_grant {
                    record.as_ref().and_then(|r| r.grant).map(|g| g.id)
                } else {
                    None
                };
                let reg = rvbox_store::sessions::Registration {
                    client_id: client.clone(),
                    instance_id: *acc.instance.as_bytes(),
                    expected_generation: core_record.generation,
                    session_id: key,
                    fence: if acc.fence.is_some() { fence_key } else { None },
                    consume_grant: grant_id,
                    capabilities: hello.capabilities.clone(),
                    cwd_policy: Some(hello.cwd_policy.clone()),
                };
                let generation = match self.store.register_session(&reg, wall_ms) {
                    Ok(g) => g,
                    Err(e) => return reject(self, e.to_domain()),
                };
                self.stats.registered += 1;
                // fence the prior connection of this client, if it is ours
                let prior = self.clients.get(&client).and_then(|s| s.conn);
                if let Some(old) = prior
                    && old != conn
                {
                    self.stats.fenced += 1;
                    if let Some(c) = self.conns.get_mut(&old) {
                        c.session_key = None; // the store already fenced it
                        c.session.handle(
                            now_ms,
                            Input::Fenced {
                                by_generation: generation,
                            },
                        );
                    }
                    self.drain(now_ms, wall_ms, old);
                }
                let st = self.clients.entry(client.clone()).or_default();
                st.conn = Some(conn);
                st.ready = false;
                st.capacity = SessionCapacity::new();
                st.in_flight.clear();
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.client = Some(client.clone());
                    c.session_key = Some(key);
                    c.generation = generation;
                    c.session.handle(
                        now_ms,
                        Input::Registered {
                            token,
                            session_id,
                            generation,
                        },
                    );
                }
                self.start_round(conn, &client);
            }
        }
    }

    /// Sends a `ReconcileRequest` listing every non-terminal command.
    fn start_round(&mut self, conn: ConnId, client: &str) {
        let rows = match self.store.non_terminal_commands(client) {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(error = %e, "reconciliation rows not readable");
                return;
            }
        };
        let rows: Vec<ServerCommand> = rows.iter().filter_map(convert::server_command).collect();
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.round = c.round.saturating_add(1);
        match build_request(c.round, &rows) {
            Ok(req) => {
                c.assembler = Some(SnapshotAssembler::new(c.round));
                c.rows = rows;
                if let Err(e) = c.session.send(Payload::ReconcileRequest(req)) {
                    tracing::error!(error = %e, "reconcile request not sent");
                }
            }
            Err(e) => tracing::error!(error = %e, "reconcile request not built"),
        }
    }

    fn deliver(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId, msg: ClientMessage) {
        match msg {
            ClientMessage::ClientSnapshot(chunk) => self.snapshot(now_ms, wall_ms, conn, &chunk),
            ClientMessage::ClientCapacity(cap) => {
                let Some(client) = self.client_of(conn) else {
                    return;
                };
                let st = self.clients.entry(client.clone()).or_default();
                match st.capacity.apply_report(&cap) {
                    Ok(_) => {
                        let _ = self.ready.mark_ready(&client);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "capacity report refused");
                        self.close(conn, wire::CloseReason::ProtocolError, wall_ms);
                    }
                }
            }
            ClientMessage::CommandAccepted { issue, message } => {
                self.accepted(now_ms, wall_ms, conn, issue, &message);
            }
            ClientMessage::CommandEvent(desc) => self.event(now_ms, wall_ms, conn, desc),
            ClientMessage::ScriptUploadStatus { issue, message } => {
                self.upload_status(wall_ms, conn, issue, &message);
            }
            ClientMessage::Pty { .. } | ClientMessage::ControlError(_) => {}
        }
    }

    fn client_of(&self, conn: ConnId) -> Option<String> {
        self.conns.get(&conn).and_then(|c| c.client.clone())
    }

    fn snapshot(&mut self, now_ms: u64, wall_ms: i64, conn: ConnId, chunk: &wire::ClientSnapshot) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(asm) = c.assembler.take() else {
            tracing::warn!("snapshot chunk with no round open");
            self.close(conn, wire::CloseReason::ProtocolError, wall_ms);
            return;
        };
        let complete = match asm.push(chunk) {
            Ok(Assembly::Incomplete(next)) => {
                c.assembler = Some(next);
                return;
            }
            Ok(Assembly::Complete(s)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "snapshot chunk refused");
                self.stats.reconcile_refused += 1;
                self.close(conn, wire::CloseReason::ProtocolError, wall_ms);
                return;
            }
        };
        let rows = c.rows.clone();
        let round = c.round;
        let mut known = BTreeMap::new();
        for issue in complete.lookups_needed(&rows) {
            match self.store.command_knowledge(issue.as_bytes()) {
                Ok(k) => {
                    known.insert(issue, convert::knowledge(&k));
                }
                Err(e) => {
                    tracing::error!(error = %e, "command knowledge not readable");
                    return;
                }
            }
        }
        let outcome = match reconcile(round, &rows, &known, &complete) {
            Ok(o) => o,
            Err(e) => {
                self.stats.reconcile_refused += 1;
                self.refuse_snapshot(conn, &e, wall_ms);
                return;
            }
        };
        let Some(client) = self.client_of(conn) else {
            return;
        };
        // plan §6.4: every decision durable, in one transaction, before
        // the result is sent
        let mut writes = Vec::new();
        for a in outcome.actions() {
            let Some(row) = rows.iter().find(|r| r.issue_uuid == a.issue_uuid) else {
                continue;
            };
            let issue = *a.issue_uuid.as_bytes();
            let revision = row.revision.0;
            match a.action {
                Action::Requeue {
                    from: Phase::Dispatched,
                } => {
                    writes.push(ReconcileWrite::Requeue { issue, revision });
                }
                Action::Requeue { .. }
                | Action::Keep {
                    advance_to: None, ..
                } => {}
                Action::Keep {
                    advance_to: Some(to),
                    ..
                } => {
                    if to != row.phase.lifecycle() {
                        writes.push(ReconcileWrite::Advance {
                            issue,
                            revision,
                            to,
                        });
                    }
                }
                Action::Interrupt { .. } => {
                    writes.push(ReconcileWrite::Interrupt { issue, revision });
                }
            }
        }
        let incidents: Vec<NewIncident> = outcome
            .incidents()
            .iter()
            .map(|i| NewIncident {
                kind: i.kind,
                scope_kind: wire::ScopeKind::Command,
                scope_key: i.issue_uuid.to_string(),
                client_id: Some(client.clone()),
                issue_uuid: Some(*i.issue_uuid.as_bytes()),
                summary: i.summary.clone(),
                evidence: Vec::new(),
                data_loss: false,
            })
            .collect();
        if let Err(e) = self
            .store
            .apply_reconciliation(&client, &writes, &incidents, wall_ms)
        {
            // nothing was written; the client reconnects and a new round
            // starts from the state as it is now
            self.stats.stale_decisions += 1;
            tracing::warn!(error = %e, "reconciliation not applied");
            self.close(conn, wire::CloseReason::StorageUnavailable, wall_ms);
            return;
        }
        self.stats.reconciled += 1;
        let result = outcome.result().clone();
        if let Some(c) = self.conns.get_mut(&conn) {
            c.session.handle(now_ms, Input::ReconcileWritten(result));
        }
        // plan §6.4: a signal decided while the client was away (or whose
        // frame was lost with the connection) goes again, after the result
        for a in outcome.actions() {
            if matches!(a.action, Action::Keep { .. }) {
                self.resend_signals(conn, a.issue_uuid.as_bytes());
            }
        }
        // and script uploads not yet committed resume from the client's
        // durable prefix
        for resume in &outcome.result().resume {
            let Ok(issue) = Uuid7::parse("resume.issue_uuid", &resume.issue_uuid) else {
                continue;
            };
            let uploading = rows.iter().any(|r| {
                r.issue_uuid == issue
                    && matches!(
                        r.source,
                        Source::Script {
                            upload_committed: false,
                            ..
                        }
                    )
            });
            if uploading {
                self.start_upload(wall_ms, conn, issue, resume.script_resume_offset);
            }
        }
        if let Some(st) = self.clients.get_mut(&client)
            && st.conn == Some(conn)
        {
            st.ready = true;
        }
        let _ = self.ready.mark_ready(&client);
    }

    fn refuse_snapshot(&mut self, conn: ConnId, e: &ReconcileError, wall_ms: i64) {
        tracing::warn!(error = %e, "reconciliation snapshot refused; nothing applied");
        if let ReconcileError::InvalidSnapshot(inv) = e
            && let Some(client) = self.client_of(conn)
        {
            let i = inv.incident();
            let new = NewIncident {
                kind: i.kind,
                scope_kind: wire::ScopeKind::Client,
                scope_key: client.clone(),
                client_id: Some(client),
                issue_uuid: Some(*i.issue_uuid.as_bytes()),
                summary: i.summary,
                evidence: Vec::new(),
                data_loss: false,
            };
            if let Err(err) = self.store.record_protocol_incident(&new, wall_ms) {
                tracing::error!(error = %err, "contradiction incident not recorded");
            }
        }
        let reason = match e {
            ReconcileError::ClientStoreNotReady { .. } => wire::CloseReason::StorageUnavailable,
            _ => wire::CloseReason::ProtocolError,
        };
        self.close(conn, reason, wall_ms);
    }

    fn accepted(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        conn: ConnId,
        issue: Uuid7,
        message: &wire::CommandAccepted,
    ) {
        let Some(client) = self.client_of(conn) else {
            return;
        };
        let Some(st) = self.clients.get_mut(&client) else {
            return;
        };
        let Some(dispatched) = st.in_flight.get(&issue).copied() else {
            // not dispatched on this session: a late or foreign answer
            tracing::warn!(issue_uuid = %issue, "CommandAccepted for a command not in flight");
            return;
        };
        let mut random = [0u8; 8];
        let _ = self.entropy.fill(&mut random);
        let decision = match classify_acceptance(
            &dispatched,
            message,
            wall_ms,
            u64::from_le_bytes(random),
            &self.retry,
        ) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "CommandAccepted refused");
                self.close(conn, wire::CloseReason::ProtocolError, wall_ms);
                return;
            }
        };
        let id = *issue.as_bytes();
        // a signal decided while the command was in flight raised the
        // stored revision; the acceptance answers the dispatch either way
        let revision = match self.store.command_view(&id) {
            Ok(v) if v.lifecycle == Lifecycle::Dispatched => v.revision,
            _ => dispatched.state.revision().0,
        };
        let result = match &decision {
            AcceptDecision::Accept(acc) => {
                self.stats.accepted += 1;
                let written = match &acc.incident {
                    // plan §6.4: a late acceptance after the TTL passed: the
                    // acceptance, the incident and a higher termination
                    // revision are durable together before the TERM is sent
                    Some(late) => {
                        self.stats.late_acceptances += 1;
                        let incident = NewIncident {
                            kind: late.kind,
                            scope_kind: wire::ScopeKind::Command,
                            scope_key: issue.to_string(),
                            client_id: Some(client.clone()),
                            issue_uuid: Some(id),
                            summary: format!(
                                "accepted after its queue expiry ({} ms) while dispatched; terminated",
                                late.queue_expiry_ms
                            ),
                            evidence: Vec::new(),
                            data_loss: false,
                        };
                        self.store
                            .accept_late(&id, revision, message.resolved_shell, &incident, wall_ms)
                            .map(|_| ())
                    }
                    None => self
                        .store
                        .record_accepted(&id, revision, message.resolved_shell),
                };
                let r = match written {
                    Err(OpError::Refused(e)) if e.code() == Code::Conflict => Ok(()),
                    other => other,
                };
                if r.is_ok() {
                    // every signal still pending for it, a late TERM
                    // included: the client ignores revisions it has seen
                    self.resend_signals(conn, &id);
                    self.start_upload(wall_ms, conn, issue, 0);
                }
                r
            }
            AcceptDecision::Repeat => {
                let r = match self
                    .store
                    .record_accepted(&id, revision, message.resolved_shell)
                {
                    Err(OpError::Refused(e)) if e.code() == Code::Conflict => Ok(()),
                    other => other,
                };
                if r.is_ok() {
                    self.resend_signals(conn, &id);
                    self.start_upload(wall_ms, conn, issue, 0);
                }
                r
            }
            AcceptDecision::Requeue(r) => {
                self.stats.requeued += 1;
                if let Some(st) = self.clients.get_mut(&client) {
                    st.backoff
                        .insert(issue, (r.not_before_wall_ms, r.transient_rejections));
                    st.wake_wall_ms = Some(
                        st.wake_wall_ms
                            .map_or(r.not_before_wall_ms, |w| w.min(r.not_before_wall_ms)),
                    );
                }
                self.store.requeue(&id, revision, wall_ms).map(|_| ())
            }
            AcceptDecision::Expire(_) => {
                self.stats.expired += 1;
                self.store
                    .requeue(&id, revision, wall_ms)
                    .and_then(|to| match to {
                        Lifecycle::Queued => self.store.finish_by_server(
                            &id,
                            &[Lifecycle::Queued],
                            revision,
                            ServerTerminal::Expired,
                            None,
                            None,
                            wall_ms,
                        ),
                        // signalled meanwhile: it ended cancelled instead
                        _ => Ok(()),
                    })
            }
            AcceptDecision::Reject(r) => {
                self.stats.rejected += 1;
                self.store.finish_by_server(
                    &id,
                    &[Lifecycle::Dispatched],
                    revision,
                    ServerTerminal::Rejected,
                    Some(&r.detail),
                    None,
                    wall_ms,
                )
            }
        };
        if let Err(e) = result {
            self.stats.stale_decisions += 1;
            tracing::warn!(error = %e, "acceptance not applied");
        }
        if let Some(st) = self.clients.get_mut(&client) {
            st.capacity.settle(issue, decision.shadow());
            st.in_flight.remove(&issue);
        }
        let _ = self.ready.mark_ready(&client);
        self.dispatch_pass(now_ms, wall_ms);
    }

    fn event(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        conn: ConnId,
        desc: rvbox_session::EventDescriptor,
    ) {
        let issue = desc.issue;
        let seq = desc.event_seq;
        let input = match event_append(&desc.event) {
            Ok(ev) => match self.store.append_events(&[ev], wall_ms) {
                Ok(report) => match report.outcomes.first() {
                    Some(EventOutcome::Appended | EventOutcome::Duplicate) => {
                        self.stats.events_durable += 1;
                        self.end_upload_unless_accepted(wall_ms, conn, issue);
                        Input::EventsDurable {
                            issue,
                            durable_seq: report.acked.get(issue.as_bytes()).copied().unwrap_or(seq),
                        }
                    }
                    Some(EventOutcome::Refused(e)) => {
                        self.stats.events_refused += 1;
                        Input::EventRefused {
                            issue,
                            event_seq: seq,
                            error: e.clone(),
                        }
                    }
                    None => return,
                },
                Err(e) => {
                    tracing::error!(error = %e, "event batch failed; nothing acknowledged");
                    Input::EventRefused {
                        issue,
                        event_seq: seq,
                        error: DomainError::new(Code::Unavailable, "server store failed"),
                    }
                }
            },
            Err(e) => Input::EventRefused {
                issue,
                event_seq: seq,
                error: e,
            },
        };
        self.input(now_ms, wall_ms, conn, input);
    }

    /// Server-side queue expiry (plan §6.4): never-dispatched commands end
    /// `expired`; dispatched ones get the pending indicator.
    fn expire(&mut self, wall_ms: i64) {
        let due = match self.store.expiry_due(wall_ms, EXPIRY_BATCH) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "expiry index not readable");
                return;
            }
        };
        for v in due {
            let r = match v.lifecycle {
                Lifecycle::Queued => {
                    self.stats.expired += 1;
                    self.store.finish_by_server(
                        &v.issue_uuid,
                        &[Lifecycle::Queued],
                        v.revision,
                        ServerTerminal::Expired,
                        None,
                        None,
                        wall_ms,
                    )
                }
                Lifecycle::Dispatched => self.store.mark_expired_pending(&v.issue_uuid, v.revision),
                _ => Ok(()),
            };
            if let Err(e) = r {
                self.stats.stale_decisions += 1;
                tracing::warn!(error = %e, "expiry not applied");
            }
        }
    }

    /// One fair turn per ready client: dispatch what its capacity allows.
    /// Every client with a reconciled session takes part (new commands,
    /// freed capacity and ended backoffs all make work ready).
    fn dispatch_pass(&mut self, now_ms: u64, wall_ms: i64) {
        // a client has work again when a backoff ended; everything else
        // that makes work ready (a new command, a capacity report, an
        // answer, a written reconciliation) marks it where it happens
        let woken: Vec<String> = self
            .clients
            .iter_mut()
            .filter(|(_, st)| st.wake_wall_ms.is_some_and(|w| w <= wall_ms))
            .map(|(c, st)| {
                st.wake_wall_ms = None;
                c.clone()
            })
            .collect();
        for c in &woken {
            let _ = self.ready.mark_ready(c);
        }
        let mut turns = self.clients.len().saturating_add(1);
        while turns > 0 {
            turns -= 1;
            let Some(client) = self.ready.next_turn() else {
                return;
            };
            self.dispatch_client(now_ms, wall_ms, &client);
            let _ = self.ready.finish(&client);
        }
    }

    fn dispatch_client(&mut self, now_ms: u64, wall_ms: i64, client: &str) {
        let Some(st) = self.clients.get(client) else {
            return;
        };
        let (Some(conn), true) = (st.conn, st.ready) else {
            return;
        };
        let mut candidates = match self.store.queued_commands(client, DISPATCH_SCAN) {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(error = %e, "queue not readable");
                return;
            }
        };
        // dispatched commands not in flight on this session are sent again
        if let Ok(rows) = self.store.non_terminal_commands(client) {
            candidates.extend(
                rows.into_iter()
                    .filter(|v| v.lifecycle == Lifecycle::Dispatched)
                    .take(DISPATCH_SCAN),
            );
        }
        for v in candidates {
            let Ok(issue) = Uuid7::from_bytes("issue_uuid", v.issue_uuid) else {
                continue;
            };
            let Some(st) = self.clients.get_mut(client) else {
                return;
            };
            let view = DispatchView {
                issue,
                state: state_of(&v),
                queue_expiry_ms: v.queue_expiry_ms,
                retry_not_before_ms: st.backoff.get(&issue).map(|b| b.0),
            };
            match decide(&view, SessionGate::Ready, &mut st.capacity, wall_ms) {
                DispatchDecision::Dispatch { write, order } => {
                    if write.is_some()
                        && let Err(e) = self.store.mark_dispatched(&v.issue_uuid, v.revision)
                    {
                        self.stats.stale_decisions += 1;
                        tracing::warn!(error = %e, "dispatch not recorded");
                        if let Some(st) = self.clients.get_mut(client) {
                            st.capacity.release(issue);
                        }
                        continue;
                    }
                    let generation = self.conns.get(&conn).map_or(0, |c| c.generation);
                    let frame = match convert::dispatch_frame(&self.store, &v, generation) {
                        Ok(f) => f,
                        Err(e) => {
                            tracing::error!(error = %e, "dispatch frame not built");
                            continue;
                        }
                    };
                    let sent = self
                        .conns
                        .get_mut(&conn)
                        .map(|c| c.session.send(Payload::Dispatch(frame)));
                    if let Some(st) = self.clients.get_mut(client) {
                        st.in_flight.insert(
                            issue,
                            DispatchedCommand {
                                issue,
                                state: CommandState::from_parts(Phase::Dispatched, order.revision),
                                dispatched_revision: order.revision,
                                queue_expiry_ms: v.queue_expiry_ms,
                                transient_rejections: st.backoff.get(&issue).map_or(0, |b| b.1),
                            },
                        );
                    }
                    if let Some(Err(e)) = sent {
                        tracing::warn!(error = %e, "dispatch frame not queued; retried later");
                    } else {
                        self.stats.dispatched += 1;
                    }
                    self.drain(now_ms, wall_ms, conn);
                }
                DispatchDecision::Expire(_) => {
                    self.stats.expired += 1;
                    let _ = self.store.finish_by_server(
                        &v.issue_uuid,
                        &[Lifecycle::Queued],
                        v.revision,
                        ServerTerminal::Expired,
                        None,
                        None,
                        wall_ms,
                    );
                }
                DispatchDecision::Wait(_) | DispatchDecision::NotDispatchable(_) => {}
            }
        }
    }

    /// `RunCommand` through the engine: the store persists the queued
    /// command (plan §6.4: before this returns), and its client gets a
    /// dispatch turn at the next tick.
    ///
    /// # Errors
    /// As [`Store::run_command`].
    pub fn run_command(
        &mut self,
        req: &wire::RunCommandRequest,
        wall_ms: i64,
    ) -> Result<wire::RunCommandResponse, OpError> {
        let r = self.store.run_command(req, wall_ms)?;
        if self
            .clients
            .get(&req.client_id)
            .is_some_and(|st| st.conn.is_some())
        {
            let _ = self.ready.mark_ready(&req.client_id);
        }
        Ok(r)
    }

    /// `SignalCommand` from the control plane (plan §6.4, R-6.4-35..38),
    /// idempotent by `request_id`: a never-dispatched command ends
    /// `cancelled` on the server; dispatched, accepted or running work
    /// first takes a higher revision and a pending signal durably, then the
    /// revisioned `Signal` goes to the client's live, reconciled session
    /// (or after its next reconciliation or acceptance), and the visible
    /// lifecycle stays until the client resolves the race. A replay
    /// returns the stored response and sends nothing new.
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
    ) -> Result<wire::SignalCommandResponse, OpError> {
        let outcome = self.store.signal_command(
            req,
            |v| {
                let id = Uuid7::from_bytes("issue_uuid", v.issue_uuid)?;
                match rvbox_dispatch::decide_signal(id, state_of(v), req.signal) {
                    Ok(rvbox_dispatch::SignalDecision::CancelQueued { .. }) => {
                        Ok(SignalPlan::CancelQueued)
                    }
                    Ok(rvbox_dispatch::SignalDecision::Deliver { .. }) => Ok(SignalPlan::Deliver),
                    Err(e) => Err(DomainError::new(Code::FailedPrecondition, e.to_string())
                        .with_field("issue_uuid")),
                }
            },
            wall_ms,
        )?;
        self.stats.signals += 1;
        if let Some(frame) = outcome.deliver {
            let live = self
                .clients
                .get(&outcome.client_id)
                .filter(|st| st.ready)
                .and_then(|st| st.conn);
            if let Some(conn) = live {
                if let Some(c) = self.conns.get_mut(&conn)
                    && let Err(e) = c.session.send(Payload::Signal(frame))
                {
                    tracing::warn!(error = %e, "signal not queued; sent after the next reconciliation");
                }
                self.drain(now_ms, wall_ms, conn);
            }
        }
        Ok(outcome.response)
    }

    /// Starts (or restarts) the script upload of `issue` on `conn` from raw
    /// offset `from`; nothing for a command that runs command text or whose
    /// script the client already holds whole.
    fn start_upload(&mut self, wall_ms: i64, conn: ConnId, issue: Uuid7, from: u64) {
        // only work the client holds and has not launched: a launched
        // command's script is whole, an ended one needs none
        let accepted = self
            .store
            .command_view(issue.as_bytes())
            .is_ok_and(|v| v.lifecycle == Lifecycle::Accepted);
        if !accepted {
            return;
        }
        let size = match self.store.script_size(issue.as_bytes()) {
            Ok(Some(size)) => size,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "script not readable for upload; the connection closes");
                self.stats.script_upload_failures += 1;
                self.close(conn, wire::CloseReason::StorageUnavailable, wall_ms);
                return;
            }
        };
        if from >= size {
            return;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.uploads.len() >= MAX_UPLOADS_PER_CONNECTION && !c.uploads.contains_key(&issue) {
            tracing::warn!(
                "too many script uploads on one connection; this one waits for a reconnect"
            );
            return;
        }
        self.stats.script_uploads += 1;
        c.uploads.insert(
            issue,
            Upload {
                size,
                sent: from,
                received: from,
            },
        );
        tracing::info!(offset = from, size, "script upload started");
        self.pump_upload(wall_ms, conn, issue);
    }

    fn upload(&self, conn: ConnId, issue: Uuid7) -> Option<Upload> {
        self.conns
            .get(&conn)
            .and_then(|c| c.uploads.get(&issue))
            .copied()
    }

    /// Sends script chunks of `issue` while its window has room.
    fn pump_upload(&mut self, wall_ms: i64, conn: ConnId, issue: Uuid7) {
        loop {
            let Some(up) = self.upload(conn, issue) else {
                return;
            };
            let limit = up.size.min(up.received.saturating_add(SCRIPT_WINDOW_BYTES));
            let session_room = self.conns.get(&conn).map_or(0, |c| {
                SCRIPT_SESSION_WINDOW_BYTES.saturating_sub(
                    c.uploads
                        .values()
                        .map(|u| u.sent.saturating_sub(u.received))
                        .sum(),
                )
            });
            if up.sent >= limit || session_room == 0 {
                return;
            }
            let len = SCRIPT_CHUNK_BYTES.min(limit - up.sent).min(session_room);
            let bytes = match self.store.script_range(
                issue.as_bytes(),
                up.sent,
                usize::try_from(len).unwrap_or(0),
            ) {
                Ok(Some((_, b))) if !b.is_empty() => b,
                Ok(_) => {
                    tracing::error!("script shorter than its descriptor; the connection closes");
                    self.stats.script_upload_failures += 1;
                    self.close(conn, wire::CloseReason::StorageUnavailable, wall_ms);
                    return;
                }
                Err(e) => {
                    // the upload resumes from the client's prefix after it
                    // reconnects; a damaged script is found by the store's
                    // verification and recovery
                    tracing::error!(error = %e, "script chunk not readable; the connection closes");
                    self.stats.script_upload_failures += 1;
                    self.close(conn, wire::CloseReason::StorageUnavailable, wall_ms);
                    return;
                }
            };
            let raw_length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            let chunk = wire::ScriptChunk {
                issue_uuid: issue.to_string(),
                offset: up.sent,
                declared_size: up.size,
                compression: wire::Compression::None as i32,
                raw_sha256: rvbox_segment::sha256(&bytes).to_vec(),
                raw_length,
                stored_length: raw_length,
                payload: bytes,
            };
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            if let Err(e) = c.session.send(Payload::ScriptChunk(chunk)) {
                // only a closing or not yet reconciled session refuses: the
                // upload resumes after the next reconciliation
                tracing::warn!(error = %e, "script chunk not queued; the upload resumes after a reconnect");
                c.uploads.remove(&issue);
                return;
            }
            self.stats.script_chunks += 1;
            if let Some(u) = c.uploads.get_mut(&issue) {
                u.sent = up.sent.saturating_add(u64::from(raw_length));
            }
        }
    }

    /// An upload lives only while its command is accepted and not launched:
    /// once the client reports it running or ended, the upload ends.
    fn end_upload_unless_accepted(&mut self, wall_ms: i64, conn: ConnId, issue: Uuid7) {
        if self.upload(conn, issue).is_none() {
            return;
        }
        let accepted = self
            .store
            .command_view(issue.as_bytes())
            .is_ok_and(|v| v.lifecycle == Lifecycle::Accepted);
        if !accepted {
            self.end_upload(wall_ms, conn, issue);
        }
    }

    /// Ends an upload and lets the room it held go to the others.
    fn end_upload(&mut self, wall_ms: i64, conn: ConnId, issue: Uuid7) {
        if let Some(c) = self.conns.get_mut(&conn)
            && c.uploads.remove(&issue).is_some()
        {
            self.pump_uploads(wall_ms, conn);
        }
    }

    /// `ScriptUploadStatus`: the client's durable prefix opens the window
    /// (and skips what it already holds); `COMMITTED` or `REJECTED` ends
    /// the upload. A prefix beyond the script's size, a commit short of it,
    /// or an unset state is a protocol error.
    fn upload_status(
        &mut self,
        wall_ms: i64,
        conn: ConnId,
        issue: Uuid7,
        m: &wire::ScriptUploadStatus,
    ) {
        let Some(up) = self.upload(conn, issue) else {
            // no upload running here (it ended, or a restart lost it): the
            // next reconciliation resumes it from the client's prefix
            return;
        };
        let state = wire::ScriptUploadState::try_from(m.state)
            .unwrap_or(wire::ScriptUploadState::Unspecified);
        // the client may hold more than this upload sent (an earlier
        // connection's chunks); never more than the script
        let valid = m.received_bytes <= up.size
            && match state {
                wire::ScriptUploadState::Receiving => true,
                wire::ScriptUploadState::Committed => m.received_bytes == up.size,
                wire::ScriptUploadState::Rejected => true,
                wire::ScriptUploadState::Unspecified => false,
            };
        if !valid {
            tracing::warn!(
                received = m.received_bytes,
                sent = up.sent,
                state = state.as_str_name(),
                "script upload status refused"
            );
            self.close(conn, wire::CloseReason::ProtocolError, wall_ms);
            return;
        }
        match state {
            wire::ScriptUploadState::Committed => {
                self.stats.scripts_committed += 1;
                tracing::info!(size = up.size, "script upload committed by the client");
                self.end_upload(wall_ms, conn, issue);
            }
            wire::ScriptUploadState::Rejected => {
                self.stats.scripts_refused += 1;
                tracing::warn!(
                    reason = m.error.as_ref().map_or("", |e| e.reason.as_str()),
                    "script upload rejected by the client"
                );
                self.end_upload(wall_ms, conn, issue);
            }
            _ => {
                if let Some(u) = self
                    .conns
                    .get_mut(&conn)
                    .and_then(|c| c.uploads.get_mut(&issue))
                {
                    // a durable prefix never shrinks: an older report changes nothing
                    u.received = u.received.max(m.received_bytes);
                    u.sent = u.sent.max(u.received);
                }
                // the freed window may let any upload of this connection on
                self.pump_uploads(wall_ms, conn);
            }
        }
    }

    /// Pumps every upload of `conn`, in command order.
    fn pump_uploads(&mut self, wall_ms: i64, conn: ConnId) {
        let issues: Vec<Uuid7> = self
            .conns
            .get(&conn)
            .map(|c| c.uploads.keys().copied().collect())
            .unwrap_or_default();
        for issue in issues {
            self.pump_upload(wall_ms, conn, issue);
        }
    }

    /// Queues every signal still pending for `issue` on `conn` (at least
    /// once; the client ignores a revision it has handled).
    fn resend_signals(&mut self, conn: ConnId, issue: &[u8; 16]) {
        let pending = match self.store.pending_signals(issue) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "pending signals not readable");
                return;
            }
        };
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        for frame in pending {
            self.stats.signals_sent_again += 1;
            if let Err(e) = c.session.send(Payload::Signal(frame)) {
                tracing::warn!(error = %e, "pending signal not queued; sent after the next reconciliation");
                return;
            }
        }
    }

    /// The server's view of a known command (for callers and tests).
    ///
    /// # Errors
    /// As [`Store::command_view`].
    pub fn command(&self, issue: &[u8; 16]) -> Result<CommandView, OpError> {
        self.store.command_view(issue)
    }

    /// Canonical text of a UUID's bytes.
    #[must_use]
    pub fn uuid_text(bytes: &[u8; 16]) -> String {
        uuid_text(bytes)
    }

    /// Maps store knowledge for tests and tools.
    #[must_use]
    pub fn knowledge(k: &Knowledge) -> ServerKnown {
        convert::knowledge(k)
    }

    /// Whether the command source of a row is a script (for tools).
    #[must_use]
    pub fn is_script(source: &Source) -> bool {
        matches!(source, Source::Script { .. })
    }
}
