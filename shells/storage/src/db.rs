//! SQLite connections and migrations (plan §5.1, §5.2, §5.3).
//!
//! Every connection runs in WAL mode with foreign keys on, a busy timeout
//! and an explicit synchronous mode, and every one of those PRAGMAs is read
//! back and checked before the connection is used. Migrations run each in
//! its own `IMMEDIATE` transaction and record a SHA-256 checksum of their
//! SQL; a recorded migration whose checksum differs from this binary's, or a
//! database newer than this binary, refuses to open.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};
use sha2::{Digest, Sha256};

use crate::error::StoreError;

/// SQLite `synchronous` modes RVBox accepts: both make a committed
/// transaction survive power loss in WAL mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    /// `FULL` (2): the WAL is synced at every commit.
    Full,
    /// `EXTRA` (3): `FULL`, and the directory is synced after a journal unlink.
    Extra,
}

impl Synchronous {
    fn pragma_value(self) -> i64 {
        match self {
            Self::Full => 2,
            Self::Extra => 3,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Extra => "EXTRA",
        }
    }
}

/// How connections are opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbOptions {
    /// Durability mode.
    pub synchronous: Synchronous,
    /// How long a writer waits for a lock before failing.
    pub busy_timeout: Duration,
}

impl Default for DbOptions {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
        }
    }
}

/// Opens (creating if needed) the database at `path` and checks every PRAGMA.
///
/// # Errors
/// [`StoreError::Sqlite`] when SQLite fails, [`StoreError::Pragma`] when a
/// PRAGMA did not take the required value.
pub fn open(path: &Path, opts: DbOptions) -> Result<Connection, StoreError> {
    make_private(path)?;
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::sqlite("open database", e))?;
    configure(&conn, opts)?;
    Ok(conn)
}

/// The database holds command text, environment values and inline
/// scripts: its file is created owner-only (0600) before SQLite opens it,
/// so the `-wal` and `-shm` files SQLite makes beside it get the same
/// mode; an existing database (and its `-wal`, `-shm`) that group or
/// others could read is made owner-only, with a warning.
fn make_private(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(StoreError::io("create database file", path, e)),
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let file = Path::new(&name);
        let Ok(meta) = std::fs::metadata(file) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| StoreError::io("make database file private", file, e))?;
            tracing::warn!(
                file = %file.display(),
                was = format!("{mode:03o}"),
                "database file was readable by group or others; set to 600"
            );
        }
    }
    Ok(())
}

/// Statements the store keeps prepared per connection: every statement of
/// every hot path (about 150 distinct texts), with room for the few built
/// with a variable shape.
pub const STATEMENT_CACHE: usize = 512;

/// Statement-cached forms of `Connection::query_row` and `execute`. The
/// store runs the same statements on every operation; rusqlite's plain
/// forms parse and plan them again on each call, which was half of the
/// store's CPU time.
pub trait Cached {
    /// `query_row` through the statement cache.
    ///
    /// # Errors
    /// As `Connection::query_row`.
    fn query_row_cached<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;

    /// `execute` through the statement cache.
    ///
    /// # Errors
    /// As `Connection::execute`.
    fn execute_cached<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
}

impl Cached for Connection {
    fn query_row_cached<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }

    fn execute_cached<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }
}

/// Sizes a connection's statement cache and makes its plans independent
/// of bound values, so cached statements stay prepared.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn cache_statements(conn: &Connection) -> Result<(), StoreError> {
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // The query-planner stability guarantee: plans never depend on bound
    // values. Without it, any statement whose WHERE clause the planner
    // tests against a partial index's predicate is marked to be prepared
    // again whenever a parameter is rebound, which defeats the statement
    // cache on every hot path (the partial indexes' predicates are
    // literals, so the plans stay the same).
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )
    .map_err(|e| StoreError::sqlite("enable the query planner stability guarantee", e))?;
    Ok(())
}

fn configure(conn: &Connection, opts: DbOptions) -> Result<(), StoreError> {
    cache_statements(conn)?;
    let timeout_ms = i64::try_from(opts.busy_timeout.as_millis()).unwrap_or(i64::MAX);
    conn.busy_timeout(opts.busy_timeout)
        .map_err(|e| StoreError::sqlite("set busy_timeout", e))?;
    // the new mode is returned as a row; it is checked with the others below
    let _: String = conn
        .query_row_cached("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(|e| StoreError::sqlite("set journal_mode", e))?;
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {}; PRAGMA foreign_keys = ON; PRAGMA trusted_schema = OFF;",
        opts.synchronous.name()
    ))
    .map_err(|e| StoreError::sqlite("set pragmas", e))?;
    check_pragmas(conn, opts.synchronous, timeout_ms)
}

/// The values the store requires, read back from a live connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PragmaReport {
    /// `journal_mode`.
    pub journal_mode: String,
    /// `synchronous` (2 FULL, 3 EXTRA).
    pub synchronous: i64,
    /// `foreign_keys` (1 on).
    pub foreign_keys: i64,
    /// `busy_timeout` in ms.
    pub busy_timeout_ms: i64,
}

/// Reads the PRAGMAs back.
///
/// # Errors
/// [`StoreError::Sqlite`].
pub fn read_pragmas(conn: &Connection) -> Result<PragmaReport, StoreError> {
    let q = |sql: &str| -> Result<i64, StoreError> {
        conn.query_row_cached(sql, [], |r| r.get(0))
            .map_err(|e| StoreError::sqlite("read pragma", e))
    };
    Ok(PragmaReport {
        journal_mode: conn
            .query_row_cached("PRAGMA journal_mode", [], |r| r.get(0))
            .map_err(|e| StoreError::sqlite("read journal_mode", e))?,
        synchronous: q("PRAGMA synchronous")?,
        foreign_keys: q("PRAGMA foreign_keys")?,
        busy_timeout_ms: q("PRAGMA busy_timeout")?,
    })
}

fn check_pragmas(conn: &Connection, sync: Synchronous, timeout_ms: i64) -> Result<(), StoreError> {
    let got = read_pragmas(conn)?;
    let mismatch =
        |name: &'static str, want: String, got: String| StoreError::Pragma { name, want, got };
    if !got.journal_mode.eq_ignore_ascii_case("wal") {
        return Err(mismatch("journal_mode", "wal".into(), got.journal_mode));
    }
    if got.synchronous != sync.pragma_value() {
        return Err(mismatch(
            "synchronous",
            sync.pragma_value().to_string(),
            got.synchronous.to_string(),
        ));
    }
    if got.foreign_keys != 1 {
        return Err(mismatch(
            "foreign_keys",
            "1".into(),
            got.foreign_keys.to_string(),
        ));
    }
    if got.busy_timeout_ms != timeout_ms {
        return Err(mismatch(
            "busy_timeout",
            timeout_ms.to_string(),
            got.busy_timeout_ms.to_string(),
        ));
    }
    Ok(())
}

/// One schema migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version number, from 1, contiguous.
    pub version: i64,
    /// The SQL, applied in one transaction.
    pub sql: &'static str,
}

/// SHA-256 of a migration's SQL text.
#[must_use]
pub fn checksum(sql: &str) -> [u8; 32] {
    let d = Sha256::digest(sql.as_bytes());
    let mut out = [0u8; 32];
    for (o, b) in out.iter_mut().zip(d.iter()) {
        *o = *b;
    }
    out
}

/// Applies every missing migration of `migrations` (versions from 1,
/// contiguous, in order) and validates the recorded ones. Returns the
/// versions applied now.
///
/// # Errors
/// [`StoreError::MigrationChecksum`], [`StoreError::SchemaTooNew`] or
/// [`StoreError::Sqlite`]. A failed migration leaves the database as it was.
pub fn migrate(
    conn: &mut Connection,
    migrations: &[Migration],
    now_ms: i64,
) -> Result<Vec<i64>, StoreError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
            version       INTEGER PRIMARY KEY CHECK (version >= 1),
            checksum      BLOB NOT NULL CHECK (length(checksum) = 32),
            applied_ms    INTEGER NOT NULL
        ) STRICT;",
    )
    .map_err(|e| StoreError::sqlite("create schema_migrations", e))?;
    let known_max = migrations.last().map_or(0, |m| m.version);
    let recorded_max: i64 = conn
        .query_row_cached(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            [],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("read schema version", e))?;
    if recorded_max > known_max {
        return Err(StoreError::SchemaTooNew {
            found: recorded_max,
            known: known_max,
        });
    }
    let mut applied = Vec::new();
    // what is recorded already is checked in one read, without a write
    // transaction per migration
    let recorded: Vec<(i64, Vec<u8>)> = {
        let mut stmt = conn
            .prepare_cached("SELECT version, checksum FROM schema_migrations ORDER BY version")
            .map_err(|e| StoreError::sqlite("read migrations", e))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(|e| StoreError::sqlite("read migrations", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| StoreError::sqlite("read migrations", e))?
    };
    for m in migrations {
        let sum = checksum(m.sql);
        match recorded.iter().find(|(v, _)| *v == m.version) {
            Some((_, found)) if found.as_slice() == sum.as_slice() => continue,
            Some(_) => return Err(StoreError::MigrationChecksum { version: m.version }),
            None => {}
        }
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin migration", e))?;
        let recorded: Option<Vec<u8>> = tx
            .query_row_cached(
                "SELECT checksum FROM schema_migrations WHERE version = ?1",
                params![m.version],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read migration", e))?;
        match recorded {
            Some(found) if found.as_slice() == sum.as_slice() => {}
            Some(_) => return Err(StoreError::MigrationChecksum { version: m.version }),
            None => {
                tx.execute_batch(m.sql)
                    .map_err(|e| StoreError::sqlite("apply migration", e))?;
                tx.execute_cached(
                    "INSERT INTO schema_migrations (version, checksum, applied_ms) VALUES (?1, ?2, ?3)",
                    params![m.version, sum.as_slice(), now_ms],
                )
                .map_err(|e| StoreError::sqlite("record migration", e))?;
                applied.push(m.version);
            }
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit migration", e))?;
    }
    Ok(applied)
}

/// `PRAGMA quick_check`: `Ok(())` or the first problems SQLite reports.
///
/// # Errors
/// [`StoreError::Integrity`] with SQLite's findings (at most 16 lines).
pub fn quick_check(conn: &Connection) -> Result<(), StoreError> {
    let mut stmt = conn
        .prepare_cached("PRAGMA quick_check(16)")
        .map_err(|e| StoreError::sqlite("quick_check", e))?;
    let rows: Vec<String> = stmt
        .query_map([], |r| r.get(0))
        .map_err(|e| StoreError::sqlite("quick_check", e))?
        .collect::<Result<_, _>>()
        .map_err(|e| StoreError::sqlite("quick_check", e))?;
    if rows.len() == 1 && rows.first().is_some_and(|r| r == "ok") {
        Ok(())
    } else {
        Err(StoreError::Integrity(rows.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    /// The database and the `-wal` and `-shm` files SQLite makes beside it
    /// are owner-only, whatever the umask; an existing database others
    /// could read is made owner-only at open.
    #[test]
    fn database_files_are_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sqlite3");
        let c = open(&path, DbOptions::default()).unwrap();
        c.execute_batch("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1);")
            .unwrap();
        let wal = dir.path().join("t.sqlite3-wal");
        let shm = dir.path().join("t.sqlite3-shm");
        for p in [&path, &wal, &shm] {
            assert_eq!(mode(p), 0o600, "{}", p.display());
        }
        drop(c);
        let old = dir.path().join("old.sqlite3");
        std::fs::write(&old, b"").unwrap();
        std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        let c = open(&old, DbOptions::default()).unwrap();
        c.execute_batch("CREATE TABLE t (x INTEGER);").unwrap();
        assert_eq!(mode(&old), 0o600);
        assert_eq!(mode(&dir.path().join("old.sqlite3-wal")), 0o600);
    }

    #[test]
    fn pragmas_are_set_and_read_back_on_every_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sqlite3");
        for sync in [Synchronous::Full, Synchronous::Extra] {
            let opts = DbOptions {
                synchronous: sync,
                busy_timeout: Duration::from_millis(1234),
            };
            let a = open(&path, opts).unwrap();
            let b = open(&path, opts).unwrap();
            for c in [&a, &b] {
                let p = read_pragmas(c).unwrap();
                assert_eq!(p.journal_mode, "wal");
                assert_eq!(p.synchronous, sync.pragma_value());
                assert_eq!(p.foreign_keys, 1);
                assert_eq!(p.busy_timeout_ms, 1234);
            }
        }
    }

    const TEST_MIGRATIONS: &[Migration] = &[
        Migration {
            version: 1,
            sql: "CREATE TABLE a (x INTEGER NOT NULL) STRICT;",
        },
        Migration {
            version: 2,
            sql: "CREATE TABLE b (y INTEGER NOT NULL) STRICT;",
        },
    ];

    #[test]
    fn migrations_apply_once_in_order_and_are_checksummed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sqlite3");
        let mut c = open(&path, DbOptions::default()).unwrap();
        let first = TEST_MIGRATIONS.get(..1).unwrap();
        assert_eq!(migrate(&mut c, first, 1).unwrap(), vec![1]);
        assert_eq!(migrate(&mut c, TEST_MIGRATIONS, 2).unwrap(), vec![2]);
        assert_eq!(
            migrate(&mut c, TEST_MIGRATIONS, 3).unwrap(),
            Vec::<i64>::new()
        );
        quick_check(&c).unwrap();
        // a failing migration leaves the database as it was
        let bad = [Migration {
            version: 3,
            sql: "CREATE TABLE c (z INTEGER); THIS IS NOT SQL;",
        }];
        let all: Vec<Migration> = TEST_MIGRATIONS.iter().copied().chain(bad).collect();
        assert!(matches!(
            migrate(&mut c, &all, 4),
            Err(StoreError::Sqlite { .. })
        ));
        let tables: i64 = c
            .query_row_cached(
                "SELECT COUNT(*) FROM sqlite_master WHERE name = 'c'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 0);
        // a tampered record refuses to open
        c.execute_cached(
            "UPDATE schema_migrations SET checksum = zeroblob(32) WHERE version = 1",
            [],
        )
        .unwrap();
        assert!(matches!(
            migrate(&mut c, TEST_MIGRATIONS, 5),
            Err(StoreError::MigrationChecksum { version: 1 })
        ));
        // a database from a newer binary refuses to open
        c.execute_cached(
            "INSERT INTO schema_migrations VALUES (99, zeroblob(32), 0)",
            [],
        )
        .unwrap();
        assert!(matches!(
            migrate(&mut c, TEST_MIGRATIONS, 6),
            Err(StoreError::SchemaTooNew {
                found: 99,
                known: 2
            })
        ));
    }
}
