//! Tombstone FIFO cap (plan §5.4, R-5.4-28..30).
//!
//! How the store applies it: in the *same* transaction that inserts (or
//! retains) a command tombstone, it counts the rows after the insert, calls
//! [`tombstones_to_drop`], and deletes that many oldest tombstones by
//! insertion order. Insert and trim commit together, so there is never a
//! moment where a tombstone was deleted before its replacement existed (no
//! delete/insert gap), and the count never exceeds the cap after commit.

use rvbox_domain::limits::MAX_TOMBSTONES;

/// How many oldest tombstones to delete after an insert brought the count to
/// `count_after_insert`.
///
/// `cap` is clamped to `1..=MAX_TOMBSTONES`: configuration may lower the cap
/// but not raise it, and the tombstone just inserted always survives.
#[must_use]
pub fn tombstones_to_drop(count_after_insert: u64, cap: u64) -> u64 {
    let cap = cap.clamp(1, MAX_TOMBSTONES);
    count_after_insert.saturating_sub(cap)
}
