//! The terminal commands (docs/terminals.md): `rvc shell` opens a
//! terminal on a client and shows it, `rvc attach` shows an open one,
//! `rvc terminals` lists them and `rvc terminal close` ends one.
//!
//! Showing a terminal is a thin loop around the pure [`Viewer`]: read an
//! input (a key read from stdin, a stream item, the answer of a call, a
//! signal, the viewer's deadline), hand it to the viewer, then perform
//! every effect it asks for (print, say a status line, open a stream,
//! send a frame of keys or the window size). Each call is one attempt:
//! the viewer decides when to try again, with which request id.
//!
//! rvc's own terminal is in raw mode meanwhile, so Ctrl-C, Ctrl-Z and
//! Ctrl-\ reach the remote foreground process as bytes; the settings are
//! put back on every way out. With stdin not a terminal (a pipe) nothing
//! is changed and the same loop runs; reading then waits while the held
//! keys have no room, rather than refusing them.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime};

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::attach_pty_session_response::Item;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::time::error::Elapsed;
use tonic::{Response, Status, Streaming};

use crate::conn::{CALL_DEADLINE, Control, retryable};
use crate::exit::{self, Failure};
use crate::out::{Format, emit};
use crate::tty::{self, RawMode};
use crate::viewer::{Effect, End, Input, MAX_SIDE, Viewer};

/// Bytes read from stdin at once: a key, or a piece of a paste, is one
/// frame.
const STDIN_READ_BYTES: usize = 1024;
/// Reads of stdin queued for the loop; the reading thread waits beyond.
const STDIN_QUEUE: usize = 4;
/// The window size a terminal opens with when rvc's own is unknown (stdin
/// and stdout are not terminals).
pub(crate) const DEFAULT_SIZE: (u16, u16) = (24, 80);
/// Rows asked per `ListPtySessions` page.
const LIST_PAGE: u32 = 1000;
/// The most terminals `rvc terminals` lists.
const MAX_LISTED: usize = 100_000;
/// The most pages `rvc terminals` reads (a server that kept answering
/// empty pages with a token would otherwise be read forever).
const MAX_LIST_PAGES: usize = MAX_LISTED / LIST_PAGE as usize + 1;

/// What `rvc shell` opens.
#[derive(Debug)]
pub(crate) struct Open {
    /// The client.
    pub(crate) client: String,
    /// The shell; unspecified: the client's default.
    pub(crate) shell_type: wire::ShellType,
    /// The working directory; empty: the client's default.
    pub(crate) cwd: String,
    /// Environment overrides.
    pub(crate) env: BTreeMap<String, String>,
    /// Resource profiles the shell runs under (`rvbox.v1.ProfileFlag`
    /// values); empty: none.
    pub(crate) profile_flags: Vec<i32>,
}

/// The `OpenPtySession` request of `open`, with request id `id`, at
/// `size` (rows, columns).
fn open_request(id: &str, open: Open, size: (u16, u16)) -> wire::OpenPtySessionRequest {
    wire::OpenPtySessionRequest {
        request_id: id.to_owned(),
        client_id: open.client,
        shell_type: open.shell_type as i32,
        cwd: open.cwd,
        env: open.env.into_iter().collect(),
        rows: u32::from(size.0),
        cols: u32::from(size.1),
        profile_flags: open.profile_flags,
    }
}

/// `rvc shell`: opens a terminal with request id `id` (its id), says it,
/// and shows it until it closes or rvc detaches.
pub(crate) async fn shell(
    control: &mut Control,
    id: String,
    mut open: Open,
) -> Result<u8, Failure> {
    let (rows, cols) = tty::window_size().unwrap_or(DEFAULT_SIZE);
    let size = (rows.min(MAX_SIDE), cols.min(MAX_SIDE));
    // the remote programs draw for the local terminal, as ssh does
    if tty::stdin_is_terminal()
        && !open.env.contains_key("TERM")
        && let Ok(term) = std::env::var("TERM")
        && !term.is_empty()
    {
        open.env.insert("TERM".to_owned(), term);
    }
    let req = open_request(&id, open, size);
    let resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.open_pty_session(req).await }
        })
        .await
        .map_err(|f| f.with_request_id(&id))?;
    // the id first, on its own line, before the screen is taken
    eprintln!("{}", resp.pty_session_id);
    view(control, &resp.pty_session_id, 0, Some(size)).await
}

fn attach_request(terminal: &str, from: u64) -> wire::AttachPtySessionRequest {
    wire::AttachPtySessionRequest {
        request_id: String::new(),
        pty_session_id: terminal.to_owned(),
        from_offset: from,
    }
}

type Pending<T> = Option<Pin<Box<dyn Future<Output = T>>>>;
type Answer<T> = Result<Result<Response<T>, Status>, Elapsed>;

/// What woke the loop.
enum Woke {
    Typed(Option<std::io::Result<Vec<u8>>>),
    Item(Result<Option<wire::AttachPtySessionResponse>, Status>),
    Attach(Answer<Streaming<wire::AttachPtySessionResponse>>),
    Write(u64, Answer<wire::WritePtyInputResponse>),
    Resize((u16, u16), Answer<wire::ResizePtySessionResponse>),
    Timeout,
    Signal(Sig),
}

/// `rvc attach`, and `rvc shell` once its terminal is open: shows
/// `terminal` from output offset `from`; returns rvc's exit status.
pub(crate) async fn view(
    control: &mut Control,
    terminal: &str,
    from: u64,
    known_size: Option<(u16, u16)>,
) -> Result<u8, Failure> {
    // the first attach follows the retry rule of every call, so a wrong
    // id or a missing server is said before the screen is taken
    let req = attach_request(terminal, from);
    let first = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.attach_pty_session(req).await }
        })
        .await?;
    let mut signals = Signals::new()?;
    let raw = RawMode::enter()?;
    let mut screen = Screen {
        raw: raw.is_raw(),
        stdout_terminal: tty::stdout_is_terminal(),
        line_start: true,
    };
    if raw.is_raw() {
        screen.notice(&format!(
            "[rvc: attached to {terminal}; ~. detaches, ~? lists the escapes]"
        ));
    }
    let now = Instant::now();
    let mut viewer = Viewer::new(
        terminal,
        from,
        now,
        crate::conn::retry_for(),
        known_size,
        || uuid::Uuid::now_v7().hyphenated().to_string(),
    );
    viewer.handle(now, Input::Attached);
    if let Some((rows, cols)) = tty::window_size() {
        viewer.handle(now, Input::Resized { rows, cols });
    }
    // a keyboard is refused with a bell when the held keys are full; a
    // pipe is read no further until there is room
    let paced = !raw.is_raw();
    let mut keys = read_stdin();
    let mut keys_open = true;
    let mut stream = Some(first);
    let mut attach: Pending<Answer<Streaming<wire::AttachPtySessionResponse>>> = None;
    let mut write: Pending<(u64, Answer<wire::WritePtyInputResponse>)> = None;
    let mut resize: Pending<((u16, u16), Answer<wire::ResizePtySessionResponse>)> = None;
    loop {
        while let Some(effect) = viewer.poll_effect() {
            match effect {
                Effect::Attach { from } => {
                    let mut c = control.lazy_client()?;
                    let req = attach_request(terminal, from);
                    attach = Some(Box::pin(async move {
                        tokio::time::timeout(CALL_DEADLINE, c.attach_pty_session(req)).await
                    }));
                }
                Effect::Write {
                    seq,
                    request_id,
                    data,
                } => {
                    let mut c = control.lazy_client()?;
                    let req = wire::WritePtyInputRequest {
                        request_id,
                        pty_session_id: terminal.to_owned(),
                        data,
                    };
                    write = Some(Box::pin(async move {
                        let r = tokio::time::timeout(CALL_DEADLINE, c.write_pty_input(req)).await;
                        (seq, r)
                    }));
                }
                Effect::Resize {
                    request_id,
                    rows,
                    cols,
                } => {
                    let mut c = control.lazy_client()?;
                    let req = wire::ResizePtySessionRequest {
                        request_id,
                        pty_session_id: terminal.to_owned(),
                        rows: u32::from(rows),
                        cols: u32::from(cols),
                    };
                    resize = Some(Box::pin(async move {
                        let r =
                            tokio::time::timeout(CALL_DEADLINE, c.resize_pty_session(req)).await;
                        ((rows, cols), r)
                    }));
                }
                Effect::Print(bytes) => {
                    if !screen.print(&bytes)? {
                        // stdout was closed (`rvc attach ... | head`):
                        // stop quietly, the terminal keeps running
                        return Ok(0);
                    }
                }
                Effect::Notice(text) => screen.notice(&text),
                Effect::Bell => screen.bell(),
                Effect::Exit(end) => {
                    drop(raw);
                    return status_of(end);
                }
            }
        }
        let deadline = viewer.poll_timeout();
        let read_keys = keys_open && (!paced || viewer.room() >= STDIN_READ_BYTES);
        let woke = tokio::select! {
            r = keys.recv(), if read_keys => Woke::Typed(r),
            r = next_item(&mut stream) => Woke::Item(r),
            r = settle(&mut attach) => Woke::Attach(r),
            (seq, r) = settle(&mut write) => Woke::Write(seq, r),
            (size, r) = settle(&mut resize) => Woke::Resize(size, r),
            () = sleep_until(deadline) => Woke::Timeout,
            s = signals.next() => Woke::Signal(s),
        };
        let input = match woke {
            Woke::Typed(Some(Ok(bytes))) => Input::Typed(bytes),
            Woke::Typed(Some(Err(e))) => {
                keys_open = false;
                screen.notice(&format!(
                    "[rvc: reading stdin failed ({e}); no more keys are read]"
                ));
                Input::StdinEnded
            }
            Woke::Typed(None) => {
                keys_open = false;
                Input::StdinEnded
            }
            Woke::Item(r) => {
                let (input, keep) = item_input(r, control);
                if !keep {
                    stream = None;
                }
                match input {
                    Some(i) => i,
                    None => continue,
                }
            }
            Woke::Attach(r) => {
                attach = None;
                match r {
                    Ok(Ok(resp)) => {
                        stream = Some(resp.into_inner());
                        Input::Attached
                    }
                    Ok(Err(s)) => stream_failure(&s, control),
                    Err(_) => {
                        control.reset();
                        Input::StreamLost {
                            reason: no_answer(),
                        }
                    }
                }
            }
            Woke::Write(seq, r) => {
                write = None;
                match r {
                    Ok(Ok(_)) => Input::Written { seq },
                    Ok(Err(s)) => {
                        let (retry, message) = call_failure(&s, control);
                        Input::WriteFailed {
                            seq,
                            retry,
                            message,
                        }
                    }
                    Err(_) => {
                        control.reset();
                        Input::WriteFailed {
                            seq,
                            retry: true,
                            message: no_answer(),
                        }
                    }
                }
            }
            Woke::Resize((rows, cols), r) => {
                resize = None;
                match r {
                    Ok(Ok(_)) => Input::ResizeDone { rows, cols },
                    Ok(Err(s)) => {
                        let (retry, message) = call_failure(&s, control);
                        Input::ResizeFailed { retry, message }
                    }
                    Err(_) => {
                        control.reset();
                        Input::ResizeFailed {
                            retry: true,
                            message: no_answer(),
                        }
                    }
                }
            }
            Woke::Timeout => Input::Timeout,
            Woke::Signal(Sig::Winch) => match tty::window_size() {
                Some((rows, cols)) => Input::Resized { rows, cols },
                None => continue,
            },
            Woke::Signal(Sig::Stop(n)) => Input::Signal(n),
        };
        viewer.handle(Instant::now(), input);
    }
}

fn no_answer() -> String {
    format!(
        "no answer from the server within {} s",
        CALL_DEADLINE.as_secs()
    )
}

/// The viewer's input for one stream read, and whether the stream goes
/// on.
fn item_input(
    r: Result<Option<wire::AttachPtySessionResponse>, Status>,
    control: &mut Control,
) -> (Option<Input>, bool) {
    match r {
        Ok(Some(resp)) => {
            let input = match resp.item {
                Some(Item::Output(o)) => Some(Input::Output {
                    offset: o.offset,
                    data: o.data,
                }),
                Some(Item::Cut(c)) => Some(Input::Cut {
                    requested_offset: c.requested_offset,
                    ring_start_offset: c.ring_start_offset,
                }),
                Some(Item::Closed(info)) => Some(Input::Closed(Box::new(info))),
                // a member this rvc does not know: skipped
                None => None,
            };
            (input, true)
        }
        Ok(None) => {
            // the server ended the stream without the close (it is
            // stopping): attach again from the printed offset
            control.reset();
            (
                Some(Input::StreamLost {
                    reason: "the server ended the stream".to_owned(),
                }),
                false,
            )
        }
        Err(s) => (Some(stream_failure(&s, control)), false),
    }
}

/// An attach that failed or a stream that broke: another try when the
/// server was unreachable or unavailable, the end otherwise.
fn stream_failure(s: &Status, control: &mut Control) -> Input {
    let f = Failure::from_status(s);
    if retryable(s) {
        control.reset();
        Input::StreamLost {
            reason: f.message().to_owned(),
        }
    } else {
        Input::AttachRefused {
            status: f.status(),
            message: f.message().to_owned(),
        }
    }
}

/// Whether a failed write or resize is worth sending again (with the
/// same request id), and what was said. A full server (its held input
/// for the terminal at the bound) stored nothing and takes it later.
fn call_failure(s: &Status, control: &mut Control) -> (bool, String) {
    let f = Failure::from_status(s);
    if retryable(s) {
        control.reset();
        return (true, f.message().to_owned());
    }
    let full = f.status() == Code::CapacityExhausted.exit_status();
    (full, f.message().to_owned())
}

/// rvc's exit status for the end of a view.
fn status_of(end: End) -> Result<u8, Failure> {
    match end {
        End::Detached => Ok(exit::DETACHED),
        End::Closed(info) => Ok(closed_status(info.exit_result.as_ref())),
        End::Signalled(n) => Ok(u8::try_from(128 + n.clamp(1, 127)).unwrap_or(exit::DETACHED)),
        End::Refused { status, message } => Err(Failure::new(status, message)),
        End::GaveUp => Ok(exit::UNREACHABLE),
    }
}

/// rvc's status for a terminal that closed: its shell's exit status,
/// 128+N after a signal N, and [`exit::TERMINATED`] when it closed with
/// none (an operator's close, the idle timeout, a host restart).
pub(crate) fn closed_status(r: Option<&wire::ExitResult>) -> u8 {
    match r {
        Some(wire::ExitResult {
            exit_code: Some(c), ..
        }) => u8::try_from(c.rem_euclid(256)).unwrap_or(1),
        Some(wire::ExitResult {
            signal_number: Some(n),
            ..
        }) => u8::try_from(128 + (*n).clamp(1, 127)).unwrap_or(exit::TERMINATED),
        Some(r) if r.lifecycle == wire::Lifecycle::Succeeded as i32 => 0,
        _ => exit::TERMINATED,
    }
}

async fn next_item(
    stream: &mut Option<Streaming<wire::AttachPtySessionResponse>>,
) -> Result<Option<wire::AttachPtySessionResponse>, Status> {
    match stream {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

async fn settle<T>(call: &mut Pending<T>) -> T {
    match call {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Reads stdin on a thread of its own (a terminal read blocks) into a
/// bounded queue.
fn read_stdin() -> tokio::sync::mpsc::Receiver<std::io::Result<Vec<u8>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(STDIN_QUEUE);
    std::thread::spawn(move || {
        let mut input = std::io::stdin().lock();
        let mut buf = vec![0u8; STDIN_READ_BYTES];
        loop {
            let read = match std::io::Read::read(&mut input, &mut buf) {
                Ok(0) => break,
                Ok(n) => Ok(buf.get(..n).unwrap_or_default().to_vec()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
            let failed = read.is_err();
            if tx.blocking_send(read).is_err() || failed {
                break;
            }
        }
    });
    rx
}

/// A signal the view reacts to.
#[derive(Debug, Clone, Copy)]
enum Sig {
    /// The local window changed size.
    Winch,
    /// Stop viewing (detach): TERM, HUP, INT (from outside raw mode) or
    /// QUIT, by number.
    Stop(i32),
}

/// The signals a view handles instead of dying with the terminal in raw
/// mode.
struct Signals {
    winch: Signal,
    term: Signal,
    hup: Signal,
    int: Signal,
    quit: Signal,
}

impl Signals {
    fn new() -> Result<Self, Failure> {
        let on = |k: SignalKind, name: &str| {
            signal(k).map_err(|e| Failure::internal(format!("handling {name}: {e}")))
        };
        Ok(Self {
            winch: on(SignalKind::window_change(), "SIGWINCH")?,
            term: on(SignalKind::terminate(), "SIGTERM")?,
            hup: on(SignalKind::hangup(), "SIGHUP")?,
            int: on(SignalKind::interrupt(), "SIGINT")?,
            quit: on(SignalKind::quit(), "SIGQUIT")?,
        })
    }

    async fn next(&mut self) -> Sig {
        tokio::select! {
            Some(()) = self.winch.recv() => Sig::Winch,
            Some(()) = self.term.recv() => Sig::Stop(15),
            Some(()) = self.hup.recv() => Sig::Stop(1),
            Some(()) = self.int.recv() => Sig::Stop(2),
            Some(()) = self.quit.recv() => Sig::Stop(3),
            else => std::future::pending().await,
        }
    }
}

/// rvc's stdout and stderr while a terminal is shown.
struct Screen {
    /// stdin is in raw mode: a line ends with CR LF.
    raw: bool,
    stdout_terminal: bool,
    /// The last byte printed ended a line.
    line_start: bool,
}

impl Screen {
    /// Writes output bytes; `false` when stdout is closed.
    fn print(&mut self, bytes: &[u8]) -> Result<bool, Failure> {
        let mut o = std::io::stdout().lock();
        match o.write_all(bytes).and_then(|()| o.flush()) {
            Ok(()) => {
                if let Some(last) = bytes.last() {
                    self.line_start = *last == b'\n';
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            Err(e) => Err(Failure::internal(format!("writing output: {e}"))),
        }
    }

    /// One status line on stderr, on a line of its own.
    fn notice(&mut self, text: &str) {
        let end = if self.raw { "\r\n" } else { "\n" };
        let body = text.replace("\r\n", "\n").replace('\n', end);
        let before = if self.stdout_terminal && !self.line_start {
            end
        } else {
            ""
        };
        let mut e = std::io::stderr().lock();
        // stderr gone: nothing to tell anyone
        let _ = write!(e, "{before}{body}{end}").and_then(|()| e.flush());
        self.line_start = true;
    }

    fn bell(&mut self) {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(b"\x07").and_then(|()| e.flush());
    }
}

/// `rvc terminals [CLIENT]`: every terminal (of one client), newest
/// first, through every page.
pub(crate) async fn list(
    control: &mut Control,
    client: Option<String>,
    fmt: Format,
) -> Result<u8, Failure> {
    let mut sessions = Vec::new();
    let mut token = String::new();
    let mut cut_short = false;
    for page_no in 0.. {
        let req = wire::ListPtySessionsRequest {
            request_id: String::new(),
            client_id: client.clone(),
            page_size: LIST_PAGE,
            page_token: token.clone(),
        };
        let page = control
            .retrying(|mut c| {
                let req = req.clone();
                async move { c.list_pty_sessions(req).await }
            })
            .await?;
        sessions.extend(page.sessions);
        if page.next_page_token.is_empty() {
            break;
        }
        if sessions.len() >= MAX_LISTED || page_no + 1 >= MAX_LIST_PAGES {
            cut_short = true;
            break;
        }
        token = page.next_page_token;
    }
    sessions.truncate(MAX_LISTED);
    let resp = wire::ListPtySessionsResponse {
        sessions,
        next_page_token: String::new(),
    };
    emit(fmt, "ListPtySessionsResponse", &resp, || {
        crate::render::terminals(&resp.sessions, SystemTime::now())
    })?;
    if cut_short {
        eprintln!(
            "rvc: only the newest {} terminals are listed",
            resp.sessions.len()
        );
    }
    Ok(0)
}

/// `rvc terminal close`: asks the terminal's client to end its shell.
pub(crate) async fn close(
    control: &mut Control,
    request_id: String,
    terminal: String,
    fmt: Format,
) -> Result<u8, Failure> {
    let req = wire::ClosePtySessionRequest {
        request_id,
        pty_session_id: terminal,
    };
    let resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.close_pty_session(req).await }
        })
        .await
        .map_err(|f| f.with_request_id(&req.request_id))?;
    emit(fmt, "ClosePtySessionResponse", &resp, || {
        format!(
            "{}: close requested; its viewers see the close once the client has ended the shell\n",
            resp.pty_session_id
        )
    })?;
    Ok(0)
}

/// The idle time of a terminal as the table shows it: `45s`, `12m`,
/// `3h05m`, `2d04h`.
pub(crate) fn idle_text(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_request_carries_everything_asked() {
        let open = Open {
            client: "web-1".into(),
            shell_type: wire::ShellType::Bash,
            cwd: "/srv".into(),
            env: BTreeMap::from([("TERM".to_owned(), "xterm".to_owned())]),
            profile_flags: vec![
                wire::ProfileFlag::CpuLow as i32,
                wire::ProfileFlag::MemHigh as i32,
            ],
        };
        let r = open_request("01890a5d-ac96-774b-bcce-b302099a8057", open, (40, 120));
        assert_eq!(r.request_id, "01890a5d-ac96-774b-bcce-b302099a8057");
        assert_eq!(r.client_id, "web-1");
        assert_eq!(r.shell_type, wire::ShellType::Bash as i32);
        assert_eq!(r.cwd, "/srv");
        assert_eq!(r.env.get("TERM").map(String::as_str), Some("xterm"));
        assert_eq!((r.rows, r.cols), (40, 120));
        assert_eq!(
            r.profile_flags,
            vec![
                wire::ProfileFlag::CpuLow as i32,
                wire::ProfileFlag::MemHigh as i32
            ]
        );
    }

    #[test]
    fn a_closed_terminal_gives_its_shell_status_or_a_documented_one() {
        let r = |code: Option<i32>, signal: Option<i32>, l: wire::Lifecycle| wire::ExitResult {
            lifecycle: l as i32,
            exit_code: code,
            signal_number: signal,
            signal_name: String::new(),
        };
        assert_eq!(
            closed_status(Some(&r(Some(3), None, wire::Lifecycle::Failed))),
            3
        );
        assert_eq!(
            closed_status(Some(&r(Some(0), None, wire::Lifecycle::Unspecified))),
            0
        );
        assert_eq!(
            closed_status(Some(&r(None, Some(9), wire::Lifecycle::Terminated))),
            137
        );
        assert_eq!(
            closed_status(Some(&r(None, None, wire::Lifecycle::Succeeded))),
            0
        );
        assert_eq!(closed_status(None), exit::TERMINATED);
    }

    #[test]
    fn idle_times_read_short() {
        assert_eq!(idle_text(Duration::from_secs(45)), "45s");
        assert_eq!(idle_text(Duration::from_secs(12 * 60 + 5)), "12m");
        assert_eq!(idle_text(Duration::from_secs(3 * 3600 + 5 * 60)), "3h05m");
        assert_eq!(
            idle_text(Duration::from_secs(2 * 86_400 + 4 * 3600)),
            "2d04h"
        );
    }
}
