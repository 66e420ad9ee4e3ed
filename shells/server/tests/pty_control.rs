#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Terminals through the real `rvbox-server`: the control API over its
//! Unix socket, and an agent peer over a real WebSocket standing in for
//! the client daemon. The agent gets the open, the attach and the input
//! only once they are durable; viewers get exactly the bytes after their
//! offset, live, and the close; the recording is asciicast v2 and holds
//! every output byte, the input and the size. The same on the SQLite and
//! the PostgreSQL store.

#[path = "../benches/support/agent_client.rs"]
mod agent_client;

use agent_client::{Ws, env, next_payload, register_session};
use futures_util::SinkExt as _;
use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_testkit::Stack;
use std::time::Duration;
use tokio_stream::StreamExt as _;

const CLIENT: &str = "load-00001";

async fn control(socket: std::path::PathBuf) -> ControlClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::try_from("http://rvbox.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let s = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap();
    ControlClient::new(channel)
}

fn new_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// The next terminal payload the agent gets (others are skipped).
async fn next_pty(ws: &mut Ws) -> Payload {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let p = next_payload(ws).await;
            if matches!(
                p,
                Payload::PtyOpen(_)
                    | Payload::PtyAttach(_)
                    | Payload::PtyInput(_)
                    | Payload::PtyResize(_)
                    | Payload::PtyClose(_)
                    | Payload::PtyOutputAck(_)
                    | Payload::PtyDetach(_)
            ) {
                return p;
            }
        }
    })
    .await
    .expect("a terminal frame within 10 s")
}

type Viewer = tonic::Streaming<wire::AttachPtySessionResponse>;

/// Reads a viewer until it has `n` more output bytes; returns them.
async fn read_bytes(v: &mut Viewer, at: &mut u64, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while out.len() < n {
            let item = v.next().await.expect("stream open").expect("item");
            match item.item {
                Some(wire::attach_pty_session_response::Item::Output(o)) => {
                    assert_eq!(o.offset, *at, "exact: no byte twice, none skipped");
                    *at += o.data.len() as u64;
                    out.extend_from_slice(&o.data);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("output within 10 s");
    assert_eq!(out.len(), n, "no byte beyond what was produced");
    out
}

async fn attach(c: &mut ControlClient<tonic::transport::Channel>, pty: &str, from: u64) -> Viewer {
    c.attach_pty_session(wire::AttachPtySessionRequest {
        request_id: String::new(),
        pty_session_id: pty.into(),
        from_offset: from,
    })
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn viewers_get_exact_output_live_and_the_recording_holds_everything() {
    viewers_and_recording(Stack::server_only()).await;
}

/// The same on the PostgreSQL store (one replica on a private instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn viewers_get_exact_output_live_and_the_recording_holds_everything_on_postgres() {
    let pg = rvbox_testkit::Postgres::start();
    pg.psql("postgres", "CREATE DATABASE rvbox");
    let mut stack = Stack::configured();
    let conf = stack.dir.path().join("server.toml");
    let text = std::fs::read_to_string(&conf).unwrap().replacen(
        "[server]\n",
        "[server]\nstore = \"postgres\"\n",
        1,
    );
    std::fs::write(
        &conf,
        format!(
            "{text}[postgres]\nconninfo = \"{}\"\n",
            pg.conninfo("rvbox")
        ),
    )
    .unwrap();
    stack.start_server();
    viewers_and_recording(stack).await;
    assert_eq!(
        pg.psql("rvbox", "SELECT count(*) FROM pty_records WHERE kind = 1"),
        "2",
        "the output is recorded in the database"
    );
    drop(pg);
}

async fn viewers_and_recording(stack: Stack) {
    let (mut ws, sid, g) = register_session(1, stack.port).await;
    let mut c = control(stack.socket()).await;

    let pty = new_id();
    c.open_pty_session(wire::OpenPtySessionRequest {
        request_id: pty.clone(),
        client_id: CLIENT.into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    })
    .await
    .unwrap();
    match (next_pty(&mut ws).await, next_pty(&mut ws).await) {
        (Payload::PtyOpen(o), Payload::PtyAttach(a)) => {
            assert_eq!(o.pty_session_id, pty);
            assert_eq!(a.from_offset, 0);
        }
        other => panic!("{other:?}"),
    }
    let send = |p: Payload| env(&sid, g, p);
    ws.send(send(Payload::PtyOpened(wire::PtyOpened {
        pty_session_id: pty.clone(),
        outcome: wire::AcceptOutcome::Positive as i32,
        error: None,
        resolved_shell: wire::ShellType::Sh as i32,
    })))
    .await
    .unwrap();
    let out = |offset: u64, data: &[u8]| {
        Payload::PtyOutput(wire::PtyOutput {
            pty_session_id: pty.clone(),
            offset,
            data: data.to_vec(),
            cut: None,
        })
    };
    ws.send(send(out(0, b"$ "))).await.unwrap();
    let Payload::PtyOutputAck(a) = next_pty(&mut ws).await else {
        panic!()
    };
    assert_eq!(a.offset, 2);

    // a viewer from the start
    let mut v1 = attach(&mut c, &pty, 0).await;
    let mut at1 = 0;
    assert_eq!(read_bytes(&mut v1, &mut at1, 2).await, b"$ ");

    // typed keys reach the agent once durable, numbered
    let r = c
        .write_pty_input(wire::WritePtyInputRequest {
            request_id: new_id(),
            pty_session_id: pty.clone(),
            data: b"ls\r".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.input_seq, 1);
    let Payload::PtyInput(i) = next_pty(&mut ws).await else {
        panic!()
    };
    assert_eq!((i.input_seq, i.data.as_slice()), (1, b"ls\r".as_slice()));
    ws.send(send(Payload::PtyInputAck(wire::PtyInputAck {
        pty_session_id: pty.clone(),
        input_seq: 1,
    })))
    .await
    .unwrap();
    // the echo and the answer, live
    ws.send(send(out(2, b"ls\r\nfile\r\n$ "))).await.unwrap();
    assert!(matches!(next_pty(&mut ws).await, Payload::PtyOutputAck(a) if a.offset == 14));
    assert_eq!(read_bytes(&mut v1, &mut at1, 12).await, b"ls\r\nfile\r\n$ ");

    // a second viewer from the middle: exactly the bytes after its offset
    let mut v2 = attach(&mut c, &pty, 5).await;
    let mut at2 = 5;
    assert_eq!(read_bytes(&mut v2, &mut at2, 9).await, b"\nfile\r\n$ ");
    let list = c
        .list_pty_sessions(wire::ListPtySessionsRequest {
            client_id: Some(CLIENT.into()),
            page_size: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.sessions.len(), 1);
    assert_eq!(list.sessions[0].viewers, 2);
    assert_eq!(list.sessions[0].state, wire::PtyState::Open as i32);
    assert_eq!(list.sessions[0].output_offset, 14);

    // an offset past the output is refused by name
    let past = c
        .attach_pty_session(wire::AttachPtySessionRequest {
            request_id: String::new(),
            pty_session_id: pty.clone(),
            from_offset: 99,
        })
        .await
        .unwrap_err();
    assert_eq!(past.code(), tonic::Code::InvalidArgument);
    assert!(past.message().contains("from_offset 99"), "{past:?}");

    // the close reaches the agent; its PtyClosed ends every viewer
    c.close_pty_session(wire::ClosePtySessionRequest {
        request_id: new_id(),
        pty_session_id: pty.clone(),
    })
    .await
    .unwrap();
    assert!(matches!(next_pty(&mut ws).await, Payload::PtyClose(_)));
    ws.send(send(Payload::PtyClosed(wire::PtyClosed {
        pty_session_id: pty.clone(),
        exit_result: None,
        final_offset: 14,
        reason: "closed by an operator".into(),
    })))
    .await
    .unwrap();
    for v in [&mut v1, &mut v2] {
        let item = tokio::time::timeout(Duration::from_secs(10), v.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let Some(wire::attach_pty_session_response::Item::Closed(info)) = item.item else {
            panic!("{item:?}")
        };
        assert_eq!(info.state, wire::PtyState::Closed as i32);
        assert_eq!(info.close_reason, "closed by an operator");
        assert!(v.next().await.is_none(), "the stream ends after the close");
    }

    // the recording: asciicast v2 with the size at open, every output byte
    // in order, and the input
    let mut rec = c
        .read_pty_recording(wire::ReadPtyRecordingRequest {
            request_id: String::new(),
            pty_session_id: pty.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut doc = Vec::new();
    while let Some(piece) = rec.next().await {
        doc.extend_from_slice(&piece.unwrap().asciicast);
    }
    let text = String::from_utf8(doc).unwrap();
    let (header, events) = rvbox_terminal::asciicast::parse(&text).unwrap();
    assert_eq!((header.width, header.height), (80, 24));
    let output: String = events
        .iter()
        .filter(|e| e.code == rvbox_terminal::asciicast::Code::Output)
        .map(|e| e.data.as_str())
        .collect();
    assert_eq!(output, "$ ls\r\nfile\r\n$ ");
    assert!(
        events
            .iter()
            .any(|e| e.code == rvbox_terminal::asciicast::Code::Input && e.data == "ls\r"),
        "{text}"
    );
    // a closed terminal takes no input
    let late = c
        .write_pty_input(wire::WritePtyInputRequest {
            request_id: new_id(),
            pty_session_id: pty.clone(),
            data: b"x".to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(late.code(), tonic::Code::FailedPrecondition, "{late:?}");
    // the terminal events are counted, by event only
    let (_, metrics) = rvbox_testkit::http_get(stack.server_metrics, "/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rvbox_server_terminal_events_total{reason=\"mutation\"} ")),
        "{metrics}"
    );
    drop(stack);
}

/// An open's resource profiles reach the client's `PtyOpen`, sorted; a
/// retry with other profiles is `CONFLICT` (gRPC ALREADY_EXISTS) and an
/// unknown one `INVALID_ARGUMENT` naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_takes_its_profiles_to_the_client() {
    let stack = Stack::server_only();
    let (mut ws, _sid, _g) = register_session(1, stack.port).await;
    let mut c = control(stack.socket()).await;
    let pty = new_id();
    let open = |flags: &[wire::ProfileFlag]| wire::OpenPtySessionRequest {
        request_id: pty.clone(),
        client_id: CLIENT.into(),
        rows: 24,
        cols: 80,
        profile_flags: flags.iter().map(|f| *f as i32).collect(),
        ..Default::default()
    };
    c.open_pty_session(open(&[
        wire::ProfileFlag::MemMedium,
        wire::ProfileFlag::CpuHigh,
        wire::ProfileFlag::MemMedium,
    ]))
    .await
    .unwrap();
    let Payload::PtyOpen(o) = next_pty(&mut ws).await else {
        panic!("the open first")
    };
    assert_eq!(o.pty_session_id, pty);
    assert_eq!(
        o.profile_flags,
        vec![
            wire::ProfileFlag::CpuHigh as i32,
            wire::ProfileFlag::MemMedium as i32
        ]
    );
    // the same set in another order is the same request
    c.open_pty_session(open(&[
        wire::ProfileFlag::CpuHigh,
        wire::ProfileFlag::MemMedium,
    ]))
    .await
    .unwrap();
    let other = c
        .open_pty_session(open(&[wire::ProfileFlag::CpuHigh]))
        .await
        .unwrap_err();
    assert_eq!(other.code(), tonic::Code::AlreadyExists, "{other:?}");
    let bad = c
        .open_pty_session(wire::OpenPtySessionRequest {
            request_id: new_id(),
            profile_flags: vec![wire::ProfileFlag::Unspecified as i32],
            ..open(&[])
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("profile_flags"), "{bad:?}");
    drop(stack);
}
