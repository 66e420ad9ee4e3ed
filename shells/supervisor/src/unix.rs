//! The Unix supervisor (plan §7.4-§7.5): [`UnixSupervisor`].
//!
//! Threads per command: the control thread (accepts the launcher's one
//! connection, checks its peer pid and its `Ready`, then forwards its
//! records), one reader per output pipe, the stdin writer, and a short
//! janitor at the end (reaps the launcher, removes the cgroups). One
//! diagnostics thread samples every tree. The state machine itself runs on
//! the caller's thread, inside the trait methods and `next_event`.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use rvbox_client_core::process::{
    CommandProcessEvent, Exit, HolderIdentity, LaunchFailure, LaunchIdentity, LaunchSpec,
    ProcessEvent, ResourceLimits, Supervision, TerminalEvent, TerminalProcessEvent, TerminalSpec,
};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{
    DEFAULT_DIAGNOSTICS_INTERVAL_MS, DEFAULT_DRAIN_GRACE_MS, DEFAULT_KILL_GRACE_MS,
    DEFAULT_SUSPECTED_HUNG_MS,
};
use rvbox_proto::v1 as wire;

use crate::cgroup::{self, CgroupLayout, CommandCgroups, Refusal};
use crate::channel::{self, ChildEnds};
use crate::diag::{self, Diagnostics};
use crate::frame::{self, FrameError, Record};
use crate::hub::{HandoverBounds, Hub, OutItem};
use crate::launcher::{self, ENV_PREFIX, LAUNCHER_MODE_ARG};
use crate::pipes::{self, StdinOp, StdinSink};
use crate::procfs;
use crate::pty;
use crate::{OrphanOutcome, Supervisor, SupervisorError};

/// How long a started launcher has to connect and report `Ready`.
const LAUNCHER_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a launcher has to exit once it should (and again after it was
/// killed) before the supervisor stops waiting for it.
const LAUNCHER_EXIT_WAIT: Duration = Duration::from_secs(5);
/// Longest wait of the one-connection accept between looks at the
/// cancel flag and the launcher (a connection wakes it at once).
const ACCEPT_POLL: Duration = Duration::from_millis(2);
/// Poll interval while waiting for a launcher to become a zombie.
const EXIT_POLL: Duration = Duration::from_millis(5);
/// The first of those looks after a launcher closed its channel.
const FIRST_EXIT_POLL: Duration = Duration::from_micros(200);
/// How often a draining tree is checked for emptiness.
const DRAIN_POLL: Duration = Duration::from_millis(20);
/// After the residual kill, how long the pipes have to reach end of file.
const KILL_EOF_WAIT: Duration = Duration::from_millis(500);
/// How long a freeze may take before signals go out anyway.
const FREEZE_WAIT: Duration = Duration::from_millis(200);
/// Signals held for a tree between release and `exec`.
const MAX_PENDING_SIGNALS: usize = 8;
/// How long orphan recovery waits for a killed tree to vanish.
const ORPHAN_KILL_WAIT: Duration = Duration::from_secs(3);
/// How long `stop_all` waits for killed trees' launchers to go.
const STOP_ALL_KILL_WAIT: Duration = Duration::from_secs(5);
/// Default bound of supervised trees.
pub const DEFAULT_MAX_TREES: usize = 64;

/// Configuration of the Unix supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// The `rvbox` executable started as the launcher.
    pub launcher: PathBuf,
    /// Arguments selecting the launcher mode (`["__launcher"]`).
    pub launcher_args: Vec<OsString>,
    /// Private (0700) directory for the release sockets.
    pub run_dir: PathBuf,
    /// Tree and pipe drain grace after the root exits.
    pub drain_grace: Duration,
    /// Grace between TERM and KILL in `stop_all`.
    pub kill_grace: Duration,
    /// Diagnostics sampling interval.
    pub diagnostics_interval: Duration,
    /// No progress for this long sets `suspected_hung`.
    pub suspected_hung_after: Duration,
    /// The v2 directory command cgroups are created in (default: `rvbox`
    /// under the daemon's own v2 cgroup).
    pub cgroup_parent: Option<PathBuf>,
    /// Most trees supervised at once.
    pub max_trees: usize,
    /// Use no cgroups at all, whatever the host offers (process-group
    /// supervision; every resource control is then unsupported).
    pub force_process_group: bool,
    /// The shell executables validated at startup, by canonical path, with
    /// the identity recorded then. A launch names one of them, and its
    /// identity is compared again immediately before the launcher starts:
    /// a shell that is not listed, or whose identity changed, refuses the
    /// launch permanently (never a fallback).
    pub shells: BTreeMap<PathBuf, ExecutableIdentity>,
    /// Bounds of the pipe readers' hand-over (see [`HandoverBounds`]).
    pub handover: HandoverBounds,
    /// `exec.allowed_cwd_roots`: a command's or a terminal's working
    /// directory must resolve (symbolic links followed) under one of them,
    /// resolved too, immediately before it starts; the check at
    /// acceptance is lexical.
    pub cwd_roots: Vec<PathBuf>,
}

/// The identity of a validated executable (plan §4.3 item 6), as the
/// configuration's validation records it.
pub use rvbox_config::FileIdentity as ExecutableIdentity;

/// The identity of `path` now, as the configuration's host probe records
/// it at validation.
///
/// # Errors
/// The file cannot be examined, or does not exist.
pub fn identity_of(path: &Path) -> std::io::Result<ExecutableIdentity> {
    use rvbox_config::HostProbe as _;
    match rvbox_daemon_common::RealHost.stat(path) {
        Ok(Some(stat)) => Ok(stat.identity()),
        Ok(None) => Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "it does not exist",
        )),
        Err(e) => Err(std::io::Error::other(e)),
    }
}

impl SupervisorConfig {
    /// The defaults for a launcher executable and a run directory.
    #[must_use]
    pub fn new(launcher: PathBuf, run_dir: PathBuf) -> Self {
        Self {
            launcher,
            launcher_args: vec![LAUNCHER_MODE_ARG.into()],
            run_dir,
            drain_grace: Duration::from_millis(DEFAULT_DRAIN_GRACE_MS),
            kill_grace: Duration::from_millis(DEFAULT_KILL_GRACE_MS),
            diagnostics_interval: Duration::from_millis(DEFAULT_DIAGNOSTICS_INTERVAL_MS),
            suspected_hung_after: Duration::from_millis(DEFAULT_SUSPECTED_HUNG_MS),
            cgroup_parent: None,
            max_trees: DEFAULT_MAX_TREES,
            force_process_group: false,
            shells: BTreeMap::new(),
            handover: HandoverBounds::default(),
            cwd_roots: vec![PathBuf::from("/")],
        }
    }

    /// Records `path` as a validated shell with its identity now (for a
    /// caller that validated it just before; the daemon takes the
    /// identity the configuration recorded).
    ///
    /// # Errors
    /// The file cannot be examined.
    pub fn validated_shell(&mut self, path: &Path) -> std::io::Result<()> {
        let identity = identity_of(path)?;
        self.shells.insert(path.to_path_buf(), identity);
        Ok(())
    }
}

/// What the supervisor's threads tell its state machine.
#[derive(Debug)]
enum Internal {
    Ready(LaunchIdentity),
    PrepareFailed(LaunchFailure),
    ExecOk { child_pid: u32 },
    ExecFailed(LaunchFailure),
    RootExited(Exit),
    LauncherGone(Option<Exit>),
    StdinWritten(u64),
    Diagnostics(wire::Diagnostics),
    CleanedUp,
}

impl StdinSink for Hub<Internal> {
    fn written(&self, issue: Uuid7, write_seq: u64) {
        self.post(issue, Internal::StdinWritten(write_seq));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Launcher started; its `Ready` is not verified yet.
    Preparing,
    /// `Ready` emitted; the launcher is blocked.
    Prepared,
    /// Channel closed before release; waiting for the launcher to die.
    Aborting,
    /// Release sent; waiting for `exec`.
    Releasing,
    /// The shell runs.
    Running,
    /// The root ended (or the launch failed after release): the drain grace.
    Draining,
    /// Residual processes killed: a short wait for end of file.
    Killing,
    /// Finish byte sent: waiting for the launcher to exit.
    Finishing,
    /// The janitor reaps the launcher and removes the cgroups.
    Cleaning,
}

type ChannelSlot = Arc<Mutex<Option<UnixStream>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug)]
struct Tree {
    phase: Phase,
    launcher: Option<Child>,
    launcher_pid: u32,
    channel: ChannelSlot,
    cancel: Arc<AtomicBool>,
    child_ends: Option<ChildEnds>,
    stdin: Option<SyncSender<StdinOp>>,
    stdin_queued: Arc<AtomicUsize>,
    cgroups: CommandCgroups,
    identity: Option<LaunchIdentity>,
    failure: Option<LaunchFailure>,
    aborted: bool,
    released: bool,
    kill_sent: bool,
    launcher_gone: bool,
    pending_signals: Vec<Signal>,
    deadline: Option<Instant>,
    next_check: Instant,
    forced_launcher_kill: bool,
    activity: Arc<AtomicU64>,
}

impl Tree {
    fn outputs_flow(&self) -> bool {
        matches!(
            self.phase,
            Phase::Running | Phase::Draining | Phase::Killing | Phase::Finishing | Phase::Cleaning
        )
    }

    fn shutdown_channel(&self) {
        if let Some(s) = lock(&self.channel).as_ref()
            && let Err(e) = s.shutdown(Shutdown::Both)
            && e.kind() != std::io::ErrorKind::NotConnected
        {
            tracing::warn!(pid = self.launcher_pid, error = %e, "cannot shut the release channel down");
        }
    }
}

/// A pid this supervisor may signal: never 0, 1 or a negative value.
fn pid_of(raw: u32) -> Option<Pid> {
    if raw <= 1 {
        return None;
    }
    i32::try_from(raw).ok().and_then(Pid::from_raw)
}

/// A launcher's exit without reaping it (its pid, and so its process
/// group, stays reserved until the janitor reaps it).
fn peek_exit(pid: u32) -> Option<Exit> {
    let p = pid_of(pid)?;
    match rustix::process::waitid(
        WaitId::Pid(p),
        WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT,
    ) {
        Ok(Some(st)) => Some(match (st.terminating_signal(), st.exit_status()) {
            (Some(sig), _) => Exit::Signal(sig),
            (None, code) => Exit::Code(code.unwrap_or(-1)),
        }),
        _ => None,
    }
}

fn signal_of(kind: wire::SignalKind) -> Option<Signal> {
    match kind {
        wire::SignalKind::Hup => Some(Signal::HUP),
        wire::SignalKind::Int => Some(Signal::INT),
        wire::SignalKind::Term => Some(Signal::TERM),
        wire::SignalKind::Kill => Some(Signal::KILL),
        wire::SignalKind::Usr1 => Some(Signal::USR1),
        wire::SignalKind::Usr2 => Some(Signal::USR2),
        wire::SignalKind::Unspecified => None,
    }
}

/// Where the launcher must be found in `/proc/<pid>/cgroup`.
#[derive(Debug, Clone)]
struct Placement {
    controller: Option<&'static str>,
    path: String,
}

struct ControlCtx {
    issue: Uuid7,
    hub: Arc<Hub<Internal>>,
    listener: UnixListener,
    socket_path: PathBuf,
    launcher_pid: u32,
    channel: ChannelSlot,
    cancel: Arc<AtomicBool>,
    placements: Vec<Placement>,
    v2_dir: Option<PathBuf>,
}

fn transient(what: impl Into<String>) -> LaunchFailure {
    LaunchFailure::Transient(what.into())
}

fn accept_one(ctx: &ControlCtx, deadline: Instant) -> Result<UnixStream, LaunchFailure> {
    ctx.listener
        .set_nonblocking(true)
        .map_err(|e| transient(format!("release socket: {e}")))?;
    loop {
        if ctx.cancel.load(Ordering::Acquire) {
            return Err(transient("aborted before the launcher connected"));
        }
        match ctx.listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(transient("the launcher did not connect in time"));
                }
                if peek_exit(ctx.launcher_pid).is_some() {
                    return Err(transient("the launcher exited before it connected"));
                }
                // wakes as soon as the launcher connects, and looks at
                // the cancel flag and the launcher at least every poll
                let timeout = rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: i64::from(ACCEPT_POLL.subsec_nanos()),
                };
                let mut fds = [rustix::event::PollFd::new(
                    &ctx.listener,
                    rustix::event::PollFlags::IN,
                )];
                if let Err(e) = rustix::event::poll(&mut fds, Some(&timeout))
                    && e != rustix::io::Errno::INTR
                {
                    return Err(transient(format!("release socket poll: {e}")));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(transient(format!("release socket accept: {e}"))),
        }
    }
}

fn verify_ready(
    ctx: &ControlCtx,
    stream: &UnixStream,
    deadline: Instant,
) -> Result<LaunchIdentity, LaunchFailure> {
    stream
        .set_nonblocking(false)
        .map_err(|e| transient(format!("release channel: {e}")))?;
    let peer = rustix::net::sockopt::socket_peercred(stream)
        .map_err(|e| transient(format!("SO_PEERCRED on the release channel: {e}")))?;
    let peer_pid = u32::try_from(peer.pid.as_raw_nonzero().get()).unwrap_or(0);
    if peer_pid != ctx.launcher_pid {
        return Err(transient(format!(
            "the release channel's peer (pid {peer_pid}) is not the launcher (pid {})",
            ctx.launcher_pid
        )));
    }
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| transient(format!("release channel: {e}")))?;
    let (pid, pgid, start_ticks) = match Record::read_from(stream) {
        Ok(Some(Record::Ready {
            pid,
            pgid,
            start_ticks,
        })) => (pid, pgid, start_ticks),
        Ok(Some(Record::Failed { permanent, reason })) => {
            return Err(if permanent {
                LaunchFailure::Permanent(reason)
            } else {
                LaunchFailure::Transient(reason)
            });
        }
        Ok(Some(other)) => {
            return Err(transient(format!(
                "the launcher sent {other:?} before Ready"
            )));
        }
        Ok(None) => return Err(transient("the launcher closed the channel before Ready")),
        Err(e) => return Err(transient(format!("no valid Ready from the launcher: {e}"))),
    };
    if pid != ctx.launcher_pid || pgid != pid {
        return Err(transient(format!(
            "Ready names pid {pid} group {pgid}, expected the launcher {} leading its group",
            ctx.launcher_pid
        )));
    }
    let stat = procfs::read_stat(pid)
        .map_err(|e| transient(format!("cannot read /proc/{pid}/stat: {e}")))?
        .ok_or_else(|| transient("the launcher vanished after Ready"))?;
    if stat.pgrp != pid || stat.session != pid || stat.start_ticks != start_ticks {
        return Err(transient(format!(
            "/proc/{pid}/stat (group {}, session {}, start {}) does not match Ready (start {start_ticks})",
            stat.pgrp, stat.session, stat.start_ticks
        )));
    }
    let text = procfs::read_bounded(Path::new(&format!("/proc/{pid}/cgroup")))
        .map_err(|e| transient(format!("cannot read /proc/{pid}/cgroup: {e}")))?;
    let lines = procfs::parse_cgroup_file(&text);
    for p in &ctx.placements {
        let placed = lines.iter().any(|l| {
            l.path == p.path
                && match p.controller {
                    None => l.hierarchy == 0 && l.controllers.is_empty(),
                    Some(c) => l.controllers.iter().any(|x| x == c),
                }
        });
        if !placed {
            return Err(transient(format!(
                "the launcher is not in its cgroup {} ({})",
                p.path,
                p.controller.unwrap_or("v2")
            )));
        }
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| transient(format!("release channel: {e}")))?;
    Ok(LaunchIdentity {
        launcher_pid: pid,
        process_group: pgid,
        birth_ticks: start_ticks,
        cgroup: ctx.v2_dir.as_ref().map(|d| d.display().to_string()),
    })
}

fn control_main(ctx: ControlCtx) {
    let issue = ctx.issue;
    let deadline = Instant::now() + LAUNCHER_READY_TIMEOUT;
    let verified =
        accept_one(&ctx, deadline).and_then(|s| verify_ready(&ctx, &s, deadline).map(|id| (s, id)));
    if let Err(e) = std::fs::remove_file(&ctx.socket_path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(%issue, error = %e, "cannot remove the release socket");
    }
    match verified {
        Ok((stream, identity)) => {
            let reader = match stream.try_clone() {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(%issue, error = %e, "cannot keep the release channel");
                    kill_unreaped(ctx.launcher_pid);
                    ctx.hub.post(
                        issue,
                        Internal::PrepareFailed(transient(format!("release channel: {e}"))),
                    );
                    wait_gone(&ctx);
                    return;
                }
            };
            {
                let mut slot = lock(&ctx.channel);
                *slot = Some(stream);
                if ctx.cancel.load(Ordering::Acquire)
                    && let Some(s) = slot.as_ref()
                {
                    // aborted while verifying: EOF makes the launcher exit
                    let _shut = s.shutdown(Shutdown::Both);
                }
            }
            tracing::info!(%issue, pid = identity.launcher_pid, birth = identity.birth_ticks, "launcher ready and verified");
            ctx.hub.post(issue, Internal::Ready(identity));
            forward(&ctx, &reader);
        }
        Err(failure) => {
            tracing::warn!(%issue, pid = ctx.launcher_pid, ?failure, "launcher not ready");
            // our unreaped child: its pid cannot name another process
            kill_unreaped(ctx.launcher_pid);
            ctx.hub.post(issue, Internal::PrepareFailed(failure));
        }
    }
    wait_gone(&ctx);
}

fn forward(ctx: &ControlCtx, stream: &UnixStream) {
    let issue = ctx.issue;
    loop {
        let msg = match Record::read_from(stream) {
            Ok(Some(Record::ExecOk { child_pid })) => Internal::ExecOk { child_pid },
            Ok(Some(Record::Failed { permanent, reason })) => Internal::ExecFailed(if permanent {
                LaunchFailure::Permanent(reason)
            } else {
                LaunchFailure::Transient(reason)
            }),
            Ok(Some(Record::Exited { signal, value })) => Internal::RootExited(if signal {
                Exit::Signal(value)
            } else {
                Exit::Code(value)
            }),
            Ok(None) => return,
            Err(FrameError::Io(e)) => {
                tracing::debug!(%issue, error = %e, "release channel ended");
                return;
            }
            Ok(Some(other @ Record::Ready { .. })) => {
                tracing::error!(%issue, record = ?other, "launcher sent a second Ready; closing its channel");
                let _shut = stream.shutdown(Shutdown::Both);
                return;
            }
            Err(e) => {
                tracing::error!(%issue, error = %e, "invalid launcher record; closing its channel");
                let _shut = stream.shutdown(Shutdown::Both);
                return;
            }
        };
        ctx.hub.post(issue, msg);
    }
}

fn wait_gone(ctx: &ControlCtx) {
    let deadline = Instant::now() + LAUNCHER_EXIT_WAIT;
    // a launcher that closed its channel is exiting: look again soon,
    // then less often (most are gone within a millisecond)
    let mut pause = FIRST_EXIT_POLL;
    let exit = loop {
        if let Some(exit) = peek_exit(ctx.launcher_pid) {
            break Some(exit);
        }
        if Instant::now() >= deadline {
            tracing::warn!(issue = %ctx.issue, pid = ctx.launcher_pid, "launcher closed its channel but has not exited");
            break None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(EXIT_POLL);
    };
    tracing::debug!(issue = %ctx.issue, pid = ctx.launcher_pid, ?exit, "launcher gone");
    ctx.hub.post(ctx.issue, Internal::LauncherGone(exit));
}

/// SIGKILL to a launcher this process started and has not reaped.
fn kill_unreaped(pid: u32) {
    if let Some(p) = pid_of(pid)
        && let Err(e) = rustix::process::kill_process(p, Signal::KILL)
        && e != rustix::io::Errno::SRCH
    {
        tracing::warn!(pid, error = %e, "cannot kill the launcher");
    }
}

/// The Unix process supervisor.
#[derive(Debug)]
pub struct UnixSupervisor {
    config: SupervisorConfig,
    layout: CgroupLayout,
    hub: Arc<Hub<Internal>>,
    trees: BTreeMap<Uuid7, Tree>,
    /// Events ready for `next_event`: a handful per tree plus, at its end,
    /// what was left in its output queue (bounded by the trees and
    /// [`crate::hub::OUTPUT_QUEUE_ITEMS`]).
    out: VecDeque<CommandProcessEvent>,
    diag: Diagnostics,
    cursor: Option<Uuid7>,
    /// The threads of the terminals' holders (bounded by
    /// [`pty::MAX_TERMINALS`]).
    terminals: BTreeMap<Uuid7, pty::Handle>,
    /// Terminal events decided on the caller's thread (a refused start),
    /// before those of the threads.
    terminal_out: VecDeque<TerminalProcessEvent>,
}

fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> SupervisorError {
    move |source| SupervisorError::Io { context, source }
}

/// Wakes the thread waiting in [`Supervisor::next_event`] of one
/// supervisor from any other thread: that call returns `None` at once, so
/// the thread can take an input that is not a process event (a frame from
/// the network).
#[derive(Clone)]
pub struct Waker(Arc<Hub<Internal>>);

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waker")
    }
}

impl Waker {
    /// Wakes the waiting thread (harmless when none waits: the next wait
    /// returns at once).
    pub fn wake(&self) {
        self.0.wake();
    }
}

impl UnixSupervisor {
    /// A waker for the thread that calls [`Supervisor::next_event`].
    #[must_use]
    pub fn waker(&self) -> Waker {
        Waker(Arc::clone(&self.hub))
    }

    /// Detects the cgroup layout, prepares the run directory and starts
    /// the diagnostics sampler.
    ///
    /// # Errors
    /// [`SupervisorError::Io`] when the run directory cannot be made
    /// private, the launcher is not an absolute path, or the sampler
    /// thread cannot start.
    pub fn new(config: SupervisorConfig) -> Result<Self, SupervisorError> {
        if !config.launcher.is_absolute() {
            return Err(SupervisorError::Io {
                context: "the launcher executable",
                source: std::io::Error::other("not an absolute path"),
            });
        }
        std::fs::create_dir_all(&config.run_dir).map_err(io_err("creating the run directory"))?;
        std::fs::set_permissions(&config.run_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("making the run directory private"))?;
        let layout = if config.force_process_group {
            CgroupLayout::process_group()
        } else {
            CgroupLayout::detect(config.cgroup_parent.as_deref())
        };
        tracing::info!(
            mode = ?layout.mode,
            v2_parent = ?layout.v2.as_ref().map(|v| v.parent.display().to_string()),
            v2_controllers = ?layout.v2.as_ref().map(|v| v.controllers.iter().cloned().collect::<Vec<_>>()),
            v1 = ?layout.v1.iter().map(|l| l.controller.name()).collect::<Vec<_>>(),
            "process supervision layout detected"
        );
        let hub = Arc::new(Hub::new(config.handover));
        let to_hub = Arc::clone(&hub);
        let diag = Diagnostics::start(
            config.diagnostics_interval,
            config.suspected_hung_after,
            Box::new(move |issue, d| {
                if !to_hub.try_post(issue, Internal::Diagnostics(d)) {
                    tracing::warn!(%issue, "diagnostics report dropped: the control queue is full");
                }
            }),
        )
        .map_err(io_err("starting the diagnostics sampler"))?;
        Ok(Self {
            config,
            layout,
            hub,
            trees: BTreeMap::new(),
            out: VecDeque::new(),
            diag,
            cursor: None,
            terminals: BTreeMap::new(),
            terminal_out: VecDeque::new(),
        })
    }

    /// The detected cgroup layout (for health).
    #[must_use]
    pub fn layout(&self) -> &CgroupLayout {
        &self.layout
    }

    /// A supervised command's cgroups.
    #[must_use]
    pub fn command_cgroups(&self, issue: &Uuid7) -> Option<&CommandCgroups> {
        self.trees.get(issue).map(|t| &t.cgroups)
    }

    /// Whether the diagnostics sampler suspects the tree is hung
    /// (diagnostic only; `None` when it is not sampled).
    #[must_use]
    pub fn suspected_hung(&self, issue: &Uuid7) -> Option<bool> {
        self.diag.suspected_hung(issue)
    }

    /// Forgets a command as a daemon that crashed would, but keeps its
    /// release channel open, so that its launcher stays alive as if its
    /// end of file had not been noticed yet. For recovery tests only.
    #[doc(hidden)]
    pub fn detach_for_test(&mut self, issue: &Uuid7) -> Option<LaunchIdentity> {
        let tree = self.trees.remove(issue)?;
        self.diag.remove(issue);
        let _closed = self.hub.close(issue);
        let identity = tree.identity.clone();
        // the open channel keeps the launcher from its watchdog kill
        std::mem::forget(tree);
        identity
    }

    fn emit(&mut self, issue: Uuid7, event: ProcessEvent) {
        self.out.push_back(CommandProcessEvent { issue, event });
    }

    fn refuse(&mut self, issue: Uuid7, failure: LaunchFailure) {
        tracing::warn!(%issue, ?failure, "launch refused before the launcher started");
        self.emit(issue, ProcessEvent::Failed(failure));
        self.emit(issue, ProcessEvent::Drained { incomplete: vec![] });
    }

    /// The shell of a launch or a terminal: sh or bash, one validated at
    /// startup, unchanged since.
    fn validate_shell(&self, kind: wire::ShellType, path: &str) -> Result<(), LaunchFailure> {
        let permanent = |what: String| Err(LaunchFailure::Permanent(what));
        if !matches!(kind, wire::ShellType::Sh | wire::ShellType::Bash) {
            return permanent(format!(
                "shell {} is unsupported on Unix",
                kind.as_str_name()
            ));
        }
        let shell = Path::new(path);
        if !shell.is_absolute() {
            return permanent(format!("shell path {path} is not absolute"));
        }
        let Some(validated) = self.config.shells.get(shell) else {
            return permanent(format!("shell {path} is not one validated at startup"));
        };
        match identity_of(shell) {
            Ok(now) if now == *validated => {}
            Ok(_) => {
                return permanent(format!(
                    "shell {path} changed since it was validated: its identity (device, inode, size, mtime, mode or owner) differs"
                ));
            }
            Err(e) => {
                return permanent(format!("shell {path} cannot be examined: {e}"));
            }
        }
        launcher::check_shell(shell).map_err(LaunchFailure::Permanent)
    }

    /// What a terminal's start needs from the host.
    fn validate_terminal(&self, spec: &TerminalSpec) -> Result<(), LaunchFailure> {
        self.validate_shell(spec.shell, &spec.shell_path)?;
        let cwd = Path::new(&spec.cwd);
        if !cwd.is_absolute() {
            return Err(LaunchFailure::Permanent(format!(
                "working directory {} is not absolute",
                spec.cwd
            )));
        }
        launcher::resolved_cwd(cwd, &self.config.cwd_roots).map_err(LaunchFailure::Permanent)?;
        for (k, v) in &spec.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(LaunchFailure::Permanent(
                    "an environment override has an invalid name or value".into(),
                ));
            }
        }
        Ok(())
    }

    /// The thread of a terminal, or why there is none.
    fn terminal(&self, terminal: &Uuid7) -> Result<&pty::Handle, SupervisorError> {
        self.terminals
            .get(terminal)
            .ok_or(SupervisorError::UnknownTerminal(*terminal))
    }

    fn room_for_terminal(&self, terminal: &Uuid7) -> Result<(), SupervisorError> {
        if self.terminals.contains_key(terminal) {
            return Err(SupervisorError::TerminalBusy {
                terminal: *terminal,
                what: "it already has a holder here",
            });
        }
        if self.terminals.len() >= pty::MAX_TERMINALS {
            return Err(SupervisorError::TerminalBusy {
                terminal: *terminal,
                what: "the supervisor drives the most terminals it may",
            });
        }
        Ok(())
    }

    fn validate(&self, spec: &LaunchSpec) -> Result<(), LaunchFailure> {
        let permanent = |what: String| Err(LaunchFailure::Permanent(what));
        self.validate_shell(spec.shell, &spec.shell_path)?;
        if !Path::new(&spec.wrapper_path).is_absolute() || !Path::new(&spec.wrapper_path).is_file()
        {
            return permanent(format!("wrapper {} is not a file", spec.wrapper_path));
        }
        let cwd = Path::new(&spec.cwd);
        if !cwd.is_absolute() || !cwd.is_dir() {
            return permanent(format!("working directory {} is not a directory", spec.cwd));
        }
        for (k, v) in &spec.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return permanent("an environment override has an invalid name or value".into());
            }
        }
        Ok(())
    }

    fn placements(&self, cg: &CommandCgroups) -> Vec<Placement> {
        let mut out = Vec::new();
        if let (Some(v2), Some(dir)) = (&self.layout.v2, &cg.v2)
            && let Some(path) = cgroup::proc_path(&v2.mount_point, &v2.mount_root, dir)
        {
            out.push(Placement {
                controller: None,
                path,
            });
        }
        for (c, dir) in &cg.v1 {
            if let Some(l) = self.layout.v1.iter().find(|l| l.controller == *c)
                && let Some(path) = cgroup::proc_path(&l.mount_point, &l.mount_root, dir)
            {
                out.push(Placement {
                    controller: Some(c.name()),
                    path,
                });
            }
        }
        out
    }

    /// Launch steps 1-2 up to the started launcher.
    fn start(&mut self, spec: &LaunchSpec) -> Result<Tree, LaunchFailure> {
        self.validate(spec)?;
        let issue = spec.issue;
        let cgroups = self
            .layout
            .create(&issue, &spec.limits)
            .map_err(|r| match r {
                Refusal::Unsupported(s) => LaunchFailure::Permanent(s),
                Refusal::Transient(s) => LaunchFailure::Transient(s),
            })?;
        let socket_path = self.config.run_dir.join(format!("{issue}.sock"));
        match self.start_launcher(spec, &cgroups, &socket_path) {
            Ok(tree) => Ok(tree),
            Err(f) => {
                self.hub.close(&issue);
                if let Err(e) = std::fs::remove_file(&socket_path)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(%issue, error = %e, "cannot remove the release socket");
                }
                if let Err(e) = cgroup::remove(&cgroups) {
                    tracing::error!(%issue, error = %e, "cannot remove the cgroups of a failed launch");
                }
                Err(f)
            }
        }
    }

    fn start_launcher(
        &mut self,
        spec: &LaunchSpec,
        cgroups: &CommandCgroups,
        socket_path: &Path,
    ) -> Result<Tree, LaunchFailure> {
        let issue = spec.issue;
        let pipe = |what: &str| {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| transient(format!("cannot create the {what} pipe: {e}")))
        };
        let (stdin_r, stdin_w) = pipe("stdin")?;
        let (stdout_r, stdout_w) = pipe("stdout")?;
        let (stderr_r, stderr_w) = pipe("stderr")?;
        match std::fs::remove_file(socket_path) {
            Ok(()) => tracing::warn!(%issue, "removed a stale release socket"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(transient(format!("stale release socket: {e}"))),
        }
        let listener = UnixListener::bind(socket_path)
            .map_err(|e| transient(format!("cannot bind the release socket: {e}")))?;
        std::fs::set_permissions(socket_path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| transient(format!("cannot make the release socket private: {e}")))?;
        let activity = Arc::new(AtomicU64::new(0));
        self.hub.open(issue);
        for (stream, fd) in [
            (wire::OutputStream::Stdout, stdout_r),
            (wire::OutputStream::Stderr, stderr_r),
        ] {
            pipes::spawn_reader(
                Arc::clone(&self.hub),
                issue,
                stream,
                File::from(fd),
                Arc::clone(&activity),
            )
            .map_err(|e| transient(format!("cannot start a pipe reader: {e}")))?;
        }
        let (stdin_tx, stdin_rx) = std::sync::mpsc::sync_channel(pipes::STDIN_QUEUE_WRITES + 1);
        let stdin_queued = Arc::new(AtomicUsize::new(0));
        let sink: Arc<dyn StdinSink> = Arc::clone(&self.hub) as Arc<dyn StdinSink>;
        pipes::spawn_stdin_writer(
            sink,
            issue,
            File::from(stdin_w),
            stdin_rx,
            Arc::clone(&stdin_queued),
            Arc::clone(&activity),
        )
        .map_err(|e| transient(format!("cannot start the stdin writer: {e}")))?;

        let mut cmd = Command::new(&self.config.launcher);
        cmd.args(&self.config.launcher_args)
            .args(launcher::launcher_args(
                socket_path,
                Path::new(&spec.shell_path),
                Path::new(&spec.wrapper_path),
                Path::new(&spec.cwd),
                &self.config.cwd_roots,
                cgroups,
            ))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (key, _) in std::env::vars_os() {
            if key.to_str().is_some_and(|k| k.starts_with(ENV_PREFIX)) {
                cmd.env_remove(key);
            }
        }
        // the daemon's systemd notification socket and watchdog are its
        // own: a command must not speak for it
        for key in rvbox_daemon_common::notify::ENVIRONMENT {
            cmd.env_remove(key);
        }
        for (i, (k, v)) in spec.env.iter().enumerate() {
            cmd.env(format!("{ENV_PREFIX}{i}"), format!("{k}={v}"));
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| transient(format!("cannot start the launcher: {e}")))?;
        let launcher_pid = child.id();
        let channel: ChannelSlot = Arc::new(Mutex::new(None));
        let cancel = Arc::new(AtomicBool::new(false));
        let ctx = ControlCtx {
            issue,
            hub: Arc::clone(&self.hub),
            listener,
            socket_path: socket_path.to_path_buf(),
            launcher_pid,
            channel: Arc::clone(&channel),
            cancel: Arc::clone(&cancel),
            placements: self.placements(cgroups),
            v2_dir: cgroups.v2.clone(),
        };
        if let Err(e) = std::thread::Builder::new()
            .name("rvbox-launch-control".into())
            .spawn(move || control_main(ctx))
        {
            kill_unreaped(launcher_pid);
            if let Err(e) = child.wait() {
                tracing::error!(%issue, error = %e, "cannot reap the launcher");
            }
            return Err(transient(format!("cannot start the control thread: {e}")));
        }
        tracing::info!(%issue, pid = launcher_pid, cgroup = ?cgroups.v2, "blocked launcher started");
        Ok(Tree {
            phase: Phase::Preparing,
            launcher: Some(child),
            launcher_pid,
            channel,
            cancel,
            child_ends: Some(ChildEnds {
                stdin: stdin_r,
                stdout: stdout_w,
                stderr: stderr_w,
            }),
            stdin: Some(stdin_tx),
            stdin_queued,
            cgroups: cgroups.clone(),
            identity: None,
            failure: None,
            aborted: false,
            released: false,
            kill_sent: false,
            launcher_gone: false,
            pending_signals: Vec::new(),
            deadline: Some(Instant::now() + LAUNCHER_READY_TIMEOUT + LAUNCHER_EXIT_WAIT),
            next_check: Instant::now(),
            forced_launcher_kill: false,
            activity,
        })
    }

    /// True when no process but the launcher is left in the tree.
    fn tree_empty(tree: &Tree) -> bool {
        if let Some(dir) = &tree.cgroups.v2 {
            return match procfs::cgroup_procs(dir) {
                Ok(pids) => pids.iter().all(|p| *p == tree.launcher_pid),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot list the command cgroup");
                    false
                }
            };
        }
        let Some(id) = &tree.identity else {
            return true;
        };
        match procfs::group_members(id.process_group) {
            Ok(pids) => pids.iter().all(|p| *p == tree.launcher_pid),
            Err(e) => {
                tracing::warn!(error = %e, "cannot scan /proc for the process group");
                false
            }
        }
    }

    /// SIGKILL to the whole tree, launcher included: `cgroup.kill` where
    /// the tree has a v2 cgroup, else `killpg` on the verified group.
    fn kill_tree(issue: &Uuid7, tree: &mut Tree) -> bool {
        tree.kill_sent = true;
        tree.activity.fetch_add(1, Ordering::Relaxed);
        if let Some(dir) = &tree.cgroups.v2 {
            match cgroup::kill(dir) {
                Ok(()) => {
                    tracing::info!(%issue, dir = %dir.display(), "cgroup.kill sent");
                    return true;
                }
                Err(e) => {
                    tracing::error!(%issue, dir = %dir.display(), error = %e, "cgroup.kill failed; falling back to killpg");
                }
            }
        }
        let Some(pgid) = tree
            .identity
            .as_ref()
            .and_then(|id| pid_of(id.process_group))
        else {
            tracing::error!(%issue, "no verified process group to kill");
            return false;
        };
        match rustix::process::kill_process_group(pgid, Signal::KILL) {
            Ok(()) => {
                tracing::info!(%issue, pgid = pgid.as_raw_nonzero().get(), "killpg SIGKILL sent");
                true
            }
            Err(rustix::io::Errno::SRCH) => true,
            Err(e) => {
                tracing::error!(%issue, error = %e, "killpg failed");
                false
            }
        }
    }

    /// A non-KILL signal to every process of the tree but the launcher
    /// (the watchdog must survive it to report the exit). In a v2 cgroup
    /// the tree is frozen while its members are listed and signalled, so
    /// no fork escapes; in a process group the members are found by
    /// scanning `/proc` (twice, for processes forked meanwhile).
    fn deliver(&self, issue: &Uuid7, tree: &Tree, sig: Signal) -> Result<usize, String> {
        let mut sent = 0usize;
        let send = |pid: u32, sent: &mut usize| {
            if pid == tree.launcher_pid {
                return Ok(());
            }
            let Some(p) = pid_of(pid) else { return Ok(()) };
            match rustix::process::kill_process(p, sig) {
                Ok(()) => {
                    *sent += 1;
                    Ok(())
                }
                Err(rustix::io::Errno::SRCH) => Ok(()),
                Err(e) => Err(format!("kill {pid}: {e}")),
            }
        };
        if let Some(dir) = &tree.cgroups.v2 {
            let freeze = self.layout.v2.as_ref().is_some_and(|v| v.freeze);
            let frozen = freeze
                && match cgroup::set_frozen(dir, true) {
                    Ok(()) => {
                        if !cgroup::wait_frozen(dir, FREEZE_WAIT) {
                            tracing::warn!(%issue, "tree not frozen in time; signalling anyway");
                        }
                        true
                    }
                    Err(e) => {
                        tracing::warn!(%issue, error = %e, "cannot freeze the tree; signalling anyway");
                        false
                    }
                };
            let result = procfs::cgroup_procs(dir)
                .map_err(|e| format!("cannot list {}: {e}", dir.display()))
                .and_then(|pids| pids.into_iter().try_for_each(|p| send(p, &mut sent)));
            if frozen && let Err(e) = cgroup::set_frozen(dir, false) {
                tracing::error!(%issue, error = %e, "cannot thaw the tree");
            }
            result.map(|()| sent)
        } else {
            let pgid = tree
                .identity
                .as_ref()
                .map(|id| id.process_group)
                .ok_or_else(|| "no verified process group".to_owned())?;
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..2 {
                let pids =
                    procfs::group_members(pgid).map_err(|e| format!("cannot scan /proc: {e}"))?;
                for p in pids {
                    if seen.insert(p) {
                        send(p, &mut sent)?;
                    }
                }
            }
            Ok(sent)
        }
    }

    fn spawn_janitor(&mut self, issue: Uuid7) {
        let Some(tree) = self.trees.get_mut(&issue) else {
            return;
        };
        tree.phase = Phase::Cleaning;
        tree.deadline = None;
        let job = Arc::new(Mutex::new(Some((
            tree.launcher.take(),
            tree.cgroups.clone(),
        ))));
        let theirs = Arc::clone(&job);
        let hub = Arc::clone(&self.hub);
        let spawned = std::thread::Builder::new()
            .name("rvbox-janitor".into())
            .spawn(move || {
                if let Some((child, cgroups)) = lock(&theirs).take() {
                    clean_up(issue, child, &cgroups);
                }
                hub.post(issue, Internal::CleanedUp);
            });
        if let Err(e) = spawned {
            tracing::warn!(%issue, error = %e, "cannot start the janitor; cleaning up inline");
            if let Some((child, cgroups)) = lock(&job).take() {
                clean_up(issue, child, &cgroups);
            }
            self.finish(issue);
        }
    }

    fn enter_finishing(&mut self, issue: Uuid7) {
        let Some(tree) = self.trees.get_mut(&issue) else {
            return;
        };
        if tree.launcher_gone {
            self.spawn_janitor(issue);
            return;
        }
        tree.phase = Phase::Finishing;
        tree.deadline = Some(Instant::now() + LAUNCHER_EXIT_WAIT);
        let sent = lock(&tree.channel)
            .as_ref()
            .map(|mut s| s.write_all(&[frame::FINISH]));
        match sent {
            Some(Ok(())) => tracing::debug!(%issue, "tree drained; launcher told to finish"),
            _ => {
                tracing::warn!(%issue, "cannot send the finish byte; killing the launcher");
                kill_unreaped(tree.launcher_pid);
            }
        }
    }

    fn start_drain(tree: &mut Tree, grace: Duration) {
        tree.phase = Phase::Draining;
        tree.deadline = Some(crate::procfs::after(grace));
        tree.next_check = Instant::now();
    }

    fn on_internal(&mut self, issue: Uuid7, msg: Internal) {
        let grace = self.config.drain_grace;
        let Some(tree) = self.trees.get_mut(&issue) else {
            tracing::debug!(%issue, ?msg, "message for a command no longer supervised");
            return;
        };
        if let Internal::Diagnostics(d) = msg {
            // the sampler's own report is not the tree's progress
            if tree.phase == Phase::Running {
                self.emit(issue, ProcessEvent::Diagnostics(d));
            }
            return;
        }
        tree.activity.fetch_add(1, Ordering::Relaxed);
        match msg {
            Internal::Ready(identity) => {
                if tree.phase == Phase::Preparing && !tree.aborted {
                    tree.identity = Some(identity.clone());
                    tree.phase = Phase::Prepared;
                    tree.deadline = None;
                    self.emit(issue, ProcessEvent::Ready(identity));
                }
            }
            Internal::PrepareFailed(f) => {
                if !tree.aborted {
                    tree.failure = Some(f);
                }
            }
            Internal::ExecOk { child_pid } => {
                if tree.phase != Phase::Releasing {
                    tracing::warn!(%issue, phase = ?tree.phase, "exec report out of order");
                    return;
                }
                tree.phase = Phase::Running;
                tracing::info!(%issue, root = child_pid, "shell running");
                if let Some(id) = &tree.identity {
                    self.diag.add(
                        issue,
                        diag::Target {
                            launcher_pid: tree.launcher_pid,
                            pgid: id.process_group,
                            cgroup: tree.cgroups.v2.clone(),
                            root_pid: child_pid,
                            activity: Arc::clone(&tree.activity),
                        },
                    );
                }
                let pending = std::mem::take(&mut tree.pending_signals);
                self.emit(issue, ProcessEvent::Running);
                for sig in pending {
                    self.send_signal(&issue, sig);
                }
            }
            Internal::ExecFailed(f) => {
                if tree.phase == Phase::Releasing {
                    tracing::warn!(%issue, failure = ?f, "the shell could not be created");
                    Self::start_drain(tree, grace);
                    self.emit(issue, ProcessEvent::Failed(f));
                }
            }
            Internal::RootExited(exit) => {
                if tree.phase == Phase::Running {
                    tracing::info!(%issue, ?exit, "root exited; draining");
                    Self::start_drain(tree, grace);
                    self.emit(issue, ProcessEvent::Exited(exit));
                }
            }
            Internal::LauncherGone(exit) => {
                tree.launcher_gone = true;
                match tree.phase {
                    Phase::Preparing | Phase::Prepared | Phase::Aborting => {
                        if !tree.aborted && tree.failure.is_none() {
                            tree.failure = Some(transient("the launcher ended before release"));
                        }
                        tree.child_ends = None;
                        tree.stdin = None;
                        self.spawn_janitor(issue);
                    }
                    Phase::Releasing => {
                        // plan §7.4 step 5: authorized but uncertain: killed
                        // as a tree; no Running and no Exit (interrupted)
                        tracing::error!(%issue, ?exit, "launcher ended after release without an exec report; killing the tree");
                        Self::kill_tree(&issue, tree);
                        Self::start_drain(tree, grace);
                    }
                    Phase::Running => {
                        Self::start_drain(tree, grace);
                        if tree.kill_sent {
                            self.emit(issue, ProcessEvent::Exited(Exit::Signal(9)));
                        } else {
                            tracing::error!(%issue, ?exit, "the watchdog ended before the root's exit; the exit is unknown");
                        }
                    }
                    Phase::Finishing => self.spawn_janitor(issue),
                    Phase::Draining | Phase::Killing | Phase::Cleaning => {}
                }
            }
            Internal::StdinWritten(write_seq) => {
                self.emit(issue, ProcessEvent::StdinWritten { write_seq });
            }
            Internal::CleanedUp => self.finish(issue),
            Internal::Diagnostics(_) => {}
        }
    }

    /// The last step: what is left of the outputs, then `Drained`.
    fn finish(&mut self, issue: Uuid7) {
        let Some(tree) = self.trees.remove(&issue) else {
            return;
        };
        self.diag.remove(&issue);
        let closed = self.hub.close(&issue);
        for item in closed.items {
            self.emit(issue, out_event(item));
        }
        let mut incomplete = Vec::new();
        if tree.released {
            if !closed.stdout_eof {
                incomplete.push(wire::OutputStream::Stdout);
            }
            if !closed.stderr_eof {
                incomplete.push(wire::OutputStream::Stderr);
            }
        } else if let Some(f) = tree.failure {
            self.emit(issue, ProcessEvent::Failed(f));
        }
        tracing::info!(%issue, ?incomplete, "tree drained");
        self.emit(issue, ProcessEvent::Drained { incomplete });
    }

    fn on_timers(&mut self) {
        let now = Instant::now();
        let issues: Vec<Uuid7> = self.trees.keys().copied().collect();
        for issue in issues {
            let Some(tree) = self.trees.get_mut(&issue) else {
                continue;
            };
            let due = tree.deadline.is_some_and(|d| now >= d);
            match tree.phase {
                Phase::Draining | Phase::Killing => {
                    if now >= tree.next_check {
                        tree.next_check = now + DRAIN_POLL;
                        let (o, e) = self.hub.drained(&issue);
                        if o && e && Self::tree_empty(tree) {
                            self.enter_finishing(issue);
                            continue;
                        }
                    }
                    if due && tree.phase == Phase::Draining {
                        tracing::info!(%issue, "drain grace over; killing residual processes");
                        Self::kill_tree(&issue, tree);
                        tree.phase = Phase::Killing;
                        tree.deadline = Some(now + KILL_EOF_WAIT);
                    } else if due {
                        tracing::warn!(%issue, "pipes still open after the residual kill");
                        self.enter_finishing(issue);
                    }
                }
                Phase::Finishing | Phase::Preparing | Phase::Aborting if due => {
                    if tree.forced_launcher_kill {
                        tracing::error!(%issue, pid = tree.launcher_pid, "launcher still not gone; reaping it in the background");
                        tree.launcher_gone = true;
                        self.spawn_janitor(issue);
                    } else {
                        tracing::warn!(%issue, pid = tree.launcher_pid, phase = ?tree.phase, "launcher overdue; killing it");
                        tree.forced_launcher_kill = true;
                        if let Some(dir) = &tree.cgroups.v2
                            && tree.released
                            && let Err(e) = cgroup::kill(dir)
                        {
                            tracing::warn!(%issue, error = %e, "cgroup.kill failed");
                        }
                        kill_unreaped(tree.launcher_pid);
                        tree.deadline = Some(now + LAUNCHER_EXIT_WAIT);
                    }
                }
                _ => {}
            }
        }
    }

    fn next_output(&mut self) -> Option<CommandProcessEvent> {
        let open: Vec<Uuid7> = self
            .trees
            .iter()
            .filter(|(_, t)| t.outputs_flow())
            .map(|(k, _)| *k)
            .collect();
        let start = self
            .cursor
            .and_then(|c| open.iter().position(|k| *k > c))
            .unwrap_or(0);
        for issue in open.iter().skip(start).chain(open.iter().take(start)) {
            if let Some(item) = self.hub.pop_output(issue) {
                self.cursor = Some(*issue);
                return Some(CommandProcessEvent {
                    issue: *issue,
                    event: out_event(item),
                });
            }
        }
        None
    }

    /// Handles every waiting message and due timer.
    fn pump(&mut self) {
        for (issue, msg) in self.hub.take_control() {
            self.on_internal(issue, msg);
        }
        self.on_timers();
    }

    fn send_signal(&mut self, issue: &Uuid7, sig: Signal) -> wire::SignalOutcome {
        let Some(tree) = self.trees.get(issue) else {
            return wire::SignalOutcome::Failed;
        };
        if tree.phase != Phase::Running && Self::tree_empty(tree) {
            return wire::SignalOutcome::NoOpAfterExit;
        }
        if sig == Signal::KILL {
            let Some(tree) = self.trees.get_mut(issue) else {
                return wire::SignalOutcome::Failed;
            };
            return if Self::kill_tree(issue, tree) {
                wire::SignalOutcome::Delivered
            } else {
                wire::SignalOutcome::Failed
            };
        }
        tree.activity.fetch_add(1, Ordering::Relaxed);
        match self.deliver(issue, tree, sig) {
            Ok(0) => wire::SignalOutcome::NoOpAfterExit,
            Ok(n) => {
                tracing::info!(%issue, signal = sig.as_raw(), processes = n, "signal delivered to the tree");
                wire::SignalOutcome::Delivered
            }
            Err(e) => {
                tracing::error!(%issue, signal = sig.as_raw(), error = %e, "signal delivery failed");
                wire::SignalOutcome::Failed
            }
        }
    }
}

/// Reaps the launcher and removes the command cgroups.
fn clean_up(issue: Uuid7, child: Option<Child>, cgroups: &CommandCgroups) {
    if let Some(mut child) = child {
        match child.wait() {
            Ok(status) => tracing::debug!(%issue, ?status, "launcher reaped"),
            Err(e) => tracing::error!(%issue, error = %e, "cannot reap the launcher"),
        }
    }
    if let Err(e) = cgroup::remove(cgroups) {
        tracing::error!(%issue, error = %e, "command cgroups left behind");
    }
}

fn out_event(item: OutItem) -> ProcessEvent {
    match item {
        OutItem::Chunk {
            stream,
            observed_ms,
            bytes,
        } => ProcessEvent::Output {
            stream,
            observed_ms,
            bytes,
        },
        OutItem::Dropped {
            stream,
            raw_bytes,
            first_ms,
            last_ms,
        } => ProcessEvent::Dropped {
            stream,
            raw_bytes,
            first_ms,
            last_ms,
        },
    }
}

impl Supervisor for UnixSupervisor {
    fn mode(&self) -> Supervision {
        self.layout.mode
    }

    fn check_limits(&self, limits: &ResourceLimits) -> Result<(), String> {
        self.layout.check(limits)
    }

    fn prepare(&mut self, spec: LaunchSpec) -> Result<(), SupervisorError> {
        let issue = spec.issue;
        if self.trees.contains_key(&issue) {
            return Err(SupervisorError::State {
                issue,
                what: "it is already supervised",
            });
        }
        if self.trees.len() >= self.config.max_trees {
            return Err(SupervisorError::Full);
        }
        match self.start(&spec) {
            Ok(tree) => {
                self.trees.insert(issue, tree);
            }
            Err(failure) => self.refuse(issue, failure),
        }
        Ok(())
    }

    fn release(&mut self, issue: &Uuid7) -> Result<(), SupervisorError> {
        let tree = self
            .trees
            .get_mut(issue)
            .ok_or(SupervisorError::Unknown(*issue))?;
        if tree.phase != Phase::Prepared {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "it is not prepared",
            });
        }
        let Some(ends) = tree.child_ends.take() else {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "its pipes are gone",
            });
        };
        let sent = lock(&tree.channel)
            .as_ref()
            .map(|s| channel::send_release(s, &ends));
        // the launcher holds the child ends now (or never will)
        drop(ends);
        match sent {
            Some(Ok(())) => {
                tree.phase = Phase::Releasing;
                tree.released = true;
                tracing::info!(%issue, pid = tree.launcher_pid, "released");
                Ok(())
            }
            Some(Err(e)) => {
                tracing::error!(%issue, error = %e, "cannot send the release; aborting");
                tree.failure = Some(transient(format!("cannot send the release: {e}")));
                self.abort(issue);
                Ok(())
            }
            None => {
                tree.failure = Some(transient("no release channel"));
                self.abort(issue);
                Ok(())
            }
        }
    }

    fn abort(&mut self, issue: &Uuid7) {
        let Some(tree) = self.trees.get_mut(issue) else {
            tracing::warn!(%issue, "abort of a command not supervised");
            return;
        };
        if !matches!(tree.phase, Phase::Preparing | Phase::Prepared) {
            tracing::warn!(%issue, phase = ?tree.phase, "abort after release ignored");
            return;
        }
        tree.aborted = true;
        tree.cancel.store(true, Ordering::Release);
        tree.shutdown_channel();
        tree.child_ends = None;
        tree.stdin = None;
        tree.phase = Phase::Aborting;
        tree.deadline = Some(Instant::now() + LAUNCHER_EXIT_WAIT);
        tracing::info!(%issue, pid = tree.launcher_pid, "aborted before release: channel closed");
    }

    fn signal(&mut self, issue: &Uuid7, kind: wire::SignalKind) -> wire::SignalOutcome {
        let Some(sig) = signal_of(kind) else {
            tracing::warn!(%issue, "refused a signal outside the portable set");
            return wire::SignalOutcome::Failed;
        };
        let Some(tree) = self.trees.get_mut(issue) else {
            tracing::warn!(%issue, "signal for a command not supervised");
            return wire::SignalOutcome::Failed;
        };
        match tree.phase {
            Phase::Preparing | Phase::Prepared => {
                self.abort(issue);
                wire::SignalOutcome::CancelledBeforeLaunch
            }
            Phase::Aborting => wire::SignalOutcome::CancelledBeforeLaunch,
            Phase::Releasing => {
                if sig == Signal::KILL {
                    if Self::kill_tree(issue, tree) {
                        wire::SignalOutcome::Delivered
                    } else {
                        wire::SignalOutcome::Failed
                    }
                } else if tree.pending_signals.len() < MAX_PENDING_SIGNALS {
                    // delivered right after exec
                    tree.pending_signals.push(sig);
                    wire::SignalOutcome::Delivered
                } else {
                    wire::SignalOutcome::Failed
                }
            }
            Phase::Running | Phase::Draining | Phase::Killing => self.send_signal(issue, sig),
            Phase::Finishing | Phase::Cleaning => wire::SignalOutcome::NoOpAfterExit,
        }
    }

    fn write_stdin(
        &mut self,
        issue: &Uuid7,
        write_seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        let tree = self
            .trees
            .get_mut(issue)
            .ok_or(SupervisorError::Unknown(*issue))?;
        if !matches!(
            tree.phase,
            Phase::Releasing | Phase::Running | Phase::Draining | Phase::Killing
        ) {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "it is not running",
            });
        }
        let Some(tx) = &tree.stdin else {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "its stdin is closed",
            });
        };
        if tree.stdin_queued.load(Ordering::Acquire) >= pipes::STDIN_QUEUE_WRITES {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "its stdin queue is full",
            });
        }
        tree.stdin_queued.fetch_add(1, Ordering::AcqRel);
        match tx.try_send(StdinOp::Write { write_seq, bytes }) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                tree.stdin_queued.fetch_sub(1, Ordering::AcqRel);
                Err(SupervisorError::State {
                    issue: *issue,
                    what: "its stdin queue is full",
                })
            }
            Err(TrySendError::Disconnected(_)) => {
                tree.stdin_queued.fetch_sub(1, Ordering::AcqRel);
                tree.stdin = None;
                Err(SupervisorError::State {
                    issue: *issue,
                    what: "its stdin is closed (broken pipe)",
                })
            }
        }
    }

    fn close_stdin(&mut self, issue: &Uuid7) {
        if let Some(tree) = self.trees.get_mut(issue)
            && let Some(tx) = tree.stdin.take()
        {
            // the writer finishes the queued writes, then drops the pipe
            if let Err(TrySendError::Full(_)) = tx.try_send(StdinOp::Close) {
                tracing::debug!(%issue, "stdin closes once the queue is written");
            }
        }
    }

    fn snapshot(&self, issue: &Uuid7) -> Option<wire::ResourceSnapshot> {
        self.diag.snapshot(issue)
    }

    fn reap_orphan(&mut self, issue: &Uuid7, identity: &LaunchIdentity) -> OrphanOutcome {
        let pid = identity.launcher_pid;
        let ours = |p: &PathBuf| {
            p.is_absolute()
                && p.components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::RootDir | std::path::Component::Normal(_)
                    )
                })
                && p.file_name().and_then(|n| n.to_str()) == Some(issue.to_string().as_str())
                && p.parent().is_some_and(|parent| {
                    self.layout.v2.as_ref().is_some_and(|v| v.parent == parent)
                        || parent.file_name().and_then(|n| n.to_str())
                            == Some(cgroup::COMMAND_CGROUPS_DIR)
                })
        };
        let recorded = identity.cgroup.as_ref().map(PathBuf::from);
        let cg = recorded.clone().filter(|p| ours(p));
        if recorded.is_some() && cg.is_none() {
            tracing::warn!(%issue, "the recorded cgroup is not an RVBox command cgroup; ignored");
        }
        let positive = matches!(
            procfs::read_stat(pid),
            Ok(Some(s)) if s.start_ticks == identity.birth_ticks && s.state != 'Z' && s.state != 'X'
        );
        let cg_live = cg
            .as_ref()
            .is_some_and(|d| procfs::cgroup_procs(d).is_ok_and(|p| !p.is_empty()));
        // the recorded cgroup, plus where this layout would put the
        // command's cgroups (left over when the launcher died early)
        let mut dirs: Vec<PathBuf> = self
            .layout
            .command_dirs(issue)
            .dirs()
            .map(Path::to_path_buf)
            .collect();
        if let Some(d) = &cg
            && !dirs.contains(d)
        {
            dirs.push(d.clone());
        }
        tracing::info!(%issue, pid, positive, cgroup_live = cg_live, "recovering a recorded launch");
        let killed_by_cgroup = match (&cg, cg_live) {
            (Some(d), true) => match cgroup::kill(d) {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!(%issue, error = %e, "cgroup.kill of the orphan failed");
                    false
                }
            },
            _ => false,
        };
        if !killed_by_cgroup {
            if !positive {
                if cg_live {
                    return OrphanOutcome::Unverified;
                }
                // gone, or the pid names another process: never kill it
                if let Err(e) = cgroup::remove_dirs(dirs.iter().map(PathBuf::as_path)) {
                    tracing::warn!(%issue, error = %e, "leftover cgroups of a gone launch");
                }
                tracing::info!(%issue, pid, "recorded launcher is gone");
                return OrphanOutcome::Gone;
            }
            if identity.process_group != pid {
                tracing::error!(%issue, pid, pgid = identity.process_group, "recorded group is not the launcher's own; not killed");
                return OrphanOutcome::Unverified;
            }
            // plan §7.4: the process-group fallback only after positive
            // birth identity
            let Some(pgid) = pid_of(pid) else {
                return OrphanOutcome::Unverified;
            };
            if let Err(e) = rustix::process::kill_process_group(pgid, Signal::KILL) {
                tracing::error!(%issue, error = %e, "killpg of the orphan failed");
                return OrphanOutcome::Unverified;
            }
        }
        let deadline = Instant::now() + ORPHAN_KILL_WAIT;
        loop {
            let launcher_dead = !procfs::is_alive_as(pid, identity.birth_ticks);
            let cgroup_empty = cg
                .as_ref()
                .is_none_or(|d| procfs::cgroup_procs(d).map_or(true, |p| p.is_empty()));
            let group_empty =
                killed_by_cgroup || procfs::group_members(pid).is_ok_and(|m| m.is_empty());
            if launcher_dead && cgroup_empty && group_empty {
                break;
            }
            if Instant::now() >= deadline {
                tracing::error!(%issue, pid, "the orphan did not die in time");
                return OrphanOutcome::Unverified;
            }
            std::thread::sleep(EXIT_POLL);
        }
        if let Err(e) = cgroup::remove_dirs(dirs.iter().map(PathBuf::as_path)) {
            tracing::warn!(%issue, error = %e, "leftover cgroups of a killed orphan");
        }
        tracing::info!(%issue, pid, "orphan killed and verified dead");
        OrphanOutcome::Killed
    }

    fn stop_all(&mut self) {
        tracing::info!(trees = self.trees.len(), "stopping every supervised tree");
        let issues: Vec<Uuid7> = self.trees.keys().copied().collect();
        for issue in &issues {
            match self.trees.get(issue).map(|t| t.phase) {
                Some(Phase::Preparing | Phase::Prepared) => self.abort(issue),
                Some(Phase::Running | Phase::Draining | Phase::Killing) => {
                    let _outcome = self.send_signal(issue, Signal::TERM);
                }
                _ => {}
            }
        }
        let live = |s: &Self| {
            s.trees
                .values()
                .any(|t| matches!(t.phase, Phase::Releasing | Phase::Running))
        };
        let deadline = crate::procfs::after(self.config.kill_grace);
        while live(self) && Instant::now() < deadline {
            let seen = self.hub.generation();
            self.pump();
            self.hub.wait(seen, DRAIN_POLL);
        }
        for (issue, tree) in &mut self.trees {
            if matches!(
                tree.phase,
                Phase::Releasing | Phase::Running | Phase::Draining | Phase::Killing
            ) && !tree.launcher_gone
            {
                Self::kill_tree(issue, tree);
            }
        }
        let deadline = Instant::now() + STOP_ALL_KILL_WAIT;
        while self.trees.values().any(|t| !t.launcher_gone) && Instant::now() < deadline {
            let seen = self.hub.generation();
            self.pump();
            self.hub.wait(seen, DRAIN_POLL);
        }
    }

    fn start_terminal(&mut self, spec: TerminalSpec) -> Result<(), SupervisorError> {
        let id = spec.terminal;
        self.room_for_terminal(&id)?;
        if let Err(f) = self.validate_terminal(&spec) {
            tracing::warn!(terminal = %id, failure = ?f, "terminal refused before its holder started");
            self.terminal_out.push_back(TerminalProcessEvent {
                terminal: id,
                event: TerminalEvent::Failed(f),
            });
            return Ok(());
        }
        // resolved as validated: a link swapped since cannot move it, and
        // one swapped between the two looks is refused, never used as given
        let cwd = match launcher::resolved_cwd(Path::new(&spec.cwd), &self.config.cwd_roots) {
            Ok(c) => c,
            Err(reason) => {
                tracing::warn!(terminal = %id, %reason, "terminal refused: its working directory changed since it was checked");
                self.terminal_out.push_back(TerminalProcessEvent {
                    terminal: id,
                    event: TerminalEvent::Failed(LaunchFailure::Permanent(reason)),
                });
                return Ok(());
            }
        };
        let holder = crate::terminal::HolderSpec {
            socket: self.config.run_dir.join(format!("pty-{id}.sock")),
            shell: PathBuf::from(&spec.shell_path),
            shell_args: Vec::new(),
            env: spec.env,
            cwd,
            cols: spec.cols.max(1),
            rows: spec.rows.max(1),
            ring: rvbox_terminal::ring::DEFAULT_CAPACITY,
            linger: pty::HOLDER_LINGER,
        };
        let mode = pty::Mode::Start {
            exe: self.config.launcher.clone(),
            spec: holder,
            layout: Box::new(self.layout.clone()),
            limits: spec.limits,
        };
        let handle = pty::spawn(id, mode, Arc::clone(&self.hub))?;
        self.terminals.insert(id, handle);
        Ok(())
    }

    fn adopt_terminal(
        &mut self,
        terminal: &Uuid7,
        holder: &HolderIdentity,
    ) -> Result<(), SupervisorError> {
        self.room_for_terminal(terminal)?;
        let mode = pty::Mode::Adopt {
            record: pty::record_of(holder),
            cgroups: self.layout.terminal_dirs(terminal),
        };
        let handle = pty::spawn(*terminal, mode, Arc::clone(&self.hub))?;
        self.terminals.insert(*terminal, handle);
        Ok(())
    }

    fn attach_terminal(&mut self, terminal: &Uuid7, from: u64) -> Result<(), SupervisorError> {
        self.terminal(terminal)?
            .send(*terminal, pty::Cmd::Attach(from))
    }

    fn terminal_input(
        &mut self,
        terminal: &Uuid7,
        seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        self.terminal(terminal)?
            .send(*terminal, pty::Cmd::Input(seq, bytes))
    }

    fn resize_terminal(
        &mut self,
        terminal: &Uuid7,
        rows: u16,
        cols: u16,
    ) -> Result<(), SupervisorError> {
        self.terminal(terminal)?
            .send(*terminal, pty::Cmd::Resize(rows.max(1), cols.max(1)))
    }

    fn close_terminal(&mut self, terminal: &Uuid7) -> Result<(), SupervisorError> {
        self.terminal(terminal)?.send(*terminal, pty::Cmd::Close)
    }

    fn next_terminal_event(&mut self) -> Option<TerminalProcessEvent> {
        let ev = match self.terminal_out.pop_front() {
            Some(ev) => ev,
            None => self.hub.pop_terminal()?,
        };
        if matches!(
            ev.event,
            TerminalEvent::Exited { .. } | TerminalEvent::Lost { .. } | TerminalEvent::Failed(_)
        ) {
            // its thread has ended
            self.terminals.remove(&ev.terminal);
        }
        Some(ev)
    }

    fn next_event(&mut self, timeout: Duration) -> Option<CommandProcessEvent> {
        let deadline = crate::procfs::after(timeout);
        loop {
            if let Some(ev) = self.out.pop_front() {
                return Some(ev);
            }
            let seen = self.hub.generation();
            self.pump();
            if let Some(ev) = self.out.pop_front() {
                return Some(ev);
            }
            if let Some(ev) = self.next_output() {
                return Some(ev);
            }
            if self.hub.take_wake() {
                return None;
            }
            // a terminal event waits for `next_terminal_event`
            if !self.terminal_out.is_empty() || self.hub.terminal_waiting() {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let mut wait = deadline - now;
            if self.trees.values().any(|t| {
                t.deadline.is_some() || matches!(t.phase, Phase::Draining | Phase::Killing)
            }) {
                wait = wait.min(DRAIN_POLL);
            }
            self.hub.wait(seen, wait);
        }
    }
}

impl Drop for UnixSupervisor {
    fn drop(&mut self) {
        // the holders go on; their threads end
        self.terminals.clear();
        // as a daemon exit: every channel closes, so a blocked launcher
        // exits and a released one kills its tree
        for tree in self.trees.values() {
            tree.cancel.store(true, Ordering::Release);
            tree.shutdown_channel();
        }
        self.diag.stop();
    }
}
