//! Canonical identifiers (plan §4.1).
//!
//! One parser for every public UUID: command issue ids and control mutation
//! request ids are RFC 9562 version 7 in canonical text (lowercase, hyphenated
//! 8-4-4-4-12). The client-instance id is a random version 4 UUID
//! (spec-mapping) and goes through the same canonical-text check. Client ids
//! are configured host names: 1 to 128 ASCII letters, digits, '.', '-' or '_'.

use std::fmt;

use thiserror::Error;
use uuid::Uuid;

use crate::limits::MAX_CLIENT_ID_LEN;

/// Why a text id was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IdError {
    /// The field was empty.
    #[error("{field} is empty")]
    Empty {
        /// Dotted name of the field.
        field: &'static str,
    },
    /// Not 36 characters of lowercase hex in 8-4-4-4-12 groups.
    #[error(
        "{field} is not a canonical UUID (want 36 lowercase hex characters in 8-4-4-4-12 groups)"
    )]
    NotCanonical {
        /// Dotted name of the field.
        field: &'static str,
    },
    /// The variant bits are not RFC 9562.
    #[error("{field} is not an RFC 9562 UUID (variant bits)")]
    WrongVariant {
        /// Dotted name of the field.
        field: &'static str,
    },
    /// The version nibble is not the one this field requires.
    #[error("{field} must be a version {want} UUID, got version {got}")]
    WrongVersion {
        /// Dotted name of the field.
        field: &'static str,
        /// Required version.
        want: u8,
        /// Version found.
        got: u8,
    },
    /// A client id longer than 128 characters.
    #[error("{field} is {len} characters long; the limit is {MAX_CLIENT_ID_LEN}")]
    TooLong {
        /// Dotted name of the field.
        field: &'static str,
        /// Length found (bytes).
        len: usize,
    },
    /// A client id with a character other than an ASCII letter, digit, '.', '-' or '_'.
    #[error(
        "{field} may only contain ASCII letters, digits, '.', '-' and '_' (bad character at byte {at})"
    )]
    BadCharacter {
        /// Dotted name of the field.
        field: &'static str,
        /// Byte offset of the first bad character.
        at: usize,
    },
}

impl IdError {
    /// The dotted name of the field that was refused.
    #[must_use]
    pub fn field(&self) -> &'static str {
        match self {
            Self::Empty { field }
            | Self::NotCanonical { field }
            | Self::WrongVariant { field }
            | Self::WrongVersion { field, .. }
            | Self::TooLong { field, .. }
            | Self::BadCharacter { field, .. } => field,
        }
    }
}

/// Parses canonical UUID text of the given version. This is the only UUID
/// parser for public input: it refuses empty, upper-case, braced, `urn:`,
/// unhyphenated and wrong-version text.
fn parse_canonical(field: &'static str, text: &str, version: u8) -> Result<Uuid, IdError> {
    if text.is_empty() {
        return Err(IdError::Empty { field });
    }
    let bytes = text.as_bytes();
    if bytes.len() != 36 {
        return Err(IdError::NotCanonical { field });
    }
    for (i, b) in bytes.iter().enumerate() {
        let ok = match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(b),
        };
        if !ok {
            return Err(IdError::NotCanonical { field });
        }
    }
    let uuid = Uuid::try_parse(text).map_err(|_| IdError::NotCanonical { field })?;
    // RFC 9562 variant: the two top bits of octet 8 are 0b10.
    if uuid.as_bytes().get(8).is_none_or(|b| b & 0xc0 != 0x80) {
        return Err(IdError::WrongVariant { field });
    }
    let got = uuid.as_bytes().get(6).map_or(0, |b| b >> 4);
    if got != version {
        return Err(IdError::WrongVersion {
            field,
            want: version,
            got,
        });
    }
    Ok(uuid)
}

/// A command issue id or control mutation request id: canonical UUIDv7.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Uuid7(Uuid);

impl Uuid7 {
    /// Parses canonical UUIDv7 text; `field` names the input in errors.
    ///
    /// # Errors
    /// [`IdError`] naming `field` when the text is not canonical UUIDv7.
    pub fn parse(field: &'static str, text: &str) -> Result<Self, IdError> {
        parse_canonical(field, text, 7).map(Self)
    }

    /// Builds from 16 raw bytes (a stored fixed-size blob), checking version and variant.
    ///
    /// # Errors
    /// [`IdError`] when the bytes are not a UUIDv7.
    pub fn from_bytes(field: &'static str, bytes: [u8; 16]) -> Result<Self, IdError> {
        let uuid = Uuid::from_bytes(bytes);
        Self::parse(field, &uuid.hyphenated().to_string())
    }

    /// The 16 raw bytes, big-endian as RFC 9562 lays them out.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// Milliseconds since the Unix epoch carried in the first 48 bits.
    #[must_use]
    pub fn unix_millis(&self) -> u64 {
        let b = self.0.as_bytes();
        b.iter()
            .take(6)
            .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte))
    }
}

impl fmt::Display for Uuid7 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

impl fmt::Debug for Uuid7 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Uuid7({})", self.0.hyphenated())
    }
}

/// The durable, random identity of one client daemon installation: a
/// canonical UUIDv4 generated once from the OS CSPRNG (spec-mapping).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InstanceId(Uuid);

impl InstanceId {
    /// Parses canonical UUIDv4 text.
    ///
    /// # Errors
    /// [`IdError`] naming `field` when the text is not canonical UUIDv4.
    pub fn parse(field: &'static str, text: &str) -> Result<Self, IdError> {
        parse_canonical(field, text, 4).map(Self)
    }

    /// Builds an instance id from 16 random bytes drawn by the caller,
    /// setting the version and variant bits.
    #[must_use]
    pub fn from_random_bytes(bytes: [u8; 16]) -> Self {
        Self(uuid::Builder::from_random_bytes(bytes).into_uuid())
    }

    /// The 16 raw bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceId({})", self.0.hyphenated())
    }
}

/// A client id: the configured host name of a client daemon, 1 to 128
/// ASCII letters, digits, '.', '-' or '_' (host-name text; no spaces,
/// control characters, path separators or shell metacharacters). It is
/// display and routing identity, not an authentication assertion (plan §6.2).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientId(String);

impl ClientId {
    /// Validates client id text.
    ///
    /// # Errors
    /// [`IdError`] naming `field` when the text is empty, too long or has a
    /// character outside printable ASCII.
    pub fn parse(field: &'static str, text: &str) -> Result<Self, IdError> {
        if text.is_empty() {
            return Err(IdError::Empty { field });
        }
        if let Some(at) = text
            .bytes()
            .position(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')))
        {
            return Err(IdError::BadCharacter { field, at });
        }
        if text.len() > MAX_CLIENT_ID_LEN {
            return Err(IdError::TooLong {
                field,
                len: text.len(),
            });
        }
        Ok(Self(text.to_owned()))
    }

    /// The id text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientId({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V7: &str = "01890a5d-ac96-774b-bcce-b302099a8057";
    const V4: &str = "3b241101-e2bb-4255-8caf-4136c566a962";

    #[test]
    fn accepts_canonical_v7() {
        let id = Uuid7::parse("issue_uuid", V7).unwrap();
        assert_eq!(id.to_string(), V7);
        assert_eq!(id.unix_millis(), 0x0189_0a5d_ac96);
        assert_eq!(Uuid7::from_bytes("x", *id.as_bytes()).unwrap(), id);
    }

    #[test]
    fn refuses_non_canonical_v7_text() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("01890A5D-AC96-774B-BCCE-B302099A8057", "upper case"),
            ("{01890a5d-ac96-774b-bcce-b302099a8057}", "braced"),
            ("urn:uuid:01890a5d-ac96-774b-bcce-b302099a8057", "urn"),
            ("01890a5dac96774bbcceb302099a8057", "unhyphenated"),
            ("01890a5d-ac96-774b-bcce-b302099a805", "short"),
            ("01890a5d-ac96-774b-bcce-b302099a80577", "long"),
            ("01890a5d-ac96-774b-bcce_b302099a8057", "wrong separator"),
            (" 01890a5d-ac96-774b-bcce-b302099a805", "leading space"),
            ("01890a5d-ac96-774b-bcce-b302099a80g7", "non-hex"),
            ("01890a5dx-ac9-774b-bcce-b302099a8057", "misplaced hyphen"),
            ("01890a5d-ac96-774b-bcce-b302099a805\u{e9}", "non-ascii"),
        ];
        for (text, why) in cases {
            let err = Uuid7::parse("issue_uuid", text).unwrap_err();
            assert_eq!(err.field(), "issue_uuid", "{why}");
            assert!(
                matches!(err, IdError::Empty { .. } | IdError::NotCanonical { .. }),
                "{why}: {err:?}"
            );
        }
    }

    #[test]
    fn refuses_wrong_version_and_variant() {
        assert_eq!(
            Uuid7::parse("request_id", V4).unwrap_err(),
            IdError::WrongVersion {
                field: "request_id",
                want: 7,
                got: 4
            }
        );
        // nil UUID: variant bits 00
        assert_eq!(
            Uuid7::parse("request_id", "00000000-0000-0000-0000-000000000000").unwrap_err(),
            IdError::WrongVariant {
                field: "request_id"
            }
        );
        // version 7 but Microsoft variant (110x)
        assert!(matches!(
            Uuid7::parse("request_id", "01890a5d-ac96-774b-ccce-b302099a8057").unwrap_err(),
            IdError::WrongVariant { .. }
        ));
        assert!(matches!(
            Uuid7::from_bytes("x", *InstanceId::parse("x", V4).unwrap().as_bytes()).unwrap_err(),
            IdError::WrongVersion { got: 4, .. }
        ));
    }

    #[test]
    fn instance_id_is_v4() {
        assert_eq!(InstanceId::parse("id", V4).unwrap().to_string(), V4);
        assert!(matches!(
            InstanceId::parse("id", V7).unwrap_err(),
            IdError::WrongVersion {
                want: 4,
                got: 7,
                ..
            }
        ));
        let minted = InstanceId::from_random_bytes([0xff; 16]);
        assert!(InstanceId::parse("id", &minted.to_string()).is_ok());
    }

    #[test]
    fn client_id_bounds() {
        assert!(ClientId::parse("client_id", "a").is_ok());
        assert!(ClientId::parse("client_id", &"h".repeat(128)).is_ok());
        assert_eq!(
            ClientId::parse("client_id", &"h".repeat(129)).unwrap_err(),
            IdError::TooLong {
                field: "client_id",
                len: 129
            }
        );
        assert_eq!(
            ClientId::parse("client_id", "").unwrap_err(),
            IdError::Empty { field: "client_id" }
        );
        assert_eq!(
            ClientId::parse("client_id", "h\u{f6}st").unwrap_err(),
            IdError::BadCharacter {
                field: "client_id",
                at: 1
            }
        );
        assert!(ClientId::parse("client_id", "web 01").is_err());
        assert!(ClientId::parse("client_id", "web\n01").is_err());
        assert!(ClientId::parse("client_id", "web-01.example.net").is_ok());
        assert!(ClientId::parse("client_id", "web_01").is_ok());
        for bad in ["web/01", "web:01", "web@01", "web;01", "../x"] {
            assert!(ClientId::parse("client_id", bad).is_err(), "{bad}");
        }
    }
}
