#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Runs the real `rvbox-server` binary with `--check-config`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rvbox-server"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

#[test]
fn example_is_valid_and_prints_the_summary() {
    let out = run(&["--check-config", "docs/examples/server.toml"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with(
        "# rvbox-server effective configuration\n# source: docs/examples/server.toml\n"
    ));
    for line in [
        "[storage]",
        "data_dir = \"/var/lib/rvbox-server\"",
        "ttl = \"15m\"",
        "command_output_window = \"10MiB\"",
        "enabled = false",
    ] {
        assert!(stdout.contains(line), "summary lacks {line}:\n{stdout}");
    }
}

#[test]
fn invalid_fixtures_fail_naming_key_and_line() {
    let cases = [
        (
            "server-unknown-key.toml",
            "fixtures/config/server-unknown-key.toml:3:1: storage.data_directory: unknown key",
        ),
        (
            "server-bare-duration.toml",
            "fixtures/config/server-bare-duration.toml:3:18: session.heartbeat_idle: durations are strings",
        ),
        (
            "server-watermark-inverted.toml",
            "fixtures/config/server-watermark-inverted.toml:4:1: flow.ingress_low_watermark: flow.ingress_low_watermark (64MiB) must be below flow.ingress_high_watermark (32MiB)",
        ),
        (
            "server-duplicate-key.toml",
            "fixtures/config/server-duplicate-key.toml:4:1: queue.ttl: duplicate key",
        ),
        (
            "server-above-ceiling.toml",
            "fixtures/config/server-above-ceiling.toml:3:16: limits.max_envelope: 2MiB exceeds the v1 ceiling of 1MiB",
        ),
    ];
    for (file, expected) in cases {
        let path = format!("fixtures/config/{file}");
        let out = run(&["--check-config", &path]);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(out.stdout.is_empty(), "{file}: nothing on stdout");
        assert!(
            stderr.contains(expected),
            "{file}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn unreadable_and_non_utf8_files_are_named() {
    let out = run(&["--check-config", "fixtures/config/does-not-exist.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("fixtures/config/does-not-exist.toml: cannot read")
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("latin1.toml");
    std::fs::write(&bad, b"# caf\xe9\n").unwrap();
    let out = run(&["--check-config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid UTF-8"));
}

#[test]
fn flags_override_and_touch_no_state() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = run(&[
        "--check-config",
        "docs/examples/server.toml",
        "--storage-data-dir",
        data.to_str().unwrap(),
        "--queue-ttl",
        "90m",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("ttl = \"1h30m\""));
    assert!(
        !data.exists(),
        "--check-config must not create the data directory"
    );
    // A flag is parsed like the file: a bare-number duration is refused.
    let out = run(&[
        "--check-config",
        "docs/examples/server.toml",
        "--queue-ttl",
        "90",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--queue-ttl: queue.ttl: missing unit"));
}

#[test]
fn start_exits_with_its_own_status() {
    // the agent port is taken: the server says so and exits 1 before it
    // opens anything
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nagent_listen = \"127.0.0.1:{port}\"\n[storage]\ndata_dir = \"{}/data\"\n[control]\nruntime_dir = \"{}/run\"\nsocket_path = \"{}/run/control.sock\"\n",
            dir.path().display(),
            dir.path().display(),
            dir.path().display()
        ),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot listen on"), "{err}");
    assert!(!dir.path().join("data").exists(), "nothing opened");
    let out = run(&["--config", "fixtures/config/server-unknown-key.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("rvbox-server "));
}

#[test]
fn answers_help_and_version() {
    let out = run(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("rvbox-server {}", env!("CARGO_PKG_VERSION"))
    );
    let out = run(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "--config <FILE>",
        "--check-config <FILE>",
        "--observability-log-level",
    ] {
        assert!(help.contains(needle), "{needle} missing from:\n{help}");
    }
}
