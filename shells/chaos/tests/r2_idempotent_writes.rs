//! R2: every operator write carries an idempotency key, and rvc keeps it
//! for every retry of one invocation. The server is SIGKILLed at a random
//! moment inside each call (before the request arrives, while it commits,
//! after it committed but before the answer left) and restarted; every
//! call still ends with its answer, and every command ran exactly once.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Stdio;
use std::time::Duration;

use rvbox_chaos::{Chaos, Options, text};

/// A small deterministic generator for the kill moments (the seed is
/// printed, so a failure can be replayed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

fn seed() -> u64 {
    std::env::var("RVBOX_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// Runs `args` with the server SIGKILLed `kill_after` into the call and
/// restarted at once; returns rvc's output.
fn call_across_a_kill(c: &mut Chaos, args: &[&str], kill_after: Duration) -> std::process::Output {
    let child = c
        .stack
        .rvc_cmd(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(kill_after);
    c.stack.kill_server();
    c.stack.start_server();
    child.wait_with_output().unwrap()
}

#[test]
fn r2_run_and_kill_survive_a_server_killed_inside_the_call_and_act_once() {
    let seed = seed();
    eprintln!("RVBOX_CHAOS_SEED={seed}");
    let mut rng = Lcg(seed);
    let mut c = Chaos::start(&Options::default());
    let mut issues = Vec::new();
    for i in 0..16 {
        let after = Duration::from_millis(rng.next(41));
        let command = format!("echo once >> {}", c.marker(&i.to_string()).display());
        let out = call_across_a_kill(&mut c, &["run", "--background", "web-1", &command], after);
        assert!(
            out.status.success(),
            "seed {seed}: run {i} killed after {after:?} exited {:?}: {}\n{}",
            out.status.code(),
            text(&out.stderr),
            c.stack.logs()
        );
        let uuid = text(&out.stdout).trim().to_owned();
        assert_eq!(uuid.len(), 36, "seed {seed}: run {i} printed no UUID");
        issues.push(uuid);
    }
    c.wait_connected(Duration::from_secs(30));
    for (i, uuid) in issues.iter().enumerate() {
        let cmd = c.wait_ended(uuid, Duration::from_secs(60));
        assert_eq!(
            cmd["lifecycle"], "LIFECYCLE_SUCCEEDED",
            "seed {seed}: {cmd}"
        );
        assert_eq!(
            c.marker_count(&i.to_string()),
            1,
            "seed {seed}: command {i} ({uuid}) ran other than once"
        );
    }
    let listed = c.rvc(&["-o", "json", "stat", "web-1", "--per-page", "100"]);
    let v: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    // the harness's warm-up command, and one per invocation
    assert_eq!(
        v["commands"].as_array().map(Vec::len),
        Some(issues.len() + 1),
        "seed {seed}: one stored command per invocation"
    );

    // a signal, sent across a kill of the server, is applied once
    for i in 0..6 {
        let uuid = c.run_bg(&format!(
            "trap 'echo term >> {}; exit 7' TERM; while :; do sleep 0.1; done",
            c.marker(&format!("term-{i}")).display()
        ));
        c.stack.wait_until("the command runs", || {
            c.command(&uuid)["lifecycle"] == "LIFECYCLE_RUNNING"
        });
        let after = Duration::from_millis(rng.next(41));
        let out = call_across_a_kill(&mut c, &["kill", "TERM", "web-1", &uuid], after);
        assert!(
            out.status.success(),
            "seed {seed}: kill {i} killed after {after:?} exited {:?}: {}",
            out.status.code(),
            text(&out.stderr)
        );
        c.wait_connected(Duration::from_secs(30));
        let cmd = c.wait_ended(&uuid, Duration::from_secs(60));
        assert_eq!(
            cmd["lifecycle"], "LIFECYCLE_TERMINATED",
            "seed {seed}: {cmd}"
        );
        assert_eq!(cmd["exitResult"]["exitCode"], 7, "seed {seed}: {cmd}");
        assert_eq!(
            c.marker_count(&format!("term-{i}")),
            1,
            "seed {seed}: TERM delivered other than once"
        );
    }
    c.assert_clean();
}

/// The server is frozen (SIGSTOP) while `rvc run` connects and sends its
/// request, then killed: the request went out and its answer never came.
/// rvc gives up after its retry window, names the command's UUID and the
/// `rvc stat` that shows it; and where it says nothing of the kind, the
/// command was never stored.
#[test]
fn r2_a_run_that_never_gets_its_answer_says_how_to_find_the_command() {
    let mut c = Chaos::start(&Options::default());
    let request_id = "01900000-0000-7000-8000-00000000abcd";
    let pid = c.stack.server_pid().expect("the server runs");
    signal(pid, "STOP");
    let out = c
        .stack
        .rvc_cmd(&[
            "run",
            "--background",
            "--request-id",
            request_id,
            "web-1",
            "true",
        ])
        .env("RVC_RETRY_FOR", "2s")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // rvc connects (the kernel accepts on the frozen server's backlog)
    // and writes its request
    std::thread::sleep(Duration::from_millis(800));
    c.stack.kill_server();
    let out = out.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "a killed server answered: {err}");
    eprintln!("rvc said: {err}");
    assert_eq!(out.status.code(), Some(69), "{err}");
    c.stack.start_server();
    c.wait_connected(Duration::from_secs(30));
    let stat = c.stack.rvc(&["stat", "web-1", request_id]);
    if err.contains(&format!("rvc stat web-1 {request_id}")) {
        assert!(err.contains("--request-id"), "{err}");
    } else {
        // rvc never sent it, so it must not say so, and nothing is stored
        assert!(
            !stat.status.success(),
            "rvc said nothing of a stored command, but it was stored: {err}"
        );
    }
    // the same run again is answered with the one command, run once
    let again = c.stack.rvc(&[
        "run",
        "--background",
        "--request-id",
        request_id,
        "web-1",
        "true",
    ]);
    assert!(again.status.success(), "{}", text(&again.stderr));
    let cmd = c.wait_ended(request_id, Duration::from_secs(60));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    c.assert_clean();
}

fn signal(pid: u32, name: &str) {
    let st = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{name} {pid}");
}

/// The client accepts a dispatch and runs it, but its `CommandAccepted`
/// never reaches the server (the way up is dark, then the connection
/// drops). After the reconnect, reconciliation finds the client's record:
/// the command goes on, and it never runs a second time.
#[test]
fn r2_a_lost_command_accepted_never_runs_the_command_twice_through_nginx() {
    let c = Chaos::start(&Options {
        nginx: true,
        ..Options::default()
    });
    c.fault("a", &rvbox_chaos::Command::Blackhole(rvbox_chaos::Dir::Up));
    let uuid = c.run_bg(&format!(
        "echo ran >> {}; {}",
        c.marker("accepted").display(),
        rvbox_chaos::lines_command(300)
    ));
    c.stack.wait_until("the client ran the command", || {
        c.marker_count("accepted") == 1
    });
    assert_eq!(
        c.command(&uuid)["lifecycle"],
        "LIFECYCLE_DISPATCHED",
        "the server never heard of the acceptance"
    );
    c.fault("a", &rvbox_chaos::Command::Drop);
    c.fault("a", &rvbox_chaos::Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(60));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    assert_eq!(c.marker_count("accepted"), 1, "the command ran twice");
    c.assert_stream_exact(&uuid, "stdout", &rvbox_chaos::lines(300));
    c.assert_clean();
}

/// A 5 MiB script's transfer is cut in the middle of a chunk frame; the
/// upload resumes from what the client holds durably, the script is run
/// once, whole and verified.
#[test]
fn r2_a_script_transfer_cut_mid_frame_resumes_and_runs_once_through_nginx() {
    let c = Chaos::start(&Options {
        nginx: true,
        ..Options::default()
    });
    let mut script = String::from(": <<'PAYLOAD'\n");
    let mut i = 0u64;
    while script.len() < 5 << 20 {
        script.push_str(&format!("{i:064}\n"));
        i += 1;
    }
    script.push_str(&format!(
        "PAYLOAD\necho ran >> {}\necho done\n",
        c.marker("script").display()
    ));
    let path = c.stack.dir.path().join("big.sh");
    std::fs::write(&path, &script).unwrap();
    // 2 MB into the way down: inside a 256 KiB chunk frame
    c.fault(
        "a",
        &rvbox_chaos::Command::Cut(rvbox_chaos::Dir::Down, 2_000_003),
    );
    let out = c
        .stack
        .rvc_cmd(&["run", "--background", "--script"])
        .arg(&path)
        .arg("web-1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let uuid = text(&out.stdout).trim().to_owned();
    c.stack
        .wait_until("the cut", || c.proxy.stats("a").unwrap().cuts >= 1);
    c.fault("a", &rvbox_chaos::Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    assert_eq!(c.marker_count("script"), 1);
    c.assert_stream_exact(&uuid, "stdout", b"done\n");
    c.assert_clean();
}

/// A dispatched command's acceptance is held up past its queue TTL: the
/// server marks it expired pending reconciliation (never a false terminal
/// state); the late real result then becomes current, and `rvc stat`
/// shows both the expiry and the late result. It ran once.
#[test]
fn r2_a_ttl_expiry_followed_by_a_late_real_result_shows_both() {
    let c = Chaos::start(&Options::default());
    c.fault("a", &rvbox_chaos::Command::Blackhole(rvbox_chaos::Dir::Up));
    let out = c.rvc(&[
        "run",
        "--background",
        "--queue-ttl",
        "2s",
        "web-1",
        &format!("echo late >> {}; echo done", c.marker("late").display()),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let uuid = text(&out.stdout).trim().to_owned();
    c.stack
        .wait_until("the client ran it", || c.marker_count("late") == 1);
    c.stack
        .wait_until("the server marks it expired pending reconciliation", || {
            c.command(&uuid)["expiredPendingReconciliation"] == true
        });
    assert_eq!(c.command(&uuid)["lifecycle"], "LIFECYCLE_DISPATCHED");
    c.fault("a", &rvbox_chaos::Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(60));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    assert!(cmd.get("expiry").is_some_and(|e| !e.is_null()), "{cmd}");
    let shown = text(&c.rvc(&["stat", "web-1", &uuid]).stdout);
    // the expiry line and the late-result line, not the command's text
    // (which holds the word "late" too)
    assert!(
        shown
            .lines()
            .any(|l| l.trim_start().starts_with("expired ")),
        "{shown}"
    );
    assert!(
        shown
            .lines()
            .any(|l| l.trim_start().starts_with("late ") && l.contains("after the expiry")),
        "{shown}"
    );
    assert_eq!(c.marker_count("late"), 1);
    c.assert_stream_exact(&uuid, "stdout", b"done\n");
    c.assert_clean();
}
