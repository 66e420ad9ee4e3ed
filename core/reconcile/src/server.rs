//! The server's side of a round: its non-terminal commands of one client
//! ([`ServerCommand`], which also build the `ReconcileRequest`, R-6.4-19),
//! and what it knows about a snapshot record it did not list
//! ([`ServerKnown`]).

use std::collections::BTreeMap;

use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_domain::limits::MAX_SCRIPT_BYTES;
use rvbox_proto::v1 as wire;
use thiserror::Error;

use crate::limits::MAX_RECONCILE_ROWS;

/// How a command's source reaches the client, as far as resuming is
/// concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Command text travels inside the `Dispatch`; nothing to resume.
    CommandText,
    /// An uploaded script sent in `ScriptChunk`s.
    Script {
        /// Exact raw script size (`ScriptDescriptor.size_bytes`), 1..=10 MiB.
        size_bytes: u64,
        /// True once the client reported `SCRIPT_UPLOAD_STATE_COMMITTED`:
        /// nothing is resent.
        upload_committed: bool,
    },
}

/// One non-terminal server command of the reconciling client: what a
/// `ReconcileRow` carries plus what the decision needs to compute the
/// resume position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerCommand {
    /// The command.
    pub issue_uuid: Uuid7,
    /// Its immutable request hash.
    pub request_hash: RequestHash,
    /// Current server phase; never terminal.
    pub phase: Phase,
    /// Current server revision (>= 1).
    pub revision: Revision,
    /// Last event_seq durably stored on the server; 0 if none.
    pub durable_event_seq: u64,
    /// Command text or script, for `ResumeRow.script_resume_offset`.
    pub source: Source,
}

impl ServerCommand {
    /// The wire row of the `ReconcileRequest` (internal launch phases render
    /// as `ACCEPTED`).
    #[must_use]
    pub fn to_row(&self) -> wire::ReconcileRow {
        wire::ReconcileRow {
            issue_uuid: self.issue_uuid.to_string(),
            durable_event_seq: self.durable_event_seq,
            revision: self.revision.0,
            request_hash: self.request_hash.as_bytes().to_vec(),
            lifecycle: self.phase.lifecycle().to_wire() as i32,
        }
    }
}

/// What the server knows about a snapshot record whose uuid is not among
/// its non-terminal commands. The caller looks these up (see
/// [`crate::CompleteSnapshot::lookups_needed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKnown {
    /// The full terminal command record is stored.
    Terminal {
        /// Its immutable request hash.
        request_hash: RequestHash,
        /// Its terminal lifecycle (never changes: terminal immutability).
        lifecycle: Lifecycle,
        /// Last event_seq durably stored; 0 if none.
        durable_event_seq: u64,
    },
    /// The command was completed and deliberately removed; only its
    /// tombstone remains.
    Tombstoned {
        /// The tombstone's request hash.
        request_hash: RequestHash,
    },
    /// Neither a command nor a tombstone exists (never created here, or the
    /// tombstone left the FIFO).
    Missing,
}

/// The caller's own inputs are inconsistent: a server bug, not the client's
/// fault. Nothing is applied.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ServerInputError {
    /// Round 0 is never used; rounds count from 1 within a session.
    #[error("reconciliation round 0 is invalid; rounds count from 1")]
    RoundZero,
    /// More non-terminal commands than one request can carry.
    #[error("{count} server rows exceed the limit of {limit}")]
    TooManyRows {
        /// Rows given.
        count: usize,
        /// [`MAX_RECONCILE_ROWS`].
        limit: usize,
    },
    /// The same command twice among the server rows.
    #[error("server row {issue_uuid} appears twice")]
    DuplicateRow {
        /// The repeated command.
        issue_uuid: Uuid7,
    },
    /// A terminal command among the rows; only non-terminal ones are asked
    /// about (plan §6.4 "query non-terminal commands").
    #[error(
        "server row {issue_uuid} is terminal ({phase}); only non-terminal commands are reconciled"
    )]
    TerminalRow {
        /// The command.
        issue_uuid: Uuid7,
        /// Its phase.
        phase: Phase,
    },
    /// Revisions start at 1.
    #[error("server row {issue_uuid} has revision 0")]
    RevisionZero {
        /// The command.
        issue_uuid: Uuid7,
    },
    /// A script size outside 1..=10 MiB.
    #[error(
        "server row {issue_uuid} declares a script of {size_bytes} bytes (want 1..={MAX_SCRIPT_BYTES})"
    )]
    BadScriptSize {
        /// The command.
        issue_uuid: Uuid7,
        /// Declared size.
        size_bytes: u64,
    },
    /// The snapshot was assembled for another round than the one decided.
    #[error("snapshot answers round {snapshot} but round {expected} is being decided")]
    RoundMismatch {
        /// Round passed to the decision.
        expected: u64,
        /// Round of the snapshot.
        snapshot: u64,
    },
    /// A snapshot record not among the rows has no [`ServerKnown`] entry.
    #[error("no server lookup for unlisted snapshot record {issue_uuid}")]
    MissingKnown {
        /// The record.
        issue_uuid: Uuid7,
    },
    /// A [`ServerKnown`] entry for a command that is also a non-terminal row.
    #[error("server row {issue_uuid} also has a terminal/tombstone/missing lookup")]
    KnownForListedRow {
        /// The command.
        issue_uuid: Uuid7,
    },
    /// A [`ServerKnown::Terminal`] whose lifecycle is not terminal.
    #[error("server lookup for {issue_uuid} says terminal but its lifecycle is {lifecycle}")]
    KnownNotTerminal {
        /// The command.
        issue_uuid: Uuid7,
        /// The non-terminal lifecycle given.
        lifecycle: Lifecycle,
    },
}

/// Checks the rows and indexes them by uuid (so the decision never depends
/// on the order the caller queried them in).
pub(crate) fn index_rows(
    rows: &[ServerCommand],
) -> Result<BTreeMap<Uuid7, &ServerCommand>, ServerInputError> {
    if rows.len() > MAX_RECONCILE_ROWS {
        return Err(ServerInputError::TooManyRows {
            count: rows.len(),
            limit: MAX_RECONCILE_ROWS,
        });
    }
    let mut index = BTreeMap::new();
    for row in rows {
        if row.phase.is_terminal() {
            return Err(ServerInputError::TerminalRow {
                issue_uuid: row.issue_uuid,
                phase: row.phase,
            });
        }
        if row.revision.0 == 0 {
            return Err(ServerInputError::RevisionZero {
                issue_uuid: row.issue_uuid,
            });
        }
        if let Source::Script { size_bytes, .. } = row.source
            && !(1..=MAX_SCRIPT_BYTES).contains(&size_bytes)
        {
            return Err(ServerInputError::BadScriptSize {
                issue_uuid: row.issue_uuid,
                size_bytes,
            });
        }
        if index.insert(row.issue_uuid, row).is_some() {
            return Err(ServerInputError::DuplicateRow {
                issue_uuid: row.issue_uuid,
            });
        }
    }
    Ok(index)
}

/// Builds the `ReconcileRequest` for `round` (R-6.4-19): one row per
/// non-terminal command, sorted by issue uuid, whatever order `rows` came in.
///
/// # Errors
/// [`ServerInputError`] when `round` is 0 or the rows are inconsistent.
pub fn build_request(
    round: u64,
    rows: &[ServerCommand],
) -> Result<wire::ReconcileRequest, ServerInputError> {
    if round == 0 {
        return Err(ServerInputError::RoundZero);
    }
    let index = index_rows(rows)?;
    Ok(wire::ReconcileRequest {
        round,
        rows: index.values().map(|row| row.to_row()).collect(),
    })
}
