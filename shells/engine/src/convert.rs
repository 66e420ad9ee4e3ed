//! Conversions between the store's rows, the cores' inputs and wire
//! messages.

use prost::Message as _;
use rusqlite_free::spec_of;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::{InstanceId, Uuid7};
use rvbox_domain::lifecycle::{Lifecycle, Revision};
use rvbox_domain::limits::MAX_EXECUTION_SPEC_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_reconcile::{ServerCommand, ServerKnown, Source};
use rvbox_segment::{Compression, Stream};
use rvbox_session::{ClientRecord, LiveSession, PendingClaim, SessionId, TakeoverGrant};
use rvbox_store::Store;
use rvbox_store::commands::{CommandView, Knowledge};
use rvbox_store::events::{EventAppend, EventBody, body_kind};

fn session_id_of(key: &[u8; 16]) -> Option<SessionId> {
    let text: String = key.iter().map(|x| format!("{x:02x}")).collect();
    SessionId::parse(&text).ok()
}

/// The session core's view of a stored client record.
pub(crate) fn client_record(r: Option<&rvbox_store::sessions::ClientRecord>) -> ClientRecord {
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
        phase: crate::phase_of(v.lifecycle),
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
pub(crate) fn knowledge(k: &Knowledge) -> ServerKnown {
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
    let body = match &ev.body {
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
    })
}

fn other(kind: u8, encoded: Vec<u8>) -> EventBody {
    EventBody::Other { kind, encoded }
}

/// The `Dispatch` frame of a stored command.
///
/// # Errors
/// When the stored spec cannot be read back.
pub(crate) fn dispatch_frame(
    store: &Store,
    v: &CommandView,
    generation: u64,
) -> Result<wire::Dispatch, String> {
    let spec = spec_of(store, &v.issue_uuid)?;
    Ok(wire::Dispatch {
        issue_uuid: crate::uuid_text(&v.issue_uuid),
        generation,
        revision: v.revision,
        request_hash: v.request_hash.to_vec(),
        spec: Some(spec),
        queue_expiry_time: v.queue_expiry_ms.map(|ms| prost_types::Timestamp {
            seconds: ms.div_euclid(1000),
            nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
        }),
    })
}

mod rusqlite_free {
    //! Reads the stored spec through the store's read connection.
    use super::{MAX_EXECUTION_SPEC_BYTES, Store, wire};
    use prost::Message as _;

    pub(crate) fn spec_of(store: &Store, issue: &[u8; 16]) -> Result<wire::ExecutionSpec, String> {
        let (z, raw_len): (Vec<u8>, i64) = store
            .db()
            .query_row(
                "SELECT spec_zstd, spec_raw_len FROM commands WHERE issue_uuid = ?1",
                [issue.as_slice()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(|e| format!("read spec: {e}"))?;
        let cap = usize::try_from(raw_len)
            .ok()
            .filter(|n| (*n as u64) <= MAX_EXECUTION_SPEC_BYTES)
            .ok_or("stored spec length out of bounds")?;
        let raw = zstd::bulk::decompress(&z, cap).map_err(|e| format!("decompress spec: {e}"))?;
        wire::ExecutionSpec::decode(raw.as_slice()).map_err(|e| format!("decode spec: {e}"))
    }
}
