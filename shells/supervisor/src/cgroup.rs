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

fn probe_v2(parent: &Path) -> Result<bool, String> {
    // one probe per call: two supervisors detecting at once in one process
    // shared a per-process name, and one removed the probe the other was
    // reading, which then fell back to process groups
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = parent.join(format!(".probe-{}-{n}", std::process::id()));
    match std::fs::create_dir(&probe) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", probe.display())),
    }
    let kill = probe.join("cgroup.kill").exists() && probe.join("cgroup.procs").exists();
    let freeze = probe.join("cgroup.freeze").exists();
    if let Err(e) = std::fs::remove_dir(&probe) {
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
    mounts: &[procfs::CgroupMount],
    own: &[procfs::CgroupLine],
    parent: Option<&Path>,
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
            fs_dir(&mount.mount_point, &mount.root, &line.path)
                .ok_or_else(|| format!("own v2 cgroup {} lies outside the mount", line.path))?
                .join(COMMAND_CGROUPS_DIR)
        }
    };
    if !parent.starts_with(&mount.mount_point) || parent == mount.mount_point {
        return Err(format!(
            "{} is not a cgroup below {}",
            parent.display(),
            mount.mount_point.display()
        ));
    }
    std::fs::create_dir_all(&parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let freeze = probe_v2(&parent)?;
    let available: BTreeSet<String> = procfs::read_bounded(&parent.join("cgroup.controllers"))
        .map(|t| t.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    for c in ["cpu", "memory", "pids", "io"] {
        if available.contains(c)
            && let Err(e) = write_file(&parent.join("cgroup.subtree_control"), &format!("+{c}"))
        {
            tracing::info!(controller = c, error = %e, "cannot enable a v2 controller for command cgroups");
        }
    }
    let controllers = procfs::read_bounded(&parent.join("cgroup.subtree_control"))
        .map(|t| t.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
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

    /// Detects this host's layout (see the module documentation).
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
        let (v1, v1_mounted) = detect_v1(&mounts, &own);
        let v2 = match detect_v2(&mounts, &own, v2_parent) {
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
