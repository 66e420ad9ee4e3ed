//! Assembling one complete client snapshot from its `ClientSnapshot` chunks
//! (plan §6.4 "Require one complete client snapshot of all locally retained
//! commands, including terminal-but-unacknowledged records and matching
//! requested tombstones").
//!
//! Each chunk is checked on its own and against the chunks before it: the
//! round, contiguous chunk indexes from 0, one store health for the whole
//! snapshot, canonical UUIDv7 ids, 32-byte hashes, strictly ascending ids
//! across chunks in each list, no id in both lists, and the totals of
//! [`crate::limits`]. Only the chunk with `final_chunk` completes the
//! snapshot; the result does not depend on how the client split it.
//!
//! Store health: every chunk must carry the same `store_health`. A snapshot
//! is one point-in-time view of the client store; a health change half way
//! means its chunks may describe different stores, so it is refused rather
//! than trusting either value.

use std::collections::BTreeMap;

use prost::Message as _;
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::{IdError, Uuid7};
use rvbox_domain::lifecycle::{Lifecycle, Revision};
use rvbox_domain::limits::MAX_SCRIPT_BYTES;
use rvbox_proto::v1 as wire;
use thiserror::Error;

use crate::limits::{
    MAX_CHUNK_BYTES, MAX_SNAPSHOT_CHUNKS, MAX_SNAPSHOT_RECORDS, MAX_SNAPSHOT_TOMBSTONES,
};
use crate::server::ServerCommand;

/// Which list of a chunk an item came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum List {
    /// `ClientSnapshot.records`.
    Records,
    /// `ClientSnapshot.tombstones`.
    Tombstones,
}

impl List {
    /// Field name for messages.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Records => "records",
            Self::Tombstones => "tombstones",
        }
    }
}

impl std::fmt::Display for List {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A command the client still holds, checked on its own (cross-checks
/// against the server happen in [`crate::reconcile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRecord {
    /// The command.
    pub issue_uuid: Uuid7,
    /// Its immutable request hash.
    pub request_hash: RequestHash,
    /// Highest revision the client durably applied (>= 1).
    pub revision: Revision,
    /// Local public lifecycle: `accepted`, `running` or terminal other than
    /// `expired`.
    pub lifecycle: Lifecycle,
    /// Highest event_seq assigned so far; 0 if none.
    pub last_assigned_event_seq: u64,
    /// Highest event_seq this server acknowledged; <= `last_assigned_event_seq`.
    pub acked_event_seq: u64,
    /// Durable script prefix in raw bytes; 0 for command text.
    pub script_received_bytes: u64,
}

/// Why a chunk was refused. Every variant names the chunk and, where there
/// is one, the list, position or uuid at fault. The caller closes the
/// session with `PROTOCOL_ERROR` (see [`SnapshotError::code`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SnapshotError {
    /// The chunk answers another round.
    #[error("chunk {chunk_index} answers round {got}, expected round {expected}")]
    WrongRound {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Round being assembled.
        expected: u64,
        /// Round in the chunk.
        got: u64,
    },
    /// Chunk indexes must count 0, 1, 2, ... without gaps or repeats.
    #[error("chunk {got} arrived where chunk {expected} was expected")]
    ChunkOutOfOrder {
        /// The next index expected.
        expected: u32,
        /// The index received.
        got: u32,
    },
    /// More chunks than [`MAX_SNAPSHOT_CHUNKS`].
    #[error("chunk {chunk_index} exceeds the limit of {limit} chunks per snapshot")]
    TooManyChunks {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// [`MAX_SNAPSHOT_CHUNKS`].
        limit: usize,
    },
    /// A chunk encodes to more than [`MAX_CHUNK_BYTES`].
    #[error("chunk {chunk_index} encodes to {bytes} bytes; the limit is {limit}")]
    ChunkTooLarge {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Encoded size.
        bytes: usize,
        /// [`MAX_CHUNK_BYTES`].
        limit: usize,
    },
    /// `store_health` is unspecified or unknown.
    #[error("chunk {chunk_index} has store_health {raw}, which is unspecified or unknown")]
    UnknownStoreHealth {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Raw enum number.
        raw: i32,
    },
    /// `store_health` differs from the first chunk's.
    #[error("chunk {chunk_index} reports store_health {got:?} but chunk 0 reported {first:?}")]
    StoreHealthChanged {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Health of chunk 0.
        first: wire::ScopeState,
        /// Health of this chunk.
        got: wire::ScopeState,
    },
    /// Too many records in total.
    #[error("chunk {chunk_index} brings the snapshot to {count} records; the limit is {limit}")]
    TooManyRecords {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Records after this chunk.
        count: usize,
        /// [`MAX_SNAPSHOT_RECORDS`].
        limit: usize,
    },
    /// Too many tombstones in total.
    #[error("chunk {chunk_index} brings the snapshot to {count} tombstones; the limit is {limit}")]
    TooManyTombstones {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// Tombstones after this chunk.
        count: usize,
        /// [`MAX_SNAPSHOT_TOMBSTONES`].
        limit: usize,
    },
    /// An `issue_uuid` that is not canonical UUIDv7 text.
    #[error("chunk {chunk_index} {list}[{position}]: {source}")]
    BadIssueUuid {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// List holding the item.
        list: List,
        /// Position of the item in that list of this chunk.
        position: usize,
        /// Why the text was refused.
        #[source]
        source: IdError,
    },
    /// A `request_hash` that is not exactly 32 bytes.
    #[error("chunk {chunk_index} {list} {issue_uuid}: request_hash is {len} bytes, want 32")]
    BadRequestHash {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// List holding the item.
        list: List,
        /// The item.
        issue_uuid: Uuid7,
        /// Length found.
        len: usize,
    },
    /// Ids not strictly ascending across the chunks of one list.
    #[error("chunk {chunk_index} {list} {issue_uuid} follows {previous}; ids must ascend")]
    NotSorted {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// List holding the item.
        list: List,
        /// The item out of order.
        issue_uuid: Uuid7,
        /// The id before it.
        previous: Uuid7,
    },
    /// The same id twice in one list.
    #[error("chunk {chunk_index} {list} repeats {issue_uuid}")]
    Duplicate {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// List holding the repeat.
        list: List,
        /// The repeated id.
        issue_uuid: Uuid7,
    },
    /// An id that is both a retained record and a tombstone: the client
    /// replaces a record by its tombstone in one transaction, never both.
    #[error("chunk {chunk_index}: {issue_uuid} is both a record and a tombstone")]
    RecordAndTombstone {
        /// Index of the chunk where the second occurrence arrived.
        chunk_index: u32,
        /// The id.
        issue_uuid: Uuid7,
    },
    /// A record lifecycle that is unspecified or unknown.
    #[error("chunk {chunk_index} record {issue_uuid}: lifecycle {raw} is unspecified or unknown")]
    UnknownLifecycle {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// The record.
        issue_uuid: Uuid7,
        /// Raw enum number.
        raw: i32,
    },
    /// A record lifecycle a client never holds: `queued` and `dispatched`
    /// are server-only, and `expired` means never dispatched (spec-mapping).
    #[error("chunk {chunk_index} record {issue_uuid}: a client never holds a {lifecycle} command")]
    NotLocalLifecycle {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// The record.
        issue_uuid: Uuid7,
        /// The lifecycle given.
        lifecycle: Lifecycle,
    },
    /// Revisions start at 1.
    #[error("chunk {chunk_index} record {issue_uuid}: revision 0")]
    RevisionZero {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// The record.
        issue_uuid: Uuid7,
    },
    /// The client claims acknowledgements for events it never assigned.
    #[error(
        "chunk {chunk_index} record {issue_uuid}: acked_event_seq {acked} is above last_assigned_event_seq {assigned}"
    )]
    AckedAboveAssigned {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// The record.
        issue_uuid: Uuid7,
        /// `acked_event_seq`.
        acked: u64,
        /// `last_assigned_event_seq`.
        assigned: u64,
    },
    /// A script prefix above the 10 MiB script ceiling.
    #[error(
        "chunk {chunk_index} record {issue_uuid}: script_received_bytes {bytes} exceeds {MAX_SCRIPT_BYTES}"
    )]
    ScriptTooLarge {
        /// Index of the offending chunk.
        chunk_index: u32,
        /// The record.
        issue_uuid: Uuid7,
        /// Bytes claimed.
        bytes: u64,
    },
}

impl SnapshotError {
    /// The stable code the session reports: every refusal is a protocol
    /// error that closes the session; nothing of the round was applied.
    #[must_use]
    pub fn code(&self) -> rvbox_domain::error::Code {
        rvbox_domain::error::Code::ProtocolError
    }
}

/// The complete, individually checked snapshot of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteSnapshot {
    round: u64,
    store_health: wire::ScopeState,
    records: BTreeMap<Uuid7, LocalRecord>,
    tombstones: BTreeMap<Uuid7, RequestHash>,
}

impl CompleteSnapshot {
    /// The round it answers.
    #[must_use]
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The client store health reported by every chunk.
    #[must_use]
    pub fn store_health(&self) -> wire::ScopeState {
        self.store_health
    }

    /// Records in ascending uuid order.
    pub fn records(&self) -> impl Iterator<Item = &LocalRecord> + '_ {
        self.records.values()
    }

    /// The record for `issue_uuid`, if the client holds one.
    #[must_use]
    pub fn record(&self, issue_uuid: &Uuid7) -> Option<&LocalRecord> {
        self.records.get(issue_uuid)
    }

    /// Tombstones `(uuid, request hash)` in ascending uuid order.
    pub fn tombstones(&self) -> impl Iterator<Item = (&Uuid7, &RequestHash)> + '_ {
        self.tombstones.iter()
    }

    /// The tombstone hash for `issue_uuid`, if the client reported one.
    #[must_use]
    pub fn tombstone(&self, issue_uuid: &Uuid7) -> Option<&RequestHash> {
        self.tombstones.get(issue_uuid)
    }

    /// The records whose uuid is not among `server_rows`, ascending: the
    /// uuids the caller must look up as [`crate::ServerKnown`] before
    /// calling [`crate::reconcile`].
    #[must_use]
    pub fn lookups_needed(&self, server_rows: &[ServerCommand]) -> Vec<Uuid7> {
        let listed: std::collections::BTreeSet<Uuid7> =
            server_rows.iter().map(|r| r.issue_uuid).collect();
        self.records
            .keys()
            .filter(|u| !listed.contains(u))
            .copied()
            .collect()
    }

    pub(crate) fn record_map(&self) -> &BTreeMap<Uuid7, LocalRecord> {
        &self.records
    }

    pub(crate) fn tombstone_map(&self) -> &BTreeMap<Uuid7, RequestHash> {
        &self.tombstones
    }
}

/// Collects the chunks of one round's snapshot. Feed chunks with
/// [`SnapshotAssembler::push`]; it consumes the assembler, so a refused
/// chunk leaves nothing half-assembled behind.
#[derive(Debug, Clone)]
pub struct SnapshotAssembler {
    round: u64,
    next_chunk: u32,
    store_health: Option<wire::ScopeState>,
    records: BTreeMap<Uuid7, LocalRecord>,
    tombstones: BTreeMap<Uuid7, RequestHash>,
}

/// The state after a chunk was accepted.
#[derive(Debug, Clone)]
pub enum Assembly {
    /// More chunks are needed; keep feeding this assembler.
    Incomplete(SnapshotAssembler),
    /// The final chunk arrived; the snapshot is complete.
    Complete(CompleteSnapshot),
}

impl SnapshotAssembler {
    /// An empty assembler for the snapshot answering `round` (the round of
    /// the `ReconcileRequest` the server sent).
    #[must_use]
    pub fn new(round: u64) -> Self {
        Self {
            round,
            next_chunk: 0,
            store_health: None,
            records: BTreeMap::new(),
            tombstones: BTreeMap::new(),
        }
    }

    /// The round being assembled.
    #[must_use]
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The chunk index expected next.
    #[must_use]
    pub fn next_chunk_index(&self) -> u32 {
        self.next_chunk
    }

    /// Accepts the next chunk.
    ///
    /// # Errors
    /// [`SnapshotError`] naming the chunk and the item at fault; the
    /// assembler is consumed and the round must be abandoned.
    pub fn push(mut self, chunk: &wire::ClientSnapshot) -> Result<Assembly, SnapshotError> {
        let chunk_index = chunk.chunk_index;
        if chunk.round != self.round {
            return Err(SnapshotError::WrongRound {
                chunk_index,
                expected: self.round,
                got: chunk.round,
            });
        }
        if chunk_index != self.next_chunk {
            return Err(SnapshotError::ChunkOutOfOrder {
                expected: self.next_chunk,
                got: chunk_index,
            });
        }
        if usize::try_from(chunk_index).map_or(true, |i| i >= MAX_SNAPSHOT_CHUNKS) {
            return Err(SnapshotError::TooManyChunks {
                chunk_index,
                limit: MAX_SNAPSHOT_CHUNKS,
            });
        }
        let bytes = chunk.encoded_len();
        if bytes > MAX_CHUNK_BYTES {
            return Err(SnapshotError::ChunkTooLarge {
                chunk_index,
                bytes,
                limit: MAX_CHUNK_BYTES,
            });
        }
        self.check_health(chunk_index, chunk.store_health)?;

        // Totals first, before parsing anything of this chunk.
        let records = self.records.len().saturating_add(chunk.records.len());
        if records > MAX_SNAPSHOT_RECORDS {
            return Err(SnapshotError::TooManyRecords {
                chunk_index,
                count: records,
                limit: MAX_SNAPSHOT_RECORDS,
            });
        }
        let tombstones = self.tombstones.len().saturating_add(chunk.tombstones.len());
        if tombstones > MAX_SNAPSHOT_TOMBSTONES {
            return Err(SnapshotError::TooManyTombstones {
                chunk_index,
                count: tombstones,
                limit: MAX_SNAPSHOT_TOMBSTONES,
            });
        }

        for (position, raw) in chunk.records.iter().enumerate() {
            let record = parse_record(chunk_index, position, raw)?;
            let uuid = record.issue_uuid;
            check_order(
                chunk_index,
                List::Records,
                uuid,
                self.records.keys().next_back(),
            )?;
            if self.tombstones.contains_key(&uuid) {
                return Err(SnapshotError::RecordAndTombstone {
                    chunk_index,
                    issue_uuid: uuid,
                });
            }
            self.records.insert(uuid, record);
        }
        for (position, raw) in chunk.tombstones.iter().enumerate() {
            let uuid = parse_uuid(chunk_index, List::Tombstones, position, &raw.issue_uuid)?;
            let hash = parse_hash(chunk_index, List::Tombstones, uuid, &raw.request_hash)?;
            check_order(
                chunk_index,
                List::Tombstones,
                uuid,
                self.tombstones.keys().next_back(),
            )?;
            if self.records.contains_key(&uuid) {
                return Err(SnapshotError::RecordAndTombstone {
                    chunk_index,
                    issue_uuid: uuid,
                });
            }
            self.tombstones.insert(uuid, hash);
        }

        if chunk.final_chunk {
            // check_health ran on this chunk, so the health is set.
            let store_health = self.store_health.unwrap_or(wire::ScopeState::Unspecified);
            return Ok(Assembly::Complete(CompleteSnapshot {
                round: self.round,
                store_health,
                records: self.records,
                tombstones: self.tombstones,
            }));
        }
        self.next_chunk = self.next_chunk.saturating_add(1);
        Ok(Assembly::Incomplete(self))
    }

    fn check_health(&mut self, chunk_index: u32, raw: i32) -> Result<(), SnapshotError> {
        let got = match wire::ScopeState::try_from(raw) {
            Ok(wire::ScopeState::Unspecified) | Err(_) => {
                return Err(SnapshotError::UnknownStoreHealth { chunk_index, raw });
            }
            Ok(state) => state,
        };
        match self.store_health {
            None => self.store_health = Some(got),
            Some(first) if first != got => {
                return Err(SnapshotError::StoreHealthChanged {
                    chunk_index,
                    first,
                    got,
                });
            }
            Some(_) => {}
        }
        Ok(())
    }
}

fn parse_uuid(
    chunk_index: u32,
    list: List,
    position: usize,
    text: &str,
) -> Result<Uuid7, SnapshotError> {
    let field = match list {
        List::Records => "client_snapshot.records.issue_uuid",
        List::Tombstones => "client_snapshot.tombstones.issue_uuid",
    };
    Uuid7::parse(field, text).map_err(|source| SnapshotError::BadIssueUuid {
        chunk_index,
        list,
        position,
        source,
    })
}

fn parse_hash(
    chunk_index: u32,
    list: List,
    issue_uuid: Uuid7,
    bytes: &[u8],
) -> Result<RequestHash, SnapshotError> {
    RequestHash::from_slice(bytes).ok_or(SnapshotError::BadRequestHash {
        chunk_index,
        list,
        issue_uuid,
        len: bytes.len(),
    })
}

/// Strictly ascending across chunks: equal is a duplicate, lower is unsorted.
fn check_order(
    chunk_index: u32,
    list: List,
    issue_uuid: Uuid7,
    previous: Option<&Uuid7>,
) -> Result<(), SnapshotError> {
    match previous {
        Some(prev) if *prev == issue_uuid => Err(SnapshotError::Duplicate {
            chunk_index,
            list,
            issue_uuid,
        }),
        Some(prev) if *prev > issue_uuid => Err(SnapshotError::NotSorted {
            chunk_index,
            list,
            issue_uuid,
            previous: *prev,
        }),
        _ => Ok(()),
    }
}

fn parse_record(
    chunk_index: u32,
    position: usize,
    raw: &wire::SnapshotRecord,
) -> Result<LocalRecord, SnapshotError> {
    let issue_uuid = parse_uuid(chunk_index, List::Records, position, &raw.issue_uuid)?;
    let request_hash = parse_hash(chunk_index, List::Records, issue_uuid, &raw.request_hash)?;
    let lifecycle =
        Lifecycle::from_wire(raw.lifecycle).map_err(|_| SnapshotError::UnknownLifecycle {
            chunk_index,
            issue_uuid,
            raw: raw.lifecycle,
        })?;
    // agent.proto: "Local public lifecycle (ACCEPTED, RUNNING or terminal)";
    // spec-mapping: `expired` is only for never-dispatched commands.
    if matches!(
        lifecycle,
        Lifecycle::Queued | Lifecycle::Dispatched | Lifecycle::Expired
    ) {
        return Err(SnapshotError::NotLocalLifecycle {
            chunk_index,
            issue_uuid,
            lifecycle,
        });
    }
    if raw.revision == 0 {
        return Err(SnapshotError::RevisionZero {
            chunk_index,
            issue_uuid,
        });
    }
    if raw.acked_event_seq > raw.last_assigned_event_seq {
        return Err(SnapshotError::AckedAboveAssigned {
            chunk_index,
            issue_uuid,
            acked: raw.acked_event_seq,
            assigned: raw.last_assigned_event_seq,
        });
    }
    if raw.script_received_bytes > MAX_SCRIPT_BYTES {
        return Err(SnapshotError::ScriptTooLarge {
            chunk_index,
            issue_uuid,
            bytes: raw.script_received_bytes,
        });
    }
    Ok(LocalRecord {
        issue_uuid,
        request_hash,
        revision: Revision(raw.revision),
        lifecycle,
        last_assigned_event_seq: raw.last_assigned_event_seq,
        acked_event_seq: raw.acked_event_seq,
        script_received_bytes: raw.script_received_bytes,
    })
}
