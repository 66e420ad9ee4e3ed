//! Per-command event sequence rules (plan §4.2, §7.1, §7.2).
//!
//! Wire `event_seq` values are contiguous from 1 per command: the client
//! assigns them only when an entry enters the send window, and a gap in
//! output is itself a sequenced `OutputTruncation` event, so a sequence is
//! never skipped. A repeat of an already durable sequence is harmless when
//! its immutable content is identical and a protocol error (the session is
//! fenced, history is not rewritten) when it differs.

use thiserror::Error;

/// What to do with an incoming event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next sequence: persist it, then acknowledge.
    Append,
    /// An identical repeat of a durable event: acknowledge again, store nothing.
    Duplicate,
}

/// A sequencing violation; each one is a protocol error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SeqError {
    /// Sequence 0 is never assigned.
    #[error("event_seq 0 is not a valid sequence (sequences start at 1)")]
    Zero,
    /// The sequence skips ahead of the next expected one.
    #[error("event_seq {got} skips ahead: the next expected sequence is {expected}")]
    Gap {
        /// Next expected sequence.
        expected: u64,
        /// Sequence received.
        got: u64,
    },
    /// A repeat whose content differs from the durable event.
    #[error("event_seq {seq} was already stored with different content")]
    ConflictingDuplicate {
        /// The repeated sequence.
        seq: u64,
    },
    /// A repeat of a sequence below the retained range whose content can no
    /// longer be compared, and the caller asked for strictness.
    #[error("event_seq {seq} is below the retained range and cannot be compared")]
    Unverifiable {
        /// The repeated sequence.
        seq: u64,
    },
}

/// Classifies `incoming` against `last_durable` (0 when nothing is stored).
///
/// `stored_digest` is the immutable-content digest of the durable event with
/// the same sequence when `incoming <= last_durable` (`None` when it was
/// removed by retention); `incoming_digest` is the digest of the new one.
///
/// # Errors
/// [`SeqError`] for sequence 0, a gap, a conflicting duplicate, or a repeat
/// that can no longer be compared.
pub fn check_event_seq(
    last_durable: u64,
    incoming: u64,
    stored_digest: Option<&[u8; 32]>,
    incoming_digest: &[u8; 32],
) -> Result<SeqVerdict, SeqError> {
    if incoming == 0 {
        return Err(SeqError::Zero);
    }
    if incoming <= last_durable {
        return match stored_digest {
            Some(d) if d == incoming_digest => Ok(SeqVerdict::Duplicate),
            Some(_) => Err(SeqError::ConflictingDuplicate { seq: incoming }),
            None => Err(SeqError::Unverifiable { seq: incoming }),
        };
    }
    let expected = last_durable.saturating_add(1);
    if incoming == expected {
        Ok(SeqVerdict::Append)
    } else {
        Err(SeqError::Gap {
            expected,
            got: incoming,
        })
    }
}

/// A removed event range declared by truncation metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SeqRange {
    /// First removed sequence.
    pub first: u64,
    /// Last removed sequence (inclusive).
    pub last: u64,
}

/// A refused truncation range.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RangeError {
    /// `first` is 0 or greater than `last`.
    #[error("truncation range {first}..={last} is empty or starts at 0")]
    Empty {
        /// First sequence.
        first: u64,
        /// Last sequence.
        last: u64,
    },
    /// The range reaches events that do not exist yet.
    #[error("truncation range ends at {last}, beyond the last stored sequence {limit}")]
    BeyondLog {
        /// Last sequence of the range.
        last: u64,
        /// Highest sequence it may cover.
        limit: u64,
    },
    /// The range overlaps one already recorded.
    #[error("truncation range {first}..={last} overlaps a recorded range")]
    Overlap {
        /// First sequence.
        first: u64,
        /// Last sequence.
        last: u64,
    },
}

/// Validates a declared removed range against the log: non-empty, within
/// `1..=limit`, and disjoint from every already recorded range.
///
/// # Errors
/// [`RangeError`] naming the range.
pub fn check_truncation_range(
    range: SeqRange,
    limit: u64,
    recorded: &[SeqRange],
) -> Result<(), RangeError> {
    let SeqRange { first, last } = range;
    if first == 0 || first > last {
        return Err(RangeError::Empty { first, last });
    }
    if last > limit {
        return Err(RangeError::BeyondLog { last, limit });
    }
    if recorded.iter().any(|r| r.first <= last && first <= r.last) {
        return Err(RangeError::Overlap { first, last });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: [u8; 32] = [1; 32];
    const B: [u8; 32] = [2; 32];

    #[test]
    fn next_duplicate_conflict_gap() {
        assert_eq!(check_event_seq(0, 1, None, &A), Ok(SeqVerdict::Append));
        assert_eq!(check_event_seq(5, 6, None, &A), Ok(SeqVerdict::Append));
        assert_eq!(
            check_event_seq(5, 3, Some(&A), &A),
            Ok(SeqVerdict::Duplicate)
        );
        assert_eq!(
            check_event_seq(5, 3, Some(&A), &B),
            Err(SeqError::ConflictingDuplicate { seq: 3 })
        );
        assert_eq!(
            check_event_seq(5, 7, None, &A),
            Err(SeqError::Gap {
                expected: 6,
                got: 7
            })
        );
        assert_eq!(check_event_seq(5, 0, None, &A), Err(SeqError::Zero));
        assert_eq!(
            check_event_seq(5, 2, None, &A),
            Err(SeqError::Unverifiable { seq: 2 })
        );
        assert!(check_event_seq(u64::MAX, u64::MAX, Some(&A), &A).is_ok());
    }

    #[test]
    fn truncation_ranges() {
        let recorded = [SeqRange { first: 3, last: 5 }];
        assert!(check_truncation_range(SeqRange { first: 1, last: 2 }, 10, &recorded).is_ok());
        assert!(check_truncation_range(SeqRange { first: 6, last: 10 }, 10, &recorded).is_ok());
        assert_eq!(
            check_truncation_range(SeqRange { first: 5, last: 6 }, 10, &recorded),
            Err(RangeError::Overlap { first: 5, last: 6 })
        );
        assert_eq!(
            check_truncation_range(SeqRange { first: 7, last: 11 }, 10, &recorded),
            Err(RangeError::BeyondLog {
                last: 11,
                limit: 10
            })
        );
        assert!(matches!(
            check_truncation_range(SeqRange { first: 0, last: 1 }, 10, &[]),
            Err(RangeError::Empty { .. })
        ));
        assert!(matches!(
            check_truncation_range(SeqRange { first: 4, last: 3 }, 10, &[]),
            Err(RangeError::Empty { .. })
        ));
    }
}
