//! Target `envelope`: one agent frame, as the server reads it.
//!
//! The bytes go through `Envelope` decode (a decoded envelope must encode
//! and decode to itself), then into three server sessions
//! (`rvbox_session::Session`, the checks the server applies before it acts
//! on a frame): a fresh one waiting for the hello, a ready one (welcomed
//! and reconciled), and the ready one again with the frame's session
//! fields replaced by the live ones, so that payload checks are reached
//! and not only the stale-session check. After each, the effects must be
//! well formed:
//!
//! - every envelope the session sends is server-to-client (or a
//!   `ControlError`), on its lane, within the envelope ceiling;
//! - a `Close` is the last effect but its counter, and a session that
//!   closed emitted one;
//! - a registration is asked for only from a hello that decodes and
//!   validates, and only before the welcome;
//! - a message is delivered only on an established session, and an event
//!   only once reconciled, with its window cost and command id as decoded;
//! - no `EventAck` leaves before the store reported the event durable, and
//!   then it never acknowledges past what was reported;
//! - the session's in-flight bytes stay within its window.

use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{
    ClientMessage, Direction, Effect, Input, Phase, RegistrationToken, ServerIdentity, Session,
    SessionConfig, SessionId, event_window_cost, payload_direction, payload_lane,
};

/// The server id every harness session uses.
pub const SERVER_ID: &str = "01890a5d-ac96-774b-bcce-b302099a8057";
/// The live session id of the ready session.
pub const LIVE_SESSION: &str = "0123456789abcdef0123456789abcdef";
/// The live generation of the ready session.
pub const LIVE_GENERATION: u64 = 3;
/// Commands the ready session was reconciled with (durable up to 2).
pub const RESUMED: [&str; 2] = [
    "01890a5d-ac96-774b-bcce-b30209a00001",
    "01890a5d-ac96-774b-bcce-b30209a00002",
];

/// The server identity of the harness.
#[must_use]
pub fn identity() -> ServerIdentity {
    ServerIdentity {
        server_id: Uuid7::parse("server_id", SERVER_ID).expect("valid server id"),
        software_version: "1.0.0".into(),
        supported_minors: vec![0, 1, 2],
    }
}

/// The session configuration of the harness (default limits).
#[must_use]
pub fn config() -> SessionConfig {
    SessionConfig::new(identity())
}

/// A valid hello from `client_id` (instance `instance`, a UUIDv4 text).
#[must_use]
pub fn hello(client_id: &str, instance: &str) -> wire::ClientHello {
    wire::ClientHello {
        client_id: client_id.into(),
        client_instance_id: instance.into(),
        protocol_major: 1,
        supported_minors: vec![0, 1, 2],
        capabilities: Some(wire::Capabilities {
            platform: Some(wire::Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                os_release: "6.1.0".into(),
            }),
            software_version: "1.0.0".into(),
            shells: vec![wire::ShellCapability {
                shell_type: wire::ShellType::Sh as i32,
                platform_default: true,
            }],
            profiles: vec![wire::ProfileFlag::Light as i32],
            max_running: 16,
            max_queued: 100,
            supervision_mode: wire::SupervisionMode::CgroupV2 as i32,
        }),
        cwd_policy: Some(wire::CwdPolicy {
            default_cwd: "/srv".into(),
            allowed_roots: vec!["/srv".into(), "/tmp".into()],
        }),
        labels: vec![wire::Label {
            key: "role".into(),
            value: "web".into(),
        }],
    }
}

/// Encodes `payload` in an envelope with these session fields.
#[must_use]
pub fn frame(session_id: &str, generation: u64, payload: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: session_id.into(),
        generation,
        payload: Some(payload),
    }
    .encode_to_vec()
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let decoded = decode_round_trip(data);
    fresh_session(data, decoded.as_ref());
    ready_session(data);
    if let Some(mut env) = decoded {
        env.session_id = LIVE_SESSION.into();
        env.generation = LIVE_GENERATION;
        ready_session(&env.encode_to_vec());
    }
}

fn decode_round_trip(data: &[u8]) -> Option<wire::Envelope> {
    let env = wire::Envelope::decode(data).ok()?;
    let bytes = env.encode_to_vec();
    assert_eq!(
        bytes.len(),
        env.encoded_len(),
        "encoded_len is the encoding's length"
    );
    let again = wire::Envelope::decode(bytes.as_slice()).expect("an encoded envelope decodes");
    assert_eq!(again, env, "decode(encode(envelope)) is the envelope");
    if let Some(p) = &env.payload {
        // total functions over every payload
        let _ = (
            rvbox_session::payload_name(p),
            payload_direction(p),
            payload_lane(p),
        );
    }
    Some(env)
}

fn drain(session: &mut Session) -> Vec<Effect> {
    let mut out = Vec::new();
    while let Some(e) = session.poll_effect() {
        out.push(e);
        assert!(
            out.len() < 10_000,
            "a session emits a bounded number of effects"
        );
    }
    out
}

/// What one batch of effects must look like, whatever the input was.
fn check_effects(session: &Session, before: Phase, effects: &[Effect], durable_reported: bool) {
    let limits = rvbox_session::SessionLimits::default();
    let mut closed_at = None;
    for (i, e) in effects.iter().enumerate() {
        if closed_at.is_some() {
            assert!(
                matches!(e, Effect::Metric(_)),
                "only the close counter follows a Close: {e:?}"
            );
        }
        match e {
            Effect::Send { lane, envelope } => {
                let payload = envelope
                    .payload
                    .as_ref()
                    .expect("a sent envelope has a payload");
                assert_ne!(
                    payload_direction(payload),
                    Direction::ClientToServer,
                    "the server sends only server-to-client payloads"
                );
                assert_eq!(*lane, payload_lane(payload), "a payload goes on its lane");
                let len = u64::try_from(envelope.encoded_len()).unwrap_or(u64::MAX);
                assert!(
                    len <= limits.max_envelope_bytes,
                    "a sent envelope fits the ceiling"
                );
                if matches!(payload, Payload::EventAck(_)) {
                    assert!(
                        durable_reported,
                        "no EventAck before the store reported durable"
                    );
                }
            }
            Effect::Close { reason } => {
                assert_ne!(
                    *reason,
                    wire::CloseReason::Unspecified,
                    "a close has a reason"
                );
                closed_at = Some(i);
            }
            Effect::Register { hello, .. } => {
                assert_eq!(
                    before,
                    Phase::AwaitingHello,
                    "registration only from the hello"
                );
                assert!(
                    [0, 1, 2].contains(&hello.negotiated_minor),
                    "the negotiated minor is one the server speaks"
                );
            }
            Effect::Deliver(m) => {
                assert!(
                    matches!(before, Phase::Reconciling | Phase::Ready),
                    "delivered only on an established session: {before:?}"
                );
                if let ClientMessage::CommandEvent(d) = m {
                    assert_eq!(before, Phase::Ready, "events only once reconciled");
                    assert_eq!(d.window_cost, event_window_cost(&d.event));
                    assert_eq!(
                        d.issue.to_string(),
                        d.event.issue_uuid,
                        "the command id as sent"
                    );
                }
            }
            Effect::Ping | Effect::Audit(_) | Effect::Metric(_) => {}
        }
    }
    if session.phase() == Phase::Closed && before != Phase::Closed {
        assert!(closed_at.is_some(), "a session that closed emitted a Close");
    }
    if closed_at.is_some() {
        assert_eq!(
            session.phase(),
            Phase::Closed,
            "a Close leaves the session closed"
        );
    }
    assert!(
        session.in_flight_bytes() <= limits.session_window_bytes,
        "in-flight bytes stay within the session window"
    );
}

fn fresh_session(data: &[u8], decoded: Option<&wire::Envelope>) {
    let mut s = Session::new(1_000, config()).expect("valid config");
    s.handle(1_000, Input::Binary(data.to_vec()));
    let effects = drain(&mut s);
    check_effects(&s, Phase::AwaitingHello, &effects, false);
    let registered = effects.iter().any(|e| matches!(e, Effect::Register { .. }));
    if registered {
        let env = decoded.expect("a registration comes from an envelope that decodes");
        let Some(Payload::ClientHello(h)) = &env.payload else {
            panic!("a registration comes from a ClientHello");
        };
        assert!(env.session_id.is_empty() && env.generation == 0);
        let valid = effects.iter().find_map(|e| match e {
            Effect::Register { hello, .. } => Some(hello),
            _ => None,
        });
        assert_eq!(
            valid.map(|v| v.client_id.as_str().to_owned()),
            Some(h.client_id.clone()),
            "the registration is for the hello's client"
        );
        assert_eq!(s.phase(), Phase::Registering);
    } else {
        assert_eq!(
            s.phase(),
            Phase::Closed,
            "a first frame is a hello or the end"
        );
    }
}

/// A session welcomed as [`LIVE_SESSION`] / [`LIVE_GENERATION`] and
/// reconciled with [`RESUMED`], its effects drained.
#[must_use]
pub fn ready() -> Session {
    let mut s = Session::new(1_000, config()).expect("valid config");
    s.handle(
        1_000,
        Input::Binary(frame(
            "",
            0,
            Payload::ClientHello(hello("web-01", "3b241101-e2bb-4255-8caf-4136c566a962")),
        )),
    );
    let token = drain(&mut s)
        .into_iter()
        .find_map(|e| match e {
            Effect::Register { token, .. } => Some(token),
            _ => None,
        })
        .unwrap_or(RegistrationToken(0));
    s.handle(
        1_001,
        Input::Registered {
            token,
            session_id: SessionId::parse(LIVE_SESSION).expect("valid session id"),
            generation: LIVE_GENERATION,
        },
    );
    s.handle(
        1_002,
        Input::ReconcileWritten(wire::ReconcileResult {
            round: 1,
            resume: RESUMED
                .iter()
                .map(|i| wire::ResumeRow {
                    issue_uuid: (*i).into(),
                    revision: 3,
                    durable_event_seq: 2,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
    );
    drain(&mut s);
    assert_eq!(s.phase(), Phase::Ready, "the fixture session is ready");
    s
}

fn ready_session(data: &[u8]) {
    let mut s = ready();
    s.handle(2_000, Input::Binary(data.to_vec()));
    let effects = drain(&mut s);
    check_effects(&s, Phase::Ready, &effects, false);
    // the store reports every delivered event durable: each ack names a
    // delivered command and never passes what was reported
    let events: Vec<(Uuid7, u64)> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Deliver(ClientMessage::CommandEvent(d)) => Some((d.issue, d.event_seq)),
            _ => None,
        })
        .collect();
    if s.phase() == Phase::Closed {
        return;
    }
    for (issue, seq) in &events {
        s.handle(
            2_001,
            Input::EventsDurable {
                issue: *issue,
                durable_seq: *seq,
            },
        );
        let acks = drain(&mut s);
        check_effects(&s, Phase::Ready, &acks, true);
        for e in &acks {
            if let Effect::Send {
                envelope:
                    wire::Envelope {
                        payload: Some(Payload::EventAck(a)),
                        session_id,
                        generation,
                    },
                ..
            } = e
            {
                assert_eq!(
                    a.issue_uuid,
                    issue.to_string(),
                    "the ack names the durable command"
                );
                assert!(
                    a.durable_event_seq <= *seq,
                    "an ack never passes what is durable"
                );
                assert_eq!(
                    (session_id.as_str(), *generation),
                    (LIVE_SESSION, LIVE_GENERATION)
                );
            }
        }
    }
}
