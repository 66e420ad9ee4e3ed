//! Heartbeat, liveness, clock jumps, reconnect backoff and the write lanes
//! (plan §6.1, §6.3).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Harness, ISSUE_1, closes, frame, render};
use rvbox_domain::limits::{DEFAULT_RECONNECT_STABLE_RESET_MS, MINUTE_MS};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::CloseReason;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{
    Backoff, CONTROL_BURST, CONTROL_LANE_CAPACITY, DATA_LANE_CAPACITY, Effect, Input, Lane,
    Liveness, LivenessAction, WriteScheduler,
};

fn pings(fx: &[Effect]) -> usize {
    fx.iter().filter(|e| matches!(e, Effect::Ping)).count()
}

#[test]
fn ping_and_close_thresholds_at_exactly_10_and_30_seconds() {
    let mut h = Harness::ready(1);
    let t0 = 1_000; // last inbound frame
    h.at(t0, Input::Pong);
    assert_eq!(h.s.poll_timeout(), Some(t0 + 10_000));
    let mut trace = Vec::new();
    for t in [
        t0 + 9_999,
        t0 + 10_000,
        t0 + 10_001,
        t0 + 29_999,
        t0 + 30_000,
    ] {
        let fx = h.at(t, Input::Timeout);
        trace.push(format!("t={t} deadline={:?}", h.s.poll_timeout()));
        trace.extend(render(t, &fx));
        match t - t0 {
            9_999 => assert!(fx.is_empty()),
            10_000 => assert_eq!(pings(&fx), 1),
            10_001 | 29_999 => assert!(fx.is_empty(), "one ping per silent period"),
            30_000 => assert_eq!(closes(&fx), vec![CloseReason::LivenessTimeout]),
            _ => unreachable!(),
        }
    }
    assert_eq!(h.s.poll_timeout(), None);
    insta::assert_debug_snapshot!(trace);
}

#[test]
fn pong_at_25_seconds_resets_liveness() {
    let mut h = Harness::ready(1);
    h.at(0, Input::Pong);
    assert_eq!(pings(&h.at(10_000, Input::Timeout)), 1);
    assert_eq!(h.s.poll_timeout(), Some(30_000));
    h.at(25_000, Input::Pong);
    assert_eq!(h.s.poll_timeout(), Some(35_000));
    // 30 s after the start is only 5 s of silence now
    assert!(h.at(30_000, Input::Timeout).is_empty());
    assert!(h.at(34_999, Input::Timeout).is_empty());
    assert_eq!(pings(&h.at(35_000, Input::Timeout)), 1);
    assert!(closes(&h.at(54_999, Input::Timeout)).is_empty());
    assert_eq!(
        closes(&h.at(55_000, Input::Timeout)),
        vec![CloseReason::LivenessTimeout]
    );
}

#[test]
fn any_valid_envelope_counts_as_activity() {
    let mut h = Harness::ready(1);
    let capacity = frame(
        common::SID_1,
        1,
        Payload::ClientCapacity(wire::ClientCapacity::default()),
    );
    h.at(20_000, Input::Binary(capacity));
    assert_eq!(h.s.poll_timeout(), Some(30_000));
    h.at(29_000, Input::Ping);
    assert!(closes(&h.at(58_999, Input::Timeout)).is_empty());
}

#[test]
fn liveness_trace_with_silence_ping_and_recovery() {
    let mut h = Harness::ready(1);
    let mut trace = Vec::new();
    let mut step = |h: &mut Harness, t: u64, input: Input| {
        let label = format!("{input:?}");
        let fx = h.at(t, input);
        trace.push(format!("t={t} <- {label} next={:?}", h.s.poll_timeout()));
        trace.extend(render(t, &fx));
    };
    step(&mut h, 0, Input::Pong);
    step(&mut h, 10_000, Input::Timeout);
    step(&mut h, 12_000, Input::Pong);
    step(&mut h, 22_000, Input::Timeout);
    step(&mut h, 42_000, Input::Timeout);
    insta::assert_debug_snapshot!(trace);
}

#[test]
fn wall_clock_jump_kills_nothing() {
    // Wall time is not an input to liveness at all. The client's events
    // carry wall-clock observation times that jump a day forward and then
    // back; a shell whose monotonic reading "goes backwards" (a caller bug)
    // is clamped. Activity every 5 s keeps the session open for 2 minutes.
    let mut h = Harness::ready(1);
    let wall = [
        1_700_000_000i64,
        1_700_086_400,
        1_600_000_000,
        1_700_000_005,
    ];
    for (i, t) in (0..=120_000u64).step_by(5_000).enumerate() {
        let fx = if i % 2 == 0 {
            h.at(t, Input::Pong)
        } else {
            let mut ev = common::lifecycle_event(ISSUE_1, 0, wire::Lifecycle::Running);
            ev = wire::CommandEvent {
                event_seq: u64::try_from(i / 2 + 1).unwrap(),
                body: Some(wire::command_event::Body::Diagnostics(
                    wire::Diagnostics::default(),
                )),
                observed_time: Some(Default::default()),
                ..ev
            };
            if let Some(ts) = ev.observed_time.as_mut() {
                ts.seconds = wall[i % wall.len()];
            }
            h.now = t;
            h.event(ev)
        };
        assert!(closes(&fx).is_empty(), "closed at {t}: {fx:?}");
        let fx = h.at(t, Input::Timeout);
        assert!(closes(&fx).is_empty() && pings(&fx) == 0, "at {t}: {fx:?}");
    }
    // a backwards monotonic reading is treated as "no time passed"
    let fx = h.at(60_000, Input::Timeout);
    assert!(fx.is_empty());
    assert_eq!(h.s.poll_timeout(), Some(130_000));
}

#[test]
fn liveness_is_idempotent_per_tick() {
    let mut l = Liveness::new(0, 10_000, 30_000);
    assert_eq!(l.on_timeout(10_000), LivenessAction::Ping);
    assert_eq!(l.on_timeout(10_000), LivenessAction::Nothing);
    assert_eq!(l.deadline(), 30_000);
    l.on_inbound(5_000); // earlier than before: ignored as a time, still activity
    assert_eq!(l.last_inbound_ms(), 5_000);
    assert_eq!(l.on_timeout(35_000), LivenessAction::Close);
    assert_eq!(l.on_timeout(35_000), LivenessAction::Close);
}

#[test]
fn backoff_resets_only_after_a_continuous_60_second_session() {
    let mut b = Backoff::default();
    assert_eq!(DEFAULT_RECONNECT_STABLE_RESET_MS, MINUTE_MS);
    assert_eq!(b.cap_ms(), 1_000);
    assert_eq!(b.next_delay_ms(u64::MAX), u64::MAX % 1_001);
    assert_eq!(b.cap_ms(), 2_000);
    b.next_delay_ms(0);
    b.next_delay_ms(0);
    assert_eq!(b.attempt(), 3);
    // up for 59.999 s: not stable, no reset
    b.on_connected(100_000);
    assert!(!b.on_disconnected(159_999));
    assert_eq!(b.attempt(), 3);
    assert_eq!(b.cap_ms(), 8_000);
    // up for exactly 60 s: reset
    b.on_connected(200_000);
    assert!(b.is_stable(260_000));
    assert!(b.on_disconnected(260_000));
    assert_eq!(b.attempt(), 0);
    // never connected: disconnect does not reset
    b.next_delay_ms(7);
    assert!(!b.on_disconnected(999_999));
    assert_eq!(b.attempt(), 1);
    // the cap never exceeds the maximum
    for _ in 0..100 {
        assert!(b.next_delay_ms(u64::MAX) <= 60_000);
    }
    assert_eq!(b.cap_ms(), 60_000);
}

#[test]
fn ping_bypasses_a_full_data_lane() {
    let mut w: WriteScheduler<&str> = WriteScheduler::default();
    for _ in 0..DATA_LANE_CAPACITY {
        w.push(Lane::Data, "data").unwrap();
    }
    assert!(!w.data_has_room());
    // a full data lane hands the frame back: the work stays durable
    let full = w.push(Lane::Data, "more").unwrap_err();
    assert_eq!((full.lane, full.frame), (Lane::Data, "more"));
    w.push(Lane::Control, "ping").unwrap();
    assert_eq!(w.next_frame(), Some((Lane::Control, "ping")));
    assert_eq!(w.next_frame(), Some((Lane::Data, "data")));
    assert!(w.data_has_room());
}

#[test]
fn control_burst_then_one_data_frame() {
    let mut w: WriteScheduler<u32> = WriteScheduler::default();
    let n = u32::try_from(CONTROL_BURST).unwrap() + 4;
    for i in 0..n {
        w.push(Lane::Control, i).unwrap();
    }
    w.push(Lane::Data, 100).unwrap();
    w.push(Lane::Data, 101).unwrap();
    let order: Vec<(Lane, u32)> = std::iter::from_fn(|| w.next_frame()).collect();
    let lanes: Vec<Lane> = order.iter().map(|(l, _)| *l).collect();
    let mut want = vec![Lane::Control; CONTROL_BURST];
    want.push(Lane::Data);
    want.extend([Lane::Control; 4]);
    want.push(Lane::Data);
    assert_eq!(lanes, want);
    assert!(w.is_empty());
}

#[test]
fn full_control_lane_is_reported() {
    let mut w: WriteScheduler<u32> = WriteScheduler::default();
    for i in 0..CONTROL_LANE_CAPACITY {
        w.push(Lane::Control, u32::try_from(i).unwrap()).unwrap();
    }
    let e = w.push(Lane::Control, 9_999).unwrap_err();
    assert_eq!(e.lane, Lane::Control);
    assert_eq!(w.len(Lane::Control), CONTROL_LANE_CAPACITY);
}

/// A client that answers every Ping but never completes its snapshot is
/// closed `RECONCILE_TIMEOUT` once the reconcile timeout has passed since
/// its welcome, not before; liveness alone never would close it.
#[test]
fn a_session_never_reconciled_is_closed_at_the_reconcile_timeout() {
    let mut c = common::config();
    c.reconcile_timeout_ms = 45_000;
    let mut h = Harness::with_config(c);
    let token = h.hello();
    h.input(Input::Registered {
        token,
        session_id: common::sid(common::SID_1),
        generation: 1,
    });
    // welcomed at 0; the client stays alive, its snapshot never completes
    let mut t = 0;
    while t + 5_000 < 45_000 {
        t += 5_000;
        h.at(t, Input::Pong);
        assert!(
            closes(&h.at(t, Input::Timeout)).is_empty(),
            "closed early at {t}"
        );
        assert_eq!(h.s.poll_timeout(), Some((t + 10_000).min(45_000)));
    }
    assert!(closes(&h.at(44_999, Input::Timeout)).is_empty());
    let fx = h.at(45_000, Input::Timeout);
    assert_eq!(closes(&fx), vec![CloseReason::ReconcileTimeout]);
    assert!(common::has_audit(
        &fx,
        rvbox_session::AuditKind::ReconcileTimeout
    ));
    assert_eq!(h.s.poll_timeout(), None);
}

/// Once the result is written the reconcile deadline is gone.
#[test]
fn a_reconciled_session_has_no_reconcile_deadline() {
    let mut c = common::config();
    c.reconcile_timeout_ms = 15_000;
    let mut h = Harness::with_config(c);
    let token = h.hello();
    h.input(Input::Registered {
        token,
        session_id: common::sid(common::SID_1),
        generation: 1,
    });
    assert_eq!(h.s.poll_timeout(), Some(10_000));
    h.at(
        5_000,
        Input::ReconcileWritten(wire::ReconcileResult {
            round: 1,
            ..Default::default()
        }),
    );
    for t in [10_000, 14_000, 15_000, 16_000, 24_000] {
        h.at(t, Input::Pong);
        assert!(closes(&h.at(t, Input::Timeout)).is_empty(), "closed at {t}");
    }
}
