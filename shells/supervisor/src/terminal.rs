//! The client daemon's side of a terminal's holder (docs/terminals.md):
//! starting one, and adopting one, at start or again after the daemon
//! restarted, only after proving it is the holder this daemon started.
//!
//! The daemon keeps a [`HolderRecord`] durably for each terminal. Adoption
//! checks, in order:
//! 1. the host's boot id is the recorded one (else the host restarted and
//!    the terminal is gone with it);
//! 2. the recorded pid is alive and was born at the recorded time (a pid
//!    alone is never trusted: it may have been reused);
//! 3. the process on the recorded socket answers a fresh random challenge
//!    with the HMAC of it under the recorded token, and names the same pid
//!    and birth time.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rvbox_terminal::local::{FromHolder, ToHolder, take_record, verify};

use crate::holder::HOLDER_MODE_ARG;
use crate::procfs;

/// How long a new holder may take to bind its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a holder may take to answer a challenge.
const PROOF_TIMEOUT: Duration = Duration::from_secs(5);
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// What the daemon keeps durably about one terminal's holder.
#[derive(Clone, PartialEq, Eq)]
pub struct HolderRecord {
    /// The holder's socket.
    pub socket: PathBuf,
    /// Its pid.
    pub pid: u32,
    /// Field 22 of its `/proc/<pid>/stat`.
    pub start_ticks: u64,
    /// The host's boot id when it started.
    pub boot_id: String,
    /// The token it proves itself with.
    pub token: [u8; 32],
}

impl std::fmt::Debug for HolderRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the token
        f.debug_struct("HolderRecord")
            .field("socket", &self.socket)
            .field("pid", &self.pid)
            .field("start_ticks", &self.start_ticks)
            .field("boot_id", &self.boot_id)
            .finish_non_exhaustive()
    }
}

/// How to start a holder.
#[derive(Debug, Clone)]
pub struct HolderSpec {
    /// Its socket (in the daemon's runtime directory).
    pub socket: PathBuf,
    /// The shell, an absolute path.
    pub shell: PathBuf,
    /// The shell's arguments.
    pub shell_args: Vec<String>,
    /// Environment overrides of the holder and so of its shell.
    pub env: Vec<(String, String)>,
    /// The working directory.
    pub cwd: PathBuf,
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
    /// The output ring's size.
    pub ring: usize,
    /// How long it waits for a daemon once none is attached.
    pub linger: Duration,
}

/// Why a holder could not be started or adopted.
#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    /// The host restarted since the holder started: the terminal ended.
    #[error("terminal closed: host restarted (boot id {now}, the terminal's was {then})")]
    HostRestarted {
        /// The boot id now.
        now: String,
        /// The recorded one.
        then: String,
    },
    /// No process born at the recorded time has the recorded pid.
    #[error("the terminal's holder (pid {0}) is gone")]
    Gone(u32),
    /// Something answered that is not the holder started with the token.
    #[error("the process on {socket} is not the terminal's holder: {why}")]
    NotTheHolder {
        /// The socket.
        socket: String,
        /// What did not match.
        why: String,
    },
    /// Starting the holder failed.
    #[error("starting the terminal's holder: {0}")]
    Start(String),
    /// An I/O failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The failure.
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> TerminalError {
    move |source| TerminalError::Io { what, source }
}

/// The host's boot id.
///
/// # Errors
/// When `/proc/sys/kernel/random/boot_id` cannot be read.
pub fn boot_id() -> Result<String, TerminalError> {
    Ok(procfs::read_bounded(Path::new(BOOT_ID))
        .map_err(io_err("reading the boot id"))?
        .trim()
        .to_owned())
}

/// Starts a holder with `exe` (the `rvbox` binary) and a fresh token;
/// returns its record (to keep durably before anything else) and the
/// child handle (the caller reaps it; the holder outlives the caller).
///
/// # Errors
/// When the holder cannot be started or does not bind its socket in time.
pub fn start_holder(exe: &Path, spec: &HolderSpec) -> Result<(HolderRecord, Child), TerminalError> {
    start_holder_placed(exe, spec, |_| Ok(()))
}

/// [`start_holder`], with `place` called with the holder's pid before it
/// gets its token: the holder waits for the token before it opens the PTY
/// and starts the shell, so what `place` does (joining the terminal's
/// cgroup) holds for the shell and everything it starts. A failure of
/// `place` ends the holder before any shell ran.
///
/// # Errors
/// When the holder cannot be started or placed, or does not bind its
/// socket in time.
pub fn start_holder_placed(
    exe: &Path,
    spec: &HolderSpec,
    place: impl FnOnce(u32) -> Result<(), String>,
) -> Result<(HolderRecord, Child), TerminalError> {
    let mut token = [0u8; 32];
    getrandom::fill(&mut token)
        .map_err(|e| TerminalError::Start(format!("no randomness for the token: {e}")))?;
    let boot_id = boot_id()?;
    let mut cmd = Command::new(exe);
    cmd.arg(HOLDER_MODE_ARG)
        .arg("--socket")
        .arg(&spec.socket)
        .arg("--shell")
        .arg(&spec.shell)
        .arg("--cwd")
        .arg(&spec.cwd)
        .args([
            "--cols",
            &spec.cols.to_string(),
            "--rows",
            &spec.rows.to_string(),
        ])
        .args(["--ring", &spec.ring.to_string()])
        .args(["--linger", &spec.linger.as_secs().to_string()]);
    for a in &spec.shell_args {
        cmd.arg("--arg").arg(a);
    }
    // the daemon's systemd notification socket and watchdog are its own
    for key in rvbox_daemon_common::notify::ENVIRONMENT {
        cmd.env_remove(key);
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| TerminalError::Start(e.to_string()))?;
    if let Err(why) = place(child.id()) {
        // no token: the holder exits without opening anything
        drop(child.stdin.take());
        let _ = child.kill();
        let _ = child.wait();
        return Err(TerminalError::Start(why));
    }
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    if let Some(mut stdin) = child.stdin.take() {
        writeln!(stdin, "{hex}").map_err(io_err("giving the holder its token"))?;
    }
    let pid = child.id();
    let until = Instant::now() + START_TIMEOUT;
    while !spec.socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(TerminalError::Start(format!(
                "the holder exited at start: {status}"
            )));
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(TerminalError::Start(format!(
                "the holder did not bind {} within {START_TIMEOUT:?}",
                spec.socket.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let start_ticks = procfs::read_stat(pid)
        .map_err(io_err("reading the holder's /proc stat"))?
        .ok_or(TerminalError::Gone(pid))?
        .start_ticks;
    Ok((
        HolderRecord {
            socket: spec.socket.clone(),
            pid,
            start_ticks,
            boot_id,
            token,
        },
        child,
    ))
}

/// Connects to the holder of `record` after proving its identity; the
/// connection is ready for `Attach`, `Input` and the rest.
///
/// # Errors
/// [`TerminalError::HostRestarted`], [`TerminalError::Gone`] or
/// [`TerminalError::NotTheHolder`] naming what did not match.
pub fn adopt(record: &HolderRecord) -> Result<UnixStream, TerminalError> {
    let now = boot_id()?;
    if now != record.boot_id {
        return Err(TerminalError::HostRestarted {
            now,
            then: record.boot_id.clone(),
        });
    }
    if !procfs::is_alive_as(record.pid, record.start_ticks) {
        return Err(TerminalError::Gone(record.pid));
    }
    let not = |why: String| TerminalError::NotTheHolder {
        socket: record.socket.display().to_string(),
        why,
    };
    let mut stream =
        UnixStream::connect(&record.socket).map_err(|e| not(format!("cannot connect: {e}")))?;
    stream
        .set_read_timeout(Some(PROOF_TIMEOUT))
        .map_err(io_err("setting the proof timeout"))?;
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce)
        .map_err(|e| not(format!("no randomness for the challenge: {e}")))?;
    stream
        .write_all(&ToHolder::Challenge { nonce }.encode())
        .map_err(|e| not(format!("the challenge was not taken: {e}")))?;
    let mut buf = Vec::new();
    let body = loop {
        match take_record(&mut buf) {
            Ok(Some(body)) => break body,
            Ok(None) => {}
            Err(e) => return Err(not(format!("its answer is malformed: {e}"))),
        }
        let mut b = [0u8; 1024];
        match stream.read(&mut b) {
            Ok(0) => return Err(not("it closed the connection without an answer".into())),
            Ok(n) => buf.extend_from_slice(b.get(..n).unwrap_or_default()),
            Err(e) => return Err(not(format!("no answer within {PROOF_TIMEOUT:?}: {e}"))),
        }
    };
    match FromHolder::decode(&body) {
        Ok(FromHolder::Proof {
            mac,
            pid,
            start_ticks,
            ..
        }) => {
            if !verify(&record.token, &nonce, &mac) {
                return Err(not("its proof does not match the token".into()));
            }
            if (pid, start_ticks) != (record.pid, record.start_ticks) {
                return Err(not(format!(
                    "it is pid {pid} born at {start_ticks}, the holder was pid {} born at {}",
                    record.pid, record.start_ticks
                )));
            }
            stream
                .set_read_timeout(None)
                .map_err(io_err("clearing the proof timeout"))?;
            Ok(stream)
        }
        Ok(other) => Err(not(format!("it answered {other:?} instead of a proof"))),
        Err(e) => Err(not(format!("its answer is malformed: {e}"))),
    }
}
