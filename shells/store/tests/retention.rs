#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Retention on real SQLite and real files (plan §5.4, §5.6): command-window
//! and command-total rotation, per-client and global whole-command
//! eviction, active-command protection, age reclamation, eviction crash
//! safety (a crash between every step, and a failing filesystem), and the
//! tombstone FIFO cap. Every test ends with the counters equal to a recount.

mod support;

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_retention::Tiers;
use rvbox_store::crash::CrashHook;
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::events::EventOutcome;
use rvbox_store::fs::{FaultKind, FaultOp, FaultyFs, RealFs, StoreFs};
use rvbox_store::mutations::OpError;
use rvbox_store::retention::{EvictOutcome, EvictionCause, points};
use rvbox_store::{Store, StoreOptions};
use support::*;

const KIB: u64 = 1024;

fn tiers(window: u64, total: u64, owner: u64, global: u64) -> Tiers {
    let mut t = Tiers::server_defaults();
    t.command_output_window = window;
    t.command_total = total;
    t.per_owner_total = owner;
    t.global_total = global;
    t.free_space_floor = 0;
    t.validate().unwrap();
    t
}

fn opts(tiers: Tiers, seal: u64) -> StoreOptions {
    StoreOptions {
        tiers,
        seal_bytes: seal,
        eviction_slack_bytes: 0,
        terminal_retention_ms: 0,
        ..StoreOptions::default()
    }
}

fn reopen(dir: &Path, o: StoreOptions) -> Store {
    open_with(dir, Arc::new(RealFs), o)
}

/// A running command issued at `NOW + k` (issue order = k order).
fn command_at(s: &mut Store, client: &str, k: i64) -> [u8; 16] {
    let t = NOW + k;
    let id = uuid_v7(&OsEntropy, t).unwrap();
    s.run_command(&run_request(&id, client, "make test"), t)
        .unwrap();
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    let r = s
        .append_events(&[lifecycle(&id, 1, Lifecycle::Running)], t)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    id
}

/// Appends `n` output chunks of `len` bytes from `seq`, one batch each;
/// returns the next sequence.
fn fill(s: &mut Store, id: &[u8; 16], seq: u64, n: u64, len: usize) -> u64 {
    for q in seq..seq + n {
        let r = s
            .append_events(&[output(id, q, &chunk(q, len))], NOW + 100)
            .unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended], "seq {q}");
    }
    seq + n
}

fn finish(s: &mut Store, id: &[u8; 16], seq: u64) {
    let r = s
        .append_events(&[lifecycle(id, seq, Lifecycle::Succeeded)], NOW + 100)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
}

fn q_u64(s: &Store, sql: &str, id: &[u8]) -> u64 {
    let v: i64 = s.db().query_row(sql, [id], |r| r.get(0)).unwrap();
    u64::try_from(v).unwrap()
}

fn command_charged(s: &Store, id: &[u8; 16]) -> u64 {
    q_u64(
        s,
        "SELECT charged_bytes FROM commands WHERE issue_uuid = ?1",
        id,
    )
}

fn client_charged(s: &Store, client: &str) -> u64 {
    let v: i64 = s
        .db()
        .query_row(
            "SELECT charged_bytes FROM clients WHERE client_id = ?1",
            [client],
            |r| r.get(0),
        )
        .unwrap();
    u64::try_from(v).unwrap()
}

fn exists(s: &Store, id: &[u8; 16]) -> bool {
    s.db()
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM commands WHERE issue_uuid = ?1)",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap()
}

fn tombstoned(s: &Store, id: &[u8; 16]) -> bool {
    s.db()
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM command_tombstones WHERE issue_uuid = ?1)",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap()
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn files_of(s: &Store, id: &[u8; 16]) -> usize {
    let prefix: String = id.iter().map(|b| format!("{b:02x}")).collect();
    s.layout()
        .segment_dirs()
        .iter()
        .filter(|d| d.exists())
        .flat_map(|d| files(d))
        .collect::<Vec<_>>()
        .iter()
        .chain(files(&s.layout().trash_dir()).iter())
        .filter(|n| n.starts_with(&prefix))
        .count()
}

fn pending(s: &Store) -> u64 {
    q_u64(
        s,
        "SELECT COUNT(*) FROM pending_deletions WHERE ?1 IS NOT NULL",
        b"x",
    )
}

/// The command's output counter equals the charges of its live segments,
/// and it stays below its counter.
fn assert_output_recount(s: &Store, id: &[u8; 16]) {
    let output = q_u64(
        s,
        "SELECT output_charged FROM commands WHERE issue_uuid = ?1",
        id,
    );
    let segs = q_u64(
        s,
        "SELECT COALESCE(SUM(charged_bytes), 0) FROM command_segments
         WHERE issue_uuid = ?1 AND state IN ('active', 'sealed')",
        id,
    );
    assert_eq!(output, segs, "output counter differs from its segments");
    assert!(output <= command_charged(s, id));
}

#[derive(Debug, PartialEq, Eq)]
struct Trunc {
    first: u64,
    last: u64,
    raw: u64,
    stored: u64,
    source: i32,
    mask: Option<i64>,
}

fn truncations(s: &Store, id: &[u8; 16]) -> Vec<Trunc> {
    let mut stmt = s
        .db()
        .prepare(
            "SELECT first_seq, last_seq, raw_bytes, stored_bytes, source, stream_mask
             FROM output_truncations WHERE issue_uuid = ?1 ORDER BY first_seq",
        )
        .unwrap();
    stmt.query_map([id.as_slice()], |r| {
        Ok(Trunc {
            first: u64::try_from(r.get::<_, i64>(0)?).unwrap(),
            last: u64::try_from(r.get::<_, i64>(1)?).unwrap(),
            raw: u64::try_from(r.get::<_, i64>(2)?).unwrap(),
            stored: u64::try_from(r.get::<_, i64>(3)?).unwrap(),
            source: r.get(4)?,
            mask: r.get(5)?,
        })
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// Exact raw and stored totals of the output events `first..=last`, each
/// written as `output(id, seq, &chunk(seq, len))` (a rotation deletes the
/// rows of the events it removes, so the totals come from what was sent).
fn event_totals(first: u64, last: u64, len: usize) -> (u64, u64) {
    (first..=last).fold((0, 0), |(raw, stored), q| {
        let ev = output(&[0; 16], q, &chunk(q, len));
        let rvbox_store::events::EventBody::Output {
            raw_len, stored: s, ..
        } = ev.body
        else {
            unreachable!()
        };
        (raw + u64::from(raw_len), stored + s.len() as u64)
    })
}

/// Event rows a command still has in `first..=last`.
fn rows_in(s: &Store, id: &[u8; 16], first: u64, last: u64) -> u64 {
    let v: i64 = s
        .db()
        .query_row(
            "SELECT COUNT(*) FROM command_events WHERE issue_uuid = ?1 AND event_seq BETWEEN ?2 AND ?3",
            rusqlite::params![id.as_slice(), first as i64, last as i64],
            |r| r.get(0),
        )
        .unwrap();
    u64::try_from(v).unwrap()
}

#[test]
fn command_window_rotation_records_exact_truncations() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(tiers(64 * KIB, 512 * KIB, 4096 * KIB, 8192 * KIB), 16 * KIB);
    let mut s = reopen(dir.path(), o.clone());
    let id = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &id, 2, 40, 4096);

    let t = truncations(&s, &id);
    assert!(!t.is_empty(), "the window rotated");
    // contiguous removed ranges from the first output event, each exact
    let mut expect_first = 2;
    for tr in &t {
        assert_eq!(tr.first, expect_first);
        assert_eq!(
            tr.source,
            wire::TruncationSource::ServerCommandWindow as i32
        );
        assert_eq!((tr.raw, tr.stored), event_totals(tr.first, tr.last, 4096));
        assert_eq!(
            rows_in(&s, &id, tr.first, tr.last),
            0,
            "rows go with records"
        );
        assert_eq!(tr.mask, Some(3), "both streams lost bytes");
        expect_first = tr.last + 1;
    }
    // what remains is exactly the rest, readable and verified
    let kept = verify_output(&s, &id);
    assert_eq!(kept, (expect_first..next).collect::<Vec<_>>());
    // the window holds, and the counters equal their recounts
    let out_charged = q_u64(
        &s,
        "SELECT output_charged FROM commands WHERE issue_uuid = ?1",
        &id,
    );
    assert!(out_charged <= 64 * KIB, "{out_charged}");
    assert_output_recount(&s, &id);
    // rotated files are gone, nothing is left pending, and an old event's
    // duplicate is still recognised (the truncation covers its sequence)
    let rotated = q_u64(
        &s,
        "SELECT COUNT(*) FROM command_segments WHERE issue_uuid = ?1 AND state = 'rotated'",
        &id,
    );
    let live = q_u64(
        &s,
        "SELECT COUNT(*) FROM command_segments WHERE issue_uuid = ?1 AND state <> 'rotated'",
        &id,
    );
    assert!(rotated > 0);
    assert_eq!(files_of(&s, &id) as u64, live);
    assert!(files(&s.layout().trash_dir()).is_empty());
    assert_eq!(pending(&s), 0);
    let dup = s
        .append_events(&[output(&id, 2, &chunk(2, 4096))], NOW + 200)
        .unwrap();
    assert_eq!(dup.outcomes, vec![EventOutcome::Duplicate]);
    assert_counters(&s);

    // a restart keeps all of it
    drop(s);
    let s = reopen(dir.path(), o);
    assert_eq!(verify_output(&s, &id), kept);
    assert_output_recount(&s, &id);
    assert_counters(&s);
}

#[test]
fn a_lowered_window_rotates_at_the_next_maintenance_pass() {
    let dir = tempfile::tempdir().unwrap();
    let wide = opts(
        tiers(256 * KIB, 512 * KIB, 4096 * KIB, 8192 * KIB),
        16 * KIB,
    );
    let mut s = reopen(dir.path(), wide);
    let ids: Vec<_> = (0..3)
        .map(|k| {
            let id = command_at(&mut s, "web-1", k);
            fill(&mut s, &id, 2, 20, 4096);
            id
        })
        .collect();
    assert!(ids.iter().all(|id| truncations(&s, id).is_empty()));
    drop(s);
    // the window is lowered below what each command holds
    let narrow = opts(tiers(32 * KIB, 512 * KIB, 4096 * KIB, 8192 * KIB), 16 * KIB);
    let mut s = reopen(dir.path(), narrow);
    let r = s.maintain(NOW + 1).unwrap();
    assert_eq!(r.rotations, 3, "{r:?}");
    for id in &ids {
        let out_charged = q_u64(
            &s,
            "SELECT output_charged FROM commands WHERE issue_uuid = ?1",
            id,
        );
        assert!(out_charged <= 32 * KIB, "{out_charged}");
        assert!(!truncations(&s, id).is_empty());
        assert_output_recount(&s, id);
    }
    // the next pass finds nothing due
    assert_eq!(s.maintain(NOW + 2).unwrap().rotations, 0);
    assert_counters(&s);
}

#[test]
fn command_total_rotation_records_the_total_source() {
    let dir = tempfile::tempdir().unwrap();
    // the window is as large as the total allows: the total binds first
    let o = opts(
        tiers(192 * KIB, 256 * KIB, 4096 * KIB, 8192 * KIB),
        16 * KIB,
    );
    let mut s = reopen(dir.path(), o);
    let id = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &id, 2, 60, 4096);
    let t = truncations(&s, &id);
    assert!(!t.is_empty());
    for tr in &t {
        assert_eq!(tr.source, wire::TruncationSource::ServerCommandTotal as i32);
        assert_eq!((tr.raw, tr.stored), event_totals(tr.first, tr.last, 4096));
        assert_eq!(rows_in(&s, &id, tr.first, tr.last), 0);
    }
    assert!(command_charged(&s, &id) <= 256 * KIB);
    let kept = verify_output(&s, &id);
    assert_eq!(*kept.last().unwrap(), next - 1);
    assert_output_recount(&s, &id);
    // the closeout headroom is intact: the terminal event still fits
    finish(&mut s, &id, next);
    assert_counters(&s);
}

#[test]
fn per_client_whole_command_eviction_takes_the_oldest_terminal_commands() {
    let dir = tempfile::tempdir().unwrap();
    let big = tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB);
    let mut s = reopen(dir.path(), opts(big.clone(), 64 * KIB));
    let mut a = Vec::new();
    for k in 0..4 {
        let id = command_at(&mut s, "web-a", k);
        let next = fill(&mut s, &id, 2, 10, 8192);
        finish(&mut s, &id, next);
        a.push(id);
    }
    let b = command_at(&mut s, "web-b", 1);
    let next = fill(&mut s, &b, 2, 10, 8192);
    finish(&mut s, &b, next);
    let used = client_charged(&s, "web-a");
    let c0 = command_charged(&s, &a[0]);
    let c1 = command_charged(&s, &a[1]);
    assert_counters(&s);
    drop(s);

    // the per-client tier is lowered so the two oldest must go
    let mut small = big.clone();
    small.per_owner_total = used - c0 - c1 / 2;
    small.command_total = small.command_total.min(small.per_owner_total);
    small.command_output_window = small.command_output_window.min(small.command_total / 2);
    let mut s = reopen(dir.path(), opts(small, 64 * KIB));
    let files_before = files_of(&s, &a[2]);
    let report = s.maintain(NOW + 1000).unwrap();
    assert_eq!(report.evicted_quota, 2, "{report:?}");
    assert_eq!(report.owner_shortfall, 0);
    assert!(!exists(&s, &a[0]) && !exists(&s, &a[1]));
    assert!(exists(&s, &a[2]) && exists(&s, &a[3]) && exists(&s, &b));
    assert_eq!(client_charged(&s, "web-a"), used - c0 - c1);
    // whole records: rows, files and pending deletions are gone; the
    // tombstone stays and guards the id
    for id in &a[..2] {
        assert!(tombstoned(&s, id));
        assert_eq!(files_of(&s, id), 0);
        for table in ["command_events", "command_segments", "control_mutations"] {
            let col = if table == "control_mutations" {
                "command_uuid"
            } else {
                "issue_uuid"
            };
            let n = q_u64(
                &s,
                &format!("SELECT COUNT(*) FROM {table} WHERE {col} = ?1"),
                id,
            );
            assert_eq!(n, 0, "{table}");
        }
        match s.run_command(&run_request(id, "web-a", "make test"), NOW + 2000) {
            Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::AlreadyExecuted),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(files_of(&s, &a[2]), files_before);
    assert!(files(&s.layout().trash_dir()).is_empty());
    assert_eq!(pending(&s), 0);
    assert_eq!(verify_output(&s, &a[2]).len(), 10);
    // a second pass has nothing to do
    let again = s.maintain(NOW + 1001).unwrap();
    assert_eq!(again.evicted_quota, 0);
    assert_counters(&s);
}

#[test]
fn global_whole_command_eviction_spans_clients_in_issue_order() {
    let dir = tempfile::tempdir().unwrap();
    let big = tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB);
    let mut s = reopen(dir.path(), opts(big.clone(), 64 * KIB));
    // issue order: web-b, web-a, web-c
    let order = [("web-b", 0), ("web-a", 1), ("web-c", 2)];
    let mut ids = Vec::new();
    for (client, k) in order {
        let id = command_at(&mut s, client, k);
        let next = fill(&mut s, &id, 2, 8, 8192);
        finish(&mut s, &id, next);
        ids.push(id);
    }
    let global: u64 = ["web-a", "web-b", "web-c"]
        .iter()
        .map(|c| client_charged(&s, c))
        .sum();
    let first = command_charged(&s, &ids[0]);
    drop(s);

    let mut small = big;
    small.global_total = global - first - 1;
    let mut s = reopen(dir.path(), opts(small, 64 * KIB));
    let report = s.maintain(NOW + 1000).unwrap();
    assert_eq!(report.evicted_quota, 2, "{report:?}");
    assert_eq!(report.global_shortfall, 0);
    assert!(!exists(&s, &ids[0]) && !exists(&s, &ids[1]));
    assert!(exists(&s, &ids[2]));
    assert_eq!(client_charged(&s, "web-b"), 0);
    assert_eq!(client_charged(&s, "web-a"), 0);
    assert!(tombstoned(&s, &ids[0]) && tombstoned(&s, &ids[1]));
    assert_eq!(files_of(&s, &ids[0]) + files_of(&s, &ids[1]), 0);
    assert_counters(&s);
}

#[test]
fn active_commands_are_never_evicted_and_new_data_is_refused_instead() {
    let dir = tempfile::tempdir().unwrap();
    // one big segment: the active command's output cannot rotate
    let t = tiers(512 * KIB, 600 * KIB, 600 * KIB, 64 * 1024 * KIB);
    let mut o = opts(t, 4096 * KIB);
    o.eviction_slack_bytes = 300 * KIB;
    let mut s = reopen(dir.path(), o);
    let old = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &old, 2, 6, 8192);
    finish(&mut s, &old, next);
    let active = command_at(&mut s, "web-1", 1);
    let mut seq = 2;
    let refused = loop {
        let r = s
            .append_events(&[output(&active, seq, &chunk(seq, 8192))], NOW + 100)
            .unwrap();
        match &r.outcomes[0] {
            EventOutcome::Appended => seq += 1,
            EventOutcome::Refused(e) => break e.code(),
            other => panic!("{other:?}"),
        }
        assert!(seq < 200);
    };
    assert_eq!(refused, Code::QuotaExceeded);

    let report = s.maintain(NOW + 1000).unwrap();
    assert_eq!(report.evicted_quota, 1, "the terminal command goes");
    assert!(!exists(&s, &old));
    assert!(exists(&s, &active), "the active command is never evicted");
    assert!(report.owner_shortfall > 0, "{report:?}");
    assert_eq!(report.pressure_rotations, 0, "nothing sealed to rotate");
    assert_eq!(verify_output(&s, &active), (2..seq).collect::<Vec<_>>());
    assert_eq!(
        s.evict_command(&active, EvictionCause::ClientQuota, NOW + 1000)
            .unwrap(),
        EvictOutcome::Active
    );
    assert_counters(&s);

    // with sealed output, pressure from active data alone rotates the
    // oldest active command's oldest output with an exact marker instead
    // of evicting it, and the freed room takes new data again
    drop(s);
    let t = tiers(236 * KIB, 300 * KIB, 400 * KIB, 64 * 1024 * KIB);
    let mut o = opts(t, 32 * KIB);
    o.eviction_slack_bytes = 100 * KIB;
    let dir2 = tempfile::tempdir().unwrap();
    let mut s = reopen(dir2.path(), o);
    let a = command_at(&mut s, "web-1", 0);
    let a_next = fill(&mut s, &a, 2, 20, 8192);
    let b = command_at(&mut s, "web-1", 1);
    let mut seq = 2;
    let refused = loop {
        let r = s
            .append_events(&[output(&b, seq, &chunk(seq, 8192))], NOW + 100)
            .unwrap();
        match &r.outcomes[0] {
            EventOutcome::Appended => seq += 1,
            EventOutcome::Refused(e) => break e.code(),
            other => panic!("{other:?}"),
        }
        assert!(seq < 200);
    };
    assert_eq!(refused, Code::QuotaExceeded);
    let before = client_charged(&s, "web-1");
    let report = s.maintain(NOW + 1000).unwrap();
    assert!(report.pressure_rotations > 0, "{report:?}");
    assert_eq!(report.owner_shortfall, 0, "{report:?}");
    assert!(exists(&s, &a) && exists(&s, &b));
    assert!(client_charged(&s, "web-1") <= before - 100 * KIB);
    let t = truncations(&s, &a);
    assert_eq!(t.len(), 1);
    assert_eq!(
        t[0].source,
        wire::TruncationSource::ServerClientQuota as i32
    );
    assert_eq!(t[0].first, 2);
    assert_eq!(
        (t[0].raw, t[0].stored),
        event_totals(t[0].first, t[0].last, 8192)
    );
    assert_eq!(rows_in(&s, &a, t[0].first, t[0].last), 0);
    assert_eq!(
        verify_output(&s, &a),
        (t[0].last + 1..a_next).collect::<Vec<_>>()
    );
    assert!(truncations(&s, &b).is_empty());
    let r = s
        .append_events(&[output(&b, seq, &chunk(seq, 8192))], NOW + 1100)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    assert_output_recount(&s, &a);
    assert_output_recount(&s, &b);
    assert_counters(&s);
}

#[test]
fn age_reclamation_and_zero_disables_it() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB);
    let mut o = opts(t.clone(), 64 * KIB);
    o.terminal_retention_ms = 10_000;
    let mut s = reopen(dir.path(), o.clone());
    let done = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &done, 2, 3, 1000);
    finish(&mut s, &done, next); // terminal at NOW + 100
    let active = command_at(&mut s, "web-1", 1);
    fill(&mut s, &active, 2, 3, 1000);

    let r = s.maintain(NOW + 100 + 9_999).unwrap();
    assert_eq!(r.evicted_aged, 0);
    assert!(exists(&s, &done));
    let r = s.maintain(NOW + 100 + 10_000).unwrap();
    assert_eq!(r.evicted_aged, 1);
    assert!(!exists(&s, &done));
    assert!(tombstoned(&s, &done), "the compact tombstone stays");
    assert_eq!(files_of(&s, &done), 0);
    assert!(exists(&s, &active), "active commands never age out");
    assert_counters(&s);

    // 0 disables age reclamation entirely
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(t, 64 * KIB);
    o.terminal_retention_ms = 0;
    let mut s = reopen(dir.path(), o);
    let done = command_at(&mut s, "web-1", 0);
    finish(&mut s, &done, 2);
    let r = s.maintain(NOW + 10 * 365 * 86_400_000).unwrap();
    assert_eq!(r.evicted_aged, 0);
    assert!(exists(&s, &done));
    assert_counters(&s);
}

#[test]
fn unresolved_incidents_keep_their_commands() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB);
    let mut o = opts(t, 64 * KIB);
    o.terminal_retention_ms = 1;
    let mut s = reopen(dir.path(), o.clone());
    let id = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &id, 2, 2, 1000);
    finish(&mut s, &id, next);
    drop(s);
    // corrupt a committed byte: recovery opens a data-loss incident
    let seg = rvbox_store::layout::Layout::new(dir.path())
        .segment_path(&id, 1)
        .unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[200] ^= 0xff;
    std::fs::write(&seg, &bytes).unwrap();
    let mut s = reopen(dir.path(), o);
    // the sealed segment was verified at seal: the background scrub finds it
    assert_eq!(s.scrub_cycle(NOW).unwrap().segments_damaged, 1);
    let r = s.maintain(NOW + 1_000_000).unwrap();
    assert_eq!(r.evicted_aged, 0);
    assert!(exists(&s, &id));
    assert_eq!(
        s.evict_command(&id, EvictionCause::TerminalAge, NOW + 1_000_000)
            .unwrap(),
        EvictOutcome::Dirty
    );
    assert_counters(&s);
}

/// Panics (an in-process power cut) the first time `point` is reached.
#[derive(Debug)]
struct StopAt {
    point: &'static str,
    hits: AtomicU32,
}

impl CrashHook for StopAt {
    fn at(&self, point: &'static str) {
        if point == self.point && self.hits.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("power cut at {point}");
        }
    }
}

#[test]
fn eviction_is_crash_safe_at_every_step() {
    for point in [
        points::EVICT_AFTER_MARK,
        points::EVICT_AFTER_MOVE,
        points::EVICT_AFTER_DELETE,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let o = opts(
            tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB),
            8 * KIB,
        );
        let mut s = reopen(dir.path(), o.clone());
        let gone = command_at(&mut s, "web-1", 0);
        let next = fill(&mut s, &gone, 2, 6, 3000);
        finish(&mut s, &gone, next);
        let kept = command_at(&mut s, "web-1", 1);
        fill(&mut s, &kept, 2, 3, 3000);
        let remaining = command_charged(&s, &kept);
        s.set_crash_hook(Arc::new(StopAt {
            point,
            hits: AtomicU32::new(0),
        }));
        let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            s.evict_command(&gone, EvictionCause::ClientQuota, NOW + 1000)
        }));
        assert!(crashed.is_err(), "{point} was reached");
        drop(s);

        // restart: recovery's sweeper completes the eviction
        let s = reopen(dir.path(), o);
        assert!(!exists(&s, &gone), "{point}");
        assert!(tombstoned(&s, &gone), "{point}");
        assert_eq!(files_of(&s, &gone), 0, "{point}");
        assert!(files(&s.layout().trash_dir()).is_empty(), "{point}");
        assert_eq!(pending(&s), 0, "{point}");
        assert_eq!(client_charged(&s, "web-1"), remaining, "{point}");
        assert_eq!(verify_output(&s, &kept), vec![2, 3, 4]);
        let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
        assert!(open.is_empty(), "{point}: {open:?}");
        assert_counters(&s);
    }
}

#[test]
fn rotation_is_crash_safe_after_its_commit() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(tiers(24 * KIB, 512 * KIB, 4096 * KIB, 8192 * KIB), 8 * KIB);
    let mut s = reopen(dir.path(), o.clone());
    let id = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &id, 2, 4, 3000);
    s.set_crash_hook(Arc::new(StopAt {
        point: points::ROTATE_AFTER_MARK,
        hits: AtomicU32::new(0),
    }));
    let mut seq = next;
    let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| {
        for _ in 0..20 {
            s.append_events(&[output(&id, seq, &chunk(seq, 3000))], NOW + 100)
                .unwrap();
            seq += 1;
        }
    }));
    assert!(crashed.is_err());
    drop(s);
    let s = reopen(dir.path(), o);
    let t = truncations(&s, &id);
    assert_eq!(t.len(), 1);
    let kept = verify_output(&s, &id);
    assert_eq!(kept.first().copied(), Some(t[0].last + 1));
    let rotated_files = q_u64(
        &s,
        "SELECT COUNT(*) FROM command_segments WHERE issue_uuid = ?1 AND state = 'rotated'",
        &id,
    );
    assert!(rotated_files > 0);
    let live = q_u64(
        &s,
        "SELECT COUNT(*) FROM command_segments WHERE issue_uuid = ?1 AND state <> 'rotated'",
        &id,
    );
    assert_eq!(files_of(&s, &id) as u64, live);
    assert_eq!(pending(&s), 0);
    assert_output_recount(&s, &id);
    assert_counters(&s);
}

#[test]
fn a_failed_eviction_records_an_incident_and_rolls_forward() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultyFs::new();
    let o = opts(
        tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB),
        8 * KIB,
    );
    let mut s = open_with(
        dir.path(),
        Arc::new(fs.clone()) as Arc<dyn StoreFs>,
        o.clone(),
    );
    let id = command_at(&mut s, "web-1", 0);
    let next = fill(&mut s, &id, 2, 5, 3000);
    finish(&mut s, &id, next);
    fs.inject(FaultOp::Rename, FaultKind::PermissionDenied);
    assert_eq!(
        s.evict_command(&id, EvictionCause::TerminalAge, NOW + 1000)
            .unwrap(),
        EvictOutcome::Failed
    );
    assert_eq!(fs.injected(), 1);
    let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].kind, wire::IncidentKind::FailedEviction);
    assert!(open[0].repairable && !open[0].data_loss);
    assert!(exists(&s, &id), "still evicting");
    assert_counters(&s);

    // the next maintenance pass rolls it forward and repairs the incident
    let r = s.maintain(NOW + 2000).unwrap();
    assert_eq!(r.rolled_forward, 1, "{r:?}");
    assert!(!exists(&s, &id));
    assert!(tombstoned(&s, &id));
    assert_eq!(files_of(&s, &id), 0);
    assert!(rvbox_store::incidents::open(s.db(), 10).unwrap().is_empty());
    let repaired = rvbox_store::incidents::get(s.db(), &open[0].id)
        .unwrap()
        .unwrap();
    assert_eq!(repaired.state, wire::IncidentState::Repaired);
    assert_eq!(client_charged(&s, "web-1"), 0);

    // a trash file that cannot be removed stays pending until it can
    let id2 = command_at(&mut s, "web-1", 1);
    let next = fill(&mut s, &id2, 2, 2, 3000);
    finish(&mut s, &id2, next);
    fs.inject(FaultOp::Remove, FaultKind::Io);
    assert!(matches!(
        s.evict_command(&id2, EvictionCause::TerminalAge, NOW + 3000)
            .unwrap(),
        EvictOutcome::Evicted { .. }
    ));
    assert!(pending(&s) > 0);
    drop(s);
    let s = open_with(dir.path(), Arc::new(fs) as Arc<dyn StoreFs>, o);
    assert_eq!(pending(&s), 0);
    assert!(files(&s.layout().trash_dir()).is_empty());
    assert_counters(&s);
}

#[test]
fn tombstone_fifo_cap_holds_through_terminal_events_and_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(
        tiers(1024 * KIB, 2048 * KIB, 64 * 1024 * KIB, 128 * 1024 * KIB),
        64 * KIB,
    );
    o.tombstone_cap = 3;
    let mut s = reopen(dir.path(), o);
    let mut ids = Vec::new();
    for k in 0..5 {
        let id = command_at(&mut s, "web-1", k);
        finish(&mut s, &id, 2);
        ids.push(id);
    }
    let count = |s: &Store| {
        q_u64(
            s,
            "SELECT COUNT(*) FROM command_tombstones WHERE ?1 IS NOT NULL",
            b"x",
        )
    };
    assert_eq!(count(&s), 3);
    assert!(!tombstoned(&s, &ids[0]) && !tombstoned(&s, &ids[1]));
    assert!(ids[2..].iter().all(|id| tombstoned(&s, id)));
    // evicting a command whose tombstone the FIFO already dropped writes it
    // again (the newest), still within the cap
    assert!(matches!(
        s.evict_command(&ids[0], EvictionCause::GlobalQuota, NOW + 1000)
            .unwrap(),
        EvictOutcome::Evicted { .. }
    ));
    assert_eq!(count(&s), 3);
    assert!(tombstoned(&s, &ids[0]));
    assert!(!tombstoned(&s, &ids[2]));
    assert_counters(&s);
}

/// Truncation rows of events dropped on arrival.
fn drop_rows(s: &Store, id: &[u8; 16]) -> Vec<(u64, u64)> {
    let mut st = s
        .db()
        .prepare(
            "SELECT first_seq, last_seq FROM output_truncations
             WHERE issue_uuid = ?1 AND reason LIKE '%dropped on arrival%' ORDER BY first_seq",
        )
        .unwrap();
    st.query_map([id.as_slice()], |r| {
        Ok((
            u64::try_from(r.get::<_, i64>(0)?).unwrap(),
            u64::try_from(r.get::<_, i64>(1)?).unwrap(),
        ))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

#[test]
fn many_small_output_events_rotate_within_the_command_total_for_ever() {
    // a long-running command writing short lines: each line is an event,
    // and the rows of rotated events would fill the total (1,500 rows of
    // 256 charged bytes are more than it holds) unless they go with their
    // records, after which every later line would be dropped on arrival
    let dir = tempfile::tempdir().unwrap();
    let o = opts(tiers(64 * KIB, 192 * KIB, 4096 * KIB, 8192 * KIB), 2 * KIB);
    let mut s = reopen(dir.path(), o);
    let id = command_at(&mut s, "web-1", 0);
    let mut seq = 2u64;
    while seq < 1502 {
        let batch: Vec<_> = (seq..seq + 25)
            .map(|q| output(&id, q, format!("line {q} of a long log\n").as_bytes()))
            .collect();
        let r = s.append_events(&batch, NOW + 100).unwrap();
        assert!(
            r.outcomes.iter().all(|o| *o == EventOutcome::Appended),
            "at {seq}: {:?}",
            r.outcomes
        );
        seq += 25;
    }
    assert_eq!(drop_rows(&s, &id), vec![], "nothing was dropped on arrival");
    let t = truncations(&s, &id);
    assert!(!t.is_empty(), "the window rotated");
    let mut expect_first = 2;
    for tr in &t {
        assert_eq!(tr.first, expect_first, "{t:?}");
        assert_eq!(rows_in(&s, &id, tr.first, tr.last), 0);
        expect_first = tr.last + 1;
    }
    assert_eq!(
        verify_output(&s, &id),
        (expect_first..seq).collect::<Vec<_>>()
    );
    assert!(command_charged(&s, &id) <= 192 * KIB);
    let rows = q_u64(
        &s,
        "SELECT COUNT(*) FROM command_events WHERE issue_uuid = ?1",
        &id,
    );
    assert!(rows < 200, "{rows} event rows are left");
    finish(&mut s, &id, seq);
    assert_counters(&s);
}

#[test]
fn a_full_command_total_drops_diagnostics_and_still_takes_the_stdin_close_and_the_end() {
    use prost::Message as _;
    let dir = tempfile::tempdir().unwrap();
    let o = opts(tiers(64 * KIB, 192 * KIB, 4096 * KIB, 8192 * KIB), 2 * KIB);
    let mut s = reopen(dir.path(), o);
    let id = command_at(&mut s, "web-1", 0);
    // stdin the client has not taken yet fills the total: it cannot rotate
    let caller = rvbox_store::operator::Caller::local();
    let mut writes = 0;
    let refusal = loop {
        let req = wire::AppendStdinRequest {
            request_id: text(&new_id()),
            issue_uuid: text(&id),
            data: chunk(writes + 7, 8 * 1024),
            newline: wire::StdinNewline::Raw as i32,
        };
        match s.append_stdin_as(&req, &caller, NOW + 10) {
            Ok(_) => writes += 1,
            Err(e) => break e.to_domain(),
        }
        assert!(writes < 100);
    };
    assert_eq!(refusal.code(), Code::QuotaExceeded, "{refusal:?}");
    assert!(writes > 0);

    // diagnostics fill what is left, until one cannot be stored: it is
    // dropped with a marker, never refused (that would hold back every
    // later event), and output after it extends the same marker
    let diag = |seq: u64| rvbox_store::events::EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: seq,
        observed_ms: NOW + 20,
        body: rvbox_store::events::EventBody::Other {
            kind: rvbox_store_port::events::body_kind::DIAGNOSTICS,
            encoded: wire::Diagnostics::default().encode_to_vec(),
        },
    };
    let mut seq = 2;
    while drop_rows(&s, &id).is_empty() {
        let r = s.append_events(&[diag(seq)], NOW + 20).unwrap();
        assert_eq!(r.outcomes, vec![EventOutcome::Appended], "at {seq}");
        seq += 1;
        assert!(seq < 100);
    }
    let dropped = seq - 1;
    assert_eq!(drop_rows(&s, &id), vec![(dropped, dropped)]);
    let r = s
        .append_events(&[output(&id, seq, &chunk(seq, 100))], NOW + 20)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    assert_eq!(drop_rows(&s, &id), vec![(dropped, seq)]);
    assert_eq!(rows_in(&s, &id, dropped, seq), 0);
    // a repeat of the dropped diagnostics is a duplicate
    let r = s.append_events(&[diag(dropped)], NOW + 30).unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Duplicate]);

    // closing stdin is part of the command's closeout: the reserve pays
    let req = wire::CloseStdinRequest {
        request_id: text(&new_id()),
        issue_uuid: text(&id),
    };
    s.close_stdin_as(&req, &caller, NOW + 40).unwrap();
    finish(&mut s, &id, seq + 1);
    assert_eq!(last_seq(&s, &id), seq + 1);
    assert_counters(&s);
}
