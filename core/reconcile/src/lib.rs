//! RVBox reconciliation core (plan §6.4): what the server and a
//! reconnecting client agree on before dispatch resumes.
//!
//! Owns: the `ReconcileRequest` rows ([`build_request`]); assembling the
//! client's chunked `ClientSnapshot` into one bounded, checked
//! [`CompleteSnapshot`] ([`SnapshotAssembler`]); the decision
//! ([`reconcile`]) that validates every row and then applies the §6.4
//! matrix, producing server actions, incident intents and one sorted,
//! deterministic `ReconcileResult` with its digest ([`Outcome`]); and the
//! client's check of a received result ([`check_result`]).
//!
//! Must never: do I/O, read a clock, use randomness or threads, iterate a
//! hash map, or apply anything itself. The caller persists an [`Outcome`]
//! in one reconciliation transaction, sends its result on the control lane,
//! and keeps dispatch disabled until that result was written (R-6.4-28/29).
//! Errors are values; a refused snapshot yields no outcome at all.
//!
//! Flow of one round (spec-mapping reconnect order: hello -> welcome ->
//! complete snapshot -> apply `ReconcileResult` durably -> replay):
//!
//! 1. server: [`build_request`]`(round, rows)` -> send `ReconcileRequest`;
//! 2. server: [`SnapshotAssembler::new`]`(round)`, [`SnapshotAssembler::push`]
//!    each chunk until [`Assembly::Complete`];
//! 3. server: look up [`CompleteSnapshot::lookups_needed`] as
//!    [`ServerKnown`], then [`reconcile`];
//! 4. server: persist, send [`Outcome::result`], then enable dispatch;
//! 5. client: [`check_result`], record terminate/discard intents durably,
//!    then report capacity and replay.

mod decide;
pub mod limits;
mod result;
mod server;
mod snapshot;

pub use decide::{
    Action, Disposition, IncidentIntent, InterruptReason, InvalidSnapshot, LostEvents, Outcome,
    ReconcileError, Resume, ServerAction, reconcile,
};
pub use result::{CheckedResult, ResultError, ResultList, check_result, result_digest};
pub use server::{ServerCommand, ServerInputError, ServerKnown, Source, build_request};
pub use snapshot::{
    Assembly, CompleteSnapshot, List, LocalRecord, SnapshotAssembler, SnapshotError,
};
