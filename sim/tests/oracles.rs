#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The oracles break when the promise breaks, and stay quiet for every
//! honest shape. Output: what a process wrote against what the server
//! serves, with output lost silently, duplicated, reordered, invented, or
//! covered by a record whose count is wrong (pages split anywhere, exact
//! records and a tail lost with its daemon are honest). Exit, stdin and
//! signals: what the process did against the events and the row the
//! server stores. The planted-bug table of docs/simulator.md shows each
//! of them firing on a seed batch too.

use rvbox_client_core::process::Exit;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_sim::oracles::{
    AckedWrite, OracleCounts, Served, check_exit, check_output, check_signals, check_stdin,
};
use rvbox_sim::supervisor::{Ended, ProcessRecord};

const SPOOL: i32 = wire::TruncationSource::ClientSpool as i32;

fn data(stream: usize, bytes: &[u8]) -> Served {
    Served::Data {
        stream,
        bytes: bytes.to_vec(),
    }
}

fn gap(mask: u8, raw: u64) -> Served {
    Served::Gap {
        mask,
        raw: Some(raw),
        source: SPOOL,
    }
}

/// Unique bytes (no run repeats), as the simulated processes write.
fn wrote() -> [Vec<u8>; 2] {
    let out: Vec<u8> = (0..40u32)
        .flat_map(|i| format!("out line {i}\n").into_bytes())
        .collect();
    let err: Vec<u8> = (0..10u32)
        .flat_map(|i| format!("err line {i}\n").into_bytes())
        .collect();
    [out, err]
}

#[test]
fn everything_served_in_any_split_is_clean() {
    let w = wrote();
    let (a, b) = w[0].split_at(37);
    let served = vec![
        data(0, a),
        data(1, &w[1][..5]),
        data(0, b),
        data(1, &w[1][5..]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(0));
}

#[test]
fn a_run_missing_without_a_record_is_caught() {
    let w = wrote();
    let served = vec![data(0, &w[0][..50]), data(0, &w[0][80..]), data(1, &w[1])];
    let e = check_output(&served, &w, false).unwrap_err();
    assert!(e.contains("30 bytes of stdout"), "{e}");
}

#[test]
fn a_run_covered_by_an_exact_record_is_clean() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        gap(1, 30),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(30));
}

#[test]
fn a_record_that_counts_wrong_is_caught() {
    let w = wrote();
    let short = vec![
        data(0, &w[0][..50]),
        gap(1, 29),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&short, &w, false).is_err());
    let long = vec![
        data(0, &w[0][..50]),
        gap(1, 31),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    let e = check_output(&long, &w, false).unwrap_err();
    assert!(e.contains("1 more bytes"), "{e}");
}

#[test]
fn a_record_of_the_other_stream_covers_nothing() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        gap(2, 30),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_record_in_the_wrong_place_covers_nothing() {
    let w = wrote();
    // the record comes after the bytes that follow the run
    let served = vec![
        data(0, &w[0][..50]),
        data(0, &w[0][80..]),
        gap(1, 30),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn duplicated_output_is_caught() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..60]),
        data(0, &w[0][40..60]),
        data(0, &w[0][60..]),
        data(1, &w[1]),
    ];
    let e = check_output(&served, &w, false).unwrap_err();
    assert!(e.contains("invented, duplicated or reordered"), "{e}");
}

#[test]
fn reordered_output_is_caught() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..20]),
        data(0, &w[0][60..100]),
        data(0, &w[0][20..60]),
        data(0, &w[0][100..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn invented_output_is_caught() {
    let w = wrote();
    let served = vec![data(0, &w[0]), data(0, b"not written"), data(1, &w[1])];
    assert!(check_output(&served, &w, false).is_err());
    // bytes of the other stream served as this one's
    let crossed = vec![data(0, &w[0]), data(0, &w[1])];
    assert!(check_output(&crossed, &w, false).is_err());
}

#[test]
fn a_lost_tail_is_clean_only_when_the_process_died_with_its_daemon() {
    let w = wrote();
    let served = vec![data(0, &w[0][..100]), data(1, &w[1]), Served::Incomplete];
    assert!(check_output(&served, &w, false).is_err());
    assert_eq!(check_output(&served, &w, true), Ok(0));
}

#[test]
fn one_record_of_both_streams_covers_a_run_of_each() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..10]),
        data(1, &w[1][..10]),
        gap(3, 15),
        data(0, &w[0][20..]),
        data(1, &w[1][15..]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(15));
}

#[test]
fn two_runs_never_share_one_narrow_record() {
    let w = wrote();
    // one stdout record of 20 bytes cannot cover a 10-byte stdout run and
    // a 10-byte stderr run
    let served = vec![
        data(0, &w[0][..10]),
        data(1, &w[1][..10]),
        gap(1, 20),
        data(0, &w[0][20..]),
        data(1, &w[1][20..]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_record_without_a_count_is_refused() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        Served::Gap {
            mask: 1,
            raw: None,
            source: SPOOL,
        },
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_short_chunk_that_recurs_is_placed_where_a_record_explains_it() {
    // "sim output line " occurs at 0 and at 18: after a record of the
    // first line only the second place is honest
    let out = b"sim output line 1\nsim output line 2\n".to_vec();
    let w = [out.clone(), Vec::new()];
    let served = vec![gap(1, 18), data(0, &out[18..34]), data(0, &out[34..])];
    assert_eq!(check_output(&served, &w, false), Ok(18));
    // the same chunks without the record: the first line is missing
    // wherever they are placed
    let bare = vec![data(0, &out[18..34]), data(0, &out[34..])];
    let e = check_output(&bare, &w, false).unwrap_err();
    assert!(e.contains("18 bytes of stdout"), "{e}");
    // and a record of the wrong size explains no placement
    let wrong = vec![gap(1, 17), data(0, &out[18..34]), data(0, &out[34..])];
    assert!(check_output(&wrong, &w, false).is_err());
}

fn issue() -> Uuid7 {
    let mut b = [0u8; 16];
    b[0] = 1;
    b[6] = 0x70;
    b[8] = 0x80;
    b[15] = 9;
    Uuid7::from_bytes("t", b).unwrap()
}

fn signal_result(kind: wire::SignalKind, delivered: bool) -> (u64, Body) {
    (
        3,
        Body::SignalResult(wire::SignalResult {
            revision: 2,
            signal: kind as i32,
            outcome: if delivered {
                wire::SignalOutcome::Delivered as i32
            } else {
                wire::SignalOutcome::NoOpAfterExit as i32
            },
            reason: String::new(),
        }),
    )
}

fn signals(
    events: &[(u64, Body)],
    record: &ProcessRecord,
    asked: &[wire::SignalKind],
) -> (bool, Vec<String>) {
    let mut problems = Vec::new();
    let delivered = check_signals(
        &issue(),
        events,
        record,
        asked,
        false,
        &mut OracleCounts::default(),
        &mut problems,
    );
    (delivered, problems)
}

#[test]
fn a_signal_delivered_once_per_request_is_clean() {
    let term = wire::SignalKind::Term;
    let record = ProcessRecord {
        signals: vec![term],
        ..ProcessRecord::default()
    };
    let (delivered, p) = signals(&[signal_result(term, true)], &record, &[term]);
    assert!(p.is_empty(), "{p:?}");
    assert!(delivered);
    // the daemon's orderly stop is not the operator's
    let stopped = ProcessRecord {
        signals: vec![term, term],
        stop_signals: vec![term],
        ..ProcessRecord::default()
    };
    assert!(
        signals(&[signal_result(term, true)], &stopped, &[term])
            .1
            .is_empty()
    );
}

#[test]
fn a_signal_delivered_twice_is_caught() {
    let term = wire::SignalKind::Term;
    let twice = ProcessRecord {
        signals: vec![term, term],
        ..ProcessRecord::default()
    };
    let (_, p) = signals(&[signal_result(term, true)], &twice, &[term]);
    assert!(
        p.iter()
            .any(|x| x.contains("reached the process 2 times for 1 requests")),
        "{p:?}"
    );
    // two results stored for one request
    let once = ProcessRecord {
        signals: vec![term],
        ..ProcessRecord::default()
    };
    let (_, p) = signals(
        &[signal_result(term, true), signal_result(term, false)],
        &once,
        &[term],
    );
    assert!(p.iter().any(|x| x.contains("2 results")), "{p:?}");
}

#[test]
fn a_signal_result_that_lies_is_caught() {
    let kill = wire::SignalKind::Kill;
    // delivered, but stored as not delivered
    let got = ProcessRecord {
        signals: vec![kill],
        ..ProcessRecord::default()
    };
    let (_, p) = signals(&[signal_result(kill, false)], &got, &[kill]);
    assert!(
        p.iter().any(|x| x.contains("say delivered 0 times")),
        "{p:?}"
    );
    // stored as delivered, never delivered
    let (_, p) = signals(
        &[signal_result(kill, true)],
        &ProcessRecord::default(),
        &[kill],
    );
    assert!(
        p.iter().any(|x| x.contains("say delivered 1 times")),
        "{p:?}"
    );
    // a result lost with a daemon that died before it was durable is honest
    let lost = ProcessRecord {
        signals: vec![kill],
        signals_unrecorded: 1,
        ..ProcessRecord::default()
    };
    assert!(signals(&[], &lost, &[kill]).1.is_empty());
}

fn exit_change(
    lifecycle: Lifecycle,
    code: Option<i32>,
    signal: Option<i32>,
) -> wire::LifecycleChange {
    wire::LifecycleChange {
        lifecycle: lifecycle.to_wire() as i32,
        revision: 1,
        exit_result: Some(wire::ExitResult {
            lifecycle: lifecycle.to_wire() as i32,
            exit_code: code,
            signal_number: signal,
            signal_name: String::new(),
        }),
        reason: String::new(),
    }
}

fn exit_problems(
    record: &ProcessRecord,
    operator_signal: bool,
    server: Lifecycle,
    change: Option<&wire::LifecycleChange>,
    served: Option<wire::ExitResult>,
) -> Vec<String> {
    let mut problems = Vec::new();
    check_exit(
        &issue(),
        record,
        operator_signal,
        server,
        change,
        || served,
        &mut OracleCounts::default(),
        &mut problems,
    );
    problems
}

#[test]
fn the_exit_the_process_made_is_what_the_server_stores_and_serves() {
    let exited = |code| ProcessRecord {
        ended: Some(Ended::Exit(Exit::Code(code))),
        ..ProcessRecord::default()
    };
    let change = exit_change(Lifecycle::Failed, Some(223), None);
    let honest = exit_problems(
        &exited(223),
        false,
        Lifecycle::Failed,
        Some(&change),
        change.exit_result.clone(),
    );
    assert!(honest.is_empty(), "{honest:?}");
    // a code masked to 7 bits in the event
    let masked = exit_change(Lifecycle::Failed, Some(95), None);
    let p = exit_problems(
        &exited(223),
        false,
        Lifecycle::Failed,
        Some(&masked),
        masked.exit_result.clone(),
    );
    assert!(p.iter().any(|x| x.contains("stored exit result")), "{p:?}");
    // the event right, the row GetCommand serves wrong
    let p = exit_problems(
        &exited(223),
        false,
        Lifecycle::Failed,
        Some(&change),
        masked.exit_result.clone(),
    );
    assert!(p.iter().any(|x| x.contains("GetCommand serves")), "{p:?}");
    // a failure stored as a success
    let ok = exit_change(Lifecycle::Succeeded, Some(0), None);
    let p = exit_problems(
        &exited(3),
        false,
        Lifecycle::Succeeded,
        Some(&ok),
        ok.exit_result.clone(),
    );
    assert!(
        p.iter()
            .any(|x| x.contains("but the server says succeeded")),
        "{p:?}"
    );
    // a process the operator's signal ended is terminated, not failed
    let killed = ProcessRecord {
        ended: Some(Ended::Exit(Exit::Signal(9))),
        ..ProcessRecord::default()
    };
    let term = exit_change(Lifecycle::Terminated, None, Some(9));
    assert!(
        exit_problems(
            &killed,
            true,
            Lifecycle::Terminated,
            Some(&term),
            term.exit_result.clone()
        )
        .is_empty()
    );
    let failed = exit_change(Lifecycle::Failed, None, Some(9));
    assert!(
        !exit_problems(
            &killed,
            true,
            Lifecycle::Failed,
            Some(&failed),
            failed.exit_result.clone()
        )
        .is_empty()
    );
    // the server ending a command whose client never reported an end is
    // its decision, explained by the history
    assert!(exit_problems(&exited(0), false, Lifecycle::Interrupted, None, None).is_empty());
}

fn ack(seq: u64, closed: bool) -> (u64, Body) {
    (
        seq + 1,
        Body::StdinAck(wire::StdinAck {
            write_seq: seq,
            delivery: wire::StdinDelivery::Written as i32,
            closed,
            reason: String::new(),
        }),
    )
}

fn stdin_problems(
    truth: &[AckedWrite],
    events: &[(u64, Body)],
    record: &ProcessRecord,
) -> Vec<String> {
    let mut problems = Vec::new();
    check_stdin(
        &issue(),
        truth,
        events,
        record,
        &mut OracleCounts::default(),
        &mut problems,
    );
    problems
}

#[test]
fn stdin_is_got_once_each_in_order_with_one_end_of_file() {
    let truth: Vec<AckedWrite> = vec![
        (1, b"abc".to_vec(), false),
        (2, b"de".to_vec(), false),
        (3, Vec::new(), true),
    ];
    let acks = [ack(1, false), ack(2, false), ack(3, true)];
    let honest = ProcessRecord {
        stdin_writes: vec![1, 2],
        stdin: b"abcde".to_vec(),
        eofs: 1,
        ended: Some(Ended::Exit(Exit::Code(0))),
        ..ProcessRecord::default()
    };
    assert!(stdin_problems(&truth, &acks, &honest).is_empty());
    // a write replayed into the process
    let doubled = ProcessRecord {
        stdin_writes: vec![1, 2, 2],
        stdin: b"abcdede".to_vec(),
        ..honest.clone()
    };
    let p = stdin_problems(&truth, &acks, &doubled);
    assert!(
        p.iter().any(|x| x.contains("got stdin writes [1, 2, 2]")),
        "{p:?}"
    );
    // bytes other than those acknowledged
    let garbled = ProcessRecord {
        stdin: b"abXde".to_vec(),
        ..honest.clone()
    };
    let p = stdin_problems(&truth, &acks, &garbled);
    assert!(p.iter().any(|x| x.contains("other than")), "{p:?}");
    // a write acknowledged written that never arrived
    let lost = ProcessRecord {
        stdin_writes: vec![1],
        stdin: b"abc".to_vec(),
        ..honest.clone()
    };
    let p = stdin_problems(&truth, &acks, &lost);
    assert!(p.iter().any(|x| x.contains("never got it")), "{p:?}");
    // end of file twice, or without the close acknowledged
    let two_eofs = ProcessRecord {
        eofs: 2,
        ..honest.clone()
    };
    assert!(!stdin_problems(&truth, &acks, &two_eofs).is_empty());
    let no_close = [ack(1, false), ack(2, false)];
    let p = stdin_problems(&truth[..2], &no_close, &honest);
    assert!(
        p.iter().any(|x| x.contains("end of file read 1 times")),
        "{p:?}"
    );
    // one write acknowledged twice
    let p = stdin_problems(
        &truth,
        &[ack(1, false), ack(1, false), ack(2, false), ack(3, true)],
        &honest,
    );
    assert!(p.iter().any(|x| x.contains("acknowledged twice")), "{p:?}");
}

#[test]
fn a_short_chunk_after_a_long_record_is_placed_where_the_record_ends() {
    // text lines recur every few dozen bytes; a record of 1.7 MB then a
    // 16-byte line prefix: tens of thousands of earlier places fit the
    // chunk, the record explains only the last one
    let mut out = Vec::new();
    let mut n = 0u64;
    while out.len() < 2_000_000 {
        n += 1;
        out.extend_from_slice(format!("sim output line {n} of host 1\n").as_bytes());
    }
    // end the stream on a line's prefix
    let cut = out.len() - out.iter().rev().position(|b| *b == b'\n').unwrap_or(0);
    out.truncate(cut);
    out.extend_from_slice(b"sim output line ");
    let w = [out.clone(), Vec::new()];
    let head = 100_000;
    let gap_len = (out.len() - head - 16) as u64;
    let served = vec![
        data(0, &out[..head]),
        gap(1, gap_len),
        data(0, &out[out.len() - 16..]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(gap_len));
    // a record one byte short explains no placement
    let short = vec![
        data(0, &out[..head]),
        gap(1, gap_len - 1),
        data(0, &out[out.len() - 16..]),
    ];
    assert!(check_output(&short, &w, false).is_err());
}
