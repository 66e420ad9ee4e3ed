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
