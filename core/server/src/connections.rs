//! Connections: one session core per connection, its effects turned into
//! the server core's outputs, and what a closed connection leaves behind.

use std::collections::BTreeMap;

use rvbox_dispatch::{DispatchedCommand, SessionCapacity};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_reconcile::{ServerCommand, SnapshotAssembler};
use rvbox_session::{Effect, Input as SessionInput, Session};
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
    pub(crate) assembler: Option<SnapshotAssembler>,
    pub(crate) rows: Vec<ServerCommand>,
    /// Script uploads in progress on this connection (plan §7.3).
    pub(crate) uploads: Uploads,
}

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
                    Conn {
                        session,
                        client: None,
                        session_key: None,
                        generation: 0,
                        round: 0,
                        assembler: None,
                        rows: Vec::new(),
                        uploads: Uploads::default(),
                    },
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
                self.out.push_back(Output::Frame {
                    conn,
                    control: lane == rvbox_session::Lane::Control,
                    bytes: prost::Message::encode_to_vec(&envelope),
                });
            }
            Effect::Ping => self.out.push_back(Output::Ping { conn }),
            Effect::Close { reason } => {
                self.out.push_back(Output::Close { conn, reason });
                self.drop_conn(conn, rvbox_session::close_text(reason));
                return false;
            }
            Effect::Register { token, hello } => self.register(conn, token, hello),
            Effect::Deliver(msg) => self.deliver(conn, msg),
            Effect::Audit(audit) => {
                let client = self.client_of(conn);
                self.out.push_back(Output::Audit {
                    conn,
                    client,
                    audit,
                });
            }
            Effect::Metric(m) => self.out.push_back(Output::Metric(m)),
        }
        self.conns.contains_key(&conn)
    }

    /// Closes a connection from the server side.
    pub(crate) fn close(&mut self, conn: ConnId, reason: wire::CloseReason) {
        if !self.conns.contains_key(&conn) {
            return;
        }
        self.out.push_back(Output::Close { conn, reason });
        self.drop_conn(conn, rvbox_session::close_text(reason));
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
            self.store(
                StoreOp::CloseSession {
                    session_id: key,
                    reason: why.to_owned(),
                },
                Pending::Background("close_session"),
            );
        }
        if let Some(client) = c.client
            && let Some(st) = self.clients.get_mut(&client)
            && st.conn == Some(conn)
        {
            st.conn = None;
            st.ready = false;
            st.capacity.close();
            st.in_flight.clear();
            st.dispatching.clear();
            self.ready.remove(&client);
        }
    }

    pub(crate) fn client_of(&self, conn: ConnId) -> Option<String> {
        self.conns.get(&conn).and_then(|c| c.client.clone())
    }

    /// Queues a server message on a connection's session.
    pub(crate) fn send(&mut self, conn: ConnId, payload: wire::envelope::Payload) -> bool {
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        match c.session.send(payload) {
            Ok(()) => {
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
