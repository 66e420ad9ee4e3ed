//! Audit records on PostgreSQL: the same records as the SQLite store
//! (`rvbox_store::audit::AuditRecord`), written into `audit_log` in the
//! effect's own transaction, so a record commits with its effect or not at
//! all. A refusal that commits nothing is recorded in a transaction of its
//! own, after it.

use postgres::Transaction;
use rvbox_domain::error::{Code, DomainError};
use rvbox_store::audit::{AuditRecord, MAX_OUTBOX_RECORD_BYTES, set_outcome};

use crate::{Fail, PgStore};

/// Writes `rec` with `outcome` inside the caller's transaction.
pub(crate) fn write_in(
    tx: &mut Transaction<'_>,
    rec: &AuditRecord,
    outcome: Result<(), &DomainError>,
) -> Result<(), Fail> {
    let mut rec = rec.clone();
    set_outcome(&mut rec, outcome);
    let raw = rec.bounded().fit(MAX_OUTBOX_RECORD_BYTES).encode();
    crate::prep::execute(
        tx,
        "INSERT INTO audit_log (time_ms, record) VALUES ($1, $2)",
        &[&rec_time(&raw), &raw],
    )
    .map_err(Fail::db("write audit record"))?;
    Ok(())
}

/// The record's time (bytes 1..9 of the encoding, after the version).
fn rec_time(raw: &[u8]) -> i64 {
    raw.get(1..9)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, i64::from_le_bytes)
}

impl PgStore {
    /// Writes the record of an operation that committed nothing (a
    /// refusal, a replay, a failure), in a transaction of its own. Never
    /// fails the caller: a record that cannot be written is logged.
    pub(crate) fn audit_alone<T>(&mut self, rec: &AuditRecord, result: &Result<T, Fail>) {
        let failed;
        let outcome = match result {
            Ok(_) => Ok(()),
            Err(Fail::Refused(e)) => Err(e),
            Err(other) => {
                failed = DomainError::new(Code::Internal, other.to_string());
                Err(&failed)
            }
        };
        let r = self.in_tx("write audit record", |tx, _| write_in(tx, rec, outcome));
        if let Err(e) = r {
            tracing::error!(action = %rec.action, error = %e, "audit record not written");
        }
    }
}
