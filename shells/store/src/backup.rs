//! Online backup and restore of a SQLite data directory (docs/operations.md,
//! "Backup and restore").
//!
//! A backup runs beside the live server: it takes no instance lock and
//! writes nothing in the data directory (beside a stopped server's
//! database, SQLite creates the empty `-wal` and `-shm` files any reader
//! needs, as the server itself would). Its consistency rests on the
//! committed-offset protocol (plan §5.3): the bytes of a segment up to its
//! `committed_end` never change once committed, and the database names
//! every byte it counts as committed. So one attempt is:
//!
//! 1. **Pre-copy**: every segment and audit file the live database names
//!    is copied up to the `committed_end` it has then (the bulk of the
//!    bytes, while the server keeps running).
//! 2. **Database**: the SQLite online backup API copies the database in
//!    one step, that is on one read snapshot. This copy is the backup's
//!    truth.
//! 3. **Catch-up**: every file the copy names is brought to exactly the
//!    `committed_end` the copy records, appending what was committed since
//!    the pre-copy; a pre-copied file the copy no longer names (rotated or
//!    evicted meanwhile) is dropped. No byte past a `committed_end` is
//!    copied, so the restored store has no uncommitted tail to cut.
//!
//! Retention removes a file only after the transaction that stops naming
//! it as live committed (a rotation marks the segment `rotated`, an
//! eviction marks the command `evicting`). A file the copy names that is
//! gone in step 3 was therefore removed after step 2, during the short
//! catch-up: the attempt is dropped and the whole backup starts again, at
//! most `attempts` times. A file that was already missing in step 1 and
//! that the copy still names as live was not removed by retention: that is
//! damage in the live store, reported, copied as it is, and found again
//! (as an incident) when the backup is restored.
//!
//! The manifest (size and SHA-256 of every file) is written last, so a
//! directory without one is not a backup. A restore verifies every file
//! against it before it writes anything.
//!
//! Every path is built from the layout's fixed names and the segment
//! naming functions; a manifest's paths are accepted only when they parse
//! back to such a name.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::backup::{Backup, StepResult};
use rusqlite::{Connection, OpenFlags};
use rvbox_segment::{
    audit_file_name, parse_audit_file_name, parse_segment_file_name, segment_dir_name,
    segment_file_name,
};
use sha2::{Digest as _, Sha256};

use crate::error::StoreError;
use crate::fs::{SegmentFile, StoreFs};
use crate::layout::Layout;

/// The manifest's file name in a backup directory.
pub const MANIFEST: &str = "MANIFEST";
/// The manifest while it is written (renamed to [`MANIFEST`] when whole).
const MANIFEST_PARTIAL: &str = "MANIFEST.partial";
/// The manifest's first line: what it is and its format version.
const FORMAT_LINE: &str = "rvbox-server backup 1";
/// Attempts of a backup unless the operator says otherwise.
pub const DEFAULT_ATTEMPTS: u32 = 3;
/// Most attempts of one backup.
pub const MAX_ATTEMPTS: u32 = 10;
/// Bytes read and written at a time.
const CHUNK: usize = 1 << 20;
/// Largest manifest a restore reads (about 3 million files).
const MAX_MANIFEST_BYTES: u64 = 512 << 20;
/// Tries of the database copy while SQLite reports the source busy.
const DB_BUSY_TRIES: u32 = 50;
/// Pause between two of them.
const DB_BUSY_PAUSE: Duration = Duration::from_millis(100);
/// How long one SQLite call waits for a lock.
const DB_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// One file of a backup, named by what it is, never by a path read from
/// outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackupFile {
    /// `token.key`.
    TokenKey,
    /// `db/rvbox.sqlite3`.
    Database,
    /// A command segment: `segments/<xx>/<uuid>-<ordinal>.seg`.
    Segment {
        /// The command.
        issue: [u8; 16],
        /// The segment ordinal.
        ordinal: u32,
    },
    /// An audit segment: `audit/audit-<ordinal>.seg`.
    Audit {
        /// The audit segment ordinal.
        ordinal: u64,
    },
}

impl BackupFile {
    /// The file's path relative to a data (or backup) directory; `None`
    /// for an ordinal beyond the name format.
    #[must_use]
    pub fn relative(&self) -> Option<String> {
        match self {
            Self::TokenKey => Some(crate::layout::TOKEN_KEY_FILE.to_owned()),
            Self::Database => Some(format!("db/{}", crate::layout::DB_FILE)),
            Self::Segment { issue, ordinal } => segment_file_name(issue, *ordinal)
                .map(|n| format!("segments/{}/{n}", segment_dir_name(issue))),
            Self::Audit { ordinal } => audit_file_name(*ordinal).map(|n| format!("audit/{n}")),
        }
    }

    /// The file a relative path names, accepted only in exactly the form
    /// [`BackupFile::relative`] makes.
    #[must_use]
    pub fn parse(relative: &str) -> Option<Self> {
        let parsed = if relative == crate::layout::TOKEN_KEY_FILE {
            Self::TokenKey
        } else if relative.strip_prefix("db/") == Some(crate::layout::DB_FILE) {
            Self::Database
        } else if let Some(name) = relative.strip_prefix("audit/") {
            Self::Audit {
                ordinal: parse_audit_file_name(name)?,
            }
        } else {
            let rest = relative.strip_prefix("segments/")?;
            let (_, name) = rest.split_once('/')?;
            let (issue, ordinal) = parse_segment_file_name(name)?;
            Self::Segment { issue, ordinal }
        };
        // the canonical form only: no other directory, no alias
        (parsed.relative().as_deref() == Some(relative)).then_some(parsed)
    }

    /// The file's path under `layout`.
    #[must_use]
    pub fn path_in(&self, layout: &Layout) -> Option<PathBuf> {
        match self {
            Self::TokenKey => Some(layout.token_key_file()),
            Self::Database => Some(layout.db_file()),
            Self::Segment { issue, ordinal } => layout.segment_path(issue, *ordinal),
            Self::Audit { ordinal } => {
                audit_file_name(*ordinal).map(|n| layout.audit_dir().join(n))
            }
        }
    }

    fn name(&self) -> String {
        self.relative()
            .unwrap_or_else(|| format!("{self:?} (beyond the name format)"))
    }
}

/// Where an attempt is, for [`backup`]'s observer (tests use it to change
/// the live store between the steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// An attempt begins (the backup directory is empty).
    Start,
    /// The files are pre-copied; the database is not copied yet.
    Precopied,
    /// The database is copied; the catch-up has not begun.
    DatabaseCopied,
}

/// What a backup holds and how it went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupReport {
    /// Attempts made (the last one succeeded).
    pub attempts: u32,
    /// Files in the manifest.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of them, the database's.
    pub database_bytes: u64,
    /// Commands in the copied database.
    pub commands: u64,
    /// Command segment files copied.
    pub segments: u64,
    /// Audit segment files copied.
    pub audit_segments: u64,
    /// Segment bytes copied before the database copy (the last attempt).
    pub precopied_bytes: u64,
    /// Segment bytes copied after it: those committed between the
    /// pre-copy and the database copy.
    pub caught_up_bytes: u64,
    /// The store's highest applied schema migration.
    pub schema_version: i64,
    /// The store's server id.
    pub server_id: [u8; 16],
    /// Whether `token.key` was there to copy (without it a restored store
    /// makes a new one and refuses every earlier page token).
    pub token_key: bool,
    /// Files the copied database names as holding committed bytes that
    /// the live store lacks (missing, or shorter than committed): damage
    /// in the live store, copied as found.
    pub damaged: Vec<String>,
}

/// Why a backup failed.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The data directory holds no store.
    #[error("{} holds no RVBox store (no db/rvbox.sqlite3)", .0.display())]
    NoStore(PathBuf),
    /// The backup directory holds something already.
    #[error("{} is not empty: a backup goes into a new or an empty directory", .0.display())]
    TargetNotEmpty(PathBuf),
    /// One directory is inside the other.
    #[error("the backup directory {} and the data directory {} overlap", .to.display(), .data.display())]
    Overlap {
        /// The backup directory.
        to: PathBuf,
        /// The data directory.
        data: PathBuf,
    },
    /// Retention removed a file the database copy names while it was
    /// being copied, in every attempt.
    #[error(
        "{file} was removed by retention (a rotation or an eviction) while its committed bytes were copied, in each of {attempts} attempt(s); run the backup again, or with more --attempts"
    )]
    Removed {
        /// The file (relative to the data directory).
        file: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A file, the database or the backup directory failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the live database (or its copy) names as committed in one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Committed {
    /// Bytes committed.
    end: u64,
    /// The file is `damaged`: kept as evidence, copied whole as found.
    damaged: bool,
}

/// One file copied in the pre-copy.
#[derive(Debug, Clone, Copy)]
struct Copied {
    /// Bytes now in the backup.
    len: u64,
    /// The live file was missing.
    missing: bool,
}

fn sqlite(context: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |source| StoreError::Sqlite { context, source }
}

fn to_u64(v: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Integrity(format!("{what} is negative: {v}")))
}

/// Every segment and audit file the database on `conn` names as live,
/// with its committed length, read in one transaction. Rotated segments
/// and the files of commands being evicted are not live.
fn committed_files(conn: &Connection) -> Result<BTreeMap<BackupFile, Committed>, StoreError> {
    let tx = conn
        .unchecked_transaction()
        .map_err(sqlite("begin the backup's read"))?;
    let mut files = BTreeMap::new();
    {
        let mut stmt = tx
            .prepare(
                "SELECT s.issue_uuid, s.ordinal, s.committed_end, s.state
                 FROM command_segments s JOIN commands c ON c.issue_uuid = s.issue_uuid
                 WHERE s.state <> 'rotated' AND c.retention = 'retained'",
            )
            .map_err(sqlite("list command segments"))?;
        let mut rows = stmt.query([]).map_err(sqlite("list command segments"))?;
        while let Some(r) = rows.next().map_err(sqlite("list command segments"))? {
            let issue: Vec<u8> = r.get(0).map_err(sqlite("read a command segment"))?;
            let issue = <[u8; 16]>::try_from(issue.as_slice()).map_err(|_| {
                StoreError::Integrity("a command segment's issue_uuid is not 16 bytes".into())
            })?;
            let ordinal: i64 = r.get(1).map_err(sqlite("read a command segment"))?;
            let ordinal = u32::try_from(ordinal).map_err(|_| {
                StoreError::Integrity(format!("segment ordinal {ordinal} is out of range"))
            })?;
            let end: i64 = r.get(2).map_err(sqlite("read a command segment"))?;
            let state: String = r.get(3).map_err(sqlite("read a command segment"))?;
            files.insert(
                BackupFile::Segment { issue, ordinal },
                Committed {
                    end: to_u64(end, "committed_end")?,
                    damaged: state == "damaged",
                },
            );
        }
        let mut stmt = tx
            .prepare("SELECT ordinal, committed_end, state FROM audit_segments")
            .map_err(sqlite("list audit segments"))?;
        let mut rows = stmt.query([]).map_err(sqlite("list audit segments"))?;
        while let Some(r) = rows.next().map_err(sqlite("list audit segments"))? {
            let ordinal: i64 = r.get(0).map_err(sqlite("read an audit segment"))?;
            let end: i64 = r.get(1).map_err(sqlite("read an audit segment"))?;
            let state: String = r.get(2).map_err(sqlite("read an audit segment"))?;
            files.insert(
                BackupFile::Audit {
                    ordinal: to_u64(ordinal, "audit ordinal")?,
                },
                Committed {
                    end: to_u64(end, "committed_end")?,
                    damaged: state == "damaged",
                },
            );
        }
    }
    tx.finish().map_err(sqlite("end the backup's read"))?;
    Ok(files)
}

/// Appends bytes `from..to` of `src` to `dst` (fewer when `src` ends
/// first); returns the end reached.
fn append_range(
    src: &dyn SegmentFile,
    dst: &mut dyn SegmentFile,
    from: u64,
    to: u64,
    buf: &mut [u8],
) -> io::Result<u64> {
    let end = to.min(src.len()?);
    let mut at = from;
    while at < end {
        let n = usize::try_from(end - at).map_or(buf.len(), |left| left.min(buf.len()));
        let part = buf
            .get_mut(..n)
            .ok_or_else(|| io::Error::other("copy buffer"))?;
        src.read_exact_at(part, at)?;
        dst.append(part)?;
        at += n as u64;
    }
    Ok(end.max(from))
}

/// The SHA-256 and length of a whole file.
fn digest(fs: &dyn StoreFs, path: &Path, buf: &mut [u8]) -> Result<(u64, [u8; 32]), StoreError> {
    let f = fs
        .open(path)
        .map_err(|e| StoreError::io("open a backup file", path, e))?;
    let len = f
        .len()
        .map_err(|e| StoreError::io("stat a backup file", path, e))?;
    let mut h = Sha256::new();
    let mut at = 0u64;
    while at < len {
        let n = usize::try_from(len - at).map_or(buf.len(), |left| left.min(buf.len()));
        let part = buf.get_mut(..n).ok_or_else(|| {
            StoreError::io("read a backup file", path, io::Error::other("buffer"))
        })?;
        f.read_exact_at(part, at)
            .map_err(|e| StoreError::io("read a backup file", path, e))?;
        h.update(&*part);
        at += n as u64;
    }
    Ok((len, h.finalize().into()))
}

/// Lower-case hex.
fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn unhex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(text.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Removes every file a failed attempt left in the backup directory `to`
/// (it was empty when the backup began, so everything in its store
/// directories is the attempt's).
fn clear(fs: &dyn StoreFs, to: &Layout) -> Result<(), StoreError> {
    let mut dirs = vec![to.db_dir(), to.audit_dir()];
    dirs.extend(to.segment_dirs());
    for dir in &dirs {
        let names = match fs.list(dir, usize::MAX) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(StoreError::io("list a backup directory", dir, e)),
        };
        for name in names {
            let path = dir.join(name);
            fs.remove_file(&path)
                .map_err(|e| StoreError::io("remove a file of a failed attempt", &path, e))?;
        }
    }
    for path in [to.token_key_file(), to.root().join(MANIFEST_PARTIAL)] {
        match fs.remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(StoreError::io(
                    "remove a file of a failed attempt",
                    &path,
                    e,
                ));
            }
        }
    }
    Ok(())
}

/// Makes `dir` (private), remembering it for the final directory sync.
fn ensure_dir(
    fs: &dyn StoreFs,
    dir: &Path,
    made: &mut BTreeSet<PathBuf>,
) -> Result<(), StoreError> {
    if made.contains(dir) {
        return Ok(());
    }
    fs.ensure_private_dir(dir)
        .map_err(|e| StoreError::io("create a backup directory", dir, e))?;
    made.insert(dir.to_path_buf());
    Ok(())
}

/// An empty directory to write into: `dir` is created when missing (its
/// parent must exist) and refused when it holds anything.
fn empty_target(fs: &dyn StoreFs, dir: &Path) -> Result<bool, StoreError> {
    match fs.list(dir, usize::MAX) {
        Ok(names) => Ok(names.is_empty()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs.ensure_private_dir(dir)
                .map_err(|e| StoreError::io("create the directory", dir, e))?;
            Ok(true)
        }
        Err(e) => Err(StoreError::io("read the directory", dir, e)),
    }
}

/// One attempt's end: a backup, or the file retention removed under it.
enum Attempt {
    Done(BackupReport),
    Removed(String),
}

/// Backs up the store in `data` (live or stopped) into `to`, a new or
/// empty directory, in at most `attempts` attempts (see the module docs);
/// `observe` is called at each [`Stage`] with the attempt's number.
///
/// # Errors
/// [`BackupError`]; the backup directory is left without a manifest (and
/// emptied of the attempt's files when the failure allows it).
pub fn backup(
    fs: &dyn StoreFs,
    data: &Layout,
    to: &Path,
    attempts: u32,
    now_ms: i64,
    observe: &mut dyn FnMut(u32, Stage),
) -> Result<BackupReport, BackupError> {
    match fs.list(&data.db_dir(), usize::MAX) {
        Ok(names) if names.iter().any(|n| n == crate::layout::DB_FILE) => {}
        Ok(_) => return Err(BackupError::NoStore(data.root().to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(BackupError::NoStore(data.root().to_path_buf()));
        }
        Err(e) => return Err(StoreError::io("read the data directory", data.db_dir(), e).into()),
    }
    if !empty_target(fs, to)? {
        return Err(BackupError::TargetNotEmpty(to.to_path_buf()));
    }
    let real_to = fs
        .resolve_dir(to)
        .map_err(|e| StoreError::io("resolve the backup directory", to, e))?;
    let real_data = fs
        .resolve_dir(data.root())
        .map_err(|e| StoreError::io("resolve the data directory", data.root(), e))?;
    if real_to.starts_with(&real_data) || real_data.starts_with(&real_to) {
        return Err(BackupError::Overlap {
            to: real_to,
            data: real_data,
        });
    }
    let out = Layout::new(&real_to);
    let attempts = attempts.clamp(1, MAX_ATTEMPTS);
    let mut last = String::new();
    for n in 1..=attempts {
        observe(n, Stage::Start);
        let result = attempt(fs, data, &out, n, now_ms, observe);
        match result {
            Ok(Attempt::Done(mut report)) => {
                report.attempts = n;
                return Ok(report);
            }
            Ok(Attempt::Removed(file)) => {
                tracing::warn!(attempt = n, file = %file, "a file was removed by retention during the backup; starting again");
                clear(fs, &out)?;
                last = file;
            }
            Err(e) => {
                if let Err(c) = clear(fs, &out) {
                    tracing::warn!(error = %c, "the failed backup's files were not all removed");
                }
                return Err(e.into());
            }
        }
    }
    Err(BackupError::Removed {
        file: last,
        attempts,
    })
}

fn attempt(
    fs: &dyn StoreFs,
    data: &Layout,
    out: &Layout,
    n: u32,
    now_ms: i64,
    observe: &mut dyn FnMut(u32, Stage),
) -> Result<Attempt, StoreError> {
    let mut buf = vec![0u8; CHUNK];
    let mut dirs = BTreeSet::new();
    for dir in [
        out.root().to_path_buf(),
        out.db_dir(),
        out.segments_dir(),
        out.audit_dir(),
    ] {
        ensure_dir(fs, &dir, &mut dirs)?;
    }
    let src = Connection::open_with_flags(
        data.db_file(),
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sqlite("open the live database read-only"))?;
    src.busy_timeout(DB_BUSY_TIMEOUT)
        .map_err(sqlite("set the busy timeout"))?;

    // 1. pre-copy, up to what the live database calls committed now
    let mut report = BackupReport::default();
    let mut copied: BTreeMap<BackupFile, Copied> = BTreeMap::new();
    for (file, c) in committed_files(&src)? {
        let (Some(from), Some(dest)) = (file.path_in(data), file.path_in(out)) else {
            continue;
        };
        let live = match fs.open(&from) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                copied.insert(
                    file,
                    Copied {
                        len: 0,
                        missing: true,
                    },
                );
                continue;
            }
            Err(e) => return Err(StoreError::io("open a live segment", &from, e)),
        };
        if let Some(dir) = dest.parent() {
            ensure_dir(fs, dir, &mut dirs)?;
        }
        let mut f = fs
            .create_new(&dest)
            .map_err(|e| StoreError::io("create a backup file", &dest, e))?;
        let want = if c.damaged { u64::MAX } else { c.end };
        let len = append_range(live.as_ref(), f.as_mut(), 0, want, &mut buf)
            .map_err(|e| StoreError::io("copy a segment", &from, e))?;
        report.precopied_bytes += len;
        copied.insert(
            file,
            Copied {
                len,
                missing: false,
            },
        );
    }
    observe(n, Stage::Precopied);

    // 2. the database, in one step (one read snapshot)
    ensure_dir(fs, &out.db_dir(), &mut dirs)?;
    let db = out.db_file();
    drop(
        fs.create_new(&db)
            .map_err(|e| StoreError::io("create the database copy", &db, e))?,
    );
    let mut dst = Connection::open_with_flags(
        &db,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sqlite("open the database copy"))?;
    dst.busy_timeout(DB_BUSY_TIMEOUT)
        .map_err(sqlite("set the busy timeout"))?;
    {
        let b = Backup::new(&src, &mut dst).map_err(sqlite("start the database copy"))?;
        let mut tries = 0;
        loop {
            match b.step(-1).map_err(sqlite("copy the database"))? {
                StepResult::Done => break,
                StepResult::Busy | StepResult::Locked if tries < DB_BUSY_TRIES => {
                    tries += 1;
                    std::thread::sleep(DB_BUSY_PAUSE);
                }
                // `More` never comes back from a step of every page
                other => {
                    return Err(StoreError::Integrity(format!(
                        "the database copy did not finish: {other:?} after {tries} tries"
                    )));
                }
            }
        }
    }
    drop(src);
    // a self-contained file: no WAL beside it (the store sets WAL again
    // when it opens the restored copy)
    dst.pragma_update(None, "journal_mode", "DELETE")
        .map_err(sqlite("make the database copy self-contained"))?;
    let snapshot = committed_files(&dst)?;
    report.commands = dst
        .query_row("SELECT COUNT(*) FROM commands", [], |r| r.get::<_, i64>(0))
        .map_err(sqlite("count commands"))
        .and_then(|v| to_u64(v, "the command count"))?;
    report.schema_version = dst
        .query_row("SELECT MAX(version) FROM schema_migrations", [], |r| {
            r.get::<_, i64>(0)
        })
        .map_err(sqlite("read the schema version"))?;
    let id: Option<Vec<u8>> = dst
        .query_row(
            "SELECT value FROM store_meta WHERE key = 'server_id'",
            [],
            |r| r.get(0),
        )
        .map_err(sqlite("read the server id"))
        .ok();
    if let Some(id) = id.and_then(|v| <[u8; 16]>::try_from(v.as_slice()).ok()) {
        report.server_id = id;
    }
    drop(dst);
    observe(n, Stage::DatabaseCopied);

    // 3. catch up to exactly what the copy calls committed
    for (file, c) in &snapshot {
        let (Some(from), Some(dest)) = (file.path_in(data), file.path_in(out)) else {
            return Err(StoreError::Integrity(format!(
                "{} is beyond the segment name format",
                file.name()
            )));
        };
        let before = copied.get(file).copied();
        let have = match before {
            Some(Copied {
                missing: false,
                len,
            }) => len,
            _ => 0,
        };
        if c.damaged && before.is_some_and(|b| !b.missing) {
            // evidence, copied whole in the pre-copy; never appended to
            continue;
        }
        if !c.damaged && have == c.end {
            continue;
        }
        if have > c.end {
            // a committed length went backwards: not a live store's doing
            return Ok(Attempt::Removed(file.name()));
        }
        let live = match fs.open(&from) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if before.is_some_and(|b| b.missing) || c.damaged {
                    // missing before the copy named it live: damage
                    report.damaged.push(file.name());
                    continue;
                }
                return Ok(Attempt::Removed(file.name()));
            }
            Err(e) => return Err(StoreError::io("open a live segment", &from, e)),
        };
        if let Some(dir) = dest.parent() {
            ensure_dir(fs, dir, &mut dirs)?;
        }
        let mut f = if before.is_some_and(|b| !b.missing) {
            fs.open(&dest)
        } else {
            fs.create_new(&dest)
        }
        .map_err(|e| StoreError::io("open a backup file", &dest, e))?;
        let want = if c.damaged { u64::MAX } else { c.end };
        let end = append_range(live.as_ref(), f.as_mut(), have, want, &mut buf)
            .map_err(|e| StoreError::io("copy a segment", &from, e))?;
        report.caught_up_bytes += end - have;
        copied.insert(
            *file,
            Copied {
                len: end,
                missing: false,
            },
        );
        if !c.damaged && end < c.end {
            report.damaged.push(file.name());
        }
    }
    for (file, c) in &copied {
        if !c.missing && !snapshot.contains_key(file) {
            // rotated or evicted since the pre-copy: not in this backup
            if let Some(dest) = file.path_in(out) {
                fs.remove_file(&dest)
                    .map_err(|e| StoreError::io("drop a file the copy does not name", &dest, e))?;
            }
        }
    }

    // the token key
    let key = data.token_key_file();
    match fs.open(&key) {
        Ok(live) => {
            let dest = out.token_key_file();
            let mut f = fs
                .create_new(&dest)
                .map_err(|e| StoreError::io("create a backup file", &dest, e))?;
            append_range(live.as_ref(), f.as_mut(), 0, u64::MAX, &mut buf)
                .map_err(|e| StoreError::io("copy the token key", &key, e))?;
            report.token_key = true;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::io("open the token key", &key, e)),
    }

    // durable, then described
    fs.sync_filesystem(out.root())
        .map_err(|e| StoreError::io("sync the backup's filesystem", out.root(), e))?;
    let dir_list: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    fs.sync_dirs(&dir_list)
        .map_err(|(d, e)| StoreError::io("sync a backup directory", d, e))?;
    let mut files: Vec<BackupFile> = Vec::new();
    if report.token_key {
        files.push(BackupFile::TokenKey);
    }
    files.push(BackupFile::Database);
    files.extend(
        snapshot
            .keys()
            .filter(|f| copied.get(f).is_some_and(|c| !c.missing)),
    );
    let mut text = format!(
        "{FORMAT_LINE}\ncreated_ms {now_ms}\nserver_id {}\nschema_version {}\ncommands {}\n",
        uuid::Uuid::from_bytes(report.server_id).hyphenated(),
        report.schema_version,
        report.commands
    );
    for file in &files {
        let (Some(path), Some(rel)) = (file.path_in(out), file.relative()) else {
            continue;
        };
        let (len, sum) = digest(fs, &path, &mut buf)?;
        let _ = writeln!(text, "file {len} {} {rel}", hex(&sum));
        report.files += 1;
        report.bytes += len;
        match file {
            BackupFile::Database => report.database_bytes = len,
            BackupFile::Segment { .. } => report.segments += 1,
            BackupFile::Audit { .. } => report.audit_segments += 1,
            BackupFile::TokenKey => {}
        }
    }
    let _ = writeln!(text, "end {}", report.files);
    let partial = out.root().join(MANIFEST_PARTIAL);
    let mut m = fs
        .create_new(&partial)
        .map_err(|e| StoreError::io("create the manifest", &partial, e))?;
    m.append(text.as_bytes())
        .and_then(|()| m.sync_data())
        .map_err(|e| StoreError::io("write the manifest", &partial, e))?;
    let manifest = out.root().join(MANIFEST);
    fs.rename(&partial, &manifest)
        .map_err(|e| StoreError::io("put the manifest in place", &manifest, e))?;
    fs.sync_dir(out.root())
        .map_err(|e| StoreError::io("sync the backup directory", out.root(), e))?;
    Ok(Attempt::Done(report))
}

/// One file of a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestEntry {
    /// The file.
    pub file: BackupFile,
    /// Its length.
    pub size: u64,
    /// Its SHA-256.
    pub sha256: [u8; 32],
}

/// A backup's manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest {
    /// When the backup was taken (Unix ms).
    pub created_ms: i64,
    /// The store's server id (as written).
    pub server_id: String,
    /// The store's schema version.
    pub schema_version: i64,
    /// Commands in the backed-up database.
    pub commands: u64,
    /// Every file, in the order written.
    pub files: Vec<ManifestEntry>,
}

/// Why a restore refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The directory holds no manifest.
    #[error("{}: no {MANIFEST}: not a complete RVBox backup (a backup that did not finish has none)", .0.display())]
    NoManifest(PathBuf),
    /// The manifest cannot be read as one.
    #[error("{} line {line}: {reason}", .path.display())]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// Its line (1-based).
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A file of the backup does not match the manifest.
    #[error("the backup does not match its manifest: {file}: {reason}")]
    Mismatch {
        /// The file (relative).
        file: String,
        /// What differs.
        reason: String,
    },
    /// The target holds something already.
    #[error("{} is not empty: restore into a new or an empty directory", .0.display())]
    TargetNotEmpty(PathBuf),
    /// A file or directory operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Reads and checks the manifest of the backup in `from`.
///
/// # Errors
/// [`RestoreError::NoManifest`], [`RestoreError::Manifest`] for anything
/// that is not exactly a manifest (an unknown format, a path that is not a
/// store name, a file named twice, a missing database, a count that does
/// not match), or a read failure.
pub fn read_manifest(fs: &dyn StoreFs, from: &Path) -> Result<Manifest, RestoreError> {
    let path = from.join(MANIFEST);
    let f = match fs.open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(RestoreError::NoManifest(from.to_path_buf()));
        }
        Err(e) => return Err(StoreError::io("open the manifest", &path, e).into()),
    };
    let bad = |line: usize, reason: String| RestoreError::Manifest {
        path: path.clone(),
        line,
        reason,
    };
    let len = f
        .len()
        .map_err(|e| StoreError::io("stat the manifest", &path, e))?;
    if len > MAX_MANIFEST_BYTES {
        return Err(bad(0, format!("{len} bytes, above {MAX_MANIFEST_BYTES}")));
    }
    let mut bytes = vec![0u8; usize::try_from(len).unwrap_or(0)];
    f.read_exact_at(&mut bytes, 0)
        .map_err(|e| StoreError::io("read the manifest", &path, e))?;
    let text = String::from_utf8(bytes).map_err(|_| bad(0, "not UTF-8".into()))?;
    let mut m = Manifest::default();
    let mut seen = BTreeSet::new();
    let mut ended = None;
    for (i, line) in text.lines().enumerate() {
        let no = i + 1;
        if ended.is_some() {
            return Err(bad(no, "text after the end line".into()));
        }
        if i == 0 {
            if line != FORMAT_LINE {
                return Err(bad(no, format!("expected {FORMAT_LINE:?}")));
            }
            continue;
        }
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        let number = |v: &str| -> Result<u64, RestoreError> {
            v.parse::<u64>()
                .map_err(|_| bad(no, format!("{key}: not a number: {v:?}")))
        };
        match key {
            "created_ms" => {
                m.created_ms = rest
                    .parse()
                    .map_err(|_| bad(no, format!("created_ms: not a number: {rest:?}")))?;
            }
            "server_id" => m.server_id = rest.to_owned(),
            "schema_version" => {
                m.schema_version = rest
                    .parse()
                    .map_err(|_| bad(no, format!("schema_version: not a number: {rest:?}")))?;
            }
            "commands" => m.commands = number(rest)?,
            "file" => {
                let mut parts = rest.splitn(3, ' ');
                let (Some(size), Some(sum), Some(rel)) = (parts.next(), parts.next(), parts.next())
                else {
                    return Err(bad(no, "expected: file SIZE SHA256 PATH".into()));
                };
                let file = BackupFile::parse(rel)
                    .ok_or_else(|| bad(no, format!("{rel:?} is not a file of a data directory")))?;
                if !seen.insert(file) {
                    return Err(bad(no, format!("{rel} is named twice")));
                }
                m.files.push(ManifestEntry {
                    file,
                    size: number(size)?,
                    sha256: unhex32(sum).ok_or_else(|| bad(no, "not a SHA-256".into()))?,
                });
            }
            "end" => ended = Some(number(rest)?),
            _ => return Err(bad(no, format!("unknown line {key:?}"))),
        }
    }
    let lines = text.lines().count();
    match ended {
        None => Err(bad(lines, "no end line: the manifest is cut short".into())),
        Some(n) if n != m.files.len() as u64 => Err(bad(
            lines,
            format!(
                "the end line counts {n} files, the manifest names {}",
                m.files.len()
            ),
        )),
        Some(_) if !seen.contains(&BackupFile::Database) => {
            Err(bad(lines, "the manifest names no database".into()))
        }
        Some(_) => Ok(m),
    }
}

/// Reads `entry` from the backup in `from`, checking its length and
/// SHA-256, and hands each part to `sink`.
fn read_verified(
    fs: &dyn StoreFs,
    from: &Path,
    entry: &ManifestEntry,
    buf: &mut [u8],
    sink: &mut dyn FnMut(&[u8]) -> Result<(), StoreError>,
) -> Result<(), RestoreError> {
    let rel = entry.file.name();
    let mismatch = |reason: String| RestoreError::Mismatch {
        file: rel.clone(),
        reason,
    };
    let path = from.join(&rel);
    let f = match fs.open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(mismatch("missing from the backup".into()));
        }
        Err(e) => return Err(StoreError::io("open a backup file", &path, e).into()),
    };
    let len = f
        .len()
        .map_err(|e| StoreError::io("stat a backup file", &path, e))?;
    if len != entry.size {
        return Err(mismatch(format!(
            "{len} bytes, the manifest says {}",
            entry.size
        )));
    }
    let mut h = Sha256::new();
    let mut at = 0u64;
    while at < len {
        let n = usize::try_from(len - at).map_or(buf.len(), |left| left.min(buf.len()));
        let part = buf.get_mut(..n).ok_or_else(|| {
            StoreError::io("read a backup file", &path, io::Error::other("buffer"))
        })?;
        f.read_exact_at(part, at)
            .map_err(|e| StoreError::io("read a backup file", &path, e))?;
        h.update(&*part);
        sink(part)?;
        at += n as u64;
    }
    let sum: [u8; 32] = h.finalize().into();
    if sum != entry.sha256 {
        return Err(mismatch(format!(
            "SHA-256 {}, the manifest says {}",
            hex(&sum),
            hex(&entry.sha256)
        )));
    }
    Ok(())
}

/// Checks every file of the backup in `from` against `manifest` (length
/// and SHA-256), writing nothing.
///
/// # Errors
/// [`RestoreError::Mismatch`] naming the first file that differs or is
/// missing, or a read failure.
pub fn verify_backup(
    fs: &dyn StoreFs,
    from: &Path,
    manifest: &Manifest,
) -> Result<u64, RestoreError> {
    let mut buf = vec![0u8; CHUNK];
    let mut bytes = 0;
    for entry in &manifest.files {
        read_verified(fs, from, entry, &mut buf, &mut |_| Ok(()))?;
        bytes += entry.size;
    }
    Ok(bytes)
}

/// Copies the backup in `from` into the data directory of `to` (new, or
/// empty), checking every file against `manifest` again as it goes; the
/// database goes last, so a directory a failure leaves holds no store.
/// Returns the bytes restored. Opening the store (recovery, the integrity
/// check) is the caller's next step.
///
/// # Errors
/// [`RestoreError::TargetNotEmpty`]; [`RestoreError::Mismatch`] when a
/// file changed since it was verified (the files copied so far stay:
/// remove the directory before trying again); a write failure.
pub fn restore_files(
    fs: &dyn StoreFs,
    from: &Path,
    manifest: &Manifest,
    to: &Layout,
) -> Result<u64, RestoreError> {
    if !empty_target(fs, to.root())? {
        return Err(RestoreError::TargetNotEmpty(to.root().to_path_buf()));
    }
    to.create(fs)?;
    let mut buf = vec![0u8; CHUNK];
    let mut dirs = BTreeSet::new();
    for d in [to.root(), &to.db_dir(), &to.segments_dir(), &to.audit_dir()] {
        dirs.insert(d.to_path_buf());
    }
    let mut ordered: Vec<&ManifestEntry> = manifest
        .files
        .iter()
        .filter(|e| e.file != BackupFile::Database)
        .collect();
    ordered.extend(
        manifest
            .files
            .iter()
            .filter(|e| e.file == BackupFile::Database),
    );
    let mut bytes = 0;
    for entry in ordered {
        let Some(dest) = entry.file.path_in(to) else {
            continue;
        };
        if let Some(dir) = dest.parent() {
            ensure_dir(fs, dir, &mut dirs)?;
        }
        let mut f = fs
            .create_new(&dest)
            .map_err(|e| StoreError::io("create a restored file", &dest, e))?;
        read_verified(fs, from, entry, &mut buf, &mut |part| {
            f.append(part)
                .map_err(|e| StoreError::io("write a restored file", &dest, e))
        })?;
        f.sync_data()
            .map_err(|e| StoreError::io("sync a restored file", &dest, e))?;
        bytes += entry.size;
    }
    let dir_list: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    fs.sync_dirs(&dir_list)
        .map_err(|(d, e)| StoreError::io("sync a restored directory", d, e))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_parse_back_only_in_their_canonical_form() {
        let issue = [0xab; 16];
        for f in [
            BackupFile::TokenKey,
            BackupFile::Database,
            BackupFile::Segment { issue, ordinal: 7 },
            BackupFile::Audit { ordinal: 3 },
        ] {
            let rel = f.relative().unwrap();
            assert_eq!(BackupFile::parse(&rel), Some(f), "{rel}");
        }
        let seg = BackupFile::Segment { issue, ordinal: 7 }
            .relative()
            .unwrap();
        let name = seg.rsplit('/').next().unwrap();
        for bad in [
            format!("segments/00/{name}"),
            format!("segments/{name}"),
            format!("../{seg}"),
            format!("./{seg}"),
            "db/other.sqlite3".to_owned(),
            "audit/../token.key".to_owned(),
            "/token.key".to_owned(),
            "lock".to_owned(),
        ] {
            assert_eq!(BackupFile::parse(&bad), None, "{bad}");
        }
    }
}
