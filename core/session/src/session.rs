//! The per-connection server session state machine (plan §6.1-§6.3).
//!
//! Sans-IO (conventions rule 2): the shell feeds [`Input`]s with a
//! monotonic `now_ms` through [`Session::handle`], then drains
//! [`Session::poll_effect`] until it returns `None`, performs the effects in
//! order, and re-arms one timer at [`Session::poll_timeout`].
//!
//! ```text
//! AwaitingHello --valid hello--> Registering --Registered--> Active(reconciling)
//!      |                            |                           |  ReconcileWritten
//!      +--------- any failure ------+------> Closed <-----------+--> Active(ready)
//! ```
//!
//! Durability is always an input (rule 3): the welcome goes out only after
//! [`Input::Registered`], an `EventAck` only after [`Input::EventsDurable`].

use std::collections::VecDeque;

use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::limits::{DEFAULT_LIVENESS_TIMEOUT_MS, DEFAULT_RECONCILE_TIMEOUT_MS};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::CloseReason;
use rvbox_proto::v1::envelope::Payload;
use thiserror::Error;

use crate::hello::{ValidHello, validate_hello};
use crate::liveness::{Liveness, LivenessAction};
use crate::registration::SessionId;
use crate::welcome::{ConfigError, ServerIdentity, SessionLimits, envelope, welcome_envelope};
use crate::window::{HELD_EVENTS_CAPACITY, Windows, event_window_cost, is_gated_body};
use crate::wire::{Direction, Lane, close_text, payload_direction, payload_lane, payload_name};

/// Longest wait for the `ClientHello` after the upgrade (the liveness
/// timeout: a peer that only answers Pings must still say hello).
pub const HELLO_TIMEOUT_MS: u64 = DEFAULT_LIVENESS_TIMEOUT_MS;

/// Metric names emitted as [`Effect::Metric`] (R-2.2-05).
pub mod metrics {
    /// A `ClientHello` passed validation.
    pub const HELLO_ACCEPTED: &str = "rvbox_session_hello_accepted_total";
    /// A hello was refused (label: close reason).
    pub const HELLO_REJECTED: &str = "rvbox_session_hello_rejected_total";
    /// A welcome was sent.
    pub const REGISTERED: &str = "rvbox_session_registered_total";
    /// A ReconcileResult was written and dispatch enabled.
    pub const RECONCILED: &str = "rvbox_session_reconciled_total";
    /// A liveness Ping was sent.
    pub const PING_SENT: &str = "rvbox_session_ping_sent_total";
    /// A stale or unknown envelope was discarded.
    pub const STALE_DISCARDED: &str = "rvbox_session_stale_envelopes_total";
    /// A `CommandEvent` was admitted to the window.
    pub const EVENTS_RECEIVED: &str = "rvbox_session_events_received_total";
    /// An event was held back by the closed ingress gate.
    pub const EVENTS_HELD: &str = "rvbox_session_events_held_total";
    /// An `EventAck` was sent.
    pub const ACKS_SENT: &str = "rvbox_session_event_acks_total";
    /// A completion arrived for a registration this session no longer waits for.
    pub const LATE_COMPLETION: &str = "rvbox_session_late_completions_total";
    /// The session closed (label: close reason text).
    pub const CLOSED: &str = "rvbox_session_closed_total";
}

/// A metric increment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    /// Counter name (one of [`metrics`]).
    pub name: &'static str,
    /// Optional `reason` label value.
    pub reason: Option<&'static str>,
}

/// What an audit record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AuditKind {
    /// A hello failed validation.
    HelloRejected,
    /// A different instance was refused while another is live.
    LiveConflict,
    /// A session was registered and welcomed.
    Registered,
    /// A stale or unknown envelope was discarded and the socket closed.
    StaleSession,
    /// The peer broke the protocol.
    ProtocolError,
    /// This session was fenced by a newer generation.
    Fenced,
    /// No inbound frame for the liveness timeout.
    LivenessTimeout,
    /// Reconciliation did not complete within the reconcile timeout.
    ReconcileTimeout,
    /// An ingress queue was full; closed without acknowledging.
    IngressOverload,
    /// The client sent a `ControlError`.
    ClientError,
    /// The client's storage scope is unavailable.
    StorageUnavailable,
    /// An internal invariant failed.
    InternalError,
}

/// An audit record; the shell adds time, client and session context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    /// What happened.
    pub kind: AuditKind,
    /// Bounded, payload-free explanation.
    pub detail: String,
}

/// A completion token for the registration request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegistrationToken(pub u64);

/// A validated client event handed to the persistence worker.
#[derive(Debug, Clone, PartialEq)]
pub struct EventDescriptor {
    /// The command.
    pub issue: Uuid7,
    /// Its sequence.
    pub event_seq: u64,
    /// Bytes it occupies in the send windows and the ingress gate.
    pub window_cost: u64,
    /// The sequence was already received: the store compares content and
    /// answers with [`Input::EventsDurable`] (identical) or
    /// [`Input::EventRefused`] (conflicting).
    pub repeat: bool,
    /// The event.
    pub event: wire::CommandEvent,
}

/// A validated client message for the caller's workers.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientMessage {
    /// Answer to a Dispatch.
    CommandAccepted {
        /// The command.
        issue: Uuid7,
        /// The message.
        message: wire::CommandAccepted,
    },
    /// A sequenced command event.
    CommandEvent(EventDescriptor),
    /// Script upload progress.
    ScriptUploadStatus {
        /// The command.
        issue: Uuid7,
        /// The message.
        message: wire::ScriptUploadStatus,
    },
    /// Current client capacity.
    ClientCapacity(wire::ClientCapacity),
    /// A reconciliation snapshot chunk.
    ClientSnapshot(wire::ClientSnapshot),
    /// A PTY message (`PtyOpened`, `PtyInputAck`, `PtyOutput`, `PtyClosed`).
    Pty {
        /// The PTY session.
        pty_session_id: Uuid7,
        /// The payload.
        payload: Payload,
    },
    /// The client reported an error.
    ControlError(wire::ControlError),
}

/// Something the session asks the shell to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Encode and queue this envelope on this writer lane.
    Send {
        /// The lane.
        lane: Lane,
        /// The envelope, carrying the live session fields.
        envelope: wire::Envelope,
    },
    /// Send a WebSocket Ping control frame (never a protobuf message).
    Ping,
    /// Send a close frame with this reason, then drop the connection.
    Close {
        /// Why.
        reason: CloseReason,
    },
    /// Run the registration transaction for this hello (load the record,
    /// [`crate::decide_registration`], commit), then answer with
    /// [`Input::Registered`] or [`Input::RegistrationRejected`].
    Register {
        /// Completion token.
        token: RegistrationToken,
        /// The validated hello.
        hello: Box<ValidHello>,
    },
    /// Hand a validated client message to the workers.
    Deliver(ClientMessage),
    /// Write an audit record.
    Audit(Audit),
    /// Increment a counter.
    Metric(Metric),
}

/// Something that happened to the connection.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A complete WebSocket binary message.
    Binary(Vec<u8>),
    /// A WebSocket text message (always refused).
    Text,
    /// A WebSocket Pong.
    Pong,
    /// A WebSocket Ping from the client (the shell answers with a Pong).
    Ping,
    /// The registration transaction committed.
    Registered {
        /// Token of the request.
        token: RegistrationToken,
        /// The new session id.
        session_id: SessionId,
        /// The new generation (>= 1).
        generation: u64,
    },
    /// The registration was refused (live conflict with the claim already
    /// persisted, storage unavailable, ...).
    RegistrationRejected {
        /// Token of the request.
        token: RegistrationToken,
        /// The error to send before closing.
        error: DomainError,
    },
    /// A newer generation of this client replaced this session.
    Fenced {
        /// The generation that replaced it.
        by_generation: u64,
    },
    /// The `ReconcileResult` of a round was written durably: send it and
    /// enable dispatch and event ingest.
    ReconcileWritten(wire::ReconcileResult),
    /// The store made every event of `issue` up to `durable_seq` durable
    /// (also the answer to an identical repeat). Only this input produces an
    /// `EventAck`; the shell releases the same descriptors' bytes from its
    /// [`crate::IngressGate`].
    EventsDurable {
        /// The command.
        issue: Uuid7,
        /// Highest durable sequence.
        durable_seq: u64,
    },
    /// The store refused an event (conflicting duplicate, gap against the
    /// durable log, event after terminal, unavailable scope, ...).
    EventRefused {
        /// The command.
        issue: Uuid7,
        /// The refused sequence.
        event_seq: u64,
        /// Why.
        error: DomainError,
    },
    /// The server-wide [`crate::IngressGate`] changed. A session starts
    /// with the gate open; the shell sends the current state right after
    /// creating a session while the gate is closed.
    IngressGate {
        /// Whether new output may be admitted.
        open: bool,
    },
    /// The shell could not enqueue a delivered descriptor.
    IngressQueueFull,
    /// The writer's control lane was full (a session-fatal invariant).
    ControlLaneFull,
    /// The timer armed at [`Session::poll_timeout`] fired.
    Timeout,
    /// The daemon is shutting down or restarting.
    Shutdown,
    /// The socket is gone.
    PeerClosed,
}

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the `ClientHello`.
    AwaitingHello,
    /// Waiting for the registration transaction.
    Registering,
    /// Welcomed; waiting for the `ReconcileResult` to be written.
    Reconciling,
    /// Dispatch and event ingest are on.
    Ready,
    /// Closed; every later input is ignored.
    Closed,
}

/// Why [`Session::send`] refused a message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SendError {
    /// The session is closed.
    #[error("session is closed")]
    Closed,
    /// No session is established yet.
    #[error("session is not established")]
    NotActive,
    /// Data-lane traffic waits for the written ReconcileResult.
    #[error("{payload} waits until the ReconcileResult has been written")]
    NotReconciled {
        /// Payload name.
        payload: &'static str,
    },
    /// Not a message the caller sends (client-to-server, welcome, ack or
    /// reconcile result, which the session itself sends).
    #[error("{payload} is not sent through Session::send")]
    NotCallerMessage {
        /// Payload name.
        payload: &'static str,
    },
    /// A Dispatch for another generation (R-6.2-14).
    #[error("dispatch for generation {dispatch} on live generation {live}")]
    GenerationMismatch {
        /// Generation in the Dispatch.
        dispatch: u64,
        /// Live generation.
        live: u64,
    },
    /// The envelope would exceed the envelope ceiling.
    #[error("envelope of {bytes} bytes exceeds {limit}")]
    TooLarge {
        /// Encoded size.
        bytes: u64,
        /// Limit.
        limit: u64,
    },
}

/// Configuration of every session of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Who the server is.
    pub identity: ServerIdentity,
    /// Limits enforced and announced.
    pub limits: SessionLimits,
    /// Longest wait for the hello (default [`HELLO_TIMEOUT_MS`]).
    pub hello_timeout_ms: u64,
    /// Longest time from the welcome to a written `ReconcileResult`
    /// (default [`DEFAULT_RECONCILE_TIMEOUT_MS`]): a client that keeps
    /// answering Pings but never completes its snapshot holds no session
    /// for ever.
    pub reconcile_timeout_ms: u64,
}

impl SessionConfig {
    /// A config with default limits.
    #[must_use]
    pub fn new(identity: ServerIdentity) -> Self {
        Self {
            identity,
            limits: SessionLimits::default(),
            hello_timeout_ms: HELLO_TIMEOUT_MS,
            reconcile_timeout_ms: DEFAULT_RECONCILE_TIMEOUT_MS,
        }
    }

    /// Checks every bound.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.identity.validate()?;
        self.limits.validate()?;
        if self.hello_timeout_ms == 0 {
            return Err(ConfigError {
                field: "hello_timeout_ms",
                reason: "must be above 0".into(),
            });
        }
        if self.reconcile_timeout_ms == 0 {
            return Err(ConfigError {
                field: "reconcile_timeout_ms",
                reason: "must be above 0".into(),
            });
        }
        Ok(())
    }
}

/// The envelope's session fields alone (tags 1 and 2 of `Envelope`):
/// decoding it skips the payload without allocating it (R-6.1-14).
#[derive(Clone, PartialEq, prost::Message)]
struct EnvelopeHeader {
    #[prost(string, tag = "1")]
    session_id: String,
    #[prost(uint64, tag = "2")]
    generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    AwaitingHello,
    Registering {
        token: RegistrationToken,
        minor: u32,
    },
    Active {
        session_id: SessionId,
        generation: u64,
        minor: u32,
        ready: bool,
        /// When the welcome went out: reconciliation must be complete
        /// within the reconcile timeout of it.
        welcomed_ms: u64,
    },
    Closed,
}

/// One agent WebSocket connection on the server.
#[derive(Debug, Clone)]
pub struct Session {
    config: SessionConfig,
    state: State,
    opened_ms: u64,
    last_now_ms: u64,
    liveness: Liveness,
    next_token: u64,
    client_id: Option<ClientId>,
    windows: Windows,
    gate_open: bool,
    held: VecDeque<EventDescriptor>,
    effects: VecDeque<Effect>,
    /// The client id the connection's verified TLS client certificate
    /// names (`server.client_identity = "tls-client-cert"`); a hello
    /// claiming another is refused.
    certified: Option<String>,
}

impl Session {
    /// A session for a connection upgraded at monotonic `now_ms`.
    ///
    /// # Errors
    /// [`ConfigError`] when `config` is out of bounds.
    pub fn new(now_ms: u64, config: SessionConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let limits = config.limits;
        Ok(Self {
            state: State::AwaitingHello,
            opened_ms: now_ms,
            last_now_ms: now_ms,
            liveness: Liveness::new(now_ms, limits.heartbeat_idle_ms, limits.liveness_timeout_ms),
            next_token: 1,
            client_id: None,
            windows: Windows::new(limits.command_window_bytes, limits.session_window_bytes),
            gate_open: true,
            // grows as events are held (bounded by length below)
            held: VecDeque::new(),
            effects: VecDeque::new(),
            certified: None,
            config,
        })
    }

    /// The client id the connection's verified client certificate names:
    /// the hello must claim exactly it.
    pub fn set_certified(&mut self, client_id: String) {
        self.certified = Some(client_id);
    }

    /// Where the session is.
    #[must_use]
    pub fn phase(&self) -> Phase {
        match &self.state {
            State::AwaitingHello => Phase::AwaitingHello,
            State::Registering { .. } => Phase::Registering,
            State::Active { ready: false, .. } => Phase::Reconciling,
            State::Active { ready: true, .. } => Phase::Ready,
            State::Closed => Phase::Closed,
        }
    }

    /// The live session id and generation once welcomed.
    #[must_use]
    pub fn live(&self) -> Option<(&SessionId, u64)> {
        match &self.state {
            State::Active {
                session_id,
                generation,
                ..
            } => Some((session_id, *generation)),
            _ => None,
        }
    }

    /// The negotiated minor once the hello was accepted.
    #[must_use]
    pub fn negotiated_minor(&self) -> Option<u32> {
        match &self.state {
            State::Registering { minor, .. } | State::Active { minor, .. } => Some(*minor),
            _ => None,
        }
    }

    /// The client id from the validated hello.
    #[must_use]
    pub fn client_id(&self) -> Option<&ClientId> {
        self.client_id.as_ref()
    }

    /// Unacknowledged event bytes of this session.
    #[must_use]
    pub fn in_flight_bytes(&self) -> u64 {
        self.windows.in_flight_bytes()
    }

    /// Events held back by the closed ingress gate.
    #[must_use]
    pub fn held_events(&self) -> usize {
        self.held.len()
    }

    /// The next monotonic instant [`Input::Timeout`] is due; `None` once
    /// closed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.state {
            State::Closed => None,
            State::AwaitingHello => Some(
                self.liveness
                    .deadline()
                    .min(self.opened_ms.saturating_add(self.config.hello_timeout_ms)),
            ),
            State::Active {
                ready: false,
                welcomed_ms,
                ..
            } => Some(
                self.liveness
                    .deadline()
                    .min(welcomed_ms.saturating_add(self.config.reconcile_timeout_ms)),
            ),
            _ => Some(self.liveness.deadline()),
        }
    }

    /// The next effect to perform, in order.
    #[must_use]
    pub fn poll_effect(&mut self) -> Option<Effect> {
        let effect = self.effects.pop_front();
        if self.effects.is_empty() && self.effects.capacity() > 0 {
            // an idle session keeps no room for effects (each is a few
            // hundred bytes, and most sessions are idle most of the time)
            self.effects = VecDeque::new();
        }
        effect
    }

    /// Feeds one input at monotonic `now_ms`. A `now_ms` earlier than a
    /// previous one is treated as the previous one.
    pub fn handle(&mut self, now_ms: u64, input: Input) {
        let now = now_ms.max(self.last_now_ms);
        self.last_now_ms = now;
        if self.state == State::Closed {
            return;
        }
        match input {
            Input::Binary(bytes) => self.on_binary(now, &bytes),
            Input::Text => self.protocol_error("text messages are not accepted".into()),
            Input::Pong | Input::Ping => self.liveness.on_inbound(now),
            Input::Registered {
                token,
                session_id,
                generation,
            } => self.on_registered(token, session_id, generation),
            Input::RegistrationRejected { token, error } => self.on_rejected(token, &error),
            Input::Fenced { by_generation } => self.on_fenced(by_generation),
            Input::ReconcileWritten(result) => self.on_reconcile_written(result),
            Input::EventsDurable { issue, durable_seq } => self.on_durable(issue, durable_seq),
            Input::EventRefused {
                issue,
                event_seq,
                error,
            } => self.on_event_refused(issue, event_seq, &error),
            Input::IngressGate { open } => self.on_gate(open),
            Input::IngressQueueFull => self.close(
                CloseReason::IngressOverload,
                None,
                AuditKind::IngressOverload,
                "the persistence queue is full; closed without acknowledging".into(),
            ),
            Input::ControlLaneFull => self.close(
                CloseReason::InternalError,
                None,
                AuditKind::InternalError,
                "the control lane is full".into(),
            ),
            Input::Timeout => self.on_timeout(now),
            Input::Shutdown => {
                self.push_close(CloseReason::ServiceRestart);
            }
            Input::PeerClosed => {
                self.state = State::Closed;
                self.held.clear();
                self.metric(metrics::CLOSED, Some("PEER_CLOSED"));
            }
        }
    }

    /// Queues a server-to-client message on its lane, in an envelope with
    /// the live session fields.
    ///
    /// # Errors
    /// [`SendError`] when the session cannot carry it now; nothing is
    /// queued then (a Dispatch stays durable and is retried later).
    pub fn send(&mut self, payload: Payload) -> Result<(), SendError> {
        let name = payload_name(&payload);
        let (session_id, generation, ready) = match &self.state {
            State::Closed => return Err(SendError::Closed),
            State::AwaitingHello | State::Registering { .. } => return Err(SendError::NotActive),
            State::Active {
                session_id,
                generation,
                ready,
                ..
            } => (session_id, *generation, *ready),
        };
        if payload_direction(&payload) == Direction::ClientToServer
            || matches!(
                payload,
                Payload::ServerWelcome(_) | Payload::EventAck(_) | Payload::ReconcileResult(_)
            )
        {
            return Err(SendError::NotCallerMessage { payload: name });
        }
        let lane = payload_lane(&payload);
        // plan §6.4: dispatch (and all data) stays off until the
        // ReconcileResult has been written on this session.
        if lane == Lane::Data && !ready {
            return Err(SendError::NotReconciled { payload: name });
        }
        if let Payload::Dispatch(d) = &payload
            && d.generation != generation
        {
            return Err(SendError::GenerationMismatch {
                dispatch: d.generation,
                live: generation,
            });
        }
        let env = envelope(session_id, generation, payload);
        let bytes = u64::try_from(env.encoded_len()).unwrap_or(u64::MAX);
        if bytes > self.config.limits.max_envelope_bytes {
            return Err(SendError::TooLarge {
                bytes,
                limit: self.config.limits.max_envelope_bytes,
            });
        }
        self.effects.push_back(Effect::Send {
            lane,
            envelope: env,
        });
        Ok(())
    }

    // ---- inbound frames ---------------------------------------------------

    fn on_binary(&mut self, now: u64, bytes: &[u8]) {
        let limit = self.config.limits.max_envelope_bytes;
        let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        // plan §6.1: size before decode.
        if len > limit {
            self.close(
                CloseReason::MessageTooBig,
                None,
                AuditKind::ProtocolError,
                format!("binary message of {len} bytes exceeds {limit}"),
            );
            return;
        }
        // plan §6.1: session fields before the payload is allocated.
        let Ok(header) = EnvelopeHeader::decode(bytes) else {
            self.protocol_error("the envelope does not decode".into());
            return;
        };
        match &self.state {
            State::AwaitingHello => {
                if !header.session_id.is_empty() || header.generation != 0 {
                    self.protocol_error(
                        "the first envelope must carry an empty session_id and generation 0".into(),
                    );
                    return;
                }
            }
            State::Registering { .. } => {
                self.protocol_error("message before welcome".into());
                return;
            }
            State::Active {
                session_id,
                generation,
                ..
            } => {
                if header.session_id != session_id.as_str() || header.generation != *generation {
                    self.stale(&header);
                    return;
                }
            }
            State::Closed => return,
        }
        let Ok(env) = wire::Envelope::decode(bytes) else {
            self.protocol_error("the envelope does not decode".into());
            return;
        };
        let Some(payload) = env.payload else {
            self.protocol_error("the envelope payload is unset or unknown".into());
            return;
        };
        if payload_direction(&payload) == Direction::ServerToClient {
            self.protocol_error(format!(
                "{} is a server-to-client message",
                payload_name(&payload)
            ));
            return;
        }
        // plan §6.3: any valid inbound frame counts as activity, in the
        // read path, before any worker sees it.
        self.liveness.on_inbound(now);
        if self.state == State::AwaitingHello {
            match payload {
                Payload::ClientHello(hello) => self.on_hello(hello),
                other => {
                    self.protocol_error(format!("{} before ClientHello", payload_name(&other)))
                }
            }
            return;
        }
        self.route(payload);
    }

    fn stale(&mut self, header: &EnvelopeHeader) {
        // plan §6.2: stale or unknown traffic is discarded, audited, closed.
        self.metric(metrics::STALE_DISCARDED, None);
        let detail = format!(
            "discarded an envelope for session {:?} generation {}",
            truncate(
                &header.session_id,
                crate::registration::MAX_SESSION_ID_BYTES
            ),
            header.generation
        );
        let error = DomainError::new(
            Code::StaleSession,
            "the envelope's session_id/generation is not the live session",
        );
        self.close(
            CloseReason::StaleSession,
            Some(error),
            AuditKind::StaleSession,
            detail,
        );
    }

    fn on_hello(&mut self, hello: wire::ClientHello) {
        match validate_hello(hello, &self.config.identity.supported_minors) {
            Err(e) => {
                self.metric(
                    metrics::HELLO_REJECTED,
                    Some(close_text(CloseReason::HelloRejected)),
                );
                let error = e.to_domain();
                self.close(
                    CloseReason::HelloRejected,
                    Some(error),
                    AuditKind::HelloRejected,
                    e.to_string(),
                );
            }
            Ok(valid)
                if self
                    .certified
                    .as_deref()
                    .is_some_and(|c| c != valid.client_id.as_str()) =>
            {
                let certified = self.certified.clone().unwrap_or_default();
                let reason = format!(
                    "client_hello.client_id {:?} is not the client its TLS client certificate names ({certified:?})",
                    valid.client_id.as_str()
                );
                self.metric(
                    metrics::HELLO_REJECTED,
                    Some(close_text(CloseReason::HelloRejected)),
                );
                self.close(
                    CloseReason::HelloRejected,
                    Some(DomainError::new(Code::FailedPrecondition, reason.clone())),
                    AuditKind::HelloRejected,
                    reason,
                );
            }
            Ok(valid) => {
                let token = RegistrationToken(self.next_token);
                self.next_token = self.next_token.saturating_add(1);
                self.client_id = Some(valid.client_id.clone());
                self.state = State::Registering {
                    token,
                    minor: valid.negotiated_minor,
                };
                self.metric(metrics::HELLO_ACCEPTED, None);
                self.effects.push_back(Effect::Register {
                    token,
                    hello: Box::new(valid),
                });
            }
        }
    }

    fn route(&mut self, payload: Payload) {
        let ready = matches!(self.state, State::Active { ready: true, .. });
        let name = payload_name(&payload);
        match payload {
            Payload::ClientHello(_) => {
                self.protocol_error("a second ClientHello on an established session".into());
            }
            Payload::ControlError(e) => {
                let detail = e.detail.as_ref().map_or_else(
                    || "ControlError without detail".to_owned(),
                    |d| {
                        format!(
                            "client error code {}: {}",
                            d.code,
                            truncate(&d.reason, DETAIL_REASON_BYTES)
                        )
                    },
                );
                self.audit(AuditKind::ClientError, detail);
                self.deliver(ClientMessage::ControlError(e));
            }
            Payload::ClientSnapshot(s) => self.deliver(ClientMessage::ClientSnapshot(s)),
            // protocol.md "Replay": the client sends capacity, acceptances,
            // events and PTY traffic only after applying the ReconcileResult.
            _ if !ready => {
                self.protocol_error(format!("{name} before the ReconcileResult"));
            }
            Payload::CommandEvent(ev) => self.on_event(ev),
            Payload::CommandAccepted(m) => {
                if let Some(issue) = self.parse_issue("command_accepted.issue_uuid", &m.issue_uuid)
                {
                    self.deliver(ClientMessage::CommandAccepted { issue, message: m });
                }
            }
            Payload::ScriptUploadStatus(m) => {
                if let Some(issue) =
                    self.parse_issue("script_upload_status.issue_uuid", &m.issue_uuid)
                {
                    self.deliver(ClientMessage::ScriptUploadStatus { issue, message: m });
                }
            }
            Payload::ClientCapacity(c) => self.deliver(ClientMessage::ClientCapacity(c)),
            Payload::PtyOpened(ref m) => {
                let id = m.pty_session_id.clone();
                self.deliver_pty(&id, payload);
            }
            Payload::PtyInputAck(ref m) => {
                let id = m.pty_session_id.clone();
                self.deliver_pty(&id, payload);
            }
            Payload::PtyOutput(ref m) => {
                let id = m.pty_session_id.clone();
                self.deliver_pty(&id, payload);
            }
            Payload::PtyClosed(ref m) => {
                let id = m.pty_session_id.clone();
                self.deliver_pty(&id, payload);
            }
            // Server-to-client payloads were refused in on_binary.
            other => self.protocol_error(format!(
                "{} is a server-to-client message",
                payload_name(&other)
            )),
        }
    }

    fn deliver_pty(&mut self, id: &str, payload: Payload) {
        if let Some(pty_session_id) = self.parse_issue("pty_session_id", id) {
            self.deliver(ClientMessage::Pty {
                pty_session_id,
                payload,
            });
        }
    }

    fn parse_issue(&mut self, field: &'static str, text: &str) -> Option<Uuid7> {
        match Uuid7::parse(field, text) {
            Ok(id) => Some(id),
            Err(e) => {
                self.protocol_error(e.to_string());
                None
            }
        }
    }

    fn on_event(&mut self, event: wire::CommandEvent) {
        let Some(issue) = self.parse_issue("command_event.issue_uuid", &event.issue_uuid) else {
            return;
        };
        let terminal = match &event.body {
            None => {
                self.protocol_error("command_event.body is unset or unknown".into());
                return;
            }
            Some(wire::command_event::Body::Lifecycle(change)) => {
                Lifecycle::from_wire(change.lifecycle).is_ok_and(Lifecycle::is_terminal)
            }
            Some(_) => false,
        };
        let cost = event_window_cost(&event);
        let event_seq = event.event_seq;
        let repeat = match self.windows.admit(issue, event_seq, cost, terminal) {
            Ok(repeat) => repeat,
            Err(e) if e.is_protocol_error() => {
                self.protocol_error(format!("command {issue} event_seq {event_seq}: {e}"));
                return;
            }
            Err(e) => {
                self.close(
                    CloseReason::IngressOverload,
                    None,
                    AuditKind::IngressOverload,
                    e.to_string(),
                );
                return;
            }
        };
        self.metric(metrics::EVENTS_RECEIVED, None);
        // plan §6.1: above the high watermark new output waits in this
        // session's bounded queue; lifecycle/control bodies use the reserve
        // unless their command already has held events (per-command order).
        let hold = self.windows.has_held(&issue) || (!self.gate_open && is_gated_body(&event));
        let descriptor = EventDescriptor {
            issue,
            event_seq,
            window_cost: cost,
            repeat,
            event,
        };
        if !hold {
            self.deliver(ClientMessage::CommandEvent(descriptor));
            return;
        }
        if self.held.len() >= HELD_EVENTS_CAPACITY {
            self.close(
                CloseReason::IngressOverload,
                None,
                AuditKind::IngressOverload,
                format!(
                    "ingress gate closed and {HELD_EVENTS_CAPACITY} events already held; \
                     closed without acknowledging"
                ),
            );
            return;
        }
        self.windows.set_held(issue, true);
        self.held.push_back(descriptor);
        self.metric(metrics::EVENTS_HELD, None);
    }

    // ---- completions --------------------------------------------------------

    fn on_registered(&mut self, token: RegistrationToken, session_id: SessionId, generation: u64) {
        let minor = match self.state {
            State::Registering { token: t, minor } if t == token => minor,
            _ => {
                self.metric(metrics::LATE_COMPLETION, None);
                return;
            }
        };
        if generation == 0 {
            self.close(
                CloseReason::InternalError,
                None,
                AuditKind::InternalError,
                "registration committed generation 0".into(),
            );
            return;
        }
        let welcome = welcome_envelope(
            &self.config.identity,
            &self.config.limits,
            minor,
            &session_id,
            generation,
        );
        self.audit(
            AuditKind::Registered,
            format!("session {session_id} generation {generation} minor {minor}"),
        );
        self.state = State::Active {
            session_id,
            generation,
            minor,
            ready: false,
            welcomed_ms: self.last_now_ms,
        };
        self.effects.push_back(Effect::Send {
            lane: Lane::Control,
            envelope: welcome,
        });
        self.metric(metrics::REGISTERED, None);
    }

    fn on_rejected(&mut self, token: RegistrationToken, error: &DomainError) {
        if !matches!(self.state, State::Registering { token: t, .. } if t == token) {
            self.metric(metrics::LATE_COMPLETION, None);
            return;
        }
        let (reason, kind) = match error.code() {
            Code::Unavailable => (
                CloseReason::StorageUnavailable,
                AuditKind::StorageUnavailable,
            ),
            Code::LiveConflict => (CloseReason::HelloRejected, AuditKind::LiveConflict),
            Code::Internal => (CloseReason::InternalError, AuditKind::InternalError),
            _ => (CloseReason::HelloRejected, AuditKind::HelloRejected),
        };
        self.metric(metrics::HELLO_REJECTED, Some(close_text(reason)));
        self.close(reason, Some(error.clone()), kind, error.to_string());
    }

    fn on_fenced(&mut self, by_generation: u64) {
        if matches!(self.state, State::AwaitingHello) {
            return;
        }
        self.close(
            CloseReason::SessionFenced,
            None,
            AuditKind::Fenced,
            format!("replaced by generation {by_generation}"),
        );
    }

    fn on_reconcile_written(&mut self, result: wire::ReconcileResult) {
        let State::Active { .. } = self.state else {
            self.metric(metrics::LATE_COMPLETION, None);
            return;
        };
        for row in &result.resume {
            let seeded = Uuid7::parse("reconcile_result.resume.issue_uuid", &row.issue_uuid)
                .map_err(|e| e.to_string())
                .and_then(|issue| {
                    self.windows
                        .seed(issue, row.durable_event_seq)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = seeded {
                self.close(
                    CloseReason::InternalError,
                    None,
                    AuditKind::InternalError,
                    format!("written ReconcileResult cannot be applied: {e}"),
                );
                return;
            }
        }
        let Some((session_id, generation)) = self.live().map(|(s, g)| (s.clone(), g)) else {
            return;
        };
        if let State::Active { ready, .. } = &mut self.state {
            *ready = true;
        }
        self.effects.push_back(Effect::Send {
            lane: Lane::Control,
            envelope: envelope(&session_id, generation, Payload::ReconcileResult(result)),
        });
        self.metric(metrics::RECONCILED, None);
    }

    fn on_durable(&mut self, issue: Uuid7, durable_seq: u64) {
        let Some((session_id, generation)) = self.live().map(|(s, g)| (s.clone(), g)) else {
            return;
        };
        // plan §6.2 / rule 3: the ack follows the store's durable report,
        // never the receipt.
        let d = self.windows.durable(issue, durable_seq);
        if let Some(seq) = d.ack {
            let ack = wire::EventAck {
                issue_uuid: issue.to_string(),
                durable_event_seq: seq,
            };
            self.effects.push_back(Effect::Send {
                lane: Lane::Control,
                envelope: envelope(&session_id, generation, Payload::EventAck(ack)),
            });
            self.metric(metrics::ACKS_SENT, None);
        }
    }

    fn on_event_refused(&mut self, issue: Uuid7, event_seq: u64, error: &DomainError) {
        if self.live().is_none() {
            return;
        }
        let (reason, kind) = match error.code() {
            Code::Unavailable => (
                CloseReason::StorageUnavailable,
                AuditKind::StorageUnavailable,
            ),
            Code::Internal => (CloseReason::InternalError, AuditKind::InternalError),
            // plan §5.4: quota pressure is transient; nothing was
            // acknowledged, and the client's spool sends the event again
            // after a reconnect, once retention made room
            Code::QuotaExceeded => (CloseReason::IngressOverload, AuditKind::IngressOverload),
            _ => (CloseReason::ProtocolError, AuditKind::ProtocolError),
        };
        let wire_error = error.clone().with_issue(issue);
        self.close(
            reason,
            Some(wire_error),
            kind,
            format!("command {issue} event_seq {event_seq} refused: {error}"),
        );
    }

    fn on_gate(&mut self, open: bool) {
        self.gate_open = open;
        if !open {
            return;
        }
        while let Some(descriptor) = self.held.pop_front() {
            self.windows.set_held(descriptor.issue, false);
            self.deliver(ClientMessage::CommandEvent(descriptor));
        }
    }

    fn on_timeout(&mut self, now: u64) {
        match self.liveness.on_timeout(now) {
            LivenessAction::Close => {
                let silent = now.saturating_sub(self.liveness.last_inbound_ms());
                self.close(
                    CloseReason::LivenessTimeout,
                    None,
                    AuditKind::LivenessTimeout,
                    format!("no inbound frame for {silent} ms"),
                );
                return;
            }
            LivenessAction::Ping => {
                self.effects.push_back(Effect::Ping);
                self.metric(metrics::PING_SENT, None);
            }
            LivenessAction::Nothing => {}
        }
        if self.state == State::AwaitingHello
            && now >= self.opened_ms.saturating_add(self.config.hello_timeout_ms)
        {
            self.protocol_error(format!(
                "no ClientHello within {} ms",
                self.config.hello_timeout_ms
            ));
            return;
        }
        if let State::Active {
            ready: false,
            welcomed_ms,
            ..
        } = self.state
            && now >= welcomed_ms.saturating_add(self.config.reconcile_timeout_ms)
        {
            // the client's snapshot, or the round it feeds, never
            // completed: nothing can be dispatched or acknowledged on this
            // session, so it goes, and the client reconnects
            self.close(
                CloseReason::ReconcileTimeout,
                None,
                AuditKind::ReconcileTimeout,
                format!(
                    "reconciliation not complete {} ms after the welcome",
                    now.saturating_sub(welcomed_ms)
                ),
            );
        }
    }

    // ---- helpers --------------------------------------------------------------

    fn deliver(&mut self, message: ClientMessage) {
        self.effects.push_back(Effect::Deliver(message));
    }

    fn metric(&mut self, name: &'static str, reason: Option<&'static str>) {
        self.effects
            .push_back(Effect::Metric(Metric { name, reason }));
    }

    fn audit(&mut self, kind: AuditKind, detail: String) {
        self.effects.push_back(Effect::Audit(Audit {
            kind,
            detail: rvbox_domain::error::bound_reason(&detail),
        }));
    }

    fn protocol_error(&mut self, reason: String) {
        let error = DomainError::new(Code::ProtocolError, &reason);
        self.close(
            CloseReason::ProtocolError,
            Some(error),
            AuditKind::ProtocolError,
            reason,
        );
    }

    /// Sends the optional `ControlError` (control lane, current session
    /// fields), audits, closes, and forgets everything held: nothing held
    /// was acknowledged, so the client's durable spool resends it.
    fn close(
        &mut self,
        reason: CloseReason,
        error: Option<DomainError>,
        kind: AuditKind,
        detail: String,
    ) {
        if let Some(error) = error {
            let (session_id, generation) = match &self.state {
                State::Active {
                    session_id,
                    generation,
                    ..
                } => (session_id.as_str().to_owned(), *generation),
                _ => (String::new(), 0),
            };
            self.effects.push_back(Effect::Send {
                lane: Lane::Control,
                envelope: wire::Envelope {
                    session_id,
                    generation,
                    payload: Some(Payload::ControlError(error.to_control_error())),
                },
            });
        }
        self.audit(kind, detail);
        self.push_close(reason);
    }

    fn push_close(&mut self, reason: CloseReason) {
        self.state = State::Closed;
        self.held.clear();
        self.effects.push_back(Effect::Close { reason });
        self.metric(metrics::CLOSED, Some(close_text(reason)));
    }
}

/// Longest piece of a client-supplied reason copied into an audit detail.
const DETAIL_REASON_BYTES: usize = 256;

fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}
