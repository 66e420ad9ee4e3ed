//! `rvc run --script` end to end: a 5 MiB script goes to the server with
//! its progress shown on a terminal (and nothing drawn off one), reaches
//! the client in verified chunks, and runs.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::process::Command;

use support::{Stack, bin, text};

/// A script of exactly 5 MiB: two commands, then comment lines.
fn five_mib_script(path: &std::path::Path) {
    let mut body = String::from("#!/bin/sh\necho script ran\necho $((6 * 7))\nexit 0\n");
    let line = format!("# {}\n", "x".repeat(77));
    while body.len() + line.len() <= 5 * 1024 * 1024 {
        body.push_str(&line);
    }
    body.push_str(&"#".repeat(5 * 1024 * 1024 - body.len() - 1));
    body.push('\n');
    assert_eq!(body.len(), 5 * 1024 * 1024);
    std::fs::write(path, body).unwrap();
}

#[test]
fn a_five_mib_script_is_uploaded_with_progress_verified_by_the_client_and_run() {
    let s = Stack::new();
    let path = s.dir.path().join("deploy.sh");
    five_mib_script(&path);

    // on a terminal (script(1) gives rvc one): the progress bar
    let line = format!(
        "env RVC_SOCKET={} {} run --script {} web-1",
        s.socket().display(),
        bin("rvc").display(),
        path.display()
    );
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .output()
        .expect("script(1) from util-linux");
    let screen = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{screen}\n{}", s.logs());
    assert!(screen.contains("uploading deploy.sh"), "{screen}");
    assert!(screen.contains("5.00 MiB/5.00 MiB"), "{screen}");
    assert!(
        screen.contains("deploy.sh: stored on the server"),
        "{screen}"
    );
    assert!(screen.contains("script ran"), "{screen}");
    assert!(screen.contains("42"), "{screen}");
    // the client held it whole and verified before it ran
    assert!(
        s.server_log()
            .contains("script upload committed by the client"),
        "{}",
        s.logs()
    );

    // off a terminal: no bar, the output exactly
    let out = s.rvc(&["run", "--script", path.to_str().unwrap(), "web-1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "script ran\n42\n");
    assert!(
        !text(&out.stderr).contains("uploading"),
        "{}",
        text(&out.stderr)
    );

    // a file past 10 MiB is refused before anything is sent
    let big = s.dir.path().join("big.sh");
    std::fs::write(&big, vec![b'#'; 10 * 1024 * 1024 + 1]).unwrap();
    let out = s.rvc(&["run", "--script", big.to_str().unwrap(), "web-1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("at most 10485760 bytes"),
        "{}",
        text(&out.stderr)
    );
    // a script and command text together are a usage error
    let out = s.rvc(&["run", "--script", path.to_str().unwrap(), "web-1", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}
