//! A scripted fake server driving one simulated host (the real client
//! runtime over the real client store, with simulated process trees)
//! directly, no network; optionally persisting events into a real
//! temporary store.
#![allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::sync::Arc;

use prost::Message as _;
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::ClientId;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_sim::host::{ClientConfig, ClientEffect, ClientInput, SimHost};
use rvbox_sim::invariants::body_kind;
use rvbox_sim::net::{ConnId, Item, NetEvent};
use rvbox_sim::rng::{SeededEntropy, Seeds, SimRng};
use rvbox_sim::supervisor::{Programs, SharedLog};
use rvbox_store::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

pub const WALL_EPOCH_MS: i64 = 1_800_000_000_000;

/// What the client sent, decoded.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    Env(wire::Envelope),
    Raw(Vec<u8>),
    Ping,
    Pong,
    Close(u16),
}

impl Seen {
    pub fn payload(&self) -> Option<&Payload> {
        match self {
            Self::Env(e) => e.payload.as_ref(),
            _ => None,
        }
    }
}

pub fn events(seen: &[Seen]) -> Vec<wire::CommandEvent> {
    seen.iter()
        .filter_map(|s| match s.payload() {
            Some(Payload::CommandEvent(e)) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

pub fn accepted(seen: &[Seen]) -> Vec<wire::CommandAccepted> {
    seen.iter()
        .filter_map(|s| match s.payload() {
            Some(Payload::CommandAccepted(a)) => Some(a.clone()),
            _ => None,
        })
        .collect()
}

pub fn snapshots(seen: &[Seen]) -> Vec<wire::ClientSnapshot> {
    seen.iter()
        .filter_map(|s| match s.payload() {
            Some(Payload::ClientSnapshot(a)) => Some(a.clone()),
            _ => None,
        })
        .collect()
}

pub fn spec(text: &str) -> wire::ExecutionSpec {
    wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(text.into())),
        ..Default::default()
    }
}

pub fn lifecycle_of(e: &wire::CommandEvent) -> Option<Lifecycle> {
    match &e.body {
        Some(Body::Lifecycle(l)) => Lifecycle::from_wire(l.lifecycle).ok(),
        _ => None,
    }
}

#[derive(Debug, Clone, Default)]
pub struct ServerCmd {
    pub hash: Vec<u8>,
    pub revision: u64,
    pub durable: u64,
    pub terminal: bool,
    pub spec: Option<wire::ExecutionSpec>,
}

/// Short programs: a few small writes, quick steps, no bursts, no stdin
/// waits, TERM honoured, exit 0.
pub fn quiet_programs() -> Programs {
    Programs {
        max_chunks: 3,
        max_chunk: 2_000,
        max_step_ms: 200,
        fail_permille: 0,
        burst_permille: 0,
        max_burst: 256 * 1024,
        stdin_permille: 0,
        ignore_term_permille: 0,
        transient_launch_permille: 0,
        chatty_permille: 0,
        max_chatty_lines: 0,
        max_chatty_step_ms: 0,
    }
}

pub struct Harness {
    pub client: SimHost,
    /// What the host's process trees did.
    pub process: SharedLog,
    _dir: tempfile::TempDir,
    pub now: u64,
    pub conn: Option<ConnId>,
    next_conn: u64,
    pub generation: u64,
    pub session_id: String,
    pub round: u64,
    pub rng: SimRng,
    /// What the server knows, by issue text.
    pub server: BTreeMap<String, ServerCmd>,
    /// Every item the client ever sent.
    pub log: Vec<Seen>,
    pub store: Option<Store>,
    pub auto_pong: bool,
}

impl Harness {
    pub fn new(config: ClientConfig, seed: u64) -> Self {
        let seeds = Seeds::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let process = SharedLog::default();
        let client = SimHost::new(
            0,
            config,
            seeds.client(0),
            dir.path().join("host"),
            process.clone(),
        )
        .unwrap();
        Self {
            client,
            process,
            _dir: dir,
            now: 0,
            conn: None,
            next_conn: 1,
            generation: 0,
            session_id: String::new(),
            round: 0,
            rng: seeds.workload(),
            server: BTreeMap::new(),
            log: Vec::new(),
            store: None,
            auto_pong: true,
        }
    }

    pub fn client_id(&self) -> ClientId {
        ClientId::parse("t", self.client.client_id()).unwrap()
    }

    /// Drains the client's effects (answering Connect and Ping itself).
    pub fn drain(&mut self) -> Vec<Seen> {
        let mut out = Vec::new();
        while let Some(effect) = self.client.poll_effect() {
            match effect {
                ClientEffect::Connect => {
                    let conn = ConnId(self.next_conn);
                    self.next_conn += 1;
                    self.conn = Some(conn);
                    self.client.handle(self.now, ClientInput::Connected(conn));
                }
                ClientEffect::Send { conn, item } => {
                    assert_eq!(Some(conn), self.conn, "sent on a stale connection");
                    let seen = match item {
                        Item::Binary(b) => match wire::Envelope::decode(b.as_slice()) {
                            Ok(e) if e.payload.is_some() => Seen::Env(e),
                            _ => Seen::Raw(b),
                        },
                        Item::Ping => Seen::Ping,
                        Item::Pong => Seen::Pong,
                        Item::Close { code } => Seen::Close(code),
                    };
                    if seen == Seen::Ping && self.auto_pong {
                        self.client.handle(
                            self.now,
                            ClientInput::Delivered {
                                conn,
                                event: NetEvent::Item(Item::Pong),
                            },
                        );
                    }
                    out.push(seen);
                }
            }
        }
        self.log.extend(out.iter().cloned());
        out
    }

    /// Advances time to `to`, running every client timer on the way.
    pub fn advance(&mut self, to: u64) -> Vec<Seen> {
        let mut out = self.drain();
        for _ in 0..100_000 {
            match self.client.poll_timeout() {
                Some(t) if t <= to => {
                    self.now = self.now.max(t);
                    self.client.handle_timeout(self.now);
                    out.extend(self.drain());
                }
                _ => break,
            }
        }
        self.now = self.now.max(to);
        out
    }

    pub fn send_env(&mut self, session_id: &str, generation: u64, payload: Payload) -> Vec<Seen> {
        let env = wire::Envelope {
            session_id: session_id.into(),
            generation,
            payload: Some(payload),
        };
        let conn = self.conn.expect("no connection");
        self.client.handle(
            self.now,
            ClientInput::Delivered {
                conn,
                event: NetEvent::Item(Item::Binary(env.encode_to_vec())),
            },
        );
        self.drain()
    }

    pub fn deliver(&mut self, payload: Payload) -> Vec<Seen> {
        let (sid, generation) = (self.session_id.clone(), self.generation);
        self.send_env(&sid, generation, payload)
    }

    /// The connection breaks (the client learns it).
    pub fn disconnect(&mut self) -> Vec<Seen> {
        if let Some(conn) = self.conn.take() {
            self.client.handle(
                self.now,
                ClientInput::Delivered {
                    conn,
                    event: NetEvent::Closed {
                        cause: rvbox_sim::net::CloseCause::Reset,
                    },
                },
            );
        }
        self.drain()
    }

    /// Waits for the client to connect, checks its hello, welcomes it.
    pub fn connect(&mut self) -> wire::ClientHello {
        let mut seen = self.drain();
        let mut guard = 0;
        while !seen
            .iter()
            .any(|s| matches!(s.payload(), Some(Payload::ClientHello(_))))
        {
            let t = self.client.poll_timeout().expect("client has no timer");
            seen.extend(self.advance(t));
            guard += 1;
            assert!(guard < 1000, "client never said hello");
        }
        let hello_env = seen
            .iter()
            .find_map(|s| match s {
                Seen::Env(e) if matches!(e.payload, Some(Payload::ClientHello(_))) => {
                    Some(e.clone())
                }
                _ => None,
            })
            .unwrap();
        assert_eq!(hello_env.session_id, "");
        assert_eq!(hello_env.generation, 0);
        let Some(Payload::ClientHello(hello)) = hello_env.payload else {
            unreachable!()
        };
        self.generation += 1;
        self.session_id = format!("sim-session-{:012}", self.generation);
        self.round = 0;
        let welcome = wire::ServerWelcome {
            protocol_major: 1,
            negotiated_minor: 0,
            session_id: self.session_id.clone(),
            generation: self.generation,
            server_id: "01890a5d-ac96-774b-bcce-b302099a8057".into(),
            server_software_version: "0.1.0".into(),
            limits: Some(wire::AgentLimits {
                max_envelope_bytes: 1 << 20,
                max_output_chunk_bytes: 1 << 16,
                max_data_chunk_bytes: 1 << 18,
                max_script_bytes: 10 << 20,
                max_execution_spec_bytes: 768 << 10,
                command_window_bytes: 1 << 20,
                session_window_bytes: 8 << 20,
                max_reason_bytes: 4096,
                heartbeat_idle: None,
                liveness_timeout: None,
            }),
        };
        let seen = self.deliver(Payload::ServerWelcome(welcome));
        assert!(
            seen.is_empty(),
            "nothing before the ReconcileRequest: {seen:?}"
        );
        hello
    }

    /// One reconciliation round: request rows for every non-terminal
    /// server command, collect the snapshot, answer per the §6.4 matrix.
    /// Returns (snapshot chunks, what the client sent after the result).
    pub fn reconcile(&mut self) -> (Vec<wire::ClientSnapshot>, Vec<Seen>) {
        self.round += 1;
        let rows: Vec<wire::ReconcileRow> = self
            .server
            .iter()
            .filter(|(_, c)| !c.terminal)
            .map(|(id, c)| wire::ReconcileRow {
                issue_uuid: id.clone(),
                durable_event_seq: c.durable,
                revision: c.revision,
                request_hash: c.hash.clone(),
                lifecycle: wire::Lifecycle::Dispatched as i32,
            })
            .collect();
        let seen = self.deliver(Payload::ReconcileRequest(wire::ReconcileRequest {
            round: self.round,
            rows,
        }));
        let chunks = snapshots(&seen);
        assert!(!chunks.is_empty(), "no snapshot: {seen:?}");
        assert!(chunks.last().unwrap().final_chunk);
        let mut result = wire::ReconcileResult {
            round: self.round,
            ..Default::default()
        };
        for rec in chunks.iter().flat_map(|c| c.records.iter()) {
            let terminal = Lifecycle::from_wire(rec.lifecycle).unwrap().is_terminal();
            match self.server.get(&rec.issue_uuid) {
                Some(c) if !c.terminal => result.resume.push(wire::ResumeRow {
                    issue_uuid: rec.issue_uuid.clone(),
                    revision: c.revision,
                    durable_event_seq: c.durable,
                    script_resume_offset: 0,
                }),
                _ if terminal => result
                    .discard_local_terminal_issue_uuids
                    .push(rec.issue_uuid.clone()),
                _ => result
                    .terminate_local_issue_uuids
                    .push(rec.issue_uuid.clone()),
            }
        }
        result.result_digest = rvbox_segment::sha256(&result.encode_to_vec()).to_vec();
        let after = self.deliver(Payload::ReconcileResult(result));
        (chunks, after)
    }

    /// A fresh command for this client, dispatched at revision 1.
    pub fn dispatch_new(&mut self, text: &str) -> (String, Vec<Seen>) {
        let issue = self
            .rng
            .uuid_v7_text(u64::try_from(WALL_EPOCH_MS).unwrap() + self.now);
        let spec = spec(text);
        let hash = command_hash(&self.client_id(), &check_execution_spec(&spec).unwrap())
            .0
            .to_vec();
        if let Some(store) = self.store.as_mut() {
            store
                .run_command(
                    &wire::RunCommandRequest {
                        request_id: issue.clone(),
                        client_id: self.client.client_id().into(),
                        spec: Some(spec.clone()),
                        script: Vec::new(),
                        queue_ttl: None,
                    },
                    WALL_EPOCH_MS,
                )
                .unwrap();
            let bytes = *rvbox_domain::ids::Uuid7::parse("t", &issue)
                .unwrap()
                .as_bytes();
            store.mark_dispatched(&bytes, 1).unwrap();
        }
        self.server.insert(
            issue.clone(),
            ServerCmd {
                hash,
                revision: 1,
                durable: 0,
                terminal: false,
                spec: Some(spec),
            },
        );
        let seen = self.redispatch(&issue);
        (issue, seen)
    }

    pub fn redispatch(&mut self, issue: &str) -> Vec<Seen> {
        let c = self.server.get(issue).unwrap().clone();
        let seen = self.deliver(Payload::Dispatch(wire::Dispatch {
            issue_uuid: issue.into(),
            generation: self.generation,
            revision: c.revision,
            request_hash: c.hash.clone(),
            spec: c.spec.clone(),
            queue_expiry_time: None,
        }));
        if let Some(store) = self.store.as_mut() {
            let bytes = *rvbox_domain::ids::Uuid7::parse("t", issue)
                .unwrap()
                .as_bytes();
            for a in accepted(&seen) {
                if a.issue_uuid == issue && a.outcome == wire::AcceptOutcome::Positive as i32 {
                    let _ = store.record_accepted(&bytes, a.revision, a.resolved_shell);
                }
            }
        }
        seen
    }

    /// Stores (if backed by a store) and acknowledges every event in
    /// `seen`; returns what the client sent in reply.
    pub fn ack_all(&mut self, seen: &[Seen]) -> Vec<Seen> {
        let evs = events(seen);
        let mut acks: BTreeMap<String, u64> = BTreeMap::new();
        if let Some(store) = self.store.as_mut() {
            let batch: Vec<EventAppend> = evs.iter().map(to_append).collect();
            let report = store.append_events(&batch, WALL_EPOCH_MS).unwrap();
            for (o, e) in report.outcomes.iter().zip(&evs) {
                assert!(
                    matches!(o, EventOutcome::Appended | EventOutcome::Duplicate),
                    "store refused {e:?}: {o:?}"
                );
            }
            for (issue, seq) in report.acked {
                acks.insert(rvbox_sim::rng::uuid_text(&issue), seq);
            }
        } else {
            for e in &evs {
                let c = self.server.get(&e.issue_uuid).unwrap();
                let next = acks.get(&e.issue_uuid).copied().unwrap_or(c.durable);
                if e.event_seq == next + 1 {
                    acks.insert(e.issue_uuid.clone(), e.event_seq);
                }
            }
        }
        for e in &evs {
            if lifecycle_of(e).is_some_and(Lifecycle::is_terminal)
                && acks.get(&e.issue_uuid).is_some_and(|s| *s >= e.event_seq)
            {
                self.server.get_mut(&e.issue_uuid).unwrap().terminal = true;
            }
        }
        let mut out = Vec::new();
        for (issue, seq) in acks {
            let c = self.server.get_mut(&issue).unwrap();
            c.durable = c.durable.max(seq);
            out.extend(self.deliver(Payload::EventAck(wire::EventAck {
                issue_uuid: issue,
                durable_event_seq: seq,
            })));
        }
        out
    }

    /// Runs the client until every started command finished, acking as it
    /// goes.
    pub fn run_to_quiet(&mut self, mut seen: Vec<Seen>, horizon: u64) {
        for _ in 0..10_000 {
            seen.extend(self.advance(self.now + 100));
            let replies = self.ack_all(&seen);
            seen = replies;
            if self.now >= horizon {
                break;
            }
        }
    }
}

pub fn to_append(e: &wire::CommandEvent) -> EventAppend {
    let issue = *rvbox_domain::ids::Uuid7::parse("t", &e.issue_uuid)
        .unwrap()
        .as_bytes();
    let observed_ms = e.observed_time.as_ref().map_or(0, |t| t.seconds * 1000);
    let body = match e.body.as_ref().unwrap() {
        Body::Output(o) => EventBody::Output {
            stream: if o.stream == wire::OutputStream::Stderr as i32 {
                rvbox_segment::Stream::Stderr
            } else {
                rvbox_segment::Stream::Stdout
            },
            compression: rvbox_segment::Compression::Zstd,
            raw_len: o.raw_length,
            stored: o.payload.clone(),
        },
        Body::Lifecycle(l) => {
            let x = l.exit_result.clone().unwrap_or_default();
            EventBody::Lifecycle {
                to: Lifecycle::from_wire(l.lifecycle).unwrap(),
                exit_code: x.exit_code,
                exit_signal: x.signal_number,
                encoded: l.encode_to_vec(),
            }
        }
        Body::SignalResult(s) => EventBody::Other {
            kind: body_kind::SIGNAL_RESULT,
            encoded: s.encode_to_vec(),
        },
        Body::StdinAck(s) => EventBody::Other {
            kind: body_kind::STDIN_ACK,
            encoded: s.encode_to_vec(),
        },
        other => panic!("unexpected body {other:?}"),
    };
    EventAppend {
        session: None,
        issue_uuid: issue,
        event_seq: e.event_seq,
        observed_ms,
        body,
    }
}

/// A real store in a temporary directory, with seeded entropy.
pub fn temp_store(dir: &std::path::Path, seed: u64) -> Store {
    let mut s = Store::open(
        Layout::new(dir),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(SeededEntropy::new(Seeds::new(seed).server())),
        StoreOptions::default(),
        WALL_EPOCH_MS,
    )
    .unwrap();
    s.recover(WALL_EPOCH_MS).unwrap();
    s
}
