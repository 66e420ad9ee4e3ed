#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Charge formula, tiers and the Reserve/Release decision.

use rvbox_domain::limits::{self, KIB, MIB};
use rvbox_retention::{
    CHARGE_VERSION, ChargeError, ChargeKind, Class, CounterUnderflow, FieldMax, Refusal, Tier,
    Tiers, TiersError, Usage, charge, overhead_v1, release, release_audit, release_closeout,
    release_command, reserve, reserve_audit, zstd_bound,
};

/// Small tiers so numbers stay readable.
fn tiers() -> Tiers {
    Tiers {
        command_total: 1_000,
        closeout_reserve: 100,
        command_output_window: 500,
        per_owner_total: 5_000,
        global_total: 20_000,
        free_space_floor: 10_000,
        field_max: FieldMax::v1(),
    }
}

/// Plenty of room everywhere; the command holds its full reserve.
fn roomy() -> Usage {
    Usage {
        command: 100,
        held_closeout: 100,
        owner: 100,
        global: 100,
        free_space: 1_000_000,
    }
}

const EV: ChargeKind = ChargeKind::EventRow;
const OUT: ChargeKind = ChargeKind::OutputRecord;

fn refused(r: Result<rvbox_retention::Reservation, Refusal>) -> Refusal {
    r.expect_err("expected a refusal")
}

// ---- charge formula --------------------------------------------------------

#[test]
fn charge_v1_is_encoded_plus_fixed_overhead() {
    assert_eq!(CHARGE_VERSION, 1);
    for kind in ChargeKind::ALL {
        let overhead = overhead_v1(kind);
        assert!(
            overhead >= 256,
            "{kind:?} overhead {overhead} is not conservative"
        );
        assert_eq!(charge(1, kind, 0).unwrap(), overhead);
        assert_eq!(charge(1, kind, 1234).unwrap(), 1234 + overhead);
    }
    assert_eq!(charge(1, ChargeKind::EventRow, 10).unwrap(), 266);
}

#[test]
fn charge_refuses_unknown_versions() {
    for version in [0, 2, u32::MAX] {
        assert_eq!(
            charge(version, ChargeKind::OutputRecord, 10),
            Err(ChargeError::UnknownVersion { version })
        );
    }
}

#[test]
fn charge_never_overflows() {
    let err = charge(1, ChargeKind::ScriptPayload, u64::MAX).unwrap_err();
    assert_eq!(
        err,
        ChargeError::Overflow {
            kind: ChargeKind::ScriptPayload,
            encoded_bytes: u64::MAX
        }
    );
    let edge = u64::MAX - overhead_v1(ChargeKind::EventRow);
    assert_eq!(charge(1, ChargeKind::EventRow, edge).unwrap(), u64::MAX);
    assert!(charge(1, ChargeKind::EventRow, edge + 1).is_err());
}

#[test]
fn kind_and_tier_names_are_stable_and_unique() {
    let kinds: Vec<&str> = ChargeKind::ALL.iter().map(|k| k.name()).collect();
    let mut sorted = kinds.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), kinds.len());
    let tiers: Vec<&str> = Tier::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(
        tiers,
        [
            "field_max",
            "command_total",
            "closeout_reserve",
            "owner_total",
            "global_total",
            "free_space_floor",
            "audit_budget"
        ]
    );
}

// ---- tiers -------------------------------------------------------------------

#[test]
fn defaults_come_from_domain_limits() {
    let s = Tiers::server_defaults();
    assert_eq!(s.command_total, 32 * MIB);
    assert_eq!(s.closeout_reserve, 64 * KIB);
    assert_eq!(s.command_output_window, 10 * MIB);
    assert_eq!(s.per_owner_total, 256 * MIB);
    assert_eq!(s.global_total, 4 * limits::GIB);
    assert_eq!(s.free_space_floor, 256 * MIB);
    let c = Tiers::client_defaults();
    assert_eq!(c.per_owner_total, 256 * MIB);
    assert_eq!(c.global_total, c.per_owner_total);
    assert_eq!(c.free_space_floor, 64 * MIB);
    s.validate().unwrap();
    c.validate().unwrap();
    tiers().validate().unwrap();
}

#[test]
fn validate_rejects_inverted_tiers() {
    let mut t = tiers();
    t.closeout_reserve = t.command_total;
    assert!(matches!(
        t.validate(),
        Err(TiersError::ReserveNotBelowCommand { .. })
    ));
    let mut t = tiers();
    t.command_output_window = 901;
    assert!(matches!(
        t.validate(),
        Err(TiersError::WindowTooLarge { .. })
    ));
    let mut t = tiers();
    t.per_owner_total = 999;
    assert!(matches!(
        t.validate(),
        Err(TiersError::TierInversion { .. })
    ));
    let mut t = tiers();
    t.global_total = 4_999;
    assert!(matches!(
        t.validate(),
        Err(TiersError::TierInversion { .. })
    ));
}

#[test]
fn field_max_matches_protocol_ceilings() {
    let f = FieldMax::v1();
    let over = |kind, encoded| charge(1, kind, encoded).unwrap();
    assert_eq!(
        f.get(ChargeKind::SpecPayload),
        over(ChargeKind::SpecPayload, zstd_bound(768 * KIB))
    );
    assert_eq!(
        f.get(ChargeKind::ScriptPayload),
        over(ChargeKind::ScriptPayload, zstd_bound(10 * MIB))
    );
    assert_eq!(
        f.get(ChargeKind::OutputRecord),
        over(ChargeKind::OutputRecord, zstd_bound(64 * KIB))
    );
    assert_eq!(
        f.get(ChargeKind::StdinWrite),
        over(ChargeKind::StdinWrite, zstd_bound(256 * KIB))
    );
    // zstd worst case grows incompressible input slightly.
    assert_eq!(zstd_bound(64 * KIB), 64 * KIB + 256 + 32);
    assert_eq!(zstd_bound(10 * MIB), 10 * MIB + 40 * KIB);
    for kind in ChargeKind::ALL {
        assert!(f.get(kind) > overhead_v1(kind));
    }
}

// ---- Reserve: check order ---------------------------------------------------

#[test]
fn check_order_first_failing_tier_wins() {
    let t = tiers();
    let max = t.field_max.get(EV);
    // Every tier fails: field max is reported.
    let all_bad = Usage {
        command: 1_000,
        held_closeout: 0,
        owner: 5_000,
        global: 20_000,
        free_space: 0,
    };
    let r = refused(reserve(&t, &all_bad, EV, Class::Ordinary, max + 1, true));
    assert_eq!(r.tier, Tier::FieldMax);
    // Field max fine: command total next.
    let r = refused(reserve(&t, &all_bad, EV, Class::Ordinary, 10, true));
    assert_eq!(r.tier, Tier::CommandTotal);
    // Command fine: owner next.
    let u = Usage {
        command: 0,
        ..all_bad
    };
    let r = refused(reserve(&t, &u, EV, Class::Ordinary, 10, true));
    assert_eq!(r.tier, Tier::OwnerTotal);
    // Owner fine: global next.
    let u = Usage { owner: 0, ..u };
    let r = refused(reserve(&t, &u, EV, Class::Ordinary, 10, true));
    assert_eq!(r.tier, Tier::GlobalTotal);
    // Global fine: floor last.
    let u = Usage { global: 0, ..u };
    let r = refused(reserve(&t, &u, EV, Class::Ordinary, 10, true));
    assert_eq!(r.tier, Tier::FreeSpaceFloor);
    // Everything fine.
    let u = Usage {
        free_space: 10_010,
        ..u
    };
    reserve(&t, &u, EV, Class::Ordinary, 10, true).unwrap();
}

#[test]
fn check_order_closeout_reserve_before_owner() {
    let t = tiers();
    // Ordinary write would fit only by using the held reserve, and the owner
    // tier is also full: the command step (closeout reserve) is reported.
    let u = Usage {
        command: 950,
        held_closeout: 100,
        owner: 5_000,
        global: 20_000,
        free_space: 0,
    };
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 100, true));
    assert_eq!(r.tier, Tier::CloseoutReserve);
}

#[test]
fn refusal_display_names_tier_and_numbers() {
    let t = tiers();
    let u = Usage {
        owner: 4_990,
        ..roomy()
    };
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 20, true));
    assert_eq!(
        r,
        Refusal {
            tier: Tier::OwnerTotal,
            needed: 20,
            available: 10
        }
    );
    assert_eq!(
        r.to_string(),
        "storage refused at tier owner_total: needed 20 bytes, 10 available"
    );
}

// ---- Reserve: all or nothing --------------------------------------------------

#[test]
fn reservation_grows_every_applicable_tier_by_the_same_amount() {
    let t = tiers();
    let u = roomy();
    let r = reserve(&t, &u, OUT, Class::Ordinary, 300, true).unwrap();
    assert_eq!(r.charged, 300);
    assert_eq!(r.added, 300);
    assert_eq!(r.from_reserve, 0);
    assert_eq!(r.command_after, 400);
    assert_eq!(r.held_closeout_after, 100);
    assert_eq!(r.owner_after, 400);
    assert_eq!(r.global_after, 400);
}

#[test]
fn refusal_at_a_late_tier_reserves_nothing() {
    let t = tiers();
    // Command and owner have room, global does not: the caller gets only a
    // refusal, no partially applied counters, and its usage is untouched.
    let u = Usage {
        global: 19_950,
        ..roomy()
    };
    let before = u;
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 60, true));
    assert_eq!(r.tier, Tier::GlobalTotal);
    assert_eq!(u, before);
    // The same request succeeds once global has room, on every tier at once.
    let u = Usage {
        global: 19_940,
        ..roomy()
    };
    let ok = reserve(&t, &u, OUT, Class::Ordinary, 60, true).unwrap();
    assert_eq!(
        (ok.command_after, ok.owner_after, ok.global_after),
        (160, 160, 20_000)
    );
}

#[test]
fn not_command_scoped_skips_command_tier() {
    let t = tiers();
    let u = Usage {
        command: 1_000,
        held_closeout: 0,
        ..roomy()
    };
    let r = reserve(&t, &u, ChargeKind::MutationRow, Class::Ordinary, 500, false).unwrap();
    assert_eq!(r.command_after, 1_000);
    assert_eq!(r.owner_after, 600);
    assert_eq!(r.global_after, 600);
}

// ---- Reserve: closeout reserve ---------------------------------------------

#[test]
fn closeout_reserve_only_for_essential() {
    let t = tiers();
    // 900 used of which 100 is held headroom: 100 free room, 100 held.
    let u = Usage {
        command: 900,
        held_closeout: 100,
        owner: 900,
        global: 900,
        free_space: 1_000_000,
    };
    // Ordinary may use the free room exactly...
    reserve(&t, &u, OUT, Class::Ordinary, 100, true).unwrap();
    // ...but not one byte of the headroom.
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 101, true));
    assert_eq!(r.tier, Tier::CloseoutReserve);
    assert_eq!(r.available, 100);
    // Essential may use free room and then all of the headroom.
    let e = reserve(&t, &u, EV, Class::Essential, 200, true).unwrap();
    assert_eq!(e.from_reserve, 100);
    assert_eq!(e.added, 100);
    assert_eq!(e.command_after, 1_000);
    assert_eq!(e.held_closeout_after, 0);
    assert_eq!(e.owner_after, 1_000);
    // But not more than that.
    let r = refused(reserve(&t, &u, EV, Class::Essential, 201, true));
    assert_eq!(r.tier, Tier::CommandTotal);
    assert_eq!(r.available, 200);
    // Ordinary beyond even the reserve is a command-total refusal.
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 201, true));
    assert_eq!(r.tier, Tier::CommandTotal);
}

#[test]
fn essential_uses_free_room_before_headroom() {
    let t = tiers();
    let e = reserve(&t, &roomy(), EV, Class::Essential, 300, true).unwrap();
    assert_eq!(e.from_reserve, 0);
    assert_eq!(e.held_closeout_after, 100);
    assert_eq!(e.added, 300);
}

#[test]
fn essential_headroom_covers_a_full_owner_tier() {
    let t = tiers();
    // The owner tier is full of other commands, but this command's held
    // headroom is already counted there, so its closeout still fits.
    let u = Usage {
        command: 200,
        held_closeout: 100,
        owner: 5_000,
        global: 5_000,
        free_space: 1_000_000,
    };
    let e = reserve(&t, &u, EV, Class::Essential, 100, true).unwrap();
    assert_eq!((e.from_reserve, e.added, e.owner_after), (100, 0, 5_000));
    let r = refused(reserve(&t, &u, EV, Class::Essential, 101, true));
    assert_eq!(r.tier, Tier::OwnerTotal);
    assert_eq!(r.available, 100);
    // Ordinary cannot use it.
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 1, true));
    assert_eq!(r.tier, Tier::OwnerTotal);
}

#[test]
fn command_creation_holds_the_reserve_up_front() {
    let t = tiers();
    let fresh = Usage {
        command: 0,
        held_closeout: 0,
        owner: 0,
        global: 0,
        free_space: 1_000_000,
    };
    let c = reserve(
        &t,
        &fresh,
        ChargeKind::CommandRow,
        Class::CommandCreation,
        300,
        false,
    )
    .unwrap();
    assert_eq!(c.reserve_top_up, 100);
    assert_eq!(c.added, 400);
    assert_eq!(c.command_after, 400);
    assert_eq!(c.held_closeout_after, 100);
    assert_eq!((c.owner_after, c.global_after), (400, 400));
    // Exactly at the command total with the reserve.
    let spec = ChargeKind::SpecPayload;
    reserve(&t, &fresh, spec, Class::CommandCreation, 900, true).unwrap();
    // One byte more fits the command total only without the reserve.
    let r = refused(reserve(&t, &fresh, spec, Class::CommandCreation, 901, true));
    assert_eq!(r.tier, Tier::CloseoutReserve);
    assert_eq!((r.needed, r.available), (1_001, 1_000));
    // More than the total at all.
    let r = refused(reserve(
        &t,
        &fresh,
        spec,
        Class::CommandCreation,
        1_001,
        true,
    ));
    assert_eq!(r.tier, Tier::CommandTotal);
    // The reserve is held at the owner tier too.
    let owner_tight = Usage {
        owner: 4_650,
        ..fresh
    };
    reserve(&t, &owner_tight, spec, Class::CommandCreation, 250, true).unwrap();
    let r = refused(reserve(
        &t,
        &owner_tight,
        spec,
        Class::CommandCreation,
        251,
        true,
    ));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::OwnerTotal, 351, 350)
    );
    // A second creation charge (the spec after the row) does not hold twice.
    let again = Usage {
        command: 400,
        held_closeout: 100,
        owner: 400,
        global: 400,
        free_space: 1_000_000,
    };
    let c = reserve(&t, &again, spec, Class::CommandCreation, 200, true).unwrap();
    assert_eq!(
        (c.reserve_top_up, c.command_after, c.held_closeout_after),
        (0, 600, 100)
    );
}

// ---- Reserve: boundaries for every tier ---------------------------------------

#[test]
fn boundary_field_max() {
    let t = Tiers::server_defaults();
    let u = Usage {
        free_space: u64::MAX,
        ..Usage::default()
    };
    for kind in ChargeKind::ALL {
        let max = t.field_max.get(kind);
        if kind == ChargeKind::ScriptPayload || kind == ChargeKind::ExecutionFile {
            // Larger than the output window but within the command total.
            assert!(max < t.command_total - t.closeout_reserve);
        }
        reserve(&t, &u, kind, Class::Ordinary, max, false).unwrap();
        let r = refused(reserve(&t, &u, kind, Class::Ordinary, max + 1, false));
        assert_eq!(
            r,
            Refusal {
                tier: Tier::FieldMax,
                needed: max + 1,
                available: max
            },
            "{kind:?}"
        );
    }
}

#[test]
fn boundary_command_total() {
    let t = tiers();
    // No held headroom left (consumed): the limit is the command total.
    let u = Usage {
        command: 700,
        held_closeout: 0,
        ..roomy()
    };
    reserve(&t, &u, EV, Class::Essential, 300, true).unwrap();
    let r = refused(reserve(&t, &u, EV, Class::Essential, 301, true));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::CommandTotal, 301, 300)
    );
    reserve(&t, &u, OUT, Class::Ordinary, 300, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 301, true));
    assert_eq!(r.tier, Tier::CommandTotal);
}

#[test]
fn boundary_closeout_reserve() {
    let t = tiers();
    let u = Usage {
        command: 600,
        held_closeout: 100,
        ..roomy()
    };
    reserve(&t, &u, OUT, Class::Ordinary, 400, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 401, true));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::CloseoutReserve, 401, 400)
    );
    // Partly consumed headroom: only the remainder is protected.
    let u = Usage {
        command: 600,
        held_closeout: 30,
        ..roomy()
    };
    reserve(&t, &u, OUT, Class::Ordinary, 400, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 401, true));
    assert_eq!(r.tier, Tier::CloseoutReserve);
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 431, true));
    assert_eq!(r.tier, Tier::CommandTotal);
}

#[test]
fn boundary_owner_total() {
    let t = tiers();
    let u = Usage {
        owner: 4_500,
        ..roomy()
    };
    reserve(&t, &u, OUT, Class::Ordinary, 500, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 501, true));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::OwnerTotal, 501, 500)
    );
}

#[test]
fn boundary_global_total() {
    let t = tiers();
    let u = Usage {
        global: 19_500,
        ..roomy()
    };
    reserve(&t, &u, OUT, Class::Ordinary, 500, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 501, true));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::GlobalTotal, 501, 500)
    );
}

#[test]
fn boundary_free_space_floor() {
    let t = tiers();
    let u = Usage {
        free_space: 10_500,
        ..roomy()
    };
    reserve(&t, &u, OUT, Class::Ordinary, 500, true).unwrap();
    let r = refused(reserve(&t, &u, OUT, Class::Ordinary, 501, true));
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::FreeSpaceFloor, 501, 500)
    );
}

#[test]
fn free_space_floor_refuses_regardless_of_quota_headroom() {
    let t = tiers();
    let empty = Usage {
        command: 0,
        held_closeout: 0,
        owner: 0,
        global: 0,
        free_space: 9_999,
    };
    for class in [Class::Ordinary, Class::Essential, Class::CommandCreation] {
        let r = refused(reserve(&t, &empty, EV, class, 1, true));
        assert_eq!(
            (r.tier, r.available),
            (Tier::FreeSpaceFloor, 0),
            "{class:?}"
        );
    }
    // Bytes drawn from held headroom are still written to disk.
    let u = Usage {
        command: 1_000,
        held_closeout: 100,
        owner: 1_000,
        global: 1_000,
        free_space: 10_050,
    };
    let r = refused(reserve(&t, &u, EV, Class::Essential, 60, true));
    assert_eq!(r.tier, Tier::FreeSpaceFloor);
    // Audit obeys the floor too.
    let r = reserve_audit(&t, 100 * MIB, 0, 9_999, ChargeKind::AuditRecord, 1).unwrap_err();
    assert_eq!(r.tier, Tier::FreeSpaceFloor);
}

#[test]
fn boundary_audit_budget() {
    let t = tiers();
    let budget = limits::DEFAULT_AUDIT_BYTES;
    let a = ChargeKind::AuditRecord;
    assert_eq!(
        reserve_audit(&t, budget, budget - 500, 1_000_000, a, 500),
        Ok(budget)
    );
    let r = reserve_audit(&t, budget, budget - 500, 1_000_000, a, 501).unwrap_err();
    assert_eq!(
        (r.tier, r.needed, r.available),
        (Tier::AuditBudget, 501, 500)
    );
    let max = t.field_max.get(ChargeKind::IncidentRow);
    let r = reserve_audit(&t, budget, 0, u64::MAX, ChargeKind::IncidentRow, max + 1).unwrap_err();
    assert_eq!(r.tier, Tier::FieldMax);
    assert_eq!(release_audit(budget, 500), Ok(budget - 500));
    assert_eq!(
        release_audit(10, 11),
        Err(CounterUnderflow {
            tier: Tier::AuditBudget,
            used: 10,
            freed: 11
        })
    );
}

// ---- Release ----------------------------------------------------------------

#[test]
fn release_inverts_reserve() {
    let t = tiers();
    let u = roomy();
    let r = reserve(&t, &u, OUT, Class::Ordinary, 321, true).unwrap();
    let after = Usage {
        command: r.command_after,
        held_closeout: r.held_closeout_after,
        owner: r.owner_after,
        global: r.global_after,
        ..u
    };
    assert_eq!(release(&after, r.charged, true), Ok(u));
}

#[test]
fn release_underflow_is_an_error_not_zero() {
    let u = Usage {
        command: 300,
        held_closeout: 100,
        owner: 1_000,
        global: 2_000,
        free_space: 0,
    };
    // Only 200 of the command counter is releasable rows; 100 is headroom.
    assert!(release(&u, 200, true).is_ok());
    assert_eq!(
        release(&u, 201, true),
        Err(CounterUnderflow {
            tier: Tier::CommandTotal,
            used: 200,
            freed: 201
        })
    );
    let low_owner = Usage { owner: 50, ..u };
    assert_eq!(
        release(&low_owner, 60, true),
        Err(CounterUnderflow {
            tier: Tier::OwnerTotal,
            used: 50,
            freed: 60
        })
    );
    let low_global = Usage { global: 50, ..u };
    assert_eq!(
        release(&low_global, 60, false),
        Err(CounterUnderflow {
            tier: Tier::GlobalTotal,
            used: 50,
            freed: 60
        })
    );
    let bad_held = Usage {
        command: 50,
        held_closeout: 100,
        ..u
    };
    assert_eq!(
        release(&bad_held, 0, true).unwrap_err().tier,
        Tier::CloseoutReserve
    );
    assert!(
        release(&low_global, 60, false)
            .unwrap_err()
            .to_string()
            .contains("global_total")
    );
}

#[test]
fn release_closeout_and_whole_command() {
    let u = Usage {
        command: 300,
        held_closeout: 100,
        owner: 1_000,
        global: 2_000,
        free_space: 7,
    };
    let c = release_closeout(&u).unwrap();
    assert_eq!(
        c,
        Usage {
            command: 200,
            held_closeout: 0,
            owner: 900,
            global: 1_900,
            free_space: 7
        }
    );
    let w = release_command(&u).unwrap();
    assert_eq!(
        w,
        Usage {
            command: 0,
            held_closeout: 0,
            owner: 700,
            global: 1_700,
            free_space: 7
        }
    );
    let short = Usage { owner: 299, ..u };
    assert_eq!(release_command(&short).unwrap_err().tier, Tier::OwnerTotal);
    let short = Usage { global: 50, ..u };
    assert_eq!(
        release_closeout(&short).unwrap_err().tier,
        Tier::GlobalTotal
    );
}
