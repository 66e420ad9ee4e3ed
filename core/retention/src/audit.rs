//! Audit segment rotation (plan §5.4 items 5, 6; R-5.4-17..19).
//!
//! Audit (and resolved incident summaries) live in compressed segments under
//! their own byte budget. Only complete (sealed) segments rotate, oldest
//! first, as a prefix: the active segment stops the scan. Unresolved
//! incidents are rows the store never puts in rotatable segments.

/// One audit segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditSegment {
    /// Segment ordinal: smaller is older.
    pub ordinal: u32,
    /// Charged bytes of the segment.
    pub charged: u64,
    /// Complete segments may rotate; the active one never does.
    pub sealed: bool,
    /// Time of the newest record in the segment.
    pub newest_unix_ms: i64,
}

/// Audit segments to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRotation {
    /// Ordinals to drop, oldest first.
    pub drop: Vec<u32>,
    /// Charged bytes they free.
    pub freed: u64,
    /// Whether `used - freed + incoming <= budget` afterwards.
    pub fits: bool,
}

/// Oldest complete audit segments to drop so that the audit bytes (the sum of
/// the segments' charges) plus `incoming` fit `budget`, plus every leading
/// segment whose newest record is at least `retention_ms` old
/// (`retention_ms == 0`, the default, disables the age trigger but not the
/// byte budget). Pass `incoming = 0` for a maintenance pass.
#[must_use]
pub fn plan_audit_rotation(
    segments: &[AuditSegment],
    budget: u64,
    retention_ms: u64,
    now_unix_ms: i64,
    incoming: u64,
) -> AuditRotation {
    let mut ordered: Vec<&AuditSegment> = segments.iter().collect();
    ordered.sort_by_key(|s| s.ordinal);
    let used = ordered
        .iter()
        .fold(0u64, |acc, s| acc.saturating_add(s.charged));
    let over = |freed: u64| used.saturating_sub(freed).saturating_add(incoming) > budget;
    let aged = |s: &AuditSegment| {
        retention_ms > 0
            && i128::from(s.newest_unix_ms).saturating_add(i128::from(retention_ms))
                <= i128::from(now_unix_ms)
    };
    let mut drop = Vec::new();
    let mut freed = 0u64;
    for segment in ordered {
        if !segment.sealed || !(over(freed) || aged(segment)) {
            break;
        }
        drop.push(segment.ordinal);
        freed = freed.saturating_add(segment.charged);
    }
    AuditRotation {
        drop,
        freed,
        fits: !over(freed),
    }
}
