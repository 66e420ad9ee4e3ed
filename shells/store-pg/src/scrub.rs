//! The background scrub on PostgreSQL, as the SQLite store's
//! (`rvbox_store::scrub`) but over what this store keeps: in bounded
//! slices, by the replica holding the scrub duty.
//!
//! One cycle runs, in order:
//!
//! 1. **re-verification** of every output chunk (a cursor over
//!    `(issue_uuid, event_seq)`): each is decompressed within its raw
//!    length and checked against its SHA-256 and its event row. A damaged
//!    chunk is never served: in one transaction it gets a
//!    `CHECKSUM_MISMATCH` incident (data loss, scope: its command) and a
//!    truncation row over its event, so readers are told what was lost
//!    instead of failing on it;
//! 2. **the counter recount** of plan §5.2 in one read-only snapshot: each
//!    client's charged total against the sum of its commands, the
//!    server-wide totals, the registry and queue counters, and the fleet
//!    runs' counters against their targets. Every writer changes a counter
//!    in the transaction that changes what it counts, so one snapshot is
//!    a consistent view. A mismatch is a `COUNTER_MISMATCH` incident,
//!    repaired at once by rebuilding the derivable counters with the
//!    counted tables locked against writers for that moment.
//!
//! There is no orphan sweep: output chunks are rows of the database, and a
//! chunk is deleted with its event row (a foreign key).
//!
//! A cycle starts at every start and then once per `scrub_interval_ms`.

use postgres::{IsolationLevel, Transaction};
use rvbox_proto::v1 as wire;
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::maintenance::ScrubReport;
use rvbox_store_port::replica::Duty;

use crate::output::OutputChunk;
use crate::sessions::{to_i64, to_u64};
use crate::{Fail, PgStore};

/// Most output chunks one slice re-verifies.
pub(crate) const CHUNKS_PER_SLICE: usize = 512;
/// Most problems of one kind a recount reports (the repair fixes all).
const MAX_PROBLEMS: i64 = 20;

/// Where the scrub's cycle stands (in memory: a start begins a new cycle).
#[derive(Debug, Clone, Default)]
pub(crate) enum ScrubState {
    /// Re-verifying chunks after this one (none: from the first).
    Verify(Option<([u8; 16], u64)>),
    /// A cycle is due (at start: at once).
    #[default]
    Due,
    /// The last cycle finished at this wall time.
    Done(i64),
}

/// What a damaged chunk is, for its incident.
fn damage(chunk: &OutputChunk, event: Option<(i64, i64, Vec<u8>)>) -> Option<String> {
    let Some((stream, stored_len, digest)) = event else {
        return Some("has no event row".into());
    };
    if i64::from(chunk.stream.as_u8()) != stream
        || chunk.stored.len() as u64 != to_u64(stored_len)
        || digest.as_slice() != chunk.sha256.as_slice()
    {
        return Some("does not match its event row".into());
    }
    chunk.raw().err().map(|e| e.to_string())
}

/// Quarantines a damaged chunk: an incident and a truncation row over its
/// event, unless a truncation already covers it.
fn quarantine(
    tx: &mut Transaction<'_>,
    incident: [u8; 16],
    chunk: &OutputChunk,
    why: &str,
    now_ms: i64,
) -> Result<bool, Fail> {
    let issue = chunk.issue_uuid;
    let seq = to_i64(chunk.event_seq);
    let covered = crate::prep::query_opt(
        tx,
        "SELECT 1 FROM output_truncations
         WHERE issue_uuid = $1 AND first_seq <= $2 AND last_seq >= $2",
        &[&issue.as_slice(), &seq],
    )
    .map_err(Fail::db("check output truncations"))?
    .is_some();
    if covered {
        return Ok(false);
    }
    let client: Option<String> = crate::prep::query_opt(
        tx,
        "SELECT client_id FROM commands WHERE issue_uuid = $1",
        &[&issue.as_slice()],
    )
    .map_err(Fail::db("load the damaged chunk's command"))?
    .map(|r| r.get(0));
    let key = rvbox_store::fleet::uuid_text(&issue);
    let new = NewIncident {
        kind: wire::IncidentKind::ChecksumMismatch,
        scope_kind: wire::ScopeKind::Command,
        scope_key: key,
        client_id: client,
        issue_uuid: Some(issue),
        summary: format!(
            "output chunk {} ({} raw bytes) {why}; the output is marked truncated",
            chunk.event_seq, chunk.raw_len
        ),
        evidence: format!("event_seq={} why={why}", chunk.event_seq).into_bytes(),
        data_loss: true,
    };
    crate::incidents::insert(tx, incident, &new, now_ms)?;
    crate::prep::execute(
        tx,
        "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, raw_bytes, stored_bytes,
             source, reason, incident_id, recorded_ms)
         VALUES ($1, $2, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &issue.as_slice(),
            &seq,
            &i64::from(chunk.raw_len),
            &to_i64(chunk.stored.len() as u64),
            &i64::from(wire::TruncationSource::StorageLoss as i32),
            &"committed output lost in server storage",
            &incident.as_slice(),
            &now_ms,
        ],
    )
    .map_err(Fail::db("record the damaged chunk's truncation"))?;
    Ok(true)
}

/// What a recount found: one line per counter that differs.
fn recount(tx: &mut Transaction<'_>) -> Result<(u64, Vec<String>), Fail> {
    let mut out = Vec::new();
    let clients: i64 = tx
        .query_one("SELECT count(*) FROM clients", &[])
        .map_err(Fail::db("recount clients"))?
        .get(0);
    for r in tx
        .query(
            "SELECT c.client_id, c.charged_bytes, COALESCE(s.total, 0)::bigint
             FROM clients c
             LEFT JOIN (SELECT client_id, sum(charged_bytes) AS total FROM commands
                        GROUP BY client_id) s ON s.client_id = c.client_id
             WHERE c.charged_bytes <> COALESCE(s.total, 0)
             ORDER BY c.client_id LIMIT $1",
            &[&MAX_PROBLEMS],
        )
        .map_err(Fail::db("recount client charges"))?
    {
        out.push(format!(
            "client {}: charged {} but its commands sum to {}",
            r.get::<_, String>(0),
            r.get::<_, i64>(1),
            r.get::<_, i64>(2)
        ));
    }
    let t = tx
        .query_one(
            "SELECT command_charged, COALESCE((SELECT sum(charged_bytes) FROM clients), 0)::bigint,
                    clients, (SELECT count(*) FROM clients),
                    sessions, (SELECT count(*) FROM sessions),
                    queued, (SELECT count(*) FROM commands WHERE lifecycle IN (1, 2)),
                    tombstones, (SELECT count(*) FROM command_tombstones)
             FROM quota_totals WHERE id = 1",
            &[],
        )
        .map_err(Fail::db("recount the server totals"))?;
    for (i, name) in [
        (0, "command_charged"),
        (2, "clients"),
        (4, "sessions"),
        (6, "queued"),
        (8, "tombstones"),
    ] {
        let (counter, recount): (i64, i64) = (t.get(i), t.get(i + 1));
        if counter != recount {
            out.push(format!(
                "server {name}: counted {counter} but recounts to {recount}"
            ));
        }
    }
    for r in tx
        .query(
            "SELECT COALESCE(q.client_id, m.client_id), COALESCE(q.queued, 0),
                    COALESCE(m.n, 0)
             FROM queued_by_client q
             FULL JOIN (SELECT client_id, count(*) AS n FROM commands
                        WHERE lifecycle IN (1, 2) GROUP BY client_id) m
               ON m.client_id = q.client_id
             WHERE COALESCE(q.queued, 0) <> COALESCE(m.n, 0) OR q.queued = 0
             ORDER BY 1 LIMIT $1",
            &[&MAX_PROBLEMS],
        )
        .map_err(Fail::db("recount queued commands"))?
    {
        out.push(format!(
            "client {}: {} queued counted, {} recounted",
            r.get::<_, String>(0),
            r.get::<_, i64>(1),
            r.get::<_, i64>(2)
        ));
    }
    for r in tx
        .query(
            "SELECT r.run_id FROM fleet_runs r
             LEFT JOIN (SELECT run_id, count(*) AS n,
                               count(*) FILTER (WHERE state = 1) AS s1,
                               count(*) FILTER (WHERE state = 2) AS s2,
                               count(*) FILTER (WHERE state = 3) AS s3,
                               count(*) FILTER (WHERE state = 4) AS s4,
                               count(*) FILTER (WHERE state = 5) AS s5,
                               count(*) FILTER (WHERE state = 6) AS s6,
                               count(*) FILTER (WHERE state = 7) AS s7,
                               count(*) FILTER (WHERE state = 8) AS s8
                        FROM fleet_targets GROUP BY run_id) t ON t.run_id = r.run_id
             WHERE (r.targets, r.n_pending, r.n_queued, r.n_running, r.n_succeeded, r.n_failed,
                    r.n_unreachable, r.n_cancelled, r.n_skipped)
                   IS DISTINCT FROM
                   (COALESCE(t.n, 0), COALESCE(t.s1, 0), COALESCE(t.s2, 0), COALESCE(t.s3, 0),
                    COALESCE(t.s4, 0), COALESCE(t.s5, 0), COALESCE(t.s6, 0), COALESCE(t.s7, 0),
                    COALESCE(t.s8, 0))
             ORDER BY r.run_id LIMIT $1",
            &[&MAX_PROBLEMS],
        )
        .map_err(Fail::db("recount fleet runs"))?
    {
        let id: Vec<u8> = r.get(0);
        out.push(format!(
            "fleet run {}: counters differ from its targets",
            <[u8; 16]>::try_from(id.as_slice())
                .map(|b| rvbox_store::fleet::uuid_text(&b))
                .unwrap_or_default()
        ));
    }
    Ok((to_u64(clients), out))
}

/// Rebuilds every derivable counter from the rows it counts, with those
/// tables locked against writers (they wait; none is refused).
pub(crate) fn rebuild_counters(tx: &mut Transaction<'_>) -> Result<(), Fail> {
    tx.batch_execute(
        "LOCK TABLE quota_totals, clients, sessions, commands, command_tombstones,
              queued_by_client, fleet_runs, fleet_targets IN SHARE ROW EXCLUSIVE MODE;
         UPDATE clients c SET charged_bytes = COALESCE(
             (SELECT sum(charged_bytes) FROM commands m WHERE m.client_id = c.client_id), 0)
         WHERE c.charged_bytes IS DISTINCT FROM COALESCE(
             (SELECT sum(charged_bytes) FROM commands m WHERE m.client_id = c.client_id), 0);
         UPDATE quota_totals SET
             command_charged = COALESCE((SELECT sum(charged_bytes) FROM clients), 0),
             clients = (SELECT count(*) FROM clients),
             sessions = (SELECT count(*) FROM sessions),
             queued = (SELECT count(*) FROM commands WHERE lifecycle IN (1, 2)),
             tombstones = (SELECT count(*) FROM command_tombstones)
         WHERE id = 1;
         DELETE FROM queued_by_client;
         INSERT INTO queued_by_client (client_id, queued)
             SELECT client_id, count(*) FROM commands WHERE lifecycle IN (1, 2)
             GROUP BY client_id;
         UPDATE fleet_runs r SET
             targets = t.n, n_pending = t.s1, n_queued = t.s2, n_running = t.s3,
             n_succeeded = t.s4, n_failed = t.s5, n_unreachable = t.s6, n_cancelled = t.s7,
             n_skipped = t.s8
         FROM (SELECT f.run_id, count(t.run_id) AS n,
                      count(*) FILTER (WHERE t.state = 1) AS s1,
                      count(*) FILTER (WHERE t.state = 2) AS s2,
                      count(*) FILTER (WHERE t.state = 3) AS s3,
                      count(*) FILTER (WHERE t.state = 4) AS s4,
                      count(*) FILTER (WHERE t.state = 5) AS s5,
                      count(*) FILTER (WHERE t.state = 6) AS s6,
                      count(*) FILTER (WHERE t.state = 7) AS s7,
                      count(*) FILTER (WHERE t.state = 8) AS s8
               FROM fleet_runs f LEFT JOIN fleet_targets t ON t.run_id = f.run_id
               GROUP BY f.run_id) t
         WHERE r.run_id = t.run_id
           AND (r.targets, r.n_pending, r.n_queued, r.n_running, r.n_succeeded, r.n_failed,
                r.n_unreachable, r.n_cancelled, r.n_skipped)
               IS DISTINCT FROM (t.n, t.s1, t.s2, t.s3, t.s4, t.s5, t.s6, t.s7, t.s8);",
    )
    .map_err(Fail::db("rebuild counters"))
}

impl PgStore {
    /// One slice of the background scrub (nothing, `idle`, when this
    /// replica does not hold the scrub duty or no cycle is due).
    pub(crate) fn scrub(&mut self, now_ms: i64) -> Result<ScrubReport, Fail> {
        let mut report = ScrubReport::default();
        let replica = self.replica();
        let held = self.in_tx("check the scrub duty", |tx, _| {
            crate::maintenance::holds(tx, replica, Duty::Scrub)
        })?;
        if !held {
            report.idle = true;
            return Ok(report);
        }
        let interval = i64::try_from(self.opts.scrub_interval_ms).unwrap_or(i64::MAX);
        match self.scrub.clone() {
            // an interval of 0: only the cycle after each start
            ScrubState::Done(at) if interval == 0 || now_ms < at.saturating_add(interval) => {
                report.idle = true;
            }
            ScrubState::Done(_) | ScrubState::Due => {
                tracing::info!("background scrub cycle started");
                self.scrub = ScrubState::Verify(None);
                self.verify_slice(None, &mut report, now_ms)?;
            }
            ScrubState::Verify(after) => self.verify_slice(after, &mut report, now_ms)?,
        }
        Ok(report)
    }

    /// Re-verifies the next chunks; after the last, the recount.
    fn verify_slice(
        &mut self,
        after: Option<([u8; 16], u64)>,
        report: &mut ScrubReport,
        now_ms: i64,
    ) -> Result<(), Fail> {
        // the chunks through the output store, their event rows beside
        let mut output =
            std::mem::replace(&mut self.output, Box::new(crate::output::DatabaseChunks));
        let read = self.in_tx("read output chunks to verify", |tx, _| {
            let chunks = output.scan(tx, after, CHUNKS_PER_SLICE)?;
            let ids: Vec<&[u8]> = chunks.iter().map(|c| c.issue_uuid.as_slice()).collect();
            let seqs: Vec<i64> = chunks.iter().map(|c| to_i64(c.event_seq)).collect();
            let mut events = std::collections::HashMap::new();
            for r in crate::prep::query(
                tx,
                "SELECT issue_uuid, event_seq, stream, stored_len, content_sha256
                 FROM command_events
                 WHERE (issue_uuid, event_seq) IN (SELECT * FROM unnest($1::bytea[], $2::int8[]))",
                &[&ids, &seqs],
            )
            .map_err(Fail::db("read the verified chunks' events"))?
            {
                let issue = crate::sessions::blob16(Some(r.get(0)))
                    .ok_or_else(|| Fail::Integrity("an event's command id".into()))?;
                events.insert(
                    (issue, to_u64(r.get(1))),
                    (
                        r.get::<_, i64>(2),
                        r.get::<_, i64>(3),
                        r.get::<_, Vec<u8>>(4),
                    ),
                );
            }
            Ok((chunks, events))
        });
        self.output = output;
        let (chunks, mut events) = read?;
        let mut last = None;
        let n = chunks.len();
        for chunk in chunks {
            let (issue, seq) = (chunk.issue_uuid, chunk.event_seq);
            last = Some((issue, seq));
            report.segments_verified += 1;
            let event = events.remove(&(issue, seq));
            let Some(why) = damage(&chunk, event) else {
                continue;
            };
            let id = self.incident_id(now_ms)?;
            let recorded = self.in_tx("quarantine a damaged output chunk", |tx, _| {
                quarantine(tx, id, &chunk, &why, now_ms)
            })?;
            if recorded {
                report.segments_damaged += 1;
                tracing::error!(
                    issue_uuid = %rvbox_store::fleet::uuid_text(&issue),
                    event_seq = seq,
                    why,
                    "damaged output chunk: incident recorded, output marked truncated"
                );
            }
        }
        if n < CHUNKS_PER_SLICE {
            self.finish_cycle(report, now_ms)?;
        } else {
            self.scrub = ScrubState::Verify(last);
        }
        Ok(())
    }

    /// The recount, its repair, and the end of the cycle.
    fn finish_cycle(&mut self, report: &mut ScrubReport, now_ms: i64) -> Result<(), Fail> {
        let (clients, problems) = {
            let mut tx = self
                .client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .map_err(Fail::db("begin the recount snapshot"))?;
            let r = recount(&mut tx);
            drop(tx);
            r?
        };
        report.clients_recounted = clients;
        if let Some(first) = problems.first() {
            report.counter_mismatches += 1;
            tracing::error!(
                problems = problems.len(),
                first = %first,
                "counters differ from a recount; rebuilding them"
            );
            let id = self.incident_id(now_ms)?;
            let summary = format!(
                "{} counter(s) differed from a recount; rebuilt (the first: {first})",
                problems.len(),
            );
            let evidence = problems.join("\n").into_bytes();
            self.in_tx("rebuild counters", |tx, _| {
                rebuild_counters(tx)?;
                crate::incidents::insert(
                    tx,
                    id,
                    &NewIncident {
                        kind: wire::IncidentKind::CounterMismatch,
                        scope_kind: wire::ScopeKind::GlobalStore,
                        scope_key: String::new(),
                        client_id: None,
                        issue_uuid: None,
                        summary: summary.clone(),
                        evidence: evidence.clone(),
                        data_loss: false,
                    },
                    now_ms,
                )?;
                // repaired at once: recorded resolved
                crate::prep::execute(
                    tx,
                    "UPDATE storage_incidents SET state = 2, resolved_ms = $2
                     WHERE incident_id = $1",
                    &[&id.as_slice(), &now_ms],
                )
                .map_err(Fail::db("resolve the counter incident"))?;
                Ok(())
            })?;
        }
        report.cycle_completed = true;
        self.scrub = ScrubState::Done(now_ms);
        tracing::info!(
            clients,
            consistent = problems.is_empty(),
            "background scrub cycle finished"
        );
        Ok(())
    }
}
