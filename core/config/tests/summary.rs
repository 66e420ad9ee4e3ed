#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Golden tests of the redacted, normalized effective configuration (plan
//! §4.3 item 9): a stable key order operators can diff across deployments.

mod support;

use rvbox_config::{load_client, load_server};
use support::FakeHost;

#[test]
fn server_defaults_summary() {
    let s = load_server("/etc/rvbox/server.toml", "", &[], &FakeHost::standard()).unwrap();
    insta::assert_snapshot!(s.summary());
}

#[test]
fn server_customized_summary() {
    let text = r#"
[jsonrpc]
enabled = true
listen = "0.0.0.0:6900"

[queue]
ttl = "0s"
retry_max = "5400s"

[storage]
data_dir = "/srv//rvbox/./data/"
server_total = 8589934592
"#;
    let s = load_server("custom.toml", text, &[], &FakeHost::standard()).unwrap();
    insta::assert_snapshot!(s.summary());
}

#[test]
fn client_defaults_summary() {
    let c = load_client("/etc/rvbox/client.toml", "", &[], &FakeHost::standard()).unwrap();
    insta::assert_snapshot!(c.summary());
}

#[test]
fn client_profiles_summary() {
    let text = r#"
[client]
client_id = "web-01.example.com"
server_urls = ["wss://rvbox.example.com/rvbox/agent", "ws://10.0.0.5:7700/rvbox/agent"]

[profiles.disk_low]
required_controls = ["io_max"]

[profiles.disk_low.io."259:0"]
write_bps = 20971520

[profiles.disk_low.io."8:0"]
read_bps = "10MiB"
read_iops = 300

[profiles.light]
required_controls = ["pids_max", "cpu_weight"]
cpu_weight = 20
pids_max = 128
memory_max = "1GiB"
"#;
    let c = load_client("client.toml", text, &[], &FakeHost::standard()).unwrap();
    insta::assert_snapshot!(c.summary());
}
