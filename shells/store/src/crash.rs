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
    /// queued -> dispatched committed; the `Dispatch` frame is not sent.
    pub const DISPATCH_AFTER_COMMIT: &str = "store.dispatch.after_commit";
    /// A requeue committed (after a transient answer or a lost dispatch).
    pub const REQUEUE_AFTER_COMMIT: &str = "store.requeue.after_commit";
    /// dispatched -> accepted committed; no upload or signal sent yet.
    pub const ACCEPT_AFTER_COMMIT: &str = "store.accept.after_commit";
    /// A late acceptance, its incident, revision and TERM committed.
    pub const ACCEPT_LATE_AFTER_COMMIT: &str = "store.accept_late.after_commit";
    /// A lifecycle advance learned from client evidence committed.
    pub const ADVANCE_AFTER_COMMIT: &str = "store.advance.after_commit";
    /// The expired-pending indicator committed.
    pub const EXPIRED_PENDING_AFTER_COMMIT: &str = "store.expired_pending.after_commit";
    /// A revision bump committed.
    pub const REVISION_AFTER_COMMIT: &str = "store.revision.after_commit";
    /// A server-decided terminal state committed (expired, rejected,
    /// cancelled, interrupted).
    pub const FINISH_AFTER_COMMIT: &str = "store.finish.after_commit";
    /// A reconciliation round committed; the `ReconcileResult` is not sent.
    pub const RECONCILE_AFTER_COMMIT: &str = "store.reconcile.after_commit";
    /// An incident committed.
    pub const INCIDENT_AFTER_COMMIT: &str = "store.incident.after_commit";
    /// A registration committed; the welcome is not sent.
    pub const REGISTER_AFTER_COMMIT: &str = "store.register.after_commit";
    /// A live-conflict claim committed; the refusal is not sent.
    pub const CLAIM_AFTER_COMMIT: &str = "store.claim.after_commit";
    /// A session's end committed.
    pub const SESSION_CLOSE_AFTER_COMMIT: &str = "store.session_close.after_commit";
    /// A takeover grant (or its stored refusal) committed; no answer yet.
    pub const TAKEOVER_AFTER_COMMIT: &str = "store.takeover.after_commit";
    /// A `SignalCommand` committed; no answer and no `Signal` frame yet.
    pub const SIGNAL_AFTER_COMMIT: &str = "store.signal.after_commit";
    /// An `AppendStdin` or `CloseStdin` committed; no answer and no
    /// `StdinWrite` frame yet.
    pub const STDIN_AFTER_COMMIT: &str = "store.stdin.after_commit";
    /// A `RunCommand` committed; no answer yet.
    pub const RUN_COMMAND_AFTER_COMMIT: &str = "store.run_command.after_commit";
    /// A server-side lifecycle transition committed.
    pub const TRANSITION_AFTER_COMMIT: &str = "store.transition.after_commit";
    /// A `RunFleet` committed (run, targets, first releases); no answer
    /// yet, and the released clients not yet looked at for dispatch.
    pub const RUN_FLEET_AFTER_COMMIT: &str = "store.run_fleet.after_commit";
    /// A fleet release pass committed; its released clients not yet looked
    /// at for dispatch.
    pub const FLEET_PASS_AFTER_COMMIT: &str = "store.fleet_pass.after_commit";
    /// A fleet action (signal, cancel, pause, resume) committed; no answer
    /// and no `Signal` frame yet.
    pub const FLEET_ACTION_AFTER_COMMIT: &str = "store.fleet_action.after_commit";
    /// Every point after a metadata commit, each at its own site: the
    /// simulator crashes at each to show that no decision depends on a
    /// second transaction that might never run, and that the frame or
    /// answer the commit announces can be lost.
    pub const AFTER_COMMIT: [&str; 21] = [
        DISPATCH_AFTER_COMMIT,
        REQUEUE_AFTER_COMMIT,
        ACCEPT_AFTER_COMMIT,
        ACCEPT_LATE_AFTER_COMMIT,
        ADVANCE_AFTER_COMMIT,
        EXPIRED_PENDING_AFTER_COMMIT,
        REVISION_AFTER_COMMIT,
        FINISH_AFTER_COMMIT,
        RECONCILE_AFTER_COMMIT,
        INCIDENT_AFTER_COMMIT,
        REGISTER_AFTER_COMMIT,
        CLAIM_AFTER_COMMIT,
        SESSION_CLOSE_AFTER_COMMIT,
        TAKEOVER_AFTER_COMMIT,
        SIGNAL_AFTER_COMMIT,
        STDIN_AFTER_COMMIT,
        RUN_COMMAND_AFTER_COMMIT,
        TRANSITION_AFTER_COMMIT,
        RUN_FLEET_AFTER_COMMIT,
        FLEET_PASS_AFTER_COMMIT,
        FLEET_ACTION_AFTER_COMMIT,
    ];
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

pub use rvbox_storage::crash::{CrashHook, NoCrash};
