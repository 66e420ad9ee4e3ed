//! Shell resolution (plan §4.3 item 6, §7.3): each configured shell of this
//! platform is resolved once, at validation, to a canonical absolute
//! executable whose identity is cached. Nothing here takes an environment,
//! so a command's `PATH` override can never select another executable.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::paths::normalize_absolute;
use crate::probe::{FileIdentity, FileKind, HostProbe};

/// A shell type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShellKind {
    /// POSIX `sh`.
    Sh,
    /// `bash`.
    Bash,
    /// Windows `cmd.exe`.
    Cmd,
    /// Windows `powershell.exe`.
    PowerShell,
}

impl ShellKind {
    /// Every shell kind, in summary order.
    pub const ALL: [ShellKind; 4] = [
        ShellKind::Sh,
        ShellKind::Bash,
        ShellKind::Cmd,
        ShellKind::PowerShell,
    ];

    /// The configuration name (`sh`, `bash`, `cmd`, `powershell`).
    pub fn as_str(self) -> &'static str {
        match self {
            ShellKind::Sh => "sh",
            ShellKind::Bash => "bash",
            ShellKind::Cmd => "cmd",
            ShellKind::PowerShell => "powershell",
        }
    }

    /// Parses a configuration name.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// True for the shells of this (Unix) platform.
    pub fn is_current_platform(self) -> bool {
        matches!(self, ShellKind::Sh | ShellKind::Bash)
    }
}

impl fmt::Display for ShellKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated shell of this platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedShell {
    kind: ShellKind,
    configured: PathBuf,
    executable: PathBuf,
    identity: FileIdentity,
}

/// Why a shell can no longer be launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shell {kind} at {path} changed since validation: {reason}")]
pub struct ShellChanged {
    /// The shell.
    pub kind: ShellKind,
    /// The canonical executable path.
    pub path: PathBuf,
    /// What changed.
    pub reason: String,
}

impl ResolvedShell {
    /// The shell type.
    pub fn kind(&self) -> ShellKind {
        self.kind
    }

    /// The path as configured (normalized).
    pub fn configured(&self) -> &Path {
        &self.configured
    }

    /// The canonical absolute executable to launch, exactly.
    pub fn executable(&self) -> &Path {
        &self.executable
    }

    /// The identity recorded at validation.
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// Re-examines the canonical executable immediately before a launch:
    /// it must still be the same regular executable file (same device,
    /// inode, size, mtime, mode and owner). No fallback, no re-resolution.
    pub fn revalidate(&self, probe: &dyn HostProbe) -> Result<(), ShellChanged> {
        let changed = |reason: String| ShellChanged {
            kind: self.kind,
            path: self.executable.clone(),
            reason,
        };
        let stat = probe
            .stat(&self.executable)
            .map_err(|e| changed(format!("cannot examine it: {e}")))?
            .ok_or_else(|| changed("it no longer exists".to_owned()))?;
        if stat.kind != FileKind::Regular || !stat.is_executable() {
            return Err(changed(
                "it is no longer an executable regular file".to_owned(),
            ));
        }
        if stat.identity() != self.identity {
            return Err(changed(
                "its identity (device, inode, size, mtime, mode or owner) differs".to_owned(),
            ));
        }
        Ok(())
    }
}

/// Resolves one configured Unix shell path to a canonical executable.
/// Takes no environment: the path must be absolute, exist, and be an
/// executable regular file owned by root or this user and not writable by
/// group or others.
pub fn resolve_shell(
    probe: &dyn HostProbe,
    kind: ShellKind,
    text: &str,
) -> Result<ResolvedShell, String> {
    if !text.starts_with('/') {
        return Err(format!(
            "{text:?} must be an absolute path; shells are never looked up through PATH"
        ));
    }
    let configured = normalize_absolute(text)?;
    let exists = probe
        .stat(&configured)
        .map_err(|e| format!("cannot examine {}: {e}", configured.display()))?;
    if exists.is_none() {
        return Err(format!("{} does not exist", configured.display()));
    }
    let executable = probe
        .canonicalize(&configured)
        .map_err(|e| format!("cannot resolve {}: {e}", configured.display()))?;
    let stat = probe
        .stat(&executable)
        .map_err(|e| format!("cannot examine {}: {e}", executable.display()))?
        .ok_or_else(|| format!("{} does not exist", executable.display()))?;
    if stat.kind != FileKind::Regular {
        return Err(format!("{} is not a regular file", executable.display()));
    }
    if !stat.is_executable() {
        return Err(format!("{} is not executable", executable.display()));
    }
    let uid = probe.current_uid();
    if stat.uid != 0 && stat.uid != uid {
        return Err(format!(
            "{} is owned by uid {}, neither root nor this user",
            executable.display(),
            stat.uid
        ));
    }
    if stat.is_group_or_world_writable() {
        return Err(format!(
            "{} is writable by group or others (mode {:o})",
            executable.display(),
            stat.mode
        ));
    }
    Ok(ResolvedShell {
        kind,
        configured,
        executable,
        identity: stat.identity(),
    })
}

/// Syntax check of a Windows path string (never advertised on Linux):
/// `X:\...` with no characters Windows forbids in paths.
pub fn check_windows_path(text: &str) -> Result<(), String> {
    let bytes = text.as_bytes();
    let drive = matches!(bytes, [letter, b':', b'\\', ..] if letter.is_ascii_alphabetic());
    if !drive {
        return Err(format!(
            "{text:?} must be an absolute Windows path such as C:\\Windows\\System32\\cmd.exe"
        ));
    }
    if text
        .chars()
        .skip(2)
        .any(|c| matches!(c, '<' | '>' | '"' | '|' | '?' | '*' | ':' | '/') || c.is_control())
    {
        return Err(format!(
            "{text:?} contains a character not allowed in a Windows path"
        ));
    }
    if text.split('\\').any(|part| part == "..") {
        return Err(format!("{text:?} must not contain '..' components"));
    }
    Ok(())
}

/// The validated shells of a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellsConfig {
    resolved: Vec<ResolvedShell>,
    default: ShellKind,
    foreign: Vec<(ShellKind, String)>,
}

impl ShellsConfig {
    pub(crate) fn new(
        resolved: Vec<ResolvedShell>,
        default: ShellKind,
        foreign: Vec<(ShellKind, String)>,
    ) -> Self {
        Self {
            resolved,
            default,
            foreign,
        }
    }

    /// The shells this client advertises (validated, this platform only).
    pub fn advertised(&self) -> Vec<ShellKind> {
        self.resolved.iter().map(ResolvedShell::kind).collect()
    }

    /// The validated executable for a shell type, if advertised. The caller
    /// launches exactly `executable()` after `revalidate`.
    pub fn executable_for(&self, kind: ShellKind) -> Option<&ResolvedShell> {
        self.resolved.iter().find(|s| s.kind == kind)
    }

    /// The platform default shell type.
    pub fn default_kind(&self) -> ShellKind {
        self.default
    }

    /// The default shell (always among the advertised ones).
    pub fn default_shell(&self) -> Option<&ResolvedShell> {
        self.executable_for(self.default)
    }

    /// Other-platform shell paths that passed the syntax check; never
    /// advertised here.
    pub fn foreign(&self) -> &[(ShellKind, String)] {
        &self.foreign
    }
}
