//! What one retention and maintenance pass did (plan §5.4).

/// What one maintenance pass did (counters only; no payload, no paths).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// Oldest resolved incidents deleted beyond the kept number.
    pub incidents_trimmed: u64,
    /// Stale evictions rolled forward by the sweeper.
    pub rolled_forward: u64,
    /// Pending file deletions completed by the sweeper.
    pub files_swept: u64,
    /// Output rotations applied (window/total due, and pressure).
    pub rotations: u64,
    /// Of those, pressure rotations of active commands.
    pub pressure_rotations: u64,
    /// Whole commands evicted under a quota tier.
    pub evicted_quota: u64,
    /// Whole commands reclaimed by terminal age.
    pub evicted_aged: u64,
    /// Evictions that failed (each has a `FAILED_EVICTION` incident).
    pub evictions_failed: u64,
    /// Candidates skipped because an unresolved incident concerns them.
    pub skipped_dirty: u64,
    /// Charged bytes still missing under a client tier after everything
    /// (new unreserved data is refused until it is freed).
    pub owner_shortfall: u64,
    /// Charged bytes still missing under the server-wide tier.
    pub global_shortfall: u64,
    /// Audit segments rotated.
    pub audit_rotated: u64,
    /// Audit records moved from the outbox into audit segments.
    pub audit_flushed: u64,
    /// Idle clients deleted.
    pub clients_pruned: u64,
    /// Done fleet runs deleted (their commands gone, or past retention).
    pub fleet_runs_pruned: u64,
    /// Closed terminals removed with their recordings after the
    /// terminal retention.
    pub terminals_pruned: u64,
}

/// What one slice of the background scrub did (counters only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScrubReport {
    /// Segments read back and checked.
    pub segments_verified: u64,
    /// Of those, segments found damaged (each has an incident).
    pub segments_damaged: u64,
    /// Orphan segment files removed.
    pub orphans_removed: u64,
    /// Clients whose charged total was recounted.
    pub clients_recounted: u64,
    /// Recounts that differed from the counters (each repaired, with an
    /// incident).
    pub counter_mismatches: u64,
    /// This slice finished a cycle.
    pub cycle_completed: bool,
    /// Nothing to do until the next cycle is due.
    pub idle: bool,
}
