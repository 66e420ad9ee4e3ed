#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Terminal recordings under the quotas and retention of command output:
//! a recording is trimmed (oldest first, the loss marked) to what the
//! client's quota leaves after its command output, and a closed terminal
//! goes with its recording after the terminal retention.

mod support;

use std::sync::Arc;

use rvbox_proto::v1 as wire;
use rvbox_store::operator::Caller;
use rvbox_store::reader::ControlReads as _;
use rvbox_store::{Store, StoreOptions};
use rvbox_store_port::pty::{PtyLimits, PtyMutation, PtyRecordKind, PtyReport};
use support::*;

const CLIENT: &str = "web-1";

fn caller() -> Caller {
    Caller {
        transport: "grpc-unix".into(),
        principal: "uid:0".into(),
    }
}

fn terminal(s: &mut Store) -> ([u8; 16], rvbox_store::sessions::SessionFence) {
    let fence = live_session(s, CLIENT);
    let id = new_id();
    s.pty_mutation_as(
        &PtyMutation::Open(wire::OpenPtySessionRequest {
            request_id: text(&id),
            client_id: CLIENT.into(),
            rows: 24,
            cols: 80,
            ..Default::default()
        }),
        &caller(),
        PtyLimits::default(),
        NOW,
    )
    .unwrap();
    (id, fence)
}

fn out(id: &[u8; 16], offset: u64, data: &[u8]) -> PtyReport {
    PtyReport::Output(wire::PtyOutput {
        pty_session_id: text(id),
        offset,
        data: data.to_vec(),
        cut: None,
    })
}

#[test]
fn a_recording_gets_only_what_the_client_quota_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = StoreOptions::default();
    opts.tiers.per_owner_total = 64 * 1024;
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    let (id, fence) = terminal(&mut s);
    // 200 KiB of output against a 64 KiB quota with a 64 MiB recording cap
    for i in 0..50u64 {
        s.pty_apply(
            CLIENT,
            Some(&fence),
            &[out(&id, i * 4096, &[b'x'; 4096])],
            64 << 20,
            NOW,
        )
        .unwrap();
    }
    let info = s.reader().unwrap().pty_session(&id).unwrap();
    assert_eq!(
        info.output_offset,
        50 * 4096,
        "the offset counts every byte"
    );
    assert!(
        info.recorded_bytes <= 64 * 1024,
        "kept {} bytes over a 64 KiB quota",
        info.recorded_bytes
    );
    // what was dropped is marked: the first output kept is past the start
    let kept = s.reader().unwrap().pty_records(&id, 0, 1 << 20).unwrap();
    let first_output = kept
        .iter()
        .find_map(|r| match r.kind {
            PtyRecordKind::Output { offset } => Some(offset),
            _ => None,
        })
        .unwrap();
    assert!(first_output > 0);
}

#[test]
fn a_closed_terminal_goes_with_its_recording_after_the_retention() {
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        terminal_retention_ms: 60_000,
        ..Default::default()
    };
    let mut s = open_with(dir.path(), Arc::new(rvbox_store::fs::RealFs), opts);
    let (open_id, _) = terminal(&mut s);
    let (closed_id, fence) = terminal(&mut s);
    s.pty_apply(
        CLIENT,
        Some(&fence),
        &[
            out(&closed_id, 0, b"bye"),
            PtyReport::Closed(wire::PtyClosed {
                pty_session_id: text(&closed_id),
                exit_result: None,
                final_offset: 3,
                reason: "shell exited".into(),
            }),
        ],
        64 << 20,
        NOW,
    )
    .unwrap();
    // within the retention: kept
    s.maintain(NOW + 30_000).unwrap();
    assert!(s.reader().unwrap().pty_session(&closed_id).is_ok());
    // past it: gone, records and all; the open one stays
    let report = s.maintain(NOW + 120_000).unwrap();
    assert_eq!(report.terminals_pruned, 1);
    assert!(s.reader().unwrap().pty_session(&closed_id).is_err());
    assert!(
        s.reader()
            .unwrap()
            .pty_records(&closed_id, 0, 1 << 20)
            .is_err()
    );
    assert!(s.reader().unwrap().pty_session(&open_id).is_ok());
}
