//! Stdin end to end (plan §9.1, §9.2): `rvc append --attach` streams
//! rvc's own stdin into a running `cat`, a replayed append is not written
//! twice, `rvc close-stdin` ends the process, and stdin written before the
//! client holds the command reaches it after its acceptance.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::{Stack, issue_of, text};

/// Waits until `rvc follow`-style output of `issue` (read with GetOutput
/// through `rvc follow --after 0` would block) shows `want`: reads the
/// command's stored output with a short-lived follow.
fn output_of(s: &Stack, issue: &str) -> String {
    // `rvc follow` ends only with the command; `stat` shows the record
    let mut child = s
        .rvc_cmd(&["follow", issue])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    text(&out.stdout)
}

fn wait_output(s: &Stack, issue: &str, want: &str) {
    let t = Instant::now();
    loop {
        let got = output_of(s, issue);
        if got.contains(want) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "output never showed {want:?}: {got:?}\n{}",
            s.logs()
        );
    }
}

#[test]
fn attach_streams_stdin_a_replay_is_written_once_and_close_ends_the_process() {
    let s = Stack::new();
    let out = s.rvc(&["run", "--background", "web-1", "cat"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let issue = issue_of(&out);

    // an interactive attach: lines as an operator types them
    let mut attach = s
        .rvc_cmd(&["append", "--attach", "web-1", &issue])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = attach.stdin.take().unwrap();
    input.write_all(b"hello\n").unwrap();
    input.flush().unwrap();
    wait_output(&s, &issue, "hello\n");
    input.write_all(b"world\n").unwrap();
    drop(input); // end of file: rvc stops attaching, stdin stays open
    let done = attach.wait_with_output().unwrap();
    assert_eq!(done.status.code(), Some(0), "{}", text(&done.stderr));
    assert!(
        text(&done.stderr).contains("written to the process's stdin"),
        "{}",
        text(&done.stderr)
    );

    // one append, sent twice with the same request id: written once
    let id = uuid::Uuid::now_v7().hyphenated().to_string();
    for _ in 0..2 {
        let out = s.rvc(&["--request-id", &id, "append", "web-1", &issue, "once"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    // --raw: no newline after the text
    let out = s.rvc(&["append", "--raw", "web-1", &issue, "tail"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let out = s.rvc(&["close-stdin", "web-1", &issue]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let followed = s.rvc(&["follow", &issue]);
    assert_eq!(
        followed.status.code(),
        Some(0),
        "{}",
        text(&followed.stderr)
    );
    assert_eq!(text(&followed.stdout), "hello\nworld\nonce\ntail");

    // the command ended: stdin is refused with the reason
    let late = s.rvc(&["append", "web-1", &issue, "late"]);
    assert_eq!(late.status.code(), Some(17), "{}", text(&late.stderr));
    assert!(
        text(&late.stderr).contains("FAILED_PRECONDITION"),
        "{}",
        text(&late.stderr)
    );
    // a command of another client is refused before anything is sent
    let wrong = s.rvc(&["append", "db-1", &issue, "x"]);
    assert_eq!(wrong.status.code(), Some(12), "{}", text(&wrong.stderr));
}

#[test]
fn stdin_written_before_the_client_holds_the_command_reaches_it_after_acceptance() {
    let mut s = Stack::server_only();
    let out = s.rvc(&["run", "--background", "web-1", "cat"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let issue = issue_of(&out);
    let early = s.rvc(&["append", "--no-wait", "web-1", &issue, "early"]);
    assert_eq!(early.status.code(), Some(0), "{}", text(&early.stderr));
    let file = s.dir.path().join("input.bin");
    std::fs::write(&file, b"from a file\n").unwrap();
    let out = s.rvc(&[
        "append",
        "--no-wait",
        "--file",
        file.to_str().unwrap(),
        "web-1",
        &issue,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = s.rvc(&["close-stdin", "--no-wait", "web-1", &issue]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    s.start_client();
    let followed = s.rvc(&["follow", &issue]);
    assert_eq!(
        followed.status.code(),
        Some(0),
        "{}\n{}",
        text(&followed.stderr),
        s.logs()
    );
    assert_eq!(text(&followed.stdout), "early\nfrom a file\n");
}
