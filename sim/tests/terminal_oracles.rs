#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The terminal oracles break when a terminal's promise breaks, and stay
//! quiet for every honest shape: input (every acknowledged frame reached
//! the PTY once, in order; nothing invented), output (what a viewer was
//! served is what the PTY produced at those offsets, or a cut marker
//! naming the range) and the close (the stored end is what the shell
//! did, with its reason).

use rvbox_client_core::process::Exit;
use rvbox_proto::v1 as wire;
use rvbox_sim::supervisor::TerminalRecord;
use rvbox_sim::terminals::{
    CloseAsked, REASON_EXITED, REASON_GONE, REASON_OPERATOR, TerminalCounts, TypedFrame,
    ViewerItem, check_recorded_input, check_terminal_close, check_terminal_input, check_viewer,
};

fn frame(id: &str, data: &[u8], acked: Option<u64>) -> TypedFrame {
    TypedFrame {
        request_id: id.to_owned(),
        data: data.to_vec(),
        acked,
        sent: true,
    }
}

fn typed() -> Vec<TypedFrame> {
    vec![
        frame("a", b"ls\r", Some(1)),
        frame("b", b"pwd\r", Some(2)),
        frame("c", b"exit\r", Some(3)),
    ]
}

fn record(frames: &[(u64, &[u8])]) -> TerminalRecord {
    TerminalRecord {
        starts: 1,
        frames: frames.iter().map(|(s, d)| (*s, d.to_vec())).collect(),
        input_seqs: frames.iter().map(|(s, _)| *s).collect(),
        ..TerminalRecord::default()
    }
}

fn input(typed: &[TypedFrame], r: &TerminalRecord, confirmed: u64, hung_up: bool) -> Vec<String> {
    let mut counts = TerminalCounts::default();
    check_terminal_input("t", typed, Some(r), confirmed, hung_up, &mut counts)
}

#[test]
fn every_acknowledged_frame_once_in_order_is_clean() {
    let r = record(&[(1, b"ls\r"), (2, b"pwd\r"), (3, b"exit\r")]);
    assert_eq!(input(&typed(), &r, 3, true), Vec::<String>::new());
}

#[test]
fn frames_not_yet_written_are_clean_until_confirmed_or_overtaken() {
    // the client has not written 3 yet, and never confirmed it
    let r = record(&[(1, b"ls\r"), (2, b"pwd\r")]);
    assert!(input(&typed(), &r, 2, false).is_empty());
    // confirmed written by the client, yet not in the PTY
    let p = input(&typed(), &r, 3, false);
    assert!(p.iter().any(|x| x.contains("confirmed written")), "{p:?}");
    // a close hung it up before it reached the PTY
    let p = input(&typed(), &r, 2, true);
    assert!(p.iter().any(|x| x.contains("hung it up")), "{p:?}");
}

#[test]
fn a_frame_written_twice_is_caught() {
    let r = record(&[(1, b"ls\r"), (2, b"pwd\r"), (2, b"pwd\r"), (3, b"exit\r")]);
    let p = input(&typed(), &r, 3, true);
    assert!(p.iter().any(|x| x.contains("each once, in order")), "{p:?}");
}

#[test]
fn a_frame_skipped_while_a_later_one_arrived_is_caught() {
    let r = record(&[(1, b"ls\r"), (3, b"exit\r")]);
    let p = input(&typed(), &r, 0, false);
    assert!(
        p.iter()
            .any(|x| x.contains("input_seq 2") && x.contains("though")),
        "{p:?}"
    );
}

#[test]
fn reordered_input_is_caught() {
    let r = record(&[(2, b"pwd\r"), (1, b"ls\r"), (3, b"exit\r")]);
    assert!(!input(&typed(), &r, 3, true).is_empty());
}

#[test]
fn changed_or_invented_input_is_caught() {
    let r = record(&[(1, b"ls\r"), (2, b"pwD\r"), (3, b"exit\r")]);
    let p = input(&typed(), &r, 3, true);
    assert!(p.iter().any(|x| x.contains("other than")), "{p:?}");
    let r = record(&[(1, b"ls\r"), (2, b"pwd\r"), (3, b"exit\r"), (4, b"rm\r")]);
    let p = input(&typed(), &r, 4, true);
    assert!(p.iter().any(|x| x.contains("no operator sent")), "{p:?}");
}

#[test]
fn a_frame_never_answered_may_arrive_once_but_not_twice() {
    let mut t = typed();
    t.push(frame("d", b"late\r", None));
    let r = record(&[(1, b"ls\r"), (2, b"pwd\r"), (3, b"exit\r"), (4, b"late\r")]);
    assert!(input(&t, &r, 4, true).is_empty());
    let r = record(&[
        (1, b"ls\r"),
        (2, b"pwd\r"),
        (3, b"exit\r"),
        (4, b"late\r"),
        (5, b"late\r"),
    ]);
    assert!(!input(&t, &r, 5, true).is_empty());
}

#[test]
fn acknowledgements_out_of_typing_order_are_caught() {
    let t = vec![frame("a", b"x", Some(2)), frame("b", b"y", Some(1))];
    let r = record(&[(1, b"y"), (2, b"x")]);
    let p = input(&t, &r, 2, true);
    assert!(p.iter().any(|x| x.contains("acknowledged as")), "{p:?}");
}

#[test]
fn the_recording_holds_what_was_typed() {
    let rec = vec![(1, b"ls\r".to_vec()), (2, b"pwd\r".to_vec())];
    assert!(check_recorded_input("t", &typed(), &rec).is_empty());
    let doubled = vec![(1, b"ls\r".to_vec()), (1, b"ls\r".to_vec())];
    assert!(!check_recorded_input("t", &typed(), &doubled).is_empty());
    let changed = vec![(1, b"LS\r".to_vec())];
    assert!(!check_recorded_input("t", &typed(), &changed).is_empty());
}

const OUT: &[u8] = b"0123456789abcdefghij";

fn out(offset: u64, data: &[u8]) -> ViewerItem {
    ViewerItem::Output {
        offset,
        data: data.to_vec(),
    }
}

#[test]
fn a_viewer_across_reattachments_and_honest_cuts_is_clean() {
    let items = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        ViewerItem::Attached { from: 5 },
        out(5, b"567"),
        ViewerItem::Cut {
            requested: 8,
            resumes: 12,
        },
        out(12, b"cdefghij"),
        ViewerItem::Closed { output_offset: 20 },
    ];
    assert_eq!(check_viewer("t", &items, OUT), Ok((16, 4)));
}

#[test]
fn doubled_output_is_caught() {
    let items = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        out(3, b"34567"),
    ];
    let e = check_viewer("t", &items, OUT).unwrap_err();
    assert!(e.contains("doubled"), "{e}");
}

#[test]
fn skipped_output_without_a_marker_is_caught() {
    let items = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        out(8, b"89"),
    ];
    let e = check_viewer("t", &items, OUT).unwrap_err();
    assert!(e.contains("without a cut marker"), "{e}");
}

#[test]
fn changed_output_is_caught() {
    let items = vec![ViewerItem::Attached { from: 0 }, out(0, b"01x34")];
    let e = check_viewer("t", &items, OUT).unwrap_err();
    assert!(e.contains("offset 2"), "{e}");
}

#[test]
fn a_reattach_from_elsewhere_than_printed_is_caught() {
    let items = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        ViewerItem::Attached { from: 3 },
    ];
    assert!(check_viewer("t", &items, OUT).is_err());
}

#[test]
fn a_cut_that_lies_or_a_close_short_of_the_end_is_caught() {
    let wrong_start = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        ViewerItem::Cut {
            requested: 6,
            resumes: 9,
        },
    ];
    assert!(check_viewer("t", &wrong_start, OUT).is_err());
    let short = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"01234"),
        ViewerItem::Closed { output_offset: 20 },
    ];
    assert!(check_viewer("t", &short, OUT).is_err());
    let past = vec![
        ViewerItem::Attached { from: 0 },
        out(0, b"0123456789abcdefghijk"),
    ];
    assert!(check_viewer("t", &past, OUT).is_err());
}

fn info(
    lifecycle: wire::Lifecycle,
    code: Option<i32>,
    reason: &str,
    offset: u64,
) -> wire::PtySessionInfo {
    wire::PtySessionInfo {
        state: wire::PtyState::Closed as i32,
        output_offset: offset,
        close_reason: reason.to_owned(),
        exit_result: Some(wire::ExitResult {
            lifecycle: lifecycle as i32,
            exit_code: code,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn ended(exit: Exit, hung_up: bool) -> TerminalRecord {
    TerminalRecord {
        starts: 1,
        output: OUT.to_vec(),
        ended: Some(exit),
        hung_up,
        ..TerminalRecord::default()
    }
}

fn close(i: &wire::PtySessionInfo, r: &TerminalRecord, asked: CloseAsked) -> Vec<String> {
    let mut counts = TerminalCounts::default();
    check_terminal_close("t", i, Some(r), asked, &mut counts)
}

#[test]
fn the_shells_own_end_and_an_operators_close_are_clean() {
    let r = ended(Exit::Code(3), false);
    let i = info(wire::Lifecycle::Failed, Some(3), REASON_EXITED, 20);
    assert!(close(&i, &r, CloseAsked::default()).is_empty());
    let r = ended(Exit::Signal(1), true);
    let mut i = info(wire::Lifecycle::Terminated, None, REASON_OPERATOR, 20);
    if let Some(x) = i.exit_result.as_mut() {
        x.signal_number = Some(1);
    }
    let asked = CloseAsked {
        by_operator: true,
        idle: false,
    };
    assert!(close(&i, &r, asked).is_empty());
}

#[test]
fn a_wrong_status_reason_or_output_end_is_caught() {
    let r = ended(Exit::Code(3), false);
    let wrong_code = info(wire::Lifecycle::Failed, Some(4), REASON_EXITED, 20);
    assert!(!close(&wrong_code, &r, CloseAsked::default()).is_empty());
    let wrong_reason = info(wire::Lifecycle::Failed, Some(3), REASON_OPERATOR, 20);
    assert!(!close(&wrong_reason, &r, CloseAsked::default()).is_empty());
    let short = info(wire::Lifecycle::Failed, Some(3), REASON_EXITED, 19);
    assert!(!close(&short, &r, CloseAsked::default()).is_empty());
    // the operator never closed it, yet it is stored as closed by one
    let r = ended(Exit::Signal(1), true);
    let mut i = info(wire::Lifecycle::Terminated, None, REASON_OPERATOR, 20);
    if let Some(x) = i.exit_result.as_mut() {
        x.signal_number = Some(1);
    }
    assert!(!close(&i, &r, CloseAsked::default()).is_empty());
}

#[test]
fn a_close_while_the_shell_runs_or_a_status_for_a_shell_never_run_is_caught() {
    let running = TerminalRecord {
        starts: 1,
        ..TerminalRecord::default()
    };
    let i = info(wire::Lifecycle::Succeeded, Some(0), REASON_EXITED, 0);
    assert!(!close(&i, &running, CloseAsked::default()).is_empty());
    let never = TerminalRecord::default();
    assert!(!close(&i, &never, CloseAsked::default()).is_empty());
    // a holder gone with the end it had told: the honest end
    let told = TerminalRecord {
        exit_unrecorded: true,
        ..ended(Exit::Code(0), false)
    };
    let gone = wire::PtySessionInfo {
        exit_result: Some(wire::ExitResult {
            lifecycle: wire::Lifecycle::Interrupted as i32,
            ..Default::default()
        }),
        ..info(wire::Lifecycle::Interrupted, None, REASON_GONE, 20)
    };
    assert!(close(&gone, &told, CloseAsked::default()).is_empty());
}
