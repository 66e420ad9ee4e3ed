//! RVBox fuzz targets (plan §11.3), each a plain `pub fn run(data: &[u8])`
//! that feeds one input to the real decoder or core and panics when an
//! invariant breaks. They build on stable: the cargo-fuzz crate under
//! `fuzz/` (nightly, libFuzzer) calls them from one `fuzz_target!` each,
//! and this crate's own test replays the seed corpora, the regression
//! inputs and a few thousand mutated inputs through them (docs/fuzzing.md).
//!
//! Owns: the targets, their invariant checks, and the model store the
//! server-core target answers store operations with. Must never: be a
//! dependency of a production crate, read the clock or the environment,
//! or keep state between two `run` calls (an input is one whole run).
// A harness reports a broken invariant by panicking: that is what a fuzzer
// and a test see. Indexing stays checked (`get`) everywhere else.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

pub mod config;
pub mod envelope;
pub mod jsonrpc;
pub mod segment_tail;
pub mod server_core;
mod source;
pub mod store_model;
pub mod tokens;
pub mod zstd_output;

pub use source::Source;

/// A fuzz target: its name (the `fuzz_targets/<name>.rs` file and the
/// `fixtures/fuzz/<name>/` corpus) and its body.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// The name.
    pub name: &'static str,
    /// What it checks, in one line.
    pub checks: &'static str,
    /// The body.
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: [Target; 7] = [
    Target {
        name: "envelope",
        checks: "agent Envelope decode, and a fresh and a ready server Session fed the frame",
        run: envelope::run,
    },
    Target {
        name: "server_core",
        checks: "sequences of frames, completions and control calls into ServerCore over a model store",
        run: server_core::run,
    },
    Target {
        name: "zstd_output",
        checks: "output chunk validation (bounded zstd decompression, raw length and SHA-256)",
        run: zstd_output::run,
    },
    Target {
        name: "segment_tail",
        checks: "segment scan and recovery verdict, and the group journal decoder, over any bytes",
        run: segment_tail::run,
    },
    Target {
        name: "tokens",
        checks: "page and output token open/seal over any text, and mutated sealed tokens",
        run: tokens::run,
    },
    Target {
        name: "jsonrpc",
        checks: "the JSON-RPC request envelope and params as each method's request message",
        run: jsonrpc::run,
    },
    Target {
        name: "config",
        checks: "both daemons' TOML configuration decode and validation from any text",
        run: config::run,
    },
];

/// The target named `name`.
#[must_use]
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().copied().find(|t| t.name == name)
}
