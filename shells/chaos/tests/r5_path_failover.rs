//! R5: paths fail over without the user noticing. The client has two
//! paths to the server; the first goes dark without closing (a stall), and
//! the client moves to the second as soon as it has given the stalled
//! session up, without waiting out a dial on the dead path. Its cursors
//! and spool belong to the server, not the path: nothing is sent twice or
//! lost.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::{Duration, Instant};

use rvbox_chaos::{Chaos, Command, Dir, LIVENESS, Options, gated, lines, lines_command};

#[test]
fn r5_a_stalled_path_fails_over_to_the_next_at_once_and_the_stream_goes_on() {
    let mut c = Chaos::start(&Options {
        nginx: true,
        second_path: true,
        ..Options::default()
    });
    let uuid = c.run_bg(&gated(&lines_command(3000)));
    c.wait_running(&uuid);
    c.go();
    c.wait_events(&uuid, 200);
    let before = c.proxy.stats("b").unwrap().accepted;
    let dark = Instant::now();
    c.fault("a", &Command::Blackhole(Dir::Both));
    c.stack.wait_until("the client dials the second path", || {
        c.proxy.stats("b").unwrap().accepted > before
    });
    let moved = dark.elapsed();
    // the liveness timeout, a backoff of at most reconnect.initial (1 s)
    // and slack; a dial on the dark path would add its 10 s
    assert!(
        moved < LIVENESS + Duration::from_secs(4),
        "moved to the second path only after {moved:?}"
    );
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(&lines(3000));
    c.assert_stream_exact(&uuid, "stdout", &want);
    // the first path heals; work goes on whichever path the client is on
    c.fault("a", &Command::Pass);
    let again = c.run_bg("echo after");
    let cmd = c.wait_ended(&again, Duration::from_secs(30));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    c.assert_stream_exact(&again, "stdout", b"after\n");
    c.assert_client_alive();
    c.assert_clean();
}
