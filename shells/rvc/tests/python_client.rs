//! A client written without any RVBox code: `docs/examples/python/rvbox_client.py`,
//! with Python's grpcio and stubs generated from the protos by
//! grpcio-tools, against a running server and client over the Unix
//! socket. It runs a command, follows it to the end, reads its output,
//! and checks that malformed requests (bad UUIDs, oversized fields,
//! unknown enum values) get structured errors.
//!
//! `scripts/test` installs grpcio into `target/pyclient` and sets
//! `RVBOX_PYTHON`; without it the test says so and passes only when
//! `RVBOX_REQUIRE_PYTHON_CLIENT` is unset.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::path::PathBuf;
use std::process::Command;

use support::{Stack, text};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> Option<PathBuf> {
    let p = std::env::var_os("RVBOX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/pyclient/bin/python"));
    let ok = Command::new(&p)
        .args(["-c", "import grpc, grpc_tools, grpc_status"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(p)
}

#[test]
fn a_grpcio_client_from_the_protos_runs_a_command_and_gets_structured_errors() {
    let Some(py) = python() else {
        assert!(
            std::env::var_os("RVBOX_REQUIRE_PYTHON_CLIENT").is_none(),
            "grpcio is not installed (scripts/test installs it into target/pyclient)"
        );
        eprintln!("skipped: no Python with grpcio (scripts/test installs it)");
        return;
    };
    let stubs = tempfile::tempdir().unwrap();
    let protos = workspace().join("protos");
    let mut protoc = Command::new(&py);
    protoc
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&protos)
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()));
    for f in ["agent", "common", "control"] {
        protoc.arg(protos.join(format!("rvbox/v1/{f}.proto")));
    }
    let out = protoc.output().unwrap();
    assert!(out.status.success(), "protoc: {}", text(&out.stderr));

    let s = Stack::new();
    let out = Command::new(&py)
        .arg(workspace().join("docs/examples/python/rvbox_client.py"))
        .arg(s.socket())
        .arg("web-1")
        .env("PYTHONPATH", stubs.path())
        .output()
        .unwrap();
    let report = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{report}\n{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    for check in [
        "RunCommand returns the request id",
        "FollowCommand ends with the exit result",
        "GetOutput returns the bytes",
        "a bad UUID",
        "an oversized client id",
        "an oversized stdin append",
        "an unknown shell type",
        "an unknown signal",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("ok ") && l.contains(check)),
            "{check}: {report}"
        );
    }
}
