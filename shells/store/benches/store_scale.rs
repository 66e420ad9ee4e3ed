//! The store at scale: a store filled through its own API to 10,000,
//! 100,000 and 1,000,000 finished commands (about 4 KiB of output each:
//! 0.04, 0.4 and 4 GiB of segments) on the real disk, and at each size:
//!
//! - RunCommand and terminal-event rates with real flushes, each as a
//!   ratio to a raw `fdatasync` probe interleaved with it (one probe flush
//!   before each operation: the disk here flips between fast and slow
//!   flush modes), and the same operations without flushes (the
//!   per-operation cost the history could change), measured at the end
//!   for every size side by side (a copy of the store is kept at each
//!   size), in rounds that visit each size in turn; and one eviction pass
//!   per size;
//! - a restart after a clean stop and after a SIGKILL under traffic, with a
//!   warm page cache and with the data files dropped from it
//!   (`posix_fadvise(DONTNEED)` on every file of the data directory): the
//!   time to liveness (the store open, its health answering), to the first
//!   client scope serving (a RunCommand committed), and to global
//!   readiness (the integrity check passed), and the restarted process's
//!   peak RSS.
//!
//! The fill runs SQLite with `synchronous=OFF` (the group journal still
//! syncs) to save time; at the smallest size the bench also fills a second
//! store with every flush on and restarts it the same way, so the two can
//! be compared: the restart reads what is on disk, not how it got there.
//!
//! Run: `scripts/bench` (or `cargo bench -p rvbox-store --bench store_scale`).
//! `RVBOX_BENCH_SCALE` (default `10000,100000,1000000`) sets the sizes;
//! `RVBOX_BENCH_DIR` (default `target/bench-store-scale`) where the stores
//! go (it needs about 6 GiB free for the largest); `RVBOX_BENCH_KEEP=1`
//! keeps the filled store there (`<dir>/kept`, filled on from what it
//! holds), `--rates DIR...` measures the rates of kept stores side by
//! side, and `--unflushed DIR N` runs N unflushed operations of each kind
//! (for a profile).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Stream};
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

mod common;

use common::{noise, now_ms, probe};

/// Clients the commands are spread over.
const CLIENTS: u64 = 100;
/// Raw output per command.
const OUTPUT: usize = 4096;
/// Commands per fill batch (one append call for their events).
const BATCH: usize = 64;
/// Operations per rate measurement.
const RATE_OPS: u64 = 400;

fn options() -> StoreOptions {
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.free_space_floor = 0;
    tiers.global_total = 1 << 40;
    tiers.per_owner_total = 1 << 40;
    StoreOptions {
        tiers,
        queue_max_per_client: 1 << 20,
        queue_max_total: 1 << 20,
        ..StoreOptions::default()
    }
}

fn open_store(dir: &Path) -> Store {
    open_store_with(dir, options())
}

fn open_store_with(dir: &Path, opts: StoreOptions) -> Store {
    Store::open(
        Layout::new(dir),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        opts,
        now_ms(),
    )
    .unwrap()
}

fn request(id: &[u8; 16], client: &str) -> wire::RunCommandRequest {
    wire::RunCommandRequest {
        request_id: uuid::Uuid::from_bytes(*id).hyphenated().to_string(),
        client_id: client.into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(
                "journalctl -u nginx --since today | tail -n 50".into(),
            )),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    }
}

fn client_of(n: u64) -> String {
    format!("web-{:03}", n % CLIENTS)
}

fn lifecycle(id: [u8; 16], seq: u64, to: Lifecycle) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: seq,
        observed_ms: now_ms(),
        body: EventBody::Lifecycle {
            to,
            exit_code: (to == Lifecycle::Succeeded).then_some(0),
            exit_signal: None,
            encoded: vec![to.to_wire() as u8],
        },
    }
}

fn output(id: [u8; 16], seq: u64, stored: &[u8]) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: id,
        event_seq: seq,
        observed_ms: now_ms(),
        body: EventBody::Output {
            stream: Stream::Stdout,
            compression: Compression::None,
            raw_len: u32::try_from(stored.len()).unwrap(),
            stored: stored.to_vec(),
        },
    }
}

/// A new command, dispatched and accepted (its RunCommand timed apart when
/// asked).
fn accepted(s: &mut Store, n: u64) -> [u8; 16] {
    let id = uuid_v7(&OsEntropy, now_ms()).unwrap();
    s.run_command(&request(&id, &client_of(n)), now_ms())
        .unwrap();
    s.record_transition(&id, Lifecycle::Dispatched).unwrap();
    s.record_transition(&id, Lifecycle::Accepted).unwrap();
    id
}

fn check(outcomes: &[EventOutcome]) {
    assert!(
        outcomes.iter().all(|o| *o == EventOutcome::Appended),
        "{outcomes:?}"
    );
}

/// Adds `count` finished commands: each runs, writes `OUTPUT` bytes and
/// succeeds, `BATCH` commands' events per append.
fn fill(s: &mut Store, from: u64, count: u64) {
    let body = noise(from, OUTPUT);
    let mut n = from;
    while n < from + count {
        let k = (from + count - n).min(BATCH as u64);
        let ids: Vec<[u8; 16]> = (0..k).map(|i| accepted(s, n + i)).collect();
        let mut batch = Vec::with_capacity(ids.len() * 3);
        for id in &ids {
            batch.push(lifecycle(*id, 1, Lifecycle::Running));
            batch.push(output(*id, 2, &body));
            batch.push(lifecycle(*id, 3, Lifecycle::Succeeded));
        }
        check(&s.append_events(&batch, now_ms()).unwrap().outcomes);
        n += k;
        // the server runs maintenance every minute: it moves the audit
        // outbox into audit segments, among the rest
        if n % 16_384 < k {
            s.maintain(now_ms()).unwrap();
        }
    }
    s.maintain(now_ms()).unwrap();
}

fn mean(a: f64, b: f64) -> f64 {
    (a + b) / 2.0
}

/// A raw flush probe: one 4 KiB append and `fdatasync` on a file of its
/// own, timed, run right before each timed operation so that both see the
/// same flush mode of the disk.
struct Probe {
    file: std::fs::File,
    path: PathBuf,
    buf: Vec<u8>,
    spent: Duration,
    count: u64,
}

impl Probe {
    fn new(dir: &Path) -> Self {
        let path = dir.join("interleaved-probe");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        Probe {
            file,
            path,
            buf: noise(7, 4096),
            spent: Duration::ZERO,
            count: 0,
        }
    }

    fn once(&mut self) {
        use std::io::Write as _;
        let t = Instant::now();
        self.file.write_all(&self.buf).unwrap();
        self.file.sync_data().unwrap();
        self.spent += t.elapsed();
        self.count += 1;
    }

    /// Probe time so far, and the flushes per second it shows.
    fn take(&mut self) -> (Duration, f64) {
        let spent = std::mem::take(&mut self.spent);
        let n = std::mem::take(&mut self.count);
        (spent, n as f64 / spent.as_secs_f64())
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// RunCommand and terminal-event rates on an open store, `ops` of each:
/// operations per second, or, with a probe interleaved (one flush before
/// each operation), the rate as a ratio to the probe's over the same time
/// (the probe's time over the operations'), and the probe's own rate.
fn rates(s: &mut Store, base: u64, ops: u64, mut probe: Option<&mut Probe>) -> (f64, f64, f64) {
    let mut spent = Duration::ZERO;
    let mut ids = Vec::new();
    for i in 0..ops {
        if let Some(p) = probe.as_deref_mut() {
            p.once();
        }
        let id = uuid_v7(&OsEntropy, now_ms()).unwrap();
        let req = request(&id, &client_of(base + i));
        let t = Instant::now();
        s.run_command(&req, now_ms()).unwrap();
        spent += t.elapsed();
        ids.push(id);
    }
    let (probed, flushes) = probe
        .as_deref_mut()
        .map_or((Duration::ZERO, 0.0), Probe::take);
    let run = match probe {
        Some(_) => probed.as_secs_f64() / spent.as_secs_f64(),
        None => ops as f64 / spent.as_secs_f64(),
    };
    let body = noise(base, OUTPUT);
    for id in &ids {
        s.record_transition(id, Lifecycle::Dispatched).unwrap();
        s.record_transition(id, Lifecycle::Accepted).unwrap();
    }
    for chunk in ids.chunks(BATCH) {
        let mut batch = Vec::new();
        for id in chunk {
            batch.push(lifecycle(*id, 1, Lifecycle::Running));
            batch.push(output(*id, 2, &body));
        }
        check(&s.append_events(&batch, now_ms()).unwrap().outcomes);
    }
    let mut spent = Duration::ZERO;
    for id in &ids {
        if let Some(p) = probe.as_deref_mut() {
            p.once();
        }
        let event = [lifecycle(*id, 3, Lifecycle::Succeeded)];
        let t = Instant::now();
        check(&s.append_events(&event, now_ms()).unwrap().outcomes);
        spent += t.elapsed();
    }
    let terminal = match probe {
        Some(p) => p.take().0.as_secs_f64() / spent.as_secs_f64(),
        None => ops as f64 / spent.as_secs_f64(),
    };
    (run, terminal, flushes)
}

/// Drops every file of `dir` from the page cache.
fn drop_cache(dir: &Path) {
    fn walk(p: &Path, n: &mut u64) {
        for e in std::fs::read_dir(p).unwrap().flatten() {
            let path = e.path();
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                walk(&path, n);
            } else if t.is_file()
                && let Ok(f) = std::fs::File::open(&path)
            {
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                *n += 1;
            }
        }
    }
    let mut n = 0;
    walk(dir, &mut n);
}

fn syncfs(dir: &Path) {
    let f = std::fs::File::open(dir).unwrap();
    rustix::fs::syncfs(&f).unwrap();
}

#[derive(Debug, Default, Clone, Copy)]
struct Restart {
    live_ms: f64,
    scope_ms: f64,
    ready_ms: f64,
    rss_mib: f64,
    scanned: u64,
}

/// Restarts the store in a fresh process and reads its figures.
fn restart(dir: &Path) -> Restart {
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let out = Command::new(exe)
        .arg("--child-restart")
        .arg(dir)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "the restarted store failed");
    let _ = started;
    let text = String::from_utf8(out.stdout).unwrap();
    let mut r = Restart::default();
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match k {
            "live_ms" => r.live_ms = v.parse().unwrap(),
            "scope_ms" => r.scope_ms = v.parse().unwrap(),
            "ready_ms" => r.ready_ms = v.parse().unwrap(),
            "rss_kib" => r.rss_mib = v.parse::<f64>().unwrap() / 1024.0,
            "scanned" => r.scanned = v.parse().unwrap(),
            _ => {}
        }
    }
    r
}

/// Runs traffic in a child process and kills it (SIGKILL) mid-write.
fn kill_under_traffic(dir: &Path) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .arg("--child-traffic")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l == "serving" => break,
            Some(Ok(_)) => {}
            _ => panic!("the traffic child ended before serving"),
        }
    }
    std::thread::sleep(Duration::from_millis(1500));
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
}

/// The child: open, recover the scopes, serve a first RunCommand, wait for
/// the integrity check, print the times since the process started.
fn child_restart(dir: &Path) {
    let t0 = Instant::now();
    let mut s = open_store(dir);
    let health = s.health();
    let _ = health.report(now_ms());
    let live = t0.elapsed();
    let (report, check) = s.begin_recovery(now_ms()).unwrap();
    let id = uuid_v7(&OsEntropy, now_ms()).unwrap();
    s.run_command(&request(&id, "web-000"), now_ms()).unwrap();
    let scope = t0.elapsed();
    // global readiness: the integrity check of every table passed (the
    // whole-file check goes on after it, with the store serving)
    while !health.report(now_ms()).ready {
        assert!(
            !check.is_finished() || health.integrity_settled(),
            "integrity check failed"
        );
        std::thread::sleep(Duration::from_micros(500));
    }
    let ready = t0.elapsed();
    assert!(check.wait().unwrap(), "integrity check failed");
    let rss = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .map(|v| v.trim().trim_end_matches("kB").trim().to_owned())
        .unwrap_or_default();
    println!("live_ms={:.1}", live.as_secs_f64() * 1e3);
    println!("scope_ms={:.1}", scope.as_secs_f64() * 1e3);
    println!("ready_ms={:.1}", ready.as_secs_f64() * 1e3);
    println!("rss_kib={rss}");
    println!("scanned={}", report.segments_scanned);
}

/// The child that is killed: recover, then write commands until killed.
fn child_traffic(dir: &Path) {
    let mut s = open_store(dir);
    s.recover(now_ms()).unwrap();
    println!("serving");
    let mut n = 0u64;
    let body = noise(99, OUTPUT);
    let mut running: Vec<[u8; 16]> = Vec::new();
    loop {
        // eight commands start and write while the eight before them end:
        // a kill leaves up to sixteen running, their segments active
        let ids: Vec<[u8; 16]> = (0..8).map(|i| accepted(&mut s, n + i)).collect();
        let mut batch = Vec::new();
        for id in &ids {
            batch.push(lifecycle(*id, 1, Lifecycle::Running));
            batch.push(output(*id, 2, &body));
        }
        for id in &running {
            batch.push(lifecycle(*id, 3, Lifecycle::Succeeded));
        }
        check(&s.append_events(&batch, now_ms()).unwrap().outcomes);
        running = ids;
        n += 8;
    }
}

fn du(dir: &Path) -> (u64, u64) {
    fn walk(p: &Path, bytes: &mut u64, files: &mut u64) {
        for e in std::fs::read_dir(p).unwrap().flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                walk(&e.path(), bytes, files);
            } else {
                *bytes += m.len();
                *files += 1;
            }
        }
    }
    let (mut b, mut f) = (0, 0);
    walk(dir, &mut b, &mut f);
    (b, f)
}

fn gib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 30)
}

fn print_restart(label: &str, r: &Restart) {
    println!(
        "  restart {label:<22} live {:>7.1} ms  first scope {:>7.1} ms  ready {:>8.1} ms  peak RSS {:>6.1} MiB  segments read {}",
        r.live_ms, r.scope_ms, r.ready_ms, r.rss_mib, r.scanned
    );
}

/// Every restart of one store: clean stop and SIGKILL, warm and cold.
fn restarts(dir: &Path) {
    // a clean stop: the fill's store was dropped (checkpointed) already
    syncfs(dir);
    let warm = restart(dir);
    let warm = restart(dir).min_by_ready(warm);
    print_restart("clean, warm", &warm);
    syncfs(dir);
    drop_cache(dir);
    print_restart("clean, cold", &restart(dir));
    kill_under_traffic(dir);
    syncfs(dir);
    // the first restart after the kill recovers what it left; measure it
    // warm, then kill again for the cold one
    print_restart("SIGKILL, warm", &restart(dir));
    kill_under_traffic(dir);
    syncfs(dir);
    drop_cache(dir);
    print_restart("SIGKILL, cold", &restart(dir));
}

impl Restart {
    fn min_by_ready(self, other: Self) -> Self {
        if self.ready_ms <= other.ready_ms {
            self
        } else {
            other
        }
    }
}

/// Commands the eviction measurement makes maintenance evict.
const EVICT: u64 = 200;

/// Whole-command evictions under the server-wide tier, lowered so that
/// about `EVICT` of the oldest commands must go: evictions per second of
/// one maintenance pass, and as a ratio to the probe around it (each
/// eviction flushes).
fn evictions(dir: &Path, probe_dir: &Path) -> (u64, f64, f64) {
    let charged: i64 = {
        let s = open_store(dir);
        s.db()
            .query_row("SELECT command_charged FROM quota_totals", [], |r| r.get(0))
            .unwrap()
    };
    let charged = u64::try_from(charged).unwrap();
    let per = charged / held(dir).max(1);
    let mut opts = options();
    opts.tiers.global_total = charged.saturating_sub(EVICT * per);
    let mut s = open_store_with(dir, opts);
    s.recover(now_ms()).unwrap();
    let p0 = probe(probe_dir, 4096, Duration::from_millis(250));
    let t = Instant::now();
    let report = s.maintain(now_ms()).unwrap();
    let took = t.elapsed().as_secs_f64();
    let p1 = probe(probe_dir, 4096, Duration::from_millis(250));
    let n = report.evicted_quota;
    let rate = n as f64 / took;
    (n, rate, rate / mean(p0, p1))
}

/// Commands a store holds (what a kept store is filled on from).
fn held(dir: &Path) -> u64 {
    let s = open_store(dir);
    let n: i64 = s
        .db()
        .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
        .unwrap();
    u64::try_from(n).unwrap()
}

/// Rounds of the side-by-side rate measurement.
const ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The rates of every store in `stores` side by side in one run: rounds
/// that visit each store in turn, so every size sees the same flush modes
/// of the disk, `RATE_OPS / 4` operations of each kind per store and
/// round with a probe flush interleaved before each (the durable rate as a
/// ratio to the probe over the same time), then rounds without SQLite
/// flushes (the per-operation cost), then one eviction pass per store.
fn side_by_side(stores: &[(u64, PathBuf)], probe_dir: &Path) {
    let per = RATE_OPS / 4;
    let mut open: Vec<Store> = stores
        .iter()
        .map(|(_, dir)| {
            let mut s = open_store(dir);
            s.recover(now_ms()).unwrap();
            s
        })
        .collect();
    let mut probe = Probe::new(probe_dir);
    let n = stores.len();
    let (mut runs, mut terms, mut probes) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    for r in 0..ROUNDS {
        for (k, s) in open.iter_mut().enumerate() {
            let (run, terminal, p) = rates(s, (r as u64) * per, per, Some(&mut probe));
            runs[k].push(run);
            terms[k].push(terminal);
            probes[k].push(p);
        }
    }
    let (mut runs_off, mut terms_off) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for s in &open {
        s.db().execute_batch("PRAGMA synchronous = OFF").unwrap();
    }
    for r in 0..ROUNDS {
        for (k, s) in open.iter_mut().enumerate() {
            let (run, terminal, _) = rates(s, (r as u64) * per, per, None);
            runs_off[k].push(1e6 / run);
            terms_off[k].push(1e6 / terminal);
        }
    }
    drop(open);
    println!(
        "\nrates side by side ({ROUNDS} rounds visiting every size in turn, {per} operations of each kind per size and round; durable: ratio to a probe flush interleaved before each operation, median round; unflushed: us/op, median round):"
    );
    println!(
        "  {:>10}  {:>22}  {:>22}  {:>20}  {:>20}",
        "commands",
        "RunCommand durable",
        "terminal durable",
        "RunCommand unflushed",
        "terminal unflushed"
    );
    let mut first: Option<(f64, f64, f64, f64)> = None;
    for (k, (size, _)) in stores.iter().enumerate() {
        let (run, term) = (median(runs[k].clone()), median(terms[k].clone()));
        let p = median(probes[k].clone());
        let (run_off, term_off) = (median(runs_off[k].clone()), median(terms_off[k].clone()));
        println!(
            "  {size:>10}  {:>8.0}/s = {run:.2}x probe  {:>8.0}/s = {term:.2}x probe  {run_off:>17.1} us  {term_off:>17.1} us   (probe {p:.0} fdatasync/s)",
            run * p,
            term * p
        );
        match first {
            None => first = Some((run, term, run_off, term_off)),
            Some((r0, t0, ro, to)) => println!(
                "  {:>10}  against {}: durable RunCommand {:.0}%, terminal event {:.0}%; unflushed cost {:.0}% and {:.0}%",
                "",
                stores[0].0,
                100.0 * run / r0,
                100.0 * term / t0,
                100.0 * run_off / ro,
                100.0 * term_off / to
            ),
        }
    }
    for (size, dir) in stores {
        let (n, rate, ratio) = evictions(dir, probe_dir);
        println!(
            "  {size:>10}  eviction {rate:>6.0}/s = {ratio:.2}x probe ({n} commands evicted by one maintenance pass)"
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child-restart") {
        child_restart(Path::new(&args[i + 1]));
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--child-traffic") {
        child_traffic(Path::new(&args[i + 1]));
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--unflushed") {
        // a profile of the per-operation cost alone: `--unflushed DIR N`
        let dir = Path::new(&args[i + 1]);
        let n: u64 = args[i + 2].parse().unwrap();
        let base = held(dir);
        let mut s = open_store(dir);
        s.recover(now_ms()).unwrap();
        s.db().execute_batch("PRAGMA synchronous = OFF").unwrap();
        eprintln!("recovered; {n} operations of each kind follow");
        let (run, terminal, _) = rates(&mut s, base, n, None);
        println!(
            "unflushed: RunCommand {:.1} us/op, terminal event {:.1} us/op",
            1e6 / run,
            1e6 / terminal
        );
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--rates") {
        // `--rates DIR...`: kept stores, side by side
        let stores: Vec<(u64, PathBuf)> = args[i + 1..]
            .iter()
            .map(|d| (held(Path::new(d)), PathBuf::from(d)))
            .collect();
        let probe_dir = stores[0].1.parent().unwrap_or(&stores[0].1).to_path_buf();
        side_by_side(&stores, &probe_dir);
        return;
    }
    let sizes: Vec<u64> = std::env::var("RVBOX_BENCH_SCALE")
        .unwrap_or_else(|_| "10000,100000,1000000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("RVBOX_BENCH_SCALE: comma-separated counts")
        })
        .collect();
    let root = PathBuf::from(
        std::env::var("RVBOX_BENCH_DIR").unwrap_or_else(|_| "target/bench-store-scale".into()),
    );
    std::fs::create_dir_all(&root).unwrap();
    let scratch = tempfile::tempdir_in(&root).unwrap();
    println!(
        "store_scale: {CLIENTS} clients, {OUTPUT} B of output per command, rates over {RATE_OPS} operations, data in {}",
        root.display()
    );
    let keep = std::env::var_os("RVBOX_BENCH_KEEP").is_some_and(|v| v == "1");
    let dir = if keep {
        root.join("kept")
    } else {
        scratch.path().join("store")
    };
    let mut filled = if dir.exists() { held(&dir) } else { 0 };
    // a copy of the store at every size but the last, for the rates side
    // by side at the end
    let mut sized: Vec<(u64, PathBuf)> = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        // fill without SQLite flushes up to the size
        {
            let mut s = open_store(&dir);
            s.recover(now_ms()).unwrap();
            s.db().execute_batch("PRAGMA synchronous = OFF").unwrap();
            let t = Instant::now();
            fill(&mut s, filled, size.saturating_sub(filled));
            filled = filled.max(size);
            let took = t.elapsed().as_secs_f64();
            drop(s);
            syncfs(&dir);
            let (bytes, files) = du(&dir);
            println!(
                "\n{size} commands: {:.2} GiB on disk in {files} files (filled in {took:.0} s)",
                gib(bytes)
            );
        }
        if i + 1 < sizes.len() {
            let copy = scratch.path().join(format!("at-{size}"));
            let status = Command::new("cp")
                .arg("-a")
                .arg(&dir)
                .arg(&copy)
                .status()
                .unwrap();
            assert!(status.success(), "copy the store at {size}");
            sized.push((size, copy));
        }
        restarts(&dir);
        if i == 0 {
            // the same size filled with every flush on: restarts compare
            let flushed = scratch.path().join("flushed");
            {
                let mut s = open_store(&flushed);
                s.recover(now_ms()).unwrap();
                let t = Instant::now();
                fill(&mut s, 0, size);
                println!(
                    "\n{size} commands filled with every flush on (in {:.0} s), for comparison:",
                    t.elapsed().as_secs_f64()
                );
            }
            restarts(&flushed);
            std::fs::remove_dir_all(&flushed).unwrap();
        }
    }
    sized.push((sizes.last().copied().unwrap_or(filled), dir.clone()));
    side_by_side(&sized, scratch.path());
}
