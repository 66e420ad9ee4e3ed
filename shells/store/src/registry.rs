//! The client registry: the `clients` and `sessions` rows, bounded,
//! pruned and charged (migration 4).
//!
//! Both tables grow from unauthenticated input (any hello names a client
//! id; every registration opens a session row), so:
//!
//! - their row counts are maintained in `quota_totals` by triggers, in the
//!   same transaction as every insert and delete;
//! - each row is charged at a fixed worst-case size ([`CLIENT_ROW_CHARGE`],
//!   [`SESSION_ROW_CHARGE`]) to the server-wide tier: the global usage every
//!   reservation sees is the command bytes plus the registry's charge, so
//!   output and registry compete for the same bytes;
//! - a new client is admitted only while fewer than [`MAX_CLIENTS`] exist
//!   and the server-wide tier holds its row and its kept sessions, else the
//!   write is refused `QUOTA_EXCEEDED` naming the tier;
//! - each registration keeps the newest [`CLOSED_SESSIONS_KEPT`] closed
//!   sessions of its client and deletes the older ones in its transaction;
//! - maintenance deletes clients idle for the terminal retention (no
//!   command, no live session, no live takeover grant), at most
//!   [`MAX_IDLE_CLIENTS_PER_PASS`] a pass. A client with any command is
//!   never deleted: its commands keep it until they are reclaimed.

use rusqlite::{Connection, OptionalExtension, params};
use rvbox_domain::error::{Code, DomainError};

use crate::db::Cached as _;
use crate::error::StoreError;
use crate::mutations::OpError;
use crate::store::{Store, to_i64, to_u64};

/// Most client rows the registry holds.
pub const MAX_CLIENTS: u64 = 100_000;
/// Closed sessions kept per client (the live one comes on top).
pub const CLOSED_SESSIONS_KEPT: u64 = 8;
/// Charge of one `clients` row: the row with its capabilities and cwd
/// policy blobs at their bounded size, its indexes and page fill.
pub const CLIENT_ROW_CHARGE: u64 = 8 * 1024;
/// Charge of one `sessions` row: the row with a close reason of at most
/// 4 KiB, its indexes and page fill.
pub const SESSION_ROW_CHARGE: u64 = 6 * 1024;
/// Most idle clients one maintenance pass deletes.
pub const MAX_IDLE_CLIENTS_PER_PASS: u32 = 1_000;

/// The registry's row counts.
pub(crate) fn counts(conn: &Connection) -> Result<(u64, u64), StoreError> {
    let (c, s): (i64, i64) = conn
        .query_row_cached(
            "SELECT clients, sessions FROM quota_totals WHERE id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(|e| StoreError::sqlite("read registry counts", e))?;
    Ok((to_u64(c), to_u64(s)))
}

/// The registry's charge against the server-wide tier.
pub(crate) fn charged(conn: &Connection) -> Result<u64, StoreError> {
    let (c, s) = counts(conn)?;
    Ok(c.saturating_mul(CLIENT_ROW_CHARGE)
        .saturating_add(s.saturating_mul(SESSION_ROW_CHARGE)))
}

/// Makes sure the client's row exists, admitting a new client only within
/// the registry's bounds (see the module docs).
///
/// # Errors
/// `QUOTA_EXCEEDED` naming the bound that refused a new client, or a
/// database failure.
pub(crate) fn ensure_client(tx: &Connection, client_id: &str, limit: u64) -> Result<(), OpError> {
    let exists: Option<i64> = tx
        .query_row_cached(
            "SELECT 1 FROM clients WHERE client_id = ?1",
            params![client_id],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("look up client", e))?;
    if exists.is_some() {
        return Ok(());
    }
    let (clients, _) = counts(tx)?;
    let used = crate::store::global_charged(tx)?;
    admit_new_client(clients, used, limit)?;
    tx.execute_cached(
        "INSERT INTO clients (client_id, generation)
         VALUES (?1, (SELECT generation_floor FROM quota_totals WHERE id = 1))",
        params![client_id],
    )
    .map_err(|e| StoreError::sqlite("register client", e))?;
    Ok(())
}

/// Whether a new client's row may be created: fewer than [`MAX_CLIENTS`]
/// exist, and the server-wide tier (`used` of `limit` bytes) holds its row
/// and its kept sessions. Pure: every store backend admits clients by it.
///
/// # Errors
/// `QUOTA_EXCEEDED` naming the bound that refused.
pub fn admit_new_client(clients: u64, used: u64, limit: u64) -> Result<(), DomainError> {
    if clients >= MAX_CLIENTS {
        tracing::warn!(clients, "new client refused: the registry is full");
        return Err(DomainError::new(
            Code::QuotaExceeded,
            format!("the server holds {clients} clients, its limit; idle clients are pruned by maintenance"),
        )
        .with_field("client_id"));
    }
    let need = CLIENT_ROW_CHARGE
        .saturating_add(SESSION_ROW_CHARGE.saturating_mul(CLOSED_SESSIONS_KEPT + 1));
    if used.saturating_add(need) > limit {
        tracing::warn!(
            used,
            need,
            "new client refused: the server-wide tier is full"
        );
        return Err(DomainError::new(
            Code::QuotaExceeded,
            format!(
                "server_total tier: {used} bytes charged, {limit} admit new clients (the tier less the eviction slack); a new client needs {need}"
            ),
        ));
    }
    Ok(())
}

/// The generation a client id that has no row starts from: above every
/// pruned client's, so a returning client never sees it go backwards.
pub(crate) fn generation_floor(tx: &Connection) -> Result<u64, StoreError> {
    let v: i64 = tx
        .query_row_cached(
            "SELECT generation_floor FROM quota_totals WHERE id = 1",
            [],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("read generation floor", e))?;
    Ok(to_u64(v))
}

/// Deletes the client's closed sessions beyond the newest
/// [`CLOSED_SESSIONS_KEPT`]. Returns how many went.
pub(crate) fn prune_sessions(tx: &Connection, client_id: &str) -> Result<u64, StoreError> {
    let n = tx
        .execute_cached(
            "DELETE FROM sessions WHERE session_id IN (
                 SELECT session_id FROM sessions
                 WHERE client_id = ?1 AND live = 0
                 ORDER BY closed_ms DESC, session_id DESC
                 LIMIT -1 OFFSET ?2)",
            params![client_id, to_i64(CLOSED_SESSIONS_KEPT)],
        )
        .map_err(|e| StoreError::sqlite("prune closed sessions", e))?;
    Ok(n as u64)
}

/// The registry's row counts (clients, sessions) as its counters hold
/// them and as a recount of the tables finds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryCounts {
    /// The maintained counters.
    pub counters: (u64, u64),
    /// The recount.
    pub recount: (u64, u64),
}

impl Store {
    /// Deletes clients idle since before `now_ms - idle_ms` (no command,
    /// no live session, no live takeover grant), with their closed
    /// sessions, at most [`MAX_IDLE_CLIENTS_PER_PASS`]. Returns how many
    /// went. `idle_ms` 0 keeps every client.
    ///
    /// # Errors
    /// A database failure.
    pub fn prune_idle_clients(&mut self, now_ms: i64, idle_ms: u64) -> Result<u64, StoreError> {
        if idle_ms == 0 {
            return Ok(0);
        }
        let before = now_ms.saturating_sub(i64::try_from(idle_ms).unwrap_or(i64::MAX));
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin client pruning", e))?;
        let idle = "SELECT c.client_id FROM clients c
                     WHERE COALESCE(c.last_seen_ms, 0) < ?1
                       AND NOT EXISTS (SELECT 1 FROM commands m WHERE m.client_id = c.client_id)
                       AND NOT EXISTS (SELECT 1 FROM sessions s
                                       WHERE s.client_id = c.client_id AND s.live = 1)
                       AND NOT EXISTS (SELECT 1 FROM pty_sessions p WHERE p.client_id = c.client_id)
                       AND NOT EXISTS (SELECT 1 FROM takeover_authorizations t
                                       WHERE t.client_id = c.client_id AND t.consumed_ms IS NULL
                                         AND t.voided_ms IS NULL AND t.expires_ms > ?2)
                     ORDER BY COALESCE(c.last_seen_ms, 0), c.client_id
                     LIMIT ?3";
        // the floor rises to the pruned generations first, in the same
        // transaction as the deletion
        tx.execute_cached(
            &format!(
                "UPDATE quota_totals SET generation_floor = MAX(generation_floor,
                     COALESCE((SELECT MAX(generation) FROM clients WHERE client_id IN ({idle})), 0))
                 WHERE id = 1"
            ),
            params![before, now_ms, MAX_IDLE_CLIENTS_PER_PASS],
        )
        .map_err(|e| StoreError::sqlite("raise generation floor", e))?;
        let n = tx
            .execute_cached(
                &format!("DELETE FROM clients WHERE client_id IN ({idle})"),
                params![before, now_ms, MAX_IDLE_CLIENTS_PER_PASS],
            )
            .map_err(|e| StoreError::sqlite("prune idle clients", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit client pruning", e))?;
        if n > 0 {
            self.metrics.clients_pruned.inc_by(n as u64);
            tracing::info!(clients = n, "idle clients pruned");
        }
        Ok(n as u64)
    }

    /// The registry's row counts (clients, sessions) as its counters hold
    /// them, and as a recount finds them.
    ///
    /// # Errors
    /// A database failure.
    pub fn registry_counts(&self) -> Result<RegistryCounts, StoreError> {
        registry_counts_on(&self.conn)
    }
}

/// [`Store::registry_counts`] on any connection (the scrub's snapshot).
pub(crate) fn registry_counts_on(conn: &Connection) -> Result<RegistryCounts, StoreError> {
    {
        let counters = counts(conn)?;
        let recount: (i64, i64) = conn
            .query_row_cached(
                "SELECT (SELECT COUNT(*) FROM clients), (SELECT COUNT(*) FROM sessions)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(|e| StoreError::sqlite("recount registry", e))?;
        Ok(RegistryCounts {
            counters,
            recount: (to_u64(recount.0), to_u64(recount.1)),
        })
    }
}
