#![allow(dead_code, clippy::unwrap_used)]
//! What the engine's integration tests share: an engine on a real store,
//! and the hello of `web-1`.

use std::sync::Arc;

use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_engine::Engine;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{ServerIdentity, SessionConfig};
use rvbox_store::entropy::OsEntropy;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

/// The wall clock every test runs at.
pub(crate) const WALL: i64 = 1_800_000_000_000;

pub(crate) fn engine(dir: &std::path::Path) -> Engine {
    let mut store = Store::open(
        Layout::new(dir),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        WALL,
    )
    .unwrap();
    store.recover(WALL).unwrap();
    let server_id = Uuid7::from_bytes("server_id", store.server_id()).unwrap();
    let config = SessionConfig::new(ServerIdentity {
        server_id,
        software_version: "0.1.0".into(),
        supported_minors: vec![0],
    });
    Engine::new(store, Arc::new(OsEntropy), config)
}

pub(crate) fn hello(instance: &str) -> Vec<u8> {
    wire::Envelope {
        session_id: String::new(),
        generation: 0,
        payload: Some(Payload::ClientHello(wire::ClientHello {
            client_id: "web-1".into(),
            client_instance_id: instance.into(),
            protocol_major: 1,
            supported_minors: vec![0],
            capabilities: Some(wire::Capabilities {
                platform: Some(wire::Platform {
                    os: "linux".into(),
                    arch: "x86_64".into(),
                    os_release: String::new(),
                }),
                software_version: "1.0.0".into(),
                shells: vec![wire::ShellCapability {
                    shell_type: wire::ShellType::Sh as i32,
                    platform_default: true,
                }],
                profiles: vec![],
                max_running: 2,
                max_queued: 0,
                supervision_mode: wire::SupervisionMode::CgroupV2 as i32,
            }),
            cwd_policy: Some(wire::CwdPolicy {
                default_cwd: "/srv".into(),
                allowed_roots: vec!["/srv".into()],
            }),
            labels: vec![],
        })),
    }
    .encode_to_vec()
}
