#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Terminals on the PostgreSQL store where only it can be asked (the
//! conformance suite's terminal cases run on it as on SQLite): replicas
//! writing the same terminal at once, the bounds across replicas, the
//! audit records of each mutation, and a recording under a quota that
//! command output holds first.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};

use rvbox_conformance::support::{
    NOW, live_session, new_id, outcomes, output_event, running, text,
};
use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store_pg::{PgStore, StoreOptions};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Backend, Completion, OpResult, PortError, StoreOp};
use rvbox_store_port::pty::{PtyApplied, PtyLimits, PtyMutation, PtyReport};
use rvbox_testkit::Postgres;

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

fn database(pg: &Postgres) -> String {
    let db = format!("pty_{}", NEXT_DB.fetch_add(1, Ordering::Relaxed));
    pg.psql("postgres", &format!("CREATE DATABASE {db}"));
    db
}

fn open_req(id: &[u8; 16]) -> wire::OpenPtySessionRequest {
    wire::OpenPtySessionRequest {
        request_id: text(id),
        client_id: "web-1".into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    }
}

fn mutate(s: &mut dyn Backend, m: PtyMutation, limits: PtyLimits) -> OpResult {
    s.perform(
        NOW,
        StoreOp::PtyMutation {
            mutation: m,
            caller: Caller::local(),
            limits,
        },
    )
}

fn opened(id: &[u8; 16]) -> PtyReport {
    PtyReport::Opened(wire::PtyOpened {
        pty_session_id: text(id),
        outcome: wire::AcceptOutcome::Positive as i32,
        error: None,
        resolved_shell: wire::ShellType::Sh as i32,
    })
}

/// The same `WritePtyInput` sent to four replicas at once is numbered
/// once: every replica answers the same sequence, one input waits.
#[test]
fn the_same_input_on_several_replicas_at_once_is_numbered_once() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut first = PgStore::connect(&pg.conninfo(&db), StoreOptions::default()).unwrap();
    live_session(&mut first, "web-1");
    let id = new_id();
    let r = mutate(
        &mut first,
        PtyMutation::Open(open_req(&id)),
        PtyLimits::default(),
    );
    assert!(matches!(r, Ok(Completion::Pty(_))), "{r:?}");
    let write = wire::WritePtyInputRequest {
        request_id: text(&new_id()),
        pty_session_id: text(&id),
        data: b"uptime\r".to_vec(),
    };
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let conninfo = pg.conninfo(&db);
            let barrier = Arc::clone(&barrier);
            let write = write.clone();
            std::thread::spawn(move || {
                let mut s = PgStore::connect(&conninfo, StoreOptions::default()).unwrap();
                barrier.wait();
                match mutate(&mut s, PtyMutation::Write(write), PtyLimits::default()) {
                    Ok(Completion::Pty(o)) => o.input_seq,
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    let seqs: Vec<Option<u64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(seqs, vec![Some(1); 4], "every replica answers the same");
    assert_eq!(pg.psql(&db, "SELECT count(*) FROM pty_inputs"), "1");
    assert_eq!(
        pg.psql(&db, "SELECT input_seq FROM pty_sessions"),
        "1",
        "numbered once"
    );
    assert_eq!(
        pg.psql(&db, "SELECT count(*) FROM pty_records WHERE kind = 2"),
        "1",
        "recorded once"
    );
}

/// Opens on several replicas at once keep the bound per client: exactly
/// as many terminals open as it allows, the rest are refused.
#[test]
fn opens_on_several_replicas_at_once_keep_the_bounds() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut first = PgStore::connect(&pg.conninfo(&db), StoreOptions::default()).unwrap();
    live_session(&mut first, "web-1");
    let limits = PtyLimits {
        per_client: 5,
        ..PtyLimits::default()
    };
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let conninfo = pg.conninfo(&db);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut s = PgStore::connect(&conninfo, StoreOptions::default()).unwrap();
                barrier.wait();
                (0..3)
                    .map(|_| mutate(&mut s, PtyMutation::Open(open_req(&new_id())), limits))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<OpResult> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let opened = results
        .iter()
        .filter(|r| matches!(r, Ok(Completion::Pty(_))))
        .count();
    let refused = results
        .iter()
        .filter(|r| matches!(r, Err(PortError::Refused(e)) if e.code() == Code::CapacityExhausted))
        .count();
    assert_eq!((opened, refused), (5, 7), "{results:?}");
    assert_eq!(pg.psql(&db, "SELECT count(*) FROM pty_sessions"), "5");
}

/// Opens and closes are audited, in their own transaction when they take
/// effect and on their own when refused or replayed; input never is (it
/// may hold a password).
#[test]
fn opens_and_closes_are_audited_and_input_never() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut s = PgStore::connect(&pg.conninfo(&db), StoreOptions::default()).unwrap();
    let count = |pg: &Postgres| -> u64 {
        pg.psql(&db, "SELECT count(*) FROM audit_log")
            .parse()
            .unwrap()
    };
    let id = new_id();
    let before = count(&pg);
    let r = mutate(
        &mut s,
        PtyMutation::Open(open_req(&id)),
        PtyLimits::default(),
    );
    assert!(matches!(r, Err(PortError::Refused(_))), "{r:?}");
    assert_eq!(count(&pg), before + 1, "a refused open is audited");
    live_session(&mut s, "web-1");
    let before = count(&pg);
    for _ in 0..2 {
        let r = mutate(
            &mut s,
            PtyMutation::Open(open_req(&id)),
            PtyLimits::default(),
        );
        assert!(matches!(r, Ok(Completion::Pty(_))), "{r:?}");
    }
    assert_eq!(count(&pg), before + 2, "an open and its replay");
    let before = count(&pg);
    for _ in 0..3 {
        let r = mutate(
            &mut s,
            PtyMutation::Write(wire::WritePtyInputRequest {
                request_id: text(&new_id()),
                pty_session_id: text(&id),
                data: b"secret\r".to_vec(),
            }),
            PtyLimits::default(),
        );
        assert!(matches!(r, Ok(Completion::Pty(_))), "{r:?}");
    }
    assert_eq!(count(&pg), before, "input is never audited");
    let r = mutate(
        &mut s,
        PtyMutation::Close(wire::ClosePtySessionRequest {
            request_id: text(&new_id()),
            pty_session_id: text(&id),
        }),
        PtyLimits::default(),
    );
    assert!(matches!(r, Ok(Completion::Pty(_))), "{r:?}");
    assert_eq!(count(&pg), before + 1, "a close");
    assert_eq!(
        pg.psql(
            &db,
            "SELECT count(*) FROM audit_log WHERE position(convert_to('secret', 'UTF8') in record) > 0"
        ),
        "0",
        "no input in the audit log"
    );
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// Command output goes first: a recording keeps only what the client's
/// quota leaves after the bytes its commands are charged.
#[test]
fn a_recording_keeps_what_command_output_leaves_of_the_client_quota() {
    let pg = Postgres::start();
    let db = database(&pg);
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.command_total = 256 * 1024;
    tiers.closeout_reserve = 64 * 1024;
    tiers.command_output_window = 128 * 1024;
    tiers.per_owner_total = 256 * 1024;
    let opts = StoreOptions {
        tiers,
        ..StoreOptions::default()
    };
    let mut s = PgStore::connect(&pg.conninfo(&db), opts).unwrap();
    let (cmd, session) = running(&mut s, "web-1");
    let events: Vec<_> = (2..12u64)
        .map(|seq| {
            let mut ev = output_event(&cmd, seq, &noise(seq, 8 * 1024));
            ev.session = Some(session);
            ev
        })
        .collect();
    let r = s.perform(NOW, StoreOp::AppendEvents { events });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; 10]);
    let charged: u64 = pg
        .psql(
            &db,
            "SELECT charged_bytes FROM clients WHERE client_id = 'web-1'",
        )
        .parse()
        .unwrap();
    assert!(charged > 80 * 1024, "{charged}");

    let id = new_id();
    let r = mutate(
        &mut s,
        PtyMutation::Open(open_req(&id)),
        PtyLimits::default(),
    );
    assert!(matches!(r, Ok(Completion::Pty(_))), "{r:?}");
    let fence = live_session(&mut s, "web-1");
    for i in 0..64u64 {
        let mut reports = vec![PtyReport::Output(wire::PtyOutput {
            pty_session_id: text(&id),
            offset: i * 8192,
            data: vec![b'x'; 8192],
            cut: None,
        })];
        if i == 0 {
            reports.insert(0, opened(&id));
        }
        let r = s.perform(
            NOW,
            StoreOp::PtyApply {
                client_id: "web-1".into(),
                session: fence,
                reports,
                recording_bytes: 64 << 20,
            },
        );
        let Ok(Completion::PtyApplied(a)) = r else {
            panic!("{r:?}")
        };
        assert!(
            matches!(a.last(), Some(PtyApplied::Recorded { .. })),
            "{a:?}"
        );
    }
    let recorded: u64 = pg
        .psql(&db, "SELECT recorded_bytes FROM pty_sessions")
        .parse()
        .unwrap();
    let kept: u64 = pg
        .psql(
            &db,
            "SELECT COALESCE(sum(octet_length(data)), 0) FROM pty_records",
        )
        .parse()
        .unwrap();
    assert_eq!(recorded, kept, "the counter is what the records hold");
    assert!(
        recorded <= 256 * 1024 - charged,
        "kept {recorded} bytes; the quota leaves {}",
        256 * 1024 - charged
    );
    assert!(recorded > 0, "the room left is used");
    assert_eq!(
        pg.psql(&db, "SELECT output_offset FROM pty_sessions"),
        (64 * 8192).to_string(),
        "the offset counts every byte"
    );
}
