//! The client store port: every durable step the client core asks for
//! ([`ClientOp`], with a [`Token`]) and how it ended ([`ClientCompletion`]),
//! and every supervisor step ([`SuperviseOp`]). The client store performs
//! the first (`rvbox-client-store`), a `Supervisor` the second; the
//! simulator performs both with faults and delays of its own.

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

use crate::accept::{CheckedDispatch, Refusal};
use crate::process::{HolderIdentity, LaunchIdentity, LaunchSpec, TerminalSpec};
use crate::spool::{SpoolCompletion, SpoolOp};

/// A completion token of the client core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// What the wrapper file runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WrapperSource {
    /// The command text, written as the file's content.
    Text(String),
    /// The committed script upload, copied from the client store.
    Script,
}

/// A durable step of the client store.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientOp {
    /// Acceptance as one transaction (plan §7.3 steps 2-4).
    Accept(Box<CheckedDispatch>),
    /// A spool step.
    Spool(Box<SpoolOp>),
    /// Record the highest session generation seen (the floor a welcome
    /// must exceed after a restart).
    Generation(u64),
    /// The tombstones held for `issues` (a read, for a snapshot).
    Tombstones {
        /// The commands asked about.
        issues: Vec<Uuid7>,
    },
    /// Apply a checked `ReconcileResult` durably: terminate intents,
    /// discards, and the server's revisions.
    Reconcile {
        /// Active commands to end here (the server holds no live record).
        terminate: Vec<Uuid7>,
        /// Terminal records the server already holds.
        discard: Vec<Uuid7>,
        /// Kept commands and their revisions.
        revisions: Vec<(Uuid7, u64)>,
    },
    /// Write the private generated wrapper file under the working
    /// directory (owner-only, atomic rename, parent synced).
    Materialize {
        /// The command.
        issue: Uuid7,
        /// The effective working directory.
        cwd: String,
        /// What it runs.
        source: WrapperSource,
    },
    /// `launch_prepared` with the launcher's identity, committed and synced.
    LaunchPrepared {
        /// The command.
        issue: Uuid7,
        /// The launcher's identity.
        identity: LaunchIdentity,
    },
    /// `launch_authorized`, committed and synced before the release.
    LaunchAuthorized {
        /// The command.
        issue: Uuid7,
    },
    /// The launcher reported `exec`: the command is running.
    Running {
        /// The command.
        issue: Uuid7,
    },
    /// Back to accepted after a transient launch failure (the launcher is
    /// verified dead).
    Unprepared {
        /// The command.
        issue: Uuid7,
    },
    /// The terminal event is spooled: the slot is released and the
    /// wrapper file removed.
    Ended {
        /// The command.
        issue: Uuid7,
        /// Its terminal lifecycle.
        lifecycle: wire::Lifecycle,
    },
    /// One script chunk at `offset`: verified (zstd, length, SHA-256,
    /// exact replay of stored bytes), appended and synced before the
    /// received prefix advances; the whole script verified at the end.
    ScriptChunk {
        /// The command.
        issue: Uuid7,
        /// The chunk as received.
        chunk: Box<wire::ScriptChunk>,
    },
    /// One stdin write as received: the store decodes it, checks its
    /// raw length and SHA-256, appends the newline it asks for, and keeps
    /// the bytes durable until they are written to the child.
    StdinWrite {
        /// The command.
        issue: Uuid7,
        /// The write (sequence, encoded payload, digest, newline, close).
        write: Box<wire::StdinWrite>,
    },
    /// A stdin write reached the child's pipe: its durable copy goes (the
    /// command's stdin sequence and close state stay).
    StdinWritten {
        /// The command.
        issue: Uuid7,
        /// Its sequence.
        write_seq: u64,
    },
    /// The terminal event was acknowledged: the record becomes a tombstone.
    Finish {
        /// The command.
        issue: Uuid7,
    },
    /// A new terminal's opening record, durable before its holder starts.
    TerminalOpening {
        /// The terminal.
        terminal: Uuid7,
        /// The shell it opens.
        resolved_shell: wire::ShellType,
        /// The checked open request.
        open: Box<wire::PtyOpen>,
    },
    /// The started holder's record, durable before `PtyOpened` is sent.
    TerminalOpened {
        /// The terminal.
        terminal: Uuid7,
        /// Its holder.
        holder: Box<HolderIdentity>,
    },
    /// The terminal's end, kept for a day so that the server's questions
    /// about it are answered from it.
    TerminalClosed {
        /// The terminal.
        terminal: Uuid7,
        /// How it ended.
        closed: Box<ClosedTerminal>,
    },
    /// Closed terminals closed before `closed_before_ms` (wall time), and
    /// opening records created before it, are forgotten.
    TerminalsExpire {
        /// The cut-off.
        closed_before_ms: i64,
    },
}

/// How a terminal ended, as the client keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClosedTerminal {
    /// How the shell ended.
    pub exit_result: wire::ExitResult,
    /// The offset after the last output byte.
    pub final_offset: u64,
    /// Operator-readable explanation.
    pub reason: String,
    /// When it closed (wall time).
    pub closed_at_ms: i64,
}

/// How a [`ClientOp`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientCompletion {
    /// The step is durable.
    Done,
    /// It failed; nothing of it is durable (the reason is for logs).
    Failed(String),
    /// An acceptance's outcome.
    Accepted(AcceptOutcome),
    /// A spool step's outcome.
    Spool(SpoolCompletion),
    /// The tombstones found (issue, request hash).
    Tombstones(Vec<(Uuid7, [u8; 32])>),
    /// The wrapper file is in place.
    Materialized {
        /// Its absolute path.
        wrapper_path: String,
    },
    /// The wrapper file was not written, and never will be: the working
    /// directory does not resolve to a directory under an allowed root
    /// (the reason names it). The launch fails permanently.
    MaterializeRefused(String),
    /// A script chunk's outcome.
    Script(ScriptOutcome),
    /// A stdin write's outcome.
    Stdin(StdinOutcome),
}

/// What a stdin write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StdinOutcome {
    /// Durable: the bytes to write to the child (decoded, the newline
    /// appended when asked).
    Stored(Vec<u8>),
    /// The payload does not decode to its raw length and digest (the
    /// reason names the field); nothing was stored.
    Invalid(String),
}

/// What an acceptance transaction decided.
#[derive(Debug, Clone, PartialEq)]
pub enum AcceptOutcome {
    /// A new record is durable.
    New,
    /// An exact duplicate of a held record.
    Repeat {
        /// The stored revision.
        revision: u64,
        /// The shell it was accepted under.
        resolved_shell: wire::ShellType,
    },
    /// Refused; nothing written.
    Refused(Refusal),
}

/// What a script chunk did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptOutcome {
    /// Stored (or an exact replay): the durable contiguous prefix now.
    Received {
        /// Bytes durable from offset 0.
        received: u64,
    },
    /// The whole script is durable and matches its descriptor.
    Committed,
    /// The chunk breaks the upload rules (a hole, changed bytes, a bad
    /// checksum or length, data past the declared size, a chunk after
    /// commit): a protocol error. Nothing was written.
    Invalid(String),
    /// All bytes arrived but the SHA-256 or length of the whole does not
    /// match the descriptor: the command is rejected permanently.
    Mismatch(String),
}

/// A step of the supervisor.
#[derive(Debug, Clone, PartialEq)]
pub enum SuperviseOp {
    /// Launch steps 1-2 (answered by `Ready` or `Failed`).
    Prepare(Box<LaunchSpec>),
    /// The release byte (answered by `Running` or `Failed`).
    Release(Uuid7),
    /// End a prepared launch before release (answered by `Drained`).
    Abort(Uuid7),
    /// A signal to the tree (answered by [`crate::machine::Input::Signalled`]).
    Signal {
        /// The command.
        issue: Uuid7,
        /// The signal.
        kind: wire::SignalKind,
        /// The revision it carries.
        revision: u64,
    },
    /// One stdin write (answered by `StdinWritten`).
    WriteStdin {
        /// The command.
        issue: Uuid7,
        /// Its sequence.
        write_seq: u64,
        /// Raw bytes.
        bytes: Vec<u8>,
    },
    /// Close the child's stdin after the queued writes.
    CloseStdin(Uuid7),
    /// Unclean-start recovery of a recorded launch (answered by
    /// [`crate::machine::Input::Reaped`]).
    Reap {
        /// The command.
        issue: Uuid7,
        /// What was recorded.
        identity: LaunchIdentity,
    },
    /// Orderly shutdown of every tree (terminal holders outlive it).
    StopAll,
    /// Start a terminal's holder (answered by `Started` or `Failed`).
    StartTerminal(Box<TerminalSpec>),
    /// Adopt a recorded holder after a restart (answered by `Adopted` or
    /// `Lost`).
    AdoptTerminal {
        /// The terminal.
        terminal: Uuid7,
        /// What was recorded.
        holder: Box<HolderIdentity>,
    },
    /// Stream the holder's output from `from` (its replay, then live).
    AttachTerminal {
        /// The terminal.
        terminal: Uuid7,
        /// The offset to start from.
        from: u64,
    },
    /// One input frame (answered by `InputAcked`).
    TerminalInput {
        /// The terminal.
        terminal: Uuid7,
        /// Its `input_seq`.
        seq: u64,
        /// The keys.
        bytes: Vec<u8>,
    },
    /// A window size change.
    ResizeTerminal {
        /// The terminal.
        terminal: Uuid7,
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// Hang up the terminal's shell (answered by `Exited`).
    CloseTerminal(Uuid7),
}
