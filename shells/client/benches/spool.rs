//! Client spool throughput and daemon memory (plan §7.2): a real `cat` of
//! a 64 MiB file runs under the client runtime (client core, client store
//! on this disk, Unix supervisor), a scripted server acknowledges every
//! event at once, and the bench prints
//!
//! - the spooled output rate (raw bytes kept per second), for compressible
//!   and for random data, as a ratio to `cat` of the same file into a pipe
//!   read by this process, measured in the same run;
//! - the same rate as a ratio to a raw append + `fdatasync` probe of 64 KiB
//!   records interleaved before and after (the spool syncs every chunk);
//! - bytes dropped into `CLIENT_OVERLOAD` markers (the child is never
//!   blocked, so a disk slower than the child drops output);
//! - the daemon's peak RSS growth over its idle RSS while the child writes
//!   flat out, against the 8 MiB raw-backlog bound.
//!
//! `RVBOX_BENCH_ROUNDS` sets the rounds (default 3).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;

use rvbox_client_core::machine::Input;

use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::hash::command_hash;

use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;
use rvbox_supervisor::UnixSupervisor;

#[path = "../tests/support/mod.rs"]
mod support;

use support::{SID, client_id, config};
const SIZE: usize = 64 << 20;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

fn probe_mb_s(dir: &Path) -> f64 {
    let path = dir.join("probe");
    let mut f = std::fs::File::create(&path).unwrap();
    let buf = vec![7u8; 64 * 1024];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_millis(500) {
        f.write_all(&buf).unwrap();
        f.sync_data().unwrap();
        n += buf.len() as u64;
    }
    let _ = std::fs::remove_file(&path);
    n as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn cat_mb_s(file: &Path) -> f64 {
    let start = Instant::now();
    let mut child = std::process::Command::new("cat")
        .arg(file)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut n = 0u64;
    loop {
        let k = out.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        n += k as u64;
    }
    child.wait().unwrap();
    n as f64 / start.elapsed().as_secs_f64() / 1e6
}

struct Run {
    kept: u64,
    dropped: u64,
    secs: f64,
    rss_growth_kib: u64,
}

fn feed(rt: &mut Runtime<UnixSupervisor>, p: Payload) {
    let env = wire::Envelope {
        session_id: SID.into(),
        generation: 1,
        payload: Some(p),
    };
    rt.input(Input::Frame(env.encode_to_vec()));
}

/// `cmds` commands each `cat` the file at once.
fn run_once(root: &Path, file: &Path, n: u32, cmds: u32) -> Run {
    let cwd = root.join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let cwd_s = cwd.to_str().unwrap().to_owned();
    let store = ClientStore::open(
        ClientLayout::new(root.join(format!("state-{n}"))),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        ClientStoreOptions::default(),
        0,
    )
    .unwrap();
    let run = root.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let sup = UnixSupervisor::new(support::supervisor_config(run)).unwrap();
    let mut cfg = config(&cwd_s);
    cfg.policy.max_running = cfg.policy.max_running.max(cmds);
    let mut rt = Runtime::new(cfg, store, sup, 1).unwrap();
    rt.input(Input::Opened);
    feed(
        &mut rt,
        Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation: 1,
            ..Default::default()
        }),
    );
    feed(
        &mut rt,
        Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![],
        }),
    );
    let mut r = wire::ReconcileResult {
        round: 1,
        ..Default::default()
    };
    r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
    feed(&mut rt, Payload::ReconcileResult(r));
    let _ = rt.take_wire();
    let issues: Vec<String> = (0..cmds)
        .map(|k| format!("01890a5d-ac96-774b-bcce-b3{k:04x}{n:06x}"))
        .collect();
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(format!(
            "cat '{}'",
            file.display()
        ))),
        ..Default::default()
    };
    let hash = command_hash(&client_id(), &check_execution_spec(&spec).unwrap());
    let idle = rss_kib();
    let mut peak = idle;
    let start = Instant::now();
    for issue in &issues {
        feed(
            &mut rt,
            Payload::Dispatch(wire::Dispatch {
                issue_uuid: issue.clone(),
                generation: 1,
                revision: 1,
                request_hash: hash.0.to_vec(),
                spec: Some(spec.clone()),
                queue_expiry_time: None,
            }),
        );
    }
    let (mut kept, mut dropped) = (0u64, 0u64);
    let mut ended = 0u32;
    while ended < cmds && start.elapsed() < Duration::from_secs(300) {
        rt.pump_processes(Duration::from_millis(5));
        rt.tick();
        let mut last: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
        for w in rt.take_wire() {
            let Wire::Binary(b) = w else { continue };
            let Ok(env) = wire::Envelope::decode(b.as_slice()) else {
                continue;
            };
            if let Some(Payload::CommandEvent(e)) = env.payload {
                let l = last.entry(e.issue_uuid.clone()).or_default();
                *l = (*l).max(e.event_seq);
                match e.body {
                    Some(Body::Output(o)) => kept += u64::from(o.raw_length),
                    Some(Body::Truncation(t)) => dropped += t.raw_bytes,
                    Some(Body::Lifecycle(l)) if l.lifecycle != wire::Lifecycle::Running as i32 => {
                        ended += 1;
                    }
                    _ => {}
                }
            }
        }
        for (issue, seq) in last {
            feed(
                &mut rt,
                Payload::EventAck(wire::EventAck {
                    issue_uuid: issue,
                    durable_event_seq: seq,
                }),
            );
        }
        peak = peak.max(rss_kib());
    }
    let secs = start.elapsed().as_secs_f64();
    Run {
        kept,
        dropped,
        secs,
        rss_growth_kib: peak.saturating_sub(idle),
    }
}

fn main() {
    let rounds: u32 = std::env::var("RVBOX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let text = dir.path().join("text");
    let random = dir.path().join("random");
    {
        let line =
            b"2026-12-01T17:00:00Z INFO request served path=/api/v1/items status=200 ms=12\n";
        let data: Vec<u8> = line.iter().copied().cycle().take(SIZE).collect();
        std::fs::write(&text, data).unwrap();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let data: Vec<u8> = (0..SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        std::fs::write(&random, data).unwrap();
    }
    println!(
        "client spool: a real `cat` of 64 MiB under the runtime, every event acknowledged at once"
    );
    println!(
        "{:<8} {:>9} {:>9} {:>9} {:>8} {:>9} {:>10} {:>9} {:>11}",
        "data", "kept MB", "drop MB", "spool/s", "cat/s", "ratio", "probe/s", "/probe", "RSS+ MiB"
    );
    let mut n = 0;
    for round in 0..rounds {
        for (name, file) in [("text", &text), ("random", &random)] {
            n += 1;
            let p0 = probe_mb_s(dir.path());
            let cat = cat_mb_s(file);
            let r = run_once(dir.path(), file, n, 1);
            let p1 = probe_mb_s(dir.path());
            let probe = (p0 + p1) / 2.0;
            let rate = r.kept as f64 / r.secs / 1e6;
            println!(
                "{:<8} {:>9.1} {:>9.1} {:>9.1} {:>8.0} {:>8.3}x {:>10.1} {:>8.2}x {:>11.1}",
                name,
                r.kept as f64 / 1e6,
                r.dropped as f64 / 1e6,
                rate,
                cat,
                rate / cat,
                probe,
                rate / probe,
                r.rss_growth_kib as f64 / 1024.0
            );
            let _ = round;
        }
    }
    // memory with many flat-out writers at once: the spool's 8 MiB daemon
    // backlog and the supervisor's hand-over bound hold whatever the count
    println!();
    println!(
        "{:<12} {:>9} {:>9} {:>11} {:>22}",
        "writers", "kept MB", "drop MB", "RSS+ MiB", "bound MiB (8 + hand-over)"
    );
    for cmds in [1u32, 8, 16] {
        n += 1;
        let r = run_once(dir.path(), &random, n, cmds);
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>11.1} {:>22.0}",
            format!("{cmds} x random"),
            r.kept as f64 / 1e6,
            r.dropped as f64 / 1e6,
            r.rss_growth_kib as f64 / 1024.0,
            8.0 + rvbox_supervisor::DEFAULT_HANDOVER_BYTES as f64 / 1_048_576.0
        );
    }
    println!(
        "RSS+ is the daemon's peak resident memory over its idle level while the children write; the raw backlog bound is 8 MiB"
    );
}
