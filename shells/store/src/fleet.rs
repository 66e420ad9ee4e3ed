//! Fleet runs (docs/fleet.md): one command on every client a selection
//! resolves to, with rate control.
//!
//! A run is a `fleet_runs` row, one `fleet_targets` row per client, and,
//! once a target is released, an ordinary command whose id is derived from
//! the run id and the client id ([`rvbox_domain::fleet::target_issue`]).
//! Every step is one transaction: the submission (run, targets, the first
//! released commands and the idempotency row), each release pass of the
//! pump, each operator action. Targets follow their commands' lifecycles
//! and runs' counters follow their targets through triggers (migration 9),
//! so they change in the transaction of whatever moved the command.
//!
//! Must never: release a target twice (a target leaves `pending` in the
//! transaction that creates its command), or release past the run's rate.

use std::collections::BTreeSet;

use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::fleet::{
    Counts, Limit, MAX_FLEET_SCRIPT_BYTES, MAX_FLEET_TARGETS, MAX_INCLUDE_LATE_MS, Selection, step,
    target_issue,
};
use rvbox_domain::hash::{command_hash, request_hash};
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::token::{PagePosition, TokenCodec, TokenKey, TokenKind, encode_filters};
use rvbox_proto::v1 as wire;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::fleet::{FleetAction, FleetAnswer, FleetOutcome};
use rvbox_store_port::signals::SignalPlan;

use crate::db::Cached as _;
use crate::error::StoreError;
use crate::health::Health;
use crate::mutations::{self, Assigned, OpError, Owner, Stored};
use crate::store::{
    CommandRow, Store, StoreOptions, apply_owner_global, command_exists, insert_command_in, to_i64,
    to_timestamp, to_u64, tombstoned,
};

/// Most targets one transaction releases (the submission's and each pump
/// pass's); the rest go in the next pass, at once.
pub const FLEET_RELEASE_BATCH: usize = 2_048;
/// Most live runs one pump pass looks at (oldest first).
pub const MAX_LIVE_RUNS_PER_PASS: usize = 256;

/// The columns of a run row, in [`RawRun`] order.
pub const RUN_COLUMNS: &str = "run_id, state, stop_reason, selection, spec_zstd, script_zstd, \
     queue_ttl_ms, max_parallel, max_errors, created_ms, late_until_ms, done_ms, targets, \
     n_pending, n_queued, n_running, n_succeeded, n_failed, n_unreachable, n_cancelled, \
     n_skipped, change_seq";

/// The columns of a target row, in [`TargetRow`] order.
pub const TARGET_COLUMNS: &str = "client_id, issue_uuid, state, lifecycle, exit_code, exit_signal, \
     rejection, released_ms, ended_ms, late, change_seq";

/// One `fleet_runs` row as read (either backend).
#[derive(Debug, Clone)]
pub struct RunRow {
    /// Run id.
    pub run_id: [u8; 16],
    /// State.
    pub state: wire::FleetRunState,
    /// `rvbox.v1.FleetStopReason`.
    pub stop_reason: i32,
    /// Encoded `FleetSelection`.
    pub selection: Vec<u8>,
    /// zstd of the encoded, normalized spec.
    pub spec_zstd: Vec<u8>,
    /// zstd of the script, when the run has one.
    pub script_zstd: Option<Vec<u8>>,
    /// Each target command's queue TTL (0: indefinite).
    pub queue_ttl_ms: u64,
    /// `max_parallel`.
    pub max_parallel: Option<Limit>,
    /// `max_errors`.
    pub max_errors: Option<Limit>,
    /// Creation time.
    pub created_ms: i64,
    /// End of the include_late window.
    pub late_until_ms: Option<i64>,
    /// When the run ended.
    pub done_ms: Option<i64>,
    /// Targets in all.
    pub targets: u64,
    /// Targets by state.
    pub counts: Counts,
    /// Position of the latest target change.
    pub change_seq: u64,
}

fn integrity(what: &str) -> StoreError {
    StoreError::Integrity(format!("stored fleet run {what} does not decode"))
}

fn limit_of(bytes: Option<Vec<u8>>) -> Result<Option<Limit>, StoreError> {
    let Some(b) = bytes else { return Ok(None) };
    let l = wire::FleetLimit::decode(b.as_slice()).map_err(|_| integrity("limit"))?;
    Limit::from_wire("limit", Some(&l)).map_err(|_| integrity("limit"))
}

/// A run row with its two encoded limits, not yet decoded.
pub type RawRun = (RunRow, Option<Vec<u8>>, Option<Vec<u8>>);

/// Decodes a run row's limits and checks its state.
///
/// # Errors
/// [`StoreError::Integrity`] for a state or limit that does not decode.
pub fn decode_run(raw: RawRun) -> Result<RunRow, StoreError> {
    let (mut row, parallel, errors) = raw;
    if row.state == wire::FleetRunState::Unspecified {
        return Err(integrity("state"));
    }
    row.max_parallel = limit_of(parallel)?;
    row.max_errors = limit_of(errors)?;
    Ok(row)
}

/// The fleet run state of a stored number (`Unspecified` when unknown,
/// which [`decode_run`] refuses).
#[must_use]
pub fn run_state(n: i64) -> wire::FleetRunState {
    i32::try_from(n)
        .ok()
        .and_then(|n| wire::FleetRunState::try_from(n).ok())
        .unwrap_or(wire::FleetRunState::Unspecified)
}

fn run_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRun> {
    let id: Vec<u8> = r.get(0)?;
    let state: i32 = r.get(1)?;
    let n = |i: usize| -> rusqlite::Result<u64> { Ok(to_u64(r.get(i)?)) };
    Ok((
        RunRow {
            run_id: <[u8; 16]>::try_from(id.as_slice()).unwrap_or([0; 16]),
            state: wire::FleetRunState::try_from(state).unwrap_or(wire::FleetRunState::Unspecified),
            stop_reason: r.get(2)?,
            selection: r.get(3)?,
            spec_zstd: r.get(4)?,
            script_zstd: r.get(5)?,
            queue_ttl_ms: n(6)?,
            max_parallel: None,
            max_errors: None,
            created_ms: r.get(9)?,
            late_until_ms: r.get(10)?,
            done_ms: r.get(11)?,
            targets: n(12)?,
            counts: Counts {
                pending: n(13)?,
                queued: n(14)?,
                running: n(15)?,
                succeeded: n(16)?,
                failed: n(17)?,
                unreachable: n(18)?,
                cancelled: n(19)?,
                skipped: n(20)?,
            },
            change_seq: n(21)?,
        },
        r.get(7)?,
        r.get(8)?,
    ))
}

fn load_run(conn: &Connection, run: &[u8; 16]) -> Result<Option<RunRow>, StoreError> {
    let row = conn
        .query_row_cached(
            &format!("SELECT {RUN_COLUMNS} FROM fleet_runs WHERE run_id = ?1"),
            params![run.as_slice()],
            run_of,
        )
        .optional()
        .map_err(|e| StoreError::sqlite("load fleet run", e))?;
    row.map(decode_run).transpose()
}

fn must_run(conn: &Connection, run: &[u8; 16]) -> Result<RunRow, OpError> {
    load_run(conn, run)?.ok_or_else(|| {
        OpError::Refused(
            DomainError::new(Code::NotFound, "no such fleet run").with_field("fleet_run_id"),
        )
    })
}

/// The run's spec, decompressed and decoded.
///
/// # Errors
/// [`StoreError::Integrity`] when it does not decode.
pub fn spec_of(row: &RunRow) -> Result<wire::ExecutionSpec, StoreError> {
    let raw = zstd::bulk::decompress(
        &row.spec_zstd,
        usize::try_from(rvbox_domain::limits::MAX_EXECUTION_SPEC_BYTES).unwrap_or(usize::MAX),
    )
    .map_err(|_| integrity("spec"))?;
    wire::ExecutionSpec::decode(raw.as_slice()).map_err(|_| integrity("spec"))
}

/// The run as `GetFleetRun` answers it.
///
/// # Errors
/// [`StoreError::Integrity`] when a stored field does not decode.
pub fn record_of(row: &RunRow) -> Result<wire::FleetRunRecord, StoreError> {
    let selection = wire::FleetSelection::decode(row.selection.as_slice())
        .map_err(|_| integrity("selection"))?;
    Ok(wire::FleetRunRecord {
        fleet_run_id: uuid_text(&row.run_id),
        state: row.state as i32,
        stop_reason: row.stop_reason,
        selection: Some(selection),
        spec: Some(spec_of(row)?),
        max_parallel: row.max_parallel.map(Limit::to_wire),
        max_errors: row.max_errors.map(Limit::to_wire),
        create_time: Some(to_timestamp(row.created_ms)),
        late_until_time: row.late_until_ms.map(to_timestamp),
        done_time: row.done_ms.map(to_timestamp),
        targets: u32::try_from(row.targets).unwrap_or(u32::MAX),
        counts: Some(row.counts.to_wire()),
        change_seq: row.change_seq,
    })
}

/// A 16-byte id as canonical text.
#[must_use]
pub fn uuid_text(b: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*b).hyphenated().to_string()
}

/// One `fleet_targets` row as stored (the columns of `TARGET_COLUMNS`).
#[derive(Debug, Clone)]
pub struct TargetRow {
    /// Client.
    pub client_id: String,
    /// The target's command id.
    pub issue: Vec<u8>,
    /// `rvbox.v1.FleetTargetState`.
    pub state: i64,
    /// The command's lifecycle, once released.
    pub lifecycle: Option<i64>,
    /// Exit code.
    pub exit_code: Option<i64>,
    /// Exit signal.
    pub exit_signal: Option<i64>,
    /// Encoded `ErrorDetail` of a refused release.
    pub rejection: Option<Vec<u8>>,
    /// Release time.
    pub released_ms: Option<i64>,
    /// End time.
    pub ended_ms: Option<i64>,
    /// Joined through the include_late window.
    pub late: bool,
    /// Position of its latest change.
    pub change_seq: i64,
}

/// A target as the fleet reads answer it.
#[must_use]
pub fn target_of_row(r: TargetRow) -> wire::FleetTarget {
    let lifecycle = r.lifecycle.and_then(|l| i32::try_from(l).ok());
    let terminal = lifecycle.is_some_and(|l| l >= wire::Lifecycle::Succeeded as i32);
    wire::FleetTarget {
        client_id: r.client_id,
        issue_uuid: uuid::Uuid::from_slice(&r.issue)
            .map(|u| u.hyphenated().to_string())
            .unwrap_or_default(),
        state: i32::try_from(r.state).unwrap_or(0),
        lifecycle: lifecycle.unwrap_or(0),
        exit_result: terminal.then(|| wire::ExitResult {
            lifecycle: lifecycle.unwrap_or(0),
            exit_code: r.exit_code.and_then(|c| i32::try_from(c).ok()),
            signal_number: r.exit_signal.and_then(|c| i32::try_from(c).ok()),
            signal_name: String::new(),
        }),
        rejection: r
            .rejection
            .and_then(|b| wire::ErrorDetail::decode(b.as_slice()).ok()),
        release_time: r.released_ms.map(to_timestamp),
        end_time: r.ended_ms.map(to_timestamp),
        late: r.late,
        change_seq: to_u64(r.change_seq),
    }
}

fn target_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<wire::FleetTarget> {
    Ok(target_of_row(TargetRow {
        client_id: r.get(0)?,
        issue: r.get(1)?,
        state: r.get(2)?,
        lifecycle: r.get(3)?,
        exit_code: r.get(4)?,
        exit_signal: r.get(5)?,
        rejection: r.get(6)?,
        released_ms: r.get(7)?,
        ended_ms: r.get(8)?,
        late: r.get(9)?,
        change_seq: r.get(10)?,
    }))
}

fn invalid(field: &'static str, msg: impl AsRef<str>) -> OpError {
    OpError::Refused(DomainError::new(Code::InvalidArgument, msg).with_field(field))
}

fn parse_run_id(text: &str) -> Result<[u8; 16], OpError> {
    Ok(*Uuid7::parse("fleet_run_id", text)
        .map_err(DomainError::from)?
        .as_bytes())
}

/// What one release pass changed.
#[derive(Debug, Default)]
pub struct Pass {
    /// Clients that got a new command.
    pub released: BTreeSet<String>,
    /// A run stopped at the pass's bound: pump again at once.
    pub more: bool,
}

impl Pass {
    /// The outcome of a fleet operation whose release pass this was:
    /// `more_runs` when the pass stopped at its bound of live runs.
    #[must_use]
    pub fn into_outcome(
        self,
        answer: FleetAnswer,
        deliver: Vec<(String, wire::Signal)>,
        live: bool,
        more_runs: bool,
    ) -> FleetOutcome {
        FleetOutcome {
            answer,
            released: self.released.into_iter().collect(),
            deliver,
            live,
            more: self.more || more_runs,
            replayed: false,
        }
    }
}

/// The writes of a release pass, inside one transaction of a store
/// backend: the rule of [`advance`] is the same on every backend.
pub trait FleetTx {
    /// The backend's failure.
    type Error: From<DomainError> + From<StoreError>;
    /// The refusal inside `e`, if it is one (a refused target release ends
    /// that target `failed`; anything else fails the pass).
    fn refusal(e: &Self::Error) -> Option<&DomainError>;
    /// The run, held against concurrent passes until the transaction ends.
    ///
    /// # Errors
    /// A store failure.
    fn run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, Self::Error>;
    /// Skips the run's pending targets and stops it for `max_errors`.
    ///
    /// # Errors
    /// A store failure.
    fn stop_for_errors(&mut self, run: &[u8; 16]) -> Result<(), Self::Error>;
    /// At most `n` pending targets (client, command id), by client id.
    ///
    /// # Errors
    /// A store failure.
    fn pending(&mut self, run: &[u8; 16], n: usize)
    -> Result<Vec<(String, [u8; 16])>, Self::Error>;
    /// Creates a target's command (a refusal leaves nothing written).
    ///
    /// # Errors
    /// A refusal (full queue, quota, unwritable scope, id taken) or a
    /// store failure.
    fn create_command(
        &mut self,
        row: &RunRow,
        spec: &wire::ExecutionSpec,
        client: &str,
        issue: &[u8; 16],
        now_ms: i64,
    ) -> Result<(), Self::Error>;
    /// Marks a target released (its command was created).
    ///
    /// # Errors
    /// A store failure.
    fn released(&mut self, run: &[u8; 16], client: &str, now_ms: i64) -> Result<(), Self::Error>;
    /// Ends a target `failed` with the refusal of its release.
    ///
    /// # Errors
    /// A store failure.
    fn refused(
        &mut self,
        run: &[u8; 16],
        client: &str,
        detail: &wire::ErrorDetail,
        now_ms: i64,
    ) -> Result<(), Self::Error>;
    /// Ends the run.
    ///
    /// # Errors
    /// A store failure.
    fn end(&mut self, run: &[u8; 16], now_ms: i64) -> Result<(), Self::Error>;
}

/// The run, or `NOT_FOUND` naming `fleet_run_id`.
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn must<T: FleetTx>(t: &mut T, run: &[u8; 16]) -> Result<RunRow, T::Error> {
    t.run(run)?.ok_or_else(|| {
        DomainError::new(Code::NotFound, "no such fleet run")
            .with_field("fleet_run_id")
            .into()
    })
}

/// Releases what `run`'s rate allows (at most `budget`), stops it at
/// `max_errors`, and ends it when done, inside the caller's transaction.
///
/// # Errors
/// A store failure (a refused release fails only its target).
pub fn advance<T: FleetTx>(
    t: &mut T,
    run_id: &[u8; 16],
    budget: &mut usize,
    pass: &mut Pass,
    now_ms: i64,
) -> Result<(), T::Error> {
    use wire::FleetRunState as R;
    let row = must(t, run_id)?;
    if row.state == R::Done {
        return Ok(());
    }
    let late_open = row.late_until_ms.is_some_and(|t| t > now_ms);
    let s = step(
        row.state,
        &row.counts,
        row.max_parallel,
        row.max_errors,
        late_open,
    );
    let run_text = uuid_text(run_id);
    if s.stop_for_errors {
        t.stop_for_errors(run_id)?;
        tracing::warn!(
            fleet_run_id = %run_text,
            errors = row.counts.errors(),
            "fleet run stopped: max_errors reached"
        );
    }
    let n = usize::try_from(s.release)
        .unwrap_or(usize::MAX)
        .min(*budget);
    if n > 0 {
        release(t, &row, n, pass, now_ms)?;
        *budget -= n;
    }
    if u64::try_from(n).unwrap_or(u64::MAX) < s.release {
        pass.more = true;
    }
    // the decision again on what this pass left
    let after = must(t, run_id)?;
    let s = step(
        after.state,
        &after.counts,
        after.max_parallel,
        after.max_errors,
        late_open,
    );
    if s.done && s.release == 0 {
        t.end(run_id, now_ms)?;
        let c = after.counts;
        tracing::info!(
            fleet_run_id = %run_text,
            targets = after.targets,
            succeeded = c.succeeded,
            failed = c.failed,
            unreachable = c.unreachable,
            cancelled = c.cancelled,
            skipped = c.skipped,
            "fleet run done"
        );
    }
    Ok(())
}

/// Creates the commands of `n` pending targets of `row` (in client-id
/// order). A refused creation (a full queue, a quota, an unwritable
/// scope) ends that target `failed` with the refusal as its rejection.
fn release<T: FleetTx>(
    t: &mut T,
    row: &RunRow,
    n: usize,
    pass: &mut Pass,
    now_ms: i64,
) -> Result<(), T::Error> {
    let pending = t.pending(&row.run_id, n)?;
    let spec = spec_of(row)?;
    for (client, issue) in pending {
        match t.create_command(row, &spec, &client, &issue, now_ms) {
            Ok(()) => {
                t.released(&row.run_id, &client, now_ms)?;
                pass.released.insert(client);
            }
            Err(e) => {
                let Some(e) = T::refusal(&e) else {
                    return Err(e);
                };
                tracing::warn!(
                    fleet_run_id = %uuid_text(&row.run_id),
                    client_id = %client,
                    code = e.code().as_str(),
                    reason = %e,
                    "fleet target refused at release"
                );
                let detail = e.to_detail();
                t.refused(&row.run_id, &client, &detail, now_ms)?;
            }
        }
    }
    Ok(())
}

/// The writes of an operator's fleet action, inside one transaction of a
/// store backend: the rule of [`act`] is the same on every backend.
pub trait FleetActTx: FleetTx {
    /// Sets the run's state.
    ///
    /// # Errors
    /// A store failure.
    fn set_state(&mut self, run: &[u8; 16], state: wire::FleetRunState) -> Result<(), Self::Error>;
    /// Ends the run's pending targets `cancelled`; returns how many.
    ///
    /// # Errors
    /// A store failure.
    fn cancel_pending(&mut self, run: &[u8; 16]) -> Result<u64, Self::Error>;
    /// Stops the run, cancelled.
    ///
    /// # Errors
    /// A store failure.
    fn stop_cancelled(&mut self, run: &[u8; 16]) -> Result<(), Self::Error>;
    /// Released targets (client, command id) in `states`, by state then
    /// client id.
    ///
    /// # Errors
    /// A store failure.
    fn targets_in(
        &mut self,
        run: &[u8; 16],
        states: &[wire::FleetTargetState],
    ) -> Result<Vec<(String, [u8; 16])>, Self::Error>;
    /// A target's command, held for the transaction.
    ///
    /// # Errors
    /// A store failure.
    fn command(&mut self, issue: &[u8; 16]) -> Result<CommandView, Self::Error>;
    /// The dispatch core's signal rule for one command, as `SignalCommand`
    /// applies it.
    ///
    /// # Errors
    /// The rule's refusal.
    fn plan(&self, view: &CommandView, signal: i32) -> Result<SignalPlan, DomainError>;
    /// Raises the command's revision and, with `signal`, records it
    /// pending for the client (and wakes the client's server); returns the
    /// new revision.
    ///
    /// # Errors
    /// A store failure.
    fn raise(
        &mut self,
        client: &str,
        view: &CommandView,
        signal: Option<wire::SignalKind>,
        now_ms: i64,
    ) -> Result<u64, Self::Error>;
    /// Ends a queued command `cancelled` (its revision already raised).
    ///
    /// # Errors
    /// A store failure.
    fn cancel_queued(&mut self, view: &CommandView, now_ms: i64) -> Result<(), Self::Error>;
    /// The run was resumed (a backend with several servers wakes the one
    /// running the pump).
    ///
    /// # Errors
    /// A store failure.
    fn resumed(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// What a fleet action did, before the release pass that follows it.
#[derive(Debug, Default)]
pub struct Acted {
    /// Signals to send now, with the client each goes to.
    pub deliver: Vec<(String, wire::Signal)>,
    /// Targets cancelled (pending ones and queued commands).
    pub cancelled: u32,
    /// Targets signalled.
    pub signalled: u32,
    /// Targets the release pass after the action may release.
    pub budget: usize,
}

/// Applies a fleet action to `row` (locked by the caller's transaction):
/// pause stops a running run's releases, resume restarts a paused one's,
/// cancel ends its pending targets, cancels its queued commands and sends
/// TERM to those the client may hold, and a signal goes to the running
/// targets. An action on a run in another state changes nothing.
///
/// # Errors
/// A store failure.
pub fn act<T: FleetActTx>(
    t: &mut T,
    action: &FleetAction,
    row: &RunRow,
    now_ms: i64,
) -> Result<Acted, T::Error> {
    use wire::FleetRunState as R;
    use wire::FleetTargetState as S;
    let run_id = &row.run_id;
    let mut out = Acted::default();
    let send = |out: &mut Acted, client: String, issue: &[u8; 16], revision, signal| {
        out.deliver.push((
            client,
            wire::Signal {
                issue_uuid: uuid_text(issue),
                revision,
                signal,
            },
        ));
        out.signalled = out.signalled.saturating_add(1);
    };
    match action {
        FleetAction::Pause(_) => {
            if row.state == R::Running {
                t.set_state(run_id, R::Paused)?;
            }
        }
        FleetAction::Resume(_) => {
            if row.state == R::Paused {
                t.set_state(run_id, R::Running)?;
                out.budget = FLEET_RELEASE_BATCH;
                t.resumed()?;
            }
        }
        FleetAction::Cancel(_) => {
            if matches!(row.state, R::Running | R::Paused) {
                out.cancelled = u32::try_from(t.cancel_pending(run_id)?).unwrap_or(u32::MAX);
                let term = wire::SignalKind::Term;
                for (client, issue) in t.targets_in(run_id, &[S::Queued, S::Running])? {
                    let view = t.command(&issue)?;
                    if view.lifecycle.is_terminal() {
                        continue;
                    }
                    match t.plan(&view, term as i32) {
                        Ok(SignalPlan::CancelQueued) if view.lifecycle == Lifecycle::Queued => {
                            t.raise(&client, &view, None, now_ms)?;
                            t.cancel_queued(&view, now_ms)?;
                            out.cancelled = out.cancelled.saturating_add(1);
                        }
                        Ok(SignalPlan::Deliver) if view.lifecycle != Lifecycle::Queued => {
                            let next = t.raise(&client, &view, Some(term), now_ms)?;
                            send(&mut out, client, &issue, next, term as i32);
                        }
                        _ => {}
                    }
                }
                t.stop_cancelled(run_id)?;
            }
        }
        FleetAction::Signal(r) => {
            let kind = wire::SignalKind::try_from(r.signal).unwrap_or(wire::SignalKind::Term);
            for (client, issue) in t.targets_in(run_id, &[S::Running])? {
                let view = t.command(&issue)?;
                if view.lifecycle.is_terminal() || view.lifecycle == Lifecycle::Queued {
                    continue;
                }
                if let Ok(SignalPlan::Deliver) = t.plan(&view, r.signal) {
                    let next = t.raise(&client, &view, Some(kind), now_ms)?;
                    send(&mut out, client, &issue, next, r.signal);
                }
            }
        }
    }
    Ok(out)
}

/// The dispatch core's signal rule, as the engine gives it.
type Decide<'a> = &'a dyn Fn(&CommandView, i32) -> Result<SignalPlan, DomainError>;

/// A release pass or a fleet action inside one SQLite transaction.
struct SqliteFleet<'a, 'c> {
    tx: &'a Transaction<'c>,
    opts: &'a StoreOptions,
    health: &'a Health,
    free: u64,
    decide: Decide<'a>,
}

impl FleetActTx for SqliteFleet<'_, '_> {
    fn set_state(&mut self, run: &[u8; 16], state: wire::FleetRunState) -> Result<(), OpError> {
        Ok(set_state(self.tx, run, state)?)
    }

    fn cancel_pending(&mut self, run: &[u8; 16]) -> Result<u64, OpError> {
        Ok(self
            .tx
            .execute_cached(
                "UPDATE fleet_targets SET state = 7 WHERE run_id = ?1 AND state = 1",
                params![run.as_slice()],
            )
            .map_err(|e| StoreError::sqlite("cancel fleet targets", e))? as u64)
    }

    fn stop_cancelled(&mut self, run: &[u8; 16]) -> Result<(), OpError> {
        self.tx
            .execute_cached(
                "UPDATE fleet_runs SET state = 3, stop_reason = 2 WHERE run_id = ?1",
                params![run.as_slice()],
            )
            .map_err(|e| StoreError::sqlite("cancel fleet run", e))?;
        Ok(())
    }

    fn targets_in(
        &mut self,
        run: &[u8; 16],
        states: &[wire::FleetTargetState],
    ) -> Result<Vec<(String, [u8; 16])>, OpError> {
        let states: Vec<i32> = states.iter().map(|s| *s as i32).collect();
        Ok(released_targets(self.tx, run, &states)?)
    }

    fn command(&mut self, issue: &[u8; 16]) -> Result<CommandView, OpError> {
        crate::commands::load_view(self.tx, issue)
    }

    fn plan(&self, view: &CommandView, signal: i32) -> Result<SignalPlan, DomainError> {
        (self.decide)(view, signal)
    }

    fn raise(
        &mut self,
        _client: &str,
        view: &CommandView,
        signal: Option<wire::SignalKind>,
        now_ms: i64,
    ) -> Result<u64, OpError> {
        crate::signals::raise_revision(self.tx, view, signal, now_ms)
    }

    fn cancel_queued(&mut self, view: &CommandView, now_ms: i64) -> Result<(), OpError> {
        Ok(crate::commands::finish_in(
            self.tx,
            &view.issue_uuid,
            view,
            Lifecycle::Cancelled,
            None,
            now_ms,
            self.opts.tombstone_cap,
        )?)
    }
}

impl FleetTx for SqliteFleet<'_, '_> {
    type Error = OpError;

    fn refusal(e: &OpError) -> Option<&DomainError> {
        match e {
            OpError::Refused(d) => Some(d),
            OpError::Store(_) => None,
        }
    }

    fn run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, OpError> {
        // SQLite's write transaction already holds the whole database
        Ok(load_run(self.tx, run)?)
    }

    fn stop_for_errors(&mut self, run: &[u8; 16]) -> Result<(), OpError> {
        self.tx
            .execute_cached(
                "UPDATE fleet_targets SET state = 8 WHERE run_id = ?1 AND state = 1",
                params![run.as_slice()],
            )
            .map_err(|e| StoreError::sqlite("skip fleet targets", e))?;
        self.tx
            .execute_cached(
                "UPDATE fleet_runs SET state = 3, stop_reason = 1 WHERE run_id = ?1",
                params![run.as_slice()],
            )
            .map_err(|e| StoreError::sqlite("stop fleet run", e))?;
        Ok(())
    }

    fn pending(&mut self, run: &[u8; 16], n: usize) -> Result<Vec<(String, [u8; 16])>, OpError> {
        let rows: Vec<(String, Vec<u8>)> = {
            let mut st = self
                .tx
                .prepare_cached(
                    "SELECT client_id, issue_uuid FROM fleet_targets
                     WHERE run_id = ?1 AND state = 1 ORDER BY client_id LIMIT ?2",
                )
                .map_err(|e| StoreError::sqlite("read pending fleet targets", e))?;
            st.query_map(
                params![run.as_slice(), i64::try_from(n).unwrap_or(i64::MAX)],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read pending fleet targets", e))?
        };
        rows.into_iter()
            .map(|(c, i)| {
                <[u8; 16]>::try_from(i.as_slice())
                    .map(|i| (c, i))
                    .map_err(|_| integrity("target").into())
            })
            .collect()
    }

    fn create_command(
        &mut self,
        row: &RunRow,
        spec: &wire::ExecutionSpec,
        client: &str,
        issue: &[u8; 16],
        now_ms: i64,
    ) -> Result<(), OpError> {
        create_target_command(
            self.tx,
            self.opts,
            self.health,
            self.free,
            row,
            spec,
            spec.encoded_len(),
            client,
            issue,
            now_ms,
        )
    }

    fn released(&mut self, run: &[u8; 16], client: &str, now_ms: i64) -> Result<(), OpError> {
        self.tx
            .execute_cached(
                "UPDATE fleet_targets SET state = 2, lifecycle = 1, released_ms = ?3
                 WHERE run_id = ?1 AND client_id = ?2",
                params![run.as_slice(), client, now_ms],
            )
            .map_err(|e| StoreError::sqlite("release fleet target", e))?;
        Ok(())
    }

    fn refused(
        &mut self,
        run: &[u8; 16],
        client: &str,
        detail: &wire::ErrorDetail,
        now_ms: i64,
    ) -> Result<(), OpError> {
        self.tx
            .execute_cached(
                "UPDATE fleet_targets SET state = 5, rejection = ?3, released_ms = ?4,
                     ended_ms = ?4
                 WHERE run_id = ?1 AND client_id = ?2",
                params![run.as_slice(), client, detail.encode_to_vec(), now_ms],
            )
            .map_err(|e| StoreError::sqlite("refuse fleet target", e))?;
        Ok(())
    }

    fn end(&mut self, run: &[u8; 16], now_ms: i64) -> Result<(), OpError> {
        self.tx
            .execute_cached(
                "UPDATE fleet_runs SET state = 4, done_ms = ?2 WHERE run_id = ?1",
                params![run.as_slice(), now_ms],
            )
            .map_err(|e| StoreError::sqlite("end fleet run", e))?;
        Ok(())
    }
}

/// [`advance`] on SQLite.
#[allow(clippy::too_many_arguments)]
fn advance_in(
    tx: &Transaction<'_>,
    opts: &StoreOptions,
    health: &Health,
    free: u64,
    run_id: &[u8; 16],
    budget: &mut usize,
    pass: &mut Pass,
    now_ms: i64,
) -> Result<(), OpError> {
    let no_signals = |_: &CommandView, _: i32| -> Result<SignalPlan, DomainError> {
        Err(DomainError::new(
            Code::Internal,
            "a release pass sends no signal",
        ))
    };
    advance(
        &mut SqliteFleet {
            tx,
            opts,
            health,
            free,
            decide: &no_signals,
        },
        run_id,
        budget,
        pass,
        now_ms,
    )
}

#[allow(clippy::too_many_arguments)]
fn create_target_command(
    tx: &Transaction<'_>,
    opts: &StoreOptions,
    health: &Health,
    free: u64,
    row: &RunRow,
    spec: &wire::ExecutionSpec,
    spec_raw_len: usize,
    client: &str,
    issue: &[u8; 16],
    now_ms: i64,
) -> Result<(), OpError> {
    let client_id = ClientId::parse("client_id", client).map_err(DomainError::from)?;
    health.check_writable(&[(wire::ScopeKind::Client, client)])?;
    if tombstoned(tx, issue)? || command_exists(tx, issue)? {
        return Err(OpError::Refused(DomainError::new(
            Code::Conflict,
            "the target's command id already names a command",
        )));
    }
    let hash = command_hash(&client_id, spec);
    let cmd = CommandRow {
        issue,
        client_id: client,
        spec,
        spec_zstd: &row.spec_zstd,
        spec_raw_len,
        request_hash: &hash,
        script_inline: row.script_zstd.as_deref(),
        script_stored: None,
        queue_ttl_ms: row.queue_ttl_ms,
    };
    let (r, _) = insert_command_in(tx, opts, free, &cmd, now_ms)?;
    apply_owner_global(tx, client, r.owner_after, r.global_after)?;
    Ok(())
}

/// Adds `client` as a late target of every live run whose include_late
/// window is open and whose selection it matches, inside the caller's
/// (registration's) transaction. Returns how many it joined.
pub(crate) fn add_late_targets_in(
    tx: &Transaction<'_>,
    client: &str,
    labels: &str,
    now_ms: i64,
) -> Result<u32, StoreError> {
    let runs: Vec<(Vec<u8>, Vec<u8>, i64)> = {
        let mut st = tx
            .prepare_cached(
                "SELECT run_id, selection, targets FROM fleet_runs
                 WHERE state < 3 AND late_until_ms > ?1",
            )
            .map_err(|e| StoreError::sqlite("read late fleet runs", e))?;
        st.query_map(params![now_ms], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read late fleet runs", e))?
    };
    if runs.is_empty() {
        return Ok(0);
    }
    let labels = crate::records::stored_labels(labels);
    let mut joined = 0;
    for (run, selection, targets) in runs {
        let run = <[u8; 16]>::try_from(run.as_slice()).map_err(|_| integrity("id"))?;
        if !joins_late(&selection, to_u64(targets), client, &labels)? {
            continue;
        }
        let run_id = Uuid7::from_bytes("fleet_run_id", run).map_err(|_| integrity("id"))?;
        let issue = target_issue(&run_id, client);
        let added = tx
            .execute_cached(
                "INSERT INTO fleet_targets (run_id, client_id, issue_uuid, state, late)
                 VALUES (?1, ?2, ?3, 1, 1) ON CONFLICT DO NOTHING",
                params![run.as_slice(), client, issue.as_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("add late fleet target", e))?;
        if added > 0 {
            joined += 1;
            tracing::info!(fleet_run_id = %run_id, client_id = %client, "late fleet target added");
        }
    }
    Ok(joined)
}

/// Live runs, oldest first, at most [`MAX_LIVE_RUNS_PER_PASS`].
fn live_runs(conn: &Connection) -> Result<Vec<[u8; 16]>, StoreError> {
    let mut st = conn
        .prepare_cached(
            "SELECT run_id FROM fleet_runs WHERE state < 4 ORDER BY created_ms, run_id LIMIT ?1",
        )
        .map_err(|e| StoreError::sqlite("read live fleet runs", e))?;
    let ids: Vec<Vec<u8>> = st
        .query_map(params![MAX_LIVE_RUNS_PER_PASS as i64], |r| r.get(0))
        .and_then(Iterator::collect)
        .map_err(|e| StoreError::sqlite("read live fleet runs", e))?;
    ids.into_iter()
        .map(|b| <[u8; 16]>::try_from(b.as_slice()).map_err(|_| integrity("id")))
        .collect()
}

fn any_live(conn: &Connection) -> Result<bool, StoreError> {
    conn.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM fleet_runs WHERE state < 4)",
        [],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("read live fleet runs", e))
}

fn decode_response<M: prost::Message + Default>(stored: Stored) -> Result<M, OpError> {
    match stored {
        Ok(bytes) => M::decode(bytes.as_slice()).map_err(|_| {
            OpError::Store(StoreError::Integrity(
                "stored fleet response does not decode".into(),
            ))
        }),
        Err(detail) => Err(OpError::Refused(crate::incidents::detail_to_error(&detail))),
    }
}

/// A `RunFleet` request, validated and encoded for storage.
#[derive(Debug)]
pub struct PreparedRun {
    /// The run id (the request id).
    pub run: Uuid7,
    /// Its bytes.
    pub run_id: [u8; 16],
    /// The selection.
    pub selection: Selection,
    /// The selection as the request encoded it (stored with the run).
    pub selection_wire: Vec<u8>,
    /// `max_parallel`.
    pub max_parallel: Option<Limit>,
    /// `max_errors`.
    pub max_errors: Option<Limit>,
    /// The include_late window (0: none).
    pub late_ms: u64,
    /// The idempotency hash of the canonical request.
    pub mutation_hash: rvbox_domain::hash::RequestHash,
    /// Length of the encoded, normalized spec.
    pub spec_raw_len: usize,
    /// zstd of the encoded, normalized spec.
    pub spec_zstd: Vec<u8>,
    /// zstd of the script, when there is one.
    pub script_zstd: Option<Vec<u8>>,
    /// The request's queue TTL (`None`: the server's default).
    pub queue_ttl_ms: Option<u64>,
}

/// Validates a `RunFleet` request (the spec, script and TTL rules of
/// `RunCommand`, the selection, the limits, the late window) and encodes
/// it for storage.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the field, or a compression failure.
pub fn prepare_run(req: &wire::RunFleetRequest) -> Result<PreparedRun, OpError> {
    let run = Uuid7::parse("request_id", &req.request_id).map_err(DomainError::from)?;
    let run_id = *run.as_bytes();
    let selection = Selection::from_wire(req.selection.as_ref())?;
    let max_parallel = Limit::from_wire("max_parallel", req.max_parallel.as_ref())?;
    let max_errors = Limit::from_wire("max_errors", req.max_errors.as_ref())?;
    let late_ms = match &req.include_late {
        None => 0,
        Some(d) if d.seconds < 0 || d.nanos < 0 => {
            return Err(invalid("include_late", "must not be negative"));
        }
        Some(d) => {
            let ms = u64::try_from(d.seconds)
                .unwrap_or(u64::MAX)
                .saturating_mul(1000)
                .saturating_add(u64::try_from(d.nanos / 1_000_000).unwrap_or(0));
            if ms > MAX_INCLUDE_LATE_MS {
                return Err(invalid(
                    "include_late",
                    format!(
                        "is longer than the limit of {} days",
                        MAX_INCLUDE_LATE_MS / 86_400_000
                    ),
                ));
            }
            ms
        }
    };
    if req.script.len() as u64 > MAX_FLEET_SCRIPT_BYTES {
        return Err(invalid(
            "script",
            format!(
                "is {} bytes; a fleet run carries scripts of at most {MAX_FLEET_SCRIPT_BYTES} bytes",
                req.script.len()
            ),
        ));
    }
    // the spec, script and TTL rules of RunCommand, in one validator
    let valid = rvbox_domain::validate::check_run_command(&wire::RunCommandRequest {
        request_id: req.request_id.clone(),
        client_id: "fleet".into(),
        spec: req.spec.clone(),
        script: req.script.clone(),
        queue_ttl: req.queue_ttl,
    })?;
    let mut canonical = req.clone();
    canonical.request_id.clear();
    canonical.spec = Some(valid.spec.clone());
    let mutation_hash = request_hash("RunFleet", &canonical);
    let spec_raw = valid.spec.encode_to_vec();
    let spec_zstd = zstd::bulk::compress(&spec_raw, 3)
        .map_err(|e| StoreError::io("compress execution spec", "", e))?;
    let script_zstd = if req.script.is_empty() {
        None
    } else {
        Some(
            zstd::bulk::compress(&req.script, 3)
                .map_err(|e| StoreError::io("compress script", "", e))?,
        )
    };
    Ok(PreparedRun {
        run,
        run_id,
        selection,
        selection_wire: req.selection.clone().unwrap_or_default().encode_to_vec(),
        max_parallel,
        max_errors,
        late_ms,
        mutation_hash,
        spec_raw_len: spec_raw.len(),
        spec_zstd,
        script_zstd,
        queue_ttl_ms: valid.queue_ttl_ms,
    })
}

/// What a `RunFleet` audit record says of the request's selection.
#[must_use]
pub fn run_audit_detail(req: &wire::RunFleetRequest) -> String {
    req.selection.as_ref().map_or_else(String::new, |s| {
        format!(
            "ids={} glob={:?} selector={:?} all={}",
            s.client_ids.len(),
            s.client_glob,
            s.selector,
            s.all
        )
    })
}

/// Whether `client` (with its stored `labels`) joins a live run through
/// its include_late window: the run's selection matches and it has room.
///
/// # Errors
/// [`StoreError::Integrity`] when the stored selection does not decode.
pub fn joins_late(
    selection: &[u8],
    targets: u64,
    client: &str,
    labels: &rvbox_domain::labels::Labels,
) -> Result<bool, StoreError> {
    let sel = wire::FleetSelection::decode(selection)
        .map_err(|_| integrity("selection"))
        .and_then(|s| Selection::from_wire(Some(&s)).map_err(|_| integrity("selection")))?;
    Ok(sel.matches(client, labels) && targets < MAX_FLEET_TARGETS as u64)
}

/// A fresh run id: `CONFLICT` when a run has it, `ALREADY_EXECUTED` when
/// retention deleted the run that had it.
///
/// # Errors
/// As above.
pub fn check_fresh_run(exists: bool, tombstoned: bool) -> Result<(), DomainError> {
    if exists {
        return Err(
            DomainError::new(Code::Conflict, "request_id already names a fleet run")
                .with_field("request_id"),
        );
    }
    if tombstoned {
        return Err(DomainError::new(
            Code::AlreadyExecuted,
            "a fleet run with this request_id already ran and its history was reclaimed; use a new request_id",
        )
        .with_field("request_id"));
    }
    Ok(())
}

/// The resolved selection's size: none (without a late window) and more
/// than [`MAX_FLEET_TARGETS`] are refused.
///
/// # Errors
/// `FAILED_PRECONDITION` or `INVALID_ARGUMENT` naming `selection`.
pub fn check_targets(targets: usize, late_ms: u64) -> Result<(), DomainError> {
    if targets == 0 && late_ms == 0 {
        return Err(DomainError::new(
            Code::FailedPrecondition,
            "the selection matches no client (set include_late to wait for clients that register later)",
        )
        .with_field("selection"));
    }
    if targets > MAX_FLEET_TARGETS {
        return Err(DomainError::new(
            Code::InvalidArgument,
            format!(
                "the selection matches {targets} clients; a fleet run holds at most {MAX_FLEET_TARGETS}"
            ),
        )
        .with_field("selection"));
    }
    Ok(())
}

/// When the include_late window of a run created at `now_ms` closes.
#[must_use]
pub fn late_until(late_ms: u64, now_ms: i64) -> Option<i64> {
    (late_ms > 0).then(|| now_ms.saturating_add(i64::try_from(late_ms).unwrap_or(i64::MAX)))
}

/// A fleet action's request id, run id and idempotency hash.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the field.
pub fn action_request(
    action: &FleetAction,
) -> Result<(Uuid7, [u8; 16], rvbox_domain::hash::RequestHash), OpError> {
    let (request_text, run_text) = action.ids();
    let request_id = Uuid7::parse("request_id", request_text).map_err(DomainError::from)?;
    let run_id = parse_run_id(run_text)?;
    let method = action.method();
    let run = uuid_text(&run_id);
    let hash = match action {
        FleetAction::Signal(r) => {
            match wire::SignalKind::try_from(r.signal) {
                Ok(wire::SignalKind::Unspecified) | Err(_) => {
                    return Err(invalid(
                        "signal",
                        format!(
                            "{} is not a known signal kind (HUP, INT, TERM, KILL, USR1, USR2)",
                            r.signal
                        ),
                    ));
                }
                Ok(_) => {}
            }
            request_hash(
                method,
                &wire::SignalFleetRunRequest {
                    request_id: String::new(),
                    fleet_run_id: run,
                    signal: r.signal,
                },
            )
        }
        FleetAction::Cancel(_) => request_hash(
            method,
            &wire::CancelFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: run,
            },
        ),
        FleetAction::Pause(_) => request_hash(
            method,
            &wire::PauseFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: run,
            },
        ),
        FleetAction::Resume(_) => request_hash(
            method,
            &wire::ResumeFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: run,
            },
        ),
    };
    Ok((request_id, run_id, hash))
}

/// A fleet action's answer and its stored encoding.
#[must_use]
pub fn action_answer(
    action: &FleetAction,
    run_id: &[u8; 16],
    record: wire::FleetRunRecord,
    cancelled: u32,
    signalled: u32,
) -> (FleetAnswer, Vec<u8>) {
    match action {
        FleetAction::Signal(_) => {
            let r = wire::SignalFleetRunResponse {
                fleet_run_id: uuid_text(run_id),
                signalled,
            };
            let b = r.encode_to_vec();
            (FleetAnswer::Signal(r), b)
        }
        FleetAction::Cancel(_) => {
            let r = wire::CancelFleetRunResponse {
                run: Some(record),
                cancelled,
                signalled,
            };
            let b = r.encode_to_vec();
            (FleetAnswer::Cancel(r), b)
        }
        FleetAction::Pause(_) => {
            let r = wire::PauseFleetRunResponse { run: Some(record) };
            let b = r.encode_to_vec();
            (FleetAnswer::Pause(r), b)
        }
        FleetAction::Resume(_) => {
            let r = wire::ResumeFleetRunResponse { run: Some(record) };
            let b = r.encode_to_vec();
            (FleetAnswer::Resume(r), b)
        }
    }
}

/// The stored answer of a replayed fleet action.
///
/// # Errors
/// The stored refusal, or an answer that does not decode.
pub fn replayed_action(action: &FleetAction, stored: Stored) -> Result<FleetAnswer, OpError> {
    Ok(match action {
        FleetAction::Signal(_) => FleetAnswer::Signal(decode_response(stored)?),
        FleetAction::Cancel(_) => FleetAnswer::Cancel(decode_response(stored)?),
        FleetAction::Pause(_) => FleetAnswer::Pause(decode_response(stored)?),
        FleetAction::Resume(_) => FleetAnswer::Resume(decode_response(stored)?),
    })
}

/// The stored answer of a replayed `RunFleet`.
///
/// # Errors
/// The stored refusal, or an answer that does not decode.
pub fn replayed_run(stored: Stored) -> Result<wire::RunFleetResponse, OpError> {
    decode_response(stored)
}

impl Store {
    /// `RunFleet`: validates the request, resolves the selection, and in
    /// one transaction stores the run, its targets, the idempotency row,
    /// the audit record and the first released commands.
    ///
    /// # Errors
    /// [`OpError::Refused`] for an invalid request, a `request_id` used
    /// for another request (`CONFLICT`), or a selection that matches no
    /// client (`FAILED_PRECONDITION`, unless `include_late` is set); a
    /// store failure.
    pub fn run_fleet_as(
        &mut self,
        req: &wire::RunFleetRequest,
        caller: &crate::operator::Caller,
        now_ms: i64,
    ) -> Result<FleetOutcome, OpError> {
        let mut rec = crate::audit::AuditRecord::control(caller, "RunFleet", now_ms);
        rec.detail = run_audit_detail(req);
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = self.run_fleet_inner(req, &mut intent, now_ms);
        self.audit_unwritten(&mut intent, &result, now_ms);
        match &result {
            Ok(o) if !o.replayed => self.metrics.fleet_event("created"),
            Ok(_) => {}
            Err(e) => {
                let code = e.to_domain().code().as_str();
                tracing::warn!(code, "RunFleet refused");
                self.metrics.fleet_event("refused");
            }
        }
        result
    }

    fn run_fleet_inner(
        &mut self,
        req: &wire::RunFleetRequest,
        intent: &mut crate::audit::AuditIntent,
        now_ms: i64,
    ) -> Result<FleetOutcome, OpError> {
        let PreparedRun {
            run,
            run_id,
            selection,
            selection_wire,
            max_parallel,
            max_errors,
            late_ms,
            mutation_hash,
            spec_raw_len,
            spec_zstd,
            script_zstd,
            queue_ttl_ms,
        } = prepare_run(req)?;
        self.health.check_writable(&[])?;
        let free = self.free_space()?;
        let opts = self.opts.clone();
        let ttl_ms = queue_ttl_ms.unwrap_or(opts.queue_ttl_ms);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin RunFleet", e))?;
        let owner = Owner::FleetRun(&run_id);
        if let Some(stored) = mutations::lookup(&tx, &run, "RunFleet", &mutation_hash, owner)? {
            let response = replayed_run(stored)?;
            let mut out = FleetOutcome::answer(FleetAnswer::Run(response));
            out.replayed = true;
            out.live = any_live(&tx)?;
            return Ok(out);
        }
        check_fresh_run(
            load_run(&tx, &run_id)?.is_some(),
            run_tombstoned(&tx, &run_id)?,
        )?;
        let targets = resolve_in(&tx, &selection)?;
        check_targets(targets.len(), late_ms)?;
        let late_until = late_until(late_ms, now_ms);
        tx.execute_cached(
            "INSERT INTO fleet_runs (run_id, state, selection, spec_zstd, spec_raw_len, script_zstd,
                 queue_ttl_ms, max_parallel, max_errors, created_ms, late_until_ms)
             VALUES (?1, 1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            params![
                run_id.as_slice(),
                selection_wire,
                spec_zstd,
                to_i64(spec_raw_len as u64),
                script_zstd,
                to_i64(ttl_ms),
                max_parallel.map(|l| l.to_wire().encode_to_vec()),
                max_errors.map(|l| l.to_wire().encode_to_vec()),
                now_ms,
                late_until
            ],
        )
        .map_err(|e| StoreError::sqlite("insert fleet run", e))?;
        {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO fleet_targets (run_id, client_id, issue_uuid, state)
                     VALUES (?1, ?2, ?3, 1)",
                )
                .map_err(|e| StoreError::sqlite("insert fleet target", e))?;
            for client in &targets {
                let issue = target_issue(&run, client);
                st.execute(params![
                    run_id.as_slice(),
                    client,
                    issue.as_bytes().as_slice()
                ])
                .map_err(|e| StoreError::sqlite("insert fleet target", e))?;
            }
        }
        let response = wire::RunFleetResponse {
            fleet_run_id: run.to_string(),
            targets: u32::try_from(targets.len()).unwrap_or(u32::MAX),
        };
        let stored: Stored = Ok(response.encode_to_vec());
        intent.write_in(&tx, Ok(()))?;
        mutations::record(
            &tx,
            &run,
            "RunFleet",
            &mutation_hash,
            owner,
            &stored,
            Assigned::default(),
            now_ms,
        )?;
        let mut budget = FLEET_RELEASE_BATCH;
        let mut pass = Pass::default();
        advance_in(
            &tx,
            &opts,
            &self.health,
            free,
            &run_id,
            &mut budget,
            &mut pass,
            now_ms,
        )?;
        let live = any_live(&tx)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit RunFleet", e))?;
        self.hook.at(crate::crash::points::RUN_FLEET_AFTER_COMMIT);
        self.metrics.fleet_released(pass.released.len());
        tracing::info!(
            fleet_run_id = %run,
            targets = targets.len(),
            released = pass.released.len(),
            late_ms,
            "fleet run created"
        );
        Ok(pass.into_outcome(FleetAnswer::Run(response), Vec::new(), live, false))
    }

    /// One release pass over the live runs (oldest first): each releases
    /// what its rate allows, within `limit` targets in all, stops at
    /// `max_errors`, and ends when done. One transaction.
    ///
    /// # Errors
    /// A store failure (nothing committed).
    pub fn fleet_pump(&mut self, limit: usize, now_ms: i64) -> Result<FleetOutcome, OpError> {
        let runs = live_runs(&self.conn)?;
        if runs.is_empty() {
            let mut out = FleetOutcome::answer(FleetAnswer::None);
            out.live = false;
            return Ok(out);
        }
        let free = self.free_space()?;
        let opts = self.opts.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin fleet pass", e))?;
        let mut budget = limit.min(FLEET_RELEASE_BATCH);
        let mut pass = Pass::default();
        for run in &runs {
            advance_in(
                &tx,
                &opts,
                &self.health,
                free,
                run,
                &mut budget,
                &mut pass,
                now_ms,
            )?;
        }
        let live = any_live(&tx)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit fleet pass", e))?;
        self.hook.at(crate::crash::points::FLEET_PASS_AFTER_COMMIT);
        self.metrics.fleet_released(pass.released.len());
        Ok(pass.into_outcome(
            FleetAnswer::None,
            Vec::new(),
            live,
            runs.len() >= MAX_LIVE_RUNS_PER_PASS,
        ))
    }

    /// `SignalFleetRun`, `CancelFleetRun`, `PauseFleetRun` and
    /// `ResumeFleetRun`, idempotent by `request_id`; `decide` is the
    /// dispatch core's signal rule for one command (as `SignalCommand`
    /// applies it).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `NOT_FOUND`, `CONFLICT` for a `request_id` used
    /// for another request, or a store failure.
    pub fn fleet_action_as(
        &mut self,
        action: &FleetAction,
        caller: &crate::operator::Caller,
        decide: impl Fn(&CommandView, i32) -> Result<SignalPlan, DomainError>,
        now_ms: i64,
    ) -> Result<FleetOutcome, OpError> {
        let method = action.method();
        let mut rec = crate::audit::AuditRecord::control(caller, method, now_ms);
        rec.detail = format!("fleet run {}", action.ids().1);
        let mut intent = crate::audit::AuditIntent::control(rec);
        let result = self.fleet_action_inner(action, &mut intent, decide, now_ms);
        self.audit_unwritten(&mut intent, &result, now_ms);
        match &result {
            Ok(o) if !o.replayed => self.metrics.fleet_event(match action {
                FleetAction::Signal(_) => "signalled",
                FleetAction::Cancel(_) => "cancelled",
                FleetAction::Pause(_) => "paused",
                FleetAction::Resume(_) => "resumed",
            }),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(
                    method,
                    code = e.to_domain().code().as_str(),
                    "fleet action refused"
                );
            }
        }
        result
    }

    fn fleet_action_inner(
        &mut self,
        action: &FleetAction,
        intent: &mut crate::audit::AuditIntent,
        decide: impl Fn(&CommandView, i32) -> Result<SignalPlan, DomainError>,
        now_ms: i64,
    ) -> Result<FleetOutcome, OpError> {
        let (request_id, run_id, hash) = action_request(action)?;
        let method = action.method();
        self.health.check_writable(&[])?;
        let free = self.free_space()?;
        let opts = self.opts.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin fleet action", e))?;
        let owner = Owner::FleetRun(&run_id);
        if let Some(stored) = mutations::lookup(&tx, &request_id, method, &hash, owner)? {
            let mut out = FleetOutcome::answer(replayed_action(action, stored)?);
            out.replayed = true;
            out.live = any_live(&tx)?;
            return Ok(out);
        }
        let row = must_run(&tx, &run_id)?;
        let mut t = SqliteFleet {
            tx: &tx,
            opts: &opts,
            health: &self.health,
            free,
            decide: &decide,
        };
        let Acted {
            deliver,
            cancelled,
            signalled,
            mut budget,
        } = act(&mut t, action, &row, now_ms)?;
        let mut pass = Pass::default();
        advance(&mut t, &run_id, &mut budget, &mut pass, now_ms)?;
        let record = record_of(&must_run(&tx, &run_id)?)?;
        let (answer, bytes) = action_answer(action, &run_id, record, cancelled, signalled);
        intent.write_in(&tx, Ok(()))?;
        mutations::record(
            &tx,
            &request_id,
            method,
            &hash,
            owner,
            &Ok(bytes),
            Assigned::default(),
            now_ms,
        )?;
        let live = any_live(&tx)?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit fleet action", e))?;
        self.hook
            .at(crate::crash::points::FLEET_ACTION_AFTER_COMMIT);
        self.metrics.fleet_released(pass.released.len());
        tracing::info!(
            method,
            fleet_run_id = %uuid_text(&run_id),
            cancelled,
            signalled,
            "fleet action recorded"
        );
        Ok(pass.into_outcome(answer, deliver, live, false))
    }
}

fn set_state(
    tx: &Transaction<'_>,
    run: &[u8; 16],
    state: wire::FleetRunState,
) -> Result<(), StoreError> {
    tx.execute_cached(
        "UPDATE fleet_runs SET state = ?2 WHERE run_id = ?1",
        params![run.as_slice(), state as i32],
    )
    .map_err(|e| StoreError::sqlite("set fleet run state", e))?;
    Ok(())
}

/// Released targets in `states`, by client id.
fn released_targets(
    tx: &Transaction<'_>,
    run: &[u8; 16],
    states: &[i32],
) -> Result<Vec<(String, [u8; 16])>, StoreError> {
    let mut out = Vec::new();
    let mut st = tx
        .prepare_cached(
            "SELECT client_id, issue_uuid FROM fleet_targets
             WHERE run_id = ?1 AND state = ?2 ORDER BY client_id",
        )
        .map_err(|e| StoreError::sqlite("read released fleet targets", e))?;
    for state in states {
        let rows: Vec<(String, Vec<u8>)> = st
            .query_map(params![run.as_slice(), state], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read released fleet targets", e))?;
        for (c, i) in rows {
            out.push((
                c,
                <[u8; 16]>::try_from(i.as_slice()).map_err(|_| integrity("target"))?,
            ));
        }
    }
    Ok(out)
}

/// The clients a selection resolves to, sorted: an explicit list as
/// given (filtered by a glob or selector when one is given too, a client
/// unknown here having no labels), or every known client that matches.
fn resolve_in(tx: &Transaction<'_>, sel: &Selection) -> Result<Vec<String>, OpError> {
    let mut out = Vec::new();
    if !sel.client_ids.is_empty() {
        for id in &sel.client_ids {
            let labels: Option<String> = tx
                .query_row_cached(
                    "SELECT labels FROM clients WHERE client_id = ?1",
                    params![id.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("read client labels", e))?;
            let labels = crate::records::stored_labels(labels.as_deref().unwrap_or(""));
            if sel.matches(id.as_str(), &labels) {
                out.push(id.as_str().to_owned());
            }
        }
        return Ok(out);
    }
    let mut st = tx
        .prepare_cached("SELECT client_id, labels FROM clients ORDER BY client_id")
        .map_err(|e| StoreError::sqlite("read clients", e))?;
    let rows = st
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .map_err(|e| StoreError::sqlite("read clients", e))?;
    for row in rows {
        let (id, labels) = row.map_err(|e| StoreError::sqlite("read clients", e))?;
        if sel.matches(&id, &crate::records::stored_labels(&labels)) {
            out.push(id);
            if out.len() > MAX_FLEET_TARGETS {
                break;
            }
        }
    }
    Ok(out)
}

/// Most done runs one maintenance pass deletes.
pub const MAX_RUNS_PRUNED_PER_PASS: i64 = 100;

/// Retention of fleet runs (maintenance): a done run goes once none of its
/// targets' commands remain (evicted by quota or age), or once it has been
/// done longer than `retention_ms` (0 keeps such runs), at most
/// [`MAX_RUNS_PRUNED_PER_PASS`] per pass. Its targets and idempotency rows
/// go with it (cascade). A run with no target at all (a late window no
/// client joined) stays until the retention.
///
/// # Errors
/// A store failure.
pub(crate) fn prune_done_runs(
    conn: &mut Connection,
    now_ms: i64,
    retention_ms: u64,
    tombstone_cap: u64,
) -> Result<u64, StoreError> {
    let aged_before = if retention_ms == 0 {
        i64::MIN
    } else {
        now_ms.saturating_sub(to_i64(retention_ms))
    };
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| StoreError::sqlite("begin fleet run retention", e))?;
    let runs: Vec<Vec<u8>> = {
        let mut st = tx
            .prepare_cached(
                "SELECT r.run_id FROM fleet_runs r
                 WHERE r.state = 4
                   AND (r.done_ms < ?1
                        OR (r.targets > 0 AND NOT EXISTS (
                               SELECT 1 FROM fleet_targets t JOIN commands c
                                 ON c.issue_uuid = t.issue_uuid
                               WHERE t.run_id = r.run_id)))
                 ORDER BY r.created_ms LIMIT ?2",
            )
            .map_err(|e| StoreError::sqlite("select done fleet runs", e))?;
        st.query_map(params![aged_before, MAX_RUNS_PRUNED_PER_PASS], |r| r.get(0))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("select done fleet runs", e))?
    };
    for run in &runs {
        // the id stays refused: a replayed RunFleet never makes it again
        tx.execute_cached(
            "INSERT INTO fleet_run_tombstones (run_id, pruned_ms) VALUES (?1, ?2)
             ON CONFLICT (run_id) DO NOTHING",
            params![run, now_ms],
        )
        .map_err(|e| StoreError::sqlite("insert fleet run tombstone", e))?;
        tx.execute_cached("DELETE FROM fleet_runs WHERE run_id = ?1", params![run])
            .map_err(|e| StoreError::sqlite("delete done fleet run", e))?;
    }
    if !runs.is_empty() {
        tx.execute_cached(
            "DELETE FROM fleet_run_tombstones WHERE seq <= (
                 SELECT MAX(seq) FROM fleet_run_tombstones) - ?1",
            params![to_i64(tombstone_cap.max(1))],
        )
        .map_err(|e| StoreError::sqlite("trim fleet run tombstones", e))?;
    }
    tx.commit()
        .map_err(|e| StoreError::sqlite("commit fleet run retention", e))?;
    if !runs.is_empty() {
        tracing::info!(runs = runs.len(), "done fleet runs deleted by retention");
    }
    Ok(runs.len() as u64)
}

/// Whether retention deleted a run with this id (its tombstone is kept).
fn run_tombstoned(tx: &Transaction<'_>, run: &[u8; 16]) -> Result<bool, StoreError> {
    tx.query_row_cached(
        "SELECT EXISTS (SELECT 1 FROM fleet_run_tombstones WHERE run_id = ?1)",
        params![run.as_slice()],
        |r| r.get(0),
    )
    .map_err(|e| StoreError::sqlite("check fleet run tombstone", e))
}

/// The fleet invariants, read from one connection: each run's counters
/// equal a recount of its targets; a released target's state is the one
/// its command's lifecycle maps to; a target never released (pending or
/// skipped) has no command; no run has more targets queued or running than
/// its `max_parallel` allows. One line per problem found.
///
/// # Errors
/// A store failure.
pub fn fleet_problems(conn: &Connection) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    for (run, counts, recount) in fleet_count_mismatches(conn)? {
        out.push(format!(
            "fleet run {run}: counters {counts:?} but its targets recount to {recount:?}"
        ));
    }
    let rows: Vec<(Vec<u8>, String, i32, Option<i32>)> = {
        let mut st = conn
            .prepare_cached(
                "SELECT t.run_id, t.client_id, t.state, c.lifecycle FROM fleet_targets t
                 LEFT JOIN commands c ON c.issue_uuid = t.issue_uuid",
            )
            .map_err(|e| StoreError::sqlite("read fleet targets", e))?;
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read fleet targets", e))?
    };
    for (run, client, state, lifecycle) in rows {
        let run = uuid::Uuid::from_slice(&run)
            .map(|u| u.hyphenated().to_string())
            .unwrap_or_default();
        match lifecycle.map(Lifecycle::from_wire) {
            Some(Ok(l)) => {
                let want = rvbox_domain::fleet::target_state(l) as i32;
                if state != want {
                    out.push(format!(
                        "fleet run {run}: target {client} is in state {state} but its command is {}",
                        l.as_str()
                    ));
                }
            }
            Some(Err(_)) => out.push(format!(
                "fleet run {run}: target {client}'s command has an unknown lifecycle"
            )),
            None => {}
        }
        if lifecycle.is_some()
            && matches!(
                wire::FleetTargetState::try_from(state),
                Ok(wire::FleetTargetState::Pending | wire::FleetTargetState::Skipped)
            )
        {
            out.push(format!(
                "fleet run {run}: target {client} was never released but has a command"
            ));
        }
    }
    let runs: Vec<Vec<u8>> = {
        let mut st = conn
            .prepare_cached("SELECT run_id FROM fleet_runs WHERE max_parallel IS NOT NULL")
            .map_err(|e| StoreError::sqlite("read fleet runs", e))?;
        st.query_map([], |r| r.get(0))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read fleet runs", e))?
    };
    for id in runs {
        let id = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| integrity("id"))?;
        let Some(row) = load_run(conn, &id)? else {
            continue;
        };
        if let Some(limit) = row.max_parallel {
            let cap = limit.resolve(row.targets);
            if row.counts.in_flight() > cap {
                out.push(format!(
                    "fleet run {}: {} targets in flight, above max_parallel {limit} ({cap})",
                    uuid_text(&id),
                    row.counts.in_flight()
                ));
            }
        }
    }
    Ok(out)
}

/// A live run's `max_parallel` resolved, and its targets' command ids.
pub type ParallelLimit = (u64, Vec<[u8; 16]>);

/// Each live run with a `max_parallel`: its limit, and its targets'
/// command ids (for an oracle that counts the processes really running).
///
/// # Errors
/// A store failure.
pub fn parallel_limits(conn: &Connection) -> Result<Vec<ParallelLimit>, StoreError> {
    let runs: Vec<Vec<u8>> = {
        let mut st = conn
            .prepare_cached(
                "SELECT run_id FROM fleet_runs WHERE max_parallel IS NOT NULL AND state < 4",
            )
            .map_err(|e| StoreError::sqlite("read fleet runs", e))?;
        st.query_map([], |r| r.get(0))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("read fleet runs", e))?
    };
    let mut out = Vec::new();
    for id in runs {
        let id = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| integrity("id"))?;
        let Some(row) = load_run(conn, &id)? else {
            continue;
        };
        let Some(limit) = row.max_parallel else {
            continue;
        };
        let issues: Vec<Vec<u8>> = {
            let mut st = conn
                .prepare_cached("SELECT issue_uuid FROM fleet_targets WHERE run_id = ?1")
                .map_err(|e| StoreError::sqlite("read fleet targets", e))?;
            st.query_map(params![id.as_slice()], |r| r.get(0))
                .and_then(Iterator::collect)
                .map_err(|e| StoreError::sqlite("read fleet targets", e))?
        };
        let issues = issues
            .into_iter()
            .filter_map(|b| <[u8; 16]>::try_from(b.as_slice()).ok())
            .collect();
        out.push((limit.resolve(row.targets), issues));
    }
    Ok(out)
}

// ---- reads (the control service's reader connections) ----

/// Where the fleet reads find their rows: one rule for `GetFleetRun`,
/// `ListFleetRuns`, `ListFleetTargets` and `FollowFleetRun`, one source
/// per store backend, each read in one snapshot.
pub trait FleetSource {
    /// The run.
    ///
    /// # Errors
    /// A store failure.
    fn fleet_run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, StoreError>;
    /// Runs created before `(after_ms, after_id)` (newest first), at most
    /// `limit`: their ids and creation times.
    ///
    /// # Errors
    /// A store failure.
    fn runs_before(
        &mut self,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<([u8; 16], i64)>, StoreError>;
    /// Targets of `run` (in `state` when given) whose client id sorts
    /// after `after`, by client id, at most `limit`.
    ///
    /// # Errors
    /// A store failure.
    fn targets_after(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError>;
    /// The client ids and current stored labels (none for a client
    /// maintenance deleted) of the targets as [`Self::targets_after`]
    /// lists them, at most `max`.
    ///
    /// # Errors
    /// A store failure.
    fn scan_targets(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, Option<String>)>, StoreError>;
    /// One target.
    ///
    /// # Errors
    /// A store failure (a missing target is an integrity failure).
    fn target(&mut self, run: &[u8; 16], client: &str) -> Result<wire::FleetTarget, StoreError>;
    /// Targets whose latest change is after `after_seq`, in change order,
    /// at most `limit`.
    ///
    /// # Errors
    /// A store failure.
    fn changes(
        &mut self,
        run: &[u8; 16],
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError>;
}

fn must_read<S: FleetSource + ?Sized>(src: &mut S, run: &[u8; 16]) -> Result<RunRow, OpError> {
    src.fleet_run(run)?.ok_or_else(|| {
        OpError::Refused(
            DomainError::new(Code::NotFound, "no such fleet run").with_field("fleet_run_id"),
        )
    })
}

/// The fleet reads on one SQLite connection.
#[derive(Debug)]
pub struct SqliteFleetReads<'a> {
    conn: &'a Connection,
}

impl<'a> SqliteFleetReads<'a> {
    /// Reads on `conn` (inside the caller's snapshot).
    #[must_use]
    pub fn new(conn: &'a Connection) -> Self {
        Self { conn }
    }
}

impl FleetSource for SqliteFleetReads<'_> {
    fn fleet_run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, StoreError> {
        load_run(self.conn, run)
    }

    fn runs_before(
        &mut self,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<([u8; 16], i64)>, StoreError> {
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT run_id, created_ms FROM fleet_runs
                 WHERE created_ms < ?1 OR (created_ms = ?1 AND run_id < ?2)
                 ORDER BY created_ms DESC, run_id DESC LIMIT ?3",
            )
            .map_err(|e| StoreError::sqlite("list fleet runs", e))?;
        let rows: Vec<(Vec<u8>, i64)> = st
            .query_map(
                params![
                    after_ms,
                    after_id.as_slice(),
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("list fleet runs", e))?;
        rows.into_iter()
            .map(|(id, ms)| {
                <[u8; 16]>::try_from(id.as_slice())
                    .map(|id| (id, ms))
                    .map_err(|_| integrity("id"))
            })
            .collect()
    }

    fn targets_after(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError> {
        // two statements, so each uses its own index range
        let sql = if state.is_some() {
            format!(
                "SELECT {TARGET_COLUMNS} FROM fleet_targets
                 WHERE run_id = ?1 AND state = ?2 AND client_id > ?3 ORDER BY client_id LIMIT ?4"
            )
        } else {
            format!(
                "SELECT {TARGET_COLUMNS} FROM fleet_targets
                 WHERE run_id = ?1 AND ?2 IS NULL AND client_id > ?3 ORDER BY client_id LIMIT ?4"
            )
        };
        let mut st = self
            .conn
            .prepare_cached(&sql)
            .map_err(|e| StoreError::sqlite("list fleet targets", e))?;
        st.query_map(
            params![
                run.as_slice(),
                state,
                after,
                i64::try_from(limit).unwrap_or(i64::MAX)
            ],
            target_of,
        )
        .and_then(Iterator::collect)
        .map_err(|e| StoreError::sqlite("list fleet targets", e))
    }

    fn scan_targets(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, Option<String>)>, StoreError> {
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT t.client_id, c.labels FROM fleet_targets t
                 LEFT JOIN clients c ON c.client_id = t.client_id
                 WHERE t.run_id = ?1 AND (?2 IS NULL OR t.state = ?2) AND t.client_id > ?3
                 ORDER BY t.client_id LIMIT ?4",
            )
            .map_err(|e| StoreError::sqlite("scan fleet targets", e))?;
        st.query_map(
            params![
                run.as_slice(),
                state,
                after,
                i64::try_from(max).unwrap_or(i64::MAX)
            ],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .and_then(Iterator::collect)
        .map_err(|e| StoreError::sqlite("scan fleet targets", e))
    }

    fn target(&mut self, run: &[u8; 16], client: &str) -> Result<wire::FleetTarget, StoreError> {
        self.conn
            .query_row_cached(
                &format!(
                    "SELECT {TARGET_COLUMNS} FROM fleet_targets WHERE run_id = ?1 AND client_id = ?2"
                ),
                params![run.as_slice(), client],
                target_of,
            )
            .map_err(|e| StoreError::sqlite("read fleet target", e))
    }

    fn changes(
        &mut self,
        run: &[u8; 16],
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError> {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT {TARGET_COLUMNS} FROM fleet_targets
                 WHERE run_id = ?1 AND change_seq > ?2 ORDER BY change_seq LIMIT ?3"
            ))
            .map_err(|e| StoreError::sqlite("read fleet changes", e))?;
        st.query_map(
            params![
                run.as_slice(),
                to_i64(after_seq),
                i64::try_from(limit).unwrap_or(i64::MAX)
            ],
            target_of,
        )
        .and_then(Iterator::collect)
        .map_err(|e| StoreError::sqlite("read fleet changes", e))
    }
}

/// `GetFleetRun`.
///
/// # Errors
/// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
pub fn get_fleet_run<S: FleetSource + ?Sized>(
    src: &mut S,
    req: &wire::GetFleetRunRequest,
) -> Result<wire::GetFleetRunResponse, OpError> {
    let run = parse_run_id(&req.fleet_run_id)?;
    let row = must_read(src, &run)?;
    Ok(wire::GetFleetRunResponse {
        run: Some(record_of(&row)?),
    })
}

fn token_error(e: &rvbox_domain::token::TokenError) -> OpError {
    OpError::Refused(
        DomainError::new(Code::InvalidArgument, e.to_string()).with_field("page_token"),
    )
}

/// `ListFleetRuns`: newest first.
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size or token, or a store failure.
pub fn list_fleet_runs<S: FleetSource + ?Sized>(
    src: &mut S,
    key: [u8; 32],
    req: &wire::ListFleetRunsRequest,
) -> Result<wire::ListFleetRunsResponse, OpError> {
    let limit = crate::records::page_size(req.page_size).map_err(OpError::Refused)?;
    let codec = TokenCodec::new(TokenKey::new(key));
    let filters = encode_filters(&[]);
    let (after_ms, after_id) = if req.page_token.is_empty() {
        (i64::MAX, [0xffu8; 16])
    } else {
        let pos = codec
            .open(TokenKind::FleetRunPage, &filters, &req.page_token)
            .map_err(|e| token_error(&e))?;
        let p = PagePosition::decode(&pos).map_err(|e| token_error(&e))?;
        (p.sort_key, p.id)
    };
    let ids = src.runs_before(after_ms, &after_id, limit as usize + 1)?;
    let more = ids.len() > limit as usize;
    let mut runs = Vec::new();
    let mut last = None;
    for (id, ms) in ids.into_iter().take(limit as usize) {
        runs.push(record_of(&must_read(src, &id)?)?);
        last = Some((ms, id));
    }
    let next_page_token = match (more, last) {
        (true, Some((ms, id))) => codec
            .seal(
                TokenKind::FleetRunPage,
                &filters,
                &PagePosition { sort_key: ms, id }.encode(),
            )
            .map_err(|e| token_error(&e))?,
        _ => String::new(),
    };
    Ok(wire::ListFleetRunsResponse {
        runs,
        next_page_token,
    })
}

/// `ListFleetTargets`: by client id, optionally in one state.
///
/// # Errors
/// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
pub fn list_fleet_targets<S: FleetSource + ?Sized>(
    src: &mut S,
    key: [u8; 32],
    req: &wire::ListFleetTargetsRequest,
) -> Result<wire::ListFleetTargetsResponse, OpError> {
    let run = parse_run_id(&req.fleet_run_id)?;
    must_read(src, &run)?;
    let limit = crate::records::page_size(req.page_size).map_err(OpError::Refused)?;
    let state = match wire::FleetTargetState::try_from(req.state) {
        Ok(wire::FleetTargetState::Unspecified) => None,
        Ok(s) => Some(s as i32),
        Err(_) => {
            return Err(invalid(
                "state",
                format!("{} is not a fleet target state", req.state),
            ));
        }
    };
    let selector = crate::records::selector_of(&req.selector)?;
    let state_bytes = state.unwrap_or(0).to_be_bytes();
    let mut filter_items: Vec<(&str, &[u8])> =
        vec![("run", run.as_slice()), ("state", &state_bytes)];
    if selector.is_some() {
        filter_items.push(("selector", req.selector.as_bytes()));
    }
    let filters = encode_filters(&filter_items);
    let codec = TokenCodec::new(TokenKey::new(key));
    let after = if req.page_token.is_empty() {
        String::new()
    } else {
        let pos = codec
            .open(TokenKind::FleetTargetPage, &filters, &req.page_token)
            .map_err(|e| token_error(&e))?;
        String::from_utf8(pos).map_err(|_| invalid("page_token", "page_token is malformed"))?
    };
    if let Some(selector) = selector {
        return targets_by_labels(src, &codec, &filters, &run, state, &after, limit, &selector);
    }
    let mut targets = src.targets_after(&run, state, &after, limit as usize + 1)?;
    let more = targets.len() > limit as usize;
    targets.truncate(limit as usize);
    let next_page_token = match (more, targets.last()) {
        (true, Some(t)) => codec
            .seal(TokenKind::FleetTargetPage, &filters, t.client_id.as_bytes())
            .map_err(|e| token_error(&e))?,
        _ => String::new(),
    };
    Ok(wire::ListFleetTargetsResponse {
        targets,
        next_page_token,
    })
}

/// A `ListFleetTargets` page of the targets whose client's current labels
/// match `selector`: at most [`crate::records::MAX_FILTER_SCAN`] targets
/// examined, so a page may come back short (or empty) with a token.
#[allow(clippy::too_many_arguments)]
fn targets_by_labels<S: FleetSource + ?Sized>(
    src: &mut S,
    codec: &TokenCodec,
    filters: &[u8],
    run: &[u8; 16],
    state: Option<i32>,
    after: &str,
    limit: u32,
    selector: &rvbox_domain::labels::Selector,
) -> Result<wire::ListFleetTargetsResponse, OpError> {
    // a client maintenance deleted has no labels: it matches only
    // selectors that ask for a label to be absent
    let scanned = src.scan_targets(run, state, after, crate::records::MAX_FILTER_SCAN)?;
    let (picked, more, last) = crate::records::pick_page(scanned, limit as usize, |_, labels| {
        selector.matches(&crate::records::stored_labels(
            labels.as_deref().unwrap_or(""),
        ))
    });
    let mut targets = Vec::with_capacity(picked.len());
    for id in &picked {
        targets.push(src.target(run, id)?);
    }
    let next_page_token = match (more, last) {
        (true, Some(last)) => codec
            .seal(TokenKind::FleetTargetPage, filters, last.as_bytes())
            .map_err(|e| token_error(&e))?,
        _ => String::new(),
    };
    Ok(wire::ListFleetTargetsResponse {
        targets,
        next_page_token,
    })
}

/// Targets of `run` whose latest change is after `after_seq`, in change
/// order, at most `limit` (FollowFleetRun).
///
/// # Errors
/// `INVALID_ARGUMENT`, `NOT_FOUND`, or a store failure.
pub fn fleet_changes<S: FleetSource + ?Sized>(
    src: &mut S,
    run_text: &str,
    after_seq: u64,
    limit: usize,
) -> Result<(wire::FleetRunRecord, Vec<wire::FleetTarget>), OpError> {
    let run = parse_run_id(run_text)?;
    let row = must_read(src, &run)?;
    let targets = src.changes(&run, after_seq, limit)?;
    Ok((record_of(&row)?, targets))
}

/// Each run's counters beside a recount of its targets: (run id text,
/// stored counts, recount) for every run where they differ.
///
/// # Errors
/// A store failure.
pub fn fleet_count_mismatches(
    conn: &Connection,
) -> Result<Vec<(String, Counts, Counts)>, StoreError> {
    let runs: Vec<Vec<u8>> = {
        let mut st = conn
            .prepare_cached("SELECT run_id FROM fleet_runs ORDER BY run_id")
            .map_err(|e| StoreError::sqlite("recount fleet runs", e))?;
        st.query_map([], |r| r.get(0))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("recount fleet runs", e))?
    };
    let mut out = Vec::new();
    for id in runs {
        let id = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| integrity("id"))?;
        let Some(row) = load_run(conn, &id)? else {
            continue;
        };
        let mut recount = Counts::default();
        let mut st = conn
            .prepare_cached(
                "SELECT state, COUNT(*) FROM fleet_targets WHERE run_id = ?1 GROUP BY state",
            )
            .map_err(|e| StoreError::sqlite("recount fleet targets", e))?;
        let rows: Vec<(i32, i64)> = st
            .query_map(params![id.as_slice()], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(Iterator::collect)
            .map_err(|e| StoreError::sqlite("recount fleet targets", e))?;
        for (state, n) in rows {
            let s = wire::FleetTargetState::try_from(state)
                .unwrap_or(wire::FleetTargetState::Unspecified);
            recount.add_n(s, to_u64(n));
        }
        if recount != row.counts || recount.total() != row.targets {
            out.push((uuid_text(&id), row.counts, recount));
        }
    }
    Ok(out)
}
