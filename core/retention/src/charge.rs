//! The versioned, deterministic charge formula (plan §5.4, R-5.4-02, R-5.4-09).
//!
//! A stored item is charged `encoded_bytes + overhead(version, kind)`: its
//! compressed/encoded payload or segment length plus a fixed, conservative
//! allowance for the SQLite row and index entries (or file-system slack) it
//! needs. SQLite pages are never attributed after the fact.
//!
//! The store records the version next to every charged row and releases the row
//! with that same version. Changing any constant below therefore needs a new
//! version *and* a migration that recharges old rows; version 1 is never
//! reinterpreted.

use thiserror::Error;

/// The charge formula new rows are charged with.
pub const CHARGE_VERSION: u32 = 1;

/// Every charge version this build can compute (to release old rows exactly).
pub const SUPPORTED_CHARGE_VERSIONS: [u32; 1] = [1];

/// What a charged item is: selects its fixed overhead and its field maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChargeKind {
    /// The `commands` row (client spool: the command record).
    CommandRow,
    /// The Zstandard-compressed immutable execution-spec payload.
    SpecPayload,
    /// A script payload (or one appended part of it).
    ScriptPayload,
    /// One `stdin_writes` row with its compressed payload.
    StdinWrite,
    /// One non-output `command_events` row (lifecycle, diagnostics, ...).
    EventRow,
    /// One output record: the encoded chunk in its segment plus its event row.
    OutputRecord,
    /// One `output_segments` row plus the segment file's last partial block.
    SegmentFile,
    /// One `output_truncations` row (an `OutputTruncation` marker).
    TruncationRow,
    /// One `control_mutations` row with its bounded stable result.
    MutationRow,
    /// One audit record inside a compressed audit segment.
    AuditRecord,
    /// One `storage_incidents` row.
    IncidentRow,
    /// One compact command tombstone.
    TombstoneRow,
    /// Client only: a generated raw execution file while it exists.
    ExecutionFile,
}

impl ChargeKind {
    /// Every kind, in declaration order.
    pub const ALL: [ChargeKind; 13] = [
        ChargeKind::CommandRow,
        ChargeKind::SpecPayload,
        ChargeKind::ScriptPayload,
        ChargeKind::StdinWrite,
        ChargeKind::EventRow,
        ChargeKind::OutputRecord,
        ChargeKind::SegmentFile,
        ChargeKind::TruncationRow,
        ChargeKind::MutationRow,
        ChargeKind::AuditRecord,
        ChargeKind::IncidentRow,
        ChargeKind::TombstoneRow,
        ChargeKind::ExecutionFile,
    ];

    /// Stable snake_case name for logs and metric labels.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            ChargeKind::CommandRow => "command_row",
            ChargeKind::SpecPayload => "spec_payload",
            ChargeKind::ScriptPayload => "script_payload",
            ChargeKind::StdinWrite => "stdin_write",
            ChargeKind::EventRow => "event_row",
            ChargeKind::OutputRecord => "output_record",
            ChargeKind::SegmentFile => "segment_file",
            ChargeKind::TruncationRow => "truncation_row",
            ChargeKind::MutationRow => "mutation_row",
            ChargeKind::AuditRecord => "audit_record",
            ChargeKind::IncidentRow => "incident_row",
            ChargeKind::TombstoneRow => "tombstone_row",
            ChargeKind::ExecutionFile => "execution_file",
        }
    }
}

/// One SQLite page / file-system block: the slack an inline blob or a file can
/// leave unused in its last page. Charged once per blob or file.
const PAGE_SLACK: u64 = 4096;

/// Version 1 fixed overhead per kind, in bytes.
///
/// Each value is the worst-case encoded row (fixed columns at their maximum
/// width, a 16-byte UUID blob, a client id of up to 128 bytes, 32-byte
/// digests) plus every index entry the row carries (key + rowid + cell
/// header), rounded *up* with roughly 1.5x for B-tree pages that are only
/// partly full after splits. Blobs stored inline or in files add
/// one 4 KiB page of slack for their last partial page/block.
#[must_use]
pub const fn overhead_v1(kind: ChargeKind) -> u64 {
    match kind {
        // ~300 B row (uuid, client id <= 128 B, four timestamps, lifecycle,
        // revision, exit, last seq, retention status) + five index entries
        // (pk, (client, issue_time), (client, lifecycle, issue_time), queue
        // expiry, terminal time), two of them carrying the client id: ~700 B,
        // rounded up to 2 KiB for page fill.
        ChargeKind::CommandRow => 2048,
        // Column header, compression metadata and overflow-page chain of an
        // inline payload (4 B per 4 KiB page, up to 768 KiB = 768 B) + one
        // page of slack.
        ChargeKind::SpecPayload => 1024 + PAGE_SLACK,
        // `command_payloads` row (kind, raw/stored sizes, 32 B digest, segment
        // reference) + pk index + overflow chain up to 10 MiB (10 KiB) + one
        // page/block of slack.
        ChargeKind::ScriptPayload => 12 * 1024 + PAGE_SLACK,
        // (command, write_seq) row with sizes, 32 B checksum and intent
        // flags, its unique index, overflow chain for <= 256 KiB + slack.
        ChargeKind::StdinWrite => 768 + PAGE_SLACK,
        // ~100 B row (uuid, seq, two times, type, metadata header, 32 B
        // checksum) + the (command, event_seq) unique index entry: 256 B.
        ChargeKind::EventRow => 256,
        // Segment record framing (rvbox-segment: 128 B header + 4 B CRC
        // trailer = 132 B) + the output event's `command_events` row keyed by
        // (command, event_seq) (<= 256 B with page fill), rounded up.
        ChargeKind::OutputRecord => 512,
        // `output_segments` row (ordinal, offsets, seq range, totals,
        // checksum, created time) + index + the segment file's inode share
        // and its last partially filled block.
        ChargeKind::SegmentFile => 512 + PAGE_SLACK,
        // Range/byte totals, source, recorded time + index entry.
        ChargeKind::TruncationRow => 256,
        // 16 B request id unique key, owner, method/target, 32 B request
        // hash, assigned seq/revision, stable result header + two indexes.
        ChargeKind::MutationRow => 512,
        // Segment record framing (132 B) + the audit frame's fixed fields
        // (time, transport, principal, ids, action, outcome, code, digest)
        // inside a compressed audit segment.
        ChargeKind::AuditRecord => 256,
        // Incident row (uuid, times, state, scope, flags) + state and scope
        // index entries.
        ChargeKind::IncidentRow => 512,
        // 16 B uuid unique key + 32 B request hash + client id <= 128 B +
        // times ~200 B, unique index + FIFO order index.
        ChargeKind::TombstoneRow => 384,
        // Inode, directory entry and the last partially filled block.
        ChargeKind::ExecutionFile => 512 + PAGE_SLACK,
    }
}

/// The charge formula could not produce a number.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChargeError {
    /// A row carries a version this build does not know: never guess.
    #[error("unknown charge version {version} (this build knows 1..={CHARGE_VERSION})")]
    UnknownVersion {
        /// The version asked for.
        version: u32,
    },
    /// `encoded_bytes` plus the overhead does not fit in a u64.
    #[error("charge overflows: {encoded_bytes} encoded bytes of {kind:?}")]
    Overflow {
        /// The kind charged.
        kind: ChargeKind,
        /// The encoded length given.
        encoded_bytes: u64,
    },
}

/// Charged bytes of one item under the given formula version.
///
/// New rows use [`CHARGE_VERSION`]; release recomputes with the version stored
/// on the row (or uses the charged value stored with it).
pub fn charge(version: u32, kind: ChargeKind, encoded_bytes: u64) -> Result<u64, ChargeError> {
    let overhead = match version {
        1 => overhead_v1(kind),
        _ => return Err(ChargeError::UnknownVersion { version }),
    };
    encoded_bytes
        .checked_add(overhead)
        .ok_or(ChargeError::Overflow {
            kind,
            encoded_bytes,
        })
}
