#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Property tests for eviction selection and output rotation.

use proptest::prelude::*;
use rvbox_retention::{
    Candidate, FieldMax, Need, OwnerNeed, SegmentUsage, Tiers, Usage, plan_output_rotation,
    select_evictions,
};

const OWNERS: [&str; 3] = ["a", "b", "c"];

fn candidates() -> impl Strategy<Value = Vec<Candidate>> {
    prop::collection::vec(
        (
            0i64..8,
            any::<u8>(),
            0usize..3,
            prop::option::of(0i64..100),
            0u64..500,
        ),
        0..30,
    )
    .prop_map(|rows| {
        rows.into_iter()
            .enumerate()
            .map(|(i, (time, hi, owner, terminal, charged))| {
                let mut uuid = [0u8; 16];
                uuid[0] = hi;
                uuid[15] = u8::try_from(i).unwrap();
                Candidate {
                    issue_time_unix_ms: time,
                    issue_uuid: uuid,
                    owner: OWNERS[owner].to_owned(),
                    terminal_time_unix_ms: terminal,
                    charged,
                }
            })
            .collect()
    })
}

fn need() -> impl Strategy<Value = Need> {
    (prop::option::of((0usize..3, 0u64..3_000)), 0u64..6_000).prop_map(|(owner, global)| Need {
        owner: owner.map(|(o, bytes)| OwnerNeed {
            owner: OWNERS[o].to_owned(),
            bytes,
        }),
        global,
    })
}

fn freed(selected: &[&Candidate], need: &Need) -> (u64, u64) {
    let global = selected.iter().map(|c| c.charged).sum();
    let owner = selected
        .iter()
        .filter(|c| need.owner.as_ref().is_some_and(|o| o.owner == c.owner))
        .map(|c| c.charged)
        .sum();
    (owner, global)
}

fn is_met(freed: (u64, u64), need: &Need) -> bool {
    freed.0 >= need.owner.as_ref().map_or(0, |o| o.bytes) && freed.1 >= need.global
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn evictions_are_terminal_ordered_and_minimal(c in candidates(), need in need()) {
        let s = select_evictions(&c, &need);
        let selected: Vec<&Candidate> = s
            .commands
            .uuids
            .iter()
            .map(|u| c.iter().find(|x| &x.issue_uuid == u).unwrap())
            .collect();
        // Always terminal.
        prop_assert!(selected.iter().all(|x| x.terminal_time_unix_ms.is_some()));
        // Strictly in (issue_time, uuid) order.
        for pair in selected.windows(2) {
            prop_assert!(
                (pair[0].issue_time_unix_ms, pair[0].issue_uuid)
                    < (pair[1].issue_time_unix_ms, pair[1].issue_uuid)
            );
        }
        // Counters and `met` agree with the selection.
        let f = freed(&selected, &need);
        prop_assert_eq!((s.freed_owner, s.freed_global), f);
        prop_assert_eq!(s.met, is_met(f, &need));
        // Minimal: without the last selected command a need is unmet.
        if let Some((_, rest)) = selected.split_last() {
            prop_assert!(!is_met(freed(rest, &need), &need));
        }
        // Not met only when every helpful terminal candidate was taken.
        if !s.met {
            for x in c.iter().filter(|x| x.terminal_time_unix_ms.is_some()) {
                let helps_owner = s.owner_shortfall > 0
                    && need.owner.as_ref().is_some_and(|o| o.owner == x.owner);
                if s.global_shortfall > 0 || helps_owner {
                    prop_assert!(s.commands.uuids.contains(&x.issue_uuid));
                }
            }
        }
    }

    #[test]
    fn rotation_is_a_contiguous_prefix_of_removable_segments(
        rows in prop::collection::vec((1u64..300, any::<bool>(), prop::bool::weighted(0.2)), 1..12),
        incoming in 0u64..600,
        other in 0u64..400,
    ) {
        let tiers = Tiers {
            command_total: 2_000,
            closeout_reserve: 100,
            command_output_window: 1_000,
            per_owner_total: 10_000,
            global_total: 10_000,
            free_space_floor: 0,
            field_max: FieldMax::v1(),
        };
        let last = rows.len() - 1;
        let segs: Vec<SegmentUsage> = rows
            .iter()
            .enumerate()
            .map(|(i, &(charged, sealed, pinned))| {
                let o = u32::try_from(i).unwrap();
                SegmentUsage {
                    ordinal: o,
                    charged,
                    sealed: sealed && i != last,
                    first_seq: u64::from(o) * 4,
                    last_seq: u64::from(o) * 4 + 3,
                    pinned,
                }
            })
            .collect();
        let out: u64 = segs.iter().map(|s| s.charged).sum();
        let command = 100 + out + other;
        let usage = Usage { command, held_closeout: 100, owner: command, global: command, free_space: u64::MAX };
        let plan = plan_output_rotation(&tiers, &usage, &segs, incoming, 20);
        // A prefix of ordinals, each sealed and unpinned.
        for (i, o) in plan.rotate.iter().enumerate() {
            prop_assert_eq!(*o, u32::try_from(i).unwrap());
            let s = &segs[i];
            prop_assert!(s.sealed && !s.pinned);
        }
        let removed: u64 = plan.rotate.iter().map(|&o| segs[o as usize].charged).sum();
        prop_assert_eq!(plan.removed_charged, removed);
        match plan.rotate.last() {
            Some(&l) => prop_assert_eq!(plan.removed_seq_range, Some((0, u64::from(l) * 4 + 3))),
            None => prop_assert_eq!(plan.removed_seq_range, None),
        }
        if plan.fits {
            let marker = if plan.rotate.is_empty() { 0 } else { 20 };
            prop_assert!(out - removed + incoming <= tiers.command_output_window);
            prop_assert!(command - removed + marker + incoming <= tiers.command_total);
            // Minimal: one segment fewer would not have fit.
            if let Some((_, rest)) = plan.rotate.split_last() {
                let less: u64 = rest.iter().map(|&o| segs[o as usize].charged).sum();
                let m = if rest.is_empty() { 0 } else { 20 };
                prop_assert!(
                    out - less + incoming > tiers.command_output_window
                        || command - less + m + incoming > tiers.command_total
                );
            }
        } else {
            prop_assert!(plan.rotate.is_empty());
        }
    }
}
