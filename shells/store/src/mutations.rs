//! Control-mutation idempotency (plan §5.2 `control_mutations`, §9.1).
//!
//! Every operator mutation carries a `request_id` (UUIDv7). Inside the
//! mutation's own transaction the store looks the id up: an exact replay
//! (same method, owner and request hash) returns the stored result or the
//! stored refusal without doing anything again; the same id with anything
//! else is a `CONFLICT` and does no work. A fresh id runs the mutation and
//! records its result in the same transaction, so the row and the effect
//! commit together or not at all.

use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{OptionalExtension, Transaction, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

use crate::error::StoreError;

/// What a mutation belongs to; the row lives as long as its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner<'a> {
    /// A command (`RunCommand`, stdin, signals).
    Command(&'a [u8; 16]),
    /// A storage incident (repair, acknowledge).
    Incident(&'a [u8; 16]),
    /// A client (takeover grants).
    Client(&'a str),
    /// A fleet run (`RunFleet` and the run's other mutations).
    FleetRun(&'a [u8; 16]),
}

/// A control operation's failure: either a refusal that is part of the
/// operation's stable result (stored, replayed identically), or a store
/// failure (not stored: the caller may retry).
#[derive(Debug)]
pub enum OpError {
    /// The domain refused the request.
    Refused(DomainError),
    /// The store failed; nothing was committed.
    Store(StoreError),
}

impl From<StoreError> for OpError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl From<DomainError> for OpError {
    fn from(e: DomainError) -> Self {
        Self::Refused(e)
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(e) => write!(f, "{e}"),
            Self::Store(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for OpError {}

impl OpError {
    /// The domain view of this failure: a store failure is `UNAVAILABLE`
    /// (transient) for the caller, with no internal paths in the reason.
    #[must_use]
    pub fn to_domain(&self) -> DomainError {
        match self {
            Self::Refused(e) => e.clone(),
            Self::Store(_) => DomainError::new(
                Code::Unavailable,
                "the server store could not complete the operation; retry with the same request_id",
            ),
        }
    }
}

/// A stored outcome: the encoded response, or the refusal's detail.
pub type Stored = Result<Vec<u8>, wire::ErrorDetail>;

/// The owner columns: command, incident, client, fleet run.
pub type OwnerColumns<'a> = (
    Option<&'a [u8]>,
    Option<&'a [u8]>,
    Option<&'a str>,
    Option<&'a [u8]>,
);

/// The owner's columns of a `control_mutations` row (every store backend
/// keeps them so).
#[must_use]
pub fn owner_columns<'a>(owner: Owner<'a>) -> OwnerColumns<'a> {
    match owner {
        Owner::Command(u) => (Some(u.as_slice()), None, None, None),
        Owner::Incident(i) => (None, Some(i.as_slice()), None, None),
        Owner::Client(c) => (None, None, Some(c), None),
        Owner::FleetRun(r) => (None, None, None, Some(r.as_slice())),
    }
}

/// Looks `request_id` up inside `tx`. `Ok(None)`: fresh, run the mutation.
/// `Ok(Some(stored))`: an exact replay. `Err(Refused(CONFLICT))`: the id
/// was used for a different request.
///
/// # Errors
/// [`OpError::Refused`] with `CONFLICT`, or [`OpError::Store`].
pub fn lookup(
    tx: &Transaction<'_>,
    request_id: &Uuid7,
    method: &str,
    hash: &RequestHash,
    owner: Owner<'_>,
) -> Result<Option<Stored>, OpError> {
    type Row = (
        String,
        Vec<u8>,
        Option<Vec<u8>>,
        Option<Vec<u8>>,
        Option<String>,
        Vec<u8>,
        bool,
        Option<Vec<u8>>,
    );
    let row: Option<Row> = tx
        .query_row_cached(
            "SELECT method, request_hash, command_uuid, incident_id, client_id, result, result_is_error,
                    fleet_run_id
             FROM control_mutations WHERE request_id = ?1",
            params![request_id.as_bytes().as_slice()],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ))
            },
        )
        .optional()
        .map_err(|e| StoreError::sqlite("look up request_id", e))?;
    let Some((m, h, cmd, inc, client, result, is_error, run)) = row else {
        return Ok(None);
    };
    let (want_cmd, want_inc, want_client, want_run) = owner_columns(owner);
    let same = m == method
        && h.as_slice() == hash.as_bytes().as_slice()
        && cmd.as_deref() == want_cmd
        && inc.as_deref() == want_inc
        && client.as_deref() == want_client
        && run.as_deref() == want_run;
    if !same {
        return Err(OpError::Refused(
            DomainError::new(
                Code::Conflict,
                "request_id was already used for a different request; use a new request_id",
            )
            .with_field("request_id"),
        ));
    }
    if is_error {
        let detail = wire::ErrorDetail::decode(result.as_slice())
            .map_err(|_| StoreError::Integrity("stored mutation refusal does not decode".into()))?;
        Ok(Some(Err(detail)))
    } else {
        Ok(Some(Ok(result)))
    }
}

/// Extra facts some mutations assign (stdin write sequence, revision).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Assigned {
    /// Stdin write sequence assigned by the mutation.
    pub write_seq: Option<u64>,
    /// Command revision assigned by the mutation.
    pub revision: Option<u64>,
}

/// Records a mutation's outcome inside the same transaction as its effect.
///
/// # Errors
/// [`StoreError::Sqlite`].
#[allow(clippy::too_many_arguments)]
pub fn record(
    tx: &Transaction<'_>,
    request_id: &Uuid7,
    method: &str,
    hash: &RequestHash,
    owner: Owner<'_>,
    outcome: &Stored,
    assigned: Assigned,
    now_ms: i64,
) -> Result<(), StoreError> {
    let (cmd, inc, client, run) = owner_columns(owner);
    let (bytes, is_error) = match outcome {
        Ok(b) => (b.clone(), false),
        Err(detail) => (detail.encode_to_vec(), true),
    };
    let as_i64 = |v: Option<u64>| v.and_then(|n| i64::try_from(n).ok());
    tx.execute_cached(
        "INSERT INTO control_mutations (request_id, method, request_hash, command_uuid, incident_id,
             client_id, write_seq, revision, result, result_is_error, created_ms, fleet_run_id)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        params![
            request_id.as_bytes().as_slice(),
            method,
            hash.as_bytes().as_slice(),
            cmd,
            inc,
            client,
            as_i64(assigned.write_seq),
            as_i64(assigned.revision),
            bytes,
            is_error,
            now_ms,
            run
        ],
    )
    .map_err(|e| StoreError::sqlite("record mutation", e))?;
    Ok(())
}
