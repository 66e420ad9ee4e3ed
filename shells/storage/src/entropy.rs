//! Where the store's random bytes come from: incident and server ids, the
//! page-token key. Production draws from the OS CSPRNG; the simulator
//! supplies a seeded source so one seed gives one run.

pub use rvbox_store_port::entropy::Entropy;

/// The operating system's CSPRNG.
#[derive(Debug, Default, Clone, Copy)]
pub struct OsEntropy;

impl Entropy for OsEntropy {
    fn fill(&self, buf: &mut [u8]) -> std::io::Result<()> {
        getrandom::fill(buf).map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// A new UUIDv7 for `now_ms` with random bits from `entropy`.
///
/// # Errors
/// When `entropy` fails.
pub fn uuid_v7(entropy: &dyn Entropy, now_ms: i64) -> std::io::Result<[u8; 16]> {
    let mut random = [0u8; 10];
    entropy.fill(&mut random)?;
    let ms = u64::try_from(now_ms).unwrap_or(0);
    Ok(*uuid::Builder::from_unix_timestamp_millis(ms, &random)
        .into_uuid()
        .as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v7_ids_parse_as_canonical_v7_and_carry_the_time() {
        let id = uuid_v7(&OsEntropy, 1_700_000_000_000).unwrap();
        let parsed = rvbox_domain::ids::Uuid7::from_bytes("id", id).unwrap();
        assert_eq!(parsed.unix_millis(), 1_700_000_000_000);
        assert_ne!(id, uuid_v7(&OsEntropy, 1_700_000_000_000).unwrap());
    }
}
