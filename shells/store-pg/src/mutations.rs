//! Control-mutation idempotency on PostgreSQL (as
//! `rvbox_store::mutations`): inside the mutation's own transaction, the
//! `request_id` is looked up; an exact replay answers the stored result,
//! the same id with anything else is `CONFLICT`, and a fresh id's outcome
//! is recorded with its effect. Two replicas running the same fresh
//! request at once both insert its row: the second's transaction fails on
//! the key, runs again, and finds the first's result.

use postgres::Transaction;
use postgres::types::ToSql;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_store::mutations::{Assigned, Owner, Stored, owner_columns};

use crate::Fail;

/// Looks `request_id` up: `None` is fresh, `Some` an exact replay.
///
/// # Errors
/// `CONFLICT` naming `request_id` when it was used for another request.
pub(crate) fn lookup(
    tx: &mut Transaction<'_>,
    request_id: &Uuid7,
    method: &str,
    hash: &RequestHash,
    owner: Owner<'_>,
) -> Result<Option<Stored>, Fail> {
    let Some(row) = crate::prep::query_opt(
        tx,
        "SELECT method, request_hash, command_uuid, incident_id, client_id, result,
                    result_is_error, fleet_run_id
             FROM control_mutations WHERE request_id = $1",
        &[&request_id.as_bytes().as_slice()],
    )
    .map_err(Fail::db("look up request_id"))?
    else {
        return Ok(None);
    };
    let (cmd, inc, client, run) = owner_columns(owner);
    let same = row.get::<_, String>(0) == method
        && row.get::<_, Vec<u8>>(1).as_slice() == hash.as_bytes().as_slice()
        && row.get::<_, Option<Vec<u8>>>(2).as_deref() == cmd
        && row.get::<_, Option<Vec<u8>>>(3).as_deref() == inc
        && row.get::<_, Option<String>>(4).as_deref() == client
        && row.get::<_, Option<Vec<u8>>>(7).as_deref() == run;
    if !same {
        return Err(DomainError::new(
            Code::Conflict,
            "request_id was already used for a different request; use a new request_id",
        )
        .with_field("request_id")
        .into());
    }
    let result: Vec<u8> = row.get(5);
    if row.get::<_, bool>(6) {
        let detail = wire::ErrorDetail::decode(result.as_slice())
            .map_err(|_| Fail::Integrity("stored mutation refusal does not decode".into()))?;
        Ok(Some(Err(detail)))
    } else {
        Ok(Some(Ok(result)))
    }
}

/// Records a mutation's outcome with its effect.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    tx: &mut Transaction<'_>,
    request_id: &Uuid7,
    method: &str,
    hash: &RequestHash,
    owner: Owner<'_>,
    outcome: &Stored,
    assigned: Assigned,
    now_ms: i64,
) -> Result<(), Fail> {
    let (cmd, inc, client, run) = owner_columns(owner);
    let (bytes, is_error) = match outcome {
        Ok(b) => (b.clone(), false),
        Err(detail) => (detail.encode_to_vec(), true),
    };
    let as_i64 = |v: Option<u64>| v.and_then(|n| i64::try_from(n).ok());
    let params: [&(dyn ToSql + Sync); 12] = [
        &request_id.as_bytes().as_slice(),
        &method,
        &hash.as_bytes().as_slice(),
        &cmd,
        &inc,
        &client,
        &as_i64(assigned.write_seq),
        &as_i64(assigned.revision),
        &bytes,
        &is_error,
        &now_ms,
        &run,
    ];
    crate::prep::execute(
        tx,
        "INSERT INTO control_mutations (request_id, method, request_hash, command_uuid,
             incident_id, client_id, write_seq, revision, result, result_is_error, created_ms,
             fleet_run_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        &params,
    )
    .map_err(Fail::db("record mutation"))?;
    Ok(())
}
