//! Conversions between the store port's values, the cores' inputs and
//! wire messages.

use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::{InstanceId, Uuid7};
use rvbox_domain::lifecycle::{CommandState, Lifecycle, Phase, Revision};
use rvbox_domain::limits::MAX_REASON_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_reconcile::{ServerCommand, ServerKnown, Source};
use rvbox_segment::{Compression, Stream};
use rvbox_session::{ClientRecord, LiveSession, PendingClaim, SessionId, TakeoverGrant};
use rvbox_store_port::commands::{CommandView, Knowledge};
use rvbox_store_port::events::{EventAppend, EventBody, body_kind};

/// Canonical text of a UUID's bytes.
#[must_use]
pub fn uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h.get(0..8).unwrap_or_default(),
        h.get(8..12).unwrap_or_default(),
        h.get(12..16).unwrap_or_default(),
        h.get(16..20).unwrap_or_default(),
        h.get(20..32).unwrap_or_default()
    )
}

/// The internal phase of a public lifecycle.
#[must_use]
pub fn phase_of(l: Lifecycle) -> Phase {
    match l {
        Lifecycle::Queued => Phase::Queued,
        Lifecycle::Dispatched => Phase::Dispatched,
        Lifecycle::Accepted => Phase::Accepted,
        Lifecycle::Running => Phase::Running,
        Lifecycle::Succeeded => Phase::Succeeded,
        Lifecycle::Failed => Phase::Failed,
        Lifecycle::Terminated => Phase::Terminated,
        Lifecycle::Interrupted => Phase::Interrupted,
        Lifecycle::Expired => Phase::Expired,
        Lifecycle::Rejected => Phase::Rejected,
        Lifecycle::Cancelled => Phase::Cancelled,
    }
}

/// A stored command's state as the dispatch core takes it.
#[must_use]
pub fn state_of(v: &CommandView) -> CommandState {
    CommandState::from_parts(phase_of(v.lifecycle), Revision(v.revision))
}

fn session_id_of(key: &[u8; 16]) -> Option<SessionId> {
    let text: String = key.iter().map(|x| format!("{x:02x}")).collect();
    SessionId::parse(&text).ok()
}

/// The session core's view of a stored client record.
pub(crate) fn client_record(r: Option<&rvbox_store_port::sessions::ClientRecord>) -> ClientRecord {
    let Some(r) = r else {
        return ClientRecord::default();
    };
    ClientRecord {
        generation: r.generation,
        instance: r.instance_id.map(InstanceId::from_random_bytes),
        live: r.live.and_then(|l| {
            Some(LiveSession {
                session_id: session_id_of(&l.session_id)?,
                generation: l.generation,
            })
        }),
        pending_claim: r.pending_claim.map(|(i, ms)| PendingClaim {
            instance: InstanceId::from_random_bytes(i),
            observed_wall_ms: u64::try_from(ms).unwrap_or(0),
        }),
        grant: r.grant.map(|g| TakeoverGrant {
            instance: InstanceId::from_random_bytes(g.instance_id),
            expires_wall_ms: u64::try_from(g.expires_ms).unwrap_or(0),
            consumed: false,
        }),
    }
}

/// A non-terminal stored command as a reconciliation row.
pub(crate) fn server_command(v: &CommandView) -> Option<ServerCommand> {
    Some(ServerCommand {
        issue_uuid: Uuid7::from_bytes("issue_uuid", v.issue_uuid).ok()?,
        request_hash: RequestHash(v.request_hash),
        phase: phase_of(v.lifecycle),
        revision: Revision(v.revision),
        durable_event_seq: v.last_event_seq,
        source: if v.script_bytes == 0 {
            Source::CommandText
        } else {
            Source::Script {
                size_bytes: v.script_bytes,
                // the client launches only a committed script; before
                // that, the upload resumes from the client's prefix
                upload_committed: v.lifecycle == Lifecycle::Running,
            }
        },
    })
}

/// Store knowledge as the reconciliation core takes it.
#[must_use]
pub fn knowledge(k: &Knowledge) -> ServerKnown {
    match k {
        Knowledge::Terminal {
            request_hash,
            lifecycle,
            last_event_seq,
        } => ServerKnown::Terminal {
            request_hash: RequestHash(*request_hash),
            lifecycle: *lifecycle,
            durable_event_seq: *last_event_seq,
        },
        Knowledge::Tombstoned { request_hash } => ServerKnown::Tombstoned {
            request_hash: RequestHash(*request_hash),
        },
        Knowledge::Missing => ServerKnown::Missing,
    }
}

fn observed_ms(t: Option<&prost_types::Timestamp>) -> i64 {
    t.map_or(0, |t| {
        t.seconds
            .saturating_mul(1000)
            .saturating_add(i64::from(t.nanos / 1_000_000))
    })
}

/// A wire event as the store's append input.
///
/// # Errors
/// `PROTOCOL_ERROR` naming the field for an event that cannot be stored.
pub fn event_append(ev: &wire::CommandEvent) -> Result<EventAppend, DomainError> {
    let issue =
        Uuid7::parse("command_event.issue_uuid", &ev.issue_uuid).map_err(DomainError::from)?;
    check_reason(ev)?;
    let body = match &ev.body {
        Some(Body::Output(o)) if u64::from(o.stored_length) != o.payload.len() as u64 => {
            return Err(DomainError::new(
                Code::ProtocolError,
                format!(
                    "output stored_length {} but the payload has {} bytes",
                    o.stored_length,
                    o.payload.len()
                ),
            )
            .with_field("command_event.output.stored_length"));
        }
        Some(Body::Output(o)) => EventBody::Output {
            stream: match o.stream {
                1 => Stream::Stdout,
                2 => Stream::Stderr,
                _ => {
                    return Err(DomainError::new(Code::ProtocolError, "output stream unset")
                        .with_field("command_event.output.stream"));
                }
            },
            compression: Compression::Zstd,
            raw_len: o.raw_length,
            stored: o.payload.clone(),
        },
        Some(Body::Lifecycle(l)) => {
            let to = Lifecycle::from_wire(l.lifecycle).map_err(|_| {
                DomainError::new(Code::ProtocolError, "lifecycle unset or unknown")
                    .with_field("command_event.lifecycle.lifecycle")
            })?;
            let exit = l.exit_result.as_ref();
            EventBody::Lifecycle {
                to,
                exit_code: exit.and_then(|e| e.exit_code),
                exit_signal: exit.and_then(|e| e.signal_number),
                encoded: l.encode_to_vec(),
            }
        }
        Some(Body::Truncation(b)) => other(body_kind::TRUNCATION, b.encode_to_vec()),
        Some(Body::Incomplete(b)) => other(body_kind::INCOMPLETE, b.encode_to_vec()),
        Some(Body::SignalResult(b)) => other(body_kind::SIGNAL_RESULT, b.encode_to_vec()),
        Some(Body::StdinAck(b)) => other(body_kind::STDIN_ACK, b.encode_to_vec()),
        Some(Body::Diagnostics(b)) => other(body_kind::DIAGNOSTICS, b.encode_to_vec()),
        Some(Body::ProfileResult(b)) => other(body_kind::PROFILE_RESULT, b.encode_to_vec()),
        None => {
            return Err(DomainError::new(Code::ProtocolError, "event body unset")
                .with_field("command_event.body"));
        }
    };
    Ok(EventAppend {
        issue_uuid: *issue.as_bytes(),
        event_seq: ev.event_seq,
        observed_ms: observed_ms(ev.observed_time.as_ref()),
        body,
        session: None,
    })
}

/// Reason text inside an event body is bounded (plan §4.3: 4 KiB).
fn check_reason(ev: &wire::CommandEvent) -> Result<(), DomainError> {
    let (field, reason) = match &ev.body {
        Some(Body::Lifecycle(b)) => ("command_event.lifecycle.reason", &b.reason),
        Some(Body::Truncation(b)) => ("command_event.truncation.reason", &b.reason),
        Some(Body::Incomplete(b)) => ("command_event.incomplete.reason", &b.reason),
        Some(Body::SignalResult(b)) => ("command_event.signal_result.reason", &b.reason),
        Some(Body::StdinAck(b)) => ("command_event.stdin_ack.reason", &b.reason),
        _ => return Ok(()),
    };
    if reason.len() as u64 > MAX_REASON_BYTES {
        return Err(DomainError::new(
            Code::ProtocolError,
            format!(
                "reason of {} bytes exceeds {MAX_REASON_BYTES}",
                reason.len()
            ),
        )
        .with_field(field));
    }
    Ok(())
}

fn other(kind: u8, encoded: Vec<u8>) -> EventBody {
    EventBody::Other { kind, encoded }
}

/// The `Dispatch` frame of a stored command at `revision`.
pub(crate) fn dispatch_frame(
    v: &CommandView,
    revision: u64,
    generation: u64,
    spec: wire::ExecutionSpec,
) -> wire::Dispatch {
    wire::Dispatch {
        issue_uuid: uuid_text(&v.issue_uuid),
        generation,
        revision,
        request_hash: v.request_hash.to_vec(),
        spec: Some(spec),
        queue_expiry_time: v.queue_expiry_ms.map(|ms| prost_types::Timestamp {
            seconds: ms.div_euclid(1000),
            nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(body: Body) -> wire::CommandEvent {
        wire::CommandEvent {
            issue_uuid: "01a3185c-5000-7663-a2e9-348cca6cee29".into(),
            event_seq: 2,
            observed_time: None,
            body: Some(body),
        }
    }

    #[test]
    fn a_stored_length_that_is_not_the_payload_length_is_refused_naming_the_field() {
        let e = event_append(&ev(Body::Output(wire::OutputChunk {
            stream: 1,
            raw_length: 10,
            stored_length: 11,
            payload: vec![0; 10],
        })))
        .unwrap_err();
        assert_eq!(e.code(), Code::ProtocolError);
        assert_eq!(e.field(), "command_event.output.stored_length");
        assert!(
            event_append(&ev(Body::Output(wire::OutputChunk {
                stream: 1,
                raw_length: 10,
                stored_length: 10,
                payload: vec![0; 10],
            })))
            .is_ok()
        );
    }

    #[test]
    fn reason_text_is_capped_at_four_kib() {
        let change = |n: usize| {
            ev(Body::Lifecycle(wire::LifecycleChange {
                lifecycle: wire::Lifecycle::Failed as i32,
                revision: 1,
                exit_result: None,
                reason: "x".repeat(n),
            }))
        };
        assert!(event_append(&change(4096)).is_ok());
        let e = event_append(&change(4097)).unwrap_err();
        assert_eq!(e.field(), "command_event.lifecycle.reason");
        let e = event_append(&ev(Body::SignalResult(wire::SignalResult {
            reason: "y".repeat(5000),
            ..Default::default()
        })))
        .unwrap_err();
        assert_eq!(e.field(), "command_event.signal_result.reason");
    }
}
