//! Fleet runs on PostgreSQL (docs/fleet.md), as `rvbox_store::fleet` does
//! them on SQLite: the submission (run, targets, the first released
//! commands, the idempotency row and the audit record), each release pass
//! of the pump and each operator action is one transaction. The release
//! rule itself ([`rvbox_store::fleet::advance`]) is shared: this module
//! only gives it PostgreSQL's writes. Targets follow their commands and
//! runs' counters follow their targets through the schema's triggers.
//!
//! Replicas: every transaction that releases or acts on a run first locks
//! the run's row (`FOR UPDATE`), so two replicas never release from one
//! run at once (never past its rate, never a target twice: a target
//! leaves `pending` in the transaction that creates its command). A
//! released command and a fleet signal wake the client's replica
//! (`NOTIFY`), and a new or resumed run wakes the replica that holds the
//! pump duty.

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::DomainError;
use rvbox_domain::fleet::target_issue;
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::audit::AuditRecord;
use rvbox_store::fleet::{
    self as shared, Acted, FleetActTx, FleetTx, Pass, PreparedRun, RawRun, RunRow, TargetRow, act,
    action_answer, action_request, advance, check_fresh_run, check_targets, late_until, must,
    prepare_run, replayed_action, replayed_run, run_state,
};
use rvbox_store::mutations::{Assigned, Owner, Stored};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::fleet::{FleetAction, FleetAnswer, FleetOutcome};
use rvbox_store_port::replica::Duty;
use rvbox_store_port::signals::SignalPlan;

use crate::audit::write_in;
use crate::commands::{
    NewCommand, ScriptChunk, command_exists, finish_in, insert_command_in, load_view, tombstoned,
};
use crate::sessions::{to_i64, to_u64};
use crate::{Fail, PgStore, StoreOptions, mutations};

use rvbox_store::fleet::{FLEET_RELEASE_BATCH, MAX_LIVE_RUNS_PER_PASS, MAX_RUNS_PRUNED_PER_PASS};

/// A run row, locked for the transaction.
const LOAD_RUN: &str = "SELECT run_id, state, stop_reason, selection, spec_zstd, script_zstd, \
     queue_ttl_ms, max_parallel, max_errors, created_ms, late_until_ms, done_ms, targets, \
     n_pending, n_queued, n_running, n_succeeded, n_failed, n_unreachable, n_cancelled, \
     n_skipped, change_seq FROM fleet_runs WHERE run_id = $1 FOR UPDATE";

/// A run row with the columns of [`rvbox_store::fleet::RUN_COLUMNS`].
pub(crate) fn run_of(r: &postgres::Row) -> RawRun {
    let n = |i: usize| to_u64(r.get(i));
    let id: Vec<u8> = r.get(0);
    (
        RunRow {
            run_id: <[u8; 16]>::try_from(id.as_slice()).unwrap_or([0; 16]),
            state: run_state(r.get(1)),
            stop_reason: i32::try_from(r.get::<_, i64>(2)).unwrap_or(0),
            selection: r.get(3),
            spec_zstd: r.get(4),
            script_zstd: r.get(5),
            queue_ttl_ms: n(6),
            max_parallel: None,
            max_errors: None,
            created_ms: r.get(9),
            late_until_ms: r.get(10),
            done_ms: r.get(11),
            targets: n(12),
            counts: rvbox_domain::fleet::Counts {
                pending: n(13),
                queued: n(14),
                running: n(15),
                succeeded: n(16),
                failed: n(17),
                unreachable: n(18),
                cancelled: n(19),
                skipped: n(20),
            },
            change_seq: n(21),
        },
        r.get(7),
        r.get(8),
    )
}

/// A target row with the columns of [`rvbox_store::fleet::TARGET_COLUMNS`].
pub(crate) fn target_of(r: &postgres::Row) -> wire::FleetTarget {
    shared::target_of_row(TargetRow {
        client_id: r.get(0),
        issue: r.get(1),
        state: r.get(2),
        lifecycle: r.get(3),
        exit_code: r.get(4),
        exit_signal: r.get(5),
        rejection: r.get(6),
        released_ms: r.get(7),
        ended_ms: r.get(8),
        late: r.get(9),
        change_seq: r.get(10),
    })
}

fn blob(v: &[u8]) -> Result<[u8; 16], Fail> {
    <[u8; 16]>::try_from(v).map_err(|_| Fail::Integrity("a stored fleet id is not 16 bytes".into()))
}

/// A release pass inside one PostgreSQL transaction.
struct PgFleet<'a, 't> {
    tx: &'a mut Transaction<'t>,
    opts: &'a StoreOptions,
    /// The run whose script was last chunked, and its chunks.
    script: Option<([u8; 16], Vec<ScriptChunk>)>,
}

impl FleetTx for PgFleet<'_, '_> {
    type Error = Fail;

    fn refusal(e: &Fail) -> Option<&DomainError> {
        match e {
            Fail::Refused(d) => Some(d),
            _ => None,
        }
    }

    fn run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, Fail> {
        crate::prep::query_opt(self.tx, LOAD_RUN, &[&run.as_slice()])
            .map_err(Fail::db("load fleet run"))?
            .map(|r| shared::decode_run(run_of(&r)).map_err(Fail::from))
            .transpose()
    }

    fn stop_for_errors(&mut self, run: &[u8; 16]) -> Result<(), Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_targets SET state = 8 WHERE run_id = $1 AND state = 1",
            &[&run.as_slice()],
        )
        .map_err(Fail::db("skip fleet targets"))?;
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_runs SET state = 3, stop_reason = 1 WHERE run_id = $1",
            &[&run.as_slice()],
        )
        .map_err(Fail::db("stop fleet run"))?;
        Ok(())
    }

    fn pending(&mut self, run: &[u8; 16], n: usize) -> Result<Vec<(String, [u8; 16])>, Fail> {
        crate::prep::query(
            self.tx,
            "SELECT client_id, issue_uuid FROM fleet_targets
             WHERE run_id = $1 AND state = 1 ORDER BY client_id LIMIT $2",
            &[&run.as_slice(), &to_i64(n as u64)],
        )
        .map_err(Fail::db("read pending fleet targets"))?
        .iter()
        .map(|r| Ok((r.get(0), blob(&r.get::<_, Vec<u8>>(1))?)))
        .collect()
    }

    fn create_command(
        &mut self,
        row: &RunRow,
        spec: &wire::ExecutionSpec,
        client: &str,
        issue: &[u8; 16],
        now_ms: i64,
    ) -> Result<(), Fail> {
        let client_id = ClientId::parse("client_id", client).map_err(DomainError::from)?;
        crate::incidents::check_writable(self.tx, &[(wire::ScopeKind::Client, client)])?;
        if tombstoned(self.tx, issue)? || command_exists(self.tx, issue)? {
            return Err(Fail::refused(
                rvbox_domain::error::Code::Conflict,
                "the target's command id already names a command",
            ));
        }
        if self.script.as_ref().is_none_or(|(r, _)| *r != row.run_id) {
            let chunks = match &row.script_zstd {
                Some(z) => {
                    let bound = usize::try_from(rvbox_domain::fleet::MAX_FLEET_SCRIPT_BYTES)
                        .unwrap_or(usize::MAX);
                    let raw = zstd::bulk::decompress(z, bound).map_err(|_| {
                        Fail::Integrity("a stored fleet script does not decode".into())
                    })?;
                    crate::commands::script_chunks(&raw)?
                }
                None => Vec::new(),
            };
            self.script = Some((row.run_id, chunks));
        }
        let script = self.script.as_ref().map_or(&[][..], |(_, c)| c.as_slice());
        let hash = command_hash(&client_id, spec);
        let new = NewCommand {
            issue,
            client_id: client,
            spec,
            spec_zstd: &row.spec_zstd,
            spec_raw_len: spec.encoded_len(),
            hash: hash.as_bytes(),
            script,
            queue_ttl_ms: row.queue_ttl_ms,
        };
        insert_command_in(self.tx, self.opts, &new, now_ms)?;
        Ok(())
    }

    fn released(&mut self, run: &[u8; 16], client: &str, now_ms: i64) -> Result<(), Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_targets SET state = 2, lifecycle = 1, released_ms = $3
             WHERE run_id = $1 AND client_id = $2",
            &[&run.as_slice(), &client, &now_ms],
        )
        .map_err(Fail::db("release fleet target"))?;
        // the replica holding the client's socket looks at it at once
        crate::notify::client(self.tx, client, None)
    }

    fn refused(
        &mut self,
        run: &[u8; 16],
        client: &str,
        detail: &wire::ErrorDetail,
        now_ms: i64,
    ) -> Result<(), Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_targets SET state = 5, rejection = $3, released_ms = $4, ended_ms = $4
             WHERE run_id = $1 AND client_id = $2",
            &[&run.as_slice(), &client, &detail.encode_to_vec(), &now_ms],
        )
        .map_err(Fail::db("refuse fleet target"))?;
        Ok(())
    }

    fn end(&mut self, run: &[u8; 16], now_ms: i64) -> Result<(), Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_runs SET state = 4, done_ms = $2 WHERE run_id = $1",
            &[&run.as_slice(), &now_ms],
        )
        .map_err(Fail::db("end fleet run"))?;
        Ok(())
    }
}

impl FleetActTx for PgFleet<'_, '_> {
    fn set_state(&mut self, run: &[u8; 16], state: wire::FleetRunState) -> Result<(), Fail> {
        set_state(self.tx, run, state)
    }

    fn cancel_pending(&mut self, run: &[u8; 16]) -> Result<u64, Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_targets SET state = 7 WHERE run_id = $1 AND state = 1",
            &[&run.as_slice()],
        )
        .map_err(Fail::db("cancel fleet targets"))
    }

    fn stop_cancelled(&mut self, run: &[u8; 16]) -> Result<(), Fail> {
        crate::prep::execute(
            self.tx,
            "UPDATE fleet_runs SET state = 3, stop_reason = 2 WHERE run_id = $1",
            &[&run.as_slice()],
        )
        .map_err(Fail::db("cancel fleet run"))?;
        Ok(())
    }

    fn targets_in(
        &mut self,
        run: &[u8; 16],
        states: &[wire::FleetTargetState],
    ) -> Result<Vec<(String, [u8; 16])>, Fail> {
        let states: Vec<i64> = states.iter().map(|s| i64::from(*s as i32)).collect();
        released_targets(self.tx, run, &states)
    }

    fn command(&mut self, issue: &[u8; 16]) -> Result<CommandView, Fail> {
        load_view(self.tx, issue, true)
    }

    fn plan(&self, view: &CommandView, signal: i32) -> Result<SignalPlan, DomainError> {
        rvbox_server_core::signal_plan(view, signal)
    }

    fn raise(
        &mut self,
        client: &str,
        view: &CommandView,
        signal: Option<wire::SignalKind>,
        now_ms: i64,
    ) -> Result<u64, Fail> {
        let next = crate::signals::raise_revision(self.tx, view, signal, now_ms)?;
        if signal.is_some() {
            // the replica holding the client's socket sends it at once
            crate::notify::client(self.tx, client, Some(&view.issue_uuid))?;
        }
        Ok(next)
    }

    fn cancel_queued(&mut self, view: &CommandView, now_ms: i64) -> Result<(), Fail> {
        finish_in(
            self.tx,
            view,
            Lifecycle::Cancelled,
            None,
            now_ms,
            self.opts.tombstone_cap,
        )
    }

    fn resumed(&mut self) -> Result<(), Fail> {
        wake_pump(self.tx)
    }
}

fn any_live(tx: &mut Transaction<'_>) -> Result<bool, Fail> {
    Ok(crate::prep::query_one(
        tx,
        "SELECT EXISTS (SELECT 1 FROM fleet_runs WHERE state < 4)",
        &[],
    )
    .map_err(Fail::db("read live fleet runs"))?
    .get(0))
}

fn run_tombstoned(tx: &mut Transaction<'_>, run: &[u8; 16]) -> Result<bool, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM fleet_run_tombstones WHERE run_id = $1",
        &[&run.as_slice()],
    )
    .map_err(Fail::db("check fleet run tombstone"))?
    .is_some())
}

fn run_exists(tx: &mut Transaction<'_>, run: &[u8; 16]) -> Result<bool, Fail> {
    Ok(crate::prep::query_opt(
        tx,
        "SELECT 1 FROM fleet_runs WHERE run_id = $1",
        &[&run.as_slice()],
    )
    .map_err(Fail::db("look up fleet run"))?
    .is_some())
}

/// The clients a selection resolves to (as on SQLite): an explicit list as
/// given, filtered by a glob or selector when one is given too (a client
/// unknown here has no labels), or every known client that matches, by id.
fn resolve(
    tx: &mut Transaction<'_>,
    sel: &rvbox_domain::fleet::Selection,
) -> Result<Vec<String>, Fail> {
    let mut out = Vec::new();
    if !sel.client_ids.is_empty() {
        let ids: Vec<&str> = sel.client_ids.iter().map(ClientId::as_str).collect();
        let known: std::collections::HashMap<String, String> = crate::prep::query(
            tx,
            "SELECT client_id, labels FROM clients WHERE client_id = ANY($1)",
            &[&ids],
        )
        .map_err(Fail::db("read client labels"))?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
        for id in ids {
            let labels =
                rvbox_store::records::stored_labels(known.get(id).map_or("", String::as_str));
            if sel.matches(id, &labels) {
                out.push(id.to_owned());
            }
        }
        return Ok(out);
    }
    for r in crate::prep::query(
        tx,
        "SELECT client_id, labels FROM clients ORDER BY client_id",
        &[],
    )
    .map_err(Fail::db("read clients"))?
    {
        let id: String = r.get(0);
        if sel.matches(&id, &rvbox_store::records::stored_labels(r.get(1))) {
            out.push(id);
            if out.len() > rvbox_domain::fleet::MAX_FLEET_TARGETS {
                break;
            }
        }
    }
    Ok(out)
}

/// Tells the replica holding the pump duty that a run may release now.
fn wake_pump(tx: &mut Transaction<'_>) -> Result<(), Fail> {
    crate::prep::execute(
        tx,
        "SELECT pg_notify($1, '')",
        &[&crate::notify::FLEET_CHANNEL],
    )
    .map_err(Fail::db("notify the fleet pump"))?;
    Ok(())
}

/// Adds `client` as a late target of every live run whose include_late
/// window is open and whose selection it matches, inside the caller's
/// (registration's) transaction. Returns how many it joined.
pub(crate) fn add_late_targets_in(
    tx: &mut Transaction<'_>,
    client: &str,
    labels: &str,
    now_ms: i64,
) -> Result<u32, Fail> {
    let runs = crate::prep::query(
        tx,
        "SELECT run_id, selection, targets FROM fleet_runs
         WHERE state < 3 AND late_until_ms > $1",
        &[&now_ms],
    )
    .map_err(Fail::db("read late fleet runs"))?;
    if runs.is_empty() {
        return Ok(0);
    }
    let labels = rvbox_store::records::stored_labels(labels);
    let mut joined = 0;
    for r in runs {
        let run = blob(&r.get::<_, Vec<u8>>(0))?;
        if !shared::joins_late(&r.get::<_, Vec<u8>>(1), to_u64(r.get(2)), client, &labels)? {
            continue;
        }
        let run_id = Uuid7::from_bytes("fleet_run_id", run)
            .map_err(|_| Fail::Integrity("a stored fleet run id is not a UUIDv7".into()))?;
        let issue = target_issue(&run_id, client);
        let added = crate::prep::execute(
            tx,
            "INSERT INTO fleet_targets (run_id, client_id, issue_uuid, state, late)
             VALUES ($1, $2, $3, 1, true) ON CONFLICT DO NOTHING",
            &[&run.as_slice(), &client, &issue.as_bytes().as_slice()],
        )
        .map_err(Fail::db("add late fleet target"))?;
        if added > 0 {
            joined += 1;
            tracing::info!(fleet_run_id = %run_id, client_id = %client, "late fleet target added");
        }
    }
    if joined > 0 {
        wake_pump(tx)?;
    }
    Ok(joined)
}

/// Retention of fleet runs (as on SQLite): a done run goes once none of
/// its targets' commands remain, or once it has been done longer than
/// `retention_ms` (0 keeps such runs), at most
/// [`MAX_RUNS_PRUNED_PER_PASS`] per pass, its id kept as a tombstone.
pub(crate) fn prune_done_runs_in(
    tx: &mut Transaction<'_>,
    now_ms: i64,
    retention_ms: u64,
    tombstone_cap: u64,
) -> Result<u64, Fail> {
    let aged_before = if retention_ms == 0 {
        i64::MIN
    } else {
        now_ms.saturating_sub(to_i64(retention_ms))
    };
    let runs: Vec<Vec<u8>> = crate::prep::query(
        tx,
        "SELECT r.run_id FROM fleet_runs r
         WHERE r.state = 4
           AND (r.done_ms < $1
                OR (r.targets > 0 AND NOT EXISTS (
                       SELECT 1 FROM fleet_targets t JOIN commands c
                         ON c.issue_uuid = t.issue_uuid
                       WHERE t.run_id = r.run_id)))
         ORDER BY r.created_ms LIMIT $2
         FOR UPDATE OF r SKIP LOCKED",
        &[&aged_before, &MAX_RUNS_PRUNED_PER_PASS],
    )
    .map_err(Fail::db("select done fleet runs"))?
    .iter()
    .map(|r| r.get(0))
    .collect();
    for run in &runs {
        // the id stays refused: a replayed RunFleet never makes it again
        crate::prep::execute(
            tx,
            "INSERT INTO fleet_run_tombstones (run_id, pruned_ms) VALUES ($1, $2)
             ON CONFLICT (run_id) DO NOTHING",
            &[run, &now_ms],
        )
        .map_err(Fail::db("insert fleet run tombstone"))?;
        crate::prep::execute(tx, "DELETE FROM fleet_runs WHERE run_id = $1", &[run])
            .map_err(Fail::db("delete done fleet run"))?;
    }
    if !runs.is_empty() {
        // identity values have gaps here: count by order, not by span
        crate::prep::execute(
            tx,
            "DELETE FROM fleet_run_tombstones WHERE seq IN (
                 SELECT seq FROM fleet_run_tombstones ORDER BY seq DESC OFFSET $1)",
            &[&to_i64(tombstone_cap.max(1))],
        )
        .map_err(Fail::db("trim fleet run tombstones"))?;
        tracing::info!(runs = runs.len(), "done fleet runs deleted by retention");
    }
    Ok(runs.len() as u64)
}

fn caller_of(caller: &Caller) -> rvbox_store::operator::Caller {
    rvbox_store::operator::Caller {
        transport: caller.transport.clone(),
        principal: caller.principal.clone(),
    }
}

impl PgStore {
    /// `RunFleet`, idempotent by `request_id`, audited in its transaction
    /// (on its own after a refusal or a replay).
    pub(crate) fn run_fleet(
        &mut self,
        req: &wire::RunFleetRequest,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<FleetOutcome, Fail> {
        let mut rec = AuditRecord::control(&caller_of(caller), "RunFleet", now_ms);
        rec.detail = shared::run_audit_detail(req);
        let result = prepare_run(req)
            .map_err(Fail::from)
            .and_then(|p| self.run_fleet_in(&p, &rec, now_ms));
        if !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        if let Err(Fail::Refused(e)) = &result {
            tracing::warn!(code = e.code().as_str(), "RunFleet refused");
        }
        result
    }

    fn run_fleet_in(
        &mut self,
        p: &PreparedRun,
        rec: &AuditRecord,
        now_ms: i64,
    ) -> Result<FleetOutcome, Fail> {
        let run_id = p.run_id;
        let (targets, outcome) = self.in_tx("RunFleet", |tx, opts| {
            crate::incidents::check_writable(tx, &[])?;
            let owner = Owner::FleetRun(&run_id);
            if let Some(stored) =
                mutations::lookup(tx, &p.run, "RunFleet", &p.mutation_hash, owner)?
            {
                let response = replayed_run(stored)?;
                let mut out = FleetOutcome::answer(FleetAnswer::Run(response));
                out.replayed = true;
                out.live = any_live(tx)?;
                return Ok((0, out));
            }
            check_fresh_run(run_exists(tx, &run_id)?, run_tombstoned(tx, &run_id)?)?;
            let targets = resolve(tx, &p.selection)?;
            check_targets(targets.len(), p.late_ms)?;
            let ttl_ms = p.queue_ttl_ms.unwrap_or(opts.queue_ttl_ms);
            let max_parallel = p.max_parallel.map(|l| l.to_wire().encode_to_vec());
            let max_errors = p.max_errors.map(|l| l.to_wire().encode_to_vec());
            let params: [&(dyn postgres::types::ToSql + Sync); 10] = [
                &run_id.as_slice(),
                &p.selection_wire,
                &p.spec_zstd,
                &to_i64(p.spec_raw_len as u64),
                &p.script_zstd,
                &to_i64(ttl_ms),
                &max_parallel,
                &max_errors,
                &now_ms,
                &late_until(p.late_ms, now_ms),
            ];
            crate::prep::execute(
                tx,
                "INSERT INTO fleet_runs (run_id, state, selection, spec_zstd, spec_raw_len,
                     script_zstd, queue_ttl_ms, max_parallel, max_errors, created_ms, late_until_ms)
                 VALUES ($1, 1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                &params,
            )
            .map_err(Fail::db("insert fleet run"))?;
            let issues: Vec<Vec<u8>> = targets
                .iter()
                .map(|c| target_issue(&p.run, c).as_bytes().to_vec())
                .collect();
            crate::prep::execute(
                tx,
                "INSERT INTO fleet_targets (run_id, client_id, issue_uuid, state)
                 SELECT $1, c, i, 1 FROM unnest($2::text[], $3::bytea[]) AS t (c, i)",
                &[&run_id.as_slice(), &targets, &issues],
            )
            .map_err(Fail::db("insert fleet targets"))?;
            let response = wire::RunFleetResponse {
                fleet_run_id: p.run.to_string(),
                targets: u32::try_from(targets.len()).unwrap_or(u32::MAX),
            };
            let stored: Stored = Ok(response.encode_to_vec());
            write_in(tx, rec, Ok(()))?;
            mutations::record(
                tx,
                &p.run,
                "RunFleet",
                &p.mutation_hash,
                owner,
                &stored,
                Assigned::default(),
                now_ms,
            )?;
            let mut budget = FLEET_RELEASE_BATCH;
            let mut pass = Pass::default();
            advance(
                &mut PgFleet {
                    tx,
                    opts,
                    script: None,
                },
                &run_id,
                &mut budget,
                &mut pass,
                now_ms,
            )?;
            let live = any_live(tx)?;
            if live {
                wake_pump(tx)?;
            }
            Ok((
                targets.len(),
                pass.into_outcome(FleetAnswer::Run(response), Vec::new(), live, false),
            ))
        })?;
        if !outcome.replayed {
            tracing::info!(
                fleet_run_id = %p.run,
                targets,
                released = outcome.released.len(),
                late_ms = p.late_ms,
                "fleet run created"
            );
        }
        Ok(outcome)
    }

    /// One release pass over the live runs (oldest first), in one
    /// transaction, by the replica holding the pump duty (any other finds
    /// nothing to do).
    pub(crate) fn fleet_pump(&mut self, limit: usize, now_ms: i64) -> Result<FleetOutcome, Fail> {
        let replica = self.replica();
        self.in_tx("fleet pass", |tx, opts| {
            if !crate::maintenance::holds(tx, replica, Duty::FleetPump)? {
                let mut out = FleetOutcome::answer(FleetAnswer::None);
                out.live = false;
                return Ok(out);
            }
            let runs: Vec<[u8; 16]> = crate::prep::query(
                tx,
                "SELECT run_id FROM fleet_runs WHERE state < 4
                 ORDER BY created_ms, run_id LIMIT $1",
                &[&to_i64(MAX_LIVE_RUNS_PER_PASS as u64)],
            )
            .map_err(Fail::db("read live fleet runs"))?
            .iter()
            .map(|r| blob(&r.get::<_, Vec<u8>>(0)))
            .collect::<Result<_, _>>()?;
            if runs.is_empty() {
                let mut out = FleetOutcome::answer(FleetAnswer::None);
                out.live = false;
                return Ok(out);
            }
            let mut budget = limit.min(FLEET_RELEASE_BATCH);
            let mut pass = Pass::default();
            let mut t = PgFleet {
                tx,
                opts,
                script: None,
            };
            for run in &runs {
                advance(&mut t, run, &mut budget, &mut pass, now_ms)?;
            }
            let live = any_live(tx)?;
            Ok(pass.into_outcome(
                FleetAnswer::None,
                Vec::new(),
                live,
                runs.len() >= MAX_LIVE_RUNS_PER_PASS,
            ))
        })
    }

    /// `SignalFleetRun`, `CancelFleetRun`, `PauseFleetRun` and
    /// `ResumeFleetRun`, idempotent by `request_id`, the dispatch core's
    /// signal rule applied to each target's command as `SignalCommand`
    /// applies it.
    pub(crate) fn fleet_action(
        &mut self,
        action: &FleetAction,
        caller: &Caller,
        now_ms: i64,
    ) -> Result<FleetOutcome, Fail> {
        let method = action.method();
        let mut rec = AuditRecord::control(&caller_of(caller), method, now_ms);
        rec.detail = format!("fleet run {}", action.ids().1);
        let result =
            action_request(action)
                .map_err(Fail::from)
                .and_then(|(request_id, run_id, hash)| {
                    self.fleet_action_in(action, &request_id, &run_id, &hash, &rec, now_ms)
                });
        if !matches!(&result, Ok(o) if !o.replayed) {
            self.audit_alone(&rec, &result);
        }
        match &result {
            Ok(o) if !o.replayed => tracing::info!(
                method,
                fleet_run_id = %action.ids().1,
                signals = o.deliver.len(),
                "fleet action recorded"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(method, error = %e, "fleet action refused"),
        }
        result
    }

    fn fleet_action_in(
        &mut self,
        action: &FleetAction,
        request_id: &Uuid7,
        run_id: &[u8; 16],
        hash: &rvbox_domain::hash::RequestHash,
        rec: &AuditRecord,
        now_ms: i64,
    ) -> Result<FleetOutcome, Fail> {
        let method = action.method();
        self.in_tx("fleet action", |tx, opts| {
            crate::incidents::check_writable(tx, &[])?;
            let owner = Owner::FleetRun(run_id);
            if let Some(stored) = mutations::lookup(tx, request_id, method, hash, owner)? {
                let mut out = FleetOutcome::answer(replayed_action(action, stored)?);
                out.replayed = true;
                out.live = any_live(tx)?;
                return Ok(out);
            }
            let mut t = PgFleet {
                tx,
                opts,
                script: None,
            };
            let row = must(&mut t, run_id)?;
            let Acted {
                deliver,
                cancelled,
                signalled,
                mut budget,
            } = act(&mut t, action, &row, now_ms)?;
            let mut pass = Pass::default();
            advance(&mut t, run_id, &mut budget, &mut pass, now_ms)?;
            let record = shared::record_of(&must(&mut t, run_id)?)?;
            let tx = t.tx;
            let (answer, bytes) = action_answer(action, run_id, record, cancelled, signalled);
            write_in(tx, rec, Ok(()))?;
            mutations::record(
                tx,
                request_id,
                method,
                hash,
                owner,
                &Ok(bytes),
                Assigned::default(),
                now_ms,
            )?;
            let live = any_live(tx)?;
            Ok(pass.into_outcome(answer, deliver, live, false))
        })
    }
}

fn set_state(
    tx: &mut Transaction<'_>,
    run: &[u8; 16],
    state: wire::FleetRunState,
) -> Result<(), Fail> {
    crate::prep::execute(
        tx,
        "UPDATE fleet_runs SET state = $2 WHERE run_id = $1",
        &[&run.as_slice(), &i64::from(state as i32)],
    )
    .map_err(Fail::db("set fleet run state"))?;
    Ok(())
}

/// Released targets in `states`, by state then client id.
fn released_targets(
    tx: &mut Transaction<'_>,
    run: &[u8; 16],
    states: &[i64],
) -> Result<Vec<(String, [u8; 16])>, Fail> {
    let mut out = Vec::new();
    for state in states {
        for r in crate::prep::query(
            tx,
            "SELECT client_id, issue_uuid FROM fleet_targets
             WHERE run_id = $1 AND state = $2 ORDER BY client_id",
            &[&run.as_slice(), state],
        )
        .map_err(Fail::db("read released fleet targets"))?
        {
            out.push((r.get(0), blob(&r.get::<_, Vec<u8>>(1))?));
        }
    }
    Ok(out)
}
