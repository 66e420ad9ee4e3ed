#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Scoped health (plan §5.1, §5.6 "recovery endpoints go live promptly
//! while unsafe scoped mutations stay gated") and essential-state
//! verification on real files.

mod support;

use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::entropy::OsEntropy;
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::RealFs;
use rvbox_store::health::ScopeState;
use rvbox_store::incidents::{self, NewIncident};
use rvbox_store::layout::Layout;
use rvbox_store::mutations::OpError;
use rvbox_store::{Store, StoreOptions};
use support::*;

fn refused(r: Result<wire::RunCommandResponse, OpError>) -> rvbox_domain::error::DomainError {
    match r {
        Err(OpError::Refused(e)) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn liveness_and_incidents_answer_at_once_while_mutations_wait_for_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let id = {
        let mut s = open(dir.path());
        running_command(&mut s, "web-1")
    };
    // opened, not yet recovered
    let mut s = Store::open(
        Layout::new(dir.path()),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let health = s.health();
    assert_eq!(health.global(), ScopeState::Recovering);
    let report = health.report(NOW);
    assert!(report.live && !report.ready);
    assert!(s.list_incidents(None, None, 10).unwrap().is_empty());
    let e = refused(s.run_command(&run_request(&new_id(), "web-2", "uptime"), NOW));
    assert_eq!(e.code(), Code::Unavailable);
    let r = s.append_events(&[output(&id, 2, b"x")], NOW).unwrap();
    assert!(matches!(&r.outcomes[0], EventOutcome::Refused(e) if e.code() == Code::Unavailable));
    assert!(r.acked.is_empty());

    s.recover(NOW).unwrap();
    assert_eq!(health.global(), ScopeState::Ready);
    assert!(health.report(NOW).ready);
    s.run_command(&run_request(&new_id(), "web-2", "uptime"), NOW)
        .unwrap();
    s.append_events(&[output(&id, 2, b"x")], NOW).unwrap();
    assert_counters(&s);
}

#[test]
fn a_dirty_client_scope_refuses_its_own_mutations_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let incident = new_id();
    incidents::insert(
        s.db(),
        incident,
        &NewIncident {
            kind: wire::IncidentKind::PermissionError,
            scope_kind: wire::ScopeKind::Client,
            scope_key: "web-1".into(),
            client_id: Some("web-1".into()),
            issue_uuid: None,
            summary: "client scope could not be written".into(),
            evidence: Vec::new(),
            data_loss: true,
        },
        NOW,
    )
    .unwrap();
    s.recover(NOW).unwrap();
    let report = s.health().report(NOW);
    assert!(
        report.ready,
        "one dirty client does not make the server unready"
    );
    assert!(report.scopes.iter().any(|h| h.scope_key == "web-1"
        && h.state == wire::ScopeState::DirtyReadable as i32
        && h.incident_ids == vec![text(&incident)]));

    let e = refused(s.run_command(&run_request(&new_id(), "web-1", "uptime"), NOW));
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(e.to_detail().incident_id, Some(text(&incident)));
    s.run_command(&run_request(&new_id(), "web-2", "uptime"), NOW)
        .unwrap();

    s.acknowledge_incident(
        &wire::AcknowledgeStorageIncidentRequest {
            request_id: text(&new_id()),
            incident_id: text(&incident),
            note: "permissions fixed by hand".into(),
        },
        &rvbox_store::operator::Caller {
            transport: "test".into(),
            principal: String::new(),
        },
        NOW,
    )
    .unwrap();
    s.run_command(&run_request(&new_id(), "web-1", "uptime"), NOW)
        .unwrap();
    // the acknowledgement is in the audit log, with who did it
    let audit = s.read_audit(0, 10).unwrap();
    assert!(
        audit
            .iter()
            .any(|(_, r)| r.action == "AcknowledgeStorageIncident" && r.transport == "test"),
        "{audit:?}"
    );
    assert_counters(&s);
}

#[test]
fn corrupt_essential_state_interrupts_only_that_command() {
    let dir = tempfile::tempdir().unwrap();
    let (bad, good) = {
        let mut s = open(dir.path());
        let bad = new_id();
        s.run_command(&run_request(&bad, "web-1", "deploy"), NOW)
            .unwrap();
        let good = new_id();
        s.run_command(&run_request(&good, "web-1", "uptime"), NOW)
            .unwrap();
        s.db()
            .execute(
                "UPDATE commands SET spec_zstd = x'28b52ffd00' WHERE issue_uuid = ?1",
                [bad.as_slice()],
            )
            .unwrap();
        (bad, good)
    };
    let mut s = Store::open(
        Layout::new(dir.path()),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let report = s.recover(NOW).unwrap();
    assert_eq!(report.commands_interrupted, 1);
    let lifecycle = |id: &[u8; 16]| -> i64 {
        s.db()
            .query_row(
                "SELECT lifecycle FROM commands WHERE issue_uuid = ?1",
                [id.as_slice()],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!(lifecycle(&bad), Lifecycle::Interrupted.to_wire() as i64);
    assert_eq!(lifecycle(&good), Lifecycle::Queued.to_wire() as i64);
    let tomb: i64 = s
        .db()
        .query_row(
            "SELECT COUNT(*) FROM command_tombstones WHERE issue_uuid = ?1",
            [bad.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tomb, 1, "the interrupted UUID can never run again");
    let open_incidents = incidents::open(s.db(), 10).unwrap();
    assert_eq!(open_incidents.len(), 1);
    assert_eq!(open_incidents[0].scope_key, text(&bad));
    // recovery is idempotent
    assert_eq!(s.recover(NOW).unwrap().commands_interrupted, 0);
    // the healthy command carries on
    s.record_transition(&good, Lifecycle::Dispatched).unwrap();
}

#[test]
fn sqlite_integrity_failure_makes_the_store_unavailable_and_stops_recovery() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = open(dir.path());
        for i in 0..300 {
            s.run_command(
                &run_request(&new_id(), &format!("web-{}", i % 7), "uptime"),
                NOW,
            )
            .unwrap();
        }
    } // the last connection closes: the WAL is checkpointed into the file
    let db = dir.path().join("db/rvbox.sqlite3");
    let mut bytes = std::fs::read(&db).unwrap();
    let pages = bytes.len() / 4096;
    assert!(pages > 8, "{pages} pages");
    // scribble over the root page of the commands table
    let root: i64 = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row(
            "SELECT rootpage FROM sqlite_schema WHERE name = 'commands'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let at = (usize::try_from(root).unwrap() - 1) * 4096;
    for b in &mut bytes[at..at + 4096] {
        *b = 0x5a;
    }
    std::fs::write(&db, &bytes).unwrap();

    let mut s = Store::open(
        Layout::new(dir.path()),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let report = s.recover(NOW).unwrap();
    assert!(!report.integrity_ok);
    let health = s.health();
    assert_eq!(health.global(), ScopeState::Unavailable);
    let h = health.report(NOW);
    assert!(h.live && !h.ready);
    let recorded = h.bootstrap_incident.is_some() || h.open_incident_count == 1;
    assert!(
        recorded,
        "the integrity failure is visible through health: {h:?}"
    );
    let e = refused(s.run_command(&run_request(&new_id(), "web-1", "uptime"), NOW));
    assert_eq!(e.code(), Code::Unavailable);
}

#[test]
fn incidents_stay_readable_while_recovery_runs_on_another_thread() {
    let dir = tempfile::tempdir().unwrap();
    {
        // a store with an open incident and enough segments to scan
        let mut s = open(dir.path());
        for i in 0..40 {
            let id = running_command(&mut s, &format!("web-{}", i % 4));
            s.append_events(&[output(&id, 2, &chunk(i, 4000))], NOW)
                .unwrap();
        }
        incidents::insert(
            s.db(),
            new_id(),
            &NewIncident {
                kind: wire::IncidentKind::PermissionError,
                scope_kind: wire::ScopeKind::Client,
                scope_key: "web-3".into(),
                client_id: Some("web-3".into()),
                issue_uuid: None,
                summary: "client scope could not be written".into(),
                evidence: Vec::new(),
                data_loss: false,
            },
            NOW,
        )
        .unwrap();
    }
    let mut s = Store::open(
        Layout::new(dir.path()),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        NOW,
    )
    .unwrap();
    let health = s.health();
    let reader = s.reader().unwrap();
    assert!(health.report(NOW).live);
    assert!(!health.report(NOW).ready);
    let recovery = std::thread::spawn(move || {
        let report = s.recover(NOW).unwrap();
        (s, report)
    });
    // the read side answers whatever the writer is doing
    let listed = reader.list_incidents(None, None, 10).unwrap();
    assert_eq!(listed.len(), 1);
    let (s, report) = recovery.join().unwrap();
    assert_eq!(report.segments_scanned, 40);
    assert!(health.report(NOW).ready);
    assert_eq!(
        health
            .check_writable(&[(wire::ScopeKind::Client, "web-3")])
            .unwrap_err()
            .code(),
        Code::Unavailable
    );
    assert!(
        health
            .check_writable(&[(wire::ScopeKind::Client, "web-1")])
            .is_ok()
    );
    drop(s);
}
