//! One connection's outgoing frames: three bounded lanes the writer task
//! takes from in a fixed order (agent.proto, docs/client.md "Transport"):
//!
//! 1. the heartbeat lane: pings and pongs, which nothing else can hold up;
//! 2. the control lane: every frame but terminal traffic, and the close;
//! 3. the data lane: terminal traffic.
//!
//! Each lane is bounded in frames and in bytes ([`HEARTBEAT_LANE`],
//! [`CONTROL_LANE`], [`DATA_LANE`]). A heartbeat that finds its lane full
//! is dropped (it carries nothing, and the next one replaces it); a frame
//! that finds the control or data lane full is refused, and the caller
//! ends the connection: the spool resends every unacknowledged event on
//! the next one and terminals resume from their offsets, so nothing is
//! lost, and memory never grows past the caps.
//!
//! Must never: reorder frames within a lane, or let a frame wait behind a
//! lane of lower rank.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::Message;

/// A lane's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneCap {
    /// Most frames waiting.
    pub(crate) frames: usize,
    /// Most payload bytes waiting.
    pub(crate) bytes: usize,
}

/// Pings, pongs: a few at most ever wait.
pub(crate) const HEARTBEAT_LANE: LaneCap = LaneCap {
    frames: 16,
    bytes: 16 * 1024,
};
/// Command traffic: twice the largest session send window (16 MiB) and
/// its acknowledgements, with room.
pub(crate) const CONTROL_LANE: LaneCap = LaneCap {
    frames: 16_384,
    bytes: 32 * 1024 * 1024,
};
/// Terminal traffic: the terminals' windows bound it well below this.
pub(crate) const DATA_LANE: LaneCap = LaneCap {
    frames: 4_096,
    bytes: 8 * 1024 * 1024,
};

/// A lane, by rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Pings and pongs.
    Heartbeat,
    /// Everything but terminal traffic.
    Control,
    /// Terminal traffic.
    Data,
}

impl Lane {
    /// A bounded word for logs and metric labels.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Heartbeat => "heartbeat",
            Self::Control => "control",
            Self::Data => "data",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Heartbeat => 0,
            Self::Control => 1,
            Self::Data => 2,
        }
    }

    fn cap(self) -> LaneCap {
        match self {
            Self::Heartbeat => HEARTBEAT_LANE,
            Self::Control => CONTROL_LANE,
            Self::Data => DATA_LANE,
        }
    }
}

/// A frame did not fit its lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full(pub(crate) Lane);

/// What the writer takes next.
#[derive(Debug)]
pub(crate) enum Next {
    /// A frame, from the highest lane that holds one.
    Frame(Message),
    /// Nothing waits now (only when not waiting).
    Idle,
    /// The outbox was closed and every lane is drained: the connection
    /// is ending.
    Closed,
}

#[derive(Debug, Default)]
struct Lanes {
    frames: [VecDeque<Message>; 3],
    bytes: [usize; 3],
    closed: bool,
}

/// The lanes of one connection, shared by the transport loop (which
/// pushes) and the connection's writer task (which takes).
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    lanes: Mutex<Lanes>,
    ready: Notify,
}

fn size(m: &Message) -> usize {
    m.len()
}

impl Outbox {
    /// Queues `msg` on `lane`.
    ///
    /// # Errors
    /// [`Full`] when the lane holds its most frames or bytes already, or
    /// the outbox is closed (the frame is dropped; a full heartbeat lane
    /// is not worth a connection, the others are).
    pub(crate) fn push(&self, lane: Lane, msg: Message) -> Result<(), Full> {
        let cap = lane.cap();
        let len = size(&msg);
        {
            let Ok(mut l) = self.lanes.lock() else {
                return Err(Full(lane));
            };
            let i = lane.index();
            let (Some(q), Some(bytes)) = (l.frames.get(i), l.bytes.get(i)) else {
                return Err(Full(lane));
            };
            if l.closed || q.len() >= cap.frames || bytes.saturating_add(len) > cap.bytes {
                return Err(Full(lane));
            }
            if let Some(b) = l.bytes.get_mut(i) {
                *b += len;
            }
            if let Some(q) = l.frames.get_mut(i) {
                q.push_back(msg);
            }
        }
        self.ready.notify_one();
        Ok(())
    }

    /// Closes the outbox after `last` (queued on the control lane past
    /// its bound, so a close is never refused): the writer drains the
    /// heartbeat and control lanes, writes `last`, and ends; terminal
    /// traffic still waiting is dropped.
    pub(crate) fn close_with(&self, last: Message) {
        if let Ok(mut l) = self.lanes.lock() {
            if let Some(q) = l.frames.get_mut(Lane::Control.index()) {
                q.push_back(last);
            }
            if let Some(q) = l.frames.get_mut(Lane::Data.index()) {
                q.clear();
            }
            l.closed = true;
        }
        self.ready.notify_one();
    }

    /// Frames and bytes waiting on `lane`.
    pub(crate) fn depth(&self, lane: Lane) -> (usize, usize) {
        self.lanes.lock().map_or((0, 0), |l| {
            let i = lane.index();
            (
                l.frames.get(i).map_or(0, VecDeque::len),
                l.bytes.get(i).copied().unwrap_or(0),
            )
        })
    }

    fn pop(&self) -> Next {
        let Ok(mut l) = self.lanes.lock() else {
            return Next::Closed;
        };
        for i in 0..3 {
            let Some(m) = l.frames.get_mut(i).and_then(VecDeque::pop_front) else {
                continue;
            };
            if let Some(b) = l.bytes.get_mut(i) {
                *b = b.saturating_sub(size(&m));
            }
            return Next::Frame(m);
        }
        if l.closed { Next::Closed } else { Next::Idle }
    }

    /// The next frame, the heartbeat lane's first, then the control
    /// lane's, then the data lane's; waits for one when `wait`.
    pub(crate) async fn next(&self, wait: bool) -> Next {
        loop {
            match self.pop() {
                Next::Idle if wait => self.ready.notified().await,
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use tokio_tungstenite::tungstenite::Bytes;

    fn name(n: Next) -> String {
        match n {
            Next::Frame(Message::Binary(b)) => String::from_utf8_lossy(&b).into_owned(),
            Next::Frame(Message::Ping(_)) => "ping".into(),
            Next::Frame(Message::Pong(_)) => "pong".into(),
            Next::Frame(Message::Close(_)) => "close".into(),
            Next::Frame(other) => format!("{other:?}"),
            Next::Idle => "idle".into(),
            Next::Closed => "closed".into(),
        }
    }

    fn bin(s: &str) -> Message {
        Message::Binary(s.as_bytes().to_vec().into())
    }

    #[tokio::test]
    async fn heartbeats_go_first_then_control_then_terminal_traffic() {
        let o = Outbox::default();
        for i in 0..3 {
            o.push(Lane::Data, bin(&format!("output {i}"))).unwrap();
        }
        o.push(Lane::Control, bin("event 0")).unwrap();
        assert_eq!(name(o.next(false).await), "event 0");
        assert_eq!(name(o.next(false).await), "output 0");
        o.push(Lane::Control, bin("ack")).unwrap();
        o.push(Lane::Heartbeat, Message::Ping(Bytes::new()))
            .unwrap();
        // a heartbeat queued behind command and terminal traffic overtakes
        // both
        assert_eq!(name(o.next(false).await), "ping");
        assert_eq!(name(o.next(true).await), "ack");
        assert_eq!(name(o.next(true).await), "output 1");
        assert_eq!(name(o.next(false).await), "output 2");
        assert_eq!(name(o.next(false).await), "idle");
    }

    #[tokio::test]
    async fn a_close_goes_after_the_control_lane_and_drops_terminal_traffic() {
        let o = Outbox::default();
        o.push(Lane::Data, bin("output")).unwrap();
        o.push(Lane::Control, bin("event")).unwrap();
        o.close_with(Message::Close(None));
        assert_eq!(o.push(Lane::Control, bin("late")), Err(Full(Lane::Control)));
        o.push(Lane::Heartbeat, Message::Pong(Bytes::new()))
            .unwrap_err();
        assert_eq!(name(o.next(true).await), "event");
        assert_eq!(name(o.next(true).await), "close");
        assert_eq!(name(o.next(true).await), "closed");
    }

    #[tokio::test]
    async fn a_waiting_writer_wakes_for_a_frame_pushed_later() {
        let o = std::sync::Arc::new(Outbox::default());
        let writer = {
            let o = std::sync::Arc::clone(&o);
            tokio::spawn(async move { name(o.next(true).await) })
        };
        tokio::task::yield_now().await;
        o.push(Lane::Data, bin("late output")).unwrap();
        assert_eq!(writer.await.unwrap(), "late output");
    }

    #[test]
    fn every_lane_is_bounded_in_frames_and_in_bytes() {
        for lane in [Lane::Heartbeat, Lane::Control, Lane::Data] {
            let cap = lane.cap();
            // in frames: small frames up to the count
            let o = Outbox::default();
            for _ in 0..cap.frames {
                o.push(lane, Message::Binary(vec![0u8; 1].into())).unwrap();
            }
            assert_eq!(
                o.push(lane, Message::Binary(vec![0u8; 1].into())),
                Err(Full(lane)),
                "{}",
                lane.name()
            );
            assert_eq!(o.depth(lane), (cap.frames, cap.frames));
            // in bytes: large frames up to the byte bound
            let o = Outbox::default();
            let big = cap.bytes / 4;
            for _ in 0..4 {
                o.push(lane, Message::Binary(vec![0u8; big].into()))
                    .unwrap();
            }
            assert_eq!(
                o.push(lane, Message::Binary(vec![0u8; 1].into())),
                Err(Full(lane)),
                "{}",
                lane.name()
            );
            // a frame taken makes room for one
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            assert!(matches!(rt.block_on(o.next(false)), Next::Frame(_)));
            o.push(lane, Message::Binary(vec![0u8; big].into()))
                .unwrap();
            assert_eq!(o.depth(lane), (4, 4 * big));
        }
    }
}
