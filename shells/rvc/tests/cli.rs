#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The real `rvc` binary answers --help and --version, and refuses to
//! pretend it can do anything else.

use std::process::Command;

fn rvc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rvc"))
        .args(args)
        .output()
        .expect("run rvc")
}

#[test]
fn version_names_the_package_version() {
    let out = rvc(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("rvc {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_describes_the_cli() {
    let out = rvc(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("rvbox-server"), "{text}");
    assert!(text.contains("--socket"), "{text}");
}

#[test]
fn no_operation_is_a_usage_error() {
    let out = rvc(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("rvc --help")
    );
    let out = rvc(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
}
