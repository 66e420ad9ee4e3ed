//! Storage incidents on PostgreSQL (as `rvbox_store::incidents`).
//!
//! Not yet on PostgreSQL: the scope gating the SQLite store derives from
//! open incidents (its health view); an incident here is recorded and
//! listed, and gates nothing until the PostgreSQL store has that view.

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::validate::check_incident_note;
use rvbox_proto::v1 as wire;
use rvbox_store::audit::AuditRecord;
use rvbox_store::incidents::{
    Incident, Resolution, SafeRepair, already_resolved, detail_to_error, resolution,
};
use rvbox_store::mutations::{Assigned, Owner, Stored};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::incidents::NewIncident;

use crate::audit::write_in;
use crate::{Fail, PgStore};

/// Records an incident in the caller's transaction.
pub(crate) fn insert(
    tx: &mut Transaction<'_>,
    id: [u8; 16],
    new: &NewIncident,
    now_ms: i64,
) -> Result<(), Fail> {
    let repairable = matches!(resolution(new.kind, new.data_loss), Resolution::Repair(_));
    let summary = rvbox_domain::error::bound_reason(&new.summary);
    crate::prep::execute(
        tx,
        "INSERT INTO storage_incidents (incident_id, kind, state, scope_kind, scope_key, client_id,
             issue_uuid, detected_ms, summary, evidence, repairable, data_loss)
         VALUES ($1, $2, 1, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        &[
            &id.as_slice(),
            &i64::from(new.kind as i32),
            &i64::from(new.scope_kind as i32),
            &new.scope_key,
            &new.client_id,
            &new.issue_uuid.as_ref().map(<[u8; 16]>::as_slice),
            &now_ms,
            &summary,
            &new.evidence,
            &repairable,
            &new.data_loss,
        ],
    )
    .map_err(Fail::db("record incident"))?;
    tracing::warn!(
        incident_kind = new.kind.as_str_name(),
        scope_kind = new.scope_kind.as_str_name(),
        scope_key = %new.scope_key,
        data_loss = new.data_loss,
        "storage incident recorded"
    );
    Ok(())
}

/// The incident kinds that gate nothing
/// ([`rvbox_store::incidents::gates_scope`]): the protocol incidents.
fn not_gating() -> Vec<i64> {
    (0..=i32::from(u8::MAX))
        .filter_map(|k| wire::IncidentKind::try_from(k).ok())
        .filter(|k| *k != wire::IncidentKind::Unspecified)
        .filter(|k| !rvbox_store::incidents::gates_scope(*k))
        .map(|k| i64::from(k as i32))
        .collect()
}

/// The open incidents that gate the writes of `scopes` (plan §5.1), as
/// the SQLite store's scoped health does: an open incident on the server
/// store's global scope refuses every write, one on a command's or a
/// client's scope the writes of that scope, until it is repaired or
/// acknowledged; the protocol incidents gate nothing. Returns each dirty
/// scope among them (the global scope as
/// `GlobalStore` with an empty key) with its first open incident's id.
pub(crate) fn dirty_scopes(
    tx: &mut Transaction<'_>,
    scopes: &[(wire::ScopeKind, &str)],
) -> Result<Vec<(i64, String, [u8; 16])>, Fail> {
    let kinds: Vec<i64> = scopes.iter().map(|(k, _)| i64::from(*k as i32)).collect();
    let keys: Vec<&str> = scopes.iter().map(|(_, k)| *k).collect();
    crate::prep::query(
        tx,
        "SELECT scope_kind, scope_key, (array_agg(incident_id ORDER BY incident_id))[1]
         FROM storage_incidents
         WHERE state = 1
           AND ((scope_kind = $1 AND scope_key = '')
                OR (scope_kind, scope_key) IN (SELECT * FROM unnest($2::bigint[], $3::text[])))
           AND kind <> ALL($4::bigint[])
         GROUP BY scope_kind, scope_key",
        &[
            &i64::from(wire::ScopeKind::GlobalStore as i32),
            &kinds,
            &keys,
            &not_gating(),
        ],
    )
    .map_err(Fail::db("read open incidents"))?
    .iter()
    .map(|r| {
        let id: Vec<u8> = r.get(2);
        Ok((
            r.get(0),
            r.get(1),
            <[u8; 16]>::try_from(id.as_slice())
                .map_err(|_| Fail::Integrity("an incident id is not 16 bytes".into()))?,
        ))
    })
    .collect()
}

/// The refusal of a write to `scope` given the dirty scopes
/// [`dirty_scopes`] found, if one applies.
pub(crate) fn gate(
    dirty: &[(i64, String, [u8; 16])],
    scope: &[(wire::ScopeKind, &str)],
) -> Option<DomainError> {
    let global = i64::from(wire::ScopeKind::GlobalStore as i32);
    if dirty
        .iter()
        .any(|(k, key, _)| *k == global && key.is_empty())
    {
        return Some(rvbox_store::health::store_not_ready("dirty_readable"));
    }
    scope.iter().find_map(|(kind, key)| {
        dirty
            .iter()
            .find(|(k, kk, _)| *k == i64::from(*kind as i32) && kk == key)
            .map(|(_, _, id)| {
                rvbox_store::health::dirty_scope(*kind, Some(&rvbox_store::fleet::uuid_text(id)))
            })
    })
}

/// Refuses a write to `scopes` under an open incident (see
/// [`dirty_scopes`]).
pub(crate) fn check_writable(
    tx: &mut Transaction<'_>,
    scopes: &[(wire::ScopeKind, &str)],
) -> Result<(), Fail> {
    let dirty = dirty_scopes(tx, scopes)?;
    match gate(&dirty, scopes) {
        Some(e) => Err(Fail::Refused(e)),
        None => Ok(()),
    }
}

/// Whether an incident of this kind is open on this scope already.
pub(crate) fn open(tx: &mut Transaction<'_>, new: &NewIncident) -> Result<bool, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM storage_incidents
             WHERE state = 1 AND kind = $1 AND scope_kind = $2 AND scope_key = $3 LIMIT 1",
        &[
            &i64::from(new.kind as i32),
            &i64::from(new.scope_kind as i32),
            &new.scope_key,
        ],
    )
    .map_err(Fail::db("find open incident"))?
    .is_some())
}

/// The columns [`from_row`] reads, in order.
pub(crate) const COLUMNS: &str = "incident_id, kind, state, scope_kind, scope_key, client_id,
    issue_uuid, detected_ms, resolved_ms, summary, evidence, repairable, data_loss, note";

/// An incident from a row of [`COLUMNS`].
pub(crate) fn from_row(r: &postgres::Row) -> Result<Incident, Fail> {
    use rvbox_proto::v1 as wire;
    let blob = |v: Vec<u8>| {
        let n = v.len();
        <[u8; 16]>::try_from(v.as_slice())
            .map_err(|_| Fail::Integrity(format!("a stored incident id is {n} bytes, expected 16")))
    };
    let int = |i: usize| i32::try_from(r.get::<_, i64>(i)).unwrap_or(0);
    Ok(Incident {
        id: blob(r.get(0))?,
        kind: wire::IncidentKind::try_from(int(1)).unwrap_or(wire::IncidentKind::Unspecified),
        state: wire::IncidentState::try_from(int(2)).unwrap_or(wire::IncidentState::Unspecified),
        scope_kind: wire::ScopeKind::try_from(int(3)).unwrap_or(wire::ScopeKind::Unspecified),
        scope_key: r.get(4),
        client_id: r.get(5),
        issue_uuid: r.get::<_, Option<Vec<u8>>>(6).map(blob).transpose()?,
        detected_ms: r.get(7),
        resolved_ms: r.get(8),
        summary: r.get(9),
        evidence: r.get(10),
        repairable: r.get(11),
        data_loss: r.get(12),
        note: r.get(13),
    })
}

/// One incident, locked for the resolution being decided.
fn load_locked(tx: &mut Transaction<'_>, id: &[u8; 16]) -> Result<Option<Incident>, Fail> {
    let sql = format!("SELECT {COLUMNS} FROM storage_incidents WHERE incident_id = $1 FOR UPDATE");
    tx.query_opt(sql.as_str(), &[&id.as_slice()])
        .map_err(Fail::db("load incident"))?
        .map(|r| from_row(&r))
        .transpose()
}

/// Which resolution an incident request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolve {
    Repair,
    Acknowledge,
}

impl PgStore {
    /// `RepairStorageIncident`: the kind's safe repair, or a stored
    /// `REQUIRES_ACKNOWLEDGEMENT` refusal, audited, idempotent.
    pub(crate) fn repair_incident(
        &mut self,
        req: &wire::RepairStorageIncidentRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::StorageIncident, Fail> {
        let mut canonical = req.clone();
        canonical.request_id.clear();
        let hash = request_hash("RepairStorageIncident", &canonical);
        self.resolve_incident(
            Resolve::Repair,
            &req.request_id,
            &req.incident_id,
            "",
            &hash,
            caller,
            now_ms,
        )
    }

    /// `AcknowledgeStorageIncident`: the loss accepted with the operator's
    /// note, audited, idempotent.
    pub(crate) fn acknowledge_incident(
        &mut self,
        req: &wire::AcknowledgeStorageIncidentRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::StorageIncident, Fail> {
        let mut canonical = req.clone();
        canonical.request_id.clear();
        let hash = request_hash("AcknowledgeStorageIncident", &canonical);
        self.resolve_incident(
            Resolve::Acknowledge,
            &req.request_id,
            &req.incident_id,
            &req.note,
            &hash,
            caller,
            now_ms,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn resolve_incident(
        &mut self,
        how: Resolve,
        request_id: &str,
        incident_id: &str,
        note: &str,
        hash: &rvbox_domain::hash::RequestHash,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::StorageIncident, Fail> {
        let method = match how {
            Resolve::Repair => "RepairStorageIncident",
            Resolve::Acknowledge => "AcknowledgeStorageIncident",
        };
        let mut rec = AuditRecord::control(&crate::stdin::operator(caller), method, now_ms);
        rec.detail = format!("incident {incident_id}");
        let result = (|| {
            let request_id = Uuid7::parse("request_id", request_id).map_err(DomainError::from)?;
            let id = *Uuid7::parse("incident_id", incident_id)
                .map_err(DomainError::from)?
                .as_bytes();
            if how == Resolve::Acknowledge {
                check_incident_note(note)?;
            }
            self.in_tx(method, |tx, _| {
                let incident = load_locked(tx, &id)?.ok_or_else(|| {
                    Fail::Refused(
                        DomainError::new(
                            Code::NotFound,
                            format!("no storage incident {incident_id}"),
                        )
                        .with_field("incident_id"),
                    )
                })?;
                let owner = Owner::Incident(&id);
                if let Some(stored) = crate::mutations::lookup(tx, &request_id, method, hash, owner)? {
                    return Ok((
                        match stored {
                            Ok(bytes) => decode(how, &bytes),
                            Err(detail) => Err(Fail::Refused(detail_to_error(&detail))),
                        },
                        false,
                    ));
                }
                let outcome: Result<(), DomainError> = if incident.state
                    != wire::IncidentState::Open
                {
                    Err(already_resolved(&incident))
                } else {
                    match (how, resolution(incident.kind, incident.data_loss)) {
                        (Resolve::Acknowledge, _) => {
                            crate::prep::execute(tx, "UPDATE storage_incidents SET state = 3, resolved_ms = $2, note = $3
                                 WHERE incident_id = $1",
                                &[&id.as_slice(), &now_ms, &note],
                            )
                            .map_err(Fail::db("mark incident acknowledged"))?;
                            Ok(())
                        }
                        (Resolve::Repair, Resolution::AcknowledgeOnly) => Err(DomainError::new(
                            Code::RequiresAcknowledgement,
                            "repairing this incident would discard committed data or rewrite recorded history; acknowledge it with a note instead",
                        )
                        .with_incident(incident_id.to_owned())),
                        (Resolve::Repair, Resolution::Repair(kind)) => match kind {
                            SafeRepair::RebuildCounters => {
                                crate::scrub::rebuild_counters(tx)?;
                                Ok(())
                            }
                            // the condition is the database server's own:
                            // this transaction's writes show it is gone
                            SafeRepair::RecheckCondition => Ok(()),
                            // segment files exist only on SQLite: these
                            // never arise here
                            SafeRepair::TruncateTail | SafeRepair::RollForwardEviction => {
                                Err(DomainError::new(
                                    Code::FailedPrecondition,
                                    "this repair applies to segment files, which the PostgreSQL store does not have; acknowledge the incident with a note instead",
                                )
                                .with_incident(incident_id.to_owned()))
                            }
                        },
                    }
                };
                if outcome.is_ok() && how == Resolve::Repair {
                    crate::prep::execute(tx, "UPDATE storage_incidents SET state = 2, resolved_ms = $2 WHERE incident_id = $1",
                        &[&id.as_slice(), &now_ms],
                    )
                    .map_err(Fail::db("mark incident repaired"))?;
                }
                let after = load_locked(tx, &id)?
                    .ok_or_else(|| Fail::Integrity("incident vanished".into()))?
                    .to_wire();
                let stored: Stored = match &outcome {
                    Ok(()) => Ok(encode(how, &after)),
                    Err(e) => Err(e.to_detail()),
                };
                write_in(tx, &rec, outcome.as_ref().map(|_| ()))?;
                crate::mutations::record(
                    tx,
                    &request_id,
                    method,
                    hash,
                    owner,
                    &stored,
                    Assigned::default(),
                    now_ms,
                )?;
                Ok((outcome.map(|()| after).map_err(Fail::Refused), true))
            })
        })();
        match result {
            Ok((outcome, audited)) => {
                if !audited {
                    self.audit_alone(&rec, &outcome);
                } else if outcome.is_ok() {
                    tracing::info!(method, "storage incident resolved");
                }
                outcome
            }
            Err(e) => {
                self.audit_alone(&rec, &Err::<(), _>(Fail::Integrity(e.to_string())));
                Err(e)
            }
        }
    }
}

fn encode(how: Resolve, incident: &wire::StorageIncident) -> Vec<u8> {
    match how {
        Resolve::Repair => wire::RepairStorageIncidentResponse {
            incident: Some(incident.clone()),
        }
        .encode_to_vec(),
        Resolve::Acknowledge => wire::AcknowledgeStorageIncidentResponse {
            incident: Some(incident.clone()),
        }
        .encode_to_vec(),
    }
}

fn decode(how: Resolve, bytes: &[u8]) -> Result<wire::StorageIncident, Fail> {
    let bad = || Fail::Integrity("stored incident result does not decode".into());
    let incident = match how {
        Resolve::Repair => {
            wire::RepairStorageIncidentResponse::decode(bytes)
                .map_err(|_| bad())?
                .incident
        }
        Resolve::Acknowledge => {
            wire::AcknowledgeStorageIncidentResponse::decode(bytes)
                .map_err(|_| bad())?
                .incident
        }
    };
    incident.ok_or_else(bad)
}
