//! The RVBox client store (plan §7.1-§7.3): the sole writer of a client
//! daemon's durable state.
//!
//! Owns: the private state directory and its single-instance lock, the
//! installation's identity file (`client_instance_id`, created once,
//! atomically), the SQLite database (accepted commands with phase, revision
//! and hash, launch identity, spool entries with local ordinals and
//! optional wire sequences, payload digests, stdin state, script ranges,
//! the last server acknowledgement, the tombstone FIFO, local incidents,
//! the terminals' records: their holders' identities and their ends),
//! the spool and script segment files with the committed-offset discipline
//! of the server store, and the named crash point of every commit step.
//! Decisions come from `rvbox-client-core`; files and SQLite connections
//! from `rvbox-storage`, shared with the server store.
//!
//! Must never: answer before a commit is durable, build a path from
//! server input, log payload bytes or command text, or touch a file except
//! through `StoreFs`.

pub mod crash;
pub mod executor;
pub mod identity;
pub mod incidents;
pub mod layout;
pub mod metrics;
pub mod records;
pub mod recovery;
pub mod script;
pub mod spool;
pub mod store;
pub mod terminals;

pub use layout::ClientLayout;
pub use rvbox_storage::StoreError;
pub use store::{Accepted, ClientStore, ClientStoreOptions, Counters, LocalHealth};
