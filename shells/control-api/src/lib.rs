//! Generated gRPC stubs of the RVBox operator service `rvbox.v1.Control`.
//!
//! This crate owns the tonic client (`v1::control_client::ControlClient`) and
//! server (`v1::control_server::{Control, ControlServer}`) for
//! `protos/rvbox/v1/control.proto`, and nothing else: the messages they carry
//! are the prost types of `rvbox-proto`, and no handler logic lives here
//! beside [`json`], the canonical proto3 JSON form of those messages (for
//! `rvc --output json` and the JSON-RPC adapter), and [`jsonrpc`], the
//! adapter's JSON-RPC 2.0 request envelope read from a body. The
//! code under `src/gen/` is produced by `scripts/generate`; a test in
//! `rvbox-codegen` fails when it is stale. Never edit it by hand.

/// Package `rvbox.v1`: the `Control` service stubs.
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

/// The encoded `FileDescriptorSet` of `protos/rvbox/v1` and its imports,
/// for gRPC server reflection (generated beside the stubs).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("gen/rvbox_descriptor.bin");

pub mod json;
pub mod jsonrpc;
