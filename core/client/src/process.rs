//! Values shared by the launch sequence and every supervisor (plan
//! §7.4-§7.5): what a launch needs, the identity a launcher reports, and
//! the events a supervised process tree produces. The Unix supervisor
//! (`rvbox-supervisor`) and the simulator's supervisor both speak these;
//! the client core decides with them.

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

/// How this host supervises process trees (reported in the hello and in
/// health).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Supervision {
    /// A delegated, writable cgroup v2 subtree: a per-command cgroup for
    /// supervision, kill and freeze, and v2 resource controls.
    CgroupV2,
    /// A v2 tree without resource controllers beside v1 controllers:
    /// supervision, kill and freeze through v2, limits through v1.
    Hybrid,
    /// No usable cgroup: the launcher's process group, with the documented
    /// caveat that a descendant calling `setsid` escapes it.
    ProcessGroup,
}

impl Supervision {
    /// The wire value.
    #[must_use]
    pub fn to_wire(self) -> wire::SupervisionMode {
        match self {
            Self::CgroupV2 => wire::SupervisionMode::CgroupV2,
            Self::Hybrid => wire::SupervisionMode::Hybrid,
            Self::ProcessGroup => wire::SupervisionMode::Fallback,
        }
    }
}

/// Resource controls of one launch, compiled from the requested profiles
/// at acceptance (empty: no restriction).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceLimits {
    /// `cpu.max` quota and period in microseconds.
    pub cpu_max: Option<(u64, u64)>,
    /// `cpu.weight` (1..=10000).
    pub cpu_weight: Option<u64>,
    /// `memory.max` in bytes.
    pub memory_max: Option<u64>,
    /// `memory.high` in bytes.
    pub memory_high: Option<u64>,
    /// `pids.max`.
    pub pids_max: Option<u64>,
    /// `io.max` rules: `major:minor` and the four optional limits.
    pub io_max: Vec<IoLimit>,
}

impl ResourceLimits {
    /// True when nothing is restricted.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One `io.max` rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoLimit {
    /// Device major.
    pub major: u32,
    /// Device minor.
    pub minor: u32,
    /// Read bytes per second.
    pub read_bps: Option<u64>,
    /// Write bytes per second.
    pub write_bps: Option<u64>,
    /// Read operations per second.
    pub read_iops: Option<u64>,
    /// Write operations per second.
    pub write_iops: Option<u64>,
}

/// Everything a supervisor needs to start one blocked launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The command.
    pub issue: Uuid7,
    /// The shell type (sh or bash on Unix).
    pub shell: wire::ShellType,
    /// The canonical absolute shell executable validated at startup; it is
    /// checked again immediately before the launch.
    pub shell_path: String,
    /// The private generated wrapper file the shell runs.
    pub wrapper_path: String,
    /// The effective working directory.
    pub cwd: String,
    /// Environment overrides on top of the daemon's environment, sorted by
    /// key.
    pub env: Vec<(String, String)>,
    /// Resource controls (applied and read back while the launcher is
    /// blocked; an essential one that cannot be applied refuses the launch).
    pub limits: ResourceLimits,
}

/// The platform identity of a blocked launcher, persisted as
/// `launch_prepared` before anything is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchIdentity {
    /// The launcher's pid (leader of its own session and process group).
    pub launcher_pid: u32,
    /// The process group (equal to the launcher's pid).
    pub process_group: u32,
    /// The launcher's start time from `/proc/<pid>/stat` (clock ticks since
    /// boot): with the pid, the birth identity that tells a reused pid apart.
    pub birth_ticks: u64,
    /// The per-command cgroup, when one supervises the tree.
    pub cgroup: Option<String>,
}

/// How a process tree's root ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// It died of this native signal.
    Signal(i32),
}

/// Why a launch failed before the requested shell ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchFailure {
    /// Policy or host facts refuse it for good (a shell no longer the
    /// validated executable, a working directory that is not allowed, a
    /// resource control that cannot be applied): the command ends
    /// `REJECTED` as unsupported or invalid, before any authorization.
    Permanent(String),
    /// A temporary failure (fork, pipe or file limits): the launch may be
    /// tried again once the launcher is verified dead.
    Transient(String),
}

/// What a supervised process tree reports, in order per command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    /// The blocked launcher runs, is placed in its cgroup and verified
    /// there, and its resource controls are written and read back.
    Ready(LaunchIdentity),
    /// The launch could not be prepared, or failed before `exec`.
    Failed(LaunchFailure),
    /// The launcher reported a successful `exec` of the shell.
    Running,
    /// Raw bytes read from one pipe (at most 64 KiB).
    Output {
        /// The stream.
        stream: wire::OutputStream,
        /// Observed wall time.
        observed_ms: i64,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// Bytes a pipe reader discarded because its hand-off queue was full
    /// (never blocking the child); counted exactly.
    Dropped {
        /// The stream.
        stream: wire::OutputStream,
        /// Raw bytes discarded.
        raw_bytes: u64,
        /// First observation.
        first_ms: i64,
        /// Last observation.
        last_ms: i64,
    },
    /// One stdin write reached the child's pipe.
    StdinWritten {
        /// Its sequence.
        write_seq: u64,
    },
    /// The diagnostics sampler saw the tree's progress state change:
    /// `suspected_hung` set after the configured period without progress,
    /// or cleared by the next progress. Diagnostic only: it never changes
    /// the command's lifecycle.
    Diagnostics(wire::Diagnostics),
    /// The root exited; the drain grace period runs.
    Exited(Exit),
    /// The tree is gone and the pipes are closed (or were given up after
    /// the grace period: those streams are listed as incomplete). This is
    /// the last event of a launch.
    Drained {
        /// Streams not drained to EOF.
        incomplete: Vec<wire::OutputStream>,
    },
}

/// A process event of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandProcessEvent {
    /// The command.
    pub issue: Uuid7,
    /// What happened.
    pub event: ProcessEvent,
}

/// Everything a supervisor needs to start one terminal's holder
/// (docs/terminals.md): the shell runs on a PTY the holder owns, in the
/// terminal's own cgroup where the host has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminalSpec {
    /// The terminal (the PTY session id).
    pub terminal: Uuid7,
    /// The shell type (sh or bash on Unix).
    pub shell: wire::ShellType,
    /// The canonical absolute shell executable validated at startup.
    pub shell_path: String,
    /// The effective working directory.
    pub cwd: String,
    /// Environment overrides on top of the daemon's environment, sorted by
    /// key.
    pub env: Vec<(String, String)>,
    /// Rows (1..=1000).
    pub rows: u16,
    /// Columns (1..=1000).
    pub cols: u16,
    /// Resource controls of the terminal's cgroup (empty: none).
    pub limits: ResourceLimits,
}

/// What the daemon keeps durably to find a terminal's holder again and
/// prove it is the one it started.
#[derive(Clone, PartialEq, Eq)]
pub struct HolderIdentity {
    /// The holder's private socket.
    pub socket: String,
    /// Its pid.
    pub pid: u32,
    /// Field 22 of its `/proc/<pid>/stat`: with the pid, its birth
    /// identity.
    pub start_ticks: u64,
    /// The host's boot id when it started.
    pub boot_id: String,
    /// The token it proves itself with (never logged).
    pub token: [u8; 32],
    /// The terminal's v2 cgroup, when one holds it.
    pub cgroup: Option<String>,
}

impl std::fmt::Debug for HolderIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the token
        f.debug_struct("HolderIdentity")
            .field("socket", &self.socket)
            .field("pid", &self.pid)
            .field("start_ticks", &self.start_ticks)
            .field("boot_id", &self.boot_id)
            .field("cgroup", &self.cgroup)
            .finish_non_exhaustive()
    }
}

/// Why a holder is no longer reachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderLoss {
    /// The host restarted since the holder started: the terminal ended
    /// with it.
    HostRestarted,
    /// The holder is gone, or what answers is not it.
    Gone,
}

/// What a terminal's holder reports through the supervisor, in order per
/// terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TerminalEvent {
    /// The holder runs and its identity is known (answers a start).
    Started(HolderIdentity),
    /// The holder could not be started (answers a start).
    Failed(LaunchFailure),
    /// The recorded holder proved its identity (answers an adoption).
    Adopted,
    /// Output bytes from `offset` (at most 64 KiB). `cut` bytes before
    /// `offset` left the holder's ring before they could be read (a
    /// replay from an offset older than the ring).
    Output {
        /// The offset of the first byte.
        offset: u64,
        /// The bytes.
        bytes: Vec<u8>,
        /// Bytes lost just before `offset`.
        cut: u64,
    },
    /// Every input frame up to `seq` is written to the PTY (cumulative; a
    /// repeat is acknowledged again and never written twice).
    InputAcked {
        /// The highest frame written.
        seq: u64,
    },
    /// The shell ended; no output follows `final_offset`.
    Exited {
        /// How it ended.
        exit: Exit,
        /// The offset after the last output byte.
        final_offset: u64,
    },
    /// The holder cannot be reached (answers an adoption, or ends a live
    /// terminal).
    Lost {
        /// Why.
        loss: HolderLoss,
        /// What was found (for logs).
        detail: String,
    },
}

/// A terminal event of one terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminalProcessEvent {
    /// The terminal.
    pub terminal: Uuid7,
    /// What happened.
    pub event: TerminalEvent,
}
