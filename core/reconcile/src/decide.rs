//! The reconciliation decision: the plan §6.4 matrix over one complete
//! snapshot, every row validated before any decision is returned.
//!
//! Each uuid of the round (server rows, snapshot records, snapshot
//! tombstones) is classified once, in ascending uuid order, by its server
//! side (a listed non-terminal row, or a [`ServerKnown`] lookup) and its
//! client side (absent, a record, a tombstone):
//!
//! | server | client | outcome |
//! | --- | --- | --- |
//! | queued/dispatched row | absent | [`Action::Requeue`] |
//! | accepted/running row | absent | [`Action::Interrupt`] `ClientStateLoss` + `CLIENT_STATE_LOSS` |
//! | any row | tombstone | [`Action::Interrupt`] `StaleServer` + `STALE_SERVER` |
//! | dispatched/accepted/running row | record | [`Action::Keep`] + resume row |
//! | queued row | record | [`Action::Keep`] + resume row + `RECONCILIATION_CONTRADICTION` |
//! | missing / tombstoned / terminal | active record | terminate_local + `RECONCILIATION_CONTRADICTION` |
//! | missing / tombstoned / terminal | terminal record | discard_local_terminal |
//! | terminal, contradicting | terminal record | discard_local_terminal + `RECONCILIATION_CONTRADICTION` |
//! | not listed | tombstone | invalid snapshot (tombstones answer requested rows only) |
//!
//! What makes the whole snapshot invalid (nothing applied; the caller
//! closes the session with `PROTOCOL_ERROR` and records a
//! `RECONCILIATION_CONTRADICTION` incident), plan §6.4 "Validate matching
//! UUID, immutable request hash, revision monotonicity, terminal
//! immutability, and event-sequence bounds for every row before applying
//! any row": a different request hash for the same uuid; a client revision
//! above the server's (only the server assigns revisions); a client
//! lifecycle the server's cannot reach (it went backwards, e.g. server
//! `running`, client `accepted`, or a pre-launch terminal after launch);
//! client `last_assigned_event_seq` below, or `acked_event_seq` above, the
//! server's durable event_seq; a script prefix for command text or beyond
//! the script size; an unrequested tombstone. Everything else is client
//! evidence the matrix answers, with an incident where the peers disagree.

use std::collections::{BTreeMap, BTreeSet};

use rvbox_domain::error::{Code, bound_reason};
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use thiserror::Error;

use crate::result::seal;
use crate::server::{ServerCommand, ServerInputError, ServerKnown, Source, index_rows};
use crate::snapshot::{CompleteSnapshot, List, LocalRecord};

/// Why an interrupt was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum InterruptReason {
    /// The client holds a matching tombstone: it already completed this
    /// command, so the server's live state is stale; replay is suppressed.
    StaleServer,
    /// An accepted/running command is absent from a healthy complete
    /// snapshot: an invariant failure on the client.
    ClientStateLoss,
}

/// Where the client resumes a kept command (the `ResumeRow` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Highest valid revision, which the client adopts (the server's: a
    /// client revision above it is invalid).
    pub revision: Revision,
    /// Last event_seq durable on the server; the client replays after it.
    pub durable_event_seq: u64,
    /// Raw script offset the server resends `ScriptChunk`s from: the
    /// client's durable prefix; 0 for command text or a committed upload.
    pub script_resume_offset: u64,
}

/// What the server does with one of its non-terminal commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// plan §6.4: absent from a healthy complete snapshot, so it returns to
    /// (`from` = dispatched) or remains (`from` = queued) `queued`;
    /// redelivery is permitted. A queued row needs no write.
    Requeue {
        /// Server phase before the decision.
        from: Phase,
    },
    /// plan §6.4: the client holds it; keep the highest valid revision and
    /// resume event and script delivery.
    Keep {
        /// Server phase before the decision.
        from: Phase,
        /// Set when the client evidence is further along than the server:
        /// the public lifecycle to advance to (`accepted` or `running`).
        /// The caller walks the legal public edges from `from` to it
        /// (e.g. dispatched -> accepted -> running). Terminal outcomes are
        /// never taken from the snapshot: they arrive as replayed events.
        advance_to: Option<Lifecycle>,
        /// The resume position sent to the client.
        resume: Resume,
        /// Set when the client's acknowledged event_seq is above the
        /// server's durable one: the server lost events it had
        /// acknowledged (it was restored from an older backup, or its
        /// storage lost them). The client no longer holds them either, so
        /// the caller records the range as a storage-loss truncation of
        /// unknown size and moves the command's durable event_seq to its
        /// end, in the reconciliation transaction; `resume` already
        /// resumes after it.
        lost: Option<LostEvents>,
    },
    /// plan §6.4: becomes `interrupted` and is never dispatched again.
    Interrupt {
        /// Server phase before the decision. Note: the domain edge table
        /// has no `queued -> interrupted`, yet a matching tombstone on a
        /// queued row interrupts it ("any non-terminal"); the caller applies
        /// this as a reconciliation edge.
        from: Phase,
        /// Why.
        reason: InterruptReason,
    },
}

/// Events the server acknowledged and no longer holds (see
/// [`Action::Keep::lost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostEvents {
    /// The first lost event_seq: the server's durable event_seq plus one.
    pub first_event_seq: u64,
    /// The last lost event_seq: the client's acknowledged event_seq.
    pub last_event_seq: u64,
}

/// One server row and its action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerAction {
    /// The command.
    pub issue_uuid: Uuid7,
    /// What to do.
    pub action: Action,
}

/// An incident the caller persists in the reconciliation transaction.
/// `(kind, issue_uuid)` is its idempotency key: a repeated round yields the
/// same intent, and the store opens no second incident while one with the
/// same key is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncidentIntent {
    /// `STALE_SERVER`, `CLIENT_STATE_LOSS` or `RECONCILIATION_CONTRADICTION`.
    pub kind: wire::IncidentKind,
    /// The command concerned.
    pub issue_uuid: Uuid7,
    /// Short text naming phases, revisions and sequence numbers; never
    /// payload bytes; at most [`crate::limits::MAX_INCIDENT_SUMMARY_BYTES`].
    pub summary: String,
    /// Whether acknowledged data was lost (a [`LostEvents`] range).
    pub data_loss: bool,
}

/// The decision of one round.
///
/// How the caller applies it (plan §6.4, R-6.4-28/29): persist every
/// [`ServerAction`], every [`IncidentIntent`] and the result in one
/// reconciliation transaction; then send [`Outcome::result`] on the control
/// lane. Dispatch to this client stays disabled until the session reports
/// that exact result (identified by [`Outcome::digest`]) written; a later
/// round supersedes it with a new outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    actions: Vec<ServerAction>,
    incidents: Vec<IncidentIntent>,
    result: wire::ReconcileResult,
    digest: [u8; 32],
}

impl Outcome {
    /// Exactly one action per server row, ascending by uuid.
    #[must_use]
    pub fn actions(&self) -> &[ServerAction] {
        &self.actions
    }

    /// Incident intents, ascending by uuid (at most one per uuid).
    #[must_use]
    pub fn incidents(&self) -> &[IncidentIntent] {
        &self.incidents
    }

    /// The wire result, digest included.
    #[must_use]
    pub fn result(&self) -> &wire::ReconcileResult {
        &self.result
    }

    /// `result_digest`: SHA-256 of the result encoded with an empty digest.
    #[must_use]
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// Splits into `(actions, incidents, result)`.
    #[must_use]
    pub fn into_parts(
        self,
    ) -> (
        Vec<ServerAction>,
        Vec<IncidentIntent>,
        wire::ReconcileResult,
    ) {
        (self.actions, self.incidents, self.result)
    }
}

/// A snapshot whose evidence contradicts the server in a way the matrix
/// does not answer. Every variant names the command.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InvalidSnapshot {
    /// plan §6.4 "immutable request hash".
    #[error("{list} {issue_uuid}: request hash {client} differs from the server's {server}")]
    RequestHashMismatch {
        /// The command.
        issue_uuid: Uuid7,
        /// Record or tombstone.
        list: List,
        /// The client's hash.
        client: RequestHash,
        /// The server's hash.
        server: RequestHash,
    },
    /// plan §6.4 "revision monotonicity": only the server assigns
    /// revisions, so the client cannot be ahead.
    #[error("record {issue_uuid}: client revision {client} is above the server revision {server}")]
    RevisionAboveServer {
        /// The command.
        issue_uuid: Uuid7,
        /// Client revision.
        client: Revision,
        /// Server revision.
        server: Revision,
    },
    /// plan §6.4 "terminal immutability" and lifecycle monotonicity: the
    /// client lifecycle is not reachable from the server's through legal
    /// edges (it went backwards, or claims a pre-launch end after launch).
    #[error(
        "record {issue_uuid}: client lifecycle {client} cannot follow the server lifecycle {server}"
    )]
    LifecycleUnreachable {
        /// The command.
        issue_uuid: Uuid7,
        /// Server lifecycle.
        server: Lifecycle,
        /// Client lifecycle.
        client: Lifecycle,
    },
    /// plan §6.4 "event-sequence bounds": the server holds durable events
    /// the client says it never assigned.
    #[error(
        "record {issue_uuid}: last_assigned_event_seq {assigned} is below the server's durable event_seq {durable}"
    )]
    AssignedBelowDurable {
        /// The command.
        issue_uuid: Uuid7,
        /// Client `last_assigned_event_seq`.
        assigned: u64,
        /// Server durable event_seq.
        durable: u64,
    },
    /// plan §6.4 "event-sequence bounds": the server acknowledges only
    /// durable events. Raised for a command the server holds terminal; a
    /// live command the client holds is kept with a [`LostEvents`] range
    /// instead (see [`Action::Keep::lost`]).
    #[error(
        "record {issue_uuid}: acked_event_seq {acked} is above the server's durable event_seq {durable}"
    )]
    AckedAboveDurable {
        /// The command.
        issue_uuid: Uuid7,
        /// Client `acked_event_seq`.
        acked: u64,
        /// Server durable event_seq.
        durable: u64,
    },
    /// A script prefix for a command-text command.
    #[error("record {issue_uuid}: script_received_bytes {received} for a command-text command")]
    ScriptForCommandText {
        /// The command.
        issue_uuid: Uuid7,
        /// Bytes claimed.
        received: u64,
    },
    /// A script prefix beyond the script's size.
    #[error("record {issue_uuid}: script_received_bytes {received} exceeds the script size {size}")]
    ScriptBeyondSize {
        /// The command.
        issue_uuid: Uuid7,
        /// Bytes claimed.
        received: u64,
        /// Script size.
        size: u64,
    },
    /// A tombstone for a uuid the server did not request (agent.proto:
    /// tombstones only answer requested rows).
    #[error("tombstone {issue_uuid} answers no requested row")]
    UnrequestedTombstone {
        /// The command.
        issue_uuid: Uuid7,
    },
}

impl InvalidSnapshot {
    /// The command the violation is about.
    #[must_use]
    pub fn issue_uuid(&self) -> Uuid7 {
        match self {
            Self::RequestHashMismatch { issue_uuid, .. }
            | Self::RevisionAboveServer { issue_uuid, .. }
            | Self::LifecycleUnreachable { issue_uuid, .. }
            | Self::AssignedBelowDurable { issue_uuid, .. }
            | Self::AckedAboveDurable { issue_uuid, .. }
            | Self::ScriptForCommandText { issue_uuid, .. }
            | Self::ScriptBeyondSize { issue_uuid, .. }
            | Self::UnrequestedTombstone { issue_uuid } => *issue_uuid,
        }
    }

    /// The incident the caller records before closing the session.
    #[must_use]
    pub fn incident(&self) -> IncidentIntent {
        IncidentIntent {
            kind: wire::IncidentKind::ReconciliationContradiction,
            issue_uuid: self.issue_uuid(),
            summary: bound_reason(&format!("invalid reconciliation snapshot: {self}")),
            data_loss: false,
        }
    }
}

/// How the caller must treat a [`ReconcileError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The client's snapshot is invalid: close the session with
    /// `PROTOCOL_ERROR`, record the incident; nothing applied.
    ProtocolError,
    /// The client store is not healthy (R-6.4-33): nothing applied, no
    /// protocol error, dispatch stays off; the caller may ask again with a
    /// later round.
    ClientNotReady,
    /// The caller's own inputs are inconsistent (a server bug): nothing
    /// applied; an internal error.
    ServerBug,
}

/// Why no [`Outcome`] was produced. Nothing of the round applies.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReconcileError {
    /// See [`InvalidSnapshot`].
    #[error("invalid snapshot: {0}")]
    InvalidSnapshot(#[from] InvalidSnapshot),
    /// plan §6.4: "A client with unresolved essential-store corruption
    /// cannot complete reconciliation or accept work."
    #[error("client store health is {health:?}; reconciliation needs READY")]
    ClientStoreNotReady {
        /// The reported health.
        health: wire::ScopeState,
    },
    /// See [`ServerInputError`].
    #[error("inconsistent server input: {0}")]
    ServerInput(#[from] ServerInputError),
}

impl ReconcileError {
    /// How the caller must treat it.
    #[must_use]
    pub fn disposition(&self) -> Disposition {
        match self {
            Self::InvalidSnapshot(_) => Disposition::ProtocolError,
            Self::ClientStoreNotReady { .. } => Disposition::ClientNotReady,
            Self::ServerInput(_) => Disposition::ServerBug,
        }
    }

    /// The stable code for the `ControlError` / log.
    #[must_use]
    pub fn code(&self) -> Code {
        match self.disposition() {
            Disposition::ProtocolError => Code::ProtocolError,
            Disposition::ClientNotReady => Code::Unavailable,
            Disposition::ServerBug => Code::Internal,
        }
    }
}

/// Which side of the server a uuid is on.
enum ServerSide<'a> {
    Listed(&'a ServerCommand),
    Unlisted(&'a ServerKnown),
}

/// Which evidence the client gave for a uuid.
enum ClientSide<'a> {
    Absent,
    Record(&'a LocalRecord),
    Tombstone(&'a RequestHash),
}

/// Where a record ends up in the wire result.
enum ResultEntry {
    Resume(Resume),
    Terminate,
    Discard,
}

/// The decision for one uuid.
struct Decision {
    action: Option<Action>,
    entry: Option<ResultEntry>,
    incident: Option<(wire::IncidentKind, String)>,
    data_loss: bool,
}

/// Decides one round (plan §6.4).
///
/// `server_rows` are every non-terminal server command of this client (any
/// order); `known` answers every [`CompleteSnapshot::lookups_needed`] uuid
/// (other entries are ignored). Same inputs give a byte-identical result.
///
/// Order of checks: the caller's inputs, then the client store health,
/// then every uuid of the round in ascending order; the first violation is
/// returned and no outcome exists.
///
/// # Errors
/// [`ReconcileError`]; see [`ReconcileError::disposition`].
pub fn reconcile(
    round: u64,
    server_rows: &[ServerCommand],
    known: &BTreeMap<Uuid7, ServerKnown>,
    snapshot: &CompleteSnapshot,
) -> Result<Outcome, ReconcileError> {
    if round == 0 {
        return Err(ServerInputError::RoundZero.into());
    }
    if snapshot.round() != round {
        return Err(ServerInputError::RoundMismatch {
            expected: round,
            snapshot: snapshot.round(),
        }
        .into());
    }
    let rows = index_rows(server_rows)?;
    let records = snapshot.record_map();
    let tombstones = snapshot.tombstone_map();
    if let Some(uuid) = rows.keys().find(|u| known.contains_key(u)) {
        return Err(ServerInputError::KnownForListedRow { issue_uuid: *uuid }.into());
    }
    for uuid in records.keys().filter(|u| !rows.contains_key(u)) {
        match known.get(uuid) {
            None => {
                return Err(ServerInputError::MissingKnown { issue_uuid: *uuid }.into());
            }
            Some(ServerKnown::Terminal { lifecycle, .. }) if !lifecycle.is_terminal() => {
                return Err(ServerInputError::KnownNotTerminal {
                    issue_uuid: *uuid,
                    lifecycle: *lifecycle,
                }
                .into());
            }
            Some(_) => {}
        }
    }

    // plan §6.4 / R-6.4-33: an unhealthy client store cannot complete
    // reconciliation; nothing is applied and dispatch stays off.
    if snapshot.store_health() != wire::ScopeState::Ready {
        return Err(ReconcileError::ClientStoreNotReady {
            health: snapshot.store_health(),
        });
    }

    let all: BTreeSet<Uuid7> = rows
        .keys()
        .chain(records.keys())
        .chain(tombstones.keys())
        .copied()
        .collect();

    // plan §6.4: validate every row before applying any; the decisions are
    // collected and only returned once every uuid passed.
    let mut actions = Vec::with_capacity(rows.len());
    let mut incidents = Vec::new();
    let mut result = wire::ReconcileResult {
        round,
        ..wire::ReconcileResult::default()
    };
    for uuid in all {
        let server = match rows.get(&uuid) {
            Some(row) => ServerSide::Listed(row),
            None => match known.get(&uuid) {
                Some(k) => ServerSide::Unlisted(k),
                // Only tombstones can reach here without a lookup.
                None => {
                    return Err(InvalidSnapshot::UnrequestedTombstone { issue_uuid: uuid }.into());
                }
            },
        };
        let client = match (records.get(&uuid), tombstones.get(&uuid)) {
            (Some(record), _) => ClientSide::Record(record),
            (None, Some(hash)) => ClientSide::Tombstone(hash),
            (None, None) => ClientSide::Absent,
        };
        let decision = decide_one(uuid, &server, &client)?;
        if let Some(action) = decision.action {
            actions.push(ServerAction {
                issue_uuid: uuid,
                action,
            });
        }
        match decision.entry {
            Some(ResultEntry::Resume(resume)) => result.resume.push(wire::ResumeRow {
                issue_uuid: uuid.to_string(),
                revision: resume.revision.0,
                durable_event_seq: resume.durable_event_seq,
                script_resume_offset: resume.script_resume_offset,
            }),
            Some(ResultEntry::Terminate) => {
                result.terminate_local_issue_uuids.push(uuid.to_string());
            }
            Some(ResultEntry::Discard) => {
                result
                    .discard_local_terminal_issue_uuids
                    .push(uuid.to_string());
            }
            None => {}
        }
        if let Some((kind, summary)) = decision.incident {
            incidents.push(IncidentIntent {
                kind,
                issue_uuid: uuid,
                summary: bound_reason(&summary),
                data_loss: decision.data_loss,
            });
        }
    }
    // Iteration was in ascending uuid order and canonical text sorts like
    // the bytes, so every list is already sorted and distinct.
    let digest = seal(&mut result);
    Ok(Outcome {
        actions,
        incidents,
        result,
        digest,
    })
}

fn decide_one(
    uuid: Uuid7,
    server: &ServerSide<'_>,
    client: &ClientSide<'_>,
) -> Result<Decision, InvalidSnapshot> {
    match (server, client) {
        (ServerSide::Listed(row), ClientSide::Absent) => Ok(absent_row(row)),
        (ServerSide::Listed(row), ClientSide::Tombstone(hash)) => {
            check_hash(uuid, List::Tombstones, hash, &row.request_hash)?;
            // plan §6.4: "any non-terminal | matching tombstone |
            // interrupt/suppress replay and record stale-server incident".
            Ok(Decision {
                action: Some(Action::Interrupt {
                    from: row.phase,
                    reason: InterruptReason::StaleServer,
                }),
                entry: None,
                incident: Some((
                    wire::IncidentKind::StaleServer,
                    format!(
                        "client holds a matching tombstone for this {} command (revision {}); interrupted, replay suppressed",
                        row.phase, row.revision
                    ),
                )),
                data_loss: false,
            })
        }
        (ServerSide::Listed(row), ClientSide::Record(record)) => kept_row(uuid, row, record),
        (ServerSide::Unlisted(_), ClientSide::Tombstone(_) | ClientSide::Absent) => {
            Err(InvalidSnapshot::UnrequestedTombstone { issue_uuid: uuid })
        }
        (ServerSide::Unlisted(known), ClientSide::Record(record)) => {
            unlisted_record(uuid, known, record)
        }
    }
}

/// A listed row the client does not know at all.
fn absent_row(row: &ServerCommand) -> Decision {
    match row.phase {
        // plan §6.4: "queued/dispatched | absent from healthy complete
        // snapshot | return/remain queued; redelivery permitted".
        Phase::Queued | Phase::Dispatched => Decision {
            action: Some(Action::Requeue { from: row.phase }),
            entry: None,
            incident: None,
            data_loss: false,
        },
        // plan §6.4: "accepted/running | absent | interrupt and record
        // client-state-loss incident". The internal launch phases render as
        // accepted; index_rows refused terminal phases.
        _ => Decision {
            action: Some(Action::Interrupt {
                from: row.phase,
                reason: InterruptReason::ClientStateLoss,
            }),
            entry: None,
            incident: Some((
                wire::IncidentKind::ClientStateLoss,
                format!(
                    "healthy complete snapshot lacks this {} command (revision {}, durable event_seq {}); interrupted",
                    row.phase, row.revision, row.durable_event_seq
                ),
            )),
            data_loss: false,
        },
    }
}

/// A listed row the client holds a record for.
fn kept_row(
    uuid: Uuid7,
    row: &ServerCommand,
    record: &LocalRecord,
) -> Result<Decision, InvalidSnapshot> {
    check_hash(uuid, List::Records, &record.request_hash, &row.request_hash)?;
    // plan §6.4 "revision monotonicity": revisions come from the server.
    if record.revision > row.revision {
        return Err(InvalidSnapshot::RevisionAboveServer {
            issue_uuid: uuid,
            client: record.revision,
            server: row.revision,
        });
    }
    let server_lifecycle = row.phase.lifecycle();
    if !reachable(server_lifecycle, record.lifecycle) {
        return Err(InvalidSnapshot::LifecycleUnreachable {
            issue_uuid: uuid,
            server: server_lifecycle,
            client: record.lifecycle,
        });
    }
    if record.last_assigned_event_seq < row.durable_event_seq {
        return Err(InvalidSnapshot::AssignedBelowDurable {
            issue_uuid: uuid,
            assigned: record.last_assigned_event_seq,
            durable: row.durable_event_seq,
        });
    }
    // The client was told events up to `acked` were durable, so it
    // deleted them; a server below that lost them (a restore from an
    // older backup, or lost storage). Refusing the snapshot would refuse
    // the client at every connection and the range can never come back:
    // it is recorded as lost instead, explicitly, and the command goes on
    // from the client's position.
    let lost = (record.acked_event_seq > row.durable_event_seq).then(|| LostEvents {
        first_event_seq: row.durable_event_seq + 1,
        last_event_seq: record.acked_event_seq,
    });
    let script_resume_offset = match row.source {
        Source::CommandText if record.script_received_bytes != 0 => {
            return Err(InvalidSnapshot::ScriptForCommandText {
                issue_uuid: uuid,
                received: record.script_received_bytes,
            });
        }
        Source::CommandText => 0,
        Source::Script { size_bytes, .. } if record.script_received_bytes > size_bytes => {
            return Err(InvalidSnapshot::ScriptBeyondSize {
                issue_uuid: uuid,
                received: record.script_received_bytes,
                size: size_bytes,
            });
        }
        Source::Script {
            upload_committed: true,
            ..
        } => 0,
        Source::Script { .. } => record.script_received_bytes,
    };
    let evidence = evidence_floor(record.lifecycle);
    let advance_to = (rank(evidence) > rank(server_lifecycle)).then_some(evidence);
    // plan §6.4: "dispatched/accepted/running | matching retained record |
    // keep highest valid revision and resume event/script delivery". The
    // highest valid revision is the server's (a higher client one is
    // invalid above).
    let resume = Resume {
        revision: row.revision,
        durable_event_seq: row.durable_event_seq.max(record.acked_event_seq),
        script_resume_offset,
    };
    // A queued row the client holds is not in the matrix: the server
    // persists `dispatched` before any frame, so it lost a dispatch (e.g. a
    // restore). The client evidence wins (never redispatch what a client
    // holds) and the disagreement is recorded.
    let mut said = Vec::new();
    if row.phase == Phase::Queued {
        said.push(format!(
            "server had this command queued but the client holds it as {} (revision {}); advanced, not redispatched",
            record.lifecycle, record.revision
        ));
    }
    if let Some(l) = lost {
        said.push(format!(
            "the client had events up to event_seq {} acknowledged but the server holds them only up to {}; events {}..={} are lost and recorded as a truncation",
            l.last_event_seq, row.durable_event_seq, l.first_event_seq, l.last_event_seq
        ));
    }
    let incident = (!said.is_empty()).then(|| {
        (
            wire::IncidentKind::ReconciliationContradiction,
            said.join("; "),
        )
    });
    Ok(Decision {
        action: Some(Action::Keep {
            from: row.phase,
            advance_to,
            resume,
            lost,
        }),
        entry: Some(ResultEntry::Resume(resume)),
        incident,
        data_loss: lost.is_some(),
    })
}

/// A record for a uuid the server holds no live command for.
fn unlisted_record(
    uuid: Uuid7,
    known: &ServerKnown,
    record: &LocalRecord,
) -> Result<Decision, InvalidSnapshot> {
    let active = !record.lifecycle.is_terminal();
    let (what, contradiction) = match known {
        ServerKnown::Missing => ("has no record of it".to_owned(), None),
        ServerKnown::Tombstoned { request_hash } => {
            check_hash(uuid, List::Records, &record.request_hash, request_hash)?;
            ("tombstoned it".to_owned(), None)
        }
        ServerKnown::Terminal {
            request_hash,
            lifecycle,
            durable_event_seq,
        } => {
            check_hash(uuid, List::Records, &record.request_hash, request_hash)?;
            check_seqs(uuid, record, *durable_event_seq)?;
            // plan §6.4: "either peer records a contradiction with
            // server-confirmed terminal state"; terminal immutability keeps
            // the server's value, the evidence is only recorded.
            let contradiction = (record.lifecycle.is_terminal()
                && (record.lifecycle != *lifecycle
                    || record.last_assigned_event_seq > *durable_event_seq))
                .then(|| {
                    format!(
                        "client terminal {} (last assigned event_seq {}) contradicts server terminal {} (durable event_seq {}); server state kept, local record discarded",
                        record.lifecycle,
                        record.last_assigned_event_seq,
                        lifecycle,
                        durable_event_seq
                    )
                });
            (format!("stored it as {lifecycle}"), contradiction)
        }
    };
    if active {
        // plan §6.4: "missing or contradictory terminal | client active |
        // terminate_local_issue_uuids plus incident; invent no server
        // command".
        return Ok(Decision {
            action: None,
            entry: Some(ResultEntry::Terminate),
            incident: Some((
                wire::IncidentKind::ReconciliationContradiction,
                format!(
                    "client holds this command as {} (revision {}) but the server {what}; client told to terminate it",
                    record.lifecycle, record.revision
                ),
            )),
            data_loss: false,
        });
    }
    // plan §6.4: "missing/tombstoned or fully stored terminal | client
    // terminal | discard_local_terminal_issue_uuids" (covers a lost final
    // EventAck followed by server retention).
    Ok(Decision {
        action: None,
        entry: Some(ResultEntry::Discard),
        incident: contradiction.map(|s| (wire::IncidentKind::ReconciliationContradiction, s)),
        data_loss: false,
    })
}

fn check_hash(
    uuid: Uuid7,
    list: List,
    client: &RequestHash,
    server: &RequestHash,
) -> Result<(), InvalidSnapshot> {
    if client == server {
        Ok(())
    } else {
        Err(InvalidSnapshot::RequestHashMismatch {
            issue_uuid: uuid,
            list,
            client: *client,
            server: *server,
        })
    }
}

/// plan §6.4 "event-sequence bounds" against a server durable event_seq.
fn check_seqs(uuid: Uuid7, record: &LocalRecord, durable: u64) -> Result<(), InvalidSnapshot> {
    if record.last_assigned_event_seq < durable {
        return Err(InvalidSnapshot::AssignedBelowDurable {
            issue_uuid: uuid,
            assigned: record.last_assigned_event_seq,
            durable,
        });
    }
    if record.acked_event_seq > durable {
        return Err(InvalidSnapshot::AckedAboveDurable {
            issue_uuid: uuid,
            acked: record.acked_event_seq,
            durable,
        });
    }
    Ok(())
}

/// True when `to` equals `from` or follows it through legal public edges
/// (the domain table, searched breadth-first; at most 11 nodes).
fn reachable(from: Lifecycle, to: Lifecycle) -> bool {
    let mut seen = BTreeSet::from([from]);
    let mut frontier = vec![from];
    while let Some(at) = frontier.pop() {
        if at == to {
            return true;
        }
        for next in Lifecycle::ALL {
            if at.check_transition(next).is_ok() && seen.insert(next) {
                frontier.push(next);
            }
        }
    }
    false
}

/// The furthest non-terminal lifecycle a client record proves: a record
/// exists only after acceptance; an outcome of a process that ran proves
/// `running`.
fn evidence_floor(client: Lifecycle) -> Lifecycle {
    match client {
        Lifecycle::Running | Lifecycle::Succeeded | Lifecycle::Failed | Lifecycle::Terminated => {
            Lifecycle::Running
        }
        _ => Lifecycle::Accepted,
    }
}

/// Progress order of the non-terminal public values.
fn rank(l: Lifecycle) -> u8 {
    match l {
        Lifecycle::Queued => 0,
        Lifecycle::Dispatched => 1,
        Lifecycle::Accepted => 2,
        _ => 3,
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;
    use Lifecycle as L;

    /// Which client lifecycles may follow each non-terminal server
    /// lifecycle, written out from the plan §4.2 edges.
    #[test]
    fn reachability_matches_the_written_out_table() {
        let after_accepted = [
            L::Accepted,
            L::Running,
            L::Succeeded,
            L::Failed,
            L::Terminated,
            L::Interrupted,
            L::Rejected,
            L::Cancelled,
        ];
        let table: [(L, &[L]); 4] = [
            (L::Queued, &[L::Queued, L::Dispatched, L::Expired]),
            (L::Dispatched, &[L::Dispatched, L::Queued, L::Expired]),
            (L::Accepted, &[]),
            (
                L::Running,
                &[
                    L::Running,
                    L::Succeeded,
                    L::Failed,
                    L::Terminated,
                    L::Interrupted,
                ],
            ),
        ];
        for (server, extra) in table {
            for client in Lifecycle::ALL {
                let expected = if server == L::Running {
                    extra.contains(&client)
                } else {
                    after_accepted.contains(&client) || extra.contains(&client)
                };
                assert_eq!(reachable(server, client), expected, "{server} -> {client}");
            }
        }
    }

    #[test]
    fn evidence_floor_is_running_only_for_outcomes_of_a_process_that_ran() {
        for l in Lifecycle::ALL {
            let ran = matches!(l, L::Running | L::Succeeded | L::Failed | L::Terminated);
            let floor = evidence_floor(l);
            assert_eq!(floor == L::Running, ran, "{l}");
            assert!(floor == L::Running || floor == L::Accepted);
        }
        assert!(rank(L::Queued) < rank(L::Dispatched));
        assert!(rank(L::Dispatched) < rank(L::Accepted));
        assert!(rank(L::Accepted) < rank(L::Running));
    }
}
