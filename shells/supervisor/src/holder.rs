//! The terminal holder: the internal mode `rvbox __terminal-holder ...`
//! (docs/terminals.md). It owns a terminal's PTY so that the shell on it
//! outlives the client daemon: the daemon connects to the holder's private
//! socket, and a restarted daemon connects again after proving it is
//! talking to the holder it started (the token challenge of
//! `rvbox_terminal::local`).
//!
//! In order: `setsid()` (the holder leads a session of its own and has no
//! controlling terminal), read the 32-byte token from standard input (64
//! hex digits and a newline), open the PTY and set its size, start the
//! shell through the child mode `rvbox __terminal-child SLAVE SHELL
//! [ARG...]` (which leads a new session, takes the slave as its
//! controlling terminal and as its standard streams, resets the signal
//! dispositions it inherited as ignored, then executes the shell), and
//! listen on the socket (mode 0600; one connection at a time,
//! a new one replaces the old). It then drives `rvbox_terminal::holder`:
//! PTY output into the ring and to the attached daemon, the daemon's
//! messages in, effects out. Input waits in a bounded queue for the PTY
//! to take it, so a shell that stops reading never blocks the holder's
//! output. Once the shell ended and an attached daemon was told, or after
//! `--linger` seconds with none, the holder removes its socket and exits.
//!
//! Everything the holder reads from its socket is bounded and checked;
//! a malformed record closes that connection, never the terminal.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::io::Errno;
use rvbox_terminal::holder::{Effect, Holder, Identity};
use rvbox_terminal::local::{FromHolder, MAX_RECORD, ToHolder, take_record};

/// The first argument of the `rvbox` binary that selects the holder mode.
pub const HOLDER_MODE_ARG: &str = "__terminal-holder";
/// The first argument that selects the shell's child mode.
pub const CHILD_MODE_ARG: &str = "__terminal-child";

const EXIT_USAGE: i32 = 2;
const EXIT_SETUP: i32 = 3;
/// Most input waiting for the PTY to take it.
const MAX_PENDING_INPUT: usize = 256 * 1024;
/// How long a write to the daemon may block before the connection is
/// dropped (the output stays in the ring for the next attach).
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
const TICK: Duration = Duration::from_millis(100);

/// The holder's arguments.
#[derive(Debug)]
struct Args {
    socket: PathBuf,
    shell: PathBuf,
    shell_args: Vec<OsString>,
    cwd: PathBuf,
    cols: u16,
    rows: u16,
    ring: usize,
    viewers: usize,
    linger: Duration,
}

fn parse(args: Vec<OsString>) -> Result<Args, String> {
    let mut a = Args {
        socket: PathBuf::new(),
        shell: PathBuf::new(),
        shell_args: Vec::new(),
        cwd: PathBuf::from("/"),
        cols: 80,
        rows: 24,
        ring: rvbox_terminal::ring::DEFAULT_CAPACITY,
        viewers: rvbox_terminal::input::DEFAULT_VIEWERS,
        linger: Duration::from_secs(24 * 3600),
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let flag = flag.to_string_lossy().into_owned();
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &OsString| {
            v.to_str()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| format!("{flag} takes a number, not {v:?}"))
        };
        match flag.as_str() {
            "--socket" => a.socket = value.into(),
            "--shell" => a.shell = value.into(),
            "--arg" => a.shell_args.push(value),
            "--cwd" => a.cwd = value.into(),
            "--cols" => a.cols = u16::try_from(num(&value)?).unwrap_or(u16::MAX).max(1),
            "--rows" => a.rows = u16::try_from(num(&value)?).unwrap_or(u16::MAX).max(1),
            "--ring" => a.ring = usize::try_from(num(&value)?).unwrap_or(usize::MAX),
            "--viewers" => a.viewers = usize::try_from(num(&value)?).unwrap_or(usize::MAX),
            "--linger" => a.linger = Duration::from_secs(num(&value)?),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if a.socket.as_os_str().is_empty() || !a.shell.is_absolute() {
        return Err("--socket and an absolute --shell are required".into());
    }
    Ok(a)
}

fn read_token() -> Result<[u8; 32], String> {
    let mut line = String::new();
    io::stdin()
        .take(66)
        .read_to_string(&mut line)
        .map_err(|e| format!("reading the token: {e}"))?;
    let hex = line.trim();
    if hex.len() != 64 {
        return Err("the token is not 64 hex digits".into());
    }
    let mut t = [0; 32];
    for (i, b) in t.iter_mut().enumerate() {
        *b = hex
            .get(2 * i..2 * i + 2)
            .and_then(|p| u8::from_str_radix(p, 16).ok())
            .ok_or("the token is not 64 hex digits")?;
    }
    Ok(t)
}

/// The child mode: leads a new session with the PTY slave as its
/// controlling terminal and standard streams, then becomes the shell.
/// Returns only on failure.
#[must_use]
pub fn child_main(args: Vec<OsString>) -> i32 {
    let mut it = args.into_iter();
    let (Some(slave), Some(shell)) = (it.next(), it.next()) else {
        eprintln!("rvbox {CHILD_MODE_ARG}: usage: SLAVE SHELL [ARG...]");
        return EXIT_USAGE;
    };
    let setup = || -> io::Result<()> {
        rustix::process::setsid()?;
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&slave)?;
        rustix::process::ioctl_tiocsctty(&tty)?;
        rustix::stdio::dup2_stdin(&tty)?;
        rustix::stdio::dup2_stdout(&tty)?;
        rustix::stdio::dup2_stderr(&tty)?;
        Ok(())
    };
    if let Err(e) = setup() {
        eprintln!("rvbox {CHILD_MODE_ARG}: taking the terminal: {e}");
        return EXIT_SETUP;
    }
    // a signal the daemon inherited as ignored (HUP under nohup) would stay
    // ignored across exec: caught here, exec resets it for the shell, so a
    // close's hang-up ends it
    crate::launcher::catch_inherited_signals();
    let e = Command::new(&shell).args(it).exec();
    eprintln!(
        "rvbox {CHILD_MODE_ARG}: starting {}: {e}",
        shell.to_string_lossy()
    );
    EXIT_SETUP
}

/// The holder's own start time, for its proofs.
fn identity(token: [u8; 32]) -> Result<Identity, String> {
    let pid = std::process::id();
    let stat = crate::procfs::read_stat(pid)
        .ok()
        .flatten()
        .ok_or("the holder cannot read its own /proc stat")?;
    Ok(Identity {
        token,
        pid,
        start_ticks: stat.start_ticks,
    })
}

fn open_pty(cols: u16, rows: u16) -> io::Result<(OwnedFd, PathBuf)> {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname(&master, Vec::new())?;
    set_size(&master, cols, rows)?;
    rustix::io::ioctl_fionbio(&master, true)?;
    Ok((master, PathBuf::from(name.to_string_lossy().into_owned())))
}

fn set_size(master: &OwnedFd, cols: u16, rows: u16) -> io::Result<()> {
    rustix::termios::tcsetwinsize(
        master,
        rustix::termios::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok(())
}

/// The holder mode. Returns the process exit status.
#[must_use]
pub fn holder_main(args: Vec<OsString>) -> i32 {
    let args = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rvbox {HOLDER_MODE_ARG}: {e}");
            return EXIT_USAGE;
        }
    };
    match run(&args) {
        Ok(status) => status,
        Err(e) => {
            eprintln!("rvbox {HOLDER_MODE_ARG}: {e}");
            let _ = std::fs::remove_file(&args.socket);
            EXIT_SETUP
        }
    }
}

/// The connection to the daemon, while there is one.
struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
}

struct State {
    holder: Holder,
    master: OwnedFd,
    child: Child,
    conn: Option<Conn>,
    pending: VecDeque<u8>,
    exited: bool,
    told: bool,
}

fn run(args: &Args) -> Result<i32, String> {
    // a session of its own: the daemon's end does not end the terminal
    let _ = rustix::process::setsid();
    let token = read_token()?;
    let id = identity(token)?;
    let (master, slave) =
        open_pty(args.cols, args.rows).map_err(|e| format!("opening a PTY: {e}"))?;
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)
        .map_err(|e| format!("binding {}: {e}", args.socket.display()))?;
    std::fs::set_permissions(&args.socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("restricting {}: {e}", args.socket.display()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("socket: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("finding the rvbox binary: {e}"))?;
    let child = Command::new(exe)
        .arg(CHILD_MODE_ARG)
        .arg(&slave)
        .arg(&args.shell)
        .args(&args.shell_args)
        .current_dir(&args.cwd)
        .env(
            "TERM",
            std::env::var_os("TERM").unwrap_or_else(|| "xterm-256color".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting the shell: {e}"))?;
    let mut s = State {
        holder: Holder::new(id, args.ring, args.viewers),
        master,
        child,
        conn: None,
        pending: VecDeque::new(),
        exited: false,
        told: false,
    };
    let mut unattached_since = Instant::now();
    loop {
        if !s.exited
            && let Ok(Some(status)) = s.child.try_wait()
        {
            // what the shell wrote last is read before its exit is told
            drain_pty(&mut s);
            s.exited = true;
            let (signal, value) = match (
                status.code(),
                std::os::unix::process::ExitStatusExt::signal(&status),
            ) {
                (Some(c), _) => (false, c),
                (None, Some(sig)) => (true, sig),
                (None, None) => (false, -1),
            };
            let fx = s.holder.shell_exited(signal, value);
            perform(&mut s, fx);
        }
        if s.exited && s.told {
            break;
        }
        if s.conn.is_some() {
            unattached_since = Instant::now();
        } else if unattached_since.elapsed() >= args.linger {
            break;
        }
        // once the shell ended its side is closed: the PTY is no longer
        // watched (it would report the hang-up on every turn)
        let pty_flags = if s.exited {
            PollFlags::empty()
        } else if s.pending.is_empty() {
            PollFlags::IN
        } else {
            PollFlags::IN | PollFlags::OUT
        };
        let mut fds = vec![
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(&s.master, pty_flags),
        ];
        if let Some(c) = &s.conn {
            fds.push(PollFd::new(&c.stream, PollFlags::IN));
        }
        let tick = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(u32::try_from(TICK.as_nanos()).unwrap_or(100_000_000)),
        };
        match poll(&mut fds, Some(&tick)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(format!("poll: {e}")),
        }
        let ready: Vec<PollFlags> = fds.iter().map(PollFd::revents).collect();
        drop(fds);
        if ready.first().is_some_and(|r| !r.is_empty()) {
            accept(&mut s, &listener);
        }
        if ready.get(1).is_some_and(|r| !r.is_empty()) {
            flush_input(&mut s);
            drain_pty(&mut s);
        }
        if ready.get(2).is_some_and(|r| !r.is_empty()) {
            read_conn(&mut s);
        }
    }
    let _ = std::fs::remove_file(&args.socket);
    Ok(0)
}

fn accept(s: &mut State, listener: &UnixListener) {
    if let Ok((stream, _)) = listener.accept() {
        if stream.set_nonblocking(false).is_err()
            || stream.set_write_timeout(Some(SEND_TIMEOUT)).is_err()
        {
            return;
        }
        // a new daemon replaces the old connection
        s.holder.detached();
        s.conn = Some(Conn {
            stream,
            buf: Vec::new(),
        });
    }
}

/// Reads what the PTY has; an error other than "nothing now" means the
/// shell's side is closed.
fn drain_pty(s: &mut State) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match rustix::io::read(&s.master, &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let fx = s.holder.pty_output(buf.get(..n).unwrap_or_default());
                perform(s, fx);
            }
        }
    }
}

fn flush_input(s: &mut State) {
    while !s.pending.is_empty() {
        let (a, _) = s.pending.as_slices();
        match rustix::io::write(&s.master, a) {
            Ok(n) if n > 0 => {
                s.pending.drain(..n);
            }
            _ => return,
        }
    }
}

fn read_conn(s: &mut State) {
    let Some(c) = &mut s.conn else { return };
    let mut buf = [0u8; 16 * 1024];
    let n = match c.stream.read(&mut buf) {
        Ok(0) | Err(_) => {
            drop_conn(s);
            return;
        }
        Ok(n) => n,
    };
    c.buf.extend_from_slice(buf.get(..n).unwrap_or_default());
    loop {
        let Some(c) = &mut s.conn else { return };
        let msg = match take_record(&mut c.buf) {
            Ok(None) => {
                if c.buf.len() > 2 * MAX_RECORD {
                    drop_conn(s);
                }
                return;
            }
            Ok(Some(body)) => ToHolder::decode(&body),
            Err(e) => Err(e),
        };
        match msg {
            Ok(ToHolder::Input { viewer, bytes, .. })
                if s.pending.len() + bytes.len() > MAX_PENDING_INPUT =>
            {
                // the shell is not reading: the frame is not taken, and
                // its viewer sends it again later
                let fx = vec![s.holder.input_busy(viewer)];
                perform(s, fx);
            }
            Ok(m) => {
                let fx = s.holder.message(m);
                perform(s, fx);
            }
            Err(e) => {
                eprintln!(
                    "rvbox {HOLDER_MODE_ARG}: a malformed record from the daemon ({e}): connection closed"
                );
                drop_conn(s);
                return;
            }
        }
    }
}

fn drop_conn(s: &mut State) {
    s.conn = None;
    s.holder.detached();
}

fn perform(s: &mut State, effects: Vec<Effect>) {
    for e in effects {
        match e {
            Effect::Send(m) => {
                let exit = matches!(m, FromHolder::Exited { .. });
                let Some(c) = &mut s.conn else { continue };
                if c.stream.write_all(&m.encode()).is_err() {
                    drop_conn(s);
                } else if exit {
                    s.told = true;
                }
            }
            Effect::WritePty(b) => {
                // room was checked before the frame was taken
                s.pending.extend(b);
                flush_input(s);
            }
            Effect::Resize { cols, rows } => {
                let _ = set_size(&s.master, cols, rows);
            }
            Effect::HangUp => {
                if let Some(pid) =
                    rustix::process::Pid::from_raw(i32::try_from(s.child.id()).unwrap_or(0))
                {
                    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::HUP);
                }
            }
        }
    }
}
