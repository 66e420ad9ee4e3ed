//! Storage incidents (plan §5.5): durable records of what went wrong, with
//! immutable evidence and a state that moves only `OPEN -> REPAIRED` or
//! `OPEN -> ACKNOWLEDGED`. Unresolved incidents make their scope dirty.
//!
//! Repair runs only actions that discard no committed data (truncate an
//! uncommitted tail, rebuild a derivable counter, roll a marked eviction
//! forward, confirm a transient condition cleared); anything else needs an
//! operator's acknowledgement with a note. Both are idempotent by
//! `request_id` through [`crate::mutations`].

use crate::audit::AuditIntent;
use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::validate::check_incident_note;
use rvbox_proto::v1 as wire;

use crate::error::StoreError;
use crate::mutations::{self, Assigned, OpError, Owner, Stored};

/// One incident row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incident {
    /// UUIDv7 bytes.
    pub id: [u8; 16],
    /// Kind.
    pub kind: wire::IncidentKind,
    /// State.
    pub state: wire::IncidentState,
    /// Scope kind.
    pub scope_kind: wire::ScopeKind,
    /// Opaque scope key (client id, issue uuid, `uuid/ordinal`); never a path.
    pub scope_key: String,
    /// Client concerned, if any.
    pub client_id: Option<String>,
    /// Command concerned, if any.
    pub issue_uuid: Option<[u8; 16]>,
    /// Detection time (Unix ms).
    pub detected_ms: i64,
    /// Resolution time.
    pub resolved_ms: Option<i64>,
    /// Bounded summary (no payload bytes, no paths).
    pub summary: String,
    /// Immutable evidence (encoded by the detector; may name internal paths).
    pub evidence: Vec<u8>,
    /// Whether a safe repair exists.
    pub repairable: bool,
    /// Whether committed data was lost.
    pub data_loss: bool,
    /// The operator's acknowledgement note.
    pub note: Option<String>,
}

pub use rvbox_store_port::incidents::NewIncident;

/// A repair that discards no committed data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SafeRepair {
    /// Truncate bytes beyond `committed_end_offset`.
    TruncateTail,
    /// Recount charged totals from the rows.
    RebuildCounters,
    /// Finish an eviction that was marked but not completed.
    RollForwardEviction,
    /// Confirm a transient condition (disk full, permissions) has cleared.
    RecheckCondition,
}

/// How an incident can be resolved (plan §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Repairable by the given action.
    Repair(SafeRepair),
    /// Only an operator's acknowledgement can resolve it.
    AcknowledgeOnly,
}

/// The resolution rule for a kind. Loss of committed or essential data is
/// never "repaired": it is acknowledged, and history keeps the loss.
#[must_use]
pub fn resolution(kind: wire::IncidentKind, data_loss: bool) -> Resolution {
    use wire::IncidentKind as K;
    if data_loss {
        return Resolution::AcknowledgeOnly;
    }
    match kind {
        K::UncommittedTail => Resolution::Repair(SafeRepair::TruncateTail),
        K::CounterMismatch => Resolution::Repair(SafeRepair::RebuildCounters),
        K::FailedEviction => Resolution::Repair(SafeRepair::RollForwardEviction),
        K::PermissionError | K::DiskExhaustion => Resolution::Repair(SafeRepair::RecheckCondition),
        K::Unspecified
        | K::MissingCommittedBytes
        | K::ChecksumMismatch
        | K::SqliteIntegrityFailure
        | K::LateAfterExpiry
        | K::StaleServer
        | K::ClientStateLoss
        | K::ReconciliationContradiction => Resolution::AcknowledgeOnly,
    }
}

const COLUMNS: &str = "incident_id, kind, state, scope_kind, scope_key, client_id, issue_uuid,
    detected_ms, resolved_ms, summary, evidence, repairable, data_loss, note";

fn blob16(v: Vec<u8>) -> rusqlite::Result<[u8; 16]> {
    <[u8; 16]>::try_from(v.as_slice()).map_err(|_| rusqlite::Error::InvalidQuery)
}

fn from_row(r: &Row<'_>) -> rusqlite::Result<Incident> {
    let kind: i32 = r.get(1)?;
    let state: i32 = r.get(2)?;
    let scope_kind: i32 = r.get(3)?;
    let issue: Option<Vec<u8>> = r.get(6)?;
    Ok(Incident {
        id: blob16(r.get(0)?)?,
        kind: wire::IncidentKind::try_from(kind).unwrap_or(wire::IncidentKind::Unspecified),
        state: wire::IncidentState::try_from(state).unwrap_or(wire::IncidentState::Unspecified),
        scope_kind: wire::ScopeKind::try_from(scope_kind).unwrap_or(wire::ScopeKind::Unspecified),
        scope_key: r.get(4)?,
        client_id: r.get(5)?,
        issue_uuid: issue.map(blob16).transpose()?,
        detected_ms: r.get(7)?,
        resolved_ms: r.get(8)?,
        summary: r.get(9)?,
        evidence: r.get(10)?,
        repairable: r.get(11)?,
        data_loss: r.get(12)?,
        note: r.get(13)?,
    })
}

/// Records a new incident (always a new id: a recurrence is a new incident).
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn insert(
    conn: &Connection,
    id: [u8; 16],
    new: &NewIncident,
    now_ms: i64,
) -> Result<Incident, StoreError> {
    let repairable = matches!(resolution(new.kind, new.data_loss), Resolution::Repair(_));
    let summary = rvbox_domain::error::bound_reason(&new.summary);
    conn.execute_cached(
        "INSERT INTO storage_incidents (incident_id, kind, state, scope_kind, scope_key, client_id,
             issue_uuid, detected_ms, summary, evidence, repairable, data_loss)
         VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![
            id.as_slice(),
            new.kind as i32,
            new.scope_kind as i32,
            new.scope_key,
            new.client_id,
            new.issue_uuid.as_ref().map(|u| u.as_slice()),
            now_ms,
            summary,
            new.evidence,
            repairable,
            new.data_loss
        ],
    )
    .map_err(|e| StoreError::sqlite("record incident", e))?;
    tracing::warn!(
        incident_kind = new.kind.as_str_name(),
        scope_kind = new.scope_kind.as_str_name(),
        scope_key = %new.scope_key,
        data_loss = new.data_loss,
        "storage incident recorded"
    );
    get(conn, &id)?.ok_or_else(|| StoreError::Integrity("incident vanished after insert".into()))
}

/// One incident by id.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn get(conn: &Connection, id: &[u8; 16]) -> Result<Option<Incident>, StoreError> {
    conn.query_row_cached(
        &format!("SELECT {COLUMNS} FROM storage_incidents WHERE incident_id = ?1"),
        params![id.as_slice()],
        from_row,
    )
    .optional()
    .map_err(|e| StoreError::sqlite("read incident", e))
}

/// A page of incidents, newest first by `(detected_ms, id)`, strictly after
/// `after` (the last row of the previous page), optionally one state only.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn list(
    conn: &Connection,
    state: Option<wire::IncidentState>,
    after: Option<(i64, [u8; 16])>,
    limit: u32,
) -> Result<Vec<Incident>, StoreError> {
    let (after_ms, after_id) = after.map_or((i64::MAX, [0xffu8; 16]), |(ms, id)| (ms, id));
    let state_filter = state.map(|s| s as i32);
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {COLUMNS} FROM storage_incidents
             WHERE (detected_ms < ?1 OR (detected_ms = ?1 AND incident_id < ?2))
               AND (?3 IS NULL OR state = ?3)
             ORDER BY detected_ms DESC, incident_id DESC
             LIMIT ?4"
        ))
        .map_err(|e| StoreError::sqlite("list incidents", e))?;
    let rows = stmt
        .query_map(
            params![after_ms, after_id.as_slice(), state_filter, limit],
            from_row,
        )
        .map_err(|e| StoreError::sqlite("list incidents", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list incidents", e))
}

/// Open incidents (dirty scopes), oldest first; at most `limit`.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn open(conn: &Connection, limit: u32) -> Result<Vec<Incident>, StoreError> {
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {COLUMNS} FROM storage_incidents WHERE state = 1
             ORDER BY detected_ms, incident_id LIMIT ?1"
        ))
        .map_err(|e| StoreError::sqlite("list open incidents", e))?;
    let rows = stmt
        .query_map(params![limit], from_row)
        .map_err(|e| StoreError::sqlite("list open incidents", e))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::sqlite("list open incidents", e))
}

/// Whether an open incident of this kind makes its scope dirty. Storage
/// incidents do (plan §5.5: unresolved rows derive dirty health); the
/// protocol incidents of plan §6.4 (late after expiry, stale server, client
/// state loss, reconciliation contradiction) record what happened for the
/// operator and gate nothing: the command's actual events must still be
/// stored ("retaining subsequent actual outcome events").
#[must_use]
pub fn gates_scope(kind: wire::IncidentKind) -> bool {
    !matches!(
        kind,
        wire::IncidentKind::LateAfterExpiry
            | wire::IncidentKind::StaleServer
            | wire::IncidentKind::ClientStateLoss
            | wire::IncidentKind::ReconciliationContradiction
    )
}

/// Whether a scope has an unresolved incident that gates it (derived dirty
/// health; see [`gates_scope`]).
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn is_dirty(
    conn: &Connection,
    scope_kind: wire::ScopeKind,
    scope_key: &str,
) -> Result<bool, StoreError> {
    conn.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM storage_incidents
                        WHERE state = 1 AND scope_kind = ?1 AND scope_key = ?2
                          AND kind NOT IN (?3, ?4, ?5, ?6))",
        params![
            scope_kind as i32,
            scope_key,
            wire::IncidentKind::LateAfterExpiry as i32,
            wire::IncidentKind::StaleServer as i32,
            wire::IncidentKind::ClientStateLoss as i32,
            wire::IncidentKind::ReconciliationContradiction as i32
        ],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("derive dirty health", e))
}

fn to_ts(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

fn canonical(id: &[u8; 16]) -> String {
    // incident ids are minted as UUIDv7 by the store
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

impl Incident {
    /// The public view: no evidence bytes, no paths.
    #[must_use]
    pub fn to_wire(&self) -> wire::StorageIncident {
        wire::StorageIncident {
            incident_id: canonical(&self.id),
            kind: self.kind as i32,
            state: self.state as i32,
            scope_kind: self.scope_kind as i32,
            scope_key: self.scope_key.clone(),
            detected_time: Some(to_ts(self.detected_ms)),
            resolved_time: self.resolved_ms.map(to_ts),
            summary: self.summary.clone(),
            repairable: self.repairable,
            data_loss: self.data_loss,
            acknowledgement_note: self.note.clone().unwrap_or_default(),
        }
    }
}

fn parse_incident_id(text: &str) -> Result<[u8; 16], OpError> {
    Ok(*Uuid7::parse("incident_id", text)
        .map_err(DomainError::from)?
        .as_bytes())
}

fn load_open(tx: &Transaction<'_>, id: &[u8; 16], text: &str) -> Result<Incident, OpError> {
    let incident = get(tx, id)?.ok_or_else(|| {
        DomainError::new(Code::NotFound, format!("no storage incident {text}"))
            .with_field("incident_id")
    })?;
    Ok(incident)
}

/// The refusal of a repair or an acknowledgement of a resolved incident.
#[must_use]
pub fn already_resolved(incident: &Incident) -> DomainError {
    let state = match incident.state {
        wire::IncidentState::Repaired => "repaired",
        wire::IncidentState::Acknowledged => "acknowledged",
        _ => "resolved",
    };
    DomainError::new(
        Code::FailedPrecondition,
        format!("the incident is already {state}; a resolved incident never changes"),
    )
    .with_field("incident_id")
}

fn replay_or<T: prost::Message + Default>(stored: Stored) -> Result<T, OpError> {
    match stored {
        Ok(bytes) => T::decode(bytes.as_slice()).map_err(|_| {
            OpError::Store(StoreError::Integrity(
                "stored mutation result does not decode".into(),
            ))
        }),
        Err(detail) => Err(OpError::Refused(detail_to_error(&detail))),
    }
}

/// A stored refusal as the domain error it was.
#[must_use]
pub fn detail_to_error(d: &wire::ErrorDetail) -> DomainError {
    let code = Code::from_wire(d.code).unwrap_or(Code::Internal);
    let mut e = DomainError::new(code, &d.reason);
    if !d.field.is_empty() {
        e = e.with_field(d.field.clone());
    }
    if let Some(i) = &d.incident_id {
        e = e.with_incident(i.clone());
    }
    e
}

/// `RepairStorageIncident`: runs the incident's safe repair through
/// `action` inside the transaction, then marks it `REPAIRED`. Refuses with
/// `REQUIRES_ACKNOWLEDGEMENT` when only an acknowledgement can resolve it.
///
/// # Errors
/// [`OpError::Refused`] (stored, replayed identically) or [`OpError::Store`].
pub fn repair(
    conn: &mut Connection,
    req: &wire::RepairStorageIncidentRequest,
    now_ms: i64,
    action: &mut dyn FnMut(&Transaction<'_>, &Incident, SafeRepair) -> Result<(), OpError>,
) -> Result<wire::RepairStorageIncidentResponse, OpError> {
    repair_audited(conn, req, now_ms, action, None)
}

/// [`repair`] with its audit record written in the same transaction as
/// the repair or the stored refusal (plan §5.5).
///
/// # Errors
/// As [`repair`].
pub fn repair_audited(
    conn: &mut Connection,
    req: &wire::RepairStorageIncidentRequest,
    now_ms: i64,
    action: &mut dyn FnMut(&Transaction<'_>, &Incident, SafeRepair) -> Result<(), OpError>,
    audit: Option<&mut AuditIntent>,
) -> Result<wire::RepairStorageIncidentResponse, OpError> {
    let request_id = Uuid7::parse("request_id", &req.request_id).map_err(DomainError::from)?;
    let id = parse_incident_id(&req.incident_id)?;
    let mut canonical_req = req.clone();
    canonical_req.request_id.clear();
    let hash = request_hash("RepairStorageIncident", &canonical_req);
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(|e| StoreError::sqlite("begin repair", e))?;
    let incident = load_open(&tx, &id, &req.incident_id)?;
    let owner = Owner::Incident(&id);
    if let Some(stored) =
        mutations::lookup(&tx, &request_id, "RepairStorageIncident", &hash, owner)?
    {
        return replay_or(stored);
    }
    let outcome: Result<wire::RepairStorageIncidentResponse, DomainError> = if incident.state
        != wire::IncidentState::Open
    {
        Err(already_resolved(&incident))
    } else {
        match resolution(incident.kind, incident.data_loss) {
            Resolution::AcknowledgeOnly => Err(DomainError::new(
                Code::RequiresAcknowledgement,
                "repairing this incident would discard committed data or rewrite recorded history; acknowledge it with a note instead",
            )
            .with_incident(canonical(&id))),
            Resolution::Repair(kind) => match action(&tx, &incident, kind) {
                Ok(()) => {
                    tx.execute_cached(
                        "UPDATE storage_incidents SET state = 2, resolved_ms = ?2 WHERE incident_id = ?1",
                        params![id.as_slice(), now_ms],
                    )
                    .map_err(|e| StoreError::sqlite("mark incident repaired", e))?;
                    let after = get(&tx, &id)?.ok_or_else(|| {
                        StoreError::Integrity("incident vanished during repair".into())
                    })?;
                    Ok(wire::RepairStorageIncidentResponse {
                        incident: Some(after.to_wire()),
                    })
                }
                Err(OpError::Refused(e)) => Err(e),
                Err(OpError::Store(e)) => return Err(OpError::Store(e)),
            },
        }
    };
    let stored: Stored = match &outcome {
        Ok(resp) => Ok(resp.encode_to_vec()),
        Err(e) => Err(e.to_detail()),
    };
    if let Some(audit) = audit {
        audit.write_in(&tx, outcome.as_ref().map(|_| ()))?;
    }
    mutations::record(
        &tx,
        &request_id,
        "RepairStorageIncident",
        &hash,
        owner,
        &stored,
        Assigned::default(),
        now_ms,
    )?;
    tx.commit()
        .map_err(|e| StoreError::sqlite("commit repair", e))?;
    if outcome.is_ok() {
        tracing::info!(
            incident_kind = incident.kind.as_str_name(),
            "storage incident repaired"
        );
    }
    outcome.map_err(OpError::Refused)
}

/// `AcknowledgeStorageIncident`: accepts the recorded loss with an
/// operator note (1 byte to 4 KiB) and marks it `ACKNOWLEDGED`. History is
/// kept; the incident stops counting toward dirty health.
///
/// # Errors
/// [`OpError::Refused`] (stored, replayed identically) or [`OpError::Store`].
pub fn acknowledge(
    conn: &mut Connection,
    req: &wire::AcknowledgeStorageIncidentRequest,
    now_ms: i64,
) -> Result<wire::AcknowledgeStorageIncidentResponse, OpError> {
    acknowledge_audited(conn, req, now_ms, None)
}

/// [`acknowledge`] with its audit record written in the same transaction
/// as the acknowledgement or the stored refusal (plan §5.5).
///
/// # Errors
/// As [`acknowledge`].
pub fn acknowledge_audited(
    conn: &mut Connection,
    req: &wire::AcknowledgeStorageIncidentRequest,
    now_ms: i64,
    audit: Option<&mut AuditIntent>,
) -> Result<wire::AcknowledgeStorageIncidentResponse, OpError> {
    let request_id = Uuid7::parse("request_id", &req.request_id).map_err(DomainError::from)?;
    let id = parse_incident_id(&req.incident_id)?;
    check_incident_note(&req.note)?;
    let mut canonical_req = req.clone();
    canonical_req.request_id.clear();
    let hash = request_hash("AcknowledgeStorageIncident", &canonical_req);
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(|e| StoreError::sqlite("begin acknowledge", e))?;
    let incident = load_open(&tx, &id, &req.incident_id)?;
    let owner = Owner::Incident(&id);
    if let Some(stored) =
        mutations::lookup(&tx, &request_id, "AcknowledgeStorageIncident", &hash, owner)?
    {
        return replay_or(stored);
    }
    let outcome: Result<wire::AcknowledgeStorageIncidentResponse, DomainError> = if incident.state
        != wire::IncidentState::Open
    {
        Err(already_resolved(&incident))
    } else {
        tx.execute_cached(
                "UPDATE storage_incidents SET state = 3, resolved_ms = ?2, note = ?3 WHERE incident_id = ?1",
                params![id.as_slice(), now_ms, req.note],
            )
            .map_err(|e| StoreError::sqlite("mark incident acknowledged", e))?;
        let after = get(&tx, &id)?
            .ok_or_else(|| StoreError::Integrity("incident vanished during acknowledge".into()))?;
        Ok(wire::AcknowledgeStorageIncidentResponse {
            incident: Some(after.to_wire()),
        })
    };
    let stored: Stored = match &outcome {
        Ok(resp) => Ok(resp.encode_to_vec()),
        Err(e) => Err(e.to_detail()),
    };
    if let Some(audit) = audit {
        audit.write_in(&tx, outcome.as_ref().map(|_| ()))?;
    }
    mutations::record(
        &tx,
        &request_id,
        "AcknowledgeStorageIncident",
        &hash,
        owner,
        &stored,
        Assigned::default(),
        now_ms,
    )?;
    tx.commit()
        .map_err(|e| StoreError::sqlite("commit acknowledge", e))?;
    if outcome.is_ok() {
        tracing::info!(
            incident_kind = incident.kind.as_str_name(),
            "storage incident acknowledged"
        );
    }
    outcome.map_err(OpError::Refused)
}

/// Most resolved incidents kept; older resolved ones are deleted by
/// maintenance (their history stays in the audit log). Open incidents are
/// never deleted.
pub const MAX_RESOLVED_INCIDENTS: u64 = 100_000;

/// Deletes the oldest resolved incidents beyond `cap` (and, by cascade,
/// their mutation rows). Returns how many were deleted.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn trim_resolved(conn: &Connection, cap: u64) -> Result<u64, StoreError> {
    let resolved: i64 = conn
        .query_row_cached(
            "SELECT COUNT(*) FROM storage_incidents WHERE state <> 1",
            [],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("count resolved incidents", e))?;
    let excess = u64::try_from(resolved).unwrap_or(0).saturating_sub(cap);
    if excess == 0 {
        return Ok(0);
    }
    let n = conn
        .execute_cached(
            "DELETE FROM storage_incidents WHERE incident_id IN (
                 SELECT incident_id FROM storage_incidents WHERE state <> 1
                 ORDER BY resolved_ms, incident_id LIMIT ?1)",
            params![i64::try_from(excess).unwrap_or(i64::MAX)],
        )
        .map_err(|e| StoreError::sqlite("trim resolved incidents", e))?;
    tracing::info!(deleted = n, "oldest resolved incidents trimmed");
    Ok(u64::try_from(n).unwrap_or(0))
}
