//! Server-side command transitions for dispatch and reconciliation (plan
//! §6.4): the reads the dispatch and reconciliation cores decide on, and
//! the writes that make their decisions durable. Every write re-checks, in
//! its transaction, the lifecycle and revision the decision saw
//! (compare-and-set), so a decision taken on a stale view changes nothing
//! and is refused with `CONFLICT`.
//!
//! Terminal decisions taken by the server (expired, rejected, cancelled,
//! interrupted) release the command's closeout headroom and insert its
//! replay tombstone in the same transaction, exactly like a terminal event
//! from the client.

use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_retention::{Usage, release_closeout};

use crate::error::StoreError;
use crate::incidents::NewIncident;
use crate::mutations::OpError;
use crate::sessions::SessionFence;
use crate::store::{Store, to_i64, to_u64};

/// Most rows one listing returns (a reconciliation request carries at
/// most 10,000 rows).
pub const MAX_LISTED_COMMANDS: usize = 10_000;

pub use rvbox_store_port::commands::{CommandView, Knowledge, ReconcileWrite, ServerTerminal};

const VIEW_COLUMNS: &str = "c.issue_uuid, c.client_id, c.lifecycle, c.revision, c.request_hash,
    c.last_event_seq, c.issue_time_ms, c.queue_expiry_ms, c.expired_pending,
    COALESCE((SELECT SUM(p.raw_len) FROM command_payloads p
              WHERE p.issue_uuid = c.issue_uuid AND p.kind = 3), 0)";

fn view_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<CommandView> {
    let issue: Vec<u8> = r.get(0)?;
    let hash: Vec<u8> = r.get(4)?;
    Ok(CommandView {
        issue_uuid: <[u8; 16]>::try_from(issue.as_slice()).unwrap_or([0; 16]),
        client_id: r.get(1)?,
        lifecycle: Lifecycle::from_wire(r.get::<_, i32>(2)?).unwrap_or(Lifecycle::Interrupted),
        revision: to_u64(r.get(3)?),
        request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or([0; 32]),
        last_event_seq: to_u64(r.get(5)?),
        issue_time_ms: r.get(6)?,
        queue_expiry_ms: r.get(7)?,
        expired_pending: r.get(8)?,
        script_bytes: to_u64(r.get(9)?),
    })
}

pub(crate) fn load_view(
    tx: &rusqlite::Connection,
    issue: &[u8; 16],
) -> Result<CommandView, OpError> {
    tx.query_row_cached(
        &format!("SELECT {VIEW_COLUMNS} FROM commands c WHERE c.issue_uuid = ?1"),
        params![issue.as_slice()],
        view_of,
    )
    .optional()
    .map_err(|e| StoreError::sqlite("load command", e))?
    .ok_or_else(|| OpError::Refused(DomainError::new(Code::NotFound, "no such command")))
}

/// The compare-and-set every write starts with.
pub(crate) fn expect(
    view: &CommandView,
    lifecycle: &[Lifecycle],
    revision: u64,
) -> Result<(), OpError> {
    if !lifecycle.contains(&view.lifecycle) || view.revision != revision {
        return Err(OpError::Refused(DomainError::new(
            Code::Conflict,
            format!(
                "the command is {} at revision {}, not what the decision saw",
                view.lifecycle.as_str(),
                view.revision
            ),
        )));
    }
    Ok(())
}

pub(crate) fn set_lifecycle(
    tx: &rusqlite::Connection,
    issue: &[u8; 16],
    to: Lifecycle,
) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE commands SET lifecycle = ?2 WHERE issue_uuid = ?1",
        params![issue.as_slice(), to.to_wire() as i32],
    )
    .map_err(|e| StoreError::sqlite("apply transition", e))?;
    Ok(())
}

/// A requeued command is certainly not held by the client any more: the
/// "expired pending reconciliation" indicator no longer applies, and a
/// queued command past its expiry simply expires.
fn clear_expired_pending(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE commands SET expired_pending = 0 WHERE issue_uuid = ?1",
        params![issue.as_slice()],
    )
    .map_err(|e| StoreError::sqlite("clear expired pending", e))?;
    Ok(())
}

impl Store {
    /// One command, as dispatch and reconciliation see it.
    ///
    /// # Errors
    /// `NOT_FOUND`, or a store failure.
    pub fn command_view(&self, issue: &[u8; 16]) -> Result<CommandView, OpError> {
        load_view(&self.conn, issue)
    }

    /// The client's queued commands in dispatch order (issue time, then
    /// UUID), at most `limit` (capped at [`MAX_LISTED_COMMANDS`]).
    ///
    /// # Errors
    /// A store failure.
    pub fn queued_commands(
        &self,
        client_id: &str,
        limit: usize,
    ) -> Result<Vec<CommandView>, StoreError> {
        self.list_views(
            "c.client_id = ?1 AND c.lifecycle = 1 ORDER BY c.issue_time_ms, c.issue_uuid",
            client_id,
            limit,
        )
    }

    /// Every non-terminal command of the client, sorted by UUID: the rows
    /// of a `ReconcileRequest` (plan §6.4, R-6.4-19).
    ///
    /// # Errors
    /// A store failure.
    pub fn non_terminal_commands(&self, client_id: &str) -> Result<Vec<CommandView>, StoreError> {
        self.list_views(
            "c.client_id = ?1 AND c.lifecycle < 5 ORDER BY c.issue_uuid",
            client_id,
            MAX_LISTED_COMMANDS,
        )
    }

    fn list_views(
        &self,
        filter: &str,
        client_id: &str,
        limit: usize,
    ) -> Result<Vec<CommandView>, StoreError> {
        let limit = limit.min(MAX_LISTED_COMMANDS);
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {VIEW_COLUMNS} FROM commands c WHERE {filter} LIMIT ?2"
            ))
            .map_err(|e| StoreError::sqlite("list commands", e))?;
        let rows = stmt
            .query_map(params![client_id, limit as i64], view_of)
            .map_err(|e| StoreError::sqlite("list commands", e))?;
        rows.collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sqlite("list commands", e))
    }

    /// Commands whose absolute queue expiry has passed while queued or
    /// dispatched (plan §6.4: driven by an ordered index), oldest first.
    ///
    /// # Errors
    /// A store failure.
    pub fn expiry_due(&self, now_ms: i64, limit: usize) -> Result<Vec<CommandView>, StoreError> {
        let limit = limit.min(MAX_LISTED_COMMANDS);
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {VIEW_COLUMNS} FROM commands c
                 WHERE c.lifecycle IN (1, 2) AND c.queue_expiry_ms IS NOT NULL
                   AND c.queue_expiry_ms <= ?1
                   AND (c.lifecycle = 1 OR c.expired_pending = 0)
                 ORDER BY c.queue_expiry_ms LIMIT ?2"
            ))
            .map_err(|e| StoreError::sqlite("list expired commands", e))?;
        let rows = stmt
            .query_map(params![now_ms, limit as i64], view_of)
            .map_err(|e| StoreError::sqlite("list expired commands", e))?;
        rows.collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sqlite("list expired commands", e))
    }

    /// What the server knows of `issue` (reconciliation of a snapshot
    /// record that is not among the client's non-terminal commands).
    ///
    /// # Errors
    /// A store failure.
    pub fn command_knowledge(&self, issue: &[u8; 16]) -> Result<Knowledge, StoreError> {
        let row: Option<(Vec<u8>, i32, i64)> = self
            .conn
            .query_row_cached(
                "SELECT request_hash, lifecycle, last_event_seq FROM commands WHERE issue_uuid = ?1",
                params![issue.as_slice()],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("load command", e))?;
        if let Some((hash, lifecycle, last)) = row {
            return Ok(Knowledge::Terminal {
                request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or([0; 32]),
                lifecycle: Lifecycle::from_wire(lifecycle).unwrap_or(Lifecycle::Interrupted),
                last_event_seq: to_u64(last),
            });
        }
        let tomb: Option<Vec<u8>> = self
            .conn
            .query_row_cached(
                "SELECT request_hash FROM command_tombstones WHERE issue_uuid = ?1",
                params![issue.as_slice()],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("load tombstone", e))?;
        Ok(match tomb {
            Some(hash) => Knowledge::Tombstoned {
                request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or([0; 32]),
            },
            None => Knowledge::Missing,
        })
    }

    /// Begins a write on one command: scope check, transaction, current view.
    pub(crate) fn begin_on(
        &mut self,
        issue: &[u8; 16],
    ) -> Result<(Transaction<'_>, CommandView), OpError> {
        self.begin_for(None, issue)
    }

    /// Begins a write on one command made for a connection's `session`:
    /// as [`Store::begin_on`], and the session checked in the transaction
    /// ([`crate::sessions::check_fence`]).
    pub(crate) fn begin_for(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
    ) -> Result<(Transaction<'_>, CommandView), OpError> {
        let client = load_view(&self.conn, issue)?.client_id;
        let key = uuid::Uuid::from_bytes(*issue).hyphenated().to_string();
        self.health.check_writable(&[
            (wire::ScopeKind::Command, key.as_str()),
            (wire::ScopeKind::Client, client.as_str()),
        ])?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin command write", e))?;
        let view = load_view(&tx, issue)?;
        crate::sessions::check_fence(
            &tx,
            &self.metrics.writes_fenced,
            session.as_ref(),
            &view.client_id,
        )?;
        Ok((tx, view))
    }

    /// queued -> dispatched, persisted before the frame is written (plan
    /// §6.4, R-6.4-04).
    ///
    /// # Errors
    /// `CONFLICT` when the command is no longer queued at `revision`,
    /// `NOT_FOUND`, `UNAVAILABLE`, or a store failure.
    pub fn mark_dispatched(&mut self, issue: &[u8; 16], revision: u64) -> Result<(), OpError> {
        let mut group = self.write_group()?;
        group.mark_dispatched(None, issue, revision)?;
        group.commit()?;
        Ok(())
    }

    /// dispatched -> queued: a transient negative acceptance, or a
    /// reconciliation that found it absent from a healthy snapshot. The
    /// queue expiry stays what it was (R-6.4-13).
    ///
    /// # Errors
    /// As [`Store::mark_dispatched`]; `STALE_SESSION` when `session` is no
    /// longer live.
    pub fn requeue(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        revision: u64,
        now_ms: i64,
    ) -> Result<Lifecycle, OpError> {
        let cap = self.opts.tombstone_cap;
        let (tx, view) = self.begin_for(session, issue)?;
        let to = requeue_in(&tx, &view, revision, now_ms, cap)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit requeue", e))?;
        self.hook.at(crate::crash::points::REQUEUE_AFTER_COMMIT);
        self.note_requeue(to, revision);
        Ok(to)
    }

    fn note_requeue(&self, to: Lifecycle, revision: u64) {
        if to == Lifecycle::Queued {
            self.metrics.command_transition("requeued");
            tracing::info!(revision, "command returned to the queue");
        } else {
            self.metrics.command_transition(to.as_str());
            tracing::info!(
                revision,
                "command never held by its client and signalled: cancelled instead of requeued"
            );
        }
    }

    /// dispatched -> accepted: a positive `CommandAccepted` at the
    /// dispatched revision; records the shell the client resolved.
    ///
    /// # Errors
    /// As [`Store::mark_dispatched`].
    pub fn record_accepted(
        &mut self,
        issue: &[u8; 16],
        revision: u64,
        resolved_shell: i32,
    ) -> Result<(), OpError> {
        let mut group = self.write_group()?;
        group.record_accepted(None, issue, revision, resolved_shell)?;
        group.commit()?;
        Ok(())
    }

    /// Advances a non-terminal command along one legal edge the server
    /// learned from client evidence (reconciliation: the client's record
    /// is further along), keeping the revision check.
    ///
    /// # Errors
    /// `ILLEGAL_TRANSITION`, `CONFLICT`, `NOT_FOUND`, or a store failure.
    pub fn advance_lifecycle(
        &mut self,
        issue: &[u8; 16],
        revision: u64,
        to: Lifecycle,
    ) -> Result<(), OpError> {
        if to.is_terminal() {
            return Err(OpError::Refused(DomainError::new(
                Code::IllegalTransition,
                "terminal lifecycles come from the client's terminal event or a server decision",
            )));
        }
        let (tx, view) = self.begin_on(issue)?;
        expect(&view, &[view.lifecycle], revision)?;
        view.lifecycle
            .check_transition(to)
            .map_err(|e| OpError::Refused(DomainError::from(e)))?;
        set_lifecycle(&tx, issue, to)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit transition", e))?;
        self.hook.at(crate::crash::points::ADVANCE_AFTER_COMMIT);
        self.metrics.command_transition(to.as_str());
        Ok(())
    }

    /// Sets the derived "expired pending reconciliation" indicator of a
    /// dispatched command past its TTL (R-6.4-10): no lifecycle change, no
    /// false terminal event.
    ///
    /// # Errors
    /// As [`Store::mark_dispatched`].
    pub fn mark_expired_pending(&mut self, issue: &[u8; 16], revision: u64) -> Result<(), OpError> {
        let (tx, view) = self.begin_on(issue)?;
        expect(&view, &[Lifecycle::Dispatched], revision)?;
        tx.execute_cached(
            "UPDATE commands SET expired_pending = 1 WHERE issue_uuid = ?1",
            params![issue.as_slice()],
        )
        .map_err(|e| StoreError::sqlite("mark expired pending", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit expired pending", e))?;
        self.hook
            .at(crate::crash::points::EXPIRED_PENDING_AFTER_COMMIT);
        self.metrics.command_transition("expired_pending");
        tracing::warn!(
            revision,
            "dispatched command past its queue TTL; expired pending reconciliation"
        );
        Ok(())
    }

    /// Persists a higher revision (a kill or termination of dispatched or
    /// accepted work, R-6.4-11/36) before the revisioned signal is sent.
    /// Returns the new revision.
    ///
    /// # Errors
    /// `CONFLICT` when the revision moved or the command is terminal, or a
    /// store failure.
    pub fn bump_revision(&mut self, issue: &[u8; 16], revision: u64) -> Result<u64, OpError> {
        let (tx, view) = self.begin_on(issue)?;
        if view.lifecycle.is_terminal() {
            return Err(OpError::Refused(DomainError::new(
                Code::Conflict,
                "the command already ended",
            )));
        }
        expect(&view, &[view.lifecycle], revision)?;
        let next = revision
            .checked_add(1)
            .ok_or_else(|| StoreError::Integrity("revision overflow".into()))?;
        tx.execute_cached(
            "UPDATE commands SET revision = ?2 WHERE issue_uuid = ?1",
            params![issue.as_slice(), to_i64(next)],
        )
        .map_err(|e| StoreError::sqlite("bump revision", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit revision", e))?;
        self.hook.at(crate::crash::points::REVISION_AFTER_COMMIT);
        Ok(next)
    }

    /// Ends a command by a server decision (expired, rejected, cancelled,
    /// interrupted), from one of `from` at `revision`: lifecycle and terminal
    /// time, the structured rejection reason, the closeout headroom
    /// released, the replay tombstone, and an optional incident, all in one
    /// transaction.
    ///
    /// # Errors
    /// `CONFLICT`, `ILLEGAL_TRANSITION`, `NOT_FOUND`, `UNAVAILABLE`,
    /// `STALE_SESSION` when `session` is no longer live, or a store failure.
    #[allow(clippy::too_many_arguments)]
    pub fn finish_by_server(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        from: &[Lifecycle],
        revision: u64,
        how: ServerTerminal,
        rejection: Option<&wire::ErrorDetail>,
        incident: Option<&NewIncident>,
        now_ms: i64,
    ) -> Result<(), OpError> {
        let incident_id = match incident {
            Some(_) => Some(
                crate::entropy::uuid_v7(self.entropy.as_ref(), now_ms)
                    .map_err(|e| StoreError::io("mint incident id", "", e))?,
            ),
            None => None,
        };
        let cap = self.opts.tombstone_cap;
        let (tx, view) = self.begin_for(session, issue)?;
        expect(&view, from, revision)?;
        let to = how.lifecycle();
        view.lifecycle
            .check_transition(to)
            .map_err(|e| OpError::Refused(DomainError::from(e)))?;
        finish_in(&tx, issue, &view, to, rejection, now_ms, cap)?;
        if let (Some(new), Some(id)) = (incident, incident_id) {
            crate::incidents::insert(&tx, id, new, now_ms)?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit server terminal", e))?;
        self.hook.at(crate::crash::points::FINISH_AFTER_COMMIT);
        if let Some(new) = incident {
            self.metrics
                .incidents
                .get_or_create(&crate::metrics::KindLabel {
                    kind: new.kind.as_str_name(),
                })
                .inc();
            self.health.refresh(&self.conn)?;
        }
        self.metrics.command_transition(to.as_str());
        tracing::info!(to = to.as_str(), revision, "command ended by the server");
        Ok(())
    }

    /// Persists every decision of a reconciliation round and its incidents
    /// in one transaction (plan §6.4, R-6.4-28), before the result is sent.
    /// Each write re-checks the revision (and, for a requeue, the
    /// lifecycle) the decision saw: if any moved, nothing is written and
    /// `CONFLICT` is returned, so the caller runs a new round. An incident
    /// whose kind is already open for the same command is not opened again
    /// (the same snapshot yields the same decisions).
    ///
    /// # Errors
    /// `CONFLICT`, `UNAVAILABLE`, `STALE_SESSION` when `session` is no
    /// longer live, or a store failure; nothing committed.
    pub fn apply_reconciliation(
        &mut self,
        session: Option<SessionFence>,
        client_id: &str,
        writes: &[ReconcileWrite],
        incidents: &[NewIncident],
        now_ms: i64,
    ) -> Result<usize, OpError> {
        self.health
            .check_writable(&[(wire::ScopeKind::Client, client_id)])?;
        let mut ids = Vec::with_capacity(incidents.len());
        for _ in incidents {
            ids.push(
                crate::entropy::uuid_v7(self.entropy.as_ref(), now_ms)
                    .map_err(|e| StoreError::io("mint incident id", "", e))?,
            );
        }
        let cap = self.opts.tombstone_cap;
        let mut requeued = Vec::new();
        let mut lost = Vec::new();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin reconciliation", e))?;
        crate::sessions::check_fence(
            &tx,
            &self.metrics.writes_fenced,
            session.as_ref(),
            client_id,
        )?;
        for w in writes {
            match *w {
                ReconcileWrite::Requeue { issue, revision } => {
                    let view = load_view(&tx, &issue)?;
                    requeued.push((requeue_in(&tx, &view, revision, now_ms, cap)?, revision));
                }
                ReconcileWrite::Advance {
                    issue,
                    revision,
                    to,
                } => {
                    let view = load_view(&tx, &issue)?;
                    expect(&view, &[view.lifecycle], revision)?;
                    // R-6.4-34: a queued row the client holds walks
                    // through dispatched (the server never learned of the
                    // dispatch's answer), then as far as the client is
                    let mut at = view.lifecycle;
                    for step in [
                        Lifecycle::Dispatched,
                        Lifecycle::Accepted,
                        Lifecycle::Running,
                    ] {
                        if at == to {
                            break;
                        }
                        if at.check_transition(step).is_ok() {
                            at = step;
                        }
                    }
                    if at != to {
                        return Err(OpError::Refused(DomainError::new(
                            Code::IllegalTransition,
                            format!(
                                "no legal path from {} to {}",
                                view.lifecycle.as_str(),
                                to.as_str()
                            ),
                        )));
                    }
                    set_lifecycle(&tx, &issue, to)?;
                }
                ReconcileWrite::Interrupt { issue, revision } => {
                    let view = load_view(&tx, &issue)?;
                    expect(&view, &[view.lifecycle], revision)?;
                    view.lifecycle
                        .check_transition(Lifecycle::Interrupted)
                        .map_err(|e| OpError::Refused(DomainError::from(e)))?;
                    finish_in(
                        &tx,
                        &issue,
                        &view,
                        Lifecycle::Interrupted,
                        None,
                        now_ms,
                        cap,
                    )?;
                }
                ReconcileWrite::LostEvents {
                    issue,
                    revision,
                    first_event_seq,
                    last_event_seq,
                } => {
                    let view = load_view(&tx, &issue)?;
                    expect(&view, &[view.lifecycle], revision)?;
                    rvbox_store_port::commands::check_lost_range(
                        view.last_event_seq,
                        first_event_seq,
                        last_event_seq,
                    )
                    .map_err(OpError::Refused)?;
                    tx.execute_cached(
                        "UPDATE commands SET last_event_seq = ?2 WHERE issue_uuid = ?1",
                        params![issue.as_slice(), to_i64(last_event_seq)],
                    )
                    .map_err(|e| StoreError::sqlite("move past lost events", e))?;
                    lost.push((issue, first_event_seq, last_event_seq));
                }
            }
        }
        let mut opened = 0usize;
        for (new, id) in incidents.iter().zip(ids) {
            let open: bool = tx
                .query_row_cached(
                    "SELECT EXISTS (SELECT 1 FROM storage_incidents
                     WHERE state = 1 AND kind = ?1 AND scope_kind = ?2 AND scope_key = ?3)",
                    params![new.kind as i32, new.scope_kind as i32, new.scope_key],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::sqlite("find open incident", e))?;
            if !open {
                crate::incidents::insert(&tx, id, new, now_ms)?;
                opened += 1;
            }
        }
        for (issue, first, last) in &lost {
            // the incident the round opened (or found open) for it
            let incident: Option<Vec<u8>> = tx
                .query_row_cached(
                    "SELECT incident_id FROM storage_incidents
                     WHERE state = 1 AND kind = ?1 AND issue_uuid = ?2
                     ORDER BY detected_ms DESC LIMIT 1",
                    params![
                        wire::IncidentKind::ReconciliationContradiction as i32,
                        issue.as_slice()
                    ],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("find the loss incident", e))?;
            tx.execute_cached(
                "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
                     source, reason, incident_id, recorded_ms)
                 VALUES (?1, ?2, ?3, NULL, NULL, ?4, ?5, ?6, ?7)",
                params![
                    issue.as_slice(),
                    to_i64(*first),
                    to_i64(*last),
                    wire::TruncationSource::StorageLoss as i32,
                    rvbox_store_port::commands::LOST_AT_RECONCILE_REASON,
                    incident,
                    now_ms
                ],
            )
            .map_err(|e| StoreError::sqlite("record lost events", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit reconciliation", e))?;
        self.hook.at(crate::crash::points::RECONCILE_AFTER_COMMIT);
        if opened > 0 {
            self.health.refresh(&self.conn)?;
        }
        for (issue, first, last) in &lost {
            self.metrics.events_lost_at_reconcile.inc();
            tracing::error!(
                issue_uuid = %uuid::Uuid::from_bytes(*issue),
                first_event_seq = first,
                last_event_seq = last,
                "events the client had acknowledged are not in the store; recorded as lost"
            );
        }
        for w in writes {
            match w {
                ReconcileWrite::Requeue { .. } | ReconcileWrite::LostEvents { .. } => {}
                ReconcileWrite::Advance { to, .. } => self.metrics.command_transition(to.as_str()),
                ReconcileWrite::Interrupt { .. } => self.metrics.command_transition("interrupted"),
            }
        }
        for (to, revision) in requeued {
            self.note_requeue(to, revision);
        }
        tracing::info!(
            client_id,
            writes = writes.len(),
            incidents = opened,
            "reconciliation applied"
        );
        Ok(opened)
    }

    /// Records a protocol incident (late after expiry, stale server, client
    /// state loss, reconciliation contradiction) against a command or a
    /// client; returns its id.
    ///
    /// # Errors
    /// A store failure.
    pub fn record_protocol_incident(
        &mut self,
        incident: &NewIncident,
        now_ms: i64,
    ) -> Result<[u8; 16], StoreError> {
        self.record_incident(incident, now_ms, false)
    }
}

/// True when the command holds a pending signal: work that goes back to
/// the queue with one is cancelled instead (launch was never authorized,
/// plan §6.4 R-6.4-37).
fn has_pending_signal(tx: &Transaction<'_>, issue: &[u8; 16]) -> Result<bool, StoreError> {
    tx.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM command_signals WHERE issue_uuid = ?1)",
        params![issue.as_slice()],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("look up pending signals", e))
}

/// dispatched -> queued at `revision`, inside the caller's transaction:
/// the client certainly does not hold the command. If a signal is pending
/// for it, launch was never authorized and the command ends `cancelled`
/// instead (plan §6.4, R-6.4-37). Returns the lifecycle it moved to.
pub(crate) fn requeue_in(
    tx: &Transaction<'_>,
    view: &CommandView,
    revision: u64,
    now_ms: i64,
    cap: u64,
) -> Result<Lifecycle, OpError> {
    expect(view, &[Lifecycle::Dispatched], revision)?;
    clear_expired_pending(tx, &view.issue_uuid)?;
    if has_pending_signal(tx, &view.issue_uuid)? {
        finish_in(
            tx,
            &view.issue_uuid,
            view,
            Lifecycle::Cancelled,
            None,
            now_ms,
            cap,
        )?;
        return Ok(Lifecycle::Cancelled);
    }
    set_lifecycle(tx, &view.issue_uuid, Lifecycle::Queued)?;
    Ok(Lifecycle::Queued)
}

/// dispatched -> accepted at `revision` with the client's resolved shell,
/// inside the caller's transaction.
pub(crate) fn accept_in(
    tx: &rusqlite::Connection,
    view: &CommandView,
    revision: u64,
    resolved_shell: i32,
) -> Result<(), OpError> {
    expect(view, &[Lifecycle::Dispatched], revision)?;
    set_lifecycle(tx, &view.issue_uuid, Lifecycle::Accepted)?;
    tx.execute_cached(
        "UPDATE commands SET resolved_shell = ?2 WHERE issue_uuid = ?1",
        params![view.issue_uuid.as_slice(), resolved_shell],
    )
    .map_err(|e| StoreError::sqlite("record resolved shell", e))?;
    Ok(())
}

/// The terminal write of a server decision, inside the caller's
/// transaction: lifecycle and terminal time, rejection reason, closeout
/// headroom released, replay tombstone.
pub(crate) fn finish_in(
    tx: &Transaction<'_>,
    issue: &[u8; 16],
    view: &CommandView,
    to: Lifecycle,
    rejection: Option<&wire::ErrorDetail>,
    now_ms: i64,
    cap: u64,
) -> Result<(), StoreError> {
    let (charged, held): (i64, i64) = tx
        .query_row_cached(
            "SELECT charged_bytes, closeout_held FROM commands WHERE issue_uuid = ?1",
            params![issue.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(|e| StoreError::sqlite("load command usage", e))?;
    let usage = Usage {
        command: to_u64(charged),
        held_closeout: to_u64(held),
        owner: crate::store::client_charged(tx, &view.client_id)?,
        global: crate::store::global_charged(tx)?,
        free_space: 0,
    };
    let after = release_closeout(&usage).map_err(|e| StoreError::Integrity(e.to_string()))?;
    tx.execute_cached(
        "UPDATE commands SET lifecycle = ?2, terminal_time_ms = MAX(?3, issue_time_ms),
                 rejection = COALESCE(?4, rejection), charged_bytes = ?5, closeout_held = 0,
                 output_charged = MIN(output_charged, ?5)
             WHERE issue_uuid = ?1",
        params![
            issue.as_slice(),
            to.to_wire() as i32,
            now_ms,
            rejection.map(prost::Message::encode_to_vec),
            to_i64(after.command)
        ],
    )
    .map_err(|e| StoreError::sqlite("finish command", e))?;
    crate::stdin::discard_pending(tx, issue)?;
    crate::store::apply_owner_global(tx, &view.client_id, after.owner, after.global)?;
    crate::events::insert_tombstone_row(
        tx,
        issue,
        &view.request_hash,
        &view.client_id,
        to,
        now_ms,
        cap,
    )?;
    Ok(())
}

/// The encoded rejection stored on a command, decoded.
///
/// # Errors
/// [`StoreError::Integrity`] when the stored bytes do not decode.
pub fn decode_rejection(bytes: &[u8]) -> Result<wire::ErrorDetail, StoreError> {
    wire::ErrorDetail::decode(bytes)
        .map_err(|_| StoreError::Integrity("stored rejection does not decode".into()))
}
