//! Path rules (plan §4.3 item 5): absolute, lexically normalized, resolved
//! through the host probe when they exist, and checked for type and
//! ownership. Private modes are an access control, not encryption.

use std::path::{Path, PathBuf};

use crate::probe::{FileKind, FileStat, HostProbe};

/// Lexically normalizes an absolute path: removes empty and `.` components
/// and a trailing slash. Refuses relative paths, `..` and NUL.
pub fn normalize_absolute(text: &str) -> Result<PathBuf, String> {
    if text.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if text.contains('\0') {
        return Err("must not contain a NUL character".to_owned());
    }
    if !text.starts_with('/') {
        return Err(format!(
            "{text:?} must be an absolute path (start with '/')"
        ));
    }
    let mut out = String::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(format!("{text:?} must not contain '..' components")),
            other => {
                out.push('/');
                out.push_str(other);
            }
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(PathBuf::from(out))
}

/// A normalized path, and what the host says about it when it exists.
#[derive(Debug, Clone)]
pub(crate) struct Examined {
    /// The canonical path when it exists, else the normalized path.
    pub(crate) path: PathBuf,
    /// The stat of the path when it exists.
    pub(crate) stat: Option<FileStat>,
}

/// Normalizes and, when the path exists, canonicalizes and stats it.
pub(crate) fn examine(probe: &dyn HostProbe, text: &str) -> Result<Examined, String> {
    let normalized = normalize_absolute(text)?;
    examine_path(probe, &normalized)
}

/// Like [`examine`] for an already normalized path.
pub(crate) fn examine_path(probe: &dyn HostProbe, normalized: &Path) -> Result<Examined, String> {
    match probe.stat(normalized) {
        Ok(None) => Ok(Examined {
            path: normalized.to_path_buf(),
            stat: None,
        }),
        Ok(Some(_)) => {
            let canonical = probe
                .canonicalize(normalized)
                .map_err(|e| format!("cannot resolve {}: {e}", normalized.display()))?;
            let stat = probe
                .stat(&canonical)
                .map_err(|e| format!("cannot examine {}: {e}", canonical.display()))?;
            Ok(Examined {
                path: canonical,
                stat,
            })
        }
        Err(e) => Err(format!("cannot examine {}: {e}", normalized.display())),
    }
}

/// A private state directory: when it exists it must be a directory owned
/// by the daemon's user (or examined by root) and not group- or
/// world-writable. A missing directory is created later by the daemon.
pub(crate) fn private_dir(probe: &dyn HostProbe, text: &str) -> Result<PathBuf, String> {
    let examined = examine(probe, text)?;
    if let Some(stat) = examined.stat {
        if stat.kind != FileKind::Dir {
            return Err(format!(
                "{} exists and is not a directory",
                examined.path.display()
            ));
        }
        let uid = probe.current_uid();
        if stat.uid != uid && uid != 0 {
            return Err(format!(
                "{} is owned by uid {}, not by this user (uid {uid})",
                examined.path.display(),
                stat.uid
            ));
        }
        if stat.is_group_or_world_writable() {
            return Err(format!(
                "{} is group- or world-writable (mode {:o}); make it private (e.g. 0700)",
                examined.path.display(),
                stat.mode
            ));
        }
    }
    Ok(examined.path)
}

/// An existing directory (CWD roots, default CWD).
pub(crate) fn existing_dir(probe: &dyn HostProbe, text: &str) -> Result<PathBuf, String> {
    let examined = examine(probe, text)?;
    match examined.stat {
        Some(stat) if stat.kind == FileKind::Dir => Ok(examined.path),
        Some(_) => Err(format!("{} is not a directory", examined.path.display())),
        None => Err(format!("{} does not exist", examined.path.display())),
    }
}

/// An existing regular file (the CA file).
pub(crate) fn existing_file(probe: &dyn HostProbe, text: &str) -> Result<PathBuf, String> {
    let examined = examine(probe, text)?;
    match examined.stat {
        Some(stat) if stat.kind == FileKind::Regular => Ok(examined.path),
        Some(_) => Err(format!("{} is not a regular file", examined.path.display())),
        None => Err(format!("{} does not exist", examined.path.display())),
    }
}

/// True when `inner` equals `outer` or lies below it (component-wise).
pub(crate) fn within(inner: &Path, outer: &Path) -> bool {
    inner.starts_with(outer)
}
