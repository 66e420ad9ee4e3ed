//! How an operation on PostgreSQL fails.

use postgres::error::SqlState;
use rvbox_domain::error::{Code, DomainError};
use rvbox_store_port::ops::PortError;

/// A failed operation: nothing of it committed.
#[derive(Debug)]
pub enum Fail {
    /// The domain refused it (part of the operation's stable result).
    Refused(DomainError),
    /// The database failed (`context` says doing what).
    Db {
        /// What the store was doing.
        context: &'static str,
        /// The driver's error.
        source: postgres::Error,
    },
    /// Stored data contradicts an invariant.
    Integrity(String),
    /// This replica may not write now (its lease ended).
    Fenced(&'static str),
}

impl Fail {
    /// Maps a driver error, naming what the store was doing.
    pub fn db(context: &'static str) -> impl Fn(postgres::Error) -> Self {
        move |source| Self::Db { context, source }
    }

    /// Whether running the whole transaction again may succeed: PostgreSQL
    /// aborted it for a conflict with a concurrent one (a serialization
    /// failure, a deadlock, or a concurrent insert of the same key, after
    /// which a new attempt sees the other's row).
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Db { source, .. } => source.code().is_some_and(|c| {
                *c == SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == SqlState::T_R_DEADLOCK_DETECTED
                    || *c == SqlState::UNIQUE_VIOLATION
                    // a row it references was deleted meanwhile (an idle
                    // client pruned while a command for it was written):
                    // run again, it is created again
                    || *c == SqlState::FOREIGN_KEY_VIOLATION
            }),
            _ => false,
        }
    }

    /// Whether the connection itself was lost (closed, terminated by the
    /// server or an administrator, a failover): nothing sent after it
    /// reached the database.
    #[must_use]
    pub fn is_connection_lost(&self) -> bool {
        match self {
            Self::Db { source, .. } => {
                source.is_closed()
                    // the socket failed (reset by the server that ended
                    // the backend, before the client saw it close)
                    || std::error::Error::source(source)
                        .is_some_and(|e| e.downcast_ref::<std::io::Error>().is_some())
                    || source.code().is_some_and(|c| {
                        let code = c.code();
                        code.starts_with("08") || code.starts_with("57P")
                    })
            }
            _ => false,
        }
    }

    /// The port's view: a refusal stays one; anything else is
    /// `UNAVAILABLE` with the detail for logs.
    #[must_use]
    pub fn into_port(self) -> PortError {
        match self {
            Self::Refused(d) => PortError::Refused(d),
            other => PortError::Unavailable(other.to_string()),
        }
    }

    /// A refusal.
    pub fn refused(code: Code, reason: impl AsRef<str>) -> Self {
        Self::Refused(DomainError::new(code, reason))
    }
}

impl From<rvbox_store::StoreError> for Fail {
    fn from(e: rvbox_store::StoreError) -> Self {
        Self::Integrity(e.to_string())
    }
}

impl From<rvbox_store::mutations::OpError> for Fail {
    fn from(e: rvbox_store::mutations::OpError) -> Self {
        match e {
            rvbox_store::mutations::OpError::Refused(d) => Self::Refused(d),
            rvbox_store::mutations::OpError::Store(s) => s.into(),
        }
    }
}

impl From<DomainError> for Fail {
    fn from(e: DomainError) -> Self {
        Self::Refused(e)
    }
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(e) => write!(f, "{e}"),
            Self::Db { context, source } => match source.as_db_error() {
                Some(db) => write!(f, "{context}: {} ({})", db.message(), db.code().code()),
                None => write!(f, "{context}: {source}"),
            },
            Self::Integrity(s) => write!(f, "stored data is inconsistent: {s}"),
            Self::Fenced(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for Fail {}
