#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Operator repairs through the store (plan §5.5): each safe action really
//! runs, refusals hold, an audit record names the caller, and a damaged
//! segment never breaks later rotation.

mod support;

use std::io::Write;
use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::incidents::{self, NewIncident};
use rvbox_store::mutations::OpError;
use rvbox_store::operator::Caller;
use rvbox_store::{Store, StoreOptions};
use support::*;

fn caller() -> Caller {
    Caller {
        transport: "test".into(),
        principal: "uid:0".into(),
    }
}

fn open_incident(
    s: &mut Store,
    kind: wire::IncidentKind,
    scope: wire::ScopeKind,
    key: &str,
) -> [u8; 16] {
    let id = new_id();
    incidents::insert(
        s.db(),
        id,
        &NewIncident {
            kind,
            scope_kind: scope,
            scope_key: key.into(),
            client_id: None,
            issue_uuid: None,
            summary: "test".into(),
            evidence: Vec::new(),
            data_loss: false,
        },
        NOW,
    )
    .unwrap();
    id
}

fn repair(s: &mut Store, id: &[u8; 16]) -> Result<wire::RepairStorageIncidentResponse, OpError> {
    s.repair_incident(
        &wire::RepairStorageIncidentRequest {
            request_id: text(&new_id()),
            incident_id: text(id),
        },
        &caller(),
        NOW,
    )
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn repairing_an_uncommitted_tail_cuts_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, b"kept")], NOW).unwrap();
    let path = s.layout().segment_path(&id, 1).unwrap();
    let committed = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"tail")
        .unwrap();
    let incident = open_incident(
        &mut s,
        wire::IncidentKind::UncommittedTail,
        wire::ScopeKind::Segment,
        &format!("{}/1", hex(&id)),
    );
    let done = repair(&mut s, &incident).unwrap().incident.unwrap();
    assert_eq!(done.state, wire::IncidentState::Repaired as i32);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), committed);
    assert_eq!(verify_output(&s, &id), vec![2]);
    let audit = s.read_audit(0, 10).unwrap();
    assert!(
        audit
            .iter()
            .any(|(_, r)| r.action == "RepairStorageIncident" && r.principal == "uid:0")
    );
    assert_counters(&s);
}

#[test]
fn repairing_a_counter_mismatch_rebuilds_the_counters() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    running_command(&mut s, "web-1");
    s.db()
        .execute(
            "UPDATE quota_totals SET command_charged = command_charged + 777",
            [],
        )
        .unwrap();
    assert!(!s.check_counters().unwrap().consistent());
    let incident = open_incident(
        &mut s,
        wire::IncidentKind::CounterMismatch,
        wire::ScopeKind::GlobalStore,
        "",
    );
    repair(&mut s, &incident).unwrap();
    assert_counters(&s);
}

#[test]
fn a_condition_is_repaired_only_once_it_has_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.free_space_floor = u64::MAX / 2; // this disk is "full"
    let mut s = open_with(
        dir.path(),
        Arc::new(rvbox_store::fs::RealFs),
        StoreOptions {
            tiers,
            ..StoreOptions::default()
        },
    );
    let incident = open_incident(
        &mut s,
        wire::IncidentKind::DiskExhaustion,
        wire::ScopeKind::GlobalStore,
        "",
    );
    match repair(&mut s, &incident) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::FailedPrecondition),
        other => panic!("{other:?}"),
    }
    drop(s);
    let mut s = open(dir.path()); // default floor: the condition has cleared
    let incident = open_incident(
        &mut s,
        wire::IncidentKind::DiskExhaustion,
        wire::ScopeKind::GlobalStore,
        "",
    );
    assert_eq!(
        repair(&mut s, &incident).unwrap().incident.unwrap().state,
        wire::IncidentState::Repaired as i32
    );
}

#[test]
fn a_damaged_segment_in_the_middle_never_breaks_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.command_output_window = 48 * 1024;
    let opts = StoreOptions {
        tiers,
        seal_bytes: 8 * 1024,
        ..StoreOptions::default()
    };
    let id;
    {
        let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts.clone());
        id = running_command(&mut s, "web-1");
        for seq in 2..10 {
            s.append_events(&[output(&id, seq, &chunk(seq, 3000))], NOW)
                .unwrap();
        }
    }
    // damage the second segment
    let seg2 = rvbox_store::layout::Layout::new(dir.path())
        .segment_path(&id, 2)
        .unwrap();
    let mut bytes = std::fs::read(&seg2).unwrap();
    bytes[500] ^= 0xff;
    std::fs::write(&seg2, &bytes).unwrap();
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    // a sealed segment verified at seal: the background scrub finds it
    assert_eq!(s.scrub_cycle(NOW).unwrap().segments_damaged, 1);
    let incident = incidents::open(s.db(), 10).unwrap().remove(0);
    s.acknowledge_incident(
        &wire::AcknowledgeStorageIncidentRequest {
            request_id: text(&new_id()),
            incident_id: text(&incident.id),
            note: "accepted".into(),
        },
        &caller(),
        NOW,
    )
    .unwrap();
    // keep writing well past the window: rotation may take segment 1 but
    // never reaches across the damaged segment, and nothing errors
    let mut appended = 0;
    for seq in 10..30 {
        let r = s
            .append_events(&[output(&id, seq, &chunk(seq, 3000))], NOW)
            .unwrap();
        if r.outcomes == vec![rvbox_store::events::EventOutcome::Appended] {
            appended += 1;
        } else {
            break;
        }
    }
    assert!(appended > 0);
    let rows: Vec<(i64, i64, i64)> = s
        .db()
        .prepare("SELECT first_seq, last_seq, source FROM output_truncations WHERE issue_uuid = ?1 ORDER BY first_seq")
        .unwrap()
        .query_map([id.as_slice()], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // the storage-loss range stays as recorded, and no other range overlaps it
    let loss: Vec<_> = rows
        .iter()
        .filter(|r| r.2 == wire::TruncationSource::StorageLoss as i64)
        .collect();
    assert_eq!(loss.len(), 1);
    for r in &rows {
        if r.2 != wire::TruncationSource::StorageLoss as i64 {
            assert!(r.1 < loss[0].0 || r.0 > loss[0].1, "{rows:?}");
        }
    }
    s.maintain(NOW).unwrap();
    assert_counters(&s);
}
