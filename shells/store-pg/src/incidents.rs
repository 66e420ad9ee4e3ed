//! Storage incidents on PostgreSQL (as `rvbox_store::incidents`).
//!
//! Not yet on PostgreSQL: the scope gating the SQLite store derives from
//! open incidents (its health view); an incident here is recorded and
//! listed, and gates nothing until the PostgreSQL store has that view.

use postgres::Transaction;
use rvbox_store::incidents::{Resolution, resolution};
use rvbox_store_port::incidents::NewIncident;

use crate::Fail;

/// Records an incident in the caller's transaction.
pub(crate) fn insert(
    tx: &mut Transaction<'_>,
    id: [u8; 16],
    new: &NewIncident,
    now_ms: i64,
) -> Result<(), Fail> {
    let repairable = matches!(resolution(new.kind, new.data_loss), Resolution::Repair(_));
    let summary = rvbox_domain::error::bound_reason(&new.summary);
    tx.execute(
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

/// Whether an incident of this kind is open on this scope already.
pub(crate) fn open(tx: &mut Transaction<'_>, new: &NewIncident) -> Result<bool, Fail> {
    Ok(tx
        .query_opt(
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
