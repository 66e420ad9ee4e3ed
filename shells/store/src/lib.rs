//! The RVBox server store (plan §5): the sole writer of server state.
//!
//! Owns: the data directory and its single-instance lock, the SQLite
//! metadata database (WAL, foreign keys, explicit synchronous mode, checked
//! PRAGMAs, checksummed migrations), the checksummed segment files with the
//! committed-offset protocol, recovery, quotas and retention, and storage
//! incidents. Pure decisions (record format, charge formula, Reserve,
//! eviction order, the recovery verdict for a segment) come from the
//! `rvbox-segment` and `rvbox-retention` cores; this crate applies them.
//!
//! Must never: acknowledge anything before it is durable, build a path from
//! client input, log payload bytes, or touch a file except through
//! [`fs::StoreFs`].

pub mod db;
pub mod layout;
pub use rvbox_storage::{atomic, entropy, error, fs};

pub use error::StoreError;
pub mod crash;
pub mod identity;
pub mod incidents;
pub mod mutations;
pub mod store;

pub use store::{Store, StoreOptions};
pub mod audit;
pub mod backup;
pub mod blobs;
pub mod checkpoint;
pub mod commands;
pub mod events;
pub mod fleet;
pub mod group;
pub mod health;
pub mod journal;
pub mod maintenance;
pub mod metrics;
pub mod operator;
pub mod output;
pub mod pty;
pub mod reader;
pub mod records;
pub mod recovery;
pub mod registry;
pub mod retention;
pub mod scrub;
pub mod sessions;
pub mod signals;
pub mod stdin;
pub mod write_group;
