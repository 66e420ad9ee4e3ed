//! R1: output streams resume from a cursor. Across a partition longer
//! than the liveness timeout (both ends give the session up while the path
//! is a blackhole that closes nothing), lost acknowledgements, a stream
//! cut in the middle of a frame, and a slow path that stops and starts,
//! every byte arrives once and in order, without a protocol-error close
//! and without a daemon restart; a gap is always a record.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use rvbox_chaos::{Chaos, Command, Dir, Options, gated, lines, lines_command};

/// Heartbeat and liveness for the partition tests: long enough that the
/// client sequences well over one spool read-back batch (1,024 events)
/// into the dead session before it gives the session up, even on a loaded
/// machine (a write, a fork and a sleep per event: some 170 a second).
const HEARTBEAT: Duration = Duration::from_secs(1);
const LIVENESS: Duration = Duration::from_secs(12);

/// Longer than the liveness timeout of both ends, with room for a
/// reconnect attempt to fail inside the hole too.
fn hole(liveness: Duration) -> Duration {
    liveness * 2 + Duration::from_secs(2)
}

/// Runs `body` (gated), opens a blackhole in both directions once it has
/// started, lets it go on producing output through the hole, heals the
/// path, and checks from outside that the command succeeded with
/// `expected` as its stdout, byte for byte, with no gap record, no
/// protocol error, no panic and the same client process; returns the
/// events the client sent again.
fn survives_a_blackhole(
    c: &mut Chaos,
    liveness: Duration,
    body: &str,
    expected: &[u8],
    expected_err: &[u8],
    max: Duration,
) -> u64 {
    let uuid = c.run_bg(&gated(body));
    c.wait_running(&uuid);
    c.fault("a", &Command::Blackhole(Dir::Both));
    c.go();
    std::thread::sleep(hole(liveness));
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, max);
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(expected);
    c.assert_stream_exact(&uuid, "stdout", &want);
    c.assert_stream_exact(&uuid, "stderr", expected_err);
    let (out, notes) = c.output(&uuid, "stdout");
    assert!(out == want, "rvc output shows other bytes");
    assert!(notes.is_empty(), "gap notices: {notes}");
    let followed = c.follow(&uuid);
    assert!(followed.stdout == want, "rvc follow shows other bytes");
    assert_eq!(followed.status.code(), Some(0));
    c.assert_client_alive();
    assert!(
        c.client_metric("rvbox_client_sessions_lost") >= 1,
        "the partition never cost the client its session:\n{}",
        c.stack.logs()
    );
    c.assert_clean();
    c.client_metric("rvbox_client_events_replayed")
}

#[test]
fn r1_small_output_survives_a_blackhole_past_the_liveness_timeout() {
    // one event per write, a fork and a sleep: the slowest producer, so
    // the longest liveness timeout
    let liveness = LIVENESS + LIVENESS;
    let mut c = Chaos::start(&Options {
        timers: Some((HEARTBEAT, liveness)),
        ..Options::default()
    });
    // a few KB in some thousands of events, most of them sequenced into
    // the dead session before the client gives it up (one stream: the
    // pipe reader joins a stream's consecutive chunks, while tiny writes
    // alternating between the streams fill its 1,024-item hand-over in a
    // couple of seconds of a starved runtime thread, and are then counted
    // as CLIENT_OVERLOAD, as designed)
    let replayed = survives_a_blackhole(
        &mut c,
        liveness,
        &lines_command(6000),
        &lines(6000),
        b"",
        Duration::from_secs(150),
    );
    assert!(
        replayed > 1024,
        "the partition left only {replayed} events to send again; this test needs more than one read-back batch (1,024)"
    );
}

#[test]
fn r1_verbose_output_far_past_the_send_windows_survives_a_blackhole_past_the_liveness_timeout() {
    // through nginx (the shipped configuration); raw-backlog watermarks
    // well above a burst, so that a slow disk never puts this test's
    // output into loss mode (CLIENT_OVERLOAD markers are the right answer
    // to a burst the disk cannot keep up with, but not what this test is
    // about); the send windows stay at their defaults
    let mut c = Chaos::start(&Options {
        nginx: true,
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
        LIVENESS,
        "i=0; while [ $i -lt 6000 ]; do i=$((i+1)); printf '%0400d\\n' $i; sleep 0.001; done; \
         j=0; while [ $j -lt 20 ]; do j=$((j+1)); seq $((j*1000000)) $((j*1000000+30000)); sleep 0.3; done",
        &want,
        b"",
        Duration::from_secs(150),
    );
    assert!(
        replayed > 1024,
        "the partition left only {replayed} events to send again; this test needs more than one read-back batch (1,024)"
    );
}

/// The server stores events whose acknowledgements never reach the
/// client (the way back is dark, then the connection drops): after the
/// reconnect the client resumes from the server's durable position, and
/// nothing is stored twice.
#[test]
fn r1_lost_event_acks_resume_from_the_durable_position_through_nginx() {
    // the client hears nothing while the way back is dark: a liveness
    // timeout long enough that the server stores hundreds of events first
    let mut c = Chaos::start(&Options {
        nginx: true,
        timers: Some((HEARTBEAT, LIVENESS)),
        ..Options::default()
    });
    let uuid = c.run_bg(&gated(&lines_command(3000)));
    c.wait_running(&uuid);
    c.fault("a", &Command::Blackhole(Dir::Down));
    c.go();
    // the server stores and acknowledges; no acknowledgement arrives
    c.wait_events(&uuid, 300);
    c.fault("a", &Command::Drop);
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    want.extend_from_slice(&lines(3000));
    c.assert_stream_exact(&uuid, "stdout", &want);
    c.assert_client_alive();
    c.assert_clean();
}

/// The connection is cut in the middle of a frame, once in each direction,
/// while large output events flow.
#[test]
fn r1_a_stream_cut_mid_frame_resumes_byte_exact() {
    let mut c = Chaos::start(&Options::default());
    let body = "j=0; while [ $j -lt 24 ]; do j=$((j+1)); seq $((j*1000000)) $((j*1000000+30000)); sleep 0.25; done";
    let mut want = b"start\n".to_vec();
    for j in 1..=24u64 {
        for n in j * 1_000_000..=j * 1_000_000 + 30_000 {
            want.extend_from_slice(format!("{n}\n").as_bytes());
        }
    }
    let uuid = c.run_bg(&gated(body));
    c.wait_running(&uuid);
    c.go();
    c.wait_events(&uuid, 5);
    // 100,000 bytes from now: inside a 64 KiB output frame
    c.fault("a", &Command::Cut(Dir::Up, 100_003));
    c.stack
        .wait_until("the upward cut", || c.proxy.stats("a").unwrap().cuts >= 1);
    c.fault("a", &Command::Pass);
    c.wait_events(&uuid, 40);
    // an acknowledgement or a ping, cut on the way down
    c.fault("a", &Command::Cut(Dir::Down, 7));
    c.stack
        .wait_until("the downward cut", || c.proxy.stats("a").unwrap().cuts >= 2);
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    c.assert_stream_exact(&uuid, "stdout", &want);
    c.assert_client_alive();
    c.assert_clean();
}

/// Both data lanes are full (output events up, stdin writes down) over a
/// slow path that stops and starts: heartbeats and acknowledgements still
/// get through, no session is lost, and both streams arrive whole.
#[test]
fn r1_heartbeats_get_through_while_both_data_lanes_are_full_on_a_slow_intermittent_path() {
    let mut c = Chaos::start(&Options::default());
    // 4 MiB of stdin, every byte of it kept by the command, while it
    // writes 4.8 MB of output in bursts
    let input: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 253) as u8).collect();
    let input_path = c.stack.dir.path().join("input.bin");
    std::fs::write(&input_path, &input).unwrap();
    let got = c.stack.work().join("stdin-got");
    let body = format!(
        "exec 3<&0; cat <&3 > '{}' & j=0; while [ $j -lt 20 ]; do j=$((j+1)); seq $((j*1000000)) $((j*1000000+30000)); sleep 0.3; done; wait",
        got.display()
    );
    let uuid = c.run_bg(&gated(&body));
    c.wait_running(&uuid);
    c.fault("a", &Command::Rate(400_000, Dir::Both));
    c.go();
    let append = c
        .stack
        .rvc_cmd(&["append", "--wait-for", "120s", "--raw", "--file"])
        .arg(&input_path)
        .args(["web-1", &uuid])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // stop and start the path (under the liveness timeout each time)
    // while the append and the output are in flight
    for _ in 0..6 {
        c.fault("a", &Command::Hold(Dir::Both));
        std::thread::sleep(Duration::from_millis(700));
        c.fault("a", &Command::Release);
        std::thread::sleep(Duration::from_millis(800));
    }
    let append = append.wait_with_output().unwrap();
    assert!(
        append.status.success(),
        "rvc append: {}",
        rvbox_chaos::text(&append.stderr)
    );
    let close = c.rvc(&["close-stdin", "web-1", &uuid]);
    assert!(
        close.status.success(),
        "{}",
        rvbox_chaos::text(&close.stderr)
    );
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(120));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut want = b"start\n".to_vec();
    for j in 1..=20u64 {
        for n in j * 1_000_000..=j * 1_000_000 + 30_000 {
            want.extend_from_slice(format!("{n}\n").as_bytes());
        }
    }
    c.assert_stream_exact(&uuid, "stdout", &want);
    assert!(
        std::fs::read(&got).unwrap() == input,
        "stdin arrived other than whole and once"
    );
    assert_eq!(
        c.client_metric("rvbox_client_sessions_lost"),
        0,
        "a session was lost:\n{}",
        c.stack.logs()
    );
    assert_eq!(c.log_count("LIVENESS_TIMEOUT"), 0, "{}", c.stack.logs());
    c.assert_client_alive();
    c.assert_clean();
}
