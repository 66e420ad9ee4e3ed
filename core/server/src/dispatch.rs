//! Dispatch and capacity (plan §6.4): a fair turn per ready client reads
//! its candidates, the dispatch core decides within the client's capacity
//! (reserving shadow slots), `dispatched` commits, and only then does the
//! `Dispatch` frame go out. Also queue expiry and `RunCommand`.

use rvbox_dispatch::{
    CommandView as DispatchView, DispatchDecision, DispatchedCommand, SessionGate, WaitReason,
    decide,
};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{CommandState, Lifecycle, Phase};
use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::commands::{CommandView, ServerTerminal};
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};
use rvbox_store_port::sessions::SessionFence;

use crate::connections::ConnId;
use crate::{ControlAnswer, DISPATCH_SCAN, Output, Pending as Any, RequestId, ServerCore, convert};

#[derive(Debug)]
pub(crate) enum Pending {
    /// A client's dispatch candidates.
    Candidates { client: String },
    /// A dispatch write (or the spec of a command sent again).
    Dispatch {
        client: String,
        conn: ConnId,
        view: Box<CommandView>,
        issue: Uuid7,
        revision: u64,
    },
    /// The expiry index.
    ExpiryDue,
    /// `RunCommand`.
    RunCommand { request: RequestId, client: String },
}

impl ServerCore {
    /// The client has work that may be dispatchable.
    pub(crate) fn mark_ready(&mut self, client: &str) {
        if let Err(e) = self.ready.mark_ready(&client.to_owned()) {
            // the tracked-client bound: the client is served once another
            // leaves the queue
            tracing::warn!(error = %e, "client not queued for dispatch");
        }
    }

    /// A client has work again when a backoff ended.
    pub(crate) fn wake_backoffs(&mut self) {
        let wall = self.wall_ms;
        let woken = self.clients.due(wall);
        for c in &woken {
            if let Some(st) = self.clients.get_mut(c) {
                st.wake_wall_ms = None;
            }
        }
        for c in &woken {
            self.mark_ready(c);
        }
    }

    /// One fair turn per ready client: read what it may be sent.
    pub(crate) fn dispatch_pass(&mut self) {
        let mut turns = self.clients.len().saturating_add(1);
        while turns > 0 {
            turns -= 1;
            let Some(client) = self.ready.next_turn() else {
                return;
            };
            if let Some(st) = self.clients.get_mut(&client)
                && st.conn.is_some()
                && st.ready
            {
                if st.scanning {
                    st.rescan = true;
                } else {
                    st.scanning = true;
                    self.store(
                        StoreOp::DispatchCandidates {
                            client_id: client.clone(),
                            limit: DISPATCH_SCAN,
                        },
                        Any::Dispatch(Pending::Candidates {
                            client: client.clone(),
                        }),
                    );
                }
            }
            if let Err(e) = self.ready.finish(&client) {
                tracing::error!(error = %e, "dispatch turn not finished");
            }
        }
    }

    pub(crate) fn dispatch_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Candidates { client } => {
                let rescan = self.clients.get_mut(&client).is_some_and(|st| {
                    st.scanning = false;
                    std::mem::take(&mut st.rescan)
                });
                match result {
                    Ok(Completion::Commands(rows)) => self.candidates(&client, rows),
                    Ok(_) => self.mismatch("dispatch_candidates"),
                    Err(e) => tracing::error!(error = %e, "queue not readable"),
                }
                if rescan {
                    self.mark_ready(&client);
                }
            }
            Pending::Dispatch {
                client,
                conn,
                view,
                issue,
                revision,
            } => self.dispatched(&client, conn, &view, issue, revision, result),
            Pending::ExpiryDue => {
                self.expiry_running = false;
                match result {
                    Ok(Completion::Commands(due)) => self.expire(due),
                    Ok(_) => self.mismatch("expiry_due"),
                    Err(e) => tracing::error!(error = %e, "expiry index not readable"),
                }
            }
            Pending::RunCommand { request, client } => {
                let answer = match result {
                    Ok(Completion::RunCommand(r)) => {
                        if self
                            .clients
                            .get(&client)
                            .is_some_and(|st| st.conn.is_some())
                        {
                            self.mark_ready(&client);
                        }
                        Ok(r)
                    }
                    Ok(_) => {
                        self.mismatch("run_command");
                        Err(rvbox_store_port::ops::PortError::Unavailable(
                            "completion does not match RunCommand".into(),
                        ))
                    }
                    Err(e) => Err(e),
                };
                self.out.push_back(Output::Reply {
                    request,
                    answer: ControlAnswer::RunCommand(answer),
                });
            }
        }
    }

    fn candidates(&mut self, client: &str, rows: Vec<CommandView>) {
        let wall = self.wall_ms;
        for v in rows {
            let Ok(issue) = Uuid7::from_bytes("issue_uuid", v.issue_uuid) else {
                continue;
            };
            let Some(st) = self.clients.get_mut(client) else {
                return;
            };
            let (Some(conn), true) = (st.conn, st.ready) else {
                return;
            };
            // the session a dispatch is fenced by (docs/scaleout.md)
            let Some(session_id) = self.conns.get(&conn).and_then(|c| c.session_key) else {
                return;
            };
            if st.dispatching.contains(&issue) {
                continue;
            }
            let view = DispatchView {
                issue,
                state: convert::state_of(&v),
                queue_expiry_ms: v.queue_expiry_ms,
                retry_not_before_ms: st.backoff.get(&issue).map(|b| b.0),
            };
            match decide(&view, SessionGate::Ready, &mut st.capacity, wall) {
                DispatchDecision::Dispatch { write, order } => {
                    st.dispatching.insert(issue);
                    let op = StoreOp::Dispatch {
                        issue: v.issue_uuid,
                        revision: v.revision,
                        write: write.is_some(),
                        session: SessionFence { session_id },
                    };
                    let revision = order.revision.0;
                    if !self.store(
                        op,
                        Any::Dispatch(Pending::Dispatch {
                            client: client.to_owned(),
                            conn,
                            view: Box::new(v),
                            issue,
                            revision,
                        }),
                    ) && let Some(st) = self.clients.get_mut(client)
                    {
                        st.dispatching.remove(&issue);
                        st.capacity.release(issue);
                    }
                }
                DispatchDecision::Expire(_) => {
                    self.stats.expired += 1;
                    self.finish_expired(&v);
                }
                DispatchDecision::Wait(WaitReason::Backoff { until_wall_ms }) => {
                    // the wake that led here may have come on a wall clock
                    // that was then put back: the backoff wakes the client
                    // again when it ends on the clock as it is now, or it
                    // would wait for an unrelated event that may never come
                    st.wake_wall_ms = Some(
                        st.wake_wall_ms
                            .map_or(until_wall_ms, |w| w.min(until_wall_ms)),
                    );
                }
                DispatchDecision::Wait(_) | DispatchDecision::NotDispatchable(_) => {}
            }
        }
    }

    fn dispatched(
        &mut self,
        client: &str,
        conn: ConnId,
        view: &CommandView,
        issue: Uuid7,
        revision: u64,
        result: OpResult,
    ) {
        let current = self
            .clients
            .get_mut(client)
            .filter(|st| st.conn == Some(conn));
        let Some(st) = current else {
            // the session ended meanwhile: its capacity went with it; a
            // dispatched row is reconciled on the client's next session
            return;
        };
        st.dispatching.remove(&issue);
        let spec = match result {
            Ok(Completion::Spec(spec)) => spec,
            Ok(_) => {
                st.capacity.release(issue);
                self.mismatch("dispatch");
                return;
            }
            Err(e) => {
                st.capacity.release(issue);
                self.stats.stale_decisions += 1;
                tracing::warn!(error = %e, "dispatch not recorded");
                return;
            }
        };
        if view.lifecycle == rvbox_domain::lifecycle::Lifecycle::Queued {
            // queued -> dispatched is durable now: the dispatch latency
            let waited =
                u64::try_from(self.wall_ms.saturating_sub(view.issue_time_ms)).unwrap_or(0);
            if self.dispatch_waits.len() < crate::MAX_DISPATCH_WAITS {
                self.dispatch_waits.push(waited);
            } else {
                self.stats.dispatch_waits_dropped += 1;
            }
        }
        let generation = self.conns.get(&conn).map_or(0, |c| c.generation);
        let frame = convert::dispatch_frame(view, revision, generation, *spec);
        let transient = st.backoff.get(&issue).map_or(0, |b| b.1);
        if !self.send(conn, Payload::Dispatch(frame)) {
            // a full data lane (or a closing session): the command stays
            // dispatched and durable, and is sent again once the writer
            // frees room
            if let Some(st) = self.clients.get_mut(client) {
                st.capacity.release(issue);
            }
            tracing::debug!("dispatch frame not queued; sent again later");
            return;
        }
        self.stats.dispatched += 1;
        if let Some(st) = self.clients.get_mut(client) {
            st.in_flight.insert(
                issue,
                DispatchedCommand {
                    issue,
                    state: CommandState::from_parts(
                        Phase::Dispatched,
                        rvbox_domain::lifecycle::Revision(revision),
                    ),
                    dispatched_revision: rvbox_domain::lifecycle::Revision(revision),
                    queue_expiry_ms: view.queue_expiry_ms,
                    transient_rejections: transient,
                },
            );
        }
    }

    fn finish_expired(&mut self, v: &CommandView) {
        self.store(
            StoreOp::FinishByServer {
                issue: v.issue_uuid,
                from: vec![Lifecycle::Queued],
                revision: v.revision,
                how: ServerTerminal::Expired,
                rejection: None,
                session: None,
            },
            Any::Background("expire"),
        );
    }

    /// Server-side queue expiry (plan §6.4): never-dispatched commands end
    /// `expired`; dispatched ones get the pending indicator.
    fn expire(&mut self, due: Vec<CommandView>) {
        for v in due {
            match v.lifecycle {
                Lifecycle::Queued => {
                    self.stats.expired += 1;
                    self.finish_expired(&v);
                }
                Lifecycle::Dispatched => {
                    self.store(
                        StoreOp::MarkExpiredPending {
                            issue: v.issue_uuid,
                            revision: v.revision,
                        },
                        Any::Background("mark_expired_pending"),
                    );
                }
                _ => {}
            }
        }
    }
}
