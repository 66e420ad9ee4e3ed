#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Group commit across concurrent writers: every writer's events are
//! durable when its call returns, and a failed group acknowledges nothing.

mod support;

use std::sync::Arc;
use std::time::Duration;

use rvbox_store::StoreOptions;
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::{FaultKind, FaultOp, FaultyFs, StoreFs};
use rvbox_store::group::{GroupCommitter, GroupError, GroupOptions};
use support::*;

fn now() -> i64 {
    NOW
}

#[test]
fn concurrent_writers_share_groups_and_every_return_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let ids: Vec<_> = (0..16)
        .map(|i| running_command(&mut s, &format!("web-{i}")))
        .collect();
    let committer = GroupCommitter::spawn(
        s,
        GroupOptions {
            max_batch: 64,
            max_delay: Duration::from_millis(5),
            queue: 64,
        },
        now,
    )
    .unwrap();
    std::thread::scope(|scope| {
        for id in &ids {
            let h = committer.handle();
            scope.spawn(move || {
                for seq in 2..=11 {
                    let r = h.append(vec![output(id, seq, &chunk(seq, 1024))]).unwrap();
                    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
                    assert_eq!(r.acked[id], seq);
                }
            });
        }
    });
    let s = committer.stop().unwrap();
    for id in &ids {
        assert_eq!(verify_output(&s, id), (2..=11).collect::<Vec<_>>());
    }
    assert_counters(&s);
}

#[test]
fn a_failed_group_acknowledges_nothing_and_later_groups_proceed() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
    let mut s = open_with(dir.path(), fs_dyn, StoreOptions::default());
    let id = running_command(&mut s, "web-1");
    let committer = GroupCommitter::spawn(s, GroupOptions::default(), now).unwrap();
    let h = committer.handle();
    h.append(vec![output(&id, 2, b"ok")]).unwrap();
    fs.inject(FaultOp::Sync, FaultKind::Io);
    assert!(matches!(
        h.append(vec![output(&id, 3, b"lost")]),
        Err(GroupError::Store(_))
    ));
    let r = h.append(vec![output(&id, 3, b"retried")]).unwrap();
    assert_eq!(r.acked[&id], 3);
    drop(h);
    let s = committer.stop().unwrap();
    assert_eq!(verify_output(&s, &id), vec![2, 3]);
    assert_counters(&s);
}

#[test]
fn one_driver_keeps_many_writers_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let ids: Vec<_> = (0..8)
        .map(|i| running_command(&mut s, &format!("web-{i}")))
        .collect();
    let committer = GroupCommitter::spawn(s, GroupOptions::default(), now).unwrap();
    let h = committer.handle();
    let (replies, acks) = std::sync::mpsc::sync_channel(16);
    let mut next = vec![2u64; ids.len()];
    for (w, id) in ids.iter().enumerate() {
        h.submit(vec![output(id, 2, &chunk(2, 100))], w as u64, &replies)
            .unwrap();
    }
    let mut done = 0;
    while done < ids.len() * 5 {
        let (tag, r) = acks.recv().unwrap();
        let w = usize::try_from(tag).unwrap();
        assert_eq!(r.unwrap().acked[&ids[w]], next[w]);
        done += 1;
        next[w] += 1;
        if next[w] <= 6 {
            h.submit(
                vec![output(&ids[w], next[w], &chunk(next[w], 100))],
                tag,
                &replies,
            )
            .unwrap();
        }
    }
    drop(h);
    let s = committer.stop().unwrap();
    for id in &ids {
        assert_eq!(verify_output(&s, id), (2..=6).collect::<Vec<_>>());
    }
    assert_counters(&s);
}
