//! The spool core (plan §7.1-§7.2; R-7.1-11/12/15/16, R-7.2-07..27),
//! driven through a model store that performs every durable step and
//! keeps what a real client store would hold.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, VecDeque};

use prost::Message as _;
use rvbox_client_core::spool::{
    AppendItem, RestoredCommand, RestoredEntry, RestoredItem, SEGMENT_RAW_BYTES, Spool,
    SpoolCompletion, SpoolError, SpoolLimits, SpoolOp, SpoolOutput, Taken, output_event_cost,
};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn issue(n: u8) -> Uuid7 {
    Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-b302099a80{n:02x}")).unwrap()
}

/// One row of the model store.
#[derive(Debug, Clone, PartialEq)]
enum Row {
    Output { stream: i32, raw: u64 },
    Event(Body),
}

#[derive(Debug, Default)]
struct Model {
    rows: BTreeMap<(Uuid7, u64), (Option<u64>, Row)>,
    /// (command, sequence) to ordinal, for the sequenced rows.
    by_seq: BTreeMap<(Uuid7, u64), u64>,
    acked: BTreeMap<Uuid7, u64>,
    /// The recorded open loss run of each command, as a store keeps it.
    loss: BTreeMap<Uuid7, wire::OutputTruncation>,
}

#[derive(Debug)]
struct Harness {
    spool: Spool,
    queue: VecDeque<SpoolOp>,
    model: Model,
    sent: Vec<(Uuid7, u64, Row)>,
    finished: Vec<Uuid7>,
    unaccountable: Vec<Uuid7>,
    fail_next: Vec<&'static str>,
}

impl Harness {
    fn new(limits: SpoolLimits) -> Self {
        limits.validate().unwrap();
        Self {
            spool: Spool::new(limits),
            queue: VecDeque::new(),
            model: Model::default(),
            sent: Vec::new(),
            finished: Vec::new(),
            unaccountable: Vec::new(),
            fail_next: Vec::new(),
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.spool.poll_output() {
            match o {
                SpoolOutput::Store(op) => self.queue.push_back(*op),
                SpoolOutput::Send {
                    issue,
                    first_seq,
                    last_seq,
                } => {
                    for seq in first_seq..=last_seq {
                        // the index, else a scan (rows a test put in place)
                        let row = self
                            .model
                            .by_seq
                            .get(&(issue, seq))
                            .and_then(|o| self.model.rows.get(&(issue, *o)))
                            .filter(|(s, _)| *s == Some(seq))
                            .map(|(_, r)| r.clone())
                            .or_else(|| {
                                self.model
                                    .rows
                                    .iter()
                                    .find(|((i, _), (s, _))| *i == issue && *s == Some(seq))
                                    .map(|(_, (_, r))| r.clone())
                            })
                            .unwrap_or_else(|| panic!("send of seq {seq} that is not durable"));
                        self.sent.push((issue, seq, row));
                    }
                }
                SpoolOutput::Finished { issue } => self.finished.push(issue),
                SpoolOutput::Unaccountable { issue, .. } => self.unaccountable.push(issue),
                SpoolOutput::TerminalDurable { .. } => {}
            }
        }
    }

    fn fails(&mut self, kind: &str) -> bool {
        if let Some(i) = self.fail_next.iter().position(|k| *k == kind) {
            self.fail_next.remove(i);
            return true;
        }
        false
    }

    /// Performs the next queued step against the model and reports it.
    fn step(&mut self) -> bool {
        self.drain();
        let Some(op) = self.queue.pop_front() else {
            return false;
        };
        let token = op.token();
        let result = match op {
            SpoolOp::Append {
                issue,
                ordinal,
                item,
                ..
            } => {
                if self.fails("append") {
                    SpoolCompletion::Failed
                } else {
                    let (row, done) = match item {
                        AppendItem::Output { stream, bytes, .. } => (
                            Row::Output {
                                stream: stream as i32,
                                raw: bytes.len() as u64,
                            },
                            SpoolCompletion::AppendedOutput {
                                // the model "compresses" to the raw length
                                stored_len: u32::try_from(bytes.len()).unwrap(),
                            },
                        ),
                        AppendItem::Event(b) => (Row::Event(b), SpoolCompletion::Done),
                    };
                    assert!(
                        self.model
                            .rows
                            .insert((issue, ordinal), (None, row))
                            .is_none(),
                        "ordinal {ordinal} appended twice"
                    );
                    // any later entry means the run was closed into its marker
                    self.model.loss.remove(&issue);
                    done
                }
            }
            SpoolOp::Assign {
                issue,
                ordinals,
                first_seq,
                ..
            } => {
                if self.fails("assign") {
                    SpoolCompletion::Failed
                } else {
                    for (i, o) in ordinals.iter().enumerate() {
                        let row = self
                            .model
                            .rows
                            .get_mut(&(issue, *o))
                            .expect("assign of a missing row");
                        assert_eq!(row.0, None, "an assigned row is immutable");
                        row.0 = Some(first_seq + i as u64);
                        self.model.by_seq.insert((issue, first_seq + i as u64), *o);
                    }
                    SpoolCompletion::Done
                }
            }
            SpoolOp::Release {
                issue, upto_seq, ..
            } => {
                self.model
                    .rows
                    .retain(|(i, _), (s, _)| !(*i == issue && s.is_some_and(|s| s <= upto_seq)));
                self.model
                    .by_seq
                    .retain(|(i, s), _| !(*i == issue && *s <= upto_seq));
                self.model.acked.insert(issue, upto_seq);
                SpoolCompletion::Done
            }
            SpoolOp::PersistLoss {
                issue,
                marker_ordinal,
                run,
                ..
            } => {
                let closed = self
                    .model
                    .rows
                    .range((issue, marker_ordinal)..=(issue, u64::MAX))
                    .next()
                    .is_some();
                if !closed {
                    self.model.loss.insert(issue, run);
                }
                SpoolCompletion::Done
            }
            SpoolOp::Rotate { .. } if self.fails("rotate") => SpoolCompletion::Failed,
            SpoolOp::Rotate {
                issue,
                removed,
                markers,
                ..
            } => {
                for o in removed {
                    let row = self
                        .model
                        .rows
                        .remove(&(issue, o))
                        .expect("rotate of a missing row");
                    assert_eq!(row.0, None, "a pinned row was rotated");
                }
                for (o, _, t) in markers {
                    let prev = self
                        .model
                        .rows
                        .insert((issue, o), (None, Row::Event(Body::Truncation(t))));
                    assert!(
                        prev.is_none_or(|p| p.0.is_none()),
                        "a pinned marker was rewritten"
                    );
                }
                SpoolCompletion::Done
            }
        };
        self.spool.completed(token, result);
        self.drain();
        true
    }

    fn settle(&mut self) {
        for _ in 0..1_000_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the spool never settled");
    }

    /// Acknowledges everything sent so far, per command.
    fn ack_all(&mut self) {
        let mut last: BTreeMap<Uuid7, u64> = BTreeMap::new();
        for (i, s, _) in &self.sent {
            last.insert(*i, *s);
        }
        for (i, s) in last {
            match self.spool.on_ack(i, s) {
                Ok(()) => {}
                Err(SpoolError::UnknownCommand(_)) if self.finished.contains(&i) => {}
                Err(e) => panic!("{e}"),
            }
        }
        self.drain();
    }

    /// The sent events of `issue`, checked contiguous from 1 with no repeat
    /// of a sequence under different content.
    fn stream_of(&self, issue: Uuid7) -> Vec<Row> {
        let mut by_seq: BTreeMap<u64, Row> = BTreeMap::new();
        for (i, s, r) in &self.sent {
            if *i != issue {
                continue;
            }
            if let Some(prev) = by_seq.insert(*s, r.clone()) {
                assert_eq!(&prev, r, "seq {s} sent with two contents");
            }
        }
        for (n, s) in by_seq.keys().enumerate() {
            assert_eq!(*s, n as u64 + 1, "sequences are not contiguous");
        }
        by_seq.into_values().collect()
    }
}

fn lifecycle(l: wire::Lifecycle) -> Body {
    Body::Lifecycle(wire::LifecycleChange {
        lifecycle: l as i32,
        ..Default::default()
    })
}

const OUT: wire::OutputStream = wire::OutputStream::Stdout;
const ERR: wire::OutputStream = wire::OutputStream::Stderr;

#[test]
fn the_cost_of_an_output_event_is_its_exact_encoded_length() {
    let id = issue(1);
    for (seq, len) in [
        (1u64, 1usize),
        (127, 200),
        (128, 16_383),
        (300_000, 65_536),
        (u64::MAX, 70_000),
    ] {
        let ev = wire::CommandEvent {
            issue_uuid: id.to_string(),
            event_seq: seq,
            observed_time: Some(prost_types::Timestamp {
                seconds: 1_800_000_000,
                nanos: 123_000_000,
            }),
            body: Some(Body::Output(wire::OutputChunk {
                stream: ERR as i32,
                payload: vec![7; len],
                raw_length: 65_536,
                stored_length: u32::try_from(len).unwrap(),
            })),
        };
        assert_eq!(
            output_event_cost(
                &id,
                seq,
                1_800_000_000_123,
                ERR,
                65_536,
                u32::try_from(len).unwrap()
            ),
            ev.encoded_len() as u64,
            "seq {seq} len {len}"
        );
    }
}

#[test]
fn entries_become_durable_then_sequenced_then_sent_in_one_order() {
    let mut h = Harness::new(SpoolLimits::default());
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool
        .event(id, 1, lifecycle(wire::Lifecycle::Running))
        .unwrap();
    for i in 0..5u8 {
        let stream = if i % 2 == 0 { OUT } else { ERR };
        assert_eq!(
            h.spool.output(id, stream, 2, vec![i; 100]).unwrap(),
            Taken::Kept
        );
    }
    h.settle();
    assert!(
        h.sent.is_empty(),
        "nothing is sent before a session is active"
    );
    h.spool.session_active(&BTreeMap::new());
    h.settle();
    let rows = h.stream_of(id);
    assert_eq!(rows.len(), 6);
    assert!(matches!(rows[0], Row::Event(Body::Lifecycle(_))));
    assert_eq!(
        rows[2],
        Row::Output {
            stream: ERR as i32,
            raw: 100
        }
    );
    h.spool
        .event(id, 3, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    assert_eq!(
        h.spool.output(id, OUT, 4, vec![1]),
        Err(SpoolError::AfterTerminal(id)),
        "the terminal event is the last"
    );
    h.settle();
    assert_eq!(h.stream_of(id).len(), 7);
    assert!(h.finished.is_empty());
    h.ack_all();
    h.settle();
    assert_eq!(h.finished, vec![id]);
    assert!(h.model.rows.is_empty(), "no history remains after the ack");
}

#[test]
fn the_send_windows_bound_what_is_in_flight_and_acks_reopen_them() {
    let limits = SpoolLimits {
        command_window: 128 * KIB,
        session_window: 192 * KIB,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let (a, b) = (issue(1), issue(2));
    for id in [a, b] {
        h.spool.open_command(id).unwrap();
    }
    h.spool.session_active(&BTreeMap::new());
    for _ in 0..8 {
        for id in [a, b] {
            h.spool.output(id, OUT, 1, vec![0; 30_000]).unwrap();
        }
        h.settle();
        assert!(h.spool.session_in_flight() <= limits.session_window);
        for id in [a, b] {
            let (last, acked) = h.spool.cursors(&id).unwrap();
            assert!(last - acked <= 4, "at most four 30 KB events fit 128 KiB");
        }
    }
    let before = h.sent.len();
    assert!(before < 16, "the windows held some back");
    for _ in 0..10 {
        h.ack_all();
        h.settle();
    }
    assert_eq!(h.stream_of(a).len(), 8);
    assert_eq!(h.stream_of(b).len(), 8);
    // an ack past what was sent is refused
    let (last, _) = h.spool.cursors(&a).unwrap();
    assert!(matches!(
        h.spool.on_ack(a, last + 1),
        Err(SpoolError::AckBeyondAssigned { .. })
    ));
}

#[test]
fn loss_mode_is_hysteretic_and_every_dropped_byte_is_in_a_marker() {
    let limits = SpoolLimits::default(); // 1 MiB / 256 KiB per command
    let mut h = Harness::new(limits);
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool.session_active(&BTreeMap::new());
    let chunk = 64 * KIB as usize;
    let mut produced = 0u64;
    // nothing completes: the backlog grows to the high watermark
    let mut kept = 0;
    for i in 0..40 {
        let stream = if i % 3 == 0 { ERR } else { OUT };
        produced += chunk as u64;
        if h.spool.output(id, stream, 10 + i, vec![1; chunk]).unwrap() == Taken::Kept {
            kept += 1;
        }
        h.drain();
    }
    assert_eq!(kept, 16, "1 MiB of 64 KiB chunks is kept");
    assert!(h.spool.dropping(&id));
    // a lifecycle event in loss mode is never dropped, and closes the run
    h.spool
        .event(id, 100, lifecycle(wire::Lifecycle::Running))
        .unwrap();
    // drain a little: still above the low watermark, so still dropping
    for _ in 0..10 {
        h.step();
    }
    assert!(h.spool.backlog() >= limits.command_low);
    assert_eq!(
        h.spool.output(id, OUT, 101, vec![2; chunk]).unwrap(),
        Taken::Dropped
    );
    produced += chunk as u64;
    h.settle();
    assert!(!h.spool.dropping(&id), "below both lows loss mode ends");
    assert_eq!(
        h.spool.output(id, OUT, 102, vec![3; 10]).unwrap(),
        Taken::Kept
    );
    produced += 10;
    h.spool
        .event(id, 103, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    for _ in 0..40 {
        h.settle();
        h.ack_all();
    }
    h.settle();
    let rows = h.stream_of(id);
    // kept bytes plus marker totals account for every produced byte
    let mut kept_bytes = 0u64;
    let mut marked = 0u64;
    let mut markers = Vec::new();
    for r in &rows {
        match r {
            Row::Output { raw, .. } => kept_bytes += raw,
            Row::Event(Body::Truncation(t)) => {
                assert_eq!(t.source, wire::TruncationSource::ClientOverload as i32);
                assert_eq!(t.first_removed_event_seq, None, "never sequenced");
                assert_eq!(t.compressed_bytes, None, "never compressed");
                assert!(t.reason.len() <= 4096);
                marked += t.raw_bytes;
                markers.push(t.clone());
            }
            Row::Event(_) => {}
        }
    }
    assert_eq!(kept_bytes + marked, produced, "exact raw-byte totals");
    assert_eq!(
        markers.len(),
        2,
        "one run before RUNNING, one before the kept chunk"
    );
    assert_eq!(markers[0].streams, vec![OUT as i32, ERR as i32]);
    // the marker sits right before the event that closed its run
    let running = rows
        .iter()
        .position(|r| matches!(r, Row::Event(Body::Lifecycle(l)) if l.lifecycle == wire::Lifecycle::Running as i32))
        .unwrap();
    assert!(matches!(rows[running - 1], Row::Event(Body::Truncation(_))));
    assert!(
        matches!(rows.last(), Some(Row::Event(Body::Lifecycle(_)))),
        "terminal last"
    );
    assert_eq!(h.finished, vec![id]);
}

#[test]
fn a_terminal_exit_above_the_high_watermark_ends_after_its_marker() {
    let mut h = Harness::new(SpoolLimits::default());
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    for _ in 0..30 {
        h.spool.output(id, OUT, 1, vec![0; 64 * 1024]).unwrap();
    }
    assert!(h.spool.dropping(&id));
    h.spool
        .event(id, 2, lifecycle(wire::Lifecycle::Failed))
        .unwrap();
    h.settle();
    h.spool.session_active(&BTreeMap::new());
    for _ in 0..40 {
        h.settle();
        h.ack_all();
    }
    let rows = h.stream_of(id);
    let n = rows.len();
    assert!(matches!(rows[n - 2], Row::Event(Body::Truncation(_))));
    assert!(matches!(rows[n - 1], Row::Event(Body::Lifecycle(_))));
    assert_eq!(h.finished, vec![id]);
}

#[test]
fn the_daemon_watermark_drops_output_of_every_command() {
    let limits = SpoolLimits {
        daemon_high: 2 * MIB,
        daemon_low: MIB,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let ids: Vec<_> = (1..=4).map(issue).collect();
    for id in &ids {
        h.spool.open_command(*id).unwrap();
    }
    for _ in 0..10 {
        for id in &ids {
            h.spool.output(*id, OUT, 1, vec![0; 64 * 1024]).unwrap();
        }
    }
    assert!(h.spool.daemon_loss());
    assert!(h.spool.backlog() <= limits.daemon_high);
    for id in &ids {
        assert!(h.spool.dropping(id));
    }
    h.settle();
    assert!(!h.spool.daemon_loss());
}

#[test]
fn offline_rotation_replaces_old_unsent_output_with_spool_markers_and_skips_no_sequence() {
    let limits = SpoolLimits {
        output_window: 2 * SEGMENT_RAW_BYTES,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    let chunk = 64 * 1024;
    let mut produced = 0u64;
    // offline: 6 MiB of output, settled as it goes (no loss mode)
    for i in 0..96 {
        h.spool
            .output(id, OUT, i, vec![(i % 251) as u8; chunk])
            .unwrap();
        produced += chunk as u64;
        if i % 4 == 3 {
            h.spool
                .event(id, i, Body::StdinAck(wire::StdinAck::default()))
                .unwrap();
        }
        h.settle();
        assert!(h.spool.stored() <= limits.output_window + SEGMENT_RAW_BYTES);
    }
    assert!(h.spool.stats().segments_rotated >= 3);
    h.spool
        .event(id, 200, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    h.settle();
    h.spool.session_active(&BTreeMap::new());
    for _ in 0..200 {
        h.settle();
        h.ack_all();
    }
    let rows = h.stream_of(id);
    let mut kept = 0u64;
    let mut marked = 0u64;
    let mut acks = 0;
    for r in &rows {
        match r {
            Row::Output { raw, .. } => kept += raw,
            Row::Event(Body::Truncation(t)) => {
                assert_eq!(t.source, wire::TruncationSource::ClientSpool as i32);
                assert_eq!(t.first_removed_event_seq, None);
                assert_eq!(
                    t.compressed_bytes,
                    Some(t.raw_bytes),
                    "compressed bytes are known"
                );
                marked += t.raw_bytes;
            }
            Row::Event(Body::StdinAck(_)) => acks += 1,
            Row::Event(_) => {}
        }
    }
    assert_eq!(acks, 24, "essential events survive rotation");
    assert_eq!(kept + marked, produced);
    assert!(kept <= limits.output_window + SEGMENT_RAW_BYTES);
    assert_eq!(h.finished, vec![id]);
}

#[test]
fn pinned_entries_are_sent_again_after_a_reconnect_from_the_servers_position() {
    let limits = SpoolLimits::default();
    let mut h = Harness::new(limits);
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool.session_active(&BTreeMap::new());
    for i in 0..6 {
        h.spool.output(id, OUT, i, vec![1; 1000]).unwrap();
    }
    h.settle();
    assert_eq!(h.sent.len(), 6);
    // the connection drops; the server had 1..=2 durable
    h.spool.session_closed();
    h.spool.output(id, OUT, 9, vec![2; 1000]).unwrap();
    h.settle();
    assert_eq!(h.sent.len(), 6, "nothing is sent while offline");
    h.sent.clear();
    let resume = BTreeMap::from([(id, 2)]);
    h.spool.session_active(&resume);
    h.settle();
    let seqs: Vec<u64> = h.sent.iter().map(|(_, s, _)| *s).collect();
    assert_eq!(
        seqs,
        vec![3, 4, 5, 6, 7],
        "replay first, then the new entry"
    );
    assert_eq!(h.spool.stats().replayed, 4);
}

#[test]
fn a_restored_spool_keeps_its_pins_and_continues_the_order() {
    let mut h = Harness::new(SpoolLimits::default());
    let id = issue(1);
    h.spool
        .restore(RestoredCommand {
            issue: id,
            next_ordinal: 4,
            next_seq: 3,
            acked: 1,
            loss_run: None,
            entries: vec![
                RestoredEntry {
                    ordinal: 2,
                    seq: Some(2),
                    observed_ms: 1,
                    item: RestoredItem::Output {
                        stream: OUT,
                        raw_len: 5,
                        stored_len: 5,
                        segment: 1,
                    },
                },
                RestoredEntry {
                    ordinal: 3,
                    seq: None,
                    observed_ms: 1,
                    item: RestoredItem::Event(lifecycle(wire::Lifecycle::Running)),
                },
            ],
        })
        .unwrap();
    h.model.rows.insert(
        (id, 2),
        (
            Some(2),
            Row::Output {
                stream: OUT as i32,
                raw: 5,
            },
        ),
    );
    h.model.rows.insert(
        (id, 3),
        (None, Row::Event(lifecycle(wire::Lifecycle::Running))),
    );
    h.spool.output(id, OUT, 2, vec![9; 7]).unwrap();
    h.spool.session_active(&BTreeMap::new());
    h.settle();
    let seqs: Vec<u64> = h.sent.iter().map(|(_, s, _)| *s).collect();
    assert_eq!(seqs, vec![2, 3, 4]);
    assert!(
        h.model.rows.contains_key(&(id, 4)),
        "new entries continue at the next ordinal"
    );
}

#[test]
fn a_failed_append_keeps_its_place_output_as_an_exact_marker_an_event_tried_again() {
    use rvbox_client_core::spool::MAX_APPEND_ATTEMPTS;
    let mut h = Harness::new(SpoolLimits::default());
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool.session_active(&BTreeMap::new());
    // failed output: its bytes are gone, an exact marker takes its place
    h.fail_next.push("append");
    h.spool.output(id, OUT, 1, vec![1; 500]).unwrap();
    h.settle();
    h.spool.output(id, OUT, 2, vec![2; 300]).unwrap();
    h.settle();
    let rows = h.stream_of(id);
    assert!(
        matches!(&rows[0], Row::Event(Body::Truncation(t))
            if t.raw_bytes == 500 && t.source == wire::TruncationSource::ClientSpool as i32),
        "{:?}",
        rows[0]
    );
    assert_eq!(
        rows[1],
        Row::Output {
            stream: OUT as i32,
            raw: 300
        }
    );
    // a failed event is appended again, in its place
    h.fail_next.push("append");
    h.spool
        .event(id, 3, lifecycle(wire::Lifecycle::Running))
        .unwrap();
    h.settle();
    assert!(h.unaccountable.is_empty());
    assert!(matches!(
        h.stream_of(id).last(),
        Some(Row::Event(Body::Lifecycle(_)))
    ));
    // an event that keeps failing is given up: unaccountable
    for _ in 0..MAX_APPEND_ATTEMPTS {
        h.fail_next.push("append");
    }
    h.spool
        .event(id, 4, Body::StdinAck(wire::StdinAck::default()))
        .unwrap();
    h.settle();
    assert_eq!(h.unaccountable, vec![id]);
    // and what follows it is still sent in order, contiguous
    h.spool.output(id, OUT, 5, vec![5; 10]).unwrap();
    h.settle();
    let rows = h.stream_of(id);
    assert!(matches!(rows.last(), Some(Row::Output { raw: 10, .. })));
}

#[test]
fn a_failed_assignment_gives_its_sequences_back() {
    let mut h = Harness::new(SpoolLimits::default());
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool.output(id, OUT, 1, vec![1; 10]).unwrap();
    h.settle();
    h.fail_next.push("assign");
    h.spool.session_active(&BTreeMap::new());
    h.settle();
    assert!(
        h.sent.is_empty(),
        "a failed assignment is not retried at once"
    );
    h.spool.output(id, OUT, 2, vec![2; 10]).unwrap();
    h.settle();
    let seqs: Vec<u64> = h.sent.iter().map(|(_, s, _)| *s).collect();
    assert_eq!(
        seqs,
        vec![1, 2],
        "no sequence is skipped after a failed assignment"
    );
}

#[test]
fn rotation_under_a_lagging_ack_never_touches_pinned_entries() {
    let limits = SpoolLimits {
        output_window: 2 * SEGMENT_RAW_BYTES,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    h.spool.session_active(&BTreeMap::new());
    let mut produced = 0u64;
    for i in 0..96 {
        h.spool.output(id, OUT, i, vec![3; 64 * 1024]).unwrap();
        produced += 64 * 1024;
        h.settle();
    }
    assert!(h.spool.stats().segments_rotated >= 2);
    let (last, acked) = h.spool.cursors(&id).unwrap();
    assert_eq!(acked, 0);
    assert!(
        last >= 15,
        "the send window's worth stays pinned, unacknowledged"
    );
    h.spool
        .event(id, 500, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    for _ in 0..200 {
        h.settle();
        h.ack_all();
    }
    let rows = h.stream_of(id);
    let total: u64 = rows
        .iter()
        .map(|r| match r {
            Row::Output { raw, .. } => *raw,
            Row::Event(Body::Truncation(t)) => t.raw_bytes,
            Row::Event(_) => 0,
        })
        .sum();
    assert_eq!(total, produced);
    assert_eq!(h.finished, vec![id]);
}

#[test]
fn every_terminal_lifecycle_is_the_last_entry_cancelled_included() {
    for terminal in [
        wire::Lifecycle::Succeeded,
        wire::Lifecycle::Failed,
        wire::Lifecycle::Terminated,
        wire::Lifecycle::Interrupted,
        wire::Lifecycle::Rejected,
        wire::Lifecycle::Cancelled,
    ] {
        let mut h = Harness::new(SpoolLimits::default());
        let id = issue(1);
        h.spool.open_command(id).unwrap();
        h.spool.session_active(&BTreeMap::new());
        h.spool.event(id, 1, lifecycle(terminal)).unwrap();
        assert_eq!(
            h.spool
                .event(id, 2, Body::SignalResult(wire::SignalResult::default())),
            Err(SpoolError::AfterTerminal(id)),
            "{terminal:?}"
        );
        h.settle();
        h.ack_all();
        h.settle();
        assert_eq!(h.finished, vec![id], "{terminal:?}");
    }
}

#[test]
fn the_session_window_is_shared_round_robin_so_no_command_starves() {
    let limits = SpoolLimits {
        command_window: 160 * KIB,
        session_window: 160 * KIB,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let ids: Vec<Uuid7> = (1..=4).map(issue).collect();
    for id in &ids {
        h.spool.open_command(*id).unwrap();
    }
    for _ in 0..20 {
        for id in &ids {
            h.spool.output(*id, OUT, 1, vec![7; 60_000]).unwrap();
        }
    }
    h.settle();
    h.spool.session_active(&BTreeMap::new());
    h.settle();
    // the window holds two 60 KB events; after as many rounds as there
    // are commands, every command has been given a turn
    for _ in 0..ids.len() {
        h.ack_all();
        h.settle();
    }
    for id in &ids {
        assert!(
            !h.stream_of(*id).is_empty(),
            "{id} was starved of the session window: {:?}",
            ids.iter()
                .map(|i| h.stream_of(*i).len())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn small_offline_output_rolls_at_the_entry_cap_keeping_the_newest() {
    use rvbox_client_core::spool::MAX_ENTRIES_PER_COMMAND;
    let mut h = Harness::new(SpoolLimits::default());
    let a = issue(1);
    h.spool.open_command(a).unwrap();
    // offline: more small chunks than the entry cap holds
    let chunks = MAX_ENTRIES_PER_COMMAND * 2;
    for n in 0..chunks {
        let taken = h.spool.output(a, OUT, 1, vec![b'x'; 100]).unwrap();
        assert_eq!(
            taken,
            Taken::Kept,
            "chunk {n} was dropped instead of rolling"
        );
        if n % 64 == 63 {
            h.settle();
        }
    }
    h.spool
        .event(a, 2, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    h.settle();
    h.spool.session_active(&BTreeMap::new());
    for _ in 0..10_000 {
        h.settle();
        h.ack_all();
        if h.finished.contains(&a) {
            break;
        }
    }
    assert!(h.finished.contains(&a), "never finished");
    let rows = h.stream_of(a);
    let (mut kept, mut rotated, mut overload) = (0u64, 0u64, 0u64);
    let mut seen_output = false;
    for r in &rows {
        match r {
            Row::Output { raw, .. } => {
                kept += raw;
                seen_output = true;
            }
            Row::Event(Body::Truncation(t)) => {
                assert!(!seen_output, "the rotated output is the oldest");
                if t.source == wire::TruncationSource::ClientSpool as i32 {
                    rotated += t.raw_bytes;
                } else {
                    overload += t.raw_bytes;
                }
            }
            _ => {}
        }
    }
    assert_eq!(overload, 0, "nothing was dropped as overload");
    assert!(rotated > 0, "the oldest output rolled");
    assert_eq!(
        kept + rotated,
        100 * chunks as u64,
        "every byte is output or in a marker"
    );
    assert!(matches!(rows.last(), Some(Row::Event(Body::Lifecycle(_)))));
}

#[test]
fn a_failed_rotation_puts_memory_back_as_the_store_holds_it_and_rotates_later() {
    let limits = SpoolLimits {
        output_window: 2 * SEGMENT_RAW_BYTES,
        ..SpoolLimits::default()
    };
    let mut h = Harness::new(limits);
    let id = issue(1);
    h.spool.open_command(id).unwrap();
    let chunk = 64 * 1024;
    let mut produced = 0u64;
    h.fail_next.push("rotate");
    for i in 0..64 {
        h.spool
            .output(id, OUT, i, vec![(i % 251) as u8; chunk])
            .unwrap();
        produced += chunk as u64;
        h.settle();
    }
    assert!(h.fail_next.is_empty(), "a rotation was tried and failed");
    assert!(
        h.unaccountable.is_empty(),
        "a failed rotation loses nothing"
    );
    assert!(
        h.spool.stats().segments_rotated >= 2,
        "rotation went on later"
    );
    h.spool
        .event(id, 100, lifecycle(wire::Lifecycle::Succeeded))
        .unwrap();
    h.settle();
    h.spool.session_active(&BTreeMap::new());
    for _ in 0..200 {
        h.settle();
        h.ack_all();
    }
    // the stream is what the model store holds: every byte kept or marked,
    // contiguous, the terminal last
    let rows = h.stream_of(id);
    let mut total = 0u64;
    for r in &rows {
        match r {
            Row::Output { raw, .. } => total += raw,
            Row::Event(Body::Truncation(t)) => total += t.raw_bytes,
            _ => {}
        }
    }
    assert_eq!(total, produced);
    assert!(matches!(rows.last(), Some(Row::Event(Body::Lifecycle(_)))));
    assert!(h.finished.contains(&id));
}
