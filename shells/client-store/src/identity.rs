//! The installation's identity (plan §7.1): `client_instance_id`.
//!
//! It is a random (v4) UUID from the OS CSPRNG (spec-mapping), created
//! once: written to a temporary file, synced, renamed into place, and the
//! state directory synced, all before the first registration. It is never
//! created again because a session was rejected, and a damaged file is
//! never replaced silently: the store opens with dirty local health, an
//! incident names the problem, and `rvbox repair` restores the file from
//! the database's copy (or, acknowledged by an operator, starts a new
//! installation).
//!
//! # File format (32 bytes, little-endian)
//!
//! | offset | size | field                                  |
//! |-------:|-----:|----------------------------------------|
//! |      0 |    4 | magic `b"RVID"`                        |
//! |      4 |    2 | version `1`                            |
//! |      6 |    2 | reserved, zero                         |
//! |      8 |   16 | the instance id                        |
//! |     24 |    4 | reserved, zero                         |
//! |     28 |    4 | CRC-32C of bytes `0..28`               |

use std::path::Path;

use rvbox_domain::ids::InstanceId;
use rvbox_storage::StoreError;
use rvbox_storage::atomic;
use rvbox_storage::crash::CrashHook;
use rvbox_storage::entropy::Entropy;
use rvbox_storage::fs::StoreFs;

use crate::crash::IDENTITY_BEFORE_RENAME;

/// Length of the identity file.
pub const IDENTITY_LEN: usize = 32;
/// Its magic.
pub const IDENTITY_MAGIC: [u8; 4] = *b"RVID";
/// Its format version.
pub const IDENTITY_VERSION: u16 = 1;
/// The longest identity file read back (anything longer is damaged).
const MAX_READ: u64 = 4096;

/// The identity file's bytes for `id`.
#[must_use]
pub fn encode(id: &InstanceId) -> [u8; IDENTITY_LEN] {
    let mut out = [0u8; IDENTITY_LEN];
    let (head, crc) = out.split_at_mut(28);
    let (magic, rest) = head.split_at_mut(4);
    magic.copy_from_slice(&IDENTITY_MAGIC);
    let (version, rest) = rest.split_at_mut(2);
    version.copy_from_slice(&IDENTITY_VERSION.to_le_bytes());
    let (_reserved, rest) = rest.split_at_mut(2);
    let (uuid, _reserved) = rest.split_at_mut(16);
    uuid.copy_from_slice(id.as_bytes());
    crc.copy_from_slice(&crc32c::crc32c(head).to_le_bytes());
    out
}

/// Decodes an identity file, naming what is wrong with a damaged one.
///
/// # Errors
/// A short description of the damage.
pub fn decode(bytes: &[u8]) -> Result<InstanceId, String> {
    let buf: &[u8; IDENTITY_LEN] = bytes
        .try_into()
        .map_err(|_| format!("is {} bytes, expected {IDENTITY_LEN}", bytes.len()))?;
    let (head, crc) = buf.split_at(28);
    if crc != crc32c::crc32c(head).to_le_bytes() {
        return Err("its checksum does not match".into());
    }
    if head.get(0..4) != Some(&IDENTITY_MAGIC[..]) {
        return Err("its magic is not RVID".into());
    }
    let version = head
        .get(4..6)
        .and_then(|v| <[u8; 2]>::try_from(v).ok())
        .map(u16::from_le_bytes);
    if version != Some(IDENTITY_VERSION) {
        return Err(format!("version {version:?} is not {IDENTITY_VERSION}"));
    }
    if head.get(6..8) != Some(&[0u8; 2][..]) || head.get(24..28) != Some(&[0u8; 4][..]) {
        return Err("reserved bytes are not zero".into());
    }
    let uuid = head
        .get(8..24)
        .and_then(|u| <[u8; 16]>::try_from(u).ok())
        .ok_or_else(|| "its id is short".to_string())?;
    let id = InstanceId::from_random_bytes(uuid);
    if id.as_bytes() != &uuid {
        return Err("its id is not a random (v4) UUID".into());
    }
    Ok(id)
}

/// What the identity file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityFile {
    /// There is none.
    Absent,
    /// A valid identity.
    Valid(InstanceId),
    /// A damaged or unreadable file, and why.
    Damaged(String),
}

/// Reads the identity file at `path`. An unreadable file is reported as
/// damaged (with the OS error), not as an error: the store still opens,
/// dirty, so that `rvbox repair` can act on it.
#[must_use]
pub fn read(fs: &dyn StoreFs, path: &Path) -> IdentityFile {
    match atomic::read_small(fs, path, MAX_READ) {
        Ok(None) => IdentityFile::Absent,
        Ok(Some(bytes)) => match decode(&bytes) {
            Ok(id) => IdentityFile::Valid(id),
            Err(why) => IdentityFile::Damaged(why),
        },
        Err(e) => IdentityFile::Damaged(e.to_string()),
    }
}

/// Writes the identity file for `id`, atomically and durably.
///
/// # Errors
/// [`StoreError::Io`] naming the step.
pub fn write(
    fs: &dyn StoreFs,
    path: &Path,
    id: &InstanceId,
    hook: &dyn CrashHook,
) -> Result<(), StoreError> {
    atomic::write_new(fs, path, &encode(id), hook, IDENTITY_BEFORE_RENAME)
}

/// A new random instance id from `entropy`.
///
/// # Errors
/// [`StoreError::Io`] when the entropy source fails.
pub fn mint(entropy: &dyn Entropy, path: &Path) -> Result<InstanceId, StoreError> {
    let mut bytes = [0u8; 16];
    entropy
        .fill(&mut bytes)
        .map_err(|e| StoreError::io("draw a new instance id", path, e))?;
    Ok(InstanceId::from_random_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_round_trips_and_every_damage_is_named() {
        let id = InstanceId::from_random_bytes([7; 16]);
        let bytes = encode(&id);
        assert_eq!(decode(&bytes), Ok(id));
        assert!(decode(&bytes[..31]).unwrap_err().contains("31 bytes"));
        for i in 0..IDENTITY_LEN {
            let mut b = bytes;
            b[i] ^= 0x01;
            assert!(decode(&b).is_err(), "flipped byte {i} accepted");
        }
        // a valid checksum over a non-v4 id is still refused
        let mut b = bytes;
        b[8 + 6] = 0x10; // version nibble 1
        let crc = crc32c::crc32c(&b[..28]).to_le_bytes();
        b[28..].copy_from_slice(&crc);
        assert!(decode(&b).unwrap_err().contains("v4"));
    }
}
