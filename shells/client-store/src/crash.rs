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

/// Every point, for tests that iterate them.
pub const ALL: &[&str] = &[
    IDENTITY_BEFORE_RENAME,
    ACCEPT_BEFORE_COMMIT,
    ACCEPT_AFTER_COMMIT,
    TERMINAL_ACK_AFTER_COMMIT,
    TOMBSTONE_ROTATE_BEFORE_COMMIT,
];
