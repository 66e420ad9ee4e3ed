//! Where random bytes come from (session ids, incident and server ids,
//! jitter, the page-token key). Production draws from the OS CSPRNG; the
//! simulator supplies a seeded source so one seed gives one run. The
//! trait lives here so the pure server core can take it without a
//! dependency on any source.

/// A source of random bytes.
pub trait Entropy: Send + Sync + std::fmt::Debug {
    /// Fills `buf` with random bytes.
    ///
    /// # Errors
    /// When the source cannot produce bytes (the OS CSPRNG failed).
    fn fill(&self, buf: &mut [u8]) -> std::io::Result<()>;
}
