//! Incidents a detector reports (plan §5.4).

use rvbox_proto::v1 as wire;

/// What a detector reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewIncident {
    /// Kind.
    pub kind: wire::IncidentKind,
    /// Scope kind.
    pub scope_kind: wire::ScopeKind,
    /// Opaque scope key.
    pub scope_key: String,
    /// Client concerned.
    pub client_id: Option<String>,
    /// Command concerned.
    pub issue_uuid: Option<[u8; 16]>,
    /// Bounded summary.
    pub summary: String,
    /// Immutable evidence.
    pub evidence: Vec<u8>,
    /// Whether committed data was lost.
    pub data_loss: bool,
}
