#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Scripted scenarios of plan §6.5 on the simulator's server: the real
//! engine over a real store, driven step by step by a scripted client, with
//! the server's answers snapshotted (insta) as a readable effect trace.
//! Everything random comes from a fixed seed, so the traces are stable.

use std::sync::Arc;

use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_engine::{Engine, Output};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{ServerIdentity, SessionConfig};
use rvbox_sim::rng::{SeededEntropy, SimRng};
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

const WALL: i64 = 1_800_000_000_000;
const A: &str = "6f1c2a4e-8b3d-4c5e-9f70-1a2b3c4d5e6f";
const B: &str = "7f1c2a4e-8b3d-4c5e-9f70-1a2b3c4d5e6f";

struct Script {
    _dir: tempfile::TempDir,
    e: Engine,
    ids: SimRng,
    now: u64,
    wall: i64,
    log: Vec<String>,
    /// Live (session id, generation) per connection, from its welcome.
    sessions: std::collections::BTreeMap<u64, (String, u64)>,
    dispatched: Vec<wire::Dispatch>,
    /// Connections whose client never takes a frame off the wire (their
    /// writer never reports a frame written); `None`: every writer keeps up.
    slow: Option<std::collections::BTreeSet<u64>>,
}

fn short(uuid: &str) -> &str {
    uuid.get(28..).unwrap_or(uuid)
}

impl Script {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let entropy = Arc::new(SeededEntropy::new(SimRng::new(65)));
        let mut store = Store::open(
            Layout::new(dir.path()),
            Arc::new(RealFs),
            entropy.clone(),
            StoreOptions::default(),
            WALL,
        )
        .unwrap();
        store.recover(WALL).unwrap();
        let server_id = Uuid7::from_bytes("server_id", store.server_id()).unwrap();
        let config = SessionConfig::new(ServerIdentity {
            server_id,
            software_version: "0.1.0".into(),
            supported_minors: vec![0, 1],
        });
        Self {
            _dir: dir,
            e: Engine::new(store, entropy, config),
            ids: SimRng::new(66),
            now: 0,
            wall: WALL,
            log: Vec::new(),
            sessions: std::collections::BTreeMap::new(),
            dispatched: Vec::new(),
            slow: None,
        }
    }

    /// From now on the client on `conn` never reads: frames to it stay
    /// unwritten, while every other connection's writer keeps up.
    fn never_reads(&mut self, conn: u64) {
        self.e.set_auto_written(false);
        self.slow.get_or_insert_with(Default::default).insert(conn);
    }

    /// Reports a frame to `conn` written, unless its client never reads.
    fn wrote(&mut self, conn: u64) {
        if self.slow.as_ref().is_some_and(|s| !s.contains(&conn)) {
            self.e.written(self.now, self.wall, conn);
        }
    }

    fn note(&mut self, s: &str) {
        self.log.push(format!("-- {s}"));
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
        self.wall += i64::try_from(ms).unwrap();
        self.e.tick(self.now, self.wall);
        self.drain();
    }

    /// Lets `ms` pass in 5 s steps, the client answering every Ping.
    fn idle(&mut self, conn: u64, ms: u64) {
        let mut left = ms;
        while left > 0 {
            let step = left.min(5_000);
            self.advance(step);
            self.e.pong(self.now, self.wall, conn);
            self.drain();
            left -= step;
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.e.poll_output() {
            let line = match o {
                Output::Frame { conn, bytes, .. } => {
                    let env = wire::Envelope::decode(bytes.as_slice()).unwrap();
                    let what = match env.payload.unwrap() {
                        Payload::ServerWelcome(w) => {
                            self.sessions
                                .insert(conn, (w.session_id.clone(), w.generation));
                            format!(
                                "server_welcome generation={} minor={}",
                                w.generation, w.negotiated_minor
                            )
                        }
                        Payload::ReconcileRequest(r) => {
                            format!("reconcile_request round={} rows={}", r.round, r.rows.len())
                        }
                        Payload::ReconcileResult(r) => format!(
                            "reconcile_result round={} terminate={} discard={} resume={}",
                            r.round,
                            r.terminate_local_issue_uuids.len(),
                            r.discard_local_terminal_issue_uuids.len(),
                            r.resume
                                .iter()
                                .map(|x| format!(
                                    "{}@{}",
                                    short(&x.issue_uuid),
                                    x.durable_event_seq
                                ))
                                .collect::<Vec<_>>()
                                .join(",")
                        ),
                        Payload::Dispatch(d) => {
                            let s = format!(
                                "dispatch {} revision={} generation={}",
                                short(&d.issue_uuid),
                                d.revision,
                                d.generation
                            );
                            self.dispatched.push(d);
                            s
                        }
                        Payload::ScriptChunk(c) => format!(
                            "script_chunk {} @{} +{} of {}",
                            short(&c.issue_uuid),
                            c.offset,
                            c.raw_length,
                            c.declared_size
                        ),
                        Payload::Signal(g) => format!(
                            "signal {} {} revision={}",
                            short(&g.issue_uuid),
                            wire::SignalKind::try_from(g.signal)
                                .map(|k| k.as_str_name().to_owned())
                                .unwrap_or_default(),
                            g.revision
                        ),
                        Payload::StdinWrite(w) => format!(
                            "stdin_write {} #{} {} bytes{}{}",
                            short(&w.issue_uuid),
                            w.write_seq,
                            w.raw_length,
                            if w.newline == wire::StdinNewline::Append as i32 {
                                " +newline"
                            } else {
                                ""
                            },
                            if w.close_after { " close" } else { "" }
                        ),
                        Payload::EventAck(a) => {
                            format!(
                                "event_ack {} #{}",
                                short(&a.issue_uuid),
                                a.durable_event_seq
                            )
                        }
                        Payload::ControlError(c) => {
                            let d = c.detail.unwrap_or_default();
                            format!(
                                "control_error {}: {}",
                                wire::ErrorCode::try_from(d.code)
                                    .map(|c| c.as_str_name().to_owned())
                                    .unwrap_or_default(),
                                d.reason
                            )
                        }
                        other => rvbox_session::payload_name(&other).to_owned(),
                    };
                    self.wrote(conn);
                    format!("c{conn} <- {what}")
                }
                Output::Ping { conn } => {
                    self.wrote(conn);
                    format!("c{conn} <- ping")
                }
                Output::Pong { conn } => {
                    self.wrote(conn);
                    format!("c{conn} <- pong")
                }
                Output::Close { conn, reason } => {
                    self.sessions.remove(&conn);
                    format!("c{conn} <- close {}", reason.as_str_name())
                }
                // the driver hands out connection outputs only
                _ => continue,
            };
            self.log.push(format!("{:>7} {line}", self.now));
        }
    }

    fn raw(&mut self, conn: u64, bytes: Vec<u8>) {
        self.e.frame(self.now, self.wall, conn, bytes);
        self.drain();
    }

    fn send(&mut self, conn: u64, p: Payload) {
        let (sid, generation) = self.sessions.get(&conn).cloned().unwrap_or_default();
        self.send_as(conn, &sid, generation, p);
    }

    fn send_as(&mut self, conn: u64, sid: &str, generation: u64, p: Payload) {
        let bytes = wire::Envelope {
            session_id: sid.into(),
            generation,
            payload: Some(p),
        }
        .encode_to_vec();
        self.raw(conn, bytes);
    }

    fn hello_with(&mut self, conn: u64, instance: &str, minors: Vec<u32>, major: u32) {
        self.hello_client(conn, "web-1", instance, minors, major);
    }

    fn hello_as(&mut self, conn: u64, client: &str, instance: &str) {
        self.hello_client(conn, client, instance, vec![0], 1);
    }

    fn hello_client(
        &mut self,
        conn: u64,
        client: &str,
        instance: &str,
        minors: Vec<u32>,
        major: u32,
    ) {
        self.e.connect(self.now, conn);
        let h = wire::ClientHello {
            client_id: client.into(),
            client_instance_id: instance.into(),
            protocol_major: major,
            supported_minors: minors,
            capabilities: Some(wire::Capabilities {
                platform: Some(wire::Platform {
                    os: "linux".into(),
                    arch: "x86_64".into(),
                    os_release: String::new(),
                }),
                software_version: "1.0.0".into(),
                shells: vec![wire::ShellCapability {
                    shell_type: wire::ShellType::Sh as i32,
                    platform_default: true,
                }],
                profiles: vec![],
                max_running: 1,
                max_queued: 0,
                supervision_mode: wire::SupervisionMode::CgroupV2 as i32,
            }),
            cwd_policy: Some(wire::CwdPolicy {
                default_cwd: "/srv".into(),
                allowed_roots: vec!["/srv".into()],
            }),
            labels: vec![],
        };
        self.send_as(conn, "", 0, Payload::ClientHello(h));
    }

    fn hello(&mut self, conn: u64, instance: &str) {
        self.hello_with(conn, instance, vec![0], 1);
    }

    /// Answers the open round with a snapshot, then reports capacity.
    fn reconcile(&mut self, conn: u64, records: Vec<wire::SnapshotRecord>, running: u32) {
        self.send(
            conn,
            Payload::ClientSnapshot(wire::ClientSnapshot {
                round: 1,
                chunk_index: 0,
                final_chunk: true,
                store_health: wire::ScopeState::Ready as i32,
                records,
                tombstones: vec![],
            }),
        );
        self.capacity(conn, running);
    }

    /// Reports capacity: `running` of one slot taken, no queue.
    fn capacity(&mut self, conn: u64, running: u32) {
        self.send(
            conn,
            Payload::ClientCapacity(wire::ClientCapacity {
                running,
                queued: 0,
                max_running: 1,
                max_queued: 0,
            }),
        );
    }

    /// A command dispatched to, accepted by and running on `conn`'s client
    /// (web-1): its id and its UUID text.
    fn running_command(&mut self, conn: u64) -> ([u8; 16], String) {
        let id = self.run_command();
        self.advance(1);
        let d = self.dispatched.last().unwrap().clone();
        self.accept(conn, &d, wire::AcceptOutcome::Positive);
        self.event(conn, &d.issue_uuid, 1, running_body());
        (id, d.issue_uuid)
    }

    fn run_command(&mut self) -> [u8; 16] {
        self.run_command_for("web-1")
    }

    fn run_command_for(&mut self, client: &str) -> [u8; 16] {
        let id = self.ids.uuid_v7(u64::try_from(self.wall).unwrap());
        let req = wire::RunCommandRequest {
            request_id: rvbox_sim::rng::uuid_text(&id),
            client_id: client.into(),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText(
                    "make test".into(),
                )),
                ..Default::default()
            }),
            script: Vec::new(),
            queue_ttl: None,
        };
        self.e.run_command(&req, self.wall).unwrap();
        self.log.push(format!(
            "{:>7} RunCommand {}",
            self.now,
            short(&rvbox_sim::rng::uuid_text(&id))
        ));
        id
    }

    fn accept(&mut self, conn: u64, d: &wire::Dispatch, outcome: wire::AcceptOutcome) {
        let error = (outcome != wire::AcceptOutcome::Positive).then(|| {
            let (code, retry) = if outcome == wire::AcceptOutcome::Transient {
                (
                    wire::ErrorCode::CapacityExhausted,
                    wire::RetryClass::Transient,
                )
            } else {
                (
                    wire::ErrorCode::InvalidArgument,
                    wire::RetryClass::Permanent,
                )
            };
            wire::ErrorDetail {
                code: code as i32,
                reason: "refused by the scripted client".into(),
                retry_class: retry as i32,
                ..Default::default()
            }
        });
        self.send(
            conn,
            Payload::CommandAccepted(wire::CommandAccepted {
                issue_uuid: d.issue_uuid.clone(),
                revision: d.revision,
                outcome: outcome as i32,
                error,
                resolved_shell: wire::ShellType::Sh as i32,
            }),
        );
    }

    fn event(&mut self, conn: u64, issue: &str, seq: u64, body: wire::command_event::Body) {
        self.send(
            conn,
            Payload::CommandEvent(wire::CommandEvent {
                issue_uuid: issue.into(),
                event_seq: seq,
                observed_time: None,
                body: Some(body),
            }),
        );
    }

    /// `SignalCommand` with a fresh `request_id`; returns (lifecycle,
    /// revision) and the request, for replays.
    fn signal(
        &mut self,
        id: &[u8; 16],
        kind: wire::SignalKind,
    ) -> (Lifecycle, u64, wire::SignalCommandRequest) {
        let request_id = self.ids.uuid_v7(u64::try_from(self.wall).unwrap());
        let req = wire::SignalCommandRequest {
            request_id: rvbox_sim::rng::uuid_text(&request_id),
            issue_uuid: rvbox_sim::rng::uuid_text(id),
            signal: kind as i32,
        };
        let r = self.e.signal_command(self.now, self.wall, &req).unwrap();
        let lifecycle = Lifecycle::from_wire(r.lifecycle).unwrap();
        self.log.push(format!(
            "{:>7} SignalCommand {} {} -> {} revision={}",
            self.now,
            short(&req.issue_uuid),
            kind.as_str_name(),
            lifecycle.as_str(),
            r.revision
        ));
        self.drain();
        (lifecycle, r.revision, req)
    }

    /// The client's answer to a signal that arrived before launch was
    /// authorized: `cancelled` at `revision` (event `seq`).
    fn cancelled_before_launch(&mut self, conn: u64, issue: &str, seq: u64, revision: u64) {
        self.event(
            conn,
            issue,
            seq,
            wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                lifecycle: wire::Lifecycle::Cancelled as i32,
                revision,
                exit_result: Some(wire::ExitResult {
                    lifecycle: wire::Lifecycle::Cancelled as i32,
                    ..Default::default()
                }),
                reason: "cancelled before launch".into(),
            }),
        );
    }

    /// The client's answer to a KILL at `revision` on a running command:
    /// the signal result (event `seq`), then `terminated` (event `seq + 1`).
    fn killed(&mut self, conn: u64, issue: &str, seq: u64, revision: u64, reason: &str) {
        self.ended_by(conn, issue, seq, revision, wire::SignalKind::Kill, reason);
    }

    /// As [`Self::killed`], for a KILL or TERM.
    fn ended_by(
        &mut self,
        conn: u64,
        issue: &str,
        seq: u64,
        revision: u64,
        kind: wire::SignalKind,
        reason: &str,
    ) {
        let (number, name) = if kind == wire::SignalKind::Term {
            (15, "SIGTERM")
        } else {
            (9, "SIGKILL")
        };
        self.event(
            conn,
            issue,
            seq,
            wire::command_event::Body::SignalResult(wire::SignalResult {
                revision,
                signal: kind as i32,
                outcome: wire::SignalOutcome::Delivered as i32,
                ..Default::default()
            }),
        );
        self.event(
            conn,
            issue,
            seq + 1,
            wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                lifecycle: wire::Lifecycle::Terminated as i32,
                revision,
                exit_result: Some(wire::ExitResult {
                    lifecycle: wire::Lifecycle::Terminated as i32,
                    signal_number: Some(number),
                    signal_name: name.into(),
                    ..Default::default()
                }),
                reason: reason.into(),
            }),
        );
    }

    fn lifecycle(&self, id: &[u8; 16]) -> Lifecycle {
        self.e.command(id).unwrap().lifecycle
    }

    fn trace(&self) -> String {
        self.log.join("\n")
    }
}

fn running_body() -> wire::command_event::Body {
    wire::command_event::Body::Lifecycle(wire::LifecycleChange {
        lifecycle: wire::Lifecycle::Running as i32,
        revision: 1,
        exit_result: None,
        reason: String::new(),
    })
}

fn output_body(raw: &[u8]) -> wire::command_event::Body {
    let z = zstd::bulk::compress(raw, 1).unwrap();
    wire::command_event::Body::Output(wire::OutputChunk {
        stream: wire::OutputStream::Stdout as i32,
        raw_length: u32::try_from(raw.len()).unwrap(),
        stored_length: u32::try_from(z.len()).unwrap(),
        payload: z,
    })
}

#[test]
fn version_negotiation() {
    let mut s = Script::new();
    s.note("a client speaking minors 0..=3 gets the highest the server shares (1)");
    s.hello_with(1, A, vec![0, 1, 2, 3], 1);
    s.note("a client speaking only minor 7 is refused");
    s.hello_with(2, B, vec![7], 1);
    s.note("and so is major 2");
    s.hello_with(3, B, vec![0], 2);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn same_instance_replacement_fences_the_old_session() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    s.event(1, &d.issue_uuid, 1, running_body());
    let old_fields = s.sessions.get(&1).cloned().unwrap();
    s.note("the same instance reconnects (its old socket is half-open)");
    s.advance(1_000);
    s.hello(2, A);
    let live =
        s.e.store()
            .client_record("web-1")
            .unwrap()
            .unwrap()
            .live
            .unwrap();
    assert_eq!(live.generation, 2, "the new session is the live one");
    s.note("late output of the old session, on its old socket and on the new one");
    let late = wire::CommandEvent {
        issue_uuid: d.issue_uuid.clone(),
        event_seq: 2,
        observed_time: None,
        body: Some(output_body(b"late")),
    };
    let before = s.log.len();
    s.send_as(
        1,
        &old_fields.0,
        old_fields.1,
        Payload::CommandEvent(late.clone()),
    );
    assert_eq!(
        s.log.len(),
        before,
        "the fenced connection is gone: nothing answers on it"
    );
    s.send_as(2, &old_fields.0, old_fields.1, Payload::CommandEvent(late));
    assert!(
        s.log
            .last()
            .is_some_and(|l| l.contains("c2 <- close CLOSE_REASON_STALE_SESSION")),
        "old session fields on a live connection are stale: {}",
        s.log.last().unwrap()
    );
    assert_eq!(
        s.e.command(&id).unwrap().last_event_seq,
        1,
        "nothing of the old session was stored after its fence"
    );
    assert!(
        !s.log[before..].iter().any(|l| l.contains("event_ack")),
        "nothing of the old session was acknowledged"
    );
    insta::assert_snapshot!(s.trace());
}

#[test]
fn different_instance_pending_claim_and_exact_one_shot_takeover() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.note("instance B while A is live: refused, its claim recorded");
    s.hello(2, B);
    let rec = s.e.store().client_record("web-1").unwrap().unwrap();
    assert!(rec.pending_claim.is_some());
    s.note("an operator authorizes exactly B");
    let rid = Uuid7::from_bytes("request_id", s.ids.uuid_v7(1_800_000_000_000)).unwrap();
    let b = *rvbox_domain::ids::InstanceId::parse("i", B)
        .unwrap()
        .as_bytes();
    s.e.store_mut()
        .authorize_takeover(&rid, "web-1", &b, 300_000, s.wall)
        .unwrap();
    s.note("B reconnects: the grant is consumed and A is fenced");
    s.hello(3, B);
    s.note("the grant was one-shot: A's comeback is a live conflict again");
    s.hello(4, A);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn an_expired_takeover_grant_admits_nobody() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.hello(2, B);
    let rid = Uuid7::from_bytes("request_id", s.ids.uuid_v7(1_800_000_000_000)).unwrap();
    let b = *rvbox_domain::ids::InstanceId::parse("i", B)
        .unwrap()
        .as_bytes();
    s.e.store_mut()
        .authorize_takeover(&rid, "web-1", &b, 300_000, s.wall)
        .unwrap();
    s.note("B comes back exactly five minutes later: the grant has expired");
    s.now += 300_000;
    s.wall += 300_000;
    // keep A's session alive across the wait
    s.hello(3, B);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn stale_generation_late_output_and_malformed_envelopes_close() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let (sid, generation) = s.sessions[&1].clone();
    s.note("output stamped with an older generation");
    s.send_as(
        1,
        &sid,
        generation - 1,
        Payload::ClientCapacity(wire::ClientCapacity::default()),
    );
    s.hello(2, A);
    s.reconcile(2, vec![], 0);
    s.note("garbage bytes");
    s.raw(2, vec![0xff, 0x00, 0x13]);
    s.hello(3, A);
    s.reconcile(3, vec![], 0);
    s.note("a server-to-client message from the client");
    s.send(3, Payload::EventAck(wire::EventAck::default()));
    insta::assert_snapshot!(s.trace());
}

#[test]
fn ping_after_exactly_ten_seconds_close_after_thirty_and_a_clock_jump_kills_nothing() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.note("the server's wall clock steps back an hour: nothing happens");
    s.wall -= 3_600_000;
    s.advance(9_999);
    s.advance(1);
    s.note("no inbound frame since: close at exactly 30 s");
    s.advance(19_999);
    s.advance(1);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_full_client_queue_receives_nothing_until_capacity_frees() {
    let mut s = Script::new();
    s.hello(1, A);
    s.note("the client reports its one running slot taken");
    s.reconcile(1, vec![], 1);
    let id = s.run_command();
    s.advance(1_000);
    assert_eq!(s.lifecycle(&id), Lifecycle::Queued);
    s.note("a slot frees");
    s.capacity(1, 0);
    s.advance(1);
    assert_eq!(s.lifecycle(&id), Lifecycle::Dispatched);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn dispatch_is_retried_after_a_lost_acceptance_and_acks_follow_durable_events() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    s.note("the connection dies before the CommandAccepted arrives");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    assert_eq!(s.lifecycle(&id), Lifecycle::Dispatched);
    s.hello(2, A);
    s.note("the client never stored it: an absent dispatched command returns to the queue");
    s.reconcile(2, vec![], 0);
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(2, &d, wire::AcceptOutcome::Positive);
    s.event(2, &d.issue_uuid, 1, running_body());
    s.event(2, &d.issue_uuid, 2, output_body(b"compiling\n"));
    s.note("an identical repeat is harmless and acknowledged again");
    s.event(2, &d.issue_uuid, 2, output_body(b"compiling\n"));
    s.note("a conflicting repeat fences the session");
    s.event(2, &d.issue_uuid, 2, output_body(b"something else\n"));
    assert_eq!(s.lifecycle(&id), Lifecycle::Running);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn transient_rejection_requeues_with_backoff_and_permanent_rejection_is_terminal() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.note("transient: back to the queue, retried after a jittered backoff");
    s.accept(1, &d, wire::AcceptOutcome::Transient);
    assert_eq!(s.lifecycle(&id), Lifecycle::Queued);
    s.idle(1, 10_000);
    assert_eq!(s.dispatched.len(), 2, "redispatched after the backoff");
    let d = s.dispatched.last().unwrap().clone();
    s.note("permanent: rejected, with its reason stored");
    s.accept(1, &d, wire::AcceptOutcome::Permanent);
    assert_eq!(s.lifecycle(&id), Lifecycle::Rejected, "{}", s.trace());
    insta::assert_snapshot!(s.trace());
}

#[test]
fn complete_reconciliation_of_active_and_terminal_unacknowledged_records_repeats_identically() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let ended = s.run_command();
    s.advance(1);
    let d1 = s.dispatched.last().unwrap().clone();
    s.accept(1, &d1, wire::AcceptOutcome::Positive);
    s.event(1, &d1.issue_uuid, 1, running_body());
    s.note("the first command ends on the client; its terminal event is not yet sent");
    s.capacity(1, 0);
    let active = s.run_command();
    s.advance(1);
    let d2 = s.dispatched.last().unwrap().clone();
    assert_ne!(d1.issue_uuid, d2.issue_uuid);
    s.accept(1, &d2, wire::AcceptOutcome::Positive);
    s.event(1, &d2.issue_uuid, 1, running_body());
    s.note("the server loses the connection; the client ran on and holds more");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    let record =
        |d: &wire::Dispatch, lifecycle: wire::Lifecycle, assigned: u64| wire::SnapshotRecord {
            issue_uuid: d.issue_uuid.clone(),
            request_hash: d.request_hash.clone(),
            revision: 1,
            lifecycle: lifecycle as i32,
            last_assigned_event_seq: assigned,
            acked_event_seq: 1,
            script_received_bytes: 0,
        };
    let records = vec![
        // terminal on the client, its succeeded event assigned and unacknowledged
        record(&d1, wire::Lifecycle::Succeeded, 2),
        // still running, with output the server has not seen
        record(&d2, wire::Lifecycle::Running, 3),
    ];
    s.hello(2, A);
    s.reconcile(2, records.clone(), 1);
    s.note("the result is lost; the same snapshot on the next session gives the same result");
    s.hello(3, A);
    s.reconcile(3, records, 1);
    assert_eq!(s.lifecycle(&active), Lifecycle::Running);
    assert_eq!(
        s.lifecycle(&ended),
        Lifecycle::Running,
        "the terminal event is replayed by the client, not invented by the server"
    );
    let results: Vec<&String> = s
        .log
        .iter()
        .filter(|l| l.contains("reconcile_result"))
        .collect();
    assert_eq!(results.len(), 3);
    assert_eq!(
        results[1].split("reconcile_result").nth(1),
        results[2].split("reconcile_result").nth(1)
    );
    for d in [&d1, &d2] {
        assert!(
            results[2].contains(&format!("{}@1", short(&d.issue_uuid))),
            "both records resume from the durable sequence: {}",
            results[2]
        );
    }
    assert!(
        results[2].contains("terminate=0 discard=0"),
        "{}",
        results[2]
    );
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_slow_client_cannot_delay_another_client() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.note("client web-1 never reads again; client web-2 connects and gets its work");
    s.never_reads(1);
    s.e.connect(s.now, 2);
    let mut h = wire::ClientHello {
        client_id: "web-2".into(),
        client_instance_id: B.into(),
        protocol_major: 1,
        supported_minors: vec![0],
        ..Default::default()
    };
    h.capabilities = Some(wire::Capabilities {
        software_version: "1.0.0".into(),
        shells: vec![wire::ShellCapability {
            shell_type: wire::ShellType::Sh as i32,
            platform_default: true,
        }],
        max_running: 1,
        platform: Some(wire::Platform {
            os: "linux".into(),
            arch: "x86_64".into(),
            os_release: String::new(),
        }),
        supervision_mode: wire::SupervisionMode::CgroupV2 as i32,
        ..Default::default()
    });
    h.cwd_policy = Some(wire::CwdPolicy {
        default_cwd: "/srv".into(),
        allowed_roots: vec!["/srv".into()],
    });
    s.send_as(2, "", 0, Payload::ClientHello(h));
    s.reconcile(2, vec![], 0);
    for _ in 0..3 {
        s.run_command(); // web-1's, piling up
    }
    let req_id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
    let req = wire::RunCommandRequest {
        request_id: rvbox_sim::rng::uuid_text(&req_id),
        client_id: "web-2".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("uptime".into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    };
    s.e.run_command(&req, s.wall).unwrap();
    s.advance(1);
    assert_eq!(s.lifecycle(&req_id), Lifecycle::Dispatched);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn cancellation_before_launch_ends_a_never_dispatched_command_on_the_server() {
    let mut s = Script::new();
    s.hello(1, A);
    s.note("the client reports its one slot taken, so nothing is dispatched");
    s.reconcile(1, vec![], 1);
    let id = s.run_command();
    s.advance(1_000);
    s.note("kill before it was ever dispatched: cancelled here, no frame");
    let (lifecycle, revision, _) = s.signal(&id, wire::SignalKind::Kill);
    assert_eq!((lifecycle, revision), (Lifecycle::Cancelled, 2));
    assert_eq!(s.lifecycle(&id), Lifecycle::Cancelled);
    s.note("a slot frees: the cancelled command is never dispatched");
    s.capacity(1, 0);
    s.advance(1);
    assert!(s.dispatched.is_empty());
    insta::assert_snapshot!(s.trace());
}

#[test]
fn the_launch_cancel_race_is_resolved_by_the_client_at_the_new_revision() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let won = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    s.note("kill while accepted: a higher revision, then the revisioned signal; still accepted");
    let (lifecycle, revision, _) = s.signal(&won, wire::SignalKind::Kill);
    assert_eq!((lifecycle, revision), (Lifecycle::Accepted, 2));
    assert_eq!(s.lifecycle(&won), Lifecycle::Accepted);
    s.note("launch was not authorized yet: the client answers cancelled at revision 2");
    s.cancelled_before_launch(1, &d.issue_uuid, 1, 2);
    assert_eq!(s.lifecycle(&won), Lifecycle::Cancelled);

    s.note("the other side of the race: already running when the kill lands");
    s.capacity(1, 0);
    let lost = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    s.event(1, &d.issue_uuid, 1, running_body());
    s.signal(&lost, wire::SignalKind::Kill);
    assert_eq!(
        s.lifecycle(&lost),
        Lifecycle::Running,
        "visible lifecycle unchanged"
    );
    s.note("the client reports the signal result and the actual outcome");
    s.killed(1, &d.issue_uuid, 2, 2, "");
    assert_eq!(s.lifecycle(&lost), Lifecycle::Terminated);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_signal_decided_while_the_client_is_away_is_sent_after_reconciliation() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    s.event(1, &d.issue_uuid, 1, running_body());
    s.note("the connection drops; the operator kills the running command meanwhile");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    let (lifecycle, revision, _) = s.signal(&id, wire::SignalKind::Kill);
    assert_eq!((lifecycle, revision), (Lifecycle::Running, 2));
    assert!(
        !s.log.iter().any(|l| l.contains("<- signal")),
        "no session to send it on"
    );
    s.note("the client comes back still running at revision 1: the kill follows the result");
    s.hello(2, A);
    s.reconcile(2, vec![held(&d, wire::Lifecycle::Running, 1, 0)], 1);
    let result_at = s
        .log
        .iter()
        .position(|l| l.contains("reconcile_result"))
        .unwrap();
    let signal_at = s.log.iter().position(|l| l.contains("<- signal")).unwrap();
    assert!(
        signal_at > result_at,
        "the signal follows the durable result"
    );
    s.note("the client reports the kill's result and the outcome; nothing is sent again");
    s.killed(2, &d.issue_uuid, 2, 2, "killed");
    assert_eq!(s.lifecycle(&id), Lifecycle::Terminated);
    assert!(s.e.store().pending_signals(&id).unwrap().is_empty());
    insta::assert_snapshot!(s.trace());
}

/// The stdin writes sent so far, in order: (conn, write_seq).
fn stdin_sent(s: &Script) -> Vec<(u64, u64)> {
    s.log
        .iter()
        .filter_map(|l| {
            let (conn, rest) = l.split_once(" <- stdin_write ")?;
            let conn = conn
                .split_whitespace()
                .last()?
                .strip_prefix('c')?
                .parse()
                .ok()?;
            let seq = rest
                .split_whitespace()
                .nth(1)?
                .strip_prefix('#')?
                .parse()
                .ok()?;
            Some((conn, seq))
        })
        .collect()
}

fn stdin_ack(write_seq: u64, closed: bool) -> wire::command_event::Body {
    wire::command_event::Body::StdinAck(wire::StdinAck {
        write_seq,
        delivery: wire::StdinDelivery::Written as i32,
        closed,
        reason: String::new(),
    })
}

#[test]
fn stdin_waits_for_the_process_goes_in_order_within_the_window_and_again_after_a_reconnect() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    let append = |s: &mut Script, data: Vec<u8>, newline: wire::StdinNewline| {
        let request_id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
        let req = wire::AppendStdinRequest {
            request_id: rvbox_sim::rng::uuid_text(&request_id),
            issue_uuid: rvbox_sim::rng::uuid_text(&id),
            data,
            newline: newline as i32,
        };
        let r = s.e.append_stdin(s.now, s.wall, &req).unwrap();
        s.log.push(format!(
            "{:>7} AppendStdin {} {} bytes -> writes {}..{}",
            s.now,
            short(&req.issue_uuid),
            req.data.len(),
            r.first_write_seq,
            r.last_write_seq
        ));
        s.drain();
        (req, r)
    };
    s.note("stdin written while the command is accepted but not running waits for its process");
    let (early, _) = append(&mut s, b"early".to_vec(), wire::StdinNewline::Append);
    assert!(stdin_sent(&s).is_empty(), "nothing before the process runs");
    s.event(1, &d.issue_uuid, 1, running_body());
    assert_eq!(
        stdin_sent(&s),
        vec![(1, 1)],
        "the running event releases it"
    );

    s.note("2 MiB more: eight writes of 256 KiB; at most 1 MiB is in flight");
    let (_, big) = append(&mut s, vec![b'x'; 1024 * 1024], wire::StdinNewline::Raw);
    assert_eq!((big.first_write_seq, big.last_write_seq), (2, 5));
    let (_, big2) = append(&mut s, vec![b'y'; 1024 * 1024], wire::StdinNewline::Raw);
    assert_eq!((big2.first_write_seq, big2.last_write_seq), (6, 9));
    let sent: Vec<u64> = stdin_sent(&s).iter().map(|(_, w)| *w).collect();
    assert_eq!(
        sent,
        vec![1, 2, 3, 4],
        "1 MiB minus the early write: three more"
    );
    s.note("the client acknowledges writes 1-3: the window moves on");
    s.event(1, &d.issue_uuid, 2, stdin_ack(1, false));
    s.event(1, &d.issue_uuid, 3, stdin_ack(2, false));
    s.event(1, &d.issue_uuid, 4, stdin_ack(3, false));
    let sent: Vec<u64> = stdin_sent(&s).iter().map(|(_, w)| *w).collect();
    assert_eq!(
        sent,
        vec![1, 2, 3, 4, 5, 6, 7],
        "in order, never beyond the window"
    );

    s.note("the connection drops; the operator closes stdin meanwhile");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    let close = wire::CloseStdinRequest {
        request_id: rvbox_sim::rng::uuid_text(&s.ids.uuid_v7(u64::try_from(s.wall).unwrap())),
        issue_uuid: rvbox_sim::rng::uuid_text(&id),
    };
    let closed = s.e.close_stdin(s.now, s.wall, &close).unwrap();
    assert_eq!(closed.write_seq, 10);
    s.drain();
    s.note("the client comes back still running: the unacknowledged writes go again from 4");
    s.hello(2, A);
    s.reconcile(2, vec![held(&d, wire::Lifecycle::Running, 4, 0)], 1);
    let again: Vec<u64> = stdin_sent(&s)
        .iter()
        .filter(|(c, _)| *c == 2)
        .map(|(_, w)| *w)
        .collect();
    assert_eq!(
        again,
        vec![4, 5, 6, 7],
        "from the first unacknowledged one, within the window"
    );
    for (n, w) in (4..=10).enumerate() {
        let seq = 5 + u64::try_from(n).unwrap();
        s.event(2, &d.issue_uuid, seq, stdin_ack(w, w == 10));
    }
    let again: Vec<u64> = stdin_sent(&s)
        .iter()
        .filter(|(c, _)| *c == 2)
        .map(|(_, w)| *w)
        .collect();
    assert_eq!(
        again,
        vec![4, 5, 6, 7, 8, 9, 10],
        "each write sent once on this session"
    );
    assert!(
        s.e.store()
            .pending_stdin(&id, 0, u64::MAX, 1000)
            .unwrap()
            .writes
            .is_empty(),
        "every write settled"
    );
    s.note("a replayed append answers its first assignment and sends nothing");
    let before = stdin_sent(&s).len();
    let replay = s.e.append_stdin(s.now, s.wall, &early).unwrap();
    s.drain();
    assert_eq!((replay.first_write_seq, replay.last_write_seq), (1, 1));
    assert_eq!(replay.delivery, wire::StdinDelivery::Written as i32);
    assert_eq!(stdin_sent(&s).len(), before);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_signal_request_id_is_answered_once_and_replayed_identically() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    s.event(1, &d.issue_uuid, 1, running_body());
    let (_, revision, req) = s.signal(&id, wire::SignalKind::Term);
    assert_eq!(revision, 2);
    s.note("the operator retries with the same request_id: the same answer, no new signal");
    let signals_before = s.log.iter().filter(|l| l.contains("<- signal")).count();
    let again = s.e.signal_command(s.now, s.wall, &req).unwrap();
    s.drain();
    assert_eq!(again.revision, 2);
    assert_eq!(again.lifecycle, wire::Lifecycle::Running as i32);
    assert_eq!(
        s.log.iter().filter(|l| l.contains("<- signal")).count(),
        signals_before
    );
    assert_eq!(s.e.command(&id).unwrap().revision, 2);
    s.note("the same request_id for another signal is a conflict and changes nothing");
    let other = wire::SignalCommandRequest {
        signal: wire::SignalKind::Kill as i32,
        ..req.clone()
    };
    let err = s.e.signal_command(s.now, s.wall, &other).unwrap_err();
    assert_eq!(err.to_domain().code(), rvbox_domain::error::Code::Conflict);
    assert_eq!(s.e.command(&id).unwrap().revision, 2);
    s.log.push(format!(
        "{:>7} reused request_id -> {}",
        s.now,
        err.to_domain().code().as_str()
    ));
    s.note("a second signal takes the next revision; both stay pending until the command ends");
    let (_, revision, _) = s.signal(&id, wire::SignalKind::Kill);
    assert_eq!(revision, 3);
    assert_eq!(s.e.store().pending_signals(&id).unwrap().len(), 2);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_late_acceptance_is_kept_recorded_and_terminated_and_the_term_survives_a_reconnect() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
    let req = wire::RunCommandRequest {
        request_id: rvbox_sim::rng::uuid_text(&id),
        client_id: "web-1".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(
                "make deploy".into(),
            )),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: Some(prost_types::Duration {
            seconds: 10,
            nanos: 0,
        }),
    };
    s.e.run_command(&req, s.wall).unwrap();
    s.note("a 10 s queue TTL; dispatched, and the acceptance is slow");
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.idle(1, 12_000);
    let v = s.e.command(&id).unwrap();
    assert_eq!(
        v.lifecycle,
        Lifecycle::Dispatched,
        "no false terminal state"
    );
    assert!(
        v.expired_pending,
        "the late-pending-reconciliation indicator"
    );
    s.note("the client accepts after the TTL: accepted, an incident, a higher revision, then TERM");
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    let v = s.e.command(&id).unwrap();
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Accepted, 2));
    let incidents = s.e.store().list_incidents(None, None, 10).unwrap();
    assert_eq!(incidents.len(), 1);
    assert_eq!(incidents[0].kind, wire::IncidentKind::LateAfterExpiry);
    assert!(s.log.last().unwrap().contains("signal"));
    s.note("the connection drops before the client saw the TERM; it is sent again after reconciliation");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    s.hello(2, A);
    s.reconcile(2, vec![held(&d, wire::Lifecycle::Running, 0, 0)], 1);
    assert!(
        s.log
            .iter()
            .rev()
            .take_while(|l| !l.contains("reconcile_result"))
            .any(|l| l.contains("signal") && l.contains("TERM revision=2"))
    );
    s.note("every event after the late acceptance is kept; the outcome follows the client");
    s.event(2, &d.issue_uuid, 1, running_body());
    s.ended_by(
        2,
        &d.issue_uuid,
        2,
        2,
        wire::SignalKind::Term,
        "terminated after a late acceptance",
    );
    assert_eq!(s.lifecycle(&id), Lifecycle::Terminated);
    insta::assert_snapshot!(s.trace());
}

#[test]
fn a_signal_on_dispatched_work_is_resolved_by_the_acceptance_or_cancels_work_never_held() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let held = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.note("TERM while dispatched: the next revision, the frame follows the dispatch");
    let (lifecycle, revision, _) = s.signal(&held, wire::SignalKind::Term);
    assert_eq!((lifecycle, revision), (Lifecycle::Dispatched, 2));
    s.note("the acceptance answers the dispatch (revision 1) and is recorded at revision 2");
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    let v = s.e.command(&held).unwrap();
    assert_eq!((v.lifecycle, v.revision), (Lifecycle::Accepted, 2));
    s.note("it had not launched when the TERM arrived: the client answers cancelled at revision 2");
    s.cancelled_before_launch(1, &d.issue_uuid, 1, 2);
    assert_eq!(s.lifecycle(&held), Lifecycle::Cancelled);

    s.note("KILL while dispatched, then the connection drops before any answer");
    s.capacity(1, 0);
    let never = s.run_command();
    s.advance(1);
    s.signal(&never, wire::SignalKind::Kill);
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    s.note("the client comes back without it: launch was never authorized, so cancelled");
    s.hello(2, A);
    s.reconcile(2, vec![], 0);
    assert_eq!(s.lifecycle(&never), Lifecycle::Cancelled);
    s.advance(1_000);
    let redispatched = s
        .dispatched
        .iter()
        .filter(|x| x.issue_uuid == rvbox_sim::rng::uuid_text(&never))
        .count();
    assert_eq!(redispatched, 1, "never dispatched again");
    insta::assert_snapshot!(s.trace());
}

/// A script of `len` pseudo-random bytes.
fn script_body(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

#[test]
fn a_script_is_uploaded_in_a_window_acknowledged_by_the_client_and_resumed_after_a_reconnect() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let body = script_body(1_500_000);
    let id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
    let req = script_request(&id, &body);
    s.e.run_command(&req, s.wall).unwrap();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.note("accepted: chunks of 256 KiB up to 1 MiB beyond what the client holds");
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    let status = |received: u64, state: wire::ScriptUploadState| {
        Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
            issue_uuid: d.issue_uuid.clone(),
            received_bytes: received,
            state: state as i32,
            error: None,
        })
    };
    s.note("the client holds 512 KiB: the window moves by that much");
    s.send(1, status(524_288, wire::ScriptUploadState::Receiving));
    s.note("the connection drops; the client comes back holding 768 KiB");
    s.e.disconnected(s.now, s.wall, 1);
    s.drain();
    s.hello(2, A);
    s.reconcile(2, vec![held(&d, wire::Lifecycle::Accepted, 0, 786_432)], 1);
    s.note("the rest, then the client commits the whole script");
    s.send(2, status(1_500_000, wire::ScriptUploadState::Committed));
    let stats = s.e.stats().clone();
    assert_eq!(stats.scripts_committed, 1);
    assert_eq!(stats.script_uploads, 2);
    s.note("a prefix beyond the script's size is a protocol error");
    s.capacity(2, 0);
    let other = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
    let req2 = wire::RunCommandRequest {
        request_id: rvbox_sim::rng::uuid_text(&other),
        ..req
    };
    s.e.run_command(&req2, s.wall).unwrap();
    s.advance(1);
    let d2 = s.dispatched.last().unwrap().clone();
    s.accept(2, &d2, wire::AcceptOutcome::Positive);
    s.send(
        2,
        Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
            issue_uuid: d2.issue_uuid.clone(),
            received_bytes: 1_500_001,
            state: wire::ScriptUploadState::Receiving as i32,
            error: None,
        }),
    );
    assert!(
        s.log
            .last()
            .unwrap()
            .contains("close CLOSE_REASON_PROTOCOL_ERROR")
    );
    insta::assert_snapshot!(s.trace());
}

/// A `RunCommand` of `body` as a script on web-1.
fn script_request(id: &[u8; 16], body: &[u8]) -> wire::RunCommandRequest {
    wire::RunCommandRequest {
        request_id: rvbox_sim::rng::uuid_text(id),
        client_id: "web-1".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::Script(
                wire::ScriptDescriptor {
                    display_basename: "job.sh".into(),
                    size_bytes: body.len() as u64,
                    sha256: rvbox_segment::sha256(body).to_vec(),
                },
            )),
            ..Default::default()
        }),
        script: body.to_vec(),
        queue_ttl: None,
    }
}

#[test]
fn many_uploads_share_the_connection_window_and_a_finished_one_hands_its_room_on() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.note("the client has room for 40 commands; 40 scripts of 256 KiB each");
    s.send(
        1,
        Payload::ClientCapacity(wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 40,
            max_queued: 0,
        }),
    );
    let mut ids = Vec::new();
    for i in 0..40u8 {
        let id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
        let body = vec![i; 262_144];
        s.e.run_command(&script_request(&id, &body), s.wall)
            .unwrap();
        ids.push(id);
    }
    s.advance(1);
    let dispatches: Vec<wire::Dispatch> = s.dispatched.clone();
    assert_eq!(dispatches.len(), 40);
    let chunks_before = s.e.stats().script_chunks;
    for d in &dispatches {
        s.accept(1, d, wire::AcceptOutcome::Positive);
    }
    let sent = s.e.stats().script_chunks - chunks_before;
    assert_eq!(sent, 32, "8 MiB on one connection, no more");
    s.note("each commit hands its 256 KiB on to a waiting upload");
    for d in dispatches.iter().take(8) {
        s.send(
            1,
            Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: d.issue_uuid.clone(),
                received_bytes: 262_144,
                state: wire::ScriptUploadState::Committed as i32,
                error: None,
            }),
        );
    }
    assert_eq!(
        s.e.stats().script_chunks - chunks_before,
        40,
        "every script sent"
    );
    assert_eq!(s.e.stats().scripts_committed, 8);
    s.note("a launched command's upload ends with its running event");
    let last = dispatches.last().unwrap();
    s.event(1, &last.issue_uuid, 1, running_body());
    s.note("the client refuses an upload for a command it does not hold; it ends");
    let other = &dispatches[20];
    s.send(
        1,
        Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
            issue_uuid: other.issue_uuid.clone(),
            received_bytes: 0,
            state: wire::ScriptUploadState::Rejected as i32,
            error: None,
        }),
    );
    assert_eq!(s.e.stats().scripts_refused, 1);
    // the summary only: forty chunk lines say nothing more
    let lines: Vec<String> = s
        .log
        .iter()
        .filter(|l| !l.contains("script_chunk") && !l.contains("<- dispatch"))
        .cloned()
        .collect();
    insta::assert_snapshot!(lines.join("\n"));
}

/// The client's snapshot record of dispatched `d` at revision 1: in
/// `lifecycle`, `seq` events assigned and acknowledged, `script` bytes held.
fn held(
    d: &wire::Dispatch,
    lifecycle: wire::Lifecycle,
    seq: u64,
    script: u64,
) -> wire::SnapshotRecord {
    wire::SnapshotRecord {
        issue_uuid: d.issue_uuid.clone(),
        request_hash: d.request_hash.clone(),
        revision: 1,
        lifecycle: lifecycle as i32,
        last_assigned_event_seq: seq,
        acked_event_seq: seq,
        script_received_bytes: script,
    }
}

#[test]
fn under_load_the_ingress_gate_holds_output_and_a_client_past_its_window_closes_unacknowledged() {
    let mut s = Script::new();
    // small watermarks stand for the 64 MiB / 32 MiB of a real server
    s.e.set_ingress_watermarks(64 * 1024, 32 * 1024).unwrap();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let (_, issue) = s.running_command(1);
    s.note("the store stops completing: admitted output piles up to the high watermark");
    s.e.set_deferred(true);
    let noise: Vec<u8> = (0..600u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut seq = 2;
    while s.e.ingress().1 {
        s.event(1, &issue, seq, output_body(&noise));
        seq += 1;
        assert!(seq < 1_000, "the gate never closed");
    }
    let admitted = s.e.ingress().0;
    assert!(admitted > 64 * 1024, "closed above high: {admitted}");
    s.note("the gate is closed: new output is held, nothing admitted, nothing acknowledged");
    for _ in 0..10 {
        s.event(1, &issue, seq, output_body(&noise));
        seq += 1;
    }
    assert_eq!(s.e.ingress().0, admitted, "held output is not admitted");
    s.note("the store catches up: below low the gate opens and the held output is admitted");
    s.e.run_until_idle(s.now, s.wall);
    s.drain();
    assert!(s.e.ingress().1, "the gate opened again");
    assert!(
        s.log
            .iter()
            .any(|l| l.contains(&format!("event_ack {} #{}", short(&issue), seq - 1))),
        "every held event was admitted and acknowledged once durable:\n{}",
        s.trace()
    );
    s.note("closed again: a client within its windows is held, never closed, however many short events it sends");
    let acks_before = s.log.iter().filter(|l| l.contains("event_ack")).count();
    while s.e.ingress().1 {
        s.event(1, &issue, seq, output_body(&noise));
        seq += 1;
    }
    // more than the 1,024 a session once held: a replay of short events
    // after a long partition
    for _ in 0..2_000 {
        s.event(1, &issue, seq, output_body(&[seq as u8; 16]));
        seq += 1;
    }
    assert!(
        !s.log.iter().any(|l| l.contains("close CLOSE_REASON")),
        "{}",
        s.trace()
    );
    assert_eq!(
        s.log.iter().filter(|l| l.contains("event_ack")).count(),
        acks_before,
        "nothing held is acknowledged while the gate is closed"
    );
    s.note("a client that sends past its window is closed without an ack");
    let mut closed = false;
    for _ in 0..100_000 {
        s.event(1, &issue, seq, output_body(&noise));
        seq += 1;
        if s.log
            .last()
            .is_some_and(|l| l.contains(" close CLOSE_REASON_"))
        {
            closed = true;
            break;
        }
    }
    assert!(closed, "{}", s.trace());
    assert!(
        s.log
            .last()
            .is_some_and(|l| l.contains("close CLOSE_REASON_PROTOCOL_ERROR")),
        "{}",
        s.trace()
    );
    assert_eq!(
        s.log.iter().filter(|l| l.contains("event_ack")).count(),
        acks_before,
        "nothing of the refused session was acknowledged"
    );
}

#[test]
fn a_client_that_never_reads_fills_its_lanes_and_is_closed_while_another_is_served() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let (_, issue) = s.running_command(1);
    s.note("web-1 stops reading but keeps streaming: its acks wait in its control lane");
    s.never_reads(1);
    let mut seq = 2;
    let handed_before = s.log.len();
    loop {
        s.event(1, &issue, seq, output_body(&[seq as u8; 64]));
        seq += 1;
        if s.log.last().is_some_and(|l| l.contains("c1 <- close")) || seq > 2_000 {
            break;
        }
    }
    let handed = s.log[handed_before..]
        .iter()
        .filter(|l| l.contains("c1 <- event_ack"))
        .count();
    assert!(
        handed <= rvbox_server_core::WRITER_WINDOW,
        "the writer was never given more than its window: {handed}"
    );
    assert!(
        s.log
            .last()
            .is_some_and(|l| l.contains("c1 <- close CLOSE_REASON_INTERNAL_ERROR")),
        "a full control lane closes the session: {}",
        s.log.last().unwrap()
    );
    assert!(
        seq - 2 > rvbox_session::CONTROL_LANE_CAPACITY as u64,
        "the lane held {} acks before it was full",
        seq - 2
    );
    assert_eq!(s.e.stats().control_lane_full, 1);
    s.note("web-2, whose writer keeps up, is served as usual");
    s.hello_as(2, "web-2", B);
    s.reconcile(2, vec![], 0);
    let other = s.run_command_for("web-2");
    s.advance(1);
    assert_eq!(s.lifecycle(&other), Lifecycle::Dispatched);
}

#[test]
fn a_running_event_sent_right_after_the_acceptance_waits_for_the_acceptance_to_commit() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    let id = s.run_command();
    s.advance(1);
    let d = s.dispatched.last().unwrap().clone();
    s.note("the store answers late: the acceptance and the running event arrive back to back");
    s.e.set_deferred(true);
    s.accept(1, &d, wire::AcceptOutcome::Positive);
    let issue = rvbox_sim::rng::uuid_text(&id);
    s.event(1, &issue, 1, running_body());
    s.e.run_until_idle(s.now, s.wall);
    s.drain();
    assert!(
        !s.log.iter().any(|l| l.contains("close")),
        "the event was ordered after the acceptance:\n{}",
        s.trace()
    );
    assert!(
        s.log
            .iter()
            .any(|l| l.contains(&format!("event_ack {} #1", short(&issue))))
    );
    assert_eq!(s.lifecycle(&id), Lifecycle::Running);
}

#[test]
fn a_signal_refused_by_a_full_data_lane_is_sent_once_the_writer_frees_room() {
    let mut s = Script::new();
    s.hello(1, A);
    s.reconcile(1, vec![], 0);
    s.send(
        1,
        Payload::ClientCapacity(wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 90,
            max_queued: 0,
        }),
    );
    s.note("the client stops reading; 90 script commands fill its data lane");
    s.never_reads(1);
    let mut ids = Vec::new();
    for i in 0..90u8 {
        let id = s.ids.uuid_v7(u64::try_from(s.wall).unwrap());
        s.e.run_command(&script_request(&id, &vec![i; 4_096]), s.wall)
            .unwrap();
        ids.push(id);
    }
    s.advance(1);
    let dispatches: Vec<wire::Dispatch> = s.dispatched.clone();
    assert_eq!(
        dispatches.len(),
        rvbox_server_core::WRITER_WINDOW,
        "the writer took its credit; the rest wait in the lane"
    );
    for d in &dispatches {
        s.accept(1, d, wire::AcceptOutcome::Positive);
    }
    assert!(
        s.e.stats().data_lane_waits > 0,
        "the data lane filled: {:?}",
        s.e.stats()
    );
    s.note("the operator kills an accepted command: its signal finds no room");
    let signals_before = s.log.iter().filter(|l| l.contains("c1 <- signal")).count();
    let target = rvbox_domain::ids::Uuid7::parse("issue_uuid", &dispatches[0].issue_uuid).unwrap();
    let target = *target.as_bytes();
    let (lifecycle, revision, _) = s.signal(&target, wire::SignalKind::Kill);
    assert_eq!((lifecycle, revision), (Lifecycle::Accepted, 2));
    assert_eq!(
        s.log.iter().filter(|l| l.contains("c1 <- signal")).count(),
        signals_before,
        "nothing handed out while the lane is full"
    );
    assert_eq!(
        s.e.store().pending_signals(&target).unwrap().len(),
        1,
        "the signal is durable meanwhile"
    );
    s.note("the client reads again: as the lanes drain, the signal is sent");
    if let Some(slow) = s.slow.as_mut() {
        slow.remove(&1);
    }
    let mut rounds = 0;
    while !s.log.iter().any(|l| l.contains("c1 <- signal")) && rounds < 1_000 {
        s.e.written(s.now, s.wall, 1);
        s.drain();
        rounds += 1;
    }
    let sent: Vec<&String> = s
        .log
        .iter()
        .filter(|l| l.contains("c1 <- signal"))
        .collect();
    assert_eq!(sent.len(), 1, "sent exactly once: {sent:?}");
    assert!(sent[0].contains("SIGNAL_KIND_KILL"), "{}", sent[0]);
}
