//! Every v1 default and hard ceiling (plan §4.3), as named constants.
//!
//! A *ceiling* is part of the wire contract: configuration may lower it but
//! never raise it, so no peer is ever asked to accept more than v1 promises.
//! A *default* is the compiled value a configuration key takes when the file
//! and the flags leave it out. Durations are in milliseconds (`*_MS`), sizes
//! in bytes (`*_BYTES`), counts are plain numbers.

/// One KiB (1,024 bytes).
pub const KIB: u64 = 1024;
/// One MiB.
pub const MIB: u64 = 1024 * KIB;
/// One GiB.
pub const GIB: u64 = 1024 * MIB;

/// One second in milliseconds.
pub const SECOND_MS: u64 = 1000;
/// One minute in milliseconds.
pub const MINUTE_MS: u64 = 60 * SECOND_MS;
/// One day in milliseconds.
pub const DAY_MS: u64 = 24 * 60 * MINUTE_MS;

// ---- protocol ceilings (plan §4.1, §4.3) ---------------------------------

/// Ceiling: a decoded agent envelope (one WebSocket binary message).
pub const MAX_ENVELOPE_BYTES: u64 = MIB;
/// Ceiling: a serialized `ExecutionSpec`.
pub const MAX_EXECUTION_SPEC_BYTES: u64 = 768 * KIB;
/// Ceiling: a decoded control gRPC request.
pub const MAX_CONTROL_REQUEST_BYTES: u64 = 16 * MIB;
/// Ceiling: a JSON-RPC HTTP request body.
pub const MAX_JSONRPC_BODY_BYTES: u64 = 24 * MIB;
/// Ceiling: raw bytes in one output chunk.
pub const MAX_RAW_CHUNK_BYTES: u64 = 64 * KIB;
/// Ceiling: raw size of an uploaded script.
pub const MAX_SCRIPT_BYTES: u64 = 10 * MIB;
/// Ceiling: protocol detail, rejection reason and summary text.
pub const MAX_REASON_BYTES: u64 = 4 * KIB;
/// Ceiling: an operator's incident acknowledgement note.
pub const MAX_INCIDENT_NOTE_BYTES: u64 = 4 * KIB;
/// Ceiling: bytes of one script chunk on the wire (keeps a chunk frame well
/// under the envelope ceiling together with its header fields).
pub const MAX_SCRIPT_CHUNK_BYTES: u64 = 256 * KIB;
/// Ceiling: bytes of one stdin write on the wire; the control API splits
/// larger appends into several writes.
pub const MAX_STDIN_WRITE_BYTES: u64 = 256 * KIB;
/// Ceiling: bytes of one `AppendStdin`; the server splits them into writes
/// of at most [`MAX_STDIN_WRITE_BYTES`].
pub const MAX_STDIN_APPEND_BYTES: u64 = MIB;
/// Ceiling: a client id (configured hostname text), in ASCII characters.
pub const MAX_CLIENT_ID_LEN: usize = 128;
/// Ceiling: environment overrides in one `ExecutionSpec`.
pub const MAX_ENV_OVERRIDES: usize = 1024;

// ---- heartbeat, reconnect, takeover (plan §6.2, §6.3, §7.1) --------------

/// Default: send a Ping after this long without an inbound frame.
pub const DEFAULT_HEARTBEAT_IDLE_MS: u64 = 10 * SECOND_MS;
/// Default: close a session after this long without an inbound frame.
pub const DEFAULT_LIVENESS_TIMEOUT_MS: u64 = 30 * SECOND_MS;
/// Default: a session must complete reconciliation (the client's complete
/// snapshot and the durable `ReconcileResult`) this long after its
/// welcome, or it is closed (`RECONCILE_TIMEOUT`).
pub const DEFAULT_RECONCILE_TIMEOUT_MS: u64 = 2 * MINUTE_MS;
/// Default: first reconnect backoff cap (full jitter below it).
pub const DEFAULT_RECONNECT_INITIAL_MS: u64 = SECOND_MS;
/// Default: largest reconnect backoff cap.
pub const DEFAULT_RECONNECT_MAX_MS: u64 = 60 * SECOND_MS;
/// Default: a session must stay up this long before backoff resets.
pub const DEFAULT_RECONNECT_STABLE_RESET_MS: u64 = 60 * SECOND_MS;
/// Default: lifetime of a one-shot live-conflict takeover grant.
pub const DEFAULT_TAKEOVER_GRANT_TTL_MS: u64 = 5 * MINUTE_MS;

// ---- queues (plan §4.3, §6.4) ---------------------------------------------

/// Default: commands a client runs at once.
pub const DEFAULT_CLIENT_MAX_RUNNING: u64 = 16;
/// Default: accepted commands a client holds waiting for a running slot.
pub const DEFAULT_CLIENT_MAX_QUEUED: u64 = 100;
/// Default: commands the server holds queued for one client.
pub const DEFAULT_SERVER_QUEUE_PER_CLIENT: u64 = 1_000;
/// Default: commands the server holds queued across all clients.
pub const DEFAULT_SERVER_QUEUE_TOTAL: u64 = 10_000;
/// Default: queue TTL until server-confirmed acceptance; 0 means indefinite.
pub const DEFAULT_QUEUE_TTL_MS: u64 = 15 * MINUTE_MS;
/// Default: first backoff after a transient dispatch rejection.
pub const DEFAULT_DISPATCH_RETRY_INITIAL_MS: u64 = SECOND_MS;
/// Default: largest backoff after repeated transient dispatch rejections.
pub const DEFAULT_DISPATCH_RETRY_MAX_MS: u64 = 60 * SECOND_MS;

// ---- storage tiers (plan §4.3, §5.4) --------------------------------------

/// Default: compressed rolling output window per command.
pub const DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES: u64 = 10 * MIB;
/// Floor of the server's per-command output window: a whole active
/// segment (which never rotates; it seals at [`DEFAULT_SEGMENT_SEAL_BYTES`])
/// and an incoming 64 KiB chunk that does not compress must fit in it, or
/// rotation could never make room for the chunk and the command would be
/// refused its output for ever.
pub const MIN_COMMAND_OUTPUT_WINDOW_BYTES: u64 = 512 * KIB;
/// Default: total stored bytes per command (all kinds).
pub const DEFAULT_COMMAND_TOTAL_BYTES: u64 = 32 * MIB;
/// Default: stored command bytes per client on the server.
pub const DEFAULT_SERVER_PER_CLIENT_BYTES: u64 = 256 * MIB;
/// Default: stored command bytes per client daemon (client spool).
pub const DEFAULT_CLIENT_DAEMON_BYTES: u64 = 256 * MIB;
/// Default: server-wide stored command bytes.
pub const DEFAULT_SERVER_TOTAL_BYTES: u64 = 4 * GIB;
/// Default: reserve inside each accepted command's quota for closeout metadata.
pub const DEFAULT_CLOSEOUT_RESERVE_BYTES: u64 = 64 * KIB;
/// Default: age after which a terminal command is reclaimed; 0 disables.
pub const DEFAULT_TERMINAL_RETENTION_MS: u64 = 30 * DAY_MS;
/// Default: audit storage budget (quota-only rotation).
pub const DEFAULT_AUDIT_BYTES: u64 = 100 * MIB;
/// Default: audit age retention; 0 (the default) disables age rotation.
pub const DEFAULT_AUDIT_RETENTION_MS: u64 = 0;
/// Default interval between two cycles of the server store's background
/// scrub (re-verification of sealed segments, orphan sweep, recount): a day.
pub const DEFAULT_SCRUB_INTERVAL_MS: u64 = 24 * 60 * 60 * 1000;
/// Default: server command tombstone FIFO length.
pub const DEFAULT_SERVER_TOMBSTONES: u64 = 1_000_000;
/// Default: client command tombstone FIFO length.
pub const DEFAULT_CLIENT_TOMBSTONES: u64 = 1_000_000;
/// Ceiling: tombstone FIFO length (both sides).
pub const MAX_TOMBSTONES: u64 = 1_000_000;
/// Default: server emergency filesystem free-space floor.
pub const DEFAULT_SERVER_FREE_SPACE_FLOOR_BYTES: u64 = 256 * MIB;
/// Default: client emergency filesystem free-space floor.
pub const DEFAULT_CLIENT_FREE_SPACE_FLOOR_BYTES: u64 = 64 * MIB;
/// Default: an active segment is sealed at this size.
pub const DEFAULT_SEGMENT_SEAL_BYTES: u64 = 256 * KIB;
/// Default: longest a group commit waits to batch more appends.
pub const DEFAULT_GROUP_COMMIT_MAX_DELAY_MS: u64 = 2;
/// Default: most appends in one group commit. 512 rather than 256: a
/// fleet run's first output creates one segment file per command, and a
/// larger group shares its directory syncs and commit among more of them
/// (docs/benchmarks.md, "Fleet fan-out").
pub const DEFAULT_GROUP_COMMIT_MAX_BATCH: u64 = 512;
/// Ceiling: most appends in one group commit.
pub const MAX_GROUP_COMMIT_BATCH: u64 = 4096;

// ---- flow control (plan §4.3, §6.1, §7.2) ---------------------------------

/// Default: raw-output backlog high watermark per command.
pub const DEFAULT_COMMAND_HIGH_WATERMARK_BYTES: u64 = MIB;
/// Default: raw-output backlog low watermark per command.
pub const DEFAULT_COMMAND_LOW_WATERMARK_BYTES: u64 = 256 * KIB;
/// Default: raw-output backlog high watermark per client daemon.
pub const DEFAULT_CLIENT_HIGH_WATERMARK_BYTES: u64 = 8 * MIB;
/// Default: raw-output backlog low watermark per client daemon.
pub const DEFAULT_CLIENT_LOW_WATERMARK_BYTES: u64 = 4 * MIB;
/// Default: server-wide ingress backlog high watermark.
pub const DEFAULT_SERVER_HIGH_WATERMARK_BYTES: u64 = 64 * MIB;
/// Default: server-wide ingress backlog low watermark.
pub const DEFAULT_SERVER_LOW_WATERMARK_BYTES: u64 = 32 * MIB;
/// Ceiling and default: unacknowledged send window per command.
pub const DEFAULT_COMMAND_SEND_WINDOW_BYTES: u64 = MIB;
/// Floor of every send window: one whole event (a 64 KiB output chunk that
/// does not compress, with its envelope) must fit in it, or the sender
/// could never send that event.
pub const MIN_SEND_WINDOW_BYTES: u64 = 128 * KIB;
/// Ceiling and default: unacknowledged send window per session.
pub const DEFAULT_SESSION_SEND_WINDOW_BYTES: u64 = 8 * MIB;

// ---- client execution (plan §7.4, §7.5) -----------------------------------

/// Default: grace after the root process exits for the tree and pipes to drain.
pub const DEFAULT_DRAIN_GRACE_MS: u64 = 5 * SECOND_MS;
/// Default: grace between TERM and KILL when RVBox stops a process tree.
pub const DEFAULT_KILL_GRACE_MS: u64 = 10 * SECOND_MS;
/// Default: diagnostics sampling interval.
pub const DEFAULT_DIAGNOSTICS_INTERVAL_MS: u64 = 15 * SECOND_MS;
/// Default: no observable progress for this long sets `suspected_hung`.
pub const DEFAULT_SUSPECTED_HUNG_MS: u64 = 10 * MINUTE_MS;

// ---- control plane (plan §9) ----------------------------------------------

/// Default: page size when a list request gives none.
pub const DEFAULT_PAGE_SIZE: u64 = 100;
/// Ceiling: largest page size a list request may ask for.
pub const MAX_PAGE_SIZE: u64 = 1_000;
/// Default: bytes returned by one `GetOutput` page.
pub const DEFAULT_OUTPUT_PAGE_BYTES: u64 = MIB;
/// Ceiling: bytes one `GetOutput` page may ask for.
pub const MAX_OUTPUT_PAGE_BYTES: u64 = 4 * MIB;
/// Default JSON-RPC bind address (the listener itself is off by default).
pub const DEFAULT_JSONRPC_LISTEN: &str = "127.0.0.1:6900";
