#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! What only the PostgreSQL store has: output kept as checksummed chunks
//! in the database, a connection killed mid-transaction, and two replicas
//! writing the same rows at once.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use rvbox_conformance::support::{
    NOW, live_session, new_id, op, outcomes, output_event, run, run_request, running, view,
};
use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_store_pg::{PgStore, StoreOptions, points};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Backend, Completion, PortError, StoreOp};
use rvbox_testkit::Postgres;

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

fn database(pg: &Postgres) -> String {
    let db = format!("store_{}", NEXT_DB.fetch_add(1, Ordering::Relaxed));
    pg.psql("postgres", &format!("CREATE DATABASE {db}"));
    db
}

fn connect(pg: &Postgres, db: &str) -> PgStore {
    PgStore::connect(&pg.conninfo(db), StoreOptions::default()).unwrap()
}

#[test]
fn output_is_kept_as_checksummed_chunks_and_a_damaged_chunk_is_never_served() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut s = connect(&pg, &db);
    let (issue, session) = running(&mut s, "web-1");
    let raw: Vec<u8> = (0..40_000u32)
        .flat_map(|n| n.to_le_bytes())
        .take(60_000)
        .collect();
    let mut events = Vec::new();
    for (n, piece) in [b"first line\n".to_vec(), raw.clone()]
        .into_iter()
        .enumerate()
    {
        let mut ev = output_event(&issue, 2 + n as u64, &piece);
        ev.session = Some(session);
        events.push(ev);
    }
    let r = op(&mut s, StoreOp::AppendEvents { events });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; 2]);
    let chunks = s.output_chunks(&issue, 1, 10).unwrap();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].event_seq, 2);
    assert_eq!(chunks[0].raw().unwrap(), b"first line\n");
    assert_eq!(chunks[1].raw().unwrap(), raw);
    // a replayed event is a duplicate: no second chunk
    let mut again = output_event(&issue, 2, b"first line\n");
    again.session = Some(session);
    let r = op(
        &mut s,
        StoreOp::AppendEvents {
            events: vec![again],
        },
    );
    assert_eq!(outcomes(&r), vec![EventOutcome::Duplicate]);
    assert_eq!(s.output_chunks(&issue, 1, 10).unwrap().len(), 2);

    // the bytes are damaged where they rest: the read names the chunk
    let other = zstd::bulk::compress(b"other line\n", 1).unwrap();
    let hex: String = other.iter().map(|b| format!("{b:02x}")).collect();
    pg.psql(
        &db,
        &format!("UPDATE output_chunks SET stored = '\\x{hex}'::bytea WHERE event_seq = 2"),
    );
    let damaged = s.output_chunks(&issue, 2, 1).unwrap();
    let e = damaged[0].raw().unwrap_err().to_string();
    assert!(e.contains("output chunk 2") && e.contains("SHA-256"), "{e}");
    pg.psql(
        &db,
        "UPDATE output_chunks SET stored = '\\x00'::bytea WHERE event_seq = 3",
    );
    let e = s.output_chunks(&issue, 3, 1).unwrap()[0]
        .raw()
        .unwrap_err()
        .to_string();
    assert!(e.contains("output chunk 3"), "{e}");

    // a read meets the damage and fails rather than serve it
    let mut reader = s.readers().open_pg().unwrap();
    let ask = rvbox_proto::v1::GetOutputRequest {
        issue_uuid: rvbox_conformance::support::text(&issue),
        streams: vec![rvbox_proto::v1::OutputStream::Stdout as i32],
        max_bytes: 1 << 20,
        ..Default::default()
    };
    assert!(
        rvbox_store::reader::ControlReads::get_output(&mut reader, &ask).is_err(),
        "a damaged chunk is never served"
    );
    // the scrub finds both: an incident each, and a truncation over each
    // event, so the output reads again and says what was lost
    let report = scrub_cycle(&mut s);
    assert_eq!(report.segments_damaged, 2, "{report:?}");
    assert!(report.segments_verified >= 2, "{report:?}");
    let kinds = pg.psql(
        &db,
        "SELECT kind || ' ' || data_loss::text FROM storage_incidents ORDER BY detected_ms",
    );
    assert_eq!(
        kinds,
        format!(
            "{k} true\n{k} true",
            k = rvbox_proto::v1::IncidentKind::ChecksumMismatch as i32
        )
    );
    let page = rvbox_store::reader::ControlReads::get_output(&mut reader, &ask).unwrap();
    let lost: Vec<_> = page
        .items
        .iter()
        .filter_map(|i| match &i.item {
            Some(rvbox_proto::v1::output_item::Item::Retention(t)) => {
                Some((t.first_event_seq, t.last_event_seq))
            }
            _ => None,
        })
        .collect();
    assert_eq!(lost, vec![(2, 2), (3, 3)], "{page:?}");
    // a second cycle finds nothing new
    let again = scrub_cycle(&mut s);
    assert_eq!(again.segments_damaged, 0, "{again:?}");
}

/// Runs scrub slices until one completes a cycle.
fn scrub_cycle(s: &mut PgStore) -> rvbox_store_port::maintenance::ScrubReport {
    let mut total = rvbox_store_port::maintenance::ScrubReport::default();
    for n in 0..1_000 {
        // a new cycle is due once the interval passed since the last one
        let at = NOW + i64::from(n) * 3_600_000 * 24;
        let Ok(Completion::Scrubbed(r)) = s.perform(at, StoreOp::Scrub) else {
            panic!("Scrub failed");
        };
        total.segments_verified += r.segments_verified;
        total.segments_damaged += r.segments_damaged;
        total.counter_mismatches += r.counter_mismatches;
        total.clients_recounted += r.clients_recounted;
        if r.cycle_completed {
            return total;
        }
    }
    panic!("no scrub cycle completed");
}

/// The scrub's recount finds counters that differ from what they count,
/// rebuilds them, and records a `COUNTER_MISMATCH` incident; a consistent
/// store gets none.
#[test]
fn the_scrub_rebuilds_counters_that_differ_from_a_recount() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut s = connect(&pg, &db);
    let (_, _) = running(&mut s, "web-1");
    run(&mut s, "web-2");
    let clean = scrub_cycle(&mut s);
    assert_eq!(clean.counter_mismatches, 0, "{clean:?}");
    assert_eq!(clean.clients_recounted, 2, "{clean:?}");
    let charged = pg.psql(
        &db,
        "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'",
    );
    pg.psql(
        &db,
        "UPDATE clients SET charged_bytes = charged_bytes + 12345 WHERE client_id = 'web-1';
         UPDATE quota_totals SET queued = queued + 7;
         UPDATE queued_by_client SET queued = 9 WHERE client_id = 'web-2'",
    );
    let found = scrub_cycle(&mut s);
    assert_eq!(found.counter_mismatches, 1, "{found:?}");
    assert_eq!(
        pg.psql(
            &db,
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'"
        ),
        charged
    );
    assert_eq!(
        pg.psql(
            &db,
            "SELECT queued || ' ' || (SELECT queued FROM queued_by_client WHERE client_id = 'web-2')
             FROM quota_totals"
        ),
        "1 1",
        "web-2's one queued command"
    );
    let incident = pg.psql(
        &db,
        "SELECT kind || ' ' || state || ' ' || summary FROM storage_incidents",
    );
    assert!(
        incident.starts_with(&format!(
            "{} 2 ",
            rvbox_proto::v1::IncidentKind::CounterMismatch as i32
        )) && incident.contains("web-1"),
        "recorded, and resolved by the rebuild: {incident}"
    );
    let after = scrub_cycle(&mut s);
    assert_eq!(after.counter_mismatches, 0, "{after:?}");

    // an operator's repair of an open counter incident rebuilds them too
    pg.psql(
        &db,
        "UPDATE clients SET charged_bytes = charged_bytes + 999 WHERE client_id = 'web-1'",
    );
    let r = s.perform(
        NOW,
        StoreOp::RecordIncident(rvbox_store_port::incidents::NewIncident {
            kind: rvbox_proto::v1::IncidentKind::CounterMismatch,
            scope_kind: rvbox_proto::v1::ScopeKind::GlobalStore,
            scope_key: String::new(),
            client_id: None,
            issue_uuid: None,
            summary: "a counter differs".into(),
            evidence: Vec::new(),
            data_loss: false,
        }),
    );
    assert!(matches!(r, Ok(Completion::Done)), "{r:?}");
    let id = pg.psql(
        &db,
        "SELECT encode(incident_id, 'hex') FROM storage_incidents WHERE state = 1",
    );
    let id = format!(
        "{}-{}-{}-{}-{}",
        &id[..8],
        &id[8..12],
        &id[12..16],
        &id[16..20],
        &id[20..]
    );
    let r = s.perform(
        NOW,
        StoreOp::RepairIncident {
            request: rvbox_proto::v1::RepairStorageIncidentRequest {
                request_id: rvbox_conformance::support::text(&new_id()),
                incident_id: id,
            },
            caller: Caller::local(),
        },
    );
    assert!(matches!(r, Ok(Completion::Incident(_))), "{r:?}");
    assert_eq!(
        pg.psql(
            &db,
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'"
        ),
        charged
    );
    assert_eq!(
        pg.psql(
            &db,
            "SELECT count(*) FROM storage_incidents WHERE state = 1"
        ),
        "0"
    );
}

/// Terminates the store's own connection from another one, once, at the
/// crash point it is armed for.
#[derive(Debug)]
struct KillConnection {
    armed: AtomicBool,
    point: &'static str,
    pid: i32,
    conninfo: String,
    fired: Mutex<u32>,
}

impl rvbox_store::crash::CrashHook for KillConnection {
    fn at(&self, point: &'static str) {
        if point == self.point && self.armed.swap(false, Ordering::SeqCst) {
            // another connection, as an operator or a failover would
            let mut other = postgres::Client::connect(&self.conninfo, postgres::NoTls).unwrap();
            let killed: bool = other
                .query_one("SELECT pg_terminate_backend($1)", &[&self.pid])
                .unwrap()
                .get(0);
            assert!(killed);
            *self.fired.lock().unwrap() += 1;
        }
    }
}

#[test]
fn a_connection_killed_before_its_commit_commits_nothing_and_the_store_connects_again() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut s = connect(&pg, &db);
    let issue = run(&mut s, "web-1");
    let session = live_session(&mut s, "web-1");
    let hook = Arc::new(KillConnection {
        armed: AtomicBool::new(true),
        point: points::BEFORE_COMMIT,
        pid: s.backend_pid().unwrap(),
        conninfo: pg.conninfo(&db),
        fired: Mutex::new(0),
    });
    s.set_crash_hook(hook.clone());
    let dispatch = StoreOp::Dispatch {
        issue,
        revision: 1,
        write: true,
        session,
    };
    let r = op(&mut s, dispatch.clone());
    assert_eq!(*hook.fired.lock().unwrap(), 1);
    assert!(matches!(r, Err(PortError::Unavailable(_))), "{r:?}");
    // nothing of it committed; the next operation connects again
    assert_eq!(view(&mut s, &issue).lifecycle, Lifecycle::Queued);
    assert!(matches!(op(&mut s, dispatch), Ok(Completion::Spec(_))));
    assert_eq!(view(&mut s, &issue).lifecycle, Lifecycle::Dispatched);
}

#[test]
fn two_replicas_registering_one_client_at_once_install_one_session() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut first = connect(&pg, &db);
    // both decide on the same record: no client yet
    let seen = rvbox_conformance::support::client(&mut first, "web-1");
    assert_eq!(seen, None);
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|n| {
            let conninfo = pg.conninfo(&db);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut s = PgStore::connect(&conninfo, StoreOptions::default()).unwrap();
                let reg =
                    rvbox_conformance::support::registration("web-1", [n as u8 + 1; 16], None);
                barrier.wait();
                s.perform(NOW, StoreOp::Register(reg))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let won = results
        .iter()
        .filter(|r| matches!(r, Ok(Completion::Registered { generation: 1 })))
        .count();
    let refused = results
        .iter()
        .filter(|r| matches!(r, Err(PortError::Refused(e)) if e.code() == Code::Conflict))
        .count();
    assert_eq!((won, refused), (1, 1), "{results:?}");
    let rec = rvbox_conformance::support::client(&mut first, "web-1").unwrap();
    assert_eq!(rec.generation, 1);
    assert!(rec.live.is_some());
}

#[test]
fn the_same_run_command_on_two_replicas_at_once_creates_one_command() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut first = connect(&pg, &db);
    let id = new_id();
    let request = run_request(&id, "web-1", "make test");
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let conninfo = pg.conninfo(&db);
            let barrier = Arc::clone(&barrier);
            let request = request.clone();
            std::thread::spawn(move || {
                let mut s = PgStore::connect(&conninfo, StoreOptions::default()).unwrap();
                barrier.wait();
                s.perform(
                    NOW,
                    StoreOp::RunCommand {
                        request,
                        caller: Caller::local(),
                    },
                )
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for r in &results {
        assert_eq!(r, &results[0], "every replica answers the same");
    }
    assert!(matches!(results[0], Ok(Completion::RunCommand(_))));
    assert_eq!(view(&mut first, &id).lifecycle, Lifecycle::Queued);
    let counted: String = pg.psql(&db, "SELECT count(*) FROM commands");
    assert_eq!(counted, "1");
}

/// The audit log is kept within its budget, oldest rows first, and rows
/// older than the audit retention go; the newest stay. Rows are counted
/// by the maintenance pass once they are a minute old.
#[test]
fn the_audit_log_is_trimmed_to_its_budget_and_its_retention() {
    const HOUR_MS: i64 = 3_600_000;
    let pg = Postgres::start();
    let db = database(&pg);
    let budget = 5_000u64;
    let mut s = PgStore::connect(
        &pg.conninfo(&db),
        StoreOptions {
            audit_budget_bytes: budget,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    for i in 0..200 {
        run(&mut s, &format!("web-{}", i % 7));
    }
    let size = || -> (u64, u64, u64) {
        let row = pg.psql(
            &db,
            "SELECT count(*) || ' ' || COALESCE(sum(octet_length(record)), 0) || ' ' || COALESCE(max(seq), 0) FROM audit_log",
        );
        let v: Vec<u64> = row.split(' ').map(|x| x.parse().unwrap()).collect();
        (v[0], v[1], v[2])
    };
    let (rows, bytes, newest) = size();
    assert!(
        bytes > 2 * budget,
        "the test writes past the budget: {bytes}"
    );
    // a minute has not passed: nothing is counted, nothing trimmed
    let Ok(Completion::Maintained(r)) = s.perform(NOW + 1_000, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert_eq!(r.audit_rotated, 0, "{r:?}");
    // an hour later the oldest go, down to the budget
    let Ok(Completion::Maintained(r)) = s.perform(NOW + HOUR_MS, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    let (rows_after, bytes_after, newest_after) = size();
    assert!(r.audit_rotated > 0 && rows_after < rows, "{r:?}");
    assert_eq!(rows - rows_after, r.audit_rotated);
    assert!(bytes_after <= budget, "{bytes_after} > {budget}");
    assert!(
        bytes_after > budget / 2,
        "no more than needed went: {bytes_after}"
    );
    assert_eq!(newest_after, newest, "the newest rows stay");
    // a second pass trims nothing more
    let Ok(Completion::Maintained(r)) = s.perform(NOW + HOUR_MS, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert_eq!(r.audit_rotated, 0, "{r:?}");

    // with a retention of one hour, everything two hours old goes
    let mut s = PgStore::connect(
        &pg.conninfo(&db),
        StoreOptions {
            audit_budget_bytes: budget,
            audit_retention_ms: 3_600_000,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let Ok(Completion::Maintained(_)) = s.perform(NOW + 2 * HOUR_MS, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert_eq!(size().0, 0, "every row was older than the retention");
}

/// 8 KiB of incompressible bytes.
fn noise(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..8192)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0xff) as u8
        })
        .collect()
}

/// A running command's output is a rolling window: past its output
/// window, its oldest output is rotated out (truncation rows of the window
/// cause covering exactly the rotated events, their charge released), so
/// it keeps its last bytes, byte for byte; a rotated event sent again is a
/// duplicate.
#[test]
fn output_past_the_window_rotates_the_oldest_out() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.command_total = 256 * 1024;
    tiers.closeout_reserve = 64 * 1024;
    tiers.command_output_window = 128 * 1024;
    let mut s = PgStore::connect(
        &pg.conninfo(&db),
        StoreOptions {
            tiers,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let (cmd, session) = running(&mut s, "web-1");
    let mut all = Vec::new();
    for seq in 2..62u64 {
        let mut ev = output_event(&cmd, seq, &noise(seq));
        ev.session = Some(session);
        all.push(ev.clone());
        let r = s.perform(NOW, StoreOp::AppendEvents { events: vec![ev] });
        assert_eq!(outcomes(&r), vec![EventOutcome::Appended], "seq {seq}");
    }
    // the stored output is the last events, contiguous up to the end
    let kept: Vec<u64> = pg
        .psql(
            &db,
            "SELECT event_seq FROM command_events WHERE body_kind = 4 ORDER BY 1",
        )
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    let first_kept = kept[0];
    assert!(first_kept > 2 && kept.len() > 8, "{kept:?}");
    assert_eq!(kept, (first_kept..62).collect::<Vec<_>>());
    // the truncation rows cover exactly what was rotated, by the window
    let rows: Vec<(u64, u64, i32)> = pg
        .psql(
            &db,
            "SELECT first_seq || ' ' || last_seq || ' ' || source FROM output_truncations
             ORDER BY first_seq",
        )
        .lines()
        .map(|l| {
            let v: Vec<i64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
            (v[0] as u64, v[1] as u64, v[2] as i32)
        })
        .collect();
    let mut next = 2;
    for (a, b, source) in &rows {
        assert_eq!(*a, next, "{rows:?}");
        assert_eq!(
            *source,
            rvbox_proto::v1::TruncationSource::ServerCommandWindow as i32
        );
        next = b + 1;
    }
    assert_eq!(next, first_kept, "{rows:?}");
    assert!(rows.len() < 20, "rotations go in steps: {rows:?}");
    // the window holds: the output counter is within it, and the kept
    // bytes read back exactly
    let output: u64 = pg
        .psql(&db, "SELECT output_charged FROM commands")
        .parse()
        .unwrap();
    assert!(output <= 128 * 1024, "{output}");
    let chunks = s.output_chunks(&cmd, 1, 100).unwrap();
    assert_eq!(chunks.len(), kept.len());
    for c in &chunks {
        assert_eq!(
            c.raw().unwrap(),
            noise(c.event_seq),
            "event {}",
            c.event_seq
        );
    }
    // a rotated event sent again is a duplicate
    let r = s.perform(
        NOW,
        StoreOp::AppendEvents {
            events: vec![all[0].clone()],
        },
    );
    assert_eq!(outcomes(&r), vec![EventOutcome::Duplicate]);
}

/// Options with small tiers: a 64 KiB closeout reserve, a 128 KiB window,
/// a 256 KiB command total, and `owner` bytes per client.
fn small_tiers(owner: u64) -> StoreOptions {
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.command_total = 256 * 1024;
    tiers.closeout_reserve = 64 * 1024;
    tiers.command_output_window = 128 * 1024;
    tiers.per_owner_total = owner;
    StoreOptions {
        tiers,
        // maintenance relieves a client down to 32 KiB under its quota
        eviction_slack_bytes: 32 * 1024,
        ..StoreOptions::default()
    }
}

/// Output past a client's quota, held by a running command's own older
/// output, is refused (transiently) rather than dropped: maintenance
/// rotates that older output out under the client-quota cause, and the
/// refused event, sent again, is stored.
#[test]
fn output_past_a_client_quota_waits_for_maintenance_to_rotate_older_output() {
    let pg = Postgres::start();
    let db = database(&pg);
    // the closeout reserve and about 96 KiB of output
    let mut s = PgStore::connect(&pg.conninfo(&db), small_tiers(160 * 1024)).unwrap();
    let (cmd, session) = running(&mut s, "web-1");
    let mut refused = None;
    for seq in 2..62u64 {
        let mut ev = output_event(&cmd, seq, &noise(seq));
        ev.session = Some(session);
        let r = s.perform(
            NOW,
            StoreOp::AppendEvents {
                events: vec![ev.clone()],
            },
        );
        match outcomes(&r).as_slice() {
            [EventOutcome::Appended] => {}
            [EventOutcome::Refused(e)] if e.code() == Code::QuotaExceeded => {
                refused = Some(ev);
                break;
            }
            other => panic!("seq {seq}: {other:?}"),
        }
    }
    let refused = refused.expect("the client's quota fills");
    assert!(
        refused.event_seq > 8 && refused.event_seq < 20,
        "{}",
        refused.event_seq
    );
    assert_eq!(
        pg.psql(&db, "SELECT count(*) FROM output_truncations"),
        "0",
        "nothing dropped while maintenance can relieve it"
    );
    let Ok(Completion::Maintained(m)) = s.perform(NOW, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert!(m.pressure_rotations >= 1, "{m:?}");
    assert_eq!(m.owner_shortfall, 0, "{m:?}");
    let rows = pg.psql(
        &db,
        "SELECT first_seq || ' ' || source FROM output_truncations",
    );
    assert_eq!(
        rows,
        format!(
            "2 {}",
            rvbox_proto::v1::TruncationSource::ServerClientQuota as i32
        ),
        "the oldest output rotated out"
    );
    let r = s.perform(
        NOW,
        StoreOp::AppendEvents {
            events: vec![refused],
        },
    );
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
}

/// Output past a client's quota held by data nothing can relieve (two
/// running commands' closeout reserves, no output to rotate, nothing
/// terminal) is dropped on arrival with a truncation row that covers
/// exactly the dropped events (one row for a run of them), never refused
/// for ever: the terminal event that follows is stored, and a dropped
/// event sent again is a duplicate.
#[test]
fn output_past_an_unrelievable_quota_is_dropped_with_a_truncation_row() {
    use rvbox_conformance::support::lifecycle_event;
    let pg = Postgres::start();
    let db = database(&pg);
    // two commands (66 KiB each: spec and closeout reserve) and a little
    let mut s = PgStore::connect(&pg.conninfo(&db), small_tiers(146 * 1024)).unwrap();
    let (_, _) = running(&mut s, "web-1");
    let (cmd, session) = running(&mut s, "web-1");
    let mut all = Vec::new();
    for seq in 2..62u64 {
        let mut ev = output_event(&cmd, seq, &noise(seq));
        ev.session = Some(session);
        all.push(ev.clone());
        let r = s.perform(NOW, StoreOp::AppendEvents { events: vec![ev] });
        assert_eq!(outcomes(&r), vec![EventOutcome::Appended], "seq {seq}");
    }
    assert_eq!(
        pg.psql(
            &db,
            "SELECT count(*) FROM command_events WHERE body_kind = 4",
        ),
        "0"
    );
    let rows = pg.psql(
        &db,
        "SELECT first_seq || ' ' || last_seq || ' ' || raw_bytes || ' ' || source
         FROM output_truncations",
    );
    assert_eq!(
        rows,
        format!(
            "2 61 {} {}",
            60 * 8192,
            rvbox_proto::v1::TruncationSource::ServerClientQuota as i32
        ),
        "one row for the whole run of dropped events"
    );
    // the terminal event is stored
    let mut end = lifecycle_event(&cmd, 62, Lifecycle::Succeeded);
    end.session = Some(session);
    let r = s.perform(NOW, StoreOp::AppendEvents { events: vec![end] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    assert_eq!(view(&mut s, &cmd).lifecycle, Lifecycle::Succeeded);
    // a dropped event sent again is a duplicate
    let r = s.perform(
        NOW,
        StoreOp::AppendEvents {
            events: vec![all[55].clone()],
        },
    );
    assert_eq!(outcomes(&r), vec![EventOutcome::Duplicate]);
}

/// A reader dropped on a thread of an async runtime (the control service
/// at the server's stop) closes its connection without panicking: the
/// blocking client's close cannot run on such a thread.
#[test]
fn a_reader_dropped_inside_an_async_runtime_closes_quietly() {
    let pg = Postgres::start();
    let db = database(&pg);
    let s = connect(&pg, &db);
    let reader = s.readers().open_pg().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    rt.block_on(async move {
        tokio::spawn(async move { drop(reader) }).await.unwrap();
    });
}
