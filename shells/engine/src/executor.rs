//! The store executor: performs the server core's store operations
//! against the real [`Store`] and returns their completions. It decides
//! nothing of the protocol; every decision arrived with the operation
//! (the signal rule is the core's [`rvbox_server_core::signal_plan`]).
//!
//! Writes of many connections are grouped: [`Executor::perform_batch`]
//! performs a batch of operations in order, and
//! - every run of consecutive [`StoreOp::AppendEvents`] in it becomes one
//!   [`Store::append_events`] call, that is one durable commit for the
//!   group; each operation still gets its own completion with its own
//!   outcomes and acknowledgements;
//! - every run of consecutive single-command writes (a dispatch, an
//!   acceptance) and reads becomes one [`rvbox_store::write_group::WriteGroup`]:
//!   one transaction, one durable commit, each write its own savepoint.
//!   When the group fails, every operation of it is answered
//!   `UNAVAILABLE`, reads included (they saw the group's writes).
//!
//! No completion leaves before the commit that made its write durable:
//! the whole batch's completions are returned after the last group.

use std::collections::BTreeMap;

use rvbox_store::Store;
use rvbox_store::error::StoreError;
use rvbox_store::mutations::OpError;
use rvbox_store::write_group::{WriteGroup, still_dispatched};
use rvbox_store_port::commands::{CommandView, Knowledge};
use rvbox_store_port::events::{AppendReport, EventAppend};
use rvbox_store_port::ops::{Completion, OpResult, OpToken, PortError, StoreOp};

/// Performs store operations.
#[derive(Debug)]
pub struct Executor {
    store: Store,
    groups: u64,
    grouped_ops: u64,
    write_groups: u64,
    write_grouped_ops: u64,
}

/// How a batch performs an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// With the adjacent appends, in one [`Store::append_events`] call.
    Append,
    /// With the adjacent single-command writes and reads, in one write
    /// group.
    Grouped,
    /// In its own transaction(s).
    Alone,
}

/// The operations that only read the store, as a pattern.
macro_rules! read_ops {
    () => {
        StoreOp::LoadClient { .. }
            | StoreOp::NonTerminalCommands { .. }
            | StoreOp::Knowledge { .. }
            | StoreOp::DispatchCandidates { .. }
            | StoreOp::CommandView { .. }
            | StoreOp::ExpiryDue { .. }
            | StoreOp::PendingSignals { .. }
            | StoreOp::PendingStdin { .. }
            | StoreOp::ScriptInfo { .. }
            | StoreOp::ScriptRange { .. }
    };
}

fn way(op: &StoreOp) -> Way {
    match op {
        StoreOp::AppendEvents { .. } => Way::Append,
        StoreOp::Dispatch { .. } | StoreOp::RecordAccepted { .. } => Way::Grouped,
        read_ops!() => Way::Grouped,
        _ => Way::Alone,
    }
}

/// A read operation (one of `read_ops!`) on `s`.
fn read(s: &Store, wall_ms: i64, op: StoreOp) -> OpResult {
    match op {
        StoreOp::LoadClient { client_id } => s
            .client_record(&client_id)
            .map(Completion::Client)
            .map_err(port_store),
        StoreOp::NonTerminalCommands { client_id } => s
            .non_terminal_commands(&client_id)
            .map(Completion::Commands)
            .map_err(port_store),
        StoreOp::Knowledge { issues } => {
            let mut known: Vec<([u8; 16], Knowledge)> = Vec::with_capacity(issues.len());
            for issue in issues {
                known.push((issue, s.command_knowledge(&issue).map_err(port_store)?));
            }
            Ok(Completion::Knowledge(known))
        }
        StoreOp::DispatchCandidates { client_id, limit } => {
            let mut rows: Vec<CommandView> =
                s.queued_commands(&client_id, limit).map_err(port_store)?;
            // dispatched commands not in flight on the session go again
            rows.extend(
                s.non_terminal_commands(&client_id)
                    .map_err(port_store)?
                    .into_iter()
                    .filter(|v| v.lifecycle == rvbox_domain::lifecycle::Lifecycle::Dispatched)
                    .take(limit),
            );
            Ok(Completion::Commands(rows))
        }
        StoreOp::CommandView { issue } => {
            s.command_view(&issue).map(Completion::View).map_err(port)
        }
        StoreOp::ExpiryDue { limit } => s
            .expiry_due(wall_ms, limit)
            .map(Completion::Commands)
            .map_err(port_store),
        StoreOp::PendingSignals { issues } => {
            let mut all = Vec::new();
            for issue in issues {
                all.extend(s.pending_signals(&issue).map_err(port_store)?);
            }
            Ok(Completion::PendingSignals(all))
        }
        StoreOp::PendingStdin {
            issue,
            after_seq,
            max_bytes,
            max_writes,
        } => s
            .pending_stdin(&issue, after_seq, max_bytes, max_writes)
            .map(Completion::StdinWrites)
            .map_err(port_store),
        StoreOp::ScriptInfo { issue } => {
            let lifecycle = s.command_view(&issue).map_err(port)?.lifecycle;
            let size = s.script_size(&issue).map_err(port)?;
            Ok(Completion::Script { lifecycle, size })
        }
        StoreOp::ScriptRange { issue, offset, len } => {
            let len = usize::try_from(len)
                .map_err(|_| PortError::Unavailable("script range length out of bounds".into()))?;
            match s.script_range(&issue, offset, len).map_err(port)? {
                Some((_, bytes)) => Ok(Completion::ScriptBytes(bytes)),
                None => Ok(Completion::ScriptBytes(Vec::new())),
            }
        }
        _ => Err(PortError::Unavailable(
            "internal: a write was performed as a read".into(),
        )),
    }
}

/// An operation of a write group.
fn grouped(g: &mut WriteGroup<'_>, wall_ms: i64, op: StoreOp) -> OpResult {
    match op {
        StoreOp::Dispatch {
            issue,
            revision,
            write,
            session,
        } => {
            if write {
                g.mark_dispatched(Some(session), &issue, revision)
                    .map_err(port)?;
            } else {
                // sent again: only while it is still dispatched at the
                // revision the decision saw (a signal decided since
                // raised it, and must not be overtaken by a Dispatch)
                still_dispatched(g.store(), Some(session), &issue, revision).map_err(port)?;
            }
            g.store()
                .execution_spec(&issue)
                .map(|spec| Completion::Spec(Box::new(spec)))
                .map_err(port)
        }
        StoreOp::RecordAccepted {
            issue,
            revision,
            resolved_shell,
            session,
        } => done(g.record_accepted(Some(session), &issue, revision, resolved_shell)),
        op => read(g.store(), wall_ms, op),
    }
}

fn port(e: OpError) -> PortError {
    match e {
        OpError::Refused(d) => PortError::Refused(d),
        OpError::Store(s) => PortError::Unavailable(s.to_string()),
    }
}

fn port_store(e: StoreError) -> PortError {
    PortError::Unavailable(e.to_string())
}

/// `AuthorizeClientTakeover`: the request's ids checked, the grant stored.
fn authorize_takeover(
    s: &mut Store,
    req: &rvbox_proto::v1::AuthorizeClientTakeoverRequest,
    caller: &rvbox_store_port::audit::Caller,
    ttl_ms: u64,
    wall_ms: i64,
) -> OpResult {
    use rvbox_domain::error::DomainError;
    let request_id = rvbox_domain::ids::Uuid7::parse("request_id", &req.request_id)
        .map_err(|e| PortError::Refused(DomainError::from(e)))?;
    let instance =
        rvbox_domain::ids::InstanceId::parse("client_instance_id", &req.client_instance_id)
            .map_err(|e| PortError::Refused(DomainError::from(e)))?;
    let grant = s
        .authorize_takeover_as(
            &request_id,
            &req.client_id,
            instance.as_bytes(),
            ttl_ms,
            caller,
            wall_ms,
        )
        .map_err(port)?;
    Ok(Completion::Takeover(
        rvbox_proto::v1::AuthorizeClientTakeoverResponse {
            client_id: req.client_id.clone(),
            client_instance_id: req.client_instance_id.clone(),
            grant_expiry_time: Some(prost_types::Timestamp {
                seconds: grant.expires_ms.div_euclid(1000),
                nanos: i32::try_from(grant.expires_ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
            }),
        },
    ))
}

/// An incident operation's answer; a response without its incident is the
/// store's fault, never the caller's.
fn incident_answer(r: Result<Option<rvbox_proto::v1::StorageIncident>, OpError>) -> OpResult {
    match r.map_err(port)? {
        Some(i) => Ok(Completion::Incident(Box::new(i))),
        None => Err(PortError::Unavailable(
            "the store answered an incident operation without the incident".into(),
        )),
    }
}

fn done<T>(r: Result<T, OpError>) -> OpResult {
    r.map(|_| Completion::Done).map_err(port)
}

impl Executor {
    /// An executor over a recovered store.
    #[must_use]
    pub fn new(store: Store) -> Self {
        Self {
            store,
            groups: 0,
            grouped_ops: 0,
            write_groups: 0,
            write_grouped_ops: 0,
        }
    }

    /// The store (read access for callers and checkers).
    #[must_use]
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The store, for what is not yet an operation of the port.
    pub fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    /// Gives the store back.
    #[must_use]
    pub fn into_store(self) -> Store {
        self.store
    }

    /// Append groups committed, and the append operations they carried.
    #[must_use]
    pub fn group_stats(&self) -> (u64, u64) {
        (self.groups, self.grouped_ops)
    }

    /// Write groups committed or failed, and the operations they carried.
    #[must_use]
    pub fn write_group_stats(&self) -> (u64, u64) {
        (self.write_groups, self.write_grouped_ops)
    }

    /// Performs `ops` in order, each run of consecutive appends one durable
    /// commit, each run of consecutive single-command writes and reads
    /// another; returns one completion per operation, in the same order.
    pub fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        let mut out = Vec::with_capacity(ops.len());
        let mut run: Vec<(OpToken, i64, StoreOp)> = Vec::new();
        let mut run_way = Way::Alone;
        for (token, wall_ms, op) in ops {
            let w = way(&op);
            if w != run_way || w == Way::Alone {
                self.flush_run(run_way, std::mem::take(&mut run), &mut out);
                run_way = w;
            }
            if w == Way::Alone {
                out.push((token, self.perform(wall_ms, op)));
            } else {
                run.push((token, wall_ms, op));
            }
        }
        self.flush_run(run_way, run, &mut out);
        out
    }

    fn flush_run(
        &mut self,
        way: Way,
        run: Vec<(OpToken, i64, StoreOp)>,
        out: &mut Vec<(OpToken, OpResult)>,
    ) {
        if run.is_empty() {
            return;
        }
        match way {
            Way::Append => {
                let wall_ms = run.last().map_or(0, |r| r.1);
                let group = run
                    .into_iter()
                    .filter_map(|(token, _, op)| match op {
                        StoreOp::AppendEvents { events } => Some((token, events)),
                        _ => None,
                    })
                    .collect();
                out.extend(self.append_group(group, wall_ms));
            }
            Way::Grouped => out.extend(self.write_group(run)),
            Way::Alone => {
                for (token, wall_ms, op) in run {
                    out.push((token, self.perform(wall_ms, op)));
                }
            }
        }
    }

    /// One transaction and one durable commit for a run of single-command
    /// writes and reads; nothing of it is kept, and each operation is
    /// answered `UNAVAILABLE`, when any write or the commit fails.
    fn write_group(&mut self, run: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        self.write_groups += 1;
        self.write_grouped_ops += run.len() as u64;
        let mut group = match self.store.write_group() {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, operations = run.len(), "write group could not begin");
                let msg = e.to_string();
                return run
                    .into_iter()
                    .map(|(token, _, _)| (token, Err(PortError::Unavailable(msg.clone()))))
                    .collect();
            }
        };
        let mut done = Vec::with_capacity(run.len());
        for (token, wall_ms, op) in run {
            done.push((token, grouped(&mut group, wall_ms, op)));
        }
        match group.commit() {
            Ok(_) => done,
            Err(e) => {
                let msg = e.to_string();
                done.into_iter()
                    .map(|(token, _)| (token, Err(PortError::Unavailable(msg.clone()))))
                    .collect()
            }
        }
    }

    /// One durable commit for the appends of a group; each request gets
    /// its own outcomes and the acknowledgements of the commands it
    /// touched.
    fn append_group(
        &mut self,
        group: Vec<(OpToken, Vec<EventAppend>)>,
        wall_ms: i64,
    ) -> Vec<(OpToken, OpResult)> {
        self.groups += 1;
        self.grouped_ops += group.len() as u64;
        let all: Vec<EventAppend> = group.iter().flat_map(|(_, e)| e.iter().cloned()).collect();
        match self.store.append_events(&all, wall_ms) {
            Ok(report) => {
                let mut outcomes = report.outcomes.into_iter();
                group
                    .into_iter()
                    .map(|(token, events)| {
                        let mine: Vec<_> = outcomes.by_ref().take(events.len()).collect();
                        let acked: BTreeMap<[u8; 16], u64> = events
                            .iter()
                            .filter_map(|e| {
                                report.acked.get(&e.issue_uuid).map(|s| (e.issue_uuid, *s))
                            })
                            .collect();
                        (
                            token,
                            Ok(Completion::Appended(AppendReport {
                                outcomes: mine,
                                acked,
                            })),
                        )
                    })
                    .collect()
            }
            Err(e) => {
                tracing::error!(error = %e, events = all.len(), "group commit failed; nothing acknowledged");
                let msg = e.to_string();
                group
                    .into_iter()
                    .map(|(token, _)| (token, Err(PortError::Unavailable(msg.clone()))))
                    .collect()
            }
        }
    }

    /// Performs one operation.
    pub fn perform(&mut self, wall_ms: i64, op: StoreOp) -> OpResult {
        let s = &mut self.store;
        match op {
            op @ (read_ops!()) => read(s, wall_ms, op),
            StoreOp::Register(reg) => s
                .register_session(&reg, wall_ms)
                .map(|generation| Completion::Registered { generation })
                .map_err(port),
            StoreOp::RecordPendingClaim {
                client_id,
                instance_id,
            } => done(s.record_pending_claim(&client_id, &instance_id, wall_ms)),
            StoreOp::CloseSession { session_id, reason } => s
                .close_session(&session_id, false, &reason, wall_ms)
                .map(|_| Completion::Done)
                .map_err(port_store),
            StoreOp::ApplyReconciliation {
                client_id,
                session,
                writes,
                incidents,
            } => done(s.apply_reconciliation(
                Some(session),
                &client_id,
                &writes,
                &incidents,
                wall_ms,
            )),
            StoreOp::RecordIncident(incident) => s
                .record_protocol_incident(&incident, wall_ms)
                .map(|_| Completion::Done)
                .map_err(port_store),
            StoreOp::Dispatch { .. } | StoreOp::RecordAccepted { .. } => {
                let mut group = s.write_group().map_err(port_store)?;
                let r = grouped(&mut group, wall_ms, op);
                group.commit().map_err(port_store)?;
                r
            }
            StoreOp::MarkExpiredPending { issue, revision } => {
                done(s.mark_expired_pending(&issue, revision))
            }
            StoreOp::AcceptLate {
                issue,
                revision,
                resolved_shell,
                incident,
                session,
            } => done(s.accept_late(
                Some(session),
                &issue,
                revision,
                resolved_shell,
                &incident,
                wall_ms,
            )),
            StoreOp::Requeue {
                issue,
                revision,
                session,
            } => s
                .requeue(Some(session), &issue, revision, wall_ms)
                .map(Completion::Requeued)
                .map_err(port),
            StoreOp::FinishByServer {
                issue,
                from,
                revision,
                how,
                rejection,
                session,
            } => done(s.finish_by_server(
                session,
                &issue,
                &from,
                revision,
                how,
                rejection.as_ref(),
                None,
                wall_ms,
            )),
            StoreOp::AppendEvents { events } => s
                .append_events(&events, wall_ms)
                .map(Completion::Appended)
                .map_err(port_store),
            StoreOp::SignalCommand { request, caller } => {
                let signal = request.signal;
                s.signal_command_as(
                    &request,
                    &caller,
                    |v| rvbox_server_core::signal_plan(v, signal),
                    wall_ms,
                )
                .map(Completion::Signal)
                .map_err(port)
            }
            StoreOp::AuthorizeTakeover {
                request,
                caller,
                ttl_ms,
            } => authorize_takeover(s, &request, &caller, ttl_ms, wall_ms),
            StoreOp::RepairIncident { request, caller } => incident_answer(
                s.repair_incident(&request, &caller, wall_ms)
                    .map(|r| r.incident),
            ),
            StoreOp::AcknowledgeIncident { request, caller } => incident_answer(
                s.acknowledge_incident(&request, &caller, wall_ms)
                    .map(|r| r.incident),
            ),
            StoreOp::Audit(records) => s
                .session_audits(&records, wall_ms)
                .map(|()| Completion::Done)
                .map_err(port_store),
            StoreOp::PtyMutation {
                mutation,
                caller,
                limits,
            } => s
                .pty_mutation_as(&mutation, &caller, limits, wall_ms)
                .map(|o| Completion::Pty(Box::new(o)))
                .map_err(port),
            StoreOp::PtyApply {
                client_id,
                session,
                reports,
                recording_bytes,
            } => s
                .pty_apply(
                    &client_id,
                    Some(&session),
                    &reports,
                    recording_bytes,
                    wall_ms,
                )
                .map(Completion::PtyApplied)
                .map_err(port),
            StoreOp::PtyResume { client_id } => s
                .pty_resume(&client_id)
                .map(Completion::PtyResume)
                .map_err(port_store),
            StoreOp::PtyIdle {
                idle_before_ms,
                limit,
            } => s
                .pty_idle(idle_before_ms, limit)
                .map(Completion::PtyIdle)
                .map_err(port),
            StoreOp::AppendStdin { request, caller } => s
                .append_stdin_as(&request, &caller, wall_ms)
                .map(|o| Completion::Stdin(Box::new(o)))
                .map_err(port),
            StoreOp::CloseStdin { request, caller } => s
                .close_stdin_as(&request, &caller, wall_ms)
                .map(|o| Completion::Stdin(Box::new(o)))
                .map_err(port),
            StoreOp::RunFleet { request, caller } => s
                .run_fleet_as(&request, &caller, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o)))
                .map_err(port),
            StoreOp::FleetAction { action, caller } => s
                .fleet_action_as(&action, &caller, rvbox_server_core::signal_plan, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o)))
                .map_err(port),
            StoreOp::FleetPump { limit } => s
                .fleet_pump(limit, wall_ms)
                .map(|o| Completion::Fleet(Box::new(o)))
                .map_err(port),
            StoreOp::RunCommand { request, caller } => s
                .run_command_as(&request, &caller, wall_ms)
                .map(Completion::RunCommand)
                .map_err(port),
            StoreOp::Maintain => s
                .maintain(wall_ms)
                .map(Completion::Maintained)
                .map_err(port_store),
            StoreOp::Scrub => s
                .scrub(wall_ms)
                .map(Completion::Scrubbed)
                .map_err(port_store),
        }
    }
}

impl rvbox_store_port::ops::Backend for Executor {
    fn perform_batch(&mut self, ops: Vec<(OpToken, i64, StoreOp)>) -> Vec<(OpToken, OpResult)> {
        Executor::perform_batch(self, ops)
    }

    /// Moves the audit outbox into the audit segments, so a stopped
    /// server's audit log is whole on disk (and `rvbox-server audit
    /// verify` checks all of it).
    fn close(&mut self, wall_ms: i64) {
        match self.store.flush_audit(wall_ms) {
            Ok(n) if n > 0 => tracing::info!(records = n, "audit outbox flushed at stop"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "audit outbox not flushed at stop; it stays durable and moves at the next start");
            }
        }
    }

    fn perform(&mut self, wall_ms: i64, op: StoreOp) -> OpResult {
        Executor::perform(self, wall_ms, op)
    }
}
