//! The data directory: its fixed layout and the single-instance lock
//! (plan §5.1).
//!
//! ```text
//! <data_dir>/            mode 0700
//!   lock                 held (flock) by the one process using the store
//!   db/rvbox.sqlite3     metadata (plus -wal and -shm)
//!   segments/            command segments: <uuid-hex>-<ordinal>.seg
//!   audit/               audit segments: audit-<ordinal>.seg
//!   trash/               same-filesystem deletion directory for eviction
//! ```
//!
//! Every path is built from these fixed names plus names produced by the
//! segment naming functions; nothing comes from a client or a request.

use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::fs::StoreFs;

/// The paths of one data directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    /// The layout rooted at `data_dir` (an absolute, validated path from
    /// the configuration).
    #[must_use]
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            root: data_dir.into(),
        }
    }

    /// The data directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The lock file.
    #[must_use]
    pub fn lock_file(&self) -> PathBuf {
        self.root.join("lock")
    }

    /// The database directory.
    #[must_use]
    pub fn db_dir(&self) -> PathBuf {
        self.root.join("db")
    }

    /// The SQLite database file.
    #[must_use]
    pub fn db_file(&self) -> PathBuf {
        self.db_dir().join("rvbox.sqlite3")
    }

    /// The command segment directory.
    #[must_use]
    pub fn segments_dir(&self) -> PathBuf {
        self.root.join("segments")
    }

    /// The audit segment directory.
    #[must_use]
    pub fn audit_dir(&self) -> PathBuf {
        self.root.join("audit")
    }

    /// The group journal directory (same filesystem as the segments).
    #[must_use]
    pub fn journal_dir(&self) -> PathBuf {
        self.root.join("journal")
    }

    /// The group journal file.
    #[must_use]
    pub fn journal_file(&self) -> PathBuf {
        self.journal_dir().join("groups.journal")
    }

    /// The deletion directory (same filesystem as the segments).
    #[must_use]
    pub fn trash_dir(&self) -> PathBuf {
        self.root.join("trash")
    }

    /// Creates every directory that is missing, mode 0700, syncing parents.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the directory.
    pub fn create(&self, fs: &dyn StoreFs) -> Result<(), StoreError> {
        for dir in [
            self.root.clone(),
            self.db_dir(),
            self.segments_dir(),
            self.audit_dir(),
            self.trash_dir(),
            self.journal_dir(),
        ] {
            fs.ensure_private_dir(&dir)
                .map_err(|e| StoreError::io("create data directory", &dir, e))?;
        }
        Ok(())
    }
}

pub use rvbox_storage::lock::InstanceLock;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::RealFs;

    #[test]
    fn layout_is_created_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path().join("data"));
        layout.create(&RealFs).unwrap();
        layout.create(&RealFs).unwrap();
        for d in [
            layout.root().to_path_buf(),
            layout.db_dir(),
            layout.segments_dir(),
            layout.audit_dir(),
            layout.trash_dir(),
        ] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
    }

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let first = InstanceLock::acquire(&layout.lock_file()).unwrap();
        assert!(matches!(
            InstanceLock::acquire(&layout.lock_file()),
            Err(StoreError::Locked { .. })
        ));
        drop(first);
        InstanceLock::acquire(&layout.lock_file()).unwrap();
    }
}
