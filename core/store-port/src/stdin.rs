//! Operator stdin (plan §5.2 `stdin_writes`, §9.1 `AppendStdin` and
//! `CloseStdin`, R-7.6-05).
//!
//! An append or a close is made durable as numbered writes before any
//! frame leaves; the server then sends the writes that are still pending,
//! in `write_seq` order, within the in-flight windows, and the client's
//! `StdinAck` events settle each one as written or discarded.

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;

/// Raw stdin bytes one command may have waiting (durable on the server
/// and not yet acknowledged by its client): an append past it is refused
/// with `CAPACITY_EXHAUSTED` until the client catches up.
pub const MAX_PENDING_STDIN_BYTES: u64 = 8 * 1024 * 1024;
/// Stdin writes one command may have waiting (see
/// [`MAX_PENDING_STDIN_BYTES`]).
pub const MAX_PENDING_STDIN_WRITES: u64 = 256;

/// The stored answer of an `AppendStdin` or a `CloseStdin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StdinResponse {
    /// `AppendStdin`.
    Append(wire::AppendStdinResponse),
    /// `CloseStdin`.
    Close(wire::CloseStdinResponse),
}

/// The outcome of an `AppendStdin` or a `CloseStdin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StdinOutcome {
    /// The response, with the delivery known now (a replay reads it again).
    pub response: StdinResponse,
    /// True when this was a replay of an earlier request.
    pub replayed: bool,
    /// The command's client (where the writes go).
    pub client_id: String,
    /// The command's lifecycle: writes go now to a running command (see
    /// [`deliverable`]).
    pub lifecycle: Lifecycle,
}

/// Pending writes of one command, read for sending.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StdinWrites {
    /// The writes, in `write_seq` order.
    pub writes: Vec<wire::StdinWrite>,
    /// More pending writes follow the last one returned.
    pub more: bool,
}

/// Whether the pending writes of a command in `lifecycle` go to its
/// client now: only once its process runs (the client writes into a
/// running process; earlier writes wait for its `running` event, and an
/// ended command's writes are discarded).
#[must_use]
pub fn deliverable(lifecycle: Lifecycle) -> bool {
    lifecycle == Lifecycle::Running
}
