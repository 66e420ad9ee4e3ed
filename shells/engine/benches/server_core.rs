//! Durable events per second through the whole server path: the pure
//! server core, the store executor on its own thread and the real store on
//! the real disk, with 64 and 1,000 simulated connections, each streaming
//! 1 KiB or 64 KiB output events for one command with 8 events in flight
//! (acknowledged cumulatively). Every figure is also given as a ratio to a
//! raw `fdatasync` probe of the same size run right before and after it,
//! and the store-only group commit is measured beside it in the same round.
//! During the 1 KiB runs a client sends a WebSocket Ping every 2 ms; the
//! time until the core hands out its Pong is the control-lane latency.
//!
//! Run: `scripts/bench` (or `cargo bench -p rvbox-engine --bench server_core`).
//! `RVBOX_BENCH_ROUNDS` (default 3) sets the number of rounds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use prost::Message as _;
use rvbox_dispatch::RetryPolicy;
use rvbox_domain::ids::Uuid7;
use rvbox_engine::ExecutorThread;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_server_core::{ControlCall, Input, Output, RequestId, ServerCore};
use rvbox_session::{ServerIdentity, SessionConfig};
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store_port::ops::{OpResult, OpToken};

#[path = "../../store/benches/common/mod.rs"]
mod common;

use common::{noise, now_ms, open, probe};

/// Events each client keeps sent and unacknowledged.
const IN_FLIGHT: u64 = 8;
/// A ping every this often during the 1 KiB runs.
const PING_EVERY: Duration = Duration::from_millis(2);

fn envelope(session: &(String, u64), p: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: session.0.clone(),
        generation: session.1,
        payload: Some(p),
    }
    .encode_to_vec()
}

fn hello(client: &str) -> Vec<u8> {
    let instance = uuid::Uuid::from_bytes({
        let mut b = uuid_v7(&OsEntropy, now_ms()).unwrap();
        b[6] = (b[6] & 0x0f) | 0x40;
        b
    });
    wire::Envelope {
        session_id: String::new(),
        generation: 0,
        payload: Some(Payload::ClientHello(wire::ClientHello {
            client_id: client.into(),
            client_instance_id: instance.hyphenated().to_string(),
            protocol_major: 1,
            supported_minors: vec![0],
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
        })),
    }
    .encode_to_vec()
}

/// One simulated connection: one client streaming one command's output.
#[derive(Debug, Default)]
struct Client {
    session: Option<(String, u64)>,
    issue: Option<String>,
    next_seq: u64,
    acked: u64,
    last_seq: u64,
    done: bool,
}

struct Run {
    events: u64,
    seconds: f64,
    pings: Vec<Duration>,
    groups: (u64, u64),
}

fn event(c: &Client, seq: u64, body: wire::command_event::Body) -> Vec<u8> {
    envelope(
        c.session.as_ref().unwrap(),
        Payload::CommandEvent(wire::CommandEvent {
            issue_uuid: c.issue.clone().unwrap(),
            event_seq: seq,
            observed_time: None,
            body: Some(body),
        }),
    )
}

/// Streams `per_conn` output events of `payload` from each of `conns`
/// connections through the core, the executor thread and the store.
fn run(conns: u64, payload: &(u32, Vec<u8>), per_conn: u64, pings: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let server_id = Uuid7::from_bytes("server_id", store.server_id()).unwrap();
    let config = SessionConfig::new(ServerIdentity {
        server_id,
        software_version: "0.1.0".into(),
        supported_minors: vec![0],
    });
    let mut core = ServerCore::new(Arc::new(OsEntropy), config, RetryPolicy::default());
    let (done_tx, done_rx) = mpsc::sync_channel::<Vec<(OpToken, OpResult)>>(4096);
    let exec = ExecutorThread::spawn(store, done_tx).unwrap();
    let epoch = Instant::now();
    let mono = |at: Instant| u64::try_from(at.duration_since(epoch).as_millis()).unwrap();
    let mut clients: BTreeMap<u64, Client> = BTreeMap::new();
    let mut inbox: VecDeque<Input> = VecDeque::new();
    for conn in 1..=conns {
        clients.insert(conn, Client::default());
        inbox.push_back(Input::Connected { conn });
        inbox.push_back(Input::Frame {
            conn,
            bytes: hello(&format!("bench-{conn}")),
        });
        let id = uuid_v7(&OsEntropy, now_ms()).unwrap();
        inbox.push_back(Input::Control {
            request: RequestId(conn),
            caller: rvbox_server_core::Caller::local(),
            call: ControlCall::RunCommand(wire::RunCommandRequest {
                request_id: uuid::Uuid::from_bytes(id).hyphenated().to_string(),
                client_id: format!("bench-{conn}"),
                spec: Some(wire::ExecutionSpec {
                    source: Some(wire::execution_spec::Source::CommandText("bench".into())),
                    ..Default::default()
                }),
                script: Vec::new(),
                queue_ttl: None,
            }),
        });
    }
    let output = wire::command_event::Body::Output(wire::OutputChunk {
        stream: wire::OutputStream::Stdout as i32,
        raw_length: payload.0,
        stored_length: u32::try_from(payload.1.len()).unwrap(),
        payload: payload.1.clone(),
    });
    let mut finished = 0u64;
    let mut running = 0u64;
    let mut stream_start: Option<Instant> = None;
    let mut ping_sent: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut next_ping = Instant::now();
    let mut ping_conn = 1u64;
    let mut latencies = Vec::new();
    let mut ops_out = Vec::new();
    let mut last_timeout = Instant::now();
    while finished < conns {
        // completions first: they are what the connections wait for
        let mut inputs: Vec<Input> = Vec::new();
        while let Ok(done) = done_rx.try_recv() {
            inputs.extend(
                done.into_iter()
                    .map(|(token, result)| Input::Completion { token, result }),
            );
        }
        // then the connections' frames, a bounded turn at a time
        for _ in 0..256 {
            let Some(i) = inbox.pop_front() else { break };
            inputs.push(i);
        }
        if pings && stream_start.is_some() && Instant::now() >= next_ping {
            next_ping += PING_EVERY;
            ping_conn = ping_conn % conns + 1;
            if ping_sent.insert(ping_conn, Instant::now()).is_none() {
                inbox.push_back(Input::Ping { conn: ping_conn });
            }
        }
        // the one timer: the core's next deadline (a group's batching
        // delay among them), and at least every 100 ms
        let deadline = core.poll_timeout();
        let due = deadline.is_some_and(|t| t <= mono(Instant::now()));
        if due || last_timeout.elapsed() >= Duration::from_millis(100) {
            last_timeout = Instant::now();
            inputs.push(Input::Timeout);
        }
        if inputs.is_empty() {
            // nothing to do until the executor answers or the timer fires
            let wait = deadline.map_or(50, |t| t.saturating_sub(mono(Instant::now())).clamp(1, 50));
            match done_rx.recv_timeout(Duration::from_millis(wait)) {
                Ok(done) => inputs.extend(
                    done.into_iter()
                        .map(|(token, result)| Input::Completion { token, result }),
                ),
                Err(_) => continue,
            }
        }
        for input in inputs {
            let now = Instant::now();
            core.handle(mono(now), now_ms(), input);
            let mut written = Vec::new();
            while let Some(o) = core.poll_output() {
                match o {
                    Output::Store { token, wall_ms, op } => ops_out.push((token, wall_ms, op)),
                    Output::Pong { conn } => {
                        written.push(conn);
                        if let Some(at) = ping_sent.remove(&conn) {
                            latencies.push(at.elapsed());
                        }
                    }
                    Output::Ping { conn } => {
                        written.push(conn);
                        inbox.push_back(Input::Pong { conn });
                    }
                    Output::Frame { conn, bytes, .. } => {
                        written.push(conn);
                        let env = wire::Envelope::decode(bytes.as_slice()).unwrap();
                        let c = clients.get_mut(&conn).unwrap();
                        match env.payload.unwrap() {
                            Payload::ServerWelcome(w) => {
                                c.session = Some((w.session_id, w.generation));
                            }
                            Payload::ReconcileRequest(r) => {
                                let s = c.session.as_ref().unwrap();
                                inbox.push_back(Input::Frame {
                                    conn,
                                    bytes: envelope(
                                        s,
                                        Payload::ClientSnapshot(wire::ClientSnapshot {
                                            round: r.round,
                                            chunk_index: 0,
                                            final_chunk: true,
                                            store_health: wire::ScopeState::Ready as i32,
                                            records: vec![],
                                            tombstones: vec![],
                                        }),
                                    ),
                                });
                            }
                            Payload::ReconcileResult(_) => {
                                let s = c.session.as_ref().unwrap();
                                inbox.push_back(Input::Frame {
                                    conn,
                                    bytes: envelope(
                                        s,
                                        Payload::ClientCapacity(wire::ClientCapacity {
                                            running: 0,
                                            queued: 0,
                                            max_running: 1,
                                            max_queued: 0,
                                        }),
                                    ),
                                });
                            }
                            Payload::Dispatch(d) => {
                                c.issue = Some(d.issue_uuid.clone());
                                let s = c.session.clone().unwrap();
                                inbox.push_back(Input::Frame {
                                    conn,
                                    bytes: envelope(
                                        &s,
                                        Payload::CommandAccepted(wire::CommandAccepted {
                                            issue_uuid: d.issue_uuid,
                                            revision: d.revision,
                                            outcome: wire::AcceptOutcome::Positive as i32,
                                            error: None,
                                            resolved_shell: wire::ShellType::Sh as i32,
                                        }),
                                    ),
                                });
                                let running =
                                    wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                                        lifecycle: wire::Lifecycle::Running as i32,
                                        revision: d.revision,
                                        exit_result: None,
                                        reason: String::new(),
                                    });
                                inbox.push_back(Input::Frame {
                                    conn,
                                    bytes: event(c, 1, running),
                                });
                                c.next_seq = 2;
                                c.last_seq = 1 + per_conn;
                            }
                            Payload::EventAck(a) => {
                                if c.acked == 0 {
                                    running += 1;
                                }
                                c.acked = c.acked.max(a.durable_event_seq);
                                if c.acked >= c.last_seq && !c.done {
                                    c.done = true;
                                    finished += 1;
                                }
                            }
                            Payload::ControlError(e) => panic!("control error: {e:?}"),
                            _ => {}
                        }
                        // every client streams within its window once all
                        // are running (the clock starts then)
                        if stream_start.is_none() && running == conns {
                            stream_start = Some(Instant::now());
                            for (conn, c) in clients.iter_mut() {
                                refill(*conn, c, &output, &mut inbox);
                            }
                        } else if stream_start.is_some() {
                            refill(conn, c, &output, &mut inbox);
                        }
                    }
                    Output::Close { conn, reason } => {
                        panic!("connection {conn} closed: {}", reason.as_str_name())
                    }
                    Output::Reply { .. } | Output::Audit { .. } | Output::Metric(_) => {}
                }
            }
            for conn in written {
                core.handle(mono(Instant::now()), now_ms(), Input::Written { conn });
                while let Some(o) = core.poll_output() {
                    if let Output::Store { token, wall_ms, op } = o {
                        ops_out.push((token, wall_ms, op));
                    }
                }
            }
            if !ops_out.is_empty() {
                exec.submit(std::mem::take(&mut ops_out)).unwrap();
            }
        }
    }
    let seconds = stream_start.unwrap().elapsed().as_secs_f64();
    let exec = exec.stop().unwrap();
    Run {
        events: conns * per_conn,
        seconds,
        pings: latencies,
        groups: exec.group_stats(),
    }
}

/// Sends the client's next events while its window has room.
fn refill(
    conn: u64,
    c: &mut Client,
    output: &wire::command_event::Body,
    inbox: &mut VecDeque<Input>,
) {
    if c.issue.is_none() || c.acked == 0 {
        return;
    }
    while c.next_seq <= c.last_seq && c.next_seq <= c.acked + IN_FLIGHT {
        let seq = c.next_seq;
        c.next_seq += 1;
        inbox.push_back(Input::Frame {
            conn,
            bytes: event(c, seq, output.clone()),
        });
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn main() {
    let rounds: u32 = std::env::var("RVBOX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let probe_dir = tempfile::tempdir().unwrap();
    println!(
        "durable events per second through the server core, the executor thread and the store"
    );
    println!(
        "each connection streams one command's output with {IN_FLIGHT} events in flight; probe = raw append+fdatasync of the same size, before and after\n"
    );
    println!(
        "{:<6} {:>6} {:>8} {:>10} {:>8} {:>9} {:>11} {:>9} {:>9} {:>9}",
        "size",
        "conns",
        "events",
        "events/s",
        "MB/s",
        "probe/s",
        "events/probe",
        "ev/group",
        "ping p50",
        "ping p99"
    );
    for (label, size, per_conn_64, per_conn_1000) in [
        ("1KiB", 1024usize, 400u64, 40u64),
        ("64KiB", 64 * 1024, 24, 4),
    ] {
        let raw = noise(size as u64, size);
        let payload = (
            u32::try_from(size).unwrap(),
            zstd::bulk::compress(&raw, 1).unwrap(),
        );
        let mut ratios: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for _ in 0..rounds {
            for (conns, per_conn) in [(64u64, per_conn_64), (1000, per_conn_1000)] {
                let p0 = probe(probe_dir.path(), size, Duration::from_millis(500));
                let r = run(conns, &payload, per_conn, size == 1024);
                let p1 = probe(probe_dir.path(), size, Duration::from_millis(500));
                let p = (p0 + p1) / 2.0;
                let rate = r.events as f64 / r.seconds;
                let mbs = rate * size as f64 / 1e6;
                let mut pings = r.pings.clone();
                pings.sort();
                // durable commits: events (and running events) per group
                let per_group = (r.events + conns) as f64 / r.groups.0.max(1) as f64;
                println!(
                    "{label:<6} {conns:>6} {:>8} {rate:>10.0} {mbs:>8.1} {p:>9.0} {:>11.2}x {per_group:>9.1} {:>9} {:>9}",
                    r.events,
                    rate / p,
                    if pings.is_empty() {
                        "-".to_owned()
                    } else {
                        format!("{:.2}ms", percentile(&pings, 0.5).as_secs_f64() * 1e3)
                    },
                    if pings.is_empty() {
                        "-".to_owned()
                    } else {
                        format!("{:.2}ms", percentile(&pings, 0.99).as_secs_f64() * 1e3)
                    },
                );
                ratios.entry(conns).or_default().push(rate / p);
            }
        }
        for (conns, mut r) in ratios {
            r.sort_by(f64::total_cmp);
            println!(
                "{label:<6} {conns:>6} connections: durable events per probe sync, median {:.2}x (min {:.2}x, max {:.2}x)",
                r[r.len() / 2],
                r[0],
                r[r.len() - 1]
            );
        }
        println!();
    }
}
