#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Wake-ups between replicas: delivered to a listener on another
//! connection when the writing transaction commits, and never for one
//! that did not.

use std::time::Duration;

use rvbox_conformance::support::{
    NOW, live_session, op, outcomes, output_event, run, run_request, running, text,
};
use rvbox_store_pg::notify::{Listener, WakeUp};
use rvbox_store_pg::{PgStore, StoreOptions};
use rvbox_store_port::audit::Caller;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Backend, StoreOp};
use rvbox_testkit::Postgres;

const WAIT: Duration = Duration::from_millis(500);

/// Every wake-up that arrives until none came for `WAIT`.
fn drain(listener: &mut Listener) -> Vec<WakeUp> {
    let mut out = Vec::new();
    loop {
        let got = listener.wait(WAIT, 10).unwrap();
        if got.is_empty() {
            return out;
        }
        out.extend(got);
    }
}

#[test]
fn a_committed_write_wakes_the_other_replicas_and_a_refused_one_does_not() {
    let pg = Postgres::start();
    pg.psql("postgres", "CREATE DATABASE notify");
    let mut s = PgStore::connect(&pg.conninfo("notify"), StoreOptions::default()).unwrap();
    let mut listener = Listener::connect(&pg.conninfo("notify")).unwrap();
    assert!(
        listener
            .wait(Duration::from_millis(100), 10)
            .unwrap()
            .is_empty()
    );

    let issue = run(&mut s, "web-1");
    assert_eq!(
        drain(&mut listener),
        vec![WakeUp::Client {
            client: "web-1".into(),
            issue: None
        }],
        "the new command's client"
    );
    // a refused request commits nothing and wakes nobody
    let r = op(
        &mut s,
        StoreOp::RunCommand {
            request: run_request(&issue, "web-1", "something else"),
            caller: Caller::local(),
        },
    );
    assert!(r.is_err());
    assert!(
        listener
            .wait(Duration::from_millis(300), 10)
            .unwrap()
            .is_empty()
    );

    let (cmd, session) = running(&mut s, "web-2");
    let wakes = drain(&mut listener);
    assert!(
        wakes.contains(&WakeUp::Client {
            client: "web-2".into(),
            issue: None
        }),
        "{wakes:?}"
    );
    assert!(wakes.contains(&WakeUp::Command(text(&cmd))), "{wakes:?}");
    // one wake-up per command of an append group, however many events
    let events: Vec<_> = (2..6)
        .map(|seq| {
            let mut ev = output_event(&cmd, seq, b"line\n");
            ev.session = Some(session);
            ev
        })
        .collect();
    let r = s.perform(NOW, StoreOp::AppendEvents { events });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; 4]);
    assert_eq!(drain(&mut listener), vec![WakeUp::Command(text(&cmd))]);
    // a stale session's event is refused: nothing committed, no wake-up
    let stale = live_session(&mut s, "web-2");
    let _ = listener.wait(Duration::from_millis(200), 10).unwrap();
    let mut ev = output_event(&cmd, 6, b"late\n");
    ev.session = Some(session);
    let r = s.perform(NOW, StoreOp::AppendEvents { events: vec![ev] });
    assert!(matches!(outcomes(&r)[0], EventOutcome::Refused(_)));
    assert!(
        listener
            .wait(Duration::from_millis(300), 10)
            .unwrap()
            .is_empty()
    );
    assert_ne!(stale, session);
    // a signal names its command, so the replica holding the client
    // delivers it at once
    let r = op(
        &mut s,
        StoreOp::SignalCommand {
            request: rvbox_proto::v1::SignalCommandRequest {
                request_id: text(&rvbox_conformance::support::new_id()),
                issue_uuid: text(&cmd),
                signal: rvbox_proto::v1::SignalKind::Term as i32,
            },
            caller: Caller::local(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        drain(&mut listener),
        vec![WakeUp::Client {
            client: "web-2".into(),
            issue: Some(cmd)
        }]
    );
}

/// A steady trickle of notifications never holds a wake-up back: the wait
/// returns with what arrived once one came, never waiting for a full
/// batch.
#[test]
fn a_steady_trickle_of_notifications_is_passed_on_at_once() {
    let pg = Postgres::start();
    pg.psql("postgres", "CREATE DATABASE notify");
    let mut listener = Listener::connect(&pg.conninfo("notify")).unwrap();
    let conninfo = pg.conninfo("notify");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&conninfo, postgres::NoTls).unwrap();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                c.execute("SELECT pg_notify('rvbox_client', 'web-1')", &[])
                    .unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let got = listener.wait(Duration::from_secs(2), 512).unwrap();
        assert!(!got.is_empty());
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "held back {:?} for {} wake-ups",
            started.elapsed(),
            got.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    sender.join().unwrap();
}

/// Every terminal mutation its client must see (open, input, resize,
/// close) and the idle pass's close wake the replica holding the client;
/// a replay or a refusal wakes nobody; recorded output and a close wake
/// the terminal's viewers on every replica.
#[test]
fn terminal_mutations_wake_the_client_and_recorded_output_its_viewers() {
    use rvbox_proto::v1 as wire;
    use rvbox_store_port::pty::{PtyLimits, PtyMutation, PtyReport};

    let pg = Postgres::start();
    pg.psql("postgres", "CREATE DATABASE notify");
    let mut s = PgStore::connect(&pg.conninfo("notify"), StoreOptions::default()).unwrap();
    let mut listener = Listener::connect(&pg.conninfo("notify")).unwrap();
    let fence = live_session(&mut s, "web-1");
    let _ = drain(&mut listener);
    let client = vec![WakeUp::Client {
        client: "web-1".into(),
        issue: None,
    }];
    let mutate = |s: &mut PgStore, m: PtyMutation| {
        s.perform(
            NOW,
            StoreOp::PtyMutation {
                mutation: m,
                caller: Caller::local(),
                limits: PtyLimits::default(),
            },
        )
    };
    let id = rvbox_conformance::support::new_id();
    let open = PtyMutation::Open(wire::OpenPtySessionRequest {
        request_id: text(&id),
        client_id: "web-1".into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    });
    assert!(mutate(&mut s, open.clone()).is_ok());
    assert_eq!(drain(&mut listener), client, "open");
    // a replay sends nothing new
    assert!(mutate(&mut s, open).is_ok());
    assert!(drain(&mut listener).is_empty(), "replay");
    let write = PtyMutation::Write(wire::WritePtyInputRequest {
        request_id: text(&rvbox_conformance::support::new_id()),
        pty_session_id: text(&id),
        data: b"ls\r".to_vec(),
    });
    assert!(mutate(&mut s, write).is_ok());
    assert_eq!(drain(&mut listener), client, "input");
    let resize = PtyMutation::Resize(wire::ResizePtySessionRequest {
        request_id: text(&rvbox_conformance::support::new_id()),
        pty_session_id: text(&id),
        rows: 40,
        cols: 100,
    });
    assert!(mutate(&mut s, resize).is_ok());
    assert_eq!(drain(&mut listener), client, "resize");

    // output recorded wakes the terminal's viewers
    let r = s.perform(
        NOW,
        StoreOp::PtyApply {
            client_id: "web-1".into(),
            session: fence,
            reports: vec![PtyReport::Output(wire::PtyOutput {
                pty_session_id: text(&id),
                offset: 0,
                data: b"total 0\n".to_vec(),
                cut: None,
            })],
            recording_bytes: 1 << 20,
        },
    );
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(drain(&mut listener), vec![WakeUp::Command(text(&id))]);

    // the idle pass asks it to close: its client is told
    let r = s.perform(
        NOW,
        StoreOp::PtyIdle {
            idle_before_ms: NOW + 1,
            limit: 10,
        },
    );
    assert!(
        matches!(&r, Ok(rvbox_store_port::ops::Completion::PtyIdle(v)) if v.len() == 1),
        "{r:?}"
    );
    assert_eq!(drain(&mut listener), client, "idle close");
    // input to a terminal asked to close is refused: nothing is sent
    let late = PtyMutation::Write(wire::WritePtyInputRequest {
        request_id: text(&rvbox_conformance::support::new_id()),
        pty_session_id: text(&id),
        data: b"x".to_vec(),
    });
    assert!(mutate(&mut s, late).is_err());
    assert!(drain(&mut listener).is_empty(), "refused");
    let close = PtyMutation::Close(wire::ClosePtySessionRequest {
        request_id: text(&rvbox_conformance::support::new_id()),
        pty_session_id: text(&id),
    });
    assert!(mutate(&mut s, close).is_ok());
    assert_eq!(drain(&mut listener), client, "close");
}
