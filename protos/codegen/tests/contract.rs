#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Pins the parts of the generated API that other crates map by name or
//! number, and the determinism the request hash relies on.

use prost::Message;
use rvbox_proto::v1::{ErrorCode, ExecutionSpec, ProfileFlag, ShellType, execution_spec};

#[test]
fn error_codes_keep_their_names_and_numbers() {
    let expected = [
        "ERROR_CODE_UNSPECIFIED",
        "ERROR_CODE_INVALID_ARGUMENT",
        "ERROR_CODE_NOT_FOUND",
        "ERROR_CODE_CONFLICT",
        "ERROR_CODE_ALREADY_EXECUTED",
        "ERROR_CODE_ILLEGAL_TRANSITION",
        "ERROR_CODE_STALE_REVISION",
        "ERROR_CODE_FAILED_PRECONDITION",
        "ERROR_CODE_REQUIRES_ACKNOWLEDGEMENT",
        "ERROR_CODE_UNAVAILABLE",
        "ERROR_CODE_QUOTA_EXCEEDED",
        "ERROR_CODE_CAPACITY_EXHAUSTED",
        "ERROR_CODE_TOO_LARGE",
        "ERROR_CODE_UNSUPPORTED",
        "ERROR_CODE_PROTOCOL_ERROR",
        "ERROR_CODE_STALE_SESSION",
        "ERROR_CODE_VERSION_MISMATCH",
        "ERROR_CODE_LIVE_CONFLICT",
        "ERROR_CODE_INTERNAL",
    ];
    for (number, name) in expected.iter().enumerate() {
        let code = ErrorCode::try_from(i32::try_from(number).unwrap()).unwrap();
        assert_eq!(code.as_str_name(), *name);
    }
    assert!(
        ErrorCode::try_from(19).is_err(),
        "a new code must be added to this test"
    );
}

#[test]
fn profile_flags_match_toml_table_names() {
    let tables = [
        "light",
        "cpu_low",
        "cpu_medium",
        "cpu_high",
        "mem_low",
        "mem_medium",
        "mem_high",
        "disk_low",
        "disk_medium",
        "disk_high",
    ];
    for (i, table) in tables.iter().enumerate() {
        let flag = ProfileFlag::try_from(i32::try_from(i + 1).unwrap()).unwrap();
        let name = flag.as_str_name().strip_prefix("PROFILE_FLAG_").unwrap();
        assert_eq!(name.to_ascii_lowercase(), *table);
    }
}

#[test]
fn execution_spec_encoding_ignores_env_insertion_order() {
    let spec = |pairs: &[(&str, &str)]| ExecutionSpec {
        source: Some(execution_spec::Source::CommandText("make test".into())),
        shell_type: ShellType::Bash.into(),
        cwd: "/srv".into(),
        env: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        profile_flags: vec![ProfileFlag::CpuLow.into()],
    };
    let a = spec(&[("B", "2"), ("A", "1"), ("C", "3")]).encode_to_vec();
    let b = spec(&[("C", "3"), ("A", "1"), ("B", "2")]).encode_to_vec();
    assert_eq!(a, b);
    assert_eq!(ExecutionSpec::decode(a.as_slice()).unwrap().env.len(), 3);
}
