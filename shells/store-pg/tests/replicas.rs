#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Replica leases on the database clock, single-runner duties, and the
//! janitor that ends the sessions of a lost replica, with two replicas on
//! one private PostgreSQL (short leases, so a lost lease ends within the
//! test).

use std::time::Duration;

use rvbox_conformance::support::{client, live_session};
use rvbox_store_pg::{PgStore, StoreOptions};
use rvbox_store_port::replica::{Duty, LeaseTimes};
use rvbox_testkit::Postgres;

const TIMES: LeaseTimes = LeaseTimes {
    lease_ms: 1_500,
    renew_every_ms: 300,
    self_fence_ms: 1_000,
};

fn two(pg: &Postgres) -> (PgStore, PgStore) {
    pg.psql("postgres", "CREATE DATABASE replicas");
    let mut a = PgStore::connect(&pg.conninfo("replicas"), StoreOptions::default()).unwrap();
    let mut b = PgStore::connect(&pg.conninfo("replicas"), StoreOptions::default()).unwrap();
    let ra = a.join(Some("10.0.0.1:7443"), TIMES).unwrap();
    let rb = b.join(Some("10.0.0.2:7443"), TIMES).unwrap();
    assert_ne!(ra.id, rb.id);
    assert!(rb.epoch > ra.epoch, "epochs from one sequence");
    (a, b)
}

/// Renews `live` for a little longer than one lease, so every other
/// replica's lease ends meanwhile.
fn renew_through_a_lease(live: &mut PgStore) {
    let deadline = std::time::Instant::now() + Duration::from_millis(TIMES.lease_ms + 300);
    while std::time::Instant::now() < deadline {
        assert!(live.renew().unwrap());
        std::thread::sleep(Duration::from_millis(TIMES.renew_every_ms));
    }
}

#[test]
fn a_duty_runs_on_one_replica_until_its_lease_ends_then_on_another() {
    assert!(TIMES.is_sound());
    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    for duty in Duty::ALL {
        assert!(a.hold_duty(duty).unwrap(), "{duty:?} free");
        assert!(!b.hold_duty(duty).unwrap(), "{duty:?} is a's");
    }
    // a renews and keeps its duties
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(TIMES.renew_every_ms));
        assert!(a.renew().unwrap());
        assert!(b.renew().unwrap());
        assert!(a.hold_duty(Duty::Expiry).unwrap());
        assert!(!b.hold_duty(Duty::Expiry).unwrap());
    }
    // a stops renewing (paused, partitioned, killed): its lease ends,
    // while b renews its own
    renew_through_a_lease(&mut b);
    assert!(b.hold_duty(Duty::Expiry).unwrap(), "b takes a lost duty");
    assert!(!a.renew().unwrap(), "an ended lease is never renewed");
    assert!(!a.hold_duty(Duty::Expiry).unwrap(), "a lost it");
    assert!(
        !a.hold_duty(Duty::Maintenance).unwrap(),
        "a replica whose own lease ended takes no duty, even a free one"
    );
    // a joins again, with a new epoch, and waits for the duty like anyone
    let again = a.join(None, TIMES).unwrap();
    assert!(again.epoch > b.replica().unwrap().epoch);
    assert!(!a.hold_duty(Duty::Expiry).unwrap());
}

#[test]
fn the_janitor_ends_the_sessions_of_a_lost_replica_and_no_other() {
    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    live_session(&mut a, "on-a");
    live_session(&mut b, "on-b");
    assert_eq!(b.end_sessions_of_lost_replicas(0).unwrap(), 0, "both live");
    // a is lost; b renews its own lease throughout
    renew_through_a_lease(&mut b);
    assert!(b.hold_duty(Duty::Janitor).unwrap());
    assert_eq!(b.end_sessions_of_lost_replicas(0).unwrap(), 1);
    assert_eq!(client(&mut b, "on-a").unwrap().live, None);
    assert!(client(&mut b, "on-b").unwrap().live.is_some());
    assert_eq!(b.end_sessions_of_lost_replicas(0).unwrap(), 0, "once");
}

/// A replica paused past its lease wakes to find its own sessions fenced
/// (before any janitor or reconnection ended them) and its registrations
/// refused; the other replica's sessions write on.
#[test]
fn a_replica_past_its_lease_commits_nothing_for_its_sessions_and_registers_none() {
    use rvbox_conformance::support::{accept, dispatch, op, refused, registration, run};
    use rvbox_domain::error::Code;
    use rvbox_store_port::ops::StoreOp;
    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    let on_a = live_session(&mut a, "on-a");
    let on_b = live_session(&mut b, "on-b");
    let cmd_a = run(&mut a, "on-a");
    let cmd_b = run(&mut b, "on-b");
    // while a's lease is live its session writes
    dispatch(&mut a, &cmd_a, on_a);
    renew_through_a_lease(&mut b);
    // a "wakes": its lease ended; its session row is still live
    assert!(client(&mut b, "on-a").unwrap().live.is_some());
    let revision = rvbox_conformance::support::view(&mut a, &cmd_a).revision;
    let r = op(
        &mut a,
        StoreOp::RecordAccepted {
            issue: cmd_a,
            revision,
            resolved_shell: rvbox_proto::v1::ShellType::Sh as i32,
            session: on_a,
        },
    );
    assert_eq!(refused(&r), Some(Code::StaleSession), "{r:?}");
    // b's session writes on
    dispatch(&mut b, &cmd_b, on_b);
    accept(&mut b, &cmd_b, on_b);
    // a registers nothing any more
    let reg = registration("fresh", [7; 16], None);
    let r = op(&mut a, StoreOp::Register(reg));
    assert!(r.is_err(), "{r:?}");
    assert!(
        a.renew().is_ok_and(|renewed| !renewed),
        "and is not renewed"
    );
}

/// Sleeps once at the commit point, as a paused process would, or as a
/// commit still on the wire.
#[derive(Debug)]
struct PauseOnce {
    armed: std::sync::atomic::AtomicBool,
    for_: Duration,
}

impl PauseOnce {
    fn new(for_: Duration) -> Self {
        Self {
            armed: std::sync::atomic::AtomicBool::new(true),
            for_,
        }
    }
}

impl rvbox_store::crash::CrashHook for PauseOnce {
    fn at(&self, point: &str) {
        if point == rvbox_store_pg::points::BEFORE_COMMIT
            && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            std::thread::sleep(self.for_);
        }
    }
}

/// A replica paused in the middle of a write for a client's session
/// (its row locked `FOR SHARE`) holds back that client's registration on
/// another replica only until the database ends the idle transaction; the
/// paused write then commits nothing.
#[test]
fn a_write_paused_mid_transaction_holds_back_another_replicas_registration_only_briefly() {
    use rvbox_conformance::support::{output_event, running, view};
    use rvbox_store_port::ops::{Backend, StoreOp};
    use std::sync::Arc;

    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    let (cmd, session) = running(&mut a, "web-1");
    a.set_crash_hook(Arc::new(PauseOnce::new(Duration::from_secs(9))));
    let paused = std::thread::spawn(move || {
        let mut ev = output_event(&cmd, 2, b"paused\n");
        ev.session = Some(session);
        a.perform(0, StoreOp::AppendEvents { events: vec![ev] })
    });
    std::thread::sleep(Duration::from_millis(500));
    let started = std::time::Instant::now();
    let moved = live_session(&mut b, "web-1");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(8),
        "the registration waited {waited:?} for the paused transaction"
    );
    assert_ne!(moved, session);
    let r = paused.join().unwrap();
    // the database ended the paused session: the write is answered
    // UNAVAILABLE (its sender retries on its next connection)
    assert!(
        matches!(r, Err(rvbox_store_port::ops::PortError::Unavailable(_))),
        "the paused write: {r:?}"
    );
    assert_eq!(view(&mut b, &cmd).last_event_seq, 1, "nothing of it stored");
}

/// A replica killed with its last write's COMMIT already sent but not yet
/// arrived (a SIGKILL does not recall bytes on the wire): that write lands
/// before its client's registration on another replica, never after it.
/// The write is a dispatch, the replica's own decision for the session
/// (output would be the client's bytes, the same whoever stores them). It
/// holds its session row `FOR SHARE`, and the registration that ends the
/// session waits for it; without that lock the dispatch would commit to a
/// session already ended. Here the commit arrives 2 s late, within the
/// database's idle limit, so it lands; past the limit it lands nowhere
/// (the test above).
#[test]
fn a_dispatch_on_the_wire_when_its_replica_dies_lands_before_the_client_moves() {
    use rvbox_conformance::support::{run, view};
    use rvbox_store_port::ops::{Backend, Completion, StoreOp};
    use std::sync::Arc;
    use std::time::Instant;

    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    let session = live_session(&mut a, "web-1");
    let cmd = run(&mut a, "web-1");
    let revision = view(&mut a, &cmd).revision;
    a.set_crash_hook(Arc::new(PauseOnce::new(Duration::from_secs(2))));
    let in_flight = std::thread::spawn(move || {
        let r = a.perform(
            0,
            StoreOp::Dispatch {
                issue: cmd,
                revision,
                write: true,
                session,
            },
        );
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let moved = live_session(&mut b, "web-1");
    let registered = Instant::now();
    assert_ne!(moved, session);
    let (r, committed) = in_flight.join().unwrap();
    assert!(
        matches!(&r, Ok(Completion::Spec(_))),
        "the dispatch whose commit arrived late: {r:?}"
    );
    let waited = registered - started;
    assert!(
        waited >= Duration::from_secs(1) && registered >= committed,
        "the registration ended the session after {waited:?}, while a dispatch to it was \
         still to commit: it committed {:?} after the move",
        committed.saturating_duration_since(registered)
    );
}

/// Maintenance runs only on the replica holding its duty: another replica
/// asked to maintain evicts nothing, whatever is due.
#[test]
fn only_the_maintenance_duty_holder_evicts() {
    use rvbox_conformance::support::{lifecycle_event, op, outcomes, running};
    use rvbox_domain::lifecycle::Lifecycle;
    use rvbox_store_port::events::EventOutcome;
    use rvbox_store_port::ops::{Backend, Completion, StoreOp};
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let pg = Postgres::start();
    let (mut a, mut b) = two(&pg);
    let (done, session) = running(&mut a, "web-1");
    let mut ev = lifecycle_event(&done, 2, Lifecycle::Succeeded);
    ev.session = Some(session);
    let r = op(&mut a, StoreOp::AppendEvents { events: vec![ev] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    assert!(a.hold_duty(Duty::Maintenance).unwrap());
    let later = rvbox_conformance::support::NOW + 31 * DAY_MS;
    let Ok(Completion::Maintained(r)) = b.perform(later, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert_eq!(r.evicted_aged, 0, "b does not hold the duty: {r:?}");
    let Ok(Completion::Maintained(r)) = a.perform(later, StoreOp::Maintain) else {
        panic!("Maintain")
    };
    assert_eq!(r.evicted_aged, 1, "{r:?}");
}
