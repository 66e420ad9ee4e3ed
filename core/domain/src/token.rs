//! Versioned, authenticated page and output tokens (plan §9.1).
//!
//! A token is opaque to callers. It carries a stable position (a sort key,
//! or command / event sequence / byte offset / snapshot boundary) and is
//! bound to the query filters it was issued for: reusing it with other
//! filters is refused, and so is a token signed by another key (each data
//! directory generates its own key once) or altered in any byte.
//!
//! Layout before base64url (no padding):
//! `version:u8 | kind:u8 | filter_digest:[u8;16] | len:u16be | position | mac:[u8;32]`
//! where `mac = HMAC-SHA256(key, everything before it)`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Current token format version.
pub const TOKEN_VERSION: u8 = 1;
/// Longest token text accepted (checked before decoding).
pub const MAX_TOKEN_CHARS: usize = 1024;
/// Longest encoded position a token may carry.
pub const MAX_POSITION_BYTES: usize = 512;

const DIGEST_LEN: usize = 16;
const MAC_LEN: usize = 32;
const HEADER_LEN: usize = 1 + 1 + DIGEST_LEN + 2;

/// What a token pages through; a token of one kind is refused for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// `ListClients`.
    ClientPage = 1,
    /// `ListCommands`.
    CommandPage = 2,
    /// `ListStorageIncidents`.
    IncidentPage = 3,
    /// `GetOutput`.
    Output = 4,
    /// `ListFleetRuns`.
    FleetRunPage = 5,
    /// `ListFleetTargets`.
    FleetTargetPage = 6,
    /// `ListPtySessions`.
    PtyPage = 7,
}

/// A refused token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TokenError {
    /// Empty, too long, not base64url, or too short to hold a token.
    #[error("page_token is malformed: {0}")]
    Malformed(&'static str),
    /// Issued by an incompatible RVBox version.
    #[error("page_token has format version {0}; this server reads version {TOKEN_VERSION}")]
    Version(u8),
    /// Signed by another key (another data directory) or altered.
    #[error("page_token was not issued by this server or was altered")]
    Forged,
    /// Issued for another RPC.
    #[error("page_token was issued for another listing")]
    WrongKind,
    /// Reused with filters other than those it was issued for.
    #[error("page_token was issued for different query filters; start again without a token")]
    FilterMismatch,
}

/// The secret that authenticates tokens: 32 random bytes generated once into
/// the data directory by the shell.
#[derive(Clone)]
pub struct TokenKey([u8; 32]);

impl TokenKey {
    /// Wraps key bytes.
    #[must_use]
    pub fn new(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(<redacted>)")
    }
}

/// Canonical encoding of query filters: each `(name, value)` pair,
/// length-prefixed, in the order given (callers list them in a fixed order).
#[must_use]
pub fn encode_filters(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u64).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u64).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

fn filter_digest(filters: &[u8]) -> [u8; DIGEST_LEN] {
    let full = Sha256::digest(filters);
    let mut out = [0u8; DIGEST_LEN];
    for (o, b) in out.iter_mut().zip(full.iter()) {
        *o = *b;
    }
    out
}

fn mac(key: &TokenKey) -> Result<Hmac<Sha256>, TokenError> {
    // HMAC takes keys of any length; an error here is unreachable, and is
    // reported as a refused token rather than a panic.
    <Hmac<Sha256> as KeyInit>::new_from_slice(&key.0).map_err(|_| TokenError::Forged)
}

/// Seals and opens tokens with one key.
#[derive(Debug, Clone)]
pub struct TokenCodec {
    key: TokenKey,
}

impl TokenCodec {
    /// A codec for `key`.
    #[must_use]
    pub fn new(key: TokenKey) -> Self {
        Self { key }
    }

    /// Issues a token for `position` under `filters`.
    ///
    /// # Errors
    /// [`TokenError::Malformed`] when the position is longer than
    /// [`MAX_POSITION_BYTES`] (a caller bug, reported rather than truncated).
    pub fn seal(
        &self,
        kind: TokenKind,
        filters: &[u8],
        position: &[u8],
    ) -> Result<String, TokenError> {
        if position.len() > MAX_POSITION_BYTES {
            return Err(TokenError::Malformed("position too long"));
        }
        let len = u16::try_from(position.len())
            .map_err(|_| TokenError::Malformed("position too long"))?;
        let mut body = Vec::with_capacity(HEADER_LEN + position.len() + MAC_LEN);
        body.push(TOKEN_VERSION);
        body.push(kind as u8);
        body.extend_from_slice(&filter_digest(filters));
        body.extend_from_slice(&len.to_be_bytes());
        body.extend_from_slice(position);
        let mut m = mac(&self.key)?;
        m.update(&body);
        body.extend_from_slice(&m.finalize().into_bytes());
        Ok(URL_SAFE_NO_PAD.encode(body))
    }

    /// Checks a token and returns its position.
    ///
    /// # Errors
    /// [`TokenError`] saying exactly why the token is refused.
    pub fn open(
        &self,
        kind: TokenKind,
        filters: &[u8],
        token: &str,
    ) -> Result<Vec<u8>, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Malformed("empty"));
        }
        if token.len() > MAX_TOKEN_CHARS {
            return Err(TokenError::Malformed("too long"));
        }
        let raw = URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| TokenError::Malformed("not base64url"))?;
        let Some((body, tag)) = raw.split_at_checked(raw.len().saturating_sub(MAC_LEN)) else {
            return Err(TokenError::Malformed("truncated"));
        };
        if body.len() < HEADER_LEN || tag.len() != MAC_LEN {
            return Err(TokenError::Malformed("truncated"));
        }
        let version = body.first().copied().unwrap_or_default();
        if version != TOKEN_VERSION {
            return Err(TokenError::Version(version));
        }
        let mut m = mac(&self.key)?;
        m.update(body);
        m.verify_slice(tag).map_err(|_| TokenError::Forged)?;
        let (header, position) = body.split_at(HEADER_LEN);
        let mut digest = [0u8; DIGEST_LEN];
        for (d, b) in digest.iter_mut().zip(header.iter().skip(2)) {
            *d = *b;
        }
        let declared = header.get(2 + DIGEST_LEN..HEADER_LEN).map_or(0, |b| {
            b.iter().fold(0usize, |acc, x| (acc << 8) | usize::from(*x))
        });
        if declared != position.len() {
            return Err(TokenError::Malformed("length mismatch"));
        }
        if header.get(1).copied() != Some(kind as u8) {
            return Err(TokenError::WrongKind);
        }
        if digest != filter_digest(filters) {
            return Err(TokenError::FilterMismatch);
        }
        Ok(position.to_vec())
    }
}

/// A position in a list ordered by `(sort_key DESC, uuid DESC)`: the last
/// row returned. The next page starts strictly after it, so writes between
/// pages never shift rows (no SQL OFFSET anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagePosition {
    /// Sort key of the last row (e.g. issue time in ms since the epoch).
    pub sort_key: i64,
    /// Tie-breaking id bytes of the last row.
    pub id: [u8; 16],
}

impl PagePosition {
    /// Fixed 24-byte encoding.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24);
        out.extend_from_slice(&self.sort_key.to_be_bytes());
        out.extend_from_slice(&self.id);
        out
    }

    /// Decodes [`Self::encode`] output.
    ///
    /// # Errors
    /// [`TokenError::Malformed`] on a wrong length.
    pub fn decode(bytes: &[u8]) -> Result<Self, TokenError> {
        let (key, id) = bytes
            .split_at_checked(8)
            .ok_or(TokenError::Malformed("page position"))?;
        let key: [u8; 8] = key
            .try_into()
            .map_err(|_| TokenError::Malformed("page position"))?;
        let id: [u8; 16] = id
            .try_into()
            .map_err(|_| TokenError::Malformed("page position"))?;
        Ok(Self {
            sort_key: i64::from_be_bytes(key),
            id,
        })
    }
}

/// A resume point inside one command's output: the next byte to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputPosition {
    /// Command issue id bytes.
    pub issue_uuid: [u8; 16],
    /// Event sequence of the next chunk.
    pub event_seq: u64,
    /// Byte offset inside that event's raw data.
    pub byte_offset: u64,
    /// Highest event sequence visible when the first page was read; later
    /// pages never go past it, so concurrent appends neither duplicate nor
    /// skip bytes.
    pub snapshot_seq: u64,
}

impl OutputPosition {
    /// Fixed 40-byte encoding.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40);
        out.extend_from_slice(&self.issue_uuid);
        out.extend_from_slice(&self.event_seq.to_be_bytes());
        out.extend_from_slice(&self.byte_offset.to_be_bytes());
        out.extend_from_slice(&self.snapshot_seq.to_be_bytes());
        out
    }

    /// Decodes [`Self::encode`] output.
    ///
    /// # Errors
    /// [`TokenError::Malformed`] on a wrong length.
    pub fn decode(bytes: &[u8]) -> Result<Self, TokenError> {
        if bytes.len() != 40 {
            return Err(TokenError::Malformed("output position"));
        }
        let field = |range: std::ops::Range<usize>| -> Result<[u8; 8], TokenError> {
            bytes
                .get(range)
                .and_then(|s| s.try_into().ok())
                .ok_or(TokenError::Malformed("output position"))
        };
        let issue_uuid: [u8; 16] = bytes
            .get(..16)
            .and_then(|s| s.try_into().ok())
            .ok_or(TokenError::Malformed("output position"))?;
        Ok(Self {
            issue_uuid,
            event_seq: u64::from_be_bytes(field(16..24)?),
            byte_offset: u64::from_be_bytes(field(24..32)?),
            snapshot_seq: u64::from_be_bytes(field(32..40)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec(seed: u8) -> TokenCodec {
        TokenCodec::new(TokenKey::new([seed; 32]))
    }

    fn filters(client: &str) -> Vec<u8> {
        encode_filters(&[("client_id", client.as_bytes()), ("state", b"")])
    }

    #[test]
    fn round_trip() {
        let pos = PagePosition {
            sort_key: 1_700_000_000_123,
            id: [7; 16],
        };
        let t = codec(1)
            .seal(TokenKind::CommandPage, &filters("web-1"), &pos.encode())
            .unwrap();
        let back = codec(1)
            .open(TokenKind::CommandPage, &filters("web-1"), &t)
            .unwrap();
        assert_eq!(PagePosition::decode(&back).unwrap(), pos);

        let out = OutputPosition {
            issue_uuid: [9; 16],
            event_seq: 42,
            byte_offset: 1000,
            snapshot_seq: 50,
        };
        let t = codec(1)
            .seal(TokenKind::Output, b"stdout", &out.encode())
            .unwrap();
        let back = codec(1).open(TokenKind::Output, b"stdout", &t).unwrap();
        assert_eq!(OutputPosition::decode(&back).unwrap(), out);
    }

    #[test]
    fn refused_with_other_filters_kind_or_key() {
        let t = codec(1)
            .seal(TokenKind::CommandPage, &filters("web-1"), b"pos")
            .unwrap();
        assert_eq!(
            codec(1).open(TokenKind::CommandPage, &filters("web-2"), &t),
            Err(TokenError::FilterMismatch)
        );
        assert_eq!(
            codec(1).open(TokenKind::ClientPage, &filters("web-1"), &t),
            Err(TokenError::WrongKind)
        );
        assert_eq!(
            codec(2).open(TokenKind::CommandPage, &filters("web-1"), &t),
            Err(TokenError::Forged)
        );
    }

    #[test]
    fn any_altered_byte_is_refused() {
        let f = filters("web-1");
        let t = codec(3)
            .seal(TokenKind::IncidentPage, &f, b"position")
            .unwrap();
        let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
        for i in 0..raw.len() {
            let mut bad = raw.clone();
            bad[i] ^= 0x01;
            let text = URL_SAFE_NO_PAD.encode(&bad);
            assert!(
                codec(3).open(TokenKind::IncidentPage, &f, &text).is_err(),
                "byte {i}"
            );
        }
    }

    #[test]
    fn malformed_input_is_refused_without_panic() {
        let c = codec(4);
        for t in ["", "!!!", "AAAA", &"A".repeat(MAX_TOKEN_CHARS + 1)] {
            assert!(matches!(
                c.open(TokenKind::Output, b"", t),
                Err(TokenError::Malformed(_))
            ));
        }
        let mut v2 = URL_SAFE_NO_PAD
            .decode(c.seal(TokenKind::Output, b"", b"").unwrap())
            .unwrap();
        v2[0] = 2;
        assert_eq!(
            c.open(TokenKind::Output, b"", &URL_SAFE_NO_PAD.encode(&v2)),
            Err(TokenError::Version(2))
        );
        assert!(
            c.seal(TokenKind::Output, b"", &[0; MAX_POSITION_BYTES + 1])
                .is_err()
        );
        assert!(PagePosition::decode(b"short").is_err());
        assert!(OutputPosition::decode(&[0; 39]).is_err());
    }

    #[test]
    fn filter_encoding_is_unambiguous() {
        assert_ne!(
            encode_filters(&[("a", b"bc")]),
            encode_filters(&[("ab", b"c")])
        );
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in ".{0,200}") {
            let _ = codec(5).open(TokenKind::CommandPage, b"", &s);
        }
    }
}
