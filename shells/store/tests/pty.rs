#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Terminals on real SQLite (docs/terminals.md): operator mutations
//! idempotent by `request_id` across a reopen, input numbered once and
//! pending until acknowledged, output recorded by offset (repeats and
//! overlaps stored once, gaps refused, lost bytes a cut record), closes,
//! the fence, the bounds, the recording cap and the idle pass.

mod support;

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::mutations::OpError;
use rvbox_store::operator::Caller;
use rvbox_store::reader::ControlReads as _;
use rvbox_store_port::pty::{
    PtyApplied, PtyLimits, PtyMutation, PtyOutcome, PtyRecordKind, PtyReport,
};
use rvbox_store_port::sessions::SessionFence;
use support::*;

const CLIENT: &str = "web-1";

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

fn caller() -> Caller {
    Caller {
        transport: "grpc-unix".into(),
        principal: "uid:0".into(),
    }
}

fn open_req(id: &[u8; 16]) -> wire::OpenPtySessionRequest {
    wire::OpenPtySessionRequest {
        request_id: text(id),
        client_id: CLIENT.into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    }
}

fn mutate(s: &mut Store, m: PtyMutation) -> Result<PtyOutcome, OpError> {
    s.pty_mutation_as(&m, &caller(), PtyLimits::default(), NOW)
}

fn write(s: &mut Store, id: &[u8; 16], rid: &[u8; 16], data: &[u8]) -> Result<PtyOutcome, OpError> {
    mutate(
        s,
        PtyMutation::Write(wire::WritePtyInputRequest {
            request_id: text(rid),
            pty_session_id: text(id),
            data: data.to_vec(),
        }),
    )
}

fn output(id: &[u8; 16], offset: u64, data: &[u8]) -> PtyReport {
    PtyReport::Output(wire::PtyOutput {
        pty_session_id: text(id),
        offset,
        data: data.to_vec(),
        cut: None,
    })
}

fn opened(id: &[u8; 16]) -> PtyReport {
    PtyReport::Opened(wire::PtyOpened {
        pty_session_id: text(id),
        outcome: wire::AcceptOutcome::Positive as i32,
        error: None,
        resolved_shell: wire::ShellType::Sh as i32,
    })
}

fn apply(s: &mut Store, fence: &SessionFence, reports: &[PtyReport]) -> Vec<PtyApplied> {
    s.pty_apply(CLIENT, Some(fence), reports, 64 << 20, NOW)
        .unwrap()
}

/// The recorded output from the start, with each cut as `[cut a..b]`.
fn recorded(s: &Store, id: &[u8; 16]) -> Vec<u8> {
    let mut r = s.reader().unwrap();
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let recs = r.pty_records(id, after, 1 << 20).unwrap();
        let Some(last) = recs.last() else { break };
        after = last.rec_seq;
        for rec in recs {
            match rec.kind {
                PtyRecordKind::Output { .. } => out.extend_from_slice(&rec.data),
                PtyRecordKind::Cut { from, to } => {
                    out.extend_from_slice(format!("[cut {from}..{to}]").as_bytes());
                }
                _ => {}
            }
        }
    }
    out
}

fn open_terminal(s: &mut Store) -> ([u8; 16], SessionFence) {
    let fence = live_session(s, CLIENT);
    let id = new_id();
    mutate(s, PtyMutation::Open(open_req(&id))).unwrap();
    let applied = apply(s, &fence, &[opened(&id)]);
    assert_eq!(
        applied,
        vec![PtyApplied::Recorded {
            output_offset: 0,
            closed: false
        }]
    );
    (id, fence)
}

#[test]
fn an_open_is_idempotent_bounded_and_needs_a_known_client() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    let e = mutate(&mut s, PtyMutation::Open(open_req(&id))).unwrap_err();
    assert_eq!(code(e), Code::NotFound);

    let _fence = live_session(&mut s, CLIENT);
    let first = mutate(&mut s, PtyMutation::Open(open_req(&id))).unwrap();
    assert!(!first.replayed);
    assert_eq!(first.view.info.state, wire::PtyState::Opening as i32);
    assert_eq!(first.view.open.pty_session_id, text(&id));
    let again = mutate(&mut s, PtyMutation::Open(open_req(&id))).unwrap();
    assert!(again.replayed);
    assert_eq!(again.view, first.view);
    // the same id for another request
    let other = wire::OpenPtySessionRequest {
        rows: 50,
        ..open_req(&id)
    };
    assert_eq!(
        code(mutate(&mut s, PtyMutation::Open(other)).unwrap_err()),
        Code::Conflict
    );

    let limits = PtyLimits {
        per_client: 2,
        ..PtyLimits::default()
    };
    let second = new_id();
    s.pty_mutation_as(
        &PtyMutation::Open(open_req(&second)),
        &caller(),
        limits,
        NOW,
    )
    .unwrap();
    let third = new_id();
    let e = s
        .pty_mutation_as(&PtyMutation::Open(open_req(&third)), &caller(), limits, NOW)
        .unwrap_err();
    assert_eq!(code(e), Code::CapacityExhausted);
    let server = PtyLimits {
        per_server: 2,
        ..PtyLimits::default()
    };
    let e = s
        .pty_mutation_as(&PtyMutation::Open(open_req(&third)), &caller(), server, NOW)
        .unwrap_err();
    assert_eq!(code(e), Code::CapacityExhausted);

    // durable: a reopened store answers the replay the same
    drop(s);
    let mut s = open(dir.path());
    let replay = mutate(&mut s, PtyMutation::Open(open_req(&id))).unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.view.info, first.view.info);
}

#[test]
fn input_is_numbered_once_and_pending_until_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let (id, fence) = open_terminal(&mut s);
    let (r1, r2, r3) = (new_id(), new_id(), new_id());
    assert_eq!(write(&mut s, &id, &r1, b"ls\r").unwrap().input_seq, Some(1));
    assert_eq!(
        write(&mut s, &id, &r2, b"pwd\r").unwrap().input_seq,
        Some(2)
    );
    // a resend of the first keeps its number and adds nothing
    let replay = write(&mut s, &id, &r1, b"ls\r").unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.input_seq, Some(1));
    assert_eq!(write(&mut s, &id, &r3, b"x").unwrap().input_seq, Some(3));

    let resume = s.pty_resume(CLIENT).unwrap();
    assert_eq!(resume.len(), 1);
    let seqs: Vec<u64> = resume[0].inputs.iter().map(|i| i.input_seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(resume[0].inputs[1].data, b"pwd\r");

    let ack = |n| {
        PtyReport::InputAck(wire::PtyInputAck {
            pty_session_id: text(&id),
            input_seq: n,
        })
    };
    apply(&mut s, &fence, &[ack(2)]);
    let resume = s.pty_resume(CLIENT).unwrap();
    let seqs: Vec<u64> = resume[0].inputs.iter().map(|i| i.input_seq).collect();
    assert_eq!(seqs, [3]);
    // an older acknowledgement changes nothing; one past what was sent is
    // a protocol error
    apply(&mut s, &fence, &[ack(1)]);
    assert_eq!(s.pty_resume(CLIENT).unwrap()[0].inputs.len(), 1);
    let refused = apply(&mut s, &fence, &[ack(9)]);
    assert!(
        matches!(&refused[0], PtyApplied::Refused(e) if e.code() == Code::ProtocolError),
        "{refused:?}"
    );
}

#[test]
fn output_is_recorded_once_by_offset_and_losses_are_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let (id, fence) = open_terminal(&mut s);
    let out = apply(
        &mut s,
        &fence,
        &[
            output(&id, 0, b"hello "),
            // an exact repeat, then an overlap
            output(&id, 0, b"hello "),
            output(&id, 3, b"lo world\n"),
        ],
    );
    assert_eq!(
        out.last(),
        Some(&PtyApplied::Recorded {
            output_offset: 12,
            closed: false
        })
    );
    assert_eq!(recorded(&s, &id), b"hello world\n");
    // a gap is refused with the end the server has
    let gap = apply(&mut s, &fence, &[output(&id, 20, b"late")]);
    assert_eq!(gap, vec![PtyApplied::Gap { output_offset: 12 }]);
    // the client's ring lost [12, 100): the cut is recorded, then output
    let cut = PtyReport::Output(wire::PtyOutput {
        pty_session_id: text(&id),
        offset: 100,
        data: b"tail".to_vec(),
        cut: Some(wire::PtyCut {
            requested_offset: 12,
            ring_start_offset: 100,
        }),
    });
    let out = apply(&mut s, &fence, &[cut]);
    assert_eq!(
        out,
        vec![PtyApplied::Recorded {
            output_offset: 104,
            closed: false
        }]
    );
    assert_eq!(recorded(&s, &id), b"hello world\n[cut 12..100]tail");
    // an output of a terminal this client does not have
    let other = new_id();
    assert_eq!(
        apply(&mut s, &fence, &[output(&other, 0, b"x")]),
        vec![PtyApplied::Unknown]
    );

    // closed with output the client never sent: a final cut
    let closed = PtyReport::Closed(wire::PtyClosed {
        pty_session_id: text(&id),
        exit_result: Some(wire::ExitResult {
            lifecycle: wire::Lifecycle::Succeeded as i32,
            exit_code: Some(0),
            ..Default::default()
        }),
        final_offset: 110,
        reason: String::new(),
    });
    assert_eq!(
        apply(&mut s, &fence, &[closed]),
        vec![PtyApplied::Recorded {
            output_offset: 110,
            closed: true
        }]
    );
    assert_eq!(
        recorded(&s, &id),
        b"hello world\n[cut 12..100]tail[cut 104..110]"
    );
    let info = s.reader().unwrap().pty_session(&id).unwrap();
    assert_eq!(info.state, wire::PtyState::Closed as i32);
    assert_eq!(info.close_reason, "the shell ended");
    assert_eq!(info.output_offset, 110);
    // nothing goes to a closed terminal, and it is not resumed
    let e = write(&mut s, &id, &new_id(), b"x").unwrap_err();
    assert_eq!(code(e), Code::FailedPrecondition);
    assert!(s.pty_resume(CLIENT).unwrap().is_empty());
}

#[test]
fn a_fenced_session_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let (id, old) = open_terminal(&mut s);
    let _new = live_session(&mut s, CLIENT);
    let e = s
        .pty_apply(CLIENT, Some(&old), &[output(&id, 0, b"x")], 1 << 20, NOW)
        .unwrap_err();
    assert_eq!(code(e), Code::StaleSession);
    assert_eq!(recorded(&s, &id), b"");
}

#[test]
fn the_recording_keeps_its_cap_and_says_what_it_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let (id, fence) = open_terminal(&mut s);
    for i in 0..10u64 {
        s.pty_apply(
            CLIENT,
            Some(&fence),
            &[output(&id, i * 100, &[b'a' + i as u8; 100])],
            350,
            NOW,
        )
        .unwrap();
    }
    let info = s.reader().unwrap().pty_session(&id).unwrap();
    assert!(info.recorded_bytes <= 350, "{}", info.recorded_bytes);
    assert_eq!(info.output_offset, 1000);
    let kept = s.reader().unwrap().pty_records(&id, 0, 1 << 20).unwrap();
    let first = kept.first().unwrap();
    assert!(
        matches!(first.kind, PtyRecordKind::Output { offset } if offset >= 650),
        "{first:?}"
    );
}

#[test]
fn resize_close_and_the_idle_pass() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let (id, _fence) = open_terminal(&mut s);
    mutate(
        &mut s,
        PtyMutation::Resize(wire::ResizePtySessionRequest {
            request_id: text(&new_id()),
            pty_session_id: text(&id),
            rows: 40,
            cols: 120,
        }),
    )
    .unwrap();
    let info = s.reader().unwrap().pty_session(&id).unwrap();
    assert_eq!((info.cols, info.rows), (120, 40));

    let idle = s.pty_idle(NOW + 1, 10).unwrap();
    assert_eq!(idle.len(), 1);
    assert!(idle[0].close_requested);
    assert_eq!(idle[0].info.close_reason, "idle timeout");
    assert!(s.pty_idle(NOW + 1, 10).unwrap().is_empty(), "asked once");
    // input after a close was asked is refused
    let e = write(&mut s, &id, &new_id(), b"x").unwrap_err();
    assert_eq!(code(e), Code::FailedPrecondition);
    let close = PtyMutation::Close(wire::ClosePtySessionRequest {
        request_id: text(&new_id()),
        pty_session_id: text(&id),
    });
    let done = mutate(&mut s, close).unwrap();
    assert!(done.view.close_requested);

    let page = s
        .reader()
        .unwrap()
        .list_pty_sessions(&wire::ListPtySessionsRequest {
            client_id: Some(CLIENT.into()),
            page_size: 10,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(page.sessions.len(), 1);
    assert_eq!(page.sessions[0].pty_session_id, text(&id));
}

#[test]
fn terminals_page_newest_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let _fence = live_session(&mut s, CLIENT);
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = new_id();
        s.pty_mutation_as(
            &PtyMutation::Open(open_req(&id)),
            &caller(),
            PtyLimits::default(),
            NOW + i,
        )
        .unwrap();
        ids.push(text(&id));
    }
    ids.reverse();
    let mut r = s.reader().unwrap();
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = r
            .list_pty_sessions(&wire::ListPtySessionsRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .unwrap();
        seen.extend(page.sessions.into_iter().map(|s| s.pty_session_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen, ids);
}
