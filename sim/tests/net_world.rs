//! Several simulated clients over the faulty network against a minimal
//! in-test server (immediate durability, the §6.4 matrix, idempotent
//! redispatch): every command finishes exactly once and every
//! acknowledged event matches what the server stored, through loss,
//! break-after-delivery, delay, stalls, a silent partition and crashes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;

use prost::Message as _;
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::ClientId;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_sim::host::{ClientConfig, ClientEffect, ClientInput, SimHost};
use rvbox_sim::invariants::content_digest;
use rvbox_sim::net::{
    ClientSlot, ConnId, Delivery, Dir, Item, Net, NetConfig, NetCounters, NetEvent, Side,
};
use rvbox_sim::rng::{Seeds, SimRng};
use rvbox_sim::supervisor::{Ended, Programs, SharedLog};

#[derive(Debug, Default)]
struct Cmd {
    client: u32,
    hash: Vec<u8>,
    spec: wire::ExecutionSpec,
    durable: u64,
    terminal: bool,
    accepted: bool,
    digests: BTreeMap<u64, [u8; 32]>,
}

#[derive(Debug, Default)]
struct Sess {
    client: u32,
    sid: String,
    generation: u64,
    ready: bool,
    round: u64,
    chunks: Vec<wire::ClientSnapshot>,
}

#[derive(Debug, Default)]
struct Mini {
    sessions: BTreeMap<ConnId, Sess>,
    live: BTreeMap<u32, ConnId>,
    gens: BTreeMap<u32, u64>,
    cmds: BTreeMap<String, Cmd>,
    fenced: u64,
}

impl Mini {
    fn send(net: &mut Net, conn: ConnId, sess: &Sess, payload: Payload, now: u64) {
        let env = wire::Envelope {
            session_id: sess.sid.clone(),
            generation: sess.generation,
            payload: Some(payload),
        };
        let _ = net.send(conn, Dir::ToClient, Item::Binary(env.encode_to_vec()), now);
    }

    fn close(&mut self, net: &mut Net, conn: ConnId, code: u16, now: u64) {
        let _ = net.send(conn, Dir::ToClient, Item::Close { code }, now);
        self.drop_session(conn);
    }

    fn drop_session(&mut self, conn: ConnId) {
        if let Some(s) = self.sessions.remove(&conn)
            && self.live.get(&s.client) == Some(&conn)
        {
            self.live.remove(&s.client);
        }
    }

    fn dispatch_pending(&mut self, net: &mut Net, client: u32, now: u64) {
        let Some(conn) = self.live.get(&client).copied() else {
            return;
        };
        let Some(sess) = self.sessions.get(&conn) else {
            return;
        };
        if !sess.ready {
            return;
        }
        for (id, c) in &self.cmds {
            if c.client == client && !c.accepted && !c.terminal {
                Self::send(
                    net,
                    conn,
                    sess,
                    Payload::Dispatch(wire::Dispatch {
                        issue_uuid: id.clone(),
                        generation: sess.generation,
                        revision: 1,
                        request_hash: c.hash.clone(),
                        spec: Some(c.spec.clone()),
                        queue_expiry_time: None,
                    }),
                    now,
                );
            }
        }
    }

    fn on(&mut self, net: &mut Net, now: u64, d: Delivery) {
        let conn = d.conn;
        match d.event {
            NetEvent::Opened => {
                self.sessions.insert(
                    conn,
                    Sess {
                        client: d.client.0,
                        ..Sess::default()
                    },
                );
            }
            NetEvent::Closed { .. } | NetEvent::Item(Item::Close { .. }) => {
                self.drop_session(conn);
            }
            NetEvent::Item(Item::Ping) => {
                let _ = net.send(conn, Dir::ToClient, Item::Pong, now);
            }
            NetEvent::Item(Item::Pong) => {}
            NetEvent::Item(Item::Binary(bytes)) => self.on_frame(net, now, conn, &bytes),
        }
    }

    fn on_frame(&mut self, net: &mut Net, now: u64, conn: ConnId, bytes: &[u8]) {
        let Some(sess) = self.sessions.get(&conn) else {
            return;
        };
        let env = wire::Envelope::decode(bytes).expect("honest clients send valid envelopes");
        let payload = env.payload.expect("payload");
        let client = sess.client;
        if sess.generation == 0 {
            let Payload::ClientHello(_) = payload else {
                panic!("first message is not a hello")
            };
            let generation = self.gens.get(&client).copied().unwrap_or(0) + 1;
            self.gens.insert(client, generation);
            if let Some(old) = self.live.insert(client, conn) {
                self.fenced += 1;
                self.close(net, old, 4000, now);
                self.live.insert(client, conn);
            }
            let sess = self.sessions.get_mut(&conn).unwrap();
            sess.generation = generation;
            sess.sid = format!("sid-{client:04}-{generation:012}");
            sess.round = 1;
            let welcome = wire::ServerWelcome {
                protocol_major: 1,
                negotiated_minor: 0,
                session_id: sess.sid.clone(),
                generation,
                server_id: "01890a5d-ac96-774b-bcce-b302099a8057".into(),
                server_software_version: "0.1.0".into(),
                limits: None,
            };
            Self::send(net, conn, sess, Payload::ServerWelcome(welcome), now);
            let rows = self
                .cmds
                .iter()
                .filter(|(_, c)| c.client == client && !c.terminal)
                .map(|(id, c)| wire::ReconcileRow {
                    issue_uuid: id.clone(),
                    durable_event_seq: c.durable,
                    revision: 1,
                    request_hash: c.hash.clone(),
                    lifecycle: wire::Lifecycle::Dispatched as i32,
                })
                .collect();
            let sess = &self.sessions[&conn];
            Self::send(
                net,
                conn,
                sess,
                Payload::ReconcileRequest(wire::ReconcileRequest { round: 1, rows }),
                now,
            );
            return;
        }
        if env.session_id != sess.sid || env.generation != sess.generation {
            panic!("honest client sent stale session fields");
        }
        match payload {
            Payload::ClientSnapshot(chunk) => {
                let done = chunk.final_chunk;
                let sess = self.sessions.get_mut(&conn).unwrap();
                sess.chunks.push(chunk);
                if !done {
                    return;
                }
                let mut result = wire::ReconcileResult {
                    round: sess.round,
                    ..Default::default()
                };
                for rec in sess.chunks.iter().flat_map(|c| c.records.iter()) {
                    let terminal = Lifecycle::from_wire(rec.lifecycle).unwrap().is_terminal();
                    match self.cmds.get_mut(&rec.issue_uuid) {
                        Some(c) if !c.terminal => {
                            c.accepted = true;
                            result.resume.push(wire::ResumeRow {
                                issue_uuid: rec.issue_uuid.clone(),
                                revision: 1,
                                durable_event_seq: c.durable,
                                script_resume_offset: 0,
                            });
                        }
                        _ if terminal => result
                            .discard_local_terminal_issue_uuids
                            .push(rec.issue_uuid.clone()),
                        _ => result
                            .terminate_local_issue_uuids
                            .push(rec.issue_uuid.clone()),
                    }
                }
                result.result_digest = rvbox_segment::sha256(&result.encode_to_vec()).to_vec();
                sess.ready = true;
                let sess = &self.sessions[&conn];
                Self::send(net, conn, sess, Payload::ReconcileResult(result), now);
                self.dispatch_pending(net, client, now);
            }
            Payload::CommandAccepted(a) => {
                let c = self.cmds.get_mut(&a.issue_uuid).unwrap();
                match wire::AcceptOutcome::try_from(a.outcome).unwrap() {
                    wire::AcceptOutcome::Positive => c.accepted = true,
                    wire::AcceptOutcome::Transient => {}
                    other => panic!("unexpected {other:?}: {:?}", a.error),
                }
            }
            Payload::CommandEvent(e) => {
                assert!(self.sessions[&conn].ready, "event before the result");
                let digest = content_digest(&e).unwrap();
                let c = self.cmds.get_mut(&e.issue_uuid).unwrap();
                assert!(c.accepted, "event of an unaccepted command");
                if e.event_seq <= c.durable {
                    assert_eq!(c.digests[&e.event_seq], digest, "conflicting duplicate");
                } else {
                    assert_eq!(e.event_seq, c.durable + 1, "gap");
                    assert!(!c.terminal, "event after terminal");
                    c.digests.insert(e.event_seq, digest);
                    c.durable = e.event_seq;
                    if let Some(Body::Lifecycle(l)) = &e.body
                        && Lifecycle::from_wire(l.lifecycle).unwrap().is_terminal()
                    {
                        c.terminal = true;
                    }
                }
                let ack = wire::EventAck {
                    issue_uuid: e.issue_uuid.clone(),
                    durable_event_seq: c.durable,
                };
                let sess = &self.sessions[&conn];
                Self::send(net, conn, sess, Payload::EventAck(ack), now);
            }
            Payload::ClientCapacity(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

struct World {
    net: Net,
    server: Mini,
    clients: Vec<SimHost>,
    workload: SimRng,
    faults: SimRng,
    now: u64,
}

impl World {
    fn drain_clients(&mut self) {
        for _ in 0..1000 {
            let mut any = false;
            for (i, c) in self.clients.iter_mut().enumerate() {
                while let Some(e) = c.poll_effect() {
                    any = true;
                    match e {
                        ClientEffect::Connect => {
                            let slot = ClientSlot(u32::try_from(i).unwrap());
                            match self.net.connect(slot, self.now) {
                                Ok(conn) => c.handle(self.now, ClientInput::Connected(conn)),
                                Err(_) => c.handle(self.now, ClientInput::ConnectFailed),
                            }
                        }
                        ClientEffect::Send { conn, item } => {
                            let _ = self.net.send(conn, Dir::ToServer, item, self.now);
                        }
                    }
                }
            }
            if !any {
                return;
            }
        }
        panic!("clients never stop producing effects");
    }

    fn step(&mut self, until: u64) {
        let next = [
            self.net.next_due(),
            self.clients.iter().filter_map(SimHost::poll_timeout).min(),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(until)
        .min(until);
        self.now = self.now.max(next);
        for d in self.net.deliver_due(self.now) {
            match d.dir {
                Dir::ToServer => self.server.on(&mut self.net, self.now, d),
                Dir::ToClient => {
                    let c = &mut self.clients[d.client.0 as usize];
                    c.handle(
                        self.now,
                        ClientInput::Delivered {
                            conn: d.conn,
                            event: d.event,
                        },
                    );
                }
            }
        }
        for c in &mut self.clients {
            if c.poll_timeout().is_some_and(|t| t <= self.now) {
                c.handle_timeout(self.now);
            }
        }
        self.drain_clients();
    }

    fn new_command(&mut self, i: u32) {
        let text = format!("job-{}", self.workload.next_u32());
        let spec = wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(text)),
            ..Default::default()
        };
        let client_id = ClientId::parse("t", self.clients[i as usize].client_id()).unwrap();
        let id = self.workload.uuid_v7_text(1_800_000_000_000 + self.now);
        self.server.cmds.insert(
            id,
            Cmd {
                client: i,
                hash: command_hash(&client_id, &check_execution_spec(&spec).unwrap())
                    .0
                    .to_vec(),
                spec,
                ..Cmd::default()
            },
        );
        self.server.dispatch_pending(&mut self.net, i, self.now);
    }
}

fn run(seed: u64) -> (NetCounters, Vec<SimHost>, Mini, SharedLog) {
    let seeds = Seeds::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let log = SharedLog::default();
    let cfg = NetConfig {
        base_latency_ms: 3,
        jitter_ms: 20,
        delay_permille: 50,
        max_extra_delay_ms: 500,
        stall_permille: 10,
        max_stall_ms: 3_000,
        loss_permille: 4,
        dup_permille: 4,
    };
    let clients = (0..3)
        .map(|i| {
            let mut c = ClientConfig::new(format!("host-{i}"));
            c.max_running = 2;
            c.max_queued = 3;
            c.programs = Programs {
                max_chunks: 6,
                max_chunk: 8_000,
                max_step_ms: 3_000,
                fail_permille: 100,
                burst_permille: 0,
                max_burst: 256 * 1024,
                stdin_permille: 0,
                ignore_term_permille: 0,
                transient_launch_permille: 0,
                chatty_permille: 0,
                max_chatty_lines: 0,
                max_chatty_step_ms: 0,
            };
            SimHost::new(
                i,
                c,
                seeds.client(i),
                dir.path().join(format!("host-{i}")),
                log.clone(),
            )
            .unwrap()
        })
        .collect();
    let mut w = World {
        net: Net::new(seeds.network(), cfg),
        server: Mini::default(),
        clients,
        workload: seeds.workload(),
        faults: seeds.faults(),
        now: 0,
    };
    let mut created = 0;
    let mut partitioned = false;
    let mut crashes = 0;
    for _ in 0..2_000_000 {
        if w.now >= 5_000 * created && created < 60 {
            let i = u32::try_from(w.workload.below(3)).unwrap();
            w.new_command(i);
            created += 1;
        }
        if !partitioned && w.now >= 40_000 {
            partitioned = true;
            w.net.partition(ClientSlot(1), w.now + 45_000, w.now);
        }
        if crashes < 10 && w.now >= 20_000 + 17_000 * crashes {
            crashes += 1;
            let i = usize::try_from(w.faults.below(3)).unwrap();
            if let Some(conn) = w.clients[i].crash_restart(w.now) {
                w.net.crash(conn, Side::Client, w.now);
            }
            w.drain_clients();
        }
        let done = created >= 60 && w.server.cmds.values().all(|c| c.terminal);
        if done || w.now > 3_600_000 {
            break;
        }
        let until = (5_000 * created).max(w.now + 1);
        w.step(until);
    }
    let out = (*w.net.counters(), w.clients, w.server, log);
    drop(dir);
    out
}

#[test]
fn every_command_finishes_once_through_network_faults_and_crashes() {
    let (net, mut clients, server, log) = run(7);
    assert_eq!(server.cmds.len(), 60);
    let unfinished: Vec<_> = server
        .cmds
        .iter()
        .filter(|(_, c)| !c.terminal)
        .map(|(id, c)| (id.clone(), c.client, c.durable))
        .collect();
    assert!(unfinished.is_empty(), "{unfinished:?}");
    // faults happened, and every kind the run enabled was counted
    assert!(
        net.lost > 0 && net.dup_cuts > 0 && net.delayed > 0 && net.stalls > 0,
        "{net:?}"
    );
    assert!(
        net.crashes > 0 && net.partitions == 1 && net.reordered > 0,
        "{net:?}"
    );
    let mut starts: BTreeMap<String, u32> = BTreeMap::new();
    for c in &mut clients {
        assert_eq!(
            c.counters().server_violations,
            0,
            "{:?}",
            c.violation_notes()
        );
        for (id, n) in c.ledger().starts() {
            *starts.entry(id.to_string()).or_default() += n;
        }
        for (id, n) in c.ledger().accepted() {
            assert_eq!(*n, 1, "{id} accepted {n} times");
        }
        for ack in c.ledger_mut().take_new().acks {
            let cmd = &server.cmds[&ack.issue.to_string()];
            assert_eq!(cmd.digests[&ack.event_seq], ack.digest);
        }
    }
    assert!(starts.values().all(|n| *n <= 1), "{starts:?}");
    let reconnects: u64 = clients.iter().map(|c| c.counters().connects).sum();
    assert!(
        reconnects > 3,
        "faults should force reconnects: {reconnects}"
    );
    let sent: u64 = clients.iter().map(|c| c.counters().events_sent).sum();
    let distinct: usize = server.cmds.values().map(|c| c.digests.len()).sum();
    assert!(
        sent > distinct as u64,
        "no event was sent again ({sent} sent, {distinct} stored)"
    );
    let log = log.lock().unwrap();
    let interrupted = log
        .records()
        .values()
        .filter(|r| r.ended == Some(Ended::WithDaemon))
        .count();
    let ended: Vec<_> = log.records().values().map(|r| r.ended).collect();
    assert!(
        interrupted > 0,
        "no crash hit a running command: {ended:?} crashes {:?}",
        clients
            .iter()
            .map(|c| c.counters().crashes)
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_world_run_is_deterministic() {
    let (a, ca, sa, _) = run(99);
    let (b, cb, sb, _) = run(99);
    assert_eq!(a, b);
    for (x, y) in ca.iter().zip(&cb) {
        assert_eq!(x.counters(), y.counters());
        assert_eq!(x.ledger(), y.ledger());
    }
    let digests = |m: &Mini| {
        m.cmds
            .iter()
            .map(|(k, c)| (k.clone(), c.digests.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(digests(&sa), digests(&sb));
}
