//! Named crash points (conventions rule 8).
//!
//! Every durability step of the store calls [`CrashHook::at`] with a stable
//! name. Production installs [`NoCrash`]; crash tests install a hook that
//! kills the process at one chosen point, and the simulator one that stops
//! the run there, so "crash between the segment fsync and the metadata
//! commit" is a reachable, named state.

/// Crash points of the event append path, in order.
pub mod points {
    /// Records are written to the segment files, not yet synced.
    pub const EVENT_BEFORE_FSYNC: &str = "store.event.before_fsync";
    /// Half of one record is written (a torn final write).
    pub const EVENT_MID_RECORD: &str = "store.event.mid_record";
    /// Segments are synced; the metadata transaction has not committed.
    pub const EVENT_AFTER_FSYNC: &str = "store.event.after_fsync";
    /// The metadata transaction committed; nothing acknowledged yet.
    pub const EVENT_AFTER_COMMIT: &str = "store.event.after_commit";
    /// A new segment file exists; its directory is not yet synced.
    pub const SEGMENT_CREATED: &str = "store.segment.after_create";
    /// A command, session, reconciliation or control-mutation transaction
    /// committed; the caller has not acted on it yet (no frame sent, no
    /// response returned, no follow-up write).
    pub const CONTROL_AFTER_COMMIT: &str = "store.control.after_commit";
    /// A large script's blob segment is durable; the command is not committed.
    pub const BLOB_AFTER_SYNC: &str = "store.blob.after_sync";
    /// Every point of the event append path, for tests that iterate them.
    pub const ALL: [&str; 5] = [
        EVENT_BEFORE_FSYNC,
        EVENT_MID_RECORD,
        EVENT_AFTER_FSYNC,
        EVENT_AFTER_COMMIT,
        SEGMENT_CREATED,
    ];
}

/// Observes the store passing a named durability step.
pub trait CrashHook: Send + Sync + std::fmt::Debug {
    /// Called when the store reaches `point`. Returning means "carry on".
    fn at(&self, point: &'static str);
}

/// The production hook: does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCrash;

impl CrashHook for NoCrash {
    fn at(&self, _point: &'static str) {}
}
