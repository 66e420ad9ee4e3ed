//! TLS through the shipped nginx configuration refuses what it must
//! (plan §11.3): a server certificate from a CA the client does not trust,
//! one that has expired, and one for another host name are each refused
//! by the client, which never opens a session (the server never lists
//! it), says why in its log, and keeps retrying; the same client with the
//! right CA and certificate connects and runs a command.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use support::{Nginx, ServerCert, Stack, make_ca, text};

/// Starts a client against nginx presenting `cert`, trusting `ca` (the
/// test CA when `None`); waits until its log shows a refused dial naming
/// `why`, and checks the server never listed it.
fn refused(cert: &ServerCert, wrong_ca: bool, why: &[&str]) {
    let mut s = Stack::server_only();
    let nginx = Nginx::start_with_cert(s.dir.path(), s.port, cert);
    let ca = if wrong_ca {
        make_ca(&s.dir.path().join("other"), "Another CA")
    } else {
        nginx.ca.clone()
    };
    s.client_url(&format!("wss://localhost:{}/rvbox/agent", nginx.port), &ca);
    s.spawn_client();
    let until = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log = s.client_log();
        // two refused dials: it keeps trying, and never gets in
        if log.matches("dial failed").count() >= 2 {
            break log;
        }
        assert!(Instant::now() < until, "no refused dial\n{}", s.logs());
        std::thread::sleep(Duration::from_millis(100));
    };
    let refusal = log
        .lines()
        .find(|l| l.contains("dial failed"))
        .unwrap_or_default();
    assert!(
        why.iter().all(|w| refusal.contains(w)),
        "the refusal should name {why:?}: {refusal}"
    );
    assert!(!log.contains("connected url="), "{log}");
    let listed = text(&s.rvc(&["stat"]).stdout);
    assert!(
        !listed.lines().any(|l| l.starts_with("web-1")),
        "the server knows the client: {listed}"
    );
}

#[test]
fn a_server_certificate_from_an_untrusted_ca_is_refused() {
    refused(
        &ServerCert::default(),
        true,
        &["invalid peer certificate", "UnknownIssuer"],
    );
}

#[test]
fn an_expired_server_certificate_is_refused() {
    refused(
        &ServerCert {
            days: -1,
            ..ServerCert::default()
        },
        false,
        &["invalid peer certificate", "Expired"],
    );
}

#[test]
fn a_server_certificate_for_another_host_name_is_refused() {
    refused(
        &ServerCert {
            names: "DNS:rvbox.example.net".into(),
            days: 2,
        },
        false,
        &["invalid peer certificate", "not valid for name"],
    );
}

/// Rewrites `table`'s first line in `file` of the stack's directory to
/// carry `lines` as well.
fn add_to_table(s: &Stack, file: &str, table: &str, lines: &str) {
    let path = s.dir.path().join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let header = format!("[{table}]\n");
    assert!(text.contains(&header), "{text}");
    std::fs::write(
        &path,
        text.replacen(&header, &format!("{header}{lines}"), 1),
    )
    .unwrap();
}

/// With `server.client_identity = "tls-client-cert"` a client is who its
/// certificate says: through the client-certificate variant of the shipped
/// nginx configuration, a client whose certificate names it connects and
/// runs a command; the same certificate claiming another client id is
/// refused with a reason naming both; a client without a certificate
/// never gets past nginx; and an upgrade that bypasses nginx, with the
/// subject header forged, is refused because it does not come from a
/// trusted proxy.
#[test]
fn with_client_certificates_a_client_is_who_its_certificate_says() {
    use std::io::{Read as _, Write as _};
    let mut s = Stack::configured();
    add_to_table(
        &s,
        "server.toml",
        "server",
        "client_identity = \"tls-client-cert\"\ntrusted_proxies = [\"127.0.0.2\"]\n",
    );
    s.start_server();
    let nginx = Nginx::start_mtls(s.dir.path(), s.port, "127.0.0.2");
    let url = format!("wss://localhost:{}/rvbox/agent", nginx.port);
    s.client_url(&url, &nginx.ca);
    let (crt, key) = nginx.client_cert("web-1");
    add_to_table(
        &s,
        "client.toml",
        "client",
        &format!(
            "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            crt.display(),
            key.display()
        ),
    );
    s.start_client();
    let out = s.rvc(&["run", "web-1", "echo certified"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    assert_eq!(out.stdout, b"certified\n");

    // bypassing nginx, with the subject forged: not a trusted proxy
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(
        tcp,
        "GET /rvbox/agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         X-RVBox-Client-Subject: CN=web-1\r\n\r\n"
    )
    .unwrap();
    let mut answer = [0u8; 12];
    tcp.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 403");

    // the same certificate claiming to be web-2
    s.stop_client();
    let cfg = s.dir.path().join("client.toml");
    let text_cfg = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text_cfg.replace("client_id = \"web-1\"", "client_id = \"web-2\""),
    )
    .unwrap();
    s.spawn_client();
    s.wait_until("the server refuses web-2's hello", || {
        s.server_log()
            .contains("client_hello.client_id \\\"web-2\\\" is not the client its TLS client certificate names (\\\"web-1\\\")")
            || s.server_log().contains(
                "client_hello.client_id \"web-2\" is not the client its TLS client certificate names (\"web-1\")",
            )
    });
    let listed = text(&s.rvc(&["stat"]).stdout);
    assert!(
        !listed
            .lines()
            .any(|l| l.starts_with("web-2") && l.contains("connected")),
        "{listed}"
    );

    // no certificate at all: nginx refuses
    s.stop_client();
    let text_cfg = std::fs::read_to_string(&cfg).unwrap();
    let stripped: String = text_cfg
        .lines()
        .filter(|l| !l.starts_with("tls_cert_file") && !l.starts_with("tls_key_file"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(
        &cfg,
        stripped.replace("client_id = \"web-2\"", "client_id = \"web-1\""),
    )
    .unwrap();
    let before = s.client_log().matches("dial failed").count();
    s.spawn_client();
    s.wait_until("a dial without a certificate fails", || {
        s.client_log().matches("dial failed").count() > before
    });
    let log = s.client_log();
    let refusal = log
        .lines()
        .rfind(|l| l.contains("dial failed"))
        .unwrap_or_default();
    assert!(refusal.contains("HTTP 400"), "{refusal}");
}
