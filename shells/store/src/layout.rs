//! The data directory: its fixed layout and the single-instance lock
//! (plan §5.1).
//!
//! ```text
//! <data_dir>/            mode 0700
//!   lock                 held (flock) by the one process using the store
//!   token.key            the key of page and output tokens (identity.rs)
//!   db/rvbox.sqlite3     metadata (plus -wal and -shm)
//!   segments/<xx>/       command segments: <uuid-hex>-<ordinal>.seg
//!   audit/               audit segments: audit-<ordinal>.seg
//!   trash/               same-filesystem deletion directory for eviction
//!   journal/             the group journal (journal.rs)
//! ```
//!
//! A backup (backup.rs) holds `token.key`, the database and the live
//! segment and audit files, in the same places.
//!
//! Every path is built from these fixed names plus names produced by the
//! segment naming functions; nothing comes from a client or a request.

use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::fs::StoreFs;

/// The token key's file name in the data directory.
pub const TOKEN_KEY_FILE: &str = "token.key";
/// The database's file name in `db/`.
pub const DB_FILE: &str = "rvbox.sqlite3";

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

    /// The token key (see [`crate::identity::token_key`]).
    #[must_use]
    pub fn token_key_file(&self) -> PathBuf {
        self.root.join(TOKEN_KEY_FILE)
    }

    /// The database directory.
    #[must_use]
    pub fn db_dir(&self) -> PathBuf {
        self.root.join("db")
    }

    /// The SQLite database file.
    #[must_use]
    pub fn db_file(&self) -> PathBuf {
        self.db_dir().join(DB_FILE)
    }

    /// The command segment directory.
    #[must_use]
    pub fn segments_dir(&self) -> PathBuf {
        self.root.join("segments")
    }

    /// The fan-out directory that holds the segment files of command
    /// `issue` (`segments/<2 hex digits>`, see
    /// [`rvbox_segment::segment_dir_name`]).
    #[must_use]
    pub fn segment_dir(&self, issue: &[u8; 16]) -> PathBuf {
        self.segments_dir()
            .join(rvbox_segment::segment_dir_name(issue))
    }

    /// The file of segment `ordinal` of command `issue` (`None` for an
    /// ordinal beyond the name format).
    #[must_use]
    pub fn segment_path(&self, issue: &[u8; 16], ordinal: u32) -> Option<PathBuf> {
        rvbox_segment::segment_file_name(issue, ordinal).map(|n| self.segment_dir(issue).join(n))
    }

    /// The file of a canonical segment file name (`None` for any other
    /// name).
    #[must_use]
    pub fn segment_file(&self, name: &str) -> Option<PathBuf> {
        rvbox_segment::parse_segment_file_name(name)
            .map(|(issue, _)| self.segment_dir(&issue).join(name))
    }

    /// Every directory that can hold command segment files, in the order
    /// the orphan sweep walks them (a directory is created with its first
    /// file).
    #[must_use]
    pub fn segment_dirs(&self) -> Vec<PathBuf> {
        (0..rvbox_segment::SEGMENT_DIRS)
            .map(|i| {
                self.segments_dir()
                    .join(rvbox_segment::segment_dir_of_index(i))
            })
            .collect()
    }

    /// Moves segment files of the flat layout of earlier versions
    /// (`segments/<name>`) into their fan-out directories; a no-op on a
    /// store that has none. Other names are left alone.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the file or directory.
    pub fn migrate_flat_segments(&self, fs: &dyn StoreFs) -> Result<u64, StoreError> {
        let root = self.segments_dir();
        let names = fs
            .list(&root, usize::MAX)
            .map_err(|e| StoreError::io("list segment directory", &root, e))?;
        let mut moved = std::collections::BTreeSet::new();
        let mut files = 0u64;
        for name in names {
            let Some((issue, _)) = rvbox_segment::parse_segment_file_name(&name) else {
                continue;
            };
            let dir = self.segment_dir(&issue);
            fs.ensure_private_dir(&dir)
                .map_err(|e| StoreError::io("create segment directory", &dir, e))?;
            let from = root.join(&name);
            fs.rename(&from, &dir.join(&name))
                .map_err(|e| StoreError::io("move segment into its directory", &from, e))?;
            moved.insert(dir);
            files += 1;
        }
        if files > 0 {
            for dir in moved.iter().chain(std::iter::once(&root)) {
                fs.sync_dir(dir)
                    .map_err(|e| StoreError::io("sync segment directory", dir, e))?;
            }
            tracing::info!(files, "segment files moved into fan-out directories");
        }
        Ok(files)
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
