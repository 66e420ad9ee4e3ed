//! Operator actions on storage incidents (plan §5.5), shared by the
//! control API and the offline `rvbox-server repair` tool: list, repair
//! with the safe action each kind allows, acknowledge with a note.

use crate::db::Cached as _;
use rusqlite::{Transaction, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;

use crate::audit::{AuditIntent, AuditRecord};
use crate::error::StoreError;
use crate::incidents::{self, Incident, SafeRepair};
use crate::mutations::OpError;
use crate::store::Store;

/// Recomputes every charged-byte counter from the rows it summarizes
/// (a derivable counter: rebuilding it discards nothing).
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn rebuild_counters(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.execute_batch(
        "UPDATE clients SET charged_bytes =
             COALESCE((SELECT SUM(charged_bytes) FROM commands m WHERE m.client_id = clients.client_id), 0);
         UPDATE quota_totals SET command_charged =
             COALESCE((SELECT SUM(charged_bytes) FROM clients), 0),
             clients = (SELECT COUNT(*) FROM clients),
             sessions = (SELECT COUNT(*) FROM sessions),
             queued = (SELECT COUNT(*) FROM commands WHERE lifecycle IN (1, 2)),
             tombstones = (SELECT COUNT(*) FROM command_tombstones) WHERE id = 1;
         DELETE FROM queued_by_client;
         INSERT INTO queued_by_client (client_id, queued)
             SELECT client_id, COUNT(*) FROM commands WHERE lifecycle IN (1, 2) GROUP BY client_id;
         UPDATE fleet_runs SET
             targets = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id),
             n_pending = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 1),
             n_queued = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 2),
             n_running = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 3),
             n_succeeded = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 4),
             n_failed = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 5),
             n_unreachable = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 6),
             n_cancelled = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 7),
             n_skipped = (SELECT COUNT(*) FROM fleet_targets t WHERE t.run_id = fleet_runs.run_id AND t.state = 8);",
    )
    .map_err(|e| StoreError::sqlite("rebuild counters", e))
}

pub use rvbox_store_port::audit::Caller;

impl Store {
    /// The audit intent of an incident action (plan §5.5): written in
    /// the action's transaction, before derived dirty health is refreshed.
    fn incident_intent(
        caller: &Caller,
        action: &str,
        incident_id: &str,
        now_ms: i64,
    ) -> AuditIntent {
        let mut rec = AuditRecord::control(caller, action, now_ms);
        rec.detail = format!("incident {incident_id}");
        AuditIntent::control(rec)
    }

    /// A page of incidents, newest first (see [`incidents::list`]).
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn list_incidents(
        &self,
        state: Option<wire::IncidentState>,
        after: Option<(i64, [u8; 16])>,
        limit: u32,
    ) -> Result<Vec<Incident>, StoreError> {
        incidents::list(&self.conn, state, after, limit)
    }

    /// `RepairStorageIncident`: runs the kind's safe repair, or refuses
    /// with `REQUIRES_ACKNOWLEDGEMENT`.
    ///
    /// # Errors
    /// [`OpError`]; refusals are stored and replay identically.
    pub fn repair_incident(
        &mut self,
        req: &wire::RepairStorageIncidentRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::RepairStorageIncidentResponse, OpError> {
        let floor = self.opts.tiers.free_space_floor;
        let free = self.free_space();
        let dir = self.layout.segments_dir();
        let layout = self.layout.clone();
        let fs = self.fs.clone();
        let writable = || -> bool {
            let probe = dir.join(".rvbox-write-probe");
            let ok = fs.create_new(&probe).is_ok();
            let _ = fs.remove_file(&probe);
            ok
        };
        let mut intent =
            Self::incident_intent(caller, "RepairStorageIncident", &req.incident_id, now_ms);
        let result = incidents::repair_audited(
            &mut self.conn,
            req,
            now_ms,
            &mut |tx, incident, action| match action {
                SafeRepair::RebuildCounters => rebuild_counters(tx).map_err(OpError::Store),
                SafeRepair::TruncateTail => cut_tail(tx, fs.as_ref(), &layout, incident),
                SafeRepair::RollForwardEviction => roll_forward_marked(tx, incident),
                SafeRepair::RecheckCondition => {
                    let space_ok = free.as_ref().is_ok_and(|f| *f >= floor);
                    if space_ok && writable() {
                        Ok(())
                    } else {
                        Err(OpError::Refused(DomainError::new(
                            Code::FailedPrecondition,
                            "the condition persists: the store's filesystem is still full or not writable",
                        )))
                    }
                }
            },
            Some(&mut intent),
        );
        self.audit_unwritten(&mut intent, &result, now_ms);
        // plan §5.5: the audit record is persisted (in the repair's own
        // transaction) before derived dirty health clears
        if result.is_ok() {
            self.health.refresh(&self.conn)?;
        }
        result
    }

    /// `AcknowledgeStorageIncident`: accepts recorded loss with a note.
    ///
    /// # Errors
    /// [`OpError`]; refusals are stored and replay identically.
    pub fn acknowledge_incident(
        &mut self,
        req: &wire::AcknowledgeStorageIncidentRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<wire::AcknowledgeStorageIncidentResponse, OpError> {
        let mut intent = Self::incident_intent(
            caller,
            "AcknowledgeStorageIncident",
            &req.incident_id,
            now_ms,
        );
        let result = incidents::acknowledge_audited(&mut self.conn, req, now_ms, Some(&mut intent));
        self.audit_unwritten(&mut intent, &result, now_ms);
        // plan §5.5: the audit record is persisted (in the acknowledgement's
        // own transaction) before derived dirty health clears
        if result.is_ok() {
            self.health.refresh(&self.conn)?;
        }
        result
    }
}

/// Cuts the bytes beyond `committed_end` of the segment an
/// `UNCOMMITTED_TAIL` incident names (`<uuid hex>/<ordinal>`); those bytes
/// were never acknowledged. A segment already at its committed length, or
/// one that no longer exists, needs nothing.
fn cut_tail(
    tx: &Transaction<'_>,
    fs: &dyn crate::fs::StoreFs,
    layout: &crate::layout::Layout,
    incident: &Incident,
) -> Result<(), OpError> {
    let bad = || {
        OpError::Refused(DomainError::new(
            Code::FailedPrecondition,
            "the incident does not name a command segment",
        ))
    };
    let (hex, ordinal) = incident.scope_key.split_once('/').ok_or_else(bad)?;
    let ordinal: u32 = ordinal.parse().map_err(|_| bad())?;
    let name = rvbox_segment::segment_file_name(&[0; 16], ordinal).ok_or_else(bad)?;
    // rebuild the canonical name from the validated parts only
    let name = format!("{hex}{}", name.get(32..).ok_or_else(bad)?);
    let (issue, parsed) = rvbox_segment::parse_segment_file_name(&name).ok_or_else(bad)?;
    let committed: Option<i64> = tx
        .query_row_cached(
            "SELECT committed_end FROM command_segments WHERE issue_uuid = ?1 AND ordinal = ?2",
            params![issue.as_slice(), parsed],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            other => Err(other),
        })
        .map_err(|e| OpError::Store(StoreError::sqlite("read segment", e)))?;
    let Some(committed) = committed else {
        return Ok(()); // the segment is gone (evicted or rotated)
    };
    let committed = u64::try_from(committed).unwrap_or(0);
    let path = layout.segment_file(&name).ok_or_else(bad)?;
    let mut f = match fs.open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(OpError::Store(StoreError::io("open segment", &path, e))),
    };
    let len = f
        .len()
        .map_err(|e| OpError::Store(StoreError::io("stat segment", &path, e)))?;
    if len > committed {
        f.truncate(committed)
            .map_err(|e| OpError::Store(StoreError::io("truncate uncommitted tail", &path, e)))?;
    }
    Ok(())
}

/// A failed eviction is rolled forward by clearing the command's
/// `evicting` mark only when its rows are already gone; otherwise the
/// maintenance worker's sweeper finishes it on its next run.
fn roll_forward_marked(tx: &Transaction<'_>, incident: &Incident) -> Result<(), OpError> {
    let Some(issue) = incident.issue_uuid else {
        return Ok(());
    };
    let still: i64 = tx
        .query_row_cached(
            "SELECT COUNT(*) FROM commands WHERE issue_uuid = ?1 AND retention = 'evicting'",
            params![issue.as_slice()],
            |r| r.get(0),
        )
        .map_err(|e| OpError::Store(StoreError::sqlite("check eviction", e)))?;
    if still > 0 {
        return Err(OpError::Refused(DomainError::new(
            Code::FailedPrecondition,
            format!("{still} eviction(s) still pending; run maintenance first"),
        )));
    }
    Ok(())
}
