//! Server memory per idle agent session on SQLite, on one PostgreSQL
//! replica, and on three PostgreSQL replicas of one database: the real
//! `rvbox-server` binaries, a private PostgreSQL on loopback, and a load
//! client in this process that registers N sessions on each replica (the
//! real protocol: hello, welcome, reconciliation, capacity) and leaves
//! them idle. Prints each server's RSS before and after, the growth per
//! session, and the sessions the deployment holds in all.
//!
//! `RVBOX_BENCH_IDLE_REPLICAS` sets N, the sessions per server (default
//! 2,000; three replicas then hold 6,000).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio_tungstenite::tungstenite::Message;

#[path = "support/agent_client.rs"]
mod agent_client;
use agent_client::{Ws, register, rss_kib};
#[path = "support/server.rs"]
mod server;
use server::start_server;

/// Sessions being registered at once.
const CONCURRENT: usize = 64;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn idle(mut ws: Ws) {
    while let Some(Ok(m)) = ws.next().await {
        if let Message::Close(f) = m {
            panic!("an idle session was closed: {f:?}");
        }
    }
}

/// Registers sessions `from..from + n` on `port`.
fn fill(rt: &tokio::runtime::Runtime, port: u16, from: usize, n: usize) -> Vec<Ws> {
    rt.block_on(async {
        let mut out = Vec::with_capacity(n);
        let mut i = from;
        while i < from + n {
            let batch: Vec<_> = (i..(i + CONCURRENT).min(from + n))
                .map(|j| tokio::spawn(register(j, port)))
                .collect();
            for h in batch {
                out.push(h.await.unwrap());
            }
            i += CONCURRENT;
        }
        out
    })
}

struct Deployment {
    label: &'static str,
    servers: Vec<(Child, u16)>,
}

fn measure(rt: &tokio::runtime::Runtime, d: Deployment, n: usize) {
    std::thread::sleep(Duration::from_millis(500));
    let base: Vec<u64> = d.servers.iter().map(|(c, _)| rss_kib(c.id())).collect();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (k, (_, port)) in d.servers.iter().enumerate() {
        let sockets = fill(rt, *port, k * n, n);
        tasks.extend(rt.block_on(async {
            sockets
                .into_iter()
                .map(|ws| tokio::spawn(idle(ws)))
                .collect::<Vec<_>>()
        }));
    }
    let took = started.elapsed();
    std::thread::sleep(Duration::from_secs(3));
    let loaded: Vec<u64> = d.servers.iter().map(|(c, _)| rss_kib(c.id())).collect();
    let growth: u64 = loaded
        .iter()
        .zip(&base)
        .map(|(l, b)| l.saturating_sub(*b))
        .sum();
    let total = n * d.servers.len();
    #[allow(clippy::cast_precision_loss)]
    let per = growth as f64 / total as f64;
    #[allow(clippy::cast_precision_loss)]
    let rss: f64 = loaded.iter().sum::<u64>() as f64 / 1024.0;
    println!(
        "{:<28} {:>8} {:>9} {:>12.1} {:>16.2} {:>11.1}",
        d.label,
        total,
        d.servers.len(),
        rss,
        per,
        took.as_secs_f64()
    );
    for t in tasks {
        t.abort();
    }
    for (mut c, _) in d.servers {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let _ = c.wait();
    }
}

fn main() {
    let n: usize = std::env::var("RVBOX_BENCH_IDLE_REPLICAS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pg = rvbox_testkit::Postgres::start();
    pg.psql("postgres", "CREATE DATABASE one");
    pg.psql("postgres", "CREATE DATABASE three");
    println!(
        "Server RSS per idle agent session: SQLite, one PostgreSQL replica, three PostgreSQL replicas ({n} sessions per server)"
    );
    println!(
        "{:<28} {:>8} {:>9} {:>12} {:>16} {:>11}",
        "deployment", "sessions", "servers", "rss MiB", "per session KiB", "register s"
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let sqlite = start_server(&dir.path().join("sqlite"), port, "", "", None);
    measure(
        &rt,
        Deployment {
            label: "SQLite, one server",
            servers: vec![(sqlite, port)],
        },
        n,
    );
    let pg_conf = |db: &str| format!("[postgres]\nconninfo = \"{}\"\n", pg.conninfo(db));
    let port = free_port();
    let one = start_server(
        &dir.path().join("one"),
        port,
        "store = \"postgres\"",
        &pg_conf("one"),
        None,
    );
    measure(
        &rt,
        Deployment {
            label: "PostgreSQL, one replica",
            servers: vec![(one, port)],
        },
        n,
    );
    let servers = (0..3)
        .map(|i| {
            let port = free_port();
            (
                start_server(
                    &dir.path().join(format!("r{i}")),
                    port,
                    "store = \"postgres\"",
                    &pg_conf("three"),
                    None,
                ),
                port,
            )
        })
        .collect();
    measure(
        &rt,
        Deployment {
            label: "PostgreSQL, three replicas",
            servers,
        },
        n,
    );
}
