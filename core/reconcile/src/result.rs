//! The `ReconcileResult` digest, and the client's check of a received
//! result before it records terminate/discard intents (R-6.4-30/31).
//!
//! `result_digest` = SHA-256 of the prost encoding of the result with
//! `result_digest` empty. prost writes fields in tag order and the result
//! has no maps, so the encoding (and the digest) is a function of the
//! values alone (agent.proto: "the same snapshot always yields a
//! byte-identical result").

use std::collections::BTreeMap;

use prost::Message as _;
use rvbox_domain::ids::{IdError, Uuid7};
use rvbox_domain::lifecycle::Revision;
use rvbox_proto::v1 as wire;
use sha2::{Digest as _, Sha256};
use thiserror::Error;

use crate::decide::Resume;
use crate::limits::MAX_SNAPSHOT_RECORDS;

/// SHA-256 of `result` encoded with an empty `result_digest` (whatever
/// digest it currently carries).
#[must_use]
pub fn result_digest(result: &wire::ReconcileResult) -> [u8; 32] {
    let mut unsealed = result.clone();
    unsealed.result_digest.clear();
    let out = Sha256::digest(unsealed.encode_to_vec());
    let mut digest = [0u8; 32];
    for (d, b) in digest.iter_mut().zip(out.iter()) {
        *d = *b;
    }
    digest
}

/// Computes the digest and stores it in `result.result_digest`.
pub(crate) fn seal(result: &mut wire::ReconcileResult) -> [u8; 32] {
    let digest = result_digest(result);
    result.result_digest = digest.to_vec();
    digest
}

/// The lists of a `ReconcileResult`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResultList {
    /// `terminate_local_issue_uuids`.
    Terminate,
    /// `discard_local_terminal_issue_uuids`.
    Discard,
    /// `resume`.
    Resume,
}

impl std::fmt::Display for ResultList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Terminate => "terminate_local_issue_uuids",
            Self::Discard => "discard_local_terminal_issue_uuids",
            Self::Resume => "resume",
        })
    }
}

/// Why a client refuses a received `ReconcileResult` (a protocol error).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ResultError {
    /// The result answers another round.
    #[error("result answers round {got}, expected round {expected}")]
    WrongRound {
        /// Round of the snapshot the client sent.
        expected: u64,
        /// Round in the result.
        got: u64,
    },
    /// More entries than any valid snapshot can produce.
    #[error("result lists {count} entries; the limit is {limit}")]
    TooManyEntries {
        /// Entries across the three lists.
        count: usize,
        /// [`MAX_SNAPSHOT_RECORDS`].
        limit: usize,
    },
    /// A uuid that is not canonical UUIDv7 text.
    #[error("{list}[{position}]: {source}")]
    BadIssueUuid {
        /// The list.
        list: ResultList,
        /// Position in it.
        position: usize,
        /// Why.
        #[source]
        source: IdError,
    },
    /// A list not in ascending order.
    #[error("{list}: {issue_uuid} follows {previous}; entries must ascend")]
    NotSorted {
        /// The list.
        list: ResultList,
        /// The entry out of order.
        issue_uuid: Uuid7,
        /// The entry before it.
        previous: Uuid7,
    },
    /// A list repeating a uuid.
    #[error("{list} repeats {issue_uuid}")]
    Duplicate {
        /// The list.
        list: ResultList,
        /// The repeated uuid.
        issue_uuid: Uuid7,
    },
    /// One uuid in two lists (each record has one fate).
    #[error("{issue_uuid} appears in more than one list")]
    InSeveralLists {
        /// The uuid.
        issue_uuid: Uuid7,
    },
    /// A resume row with revision 0.
    #[error("resume {issue_uuid}: revision 0")]
    RevisionZero {
        /// The uuid.
        issue_uuid: Uuid7,
    },
    /// `result_digest` is not 32 bytes or does not match the content.
    #[error("result_digest does not match the result")]
    DigestMismatch,
}

/// A received result the client checked: round, canonical sorted distinct
/// lists, one fate per uuid, and the digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedResult {
    /// The round answered.
    pub round: u64,
    /// Local active commands to terminate.
    pub terminate: Vec<Uuid7>,
    /// Local terminal records to discard.
    pub discard: Vec<Uuid7>,
    /// Kept commands and where to resume them.
    pub resume: BTreeMap<Uuid7, Resume>,
    /// The digest, for logs and replay checks.
    pub digest: [u8; 32],
}

/// The client's check of a received result for the snapshot of `round`.
///
/// # Errors
/// [`ResultError`] naming what is wrong; the client treats it as a
/// protocol error and records no intent.
pub fn check_result(
    result: &wire::ReconcileResult,
    round: u64,
) -> Result<CheckedResult, ResultError> {
    if result.round != round {
        return Err(ResultError::WrongRound {
            expected: round,
            got: result.round,
        });
    }
    let count = result
        .terminate_local_issue_uuids
        .len()
        .saturating_add(result.discard_local_terminal_issue_uuids.len())
        .saturating_add(result.resume.len());
    if count > MAX_SNAPSHOT_RECORDS {
        return Err(ResultError::TooManyEntries {
            count,
            limit: MAX_SNAPSHOT_RECORDS,
        });
    }
    let digest: [u8; 32] = result
        .result_digest
        .as_slice()
        .try_into()
        .map_err(|_| ResultError::DigestMismatch)?;
    if digest != result_digest(result) {
        return Err(ResultError::DigestMismatch);
    }
    let terminate = sorted_uuids(
        ResultList::Terminate,
        result
            .terminate_local_issue_uuids
            .iter()
            .map(String::as_str),
    )?;
    let discard = sorted_uuids(
        ResultList::Discard,
        result
            .discard_local_terminal_issue_uuids
            .iter()
            .map(String::as_str),
    )?;
    let resume_ids = sorted_uuids(
        ResultList::Resume,
        result.resume.iter().map(|r| r.issue_uuid.as_str()),
    )?;
    let mut fates = std::collections::BTreeSet::new();
    for uuid in terminate.iter().chain(&discard).chain(&resume_ids) {
        if !fates.insert(*uuid) {
            return Err(ResultError::InSeveralLists { issue_uuid: *uuid });
        }
    }
    let mut resume = BTreeMap::new();
    for (uuid, row) in resume_ids.into_iter().zip(&result.resume) {
        if row.revision == 0 {
            return Err(ResultError::RevisionZero { issue_uuid: uuid });
        }
        resume.insert(
            uuid,
            Resume {
                revision: Revision(row.revision),
                durable_event_seq: row.durable_event_seq,
                script_resume_offset: row.script_resume_offset,
            },
        );
    }
    Ok(CheckedResult {
        round,
        terminate,
        discard,
        resume,
        digest,
    })
}

fn sorted_uuids<'a>(
    list: ResultList,
    texts: impl Iterator<Item = &'a str>,
) -> Result<Vec<Uuid7>, ResultError> {
    let mut out: Vec<Uuid7> = Vec::new();
    for (position, text) in texts.enumerate() {
        let uuid = Uuid7::parse("reconcile_result.issue_uuid", text).map_err(|source| {
            ResultError::BadIssueUuid {
                list,
                position,
                source,
            }
        })?;
        if let Some(previous) = out.last().copied() {
            if previous == uuid {
                return Err(ResultError::Duplicate {
                    list,
                    issue_uuid: uuid,
                });
            }
            if previous > uuid {
                return Err(ResultError::NotSorted {
                    list,
                    issue_uuid: uuid,
                    previous,
                });
            }
        }
        out.push(uuid);
    }
    Ok(out)
}
