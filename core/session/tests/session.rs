//! The per-connection session machine: hello -> welcome, rejections,
//! malformed envelopes, stale traffic, fencing, the send API.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{
    Harness, ISSUE_1, SID_1, SID_2, closes, control_error_code, frame, has_audit, hello,
    hello_frame, lifecycle_event, output_event, render, sent, sid,
};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::limits::MIB;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::CloseReason;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{
    AuditKind, ClientMessage, Effect, HELLO_TIMEOUT_MS, Input, Lane, Phase, RegistrationToken,
    SendError,
};

#[test]
fn hello_to_welcome_trace() {
    let mut h = Harness::new();
    let mut fx = h.at(5, Input::Binary(hello_frame(hello())));
    assert_eq!(h.s.phase(), Phase::Registering);
    // durability is an input: nothing is sent before the commit
    assert!(sent(&fx).is_empty());
    let token = match &fx[1] {
        Effect::Register { token, .. } => *token,
        other => panic!("{other:?}"),
    };
    fx.extend(h.at(
        7,
        Input::Registered {
            token,
            session_id: sid(SID_1),
            generation: 4,
        },
    ));
    assert_eq!(h.s.phase(), Phase::Reconciling);
    assert_eq!(h.s.negotiated_minor(), Some(2));
    insta::assert_debug_snapshot!(fx);
}

#[test]
fn welcome_session_fields_equal_the_envelope() {
    let mut h = Harness::new();
    let token = h.hello();
    let fx = h.input(Input::Registered {
        token,
        session_id: sid(SID_1),
        generation: 9,
    });
    let env = sent(&fx)[0].clone();
    let Some(Payload::ServerWelcome(w)) = &env.payload else {
        panic!("{env:?}")
    };
    assert_eq!(env.session_id, SID_1);
    assert_eq!(env.generation, 9);
    assert_eq!(w.session_id, env.session_id);
    assert_eq!(w.generation, env.generation);
    assert_eq!(w.protocol_major, 1);
    assert_eq!(w.negotiated_minor, 2);
    assert_eq!(w.server_id, common::SERVER_ID);
    let limits = w.limits.as_ref().unwrap();
    assert_eq!(limits.command_window_bytes, MIB);
    assert_eq!(limits.session_window_bytes, 8 * MIB);
    assert!(matches!(fx[0], Effect::Audit(_)));
    assert!(matches!(
        fx[1],
        Effect::Send {
            lane: Lane::Control,
            ..
        }
    ));
}

#[test]
fn live_conflict_rejection_closes_with_hello_rejected() {
    let mut h = Harness::new();
    let token = h.hello();
    let error = DomainError::new(Code::LiveConflict, "another instance is live")
        .with_field("client_hello.client_instance_id");
    let fx = h.input(Input::RegistrationRejected { token, error });
    assert_eq!(closes(&fx), vec![CloseReason::HelloRejected]);
    assert_eq!(
        control_error_code(&fx),
        Some(wire::ErrorCode::LiveConflict as i32)
    );
    assert!(has_audit(&fx, AuditKind::LiveConflict));
    // no welcome was ever sent
    assert!(
        !sent(&fx)
            .iter()
            .any(|e| matches!(e.payload, Some(Payload::ServerWelcome(_))))
    );
    assert_eq!(h.s.phase(), Phase::Closed);
    assert_eq!(h.s.poll_timeout(), None);
}

#[test]
fn storage_unavailable_registration_closes_retryably() {
    let mut h = Harness::new();
    let token = h.hello();
    let fx = h.input(Input::RegistrationRejected {
        token,
        error: DomainError::new(Code::Unavailable, "client scope is recovering"),
    });
    assert_eq!(closes(&fx), vec![CloseReason::StorageUnavailable]);
    assert_eq!(
        control_error_code(&fx),
        Some(wire::ErrorCode::Unavailable as i32)
    );
}

#[test]
fn late_or_foreign_registration_completion_is_ignored() {
    let mut h = Harness::new();
    let token = h.hello();
    let fx = h.input(Input::Registered {
        token: RegistrationToken(token.0 + 1),
        session_id: sid(SID_1),
        generation: 1,
    });
    assert!(sent(&fx).is_empty());
    assert_eq!(h.s.phase(), Phase::Registering);
}

#[test]
fn invalid_hello_closes_with_hello_rejected() {
    let mut h = Harness::new();
    let mut bad = hello();
    bad.protocol_major = 2;
    let fx = h.input(Input::Binary(hello_frame(bad)));
    assert_eq!(closes(&fx), vec![CloseReason::HelloRejected]);
    assert_eq!(
        control_error_code(&fx),
        Some(wire::ErrorCode::VersionMismatch as i32)
    );
    let env = sent(&fx)[0];
    assert_eq!((env.session_id.as_str(), env.generation), ("", 0));
    assert!(has_audit(&fx, AuditKind::HelloRejected));
}

fn assert_protocol_close(fx: &[Effect]) {
    assert_eq!(closes(fx), vec![CloseReason::ProtocolError], "{fx:#?}");
    assert_eq!(
        control_error_code(fx),
        Some(wire::ErrorCode::ProtocolError as i32)
    );
    assert!(has_audit(fx, AuditKind::ProtocolError));
    assert!(
        !fx.iter()
            .any(|e| matches!(e, Effect::Register { .. } | Effect::Deliver(_)))
    );
}

#[test]
fn malformed_envelope_closes_the_connection() {
    // garbage bytes
    let mut h = Harness::new();
    assert_protocol_close(&h.input(Input::Binary(vec![0xff, 0xff, 0xff, 0xff, 0x0f])));
    // text frame
    let mut h = Harness::new();
    assert_protocol_close(&h.input(Input::Text));
    // unset payload
    let mut h = Harness::new();
    let unset = prost::Message::encode_to_vec(&wire::Envelope::default());
    assert_protocol_close(&h.input(Input::Binary(unset)));
    // unknown payload field number (a future message): unset after decode
    let mut h = Harness::new();
    assert_protocol_close(&h.input(Input::Binary(vec![0xfa, 0x01, 0x00])));
    // server-direction message from the client
    let mut h = Harness::new();
    let ack = frame("", 0, Payload::EventAck(wire::EventAck::default()));
    assert_protocol_close(&h.input(Input::Binary(ack)));
    // a client message before the hello
    let mut h = Harness::new();
    let cap = frame(
        "",
        0,
        Payload::ClientCapacity(wire::ClientCapacity::default()),
    );
    assert_protocol_close(&h.input(Input::Binary(cap)));
    // a hello envelope that already claims session fields
    let mut h = Harness::new();
    let claimed = frame(SID_1, 1, Payload::ClientHello(hello()));
    assert_protocol_close(&h.input(Input::Binary(claimed)));
    // anything while the registration is in flight (before welcome)
    let mut h = Harness::new();
    h.hello();
    assert_protocol_close(&h.input(Input::Binary(hello_frame(hello()))));
    // a second hello on an established session
    let mut h = Harness::ready(1);
    assert_protocol_close(&h.input(Input::Binary(frame(
        SID_1,
        1,
        Payload::ClientHello(hello()),
    ))));
    // a server-direction message on an established session
    let mut h = Harness::ready(1);
    assert_protocol_close(&h.input(Input::Binary(frame(
        SID_1,
        1,
        Payload::Dispatch(wire::Dispatch::default()),
    ))));
}

#[test]
fn oversized_frame_closes_with_message_too_big_before_decoding() {
    let mut h = Harness::new();
    let limit = usize::try_from(MIB).unwrap();
    // not even valid protobuf: the size check comes first
    let fx = h.input(Input::Binary(vec![0xff; limit + 1]));
    assert_eq!(closes(&fx), vec![CloseReason::MessageTooBig]);
    assert!(sent(&fx).is_empty());
    // exactly at the limit the size passes and decoding decides
    let mut h = Harness::new();
    let fx = h.input(Input::Binary(vec![0xff; limit]));
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
}

#[test]
fn stale_generation_late_output_is_discarded_audited_and_closed() {
    // generation 5 is live; output still tagged with generation 4 arrives
    let mut h = Harness::ready(5);
    let late = frame(
        SID_1,
        4,
        Payload::CommandEvent(output_event(ISSUE_1, 1, 10)),
    );
    let fx = h.input(Input::Binary(late));
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Deliver(_))),
        "stale output must not reach the store"
    );
    assert!(has_audit(&fx, AuditKind::StaleSession));
    assert_eq!(closes(&fx), vec![CloseReason::StaleSession]);
    assert_eq!(
        control_error_code(&fx),
        Some(wire::ErrorCode::StaleSession as i32)
    );
    assert_eq!(h.s.in_flight_bytes(), 0);
    // after the close nothing more is accepted
    let again = frame(
        SID_1,
        5,
        Payload::CommandEvent(output_event(ISSUE_1, 1, 10)),
    );
    assert!(h.input(Input::Binary(again)).is_empty());
}

#[test]
fn unknown_session_id_is_stale() {
    let mut h = Harness::ready(5);
    let fx = h.input(Input::Binary(frame(
        SID_2,
        5,
        Payload::ClientCapacity(wire::ClientCapacity::default()),
    )));
    assert_eq!(closes(&fx), vec![CloseReason::StaleSession]);
    let mut h = Harness::ready(5);
    let fx = h.input(Input::Binary(frame(
        "",
        0,
        Payload::ClientCapacity(wire::ClientCapacity::default()),
    )));
    assert_eq!(closes(&fx), vec![CloseReason::StaleSession]);
}

#[test]
fn fenced_session_closes_with_session_fenced() {
    let mut h = Harness::ready(3);
    let fx = h.input(Input::Fenced { by_generation: 4 });
    assert_eq!(closes(&fx), vec![CloseReason::SessionFenced]);
    assert!(has_audit(&fx, AuditKind::Fenced));
    assert_eq!(h.s.phase(), Phase::Closed);
    assert_eq!(
        h.s.send(Payload::ReconcileRequest(wire::ReconcileRequest::default())),
        Err(SendError::Closed)
    );
}

#[test]
fn client_traffic_before_the_reconcile_result_is_a_protocol_error() {
    let mut h = Harness::welcomed(1);
    // the snapshot is what reconciliation waits for: allowed
    let fx = h.input(Input::Binary(frame(
        SID_1,
        1,
        Payload::ClientSnapshot(wire::ClientSnapshot::default()),
    )));
    assert!(matches!(
        fx.as_slice(),
        [Effect::Deliver(ClientMessage::ClientSnapshot(_))]
    ));
    let fx = h.event(lifecycle_event(ISSUE_1, 1, wire::Lifecycle::Running));
    assert_protocol_close(&fx);
}

#[test]
fn dispatch_waits_for_the_reconcile_result_and_the_live_generation() {
    let mut h = Harness::new();
    let dispatch = |generation| {
        Payload::Dispatch(wire::Dispatch {
            issue_uuid: ISSUE_1.into(),
            generation,
            revision: 1,
            ..Default::default()
        })
    };
    assert_eq!(h.s.send(dispatch(2)), Err(SendError::NotActive));
    let mut h = Harness::welcomed(2);
    assert_eq!(
        h.s.send(dispatch(2)),
        Err(SendError::NotReconciled {
            payload: "dispatch"
        })
    );
    // control traffic is fine while reconciling
    h.s.send(Payload::ReconcileRequest(wire::ReconcileRequest {
        round: 1,
        rows: vec![],
    }))
    .unwrap();
    let fx = h.input(Input::ReconcileWritten(wire::ReconcileResult {
        round: 1,
        ..Default::default()
    }));
    let envs = sent(&fx);
    assert!(matches!(
        envs[0].payload,
        Some(Payload::ReconcileRequest(_))
    ));
    assert!(matches!(envs[1].payload, Some(Payload::ReconcileResult(_))));
    assert_eq!(h.s.phase(), Phase::Ready);
    assert_eq!(
        h.s.send(dispatch(1)),
        Err(SendError::GenerationMismatch {
            dispatch: 1,
            live: 2
        })
    );
    h.s.send(dispatch(2)).unwrap();
    let fx = h.drain();
    match &fx[..] {
        [Effect::Send { lane, envelope }] => {
            assert_eq!(*lane, Lane::Data);
            assert_eq!(
                (envelope.session_id.as_str(), envelope.generation),
                (SID_1, 2)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        h.s.send(Payload::EventAck(wire::EventAck::default())),
        Err(SendError::NotCallerMessage {
            payload: "event_ack"
        })
    );
    assert_eq!(
        h.s.send(Payload::CommandEvent(wire::CommandEvent::default())),
        Err(SendError::NotCallerMessage {
            payload: "command_event"
        })
    );
    let huge = Payload::ScriptChunk(wire::ScriptChunk {
        payload: vec![0; usize::try_from(MIB).unwrap()],
        ..Default::default()
    });
    assert!(matches!(h.s.send(huge), Err(SendError::TooLarge { .. })));
}

#[test]
fn client_messages_are_delivered_with_parsed_ids() {
    let mut h = Harness::ready(1);
    let fx = h.input(Input::Binary(frame(
        SID_1,
        1,
        Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: ISSUE_1.into(),
            revision: 1,
            outcome: wire::AcceptOutcome::Positive as i32,
            ..Default::default()
        }),
    )));
    assert!(matches!(
        fx.as_slice(),
        [Effect::Deliver(ClientMessage::CommandAccepted { issue, .. })] if issue.to_string() == ISSUE_1
    ));
    let fx = h.input(Input::Binary(frame(
        SID_1,
        1,
        Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: "not-a-uuid".into(),
            ..Default::default()
        }),
    )));
    assert_protocol_close(&fx);
}

#[test]
fn hello_timeout_closes_a_silent_or_pong_only_peer() {
    let mut h = Harness::new();
    // the peer answers pings but never says hello
    for t in (5_000..HELLO_TIMEOUT_MS).step_by(5_000) {
        assert!(closes(&h.at(t, Input::Pong)).is_empty());
    }
    assert_eq!(h.s.poll_timeout(), Some(HELLO_TIMEOUT_MS));
    let fx = h.at(HELLO_TIMEOUT_MS - 1, Input::Timeout);
    assert!(closes(&fx).is_empty());
    let fx = h.at(HELLO_TIMEOUT_MS, Input::Timeout);
    assert_eq!(closes(&fx), vec![CloseReason::ProtocolError]);
}

#[test]
fn shutdown_and_control_lane_overflow_close() {
    let mut h = Harness::ready(1);
    assert_eq!(
        closes(&h.input(Input::Shutdown)),
        vec![CloseReason::ServiceRestart]
    );
    let mut h = Harness::ready(1);
    let fx = h.input(Input::ControlLaneFull);
    assert_eq!(closes(&fx), vec![CloseReason::InternalError]);
    // the control lane is full: no ControlError is queued on it
    assert!(sent(&fx).is_empty());
    let mut h = Harness::ready(1);
    assert!(closes(&h.input(Input::PeerClosed)).is_empty());
    assert_eq!(h.s.phase(), Phase::Closed);
}

#[test]
fn two_runs_give_identical_traces() {
    let run = || {
        let mut h = Harness::ready(1);
        let mut lines = Vec::new();
        for seq in 1..=3 {
            let fx = h.event(output_event(ISSUE_1, seq, 5));
            lines.extend(render(h.now, &fx));
        }
        let fx = h.input(Input::EventsDurable {
            issue: common::issue(ISSUE_1),
            durable_seq: 3,
        });
        lines.extend(render(h.now, &fx));
        lines
    };
    assert_eq!(run(), run());
}
