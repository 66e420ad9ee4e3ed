//! Shared helpers for the segment integration tests.
#![allow(dead_code, unreachable_pub)]

use rvbox_segment::{Compression, Kind, Limits, RecordMeta, Stream, encode, sha256};

pub const LIMITS: Limits = Limits {
    max_stored_len: 1 << 20,
    max_raw_len: 4 << 20,
};

pub const UUID: [u8; 16] = [
    0x01, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x7a, 0xbc, 0x80, 0x00, 0x12, 0x34, 0x56, 0x78, 0x80, 0x57,
];

/// The stream a kind must carry.
pub fn stream_for(kind: Kind, seq: u64) -> Stream {
    match kind {
        Kind::Output if seq.is_multiple_of(2) => Stream::Stdout,
        Kind::Output => Stream::Stderr,
        _ => Stream::None,
    }
}

/// A valid uncompressed record's meta for `payload`.
pub fn meta(kind: Kind, seq: u64, payload: &[u8]) -> RecordMeta {
    RecordMeta {
        issue_uuid: if kind == Kind::Audit { [0; 16] } else { UUID },
        seq,
        observed_unix_ms: 1_700_000_000_000 + i64::try_from(seq).unwrap(),
        receipt_unix_ms: 1_700_000_000_500 + i64::try_from(seq).unwrap(),
        kind,
        stream: stream_for(kind, seq),
        compression: Compression::None,
        raw_len: u32::try_from(payload.len()).unwrap(),
        sha256: sha256(payload),
    }
}

/// Deterministic payload of `len` bytes for `seq`.
pub fn payload(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| u8::try_from((i as u64).wrapping_mul(31).wrapping_add(seq * 7) % 251).unwrap())
        .collect()
}

/// An uncompressed Output record.
pub fn record(seq: u64, len: usize) -> (RecordMeta, Vec<u8>) {
    let p = payload(seq, len);
    let m = meta(Kind::Output, seq, &p);
    let bytes = encode(&m, &p, &LIMITS).unwrap();
    (m, bytes)
}

/// A segment of `lens.len()` Output records; returns the bytes, each record's
/// (offset, len, meta).
pub fn segment(lens: &[usize]) -> (Vec<u8>, Vec<(u64, u64, RecordMeta)>) {
    let mut buf = Vec::new();
    let mut recs = Vec::new();
    for (i, len) in lens.iter().enumerate() {
        let (m, bytes) = record(i as u64 + 1, *len);
        recs.push((buf.len() as u64, bytes.len() as u64, m));
        buf.extend_from_slice(&bytes);
    }
    (buf, recs)
}

/// Recomputes the header CRC after a test edited header bytes.
pub fn reseal_header(rec: &mut [u8]) {
    let crc = crc32c_of(&rec[..124]);
    rec[124..128].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes the trailing record CRC.
pub fn reseal_record(rec: &mut [u8]) {
    let n = rec.len();
    let crc = crc32c_of(&rec[..n - 4]);
    rec[n - 4..].copy_from_slice(&crc.to_le_bytes());
}

/// Reference CRC-32C (Castagnoli, reflected 0x82F63B78), bitwise, so the
/// tests do not just reuse the implementation's dependency.
pub fn crc32c_of(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
