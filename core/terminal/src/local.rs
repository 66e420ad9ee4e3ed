//! The private protocol between the client daemon and a terminal's holder
//! (over the holder's Unix socket), and the proof of the holder's identity.
//!
//! Each message is a record `length (u32 LE) | CRC-32C of the body (u32
//! LE) | body`, the body a tag byte and its fields, little-endian; at most
//! [`MAX_RECORD`] bytes in all. A record that is too long, fails its
//! checksum, or does not parse is an error naming what was wrong, and the
//! reader closes the connection: nothing is guessed.
//!
//! Identity: the daemon gives the holder a random token when it starts
//! it, and keeps it durably. A restarted daemon sends a fresh nonce; the
//! holder answers with HMAC-SHA256(token, nonce) and its own pid and start
//! time, which the daemon checks against `/proc` as well.

use hmac::{KeyInit, Mac};

/// Largest record, header included.
pub const MAX_RECORD: usize = 64 * 1024;
/// Largest piece of output or input one record carries.
pub const MAX_CHUNK: usize = 16 * 1024;
const HEADER: usize = 8;

/// What the daemon sends the holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToHolder {
    /// Prove you are the holder started with the token.
    Challenge {
        /// Fresh random bytes.
        nonce: [u8; 32],
    },
    /// Send the output from `from`, then every new byte as it comes.
    Attach {
        /// The offset to start from.
        from: u64,
    },
    /// Keys typed by a viewer.
    Input {
        /// The viewer.
        viewer: [u8; 16],
        /// The frame's number in the viewer's sequence.
        seq: u64,
        /// The keys.
        bytes: Vec<u8>,
    },
    /// The window size changed.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
    /// End the terminal: hang up its shell.
    Close,
}

/// What the holder sends the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromHolder {
    /// The answer to a challenge.
    Proof {
        /// HMAC-SHA256 of the nonce under the token.
        mac: [u8; 32],
        /// The holder's pid.
        pid: u32,
        /// Field 22 of the holder's `/proc/self/stat`.
        start_ticks: u64,
        /// The offset after the last output byte.
        end: u64,
    },
    /// The start of an attach's output: `cut` bytes before `offset` are
    /// gone; the bytes follow as [`FromHolder::Output`].
    Replay {
        /// The offset of the first byte that follows.
        offset: u64,
        /// Bytes asked for that left the ring.
        cut: u64,
    },
    /// Output bytes starting at `offset`.
    Output {
        /// The offset of the first byte.
        offset: u64,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// What became of a viewer's input frame.
    InputAck {
        /// The viewer.
        viewer: [u8; 16],
        /// The last of its frames written to the PTY.
        acked: u64,
        /// Why the frame was not written, if it was not.
        refused: Option<Refused>,
    },
    /// An attach asked for an offset the output has not reached.
    OffsetAhead {
        /// The offset asked for.
        from: u64,
        /// The end of the output.
        end: u64,
    },
    /// The shell ended; the holder exits once this is read.
    Exited {
        /// True when `value` is a signal number.
        signal: bool,
        /// The exit code or signal.
        value: i32,
    },
}

/// Why the holder did not write an input frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Frames are missing before it: resend from `acked + 1`.
    Gap,
    /// The holder does not know the viewer: drop the held keys.
    UnknownViewer,
    /// The frame is larger than [`MAX_CHUNK`].
    TooLarge,
    /// The PTY is not taking input now: send it again later.
    Busy,
}

/// A record that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Its length is past the limit.
    #[error("a record of {0} bytes is past the limit of {MAX_RECORD}")]
    TooLong(usize),
    /// Its checksum does not match.
    #[error("a record's checksum does not match its body")]
    Checksum,
    /// Its body is malformed.
    #[error("a record's body is malformed: {0}")]
    Body(&'static str),
}

/// HMAC-SHA256 of `nonce` under `token`.
#[must_use]
pub fn proof(token: &[u8; 32], nonce: &[u8; 32]) -> [u8; 32] {
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(token) else {
        // HMAC takes a key of any length
        return [0; 32];
    };
    mac.update(nonce);
    mac.finalize().into_bytes().into()
}

/// Whether `mac` proves the token for `nonce` (in constant time).
#[must_use]
pub fn verify(token: &[u8; 32], nonce: &[u8; 32], mac: &[u8; 32]) -> bool {
    let Ok(mut m) = hmac::Hmac::<sha2::Sha256>::new_from_slice(token) else {
        return false;
    };
    m.update(nonce);
    m.verify_slice(mac).is_ok()
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Takes one whole record off the front of `buf`: `Ok(None)` until a
/// whole one has arrived.
///
/// # Errors
/// [`DecodeError`] for a record past the limit or with a bad checksum.
pub fn take_record(buf: &mut Vec<u8>) -> Result<Option<Vec<u8>>, DecodeError> {
    let Some(head) = buf.get(..HEADER) else {
        return Ok(None);
    };
    let mut len = [0; 4];
    let mut crc = [0; 4];
    len.copy_from_slice(head.get(..4).unwrap_or(&[0; 4]));
    crc.copy_from_slice(head.get(4..).unwrap_or(&[0; 4]));
    let len = usize::try_from(u32::from_le_bytes(len)).unwrap_or(usize::MAX);
    if len > MAX_RECORD - HEADER {
        return Err(DecodeError::TooLong(len.saturating_add(HEADER)));
    }
    let Some(body) = buf.get(HEADER..HEADER + len) else {
        return Ok(None);
    };
    if crc32c::crc32c(body) != u32::from_le_bytes(crc) {
        return Err(DecodeError::Checksum);
    }
    let body = body.to_vec();
    buf.drain(..HEADER + len);
    Ok(Some(body))
}

/// Reads fields off a body.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let (a, b) = self
            .0
            .split_at_checked(n)
            .ok_or(DecodeError::Body("it ends early"))?;
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = usize::try_from(self.u32()?).unwrap_or(usize::MAX);
        if n > MAX_CHUNK {
            return Err(DecodeError::Body("a byte field is past the chunk limit"));
        }
        Ok(self.take(n)?.to_vec())
    }
    fn end(self) -> Result<(), DecodeError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Body("bytes follow its last field"))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(b);
}

impl ToHolder {
    /// The message as one record. Input longer than [`MAX_CHUNK`] is the
    /// caller's to split; the holder refuses it.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Self::Challenge { nonce } => {
                b.push(1);
                b.extend_from_slice(nonce);
            }
            Self::Attach { from } => {
                b.push(2);
                b.extend_from_slice(&from.to_le_bytes());
            }
            Self::Input { viewer, seq, bytes } => {
                b.push(3);
                b.extend_from_slice(viewer);
                b.extend_from_slice(&seq.to_le_bytes());
                put_bytes(&mut b, bytes);
            }
            Self::Resize { cols, rows } => {
                b.push(4);
                b.extend_from_slice(&cols.to_le_bytes());
                b.extend_from_slice(&rows.to_le_bytes());
            }
            Self::Close => b.push(5),
        }
        frame(&b)
    }

    /// A record's body read back.
    ///
    /// # Errors
    /// [`DecodeError::Body`] naming what is malformed.
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut f = Fields(body);
        let m = match f.u8()? {
            1 => Self::Challenge { nonce: f.array()? },
            2 => Self::Attach { from: f.u64()? },
            3 => Self::Input {
                viewer: f.array()?,
                seq: f.u64()?,
                bytes: f.bytes()?,
            },
            4 => Self::Resize {
                cols: f.u16()?,
                rows: f.u16()?,
            },
            5 => Self::Close,
            _ => return Err(DecodeError::Body("unknown message tag")),
        };
        f.end()?;
        Ok(m)
    }
}

impl FromHolder {
    /// The message as one record.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Self::Proof {
                mac,
                pid,
                start_ticks,
                end,
            } => {
                b.push(1);
                b.extend_from_slice(mac);
                b.extend_from_slice(&pid.to_le_bytes());
                b.extend_from_slice(&start_ticks.to_le_bytes());
                b.extend_from_slice(&end.to_le_bytes());
            }
            Self::Replay { offset, cut } => {
                b.push(2);
                b.extend_from_slice(&offset.to_le_bytes());
                b.extend_from_slice(&cut.to_le_bytes());
            }
            Self::Output { offset, bytes } => {
                b.push(3);
                b.extend_from_slice(&offset.to_le_bytes());
                put_bytes(&mut b, bytes);
            }
            Self::InputAck {
                viewer,
                acked,
                refused,
            } => {
                b.push(4);
                b.extend_from_slice(viewer);
                b.extend_from_slice(&acked.to_le_bytes());
                b.push(match refused {
                    None => 0,
                    Some(Refused::Gap) => 1,
                    Some(Refused::UnknownViewer) => 2,
                    Some(Refused::TooLarge) => 3,
                    Some(Refused::Busy) => 4,
                });
            }
            Self::OffsetAhead { from, end } => {
                b.push(5);
                b.extend_from_slice(&from.to_le_bytes());
                b.extend_from_slice(&end.to_le_bytes());
            }
            Self::Exited { signal, value } => {
                b.push(6);
                b.push(u8::from(*signal));
                b.extend_from_slice(&value.to_le_bytes());
            }
        }
        frame(&b)
    }

    /// A record's body read back.
    ///
    /// # Errors
    /// [`DecodeError::Body`] naming what is malformed.
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut f = Fields(body);
        let m = match f.u8()? {
            1 => Self::Proof {
                mac: f.array()?,
                pid: f.u32()?,
                start_ticks: f.u64()?,
                end: f.u64()?,
            },
            2 => Self::Replay {
                offset: f.u64()?,
                cut: f.u64()?,
            },
            3 => Self::Output {
                offset: f.u64()?,
                bytes: f.bytes()?,
            },
            4 => Self::InputAck {
                viewer: f.array()?,
                acked: f.u64()?,
                refused: match f.u8()? {
                    0 => None,
                    1 => Some(Refused::Gap),
                    2 => Some(Refused::UnknownViewer),
                    3 => Some(Refused::TooLarge),
                    4 => Some(Refused::Busy),
                    _ => return Err(DecodeError::Body("unknown refusal")),
                },
            },
            5 => Self::OffsetAhead {
                from: f.u64()?,
                end: f.u64()?,
            },
            6 => Self::Exited {
                signal: match f.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::Body("the signal flag is not 0 or 1")),
                },
                value: i32::from_le_bytes(f.array()?),
            },
            _ => return Err(DecodeError::Body("unknown message tag")),
        };
        f.end()?;
        Ok(m)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_the_token_proves_the_holder() {
        let (t, n) = ([7; 32], [9; 32]);
        let mac = proof(&t, &n);
        assert!(verify(&t, &n, &mac));
        assert!(!verify(&[8; 32], &n, &mac));
        assert!(!verify(&t, &[1; 32], &mac));
    }

    #[test]
    fn records_round_trip_and_arrive_in_pieces() {
        let msgs = vec![
            ToHolder::Challenge { nonce: [3; 32] },
            ToHolder::Attach { from: 1 << 40 },
            ToHolder::Input {
                viewer: [5; 16],
                seq: 9,
                bytes: b"ls -l\r".to_vec(),
            },
            ToHolder::Resize {
                cols: 200,
                rows: 50,
            },
            ToHolder::Close,
        ];
        let wire: Vec<u8> = msgs.iter().flat_map(ToHolder::encode).collect();
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for piece in wire.chunks(5) {
            buf.extend_from_slice(piece);
            while let Some(body) = take_record(&mut buf).unwrap() {
                got.push(ToHolder::decode(&body).unwrap());
            }
        }
        assert_eq!(got, msgs);
        let back = [
            FromHolder::Proof {
                mac: [1; 32],
                pid: 42,
                start_ticks: 7,
                end: 9,
            },
            FromHolder::Replay { offset: 3, cut: 2 },
            FromHolder::Output {
                offset: 3,
                bytes: b"x".to_vec(),
            },
            FromHolder::InputAck {
                viewer: [2; 16],
                acked: 4,
                refused: Some(Refused::Gap),
            },
            FromHolder::OffsetAhead { from: 10, end: 9 },
            FromHolder::Exited {
                signal: true,
                value: 9,
            },
        ];
        for m in back {
            let mut buf = m.encode();
            let body = take_record(&mut buf).unwrap().unwrap();
            assert_eq!(FromHolder::decode(&body).unwrap(), m);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn a_damaged_or_oversized_record_is_refused_by_name() {
        let mut r = ToHolder::Attach { from: 1 }.encode();
        r[9] ^= 1;
        assert_eq!(take_record(&mut r), Err(DecodeError::Checksum));
        let mut huge = (u32::try_from(MAX_RECORD).unwrap()).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 4]);
        assert_eq!(
            take_record(&mut huge),
            Err(DecodeError::TooLong(MAX_RECORD + 8))
        );
        assert_eq!(
            ToHolder::decode(&[2, 1, 2]),
            Err(DecodeError::Body("it ends early"))
        );
        assert_eq!(
            ToHolder::decode(&[5, 0]),
            Err(DecodeError::Body("bytes follow its last field"))
        );
    }

    proptest! {
        /// No input, however damaged, panics the reader or makes it
        /// allocate past its limits.
        #[test]
        fn any_bytes_are_read_or_refused(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = ToHolder::decode(&data);
            let _ = FromHolder::decode(&data);
            let mut buf = data.clone();
            let _ = take_record(&mut buf);
        }
    }
}
