//! A deterministic network between the server and the simulated clients.
//!
//! Each connection is a WebSocket over TCP between the server and one
//! client. It carries opaque binary frames (encoded envelopes) and the
//! WebSocket control items Ping, Pong and Close. Each direction is a FIFO
//! queue whose items carry a delivery time; [`Net::deliver_due`] hands out
//! every item due by `now`, earliest first, ties broken by send order.
//!
//! # Fault model (conventions rule 7: only faults the real system meets)
//!
//! TCP delivers a stream reliably and in order, or breaks. So:
//!
//! - **Order within a connection is never violated.** A direction's
//!   delivery times never decrease: a delayed item holds back every later
//!   item of that direction (head-of-line blocking), exactly as TCP does.
//! - **Delay** ([`NetCounters::delayed`]): extra latency on one item; the
//!   items behind it wait too.
//! - **Stall / reorder** ([`NetCounters::stalls`], [`NetCounters::reordered`]):
//!   a direction stops for a while, as during TCP retransmission after a
//!   lost segment, then resumes in order. Items of *other* connections
//!   overtake it; that cross-connection reordering is the only reordering
//!   there is, and `reordered` counts each delivery that was overtaken by
//!   an item sent after it on another connection.
//! - **Loss** ([`NetCounters::lost`]): a WebSocket never silently drops a
//!   frame in mid-stream. A frame that does not arrive means the connection
//!   broke: the item is dropped, every item behind it in either direction
//!   is dropped, and each end learns of the break ([`NetEvent::Closed`])
//!   after the items already ahead of the break were delivered.
//! - **Duplication** ([`NetCounters::dup_cuts`]): TCP never hands the
//!   application a frame twice. Duplicates on the real system come from the
//!   application re-sending after a reconnect because the answer was lost.
//!   So this fault delivers the item and then breaks the connection before
//!   any answer can travel back: the sender never sees the ack and replays
//!   the item on its next connection.
//! - **Partition** ([`NetCounters::partitions`]): the client's link goes
//!   silent until a time: every item of its connections, in flight or sent
//!   later, waits until the partition ends (TCP keeps retransmitting; it
//!   neither drops nor reorders), and new connections are refused
//!   ([`NetCounters::refused_connects`]). Endpoints notice only through
//!   their own liveness timers; whatever they then send (a Close) arrives
//!   after the partition, as on a real network.
//!   [`Net::partition_cut`] is the variant where the connections are reset
//!   at once instead (a firewall answering with resets).
//! - **Cut** ([`Net::cut`], [`NetCounters::cuts`]): a reset seen by both
//!   ends. **Crash** ([`Net::crash`], [`NetCounters::crashes`]): one end's
//!   process died; what it had already written is still delivered, then
//!   the peer sees the connection close; nothing is delivered to the dead
//!   end.
//! - **Overflow** ([`NetCounters::overflow_cuts`]): a send into a full
//!   queue breaks the connection (a write deadline expiring), and the
//!   sender gets [`NetError::QueueFull`].
//!
//! Not modelled because TCP hides them: corrupted, truncated or duplicated
//! frames, and reordering inside one connection.

use std::collections::{BTreeMap, VecDeque};

use std::fmt;

use rvbox_domain::limits::MIB;

use crate::rng::SimRng;

/// Most connections open at once (both ends included).
pub const MAX_CONNECTIONS: usize = 4096;
/// Most items queued in one direction of one connection (matches the
/// session's unacknowledged-event bound plus control headroom).
pub const MAX_QUEUE_ITEMS: usize = 65_536 + 1024;
/// Most bytes queued in one direction of one connection: the 8 MiB
/// session window plus control and replay headroom.
pub const MAX_QUEUE_BYTES: u64 = 16 * MIB;
/// Ceiling of the configured one-way base latency.
pub const MAX_BASE_LATENCY_MS: u64 = 10_000;
/// Ceiling of the configured per-item jitter.
pub const MAX_JITTER_MS: u64 = 10_000;
/// Ceiling of one delay fault.
pub const MAX_EXTRA_DELAY_MS: u64 = 30_000;
/// Ceiling of one stall fault.
pub const MAX_STALL_MS: u64 = 60_000;
/// Ceiling of one partition.
pub const MAX_PARTITION_MS: u64 = 30 * 60_000;
/// Most deliveries one [`Net::deliver_due`] call returns; the rest stay
/// due and come with the next call.
pub const MAX_DELIVERIES_PER_CALL: usize = 131_072;
/// Bytes charged for an item without payload (control frames, markers).
const CONTROL_ITEM_BYTES: u64 = 2;

/// WebSocket close codes (agent.proto `CloseReason`).
pub mod close_code {
    /// Orderly close.
    pub const NORMAL: u16 = 1000;
    /// Protocol error.
    pub const PROTOCOL_ERROR: u16 = 1002;
    /// Frame above the envelope limit.
    pub const MESSAGE_TOO_BIG: u16 = 1009;
    /// Internal invariant failed.
    pub const INTERNAL_ERROR: u16 = 1011;
    /// Daemon restarting.
    pub const SERVICE_RESTART: u16 = 1012;
    /// Replaced by a newer generation.
    pub const SESSION_FENCED: u16 = 4000;
    /// Envelope session fields do not match.
    pub const STALE_SESSION: u16 = 4001;
    /// No inbound frame for the liveness timeout.
    pub const LIVENESS_TIMEOUT: u16 = 4002;
    /// Essential ingress queue full.
    pub const INGRESS_OVERLOAD: u16 = 4003;
    /// Storage recovering or unavailable.
    pub const STORAGE_UNAVAILABLE: u16 = 4004;
    /// Hello refused.
    pub const HELLO_REJECTED: u16 = 4005;
}

/// A connection, numbered from 1 in creation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// A simulated client's slot in the world (its index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientSlot(pub u32);

/// One end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Side {
    /// The server.
    Server,
    /// The client daemon.
    Client,
}

impl Side {
    /// The other end.
    #[must_use]
    pub fn peer(self) -> Self {
        match self {
            Self::Server => Self::Client,
            Self::Client => Self::Server,
        }
    }
}

/// A direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    /// Client to server.
    ToServer,
    /// Server to client.
    ToClient,
}

impl Dir {
    /// The end that receives in this direction.
    #[must_use]
    pub fn receiver(self) -> Side {
        match self {
            Self::ToServer => Side::Server,
            Self::ToClient => Side::Client,
        }
    }

    /// The direction in which `side` sends.
    #[must_use]
    pub fn from_sender(side: Side) -> Self {
        match side {
            Side::Client => Self::ToServer,
            Side::Server => Self::ToClient,
        }
    }

    fn index(self) -> usize {
        match self {
            Self::ToServer => 0,
            Self::ToClient => 1,
        }
    }
}

/// What travels on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A WebSocket binary message (one encoded envelope, or garbage).
    Binary(Vec<u8>),
    /// A WebSocket Ping control frame.
    Ping,
    /// A WebSocket Pong control frame.
    Pong,
    /// A WebSocket Close frame; the sender sends nothing after it, and its
    /// delivery ends the connection.
    Close {
        /// Close code (see [`close_code`]).
        code: u16,
    },
}

impl Item {
    fn bytes(&self) -> u64 {
        match self {
            Self::Binary(b) => u64::try_from(b.len()).unwrap_or(u64::MAX),
            _ => CONTROL_ITEM_BYTES,
        }
    }
}

/// Why an end learned that its connection ended without a Close frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseCause {
    /// Reset ([`Net::cut`]).
    Reset,
    /// A loss fault broke the connection.
    Lost,
    /// The connection was broken right after a delivery (duplication fault).
    BrokenAfterDelivery,
    /// The peer process died ([`Net::crash`]).
    PeerDied,
    /// A send found the queue full (write deadline).
    Overflow,
}

/// What one end receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    /// A new connection from the client (server side only), delivered
    /// before anything the client sent on it.
    Opened,
    /// An item sent by the peer.
    Item(Item),
    /// The connection ended without a Close frame; nothing more arrives.
    Closed {
        /// Why.
        cause: CloseCause,
    },
}

/// One delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Simulated time of the delivery.
    pub at: u64,
    /// The connection.
    pub conn: ConnId,
    /// The client end of the connection.
    pub client: ClientSlot,
    /// Direction; [`Dir::receiver`] is the end that receives.
    pub dir: Dir,
    /// What arrives.
    pub event: NetEvent,
}

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetError {
    /// The client is partitioned until the given time.
    Partitioned(ClientSlot, u64),
    /// [`MAX_CONNECTIONS`] are open.
    TooManyConnections,
    /// The connection does not exist (any more).
    Closed(ConnId),
    /// This end already sent a Close frame on the connection.
    Closing(ConnId),
    /// The queue was full; the connection is broken now.
    QueueFull(ConnId),
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Partitioned(c, until) => {
                write!(f, "client {} is partitioned until {until} ms", c.0)
            }
            Self::TooManyConnections => {
                write!(f, "{MAX_CONNECTIONS} connections are already open")
            }
            Self::Closed(c) => write!(f, "connection {} is closed", c.0),
            Self::Closing(c) => write!(f, "connection {} is closing: a Close frame was sent", c.0),
            Self::QueueFull(c) => {
                write!(
                    f,
                    "connection {}: send queue full; the connection is broken",
                    c.0
                )
            }
        }
    }
}

impl std::error::Error for NetError {}

/// Fault rates and latency of a run (per mille per item where noted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// One-way latency of every item.
    pub base_latency_ms: u64,
    /// Extra latency per item, uniform in `0..=jitter_ms`.
    pub jitter_ms: u64,
    /// Chance of a delay fault on an item.
    pub delay_permille: u32,
    /// Largest delay fault.
    pub max_extra_delay_ms: u64,
    /// Chance of a stall fault on an item.
    pub stall_permille: u32,
    /// Largest stall.
    pub max_stall_ms: u64,
    /// Chance of a loss fault on an item.
    pub loss_permille: u32,
    /// Chance of a deliver-then-break (duplication) fault on an item.
    pub dup_permille: u32,
}

impl NetConfig {
    /// No faults, fixed 5 ms latency with 5 ms jitter.
    #[must_use]
    pub fn calm() -> Self {
        Self {
            base_latency_ms: 5,
            jitter_ms: 5,
            delay_permille: 0,
            max_extra_delay_ms: 0,
            stall_permille: 0,
            max_stall_ms: 0,
            loss_permille: 0,
            dup_permille: 0,
        }
    }

    /// Rates chosen by the run's fault stream, so one seed also decides
    /// which faults are likely (swarm testing). Each fault kind is off in
    /// about a quarter of runs.
    pub fn random(rng: &mut SimRng) -> Self {
        let mut rate = |max: u64| {
            let on = rng.below(4) != 0;
            let v = rng.range_inclusive(1..=max);
            if on { u32::try_from(v).unwrap_or(0) } else { 0 }
        };
        let delay_permille = rate(100);
        let stall_permille = rate(20);
        let loss_permille = rate(10);
        let dup_permille = rate(10);
        Self {
            base_latency_ms: rng.range_inclusive(1..=50),
            jitter_ms: rng.range_inclusive(0..=50),
            delay_permille,
            max_extra_delay_ms: rng.range_inclusive(10..=2_000),
            stall_permille,
            max_stall_ms: rng.range_inclusive(100..=20_000),
            loss_permille,
            dup_permille,
        }
    }

    /// Clamps every value to its ceiling.
    #[must_use]
    pub fn clamped(self) -> Self {
        Self {
            base_latency_ms: self.base_latency_ms.min(MAX_BASE_LATENCY_MS),
            jitter_ms: self.jitter_ms.min(MAX_JITTER_MS),
            delay_permille: self.delay_permille.min(1000),
            max_extra_delay_ms: self.max_extra_delay_ms.min(MAX_EXTRA_DELAY_MS),
            stall_permille: self.stall_permille.min(1000),
            max_stall_ms: self.max_stall_ms.min(MAX_STALL_MS),
            loss_permille: self.loss_permille.min(1000),
            dup_permille: self.dup_permille.min(1000),
        }
    }
}

/// Per-kind counters: every fault and recovery trigger is counted, so a
/// batch of seeds can prove each one happened (conventions rule 7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetCounters {
    /// Connections opened.
    pub connects: u64,
    /// Connection attempts refused by a partition.
    pub refused_connects: u64,
    /// Items accepted by `send`.
    pub sent: u64,
    /// Items delivered (opens and close notices excluded).
    pub delivered: u64,
    /// Delay faults.
    pub delayed: u64,
    /// Stall faults.
    pub stalls: u64,
    /// Deliveries overtaken by a later-sent item of another connection.
    pub reordered: u64,
    /// Loss faults (each broke its connection).
    pub lost: u64,
    /// Deliver-then-break faults.
    pub dup_cuts: u64,
    /// Explicit cuts.
    pub cuts: u64,
    /// Explicit end crashes.
    pub crashes: u64,
    /// Partitions started.
    pub partitions: u64,
    /// Items dropped because their connection broke before delivery.
    pub dropped: u64,
    /// Connections broken by a full queue.
    pub overflow_cuts: u64,
    /// Close frames delivered.
    pub closes: u64,
}

#[derive(Debug, Clone)]
enum Payload {
    Opened,
    Item(Item),
    /// The connection breaks here: the receiver learns it.
    Break(CloseCause),
}

#[derive(Debug, Clone)]
struct InFlight {
    at: u64,
    send_seq: u64,
    payload: Payload,
    /// Break the connection right after delivering this item.
    break_after: bool,
}

#[derive(Debug, Clone, Default)]
struct Queue {
    items: VecDeque<InFlight>,
    bytes: u64,
    /// Nothing is delivered before this time (stall or partition).
    held_until: u64,
    /// Latest delivery time queued so far (FIFO: never decreases).
    last_at: u64,
    /// The receiver has learned the connection ended; nothing more is
    /// queued or delivered in this direction.
    done: bool,
    /// The sender sent a Close frame.
    closing: bool,
}

impl Queue {
    fn due_at(&self) -> Option<u64> {
        self.items.front().map(|i| i.at.max(self.held_until))
    }

    fn clear(&mut self) -> u64 {
        let n = self
            .items
            .iter()
            .filter(|i| matches!(i.payload, Payload::Item(_)))
            .count();
        self.items.clear();
        self.bytes = 0;
        u64::try_from(n).unwrap_or(u64::MAX)
    }
}

#[derive(Debug, Clone)]
struct Conn {
    client: ClientSlot,
    queues: [Queue; 2],
    /// A break is on its way: later sends are dropped silently (the
    /// socket is dead but the sender does not know yet).
    broken: bool,
}

impl Conn {
    fn queue(&self, dir: Dir) -> Option<&Queue> {
        self.queues.get(dir.index())
    }

    fn queue_mut(&mut self, dir: Dir) -> Option<&mut Queue> {
        self.queues.get_mut(dir.index())
    }
}

/// The simulated network.
#[derive(Debug, Clone)]
pub struct Net {
    config: NetConfig,
    rng: SimRng,
    conns: BTreeMap<ConnId, Conn>,
    partitions: BTreeMap<ClientSlot, u64>,
    next_conn: u64,
    send_seq: u64,
    max_delivered_seq: u64,
    counters: NetCounters,
    /// Binary frames copied as they are sent (see [`Net::record`]).
    recording: Option<Recording>,
}

/// A binary frame as it was sent, copied for a seed corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedFrame {
    /// The connection.
    pub conn: ConnId,
    /// Which way it went.
    pub dir: Dir,
    /// The bytes (an encoded envelope, or an adversary's garbage).
    pub bytes: Vec<u8>,
}

/// The frames [`Net::record`] keeps, at most `limit`.
#[derive(Debug, Clone, Default)]
struct Recording {
    limit: usize,
    frames: Vec<RecordedFrame>,
}

impl Net {
    /// A network drawing latency and faults from `rng` (the run's network
    /// stream).
    #[must_use]
    pub fn new(rng: SimRng, config: NetConfig) -> Self {
        Self {
            config: config.clamped(),
            rng,
            conns: BTreeMap::new(),
            partitions: BTreeMap::new(),
            next_conn: 1,
            send_seq: 0,
            max_delivered_seq: 0,
            counters: NetCounters::default(),
            recording: None,
        }
    }

    /// Copies the first `limit` binary frames sent from now on (the fuzz
    /// seed corpora are recorded this way). Recording draws nothing from
    /// the run's streams, so a recorded run is the same run.
    pub fn record(&mut self, limit: usize) {
        self.recording = Some(Recording {
            limit,
            frames: Vec::new(),
        });
    }

    /// The frames recorded so far, taken.
    pub fn take_recorded(&mut self) -> Vec<RecordedFrame> {
        self.recording
            .as_mut()
            .map(|r| std::mem::take(&mut r.frames))
            .unwrap_or_default()
    }

    /// The (clamped) configuration.
    #[must_use]
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// Replaces the fault rates (e.g. a calm phase at the end of a run).
    pub fn set_config(&mut self, config: NetConfig) {
        self.config = config.clamped();
    }

    /// The counters.
    #[must_use]
    pub fn counters(&self) -> &NetCounters {
        &self.counters
    }

    /// Connections not yet fully ended, in id order.
    #[must_use]
    pub fn connections(&self) -> Vec<(ConnId, ClientSlot)> {
        self.conns.iter().map(|(id, c)| (*id, c.client)).collect()
    }

    /// Whether `client` is partitioned at `now`.
    #[must_use]
    pub fn is_partitioned(&self, client: ClientSlot, now: u64) -> bool {
        self.partitions
            .get(&client)
            .is_some_and(|until| now < *until)
    }

    /// Opens a connection from `client`. The server receives
    /// [`NetEvent::Opened`] after the latency, before anything the client
    /// sends on it; the client may send at once.
    ///
    /// # Errors
    /// [`NetError::Partitioned`] or [`NetError::TooManyConnections`].
    pub fn connect(&mut self, client: ClientSlot, now: u64) -> Result<ConnId, NetError> {
        if let Some(until) = self.partitions.get(&client).copied()
            && now < until
        {
            self.counters.refused_connects = self.counters.refused_connects.saturating_add(1);
            return Err(NetError::Partitioned(client, until));
        }
        if self.conns.len() >= MAX_CONNECTIONS {
            return Err(NetError::TooManyConnections);
        }
        let id = ConnId(self.next_conn);
        self.next_conn = self.next_conn.saturating_add(1);
        let mut conn = Conn {
            client,
            queues: [Queue::default(), Queue::default()],
            broken: false,
        };
        let at = now.saturating_add(self.config.base_latency_ms);
        let seq = self.next_send_seq();
        if let Some(q) = conn.queue_mut(Dir::ToServer) {
            q.last_at = at;
            q.items.push_back(InFlight {
                at,
                send_seq: seq,
                payload: Payload::Opened,
                break_after: false,
            });
            q.bytes = CONTROL_ITEM_BYTES;
        }
        self.conns.insert(id, conn);
        self.counters.connects = self.counters.connects.saturating_add(1);
        Ok(id)
    }

    fn next_send_seq(&mut self) -> u64 {
        self.send_seq = self.send_seq.saturating_add(1);
        self.send_seq
    }

    /// Sends `item` in direction `dir` at `now`, drawing this item's
    /// latency and faults. A send on a connection that is already broken
    /// (but whose sender has not learned it yet) is accepted and dropped.
    ///
    /// # Errors
    /// [`NetError::Closed`] for an ended connection, [`NetError::Closing`]
    /// after this end sent a Close frame, [`NetError::QueueFull`] when the
    /// queue is full (the connection is broken then).
    pub fn send(&mut self, conn: ConnId, dir: Dir, item: Item, now: u64) -> Result<(), NetError> {
        // Draw the same number of values for every send, whatever the
        // rates, so a rate change does not shift the rest of the stream.
        let cfg = self.config;
        let jitter = self.rng.range_inclusive(0..=cfg.jitter_ms);
        let delay_hit = self.rng.chance(cfg.delay_permille);
        let delay = self.rng.range_inclusive(1..=cfg.max_extra_delay_ms.max(1));
        let stall_hit = self.rng.chance(cfg.stall_permille);
        let stall = self.rng.range_inclusive(1..=cfg.max_stall_ms.max(1));
        let loss_hit = self.rng.chance(cfg.loss_permille);
        let dup_hit = self.rng.chance(cfg.dup_permille);
        let seq = self.next_send_seq();
        if let (Some(r), Item::Binary(bytes)) = (self.recording.as_mut(), &item)
            && r.frames.len() < r.limit
        {
            r.frames.push(RecordedFrame {
                conn,
                dir,
                bytes: bytes.clone(),
            });
        }

        let latency = cfg.base_latency_ms.saturating_add(jitter);
        let Some(c) = self.conns.get_mut(&conn) else {
            return Err(NetError::Closed(conn));
        };
        let (done, closing, queued_items, queued_bytes) = match c.queue(dir) {
            Some(q) => (q.done, q.closing, q.items.len(), q.bytes),
            None => return Err(NetError::Closed(conn)),
        };
        if done {
            return Err(NetError::Closed(conn));
        }
        if closing {
            return Err(NetError::Closing(conn));
        }
        let is_close = matches!(item, Item::Close { .. });
        if c.broken {
            // The socket is dead; the sender learns from the break notice.
            if let Some(q) = c.queue_mut(dir) {
                q.closing |= is_close;
            }
            self.counters.dropped = self.counters.dropped.saturating_add(1);
            return Ok(());
        }
        let bytes = item.bytes();
        if queued_items >= MAX_QUEUE_ITEMS || queued_bytes.saturating_add(bytes) > MAX_QUEUE_BYTES {
            self.counters.overflow_cuts = self.counters.overflow_cuts.saturating_add(1);
            self.counters.dropped = self.counters.dropped.saturating_add(1);
            self.break_conn(conn, now, CloseCause::Overflow);
            return Err(NetError::QueueFull(conn));
        }
        self.counters.sent = self.counters.sent.saturating_add(1);
        if loss_hit {
            self.counters.lost = self.counters.lost.saturating_add(1);
            self.counters.dropped = self.counters.dropped.saturating_add(1);
            self.break_conn(conn, now, CloseCause::Lost);
            return Ok(());
        }
        let mut extra = 0u64;
        if delay_hit {
            self.counters.delayed = self.counters.delayed.saturating_add(1);
            extra = delay;
        }
        if stall_hit {
            self.counters.stalls = self.counters.stalls.saturating_add(1);
        }
        if dup_hit {
            self.counters.dup_cuts = self.counters.dup_cuts.saturating_add(1);
        }
        let Some(q) = self.conns.get_mut(&conn).and_then(|c| c.queue_mut(dir)) else {
            return Err(NetError::Closed(conn));
        };
        if stall_hit {
            q.held_until = q.held_until.max(now.saturating_add(stall));
        }
        let at = now
            .saturating_add(latency)
            .saturating_add(extra)
            .max(q.last_at);
        q.last_at = at;
        q.bytes = q.bytes.saturating_add(bytes);
        q.closing |= is_close;
        q.items.push_back(InFlight {
            at,
            send_seq: seq,
            payload: Payload::Item(item),
            break_after: dup_hit,
        });
        Ok(())
    }

    /// Queues a break notice in every direction that is still live: items
    /// already ahead of it are delivered, then the receiver learns.
    fn break_conn(&mut self, conn: ConnId, now: u64, cause: CloseCause) {
        let latency = self.config.base_latency_ms;
        let seqs = [self.next_send_seq(), self.next_send_seq()];
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.broken {
            return;
        }
        c.broken = true;
        for (q, seq) in c.queues.iter_mut().zip(seqs) {
            if q.done {
                continue;
            }
            let at = now.saturating_add(latency).max(q.last_at);
            q.last_at = at;
            q.items.push_back(InFlight {
                at,
                send_seq: seq,
                payload: Payload::Break(cause),
                break_after: false,
            });
        }
    }

    /// Resets `conn`: both ends learn after the items already ahead.
    pub fn cut(&mut self, conn: ConnId, now: u64) {
        if self.conns.get(&conn).is_some_and(|c| !c.broken) {
            self.counters.cuts = self.counters.cuts.saturating_add(1);
            self.break_conn(conn, now, CloseCause::Reset);
        }
    }

    /// The process at `dead` died: nothing more reaches it; what it had
    /// already sent is still delivered, then its peer learns.
    pub fn crash(&mut self, conn: ConnId, dead: Side, now: u64) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        // When a break is already on its way to the peer, only stop
        // delivering to the dead end.
        if !c.broken {
            self.counters.crashes = self.counters.crashes.saturating_add(1);
        }
        let latency = self.config.base_latency_ms;
        let seq = self.next_send_seq();
        let mut dropped = 0u64;
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let was_broken = c.broken;
        c.broken = true;
        if let Some(q) = c.queue_mut(Dir::from_sender(dead.peer())) {
            dropped = q.clear();
            q.done = true;
        }
        if !was_broken
            && let Some(q) = c.queue_mut(Dir::from_sender(dead))
            && !q.done
        {
            let at = now.saturating_add(latency).max(q.last_at);
            q.last_at = at;
            q.items.push_back(InFlight {
                at,
                send_seq: seq,
                payload: Payload::Break(CloseCause::PeerDied),
                break_after: false,
            });
        }
        self.counters.dropped = self.counters.dropped.saturating_add(dropped);
        self.remove_if_done(conn);
    }

    /// Partitions `client` until `until` (at most [`MAX_PARTITION_MS`]
    /// from `now`): its connections go silent (nothing is delivered in
    /// either direction before `until`) and new connections are refused.
    pub fn partition(&mut self, client: ClientSlot, until: u64, now: u64) {
        let until = until.min(now.saturating_add(MAX_PARTITION_MS));
        if until <= now {
            return;
        }
        self.counters.partitions = self.counters.partitions.saturating_add(1);
        let entry = self.partitions.entry(client).or_insert(until);
        *entry = (*entry).max(until);
        for c in self.conns.values_mut().filter(|c| c.client == client) {
            for q in &mut c.queues {
                q.held_until = q.held_until.max(until);
            }
        }
    }

    /// Like [`Self::partition`], but the client's connections are reset
    /// at once (both ends learn, as when a firewall answers with resets or
    /// the host's interface goes down) instead of going silent.
    pub fn partition_cut(&mut self, client: ClientSlot, until: u64, now: u64) {
        let until = until.min(now.saturating_add(MAX_PARTITION_MS));
        if until <= now {
            return;
        }
        self.counters.partitions = self.counters.partitions.saturating_add(1);
        let entry = self.partitions.entry(client).or_insert(until);
        *entry = (*entry).max(until);
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.client == client)
            .map(|(id, _)| *id)
            .collect();
        for conn in conns {
            self.cut(conn, now);
        }
    }

    /// The earliest time something is due, if anything is queued.
    #[must_use]
    pub fn next_due(&self) -> Option<u64> {
        self.conns
            .values()
            .flat_map(|c| c.queues.iter())
            .filter_map(Queue::due_at)
            .min()
    }

    /// Delivers everything due at `now`, in time order (ties: send order),
    /// at most [`MAX_DELIVERIES_PER_CALL`] items.
    pub fn deliver_due(&mut self, now: u64) -> Vec<Delivery> {
        self.partitions.retain(|_, until| now < *until);
        let mut out = Vec::new();
        while out.len() < MAX_DELIVERIES_PER_CALL {
            // the earliest due head across all queues (heads only: FIFO)
            let mut best: Option<(u64, u64, ConnId, Dir)> = None;
            for (id, c) in &self.conns {
                for dir in [Dir::ToServer, Dir::ToClient] {
                    let Some(q) = c.queue(dir) else { continue };
                    let (Some(at), Some(head)) = (q.due_at(), q.items.front()) else {
                        continue;
                    };
                    if at > now {
                        continue;
                    }
                    let key = (at, head.send_seq, *id, dir);
                    if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                        best = Some(key);
                    }
                }
            }
            let Some((at, _, conn, dir)) = best else {
                break;
            };
            if let Some(d) = self.pop(conn, dir, at, now) {
                out.push(d);
            }
        }
        out
    }

    fn pop(&mut self, conn: ConnId, dir: Dir, at: u64, now: u64) -> Option<Delivery> {
        let c = self.conns.get_mut(&conn)?;
        let client = c.client;
        let q = c.queue_mut(dir)?;
        let head = q.items.pop_front()?;
        let bytes = match &head.payload {
            Payload::Item(i) => i.bytes(),
            _ => CONTROL_ITEM_BYTES,
        };
        q.bytes = q.bytes.saturating_sub(bytes);
        let event = match head.payload {
            Payload::Opened => NetEvent::Opened,
            Payload::Item(item) => {
                self.counters.delivered = self.counters.delivered.saturating_add(1);
                if head.send_seq < self.max_delivered_seq {
                    self.counters.reordered = self.counters.reordered.saturating_add(1);
                }
                if let Item::Close { .. } = item {
                    // The close handshake ends the connection for both.
                    self.counters.closes = self.counters.closes.saturating_add(1);
                    let dropped = c.queues.iter_mut().map(Queue::clear).sum::<u64>();
                    for q in &mut c.queues {
                        q.done = true;
                    }
                    self.counters.dropped = self.counters.dropped.saturating_add(dropped);
                }
                NetEvent::Item(item)
            }
            Payload::Break(cause) => {
                let dropped = q.clear();
                q.done = true;
                self.counters.dropped = self.counters.dropped.saturating_add(dropped);
                NetEvent::Closed { cause }
            }
        };
        self.max_delivered_seq = self.max_delivered_seq.max(head.send_seq);
        if head.break_after {
            self.break_conn(conn, now, CloseCause::BrokenAfterDelivery);
        }
        self.remove_if_done(conn);
        Some(Delivery {
            at,
            conn,
            client,
            dir,
            event,
        })
    }

    fn remove_if_done(&mut self, conn: ConnId) {
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.queues.iter().all(|q| q.done))
        {
            self.conns.remove(&conn);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;
    use crate::rng::Seeds;

    fn bin(n: u8) -> Item {
        Item::Binary(vec![n])
    }

    /// Runs the network to quiescence, returning every delivery.
    fn drain(net: &mut Net) -> Vec<Delivery> {
        let mut out = Vec::new();
        let mut guard = 0;
        while let Some(t) = net.next_due() {
            out.extend(net.deliver_due(t));
            guard += 1;
            assert!(guard < 100_000);
        }
        out
    }

    fn items_of(ds: &[Delivery], conn: ConnId, dir: Dir) -> Vec<u8> {
        ds.iter()
            .filter(|d| d.conn == conn && d.dir == dir)
            .filter_map(|d| match &d.event {
                NetEvent::Item(Item::Binary(b)) => Some(b[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn order_within_a_connection_survives_delays_and_stalls() {
        let cfg = NetConfig {
            base_latency_ms: 5,
            jitter_ms: 40,
            delay_permille: 300,
            max_extra_delay_ms: 500,
            stall_permille: 100,
            max_stall_ms: 2_000,
            loss_permille: 0,
            dup_permille: 0,
        };
        let mut net = Net::new(Seeds::new(11).network(), cfg);
        let a = net.connect(ClientSlot(0), 0).unwrap();
        let b = net.connect(ClientSlot(1), 0).unwrap();
        for t in 0..200u8 {
            net.send(a, Dir::ToServer, bin(t), u64::from(t)).unwrap();
            net.send(b, Dir::ToServer, bin(t), u64::from(t)).unwrap();
            net.send(a, Dir::ToClient, bin(t), u64::from(t)).unwrap();
        }
        let ds = drain(&mut net);
        let want: Vec<u8> = (0..200).collect();
        assert_eq!(items_of(&ds, a, Dir::ToServer), want);
        assert_eq!(items_of(&ds, b, Dir::ToServer), want);
        assert_eq!(items_of(&ds, a, Dir::ToClient), want);
        // the open precedes the first item of its connection
        let first_a = ds
            .iter()
            .position(|d| d.conn == a && d.dir == Dir::ToServer)
            .unwrap();
        assert_eq!(ds[first_a].event, NetEvent::Opened);
        // deliveries come in time order
        assert!(ds.windows(2).all(|w| w[0].at <= w[1].at));
        let c = net.counters();
        assert!(c.delayed > 0 && c.stalls > 0, "{c:?}");
        assert!(
            c.reordered > 0,
            "stalls must let other connections overtake: {c:?}"
        );
        assert_eq!(c.delivered, 600);
        assert_eq!(c.lost + c.dup_cuts + c.dropped, 0);
    }

    #[test]
    fn same_seed_same_deliveries() {
        let run = || {
            let mut rng = Seeds::new(5).faults();
            let mut net = Net::new(Seeds::new(5).network(), NetConfig::random(&mut rng));
            let conns: Vec<ConnId> = (0..4)
                .map(|i| net.connect(ClientSlot(i), 0).unwrap())
                .collect();
            let mut out = Vec::new();
            for t in 0..300u64 {
                let c = conns[usize::try_from(t % 4).unwrap()];
                let _ = net.send(c, Dir::ToServer, bin(u8::try_from(t % 251).unwrap()), t);
                out.extend(net.deliver_due(t));
            }
            out.extend(drain(&mut net));
            (out, *net.counters())
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn loss_breaks_the_connection_and_is_counted() {
        let mut cfg = NetConfig::calm();
        cfg.loss_permille = 1000;
        let mut net = Net::new(Seeds::new(1).network(), NetConfig::calm());
        let c = net.connect(ClientSlot(0), 0).unwrap();
        net.send(c, Dir::ToServer, bin(1), 0).unwrap();
        net.send(c, Dir::ToClient, bin(9), 0).unwrap();
        net.set_config(cfg);
        net.send(c, Dir::ToServer, bin(2), 1).unwrap();
        // sent after the break: silently dropped
        net.send(c, Dir::ToServer, bin(3), 2).unwrap();
        let ds = drain(&mut net);
        assert_eq!(items_of(&ds, c, Dir::ToServer), vec![1]);
        assert_eq!(items_of(&ds, c, Dir::ToClient), vec![9]);
        let mut closed: Vec<Dir> = ds
            .iter()
            .filter(|d| {
                matches!(
                    d.event,
                    NetEvent::Closed {
                        cause: CloseCause::Lost
                    }
                )
            })
            .map(|d| d.dir)
            .collect();
        closed.sort();
        assert_eq!(closed, vec![Dir::ToServer, Dir::ToClient]);
        assert_eq!(net.counters().lost, 1);
        assert_eq!(net.counters().dropped, 2);
        assert!(net.connections().is_empty());
        assert_eq!(
            net.send(c, Dir::ToServer, bin(4), 10),
            Err(NetError::Closed(c))
        );
    }

    #[test]
    fn duplication_delivers_then_breaks_before_the_answer() {
        let mut cfg = NetConfig::calm();
        cfg.dup_permille = 1000;
        let mut net = Net::new(Seeds::new(2).network(), cfg);
        let c = net.connect(ClientSlot(0), 0).unwrap();
        net.send(c, Dir::ToServer, bin(1), 0).unwrap();
        let mut got = Vec::new();
        while let Some(t) = net.next_due() {
            for d in net.deliver_due(t) {
                if d.event == NetEvent::Item(bin(1)) {
                    // the server answers right away; the answer is lost
                    net.send(c, Dir::ToClient, bin(2), t).unwrap();
                }
                got.push(d);
            }
        }
        assert_eq!(items_of(&got, c, Dir::ToServer), vec![1]);
        assert!(items_of(&got, c, Dir::ToClient).is_empty());
        assert_eq!(net.counters().dup_cuts, 1);
        assert!(got.iter().any(|d| d.dir == Dir::ToClient
            && d.event
                == NetEvent::Closed {
                    cause: CloseCause::BrokenAfterDelivery
                }));
    }

    #[test]
    fn partition_holds_traffic_and_refuses_connects() {
        let mut net = Net::new(Seeds::new(3).network(), NetConfig::calm());
        let c = net.connect(ClientSlot(0), 0).unwrap();
        let other = net.connect(ClientSlot(1), 0).unwrap();
        let _ = net.deliver_due(100);
        net.partition(ClientSlot(0), 5_000, 100);
        net.send(c, Dir::ToServer, bin(1), 100).unwrap();
        net.send(other, Dir::ToServer, bin(2), 100).unwrap();
        assert_eq!(
            net.connect(ClientSlot(0), 200),
            Err(NetError::Partitioned(ClientSlot(0), 5_000))
        );
        let early = net.deliver_due(4_999);
        assert_eq!(items_of(&early, other, Dir::ToServer), vec![2]);
        assert!(items_of(&early, c, Dir::ToServer).is_empty());
        let late = net.deliver_due(5_000);
        assert_eq!(items_of(&late, c, Dir::ToServer), vec![1]);
        assert!(net.connect(ClientSlot(0), 5_000).is_ok());
        let k = net.counters();
        assert_eq!((k.partitions, k.refused_connects), (1, 1));
    }

    #[test]
    fn partition_cut_resets_every_connection_of_the_client() {
        let mut net = Net::new(Seeds::new(3).network(), NetConfig::calm());
        let a = net.connect(ClientSlot(0), 0).unwrap();
        let b = net.connect(ClientSlot(0), 0).unwrap();
        let other = net.connect(ClientSlot(1), 0).unwrap();
        net.partition_cut(ClientSlot(0), 1_000, 10);
        assert!(net.connect(ClientSlot(0), 20).is_err());
        let ds = drain(&mut net);
        for c in [a, b] {
            let closed = ds
                .iter()
                .filter(|d| d.conn == c && matches!(d.event, NetEvent::Closed { .. }))
                .count();
            assert_eq!(closed, 2);
        }
        assert!(net.connections().iter().all(|(c, _)| *c == other));
        assert_eq!(net.counters().cuts, 2);
        assert!(net.connect(ClientSlot(0), 1_000).is_ok());
    }

    #[test]
    fn crash_delivers_what_was_written_then_tells_the_peer() {
        let mut net = Net::new(Seeds::new(4).network(), NetConfig::calm());
        let c = net.connect(ClientSlot(0), 0).unwrap();
        net.send(c, Dir::ToServer, bin(1), 0).unwrap();
        net.send(c, Dir::ToClient, bin(2), 0).unwrap();
        net.crash(c, Side::Client, 1);
        let ds = drain(&mut net);
        assert_eq!(items_of(&ds, c, Dir::ToServer), vec![1]);
        assert!(items_of(&ds, c, Dir::ToClient).is_empty());
        assert_eq!(
            ds.last().unwrap().event,
            NetEvent::Closed {
                cause: CloseCause::PeerDied
            }
        );
        assert_eq!(ds.last().unwrap().dir, Dir::ToServer);
        assert!(net.connections().is_empty());
        assert_eq!(net.counters().crashes, 1);
    }

    #[test]
    fn close_frame_ends_the_connection() {
        let mut net = Net::new(Seeds::new(6).network(), NetConfig::calm());
        let c = net.connect(ClientSlot(0), 0).unwrap();
        net.send(c, Dir::ToClient, bin(1), 0).unwrap();
        net.send(c, Dir::ToClient, Item::Close { code: 4001 }, 0)
            .unwrap();
        assert_eq!(
            net.send(c, Dir::ToClient, bin(2), 0),
            Err(NetError::Closing(c))
        );
        let ds = drain(&mut net);
        assert_eq!(
            ds.last().unwrap().event,
            NetEvent::Item(Item::Close { code: 4001 })
        );
        assert!(net.connections().is_empty());
        assert_eq!(net.counters().closes, 1);
    }

    #[test]
    fn queues_are_bounded() {
        let mut net = Net::new(Seeds::new(8).network(), NetConfig::calm());
        let c = net.connect(ClientSlot(0), 0).unwrap();
        let big = Item::Binary(vec![0u8; usize::try_from(MIB).unwrap()]);
        let mut sent = 0;
        let err = loop {
            match net.send(c, Dir::ToServer, big.clone(), 0) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent <= 16);
        };
        assert_eq!(err, NetError::QueueFull(c));
        assert_eq!(sent, 15);
        assert_eq!(net.counters().overflow_cuts, 1);
        let ds = drain(&mut net);
        assert!(ds.iter().any(|d| d.event
            == NetEvent::Closed {
                cause: CloseCause::Overflow
            }));
    }
}
