//! Cases over the control reads as well as the operations: output pages,
//! follow history, command records and listings, clients and storage
//! incidents, the same on every backend.

use rvbox_domain::error::Code;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::mutations::OpError;
use rvbox_store::output::HistoryItem;
use rvbox_store::reader::ControlReads;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Backend, StoreOp};

use crate::support::*;

pub use crate::fleet::{
    a_client_registering_in_a_late_window_becomes_a_target,
    a_fleet_run_releases_at_its_rate_and_ends_once_every_target_has,
    an_open_incident_refuses_the_writes_of_its_scope_until_acknowledged,
    fleet_actions_pause_resume_signal_and_cancel_once_each,
};

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

/// The refusal code of a read, if it is one.
fn read_refused<T: std::fmt::Debug>(r: &Result<T, OpError>) -> Option<Code> {
    match r {
        Err(OpError::Refused(e)) => Some(e.code()),
        _ => None,
    }
}

/// Registers `client_id` with `labels` on a new live session (fencing its
/// live one).
fn labelled_session(
    b: &mut dyn WithReads,
    client_id: &str,
    labels: &str,
) -> rvbox_store_port::sessions::SessionFence {
    let seen = client(b, client_id);
    let mut reg = registration(client_id, INSTANCE, seen.as_ref());
    reg.labels = labels.into();
    let session_id = reg.session_id;
    let r = b.perform(NOW, StoreOp::Register(reg));
    assert!(r.is_ok(), "{r:?}");
    rvbox_store_port::sessions::SessionFence { session_id }
}

/// The value of a client's label.
fn label<'a>(c: &'a wire::ClientSummary, key: &str) -> Option<&'a str> {
    c.labels
        .iter()
        .find(|l| l.key == key)
        .map(|l| l.value.as_str())
}

/// Every page of a client listing with `selector` and `glob`, `size` at a
/// time: the ids in order.
fn list_clients(b: &mut dyn WithReads, selector: &str, glob: &str, size: u32) -> Vec<String> {
    let mut out = Vec::new();
    let mut token = String::new();
    for _ in 0..20 {
        let page = b
            .reads()
            .list_clients(&wire::ListClientsRequest {
                page_size: size,
                page_token: token.clone(),
                selector: selector.into(),
                client_glob: glob.into(),
                ..Default::default()
            })
            .unwrap();
        // 0 asks for the default size
        assert!(size == 0 || page.clients.len() <= size as usize, "{page:?}");
        out.extend(page.clients.into_iter().map(|c| c.client_id));
        if page.next_page_token.is_empty() {
            return out;
        }
        token = page.next_page_token;
    }
    panic!("pages never end");
}

/// Clients are listed by id, page by page, every one exactly once, with
/// their generation and whether they are connected; a label selector and
/// a client-id glob narrow the listing, and a page token is good only
/// with the filters it was made for.
pub fn clients_are_listed_by_id_page_by_page(b: &mut dyn WithReads) {
    labelled_session(b, "web-2", "env=dev,role=web");
    labelled_session(b, "web-1", "env=prod,role=web");
    labelled_session(b, "web-1", "env=prod,role=web");
    labelled_session(b, "db-1", "env=prod,role=db");
    labelled_session(b, "web-3", "env=prod,role=web");
    let s = labelled_session(b, "db-2", "");
    let r = b.perform(
        NOW,
        StoreOp::CloseSession {
            session_id: s.session_id,
            reason: "connection lost".into(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    // a command for a client that never registered makes its row
    run(b, "lone-1");

    let all = ["db-1", "db-2", "lone-1", "web-1", "web-2", "web-3"];
    assert_eq!(list_clients(b, "", "", 2), all);
    assert_eq!(list_clients(b, "", "", 4), all);
    assert_eq!(list_clients(b, "", "", 0), all, "the default page size");
    assert_eq!(
        list_clients(b, "env=prod", "", 1),
        ["db-1", "web-1", "web-3"]
    );
    assert_eq!(list_clients(b, "", "web-*", 2), ["web-1", "web-2", "web-3"]);
    assert_eq!(list_clients(b, "env=prod", "web-?", 1), ["web-1", "web-3"]);
    assert!(list_clients(b, "env=test", "", 2).is_empty());

    let page = b
        .reads()
        .list_clients(&wire::ListClientsRequest::default())
        .unwrap();
    let summary = |id: &str| {
        page.clients
            .iter()
            .find(|c| c.client_id == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id} is listed: {page:?}"))
    };
    let web1 = summary("web-1");
    assert_eq!((web1.generation, web1.connected), (2, true));
    assert_eq!(web1.client_instance_id, any_uuid_text(&INSTANCE));
    assert_eq!(label(&web1, "env"), Some("prod"), "{web1:?}");
    assert!(web1.connected_time.is_some());
    let db2 = summary("db-2");
    assert_eq!((db2.generation, db2.connected), (1, false), "closed");
    let lone = summary("lone-1");
    assert_eq!((lone.generation, lone.connected), (0, false));
    assert_eq!(lone.client_instance_id, "", "never registered");

    // a token is bound to its filters
    let first = |b: &mut dyn WithReads, selector: &str, glob: &str| {
        let page = b
            .reads()
            .list_clients(&wire::ListClientsRequest {
                page_size: 1,
                selector: selector.into(),
                client_glob: glob.into(),
                ..Default::default()
            })
            .unwrap();
        assert!(!page.next_page_token.is_empty(), "{page:?}");
        page.next_page_token
    };
    for (made_for, used_with) in [
        (("", ""), ("env=prod", "")),
        (("", "web-*"), ("", "db-*")),
        (("env=prod", ""), ("env=prod", "web-*")),
        (("env=prod", "web-*"), ("", "")),
    ] {
        let token = first(b, made_for.0, made_for.1);
        let r = b.reads().list_clients(&wire::ListClientsRequest {
            page_size: 1,
            page_token: token,
            selector: used_with.0.into(),
            client_glob: used_with.1.into(),
            ..Default::default()
        });
        assert_eq!(
            read_refused(&r),
            Some(Code::InvalidArgument),
            "a token made for {made_for:?} used with {used_with:?}: {r:?}"
        );
    }
    for bad in [
        wire::ListClientsRequest {
            client_glob: "web/*".into(),
            ..Default::default()
        },
        wire::ListClientsRequest {
            page_token: "not a token".into(),
            ..Default::default()
        },
        wire::ListClientsRequest {
            page_size: 1_000_000,
            ..Default::default()
        },
    ] {
        let r = b.reads().list_clients(&bad);
        assert_eq!(
            read_refused(&r),
            Some(Code::InvalidArgument),
            "{bad:?}: {r:?}"
        );
    }
}

/// A client is read with its generation, whether it is connected, a
/// refused live claim and the expiry of a live takeover grant; an unknown
/// client is `NOT_FOUND`.
pub fn a_client_is_read_with_its_session_claim_and_grant(b: &mut dyn WithReads) {
    let r = b.reads().get_client("nobody-1", NOW);
    assert_eq!(read_refused(&r), Some(Code::NotFound), "{r:?}");

    let s = labelled_session(b, "web-1", "env=prod");
    let got = b.reads().get_client("web-1", NOW).unwrap();
    let c = got.client.clone().unwrap();
    assert_eq!(c.client_id, "web-1");
    assert_eq!((c.generation, c.connected), (1, true));
    assert_eq!(c.client_instance_id, any_uuid_text(&INSTANCE));
    assert_eq!(label(&c, "env"), Some("prod"));
    assert_eq!(
        c.capabilities.map(|k| k.software_version),
        Some("1.0.0".to_owned())
    );
    assert_eq!(got.pending_claim, None);
    assert_eq!(got.takeover_grant_expiry_time, None);
    assert!(got.dirty_scopes.is_empty(), "{got:?}");

    let r = b.perform(
        NOW,
        StoreOp::CloseSession {
            session_id: s.session_id,
            reason: "connection lost".into(),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let c = b.reads().get_client("web-1", NOW).unwrap().client.unwrap();
    assert_eq!((c.generation, c.connected), (1, false), "closed");

    labelled_session(b, "web-1", "env=prod");
    let claimant: [u8; 16] = {
        let mut i = new_id();
        i[6] = 0x40 | (i[6] & 0x0f);
        i
    };
    let r = b.perform(
        NOW,
        StoreOp::RecordPendingClaim {
            client_id: "web-1".into(),
            instance_id: claimant,
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let r = b.perform(
        NOW,
        StoreOp::AuthorizeTakeover {
            request: wire::AuthorizeClientTakeoverRequest {
                request_id: text(&new_id()),
                client_id: "web-1".into(),
                client_instance_id: any_uuid_text(&claimant),
            },
            caller: rvbox_store_port::audit::Caller::local(),
            ttl_ms: 60_000,
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let got = b.reads().get_client("web-1", NOW).unwrap();
    let c = got.client.clone().unwrap();
    assert_eq!((c.generation, c.connected), (2, true));
    let claim = got.pending_claim.unwrap();
    assert_eq!(claim.client_instance_id, any_uuid_text(&claimant));
    assert_eq!(
        claim.observed_time.map(|t| t.seconds),
        Some(NOW / 1000),
        "seen now"
    );
    assert_eq!(
        got.takeover_grant_expiry_time.map(|t| t.seconds),
        Some((NOW + 60_000) / 1000)
    );
    let later = b.reads().get_client("web-1", NOW + 60_000).unwrap();
    assert_eq!(later.takeover_grant_expiry_time, None, "expired");
}

/// Every page of an incident listing in `state`, `size` at a time.
fn list_incidents(
    b: &mut dyn WithReads,
    state: Option<wire::IncidentState>,
    size: u32,
) -> Vec<wire::StorageIncident> {
    let mut out = Vec::new();
    let mut token = String::new();
    for _ in 0..20 {
        let page = b
            .reads()
            .incident_page(&wire::ListStorageIncidentsRequest {
                state: state.map(|s| s as i32),
                page_size: size,
                page_token: token.clone(),
                ..Default::default()
            })
            .unwrap();
        assert!(page.incidents.len() <= size as usize, "{page:?}");
        out.extend(page.incidents);
        if page.next_page_token.is_empty() {
            return out;
        }
        token = page.next_page_token;
    }
    panic!("pages never end");
}

/// Storage incidents are listed newest first (then by id, descending),
/// page by page, every one exactly once, optionally in one state; a page
/// token is good only for the state it was made for.
pub fn incidents_are_listed_newest_first_page_by_page(b: &mut dyn WithReads) {
    let issue = run(b, "web-1");
    // two at the same time: the page boundary falls between them
    let times = [0i64, 1, 2, 2, 3];
    for (n, dt) in times.iter().enumerate() {
        let r = b.perform(
            NOW + dt,
            StoreOp::RecordIncident(rvbox_store_port::incidents::NewIncident {
                kind: wire::IncidentKind::LateAfterExpiry,
                scope_kind: wire::ScopeKind::Command,
                scope_key: text(&issue),
                client_id: Some("web-1".into()),
                issue_uuid: Some(issue),
                summary: format!("incident {n}"),
                evidence: Vec::new(),
                data_loss: false,
            }),
        );
        assert!(r.is_ok(), "{r:?}");
    }
    let key = |i: &wire::StorageIncident| {
        let t = i.detected_time.unwrap_or_default();
        (t.seconds, t.nanos, i.incident_id.clone())
    };
    let all = list_incidents(b, None, 2);
    assert_eq!(all.len(), times.len(), "{all:?}");
    let mut sorted = all.clone();
    sorted.sort_by_key(|i| std::cmp::Reverse(key(i)));
    assert_eq!(all, sorted, "newest first, then by id");
    let summaries: Vec<&str> = all.iter().map(|i| i.summary.as_str()).collect();
    assert_eq!(summaries.first(), Some(&"incident 4"));
    assert_eq!(summaries.last(), Some(&"incident 0"));
    let mut seen = summaries.clone();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [
            "incident 0",
            "incident 1",
            "incident 2",
            "incident 3",
            "incident 4"
        ]
    );
    assert_eq!(list_incidents(b, None, 100), all, "one page says the same");
    let first = all.last().unwrap();
    assert_eq!(first.kind, wire::IncidentKind::LateAfterExpiry as i32);
    assert_eq!(first.state, wire::IncidentState::Open as i32);
    assert_eq!(first.scope_kind, wire::ScopeKind::Command as i32);
    assert_eq!(first.scope_key, text(&issue));
    assert_eq!(
        first.detected_time,
        Some(prost_types::Timestamp {
            seconds: NOW / 1000,
            nanos: 0
        })
    );
    assert_eq!(first.resolved_time, None);

    // acknowledged ones leave the open listing
    let acknowledged: Vec<String> = [1usize, 3]
        .iter()
        .map(|n| all[*n].incident_id.clone())
        .collect();
    for id in &acknowledged {
        let r = b.perform(
            NOW + 10,
            StoreOp::AcknowledgeIncident {
                request: wire::AcknowledgeStorageIncidentRequest {
                    request_id: text(&new_id()),
                    incident_id: id.clone(),
                    note: "seen, accepted".into(),
                },
                caller: rvbox_store_port::audit::Caller::local(),
            },
        );
        assert!(r.is_ok(), "{r:?}");
    }
    let ids = |v: &[wire::StorageIncident]| -> Vec<String> {
        v.iter().map(|i| i.incident_id.clone()).collect()
    };
    let open = list_incidents(b, Some(wire::IncidentState::Open), 2);
    assert_eq!(
        ids(&open),
        [0usize, 2, 4]
            .iter()
            .map(|n| all[*n].incident_id.clone())
            .collect::<Vec<_>>()
    );
    let acked = list_incidents(b, Some(wire::IncidentState::Acknowledged), 1);
    assert_eq!(ids(&acked), acknowledged);
    for i in &acked {
        assert_eq!(i.state, wire::IncidentState::Acknowledged as i32);
        assert_eq!(i.acknowledgement_note, "seen, accepted");
        assert!(i.resolved_time.is_some());
    }
    assert!(list_incidents(b, Some(wire::IncidentState::Repaired), 2).is_empty());

    // a token is bound to its state
    for (made_for, used_with) in [
        (None, Some(wire::IncidentState::Open)),
        (Some(wire::IncidentState::Open), None),
        (
            Some(wire::IncidentState::Open),
            Some(wire::IncidentState::Acknowledged),
        ),
    ] {
        let page = b
            .reads()
            .incident_page(&wire::ListStorageIncidentsRequest {
                state: made_for.map(|s| s as i32),
                page_size: 1,
                ..Default::default()
            })
            .unwrap();
        assert!(!page.next_page_token.is_empty(), "{page:?}");
        let r = b.reads().incident_page(&wire::ListStorageIncidentsRequest {
            state: used_with.map(|s| s as i32),
            page_size: 1,
            page_token: page.next_page_token,
            ..Default::default()
        });
        assert_eq!(
            read_refused(&r),
            Some(Code::InvalidArgument),
            "a token made for {made_for:?} used with {used_with:?}: {r:?}"
        );
    }
    for state in [0, 99] {
        let r = b.reads().incident_page(&wire::ListStorageIncidentsRequest {
            state: Some(state),
            ..Default::default()
        });
        assert_eq!(
            read_refused(&r),
            Some(Code::InvalidArgument),
            "state {state}"
        );
    }
}

/// Events a client had acknowledged and the store no longer holds (a
/// restore from an older backup) are recorded at reconciliation: the
/// range becomes a `STORAGE_LOSS` truncation of unknown size linked to
/// the round's incident, the command's durable event_seq moves to its end,
/// later events append after it, and an output page reports the range
/// between the bytes before and after it. A range that does not follow
/// the durable events is `CONFLICT` and changes nothing.
pub fn events_lost_by_the_store_after_acknowledgement_are_a_recorded_truncation(
    b: &mut dyn WithReads,
) {
    use rvbox_store_port::commands::ReconcileWrite;
    use rvbox_store_port::incidents::NewIncident;
    use rvbox_store_port::ops::{Completion, PortError};

    let chunks = chunks();
    let issue = command_with_output(b, &chunks[..2], false);
    assert_eq!(view(b, &issue).last_event_seq, 3);
    let session = live_session(b, "web-1");
    let revision = view(b, &issue).revision;
    let apply = |first_event_seq, last_event_seq| StoreOp::ApplyReconciliation {
        client_id: "web-1".into(),
        session,
        writes: vec![ReconcileWrite::LostEvents {
            issue,
            revision,
            first_event_seq,
            last_event_seq,
        }],
        incidents: vec![NewIncident {
            kind: wire::IncidentKind::ReconciliationContradiction,
            scope_kind: wire::ScopeKind::Command,
            scope_key: text(&issue),
            client_id: Some("web-1".into()),
            issue_uuid: Some(issue),
            summary: "events 4..=6 are lost".into(),
            evidence: Vec::new(),
            data_loss: true,
        }],
    };
    for (first, last) in [(5, 6), (3, 6), (4, 3)] {
        match b.perform(NOW, apply(first, last)) {
            Err(PortError::Refused(e)) => assert_eq!(e.code(), Code::Conflict, "{first}..={last}"),
            other => panic!("lost range {first}..={last}: {other:?}"),
        }
        assert_eq!(view(b, &issue).last_event_seq, 3, "nothing changed");
    }
    assert_eq!(b.perform(NOW, apply(4, 6)), Ok(Completion::Done));
    assert_eq!(view(b, &issue).last_event_seq, 6);

    // the command goes on after the range
    let mut after = output_event(&issue, 7, b"after the loss\n");
    after.session = Some(session);
    let mut end = lifecycle_event(&issue, 8, Lifecycle::Succeeded);
    end.session = Some(session);
    let r = b.perform(
        NOW,
        StoreOp::AppendEvents {
            events: vec![after, end],
        },
    );
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; 2]);

    let page = b
        .reads()
        .get_output(&wire::GetOutputRequest {
            issue_uuid: text(&issue),
            streams: vec![
                wire::OutputStream::Stdout as i32,
                wire::OutputStream::Stderr as i32,
            ],
            max_bytes: 1 << 20,
            page_token: String::new(),
            ..Default::default()
        })
        .unwrap();
    let mut seen = Vec::new();
    for item in page.items {
        match item.item {
            Some(wire::output_item::Item::Data(d)) => seen.push(format!("data {}", d.event_seq)),
            Some(wire::output_item::Item::Retention(t)) => {
                assert_eq!(t.source, wire::TruncationSource::StorageLoss as i32);
                assert_eq!(t.raw_bytes, None, "the lost size is unknown");
                assert!(t.incident_id.is_some(), "linked to the round's incident");
                assert!(t.reason.contains("acknowledged"), "{}", t.reason);
                seen.push(format!("lost {}..={}", t.first_event_seq, t.last_event_seq));
            }
            other => panic!("unexpected item {other:?}"),
        }
    }
    assert_eq!(seen, ["data 2", "data 3", "lost 4..=6", "data 7"]);
    assert!(page.next_page_token.is_empty(), "the command ended");
    let incidents = b
        .reads()
        .incident_page(&wire::ListStorageIncidentsRequest {
            page_size: 10,
            ..Default::default()
        })
        .unwrap()
        .incidents;
    assert!(
        incidents
            .iter()
            .any(|i| i.data_loss && i.scope_key == text(&issue)),
        "{incidents:?}"
    );
}
