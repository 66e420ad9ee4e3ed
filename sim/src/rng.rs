//! Seeded randomness: one `u64` root seed, many independent named streams
//! (conventions rule 6: "one seed is one run").
//!
//! Every random choice of a run comes from a [`SimRng`] derived from the
//! root seed by [`Seeds`]. Each stream (network, disk, clock, workload,
//! faults, one per client, ...) is its own ChaCha8 generator, seeded from
//! the root by a fixed mixing function of the stream's name and index, so
//! adding draws to one stream never shifts another: a new fault in the
//! network model does not change which commands the workload creates.
//!
//! The mixing function ([`derive_seed`]) is frozen: changing it changes
//! every run, and the failing seeds kept under `fixtures/` would replay
//! something else. Never read OS randomness or a clock here.

use std::ops::{Range, RangeInclusive};
use std::sync::Mutex;

use rand::{Rng as _, SeedableRng as _};
use rand_chacha::ChaCha8Rng;

/// Tries of the rejection sampler in [`SimRng::below`] before it falls
/// back to a (slightly biased, still deterministic) modulo. The expected
/// number of tries is below 2; 64 failures in a row has probability
/// below 2^-64.
pub const MAX_REJECTION_TRIES: u32 = 64;

/// Most bytes one [`SimRng::bytes`] call returns (a bound on allocations
/// driven by a random length).
pub const MAX_RANDOM_BYTES: usize = 16 * 1024 * 1024;

/// A deterministic random stream: ChaCha8 seeded from a `u64`.
///
/// Every helper consumes a fixed, documented number of draws where it can
/// (`chance` always one), so changing a probability does not shift the
/// rest of the stream.
#[derive(Debug, Clone)]
pub struct SimRng {
    inner: ChaCha8Rng,
}

impl SimRng {
    /// A stream seeded with `seed` (`rand::SeedableRng::seed_from_u64`).
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        self.inner.next_u32()
    }

    /// A uniform value in `0..n`; `0` without drawing when `n == 0`.
    ///
    /// Lemire's multiply-and-reject method: unbiased, and deterministic for
    /// a given stream position.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let threshold = n.wrapping_neg() % n;
        let mut last = 0u64;
        for _ in 0..MAX_REJECTION_TRIES {
            let x = self.next_u64();
            let m = u128::from(x) * u128::from(n);
            // the low half decides acceptance, the high half is the value
            let low = m as u64;
            if low >= threshold {
                return (m >> 64) as u64;
            }
            last = x;
        }
        last % n
    }

    /// True with probability `p_permille / 1000` (values above 1000 mean
    /// always). Always consumes exactly one draw.
    pub fn chance(&mut self, p_permille: u32) -> bool {
        self.below(1000) < u64::from(p_permille)
    }

    /// A uniform value in `range`; `range.start` without drawing when the
    /// range is empty.
    pub fn range(&mut self, range: Range<u64>) -> u64 {
        if range.end <= range.start {
            return range.start;
        }
        range
            .start
            .saturating_add(self.below(range.end - range.start))
    }

    /// A uniform value in `range` (both ends included); `start` when the
    /// range is empty.
    pub fn range_inclusive(&mut self, range: RangeInclusive<u64>) -> u64 {
        let (lo, hi) = range.into_inner();
        if hi < lo {
            return lo;
        }
        match (hi - lo).checked_add(1) {
            Some(span) => lo.saturating_add(self.below(span)),
            // the whole u64 range
            None => self.next_u64(),
        }
    }

    /// A uniformly chosen element, `None` for an empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        let len = u64::try_from(items.len()).unwrap_or(u64::MAX);
        if len == 0 {
            return None;
        }
        let i = usize::try_from(self.below(len)).unwrap_or(0);
        items.get(i)
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        self.inner.fill_bytes(buf);
    }

    /// `n` random bytes (at most [`MAX_RANDOM_BYTES`]).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n.min(MAX_RANDOM_BYTES)];
        self.fill(&mut out);
        out
    }

    /// 16 random bytes.
    pub fn bytes16(&mut self) -> [u8; 16] {
        let mut out = [0u8; 16];
        self.fill(&mut out);
        out
    }

    /// A child stream seeded from this one (one draw), for entities created
    /// during a run.
    pub fn fork(&mut self) -> Self {
        Self::new(self.next_u64())
    }

    /// An RFC 9562 UUIDv7 for Unix time `now_ms`: 48-bit big-endian
    /// milliseconds, version 7, 12 random bits, variant `0b10`, 62 random
    /// bits.
    pub fn uuid_v7(&mut self, now_ms: u64) -> [u8; 16] {
        let mut b = self.bytes16();
        let ms = now_ms.to_be_bytes();
        for (dst, src) in b.iter_mut().zip(ms.iter().skip(2)) {
            *dst = *src;
        }
        set_version_and_variant(&mut b, 7);
        b
    }

    /// An RFC 9562 UUIDv4: 122 random bits, version 4, variant `0b10`.
    pub fn uuid_v4(&mut self) -> [u8; 16] {
        let mut b = self.bytes16();
        set_version_and_variant(&mut b, 4);
        b
    }

    /// Canonical text of [`Self::uuid_v7`].
    pub fn uuid_v7_text(&mut self, now_ms: u64) -> String {
        uuid_text(&self.uuid_v7(now_ms))
    }

    /// Canonical text of [`Self::uuid_v4`].
    pub fn uuid_v4_text(&mut self) -> String {
        uuid_text(&self.uuid_v4())
    }
}

fn set_version_and_variant(b: &mut [u8; 16], version: u8) {
    if let Some(v) = b.get_mut(6) {
        *v = (*v & 0x0f) | (version << 4);
    }
    if let Some(v) = b.get_mut(8) {
        *v = (*v & 0x3f) | 0x80;
    }
}

/// Canonical RFC 9562 text: lowercase hex, hyphenated 8-4-4-4-12.
#[must_use]
pub fn uuid_text(bytes: &[u8; 16]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(36);
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        for nibble in [b >> 4, b & 0x0f] {
            let c = HEX.get(usize::from(nibble)).copied().unwrap_or(b'0');
            out.push(char::from(c));
        }
    }
    out
}

/// A named sub-stream of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stream {
    /// Latency and network faults.
    Network,
    /// Simulated disk faults (lost un-synced bytes, torn writes, full disk).
    Disk,
    /// Clock steps and skew.
    Clock,
    /// Which commands are run, when and where.
    Workload,
    /// Fault schedule: which faults are likely in this run, crash points.
    Faults,
    /// Server-side random values (session ids, jitter, store entropy).
    Server,
    /// One simulated client, by index.
    Client(u32),
    /// Any other stream the world adds; names must differ from the labels
    /// above (`network`, `disk`, `clock`, `workload`, `faults`, `server`,
    /// `client`).
    Named(&'static str),
}

impl Stream {
    /// The label and index fed to [`derive_seed`].
    #[must_use]
    pub fn key(self) -> (&'static str, u64) {
        match self {
            Self::Network => ("network", 0),
            Self::Disk => ("disk", 0),
            Self::Clock => ("clock", 0),
            Self::Workload => ("workload", 0),
            Self::Faults => ("faults", 0),
            Self::Server => ("server", 0),
            Self::Client(i) => ("client", u64::from(i)),
            Self::Named(name) => (name, 0),
        }
    }
}

/// SplitMix64 finalizer: a bijective 64-bit mixer.
const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of a label.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The seed of stream `(label, index)` under `root`. Frozen (see module
/// docs): each input passes through its own SplitMix64 round so that
/// neighbouring roots, labels and indexes give unrelated seeds.
#[must_use]
pub fn derive_seed(root: u64, label: &str, index: u64) -> u64 {
    let r = splitmix64(root);
    let l = splitmix64(fnv1a64(label.as_bytes()) ^ 0x5157_4d5f_5345_4544);
    let i = splitmix64(index ^ 0x494e_4445_585f_5f5f);
    splitmix64(r ^ l.rotate_left(17) ^ i.rotate_left(41))
}

/// The tree of streams of one run, all derived from one root seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seeds {
    root: u64,
}

impl Seeds {
    /// The tree of `root`.
    #[must_use]
    pub fn new(root: u64) -> Self {
        Self { root }
    }

    /// The root seed (what `--seed N` reproduces).
    #[must_use]
    pub fn root(&self) -> u64 {
        self.root
    }

    /// A fresh generator at the start of `stream`. Calling it twice gives
    /// two generators producing the same values: take each stream once.
    #[must_use]
    pub fn stream(&self, stream: Stream) -> SimRng {
        let (label, index) = stream.key();
        SimRng::new(derive_seed(self.root, label, index))
    }

    /// [`Stream::Network`].
    #[must_use]
    pub fn network(&self) -> SimRng {
        self.stream(Stream::Network)
    }

    /// [`Stream::Disk`].
    #[must_use]
    pub fn disk(&self) -> SimRng {
        self.stream(Stream::Disk)
    }

    /// [`Stream::Clock`].
    #[must_use]
    pub fn clock(&self) -> SimRng {
        self.stream(Stream::Clock)
    }

    /// [`Stream::Workload`].
    #[must_use]
    pub fn workload(&self) -> SimRng {
        self.stream(Stream::Workload)
    }

    /// [`Stream::Faults`].
    #[must_use]
    pub fn faults(&self) -> SimRng {
        self.stream(Stream::Faults)
    }

    /// [`Stream::Server`].
    #[must_use]
    pub fn server(&self) -> SimRng {
        self.stream(Stream::Server)
    }

    /// [`Stream::Client`] `index`.
    #[must_use]
    pub fn client(&self, index: u32) -> SimRng {
        self.stream(Stream::Client(index))
    }
}

/// Seeded bytes for the store (`rvbox_store::entropy::Entropy`): incident
/// and server ids and the page-token key come from a run's stream instead
/// of the OS CSPRNG. The mutex only satisfies the trait's `Sync` bound;
/// the simulator is single-threaded, so draws happen in call order.
#[derive(Debug)]
pub struct SeededEntropy {
    rng: Mutex<SimRng>,
}

impl SeededEntropy {
    /// Entropy drawn from `rng`.
    #[must_use]
    pub fn new(rng: SimRng) -> Self {
        Self {
            rng: Mutex::new(rng),
        }
    }
}

impl rvbox_store::entropy::Entropy for SeededEntropy {
    fn fill(&self, buf: &mut [u8]) -> std::io::Result<()> {
        let mut rng = self
            .rng
            .lock()
            .map_err(|_| std::io::Error::other("seeded entropy mutex poisoned"))?;
        rng.fill(buf);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use rvbox_domain::ids::{InstanceId, Uuid7};
    use rvbox_store::entropy::Entropy as _;

    use super::*;

    fn draws(rng: &mut SimRng, n: usize) -> Vec<u64> {
        (0..n).map(|_| rng.next_u64()).collect()
    }

    #[test]
    fn same_seed_gives_identical_streams() {
        let a = Seeds::new(42);
        let b = Seeds::new(42);
        for s in [
            Stream::Network,
            Stream::Disk,
            Stream::Clock,
            Stream::Workload,
            Stream::Faults,
            Stream::Server,
            Stream::Client(0),
            Stream::Client(7),
            Stream::Named("engine"),
        ] {
            assert_eq!(
                draws(&mut a.stream(s), 64),
                draws(&mut b.stream(s), 64),
                "{s:?}"
            );
        }
        let mut x = SimRng::new(9);
        let mut y = SimRng::new(9);
        for _ in 0..200 {
            assert_eq!(x.below(37), y.below(37));
            assert_eq!(x.chance(300), y.chance(300));
            assert_eq!(x.bytes(5), y.bytes(5));
            assert_eq!(x.uuid_v7(1_700_000_000_000), y.uuid_v7(1_700_000_000_000));
        }
    }

    #[test]
    fn streams_and_roots_differ() {
        let seeds = Seeds::new(1);
        let mut firsts: Vec<u64> = [
            Stream::Network,
            Stream::Disk,
            Stream::Clock,
            Stream::Workload,
            Stream::Faults,
            Stream::Server,
            Stream::Client(0),
            Stream::Client(1),
            Stream::Client(2),
        ]
        .into_iter()
        .map(|s| seeds.stream(s).next_u64())
        .collect();
        firsts.push(Seeds::new(2).network().next_u64());
        let mut sorted = firsts.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), firsts.len(), "{firsts:?}");
    }

    #[test]
    fn draws_on_one_stream_never_shift_another() {
        let seeds = Seeds::new(0xfeed);
        let baseline = draws(&mut seeds.workload(), 32);
        // a run that draws heavily from the network stream first
        let mut net = seeds.network();
        let _ = draws(&mut net, 10_000);
        let _ = net.bytes(4096);
        assert_eq!(draws(&mut seeds.workload(), 32), baseline);
        // and a run that adds a client
        let _ = draws(&mut seeds.client(99), 100);
        assert_eq!(draws(&mut seeds.workload(), 32), baseline);
    }

    #[test]
    fn derive_seed_is_frozen() {
        // Changing the mixing function changes every recorded seed.
        assert_eq!(derive_seed(0, "network", 0), derive_seed(0, "network", 0));
        let v = derive_seed(1, "client", 3);
        assert_ne!(v, derive_seed(1, "client", 4));
        assert_ne!(v, derive_seed(2, "client", 3));
        assert_ne!(v, derive_seed(1, "clienT", 3));
        insta::assert_snapshot!(
            format!(
                "{:016x} {:016x} {:016x}",
                derive_seed(0, "network", 0),
                derive_seed(1, "client", 3),
                SimRng::new(derive_seed(42, "workload", 0)).next_u64()
            ),
            @"ba9b3e8369a16771 456ca685a80c2545 d54b8ab1021a1d46"
        );
    }

    #[test]
    fn helpers_stay_in_bounds() {
        let mut rng = SimRng::new(5);
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.range(10..10), 10);
        let (lo, hi) = (3, 2);
        assert_eq!(rng.range_inclusive(lo..=hi), 3);
        assert!(rng.pick::<u8>(&[]).is_none());
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            let v = rng.range(3..10);
            assert!((3..10).contains(&v));
            seen[usize::try_from(v - 3).unwrap()] += 1;
            let w = rng.range_inclusive(0..=u64::MAX);
            let _ = w;
            assert!(rng.range_inclusive(5..=5) == 5);
        }
        assert!(seen.iter().all(|n| *n > 800), "{seen:?}");
        assert!(!rng.chance(0));
        assert!(rng.chance(1000));
        let hits = (0..10_000).filter(|_| rng.chance(250)).count();
        assert!((2_200..2_800).contains(&hits), "{hits}");
        let items = ["a", "b", "c"];
        assert!(items.contains(rng.pick(&items).unwrap()));
        assert_eq!(rng.bytes(33).len(), 33);
    }

    #[test]
    fn uuids_are_canonical_and_carry_their_version() {
        let mut rng = SimRng::new(77);
        for _ in 0..100 {
            let t = 1_800_000_000_123;
            let v7 = rng.uuid_v7_text(t);
            let parsed = Uuid7::parse("id", &v7).unwrap();
            assert_eq!(parsed.unix_millis(), t);
            assert_eq!(parsed.to_string(), v7);
            let v4 = rng.uuid_v4_text();
            let inst = InstanceId::parse("id", &v4).unwrap();
            assert_eq!(inst.to_string(), v4);
        }
        assert_eq!(
            uuid_text(&[
                0x01, 0x89, 0x0a, 0x5d, 0xac, 0x96, 0x77, 0x4b, 0xbc, 0xce, 0xb3, 0x02, 0x09, 0x9a,
                0x80, 0x57
            ]),
            "01890a5d-ac96-774b-bcce-b302099a8057"
        );
    }

    #[test]
    fn seeded_entropy_is_deterministic() {
        let a = SeededEntropy::new(Seeds::new(3).server());
        let b = SeededEntropy::new(Seeds::new(3).server());
        let (mut x, mut y) = ([0u8; 24], [0u8; 24]);
        a.fill(&mut x).unwrap();
        b.fill(&mut y).unwrap();
        assert_eq!(x, y);
        assert_ne!(x, [0u8; 24]);
    }
}
