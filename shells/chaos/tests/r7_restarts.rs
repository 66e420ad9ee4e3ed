//! R7: restarts drop no state. The server stops (SIGTERM: sessions closed
//! 1012, clients back at once) and crashes (SIGKILL) in the middle of a
//! stream; the client daemon stops in the middle of a command and comes
//! back. What was written is stored once, what was acknowledged is never
//! lost, and nothing runs twice.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::{Duration, Instant};

use rvbox_chaos::{Chaos, Options, Piece, check_stream, gated, lines, lines_command};

#[test]
fn r7_server_restarts_mid_stream_lose_nothing_and_clients_come_back_at_once() {
    let mut c = Chaos::start(&Options::default());
    let uuid = c.run_bg(&gated(&lines_command(3000)));
    c.wait_running(&uuid);
    c.go();
    c.wait_events(&uuid, 300);
    // SIGTERM: 1012 to every session, and the client reconnects at once
    let stopped = Instant::now();
    c.stack.restart_server();
    c.wait_connected(Duration::from_secs(10));
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "the client took {:?} to come back after a restart",
        stopped.elapsed()
    );
    c.wait_progress(&uuid, 100);
    // SIGKILL in the middle of the stream
    c.stack.kill_server();
    c.stack.start_server();
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(&lines(3000));
    c.assert_stream_exact(&uuid, "stdout", &want);
    c.assert_client_alive();
    c.assert_clean();
}

#[test]
fn r7_a_client_stopped_mid_command_reports_it_interrupted_with_its_output_and_never_runs_it_again()
{
    let mut c = Chaos::start(&Options::default());
    let uuid = c.run_bg(&gated(&format!(
        "echo ran >> {}; {}",
        c.marker("once").display(),
        lines_command(100_000)
    )));
    c.wait_running(&uuid);
    c.go();
    c.wait_events(&uuid, 200);
    assert_eq!(c.stack.stop_client(), Some(0), "{}", c.stack.logs());
    c.stack.start_client();
    let cmd = c.wait_ended(&uuid, Duration::from_secs(60));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_INTERRUPTED", "{cmd}");
    assert_eq!(c.marker_count("once"), 1, "the command ran again");
    // what it wrote up to the stop is stored, each byte once, in order:
    // a prefix of the lines it would have written, then the record that
    // the rest was not captured
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(&lines(100_000));
    let pieces = c.stored_output(&uuid, "stdout");
    let stored: usize = pieces
        .iter()
        .map(|p| match p {
            Piece::Bytes(b) => b.len(),
            _ => 0,
        })
        .sum();
    assert!(stored > 200, "{pieces:?}");
    check_stream(&pieces, &want[..stored])
        .unwrap_or_else(|e| panic!("stdout of {uuid}: {e}\n{}", c.stack.logs()));
    c.assert_clean();
}
