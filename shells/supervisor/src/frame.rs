//! Launcher-control records (plan §7.4: "launch-journal and
//! launcher-control records are checksum-framed and bounded").
//!
//! The launcher reports to the daemon in records framed as
//! `payload length (u32 LE) | CRC-32C of the payload (u32 LE) | payload`,
//! at most [`MAX_RECORD_BYTES`] in all. The daemon answers with single
//! bytes ([`RELEASE`], [`FINISH`]); the release byte carries the child's
//! pipe ends as `SCM_RIGHTS`.

use std::io::{self, Read, Write};

/// Largest launcher-control record, header included.
pub(crate) const MAX_RECORD_BYTES: usize = 4096;
/// Header: length and checksum.
const HEADER_BYTES: usize = 8;
/// Largest failure reason a record carries (cut at a character boundary).
pub(crate) const MAX_REASON_BYTES: usize = 1024;

/// The one-byte release (plan §7.4 step 4).
pub(crate) const RELEASE: u8 = b'R';
/// The tree is cleaned up: the launcher exits without killing anything.
pub(crate) const FINISH: u8 = b'F';

const TAG_READY: u8 = 1;
const TAG_EXEC_OK: u8 = 2;
const TAG_FAILED: u8 = 3;
const TAG_EXITED: u8 = 4;

/// One record from the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// The blocked launcher leads its session and process group and sits in
    /// its cgroups.
    Ready {
        /// Its pid.
        pid: u32,
        /// Its process group.
        pgid: u32,
        /// Field 22 of its `/proc/self/stat`.
        start_ticks: u64,
    },
    /// The shell was created.
    ExecOk {
        /// The shell's pid.
        child_pid: u32,
    },
    /// The launcher could not do its part; nothing of the command ran.
    Failed {
        /// A policy or host fact that will not change on a retry.
        permanent: bool,
        /// What failed.
        reason: String,
    },
    /// The shell ended.
    Exited {
        /// True when `value` is a signal number, false for an exit code.
        signal: bool,
        /// The code or signal.
        value: i32,
    },
}

/// A record that cannot be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The stream failed.
    #[error("launcher channel: {0}")]
    Io(#[from] io::Error),
    /// The stream ended inside a record.
    #[error("launcher channel ended inside a record")]
    Truncated,
    /// A length beyond the bound.
    #[error("launcher record of {0} bytes exceeds the bound")]
    Oversized(usize),
    /// The checksum does not match.
    #[error("launcher record checksum mismatch")]
    Checksum,
    /// The payload does not parse.
    #[error("malformed launcher record: {0}")]
    Malformed(&'static str),
}

fn cut_reason(reason: &str) -> &str {
    if reason.len() <= MAX_REASON_BYTES {
        return reason;
    }
    let mut end = MAX_REASON_BYTES;
    while end > 0 && !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.get(..end).unwrap_or("")
}

impl Record {
    fn payload(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(32);
        match self {
            Self::Ready {
                pid,
                pgid,
                start_ticks,
            } => {
                p.push(TAG_READY);
                p.extend_from_slice(&pid.to_le_bytes());
                p.extend_from_slice(&pgid.to_le_bytes());
                p.extend_from_slice(&start_ticks.to_le_bytes());
            }
            Self::ExecOk { child_pid } => {
                p.push(TAG_EXEC_OK);
                p.extend_from_slice(&child_pid.to_le_bytes());
            }
            Self::Failed { permanent, reason } => {
                p.push(TAG_FAILED);
                p.push(u8::from(*permanent));
                p.extend_from_slice(cut_reason(reason).as_bytes());
            }
            Self::Exited { signal, value } => {
                p.push(TAG_EXITED);
                p.push(u8::from(*signal));
                p.extend_from_slice(&value.to_le_bytes());
            }
        }
        p
    }

    /// The framed bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let payload = self.payload();
        debug_assert!(payload.len() + HEADER_BYTES <= MAX_RECORD_BYTES);
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Writes one framed record.
    pub(crate) fn write_to(&self, mut w: impl Write) -> io::Result<()> {
        w.write_all(&self.encode())?;
        w.flush()
    }

    fn decode(payload: &[u8]) -> Result<Self, FrameError> {
        let (tag, rest) = payload
            .split_first()
            .ok_or(FrameError::Malformed("empty payload"))?;
        let u32_at = |b: &[u8], at: usize| -> Result<u32, FrameError> {
            b.get(at..at + 4)
                .and_then(|s| <[u8; 4]>::try_from(s).ok())
                .map(u32::from_le_bytes)
                .ok_or(FrameError::Malformed("short field"))
        };
        match *tag {
            TAG_READY => {
                if rest.len() != 16 {
                    return Err(FrameError::Malformed("ready length"));
                }
                let start = rest
                    .get(8..16)
                    .and_then(|s| <[u8; 8]>::try_from(s).ok())
                    .map(u64::from_le_bytes)
                    .ok_or(FrameError::Malformed("short field"))?;
                Ok(Self::Ready {
                    pid: u32_at(rest, 0)?,
                    pgid: u32_at(rest, 4)?,
                    start_ticks: start,
                })
            }
            TAG_EXEC_OK => {
                if rest.len() != 4 {
                    return Err(FrameError::Malformed("exec-ok length"));
                }
                Ok(Self::ExecOk {
                    child_pid: u32_at(rest, 0)?,
                })
            }
            TAG_FAILED => {
                let (permanent, text) = rest
                    .split_first()
                    .ok_or(FrameError::Malformed("failed length"))?;
                if *permanent > 1 || text.len() > MAX_REASON_BYTES {
                    return Err(FrameError::Malformed("failed fields"));
                }
                let reason = std::str::from_utf8(text)
                    .map_err(|_| FrameError::Malformed("reason is not UTF-8"))?;
                Ok(Self::Failed {
                    permanent: *permanent == 1,
                    reason: reason.to_owned(),
                })
            }
            TAG_EXITED => {
                if rest.len() != 5 {
                    return Err(FrameError::Malformed("exited length"));
                }
                let (signal, value) = rest
                    .split_first()
                    .ok_or(FrameError::Malformed("exited length"))?;
                if *signal > 1 {
                    return Err(FrameError::Malformed("exited kind"));
                }
                Ok(Self::Exited {
                    signal: *signal == 1,
                    value: i32::from_le_bytes(u32_at(value, 0)?.to_le_bytes()),
                })
            }
            _ => Err(FrameError::Malformed("unknown tag")),
        }
    }

    /// Reads one record; `None` at a clean end of stream between records.
    pub(crate) fn read_from(mut r: impl Read) -> Result<Option<Self>, FrameError> {
        let mut header = [0u8; HEADER_BYTES];
        let mut got = 0;
        while got < HEADER_BYTES {
            let n = match r.read(header.get_mut(got..).unwrap_or_default()) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            if n == 0 {
                return if got == 0 {
                    Ok(None)
                } else {
                    Err(FrameError::Truncated)
                };
            }
            got += n;
        }
        let [l0, l1, l2, l3, c0, c1, c2, c3] = header;
        let len = usize::try_from(u32::from_le_bytes([l0, l1, l2, l3]))
            .map_err(|_| FrameError::Oversized(usize::MAX))?;
        if len > MAX_RECORD_BYTES - HEADER_BYTES {
            return Err(FrameError::Oversized(len));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                FrameError::Truncated
            } else {
                FrameError::Io(e)
            }
        })?;
        if crc32c::crc32c(&payload) != u32::from_le_bytes([c0, c1, c2, c3]) {
            return Err(FrameError::Checksum);
        }
        Self::decode(&payload).map(Some)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    fn all() -> Vec<Record> {
        vec![
            Record::Ready {
                pid: 41,
                pgid: 41,
                start_ticks: u64::MAX - 3,
            },
            Record::ExecOk { child_pid: 7 },
            Record::Failed {
                permanent: true,
                reason: "shell changed".into(),
            },
            Record::Exited {
                signal: false,
                value: -2,
            },
            Record::Exited {
                signal: true,
                value: 9,
            },
        ]
    }

    #[test]
    fn records_round_trip_back_to_back() {
        let mut bytes = Vec::new();
        for r in all() {
            r.write_to(&mut bytes).unwrap();
        }
        let mut cursor = std::io::Cursor::new(bytes);
        for r in all() {
            assert_eq!(Record::read_from(&mut cursor).unwrap(), Some(r));
        }
        assert_eq!(Record::read_from(&mut cursor).unwrap(), None);
    }

    #[test]
    fn a_flipped_bit_is_a_checksum_error() {
        let mut bytes = Record::ExecOk { child_pid: 7 }.encode();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(matches!(
            Record::read_from(&bytes[..]),
            Err(FrameError::Checksum)
        ));
    }

    #[test]
    fn an_oversized_length_is_refused_before_reading() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&(MAX_RECORD_BYTES as u32).to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            Record::read_from(&bytes[..]),
            Err(FrameError::Oversized(_))
        ));
    }

    #[test]
    fn a_cut_record_is_truncated_and_long_reasons_are_cut() {
        let bytes = Record::ExecOk { child_pid: 7 }.encode();
        assert!(matches!(
            Record::read_from(&bytes[..5]),
            Err(FrameError::Truncated)
        ));
        let long = "é".repeat(MAX_REASON_BYTES);
        let r = Record::Failed {
            permanent: false,
            reason: long,
        };
        let back = Record::read_from(&r.encode()[..]).unwrap().unwrap();
        let Record::Failed { reason, .. } = back else {
            panic!("not a failure")
        };
        assert!(reason.len() <= MAX_REASON_BYTES && !reason.is_empty());
    }
}
