//! Target `tokens`: the authenticated page and output tokens of the
//! control API (`rvbox_domain::token`: base64url text, version, kind,
//! filter digest, position, HMAC-SHA-256), and the positions they carry
//! (`PagePosition`, `OutputPosition`).
//!
//! The first byte chooses: any text opened as a token; a position sealed
//! and opened again (with the right and with other kinds, filters and
//! keys); or a sealed token with one character changed. Checks:
//!
//! - no panic, and no token opens that this key did not seal: a text that
//!   opens is exactly the token sealing its position gives (no second
//!   spelling of a token);
//! - a sealed token opens to its position, and is refused for another
//!   kind (`WrongKind`), other filters (`FilterMismatch`) and another key
//!   (`Forged`);
//! - a sealed token with any character changed is refused;
//! - a position that decodes encodes back to the same bytes.

use rvbox_domain::token::{
    MAX_POSITION_BYTES, OutputPosition, PagePosition, TokenCodec, TokenError, TokenKey, TokenKind,
};

use crate::Source;

const KINDS: [TokenKind; 7] = [
    TokenKind::ClientPage,
    TokenKind::CommandPage,
    TokenKind::IncidentPage,
    TokenKind::Output,
    TokenKind::FleetRunPage,
    TokenKind::FleetTargetPage,
    TokenKind::PtyPage,
];

fn codec(byte: u8) -> TokenCodec {
    TokenCodec::new(TokenKey::new([byte; 32]))
}

fn positions(bytes: &[u8]) {
    if let Ok(p) = PagePosition::decode(bytes) {
        assert_eq!(
            p.encode(),
            bytes,
            "a page position encodes back to its bytes"
        );
    }
    if let Ok(p) = OutputPosition::decode(bytes) {
        assert_eq!(
            p.encode(),
            bytes,
            "an output position encodes back to its bytes"
        );
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut src = Source::new(data);
    let mode = src.u8() % 3;
    let kind = *src.pick(&KINDS).unwrap_or(&TokenKind::Output);
    let filters = src.bytes(48).to_vec();
    let c = codec(7);
    match mode {
        0 => {
            let text = String::from_utf8_lossy(src.rest()).into_owned();
            if let Ok(position) = c.open(kind, &filters, &text) {
                let sealed = c
                    .seal(kind, &filters, &position)
                    .expect("an opened position seals");
                assert_eq!(sealed, text, "a token that opens is the one sealing gives");
                positions(&position);
            }
        }
        1 => {
            let position = src.rest();
            positions(position);
            let sealed = match c.seal(kind, &filters, position) {
                Ok(t) => t,
                Err(e) => {
                    assert!(
                        position.len() > MAX_POSITION_BYTES,
                        "only a long position fails: {e}"
                    );
                    return;
                }
            };
            assert_eq!(c.open(kind, &filters, &sealed).as_deref(), Ok(position));
            let other = KINDS
                .iter()
                .copied()
                .find(|k| *k != kind)
                .unwrap_or(TokenKind::Output);
            assert_eq!(c.open(other, &filters, &sealed), Err(TokenError::WrongKind));
            let mut other_filters = filters.clone();
            other_filters.push(0);
            assert_eq!(
                c.open(kind, &other_filters, &sealed),
                Err(TokenError::FilterMismatch)
            );
            assert_eq!(
                codec(8).open(kind, &filters, &sealed),
                Err(TokenError::Forged)
            );
        }
        _ => {
            let at = usize::from(src.u16());
            let with = char::from(src.u8());
            let position = src.rest();
            let Ok(sealed) = c.seal(kind, &filters, position) else {
                return;
            };
            let mut chars: Vec<char> = sealed.chars().collect();
            if chars.is_empty() {
                return;
            }
            let i = at % chars.len();
            if let Some(ch) = chars.get_mut(i) {
                *ch = with;
            }
            let changed: String = chars.into_iter().collect();
            if changed != sealed {
                assert!(
                    c.open(kind, &filters, &changed).is_err(),
                    "a token with a character changed is refused"
                );
            }
        }
    }
}
