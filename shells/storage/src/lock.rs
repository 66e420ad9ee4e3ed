//! The single-instance lock on a state directory: an exclusive `flock` on
//! one lock file, held for the life of an [`InstanceLock`]. A daemon and
//! its offline repair tool take the same lock, so the repair tool can never
//! open a live store.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::StoreError;

/// An exclusive lock on a store's lock file, released on drop.
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
    path: PathBuf,
}

impl InstanceLock {
    /// Takes the lock on `path` (created mode 0600 if absent) without
    /// waiting.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another process holds it;
    /// [`StoreError::Io`] when the lock file cannot be opened.
    pub fn acquire(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| StoreError::io("open lock file", &path, e))?;
        match file.try_lock() {
            Ok(()) => Ok(Self { _file: file, path }),
            Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Locked { path }),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(StoreError::io("lock state directory", &path, e))
            }
        }
    }

    /// The lock file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let first = InstanceLock::acquire(&path).unwrap();
        assert!(matches!(
            InstanceLock::acquire(&path),
            Err(StoreError::Locked { .. })
        ));
        drop(first);
        InstanceLock::acquire(&path).unwrap();
    }
}
