//! A minimal agent peer speaking the RVBox agent protocol over a real
//! WebSocket: hello, welcome, an empty reconciliation snapshot, capacity.
//! Used by the idle-connection benchmark (many sessions) and by the
//! end-to-end tests (a registered session that then misbehaves).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use futures_util::{SinkExt as _, StreamExt as _};
use prost::Message as _;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use tokio::net::TcpSocket;
use tokio_tungstenite::tungstenite::Message;

pub fn env(session_id: &str, generation: u64, payload: Payload) -> Message {
    Message::Binary(
        wire::Envelope {
            session_id: session_id.into(),
            generation,
            payload: Some(payload),
        }
        .encode_to_vec()
        .into(),
    )
}

pub fn hello(i: usize) -> wire::ClientHello {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&(i as u64).to_be_bytes());
    id[6] = 0x40 | (id[6] & 0x0f);
    id[8] = 0x80 | (id[8] & 0x3f);
    wire::ClientHello {
        client_id: format!("load-{i:05}"),
        client_instance_id: uuid::Uuid::from_bytes(id).hyphenated().to_string(),
        protocol_major: 1,
        supported_minors: vec![0],
        capabilities: Some(wire::Capabilities {
            platform: Some(wire::Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                os_release: "bench".into(),
            }),
            software_version: "0.1.0".into(),
            shells: vec![wire::ShellCapability {
                shell_type: wire::ShellType::Sh as i32,
                platform_default: true,
            }],
            profiles: vec![],
            max_running: 4,
            max_queued: 4,
            supervision_mode: wire::SupervisionMode::Fallback as i32,
        }),
        cwd_policy: Some(wire::CwdPolicy {
            default_cwd: "/tmp".into(),
            allowed_roots: vec!["/tmp".into()],
        }),
        labels: vec![],
    }
}

pub type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

pub async fn next_payload(ws: &mut Ws) -> Payload {
    loop {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) => {
                return wire::Envelope::decode(b.as_ref()).unwrap().payload.unwrap();
            }
            Some(Ok(Message::Close(f))) => panic!("closed: {f:?}"),
            Some(Ok(_)) => {}
            other => panic!("read: {other:?}"),
        }
    }
}

/// Registers session `i` and returns its socket, idle.
pub async fn register(i: usize, port: u16) -> Ws {
    register_session(i, port).await.0
}

/// Registers session `i`; returns its socket, session id and generation.
pub async fn register_session(i: usize, port: u16) -> (Ws, String, u64) {
    // spread the source addresses over 127.0.0.0/8 (one /24 per 250)
    let src = std::net::Ipv4Addr::new(
        127,
        1 + (i / 62_500) as u8,
        ((i / 250) % 250) as u8,
        (i % 250 + 1) as u8,
    );
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind((src, 0).into()).unwrap();
    let tcp = sock.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let (mut ws, _) =
        tokio_tungstenite::client_async(format!("ws://127.0.0.1:{port}/rvbox/agent"), tcp)
            .await
            .unwrap();
    ws.send(env("", 0, Payload::ClientHello(hello(i))))
        .await
        .unwrap();
    let Payload::ServerWelcome(w) = next_payload(&mut ws).await else {
        panic!("no welcome")
    };
    let (sid, generation) = (w.session_id.clone(), w.generation);
    let round = loop {
        if let Payload::ReconcileRequest(r) = next_payload(&mut ws).await {
            break r.round;
        }
    };
    ws.send(env(
        &sid,
        generation,
        Payload::ClientSnapshot(wire::ClientSnapshot {
            round,
            chunk_index: 0,
            final_chunk: true,
            store_health: wire::ScopeState::Ready as i32,
            records: vec![],
            tombstones: vec![],
        }),
    ))
    .await
    .unwrap();
    loop {
        if let Payload::ReconcileResult(_) = next_payload(&mut ws).await {
            break;
        }
    }
    ws.send(env(
        &sid,
        generation,
        Payload::ClientCapacity(wire::ClientCapacity {
            running: 0,
            queued: 0,
            max_running: 4,
            max_queued: 4,
        }),
    ))
    .await
    .unwrap();
    (ws, sid, generation)
}

/// The resident memory of process `pid` in KiB (0 once it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Whether `GET path` on a loopback port answers 200.
pub fn http_ok(port: u16, path: &str) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut t = String::new();
    let _ = s.read_to_string(&mut t);
    t.starts_with("HTTP/1.1 200")
}
