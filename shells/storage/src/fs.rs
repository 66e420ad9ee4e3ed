//! The narrow filesystem the store uses for segment files (plan §5.3).
//!
//! Every segment, audit and deletion-directory access goes through
//! [`StoreFs`]. [`RealFs`] is the production implementation. [`FaultyFs`]
//! wraps it for tests and the simulator: it tracks which bytes were made
//! durable by `sync_data` and which file creations were made durable by a
//! directory sync, injects `ENOSPC`, `EACCES` and I/O errors on chosen
//! operations, and on a simulated power cut keeps all, part or none of the
//! un-synced bytes of each file (a torn final write) and forgets creations
//! whose directory was never synced.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// One open segment file.
pub trait SegmentFile: Send + std::fmt::Debug {
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// True when the file holds no bytes.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Appends `data` at the end of the file.
    fn append(&mut self, data: &[u8]) -> io::Result<()>;
    /// Makes every byte written so far durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Cuts the file to `len` bytes (recovery of an uncommitted tail).
    fn truncate(&mut self, len: u64) -> io::Result<()>;
}

/// The filesystem operations of the store, and nothing else.
pub trait StoreFs: Send + Sync + std::fmt::Debug {
    /// Creates `dir` with mode 0700 if it does not exist; an existing path
    /// must be a directory, and is made private (0700) when group or others
    /// could access it.
    fn ensure_private_dir(&self, dir: &Path) -> io::Result<()>;
    /// Creates a new file with mode 0600; fails if it exists (`O_EXCL`).
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>>;
    /// Opens an existing file for reading and appending.
    fn open(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>>;
    /// Makes the directory entries of `dir` durable (after create/rename).
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Makes the entries of every directory in `dirs` durable; on failure,
    /// the first failing directory in `dirs` order, with its error. By
    /// default one after the other.
    ///
    /// # Errors
    /// The first failure, as above.
    fn sync_dirs(&self, dirs: &[&Path]) -> Result<(), (PathBuf, io::Error)> {
        for dir in dirs {
            self.sync_dir(dir).map_err(|e| (dir.to_path_buf(), e))?;
        }
        Ok(())
    }
    /// Renames within one filesystem.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// The file names in `dir`, at most `limit` of them, sorted.
    fn list(&self, dir: &Path, limit: usize) -> io::Result<Vec<String>>;
    /// Bytes available to an unprivileged writer on the filesystem of `path`.
    fn free_space(&self, path: &Path) -> io::Result<u64>;
    /// `path` with every symbolic link, `.` and `..` resolved; an error
    /// when it does not exist or is not a directory.
    fn resolve_dir(&self, path: &Path) -> io::Result<PathBuf>;
    /// Makes everything written to the filesystem holding `dir` durable,
    /// data and directory entries alike (`syncfs`): one flush shared by every
    /// file a group commit touched.
    fn sync_filesystem(&self, dir: &Path) -> io::Result<()>;
}

/// Production filesystem access.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

#[derive(Debug)]
struct RealFile {
    file: File,
}

impl SegmentFile for RealFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        // opened with O_APPEND: every write lands at the end
        self.file.write_all(data)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.file.sync_all()
    }
}

impl StoreFs for RealFs {
    fn ensure_private_dir(&self, dir: &Path) -> io::Result<()> {
        match std::fs::symlink_metadata(dir) {
            Ok(m) if m.is_dir() => {
                use std::os::unix::fs::PermissionsExt;
                let mode = m.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    // the store holds command text, environments and output
                    // in plaintext: a directory others can enter is made
                    // private (or refused when that is not allowed)
                    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
                    tracing::warn!(
                        dir = %dir.display(),
                        was = format!("{mode:03o}"),
                        "data directory was accessible to group or others; set to 700"
                    );
                }
                Ok(())
            }
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a directory", dir.display()),
            )),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new().mode(0o700).create(dir)?;
                if let Some(parent) = dir.parent() {
                    self.sync_dir(parent)?;
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        Ok(Box::new(RealFile { file }))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new().read(true).append(true).open(path)?;
        Ok(Box::new(RealFile { file }))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn list(&self, dir: &Path, limit: usize) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            if names.len() >= limit {
                return Err(io::Error::other(format!(
                    "{} holds more than {limit} entries",
                    dir.display()
                )));
            }
            // names that are not UTF-8 are never ours; callers refuse them
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn resolve_dir(&self, path: &Path) -> io::Result<PathBuf> {
        let real = std::fs::canonicalize(path)?;
        if !real.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("{} is not a directory", real.display()),
            ));
        }
        Ok(real)
    }

    fn free_space(&self, path: &Path) -> io::Result<u64> {
        let st = rustix::fs::statvfs(path).map_err(io::Error::from)?;
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }

    fn sync_filesystem(&self, dir: &Path) -> io::Result<()> {
        let d = File::open(dir)?;
        rustix::fs::syncfs(&d).map_err(io::Error::from)
    }

    /// Several directories at once, on up to [`SYNC_DIR_THREADS`] threads:
    /// a fleet run's first output creates segment files in most of the 256
    /// fan-out directories in one group, and the device serves concurrent
    /// flushes in less time than the same flushes one after the other
    /// (docs/benchmarks.md). Every directory is synced before this returns,
    /// failed or not.
    fn sync_dirs(&self, dirs: &[&Path]) -> Result<(), (PathBuf, io::Error)> {
        if dirs.len() < 4 {
            for dir in dirs {
                self.sync_dir(dir).map_err(|e| (dir.to_path_buf(), e))?;
            }
            return Ok(());
        }
        let threads = dirs.len().min(SYNC_DIR_THREADS);
        let failures: Vec<(usize, io::Error)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        dirs.iter()
                            .enumerate()
                            .skip(t)
                            .step_by(threads)
                            .filter_map(|(i, dir)| self.sync_dir(dir).err().map(|e| (i, e)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| {
                    w.join().unwrap_or_else(|_| {
                        vec![(0, io::Error::other("a directory sync thread panicked"))]
                    })
                })
                .collect()
        });
        match failures.into_iter().min_by_key(|(i, _)| *i) {
            None => Ok(()),
            Some((i, e)) => Err((
                dirs.get(i).map_or_else(PathBuf::new, |d| d.to_path_buf()),
                e,
            )),
        }
    }
}

/// Most threads [`RealFs::sync_dirs`] syncs directories on at once.
pub const SYNC_DIR_THREADS: usize = 8;

/// A file operation a fault can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `create_new`.
    Create,
    /// `append` (a short write: half the bytes land, then the error).
    Append,
    /// `sync_data`.
    Sync,
    /// `sync_dir`.
    SyncDir,
    /// `rename`.
    Rename,
    /// `remove_file`.
    Remove,
    /// `open`.
    Open,
}

/// The error an injected fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `ENOSPC`: the disk is full.
    NoSpace,
    /// `EACCES`: permission denied.
    PermissionDenied,
    /// `EIO`: a device error.
    Io,
    /// `ENOENT`: the file is gone (removed by retention under a reader).
    NotFound,
}

impl FaultKind {
    fn error(self) -> io::Error {
        match self {
            Self::NoSpace => io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()),
            Self::PermissionDenied => {
                io::Error::from_raw_os_error(rustix::io::Errno::ACCESS.raw_os_error())
            }
            Self::Io => io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error()),
            Self::NotFound => io::Error::from_raw_os_error(rustix::io::Errno::NOENT.raw_os_error()),
        }
    }
}

/// What survives a simulated power cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Every un-synced byte is lost.
    LoseUnsynced,
    /// Up to `keep` of each file's un-synced bytes survive (a torn write).
    Tear {
        /// Un-synced bytes kept per file.
        keep: u64,
    },
}

#[derive(Debug, Default)]
struct Track {
    durable_len: u64,
    current_len: u64,
}

#[derive(Debug, Default)]
struct FaultState {
    files: BTreeMap<PathBuf, Track>,
    /// Created (or renamed into place) but the directory was not synced since.
    undurable_entries: BTreeSet<PathBuf>,
    faults: VecDeque<(FaultOp, FaultKind)>,
    injected: u64,
}

/// Upper bound on queued faults (a test arms a handful).
const MAX_QUEUED_FAULTS: usize = 64;

/// A fault-injecting wrapper around [`RealFs`] (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct FaultyFs {
    inner: RealFs,
    state: Arc<Mutex<FaultState>>,
}

fn lock(state: &Mutex<FaultState>) -> MutexGuard<'_, FaultState> {
    // a panic while holding the lock leaves plain counters behind; keep going
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FaultState {
    fn take_fault(&mut self, op: FaultOp) -> Option<FaultKind> {
        let pos = self.faults.iter().position(|(o, _)| *o == op)?;
        let (_, kind) = self.faults.remove(pos)?;
        self.injected = self.injected.saturating_add(1);
        Some(kind)
    }
}

impl FaultyFs {
    /// A wrapper with no faults armed.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Arms one fault: the next `op` fails with `kind`.
    pub fn inject(&self, op: FaultOp, kind: FaultKind) {
        let mut s = lock(&self.state);
        if s.faults.len() < MAX_QUEUED_FAULTS {
            s.faults.push_back((op, kind));
        }
    }

    /// How many armed faults have fired.
    #[must_use]
    pub fn injected(&self) -> u64 {
        lock(&self.state).injected
    }

    /// Simulates a power cut on the files this wrapper has seen: entries
    /// whose directory was never synced disappear, and each file keeps its
    /// durable bytes plus what `mode` lets survive of the rest. Returns how
    /// many bytes were dropped in all.
    ///
    /// # Errors
    /// An I/O error from truncating or removing a file.
    pub fn crash(&self, mode: CrashMode) -> io::Result<u64> {
        let mut s = lock(&self.state);
        let mut dropped = 0u64;
        let gone: Vec<PathBuf> = s.undurable_entries.iter().cloned().collect();
        for path in gone {
            if let Some(t) = s.files.remove(&path) {
                dropped = dropped.saturating_add(t.current_len);
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        s.undurable_entries.clear();
        for (path, t) in &mut s.files {
            let keep = match mode {
                CrashMode::LoseUnsynced => 0,
                CrashMode::Tear { keep } => keep,
            };
            let survive = t.durable_len.saturating_add(keep).min(t.current_len);
            if survive < t.current_len {
                let f = OpenOptions::new().write(true).open(path)?;
                f.set_len(survive)?;
                f.sync_all()?;
                dropped = dropped.saturating_add(t.current_len - survive);
                t.current_len = survive;
            }
            t.durable_len = t.current_len;
        }
        s.faults.clear();
        Ok(dropped)
    }

    fn check(&self, op: FaultOp) -> io::Result<()> {
        match lock(&self.state).take_fault(op) {
            Some(kind) => Err(kind.error()),
            None => Ok(()),
        }
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Box<dyn SegmentFile>,
    path: PathBuf,
    state: Arc<Mutex<FaultState>>,
}

impl FaultyFile {
    fn update(&self, f: impl FnOnce(&mut Track)) {
        let mut s = lock(&self.state);
        let t = s.files.entry(self.path.clone()).or_default();
        f(t);
    }
}

impl SegmentFile for FaultyFile {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        let fault = lock(&self.state).take_fault(FaultOp::Append);
        if let Some(kind) = fault {
            // a short write: part of the data lands before the error
            let half = data.get(..data.len() / 2).unwrap_or_default();
            self.inner.append(half)?;
            let n = half.len() as u64;
            self.update(|t| t.current_len = t.current_len.saturating_add(n));
            return Err(kind.error());
        }
        self.inner.append(data)?;
        let n = data.len() as u64;
        self.update(|t| t.current_len = t.current_len.saturating_add(n));
        Ok(())
    }

    fn sync_data(&mut self) -> io::Result<()> {
        if let Some(kind) = lock(&self.state).take_fault(FaultOp::Sync) {
            return Err(kind.error());
        }
        self.inner.sync_data()?;
        self.update(|t| t.durable_len = t.current_len);
        Ok(())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_exact_at(buf, offset)
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)?;
        self.update(|t| {
            t.current_len = len;
            t.durable_len = t.durable_len.min(len);
        });
        Ok(())
    }
}

impl StoreFs for FaultyFs {
    fn ensure_private_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.ensure_private_dir(dir)
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        self.check(FaultOp::Create)?;
        let inner = self.inner.create_new(path)?;
        {
            let mut s = lock(&self.state);
            s.files.insert(path.to_path_buf(), Track::default());
            s.undurable_entries.insert(path.to_path_buf());
        }
        Ok(Box::new(FaultyFile {
            inner,
            path: path.to_path_buf(),
            state: Arc::clone(&self.state),
        }))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        self.check(FaultOp::Open)?;
        let inner = self.inner.open(path)?;
        let len = inner.len()?;
        {
            let mut s = lock(&self.state);
            s.files.entry(path.to_path_buf()).or_insert(Track {
                durable_len: len,
                current_len: len,
            });
        }
        Ok(Box::new(FaultyFile {
            inner,
            path: path.to_path_buf(),
            state: Arc::clone(&self.state),
        }))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.check(FaultOp::SyncDir)?;
        self.inner.sync_dir(dir)?;
        let mut s = lock(&self.state);
        s.undurable_entries.retain(|p| p.parent() != Some(dir));
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.check(FaultOp::Rename)?;
        self.inner.rename(from, to)?;
        let mut s = lock(&self.state);
        if let Some(t) = s.files.remove(from) {
            s.files.insert(to.to_path_buf(), t);
        }
        s.undurable_entries.remove(from);
        s.undurable_entries.insert(to.to_path_buf());
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.check(FaultOp::Remove)?;
        self.inner.remove_file(path)?;
        let mut s = lock(&self.state);
        s.files.remove(path);
        s.undurable_entries.remove(path);
        Ok(())
    }

    fn list(&self, dir: &Path, limit: usize) -> io::Result<Vec<String>> {
        self.inner.list(dir, limit)
    }

    fn resolve_dir(&self, path: &Path) -> io::Result<PathBuf> {
        self.inner.resolve_dir(path)
    }

    fn free_space(&self, path: &Path) -> io::Result<u64> {
        self.inner.free_space(path)
    }

    fn sync_filesystem(&self, dir: &Path) -> io::Result<()> {
        self.check(FaultOp::Sync)?;
        self.inner.sync_filesystem(dir)?;
        let mut s = lock(&self.state);
        for t in s.files.values_mut() {
            t.durable_len = t.current_len;
        }
        s.undurable_entries.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(f: &dyn SegmentFile) -> Vec<u8> {
        let mut buf = vec![0; usize::try_from(f.len().unwrap()).unwrap()];
        f.read_exact_at(&mut buf, 0).unwrap();
        buf
    }

    #[test]
    fn many_directories_sync_at_once_and_the_first_failure_in_order_is_named() {
        let root = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..20)
            .map(|i| root.path().join(format!("{i:02}")))
            .collect();
        for d in &dirs {
            RealFs.ensure_private_dir(d).unwrap();
            drop(RealFs.create_new(&d.join("seg")).unwrap());
        }
        let refs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
        RealFs.sync_dirs(&refs).unwrap();
        // two gone: the earlier one in the list is the one reported,
        // whichever thread met it first
        std::fs::remove_dir_all(&dirs[13]).unwrap();
        std::fs::remove_dir_all(&dirs[5]).unwrap();
        let (dir, e) = RealFs.sync_dirs(&refs).unwrap_err();
        assert_eq!(dir, dirs[5]);
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        // a short list goes one by one, with the same answer
        let (dir, _) = RealFs.sync_dirs(&refs[4..7]).unwrap_err();
        assert_eq!(dir, dirs[5]);
    }

    #[test]
    fn real_files_are_private_and_exclusive() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fs = RealFs;
        let sub = dir.path().join("segments");
        fs.ensure_private_dir(&sub).unwrap();
        fs.ensure_private_dir(&sub).unwrap();
        assert_eq!(
            std::fs::metadata(&sub).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let p = sub.join("a.seg");
        let mut f = fs.create_new(&p).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs.create_new(&p).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        f.append(b"hello ").unwrap();
        f.append(b"world").unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(&sub).unwrap();
        assert_eq!(read_all(&*f), b"hello world");
        f.truncate(5).unwrap();
        assert_eq!(read_all(&*fs.open(&p).unwrap()), b"hello");
        assert_eq!(fs.list(&sub, 10).unwrap(), vec!["a.seg".to_owned()]);
        assert!(fs.list(&sub, 0).is_err());
        assert!(fs.free_space(dir.path()).unwrap() > 0);
        let file_as_dir = sub.join("a.seg");
        assert!(fs.ensure_private_dir(&file_as_dir).is_err());
        let open_dir = dir.path().join("shared");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        fs.ensure_private_dir(&open_dir).unwrap();
        assert_eq!(
            std::fs::metadata(&open_dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }

    #[test]
    fn power_cut_loses_unsynced_bytes_and_unsynced_creations() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let synced = dir.path().join("synced.seg");
        let mut f = fs.create_new(&synced).unwrap();
        fs.sync_dir(dir.path()).unwrap();
        f.append(b"durable").unwrap();
        f.sync_data().unwrap();
        f.append(b"-lost").unwrap();
        let unsynced_entry = dir.path().join("entry.seg");
        let mut g = fs.create_new(&unsynced_entry).unwrap();
        g.append(b"x").unwrap();
        g.sync_data().unwrap();
        assert_eq!(fs.crash(CrashMode::LoseUnsynced).unwrap(), 5 + 1);
        assert_eq!(std::fs::read(&synced).unwrap(), b"durable");
        assert!(!unsynced_entry.exists());
    }

    #[test]
    fn power_cut_can_tear_the_last_write() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let p = dir.path().join("t.seg");
        let mut f = fs.create_new(&p).unwrap();
        fs.sync_dir(dir.path()).unwrap();
        f.append(b"abc").unwrap();
        f.sync_data().unwrap();
        f.append(b"defgh").unwrap();
        fs.crash(CrashMode::Tear { keep: 2 }).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"abcde");
    }

    #[test]
    fn injected_faults_fire_once_and_short_writes_land_half() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new();
        let p = dir.path().join("f.seg");
        fs.inject(FaultOp::Create, FaultKind::PermissionDenied);
        let e = fs.create_new(&p).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let mut f = fs.create_new(&p).unwrap();
        fs.inject(FaultOp::Append, FaultKind::NoSpace);
        let e = f.append(b"12345678").unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::NOSPC.raw_os_error())
        );
        assert_eq!(std::fs::read(&p).unwrap(), b"1234");
        fs.inject(FaultOp::Sync, FaultKind::Io);
        assert!(f.sync_data().is_err());
        f.sync_data().unwrap();
        assert_eq!(fs.injected(), 3);
    }
}
