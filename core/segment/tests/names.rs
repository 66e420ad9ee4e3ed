#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Canonical segment and audit file names (plan §5.1, R-5.3-03).

use rvbox_segment::{
    MAX_AUDIT_ORDINAL, MAX_SEGMENT_ORDINAL, audit_file_name, parse_audit_file_name,
    parse_segment_file_name, segment_file_name,
};

const UUID: [u8; 16] = [
    0x01, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x7a, 0xbc, 0x80, 0x00, 0x12, 0x34, 0x56, 0x78, 0x80, 0x57,
];
const CANON: &str = "0189abcdef017abc8000123456788057-00000001.seg";

#[test]
fn segment_name_is_canonical_and_round_trips() {
    assert_eq!(segment_file_name(&UUID, 1).unwrap(), CANON);
    assert_eq!(parse_segment_file_name(CANON), Some((UUID, 1)));
    for (uuid, ord) in [
        ([0u8; 16], 0u32),
        ([0xffu8; 16], MAX_SEGMENT_ORDINAL),
        (UUID, 42),
        (core::array::from_fn(|i| i as u8 * 17), 12_345_678),
    ] {
        let name = segment_file_name(&uuid, ord).unwrap();
        assert_eq!(name.len(), 45);
        assert_eq!(parse_segment_file_name(&name), Some((uuid, ord)), "{name}");
    }
    assert_eq!(segment_file_name(&UUID, MAX_SEGMENT_ORDINAL + 1), None);
    assert_eq!(segment_file_name(&UUID, u32::MAX), None);
}

#[test]
fn non_canonical_segment_names_are_rejected() {
    let bad = [
        "",
        ".seg",
        "0189ABCDEF017ABC8000123456788057-00000001.seg", // uppercase hex
        "0189abcdef017abc8000123456788057-00000001.SEG", // uppercase suffix
        "0189abcdef017abc800012345678805-00000001.seg",  // 31 hex
        "0189abcdef017abc8000123456788057a-00000001.seg", // 33 hex
        "0189abcdef017abc8000123456788057-0000001.seg",  // 7 digits
        "0189abcdef017abc8000123456788057-000000001.seg", // 9 digits
        "0189abcdef017abc8000123456788057-00000001.seg.tmp", // extra suffix
        "0189abcdef017abc8000123456788057-00000001.segx",
        "0189abcdef017abc8000123456788057-00000001",
        "0189abcdef017abc8000123456788057_00000001.seg",
        "0189abcd-ef01-7abc-8000-123456788057-00000001.seg", // hyphenated uuid
        "0189abcdef017abc8000123456788057--0000001.seg",
        "0189abcdef017abc8000123456788057-+0000001.seg",
        "0189abcdef017abc8000123456788057- 0000001.seg",
        "0189abcdef017abc8000123456788057-0000000a.seg",
        "0189abcdef017abc8000123456788g57-00000001.seg", // non-hex
        "../89abcdef017abc8000123456788057-00000001.seg",
        "0189abcdef017abc80001234/6788057-00000001.seg",
        "0189abcdef017abc80001234\\6788057-00000001.seg",
        "/0189abcdef017abc8000123456788057-00000001.seg",
        "0189abcdef017abc8000123456788057-00000001.seg/",
        " 0189abcdef017abc8000123456788057-00000001.seg",
        "0189abcdef017abc8000123456788057-00000001.seg\0",
        "0189abcdef017abc8000123456788057-0000000\u{0661}.seg", // non-ASCII digit
        "0189abcdef017abc80001234567880\u{e9}-00000001.seg",
        "audit-0000000000000001.seg",
    ];
    for name in bad {
        assert_eq!(parse_segment_file_name(name), None, "{name:?}");
    }
    // Every single-character substitution of the canonical name either
    // parses to a name that prints back identically, or is rejected.
    for i in 0..CANON.len() {
        for c in ['A', 'F', 'g', '/', '.', '-', '0', '9', 'a', ' ', 'S'] {
            let mut s = CANON.to_string();
            s.replace_range(i..=i, c.encode_utf8(&mut [0; 4]));
            if let Some((u, o)) = parse_segment_file_name(&s) {
                assert_eq!(segment_file_name(&u, o).unwrap(), s);
            }
        }
    }
}

#[test]
fn audit_name_is_canonical_and_round_trips() {
    assert_eq!(audit_file_name(1).unwrap(), "audit-0000000000000001.seg");
    for ord in [0u64, 1, 99, 1_234_567_890_123, MAX_AUDIT_ORDINAL] {
        let name = audit_file_name(ord).unwrap();
        assert_eq!(name.len(), 26);
        assert_eq!(parse_audit_file_name(&name), Some(ord));
    }
    assert_eq!(audit_file_name(MAX_AUDIT_ORDINAL + 1), None);
    assert_eq!(audit_file_name(u64::MAX), None);
}

#[test]
fn non_canonical_audit_names_are_rejected() {
    let bad = [
        "",
        "audit-.seg",
        "audit-000000000000001.seg",   // 15 digits
        "audit-00000000000000001.seg", // 17 digits
        "AUDIT-0000000000000001.seg",
        "audit-0000000000000001.SEG",
        "audit-0000000000000001.seg.bak",
        "audit_0000000000000001.seg",
        "audit-+000000000000001.seg",
        "audit--000000000000001.seg",
        "audit-000000000000000a.seg",
        "audit-00000000/0000001.seg",
        "../audit-0000000000000001.seg",
        "xaudit-0000000000000001.seg",
        "audit-0000000000000001",
        CANON,
    ];
    for name in bad {
        assert_eq!(parse_audit_file_name(name), None, "{name:?}");
    }
}
