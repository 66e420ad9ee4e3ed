//! Client registration, sessions and takeover grants (plan §6.2, §5.2
//! `clients`, `sessions`, `takeover_authorizations`).
//!
//! The session core decides (`rvbox-session`): accept with a new generation,
//! fencing a prior session and consuming a grant, or reject a live conflict
//! and record the pending claim. This module makes each decision durable in
//! one transaction, and re-checks in that transaction what the decision
//! was based on (the generation, the live session, the grant), so a decision
//! taken on a stale view is refused with `CONFLICT` and nothing changes.
//! Only after [`Store::register_session`] returns may a welcome be sent.

use crate::audit::{AuditIntent, AuditRecord};
use crate::db::Cached as _;
use prost::Message as _;
use rusqlite::{OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::request_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

use crate::error::StoreError;
use crate::mutations::{self, Assigned, OpError, Owner, Stored};
use crate::store::{Store, to_i64, to_u64};

/// Longest close reason kept (the column's bound).
pub const MAX_CLOSE_REASON_BYTES: usize = 4096;

pub use rvbox_store_port::sessions::{
    ClientRecord, LiveSession, Registration, SessionFence, TakeoverGrant,
};

/// The fencing check of a write made for a connection (docs/scaleout.md):
/// the write's session must still be its client's live one, and belong to
/// `client_id`, the client of what the write changes. Run inside the
/// write's own transaction, so the answer holds when it commits. `None`
/// is a write not made for a connection: nothing to check.
///
/// # Errors
/// `STALE_SESSION` when the session ended, was fenced by a newer one, or
/// belongs to another client; a store failure.
pub(crate) fn check_fence(
    conn: &rusqlite::Connection,
    fenced: &prometheus_client::metrics::counter::Counter,
    fence: Option<&SessionFence>,
    client_id: &str,
) -> Result<(), OpError> {
    let Some(fence) = fence else {
        return Ok(());
    };
    fence_verdict(
        fenced,
        live_session_owner(conn, fence)?.as_deref(),
        client_id,
    )
    .map_err(OpError::Refused)
}

/// The client whose live session `fence` names, if it is live.
pub(crate) fn live_session_owner(
    conn: &rusqlite::Connection,
    fence: &SessionFence,
) -> Result<Option<String>, StoreError> {
    conn.query_row_cached(
        "SELECT client_id FROM sessions WHERE session_id = ?1 AND live = 1",
        params![fence.session_id.as_slice()],
        |r| r.get(0),
    )
    .optional()
    .map_err(|e| StoreError::sqlite("check the write's session", e))
}

/// The fencing verdict from a session's live owner (`None`: not live).
pub(crate) fn fence_verdict(
    fenced: &prometheus_client::metrics::counter::Counter,
    owner: Option<&str>,
    client_id: &str,
) -> Result<(), DomainError> {
    let verdict = match owner {
        Some(owner) if owner == client_id => Ok(()),
        Some(_) => Err(DomainError::new(
            Code::StaleSession,
            "the write's session belongs to another client",
        )),
        None => Err(DomainError::new(
            Code::StaleSession,
            "the write's session is no longer its client's live session",
        )),
    };
    if let Err(e) = &verdict {
        fenced.inc();
        tracing::warn!(
            reason = e.reason(),
            "write refused: its session is not live"
        );
    }
    verdict
}

fn blob16(v: Option<Vec<u8>>) -> Option<[u8; 16]> {
    v.and_then(|b| <[u8; 16]>::try_from(b.as_slice()).ok())
}

fn conflict(reason: &str) -> OpError {
    OpError::Refused(DomainError::new(Code::Conflict, reason))
}

/// `clients` columns: instance, generation, pending instance, pending time.
type ClientRow = (Option<Vec<u8>>, i64, Option<Vec<u8>>, Option<i64>);

fn load(tx: &rusqlite::Connection, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
    let row: Option<ClientRow> = tx
        .query_row_cached(
            "SELECT instance_id, generation, pending_instance_id, pending_seen_ms
             FROM clients WHERE client_id = ?1",
            params![client_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("load client", e))?;
    let Some((instance, generation, pending, pending_ms)) = row else {
        return Ok(None);
    };
    let live = tx
        .query_row_cached(
            "SELECT session_id, instance_id, generation, opened_ms FROM sessions
             WHERE client_id = ?1 AND live = 1",
            params![client_id],
            |r| {
                Ok((
                    r.get::<_, Vec<u8>>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            },
        )
        .optional()
        .map_err(|e| StoreError::sqlite("load live session", e))?
        .and_then(|(s, i, g, o)| {
            Some(LiveSession {
                session_id: blob16(Some(s))?,
                instance_id: blob16(Some(i))?,
                generation: to_u64(g),
                opened_ms: o,
            })
        });
    let grant = tx
        .query_row_cached(
            "SELECT id, instance_id, created_ms, expires_ms FROM takeover_authorizations
             WHERE client_id = ?1 AND consumed_ms IS NULL AND voided_ms IS NULL",
            params![client_id],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            },
        )
        .optional()
        .map_err(|e| StoreError::sqlite("load takeover grant", e))?
        .and_then(|(id, i, c, x)| {
            Some(TakeoverGrant {
                id,
                instance_id: blob16(Some(i))?,
                created_ms: c,
                expires_ms: x,
            })
        });
    Ok(Some(ClientRecord {
        client_id: client_id.to_owned(),
        instance_id: blob16(instance),
        generation: to_u64(generation),
        live,
        pending_claim: blob16(pending).zip(pending_ms),
        grant,
    }))
}

/// The detail of a registration's audit record. Pure: every store backend
/// records a registration so.
#[must_use]
pub fn registered_detail(reg: &Registration, generation: u64) -> String {
    format!(
        "generation {generation}{}{}",
        if reg.fence.is_some() {
            ", previous session fenced"
        } else {
            ""
        },
        if reg.consume_grant.is_some() {
            ", takeover grant consumed"
        } else {
            ""
        }
    )
}

fn end_session(
    tx: &Transaction<'_>,
    session_id: &[u8; 16],
    fenced: bool,
    reason: &str,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let reason: String = reason.chars().take(MAX_CLOSE_REASON_BYTES / 4).collect();
    let n = tx
        .execute_cached(
            "UPDATE sessions SET live = 0, closed_ms = ?2,
                 fenced_ms = CASE WHEN ?3 THEN ?2 ELSE fenced_ms END, close_reason = ?4
             WHERE session_id = ?1 AND live = 1",
            params![session_id.as_slice(), now_ms, fenced, reason],
        )
        .map_err(|e| StoreError::sqlite("end session", e))?;
    Ok(n == 1)
}

impl Store {
    /// The client's registration state, or `None` for a client never seen.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn client_record(&self, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
        load(&self.conn, client_id)
    }

    /// Makes an accepted registration durable (plan §6.2, R-6.2-03/04/07):
    /// in one transaction, checks that the generation, the live session and
    /// the grant are still what the decision saw, fences the prior session,
    /// consumes the grant, stores the client's capabilities and instance,
    /// clears a pending claim of this instance, increments the generation
    /// and installs the new live session. Returns the new generation; only
    /// now may the welcome be sent.
    ///
    /// # Errors
    /// `CONFLICT` when the state changed since the decision (nothing
    /// written), `UNAVAILABLE` when the client's scope is not writable, or
    /// a store failure.
    pub fn register_session(&mut self, reg: &Registration, now_ms: i64) -> Result<u64, OpError> {
        self.health
            .check_writable(&[(wire::ScopeKind::Client, reg.client_id.as_str())])?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin registration", e))?;
        let current = load(&tx, &reg.client_id)?;
        let generation = current.as_ref().map_or(0, |c| c.generation);
        if generation != reg.expected_generation {
            return Err(conflict(
                "the client's generation changed since the registration was decided",
            ));
        }
        let live = current.as_ref().and_then(|c| c.live);
        if live.map(|l| l.session_id) != reg.fence {
            return Err(conflict(
                "the client's live session changed since the registration was decided",
            ));
        }
        if let Some(id) = reg.consume_grant {
            let ok = current.as_ref().and_then(|c| c.grant).is_some_and(|g| {
                g.id == id && g.instance_id == reg.instance_id && now_ms < g.expires_ms
            });
            if !ok {
                return Err(conflict(
                    "the takeover grant is no longer live, expired, or names another instance",
                ));
            }
            tx.execute_cached(
                "UPDATE takeover_authorizations SET consumed_ms = ?2 WHERE id = ?1",
                params![id, now_ms],
            )
            .map_err(|e| StoreError::sqlite("consume takeover grant", e))?;
        }
        if let Some(old) = reg.fence {
            end_session(&tx, &old, true, "fenced by a newer registration", now_ms)?;
        }
        // a client id without a row starts above every pruned client's
        // generation (its row, created below, starts at that floor)
        let base = match &current {
            Some(c) => c.generation,
            None => crate::registry::generation_floor(&tx)?,
        };
        let next = base
            .checked_add(1)
            .ok_or_else(|| StoreError::Integrity("client generation overflow".into()))?;
        let caps = reg.capabilities.encode_to_vec();
        let cwd = reg.cwd_policy.as_ref().map(prost::Message::encode_to_vec);
        let platform = reg
            .capabilities
            .platform
            .as_ref()
            .map(|p| format!("{}/{}", p.os, p.arch));
        crate::registry::ensure_client(&tx, &reg.client_id, self.opts.registry_limit())?;
        tx.execute_cached(
            "UPDATE clients SET instance_id = ?2, generation = ?3, platform = ?4,
                 software_version = ?5, capabilities = ?6, cwd_policy = ?7,
                 connected_ms = ?8, last_seen_ms = ?8, labels = ?9,
                 pending_instance_id = CASE WHEN pending_instance_id = ?2 THEN NULL ELSE pending_instance_id END,
                 pending_seen_ms = CASE WHEN pending_instance_id = ?2 THEN NULL ELSE pending_seen_ms END
             WHERE client_id = ?1",
            params![
                reg.client_id,
                reg.instance_id.as_slice(),
                to_i64(next),
                platform,
                reg.capabilities.software_version,
                caps,
                cwd,
                now_ms,
                reg.labels
            ],
        )
        .map_err(|e| StoreError::sqlite("update client registration", e))?;
        tx.execute_cached(
            "INSERT INTO sessions (session_id, client_id, instance_id, generation, opened_ms, live)
             VALUES (?1, ?2, ?3, ?4, ?5, 1)",
            params![
                reg.session_id.as_slice(),
                reg.client_id,
                reg.instance_id.as_slice(),
                to_i64(next),
                now_ms
            ],
        )
        .map_err(|e| StoreError::sqlite("install session", e))?;
        let pruned = crate::registry::prune_sessions(&tx, &reg.client_id)?;
        // a fleet run waiting for late clients takes this one if it matches
        crate::fleet::add_late_targets_in(&tx, &reg.client_id, &reg.labels, now_ms)?;
        // plan §5.2: the session's audit records commit with it
        let mut fenced_intent = reg.fence.map(|_| {
            AuditIntent::session(AuditRecord::session(
                Some(&reg.client_id),
                "SessionFenced",
                format!("fenced by the registration of generation {next}"),
                now_ms,
            ))
        });
        if let Some(intent) = fenced_intent.as_mut() {
            intent.write_in(&tx, Ok(()))?;
        }
        let mut intent = AuditIntent::session(AuditRecord::session(
            Some(&reg.client_id),
            "SessionRegistered",
            registered_detail(reg, next),
            now_ms,
        ));
        intent.write_in(&tx, Ok(()))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit registration", e))?;
        if let Some(mut f) = fenced_intent {
            self.audit_unwritten(&mut f, &Ok::<(), OpError>(()), now_ms);
        }
        self.audit_unwritten(&mut intent, &Ok::<(), OpError>(()), now_ms);
        self.hook.at(crate::crash::points::REGISTER_AFTER_COMMIT);
        self.metrics.sessions_registered.inc();
        self.metrics.sessions_pruned.inc_by(pruned);
        if reg.fence.is_some() {
            self.metrics.sessions_fenced.inc();
        }
        tracing::info!(
            client_id = %reg.client_id,
            generation = next,
            fenced = reg.fence.is_some(),
            takeover = reg.consume_grant.is_some(),
            "session registered"
        );
        Ok(next)
    }

    /// Records a rejected live-conflict claim (plan §6.2, R-6.2-06): the
    /// exact instance and when it was seen, durable before the candidate's
    /// socket is closed. The latest claim replaces an earlier one.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the client's scope is not writable, or a store
    /// failure.
    pub fn record_pending_claim(
        &mut self,
        client_id: &str,
        instance_id: &[u8; 16],
        now_ms: i64,
    ) -> Result<(), OpError> {
        self.health
            .check_writable(&[(wire::ScopeKind::Client, client_id)])?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin pending claim", e))?;
        crate::registry::ensure_client(&tx, client_id, self.opts.registry_limit())?;
        tx.execute_cached(
            "UPDATE clients SET pending_instance_id = ?2, pending_seen_ms = ?3 WHERE client_id = ?1",
            params![client_id, instance_id.as_slice(), now_ms],
        )
        .map_err(|e| StoreError::sqlite("record pending claim", e))?;
        let mut intent = AuditIntent::session(AuditRecord::session(
            Some(client_id),
            "LiveConflictRefused",
            "another instance's session is live; the claim is recorded for takeover",
            now_ms,
        ));
        intent.write_in(&tx, Ok(()))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit pending claim", e))?;
        self.audit_unwritten(&mut intent, &Ok::<(), OpError>(()), now_ms);
        self.hook.at(crate::crash::points::CLAIM_AFTER_COMMIT);
        self.metrics.live_conflicts.inc();
        tracing::warn!(
            client_id,
            "live-conflict registration rejected; claim recorded"
        );
        Ok(())
    }

    /// Session audit records that no effect carries (a rejected hello,
    /// traffic of an unknown session), in one transaction. Best effort: a
    /// full outbox drops them, counted.
    ///
    /// # Errors
    /// A store failure.
    pub fn session_audits(
        &mut self,
        records: &[rvbox_store_port::audit::SessionAudit],
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin session audit", e))?;
        let mut intents = Vec::with_capacity(records.len());
        for r in records {
            let rec = AuditRecord::of_edge(r, now_ms);
            let refused = rec
                .error_code
                .and_then(rvbox_domain::error::Code::from_wire)
                .map(|code| rvbox_domain::error::DomainError::new(code, r.detail.clone()));
            let mut i = AuditIntent::session(rec);
            i.write_in(&tx, refused.as_ref().map_or(Ok(()), Err))
                .map_err(|e| match e {
                    OpError::Store(e) => e,
                    OpError::Refused(d) => StoreError::Integrity(d.to_string()),
                })?;
            intents.push(i);
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit session audit", e))?;
        for mut i in intents {
            self.audit_unwritten(&mut i, &Ok::<(), OpError>(()), now_ms);
        }
        Ok(())
    }

    /// Ends a live session (closed, or `fenced`). Returns whether it was
    /// live. Idempotent.
    ///
    /// # Errors
    /// A store failure.
    pub fn close_session(
        &mut self,
        session_id: &[u8; 16],
        fenced: bool,
        reason: &str,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin session close", e))?;
        let ended = end_session(&tx, session_id, fenced, reason, now_ms)?;
        let mut intent = None;
        if ended {
            tx.execute_cached(
                "UPDATE clients SET last_seen_ms = ?2
                 WHERE client_id = (SELECT client_id FROM sessions WHERE session_id = ?1)",
                params![session_id.as_slice(), now_ms],
            )
            .map_err(|e| StoreError::sqlite("update last seen", e))?;
            let client: Option<String> = tx
                .query_row_cached(
                    "SELECT client_id FROM sessions WHERE session_id = ?1",
                    params![session_id.as_slice()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("read session client", e))?;
            let mut i = AuditIntent::session(AuditRecord::session(
                client.as_deref(),
                if fenced {
                    "SessionFenced"
                } else {
                    "SessionClosed"
                },
                reason,
                now_ms,
            ));
            i.write_in(&tx, Ok(())).map_err(|e| match e {
                OpError::Store(e) => e,
                OpError::Refused(d) => StoreError::Integrity(d.to_string()),
            })?;
            intent = Some(i);
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit session close", e))?;
        if let Some(mut i) = intent {
            self.audit_unwritten(&mut i, &Ok::<(), OpError>(()), now_ms);
        }
        self.hook
            .at(crate::crash::points::SESSION_CLOSE_AFTER_COMMIT);
        if ended {
            tracing::info!(fenced, reason, "session closed");
        }
        Ok(ended)
    }

    /// `AuthorizeClientTakeover` (plan §6.2, R-6.2-11): the instance must
    /// be exactly the client's pending claim; stores a one-shot grant for it
    /// expiring `ttl_ms` from now, replacing (voiding) an earlier live
    /// grant, and fences nothing. Idempotent by `request_id`: a replay
    /// returns the same grant, the same id with another request is
    /// `CONFLICT`.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown client, `FAILED_PRECONDITION` when the
    /// instance is not the pending claim, `CONFLICT`, or a store failure.
    pub fn authorize_takeover(
        &mut self,
        request_id: &Uuid7,
        client_id: &str,
        instance_id: &[u8; 16],
        ttl_ms: u64,
        now_ms: i64,
    ) -> Result<TakeoverGrant, OpError> {
        self.authorize_takeover_in(request_id, client_id, instance_id, ttl_ms, now_ms, None)
    }

    /// [`Self::authorize_takeover`] for an operator: the audit record
    /// naming `caller` is written in the transaction of the grant, and
    /// on its own after a refusal (plan §5.5).
    ///
    /// # Errors
    /// As [`Self::authorize_takeover`].
    pub fn authorize_takeover_as(
        &mut self,
        request_id: &Uuid7,
        client_id: &str,
        instance_id: &[u8; 16],
        ttl_ms: u64,
        caller: &crate::operator::Caller,
        now_ms: i64,
    ) -> Result<TakeoverGrant, OpError> {
        let mut rec = crate::audit::AuditRecord::control(caller, "AuthorizeClientTakeover", now_ms);
        rec.client_id = Some(client_id.to_owned());
        rec.detail = format!(
            "instance {}",
            uuid::Uuid::from_bytes(*instance_id).hyphenated()
        );
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = self.authorize_takeover_in(
            request_id,
            client_id,
            instance_id,
            ttl_ms,
            now_ms,
            Some(&mut intent),
        );
        self.audit_unwritten(&mut intent, &result, now_ms);
        result
    }

    fn authorize_takeover_in(
        &mut self,
        request_id: &Uuid7,
        client_id: &str,
        instance_id: &[u8; 16],
        ttl_ms: u64,
        now_ms: i64,
        audit: Option<&mut crate::audit::AuditIntent>,
    ) -> Result<TakeoverGrant, OpError> {
        self.health
            .check_writable(&[(wire::ScopeKind::Client, client_id)])?;
        let request = wire::AuthorizeClientTakeoverRequest {
            request_id: String::new(),
            client_id: client_id.to_owned(),
            client_instance_id: uuid::Uuid::from_bytes(*instance_id)
                .hyphenated()
                .to_string(),
        };
        let hash = request_hash("AuthorizeClientTakeover", &request);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin takeover grant", e))?;
        let owner = Owner::Client(client_id);
        if let Some(stored) =
            mutations::lookup(&tx, request_id, "AuthorizeClientTakeover", &hash, owner)?
        {
            return match stored {
                Ok(bytes) => decode_grant(&bytes),
                Err(detail) => Err(OpError::Refused(crate::incidents::detail_to_error(&detail))),
            };
        }
        let Some(record) = load(&tx, client_id)? else {
            return Err(OpError::Refused(
                DomainError::new(Code::NotFound, "no such client").with_field("client_id"),
            ));
        };
        if record.pending_claim.map(|p| p.0) != Some(*instance_id) {
            // never broadened to "the next instance" (R-6.2-12)
            let refusal = DomainError::new(
                Code::FailedPrecondition,
                "client_instance_id is not the client's pending claim",
            )
            .with_field("client_instance_id");
            let stored: Stored = Err(refusal.to_detail());
            mutations::record(
                &tx,
                request_id,
                "AuthorizeClientTakeover",
                &hash,
                owner,
                &stored,
                Assigned::default(),
                now_ms,
            )?;
            tx.commit()
                .map_err(|e| StoreError::sqlite("commit takeover refusal", e))?;
            self.hook.at(crate::crash::points::TAKEOVER_AFTER_COMMIT);
            return Err(OpError::Refused(refusal));
        }
        tx.execute_cached(
            "UPDATE takeover_authorizations SET voided_ms = ?2
             WHERE client_id = ?1 AND consumed_ms IS NULL AND voided_ms IS NULL",
            params![client_id, now_ms],
        )
        .map_err(|e| StoreError::sqlite("void earlier grant", e))?;
        let expires = now_ms.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX).max(1));
        tx.execute_cached(
            "INSERT INTO takeover_authorizations (client_id, instance_id, created_ms, expires_ms, request_id)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                client_id,
                instance_id.as_slice(),
                now_ms,
                expires,
                request_id.as_bytes().as_slice()
            ],
        )
        .map_err(|e| StoreError::sqlite("insert takeover grant", e))?;
        let grant = TakeoverGrant {
            id: tx.last_insert_rowid(),
            instance_id: *instance_id,
            created_ms: now_ms,
            expires_ms: expires,
        };
        let stored: Stored = Ok(encode_grant(&grant));
        mutations::record(
            &tx,
            request_id,
            "AuthorizeClientTakeover",
            &hash,
            owner,
            &stored,
            Assigned::default(),
            now_ms,
        )?;
        if let Some(a) = audit {
            a.write_in(&tx, Ok(()))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit takeover grant", e))?;
        self.hook.at(crate::crash::points::TAKEOVER_AFTER_COMMIT);
        tracing::info!(client_id, "takeover grant stored");
        Ok(grant)
    }
}

/// The stored result of a grant: id, instance, created, expires.
#[must_use]
pub fn encode_grant(g: &TakeoverGrant) -> Vec<u8> {
    let mut out = Vec::with_capacity(40);
    out.extend_from_slice(&g.id.to_le_bytes());
    out.extend_from_slice(&g.instance_id);
    out.extend_from_slice(&g.created_ms.to_le_bytes());
    out.extend_from_slice(&g.expires_ms.to_le_bytes());
    out
}

/// A stored grant, decoded.
///
/// # Errors
/// When the stored bytes are malformed.
pub fn decode_grant(b: &[u8]) -> Result<TakeoverGrant, OpError> {
    let bad = || {
        OpError::Store(StoreError::Integrity(
            "stored takeover grant is malformed".into(),
        ))
    };
    let i64_at = |at: usize| -> Result<i64, OpError> {
        b.get(at..at + 8)
            .and_then(|s| <[u8; 8]>::try_from(s).ok())
            .map(i64::from_le_bytes)
            .ok_or_else(bad)
    };
    Ok(TakeoverGrant {
        id: i64_at(0)?,
        instance_id: b
            .get(8..24)
            .and_then(|s| <[u8; 16]>::try_from(s).ok())
            .ok_or_else(bad)?,
        created_ms: i64_at(24)?,
        expires_ms: i64_at(32)?,
    })
}
