//! What the durability benchmarks share: wall time, incompressible bytes,
//! a store on the real disk, and the raw `fdatasync` probe every figure is
//! compared with.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rvbox_store::entropy::OsEntropy;
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

pub fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0xff) as u8
        })
        .collect()
}

pub fn open(dir: &Path) -> Store {
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.free_space_floor = 0;
    let opts = StoreOptions {
        tiers,
        ..StoreOptions::default()
    };
    let mut s = Store::open(
        Layout::new(dir),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        opts,
        now_ms(),
    )
    .unwrap();
    s.recover(now_ms()).unwrap();
    s
}

/// Raw durable writes per second: append `len` bytes and `fdatasync`, the
/// floor under any durable event rate on this disk right now.
pub fn probe(dir: &Path, len: usize, for_: Duration) -> f64 {
    let path = dir.join("probe");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    let buf = noise(7, len);
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < for_ {
        f.write_all(&buf).unwrap();
        f.sync_data().unwrap();
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path).unwrap();
    rate
}
