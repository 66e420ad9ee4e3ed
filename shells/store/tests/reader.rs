#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Control reads on the read-only connection (plan §6.1: control reads
//! never wait behind the writer): they answer while the writer is inside
//! a group commit, see only committed state, and a read that meets a
//! segment file removed under its snapshot is retried on a fresh one.

mod support;

use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::StoreOptions;
use rvbox_store::fs::{FaultKind, FaultOp, FaultyFs};
use rvbox_store::mutations::OpError;
use rvbox_store::output::HistoryItem;
use rvbox_store::reader::{READ_ATTEMPTS, StoreReader};
use support::*;

fn request(id: &[u8; 16]) -> wire::GetOutputRequest {
    wire::GetOutputRequest {
        request_id: String::new(),
        issue_uuid: text(id),
        streams: vec![
            wire::OutputStream::Stdout as i32,
            wire::OutputStream::Stderr as i32,
        ],
        max_bytes: 1 << 20,
        page_token: String::new(),
    }
}

fn data_seqs(page: &wire::GetOutputResponse) -> Vec<u64> {
    page.items
        .iter()
        .filter_map(|i| match &i.item {
            Some(wire::output_item::Item::Data(d)) => Some(d.event_seq),
            _ => None,
        })
        .collect()
}

fn history_seqs(items: &[HistoryItem]) -> Vec<u64> {
    items
        .iter()
        .filter_map(|i| match i {
            HistoryItem::Event(e) => Some(e.event_seq),
            _ => None,
        })
        .collect()
}

#[test]
fn control_reads_answer_while_the_writer_is_inside_a_group_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, &chunk(2, 3000))], NOW)
        .unwrap();
    let reader = s.reader().unwrap();

    let (park, reached, release) = Park::at(rvbox_store::crash::points::EVENT_AFTER_FSYNC);
    s.set_crash_hook(park);
    let writer = std::thread::spawn(move || {
        let batch: Vec<_> = (3..=6).map(|n| output(&id, n, &chunk(n, 3000))).collect();
        s.append_events(&batch, NOW).unwrap();
        s
    });
    reached.recv().unwrap();

    // the writer holds its group between fsync and commit: every control
    // read still answers, from the last committed state only
    assert_eq!(
        data_seqs(&reader.get_output(&request(&id)).unwrap()),
        vec![2]
    );
    assert_eq!(
        history_seqs(&reader.events_after(&id, 0, 100).unwrap()),
        vec![1, 2]
    );
    assert_eq!(reader.command_view(&id).unwrap().last_event_seq, 2);
    assert!(reader.list_incidents(None, None, 10).unwrap().is_empty());

    release.send(()).unwrap();
    let s = writer.join().unwrap();
    assert_eq!(
        data_seqs(&reader.get_output(&request(&id)).unwrap()),
        vec![2, 3, 4, 5, 6]
    );
    assert_eq!(
        history_seqs(&reader.events_after(&id, 4, 100).unwrap()),
        vec![5, 6]
    );
    assert_eq!(reader.command_view(&id).unwrap().last_event_seq, 6);
    assert_counters(&s);
}

#[test]
fn a_segment_removed_under_a_read_is_read_again_on_a_fresh_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_events(&[output(&id, 2, &chunk(2, 3000))], NOW)
        .unwrap();
    let fs = Arc::new(FaultyFs::new());
    let reader = StoreReader::open(
        s.layout(),
        fs.clone(),
        s.token_key(),
        StoreOptions::default().db,
        s.health(),
    )
    .unwrap();

    // one vanished file: the retry answers in full
    fs.inject(FaultOp::Open, FaultKind::NotFound);
    assert_eq!(
        data_seqs(&reader.get_output(&request(&id)).unwrap()),
        vec![2]
    );
    fs.inject(FaultOp::Open, FaultKind::NotFound);
    assert_eq!(
        history_seqs(&reader.events_after(&id, 0, 100).unwrap()),
        vec![1, 2]
    );

    // a file that stays gone is an error that names it, never a short page
    for _ in 0..READ_ATTEMPTS {
        fs.inject(FaultOp::Open, FaultKind::NotFound);
    }
    match reader.get_output(&request(&id)) {
        Err(OpError::Store(e)) => {
            assert!(e.to_string().contains("open segment for reading"), "{e}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }

    // other failures are not retried
    fs.inject(FaultOp::Open, FaultKind::Io);
    assert!(matches!(
        reader.get_output(&request(&id)),
        Err(OpError::Store(_))
    ));
    assert_eq!(
        data_seqs(&reader.get_output(&request(&id)).unwrap()),
        vec![2]
    );
}

#[test]
fn the_reader_refuses_unknown_commands_and_bad_requests_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let reader = s.reader().unwrap();
    let unknown = new_id();
    match reader.command_view(&unknown) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::NotFound),
        other => panic!("expected NOT_FOUND, got {other:?}"),
    }
    match reader.get_output(&request(&unknown)) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::NotFound),
        other => panic!("expected NOT_FOUND, got {other:?}"),
    }
    let mut bad = request(&unknown);
    bad.issue_uuid = "not-a-uuid".into();
    match reader.get_output(&bad) {
        Err(OpError::Refused(e)) => {
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.to_string().contains("issue_uuid"), "{e}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
}
