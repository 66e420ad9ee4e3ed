#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The store's connection keeps prepared statements prepared: a cached
//! statement rebound to new values, and run again after the store's own
//! writes, is never parsed and planned again (a partial index's predicate
//! would otherwise mark every statement it is tested against for a new
//! preparation at each rebinding).

mod support;

use rusqlite::StatementStatus;
use support::*;

#[test]
fn a_cached_statement_is_not_prepared_again_when_rebound_or_after_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let a = running_command(&mut s, "web-1");
    let b = running_command(&mut s, "web-2");
    // planned against the partial index on pending_deletions (issue_uuid IS NOT NULL)
    let queries = [
        "SELECT event_seq FROM command_events WHERE issue_uuid = ?1 ORDER BY event_seq",
        "SELECT COUNT(*) FROM pending_deletions WHERE issue_uuid = ?1",
    ];
    for round in 0..6u64 {
        for q in queries {
            let id = if round % 2 == 0 { a } else { b };
            let mut st = s.db().prepare_cached(q).unwrap();
            let _: Vec<i64> = st
                .query_map([id.as_slice()], |r| r.get(0))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(
                st.get_status(StatementStatus::RePrepare),
                0,
                "round {round}: {q} was prepared again"
            );
        }
        let id = if round % 2 == 0 { a } else { b };
        s.append_events(&[output(&id, round / 2 + 2, &chunk(round, 100))], NOW)
            .unwrap();
    }
}
