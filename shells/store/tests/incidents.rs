#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Incidents on a real SQLite file: dirty derivation, then repair, then
//! acknowledgement (plan §5.6), with request-id idempotency.

use rusqlite::Connection;
use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::db::{self, DbOptions};
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::incidents::{self, NewIncident, Resolution, SafeRepair, resolution};
use rvbox_store::mutations::OpError;

fn open() -> (tempfile::TempDir, Connection) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = db::open(&dir.path().join("t.sqlite3"), DbOptions::default()).unwrap();
    db::migrate(&mut c, 0).unwrap();
    (dir, c)
}

fn new(kind: wire::IncidentKind, key: &str, data_loss: bool) -> NewIncident {
    NewIncident {
        kind,
        scope_kind: wire::ScopeKind::Segment,
        scope_key: key.into(),
        client_id: Some("web-1".into()),
        issue_uuid: None,
        summary: "segment 1 of a command has bytes beyond its committed end".into(),
        evidence: b"offset=4096".to_vec(),
        data_loss,
    }
}

fn id_text(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

fn request_id(ms: i64) -> String {
    id_text(&uuid_v7(&OsEntropy, ms).unwrap())
}

fn refused(r: Result<impl std::fmt::Debug, OpError>) -> Code {
    match r {
        Err(OpError::Refused(e)) => e.code(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn dirty_derivation_then_repair_then_acknowledgement() {
    let (_dir, mut c) = open();
    let tail = incidents::insert(
        &c,
        uuid_v7(&OsEntropy, 1000).unwrap(),
        &new(wire::IncidentKind::UncommittedTail, "a/1", false),
        1000,
    )
    .unwrap();
    let loss = incidents::insert(
        &c,
        uuid_v7(&OsEntropy, 2000).unwrap(),
        &new(wire::IncidentKind::ChecksumMismatch, "a/2", true),
        2000,
    )
    .unwrap();
    assert!(tail.repairable && !loss.repairable);
    assert!(incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/1").unwrap());
    assert!(incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/2").unwrap());
    assert!(!incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/3").unwrap());

    // repair runs the safe action, once, and resolves
    let mut calls = Vec::new();
    let req = wire::RepairStorageIncidentRequest {
        request_id: request_id(3000),
        incident_id: id_text(&tail.id),
    };
    let resp = incidents::repair(&mut c, &req, 3000, &mut |_, inc, action| {
        calls.push((inc.id, action));
        Ok(())
    })
    .unwrap();
    assert_eq!(calls, vec![(tail.id, SafeRepair::TruncateTail)]);
    let inc = resp.incident.unwrap();
    assert_eq!(inc.state, wire::IncidentState::Repaired as i32);
    assert!(!incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/1").unwrap());
    // exact replay: same answer, the action does not run again
    let again = incidents::repair(&mut c, &req, 9999, &mut |_, _, _| panic!("ran twice")).unwrap();
    assert_eq!(again.incident.unwrap(), inc);

    // loss cannot be repaired: acknowledgement only, and the refusal replays
    let req = wire::RepairStorageIncidentRequest {
        request_id: request_id(4000),
        incident_id: id_text(&loss.id),
    };
    let no_action =
        &mut |_: &rusqlite::Transaction<'_>, _: &incidents::Incident, _| panic!("no safe repair");
    assert_eq!(
        refused(incidents::repair(&mut c, &req, 4000, no_action)),
        Code::RequiresAcknowledgement
    );
    assert_eq!(
        refused(incidents::repair(&mut c, &req, 4001, no_action)),
        Code::RequiresAcknowledgement
    );
    assert!(incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/2").unwrap());

    // acknowledgement needs a note of 1 byte to 4 KiB
    let mut ack = wire::AcknowledgeStorageIncidentRequest {
        request_id: request_id(5000),
        incident_id: id_text(&loss.id),
        note: String::new(),
    };
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &ack, 5000)),
        Code::InvalidArgument
    );
    ack.note = "x".repeat(4097);
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &ack, 5000)),
        Code::TooLarge
    );
    ack.note = "disk replaced; output of one command is lost".into();
    let done = incidents::acknowledge(&mut c, &ack, 5000)
        .unwrap()
        .incident
        .unwrap();
    assert_eq!(done.state, wire::IncidentState::Acknowledged as i32);
    assert_eq!(done.acknowledgement_note, ack.note);
    assert!(!incidents::is_dirty(&c, wire::ScopeKind::Segment, "a/2").unwrap());
    assert_eq!(
        incidents::acknowledge(&mut c, &ack, 6000)
            .unwrap()
            .incident
            .unwrap(),
        done
    );

    // the same request id with another note is a conflict and changes nothing
    let mut other = ack.clone();
    other.note = "something else".into();
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &other, 7000)),
        Code::Conflict
    );
    // a new request on a resolved incident is refused; it never reopens
    other.request_id = request_id(8000);
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &other, 8000)),
        Code::FailedPrecondition
    );
    let stored = incidents::get(&c, &loss.id).unwrap().unwrap();
    assert_eq!(stored.note.as_deref(), Some(ack.note.as_str()));
    assert_eq!(stored.evidence, b"offset=4096");

    // history is kept: both incidents are still listed
    let all = incidents::list(&c, None, None, 10).unwrap();
    assert_eq!(
        all.iter().map(|i| i.id).collect::<Vec<_>>(),
        vec![loss.id, tail.id]
    );
}

#[test]
fn unknown_and_malformed_incident_ids_are_refused() {
    let (_dir, mut c) = open();
    let req = wire::AcknowledgeStorageIncidentRequest {
        request_id: request_id(1),
        incident_id: request_id(2),
        note: "n".into(),
    };
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &req, 1)),
        Code::NotFound
    );
    let mut bad = req.clone();
    bad.incident_id = "not-a-uuid".into();
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &bad, 1)),
        Code::InvalidArgument
    );
    let mut bad = req;
    bad.request_id = String::new();
    assert_eq!(
        refused(incidents::acknowledge(&mut c, &bad, 1)),
        Code::InvalidArgument
    );
}

#[test]
fn listing_pages_are_stable_under_inserts() {
    let (_dir, c) = open();
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = uuid_v7(&OsEntropy, 1000 + i).unwrap();
        incidents::insert(
            &c,
            id,
            &new(wire::IncidentKind::DiskExhaustion, "g", false),
            1000 + i,
        )
        .unwrap();
        ids.push(id);
    }
    let first = incidents::list(&c, None, None, 2).unwrap();
    assert_eq!(first.len(), 2);
    // a newer incident arrives between pages: it does not shift the next page
    incidents::insert(
        &c,
        uuid_v7(&OsEntropy, 9000).unwrap(),
        &new(wire::IncidentKind::DiskExhaustion, "g", false),
        9000,
    )
    .unwrap();
    let last = first.last().unwrap();
    let second = incidents::list(&c, None, Some((last.detected_ms, last.id)), 10).unwrap();
    let seen: Vec<_> = first.iter().chain(&second).map(|i| i.id).collect();
    let mut want = ids.clone();
    want.reverse();
    assert_eq!(seen, want);
    let open_only = incidents::list(&c, Some(wire::IncidentState::Repaired), None, 10).unwrap();
    assert!(open_only.is_empty());
}

#[test]
fn resolution_rules() {
    use wire::IncidentKind as K;
    assert_eq!(
        resolution(K::UncommittedTail, false),
        Resolution::Repair(SafeRepair::TruncateTail)
    );
    assert_eq!(
        resolution(K::CounterMismatch, false),
        Resolution::Repair(SafeRepair::RebuildCounters)
    );
    assert_eq!(
        resolution(K::FailedEviction, false),
        Resolution::Repair(SafeRepair::RollForwardEviction)
    );
    assert_eq!(
        resolution(K::DiskExhaustion, false),
        Resolution::Repair(SafeRepair::RecheckCondition)
    );
    for k in [
        K::MissingCommittedBytes,
        K::ChecksumMismatch,
        K::SqliteIntegrityFailure,
        K::StaleServer,
    ] {
        assert_eq!(resolution(k, false), Resolution::AcknowledgeOnly, "{k:?}");
    }
    // any recorded loss needs acknowledgement, whatever the kind
    assert_eq!(
        resolution(K::UncommittedTail, true),
        Resolution::AcknowledgeOnly
    );
}

#[test]
fn only_the_newest_resolved_incidents_are_kept_and_open_ones_always() {
    let (_dir, c) = open();
    let mut open_ids = Vec::new();
    for i in 0..6 {
        let id = uuid_v7(&OsEntropy, 1000 + i).unwrap();
        incidents::insert(
            &c,
            id,
            &new(wire::IncidentKind::DiskExhaustion, "g", false),
            1000 + i,
        )
        .unwrap();
        if i % 2 == 0 {
            c.execute(
                "UPDATE storage_incidents SET state = 2, resolved_ms = ?2 WHERE incident_id = ?1",
                rusqlite::params![id.as_slice(), 2000 + i],
            )
            .unwrap();
        } else {
            open_ids.push(id);
        }
    }
    assert_eq!(incidents::trim_resolved(&c, 1).unwrap(), 2);
    let left = incidents::list(&c, None, None, 10).unwrap();
    assert_eq!(left.len(), 4);
    for id in open_ids {
        assert!(left.iter().any(|i| i.id == id));
    }
    // the newest resolved one is the one kept
    assert!(
        left.iter()
            .any(|i| i.state == wire::IncidentState::Repaired && i.resolved_ms == Some(2004))
    );
}
