#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Table tests of plan §4.3: unknown keys, durations, sizes, watermarks,
//! tiers, zero semantics, paths, devices, shells, profiles, precedence.

mod support;

use std::time::Duration;

use rvbox_config::registry::{CLIENT_KEYS, SERVER_KEYS};
use rvbox_config::{
    ConfigErrors, FlagValue, Origin, ProfileName, ProfileRequestError, ShellKind,
    check_profile_combination, load_client, load_server, parse_device_key,
};
use support::{FakeHost, client, client_err, server, server_err};

fn assert_error(errors: &ConfigErrors, key: &str, needle: &str, case: &str) {
    assert!(
        errors
            .errors
            .iter()
            .any(|e| e.key == key && e.message.contains(needle)),
        "{case}: expected an error on {key} containing {needle:?}, got:\n{errors}"
    );
}

#[test]
fn defaults_are_valid() {
    let s = server("").unwrap();
    assert_eq!(s.session.heartbeat_idle, Duration::from_secs(10));
    assert_eq!(s.session.liveness_timeout, Duration::from_secs(30));
    assert_eq!(s.queue.ttl, Some(Duration::from_secs(15 * 60)));
    assert_eq!(s.audit.retention, None);
    assert_eq!(s.storage.command_total, 32 << 20);
    let c = client("").unwrap();
    assert_eq!(c.client.client_id, "testhost");
    assert_eq!(c.exec.max_running, 16);
    assert_eq!(c.exec.max_queued, 100);
    assert_eq!(c.terminals.max_open, 16);
    assert_eq!(
        client("[terminals]\nmax_open = 3\n")
            .unwrap()
            .terminals
            .max_open,
        3
    );
    assert_eq!(c.reconnect.initial, Duration::from_secs(1));
    assert_eq!(c.reconnect.max, Duration::from_secs(60));
    assert_eq!(c.shells.advertised(), vec![ShellKind::Sh, ShellKind::Bash]);
}

#[test]
fn unknown_keys_are_refused_with_path_and_line() {
    let cases: &[(&str, &str, &str, u32)] = &[
        ("top-level key", "bogus = 1\n", "bogus", 1),
        ("top-level table", "\n[bogus]\nx = 1\n", "bogus", 2),
        (
            "section key",
            "[storage]\ndata_dir = \"/var/lib/x\"\nbogus_key = 1\n",
            "storage.bogus_key",
            3,
        ),
        ("dotted key", "storage.bogus = \"1s\"\n", "storage.bogus", 1),
        (
            "misspelled",
            "[session]\nheartbeat_idel = \"10s\"\n",
            "session.heartbeat_idel",
            2,
        ),
        (
            "client section in server",
            "[spool]\ncommand_total = 1\n",
            "spool",
            1,
        ),
    ];
    for (case, text, key, line) in cases {
        let errors = server_err(text);
        let e = errors
            .errors
            .iter()
            .find(|e| e.key == *key)
            .unwrap_or_else(|| panic!("{case}: {errors}"));
        assert_eq!(e.line(), Some(*line), "{case}");
        assert!(
            e.render(Some("f.toml"))
                .starts_with(&format!("f.toml:{line}:")),
            "{case}"
        );
    }
    let client_cases: &[(&str, &str, &str)] = &[
        (
            "client key",
            "[client]\nclientid = \"a\"\n",
            "client.clientid",
        ),
        (
            "server section in client",
            "[storage]\ndata_dir = \"/x\"\n",
            "storage",
        ),
        (
            "unknown profile",
            "[profiles.turbo]\nrequired_controls = [\"pids_max\"]\npids_max = 5\n",
            "profiles.turbo",
        ),
        (
            "nested profile key",
            "[profiles.light]\nrequired_controls = [\"pids_max\"]\npids_max = 5\nbogus = 1\n",
            "profiles.light.bogus",
        ),
        (
            "io rule key",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.\"8:0\"]\nread_bps = 1\nbogus = 2\n",
            "profiles.disk_low.io.\"8:0\".bogus",
        ),
    ];
    for (case, text, key) in client_cases {
        assert_error(&client_err(text), key, "unknown", case);
    }
}

#[test]
fn duplicate_keys_are_refused_with_path_and_line() {
    let errors = server_err("[storage]\ndata_dir = \"/a\"\ndata_dir = \"/b\"\n");
    let e = &errors.errors[0];
    assert_eq!(e.key, "storage.data_dir");
    assert_eq!(e.line(), Some(3));
    assert!(e.message.contains("duplicate"));
    let errors = server_err("[queue]\nttl = \"1m\"\n[queue]\nmax_total = 5\n");
    assert_eq!(errors.errors[0].key, "queue");
    assert_eq!(errors.errors[0].line(), Some(3));
    // an empty header has no name: what follows it is a syntax error at
    // its line, never an error about the key "" (found by fuzzing,
    // fixtures/fuzz/config/regressions/)
    for text in ["[]\n[", "[]\n[]\n"] {
        for errors in [server_err(text), client_err(text)] {
            for e in &errors.errors {
                assert!(!e.key.is_empty(), "{text:?}: {e:?}");
                assert!(e.line().is_some(), "{text:?}: {e:?}");
            }
        }
    }
}

#[test]
fn syntax_errors_carry_a_line() {
    let errors = server_err("[storage\n");
    assert_eq!(errors.errors[0].key, "toml");
    assert_eq!(errors.errors[0].line(), Some(1));
}

#[test]
fn invalid_durations_are_refused() {
    let cases: &[(&str, &str, &str)] = &[
        ("bare number", "10", "bare numbers"),
        ("bare zero", "0", "bare numbers"),
        ("float", "1.5", "bare numbers"),
        ("negative integer", "-5", "bare numbers"),
        ("negative string", "\"-5s\"", "negative"),
        ("fraction string", "\"1.5s\"", "fractional"),
        ("overflow", "\"99999999999999999999s\"", "too large"),
        (
            "overflow by multiplication",
            "\"18446744073709551d\"",
            "too large",
        ),
        ("unknown unit", "\"10x\"", "unknown duration unit"),
        ("missing unit", "\"10\"", "missing unit"),
        ("empty", "\"\"", "empty"),
        ("units out of order", "\"30m1h\"", "largest first"),
        ("space", "\"10 s\"", "invalid duration"),
        ("boolean", "true", "expected a duration"),
    ];
    for (case, value, needle) in cases {
        let text = format!("[session]\nheartbeat_idle = {value}\n");
        let errors = server_err(&text);
        assert_error(&errors, "session.heartbeat_idle", needle, case);
        assert_eq!(errors.errors[0].line(), Some(2), "{case}");
    }
    // Valid forms.
    for (value, ms) in [
        ("\"1500ms\"", 1500u64),
        ("\"1h30m\"", 5_400_000),
        ("\"2d\"", 172_800_000),
    ] {
        let s = server(&format!("[session]\ntakeover_grant_ttl = {value}\n")).unwrap();
        assert_eq!(s.session.takeover_grant_ttl, Duration::from_millis(ms));
    }
}

#[test]
fn invalid_sizes_are_refused() {
    let cases: &[(&str, &str, &str)] = &[
        ("float", "1.5", "fractional"),
        ("float string", "\"1.5MiB\"", "fractional"),
        ("negative", "-1", "negative"),
        ("negative string", "\"-1KiB\"", "negative"),
        ("overflow", "\"99999999999TiB\"", "too large"),
        ("decimal unit", "\"10MB\"", "IEC"),
        ("bad unit", "\"10Qb\"", "unknown size unit"),
        ("digits string", "\"65536\"", "needs a unit"),
        ("empty", "\"\"", "empty"),
        ("above ceiling", "\"2MiB\"", "v1 ceiling of 1MiB"),
        ("above ceiling integer", "1048577", "v1 ceiling"),
        ("boolean", "false", "expected a byte size"),
    ];
    for (case, value, needle) in cases {
        let text = format!("[limits]\nmax_envelope = {value}\n");
        assert_error(&server_err(&text), "limits.max_envelope", needle, case);
    }
    for (value, bytes) in [
        ("65536", 65_536u64),
        ("\"512KiB\"", 512 * 1024),
        ("0x10000", 65_536),
        ("1_000", 1_000),
    ] {
        let s = server(&format!("[storage]\nsegment_seal_size = {value}\n")).unwrap();
        assert_eq!(s.storage.segment_seal_size, bytes);
    }
    // Counts never come from strings.
    assert_error(
        &server_err("[queue]\nmax_total = \"100\"\n"),
        "queue.max_total",
        "never converted",
        "count string",
    );
    assert_error(
        &server_err("[queue]\nmax_total = 1.0\n"),
        "queue.max_total",
        "expected an integer",
        "count float",
    );
    // Every wire ceiling holds even when the file asks for more.
    for def in SERVER_KEYS {
        if let rvbox_config::registry::Limit::Ceiling(c) = def.limit {
            let (section, key) = def.path.split_once('.').unwrap();
            let errors = server_err(&format!("[{section}]\n{key} = {}\n", c + 1));
            assert_error(&errors, def.path, "ceiling", def.path);
            let errors = server_err(&format!("[{section}]\n{key} = {}\n", c + 1));
            assert!(errors.errors.len() == 1, "{}: {errors}", def.path);
        }
    }
}

#[test]
fn watermark_inversions_are_refused_in_every_tier() {
    let cases: &[(&str, &str, &str, bool)] = &[
        (
            "server ingress equal",
            "[flow]\ningress_low_watermark = \"64MiB\"\n",
            "flow.ingress_low_watermark",
            true,
        ),
        (
            "server ingress above",
            "[flow]\ningress_low_watermark = \"128MiB\"\ningress_high_watermark = \"64MiB\"\n",
            "flow.ingress_low_watermark",
            true,
        ),
        (
            "client command equal",
            "[flow]\ncommand_low_watermark = \"1MiB\"\n",
            "flow.command_low_watermark",
            false,
        ),
        (
            "client command above",
            "[flow]\ncommand_high_watermark = \"128KiB\"\n",
            "flow.command_high_watermark",
            false,
        ),
        (
            "client daemon equal",
            "[flow]\ndaemon_low_watermark = \"8MiB\"\n",
            "flow.daemon_low_watermark",
            false,
        ),
        (
            "client daemon above",
            "[flow]\ndaemon_low_watermark = \"9MiB\"\n",
            "flow.daemon_low_watermark",
            false,
        ),
    ];
    for (case, text, key, is_server) in cases {
        let errors = if *is_server {
            server_err(text)
        } else {
            client_err(text)
        };
        assert_error(&errors, key, "below", case);
        assert!(
            errors.errors[0].line().is_some(),
            "{case}: error must carry the line"
        );
    }
}

#[test]
fn tier_inversions_are_refused() {
    let server_cases: &[(&str, &str, &str, &str)] = &[
        (
            "reserve = command quota",
            "[storage]\ncloseout_reserve = \"32MiB\"\n",
            "storage.closeout_reserve",
            "below storage.command_total",
        ),
        (
            "command quota = per-client",
            "[storage]\ncommand_total = \"256MiB\"\n",
            "storage.command_total",
            "below storage.per_client_total",
        ),
        (
            "command quota above server",
            "[storage]\nserver_total = \"16MiB\"\nper_client_total = \"8MiB\"\n",
            "storage.server_total",
            "below storage.server_total",
        ),
        (
            "per-client above server",
            "[storage]\nper_client_total = \"8GiB\"\n",
            "storage.per_client_total",
            "must not exceed storage.server_total",
        ),
        (
            "output window above quota",
            "[storage]\ncommand_output_window = \"33MiB\"\n",
            "storage.command_output_window",
            "must not exceed",
        ),
        (
            "output window below one segment and a chunk",
            "[storage]\ncommand_output_window = \"64KiB\"\n",
            "storage.command_output_window",
            "must be at least 512KiB",
        ),
        (
            "command window = quota",
            "[storage]\ncommand_total = \"1MiB\"\ncloseout_reserve = \"4KiB\"\ncommand_output_window = \"1MiB\"\n",
            "storage.command_total",
            "flow.command_send_window",
        ),
        (
            "session window = per-client",
            "[storage]\nper_client_total = \"8MiB\"\n",
            "storage.per_client_total",
            "flow.session_send_window",
        ),
        (
            "queue per client above total",
            "[queue]\nmax_per_client = 20000\n",
            "queue.max_per_client",
            "must not exceed queue.max_total",
        ),
        (
            "retry initial above max",
            "[queue]\nretry_initial = \"2m\"\n",
            "queue.retry_initial",
            "must not exceed",
        ),
        (
            "heartbeat = liveness",
            "[session]\nheartbeat_idle = \"30s\"\n",
            "session.heartbeat_idle",
            "below session.liveness_timeout",
        ),
        (
            "default page above max",
            "[control]\nmax_page_size = 50\n",
            "control.max_page_size",
            "must not exceed",
        ),
        (
            "envelope below the largest spec",
            "[limits]\nmax_envelope = \"512KiB\"\n",
            "limits.max_envelope",
            "the largest ExecutionSpec",
        ),
        (
            "a removed key",
            "[limits]\nmax_reason = \"1KiB\"\n",
            "limits.max_reason",
            "removed: this limit is fixed by the v1 protocol",
        ),
    ];
    for (case, text, key, needle) in server_cases {
        assert_error(&server_err(text), key, needle, case);
    }
    let client_cases: &[(&str, &str, &str, &str)] = &[
        (
            "command total below its streams",
            "[spool]\ncommand_total = \"11MiB\"\n",
            "spool.command_total",
            "worst case fits",
        ),
        (
            "reconnect initial above cap",
            "[reconnect]\ninitial = \"2m\"\n",
            "reconnect.initial",
            "must not exceed reconnect.max",
        ),
        (
            "heartbeat above liveness",
            "[session]\nheartbeat_idle = \"1m\"\n",
            "session.heartbeat_idle",
            "below session.liveness_timeout",
        ),
        (
            "reserve = quota",
            "[spool]\ncloseout_reserve = \"32MiB\"\n",
            "spool.closeout_reserve",
            "below spool.command_total",
        ),
        (
            "command quota = daemon",
            "[spool]\ncommand_total = \"256MiB\"\n",
            "spool.command_total",
            "below spool.daemon_total",
        ),
        (
            "command window above quota",
            "[spool]\ncommand_total = \"1MiB\"\ncommand_output_window = \"1MiB\"\n",
            "spool.command_total",
            "flow.command_send_window",
        ),
        (
            "session window above daemon",
            "[spool]\ndaemon_total = \"8MiB\"\ncommand_total = \"4MiB\"\ncommand_output_window = \"4MiB\"\n",
            "spool.daemon_total",
            "flow.session_send_window",
        ),
        (
            "command high above daemon high",
            "[flow]\ncommand_high_watermark = \"16MiB\"\n",
            "flow.command_high_watermark",
            "must not exceed flow.daemon_high_watermark",
        ),
    ];
    for (case, text, key, needle) in client_cases {
        assert_error(&client_err(text), key, needle, case);
    }
    // reconnect initial == cap is allowed (<=).
    client("[reconnect]\ninitial = \"1m\"\n").unwrap();
}

#[test]
fn zero_is_allowed_only_where_documented() {
    // Allowed, with meaning.
    let s = server("[queue]\nttl = \"0s\"\n[storage]\nterminal_retention = \"0s\"\n[audit]\nretention = \"0s\"\n").unwrap();
    assert_eq!(s.queue.ttl, None);
    assert_eq!(s.storage.terminal_retention, None);
    assert_eq!(s.audit.retention, None);
    // Refused everywhere else, for every numeric key of both daemons.
    for (keys, is_server) in [(SERVER_KEYS, true), (CLIENT_KEYS, false)] {
        for def in keys.iter().filter(|d| d.kind.is_numeric()) {
            let (section, key) = def.path.split_once('.').unwrap();
            let value = if def.kind == rvbox_config::Kind::Duration {
                "\"0s\""
            } else {
                "0"
            };
            let text = format!("[{section}]\n{key} = {value}\n");
            let result = if is_server {
                load_server("z.toml", &text, &[], &FakeHost::standard()).err()
            } else {
                load_client("z.toml", &text, &[], &FakeHost::standard()).err()
            };
            match def.zero {
                rvbox_config::registry::Zero::Means(_) => {
                    assert!(result.is_none(), "{}: zero must be accepted", def.path)
                }
                rvbox_config::registry::Zero::Refused => {
                    let errors =
                        result.unwrap_or_else(|| panic!("{}: zero must be refused", def.path));
                    assert_error(&errors, def.path, "0 is not allowed", def.path);
                }
            }
        }
    }
}

#[test]
fn positive_page_and_queue_limits() {
    for (text, key) in [
        (
            "[control]\ndefault_page_size = 0\n",
            "control.default_page_size",
        ),
        ("[control]\nmax_page_size = 0\n", "control.max_page_size"),
        ("[queue]\nmax_per_client = 0\n", "queue.max_per_client"),
        ("[queue]\nmax_total = 0\n", "queue.max_total"),
    ] {
        assert_error(&server_err(text), key, "0 is not allowed", key);
    }
    for (text, key) in [
        ("[exec]\nmax_running = 0\n", "exec.max_running"),
        ("[exec]\nmax_queued = 0\n", "exec.max_queued"),
        ("[terminals]\nmax_open = 0\n", "terminals.max_open"),
    ] {
        assert_error(&client_err(text), key, "0 is not allowed", key);
    }
    assert_error(
        &server_err("[control]\nmax_page_size = 1001\n"),
        "control.max_page_size",
        "ceiling",
        "page ceiling",
    );
}

#[test]
fn noncanonical_and_unsafe_paths_are_refused() {
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "relative data dir",
            "[storage]\ndata_dir = \"var/lib/x\"\n",
            "storage.data_dir",
            "absolute",
        ),
        (
            "dotdot data dir",
            "[storage]\ndata_dir = \"/var/lib/../x\"\n",
            "storage.data_dir",
            "'..'",
        ),
        (
            "empty data dir",
            "[storage]\ndata_dir = \"\"\n",
            "storage.data_dir",
            "empty",
        ),
        (
            "data dir is a file",
            "[storage]\ndata_dir = \"/usr/bin/bash\"\n",
            "storage.data_dir",
            "not a directory",
        ),
        (
            "relative runtime dir",
            "[control]\nruntime_dir = \"run\"\n",
            "control.runtime_dir",
            "absolute",
        ),
        (
            "socket outside runtime dir",
            "[control]\nsocket_path = \"/tmp/control.sock\"\n",
            "control.socket_path",
            "directly inside",
        ),
        (
            "socket nested below runtime dir",
            "[control]\nsocket_path = \"/run/rvbox-server/sub/control.sock\"\n",
            "control.socket_path",
            "directly inside",
        ),
        (
            "runtime dir inside data dir",
            "[control]\nruntime_dir = \"/var/lib/rvbox-server/run\"\nsocket_path = \"/var/lib/rvbox-server/run/c.sock\"\n",
            "control.runtime_dir",
            "must not contain",
        ),
    ];
    for (case, text, key, needle) in cases {
        assert_error(&server_err(text), key, needle, case);
    }
    // Lexical normalization is accepted and shown normalized.
    let s = server("[storage]\ndata_dir = \"/var//lib/./rvbox-server/\"\n").unwrap();
    assert_eq!(
        s.storage.data_dir,
        std::path::Path::new("/var/lib/rvbox-server")
    );
    assert_eq!(
        s.storage.segments_dir,
        std::path::Path::new("/var/lib/rvbox-server/segments")
    );

    let host = FakeHost::standard();
    // Aliases that collapse data subdirectories.
    host.dir("/var/lib/rvbox-server", 0o700, 1000);
    host.dir("/var/lib/rvbox-server/db", 0o700, 1000);
    host.link("/var/lib/rvbox-server/segments", "/var/lib/rvbox-server/db");
    let errors = load_server("t", "", &[], &host).unwrap_err();
    assert_error(
        &errors,
        "storage.data_dir",
        "collapse",
        "segments -> db alias",
    );

    // World-writable runtime dir, wrong owner of data dir, non-socket at the socket path.
    let host = FakeHost::standard();
    host.dir("/run/rvbox-server", 0o777, 0);
    host.dir("/var/lib/rvbox-server", 0o700, 4242);
    let errors = load_server("t", "", &[], &host).unwrap_err();
    assert_error(
        &errors,
        "control.runtime_dir",
        "world-writable",
        "world-writable runtime dir",
    );
    assert_error(
        &errors,
        "storage.data_dir",
        "owned by uid 4242",
        "foreign data dir",
    );
    let host = FakeHost::standard();
    host.dir("/run/rvbox-server", 0o755, 0);
    host.file("/run/rvbox-server/control.sock", 0o600, 1000);
    let errors = load_server("t", "", &[], &host).unwrap_err();
    assert_error(
        &errors,
        "control.socket_path",
        "not a socket",
        "regular file at socket path",
    );
    // A stale socket is fine; a runtime dir reached through a symlink too.
    let host = FakeHost::standard();
    host.dir("/run/rvbox-server", 0o755, 0);
    host.socket("/run/rvbox-server/control.sock");
    load_server("t", "", &[], &host).unwrap();
    let host = FakeHost::standard();
    host.link("/var/run", "/run");
    let s = load_server(
        "t",
        "[control]\nruntime_dir = \"/var/run\"\nsocket_path = \"/var/run/c.sock\"\n",
        &[],
        &host,
    )
    .unwrap();
    assert_eq!(s.control.socket_path, std::path::Path::new("/run/c.sock"));
    // Too long for sun_path.
    let long = format!("/run/{}.sock", "x".repeat(120));
    let errors = server_err(&format!(
        "[control]\nruntime_dir = \"/run\"\nsocket_path = \"{long}\"\n"
    ));
    assert_error(
        &errors,
        "control.socket_path",
        "too long",
        "long socket path",
    );

    // Client paths.
    let client_cases: &[(&str, &str, &str, &str)] = &[
        (
            "relative state dir",
            "[client]\nstate_dir = \"state\"\n",
            "client.state_dir",
            "absolute",
        ),
        (
            "missing ca file",
            "[client]\nca_file = \"/etc/missing.pem\"\n",
            "client.ca_file",
            "does not exist",
        ),
        (
            "ca file is a dir",
            "[client]\nca_file = \"/etc\"\n",
            "client.ca_file",
            "not a regular file",
        ),
        (
            "missing cwd root",
            "[exec]\nallowed_cwd_roots = [\"/nope\"]\n",
            "exec.allowed_cwd_roots",
            "does not exist",
        ),
        (
            "relative cwd root",
            "[exec]\nallowed_cwd_roots = [\"home\"]\n",
            "exec.allowed_cwd_roots",
            "absolute",
        ),
        (
            "empty cwd roots",
            "[exec]\nallowed_cwd_roots = []\n",
            "exec.allowed_cwd_roots",
            "at least one",
        ),
        (
            "duplicate cwd root",
            "[exec]\nallowed_cwd_roots = [\"/home\", \"/home/\"]\ndefault_cwd = \"/home\"\n",
            "exec.allowed_cwd_roots",
            "twice",
        ),
        (
            "default cwd outside roots",
            "[exec]\nallowed_cwd_roots = [\"/home\"]\ndefault_cwd = \"/tmp\"\n",
            "exec.default_cwd",
            "under one of",
        ),
    ];
    for (case, text, key, needle) in client_cases {
        assert_error(&client_err(text), key, needle, case);
    }
    let c = client("[exec]\nallowed_cwd_roots = [\"/home\", \"/srv/\"]\ndefault_cwd = \"/srv\"\n")
        .unwrap();
    assert!(c.exec.cwd_allowed(std::path::Path::new("/srv/app")));
    assert!(!c.exec.cwd_allowed(std::path::Path::new("/srvx")));
}

/// The control runtime directory holds the operator-authority socket: when
/// it exists it must be owned by this account or root, and neither group-
/// nor world-writable (another account could otherwise replace the socket
/// or the directory's entries).
#[test]
fn the_control_runtime_directory_is_private_to_this_account_or_root() {
    let refused = |mode: u32, uid: u32, needle: &str, case: &str| {
        let host = FakeHost::standard();
        host.dir("/run/rvbox-server", mode, uid);
        let errors = load_server("t", "", &[], &host).unwrap_err();
        assert_error(&errors, "control.runtime_dir", needle, case);
    };
    refused(
        0o700,
        4242,
        "owned by uid 4242, neither root nor this user",
        "another account's",
    );
    refused(
        0o755,
        4242,
        "owned by uid 4242",
        "another account's, not writable",
    );
    refused(
        0o770,
        1000,
        "group- or world-writable (mode 770)",
        "group-writable",
    );
    refused(
        0o720,
        0,
        "group- or world-writable",
        "root's, group-writable",
    );
    refused(0o702, 1000, "group- or world-writable", "world-writable");
    refused(
        0o1777,
        0,
        "group- or world-writable",
        "sticky, world-writable",
    );
    // this account's or root's, private or readable: accepted
    for (mode, uid) in [(0o700, 1000), (0o755, 1000), (0o755, 0), (0o700, 0)] {
        let host = FakeHost::standard();
        host.dir("/run/rvbox-server", mode, uid);
        let s = load_server("t", "", &[], &host)
            .unwrap_or_else(|e| panic!("mode {mode:o} uid {uid}: {e}"));
        assert_eq!(
            s.control.runtime_dir,
            std::path::Path::new("/run/rvbox-server")
        );
    }
    // a file in its place
    let host = FakeHost::standard();
    host.file("/run/rvbox-server", 0o600, 1000);
    let errors = load_server("t", "", &[], &host).unwrap_err();
    assert_error(&errors, "control.runtime_dir", "not a directory", "a file");
}

#[test]
fn client_identity_and_urls() {
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "empty id",
            "[client]\nclient_id = \"\"\n",
            "client.client_id",
            "empty",
        ),
        (
            "long id",
            &format!("[client]\nclient_id = \"{}\"\n", "a".repeat(129)),
            "client.client_id",
            "the limit is 128",
        ),
        (
            "non-ascii id",
            "[client]\nclient_id = \"hôte\"\n",
            "client.client_id",
            "ASCII",
        ),
        (
            "no urls",
            "[client]\nserver_urls = []\n",
            "client.server_urls",
            "at least one",
        ),
        (
            "http url",
            "[client]\nserver_urls = [\"https://x/agent\"]\n",
            "client.server_urls",
            "ws:// or wss://",
        ),
        (
            "credentials",
            "[client]\nserver_urls = [\"wss://u:p@x/agent\"]\n",
            "client.server_urls",
            "credentials",
        ),
        (
            "duplicate url",
            "[client]\nserver_urls = [\"wss://a/x\", \"wss://a/x\"]\n",
            "client.server_urls",
            "twice",
        ),
    ];
    for (case, text, key, needle) in cases {
        assert_error(&client_err(text), key, needle, case);
    }
    client(&format!("[client]\nclient_id = \"{}\"\n", "a".repeat(128))).unwrap();
    let host = FakeHost::standard();
    let host = FakeHost {
        host_name: None,
        ..host
    };
    let errors = load_client("t", "", &[], &host).unwrap_err();
    assert_error(&errors, "client.client_id", "host name", "no host name");
}

#[test]
fn shells_resolve_once_to_canonical_executables() {
    let c = client("").unwrap();
    let sh = c.shells.executable_for(ShellKind::Sh).unwrap();
    assert_eq!(sh.executable(), std::path::Path::new("/usr/bin/dash"));
    assert_eq!(sh.configured(), std::path::Path::new("/bin/sh"));
    assert_eq!(c.shells.default_shell().unwrap().kind(), ShellKind::Sh);
    assert!(c.summary().contains("sh = \"/usr/bin/dash\""));

    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "relative sh",
            "[shells]\nsh = \"sh\"\n",
            "shells.sh",
            "never looked up through PATH",
        ),
        (
            "missing bash",
            "[shells]\nbash = \"/usr/local/bin/bash\"\n",
            "shells.bash",
            "does not exist",
        ),
        (
            "directory",
            "[shells]\nsh = \"/usr/bin\"\n",
            "shells.sh",
            "not a regular file",
        ),
        (
            "windows default",
            "[shells]\ndefault = \"cmd\"\n",
            "shells.default",
            "Windows shell",
        ),
        (
            "powershell default",
            "[shells]\ndefault = \"powershell\"\n",
            "shells.default",
            "Windows shell",
        ),
        (
            "unknown default",
            "[shells]\ndefault = \"zsh\"\n",
            "shells.default",
            "unknown value",
        ),
        (
            "default disabled",
            "[shells]\nbash = \"\"\ndefault = \"bash\"\n",
            "shells.default",
            "not a validated shell",
        ),
        (
            "bad windows path",
            "[shells]\ncmd = \"cmd.exe\"\n",
            "shells.cmd",
            "absolute Windows path",
        ),
        (
            "bad windows chars",
            "[shells]\npowershell = \"C:\\\\a|b.exe\"\n",
            "shells.powershell",
            "not allowed",
        ),
    ];
    for (case, text, key, needle) in cases {
        assert_error(&client_err(text), key, needle, case);
    }
    let host = FakeHost::standard();
    host.file("/usr/bin/noexec", 0o644, 0);
    host.file("/usr/bin/writable", 0o777, 0);
    host.file("/usr/bin/foreign", 0o755, 4242);
    for (path, needle) in [
        ("/usr/bin/noexec", "not executable"),
        ("/usr/bin/writable", "writable"),
        ("/usr/bin/foreign", "owned by uid 4242"),
    ] {
        let errors =
            load_client("t", &format!("[shells]\nbash = \"{path}\"\n"), &[], &host).unwrap_err();
        assert_error(&errors, "shells.bash", needle, path);
    }
    // Windows strings are syntax-checked only and never advertised.
    let c = client("[shells]\ncmd = \"C:\\\\Windows\\\\System32\\\\cmd.exe\"\n").unwrap();
    assert_eq!(c.shells.advertised(), vec![ShellKind::Sh, ShellKind::Bash]);
    assert!(c.shells.executable_for(ShellKind::Cmd).is_none());
    assert_eq!(c.shells.foreign().len(), 1);
    // Only sh configured: bash is not advertised.
    let c = client("[shells]\nbash = \"\"\n").unwrap();
    assert_eq!(c.shells.advertised(), vec![ShellKind::Sh]);
}

#[test]
fn path_override_cannot_change_the_shell() {
    // plan §7.3: an attacker-controlled PATH entry with a same-named fake
    // shell. The resolution API takes no environment, so a request's
    // `PATH=/evil` has nothing to act on.
    let host = FakeHost::standard();
    host.dir("/evil", 0o755, 1000);
    host.file("/evil/sh", 0o755, 1000);
    host.file("/evil/bash", 0o755, 1000);
    let c = load_client("t", "", &[], &host).unwrap();
    let request_env = [("PATH", "/evil")];
    let _ = request_env; // a request's environment is never an input to resolution
    for kind in [ShellKind::Sh, ShellKind::Bash] {
        let shell = c.shells.executable_for(kind).unwrap();
        assert!(!shell.executable().starts_with("/evil"), "{kind}");
        shell.revalidate(&host).unwrap();
    }
    // A bare name (what a PATH search would need) is refused outright.
    let errors = load_client("t", "[shells]\nsh = \"sh\"\n", &[], &host).unwrap_err();
    assert_error(
        &errors,
        "shells.sh",
        "never looked up through PATH",
        "bare name",
    );
    // Identity is revalidated before launch: a replaced file is refused,
    // with no fallback.
    let sh = c.shells.executable_for(ShellKind::Sh).unwrap();
    host.touch("/usr/bin/dash");
    let changed = sh.revalidate(&host).unwrap_err();
    assert_eq!(changed.kind, ShellKind::Sh);
    assert!(changed.reason.contains("identity"));
}

#[test]
fn profiles_are_validated() {
    let good = r#"
[profiles.light]
required_controls = ["cpu_weight", "pids_max"]
cpu_weight = 50
pids_max = 256

[profiles.cpu_low]
required_controls = ["cpu_max"]
cpu_quota_us = 25000
cpu_period_us = 100000

[profiles.mem_low]
required_controls = ["memory_max"]
memory_max = "512MiB"
memory_high = "384MiB"

[profiles.disk_low]
required_controls = ["io_max"]

[profiles.disk_low.io."8:0"]
read_bps = "10MiB"
write_iops = 100

[profiles.disk_high]
enabled = false
"#;
    let c = client(good).unwrap();
    assert_eq!(
        c.profiles.advertised(),
        vec![
            ProfileName::Light,
            ProfileName::CpuLow,
            ProfileName::MemLow,
            ProfileName::DiskLow
        ]
    );
    let disk = c.profiles.get(ProfileName::DiskLow).unwrap();
    assert_eq!((disk.io[0].major, disk.io[0].minor), (8, 0));

    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "no required controls",
            "[profiles.light]\npids_max = 5\n",
            "profiles.light.required_controls",
            "at least one",
        ),
        (
            "required without value",
            "[profiles.cpu_low]\nrequired_controls = [\"cpu_max\"]\ncpu_weight = 5\n",
            "profiles.cpu_low.required_controls",
            "no nonzero value",
        ),
        (
            "zero value",
            "[profiles.light]\nrequired_controls = [\"pids_max\"]\npids_max = 0\n",
            "profiles.light.pids_max",
            "0 is not allowed",
        ),
        (
            "unknown control",
            "[profiles.light]\nrequired_controls = [\"gpu\"]\n",
            "profiles.light.required_controls",
            "unknown control",
        ),
        (
            "duplicate control",
            "[profiles.light]\nrequired_controls = [\"pids_max\", \"pids_max\"]\npids_max = 5\n",
            "profiles.light.required_controls",
            "twice",
        ),
        (
            "quota without period",
            "[profiles.cpu_low]\nrequired_controls = [\"cpu_max\"]\ncpu_quota_us = 5000\n",
            "profiles.cpu_low.cpu_period_us",
            "needs cpu_period_us",
        ),
        (
            "period too large",
            "[profiles.cpu_low]\nrequired_controls = [\"cpu_max\"]\ncpu_quota_us = 5000\ncpu_period_us = 2000000\n",
            "profiles.cpu_low.cpu_period_us",
            "maximum",
        ),
        (
            "weight too large",
            "[profiles.cpu_low]\nrequired_controls = [\"cpu_weight\"]\ncpu_weight = 10001\n",
            "profiles.cpu_low.cpu_weight",
            "maximum",
        ),
        (
            "memory high above max",
            "[profiles.mem_low]\nrequired_controls = [\"memory_max\"]\nmemory_max = \"1GiB\"\nmemory_high = \"2GiB\"\n",
            "profiles.mem_low.memory_high",
            "must not exceed",
        ),
        (
            "memory float",
            "[profiles.mem_low]\nrequired_controls = [\"memory_max\"]\nmemory_max = 1.5\n",
            "profiles.mem_low.memory_max",
            "fractional",
        ),
        (
            "wrong dimension",
            "[profiles.cpu_low]\nrequired_controls = [\"memory_max\"]\nmemory_max = \"1GiB\"\n",
            "profiles.cpu_low",
            "does not belong",
        ),
        (
            "leading zero device",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.\"08:0\"]\nread_bps = 1\n",
            "profiles.disk_low.io.\"08:0\"",
            "not canonical",
        ),
        (
            "device name",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.sda]\nread_bps = 1\n",
            "profiles.disk_low.io.\"sda\"",
            "MAJOR:MINOR",
        ),
        (
            "device out of range",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.\"4096:0\"]\nread_bps = 1\n",
            "profiles.disk_low.io.\"4096:0\"",
            "exceeds",
        ),
        (
            "empty device rule",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.\"8:0\"]\n",
            "profiles.disk_low.io.\"8:0\"",
            "at least one",
        ),
        (
            "zero bps",
            "[profiles.disk_low]\nrequired_controls = [\"io_max\"]\n[profiles.disk_low.io.\"8:0\"]\nread_bps = 0\n",
            "profiles.disk_low.io.\"8:0\".read_bps",
            "0 is not allowed",
        ),
    ];
    for (case, text, key, needle) in cases {
        assert_error(&client_err(text), key, needle, case);
    }
}

#[test]
fn device_keys_must_be_canonical() {
    for (text, ok) in [
        ("8:0", true),
        ("0:0", true),
        ("259:1048575", true),
        ("08:0", false),
        ("8:00", false),
        ("8: 0", false),
        ("+8:0", false),
        ("8", false),
        ("8:0:1", false),
        ("4096:0", false),
        ("8:1048576", false),
        ("", false),
    ] {
        assert_eq!(parse_device_key(text).is_ok(), ok, "{text:?}");
    }
}

#[test]
fn conflicting_profile_combinations_are_refused() {
    use ProfileName::*;
    let cases: &[(&[ProfileName], Option<ProfileRequestError>)] = &[
        (&[], None),
        (&[Light], None),
        (&[Light, Light], None),
        (&[CpuLow, MemHigh, DiskMedium], None),
        (&[CpuLow, CpuLow], None),
        (
            &[Light, CpuLow],
            Some(ProfileRequestError::LightNotExclusive(CpuLow)),
        ),
        (
            &[DiskLow, Light],
            Some(ProfileRequestError::LightNotExclusive(DiskLow)),
        ),
        (
            &[CpuLow, CpuHigh],
            Some(ProfileRequestError::SameDimension(CpuLow, CpuHigh)),
        ),
        (
            &[MemLow, MemMedium],
            Some(ProfileRequestError::SameDimension(MemLow, MemMedium)),
        ),
        (
            &[DiskHigh, DiskLow],
            Some(ProfileRequestError::SameDimension(DiskLow, DiskHigh)),
        ),
    ];
    for (flags, expected) in cases {
        assert_eq!(
            check_profile_combination(flags).err(),
            *expected,
            "{flags:?}"
        );
    }
    let c = client("[profiles.cpu_low]\nrequired_controls = [\"cpu_weight\"]\ncpu_weight = 10\n[profiles.mem_low]\nenabled = false\nrequired_controls = [\"memory_max\"]\nmemory_max = \"1GiB\"\n").unwrap();
    assert_eq!(
        c.profiles
            .validate_request(&[CpuLow, CpuLow])
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        c.profiles.validate_request(&[CpuMedium]).unwrap_err(),
        ProfileRequestError::NotConfigured(CpuMedium)
    );
    assert_eq!(
        c.profiles.validate_request(&[MemLow]).unwrap_err(),
        ProfileRequestError::NotConfigured(MemLow)
    );
}

#[test]
fn flag_precedence() {
    let host = FakeHost::standard();
    let flag = |k: &str, v: &str| FlagValue::new(k, v);
    let ttl =
        |text: &str, flags: &[FlagValue]| load_server("t", text, flags, &host).unwrap().queue.ttl;
    let minutes = |m: u64| Some(Duration::from_secs(m * 60));
    // default only
    assert_eq!(ttl("", &[]), minutes(15));
    // file only
    assert_eq!(ttl("[queue]\nttl = \"20m\"\n", &[]), minutes(20));
    // flag only
    assert_eq!(ttl("", &[flag("queue.ttl", "30m")]), minutes(30));
    // file + flag: the flag wins
    assert_eq!(
        ttl("[queue]\nttl = \"20m\"\n", &[flag("queue.ttl", "30m")]),
        minutes(30)
    );
    // an omitted flag (another key given) keeps the file value
    assert_eq!(
        ttl(
            "[queue]\nttl = \"20m\"\n",
            &[flag("queue.max_total", "50000")]
        ),
        minutes(20)
    );
    // flags use the same parsers: bare numbers are refused for durations
    let errors = load_server("t", "", &[flag("queue.ttl", "30")], &host).unwrap_err();
    assert_error(&errors, "queue.ttl", "missing unit", "bare flag duration");
    assert_eq!(
        errors.errors[0].origin,
        Origin::Flag("--queue-ttl".to_owned())
    );
    assert!(
        errors.errors[0]
            .render(Some("f.toml"))
            .contains("--queue-ttl: queue.ttl:")
    );
    // flag ceilings and invariants
    let errors = load_server("t", "", &[flag("limits.max_envelope", "2MiB")], &host).unwrap_err();
    assert_error(
        &errors,
        "limits.max_envelope",
        "ceiling",
        "flag above ceiling",
    );
    let errors = load_server(
        "t",
        "",
        &[flag("flow.ingress_low_watermark", "64MiB")],
        &host,
    )
    .unwrap_err();
    assert_error(
        &errors,
        "flow.ingress_low_watermark",
        "below",
        "flag watermark",
    );
    // bytes flags accept plain integers and IEC units
    let s = load_server(
        "t",
        "",
        &[flag("storage.segment_seal_size", "131072")],
        &host,
    )
    .unwrap();
    assert_eq!(s.storage.segment_seal_size, 131_072);
    // list flags: one element per occurrence, a single "" clears
    let c = load_client(
        "t",
        "",
        &[FlagValue {
            key: "client.server_urls".into(),
            values: vec!["wss://a/x".into(), "wss://b/x".into()],
        }],
        &host,
    )
    .unwrap();
    assert_eq!(c.client.server_urls, vec!["wss://a/x", "wss://b/x"]);
    let errors = load_client("t", "", &[flag("client.server_urls", "")], &host).unwrap_err();
    assert_error(
        &errors,
        "client.server_urls",
        "at least one",
        "cleared list",
    );
    // booleans and unknown flag keys
    let s = load_server("t", "", &[flag("jsonrpc.enabled", "true")], &host).unwrap();
    assert!(s.jsonrpc.enabled);
    assert!(load_server("t", "", &[flag("jsonrpc.enabled", "yes")], &host).is_err());
    assert!(load_server("t", "", &[flag("nope.key", "1")], &host).is_err());
}

#[test]
fn all_errors_are_reported_at_once() {
    let errors = server_err(
        "bogus = 1\n[session]\nheartbeat_idle = 10\n[flow]\ningress_low_watermark = \"64MiB\"\n",
    );
    assert!(errors.mentions("bogus"));
    assert!(errors.mentions("session.heartbeat_idle"));
    assert!(errors.mentions("flow.ingress_low_watermark"));
    let rendered = errors.render("s.toml");
    assert_eq!(rendered.lines().count(), 3, "{rendered}");
    assert!(rendered.contains("s.toml:1:1: bogus: unknown section"));
    assert!(rendered.contains("s.toml:3:18: session.heartbeat_idle: durations are strings"));
    assert!(rendered.contains("s.toml:5:1: flow.ingress_low_watermark:"));
}

#[test]
fn jsonrpc_exposure_warns_but_is_allowed() {
    let s = server("[jsonrpc]\nenabled = true\nlisten = \"0.0.0.0:6900\"\n").unwrap();
    assert!(s.jsonrpc.is_exposed());
    assert_eq!(s.warnings().len(), 1);
    assert!(
        s.summary()
            .contains("# WARNING: JSON-RPC is enabled on non-loopback address 0.0.0.0:6900")
    );
    let s = server("[jsonrpc]\nenabled = true\n").unwrap();
    assert!(s.warnings().is_empty());
    let s = server("[jsonrpc]\nlisten = \"0.0.0.0:6900\"\n").unwrap();
    assert!(
        s.warnings().is_empty(),
        "disabled listener draws no warning"
    );
    assert_error(
        &server_err("[jsonrpc]\nlisten = \"localhost:6900\"\n"),
        "jsonrpc.listen",
        "IP socket address",
        "hostname",
    );
    assert_error(
        &server_err("[server]\nagent_listen = \"127.0.0.1:0\"\n"),
        "server.agent_listen",
        "port 0",
        "port zero",
    );
}

#[test]
fn origins_and_agent_path() {
    server(
        "[server]\nallowed_origins = [\"https://ops.example.com\", \"http://localhost:8080\"]\n",
    )
    .unwrap();
    for (text, key) in [
        (
            "[server]\nallowed_origins = [\"ops.example.com\"]\n",
            "server.allowed_origins",
        ),
        (
            "[server]\nallowed_origins = [\"https://a/b\"]\n",
            "server.allowed_origins",
        ),
        ("[server]\nagent_path = \"agent\"\n", "server.agent_path"),
        ("[server]\nagent_path = \"/a b\"\n", "server.agent_path"),
    ] {
        assert!(server_err(text).mentions(key), "{text}");
    }
}

#[test]
fn summary_round_trips_through_the_decoder() {
    let s = server("[queue]\nttl = \"90m\"\n[storage]\ndata_dir = \"/srv//rvbox\"\n").unwrap();
    let again = server(s.summary()).unwrap();
    assert_eq!(
        s.summary().replace("test.toml", ""),
        again.summary().replace("test.toml", "")
    );
    assert!(s.summary().contains("ttl = \"1h30m\""));
    assert!(s.summary().contains("data_dir = \"/srv/rvbox\""));
    let c =
        client("[profiles.light]\nrequired_controls = [\"pids_max\"]\npids_max = 64\n").unwrap();
    let again = client(c.summary()).unwrap();
    assert_eq!(c.summary(), again.summary());
    assert_eq!(c.profiles, again.profiles);
}

#[test]
fn client_labels_are_a_validated_table() {
    let c = client("[client]\nlabels = { zone = \"eu-west\", role = \"web\" }\n").unwrap();
    assert_eq!(c.client.labels.to_string(), "role=web,zone=eu-west");
    // the summary renders them back as a table that decodes to the same
    assert!(
        c.summary()
            .contains("labels = { \"role\" = \"web\", \"zone\" = \"eu-west\" }"),
        "{}",
        c.summary()
    );
    let again = client(c.summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.client.labels, c.client.labels);
    // flags give key=value, one per occurrence, and replace the table
    let host = FakeHost::standard();
    let flags = [FlagValue {
        key: "client.labels".into(),
        values: vec!["role=db".into(), "rack=r1".into()],
    }];
    let c = load_client(
        "t",
        "[client]\nlabels = { role = \"web\" }\n",
        &flags,
        &host,
    )
    .unwrap();
    assert_eq!(c.client.labels.to_string(), "rack=r1,role=db");
    for (text, needle) in [
        (
            "[client]\nlabels = [\"role=web\"]\n",
            "expected a table of labels",
        ),
        ("[client]\nlabels = { role = 1 }\n", "must be a string"),
        ("[client]\nlabels = { \"-x\" = \"a\" }\n", "must start with"),
        ("[client]\nlabels = { role = \"a b\" }\n", "values use"),
        ("[client]\nlabels = { role = \"a,b\" }\n", "values use"),
    ] {
        let errors = client_err(text);
        assert_error(&errors, "client.labels", needle, text);
    }
    let many: Vec<String> = (0..33).map(|i| format!("k{i} = \"v\"")).collect();
    let errors = client_err(&format!("[client]\nlabels = {{ {} }}\n", many.join(", ")));
    assert_error(&errors, "client.labels", "more than 32 labels", "33 labels");
    let errors = load_client(
        "t",
        "",
        &[FlagValue::new("client.labels", "novalue")],
        &host,
    )
    .unwrap_err();
    assert_error(&errors, "client.labels", "is not key=value", "flag");
}
