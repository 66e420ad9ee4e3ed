//! Registration, fencing and takeover decisions (plan §6.2, R-6.2-03..12).
//!
//! [`decide_registration`] is a pure function over the durable client record
//! the caller loaded inside its registration transaction. The caller applies
//! the whole [`Registration`] in that one transaction (increment generation,
//! consume the grant, close the old session record, install the new session,
//! or persist the pending claim) and only then tells the [`crate::Session`]
//! it committed. The session id comes from the caller's CSPRNG: this crate
//! never generates randomness.

use std::fmt;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::InstanceId;
use rvbox_domain::limits::DEFAULT_TAKEOVER_GRANT_TTL_MS;
use thiserror::Error;

use crate::hello::ValidHello;

/// Shortest session id in bytes (agent.proto `Envelope.session_id`).
pub const MIN_SESSION_ID_BYTES: usize = 16;
/// Longest session id in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 64;
/// Default lifetime of a takeover grant (plan §6.2: five minutes).
pub const TAKEOVER_GRANT_TTL_MS: u64 = DEFAULT_TAKEOVER_GRANT_TTL_MS;

/// A session id that is not 16..=64 printable ASCII bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SessionIdError {
    /// Wrong length.
    #[error("session id is {len} bytes; want {MIN_SESSION_ID_BYTES}..={MAX_SESSION_ID_BYTES}")]
    Length {
        /// Length found.
        len: usize,
    },
    /// A byte that is not printable ASCII (0x21..=0x7e).
    #[error("session id byte {at} is not printable ASCII")]
    BadByte {
        /// Offset of the first bad byte.
        at: usize,
    },
}

/// An opaque, cryptographically random session id drawn by the caller:
/// 16..=64 printable ASCII bytes (no space or control characters, so it is
/// safe in logs and close reasons).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(String);

impl SessionId {
    /// Validates session id text.
    ///
    /// # Errors
    /// [`SessionIdError`] when the length or a byte is out of range.
    pub fn parse(text: &str) -> Result<Self, SessionIdError> {
        if !(MIN_SESSION_ID_BYTES..=MAX_SESSION_ID_BYTES).contains(&text.len()) {
            return Err(SessionIdError::Length { len: text.len() });
        }
        if let Some(at) = text.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(SessionIdError::BadByte { at });
        }
        Ok(Self(text.to_owned()))
    }

    /// The id text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({:?})", self.0)
    }
}

/// The live session of a client as the durable record holds it. Its
/// instance is the record's [`ClientRecord::instance`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSession {
    /// Its session id.
    pub session_id: SessionId,
    /// Its generation.
    pub generation: u64,
}

/// A rejected live-conflict candidate (plan §6.2): only its exact instance
/// id and the wall time it was observed are persisted and exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingClaim {
    /// The candidate instance.
    pub instance: InstanceId,
    /// Wall-clock UTC milliseconds of the observation.
    pub observed_wall_ms: u64,
}

/// A one-shot takeover grant made by `AuthorizeClientTakeover`.
///
/// Valid for wall times in the half-open interval `[authorized, expires)`:
/// at exactly `expires_wall_ms` it has expired, so a five-minute grant is
/// good for exactly 300,000 ms and never for one more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeoverGrant {
    /// The exact instance allowed to take over.
    pub instance: InstanceId,
    /// Wall-clock UTC milliseconds at which the grant stops being valid.
    pub expires_wall_ms: u64,
    /// Whether a reconnect already used it.
    pub consumed: bool,
}

impl TakeoverGrant {
    /// Whether the grant lets `instance` take over at `now_wall_ms`.
    #[must_use]
    pub fn admits(&self, instance: InstanceId, now_wall_ms: u64) -> bool {
        self.refusal(instance, now_wall_ms).is_none()
    }

    fn refusal(&self, instance: InstanceId, now_wall_ms: u64) -> Option<ConflictCause> {
        if self.instance != instance {
            Some(ConflictCause::GrantForOtherInstance)
        } else if self.consumed {
            Some(ConflictCause::GrantConsumed)
        } else if now_wall_ms >= self.expires_wall_ms {
            Some(ConflictCause::GrantExpired)
        } else {
            None
        }
    }
}

/// The durable client record, as loaded by the caller's registration
/// transaction.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientRecord {
    /// Current generation; 0 for a client never seen.
    pub generation: u64,
    /// Instance of the last accepted session; `None` for a client never seen.
    pub instance: Option<InstanceId>,
    /// The live session, if any.
    pub live: Option<LiveSession>,
    /// The pending live-conflict claim, if any.
    pub pending_claim: Option<PendingClaim>,
    /// The takeover grant, if any.
    pub grant: Option<TakeoverGrant>,
}

/// How an accepted registration relates to what was there before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptKind {
    /// No session was live and the instance is the recorded one (or the
    /// client is new).
    Fresh,
    /// No session was live and the instance differs from the recorded one:
    /// accepted normally, no grant created or consumed (R-6.2-05).
    NewInstance,
    /// Same instance reconnecting while its old session is live: the old
    /// one is fenced first (R-6.2-04).
    Replace,
    /// Another instance with an unexpired grant for exactly it: the grant is
    /// consumed and the old session fenced in one transaction (R-6.2-07).
    Takeover,
}

/// What the caller commits for an accepted hello, in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acceptance {
    /// Why it was accepted.
    pub kind: AcceptKind,
    /// The new session id (from the caller's CSPRNG).
    pub session_id: SessionId,
    /// The new generation: the record's plus one.
    pub generation: u64,
    /// The instance now owning the client id.
    pub instance: InstanceId,
    /// The prior live session to fence before the new one becomes active.
    pub fence: Option<LiveSession>,
    /// Mark the takeover grant consumed.
    pub consume_grant: bool,
    /// Clear the pending claim (it was this instance's).
    pub clear_pending_claim: bool,
}

/// Why a different instance was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictCause {
    /// No grant exists.
    NoGrant,
    /// The grant names another instance; it is never broadened (R-6.2-12).
    GrantForOtherInstance,
    /// The grant expired.
    GrantExpired,
    /// The grant was already used.
    GrantConsumed,
}

/// The decision for one hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// Commit the acceptance, then send the welcome.
    Accept(Acceptance),
    /// Persist `claim` as the pending claim, then send `LIVE_CONFLICT` and
    /// close the candidate with `HELLO_REJECTED` (R-6.2-06).
    RejectLiveConflict {
        /// The claim to persist (replacing any earlier one).
        claim: PendingClaim,
        /// The live session that keeps the client id.
        live: LiveSession,
        /// Why no grant applied.
        cause: ConflictCause,
    },
}

impl Registration {
    /// The error sent to a rejected candidate, `None` for an acceptance.
    #[must_use]
    pub fn rejection(&self) -> Option<DomainError> {
        match self {
            Self::Accept(_) => None,
            Self::RejectLiveConflict { claim, .. } => Some(
                DomainError::new(
                    Code::LiveConflict,
                    format!(
                        "another instance of this client id is live; an operator must authorize \
                         a takeover for instance {}",
                        claim.instance
                    ),
                )
                .with_field("client_hello.client_instance_id"),
            ),
        }
    }
}

/// The durable record cannot be used as loaded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RegistrationError {
    /// The generation counter cannot be incremented.
    #[error("client generation {generation} cannot be incremented")]
    GenerationExhausted {
        /// Current generation.
        generation: u64,
    },
    /// A live session without a recorded instance, or one whose generation
    /// is above the record's.
    #[error("client record is inconsistent: {0}")]
    InconsistentRecord(&'static str),
    /// The caller's fresh session id equals the live one.
    #[error("the new session id equals the live session's; draw another")]
    SessionIdReused,
}

impl From<RegistrationError> for DomainError {
    fn from(e: RegistrationError) -> Self {
        DomainError::new(Code::Internal, e.to_string())
    }
}

/// Decides what to do with a validated hello (plan §6.2).
///
/// - No live session: accept (a different instance too), generation + 1,
///   no grant created or consumed.
/// - Live session of the same instance: accept and fence the old one first.
/// - Live session of another instance: accept only if an unexpired,
///   unconsumed grant names exactly this instance (consume it, fence the
///   old session); otherwise reject and record this instance as the pending
///   claim observed at `now_wall_ms`.
///
/// # Errors
/// [`RegistrationError`] when the record is inconsistent, the generation
/// would overflow, or `session_id` equals the live session's.
pub fn decide_registration(
    record: &ClientRecord,
    hello: &ValidHello,
    session_id: SessionId,
    now_wall_ms: u64,
) -> Result<Registration, RegistrationError> {
    let generation =
        record
            .generation
            .checked_add(1)
            .ok_or(RegistrationError::GenerationExhausted {
                generation: record.generation,
            })?;
    let instance = hello.instance;
    let clear_pending_claim = record.pending_claim.is_some_and(|c| c.instance == instance);
    let Some(live) = &record.live else {
        let kind = match record.instance {
            Some(recorded) if recorded != instance => AcceptKind::NewInstance,
            _ => AcceptKind::Fresh,
        };
        return Ok(Registration::Accept(Acceptance {
            kind,
            session_id,
            generation,
            instance,
            fence: None,
            consume_grant: false,
            clear_pending_claim,
        }));
    };
    let Some(live_instance) = record.instance else {
        return Err(RegistrationError::InconsistentRecord(
            "a live session without a recorded instance",
        ));
    };
    if live.generation > record.generation {
        return Err(RegistrationError::InconsistentRecord(
            "the live session's generation is above the client's",
        ));
    }
    if live.session_id == session_id {
        return Err(RegistrationError::SessionIdReused);
    }
    if live_instance == instance {
        return Ok(Registration::Accept(Acceptance {
            kind: AcceptKind::Replace,
            session_id,
            generation,
            instance,
            fence: Some(live.clone()),
            consume_grant: false,
            clear_pending_claim,
        }));
    }
    let cause = match &record.grant {
        None => Some(ConflictCause::NoGrant),
        Some(grant) => grant.refusal(instance, now_wall_ms),
    };
    match cause {
        None => Ok(Registration::Accept(Acceptance {
            kind: AcceptKind::Takeover,
            session_id,
            generation,
            instance,
            fence: Some(live.clone()),
            consume_grant: true,
            clear_pending_claim: record.pending_claim.is_some(),
        })),
        Some(cause) => Ok(Registration::RejectLiveConflict {
            claim: PendingClaim {
                instance,
                observed_wall_ms: now_wall_ms,
            },
            live: live.clone(),
            cause,
        }),
    }
}

/// Why `AuthorizeClientTakeover` was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TakeoverError {
    /// No pending claim is recorded.
    #[error("no pending live-conflict claim is recorded for this client")]
    NoPendingClaim,
    /// The named instance is not the pending one.
    #[error("instance {requested} is not the pending claim (pending: {pending})")]
    ClaimMismatch {
        /// Instance the operator named.
        requested: InstanceId,
        /// Instance of the pending claim.
        pending: InstanceId,
    },
    /// The expiry would overflow.
    #[error("grant expiry overflows")]
    ExpiryOverflow,
}

impl From<TakeoverError> for DomainError {
    fn from(e: TakeoverError) -> Self {
        let code = match e {
            TakeoverError::NoPendingClaim | TakeoverError::ClaimMismatch { .. } => {
                Code::FailedPrecondition
            }
            TakeoverError::ExpiryOverflow => Code::InvalidArgument,
        };
        DomainError::new(code, e.to_string()).with_field("client_instance_id")
    }
}

/// The grant `AuthorizeClientTakeover` stores (R-6.2-11): it checks that
/// `requested` still matches the pending claim and expires `ttl_ms` after
/// `now_wall_ms`. It fences nothing; the matching reconnect does. The
/// caller stores it with its idempotent UUIDv7 mutation.
///
/// # Errors
/// [`TakeoverError`] when no claim is pending or it names another instance.
pub fn authorize_takeover(
    record: &ClientRecord,
    requested: InstanceId,
    now_wall_ms: u64,
    ttl_ms: u64,
) -> Result<TakeoverGrant, TakeoverError> {
    let pending = record.pending_claim.ok_or(TakeoverError::NoPendingClaim)?;
    if pending.instance != requested {
        return Err(TakeoverError::ClaimMismatch {
            requested,
            pending: pending.instance,
        });
    }
    let expires_wall_ms = now_wall_ms
        .checked_add(ttl_ms)
        .ok_or(TakeoverError::ExpiryOverflow)?;
    Ok(TakeoverGrant {
        instance: requested,
        expires_wall_ms,
        consumed: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_id_bounds() {
        assert!(SessionId::parse(&"a".repeat(16)).is_ok());
        assert!(SessionId::parse(&"a".repeat(64)).is_ok());
        assert_eq!(
            SessionId::parse(&"a".repeat(15)),
            Err(SessionIdError::Length { len: 15 })
        );
        assert_eq!(
            SessionId::parse(&"a".repeat(65)),
            Err(SessionIdError::Length { len: 65 })
        );
        assert_eq!(
            SessionId::parse("aaaaaaaa aaaaaaaa"),
            Err(SessionIdError::BadByte { at: 8 })
        );
        assert!(SessionId::parse("aaaaaaaa\u{e9}aaaaaaa").is_err());
    }
}
