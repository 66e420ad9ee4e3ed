//! One thread per terminal holder (docs/terminals.md): it starts the
//! holder (in the terminal's own cgroup where the host has them) or adopts
//! a recorded one, then speaks the holder's private protocol
//! (`rvbox_terminal::local`) on its socket: the supervisor's commands
//! (attach, input, resize, close) go to the holder, and what the holder
//! says comes back as [`TerminalEvent`]s through the hub, in order.
//!
//! The connection to a holder may drop (the holder drops a daemon that
//! does not read for 5 s): the thread connects again after a fresh proof,
//! attaches again from the offset after the last byte it handed over, and
//! sends again every input frame not yet acknowledged (the holder's gate
//! writes each once). A holder that cannot be proven any more ends the
//! terminal with `Lost`.
//!
//! Must never: write an input frame it did not get from the supervisor,
//! log keys or output, or outlive its supervisor's stop for longer than a
//! blocking step (a start, a proof) takes.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};
use rvbox_client_core::process::{
    Exit, HolderIdentity, HolderLoss, LaunchFailure, TerminalEvent, TerminalProcessEvent,
};
use rvbox_domain::ids::Uuid7;
use rvbox_terminal::local::{FromHolder, MAX_RECORD, Refused, ToHolder, take_record};

use crate::SupervisorError;
use crate::cgroup::{self, CommandCgroups};
use crate::hub::Hub;
use crate::terminal::{self, HolderRecord, HolderSpec, TerminalError};

/// Most terminals one supervisor drives at once.
pub(crate) const MAX_TERMINALS: usize = 64;
/// Commands waiting for one terminal's thread.
pub(crate) const COMMAND_QUEUE: usize = 1024;
/// Input frames sent to a holder and not yet acknowledged (each at most
/// 4 KiB); a frame past it is not taken (the server sends it again after
/// a reconnect).
pub(crate) const MAX_UNACKED_INPUTS: usize = 256;
/// Times a dropped connection is proven and opened again.
const RECONNECT_ATTEMPTS: u32 = 3;
/// Between those attempts.
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);
/// A frame the holder could not take now is sent again after this.
const BUSY_RETRY: Duration = Duration::from_millis(100);
/// Longest wait between looks at the stop flag.
const TICK: Duration = Duration::from_millis(200);
/// How long a write to the holder may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an ended holder has to exit before it is left to its parent.
const REAP_WAIT: Duration = Duration::from_secs(5);
/// How long a holder waits for a daemon once none is attached (a daemon
/// stopped longer than this finds its terminals gone).
pub(crate) const HOLDER_LINGER: Duration = Duration::from_secs(24 * 3600);

/// What the supervisor asks of a terminal's thread.
#[derive(Debug)]
pub(crate) enum Cmd {
    Attach(u64),
    Input(u64, Vec<u8>),
    Resize(u16, u16),
    Close,
}

/// How the thread finds its holder.
#[derive(Debug)]
pub(crate) enum Mode {
    /// Start one: the `rvbox` binary, the spec, and the terminal's
    /// cgroups to create (with their resource controls).
    Start {
        exe: PathBuf,
        spec: HolderSpec,
        layout: Box<cgroup::CgroupLayout>,
        limits: rvbox_client_core::process::ResourceLimits,
    },
    /// Adopt a recorded one.
    Adopt {
        record: HolderRecord,
        cgroups: CommandCgroups,
    },
}

/// The supervisor's end of a terminal's thread.
#[derive(Debug)]
pub(crate) struct Handle {
    tx: SyncSender<Cmd>,
    wake: UnixStream,
    stop: Arc<AtomicBool>,
}

impl Handle {
    /// Queues a command and wakes the thread.
    pub(crate) fn send(&self, terminal: Uuid7, cmd: Cmd) -> Result<(), SupervisorError> {
        match self.tx.try_send(cmd) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(SupervisorError::TerminalBusy {
                    terminal,
                    what: "its command queue is full",
                });
            }
            Err(TrySendError::Disconnected(_)) => {
                // the thread ended: its last event (the exit, or the
                // holder lost) is on its way, and says what became of the
                // terminal; the step is moot
                tracing::debug!(%terminal, "a step for a terminal whose holder's thread ended");
                return Ok(());
            }
        }
        // a full wake socket already wakes the thread
        let _ = (&self.wake).write(&[1]);
        Ok(())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // the thread sees the flag, or the closed wake socket, and ends;
        // the holder goes on (it outlives the daemon)
        self.stop.store(true, Ordering::Release);
    }
}

/// Starts the thread of `terminal`.
pub(crate) fn spawn<C: Send + 'static>(
    terminal: Uuid7,
    mode: Mode,
    hub: Arc<Hub<C>>,
) -> Result<Handle, SupervisorError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(COMMAND_QUEUE);
    let (wake, wake_rx) = UnixStream::pair().map_err(|source| SupervisorError::Io {
        context: "creating a terminal's wake socket",
        source,
    })?;
    for s in [&wake, &wake_rx] {
        s.set_nonblocking(true)
            .map_err(|source| SupervisorError::Io {
                context: "creating a terminal's wake socket",
                source,
            })?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let io = Io {
        terminal,
        hub,
        stop: Arc::clone(&stop),
        rx,
        wake: wake_rx,
        stream: None,
        buf: Vec::new(),
        forwarded: 0,
        attached: false,
        cut: 0,
        unacked: VecDeque::new(),
        acked: 0,
        resend_at: None,
        size: None,
        close_asked: false,
        child: None,
        holder: None,
        cgroups: CommandCgroups::default(),
    };
    std::thread::Builder::new()
        .name("rvbox-terminal".into())
        .spawn(move || io.run(mode))
        .map_err(|source| SupervisorError::Io {
            context: "starting a terminal's thread",
            source,
        })?;
    Ok(Handle { tx, wake, stop })
}

fn identity(record: &HolderRecord, cgroups: &CommandCgroups) -> HolderIdentity {
    HolderIdentity {
        socket: record.socket.display().to_string(),
        pid: record.pid,
        start_ticks: record.start_ticks,
        boot_id: record.boot_id.clone(),
        token: record.token,
        cgroup: cgroups.v2.as_ref().map(|d| d.display().to_string()),
    }
}

/// The record the supervisor adopts from what the daemon kept.
pub(crate) fn record_of(h: &HolderIdentity) -> HolderRecord {
    HolderRecord {
        socket: PathBuf::from(&h.socket),
        pid: h.pid,
        start_ticks: h.start_ticks,
        boot_id: h.boot_id.clone(),
        token: h.token,
    }
}

fn loss_of(e: &TerminalError) -> HolderLoss {
    match e {
        TerminalError::HostRestarted { .. } => HolderLoss::HostRestarted,
        _ => HolderLoss::Gone,
    }
}

/// Why the thread stops.
enum End {
    /// The supervisor is gone: the holder goes on.
    Stopped,
    /// The terminal ended (told to the supervisor): clean up.
    Ended,
}

struct Io<C> {
    terminal: Uuid7,
    hub: Arc<Hub<C>>,
    stop: Arc<AtomicBool>,
    rx: Receiver<Cmd>,
    wake: UnixStream,
    stream: Option<UnixStream>,
    buf: Vec<u8>,
    /// The offset after the last output byte handed over.
    forwarded: u64,
    /// An attach was asked for (it is renewed after a reconnect).
    attached: bool,
    /// Bytes cut before the next output (from the holder's replay).
    cut: u64,
    unacked: VecDeque<(u64, Vec<u8>)>,
    acked: u64,
    resend_at: Option<Instant>,
    size: Option<(u16, u16)>,
    /// A hang-up was asked (it is renewed after a reconnect).
    close_asked: bool,
    /// The holder, when this thread started it (reaped at its end).
    child: Option<Child>,
    /// The holder's pid and birth time, once known.
    holder: Option<(u32, u64)>,
    cgroups: CommandCgroups,
}

impl<C> Io<C> {
    fn post(&self, event: TerminalEvent) -> bool {
        self.hub.post_terminal(
            TerminalProcessEvent {
                terminal: self.terminal,
                event,
            },
            &self.stop,
        )
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn run(mut self, mode: Mode) {
        let terminal = self.terminal;
        let adopting = matches!(mode, Mode::Adopt { .. });
        let record = match mode {
            Mode::Start {
                exe,
                spec,
                layout,
                limits,
            } => match self.start(&exe, &spec, &layout, &limits) {
                Ok(record) => record,
                Err(f) => {
                    tracing::warn!(%terminal, failure = ?f, "terminal holder not started");
                    self.post(TerminalEvent::Failed(f));
                    self.clean_up();
                    return;
                }
            },
            Mode::Adopt { record, cgroups } => {
                self.cgroups = cgroups;
                record
            }
        };
        self.holder = Some((record.pid, record.start_ticks));
        match terminal::adopt(&record) {
            Ok(stream) => {
                if let Err(e) = stream.set_write_timeout(Some(WRITE_TIMEOUT)) {
                    tracing::warn!(%terminal, error = %e, "terminal holder socket: no write timeout");
                }
                self.stream = Some(stream);
            }
            Err(e) => {
                tracing::warn!(%terminal, error = %e, "terminal holder not adopted");
                self.post(TerminalEvent::Lost {
                    loss: loss_of(&e),
                    detail: e.to_string(),
                });
                if !matches!(e, TerminalError::HostRestarted { .. }) {
                    self.clean_up();
                }
                return;
            }
        }
        if adopting {
            tracing::info!(%terminal, pid = record.pid, "terminal holder adopted");
            if !self.post(TerminalEvent::Adopted) {
                return;
            }
        }
        match self.serve(&record) {
            End::Stopped => {
                tracing::debug!(%terminal, "terminal thread stopped; the holder goes on");
            }
            End::Ended => self.clean_up(),
        }
    }

    /// Starts the holder in the terminal's cgroups.
    fn start(
        &mut self,
        exe: &std::path::Path,
        spec: &HolderSpec,
        layout: &cgroup::CgroupLayout,
        limits: &rvbox_client_core::process::ResourceLimits,
    ) -> Result<HolderRecord, LaunchFailure> {
        let cgroups = layout
            .create_terminal(&self.terminal, limits)
            .map_err(|r| match r {
                cgroup::Refusal::Unsupported(s) => LaunchFailure::Permanent(s),
                cgroup::Refusal::Transient(s) => LaunchFailure::Transient(s),
            })?;
        self.cgroups = cgroups.clone();
        let place = |pid: u32| -> Result<(), String> {
            for dir in cgroups.dirs() {
                cgroup::join(dir, pid).map_err(|e| {
                    format!(
                        "the holder could not join its cgroup {}: {e}",
                        dir.display()
                    )
                })?;
            }
            Ok(())
        };
        match terminal::start_holder_placed(exe, spec, place) {
            Ok((record, child)) => {
                tracing::info!(terminal = %self.terminal, pid = record.pid, cgroup = ?self.cgroups.v2, "terminal holder started");
                self.child = Some(child);
                if !self.post(TerminalEvent::Started(identity(&record, &self.cgroups))) {
                    return Err(LaunchFailure::Transient(
                        "the supervisor stopped while the holder started".into(),
                    ));
                }
                Ok(record)
            }
            Err(e) => Err(LaunchFailure::Transient(e.to_string())),
        }
    }

    /// Ends a terminal's traces: the holder reaped when this thread
    /// started it (or, adopted, awaited: it exits once it told the end),
    /// what is left in its cgroup killed, the cgroup removed.
    fn clean_up(&mut self) {
        if self.child.is_none()
            && let Some((pid, ticks)) = self.holder
        {
            let until = Instant::now() + REAP_WAIT;
            while crate::procfs::is_alive_as(pid, ticks) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if let Some(mut child) = self.child.take() {
            let until = Instant::now() + REAP_WAIT;
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= until => {
                        tracing::warn!(terminal = %self.terminal, pid = child.id(), "terminal holder still running after its end; left to exit on its own");
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        if let Some(dir) = &self.cgroups.v2
            && dir.exists()
            && let Err(e) = cgroup::kill(dir)
        {
            tracing::warn!(terminal = %self.terminal, error = %e, "cannot kill what is left in a terminal's cgroup");
        }
        if let Err(e) = cgroup::remove(&self.cgroups) {
            tracing::warn!(terminal = %self.terminal, error = %e, "cannot remove a terminal's cgroups");
        }
    }

    fn write(&mut self, m: &ToHolder) -> bool {
        let Some(s) = self.stream.as_mut() else {
            return false;
        };
        if s.write_all(&m.encode()).is_ok() {
            true
        } else {
            self.stream = None;
            false
        }
    }

    /// Connects again after a dropped connection, and renews what the
    /// holder must know of this daemon. False when the holder is lost (and
    /// told).
    fn reconnect(&mut self, record: &HolderRecord) -> bool {
        let mut last = None;
        for attempt in 0..RECONNECT_ATTEMPTS {
            if self.stopped() {
                return false;
            }
            if attempt > 0 {
                std::thread::sleep(RECONNECT_PAUSE);
            }
            match terminal::adopt(record) {
                Ok(stream) => {
                    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
                    self.stream = Some(stream);
                    self.buf.clear();
                    tracing::info!(terminal = %self.terminal, "terminal holder connected again");
                    if self.attached
                        && !self.write(&ToHolder::Attach {
                            from: self.forwarded,
                        })
                    {
                        continue;
                    }
                    if let Some((rows, cols)) = self.size
                        && !self.write(&ToHolder::Resize { cols, rows })
                    {
                        continue;
                    }
                    if !self.resend() {
                        continue;
                    }
                    if self.close_asked && !self.write(&ToHolder::Close) {
                        continue;
                    }
                    return true;
                }
                Err(e @ (TerminalError::HostRestarted { .. } | TerminalError::Gone(_))) => {
                    last = Some(e);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let (loss, detail) = last
            .map_or((HolderLoss::Gone, "it could not be reached".into()), |e| {
                (loss_of(&e), e.to_string())
            });
        tracing::warn!(terminal = %self.terminal, %detail, "terminal holder lost");
        self.post(TerminalEvent::Lost { loss, detail });
        false
    }

    /// Every unacknowledged frame again, in order.
    fn resend(&mut self) -> bool {
        self.resend_at = None;
        let viewer = *self.terminal.as_bytes();
        let frames: Vec<(u64, Vec<u8>)> = self.unacked.iter().cloned().collect();
        for (seq, bytes) in frames {
            if !self.write(&ToHolder::Input { viewer, seq, bytes }) {
                return false;
            }
        }
        true
    }

    fn command(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Attach(from) => {
                self.attached = true;
                self.cut = 0;
                self.write(&ToHolder::Attach { from })
            }
            Cmd::Input(seq, bytes) => {
                if seq > self.acked {
                    if self.unacked.len() >= MAX_UNACKED_INPUTS {
                        tracing::warn!(terminal = %self.terminal, seq, "terminal input frame not taken: too many unacknowledged");
                        return true;
                    }
                    self.unacked.push_back((seq, bytes.clone()));
                }
                let viewer = *self.terminal.as_bytes();
                self.write(&ToHolder::Input { viewer, seq, bytes })
            }
            Cmd::Resize(rows, cols) => {
                self.size = Some((rows, cols));
                self.write(&ToHolder::Resize { cols, rows })
            }
            Cmd::Close => {
                tracing::info!(terminal = %self.terminal, "terminal hang-up asked");
                self.close_asked = true;
                self.write(&ToHolder::Close)
            }
        }
    }

    /// One message of the holder; `Some` when the terminal ended.
    fn message(&mut self, m: FromHolder) -> Option<End> {
        match m {
            FromHolder::Replay { offset: _, cut } => self.cut = cut,
            FromHolder::Output { offset, bytes } => {
                let end = offset.saturating_add(bytes.len() as u64);
                let cut = std::mem::take(&mut self.cut);
                self.forwarded = self.forwarded.max(end);
                if !self.post(TerminalEvent::Output { offset, bytes, cut }) {
                    return Some(End::Stopped);
                }
            }
            FromHolder::InputAck {
                viewer: _,
                acked,
                refused,
            } => {
                if acked > self.acked {
                    self.acked = acked;
                    while self.unacked.front().is_some_and(|(s, _)| *s <= acked) {
                        self.unacked.pop_front();
                    }
                }
                match refused {
                    None => {}
                    Some(Refused::Gap | Refused::Busy) if self.resend_at.is_none() => {
                        self.resend_at = Some(Instant::now() + BUSY_RETRY);
                    }
                    Some(Refused::Gap | Refused::Busy) => {}
                    Some(Refused::UnknownViewer) => {
                        // the holder takes no input (its shell ended): the
                        // frames wait for nothing
                        self.unacked.clear();
                    }
                    Some(Refused::TooLarge) => {
                        tracing::warn!(terminal = %self.terminal, "the holder refused an input frame as too large");
                        self.unacked.pop_front();
                    }
                }
                if acked > 0 && !self.post(TerminalEvent::InputAcked { seq: acked }) {
                    return Some(End::Stopped);
                }
            }
            FromHolder::OffsetAhead { from, end } => {
                tracing::warn!(terminal = %self.terminal, from, end, "attach past the holder's output; attaching from its end");
                if !self.write(&ToHolder::Attach { from: end }) {
                    self.stream = None;
                }
            }
            FromHolder::Exited { signal, value } => {
                let exit = if signal {
                    Exit::Signal(value)
                } else {
                    Exit::Code(value)
                };
                tracing::info!(terminal = %self.terminal, ?exit, final_offset = self.forwarded, "terminal shell ended");
                self.post(TerminalEvent::Exited {
                    exit,
                    final_offset: self.forwarded,
                });
                return Some(End::Ended);
            }
            FromHolder::Proof { .. } => {}
        }
        None
    }

    /// Serves the terminal until it ends or the supervisor stops.
    fn serve(&mut self, record: &HolderRecord) -> End {
        loop {
            if self.stopped() {
                return End::Stopped;
            }
            if self.stream.is_none() && !self.reconnect(record) {
                return if self.stopped() {
                    End::Stopped
                } else {
                    End::Ended
                };
            }
            // the supervisor's commands first
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.command(cmd) {
                            break;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return End::Stopped,
                }
            }
            if self.resend_at.is_some_and(|t| Instant::now() >= t) && !self.resend() {
                continue;
            }
            let Some(stream) = self.stream.as_ref() else {
                continue;
            };
            let wait = self.resend_at.map_or(TICK, |t| {
                t.saturating_duration_since(Instant::now()).min(TICK)
            });
            let tick = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: i64::from(u32::try_from(wait.as_nanos()).unwrap_or(200_000_000)),
            };
            let mut fds = [
                PollFd::new(stream, PollFlags::IN),
                PollFd::new(&self.wake, PollFlags::IN),
            ];
            match poll(&mut fds, Some(&tick)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::error!(terminal = %self.terminal, error = %e, "poll on a terminal's socket failed");
                    std::thread::sleep(TICK);
                    continue;
                }
            }
            let [sock_fd, wake_fd] = &fds;
            let (sock, wake) = (sock_fd.revents(), wake_fd.revents());
            if !wake.is_empty() {
                let mut b = [0u8; 64];
                // the supervisor's end closed
                if let Ok(0) = (&self.wake).read(&mut b) {
                    return End::Stopped;
                }
            }
            if !sock.is_empty()
                && let Some(end) = self.read()
            {
                return end;
            }
        }
    }

    /// Reads what the holder sent; `Some` when the terminal ended.
    fn read(&mut self) -> Option<End> {
        let stream = self.stream.as_mut()?;
        let mut b = [0u8; 16 * 1024];
        match stream.read(&mut b) {
            Ok(0) | Err(_) => {
                // dropped: the next turn proves the holder again
                self.stream = None;
                return None;
            }
            Ok(n) => self.buf.extend_from_slice(b.get(..n).unwrap_or_default()),
        }
        loop {
            let body = match take_record(&mut self.buf) {
                Ok(Some(body)) => body,
                Ok(None) => {
                    if self.buf.len() > 2 * MAX_RECORD {
                        self.stream = None;
                    }
                    return None;
                }
                Err(e) => {
                    tracing::warn!(terminal = %self.terminal, error = %e, "a malformed record from the holder; connecting again");
                    self.stream = None;
                    return None;
                }
            };
            match FromHolder::decode(&body) {
                Ok(m) => {
                    if let Some(end) = self.message(m) {
                        return Some(end);
                    }
                }
                Err(e) => {
                    tracing::warn!(terminal = %self.terminal, error = %e, "a malformed message from the holder; connecting again");
                    self.stream = None;
                    return None;
                }
            }
        }
    }
}
