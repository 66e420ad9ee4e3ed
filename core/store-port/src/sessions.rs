//! Client records and registrations (plan §6.2).

use rvbox_proto::v1 as wire;

/// The live session of a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveSession {
    /// Session id (16 random bytes; hex on the wire).
    pub session_id: [u8; 16],
    /// The client instance that opened it.
    pub instance_id: [u8; 16],
    /// Its generation.
    pub generation: u64,
    /// When it was installed (wall ms).
    pub opened_ms: i64,
}

/// An unconsumed, unvoided takeover grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeoverGrant {
    /// Row id (what a registration consumes).
    pub id: i64,
    /// The exact instance the grant admits.
    pub instance_id: [u8; 16],
    /// Created (wall ms).
    pub created_ms: i64,
    /// Expires (wall ms); a grant at or past it admits nobody.
    pub expires_ms: i64,
}

/// What the store knows of a client, as the registration decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientRecord {
    /// Client id.
    pub client_id: String,
    /// The instance of the last accepted registration.
    pub instance_id: Option<[u8; 16]>,
    /// Current generation (0 before the first registration).
    pub generation: u64,
    /// The live session, if any.
    pub live: Option<LiveSession>,
    /// The latest rejected live-conflict claim: instance and when it was seen.
    pub pending_claim: Option<([u8; 16], i64)>,
    /// The live takeover grant, if any (possibly expired: the decision
    /// compares its expiry with the clock).
    pub grant: Option<TakeoverGrant>,
}

/// An accepted registration to make durable (one transaction).
#[derive(Debug, Clone, PartialEq)]
pub struct Registration {
    /// Client id (validated by the session core).
    pub client_id: String,
    /// The registering instance.
    pub instance_id: [u8; 16],
    /// The generation the decision saw; the registration installs
    /// `expected_generation + 1` and fails with `CONFLICT` if it changed.
    pub expected_generation: u64,
    /// The new session's id (from a CSPRNG).
    pub session_id: [u8; 16],
    /// The live session the decision fences, if any; it must still be the
    /// live one.
    pub fence: Option<[u8; 16]>,
    /// The grant the decision consumes, if any; it must still be live and
    /// unexpired and name this instance.
    pub consume_grant: Option<i64>,
    /// The client's capabilities, as sent.
    pub capabilities: wire::Capabilities,
    /// Its working-directory policy, as sent.
    pub cwd_policy: Option<wire::CwdPolicy>,
    /// Its validated labels, normalized (`key=value,...`, sorted by key).
    pub labels: String,
}

/// The session a connection's write is made for. The write commits only
/// while this session is still its client's live one, checked in the
/// write's own transaction (on PostgreSQL with the session row locked
/// `FOR SHARE`): a server that lost the client to a newer session, on this
/// or another replica, can never commit for it. A refused write is
/// `STALE_SESSION`, and the connection it was made for is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionFence {
    /// The session's id (one row, one generation of one client).
    pub session_id: [u8; 16],
}
