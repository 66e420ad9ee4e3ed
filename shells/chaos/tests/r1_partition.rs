//! R1: output streams resume from a cursor across a partition longer than
//! the liveness timeout (both ends give the session up while the path is
//! a blackhole that closes nothing), with every byte arriving once, in
//! order, without a protocol-error close and without a daemon restart.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use rvbox_chaos::{Chaos, Command, Dir, Options};

/// Heartbeat and liveness for these tests: long enough that the client
/// sequences well over one spool read-back batch (1,024 events) into the
/// dead session before it gives the session up.
const HEARTBEAT: Duration = Duration::from_secs(1);
const LIVENESS: Duration = Duration::from_secs(6);

/// Longer than the liveness timeout of both ends, with room for a
/// reconnect attempt to fail inside the hole too.
fn hole() -> Duration {
    LIVENESS * 2 + Duration::from_secs(2)
}

fn start() -> Chaos {
    Chaos::start(&Options {
        timers: Some((HEARTBEAT, LIVENESS)),
        ..Options::default()
    })
}

/// A command that prints `start`, waits for the file `go` in its working
/// directory, then runs `body`.
fn gated(body: &str) -> String {
    format!("echo start; while [ ! -e go ]; do sleep 0.05; done; {body}")
}

/// Runs `command`, opens a blackhole in both directions once it has
/// started, lets it go on producing output through the hole, heals the
/// path, and checks from outside that the command ended as it should with
/// `expected` as its stdout, byte for byte, with no gap notice, no
/// protocol error, no panic and the same client process.
fn survives_a_blackhole(c: &mut Chaos, body: &str, expected: &[u8], max: Duration) -> u64 {
    let uuid = c.run_bg(&gated(body));
    c.stack.wait_until("the command runs", || {
        c.command(&uuid)["lifecycle"] == "LIFECYCLE_RUNNING"
    });
    c.fault("a", &Command::Blackhole(Dir::Both));
    std::fs::write(c.stack.work().join("go"), b"").unwrap();
    std::thread::sleep(hole());
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, max);
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(expected);
    let (out, notes) = c.output(&uuid, "stdout");
    assert!(
        out == want,
        "stdout differs from what the command wrote: {} of {} bytes stored, first difference at {:?}\n{notes}\n{}",
        out.len(),
        want.len(),
        out.iter().zip(&want).position(|(a, b)| a != b),
        c.stack.logs()
    );
    assert!(notes.is_empty(), "gap notices: {notes}");
    let followed = c.follow(&uuid);
    assert!(followed.stdout == want, "rvc follow shows other bytes");
    assert_eq!(followed.status.code(), Some(0));
    let client = c.stack.client.as_mut().unwrap();
    assert!(
        client.try_wait().unwrap().is_none(),
        "the client daemon exited:\n{}",
        c.stack.logs()
    );
    assert!(
        c.stack.client_log().contains("connected")
            && c.client_metric("rvbox_client_sessions_lost") >= 1,
        "the partition never cost the client its session:\n{}",
        c.stack.logs()
    );
    c.assert_clean();
    c.client_metric("rvbox_client_events_replayed")
}

/// The bytes of `echo "line $i"` for `1..=n`.
fn lines(n: u64) -> Vec<u8> {
    (1..=n)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect()
}

#[test]
fn r1_small_output_survives_a_blackhole_past_the_liveness_timeout() {
    let mut c = start();
    // a few KB in some thousands of events, most of them sequenced into
    // the dead session before the client gives it up
    let replayed = survives_a_blackhole(
        &mut c,
        "i=0; while [ $i -lt 4000 ]; do i=$((i+1)); echo \"line $i\"; sleep 0.001; done",
        &lines(4000),
        Duration::from_secs(90),
    );
    assert!(
        replayed > 1024,
        "the partition left only {replayed} events to send again; this test needs more than one read-back batch (1,024)"
    );
}

#[test]
fn r1_verbose_output_far_past_the_send_windows_survives_a_blackhole_past_the_liveness_timeout() {
    // raw-backlog watermarks well above a burst, so that a slow disk never
    // puts this test's output into loss mode (CLIENT_OVERLOAD markers are
    // the right answer to a burst the disk cannot keep up with, but not
    // what this test is about); the send windows stay at their defaults
    let mut c = Chaos::start(&Options {
        timers: Some((HEARTBEAT, LIVENESS)),
        client_extra: "[flow]\ncommand_high_watermark = \"8MiB\"\ncommand_low_watermark = \"4MiB\"\ndaemon_high_watermark = \"32MiB\"\ndaemon_low_watermark = \"16MiB\"\n".into(),
        ..Options::default()
    });
    // 6,000 writes of 401 bytes (2.4 MB: the 1 MiB command window fills
    // in the hole with some 2,600 events), then 4.8 MB of `seq` in bursts
    // of 240 KB (64 KiB chunks) that wait in the spool until the path heals
    let mut want = Vec::new();
    for i in 1..=6000u64 {
        want.extend_from_slice(format!("{i:0400}\n").as_bytes());
    }
    for j in 1..=20u64 {
        for n in j * 1_000_000..=j * 1_000_000 + 30_000 {
            want.extend_from_slice(format!("{n}\n").as_bytes());
        }
    }
    let replayed = survives_a_blackhole(
        &mut c,
        "i=0; while [ $i -lt 6000 ]; do i=$((i+1)); printf '%0400d\\n' $i; sleep 0.001; done; \
         j=0; while [ $j -lt 20 ]; do j=$((j+1)); seq $((j*1000000)) $((j*1000000+30000)); sleep 0.3; done",
        &want,
        Duration::from_secs(120),
    );
    assert!(
        replayed > 1024,
        "the partition left only {replayed} events to send again; this test needs more than one read-back batch (1,024)"
    );
}
