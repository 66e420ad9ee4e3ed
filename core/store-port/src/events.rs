//! Sequenced client events and what the append path made of them
//! (plan §5.3).

use std::collections::BTreeMap;

use rvbox_domain::error::DomainError;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_segment::{Compression, Stream};

/// `CommandEvent.body` field numbers (rvbox.v1), stored as `body_kind`.
pub mod body_kind {
    /// `OutputChunk`.
    pub const OUTPUT: u8 = 4;
    /// `LifecycleChange`.
    pub const LIFECYCLE: u8 = 5;
    /// `OutputTruncation`.
    pub const TRUNCATION: u8 = 6;
    /// `OutputIncomplete`.
    pub const INCOMPLETE: u8 = 7;
    /// `SignalResult`.
    pub const SIGNAL_RESULT: u8 = 8;
    /// `StdinAck`.
    pub const STDIN_ACK: u8 = 9;
    /// `Diagnostics`.
    pub const DIAGNOSTICS: u8 = 10;
    /// `ProfileResult`.
    pub const PROFILE_RESULT: u8 = 11;
}

/// The body of one event, as the session layer hands it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventBody {
    /// Output bytes, exactly as the client stored and sent them.
    Output {
        /// Stdout or stderr.
        stream: Stream,
        /// How `stored` is encoded.
        compression: Compression,
        /// Declared raw length (at most 64 KiB).
        raw_len: u32,
        /// The bytes as sent.
        stored: Vec<u8>,
    },
    /// A lifecycle change; `encoded` is the encoded `LifecycleChange`.
    Lifecycle {
        /// The new lifecycle.
        to: Lifecycle,
        /// Exit code of a process that exited.
        exit_code: Option<i32>,
        /// Terminating signal number of a process that died of one.
        exit_signal: Option<i32>,
        /// Encoded body, kept for history.
        encoded: Vec<u8>,
    },
    /// Any other body (truncation, incomplete, signal result, stdin ack,
    /// diagnostics, profile result): `kind` is one of [`body_kind`].
    Other {
        /// Body field number.
        kind: u8,
        /// Encoded body.
        encoded: Vec<u8>,
    },
}

/// One sequenced client event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventAppend {
    /// Command.
    pub issue_uuid: [u8; 16],
    /// Wire sequence (contiguous from 1).
    pub event_seq: u64,
    /// Client-observed wall time.
    pub observed_ms: i64,
    /// Body.
    pub body: EventBody,
    /// The session it arrived on; `None` only for events not received
    /// from a client (tools and tests).
    pub session: Option<crate::sessions::SessionFence>,
}

/// What happened to one event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventOutcome {
    /// Durable now.
    Appended,
    /// An identical repeat of a durable event: nothing stored.
    Duplicate,
    /// Refused; nothing stored. `PROTOCOL_ERROR` refusals mean the session
    /// sending it must be fenced; `QUOTA_EXCEEDED` is transient.
    Refused(DomainError),
}

/// The result of one batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppendReport {
    /// One outcome per event, in batch order.
    pub outcomes: Vec<EventOutcome>,
    /// Per command touched: the highest contiguous durable sequence, the
    /// value of a cumulative `EventAck`.
    pub acked: BTreeMap<[u8; 16], u64>,
}
