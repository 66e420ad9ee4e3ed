#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The simulator under `cargo test`: a fixed batch of seeds runs clean and
//! exercises every fault kind and recovery path (a counter left at zero
//! fails the batch), every seed kept under `fixtures/sim/` replays clean,
//! and one seed run twice gives a byte-identical trace.

use std::collections::BTreeMap;

use rvbox_sim::world::{CRASH_POINTS, SimConfig, run};

/// Seeds of the fixed batch: 120..160, and seed 460. 120..160 since the
/// fleet workload changed every run's draws: 0..40 then held no daemon
/// stop that escalated to KILL and no refused second instance, both rare
/// (2 escalations in 200 seeds). Since the replica faults changed the
/// draws again, 120..160 holds no escalation either (none in 160..440):
/// seed 460 has one.
const BATCH: &[std::ops::Range<u64>] = &[120..160, 460..461];

/// Every fault the simulator injects and every recovery path it relies
/// on; each must happen at least once in the batch (conventions rule 7).
const MUST_HAPPEN: &[&str] = &[
    "server_crash",
    "lease_lost",
    "duties_moved",
    "spurious_wake",
    "client_crash",
    "partition",
    "wall_clock_jump",
    "connection_cut",
    "unsynced_bytes_lost",
    "net delayed",
    "net stalled",
    "net reordered",
    "net lost",
    "net duplicated",
    "recovery tail_truncated",
    "recovery sessions_closed",
    "engine reconciled",
    "engine requeued",
    "engine expired",
    "engine signals_sent_again",
    "operator_signal",
    "operator_signal_replayed",
    "second_instance_refused",
    "client scripts_committed",
    "client long_replays",
    "chatty_partition",
    "client_orderly_restart",
    "workload kill_escalations",
    "clients real",
    "client_crash_point",
    "client store_faults",
    "server_close CLOSE_REASON_PROTOCOL_ERROR",
    "server_close CLOSE_REASON_STALE_SESSION",
    "crash_with ops_queued",
    "crash_with completions_undelivered",
    "executor appends_grouped",
    "agreement commands_checked",
    "engine maintenance_passes",
    "adversary answered StaleGeneration",
    "adversary answered MalformedBytes",
    "adversary answered ConflictingDuplicate",
    "adversary answered WindowOverrun",
    "adversary answered ContradictorySnapshot",
    "adversary contradiction_incidents",
    "retention tight_quotas",
    "retention tombstone_fifo_full",
    "retention output_truncations",
    "engine evicted",
    "engine rotations",
    "engine clients_pruned",
    "engine audits_flushed",
    "engine gate_changes",
    "adversary answered ExactDuplicate",
    "oracle output_commands",
    "oracle output_bytes",
    "oracle gap_bytes",
    "oracle exits",
    "oracle stdin_writes",
    "oracle eofs",
    "oracle signals",
    "oracle cursor_reads",
    "stdin appended",
    "stdin closed",
    "late_acceptance_provoked",
    "engine late_acceptances",
    "fleet runs",
    "fleet targets released",
    "fleet retried",
    "fleet replayed",
    "fleet cancelled",
    "fleet cancel retried",
    "fleet parallel_checks",
    "terminal opened",
    "terminal frames acknowledged",
    "terminal requests replayed",
    "terminal resized",
    "terminal shell exits",
    "terminal close answered",
    "terminal closed",
    "terminal output bursts",
    "terminal viewers attached again",
    "terminal viewers saw the end",
    "oracle terminal_frames",
    "oracle terminal_output_bytes",
    "oracle terminal_cut_bytes",
    "oracle terminal_closes",
];

/// Named crash points of the server's store that no path of the engine
/// passes, with the reason; the batch asserts they stay unpassed, so the
/// day one becomes reachable it must be taken off this list and crashed at.
const UNREACHABLE: &[(&str, &str)] = &[
    (
        "store.advance.after_commit",
        "advance_lifecycle is a store API the benches and repair tests use; the engine records lifecycle changes with the operation that causes them",
    ),
    (
        "store.revision.after_commit",
        "bump_revision is called by tests only; revisions change inside signal and takeover transactions",
    ),
    (
        "store.transition.after_commit",
        "record_transition is called by benches and repair tests only",
    ),
];

/// Every counter the batch requires: [`MUST_HAPPEN`], every named crash
/// point of the server's store (`crash_point <name>`) but the
/// [`UNREACHABLE`] ones, and every named crash point of the client's store
/// (`client_crash_point <name>`).
fn required() -> Vec<String> {
    MUST_HAPPEN
        .iter()
        .map(|k| (*k).to_owned())
        .chain(
            CRASH_POINTS
                .iter()
                .filter(|p| !UNREACHABLE.iter().any(|(u, _)| u == *p))
                .map(|p| format!("crash_point {p}")),
        )
        .chain(
            rvbox_client_store::crash::ALL
                .iter()
                .chain(rvbox_client_store::crash::TERMINAL_POINTS)
                .map(|p| format!("client_crash_point {p}")),
        )
        .collect()
}

#[test]
fn a_fixed_batch_of_seeds_runs_clean_and_exercises_every_fault() {
    let mut total: BTreeMap<String, u64> = BTreeMap::new();
    let mut failures = Vec::new();
    // RVBOX_SIM_BATCH=A..B tries another batch (to find one that exercises
    // every fault after the draws changed)
    let batch: Vec<std::ops::Range<u64>> = std::env::var("RVBOX_SIM_BATCH")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once("..")?;
            let only: std::ops::Range<u64> = a.parse().ok()?..b.parse().ok()?;
            Some(std::iter::once(only).collect())
        })
        .unwrap_or_else(|| BATCH.to_vec());
    for seed in batch.into_iter().flatten() {
        let r = run(seed, &SimConfig::default()).unwrap();
        if let Some(f) = &r.failure {
            failures.push(format!(
                "seed {seed}: {f}\n  reproduce: cargo run -p rvbox-sim -- --seed {seed}"
            ));
        }
        for (k, v) in r.counters {
            *total.entry(k).or_default() += v;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let missing: Vec<String> = required()
        .into_iter()
        .filter(|k| total.get(k).copied().unwrap_or(0) == 0)
        .collect();
    assert!(
        missing.is_empty(),
        "never exercised in the batch: {missing:?}\ncounters: {total:#?}"
    );
    for (point, why) in UNREACHABLE {
        assert!(
            CRASH_POINTS.contains(point),
            "{point} is listed unreachable but is no crash point"
        );
        assert_eq!(
            total.get(&format!("passed {point}")).copied().unwrap_or(0),
            0,
            "{point} was passed: it is reachable now ({why} no longer holds), so crash at it"
        );
    }
}

#[test]
fn every_kept_seed_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/sim");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seed"))
        .collect();
    names.sort();
    assert!(!names.is_empty());
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap();
        let seed: u64 = text.lines().next().unwrap().trim().parse().unwrap();
        let r = run(seed, &SimConfig::default()).unwrap();
        assert_eq!(r.failure, None, "{} (seed {seed})", path.display());
    }
}

#[test]
fn one_seed_twice_gives_a_byte_identical_trace() {
    let a = run(7, &SimConfig::default()).unwrap();
    let b = run(7, &SimConfig::default()).unwrap();
    assert!(a.trace.len() > 50, "a real run: {} lines", a.trace.len());
    assert_eq!(a.trace_text(), b.trace_text());
    assert_eq!(a.counters, b.counters);
    let c = run(8, &SimConfig::default()).unwrap();
    assert_ne!(a.trace_text(), c.trace_text(), "the seed matters");
}
