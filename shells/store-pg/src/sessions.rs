//! Client registration, sessions and the fencing check on PostgreSQL
//! (as `rvbox_store::sessions` does it on SQLite).
//!
//! A registration locks its client's row (`FOR UPDATE`, created first if
//! the client is new) before it re-checks what the decision saw, so two
//! replicas registering the same client serialise on that row and the
//! second sees the first's generation and refuses `CONFLICT`.

use postgres::Transaction;
use postgres::types::ToSql;
use rvbox_domain::error::Code;
use rvbox_store::audit::AuditRecord;
use rvbox_store::registry::{
    CLIENT_ROW_CHARGE, CLOSED_SESSIONS_KEPT, SESSION_ROW_CHARGE, admit_new_client,
};
use rvbox_store::sessions::{MAX_CLOSE_REASON_BYTES, registered_detail};
use rvbox_store_port::audit::SessionAudit;
use rvbox_store_port::sessions::{
    ClientRecord, LiveSession, Registration, SessionFence, TakeoverGrant,
};

use crate::audit::write_in;
use crate::{Fail, PgStore, StoreOptions};

pub(crate) fn blob16(v: Option<Vec<u8>>) -> Option<[u8; 16]> {
    v.and_then(|b| <[u8; 16]>::try_from(b.as_slice()).ok())
}

pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn conflict(reason: &str) -> Fail {
    Fail::refused(Code::Conflict, reason)
}

/// The client's record as the registration decision needs it; `lock`
/// takes its row `FOR UPDATE` first.
fn load(
    tx: &mut Transaction<'_>,
    client_id: &str,
    lock: bool,
) -> Result<Option<ClientRecord>, Fail> {
    let sql = if lock {
        "SELECT instance_id, generation, pending_instance_id, pending_seen_ms
         FROM clients WHERE client_id = $1 FOR UPDATE"
    } else {
        "SELECT instance_id, generation, pending_instance_id, pending_seen_ms
         FROM clients WHERE client_id = $1"
    };
    let Some(row) = tx
        .query_opt(sql, &[&client_id])
        .map_err(Fail::db("load client"))?
    else {
        return Ok(None);
    };
    let instance: Option<Vec<u8>> = row.get(0);
    let generation: i64 = row.get(1);
    let pending: Option<Vec<u8>> = row.get(2);
    let pending_ms: Option<i64> = row.get(3);
    let live = crate::prep::query_opt(
        tx,
        "SELECT session_id, instance_id, generation, opened_ms FROM sessions
             WHERE client_id = $1 AND live",
        &[&client_id],
    )
    .map_err(Fail::db("load live session"))?
    .and_then(|r| {
        Some(LiveSession {
            session_id: blob16(r.get(0))?,
            instance_id: blob16(r.get(1))?,
            generation: to_u64(r.get(2)),
            opened_ms: r.get(3),
        })
    });
    let grant = crate::prep::query_opt(
        tx,
        "SELECT id, instance_id, created_ms, expires_ms FROM takeover_authorizations
             WHERE client_id = $1 AND consumed_ms IS NULL AND voided_ms IS NULL",
        &[&client_id],
    )
    .map_err(Fail::db("load takeover grant"))?
    .and_then(|r| {
        Some(TakeoverGrant {
            id: r.get(0),
            instance_id: blob16(r.get(1))?,
            created_ms: r.get(2),
            expires_ms: r.get(3),
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

/// Everything charged against the server-wide tier.
pub(crate) fn global_charged(tx: &mut Transaction<'_>) -> Result<u64, Fail> {
    // one read of the totals row: the commands' bytes and the registry's
    let row = crate::prep::query_one(
        tx,
        "SELECT command_charged, clients, sessions FROM quota_totals WHERE id = 1",
        &[],
    )
    .map_err(Fail::db("read global usage"))?;
    let (v, c, s): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    Ok(to_u64(v).saturating_add(
        to_u64(c)
            .saturating_mul(CLIENT_ROW_CHARGE)
            .saturating_add(to_u64(s).saturating_mul(SESSION_ROW_CHARGE)),
    ))
}

/// Makes sure the client's row exists, admitting a new client only within
/// the registry's bounds (as the SQLite store's `ensure_client`). A new
/// row is inserted `ON CONFLICT DO NOTHING`: a replica creating the same
/// client at the same moment leaves one row.
pub(crate) fn ensure_client(
    tx: &mut Transaction<'_>,
    client_id: &str,
    opts: &StoreOptions,
) -> Result<(), Fail> {
    let exists = crate::prep::query_opt(
        tx,
        "SELECT 1 FROM clients WHERE client_id = $1",
        &[&client_id],
    )
    .map_err(Fail::db("look up client"))?
    .is_some();
    if exists {
        return Ok(());
    }
    let clients: i64 =
        crate::prep::query_one(tx, "SELECT clients FROM quota_totals WHERE id = 1", &[])
            .map_err(Fail::db("read registry counts"))?
            .get(0);
    let used = global_charged(tx)?;
    admit_new_client(to_u64(clients), used, opts.registry_limit())?;
    crate::prep::execute(
        tx,
        "INSERT INTO clients (client_id, generation)
         VALUES ($1, (SELECT generation_floor FROM quota_totals WHERE id = 1))
         ON CONFLICT (client_id) DO NOTHING",
        &[&client_id],
    )
    .map_err(Fail::db("register client"))?;
    Ok(())
}

fn end_session(
    tx: &mut Transaction<'_>,
    session_id: &[u8; 16],
    fenced: bool,
    reason: &str,
    now_ms: i64,
) -> Result<bool, Fail> {
    let reason: String = reason.chars().take(MAX_CLOSE_REASON_BYTES / 4).collect();
    let n = crate::prep::execute(
        tx,
        "UPDATE sessions SET live = false, closed_ms = $2,
                 fenced_ms = CASE WHEN $3 THEN $2 ELSE fenced_ms END, close_reason = $4
             WHERE session_id = $1 AND live",
        &[&session_id.as_slice(), &now_ms, &fenced, &reason],
    )
    .map_err(Fail::db("end session"))?;
    Ok(n == 1)
}

/// The fencing check of a write made for a connection (docs/scaleout.md),
/// the first statement of the write's transaction: the session's row is
/// locked `FOR SHARE` until the transaction ends, so a registration that
/// would fence it waits for this write, and a write after that
/// registration sees the session ended. `None`: not made for a connection.
pub(crate) fn check_fence(
    tx: &mut Transaction<'_>,
    fence: Option<SessionFence>,
    client_id: &str,
) -> Result<(), Fail> {
    let Some(fence) = fence else {
        return Ok(());
    };
    // the session row is locked against a registration that would fence
    // it; a session owned by a replica counts only while that replica's
    // lease is live (a paused replica that wakes past its lease commits
    // nothing for its old sessions, even before the janitor ends them)
    let owner: Option<(String, bool)> = crate::prep::query_opt(
        tx,
        "SELECT s.client_id,
                    s.owner_replica IS NULL OR EXISTS (
                        SELECT 1 FROM replicas r
                        WHERE r.replica_id = s.owner_replica AND r.epoch = s.owner_epoch
                          AND r.lease_expires > now())
             FROM sessions s WHERE s.session_id = $1 AND s.live FOR SHARE OF s",
        &[&fence.session_id.as_slice()],
    )
    .map_err(Fail::db("check the write's session"))?
    .map(|r| (r.get(0), r.get(1)));
    let refusal = match owner {
        Some((owner, true)) if owner == client_id => return Ok(()),
        Some((owner, false)) if owner == client_id => {
            "the write's session belongs to a server replica whose lease ended"
        }
        Some(_) => "the write's session belongs to another client",
        None => "the write's session is no longer its client's live session",
    };
    tracing::warn!(reason = refusal, "write refused: its session is not live");
    Err(Fail::refused(Code::StaleSession, refusal))
}

impl PgStore {
    /// The client's registration state, or `None` for a client never seen.
    pub(crate) fn client_record(&mut self, client_id: &str) -> Result<Option<ClientRecord>, Fail> {
        self.in_tx("load client", |tx, _| load(tx, client_id, false))
    }

    /// Makes an accepted registration durable, as the SQLite store's
    /// `register_session`: re-checks generation, live session and grant on
    /// the locked client row, fences the prior session, consumes the
    /// grant, records capabilities, raises the generation, installs the
    /// new live session, prunes old closed sessions, and writes the audit
    /// records, in one transaction.
    pub(crate) fn register_session(
        &mut self,
        reg: &Registration,
        now_ms: i64,
    ) -> Result<u64, Fail> {
        let owner = self.replica;
        let next = self.in_tx("register session", |tx, opts| {
            crate::incidents::check_writable(tx, &[(rvbox_proto::v1::ScopeKind::Client, reg.client_id.as_str())])?;
            // a replica registers only while its lease is live
            if let Some(r) = owner {
                let live = crate::prep::query_opt(tx, "SELECT 1 FROM replicas
                         WHERE replica_id = $1 AND epoch = $2 AND lease_expires > now()",
                        &[&r.id.as_slice(), &to_i64(r.epoch)],
                    )
                    .map_err(Fail::db("check the replica lease"))?
                    .is_some();
                if !live {
                    return Err(Fail::Fenced(
                        "this server replica's lease ended; it registers no session",
                    ));
                }
            }
            // the client's row, locked: a concurrent registration of the
            // same client waits here and then sees this one's generation
            let current = load(tx, &reg.client_id, true)?;
            let generation = current.as_ref().map_or(0, |c| c.generation);
            if generation != reg.expected_generation {
                return Err(conflict(
                    "the client's generation changed since the registration was decided",
                ));
            }
            if current.as_ref().and_then(|c| c.live).map(|l| l.session_id) != reg.fence {
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
                crate::prep::execute(tx, "UPDATE takeover_authorizations SET consumed_ms = $2 WHERE id = $1",
                    &[&id, &now_ms],
                )
                .map_err(Fail::db("consume takeover grant"))?;
            }
            if let Some(old) = reg.fence {
                end_session(tx, &old, true, "fenced by a newer registration", now_ms)?;
            }
            // a client id without a row starts above every pruned
            // client's generation (its row, created here, starts at that
            // floor); two replicas creating it at once leave one row, and
            // the one-live-session index refuses the second session, whose
            // transaction then runs again and sees the first's generation
            ensure_client(tx, &reg.client_id, opts)?;
            let base = match &current {
                Some(c) => c.generation,
                None => {
                    let floor: i64 = crate::prep::query_one(tx, "SELECT generation_floor FROM quota_totals WHERE id = 1", &[])
                        .map_err(Fail::db("read generation floor"))?
                        .get(0);
                    to_u64(floor)
                }
            };
            let next = base
                .checked_add(1)
                .ok_or_else(|| Fail::Integrity("client generation overflow".into()))?;
            let caps = prost::Message::encode_to_vec(&reg.capabilities);
            let cwd = reg.cwd_policy.as_ref().map(prost::Message::encode_to_vec);
            let platform = reg
                .capabilities
                .platform
                .as_ref()
                .map(|p| format!("{}/{}", p.os, p.arch));
            let params: [&(dyn ToSql + Sync); 9] = [
                &reg.client_id,
                &reg.instance_id.as_slice(),
                &to_i64(next),
                &platform,
                &reg.capabilities.software_version,
                &caps,
                &cwd,
                &now_ms,
                &reg.labels,
            ];
            crate::prep::execute(tx, "UPDATE clients SET instance_id = $2, generation = $3, platform = $4,
                     software_version = $5, capabilities = $6, cwd_policy = $7,
                     connected_ms = $8, last_seen_ms = $8, labels = $9,
                     pending_instance_id = CASE WHEN pending_instance_id = $2 THEN NULL ELSE pending_instance_id END,
                     pending_seen_ms = CASE WHEN pending_instance_id = $2 THEN NULL ELSE pending_seen_ms END
                 WHERE client_id = $1",
                &params,
            )
            .map_err(Fail::db("update client registration"))?;
            crate::prep::execute(tx, "INSERT INTO sessions (session_id, client_id, instance_id, generation, opened_ms,
                     live, owner_replica, owner_epoch)
                 VALUES ($1, $2, $3, $4, $5, true, $6, $7)",
                &[
                    &reg.session_id.as_slice(),
                    &reg.client_id,
                    &reg.instance_id.as_slice(),
                    &to_i64(next),
                    &now_ms,
                    &owner.map(|r| r.id.to_vec()),
                    &owner.map(|r| to_i64(r.epoch)),
                ],
            )
            .map_err(Fail::db("install session"))?;
            crate::prep::execute(tx, "DELETE FROM sessions WHERE session_id IN (
                     SELECT session_id FROM sessions
                     WHERE client_id = $1 AND NOT live
                     ORDER BY closed_ms DESC, session_id DESC
                     OFFSET $2)",
                &[&reg.client_id, &to_i64(CLOSED_SESSIONS_KEPT)],
            )
            .map_err(Fail::db("prune closed sessions"))?;
            // a fleet run waiting for late clients takes this one if it matches
            crate::fleet::add_late_targets_in(tx, &reg.client_id, &reg.labels, now_ms)?;
            if reg.fence.is_some() {
                write_in(
                    tx,
                    &AuditRecord::session(
                        Some(&reg.client_id),
                        "SessionFenced",
                        format!("fenced by the registration of generation {next}"),
                        now_ms,
                    ),
                    Ok(()),
                )?;
            }
            write_in(
                tx,
                &AuditRecord::session(
                    Some(&reg.client_id),
                    "SessionRegistered",
                    registered_detail(reg, next),
                    now_ms,
                ),
                Ok(()),
            )?;
            Ok(next)
        })?;
        tracing::info!(
            client_id = %reg.client_id,
            generation = next,
            fenced = reg.fence.is_some(),
            takeover = reg.consume_grant.is_some(),
            "session registered"
        );
        Ok(next)
    }

    /// Records a rejected live-conflict claim with its audit record.
    pub(crate) fn record_pending_claim(
        &mut self,
        client_id: &str,
        instance_id: &[u8; 16],
        now_ms: i64,
    ) -> Result<(), Fail> {
        self.in_tx("record pending claim", |tx, opts| {
            crate::incidents::check_writable(tx, &[(rvbox_proto::v1::ScopeKind::Client, client_id)])?;
            ensure_client(tx, client_id, opts)?;
            crate::prep::execute(tx, "UPDATE clients SET pending_instance_id = $2, pending_seen_ms = $3 WHERE client_id = $1",
                &[&client_id, &instance_id.as_slice(), &now_ms],
            )
            .map_err(Fail::db("record pending claim"))?;
            write_in(
                tx,
                &AuditRecord::session(
                    Some(client_id),
                    "LiveConflictRefused",
                    "another instance's session is live; the claim is recorded for takeover",
                    now_ms,
                ),
                Ok(()),
            )
        })?;
        tracing::warn!(
            client_id,
            "live-conflict registration rejected; claim recorded"
        );
        Ok(())
    }

    /// Ends a live session with its audit record (the reason as its
    /// detail). Idempotent: a session no longer live changes nothing.
    pub(crate) fn close_session(
        &mut self,
        session_id: &[u8; 16],
        reason: &str,
        now_ms: i64,
    ) -> Result<(), Fail> {
        self.in_tx("close session", |tx, _| {
            let client: Option<String> = crate::prep::query_opt(
                tx,
                "SELECT client_id FROM sessions WHERE session_id = $1 AND live FOR UPDATE",
                &[&session_id.as_slice()],
            )
            .map_err(Fail::db("load session"))?
            .map(|r| r.get(0));
            let Some(client) = client else {
                return Ok(());
            };
            end_session(tx, session_id, false, reason, now_ms)?;
            crate::prep::execute(
                tx,
                "UPDATE clients SET last_seen_ms = $2 WHERE client_id = $1",
                &[&client, &now_ms],
            )
            .map_err(Fail::db("record last seen"))?;
            write_in(
                tx,
                &AuditRecord::session(Some(&client), "SessionClosed", reason, now_ms),
                Ok(()),
            )
        })
    }

    /// Session audit records that no effect carries, in one transaction.
    pub(crate) fn session_audits(
        &mut self,
        records: &[SessionAudit],
        now_ms: i64,
    ) -> Result<(), Fail> {
        self.in_tx("write session audit", |tx, _| {
            for r in records {
                let rec = AuditRecord::of_edge(r, now_ms);
                let refused = rec
                    .error_code
                    .and_then(rvbox_domain::error::Code::from_wire)
                    .map(|code| rvbox_domain::error::DomainError::new(code, r.detail.clone()));
                write_in(tx, &rec, refused.as_ref().map_or(Ok(()), Err))?;
            }
            Ok(())
        })
    }
}

impl PgStore {
    /// `AuthorizeClientTakeover`: a one-shot grant for exactly the
    /// client's pending claim, replacing (voiding) an earlier live grant,
    /// idempotent by `request_id`; a refusal is stored as the request's
    /// result too. Audited with `caller`.
    pub(crate) fn authorize_takeover(
        &mut self,
        req: &rvbox_proto::v1::AuthorizeClientTakeoverRequest,
        caller: &rvbox_store_port::audit::Caller,
        ttl_ms: u64,
        now_ms: i64,
    ) -> Result<rvbox_proto::v1::AuthorizeClientTakeoverResponse, Fail> {
        let caller = crate::stdin::operator(caller);
        let mut rec = AuditRecord::control(&caller, "AuthorizeClientTakeover", now_ms);
        rec.client_id = Some(req.client_id.clone());
        let result = self.authorize_takeover_in(req, &rec, ttl_ms, now_ms);
        if !matches!(&result, Ok((_, true))) {
            self.audit_alone(&rec, &result);
        }
        let (grant, _) = result?;
        Ok(rvbox_proto::v1::AuthorizeClientTakeoverResponse {
            client_id: req.client_id.clone(),
            client_instance_id: req.client_instance_id.clone(),
            grant_expiry_time: Some(prost_types::Timestamp {
                seconds: grant.expires_ms.div_euclid(1000),
                nanos: i32::try_from(grant.expires_ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
            }),
        })
    }

    /// The grant, and whether this call wrote it (and its audit record).
    fn authorize_takeover_in(
        &mut self,
        req: &rvbox_proto::v1::AuthorizeClientTakeoverRequest,
        rec: &AuditRecord,
        ttl_ms: u64,
        now_ms: i64,
    ) -> Result<(TakeoverGrant, bool), Fail> {
        use rvbox_domain::error::DomainError;
        use rvbox_store::mutations::{Assigned, Owner, Stored};
        let request_id = rvbox_domain::ids::Uuid7::parse("request_id", &req.request_id)
            .map_err(DomainError::from)?;
        let instance =
            rvbox_domain::ids::InstanceId::parse("client_instance_id", &req.client_instance_id)
                .map_err(DomainError::from)?;
        let instance_id = *instance.as_bytes();
        let client_id = req.client_id.as_str();
        let canonical = rvbox_proto::v1::AuthorizeClientTakeoverRequest {
            request_id: String::new(),
            client_id: client_id.to_owned(),
            client_instance_id: instance.to_string(),
        };
        let hash = rvbox_domain::hash::request_hash("AuthorizeClientTakeover", &canonical);
        let outcome = self.in_tx("authorize takeover", |tx, _| {
            crate::incidents::check_writable(
                tx,
                &[(rvbox_proto::v1::ScopeKind::Client, client_id)],
            )?;
            let owner = Owner::Client(client_id);
            if let Some(stored) =
                crate::mutations::lookup(tx, &request_id, "AuthorizeClientTakeover", &hash, owner)?
            {
                return Ok(match stored {
                    Ok(bytes) => Ok((
                        rvbox_store::sessions::decode_grant(&bytes)
                            .map_err(|e| Fail::Integrity(e.to_string()))?,
                        false,
                    )),
                    Err(detail) => Err(rvbox_store::incidents::detail_to_error(&detail)),
                });
            }
            let Some(record) = load(tx, client_id, true)? else {
                return Err(DomainError::new(Code::NotFound, "no such client")
                    .with_field("client_id")
                    .into());
            };
            if record.pending_claim.map(|p| p.0) != Some(instance_id) {
                // never broadened to "the next instance"; the refusal is
                // the request's stored result
                let refusal = DomainError::new(
                    Code::FailedPrecondition,
                    "client_instance_id is not the client's pending claim",
                )
                .with_field("client_instance_id");
                let stored: Stored = Err(refusal.to_detail());
                crate::mutations::record(
                    tx,
                    &request_id,
                    "AuthorizeClientTakeover",
                    &hash,
                    owner,
                    &stored,
                    Assigned::default(),
                    now_ms,
                )?;
                return Ok(Err(refusal));
            }
            crate::prep::execute(
                tx,
                "UPDATE takeover_authorizations SET voided_ms = $2
                 WHERE client_id = $1 AND consumed_ms IS NULL AND voided_ms IS NULL",
                &[&client_id, &now_ms],
            )
            .map_err(Fail::db("void earlier grant"))?;
            let expires = now_ms.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX).max(1));
            let id: i64 = crate::prep::query_one(
                tx,
                "INSERT INTO takeover_authorizations (client_id, instance_id, created_ms,
                         expires_ms, request_id)
                     VALUES ($1, $2, $3, $4, $5) RETURNING id",
                &[
                    &client_id,
                    &instance_id.as_slice(),
                    &now_ms,
                    &expires,
                    &request_id.as_bytes().as_slice(),
                ],
            )
            .map_err(Fail::db("insert takeover grant"))?
            .get(0);
            let grant = TakeoverGrant {
                id,
                instance_id,
                created_ms: now_ms,
                expires_ms: expires,
            };
            let stored: Stored = Ok(rvbox_store::sessions::encode_grant(&grant));
            crate::mutations::record(
                tx,
                &request_id,
                "AuthorizeClientTakeover",
                &hash,
                owner,
                &stored,
                Assigned::default(),
                now_ms,
            )?;
            write_in(tx, rec, Ok(()))?;
            Ok(Ok((grant, true)))
        })?;
        let (grant, fresh) = outcome.map_err(Fail::Refused)?;
        if fresh {
            tracing::info!(client_id, "takeover grant stored");
        }
        Ok((grant, fresh))
    }
}
