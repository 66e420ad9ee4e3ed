//! RVBox storage accounting decisions (plan §5.4, §7.2).
//!
//! Owns the storage accounting of the server store *and* of the client spool
//! (the same contract, plan §5.4 "Reuse the same contract in the client
//! spool"): the versioned charge formula, the one Reserve decision across the
//! field-maximum, command, closeout-reserve, owner, global and free-space
//! tiers with its Release counterpart, command output window rotation,
//! whole-command eviction and age selection, the tombstone FIFO cap, audit
//! segment rotation, and watermark hysteresis.
//!
//! Must never: do I/O, read a clock or use randomness. Time arrives as
//! `now_unix_ms` arguments and every decision is a value; the store shell
//! applies it inside its SQLite transactions (the client spool inside its
//! own), all or nothing.

pub mod audit;
pub mod charge;
pub mod eviction;
pub mod hysteresis;
pub mod reserve;
pub mod rotation;
pub mod tiers;
pub mod tombstone;

pub use audit::{AuditRotation, AuditSegment, plan_audit_rotation};
pub use charge::{
    CHARGE_VERSION, ChargeError, ChargeKind, SUPPORTED_CHARGE_VERSIONS, charge, overhead_v1,
};
pub use eviction::{
    Candidate, Need, OwnerNeed, Selection, WholeCommands, select_aged, select_evictions,
};
pub use hysteresis::{Hysteresis, LossMode, Transition, WatermarkError};
pub use reserve::{
    Class, CounterUnderflow, Refusal, Reservation, Tier, release, release_audit, release_closeout,
    release_command, reserve, reserve_audit,
};
pub use rotation::{RotationPlan, SegmentUsage, plan_output_rotation, plan_pressure_rotation};
pub use tiers::{FieldMax, Tiers, TiersError, Usage, zstd_bound};
pub use tombstone::tombstones_to_drop;
