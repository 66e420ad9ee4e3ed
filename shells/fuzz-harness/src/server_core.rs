//! Target `server_core`: a structure-aware run of the whole server core.
//!
//! The input is read as a program of steps ([`Step`]): connections open
//! and close, clients send frames (hellos, snapshots, events, acceptances,
//! capacity, or any bytes, raw or with the live session fields put in),
//! the writer reports frames written or lanes full, time passes, the store
//! completes its operations (in the order issued, as every backend does,
//! each answered by [`StoreModel`] or failed as the input says: an outage,
//! a refusal, a completion of the wrong shape, a token never issued), and
//! operators call. After every input the core's outputs are drained and
//! checked (the core itself asserts its `check_invariants` after every
//! input in this debug build):
//!
//! - a frame goes only to a connection the core has not closed and the
//!   peer has not left, within the writer window, decodes as an envelope of
//!   a server-to-client payload on its lane, carries the welcome's session
//!   fields once welcomed (before it, only a `ControlError` with empty ones);
//! - a welcome names a registration the store installed, once per
//!   connection; an `EventAck` never passes what the store made durable; a
//!   `Dispatch` names a command the store marked dispatched at that revision
//!   and the connection's generation;
//! - store tokens are issued in increasing order, never twice; every
//!   control answer answers a call, once;
//! - at the end, with every operation completed, every control call was
//!   answered and the core waits for nothing.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_server_core::{
    Caller, ConnId, ControlCall, Input, Output, RequestId, ServerCore, WRITER_WINDOW,
};
use rvbox_session::{Direction, Lane, payload_direction, payload_lane};
use rvbox_store_port::ops::{Completion, OpResult, OpToken, PortError, StoreOp};

use crate::Source;
use crate::envelope::{config, frame, hello};
use crate::store_model::{CLIENTS, StoreModel, issue_text};

/// Most steps one input runs.
pub const MAX_STEPS: usize = 256;
/// Most inputs the harness feeds while settling (written reports and the
/// final completions) before it calls the run stuck.
const MAX_SETTLE: usize = 20_000;
/// The wall clock at the start of a run (ms since the epoch).
const WALL_START: i64 = 1_800_000_000_000;
/// Client instances the hellos use.
const INSTANCES: [&str; 3] = [
    "3b241101-e2bb-4255-8caf-4136c566a962",
    "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f",
    "0c1d2e3f-4a5b-4c6d-9e7f-8a9b0c1d2e3f",
];

/// Deterministic "randomness": a counter through splitmix64.
#[derive(Debug, Default)]
struct CountingEntropy(AtomicU64);

impl rvbox_store_port::entropy::Entropy for CountingEntropy {
    fn fill(&self, buf: &mut [u8]) -> std::io::Result<()> {
        for chunk in buf.chunks_mut(8) {
            let mut z = self
                .0
                .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
                .wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            for (b, v) in chunk.iter_mut().zip(z.to_le_bytes()) {
                *b = v;
            }
        }
        Ok(())
    }
}

/// What the harness knows of one connection, from the outside.
#[derive(Debug, Default)]
struct Conn {
    /// Neither closed by the core nor left by the peer.
    open: bool,
    /// The welcome's session fields.
    live: Option<(String, u64)>,
    /// The client of the last hello sent on it.
    client: Option<String>,
    /// The last reconciliation round asked for, and its rows.
    round: u64,
    rows: Vec<wire::ReconcileRow>,
    /// Commands dispatched on it: (issue, revision).
    dispatched: Vec<(String, u64)>,
    /// Frames handed to the writer and not reported written.
    unwritten: usize,
    /// Of those, reports queued to be fed.
    reporting: usize,
    /// The writer reports every frame written at once.
    auto_written: bool,
}

/// A fault the store shows for one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Unavailable,
    Refused(Code),
    WrongShape,
    ForeignFirst,
}

impl Fault {
    fn draw(src: &mut Source<'_>) -> Self {
        match src.u8() {
            0..=199 => Self::None,
            200..=219 => Self::Unavailable,
            220..=239 => Self::Refused(*src.pick(&Code::ALL).unwrap_or(&Code::Internal)),
            240..=249 => Self::WrongShape,
            _ => Self::ForeignFirst,
        }
    }
}

/// The harness around one core.
struct Harness {
    core: ServerCore,
    model: StoreModel,
    now: u64,
    wall: i64,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    ops: VecDeque<(OpToken, StoreOp)>,
    last_token: u64,
    requests: BTreeSet<u64>,
    next_request: u64,
    /// Every (issue text, revision) the model marked dispatched.
    dispatched: BTreeSet<(String, u64)>,
    /// The next event sequence the client side uses, per command.
    seqs: BTreeMap<String, u64>,
    /// What the core did, counted (frames by payload, operations by name).
    seen: BTreeMap<String, u64>,
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

impl Harness {
    fn new() -> Self {
        Self {
            core: ServerCore::new(
                Arc::new(CountingEntropy::default()),
                config(),
                rvbox_dispatch::RetryPolicy::default(),
            ),
            model: StoreModel::seeded(WALL_START),
            now: 1_000,
            wall: WALL_START,
            conns: BTreeMap::new(),
            next_conn: 1,
            ops: VecDeque::new(),
            last_token: 0,
            requests: BTreeSet::new(),
            next_request: 1,
            dispatched: BTreeSet::new(),
            seqs: BTreeMap::new(),
            seen: BTreeMap::new(),
        }
    }

    /// Feeds one input, drains and checks the outputs, and reports the
    /// frames written for connections whose writer keeps up.
    fn feed(&mut self, input: Input) {
        let mut queue = VecDeque::from([input]);
        let mut fed = 0usize;
        while let Some(input) = queue.pop_front() {
            fed += 1;
            assert!(fed < MAX_SETTLE, "the writer's reports never settle");
            if let Input::Written { conn } = &input
                && let Some(c) = self.conns.get_mut(conn)
            {
                c.unwritten = c.unwritten.saturating_sub(1);
                c.reporting = c.reporting.saturating_sub(1);
            }
            self.core.handle(self.now, self.wall, input);
            self.drain();
            for (id, c) in &mut self.conns {
                while c.open && c.auto_written && c.reporting < c.unwritten {
                    queue.push_back(Input::Written { conn: *id });
                    c.reporting += 1;
                }
            }
        }
    }

    fn drain(&mut self) {
        let mut n = 0usize;
        while let Some(out) = self.core.poll_output() {
            n += 1;
            assert!(
                n < 1_000_000,
                "an input produces a bounded number of outputs"
            );
            self.check(out);
        }
    }

    fn frame_for(&mut self, conn: ConnId) -> &mut Conn {
        let c = self
            .conns
            .get_mut(&conn)
            .unwrap_or_else(|| panic!("a frame for connection {conn}, which never opened"));
        assert!(c.open, "a frame for connection {conn}, closed or left");
        c.unwritten += 1;
        assert!(
            c.unwritten <= WRITER_WINDOW,
            "connection {conn} was handed more than the writer window"
        );
        c
    }

    fn check(&mut self, out: Output) {
        match out {
            Output::Frame {
                conn,
                control,
                bytes,
            } => {
                let env = wire::Envelope::decode(bytes.as_slice())
                    .unwrap_or_else(|e| panic!("a frame the core sent does not decode: {e}"));
                let payload = env.payload.clone().expect("a sent envelope has a payload");
                *self
                    .seen
                    .entry(format!("frame {}", rvbox_session::payload_name(&payload)))
                    .or_default() += 1;
                assert_ne!(
                    payload_direction(&payload),
                    Direction::ClientToServer,
                    "the server sent a client-to-server payload"
                );
                assert_eq!(
                    control,
                    payload_lane(&payload) == Lane::Control,
                    "a frame is on its payload's lane"
                );
                let installed: Vec<(String, u64)> = self
                    .model
                    .installed
                    .iter()
                    .map(|(s, g)| (hex(s), *g))
                    .collect();
                let dispatched = self.dispatched.clone();
                let model = &self.model;
                let durable = |issue: &str| {
                    model
                        .commands
                        .values()
                        .find(|c| issue_of(&c.view.issue_uuid) == issue)
                        .map_or(0, |c| c.durable_seq)
                };
                let acks_ok = match &payload {
                    Payload::EventAck(a) => a.durable_event_seq <= durable(&a.issue_uuid),
                    _ => true,
                };
                let c = self.frame_for(conn);
                match &payload {
                    Payload::ServerWelcome(w) => {
                        assert!(c.live.is_none(), "one welcome per connection");
                        assert!(
                            installed.contains(&(w.session_id.clone(), w.generation)),
                            "the welcome names a registration the store installed"
                        );
                        assert_eq!(
                            (&env.session_id, env.generation),
                            (&w.session_id, w.generation)
                        );
                        c.live = Some((w.session_id.clone(), w.generation));
                    }
                    other => match &c.live {
                        Some((sid, generation)) => assert_eq!(
                            (&env.session_id, env.generation),
                            (sid, *generation),
                            "a frame after the welcome carries its session fields"
                        ),
                        None => {
                            assert!(
                                matches!(other, Payload::ControlError(_)),
                                "before the welcome only a ControlError goes out"
                            );
                            assert!(env.session_id.is_empty() && env.generation == 0);
                        }
                    },
                }
                assert!(acks_ok, "an EventAck passed what the store made durable");
                match payload {
                    Payload::ReconcileRequest(r) => {
                        c.round = r.round;
                        c.rows = r.rows;
                    }
                    Payload::ReconcileResult(_) => {
                        assert!(c.round > 0, "a ReconcileResult answers a ReconcileRequest");
                    }
                    Payload::Dispatch(d) => {
                        assert_eq!(
                            Some(d.generation),
                            c.live.as_ref().map(|l| l.1),
                            "a dispatch carries the connection's generation"
                        );
                        assert!(
                            dispatched.contains(&(d.issue_uuid.clone(), d.revision)),
                            "a Dispatch names a command the store dispatched at that revision"
                        );
                        c.dispatched.push((d.issue_uuid, d.revision));
                    }
                    _ => {}
                }
            }
            Output::Ping { conn } | Output::Pong { conn } => {
                self.frame_for(conn);
            }
            Output::Close { conn, reason } => {
                assert_ne!(
                    reason,
                    wire::CloseReason::Unspecified,
                    "a close has a reason"
                );
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.open = false;
                }
            }
            Output::Store { token, wall_ms, op } => {
                assert!(
                    token.0 > self.last_token,
                    "store tokens increase and never repeat"
                );
                self.last_token = token.0;
                *self.seen.entry(format!("op {}", op.name())).or_default() += 1;
                assert_eq!(
                    wall_ms, self.wall,
                    "an operation carries the input's wall time"
                );
                self.ops.push_back((token, op));
            }
            Output::Reply { request, .. } => {
                assert!(
                    self.requests.remove(&request.0),
                    "a control answer for a call not made, or answered twice"
                );
            }
            Output::Audit { .. } | Output::Metric(_) => {}
        }
    }

    /// Completes the oldest store operation, as `fault` says.
    fn complete(&mut self, fault: Fault) {
        let Some((token, op)) = self.ops.pop_front() else {
            return;
        };
        let result: OpResult = match fault {
            Fault::None | Fault::ForeignFirst => self.model.perform(self.wall, &op),
            Fault::Unavailable => Err(PortError::Unavailable("fuzz: store unavailable".into())),
            Fault::Refused(code) => Err(PortError::Refused(DomainError::new(code, "fuzz"))),
            Fault::WrongShape => Ok(match op {
                StoreOp::Maintain => Completion::Done,
                _ => Completion::Maintained(Default::default()),
            }),
        };
        if fault == Fault::ForeignFirst {
            self.feed(Input::Completion {
                token: OpToken(u64::MAX - token.0),
                result: Ok(Completion::Done),
            });
        }
        if let (
            Ok(Completion::Spec(_)),
            StoreOp::Dispatch {
                issue, revision, ..
            },
        ) = (&result, &op)
        {
            self.dispatched.insert((issue_of(issue), *revision));
        }
        self.feed(Input::Completion { token, result });
    }

    fn conn_pick(&mut self, src: &mut Source<'_>) -> ConnId {
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        if ids.is_empty() {
            return self.next_conn;
        }
        // mostly the newest connections
        let i = src.below(ids.len() + 2);
        ids.get(ids.len().saturating_sub(1 + i % ids.len()))
            .copied()
            .unwrap_or(self.next_conn)
    }

    fn live_fields(&self, conn: ConnId) -> (String, u64) {
        self.conns
            .get(&conn)
            .and_then(|c| c.live.clone())
            .unwrap_or_default()
    }

    fn send(&mut self, conn: ConnId, payload: Payload) {
        let (sid, generation) = self.live_fields(conn);
        self.feed(Input::Frame {
            conn,
            bytes: frame(&sid, generation, payload),
        });
    }

    /// A command id the client side could name: dispatched on the
    /// connection, or any the model knows, or one it does not.
    fn issue_pick(&mut self, src: &mut Source<'_>, conn: ConnId) -> (String, u64) {
        let mut known: Vec<(String, u64)> = self
            .conns
            .get(&conn)
            .map(|c| c.dispatched.clone())
            .unwrap_or_default();
        known.extend(
            self.model
                .commands
                .values()
                .map(|c| (issue_of(&c.view.issue_uuid), c.view.revision)),
        );
        known.push((issue_text(0xfff0), 1));
        src.pick(&known).cloned().unwrap_or_default()
    }

    fn seq_pick(&mut self, src: &mut Source<'_>, issue: &str) -> u64 {
        let next = self.seqs.get(issue).copied().unwrap_or(1);
        let (how, raw) = (src.u8(), src.u8());
        let seq = match how % 5 {
            0 | 1 => next,
            2 => next.saturating_sub(1),
            3 => next + 1,
            _ => u64::from(raw),
        };
        if seq == next {
            self.seqs.insert(issue.to_owned(), next + 1);
        }
        seq
    }

    fn step(&mut self, src: &mut Source<'_>) {
        match src.u8() % 20 {
            0 => {
                let conn = self.next_conn;
                self.next_conn += 1;
                // mostly a writer that keeps up
                let (a, b) = (src.bool(), src.bool());
                self.conns.insert(
                    conn,
                    Conn {
                        open: true,
                        auto_written: !(a && b),
                        ..Conn::default()
                    },
                );
                self.feed(Input::Connected { conn });
            }
            1 => {
                let conn = self.conn_pick(src);
                let client = match src.below(CLIENTS.len() + 1) {
                    i if i < CLIENTS.len() => CLIENTS.get(i).copied().unwrap_or_default(),
                    _ => "Not A Valid Id!",
                };
                let instance = src.pick(&INSTANCES).copied().unwrap_or_default();
                let mut h = hello(client, instance);
                let (how, minor) = (src.u8(), src.u8());
                if how < 16 {
                    h.supported_minors = vec![u32::from(minor % 5)];
                }
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.client = Some(client.to_owned());
                }
                self.feed(Input::Frame {
                    conn,
                    bytes: frame("", 0, Payload::ClientHello(h)),
                });
            }
            2 => self.snapshot(src),
            3 => self.event(src),
            4 => {
                let conn = self.conn_pick(src);
                let (issue, revision) = self.issue_pick(src, conn);
                let outcome = match src.u8() % 8 {
                    0 => wire::AcceptOutcome::Transient,
                    1 => wire::AcceptOutcome::Permanent,
                    2 => wire::AcceptOutcome::Unspecified,
                    _ => wire::AcceptOutcome::Positive,
                };
                let error = (outcome != wire::AcceptOutcome::Positive)
                    .then(|| DomainError::new(Code::CapacityExhausted, "fuzz: busy").to_detail());
                let (how, raw) = (src.u8(), src.u8());
                let revision = if how < 32 { u64::from(raw) } else { revision };
                self.send(
                    conn,
                    Payload::CommandAccepted(wire::CommandAccepted {
                        issue_uuid: issue,
                        revision,
                        outcome: outcome as i32,
                        error,
                        resolved_shell: wire::ShellType::Sh as i32,
                    }),
                );
            }
            5 => {
                let conn = self.conn_pick(src);
                let c = wire::ClientCapacity {
                    running: u32::from(src.u8() % 8),
                    queued: u32::from(src.u8() % 8),
                    max_running: u32::from(src.u8() % 8),
                    max_queued: u32::from(src.u8() % 8),
                };
                self.send(conn, Payload::ClientCapacity(c));
            }
            6 => {
                let conn = self.conn_pick(src);
                let bytes = src.bytes(512).to_vec();
                self.feed(Input::Frame { conn, bytes });
            }
            7 => {
                let conn = self.conn_pick(src);
                let raw = src.bytes(512);
                let bytes = match wire::Envelope::decode(raw) {
                    Ok(mut env) => {
                        let (sid, generation) = self.live_fields(conn);
                        env.session_id = sid;
                        env.generation = generation;
                        env.encode_to_vec()
                    }
                    Err(_) => raw.to_vec(),
                };
                self.feed(Input::Frame { conn, bytes });
            }
            8 => {
                for _ in 0..=src.u8() % 8 {
                    let fault = Fault::draw(src);
                    self.complete(fault);
                }
            }
            9 => {
                let advance = *src
                    .pick(&[0u64, 1, 100, 1_000, 10_000, 30_000, 60_000, 600_000])
                    .unwrap_or(&0);
                self.now += advance;
                self.wall += i64::try_from(advance).unwrap_or(0);
                self.feed(Input::Timeout);
            }
            10 => {
                let conn = self.conn_pick(src);
                if self.conns.get(&conn).is_some_and(|c| c.unwritten > 0) {
                    self.feed(Input::Written { conn });
                }
            }
            11 => {
                let conn = self.conn_pick(src);
                let input = if src.bool() {
                    Input::Ping { conn }
                } else {
                    Input::Pong { conn }
                };
                self.feed(input);
            }
            12 => {
                let conn = self.conn_pick(src);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.open = false;
                }
                self.feed(Input::Disconnected { conn });
            }
            13 => {
                let conn = self.conn_pick(src);
                let control = src.bool();
                self.feed(Input::LaneFull { conn, control });
            }
            14 => {
                let conn = self.conn_pick(src);
                if src.bool() {
                    self.feed(Input::IngressQueueFull { conn });
                } else if let Some(c) = self.conns.get_mut(&conn) {
                    c.auto_written = !c.auto_written;
                }
            }
            15 => self.control(src),
            16 => {
                let input = match src.u8() % 3 {
                    0 => {
                        let client = src.pick(&CLIENTS).copied().unwrap_or_default().to_owned();
                        let issue = src.bool().then(|| {
                            self.model
                                .commands
                                .keys()
                                .next()
                                .copied()
                                .unwrap_or([0; 16])
                        });
                        Input::Wake { client, issue }
                    }
                    1 => Input::WakeAll,
                    _ => Input::FleetWake,
                };
                self.feed(input);
            }
            17 => {
                let input = if src.u8() < 64 {
                    Input::Serving {
                        serving: src.bool(),
                    }
                } else {
                    let mask = src.u8();
                    Input::Duties {
                        held: rvbox_store_port::replica::Duty::ALL
                            .into_iter()
                            .enumerate()
                            .filter(|(i, _)| mask & (1 << i) != 0)
                            .map(|(_, d)| d)
                            .collect(),
                    }
                };
                self.feed(input);
            }
            18 => {
                // the wall clock is put back or forward (NTP, an operator)
                let delta = i64::from(src.u16() as i16) * 1_000;
                self.wall = self.wall.saturating_add(delta);
                self.feed(Input::Timeout);
            }
            _ => self.other_frame(src),
        }
    }

    fn snapshot(&mut self, src: &mut Source<'_>) {
        let conn = self.conn_pick(src);
        let (round, rows) = self
            .conns
            .get(&conn)
            .map(|c| (c.round, c.rows.clone()))
            .unwrap_or_default();
        let (pick_round, raw_round) = (src.u8(), src.u8());
        let round = if pick_round < 16 {
            u64::from(raw_round)
        } else {
            round
        };
        let echo = src.u8() >= 32;
        // one lifecycle and revision choice for each of the first rows
        let choices: [(u8, u8); 4] = [
            (src.u8(), src.u8()),
            (src.u8(), src.u8()),
            (src.u8(), src.u8()),
            (src.u8(), src.u8()),
        ];
        let mut records = Vec::new();
        if echo {
            for (i, row) in rows.into_iter().enumerate() {
                let (l, r) = choices.get(i % 4).copied().unwrap_or_default();
                let lifecycle = match l % 6 {
                    0 => wire::Lifecycle::Running,
                    1 => wire::Lifecycle::Succeeded,
                    2 => wire::Lifecycle::Failed,
                    3 => row.lifecycle(),
                    _ => wire::Lifecycle::Accepted,
                };
                let last = self.seqs.get(&row.issue_uuid).copied().unwrap_or(1) - 1;
                records.push(wire::SnapshotRecord {
                    issue_uuid: row.issue_uuid.clone(),
                    request_hash: row.request_hash.clone(),
                    revision: row.revision + u64::from(r % 2),
                    lifecycle: lifecycle as i32,
                    last_assigned_event_seq: last,
                    // sometimes ahead of the store (it lost events it had
                    // acknowledged): reconciliation records them lost
                    acked_event_seq: if r & 6 == 6 {
                        last
                    } else {
                        row.durable_event_seq.min(last)
                    },
                    script_received_bytes: 0,
                });
            }
        }
        // and, sometimes, a command the round did not ask about (one the
        // server ended, or does not know): the server looks it up
        let (extra, pick, lifecycle) = (src.u8(), src.u8(), src.u8());
        if extra < 64 {
            let mut known: Vec<(String, u64)> = self
                .model
                .commands
                .values()
                .map(|c| (issue_of(&c.view.issue_uuid), c.view.revision))
                .collect();
            known.push((issue_text(0xfff1), 1));
            let (issue, revision) = known
                .get(usize::from(pick) % known.len())
                .cloned()
                .unwrap_or_default();
            let lifecycle = match lifecycle % 3 {
                0 => wire::Lifecycle::Succeeded,
                1 => wire::Lifecycle::Running,
                _ => wire::Lifecycle::Failed,
            };
            records.push(wire::SnapshotRecord {
                issue_uuid: issue,
                request_hash: vec![7; 32],
                revision,
                lifecycle: lifecycle as i32,
                last_assigned_event_seq: 0,
                acked_event_seq: 0,
                script_received_bytes: 0,
            });
        }
        let health = if src.u8() < 16 {
            wire::ScopeState::Unavailable
        } else {
            wire::ScopeState::Ready
        };
        self.send(
            conn,
            Payload::ClientSnapshot(wire::ClientSnapshot {
                round,
                chunk_index: 0,
                final_chunk: src.u8() >= 16,
                store_health: health as i32,
                records,
                tombstones: Vec::new(),
            }),
        );
    }

    fn event(&mut self, src: &mut Source<'_>) {
        let conn = self.conn_pick(src);
        let (issue, revision) = self.issue_pick(src, conn);
        let event_seq = self.seq_pick(src, &issue);
        let body = match src.u8() % 8 {
            0..=2 => {
                let raw = src.bytes(64).to_vec();
                let stream = if src.bool() {
                    wire::OutputStream::Stdout
                } else {
                    wire::OutputStream::Stderr
                };
                let (how, declared) = (src.u8(), src.u8());
                let (payload, raw_length) = match how % 4 {
                    0 => (raw.clone(), u32::from(declared)),
                    _ => (
                        zstd::bulk::compress(&raw, 1).unwrap_or_default(),
                        u32::try_from(raw.len()).unwrap_or(0),
                    ),
                };
                wire::command_event::Body::Output(wire::OutputChunk {
                    stream: stream as i32,
                    stored_length: u32::try_from(payload.len()).unwrap_or(0),
                    payload,
                    raw_length,
                })
            }
            3 | 4 => {
                let lifecycle = match src.u8() % 6 {
                    0 => wire::Lifecycle::Running,
                    1 => wire::Lifecycle::Succeeded,
                    2 => wire::Lifecycle::Failed,
                    3 => wire::Lifecycle::Terminated,
                    4 => wire::Lifecycle::Accepted,
                    _ => wire::Lifecycle::Queued,
                };
                wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                    lifecycle: lifecycle as i32,
                    revision: revision + u64::from(src.u8() % 3),
                    exit_result: None,
                    reason: String::new(),
                })
            }
            5 => wire::command_event::Body::StdinAck(wire::StdinAck {
                write_seq: u64::from(src.u8() % 4),
                delivery: i32::from(src.u8() % 4),
                closed: src.bool(),
                reason: String::new(),
            }),
            6 => wire::command_event::Body::SignalResult(wire::SignalResult::default()),
            _ => wire::command_event::Body::Diagnostics(wire::Diagnostics::default()),
        };
        self.send(
            conn,
            Payload::CommandEvent(wire::CommandEvent {
                issue_uuid: issue,
                event_seq,
                observed_time: None,
                body: Some(body),
            }),
        );
    }

    fn other_frame(&mut self, src: &mut Source<'_>) {
        let conn = self.conn_pick(src);
        let (issue, _) = self.issue_pick(src, conn);
        let payload = match src.u8() % 4 {
            0 => Payload::ControlError(
                DomainError::new(Code::Internal, "fuzz: client error").to_control_error(),
            ),
            1 => Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: issue,
                received_bytes: u64::from(src.u8()),
                state: i32::from(src.u8() % 5),
                error: None,
            }),
            2 => Payload::PtyOpened(wire::PtyOpened {
                pty_session_id: issue,
                outcome: wire::AcceptOutcome::Positive as i32,
                error: None,
                resolved_shell: wire::ShellType::Sh as i32,
            }),
            _ => Payload::PtyClosed(wire::PtyClosed {
                pty_session_id: issue,
                ..Default::default()
            }),
        };
        self.send(conn, payload);
    }

    fn control(&mut self, src: &mut Source<'_>) {
        let request = RequestId(self.next_request);
        self.next_request += 1;
        let request_id = issue_text(0x10000 + u32::try_from(request.0 % 0xfff).unwrap_or(0));
        let conn = self.conn_pick(src);
        let (issue, _) = self.issue_pick(src, conn);
        let call = match src.u8() % 8 {
            0 | 1 => ControlCall::RunCommand(wire::RunCommandRequest {
                request_id,
                client_id: match src.below(CLIENTS.len() + 1) {
                    i if i < CLIENTS.len() => CLIENTS.get(i).copied().unwrap_or_default(),
                    _ => "nobody",
                }
                .into(),
                spec: Some(wire::ExecutionSpec {
                    shell_type: wire::ShellType::Sh as i32,
                    source: Some(wire::execution_spec::Source::CommandText(
                        "echo fuzz".into(),
                    )),
                    ..Default::default()
                }),
                script: {
                    let script = src.bytes(64);
                    script.to_vec()
                },
                queue_ttl: None,
            }),
            2 => ControlCall::SignalCommand(wire::SignalCommandRequest {
                request_id,
                issue_uuid: issue,
                signal: i32::from(src.u8() % 4),
            }),
            3 => ControlCall::AppendStdin(wire::AppendStdinRequest {
                request_id,
                issue_uuid: issue,
                data: src.bytes(32).to_vec(),
                newline: 0,
            }),
            4 => ControlCall::CloseStdin(wire::CloseStdinRequest {
                request_id,
                issue_uuid: issue,
            }),
            5 => ControlCall::AuthorizeClientTakeover(wire::AuthorizeClientTakeoverRequest {
                request_id,
                client_id: src.pick(&CLIENTS).copied().unwrap_or_default().into(),
                client_instance_id: src.pick(&INSTANCES).copied().unwrap_or_default().into(),
            }),
            6 => ControlCall::RunFleet(wire::RunFleetRequest {
                request_id,
                ..Default::default()
            }),
            _ => ControlCall::Pty(rvbox_store_port::pty::PtyMutation::Close(
                wire::ClosePtySessionRequest {
                    request_id,
                    pty_session_id: issue,
                },
            )),
        };
        self.requests.insert(request.0);
        self.feed(Input::Control {
            request,
            caller: Caller {
                transport: "fuzz".into(),
                principal: String::new(),
            },
            call,
        });
    }

    /// Completes every operation (new ones included) without faults, then
    /// checks that nothing is left waiting.
    fn settle(&mut self) {
        let mut n = 0usize;
        while !self.ops.is_empty() {
            n += 1;
            assert!(n < MAX_SETTLE, "store operations never settle");
            self.complete(Fault::None);
        }
        assert_eq!(
            self.core.pending_ops(),
            0,
            "every operation the core issued was answered"
        );
        assert!(
            self.requests.is_empty(),
            "every control call was answered once its operations completed"
        );
    }
}

fn issue_of(bytes: &[u8; 16]) -> String {
    rvbox_domain::ids::Uuid7::from_bytes("issue", *bytes)
        .map(|u| u.to_string())
        .unwrap_or_default()
}

/// Runs one input.
pub fn run(data: &[u8]) {
    explore(data);
}

/// Runs one input and counts what the core did: frames sent by payload,
/// store operations by name (for the seed recorder and the docs).
pub fn explore(data: &[u8]) -> BTreeMap<String, u64> {
    let mut src = Source::new(data);
    let mut h = Harness::new();
    let mut steps = 0;
    while !src.is_empty() && steps < MAX_STEPS {
        h.step(&mut src);
        steps += 1;
    }
    h.settle();
    h.seen
}

/// Step programs for the server-core target, written as the reader reads
/// them (the seed recorder writes its scripted runs with these).
pub mod program {
    /// A program under construction.
    #[derive(Debug, Default, Clone)]
    pub struct Program(pub Vec<u8>);

    impl Program {
        /// An empty program.
        #[must_use]
        pub fn new() -> Self {
            Self::default()
        }

        /// The bytes.
        #[must_use]
        pub fn bytes(&self) -> Vec<u8> {
            self.0.clone()
        }

        /// The happy path: a client connects, says hello, reconciles,
        /// offers capacity, accepts the dispatched command and sends its
        /// first events, each store operation completed (the seed
        /// recorder writes it, and the tests extend it).
        #[must_use]
        pub fn happy() -> Self {
            Self::new()
                .connect()
                .hello(0, 0)
                .complete(8)
                .complete(8)
                .snapshot(false)
                .complete(8)
                .complete(8)
                .capacity(4)
                .complete(8)
                .complete(8)
                .accept(0)
                .complete(8)
                .lifecycle(0, 0)
                .output(0, b"hello\n")
                .complete(8)
                .complete(8)
        }

        /// A new connection whose writer keeps up.
        #[must_use]
        pub fn connect(mut self) -> Self {
            self.0.extend([0, 0, 0]);
            self
        }

        /// A hello on the newest connection from client `client` (an
        /// index of `CLIENTS`) and instance `instance`.
        #[must_use]
        pub fn hello(mut self, client: u8, instance: u8) -> Self {
            self.0.extend([1, 0, client, instance, 255, 0]);
            self
        }

        /// Completes the next `n` (1..=8) operations without fault.
        #[must_use]
        pub fn complete(mut self, n: u8) -> Self {
            let n = n.clamp(1, 8);
            self.0.extend([8, n - 1]);
            self.0.extend(std::iter::repeat_n(0, usize::from(n)));
            self
        }

        /// A final snapshot on the newest connection answering the last
        /// round: empty (a client that holds nothing), or echoing the
        /// round's rows as `ACCEPTED` at their revision.
        #[must_use]
        pub fn snapshot(mut self, echo: bool) -> Self {
            self.0.extend([2, 0, 255, 0, if echo { 255 } else { 0 }]);
            self.0.extend([4, 0, 4, 0, 4, 0, 4, 0]);
            self.0.extend([255, 0, 0, 255, 255]);
            self
        }

        /// Capacity of `max` running slots on the newest connection.
        #[must_use]
        pub fn capacity(mut self, max: u8) -> Self {
            self.0.extend([5, 0, 0, 0, max, max]);
            self
        }

        /// A positive acceptance of the `issue`-th command the newest
        /// connection knows (dispatched ones first), at its revision.
        #[must_use]
        pub fn accept(mut self, issue: u8) -> Self {
            self.0.extend([4, 0, issue, 4, 255, 0]);
            self
        }

        /// The next output event of the `issue`-th known command,
        /// compressed, with `data` (at most 64 bytes).
        #[must_use]
        pub fn output(mut self, issue: u8, data: &[u8]) -> Self {
            let data = data.get(..data.len().min(64)).unwrap_or_default();
            self.0.extend([3, 0, issue, 0, 0, 0]);
            self.0.push(u8::try_from(data.len()).unwrap_or(0));
            self.0.extend_from_slice(data);
            self.0.extend([0, 1, 0]);
            self
        }

        /// The next lifecycle event of the `issue`-th known command:
        /// `to` 0 running, 1 succeeded, 2 failed.
        #[must_use]
        pub fn lifecycle(mut self, issue: u8, to: u8) -> Self {
            self.0.extend([3, 0, issue, 0, 0, 3, to, 1]);
            self
        }

        /// `RunCommand` for client `client` (an index of `CLIENTS`), with
        /// `script` (at most 64 bytes; empty for command text).
        #[must_use]
        pub fn run_command(mut self, client: u8, script: &[u8]) -> Self {
            let script = script.get(..script.len().min(64)).unwrap_or_default();
            self.0.extend([15, 0, 0, 0, client]);
            self.0.push(u8::try_from(script.len()).unwrap_or(0));
            self.0.extend_from_slice(script);
            self
        }

        /// `AppendStdin` of `data` to the `issue`-th known command.
        #[must_use]
        pub fn stdin(mut self, issue: u8, data: &[u8]) -> Self {
            let data = data.get(..data.len().min(32)).unwrap_or_default();
            self.0.extend([15, 0, issue, 3]);
            self.0.push(u8::try_from(data.len()).unwrap_or(0));
            self.0.extend_from_slice(data);
            self
        }

        /// Time passes: `which` indexes 0, 1 ms, 100 ms, 1 s, 10 s, 30 s,
        /// 60 s, 600 s; then the timer fires.
        #[must_use]
        pub fn timeout(mut self, which: u8) -> Self {
            self.0.extend([9, which]);
            self
        }

        /// A frame as a client sent it, with the live session fields put
        /// in (at most 512 bytes).
        #[must_use]
        pub fn frame(mut self, bytes: &[u8]) -> Self {
            let bytes = bytes.get(..bytes.len().min(512)).unwrap_or_default();
            self.0.extend([7, 0]);
            self.0
                .extend(u16::try_from(bytes.len()).unwrap_or(0).to_le_bytes());
            self.0.extend_from_slice(bytes);
            self
        }

        /// The peer leaves the newest connection.
        #[must_use]
        pub fn disconnect(mut self) -> Self {
            self.0.extend([12, 0]);
            self
        }
    }
}
