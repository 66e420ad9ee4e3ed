//! Operator stdin (plan §9.1 `AppendStdin`/`CloseStdin`, §7.3, R-7.6-05,
//! P-AG-082): an append or close is durable as numbered writes before
//! any frame leaves; the server sends the pending writes of a command the
//! client holds, in `write_seq` order, never more than
//! [`STDIN_WINDOW_BYTES`] (raw) or [`STDIN_WINDOW_WRITES`] per command
//! beyond the client's acknowledgements, and within the connection's
//! 8 MiB data window shared with script uploads. The client's `StdinAck`
//! events, once durable, move the window.
//!
//! After a reconnect the pending writes go again from the first one: the
//! client ignores a write it already holds (its acknowledgement is in its
//! event spool), so delivery is exactly once into the child.
//!
//! [`StdinFlows`] is the pure window bookkeeping of one connection; the
//! server core turns its reads into store operations and frames.

use std::collections::{BTreeMap, VecDeque};

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};
use rvbox_store_port::stdin::{StdinOutcome, StdinResponse, deliverable};

use crate::connections::ConnId;
use crate::upload::SCRIPT_SESSION_WINDOW_BYTES;
use crate::{ControlAnswer, Output, Pending as Any, RequestId, ServerCore};

/// Raw stdin bytes in flight per command beyond the client's
/// acknowledgements (the 1 MiB per-command data window).
pub const STDIN_WINDOW_BYTES: u64 = 1024 * 1024;
/// Stdin writes in flight per command (close-only and newline-only
/// writes carry no data, so bytes alone do not bound them).
pub const STDIN_WINDOW_WRITES: u64 = 64;
/// Commands with stdin in flight on one connection (a client's held
/// commands are bounded far below this).
pub const MAX_STDIN_FLOWS_PER_CONNECTION: usize = 1024;

/// One command's stdin on one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Flow {
    /// Highest `write_seq` sent on this connection.
    sent_through: u64,
    /// Writes sent and not yet acknowledged: (write_seq, window cost).
    in_flight: VecDeque<(u64, u64)>,
    /// A store read is in flight (one at a time, so writes leave in order).
    reading: bool,
    /// The store may hold pending writes not yet sent.
    more: bool,
    /// A pump came while a read was in flight (an acknowledgement or a
    /// freed data lane may have widened the window the read was given).
    again: bool,
}

impl Flow {
    fn bytes(&self) -> u64 {
        self.in_flight.iter().map(|(_, b)| b).sum()
    }

    fn idle(&self) -> bool {
        self.in_flight.is_empty() && !self.reading && !self.more
    }
}

/// The window cost of a write: its raw bytes, at least one.
#[must_use]
pub fn cost(w: &wire::StdinWrite) -> u64 {
    u64::from(w.raw_length).max(1)
}

/// The stdin flows of one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdinFlows {
    map: BTreeMap<Uuid7, Flow>,
}

impl StdinFlows {
    /// Raw bytes in flight over every command.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.map.values().map(Flow::bytes).sum()
    }

    /// Commands with a flow.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no command has a flow.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Commands with a flow, in order.
    #[must_use]
    pub fn issues(&self) -> Vec<Uuid7> {
        self.map.keys().copied().collect()
    }

    /// The store may hold pending writes of `issue`: true when the flow
    /// exists (or was made) and false at the per-connection bound.
    pub fn wake(&mut self, issue: Uuid7) -> bool {
        if !self.map.contains_key(&issue) && self.map.len() >= MAX_STDIN_FLOWS_PER_CONNECTION {
            return false;
        }
        self.map.entry(issue).or_default().more = true;
        true
    }

    /// The next read of `issue`, `(after_seq, max_bytes, max_writes)`,
    /// within the command window and `session_room`; `None` while a read
    /// is in flight, nothing may be pending, or a window is full.
    pub fn next_read(&mut self, issue: &Uuid7, session_room: u64) -> Option<(u64, u64, u64)> {
        let f = self.map.get_mut(issue)?;
        if f.reading {
            f.again = true;
            return None;
        }
        if !f.more {
            return None;
        }
        let bytes = STDIN_WINDOW_BYTES
            .saturating_sub(f.bytes())
            .min(session_room);
        let writes = STDIN_WINDOW_WRITES.saturating_sub(f.in_flight.len() as u64);
        if bytes == 0 || writes == 0 {
            return None;
        }
        f.reading = true;
        f.more = false;
        f.again = false;
        Some((f.sent_through, bytes, writes))
    }

    /// After a read that returned nothing to send: whether the window
    /// may have widened while it ran and writes still wait, so that one
    /// more read is due (without it, acknowledgements that all came
    /// during the read would leave the remaining writes unsent until a
    /// reconnect).
    pub fn take_again(&mut self, issue: &Uuid7) -> bool {
        self.map
            .get_mut(issue)
            .is_some_and(|f| std::mem::take(&mut f.again) && f.more)
    }

    /// A read of `issue` finished: the writes it returned that are not
    /// yet sent, in order; `more` says the store holds further ones.
    pub fn read_done(
        &mut self,
        issue: &Uuid7,
        writes: Vec<wire::StdinWrite>,
        more: bool,
    ) -> Vec<wire::StdinWrite> {
        let Some(f) = self.map.get_mut(issue) else {
            return Vec::new();
        };
        f.reading = false;
        f.more |= more;
        let fresh: Vec<_> = writes
            .into_iter()
            .filter(|w| w.write_seq > f.sent_through)
            .collect();
        if f.idle() && fresh.is_empty() {
            self.map.remove(issue);
        }
        fresh
    }

    /// `w` was queued on the session.
    pub fn sent(&mut self, issue: &Uuid7, w: &wire::StdinWrite) {
        if let Some(f) = self.map.get_mut(issue) {
            f.sent_through = f.sent_through.max(w.write_seq);
            f.in_flight.push_back((w.write_seq, cost(w)));
        }
    }

    /// `w` and what followed it could not be queued (a full data lane):
    /// they are read again once the lane has room.
    pub fn unsent(&mut self, issue: &Uuid7) {
        if let Some(f) = self.map.get_mut(issue) {
            f.more = true;
        }
    }

    /// The client acknowledged every write up to `write_seq` (its
    /// acknowledgements come in order); true when the window moved.
    pub fn acked(&mut self, issue: &Uuid7, write_seq: u64) -> bool {
        let Some(f) = self.map.get_mut(issue) else {
            return false;
        };
        let before = f.in_flight.len();
        while f.in_flight.front().is_some_and(|(s, _)| *s <= write_seq) {
            f.in_flight.pop_front();
        }
        let moved = f.in_flight.len() != before;
        if f.idle() {
            self.map.remove(issue);
        }
        moved
    }

    /// Forgets `issue` (its command ended).
    pub fn end(&mut self, issue: &Uuid7) -> bool {
        self.map.remove(issue).is_some()
    }
}

#[derive(Debug)]
pub(crate) enum Pending {
    /// `AppendStdin` or `CloseStdin`.
    Mutation { request: RequestId, close: bool },
    /// Pending writes of a command, for a connection.
    Read { conn: ConnId, issue: Uuid7 },
}

impl ServerCore {
    /// Pending writes of `issue` may wait in the store: read and send
    /// them on `conn` as the windows allow.
    pub(crate) fn wake_stdin(&mut self, conn: ConnId, issue: Uuid7) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if !c.stdin.wake(issue) {
            tracing::warn!(
                "too many commands with stdin on one connection; this one waits for a reconnect"
            );
            return;
        }
        self.pump_stdin(conn, issue);
    }

    /// Reads the next writes of `issue` while its windows have room.
    fn pump_stdin(&mut self, conn: ConnId, issue: Uuid7) {
        if !self.data_room(conn) {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.data_blocked = true;
            }
            return;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let room = SCRIPT_SESSION_WINDOW_BYTES
            .saturating_sub(c.uploads.in_flight())
            .saturating_sub(c.stdin.in_flight());
        let Some((after_seq, max_bytes, max_writes)) = c.stdin.next_read(&issue, room) else {
            return;
        };
        self.store(
            StoreOp::PendingStdin {
                issue: *issue.as_bytes(),
                after_seq,
                max_bytes,
                max_writes,
            },
            Any::Stdin(Pending::Read { conn, issue }),
        );
    }

    /// Pumps every stdin flow of `conn`, in command order.
    pub(crate) fn pump_stdins(&mut self, conn: ConnId) {
        let issues = self
            .conns
            .get(&conn)
            .map(|c| c.stdin.issues())
            .unwrap_or_default();
        for issue in issues {
            self.pump_stdin(conn, issue);
        }
    }

    /// A durable `StdinAck` of `issue` for `write_seq` on `conn`.
    pub(crate) fn stdin_acked(&mut self, conn: ConnId, issue: Uuid7, write_seq: u64) {
        let moved = self
            .conns
            .get_mut(&conn)
            .is_some_and(|c| c.stdin.acked(&issue, write_seq));
        self.stats.stdin_acks += 1;
        if moved {
            self.pump_stdins(conn);
        }
    }

    /// The command of `issue` launched nothing more to write to (it ended).
    pub(crate) fn end_stdin(&mut self, conn: ConnId, issue: Uuid7) {
        if self
            .conns
            .get_mut(&conn)
            .is_some_and(|c| c.stdin.end(&issue))
        {
            self.pump_stdins(conn);
        }
    }

    pub(crate) fn stdin_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Mutation { request, close } => {
                let outcome = match result {
                    Ok(Completion::Stdin(o)) => Ok(*o),
                    Ok(_) => {
                        self.mismatch("stdin");
                        Err(PortError::Unavailable(
                            "completion does not match the stdin operation".into(),
                        ))
                    }
                    Err(e) => Err(e),
                };
                if let Ok(o) = &outcome {
                    self.stats.stdin_mutations += 1;
                    self.deliver_stdin(o);
                }
                let answer = match (close, outcome) {
                    (
                        false,
                        Ok(StdinOutcome {
                            response: StdinResponse::Append(r),
                            ..
                        }),
                    ) => ControlAnswer::AppendStdin(Ok(r)),
                    (
                        true,
                        Ok(StdinOutcome {
                            response: StdinResponse::Close(r),
                            ..
                        }),
                    ) => ControlAnswer::CloseStdin(Ok(r)),
                    (close, Ok(_)) => {
                        self.mismatch("stdin response");
                        let e = PortError::Unavailable(
                            "stored stdin response does not match the method".into(),
                        );
                        if close {
                            ControlAnswer::CloseStdin(Err(e))
                        } else {
                            ControlAnswer::AppendStdin(Err(e))
                        }
                    }
                    (false, Err(e)) => ControlAnswer::AppendStdin(Err(e)),
                    (true, Err(e)) => ControlAnswer::CloseStdin(Err(e)),
                };
                self.out.push_back(Output::Reply { request, answer });
            }
            Pending::Read { conn, issue } => {
                let (writes, more) = match result {
                    Ok(Completion::StdinWrites(w)) => (w.writes, w.more),
                    Ok(_) => {
                        self.mismatch("pending_stdin");
                        (Vec::new(), false)
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "pending stdin not readable; the connection closes");
                        self.stats.stdin_failures += 1;
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                        return;
                    }
                };
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let fresh = c.stdin.read_done(&issue, writes, more);
                // nothing fitted the window the read was given: the next
                // acknowledgement (or a freed data lane) reads again, and
                // so does one that came while this read ran; never a
                // read in a loop
                if fresh.is_empty() {
                    if c.stdin.take_again(&issue) {
                        self.pump_stdin(conn, issue);
                    }
                    return;
                }
                for w in fresh {
                    let write = w.clone();
                    if self.send(conn, Payload::StdinWrite(w)) {
                        self.stats.stdin_writes_sent += 1;
                        if let Some(c) = self.conns.get_mut(&conn) {
                            c.stdin.sent(&issue, &write);
                        }
                    } else {
                        // a full data lane (read again once it has room), or
                        // a session that is closing (sent after the next
                        // reconciliation)
                        if let Some(c) = self.conns.get_mut(&conn) {
                            c.stdin.unsent(&issue);
                        }
                        return;
                    }
                }
                self.pump_stdin(conn, issue);
            }
        }
    }

    /// Fresh writes of a running command go to its client's live,
    /// reconciled connection; otherwise they wait for its `running` event
    /// or the next reconciliation.
    fn deliver_stdin(&mut self, o: &StdinOutcome) {
        if o.replayed || !deliverable(o.lifecycle) {
            return;
        }
        let issue = match &o.response {
            StdinResponse::Append(r) => &r.issue_uuid,
            StdinResponse::Close(r) => &r.issue_uuid,
        };
        let Ok(issue) = Uuid7::parse("issue_uuid", issue) else {
            return;
        };
        let live = self
            .clients
            .get(&o.client_id)
            .filter(|st| st.ready)
            .and_then(|st| st.conn);
        if let Some(conn) = live {
            self.wake_stdin(conn, issue);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> Uuid7 {
        let mut b = [0u8; 16];
        b[0] = 0x01;
        b[6] = 0x70;
        b[8] = 0x80;
        b[15] = n;
        Uuid7::from_bytes("t", b).unwrap()
    }

    fn write(seq: u64, raw: u32) -> wire::StdinWrite {
        wire::StdinWrite {
            write_seq: seq,
            raw_length: raw,
            ..Default::default()
        }
    }

    const KIB: u32 = 1024;

    #[test]
    fn the_window_bounds_what_is_in_flight_and_acks_move_it() {
        let mut f = StdinFlows::default();
        assert!(f.wake(id(1)));
        assert_eq!(
            f.next_read(&id(1), u64::MAX),
            Some((0, STDIN_WINDOW_BYTES, 64))
        );
        assert_eq!(f.next_read(&id(1), u64::MAX), None, "one read at a time");
        let got = f.read_done(&id(1), (1..=4).map(|s| write(s, 256 * KIB)).collect(), true);
        assert_eq!(got.len(), 4);
        for w in &got {
            f.sent(&id(1), w);
        }
        assert_eq!(f.in_flight(), STDIN_WINDOW_BYTES);
        assert_eq!(f.next_read(&id(1), u64::MAX), None, "the window is full");
        assert!(f.acked(&id(1), 2));
        assert_eq!(
            f.next_read(&id(1), u64::MAX),
            Some((4, 512 * 1024, 62)),
            "reads continue after the last write sent"
        );
    }

    #[test]
    fn a_write_sent_already_is_not_sent_twice_and_an_idle_flow_goes() {
        let mut f = StdinFlows::default();
        f.wake(id(1));
        f.next_read(&id(1), u64::MAX);
        let got = f.read_done(&id(1), vec![write(1, 3)], false);
        f.sent(&id(1), &got[0]);
        f.wake(id(1));
        f.next_read(&id(1), u64::MAX);
        assert!(
            f.read_done(&id(1), vec![write(1, 3), write(2, 1)], false)
                .iter()
                .all(|w| w.write_seq == 2)
        );
        f.sent(&id(1), &write(2, 1));
        f.acked(&id(1), 2);
        assert!(f.is_empty(), "nothing in flight, nothing pending");
    }

    #[test]
    fn the_session_room_and_the_write_count_bound_a_read() {
        let mut f = StdinFlows::default();
        f.wake(id(1));
        assert_eq!(f.next_read(&id(1), 0), None, "no session room");
        assert_eq!(f.next_read(&id(1), 10), Some((0, 10, STDIN_WINDOW_WRITES)));
        let got = f.read_done(&id(1), (1..=64).map(|s| write(s, 0)).collect(), true);
        for w in &got {
            f.sent(&id(1), w);
        }
        assert_eq!(
            f.next_read(&id(1), u64::MAX),
            None,
            "64 close-size writes fill it"
        );
        assert!(f.acked(&id(1), 64));
        assert!(f.next_read(&id(1), u64::MAX).is_some());
    }

    #[test]
    fn acknowledgements_during_a_read_that_found_no_room_read_again() {
        let mut f = StdinFlows::default();
        f.wake(id(1));
        let (_, max, _) = f.next_read(&id(1), u64::MAX).unwrap();
        assert_eq!(max, STDIN_WINDOW_BYTES);
        // four writes nearly fill the window; a fifth waits
        let sent = f.read_done(&id(1), (1..=4).map(|s| write(s, 250 * KIB)).collect(), true);
        for w in &sent {
            f.sent(&id(1), w);
        }
        // a read with the little room left is in flight ...
        assert_eq!(
            f.next_read(&id(1), u64::MAX),
            Some((4, 24 * KIB as u64, STDIN_WINDOW_WRITES - 4))
        );
        // ... when every acknowledgement arrives
        assert!(f.acked(&id(1), 4));
        assert_eq!(f.next_read(&id(1), u64::MAX), None, "one read at a time");
        // it found nothing that fitted its window; the window has moved
        assert!(f.read_done(&id(1), Vec::new(), true).is_empty());
        assert!(f.take_again(&id(1)), "the waiting write is read again");
        assert_eq!(
            f.next_read(&id(1), u64::MAX),
            Some((4, STDIN_WINDOW_BYTES, STDIN_WINDOW_WRITES))
        );
        // without a pump during the read, no second read
        assert!(f.read_done(&id(1), Vec::new(), true).is_empty());
        assert!(!f.take_again(&id(1)));
    }

    #[test]
    fn the_flow_bound() {
        let mut f = StdinFlows::default();
        for n in 0..MAX_STDIN_FLOWS_PER_CONNECTION {
            let mut b = [0u8; 16];
            b[0] = 1;
            b[6] = 0x70;
            b[8] = 0x80;
            b[13..16].copy_from_slice(&u32::try_from(n).unwrap().to_be_bytes()[1..]);
            assert!(f.wake(Uuid7::from_bytes("t", b).unwrap()));
        }
        let mut other = *id(1).as_bytes();
        other[2] = 0xee;
        assert!(!f.wake(Uuid7::from_bytes("t", other).unwrap()));
    }
}
