//! Shared fixtures: a valid hello, a driven session, compact effect traces.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code,
    unreachable_pub
)]

use prost::Message as _;
use rvbox_domain::ids::{InstanceId, Uuid7};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{
    ClientMessage, Effect, Input, Phase, RegistrationToken, ServerIdentity, Session, SessionConfig,
    SessionId, close_text, payload_name,
};

pub const INSTANCE_A: &str = "3b241101-e2bb-4255-8caf-4136c566a962";
pub const INSTANCE_B: &str = "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f";
pub const INSTANCE_C: &str = "0c1d2e3f-4a5b-4c6d-9e7f-8a9b0c1d2e3f";
pub const SERVER_ID: &str = "01890a5d-ac96-774b-bcce-b302099a8057";
pub const ISSUE_1: &str = "01890a5d-ac96-774b-bcce-b302099a8101";
pub const ISSUE_2: &str = "01890a5d-ac96-774b-bcce-b302099a8102";
pub const SID_1: &str = "sid-0001-aaaaaaaaaaaaaaaa";
pub const SID_2: &str = "sid-0002-bbbbbbbbbbbbbbbb";

pub fn instance(text: &str) -> InstanceId {
    InstanceId::parse("test", text).unwrap()
}

pub fn issue(text: &str) -> Uuid7 {
    Uuid7::parse("test", text).unwrap()
}

/// The `n`-th distinct command id (n < 4096).
pub fn issue_n(n: u16) -> Uuid7 {
    issue(&format!("01890a5d-ac96-774b-bcce-b30209a{n:05x}"))
}

pub fn sid(text: &str) -> SessionId {
    SessionId::parse(text).unwrap()
}

pub fn identity() -> ServerIdentity {
    ServerIdentity {
        server_id: Uuid7::parse("server_id", SERVER_ID).unwrap(),
        software_version: "1.0.0".into(),
        supported_minors: vec![0, 1, 2],
    }
}

pub fn config() -> SessionConfig {
    SessionConfig::new(identity())
}

pub fn hello() -> wire::ClientHello {
    wire::ClientHello {
        client_id: "web-01".into(),
        client_instance_id: INSTANCE_A.into(),
        protocol_major: 1,
        supported_minors: vec![0, 1, 2, 3],
        capabilities: Some(wire::Capabilities {
            platform: Some(wire::Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                os_release: "6.1.0-18-amd64".into(),
            }),
            software_version: "1.0.0".into(),
            shells: vec![
                wire::ShellCapability {
                    shell_type: wire::ShellType::Sh as i32,
                    platform_default: true,
                },
                wire::ShellCapability {
                    shell_type: wire::ShellType::Bash as i32,
                    platform_default: false,
                },
            ],
            profiles: vec![wire::ProfileFlag::Light as i32],
            max_running: 16,
            max_queued: 100,
            supervision_mode: wire::SupervisionMode::CgroupV2 as i32,
        }),
        cwd_policy: Some(wire::CwdPolicy {
            default_cwd: "/srv".into(),
            allowed_roots: vec!["/srv".into(), "/tmp".into()],
        }),
        labels: vec![
            wire::Label {
                key: "role".into(),
                value: "web".into(),
            },
            wire::Label {
                key: "zone".into(),
                value: "eu-west".into(),
            },
        ],
    }
}

pub fn frame(session_id: &str, generation: u64, payload: Payload) -> Vec<u8> {
    wire::Envelope {
        session_id: session_id.into(),
        generation,
        payload: Some(payload),
    }
    .encode_to_vec()
}

pub fn hello_frame(h: wire::ClientHello) -> Vec<u8> {
    frame("", 0, Payload::ClientHello(h))
}

/// An output event whose payload is `len` bytes.
pub fn output_event(issue: &str, seq: u64, len: usize) -> wire::CommandEvent {
    wire::CommandEvent {
        issue_uuid: issue.into(),
        event_seq: seq,
        observed_time: None,
        body: Some(wire::command_event::Body::Output(wire::OutputChunk {
            stream: wire::OutputStream::Stdout as i32,
            payload: vec![b'x'; len],
            raw_length: 1,
            stored_length: u32::try_from(len).unwrap(),
        })),
    }
}

/// A lifecycle event.
pub fn lifecycle_event(issue: &str, seq: u64, to: wire::Lifecycle) -> wire::CommandEvent {
    wire::CommandEvent {
        issue_uuid: issue.into(),
        event_seq: seq,
        observed_time: None,
        body: Some(wire::command_event::Body::Lifecycle(
            wire::LifecycleChange {
                lifecycle: to as i32,
                revision: 1,
                exit_result: None,
                reason: String::new(),
            },
        )),
    }
}

/// An output event whose window cost is exactly `cost`.
pub fn output_event_costing(issue: &str, seq: u64, cost: u64) -> wire::CommandEvent {
    let mut len = usize::try_from(cost).unwrap();
    loop {
        let ev = output_event(issue, seq, len);
        let c = rvbox_session::event_window_cost(&ev);
        if c == cost {
            return ev;
        }
        assert!(c > cost && len > 0, "cannot hit cost {cost}");
        len -= 1;
    }
}

/// A session plus a clock; every call drains all effects.
#[derive(Debug)]
pub struct Harness {
    pub s: Session,
    pub now: u64,
}

impl Harness {
    pub fn new() -> Self {
        Self::with_config(config())
    }

    pub fn with_config(c: SessionConfig) -> Self {
        Self {
            s: Session::new(0, c).unwrap(),
            now: 0,
        }
    }

    pub fn at(&mut self, now: u64, input: Input) -> Vec<Effect> {
        self.now = now;
        self.s.handle(now, input);
        self.drain()
    }

    pub fn input(&mut self, input: Input) -> Vec<Effect> {
        let now = self.now;
        self.at(now, input)
    }

    pub fn drain(&mut self) -> Vec<Effect> {
        std::iter::from_fn(|| self.s.poll_effect()).collect()
    }

    /// Hello accepted; returns the registration token.
    pub fn hello(&mut self) -> RegistrationToken {
        let fx = self.input(Input::Binary(hello_frame(hello())));
        fx.iter()
            .find_map(|e| match e {
                Effect::Register { token, .. } => Some(*token),
                _ => None,
            })
            .expect("register effect")
    }

    /// Welcomed as SID_1 generation `generation`.
    pub fn welcomed(generation: u64) -> Self {
        let mut h = Self::new();
        let token = h.hello();
        h.input(Input::Registered {
            token,
            session_id: sid(SID_1),
            generation,
        });
        assert_eq!(h.s.phase(), Phase::Reconciling);
        h
    }

    /// Welcomed and reconciled with the given resume rows.
    pub fn ready_with(generation: u64, resume: Vec<wire::ResumeRow>) -> Self {
        let mut h = Self::welcomed(generation);
        h.input(Input::ReconcileWritten(wire::ReconcileResult {
            round: 1,
            resume,
            ..Default::default()
        }));
        assert_eq!(h.s.phase(), Phase::Ready);
        h
    }

    pub fn ready(generation: u64) -> Self {
        Self::ready_with(generation, Vec::new())
    }

    /// Sends a client event on the live session.
    pub fn event(&mut self, ev: wire::CommandEvent) -> Vec<Effect> {
        let (s, g) = self
            .s
            .live()
            .map(|(s, g)| (s.as_str().to_owned(), g))
            .unwrap();
        self.input(Input::Binary(frame(&s, g, Payload::CommandEvent(ev))))
    }
}

pub fn closes(fx: &[Effect]) -> Vec<wire::CloseReason> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Close { reason } => Some(*reason),
            _ => None,
        })
        .collect()
}

pub fn sent(fx: &[Effect]) -> Vec<&wire::Envelope> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Send { envelope, .. } => Some(envelope),
            _ => None,
        })
        .collect()
}

pub fn acks(fx: &[Effect]) -> Vec<(String, u64)> {
    sent(fx)
        .into_iter()
        .filter_map(|e| match &e.payload {
            Some(Payload::EventAck(a)) => Some((a.issue_uuid.clone(), a.durable_event_seq)),
            _ => None,
        })
        .collect()
}

pub fn delivered_events(fx: &[Effect]) -> Vec<(Uuid7, u64, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver(ClientMessage::CommandEvent(d)) => {
                Some((d.issue, d.event_seq, d.repeat))
            }
            _ => None,
        })
        .collect()
}

pub fn control_error_code(fx: &[Effect]) -> Option<i32> {
    sent(fx).into_iter().find_map(|e| match &e.payload {
        Some(Payload::ControlError(c)) => c.detail.as_ref().map(|d| d.code),
        _ => None,
    })
}

pub fn has_audit(fx: &[Effect], kind: rvbox_session::AuditKind) -> bool {
    fx.iter()
        .any(|e| matches!(e, Effect::Audit(a) if a.kind == kind))
}

/// One line per effect, for readable trace snapshots.
pub fn render(now: u64, fx: &[Effect]) -> Vec<String> {
    fx.iter()
        .map(|e| {
            let what = match e {
                Effect::Send { lane, envelope } => {
                    let p = envelope.payload.as_ref().map_or("unset", payload_name);
                    let extra = match &envelope.payload {
                        Some(Payload::ControlError(c)) => c
                            .detail
                            .as_ref()
                            .map(|d| format!(" code={} reason={:?}", d.code, d.reason))
                            .unwrap_or_default(),
                        Some(Payload::EventAck(a)) => {
                            format!(" issue={} seq={}", a.issue_uuid, a.durable_event_seq)
                        }
                        _ => String::new(),
                    };
                    format!(
                        "send {lane:?} {p} sid={:?} gen={}{extra}",
                        envelope.session_id, envelope.generation
                    )
                }
                Effect::Ping => "ping".into(),
                Effect::Close { reason } => format!("close {}", close_text(*reason)),
                Effect::Register { token, hello } => format!(
                    "register token={} client={} instance={} minor={}",
                    token.0, hello.client_id, hello.instance, hello.negotiated_minor
                ),
                Effect::Deliver(m) => format!("deliver {m:?}"),
                Effect::Audit(a) => format!("audit {:?}: {}", a.kind, a.detail),
                Effect::Metric(m) => match m.reason {
                    Some(r) => format!("metric {} reason={r}", m.name),
                    None => format!("metric {}", m.name),
                },
            };
            format!("t={now} {what}")
        })
        .collect()
}
