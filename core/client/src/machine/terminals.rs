//! Terminals (docs/terminals.md): the client's side of the PTY sessions.
//!
//! Per terminal the core keeps its phase, a copy of the output its holder
//! streamed (an [`OutputRing`] of the holder's size, by byte offset), what
//! it streamed to the server and what the server acknowledged, and the
//! last `input_seq` the holder acknowledged.
//!
//! ```text
//! PtyOpen ─▶ recording ─▶ starting ─▶ persisting ─▶ open ─▶ ending ─▶ closed (kept 24 h)
//!            (opening      (holder     (holder              (closed
//!             record)       starts)     record)              record)
//! restart:  open record ─▶ adopting ─▶ open        opening record ─▶ opening (waits for PtyOpen)
//! ```
//!
//! The contract with the server:
//! - a new `PtyOpen` is checked (shell, resource profiles, working
//!   directory, environment, size; a refusal is PERMANENT and names the
//!   field; a profile this host cannot enforce is UNSUPPORTED), bounded
//!   ([`TerminalLimits::max_open`]; beyond it TRANSIENT), recorded as
//!   opening, its holder started, the holder's record made durable, and
//!   only then answered `PtyOpened` POSITIVE; a repeat answers the same;
//! - nothing is streamed on a connection before the server's
//!   `PtyAttach{from}`; output then goes in pieces of at most
//!   [`PTY_OUTPUT_PIECE_BYTES`] while less than [`PTY_WINDOW_BYTES`] is
//!   unacknowledged, and resumes on `PtyOutputAck`; an offset that left
//!   the ring is answered with the whole ring and a `PtyCut` on its first
//!   piece;
//! - `PtyInput` goes to the holder, whose gate drops repeats; its
//!   acknowledgement goes back as a cumulative `PtyInputAck`, and a frame
//!   already acknowledged is acknowledged again without being relayed;
//! - `PtyClose` hangs the shell up; the end (an operator's close, the
//!   shell's own exit, a lost holder or a restarted host) is recorded and
//!   then reported as `PtyClosed` once the output before it was streamed;
//!   the record answers every later question for
//!   [`CLOSED_TERMINAL_KEEP_MS`];
//! - a message for a terminal this client does not know answers
//!   `PtyClosed` with [`REASON_UNKNOWN`].
//!
//! Output, `PtyOpened` and `PtyClosed` go on the data lane; `PtyInputAck`
//! on the control lane (agent.proto).

use std::collections::{BTreeMap, VecDeque};

use rvbox_domain::error::{Code, DomainError, RetryClass};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::MAX_ENV_OVERRIDES;
use rvbox_domain::validate::{MAX_CWD_BYTES, MAX_ENV_KEY_BYTES};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_terminal::ring::OutputRing;

use super::{ClientCore, Output, Pending};
use crate::ops::{ClientCompletion, ClientOp, ClosedTerminal, SuperviseOp};
use crate::process::{
    Exit, HolderIdentity, HolderLoss, LaunchFailure, TerminalEvent, TerminalProcessEvent,
    TerminalSpec,
};

/// Terminals open (or opening) at once unless configured
/// (`terminals.max_open`).
pub const DEFAULT_MAX_OPEN_TERMINALS: u32 = 16;
/// Output streamed and not yet acknowledged, per terminal (agent.proto:
/// 1 MiB per PTY session).
pub const PTY_WINDOW_BYTES: u64 = 1024 * 1024;
/// Largest `PtyOutput` (agent.proto: 64 KiB).
pub const PTY_OUTPUT_PIECE_BYTES: usize = 64 * 1024;
/// The copy of a terminal's output the client keeps: the holder's ring.
pub const TERMINAL_RING_BYTES: usize = rvbox_terminal::ring::DEFAULT_CAPACITY;
/// How long a closed terminal's record answers the server (24 h).
pub const CLOSED_TERMINAL_KEEP_MS: i64 = 24 * 3600 * 1000;
/// Closed terminals kept in memory at most (the oldest go first).
pub const MAX_CLOSED_TERMINALS: usize = 4096;
/// Input held for a terminal whose holder is not started yet.
pub const MAX_HELD_INPUT_BYTES: usize = 256 * 1024;
/// Largest `PtyInput` (agent.proto: 4 KiB).
pub const MAX_PTY_INPUT_BYTES: usize = 4096;
/// Largest rows or columns (agent.proto).
pub const MAX_TERMINAL_SIZE: u32 = 1000;
/// Expired records are looked for at most this often (wall time).
pub const EXPIRE_EVERY_MS: i64 = 60_000;
/// Closes of closed or unknown terminals answered on one connection (each
/// once: a peer that answers every `PtyClosed` with a close again cannot
/// make the two loop).
pub const MAX_CLOSE_ANSWERS: usize = 4096;
/// Times a closed record is written again after a failure before the
/// end is reported anyway.
pub const MAX_CLOSE_ATTEMPTS: u32 = 3;

/// `PtyClosed.reason` after an operator's close.
pub const REASON_OPERATOR: &str = "closed by an operator";
/// `PtyClosed.reason` after the shell ended by itself.
pub const REASON_EXITED: &str = "shell exited";
/// `PtyClosed.reason` for a terminal this client does not know.
pub const REASON_UNKNOWN: &str = "unknown terminal on this client";
/// `PtyClosed.reason` for a terminal of an earlier boot of the host.
pub const REASON_HOST_RESTARTED: &str = "terminal closed: host restarted";
/// `PtyClosed.reason` for a holder that is gone.
pub const REASON_GONE: &str = "terminal holder is gone";

/// Terminal bounds of the client (`terminals.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalLimits {
    /// Terminals open or opening at once.
    pub max_open: u32,
}

impl Default for TerminalLimits {
    fn default() -> Self {
        Self {
            max_open: DEFAULT_MAX_OPEN_TERMINALS,
        }
    }
}

/// What the store holds for one terminal, for
/// [`ClientCore::restore_terminals`].
#[derive(Debug, Clone, PartialEq)]
pub struct RestoredTerminal {
    /// The terminal.
    pub terminal: Uuid7,
    /// The shell it opened.
    pub resolved_shell: wire::ShellType,
    /// The checked open request.
    pub open: wire::PtyOpen,
    /// When its opening record was written (wall time).
    pub created_ms: i64,
    /// Its holder, once started and recorded.
    pub holder: Option<HolderIdentity>,
    /// How it ended, once closed.
    pub closed: Option<ClosedTerminal>,
}

/// The phase of one terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminalPhase {
    /// Restored as opening: its holder may never have started; a new
    /// `PtyOpen` starts one.
    Opening,
    /// The opening record is being made durable.
    Recording,
    /// The holder is starting.
    Starting,
    /// The holder runs; its record is being made durable.
    Persisting,
    /// Open: the holder's record is durable and `PtyOpened` answered.
    Open,
    /// Restored open: the recorded holder is being adopted.
    Adopting,
    /// Ended: the closed record is being made durable.
    Ending,
    /// Closed: the record is durable.
    Closed,
}

/// Counters of the terminal concern (metrics and the simulator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TerminalStats {
    /// Terminals opened (`PtyOpened` POSITIVE, first time).
    pub opened: u64,
    /// Opens refused (checks or the bound).
    pub refused: u64,
    /// Holders that could not be started.
    pub start_failures: u64,
    /// Holders adopted after a restart.
    pub adopted: u64,
    /// Holders lost (gone, or of an earlier boot).
    pub lost: u64,
    /// Terminals closed (record durable).
    pub closed: u64,
    /// `PtyClosed` answers for an unknown terminal.
    pub unknown: u64,
    /// Input frames relayed to a holder.
    pub inputs_relayed: u64,
    /// Input frames already acknowledged, acknowledged again.
    pub input_repeats: u64,
    /// Input frames dropped because the held input was full (the server
    /// sends them again after a reconnect).
    pub held_input_dropped: u64,
    /// Output bytes streamed.
    pub output_bytes: u64,
    /// Cut markers sent.
    pub output_cuts: u64,
    /// Times a terminal's window filled.
    pub window_pauses: u64,
    /// Output acknowledgements beyond what was streamed (ignored).
    pub stray_acks: u64,
    /// Terminal events for no terminal, or out of phase (ignored).
    pub stray_events: u64,
    /// Output that did not continue the copy (the copy restarts there).
    pub output_gaps: u64,
    /// Closed records that could not be written.
    pub close_failures: u64,
    /// Closes of a closed or unknown terminal not answered again on the
    /// same connection.
    pub close_repeats: u64,
    /// Ends held back until the server's attach on a new connection
    /// (output the server may lack goes first).
    pub closes_awaiting_attach: u64,
}

/// What one connection streams of a terminal's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stream {
    /// The offset of the next byte to send.
    next: u64,
    /// The server acknowledged output up to here.
    acked: u64,
    /// The furthest offset streamed since the attach.
    high: u64,
    /// The window is full (counted once per pause).
    paused: bool,
}

impl Stream {
    fn from(offset: u64) -> Self {
        Self {
            next: offset,
            acked: offset,
            high: offset,
            paused: false,
        }
    }

    /// Bytes that may still go before the window is full. An
    /// acknowledgement of before a re-attach may lie past `next`: nothing
    /// is then in flight.
    fn room(&self) -> u64 {
        PTY_WINDOW_BYTES.saturating_sub(self.next.saturating_sub(self.acked))
    }
}

#[derive(Debug, Clone)]
pub(super) struct Term {
    phase: TerminalPhase,
    resolved_shell: wire::ShellType,
    /// The checked open request (its size follows resizes until start).
    open: wire::PtyOpen,
    /// The normalized working directory.
    cwd: String,
    created_ms: i64,
    /// The holder's output since this daemon attached to it.
    ring: Option<OutputRing>,
    stream: Option<Stream>,
    input_acked: u64,
    /// Input received before the holder was asked to start.
    held: VecDeque<(u64, Vec<u8>)>,
    held_bytes: usize,
    close_requested: bool,
    /// Why the terminal is being closed by this client (not the operator).
    abandon_reason: Option<String>,
    closed: Option<ClosedTerminal>,
    close_attempts: u32,
    /// `PtyClosed` went on this connection.
    closed_sent: bool,
}

/// Why a closed terminal's `PtyClosed` waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndWait {
    /// Output before the end still goes on this connection's stream.
    Output,
    /// Not attached on this connection: the server may lack output the
    /// copy holds, so the end waits for the attach every connection
    /// brings for a terminal the server has open (sent before it, the
    /// copy would go and its bytes with it).
    Attach,
}

impl Term {
    /// Whether (and why) its `PtyClosed` must wait.
    fn end_waits(&self) -> Option<EndWait> {
        let closed = self.closed.as_ref()?;
        match (&self.stream, &self.ring) {
            (Some(s), Some(ring)) if s.next < ring.end().min(closed.final_offset) => {
                Some(EndWait::Output)
            }
            (None, Some(ring)) if ring.end() > 0 => Some(EndWait::Attach),
            _ => None,
        }
    }
}

/// The terminal concern's state inside the client core.
#[derive(Debug, Default)]
pub(super) struct Terminals {
    terms: BTreeMap<Uuid7, Term>,
    stats: TerminalStats,
    last_expiry_ms: Option<i64>,
    /// The store holds records to expire that memory does not.
    expire_store: bool,
    /// Closed or unknown terminals whose close this connection answered.
    close_answered: std::collections::BTreeSet<Uuid7>,
}

impl Terminals {
    /// Terminals holding a slot: every one not closed, and a closed one
    /// whose output copy is still kept for the server.
    fn slots(&self) -> usize {
        self.terms
            .values()
            .filter(|t| match t.phase {
                TerminalPhase::Opening => false,
                TerminalPhase::Closed => t.ring.is_some(),
                _ => true,
            })
            .count()
    }
}

fn invalid(field: &str, reason: impl AsRef<str>) -> DomainError {
    DomainError::new(Code::InvalidArgument, reason).with_field(field)
}

fn exit_result(lifecycle: wire::Lifecycle, exit: Option<Exit>) -> wire::ExitResult {
    let mut r = wire::ExitResult {
        lifecycle: lifecycle as i32,
        ..Default::default()
    };
    match exit {
        Some(Exit::Code(c)) => r.exit_code = Some(c),
        Some(Exit::Signal(s)) => {
            r.signal_number = Some(s);
            r.signal_name = super::signals::signal_name(s).into();
        }
        None => {}
    }
    r
}

/// An open request checked: the shell, working directory and size.
struct CheckedOpen {
    shell: wire::ShellType,
    cwd: String,
}

impl ClientCore {
    // ---- queries -----------------------------------------------------------

    /// The terminal concern's counters.
    #[must_use]
    pub fn terminal_stats(&self) -> TerminalStats {
        self.terminals.stats
    }

    /// The phase of a terminal.
    #[must_use]
    pub fn terminal_phase(&self, terminal: &Uuid7) -> Option<TerminalPhase> {
        self.terminals.terms.get(terminal).map(|t| t.phase)
    }

    /// Terminals holding a slot (open, opening, or closed with output not
    /// yet delivered).
    #[must_use]
    pub fn open_terminals(&self) -> usize {
        self.terminals.slots()
    }

    /// Terminals known (closed records included).
    #[must_use]
    pub fn terminal_count(&self) -> usize {
        self.terminals.terms.len()
    }

    /// The last `input_seq` a terminal's holder acknowledged.
    #[must_use]
    pub fn terminal_input_acked(&self, terminal: &Uuid7) -> Option<u64> {
        self.terminals.terms.get(terminal).map(|t| t.input_acked)
    }

    // ---- restart -----------------------------------------------------------

    /// The terminals the store holds, at startup: each open one is
    /// adopted (its holder proves itself, or the terminal closes), each
    /// closed one answers for a day, each opening one waits for the
    /// server's `PtyOpen` again.
    pub fn restore_terminals(&mut self, restored: Vec<RestoredTerminal>, wall_ms: i64) {
        let mut closed: Vec<(i64, Uuid7)> = Vec::new();
        for r in restored {
            let phase = match (&r.closed, &r.holder) {
                (Some(c), _) => {
                    if c.closed_at_ms.saturating_add(CLOSED_TERMINAL_KEEP_MS) <= wall_ms {
                        self.terminals.expire_store = true;
                        continue;
                    }
                    closed.push((c.closed_at_ms, r.terminal));
                    TerminalPhase::Closed
                }
                (None, Some(h)) => {
                    self.push(Output::Supervise(SuperviseOp::AdoptTerminal {
                        terminal: r.terminal,
                        holder: Box::new(h.clone()),
                    }));
                    TerminalPhase::Adopting
                }
                (None, None) => {
                    if r.created_ms.saturating_add(CLOSED_TERMINAL_KEEP_MS) <= wall_ms {
                        self.terminals.expire_store = true;
                        continue;
                    }
                    TerminalPhase::Opening
                }
            };
            let cwd = self.resolve_cwd(&r.open.cwd).unwrap_or_default();
            self.terminals.terms.insert(
                r.terminal,
                Term {
                    phase,
                    resolved_shell: r.resolved_shell,
                    open: r.open,
                    cwd,
                    created_ms: r.created_ms,
                    ring: None,
                    stream: None,
                    input_acked: 0,
                    held: VecDeque::new(),
                    held_bytes: 0,
                    close_requested: false,
                    abandon_reason: None,
                    closed: r.closed,
                    close_attempts: 0,
                    closed_sent: false,
                },
            );
        }
        // the newest closed records are kept when there are too many
        closed.sort();
        let excess = closed.len().saturating_sub(MAX_CLOSED_TERMINALS);
        for (_, id) in closed.into_iter().take(excess) {
            self.terminals.terms.remove(&id);
        }
    }

    // ---- the server's messages --------------------------------------------

    /// A terminal message of the server.
    pub(super) fn pty_message(&mut self, now_ms: u64, payload: Payload) {
        // a record past its day answers no more
        self.expire_terminals(self.wall);
        match payload {
            Payload::PtyOpen(p) => self.pty_open(p),
            Payload::PtyInput(m) => self.pty_input(now_ms, m),
            Payload::PtyResize(m) => self.pty_resize(now_ms, &m),
            Payload::PtyAttach(m) => self.pty_attach(now_ms, &m),
            Payload::PtyOutputAck(m) => self.pty_output_ack(now_ms, &m),
            Payload::PtyDetach(m) => {
                if let Some(id) = self.known_or_answer(now_ms, &m.pty_session_id)
                    && let Some(t) = self.terminals.terms.get_mut(&id)
                {
                    t.stream = None;
                }
            }
            Payload::PtyClose(m) => self.pty_close(now_ms, &m.pty_session_id),
            _ => {}
        }
    }

    /// The id of a terminal this client knows; `None` (after answering
    /// an unknown one, or closing the session for a malformed id)
    /// otherwise.
    fn known_or_answer(&mut self, now_ms: u64, text: &str) -> Option<Uuid7> {
        let Ok(id) = Uuid7::parse("pty_session_id", text) else {
            self.protocol_error(now_ms);
            return None;
        };
        if self.terminals.terms.contains_key(&id) {
            Some(id)
        } else {
            self.terminals.stats.unknown += 1;
            self.send_data(Payload::PtyClosed(wire::PtyClosed {
                pty_session_id: text.to_owned(),
                exit_result: Some(exit_result(wire::Lifecycle::Interrupted, None)),
                final_offset: 0,
                reason: REASON_UNKNOWN.into(),
            }));
            None
        }
    }

    /// Whether `id` is closed (then `PtyClosed` was answered again, or
    /// follows once its record is durable).
    fn answered_closed(&mut self, id: Uuid7) -> bool {
        match self.terminals.terms.get(&id).map(|t| t.phase) {
            Some(TerminalPhase::Closed) => {
                // answered again, unless output before the end must go
                // first (then the end follows it)
                match self.terminals.terms.get(&id).and_then(Term::end_waits) {
                    Some(EndWait::Attach) => self.terminals.stats.closes_awaiting_attach += 1,
                    Some(EndWait::Output) => {}
                    None => self.send_closed(id),
                }
                true
            }
            Some(TerminalPhase::Ending) => true,
            _ => false,
        }
    }

    fn send_data(&mut self, payload: Payload) {
        if self.link.send_data(payload).is_ok() {
            self.drain_link_sends();
        }
    }

    fn send_opened(
        &mut self,
        id: &str,
        outcome: wire::AcceptOutcome,
        error: Option<DomainError>,
        shell: wire::ShellType,
    ) {
        self.send_data(Payload::PtyOpened(wire::PtyOpened {
            pty_session_id: id.to_owned(),
            outcome: outcome as i32,
            error: error.map(|e| e.to_detail()),
            resolved_shell: shell as i32,
        }));
    }

    fn refuse_open(&mut self, id: &str, outcome: wire::AcceptOutcome, error: DomainError) {
        self.terminals.stats.refused += 1;
        self.send_opened(id, outcome, Some(error), wire::ShellType::Unspecified);
    }

    fn resolve_cwd(&self, requested: &str) -> Result<String, DomainError> {
        if requested.len() > MAX_CWD_BYTES {
            return Err(DomainError::new(
                Code::TooLarge,
                format!("is longer than {MAX_CWD_BYTES} bytes"),
            )
            .with_field("pty_open.cwd"));
        }
        if requested.contains('\0') {
            return Err(invalid("pty_open.cwd", "contains a NUL byte"));
        }
        let policy = &self.config.policy;
        let requested = if requested.is_empty() {
            policy.default_cwd.as_str()
        } else {
            requested
        };
        let Some(cwd) = crate::accept::normalize(requested) else {
            return Err(invalid(
                "pty_open.cwd",
                "is not an absolute path below the root",
            ));
        };
        if !policy
            .cwd_roots
            .iter()
            .any(|root| crate::accept::under_root(&cwd, root))
        {
            return Err(invalid(
                "pty_open.cwd",
                "is not under an allowed working-directory root",
            ));
        }
        Ok(cwd)
    }

    /// The checks of a `PtyOpen` (agent.proto), each refusal naming its
    /// field.
    fn check_open(&self, p: &wire::PtyOpen) -> Result<CheckedOpen, DomainError> {
        let policy = &self.config.policy;
        let shell = match wire::ShellType::try_from(p.shell_type) {
            Ok(wire::ShellType::Unspecified) => policy.default_shell,
            Ok(s) => s,
            Err(_) => {
                return Err(invalid(
                    "pty_open.shell_type",
                    format!("unknown shell type value {}", p.shell_type),
                ));
            }
        };
        if !policy.shells.contains(&shell) || !self.config.shell_paths.contains_key(&(shell as i32))
        {
            return Err(DomainError::new(
                Code::Unsupported,
                format!("{} is not configured on this host", shell.as_str_name()),
            )
            .with_field("pty_open.shell_type"));
        }
        // the profiles as for a command: a valid set, each enforceable here
        rvbox_domain::validate::check_profile_flags_of("pty_open.profile_flags", &p.profile_flags)?;
        crate::accept::check_enforceable(policy, "pty_open.profile_flags", &p.profile_flags)?;
        let cwd = self.resolve_cwd(&p.cwd)?;
        if p.env.len() > MAX_ENV_OVERRIDES {
            return Err(DomainError::new(
                Code::TooLarge,
                format!(
                    "{} environment overrides; the limit is {MAX_ENV_OVERRIDES}",
                    p.env.len()
                ),
            )
            .with_field("pty_open.env"));
        }
        for (key, value) in &p.env {
            if key.is_empty() || key.len() > MAX_ENV_KEY_BYTES || key.contains(['=', '\0']) {
                return Err(invalid(
                    "pty_open.env",
                    format!(
                        "environment key {key:?} must be 1..={MAX_ENV_KEY_BYTES} bytes without '=' or NUL"
                    ),
                ));
            }
            if value.contains('\0') {
                // the value itself is never echoed: it may be a secret
                return Err(invalid(
                    "pty_open.env",
                    format!("the value of environment key {key:?} contains a NUL byte"),
                ));
            }
        }
        for (field, n) in [("pty_open.rows", p.rows), ("pty_open.cols", p.cols)] {
            if !(1..=MAX_TERMINAL_SIZE).contains(&n) {
                return Err(invalid(
                    field,
                    format!("is {n}; it must be 1..={MAX_TERMINAL_SIZE}"),
                ));
            }
        }
        Ok(CheckedOpen { shell, cwd })
    }

    fn full(open: usize, max: usize) -> DomainError {
        DomainError::new(
            Code::CapacityExhausted,
            format!(
                "this client has {open} terminals open, the most terminals.max_open ({max}) allows"
            ),
        )
        .with_retry(RetryClass::Transient)
    }

    fn pty_open(&mut self, p: wire::PtyOpen) {
        let Ok(id) = Uuid7::parse("pty_open.pty_session_id", &p.pty_session_id) else {
            self.refuse_open(
                &p.pty_session_id,
                wire::AcceptOutcome::Permanent,
                invalid("pty_open.pty_session_id", "is not a canonical UUIDv7"),
            );
            return;
        };
        if let Some(t) = self.terminals.terms.get(&id) {
            match t.phase {
                TerminalPhase::Closed | TerminalPhase::Ending => {
                    let _ = self.answered_closed(id);
                }
                TerminalPhase::Open => {
                    let shell = t.resolved_shell;
                    self.send_opened(
                        &p.pty_session_id,
                        wire::AcceptOutcome::Positive,
                        None,
                        shell,
                    );
                }
                TerminalPhase::Opening => {
                    // its holder may never have started: start one now (a
                    // stale one in the terminal's cgroup is reclaimed
                    // first)
                    let max = usize::try_from(self.config.terminals.max_open).unwrap_or(usize::MAX);
                    let open = self.terminals.slots();
                    if open >= max {
                        self.refuse_open(
                            &p.pty_session_id,
                            wire::AcceptOutcome::Transient,
                            Self::full(open, max),
                        );
                        return;
                    }
                    match self.check_open(&p) {
                        Err(e) => {
                            self.refuse_open(&p.pty_session_id, wire::AcceptOutcome::Permanent, e);
                        }
                        Ok(c) => {
                            if let Some(t) = self.terminals.terms.get_mut(&id) {
                                t.resolved_shell = c.shell;
                                t.cwd = c.cwd;
                                t.open = p;
                            }
                            self.start_holder(id);
                        }
                    }
                }
                // the answer follows the step in flight
                _ => {}
            }
            return;
        }
        let checked = match self.check_open(&p) {
            Ok(c) => c,
            Err(e) => {
                self.refuse_open(&p.pty_session_id, wire::AcceptOutcome::Permanent, e);
                return;
            }
        };
        let max = usize::try_from(self.config.terminals.max_open).unwrap_or(usize::MAX);
        let open = self.terminals.slots();
        if open >= max {
            self.refuse_open(
                &p.pty_session_id,
                wire::AcceptOutcome::Transient,
                Self::full(open, max),
            );
            return;
        }
        self.terminals.terms.insert(
            id,
            Term {
                phase: TerminalPhase::Recording,
                resolved_shell: checked.shell,
                open: p.clone(),
                cwd: checked.cwd,
                created_ms: self.wall,
                ring: None,
                stream: None,
                input_acked: 0,
                held: VecDeque::new(),
                held_bytes: 0,
                close_requested: false,
                abandon_reason: None,
                closed: None,
                close_attempts: 0,
                closed_sent: false,
            },
        );
        self.store(
            ClientOp::TerminalOpening {
                terminal: id,
                resolved_shell: checked.shell,
                open: Box::new(p),
            },
            Pending::TermOpening(id),
        );
    }

    /// Asks the supervisor for the holder, then relays what was held.
    fn start_holder(&mut self, id: Uuid7) {
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        let Some(shell_path) = self.config.shell_paths.get(&(t.resolved_shell as i32)) else {
            // checked at open; a configuration without it refuses for good
            let reason = format!(
                "{} is not configured on this host",
                t.resolved_shell.as_str_name()
            );
            self.start_failed(id, &LaunchFailure::Permanent(reason));
            return;
        };
        t.phase = TerminalPhase::Starting;
        let spec = TerminalSpec {
            terminal: id,
            shell: t.resolved_shell,
            shell_path: shell_path.clone(),
            cwd: t.cwd.clone(),
            env: t
                .open
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            rows: u16::try_from(t.open.rows).unwrap_or(24),
            cols: u16::try_from(t.open.cols).unwrap_or(80),
            limits: super::launch::limits_of(&self.config.profiles, &t.open.profile_flags),
        };
        let held: Vec<(u64, Vec<u8>)> = t.held.drain(..).collect();
        t.held_bytes = 0;
        let close = t.close_requested;
        self.push(Output::Supervise(SuperviseOp::StartTerminal(Box::new(
            spec,
        ))));
        for (seq, bytes) in held {
            self.terminals.stats.inputs_relayed += 1;
            self.push(Output::Supervise(SuperviseOp::TerminalInput {
                terminal: id,
                seq,
                bytes,
            }));
        }
        if close {
            self.push(Output::Supervise(SuperviseOp::CloseTerminal(id)));
        }
    }

    fn pty_input(&mut self, now_ms: u64, m: wire::PtyInput) {
        let Some(id) = self.known_or_answer(now_ms, &m.pty_session_id) else {
            return;
        };
        if self.answered_closed(id) {
            return;
        }
        if m.input_seq == 0 || m.data.is_empty() || m.data.len() > MAX_PTY_INPUT_BYTES {
            self.protocol_error(now_ms);
            return;
        }
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        if m.input_seq <= t.input_acked {
            // written already: acknowledged again, never written twice
            let acked = t.input_acked;
            self.terminals.stats.input_repeats += 1;
            self.send_input_ack(&m.pty_session_id, acked);
            return;
        }
        match t.phase {
            TerminalPhase::Opening | TerminalPhase::Recording => {
                if t.held_bytes + m.data.len() > MAX_HELD_INPUT_BYTES {
                    // not acknowledged: the server sends it again after a
                    // reconnect
                    self.terminals.stats.held_input_dropped += 1;
                    return;
                }
                t.held_bytes += m.data.len();
                t.held.push_back((m.input_seq, m.data));
            }
            _ => {
                self.terminals.stats.inputs_relayed += 1;
                self.push(Output::Supervise(SuperviseOp::TerminalInput {
                    terminal: id,
                    seq: m.input_seq,
                    bytes: m.data,
                }));
            }
        }
    }

    fn send_input_ack(&mut self, id: &str, seq: u64) {
        let ack = Payload::PtyInputAck(wire::PtyInputAck {
            pty_session_id: id.to_owned(),
            input_seq: seq,
        });
        // agent.proto: the control lane
        self.send(ack);
    }

    fn pty_resize(&mut self, now_ms: u64, m: &wire::PtyResize) {
        let Some(id) = self.known_or_answer(now_ms, &m.pty_session_id) else {
            return;
        };
        if self.answered_closed(id) {
            return;
        }
        let ok = |n: u32| (1..=MAX_TERMINAL_SIZE).contains(&n);
        if !ok(m.rows) || !ok(m.cols) {
            self.protocol_error(now_ms);
            return;
        }
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        t.open.rows = m.rows;
        t.open.cols = m.cols;
        if !matches!(t.phase, TerminalPhase::Opening | TerminalPhase::Recording) {
            self.push(Output::Supervise(SuperviseOp::ResizeTerminal {
                terminal: id,
                rows: u16::try_from(m.rows).unwrap_or(24),
                cols: u16::try_from(m.cols).unwrap_or(80),
            }));
        }
    }

    fn pty_attach(&mut self, now_ms: u64, m: &wire::PtyAttach) {
        let Some(id) = self.known_or_answer(now_ms, &m.pty_session_id) else {
            return;
        };
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        match t.phase {
            TerminalPhase::Ending => return,
            TerminalPhase::Closed if t.ring.is_none() => {
                self.send_closed(id);
                return;
            }
            TerminalPhase::Opening => {
                // the server has it open, but no holder of it was ever
                // recorded here
                self.end_terminal(id, wire::Lifecycle::Interrupted, None, REASON_GONE.into());
                return;
            }
            _ => {}
        }
        t.stream = Some(Stream::from(m.from_offset));
        t.closed_sent = false;
        self.pump_output(id);
    }

    fn pty_output_ack(&mut self, now_ms: u64, m: &wire::PtyOutputAck) {
        let Some(id) = self.known_or_answer(now_ms, &m.pty_session_id) else {
            return;
        };
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        let Some(s) = t.stream.as_mut() else {
            return;
        };
        if m.offset > s.high {
            // past what this attach streamed (an acknowledgement of before
            // it): the window is not opened by it
            self.terminals.stats.stray_acks += 1;
            return;
        }
        s.acked = s.acked.max(m.offset);
        let acked = s.acked;
        if t.phase == TerminalPhase::Closed
            && t.closed_sent
            && t.closed.as_ref().is_some_and(|c| acked >= c.final_offset)
        {
            // everything before the end is recorded: the copy goes
            t.ring = None;
            return;
        }
        self.pump_output(id);
    }

    fn pty_close(&mut self, now_ms: u64, text: &str) {
        if let Ok(id) = Uuid7::parse("pty_session_id", text)
            && self
                .terminals
                .terms
                .get(&id)
                .is_none_or(|t| matches!(t.phase, TerminalPhase::Closed | TerminalPhase::Ending))
        {
            // answered once per connection: a close that answers the
            // answer would otherwise go back and forth for ever
            if self.terminals.close_answered.contains(&id)
                || self.terminals.close_answered.len() >= MAX_CLOSE_ANSWERS
            {
                self.terminals.stats.close_repeats += 1;
                return;
            }
            self.terminals.close_answered.insert(id);
        }
        let Some(id) = self.known_or_answer(now_ms, text) else {
            return;
        };
        if self.answered_closed(id) {
            return;
        }
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        if t.close_requested && t.abandon_reason.is_none() {
            return;
        }
        t.close_requested = true;
        t.abandon_reason = None;
        match t.phase {
            // asked before the holder is asked for: it never starts
            TerminalPhase::Recording => {}
            TerminalPhase::Opening => {
                self.end_terminal(id, wire::Lifecycle::Cancelled, None, REASON_OPERATOR.into());
            }
            _ => self.push(Output::Supervise(SuperviseOp::CloseTerminal(id))),
        }
    }

    // ---- output ------------------------------------------------------------

    /// Streams what the window allows of a terminal's output, then its
    /// `PtyClosed` once everything before its end went.
    fn pump_output(&mut self, id: Uuid7) {
        let mut out: Vec<Payload> = Vec::new();
        if let Some(t) = self.terminals.terms.get_mut(&id)
            && let (Some(ring), Some(s)) = (t.ring.as_ref(), t.stream.as_mut())
            && s.next < ring.end()
        {
            if s.room() == 0 {
                if !s.paused {
                    s.paused = true;
                    self.terminals.stats.window_pauses += 1;
                }
            } else if let Ok(replay) = ring.since(s.next) {
                s.paused = false;
                let mut cut = (replay.cut > 0).then_some(wire::PtyCut {
                    requested_offset: s.next,
                    ring_start_offset: replay.offset,
                });
                if cut.is_some() {
                    self.terminals.stats.output_cuts += 1;
                    // the bytes cut are not in flight
                    s.acked = s.acked.max(replay.offset);
                    s.high = s.high.max(replay.offset);
                }
                s.next = replay.offset;
                let mut rest = replay.bytes.as_slice();
                while !rest.is_empty() {
                    let room = usize::try_from(s.room()).unwrap_or(usize::MAX);
                    if room == 0 {
                        s.paused = true;
                        self.terminals.stats.window_pauses += 1;
                        break;
                    }
                    let take = rest.len().min(PTY_OUTPUT_PIECE_BYTES).min(room);
                    let (piece, tail) = rest.split_at(take);
                    out.push(Payload::PtyOutput(wire::PtyOutput {
                        pty_session_id: id.to_string(),
                        offset: s.next,
                        data: piece.to_vec(),
                        cut: cut.take(),
                    }));
                    s.next += take as u64;
                    s.high = s.high.max(s.next);
                    self.terminals.stats.output_bytes += take as u64;
                    rest = tail;
                }
                debug_assert!(s.next.saturating_sub(s.acked) <= PTY_WINDOW_BYTES);
            }
        }
        for p in out {
            self.send_data(p);
        }
        self.maybe_report_closed(id);
    }

    /// Output from the holder, copied into the terminal's ring.
    fn holder_output(&mut self, id: Uuid7, offset: u64, bytes: &[u8], cut: u64) {
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            self.terminals.stats.stray_events += 1;
            return;
        };
        let ring = t
            .ring
            .get_or_insert_with(|| OutputRing::new(TERMINAL_RING_BYTES));
        let end = ring.end();
        if offset > end {
            // bytes never reached this daemon (the holder's ring had lost
            // them, or its replay starts past the copy): the copy restarts
            // here, and a stream behind it gets a cut marker
            if cut == 0 && end > 0 {
                self.terminals.stats.output_gaps += 1;
            }
            *ring = OutputRing::resumed_at(TERMINAL_RING_BYTES, offset);
        }
        let len = bytes.len() as u64;
        let skip = ring.end().saturating_sub(offset);
        if skip < len {
            let from = usize::try_from(skip).unwrap_or(usize::MAX);
            ring.push(bytes.get(from..).unwrap_or_default());
        }
        self.pump_output(id);
    }

    // ---- the end -----------------------------------------------------------

    /// Reports the end once the record is durable and the output before
    /// it streamed (when a stream is attached).
    fn maybe_report_closed(&mut self, id: Uuid7) {
        let Some(t) = self.terminals.terms.get(&id) else {
            return;
        };
        if t.phase != TerminalPhase::Closed || t.closed_sent {
            return;
        }
        if t.closed.is_none() {
            return;
        }
        if let Some(wait) = t.end_waits() {
            if wait == EndWait::Attach {
                self.terminals.stats.closes_awaiting_attach += 1;
            }
            return;
        }
        self.send_closed(id);
    }

    fn send_closed(&mut self, id: Uuid7) {
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        let Some(c) = &t.closed else {
            return;
        };
        let payload = Payload::PtyClosed(wire::PtyClosed {
            pty_session_id: id.to_string(),
            exit_result: Some(c.exit_result.clone()),
            final_offset: c.final_offset,
            reason: c.reason.clone(),
        });
        // the copy goes once the server has every byte before the end
        let delivered = t.ring.as_ref().is_none_or(|r| r.end() == 0)
            || t.stream.is_some_and(|s| s.acked >= c.final_offset);
        if self.link.send_data(payload).is_ok() {
            self.drain_link_sends();
            if let Some(t) = self.terminals.terms.get_mut(&id) {
                t.closed_sent = true;
                if delivered {
                    t.ring = None;
                }
            }
        }
    }

    /// Ends a terminal: its closed record is made durable, then reported.
    fn end_terminal(
        &mut self,
        id: Uuid7,
        lifecycle: wire::Lifecycle,
        exit: Option<(Exit, u64)>,
        reason: String,
    ) {
        let wall = self.wall;
        let Some(t) = self.terminals.terms.get_mut(&id) else {
            return;
        };
        if matches!(t.phase, TerminalPhase::Ending | TerminalPhase::Closed) {
            return;
        }
        // the holder's own count when it told one, else what reached the
        // copy
        let copied = t.ring.as_ref().map_or(0, OutputRing::end);
        let final_offset = exit.map_or(copied, |(_, f)| f.max(copied));
        let exit = exit.map(|(e, _)| e);
        let closed = ClosedTerminal {
            exit_result: exit_result(lifecycle, exit),
            final_offset,
            reason,
            closed_at_ms: wall,
        };
        t.phase = TerminalPhase::Ending;
        t.closed = Some(closed.clone());
        t.held.clear();
        t.held_bytes = 0;
        self.store(
            ClientOp::TerminalClosed {
                terminal: id,
                closed: Box::new(closed),
            },
            Pending::TermClosed(id),
        );
    }

    fn start_failed(&mut self, id: Uuid7, f: &LaunchFailure) {
        self.terminals.stats.start_failures += 1;
        let (outcome, reason) = match f {
            LaunchFailure::Permanent(r) => (wire::AcceptOutcome::Permanent, r.clone()),
            LaunchFailure::Transient(r) => (wire::AcceptOutcome::Transient, r.clone()),
        };
        let error = if outcome == wire::AcceptOutcome::Permanent {
            DomainError::new(
                Code::Unsupported,
                format!("the terminal could not be started: {reason}"),
            )
        } else {
            DomainError::new(
                Code::Unavailable,
                format!("the terminal could not be started: {reason}"),
            )
            .with_retry(RetryClass::Transient)
        };
        self.refuse_open(&id.to_string(), outcome, error);
        self.end_terminal(
            id,
            wire::Lifecycle::Rejected,
            None,
            format!("the terminal could not be started: {reason}"),
        );
    }

    // ---- the supervisor's events -------------------------------------------

    /// One terminal event of the supervisor.
    pub(super) fn terminal_event(&mut self, ev: TerminalProcessEvent) {
        let id = ev.terminal;
        let Some(phase) = self.terminals.terms.get(&id).map(|t| t.phase) else {
            self.terminals.stats.stray_events += 1;
            return;
        };
        match ev.event {
            TerminalEvent::Started(holder) => {
                if phase != TerminalPhase::Starting {
                    self.terminals.stats.stray_events += 1;
                    return;
                }
                if let Some(t) = self.terminals.terms.get_mut(&id) {
                    t.phase = TerminalPhase::Persisting;
                }
                // its output is kept from the start; the server sees it
                // once it attaches
                self.push(Output::Supervise(SuperviseOp::AttachTerminal {
                    terminal: id,
                    from: 0,
                }));
                self.store(
                    ClientOp::TerminalOpened {
                        terminal: id,
                        holder: Box::new(holder),
                    },
                    Pending::TermOpened(id),
                );
            }
            TerminalEvent::Failed(f) => {
                if phase == TerminalPhase::Starting {
                    self.start_failed(id, &f);
                } else {
                    self.terminals.stats.stray_events += 1;
                }
            }
            TerminalEvent::Adopted => {
                if phase != TerminalPhase::Adopting {
                    self.terminals.stats.stray_events += 1;
                    return;
                }
                self.terminals.stats.adopted += 1;
                if let Some(t) = self.terminals.terms.get_mut(&id) {
                    t.phase = TerminalPhase::Open;
                }
                // the holder's whole ring: what the server asks for next
                // is served from the copy
                self.push(Output::Supervise(SuperviseOp::AttachTerminal {
                    terminal: id,
                    from: 0,
                }));
            }
            TerminalEvent::Output { offset, bytes, cut } => {
                self.holder_output(id, offset, &bytes, cut);
            }
            TerminalEvent::InputAcked { seq } => {
                let Some(t) = self.terminals.terms.get_mut(&id) else {
                    return;
                };
                if seq == 0 {
                    return;
                }
                t.input_acked = t.input_acked.max(seq);
                let acked = t.input_acked;
                self.send_input_ack(&id.to_string(), acked);
            }
            TerminalEvent::Exited { exit, final_offset } => {
                let Some(t) = self.terminals.terms.get(&id) else {
                    return;
                };
                debug_assert!(
                    t.ring.as_ref().is_none_or(|r| r.end() <= final_offset),
                    "output past the shell's final offset"
                );
                let (lifecycle, reason) = if let Some(r) = &t.abandon_reason {
                    (wire::Lifecycle::Terminated, r.clone())
                } else if t.close_requested {
                    (wire::Lifecycle::Terminated, REASON_OPERATOR.to_owned())
                } else if exit == Exit::Code(0) {
                    (wire::Lifecycle::Succeeded, REASON_EXITED.to_owned())
                } else {
                    (wire::Lifecycle::Failed, REASON_EXITED.to_owned())
                };
                self.end_terminal(id, lifecycle, Some((exit, final_offset)), reason);
            }
            TerminalEvent::Lost { loss, detail: _ } => {
                if matches!(phase, TerminalPhase::Ending | TerminalPhase::Closed) {
                    return;
                }
                self.terminals.stats.lost += 1;
                let reason = match loss {
                    HolderLoss::HostRestarted => REASON_HOST_RESTARTED,
                    HolderLoss::Gone => REASON_GONE,
                };
                self.end_terminal(id, wire::Lifecycle::Interrupted, None, reason.into());
            }
        }
    }

    // ---- store completions -------------------------------------------------

    pub(super) fn terminal_completed(&mut self, pending: Pending, result: ClientCompletion) {
        let done = result == ClientCompletion::Done;
        let reason = match &result {
            ClientCompletion::Failed(r) => r.clone(),
            _ => "the client store answered something else".to_owned(),
        };
        match pending {
            Pending::TermOpening(id) => {
                let Some(t) = self.terminals.terms.get(&id) else {
                    return;
                };
                if t.phase != TerminalPhase::Recording {
                    return;
                }
                if !done {
                    self.terminals.terms.remove(&id);
                    self.refuse_open(
                        &id.to_string(),
                        wire::AcceptOutcome::Transient,
                        DomainError::new(
                            Code::Unavailable,
                            format!("the client could not record the terminal: {reason}"),
                        )
                        .with_retry(RetryClass::Transient),
                    );
                } else if t.close_requested {
                    self.end_terminal(id, wire::Lifecycle::Cancelled, None, REASON_OPERATOR.into());
                } else {
                    self.start_holder(id);
                }
            }
            Pending::TermOpened(id) => {
                let Some(t) = self.terminals.terms.get_mut(&id) else {
                    return;
                };
                if t.phase != TerminalPhase::Persisting {
                    return;
                }
                t.phase = TerminalPhase::Open;
                let shell = t.resolved_shell;
                if done {
                    self.terminals.stats.opened += 1;
                    self.send_opened(&id.to_string(), wire::AcceptOutcome::Positive, None, shell);
                } else {
                    // a holder without a durable record could not be found
                    // again: it is hung up, and the open refused
                    let why =
                        format!("the client could not record the terminal's holder: {reason}");
                    if !t.close_requested {
                        self.push(Output::Supervise(SuperviseOp::CloseTerminal(id)));
                    }
                    if let Some(t) = self.terminals.terms.get_mut(&id) {
                        t.close_requested = true;
                        t.abandon_reason = Some(why.clone());
                    }
                    self.refuse_open(
                        &id.to_string(),
                        wire::AcceptOutcome::Transient,
                        DomainError::new(Code::Unavailable, why).with_retry(RetryClass::Transient),
                    );
                }
            }
            Pending::TermClosed(id) => {
                let Some(t) = self.terminals.terms.get_mut(&id) else {
                    return;
                };
                if t.phase != TerminalPhase::Ending {
                    return;
                }
                if !done {
                    self.terminals.stats.close_failures += 1;
                    t.close_attempts += 1;
                    if t.close_attempts < MAX_CLOSE_ATTEMPTS
                        && let Some(c) = t.closed.clone()
                    {
                        self.store(
                            ClientOp::TerminalClosed {
                                terminal: id,
                                closed: Box::new(c),
                            },
                            Pending::TermClosed(id),
                        );
                        return;
                    }
                }
                // durable (or given up on: the end is still reported; a
                // restart then finds its holder gone)
                t.phase = TerminalPhase::Closed;
                self.terminals.stats.closed += 1;
                self.maybe_report_closed(id);
            }
            Pending::TermExpire => {}
            _ => {}
        }
    }

    // ---- the connection and time -------------------------------------------

    /// The session ended: nothing streams until the next one's attach.
    pub(super) fn terminals_down(&mut self) {
        self.terminals.close_answered.clear();
        for t in self.terminals.terms.values_mut() {
            t.stream = None;
            t.closed_sent = false;
        }
    }

    /// Forgets closed records older than a day (and opening ones never
    /// opened), at most once per [`EXPIRE_EVERY_MS`].
    pub(super) fn expire_terminals(&mut self, wall_ms: i64) {
        if self
            .terminals
            .last_expiry_ms
            .is_some_and(|t| wall_ms < t.saturating_add(EXPIRE_EVERY_MS))
        {
            return;
        }
        self.terminals.last_expiry_ms = Some(wall_ms);
        let before = wall_ms.saturating_sub(CLOSED_TERMINAL_KEEP_MS);
        let old: Vec<Uuid7> = self
            .terminals
            .terms
            .iter()
            .filter(|(_, t)| match t.phase {
                TerminalPhase::Closed => {
                    t.ring.is_none() && t.closed.as_ref().is_some_and(|c| c.closed_at_ms <= before)
                }
                TerminalPhase::Opening => t.created_ms <= before,
                _ => false,
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &old {
            self.terminals.terms.remove(id);
        }
        // the bound: the oldest closed records go first
        let mut closed: Vec<(i64, Uuid7)> = self
            .terminals
            .terms
            .iter()
            .filter(|(_, t)| t.phase == TerminalPhase::Closed && t.ring.is_none())
            .map(|(id, t)| (t.closed.as_ref().map_or(0, |c| c.closed_at_ms), *id))
            .collect();
        closed.sort();
        let excess = closed.len().saturating_sub(MAX_CLOSED_TERMINALS);
        for (_, id) in closed.into_iter().take(excess) {
            self.terminals.terms.remove(&id);
        }
        if old.is_empty() && excess == 0 && !std::mem::take(&mut self.terminals.expire_store) {
            return;
        }
        self.store(
            ClientOp::TerminalsExpire {
                closed_before_ms: before,
            },
            Pending::TermExpire,
        );
    }
}
