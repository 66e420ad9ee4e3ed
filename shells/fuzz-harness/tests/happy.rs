//! The scripted server-core program reaches the deep paths: welcome,
//! reconciliation, dispatch, acceptance and acknowledged events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use rvbox_fuzz::server_core::{explore, program::Program};

/// The happy path the seed recorder also writes.
pub fn happy() -> Program {
    Program::new()
        .connect()
        .hello(0, 0)
        .complete(8)
        .complete(8)
        .snapshot(false)
        .complete(8)
        .complete(8)
        .capacity(4)
        .complete(8)
        .complete(8)
        .accept(0)
        .complete(8)
        .lifecycle(0, 0)
        .output(0, b"hello\n")
        .complete(8)
        .complete(8)
}

#[test]
fn the_scripted_program_reaches_dispatch_and_acks() {
    let seen = explore(&happy().bytes());
    for want in [
        "frame server_welcome",
        "frame reconcile_request",
        "frame reconcile_result",
        "frame dispatch",
        "frame event_ack",
        "op record_accepted",
        "op append_events",
    ] {
        assert!(seen.contains_key(want), "{want} missing from {seen:#?}");
    }
}
