//! Storage errors: every failure names what failed; none carries payload bytes.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// A store failure.
#[derive(Debug, Error)]
pub enum StoreError {
    /// A filesystem operation failed.
    #[error("{context}: {path}: {source}")]
    Io {
        /// What the store was doing.
        context: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// SQLite failed.
    #[error("{context}: {source}")]
    Sqlite {
        /// What the store was doing.
        context: &'static str,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// A PRAGMA did not take the value the store requires.
    #[error("SQLite PRAGMA {name} is {got}, the store requires {want}")]
    Pragma {
        /// PRAGMA name.
        name: &'static str,
        /// Required value.
        want: String,
        /// Value read back.
        got: String,
    },
    /// A recorded migration differs from this binary's.
    #[error(
        "schema migration {version} was recorded with a different checksum than this binary's; refusing to open"
    )]
    MigrationChecksum {
        /// Migration version.
        version: i64,
    },
    /// The database was written by a newer RVBox.
    #[error(
        "database schema version {found} is newer than this binary's {known}; refusing to open"
    )]
    SchemaTooNew {
        /// Highest recorded version.
        found: i64,
        /// Highest version this binary knows.
        known: i64,
    },
    /// `PRAGMA quick_check` found problems.
    #[error("SQLite integrity check failed: {0}")]
    Integrity(String),
    /// Another process holds the store's lock.
    #[error(
        "{path} is held by another RVBox process (lock held); refusing to open the store twice"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A transaction was rolled back because one of its writes failed
    /// (a write group: nothing of it was kept).
    #[error("{context}: rolled back: {reason}")]
    RolledBack {
        /// What the store was doing.
        context: &'static str,
        /// The failure that ended it.
        reason: String,
    },
    /// The state directory layout is unusable.
    #[error("{path}: {reason}")]
    Layout {
        /// The path concerned.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl StoreError {
    /// Wraps a SQLite error with what the store was doing.
    #[must_use]
    pub fn sqlite(context: &'static str, source: rusqlite::Error) -> Self {
        Self::Sqlite { context, source }
    }

    /// Wraps an I/O error with what the store was doing and where.
    #[must_use]
    pub fn io(context: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            context,
            path: path.into(),
            source,
        }
    }
}
