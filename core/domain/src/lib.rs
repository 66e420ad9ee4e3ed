//! RVBox domain model, shared by the server, the client daemon and `rvc`.
//!
//! Owns: canonical ids (UUIDv7 command and mutation ids, client ids), the
//! command lifecycle transition table with its internal launch phases,
//! revision compare-and-transition, typed errors with stable codes and their
//! one mapping to gRPC / JSON-RPC / agent `ControlError`, every v1 default and
//! ceiling, the canonical request hash, and authenticated page tokens.
//!
//! Must never: touch a file, a socket, a clock or an RNG. Time, keys and
//! random values are inputs.

pub mod error;
pub mod events;
pub mod fleet;
pub mod hash;
pub mod ids;
pub mod labels;
pub mod lifecycle;
pub mod limits;
pub mod token;
pub mod validate;
