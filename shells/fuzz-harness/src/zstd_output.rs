//! Target `zstd_output`: the validation every store backend applies to a
//! client's output chunk before it is stored (`rvbox_store::events::
//! check_output`: the declared raw length within the limit, the stored
//! length within the compression bound, bounded decompression that never
//! allocates past the declared raw length, the decompressed length, the
//! SHA-256 of the raw bytes).
//!
//! Two ways in, chosen by the first byte: arbitrary stored bytes with a
//! declared raw length and compression, or raw bytes compressed here (so
//! the fuzzer starts from real frames) then optionally damaged (one byte
//! changed, or the declared length moved). Checks:
//!
//! - no panic; a refusal is `PROTOCOL_ERROR` with a reason;
//! - an accepted chunk's digest is the SHA-256 of exactly `raw_len` raw
//!   bytes, which a fresh decompressor agrees with;
//! - a reused decompression context (as the store keeps one) gives the
//!   same verdict as a fresh one, also after it failed on other bytes;
//! - an undamaged compressed chunk with its true length is accepted with
//!   the digest of its raw bytes.

use rvbox_domain::error::Code;
use rvbox_segment::{Compression, sha256};
use rvbox_store::events::check_output;

use crate::Source;

fn dctx() -> zstd::bulk::Decompressor<'static> {
    zstd::bulk::Decompressor::new().expect("a decompression context")
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut src = Source::new(data);
    let mode = src.u8();
    let limits = rvbox_store::store::record_limits();
    let (compression, raw_len, stored, expect) = if mode & 1 == 0 {
        let compression = if mode & 2 == 0 {
            Compression::Zstd
        } else {
            Compression::None
        };
        let raw_len = src.u32() % limits.max_raw_len.saturating_add(2);
        (compression, raw_len, src.rest().to_vec(), None)
    } else {
        let level = i32::from(src.u8() % 4);
        let damage = src.u8();
        let at = usize::from(src.u16());
        let flip = src.u8() | 1;
        let delta = i64::from(src.u8() as i8);
        let raw = src.rest().to_vec();
        let mut stored = zstd::bulk::compress(&raw, level).expect("compression of fuzz bytes");
        let mut raw_len = u32::try_from(raw.len()).unwrap_or(u32::MAX);
        let mut clean = true;
        if damage & 0x0f == 1 && !stored.is_empty() {
            let i = at % stored.len();
            if let Some(b) = stored.get_mut(i) {
                *b ^= flip;
            }
            clean = false;
        }
        if damage & 0xf0 == 0x10 && delta != 0 {
            raw_len = u32::try_from(i64::from(raw_len).saturating_add(delta).max(0)).unwrap_or(0);
            clean = false;
        }
        let expect = (clean && raw.len() <= limits.max_raw_len as usize).then(|| sha256(&raw));
        (Compression::Zstd, raw_len, stored, expect)
    };

    let mut reused = dctx();
    let first = check_output(&mut reused, compression, raw_len, &stored);
    let again = check_output(&mut reused, compression, raw_len, &stored);
    assert_eq!(first, again, "a reused context gives the same verdict");
    // a context that last failed on a cut-short copy of the same bytes
    let mut after_failure = dctx();
    let cut = stored.get(..stored.len() / 2).unwrap_or(&[]);
    let _ = check_output(&mut after_failure, compression, raw_len, cut);
    let third = check_output(&mut after_failure, compression, raw_len, &stored);
    assert_eq!(
        first, third,
        "a context that failed before gives the same verdict"
    );

    match &first {
        Ok(digest) => {
            assert!(
                raw_len <= limits.max_raw_len,
                "an accepted chunk is within the raw limit"
            );
            let raw = match compression {
                Compression::None => stored.clone(),
                Compression::Zstd => zstd::bulk::decompress(&stored, raw_len as usize)
                    .expect("an accepted chunk decompresses with a fresh context"),
            };
            assert_eq!(
                raw.len(),
                raw_len as usize,
                "an accepted chunk has its declared length"
            );
            assert_eq!(*digest, sha256(&raw), "the digest is that of the raw bytes");
        }
        Err(e) => {
            assert_eq!(
                e.code(),
                Code::ProtocolError,
                "a refused chunk is a protocol error"
            );
            assert!(!e.to_string().is_empty(), "a refusal says why");
        }
    }
    if let Some(want) = expect {
        assert_eq!(
            first,
            Ok(want),
            "an undamaged chunk with its true length is accepted"
        );
    }
}
