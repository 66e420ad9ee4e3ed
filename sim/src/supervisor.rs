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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rvbox_client_core::process::{
    CommandProcessEvent, Exit, LaunchFailure, LaunchIdentity, LaunchSpec, ProcessEvent, Supervision,
};
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

/// Every tree's record, shared between the supervisor (which writes it)
/// and the world's oracles (which read it).
#[derive(Debug, Default)]
pub struct ProcessLog {
    records: BTreeMap<Uuid7, ProcessRecord>,
    /// A record could not be kept (the bound): the run must fail.
    pub overflowed: bool,
}

impl ProcessLog {
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

    /// Whether process events wait to be taken.
    #[must_use]
    pub fn has_events(&self) -> bool {
        !self.ready.is_empty()
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
    ) {
        let mut l = log(&self.log);
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
}
