#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! A terminal through the whole engine on a real store: the operator's
//! open, input, resize and close go to the client only once durable; the
//! client's output is acknowledged only once recorded; a gap attaches
//! again from the recorded end; after a reconnect everything pending goes
//! again (and nothing the connection carried goes twice); an unknown
//! terminal is closed on the client.

use prost::Message as _;
use rvbox_engine::{Engine, Output};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_server_core::PtyAnswer;
use rvbox_store::entropy::OsEntropy;
use rvbox_store_port::pty::PtyMutation;

mod support;
use support::{WALL, engine};

fn hello() -> Vec<u8> {
    support::hello(INSTANCE)
}

const INSTANCE: &str = "6f1c2a4e-8b3d-4c5e-9f70-1a2b3c4d5e6f";

/// The payloads sent on `conn`, and the closes.
fn drain(e: &mut Engine, conn: u64) -> (Vec<Payload>, Vec<wire::CloseReason>) {
    let mut frames = Vec::new();
    let mut closes = Vec::new();
    while let Some(o) = e.poll_output() {
        match o {
            Output::Frame { conn: c, bytes, .. } if c == conn => {
                if let Some(p) = wire::Envelope::decode(bytes.as_slice()).unwrap().payload {
                    frames.push(p);
                }
            }
            Output::Close { conn: c, reason } if c == conn => closes.push(reason),
            _ => {}
        }
    }
    (frames, closes)
}

fn pty_frames(frames: &[Payload]) -> Vec<Payload> {
    frames
        .iter()
        .filter(|p| {
            matches!(
                p,
                Payload::PtyOpen(_)
                    | Payload::PtyAttach(_)
                    | Payload::PtyInput(_)
                    | Payload::PtyResize(_)
                    | Payload::PtyClose(_)
                    | Payload::PtyOutputAck(_)
                    | Payload::PtyDetach(_)
            )
        })
        .cloned()
        .collect()
}

fn env(session: &str, generation: u64, p: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: session.into(),
        generation,
        payload: Some(p),
    }
    .encode_to_vec()
}

/// Connects `web-1` on `conn` and reconciles; returns the session id, the
/// generation and the frames sent after the round was written.
fn connect(e: &mut Engine, now: u64, conn: u64) -> (String, u64, Vec<Payload>) {
    e.connect(now, conn);
    e.frame(now, WALL, conn, hello());
    let (frames, closes) = drain(e, conn);
    assert!(closes.is_empty(), "{closes:?}");
    let Some(Payload::ServerWelcome(w)) = frames.first() else {
        panic!("{frames:?}")
    };
    let (sid, generation) = (w.session_id.clone(), w.generation);
    let round = frames
        .iter()
        .find_map(|p| match p {
            Payload::ReconcileRequest(r) => Some(r.round),
            _ => None,
        })
        .expect("a reconciliation request");
    e.frame(
        now + 1,
        WALL,
        conn,
        env(
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
        ),
    );
    let (frames, closes) = drain(e, conn);
    assert!(closes.is_empty(), "{closes:?}");
    assert!(
        frames
            .iter()
            .any(|p| matches!(p, Payload::ReconcileResult(_)))
    );
    (sid, generation, pty_frames(&frames))
}

fn id() -> String {
    Engine::uuid_text(&rvbox_store::entropy::uuid_v7(&OsEntropy, WALL).unwrap())
}

fn write(e: &mut Engine, pty: &str, request: &str, data: &[u8]) -> u64 {
    match e
        .pty(
            10,
            WALL,
            PtyMutation::Write(wire::WritePtyInputRequest {
                request_id: request.into(),
                pty_session_id: pty.into(),
                data: data.to_vec(),
            }),
        )
        .unwrap()
    {
        PtyAnswer::Write(r) => r.input_seq,
        other => panic!("{other:?}"),
    }
}

fn output(pty: &str, offset: u64, data: &[u8]) -> Payload {
    Payload::PtyOutput(wire::PtyOutput {
        pty_session_id: pty.into(),
        offset,
        data: data.to_vec(),
        cut: None,
    })
}

#[test]
fn a_terminal_goes_to_its_client_only_when_durable_and_again_after_a_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let (sid, g, first) = connect(&mut e, 0, 1);
    assert!(first.is_empty(), "no terminal yet: {first:?}");

    // the open: durable, then PtyOpen and an attach from 0
    let pty = id();
    let open = wire::OpenPtySessionRequest {
        request_id: pty.clone(),
        client_id: "web-1".into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    };
    let a = e.pty(5, WALL, PtyMutation::Open(open.clone())).unwrap();
    assert!(matches!(a, PtyAnswer::Open(ref r) if r.pty_session_id == pty));
    let (frames, _) = drain(&mut e, 1);
    let frames = pty_frames(&frames);
    assert!(
        matches!(&frames[..], [Payload::PtyOpen(o), Payload::PtyAttach(at)]
            if o.pty_session_id == pty && o.rows == 24 && at.from_offset == 0),
        "{frames:?}"
    );
    // a repeated open (same request id) sends nothing again
    e.pty(6, WALL, PtyMutation::Open(open)).unwrap();
    assert!(pty_frames(&drain(&mut e, 1).0).is_empty());

    // the client opened it and streams output: acknowledged once recorded
    e.frame(
        7,
        WALL,
        1,
        env(
            &sid,
            g,
            Payload::PtyOpened(wire::PtyOpened {
                pty_session_id: pty.clone(),
                outcome: wire::AcceptOutcome::Positive as i32,
                error: None,
                resolved_shell: wire::ShellType::Sh as i32,
            }),
        ),
    );
    e.frame(8, WALL, 1, env(&sid, g, output(&pty, 0, b"hello")));
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyOutputAck(a)] if a.offset == 5),
        "{frames:?}"
    );

    // input: numbered, sent once; a repeat of the request is not sent again
    let r1 = id();
    assert_eq!(write(&mut e, &pty, &r1, b"ls\n"), 1);
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyInput(i)] if i.input_seq == 1 && i.data == b"ls\n"),
        "{frames:?}"
    );
    assert_eq!(write(&mut e, &pty, &r1, b"ls\n"), 1);
    assert!(pty_frames(&drain(&mut e, 1).0).is_empty());

    // a resize goes as its own frame
    e.pty(
        11,
        WALL,
        PtyMutation::Resize(wire::ResizePtySessionRequest {
            request_id: id(),
            pty_session_id: pty.clone(),
            rows: 40,
            cols: 100,
        }),
    )
    .unwrap();
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyResize(r)] if r.rows == 40 && r.cols == 100),
        "{frames:?}"
    );

    // output past a gap: nothing recorded, an attach from the recorded end,
    // once, however many pieces were in flight
    e.frame(12, WALL, 1, env(&sid, g, output(&pty, 9, b"xyz")));
    e.frame(13, WALL, 1, env(&sid, g, output(&pty, 12, b"uvw")));
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyAttach(a)] if a.from_offset == 5),
        "{frames:?}"
    );
    // the client resends from 5, overlapping what it had: exact
    e.frame(14, WALL, 1, env(&sid, g, output(&pty, 5, b" world")));
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyOutputAck(a)] if a.offset == 11),
        "{frames:?}"
    );

    // the connection drops; a key typed meanwhile waits
    e.disconnected(15, WALL, 1);
    let r2 = id();
    assert_eq!(write(&mut e, &pty, &r2, b"pwd\n"), 2);
    // the client comes back: the attach from the recorded end, the size,
    // and every input it has not acknowledged, in order
    let (sid, g, frames) = connect(&mut e, 20, 2);
    assert!(
        matches!(&frames[..], [
            Payload::PtyAttach(a),
            Payload::PtyResize(r),
            Payload::PtyInput(i1),
            Payload::PtyInput(i2),
        ] if a.from_offset == 11 && r.rows == 40 && i1.input_seq == 1 && i2.input_seq == 2),
        "{frames:?}"
    );
    // acknowledged input is not sent again at the next sync
    e.frame(
        21,
        WALL,
        2,
        env(
            &sid,
            g,
            Payload::PtyInputAck(wire::PtyInputAck {
                pty_session_id: pty.clone(),
                input_seq: 2,
            }),
        ),
    );
    let r3 = id();
    assert_eq!(write(&mut e, &pty, &r3, b"x"), 3);
    let frames = pty_frames(&drain(&mut e, 2).0);
    assert!(
        matches!(&frames[..], [Payload::PtyInput(i)] if i.input_seq == 3),
        "{frames:?}"
    );

    // a report of a terminal the server does not have closes it there
    let stray = id();
    e.frame(22, WALL, 2, env(&sid, g, output(&stray, 0, b"?")));
    let frames = pty_frames(&drain(&mut e, 2).0);
    assert!(
        matches!(&frames[..], [Payload::PtyClose(c)] if c.pty_session_id == stray),
        "{frames:?}"
    );

    // the close of a terminal the server does not have is not answered
    // (a close would loop with the client's answer)
    e.frame(
        22,
        WALL,
        2,
        env(
            &sid,
            g,
            Payload::PtyClosed(wire::PtyClosed {
                pty_session_id: stray.clone(),
                exit_result: None,
                final_offset: 0,
                reason: "unknown terminal on this client".into(),
            }),
        ),
    );
    let frames = pty_frames(&drain(&mut e, 2).0);
    assert!(frames.is_empty(), "{frames:?}");

    // the close: durable, then PtyClose; the client's PtyClosed ends it
    e.pty(
        23,
        WALL,
        PtyMutation::Close(wire::ClosePtySessionRequest {
            request_id: id(),
            pty_session_id: pty.clone(),
        }),
    )
    .unwrap();
    let frames = pty_frames(&drain(&mut e, 2).0);
    assert!(
        matches!(&frames[..], [Payload::PtyClose(c)] if c.pty_session_id == pty),
        "{frames:?}"
    );
    e.frame(
        24,
        WALL,
        2,
        env(
            &sid,
            g,
            Payload::PtyClosed(wire::PtyClosed {
                pty_session_id: pty.clone(),
                exit_result: None,
                final_offset: 11,
                reason: "closed by an operator".into(),
            }),
        ),
    );
    let (frames, closes) = drain(&mut e, 2);
    assert!(closes.is_empty(), "{closes:?}");
    assert!(pty_frames(&frames).is_empty(), "{frames:?}");
    assert!(
        e.store().pty_resume("web-1").unwrap().is_empty(),
        "closed: nothing to resume"
    );
    // a closed terminal takes no more input
    assert!(
        e.pty(
            25,
            WALL,
            PtyMutation::Write(wire::WritePtyInputRequest {
                request_id: id(),
                pty_session_id: pty.clone(),
                data: b"late".to_vec(),
            }),
        )
        .is_err()
    );
    assert!(e.stats().pty_gaps >= 1);
}

#[test]
fn output_that_breaks_the_protocol_closes_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    let (sid, g, _) = connect(&mut e, 0, 1);
    let pty = id();
    e.pty(
        1,
        WALL,
        PtyMutation::Open(wire::OpenPtySessionRequest {
            request_id: pty.clone(),
            client_id: "web-1".into(),
            rows: 24,
            cols: 80,
            ..Default::default()
        }),
    )
    .unwrap();
    drain(&mut e, 1);
    // an acknowledgement of input never given
    e.frame(
        2,
        WALL,
        1,
        env(
            &sid,
            g,
            Payload::PtyInputAck(wire::PtyInputAck {
                pty_session_id: pty,
                input_seq: 9,
            }),
        ),
    );
    let (_, closes) = drain(&mut e, 1);
    assert_eq!(closes, vec![wire::CloseReason::ProtocolError]);
    assert_eq!(e.stats().pty_refused, 1);
}

#[test]
fn a_terminal_idle_past_the_timeout_is_closed_and_zero_means_never() {
    for (timeout_ms, expect_close) in [(60_000_u64, true), (0, false)] {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path());
        e.set_pty_policy(rvbox_server_core::PtyPolicy {
            idle_timeout_ms: timeout_ms,
            ..Default::default()
        });
        let (_, _, _) = connect(&mut e, 0, 1);
        let pty = id();
        e.pty(
            1,
            WALL,
            PtyMutation::Open(wire::OpenPtySessionRequest {
                request_id: pty.clone(),
                client_id: "web-1".into(),
                rows: 24,
                cols: 80,
                ..Default::default()
            }),
        )
        .unwrap();
        drain(&mut e, 1);
        // the connection stays alive throughout
        let alive = |e: &mut Engine, from: u64, to: u64| {
            for t in (from..to).step_by(10_000) {
                e.pong(t, WALL + i64::try_from(t).unwrap(), 1);
            }
        };
        // busy a minute ago: not yet idle
        alive(&mut e, 2, 100_000);
        e.tick(100_000, WALL + 30_000);
        assert!(pty_frames(&drain(&mut e, 1).0).is_empty());
        // two passes later, idle for more than the timeout
        alive(&mut e, 100_001, 300_000);
        e.tick(300_000, WALL + 200_000);
        let (frames, closes) = drain(&mut e, 1);
        assert!(closes.is_empty(), "{closes:?}");
        let frames = pty_frames(&frames);
        if expect_close {
            assert!(
                matches!(&frames[..], [Payload::PtyClose(c)] if c.pty_session_id == pty),
                "{frames:?}"
            );
        } else {
            assert!(frames.is_empty(), "{frames:?}");
        }
    }
}

#[test]
fn a_terminal_open_takes_its_profiles_to_the_client_and_a_retry_with_others_conflicts() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path());
    connect(&mut e, 0, 1);
    let pty = id();
    let open = |flags: &[wire::ProfileFlag]| wire::OpenPtySessionRequest {
        request_id: pty.clone(),
        client_id: "web-1".into(),
        rows: 24,
        cols: 80,
        profile_flags: flags.iter().map(|f| *f as i32).collect(),
        ..Default::default()
    };
    let sorted = vec![
        wire::ProfileFlag::CpuLow as i32,
        wire::ProfileFlag::DiskHigh as i32,
    ];
    e.pty(
        1,
        WALL,
        PtyMutation::Open(open(&[
            wire::ProfileFlag::DiskHigh,
            wire::ProfileFlag::CpuLow,
        ])),
    )
    .unwrap();
    let frames = pty_frames(&drain(&mut e, 1).0);
    assert!(
        matches!(&frames[..], [Payload::PtyOpen(o), Payload::PtyAttach(_)]
            if o.pty_session_id == pty && o.profile_flags == sorted),
        "{frames:?}"
    );
    // the same id with other profiles: CONFLICT, nothing sent
    match e.pty(
        2,
        WALL,
        PtyMutation::Open(open(&[wire::ProfileFlag::CpuLow])),
    ) {
        Err(rvbox_store_port::ops::PortError::Refused(err)) => {
            assert_eq!(err.code(), rvbox_domain::error::Code::Conflict, "{err}");
        }
        other => panic!("{other:?}"),
    }
    // an unknown profile: INVALID_ARGUMENT naming the field
    match e.pty(
        3,
        WALL,
        PtyMutation::Open(wire::OpenPtySessionRequest {
            request_id: id(),
            profile_flags: vec![42],
            ..open(&[])
        }),
    ) {
        Err(rvbox_store_port::ops::PortError::Refused(err)) => {
            assert_eq!(
                err.code(),
                rvbox_domain::error::Code::InvalidArgument,
                "{err}"
            );
            assert_eq!(err.field(), "profile_flags");
        }
        other => panic!("{other:?}"),
    }
    assert!(pty_frames(&drain(&mut e, 1).0).is_empty());
    // not yet opened on the client: a reconnect sends the same open again
    e.disconnected(4, WALL, 1);
    let (_, _, frames) = connect(&mut e, 5, 2);
    assert!(
        matches!(&frames[..], [Payload::PtyOpen(o), ..] if o.profile_flags == sorted),
        "{frames:?}"
    );
}
