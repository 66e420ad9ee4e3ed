//! Fan-out of one fleet run to N agent sessions on three deployments side
//! by side, in one run: one `rvbox-server` on SQLite, one replica on
//! PostgreSQL, and three replicas on one PostgreSQL database (a private
//! instance on loopback, one database per deployment and N). The real
//! binaries, and the simulated agent sessions of the fleet fan-out
//! benchmark (support/fleet_load.rs) in this process; with three
//! replicas, session i connects to replica i % 3 directly.
//!
//! For each deployment and N it times one `RunFleet` with `all`, submitted
//! on the first server's control socket, from the call until `GetFleetRun`
//! there shows the run DONE (polled every 10 ms; given up after 180 s),
//! and prints results per second and their ratio to SQLite's for the same
//! N. Beside each run a thread times a raw 4 KiB write + `fdatasync` every
//! 50 ms, in the SQLite server's data directory or in the PostgreSQL
//! instance's directory; its median is printed, and the run's time as a
//! count of those flushes (the disk flips between fast and slow flush
//! modes every few seconds).
//!
//! On stderr, for each deployment: when `RunFleet` answered and when the
//! sessions of each server received their dispatches and sent their
//! terminal events; how busy the machine was during the run and whose CPU
//! time it was (the servers, the `postgres` processes, this load tool,
//! anything else), with the five busiest server threads or `postgres`
//! processes; on PostgreSQL, the transactions committed in the database
//! and the instance's WAL flushes; sessions a server closed; and what
//! each server logged (warnings, errors, panics), before or at its stop.
//!
//! The servers' directories are removed only when the tool ends.
//! `RVBOX_BENCH_FLEET_REPLICAS` overrides the session counts
//! (comma-separated; default 1000,3000).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_precision_loss
)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rvbox_proto::v1 as wire;

#[path = "support/agent_client.rs"]
mod agent_client;
use agent_client::register_session;
#[path = "support/server.rs"]
mod server;
use server::start_server;
#[path = "support/fleet_load.rs"]
mod fleet_load;
use fleet_load::{
    CLOSED, LAST_CLOSE, RECONNECTS, RECORD_TIMELINE, TIMELINE, agent, control, fdatasync_probe,
    median,
};

/// Sessions being registered at once (over all of a deployment's servers).
const CONCURRENT: usize = 64;
/// The servers' file-descriptor limit.
const NOFILE: u32 = 20_000;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One deployment's servers: each with its agent port and directory.
struct Deployment {
    label: &'static str,
    servers: Vec<(Child, u16, PathBuf)>,
    /// Where the fdatasync probe runs.
    probe_dir: PathBuf,
    /// Its PostgreSQL database, if any.
    database: Option<String>,
}

/// CPU time so far, in clock ticks: the machine's busy time and all of
/// it, the deployment's servers, every `postgres` process, this load
/// tool, and each server thread and `postgres` process on its own.
#[derive(Clone, Default)]
struct Cpu {
    busy: u64,
    total: u64,
    servers: u64,
    postgres: u64,
    tool: u64,
    each: std::collections::BTreeMap<String, u64>,
}

/// User + system ticks of the process or thread at `dir` (under /proc)
/// and its command name.
fn proc_ticks(dir: &str) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{dir}/stat")).ok()?;
    let (head, rest) = stat.rsplit_once(") ")?;
    let comm = head.split_once(" (")?.1.to_owned();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // after the name: utime and stime are the 12th and 13th fields
    Some((
        comm,
        f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?,
    ))
}

fn cpu(servers: &[u32]) -> Cpu {
    let mut c = Cpu::default();
    if let Some(line) = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().next().map(str::to_owned))
    {
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        c.total = v.iter().take(8).sum();
        // less idle and iowait
        c.busy = c.total - v.get(3).copied().unwrap_or(0) - v.get(4).copied().unwrap_or(0);
    }
    c.tool = proc_ticks("self").map_or(0, |(_, t)| t);
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Some((comm, ticks)) = proc_ticks(&name) else {
            continue;
        };
        if comm == "postgres" {
            c.postgres += ticks;
            c.each.insert(format!("postgres process {name}"), ticks);
        } else if let Some(k) = servers.iter().position(|p| p.to_string() == name) {
            c.servers += ticks;
            for t in std::fs::read_dir(format!("/proc/{name}/task"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let tid = t.file_name().to_string_lossy().into_owned();
                if let Some((thread, ticks)) = proc_ticks(&format!("{name}/task/{tid}")) {
                    c.each
                        .insert(format!("server {k} thread {thread} ({tid})"), ticks);
                }
            }
        }
    }
    c
}

/// Clock ticks per second.
fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Transactions committed in `db` so far (reads included), and the WAL
/// flushes of the whole instance.
fn pg_counts(pg: &rvbox_testkit::Postgres, db: &str) -> (u64, u64) {
    let out = pg.psql(
        "postgres",
        &format!(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = '{db}') || ' ' || (SELECT wal_sync FROM pg_stat_wal)"
        ),
    );
    let mut v = out.split_whitespace().map(|x| x.parse().unwrap_or(0));
    (v.next().unwrap_or(0), v.next().unwrap_or(0))
}

struct Outcome {
    started: Instant,
    /// When `RunFleet` answered.
    answered: Duration,
    elapsed: Duration,
    record: Option<wire::FleetRunRecord>,
    done: bool,
    /// Median of the raw fdatasync probe during the run, in ms.
    probe_ms: f64,
}

/// Registers sessions `0..n`, session i on server i % servers, each
/// answering as soon as it is registered; returns their tasks.
async fn fill(ports: &[u16], n: usize) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::with_capacity(n);
    let mut i = 0;
    while i < n {
        let batch: Vec<_> = (i..(i + CONCURRENT).min(n))
            .map(|j| tokio::spawn(register_session(j, ports[j % ports.len()])))
            .collect();
        for (k, h) in batch.into_iter().enumerate() {
            let j = i + k;
            let first = h.await.unwrap();
            tasks.push(tokio::spawn(agent(j, ports[j % ports.len()], first, None)));
        }
        i += CONCURRENT;
    }
    tasks
}

/// One fleet run to every session, submitted on `socket`, timed to DONE.
async fn one_run(socket: PathBuf, probe_dir: &Path) -> Outcome {
    let mut c = control(socket).await;
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
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let probe = fdatasync_probe(probe_dir.to_path_buf(), Arc::clone(&stop));
    let started = Instant::now();
    let submitted = c.run_fleet(req).await;
    let answered = started.elapsed();
    let mut record = None;
    let mut done = false;
    match submitted {
        Err(e) => eprintln!("RunFleet failed: {e}"),
        Ok(_) => loop {
            match c
                .get_fleet_run(wire::GetFleetRunRequest {
                    request_id: String::new(),
                    fleet_run_id: id.clone(),
                })
                .await
            {
                Ok(r) => {
                    let r = r.into_inner().run.unwrap();
                    done = r.state == wire::FleetRunState::Done as i32;
                    record = Some(r);
                }
                Err(e) => eprintln!("GetFleetRun failed: {e}"),
            }
            if done {
                break;
            }
            if started.elapsed() > Duration::from_secs(180) {
                eprintln!("the run did not end in 180 s: {record:?}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        },
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let probe_ms = median(probe.join().unwrap());
    Outcome {
        started,
        answered,
        elapsed,
        record,
        done,
        probe_ms,
    }
}

/// When `RunFleet` answered, and when the sessions of each server received
/// their dispatch and sent their terminal event, in seconds from the
/// `RunFleet` call.
fn report_timeline(label: &str, o: &Outcome, servers: usize) {
    let timeline = std::mem::take(&mut *TIMELINE.lock().unwrap());
    eprintln!(
        "{label}: RunFleet answered {:.2} s",
        o.answered.as_secs_f64()
    );
    for r in 0..servers {
        let at = |terminal: bool| {
            let mut v: Vec<f64> = timeline
                .iter()
                .filter(|(i, _, t)| i % servers == r && *t == terminal)
                .map(|(_, when, _)| when.duration_since(o.started).as_secs_f64())
                .collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (dispatched, ended) = (at(false), at(true));
        let q = |v: &[f64], p: f64| {
            v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1)))
                .copied()
                .unwrap_or(f64::NAN)
        };
        eprintln!(
            "{label}: sessions of server {r}: {} dispatches received, first {:.2} s, median {:.2} s, last {:.2} s; last terminal event sent {:.2} s; run DONE seen {:.2} s",
            dispatched.len(),
            q(&dispatched, 0.0),
            q(&dispatched, 0.5),
            q(&dispatched, 1.0),
            q(&ended, 1.0),
            o.elapsed.as_secs_f64()
        );
    }
}

/// What a server logged (warnings, errors, panics and the project's
/// frames of their backtraces): each message once, with its count, its
/// first whole line, and whether it was written before the server was
/// asked to stop (`before_stop`: the log's length then) or after.
fn report_log(label: &str, log: &Path, before_stop: usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut seen: Vec<(String, u32, String, bool)> = Vec::new();
    let mut at = 0;
    for line in text.lines() {
        let early = at < before_stop;
        at += line.len() + 1;
        let t = line.trim_start();
        let frame = t.starts_with("at ")
            || t.split_once(": ")
                .is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()));
        // the project's frames near the top of the stack, where the cause is
        let top = t
            .split_once(": ")
            .and_then(|(n, _)| n.parse::<u32>().ok())
            .is_some_and(|n| n <= 25);
        let ours = top && t.contains("rvbox");
        let noise = t.starts_with("stack backtrace") || t.starts_with("note: Some details");
        if t.is_empty() || noise || (frame && !ours) {
            continue;
        }
        // the first eight words after the time stamp
        let key = t
            .split_whitespace()
            .skip(1)
            .take(8)
            .collect::<Vec<_>>()
            .join(" ");
        match seen.iter_mut().find(|(k, _, _, _)| *k == key) {
            Some(e) => e.1 += 1,
            None => seen.push((key, 1, t.chars().take(400).collect(), early)),
        }
    }
    for (_, count, first, early) in seen.iter().take(30) {
        let when = if *early {
            "before the stop"
        } else {
            "at the stop"
        };
        eprintln!("{label}: {} ({when}) {count} x {first}", log.display());
    }
}

/// Registers `n` sessions on `d`, times one fleet run, prints its row and
/// stops the servers; returns the results per second.
fn measure(
    rt: &tokio::runtime::Runtime,
    pg: &rvbox_testkit::Postgres,
    d: Deployment,
    n: usize,
    sqlite_rate: Option<f64>,
) -> f64 {
    let ports: Vec<u16> = d.servers.iter().map(|(_, p, _)| *p).collect();
    let pids: Vec<u32> = d.servers.iter().map(|(c, _, _)| c.id()).collect();
    let socket = d.servers[0].2.join("run/control.sock");
    let registering = Instant::now();
    let tasks = rt.block_on(fill(&ports, n));
    eprintln!(
        "{}: {n} sessions registered in {:.1} s",
        d.label,
        registering.elapsed().as_secs_f64()
    );
    let counts_before = d.database.as_deref().map(|db| pg_counts(pg, db));
    let before = cpu(&pids);
    TIMELINE.lock().unwrap().clear();
    RECORD_TIMELINE.store(true, Ordering::Relaxed);
    let o = rt.block_on(one_run(socket, &d.probe_dir));
    let after = cpu(&pids);
    RECORD_TIMELINE.store(false, Ordering::Relaxed);
    report_timeline(d.label, &o, ports.len());
    // the statistics reach pg_stat_database within a second
    let counts_during = counts_before.map(|(c, w)| {
        std::thread::sleep(Duration::from_millis(1_500));
        let (c2, w2) = pg_counts(pg, d.database.as_deref().unwrap_or_default());
        (c2.saturating_sub(c), w2.saturating_sub(w))
    });
    for t in tasks {
        t.abort();
    }
    let secs = o.elapsed.as_secs_f64();
    let hz = clock_ticks();
    let busy = after.busy - before.busy;
    let mut each: Vec<(&String, u64)> = after
        .each
        .iter()
        .map(|(k, t)| {
            (
                k,
                t.saturating_sub(before.each.get(k).copied().unwrap_or(0)),
            )
        })
        .collect();
    each.sort_by_key(|(_, t)| std::cmp::Reverse(*t));
    let top: Vec<String> = each
        .iter()
        .take(5)
        .map(|(k, t)| format!("{k} {:.0}%", *t as f64 * 100.0 / hz / secs))
        .collect();
    eprintln!(
        "{}: busiest during the run (share of the run's time): {}",
        d.label,
        top.join(", ")
    );
    let (servers, postgres, tool) = (
        after.servers.saturating_sub(before.servers),
        after.postgres.saturating_sub(before.postgres),
        after.tool.saturating_sub(before.tool),
    );
    eprintln!(
        "{}: during the run the machine was {:.0}% busy; CPU seconds: servers {:.1}, postgres {:.1}, load tool {:.1}, anything else {:.1}",
        d.label,
        busy as f64 * 100.0 / (after.total - before.total).max(1) as f64,
        servers as f64 / hz,
        postgres as f64 / hz,
        tool as f64 / hz,
        busy.saturating_sub(servers + postgres + tool) as f64 / hz
    );
    if let Some((c, w)) = counts_during {
        eprintln!(
            "{}: during the run and the 1.5 s after, {c} transactions committed in the database ({:.1} per target; reads included) and {w} WAL flushes ({:.1} per target; {:.1} s at the probe's median)",
            d.label,
            c as f64 / n as f64,
            w as f64 / n as f64,
            w as f64 * o.probe_ms / 1e3,
        );
    }
    let closed = CLOSED.swap(0, Ordering::Relaxed);
    let reconnects = RECONNECTS.swap(0, Ordering::Relaxed);
    if closed > 0 {
        eprintln!(
            "{}: {closed} agent sessions closed by a server ({reconnects} registered again); the last: {}",
            d.label,
            LAST_CLOSE.lock().map(|l| l.clone()).unwrap_or_default()
        );
    }
    let counts = o.record.as_ref().and_then(|r| r.counts).unwrap_or_default();
    let targets = o.record.as_ref().map_or(0, |r| r.targets);
    let rate = f64::from(counts.succeeded + counts.failed) / secs;
    let ratio = sqlite_rate.map_or(1.0, |s| rate / s);
    println!(
        "{:<28} {:>8} {:>8} {:>8.2} {:>10.0} {:>9} {:>7} {:>9.2} {:>9.0} {:>9.2}{}",
        d.label,
        n,
        targets,
        secs,
        rate,
        counts.succeeded,
        counts.failed,
        o.probe_ms,
        secs * 1e3 / o.probe_ms,
        ratio,
        if o.done { "" } else { "  NOT DONE" }
    );
    if !o.done {
        println!(
            "{:<28} pending {} queued {} running {} unreachable {} cancelled {} skipped {}",
            "",
            counts.pending,
            counts.queued,
            counts.running,
            counts.unreachable,
            counts.cancelled,
            counts.skipped
        );
    }
    for (mut c, _, dir) in d.servers {
        let log = dir.join("server.log");
        let before_stop = std::fs::metadata(&log).map_or(0, |m| m.len());
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        match c.wait() {
            Ok(s) if !s.success() => eprintln!("{}: {} exited: {s}", d.label, dir.display()),
            _ => {}
        }
        // what the server warned about, once per message
        report_log(
            d.label,
            &log,
            usize::try_from(before_stop).unwrap_or(usize::MAX),
        );
    }
    rate
}

fn main() {
    let counts: Vec<usize> = std::env::var("RVBOX_BENCH_FLEET_REPLICAS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 3_000]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pg = rvbox_testkit::Postgres::start();
    let pg_conf = |db: &str| format!("[postgres]\nconninfo = \"{}\"\n", pg.conninfo(db));
    // every server directory stays until the tool ends
    let dir = tempfile::tempdir().unwrap();
    println!(
        "One fleet run to N agent sessions: SQLite, one PostgreSQL replica, three PostgreSQL replicas (sessions on loopback)"
    );
    println!(
        "{:<28} {:>8} {:>8} {:>8} {:>10} {:>9} {:>7} {:>9} {:>9} {:>9}",
        "deployment",
        "sessions",
        "targets",
        "seconds",
        "results/s",
        "succeeded",
        "failed",
        "fsync ms",
        "run/fsync",
        "vs SQLite"
    );
    for &n in &counts {
        let at = dir.path().join(format!("sqlite-{n}"));
        let port = free_port();
        let sqlite = start_server(&at, port, "", "", Some(NOFILE));
        let sqlite_rate = measure(
            &rt,
            &pg,
            Deployment {
                label: "SQLite, one server",
                servers: vec![(sqlite, port, at.clone())],
                probe_dir: at.join("data"),
                database: None,
            },
            n,
            None,
        );
        let db = format!("one_{n}");
        pg.psql("postgres", &format!("CREATE DATABASE {db}"));
        let at = dir.path().join(format!("one-{n}"));
        let port = free_port();
        let one = start_server(
            &at,
            port,
            "store = \"postgres\"",
            &pg_conf(&db),
            Some(NOFILE),
        );
        measure(
            &rt,
            &pg,
            Deployment {
                label: "PostgreSQL, one replica",
                servers: vec![(one, port, at)],
                probe_dir: pg.dir().to_path_buf(),
                database: Some(db),
            },
            n,
            Some(sqlite_rate),
        );
        let db = format!("three_{n}");
        pg.psql("postgres", &format!("CREATE DATABASE {db}"));
        let servers = (0..3)
            .map(|i| {
                let at = dir.path().join(format!("three-{n}-r{i}"));
                let port = free_port();
                let child = start_server(
                    &at,
                    port,
                    "store = \"postgres\"",
                    &pg_conf(&db),
                    Some(NOFILE),
                );
                (child, port, at)
            })
            .collect();
        measure(
            &rt,
            &pg,
            Deployment {
                label: "PostgreSQL, three replicas",
                servers,
                probe_dir: pg.dir().to_path_buf(),
                database: Some(db),
            },
            n,
            Some(sqlite_rate),
        );
    }
    drop(dir);
}
