#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Record encode/decode: round trips, every bit flip, every truncation,
//! every invalid field, limits before allocation.

mod common;

use common::{LIMITS, UUID, crc32c_of, meta, payload, record, reseal_header, reseal_record};
use rvbox_segment::{
    Compression, DecodeError, EncodeError, Field, HEADER_LEN, Kind, Limits, MAGIC, RECORD_OVERHEAD,
    RecordMeta, Stream, VERSION, decode, encode, encoded_len, sha256,
};

#[test]
fn round_trip_every_kind_stream_compression() {
    let mut valid = 0;
    for kind in Kind::ALL {
        for stream in Stream::ALL {
            for compression in Compression::ALL {
                for len in [0usize, 1, 37, 300] {
                    let stored = payload(u64::from(kind.as_u8()), len);
                    let raw_len = match compression {
                        Compression::None => len as u32,
                        Compression::Zstd => len as u32 * 3 + 5,
                    };
                    let m = RecordMeta {
                        issue_uuid: if kind == Kind::Audit { [0; 16] } else { UUID },
                        seq: u64::MAX - u64::from(kind.as_u8()),
                        observed_unix_ms: -5,
                        receipt_unix_ms: i64::MAX,
                        kind,
                        stream,
                        compression,
                        raw_len,
                        sha256: sha256(b"raw bytes"),
                    };
                    let stream_ok = (kind == Kind::Output) == (stream != Stream::None);
                    let res = encode(&m, &stored, &LIMITS);
                    if !stream_ok {
                        assert_eq!(
                            res,
                            Err(EncodeError::BadField {
                                field: Field::Stream
                            })
                        );
                        continue;
                    }
                    let bytes = res.unwrap();
                    assert_eq!(bytes.len() as u64, encoded_len(len as u32));
                    let d = decode(&bytes, &LIMITS).unwrap();
                    assert_eq!(d.meta, m);
                    assert_eq!(d.payload, &stored[..]);
                    assert_eq!(d.len, bytes.len() as u64);
                    valid += 1;
                }
            }
        }
    }
    // 6 kinds x 2 compressions x 4 lengths, Output twice (two streams).
    assert_eq!(valid, 7 * 2 * 4);
}

#[test]
fn enum_codes_round_trip_and_reject_unknown() {
    for v in 0..=255u8 {
        assert_eq!(
            Kind::from_u8(v).map(Kind::as_u8),
            (1..=6).contains(&v).then_some(v)
        );
        assert_eq!(Stream::from_u8(v).map(Stream::as_u8), (v <= 2).then_some(v));
        assert_eq!(
            Compression::from_u8(v).map(Compression::as_u8),
            (v <= 1).then_some(v)
        );
    }
}

#[test]
fn layout_matches_the_documented_table() {
    let p = b"hello";
    let m = meta(Kind::Output, 0x0102_0304_0506_0708, p);
    let r = encode(&m, p, &LIMITS).unwrap();
    assert_eq!(&r[0..4], &MAGIC);
    assert_eq!(u16::from_le_bytes([r[4], r[5]]), VERSION);
    assert_eq!(u16::from_le_bytes([r[6], r[7]]), 128);
    assert_eq!(
        u32::from_le_bytes(r[8..12].try_into().unwrap()),
        128 + 5 + 4
    );
    assert_eq!(&r[12..28], &UUID);
    assert_eq!(u64::from_le_bytes(r[28..36].try_into().unwrap()), m.seq);
    assert_eq!(
        i64::from_le_bytes(r[36..44].try_into().unwrap()),
        m.observed_unix_ms
    );
    assert_eq!(
        i64::from_le_bytes(r[44..52].try_into().unwrap()),
        m.receipt_unix_ms
    );
    assert_eq!(r[52], 1);
    assert_eq!(r[53], m.stream.as_u8());
    assert_eq!(r[54], 0);
    assert_eq!(r[55], 0);
    assert_eq!(u32::from_le_bytes(r[56..60].try_into().unwrap()), 5);
    assert_eq!(u32::from_le_bytes(r[60..64].try_into().unwrap()), 5);
    assert_eq!(&r[64..96], &sha256(p));
    assert!(r[96..124].iter().all(|b| *b == 0));
    assert_eq!(
        u32::from_le_bytes(r[124..128].try_into().unwrap()),
        crc32c_of(&r[..124])
    );
    assert_eq!(&r[128..133], p);
    assert_eq!(
        u32::from_le_bytes(r[133..137].try_into().unwrap()),
        crc32c_of(&r[..133])
    );
    assert_eq!(r.len(), 137);
    assert_eq!(HEADER_LEN, 128);
    assert_eq!(RECORD_OVERHEAD, 132);
    assert_eq!(encoded_len(0), 132);
    assert_eq!(encoded_len(u32::MAX), 132 + u64::from(u32::MAX));
}

#[test]
fn sha256_matches_known_vectors() {
    let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(
        hex(sha256(b"abc")),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert_eq!(
        hex(sha256(b"")),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}

#[test]
fn decode_reads_only_the_first_record() {
    let (m, mut bytes) = record(9, 20);
    let len = bytes.len();
    bytes.extend_from_slice(b"anything after the record");
    let d = decode(&bytes, &LIMITS).unwrap();
    assert_eq!(d.meta, m);
    assert_eq!(d.len, len as u64);
}

/// Flipping any bit (and any whole byte) anywhere in a record is detected;
/// header bytes fail on the check that covers them, payload and trailer
/// bytes fail the record CRC.
#[test]
fn every_single_byte_flip_is_detected() {
    for kind in [Kind::Output, Kind::Audit] {
        let p = payload(3, 40);
        let m = meta(kind, 3, &p);
        let rec = encode(&m, &p, &LIMITS).unwrap();
        let mut checked = 0;
        for i in 0..rec.len() {
            for mask in [1u8, 2, 4, 8, 16, 32, 64, 128, 0xff] {
                let mut bad = rec.clone();
                bad[i] ^= mask;
                let err = decode(&bad, &LIMITS).unwrap_err();
                let expected_code = match i {
                    0..4 => "bad_magic",
                    4..6 => "bad_version",
                    6..8 => "bad_field",
                    8..128 => "bad_header_crc",
                    _ => "bad_record_crc",
                };
                assert_eq!(
                    err.code(),
                    expected_code,
                    "byte {i} mask {mask:#x}: {err:?}"
                );
                checked += 1;
            }
        }
        assert_eq!(checked, rec.len() * 9);
    }
}

#[test]
fn truncation_at_every_length_is_truncated() {
    let (_, rec) = record(5, 77);
    for l in 0..rec.len() {
        let needed = if l < HEADER_LEN {
            128
        } else {
            rec.len() as u64
        };
        assert_eq!(
            decode(&rec[..l], &LIMITS),
            Err(DecodeError::Truncated {
                needed,
                have: l as u64
            }),
            "length {l}"
        );
    }
    assert!(decode(&rec, &LIMITS).is_ok());
}

#[test]
fn short_garbage_is_bad_magic_not_truncated() {
    assert_eq!(decode(b"X", &LIMITS), Err(DecodeError::BadMagic));
    assert_eq!(decode(b"RVSx", &LIMITS), Err(DecodeError::BadMagic));
    assert_eq!(decode(&[0u8; 200], &LIMITS), Err(DecodeError::BadMagic));
}

/// A header with a valid CRC that claims a huge payload is refused on the
/// limit check, from the 128 header bytes alone: decode borrows its payload
/// and never allocates, and no length is used before this check.
#[test]
fn huge_stored_len_with_valid_header_crc_is_too_large() {
    let (_, rec) = record(1, 10);
    let mut h = rec[..128].to_vec();
    h[60..64].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal_header(&mut h);
    assert_eq!(
        decode(&h, &LIMITS),
        Err(DecodeError::TooLarge {
            field: Field::StoredLen,
            len: u64::from(u32::MAX),
            max: u64::from(LIMITS.max_stored_len),
        })
    );
    // Even with limits at the maximum, a u32::MAX payload cannot have a
    // consistent 32-bit record_len, and nothing past the header is read.
    let open = Limits {
        max_stored_len: u32::MAX,
        max_raw_len: u32::MAX,
    };
    assert_eq!(
        decode(&h, &open),
        Err(DecodeError::BadField {
            field: Field::RecordLen
        })
    );
    // raw_len above its limit.
    let mut h2 = rec[..128].to_vec();
    h2[56..60].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal_header(&mut h2);
    assert_eq!(
        decode(&h2, &LIMITS),
        Err(DecodeError::TooLarge {
            field: Field::RawLen,
            len: u64::from(u32::MAX),
            max: u64::from(LIMITS.max_raw_len),
        })
    );
}

#[test]
fn limits_are_exact_on_decode() {
    let (_, rec) = record(1, 10);
    let exact = Limits {
        max_stored_len: 10,
        max_raw_len: 10,
    };
    assert!(decode(&rec, &exact).is_ok());
    let one_less = Limits {
        max_stored_len: 9,
        max_raw_len: 10,
    };
    assert_eq!(decode(&rec, &one_less).unwrap_err().code(), "too_large");
    let raw_less = Limits {
        max_stored_len: 10,
        max_raw_len: 9,
    };
    assert_eq!(
        decode(&rec, &raw_less),
        Err(DecodeError::TooLarge {
            field: Field::RawLen,
            len: 10,
            max: 9
        })
    );
}

/// Every invalid header value is rejected even when the header CRC was
/// recomputed over it (a writer bug, not a bit flip).
#[test]
fn invalid_fields_with_valid_crc_are_rejected() {
    let (_, rec) = record(2, 16);
    type Edit = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Edit, DecodeError)> = vec![
        (
            "kind 0",
            Box::new(|r| r[52] = 0),
            DecodeError::BadField { field: Field::Kind },
        ),
        (
            "kind 7",
            Box::new(|r| r[52] = 7),
            DecodeError::BadField { field: Field::Kind },
        ),
        (
            "kind 255",
            Box::new(|r| r[52] = 255),
            DecodeError::BadField { field: Field::Kind },
        ),
        (
            "stream 3",
            Box::new(|r| r[53] = 3),
            DecodeError::BadField {
                field: Field::Stream,
            },
        ),
        (
            "output stream none",
            Box::new(|r| r[53] = 0),
            DecodeError::BadField {
                field: Field::Stream,
            },
        ),
        (
            "event with stream",
            Box::new(|r| r[52] = Kind::Event.as_u8()),
            DecodeError::BadField {
                field: Field::Stream,
            },
        ),
        (
            "audit with uuid",
            Box::new(|r| {
                r[52] = Kind::Audit.as_u8();
                r[53] = 0;
            }),
            DecodeError::BadField {
                field: Field::IssueUuid,
            },
        ),
        (
            "compression 2",
            Box::new(|r| r[54] = 2),
            DecodeError::BadField {
                field: Field::Compression,
            },
        ),
        (
            "flags",
            Box::new(|r| r[55] = 1),
            DecodeError::BadField {
                field: Field::Flags,
            },
        ),
        (
            "raw != stored uncompressed",
            Box::new(|r| r[56..60].copy_from_slice(&17u32.to_le_bytes())),
            DecodeError::BadField {
                field: Field::RawLen,
            },
        ),
        (
            "record_len + 1",
            Box::new(|r| r[8..12].copy_from_slice(&(128u32 + 16 + 4 + 1).to_le_bytes())),
            DecodeError::BadField {
                field: Field::RecordLen,
            },
        ),
        (
            "record_len - 1",
            Box::new(|r| r[8..12].copy_from_slice(&(128u32 + 16 + 3).to_le_bytes())),
            DecodeError::BadField {
                field: Field::RecordLen,
            },
        ),
        (
            "header_len 64",
            Box::new(|r| r[6..8].copy_from_slice(&64u16.to_le_bytes())),
            DecodeError::BadField {
                field: Field::HeaderLen,
            },
        ),
        (
            "version 2",
            Box::new(|r| r[4..6].copy_from_slice(&2u16.to_le_bytes())),
            DecodeError::BadVersion { version: 2 },
        ),
        (
            "version 0",
            Box::new(|r| r[4..6].copy_from_slice(&0u16.to_le_bytes())),
            DecodeError::BadVersion { version: 0 },
        ),
    ];
    for (name, edit, expected) in cases {
        let mut bad = rec.clone();
        edit(&mut bad);
        reseal_header(&mut bad);
        reseal_record(&mut bad);
        assert_eq!(decode(&bad, &LIMITS), Err(expected), "{name}");
    }
    for i in 96..124 {
        let mut bad = rec.clone();
        bad[i] = 0x80;
        reseal_header(&mut bad);
        reseal_record(&mut bad);
        assert_eq!(
            decode(&bad, &LIMITS),
            Err(DecodeError::BadField {
                field: Field::Reserved
            }),
            "reserved byte {i}"
        );
    }
}

#[test]
fn encode_refuses_limits_and_inconsistent_meta() {
    let p = payload(1, 11);
    let m = meta(Kind::Script, 1, &p);
    let tight = Limits {
        max_stored_len: 10,
        max_raw_len: 100,
    };
    assert_eq!(
        encode(&m, &p, &tight),
        Err(EncodeError::TooLarge {
            field: Field::StoredLen,
            len: 11,
            max: 10
        })
    );
    let raw_tight = Limits {
        max_stored_len: 100,
        max_raw_len: 10,
    };
    assert_eq!(
        encode(&m, &p, &raw_tight),
        Err(EncodeError::TooLarge {
            field: Field::RawLen,
            len: 11,
            max: 10
        })
    );
    let exact = Limits {
        max_stored_len: 11,
        max_raw_len: 11,
    };
    assert!(encode(&m, &p, &exact).is_ok());

    let mut wrong_raw = m.clone();
    wrong_raw.raw_len = 12;
    assert_eq!(
        encode(&wrong_raw, &p, &LIMITS),
        Err(EncodeError::BadField {
            field: Field::RawLen
        })
    );
    let mut zstd = wrong_raw.clone();
    zstd.compression = Compression::Zstd;
    assert!(encode(&zstd, &p, &LIMITS).is_ok());

    let mut audit = meta(Kind::Audit, 1, &p);
    audit.issue_uuid = UUID;
    assert_eq!(
        encode(&audit, &p, &LIMITS),
        Err(EncodeError::BadField {
            field: Field::IssueUuid
        })
    );
    let mut out = meta(Kind::Output, 1, &p);
    out.stream = Stream::None;
    assert_eq!(
        encode(&out, &p, &LIMITS),
        Err(EncodeError::BadField {
            field: Field::Stream
        })
    );
    let mut spec = meta(Kind::Spec, 1, &p);
    spec.stream = Stream::Stderr;
    assert_eq!(
        encode(&spec, &p, &LIMITS),
        Err(EncodeError::BadField {
            field: Field::Stream
        })
    );
}

#[test]
fn error_codes_are_stable_and_messages_carry_no_payload() {
    let errors = [
        (DecodeError::Truncated { needed: 1, have: 0 }, "truncated"),
        (DecodeError::BadMagic, "bad_magic"),
        (DecodeError::BadVersion { version: 9 }, "bad_version"),
        (DecodeError::BadHeaderCrc, "bad_header_crc"),
        (DecodeError::BadRecordCrc, "bad_record_crc"),
        (
            DecodeError::BadField {
                field: Field::Flags,
            },
            "bad_field",
        ),
        (
            DecodeError::TooLarge {
                field: Field::StoredLen,
                len: 2,
                max: 1,
            },
            "too_large",
        ),
    ];
    for (e, code) in errors {
        assert_eq!(e.code(), code);
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(
        DecodeError::TooLarge {
            field: Field::StoredLen,
            len: 2,
            max: 1
        }
        .to_string(),
        "segment record stored_len 2 exceeds limit 1"
    );
    assert_eq!(
        EncodeError::BadField { field: Field::Kind }.code(),
        "bad_field"
    );
    assert_eq!(
        EncodeError::TooLarge {
            field: Field::RawLen,
            len: 2,
            max: 1
        }
        .code(),
        "too_large"
    );
    // A corrupted record's error names no payload byte.
    let (_, mut rec) = record(4, 8);
    let n = rec.len();
    rec[n - 5] ^= 1;
    let msg = decode(&rec, &LIMITS).unwrap_err().to_string();
    assert_eq!(msg, "segment record checksum mismatch");
}
