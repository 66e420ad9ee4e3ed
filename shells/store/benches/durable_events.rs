//! Durable events per second through the real store: one fsync and one
//! metadata transaction per event, against group commit with 64 concurrent
//! writers, for 1 KiB and 64 KiB events. The disk here flips between fast
//! and slow flush modes, so every figure is also given as a ratio to a raw
//! `fdatasync` probe run right before and after it, and the two modes
//! alternate within each round.
//!
//! Run: `scripts/bench` (or `cargo bench -p rvbox-store --bench durable_events`).
//! `RVBOX_BENCH_ROUNDS` (default 3) sets the number of rounds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::{Duration, Instant};

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Stream};
use rvbox_store::Store;
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store::group::{GroupCommitter, GroupOptions};

mod common;

use common::{noise, now_ms, open, probe};

const WRITERS: usize = 64;

fn running(s: &mut Store, client: &str) -> [u8; 16] {
    let id = uuid_v7(&OsEntropy, now_ms()).unwrap();
    let req = wire::RunCommandRequest {
        request_id: uuid::Uuid::from_bytes(id).hyphenated().to_string(),
        client_id: client.into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("bench".into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    };
    s.run_command(&req, now_ms()).unwrap();
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    let ev = EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: 1,
        observed_ms: now_ms(),
        body: EventBody::Lifecycle {
            to: Lifecycle::Running,
            exit_code: None,
            exit_signal: None,
            encoded: vec![4],
        },
    };
    s.append_events(&[ev], now_ms()).unwrap();
    id
}

fn event(id: [u8; 16], seq: u64, payload: &(u32, Vec<u8>)) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: seq,
        observed_ms: now_ms(),
        body: EventBody::Output {
            stream: Stream::Stdout,
            compression: Compression::Zstd,
            raw_len: payload.0,
            stored: payload.1.clone(),
        },
    }
}

/// One event per append call: one fsync per segment write plus one SQLite
/// commit per event.
fn per_event(payload: &(u32, Vec<u8>), n: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running(&mut s, "bench");
    let start = Instant::now();
    for seq in 2..2 + n {
        let r = s
            .append_events(&[event(id, seq, payload)], now_ms())
            .unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// 64 writers, each on its own command, each with up to `in_flight`
/// events submitted and not yet acknowledged: with 1, a writer sends its
/// next event only once the previous one is durable; with more, it streams
/// as an RVBox client does within its send window (1 MiB per command), and
/// the cumulative acknowledgement covers whatever has become durable. The
/// writers are multiplexed on one driver thread (as the server's
/// per-session async tasks are), so the figure measures the store and not
/// 64 operating-system threads contending for two cores.
fn grouped(payload: &(u32, Vec<u8>), per_writer: u64, in_flight: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let ids: Vec<_> = (0..WRITERS)
        .map(|i| running(&mut s, &format!("bench-{i}")))
        .collect();
    let committer = GroupCommitter::spawn(
        s,
        GroupOptions {
            max_batch: 256,
            max_delay: Duration::from_millis(2),
            queue: 1024,
        },
        now_ms,
    )
    .unwrap();
    let h = committer.handle();
    let (replies, acks) = std::sync::mpsc::sync_channel(WRITERS * 2 * in_flight as usize);
    // next sequence to send, per writer (seq 1 was the `running` event)
    let mut next = vec![2u64; WRITERS];
    let last = 1 + per_writer;
    let start = Instant::now();
    for (w, id) in ids.iter().enumerate() {
        while next[w] <= last && next[w] < 2 + in_flight {
            h.submit(vec![event(*id, next[w], payload)], w as u64, &replies)
                .unwrap();
            next[w] += 1;
        }
    }
    let mut done = 0u64;
    while done < per_writer * WRITERS as u64 {
        let (tag, result) = acks.recv().unwrap();
        let r = result.unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
        done += 1;
        let w = tag as usize;
        if next[w] <= last {
            h.submit(vec![event(ids[w], next[w], payload)], tag, &replies)
                .unwrap();
            next[w] += 1;
        }
    }
    let rate = done as f64 / start.elapsed().as_secs_f64();
    drop(h);
    committer.stop().unwrap();
    rate
}

/// Events each streaming writer keeps in flight in the windowed mode: 8
/// KiB of 1 KiB events, far inside the protocol's 1 MiB per-command window.
const IN_FLIGHT: u64 = 8;

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted
    let rounds: u32 = std::env::var("RVBOX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let probe_dir = tempfile::tempdir().unwrap();
    println!(
        "durable events per second (store: segment fsync + SQLite WAL commit, synchronous=FULL)"
    );
    println!(
        "probe = raw append+fdatasync of the same size, measured right before and after each run\n"
    );
    println!(
        "{:<7} {:<24} {:>8} {:>11} {:>12} {:>14}",
        "size", "mode", "events", "events/s", "probe/s", "events/probe"
    );
    for (label, size, n_single, per_writer) in [
        ("1KiB", 1024usize, 1500u64, 200u64),
        ("64KiB", 64 * 1024, 120, 20),
    ] {
        let raw = noise(size as u64, size);
        let payload = (
            u32::try_from(size).unwrap(),
            zstd::bulk::compress(&raw, 1).unwrap(),
        );
        let mut ratios = Vec::new();
        let mut ratios_w = Vec::new();
        for _ in 0..rounds {
            let p0 = probe(probe_dir.path(), size, Duration::from_millis(500));
            let single = per_event(&payload, n_single);
            let p1 = probe(probe_dir.path(), size, Duration::from_millis(500));
            let group = grouped(&payload, per_writer, 1);
            let p2 = probe(probe_dir.path(), size, Duration::from_millis(500));
            let window = grouped(&payload, per_writer, IN_FLIGHT);
            let p3 = probe(probe_dir.path(), size, Duration::from_millis(500));
            let ps = (p0 + p1) / 2.0;
            let pg = (p1 + p2) / 2.0;
            let pw = (p2 + p3) / 2.0;
            for (mode, events, rate, p) in [
                ("one fsync per event", n_single, single, ps),
                ("group, 64 writers", per_writer * WRITERS as u64, group, pg),
                (
                    "group, 64 x 8 in flight",
                    per_writer * WRITERS as u64,
                    window,
                    pw,
                ),
            ] {
                println!(
                    "{label:<7} {mode:<24} {events:>8} {rate:>11.0} {p:>12.0} {:>14.3}",
                    rate / p
                );
            }
            // compare as probe-normalized rates, so a disk mode flip between
            // the runs does not masquerade as a speed-up
            ratios.push((group / pg) / (single / ps));
            ratios_w.push((window / pw) / (single / ps));
        }
        for (what, mut ratios) in [
            ("one event in flight per writer", ratios),
            ("8 events in flight per writer", ratios_w),
        ] {
            ratios.sort_by(f64::total_cmp);
            let median = ratios[ratios.len() / 2];
            println!(
                "{label:<7} group commit / one-fsync-per-event ({what}, probe-normalized): median {median:.1}x, min {:.1}x, max {:.1}x",
                ratios[0],
                ratios[ratios.len() - 1]
            );
        }
        println!();
    }
}
