#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The event append path on real SQLite and real files (plan §5.3, §5.6).

mod support;

use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::{CrashMode, FaultKind, FaultOp, FaultyFs};
use rvbox_store::mutations::OpError;
use rvbox_store::{StoreError, StoreOptions};
use support::*;

fn refused_code(o: &EventOutcome) -> Code {
    match o {
        EventOutcome::Refused(e) => e.code(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn events_are_durable_in_order_and_acknowledged_cumulatively() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let batch: Vec<_> = (2..=6)
        .map(|seq| output(&id, seq, &chunk(seq, 1000)))
        .collect();
    let r = s.append_events(&batch, NOW).unwrap();
    assert!(r.outcomes.iter().all(|o| *o == EventOutcome::Appended));
    assert_eq!(r.acked.get(&id), Some(&6));
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4, 5, 6]);
    assert_counters(&s);
}

#[test]
fn duplicate_event_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, b"hello")], NOW).unwrap();
    let before = s.check_counters().unwrap();
    // the same event again, alone and inside a later batch
    let r = s.append_events(&[output(&id, 2, b"hello")], NOW).unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Duplicate]);
    assert_eq!(r.acked.get(&id), Some(&2));
    let r = s
        .append_events(&[output(&id, 2, b"hello"), output(&id, 3, b"world")], NOW)
        .unwrap();
    assert_eq!(
        r.outcomes,
        vec![EventOutcome::Duplicate, EventOutcome::Appended]
    );
    assert_eq!(verify_output(&s, &id), vec![2, 3]);
    assert!(before.global.0 < s.check_counters().unwrap().global.0);
    assert_counters(&s);
}

#[test]
fn conflicting_duplicate_is_rejected_and_history_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, b"original")], NOW)
        .unwrap();
    let r = s
        .append_events(&[output(&id, 2, b"rewritten")], NOW)
        .unwrap();
    assert_eq!(refused_code(&r.outcomes[0]), Code::ProtocolError);
    let digest: Vec<u8> = s
        .db()
        .query_row(
            "SELECT content_sha256 FROM command_events WHERE issue_uuid = ?1 AND event_seq = 2",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(digest, rvbox_segment::sha256(b"original"));
    assert_counters(&s);
}

#[test]
fn gaps_unknown_commands_and_bad_chunks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let mut bad_size = output(&id, 2, b"abc");
    if let rvbox_store::events::EventBody::Output { raw_len, .. } = &mut bad_size.body {
        *raw_len = 2; // decompresses to more than declared
    }
    let mut not_zstd = output(&id, 2, b"abc");
    if let rvbox_store::events::EventBody::Output { stored, .. } = &mut not_zstd.body {
        *stored = b"definitely not zstd".to_vec();
    }
    let r = s
        .append_events(
            &[
                output(&id, 5, b"gap"),
                output(&new_id(), 1, b"who"),
                bad_size,
                not_zstd,
            ],
            NOW,
        )
        .unwrap();
    for o in &r.outcomes {
        assert_eq!(refused_code(o), Code::ProtocolError, "{o:?}");
    }
    assert_eq!(last_seq(&s, &id), 1);
    assert_counters(&s);
}

/// A decompression bomb (plan §11.3): a 2 KiB zstd frame that expands to
/// 16 MiB, declared as one full chunk, is refused by a decoder whose
/// capacity is the declared raw length (so it is never expanded past
/// 64 KiB); a declared raw length above the chunk limit is refused before
/// any decoding. Nothing is stored.
#[test]
fn a_decompression_bomb_is_refused_within_its_declared_length() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let bomb = zstd::bulk::compress(&vec![0u8; 16 << 20], 3).unwrap();
    assert!(bomb.len() < 4096, "{}", bomb.len());
    let max = u32::try_from(rvbox_domain::limits::MAX_RAW_CHUNK_BYTES).unwrap();
    let declared = |raw_len: u32| {
        let mut e = output(&id, 2, b"x");
        if let rvbox_store::events::EventBody::Output {
            raw_len: r, stored, ..
        } = &mut e.body
        {
            *r = raw_len;
            stored.clone_from(&bomb);
        }
        e
    };
    for (raw_len, why) in [
        (max, "does not decompress within its declared raw length"),
        (u32::MAX, "the limit is 65536"),
    ] {
        let r = s.append_events(&[declared(raw_len)], NOW).unwrap();
        match &r.outcomes[0] {
            EventOutcome::Refused(e) => {
                assert_eq!(e.code(), Code::ProtocolError, "{e}");
                assert!(e.reason().contains(why), "{raw_len}: {e}");
            }
            other => panic!("{raw_len}: expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(last_seq(&s, &id), 1);
    assert_counters(&s);
}

#[test]
fn segments_seal_at_the_target_size() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    // incompressible 60 KiB chunks: about four fit in a 256 KiB segment
    let noise = |seq: u64| -> Vec<u8> {
        let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..60 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x & 0xff) as u8
            })
            .collect()
    };
    for seq in 2..=11 {
        s.append_events(&[output(&id, seq, &noise(seq))], NOW)
            .unwrap();
    }
    let states: Vec<(u32, String, i64)> = s
        .db()
        .prepare("SELECT ordinal, state, committed_end FROM command_segments WHERE issue_uuid = ?1 ORDER BY ordinal")
        .unwrap()
        .query_map([id.as_slice()], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(states.len() >= 3, "{states:?}");
    for (i, (_, state, end)) in states.iter().enumerate() {
        assert!(*end <= 256 * 1024, "{states:?}");
        let want = if i + 1 == states.len() {
            "active"
        } else {
            "sealed"
        };
        assert_eq!(state, want);
    }
    assert_eq!(verify_output(&s, &id), (2..=11).collect::<Vec<_>>());
    assert_counters(&s);
}

#[test]
fn terminal_event_writes_the_tombstone_and_closes_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(
        &[
            output(&id, 2, b"done"),
            lifecycle(&id, 3, Lifecycle::Succeeded),
        ],
        NOW,
    )
    .unwrap();
    let (lc, exit, held): (i64, Option<i64>, i64) = s
        .db()
        .query_row(
            "SELECT lifecycle, exit_code, closeout_held FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(lc, Lifecycle::Succeeded.to_wire() as i64);
    assert_eq!(exit, Some(0));
    assert_eq!(held, 0, "unused closeout headroom is released at terminal");
    let tomb: i64 = s
        .db()
        .query_row(
            "SELECT COUNT(*) FROM command_tombstones WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tomb, 1);
    let r = s.append_events(&[output(&id, 4, b"late")], NOW).unwrap();
    assert_eq!(refused_code(&r.outcomes[0]), Code::ProtocolError);
    assert_counters(&s);
}

#[test]
fn run_command_is_idempotent_and_guarded_by_tombstones() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    let req = run_request(&id, "web-1", "uptime");
    let first = s.run_command(&req, NOW).unwrap();
    assert_eq!(first.issue_uuid, text(&id));
    assert_eq!(s.run_command(&req, NOW + 5).unwrap(), first);
    let other = run_request(&id, "web-1", "reboot");
    match s.run_command(&other, NOW) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::Conflict),
        other => panic!("{other:?}"),
    }
    // once the command ran and its history was reclaimed, the id is still refused
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    s.append_events(
        &[
            lifecycle(&id, 1, Lifecycle::Running),
            lifecycle(&id, 2, Lifecycle::Succeeded),
        ],
        NOW,
    )
    .unwrap();
    s.db()
        .execute(
            "DELETE FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
        )
        .unwrap();
    match s.run_command(&req, NOW) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::AlreadyExecuted),
        other => panic!("{other:?}"),
    }
}

#[test]
fn queue_and_quota_limits_refuse_commands() {
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        queue_max_per_client: 2,
        ..StoreOptions::default()
    };
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    s.run_command(&run_request(&new_id(), "web-1", "a"), NOW)
        .unwrap();
    s.run_command(&run_request(&new_id(), "web-1", "b"), NOW)
        .unwrap();
    match s.run_command(&run_request(&new_id(), "web-1", "c"), NOW) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::CapacityExhausted),
        other => panic!("{other:?}"),
    }
    s.run_command(&run_request(&new_id(), "web-2", "d"), NOW)
        .unwrap();
    assert_counters(&s);

    let dir = tempfile::tempdir().unwrap();
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.per_owner_total = 200 * 1024;
    let opts = StoreOptions {
        tiers,
        ..StoreOptions::default()
    };
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    let id = running_command(&mut s, "web-1");
    // the client's quota fills with the active segment of its only
    // command: nothing can be evicted or rotated, so output past the
    // quota is dropped on arrival with one exact marker (plan §5.4 item
    // 3), never refused for ever (which would hold the terminal event
    // back behind it)
    for seq in 2..60 {
        let r = s
            .append_events(&[output(&id, seq, &chunk(seq, 8 * 1024))], NOW)
            .unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended], "seq {seq}");
    }
    let (first, last, raw, source): (i64, i64, i64, i32) = s
        .db()
        .query_row(
            "SELECT first_seq, last_seq, raw_bytes, source FROM output_truncations
             WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert!(first > 2, "output fitted first");
    assert_eq!(last, 59);
    assert_eq!(
        raw,
        (last - first + 1) * 8 * 1024,
        "the marker counts exactly"
    );
    assert_eq!(
        source,
        rvbox_proto::v1::TruncationSource::ServerClientQuota as i32
    );
    let rows: i64 = s
        .db()
        .query_row(
            "SELECT COUNT(*) FROM command_events WHERE issue_uuid = ?1 AND event_seq >= ?2",
            rusqlite::params![id.as_slice(), first],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(rows, 0, "a dropped event keeps no row");
    let charged: i64 = s
        .db()
        .query_row(
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(charged <= 200 * 1024, "{charged}");
    // a repeat of a dropped event is a harmless duplicate
    let r = s
        .append_events(&[output(&id, 40, &chunk(40, 8 * 1024))], NOW)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Duplicate]);
    // the closeout headroom still takes the terminal event
    let r = s
        .append_events(&[lifecycle(&id, 60, Lifecycle::Failed)], NOW)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    assert_counters(&s);
}

#[test]
fn disk_full_and_permission_failures_acknowledge_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let mut s = open_with(dir.path(), Arc::new(fs.clone()), StoreOptions::default());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, b"before")], NOW).unwrap();

    fs.inject(FaultOp::Append, FaultKind::NoSpace);
    let err = s
        .append_events(&[output(&id, 3, b"lost-to-enospc")], NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }), "{err}");
    assert_eq!(last_seq(&s, &id), 2);
    // the failure is recorded against that command: its events now wait
    // (and only its events) until the condition is repaired
    let r = s.append_events(&[output(&id, 3, b"after")], NOW).unwrap();
    assert_eq!(refused_code(&r.outcomes[0]), Code::Unavailable);
    repair_open_incidents(&mut s, rvbox_proto::v1::IncidentKind::DiskExhaustion);
    // the short write was cut back: the next batch lands cleanly
    s.append_events(&[output(&id, 3, b"after")], NOW).unwrap();
    assert_eq!(verify_output(&s, &id), vec![2, 3]);

    fs.inject(FaultOp::Sync, FaultKind::Io);
    assert!(
        s.append_events(&[output(&id, 4, b"unsynced")], NOW)
            .is_err()
    );
    assert_eq!(last_seq(&s, &id), 3);

    // a new command's first segment cannot be created
    let other = running_command_without_output(&mut s);
    fs.inject(FaultOp::Create, FaultKind::PermissionDenied);
    assert!(s.append_events(&[output(&other, 2, b"x")], NOW).is_err());
    assert_eq!(last_seq(&s, &other), 1);
    // the other command is not held back by this one's failure
    s.append_events(&[output(&id, 4, b"still flowing")], NOW)
        .unwrap();
    assert_eq!(last_seq(&s, &id), 4);
    repair_open_incidents(&mut s, rvbox_proto::v1::IncidentKind::PermissionError);
    s.append_events(&[output(&other, 2, b"x")], NOW).unwrap();
    assert_eq!(fs.injected(), 3);
    assert_counters(&s);

    // a power cut now loses nothing that was acknowledged
    drop(s);
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    let s = open_with(dir.path(), Arc::new(fs.clone()), StoreOptions::default());
    assert_eq!(verify_output(&s, &id), vec![2, 3, 4]);
    assert_eq!(verify_output(&s, &other), vec![2]);
    assert_counters(&s);
}

/// Repairs every open incident of `kind` through the store (the condition
/// has cleared: the fault fired once).
fn repair_open_incidents(s: &mut rvbox_store::Store, kind: rvbox_proto::v1::IncidentKind) {
    let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
    assert!(open.iter().any(|i| i.kind == kind), "{open:?}");
    for i in open {
        s.repair_incident(
            &rvbox_proto::v1::RepairStorageIncidentRequest {
                request_id: text(&new_id()),
                incident_id: text(&i.id),
            },
            &rvbox_store::operator::Caller {
                transport: "test".into(),
                principal: String::new(),
            },
            NOW,
        )
        .unwrap();
    }
}

fn running_command_without_output(s: &mut rvbox_store::Store) -> [u8; 16] {
    running_command(s, "web-2")
}

#[test]
fn a_second_store_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _s = open(dir.path());
    let again = rvbox_store::Store::open(
        rvbox_store::layout::Layout::new(dir.path()),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(rvbox_store::entropy::OsEntropy),
        StoreOptions::default(),
        NOW,
    );
    assert!(matches!(again, Err(StoreError::Locked { .. })));
}

#[test]
fn metrics_count_every_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(
        &[
            output(&id, 2, b"a"),
            output(&id, 2, b"a"),
            output(&id, 9, b"gap"),
        ],
        NOW,
    )
    .unwrap();
    let m = s.metrics();
    assert_eq!(m.events_appended.get(), 2); // the running event and seq 2
    assert_eq!(m.events_duplicate.get(), 1);
    assert_eq!(
        m.events_refused
            .get_or_create(&rvbox_store::metrics::CodeLabel {
                code: "PROTOCOL_ERROR"
            })
            .get(),
        1
    );
    assert_eq!(m.commands_created.get(), 1);
    assert_eq!(m.segments_created.get(), 1);
    assert_counters(&s);
}

#[test]
fn a_terminal_event_with_the_clock_behind_the_issue_time_still_lands() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    // the wall clock stepped back ten seconds since the command was issued
    let r = s
        .append_events(&[lifecycle(&id, 2, Lifecycle::Succeeded)], NOW - 10_000)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    let (issue, terminal): (i64, i64) = s
        .db()
        .query_row(
            "SELECT issue_time_ms, terminal_time_ms FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(terminal, issue);
    assert_counters(&s);
}

#[test]
fn refused_events_never_rotate_acknowledged_output() {
    let dir = tempfile::tempdir().unwrap();
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.command_output_window = 48 * 1024;
    let opts = StoreOptions {
        tiers,
        seal_bytes: 8 * 1024,
        ..StoreOptions::default()
    };
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    let id = running_command(&mut s, "web-1");
    let mut seq = 2;
    // fill the window close to its limit
    while seq < 14 {
        let r = s
            .append_events(&[output(&id, seq, &chunk(seq, 3000))], NOW)
            .unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended], "seq {seq}");
        seq += 1;
    }
    let truncations = |s: &rvbox_store::Store| -> i64 {
        s.db()
            .query_row("SELECT COUNT(*) FROM output_truncations", [], |r| r.get(0))
            .unwrap()
    };
    let before = truncations(&s);
    // a gap, a bad chunk and an unknown command each carry big output
    let mut bad = output(&id, seq, &chunk(99, 6_000));
    if let rvbox_store::events::EventBody::Output { stored, .. } = &mut bad.body {
        *stored = vec![0u8; 100];
    }
    let r = s
        .append_events(
            &[
                output(&id, seq + 5, &chunk(1, 6_000)),
                bad,
                output(&new_id(), 1, &chunk(2, 6_000)),
            ],
            NOW,
        )
        .unwrap();
    assert!(
        r.outcomes
            .iter()
            .all(|o| matches!(o, EventOutcome::Refused(_)))
    );
    assert_eq!(truncations(&s), before, "refused events rotated nothing");
    // after the terminal event, late output rotates nothing either
    s.append_events(&[lifecycle(&id, seq, Lifecycle::Succeeded)], NOW)
        .unwrap();
    let r = s
        .append_events(&[output(&id, seq + 1, &chunk(3, 6_000))], NOW)
        .unwrap();
    assert!(matches!(&r.outcomes[0], EventOutcome::Refused(_)));
    assert_eq!(truncations(&s), before);
    assert_counters(&s);
}
