//! The client state directory (plan §7.1): private, fixed names only.
//!
//! ```text
//! <state_dir>/            mode 0700
//!   lock                  held (flock) by the daemon or the repair tool
//!   instance_id           the installation's identity (32 bytes, checksummed)
//!   db/client.sqlite3     metadata (plus -wal and -shm)
//!   spool/                output segments: <uuid-hex>-<ordinal>.seg
//!   scripts/              script upload segments: <uuid-hex>-<ordinal>.seg
//! ```
//!
//! Every path is built from these names plus names the segment naming
//! functions produce from a validated UUID; nothing comes from the server.

use std::path::{Path, PathBuf};

use rvbox_storage::StoreError;
use rvbox_storage::fs::StoreFs;

/// The paths of one client state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientLayout {
    root: PathBuf,
}

impl ClientLayout {
    /// The layout rooted at `state_dir` (an absolute path from the
    /// validated configuration).
    #[must_use]
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            root: state_dir.into(),
        }
    }

    /// The state directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The single-instance lock file.
    #[must_use]
    pub fn lock_file(&self) -> PathBuf {
        self.root.join("lock")
    }

    /// The identity file.
    #[must_use]
    pub fn identity_file(&self) -> PathBuf {
        self.root.join("instance_id")
    }

    /// The database directory.
    #[must_use]
    pub fn db_dir(&self) -> PathBuf {
        self.root.join("db")
    }

    /// The database file.
    #[must_use]
    pub fn db_file(&self) -> PathBuf {
        self.db_dir().join("client.sqlite3")
    }

    /// Output spool segments.
    #[must_use]
    pub fn spool_dir(&self) -> PathBuf {
        self.root.join("spool")
    }

    /// Script upload segments.
    #[must_use]
    pub fn scripts_dir(&self) -> PathBuf {
        self.root.join("scripts")
    }

    /// Creates the directories, each private (0700).
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the directory.
    pub fn create(&self, fs: &dyn StoreFs) -> Result<(), StoreError> {
        for dir in [
            self.root.clone(),
            self.db_dir(),
            self.spool_dir(),
            self.scripts_dir(),
        ] {
            fs.ensure_private_dir(&dir)
                .map_err(|e| StoreError::io("create state directory", &dir, e))?;
        }
        if let Some(parent) = self.root.parent() {
            // the new state directory's own entry
            fs.sync_dir(parent)
                .map_err(|e| StoreError::io("sync parent of state directory", parent, e))?;
        }
        fs.sync_dir(&self.root)
            .map_err(|e| StoreError::io("sync state directory", &self.root, e))?;
        Ok(())
    }
}
