//! The holder's decisions, as a state machine its process shell drives:
//! PTY output in, daemon messages in, the daemon's connection gone, the
//! shell ended; effects out, performed in order (a frame is acknowledged
//! only after the effect before it, its write to the PTY, succeeded).

use crate::input::{InputGate, Verdict, ViewerId};
use crate::local::{FromHolder, MAX_CHUNK, Refused, ToHolder, proof};
use crate::ring::OutputRing;

/// What the holder's process does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Send to the daemon.
    Send(FromHolder),
    /// Write keys to the PTY.
    WritePty(Vec<u8>),
    /// Set the PTY's window size (the kernel signals the foreground
    /// process group).
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
    /// Hang up the shell's session (SIGHUP to its process group).
    HangUp,
}

/// Who the holder is, for its proofs.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The token its daemon gave it.
    pub token: [u8; 32],
    /// Its pid.
    pub pid: u32,
    /// Field 22 of its `/proc/self/stat`.
    pub start_ticks: u64,
}

/// A terminal's holder.
#[derive(Debug)]
pub struct Holder {
    id: Identity,
    ring: OutputRing,
    gate: InputGate,
    /// Whether a daemon is attached (it gets every new output byte).
    attached: bool,
    exited: Option<(bool, i32)>,
}

fn chunks(offset: u64, bytes: &[u8]) -> impl Iterator<Item = Effect> + '_ {
    bytes.chunks(MAX_CHUNK).scan(offset, |at, c| {
        let e = Effect::Send(FromHolder::Output {
            offset: *at,
            bytes: c.to_vec(),
        });
        *at += c.len() as u64;
        Some(e)
    })
}

impl Holder {
    /// A holder with an output ring of `ring` bytes remembering `viewers`
    /// viewers.
    #[must_use]
    pub fn new(id: Identity, ring: usize, viewers: usize) -> Self {
        Self {
            id,
            ring: OutputRing::new(ring),
            gate: InputGate::new(viewers),
            attached: false,
            exited: None,
        }
    }

    /// The offset after the last output byte.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.ring.end()
    }

    /// Output read from the PTY.
    pub fn pty_output(&mut self, bytes: &[u8]) -> Vec<Effect> {
        let at = self.ring.end();
        self.ring.push(bytes);
        if self.attached {
            chunks(at, bytes).collect()
        } else {
            Vec::new()
        }
    }

    /// A message from the daemon.
    pub fn message(&mut self, m: ToHolder) -> Vec<Effect> {
        match m {
            ToHolder::Challenge { nonce } => vec![Effect::Send(FromHolder::Proof {
                mac: proof(&self.id.token, &nonce),
                pid: self.id.pid,
                start_ticks: self.id.start_ticks,
                end: self.ring.end(),
            })],
            ToHolder::Attach { from } => self.attach(from),
            ToHolder::Input { viewer, seq, bytes } => self.input(viewer, seq, bytes),
            ToHolder::Resize { cols, rows } => vec![Effect::Resize {
                cols: cols.max(1),
                rows: rows.max(1),
            }],
            ToHolder::Close => vec![Effect::HangUp],
        }
    }

    fn attach(&mut self, from: u64) -> Vec<Effect> {
        match self.ring.since(from) {
            Err(e) => vec![Effect::Send(FromHolder::OffsetAhead {
                from: e.from,
                end: e.end,
            })],
            Ok(r) => {
                self.attached = true;
                let mut out = vec![Effect::Send(FromHolder::Replay {
                    offset: r.offset,
                    cut: r.cut,
                })];
                out.extend(chunks(r.offset, &r.bytes));
                if let Some((signal, value)) = self.exited {
                    out.push(Effect::Send(FromHolder::Exited { signal, value }));
                }
                out
            }
        }
    }

    fn input(&mut self, viewer: ViewerId, seq: u64, bytes: Vec<u8>) -> Vec<Effect> {
        let ack = |gate: &InputGate, refused| {
            Effect::Send(FromHolder::InputAck {
                viewer,
                acked: gate.acked(&viewer),
                refused,
            })
        };
        if bytes.len() > MAX_CHUNK {
            return vec![ack(&self.gate, Some(Refused::TooLarge))];
        }
        if self.exited.is_some() {
            // nothing reads the PTY any more: the keys are not written
            return vec![ack(&self.gate, Some(Refused::UnknownViewer))];
        }
        match self.gate.offer(viewer, seq) {
            Verdict::Write => vec![Effect::WritePty(bytes), ack(&self.gate, None)],
            Verdict::Duplicate => vec![ack(&self.gate, None)],
            Verdict::Gap { .. } => vec![ack(&self.gate, Some(Refused::Gap))],
            Verdict::Unknown => vec![ack(&self.gate, Some(Refused::UnknownViewer))],
        }
    }

    /// The answer to an input frame the process cannot take now (its
    /// queue to the PTY is full): not written, not recorded.
    #[must_use]
    pub fn input_busy(&self, viewer: ViewerId) -> Effect {
        Effect::Send(FromHolder::InputAck {
            viewer,
            acked: self.gate.acked(&viewer),
            refused: Some(Refused::Busy),
        })
    }

    /// The daemon's connection closed: output is kept in the ring for the
    /// next attach.
    pub fn detached(&mut self) {
        self.attached = false;
    }

    /// The shell ended.
    pub fn shell_exited(&mut self, signal: bool, value: i32) -> Vec<Effect> {
        self.exited = Some((signal, value));
        if self.attached {
            vec![Effect::Send(FromHolder::Exited { signal, value })]
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::local::verify;

    const V: ViewerId = [4; 16];

    fn holder() -> Holder {
        Holder::new(
            Identity {
                token: [6; 32],
                pid: 100,
                start_ticks: 5,
            },
            64,
            8,
        )
    }

    fn sent_output(effects: &[Effect]) -> Vec<u8> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(FromHolder::Output { bytes, .. }) => Some(bytes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn output_while_detached_is_replayed_from_the_last_offset_seen() {
        let mut h = holder();
        assert!(h.pty_output(b"$ ").is_empty());
        let first = h.message(ToHolder::Attach { from: 0 });
        assert_eq!(
            first[0],
            Effect::Send(FromHolder::Replay { offset: 0, cut: 0 })
        );
        assert_eq!(sent_output(&first), b"$ ");
        assert_eq!(sent_output(&h.pty_output(b"ls\r\n")), b"ls\r\n");
        h.detached();
        assert!(h.pty_output(b"a b c\r\n$ ").is_empty());
        let again = h.message(ToHolder::Attach { from: 6 });
        assert_eq!(sent_output(&again), b"a b c\r\n$ ");
        assert_eq!(
            h.message(ToHolder::Attach { from: 99 }),
            vec![Effect::Send(FromHolder::OffsetAhead { from: 99, end: 15 })]
        );
    }

    #[test]
    fn a_frame_sent_twice_is_written_once_and_a_gap_waits() {
        let mut h = holder();
        let input = |seq, b: &[u8]| ToHolder::Input {
            viewer: V,
            seq,
            bytes: b.to_vec(),
        };
        let one = h.message(input(1, b"l"));
        assert_eq!(one[0], Effect::WritePty(b"l".to_vec()));
        assert_eq!(
            h.message(input(1, b"l")).len(),
            1,
            "acknowledged again, not written"
        );
        assert_eq!(
            h.message(input(3, b"\r")),
            vec![Effect::Send(FromHolder::InputAck {
                viewer: V,
                acked: 1,
                refused: Some(Refused::Gap)
            })]
        );
        assert_eq!(
            h.message(input(2, b"s"))[0],
            Effect::WritePty(b"s".to_vec())
        );
    }

    #[test]
    fn the_proof_answers_the_nonce_under_the_token() {
        let mut h = holder();
        let [Effect::Send(FromHolder::Proof { mac, pid, .. })] =
            h.message(ToHolder::Challenge { nonce: [1; 32] })[..]
        else {
            panic!("no proof")
        };
        assert!(verify(&[6; 32], &[1; 32], &mac));
        assert_eq!(pid, 100);
    }

    #[test]
    fn an_exit_is_told_now_or_at_the_next_attach() {
        let mut h = holder();
        h.pty_output(b"bye\r\n");
        assert!(h.shell_exited(false, 0).is_empty());
        let e = h.message(ToHolder::Attach { from: 0 });
        assert_eq!(
            e.last(),
            Some(&Effect::Send(FromHolder::Exited {
                signal: false,
                value: 0
            }))
        );
    }
}
