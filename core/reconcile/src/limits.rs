//! Named bounds of one reconciliation round (plan §6.4; conventions rule 9:
//! "put a limit on everything").
//!
//! Every bound below is checked before the data it guards is stored, so a
//! peer can never make the server hold more than these numbers of anything.

use rvbox_domain::limits::{MAX_ENVELOPE_BYTES, MAX_REASON_BYTES};

/// Ceiling: rows in one `ReconcileRequest` (agent.proto: "<= 10000 rows").
/// The server sends one row per non-terminal command of the client, so this
/// also bounds the server actions of one outcome.
pub const MAX_RECONCILE_ROWS: usize = 10_000;

/// Ceiling: tombstones in one complete snapshot. A client only reports
/// tombstones that match a requested row (agent.proto `ClientSnapshot`), so
/// there can never be more of them than requested rows.
pub const MAX_SNAPSHOT_TOMBSTONES: usize = MAX_RECONCILE_ROWS;

/// Ceiling: records (active plus terminal-but-unacknowledged) in one
/// complete snapshot.
///
/// Why 16,384: each record lands in at most one list of the
/// `ReconcileResult` (resume, terminate or discard), and that result must fit
/// in one envelope. A record is either one of the at most
/// [`MAX_RECONCILE_ROWS`] requested commands (a resume row, at most
/// [`RESUME_ROW_MAX_BYTES`] encoded) or one the server no longer lists (a
/// uuid string, [`UUID_ENTRY_BYTES`]): 10,000 resume rows plus 6,384 uuid
/// entries is about 913 KB, under [`MAX_RESULT_BYTES`] (a test builds the
/// worst case). Terminal-unacknowledged records are discarded by every
/// completed reconciliation, so reaching this bound would take thousands of
/// lost final `EventAck`s in one session; a client over it is refused as a
/// protocol violation rather than answered with a result no frame can carry.
pub const MAX_SNAPSHOT_RECORDS: usize = 16_384;

/// Ceiling: chunks of one snapshot. Enough for the most wasteful legal
/// split (one item per chunk plus an empty final chunk), and it bounds the
/// number of frames a client can make the server process for one round.
pub const MAX_SNAPSHOT_CHUNKS: usize = MAX_SNAPSHOT_RECORDS + MAX_SNAPSHOT_TOMBSTONES + 1;

/// Ceiling: encoded bytes of one `ClientSnapshot` chunk (agent.proto: "each
/// <= 1 MiB encoded"). The transport already refuses larger envelopes; this
/// is the core's own check.
pub const MAX_CHUNK_BYTES: usize = MAX_ENVELOPE_BYTES as usize;

/// Bytes an envelope needs around its payload (session id <= 64 bytes,
/// generation, oneof tag and length), rounded up generously.
pub const ENVELOPE_HEADROOM_BYTES: usize = 1024;

/// Ceiling: encoded bytes of a `ReconcileRequest` or `ReconcileResult`, so
/// either fits in one envelope with its header.
pub const MAX_RESULT_BYTES: usize = MAX_ENVELOPE_BYTES as usize - ENVELOPE_HEADROOM_BYTES;

/// Worst-case encoded size of one `ResumeRow` inside a `ReconcileResult`:
/// tag+len+36-byte uuid, two 10-byte varints with tags, a script offset of
/// at most 10 MiB (4-byte varint) with tag, plus the row's own tag and length.
pub const RESUME_ROW_MAX_BYTES: usize = (1 + 1 + 36) + 2 * (1 + 10) + (1 + 4) + (1 + 1);

/// Encoded size of one uuid entry of a result list: tag, length, 36 bytes.
pub const UUID_ENTRY_BYTES: usize = 1 + 1 + 36;

/// Ceiling: bytes of an incident summary (the domain's reason ceiling).
/// Summaries name phases, numbers and uuids, never payload bytes.
pub const MAX_INCIDENT_SUMMARY_BYTES: usize = MAX_REASON_BYTES as usize;
