//! Interactive terminals (docs/terminals.md): the operator's mutations,
//! what the server sends a client of its terminals, and the client's
//! reports, recorded in groups.
//!
//! Every frame the server sends a client about its terminals derives from
//! one read of the store, [`StoreOp::PtyResume`] (the terminals that are
//! not closed, with the input the client has not acknowledged), compared
//! with what this connection has already carried ([`TermLink`]):
//! - `PtyOpen` while the server has the terminal as OPENING;
//! - `PtyAttach` from the output end the server has recorded, once per
//!   connection (and again after a gap);
//! - each `PtyInput` not yet sent on this connection, in `input_seq`
//!   order;
//! - `PtyResize` when the size the store holds is not the size last sent;
//! - `PtyClose` once an operator (or the idle timeout) asked for it.
//!
//! An operator's mutation, an idle pass, a gap, a wake-up from another
//! replica and a data lane that frees room each ask for such a read
//! ([`ServerCore::pty_sync`]); one is in flight per connection, and one
//! asked for meanwhile runs after it. The data lane is ordered and
//! lossless within a connection, so what it carried is never sent twice;
//! after a reconnect everything pending goes again, and the client's
//! holder drops an `input_seq` it already wrote.
//!
//! The client's reports (`PtyOpened`, `PtyInputAck`, `PtyOutput`,
//! `PtyClosed`) wait in the connection's queue ([`MAX_PTY_QUEUE_BYTES`])
//! and go to the store in groups ([`StoreOp::PtyApply`], one in flight per
//! connection). A `PtyOutputAck` is sent only after its output committed,
//! so the client's send window never runs ahead of the recording.

use std::collections::{BTreeMap, VecDeque};

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};
use rvbox_store_port::pty::{
    MAX_PTY_APPLY_ITEMS, PtyApplied, PtyLimits, PtyMutation, PtyOutcome, PtyReport, PtyResume,
};

use crate::connections::ConnId;
use crate::{ControlAnswer, Output, Pending as Any, RequestId, ServerCore};

/// Report bytes (output data, mostly) one connection may have waiting for
/// the store. A client sends at most a 1 MiB window per terminal ahead of
/// the server's acknowledgements; beyond this bound the connection closes
/// (`INGRESS_OVERLOAD`) rather than queueing without limit.
pub const MAX_PTY_QUEUE_BYTES: u64 = 32 * 1024 * 1024;
/// Reports one connection may have waiting (acknowledgements carry no
/// bytes, so bytes alone do not bound them).
pub const MAX_PTY_QUEUE_ITEMS: usize = 16 * 1024;
/// Most report bytes in one group.
pub const PTY_GROUP_BYTES: u64 = 4 * 1024 * 1024;
/// Terminals one connection tracks (a client's terminals are bounded far
/// below this by the server's per-client limit).
pub const MAX_TERMINALS_PER_CONNECTION: usize = 1024;
/// The idle pass runs this often.
pub const PTY_IDLE_INTERVAL_MS: u64 = 60_000;
/// Most terminals one idle pass asks to close.
pub const PTY_IDLE_BATCH: usize = 256;
/// The default idle timeout: 12 h.
pub const DEFAULT_PTY_IDLE_TIMEOUT_MS: u64 = 12 * 3600 * 1000;

/// The configured terminal policy (`terminals.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtyPolicy {
    /// The bounds an open is checked against, and the recording kept.
    pub limits: PtyLimits,
    /// Terminals with no input or output for this long are closed; 0:
    /// never.
    pub idle_timeout_ms: u64,
}

impl Default for PtyPolicy {
    fn default() -> Self {
        Self {
            limits: PtyLimits::default(),
            idle_timeout_ms: DEFAULT_PTY_IDLE_TIMEOUT_MS,
        }
    }
}

/// What one connection has carried of one terminal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TermLink {
    opened: bool,
    attached: bool,
    input_sent: u64,
    size_sent: Option<(u32, u32)>,
    close_sent: bool,
    /// The end of output a gap made the server attach again from: a later
    /// gap at the same end (output the client had in flight) asks nothing
    /// more.
    reattached_at: Option<u64>,
}

/// The terminal traffic of one connection.
#[derive(Debug, Default)]
pub(crate) struct PtyLinks {
    terms: BTreeMap<[u8; 16], TermLink>,
    queue: VecDeque<PtyReport>,
    queued_bytes: u64,
    applying: bool,
    /// The reconciliation round is written: terminal frames may go.
    live: bool,
    syncing: bool,
    sync_again: bool,
    /// A frame found the data lane full: sync again once it frees room.
    blocked: bool,
}

/// The bytes a report weighs in the queue.
fn weight(r: &PtyReport) -> u64 {
    match r {
        PtyReport::Output(o) => o.data.len() as u64,
        PtyReport::Closed(c) => c.reason.len() as u64,
        _ => 0,
    }
    .max(1)
}

/// What kind of report a group item was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReportKind {
    /// `PtyOutput`.
    Output,
    /// `PtyClosed`.
    Closed,
    /// `PtyOpened` or `PtyInputAck`.
    Other,
}

/// What a terminal completion waits on.
#[derive(Debug)]
pub(crate) enum Pending {
    /// An operator's mutation.
    Mutation {
        request: RequestId,
        method: &'static str,
        client: Option<String>,
    },
    /// A group of a connection's reports.
    Apply {
        conn: ConnId,
        /// Each report's terminal and kind, in order.
        reports: Vec<([u8; 16], ReportKind)>,
    },
    /// The sync read of a connection.
    Resume { conn: ConnId },
    /// An idle pass.
    Idle,
}

/// The answer to a terminal mutation.
#[derive(Debug, Clone, PartialEq)]
pub enum PtyAnswer {
    /// `OpenPtySession`.
    Open(wire::OpenPtySessionResponse),
    /// `WritePtyInput`.
    Write(wire::WritePtyInputResponse),
    /// `ResizePtySession`.
    Resize(wire::ResizePtySessionResponse),
    /// `ClosePtySession`.
    Close(wire::ClosePtySessionResponse),
    /// A viewer's attach or detach, audited.
    Viewer,
}

fn answer_of(method: &'static str, o: &PtyOutcome) -> Result<PtyAnswer, PortError> {
    let id = o.view.info.pty_session_id.clone();
    Ok(match method {
        "OpenPtySession" => PtyAnswer::Open(wire::OpenPtySessionResponse { pty_session_id: id }),
        "WritePtyInput" => PtyAnswer::Write(wire::WritePtyInputResponse {
            pty_session_id: id,
            input_seq: o.input_seq.ok_or_else(|| {
                PortError::Unavailable("the stored input carries no input_seq".into())
            })?,
        }),
        "ResizePtySession" => {
            PtyAnswer::Resize(wire::ResizePtySessionResponse { pty_session_id: id })
        }
        _ => PtyAnswer::Close(wire::ClosePtySessionResponse { pty_session_id: id }),
    })
}

fn id_bytes(text: &str) -> Option<[u8; 16]> {
    Uuid7::parse("pty_session_id", text)
        .ok()
        .map(|u| *u.as_bytes())
}

impl ServerCore {
    /// Sets the terminal policy (`terminals.*`).
    pub fn set_pty_policy(&mut self, policy: PtyPolicy) {
        self.pty_policy = policy;
    }

    /// An operator's terminal mutation.
    pub(crate) fn pty_mutation(
        &mut self,
        request: RequestId,
        caller: crate::Caller,
        mutation: PtyMutation,
    ) {
        let method = mutation.method();
        let client = match &mutation {
            PtyMutation::Open(r) => Some(r.client_id.clone()),
            _ => None,
        };
        let issued = self.store(
            StoreOp::PtyMutation {
                mutation,
                caller,
                limits: self.pty_policy.limits,
            },
            Any::Pty(Pending::Mutation {
                request,
                method,
                client,
            }),
        );
        if !issued {
            self.out.push_back(Output::Reply {
                request,
                answer: ControlAnswer::Pty(Err(PortError::Unavailable(
                    "the server has too many store operations in flight; retry with the same request_id".into(),
                ))),
            });
        }
    }

    /// A viewer attached or detached: an audit record (the answer does
    /// not wait for it).
    pub(crate) fn pty_viewer(
        &mut self,
        request: RequestId,
        caller: &crate::Caller,
        id: &str,
        client_id: String,
        attach: bool,
        offset: u64,
    ) {
        let (action, at) = if attach {
            ("PtyAttach", "from offset")
        } else {
            ("PtyDetach", "at offset")
        };
        tracing::info!(terminal = %id, principal = %caller.principal, transport = %caller.transport, attach, offset, "terminal viewer");
        let detail = crate::audit::bounded(
            &format!(
                "terminal {id}, {at} {offset}, by {} over {}",
                if caller.principal.is_empty() {
                    "an unnamed principal"
                } else {
                    &caller.principal
                },
                caller.transport
            ),
            rvbox_store_port::audit::MAX_SESSION_AUDIT_DETAIL,
        );
        self.store(
            StoreOp::Audit(vec![rvbox_store_port::audit::SessionAudit::session(
                Some(client_id),
                action,
                detail,
            )]),
            Any::Background("terminal viewer audit"),
        );
        self.out.push_back(Output::Reply {
            request,
            answer: ControlAnswer::Pty(Ok(Box::new(PtyAnswer::Viewer))),
        });
    }

    /// A client's terminal report, queued for the next group.
    pub(crate) fn pty_report(&mut self, conn: ConnId, payload: Payload) {
        let report = match payload {
            Payload::PtyOpened(m) => PtyReport::Opened(m),
            Payload::PtyInputAck(m) => PtyReport::InputAck(m),
            Payload::PtyOutput(m) => PtyReport::Output(m),
            Payload::PtyClosed(m) => PtyReport::Closed(m),
            _ => return,
        };
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let w = weight(&report);
        if c.pty.queue.len() >= MAX_PTY_QUEUE_ITEMS
            || c.pty.queued_bytes.saturating_add(w) > MAX_PTY_QUEUE_BYTES
        {
            tracing::warn!(
                conn,
                queued = c.pty.queue.len(),
                bytes = c.pty.queued_bytes,
                "terminal reports beyond the connection's bound; closing"
            );
            self.stats.pty_queue_full += 1;
            self.close(conn, wire::CloseReason::IngressOverload);
            return;
        }
        c.pty.queued_bytes += w;
        c.pty.queue.push_back(report);
        self.pty_pump(conn);
    }

    /// Issues the next group of a connection's reports.
    fn pty_pump(&mut self, conn: ConnId) {
        let Some(session) = self.fence_of(conn) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(client_id) = c.client.clone() else {
            return;
        };
        if c.pty.applying || c.pty.queue.is_empty() {
            return;
        }
        let mut reports = Vec::new();
        let mut bytes = 0u64;
        while let Some(r) = c.pty.queue.front() {
            let w = weight(r);
            if !reports.is_empty()
                && (reports.len() >= MAX_PTY_APPLY_ITEMS || bytes + w > PTY_GROUP_BYTES)
            {
                break;
            }
            let Some(r) = c.pty.queue.pop_front() else {
                break;
            };
            bytes += w;
            c.pty.queued_bytes = c.pty.queued_bytes.saturating_sub(w);
            reports.push(r);
        }
        c.pty.applying = true;
        let keys = reports
            .iter()
            .map(|r| {
                (
                    id_bytes(r.id()).unwrap_or_default(),
                    match r {
                        PtyReport::Output(_) => ReportKind::Output,
                        PtyReport::Closed(_) => ReportKind::Closed,
                        _ => ReportKind::Other,
                    },
                )
            })
            .collect();
        let issued = self.store(
            StoreOp::PtyApply {
                client_id,
                session,
                reports,
                recording_bytes: self.pty_policy.limits.recording_bytes,
            },
            Any::Pty(Pending::Apply {
                conn,
                reports: keys,
            }),
        );
        if !issued {
            self.close(conn, wire::CloseReason::IngressOverload);
        }
    }

    /// The reconciliation round of `conn` is written: its terminals go.
    pub(crate) fn pty_live(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.pty.live = true;
        }
        self.pty_sync(conn);
    }

    /// Terminal work of `client` may be new: sync its live connection.
    pub(crate) fn pty_sync_client(&mut self, client: &str) {
        if let Some(conn) = self.clients.get(client).and_then(|st| st.conn) {
            self.pty_sync(conn);
        }
    }

    /// Reads what `conn` should carry of its client's terminals (one read
    /// in flight; one asked for meanwhile follows it).
    pub(crate) fn pty_sync(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(client_id) = c.client.clone() else {
            return;
        };
        if !c.pty.live {
            return;
        }
        if c.pty.syncing {
            c.pty.sync_again = true;
            return;
        }
        c.pty.syncing = true;
        c.pty.sync_again = false;
        if !self.store(
            StoreOp::PtyResume { client_id },
            Any::Pty(Pending::Resume { conn }),
        ) && let Some(c) = self.conns.get_mut(&conn)
        {
            c.pty.syncing = false;
        }
    }

    /// The writer freed room on a data lane that refused a terminal frame.
    pub(crate) fn pty_unblocked(&mut self, conn: ConnId) {
        if self
            .conns
            .get_mut(&conn)
            .is_some_and(|c| std::mem::take(&mut c.pty.blocked))
        {
            self.pty_sync(conn);
        }
    }

    /// An idle pass, when one is due (the maintenance duty's).
    pub(crate) fn pty_idle_pass(&mut self) {
        let timeout = self.pty_policy.idle_timeout_ms;
        if timeout == 0 || self.pty_idle_running {
            return;
        }
        if self
            .last_pty_idle_ms
            .is_some_and(|t| self.now_ms < t.saturating_add(PTY_IDLE_INTERVAL_MS))
        {
            return;
        }
        self.last_pty_idle_ms = Some(self.now_ms);
        let idle_before_ms = self
            .wall_ms
            .saturating_sub(i64::try_from(timeout).unwrap_or(i64::MAX));
        self.pty_idle_running = self.store(
            StoreOp::PtyIdle {
                idle_before_ms,
                limit: PTY_IDLE_BATCH,
            },
            Any::Pty(Pending::Idle),
        );
    }

    /// When the next idle pass is due, if one will run.
    pub(crate) fn pty_idle_due(&self) -> Option<u64> {
        if self.pty_policy.idle_timeout_ms == 0 || self.pty_idle_running {
            return None;
        }
        Some(
            self.last_pty_idle_ms
                .map_or(self.now_ms, |t| t.saturating_add(PTY_IDLE_INTERVAL_MS)),
        )
    }

    pub(crate) fn pty_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Mutation {
                request,
                method,
                client,
            } => self.pty_mutation_done(request, method, client, result),
            Pending::Apply { conn, reports } => self.pty_applied(conn, &reports, result),
            Pending::Resume { conn } => self.pty_resumed(conn, result),
            Pending::Idle => {
                self.pty_idle_running = false;
                match result {
                    Ok(Completion::PtyIdle(views)) => {
                        let mut clients: Vec<String> =
                            views.into_iter().map(|v| v.info.client_id).collect();
                        clients.sort();
                        clients.dedup();
                        self.stats.pty_idle_closed += clients.len() as u64;
                        for client in clients {
                            tracing::info!(client_id = %client, "terminals idle past the timeout are closed");
                            self.pty_sync_client(&client);
                        }
                    }
                    Ok(_) => self.mismatch("pty_idle"),
                    Err(e) => tracing::error!(error = %e, "terminal idle pass failed"),
                }
            }
        }
    }

    fn pty_mutation_done(
        &mut self,
        request: RequestId,
        method: &'static str,
        client: Option<String>,
        result: OpResult,
    ) {
        let outcome = match result {
            Ok(Completion::Pty(o)) => Ok(*o),
            Ok(_) => {
                self.mismatch("pty_mutation");
                Err(PortError::Unavailable(
                    "completion does not match the terminal operation".into(),
                ))
            }
            Err(e) => Err(e),
        };
        let answer = match &outcome {
            Ok(o) => {
                self.stats.pty_mutations += 1;
                if !o.replayed {
                    tracing::info!(
                        terminal = %o.view.info.pty_session_id,
                        method,
                        "terminal mutation stored"
                    );
                }
                let client = client.unwrap_or_else(|| o.view.info.client_id.clone());
                self.pty_sync_client(&client);
                answer_of(method, o)
            }
            Err(e) => Err(e.clone()),
        };
        self.out.push_back(Output::Reply {
            request,
            answer: ControlAnswer::Pty(answer.map(Box::new)),
        });
    }

    fn pty_applied(&mut self, conn: ConnId, reports: &[([u8; 16], ReportKind)], result: OpResult) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.pty.applying = false;
        }
        let applied = match result {
            Ok(Completion::PtyApplied(a)) if a.len() == reports.len() => a,
            Ok(_) => {
                self.mismatch("pty_apply");
                self.close(conn, wire::CloseReason::InternalError);
                return;
            }
            Err(PortError::Refused(e)) if e.code() == rvbox_domain::error::Code::StaleSession => {
                // closed by write_fenced already
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "terminal reports not stored; the connection closes");
                self.stats.pty_failures += 1;
                self.close(conn, wire::CloseReason::StorageUnavailable);
                return;
            }
        };
        let mut acks: BTreeMap<[u8; 16], u64> = BTreeMap::new();
        let mut resync = false;
        for ((id, kind), a) in reports.iter().zip(applied) {
            let output = *kind == ReportKind::Output;
            let text = Uuid7::from_bytes("pty_session_id", *id)
                .map(|u| u.to_string())
                .unwrap_or_default();
            match a {
                PtyApplied::Recorded {
                    output_offset,
                    closed,
                } => {
                    self.stats.pty_reports += 1;
                    if output {
                        acks.insert(*id, output_offset);
                        if let Some(t) = self
                            .conns
                            .get_mut(&conn)
                            .and_then(|c| c.pty.terms.get_mut(id))
                            && t.reattached_at.is_some_and(|at| output_offset > at)
                        {
                            t.reattached_at = None;
                        }
                    }
                    if closed && let Some(c) = self.conns.get_mut(&conn) {
                        c.pty.terms.remove(id);
                    }
                }
                PtyApplied::Gap { output_offset } => {
                    self.stats.pty_gaps += 1;
                    let Some(c) = self.conns.get_mut(&conn) else {
                        return;
                    };
                    if c.pty.terms.len() < MAX_TERMINALS_PER_CONNECTION
                        || c.pty.terms.contains_key(id)
                    {
                        let t = c.pty.terms.entry(*id).or_default();
                        if t.reattached_at != Some(output_offset) {
                            tracing::warn!(terminal = %text, output_offset, "terminal output does not continue the recording; attaching again from its end");
                            t.reattached_at = Some(output_offset);
                            t.attached = false;
                            resync = true;
                        }
                    }
                }
                // a close of a terminal the server does not have needs no
                // answer: answering it with a close would loop
                PtyApplied::Unknown if *kind == ReportKind::Closed => {}
                PtyApplied::Unknown => {
                    tracing::warn!(terminal = %text, "a client reported a terminal the server does not have; closing it there");
                    self.send(
                        conn,
                        Payload::PtyClose(wire::PtyClose {
                            pty_session_id: text,
                        }),
                    );
                }
                PtyApplied::Refused(e) => {
                    tracing::warn!(error = %e, "terminal report refused; the connection closes");
                    self.stats.pty_refused += 1;
                    self.close(conn, wire::CloseReason::ProtocolError);
                    return;
                }
            }
        }
        for (id, offset) in acks {
            let pty_session_id = Uuid7::from_bytes("pty_session_id", id)
                .map(|u| u.to_string())
                .unwrap_or_default();
            self.send(
                conn,
                Payload::PtyOutputAck(wire::PtyOutputAck {
                    pty_session_id,
                    offset,
                }),
            );
        }
        if resync {
            self.pty_sync(conn);
        }
        self.pty_pump(conn);
    }

    fn pty_resumed(&mut self, conn: ConnId, result: OpResult) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.pty.syncing = false;
        }
        let terminals = match result {
            Ok(Completion::PtyResume(t)) => t,
            Ok(_) => {
                self.mismatch("pty_resume");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "terminals not readable; the connection closes");
                self.stats.pty_failures += 1;
                self.close(conn, wire::CloseReason::StorageUnavailable);
                return;
            }
        };
        self.stats.pty_syncs += 1;
        for t in terminals {
            if !self.pty_carry(conn, t) {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.pty.blocked = true;
                    c.pty.sync_again = false;
                }
                return;
            }
        }
        if self
            .conns
            .get_mut(&conn)
            .is_some_and(|c| std::mem::take(&mut c.pty.sync_again))
        {
            self.pty_sync(conn);
        }
    }

    /// Sends what `conn` has not carried of one terminal; false when the
    /// data lane refused a frame (the rest goes once it has room).
    fn pty_carry(&mut self, conn: ConnId, t: PtyResume) -> bool {
        let Ok(id) = Uuid7::parse("pty_session_id", &t.view.info.pty_session_id) else {
            return true;
        };
        let key = *id.as_bytes();
        let Some(c) = self.conns.get_mut(&conn) else {
            return true;
        };
        if !c.pty.terms.contains_key(&key) && c.pty.terms.len() >= MAX_TERMINALS_PER_CONNECTION {
            return true;
        }
        let mut link = c.pty.terms.get(&key).cloned().unwrap_or_default();
        let text = t.view.info.pty_session_id.clone();
        let opening = t.view.info.state == wire::PtyState::Opening as i32;
        let size = (t.view.info.rows, t.view.info.cols);
        let mut ok = true;
        if opening && !link.opened {
            ok = self.send(conn, Payload::PtyOpen(t.view.open.clone()));
            if ok {
                link.opened = true;
                link.size_sent = Some((t.view.open.rows, t.view.open.cols));
            }
        }
        if ok && !link.attached {
            ok = self.send(
                conn,
                Payload::PtyAttach(wire::PtyAttach {
                    pty_session_id: text.clone(),
                    from_offset: t.view.info.output_offset,
                }),
            );
            link.attached = ok;
        }
        if ok && link.size_sent != Some(size) {
            ok = self.send(
                conn,
                Payload::PtyResize(wire::PtyResize {
                    pty_session_id: text.clone(),
                    rows: size.0,
                    cols: size.1,
                }),
            );
            if ok {
                link.size_sent = Some(size);
            }
        }
        if ok {
            // everything up to input_acked is written; what this
            // connection carried before is not sent twice
            link.input_sent = link.input_sent.max(t.view.input_acked);
            for input in t.inputs {
                if input.input_seq <= link.input_sent {
                    continue;
                }
                let seq = input.input_seq;
                if !self.send(conn, Payload::PtyInput(input)) {
                    ok = false;
                    break;
                }
                self.stats.pty_inputs_sent += 1;
                link.input_sent = seq;
            }
        }
        if ok && t.view.close_requested && !link.close_sent {
            ok = self.send(
                conn,
                Payload::PtyClose(wire::PtyClose {
                    pty_session_id: text,
                }),
            );
            link.close_sent = ok;
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.pty.terms.insert(key, link);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_weighs_its_bytes_and_at_least_one() {
        let out = PtyReport::Output(wire::PtyOutput {
            data: vec![0; 100],
            ..Default::default()
        });
        assert_eq!(weight(&out), 100);
        assert_eq!(
            weight(&PtyReport::InputAck(wire::PtyInputAck::default())),
            1
        );
    }

    #[test]
    fn every_method_has_its_answer() {
        let o = PtyOutcome {
            view: rvbox_store_port::pty::PtyView::default(),
            input_seq: Some(3),
            replayed: false,
        };
        assert!(matches!(
            answer_of("OpenPtySession", &o),
            Ok(PtyAnswer::Open(_))
        ));
        assert!(matches!(
            answer_of("WritePtyInput", &o),
            Ok(PtyAnswer::Write(wire::WritePtyInputResponse {
                input_seq: 3,
                ..
            }))
        ));
        assert!(matches!(
            answer_of("ResizePtySession", &o),
            Ok(PtyAnswer::Resize(_))
        ));
        assert!(matches!(
            answer_of("ClosePtySession", &o),
            Ok(PtyAnswer::Close(_))
        ));
        let none = PtyOutcome {
            input_seq: None,
            ..o
        };
        assert!(answer_of("WritePtyInput", &none).is_err());
    }
}
