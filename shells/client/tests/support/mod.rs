//! Shared helpers of the client daemon's tests and benches: the session
//! id the scripted server uses, the test client's id, and a client core
//! configuration for a working directory on this host.
#![allow(clippy::unwrap_used, dead_code, unreachable_pub)]

use std::collections::BTreeMap;

use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::ClientCoreConfig;
use rvbox_client_core::spool::SpoolLimits;
use rvbox_domain::ids::ClientId;
use rvbox_proto::v1 as wire;

/// The session id of the scripted server.
pub const SID: &str = "0123456789abcdef0123";

/// The test client's id.
pub fn client_id() -> ClientId {
    ClientId::parse("c", "web-1").unwrap()
}

/// A client core configuration running `sh` in `cwd`.
pub fn config(cwd: &str) -> ClientCoreConfig {
    ClientCoreConfig {
        policy: AcceptPolicy {
            client_id: client_id(),
            shells: vec![wire::ShellType::Sh],
            default_shell: wire::ShellType::Sh,
            profiles: vec![],
            cwd_roots: vec![cwd.into()],
            default_cwd: cwd.into(),
            max_running: 4,
            max_queued: 4,
            closeout_reserve: 64 * 1024,
            storage_budget: 1 << 30,
            command_total: 32 << 20,
            command_streams: 11 << 20,
            free_space_floor: 0,
        },
        link: LinkConfig::default(),
        spool: SpoolLimits::default(),
        // the configuration resolves each shell once to its canonical
        // executable (/bin/sh is a symlink on many hosts)
        shell_paths: BTreeMap::from([(
            wire::ShellType::Sh as i32,
            std::fs::canonicalize("/bin/sh")
                .unwrap()
                .to_string_lossy()
                .into_owned(),
        )]),
        profiles: BTreeMap::new(),
        hello: wire::ClientHello {
            client_id: client_id().as_str().to_owned(),
            protocol_major: 1,
            supported_minors: vec![0],
            ..Default::default()
        },
        terminals: rvbox_client_core::machine::TerminalLimits::default(),
    }
}

/// A supervisor configuration for the `rvbox` under test, with this host's
/// `sh` and `bash` validated as the daemon's startup validates its shells.
pub fn supervisor_config(run: std::path::PathBuf) -> rvbox_supervisor::SupervisorConfig {
    let mut c = rvbox_supervisor::SupervisorConfig::new(env!("CARGO_BIN_EXE_rvbox").into(), run);
    for shell in ["/bin/sh", "/bin/bash"] {
        if let Ok(path) = std::fs::canonicalize(shell) {
            c.validated_shell(&path).unwrap();
        }
    }
    c
}

/// Whether `RVBOX_REQUIRE_CGROUPS=1`: a host without what a cgroup test
/// needs then fails the test instead of skipping it (`scripts/test` sets
/// it where the cgroup tests pass).
pub fn cgroups_required() -> bool {
    std::env::var_os("RVBOX_REQUIRE_CGROUPS").is_some_and(|v| v == "1")
}

/// Skips the cgroup half of `test` loudly, or fails it under
/// `RVBOX_REQUIRE_CGROUPS=1`.
pub fn skip_cgroups(test: &str, why: &str) {
    assert!(
        !cgroups_required(),
        "{test}: RVBOX_REQUIRE_CGROUPS=1, but {why}"
    );
    eprintln!("{test}: SKIPPED: {why} (RVBOX_REQUIRE_CGROUPS=1 makes this a failure)");
}
