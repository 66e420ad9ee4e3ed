//! Event ingest (plan §5.3, §6.3): a validated `CommandEvent` becomes an
//! append operation; its `EventAck` is the session's answer to the
//! append's completion, never sooner. Also the routing of every validated
//! client message.

use std::collections::{BTreeMap, VecDeque};

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1::command_event::Body;
use rvbox_session::{ClientMessage, EventDescriptor, GateChange, Input as SessionInput};
use rvbox_store_port::events::{EventAppend, EventOutcome};
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore, convert};

/// Most event descriptors one connection may have waiting for the store
/// (queued here or in flight): the session's own bound on unacknowledged
/// events, so an honest client never reaches it. Under load the ingress
/// gate closes first and the session holds, then refuses, new output
/// (`INGRESS_OVERLOAD`); this is the last bound, and a connection that
/// would pass it is closed without an acknowledgement the same way.
pub const INGEST_QUEUE_PER_CONNECTION: usize = rvbox_session::MAX_UNACKED_EVENTS_PER_SESSION;
/// Events in one append group by default (`storage.group_commit_max_batch`).
#[allow(clippy::cast_possible_truncation)]
pub const GROUP_MAX_EVENTS: usize = rvbox_domain::limits::DEFAULT_GROUP_COMMIT_MAX_BATCH as usize;
/// Most window bytes in one append group.
pub const GROUP_MAX_BYTES: u64 = 8 * 1024 * 1024;
/// Append groups in flight at once: one being made durable while the next
/// gathers what arrives meanwhile, then waits its turn at the writer.
pub const GROUPS_IN_FLIGHT: usize = 2;
/// Bytes a connection may put into a group per round-robin turn (deficit
/// round robin: a verbose connection never monopolizes a group).
pub const INGEST_QUANTUM_BYTES: u64 = 64 * 1024;

/// One validated event waiting for the store.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    /// Its command.
    pub issue: Uuid7,
    /// Its sequence.
    pub event_seq: u64,
    /// Bytes it holds in the ingress gate and the group.
    pub cost: u64,
    /// The event reports the command launched or ended: its script upload
    /// (if any) ends once it is durable.
    pub ends_upload: bool,
    /// The event reports the command's process runs: stdin written
    /// before goes once it is durable.
    pub starts_stdin: bool,
    /// The event reports the command ended: its stdin flow ends once it
    /// is durable.
    pub ends_stdin: bool,
    /// The event acknowledges this stdin write: the window moves once it
    /// is durable.
    pub stdin_ack: Option<u64>,
    /// What the store appends.
    pub event: EventAppend,
}

/// The persistence fairness scheduler (plan §6.1): one bounded FIFO per
/// connection (per-command order is kept because a command's events come
/// from one connection, in order), and deficit round robin across
/// connections when a group is formed.
#[derive(Debug, Default)]
pub struct IngestQueue {
    queues: BTreeMap<ConnId, VecDeque<Queued>>,
    /// Connections with queued events, in round-robin order.
    rotation: VecDeque<ConnId>,
    deficit: BTreeMap<ConnId, u64>,
    /// Events queued or in flight, per connection.
    held: BTreeMap<ConnId, usize>,
    /// Events queued (not yet in a group), and their bytes.
    queued_events: usize,
    queued_bytes: u64,
}

/// When an append group is issued: the group committer's policy (plan
/// §5.3, `storage.group_commit_max_delay` / `_max_batch`) on the core's
/// injected monotonic clock. A group goes to the store as soon as a writer
/// slot is free and it is full (`max_events` events or
/// [`GROUP_MAX_BYTES`]), or no other group is with the store, or once its
/// oldest event has waited `max_delay_ms`.
/// The delay is a maximum batching delay, never permission to acknowledge
/// early: an event's ack still waits for its group's completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPolicy {
    /// Longest the oldest queued event waits for more to join its group
    /// (0: issue at once).
    pub max_delay_ms: u64,
    /// Most events in one group (1 to
    /// [`MAX_GROUP_COMMIT_BATCH`](rvbox_domain::limits::MAX_GROUP_COMMIT_BATCH)).
    pub max_events: usize,
}

impl Default for GroupPolicy {
    /// The configuration's defaults: 2 ms, 512 events.
    fn default() -> Self {
        Self {
            max_delay_ms: rvbox_domain::limits::DEFAULT_GROUP_COMMIT_MAX_DELAY_MS,
            max_events: GROUP_MAX_EVENTS,
        }
    }
}

impl GroupPolicy {
    /// No batching delay: a group goes as soon as a writer slot is free
    /// (the scenario driver, whose steps are single inputs).
    #[must_use]
    pub const fn immediate() -> Self {
        Self {
            max_delay_ms: 0,
            max_events: GROUP_MAX_EVENTS,
        }
    }
}

/// The connection's ingest bound is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

impl IngestQueue {
    /// Events queued (not yet in a group).
    #[must_use]
    pub fn queued(&self) -> usize {
        self.queued_events
    }

    /// Bytes of the queued events.
    #[must_use]
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// Events queued or in flight for `conn`.
    #[must_use]
    pub fn held(&self, conn: ConnId) -> usize {
        self.held.get(&conn).copied().unwrap_or(0)
    }

    /// Queues an event of `conn`.
    ///
    /// # Errors
    /// [`QueueFull`] at [`INGEST_QUEUE_PER_CONNECTION`]; nothing is queued.
    pub fn push(&mut self, conn: ConnId, item: Queued) -> Result<(), QueueFull> {
        let held = self.held.entry(conn).or_default();
        if *held >= INGEST_QUEUE_PER_CONNECTION {
            return Err(QueueFull);
        }
        *held += 1;
        self.queued_events += 1;
        self.queued_bytes = self.queued_bytes.saturating_add(item.cost);
        let q = self.queues.entry(conn).or_default();
        if q.is_empty() {
            self.rotation.push_back(conn);
        }
        q.push_back(item);
        Ok(())
    }

    /// Forms the next group: up to `max_events` events and `max_bytes`
    /// bytes (at least one event when any is queued), taken by deficit
    /// round robin across connections.
    pub fn take_group(&mut self, max_events: usize, max_bytes: u64) -> Vec<(ConnId, Queued)> {
        self.take_group_unless(max_events, max_bytes, |_| false)
    }

    /// Like [`Self::take_group`], but a connection whose next event's
    /// command is `blocked` waits (with everything behind it, keeping its
    /// order) for a later group.
    pub fn take_group_unless(
        &mut self,
        max_events: usize,
        max_bytes: u64,
        blocked: impl Fn(&Uuid7) -> bool,
    ) -> Vec<(ConnId, Queued)> {
        let mut waiting: Vec<ConnId> = Vec::new();
        let mut group: Vec<(ConnId, Queued)> = Vec::new();
        let mut bytes = 0u64;
        while group.len() < max_events {
            let Some(conn) = self.rotation.pop_front() else {
                break;
            };
            if self
                .queues
                .get(&conn)
                .and_then(VecDeque::front)
                .is_some_and(|f| blocked(&f.issue))
            {
                waiting.push(conn);
                continue;
            }
            let deficit = self.deficit.entry(conn).or_default();
            *deficit = deficit.saturating_add(INGEST_QUANTUM_BYTES);
            let mut full = false;
            if let Some(q) = self.queues.get_mut(&conn) {
                while let Some(front) = q.front() {
                    let fits = group.is_empty() || bytes.saturating_add(front.cost) <= max_bytes;
                    if group.len() >= max_events || !fits {
                        full = true;
                        break;
                    }
                    // an event larger than the quantum goes first in a
                    // group of its own turn rather than never
                    if (front.cost > *deficit && !group.is_empty()) || blocked(&front.issue) {
                        break;
                    }
                    let Some(item) = q.pop_front() else {
                        break;
                    };
                    *deficit = deficit.saturating_sub(item.cost);
                    bytes = bytes.saturating_add(item.cost);
                    group.push((conn, item));
                }
            }
            let empty = self.queues.get(&conn).is_none_or(VecDeque::is_empty);
            if empty {
                self.queues.remove(&conn);
                self.deficit.remove(&conn);
            } else {
                self.rotation.push_back(conn);
            }
            if full {
                break;
            }
            // a turn without a fit still adds a quantum: within
            // GROUP_MAX_BYTES / quantum rounds every front event fits
        }
        for conn in waiting.into_iter().rev() {
            self.rotation.push_front(conn);
        }
        self.queued_events = self.queued_events.saturating_sub(group.len());
        self.queued_bytes = self.queued_bytes.saturating_sub(bytes);
        group
    }

    /// Puts a group that could not be issued back at the front of its
    /// connections' queues, in order.
    pub fn put_back(&mut self, items: Vec<(ConnId, Queued)>) {
        for (conn, item) in items.into_iter().rev() {
            self.queued_events += 1;
            self.queued_bytes = self.queued_bytes.saturating_add(item.cost);
            let q = self.queues.entry(conn).or_default();
            if q.is_empty() && !self.rotation.contains(&conn) {
                self.rotation.push_front(conn);
            }
            q.push_front(item);
        }
    }

    /// An event of `conn` left the store's hands (durable, refused, or
    /// its group failed).
    pub fn done(&mut self, conn: ConnId) {
        if let Some(h) = self.held.get_mut(&conn) {
            *h = h.saturating_sub(1);
            if *h == 0 {
                self.held.remove(&conn);
            }
        }
    }

    /// Forgets a connection's queued events; returns their costs.
    pub fn remove_conn(&mut self, conn: ConnId) -> u64 {
        self.rotation.retain(|c| *c != conn);
        self.deficit.remove(&conn);
        let (n, cost) = self
            .queues
            .remove(&conn)
            .map_or((0, 0), |q| (q.len(), q.iter().map(|i| i.cost).sum::<u64>()));
        self.queued_events = self.queued_events.saturating_sub(n);
        self.queued_bytes = self.queued_bytes.saturating_sub(cost);
        // events in flight still finish; their count goes with the conn
        self.held.remove(&conn);
        cost
    }
}

/// One append group in flight.
#[derive(Debug)]
pub(crate) struct Pending {
    items: Vec<(ConnId, Queued)>,
}

impl ServerCore {
    /// Routes a validated client message.
    pub(crate) fn deliver(&mut self, conn: ConnId, msg: ClientMessage) {
        match msg {
            ClientMessage::ClientSnapshot(chunk) => self.snapshot(conn, &chunk),
            ClientMessage::ClientCapacity(cap) => {
                let Some(client) = self.client_of(conn) else {
                    return;
                };
                let Some(st) = self.clients.get_mut(&client) else {
                    return;
                };
                match st.capacity.apply_report(&cap) {
                    Ok(_) => self.mark_ready(&client),
                    Err(e) => {
                        tracing::warn!(error = %e, "capacity report refused");
                        self.close(conn, rvbox_proto::v1::CloseReason::ProtocolError);
                    }
                }
            }
            ClientMessage::CommandAccepted { issue, message } => {
                self.accepted(conn, issue, &message);
            }
            ClientMessage::CommandEvent(desc) => self.event(conn, desc),
            ClientMessage::ScriptUploadStatus { issue, message } => {
                self.upload_status(conn, issue, &message);
            }
            ClientMessage::Pty { payload, .. } => self.pty_report(conn, payload),
            ClientMessage::ControlError(_) => {}
        }
    }

    fn event(&mut self, conn: ConnId, desc: EventDescriptor) {
        let issue = desc.issue;
        let event_seq = desc.event_seq;
        let ends_upload = matches!(
            &desc.event.body,
            Some(Body::Lifecycle(l)) if Lifecycle::from_wire(l.lifecycle).is_ok_and(|to| to != Lifecycle::Accepted)
        );
        let starts_stdin = matches!(
            &desc.event.body,
            Some(Body::Lifecycle(l)) if Lifecycle::from_wire(l.lifecycle) == Ok(Lifecycle::Running)
        );
        let ends_stdin = matches!(
            &desc.event.body,
            Some(Body::Lifecycle(l)) if Lifecycle::from_wire(l.lifecycle).is_ok_and(Lifecycle::is_terminal)
        );
        let stdin_ack = match &desc.event.body {
            Some(Body::StdinAck(a)) => Some(a.write_seq),
            _ => None,
        };
        let event = match convert::event_append(&desc.event) {
            Ok(mut ev) => {
                // the store refuses it once this session is no longer live
                ev.session = self.fence_of(conn);
                ev
            }
            Err(error) => {
                return self.session_input(
                    conn,
                    SessionInput::EventRefused {
                        issue,
                        event_seq,
                        error,
                    },
                );
            }
        };
        let item = Queued {
            issue,
            event_seq,
            cost: desc.window_cost,
            ends_upload,
            starts_stdin,
            ends_stdin,
            stdin_ack,
            event,
        };
        if self.ingest.push(conn, item).is_err() {
            self.stats.ingest_queue_full += 1;
            tracing::warn!(conn, "persistence queue of the connection is full; closing");
            self.session_input(conn, SessionInput::IngressQueueFull);
            return;
        }
        if let Some(GateChange::Closed) = self.gate.admit(desc.window_cost) {
            self.gate_changed(false);
        }
    }

    /// Tells every session the server-wide ingress gate changed.
    fn gate_changed(&mut self, open: bool) {
        self.stats.gate_changes += 1;
        tracing::info!(open, level = self.gate.level(), "ingress gate changed");
        let conns: Vec<ConnId> = self.conns.keys().copied().collect();
        for conn in conns {
            self.session_input(conn, SessionInput::IngressGate { open });
        }
    }

    /// Releases bytes from the ingress gate.
    pub(crate) fn release_ingress(&mut self, bytes: u64) {
        match self.gate.release(bytes) {
            Ok(Some(GateChange::Opened)) => self.gate_changed(true),
            Ok(_) => {}
            Err(e) => {
                // an accounting bug, never input: named, and the gate left
                // where it was
                debug_assert!(false, "ingress gate underflow: {e:?}");
                tracing::error!(error = ?e, "ingress gate underflow");
            }
        }
    }

    /// Forms append groups while fewer than [`GROUPS_IN_FLIGHT`] are with
    /// the store.
    /// When the queued events' group is due under the group policy: now
    /// when it is full or the store has no group, else when its oldest
    /// event has waited the delay.
    pub(crate) fn group_due_at(&self) -> Option<u64> {
        if self.ingest.queued() == 0 || self.groups_in_flight >= GROUPS_IN_FLIGHT {
            return None;
        }
        let full = self.ingest.queued() >= self.group_policy.max_events
            || self.ingest.queued_bytes() >= GROUP_MAX_BYTES;
        // an idle store has nothing for a group to wait behind: a lone
        // event goes at once, and under load the events that arrive while
        // a group is being written form the next one
        if full || self.groups_in_flight == 0 {
            return Some(self.now_ms);
        }
        let since = self.ingest_since.unwrap_or(self.now_ms);
        Some(since.saturating_add(self.group_policy.max_delay_ms))
    }

    pub(crate) fn pump_ingest(&mut self) {
        if self.ingest.queued() == 0 {
            self.ingest_since = None;
            return;
        }
        if self.ingest_since.is_none() {
            self.ingest_since = Some(self.now_ms);
        }
        while self.groups_in_flight < GROUPS_IN_FLIGHT {
            if self.group_due_at().is_none_or(|t| t > self.now_ms) {
                return;
            }
            // a command whose acceptance is being written waits: its
            // events follow the acceptance, as the client sent them
            let barrier = &self.barrier;
            let max_events = self.group_policy.max_events.clamp(
                1,
                usize::try_from(rvbox_domain::limits::MAX_GROUP_COMMIT_BATCH).unwrap_or(4096),
            );
            let items = self
                .ingest
                .take_group_unless(max_events, GROUP_MAX_BYTES, |i| barrier.contains(i));
            if items.is_empty() {
                return;
            }
            // what stays queued has waited since before this group; it is
            // due as soon as a writer slot frees
            if self.ingest.queued() == 0 {
                self.ingest_since = None;
            }
            if !self.can_issue() {
                // the operation table is full: the group waits for room
                self.ingest.put_back(items);
                return;
            }
            let events = items.iter().map(|(_, q)| q.event.clone()).collect();
            self.store(
                StoreOp::AppendEvents { events },
                Any::Ingest(Pending { items }),
            );
            self.groups_in_flight += 1;
        }
    }

    pub(crate) fn ingest_done(&mut self, p: Pending, result: OpResult) {
        self.groups_in_flight = self.groups_in_flight.saturating_sub(1);
        let report = match result {
            Ok(Completion::Appended(report)) if report.outcomes.len() == p.items.len() => {
                Ok(report)
            }
            Ok(_) => {
                self.mismatch("append_events");
                Err(DomainError::new(
                    Code::Internal,
                    "append completion does not match its group",
                ))
            }
            Err(e) => {
                tracing::error!(error = %e, events = p.items.len(), "event group failed; nothing acknowledged");
                Err(DomainError::new(Code::Unavailable, "server store failed"))
            }
        };
        for (n, (conn, q)) in p.items.into_iter().enumerate() {
            self.ingest.done(conn);
            self.release_ingress(q.cost);
            let input = match &report {
                Err(error) => SessionInput::EventRefused {
                    issue: q.issue,
                    event_seq: q.event_seq,
                    error: error.clone(),
                },
                Ok(report) => match report.outcomes.get(n) {
                    Some(EventOutcome::Appended | EventOutcome::Duplicate) => {
                        self.stats.events_durable += 1;
                        if q.ends_upload {
                            self.end_upload(conn, q.issue);
                        }
                        if let Some(write_seq) = q.stdin_ack {
                            self.stdin_acked(conn, q.issue, write_seq);
                        }
                        if q.starts_stdin {
                            self.wake_stdin(conn, q.issue);
                        }
                        if q.ends_stdin {
                            self.end_stdin(conn, q.issue);
                        }
                        SessionInput::EventsDurable {
                            issue: q.issue,
                            durable_seq: report
                                .acked
                                .get(q.issue.as_bytes())
                                .copied()
                                .unwrap_or(q.event_seq),
                        }
                    }
                    Some(EventOutcome::Refused(e)) if e.code() == Code::StaleSession => {
                        self.stats.events_refused += 1;
                        self.write_fenced(conn);
                        continue;
                    }
                    Some(EventOutcome::Refused(e)) => {
                        self.stats.events_refused += 1;
                        if e.code() == Code::QuotaExceeded {
                            // the next pass's pressure rotation makes room
                            self.maintenance_asked = true;
                        }
                        SessionInput::EventRefused {
                            issue: q.issue,
                            event_seq: q.event_seq,
                            error: e.clone(),
                        }
                    }
                    None => continue,
                },
            };
            self.session_input(conn, input);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rvbox_store_port::events::EventBody;

    fn item(n: u8, seq: u64, cost: u64) -> Queued {
        let mut b = [0u8; 16];
        b[0] = 1;
        b[6] = 0x70;
        b[8] = 0x80;
        b[15] = n;
        let issue = Uuid7::from_bytes("t", b).unwrap();
        Queued {
            issue,
            event_seq: seq,
            cost,
            ends_upload: false,
            starts_stdin: false,
            ends_stdin: false,
            stdin_ack: None,
            event: EventAppend {
                issue_uuid: b,
                event_seq: seq,
                observed_ms: 0,
                body: EventBody::Other {
                    kind: 9,
                    encoded: Vec::new(),
                },
                session: None,
            },
        }
    }

    #[test]
    fn a_verbose_connection_does_not_starve_a_quiet_one() {
        let mut q = IngestQueue::default();
        for seq in 1..=100 {
            q.push(1, item(1, seq, 16 * 1024)).unwrap();
        }
        q.push(2, item(2, 1, 1024)).unwrap();
        let g = q.take_group(8, u64::MAX);
        let conns: Vec<ConnId> = g.iter().map(|(c, _)| *c).collect();
        assert!(
            conns.contains(&2),
            "the quiet connection is in the first group: {conns:?}"
        );
        assert_eq!(g.len(), 8);
        // per-connection order is kept
        let seqs: Vec<u64> = g
            .iter()
            .filter(|(c, _)| *c == 1)
            .map(|(_, i)| i.event_seq)
            .collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn groups_respect_their_bounds_and_take_at_least_one_event() {
        let mut q = IngestQueue::default();
        for seq in 1..=10 {
            q.push(1, item(1, seq, 100)).unwrap();
        }
        assert_eq!(q.take_group(3, u64::MAX).len(), 3);
        assert_eq!(q.take_group(100, 250).len(), 2);
        let mut big = IngestQueue::default();
        big.push(1, item(1, 1, 10 * 1024 * 1024)).unwrap();
        assert_eq!(
            big.take_group(100, 1024).len(),
            1,
            "an event larger than the byte bound still goes"
        );
    }

    #[test]
    fn the_per_connection_bound_counts_events_until_they_are_done() {
        let mut q = IngestQueue::default();
        for seq in 0..INGEST_QUEUE_PER_CONNECTION as u64 {
            q.push(1, item(1, seq + 1, 10)).unwrap();
        }
        assert_eq!(q.push(1, item(1, 9999, 10)), Err(QueueFull));
        let g = q.take_group(10, u64::MAX);
        assert_eq!(
            q.push(1, item(1, 9999, 10)),
            Err(QueueFull),
            "in flight still counts"
        );
        for (c, _) in g {
            q.done(c);
        }
        assert!(q.push(1, item(1, 9999, 10)).is_ok());
        assert!(
            q.push(2, item(2, 1, 10)).is_ok(),
            "another connection has its own bound"
        );
        assert_eq!(q.remove_conn(2), 10);
    }
}
