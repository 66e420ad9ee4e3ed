//! Server memory per idle agent connection: the real `rvbox-server`
//! binary, and a load client in this process that registers N agent
//! sessions over real WebSockets on loopback (source addresses spread over
//! 127.0.0.0/8), answers their reconciliation, advertises capacity, and
//! then leaves them idle (answering Pings). Prints the server's RSS with
//! none, with 1,000 and with 10,000 idle sessions, and the growth per
//! session.
//!
//! `RVBOX_BENCH_IDLE` overrides the session counts (comma-separated).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
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
const CONCURRENT: usize = 128;

/// Keeps a session idle: reads (which answers the server's Pings) until
/// the end.
async fn idle(mut ws: Ws) {
    while let Some(Ok(m)) = ws.next().await {
        if let Message::Close(f) = m {
            panic!("an idle session was closed: {f:?}");
        }
    }
}

fn main() {
    let counts: Vec<usize> = std::env::var("RVBOX_BENCH_IDLE")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "Server RSS per idle agent session (real rvbox-server, registered sessions on loopback)"
    );
    println!(
        "{:>8} {:>12} {:>14} {:>16} {:>12}",
        "sessions", "rss MiB", "growth MiB", "per session KiB", "register s"
    );
    for &n in &counts {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = start_server(dir.path(), port, "", "", None);
        let pid = server.id();
        std::thread::sleep(Duration::from_millis(500));
        let base = rss_kib(pid);
        let started = Instant::now();
        let sockets = rt.block_on(async {
            let mut out = Vec::with_capacity(n);
            let mut i = 0;
            while i < n {
                let batch: Vec<_> = (i..(i + CONCURRENT).min(n))
                    .map(|j| tokio::spawn(register(j, port)))
                    .collect();
                for h in batch {
                    out.push(h.await.unwrap());
                }
                i += CONCURRENT;
            }
            out
        });
        let took = started.elapsed();
        let tasks: Vec<_> = rt.block_on(async {
            sockets
                .into_iter()
                .map(|ws| tokio::spawn(idle(ws)))
                .collect()
        });
        // idle long enough for the server's buffers to settle
        std::thread::sleep(Duration::from_secs(3));
        let loaded = rss_kib(pid);
        let growth = loaded.saturating_sub(base);
        println!(
            "{:>8} {:>12.1} {:>14.1} {:>16.2} {:>12.1}",
            0,
            base as f64 / 1024.0,
            0.0,
            0.0,
            0.0
        );
        println!(
            "{:>8} {:>12.1} {:>14.1} {:>16.2} {:>12.1}",
            n,
            loaded as f64 / 1024.0,
            growth as f64 / 1024.0,
            growth as f64 / n as f64,
            took.as_secs_f64()
        );
        for t in tasks {
            t.abort();
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
        let _ = server.wait();
    }
}
