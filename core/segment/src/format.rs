//! One segment record: types, encode, decode (plan §5.3, R-5.3-04/05).

use sha2::{Digest, Sha256};

/// First four bytes of every record.
pub const MAGIC: [u8; 4] = *b"RVSG";
/// Record format version written and accepted by this crate.
pub const VERSION: u16 = 1;
/// Fixed header length in bytes.
pub const HEADER_LEN: usize = 128;
/// Trailing record CRC length in bytes.
pub const TRAILER_LEN: usize = 4;
/// Bytes a record adds around its stored payload (header + trailing CRC).
pub const RECORD_OVERHEAD: u64 = (HEADER_LEN + TRAILER_LEN) as u64;

// Header field offsets (see the table in the crate docs).
const OFF_VERSION: usize = 4;
const OFF_HEADER_LEN: usize = 6;
const OFF_RECORD_LEN: usize = 8;
const OFF_ISSUE_UUID: usize = 12;
const OFF_SEQ: usize = 28;
const OFF_OBSERVED: usize = 36;
const OFF_RECEIPT: usize = 44;
const OFF_KIND: usize = 52;
const OFF_STREAM: usize = 53;
const OFF_COMPRESSION: usize = 54;
const OFF_FLAGS: usize = 55;
const OFF_RAW_LEN: usize = 56;
const OFF_STORED_LEN: usize = 60;
const OFF_SHA256: usize = 64;
const OFF_RESERVED: usize = 96;
const RESERVED_LEN: usize = 28;
const OFF_HEADER_CRC: usize = 124;

/// What a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Command output chunk (stream Stdout or Stderr); `seq` is the event_seq.
    Output = 1,
    /// Non-output command event body (e.g. lifecycle); `seq` is the event_seq.
    Event = 2,
    /// Script chunk; `seq` is the chunk ordinal.
    Script = 3,
    /// Stdin write; `seq` is the write_seq.
    Stdin = 4,
    /// Immutable execution spec chunk; `seq` is the chunk ordinal.
    Spec = 5,
    /// Audit event; `seq` is the audit ordinal, `issue_uuid` is all zero.
    Audit = 6,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 6] = [
        Kind::Output,
        Kind::Event,
        Kind::Script,
        Kind::Stdin,
        Kind::Spec,
        Kind::Audit,
    ];

    /// The on-disk code.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Parses an on-disk code; unknown codes are `None`.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Kind::Output),
            2 => Some(Kind::Event),
            3 => Some(Kind::Script),
            4 => Some(Kind::Stdin),
            5 => Some(Kind::Spec),
            6 => Some(Kind::Audit),
            _ => None,
        }
    }

    /// Stable short name for logs and incidents.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Output => "output",
            Kind::Event => "event",
            Kind::Script => "script",
            Kind::Stdin => "stdin",
            Kind::Spec => "spec",
            Kind::Audit => "audit",
        }
    }
}

/// Output stream of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Stream {
    /// Not an output record.
    None = 0,
    /// Standard output.
    Stdout = 1,
    /// Standard error.
    Stderr = 2,
}

impl Stream {
    /// Every stream, in code order.
    pub const ALL: [Stream; 3] = [Stream::None, Stream::Stdout, Stream::Stderr];

    /// The on-disk code.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Parses an on-disk code; unknown codes are `None`.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Stream::None),
            1 => Some(Stream::Stdout),
            2 => Some(Stream::Stderr),
            _ => None,
        }
    }
}

/// How the stored payload is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Compression {
    /// Stored bytes are the raw bytes (`raw_len == stored_len`).
    None = 0,
    /// Stored bytes are one Zstandard frame of `raw_len` raw bytes.
    Zstd = 1,
}

impl Compression {
    /// Every compression, in code order.
    pub const ALL: [Compression; 2] = [Compression::None, Compression::Zstd];

    /// The on-disk code.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Parses an on-disk code; unknown codes are `None`.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Compression::None),
            1 => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// Configured maxima, checked before any allocation or slicing (R-5.3-05).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted stored (possibly compressed) payload.
    pub max_stored_len: u32,
    /// Largest accepted raw (decompressed) payload.
    pub max_raw_len: u32,
}

/// Everything in a record header except the framing (magic, version,
/// lengths of the frame, CRCs). `stored_len` is the payload's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordMeta {
    /// Command UUID bytes; all zero for audit records.
    pub issue_uuid: [u8; 16],
    /// event_seq / write_seq / chunk ordinal / audit ordinal, per [`Kind`].
    pub seq: u64,
    /// Client-observed wall time (ms since the Unix epoch); 0 when not applicable.
    pub observed_unix_ms: i64,
    /// Server receipt wall time (ms since the Unix epoch).
    pub receipt_unix_ms: i64,
    /// What the record holds.
    pub kind: Kind,
    /// Output stream; `Stream::None` for every kind except `Output`.
    pub stream: Stream,
    /// How the stored payload is encoded.
    pub compression: Compression,
    /// Bytes after decompression.
    pub raw_len: u32,
    /// SHA-256 of the raw payload (see [`sha256`]).
    pub sha256: [u8; 32],
}

/// Names of header fields, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Field {
    /// `header_len`.
    HeaderLen,
    /// `record_len`.
    RecordLen,
    /// `issue_uuid` (must be zero for audit records).
    IssueUuid,
    /// `kind`.
    Kind,
    /// `stream` (unknown, or inconsistent with the kind).
    Stream,
    /// `compression`.
    Compression,
    /// `flags`.
    Flags,
    /// `raw_len`.
    RawLen,
    /// `stored_len`.
    StoredLen,
    /// `reserved`.
    Reserved,
}

impl Field {
    /// Stable short name for logs and incidents.
    pub const fn as_str(self) -> &'static str {
        match self {
            Field::HeaderLen => "header_len",
            Field::RecordLen => "record_len",
            Field::IssueUuid => "issue_uuid",
            Field::Kind => "kind",
            Field::Stream => "stream",
            Field::Compression => "compression",
            Field::Flags => "flags",
            Field::RawLen => "raw_len",
            Field::StoredLen => "stored_len",
            Field::Reserved => "reserved",
        }
    }
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a record could not be encoded. Messages never contain payload bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A length is above the configured limit (or the record would not fit
    /// the 32-bit `record_len`).
    #[error("segment record {field} {len} exceeds limit {max}")]
    TooLarge {
        /// Which length.
        field: Field,
        /// The offending length.
        len: u64,
        /// The limit it exceeds.
        max: u64,
    },
    /// A metadata field is inconsistent (stream vs kind, audit with a
    /// command id, uncompressed with `raw_len != stored_len`).
    #[error("segment record field {field} is invalid")]
    BadField {
        /// Which field.
        field: Field,
    },
}

impl EncodeError {
    /// Stable short code for logs and incidents.
    pub const fn code(&self) -> &'static str {
        match self {
            EncodeError::TooLarge { .. } => "too_large",
            EncodeError::BadField { .. } => "bad_field",
        }
    }
}

/// Why the bytes at the start of a buffer are not a valid record.
/// Messages never contain payload bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The buffer ends inside the record: a torn write (or, inside the
    /// committed range, missing bytes).
    #[error("segment record truncated: needed {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the record needs (the header length while the header itself
        /// is incomplete, else the whole record length).
        needed: u64,
        /// Bytes available.
        have: u64,
    },
    /// The first bytes are not `RVSG`.
    #[error("segment record has bad magic")]
    BadMagic,
    /// Unknown format version.
    #[error("segment record has unsupported version {version}")]
    BadVersion {
        /// The version found.
        version: u16,
    },
    /// The header CRC does not match.
    #[error("segment record header checksum mismatch")]
    BadHeaderCrc,
    /// The header is intact but the header + payload CRC does not match.
    #[error("segment record checksum mismatch")]
    BadRecordCrc,
    /// A header field holds an unknown or inconsistent value.
    #[error("segment record field {field} is invalid")]
    BadField {
        /// Which field.
        field: Field,
    },
    /// A length is above the caller's limit.
    #[error("segment record {field} {len} exceeds limit {max}")]
    TooLarge {
        /// Which length.
        field: Field,
        /// The claimed length.
        len: u64,
        /// The limit it exceeds.
        max: u64,
    },
}

impl DecodeError {
    /// Stable short code for logs and incidents.
    pub const fn code(&self) -> &'static str {
        match self {
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::BadMagic => "bad_magic",
            DecodeError::BadVersion { .. } => "bad_version",
            DecodeError::BadHeaderCrc => "bad_header_crc",
            DecodeError::BadRecordCrc => "bad_record_crc",
            DecodeError::BadField { .. } => "bad_field",
            DecodeError::TooLarge { .. } => "too_large",
        }
    }
}

/// A record decoded from the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// The header fields.
    pub meta: RecordMeta,
    /// The stored payload (borrowed from the input; not decompressed).
    pub payload: &'a [u8],
    /// Whole record length (header + payload + trailing CRC).
    pub len: u64,
}

/// SHA-256 of a raw (uncompressed) payload: the record's content identity.
pub fn sha256(raw: &[u8]) -> [u8; 32] {
    let digest = Sha256::digest(raw);
    let mut out = [0u8; 32];
    for (o, b) in out.iter_mut().zip(digest.iter()) {
        *o = *b;
    }
    out
}

/// Length of an encoded record with `stored_len` payload bytes.
pub fn encoded_len(stored_len: u32) -> u64 {
    RECORD_OVERHEAD.saturating_add(u64::from(stored_len))
}

/// Largest stored length whose record still fits the 32-bit `record_len`.
const MAX_STORED_BY_FORMAT: u64 = u32::MAX as u64 - RECORD_OVERHEAD;

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Checks that kind, stream, audit identity and the compression/raw_len pair
/// agree. Shared by encode and decode so both accept exactly the same set.
fn check_meta(meta: &RecordMeta, stored_len: u32) -> Result<(), Field> {
    let stream_ok = match meta.kind {
        Kind::Output => meta.stream != Stream::None,
        _ => meta.stream == Stream::None,
    };
    if !stream_ok {
        return Err(Field::Stream);
    }
    if meta.kind == Kind::Audit && meta.issue_uuid != [0u8; 16] {
        return Err(Field::IssueUuid);
    }
    if meta.compression == Compression::None && meta.raw_len != stored_len {
        return Err(Field::RawLen);
    }
    Ok(())
}

/// Encodes one record. Does not compress and does not hash: the caller
/// passes the stored bytes, says how they are compressed, and supplies the
/// SHA-256 of the raw bytes in `meta`.
pub fn encode(
    meta: &RecordMeta,
    stored_payload: &[u8],
    limits: &Limits,
) -> Result<Vec<u8>, EncodeError> {
    let stored_len64 = len_u64(stored_payload.len());
    let max_stored = u64::from(limits.max_stored_len).min(MAX_STORED_BY_FORMAT);
    if stored_len64 > max_stored {
        return Err(EncodeError::TooLarge {
            field: Field::StoredLen,
            len: stored_len64,
            max: max_stored,
        });
    }
    if meta.raw_len > limits.max_raw_len {
        return Err(EncodeError::TooLarge {
            field: Field::RawLen,
            len: u64::from(meta.raw_len),
            max: u64::from(limits.max_raw_len),
        });
    }
    let stored_len = u32::try_from(stored_len64).map_err(|_| EncodeError::TooLarge {
        field: Field::StoredLen,
        len: stored_len64,
        max: max_stored,
    })?;
    check_meta(meta, stored_len).map_err(|field| EncodeError::BadField { field })?;
    let record_len64 = encoded_len(stored_len);
    let record_len = u32::try_from(record_len64).map_err(|_| EncodeError::TooLarge {
        field: Field::RecordLen,
        len: record_len64,
        max: u64::from(u32::MAX),
    })?;
    let capacity = usize::try_from(record_len64).map_err(|_| EncodeError::TooLarge {
        field: Field::RecordLen,
        len: record_len64,
        max: len_u64(usize::MAX),
    })?;

    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
    out.extend_from_slice(&record_len.to_le_bytes());
    out.extend_from_slice(&meta.issue_uuid);
    out.extend_from_slice(&meta.seq.to_le_bytes());
    out.extend_from_slice(&meta.observed_unix_ms.to_le_bytes());
    out.extend_from_slice(&meta.receipt_unix_ms.to_le_bytes());
    out.push(meta.kind.as_u8());
    out.push(meta.stream.as_u8());
    out.push(meta.compression.as_u8());
    out.push(0); // flags
    out.extend_from_slice(&meta.raw_len.to_le_bytes());
    out.extend_from_slice(&stored_len.to_le_bytes());
    out.extend_from_slice(&meta.sha256);
    out.extend_from_slice(&[0u8; RESERVED_LEN]);
    let header_crc = crc32c::crc32c(&out);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(stored_payload);
    let record_crc = crc32c::crc32c(&out);
    out.extend_from_slice(&record_crc.to_le_bytes());
    Ok(out)
}

/// Copies `N` bytes starting at `at` (zero-filled past the end; callers only
/// read inside the fixed header).
fn take<const N: usize>(h: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    for (o, b) in out.iter_mut().zip(h.iter().skip(at)) {
        *o = *b;
    }
    out
}

fn byte_at(h: &[u8], at: usize) -> u8 {
    h.get(at).copied().unwrap_or(0)
}

/// A header that passed every check that needs only the header bytes.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) meta: RecordMeta,
    pub(crate) stored_len: u32,
    /// Whole record length (== header + stored + trailer, verified).
    pub(crate) record_len: u64,
}

/// Validates the fixed header at the start of `buf`: everything except the
/// record CRC and whether the buffer holds the whole record. A header that
/// passes is trusted (its CRC verified), so its `record_len` gives the
/// record's exact extent even when the payload is damaged.
pub(crate) fn parse_header(buf: &[u8], limits: &Limits) -> Result<Header, DecodeError> {
    let have = len_u64(buf.len());
    // Compare the magic on whatever prefix exists, so short garbage reports
    // BadMagic while a torn valid record reports Truncated.
    let magic_ok = MAGIC.iter().zip(buf.iter()).all(|(m, b)| m == b);
    if !magic_ok {
        return Err(DecodeError::BadMagic);
    }
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN as u64,
            have,
        });
    };
    let version = u16::from_le_bytes(take(h, OFF_VERSION));
    if version != VERSION {
        return Err(DecodeError::BadVersion { version });
    }
    if u16::from_le_bytes(take(h, OFF_HEADER_LEN)) != HEADER_LEN as u16 {
        return Err(DecodeError::BadField {
            field: Field::HeaderLen,
        });
    }
    let crc_input = h.get(..OFF_HEADER_CRC).unwrap_or(&[]);
    if crc32c::crc32c(crc_input) != u32::from_le_bytes(take(h, OFF_HEADER_CRC)) {
        return Err(DecodeError::BadHeaderCrc);
    }
    let kind =
        Kind::from_u8(byte_at(h, OFF_KIND)).ok_or(DecodeError::BadField { field: Field::Kind })?;
    let stream = Stream::from_u8(byte_at(h, OFF_STREAM)).ok_or(DecodeError::BadField {
        field: Field::Stream,
    })?;
    let compression =
        Compression::from_u8(byte_at(h, OFF_COMPRESSION)).ok_or(DecodeError::BadField {
            field: Field::Compression,
        })?;
    if byte_at(h, OFF_FLAGS) != 0 {
        return Err(DecodeError::BadField {
            field: Field::Flags,
        });
    }
    if take::<RESERVED_LEN>(h, OFF_RESERVED) != [0u8; RESERVED_LEN] {
        return Err(DecodeError::BadField {
            field: Field::Reserved,
        });
    }
    let raw_len = u32::from_le_bytes(take(h, OFF_RAW_LEN));
    let stored_len = u32::from_le_bytes(take(h, OFF_STORED_LEN));
    // R-5.3-05: lengths against the configured maxima before anything uses them.
    if stored_len > limits.max_stored_len {
        return Err(DecodeError::TooLarge {
            field: Field::StoredLen,
            len: u64::from(stored_len),
            max: u64::from(limits.max_stored_len),
        });
    }
    if raw_len > limits.max_raw_len {
        return Err(DecodeError::TooLarge {
            field: Field::RawLen,
            len: u64::from(raw_len),
            max: u64::from(limits.max_raw_len),
        });
    }
    let record_len = u64::from(u32::from_le_bytes(take(h, OFF_RECORD_LEN)));
    if record_len != encoded_len(stored_len) {
        return Err(DecodeError::BadField {
            field: Field::RecordLen,
        });
    }
    let meta = RecordMeta {
        issue_uuid: take(h, OFF_ISSUE_UUID),
        seq: u64::from_le_bytes(take(h, OFF_SEQ)),
        observed_unix_ms: i64::from_le_bytes(take(h, OFF_OBSERVED)),
        receipt_unix_ms: i64::from_le_bytes(take(h, OFF_RECEIPT)),
        kind,
        stream,
        compression,
        raw_len,
        sha256: take(h, OFF_SHA256),
    };
    check_meta(&meta, stored_len).map_err(|field| DecodeError::BadField { field })?;
    Ok(Header {
        meta,
        stored_len,
        record_len,
    })
}

/// Decodes the record at the start of `buf` (trailing bytes are ignored).
pub fn decode<'a>(buf: &'a [u8], limits: &Limits) -> Result<Decoded<'a>, DecodeError> {
    let header = parse_header(buf, limits)?;
    let have = len_u64(buf.len());
    let truncated = DecodeError::Truncated {
        needed: header.record_len,
        have,
    };
    let record_len = usize::try_from(header.record_len).map_err(|_| truncated.clone())?;
    let record = buf.get(..record_len).ok_or(truncated)?;
    let body_len =
        HEADER_LEN.saturating_add(usize::try_from(header.stored_len).unwrap_or(usize::MAX));
    let (body, trailer) = record
        .split_at_checked(body_len)
        .ok_or(DecodeError::BadRecordCrc)?;
    if crc32c::crc32c(body) != u32::from_le_bytes(take(trailer, 0)) {
        return Err(DecodeError::BadRecordCrc);
    }
    let payload = body.get(HEADER_LEN..).unwrap_or(&[]);
    Ok(Decoded {
        meta: header.meta,
        payload,
        len: header.record_len,
    })
}
