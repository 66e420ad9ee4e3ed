//! What a `server_core` corpus reaches: for every frame payload the core
//! sent and every store operation it issued, how many inputs of the corpus
//! got there (docs/fuzzing.md quotes it after a long run).
//!
//! ```text
//! cargo run -p rvbox-fuzz --example server-core-reach -- DIR...
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

fn main() {
    let mut reach: BTreeMap<String, u64> = BTreeMap::new();
    let mut inputs = 0u64;
    for dir in std::env::args().skip(1) {
        for e in std::fs::read_dir(&dir)
            .expect("a corpus directory")
            .flatten()
        {
            if !e.path().is_file() {
                continue;
            }
            let data = std::fs::read(e.path()).unwrap();
            inputs += 1;
            for k in rvbox_fuzz::server_core::explore(&data).into_keys() {
                *reach.entry(k).or_default() += 1;
            }
        }
    }
    println!("{inputs} inputs");
    for (k, n) in reach {
        println!("{n:>7}  {k}");
    }
}
