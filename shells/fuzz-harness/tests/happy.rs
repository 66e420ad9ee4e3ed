//! The scripted server-core program reaches the deep paths: welcome,
//! reconciliation, dispatch, acceptance and acknowledged events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use rvbox_fuzz::server_core::{explore, program::Program};

#[test]
fn the_scripted_program_reaches_dispatch_and_acks() {
    let seen = explore(&Program::happy().bytes());
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

#[test]
fn an_accepted_script_command_is_uploaded() {
    let p = Program::happy()
        .accept(2)
        .complete(8)
        .complete(8)
        .complete(8);
    let seen = explore(&p.bytes());
    for want in ["op script_info", "op script_range", "frame script_chunk"] {
        assert!(seen.contains_key(want), "{want} missing from {seen:#?}");
    }
}

#[test]
fn a_snapshot_naming_an_unknown_command_is_looked_up() {
    let mut p = Program::new().connect().hello(0, 0).complete(8).complete(8);
    // a snapshot whose extra record names a command the round did not ask
    // about (the layout of `Program::snapshot`, with the extra record on)
    p.0.extend([2, 0, 255, 0, 0, 4, 0, 4, 0, 4, 0, 4, 0, 0, 9, 0, 255, 255]);
    let seen = explore(&p.complete(8).complete(8).bytes());
    assert!(
        seen.contains_key("op knowledge"),
        "knowledge missing from {seen:#?}"
    );
}
