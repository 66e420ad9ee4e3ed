//! Cases over the control reads as well as the operations: output pages
//! and follow history, the same on every backend.

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::output::HistoryItem;
use rvbox_store::reader::ControlReads;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Backend, StoreOp};

use crate::support::*;

/// A backend and its control reads.
pub trait WithReads: Backend {
    /// The backend's control reader.
    fn reads(&mut self) -> &mut dyn ControlReads;
}

/// A running command of `web-1` with output `chunks` (event 2 on), then
/// succeeded when `end`: returns it and every event's raw output.
fn command_with_output(
    b: &mut dyn WithReads,
    chunks: &[(rvbox_segment::Stream, Vec<u8>)],
    end: bool,
) -> [u8; 16] {
    let (issue, session) = running(b, "web-1");
    let mut events = Vec::new();
    for (n, (stream, raw)) in chunks.iter().enumerate() {
        let mut ev = output_event(&issue, 2 + n as u64, raw);
        if let rvbox_store_port::events::EventBody::Output { stream: s, .. } = &mut ev.body {
            *s = *stream;
        }
        ev.session = Some(session);
        events.push(ev);
    }
    if end {
        let mut ev = lifecycle_event(&issue, 2 + chunks.len() as u64, Lifecycle::Succeeded);
        ev.session = Some(session);
        events.push(ev);
    }
    let n = events.len();
    let r = b.perform(NOW, StoreOp::AppendEvents { events });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; n]);
    issue
}

fn chunks() -> Vec<(rvbox_segment::Stream, Vec<u8>)> {
    use rvbox_segment::Stream;
    (0..6u8)
        .map(|n| {
            let stream = if n % 3 == 2 {
                Stream::Stderr
            } else {
                Stream::Stdout
            };
            let raw: Vec<u8> = (0..(700 + u32::from(n) * 300))
                .map(|i| b'a' + u8::try_from((i + u32::from(n)) % 26).unwrap_or(0))
                .collect();
            (stream, raw)
        })
        .collect()
}

/// Output comes back page by page, in event order, every byte of the
/// selected streams exactly once, and the last page of an ended command
/// says so (no token).
pub fn output_pages_return_every_byte_once_and_end_for_an_ended_command(b: &mut dyn WithReads) {
    let chunks = chunks();
    let issue = command_with_output(b, &chunks, true);
    for (streams, want) in [
        (vec![wire::OutputStream::Stdout as i32], vec![1u8]),
        (vec![wire::OutputStream::Stderr as i32], vec![2]),
        (
            vec![
                wire::OutputStream::Stdout as i32,
                wire::OutputStream::Stderr as i32,
            ],
            vec![1, 2],
        ),
    ] {
        let expected: Vec<u8> = chunks
            .iter()
            .filter(|(s, _)| want.contains(&s.as_u8()))
            .flat_map(|(_, r)| r.clone())
            .collect();
        let mut got = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let page = b
                .reads()
                .get_output(&wire::GetOutputRequest {
                    issue_uuid: text(&issue),
                    streams: streams.clone(),
                    max_bytes: 1000,
                    page_token: token.clone(),
                    ..Default::default()
                })
                .unwrap();
            pages += 1;
            assert!(pages < 50, "pages never end");
            for item in page.items {
                if let Some(wire::output_item::Item::Data(d)) = item.item {
                    got.extend_from_slice(&d.data);
                }
            }
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        assert_eq!(got, expected, "streams {streams:?}");
        assert!(pages > 1, "the page size splits the output");
    }
    // a token is bound to its command and selection
    let other = run(b, "web-1");
    let first = b
        .reads()
        .get_output(&wire::GetOutputRequest {
            issue_uuid: text(&issue),
            streams: vec![wire::OutputStream::Stdout as i32],
            max_bytes: 1000,
            page_token: String::new(),
            ..Default::default()
        })
        .unwrap();
    let stolen = b.reads().get_output(&wire::GetOutputRequest {
        issue_uuid: text(&other),
        streams: vec![wire::OutputStream::Stdout as i32],
        max_bytes: 1000,
        page_token: first.next_page_token,
        ..Default::default()
    });
    assert!(stolen.is_err(), "a token of another command: {stolen:?}");
    let missing = b.reads().get_output(&wire::GetOutputRequest {
        issue_uuid: text(&new_id()),
        streams: vec![wire::OutputStream::Stdout as i32],
        max_bytes: 1000,
        page_token: String::new(),
        ..Default::default()
    });
    assert!(missing.is_err());
}

fn seqs(items: &[HistoryItem]) -> Vec<u64> {
    items
        .iter()
        .filter_map(|i| match i {
            HistoryItem::Event(e) => Some(e.event_seq),
            _ => None,
        })
        .collect()
}

/// Follow history returns the events after any cursor, in order, output
/// still as stored, and ends with "caught up" once it reached the last
/// event; a cursor ahead of the log is reset to where the log ends.
pub fn follow_history_continues_after_any_cursor(b: &mut dyn WithReads) {
    let chunks = chunks();
    let issue = command_with_output(b, &chunks, false);
    let last = 1 + chunks.len() as u64;
    let all = b.reads().events_after(&issue, 0, 100).unwrap();
    assert_eq!(seqs(&all), (1..=last).collect::<Vec<_>>());
    assert!(matches!(
        all.last(),
        Some(HistoryItem::CaughtUp { last_event_seq }) if *last_event_seq == last
    ));
    let part = b.reads().events_after(&issue, 3, 2).unwrap();
    assert_eq!(seqs(&part), vec![4, 5], "a batch stops at its limit");
    assert!(
        !matches!(part.last(), Some(HistoryItem::CaughtUp { .. })),
        "and does not claim to be caught up"
    );
    let ahead = b.reads().events_after(&issue, last + 10, 100).unwrap();
    assert!(matches!(
        ahead.first(),
        Some(HistoryItem::Reset(r)) if r.resumed_after_event_seq == last
    ));
    // the bytes come back exactly as stored
    let Some(HistoryItem::Event(e)) = all.get(1) else {
        panic!("{all:?}")
    };
    let rvbox_store::output::HistoryBody::Output {
        raw_len, stored, ..
    } = &e.body
    else {
        panic!("{e:?}")
    };
    let raw = zstd::bulk::decompress(stored, *raw_len as usize).unwrap();
    assert_eq!(raw, chunks[0].1);
}

/// A command's record says what happened to it: its lifecycle, revision,
/// times, exit, the stored range of its events, its spec, and a
/// rejection's reason; an unknown id is `NOT_FOUND`.
pub fn a_command_record_says_what_happened_to_it(b: &mut dyn WithReads) {
    let chunks = chunks();
    let done = command_with_output(b, &chunks, true);
    let r = b.reads().command_record(&done).unwrap();
    assert_eq!(r.issue_uuid, text(&done));
    assert_eq!(r.client_id, "web-1");
    assert_eq!(r.lifecycle, wire::Lifecycle::Succeeded as i32);
    assert_eq!(r.last_event_seq, 2 + chunks.len() as u64);
    let range = r.retained_range.unwrap();
    assert_eq!(
        (range.first_event_seq, range.last_event_seq),
        (1, 2 + chunks.len() as u64)
    );
    assert_eq!(
        r.exit_result.map(|e| e.lifecycle),
        Some(wire::Lifecycle::Succeeded as i32)
    );
    assert!(r.terminal_time.is_some());
    assert!(!r.terminal_output_incomplete);
    assert_eq!(r.retention_status, wire::RetentionStatus::Complete as i32);
    assert!(r.spec.is_some_and(|s| s.source.is_some()));
    assert_eq!(r.request_hash.len(), 32);

    let s = live_session(b, "web-2");
    let rejected = run(b, "web-2");
    dispatch(b, &rejected, s);
    let op = b.perform(
        NOW,
        StoreOp::FinishByServer {
            issue: rejected,
            from: vec![Lifecycle::Dispatched],
            revision: 1,
            how: rvbox_store_port::commands::ServerTerminal::Rejected,
            rejection: Some(wire::ErrorDetail {
                code: wire::ErrorCode::Unsupported as i32,
                reason: "no such shell".into(),
                ..Default::default()
            }),
            session: Some(s),
        },
    );
    assert!(op.is_ok(), "{op:?}");
    let r = b.reads().command_record(&rejected).unwrap();
    assert_eq!(r.lifecycle, wire::Lifecycle::Rejected as i32);
    assert_eq!(
        r.rejection.map(|d| d.reason),
        Some("no such shell".to_owned())
    );
    assert_eq!(r.last_event_seq, 0);
    assert_eq!(
        r.retained_range
            .map(|x| (x.first_event_seq, x.last_event_seq)),
        Some((0, 0))
    );
    assert!(b.reads().command_record(&new_id()).is_err());
}

/// Commands are listed newest first, page by page, every one exactly once,
/// of one client or of all, and only of clients whose labels match a
/// selector when one is given.
pub fn commands_are_listed_newest_first_page_by_page(b: &mut dyn WithReads) {
    let mut prod = registration("db-1", INSTANCE, None);
    prod.labels = "env=prod".into();
    assert!(b.perform(NOW, StoreOp::Register(prod)).is_ok());
    let mut made: Vec<([u8; 16], &str)> = Vec::new();
    for n in 0..7i64 {
        let client = if n % 2 == 0 { "web-1" } else { "db-1" };
        let id = new_id();
        let r = b.perform(
            NOW + n,
            StoreOp::RunCommand {
                request: run_request(&id, client, "true"),
                caller: rvbox_store_port::audit::Caller::local(),
            },
        );
        assert!(r.is_ok(), "{r:?}");
        made.push((id, client));
    }
    let list = |b: &mut dyn WithReads, client: Option<&str>, selector: &str| {
        let mut out = Vec::new();
        let mut token = String::new();
        for _ in 0..20 {
            let page = b
                .reads()
                .list_commands(&wire::ListCommandsRequest {
                    client_id: client.map(str::to_owned),
                    page_size: 2,
                    page_token: token.clone(),
                    selector: selector.into(),
                    ..Default::default()
                })
                .unwrap();
            assert!(page.commands.len() <= 2);
            out.extend(page.commands.into_iter().map(|c| c.issue_uuid));
            if page.next_page_token.is_empty() {
                return out;
            }
            token = page.next_page_token;
        }
        panic!("pages never end");
    };
    let newest_first = |filter: &dyn Fn(&str) -> bool| -> Vec<String> {
        made.iter()
            .rev()
            .filter(|(_, c)| filter(c))
            .map(|(id, _)| text(id))
            .collect()
    };
    assert_eq!(list(b, None, ""), newest_first(&|_| true));
    assert_eq!(list(b, Some("web-1"), ""), newest_first(&|c| c == "web-1"));
    assert_eq!(list(b, None, "env=prod"), newest_first(&|c| c == "db-1"));
    // a token is bound to its filters
    let first = b
        .reads()
        .list_commands(&wire::ListCommandsRequest {
            client_id: None,
            page_size: 2,
            ..Default::default()
        })
        .unwrap();
    let other = b.reads().list_commands(&wire::ListCommandsRequest {
        client_id: Some("web-1".into()),
        page_size: 2,
        page_token: first.next_page_token,
        ..Default::default()
    });
    assert!(other.is_err(), "{other:?}");
}
