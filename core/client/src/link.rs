//! The client session core (plan §7.1, §6.2-§6.3): one replaceable network
//! session, as explicit states
//!
//! ```text
//! backoff -> connecting -> hello -> reconciling -> active -> closing
//!    ^___________|____________|__________|___________|  (any loss)
//! ```
//!
//! - Reconnects use the server session core's full-jitter [`Backoff`]
//!   (1 s to 60 s, reset only after 60 stable seconds); the jitter comes
//!   from a generator the owner seeds. A server restart (close 1012)
//!   reconnects at once.
//! - The hello carries the durable instance id; the welcome must match its
//!   envelope, a supported version, and a generation above every one this
//!   installation has seen.
//! - Heartbeats follow the server's policy from the welcome
//!   ([`Liveness`] of the session core).
//! - After the welcome, each `ReconcileRequest` is handed up
//!   ([`LinkEffect::Reconcile`]); the owner answers with the complete
//!   snapshot ([`Link::send_snapshot`]). The `ReconcileResult` is checked
//!   with `rvbox_reconcile::check_result` and handed up
//!   ([`LinkEffect::Reconciled`]); the owner applies it durably and only
//!   then calls [`Link::activate`]. Dispatches, signals, stdin and script
//!   chunks are accepted only in `active`.
//! - Every envelope is size-checked before decoding and its session fields
//!   are checked against the live session.

use std::collections::VecDeque;

use prost::Message as _;
use rvbox_domain::limits::{
    DEFAULT_HEARTBEAT_IDLE_MS, DEFAULT_LIVENESS_TIMEOUT_MS, DEFAULT_RECONNECT_INITIAL_MS,
    DEFAULT_RECONNECT_MAX_MS, DEFAULT_RECONNECT_STABLE_RESET_MS, MAX_ENVELOPE_BYTES,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_reconcile::limits::MAX_RECONCILE_ROWS;
use rvbox_reconcile::{CheckedResult, check_result};
use rvbox_session::{Backoff, Liveness, LivenessAction, close_code};

/// The protocol major this client speaks.
pub const PROTOCOL_MAJOR: u32 = 1;
/// Minors of major 1 this client speaks.
pub const SUPPORTED_MINORS: &[u32] = &[0];
/// How long a transport may take to open.
pub const CONNECT_TIMEOUT_MS: u64 = 30_000;
/// How long the welcome may take after the hello.
pub const HELLO_TIMEOUT_MS: u64 = DEFAULT_LIVENESS_TIMEOUT_MS;
/// Most effects waiting to be drained.
pub const MAX_EFFECTS: usize = 65_536;
/// Byte budget of one `ClientSnapshot` chunk (the envelope limit less the
/// header headroom of `rvbox-reconcile`).
pub const SNAPSHOT_CHUNK_BUDGET_BYTES: usize = rvbox_reconcile::limits::MAX_RESULT_BYTES;

/// WebSocket close codes the link sends or reads.
pub mod codes {
    use rvbox_proto::v1::CloseReason;

    fn code(r: CloseReason) -> u16 {
        rvbox_session::close_code(r).unwrap_or(1000)
    }

    /// 1000.
    #[must_use]
    pub fn normal() -> u16 {
        code(CloseReason::Normal)
    }
    /// 1002.
    #[must_use]
    pub fn protocol_error() -> u16 {
        code(CloseReason::ProtocolError)
    }
    /// 1009.
    #[must_use]
    pub fn too_big() -> u16 {
        code(CloseReason::MessageTooBig)
    }
    /// 1012: a restart; the peer reconnects at once.
    #[must_use]
    pub fn service_restart() -> u16 {
        code(CloseReason::ServiceRestart)
    }
    /// 4001.
    #[must_use]
    pub fn stale_session() -> u16 {
        code(CloseReason::StaleSession)
    }
    /// 4002.
    #[must_use]
    pub fn liveness_timeout() -> u16 {
        code(CloseReason::LivenessTimeout)
    }
}

/// Reconnect and heartbeat settings (`reconnect.*`, `session.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkConfig {
    /// First backoff cap.
    pub reconnect_initial_ms: u64,
    /// Largest backoff cap.
    pub reconnect_max_ms: u64,
    /// Connected this long, the backoff resets.
    pub stable_reset_ms: u64,
    /// Heartbeat idle time until the welcome says otherwise.
    pub heartbeat_idle_ms: u64,
    /// Liveness timeout until the welcome says otherwise.
    pub liveness_timeout_ms: u64,
    /// This client's per-command send window ceiling.
    pub command_window: u64,
    /// This client's per-session send window ceiling.
    pub session_window: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            reconnect_initial_ms: DEFAULT_RECONNECT_INITIAL_MS,
            reconnect_max_ms: DEFAULT_RECONNECT_MAX_MS,
            stable_reset_ms: DEFAULT_RECONNECT_STABLE_RESET_MS,
            heartbeat_idle_ms: DEFAULT_HEARTBEAT_IDLE_MS,
            liveness_timeout_ms: DEFAULT_LIVENESS_TIMEOUT_MS,
            command_window: rvbox_domain::limits::DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            session_window: rvbox_domain::limits::DEFAULT_SESSION_SEND_WINDOW_BYTES,
        }
    }
}

/// The phase of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting to dial again.
    Backoff {
        /// When.
        until_ms: u64,
    },
    /// A transport is being opened.
    Connecting {
        /// Since when.
        since_ms: u64,
    },
    /// The hello is sent; waiting for the welcome.
    Hello {
        /// Since when.
        since_ms: u64,
    },
    /// Welcomed; reconciliation runs (`round` once a request came).
    Reconciling {
        /// The round being answered.
        round: Option<u64>,
        /// Whether its result arrived and is being applied.
        applying: bool,
    },
    /// Reconciled: dispatch, capacity and events flow.
    Active {
        /// Since when.
        since_ms: u64,
    },
    /// Shutting down: no reconnect.
    Closing,
}

/// The live session's fields and windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSession {
    /// Session id.
    pub session_id: String,
    /// Generation.
    pub generation: u64,
    /// The server's identity.
    pub server_id: String,
    /// Per-command send window: the smaller of ours and the server's.
    pub command_window: u64,
    /// Per-session send window.
    pub session_window: u64,
}

/// What the link asks of its owner.
#[derive(Debug, Clone, PartialEq)]
pub enum LinkEffect {
    /// Open a transport to the server.
    Dial,
    /// Send this binary frame (an encoded envelope) on the control lane,
    /// in order with every other frame of that lane.
    Send(Vec<u8>),
    /// Send this binary frame on the data lane (terminal traffic): it may
    /// wait behind the control lane, never the other way round.
    SendData(Vec<u8>),
    /// Answer a WebSocket Ping.
    SendPong,
    /// Send a WebSocket Ping (heartbeat).
    SendPing,
    /// Close the transport with this code.
    Close(u16),
    /// A session was welcomed (persist its generation as the new floor).
    Welcomed(LiveSession),
    /// The server asks for a complete snapshot of `round`; requested rows
    /// name the commands whose tombstones it wants.
    Reconcile {
        /// The round.
        round: u64,
        /// The server's rows.
        rows: Vec<wire::ReconcileRow>,
    },
    /// A checked result: apply it durably, then [`Link::activate`].
    Reconciled(CheckedResult),
    /// A message for the active session (dispatch, signal, stdin, script
    /// chunk, event ack, PTY open).
    Message(Payload),
    /// The session ended (no more sending until the next is active).
    Down,
}

/// Counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkStats {
    /// Dials.
    pub dials: u64,
    /// Welcomes accepted.
    pub welcomes: u64,
    /// Sessions that reached active.
    pub activations: u64,
    /// Sessions lost (transport closed or closed by us).
    pub sessions_lost: u64,
    /// Protocol violations by the server (each closed the session).
    pub violations: u64,
    /// Heartbeat pings sent.
    pub pings: u64,
    /// `ControlError`s received.
    pub control_errors: u64,
}

/// A small deterministic generator for jitter, seeded by the owner.
#[derive(Debug, Clone)]
struct Jitter(u64);

impl Jitter {
    fn next(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Why a send was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no live session to send on")]
pub struct NotLive;

/// The client's network session state machine.
#[derive(Debug)]
pub struct Link {
    config: LinkConfig,
    phase: Phase,
    backoff: Backoff,
    liveness: Option<Liveness>,
    session: Option<LiveSession>,
    hello: wire::ClientHello,
    generation_floor: u64,
    jitter: Jitter,
    out: VecDeque<LinkEffect>,
    stats: LinkStats,
}

fn timeout_ms(d: Option<&prost_types::Duration>) -> Option<u64> {
    let d = d?;
    let ms = u64::try_from(d.seconds)
        .ok()?
        .checked_mul(1000)?
        .checked_add(u64::try_from(d.nanos / 1_000_000).ok()?)?;
    (ms > 0).then_some(ms)
}

impl Link {
    /// A link that dials at once. `hello` is sent on every connection;
    /// `generation_floor` is the highest generation this installation has
    /// seen (durable); `seed` seeds the jitter.
    #[must_use]
    pub fn new(
        config: LinkConfig,
        hello: wire::ClientHello,
        generation_floor: u64,
        seed: u64,
        now_ms: u64,
    ) -> Self {
        let mut link = Self {
            config,
            phase: Phase::Backoff { until_ms: now_ms },
            backoff: Backoff::new(
                config.reconnect_initial_ms,
                config.reconnect_max_ms,
                config.stable_reset_ms,
            ),
            liveness: None,
            session: None,
            hello,
            generation_floor,
            jitter: Jitter(seed | 1),
            out: VecDeque::new(),
            stats: LinkStats::default(),
        };
        link.handle_timeout(now_ms);
        link
    }

    /// The phase.
    #[must_use]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The live session, once welcomed.
    #[must_use]
    pub fn session(&self) -> Option<&LiveSession> {
        self.session.as_ref()
    }

    /// True in `active`.
    #[must_use]
    pub fn is_active(&self) -> bool {
        matches!(self.phase, Phase::Active { .. })
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// The backoff's current attempt count.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.backoff.attempt()
    }

    /// The next effect.
    #[must_use]
    pub fn poll_effect(&mut self) -> Option<LinkEffect> {
        self.out.pop_front()
    }

    fn push(&mut self, e: LinkEffect) {
        debug_assert!(self.out.len() < MAX_EFFECTS, "link effects not drained");
        self.out.push_back(e);
    }

    /// The one deadline of the link.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.phase {
            Phase::Backoff { until_ms } => Some(until_ms),
            Phase::Connecting { since_ms } => Some(since_ms.saturating_add(CONNECT_TIMEOUT_MS)),
            Phase::Hello { since_ms } => Some(since_ms.saturating_add(HELLO_TIMEOUT_MS)),
            Phase::Reconciling { .. } | Phase::Active { .. } => {
                self.liveness.as_ref().map(Liveness::deadline)
            }
            Phase::Closing => None,
        }
    }

    /// Timers: dial after the backoff, give up a slow connect or hello,
    /// heartbeat and liveness. Idempotent.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        match self.phase {
            Phase::Backoff { until_ms } if now_ms >= until_ms => {
                self.phase = Phase::Connecting { since_ms: now_ms };
                self.stats.dials += 1;
                self.push(LinkEffect::Dial);
            }
            Phase::Connecting { since_ms } if now_ms >= since_ms + CONNECT_TIMEOUT_MS => {
                self.lose(now_ms, Some(codes::normal()));
            }
            Phase::Hello { since_ms } if now_ms >= since_ms + HELLO_TIMEOUT_MS => {
                self.lose(now_ms, Some(codes::liveness_timeout()));
            }
            Phase::Reconciling { .. } | Phase::Active { .. } => {
                let action = self
                    .liveness
                    .as_mut()
                    .map_or(LivenessAction::Nothing, |l| l.on_timeout(now_ms));
                match action {
                    LivenessAction::Nothing => {}
                    LivenessAction::Ping => {
                        self.stats.pings += 1;
                        self.push(LinkEffect::SendPing);
                    }
                    LivenessAction::Close => self.lose(now_ms, Some(codes::liveness_timeout())),
                }
            }
            _ => {}
        }
    }

    /// The transport opened: send the hello.
    pub fn opened(&mut self, now_ms: u64) {
        if !matches!(self.phase, Phase::Connecting { .. }) {
            // not asked for
            self.push(LinkEffect::Close(codes::normal()));
            return;
        }
        self.phase = Phase::Hello { since_ms: now_ms };
        let env = wire::Envelope {
            session_id: String::new(),
            generation: 0,
            payload: Some(Payload::ClientHello(self.hello.clone())),
        };
        self.push(LinkEffect::Send(env.encode_to_vec()));
    }

    /// The transport closed (or could not open), with the peer's close code
    /// if it sent one.
    pub fn closed(&mut self, now_ms: u64, code: Option<u16>) {
        if matches!(self.phase, Phase::Backoff { .. } | Phase::Closing) {
            return;
        }
        let restart = code == Some(codes::service_restart());
        self.down(now_ms);
        if restart && let Phase::Backoff { .. } = self.phase {
            // plan R7: a restarting server is reconnected to at once
            self.phase = Phase::Backoff { until_ms: now_ms };
        }
    }

    /// A WebSocket Ping arrived.
    pub fn ping(&mut self, now_ms: u64) {
        if let Some(l) = self.liveness.as_mut() {
            l.on_inbound(now_ms);
        }
        if !matches!(self.phase, Phase::Backoff { .. } | Phase::Closing) {
            self.push(LinkEffect::SendPong);
        }
    }

    /// A WebSocket Pong arrived.
    pub fn pong(&mut self, now_ms: u64) {
        if let Some(l) = self.liveness.as_mut() {
            l.on_inbound(now_ms);
        }
    }

    /// Orderly shutdown: close with 1012 so the server sees a restart, and
    /// never reconnect.
    pub fn shutdown(&mut self) {
        let live = !matches!(self.phase, Phase::Backoff { .. } | Phase::Closing);
        if live {
            self.push(LinkEffect::Close(codes::service_restart()));
            self.push(LinkEffect::Down);
        }
        self.phase = Phase::Closing;
        self.session = None;
        self.liveness = None;
    }

    fn down(&mut self, now_ms: u64) {
        let was_live = self.session.is_some();
        self.backoff.on_disconnected(now_ms);
        self.session = None;
        self.liveness = None;
        if was_live {
            self.stats.sessions_lost += 1;
            self.push(LinkEffect::Down);
        }
        let delay = self.backoff.next_delay_ms(self.jitter.next());
        self.phase = Phase::Backoff {
            until_ms: now_ms.saturating_add(delay),
        };
    }

    /// Leaves the session: close with `code`, then back off.
    fn lose(&mut self, now_ms: u64, code: Option<u16>) {
        if let Some(code) = code {
            self.push(LinkEffect::Close(code));
        }
        self.down(now_ms);
    }

    fn violation(&mut self, now_ms: u64, code: u16) {
        self.stats.violations += 1;
        self.lose(now_ms, Some(code));
    }

    /// A binary frame arrived.
    pub fn frame(&mut self, now_ms: u64, bytes: &[u8]) {
        if matches!(
            self.phase,
            Phase::Backoff { .. } | Phase::Closing | Phase::Connecting { .. }
        ) {
            return;
        }
        if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_ENVELOPE_BYTES {
            self.violation(now_ms, codes::too_big());
            return;
        }
        let Ok(env) = wire::Envelope::decode(bytes) else {
            self.violation(now_ms, codes::protocol_error());
            return;
        };
        let Some(payload) = env.payload else {
            self.violation(now_ms, codes::protocol_error());
            return;
        };
        if let Some(l) = self.liveness.as_mut() {
            l.on_inbound(now_ms);
        }
        if let Payload::ControlError(_) = payload {
            self.stats.control_errors += 1;
            return;
        }
        match self.phase {
            Phase::Hello { .. } => match payload {
                Payload::ServerWelcome(w) => {
                    self.welcome(now_ms, &env.session_id, env.generation, w)
                }
                _ => self.violation(now_ms, codes::protocol_error()),
            },
            Phase::Reconciling { .. } | Phase::Active { .. } => {
                let live = self.session.as_ref().is_some_and(|s| {
                    s.session_id == env.session_id && s.generation == env.generation
                });
                if !live {
                    self.violation(now_ms, codes::stale_session());
                    return;
                }
                self.route(now_ms, payload);
            }
            _ => {}
        }
    }

    fn welcome(&mut self, now_ms: u64, session_id: &str, generation: u64, w: wire::ServerWelcome) {
        let sid_ok = (16..=64).contains(&session_id.len()) && session_id.is_ascii();
        let fields_ok = sid_ok
            && generation > 0
            && w.session_id == session_id
            && w.generation == generation
            && w.protocol_major == PROTOCOL_MAJOR
            && SUPPORTED_MINORS.contains(&w.negotiated_minor);
        // plan §6.2: generations only grow; a welcome at or below one this
        // installation saw is stale state on the server
        if !fields_ok || generation <= self.generation_floor {
            self.violation(now_ms, codes::protocol_error());
            return;
        }
        self.generation_floor = generation;
        let limits = w.limits.unwrap_or_default();
        let window = |ours: u64, theirs: u64| if theirs > 0 { ours.min(theirs) } else { ours };
        let session = LiveSession {
            session_id: session_id.to_owned(),
            generation,
            server_id: w.server_id,
            command_window: window(self.config.command_window, limits.command_window_bytes),
            session_window: window(self.config.session_window, limits.session_window_bytes),
        };
        // the server's heartbeat policy
        let idle =
            timeout_ms(limits.heartbeat_idle.as_ref()).unwrap_or(self.config.heartbeat_idle_ms);
        let dead = timeout_ms(limits.liveness_timeout.as_ref())
            .unwrap_or(self.config.liveness_timeout_ms)
            .max(idle);
        self.liveness = Some(Liveness::new(now_ms, idle, dead));
        self.backoff.on_connected(now_ms);
        self.session = Some(session.clone());
        self.phase = Phase::Reconciling {
            round: None,
            applying: false,
        };
        self.stats.welcomes += 1;
        self.push(LinkEffect::Welcomed(session));
    }

    fn route(&mut self, now_ms: u64, payload: Payload) {
        let active = self.is_active();
        match payload {
            Payload::ReconcileRequest(req) => {
                if req.round == 0 || req.rows.len() > MAX_RECONCILE_ROWS {
                    self.violation(now_ms, codes::protocol_error());
                    return;
                }
                // a new round: dispatch waits for its result again
                self.phase = Phase::Reconciling {
                    round: Some(req.round),
                    applying: false,
                };
                self.push(LinkEffect::Reconcile {
                    round: req.round,
                    rows: req.rows,
                });
            }
            Payload::ReconcileResult(res) => {
                let Phase::Reconciling {
                    round: Some(round),
                    applying: false,
                } = self.phase
                else {
                    self.violation(now_ms, codes::protocol_error());
                    return;
                };
                match check_result(&res, round) {
                    Ok(checked) => {
                        self.phase = Phase::Reconciling {
                            round: Some(round),
                            applying: true,
                        };
                        self.push(LinkEffect::Reconciled(checked));
                    }
                    Err(_) => self.violation(now_ms, codes::protocol_error()),
                }
            }
            Payload::EventAck(_) => self.push(LinkEffect::Message(payload)),
            Payload::ServerWelcome(_) => self.violation(now_ms, codes::protocol_error()),
            Payload::Dispatch(_)
            | Payload::Signal(_)
            | Payload::StdinWrite(_)
            | Payload::ScriptChunk(_)
                if active =>
            {
                self.push(LinkEffect::Message(payload));
            }
            // terminals do not depend on the commands' reconciliation: the
            // server sends their frames once it wrote its round, which may
            // be before this client applied the result
            Payload::PtyOpen(_)
            | Payload::PtyInput(_)
            | Payload::PtyResize(_)
            | Payload::PtyAttach(_)
            | Payload::PtyOutputAck(_)
            | Payload::PtyDetach(_)
            | Payload::PtyClose(_) => {
                self.push(LinkEffect::Message(payload));
            }
            _ => self.violation(now_ms, codes::protocol_error()),
        }
    }

    /// The owner applied the checked result durably: the session is active.
    /// Ignored unless a result is being applied.
    pub fn activate(&mut self, now_ms: u64) {
        if let Phase::Reconciling { applying: true, .. } = self.phase {
            self.phase = Phase::Active { since_ms: now_ms };
            self.stats.activations += 1;
        }
    }

    /// Wraps `payload` in an envelope of the live session and sends it.
    ///
    /// # Errors
    /// [`NotLive`] when there is no welcomed session.
    pub fn send(&mut self, payload: Payload) -> Result<(), NotLive> {
        let s = self.session.as_ref().ok_or(NotLive)?;
        let env = wire::Envelope {
            session_id: s.session_id.clone(),
            generation: s.generation,
            payload: Some(payload),
        };
        self.push(LinkEffect::Send(env.encode_to_vec()));
        Ok(())
    }

    /// Like [`Link::send`], on the data lane.
    ///
    /// # Errors
    /// [`NotLive`] when there is no welcomed session.
    pub fn send_data(&mut self, payload: Payload) -> Result<(), NotLive> {
        let s = self.session.as_ref().ok_or(NotLive)?;
        let env = wire::Envelope {
            session_id: s.session_id.clone(),
            generation: s.generation,
            payload: Some(payload),
        };
        self.push(LinkEffect::SendData(env.encode_to_vec()));
        Ok(())
    }

    /// Sends the snapshot chunks of `round` if that round is still the one
    /// being answered (a newer request supersedes it).
    pub fn send_snapshot(&mut self, round: u64, chunks: Vec<wire::ClientSnapshot>) {
        let current = matches!(
            self.phase,
            Phase::Reconciling { round: Some(r), applying: false } if r == round
        );
        if !current {
            return;
        }
        for c in chunks {
            if self.send(Payload::ClientSnapshot(c)).is_err() {
                return;
            }
        }
    }

    /// The session's close code for a protocol error the owner found
    /// (a dispatch for another generation, an ack beyond what was sent).
    pub fn protocol_error(&mut self, now_ms: u64) {
        if self.session.is_some() {
            self.violation(now_ms, codes::protocol_error());
        }
    }
}

/// The complete snapshot of `round`, split into chunks under the envelope
/// budget: records first (every retained command), then the tombstones
/// asked for, each list ascending as given (plan §6.4). There is always at
/// least one chunk, and only the last is final.
#[must_use]
pub fn snapshot_chunks(
    round: u64,
    health: wire::ScopeState,
    records: Vec<wire::SnapshotRecord>,
    tombstones: Vec<wire::SnapshotTombstone>,
) -> Vec<wire::ClientSnapshot> {
    let new_chunk = |index: u32| wire::ClientSnapshot {
        round,
        chunk_index: index,
        final_chunk: false,
        store_health: health as i32,
        records: Vec::new(),
        tombstones: Vec::new(),
    };
    let base = new_chunk(u32::MAX).encoded_len().saturating_add(16);
    let mut chunks = Vec::new();
    let mut current = new_chunk(0);
    let mut size = base;
    let mut items = 0usize;
    let mut add =
        |current: &mut wire::ClientSnapshot, chunks: &mut Vec<wire::ClientSnapshot>, len: usize| {
            if items > 0 && size.saturating_add(len) > SNAPSHOT_CHUNK_BUDGET_BYTES {
                let index = current.chunk_index.saturating_add(1);
                chunks.push(std::mem::replace(current, new_chunk(index)));
                size = base;
                items = 0;
            }
            size = size.saturating_add(len);
            items += 1;
        };
    for r in records {
        add(&mut current, &mut chunks, r.encoded_len().saturating_add(4));
        current.records.push(r);
    }
    for t in tombstones {
        add(&mut current, &mut chunks, t.encoded_len().saturating_add(4));
        current.tombstones.push(t);
    }
    current.final_chunk = true;
    chunks.push(current);
    chunks
}

/// Close codes the owner may need by name.
#[must_use]
pub fn close_for(reason: wire::CloseReason) -> Option<u16> {
    close_code(reason)
}
