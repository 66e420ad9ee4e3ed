//! What the cases share: ids, requests, and the operations that bring a
//! command or a session where a case needs it, each through the port.

use std::sync::atomic::{AtomicU64, Ordering};

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store_port::audit::Caller;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store_port::ops::{Backend, Completion, OpResult, PortError, StoreOp};
use rvbox_store_port::sessions::{ClientRecord, Registration, SessionFence};

/// The wall clock every case runs at.
pub const NOW: i64 = 1_800_000_000_000;

static NEXT: AtomicU64 = AtomicU64::new(1);

/// A fresh UUIDv7 (time `NOW`, a process-wide counter in the random bits).
#[must_use]
pub fn new_id() -> [u8; 16] {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut b = [0u8; 16];
    let ms = u64::try_from(NOW).unwrap_or(0);
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6] = 0x70;
    b[8] = 0x80;
    b[9..16].copy_from_slice(&n.to_be_bytes()[1..]);
    b
}

/// The canonical text of an id.
#[must_use]
pub fn text(id: &[u8; 16]) -> String {
    rvbox_domain::ids::Uuid7::from_bytes("id", *id)
        .map(|u| u.to_string())
        .unwrap_or_default()
}

/// The canonical text of any UUID (an instance id need not be v7).
#[must_use]
pub fn any_uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// A `RunCommand` request for `client` running `command`, id `id`.
#[must_use]
pub fn run_request(id: &[u8; 16], client: &str, command: &str) -> wire::RunCommandRequest {
    wire::RunCommandRequest {
        request_id: text(id),
        client_id: client.into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(command.into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    }
}

/// Performs one operation at `NOW`.
pub fn op(b: &mut dyn Backend, op: StoreOp) -> OpResult {
    b.perform(NOW, op)
}

/// The refusal code of a result, if it is one.
#[must_use]
pub fn refused(r: &OpResult) -> Option<rvbox_domain::error::Code> {
    match r {
        Err(PortError::Refused(e)) => Some(e.code()),
        _ => None,
    }
}

/// Creates a queued command of `client`.
pub fn run(b: &mut dyn Backend, client: &str) -> [u8; 16] {
    let id = new_id();
    let r = op(
        b,
        StoreOp::RunCommand {
            request: run_request(&id, client, "uptime"),
            caller: Caller::local(),
        },
    );
    assert!(matches!(r, Ok(Completion::RunCommand(_))), "{r:?}");
    id
}

/// The client's record.
pub fn client(b: &mut dyn Backend, client: &str) -> Option<ClientRecord> {
    match op(
        b,
        StoreOp::LoadClient {
            client_id: client.into(),
        },
    ) {
        Ok(Completion::Client(c)) => c,
        other => panic!("LoadClient: {other:?}"),
    }
}

/// A registration of `client` by `instance` as the decision saw the
/// client's record: its generation and live session.
#[must_use]
pub fn registration(
    client_id: &str,
    instance: [u8; 16],
    seen: Option<&ClientRecord>,
) -> Registration {
    Registration {
        client_id: client_id.into(),
        instance_id: instance,
        expected_generation: seen.map_or(0, |c| c.generation),
        session_id: new_id(),
        fence: seen.and_then(|c| c.live.map(|l| l.session_id)),
        consume_grant: None,
        capabilities: wire::Capabilities {
            software_version: "1.0.0".into(),
            max_running: 4,
            max_queued: 10,
            ..Default::default()
        },
        cwd_policy: None,
        labels: String::new(),
    }
}

/// The instance every case's client registers as, unless it says otherwise.
pub const INSTANCE: [u8; 16] = [9; 16];

/// Registers a new live session of `client` (fencing its live one), as
/// the server does for a connection; returns its fence.
pub fn live_session(b: &mut dyn Backend, client_id: &str) -> SessionFence {
    let seen = client(b, client_id);
    let reg = registration(client_id, INSTANCE, seen.as_ref());
    let session_id = reg.session_id;
    let r = op(b, StoreOp::Register(reg));
    assert!(matches!(r, Ok(Completion::Registered { .. })), "{r:?}");
    SessionFence { session_id }
}

/// One command as the port answers it.
pub fn view(b: &mut dyn Backend, issue: &[u8; 16]) -> CommandView {
    match op(b, StoreOp::CommandView { issue: *issue }) {
        Ok(Completion::View(v)) => v,
        other => panic!("CommandView: {other:?}"),
    }
}

/// Dispatches a queued command on `session`.
pub fn dispatch(b: &mut dyn Backend, issue: &[u8; 16], session: SessionFence) {
    let revision = view(b, issue).revision;
    let r = op(
        b,
        StoreOp::Dispatch {
            issue: *issue,
            revision,
            write: true,
            session,
        },
    );
    assert!(matches!(r, Ok(Completion::Spec(_))), "{r:?}");
}

/// Records a dispatched command's acceptance on `session`.
pub fn accept(b: &mut dyn Backend, issue: &[u8; 16], session: SessionFence) {
    let revision = view(b, issue).revision;
    let r = op(
        b,
        StoreOp::RecordAccepted {
            issue: *issue,
            revision,
            resolved_shell: wire::ShellType::Sh as i32,
            session,
        },
    );
    assert!(matches!(r, Ok(Completion::Done)), "{r:?}");
}

/// A lifecycle event of `issue`.
#[must_use]
pub fn lifecycle_event(issue: &[u8; 16], seq: u64, to: Lifecycle) -> EventAppend {
    let change = wire::LifecycleChange {
        lifecycle: to.to_wire() as i32,
        revision: 1,
        exit_result: None,
        reason: String::new(),
    };
    EventAppend {
        issue_uuid: *issue,
        event_seq: seq,
        observed_ms: NOW,
        body: EventBody::Lifecycle {
            to,
            exit_code: None,
            exit_signal: None,
            encoded: prost::Message::encode_to_vec(&change),
        },
        session: None,
    }
}

/// An output event of `issue`: `raw` compressed as the client sends it.
#[must_use]
pub fn output_event(issue: &[u8; 16], seq: u64, raw: &[u8]) -> EventAppend {
    EventAppend {
        issue_uuid: *issue,
        event_seq: seq,
        observed_ms: NOW,
        body: EventBody::Output {
            stream: rvbox_segment::Stream::Stdout,
            compression: rvbox_segment::Compression::Zstd,
            raw_len: u32::try_from(raw.len()).unwrap(),
            stored: zstd::bulk::compress(raw, 1).unwrap(),
        },
        session: None,
    }
}

/// The outcomes of an append.
#[must_use]
pub fn outcomes(r: &OpResult) -> Vec<EventOutcome> {
    match r {
        Ok(Completion::Appended(a)) => a.outcomes.clone(),
        other => panic!("AppendEvents: {other:?}"),
    }
}

/// A command of `client` moved to `running` on a live session (its
/// running event is sequence 1); returns the command and the session.
pub fn running(b: &mut dyn Backend, client_id: &str) -> ([u8; 16], SessionFence) {
    let issue = run(b, client_id);
    let session = live_session(b, client_id);
    dispatch(b, &issue, session);
    accept(b, &issue, session);
    let mut ev = lifecycle_event(&issue, 1, Lifecycle::Running);
    ev.session = Some(session);
    let r = op(b, StoreOp::AppendEvents { events: vec![ev] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    (issue, session)
}
