//! Durable events per second and `RunCommand` per second through the store
//! port, side by side in one run: the SQLite store (one server), the
//! PostgreSQL store (one replica), and three PostgreSQL replicas writing at
//! once to one database, each figure beside a raw `fdatasync` probe taken
//! just before it, on the same disk (the PostgreSQL instance is a private
//! one under the same temporary directory, `fsync = on`,
//! `synchronous_commit = on`).
//!
//! Workload:
//! - *events, 64 writers*: 64 commands running, each with one output event
//!   (256 incompressible bytes) in flight; every round is one
//!   `AppendEvents` of 64 events, one durable group (one SQLite group
//!   commit, one PostgreSQL transaction), as the server's executor forms
//!   them from 64 busy sessions.
//! - *events, 1 writer*: one event per `AppendEvents`: a commit per event.
//! - *RunCommand*: one new command per operation, each its own durable
//!   transaction with its idempotency row and audit record.
//!
//! Three replicas: three threads, each with its own connection and its own
//! 64 clients, append (or create commands) at once; the figure is their
//! sum.
//!
//! `RVBOX_BENCH_ROUNDS` sets the rounds (default 3); each measurement
//! runs for `RVBOX_BENCH_SECS` seconds (default 3).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_precision_loss
)]

#[path = "../../store/benches/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use rvbox_conformance::support::{new_id, output_event, run_request, running};
use rvbox_store_pg::{PgStore, StoreOptions};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::ops::{Backend, Completion, OpToken, StoreOp};
use rvbox_store_port::sessions::SessionFence;
use rvbox_testkit::Postgres;

const WRITERS: usize = 64;
const EVENT_BYTES: usize = 256;

/// A backend with `WRITERS` running commands of clients `prefix-N`.
struct Writers<B> {
    backend: B,
    /// Each command, its session and its next event sequence.
    commands: Vec<([u8; 16], SessionFence, u64)>,
    rounds: u64,
    created: u64,
}

impl<B: Backend> Writers<B> {
    fn new(mut backend: B, prefix: &str, n: usize) -> Self {
        let commands = (0..n)
            .map(|i| {
                let (issue, session) = running(&mut backend, &format!("{prefix}-{i}"));
                (issue, session, 2)
            })
            .collect();
        Self {
            backend,
            commands,
            rounds: 0,
            created: 0,
        }
    }

    /// One `AppendEvents` of one event per command (the first `writers`);
    /// returns the events appended.
    fn round(&mut self, writers: usize, payload: &[u8]) -> u64 {
        self.rounds += 1;
        let events = self
            .commands
            .iter_mut()
            .take(writers)
            .map(|(issue, session, seq)| {
                let mut ev = output_event(issue, *seq, payload);
                ev.session = Some(*session);
                *seq += 1;
                ev
            })
            .collect::<Vec<_>>();
        let n = events.len() as u64;
        let mut done = self.backend.perform_batch(vec![(
            OpToken(self.rounds),
            common::now_ms(),
            StoreOp::AppendEvents { events },
        )]);
        let (_, result) = done.pop().expect("one completion");
        let outcomes = rvbox_conformance::support::outcomes(&result);
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, rvbox_store_port::events::EventOutcome::Appended)),
            "{outcomes:?}"
        );
        n
    }

    /// Events per second for `for_`.
    fn events_per_s(&mut self, writers: usize, for_: Duration) -> f64 {
        let payload = common::noise(self.rounds, EVENT_BYTES);
        let start = Instant::now();
        let mut n = 0;
        while start.elapsed() < for_ {
            n += self.round(writers, &payload);
        }
        n as f64 / start.elapsed().as_secs_f64()
    }

    /// `RunCommand`s per second for `for_`, for clients `prefix-rc-N`, a
    /// new one every 1,000 commands (each command reserves its quota
    /// inside its client's).
    fn run_commands_per_s(&mut self, prefix: &str, for_: Duration) -> f64 {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < for_ {
            let id = new_id();
            self.created += 1;
            let client = format!("{prefix}-rc-{}", self.created / 1000);
            let r = self.backend.perform(
                common::now_ms(),
                StoreOp::RunCommand {
                    request: run_request(&id, &client, "true"),
                    caller: Caller::local(),
                },
            );
            assert!(matches!(r, Ok(Completion::RunCommand(_))), "{r:?}");
            n += 1;
        }
        n as f64 / start.elapsed().as_secs_f64()
    }
}

/// Default options, with queue bounds the bench's new commands stay inside
/// (they are never dispatched) and no free-space floor.
fn options() -> StoreOptions {
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.free_space_floor = 0;
    StoreOptions {
        tiers,
        queue_max_per_client: 10_000_000,
        queue_max_total: 10_000_000,
        ..StoreOptions::default()
    }
}

fn sqlite(dir: &std::path::Path) -> Writers<rvbox_engine::Executor> {
    let mut store = rvbox_store::Store::open(
        rvbox_store::layout::Layout::new(dir),
        std::sync::Arc::new(rvbox_store::fs::RealFs),
        std::sync::Arc::new(rvbox_store::entropy::OsEntropy),
        options(),
        common::now_ms(),
    )
    .unwrap();
    store.recover(common::now_ms()).unwrap();
    Writers::new(rvbox_engine::Executor::new(store), "sq", WRITERS)
}

fn pg_options() -> StoreOptions {
    options()
}

fn replica(conninfo: &str, prefix: &str) -> Writers<PgStore> {
    Writers::new(
        PgStore::connect(conninfo, pg_options()).unwrap(),
        prefix,
        WRITERS,
    )
}

/// Runs `f` on three replicas at once; the sum of their rates.
fn three<F>(replicas: &mut [Writers<PgStore>; 3], f: F) -> f64
where
    F: Fn(&mut Writers<PgStore>, usize) -> f64 + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = replicas
            .iter_mut()
            .enumerate()
            .map(|(i, w)| {
                let f = &f;
                s.spawn(move || f(w, i))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

fn row(label: &str, rate: f64, probe: f64) {
    println!(
        "{label:<40} {rate:>12.0} {probe:>12.0} {:>8.2}",
        rate / probe
    );
}

fn main() {
    let rounds: usize = std::env::var("RVBOX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let secs: u64 = std::env::var("RVBOX_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let for_ = Duration::from_secs(secs);
    let probe_for = Duration::from_secs(1);
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start();
    pg.psql("postgres", "CREATE DATABASE one");
    pg.psql("postgres", "CREATE DATABASE three");
    let mut sq = sqlite(dir.path());
    let mut one = replica(&pg.conninfo("one"), "pg");
    let mut replicas = [
        replica(&pg.conninfo("three"), "r0"),
        replica(&pg.conninfo("three"), "r1"),
        replica(&pg.conninfo("three"), "r2"),
    ];
    println!(
        "Durable writes per second through the store port ({secs} s each, {rounds} rounds; probe: 256-byte append + fdatasync)"
    );
    println!(
        "{:<40} {:>12} {:>12} {:>8}",
        "", "per second", "probe /s", "ratio"
    );
    let probe = || common::probe(dir.path(), EVENT_BYTES, probe_for);
    for round in 1..=rounds {
        println!("round {round}");
        let p = probe();
        row(
            "events, 64 writers: SQLite",
            sq.events_per_s(WRITERS, for_),
            p,
        );
        let p = probe();
        row(
            "events, 64 writers: PostgreSQL",
            one.events_per_s(WRITERS, for_),
            p,
        );
        let p = probe();
        row(
            "events, 64 writers x 3 replicas",
            three(&mut replicas, |w, _| w.events_per_s(WRITERS, for_)),
            p,
        );
        let p = probe();
        row("events, 1 writer: SQLite", sq.events_per_s(1, for_), p);
        let p = probe();
        row("events, 1 writer: PostgreSQL", one.events_per_s(1, for_), p);
        let p = probe();
        row(
            "events, 1 writer x 3 replicas",
            three(&mut replicas, |w, _| w.events_per_s(1, for_)),
            p,
        );
        let p = probe();
        row("RunCommand: SQLite", sq.run_commands_per_s("sq", for_), p);
        let p = probe();
        row(
            "RunCommand: PostgreSQL",
            one.run_commands_per_s("pg", for_),
            p,
        );
        let p = probe();
        row(
            "RunCommand x 3 replicas",
            three(&mut replicas, |w, i| {
                w.run_commands_per_s(&format!("r{i}"), for_)
            }),
            p,
        );
    }
}
