//! Local storage incidents (plan §5.5 applied to the client, §7.1): what
//! is damaged in the client's own state, recorded with immutable evidence,
//! and ended only by a repair or by an operator's acknowledgement with a
//! note. An open incident makes local health dirty; `rvbox repair` lists,
//! repairs and acknowledges them offline.

use rusqlite::{Connection, OptionalExtension, params};
use rvbox_proto::v1 as wire;
use rvbox_storage::StoreError;
use rvbox_storage::db::Cached as _;
use rvbox_storage::entropy::{Entropy, uuid_v7};

/// Longest incident summary kept (bytes).
pub const MAX_SUMMARY_BYTES: usize = 4096;
/// Longest evidence kept (bytes).
pub const MAX_EVIDENCE_BYTES: usize = 16 * 1024;
/// Longest operator note (bytes).
pub const MAX_NOTE_BYTES: usize = 4096;
/// Most incidents one listing returns.
pub const MAX_LISTED: usize = 1000;

/// Scope key of the installation's identity.
pub const IDENTITY_SCOPE: &str = "identity";

/// One local incident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIncident {
    /// Its id (UUIDv7).
    pub incident_id: [u8; 16],
    /// What kind of damage.
    pub kind: wire::IncidentKind,
    /// Open, repaired or acknowledged.
    pub state: wire::IncidentState,
    /// What it concerns.
    pub scope_kind: wire::ScopeKind,
    /// Which one.
    pub scope_key: String,
    /// When it was found (wall ms).
    pub detected_ms: i64,
    /// A bounded, operator-readable summary.
    pub summary: String,
    /// The operator's note, once acknowledged.
    pub note: Option<String>,
}

/// What a detector reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLocalIncident {
    /// Kind.
    pub kind: wire::IncidentKind,
    /// Scope kind.
    pub scope_kind: wire::ScopeKind,
    /// Scope key.
    pub scope_key: String,
    /// Summary (cut to [`MAX_SUMMARY_BYTES`]).
    pub summary: String,
    /// Evidence (cut to [`MAX_EVIDENCE_BYTES`]).
    pub evidence: Vec<u8>,
}

fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

/// Records `incident` unless one of the same kind and scope is open
/// already; returns the open incident's id either way.
///
/// # Errors
/// [`StoreError::Sqlite`], or [`StoreError::Io`] when entropy fails.
pub fn record(
    conn: &Connection,
    entropy: &dyn Entropy,
    incident: &NewLocalIncident,
    now_ms: i64,
) -> Result<[u8; 16], StoreError> {
    let open: Option<Vec<u8>> = conn
        .query_row_cached(
            "SELECT incident_id FROM incidents
             WHERE state = 1 AND kind = ?1 AND scope_kind = ?2 AND scope_key = ?3",
            params![
                incident.kind as i32,
                incident.scope_kind as i32,
                incident.scope_key
            ],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("find open incident", e))?;
    if let Some(id) = open.and_then(|v| <[u8; 16]>::try_from(v.as_slice()).ok()) {
        return Ok(id);
    }
    let id = uuid_v7(entropy, now_ms).map_err(|e| StoreError::io("mint incident id", "", e))?;
    let evidence = incident
        .evidence
        .get(..incident.evidence.len().min(MAX_EVIDENCE_BYTES))
        .unwrap_or_default();
    conn.execute_cached(
        "INSERT INTO incidents (incident_id, kind, state, scope_kind, scope_key, detected_ms,
             summary, evidence)
         VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, ?7)",
        params![
            id.as_slice(),
            incident.kind as i32,
            incident.scope_kind as i32,
            incident.scope_key,
            now_ms,
            cut(&incident.summary, MAX_SUMMARY_BYTES),
            evidence,
        ],
    )
    .map_err(|e| StoreError::sqlite("record incident", e))?;
    tracing::warn!(
        kind = incident.kind.as_str_name(),
        scope = incident.scope_kind.as_str_name(),
        summary = cut(&incident.summary, MAX_SUMMARY_BYTES),
        "local storage incident"
    );
    Ok(id)
}

fn incident_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<LocalIncident> {
    let id: Vec<u8> = r.get(0)?;
    Ok(LocalIncident {
        incident_id: <[u8; 16]>::try_from(id.as_slice()).unwrap_or_default(),
        kind: wire::IncidentKind::try_from(r.get::<_, i32>(1)?).unwrap_or_default(),
        state: wire::IncidentState::try_from(r.get::<_, i32>(2)?).unwrap_or_default(),
        scope_kind: wire::ScopeKind::try_from(r.get::<_, i32>(3)?).unwrap_or_default(),
        scope_key: r.get(4)?,
        detected_ms: r.get(5)?,
        summary: r.get(6)?,
        note: r.get(7)?,
    })
}

const SELECT: &str = "SELECT incident_id, kind, state, scope_kind, scope_key, detected_ms,
     summary, note FROM incidents";

/// Incidents, open ones first, each group oldest first, at most
/// [`MAX_LISTED`].
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn list(conn: &Connection) -> Result<Vec<LocalIncident>, StoreError> {
    let mut stmt = conn
        .prepare_cached(&format!(
            "{SELECT} ORDER BY state <> 1, detected_ms, incident_id LIMIT {MAX_LISTED}"
        ))
        .map_err(|e| StoreError::sqlite("list incidents", e))?;
    let rows = stmt
        .query_map([], incident_row)
        .map_err(|e| StoreError::sqlite("list incidents", e))?;
    rows.collect::<Result<_, _>>()
        .map_err(|e| StoreError::sqlite("list incidents", e))
}

/// One incident.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn get(conn: &Connection, id: &[u8; 16]) -> Result<Option<LocalIncident>, StoreError> {
    conn.query_row_cached(
        &format!("{SELECT} WHERE incident_id = ?1"),
        params![id.as_slice()],
        incident_row,
    )
    .optional()
    .map_err(|e| StoreError::sqlite("read incident", e))
}

/// Open incidents.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn open_count(conn: &Connection) -> Result<u64, StoreError> {
    conn.query_row_cached("SELECT COUNT(*) FROM incidents WHERE state = 1", [], |r| {
        r.get::<_, i64>(0)
    })
    .map(|n| u64::try_from(n).unwrap_or(0))
    .map_err(|e| StoreError::sqlite("count open incidents", e))
}

/// Ends an open incident as repaired (`note` = `None`) or acknowledged
/// with an operator note. Returns false when it was not open.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn resolve(
    conn: &Connection,
    id: &[u8; 16],
    note: Option<&str>,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let state = if note.is_some() { 3 } else { 2 };
    let n = conn
        .execute_cached(
            "UPDATE incidents SET state = ?2, note = ?3, resolved_ms = ?4
             WHERE incident_id = ?1 AND state = 1",
            params![
                id.as_slice(),
                state,
                note.map(|n| cut(n, MAX_NOTE_BYTES)),
                now_ms
            ],
        )
        .map_err(|e| StoreError::sqlite("resolve incident", e))?;
    Ok(n == 1)
}
