#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Runs the real `rvbox` binary with `--check-config`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rvbox"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

#[test]
fn example_is_valid_and_prints_the_summary() {
    let out = run(&["--check-config", "docs/examples/client.toml"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout
            .starts_with("# rvbox effective configuration\n# source: docs/examples/client.toml\n")
    );
    for line in [
        "[shells]",
        "default = \"sh\"",
        "initial = \"1s\"",
        "daemon_total = \"256MiB\"",
    ] {
        assert!(stdout.contains(line), "summary lacks {line}:\n{stdout}");
    }
    // The shell is shown as the canonical executable that will run.
    let sh = std::fs::canonicalize("/bin/sh").unwrap();
    assert!(stdout.contains(&format!("sh = \"{}\"", sh.display())));
}

#[test]
fn invalid_fixtures_fail_naming_key_and_line() {
    let cases = [
        (
            "client-unknown-key.toml",
            "fixtures/config/client-unknown-key.toml:3:1: exec.max_runing: unknown key",
        ),
        (
            "client-bare-duration.toml",
            "fixtures/config/client-bare-duration.toml:3:11: reconnect.initial: durations are strings",
        ),
        (
            "client-watermark-inverted.toml",
            "fixtures/config/client-watermark-inverted.toml:4:1: flow.command_low_watermark: flow.command_low_watermark (256KiB) must be below flow.command_high_watermark (256KiB)",
        ),
        (
            "client-relative-shell.toml",
            "fixtures/config/client-relative-shell.toml:3:1: shells.sh: \"sh\" must be an absolute path; shells are never looked up through PATH",
        ),
        (
            "client-profile-conflict.toml",
            "profiles.cpu_low.required_controls: required control cpu_max has no nonzero value",
        ),
        (
            "client-profile-conflict.toml",
            "profiles.cpu_low: control memory_max does not belong to a cpu_low profile",
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
fn flags_override_and_touch_no_state() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let out = run(&[
        "--check-config",
        "docs/examples/client.toml",
        "--client-state-dir",
        state.to_str().unwrap(),
        "--client-client-id",
        "web-01",
        "--client-server-urls",
        "wss://a.example/agent",
        "--client-server-urls",
        "wss://b.example/agent",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("client_id = \"web-01\""));
    assert!(
        stdout.contains("server_urls = [\"wss://a.example/agent\", \"wss://b.example/agent\"]")
    );
    assert!(
        !state.exists(),
        "--check-config must not create the state directory"
    );
}

#[test]
fn a_start_that_cannot_open_its_store_exits_1_and_says_why() {
    // the state directory's database directory is a regular file
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::write(state.join("db"), b"x").unwrap();
    let cfg = dir.path().join("client.toml");
    std::fs::write(
        &cfg,
        format!(
            "[client]\nclient_id = \"web-01\"\nserver_urls = [\"ws://127.0.0.1:9/rvbox/agent\"]\nstate_dir = \"{}\"\n",
            state.display()
        ),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("rvbox: client store"), "{err}");
}

#[test]
fn a_hostile_path_cannot_change_the_resolved_shell() {
    // The daemon's own PATH points first at a directory holding a fake `sh`
    // and `bash`; resolution uses only the configured absolute paths.
    use std::os::unix::fs::PermissionsExt;
    let evil = tempfile::tempdir().unwrap();
    for name in ["sh", "bash"] {
        let fake = evil.path().join(name);
        std::fs::write(&fake, "#!/bin/true\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let hostile_path = format!("{}:/usr/bin:/bin", evil.path().display());
    let out = Command::new(env!("CARGO_BIN_EXE_rvbox"))
        .args(["--check-config", "docs/examples/client.toml"])
        .env("PATH", &hostile_path)
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8(out.stdout).unwrap();
    let sh = std::fs::canonicalize("/bin/sh").unwrap();
    assert!(
        summary.contains(&format!("sh = \"{}\"", sh.display())),
        "{summary}"
    );
    assert!(
        !summary.contains(&evil.path().display().to_string()),
        "{summary}"
    );
}

#[test]
fn answers_help_and_version() {
    let out = run(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("rvbox {}", env!("CARGO_PKG_VERSION"))
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
