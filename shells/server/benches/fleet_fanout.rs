//! Fan-out of one fleet run to N agent sessions: the real `rvbox-server`
//! binary, and a load tool in this process that holds N agent sessions
//! over real WebSockets on loopback (source addresses spread over
//! 127.0.0.0/8). Each session speaks the real protocol: hello, an empty
//! reconciliation, capacity, then for each `Dispatch` a positive
//! `CommandAccepted`, a simulated execution of 0-400 ms (RUNNING, one line
//! of output, the terminal event with its exit code), all acknowledged by
//! the server; a session the server closes registers again, as a daemon
//! would.
//!
//! For each N it times one `RunFleet` to every session, from the call to
//! the run being DONE (every target's terminal event durable), and prints
//! results per second, the server's peak RSS, the WebSocket Ping round
//! trip p99 seen by 32 probe sessions during the run, and the p99 of a
//! `GetCommand` issued every 20 ms during the run. For the largest N it
//! adds a run with `max_parallel = 10%` and one where every tenth session
//! fails its command, with `max_errors = 5%` (and `max_parallel = 10%`, so
//! that the stop leaves targets to skip).
//!
//! The disk of the machine these figures come from flips between fast and
//! slow flush modes every few seconds, so a thread beside each run times a
//! raw 4 KiB write + `fdatasync` in the server's data directory every
//! 50 ms; its median is printed, and the run's time as a count of those
//! flushes.
//!
//! Each run creates one segment file per target. On this machine's ext4
//! (no journal), creating files within minutes of a mass deletion is
//! several times slower (the allocator skips recently freed inodes), so
//! the data directories are removed only when the tool ends, and the
//! figures are taken at least five minutes after anything deleted many
//! files on that filesystem.
//!
//! `RVBOX_BENCH_FLEET` overrides the session counts (comma-separated;
//! default 1000,10000,19000: this machine caps one process near 20,000
//! file descriptors).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_precision_loss
)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use tokio::sync::Mutex;

#[path = "support/agent_client.rs"]
mod agent_client;
use agent_client::{http_ok, register_session, rss_kib};
#[path = "support/fleet_load.rs"]
mod fleet_load;
use fleet_load::{
    CLOSED, FAIL_TENTH, LAST_CLOSE, RECONNECTS, agent, control, fdatasync_probe, median, p99,
};

/// Sessions being registered at once.
const CONCURRENT: usize = 128;
/// Sessions that also measure the Ping round trip.
const PROBES: usize = 32;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_server(dir: &std::path::Path, port: u16, metrics: u16) -> Child {
    std::fs::write(
        dir.join("server.toml"),
        format!(
            "[server]\nagent_listen = \"127.0.0.1:{port}\"\n[storage]\ndata_dir = \"{d}/data\"\n[control]\nruntime_dir = \"{d}/run\"\nsocket_path = \"{d}/run/control.sock\"\n[observability]\nlog_level = \"warn\"\nmetrics_listen = \"127.0.0.1:{metrics}\"\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 20000 && exec \"$0\" --config \"$1\"")
        .arg(env!("CARGO_BIN_EXE_rvbox-server"))
        .arg(dir.join("server.toml"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    while !http_ok(metrics, "/readyz") {
        assert!(Instant::now() < until, "server not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

struct Outcome {
    elapsed: Duration,
    counts: wire::FleetCounts,
    ping_p99: f64,
    get_p99: f64,
    rss_peak_kib: u64,
    /// Median of the raw fdatasync probe during the run, in ms.
    probe_ms: f64,
}

/// One fleet run to every session, timed to DONE, with the probes.
async fn one_run(
    c: &mut ControlClient<tonic::transport::Channel>,
    data_dir: &std::path::Path,
    pid: u32,
    rtts: &Arc<Mutex<Vec<f64>>>,
    max_parallel: Option<u32>,
    max_errors: Option<u32>,
) -> Outcome {
    rtts.lock().await.clear();
    let id = uuid::Uuid::now_v7().hyphenated().to_string();
    let req = wire::RunFleetRequest {
        request_id: id.clone(),
        selection: Some(wire::FleetSelection {
            all: true,
            ..Default::default()
        }),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("echo ok".into())),
            ..Default::default()
        }),
        max_parallel: max_parallel.map(|p| wire::FleetLimit {
            limit: Some(wire::fleet_limit::Limit::Percent(p)),
        }),
        max_errors: max_errors.map(|p| wire::FleetLimit {
            limit: Some(wire::fleet_limit::Limit::Percent(p)),
        }),
        ..Default::default()
    };
    let done = Arc::new(AtomicBool::new(false));
    // GetCommand latency during the run, on a command of this run
    let getter = {
        let mut c2 = c.clone();
        let done = Arc::clone(&done);
        let run = id.clone();
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut issue = None;
            while !done.load(Ordering::Relaxed) {
                if issue.is_none() {
                    issue = c2
                        .list_fleet_targets(wire::ListFleetTargetsRequest {
                            fleet_run_id: run.clone(),
                            page_size: 1,
                            ..Default::default()
                        })
                        .await
                        .ok()
                        .and_then(|r| r.into_inner().targets.into_iter().next())
                        .map(|t| t.issue_uuid);
                }
                if let Some(issue) = &issue {
                    let t = Instant::now();
                    let ok = c2
                        .get_command(wire::GetCommandRequest {
                            request_id: String::new(),
                            issue_uuid: issue.clone(),
                        })
                        .await
                        .is_ok();
                    if ok {
                        lat.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            lat
        })
    };
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let done = Arc::clone(&done);
        let peak = Arc::clone(&peak);
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let probe = fdatasync_probe(data_dir.to_path_buf(), Arc::clone(&done));
    let started = Instant::now();
    c.run_fleet(req).await.unwrap();
    let record = loop {
        let r = c
            .get_fleet_run(wire::GetFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        if r.state == wire::FleetRunState::Done as i32 {
            break r;
        }
        if started.elapsed() > Duration::from_secs(180) {
            eprintln!("the run did not end in 180 s: {r:?}");
            break r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let elapsed = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let lat = getter.await.unwrap();
    sampler.await.unwrap();
    let ping = rtts.lock().await.clone();
    let probe_ms = median(probe.join().unwrap());
    Outcome {
        elapsed,
        counts: record.counts.unwrap(),
        ping_p99: p99(ping),
        get_p99: p99(lat),
        rss_peak_kib: peak.load(Ordering::Relaxed),
        probe_ms,
    }
}

fn main() {
    let counts: Vec<usize> = std::env::var("RVBOX_BENCH_FLEET")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000, 19_000]);
    let largest = counts.iter().copied().max().unwrap_or(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("One fleet run to N agent sessions (real rvbox-server, sessions on loopback)");
    println!(
        "{:>8} {:<22} {:>9} {:>10} {:>12} {:>9} {:>8} {:>8} {:>11} {:>13} {:>8} {:>10} {:>10}",
        "sessions",
        "run",
        "targets",
        "seconds",
        "results/s",
        "succeeded",
        "failed",
        "skipped",
        "ping p99 ms",
        "GetCommand p99",
        "RSS MiB",
        "fsync ms",
        "run/fsync"
    );
    // every data directory is removed only when the tool ends: on this
    // machine's ext4 (no journal) a mass deletion makes the file creations
    // of the next minutes several times slower, and each run creates one
    // segment file per target
    let mut kept = Vec::new();
    for &n in &counts {
        let dir = tempfile::tempdir().unwrap();
        let (port, metrics) = (free_port(), free_port());
        let mut server = start_server(dir.path(), port, metrics);
        let pid = server.id();
        let rtts = Arc::new(Mutex::new(Vec::new()));
        rt.block_on(async {
            // each session starts answering as soon as it is registered
            // (an unread session would miss the server's Pings)
            let mut tasks = Vec::with_capacity(n);
            let mut i = 0;
            while i < n {
                let batch: Vec<_> = (i..(i + CONCURRENT).min(n))
                    .map(|j| tokio::spawn(register_session(j, port)))
                    .collect();
                for (k, h) in batch.into_iter().enumerate() {
                    let j = i + k;
                    let first = h.await.unwrap();
                    let probe = j.is_multiple_of((n / PROBES).max(1)).then(|| Arc::clone(&rtts));
                    tasks.push(tokio::spawn(agent(j, port, first, probe)));
                }
                i += CONCURRENT;
            }
            let mut c = control(dir.path().join("run/control.sock")).await;
            let mut runs: Vec<(&str, Option<u32>, Option<u32>, bool)> =
                vec![("all at once", None, None, false)];
            if n == largest {
                runs.push(("max-parallel 10%", Some(10), None, false));
                runs.push(("10% fail, max-errors 5%", Some(10), Some(5), true));
            }
            for (name, parallel, errors, fail) in runs {
                FAIL_TENTH.store(fail, Ordering::Relaxed);
                let o = one_run(&mut c, &dir.path().join("data"), pid, &rtts, parallel, errors).await;
                let total = o.counts.succeeded + o.counts.failed + o.counts.skipped;
                let closed = CLOSED.swap(0, Ordering::Relaxed);
                if closed > 0 {
                    eprintln!(
                        "{closed} agent sessions closed by the server ({} registered again); the last: {}",
                        RECONNECTS.swap(0, Ordering::Relaxed),
                        LAST_CLOSE.lock().map(|l| l.clone()).unwrap_or_default()
                    );
                }
                println!(
                    "{:>8} {:<22} {:>9} {:>10.2} {:>12.0} {:>9} {:>8} {:>8} {:>11.1} {:>13.1} {:>8.0} {:>10.2} {:>10.0}",
                    n,
                    name,
                    total,
                    o.elapsed.as_secs_f64(),
                    f64::from(o.counts.succeeded + o.counts.failed) / o.elapsed.as_secs_f64(),
                    o.counts.succeeded,
                    o.counts.failed,
                    o.counts.skipped,
                    o.ping_p99,
                    o.get_p99,
                    o.rss_peak_kib as f64 / 1024.0,
                    o.probe_ms,
                    o.elapsed.as_secs_f64() * 1e3 / o.probe_ms
                );
            }
            for t in tasks {
                t.abort();
            }
        });
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
        let _ = server.wait();
        // what the server warned about, once per message
        let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
        let mut seen = std::collections::BTreeMap::<String, u32>::new();
        for line in log.lines() {
            let key: String = line
                .split_whitespace()
                .skip(1)
                .take(8)
                .collect::<Vec<_>>()
                .join(" ");
            *seen.entry(key).or_default() += 1;
        }
        for (k, n) in seen.iter().take(20) {
            eprintln!("server log: {n} x {k}");
        }
        kept.push(dir);
    }
    drop(kept);
}
