//! RVBox server session core: the server side of the agent session
//! protocol (plan §6.1-§6.3), as pure state machines and decisions.
//!
//! Owns: `ClientHello` validation and version choice ([`validate_hello`]),
//! the registration / fencing / takeover decision over the durable client
//! record ([`decide_registration`], [`authorize_takeover`]), the welcome
//! ([`welcome_envelope`]), the per-connection [`Session`] (envelope checks
//! before decode, session-field fencing, heartbeat and liveness, event
//! sequencing, send windows, acks only after durability, ingress holding),
//! the two-lane [`WriteScheduler`], the server-wide [`IngressGate`], and the
//! reconnect [`Backoff`] the client shell reuses.
//!
//! Must never: do I/O, read a clock, draw randomness, spawn threads or read
//! the environment. Monotonic `now_ms` arrives with every input and wall
//! time only where a persisted observation needs it; session ids come from
//! the caller's CSPRNG; durability is always a later input, never assumed.
//! It decides; the server shell performs (conventions rules 1-3).
#![warn(missing_docs)]

pub mod hello;
pub mod lanes;
pub mod liveness;
pub mod registration;
pub mod session;
pub mod welcome;
pub mod window;
pub mod wire;

pub use hello::{
    HelloError, PROTOCOL_MAJOR, V1_SUPPORTED_MINORS, ValidHello, negotiate_minor, validate_hello,
};
pub use lanes::{
    CONTROL_BURST, CONTROL_LANE_CAPACITY, DATA_LANE_CAPACITY, LaneFull, WriteScheduler,
};
pub use liveness::{Backoff, Liveness, LivenessAction};
pub use registration::{
    AcceptKind, Acceptance, ClientRecord, ConflictCause, LiveSession, PendingClaim, Registration,
    RegistrationError, SessionId, SessionIdError, TAKEOVER_GRANT_TTL_MS, TakeoverError,
    TakeoverGrant, authorize_takeover, decide_registration,
};
pub use session::{
    Audit, AuditKind, ClientMessage, Effect, EventDescriptor, HELLO_TIMEOUT_MS, Input, Metric,
    Phase, RegistrationToken, SendError, Session, SessionConfig, metrics,
};
pub use welcome::{
    ConfigError, ServerIdentity, SessionLimits, build_welcome, envelope, welcome_envelope,
};
pub use window::{
    GateChange, GateConfigError, GateUnderflow, HELD_EVENTS_CAPACITY, IngressGate,
    MAX_TRACKED_COMMANDS_PER_SESSION, MAX_UNACKED_EVENTS_PER_SESSION, event_window_cost,
    is_gated_body,
};
pub use wire::{
    Direction, Lane, close_code, close_text, payload_direction, payload_lane, payload_name,
};
