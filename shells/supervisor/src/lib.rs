//! RVBox process supervision (plan §7.4-§7.5).
//!
//! Owns: the OS-neutral [`Supervisor`] trait the client runtime drives,
//! and (behind `cfg(unix)`) its Unix implementation: the blocked launcher
//! mode of the `rvbox` binary, process groups and sessions, the cgroup
//! layout detection and per-command cgroups, resource profiles written and
//! read back while the launcher is blocked, pipe readers that never block
//! the child, stdin writers, signals to the whole tree, the drain grace
//! period, orphan reaping after positive birth-identity checks, and the
//! `/proc` diagnostics sampler.
//!
//! Must never: run user code before `release`, search `PATH` for a shell,
//! signal a pid that is not positively ours, block a pipe reader on
//! anything but its pipe, or log command output.
//!
//! Unix only: Windows is not supported (its supervisor would implement the
//! same trait). See `docs/supervisor.md` for the launch sequence, the
//! cgroup layouts, the drain, signals and orphan reaping.
#![warn(missing_docs)]

use std::time::Duration;

use rvbox_client_core::process::{
    CommandProcessEvent, LaunchIdentity, LaunchSpec, ResourceLimits, Supervision,
};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

#[cfg(unix)]
pub mod cgroup;
#[cfg(unix)]
mod channel;
#[cfg(unix)]
mod diag;
#[cfg(unix)]
mod frame;
#[cfg(unix)]
pub mod holder;
#[cfg(unix)]
mod hub;
#[cfg(unix)]
pub mod launcher;
#[cfg(unix)]
mod pipes;
#[cfg(unix)]
mod procfs;
#[cfg(unix)]
pub mod terminal;
#[cfg(unix)]
mod unix;

#[cfg(unix)]
pub use cgroup::{CgroupLayout, CommandCgroups, V1Controller, V1Layout, V2Layout};
#[cfg(unix)]
pub use holder::{CHILD_MODE_ARG, HOLDER_MODE_ARG, child_main, holder_main};
#[cfg(unix)]
pub use hub::{DEFAULT_COMMAND_HANDOVER_BYTES, DEFAULT_HANDOVER_BYTES, HandoverBounds};
#[cfg(unix)]
pub use launcher::{LAUNCHER_MODE_ARG, launcher_main};
#[cfg(unix)]
pub use unix::{
    DEFAULT_MAX_TREES, ExecutableIdentity, SupervisorConfig, UnixSupervisor, Waker, identity_of,
};

/// A supervisor failure that is not a process event.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The command is not supervised here.
    #[error("command {0} is not supervised")]
    Unknown(Uuid7),
    /// The step does not apply in the command's current state.
    #[error("command {issue}: {what}")]
    State {
        /// The command.
        issue: Uuid7,
        /// What is wrong.
        what: &'static str,
    },
    /// Too many supervised trees.
    #[error("the supervisor holds the most process trees it may")]
    Full,
    /// An OS operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// What unclean-start recovery found for a recorded launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrphanOutcome {
    /// The recorded launcher is gone (or its pid now names another
    /// process): nothing to kill.
    Gone,
    /// The recorded tree was positively ours and is now killed.
    Killed,
    /// It could not be verified or killed; the caller keeps the command
    /// unresolved and reports it.
    Unverified,
}

/// The narrow interface the client runtime drives (plan §7.4). Every
/// outcome that takes time arrives later as a [`CommandProcessEvent`]:
/// `prepare` is answered by `Ready` or `Failed`, `release` by `Running` or
/// `Failed`, and every launch ends with one `Drained`.
pub trait Supervisor: Send {
    /// How this host supervises trees.
    fn mode(&self) -> Supervision;
    /// Launch steps 1-2: the cgroup (or process group), pipes, the private
    /// release channel and the blocked launcher; resource controls written
    /// and read back. No user code runs.
    ///
    /// # Errors
    /// [`SupervisorError`] when nothing could be started at all.
    fn prepare(&mut self, spec: LaunchSpec) -> Result<(), SupervisorError>;
    /// Launch step 4, after `launch_authorized` is durable: the one-byte
    /// release.
    ///
    /// # Errors
    /// [`SupervisorError`] when the command is not prepared.
    fn release(&mut self, issue: &Uuid7) -> Result<(), SupervisorError>;
    /// Ends a prepared, unreleased launch: the channel closes, the
    /// launcher exits without running anything, and `Drained` follows once
    /// it is verified dead.
    fn abort(&mut self, issue: &Uuid7);
    /// Sends one of the portable signals to the whole tree.
    fn signal(&mut self, issue: &Uuid7, kind: wire::SignalKind) -> wire::SignalOutcome;
    /// Queues one stdin write (in order); `StdinWritten` follows.
    ///
    /// # Errors
    /// [`SupervisorError`] when the command is not running or its stdin
    /// is closed.
    fn write_stdin(
        &mut self,
        issue: &Uuid7,
        write_seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError>;
    /// Closes the child's stdin after every queued write.
    fn close_stdin(&mut self, issue: &Uuid7);
    /// Whether every control in `limits` can be applied on this host
    /// (checked once per configured profile at startup; nothing is
    /// created). A supervisor without resource controls refuses any
    /// restriction.
    ///
    /// # Errors
    /// The reason naming the control that cannot be applied.
    fn check_limits(&self, limits: &ResourceLimits) -> Result<(), String> {
        if limits.is_empty() {
            Ok(())
        } else {
            Err("this supervisor applies no resource controls".to_owned())
        }
    }
    /// The latest diagnostics sample of a running tree.
    fn snapshot(&self, issue: &Uuid7) -> Option<wire::ResourceSnapshot>;
    /// Unclean-start recovery of a launch recorded before the restart.
    fn reap_orphan(&mut self, issue: &Uuid7, identity: &LaunchIdentity) -> OrphanOutcome;
    /// Orderly shutdown: terminates every supervised tree.
    fn stop_all(&mut self);
    /// The next process event, waiting at most `timeout`.
    fn next_event(&mut self, timeout: Duration) -> Option<CommandProcessEvent>;
}
