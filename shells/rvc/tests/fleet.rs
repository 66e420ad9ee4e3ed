//! Fleet runs end to end: one server and 20 real `rvbox` daemons on
//! loopback, each with its own state directory, work directory and
//! labels, driven by `rvc run --target/--label/--all` and `rvc fleet`.
//! Covers a glob, a label selector, max-parallel (checked from marker
//! files with timestamps the commands write), max-errors, a retried
//! submission, a daemon killed mid-run, cancel, `--group`,
//! `--output-dir`, and snapshots of every fleet output of rvc.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::BTreeSet;
use std::process::Output;

use rvbox_testkit::{Fleet, text};

const HOSTS: usize = 20;

/// host-01.. : role web (odd numbers) or db (even); zone eu (1-10) or us.
fn labels(i: usize) -> String {
    let n = i + 1;
    let role = if n % 2 == 1 { "web" } else { "db" };
    let zone = if n <= 10 { "eu-west" } else { "us-east" };
    format!("{{ role = \"{role}\", zone = \"{zone}\" }}")
}

/// Output with its stdout lines sorted (hosts end in any order): JSON
/// documents by their client id, text by the line.
fn sorted(out: &Output) -> Output {
    let mut lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    let key = |l: &str| -> String {
        serde_json::from_str::<serde_json::Value>(l)
            .ok()
            .and_then(|v| v["clientId"].as_str().map(str::to_owned))
            .unwrap_or_else(|| l.to_owned())
    };
    lines.sort_by_key(|l| key(l));
    let mut stdout = lines.join("\n").into_bytes();
    if !stdout.is_empty() {
        stdout.push(b'\n');
    }
    Output {
        status: out.status,
        stdout,
        stderr: out.stderr.clone(),
    }
}

fn snap(f: &Fleet, name: &str, out: &Output) {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"\d+\.\ds", "[t]s");
    // which host was slowest is the machine's choice
    settings.add_filter(r"slowest .*", "slowest [hosts]");
    settings.add_filter(r#""changeSeq":"\d+""#, "\"changeSeq\":\"[n]\"");
    settings.add_filter(r#""signalled":\d+"#, "\"signalled\":[n]");
    if name == "fleet_resume_json" {
        // where the two released targets are depends on the machine
        settings.add_filter(r#""counts":\{[^}]*\}"#, "\"counts\":[counts]");
        settings.add_filter(r#""changeSeq":"[^"]*""#, "\"changeSeq\":\"[n]\"");
    }
    settings.bind(|| support::snapshot(&f.stack, name, out));
}

fn status(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn hosts_in(out: &Output) -> BTreeSet<String> {
    text(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(h, _)| h.to_owned()))
        .collect()
}

/// The fleet run id `rvc run` printed on stderr (`fleet run ID: ...`).
fn run_id(out: &Output) -> String {
    let err = text(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("fleet run "))
        .unwrap_or_else(|| panic!("no fleet run line in {err}"));
    line["fleet run ".len()..]
        .split(':')
        .next()
        .unwrap()
        .to_owned()
}

fn count_commands(f: &Fleet) -> usize {
    let out = f.rvc(&["-o", "json", "list", "--per-page", "1000"]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["commands"].as_array().map_or(0, Vec::len)
}

fn targets_in(f: &Fleet, run: &str, state: &str) -> usize {
    let out = f.rvc(&["fleet", "targets", run, "--state", state]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    text(&out.stdout).lines().skip(1).count()
}

#[test]
fn fleet_runs_on_twenty_daemons() {
    let mut f = Fleet::start(HOSTS, labels);

    // a glob: host-01..host-09, prefixed output, every host succeeded
    let out = f.rvc(&[
        "run",
        "--target",
        "host-0*",
        "echo hello from $(basename $(dirname $PWD))",
    ]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let want: BTreeSet<String> = (1..=9).map(|n| format!("host-{n:02}")).collect();
    assert_eq!(hosts_in(&out), want);
    for l in text(&out.stdout).lines() {
        let (host, rest) = l.split_once(": ").unwrap();
        assert_eq!(rest, format!("hello from {host}"), "each host ran it");
    }
    snap(&f, "fleet_run_glob", &sorted(&out));

    // a label selector: db hosts in eu-west are host-02..host-10 (even)
    let out = f.rvc(&[
        "run",
        "--label",
        "role=db",
        "--label",
        "zone=eu-*",
        "echo db",
    ]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let want: BTreeSet<String> = [2, 4, 6, 8, 10]
        .iter()
        .map(|n| format!("host-{n:02}"))
        .collect();
    assert_eq!(hosts_in(&out), want);
    snap(&f, "fleet_run_label", &sorted(&out));

    // JSON: one FleetTarget per target, then the run
    let out = f.rvc(&[
        "-o",
        "json",
        "run",
        "--label",
        "zone=us-east,role=web",
        "true",
    ]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let docs: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(docs.len(), 1 + 5 + 1, "the response, five targets, the run");
    assert_eq!(docs.last().unwrap()["run"]["state"], "FLEET_RUN_STATE_DONE");
    snap(&f, "fleet_run_json", &sorted(&out));

    // max-parallel: never more than 3 at once, from the commands' own
    // marker files
    let out = f.rvc(&[
        "run",
        "--all",
        "--max-parallel",
        "3",
        "date +%s%N > start; sleep 0.4; date +%s%N > end",
    ]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let mut spans = Vec::new();
    for i in 0..HOSTS {
        let read = |name: &str| -> u128 {
            std::fs::read_to_string(f.work(i).join(name))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        spans.push((read("start"), read("end")));
    }
    let most = spans
        .iter()
        .map(|(s, _)| spans.iter().filter(|(a, b)| a <= s && s < b).count())
        .max()
        .unwrap();
    assert!(
        most <= 3,
        "{most} ran at once with --max-parallel 3: {spans:?}"
    );
    assert!(most >= 2, "the run went in parallel at all: {spans:?}");

    // max-errors: every command fails; one at a time, the run stops after
    // the second failure and the rest are skipped
    let out = f.rvc(&[
        "run",
        "--all",
        "--max-parallel",
        "1",
        "--max-errors",
        "2",
        "exit 1",
    ]);
    assert_eq!(status(&out), 34, "{}", text(&out.stderr));
    let run = run_id(&out);
    assert_eq!(targets_in(&f, &run, "failed"), 2);
    assert_eq!(targets_in(&f, &run, "skipped"), HOSTS - 2);
    assert!(text(&out.stderr).contains("stopped at --max-errors"));
    snap(
        &f,
        "fleet_show_max_errors",
        &f.rvc(&["fleet", "show", &run]),
    );

    // a retried RunFleet creates nothing new
    let request = uuid::Uuid::now_v7().hyphenated().to_string();
    let before = count_commands(&f);
    let first = f.rvc(&[
        "--request-id",
        &request,
        "run",
        "--background",
        "--target",
        "host-1*",
        "true",
    ]);
    assert_eq!(status(&first), 0, "{}", text(&first.stderr));
    let again = f.rvc(&[
        "--request-id",
        &request,
        "run",
        "--background",
        "--target",
        "host-1*",
        "true",
    ]);
    assert_eq!(text(&first.stdout), text(&again.stdout), "the same run");
    assert_eq!(count_commands(&f), before + 10, "host-10..host-19, once");
    let other = f.rvc(&[
        "--request-id",
        &request,
        "run",
        "--background",
        "--target",
        "host-1*",
        "false",
    ]);
    assert_eq!(
        status(&other),
        13,
        "another request with the same id: CONFLICT"
    );
    let run = text(&first.stdout).trim().to_owned();
    let out = f.rvc(&["fleet", "follow", &run]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    snap(&f, "fleet_background", &first);

    // a daemon killed mid-run: its target ends interrupted, the others
    // succeed
    let out = f.rvc(&["run", "--background", "--all", "sleep 3"]);
    let run = text(&out.stdout).trim().to_owned();
    f.stack.wait_until("every target runs", || {
        targets_in(&f, &run, "running") == HOSTS
    });
    f.kill_client(5);
    f.start_client(5);
    let out = f.rvc(&["fleet", "follow", &run]);
    assert_eq!(status(&out), 34, "{}", text(&out.stderr));
    let t = f.rvc(&["-o", "json", "fleet", "targets", &run, "--state", "failed"]);
    let v: serde_json::Value = serde_json::from_slice(&t.stdout).unwrap();
    let failed = v["targets"].as_array().unwrap();
    assert_eq!(failed.len(), 1, "{v}");
    assert_eq!(failed[0]["clientId"], "host-06");
    assert_eq!(failed[0]["lifecycle"], "LIFECYCLE_INTERRUPTED");
    assert_eq!(targets_in(&f, &run, "succeeded"), HOSTS - 1);
    f.wait_all_connected();

    // cancel: five run, fifteen wait; the waiting ones are cancelled, the
    // running ones get TERM
    let out = f.rvc(&[
        "run",
        "--background",
        "--all",
        "--max-parallel",
        "5",
        "sleep 30",
    ]);
    let run = text(&out.stdout).trim().to_owned();
    f.stack
        .wait_until("five targets run", || targets_in(&f, &run, "running") == 5);
    let out = f.rvc(&["fleet", "cancel", &run]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("cancelled 15 target(s) before they ran; sent TERM to 5"));
    snap(&f, "fleet_cancel", &out);
    let again = f.rvc(&["fleet", "cancel", &run]);
    assert!(text(&again.stdout).contains("cancelled 0 target(s) before they ran; sent TERM to 0"));
    let out = f.rvc(&["fleet", "follow", &run]);
    assert_eq!(
        status(&out),
        34,
        "TERMed targets failed: {}",
        text(&out.stderr)
    );
    assert_eq!(targets_in(&f, &run, "cancelled"), 15);

    // --group: even hosts print "even", odd ones print "odd" and exit 3
    let group_cmd = "n=$(basename $(dirname $PWD) | cut -d- -f2 | sed 's/^0//'); if [ $((n % 2)) = 0 ]; then echo even; else echo odd; exit 3; fi";
    let out = f.rvc(&["run", "--all", "--group", group_cmd]);
    assert_eq!(status(&out), 34, "{}", text(&out.stderr));
    snap(&f, "fleet_group", &out);

    // on a terminal (a pty, through script(1)): the live status line on
    // stderr while targets end, then the table with the slowest hosts and
    // the summary line
    let rvc = f.stack.rvc_cmd(&[]);
    let line = format!(
        "{} run --target 'host-1*' --group 'sleep 0.$(( $(basename $(dirname $PWD) | cut -d- -f2 | sed s/^0//) % 5 )); echo same'",
        rvc.get_program().to_string_lossy()
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env("RVC_SOCKET", f.stack.socket())
        .output()
        .unwrap();
    let screen = text(&out.stdout);
    assert_eq!(status(&out), 0, "{screen}");
    let statuses: Vec<&str> = screen
        .split("\r\u{1b}[K")
        .filter(|s| s.starts_with('['))
        .collect();
    assert!(
        statuses.iter().any(|s| s.starts_with("[0/10] pending")
            || s.starts_with("[1/10]")
            || s.contains("running")),
        "a status line while the run went on: {screen:?}"
    );
    assert!(
        statuses
            .iter()
            .all(|s| s.split(' ').next().is_some_and(|n| n.ends_with("/10]"))),
        "{statuses:?}"
    );
    // what stays on the screen once the status line is cleared
    let mut kept = String::new();
    for piece in screen.replace("\r\n", "\n").split("\r\u{1b}[K") {
        let piece = if piece.starts_with('[') && !piece.contains('\n') {
            ""
        } else if piece.starts_with('[') {
            // a status line a later line of output followed
            piece.split_once('\n').map_or("", |(_, rest)| rest)
        } else {
            piece
        };
        kept.push_str(piece);
    }
    let tty = Output {
        status: out.status,
        stdout: kept.into_bytes(),
        stderr: Vec::new(),
    };
    snap(&f, "fleet_tty", &tty);

    // --output-dir: one file per host and stream
    let dir = f.stack.dir.path().join("out");
    let out = f.rvc(&[
        "run",
        "--target",
        "host-1?",
        "--output-dir",
        dir.to_str().unwrap(),
        "echo out; echo err >&2",
    ]);
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    for n in 10..=19 {
        let read =
            |ext: &str| std::fs::read_to_string(dir.join(format!("host-{n}.{ext}"))).unwrap();
        assert_eq!(read("stdout"), "out\n");
        assert_eq!(read("stderr"), "err\n");
        assert_eq!(read("exit"), "succeeded exit 0\n");
    }
    snap(&f, "fleet_output_dir", &out);

    // pause, resume and kill, text and JSON
    let out = f.rvc(&[
        "run",
        "--background",
        "--all",
        "--max-parallel",
        "2",
        "sleep 1",
    ]);
    let run = text(&out.stdout).trim().to_owned();
    let paused = f.rvc(&["fleet", "pause", &run]);
    assert_eq!(status(&paused), 0, "{}", text(&paused.stderr));
    snap(&f, "fleet_pause", &paused);
    let resumed = f.rvc(&["-o", "json", "fleet", "resume", &run]);
    assert_eq!(status(&resumed), 0, "{}", text(&resumed.stderr));
    snap(&f, "fleet_resume_json", &resumed);
    let killed = f.rvc(&["fleet", "kill", "USR1", &run]);
    assert_eq!(status(&killed), 0, "{}", text(&killed.stderr));
    assert!(
        text(&killed.stdout).starts_with("sent USR1 to "),
        "{}",
        text(&killed.stdout)
    );
    let killed = f.rvc(&["-o", "json", "fleet", "kill", "HUP", &run]);
    assert_eq!(status(&killed), 0, "{}", text(&killed.stderr));
    snap(&f, "fleet_kill_json", &killed);
    let out = f.rvc(&["fleet", "follow", &run]);
    assert!(matches!(status(&out), 0 | 34), "{}", text(&out.stderr));
    snap(
        &f,
        "fleet_show_json",
        &f.rvc(&["-o", "json", "fleet", "targets", &run, "--state", "pending"]),
    );

    // a server restart while a run is followed: one quiet reconnect, and
    // the run ends as if nothing happened
    let out = f.rvc(&[
        "run",
        "--background",
        "--all",
        "--max-parallel",
        "10",
        "sleep 1",
    ]);
    let run = text(&out.stdout).trim().to_owned();
    let follower = f
        .stack
        .rvc_cmd(&["fleet", "follow", &run])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    f.stack.restart_server();
    let out = follower.wait_with_output().unwrap();
    assert_eq!(status(&out), 0, "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.matches("reconnecting").count() <= 1, "{err}");
    assert!(err.contains("20 host(s): 20 succeeded"), "{err}");
    assert_eq!(text(&out.stdout).lines().count(), 0, "sleep prints nothing");

    // the listings
    let list = f.rvc(&["fleet", "list", "--per-page", "2"]);
    assert_eq!(status(&list), 0);
    snap(&f, "fleet_list", &list);
    snap(
        &f,
        "fleet_targets",
        &f.rvc(&["fleet", "targets", &run, "--state", "cancelled"]),
    );
    // the run followed across the restart: only its web hosts in us-east
    // (odd, 11..19), by their labels
    let by_label = f.rvc(&[
        "fleet",
        "targets",
        &run,
        "--state",
        "succeeded",
        "--label",
        "zone=us-*",
        "--label",
        "role=web",
    ]);
    assert_eq!(status(&by_label), 0, "{}", text(&by_label.stderr));
    let listed: BTreeSet<String> = text(&by_label.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    let want: BTreeSet<String> = [11, 13, 15, 17, 19]
        .iter()
        .map(|n| format!("host-{n:02}"))
        .collect();
    assert_eq!(listed, want);
    snap(&f, "fleet_targets_label", &by_label);
    snap(
        &f,
        "fleet_list_json",
        &f.rvc(&["-o", "json", "fleet", "list", "--per-page", "1"]),
    );
    // errors: no selection matches, a bad selector, an unknown run
    snap(
        &f,
        "fleet_error_no_match",
        &f.rvc(&["run", "--label", "role=cache", "true"]),
    );
    snap(
        &f,
        "fleet_error_selector",
        &f.rvc(&["run", "--label", "role=a b", "true"]),
    );
    snap(
        &f,
        "fleet_error_unknown",
        &f.rvc(&[
            "fleet",
            "show",
            &uuid::Uuid::now_v7().hyphenated().to_string(),
        ]),
    );
}
