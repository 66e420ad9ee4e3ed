//! The group journal frame format (plan §5.3, group commit).
//!
//! A group that appends to many segment files at once is made durable with
//! one sequential write and one `fdatasync` of the group journal instead of
//! a flush of every touched segment file. Each group is one *frame*: a
//! checksummed header followed by one *entry* per touched segment, holding
//! exactly the bytes appended to that segment in this group and where they
//! went (command, segment ordinal, offset). The segment files receive the
//! same bytes through the page cache; a checkpoint (one filesystem sync)
//! later makes them durable on their own and starts a new journal *epoch*.
//! After a power cut, recovery re-appends, from the frames of the current
//! epoch, whatever committed segment bytes the filesystem lost.
//!
//! # Frame format (version 1, little-endian)
//!
//! | offset | size | field          | meaning                                         |
//! |-------:|-----:|----------------|-------------------------------------------------|
//! |      0 |    4 | `magic`        | `b"RVJF"`                                       |
//! |      4 |    2 | `version`      | `1`                                             |
//! |      6 |    2 | `flags`        | must be 0                                       |
//! |      8 |    8 | `epoch`        | journal epoch the frame belongs to              |
//! |     16 |    4 | `payload_len`  | bytes of entries that follow the header         |
//! |     20 |    4 | `entry_count`  | entries in the payload                          |
//! |     24 |    4 | `payload_crc`  | CRC-32C of the payload                          |
//! |     28 |    4 | `header_crc`   | CRC-32C of bytes `0..28`                        |
//!
//! Each entry: `issue_uuid` (16), `ordinal` (u32), `offset` (u64), `len`
//! (u32), then `len` bytes (whole segment records).
//!
//! Decoding stops at the first frame that is short (a torn write), carries
//! another epoch (a frame left from before the last checkpoint), or fails
//! a check; nothing after that point is trusted. A frame is all or nothing.

use thiserror::Error;

/// Frame magic.
pub const FRAME_MAGIC: [u8; 4] = *b"RVJF";
/// Frame format version.
pub const FRAME_VERSION: u16 = 1;
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: usize = 32;
/// Bytes of an entry header.
pub const ENTRY_HEADER_LEN: usize = 32;

/// The bytes one group appended to one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry<'a> {
    /// Command the segment belongs to.
    pub issue_uuid: [u8; 16],
    /// Segment ordinal.
    pub ordinal: u32,
    /// Offset in the segment where `bytes` begin.
    pub offset: u64,
    /// Whole records, exactly as appended.
    pub bytes: &'a [u8],
}

/// An entry found by [`decode_frames`]: where its bytes lie in the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedEntry {
    /// Command.
    pub issue_uuid: [u8; 16],
    /// Segment ordinal.
    pub ordinal: u32,
    /// Offset in the segment.
    pub offset: u64,
    /// Position of the bytes in the decoded buffer.
    pub range: std::ops::Range<usize>,
    /// Index of the frame the entry came from (journal order).
    pub frame: usize,
}

/// Why decoding stopped before the end of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalStop {
    /// The buffer ends inside a frame (a torn final write).
    Torn,
    /// Bytes that are not a frame header.
    BadMagic,
    /// A frame of another epoch: left over from before a checkpoint.
    OtherEpoch,
    /// A header or payload checksum failed, or a field is invalid.
    Corrupt,
}

/// Result of [`decode_frames`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JournalScan {
    /// Entries of every valid frame, in journal order.
    pub entries: Vec<DecodedEntry>,
    /// Valid frames.
    pub frames: usize,
    /// End of the last valid frame.
    pub valid_len: u64,
    /// Why decoding stopped early; `None` when the buffer ended on a frame
    /// boundary.
    pub stop: Option<JournalStop>,
}

/// Why a frame cannot be encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum JournalError {
    /// The payload would not fit the 32-bit length field.
    #[error("journal frame payload exceeds 4 GiB")]
    TooLarge,
}

/// Bytes a frame of `entries` takes.
#[must_use]
pub fn frame_len(entries: &[JournalEntry<'_>]) -> u64 {
    entries.iter().fold(FRAME_HEADER_LEN as u64, |n, e| {
        n.saturating_add(ENTRY_HEADER_LEN as u64)
            .saturating_add(e.bytes.len() as u64)
    })
}

/// Encodes one frame.
///
/// # Errors
/// [`JournalError::TooLarge`] when the payload exceeds `u32::MAX` bytes.
pub fn encode_frame(epoch: u64, entries: &[JournalEntry<'_>]) -> Result<Vec<u8>, JournalError> {
    let total = usize::try_from(frame_len(entries)).map_err(|_| JournalError::TooLarge)?;
    let payload_len =
        u32::try_from(total - FRAME_HEADER_LEN).map_err(|_| JournalError::TooLarge)?;
    let count = u32::try_from(entries.len()).map_err(|_| JournalError::TooLarge)?;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    for e in entries {
        let len = u32::try_from(e.bytes.len()).map_err(|_| JournalError::TooLarge)?;
        out.extend_from_slice(&e.issue_uuid);
        out.extend_from_slice(&e.ordinal.to_le_bytes());
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(e.bytes);
    }
    let payload_crc = crc32c::crc32c(out.get(FRAME_HEADER_LEN..).unwrap_or_default());
    let mut header = Vec::with_capacity(FRAME_HEADER_LEN);
    header.extend_from_slice(&FRAME_MAGIC);
    header.extend_from_slice(&FRAME_VERSION.to_le_bytes());
    header.extend_from_slice(&0u16.to_le_bytes());
    header.extend_from_slice(&epoch.to_le_bytes());
    header.extend_from_slice(&payload_len.to_le_bytes());
    header.extend_from_slice(&count.to_le_bytes());
    header.extend_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32c::crc32c(&header);
    header.extend_from_slice(&header_crc.to_le_bytes());
    if let Some(h) = out.get_mut(..FRAME_HEADER_LEN) {
        h.copy_from_slice(&header);
    }
    Ok(out)
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at.checked_add(4)?)
        .and_then(|s| <[u8; 4]>::try_from(s).ok())
        .map(u32::from_le_bytes)
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at.checked_add(8)?)
        .and_then(|s| <[u8; 8]>::try_from(s).ok())
        .map(u64::from_le_bytes)
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at.checked_add(2)?)
        .and_then(|s| <[u8; 2]>::try_from(s).ok())
        .map(u16::from_le_bytes)
}

/// Decodes the entries of one frame's payload; `None` when they do not
/// exactly fill it.
fn decode_entries(
    payload: &[u8],
    base: usize,
    count: u32,
    frame: usize,
    max_entry_len: u32,
) -> Option<Vec<DecodedEntry>> {
    let mut at = 0usize;
    let mut out = Vec::new();
    for _ in 0..count {
        let head = payload.get(at..at.checked_add(ENTRY_HEADER_LEN)?)?;
        let issue_uuid = <[u8; 16]>::try_from(head.get(0..16)?).ok()?;
        let ordinal = le_u32(head, 16)?;
        let offset = le_u64(head, 20)?;
        let len = le_u32(head, 28)?;
        if len > max_entry_len {
            return None;
        }
        let start = at.checked_add(ENTRY_HEADER_LEN)?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        if end > payload.len() {
            return None;
        }
        out.push(DecodedEntry {
            issue_uuid,
            ordinal,
            offset,
            range: base.checked_add(start)?..base.checked_add(end)?,
            frame,
        });
        at = end;
    }
    (at == payload.len()).then_some(out)
}

/// Decodes the frames of `epoch` from the start of `buf` (see the module
/// docs). `max_payload` bounds a frame's payload and every entry; a larger
/// declared length is corruption, never an allocation.
#[must_use]
pub fn decode_frames(buf: &[u8], epoch: u64, max_payload: u32) -> JournalScan {
    let mut scan = JournalScan::default();
    let mut at = 0usize;
    loop {
        if at == buf.len() {
            return scan;
        }
        let stop = (|| {
            let Some(header) = buf.get(at..at.saturating_add(FRAME_HEADER_LEN)) else {
                // a header cut short: torn if what is there could be one
                let rest = buf.get(at..).unwrap_or_default();
                let could = rest.iter().zip(FRAME_MAGIC.iter()).all(|(a, b)| a == b);
                return Err(if could {
                    JournalStop::Torn
                } else {
                    JournalStop::BadMagic
                });
            };
            if header.get(0..4) != Some(&FRAME_MAGIC[..]) {
                return Err(JournalStop::BadMagic);
            }
            let crc_ok =
                le_u32(header, 28) == Some(crc32c::crc32c(header.get(..28).unwrap_or_default()));
            if !crc_ok || le_u16(header, 4) != Some(FRAME_VERSION) || le_u16(header, 6) != Some(0) {
                return Err(JournalStop::Corrupt);
            }
            if le_u64(header, 8) != Some(epoch) {
                return Err(JournalStop::OtherEpoch);
            }
            let payload_len = le_u32(header, 16).ok_or(JournalStop::Corrupt)?;
            let count = le_u32(header, 20).ok_or(JournalStop::Corrupt)?;
            if payload_len > max_payload {
                return Err(JournalStop::Corrupt);
            }
            let start = at + FRAME_HEADER_LEN;
            let end = start
                .checked_add(usize::try_from(payload_len).map_err(|_| JournalStop::Corrupt)?)
                .ok_or(JournalStop::Corrupt)?;
            let payload = buf.get(start..end).ok_or(JournalStop::Torn)?;
            if le_u32(header, 24) != Some(crc32c::crc32c(payload)) {
                return Err(JournalStop::Corrupt);
            }
            let entries = decode_entries(payload, start, count, scan.frames, max_payload)
                .ok_or(JournalStop::Corrupt)?;
            Ok((entries, end))
        })();
        match stop {
            Ok((entries, end)) => {
                scan.entries.extend(entries);
                scan.frames += 1;
                scan.valid_len = end as u64;
                at = end;
            }
            Err(s) => {
                scan.stop = Some(s);
                return scan;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    fn entries(data: &[Vec<u8>]) -> Vec<JournalEntry<'_>> {
        data.iter()
            .enumerate()
            .map(|(i, b)| JournalEntry {
                issue_uuid: [u8::try_from(i).unwrap(); 16],
                ordinal: u32::try_from(i).unwrap() + 1,
                offset: 1000 * i as u64,
                bytes: b,
            })
            .collect()
    }

    #[test]
    fn frames_round_trip_in_order() {
        let a = vec![vec![1u8; 10], vec![2u8; 300]];
        let b = vec![vec![3u8; 7]];
        let mut buf = encode_frame(5, &entries(&a)).unwrap();
        assert_eq!(buf.len() as u64, frame_len(&entries(&a)));
        buf.extend(encode_frame(5, &entries(&b)).unwrap());
        let scan = decode_frames(&buf, 5, 1 << 20);
        assert_eq!(scan.stop, None);
        assert_eq!(scan.frames, 2);
        assert_eq!(scan.valid_len, buf.len() as u64);
        assert_eq!(scan.entries.len(), 3);
        assert_eq!(&buf[scan.entries[1].range.clone()], &a[1][..]);
        assert_eq!(scan.entries[1].offset, 1000);
        assert_eq!(scan.entries[1].ordinal, 2);
        assert_eq!(scan.entries[2].frame, 1);
        assert_eq!(&buf[scan.entries[2].range.clone()], &b[0][..]);
    }

    #[test]
    fn a_torn_final_frame_is_ignored_whole() {
        let a = vec![vec![1u8; 50]];
        let mut buf = encode_frame(1, &entries(&a)).unwrap();
        let first = buf.len();
        buf.extend(encode_frame(1, &entries(&a)).unwrap());
        for cut in first + 1..buf.len() {
            let scan = decode_frames(&buf[..cut], 1, 1 << 20);
            assert_eq!(scan.frames, 1, "cut at {cut}");
            assert_eq!(scan.valid_len, first as u64);
            assert_eq!(scan.stop, Some(JournalStop::Torn), "cut at {cut}");
        }
    }

    #[test]
    fn frames_of_another_epoch_end_the_journal() {
        let a = vec![vec![1u8; 50]];
        let mut buf = encode_frame(2, &entries(&a)).unwrap();
        buf.extend(encode_frame(1, &entries(&a)).unwrap());
        let scan = decode_frames(&buf, 2, 1 << 20);
        assert_eq!(scan.frames, 1);
        assert_eq!(scan.stop, Some(JournalStop::OtherEpoch));
        assert_eq!(decode_frames(&buf, 3, 1 << 20).frames, 0);
    }

    #[test]
    fn a_flipped_bit_or_oversized_length_is_corruption() {
        let a = vec![vec![1u8; 50]];
        let buf = encode_frame(1, &entries(&a)).unwrap();
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            let scan = decode_frames(&bad, 1, 1 << 20);
            assert_eq!(scan.frames, 0, "bit flip at {i} accepted");
            assert!(scan.stop.is_some());
        }
        assert_eq!(
            decode_frames(&buf, 1, 10).stop,
            Some(JournalStop::Corrupt),
            "a payload above the bound is refused before it is read"
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600), epoch in 0u64..3) {
            let scan = decode_frames(&bytes, epoch, 1 << 16);
            prop_assert!(scan.valid_len <= bytes.len() as u64);
            for e in &scan.entries {
                prop_assert!(e.range.end <= bytes.len());
            }
        }

        #[test]
        fn any_prefix_decodes_to_whole_frames(sizes in proptest::collection::vec(0usize..200, 1..6), cut in 0usize..2000) {
            let data: Vec<Vec<u8>> = sizes.iter().map(|n| vec![7u8; *n]).collect();
            let mut buf = Vec::new();
            let mut ends = vec![0usize];
            for d in &data {
                buf.extend(encode_frame(9, &entries(std::slice::from_ref(d))).unwrap());
                ends.push(buf.len());
            }
            let cut = cut.min(buf.len());
            let scan = decode_frames(&buf[..cut], 9, 1 << 16);
            let whole = ends.iter().filter(|e| **e <= cut).count() - 1;
            prop_assert_eq!(scan.frames, whole);
            prop_assert_eq!(scan.valid_len as usize, ends[whole]);
        }
    }
}
