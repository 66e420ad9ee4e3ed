//! The cgroup layout of this host and the per-command cgroups (plan §7.4,
//! §7.5; design dependencies §8).
//!
//! Detection at startup, from `/proc/self/mountinfo` and
//! `/proc/self/cgroup`:
//! - a cgroup2 mount whose parent directory for command cgroups can be
//!   created and whose child cgroups offer `cgroup.kill` supervises trees
//!   (a probe child is created and removed to check);
//! - if v1 hierarchies for `memory`, `pids` or `cpu` are mounted beside it,
//!   the host is [`Supervision::Hybrid`]: supervision through v2, limits
//!   through v1 cgroups created under the daemon's own v1 cgroups (the
//!   memory one must be a child of the daemon's memory cgroup);
//! - otherwise [`Supervision::CgroupV2`], limits through the controllers
//!   the parent's `cgroup.subtree_control` enables;
//! - without a usable v2 tree, [`Supervision::ProcessGroup`].
//!
//! Delegation under pure cgroup v2 (`Delegate=yes`): a non-root cgroup may
//! hold processes or enable controllers for its children, not both (the
//! no-internal-processes rule). So a daemon alone in its own cgroup first
//! moves itself (`cgroup.procs` moves every thread) into the leaf
//! [`DAEMON_LEAF`], then enables `cpu`, `memory`, `pids` and `io` (those
//! offered) in its own `cgroup.subtree_control`; command cgroups live under
//! [`COMMAND_CGROUPS_DIR`], a sibling of the leaf:
//!
//! ```text
//! <own cgroup>/            cgroup.subtree_control: +cpu +memory +pids +io
//!   daemon/                the daemon (every thread)
//!   rvbox/                 cgroup.subtree_control: the same
//!     <command id>/        one command's tree, limits applied here
//! ```
//!
//! A daemon that shares its cgroup with other processes does not move
//! (the controllers could not be enabled anyway); the real root cgroup,
//! exempt from the rule, is left as it is.
//!
//! Every requested control is written and read back before the launcher is
//! released; a control this layout cannot apply refuses the launch and the
//! cgroups created for it are removed again.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rvbox_client_core::process::{IoLimit, ResourceLimits, Supervision};
use rvbox_domain::ids::Uuid7;

use crate::procfs;

/// Name of the directory holding command cgroups under the daemon's own
/// cgroup (v2 default parent and every v1 parent).
pub const COMMAND_CGROUPS_DIR: &str = "rvbox";
/// Name of the leaf the daemon moves itself into under pure cgroup v2,
/// beside [`COMMAND_CGROUPS_DIR`].
pub const DAEMON_LEAF: &str = "daemon";
/// Controllers enabled for command cgroups, when offered.
const V2_CONTROLLERS: [&str; 4] = ["cpu", "memory", "pids", "io"];
/// Tolerance of a memory read-back: the kernel rounds a byte limit down to
/// its page size (at most 64 KiB on any Linux architecture).
const MEMORY_ROUNDING_BYTES: u64 = 64 * 1024;
/// Attempts to remove a cgroup directory the kernel still reports busy.
const RMDIR_ATTEMPTS: u32 = 50;
/// Pause between those attempts.
const RMDIR_PAUSE: Duration = Duration::from_millis(10);
/// Poll interval while waiting for `frozen 1`.
const FREEZE_POLL: Duration = Duration::from_millis(2);

/// A v1 controller RVBox applies limits through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum V1Controller {
    /// `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`).
    Memory,
    /// `pids.max`.
    Pids,
    /// `cpu.cfs_quota_us`/`cpu.cfs_period_us` and `cpu.shares`.
    Cpu,
}

impl V1Controller {
    const ALL: [Self; 3] = [Self::Memory, Self::Pids, Self::Cpu];

    /// The controller's kernel name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Cpu => "cpu",
        }
    }
}

/// The cgroup v2 tree used for supervision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V2Layout {
    /// Where cgroup2 is mounted.
    pub mount_point: PathBuf,
    /// The hierarchy path mounted there (as `/proc/<pid>/cgroup` names it).
    pub mount_root: String,
    /// The directory command cgroups are created in.
    pub parent: PathBuf,
    /// Controllers enabled for command cgroups (the parent's
    /// `cgroup.subtree_control`).
    pub controllers: BTreeSet<String>,
    /// Whether command cgroups offer `cgroup.freeze`.
    pub freeze: bool,
}

/// One v1 hierarchy used for limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V1Layout {
    /// The controller.
    pub controller: V1Controller,
    /// Where the hierarchy is mounted.
    pub mount_point: PathBuf,
    /// The hierarchy path mounted there.
    pub mount_root: String,
    /// The directory command cgroups are created in: `rvbox` under the
    /// daemon's own cgroup of this hierarchy.
    pub parent: PathBuf,
}

/// The detected layout (reported in health).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupLayout {
    /// How trees are supervised.
    pub mode: Supervision,
    /// The v2 tree, when trees are supervised through it.
    pub v2: Option<V2Layout>,
    /// v1 hierarchies available for limits.
    pub v1: Vec<V1Layout>,
}

/// The cgroups of one command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandCgroups {
    /// The v2 cgroup supervising the tree.
    pub v2: Option<PathBuf>,
    /// v1 cgroups carrying limits.
    pub v1: Vec<(V1Controller, PathBuf)>,
}

impl CommandCgroups {
    /// Every directory.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.v2
            .iter()
            .map(PathBuf::as_path)
            .chain(self.v1.iter().map(|(_, p)| p.as_path()))
    }
}

/// Why a command's cgroups could not be set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A requested control this layout cannot apply.
    Unsupported(String),
    /// A temporary condition (an existing directory, a resource limit).
    Transient(String),
}

/// The directory `path` (as `/proc/.../cgroup` names it) has in a mount.
fn fs_dir(mount_point: &Path, mount_root: &str, path: &str) -> Option<PathBuf> {
    let rel = if mount_root == "/" {
        path.strip_prefix('/')?
    } else {
        let rest = path.strip_prefix(mount_root)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        rest.trim_start_matches('/')
    };
    Some(if rel.is_empty() {
        mount_point.to_path_buf()
    } else {
        mount_point.join(rel)
    })
}

/// How `/proc/<pid>/cgroup` names a directory of a mount.
pub(crate) fn proc_path(mount_point: &Path, mount_root: &str, dir: &Path) -> Option<String> {
    let rel = dir.strip_prefix(mount_point).ok()?.to_str()?;
    let root = mount_root.trim_end_matches('/');
    Some(if rel.is_empty() {
        if root.is_empty() {
            "/".to_owned()
        } else {
            root.to_owned()
        }
    } else {
        format!("{root}/{rel}")
    })
}

fn write_file(path: &Path, value: &str) -> io::Result<()> {
    // one write(2): cgroup files take a value per write
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// The filesystem detection works on: the kernel's cgroup filesystems,
/// or in tests a scratch tree that behaves as a delegated v2 subtree.
pub(crate) trait CgroupFs {
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    fn remove_dir(&self, dir: &Path) -> io::Result<()>;
    fn exists(&self, path: &Path) -> bool;
    fn read(&self, path: &Path) -> io::Result<String>;
    /// One `write(2)` to an existing file.
    fn write(&self, path: &Path, value: &str) -> io::Result<()>;
}

/// The kernel's cgroup filesystems.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernel;

impl CgroupFs for Kernel {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::remove_dir(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn read(&self, path: &Path) -> io::Result<String> {
        procfs::read_bounded(path)
    }
    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        write_file(path, value)
    }
}

fn words(fs: &dyn CgroupFs, path: &Path) -> BTreeSet<String> {
    fs.read(path)
        .map(|t| t.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Enables each of [`V2_CONTROLLERS`] that `dir` offers for its children;
/// a refusal is logged (the controller is then not offered below).
fn enable_controllers(fs: &dyn CgroupFs, dir: &Path) {
    let available = words(fs, &dir.join("cgroup.controllers"));
    for c in V2_CONTROLLERS {
        if available.contains(c)
            && let Err(e) = fs.write(&dir.join("cgroup.subtree_control"), &format!("+{c}"))
        {
            tracing::info!(cgroup = %dir.display(), controller = c, error = %e, "cannot enable a v2 controller for command cgroups");
        }
    }
}

/// Pure cgroup v2: moves the daemon (process `pid`, every thread) out of
/// its own cgroup `own` into the leaf [`DAEMON_LEAF`], so that `own` may
/// enable controllers for the command cgroups beside it, and enables them
/// (see the module documentation).
fn delegate(fs: &dyn CgroupFs, own: &Path, pid: u32) {
    // the real root cgroup (no cgroup.type) may hold processes and enable
    // controllers at once
    if !fs.exists(&own.join("cgroup.type")) {
        tracing::debug!(cgroup = %own.display(), "own cgroup is the root: no leaf needed");
        return;
    }
    let procs: Vec<String> = match fs.read(&own.join("cgroup.procs")) {
        Ok(t) => t.split_whitespace().map(str::to_owned).collect(),
        Err(e) => {
            tracing::warn!(cgroup = %own.display(), error = %e, "cannot read the daemon's own cgroup.procs");
            return;
        }
    };
    let me = pid.to_string();
    if procs.iter().any(|p| *p != me) {
        tracing::warn!(
            cgroup = %own.display(),
            processes = procs.len(),
            "the daemon shares its cgroup with other processes: it stays there, and no controller can be enabled for command cgroups (run it under a unit with Delegate=yes)"
        );
        return;
    }
    if procs.is_empty() {
        // already in the leaf (a second supervisor in this process)
        enable_controllers(fs, own);
        return;
    }
    let leaf = own.join(DAEMON_LEAF);
    match fs.create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            tracing::warn!(cgroup = %leaf.display(), error = %e, "cannot create the daemon's leaf cgroup");
            return;
        }
    }
    if let Err(e) = fs.write(&leaf.join("cgroup.procs"), &me) {
        tracing::warn!(cgroup = %leaf.display(), error = %e, "cannot move the daemon into its leaf cgroup");
        return;
    }
    tracing::info!(leaf = %leaf.display(), "moved the daemon into its leaf cgroup (delegated cgroup v2)");
    enable_controllers(fs, own);
}

fn probe_v2(fs: &dyn CgroupFs, parent: &Path) -> Result<bool, String> {
    // one probe per call: two supervisors detecting at once in one process
    // shared a per-process name, and one removed the probe the other was
    // reading, which then fell back to process groups
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = parent.join(format!(".probe-{}-{n}", std::process::id()));
    match fs.create_dir(&probe) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", probe.display())),
    }
    let kill = fs.exists(&probe.join("cgroup.kill")) && fs.exists(&probe.join("cgroup.procs"));
    let freeze = fs.exists(&probe.join("cgroup.freeze"));
    if let Err(e) = fs.remove_dir(&probe) {
        tracing::warn!(path = %probe.display(), error = %e, "cannot remove the cgroup probe");
    }
    if kill {
        Ok(freeze)
    } else {
        Err(format!(
            "{} offers no cgroup.kill (kernel older than 5.14?)",
            parent.display()
        ))
    }
}

fn detect_v2(
    fs: &dyn CgroupFs,
    mounts: &[procfs::CgroupMount],
    own: &[procfs::CgroupLine],
    parent: Option<&Path>,
    delegation: Option<u32>,
) -> Result<V2Layout, String> {
    let mount = mounts
        .iter()
        .find(|m| m.v2)
        .ok_or_else(|| "no cgroup2 mount".to_owned())?;
    let parent = match parent {
        Some(p) => p.to_path_buf(),
        None => {
            let line = own
                .iter()
                .find(|l| l.hierarchy == 0 && l.controllers.is_empty())
                .ok_or_else(|| "no v2 line in /proc/self/cgroup".to_owned())?;
            let mut own_dir = fs_dir(&mount.mount_point, &mount.root, &line.path)
                .ok_or_else(|| format!("own v2 cgroup {} lies outside the mount", line.path))?;
            if let Some(pid) = delegation {
                // a daemon already in its leaf (moved by an earlier
                // detection in this process, or started there by systemd's
                // DelegateSubgroup=daemon) delegates from the leaf's parent
                if own_dir.file_name() == Some(std::ffi::OsStr::new(DAEMON_LEAF))
                    && own_dir != mount.mount_point
                {
                    own_dir.pop();
                }
                delegate(fs, &own_dir, pid);
            }
            own_dir.join(COMMAND_CGROUPS_DIR)
        }
    };
    if !parent.starts_with(&mount.mount_point) || parent == mount.mount_point {
        return Err(format!(
            "{} is not a cgroup below {}",
            parent.display(),
            mount.mount_point.display()
        ));
    }
    fs.create_dir_all(&parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let freeze = probe_v2(fs, &parent)?;
    enable_controllers(fs, &parent);
    let controllers = words(fs, &parent.join("cgroup.subtree_control"));
    Ok(V2Layout {
        mount_point: mount.mount_point.clone(),
        mount_root: mount.root.clone(),
        parent,
        controllers,
        freeze,
    })
}

fn detect_v1(mounts: &[procfs::CgroupMount], own: &[procfs::CgroupLine]) -> (Vec<V1Layout>, bool) {
    let mut out = Vec::new();
    let mut mounted = false;
    for c in V1Controller::ALL {
        let Some(mount) = mounts
            .iter()
            .find(|m| !m.v2 && m.controllers.iter().any(|x| x == c.name()))
        else {
            continue;
        };
        mounted = true;
        let Some(line) = own
            .iter()
            .find(|l| l.hierarchy != 0 && l.controllers.iter().any(|x| x == c.name()))
        else {
            tracing::warn!(controller = c.name(), "no own v1 cgroup line");
            continue;
        };
        let Some(own_dir) = fs_dir(&mount.mount_point, &mount.root, &line.path) else {
            tracing::warn!(
                controller = c.name(),
                "own v1 cgroup lies outside its mount"
            );
            continue;
        };
        let parent = own_dir.join(COMMAND_CGROUPS_DIR);
        if let Err(e) = std::fs::create_dir_all(&parent) {
            tracing::warn!(controller = c.name(), path = %parent.display(), error = %e, "v1 controller unusable");
            continue;
        }
        out.push(V1Layout {
            controller: c,
            mount_point: mount.mount_point.clone(),
            mount_root: mount.root.clone(),
            parent,
        });
    }
    (out, mounted)
}

impl CgroupLayout {
    /// The process-group layout: no cgroups at all.
    #[must_use]
    pub fn process_group() -> Self {
        Self {
            mode: Supervision::ProcessGroup,
            v2: None,
            v1: Vec::new(),
        }
    }

    /// Detects this host's layout (see the module documentation); under
    /// pure cgroup v2 the daemon may move itself into its leaf cgroup.
    #[must_use]
    pub fn detect(v2_parent: Option<&Path>) -> Self {
        let mounts = match procfs::read_bounded(Path::new("/proc/self/mountinfo")) {
            Ok(t) => procfs::parse_mountinfo(&t),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read /proc/self/mountinfo: no cgroups");
                return Self::process_group();
            }
        };
        let own = match procfs::read_bounded(Path::new("/proc/self/cgroup")) {
            Ok(t) => procfs::parse_cgroup_file(&t),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read /proc/self/cgroup: no cgroups");
                return Self::process_group();
            }
        };
        Self::detect_from(&Kernel, &mounts, &own, std::process::id(), v2_parent)
    }

    /// Detection from the given mounts and own cgroups of process `pid`,
    /// on `fs` (the kernel's, or a test's scratch tree).
    pub(crate) fn detect_from(
        fs: &dyn CgroupFs,
        mounts: &[procfs::CgroupMount],
        own: &[procfs::CgroupLine],
        pid: u32,
        v2_parent: Option<&Path>,
    ) -> Self {
        let (v1, v1_mounted) = detect_v1(mounts, own);
        // pure v2: the controllers are all in the v2 tree, so the
        // daemon's cgroup must be delegated as the kernel's rule asks
        let delegation = (!v1_mounted).then_some(pid);
        let v2 = match detect_v2(fs, mounts, own, v2_parent, delegation) {
            Ok(v2) => Some(v2),
            Err(reason) => {
                tracing::warn!(%reason, "no usable cgroup v2 tree: process-group supervision");
                None
            }
        };
        let mode = match (&v2, v1_mounted) {
            (Some(_), true) => Supervision::Hybrid,
            (Some(_), false) => Supervision::CgroupV2,
            (None, _) => Supervision::ProcessGroup,
        };
        Self { mode, v2, v1 }
    }

    fn v1(&self, c: V1Controller) -> Option<&V1Layout> {
        self.v1.iter().find(|l| l.controller == c)
    }

    fn v2_has(&self, controller: &str) -> bool {
        self.v2
            .as_ref()
            .is_some_and(|v| v.controllers.contains(controller))
    }

    /// The directories a command's cgroups have (or would have).
    #[must_use]
    pub fn command_dirs(&self, issue: &Uuid7) -> CommandCgroups {
        self.named_dirs(&issue.to_string())
    }

    /// The directories a terminal's cgroups have (or would have): named
    /// apart from every command's.
    #[must_use]
    pub fn terminal_dirs(&self, terminal: &Uuid7) -> CommandCgroups {
        self.named_dirs(&format!("pty-{terminal}"))
    }

    fn named_dirs(&self, name: &str) -> CommandCgroups {
        CommandCgroups {
            v2: self.v2.as_ref().map(|v| v.parent.join(name)),
            v1: self
                .v1
                .iter()
                .map(|l| (l.controller, l.parent.join(name)))
                .collect(),
        }
    }

    /// Creates a command's cgroups and applies `limits`, reading every
    /// control back. On a refusal nothing created remains.
    pub(crate) fn create(
        &self,
        issue: &Uuid7,
        limits: &ResourceLimits,
    ) -> Result<CommandCgroups, Refusal> {
        self.create_in(issue, self.command_dirs(issue), limits)
    }

    /// Creates a terminal's cgroups as [`Self::create`] does a command's.
    pub(crate) fn create_terminal(
        &self,
        terminal: &Uuid7,
        limits: &ResourceLimits,
    ) -> Result<CommandCgroups, Refusal> {
        self.create_in(terminal, self.terminal_dirs(terminal), limits)
    }

    fn create_in(
        &self,
        issue: &Uuid7,
        all: CommandCgroups,
        limits: &ResourceLimits,
    ) -> Result<CommandCgroups, Refusal> {
        let plan = self.plan(limits)?;
        let mut made = CommandCgroups::default();
        let result = (|| {
            if let Some(dir) = &all.v2 {
                make_dir(dir)?;
                made.v2 = Some(dir.clone());
            }
            for (c, dir) in &all.v1 {
                if plan.v1.contains(c) {
                    make_dir(dir)?;
                    made.v1.push((*c, dir.clone()));
                }
            }
            apply(&plan, &made, limits).map_err(Refusal::Unsupported)
        })();
        match result {
            Ok(()) => Ok(made),
            Err(refusal) => {
                if let Err(e) = remove(&made) {
                    tracing::error!(%issue, error = %e, "cannot remove the cgroups of a refused launch");
                }
                Err(refusal)
            }
        }
    }

    /// Whether this layout can apply every control in `limits` (a check of
    /// where each would go; nothing is created). Startup compiles each
    /// configured profile against it (plan §7.5).
    ///
    /// # Errors
    /// The reason naming the first control that cannot go anywhere.
    pub fn check(&self, limits: &ResourceLimits) -> Result<(), String> {
        match self.plan(limits) {
            Ok(_) => Ok(()),
            Err(Refusal::Unsupported(s) | Refusal::Transient(s)) => Err(s),
        }
    }

    /// Where each requested control goes; a refusal before anything is
    /// created when one cannot go anywhere.
    fn plan(&self, limits: &ResourceLimits) -> Result<Plan, Refusal> {
        let mut plan = Plan::default();
        let unsupported = |what: &str| {
            Refusal::Unsupported(format!(
                "resource control {what} is unsupported on this host's cgroup layout"
            ))
        };
        let mut route = |wanted: bool, v2name: &str, c: V1Controller| -> Result<(), Refusal> {
            if !wanted {
                return Ok(());
            }
            if self.v2_has(v2name) {
                plan.v2.insert(v2name.to_owned());
            } else if self.v1(c).is_some() {
                plan.v1.insert(c);
            } else {
                return Err(unsupported(v2name));
            }
            Ok(())
        };
        route(
            limits.memory_max.is_some() || limits.memory_high.is_some(),
            "memory",
            V1Controller::Memory,
        )?;
        route(limits.pids_max.is_some(), "pids", V1Controller::Pids)?;
        route(
            limits.cpu_max.is_some() || limits.cpu_weight.is_some(),
            "cpu",
            V1Controller::Cpu,
        )?;
        if plan.v1.contains(&V1Controller::Memory) && limits.memory_high.is_some() {
            return Err(unsupported("memory.high (no cgroup v1 equivalent)"));
        }
        if limits.io_max.iter().any(has_io_limit) {
            if self.v2_has("io") {
                plan.v2.insert("io".to_owned());
            } else {
                return Err(unsupported(
                    "io.max (needs the cgroup v2 io controller delegated)",
                ));
            }
        }
        Ok(plan)
    }
}

#[derive(Debug, Default)]
struct Plan {
    v2: BTreeSet<String>,
    v1: BTreeSet<V1Controller>,
}

fn has_io_limit(l: &IoLimit) -> bool {
    l.read_bps.is_some() || l.write_bps.is_some() || l.read_iops.is_some() || l.write_iops.is_some()
}

fn make_dir(dir: &Path) -> Result<(), Refusal> {
    let refuse = |e: io::Error| {
        let what = format!("cannot create cgroup {}: {e}", dir.display());
        match e.kind() {
            io::ErrorKind::PermissionDenied => Refusal::Unsupported(what),
            _ => Refusal::Transient(what),
        }
    };
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            // plan §7.4 step 5: a cgroup of this command that exists before
            // its launch is prepared was left by a launcher the daemon never
            // recorded (it crashed before `launch_prepared` was durable, so
            // nothing was released): an untrusted orphan, cleaned before
            // the retry. A recorded launch is reaped before it is retried,
            // so this never meets one.
            reclaim_stale(dir);
            std::fs::create_dir(dir).map_err(refuse)
        }
        Err(e) => Err(refuse(e)),
    }
}

/// Bound on waiting for a stale cgroup to empty after `cgroup.kill`.
const STALE_EMPTY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Kills what a stale command cgroup holds (v2 `cgroup.kill`; a v1
/// hierarchy's processes are the same processes, placed in both) and
/// removes it.
fn reclaim_stale(dir: &Path) {
    let kill = dir.join("cgroup.kill");
    if kill.exists()
        && let Err(e) = std::fs::write(&kill, "1")
    {
        tracing::warn!(cgroup = %dir.display(), error = %e, "cannot kill a stale command cgroup");
    }
    let until = std::time::Instant::now() + STALE_EMPTY_WAIT;
    while std::time::Instant::now() < until {
        let empty = procfs::read_bounded(&dir.join("cgroup.procs"))
            .map(|t| t.trim().is_empty())
            .unwrap_or(true);
        if empty {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    match remove_dirs(std::iter::once(dir)) {
        Ok(()) => {
            tracing::warn!(cgroup = %dir.display(), "removed a stale command cgroup of an unrecorded launch")
        }
        Err(e) => {
            tracing::error!(cgroup = %dir.display(), error = %e, "cannot remove a stale command cgroup")
        }
    }
}

fn read_control(dir: &Path, file: &str) -> Result<String, String> {
    procfs::read_bounded(&dir.join(file))
        .map(|t| t.trim().to_owned())
        .map_err(|e| format!("cannot read back {file} in {}: {e}", dir.display()))
}

/// Writes a control and checks what the kernel reports back with `ok`.
fn set(dir: &Path, file: &str, value: &str, ok: impl Fn(&str) -> bool) -> Result<(), String> {
    write_file(&dir.join(file), value).map_err(|e| {
        format!(
            "resource control {file} = {value} cannot be applied in {} (unsupported here): {e}",
            dir.display()
        )
    })?;
    let back = read_control(dir, file)?;
    if ok(&back) {
        tracing::debug!(dir = %dir.display(), file, value, "resource control applied and read back");
        Ok(())
    } else {
        Err(format!(
            "resource control {file} = {value} reads back as {back} in {} (unsupported here)",
            dir.display()
        ))
    }
}

fn memory_ok(want: u64) -> impl Fn(&str) -> bool {
    move |back: &str| {
        back.parse::<u64>()
            .is_ok_and(|b| b <= want && want - b < MEMORY_ROUNDING_BYTES)
    }
}

fn exact(want: String) -> impl Fn(&str) -> bool {
    move |back: &str| back == want
}

/// The v1 `cpu.shares` equivalent of a v2 `cpu.weight` (as systemd maps
/// them: weight 100 is 1024 shares).
fn weight_to_shares(weight: u64) -> u64 {
    (weight.saturating_mul(1024) / 100).clamp(2, 262_144)
}

fn io_line(l: &IoLimit) -> String {
    let mut line = format!("{}:{}", l.major, l.minor);
    for (key, v) in [
        ("rbps", l.read_bps),
        ("wbps", l.write_bps),
        ("riops", l.read_iops),
        ("wiops", l.write_iops),
    ] {
        if let Some(v) = v {
            line.push_str(&format!(" {key}={v}"));
        }
    }
    line
}

fn io_ok(l: IoLimit) -> impl Fn(&str) -> bool {
    move |back: &str| {
        let dev = format!("{}:{}", l.major, l.minor);
        let Some(line) = back
            .lines()
            .find(|line| line.split_whitespace().next() == Some(dev.as_str()))
        else {
            return false;
        };
        [
            ("rbps", l.read_bps),
            ("wbps", l.write_bps),
            ("riops", l.read_iops),
            ("wiops", l.write_iops),
        ]
        .iter()
        .all(|(key, want)| {
            let got = line
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{key}=")));
            match want {
                Some(w) => got == Some(w.to_string().as_str()),
                None => got.is_none_or(|g| g == "max"),
            }
        })
    }
}

fn apply(plan: &Plan, cg: &CommandCgroups, limits: &ResourceLimits) -> Result<(), String> {
    let v1 = |c: V1Controller| {
        cg.v1
            .iter()
            .find(|(x, _)| *x == c)
            .map(|(_, d)| d.as_path())
            .ok_or_else(|| format!("no v1 {} cgroup was created", c.name()))
    };
    let v2 = || {
        cg.v2
            .as_deref()
            .ok_or_else(|| "no v2 cgroup was created".to_owned())
    };
    // memory
    if plan.v2.contains("memory") {
        let dir = v2()?;
        if let Some(max) = limits.memory_max {
            set(dir, "memory.max", &max.to_string(), memory_ok(max))?;
        }
        if let Some(high) = limits.memory_high {
            set(dir, "memory.high", &high.to_string(), memory_ok(high))?;
        }
    } else if plan.v1.contains(&V1Controller::Memory)
        && let Some(max) = limits.memory_max
    {
        let dir = v1(V1Controller::Memory)?;
        set(
            dir,
            "memory.limit_in_bytes",
            &max.to_string(),
            memory_ok(max),
        )?;
        // without this a swapping host would page the tree out instead of
        // holding it to the limit
        if dir.join("memory.memsw.limit_in_bytes").exists() {
            set(
                dir,
                "memory.memsw.limit_in_bytes",
                &max.to_string(),
                memory_ok(max),
            )?;
        }
    }
    // pids
    if let Some(max) = limits.pids_max {
        let dir = if plan.v2.contains("pids") {
            v2()?
        } else {
            v1(V1Controller::Pids)?
        };
        set(dir, "pids.max", &max.to_string(), exact(max.to_string()))?;
    }
    // cpu
    if plan.v2.contains("cpu") {
        let dir = v2()?;
        if let Some((quota, period)) = limits.cpu_max {
            let value = format!("{quota} {period}");
            set(dir, "cpu.max", &value, exact(value.clone()))?;
        }
        if let Some(w) = limits.cpu_weight {
            set(dir, "cpu.weight", &w.to_string(), exact(w.to_string()))?;
        }
    } else if plan.v1.contains(&V1Controller::Cpu) {
        let dir = v1(V1Controller::Cpu)?;
        if let Some((quota, period)) = limits.cpu_max {
            set(
                dir,
                "cpu.cfs_period_us",
                &period.to_string(),
                exact(period.to_string()),
            )?;
            set(
                dir,
                "cpu.cfs_quota_us",
                &quota.to_string(),
                exact(quota.to_string()),
            )?;
        }
        if let Some(w) = limits.cpu_weight {
            let shares = weight_to_shares(w);
            set(
                dir,
                "cpu.shares",
                &shares.to_string(),
                exact(shares.to_string()),
            )?;
        }
    }
    // io
    if plan.v2.contains("io") {
        let dir = v2()?;
        for l in limits.io_max.iter().filter(|l| has_io_limit(l)) {
            set(dir, "io.max", &io_line(l), io_ok(*l))?;
        }
    }
    Ok(())
}

/// `cgroup.kill`: SIGKILL to every process of the cgroup and its children.
pub(crate) fn kill(dir: &Path) -> io::Result<()> {
    write_file(&dir.join("cgroup.kill"), "1")
}

/// Freezes or thaws a cgroup.
pub(crate) fn set_frozen(dir: &Path, frozen: bool) -> io::Result<()> {
    write_file(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })
}

/// Waits (bounded) until `cgroup.events` reports `frozen 1`.
pub(crate) fn wait_frozen(dir: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if procfs::read_bounded(&dir.join("cgroup.events"))
            .is_ok_and(|t| t.lines().any(|l| l.trim() == "frozen 1"))
        {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(FREEZE_POLL);
    }
}

/// Writes `pid` into a cgroup's `cgroup.procs`.
pub(crate) fn join(dir: &Path, pid: u32) -> io::Result<()> {
    write_file(&dir.join("cgroup.procs"), &pid.to_string())
}

/// Removes a command's cgroup directories (absent ones are fine).
pub(crate) fn remove(cg: &CommandCgroups) -> Result<(), String> {
    remove_dirs(cg.dirs())
}

/// Removes cgroup directories (absent ones are fine).
pub(crate) fn remove_dirs<'a>(dirs: impl Iterator<Item = &'a Path>) -> Result<(), String> {
    let mut failed = Vec::new();
    for dir in dirs {
        let mut attempt = 0;
        loop {
            match std::fs::remove_dir(dir) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e)
                    if attempt + 1 < RMDIR_ATTEMPTS
                        && e.raw_os_error() == Some(16 /* EBUSY */) =>
                {
                    attempt += 1;
                    std::thread::sleep(RMDIR_PAUSE);
                }
                Err(e) => {
                    failed.push(format!("{}: {e}", dir.display()));
                    break;
                }
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("cannot remove cgroup {}", failed.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_between_mounts_and_proc_names() {
        let m = Path::new("/sys/fs/cgroup/memory");
        assert_eq!(
            fs_dir(m, "/", "/process_api/x"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/process_api/x"))
        );
        assert_eq!(fs_dir(m, "/a", "/a/b"), Some(m.join("b")));
        assert_eq!(fs_dir(m, "/a", "/ab"), None);
        assert_eq!(fs_dir(m, "/a", "/a"), Some(m.to_path_buf()));
        assert_eq!(
            proc_path(m, "/", &m.join("rvbox/i")).as_deref(),
            Some("/rvbox/i")
        );
        assert_eq!(proc_path(m, "/a", &m.join("i")).as_deref(), Some("/a/i"));
        assert_eq!(proc_path(m, "/", m).as_deref(), Some("/"));
    }

    #[test]
    fn read_back_comparisons() {
        assert!(memory_ok(64 << 20)(&(64u64 << 20).to_string()));
        assert!(memory_ok((64 << 20) + 100)(&(64u64 << 20).to_string()));
        assert!(!memory_ok(64 << 20)("max"));
        assert!(!memory_ok(64 << 20)(&(32u64 << 20).to_string()));
        assert_eq!(weight_to_shares(100), 1024);
        assert_eq!(weight_to_shares(1), 10);
        let l = IoLimit {
            major: 8,
            minor: 0,
            read_bps: Some(1000),
            write_bps: None,
            read_iops: None,
            write_iops: Some(5),
        };
        assert_eq!(io_line(&l), "8:0 rbps=1000 wiops=5");
        assert!(io_ok(l)("8:0 rbps=1000 wbps=max riops=max wiops=5"));
        assert!(!io_ok(l)("8:0 rbps=1001 wbps=max riops=max wiops=5"));
        assert!(!io_ok(l)("8:1 rbps=1000 wbps=max riops=max wiops=5"));
    }

    /// A scratch directory tree that behaves as a cgroup v2 hierarchy where
    /// it matters here: a new directory gets the kernel's files and offers
    /// what its parent enables; `cgroup.procs` moves a process out of every
    /// other cgroup; and the no-internal-processes rule holds both ways (a
    /// non-root cgroup with processes cannot enable controllers, one with
    /// controllers enabled cannot take processes), as `EBUSY`.
    struct ScratchTree {
        root: PathBuf,
    }

    fn busy(what: &str) -> io::Error {
        io::Error::other(format!("EBUSY: {what}"))
    }

    impl ScratchTree {
        /// A root cgroup offering `controllers`, all enabled below it.
        fn new(root: &Path, controllers: &str) -> Self {
            std::fs::create_dir_all(root).unwrap();
            for (f, v) in [
                ("cgroup.controllers", controllers),
                ("cgroup.subtree_control", controllers),
                ("cgroup.procs", "1\n"),
            ] {
                std::fs::write(root.join(f), v).unwrap();
            }
            Self {
                root: root.to_path_buf(),
            }
        }

        fn text(&self, dir: &Path, file: &str) -> String {
            std::fs::read_to_string(dir.join(file)).unwrap()
        }

        fn set(&self, dir: &Path, file: &str, words: &BTreeSet<String>) {
            let v: Vec<&str> = words.iter().map(String::as_str).collect();
            std::fs::write(dir.join(file), v.join(" ")).unwrap();
        }

        fn all_dirs(&self) -> Vec<PathBuf> {
            fn walk(d: &Path, out: &mut Vec<PathBuf>) {
                out.push(d.to_path_buf());
                for e in std::fs::read_dir(d).unwrap() {
                    let p = e.unwrap().path();
                    if p.is_dir() {
                        walk(&p, out);
                    }
                }
            }
            let mut out = Vec::new();
            walk(&self.root, &mut out);
            out
        }

        fn is_root(&self, dir: &Path) -> bool {
            dir == self.root
        }

        fn procs(&self, dir: &Path) -> BTreeSet<String> {
            self.text(dir, "cgroup.procs")
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        }
    }

    impl CgroupFs for ScratchTree {
        fn create_dir(&self, dir: &Path) -> io::Result<()> {
            std::fs::create_dir(dir)?;
            let offered = self.text(dir.parent().unwrap(), "cgroup.subtree_control");
            for (f, v) in [
                ("cgroup.type", "domain\n"),
                ("cgroup.procs", ""),
                ("cgroup.kill", ""),
                ("cgroup.freeze", "0\n"),
                ("cgroup.events", "populated 0\nfrozen 0\n"),
                ("cgroup.subtree_control", ""),
                ("cgroup.controllers", offered.as_str()),
            ] {
                std::fs::write(dir.join(f), v)?;
            }
            Ok(())
        }

        fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
            let mut missing = Vec::new();
            let mut d = dir;
            while !d.exists() {
                missing.push(d.to_path_buf());
                d = d.parent().unwrap();
            }
            for m in missing.iter().rev() {
                self.create_dir(m)?;
            }
            Ok(())
        }

        fn remove_dir(&self, dir: &Path) -> io::Result<()> {
            if !self.procs(dir).is_empty() {
                return Err(busy("processes in it"));
            }
            for e in std::fs::read_dir(dir)? {
                let p = e?.path();
                if p.is_dir() {
                    return Err(busy("children in it"));
                }
                std::fs::remove_file(p)?;
            }
            std::fs::remove_dir(dir)
        }

        fn exists(&self, path: &Path) -> bool {
            path.exists()
        }

        fn read(&self, path: &Path) -> io::Result<String> {
            std::fs::read_to_string(path)
        }

        fn write(&self, path: &Path, value: &str) -> io::Result<()> {
            let dir = path.parent().unwrap();
            match path.file_name().and_then(|n| n.to_str()) {
                Some("cgroup.procs") => {
                    if !self.is_root(dir)
                        && !self.text(dir, "cgroup.subtree_control").trim().is_empty()
                    {
                        return Err(busy("controllers enabled: no processes here"));
                    }
                    let pid = value.trim().to_owned();
                    for d in self.all_dirs() {
                        let mut p = self.procs(&d);
                        if p.remove(&pid) {
                            self.set(&d, "cgroup.procs", &p);
                        }
                    }
                    let mut p = self.procs(dir);
                    p.insert(pid);
                    self.set(dir, "cgroup.procs", &p);
                    Ok(())
                }
                Some("cgroup.subtree_control") => {
                    let offered: BTreeSet<String> = self
                        .text(dir, "cgroup.controllers")
                        .split_whitespace()
                        .map(str::to_owned)
                        .collect();
                    let mut enabled: BTreeSet<String> = self
                        .text(dir, "cgroup.subtree_control")
                        .split_whitespace()
                        .map(str::to_owned)
                        .collect();
                    for w in value.split_whitespace() {
                        let (on, c) = match w.split_at(1) {
                            ("+", c) => (true, c),
                            ("-", c) => (false, c),
                            _ => return Err(io::Error::other("EINVAL")),
                        };
                        if !offered.contains(c) {
                            return Err(io::Error::new(io::ErrorKind::NotFound, "not offered"));
                        }
                        if on && !self.is_root(dir) && !self.procs(dir).is_empty() {
                            return Err(busy("processes here: no controllers for children"));
                        }
                        if on {
                            enabled.insert(c.to_owned());
                        } else {
                            enabled.remove(c);
                        }
                    }
                    self.set(dir, "cgroup.subtree_control", &enabled);
                    for e in std::fs::read_dir(dir)? {
                        let child = e?.path();
                        if child.is_dir() {
                            self.set(&child, "cgroup.controllers", &enabled);
                        }
                    }
                    Ok(())
                }
                _ => write_file(path, value),
            }
        }
    }

    fn mounts_of(text: &str) -> Vec<procfs::CgroupMount> {
        procfs::parse_mountinfo(text)
    }

    fn set_of(words: &[&str]) -> BTreeSet<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    /// A delegated unit cgroup `/system.slice/rvbox.service` holding only
    /// the daemon (pid 4242) in a scratch v2 tree; the tree and its mounts.
    fn delegated_unit(dir: &Path) -> (ScratchTree, Vec<procfs::CgroupMount>, PathBuf) {
        let mount = dir.join("cgroup");
        let tree = ScratchTree::new(&mount, "cpu io memory pids hugetlb");
        // systemd enables the controllers down to a delegated unit
        let slice = mount.join("system.slice");
        tree.create_dir(&slice).unwrap();
        tree.write(
            &slice.join("cgroup.subtree_control"),
            "+cpu +io +memory +pids +hugetlb",
        )
        .unwrap();
        let unit = slice.join("rvbox.service");
        tree.create_dir(&unit).unwrap();
        tree.write(&unit.join("cgroup.procs"), "4242").unwrap();
        let mounts = mounts_of(&format!(
            "30 23 0:26 / {} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
            mount.display()
        ));
        (tree, mounts, unit)
    }

    #[test]
    fn a_delegated_v2_daemon_moves_into_its_leaf_and_enables_controllers_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, mounts, unit) = delegated_unit(dir.path());
        // the rule is in force: the unit cannot enable controllers while
        // the daemon is in it
        assert!(
            tree.write(&unit.join("cgroup.subtree_control"), "+memory")
                .is_err()
        );
        let own = procfs::parse_cgroup_file("0::/system.slice/rvbox.service\n");
        let layout = CgroupLayout::detect_from(&tree, &mounts, &own, 4242, None);
        assert_eq!(layout.mode, Supervision::CgroupV2);
        // the daemon (every thread: one cgroup.procs write) is in the leaf
        let leaf = unit.join(DAEMON_LEAF);
        assert_eq!(tree.procs(&leaf), set_of(&["4242"]));
        assert!(tree.procs(&unit).is_empty());
        // the unit enables the four controllers (not hugetlb) for its children
        assert_eq!(
            tree.text(&unit, "cgroup.subtree_control"),
            "cpu io memory pids"
        );
        // command cgroups go under rvbox/, a sibling of the leaf, which
        // enables them again for each command
        let v2 = layout.v2.clone().unwrap();
        assert_eq!(v2.parent, unit.join(COMMAND_CGROUPS_DIR));
        assert_eq!(v2.controllers, set_of(&["cpu", "io", "memory", "pids"]));
        assert!(v2.freeze);
        let issue = Uuid7::parse("t", "01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
        let cmd = layout.command_dirs(&issue).v2.unwrap();
        assert_eq!(cmd, unit.join("rvbox").join(issue.to_string()));
        assert!(!cmd.starts_with(&leaf));
        // a command cgroup takes a process and is offered its controllers
        tree.create_dir(&cmd).unwrap();
        tree.write(&cmd.join("cgroup.procs"), "5000").unwrap();
        assert_eq!(tree.text(&cmd, "cgroup.controllers"), "cpu io memory pids");
        // the probe was removed again
        let left: Vec<_> = std::fs::read_dir(unit.join("rvbox"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_dir())
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from(issue.to_string())]);

        // a second detection in the same process sees itself in the leaf
        // and finds the same layout (no leaf inside the leaf)
        let again = procfs::parse_cgroup_file("0::/system.slice/rvbox.service/daemon\n");
        let second = CgroupLayout::detect_from(&tree, &mounts, &again, 4242, None);
        assert_eq!(second.v2, layout.v2);
        assert!(!leaf.join(DAEMON_LEAF).exists());
        assert_eq!(tree.procs(&leaf), set_of(&["4242"]));
    }

    #[test]
    fn a_daemon_sharing_its_v2_cgroup_stays_and_gets_no_controllers() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, mounts, unit) = delegated_unit(dir.path());
        tree.write(&unit.join("cgroup.procs"), "777").unwrap();
        let own = procfs::parse_cgroup_file("0::/system.slice/rvbox.service\n");
        let layout = CgroupLayout::detect_from(&tree, &mounts, &own, 4242, None);
        assert_eq!(layout.mode, Supervision::CgroupV2);
        assert!(!unit.join(DAEMON_LEAF).exists());
        assert_eq!(tree.procs(&unit), set_of(&["4242", "777"]));
        let v2 = layout.v2.unwrap();
        assert_eq!(v2.parent, unit.join(COMMAND_CGROUPS_DIR));
        assert!(v2.controllers.is_empty(), "{:?}", v2.controllers);
    }

    #[test]
    fn beside_v1_controllers_or_in_the_root_cgroup_the_daemon_does_not_move() {
        let dir = tempfile::tempdir().unwrap();
        // hybrid: a v1 memory hierarchy beside the v2 tree
        let (tree, mut mounts, unit) = delegated_unit(dir.path());
        let memory = dir.path().join("memory");
        std::fs::create_dir_all(&memory).unwrap();
        mounts.extend(mounts_of(&format!(
            "35 31 0:32 / {} rw,relatime - cgroup cgroup rw,memory\n",
            memory.display()
        )));
        let own = procfs::parse_cgroup_file("4:memory:/\n0::/system.slice/rvbox.service\n");
        let layout = CgroupLayout::detect_from(&tree, &mounts, &own, 4242, None);
        assert_eq!(layout.mode, Supervision::Hybrid);
        assert!(!unit.join(DAEMON_LEAF).exists());
        assert_eq!(tree.procs(&unit), set_of(&["4242"]));
        // pure v2, the daemon in the root cgroup (exempt from the rule)
        let dir = tempfile::tempdir().unwrap();
        let (tree, mounts, unit) = delegated_unit(dir.path());
        let root = dir.path().join("cgroup");
        // the daemon alone in the root cgroup
        std::fs::write(root.join("cgroup.procs"), "4242\n").unwrap();
        std::fs::write(unit.join("cgroup.procs"), "").unwrap();
        let own = procfs::parse_cgroup_file("0::/\n");
        let layout = CgroupLayout::detect_from(&tree, &mounts, &own, 4242, None);
        assert_eq!(layout.mode, Supervision::CgroupV2);
        assert!(!root.join(DAEMON_LEAF).exists());
        assert_eq!(layout.v2.unwrap().parent, root.join(COMMAND_CGROUPS_DIR));
    }

    /// `RVBOX_REQUIRE_CGROUPS=1`: a host without what a cgroup test needs
    /// fails the test instead of skipping it.
    fn cgroups_required() -> bool {
        std::env::var_os("RVBOX_REQUIRE_CGROUPS").is_some_and(|v| v == "1")
    }

    fn skip_or_fail(test: &str, why: &str) {
        assert!(
            !cgroups_required(),
            "{test}: RVBOX_REQUIRE_CGROUPS=1, but {why}"
        );
        eprintln!("{test}: SKIPPED: {why} (RVBOX_REQUIRE_CGROUPS=1 makes this a failure)");
    }

    /// The environment variables of the re-executed test process.
    const CHILD_CGROUP: &str = "RVBOX_TEST_DELEGATION_CGROUP";
    const CHILD_CONTROLLER: &str = "RVBOX_TEST_DELEGATION_CONTROLLER";

    fn own_v2_dir(pid: &str) -> Option<(procfs::CgroupMount, PathBuf)> {
        let mounts =
            procfs::parse_mountinfo(&procfs::read_bounded(Path::new("/proc/self/mountinfo")).ok()?);
        let own = procfs::parse_cgroup_file(
            &procfs::read_bounded(&Path::new("/proc").join(pid).join("cgroup")).ok()?,
        );
        let m = mounts.into_iter().find(|m| m.v2)?;
        let line = own.iter().find(|l| l.hierarchy == 0)?;
        let dir = fs_dir(&m.mount_point, &m.root, &line.path)?;
        Some((m, dir))
    }

    /// The kernel's own rule, on a real cgroup2 tree: a process alone in a
    /// cgroup `X` below its v2 cgroup (a test process re-executed into it)
    /// detects a pure v2 layout; `X` can enable a controller for its
    /// children only after the move (before, the kernel refuses with
    /// EBUSY), every thread is in the leaf, and command cgroups are real
    /// cgroups beside it. This host's v2 tree has no cpu, memory, pids or
    /// io controller, so the rule is shown with whichever controller the
    /// tree offers.
    #[test]
    fn a_real_v2_cgroup_is_delegated_by_moving_the_daemon_into_its_leaf() {
        const TEST: &str = "a_real_v2_cgroup_is_delegated_by_moving_the_daemon_into_its_leaf";
        if std::env::var_os(CHILD_CGROUP).is_some() {
            return; // the re-executed process runs delegation_child only
        }
        let Some((_, parent)) = own_v2_dir("self") else {
            skip_or_fail(TEST, "no cgroup2 mount or no v2 line in /proc/self/cgroup");
            return;
        };
        let offered: Vec<String> = procfs::read_bounded(&parent.join("cgroup.controllers"))
            .map(|t| t.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        let enabled =
            procfs::read_bounded(&parent.join("cgroup.subtree_control")).unwrap_or_default();
        // a controller enabled below our cgroup, or one we can enable
        let mut turned_on = None;
        let controller = offered
            .iter()
            .find(|c| enabled.split_whitespace().any(|e| e == c.as_str()))
            .cloned()
            .or_else(|| {
                offered.iter().find_map(|c| {
                    write_file(&parent.join("cgroup.subtree_control"), &format!("+{c}"))
                        .ok()
                        .map(|()| {
                            turned_on = Some(c.clone());
                            c.clone()
                        })
                })
            });
        let Some(controller) = controller else {
            skip_or_fail(
                TEST,
                &format!(
                    "no v2 controller is offered below {} or can be enabled there",
                    parent.display()
                ),
            );
            return;
        };
        let x = parent.join(format!("rvbox-delegation-test-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&x) {
            skip_or_fail(TEST, &format!("cannot create {}: {e}", x.display()));
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cgroup::tests::delegation_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_CGROUP, &x)
            .env(CHILD_CONTROLLER, &controller)
            .output()
            .unwrap();
        // clean up whatever the child left (it has exited: its cgroups are empty)
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut stack = vec![x.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        let removed = remove_dirs(dirs.iter().map(PathBuf::as_path));
        if let Some(c) = turned_on {
            let _ = write_file(&parent.join("cgroup.subtree_control"), &format!("-{c}"));
        }
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "the delegated process failed:\n{text}"
        );
        assert!(
            text.contains("delegation_child: checked"),
            "the child did not run its checks:\n{text}"
        );
        removed.unwrap();
    }

    /// The re-executed half of the test above (a no-op in a normal run).
    #[test]
    fn delegation_child() {
        let Some(x) = std::env::var_os(CHILD_CGROUP).map(PathBuf::from) else {
            return;
        };
        let controller = std::env::var(CHILD_CONTROLLER).unwrap();
        let pid = std::process::id();
        join(&x, pid).unwrap();
        // the rule is in force: X holds a process, so no controllers
        let refused = write_file(&x.join("cgroup.subtree_control"), &format!("+{controller}"));
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(16 /* EBUSY */)),
            "enabling {controller} in an occupied cgroup was not refused with EBUSY: {refused:?}"
        );
        // pure v2 as detection sees it: the cgroup2 mount alone
        let mounts: Vec<_> = procfs::parse_mountinfo(
            &procfs::read_bounded(Path::new("/proc/self/mountinfo")).unwrap(),
        )
        .into_iter()
        .filter(|m| m.v2)
        .collect();
        let own = procfs::parse_cgroup_file(
            &procfs::read_bounded(Path::new("/proc/self/cgroup")).unwrap(),
        );
        let layout = CgroupLayout::detect_from(&Kernel, &mounts, &own, pid, None);
        assert_eq!(layout.mode, Supervision::CgroupV2);
        let leaf = x.join(DAEMON_LEAF);
        // every thread of this process is in the leaf, none left in X
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let tid = task.unwrap().file_name();
            let (_, dir) = own_v2_dir(&format!("self/task/{}", tid.to_string_lossy())).unwrap();
            assert_eq!(dir, leaf, "thread {tid:?}");
        }
        assert_eq!(procfs::cgroup_procs(&leaf).unwrap(), vec![pid]);
        assert!(procfs::cgroup_procs(&x).unwrap().is_empty());
        // and X may now enable the controller for its children
        write_file(&x.join("cgroup.subtree_control"), &format!("+{controller}")).unwrap();
        let enabled = procfs::read_bounded(&x.join("cgroup.subtree_control")).unwrap();
        assert!(
            enabled.split_whitespace().any(|c| c == controller),
            "{enabled}"
        );
        // command cgroups are real cgroups beside the leaf
        let v2 = layout.v2.clone().unwrap();
        assert_eq!(v2.parent, x.join(COMMAND_CGROUPS_DIR));
        let issue = Uuid7::parse("t", "01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
        let made = layout.create(&issue, &ResourceLimits::default()).unwrap();
        let cmd = made.v2.clone().unwrap();
        assert_eq!(cmd, x.join(COMMAND_CGROUPS_DIR).join(issue.to_string()));
        assert!(cmd.join("cgroup.kill").exists());
        remove(&made).unwrap();
        println!("delegation_child: checked");
    }

    #[test]
    fn the_process_group_layout_refuses_every_control() {
        let layout = CgroupLayout::process_group();
        let limits = ResourceLimits {
            pids_max: Some(8),
            ..ResourceLimits::default()
        };
        let issue = Uuid7::parse("t", "01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
        assert!(matches!(
            layout.create(&issue, &limits),
            Err(Refusal::Unsupported(_))
        ));
        assert_eq!(
            layout.create(&issue, &ResourceLimits::default()),
            Ok(CommandCgroups::default())
        );
    }
}
