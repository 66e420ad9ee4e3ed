//! The storage base both RVBox stores stand on: the server store
//! (`rvbox-store`) and the client daemon's store (`rvbox-client-store`).
//!
//! Owns: the narrow filesystem trait every segment and identity file goes
//! through ([`fs::StoreFs`], real and fault-injecting), the named
//! crash-point hook ([`crash::CrashHook`]), SQLite connections with checked
//! PRAGMAs and checksummed migrations ([`db`]), the single-instance lock
//! ([`lock::InstanceLock`]), atomic creation of small identity files
//! ([`atomic`]), reading a segment back for recovery and cutting its
//! uncommitted tail ([`segment_io`]: the committed-offset discipline), the
//! CSPRNG seam ([`entropy`]) and the error type ([`StoreError`]).
//!
//! Must never: know a table, a record kind or a protocol message of either
//! store; log file contents; touch a file except through [`fs::StoreFs`]
//! (the lock file and the SQLite files are the only exceptions, and they
//! are opened by path here).

pub mod atomic;
pub mod crash;
pub mod db;
pub mod entropy;
pub mod error;
pub mod fs;
pub mod lock;
pub mod segment_io;

pub use error::StoreError;
