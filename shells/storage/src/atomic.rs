//! Small files that must appear whole or not at all: identity files and
//! keys. [`write_new`] writes a temporary file, syncs it, renames it into
//! place and syncs the directory, so after a crash the file is either
//! absent or complete. [`read_small`] reads one back with a length bound,
//! so a damaged or foreign file never causes an unbounded allocation.

use std::io;
use std::path::{Path, PathBuf};

use crate::crash::CrashHook;
use crate::error::StoreError;
use crate::fs::StoreFs;

/// Suffix of the temporary file [`write_new`] renames into place.
pub const TEMP_SUFFIX: &str = ".tmp";

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(TEMP_SUFFIX);
    path.with_file_name(name)
}

/// Creates `path` holding exactly `bytes`: a temporary sibling is written
/// and `fdatasync`ed, renamed over `path`, and the directory is synced. A
/// temporary file left by an earlier crash is removed first. `hook` is
/// called at `before_rename` once the temporary file is durable.
///
/// # Errors
/// [`StoreError::Io`] naming the step and the path.
pub fn write_new(
    fs: &dyn StoreFs,
    path: &Path,
    bytes: &[u8],
    hook: &dyn CrashHook,
    before_rename: &'static str,
) -> Result<(), StoreError> {
    let tmp = temp_path(path);
    match fs.remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::io("remove stale temporary file", &tmp, e)),
    }
    let mut f = fs
        .create_new(&tmp)
        .map_err(|e| StoreError::io("create temporary file", &tmp, e))?;
    f.append(bytes)
        .and_then(|()| f.sync_data())
        .map_err(|e| StoreError::io("write temporary file", &tmp, e))?;
    drop(f);
    hook.at(before_rename);
    fs.rename(&tmp, path)
        .map_err(|e| StoreError::io("rename into place", path, e))?;
    if let Some(dir) = path.parent() {
        fs.sync_dir(dir)
            .map_err(|e| StoreError::io("sync directory", dir, e))?;
    }
    Ok(())
}

/// Reads `path` whole when it exists and holds at most `max_len` bytes.
/// `Ok(None)` when it does not exist.
///
/// # Errors
/// [`StoreError::Io`] when it cannot be read; [`StoreError::Layout`] when
/// it is longer than `max_len`.
pub fn read_small(
    fs: &dyn StoreFs,
    path: &Path,
    max_len: u64,
) -> Result<Option<Vec<u8>>, StoreError> {
    let f = match fs.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io("open", path, e)),
    };
    let len = f.len().map_err(|e| StoreError::io("stat", path, e))?;
    if len > max_len {
        return Err(StoreError::Layout {
            path: path.to_path_buf(),
            reason: format!("is {len} bytes, at most {max_len} expected"),
        });
    }
    let n = usize::try_from(len).map_err(|_| StoreError::Layout {
        path: path.to_path_buf(),
        reason: format!("is {len} bytes, too large for this platform"),
    })?;
    let mut buf = vec![0u8; n];
    f.read_exact_at(&mut buf, 0)
        .map_err(|e| StoreError::io("read", path, e))?;
    Ok(Some(buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crash::NoCrash;
    use crate::fs::{CrashMode, FaultyFs, RealFs};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn written_files_are_whole_private_and_replace_a_stale_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id");
        std::fs::write(temp_path(&path), b"half").unwrap();
        write_new(&RealFs, &path, b"0123456789abcdef", &NoCrash, "t").unwrap();
        assert_eq!(
            read_small(&RealFs, &path, 16).unwrap().unwrap(),
            b"0123456789abcdef"
        );
        assert!(!temp_path(&path).exists());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            read_small(&RealFs, &dir.path().join("absent"), 16)
                .unwrap()
                .is_none()
        );
        assert!(matches!(
            read_small(&RealFs, &path, 15),
            Err(StoreError::Layout { .. })
        ));
    }

    #[test]
    fn a_power_cut_after_write_new_keeps_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let path = dir.path().join("id");
        write_new(&fs, &path, b"abc", &NoCrash, "t").unwrap();
        fs.crash(CrashMode::LoseUnsynced).unwrap();
        assert_eq!(read_small(&RealFs, &path, 16).unwrap().unwrap(), b"abc");
    }
}
