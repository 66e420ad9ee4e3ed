//! RVBox end to end on this host: the real `rvbox-server`, `rvbox` and
//! `rvc` binaries on loopback, a real WebSocket, a real control socket,
//! real SQLite files and real processes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use support::{Stack, issue_of, text};

#[test]
fn foreground_run_returns_output_and_exit_status_byte_for_byte() {
    let s = Stack::new();
    // no trailing newline, a partial line on stderr, binary-ish bytes
    let out = s.rvc(&[
        "run",
        "web-1",
        "printf 'one\\ntwo'; printf 'half' >&2; printf '\\001\\377'; exit 7",
    ]);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    assert_eq!(out.stdout, b"one\ntwo\x01\xff");
    let err = text(&out.stderr);
    let mut lines = err.lines();
    let uuid = lines.next().unwrap();
    assert_eq!(uuid.len(), 36, "the UUID comes first on stderr: {err}");
    assert!(err.ends_with("half"), "{err:?}");
}

#[test]
fn a_configured_backlog_larger_than_a_burst_keeps_every_byte_of_a_fast_child() {
    // `cat` writes 8 MiB at pipe speed, far faster than the spool makes it
    // durable; with the defaults (1 MiB per command) most of it goes into
    // loss markers. With a raw backlog larger than the burst, the pipe
    // readers' hand-over grows with it and nothing is lost.
    let s = Stack::with_client_config(
        "[flow]\ncommand_high_watermark = \"32MiB\"\ncommand_low_watermark = \"16MiB\"\ndaemon_high_watermark = \"64MiB\"\ndaemon_low_watermark = \"32MiB\"\n",
    );
    let mut data = vec![0u8; 8 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in &mut data {
        // xorshift: incompressible, so the spool writes all 8 MiB
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    let file = s.work().join("burst.bin");
    std::fs::write(&file, &data).unwrap();
    let out = s.rvc(&["run", "web-1", &format!("cat {}", file.display())]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}\n{}", s.logs());
    assert!(!err.contains("lost"), "{err}");
    assert_eq!(out.stdout.len(), data.len(), "{err}");
    assert!(out.stdout == data, "the bytes differ");
}

#[test]
fn background_command_is_followed_later_and_listed() {
    let s = Stack::new();
    let out = s.rvc(&["run", "--background", "web-1", "echo later; exit 0"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let uuid = text(&out.stdout).trim().to_owned();
    assert_eq!(uuid, issue_of(&out), "stdout and stderr name the same UUID");
    let f = s.rvc(&["follow", &uuid]);
    assert_eq!(f.status.code(), Some(0), "{}", text(&f.stderr));
    assert_eq!(f.stdout, b"later\n");
    let list = text(&s.rvc(&["list", "web-1"]).stdout);
    assert!(list.contains(&uuid) && list.contains("succeeded"), "{list}");
    let stat = text(&s.rvc(&["stat", "web-1", &uuid]).stdout);
    assert!(stat.contains("state     succeeded (exit 0)"), "{stat}");
}

#[test]
fn each_signal_reaches_the_process_tree() {
    let s = Stack::new();
    for (name, number) in [
        ("HUP", 1),
        ("INT", 2),
        ("SIGTERM", 15),
        ("KILL", 9),
        ("usr1", 10),
        ("SIGUSR2", 12),
    ] {
        let out = s.rvc(&[
            "run",
            "--background",
            "web-1",
            "echo started; exec sleep 60",
        ]);
        let uuid = text(&out.stdout).trim().to_owned();
        // wait until it runs (its first output is stored)
        s.wait_until("the command runs", || {
            text(&s.rvc(&["stat", "web-1", &uuid]).stdout).contains("state     running")
        });
        let k = s.rvc(&["kill", name, "web-1", &uuid]);
        assert_eq!(k.status.code(), Some(0), "{name}: {}", text(&k.stderr));
        let f = s.rvc(&["follow", &uuid]);
        assert_eq!(
            f.status.code(),
            Some(128 + number),
            "{name}: {}\n{}",
            text(&f.stderr),
            s.logs()
        );
        assert_eq!(f.stdout, b"started\n", "{name}");
        let stat = text(&s.rvc(&["stat", "web-1", &uuid]).stdout);
        assert!(
            stat.contains(&format!("terminated (signal {number})")),
            "{name}: {stat}"
        );
    }
}

#[test]
fn the_default_signal_is_term_and_an_unknown_one_is_refused() {
    let s = Stack::new();
    let bad = s.rvc(&[
        "kill",
        "STOP",
        "web-1",
        "01a233bb-db10-7210-ae1b-edcc39797614",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("unknown signal"),
        "{}",
        text(&bad.stderr)
    );
    let out = s.rvc(&["run", "--background", "web-1", "exec sleep 60"]);
    let uuid = text(&out.stdout).trim().to_owned();
    s.wait_until("the command runs", || {
        text(&s.rvc(&["stat", "web-1", &uuid]).stdout).contains("state     running")
    });
    assert_eq!(s.rvc(&["kill", "web-1", &uuid]).status.code(), Some(0));
    assert_eq!(s.rvc(&["follow", &uuid]).status.code(), Some(128 + 15));
}

#[test]
fn the_same_request_id_twice_runs_once_and_answers_the_same() {
    let s = Stack::new();
    let id = "01a233bb-db10-7210-ae1b-edcc39797615";
    let marker = s.work().join("ran");
    let cmd = format!("echo x >> {}; echo done", marker.display());
    let a = s.rvc(&["run", "--request-id", id, "web-1", &cmd]);
    let b = s.rvc(&["run", "--request-id", id, "web-1", &cmd]);
    assert_eq!(a.status.code(), Some(0), "{}", text(&a.stderr));
    assert_eq!(b.status.code(), Some(0), "{}", text(&b.stderr));
    assert_eq!(issue_of(&a), id);
    assert_eq!(issue_of(&b), id);
    assert_eq!(a.stdout, b"done\n");
    assert_eq!(b.stdout, b"done\n");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "x\n", "ran once");
    // the same id with another request does nothing and says why
    let c = s.rvc(&["run", "--request-id", id, "web-1", "echo other"]);
    assert_eq!(c.status.code(), Some(13), "CONFLICT: {}", text(&c.stderr));
    assert!(text(&c.stderr).contains("CONFLICT"), "{}", text(&c.stderr));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "x\n");
}

#[test]
fn a_server_restart_mid_command_loses_nothing_and_rvc_says_reconnecting_once() {
    let mut s = Stack::new();
    let follow = s
        .rvc_cmd(&[
            "run",
            "web-1",
            "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done; exit 3",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    s.restart_server();
    let out = follow.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    assert_eq!(
        text(&out.stdout),
        "tick 1\ntick 2\ntick 3\ntick 4\ntick 5\ntick 6\n",
        "{}",
        s.logs()
    );
    let err = text(&out.stderr);
    assert_eq!(err.matches("reconnecting").count(), 1, "{err}");
    // the client was told the server restarts (1012), so it reconnected
    // at once instead of backing off
    let client_log = std::fs::read_to_string(s.dir.path().join("client.log")).unwrap();
    assert!(
        client_log.contains("connection ended code=Some(1012)"),
        "{}",
        s.logs()
    );
}

#[test]
fn a_client_restart_mid_command_ends_it_interrupted_with_its_output_complete() {
    let mut s = Stack::new();
    let out = s.rvc(&[
        "run",
        "--background",
        "web-1",
        "echo before; sleep 60; echo never",
    ]);
    let uuid = text(&out.stdout).trim().to_owned();
    s.wait_until("the command runs", || {
        text(&s.rvc(&["stat", "web-1", &uuid]).stdout).contains("state     running")
    });
    assert_eq!(s.stop_client(), Some(0), "{}", s.logs());
    s.start_client();
    let f = s.rvc(&["follow", &uuid]);
    assert_eq!(f.stdout, b"before\n", "{}", s.logs());
    // plan §7.4 (R-7.4-06): an orderly shutdown terminates the trees it
    // supervises and reports them interrupted
    assert_eq!(f.status.code(), Some(32), "{}", text(&f.stderr));
    let stat = text(&s.rvc(&["stat", "web-1", &uuid]).stdout);
    assert!(stat.contains("state     interrupted"), "{stat}");
}

/// The control socket is operator authority: a socket of this account,
/// mode 0600, in a runtime directory the server created private (0700).
#[test]
fn the_control_socket_is_owner_only() {
    use std::os::unix::fs::MetadataExt as _;
    let s = Stack::server_only();
    let meta = std::fs::metadata(s.socket()).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
    let dir = std::fs::metadata(s.socket().parent().unwrap()).unwrap();
    assert_eq!(dir.permissions().mode() & 0o7777, 0o700);
    assert_eq!(dir.uid(), rustix::process::geteuid().as_raw());
}

#[test]
fn health_readiness_and_metrics_answer_on_the_agent_listener() {
    let s = Stack::server_only();
    assert_eq!(support::http_get(s.port, "/healthz").unwrap().0, 200);
    assert_eq!(support::http_get(s.port, "/readyz").unwrap().0, 200);
    let (code, body) = support::http_get(s.port, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("rvbox_server_fd_limit"), "{body}");
    assert!(body.contains("rvbox_store_events_appended_total"), "{body}");
    assert_eq!(support::http_get(s.port, "/nope").unwrap().0, 404);
    // the same on observability.metrics_listen, which has no agent path
    assert_eq!(
        support::http_get(s.server_metrics, "/readyz").unwrap().0,
        200
    );
    let (code, body) = support::http_get(s.server_metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("rvbox_server_ready 1"), "{body}");
    assert_eq!(
        support::http_get(s.server_metrics, "/rvbox/agent")
            .unwrap()
            .0,
        404
    );
}

/// The value of the first sample of `name` (with any labels) in a
/// Prometheus text exposition.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The metrics of plan §11.1 move with the work: a command's dispatch
/// latency, the store's write passes and queue, the client's lanes, and
/// its reconnect duration after the server restarts.
#[test]
fn dispatch_store_and_transport_metrics_move_with_the_work() {
    let mut s = Stack::new();
    let out = s.rvc(&["run", "web-1", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (code, body) = support::http_get(s.server_metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    for name in [
        "rvbox_server_dispatch_seconds_count",
        "rvbox_server_store_pass_seconds_count",
    ] {
        assert!(
            sample(&body, name).is_some_and(|v| v >= 1.0),
            "{name}\n{body}"
        );
    }
    assert!(
        sample(&body, "rvbox_server_store_queued_ops").is_some(),
        "{body}"
    );
    let client = |s: &Stack| support::http_get(s.client_health, "/metrics").unwrap().1;
    let body = client(&s);
    assert!(
        body.contains("rvbox_client_transport_queued_frames{lane=\"control\"}"),
        "{body}"
    );
    assert!(
        sample(&body, "rvbox_client_runtime_wire_queued_frames").is_some(),
        "{body}"
    );
    let reconnects = |b: &str| sample(b, "rvbox_client_transport_reconnect_seconds_count");
    assert_eq!(reconnects(&body), Some(1.0), "{body}");
    s.restart_server();
    s.wait_connected();
    s.wait_until("the client counts its reconnect", || {
        reconnects(&client(&s)) == Some(2.0)
    });
}

#[test]
fn a_stale_control_socket_is_replaced_but_a_live_one_is_not() {
    let mut s = Stack::server_only();
    // a second server on the same control socket refuses to start
    let port2 = support::free_port();
    let cfg = std::fs::read_to_string(s.dir.path().join("server.toml"))
        .unwrap()
        .replace(&format!(":{}", s.port), &format!(":{port2}"))
        .replace(
            &format!(":{}", s.server_metrics),
            &format!(":{}", support::free_port()),
        )
        .replace("/data\"", "/data2\"");
    std::fs::write(s.dir.path().join("server2.toml"), cfg).unwrap();
    let second = std::process::Command::new(support::bin("rvbox-server"))
        .arg("--config")
        .arg(s.dir.path().join("server2.toml"))
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert!(
        text(&second.stderr).contains("another rvbox-server is serving"),
        "{}",
        text(&second.stderr)
    );
    // killed without cleanup, the socket file stays; the next start
    // replaces it
    let mut server = s.server.take().unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(s.socket().exists());
    s.start_server();
    assert_eq!(s.rvc(&["stat"]).status.code(), Some(0));
}

/// Sends one message on a fresh agent connection and returns the close
/// code and reason the server answered with.
fn close_after(port: u16, msg: tokio_tungstenite::tungstenite::Message) -> (u16, String) {
    use tokio_tungstenite::tungstenite::{self, Message};
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (mut ws, _) =
        tungstenite::client::client(format!("ws://127.0.0.1:{port}/rvbox/agent"), tcp).unwrap();
    // a write may fail once the server closed mid-message
    let _ = ws.send(msg);
    loop {
        match ws.read() {
            Ok(Message::Close(Some(f))) => return (u16::from(f.code), f.reason.to_string()),
            Ok(Message::Close(None)) => return (1005, String::new()),
            Ok(_) => {}
            Err(e) => panic!("no close frame: {e}"),
        }
    }
}

#[test]
fn malformed_oversized_and_wrong_type_messages_are_closed_with_their_reason_and_store_nothing() {
    use tokio_tungstenite::tungstenite::Message;
    let s = Stack::server_only();
    assert_eq!(
        close_after(s.port, Message::Text("hello".into())),
        (1002, "PROTOCOL_ERROR".into())
    );
    assert_eq!(
        close_after(s.port, Message::Binary(vec![0xff; 64].into())),
        (1002, "PROTOCOL_ERROR".into())
    );
    assert_eq!(
        close_after(s.port, Message::Binary(vec![0u8; 2 << 20].into())),
        (1009, "MESSAGE_TOO_BIG".into())
    );
    // nothing was registered or stored
    let stat = text(&s.rvc(&["stat"]).stdout);
    assert_eq!(stat.lines().count(), 1, "only the header: {stat}");
    let (_, metrics) = support::http_get(s.port, "/metrics").unwrap();
    assert!(
        metrics.contains("rvbox_server_agent_messages_refused_total{reason=\"text\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rvbox_server_agent_messages_refused_total{reason=\"too_big\"} 1"),
        "{metrics}"
    );
    // an upgrade from a foreign origin is refused before any WebSocket
    let tcp = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        format!("ws://127.0.0.1:{}/rvbox/agent", s.port),
    )
    .unwrap();
    req.headers_mut()
        .insert("Origin", "https://evil.example".parse().unwrap());
    let refused = tokio_tungstenite::tungstenite::client::client(req, tcp);
    assert!(
        matches!(refused, Err(tokio_tungstenite::tungstenite::HandshakeError::Failure(
            tokio_tungstenite::tungstenite::Error::Http(ref r)
        )) if r.status() == 403),
        "{refused:?}"
    );
}

#[test]
fn a_client_killed_mid_output_and_restarted_delivers_every_byte_or_says_what_is_missing() {
    let mut s = Stack::new();
    let marker = s.work().join("ran");
    let cmd = format!(
        "echo run >> {}; i=0; while [ $i -lt 3000 ]; do i=$((i+1)); echo line $i; sleep 0.002; done",
        marker.display()
    );
    let out = s.rvc(&["run", "--background", "web-1", &cmd]);
    let uuid = text(&out.stdout).trim().to_owned();
    s.wait_until("output is stored", || {
        let stat = text(&s.rvc(&["stat", "web-1", &uuid]).stdout);
        stat.contains("state     running") && !stat.contains("events    1 ")
    });
    s.kill_client();
    s.start_client();
    let f = s.rvc(&["follow", &uuid]);
    let err = text(&f.stderr);
    assert_eq!(
        f.status.code(),
        Some(32),
        "interrupted: {err}\n{}",
        s.logs()
    );
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "run\n",
        "the command ran exactly once"
    );
    // the lines that came are 1..=n in order, none twice; what is missing
    // after them is said
    let got = text(&f.stdout);
    let lines: Vec<&str> = got.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(*l, format!("line {}", i + 1), "{got}");
    }
    eprintln!(
        "{} of 3000 lines delivered before the kill; stderr: {err}",
        lines.len()
    );
    if lines.len() < 3000 {
        assert!(
            err.contains("incomplete") || err.contains("lost"),
            "{} of 3000 lines and no notice: {err}",
            lines.len()
        );
    }
}

#[test]
fn grpc_health_and_reflection_are_served_on_the_control_socket() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let s = Stack::server_only();
    let socket = s.socket();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let channel = support::control_channel(socket).await;
        let mut health = HealthClient::new(channel.clone());
        for service in ["", "rvbox.v1.Control"] {
            // NOT_SERVING while the store's startup recovery runs, then
            // SERVING
            let t = std::time::Instant::now();
            loop {
                let r = health
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .unwrap()
                    .into_inner();
                if r.status == ServingStatus::Serving as i32 {
                    break;
                }
                assert_eq!(r.status, ServingStatus::NotServing as i32, "{service:?}");
                assert!(
                    t.elapsed() < std::time::Duration::from_secs(20),
                    "{service:?} never served"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        let mut reflection = ServerReflectionClient::new(channel);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = reflection
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let resp = stream.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
            panic!("{resp:?}");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&"rvbox.v1.Control".to_owned()), "{names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health".to_owned()),
            "{names:?}"
        );
    });
}

#[test]
fn out_of_file_descriptors_the_listener_pauses_and_recovers() {
    let s = Stack::server_with_fd_limit(96);
    assert!(
        s.server_log()
            .contains("open file descriptor limit soft=96"),
        "{}",
        s.server_log()
    );
    // hold connections until accept runs out of descriptors
    let mut held = Vec::new();
    for _ in 0..200 {
        match std::net::TcpStream::connect(("127.0.0.1", s.port)) {
            Ok(c) => held.push(c),
            Err(_) => break,
        }
    }
    s.wait_until("accept reports the fd limit", || {
        s.server_log().contains("reason=\"fd_limit\"")
    });
    // the failure repeats with a growing pause (10 ms doubling to 1 s),
    // not a spin: over 1.5 s it is logged a handful of times
    std::thread::sleep(Duration::from_millis(1500));
    let refusals = s.server_log().matches("agent accept failed").count();
    assert!(refusals <= 12, "the listener spun: {refusals} refusals");
    drop(held);
    // descriptors are back: the server answers again and counted it
    s.wait_until("the server answers again", || {
        support::http_get(s.port, "/metrics").is_some_and(|(code, body)| {
            code == 200
                && body
                    .lines()
                    .any(|l| l.starts_with("rvbox_server_accept_errors_total{reason=\"fd_limit\"}"))
        })
    });
    assert_eq!(s.rvc(&["stat"]).status.code(), Some(0));
}

#[test]
fn client_health_follows_the_session_and_shows_no_output() {
    let mut s = Stack::new();
    let out = s.rvc(&["run", "web-1", "echo secret-output-text"]);
    assert_eq!(out.status.code(), Some(0));
    s.wait_until("the client reports the active session", || {
        support::http_get(s.client_health, "/readyz").is_some_and(|(c, _)| c == 200)
    });
    let (code, body) = support::http_get(s.client_health, "/healthz").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("\"state\":\"active\""), "{body}");
    assert!(body.contains("\"store\":\"ready\""), "{body}");
    assert!(body.contains("\"mode\":"), "{body}");
    assert!(!body.contains("secret-output-text"), "{body}");
    let (_, metrics) = support::http_get(s.client_health, "/metrics").unwrap();
    assert!(
        metrics.contains("rvbox_client_session_active 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("secret-output-text"));
    // the server goes away: the client says so, and is not ready
    assert_eq!(s.stop_server(), Some(0));
    s.wait_until("the client reports the lost session", || {
        support::http_get(s.client_health, "/readyz")
            .is_some_and(|(c, b)| c == 503 && b.contains("link"))
    });
    let (_, body) = support::http_get(s.client_health, "/healthz").unwrap();
    assert!(body.contains("\"sessions_lost\":1"), "{body}");
}

#[test]
fn a_follow_after_the_end_of_the_log_continues_from_the_end() {
    let s = Stack::new();
    let out = s.rvc(&["run", "--background", "web-1", "sleep 1.5; echo x"]);
    let uuid = text(&out.stdout).trim().to_owned();
    let f = s.rvc(&["follow", "--after", "999", &uuid]);
    assert_eq!(f.status.code(), Some(0), "{}", text(&f.stderr));
    assert_eq!(f.stdout, b"x\n", "events after the reset are shown");
    assert_eq!(
        text(&f.stderr).matches("has no events after 999").count(),
        1,
        "{}",
        text(&f.stderr)
    );
}

#[test]
fn kill_and_stat_refuse_a_command_of_another_client() {
    let s = Stack::new();
    let out = s.rvc(&["run", "--background", "web-1", "exec sleep 30"]);
    let uuid = text(&out.stdout).trim().to_owned();
    let k = s.rvc(&["kill", "web-2", &uuid]);
    assert_eq!(k.status.code(), Some(12), "{}", text(&k.stderr));
    assert!(text(&k.stderr).contains("belongs to client web-1, not web-2"));
    let st = s.rvc(&["stat", "web-2", &uuid]);
    assert_eq!(st.status.code(), Some(12));
    // the command was not signalled
    assert!(text(&s.rvc(&["stat", "web-1", &uuid]).stdout).contains("revision  1"));
    assert_eq!(
        s.rvc(&["kill", "KILL", "web-1", &uuid]).status.code(),
        Some(0)
    );
}

#[test]
fn a_command_runs_through_nginx_tls() {
    let mut s = Stack::server_only();
    let nginx = support::Nginx::start(s.dir.path(), s.port);
    s.client_url(
        &format!("wss://localhost:{}/rvbox/agent", nginx.port),
        &nginx.ca,
    );
    s.start_client();
    let out = s.rvc(&["run", "web-1", "printf 'through nginx\\n'; exit 9"]);
    assert_eq!(
        out.status.code(),
        Some(9),
        "{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    assert_eq!(out.stdout, b"through nginx\n");
    let log = std::fs::read_to_string(s.dir.path().join("client.log")).unwrap();
    assert!(
        log.contains(&format!(
            "connected url=wss://localhost:{}/rvbox/agent",
            nginx.port
        )),
        "{log}"
    );
}

/// A registered session (hello, welcome, reconciliation, capacity) sends
/// the message `msg` builds from its session id and generation; returns
/// the close code and reason the server answered with.
fn registered_then(
    port: u16,
    i: usize,
    msg: impl FnOnce(&str, u64) -> tokio_tungstenite::tungstenite::Message,
) -> (u16, String) {
    use futures_util::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (mut ws, sid, generation) = support::agent_client::register_session(i, port).await;
        let _ = ws.send(msg(&sid, generation)).await;
        loop {
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Close(Some(f))))) => {
                    return (u16::from(f.code), f.reason.to_string());
                }
                Ok(Some(Ok(_))) => {}
                other => panic!("no close frame: {other:?}"),
            }
        }
    })
}

#[test]
fn a_registered_session_that_misbehaves_is_closed_and_nothing_is_stored() {
    use rvbox_proto::v1 as wire;
    use tokio_tungstenite::tungstenite::Message;
    let s = Stack::server_only();
    assert_eq!(
        registered_then(s.port, 1, |_, _| Message::Binary(vec![0xff; 64].into())),
        (1002, "PROTOCOL_ERROR".into())
    );
    assert_eq!(
        registered_then(s.port, 2, |_, _| Message::Text("hello".into())),
        (1002, "PROTOCOL_ERROR".into())
    );
    assert_eq!(
        registered_then(s.port, 3, |_, _| Message::Binary(vec![0u8; 2 << 20].into())),
        (1009, "MESSAGE_TOO_BIG".into())
    );
    // output for a command this server never dispatched, in the live
    // session's envelope
    let (code, reason) = registered_then(s.port, 4, |sid, generation| {
        let payload = zstd::bulk::compress(b"not yours\n", 3).unwrap();
        let event = wire::CommandEvent {
            issue_uuid: "01a233bb-db10-7210-ae1b-edcc39797600".into(),
            event_seq: 1,
            observed_time: None,
            body: Some(wire::command_event::Body::Output(wire::OutputChunk {
                stream: wire::OutputStream::Stdout as i32,
                raw_length: 10,
                stored_length: u32::try_from(payload.len()).unwrap(),
                payload,
            })),
        };
        support::agent_client::env(
            sid,
            generation,
            wire::envelope::Payload::CommandEvent(event),
        )
    });
    assert_eq!((code, reason.as_str()), (1002, "PROTOCOL_ERROR"));
    let (_, metrics) = support::http_get(s.port, "/metrics").unwrap();
    // the sessions registered (so the frames reached live sessions) and
    // nothing was appended
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rvbox_store_sessions_registered_total") && !l.ends_with(" 0")),
        "{metrics}"
    );
    assert!(
        metrics.contains("rvbox_store_events_appended_total 0"),
        "{metrics}"
    );
    let list = text(&s.rvc(&["list"]).stdout);
    assert_eq!(list.lines().count(), 1, "no command: {list}");
}

/// An agent that says hello and answers every Ping but never sends its
/// snapshot is closed RECONCILE_TIMEOUT once `session.reconcile_timeout`
/// has passed since its welcome.
#[test]
fn an_agent_that_never_completes_reconciliation_is_closed() {
    use futures_util::{SinkExt as _, StreamExt as _};
    use rvbox_proto::v1::envelope::Payload;
    use tokio_tungstenite::tungstenite::Message;
    let mut s = Stack::configured();
    s.append_server_config("[session]\nheartbeat_idle = \"500ms\"\nliveness_timeout = \"1s\"\nreconcile_timeout = \"3s\"\n");
    s.start_server();
    let port = s.port;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (code, reason, waited) = rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (mut ws, _) =
            tokio_tungstenite::client_async(format!("ws://127.0.0.1:{port}/rvbox/agent"), tcp)
                .await
                .unwrap();
        ws.send(support::agent_client::env(
            "",
            0,
            Payload::ClientHello(support::agent_client::hello(7)),
        ))
        .await
        .unwrap();
        let Payload::ServerWelcome(_) = support::agent_client::next_payload(&mut ws).await else {
            panic!("no welcome")
        };
        let welcomed = std::time::Instant::now();
        loop {
            // reading answers the server's Pings (tungstenite queues the
            // Pong); the snapshot is never sent
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Close(Some(f))))) => {
                    return (u16::from(f.code), f.reason.to_string(), welcomed.elapsed());
                }
                Ok(Some(Ok(Message::Ping(_)))) => {
                    let _ = ws.flush().await;
                }
                Ok(Some(Ok(_))) => {}
                other => panic!("no close frame: {other:?}"),
            }
        }
    });
    assert_eq!((code, reason.as_str()), (4006, "RECONCILE_TIMEOUT"));
    assert!(
        waited >= Duration::from_millis(2_900),
        "closed after {waited:?}"
    );
    let (_, metrics) = support::http_get(s.port, "/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("RECONCILE_TIMEOUT") && !l.ends_with(" 0")),
        "{metrics}"
    );
}
