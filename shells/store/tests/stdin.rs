#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! `AppendStdin` and `CloseStdin` on real SQLite (plan §5.2
//! `stdin_writes`, §9.1): numbered writes of at most 256 KiB, idempotent
//! by `request_id` across a reopen, bounded while unacknowledged, settled
//! by the client's `StdinAck` events (which free the payload's charge),
//! and discarded when the command ends.

mod support;

use prost::Message as _;
use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store::mutations::OpError;
use rvbox_store::operator::Caller;
use rvbox_store::stdin::{MAX_PENDING_STDIN_WRITES, StdinResponse};
use support::*;

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

fn append(id: &[u8; 16], data: &[u8], newline: wire::StdinNewline) -> wire::AppendStdinRequest {
    wire::AppendStdinRequest {
        request_id: text(&new_id()),
        issue_uuid: text(id),
        data: data.to_vec(),
        newline: newline as i32,
    }
}

fn close(id: &[u8; 16]) -> wire::CloseStdinRequest {
    wire::CloseStdinRequest {
        request_id: text(&new_id()),
        issue_uuid: text(id),
    }
}

fn appended(r: &StdinResponse) -> &wire::AppendStdinResponse {
    match r {
        StdinResponse::Append(a) => a,
        StdinResponse::Close(_) => panic!("an append answered as a close"),
    }
}

fn ack(id: &[u8; 16], seq: u64, write_seq: u64, delivery: wire::StdinDelivery) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: *id,
        event_seq: seq,
        observed_ms: NOW,
        body: EventBody::Other {
            kind: rvbox_store_port::events::body_kind::STDIN_ACK,
            encoded: wire::StdinAck {
                write_seq,
                delivery: delivery as i32,
                closed: false,
                reason: String::new(),
            }
            .encode_to_vec(),
        },
    }
}

fn charged(s: &Store, id: &[u8; 16]) -> i64 {
    s.db()
        .query_row(
            "SELECT charged_bytes FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap()
}

fn op() -> Caller {
    Caller::local()
}

#[test]
fn an_append_is_split_into_numbered_writes_the_newline_on_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let data: Vec<u8> = (0..600 * 1024).map(|i| (i % 251) as u8).collect();
    let out = s
        .append_stdin_as(&append(&id, &data, wire::StdinNewline::Append), &op(), NOW)
        .unwrap();
    let r = appended(&out.response);
    assert_eq!((r.first_write_seq, r.last_write_seq), (1, 3));
    assert_eq!(r.delivery, wire::StdinDelivery::Pending as i32);
    assert_eq!(out.lifecycle, Lifecycle::Running);
    let pending = s.pending_stdin(&id, 0, u64::MAX, 100).unwrap();
    assert!(!pending.more);
    let w = &pending.writes;
    assert_eq!(
        w.iter()
            .map(|w| (w.write_seq, w.raw_length, w.newline))
            .collect::<Vec<_>>(),
        vec![
            (1, 262_144, wire::StdinNewline::Raw as i32),
            (2, 262_144, wire::StdinNewline::Raw as i32),
            (3, 90_112, wire::StdinNewline::Append as i32),
        ]
    );
    // each decodes to its raw bytes and digest (zstd where it helps)
    let mut joined = Vec::new();
    for w in w {
        assert_eq!(w.stored_length as usize, w.payload.len());
        let raw = if w.compression == wire::Compression::Zstd as i32 {
            zstd::bulk::decompress(&w.payload, w.raw_length as usize).unwrap()
        } else {
            w.payload.clone()
        };
        assert_eq!(
            rvbox_segment::sha256(&raw).as_slice(),
            w.raw_sha256.as_slice()
        );
        joined.extend(raw);
    }
    assert_eq!(joined, data);
    // the window bounds a read, and says more follow
    let part = s.pending_stdin(&id, 0, 300 * 1024, 100).unwrap();
    assert_eq!(part.writes.len(), 1);
    assert!(part.more);
    let after = s.pending_stdin(&id, 1, u64::MAX, 1).unwrap();
    assert_eq!(after.writes[0].write_seq, 2);
    assert!(after.more);
    assert_counters(&s);
}

#[test]
fn a_replay_after_a_reopen_writes_nothing_twice_and_reports_the_delivery_since() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let req = append(&id, b"hello", wire::StdinNewline::Append);
    let first = s.append_stdin_as(&req, &op(), NOW).unwrap();
    assert!(!first.replayed);
    drop(s);
    let mut s = open(dir.path());
    let again = s.append_stdin_as(&req, &op(), NOW + 1).unwrap();
    assert!(again.replayed);
    assert_eq!(again.response, first.response);
    assert_eq!(
        s.pending_stdin(&id, 0, u64::MAX, 100).unwrap().writes.len(),
        1
    );
    // the client writes it: a replay now says so
    let r = s
        .append_events(&[ack(&id, 2, 1, wire::StdinDelivery::Written)], NOW + 2)
        .unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    let settled = s.append_stdin_as(&req, &op(), NOW + 3).unwrap();
    assert_eq!(
        appended(&settled.response).delivery,
        wire::StdinDelivery::Written as i32
    );
    assert!(
        s.pending_stdin(&id, 0, u64::MAX, 100)
            .unwrap()
            .writes
            .is_empty()
    );
    // the same id for other data is a conflict, and no work
    let other = wire::AppendStdinRequest {
        data: b"other".to_vec(),
        ..req.clone()
    };
    assert_eq!(
        code(s.append_stdin_as(&other, &op(), NOW + 4).unwrap_err()),
        Code::Conflict
    );
    // the next append continues the numbering
    let next = s
        .append_stdin_as(&append(&id, b"x", wire::StdinNewline::Raw), &op(), NOW + 5)
        .unwrap();
    assert_eq!(appended(&next.response).first_write_seq, 2);
    assert_counters(&s);
}

#[test]
fn an_acknowledgement_frees_the_payload_and_a_repeat_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let before = charged(&s, &id);
    let data = chunk(1, 200 * 1024); // incompressible
    s.append_stdin_as(&append(&id, &data, wire::StdinNewline::Raw), &op(), NOW)
        .unwrap();
    let with = charged(&s, &id);
    assert!(with - before > 200 * 1024, "the payload is charged");
    s.append_events(&[ack(&id, 2, 1, wire::StdinDelivery::Written)], NOW)
        .unwrap();
    let after = charged(&s, &id);
    let c = |kind, bytes| {
        i64::try_from(
            rvbox_retention::charge(rvbox_retention::CHARGE_VERSION, kind, bytes).unwrap(),
        )
        .unwrap()
    };
    let EventBody::Other { encoded, .. } = ack(&id, 2, 1, wire::StdinDelivery::Written).body else {
        unreachable!()
    };
    // what stays: the stored result, the write's row remainder and the
    // acknowledgement event's own row
    assert_eq!(
        after - before,
        c(rvbox_retention::ChargeKind::MutationRow, 0)
            + c(rvbox_retention::ChargeKind::EventRow, 0)
            + c(rvbox_retention::ChargeKind::EventRow, encoded.len() as u64),
        "{before} {with} {after}"
    );
    let payload: Vec<u8> = s
        .db()
        .query_row(
            "SELECT payload FROM stdin_writes WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    assert!(payload.is_empty());
    // a second acknowledgement of the same write (another event) frees
    // nothing more
    s.append_events(&[ack(&id, 3, 1, wire::StdinDelivery::Written)], NOW)
        .unwrap();
    assert!(charged(&s, &id) >= after);
    assert_counters(&s);
}

#[test]
fn an_acknowledgement_of_a_write_never_assigned_is_a_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let r = s
        .append_events(&[ack(&id, 2, 7, wire::StdinDelivery::Written)], NOW)
        .unwrap();
    assert!(matches!(&r.outcomes[0], EventOutcome::Refused(e) if e.code() == Code::ProtocolError));
    s.append_stdin_as(&append(&id, b"a", wire::StdinNewline::Raw), &op(), NOW)
        .unwrap();
    let r = s
        .append_events(&[ack(&id, 2, 1, wire::StdinDelivery::Pending)], NOW)
        .unwrap();
    assert!(
        matches!(&r.outcomes[0], EventOutcome::Refused(e) if e.code() == Code::ProtocolError),
        "PENDING is never an acknowledgement"
    );
}

#[test]
fn close_ends_further_appends_and_the_end_of_the_command_discards_what_waits() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    s.append_stdin_as(&append(&id, b"one", wire::StdinNewline::Append), &op(), NOW)
        .unwrap();
    let closed = s.close_stdin_as(&close(&id), &op(), NOW).unwrap();
    let StdinResponse::Close(c) = &closed.response else {
        panic!("a close answered as an append");
    };
    assert_eq!(c.write_seq, 2);
    let w = s.pending_stdin(&id, 0, u64::MAX, 100).unwrap().writes;
    assert!(w[1].close_after && w[1].payload.is_empty());
    let e = s
        .append_stdin_as(&append(&id, b"late", wire::StdinNewline::Raw), &op(), NOW)
        .unwrap_err()
        .to_domain();
    assert_eq!(
        (e.code(), e.field()),
        (Code::FailedPrecondition, "issue_uuid")
    );
    assert_eq!(
        code(s.close_stdin_as(&close(&id), &op(), NOW).unwrap_err()),
        Code::FailedPrecondition
    );
    // the command ends before its client acknowledged anything
    s.append_events(&[lifecycle(&id, 2, Lifecycle::Succeeded)], NOW)
        .unwrap();
    assert!(
        s.pending_stdin(&id, 0, u64::MAX, 100)
            .unwrap()
            .writes
            .is_empty()
    );
    let deliveries: Vec<i64> = s
        .db()
        .prepare("SELECT delivery FROM stdin_writes WHERE issue_uuid = ?1 ORDER BY write_seq")
        .unwrap()
        .query_map([id.as_slice()], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(deliveries, vec![3, 3], "discarded");
    let e = s
        .append_stdin_as(&append(&id, b"x", wire::StdinNewline::Raw), &op(), NOW)
        .unwrap_err()
        .to_domain();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.to_string().contains("ended"), "{e}");
    assert_counters(&s);
}

#[test]
fn stdin_written_before_the_process_runs_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = new_id();
    s.run_command(&run_request(&id, "web-1", "cat"), NOW)
        .unwrap();
    let out = s
        .append_stdin_as(
            &append(&id, b"early", wire::StdinNewline::Append),
            &op(),
            NOW,
        )
        .unwrap();
    assert_eq!(out.lifecycle, Lifecycle::Queued);
    assert!(!rvbox_store_port::stdin::deliverable(out.lifecycle));
    // nothing goes before the process runs (the client writes only into a
    // running process)
    assert!(
        s.pending_stdin(&id, 0, u64::MAX, 100)
            .unwrap()
            .writes
            .is_empty()
    );
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    assert!(
        s.pending_stdin(&id, 0, u64::MAX, 100)
            .unwrap()
            .writes
            .is_empty()
    );
    s.append_events(&[lifecycle(&id, 1, Lifecycle::Running)], NOW)
        .unwrap();
    assert!(rvbox_store_port::stdin::deliverable(Lifecycle::Running));
    assert_eq!(
        s.pending_stdin(&id, 0, u64::MAX, 100).unwrap().writes.len(),
        1
    );
}

#[test]
fn the_pending_bound_refuses_without_storing_and_the_request_id_stays_usable() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    for _ in 0..MAX_PENDING_STDIN_WRITES {
        s.append_stdin_as(&append(&id, b"a", wire::StdinNewline::Raw), &op(), NOW)
            .unwrap();
    }
    let req = append(&id, b"one more", wire::StdinNewline::Raw);
    let e = s.append_stdin_as(&req, &op(), NOW).unwrap_err().to_domain();
    assert_eq!((e.code(), e.field()), (Code::CapacityExhausted, "data"));
    // the client catches up: the same request now goes through
    let acks: Vec<EventAppend> = (1..=MAX_PENDING_STDIN_WRITES)
        .map(|w| ack(&id, w + 1, w, wire::StdinDelivery::Written))
        .collect();
    s.append_events(&acks, NOW).unwrap();
    let ok = s.append_stdin_as(&req, &op(), NOW).unwrap();
    assert_eq!(
        appended(&ok.response).first_write_seq,
        MAX_PENDING_STDIN_WRITES + 1
    );
    assert_counters(&s);
}

#[test]
fn malformed_requests_name_the_field_and_store_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let mut bad = append(&id, b"x", wire::StdinNewline::Raw);
    bad.request_id = "nope".into();
    let e = s.append_stdin_as(&bad, &op(), NOW).unwrap_err().to_domain();
    assert_eq!((e.code(), e.field()), (Code::InvalidArgument, "request_id"));
    let e = s
        .append_stdin_as(
            &append(&id, b"x", wire::StdinNewline::Unspecified),
            &op(),
            NOW,
        )
        .unwrap_err()
        .to_domain();
    assert_eq!((e.code(), e.field()), (Code::InvalidArgument, "newline"));
    let e = s
        .append_stdin_as(&append(&id, b"", wire::StdinNewline::Raw), &op(), NOW)
        .unwrap_err()
        .to_domain();
    assert_eq!((e.code(), e.field()), (Code::InvalidArgument, "data"));
    let big = vec![0u8; 1024 * 1024 + 1];
    let e = s
        .append_stdin_as(&append(&id, &big, wire::StdinNewline::Raw), &op(), NOW)
        .unwrap_err()
        .to_domain();
    assert_eq!((e.code(), e.field()), (Code::TooLarge, "data"));
    assert_eq!(
        code(
            s.append_stdin_as(
                &append(&new_id(), b"x", wire::StdinNewline::Raw),
                &op(),
                NOW
            )
            .unwrap_err()
        ),
        Code::NotFound
    );
    let rows: i64 = s
        .db()
        .query_row("SELECT COUNT(*) FROM stdin_writes", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rows, 0);
}
