//! RVBox process supervision (plan §7.4-§7.5).
//!
//! Owns: the OS-neutral [`Supervisor`] trait the client runtime drives,
//! and (behind `cfg(unix)`) its Unix implementation: the blocked launcher
//! mode of the `rvbox` binary, process groups and sessions, the cgroup
//! layout detection and per-command cgroups, resource profiles written and
//! read back while the launcher is blocked, pipe readers that never block
//! the child, stdin writers, signals to the whole tree, the drain grace
//! period, orphan reaping after positive birth-identity checks, the
//! `/proc` diagnostics sampler, and the terminals' holders (the holder
//! mode, starting one in the terminal's cgroup, adopting one after a
//! restart only once it proved itself, one thread per holder speaking its
//! private protocol).
//!
//! Must never: run user code before `release`, search `PATH` for a shell,
//! signal a pid that is not positively ours, block a pipe reader on
//! anything but its pipe, log command or terminal output or keys, or
//! speak to a holder that has not proven its token.
//!
//! Unix only: Windows is not supported (its supervisor would implement the
//! same trait). See `docs/supervisor.md` for the launch sequence, the
//! cgroup layouts, the drain, signals and orphan reaping.
#![warn(missing_docs)]

use std::time::Duration;

use rvbox_client_core::process::{
    CommandProcessEvent, HolderIdentity, LaunchIdentity, LaunchSpec, ResourceLimits, Supervision,
    TerminalProcessEvent, TerminalSpec,
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
mod pty;
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
    /// This supervisor does not run terminals.
    #[error("this supervisor has no terminals")]
    NoTerminals,
    /// The terminal has no holder here (never started or adopted, or it
    /// ended).
    #[error("terminal {0} has no holder here")]
    UnknownTerminal(Uuid7),
    /// Too many terminals, or a terminal's queue is full.
    #[error("terminal {terminal}: {what}")]
    TerminalBusy {
        /// The terminal.
        terminal: Uuid7,
        /// What is full.
        what: &'static str,
    },
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
    /// The next process event, waiting at most `timeout`. It returns
    /// `None` at once while a terminal event waits for
    /// [`Supervisor::next_terminal_event`].
    fn next_event(&mut self, timeout: Duration) -> Option<CommandProcessEvent>;

    // ---- terminals (docs/terminals.md) ---------------------------------
    //
    // A terminal's shell runs on a PTY its holder owns, so that it outlives
    // the daemon. Every outcome arrives as a `TerminalEvent`, in order per
    // terminal: a start is answered by `Started` or `Failed`, an adoption
    // by `Adopted` or `Lost`; after an attach the output follows by offset,
    // each input frame is acknowledged (`InputAcked`), and a terminal ends
    // with `Exited` or `Lost`. A supervisor without terminals refuses them
    // all.

    /// Starts a terminal's holder (in the terminal's own cgroup where the
    /// host has them).
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`], or when nothing could be started.
    fn start_terminal(&mut self, spec: TerminalSpec) -> Result<(), SupervisorError> {
        let _ = spec;
        Err(SupervisorError::NoTerminals)
    }
    /// Adopts the holder of a record kept before a restart: the boot id,
    /// then the pid's birth time, then the answer to a fresh challenge.
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`].
    fn adopt_terminal(
        &mut self,
        terminal: &Uuid7,
        holder: &HolderIdentity,
    ) -> Result<(), SupervisorError> {
        let _ = (terminal, holder);
        Err(SupervisorError::NoTerminals)
    }
    /// Streams the holder's output from `from`: its replay (exact, or the
    /// whole ring after a cut), then every new byte.
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`] or
    /// [`SupervisorError::UnknownTerminal`].
    fn attach_terminal(&mut self, terminal: &Uuid7, from: u64) -> Result<(), SupervisorError> {
        let _ = (terminal, from);
        Err(SupervisorError::NoTerminals)
    }
    /// Writes one numbered input frame (the holder writes a frame once,
    /// and acknowledges a repeat again).
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`] or
    /// [`SupervisorError::UnknownTerminal`].
    fn terminal_input(
        &mut self,
        terminal: &Uuid7,
        seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        let _ = (terminal, seq, bytes);
        Err(SupervisorError::NoTerminals)
    }
    /// Sets the window size.
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`] or
    /// [`SupervisorError::UnknownTerminal`].
    fn resize_terminal(
        &mut self,
        terminal: &Uuid7,
        rows: u16,
        cols: u16,
    ) -> Result<(), SupervisorError> {
        let _ = (terminal, rows, cols);
        Err(SupervisorError::NoTerminals)
    }
    /// Hangs the terminal's shell up (`Exited` follows).
    ///
    /// # Errors
    /// [`SupervisorError::NoTerminals`] or
    /// [`SupervisorError::UnknownTerminal`].
    fn close_terminal(&mut self, terminal: &Uuid7) -> Result<(), SupervisorError> {
        let _ = terminal;
        Err(SupervisorError::NoTerminals)
    }
    /// The next terminal event, if one waits (never waits itself).
    fn next_terminal_event(&mut self) -> Option<TerminalProcessEvent> {
        None
    }
}
