//! RVBox segment files: the on-disk record format and the recovery decision
//! for one segment (plan §5.3, §5.1 step 4).
//!
//! Owns: encoding and decoding one segment record, validating every header
//! field and length against caller-supplied [`Limits`] before any slicing,
//! the SHA-256 content identity of a raw payload, the [`scan`] of one
//! segment's bytes that decides [`Recovery`] (clean, truncate an
//! unacknowledged tail, or committed damage with the exact lost byte ranges),
//! and the canonical segment / audit file names.
//!
//! Must never: open, read, write, seek, truncate or sync a file; read a clock;
//! use randomness; log payload bytes. The shell reads the bytes (at most
//! `committed_end` plus a bounded tail), hands them in, and performs the
//! decision. It never moves `committed_end` backwards (plan §5.3).
//!
//! # Record format (version 1, little-endian, fixed 128-byte header)
//!
//! | offset | size | field              | meaning                                                                 |
//! |-------:|-----:|--------------------|-------------------------------------------------------------------------|
//! |      0 |    4 | `magic`            | `b"RVSG"`                                                               |
//! |      4 |    2 | `version`          | `1`                                                                     |
//! |      6 |    2 | `header_len`       | `128`                                                                   |
//! |      8 |    4 | `record_len`       | `header_len + stored_len + 4` (trailing CRC)                            |
//! |     12 |   16 | `issue_uuid`       | command UUID; all zero for audit records                                |
//! |     28 |    8 | `seq`              | event_seq (output/events), write_seq (stdin), chunk ordinal (script/spec), audit ordinal |
//! |     36 |    8 | `observed_unix_ms` | i64, client-observed wall time; 0 when not applicable                   |
//! |     44 |    8 | `receipt_unix_ms`  | i64, server receipt wall time                                           |
//! |     52 |    1 | `kind`             | 1 Output, 2 Event, 3 Script, 4 Stdin, 5 Spec, 6 Audit                   |
//! |     53 |    1 | `stream`           | 0 None, 1 Stdout, 2 Stderr (Output needs Stdout/Stderr, others None)     |
//! |     54 |    1 | `compression`      | 0 None, 1 Zstd                                                          |
//! |     55 |    1 | `flags`            | must be 0                                                               |
//! |     56 |    4 | `raw_len`          | payload bytes after decompression (== `stored_len` when uncompressed)   |
//! |     60 |    4 | `stored_len`       | payload bytes as stored                                                 |
//! |     64 |   32 | `sha256`           | SHA-256 of the RAW payload: the immutable identity for duplicate checks |
//! |     96 |   28 | `reserved`         | must be all zero                                                        |
//! |    124 |    4 | `header_crc`       | CRC-32C of bytes `0..124`                                               |
//! |    128 | `stored_len` | `payload`  | stored (possibly compressed) payload                                    |
//! |    end |    4 | `record_crc`       | CRC-32C of header (128 bytes) + payload                                 |
//!
//! Decoding checks, in order: magic, version, header length, header CRC, field
//! values (kind, stream, compression, flags, reserved), lengths against
//! [`Limits`], `record_len` consistency, that the buffer holds the whole
//! record ([`DecodeError::Truncated`] otherwise: a torn write), and finally
//! the record CRC. No length is trusted before the header CRC verified it,
//! and nothing is allocated or sliced from an unchecked length.

mod format;
pub mod journal;
mod names;
mod scan;

pub use format::{
    Compression, DecodeError, Decoded, EncodeError, Field, HEADER_LEN, Kind, Limits, MAGIC,
    RECORD_OVERHEAD, RecordMeta, Stream, TRAILER_LEN, VERSION, decode, encode, encoded_len, sha256,
};
pub use names::{
    MAX_AUDIT_ORDINAL, MAX_SEGMENT_ORDINAL, SEGMENT_DIRS, audit_file_name, parse_audit_file_name,
    parse_segment_file_name, segment_dir_name, segment_dir_of_index, segment_file_name,
};
pub use scan::{ByteRange, Damage, Recovery, Scan, ScannedRecord, scan};
