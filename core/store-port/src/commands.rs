//! Commands as dispatch and reconciliation see them, and the server's
//! decisions on them.

use rvbox_domain::lifecycle::Lifecycle;

/// A command as dispatch and reconciliation see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandView {
    /// Command.
    pub issue_uuid: [u8; 16],
    /// Owning client.
    pub client_id: String,
    /// Public lifecycle.
    pub lifecycle: Lifecycle,
    /// Current revision.
    pub revision: u64,
    /// Immutable request hash.
    pub request_hash: [u8; 32],
    /// Last durable event sequence.
    pub last_event_seq: u64,
    /// Creation (wall ms).
    pub issue_time_ms: i64,
    /// Absolute queue expiry (wall ms); `None`: indefinite.
    pub queue_expiry_ms: Option<i64>,
    /// The derived "expired pending reconciliation" indicator.
    pub expired_pending: bool,
    /// Raw script size in bytes; 0 for command text.
    pub script_bytes: u64,
}

/// What the server knows of a command that is not among a client's
/// non-terminal commands (reconciliation, plan §6.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Knowledge {
    /// Stored and terminal.
    Terminal {
        /// Immutable request hash.
        request_hash: [u8; 32],
        /// Terminal lifecycle.
        lifecycle: Lifecycle,
        /// Last durable event sequence.
        last_event_seq: u64,
    },
    /// Reclaimed; only the replay tombstone remains.
    Tombstoned {
        /// Immutable request hash.
        request_hash: [u8; 32],
    },
    /// Never seen (or its tombstone left the FIFO).
    Missing,
}

/// A server decision that ends a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerTerminal {
    /// The queue TTL ran out before any dispatch.
    Expired,
    /// A permanent negative acceptance.
    Rejected,
    /// Killed before it was ever dispatched.
    Cancelled,
    /// An invariant failed (reconciliation: client state loss, stale server).
    Interrupted,
}

impl ServerTerminal {
    /// The terminal lifecycle this decision ends a command in.
    #[must_use]
    pub fn lifecycle(self) -> Lifecycle {
        match self {
            Self::Expired => Lifecycle::Expired,
            Self::Rejected => Lifecycle::Rejected,
            Self::Cancelled => Lifecycle::Cancelled,
            Self::Interrupted => Lifecycle::Interrupted,
        }
    }
}

/// One server-state decision of a reconciliation round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileWrite {
    /// dispatched -> queued (absent from a healthy complete snapshot).
    Requeue {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
    },
    /// Walk the legal public edges up to `to` (accepted or running): the
    /// client's record is further along.
    Advance {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
        /// Target lifecycle.
        to: Lifecycle,
    },
    /// End it `interrupted` (stale server or client state loss).
    Interrupt {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
    },
    /// The client had events `first_event_seq..=last_event_seq`
    /// acknowledged that the store no longer holds (a restore from an
    /// older backup): record the range as a `STORAGE_LOSS` truncation of
    /// unknown size, linked to the round's open incident for the command,
    /// and move the command's durable event_seq to `last_event_seq`. The
    /// store's durable event_seq must still be `first_event_seq - 1`.
    LostEvents {
        /// Command.
        issue: [u8; 16],
        /// Revision the decision saw.
        revision: u64,
        /// First lost event_seq.
        first_event_seq: u64,
        /// Last lost event_seq (the client's acknowledged one).
        last_event_seq: u64,
    },
}

/// Why a [`ReconcileWrite::LostEvents`] range is recorded lost (the
/// `output_truncations` reason, in every store).
pub const LOST_AT_RECONCILE_REASON: &str = "events the client had acknowledged are not in the server's store (restored from an older backup?); their size is unknown";

/// A [`ReconcileWrite::LostEvents`] range must start right after the
/// command's durable events and not be empty.
///
/// # Errors
/// `CONFLICT` naming the range and the durable event_seq.
pub fn check_lost_range(
    durable_event_seq: u64,
    first_event_seq: u64,
    last_event_seq: u64,
) -> Result<(), rvbox_domain::error::DomainError> {
    if first_event_seq != durable_event_seq.saturating_add(1) || last_event_seq < first_event_seq {
        return Err(rvbox_domain::error::DomainError::new(
            rvbox_domain::error::Code::Conflict,
            format!(
                "lost events {first_event_seq}..={last_event_seq} do not follow the durable event_seq {durable_event_seq}"
            ),
        ));
    }
    Ok(())
}
