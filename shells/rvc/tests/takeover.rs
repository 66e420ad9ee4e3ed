//! Takeover end to end: a second installation of a client id (its own
//! state directory, so a new instance id) is refused while the first is
//! connected, shows as the client's claim, and is admitted once an
//! operator authorizes exactly that instance with `rvc client takeover`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::process::{Command, Stdio};

use support::{Stack, bin, free_port, text};

/// A daemon ended when the test ends, passed or not.
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if Stack::term(&mut self.0).is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The value after `key` on its line of `rvc client show`.
fn field(show: &str, key: &str) -> String {
    show.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

#[test]
fn a_reinstalled_client_is_refused_then_admitted_after_an_operator_takeover() {
    let s = Stack::new();
    let show = |s: &Stack| {
        let out = s.rvc(&["client", "show", "web-1"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let first = show(&s);
    assert_eq!(field(&first, "state"), "connected", "{first}");
    assert_eq!(field(&first, "claim"), "none", "{first}");
    let generation: u64 = field(&first, "generation").parse().unwrap();

    // the same client id installed again: a fresh state directory
    let d = s.dir.path();
    let config = std::fs::read_to_string(d.join("client.toml"))
        .unwrap()
        .replace(
            &d.join("cstate").display().to_string(),
            &d.join("cstate2").display().to_string(),
        )
        .replace(
            &format!("127.0.0.1:{}", s.client_health),
            &format!("127.0.0.1:{}", free_port()),
        );
    std::fs::write(d.join("client2.toml"), config).unwrap();
    let _second = Daemon(
        Command::new(bin("rvbox"))
            .arg("--config")
            .arg(d.join("client2.toml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("client2.log")).unwrap())
            .spawn()
            .unwrap(),
    );

    // refused while the first is connected: its instance is the claim
    let mut claim = String::new();
    s.wait_until("the second installation's claim", || {
        claim = field(&show(&s), "claim");
        claim.starts_with("instance ")
    });
    let instance = claim.split_whitespace().nth(1).unwrap().to_owned();
    assert_eq!(instance.len(), 36, "{claim}");
    // the refusal closed its session with the live-conflict code
    let log = std::fs::read_to_string(d.join("client2.log")).unwrap();
    assert!(log.contains("code=Some(4005)"), "{log}");

    // only exactly the claiming instance can be authorized
    let other = "6f1c2a4e-8d3b-4f5a-9c7e-2b1d0e3f4a5b";
    let wrong = s.rvc(&["client", "takeover", "web-1", other]);
    assert_eq!(
        wrong.status.code(),
        Some(17),
        "FAILED_PRECONDITION: {}",
        text(&wrong.stderr)
    );

    support::snapshot(
        &s,
        "client_show_claim",
        &s.rvc(&["client", "show", "web-1"]),
    );
    support::snapshot(
        &s,
        "client_show_claim_json",
        &s.rvc(&["-o", "json", "client", "show", "web-1"]),
    );
    let id = uuid::Uuid::now_v7().hyphenated().to_string();
    let ok = s.rvc(&[
        "--request-id",
        &id,
        "client",
        "takeover",
        "web-1",
        &instance,
    ]);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok.stderr));
    support::snapshot(&s, "client_takeover", &ok);
    support::snapshot(
        &s,
        "client_takeover_json",
        &s.rvc(&[
            "-o",
            "json",
            "--request-id",
            &id,
            "client",
            "takeover",
            "web-1",
            &instance,
        ]),
    );
    assert!(text(&ok.stdout).contains(&instance), "{}", text(&ok.stdout));

    // the second installation's next attempt is admitted: a new
    // generation, and its claim is gone
    s.wait_until("the takeover", || {
        let now = show(&s);
        field(&now, "generation")
            .parse::<u64>()
            .is_ok_and(|g| g > generation)
            && !field(&now, "claim").contains(&instance)
    });
    // and it runs commands
    let out = s.rvc(&["run", "web-1", "echo taken over"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(out.stdout, b"taken over\n");
    let log = std::fs::read_to_string(d.join("client2.log")).unwrap();
    assert!(
        log.contains("shell running"),
        "the second installation ran it: {log}"
    );
}
