//! Process trees in the simulator, behind the real [`Supervisor`] trait the
//! client runtime drives. Each released tree runs a seeded program over
//! simulated time: it writes byte streams on stdout and stderr in chunks
//! of varied size (now and then a burst far past the raw-backlog
//! watermarks and the send windows), a pipe reader now and then discards
//! what it could not hand over (counted, as the real reader does), it
//! reads stdin and may wait for its end, it may ignore TERM (so that only
//! KILL ends it), and it exits with a chosen status or dies of a chosen
//! signal.
//!
//! Everything a tree really did goes into the shared [`ProcessLog`]: the
//! bytes it wrote on each stream, the stdin writes it got and the ends of
//! file it read, the signals delivered to it, and how it ended. The log
//! is the simulator's observation (it survives daemon crashes); the
//! oracles compare it with what the server stores and serves.
//!
//! Trees die with their daemon: after a crash nothing of them runs on,
//! and reaping finds them gone.
//!
//! Terminals are modelled with the real holder (`rvbox_terminal::holder`,
//! its output ring and input gate) over a model shell that echoes every
//! byte written to its PTY. Holders outlive their daemon, as real ones
//! do: a restarted daemon adopts them with the token it recorded. The
//! [`TerminalRecord`] of each terminal in the shared log is what its PTY
//! really got (every input frame and byte written, once each) and
//! produced (every output byte, by offset), for the oracles.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rvbox_client_core::process::{
    CommandProcessEvent, Exit, HolderIdentity, HolderLoss, LaunchFailure, LaunchIdentity,
    LaunchSpec, ProcessEvent, Supervision, TerminalEvent, TerminalProcessEvent, TerminalSpec,
};
use rvbox_client_core::terminal::holder::{Effect, Holder, Identity};
use rvbox_client_core::terminal::local::{FromHolder, ToHolder};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_supervisor::{OrphanOutcome, Supervisor, SupervisorError};

use crate::rng::SimRng;

/// Largest read a pipe reader hands over (the real reader's 64 KiB).
pub const READ_CHUNK: usize = 64 * 1024;
/// Most commands the log keeps (a run creates far fewer).
pub const MAX_LOGGED_COMMANDS: usize = 100_000;
/// Most bytes one tree writes (bursts included); a bound, not a target.
pub const MAX_TREE_BYTES: u64 = 16 * 1024 * 1024;
/// Most terminals the log keeps.
pub const MAX_LOGGED_TERMINALS: usize = 10_000;
/// Most bytes a terminal's record keeps of its input and of its output
/// (past it the record says it overflowed).
pub const MAX_TERMINAL_LOG_BYTES: usize = 16 * 1024 * 1024;
/// The model holder's output ring (the real holder's default).
pub const MODEL_RING_BYTES: usize = rvbox_client_core::terminal::ring::DEFAULT_CAPACITY;
/// Input frames a model shell takes before its holder answers `Busy`
/// (never: the model PTY takes everything at once).
const MODEL_VIEWERS: usize = rvbox_client_core::terminal::input::DEFAULT_VIEWERS;

/// The shape of the programs a supervisor runs (from the host's
/// configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Programs {
    /// Most ordinary writes of one tree.
    pub max_chunks: u32,
    /// Largest ordinary write.
    pub max_chunk: u32,
    /// Longest pause between two writes (ms).
    pub max_step_ms: u64,
    /// Chance (per mille) a tree exits non-zero.
    pub fail_permille: u32,
    /// Chance a tree writes one burst past the watermarks.
    pub burst_permille: u32,
    /// Largest burst (bytes).
    pub max_burst: u64,
    /// Chance a tree reads stdin to its end before it exits.
    pub stdin_permille: u32,
    /// Chance a tree ignores TERM.
    pub ignore_term_permille: u32,
    /// Chance a launch fails transiently before it is ready (fork or
    /// file limits): the client puts the command back and tries again.
    pub transient_launch_permille: u32,
    /// Chance a tree is chatty first: many short lines, each its own
    /// read, more of them than one spool read-back returns (a verbose
    /// program that a long partition leaves with thousands of pinned
    /// events). Drawn from a stream of its own, so a run with no chatty
    /// tree draws exactly what it did without them.
    pub chatty_permille: u32,
    /// Most lines of a chatty tree (at least [`CHATTY_MIN_LINES`]).
    pub max_chatty_lines: u32,
    /// Longest pause between two lines of a chatty tree (ms).
    pub max_chatty_step_ms: u64,
}

/// Fewest lines of a chatty tree: past one spool read-back
/// (`rvbox_client_store::spool::MAX_READ_EVENTS`, 1,024 events).
pub const CHATTY_MIN_LINES: u32 = 1_100;

impl Default for Programs {
    fn default() -> Self {
        Self {
            max_chunks: 4,
            max_chunk: 2_000,
            max_step_ms: 2_000,
            fail_permille: 100,
            burst_permille: 40,
            max_burst: 3 << 20,
            stdin_permille: 250,
            ignore_term_permille: 250,
            transient_launch_permille: 40,
            chatty_permille: 50,
            max_chatty_lines: 4_000,
            max_chatty_step_ms: 8,
        }
    }
}

/// How a tree ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Its root exited (or died of a signal).
    Exit(Exit),
    /// Its daemon crashed under it: nothing of it went on.
    WithDaemon,
    /// Its daemon stopped in order: TERM, then KILL if it ignored TERM.
    Stopped,
    /// Released, aborted before it ran anything.
    Aborted,
}

/// What one command's tree really did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessRecord {
    /// The host (client index) that ran it.
    pub host: u32,
    /// Chatty lines its program began with (0: not chatty).
    pub chatty_lines: u32,
    /// Times it was released (user code ran); must be at most 1.
    pub starts: u32,
    /// Bytes it wrote on stdout (index 0) and stderr (index 1), whether or
    /// not a pipe reader handed them over.
    pub wrote: [Vec<u8>; 2],
    /// Bytes a pipe reader discarded (counted into a loss record).
    pub dropped: [u64; 2],
    /// Stdin writes it got, by write sequence, in the order it got them.
    pub stdin_writes: Vec<u64>,
    /// Stdin bytes it read, in order.
    pub stdin: Vec<u8>,
    /// Ends of file it read on stdin.
    pub eofs: u32,
    /// Signals delivered to it while it ran (the orderly stop's included).
    pub signals: Vec<wire::SignalKind>,
    /// Those of `signals` the daemon's orderly stop sent.
    pub stop_signals: Vec<wire::SignalKind>,
    /// How it ended (`None` while it runs).
    pub ended: Option<Ended>,
    /// Signals delivered to it whose result its daemon had not made
    /// durable when it died (the stored results may miss them).
    pub signals_unrecorded: u32,
    /// It ended on its own while a daemon ran that died before the end
    /// was durable in its spool (`INTERRUPTED` is the honest outcome).
    pub end_unrecorded: bool,
}

/// What one terminal's PTY really got and produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminalRecord {
    /// The host (client index) whose holder ran it.
    pub host: u32,
    /// Holders started for it (an orphan of a crash before its record was
    /// durable is reclaimed by the next start).
    pub starts: u32,
    /// Adoptions of its holder by a restarted daemon.
    pub adoptions: u32,
    /// Input frames written to the PTY, by `input_seq`, in order: each
    /// acknowledged frame appears exactly once.
    pub input_seqs: Vec<u64>,
    /// Every input byte written to the PTY, in order.
    pub written: Vec<u8>,
    /// Every input frame written to the PTY, in order: its `input_seq`
    /// and its bytes.
    pub frames: Vec<(u64, Vec<u8>)>,
    /// Every output byte the PTY produced; output offset `n` is index `n`.
    pub output: Vec<u8>,
    /// How its shell ended (`None` while it runs).
    pub ended: Option<Exit>,
    /// It was hung up (a close).
    pub hung_up: bool,
    /// `written` or `output` reached [`MAX_TERMINAL_LOG_BYTES`].
    pub truncated: bool,
    /// The holder told a daemon how its shell ended.
    pub exit_told: bool,
    /// A daemon that was told the end died before it made the terminal's
    /// closed record durable: nobody can know how the shell ended any
    /// more ("terminal holder is gone" is the honest end).
    pub exit_unrecorded: bool,
    /// Holders started while an earlier holder of the terminal still ran
    /// (the earlier one is reclaimed first; `output` restarts with the new
    /// holder's).
    pub replaced: u32,
    /// Window sizes the PTY got, in order (columns, rows).
    pub sizes: Vec<(u16, u16)>,
    /// A daemon died after its holder told the end (the holder exits
    /// then): output the server had not recorded went with the daemon's
    /// copy, and the recording ends in a cut (docs/terminals.md, "Limits").
    pub copy_lost_after_end: bool,
}

/// Every tree's record, shared between the supervisor (which writes it)
/// and the world's oracles (which read it).
#[derive(Debug, Default)]
pub struct ProcessLog {
    records: BTreeMap<Uuid7, ProcessRecord>,
    terminals: BTreeMap<Uuid7, TerminalRecord>,
    /// A record could not be kept (the bound): the run must fail.
    pub overflowed: bool,
}

impl ProcessLog {
    /// Every terminal's record.
    #[must_use]
    pub fn terminals(&self) -> &BTreeMap<Uuid7, TerminalRecord> {
        &self.terminals
    }

    /// The record of terminal `id`.
    #[must_use]
    pub fn terminal(&self, id: &Uuid7) -> Option<&TerminalRecord> {
        self.terminals.get(id)
    }

    fn terminal_entry(&mut self, id: Uuid7, host: u32) -> Option<&mut TerminalRecord> {
        if !self.terminals.contains_key(&id) && self.terminals.len() >= MAX_LOGGED_TERMINALS {
            self.overflowed = true;
            return None;
        }
        let r = self.terminals.entry(id).or_default();
        r.host = host;
        Some(r)
    }

    /// The records.
    #[must_use]
    pub fn records(&self) -> &BTreeMap<Uuid7, ProcessRecord> {
        &self.records
    }

    /// The record of `issue`.
    #[must_use]
    pub fn get(&self, issue: &Uuid7) -> Option<&ProcessRecord> {
        self.records.get(issue)
    }

    fn entry(&mut self, issue: Uuid7, host: u32) -> Option<&mut ProcessRecord> {
        if !self.records.contains_key(&issue) && self.records.len() >= MAX_LOGGED_COMMANDS {
            self.overflowed = true;
            return None;
        }
        let r = self.records.entry(issue).or_default();
        r.host = host;
        Some(r)
    }
}

/// The log, shared.
pub type SharedLog = Arc<Mutex<ProcessLog>>;

fn log(shared: &SharedLog) -> std::sync::MutexGuard<'_, ProcessLog> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn stream_index(s: wire::OutputStream) -> usize {
    usize::from(s == wire::OutputStream::Stderr)
}

#[derive(Debug, Clone)]
struct Tree {
    next_at: u64,
    /// Short lines still to write before the ordinary writes.
    chatty_left: u32,
    writes_left: u32,
    burst: Option<u64>,
    exit: Exit,
    ignore_term: bool,
    waits_for_eof: bool,
    stdin_closed: bool,
    exited: bool,
}

/// A model terminal holder: the real holder's decisions over a shell that
/// echoes its input.
#[derive(Debug)]
struct ModelHolder {
    holder: Holder,
    identity: HolderIdentity,
    /// The daemon it is attached to told the exit: the holder is gone.
    gone: bool,
    /// Its shell ended by itself (a hang-up after it changes nothing).
    shell_ended: bool,
}

/// The holders of one host, shared by every daemon that runs there (they
/// outlive it).
type SharedHolders = Arc<Mutex<BTreeMap<Uuid7, ModelHolder>>>;

fn holders(shared: &SharedHolders) -> std::sync::MutexGuard<'_, BTreeMap<Uuid7, ModelHolder>> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What one daemon's connection to a holder carries besides the holder
/// (the real supervisor's I/O thread).
#[derive(Debug, Clone, Default)]
struct HolderLink {
    /// The offset after the last output byte handed over.
    forwarded: u64,
    /// Bytes cut before the next output (from a replay).
    cut: u64,
}

/// The simulated supervisor of one host.
#[derive(Debug, Clone)]
pub struct SimSupervisor {
    host: u32,
    rng: SimRng,
    programs: Programs,
    prepared: BTreeMap<Uuid7, ()>,
    trees: BTreeMap<Uuid7, Tree>,
    /// Trees that ended on their own since this daemon started.
    ended_here: BTreeSet<Uuid7>,
    /// Signals delivered since this daemon started, per tree.
    signalled_here: BTreeMap<Uuid7, u32>,
    ready: VecDeque<CommandProcessEvent>,
    now: u64,
    wall_epoch_ms: i64,
    log: SharedLog,
    /// Releases since the last [`Self::take_started`].
    started: Vec<Uuid7>,
    /// Lines of text written so far (they are numbered).
    lines: u64,
    /// The chatty trees' own stream: whether a tree is chatty, and all of
    /// its chatty lines.
    chatty: SimRng,
    /// Chatty lines written so far (numbered apart from `lines`).
    chatty_lines: u64,
    /// The host's terminal holders.
    holders: SharedHolders,
    /// The holders this daemon drives.
    links: BTreeMap<Uuid7, HolderLink>,
    /// Terminal events not yet taken.
    terminal_ready: VecDeque<TerminalProcessEvent>,
    /// Holders started on this host so far (their pids).
    holder_pids: u32,
    /// Terminals whose holder was started while an earlier one still ran,
    /// since the last [`Self::take_replaced`].
    replaced: Vec<Uuid7>,
}

impl SimSupervisor {
    /// A supervisor of host `host` writing into `log`.
    #[must_use]
    pub fn new(
        host: u32,
        rng: SimRng,
        programs: Programs,
        wall_epoch_ms: i64,
        log: SharedLog,
    ) -> Self {
        // a stream of its own that leaves `rng` where it is
        let chatty = SimRng::new(rng.clone().next_u64() ^ 0x6368_6174_7479_5f31);
        Self {
            host,
            chatty,
            chatty_lines: 0,
            rng,
            programs,
            prepared: BTreeMap::new(),
            trees: BTreeMap::new(),
            ended_here: BTreeSet::new(),
            signalled_here: BTreeMap::new(),
            ready: VecDeque::new(),
            now: 0,
            wall_epoch_ms,
            log,
            started: Vec::new(),
            lines: 0,
            holders: Arc::new(Mutex::new(BTreeMap::new())),
            links: BTreeMap::new(),
            terminal_ready: VecDeque::new(),
            holder_pids: 0,
            replaced: Vec::new(),
        }
    }

    fn wall(&self) -> i64 {
        self.wall_epoch_ms
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
    }

    fn push(&mut self, issue: Uuid7, event: ProcessEvent) {
        self.ready.push_back(CommandProcessEvent { issue, event });
    }

    /// The commands released since the last call.
    pub fn take_started(&mut self) -> Vec<Uuid7> {
        std::mem::take(&mut self.started)
    }

    /// Whether process or terminal events wait to be taken.
    #[must_use]
    pub fn has_events(&self) -> bool {
        !self.ready.is_empty() || !self.terminal_ready.is_empty()
    }

    /// The next time a tree does something.
    #[must_use]
    pub fn next_due(&self) -> Option<u64> {
        self.trees
            .values()
            .filter(|t| !t.exited)
            .map(|t| t.next_at)
            .min()
    }

    /// The daemon died: every tree dies with it, every event not taken is
    /// lost (the pipes and their contents went with the process).
    pub fn daemon_died(
        &mut self,
        ended_durable: &BTreeSet<Uuid7>,
        results_durable: &BTreeMap<Uuid7, u32>,
        terminals_closed: &BTreeSet<Uuid7>,
    ) {
        let mut l = log(&self.log);
        let host = self.host;
        for (id, r) in &mut l.terminals {
            if r.host == host && r.exit_told {
                r.copy_lost_after_end = true;
                if !terminals_closed.contains(id) {
                    // told the end, and died before the end was durable
                    r.exit_unrecorded = true;
                }
            }
        }
        for issue in self.trees.keys() {
            if let Some(r) = l.entry(*issue, self.host)
                && r.ended.is_none()
            {
                r.ended = Some(Ended::WithDaemon);
            }
        }
        for (issue, n) in std::mem::take(&mut self.signalled_here) {
            let recorded = results_durable.get(&issue).copied().unwrap_or(0);
            if n > recorded
                && let Some(r) = l.entry(issue, self.host)
            {
                // delivered, and the daemon died before the result was
                // durable: the result is lost with it
                r.signals_unrecorded = r.signals_unrecorded.saturating_add(n - recorded);
            }
        }
        for issue in std::mem::take(&mut self.ended_here) {
            if !ended_durable.contains(&issue)
                && let Some(r) = l.entry(issue, self.host)
            {
                // it ended while this daemon ran, and the daemon died
                // before the end was durable: nobody can know how it ended
                r.end_unrecorded = true;
            }
        }
        drop(l);
        self.trees.clear();
        self.prepared.clear();
        self.ready.clear();
        // the holders go on, detached, keeping their output in their rings
        for h in holders(&self.holders).values_mut() {
            h.holder.detached();
        }
        self.links.clear();
        self.terminal_ready.clear();
    }

    fn terminal_push(&mut self, terminal: Uuid7, event: TerminalEvent) {
        self.terminal_ready
            .push_back(TerminalProcessEvent { terminal, event });
    }

    /// Performs a model holder's effects as its process would, and hands
    /// what it says to this daemon as terminal events (as the real
    /// supervisor's thread does).
    fn perform(&mut self, id: Uuid7, effects: Vec<Effect>) {
        let mut queue: VecDeque<Effect> = effects.into();
        while let Some(e) = queue.pop_front() {
            match e {
                Effect::WritePty(bytes) => {
                    // the model shell echoes every byte it reads
                    let echo = {
                        let mut hs = holders(&self.holders);
                        let Some(h) = hs.get_mut(&id) else { continue };
                        h.holder.pty_output(&bytes)
                    };
                    self.log_output(id, &bytes);
                    queue.extend(echo);
                }
                Effect::Resize { cols, rows } => {
                    if let Some(r) = log(&self.log).terminal_entry(id, self.host) {
                        r.sizes.push((cols, rows));
                    }
                }
                Effect::HangUp => {
                    let fx = {
                        let mut hs = holders(&self.holders);
                        let Some(h) = hs.get_mut(&id) else { continue };
                        if h.shell_ended {
                            // the shell is gone already: nothing to hang up
                            continue;
                        }
                        h.shell_ended = true;
                        h.holder.shell_exited(true, 1)
                    };
                    if let Some(r) = log(&self.log).terminal_entry(id, self.host) {
                        r.hung_up = true;
                        r.ended = Some(Exit::Signal(1));
                    }
                    queue.extend(fx);
                }
                Effect::Send(m) => self.told(id, m),
            }
        }
    }

    fn log_output(&self, id: Uuid7, bytes: &[u8]) {
        if let Some(r) = log(&self.log).terminal_entry(id, self.host) {
            if r.output.len() + bytes.len() > MAX_TERMINAL_LOG_BYTES {
                r.truncated = true;
            } else {
                r.output.extend_from_slice(bytes);
            }
        }
    }

    /// A message of a holder to this daemon.
    fn told(&mut self, id: Uuid7, m: FromHolder) {
        let Some(link) = self.links.get_mut(&id) else {
            return; // no daemon of this host drives it now
        };
        match m {
            FromHolder::Replay { cut, .. } => link.cut = cut,
            FromHolder::Output { offset, bytes } => {
                let cut = std::mem::take(&mut link.cut);
                link.forwarded = link
                    .forwarded
                    .max(offset.saturating_add(bytes.len() as u64));
                self.terminal_push(id, TerminalEvent::Output { offset, bytes, cut });
            }
            FromHolder::InputAck { acked, .. } => {
                if acked > 0 {
                    self.terminal_push(id, TerminalEvent::InputAcked { seq: acked });
                }
            }
            FromHolder::Exited { signal, value } => {
                let final_offset = link.forwarded;
                self.links.remove(&id);
                if let Some(r) = log(&self.log).terminal_entry(id, self.host) {
                    r.exit_told = true;
                }
                if let Some(h) = holders(&self.holders).get_mut(&id) {
                    // told: the holder exits
                    h.gone = true;
                }
                let exit = if signal {
                    Exit::Signal(value)
                } else {
                    Exit::Code(value)
                };
                self.terminal_push(id, TerminalEvent::Exited { exit, final_offset });
            }
            FromHolder::OffsetAhead { end, .. } => {
                let fx = holders(&self.holders)
                    .get_mut(&id)
                    .map(|h| h.holder.message(ToHolder::Attach { from: end }))
                    .unwrap_or_default();
                self.perform(id, fx);
            }
            FromHolder::Proof { .. } => {}
        }
    }

    /// The model holder of `id` driven by this daemon, or why not.
    fn driven(&self, id: &Uuid7) -> Result<(), SupervisorError> {
        let live = holders(&self.holders).get(id).is_some_and(|h| !h.gone);
        if live && self.links.contains_key(id) {
            Ok(())
        } else {
            Err(SupervisorError::UnknownTerminal(*id))
        }
    }

    fn message(&mut self, id: &Uuid7, m: ToHolder) -> Result<(), SupervisorError> {
        self.driven(id)?;
        let fx = holders(&self.holders)
            .get_mut(id)
            .map(|h| h.holder.message(m))
            .unwrap_or_default();
        self.perform(*id, fx);
        Ok(())
    }

    /// The shell of terminal `id` writes `bytes` by itself (a prompt, a
    /// program's output), as the world's workload decides.
    pub fn terminal_writes(&mut self, id: &Uuid7, bytes: &[u8]) {
        let fx = {
            let mut hs = holders(&self.holders);
            let Some(h) = hs.get_mut(id).filter(|h| !h.gone) else {
                return;
            };
            if h.shell_ended {
                // an ended shell writes nothing more
                return;
            }
            h.holder.pty_output(bytes)
        };
        self.log_output(*id, bytes);
        self.perform(*id, fx);
    }

    /// Terminals whose holder was started while an earlier one still ran,
    /// since the last call.
    pub fn take_replaced(&mut self) -> Vec<Uuid7> {
        std::mem::take(&mut self.replaced)
    }

    /// Whether terminal `id` has a holder on this host whose shell still
    /// runs.
    #[must_use]
    pub fn shell_runs(&self, id: &Uuid7) -> bool {
        holders(&self.holders)
            .get(id)
            .is_some_and(|h| !h.gone && !h.shell_ended)
    }

    /// The shell of terminal `id` ends by itself with `code`.
    pub fn terminal_exits(&mut self, id: &Uuid7, code: i32) {
        let fx = {
            let mut hs = holders(&self.holders);
            let Some(h) = hs.get_mut(id).filter(|h| !h.gone && !h.shell_ended) else {
                return;
            };
            h.shell_ended = true;
            h.holder.shell_exited(false, code)
        };
        if let Some(r) = log(&self.log).terminal_entry(*id, self.host) {
            r.ended = Some(Exit::Code(code));
        }
        self.perform(*id, fx);
    }

    /// The host's terminal holders still running.
    #[must_use]
    pub fn live_holders(&self) -> Vec<Uuid7> {
        holders(&self.holders)
            .iter()
            .filter(|(_, h)| !h.gone)
            .map(|(id, _)| *id)
            .collect()
    }

    /// A write of `len` seeded bytes on `stream`, handed over in reads of
    /// at most [`READ_CHUNK`]; now and then a reader discards one read
    /// instead (counted exactly).
    fn write(&mut self, issue: Uuid7, stream: wire::OutputStream, len: usize) {
        let bytes = if self.rng.chance(400) {
            // text that compresses well and never repeats (so every run
            // of it has one place in the stream)
            let mut text = Vec::with_capacity(len + 64);
            while text.len() < len {
                self.lines = self.lines.wrapping_add(1);
                text.extend_from_slice(
                    format!("sim output line {} of host {}\n", self.lines, self.host).as_bytes(),
                );
            }
            text.truncate(len);
            text
        } else {
            self.rng.bytes(len)
        };
        let mut reads = Vec::new();
        for part in bytes.chunks(READ_CHUNK) {
            let dropped = self.rng.chance(15);
            reads.push((part.to_vec(), dropped));
        }
        self.deliver(issue, stream, &bytes, reads);
        // now and then the diagnostics sampler reports a change of the
        // tree's progress state
        if self.rng.chance(20) {
            let suspected_hung = self.rng.chance(500);
            self.push(
                issue,
                ProcessEvent::Diagnostics(wire::Diagnostics {
                    snapshot: None,
                    suspected_hung,
                    no_progress_since: None,
                }),
            );
        }
    }

    /// One short numbered line of a chatty tree, its own read (drawn from
    /// the chatty stream only).
    fn chatty_line(&mut self, issue: Uuid7) {
        self.chatty_lines = self.chatty_lines.wrapping_add(1);
        let stream = if self.chatty.chance(900) {
            wire::OutputStream::Stdout
        } else {
            wire::OutputStream::Stderr
        };
        let line =
            format!("chatty line {} of host {}\n", self.chatty_lines, self.host).into_bytes();
        let dropped = self.chatty.chance(3);
        self.deliver(issue, stream, &line, vec![(line.clone(), dropped)]);
    }

    /// Records `bytes` as written by the tree and hands `reads` (their
    /// split into reads, each handed over or discarded) to the runtime.
    fn deliver(
        &mut self,
        issue: Uuid7,
        stream: wire::OutputStream,
        bytes: &[u8],
        reads: Vec<(Vec<u8>, bool)>,
    ) {
        let observed_ms = self.wall();
        {
            let mut l = log(&self.log);
            if let Some(r) = l.entry(issue, self.host) {
                let i = stream_index(stream);
                if let Some(w) = r.wrote.get_mut(i) {
                    w.extend_from_slice(bytes);
                }
                for (part, dropped) in &reads {
                    if *dropped && let Some(d) = r.dropped.get_mut(i) {
                        *d = d.saturating_add(part.len() as u64);
                    }
                }
            }
        }
        for (part, dropped) in reads {
            if dropped {
                self.push(
                    issue,
                    ProcessEvent::Dropped {
                        stream,
                        raw_bytes: part.len() as u64,
                        first_ms: observed_ms,
                        last_ms: observed_ms,
                    },
                );
            } else {
                self.push(
                    issue,
                    ProcessEvent::Output {
                        stream,
                        observed_ms,
                        bytes: part,
                    },
                );
            }
        }
    }

    fn end(&mut self, issue: Uuid7, exit: Exit) {
        if let Some(t) = self.trees.get_mut(&issue) {
            if t.exited {
                return;
            }
            t.exited = true;
        }
        if let Some(r) = log(&self.log).entry(issue, self.host) {
            r.ended = Some(Ended::Exit(exit));
        }
        self.trees.remove(&issue);
        self.ended_here.insert(issue);
        self.push(issue, ProcessEvent::Exited(exit));
        self.push(issue, ProcessEvent::Drained { incomplete: vec![] });
    }

    /// The time now, for what the runtime asks of the trees (a release
    /// starts its program from here).
    pub fn set_now(&mut self, now: u64) {
        self.now = self.now.max(now);
    }

    /// Moves every tree to `now`.
    pub fn advance(&mut self, now: u64) {
        self.now = now;
        let due: Vec<Uuid7> = self
            .trees
            .iter()
            .filter(|(_, t)| !t.exited && t.next_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for issue in due {
            let Some(t) = self.trees.get(&issue).cloned() else {
                continue;
            };
            if t.chatty_left > 0 {
                self.chatty_line(issue);
                // at least a millisecond: the world wakes a host for what
                // is due after the present
                let step = self
                    .chatty
                    .range_inclusive(1..=self.programs.max_chatty_step_ms.max(1));
                if let Some(t) = self.trees.get_mut(&issue) {
                    t.chatty_left -= 1;
                    t.next_at = now.saturating_add(step);
                }
                continue;
            }
            if let Some(len) = t.burst {
                // a burst: one write far past the watermarks, handed over
                // in 64 KiB reads at once
                let stream = if self.rng.chance(700) {
                    wire::OutputStream::Stdout
                } else {
                    wire::OutputStream::Stderr
                };
                self.write(issue, stream, usize::try_from(len).unwrap_or(READ_CHUNK));
                if let Some(t) = self.trees.get_mut(&issue) {
                    t.burst = None;
                }
            } else if t.writes_left > 0 {
                let len = usize::try_from(
                    self.rng
                        .range_inclusive(1..=u64::from(self.programs.max_chunk.max(1))),
                )
                .unwrap_or(1);
                let stream = if self.rng.chance(750) {
                    wire::OutputStream::Stdout
                } else {
                    wire::OutputStream::Stderr
                };
                self.write(issue, stream, len);
                if let Some(t) = self.trees.get_mut(&issue) {
                    t.writes_left -= 1;
                }
            } else if t.waits_for_eof && !t.stdin_closed {
                // reading stdin: nothing more until its end (a signal
                // may come first)
                if let Some(t) = self.trees.get_mut(&issue) {
                    t.next_at = u64::MAX;
                }
                continue;
            } else {
                self.end(issue, t.exit);
                continue;
            }
            let step = self.rng.range_inclusive(0..=self.programs.max_step_ms);
            if let Some(t) = self.trees.get_mut(&issue) {
                t.next_at = now.saturating_add(step);
            }
        }
    }
}

impl Supervisor for SimSupervisor {
    fn mode(&self) -> Supervision {
        Supervision::ProcessGroup
    }

    fn prepare(&mut self, spec: LaunchSpec) -> Result<(), SupervisorError> {
        // no draw when disabled: a run without transient failures keeps
        // the sequence it always had
        if self.programs.transient_launch_permille > 0
            && self.rng.chance(self.programs.transient_launch_permille)
        {
            self.push(
                spec.issue,
                ProcessEvent::Failed(LaunchFailure::Transient(
                    "fork: resource temporarily unavailable (simulated)".into(),
                )),
            );
            return Ok(());
        }
        let birth = self.rng.next_u64();
        self.prepared.insert(spec.issue, ());
        self.push(
            spec.issue,
            ProcessEvent::Ready(LaunchIdentity {
                launcher_pid: 1000,
                process_group: 1000,
                birth_ticks: birth,
                cgroup: None,
            }),
        );
        Ok(())
    }

    fn release(&mut self, issue: &Uuid7) -> Result<(), SupervisorError> {
        if self.prepared.remove(issue).is_none() {
            return Err(SupervisorError::State {
                issue: *issue,
                what: "not prepared",
            });
        }
        let p = self.programs;
        let writes =
            u32::try_from(self.rng.range_inclusive(0..=u64::from(p.max_chunks))).unwrap_or(0);
        let burst = self
            .rng
            .chance(p.burst_permille)
            .then(|| {
                self.rng
                    .range_inclusive(256 * 1024..=p.max_burst.max(256 * 1024))
            })
            .map(|b| b.min(MAX_TREE_BYTES));
        let exit = if self.rng.chance(p.fail_permille) {
            if self.rng.chance(200) {
                // it dies of its own signal (SEGV or ABRT)
                Exit::Signal(if self.rng.chance(500) { 11 } else { 6 })
            } else {
                Exit::Code(i32::try_from(self.rng.range_inclusive(1..=255)).unwrap_or(1))
            }
        } else {
            Exit::Code(0)
        };
        let ignore_term = self.rng.chance(p.ignore_term_permille);
        let waits_for_eof = self.rng.chance(p.stdin_permille);
        let step = self.rng.range_inclusive(0..=p.max_step_ms);
        let chatty_left = if p.chatty_permille > 0 && self.chatty.chance(p.chatty_permille) {
            u32::try_from(self.chatty.range_inclusive(
                u64::from(CHATTY_MIN_LINES)..=u64::from(p.max_chatty_lines.max(CHATTY_MIN_LINES)),
            ))
            .unwrap_or(CHATTY_MIN_LINES)
        } else {
            0
        };
        self.started.push(*issue);
        if let Some(r) = log(&self.log).entry(*issue, self.host) {
            r.starts = r.starts.saturating_add(1);
            r.chatty_lines = chatty_left;
        }
        self.trees.insert(
            *issue,
            Tree {
                next_at: self.now.saturating_add(step),
                chatty_left,
                writes_left: writes,
                burst,
                exit,
                ignore_term,
                waits_for_eof,
                stdin_closed: false,
                exited: false,
            },
        );
        self.push(*issue, ProcessEvent::Running);
        Ok(())
    }

    fn abort(&mut self, issue: &Uuid7) {
        self.prepared.remove(issue);
        self.push(*issue, ProcessEvent::Drained { incomplete: vec![] });
    }

    fn signal(&mut self, issue: &Uuid7, kind: wire::SignalKind) -> wire::SignalOutcome {
        let n = match kind {
            wire::SignalKind::Hup => 1,
            wire::SignalKind::Int => 2,
            wire::SignalKind::Term => 15,
            wire::SignalKind::Kill => 9,
            wire::SignalKind::Usr1 => 10,
            wire::SignalKind::Usr2 => 12,
            wire::SignalKind::Unspecified => return wire::SignalOutcome::Failed,
        };
        let Some(t) = self.trees.get(issue).filter(|t| !t.exited).cloned() else {
            return wire::SignalOutcome::NoOpAfterExit;
        };
        if let Some(r) = log(&self.log).entry(*issue, self.host) {
            r.signals.push(kind);
        }
        *self.signalled_here.entry(*issue).or_default() += 1;
        // the default action of every portable signal ends the tree; this
        // program may ignore TERM
        if !(kind == wire::SignalKind::Term && t.ignore_term) {
            self.end(*issue, Exit::Signal(n));
        }
        wire::SignalOutcome::Delivered
    }

    fn write_stdin(
        &mut self,
        issue: &Uuid7,
        write_seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        match self.trees.get(issue) {
            Some(t) if !t.exited && !t.stdin_closed => {}
            _ => {
                return Err(SupervisorError::State {
                    issue: *issue,
                    what: "stdin is not open",
                });
            }
        }
        if let Some(r) = log(&self.log).entry(*issue, self.host) {
            r.stdin_writes.push(write_seq);
            r.stdin.extend_from_slice(&bytes);
        }
        self.push(*issue, ProcessEvent::StdinWritten { write_seq });
        Ok(())
    }

    fn close_stdin(&mut self, issue: &Uuid7) {
        let now = self.now;
        let Some(t) = self.trees.get_mut(issue) else {
            return;
        };
        if t.exited || t.stdin_closed {
            return;
        }
        t.stdin_closed = true;
        if t.waits_for_eof {
            // it read its stdin to the end: on to its exit
            t.next_at = now;
        }
        if let Some(r) = log(&self.log).entry(*issue, self.host) {
            r.eofs = r.eofs.saturating_add(1);
        }
    }

    fn snapshot(&self, _: &Uuid7) -> Option<wire::ResourceSnapshot> {
        None
    }

    fn reap_orphan(&mut self, _: &Uuid7, _: &LaunchIdentity) -> OrphanOutcome {
        // simulated trees die with their daemon
        OrphanOutcome::Gone
    }

    fn stop_all(&mut self) {
        // orderly stop: TERM to every tree, then (after the kill grace,
        // which costs no simulated time here) KILL to those that ignore it
        self.prepared.clear();
        let issues: Vec<Uuid7> = self.trees.keys().copied().collect();
        for issue in issues {
            let Some(t) = self.trees.get(&issue).filter(|t| !t.exited).cloned() else {
                continue;
            };
            let mut sent = vec![wire::SignalKind::Term];
            if t.ignore_term {
                sent.push(wire::SignalKind::Kill);
            }
            let n = if t.ignore_term { 9 } else { 15 };
            if let Some(r) = log(&self.log).entry(issue, self.host) {
                r.signals.extend(sent.iter().copied());
                r.stop_signals.extend(sent);
                r.ended = Some(Ended::Stopped);
            }
            self.trees.remove(&issue);
            self.push(issue, ProcessEvent::Exited(Exit::Signal(n)));
            self.push(issue, ProcessEvent::Drained { incomplete: vec![] });
        }
    }

    fn next_event(&mut self, _: Duration) -> Option<CommandProcessEvent> {
        self.ready.pop_front()
    }

    fn start_terminal(&mut self, spec: TerminalSpec) -> Result<(), SupervisorError> {
        let id = spec.terminal;
        if self.links.contains_key(&id) {
            return Err(SupervisorError::TerminalBusy {
                terminal: id,
                what: "it already has a holder here",
            });
        }
        self.holder_pids = self.holder_pids.saturating_add(1);
        let pid = 20_000u32.saturating_add(self.holder_pids);
        let mut token = [0u8; 32];
        for chunk in token.chunks_mut(8) {
            chunk.copy_from_slice(&self.rng.next_u64().to_le_bytes());
        }
        // clock ticks since boot (`/proc/PID/stat` field 22): far below
        // 2^63, as the client store's integer column holds them
        let start_ticks = self.rng.below(1 << 40);
        let identity = HolderIdentity {
            socket: format!("/sim/host-{}/run/pty-{id}.sock", self.host),
            pid,
            start_ticks,
            boot_id: format!("sim-boot-{}", self.host),
            token,
            cgroup: None,
        };
        let holder = Holder::new(
            Identity {
                token,
                pid,
                start_ticks,
            },
            MODEL_RING_BYTES,
            MODEL_VIEWERS,
        );
        // an orphan of an unrecorded start (its cgroup) is reclaimed first
        let orphan = holders(&self.holders)
            .insert(
                id,
                ModelHolder {
                    holder,
                    identity: identity.clone(),
                    gone: false,
                    shell_ended: false,
                },
            )
            .is_some_and(|old| !old.gone);
        if let Some(r) = log(&self.log).terminal_entry(id, self.host) {
            r.starts = r.starts.saturating_add(1);
            if orphan {
                // the earlier holder is reclaimed (killed); what the new
                // one produces is counted from its own start
                r.replaced = r.replaced.saturating_add(1);
                r.output.clear();
                r.ended = None;
                r.hung_up = false;
                r.exit_told = false;
            }
        }
        if orphan {
            self.replaced.push(id);
        }
        self.links.insert(id, HolderLink::default());
        self.terminal_push(id, TerminalEvent::Started(identity));
        Ok(())
    }

    fn adopt_terminal(
        &mut self,
        terminal: &Uuid7,
        holder: &HolderIdentity,
    ) -> Result<(), SupervisorError> {
        let proven = holders(&self.holders)
            .get(terminal)
            .is_some_and(|h| !h.gone && h.identity == *holder);
        if !proven {
            self.terminal_push(
                *terminal,
                TerminalEvent::Lost {
                    loss: HolderLoss::Gone,
                    detail: format!("the terminal's holder (pid {}) is gone", holder.pid),
                },
            );
            return Ok(());
        }
        if let Some(h) = holders(&self.holders).get_mut(terminal) {
            // a new connection replaces the old
            h.holder.detached();
        }
        if let Some(r) = log(&self.log).terminal_entry(*terminal, self.host) {
            r.adoptions = r.adoptions.saturating_add(1);
        }
        self.links.insert(*terminal, HolderLink::default());
        self.terminal_push(*terminal, TerminalEvent::Adopted);
        Ok(())
    }

    fn attach_terminal(&mut self, terminal: &Uuid7, from: u64) -> Result<(), SupervisorError> {
        if let Some(l) = self.links.get_mut(terminal) {
            l.cut = 0;
        }
        self.message(terminal, ToHolder::Attach { from })
    }

    fn terminal_input(
        &mut self,
        terminal: &Uuid7,
        seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        self.driven(terminal)?;
        let viewer = *terminal.as_bytes();
        let fx = holders(&self.holders)
            .get_mut(terminal)
            .map(|h| {
                h.holder.message(ToHolder::Input {
                    viewer,
                    seq,
                    bytes: bytes.clone(),
                })
            })
            .unwrap_or_default();
        if fx.iter().any(|e| matches!(e, Effect::WritePty(_)))
            && let Some(r) = log(&self.log).terminal_entry(*terminal, self.host)
        {
            // what the PTY really got, once per frame the gate lets through
            r.input_seqs.push(seq);
            if r.written.len() + bytes.len() > MAX_TERMINAL_LOG_BYTES {
                r.truncated = true;
            } else {
                r.written.extend_from_slice(&bytes);
                r.frames.push((seq, bytes.clone()));
            }
        }
        self.perform(*terminal, fx);
        Ok(())
    }

    fn resize_terminal(
        &mut self,
        terminal: &Uuid7,
        rows: u16,
        cols: u16,
    ) -> Result<(), SupervisorError> {
        self.message(terminal, ToHolder::Resize { cols, rows })
    }

    fn close_terminal(&mut self, terminal: &Uuid7) -> Result<(), SupervisorError> {
        self.message(terminal, ToHolder::Close)
    }

    fn next_terminal_event(&mut self) -> Option<TerminalProcessEvent> {
        self.terminal_ready.pop_front()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    fn sup(log: &SharedLog) -> SimSupervisor {
        SimSupervisor::new(
            0,
            SimRng::new(7),
            Programs::default(),
            1_800_000_000_000,
            Arc::clone(log),
        )
    }

    fn term() -> Uuid7 {
        Uuid7::parse("t", "01890a5d-ac96-774b-bcce-b302099a8301").unwrap()
    }

    fn spec() -> TerminalSpec {
        TerminalSpec {
            terminal: term(),
            shell: wire::ShellType::Sh,
            shell_path: "/bin/sh".into(),
            cwd: "/tmp".into(),
            env: vec![],
            rows: 24,
            cols: 80,
            limits: rvbox_client_core::process::ResourceLimits::default(),
        }
    }

    fn events(s: &mut SimSupervisor) -> Vec<TerminalEvent> {
        std::iter::from_fn(|| s.next_terminal_event())
            .map(|e| e.event)
            .collect()
    }

    fn output(ev: &[TerminalEvent]) -> Vec<(u64, Vec<u8>)> {
        ev.iter()
            .filter_map(|e| match e {
                TerminalEvent::Output { offset, bytes, .. } => Some((*offset, bytes.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_model_terminal_echoes_each_frame_once_outlives_its_daemon_and_is_adopted() {
        let log: SharedLog = Arc::default();
        let mut s = sup(&log);
        s.start_terminal(spec()).unwrap();
        let ev = events(&mut s);
        let [TerminalEvent::Started(identity)] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        let identity = identity.clone();
        s.attach_terminal(&term(), 0).unwrap();
        s.terminal_writes(&term(), b"$ ");
        s.terminal_input(&term(), 1, b"ls\r".to_vec()).unwrap();
        s.terminal_input(&term(), 1, b"ls\r".to_vec()).unwrap();
        let ev = events(&mut s);
        assert_eq!(
            output(&ev),
            vec![(0, b"$ ".to_vec()), (2, b"ls\r".to_vec())],
            "echoed once, by offset"
        );
        let acks: Vec<u64> = ev
            .iter()
            .filter_map(|e| match e {
                TerminalEvent::InputAcked { seq } => Some(*seq),
                _ => None,
            })
            .collect();
        assert_eq!(acks, vec![1, 1], "the repeat is acknowledged again");
        // a gap is not written
        s.terminal_input(&term(), 3, b"x".to_vec()).unwrap();
        assert!(output(&events(&mut s)).is_empty());
        {
            let l = log.lock().unwrap();
            let r = l.terminal(&term()).unwrap();
            assert_eq!(r.input_seqs, vec![1]);
            assert_eq!(r.written, b"ls\r");
            assert_eq!(r.output, b"$ ls\r");
            assert_eq!(r.starts, 1);
        }
        // the daemon dies; the holder keeps its ring and gate
        s.daemon_died(&BTreeSet::new(), &BTreeMap::new(), &BTreeSet::new());
        assert!(matches!(
            s.terminal_input(&term(), 2, b"y".to_vec()),
            Err(SupervisorError::UnknownTerminal(_))
        ));
        let mut forged = identity.clone();
        forged.token = [0; 32];
        s.adopt_terminal(&term(), &forged).unwrap();
        assert!(matches!(
            events(&mut s).as_slice(),
            [TerminalEvent::Lost {
                loss: HolderLoss::Gone,
                ..
            }]
        ));
        s.adopt_terminal(&term(), &identity).unwrap();
        assert_eq!(events(&mut s), vec![TerminalEvent::Adopted]);
        s.attach_terminal(&term(), 0).unwrap();
        assert_eq!(output(&events(&mut s)), vec![(0, b"$ ls\r".to_vec())]);
        s.terminal_input(&term(), 1, b"ls\r".to_vec()).unwrap();
        s.terminal_input(&term(), 2, b"y".to_vec()).unwrap();
        s.close_terminal(&term()).unwrap();
        let ev = events(&mut s);
        assert_eq!(output(&ev), vec![(5, b"y".to_vec())]);
        assert_eq!(
            ev.last(),
            Some(&TerminalEvent::Exited {
                exit: Exit::Signal(1),
                final_offset: 6
            })
        );
        let l = log.lock().unwrap();
        let r = l.terminal(&term()).unwrap();
        assert_eq!(r.input_seqs, vec![1, 2], "every acknowledged frame once");
        assert_eq!(r.adoptions, 1);
        assert!(r.hung_up);
        drop(l);
        // the holder is gone with its shell
        s.adopt_terminal(&term(), &identity).unwrap();
        assert!(matches!(
            events(&mut s).as_slice(),
            [TerminalEvent::Lost { .. }]
        ));
        assert!(s.live_holders().is_empty());
    }
}
