//! The committed-offset discipline of segment files (plan §5.3), shared by
//! both stores: a record is appended and synced before the metadata
//! transaction that moves the segment's `committed_end` commits, so bytes
//! past `committed_end` are an unacknowledged tail that recovery cuts,
//! and a committed range that no longer reads back is damage with exact
//! lost ranges. The decision is `rvbox_segment::scan`; this module reads
//! the bytes for it and performs the cut.

use std::io;
use std::path::{Path, PathBuf};

use rvbox_segment::{Limits, RECORD_OVERHEAD, Scan, scan};

use crate::error::StoreError;
use crate::fs::StoreFs;

/// One segment read back and scanned.
#[derive(Debug)]
pub struct ScannedSegment {
    /// The file.
    pub path: PathBuf,
    /// The scan's verdict and records.
    pub scan: Scan,
    /// The file's length (0 when it is missing).
    pub file_len: u64,
    /// The most bytes read: the committed end, or the seal size plus one
    /// record when that is larger.
    pub max_len: u64,
}

impl ScannedSegment {
    /// True when the file holds bytes past what was read (it is longer than
    /// any segment can legitimately be).
    #[must_use]
    pub fn overlong(&self) -> bool {
        self.file_len > self.max_len
    }
}

/// Reads `path` up to its committed end plus a bounded tail (`seal_bytes`
/// plus one record of `limits`) and scans it. A missing file scans as empty
/// (committed damage when anything was committed).
///
/// # Errors
/// [`StoreError::Io`] when the file exists but cannot be read.
pub fn read_and_scan(
    fs: &dyn StoreFs,
    path: &Path,
    committed_end: u64,
    seal_bytes: u64,
    limits: &Limits,
) -> Result<ScannedSegment, StoreError> {
    let max_len = seal_bytes
        .saturating_add(u64::from(limits.max_stored_len))
        .saturating_add(RECORD_OVERHEAD)
        .max(committed_end);
    let (buf, file_len) = match fs.open(path) {
        Ok(f) => {
            let len = f
                .len()
                .map_err(|e| StoreError::io("stat segment", path, e))?;
            let read = len.min(max_len);
            let n = usize::try_from(read).map_err(|_| StoreError::Layout {
                path: path.to_path_buf(),
                reason: format!("segment of {read} bytes is too large for this platform"),
            })?;
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, 0)
                .map_err(|e| StoreError::io("read segment", path, e))?;
            (buf, len)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => (Vec::new(), 0),
        Err(e) => return Err(StoreError::io("open segment", path, e)),
    };
    let scan = scan(&buf, committed_end, limits);
    Ok(ScannedSegment {
        path: path.to_path_buf(),
        scan,
        file_len,
        max_len,
    })
}

/// Cuts `path` back to `committed_end` and returns how many bytes went.
///
/// # Errors
/// [`StoreError::Io`].
pub fn cut_tail(fs: &dyn StoreFs, path: &Path, committed_end: u64) -> Result<u64, StoreError> {
    let mut f = fs
        .open(path)
        .map_err(|e| StoreError::io("open segment", path, e))?;
    let len = f
        .len()
        .map_err(|e| StoreError::io("stat segment", path, e))?;
    f.truncate(committed_end)
        .map_err(|e| StoreError::io("truncate uncommitted tail", path, e))?;
    Ok(len.saturating_sub(committed_end))
}
