#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Output rotation, eviction, age selection, tombstones, audit rotation and
//! hysteresis.

use rvbox_domain::limits::{DAY_MS, MAX_TOMBSTONES, MIB};
use rvbox_retention::{
    AuditSegment, Candidate, FieldMax, Hysteresis, LossMode, Need, OwnerNeed, SegmentUsage, Tiers,
    Transition, Usage, WatermarkError, WholeCommands, plan_audit_rotation, plan_output_rotation,
    plan_pressure_rotation, select_aged, select_evictions, tombstones_to_drop,
};

// ---- output rotation -----------------------------------------------------------

fn tiers() -> Tiers {
    Tiers {
        command_total: 1_000,
        closeout_reserve: 100,
        command_output_window: 500,
        per_owner_total: 5_000,
        global_total: 20_000,
        free_space_floor: 0,
        field_max: FieldMax::v1(),
    }
}

fn seg(ordinal: u32, charged: u64, sealed: bool, pinned: bool) -> SegmentUsage {
    // Ten sequence numbers per segment, contiguous.
    let first = u64::from(ordinal) * 10;
    SegmentUsage {
        ordinal,
        charged,
        sealed,
        first_seq: first,
        last_seq: first + 9,
        pinned,
    }
}

/// Command counter: held headroom 100 + the segments + `other` bytes.
fn usage_for(segments: &[SegmentUsage], other: u64) -> Usage {
    let out: u64 = segments.iter().map(|s| s.charged).sum();
    let command = 100 + out + other;
    Usage {
        command,
        held_closeout: 100,
        owner: command,
        global: command,
        free_space: u64::MAX,
    }
}

#[test]
fn rotation_not_needed_when_it_fits() {
    let segs = [seg(0, 100, true, false), seg(1, 100, false, false)];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 300, 10);
    assert!(plan.fits);
    assert!(plan.rotate.is_empty());
    assert_eq!(plan.removed_seq_range, None);
    assert_eq!(plan.removed_charged, 0);
}

#[test]
fn rotation_removes_just_enough_oldest_segments_for_the_window() {
    let segs = [
        seg(0, 100, true, false),
        seg(1, 100, true, false),
        seg(2, 100, true, false),
        seg(3, 150, false, false),
    ];
    // 450 in the window; 250 incoming needs 200 removed.
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 250, 10);
    assert!(plan.fits);
    assert_eq!(plan.rotate, vec![0, 1]);
    assert_eq!(plan.removed_seq_range, Some((0, 19)));
    assert_eq!(plan.removed_charged, 200);
    // Exactly at the window after one segment: 450 - 100 + 150 = 500.
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 150, 10);
    assert_eq!(plan.rotate, vec![0]);
}

#[test]
fn rotation_never_touches_active_or_pinned_segments() {
    // The oldest segment is pinned: nothing behind it may rotate, so the plan
    // refuses rather than leaving a hole.
    let segs = [
        seg(0, 200, true, true),
        seg(1, 200, true, false),
        seg(2, 100, false, false),
    ];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 100, 10);
    assert!(!plan.fits);
    assert!(plan.rotate.is_empty());
    // Only the active segment: it never rotates.
    let segs = [seg(0, 450, false, false)];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 100, 10);
    assert!(!plan.fits);
    assert!(plan.rotate.is_empty());
    // Stops at the first pinned one even if more would be needed.
    let segs = [
        seg(0, 100, true, false),
        seg(1, 100, true, true),
        seg(2, 100, true, false),
        seg(3, 100, false, false),
    ];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 250, 10);
    assert!(!plan.fits);
    assert!(plan.rotate.is_empty());
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 200, 10);
    assert_eq!(plan.rotate, vec![0]);
}

#[test]
fn rotation_sorts_by_ordinal_and_reports_a_contiguous_range() {
    let segs = [
        seg(7, 100, false, false),
        seg(5, 100, true, false),
        seg(4, 100, true, false),
        seg(6, 100, true, false),
    ];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 400, 10);
    assert!(plan.fits);
    assert_eq!(plan.rotate, vec![4, 5, 6]);
    assert_eq!(plan.removed_seq_range, Some((40, 69)));
}

#[test]
fn rotation_respects_command_total_and_counts_the_marker() {
    let segs = [
        seg(0, 100, true, false),
        seg(1, 100, true, false),
        seg(2, 50, false, false),
    ];
    // Window fine (250 + 100), but the command holds 100 headroom + 250
    // output + 600 other = 950: 100 incoming needs 50 freed plus the marker.
    let u = usage_for(&segs, 600);
    let plan = plan_output_rotation(&tiers(), &u, &segs, 50, 10);
    assert!(plan.fits);
    assert!(plan.rotate.is_empty());
    let plan = plan_output_rotation(&tiers(), &u, &segs, 100, 10);
    assert_eq!(plan.rotate, vec![0]);
    // A marker that eats the gain forces a second segment.
    let plan = plan_output_rotation(&tiers(), &u, &segs, 100, 60);
    assert_eq!(plan.rotate, vec![0, 1]);
}

#[test]
fn rotation_refuses_an_item_larger_than_the_window() {
    let segs = [seg(0, 100, true, false), seg(1, 0, false, false)];
    let plan = plan_output_rotation(&tiers(), &usage_for(&segs, 0), &segs, 501, 10);
    assert!(!plan.fits);
    assert!(plan.rotate.is_empty());
}

#[test]
fn pressure_rotation_frees_what_it_can() {
    let segs = [
        seg(0, 100, true, false),
        seg(1, 100, true, false),
        seg(2, 100, true, true),
        seg(3, 100, false, false),
    ];
    let plan = plan_pressure_rotation(&segs, 150, 10);
    assert!(plan.fits);
    assert_eq!(plan.rotate, vec![0, 1]);
    let plan = plan_pressure_rotation(&segs, 500, 10);
    assert!(!plan.fits);
    assert_eq!(plan.rotate, vec![0, 1]);
    assert_eq!(plan.removed_seq_range, Some((0, 19)));
    let plan = plan_pressure_rotation(&segs, 0, 10);
    assert!(plan.fits && plan.rotate.is_empty());
    let plan = plan_pressure_rotation(&[seg(0, 5, true, false)], 1, 10);
    assert!(!plan.fits && plan.rotate.is_empty());
}

// ---- eviction --------------------------------------------------------------------

fn uuid(n: u8) -> [u8; 16] {
    let mut u = [0u8; 16];
    u[15] = n;
    u
}

fn cand(time: i64, n: u8, owner: &str, terminal: Option<i64>, charged: u64) -> Candidate {
    Candidate {
        issue_time_unix_ms: time,
        issue_uuid: uuid(n),
        owner: owner.to_owned(),
        terminal_time_unix_ms: terminal,
        charged,
    }
}

fn global(bytes: u64) -> Need {
    Need {
        owner: None,
        global: bytes,
    }
}

fn owner(name: &str, bytes: u64) -> Need {
    Need {
        owner: Some(OwnerNeed {
            owner: name.to_owned(),
            bytes,
        }),
        global: 0,
    }
}

#[test]
fn eviction_order_is_issue_time_then_uuid() {
    let c = [
        cand(20, 1, "a", Some(30), 10),
        cand(10, 9, "a", Some(30), 10),
        cand(10, 3, "b", Some(30), 10),
        cand(5, 200, "b", Some(30), 10),
    ];
    let s = select_evictions(&c, &global(40));
    assert!(s.met);
    assert_eq!(s.commands.uuids, vec![uuid(200), uuid(3), uuid(9), uuid(1)]);
}

#[test]
fn eviction_never_selects_active_commands() {
    let c = [
        cand(1, 1, "a", None, 1_000),
        cand(2, 2, "a", Some(5), 10),
        cand(3, 3, "a", None, 1_000),
    ];
    let s = select_evictions(&c, &global(500));
    assert_eq!(s.commands.uuids, vec![uuid(2)]);
    assert!(!s.met);
    assert_eq!((s.freed_global, s.global_shortfall), (10, 490));
}

#[test]
fn eviction_stops_as_soon_as_met() {
    let c = [
        cand(1, 1, "a", Some(9), 100),
        cand(2, 2, "a", Some(9), 100),
        cand(3, 3, "a", Some(9), 100),
    ];
    let s = select_evictions(&c, &global(100));
    assert_eq!(s.commands.uuids, vec![uuid(1)]);
    let s = select_evictions(&c, &global(101));
    assert_eq!(s.commands.uuids, vec![uuid(1), uuid(2)]);
    let s = select_evictions(&c, &Need::default());
    assert!(s.met && s.commands.is_empty());
}

#[test]
fn owner_need_takes_only_that_owners_commands() {
    let c = [
        cand(1, 1, "b", Some(9), 100),
        cand(2, 2, "a", Some(9), 100),
        cand(3, 3, "a", Some(9), 100),
    ];
    let s = select_evictions(&c, &owner("a", 150));
    assert_eq!(s.commands.uuids, vec![uuid(2), uuid(3)]);
    assert_eq!((s.freed_owner, s.freed_global), (200, 200));
    assert!(s.met);
    // Combined: the global need takes the oldest of anyone, the owner need
    // keeps going through that owner's commands.
    let need = Need {
        owner: Some(OwnerNeed {
            owner: "a".into(),
            bytes: 150,
        }),
        global: 100,
    };
    let s = select_evictions(&c, &need);
    assert_eq!(s.commands.uuids, vec![uuid(1), uuid(2), uuid(3)]);
    assert_eq!((s.freed_owner, s.freed_global), (200, 300));
    let s = select_evictions(&c, &owner("c", 1));
    assert!(!s.met && s.commands.is_empty());
    assert_eq!(s.owner_shortfall, 1);
}

#[test]
fn age_selection_uses_terminal_time_and_retention() {
    let r = 30 * DAY_MS;
    let now = 100 * DAY_MS as i64;
    let edge = now - r as i64;
    let c = [
        cand(9, 1, "a", Some(edge), 1),
        cand(3, 2, "a", Some(edge + 1), 1),
        cand(2, 3, "b", None, 1),
        cand(1, 4, "b", Some(0), 1),
        cand(9, 0, "b", Some(edge - 5), 1),
    ];
    let aged: WholeCommands = select_aged(&c, now, r);
    assert_eq!(aged.uuids, vec![uuid(4), uuid(0), uuid(1)]);
    assert_eq!(aged.len(), 3);
    // Retention 0 disables age reclamation entirely.
    assert!(select_aged(&c, i64::MAX, 0).is_empty());
    // No overflow at the extremes.
    let far = [cand(0, 1, "a", Some(i64::MAX), 1)];
    assert!(select_aged(&far, i64::MAX, u64::MAX).is_empty());
    let old = [cand(0, 1, "a", Some(i64::MIN), 1)];
    assert_eq!(select_aged(&old, 0, 1).len(), 1);
}

// ---- tombstones --------------------------------------------------------------------

#[test]
fn tombstone_fifo_overflow() {
    assert_eq!(tombstones_to_drop(0, MAX_TOMBSTONES), 0);
    assert_eq!(tombstones_to_drop(MAX_TOMBSTONES, MAX_TOMBSTONES), 0);
    assert_eq!(tombstones_to_drop(MAX_TOMBSTONES + 1, MAX_TOMBSTONES), 1);
    assert_eq!(tombstones_to_drop(10, 3), 7);
    // The cap may be lowered, never raised.
    assert_eq!(tombstones_to_drop(MAX_TOMBSTONES + 1, u64::MAX), 1);
    // The tombstone just inserted always survives.
    assert_eq!(tombstones_to_drop(5, 0), 4);
    assert_eq!(tombstones_to_drop(u64::MAX, 1), u64::MAX - 1);
}

// ---- audit rotation ----------------------------------------------------------------

fn aseg(ordinal: u32, charged: u64, sealed: bool, newest: i64) -> AuditSegment {
    AuditSegment {
        ordinal,
        charged,
        sealed,
        newest_unix_ms: newest,
    }
}

#[test]
fn audit_rotation_by_budget_drops_oldest_complete_segments() {
    let segs = [
        aseg(2, 40, true, 30),
        aseg(1, 40, true, 20),
        aseg(3, 40, false, 40),
    ];
    let r = plan_audit_rotation(&segs, 120, 0, 1_000, 0);
    assert!(r.fits && r.drop.is_empty());
    let r = plan_audit_rotation(&segs, 120, 0, 1_000, 1);
    assert_eq!((r.drop.clone(), r.freed, r.fits), (vec![1], 40, true));
    let r = plan_audit_rotation(&segs, 119, 0, 1_000, 40);
    assert_eq!(r.drop, vec![1, 2]);
    // The active segment never rotates, even when over budget.
    let r = plan_audit_rotation(&segs, 10, 0, 1_000, 0);
    assert_eq!((r.drop.clone(), r.fits), (vec![1, 2], false));
}

#[test]
fn audit_age_trigger_is_separate_and_zero_disables_it() {
    let segs = [
        aseg(1, 10, true, 100),
        aseg(2, 10, true, 200),
        aseg(3, 10, false, 300),
    ];
    let budget = 100 * MIB;
    assert!(
        plan_audit_rotation(&segs, budget, 0, i64::MAX, 0)
            .drop
            .is_empty()
    );
    assert_eq!(plan_audit_rotation(&segs, budget, 50, 150, 0).drop, vec![1]);
    assert!(
        plan_audit_rotation(&segs, budget, 50, 149, 0)
            .drop
            .is_empty()
    );
    assert_eq!(
        plan_audit_rotation(&segs, budget, 50, 10_000, 0).drop,
        vec![1, 2]
    );
}

// ---- hysteresis -------------------------------------------------------------------------

#[test]
fn hysteresis_engages_at_high_and_releases_below_low() {
    let mut h = Hysteresis::new(100, 40).unwrap();
    assert_eq!(h.observe(99), Transition::Unchanged);
    assert!(!h.is_engaged());
    assert_eq!(h.observe(100), Transition::Engaged);
    assert_eq!(h.observe(500), Transition::Unchanged);
    assert_eq!(h.observe(40), Transition::Unchanged);
    assert!(h.is_engaged());
    assert_eq!(h.observe(39), Transition::Released);
    assert_eq!(h.observe(99), Transition::Unchanged);
    assert_eq!(h.observe(0), Transition::Unchanged);
    assert_eq!((h.high(), h.low()), (100, 40));
    assert_eq!(
        Hysteresis::new(40, 40),
        Err(WatermarkError { high: 40, low: 40 })
    );
    assert!(Hysteresis::new(40, 41).is_err());
    let d = Hysteresis::command_defaults();
    assert_eq!((d.high(), d.low()), (MIB, 256 * 1024));
    let d = Hysteresis::client_daemon_defaults();
    assert_eq!((d.high(), d.low()), (8 * MIB, 4 * MIB));
    let d = Hysteresis::server_ingress_defaults();
    assert_eq!((d.high(), d.low()), (64 * MIB, 32 * MIB));
}

#[test]
fn loss_mode_engages_on_either_and_releases_on_both() {
    let mut m = LossMode::new(
        Hysteresis::new(100, 40).unwrap(),
        Hysteresis::new(1_000, 400).unwrap(),
    );
    assert_eq!(m.observe(99, 999), Transition::Unchanged);
    assert_eq!(m.observe(0, 1_000), Transition::Engaged);
    // The daemon fell below its low, but the command backlog has not.
    assert_eq!(m.observe(40, 0), Transition::Unchanged);
    assert!(m.is_engaged());
    assert_eq!(m.observe(39, 399), Transition::Released);
    assert_eq!(m.observe(100, 0), Transition::Engaged);
    assert_eq!(m.observe(0, 400), Transition::Unchanged);
    assert_eq!(m.observe(0, 399), Transition::Released);
}
