//! Cases over interactive terminals (docs/terminals.md): operator
//! mutations idempotent by `request_id`, input numbered once and pending
//! until acknowledged, output recorded by offset (repeats and overlaps
//! stored once, gaps refused, lost bytes a cut record), closes, the
//! session fence, the bounds, the recording cap and quotas, the idle pass,
//! retention, and the reads that list terminals and stream a recording.
//!
//! Every case runs on a backend made with [`options`] (a small client
//! quota and a short terminal retention), through `StoreOp`s and the
//! control reads only.

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::StoreOptions;
use rvbox_store::mutations::OpError;
use rvbox_store_port::audit::Caller;
use rvbox_store_port::maintenance::MaintenanceReport;
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};
use rvbox_store_port::pty::{
    PtyApplied, PtyLimits, PtyMutation, PtyOutcome, PtyRecord, PtyRecordKind, PtyReport, PtyResume,
    PtyView,
};
use rvbox_store_port::sessions::SessionFence;

use crate::reads::WithReads;
use crate::support::*;

const CLIENT: &str = "web-1";
/// The client quota of [`options`].
pub const CLIENT_QUOTA: u64 = 64 * 1024;
/// The terminal retention of [`options`].
pub const RETENTION_MS: u64 = 60_000;
/// The recording cap the cases pass unless they say otherwise.
const CAP: u64 = 64 << 20;

/// The store options every terminal case's backend is made with.
#[must_use]
pub fn options() -> StoreOptions {
    let mut opts = StoreOptions {
        terminal_retention_ms: RETENTION_MS,
        ..StoreOptions::default()
    };
    opts.tiers.per_owner_total = CLIENT_QUOTA;
    opts
}

fn open_req(id: &[u8; 16], client: &str) -> wire::OpenPtySessionRequest {
    wire::OpenPtySessionRequest {
        request_id: text(id),
        client_id: client.into(),
        rows: 24,
        cols: 80,
        ..Default::default()
    }
}

fn mutate_with(b: &mut dyn WithReads, wall_ms: i64, m: PtyMutation, limits: PtyLimits) -> OpResult {
    b.perform(
        wall_ms,
        StoreOp::PtyMutation {
            mutation: m,
            caller: Caller::local(),
            limits,
        },
    )
}

fn mutate(b: &mut dyn WithReads, m: PtyMutation) -> OpResult {
    mutate_with(b, NOW, m, PtyLimits::default())
}

fn outcome(r: OpResult) -> PtyOutcome {
    match r {
        Ok(Completion::Pty(o)) => *o,
        other => panic!("PtyMutation: {other:?}"),
    }
}

fn write(b: &mut dyn WithReads, id: &[u8; 16], rid: &[u8; 16], data: &[u8]) -> OpResult {
    mutate(
        b,
        PtyMutation::Write(wire::WritePtyInputRequest {
            request_id: text(rid),
            pty_session_id: text(id),
            data: data.to_vec(),
        }),
    )
}

fn close(b: &mut dyn WithReads, id: &[u8; 16]) -> PtyOutcome {
    outcome(mutate(
        b,
        PtyMutation::Close(wire::ClosePtySessionRequest {
            request_id: text(&new_id()),
            pty_session_id: text(id),
        }),
    ))
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

fn ack(id: &[u8; 16], input_seq: u64) -> PtyReport {
    PtyReport::InputAck(wire::PtyInputAck {
        pty_session_id: text(id),
        input_seq,
    })
}

fn closed_report(id: &[u8; 16], final_offset: u64, reason: &str) -> PtyReport {
    PtyReport::Closed(wire::PtyClosed {
        pty_session_id: text(id),
        exit_result: Some(wire::ExitResult {
            lifecycle: wire::Lifecycle::Succeeded as i32,
            exit_code: Some(0),
            ..Default::default()
        }),
        final_offset,
        reason: reason.into(),
    })
}

fn apply_as(
    b: &mut dyn WithReads,
    client: &str,
    fence: SessionFence,
    reports: &[PtyReport],
    cap: u64,
) -> OpResult {
    b.perform(
        NOW,
        StoreOp::PtyApply {
            client_id: client.into(),
            session: fence,
            reports: reports.to_vec(),
            recording_bytes: cap,
        },
    )
}

fn applied(r: OpResult) -> Vec<PtyApplied> {
    match r {
        Ok(Completion::PtyApplied(a)) => a,
        other => panic!("PtyApply: {other:?}"),
    }
}

fn apply(b: &mut dyn WithReads, fence: SessionFence, reports: &[PtyReport]) -> Vec<PtyApplied> {
    applied(apply_as(b, CLIENT, fence, reports, CAP))
}

fn resume(b: &mut dyn WithReads, client: &str) -> Vec<PtyResume> {
    match op(
        b,
        StoreOp::PtyResume {
            client_id: client.into(),
        },
    ) {
        Ok(Completion::PtyResume(t)) => t,
        other => panic!("PtyResume: {other:?}"),
    }
}

fn idle(b: &mut dyn WithReads, idle_before_ms: i64) -> Vec<PtyView> {
    match op(
        b,
        StoreOp::PtyIdle {
            idle_before_ms,
            limit: 10,
        },
    ) {
        Ok(Completion::PtyIdle(v)) => v,
        other => panic!("PtyIdle: {other:?}"),
    }
}

fn maintain(b: &mut dyn WithReads, wall_ms: i64) -> MaintenanceReport {
    match b.perform(wall_ms, StoreOp::Maintain) {
        Ok(Completion::Maintained(r)) => r,
        other => panic!("Maintain: {other:?}"),
    }
}

fn info(b: &mut dyn WithReads, id: &[u8; 16]) -> wire::PtySessionInfo {
    b.reads().pty_session(id).unwrap()
}

/// Every record of the recording, read in pieces of at most `max_bytes`.
fn records(b: &mut dyn WithReads, id: &[u8; 16], max_bytes: usize) -> Vec<PtyRecord> {
    let mut out: Vec<PtyRecord> = Vec::new();
    let mut after = 0;
    loop {
        let recs = b.reads().pty_records(id, after, max_bytes).unwrap();
        let Some(last) = recs.last() else { break };
        after = last.rec_seq;
        out.extend(recs);
    }
    out
}

/// The recorded output from the start, with each cut as `[cut a..b]`.
fn recorded(b: &mut dyn WithReads, id: &[u8; 16]) -> Vec<u8> {
    let mut out = Vec::new();
    for rec in records(b, id, 1 << 20) {
        match rec.kind {
            PtyRecordKind::Output { .. } => out.extend_from_slice(&rec.data),
            PtyRecordKind::Cut { from, to } => {
                out.extend_from_slice(format!("[cut {from}..{to}]").as_bytes());
            }
            _ => {}
        }
    }
    out
}

fn read_refused<T: std::fmt::Debug>(r: &Result<T, OpError>) -> Option<Code> {
    match r {
        Err(OpError::Refused(e)) => Some(e.code()),
        _ => None,
    }
}

/// A terminal of `web-1` its client has opened, and the client's session.
fn open_terminal(b: &mut dyn WithReads) -> ([u8; 16], SessionFence) {
    let fence = live_session(b, CLIENT);
    let id = new_id();
    outcome(mutate(b, PtyMutation::Open(open_req(&id, CLIENT))));
    assert_eq!(
        apply(b, fence, &[opened(&id)]),
        vec![PtyApplied::Recorded {
            output_offset: 0,
            closed: false
        }]
    );
    (id, fence)
}

/// An open's resource profiles are a set: checked as a command's
/// (`INVALID_ARGUMENT` naming `profile_flags`), deduplicated and sorted in
/// the open frame the client is sent, and part of the request: the same
/// set in another order is a replay, another set `CONFLICT`.
pub fn a_terminal_open_carries_its_profiles_as_a_sorted_set(b: &mut dyn WithReads) {
    live_session(b, CLIENT);
    let id = new_id();
    let with = |flags: &[wire::ProfileFlag]| wire::OpenPtySessionRequest {
        profile_flags: flags.iter().map(|f| *f as i32).collect(),
        ..open_req(&id, CLIENT)
    };
    for bad in [
        with(&[wire::ProfileFlag::Unspecified]),
        with(&[wire::ProfileFlag::Light, wire::ProfileFlag::CpuLow]),
        with(&[wire::ProfileFlag::MemLow, wire::ProfileFlag::MemHigh]),
        wire::OpenPtySessionRequest {
            profile_flags: vec![99],
            ..open_req(&id, CLIENT)
        },
    ] {
        match mutate(b, PtyMutation::Open(bad)) {
            Err(rvbox_store_port::ops::PortError::Refused(e)) => {
                assert_eq!(e.code(), Code::InvalidArgument, "{e}");
                assert_eq!(e.field(), "profile_flags", "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(resume(b, CLIENT).is_empty(), "nothing refused was kept");

    let asked = with(&[
        wire::ProfileFlag::MemLow,
        wire::ProfileFlag::CpuHigh,
        wire::ProfileFlag::MemLow,
    ]);
    let first = outcome(mutate(b, PtyMutation::Open(asked)));
    assert!(!first.replayed);
    let sorted = vec![
        wire::ProfileFlag::CpuHigh as i32,
        wire::ProfileFlag::MemLow as i32,
    ];
    assert_eq!(first.view.open.profile_flags, sorted);
    // the same set in another order: the same request
    let again = outcome(mutate(
        b,
        PtyMutation::Open(with(&[
            wire::ProfileFlag::CpuHigh,
            wire::ProfileFlag::MemLow,
        ])),
    ));
    assert!(again.replayed);
    assert_eq!(again.view, first.view);
    // another set, or none, under the same id: CONFLICT
    for other in [with(&[wire::ProfileFlag::CpuHigh]), with(&[])] {
        let r = mutate(b, PtyMutation::Open(other));
        assert_eq!(refused(&r), Some(Code::Conflict), "{r:?}");
    }
    // what the client is sent, again after every reconnect
    let pending = resume(b, CLIENT);
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].view.open.profile_flags, sorted);
}

/// An open needs a known client, is answered the same for the same
/// request (and `CONFLICT` for another one with its id), keeps the bounds
/// per client and per server, and starts the recording with the size.
pub fn a_terminal_open_is_idempotent_bounded_and_needs_a_known_client(b: &mut dyn WithReads) {
    let id = new_id();
    let r = mutate(b, PtyMutation::Open(open_req(&id, CLIENT)));
    assert_eq!(refused(&r), Some(Code::NotFound), "{r:?}");
    let bad = wire::OpenPtySessionRequest {
        rows: 0,
        ..open_req(&id, CLIENT)
    };
    let r = mutate(b, PtyMutation::Open(bad));
    assert_eq!(refused(&r), Some(Code::InvalidArgument), "{r:?}");

    live_session(b, CLIENT);
    let first = outcome(mutate(b, PtyMutation::Open(open_req(&id, CLIENT))));
    assert!(!first.replayed);
    assert_eq!(first.input_seq, None);
    assert_eq!(first.view.info.state, wire::PtyState::Opening as i32);
    assert_eq!(first.view.info.client_id, CLIENT);
    assert_eq!((first.view.info.cols, first.view.info.rows), (80, 24));
    assert_eq!(first.view.open.pty_session_id, text(&id));
    assert_eq!((first.view.open.cols, first.view.open.rows), (80, 24));
    assert!(!first.view.close_requested);
    let again = outcome(b.perform(
        NOW + 1000,
        StoreOp::PtyMutation {
            mutation: PtyMutation::Open(open_req(&id, CLIENT)),
            caller: Caller::local(),
            limits: PtyLimits::default(),
        },
    ));
    assert!(again.replayed);
    assert_eq!(again.view, first.view, "a replay changes nothing");
    let other = wire::OpenPtySessionRequest {
        rows: 50,
        ..open_req(&id, CLIENT)
    };
    let r = mutate(b, PtyMutation::Open(other));
    assert_eq!(refused(&r), Some(Code::Conflict), "{r:?}");

    // the client is sent the open frame until the terminal closes
    let pending = resume(b, CLIENT);
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].view, first.view);
    assert!(pending[0].inputs.is_empty());
    // the recording starts with the size at open
    let recs = records(b, &id, 1 << 20);
    assert_eq!(recs.len(), 1, "{recs:?}");
    assert_eq!(recs[0].rec_seq, 1);
    assert_eq!(recs[0].kind, PtyRecordKind::Resize { cols: 80, rows: 24 });
    assert!(recs[0].data.is_empty());

    let per_client = PtyLimits {
        per_client: 2,
        ..PtyLimits::default()
    };
    let second = new_id();
    outcome(mutate_with(
        b,
        NOW,
        PtyMutation::Open(open_req(&second, CLIENT)),
        per_client,
    ));
    let third = new_id();
    let r = mutate_with(
        b,
        NOW,
        PtyMutation::Open(open_req(&third, CLIENT)),
        per_client,
    );
    assert_eq!(refused(&r), Some(Code::CapacityExhausted), "{r:?}");
    let per_server = PtyLimits {
        per_server: 2,
        ..PtyLimits::default()
    };
    live_session(b, "web-2");
    let r = mutate_with(
        b,
        NOW,
        PtyMutation::Open(open_req(&third, "web-2")),
        per_server,
    );
    assert_eq!(refused(&r), Some(Code::CapacityExhausted), "{r:?}");
    // a refusal stored nothing: the same request is taken once there is
    // room
    let taken = outcome(mutate_with(
        b,
        NOW,
        PtyMutation::Open(open_req(&third, "web-2")),
        PtyLimits::default(),
    ));
    assert!(!taken.replayed);
    assert_eq!(resume(b, CLIENT).len(), 2);
    assert_eq!(resume(b, "web-2").len(), 1);
}

/// Input is numbered in its mutation's transaction, once; it waits (and
/// is sent again after a reconnect) until its client acknowledges it, and
/// is bounded while it waits.
pub fn terminal_input_is_numbered_once_and_pending_until_acknowledged(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    let (r1, r2, r3) = (new_id(), new_id(), new_id());
    assert_eq!(outcome(write(b, &id, &r1, b"ls\r")).input_seq, Some(1));
    assert_eq!(outcome(write(b, &id, &r2, b"pwd\r")).input_seq, Some(2));
    // a resend keeps its number and adds nothing; the same id for other
    // input is refused
    let replay = outcome(write(b, &id, &r1, b"ls\r"));
    assert!(replay.replayed);
    assert_eq!(replay.input_seq, Some(1));
    assert_eq!(replay.view.input_seq, 2);
    let r = write(b, &id, &r1, b"rm -rf /\r");
    assert_eq!(refused(&r), Some(Code::Conflict), "{r:?}");
    let third = outcome(write(b, &id, &r3, b"x"));
    assert_eq!(third.input_seq, Some(3));
    assert_eq!((third.view.input_seq, third.view.input_acked), (3, 0));
    let r = write(b, &new_id(), &new_id(), b"x");
    assert_eq!(refused(&r), Some(Code::NotFound), "{r:?}");

    let pending = resume(b, CLIENT);
    assert_eq!(pending.len(), 1);
    let seqs: Vec<u64> = pending[0].inputs.iter().map(|i| i.input_seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(pending[0].inputs[1].data, b"pwd\r");
    assert_eq!(pending[0].inputs[1].pty_session_id, text(&id));
    // the recording keeps each input with its number
    let inputs: Vec<(u64, Vec<u8>)> = records(b, &id, 1 << 20)
        .into_iter()
        .filter_map(|r| match r.kind {
            PtyRecordKind::Input { input_seq } => Some((input_seq, r.data)),
            _ => None,
        })
        .collect();
    assert_eq!(
        inputs,
        vec![
            (1, b"ls\r".to_vec()),
            (2, b"pwd\r".to_vec()),
            (3, b"x".to_vec())
        ]
    );

    apply(b, fence, &[ack(&id, 2)]);
    let pending = resume(b, CLIENT);
    let seqs: Vec<u64> = pending[0].inputs.iter().map(|i| i.input_seq).collect();
    assert_eq!(seqs, [3]);
    assert_eq!(pending[0].view.input_acked, 2);
    // an older acknowledgement changes nothing; one past what was sent is
    // a protocol error
    apply(b, fence, &[ack(&id, 1)]);
    assert_eq!(resume(b, CLIENT)[0].inputs.len(), 1);
    let refusal = apply(b, fence, &[ack(&id, 9)]);
    assert!(
        matches!(&refusal[0], PtyApplied::Refused(e) if e.code() == Code::ProtocolError),
        "{refusal:?}"
    );
    apply(b, fence, &[ack(&id, 3)]);
    assert!(resume(b, CLIENT)[0].inputs.is_empty());

    // at most 256 KiB wait unacknowledged
    let chunk = vec![b'y'; 4096];
    for n in 0..64u64 {
        let o = outcome(write(b, &id, &new_id(), &chunk));
        assert_eq!(o.input_seq, Some(4 + n));
    }
    let r = write(b, &id, &new_id(), b"z");
    let Err(rvbox_store_port::ops::PortError::Refused(e)) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(e.code(), Code::CapacityExhausted);
    assert_eq!(e.field(), "data");
    apply(b, fence, &[ack(&id, 67)]);
    assert_eq!(outcome(write(b, &id, &new_id(), b"z")).input_seq, Some(68));
}

/// Output is recorded by offset: an exact repeat and an overlap are stored
/// once, a gap is refused with the end the server has, bytes the client
/// lost are a cut record, and a close past the recorded end ends with one.
pub fn terminal_output_is_recorded_once_by_offset_and_losses_are_cuts(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    let out = apply(
        b,
        fence,
        &[
            output(&id, 0, b"hello "),
            output(&id, 0, b"hello "),
            output(&id, 3, b"lo world\n"),
        ],
    );
    assert_eq!(
        out,
        vec![
            PtyApplied::Recorded {
                output_offset: 6,
                closed: false
            },
            PtyApplied::Recorded {
                output_offset: 6,
                closed: false
            },
            PtyApplied::Recorded {
                output_offset: 12,
                closed: false
            }
        ]
    );
    assert_eq!(recorded(b, &id), b"hello world\n");
    let outputs: Vec<u64> = records(b, &id, 1 << 20)
        .iter()
        .filter_map(|r| match r.kind {
            PtyRecordKind::Output { offset } => Some(offset),
            _ => None,
        })
        .collect();
    assert_eq!(outputs, [0, 6], "the overlap is stored from the end");
    assert_eq!(info(b, &id).output_offset, 12);
    assert_eq!(info(b, &id).recorded_bytes, 12);
    // a gap is refused with the end the server has, and nothing is stored
    let gap = apply(b, fence, &[output(&id, 20, b"late")]);
    assert_eq!(gap, vec![PtyApplied::Gap { output_offset: 12 }]);
    assert_eq!(recorded(b, &id), b"hello world\n");
    // the client's ring lost [12, 100): the cut is recorded, then output
    let cut = |offset: u64, ring: u64| {
        PtyReport::Output(wire::PtyOutput {
            pty_session_id: text(&id),
            offset,
            data: b"tail".to_vec(),
            cut: Some(wire::PtyCut {
                requested_offset: 12,
                ring_start_offset: ring,
            }),
        })
    };
    let refusal = apply(b, fence, &[cut(100, 90)]);
    assert!(
        matches!(&refusal[0], PtyApplied::Refused(e) if e.code() == Code::ProtocolError),
        "{refusal:?}"
    );
    let out = apply(b, fence, &[cut(100, 100)]);
    assert_eq!(
        out,
        vec![PtyApplied::Recorded {
            output_offset: 104,
            closed: false
        }]
    );
    assert_eq!(recorded(b, &id), b"hello world\n[cut 12..100]tail");
    // reports that break the protocol, and a terminal the client does not
    // have
    let empty = apply(b, fence, &[output(&id, 104, b"")]);
    assert!(
        matches!(&empty[0], PtyApplied::Refused(e) if e.code() == Code::ProtocolError),
        "{empty:?}"
    );
    let not_an_id = PtyReport::Output(wire::PtyOutput {
        pty_session_id: "nope".into(),
        offset: 0,
        data: b"x".to_vec(),
        cut: None,
    });
    let r = apply(b, fence, &[not_an_id]);
    assert!(
        matches!(&r[0], PtyApplied::Refused(e) if e.code() == Code::ProtocolError),
        "{r:?}"
    );
    assert_eq!(
        apply(b, fence, &[output(&new_id(), 0, b"x")]),
        vec![PtyApplied::Unknown]
    );
    let other = live_session(b, "web-2");
    assert_eq!(
        applied(apply_as(b, "web-2", other, &[output(&id, 104, b"x")], CAP)),
        vec![PtyApplied::Unknown],
        "another client's terminal"
    );

    // closed with output the client never sent: a final cut
    assert_eq!(
        apply(b, fence, &[closed_report(&id, 110, "")]),
        vec![PtyApplied::Recorded {
            output_offset: 110,
            closed: true
        }]
    );
    assert_eq!(
        recorded(b, &id),
        b"hello world\n[cut 12..100]tail[cut 104..110]"
    );
    let i = info(b, &id);
    assert_eq!(i.state, wire::PtyState::Closed as i32);
    assert_eq!(i.close_reason, "the shell ended");
    assert_eq!(i.output_offset, 110);
    assert_eq!(
        i.closed_time,
        Some(prost_types::Timestamp {
            seconds: NOW / 1000,
            nanos: 0
        })
    );
    assert_eq!(
        i.exit_result.map(|e| e.exit_code),
        Some(Some(0)),
        "the exit is kept"
    );
    // a closed terminal takes nothing more: reports are answered closed
    assert_eq!(
        apply(b, fence, &[output(&id, 110, b"more"), ack(&id, 0)]),
        vec![
            PtyApplied::Recorded {
                output_offset: 110,
                closed: true
            };
            2
        ]
    );
    let r = write(b, &id, &new_id(), b"x");
    assert_eq!(refused(&r), Some(Code::FailedPrecondition), "{r:?}");
    let r = mutate(
        b,
        PtyMutation::Resize(wire::ResizePtySessionRequest {
            request_id: text(&new_id()),
            pty_session_id: text(&id),
            rows: 10,
            cols: 10,
        }),
    );
    assert_eq!(refused(&r), Some(Code::FailedPrecondition), "{r:?}");
    // closing it again is answered as done, and changes nothing
    let again = close(b, &id);
    assert!(!again.replayed);
    assert!(again.view.closed());
    assert_eq!(again.view.info.close_reason, "the shell ended");
    assert!(
        resume(b, CLIENT).is_empty(),
        "a closed terminal is not resumed"
    );
}

/// Reports that arrive on a session that is no longer the client's live
/// one apply nothing.
pub fn a_fenced_session_applies_no_terminal_report(b: &mut dyn WithReads) {
    let (id, old) = open_terminal(b);
    let _new = live_session(b, CLIENT);
    let r = apply_as(b, CLIENT, old, &[output(&id, 0, b"x")], CAP);
    assert_eq!(refused(&r), Some(Code::StaleSession), "{r:?}");
    assert_eq!(recorded(b, &id), b"");
    assert_eq!(info(b, &id).output_offset, 0);
}

/// The recording keeps its cap: the oldest records go, the offset still
/// counts every byte, and reads go on from any record in pieces.
pub fn a_terminal_recording_keeps_its_cap_and_says_what_it_dropped(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    for i in 0..10u8 {
        let r = apply_as(
            b,
            CLIENT,
            fence,
            &[output(&id, u64::from(i) * 100, &[b'a' + i; 100])],
            350,
        );
        assert_eq!(applied(r).len(), 1);
    }
    let i = info(b, &id);
    assert!(i.recorded_bytes <= 350, "{}", i.recorded_bytes);
    assert_eq!(i.output_offset, 1000);
    let kept = records(b, &id, 1 << 20);
    let first = kept.first().unwrap();
    assert!(
        matches!(first.kind, PtyRecordKind::Output { offset } if offset >= 650),
        "{first:?}"
    );
    // what is kept is whole and in order, up to the end
    let bytes: u64 = kept.iter().map(|r| r.data.len() as u64).sum();
    assert_eq!(bytes, i.recorded_bytes);
    let last = kept.last().unwrap();
    assert_eq!(last.kind, PtyRecordKind::Output { offset: 900 });
    assert_eq!(last.data, vec![b'j'; 100]);
    // reads bounded by bytes return at least one record each, in order
    let pieces = records(b, &id, 1);
    assert_eq!(pieces, kept);
    let r = b.reads().pty_records(&new_id(), 0, 1 << 20);
    assert_eq!(read_refused(&r), Some(Code::NotFound), "{r:?}");
}

/// A recording shares the client's quota with command output and the
/// client's other recordings: it keeps only what they leave, the oldest
/// records dropped, while the offset counts every byte.
pub fn a_recording_gets_only_what_the_client_quota_leaves(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    // 200 KiB of output against a 64 KiB quota with a 64 MiB cap
    for i in 0..50u64 {
        applied(apply_as(
            b,
            CLIENT,
            fence,
            &[output(&id, i * 4096, &[b'x'; 4096])],
            CAP,
        ));
    }
    let first = info(b, &id);
    assert_eq!(
        first.output_offset,
        50 * 4096,
        "the offset counts every byte"
    );
    assert!(
        first.recorded_bytes <= CLIENT_QUOTA,
        "kept {} bytes over a 64 KiB quota",
        first.recorded_bytes
    );
    assert!(first.recorded_bytes > 0);
    let kept = records(b, &id, 1 << 20);
    let first_output = kept
        .iter()
        .find_map(|r| match r.kind {
            PtyRecordKind::Output { offset } => Some(offset),
            _ => None,
        })
        .unwrap();
    assert!(first_output > 0, "the oldest output went");

    // a second terminal of the client finds the quota taken
    let second = new_id();
    outcome(mutate(b, PtyMutation::Open(open_req(&second, CLIENT))));
    applied(apply_as(b, CLIENT, fence, &[opened(&second)], CAP));
    for i in 0..4u64 {
        applied(apply_as(
            b,
            CLIENT,
            fence,
            &[output(&second, i * 4096, &[b'y'; 4096])],
            CAP,
        ));
    }
    let s = info(b, &second);
    assert_eq!(s.output_offset, 4 * 4096);
    let both = s.recorded_bytes + info(b, &id).recorded_bytes;
    assert!(
        both <= CLIENT_QUOTA,
        "kept {both} bytes over a 64 KiB quota"
    );
}

/// A resize is recorded, the idle pass asks idle terminals to close once
/// (and input is refused then), an operator's close keeps the first
/// reason, a client that refuses an open closes it, and the listing
/// shows each terminal of a client.
pub fn terminals_resize_close_and_the_idle_pass(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    let resized = outcome(mutate(
        b,
        PtyMutation::Resize(wire::ResizePtySessionRequest {
            request_id: text(&new_id()),
            pty_session_id: text(&id),
            rows: 40,
            cols: 120,
        }),
    ));
    assert_eq!((resized.view.info.cols, resized.view.info.rows), (120, 40));
    let i = info(b, &id);
    assert_eq!((i.cols, i.rows), (120, 40));
    assert_eq!(
        records(b, &id, 1 << 20).last().map(|r| r.kind),
        Some(PtyRecordKind::Resize {
            cols: 120,
            rows: 40
        })
    );
    assert_eq!(i.state, wire::PtyState::Open as i32);

    // a busy terminal is not idle
    assert!(idle(b, NOW).is_empty());
    let idled = idle(b, NOW + 1);
    assert_eq!(idled.len(), 1);
    assert_eq!(idled[0].info.pty_session_id, text(&id));
    assert!(idled[0].close_requested);
    assert_eq!(idled[0].info.close_reason, "idle timeout");
    assert!(idle(b, NOW + 1).is_empty(), "asked once");
    let pending = resume(b, CLIENT);
    assert!(pending[0].view.close_requested, "the client is told");
    let r = write(b, &id, &new_id(), b"x");
    assert_eq!(refused(&r), Some(Code::FailedPrecondition), "{r:?}");
    // an operator's close now keeps the first reason
    let done = close(b, &id);
    assert!(done.view.close_requested);
    assert_eq!(done.view.info.close_reason, "idle timeout");
    // the client's close without a reason keeps the one asked for
    // the client, knowing only that a close came, says an operator closed
    // it: the server's reason for asking stays
    apply(b, fence, &[closed_report(&id, 0, "closed by an operator")]);
    assert_eq!(info(b, &id).close_reason, "idle timeout");

    // an operator's close of an open terminal
    let other = new_id();
    outcome(mutate(b, PtyMutation::Open(open_req(&other, CLIENT))));
    let c = close(b, &other);
    assert!(c.view.close_requested);
    assert_eq!(c.view.info.close_reason, "closed by an operator");
    assert_eq!(c.view.info.state, wire::PtyState::Opening as i32);
    apply(b, fence, &[closed_report(&other, 0, "shell exited")]);
    assert_eq!(info(b, &other).close_reason, "shell exited");

    // a client that refuses an open closes the terminal
    let refused_id = new_id();
    outcome(mutate(b, PtyMutation::Open(open_req(&refused_id, CLIENT))));
    let no = PtyReport::Opened(wire::PtyOpened {
        pty_session_id: text(&refused_id),
        outcome: wire::AcceptOutcome::Permanent as i32,
        error: Some(wire::ErrorDetail {
            reason: "no such shell".into(),
            ..Default::default()
        }),
        resolved_shell: 0,
    });
    assert_eq!(
        apply(b, fence, &[no]),
        vec![PtyApplied::Recorded {
            output_offset: 0,
            closed: true
        }]
    );
    let i = info(b, &refused_id);
    assert_eq!(i.state, wire::PtyState::Closed as i32);
    assert!(
        i.close_reason.contains("no such shell"),
        "{}",
        i.close_reason
    );
    assert!(resume(b, CLIENT).is_empty());

    // a refusal's words come from the client: stored bounded
    let long_id = new_id();
    outcome(mutate(b, PtyMutation::Open(open_req(&long_id, CLIENT))));
    let long = PtyReport::Opened(wire::PtyOpened {
        pty_session_id: text(&long_id),
        outcome: wire::AcceptOutcome::Permanent as i32,
        error: Some(wire::ErrorDetail {
            reason: "é".repeat(200_000),
            ..Default::default()
        }),
        resolved_shell: 0,
    });
    apply(b, fence, &[long]);
    let i = info(b, &long_id);
    assert_eq!(i.state, wire::PtyState::Closed as i32);
    assert!(
        i.close_reason.len() <= rvbox_store_port::pty::MAX_PTY_REASON_BYTES
            && i.close_reason
                .starts_with("the client refused to open the terminal: é"),
        "{} bytes",
        i.close_reason.len()
    );

    let page = b
        .reads()
        .list_pty_sessions(&wire::ListPtySessionsRequest {
            client_id: Some(CLIENT.into()),
            page_size: 10,
            ..Default::default()
        })
        .unwrap();
    let mut listed: Vec<String> = page
        .sessions
        .into_iter()
        .map(|s| s.pty_session_id)
        .collect();
    listed.sort();
    let mut want = vec![text(&id), text(&other), text(&refused_id), text(&long_id)];
    want.sort();
    assert_eq!(listed, want);
    assert!(page.next_page_token.is_empty());
}

/// Terminals are listed newest first, page by page, every one once; a
/// client's listing holds only its own, a page token is bound to its
/// listing, and a terminal the server does not have is `NOT_FOUND`.
pub fn terminals_are_listed_newest_first_page_by_page(b: &mut dyn WithReads) {
    live_session(b, CLIENT);
    live_session(b, "web-2");
    let mut ids = Vec::new();
    let mut mine = Vec::new();
    for i in 0..5 {
        let id = new_id();
        let client = if i == 2 { "web-2" } else { CLIENT };
        outcome(mutate_with(
            b,
            NOW + i,
            PtyMutation::Open(open_req(&id, client)),
            PtyLimits::default(),
        ));
        ids.push(text(&id));
        if client == CLIENT {
            mine.push(text(&id));
        }
    }
    ids.reverse();
    mine.reverse();
    let list = |b: &mut dyn WithReads, client: Option<&str>| {
        let mut seen = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let page = b
                .reads()
                .list_pty_sessions(&wire::ListPtySessionsRequest {
                    client_id: client.map(str::to_owned),
                    page_size: 2,
                    page_token: token.clone(),
                    ..Default::default()
                })
                .unwrap();
            pages += 1;
            assert!(pages < 10, "pages never end");
            assert!(page.sessions.len() <= 2);
            seen.extend(page.sessions.into_iter().map(|s| s.pty_session_id));
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        seen
    };
    assert_eq!(list(b, None), ids);
    assert_eq!(list(b, Some(CLIENT)), mine);
    let first = b
        .reads()
        .list_pty_sessions(&wire::ListPtySessionsRequest {
            client_id: None,
            page_size: 2,
            page_token: String::new(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        first.sessions[0].opened_time.as_ref().map(|t| t.seconds),
        Some(NOW / 1000)
    );
    let stolen = b.reads().list_pty_sessions(&wire::ListPtySessionsRequest {
        client_id: Some(CLIENT.into()),
        page_size: 2,
        page_token: first.next_page_token,
        ..Default::default()
    });
    assert_eq!(
        read_refused(&stolen),
        Some(Code::InvalidArgument),
        "{stolen:?}"
    );
    let r = b.reads().list_pty_sessions(&wire::ListPtySessionsRequest {
        client_id: Some("not a client id!".into()),
        page_size: 2,
        page_token: String::new(),
        ..Default::default()
    });
    assert_eq!(read_refused(&r), Some(Code::InvalidArgument), "{r:?}");
    let r = b.reads().pty_session(&new_id());
    assert_eq!(read_refused(&r), Some(Code::NotFound), "{r:?}");
}

/// A closed terminal goes with its recording after the terminal
/// retention; an open one stays.
pub fn a_closed_terminal_goes_with_its_recording_after_the_retention(b: &mut dyn WithReads) {
    let (open_id, _) = open_terminal(b);
    let (closed_id, fence) = open_terminal(b);
    let out = apply(
        b,
        fence,
        &[
            output(&closed_id, 0, b"bye"),
            closed_report(&closed_id, 3, "shell exited"),
        ],
    );
    assert_eq!(
        out.last(),
        Some(&PtyApplied::Recorded {
            output_offset: 3,
            closed: true
        })
    );
    // within the retention: kept
    let retention = i64::try_from(RETENTION_MS).unwrap();
    let r = maintain(b, NOW + retention / 2);
    assert_eq!(r.terminals_pruned, 0, "{r:?}");
    assert_eq!(info(b, &closed_id).close_reason, "shell exited");
    assert_eq!(recorded(b, &closed_id), b"bye");
    // past it: gone, records and all; the open one stays
    let r = maintain(b, NOW + 2 * retention);
    assert_eq!(r.terminals_pruned, 1, "{r:?}");
    let gone = b.reads().pty_session(&closed_id);
    assert_eq!(read_refused(&gone), Some(Code::NotFound), "{gone:?}");
    let gone = b.reads().pty_records(&closed_id, 0, 1 << 20);
    assert_eq!(read_refused(&gone), Some(Code::NotFound), "{gone:?}");
    assert_eq!(info(b, &open_id).state, wire::PtyState::Open as i32);
    let r = maintain(b, NOW + 3 * retention);
    assert_eq!(r.terminals_pruned, 0, "{r:?}");
    // its request ids are gone with it: a mutation of it is NOT_FOUND
    let r = write(b, &closed_id, &new_id(), b"x");
    assert_eq!(refused(&r), Some(Code::NotFound), "{r:?}");
}

/// A client with a terminal is never forgotten as idle: its open terminal
/// (whose client lost its session) and a closed one's recording stay
/// until the terminal retention removes the terminal; then the client
/// goes.
pub fn a_client_with_a_terminal_is_not_pruned_as_idle(b: &mut dyn WithReads) {
    let (id, fence) = open_terminal(b);
    let r = op(
        b,
        StoreOp::CloseSession {
            session_id: fence.session_id,
            reason: "connection lost".into(),
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    // far past the retention (the idle-client horizon): the open terminal
    // keeps its client
    let retention = i64::try_from(RETENTION_MS).unwrap();
    let r = maintain(b, NOW + 10 * retention);
    assert_eq!(r.clients_pruned, 0, "{r:?}");
    assert!(
        client(b, CLIENT).is_some(),
        "the client of an open terminal"
    );
    assert_eq!(info(b, &id).state, wire::PtyState::Open as i32);
    // the client comes back, ends it, and goes again: the closed
    // terminal's recording is kept for the retention, and its client
    // with it; the pass that removes the terminal still finds the client
    // holding it, the next one forgets the client
    let fence = live_session(b, CLIENT);
    apply(b, fence, &[closed_report(&id, 0, "shell exited")]);
    assert_eq!(info(b, &id).state, wire::PtyState::Closed as i32);
    let r = op(
        b,
        StoreOp::CloseSession {
            session_id: fence.session_id,
            reason: "connection lost".into(),
        },
    );
    assert_eq!(r, Ok(Completion::Done));
    let at = NOW + 12 * retention;
    let r = maintain(b, at);
    assert_eq!((r.terminals_pruned, r.clients_pruned), (1, 0), "{r:?}");
    assert!(
        client(b, CLIENT).is_some(),
        "pruned with its recording kept"
    );
    let r = maintain(b, at + 1);
    assert_eq!(r.clients_pruned, 1, "{r:?}");
    assert!(
        client(b, CLIENT).is_none(),
        "an idle client without terminals"
    );
}
