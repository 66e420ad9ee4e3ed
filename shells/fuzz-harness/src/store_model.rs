//! A model store for the server-core target: answers every store
//! operation with a completion of the right shape, from a small in-memory
//! state that behaves as the real store does where the core can see it
//! (client records and generations, the session fence, command lifecycles
//! and revisions under compare-and-set, event sequences and the durable
//! watermark, stdin writes). It is deliberately small: fleet runs and
//! terminals do not exist in it (their mutations are refused `NOT_FOUND`,
//! a release pass finds no live run, terminal reports name unknown
//! terminals), so those modules' success paths are not reached through it.
//!
//! Nothing here is a second implementation of the store's rules: where
//! the model would have to decide something the real store decides
//! (quotas, retention, incidents), it answers the simplest true thing.

use std::collections::BTreeMap;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store_port::commands::{CommandView, Knowledge, ReconcileWrite};
use rvbox_store_port::events::{AppendReport, EventBody, EventOutcome};
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};
use rvbox_store_port::sessions::{ClientRecord, LiveSession, SessionFence};
use rvbox_store_port::signals::SignalOutcome;
use rvbox_store_port::stdin::{StdinOutcome, StdinResponse, StdinWrites};

/// The clients the model knows (the hellos of the target use them).
pub const CLIENTS: [&str; 3] = ["web-01", "web-02", "db-1"];

/// The `n`-th command id of the model (canonical UUIDv7 text).
#[must_use]
pub fn issue_text(n: u32) -> String {
    format!("01890a5d-ac96-774b-bcce-b30209a{n:05x}")
}

fn issue_bytes(n: u32) -> [u8; 16] {
    Uuid7::parse("issue", &issue_text(n))
        .map(|u| *u.as_bytes())
        .unwrap_or([0; 16])
}

fn refused(code: Code, why: &str) -> OpResult {
    Err(PortError::Refused(DomainError::new(code, why)))
}

/// One command as the model holds it.
#[derive(Debug, Clone)]
pub struct Command {
    /// The view the core reads.
    pub view: CommandView,
    /// Highest event sequence made durable.
    pub durable_seq: u64,
    /// Stdin writes made durable, in order.
    pub stdin: Vec<wire::StdinWrite>,
    /// Stdin closed.
    pub stdin_closed: bool,
    /// The uploaded script's raw bytes (empty for command text).
    pub script: Vec<u8>,
}

/// The model store.
#[derive(Debug, Clone, Default)]
pub struct StoreModel {
    /// Client records by id.
    pub clients: BTreeMap<String, ClientRecord>,
    /// Commands by id.
    pub commands: BTreeMap<[u8; 16], Command>,
    /// Every (session id, generation) a registration installed.
    pub installed: Vec<([u8; 16], u64)>,
    next_issue: u32,
}

impl StoreModel {
    /// A store with a few queued commands for the first two clients,
    /// created at wall time `wall_ms`.
    #[must_use]
    pub fn seeded(wall_ms: i64) -> Self {
        let mut m = Self {
            next_issue: 1,
            ..Self::default()
        };
        for client in [CLIENTS[0], CLIENTS[0], CLIENTS[1]] {
            m.create(client, wall_ms, Vec::new());
        }
        // a script command: its upload follows the acceptance
        let script: Vec<u8> = b"#!/bin/sh\necho from a script\n".repeat(40);
        m.create(CLIENTS[0], wall_ms, script);
        m
    }

    /// Creates a queued command for `client` (a script command when
    /// `script` is not empty); returns its id.
    pub fn create(&mut self, client: &str, wall_ms: i64, script: Vec<u8>) -> [u8; 16] {
        let issue = issue_bytes(self.next_issue);
        self.next_issue = self.next_issue.saturating_add(1);
        self.commands.insert(
            issue,
            Command {
                view: CommandView {
                    issue_uuid: issue,
                    client_id: client.to_owned(),
                    lifecycle: Lifecycle::Queued,
                    revision: 1,
                    request_hash: [7; 32],
                    last_event_seq: 0,
                    issue_time_ms: wall_ms,
                    queue_expiry_ms: Some(wall_ms.saturating_add(3_600_000)),
                    expired_pending: false,
                    script_bytes: u64::try_from(script.len()).unwrap_or(u64::MAX),
                },
                durable_seq: 0,
                stdin: Vec::new(),
                stdin_closed: false,
                script,
            },
        );
        issue
    }

    /// Whether `fence` is the live session of `client`.
    fn live(&self, client: &str, fence: &SessionFence) -> bool {
        self.clients
            .get(client)
            .and_then(|c| c.live)
            .is_some_and(|l| l.session_id == fence.session_id)
    }

    fn fenced(&self, issue: &[u8; 16], fence: Option<&SessionFence>) -> Result<(), PortError> {
        let Some(fence) = fence else {
            return Ok(());
        };
        let client = self
            .commands
            .get(issue)
            .map(|c| c.view.client_id.clone())
            .unwrap_or_default();
        if self.live(&client, fence) {
            Ok(())
        } else {
            Err(PortError::Refused(DomainError::new(
                Code::StaleSession,
                "the session is not the client's live one",
            )))
        }
    }

    /// Compare-and-set on a command's revision and lifecycle.
    fn command_mut(&mut self, issue: &[u8; 16]) -> Result<&mut Command, PortError> {
        self.commands
            .get_mut(issue)
            .ok_or_else(|| PortError::Refused(DomainError::new(Code::NotFound, "no such command")))
    }

    fn cas(
        &mut self,
        issue: &[u8; 16],
        revision: u64,
        from: &[Lifecycle],
        to: Lifecycle,
    ) -> Result<(), PortError> {
        let c = self.command_mut(issue)?;
        if c.view.revision != revision || !from.contains(&c.view.lifecycle) {
            return Err(PortError::Refused(DomainError::new(
                Code::StaleRevision,
                "the command changed since the decision",
            )));
        }
        // transitions keep the revision; only signals and cancels take
        // the next one (rvbox_domain::lifecycle::Revision)
        c.view.lifecycle = to;
        Ok(())
    }

    fn of_client(&self, client: &str, keep: impl Fn(&Command) -> bool) -> Vec<CommandView> {
        self.commands
            .values()
            .filter(|c| c.view.client_id == client && keep(c))
            .map(|c| c.view.clone())
            .collect()
    }

    /// The plausible answer to `op` at wall time `wall_ms`, applied to the
    /// model.
    pub fn perform(&mut self, wall_ms: i64, op: &StoreOp) -> OpResult {
        match op {
            StoreOp::LoadClient { client_id } => {
                Ok(Completion::Client(self.clients.get(client_id).cloned()))
            }
            StoreOp::Register(r) => {
                let current = self.clients.get(&r.client_id).map_or(0, |c| c.generation);
                let live = self
                    .clients
                    .get(&r.client_id)
                    .and_then(|c| c.live)
                    .map(|l| l.session_id);
                if current != r.expected_generation || live != r.fence {
                    return refused(Code::Conflict, "the client record changed");
                }
                let generation = current.saturating_add(1);
                self.clients.insert(
                    r.client_id.clone(),
                    ClientRecord {
                        client_id: r.client_id.clone(),
                        instance_id: Some(r.instance_id),
                        generation,
                        live: Some(LiveSession {
                            session_id: r.session_id,
                            instance_id: r.instance_id,
                            generation,
                            opened_ms: wall_ms,
                        }),
                        pending_claim: None,
                        grant: None,
                    },
                );
                self.installed.push((r.session_id, generation));
                Ok(Completion::Registered { generation })
            }
            StoreOp::RecordPendingClaim {
                client_id,
                instance_id,
            } => {
                if let Some(c) = self.clients.get_mut(client_id) {
                    c.pending_claim = Some((*instance_id, wall_ms));
                }
                Ok(Completion::Done)
            }
            StoreOp::CloseSession { session_id, .. } => {
                for c in self.clients.values_mut() {
                    if c.live.is_some_and(|l| l.session_id == *session_id) {
                        c.live = None;
                    }
                }
                Ok(Completion::Done)
            }
            StoreOp::NonTerminalCommands { client_id } => Ok(Completion::Commands(
                self.of_client(client_id, |c| !c.view.lifecycle.is_terminal()),
            )),
            StoreOp::Knowledge { issues } => Ok(Completion::Knowledge(
                issues
                    .iter()
                    .map(|i| {
                        let k = match self.commands.get(i) {
                            Some(c) if c.view.lifecycle.is_terminal() => Knowledge::Terminal {
                                request_hash: c.view.request_hash,
                                lifecycle: c.view.lifecycle,
                                last_event_seq: c.durable_seq,
                            },
                            _ => Knowledge::Missing,
                        };
                        (*i, k)
                    })
                    .collect(),
            )),
            StoreOp::ApplyReconciliation {
                client_id,
                session,
                writes,
                ..
            } => {
                if !self.live(client_id, session) {
                    return refused(Code::StaleSession, "not the live session");
                }
                // all or nothing: check every write first
                let mut next = self.clone();
                for w in writes {
                    let r = match w {
                        ReconcileWrite::Requeue { issue, revision } => next.cas(
                            issue,
                            *revision,
                            &[Lifecycle::Dispatched],
                            Lifecycle::Queued,
                        ),
                        ReconcileWrite::Advance {
                            issue,
                            revision,
                            to,
                        } => next.advance(issue, *revision, *to),
                        ReconcileWrite::Interrupt { issue, revision } => {
                            next.cas(issue, *revision, &Lifecycle::ALL, Lifecycle::Interrupted)
                        }
                        ReconcileWrite::LostEvents {
                            issue,
                            revision,
                            first_event_seq,
                            last_event_seq,
                        } => next.lose(issue, *revision, *first_event_seq, *last_event_seq),
                    };
                    r?;
                }
                *self = next;
                Ok(Completion::Done)
            }
            StoreOp::RecordIncident(_) | StoreOp::MarkExpiredPending { .. } | StoreOp::Audit(_) => {
                Ok(Completion::Done)
            }
            StoreOp::DispatchCandidates { client_id, limit } => {
                let mut rows: Vec<CommandView> = self
                    .of_client(client_id, |c| c.view.lifecycle == Lifecycle::Queued)
                    .into_iter()
                    .take(*limit)
                    .collect();
                rows.extend(
                    self.of_client(client_id, |c| c.view.lifecycle == Lifecycle::Dispatched)
                        .into_iter()
                        .take(*limit),
                );
                Ok(Completion::Commands(rows))
            }
            StoreOp::Dispatch {
                issue,
                revision,
                write,
                session,
            } => {
                self.fenced(issue, Some(session))?;
                if *write {
                    self.cas(
                        issue,
                        *revision,
                        &[Lifecycle::Queued],
                        Lifecycle::Dispatched,
                    )?;
                } else {
                    let ok = self.commands.get(issue).is_some_and(|c| {
                        c.view.revision == *revision && c.view.lifecycle == Lifecycle::Dispatched
                    });
                    if !ok {
                        return refused(Code::Conflict, "not dispatched at that revision");
                    }
                }
                Ok(Completion::Spec(Box::new(wire::ExecutionSpec {
                    shell_type: wire::ShellType::Sh as i32,
                    source: Some(wire::execution_spec::Source::CommandText("true".into())),
                    ..Default::default()
                })))
            }
            StoreOp::CommandView { issue } => match self.commands.get(issue) {
                Some(c) => Ok(Completion::View(c.view.clone())),
                None => refused(Code::NotFound, "no such command"),
            },
            StoreOp::RecordAccepted {
                issue,
                revision,
                session,
                ..
            } => {
                self.fenced(issue, Some(session))?;
                self.cas(
                    issue,
                    *revision,
                    &[Lifecycle::Dispatched],
                    Lifecycle::Accepted,
                )?;
                Ok(Completion::Done)
            }
            StoreOp::AcceptLate {
                issue,
                revision,
                session,
                ..
            } => {
                // accepted, with a pending TERM at the next revision
                self.fenced(issue, Some(session))?;
                self.cas(
                    issue,
                    *revision,
                    &[Lifecycle::Dispatched],
                    Lifecycle::Accepted,
                )?;
                if let Some(c) = self.commands.get_mut(issue) {
                    c.view.revision = c.view.revision.saturating_add(1);
                }
                Ok(Completion::Done)
            }
            StoreOp::Requeue {
                issue,
                revision,
                session,
            } => {
                self.fenced(issue, Some(session))?;
                self.cas(
                    issue,
                    *revision,
                    &[Lifecycle::Dispatched],
                    Lifecycle::Queued,
                )?;
                Ok(Completion::Requeued(Lifecycle::Queued))
            }
            StoreOp::FinishByServer {
                issue,
                from,
                revision,
                how,
                session,
                ..
            } => {
                self.fenced(issue, session.as_ref())?;
                self.cas(issue, *revision, from, how.lifecycle())?;
                Ok(Completion::Done)
            }
            StoreOp::ExpiryDue { limit } => Ok(Completion::Commands(
                self.commands
                    .values()
                    .filter(|c| {
                        matches!(c.view.lifecycle, Lifecycle::Queued | Lifecycle::Dispatched)
                            && !c.view.expired_pending
                            && c.view.queue_expiry_ms.is_some_and(|e| e <= wall_ms)
                    })
                    .take(*limit)
                    .map(|c| c.view.clone())
                    .collect(),
            )),
            StoreOp::AppendEvents { events } => Ok(Completion::Appended(self.append(events))),
            StoreOp::SignalCommand { request, .. } => {
                let Some(c) = Uuid7::parse("issue_uuid", &request.issue_uuid)
                    .ok()
                    .and_then(|u| self.commands.get_mut(u.as_bytes()))
                else {
                    return refused(Code::NotFound, "no such command");
                };
                let live = !c.view.lifecycle.is_terminal() && c.view.lifecycle != Lifecycle::Queued;
                if live {
                    // a signal takes the next revision
                    c.view.revision = c.view.revision.saturating_add(1);
                }
                let deliver = live.then(|| wire::Signal {
                    issue_uuid: request.issue_uuid.clone(),
                    revision: c.view.revision,
                    signal: request.signal,
                });
                Ok(Completion::Signal(SignalOutcome {
                    response: wire::SignalCommandResponse::default(),
                    deliver,
                    replayed: false,
                    client_id: c.view.client_id.clone(),
                }))
            }
            StoreOp::PendingSignals { .. } => Ok(Completion::PendingSignals(Vec::new())),
            StoreOp::ScriptInfo { issue } => match self.commands.get(issue) {
                Some(c) => Ok(Completion::Script {
                    lifecycle: c.view.lifecycle,
                    size: (!c.script.is_empty()).then_some(c.view.script_bytes),
                }),
                None => refused(Code::NotFound, "no such command"),
            },
            StoreOp::ScriptRange { issue, offset, len } => match self.commands.get(issue) {
                Some(c) => {
                    let start = usize::try_from(*offset)
                        .unwrap_or(usize::MAX)
                        .min(c.script.len());
                    let end = start
                        .saturating_add(usize::try_from(*len).unwrap_or(usize::MAX))
                        .min(c.script.len());
                    Ok(Completion::ScriptBytes(
                        c.script.get(start..end).unwrap_or_default().to_vec(),
                    ))
                }
                None => refused(Code::NotFound, "no such command"),
            },
            StoreOp::RunCommand { request, .. } => {
                if !CLIENTS.contains(&request.client_id.as_str()) {
                    return refused(Code::InvalidArgument, "unknown client");
                }
                let issue = self.create(&request.client_id, wall_ms, request.script.clone());
                Ok(Completion::RunCommand(wire::RunCommandResponse {
                    issue_uuid: Uuid7::from_bytes("issue", issue)
                        .map(|u| u.to_string())
                        .unwrap_or_default(),
                    queue_expiry_time: None,
                }))
            }
            StoreOp::RunFleet { .. } | StoreOp::FleetAction { .. } => {
                refused(Code::NotFound, "no such fleet run")
            }
            StoreOp::FleetPump { .. } => Ok(Completion::Fleet(Box::new(
                rvbox_store_port::fleet::FleetOutcome {
                    live: false,
                    ..rvbox_store_port::fleet::FleetOutcome::answer(
                        rvbox_store_port::fleet::FleetAnswer::None,
                    )
                },
            ))),
            StoreOp::RepairIncident { .. } | StoreOp::AcknowledgeIncident { .. } => {
                refused(Code::NotFound, "no such incident")
            }
            StoreOp::AuthorizeTakeover { request, .. } => Ok(Completion::Takeover(
                wire::AuthorizeClientTakeoverResponse {
                    client_id: request.client_id.clone(),
                    client_instance_id: request.client_instance_id.clone(),
                    grant_expiry_time: None,
                },
            )),
            StoreOp::AppendStdin { request, .. } => {
                self.stdin(&request.issue_uuid, Some(&request.data), false)
            }
            StoreOp::CloseStdin { request, .. } => self.stdin(&request.issue_uuid, None, true),
            StoreOp::PendingStdin {
                issue,
                after_seq,
                max_bytes,
                max_writes,
            } => {
                let Some(c) = self.commands.get(issue) else {
                    return Ok(Completion::StdinWrites(StdinWrites::default()));
                };
                let mut writes = Vec::new();
                let mut bytes = 0u64;
                for w in c.stdin.iter().filter(|w| w.write_seq > *after_seq) {
                    let len = u64::try_from(w.payload.len()).unwrap_or(u64::MAX);
                    if writes.len() as u64 >= *max_writes || bytes.saturating_add(len) > *max_bytes
                    {
                        break;
                    }
                    bytes = bytes.saturating_add(len);
                    writes.push(w.clone());
                }
                let more =
                    c.stdin.iter().filter(|w| w.write_seq > *after_seq).count() > writes.len();
                Ok(Completion::StdinWrites(StdinWrites { writes, more }))
            }
            StoreOp::PtyMutation { .. } => refused(Code::NotFound, "no such terminal"),
            StoreOp::PtyApply { reports, .. } => Ok(Completion::PtyApplied(
                reports
                    .iter()
                    .map(|_| rvbox_store_port::pty::PtyApplied::Unknown)
                    .collect(),
            )),
            StoreOp::PtyResume { .. } => Ok(Completion::PtyResume(Vec::new())),
            StoreOp::PtyIdle { .. } => Ok(Completion::PtyIdle(Vec::new())),
            StoreOp::Maintain => Ok(Completion::Maintained(
                rvbox_store_port::maintenance::MaintenanceReport::default(),
            )),
            StoreOp::Scrub => Ok(Completion::Scrubbed(
                rvbox_store_port::maintenance::ScrubReport {
                    idle: true,
                    ..Default::default()
                },
            )),
        }
    }

    /// A client-reported lifecycle advance (reconciliation).
    fn advance(&mut self, issue: &[u8; 16], revision: u64, to: Lifecycle) -> Result<(), PortError> {
        let c = self.command_mut(issue)?;
        if c.view.lifecycle.is_terminal() || c.view.revision > revision.saturating_add(1) {
            return Err(PortError::Refused(DomainError::new(
                Code::StaleRevision,
                "the command changed since the decision",
            )));
        }
        c.view.lifecycle = to;
        c.view.revision = c.view.revision.max(revision);
        Ok(())
    }

    /// Events a client had acknowledged that the store lacks: the durable
    /// event_seq moves past them (the stores also record the range).
    fn lose(
        &mut self,
        issue: &[u8; 16],
        revision: u64,
        first: u64,
        last: u64,
    ) -> Result<(), PortError> {
        let c = self.command_mut(issue)?;
        if c.view.revision != revision {
            return Err(PortError::Refused(DomainError::new(
                Code::StaleRevision,
                "the command changed since the decision",
            )));
        }
        rvbox_store_port::commands::check_lost_range(c.durable_seq, first, last)
            .map_err(PortError::Refused)?;
        c.durable_seq = last;
        c.view.last_event_seq = last;
        Ok(())
    }

    fn append(&mut self, events: &[rvbox_store_port::events::EventAppend]) -> AppendReport {
        let mut report = AppendReport::default();
        for e in events {
            let outcome = match self.fenced(&e.issue_uuid, e.session.as_ref()) {
                Err(PortError::Refused(err)) => EventOutcome::Refused(err),
                Err(PortError::Unavailable(why)) => {
                    EventOutcome::Refused(DomainError::new(Code::Unavailable, why))
                }
                Ok(()) => match self.commands.get_mut(&e.issue_uuid) {
                    None => {
                        EventOutcome::Refused(DomainError::new(Code::NotFound, "no such command"))
                    }
                    Some(c) if e.event_seq != 0 && e.event_seq <= c.durable_seq => {
                        EventOutcome::Duplicate
                    }
                    Some(c) if e.event_seq != c.durable_seq.saturating_add(1) => {
                        EventOutcome::Refused(DomainError::new(
                            Code::ProtocolError,
                            "event_seq leaves a gap",
                        ))
                    }
                    Some(c) if c.view.lifecycle.is_terminal() => EventOutcome::Refused(
                        DomainError::new(Code::IllegalTransition, "event after the terminal one"),
                    ),
                    Some(c) => {
                        c.durable_seq = e.event_seq;
                        c.view.last_event_seq = e.event_seq;
                        if let EventBody::Lifecycle { to, .. } = &e.body {
                            c.view.lifecycle = *to;
                        }
                        EventOutcome::Appended
                    }
                },
            };
            if !matches!(outcome, EventOutcome::Refused(_))
                && let Some(c) = self.commands.get(&e.issue_uuid)
            {
                report.acked.insert(e.issue_uuid, c.durable_seq);
            }
            report.outcomes.push(outcome);
        }
        report
    }

    fn stdin(&mut self, issue_text: &str, data: Option<&[u8]>, close: bool) -> OpResult {
        let Some(c) = Uuid7::parse("issue_uuid", issue_text)
            .ok()
            .and_then(|u| self.commands.get_mut(u.as_bytes()))
        else {
            return refused(Code::NotFound, "no such command");
        };
        if c.stdin_closed {
            return refused(Code::FailedPrecondition, "stdin is closed");
        }
        let first = c.stdin.last().map_or(1, |w| w.write_seq.saturating_add(1));
        let payload = data.map(<[u8]>::to_vec).unwrap_or_default();
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        c.stdin.push(wire::StdinWrite {
            issue_uuid: issue_text.to_owned(),
            write_seq: first,
            compression: wire::Compression::None as i32,
            raw_sha256: rvbox_segment::sha256(&payload).to_vec(),
            payload,
            raw_length: len,
            stored_length: len,
            newline: 0,
            close_after: close,
        });
        c.stdin_closed = close;
        let response = if close {
            StdinResponse::Close(wire::CloseStdinResponse {
                issue_uuid: issue_text.to_owned(),
                write_seq: first,
                ..Default::default()
            })
        } else {
            StdinResponse::Append(wire::AppendStdinResponse {
                issue_uuid: issue_text.to_owned(),
                first_write_seq: first,
                last_write_seq: first,
                delivery: wire::StdinDelivery::Pending as i32,
            })
        };
        Ok(Completion::Stdin(Box::new(StdinOutcome {
            response,
            replayed: false,
            client_id: c.view.client_id.clone(),
            lifecycle: c.view.lifecycle,
        })))
    }
}
