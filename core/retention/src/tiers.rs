//! Storage tiers, field maxima and the usage the shell measures (plan §4.3
//! defaults, §5.4, §7.2).

use rvbox_domain::limits;
use thiserror::Error;

use crate::charge::{ChargeKind, overhead_v1};

/// Worst-case Zstandard output for `raw` input bytes (`ZSTD_COMPRESSBOUND`):
/// incompressible data grows slightly, so encoded maxima are derived from it.
#[must_use]
pub const fn zstd_bound(raw: u64) -> u64 {
    const SMALL: u64 = 128 * 1024;
    let small_margin = if raw < SMALL { (SMALL - raw) >> 11 } else { 0 };
    raw.saturating_add(raw >> 8).saturating_add(small_margin)
}

/// Encoded bytes of one event's metadata: room for four reason-sized text
/// fields (detail, reason, summary, diagnostics text) around its fixed fields.
pub const EVENT_METADATA_MAX_BYTES: u64 = 4 * limits::MAX_REASON_BYTES;

/// Encoded bytes of a command row's own columns besides the spec: the client
/// id, fixed columns and one bounded reason text.
pub const COMMAND_ROW_MAX_BYTES: u64 = limits::MAX_REASON_BYTES + 4 * limits::KIB;

/// Encoded bytes of fixed columns in small rows (tombstones, truncations).
pub const SMALL_ROW_MAX_BYTES: u64 = limits::KIB;

/// Hard maximum of one *charged* item per kind (checked first by Reserve).
///
/// Values are charged bytes (encoded maximum + the kind's v1 overhead), so a
/// field at exactly its protocol ceiling passes and one byte more is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMax {
    /// [`ChargeKind::CommandRow`].
    pub command_row: u64,
    /// [`ChargeKind::SpecPayload`]: 768 KiB spec, compressed worst case.
    pub spec_payload: u64,
    /// [`ChargeKind::ScriptPayload`]: 10 MiB script, compressed worst case.
    pub script_payload: u64,
    /// [`ChargeKind::StdinWrite`]: one 256 KiB write, compressed worst case.
    pub stdin_write: u64,
    /// [`ChargeKind::EventRow`].
    pub event_row: u64,
    /// [`ChargeKind::OutputRecord`]: one 64 KiB raw chunk, compressed worst
    /// case, plus its framing.
    pub output_record: u64,
    /// [`ChargeKind::SegmentFile`]: the segment row itself (its records are
    /// charged as output records).
    pub segment_file: u64,
    /// [`ChargeKind::TruncationRow`]: fixed fields + a 4 KiB reason.
    pub truncation_row: u64,
    /// [`ChargeKind::MutationRow`]: fixed fields + a 4 KiB stable result.
    pub mutation_row: u64,
    /// [`ChargeKind::AuditRecord`]: may carry the command text, so bounded by
    /// a compressed spec.
    pub audit_record: u64,
    /// [`ChargeKind::IncidentRow`]: summary and operator note, 4 KiB each.
    pub incident_row: u64,
    /// [`ChargeKind::TombstoneRow`].
    pub tombstone_row: u64,
    /// [`ChargeKind::ExecutionFile`]: the raw script plus a spec-sized
    /// generated wrapper (uncompressed on disk).
    pub execution_file: u64,
}

const fn charged_v1(kind: ChargeKind, encoded: u64) -> u64 {
    encoded.saturating_add(overhead_v1(kind))
}

impl FieldMax {
    /// The v1 field maxima, derived from `rvbox_domain::limits` ceilings.
    #[must_use]
    pub const fn v1() -> FieldMax {
        use limits::{
            KIB, MAX_EXECUTION_SPEC_BYTES, MAX_INCIDENT_NOTE_BYTES, MAX_RAW_CHUNK_BYTES,
            MAX_REASON_BYTES, MAX_SCRIPT_BYTES, MAX_STDIN_WRITE_BYTES,
        };
        FieldMax {
            command_row: charged_v1(ChargeKind::CommandRow, COMMAND_ROW_MAX_BYTES),
            spec_payload: charged_v1(
                ChargeKind::SpecPayload,
                zstd_bound(MAX_EXECUTION_SPEC_BYTES),
            ),
            script_payload: charged_v1(ChargeKind::ScriptPayload, zstd_bound(MAX_SCRIPT_BYTES)),
            stdin_write: charged_v1(ChargeKind::StdinWrite, zstd_bound(MAX_STDIN_WRITE_BYTES)),
            event_row: charged_v1(ChargeKind::EventRow, EVENT_METADATA_MAX_BYTES),
            output_record: charged_v1(ChargeKind::OutputRecord, zstd_bound(MAX_RAW_CHUNK_BYTES)),
            segment_file: charged_v1(ChargeKind::SegmentFile, SMALL_ROW_MAX_BYTES),
            truncation_row: charged_v1(
                ChargeKind::TruncationRow,
                SMALL_ROW_MAX_BYTES + MAX_REASON_BYTES,
            ),
            mutation_row: charged_v1(ChargeKind::MutationRow, KIB + MAX_REASON_BYTES),
            audit_record: charged_v1(
                ChargeKind::AuditRecord,
                KIB + zstd_bound(MAX_EXECUTION_SPEC_BYTES),
            ),
            incident_row: charged_v1(
                ChargeKind::IncidentRow,
                KIB + MAX_REASON_BYTES + MAX_INCIDENT_NOTE_BYTES,
            ),
            tombstone_row: charged_v1(ChargeKind::TombstoneRow, SMALL_ROW_MAX_BYTES),
            execution_file: charged_v1(
                ChargeKind::ExecutionFile,
                MAX_SCRIPT_BYTES + MAX_EXECUTION_SPEC_BYTES,
            ),
        }
    }

    /// The maximum charged bytes of one item of `kind`.
    #[must_use]
    pub const fn get(&self, kind: ChargeKind) -> u64 {
        match kind {
            ChargeKind::CommandRow => self.command_row,
            ChargeKind::SpecPayload => self.spec_payload,
            ChargeKind::ScriptPayload => self.script_payload,
            ChargeKind::StdinWrite => self.stdin_write,
            ChargeKind::EventRow => self.event_row,
            ChargeKind::OutputRecord => self.output_record,
            ChargeKind::SegmentFile => self.segment_file,
            ChargeKind::TruncationRow => self.truncation_row,
            ChargeKind::MutationRow => self.mutation_row,
            ChargeKind::AuditRecord => self.audit_record,
            ChargeKind::IncidentRow => self.incident_row,
            ChargeKind::TombstoneRow => self.tombstone_row,
            ChargeKind::ExecutionFile => self.execution_file,
        }
    }
}

/// The byte tiers Reserve enforces, for the server store or the client spool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tiers {
    /// Total charged bytes per command, closeout reserve included (32 MiB).
    pub command_total: u64,
    /// Headroom held inside each active command for terminal/loss closeout
    /// metadata (64 KiB).
    pub closeout_reserve: u64,
    /// Rolling output window per command, charged segment bytes (10 MiB).
    pub command_output_window: u64,
    /// Per client (server) or per client daemon (client spool) (256 MiB).
    pub per_owner_total: u64,
    /// Server-wide (4 GiB); on the client equal to `per_owner_total`.
    pub global_total: u64,
    /// Refuse any allocation that would leave less free file-system space
    /// (256 MiB server, 64 MiB client).
    pub free_space_floor: u64,
    /// Hard per-kind maximum of one charged item.
    pub field_max: FieldMax,
}

/// The tiers contradict each other (plan §4.3 item 8).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TiersError {
    /// The closeout reserve must be below the command total.
    #[error("closeout reserve {reserve} is not below the command total {command_total}")]
    ReserveNotBelowCommand {
        /// Closeout reserve.
        reserve: u64,
        /// Command total.
        command_total: u64,
    },
    /// The output window must fit in the command total minus the reserve.
    #[error("output window {window} exceeds command total {command_total} minus reserve {reserve}")]
    WindowTooLarge {
        /// Output window.
        window: u64,
        /// Command total.
        command_total: u64,
        /// Closeout reserve.
        reserve: u64,
    },
    /// Command total <= per-owner total <= global total.
    #[error(
        "tiers out of order: command {command_total}, owner {owner_total}, global {global_total}"
    )]
    TierInversion {
        /// Command total.
        command_total: u64,
        /// Per-owner total.
        owner_total: u64,
        /// Global total.
        global_total: u64,
    },
}

impl Tiers {
    /// Server store defaults (plan §4.3).
    #[must_use]
    pub const fn server_defaults() -> Tiers {
        Tiers {
            command_total: limits::DEFAULT_COMMAND_TOTAL_BYTES,
            closeout_reserve: limits::DEFAULT_CLOSEOUT_RESERVE_BYTES,
            command_output_window: limits::DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
            per_owner_total: limits::DEFAULT_SERVER_PER_CLIENT_BYTES,
            global_total: limits::DEFAULT_SERVER_TOTAL_BYTES,
            free_space_floor: limits::DEFAULT_SERVER_FREE_SPACE_FLOOR_BYTES,
            field_max: FieldMax::v1(),
        }
    }

    /// Client spool defaults (plan §4.3, §7.2): one daemon is both the owner
    /// and the global tier.
    #[must_use]
    pub const fn client_defaults() -> Tiers {
        Tiers {
            command_total: limits::DEFAULT_COMMAND_TOTAL_BYTES,
            closeout_reserve: limits::DEFAULT_CLOSEOUT_RESERVE_BYTES,
            command_output_window: limits::DEFAULT_COMMAND_OUTPUT_WINDOW_BYTES,
            per_owner_total: limits::DEFAULT_CLIENT_DAEMON_BYTES,
            global_total: limits::DEFAULT_CLIENT_DAEMON_BYTES,
            free_space_floor: limits::DEFAULT_CLIENT_FREE_SPACE_FLOOR_BYTES,
            field_max: FieldMax::v1(),
        }
    }

    /// Check the cross-tier invariants the decisions rely on.
    pub fn validate(&self) -> Result<(), TiersError> {
        if self.closeout_reserve >= self.command_total {
            return Err(TiersError::ReserveNotBelowCommand {
                reserve: self.closeout_reserve,
                command_total: self.command_total,
            });
        }
        if self.command_output_window > self.command_total.saturating_sub(self.closeout_reserve) {
            return Err(TiersError::WindowTooLarge {
                window: self.command_output_window,
                command_total: self.command_total,
                reserve: self.closeout_reserve,
            });
        }
        if self.command_total > self.per_owner_total || self.per_owner_total > self.global_total {
            return Err(TiersError::TierInversion {
                command_total: self.command_total,
                owner_total: self.per_owner_total,
                global_total: self.global_total,
            });
        }
        Ok(())
    }
}

/// Charged bytes already used, as persisted by the store (or spool) counters,
/// plus the free space the shell measured.
///
/// The command, owner and global counters include the closeout headroom each
/// active command still holds, so ordinary writes can never eat into it at any
/// tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Charged bytes of this command, its held closeout headroom included
    /// (0 when the item is not command-owned).
    pub command: u64,
    /// Part of `command` that is closeout headroom not yet consumed.
    pub held_closeout: u64,
    /// Charged bytes of the owner: the client (server) or the daemon (client).
    pub owner: u64,
    /// Charged bytes of the whole store or spool.
    pub global: u64,
    /// Free file-system bytes as measured by the shell.
    pub free_space: u64,
}
