//! The host facts validation needs, behind a small trait so that the pure
//! configuration code can be tested with an in-memory host. The daemons pass
//! a real implementation (rvbox-daemon-common); nothing here reads the
//! environment, so no `PATH` can ever take part in resolution.

use std::path::{Path, PathBuf};

/// The type of a filesystem object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A directory.
    Dir,
    /// A regular file.
    Regular,
    /// A Unix domain socket.
    Socket,
    /// Anything else (device, FIFO, ...).
    Other,
}

/// What `stat` (following symlinks) says about a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStat {
    /// Object type.
    pub kind: FileKind,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Device id.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
}

impl FileStat {
    /// The identity of the file, as compared before a launch.
    pub fn identity(&self) -> FileIdentity {
        FileIdentity {
            dev: self.dev,
            ino: self.ino,
            size: self.size,
            mtime_ns: self.mtime_ns,
            mode: self.mode,
            uid: self.uid,
        }
    }

    /// True when any execute bit is set.
    pub fn is_executable(&self) -> bool {
        self.mode & 0o111 != 0
    }

    /// True when the group or others may write.
    pub fn is_group_or_world_writable(&self) -> bool {
        self.mode & 0o022 != 0
    }
}

/// The identity of a validated executable: if any field differs at launch
/// time, the file was replaced or modified and the launch is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// Device id.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Permission bits.
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
}

/// Host facts used by validation. Implementations must not consult the
/// process environment.
pub trait HostProbe {
    /// `stat` following symlinks: `Ok(None)` when the path does not exist,
    /// `Err` with a reason when it cannot be examined (e.g. permission).
    fn stat(&self, path: &Path) -> Result<Option<FileStat>, String>;

    /// The canonical absolute path of an existing path (all symlinks
    /// resolved).
    fn canonicalize(&self, path: &Path) -> Result<PathBuf, String>;

    /// The effective uid of this process.
    fn current_uid(&self) -> u32;

    /// The host name, if the host reports one.
    fn host_name(&self) -> Option<String>;
}
