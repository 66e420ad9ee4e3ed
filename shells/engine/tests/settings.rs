#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Every configuration key the store, the session core and the dispatch
//! core use reaches them: a configuration with a non-default value for each
//! is mapped, and each value comes out where it belongs.

#[path = "../../../core/config/tests/support/mod.rs"]
mod support;

use rvbox_config::load_server;
use rvbox_domain::ids::Uuid7;
use rvbox_engine::server_settings;
use rvbox_session::ServerIdentity;
use rvbox_store::db::Synchronous;

const CONFIG: &str = r#"
[storage]
sqlite_synchronous = "extra"
command_output_window = "9MiB"
command_total = "30MiB"
per_client_total = "200MiB"
server_total = "3GiB"
closeout_reserve = "128KiB"
terminal_retention = "7d"
free_space_floor = "300MiB"
tombstones = 5000
segment_seal_size = "512KiB"
group_commit_max_delay = "5ms"
group_commit_max_batch = 1000

[audit]
max_bytes = "50MiB"
retention = "2d"

[queue]
ttl = "20m"
max_per_client = 77
max_total = 7777
retry_initial = "2s"
retry_max = "3m"

[session]
heartbeat_idle = "12s"
liveness_timeout = "40s"

[flow]
command_send_window = "512KiB"
session_send_window = "4MiB"
ingress_high_watermark = "48MiB"
ingress_low_watermark = "16MiB"

[limits]
max_envelope = "960KiB"
"#;

#[test]
fn every_mapped_key_reaches_its_core() {
    let cfg = load_server("server.toml", CONFIG, &[], &support::FakeHost::standard())
        .unwrap_or_else(|e| panic!("{e}"));
    let identity = ServerIdentity {
        server_id: Uuid7::parse("id", "01a3185c-5000-7663-a2e9-348cca6cee29").unwrap(),
        software_version: "0.1.0".into(),
        supported_minors: vec![0],
    };
    let s = server_settings(&cfg, identity).unwrap();
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const DAY: u64 = 86_400_000;
    assert_eq!(s.store.db.synchronous, Synchronous::Extra);
    assert_eq!(s.store.tiers.command_output_window, 9 * MIB);
    assert_eq!(s.store.tiers.command_total, 30 * MIB);
    assert_eq!(s.store.tiers.per_owner_total, 200 * MIB);
    assert_eq!(s.store.tiers.global_total, 3 * 1024 * MIB);
    assert_eq!(s.store.tiers.closeout_reserve, 128 * KIB);
    assert_eq!(s.store.terminal_retention_ms, 7 * DAY);
    assert_eq!(s.store.tiers.free_space_floor, 300 * MIB);
    assert_eq!(s.store.tombstone_cap, 5000);
    assert_eq!(s.store.seal_bytes, 512 * KIB);
    assert_eq!(s.store.audit_budget_bytes, 50 * MIB);
    assert_eq!(s.store.audit_retention_ms, 2 * DAY);
    assert_eq!(s.store.queue_ttl_ms, 20 * 60_000);
    assert_eq!(s.store.queue_max_per_client, 77);
    assert_eq!(s.store.queue_max_total, 7777);
    assert_eq!(
        s.retry,
        rvbox_dispatch::RetryPolicy::new(2_000, 180_000).unwrap()
    );
    assert_eq!(s.session.limits.heartbeat_idle_ms, 12_000);
    assert_eq!(s.session.limits.liveness_timeout_ms, 40_000);
    assert_eq!(s.session.hello_timeout_ms, 40_000);
    assert_eq!(s.session.limits.command_window_bytes, 512 * KIB);
    assert_eq!(s.session.limits.session_window_bytes, 4 * MIB);
    assert_eq!(s.session.limits.max_envelope_bytes, 960 * KIB);
    assert_eq!(s.ingress, (48 * MIB, 16 * MIB));
    assert_eq!(
        s.group,
        rvbox_engine::GroupPolicy {
            max_delay_ms: 5,
            max_events: 1000
        }
    );
}
