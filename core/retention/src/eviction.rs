//! Whole-command eviction and age reclamation (plan §5.4 items 3, 4;
//! R-5.4-13..16, R-5.4-20, R-5.4-26).
//!
//! Both selections return a [`WholeCommands`] list in the same deterministic
//! `(server issue time, issue uuid)` order, so the shell feeds both to one
//! whole-command delete primitive (which rechecks terminal state and
//! generation inside its transaction). Active commands are never selected.

/// A command that retention may consider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Authoritative server issue time.
    pub issue_time_unix_ms: i64,
    /// Issue UUIDv7 bytes (tie breaker).
    pub issue_uuid: [u8; 16],
    /// Owner: the client id.
    pub owner: String,
    /// Authoritative terminal time; `None` while active (never evicted).
    pub terminal_time_unix_ms: Option<i64>,
    /// The command's whole charged bytes (its counter).
    pub charged: u64,
}

impl Candidate {
    fn order_key(&self) -> (i64, [u8; 16]) {
        (self.issue_time_unix_ms, self.issue_uuid)
    }
}

/// Whole commands to delete, oldest `(issue_time, uuid)` first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WholeCommands {
    /// Issue UUIDs in deletion order.
    pub uuids: Vec<[u8; 16]>,
}

impl WholeCommands {
    /// Number of commands.
    #[must_use]
    pub fn len(&self) -> usize {
        self.uuids.len()
    }

    /// True when nothing is selected.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.uuids.is_empty()
    }
}

/// Bytes one owner must free (counts only that owner's commands).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerNeed {
    /// The client id.
    pub owner: String,
    /// Bytes to free from that owner's commands.
    pub bytes: u64,
}

/// How much must be freed: for one owner and/or globally.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Need {
    /// Per-owner pressure, if any.
    pub owner: Option<OwnerNeed>,
    /// Global bytes to free (any owner's commands count); 0 = none.
    pub global: u64,
}

/// The eviction decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Terminal commands to delete, in order.
    pub commands: WholeCommands,
    /// Bytes freed from the needy owner (0 without an owner need).
    pub freed_owner: u64,
    /// Bytes freed globally.
    pub freed_global: u64,
    /// Whether terminal data alone meets the need. When false the shell
    /// rotates active output with markers, then rejects new unreserved state.
    pub met: bool,
    /// Owner bytes still missing after the selection.
    pub owner_shortfall: u64,
    /// Global bytes still missing after the selection.
    pub global_shortfall: u64,
}

fn ordered(candidates: &[Candidate]) -> Vec<&Candidate> {
    let mut list: Vec<&Candidate> = candidates.iter().collect();
    list.sort_by_key(|c| c.order_key());
    list
}

/// Pick terminal commands, oldest `(issue_time, uuid)` first, stopping as
/// soon as both needs are met. A candidate is taken only when it helps an
/// unmet need: the owner need (its own commands) or the global need (any
/// command), so removing the last one taken leaves a need unmet.
#[must_use]
pub fn select_evictions(candidates: &[Candidate], need: &Need) -> Selection {
    let owner_need = need.owner.as_ref().map_or(0, |o| o.bytes);
    let mut freed_owner = 0u64;
    let mut freed_global = 0u64;
    let mut uuids = Vec::new();
    for candidate in ordered(candidates) {
        let owner_unmet = freed_owner < owner_need;
        let global_unmet = freed_global < need.global;
        if !owner_unmet && !global_unmet {
            break;
        }
        if candidate.terminal_time_unix_ms.is_none() {
            continue;
        }
        let is_owner = need
            .owner
            .as_ref()
            .is_some_and(|o| o.owner == candidate.owner);
        if !(global_unmet || (owner_unmet && is_owner)) {
            continue;
        }
        uuids.push(candidate.issue_uuid);
        freed_global = freed_global.saturating_add(candidate.charged);
        if is_owner {
            freed_owner = freed_owner.saturating_add(candidate.charged);
        }
    }
    let owner_shortfall = owner_need.saturating_sub(freed_owner);
    let global_shortfall = need.global.saturating_sub(freed_global);
    Selection {
        commands: WholeCommands { uuids },
        freed_owner,
        freed_global,
        met: owner_shortfall == 0 && global_shortfall == 0,
        owner_shortfall,
        global_shortfall,
    }
}

/// Terminal commands whose terminal time plus `retention_ms` is at or before
/// `now_unix_ms`, in `(issue_time, uuid)` order. `retention_ms == 0` disables
/// age reclamation.
#[must_use]
pub fn select_aged(candidates: &[Candidate], now_unix_ms: i64, retention_ms: u64) -> WholeCommands {
    if retention_ms == 0 {
        return WholeCommands::default();
    }
    let uuids = ordered(candidates)
        .into_iter()
        .filter(|c| {
            c.terminal_time_unix_ms.is_some_and(|t| {
                // i128 cannot overflow here: i64 + u64 fits.
                i128::from(t).saturating_add(i128::from(retention_ms)) <= i128::from(now_unix_ms)
            })
        })
        .map(|c| c.issue_uuid)
        .collect();
    WholeCommands { uuids }
}
