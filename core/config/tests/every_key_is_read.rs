//! Every configuration key is read by the code it names (plan §4.3: a
//! parsed key that nothing reads is a promise not kept). For each key of
//! both daemons this test names where it is read outside this crate, and
//! checks that the reading is really there; a key with no reader, a reader
//! that went away, or an entry for a key the registry no longer has fails
//! the test. Keys this crate resolves itself, or that do not apply to this
//! platform, are listed apart with the reason. Removed keys are refused by
//! name (`registry::REMOVED`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// a test of the source tree: it reads the workspace's files
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeSet;
use std::path::Path;

use rvbox_config::Daemon;

/// Where each key is read: the key, a file of the workspace, and text of
/// that file that reads it.
const READERS: &[(&str, &str, &str)] = &[
    (
        "server.agent_listen",
        "shells/server/src/daemon.rs",
        "config.agent.listen",
    ),
    (
        "server.agent_path",
        "shells/server/src/daemon.rs",
        "config.agent.path",
    ),
    (
        "server.allowed_origins",
        "shells/server/src/daemon.rs",
        "config.agent.allowed_origins",
    ),
    (
        "server.client_identity",
        "shells/server/src/daemon.rs",
        "config.agent.identity",
    ),
    (
        "server.client_cert_header",
        "shells/server/src/agent.rs",
        ".get(header.as_str())",
    ),
    (
        "server.trusted_proxies",
        "shells/server/src/agent.rs",
        "trusted_proxies.contains(&peer.ip())",
    ),
    (
        "server.store",
        "shells/server/src/daemon.rs",
        "match &config.store",
    ),
    (
        "postgres.conninfo",
        "shells/server/src/replica.rs",
        "cfg.conninfo",
    ),
    (
        "postgres.password_file",
        "shells/server/src/replica.rs",
        "cfg.password_file",
    ),
    (
        "storage.data_dir",
        "shells/server/src/daemon.rs",
        ".storage.data_dir",
    ),
    (
        "storage.sqlite_synchronous",
        "shells/engine/src/settings.rs",
        ".storage.sqlite_synchronous",
    ),
    (
        "storage.command_output_window",
        "shells/engine/src/settings.rs",
        ".storage.command_output_window",
    ),
    (
        "storage.command_total",
        "shells/engine/src/settings.rs",
        ".storage.command_total",
    ),
    (
        "storage.per_client_total",
        "shells/engine/src/settings.rs",
        ".storage.per_client_total",
    ),
    (
        "storage.server_total",
        "shells/engine/src/settings.rs",
        ".storage.server_total",
    ),
    (
        "storage.closeout_reserve",
        "shells/engine/src/settings.rs",
        ".storage.closeout_reserve",
    ),
    (
        "storage.terminal_retention",
        "shells/engine/src/settings.rs",
        ".storage.terminal_retention",
    ),
    (
        "storage.scrub_interval",
        "shells/engine/src/settings.rs",
        ".storage.scrub_interval",
    ),
    (
        "storage.free_space_floor",
        "shells/engine/src/settings.rs",
        ".storage.free_space_floor",
    ),
    (
        "storage.tombstones",
        "shells/engine/src/settings.rs",
        ".storage.tombstones",
    ),
    (
        "storage.segment_seal_size",
        "shells/engine/src/settings.rs",
        ".storage.segment_seal_size",
    ),
    (
        "storage.group_commit_max_delay",
        "shells/engine/src/settings.rs",
        ".storage.group_commit_max_delay",
    ),
    (
        "storage.group_commit_max_batch",
        "shells/engine/src/settings.rs",
        ".storage.group_commit_max_batch",
    ),
    (
        "audit.max_bytes",
        "shells/engine/src/settings.rs",
        ".audit.max_bytes",
    ),
    (
        "audit.retention",
        "shells/engine/src/settings.rs",
        ".audit.retention",
    ),
    ("queue.ttl", "shells/engine/src/settings.rs", ".queue.ttl"),
    (
        "queue.max_per_client",
        "shells/engine/src/settings.rs",
        ".queue.max_per_client",
    ),
    (
        "queue.max_total",
        "shells/engine/src/settings.rs",
        ".queue.max_total",
    ),
    (
        "queue.retry_initial",
        "shells/engine/src/settings.rs",
        ".queue.retry_initial",
    ),
    (
        "queue.retry_max",
        "shells/engine/src/settings.rs",
        ".queue.retry_max",
    ),
    (
        "session.heartbeat_idle",
        "shells/client-runtime/src/settings.rs",
        ".session.heartbeat_idle",
    ),
    (
        "session.liveness_timeout",
        "shells/client-runtime/src/settings.rs",
        ".session.liveness_timeout",
    ),
    (
        "session.reconcile_timeout",
        "shells/engine/src/settings.rs",
        ".session.reconcile_timeout",
    ),
    (
        "session.takeover_grant_ttl",
        "shells/engine/src/settings.rs",
        ".session.takeover_grant_ttl",
    ),
    (
        "terminals.idle_timeout",
        "shells/engine/src/settings.rs",
        ".terminals.idle_timeout",
    ),
    (
        "terminals.max_per_client",
        "shells/engine/src/settings.rs",
        ".terminals.max_per_client",
    ),
    (
        "terminals.max_open",
        "shells/client-runtime/src/settings.rs",
        ".terminals.max_open",
    ),
    (
        "terminals.recording_bytes",
        "shells/engine/src/settings.rs",
        ".terminals.recording_bytes",
    ),
    (
        "flow.command_send_window",
        "shells/client-runtime/src/settings.rs",
        ".flow.command_send_window",
    ),
    (
        "flow.session_send_window",
        "shells/client-runtime/src/settings.rs",
        ".flow.session_send_window",
    ),
    (
        "flow.ingress_high_watermark",
        "shells/engine/src/settings.rs",
        ".flow.ingress_high_watermark",
    ),
    (
        "flow.ingress_low_watermark",
        "shells/engine/src/settings.rs",
        ".flow.ingress_low_watermark",
    ),
    (
        "limits.max_envelope",
        "shells/engine/src/settings.rs",
        ".limits.max_envelope",
    ),
    (
        "limits.max_control_request",
        "shells/server/src/daemon.rs",
        ".limits.max_control_request",
    ),
    (
        "control.runtime_dir",
        "shells/server/src/daemon.rs",
        ".control.runtime_dir",
    ),
    (
        "control.socket_path",
        "shells/server/src/daemon.rs",
        ".control.socket_path",
    ),
    (
        "control.default_page_size",
        "shells/server/src/control.rs",
        "c.default_page_size",
    ),
    (
        "control.max_page_size",
        "shells/server/src/control.rs",
        "c.max_page_size",
    ),
    (
        "control.default_output_page",
        "shells/server/src/control.rs",
        "c.default_output_page",
    ),
    (
        "control.max_output_page",
        "shells/server/src/control.rs",
        "c.max_output_page",
    ),
    (
        "jsonrpc.enabled",
        "shells/server/src/daemon.rs",
        ".jsonrpc.enabled",
    ),
    (
        "jsonrpc.listen",
        "shells/server/src/daemon.rs",
        ".jsonrpc.listen",
    ),
    (
        "jsonrpc.max_body",
        "shells/server/src/daemon.rs",
        ".jsonrpc.max_body",
    ),
    (
        "observability.log_level",
        "shells/common/src/lib.rs",
        "config.log_level",
    ),
    (
        "observability.log_format",
        "shells/common/src/lib.rs",
        "config.log_format",
    ),
    (
        "observability.metrics_listen",
        "shells/client/src/daemon.rs",
        ".observability.metrics_listen",
    ),
    (
        "client.client_id",
        "shells/client-runtime/src/settings.rs",
        ".client.client_id",
    ),
    (
        "client.server_urls",
        "shells/client/src/net.rs",
        ".client.server_urls",
    ),
    ("client.ca_file", "shells/client/src/net.rs", ".ca_file"),
    (
        "client.tls_cert_file",
        "shells/client/src/net.rs",
        "&cfg.client.tls_identity",
    ),
    (
        "client.tls_key_file",
        "shells/client/src/net.rs",
        "load_identity(cert, key)",
    ),
    (
        "client.state_dir",
        "shells/client-runtime/src/settings.rs",
        ".client.state_dir",
    ),
    (
        "client.labels",
        "shells/client-runtime/src/settings.rs",
        ".client.labels",
    ),
    (
        "exec.allowed_cwd_roots",
        "shells/client-runtime/src/settings.rs",
        ".allowed_cwd_roots",
    ),
    (
        "exec.default_cwd",
        "shells/client-runtime/src/settings.rs",
        ".exec.default_cwd",
    ),
    (
        "exec.max_running",
        "shells/client-runtime/src/settings.rs",
        ".exec.max_running",
    ),
    (
        "exec.max_queued",
        "shells/client-runtime/src/settings.rs",
        ".exec.max_queued",
    ),
    (
        "exec.drain_grace",
        "shells/client-runtime/src/settings.rs",
        ".exec.drain_grace",
    ),
    (
        "exec.kill_grace",
        "shells/client-runtime/src/settings.rs",
        ".exec.kill_grace",
    ),
    (
        "exec.diagnostics_interval",
        "shells/client-runtime/src/settings.rs",
        ".exec.diagnostics_interval",
    ),
    (
        "exec.suspected_hung_after",
        "shells/client-runtime/src/settings.rs",
        ".exec.suspected_hung_after",
    ),
    (
        "reconnect.initial",
        "shells/client-runtime/src/settings.rs",
        ".reconnect.initial",
    ),
    (
        "reconnect.max",
        "shells/client-runtime/src/settings.rs",
        ".reconnect.max",
    ),
    (
        "reconnect.stable_reset",
        "shells/client-runtime/src/settings.rs",
        ".reconnect.stable_reset",
    ),
    (
        "spool.command_output_window",
        "shells/client-runtime/src/settings.rs",
        ".command_output_window",
    ),
    (
        "spool.command_total",
        "shells/client-runtime/src/settings.rs",
        ".spool.command_total",
    ),
    (
        "spool.daemon_total",
        "shells/client-runtime/src/settings.rs",
        ".spool.daemon_total",
    ),
    (
        "spool.closeout_reserve",
        "shells/client-runtime/src/settings.rs",
        ".spool.closeout_reserve",
    ),
    (
        "spool.free_space_floor",
        "shells/client-runtime/src/settings.rs",
        ".spool.free_space_floor",
    ),
    (
        "spool.tombstones",
        "shells/client/src/daemon.rs",
        ".spool.tombstones",
    ),
    (
        "flow.command_high_watermark",
        "shells/client-runtime/src/settings.rs",
        ".flow.command_high_watermark",
    ),
    (
        "flow.command_low_watermark",
        "shells/client-runtime/src/settings.rs",
        ".flow.command_low_watermark",
    ),
    (
        "flow.daemon_high_watermark",
        "shells/client-runtime/src/settings.rs",
        ".flow.daemon_high_watermark",
    ),
    (
        "flow.daemon_low_watermark",
        "shells/client-runtime/src/settings.rs",
        ".flow.daemon_low_watermark",
    ),
];

/// Keys read inside the configuration crate, or not on this platform.
const ELSEWHERE: &[(&str, &str)] = &[
    (
        "shells.sh",
        "resolved by the configuration to its validated executable (ShellsConfig::executable_for and advertised), which shells/client-runtime/src/settings.rs reads",
    ),
    (
        "shells.bash",
        "resolved by the configuration to its validated executable (ShellsConfig::executable_for and advertised), which shells/client-runtime/src/settings.rs reads",
    ),
    (
        "shells.default",
        "resolved by the configuration (ShellsConfig), whose default shell shells/client-runtime/src/settings.rs reads",
    ),
    (
        "shells.cmd",
        "Windows only: syntax-checked on Linux and never advertised (docs/configuration.md)",
    ),
    (
        "shells.powershell",
        "Windows only: syntax-checked on Linux and never advertised (docs/configuration.md)",
    ),
];

#[test]
fn every_key_of_both_daemons_has_a_reader_that_is_really_there() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let keys: BTreeSet<&str> = [Daemon::Server, Daemon::Client]
        .iter()
        .flat_map(|d| d.keys().iter().map(|k| k.path))
        .collect();
    let mut problems = Vec::new();
    for key in &keys {
        let read = READERS.iter().any(|(k, _, _)| k == key);
        let apart = ELSEWHERE.iter().any(|(k, _)| k == key);
        if !read && !apart {
            problems.push(format!(
                "{key}: nothing reads it (add its reader, or remove the key)"
            ));
        }
    }
    for (key, file, needle) in READERS {
        if !keys.contains(key) {
            problems.push(format!(
                "{key}: listed as read in {file}, but the registry has no such key"
            ));
            continue;
        }
        match std::fs::read_to_string(root.join(file)) {
            Ok(text) if text.contains(needle) => {}
            Ok(_) => problems.push(format!(
                "{key}: {file} no longer reads it ({needle:?} not found)"
            )),
            Err(e) => problems.push(format!("{key}: {file}: {e}")),
        }
    }
    for (key, _) in ELSEWHERE {
        if !keys.contains(key) {
            problems.push(format!(
                "{key}: listed apart, but the registry has no such key"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
