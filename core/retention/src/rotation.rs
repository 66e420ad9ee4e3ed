//! Command output window rotation (plan §5.4 item 2, §7.2; R-5.4-12, R-5.4-14).
//!
//! Only the oldest *prefix* of sealed, unpinned output segments is ever
//! rotated: rotation stops at the first active (unsealed) or pinned segment,
//! so each plan removes one contiguous event range and needs exactly one
//! `OutputTruncation` marker. Essential state lives in rows, not in output
//! segments, so it is never rolled.

use crate::tiers::{Tiers, Usage};

/// One output segment of a command, as the store (or spool) knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentUsage {
    /// Segment ordinal: smaller is older.
    pub ordinal: u32,
    /// Charged bytes of the segment: its file/row charge plus its records.
    pub charged: u64,
    /// Sealed segments are complete; the active one never rotates.
    pub sealed: bool,
    /// Smallest event sequence stored in the segment.
    pub first_seq: u64,
    /// Largest event sequence stored in the segment.
    pub last_seq: u64,
    /// Must not be removed: not yet acknowledged to the client (server), or
    /// assigned and inside the unacknowledged send window (client).
    pub pinned: bool,
}

/// Which segments to rotate, and whether the goal is then met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotationPlan {
    /// Ordinals to remove, oldest first (empty when nothing rotates).
    pub rotate: Vec<u32>,
    /// Inclusive event range the single truncation marker records.
    pub removed_seq_range: Option<(u64, u64)>,
    /// Charged bytes the rotated segments free.
    pub removed_charged: u64,
    /// Whether the goal holds after the rotation (and its marker).
    pub fits: bool,
}

impl RotationPlan {
    fn nothing(fits: bool) -> RotationPlan {
        RotationPlan {
            rotate: Vec::new(),
            removed_seq_range: None,
            removed_charged: 0,
            fits,
        }
    }
}

/// The rotatable prefix, oldest first: sealed and unpinned, stopping at the
/// first segment that is not.
fn rotatable_prefix(segments: &[SegmentUsage]) -> Vec<&SegmentUsage> {
    let mut ordered: Vec<&SegmentUsage> = segments.iter().collect();
    ordered.sort_by_key(|s| s.ordinal);
    ordered
        .into_iter()
        .take_while(|s| s.sealed && !s.pinned)
        .collect()
}

/// Build a plan from the first `n` rotatable segments.
fn plan_of(prefix: &[&SegmentUsage], removed: u64, fits: bool) -> RotationPlan {
    let first = prefix.iter().map(|s| s.first_seq.min(s.last_seq)).min();
    let last = prefix.iter().map(|s| s.last_seq.max(s.first_seq)).max();
    RotationPlan {
        rotate: prefix.iter().map(|s| s.ordinal).collect(),
        removed_seq_range: first.zip(last),
        removed_charged: removed,
        fits,
    }
}

/// Decide which oldest sealed, unpinned segments to rotate so that an
/// incoming output item of `incoming` charged bytes fits both the command's
/// output window and its total (with the held closeout headroom untouched,
/// the same test Reserve applies to ordinary output).
///
/// `usage.command` is the command counter (held headroom included); the
/// output window usage is the sum of the segments' charges. When anything is
/// rotated, the truncation marker of `marker_charged` bytes is counted
/// against the command total. When the item cannot fit even after rotating
/// every eligible segment, nothing is rotated and `fits` is false: the shell
/// refuses the output (server) or records it as lost (client).
#[must_use]
pub fn plan_output_rotation(
    tiers: &Tiers,
    usage: &Usage,
    segments: &[SegmentUsage],
    incoming: u64,
    marker_charged: u64,
) -> RotationPlan {
    let output_used = segments
        .iter()
        .fold(0u64, |acc, s| acc.saturating_add(s.charged));
    let fits = |removed: u64, marker: u64| {
        let window = output_used.saturating_sub(removed).saturating_add(incoming);
        let command = usage
            .command
            .saturating_sub(removed)
            .saturating_add(marker)
            .saturating_add(incoming);
        window <= tiers.command_output_window && command <= tiers.command_total
    };
    if fits(0, 0) {
        return RotationPlan::nothing(true);
    }
    let prefix = rotatable_prefix(segments);
    let mut removed = 0u64;
    for (n, segment) in prefix.iter().enumerate() {
        removed = removed.saturating_add(segment.charged);
        if fits(removed, marker_charged) {
            return plan_of(prefix.get(..=n).unwrap_or(&[]), removed, true);
        }
    }
    RotationPlan::nothing(false)
}

/// Rotate a command's oldest eligible output to relieve owner/global
/// pressure from active data alone (plan §5.4 item 3): remove the rotatable
/// prefix until it frees `need` bytes net of its `marker_charged` marker.
///
/// Unlike [`plan_output_rotation`] it returns the longest useful prefix even
/// when `need` cannot be met (`fits` false), so the shell can continue with
/// the next active command and then reject new unreserved state.
#[must_use]
pub fn plan_pressure_rotation(
    segments: &[SegmentUsage],
    need: u64,
    marker_charged: u64,
) -> RotationPlan {
    if need == 0 {
        return RotationPlan::nothing(true);
    }
    let prefix = rotatable_prefix(segments);
    let mut removed = 0u64;
    let mut best: Option<(usize, u64)> = None;
    for (n, segment) in prefix.iter().enumerate() {
        removed = removed.saturating_add(segment.charged);
        let net = removed.saturating_sub(marker_charged);
        if net > 0 {
            best = Some((n, removed));
        }
        if net >= need {
            return plan_of(prefix.get(..=n).unwrap_or(&[]), removed, true);
        }
    }
    match best {
        Some((n, removed)) => plan_of(prefix.get(..=n).unwrap_or(&[]), removed, false),
        None => RotationPlan::nothing(false),
    }
}
