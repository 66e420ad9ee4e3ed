//! RVBox wire messages generated from `protos/rvbox/v1/*.proto`.
//!
//! This crate owns the prost message types and nothing else: no services, no
//! I/O. The code under `src/gen/` is produced by `scripts/generate` and a test
//! in `rvbox-codegen` fails when it is stale. Never edit it by hand.

/// Package `rvbox.v1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    unreachable_pub,
    missing_debug_implementations
)]
pub mod v1 {
    include!("gen/rvbox.v1.rs");
}
