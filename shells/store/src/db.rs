//! The server store's schema: its migrations, applied through the shared
//! runner of `rvbox-storage` (plan §5.2). Everything else about
//! connections (PRAGMAs, the statement cache, `quick_check`) is the
//! storage base's, re-exported here.

use rusqlite::Connection;

use crate::error::StoreError;

pub use rvbox_storage::db::{
    Cached, DbOptions, Migration, PragmaReport, STATEMENT_CACHE, Synchronous, cache_statements,
    checksum, open, quick_check, read_pragmas,
};

/// Every migration this binary knows, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: include_str!("migrations/0001_initial.sql"),
    },
    Migration {
        version: 2,
        sql: include_str!("migrations/0002_command_signals.sql"),
    },
    Migration {
        version: 3,
        sql: include_str!("migrations/0003_audit_outbox.sql"),
    },
    Migration {
        version: 4,
        sql: include_str!("migrations/0004_client_registry.sql"),
    },
    Migration {
        version: 5,
        sql: include_str!("migrations/0005_operation_counters.sql"),
    },
    Migration {
        version: 6,
        sql: include_str!("migrations/0006_sealed_verified.sql"),
    },
    Migration {
        version: 7,
        sql: include_str!("migrations/0007_foreign_key_indexes.sql"),
    },
    Migration {
        version: 8,
        sql: include_str!("migrations/0008_client_labels.sql"),
    },
    Migration {
        version: 9,
        sql: include_str!("migrations/0009_fleet_runs.sql"),
    },
    Migration {
        version: 10,
        sql: include_str!("migrations/0010_fleet_run_tombstones.sql"),
    },
    Migration {
        version: 11,
        sql: include_str!("migrations/0011_pty_sessions.sql"),
    },
    Migration {
        version: 12,
        sql: include_str!("migrations/0012_audit_chain.sql"),
    },
];

/// Applies every missing server-store migration and validates the
/// recorded ones. Returns the versions applied now.
///
/// # Errors
/// As [`rvbox_storage::db::migrate`].
pub fn migrate(conn: &mut Connection, now_ms: i64) -> Result<Vec<i64>, StoreError> {
    rvbox_storage::db::migrate(conn, MIGRATIONS, now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::params;

    #[test]
    fn migrations_apply_once_and_are_checksummed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sqlite3");
        let mut c = open(&path, DbOptions::default()).unwrap();
        assert_eq!(
            migrate(&mut c, 1).unwrap(),
            vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
        );
        assert_eq!(migrate(&mut c, 2).unwrap(), Vec::<i64>::new());
        quick_check(&c).unwrap();
        // a tampered record refuses to open
        c.execute_cached(
            "UPDATE schema_migrations SET checksum = zeroblob(32) WHERE version = 1",
            [],
        )
        .unwrap();
        assert!(matches!(
            migrate(&mut c, 3),
            Err(StoreError::MigrationChecksum { version: 1 })
        ));
        // a database from a newer binary refuses to open
        c.execute_cached(
            "INSERT INTO schema_migrations VALUES (99, zeroblob(32), 0)",
            [],
        )
        .unwrap();
        assert!(matches!(
            migrate(&mut c, 3),
            Err(StoreError::SchemaTooNew {
                found: 99,
                known: 12
            })
        ));
    }

    #[test]
    fn schema_constraints_hold() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(&dir.path().join("t.sqlite3"), DbOptions::default()).unwrap();
        migrate(&mut c, 1).unwrap();
        c.execute_cached("INSERT INTO clients (client_id) VALUES ('web-1')", [])
            .unwrap();
        let insert_cmd = |c: &Connection, uuid: u8, lifecycle: i64, terminal: Option<i64>| {
            c.execute_cached(
                "INSERT INTO commands (issue_uuid, client_id, issue_time_ms, lifecycle, revision,
                     request_hash, spec_zstd, spec_raw_len, charge_version, terminal_time_ms)
                 VALUES (?1, 'web-1', 10, ?2, 1, zeroblob(32), x'00', 1, 1, ?3)",
                params![vec![uuid; 16], lifecycle, terminal],
            )
        };
        insert_cmd(&c, 1, 1, None).unwrap();
        // a terminal lifecycle needs a terminal time, and only it
        assert!(insert_cmd(&c, 2, 5, None).is_err());
        assert!(insert_cmd(&c, 3, 1, Some(20)).is_err());
        insert_cmd(&c, 4, 5, Some(20)).unwrap();
        // unknown client: foreign key
        assert!(
            c.execute_cached(
                "INSERT INTO commands (issue_uuid, client_id, issue_time_ms, lifecycle, revision,
                     request_hash, spec_zstd, spec_raw_len, charge_version)
                 VALUES (zeroblob(16), 'nobody', 1, 1, 1, zeroblob(32), x'00', 1, 1)",
                [],
            )
            .is_err()
        );
        // negative counters are refused
        assert!(
            c.execute_cached("UPDATE clients SET charged_bytes = -1", [])
                .is_err()
        );
        // unique (command, event_seq)
        let ev = "INSERT INTO command_events (issue_uuid, event_seq, observed_ms, receipt_ms,
                      body_kind, content_sha256) VALUES (?1, 1, 0, 0, 1, zeroblob(32))";
        c.execute_cached(ev, params![vec![1u8; 16]]).unwrap();
        assert!(c.execute_cached(ev, params![vec![1u8; 16]]).is_err());
        // one live session per client
        let s =
            "INSERT INTO sessions (session_id, client_id, instance_id, generation, opened_ms, live)
                 VALUES (?1, 'web-1', zeroblob(16), 1, 0, 1)";
        c.execute_cached(s, params![vec![1u8; 16]]).unwrap();
        assert!(c.execute_cached(s, params![vec![2u8; 16]]).is_err());
        // non-overlapping truncation ranges
        let t = "INSERT INTO output_truncations (issue_uuid, first_seq, last_seq, source, reason, recorded_ms)
                 VALUES (?1, ?2, ?3, 1, 'r', 0)";
        c.execute_cached(t, params![vec![1u8; 16], 1, 5]).unwrap();
        assert!(c.execute_cached(t, params![vec![1u8; 16], 5, 6]).is_err());
        c.execute_cached(t, params![vec![1u8; 16], 6, 9]).unwrap();
        // incident evidence is immutable and a resolved incident never reopens
        c.execute_cached(
            "INSERT INTO storage_incidents (incident_id, kind, state, scope_kind, scope_key,
                 detected_ms, summary, evidence, repairable, data_loss)
             VALUES (zeroblob(16), 1, 1, 1, '', 0, 's', x'01', 1, 0)",
            [],
        )
        .unwrap();
        assert!(
            c.execute_cached("UPDATE storage_incidents SET evidence = x'02'", [])
                .is_err()
        );
        c.execute_cached(
            "UPDATE storage_incidents SET state = 2, resolved_ms = 5",
            [],
        )
        .unwrap();
        assert!(
            c.execute_cached(
                "UPDATE storage_incidents SET state = 1, resolved_ms = NULL",
                []
            )
            .is_err()
        );
        // deleting a command cascades to its events
        c.execute_cached(
            "DELETE FROM commands WHERE issue_uuid = ?1",
            params![vec![1u8; 16]],
        )
        .unwrap();
        let n: i64 = c
            .query_row_cached("SELECT COUNT(*) FROM command_events", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
    }
}
