//! Connections: one session core per connection, its effects turned into
//! the server core's outputs, and what a closed connection leaves behind.

use std::collections::BTreeMap;

use rvbox_dispatch::{DispatchedCommand, SessionCapacity};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_reconcile::{ServerCommand, SnapshotAssembler};
use rvbox_session::{Effect, Input as SessionInput, Lane, LaneFull, Session, WriteScheduler};
use rvbox_store_port::ops::StoreOp;

use crate::upload::Uploads;
use crate::{MAX_CONNECTIONS, Output, Pending, ServerCore};

/// A connection, numbered by the caller.
pub type ConnId = u64;

#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) session: Session,
    pub(crate) client: Option<String>,
    /// The store session id of this connection once registered.
    pub(crate) session_key: Option<[u8; 16]>,
    pub(crate) generation: u64,
    pub(crate) round: u64,
    /// Rounds restarted in a row because their decisions met changed rows.
    pub(crate) stale_rounds: u32,
    pub(crate) assembler: Option<SnapshotAssembler>,
    pub(crate) rows: Vec<ServerCommand>,
    /// Script uploads in progress on this connection (plan §7.3).
    pub(crate) uploads: Uploads,
    /// Stdin writes in flight on this connection (plan §9.1).
    pub(crate) stdin: crate::stdin::StdinFlows,
    /// Terminal traffic on this connection (docs/terminals.md).
    pub(crate) pty: crate::pty::PtyLinks,
    /// The connection's two-lane write schedule (plan §6.1): frames wait
    /// here until the writer has room.
    pub(crate) lanes: WriteScheduler<Frame>,
    /// Frames the writer may still take before it reports one written.
    pub(crate) writer_credit: usize,
    /// Data frames the session has queued and not yet handed to the lanes.
    pub(crate) data_in_session: usize,
    /// A data frame was refused for a full data lane: dispatch and uploads
    /// go on once the writer frees room.
    pub(crate) data_blocked: bool,
    /// Signals refused for a full data lane, sent again when room frees.
    pub(crate) signals_blocked: std::collections::BTreeSet<[u8; 16]>,
    /// What the session core reported last about a registered session:
    /// the close of its session row names it, in the same transaction.
    pub(crate) close_detail: Option<String>,
}

/// A frame waiting in a connection's lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// An encoded envelope.
    Binary(Vec<u8>),
    /// A WebSocket Ping.
    Ping,
    /// A WebSocket Pong.
    Pong,
}

/// Frames a connection's writer may hold at once (written to the socket
/// and not yet reported by [`crate::Input::Written`]): beyond it frames
/// wait in the lanes, where control frames overtake data.
pub const WRITER_WINDOW: usize = 16;

#[derive(Debug, Default)]
pub(crate) struct ClientState {
    pub(crate) conn: Option<ConnId>,
    pub(crate) ready: bool,
    pub(crate) capacity: SessionCapacity,
    pub(crate) in_flight: BTreeMap<Uuid7, DispatchedCommand>,
    pub(crate) backoff: BTreeMap<Uuid7, (i64, u32)>,
    /// Earliest end of a backoff: the client has work again then.
    pub(crate) wake_wall_ms: Option<i64>,
    /// A dispatch-candidate read is in flight for this client.
    pub(crate) scanning: bool,
    /// Work became ready while a read was in flight: scan again after it.
    pub(crate) rescan: bool,
    /// Commands whose dispatch write, or whose answer's write, is in
    /// flight: no dispatch turn sends them meanwhile.
    pub(crate) dispatching: std::collections::BTreeSet<Uuid7>,
}

impl ServerCore {
    pub(crate) fn connect(&mut self, conn: ConnId) {
        if !self.serving {
            // a replica that lost its lease takes no client until it has
            // joined again: the client goes to another replica
            self.out.push_back(Output::Close {
                conn,
                reason: wire::CloseReason::ServiceRestart,
            });
            return;
        }
        if self.conns.len() >= MAX_CONNECTIONS || self.conns.contains_key(&conn) {
            tracing::warn!(
                conn,
                "connection refused: too many connections or a reused number"
            );
            self.out.push_back(Output::Close {
                conn,
                reason: wire::CloseReason::IngressOverload,
            });
            return;
        }
        match Session::new(self.now_ms, self.config.clone()) {
            Ok(mut session) => {
                if !self.gate.is_open() {
                    session.handle(self.now_ms, SessionInput::IngressGate { open: false });
                }
                self.conns.insert(
                    conn,
                    Box::new(Conn {
                        session,
                        client: None,
                        session_key: None,
                        generation: 0,
                        round: 0,
                        stale_rounds: 0,
                        assembler: None,
                        rows: Vec::new(),
                        uploads: Uploads::default(),
                        stdin: crate::stdin::StdinFlows::default(),
                        pty: crate::pty::PtyLinks::default(),
                        lanes: WriteScheduler::default(),
                        writer_credit: WRITER_WINDOW,
                        data_in_session: 0,
                        data_blocked: false,
                        signals_blocked: std::collections::BTreeSet::new(),
                        close_detail: None,
                    }),
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "session configuration refused");
                self.out.push_back(Output::Close {
                    conn,
                    reason: wire::CloseReason::InternalError,
                });
            }
        }
    }

    pub(crate) fn disconnected(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.session.handle(self.now_ms, SessionInput::PeerClosed);
            // what the session emits on a peer close is only counters
            while let Some(e) = c.session.poll_effect() {
                if let Effect::Metric(m) = e {
                    self.out.push_back(Output::Metric(m));
                }
            }
        }
        self.drop_conn(conn, "connection closed");
    }

    /// Feeds one session input; its effects are performed by the drain
    /// at the end of the core's input (never a nested drain).
    pub(crate) fn session_input(&mut self, conn: ConnId, input: SessionInput) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.session.handle(self.now_ms, input);
        self.dirty.insert(conn);
    }

    /// Performs the effects of every session that has some, until none
    /// has any left. Acting on an effect may give this or another session
    /// new effects; they join the work list rather than a nested drain.
    pub(crate) fn drain_sessions(&mut self) {
        while let Some(conn) = self.dirty.pop_first() {
            while let Some(effect) = self
                .conns
                .get_mut(&conn)
                .and_then(|c| c.session.poll_effect())
            {
                if !self.perform(conn, effect) {
                    break;
                }
            }
        }
    }

    /// Performs one session effect; false once the connection is gone.
    fn perform(&mut self, conn: ConnId, effect: Effect) -> bool {
        match effect {
            Effect::Send { lane, envelope } => {
                let frame = Frame::Binary(prost::Message::encode_to_vec(&envelope));
                self.queue_frame(conn, lane, frame);
            }
            Effect::Ping => self.queue_frame(conn, Lane::Control, Frame::Ping),
            Effect::Close { reason } => {
                self.close_now(conn, reason);
                return false;
            }
            Effect::Register { token, hello } => self.register(conn, token, hello),
            Effect::Deliver(msg) => self.deliver(conn, msg),
            Effect::Audit(audit) => self.session_audit(conn, audit),
            Effect::Metric(m) => self.out.push_back(Output::Metric(m)),
        }
        self.conns.contains_key(&conn)
    }

    /// A session audit record: kept for the close of a registered
    /// session (written in its transaction), written on its own
    /// (rate-limited) for a connection without one, and not again for what
    /// the store writes with its effect (see [`crate::audit`]).
    fn session_audit(&mut self, conn: ConnId, audit: rvbox_session::Audit) {
        let client = self.client_of(conn);
        if !crate::audit::written_with_effect(audit.kind) {
            let registered = self
                .conns
                .get(&conn)
                .is_some_and(|c| c.session_key.is_some());
            if registered && audit.kind != rvbox_session::AuditKind::ClientError {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.close_detail = Some(format!(
                        "{}: {}",
                        crate::audit::action(audit.kind),
                        audit.detail
                    ));
                }
            } else {
                self.audit_alone(client.clone(), &audit);
            }
        }
        self.out.push_back(Output::Audit {
            conn,
            client,
            audit,
        });
    }

    /// Writes a session record no effect carries, within the rate limit.
    pub(crate) fn audit_alone(&mut self, client: Option<String>, audit: &rvbox_session::Audit) {
        let records = self.audits.admit(self.now_ms, client, audit);
        if records.is_empty() {
            self.stats.audits_suppressed += 1;
        } else {
            self.stats.audits_written += 1;
            self.store(StoreOp::Audit(records), Pending::Background("audit"));
        }
    }

    /// The store refused a write made for `conn` with `STALE_SESSION`: its
    /// session is no longer its client's live one (a newer session
    /// replaced it, here or on another replica). The session row is not
    /// this connection's to close any more; the connection closes fenced.
    pub(crate) fn write_fenced(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.session_key = None;
        self.stats.writes_fenced += 1;
        tracing::warn!(
            conn,
            "a write for this connection was refused: its session is no longer live; closing"
        );
        self.close(conn, wire::CloseReason::SessionFenced);
    }

    /// Closes a connection from the server side.
    pub(crate) fn close(&mut self, conn: ConnId, reason: wire::CloseReason) {
        if !self.conns.contains_key(&conn) {
            return;
        }
        // what the session still has to say (a ControlError before the
        // close) goes to the writer while it has room
        while let Some(effect) = self
            .conns
            .get_mut(&conn)
            .and_then(|c| c.session.poll_effect())
        {
            if let Effect::Send { lane, envelope } = effect {
                let frame = Frame::Binary(prost::Message::encode_to_vec(&envelope));
                self.queue_frame(conn, lane, frame);
            }
        }
        self.close_now(conn, reason);
    }

    /// Sends the close and forgets the connection. Frames still waiting in
    /// its lanes are dropped: the writer took what it had room for, and a
    /// peer that stopped reading would never take the rest.
    fn close_now(&mut self, conn: ConnId, reason: wire::CloseReason) {
        if let Some(c) = self.conns.get(&conn)
            && !c.lanes.is_empty()
        {
            tracing::debug!(
                conn,
                control = c.lanes.len(Lane::Control),
                data = c.lanes.len(Lane::Data),
                "frames dropped with the closed connection"
            );
        }
        self.out.push_back(Output::Close { conn, reason });
        self.drop_conn(conn, rvbox_session::close_text(reason));
    }

    /// Puts a frame in its lane and lets the writer take what it has room
    /// for. A full control lane is a session-fatal invariant (plan §6.1);
    /// a full data lane leaves the work durable and offered again when the
    /// writer frees room.
    fn queue_frame(&mut self, conn: ConnId, lane: Lane, frame: Frame) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if lane == Lane::Data {
            c.data_in_session = c.data_in_session.saturating_sub(1);
        }
        match c.lanes.push(lane, frame) {
            Ok(()) => {}
            Err(LaneFull {
                lane: Lane::Control,
                ..
            }) => {
                self.stats.control_lane_full += 1;
                tracing::error!(conn, "control lane full; the session closes");
                self.session_input(conn, SessionInput::ControlLaneFull);
                return;
            }
            Err(LaneFull {
                lane: Lane::Data, ..
            }) => {
                // never reached: senders check for room first
                self.stats.data_lane_full += 1;
                c.data_blocked = true;
                tracing::warn!(conn, "data lane full; the frame waits for a later turn");
            }
        }
        self.flush_writer(conn);
    }

    /// Hands frames to the writer while it has credit: up to a burst of
    /// control, then one data frame.
    pub(crate) fn flush_writer(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        while c.writer_credit > 0 {
            let Some((lane, frame)) = c.lanes.next_frame() else {
                break;
            };
            c.writer_credit -= 1;
            self.out.push_back(frame_output(conn, lane, frame));
        }
    }

    /// A client's Ping: liveness, and a Pong on the control lane (plan
    /// §6.1: Ping/Pong stay sendable while the data window is full).
    pub(crate) fn ping(&mut self, conn: ConnId) {
        if !self.conns.contains_key(&conn) {
            return;
        }
        self.session_input(conn, SessionInput::Ping);
        self.queue_frame(conn, Lane::Control, Frame::Pong);
    }

    /// The writer wrote one frame: room for the next, and work a full data
    /// lane held back goes on.
    pub(crate) fn written(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.writer_credit = (c.writer_credit + 1).min(WRITER_WINDOW);
        self.flush_writer(conn);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.data_blocked && c.lanes.data_has_room() {
            c.data_blocked = false;
            let signals: Vec<[u8; 16]> =
                std::mem::take(&mut c.signals_blocked).into_iter().collect();
            if let Some(client) = c.client.clone() {
                self.mark_ready(&client);
            }
            self.pump_uploads(conn);
            self.pump_stdins(conn);
            if !signals.is_empty() {
                self.store(
                    StoreOp::PendingSignals { issues: signals },
                    Pending::Signal(crate::signals::Pending::Resend { conn }),
                );
            }
        }
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.lanes.data_has_room())
        {
            self.pty_unblocked(conn);
        }
    }

    /// Forgets a connection: its session row ends, its client loses its
    /// dispatch state.
    pub(crate) fn drop_conn(&mut self, conn: ConnId, why: &str) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        self.dirty.remove(&conn);
        let queued = self.ingest.remove_conn(conn);
        if queued > 0 {
            self.release_ingress(queued);
        }
        if let Some(key) = c.session_key {
            let reason = match &c.close_detail {
                Some(d) => crate::audit::bounded(
                    &format!("{why}; {d}"),
                    rvbox_store_port::audit::MAX_SESSION_AUDIT_DETAIL,
                ),
                None => why.to_owned(),
            };
            self.store(
                StoreOp::CloseSession {
                    session_id: key,
                    reason,
                },
                Pending::Background("close_session"),
            );
        }
        // a client's dispatch state lives only as long as its live
        // connection: the map holds at most one entry per connection, and
        // whatever a reconnect needs is in the store (its reconciliation
        // starts from there; a transient backoff starts over)
        if let Some(client) = c.client
            && self
                .clients
                .get(&client)
                .is_some_and(|st| st.conn == Some(conn))
        {
            self.clients.remove(&client);
            self.ready.remove(&client);
        }
    }

    pub(crate) fn client_of(&self, conn: ConnId) -> Option<String> {
        self.conns.get(&conn).and_then(|c| c.client.clone())
    }

    /// Whether a data frame would find room on the connection.
    pub(crate) fn data_room(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| {
            c.lanes.len(Lane::Data) + c.data_in_session < rvbox_session::DATA_LANE_CAPACITY
        })
    }

    /// Queues a server message on a connection's session. A data message
    /// finds no room while the data lane is full: it is refused (false),
    /// the work stays durable, and it is offered again once the writer
    /// frees room.
    pub(crate) fn send(&mut self, conn: ConnId, payload: wire::envelope::Payload) -> bool {
        let data = rvbox_session::payload_lane(&payload) == Lane::Data;
        if data && !self.data_room(conn) {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.data_blocked = true;
                if let wire::envelope::Payload::Signal(sig) = &payload
                    && let Ok(id) = rvbox_domain::ids::Uuid7::parse("issue_uuid", &sig.issue_uuid)
                {
                    c.signals_blocked.insert(*id.as_bytes());
                }
            }
            self.stats.data_lane_waits += 1;
            return false;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        match c.session.send(payload) {
            Ok(()) => {
                if data {
                    c.data_in_session += 1;
                }
                self.dirty.insert(conn);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "message not queued on the session");
                false
            }
        }
    }
}

fn frame_output(conn: ConnId, lane: Lane, frame: Frame) -> Output {
    match frame {
        Frame::Binary(bytes) => Output::Frame {
            conn,
            control: lane == Lane::Control,
            bytes,
        },
        Frame::Ping => Output::Ping { conn },
        Frame::Pong => Output::Pong { conn },
    }
}
