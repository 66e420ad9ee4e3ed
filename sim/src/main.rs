//! `rvbox-sim`: run one seed, a range of seeds, or replay a trace.
//!
//! ```text
//! cargo run -p rvbox-sim -- --seed 42
//! cargo run -p rvbox-sim -- --seeds 0..1000
//! cargo run -p rvbox-sim -- --replay sim-failure-42.trace
//! ```

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use rvbox_sim::world::{SimConfig, run};

/// Deterministic simulation of the RVBox server against simulated clients.
#[derive(Debug, Parser)]
#[command(name = "rvbox-sim", version)]
struct Args {
    /// Run one seed; on failure print it and write a replayable trace.
    #[arg(long, conflicts_with_all = ["seeds", "replay"])]
    seed: Option<u64>,
    /// Run a range of seeds `A..B` (B exclusive) and print seeds per second.
    #[arg(long, conflicts_with = "replay")]
    seeds: Option<String>,
    /// Replay a trace file written by a failed run and compare it line by line.
    #[arg(long)]
    replay: Option<std::path::PathBuf>,
    /// Commands per run.
    #[arg(long, default_value_t = SimConfig::default().commands)]
    commands: u32,
    /// Clients per run.
    #[arg(long, default_value_t = SimConfig::default().clients)]
    clients: u32,
    /// Run without injected faults.
    #[arg(long)]
    calm: bool,
    /// Print the trace of a single run.
    #[arg(long)]
    trace: bool,
}

fn parse_range(text: &str) -> Option<(u64, u64)> {
    let (a, b) = text.split_once("..")?;
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a < b).then_some((a, b))
}

fn write_trace(report: &rvbox_sim::world::Report) -> String {
    let path = format!("sim-failure-{}.trace", report.seed);
    match std::fs::write(&path, report.trace_text()) {
        Ok(()) => path,
        Err(e) => format!("(trace not written: {e})"),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = SimConfig {
        clients: args.clients,
        commands: args.commands,
        faults: !args.calm,
        ..SimConfig::default()
    };
    if let Some(path) = &args.replay {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("rvbox-sim: cannot read {}: {e}", path.display());
                return ExitCode::from(2);
            }
        };
        let Some(seed) = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("seed "))
            .and_then(|n| n.trim().parse::<u64>().ok())
        else {
            eprintln!("rvbox-sim: {} does not start with `seed N`", path.display());
            return ExitCode::from(2);
        };
        let report = match run(seed, &config) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("rvbox-sim: {e}");
                return ExitCode::from(2);
            }
        };
        let again = report.trace_text();
        match text.lines().zip(again.lines()).position(|(a, b)| a != b) {
            None if text.lines().count() == again.lines().count() => {
                println!(
                    "replayed seed {seed} identically ({} lines)",
                    report.trace.len()
                );
            }
            None => println!(
                "replay of seed {seed} matches the common prefix but has {} lines, the trace {}",
                again.lines().count(),
                text.lines().count()
            ),
            Some(i) => println!(
                "replay of seed {seed} diverges at line {}:\n  trace:  {}\n  replay: {}",
                i + 1,
                text.lines().nth(i).unwrap_or_default(),
                again.lines().nth(i).unwrap_or_default()
            ),
        }
        return match &report.failure {
            Some(f) => {
                println!("failure: {f}");
                ExitCode::from(1)
            }
            None => ExitCode::SUCCESS,
        };
    }
    if let Some(range) = &args.seeds {
        let Some((a, b)) = parse_range(range) else {
            eprintln!("rvbox-sim: --seeds wants A..B with A < B, got {range}");
            return ExitCode::from(2);
        };
        let start = Instant::now();
        let mut failed = 0u64;
        let mut counters = std::collections::BTreeMap::<String, u64>::new();
        for seed in a..b {
            let done = seed - a;
            if done > 0 && done % 1000 == 0 {
                let secs = start.elapsed().as_secs_f64();
                println!(
                    "progress: {done} seeds, {failed} failed, {:.1} seeds/s",
                    done as f64 / secs.max(1e-9)
                );
            }
            match run(seed, &config) {
                Ok(report) => {
                    for (k, v) in &report.counters {
                        *counters.entry(k.clone()).or_default() += v;
                    }
                    if let Some(f) = &report.failure {
                        failed += 1;
                        let path = write_trace(&report);
                        println!("seed {seed} FAILED: {f}");
                        println!(
                            "  reproduce: cargo run -p rvbox-sim -- --seed {seed}  (trace: {path})"
                        );
                    }
                }
                Err(e) => {
                    failed += 1;
                    println!("seed {seed} could not start: {e}");
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let n = b - a;
        println!(
            "{n} seeds, {failed} failed, {:.1} s, {:.1} seeds/s",
            secs,
            n as f64 / secs.max(1e-9)
        );
        for (k, v) in &counters {
            println!("  {k:<40} {v}");
        }
        return if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        };
    }
    let seed = args.seed.unwrap_or(0);
    let report = match run(seed, &config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rvbox-sim: {e}");
            return ExitCode::from(2);
        }
    };
    if args.trace {
        print!("{}", report.trace_text());
    }
    for (k, v) in &report.counters {
        println!("  {k:<40} {v}");
    }
    match &report.failure {
        Some(f) => {
            let path = write_trace(&report);
            println!("seed {seed} FAILED after {} steps: {f}", report.steps);
            println!("reproduce: cargo run -p rvbox-sim -- --seed {seed}");
            println!("trace written to {path}; replay: cargo run -p rvbox-sim -- --replay {path}");
            ExitCode::from(1)
        }
        None => {
            println!("seed {seed} ok ({} steps)", report.steps);
            ExitCode::SUCCESS
        }
    }
}
