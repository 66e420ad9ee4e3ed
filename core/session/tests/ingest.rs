//! Event ingest: acks only after durability, send windows, duplicates,
//! ingress hysteresis (plan §6.1, §6.2, R-6.1-06/07/17/18).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{
    Harness, ISSUE_1, ISSUE_2, acks, closes, control_error_code, delivered_events, has_audit,
    issue, issue_n, lifecycle_event, output_event, output_event_costing,
};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::events::SeqError;
use rvbox_domain::limits::MIB;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::CloseReason;
use rvbox_session::{
    AuditKind, Effect, GateChange, HELD_EVENTS_CAPACITY, IngressGate, Input, event_window_cost,
};

#[test]
fn event_acks_only_after_durable() {
    let mut h = Harness::ready(1);
    let i1 = issue(ISSUE_1);
    let mut received = Vec::new();
    for seq in 1..=3 {
        let fx = h.event(output_event(ISSUE_1, seq, 100));
        assert!(acks(&fx).is_empty(), "no ack on receipt");
        received.extend(delivered_events(&fx));
    }
    assert_eq!(
        received,
        vec![(i1, 1, false), (i1, 2, false), (i1, 3, false)]
    );
    let before = h.s.in_flight_bytes();
    assert!(before > 300);
    // the store made 1..=2 durable
    let fx = h.input(Input::EventsDurable {
        issue: i1,
        durable_seq: 2,
    });
    assert_eq!(acks(&fx), vec![(ISSUE_1.to_owned(), 2)]);
    assert!(matches!(
        fx[0],
        Effect::Send {
            lane: rvbox_session::Lane::Control,
            ..
        }
    ));
    assert!(h.s.in_flight_bytes() < before);
    // a repeated or older durable report acks nothing new
    assert!(
        acks(&h.input(Input::EventsDurable {
            issue: i1,
            durable_seq: 2
        }))
        .is_empty()
    );
    assert!(
        acks(&h.input(Input::EventsDurable {
            issue: i1,
            durable_seq: 1
        }))
        .is_empty()
    );
    assert_eq!(
        acks(&h.input(Input::EventsDurable {
            issue: i1,
            durable_seq: 3
        })),
        vec![(ISSUE_1.to_owned(), 3)]
    );
    assert_eq!(h.s.in_flight_bytes(), 0);
}

#[test]
fn command_window_of_1_mib_exceeded_is_a_protocol_error() {
    let mut h = Harness::ready(1);
    let half = MIB / 2;
    // exactly 1 MiB unacknowledged is allowed
    for seq in 1..=2 {
        let fx = h.event(output_event_costing(ISSUE_1, seq, half));
        assert!(closes(&fx).is_empty(), "{fx:?}");
    }
    assert_eq!(h.s.in_flight_bytes(), MIB);
    // one more event of this command exceeds it
    let next = output_event(ISSUE_1, 3, 1);
    assert!(event_window_cost(&next) > 0);
    let fx = h.event(next);
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
    assert_eq!(
        control_error_code(&fx),
        Some(wire::ErrorCode::ProtocolError as i32)
    );
    assert!(delivered_events(&fx).is_empty());
}

#[test]
fn command_window_reopens_after_the_durable_ack() {
    let mut h = Harness::ready(1);
    let half = MIB / 2;
    h.event(output_event_costing(ISSUE_1, 1, half));
    h.event(output_event_costing(ISSUE_1, 2, half));
    h.input(Input::EventsDurable {
        issue: issue(ISSUE_1),
        durable_seq: 1,
    });
    let fx = h.event(output_event_costing(ISSUE_1, 3, half));
    assert!(closes(&fx).is_empty());
    assert_eq!(delivered_events(&fx).len(), 1);
}

#[test]
fn session_window_of_8_mib_exceeded_is_a_protocol_error() {
    let mut h = Harness::ready(1);
    let half = MIB / 2;
    for n in 0..8u16 {
        let id = issue_n(n).to_string();
        for seq in 1..=2 {
            let fx = h.event(output_event_costing(&id, seq, half));
            assert!(closes(&fx).is_empty(), "command {n} seq {seq}");
        }
    }
    assert_eq!(h.s.in_flight_bytes(), 8 * MIB);
    // a ninth command is within its own window but not the session's
    let fx = h.event(output_event(&issue_n(8).to_string(), 1, 1));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
    assert!(has_audit(&fx, AuditKind::ProtocolError));
}

#[test]
fn gap_and_zero_sequences_are_refused() {
    let mut h = Harness::ready(1);
    h.event(output_event(ISSUE_1, 1, 1));
    let fx = h.event(output_event(ISSUE_1, 3, 1));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
    let mut h = Harness::ready(1);
    let fx = h.event(output_event(ISSUE_1, 0, 1));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
    // a command first seen in this session starts at 1
    let mut h = Harness::ready(1);
    let fx = h.event(output_event(ISSUE_1, 2, 1));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
}

#[test]
fn reconcile_resume_rows_seed_the_sequence_baseline() {
    let row = wire::ResumeRow {
        issue_uuid: ISSUE_1.into(),
        revision: 2,
        durable_event_seq: 5,
        script_resume_offset: 0,
    };
    let mut h = Harness::ready_with(1, vec![row.clone()]);
    let fx = h.event(output_event(ISSUE_1, 6, 1));
    assert_eq!(delivered_events(&fx), vec![(issue(ISSUE_1), 6, false)]);
    let mut h = Harness::ready_with(1, vec![row]);
    let fx = h.event(output_event(ISSUE_1, 7, 1));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
}

#[test]
fn identical_duplicate_is_harmless() {
    let mut h = Harness::ready(1);
    let i1 = issue(ISSUE_1);
    h.event(output_event(ISSUE_1, 1, 10));
    h.event(output_event(ISSUE_1, 2, 10));
    h.input(Input::EventsDurable {
        issue: i1,
        durable_seq: 2,
    });
    // the client repeats seq 2 unchanged: it goes to the store flagged repeat
    let fx = h.event(output_event(ISSUE_1, 2, 10));
    assert_eq!(delivered_events(&fx), vec![(i1, 2, true)]);
    assert!(closes(&fx).is_empty());
    // the store found it identical and reports durable again: re-ack, no close
    let fx = h.input(Input::EventsDurable {
        issue: i1,
        durable_seq: 2,
    });
    assert_eq!(acks(&fx), vec![(ISSUE_1.to_owned(), 2)]);
    assert!(closes(&fx).is_empty());
    assert_eq!(h.s.in_flight_bytes(), 0);
    // and the stream continues
    let fx = h.event(output_event(ISSUE_1, 3, 10));
    assert_eq!(delivered_events(&fx), vec![(i1, 3, false)]);
}

#[test]
fn conflicting_duplicate_closes_the_session() {
    let mut h = Harness::ready(1);
    let i1 = issue(ISSUE_1);
    h.event(output_event(ISSUE_1, 1, 10));
    h.input(Input::EventsDurable {
        issue: i1,
        durable_seq: 1,
    });
    // seq 1 again with different content
    let fx = h.event(output_event(ISSUE_1, 1, 11));
    assert_eq!(delivered_events(&fx), vec![(i1, 1, true)]);
    // the store compared digests (check_event_seq) and refused it
    let error = DomainError::new(
        Code::ProtocolError,
        SeqError::ConflictingDuplicate { seq: 1 }.to_string(),
    );
    let fx = h.input(Input::EventRefused {
        issue: i1,
        event_seq: 1,
        error,
    });
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
    assert!(has_audit(&fx, AuditKind::ProtocolError));
    assert!(acks(&fx).is_empty(), "history is never rewritten or acked");
    // later durable reports for the closed session ack nothing
    assert!(
        h.input(Input::EventsDurable {
            issue: i1,
            durable_seq: 1
        })
        .is_empty()
    );
}

#[test]
fn ingress_hysteresis_stops_above_64_mib_and_resumes_only_below_32_mib() {
    let mut gate = IngressGate::default();
    assert_eq!(gate.admit(64 * MIB), None, "at 64 MiB exactly: still open");
    assert!(gate.is_open());
    assert_eq!(gate.admit(1), Some(GateChange::Closed));
    assert!(!gate.is_open());
    // falling to 32 MiB exactly is not below the low watermark
    assert_eq!(gate.release(32 * MIB + 1), Ok(None));
    assert_eq!(gate.level(), 32 * MIB);
    assert!(!gate.is_open());
    assert_eq!(gate.admit(10), None);
    assert_eq!(gate.release(11), Ok(Some(GateChange::Opened)));
    assert!(gate.is_open());
}

#[test]
fn closed_gate_holds_output_and_keeps_the_lifecycle_reserve() {
    let mut h = Harness::ready(1);
    let (i1, i2) = (issue(ISSUE_1), issue(ISSUE_2));
    h.input(Input::IngressGate { open: false });
    // output is held: not delivered, so never durable, so never acked
    let fx = h.event(output_event(ISSUE_1, 1, 10));
    assert!(delivered_events(&fx).is_empty());
    assert_eq!(h.s.held_events(), 1);
    // another command's lifecycle uses the reserve
    let fx = h.event(lifecycle_event(ISSUE_2, 1, wire::Lifecycle::Running));
    assert_eq!(delivered_events(&fx), vec![(i2, 1, false)]);
    // the held command's lifecycle waits behind its output (order)
    let fx = h.event(lifecycle_event(ISSUE_1, 2, wire::Lifecycle::Succeeded));
    assert!(delivered_events(&fx).is_empty());
    // below the low watermark the held events go out in order
    let fx = h.input(Input::IngressGate { open: true });
    assert_eq!(delivered_events(&fx), vec![(i1, 1, false), (i1, 2, false)]);
    assert_eq!(h.s.held_events(), 0);
    let fx = h.event(output_event(ISSUE_1, 3, 10));
    assert_eq!(delivered_events(&fx), vec![(i1, 3, false)]);
}

#[test]
fn full_held_queue_closes_without_acknowledging() {
    let mut h = Harness::ready(1);
    h.input(Input::IngressGate { open: false });
    // an honest client replaying thousands of short events after a long
    // partition: everything its windows let it have unacknowledged (here
    // over several commands, each within its 1 MiB window) is held while
    // the gate is closed, and none of it closes the session
    let per_command = 8_192u64;
    let commands = u64::try_from(HELD_EVENTS_CAPACITY).unwrap() / per_command;
    let issue = |c: u64| format!("01890a5d-ac96-774b-bcce-b302099a{:04x}", 0x9000 + c);
    for c in 0..commands {
        for seq in 1..=per_command {
            let fx = h.event(output_event(&issue(c), seq, 1));
            assert!(closes(&fx).is_empty(), "command {c} event {seq}: {fx:?}");
        }
    }
    assert_eq!(h.s.held_events(), HELD_EVENTS_CAPACITY);
    // one more than that is an overload: closed, nothing acknowledged
    let fx = h.event(output_event(&issue(commands), 1, 1));
    assert_eq!(closes(&fx), vec![CloseReason::IngressOverload]);
    assert!(acks(&fx).is_empty());
    assert!(delivered_events(&fx).is_empty());
    assert!(has_audit(&fx, AuditKind::IngressOverload));
    // the shell could not enqueue a descriptor: same close
    let mut h = Harness::ready(1);
    assert_eq!(
        closes(&h.input(Input::IngressQueueFull)),
        vec![CloseReason::IngressOverload]
    );
}

#[test]
fn unset_event_body_and_bad_issue_are_protocol_errors() {
    let mut h = Harness::ready(1);
    let mut ev = output_event(ISSUE_1, 1, 1);
    ev.body = None;
    assert_eq!(closes(&h.event(ev)), vec![CloseReason::ProtocolError]);
    let mut h = Harness::ready(1);
    let ev = output_event("3b241101-e2bb-4255-8caf-4136c566a962", 1, 1);
    assert_eq!(closes(&h.event(ev)), vec![CloseReason::ProtocolError]);
}

#[test]
fn storage_unavailable_refusal_closes_retryably() {
    let mut h = Harness::ready(1);
    h.event(output_event(ISSUE_1, 1, 1));
    let fx = h.input(Input::EventRefused {
        issue: issue(ISSUE_1),
        event_seq: 1,
        error: DomainError::new(Code::Unavailable, "scope recovering"),
    });
    assert_eq!(closes(&fx), vec![CloseReason::StorageUnavailable]);
}

#[test]
fn a_quota_refusal_is_transient_never_a_protocol_error() {
    let mut h = Harness::ready(1);
    h.event(output_event(ISSUE_1, 1, 1));
    let fx = h.input(Input::EventRefused {
        issue: issue(ISSUE_1),
        event_seq: 1,
        error: DomainError::new(Code::QuotaExceeded, "the client tier is full"),
    });
    assert_eq!(closes(&fx), vec![CloseReason::IngressOverload]);
}
