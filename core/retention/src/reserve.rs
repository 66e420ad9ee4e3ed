//! The one Reserve decision and its Release counterpart (plan §5.4,
//! R-5.4-04..11).
//!
//! Reserve only decides. The shell applies a [`Reservation`] to every counter
//! it names inside the same store-writer transaction as the row it charges,
//! or applies nothing: there is no partial reservation to undo.

use std::fmt;

use thiserror::Error;

use crate::charge::ChargeKind;
use crate::tiers::{Tiers, Usage};

/// How an item may use a command's closeout headroom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Lifecycle, terminal and truncation/loss markers, mutation results:
    /// uses free room first and the command's held closeout headroom for the
    /// rest.
    Essential,
    /// Output, stdin payload, script, execution files: must leave the held
    /// closeout headroom untouched.
    Ordinary,
    /// The command row and spec: also tops the command's closeout headroom up
    /// to the configured reserve, at every tier, before the command is
    /// accepted. Always command-scoped.
    CommandCreation,
}

/// A tier Reserve checks, in check order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Hard per-kind maximum of one item.
    FieldMax,
    /// Per-command total.
    CommandTotal,
    /// The write fits the command total only by using the closeout headroom,
    /// which its class may not use (or creation cannot hold it).
    CloseoutReserve,
    /// Per-client (server) or per-daemon (client) total.
    OwnerTotal,
    /// Server-wide (or client-daemon) total.
    GlobalTotal,
    /// Filesystem free-space floor.
    FreeSpaceFloor,
    /// The separate audit/incident budget.
    AuditBudget,
}

impl Tier {
    /// Every tier, in declaration (check) order.
    pub const ALL: [Tier; 7] = [
        Tier::FieldMax,
        Tier::CommandTotal,
        Tier::CloseoutReserve,
        Tier::OwnerTotal,
        Tier::GlobalTotal,
        Tier::FreeSpaceFloor,
        Tier::AuditBudget,
    ];

    /// Stable snake_case name for logs and metric labels.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Tier::FieldMax => "field_max",
            Tier::CommandTotal => "command_total",
            Tier::CloseoutReserve => "closeout_reserve",
            Tier::OwnerTotal => "owner_total",
            Tier::GlobalTotal => "global_total",
            Tier::FreeSpaceFloor => "free_space_floor",
            Tier::AuditBudget => "audit_budget",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reserve refused: the first tier, in check order, that could not hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("storage refused at tier {tier}: needed {needed} bytes, {available} available")]
pub struct Refusal {
    /// The first failing tier.
    pub tier: Tier,
    /// Bytes the item needs at that tier (charged bytes; for creation plus
    /// the closeout top-up).
    pub needed: u64,
    /// Bytes that tier can still give this class (for `FieldMax`, the
    /// maximum itself; for the floor, free space above the floor).
    pub available: u64,
}

/// An accepted reservation: the counters after applying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Charged bytes of the item (what Release later frees).
    pub charged: u64,
    /// Part of `charged` drawn from the command's held closeout headroom
    /// (Essential only); the counters do not grow by it.
    pub from_reserve: u64,
    /// Closeout headroom newly held (CommandCreation only).
    pub reserve_top_up: u64,
    /// Bytes every applicable counter grows by:
    /// `charged - from_reserve + reserve_top_up`.
    pub added: u64,
    /// Command counter after (unchanged when not command-scoped).
    pub command_after: u64,
    /// Held closeout headroom after.
    pub held_closeout_after: u64,
    /// Owner counter after.
    pub owner_after: u64,
    /// Global counter after.
    pub global_after: u64,
}

/// Room left under `limit` after `used`.
const fn room(limit: u64, used: u64) -> u64 {
    limit.saturating_sub(used)
}

/// Decide one allocation of `charged` bytes of `kind`.
///
/// Checks, in order (plan §5.4): hard field maximum, per-command total and
/// closeout reserve (only when `command_scoped`), per-owner total, global
/// total, filesystem floor. Reports the first failing tier; reserves all
/// applicable tiers or none. `command_scoped` is false for items no command
/// owns (client-owned mutations); audit and incidents use [`reserve_audit`].
pub fn reserve(
    tiers: &Tiers,
    usage: &Usage,
    kind: ChargeKind,
    class: Class,
    charged: u64,
    command_scoped: bool,
) -> Result<Reservation, Refusal> {
    // 1. Hard field maximum.
    let max = tiers.field_max.get(kind);
    if charged > max {
        return Err(Refusal {
            tier: Tier::FieldMax,
            needed: charged,
            available: max,
        });
    }

    let scoped = command_scoped || class == Class::CommandCreation;
    // A held reserve larger than the counter holding it is a counter bug;
    // assume the smaller value (conservative) and let Release surface it.
    let held = if scoped {
        usage.held_closeout.min(usage.command)
    } else {
        0
    };
    let room_command = room(tiers.command_total, usage.command);
    let room_owner = room(tiers.per_owner_total, usage.owner);
    let room_global = room(tiers.global_total, usage.global);

    // What each counter grows by, and what this class may additionally use
    // (`bonus`, reported in `available`).
    let (from_reserve, top_up, bonus) = match class {
        Class::Ordinary => (0, 0, 0),
        Class::CommandCreation => (0, tiers.closeout_reserve.saturating_sub(held), 0),
        Class::Essential => {
            // Use free room first so the headroom lasts until closeout.
            let min_room = if scoped {
                room_command.min(room_owner).min(room_global)
            } else {
                room_owner.min(room_global)
            };
            (charged.saturating_sub(min_room).min(held), 0, held)
        }
    };
    let added = charged.saturating_sub(from_reserve).saturating_add(top_up);
    let needed = charged.saturating_add(top_up);

    // 2. Per-command total and closeout reserve.
    if scoped && added > room_command {
        let fits_with_reserve =
            charged <= room(tiers.command_total, usage.command.saturating_sub(held));
        let tier = match class {
            Class::Ordinary if fits_with_reserve => Tier::CloseoutReserve,
            Class::CommandCreation if charged <= room_command => Tier::CloseoutReserve,
            _ => Tier::CommandTotal,
        };
        return Err(Refusal {
            tier,
            needed,
            available: room_command.saturating_add(bonus),
        });
    }
    // 3. Per-owner total.
    if added > room_owner {
        return Err(Refusal {
            tier: Tier::OwnerTotal,
            needed,
            available: room_owner.saturating_add(bonus),
        });
    }
    // 4. Global total.
    if added > room_global {
        return Err(Refusal {
            tier: Tier::GlobalTotal,
            needed,
            available: room_global.saturating_add(bonus),
        });
    }
    // 5. Filesystem floor, whatever the logical headroom: the bytes about to
    // be written (held headroom is logical, not written).
    let above_floor = usage.free_space.saturating_sub(tiers.free_space_floor);
    if charged > above_floor {
        return Err(Refusal {
            tier: Tier::FreeSpaceFloor,
            needed: charged,
            available: above_floor,
        });
    }

    // Every sum below is bounded by a tier limit checked above.
    Ok(Reservation {
        charged,
        from_reserve,
        reserve_top_up: top_up,
        added,
        command_after: if scoped {
            usage.command.saturating_add(added)
        } else {
            usage.command
        },
        held_closeout_after: held.saturating_sub(from_reserve).saturating_add(top_up),
        owner_after: usage.owner.saturating_add(added),
        global_after: usage.global.saturating_add(added),
    })
}

/// A counter would go below zero: the persisted counters disagree with the
/// rows. The shell raises a counter-mismatch incident; never hide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("counter underflow at tier {tier}: {used} bytes counted, freeing {freed}")]
pub struct CounterUnderflow {
    /// The counter that would underflow (first in check order).
    pub tier: Tier,
    /// What the counter (or its releasable part) holds.
    pub used: u64,
    /// What the caller tried to free.
    pub freed: u64,
}

fn sub(tier: Tier, used: u64, freed: u64) -> Result<u64, CounterUnderflow> {
    used.checked_sub(freed)
        .ok_or(CounterUnderflow { tier, used, freed })
}

/// Usage after freeing `charged` bytes of rows (charged with the version
/// stored on them). For a command-scoped item the held closeout headroom is
/// not releasable here (see [`release_closeout`]).
pub fn release(
    usage: &Usage,
    charged: u64,
    command_scoped: bool,
) -> Result<Usage, CounterUnderflow> {
    let mut after = *usage;
    if command_scoped {
        let releasable = sub(Tier::CloseoutReserve, usage.command, usage.held_closeout)?;
        sub(Tier::CommandTotal, releasable, charged)?;
        after.command = sub(Tier::CommandTotal, usage.command, charged)?;
    }
    after.owner = sub(Tier::OwnerTotal, usage.owner, charged)?;
    after.global = sub(Tier::GlobalTotal, usage.global, charged)?;
    Ok(after)
}

/// Usage after freeing the closeout headroom a command still holds (when it
/// becomes terminal and its closeout is recorded).
pub fn release_closeout(usage: &Usage) -> Result<Usage, CounterUnderflow> {
    let held = usage.held_closeout;
    Ok(Usage {
        command: sub(Tier::CloseoutReserve, usage.command, held)?,
        held_closeout: 0,
        owner: sub(Tier::OwnerTotal, usage.owner, held)?,
        global: sub(Tier::GlobalTotal, usage.global, held)?,
        free_space: usage.free_space,
    })
}

/// Usage after deleting a whole command (eviction or age reclamation): its
/// whole counter, held headroom included, leaves the owner and global tiers.
pub fn release_command(usage: &Usage) -> Result<Usage, CounterUnderflow> {
    sub(Tier::CloseoutReserve, usage.command, usage.held_closeout)?;
    Ok(Usage {
        command: 0,
        held_closeout: 0,
        owner: sub(Tier::OwnerTotal, usage.owner, usage.command)?,
        global: sub(Tier::GlobalTotal, usage.global, usage.command)?,
        free_space: usage.free_space,
    })
}

/// Reserve audit or incident storage under its own budget (plan §5.4 item 5):
/// field maximum, audit budget, filesystem floor, in that order. Returns the
/// audit counter after.
pub fn reserve_audit(
    tiers: &Tiers,
    budget: u64,
    used: u64,
    free_space: u64,
    kind: ChargeKind,
    charged: u64,
) -> Result<u64, Refusal> {
    let max = tiers.field_max.get(kind);
    if charged > max {
        return Err(Refusal {
            tier: Tier::FieldMax,
            needed: charged,
            available: max,
        });
    }
    let available = room(budget, used);
    if charged > available {
        return Err(Refusal {
            tier: Tier::AuditBudget,
            needed: charged,
            available,
        });
    }
    let above_floor = free_space.saturating_sub(tiers.free_space_floor);
    if charged > above_floor {
        return Err(Refusal {
            tier: Tier::FreeSpaceFloor,
            needed: charged,
            available: above_floor,
        });
    }
    Ok(used.saturating_add(charged))
}

/// The audit counter after freeing `charged` bytes.
pub fn release_audit(used: u64, charged: u64) -> Result<u64, CounterUnderflow> {
    sub(Tier::AuditBudget, used, charged)
}
