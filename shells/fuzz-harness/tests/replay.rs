//! The fuzz targets on stable, in seconds: every seed corpus file and every
//! regression input under `fixtures/fuzz/<target>/` goes through its
//! target, then a few thousand inputs made from them by seeded mutation
//! (bit flips, byte changes, insertions, deletions, cuts, splices), the
//! same inputs on every run. A failing input is written to
//! `<target dir>/tmp/fuzz-failures/<target>-<what>.bin` and named in the failure, ready
//! to be kept under `fixtures/fuzz/<target>/regressions/`.
//!
//! `RVBOX_FUZZ_MUTATIONS` sets the number of mutated inputs per target
//! (default 2000).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::{Path, PathBuf};

use rvbox_fuzz::{TARGETS, Target, target};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn corpus_dir(name: &str) -> PathBuf {
    root().join("fixtures/fuzz").join(name)
}

/// Every file under `dir` (seeds and `regressions/`), sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else if p.extension().is_none_or(|x| x != "md") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// splitmix64: a fixed stream per target, so a run is the same every time.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn mutate(rng: &mut Rng, base: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..=rng.below(4) {
        let len = v.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = *[0u8, 1, 0x7f, 0x80, 0xff, rng.next() as u8]
                    .get(rng.below(6))
                    .unwrap();
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(16));
                v.drain(i..i + n);
            }
            4 => v.truncate(rng.below(len + 1)),
            5 if !pool.is_empty() => {
                let other = &pool[rng.below(pool.len())];
                let from = rng.below(other.len() + 1);
                let to = from + rng.below(other.len() - from + 1);
                let at = rng.below(len + 1);
                v.splice(at..at, other[from..to].iter().copied());
            }
            6 if len > 1 => {
                let i = rng.below(len);
                let j = rng.below(len);
                v.swap(i, j);
            }
            _ => {
                let n = rng.below(32);
                v.extend((0..n).map(|_| rng.next() as u8));
            }
        }
    }
    v
}

fn run_one(t: Target, input: &[u8], what: &str) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (t.run)(input))) {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        let _ = std::fs::create_dir_all(&dir);
        let mut name = format!("{}-{}", t.name, what.replace('/', "_"));
        if !what.contains('.') {
            name.push_str(".bin");
        }
        let file = dir.join(name);
        let _ = std::fs::write(&file, input);
        eprintln!(
            "{}: {what} failed; the input is in {} (keep it under fixtures/fuzz/{}/regressions/)",
            t.name,
            file.display(),
            t.name
        );
        resume_unwind(panic);
    }
}

fn replay(name: &str) {
    let t = target(name).unwrap();
    let paths = files(&corpus_dir(name));
    assert!(
        !paths.is_empty(),
        "fixtures/fuzz/{name}/ has no seed corpus (cargo run -p rvbox-fuzz --example record-seeds)"
    );
    let pool: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for (p, input) in paths.iter().zip(&pool) {
        let rel = p.strip_prefix(corpus_dir(name)).unwrap_or(p);
        run_one(t, input, &rel.display().to_string());
    }
    let n: usize = std::env::var("RVBOX_FUZZ_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut rng = Rng(name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }));
    for i in 0..n {
        let base = if rng.below(16) == 0 {
            Vec::new()
        } else {
            pool[rng.below(pool.len())].clone()
        };
        let input = mutate(&mut rng, &base, &pool);
        run_one(t, &input, &format!("mutation-{i}"));
    }
}

#[test]
fn envelope() {
    replay("envelope");
}

#[test]
fn server_core() {
    replay("server_core");
}

#[test]
fn zstd_output() {
    replay("zstd_output");
}

#[test]
fn segment_tail() {
    replay("segment_tail");
}

#[test]
fn tokens() {
    replay("tokens");
}

#[test]
fn jsonrpc() {
    replay("jsonrpc");
}

#[test]
fn config() {
    replay("config");
}

#[test]
fn every_target_has_a_test_a_libfuzzer_entry_and_a_corpus() {
    let here =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/replay.rs"))
            .unwrap();
    for t in TARGETS {
        assert!(
            here.contains(&format!("replay(\"{}\")", t.name)),
            "{} has no replay test here",
            t.name
        );
        let entry = root()
            .join("fuzz/fuzz_targets")
            .join(format!("{}.rs", t.name));
        let text = std::fs::read_to_string(&entry)
            .unwrap_or_else(|_| panic!("{} is missing", entry.display()));
        assert!(
            text.contains(&format!("rvbox_fuzz::{}::run", t.name)),
            "{} does not call rvbox_fuzz::{}::run",
            entry.display(),
            t.name
        );
        assert!(
            corpus_dir(t.name).is_dir(),
            "fixtures/fuzz/{} is missing",
            t.name
        );
    }
    let entries = std::fs::read_dir(root().join("fuzz/fuzz_targets"))
        .unwrap()
        .count();
    assert_eq!(
        entries,
        TARGETS.len(),
        "one fuzz_targets file per target, no other"
    );
}

/// `name version` of every package of a lock file.
fn locked(path: &Path) -> std::collections::BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = std::collections::BTreeSet::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_owned());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            out.insert((n, v.trim_matches('"').to_owned()));
        }
    }
    out
}

#[test]
fn the_fuzz_build_uses_the_workspace_versions() {
    // fuzz/ has its own lock (libFuzzer stays out of the main graph); what
    // it shares with the workspace must be the versions production runs
    let main = locked(&root().join("Cargo.lock"));
    let fuzz = locked(&root().join("fuzz/Cargo.lock"));
    let main_names: std::collections::BTreeSet<&String> = main.iter().map(|(n, _)| n).collect();
    let drifted: Vec<_> = fuzz
        .iter()
        .filter(|(n, _)| main_names.contains(n))
        .filter(|p| !main.contains(*p))
        .collect();
    assert!(
        drifted.is_empty(),
        "fuzz/Cargo.lock differs from Cargo.lock for {drifted:?}: copy Cargo.lock to fuzz/Cargo.lock and build the fuzz crate once"
    );
}
