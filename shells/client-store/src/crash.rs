//! Named crash points of the client store (conventions rule 8). Every
//! commit step calls the installed [`CrashHook`] with one of these names;
//! the crash suite kills the daemon at each, and the simulator stops a run
//! there.

pub use rvbox_storage::crash::{CrashHook, NoCrash};

/// The identity file is written and synced; not yet renamed into place.
pub const IDENTITY_BEFORE_RENAME: &str = "identity.before_rename";
/// The acceptance transaction is written, not committed.
pub const ACCEPT_BEFORE_COMMIT: &str = "accept.before_commit";
/// The acceptance is committed; `CommandAccepted` is not sent.
pub const ACCEPT_AFTER_COMMIT: &str = "accept.after_commit";
/// The terminal acknowledgement removed the command and wrote its
/// tombstone (and rotated the FIFO); nothing cleaned up yet.
pub const TERMINAL_ACK_AFTER_COMMIT: &str = "terminal_ack.after_commit";
/// The tombstone FIFO rotated its oldest entries out, not committed.
pub const TOMBSTONE_ROTATE_BEFORE_COMMIT: &str = "tombstone.rotate.before_commit";

/// A new spool segment file exists; its directory is not yet synced.
pub const SPOOL_SEGMENT_AFTER_CREATE: &str = "spool.segment.after_create";
/// An output record is written to its segment, not yet synced.
pub const SPOOL_APPEND_BEFORE_FSYNC: &str = "spool.append.before_fsync";
/// The record is synced; its index row is not committed.
pub const SPOOL_APPEND_AFTER_FSYNC: &str = "spool.append.after_fsync";
/// The output entry is committed.
pub const SPOOL_APPEND_AFTER_COMMIT: &str = "spool.append.after_commit";
/// An event entry is written, not committed.
pub const SPOOL_EVENT_BEFORE_COMMIT: &str = "spool.event.before_commit";
/// An event entry is committed.
pub const SPOOL_EVENT_AFTER_COMMIT: &str = "spool.event.after_commit";
/// Wire sequences are committed; nothing is sent.
pub const SPOOL_ASSIGN_AFTER_COMMIT: &str = "spool.assign.after_commit";
/// A release is committed; its segment files are not yet removed.
pub const SPOOL_RELEASE_AFTER_COMMIT: &str = "spool.release.after_commit";
/// A rotation is written, not committed.
pub const SPOOL_ROTATE_BEFORE_COMMIT: &str = "spool.rotate.before_commit";
/// A rotation is committed; its segment file is not yet removed.
pub const SPOOL_ROTATE_AFTER_COMMIT: &str = "spool.rotate.after_commit";

/// A reconciliation result is committed; capacity not yet reported.
pub const RECONCILE_AFTER_COMMIT: &str = "reconcile.after_commit";
/// The wrapper file is written and synced; not yet renamed into place.
pub const MATERIALIZE_BEFORE_RENAME: &str = "materialize.before_rename";
/// `launch_prepared` is committed and synced; nothing released.
pub const LAUNCH_PREPARED_AFTER_FSYNC: &str = "launch.prepared.after_fsync";
/// `launch_authorized` is committed and synced; the release byte not sent.
pub const LAUNCH_AUTHORIZED_AFTER_FSYNC: &str = "launch.authorized.after_fsync";
/// Running is committed.
pub const LAUNCH_RUNNING_AFTER_COMMIT: &str = "launch.running.after_commit";
/// Back to accepted after a transient launch failure is committed.
pub const LAUNCH_UNPREPARED_AFTER_COMMIT: &str = "launch.unprepared.after_commit";
/// The slot release after the terminal event is committed.
pub const LAUNCH_ENDED_AFTER_COMMIT: &str = "launch.ended.after_commit";
/// An open loss run's totals are committed on its command.
pub const SPOOL_LOSS_AFTER_COMMIT: &str = "spool.loss.after_commit";
/// A stdin write is committed; not yet written to the child.
pub const STDIN_AFTER_COMMIT: &str = "stdin.after_commit";
/// A written stdin write's durable copy is removed.
pub const STDIN_WRITTEN_AFTER_COMMIT: &str = "stdin.written.after_commit";
/// A script chunk is synced; its index row is not committed.
pub const SCRIPT_CHUNK_AFTER_FSYNC: &str = "script.chunk.after_fsync";
/// A script chunk is committed; no status sent.
pub const SCRIPT_CHUNK_AFTER_COMMIT: &str = "script.chunk.after_commit";
/// The verified script is committed as launch-eligible.
pub const SCRIPT_COMMIT_AFTER_COMMIT: &str = "script.commit.after_commit";

/// A terminal's opening record is committed; its holder is not started.
pub const TERMINAL_OPENING_AFTER_COMMIT: &str = "terminal.opening.after_commit";
/// A terminal's holder record is committed; `PtyOpened` is not sent.
pub const TERMINAL_OPENED_AFTER_COMMIT: &str = "terminal.opened.after_commit";
/// A terminal's end is committed; `PtyClosed` is not sent.
pub const TERMINAL_CLOSED_AFTER_COMMIT: &str = "terminal.closed.after_commit";

/// Every point, for tests that iterate them.
pub const ALL: &[&str] = &[
    IDENTITY_BEFORE_RENAME,
    ACCEPT_BEFORE_COMMIT,
    ACCEPT_AFTER_COMMIT,
    TERMINAL_ACK_AFTER_COMMIT,
    TOMBSTONE_ROTATE_BEFORE_COMMIT,
    SPOOL_SEGMENT_AFTER_CREATE,
    SPOOL_APPEND_BEFORE_FSYNC,
    SPOOL_APPEND_AFTER_FSYNC,
    SPOOL_APPEND_AFTER_COMMIT,
    SPOOL_EVENT_BEFORE_COMMIT,
    SPOOL_EVENT_AFTER_COMMIT,
    SPOOL_ASSIGN_AFTER_COMMIT,
    SPOOL_RELEASE_AFTER_COMMIT,
    SPOOL_ROTATE_BEFORE_COMMIT,
    SPOOL_ROTATE_AFTER_COMMIT,
    SPOOL_LOSS_AFTER_COMMIT,
    RECONCILE_AFTER_COMMIT,
    MATERIALIZE_BEFORE_RENAME,
    LAUNCH_PREPARED_AFTER_FSYNC,
    LAUNCH_AUTHORIZED_AFTER_FSYNC,
    LAUNCH_RUNNING_AFTER_COMMIT,
    LAUNCH_UNPREPARED_AFTER_COMMIT,
    LAUNCH_ENDED_AFTER_COMMIT,
    STDIN_AFTER_COMMIT,
    STDIN_WRITTEN_AFTER_COMMIT,
    SCRIPT_CHUNK_AFTER_FSYNC,
    SCRIPT_CHUNK_AFTER_COMMIT,
    SCRIPT_COMMIT_AFTER_COMMIT,
];

/// The terminals' points, apart from [`ALL`]: armed by the simulator's
/// terminal workload on the host of a terminal it opens (so the draws of
/// the other points stay what they were), and iterated by the store's
/// crash tests.
pub const TERMINAL_POINTS: &[&str] = &[
    TERMINAL_OPENING_AFTER_COMMIT,
    TERMINAL_OPENED_AFTER_COMMIT,
    TERMINAL_CLOSED_AFTER_COMMIT,
];
