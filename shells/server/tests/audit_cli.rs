//! The audit log offline through `rvbox-server audit` (docs/storage.md,
//! "The audit chain"): a server that ran commands and stopped has its
//! whole audit log in segments; `verify` passes and prints the head,
//! `list` shows the operator's commands, and an edited record (its
//! checksums made to match) fails `verify` with exit 6 naming the segment.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Command;

use rvbox_testkit::{Stack, bin, text};

fn audit(s: &Stack, args: &[&str]) -> std::process::Output {
    Command::new(bin("rvbox-server"))
        .arg("audit")
        .arg("--data-dir")
        .arg(s.dir.path().join("data"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_stopped_servers_audit_log_verifies_and_an_edited_record_does_not() {
    let mut s = Stack::new();
    for i in 0..3 {
        let out = s.rvc(&["run", "web-1", &format!("echo {i}")]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    // a live server's store is locked
    let locked = audit(&s, &["verify"]);
    assert_eq!(locked.status.code(), Some(4), "{}", text(&locked.stderr));
    assert!(text(&locked.stderr).contains("stop the server first"));
    s.stop_client();
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());

    let ok = audit(&s, &["verify"]);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}{}",
        text(&ok.stdout),
        text(&ok.stderr)
    );
    let out = text(&ok.stdout);
    assert!(
        out.contains("ok: every committed record matches the chain"),
        "{out}"
    );
    assert!(
        out.contains("waiting in the outbox 0"),
        "the stop flushed the outbox: {out}"
    );
    let listed = text(&audit(&s, &["list"]).stdout);
    assert_eq!(
        listed
            .lines()
            .filter(|l| l.contains(" RunCommand ok client=web-1"))
            .count(),
        3,
        "{listed}"
    );

    // edit a RunCommand record: its action and every checksum recomputed
    let dir = s.dir.path().join("data/audit");
    let seg = dir.join(rvbox_segment::audit_file_name(1).unwrap());
    let bytes = std::fs::read(&seg).unwrap();
    let limits = rvbox_store::audit::audit_limits();
    let mut out = Vec::new();
    let mut off = 0;
    let mut edited = false;
    while off < bytes.len() {
        let d = rvbox_segment::decode(&bytes[off..], &limits).unwrap();
        let len = rvbox_segment::encoded_len(u32::try_from(d.payload.len()).unwrap()) as usize;
        let mut raw = zstd::bulk::decompress(d.payload, d.meta.raw_len as usize).unwrap();
        let mut rec = rvbox_store::audit::AuditRecord::decode(&raw).unwrap();
        if !edited && rec.action == "RunCommand" {
            rec.action = "GetCommand".into();
            raw = rec.encode();
            edited = true;
        }
        let mut meta = d.meta.clone();
        meta.raw_len = u32::try_from(raw.len()).unwrap();
        meta.sha256 = rvbox_segment::sha256(&raw);
        let stored = zstd::bulk::compress(&raw, 3).unwrap();
        out.extend(rvbox_segment::encode(&meta, &stored, &limits).unwrap());
        off += len;
    }
    assert!(edited);
    std::fs::write(&seg, &out).unwrap();
    let bad = audit(&s, &["verify"]);
    assert_eq!(bad.status.code(), Some(6), "{}", text(&bad.stdout));
    assert!(
        text(&bad.stdout).contains("problem: audit segment"),
        "{}",
        text(&bad.stdout)
    );
}

/// Reads and refusals at the edges are audited: an operator's reads
/// (with the command they were about and the caller's uid), an agent
/// upgrade refused for its Origin, and a JSON-RPC request that names no
/// method; each shows in the audit log once the server stopped.
#[test]
fn control_reads_and_edge_refusals_are_audited() {
    use std::io::{Read as _, Write as _};
    let rpc_port = rvbox_testkit::free_port();
    let mut s = Stack::with_server_config(&format!(
        "[jsonrpc]\nenabled = true\nlisten = \"127.0.0.1:{rpc_port}\"\n"
    ));
    let run = s.rvc(&["run", "--background", "web-1", "echo audited"]);
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    let issue = rvbox_testkit::issue_of(&run);
    assert_eq!(
        s.rvc(&["stat", "web-1", &issue]).status.code(),
        Some(0),
        "{}",
        s.logs()
    );
    assert_eq!(s.rvc(&["list", "web-1"]).status.code(), Some(0));
    // an agent upgrade from a browser page that is not allowed
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(
        tcp,
        "GET /rvbox/agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Origin: https://evil.example\r\n\r\n"
    )
    .unwrap();
    let mut answer = [0u8; 12];
    tcp.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 403");
    // a JSON-RPC body that is not a request
    let mut rpc = std::net::TcpStream::connect(("127.0.0.1", rpc_port)).unwrap();
    let body = "{\"jsonrpc\":\"2.0\",\"id\":1}";
    write!(
        rpc,
        "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    rpc.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("\"error\""), "{reply}");
    s.stop_client();
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());

    let listed = text(&audit(&s, &["list", "--limit", "1000"]).stdout);
    let uid = format!("uid:{}", rustix_uid());
    let has = |needle: &[&str]| listed.lines().any(|l| needle.iter().all(|n| l.contains(n)));
    assert!(
        has(&[" GetCommand ok", &uid, &format!("issue={issue}")]),
        "no GetCommand read of {issue}:\n{listed}"
    );
    assert!(has(&[" ListCommands ok", "client=web-1"]), "{listed}");
    assert!(
        has(&["agent-wss", " UpgradeRefused ok", "origin (HTTP 403)"]),
        "{listed}"
    );
    assert!(has(&["json-rpc", " InvalidRequest refused"]), "{listed}");
    assert_eq!(audit(&s, &["verify"]).status.code(), Some(0));
}

fn rustix_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}
