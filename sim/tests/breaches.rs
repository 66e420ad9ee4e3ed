#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The checks of a whole run fire on a deliberately broken world: each
//! [`Breach`] is what a real bug would leave behind, and the same seed
//! without it runs clean (so the failure is the breach's).

use rvbox_sim::world::{Breach, SimConfig, run};

fn failure(seed: u64, faults: bool, breach: Option<Breach>) -> Option<String> {
    let config = SimConfig {
        faults,
        breach,
        ..SimConfig::default()
    };
    run(seed, &config).unwrap().failure
}

fn fires(seed: u64, faults: bool, breach: Breach, want: &str) {
    assert_eq!(failure(seed, faults, None), None, "seed {seed} unbroken");
    let got = failure(seed, faults, Some(breach));
    eprintln!("{breach:?} on seed {seed}: {got:?}");
    assert!(
        got.as_deref().is_some_and(|f| f.contains(want)),
        "{breach:?} on seed {seed}: {got:?}"
    );
}

#[test]
fn a_network_dead_from_the_calm_tail_on_fails_the_calm_tails_bound() {
    fires(3, true, Breach::DeadNetwork, "into the calm tail");
}

#[test]
fn an_outcome_the_client_did_not_report_fails_agreement() {
    fires(3, false, Breach::FlippedOutcome, "agreement:");
}

#[test]
fn a_command_stored_for_another_client_fails_the_exit_oracle() {
    fires(3, false, Breach::Readdressed, "but ran on");
}
