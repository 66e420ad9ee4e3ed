//! R3: reconnecting is quiet. `rvc follow` across server restarts (a
//! SIGTERM and a SIGKILL) says "reconnecting…" once, never a stack of
//! errors, resumes from its cursor, and shows every byte once.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Stdio;
use std::time::Duration;

use rvbox_chaos::{Chaos, Options, gated, lines, lines_command, text};

#[test]
fn r3_follow_across_server_restarts_says_reconnecting_once_and_shows_every_byte() {
    let mut c = Chaos::start(&Options::default());
    let uuid = c.run_bg(&gated(&format!("{}; exit 3", lines_command(2500))));
    c.wait_running(&uuid);
    let follow = c
        .stack
        .rvc_cmd(&["follow", &uuid])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.go();
    c.wait_events(&uuid, 300);
    c.stack.restart_server();
    c.wait_progress(&uuid, 100);
    c.stack.kill_server();
    std::thread::sleep(Duration::from_millis(500));
    c.stack.start_server();
    let out = follow.wait_with_output().unwrap();
    let err = text(&out.stderr);
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(&lines(2500));
    assert!(
        out.stdout == want,
        "rvc follow showed {} bytes of {}: {err}",
        out.stdout.len(),
        want.len()
    );
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(
        err.matches("reconnecting").count(),
        1,
        "one reconnecting line, nothing else: {err:?}"
    );
    assert_eq!(err.lines().count(), 1, "nothing but the one line: {err:?}");
    c.assert_stream_exact(&uuid, "stdout", &want);
    c.assert_clean();
}
