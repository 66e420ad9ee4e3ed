#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Reading output back on real files (plan §9.1 `GetOutput`/`FollowCommand`,
//! wire contract P-CT-036..049, spec-mapping R1): paging reproduces the
//! appended bytes exactly, events split across pages resume at their byte
//! offset, the snapshot boundary keeps pages stable under appends, tokens
//! are refused when misused, removed output is reported explicitly (never
//! a silent gap), and every record read is verified. Every test ends with
//! the counters equal to a recount.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message as _;
use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::token::{OutputPosition, TokenCodec, TokenKey, TokenKind};
use rvbox_proto::v1 as wire;
use rvbox_retention::Tiers;
use rvbox_segment::{Compression, Stream};
use rvbox_store::events::{EventAppend, EventBody, EventOutcome, body_kind};
use rvbox_store::fs::RealFs;
use rvbox_store::mutations::OpError;
use rvbox_store::output::{HistoryBody, HistoryItem, output_filters};
use rvbox_store::{Store, StoreOptions};
use support::*;

const KIB: u64 = 1024;
const STDOUT: i32 = wire::OutputStream::Stdout as i32;
const STDERR: i32 = wire::OutputStream::Stderr as i32;
const RECEIPT: i64 = NOW + 1_000;

fn request(id: &[u8; 16], streams: &[i32], max_bytes: u32, token: &str) -> wire::GetOutputRequest {
    wire::GetOutputRequest {
        request_id: String::new(),
        issue_uuid: text(id),
        streams: streams.to_vec(),
        max_bytes,
        page_token: token.into(),
    }
}

fn append(s: &mut Store, batch: &[EventAppend]) {
    let r = s.append_events(batch, RECEIPT).unwrap();
    assert!(
        r.outcomes.iter().all(|o| *o == EventOutcome::Appended),
        "{:?}",
        r.outcomes
    );
}

/// Appends output `from..=to` (one batch each, `len` bytes); stdout for
/// even sequences, stderr for odd (support::output).
fn fill(s: &mut Store, id: &[u8; 16], from: u64, to: u64, len: usize) {
    for q in from..=to {
        append(s, &[output(id, q, &chunk(q, len))]);
    }
}

fn stream_of(seq: u64) -> i32 {
    if seq.is_multiple_of(2) {
        STDOUT
    } else {
        STDERR
    }
}

/// The bytes the selection should return for events `seqs`, per event.
fn expected(seqs: impl IntoIterator<Item = u64>, len: usize, streams: &[i32]) -> Vec<u8> {
    seqs.into_iter()
        .filter(|q| streams.contains(&stream_of(*q)))
        .flat_map(|q| chunk(q, len))
        .collect()
}

#[derive(Debug, Default)]
struct Collected {
    /// Raw bytes per event, in the order received.
    data: BTreeMap<u64, Vec<u8>>,
    /// All data in arrival order.
    all: Vec<u8>,
    markers: Vec<wire::ReceivedEvent>,
    retention: Vec<wire::RetentionTruncation>,
    pages: usize,
    last: Option<wire::GetOutputResponse>,
}

impl Collected {
    fn take(&mut self, page: wire::GetOutputResponse, max_bytes: u32) {
        use wire::output_item::Item;
        self.pages += 1;
        let mut bytes = 0usize;
        for item in &page.items {
            match item.item.as_ref().unwrap() {
                Item::Data(d) => {
                    let have = self.data.entry(d.event_seq).or_default();
                    // an event continues exactly where the previous page stopped
                    assert_eq!(d.offset as usize, have.len(), "event {}", d.event_seq);
                    assert!(!d.data.is_empty());
                    assert_eq!(d.stream, stream_of(d.event_seq));
                    // client-observed and server-receipt times are separate fields
                    let observed = d.observed_time.unwrap();
                    let receipt = d.receipt_time.unwrap();
                    assert_eq!(
                        observed.seconds * 1000 + i64::from(observed.nanos / 1_000_000),
                        NOW + i64::try_from(d.event_seq).unwrap()
                    );
                    assert_eq!(
                        receipt.seconds * 1000 + i64::from(receipt.nanos / 1_000_000),
                        RECEIPT
                    );
                    have.extend_from_slice(&d.data);
                    self.all.extend_from_slice(&d.data);
                    bytes += d.data.len();
                }
                Item::Marker(m) => self.markers.push(m.clone()),
                Item::Retention(r) => self.retention.push(r.clone()),
            }
        }
        // 0 asks for the 1 MiB default
        let cap = if max_bytes == 0 {
            1 << 20
        } else {
            max_bytes as usize
        };
        assert!(bytes <= cap, "page holds {bytes} > {cap}");
        self.last = Some(page);
    }
}

/// Pages from `token` until the token is empty or a page comes back empty
/// (the end of a pass of a live command); returns the last token.
fn page_all(
    s: &Store,
    id: &[u8; 16],
    streams: &[i32],
    max_bytes: u32,
    token: &str,
    out: &mut Collected,
) -> String {
    let mut token = token.to_string();
    for _ in 0..100_000 {
        let page = s
            .get_output(&request(id, streams, max_bytes, &token))
            .unwrap();
        let empty = page.items.is_empty();
        let next = page.next_page_token.clone();
        out.take(page, max_bytes);
        if next.is_empty() || (empty && next == token) {
            return next;
        }
        token = next;
    }
    panic!("paging did not end");
}

fn refused(r: Result<wire::GetOutputResponse, OpError>) -> (Code, String) {
    match r {
        Err(OpError::Refused(e)) => (e.code(), e.field().to_string()),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn truncation_body(streams: &[i32]) -> Vec<u8> {
    wire::OutputTruncation {
        source: wire::TruncationSource::ClientSpool as i32,
        streams: streams.to_vec(),
        reason: "client spool full".into(),
        first_removed_event_seq: None,
        last_removed_event_seq: None,
        raw_bytes: 123,
        compressed_bytes: None,
        first_observed_time: None,
        last_observed_time: None,
    }
    .encode_to_vec()
}

fn marker(id: &[u8; 16], seq: u64, streams: &[i32]) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: *id,
        event_seq: seq,
        observed_ms: NOW + i64::try_from(seq).unwrap(),
        body: EventBody::Other {
            kind: body_kind::TRUNCATION,
            encoded: truncation_body(streams),
        },
    }
}

fn finish(s: &mut Store, id: &[u8; 16], seq: u64) {
    append(s, &[lifecycle(id, seq, Lifecycle::Succeeded)]);
}

#[test]
fn paging_in_small_pages_reproduces_the_appended_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    // events 2..=20 of varying lengths, a stderr-only client marker at 21,
    // one uncompressed chunk at 22, then the terminal event at 23
    let len = |q: u64| 100 + usize::try_from(q * 37 % 900).unwrap();
    for q in 2..=20 {
        append(&mut s, &[output(&id, q, &chunk(q, len(q)))]);
    }
    append(&mut s, &[marker(&id, 21, &[STDERR])]);
    let plain = chunk(22, 333);
    append(
        &mut s,
        &[EventAppend {
            session: None,
            issue_uuid: id,
            event_seq: 22,
            observed_ms: NOW + 22,
            body: EventBody::Output {
                stream: Stream::Stdout,
                compression: Compression::None,
                raw_len: 333,
                stored: plain.clone(),
            },
        }],
    );
    finish(&mut s, &id, 23);

    for (streams, max) in [
        (vec![STDOUT, STDERR], 100u32),
        (vec![STDOUT, STDERR], 777),
        (vec![STDOUT], 250),
        (vec![STDERR], 1),
        (vec![STDOUT, STDERR], 0), // the 1 MiB default: one page
    ] {
        let mut got = Collected::default();
        let end = page_all(&s, &id, &streams, max, "", &mut got);
        assert!(
            end.is_empty(),
            "a terminal command's last page has no token"
        );
        let mut want: Vec<u8> = (2..=20)
            .filter(|q| streams.contains(&stream_of(*q)))
            .flat_map(|q| chunk(q, len(q)))
            .collect();
        if streams.contains(&STDOUT) {
            want.extend_from_slice(&plain);
        }
        assert_eq!(got.all, want, "streams {streams:?} max {max}");
        // the client marker touches stderr only
        let markers: Vec<u64> = got
            .markers
            .iter()
            .map(|m| m.event.as_ref().unwrap().event_seq)
            .collect();
        if streams.contains(&STDERR) {
            assert_eq!(markers, vec![21]);
            let ev = got.markers[0].event.as_ref().unwrap();
            match ev.body.as_ref().unwrap() {
                wire::command_event::Body::Truncation(t) => assert_eq!(t.raw_bytes, 123),
                other => panic!("{other:?}"),
            }
            assert!(got.markers[0].receipt_time.is_some());
        } else {
            assert!(markers.is_empty());
        }
        assert!(got.retention.is_empty());
        if max == 0 {
            assert_eq!(got.pages, 1);
        }
        let range = got.last.as_ref().unwrap().retained_range.unwrap();
        let first = if streams == [STDERR] { 3 } else { 2 };
        let last = if streams.contains(&STDOUT) { 22 } else { 19 };
        assert_eq!((range.first_event_seq, range.last_event_seq), (first, last));
    }
    assert_counters(&s);
}

#[test]
fn an_event_split_across_pages_resumes_at_its_byte_offset() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let big = chunk(2, 10_000);
    append(&mut s, &[output(&id, 2, &big)]);
    append(&mut s, &[output(&id, 3, &chunk(3, 10))]);

    let p1 = s
        .get_output(&request(&id, &[STDOUT, STDERR], 4096, ""))
        .unwrap();
    assert_eq!(p1.items.len(), 1);
    let Some(wire::output_item::Item::Data(d)) = &p1.items[0].item else {
        panic!("{:?}", p1.items)
    };
    assert_eq!(
        (d.event_seq, d.offset, d.data.as_slice()),
        (2, 0, &big[..4096])
    );
    // the token carries the byte offset inside event 2
    let codec = TokenCodec::new(TokenKey::new(s.token_key()));
    let pos = OutputPosition::decode(
        &codec
            .open(
                TokenKind::Output,
                &output_filters(&id, 3),
                &p1.next_page_token,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (
            pos.issue_uuid,
            pos.event_seq,
            pos.byte_offset,
            pos.snapshot_seq
        ),
        (id, 2, 4096, 3)
    );

    let p2 = s
        .get_output(&request(&id, &[STDOUT, STDERR], 4096, &p1.next_page_token))
        .unwrap();
    let Some(wire::output_item::Item::Data(d)) = &p2.items[0].item else {
        panic!()
    };
    assert_eq!(
        (d.event_seq, d.offset, d.data.as_slice()),
        (2, 4096, &big[4096..8192])
    );
    // the last page finishes event 2 and holds event 3 whole
    let p3 = s
        .get_output(&request(&id, &[STDOUT, STDERR], 4096, &p2.next_page_token))
        .unwrap();
    let datas: Vec<(u64, u32, usize)> = p3
        .items
        .iter()
        .map(|i| match i.item.as_ref().unwrap() {
            wire::output_item::Item::Data(d) => (d.event_seq, d.offset, d.data.len()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(datas, vec![(2, 8192, 10_000 - 8192), (3, 0, 10)]);
    // a live command: the token continues after the boundary
    assert!(!p3.next_page_token.is_empty());
    let p4 = s
        .get_output(&request(&id, &[STDOUT, STDERR], 4096, &p3.next_page_token))
        .unwrap();
    assert!(p4.items.is_empty());
    assert_counters(&s);
}

#[test]
fn appends_between_pages_neither_duplicate_nor_skip() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 11, 1000);
    let both = [STDOUT, STDERR];

    let mut got = Collected::default();
    let p1 = s.get_output(&request(&id, &both, 2500, "")).unwrap();
    let t1 = p1.next_page_token.clone();
    got.take(p1, 2500);
    // events arrive between pages
    fill(&mut s, &id, 12, 15, 1000);
    // the pass ends at its boundary (event 11) even with room for more
    let p2 = s.get_output(&request(&id, &both, 1 << 20, &t1)).unwrap();
    let t2 = p2.next_page_token.clone();
    assert_eq!(p2.retained_range.unwrap().last_event_seq, 11);
    got.take(p2, 1 << 20);
    assert_eq!(got.all, expected(2..=11, 1000, &both));
    assert_eq!(
        got.data.keys().copied().collect::<Vec<_>>(),
        (2..=11).collect::<Vec<_>>()
    );

    // the continuation token picks up exactly the new events
    let p3 = s.get_output(&request(&id, &both, 1 << 20, &t2)).unwrap();
    assert_eq!(p3.retained_range.unwrap().last_event_seq, 15);
    got.take(p3, 1 << 20);
    assert_eq!(got.all, expected(2..=15, 1000, &both));

    // a fresh read sees everything, new events included
    let mut fresh = Collected::default();
    page_all(&s, &id, &both, 1500, "", &mut fresh);
    assert_eq!(fresh.all, expected(2..=15, 1000, &both));

    // after the terminal event, the pass that covers it ends with no token
    finish(&mut s, &id, 16);
    let mut rest = Collected::default();
    let end = page_all(
        &s,
        &id,
        &both,
        1 << 20,
        &got.last.unwrap().next_page_token,
        &mut rest,
    );
    assert!(end.is_empty());
    assert!(rest.all.is_empty());
    assert_counters(&s);
}

#[test]
fn misused_tokens_and_bad_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    let other = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 5, 3000);
    fill(&mut s, &other, 2, 5, 3000);
    let page = s.get_output(&request(&id, &[STDOUT], 1000, "")).unwrap();
    let token = page.next_page_token;
    assert!(!token.is_empty());
    let bad_token = (Code::InvalidArgument, "page_token".to_string());

    // other filters: another stream selection, another command
    assert_eq!(
        refused(s.get_output(&request(&id, &[STDOUT, STDERR], 1000, &token))),
        bad_token
    );
    assert_eq!(
        refused(s.get_output(&request(&id, &[STDERR], 1000, &token))),
        bad_token
    );
    assert_eq!(
        refused(s.get_output(&request(&other, &[STDOUT], 1000, &token))),
        bad_token
    );
    // the page size is not a filter
    assert!(s.get_output(&request(&id, &[STDOUT], 10, &token)).is_ok());

    // another kind, sealed with this store's own key and the right filters
    let codec = TokenCodec::new(TokenKey::new(s.token_key()));
    let position = OutputPosition {
        issue_uuid: id,
        event_seq: 2,
        byte_offset: 0,
        snapshot_seq: 5,
    }
    .encode();
    let wrong_kind = codec
        .seal(TokenKind::CommandPage, &output_filters(&id, 1), &position)
        .unwrap();
    assert_eq!(
        refused(s.get_output(&request(&id, &[STDOUT], 1000, &wrong_kind))),
        bad_token
    );

    // another data directory's key
    let dir2 = tempfile::tempdir().unwrap();
    let s2 = open(dir2.path());
    assert_ne!(s2.token_key(), s.token_key());
    let foreign = TokenCodec::new(TokenKey::new(s2.token_key()))
        .seal(TokenKind::Output, &output_filters(&id, 1), &position)
        .unwrap();
    assert_eq!(
        refused(s.get_output(&request(&id, &[STDOUT], 1000, &foreign))),
        bad_token
    );
    // and the other store does not know this store's tokens either
    assert!(
        s2.get_output(&request(&id, &[STDOUT], 1000, &token))
            .is_err()
    );

    // altered bytes: every character position changed
    for i in 0..token.len() {
        let mut chars: Vec<char> = token.chars().collect();
        chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
        let altered: String = chars.into_iter().collect();
        if altered == token {
            continue;
        }
        assert_eq!(
            refused(s.get_output(&request(&id, &[STDOUT], 1000, &altered))),
            bad_token,
            "position {i}"
        );
    }
    // garbage
    for g in [
        "x",
        "!!!!",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        &"A".repeat(5000),
    ] {
        assert_eq!(
            refused(s.get_output(&request(&id, &[STDOUT], 1000, g))),
            bad_token
        );
    }
    // an authentic token whose position the command never had
    let beyond = codec
        .seal(
            TokenKind::Output,
            &output_filters(&id, 1),
            &OutputPosition {
                issue_uuid: id,
                event_seq: 2,
                byte_offset: 0,
                snapshot_seq: 99,
            }
            .encode(),
        )
        .unwrap();
    assert_eq!(
        refused(s.get_output(&request(&id, &[STDOUT], 1000, &beyond))),
        bad_token
    );

    // request validation
    let field = |r| refused(r).1;
    assert_eq!(field(s.get_output(&request(&id, &[], 1000, ""))), "streams");
    assert_eq!(
        field(s.get_output(&request(&id, &[0], 1000, ""))),
        "streams"
    );
    assert_eq!(
        field(s.get_output(&request(&id, &[3], 1000, ""))),
        "streams"
    );
    assert_eq!(
        field(s.get_output(&request(&id, &[1, 1], 1000, ""))),
        "streams"
    );
    assert_eq!(
        field(s.get_output(&request(&id, &[2, 1], 1000, ""))),
        "streams"
    );
    assert_eq!(
        field(s.get_output(&request(&id, &[1, 2, 2], 1000, ""))),
        "streams"
    );
    assert_eq!(
        field(s.get_output(&request(&id, &[1], 4 * 1024 * 1024 + 1, ""))),
        "max_bytes"
    );
    assert!(
        s.get_output(&request(&id, &[1], 4 * 1024 * 1024, ""))
            .is_ok()
    );
    let mut upper = request(&id, &[1], 10, "");
    upper.issue_uuid = upper.issue_uuid.to_uppercase();
    assert_eq!(field(s.get_output(&upper)), "issue_uuid");
    let unknown = new_id();
    assert_eq!(
        refused(s.get_output(&request(&unknown, &[1], 10, ""))).0,
        Code::NotFound
    );
    assert_counters(&s);
    assert_counters(&s2);
}

fn tiers(window: u64, total: u64) -> Tiers {
    let mut t = Tiers::server_defaults();
    t.command_output_window = window;
    t.command_total = total;
    t.per_owner_total = 4096 * KIB;
    t.global_total = 8192 * KIB;
    t.free_space_floor = 0;
    t.validate().unwrap();
    t
}

fn rotating(dir: &Path) -> Store {
    open_with(
        dir,
        Arc::new(RealFs),
        StoreOptions {
            tiers: tiers(64 * KIB, 512 * KIB),
            seal_bytes: 16 * KIB,
            eviction_slack_bytes: 0,
            terminal_retention_ms: 0,
            ..StoreOptions::default()
        },
    )
}

/// `(first, last, source)` of every removed range, in order.
fn removed(s: &Store, id: &[u8; 16]) -> Vec<(u64, u64, i32)> {
    let mut st = s
        .db()
        .prepare(
            "SELECT first_seq, last_seq, source FROM output_truncations WHERE issue_uuid = ?1
             ORDER BY first_seq",
        )
        .unwrap();
    st.query_map([id.as_slice()], |r| {
        Ok((
            u64::try_from(r.get::<_, i64>(0)?).unwrap(),
            u64::try_from(r.get::<_, i64>(1)?).unwrap(),
            r.get(2)?,
        ))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

fn covered(ranges: &[(u64, u64, i32)], seq: u64) -> bool {
    ranges.iter().any(|r| r.0 <= seq && seq <= r.1)
}

#[test]
fn rotation_between_pages_continues_at_the_next_retained_event() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = rotating(dir.path());
    let id = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 9, 4096);
    assert!(removed(&s, &id).is_empty());
    let both = [STDOUT, STDERR];

    let mut got = Collected::default();
    let p1 = s.get_output(&request(&id, &both, 6000, "")).unwrap();
    let t1 = p1.next_page_token.clone();
    got.take(p1, 6000);
    // page 1 ended inside event 3
    assert_eq!(got.data[&3].len(), 6000 - 4096);

    // the window rotates the oldest segments away, taking the resume point
    fill(&mut s, &id, 10, 40, 4096);
    let ranges = removed(&s, &id);
    assert!(covered(&ranges, 3), "{ranges:?}");
    let window = wire::TruncationSource::ServerCommandWindow as i32;
    assert!(ranges.iter().all(|r| r.2 == window));
    finish(&mut s, &id, 41);

    let p2 = s.get_output(&request(&id, &both, 6000, &t1)).unwrap();
    // the page starts with the removal naming the exact removed range
    let Some(wire::output_item::Item::Retention(r)) = &p2.items[0].item else {
        panic!("{:?}", p2.items[0])
    };
    let first_range = ranges.iter().find(|r| covered(&[**r], 3)).unwrap();
    assert_eq!(
        (r.first_event_seq, r.last_event_seq),
        (first_range.0, first_range.1)
    );
    assert_eq!(r.source, window);
    assert_eq!(r.streams, vec![STDOUT, STDERR]);
    assert!(r.raw_bytes.is_some() && r.stored_bytes.is_some() && r.recorded_time.is_some());
    assert!(r.incident_id.is_none());
    let end = page_all(&s, &id, &both, 6000, &t1, &mut got);
    assert!(end.is_empty());

    // every range the walk passed is reported exactly once, in order, and
    // each retained event after the resume point is whole and exact
    let reported: Vec<(u64, u64)> = got
        .retention
        .iter()
        .map(|r| (r.first_event_seq, r.last_event_seq))
        .collect();
    let want: Vec<(u64, u64)> = ranges
        .iter()
        .filter(|r| r.1 >= 3)
        .map(|r| (r.0, r.1))
        .collect();
    assert_eq!(reported, want);
    for q in 4..=40 {
        if covered(&ranges, q) {
            assert!(!got.data.contains_key(&q), "removed event {q} returned");
        } else {
            assert_eq!(got.data[&q], chunk(q, 4096), "event {q}");
        }
    }
    // nothing retained was skipped: the retained range starts right after the removals
    let range = got.last.unwrap().retained_range.unwrap();
    let last_removed = ranges.iter().map(|r| r.1).max().unwrap();
    assert_eq!(range.first_event_seq, last_removed + 1);
    assert_eq!(range.last_event_seq, 40);
    assert_counters(&s);
}

fn segment_path(s: &Store, id: &[u8; 16], ordinal: u32) -> PathBuf {
    s.layout().segment_path(id, ordinal).unwrap()
}

#[test]
fn storage_loss_is_reported_after_a_corrupted_segment() {
    let dir = tempfile::tempdir().unwrap();
    let id = {
        let mut s = open(dir.path());
        let id = running_command(&mut s, "web-1");
        fill(&mut s, &id, 2, 4, 2000);
        append(&mut s, &[marker(&id, 5, &[STDOUT])]);
        id
    };
    // corrupt the last output record (event 4) on disk, then restart
    let path = {
        let s = open(dir.path());
        segment_path(&s, &id, 1)
    };
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let s = open(dir.path());
    let incident: Vec<u8> = s
        .db()
        .query_row(
            "SELECT incident_id FROM output_truncations WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    let incident = uuid::Uuid::from_slice(&incident)
        .unwrap()
        .hyphenated()
        .to_string();

    let mut got = Collected::default();
    page_all(&s, &id, &[STDOUT, STDERR], 1000, "", &mut got);
    assert_eq!(got.all, expected(2..=3, 2000, &[STDOUT, STDERR]));
    assert_eq!(got.retention.len(), 1);
    let r = &got.retention[0];
    assert_eq!((r.first_event_seq, r.last_event_seq), (4, 4));
    assert_eq!(r.source, wire::TruncationSource::StorageLoss as i32);
    assert_eq!(r.streams, vec![STDOUT]);
    assert_eq!(r.raw_bytes, Some(2000));
    assert_eq!(r.incident_id.as_deref(), Some(incident.as_str()));
    // the loss appears in event order: after event 3's data, before the marker at 5
    let page = s
        .get_output(&request(&id, &[STDOUT, STDERR], 1 << 20, ""))
        .unwrap();
    let kinds: Vec<String> = page
        .items
        .iter()
        .map(|i| match i.item.as_ref().unwrap() {
            wire::output_item::Item::Data(d) => format!("data{}", d.event_seq),
            wire::output_item::Item::Marker(m) => {
                format!("marker{}", m.event.as_ref().unwrap().event_seq)
            }
            wire::output_item::Item::Retention(r) => format!("loss{}", r.first_event_seq),
        })
        .collect();
    assert_eq!(kinds, ["data2", "data3", "loss4", "marker5"]);
    // stderr alone: the loss touched stdout only, the marker too
    let mut err = Collected::default();
    page_all(&s, &id, &[STDERR], 1000, "", &mut err);
    assert_eq!(err.all, chunk(3, 2000));
    assert!(err.retention.is_empty() && err.markers.is_empty());

    // the follow history reports the loss before the event after it
    let h = s.events_after(&id, 0, 100).unwrap();
    let shape: Vec<String> = h
        .iter()
        .map(|i| match i {
            HistoryItem::Event(e) => format!("e{}", e.event_seq),
            HistoryItem::Retention(r) => format!("r{}-{}", r.first_seq, r.last_seq),
            HistoryItem::Reset(_) => "reset".into(),
            HistoryItem::CaughtUp { last_event_seq } => format!("end{last_event_seq}"),
        })
        .collect();
    assert_eq!(shape, ["e1", "e2", "e3", "r4-4", "e5", "end5"]);
    assert_counters(&s);
}

#[test]
fn a_record_failing_verification_is_an_error_then_an_explicit_loss_once_reverified() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 4, 2000);
    // damage event 3's record under the running store (no recovery ran)
    let path = segment_path(&s, &id, 1);
    let offset: i64 = s
        .db()
        .query_row(
            "SELECT segment_offset FROM command_events WHERE issue_uuid = ?1 AND event_seq = 3",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[usize::try_from(offset).unwrap() + 200] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();

    // the page before it is fine; the page reaching it fails, naming the event
    let p1 = s
        .get_output(&request(&id, &[STDOUT, STDERR], 2000, ""))
        .unwrap();
    let err = s
        .get_output(&request(&id, &[STDOUT, STDERR], 2000, &p1.next_page_token))
        .unwrap_err();
    match &err {
        OpError::Store(e) => assert!(e.to_string().contains("event 3"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(err.to_domain().code(), Code::Unavailable);
    assert!(s.events_after(&id, 0, 100).is_err());
    // history before the damage is still served
    let h = s.events_after(&id, 0, 2).unwrap();
    assert_eq!(h.len(), 2);
    assert_counters(&s);

    // the reader's caller re-verifies the command: the damage becomes an
    // explicit STORAGE_LOSS range with an open incident, not an error
    let report = s.reverify_command(&id, RECEIPT).unwrap();
    assert_eq!(report.segments_damaged, 1);
    assert_eq!(report.events_lost, 1);
    assert_eq!(
        removed(&s, &id),
        vec![(3, 3, wire::TruncationSource::StorageLoss as i32)]
    );
    let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
    assert_eq!(open.len(), 1);
    assert!(open[0].data_loss);
    let mut got = Collected::default();
    page_all(&s, &id, &[STDOUT, STDERR], 1000, "", &mut got);
    assert_eq!(got.all, expected([2, 4], 2000, &[STDOUT, STDERR]));
    assert_eq!(got.retention.len(), 1);
    // running it again finds nothing new
    let again = s.reverify_command(&id, RECEIPT).unwrap();
    assert_eq!(again.segments_damaged, 0);
    assert_eq!(rvbox_store::incidents::open(s.db(), 10).unwrap().len(), 1);
    assert_counters(&s);
}

#[test]
fn follow_history_puts_retention_items_before_the_events_they_precede() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = rotating(dir.path());
    let id = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 30, 4096);
    append(&mut s, &[marker(&id, 31, &[STDERR])]);
    fill(&mut s, &id, 32, 34, 4096);
    finish(&mut s, &id, 35);
    let ranges = removed(&s, &id);
    assert!(!ranges.is_empty());

    let h = s.events_after(&id, 0, 1000).unwrap();
    assert_eq!(
        h.last(),
        Some(&HistoryItem::CaughtUp { last_event_seq: 35 })
    );
    let mut seen_events = Vec::new();
    let mut seen_ranges = Vec::new();
    for item in &h {
        match item {
            HistoryItem::Event(e) => {
                assert!(
                    !covered(&ranges, e.event_seq) || !matches!(e.body, HistoryBody::Output { .. })
                );
                // every range starting at or before this event was already sent
                for r in &ranges {
                    if r.0 <= e.event_seq {
                        assert!(
                            seen_ranges.contains(&(r.0, r.1)),
                            "range {r:?} before {}",
                            e.event_seq
                        );
                    }
                }
                if let HistoryBody::Output {
                    stream,
                    compression,
                    raw_len,
                    stored,
                } = &e.body
                {
                    assert_eq!(*compression, Compression::Zstd);
                    assert_eq!(i32::from(stream.as_u8()), stream_of(e.event_seq));
                    let raw = zstd::bulk::decompress(stored, *raw_len as usize).unwrap();
                    assert_eq!(raw, chunk(e.event_seq, 4096));
                    // the wire form carries the stored payload unchanged
                    let w = item
                        .to_wire(&rvbox_domain::ids::Uuid7::from_bytes("id", id).unwrap())
                        .unwrap()
                        .unwrap();
                    let Some(wire::follow_command_response::Item::Event(ev)) = w.item else {
                        panic!()
                    };
                    let ev = ev.event.unwrap();
                    assert_eq!(ev.event_seq, e.event_seq);
                    let Some(wire::command_event::Body::Output(o)) = ev.body else {
                        panic!()
                    };
                    assert_eq!(&o.payload, stored);
                }
                seen_events.push(e.event_seq);
            }
            HistoryItem::Retention(r) => {
                assert!(seen_events.iter().all(|q| *q < r.first_seq));
                seen_ranges.push((r.first_seq, r.last_seq));
            }
            HistoryItem::CaughtUp { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    let want_events: Vec<u64> = (1..=35)
        .filter(|q| *q == 1 || *q == 31 || *q == 35 || !covered(&ranges, *q))
        .collect();
    assert_eq!(seen_events, want_events);
    assert_eq!(
        seen_ranges,
        ranges.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()
    );

    // in small batches: same events, each range once, the cursor moved only by events
    let mut cursor = 0;
    let mut batched_events = Vec::new();
    let mut batched_ranges = Vec::new();
    loop {
        let batch = s.events_after(&id, cursor, 3).unwrap();
        let mut done = false;
        for item in batch {
            match item {
                HistoryItem::Event(e) => {
                    cursor = e.event_seq;
                    batched_events.push(e.event_seq);
                }
                HistoryItem::Retention(r) => batched_ranges.push((r.first_seq, r.last_seq)),
                HistoryItem::CaughtUp { .. } => done = true,
                HistoryItem::Reset(_) => panic!(),
            }
        }
        if done {
            break;
        }
    }
    assert_eq!(batched_events, want_events);
    assert_eq!(batched_ranges, seen_ranges);

    // a cursor inside a removed range gets that range first
    let (first, last, _) = ranges[0];
    if last > first {
        let h = s.events_after(&id, first, 10).unwrap();
        assert!(
            matches!(&h[0], HistoryItem::Retention(r) if (r.first_seq, r.last_seq) == (first, last))
        );
    }
    assert_counters(&s);
}

#[test]
fn a_cursor_ahead_of_the_log_gets_a_reset() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    let id = running_command(&mut s, "web-1");
    fill(&mut s, &id, 2, 4, 100);
    let h = s.events_after(&id, 9, 10).unwrap();
    assert_eq!(h.len(), 2);
    let HistoryItem::Reset(r) = &h[0] else {
        panic!("{h:?}")
    };
    assert_eq!(
        (r.requested_after_event_seq, r.resumed_after_event_seq),
        (9, 4)
    );
    assert_eq!(h[1], HistoryItem::CaughtUp { last_event_seq: 4 });
    let uuid = rvbox_domain::ids::Uuid7::from_bytes("id", id).unwrap();
    let w = h[0].to_wire(&uuid).unwrap().unwrap();
    assert!(matches!(
        w.item,
        Some(wire::follow_command_response::Item::Reset(
            wire::CursorReset {
                requested_after_event_seq: 9,
                resumed_after_event_seq: 4,
                ..
            }
        ))
    ));
    assert_eq!(h[1].to_wire(&uuid).unwrap(), None);
    // a cursor at the end is simply caught up; the log continuing is seen
    assert_eq!(
        s.events_after(&id, 4, 10).unwrap(),
        vec![HistoryItem::CaughtUp { last_event_seq: 4 }]
    );
    fill(&mut s, &id, 5, 5, 100);
    let h = s.events_after(&id, 4, 10).unwrap();
    assert!(matches!(&h[0], HistoryItem::Event(e) if e.event_seq == 5));
    // an unknown command is NOT_FOUND
    match s.events_after(&new_id(), 0, 10) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::NotFound),
        other => panic!("{other:?}"),
    }
    assert_counters(&s);
}
