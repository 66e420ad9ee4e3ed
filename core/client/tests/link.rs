//! The client session core (plan §7.1, §6.2-§6.3; R-7.1-08/09/17/19).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use prost::Message as _;
use rvbox_client_core::link::{
    HELLO_TIMEOUT_MS, Link, LinkConfig, LinkEffect, Phase, SNAPSHOT_CHUNK_BUDGET_BYTES, codes,
    snapshot_chunks,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;

const SID: &str = "0123456789abcdef0123";

fn hello() -> wire::ClientHello {
    wire::ClientHello {
        client_id: "web-1".into(),
        client_instance_id: "7b1e1d0e-8d5a-4f0c-9a57-1b7a2c3d4e5f".into(),
        protocol_major: 1,
        supported_minors: vec![0],
        ..Default::default()
    }
}

fn drain(link: &mut Link) -> Vec<LinkEffect> {
    std::iter::from_fn(|| link.poll_effect()).collect()
}

fn env(generation: u64, payload: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: SID.into(),
        generation,
        payload: Some(payload),
    }
    .encode_to_vec()
}

fn welcome(generation: u64, idle_s: i64) -> Vec<u8> {
    env(
        generation,
        Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            negotiated_minor: 0,
            session_id: SID.into(),
            generation,
            server_id: "srv".into(),
            server_software_version: "t".into(),
            limits: Some(wire::AgentLimits {
                command_window_bytes: 512 * 1024,
                session_window_bytes: 0,
                heartbeat_idle: Some(prost_types::Duration {
                    seconds: idle_s,
                    nanos: 0,
                }),
                liveness_timeout: Some(prost_types::Duration {
                    seconds: idle_s * 3,
                    nanos: 0,
                }),
                ..Default::default()
            }),
        }),
    )
}

fn sealed(round: u64) -> wire::ReconcileResult {
    let mut r = wire::ReconcileResult {
        round,
        ..Default::default()
    };
    r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
    r
}

/// A link welcomed at generation 5 (floor 4) and at `Reconciling`.
fn welcomed(now: u64) -> Link {
    let mut l = Link::new(LinkConfig::default(), hello(), 4, 7, now);
    assert_eq!(drain(&mut l), vec![LinkEffect::Dial]);
    l.opened(now);
    let sent = drain(&mut l);
    let LinkEffect::Send(bytes) = &sent[0] else {
        panic!("{sent:?}")
    };
    let hello_env = wire::Envelope::decode(bytes.as_slice()).unwrap();
    assert!(matches!(hello_env.payload, Some(Payload::ClientHello(_))));
    l.frame(now, &welcome(5, 10));
    let fx = drain(&mut l);
    let Some(LinkEffect::Welcomed(s)) = fx.first() else {
        panic!("{fx:?}")
    };
    assert_eq!(s.command_window, 512 * 1024, "the smaller window");
    assert_eq!(s.session_window, LinkConfig::default().session_window);
    l
}

fn active(now: u64) -> Link {
    let mut l = welcomed(now);
    l.frame(
        now,
        &env(
            5,
            Payload::ReconcileRequest(wire::ReconcileRequest {
                round: 1,
                rows: vec![],
            }),
        ),
    );
    assert!(matches!(
        drain(&mut l)[..],
        [LinkEffect::Reconcile { round: 1, .. }]
    ));
    l.send_snapshot(
        1,
        snapshot_chunks(1, wire::ScopeState::Ready, vec![], vec![]),
    );
    assert_eq!(drain(&mut l).len(), 1);
    l.frame(now, &env(5, Payload::ReconcileResult(sealed(1))));
    assert!(matches!(drain(&mut l)[..], [LinkEffect::Reconciled(_)]));
    assert!(!l.is_active(), "active only once the result is applied");
    l.activate(now);
    assert!(l.is_active());
    l
}

fn dispatch() -> Payload {
    Payload::Dispatch(wire::Dispatch::default())
}

#[test]
fn the_session_walks_hello_reconciling_active_in_order() {
    let mut l = active(1000);
    l.frame(1001, &env(5, dispatch()));
    assert!(matches!(
        drain(&mut l)[..],
        [LinkEffect::Message(Payload::Dispatch(_))]
    ));
    // the server's heartbeat policy: idle 10 s
    assert_eq!(l.poll_timeout(), Some(1001 + 10_000));
    l.send(Payload::ClientCapacity(wire::ClientCapacity::default()))
        .unwrap();
    let LinkEffect::Send(bytes) = &drain(&mut l)[0] else {
        panic!()
    };
    let e = wire::Envelope::decode(bytes.as_slice()).unwrap();
    assert_eq!((e.session_id.as_str(), e.generation), (SID, 5));
}

#[test]
fn dispatch_before_the_result_is_a_protocol_error() {
    let mut l = welcomed(0);
    l.frame(1, &env(5, dispatch()));
    let fx = drain(&mut l);
    assert_eq!(fx[0], LinkEffect::Close(codes::protocol_error()));
    assert!(fx.contains(&LinkEffect::Down));
    assert!(matches!(l.phase(), Phase::Backoff { .. }));
}

#[test]
fn a_stale_or_foreign_envelope_closes_the_session() {
    let mut l = active(0);
    l.frame(1, &env(4, dispatch()));
    assert_eq!(drain(&mut l)[0], LinkEffect::Close(codes::stale_session()));
    let mut l = active(0);
    l.frame(1, &[0xff; 10]);
    assert_eq!(drain(&mut l)[0], LinkEffect::Close(codes::protocol_error()));
    let mut l = active(0);
    l.frame(1, &vec![0; 1024 * 1024 + 1]);
    assert_eq!(drain(&mut l)[0], LinkEffect::Close(codes::too_big()));
}

#[test]
fn a_welcome_must_raise_the_generation_and_match_its_envelope() {
    for (g, bytes) in [
        (4, welcome(4, 10)), // not above the floor
        (6, {
            let mut w = wire::Envelope::decode(welcome(6, 10).as_slice()).unwrap();
            w.generation = 7; // envelope disagrees with the welcome
            w.encode_to_vec()
        }),
    ] {
        let mut l = Link::new(LinkConfig::default(), hello(), 4, 7, 0);
        drain(&mut l);
        l.opened(0);
        drain(&mut l);
        l.frame(1, &bytes);
        assert_eq!(
            drain(&mut l)[0],
            LinkEffect::Close(codes::protocol_error()),
            "generation {g}"
        );
    }
}

#[test]
fn a_result_is_checked_against_its_round_and_digest() {
    let mut l = welcomed(0);
    l.frame(
        0,
        &env(
            5,
            Payload::ReconcileRequest(wire::ReconcileRequest {
                round: 3,
                rows: vec![],
            }),
        ),
    );
    drain(&mut l);
    l.frame(1, &env(5, Payload::ReconcileResult(sealed(2))));
    assert_eq!(drain(&mut l)[0], LinkEffect::Close(codes::protocol_error()));
    let mut l = welcomed(0);
    l.frame(
        0,
        &env(
            5,
            Payload::ReconcileRequest(wire::ReconcileRequest {
                round: 3,
                rows: vec![],
            }),
        ),
    );
    drain(&mut l);
    let mut bad = sealed(3);
    bad.result_digest[0] ^= 1;
    l.frame(1, &env(5, Payload::ReconcileResult(bad)));
    assert_eq!(drain(&mut l)[0], LinkEffect::Close(codes::protocol_error()));
}

#[test]
fn backoff_is_full_jitter_doubling_to_a_minute_and_resets_only_after_a_stable_minute() {
    let mut l = Link::new(LinkConfig::default(), hello(), 0, 99, 0);
    let mut now = 0;
    let mut caps = Vec::new();
    for _ in 0..10 {
        assert_eq!(drain(&mut l), vec![LinkEffect::Dial]);
        l.closed(now, None);
        let Phase::Backoff { until_ms } = l.phase() else {
            panic!()
        };
        caps.push(until_ms - now);
        now = until_ms;
        l.handle_timeout(now);
    }
    let bounds = [
        1_000u64, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000, 60_000,
    ];
    for (d, cap) in caps.iter().zip(bounds) {
        assert!(*d <= cap, "{caps:?}");
    }
    assert!(caps.iter().any(|d| *d > 0), "jitter draws delays");
    // a session of 30 s does not reset the attempts; one of 60 s does
    let attempts = l.attempt();
    drain(&mut l);
    l.opened(now);
    l.frame(now, &welcome(1, 10));
    drain(&mut l);
    l.closed(now + 30_000, None);
    assert!(l.attempt() > attempts);
    let Phase::Backoff { until_ms } = l.phase() else {
        panic!()
    };
    now = until_ms;
    l.handle_timeout(now);
    drain(&mut l);
    l.opened(now);
    l.frame(now, &welcome(2, 10));
    drain(&mut l);
    l.closed(now + 60_000, None);
    assert_eq!(l.attempt(), 1, "reset, then this loss counted");
}

#[test]
fn a_server_restart_close_reconnects_at_once() {
    let mut l = active(5_000);
    l.closed(6_000, Some(codes::service_restart()));
    assert!(drain(&mut l).contains(&LinkEffect::Down));
    assert_eq!(l.phase(), Phase::Backoff { until_ms: 6_000 });
}

#[test]
fn silence_is_pinged_then_closed_by_the_liveness_timeout() {
    let mut l = active(0);
    l.handle_timeout(10_000);
    assert_eq!(drain(&mut l), vec![LinkEffect::SendPing]);
    let deadline = l.poll_timeout().unwrap();
    l.handle_timeout(deadline);
    let fx = drain(&mut l);
    assert_eq!(fx[0], LinkEffect::Close(codes::liveness_timeout()));
    assert!(fx.contains(&LinkEffect::Down));
    // an unanswered hello gives up too
    let mut l = Link::new(LinkConfig::default(), hello(), 0, 1, 0);
    drain(&mut l);
    l.opened(0);
    drain(&mut l);
    l.handle_timeout(HELLO_TIMEOUT_MS);
    assert_eq!(
        drain(&mut l)[0],
        LinkEffect::Close(codes::liveness_timeout())
    );
}

#[test]
fn shutdown_closes_with_1012_and_never_dials_again() {
    let mut l = active(0);
    l.shutdown();
    assert_eq!(
        drain(&mut l),
        vec![
            LinkEffect::Close(codes::service_restart()),
            LinkEffect::Down
        ]
    );
    l.handle_timeout(1_000_000);
    assert!(drain(&mut l).is_empty());
    assert_eq!(l.poll_timeout(), None);
}

#[test]
fn snapshot_chunks_stay_under_the_envelope_budget_with_records_before_tombstones() {
    let records: Vec<wire::SnapshotRecord> = (0..20_000)
        .map(|i| wire::SnapshotRecord {
            issue_uuid: format!("01890a5d-ac96-774b-bcce-b3020{i:07x}"),
            request_hash: vec![7; 32],
            revision: 1,
            lifecycle: wire::Lifecycle::Running as i32,
            ..Default::default()
        })
        .collect();
    let tombs: Vec<wire::SnapshotTombstone> = (0..100)
        .map(|i| wire::SnapshotTombstone {
            issue_uuid: format!("01890a5d-ac96-774b-bcce-b3021{i:07x}"),
            request_hash: vec![1; 32],
        })
        .collect();
    let chunks = snapshot_chunks(9, wire::ScopeState::Ready, records, tombs);
    assert!(chunks.len() > 1);
    let mut seen_tomb = false;
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.chunk_index as usize, i);
        assert_eq!(c.final_chunk, i + 1 == chunks.len());
        assert!(c.encoded_len() <= SNAPSHOT_CHUNK_BUDGET_BYTES);
        if !c.tombstones.is_empty() {
            seen_tomb = true;
        }
        if seen_tomb {
            assert!(c.records.is_empty() || !c.tombstones.is_empty());
        }
    }
    let total: usize = chunks.iter().map(|c| c.records.len()).sum();
    assert_eq!(total, 20_000);
    let one = snapshot_chunks(1, wire::ScopeState::DirtyReadable, vec![], vec![]);
    assert_eq!(one.len(), 1);
    assert!(one[0].final_chunk);
}
