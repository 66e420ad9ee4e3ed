//! The adversary layer: a thin mutation of a real client's outgoing
//! frames. The client itself stays the real runtime and cores; the layer
//! only adds frames after the ones it sends (a copy of an event, a copy
//! with changed content, an envelope of an older generation, a window's
//! worth of copies, bytes that are no envelope), at most once per session.
//! The world checks that the server answers each one as the plan says.

use prost::Message as _;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;

use crate::rng::SimRng;

/// Most frames a window overrun sends.
pub const MAX_OVERRUN_FRAMES: u64 = 320;
/// Longest garbage frame.
pub const MAX_MALFORMED_BYTES: u64 = 512;
/// The time in the UUIDv7 of a command no server issued (2023-11-14).
const GHOST_MS: u64 = 1_700_000_000_000;

/// A misbehaviour a client can be configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Adversary {
    /// Sends an exact copy of an event it already sent this session: a
    /// harmless repeat (acknowledged, never a close).
    ExactDuplicate,
    /// Sends an event it already sent this session with the same
    /// `event_seq` and different content (expect `PROTOCOL_ERROR`; the
    /// store keeps the first content and never acknowledges the copy).
    ConflictingDuplicate,
    /// Sends an envelope of an older generation (expect `STALE_SESSION`).
    StaleGeneration,
    /// Repeats its largest event of the session until the server's
    /// per-command window is exceeded (expect `PROTOCOL_ERROR`).
    WindowOverrun,
    /// Sends bytes that are no envelope (expect `PROTOCOL_ERROR`).
    MalformedBytes,
    /// A second installation claiming a live client id with its own
    /// instance id (expect `LIVE_CONFLICT`); the world makes it.
    SecondInstance,
    /// Replaces a chunk of its reconciliation snapshot with one that also
    /// holds a tombstone the server never asked about (expect
    /// `PROTOCOL_ERROR`, nothing applied, and a reconciliation
    /// contradiction incident recorded for the operator).
    ContradictorySnapshot,
}

impl Adversary {
    /// Whether the server must close the session on it.
    #[must_use]
    pub fn expects_close(self) -> bool {
        !matches!(self, Self::ExactDuplicate | Self::SecondInstance)
    }
}

/// The layer of one adversarial client.
#[derive(Debug)]
pub struct AdversaryLayer {
    kind: Adversary,
    permille: u32,
    command_window: u64,
    rng: SimRng,
    session: Option<(String, u64)>,
    misbehaved: bool,
    last_event: Option<wire::CommandEvent>,
    largest: Option<(u64, wire::CommandEvent)>,
}

/// What the layer did with one outgoing frame.
#[derive(Debug, Default)]
pub struct Mutated {
    /// The frames to send, in order (the real frame first).
    pub frames: Vec<Vec<u8>>,
    /// The first frame of a misbehaviour, when one was added.
    pub misbehaviour: Option<Vec<u8>>,
}

fn zstd_frame(raw: &[u8]) -> Option<Vec<u8>> {
    let mut c = zstd::bulk::Compressor::new(1).ok()?;
    c.include_checksum(true).ok()?;
    c.include_contentsize(true).ok()?;
    c.compress(raw).ok()
}

impl AdversaryLayer {
    /// A layer of `kind`, firing with `permille` per opportunity, against
    /// a server whose per-command window is `command_window`.
    #[must_use]
    pub fn new(kind: Adversary, permille: u32, command_window: u64, rng: SimRng) -> Self {
        Self {
            kind,
            permille,
            command_window,
            rng,
            session: None,
            misbehaved: false,
            last_event: None,
            largest: None,
        }
    }

    /// Its kind.
    #[must_use]
    pub fn kind(&self) -> Adversary {
        self.kind
    }

    /// A new connection: the next session may misbehave again.
    pub fn new_connection(&mut self) {
        self.session = None;
        self.misbehaved = false;
        self.last_event = None;
        self.largest = None;
    }

    fn envelope(&self, payload: Payload, generation: u64) -> Option<Vec<u8>> {
        let (sid, _) = self.session.as_ref()?;
        Some(
            wire::Envelope {
                session_id: sid.clone(),
                generation,
                payload: Some(payload),
            }
            .encode_to_vec(),
        )
    }

    /// The same `(issue, event_seq)` with other content.
    fn conflicting(&mut self, mut ev: wire::CommandEvent) -> Option<wire::CommandEvent> {
        match ev.body.as_mut()? {
            Body::Output(o) => {
                let raw_len = usize::try_from(o.raw_length).ok()?.max(1);
                let mut raw = self.rng.bytes(raw_len);
                if let Some(b) = raw.first_mut() {
                    *b = b.wrapping_add(1);
                }
                let payload = zstd_frame(&raw)?;
                o.stored_length = u32::try_from(payload.len()).ok()?;
                o.raw_length = u32::try_from(raw.len()).ok()?;
                o.payload = payload;
            }
            Body::Lifecycle(l) => l.reason = format!("{} (conflicting duplicate)", l.reason),
            Body::SignalResult(s) => s.reason = format!("{} (conflicting duplicate)", s.reason),
            Body::StdinAck(a) => a.reason = format!("{} (conflicting duplicate)", a.reason),
            _ => return None,
        }
        Some(ev)
    }

    /// The snapshot chunk with a tombstone of a command the server never
    /// listed (in `issue_uuid` order, as the chunk's tombstones are).
    fn contradicting(
        &mut self,
        mut snap: wire::ClientSnapshot,
        generation: u64,
    ) -> Option<Vec<u8>> {
        let ghost = crate::rng::uuid_text(&self.rng.uuid_v7(GHOST_MS));
        let request_hash = self.rng.bytes(32);
        snap.tombstones.push(wire::SnapshotTombstone {
            issue_uuid: ghost,
            request_hash,
        });
        snap.tombstones
            .sort_by(|a, b| a.issue_uuid.cmp(&b.issue_uuid));
        self.envelope(Payload::ClientSnapshot(snap), generation)
    }

    /// One frame the real client sends; returns what goes on the wire.
    pub fn outgoing(&mut self, frame: Vec<u8>) -> Mutated {
        let mut out = Mutated::default();
        let env = wire::Envelope::decode(frame.as_slice()).ok();
        out.frames.push(frame);
        let Some(env) = env else {
            return out;
        };
        if !env.session_id.is_empty() && env.generation > 0 {
            let same = self
                .session
                .as_ref()
                .is_some_and(|(s, g)| *s == env.session_id && *g == env.generation);
            if !same {
                self.session = Some((env.session_id.clone(), env.generation));
                self.misbehaved = false;
                self.last_event = None;
                self.largest = None;
            }
        }
        if self.kind == Adversary::ContradictorySnapshot {
            if let Some(Payload::ClientSnapshot(snap)) = env.payload
                && !self.misbehaved
                && self.session.is_some()
                && self.rng.chance(self.permille)
                && let Some(bytes) = self.contradicting(snap, env.generation)
            {
                self.misbehaved = true;
                out.frames = vec![bytes.clone()];
                out.misbehaviour = Some(bytes);
            }
            return out;
        }
        let Some(Payload::CommandEvent(ev)) = env.payload else {
            return out;
        };
        let generation = env.generation;
        let cost = rvbox_session::event_window_cost(&ev).max(1);
        if self.largest.as_ref().is_none_or(|(c, _)| cost > *c) {
            self.largest = Some((cost, ev.clone()));
        }
        let earlier = self.last_event.replace(ev.clone());
        if self.misbehaved || self.session.is_none() || !self.rng.chance(self.permille) {
            return out;
        }
        let added: Vec<Vec<u8>> = match self.kind {
            Adversary::ExactDuplicate => earlier
                .and_then(|e| self.envelope(Payload::CommandEvent(e), generation))
                .into_iter()
                .collect(),
            Adversary::ConflictingDuplicate => earlier
                .and_then(|e| self.conflicting(e))
                .and_then(|e| self.envelope(Payload::CommandEvent(e), generation))
                .into_iter()
                .collect(),
            Adversary::StaleGeneration => self
                .envelope(
                    Payload::ClientCapacity(wire::ClientCapacity::default()),
                    generation.saturating_sub(1),
                )
                .into_iter()
                .collect(),
            Adversary::WindowOverrun => match self.largest.clone() {
                Some((cost, big)) => {
                    let n = self.command_window / cost + 2;
                    if n <= MAX_OVERRUN_FRAMES {
                        (0..n)
                            .filter_map(|_| {
                                self.envelope(Payload::CommandEvent(big.clone()), generation)
                            })
                            .collect()
                    } else {
                        Vec::new()
                    }
                }
                None => Vec::new(),
            },
            Adversary::MalformedBytes => {
                let n =
                    usize::try_from(self.rng.range_inclusive(1..=MAX_MALFORMED_BYTES)).unwrap_or(1);
                vec![self.rng.bytes(n)]
            }
            Adversary::SecondInstance | Adversary::ContradictorySnapshot => Vec::new(),
        };
        if let Some(first) = added.first() {
            self.misbehaved = true;
            out.misbehaviour = Some(first.clone());
            out.frames.extend(added);
        }
        out
    }
}
