//! RVBox store port (plan §5, §6.1).
//!
//! Owns: the backend-neutral values that pass between the pure server core
//! and whatever store backs it: commands as dispatch and reconciliation
//! see them, client records and registrations, event appends and their
//! outcomes, incidents, signal plans, and the source of random bytes. The
//! SQLite + segment store implements it today; a PostgreSQL + object
//! storage backend for several server replicas implements the same values
//! later.
//!
//! Must never: name a SQLite (or any backend's) type, touch a file, a
//! socket, a clock or an RNG.

pub mod audit;
pub mod commands;
pub mod entropy;
pub mod events;
pub mod fleet;
pub mod incidents;
pub mod maintenance;
pub mod ops;
pub mod pty;
pub mod replica;
pub mod sessions;
pub mod signals;
pub mod stdin;
