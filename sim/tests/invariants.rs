//! The invariant checker against a real temporary store fed by the real
//! client (the simulator's host): a clean run passes; deliberately broken
//! states fail with the right invariant.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Harness, quiet_programs, temp_store};
use rvbox_domain::ids::Uuid7;
use rvbox_sim::host::ClientConfig;
use rvbox_sim::invariants::{Checker, Invariant, Violation};

fn config() -> ClientConfig {
    let mut c = ClientConfig::new("build-01");
    c.programs = quiet_programs();
    c.programs.max_chunks = 4;
    c.programs.max_chunk = 3_000;
    c.programs.max_step_ms = 100;
    c
}

fn check(checker: &mut Checker, h: &mut Harness) -> Vec<Violation> {
    let id = h.client.client_id().to_owned();
    let store = h.store.as_ref().unwrap();
    checker
        .check(store, [(id.as_str(), h.client.ledger_mut())])
        .unwrap()
}

fn kinds(v: &[Violation]) -> Vec<Invariant> {
    let mut k: Vec<Invariant> = v.iter().map(|v| v.invariant).collect();
    k.sort();
    k.dedup();
    k
}

/// Runs three commands to completion against the store, checking after
/// every step; returns the harness, the command ids and every violation.
fn drive(dir: &std::path::Path, checker: &mut Checker) -> (Harness, Vec<String>, Vec<Violation>) {
    let mut h = Harness::new(config(), 21);
    h.store = Some(temp_store(dir, 21));
    h.connect();
    h.reconcile();
    let mut issues = Vec::new();
    let mut seen = Vec::new();
    let mut violations = Vec::new();
    for i in 0..3 {
        let (issue, s) = h.dispatch_new(&format!("make test-{i}"));
        issues.push(issue);
        seen.extend(s);
        violations.extend(check(checker, &mut h));
    }
    for _ in 0..200 {
        seen.extend(h.advance(h.now + 50));
        seen = h.ack_all(&seen);
        violations.extend(check(checker, &mut h));
    }
    assert_eq!(h.client.records(), 0, "all commands finished");
    violations.extend(checker.full_check(h.store.as_ref().unwrap()).unwrap());
    (h, issues, violations)
}

/// [`drive`] with a checker that must see nothing wrong.
fn clean_run(dir: &std::path::Path, checker: &mut Checker) -> (Harness, Vec<String>) {
    let (h, issues, v) = drive(dir, checker);
    assert!(v.is_empty(), "{v:#?}");
    assert!(checker.tracked_acked_events() > 6);
    (h, issues)
}

#[test]
fn a_clean_run_passes() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (_h, issues) = clean_run(dir.path(), &mut checker);
    assert_eq!(issues.len(), 3);
    assert!(checker.checks() > 100);
}

#[test]
fn a_deleted_acknowledged_event_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (mut h, issues) = clean_run(dir.path(), &mut checker);
    let issue = *Uuid7::parse("t", &issues[1]).unwrap().as_bytes();
    let store = h.store.as_ref().unwrap();
    let n = store
        .db()
        .execute(
            "DELETE FROM command_events WHERE issue_uuid = ?1 AND event_seq = 2",
            [issue.as_slice()],
        )
        .unwrap();
    assert_eq!(n, 1);
    let v = check(&mut checker, &mut h);
    assert_eq!(
        kinds(&v),
        vec![Invariant::AckedEventDurable, Invariant::ContiguousSequence],
        "{v:#?}"
    );
    assert!(
        v.iter()
            .all(|x| x.issue_uuid.as_deref() == Some(issues[1].as_str()))
    );
    assert!(v.iter().any(|x| x.detail.contains("event_seq 2")));
}

#[test]
fn changed_content_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (mut h, issues) = clean_run(dir.path(), &mut checker);
    let issue = *Uuid7::parse("t", &issues[0]).unwrap().as_bytes();
    h.store
        .as_ref()
        .unwrap()
        .db()
        .execute(
            "UPDATE command_events SET content_sha256 = zeroblob(32)
             WHERE issue_uuid = ?1 AND event_seq = 1",
            [issue.as_slice()],
        )
        .unwrap();
    let v = check(&mut checker, &mut h);
    assert_eq!(kinds(&v), vec![Invariant::AckedEventDurable], "{v:#?}");
    assert!(v[0].to_string().contains("other content"));
}

#[test]
fn a_truncation_row_explains_a_gap() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (mut h, issues) = clean_run(dir.path(), &mut checker);
    let issue = *Uuid7::parse("t", &issues[2]).unwrap().as_bytes();
    let db = h.store.as_ref().unwrap().db();
    db.execute(
        "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, source, reason, recorded_ms)
         VALUES (?1, 2, 2, 3, 'test rotation', 0)",
        [issue.as_slice()],
    )
    .unwrap();
    db.execute(
        "DELETE FROM command_events WHERE issue_uuid = ?1 AND event_seq = 2",
        [issue.as_slice()],
    )
    .unwrap();
    let v = check(&mut checker, &mut h);
    assert!(v.is_empty(), "{v:#?}");
}

#[test]
fn lifecycle_revision_counter_and_generation_breaks_are_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (mut h, issues) = clean_run(dir.path(), &mut checker);
    let issue = *Uuid7::parse("t", &issues[0]).unwrap().as_bytes();
    let db = h.store.as_ref().unwrap().db();
    // a terminal command back to running
    db.execute(
        "UPDATE commands SET lifecycle = 4, terminal_time_ms = NULL WHERE issue_uuid = ?1",
        [issue.as_slice()],
    )
    .unwrap();
    let v = check(&mut checker, &mut h);
    assert_eq!(kinds(&v), vec![Invariant::LegalLifecycle], "{v:#?}");
    // revision up, then down
    let db = h.store.as_ref().unwrap().db();
    db.execute(
        "UPDATE commands SET revision = 5 WHERE issue_uuid = ?1",
        [issue.as_slice()],
    )
    .unwrap();
    assert!(check(&mut checker, &mut h).is_empty());
    let db = h.store.as_ref().unwrap().db();
    db.execute(
        "UPDATE commands SET revision = 2 WHERE issue_uuid = ?1",
        [issue.as_slice()],
    )
    .unwrap();
    let v = check(&mut checker, &mut h);
    assert_eq!(kinds(&v), vec![Invariant::RevisionMonotonic], "{v:#?}");
    // a quota counter off by one
    let db = h.store.as_ref().unwrap().db();
    db.execute("UPDATE clients SET charged_bytes = charged_bytes + 1", [])
        .unwrap();
    let v = check(&mut checker, &mut h);
    assert!(kinds(&v).contains(&Invariant::QuotaCounters), "{v:#?}");
    let db = h.store.as_ref().unwrap().db();
    db.execute("UPDATE clients SET charged_bytes = charged_bytes - 1", [])
        .unwrap();
    // a generation going back
    db.execute("UPDATE clients SET generation = 7", []).unwrap();
    assert!(check(&mut checker, &mut h).is_empty());
    let db = h.store.as_ref().unwrap().db();
    db.execute("UPDATE clients SET generation = 6", []).unwrap();
    let v = check(&mut checker, &mut h);
    assert_eq!(kinds(&v), vec![Invariant::GenerationMonotonic], "{v:#?}");
}

#[test]
fn a_vanished_command_is_flagged_unless_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::new();
    let (mut h, issues) = clean_run(dir.path(), &mut checker);
    let reclaimed = *Uuid7::parse("t", &issues[0]).unwrap().as_bytes();
    let lost = *Uuid7::parse("t", &issues[1]).unwrap().as_bytes();
    let db = h.store.as_ref().unwrap().db();
    // reclaimed by retention: the tombstone stays (and the counters are
    // released with it; keep them consistent for this test)
    for id in [reclaimed, lost] {
        db.execute(
            "UPDATE clients SET charged_bytes = charged_bytes -
                 (SELECT charged_bytes FROM commands WHERE issue_uuid = ?1)",
            [id.as_slice()],
        )
        .unwrap();
        db.execute(
            "UPDATE quota_totals SET command_charged = command_charged -
                 (SELECT charged_bytes FROM commands WHERE issue_uuid = ?1)",
            [id.as_slice()],
        )
        .unwrap();
        db.execute(
            "DELETE FROM control_mutations WHERE command_uuid = ?1",
            [id.as_slice()],
        )
        .unwrap();
        db.execute(
            "DELETE FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
        )
        .unwrap();
    }
    db.execute(
        "DELETE FROM command_tombstones WHERE issue_uuid = ?1",
        [lost.as_slice()],
    )
    .unwrap();
    let v = check(&mut checker, &mut h);
    assert_eq!(kinds(&v), vec![Invariant::AckedEventDurable], "{v:#?}");
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].issue_uuid.as_deref(), Some(issues[1].as_str()));
    // reported once, then forgotten
    assert!(check(&mut checker, &mut h).is_empty());
}

#[test]
fn a_uuid_accepted_by_two_instances_is_flagged() {
    let mut cfg = config();
    cfg.programs.max_step_ms = 0;
    let mut checker = Checker::new();
    let mut a = Harness::new(cfg.clone(), 30);
    a.connect();
    a.reconcile();
    let (issue, _) = a.dispatch_new("deploy");
    // a second installation of the same client id (its own store and
    // instance id) gets the same command
    let mut b = Harness::new(cfg, 31);
    assert_ne!(a.client.instance_id(), b.client.instance_id());
    b.connect();
    b.reconcile();
    b.server = a.server.clone();
    b.redispatch(&issue);
    let mut v = checker.absorb("build-01", a.client.ledger_mut());
    assert!(v.is_empty());
    v.extend(checker.absorb("build-01", b.client.ledger_mut()));
    assert_eq!(kinds(&v), vec![Invariant::SingleExecution], "{v:#?}");
    assert!(v.iter().any(|x| x.detail.contains("accepted 2 times")));
    assert!(v.iter().any(|x| x.detail.contains("started 2 times")));
}

#[test]
fn a_checker_past_its_bounds_says_so_once_and_stops_recording() {
    // three commands, room for two
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::with_bounds(2, 1_000_000);
    let (_, _, v) = drive(dir.path(), &mut checker);
    assert_eq!(kinds(&v), vec![Invariant::CheckerBounds], "{v:#?}");
    assert_eq!(v.len(), 1, "reported once: {v:#?}");
    // room for three acknowledged events, of many more
    let dir = tempfile::tempdir().unwrap();
    let mut checker = Checker::with_bounds(1_000, 3);
    let (_, _, v) = drive(dir.path(), &mut checker);
    assert_eq!(kinds(&v), vec![Invariant::CheckerBounds], "{v:#?}");
    assert_eq!(v.len(), 1, "{v:#?}");
    assert_eq!(checker.tracked_acked_events(), 3);
}
