//! The `/proc` diagnostics sampler (plan §7.5).
//!
//! One thread samples every running tree at the configured interval,
//! outside the pipe and event loops: CPU ticks, RSS and storage I/O summed
//! over the tree's processes (the members of its v2 cgroup, else of its
//! process group; the launcher is RVBox's, not the command's, and is left
//! out), the root's state, working directory and wait channel. A value that
//! cannot be read stays absent. Progress is a change of the tree's CPU
//! ticks, I/O counters, or its output, input and lifecycle activity (any
//! change, so a counter reset after a process exit counts too);
//! `suspected_hung` is set after the configured period without progress
//! and cleared on the next. It is diagnostic only: the sampler never
//! changes what the supervisor does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;

use crate::procfs;

/// `/proc` CPU times are in USER_HZ ticks, fixed at 100 per second by the
/// Linux ABI on every architecture RVBox builds for.
const USER_HZ: u64 = 100;
/// Longest working directory reported.
const MAX_CWD_BYTES: usize = 4096;
/// Longest wait channel reported.
const MAX_WCHAN_BYTES: usize = 128;
/// Trees sampled at most (the supervisor's own bound is lower).
pub(crate) const MAX_SAMPLED_TREES: usize = 4096;

/// Where a tree's processes are found.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub launcher_pid: u32,
    pub pgid: u32,
    pub cgroup: Option<PathBuf>,
    pub root_pid: u32,
    pub activity: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    cpu_ticks: Option<u64>,
    io_bytes: Option<u64>,
    activity: u64,
}

#[derive(Debug)]
struct Entry {
    target: Target,
    snapshot: Option<wire::ResourceSnapshot>,
    last: Option<Fingerprint>,
    since: Instant,
    hung: bool,
}

/// Where a change of a tree's progress state goes (the supervisor posts
/// it as a process event). Called outside every lock of the sampler.
pub(crate) type Report = Box<dyn Fn(Uuid7, wire::Diagnostics) + Send + Sync>;

struct Shared {
    entries: Mutex<BTreeMap<Uuid7, Entry>>,
    report: Report,
    stop: Mutex<bool>,
    wake: Condvar,
    interval: Duration,
    hung_after: Duration,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("interval", &self.interval)
            .field("hung_after", &self.hung_after)
            .finish_non_exhaustive()
    }
}

/// The sampler handle.
#[derive(Debug)]
pub(crate) struct Diagnostics {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Diagnostics {
    /// Starts the sampler thread; `report` hears every change of a tree's
    /// `suspected_hung`.
    pub(crate) fn start(
        interval: Duration,
        hung_after: Duration,
        report: Report,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            entries: Mutex::new(BTreeMap::new()),
            report,
            stop: Mutex::new(false),
            wake: Condvar::new(),
            interval: interval.max(Duration::from_millis(10)),
            hung_after,
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("rvbox-diagnostics".into())
            .spawn(move || run(&s))?;
        Ok(Self { shared })
    }

    pub(crate) fn add(&self, issue: Uuid7, target: Target) {
        let mut entries = lock(&self.shared.entries);
        if entries.len() >= MAX_SAMPLED_TREES {
            tracing::warn!(%issue, "diagnostics: too many trees; this one is not sampled");
            return;
        }
        entries.insert(
            issue,
            Entry {
                target,
                snapshot: None,
                last: None,
                since: Instant::now(),
                hung: false,
            },
        );
    }

    pub(crate) fn remove(&self, issue: &Uuid7) {
        lock(&self.shared.entries).remove(issue);
    }

    pub(crate) fn snapshot(&self, issue: &Uuid7) -> Option<wire::ResourceSnapshot> {
        lock(&self.shared.entries)
            .get(issue)
            .and_then(|e| e.snapshot.clone())
    }

    pub(crate) fn suspected_hung(&self, issue: &Uuid7) -> Option<bool> {
        lock(&self.shared.entries).get(issue).map(|e| e.hung)
    }

    pub(crate) fn stop(&self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
    }
}

impl Drop for Diagnostics {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(shared: &Shared) {
    loop {
        {
            let stop = lock(&shared.stop);
            if *stop {
                return;
            }
            let (stop, _) = shared
                .wake
                .wait_timeout(stop, shared.interval)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *stop {
                return;
            }
        }
        let targets: Vec<(Uuid7, Target)> = lock(&shared.entries)
            .iter()
            .map(|(i, e)| (*i, e.target.clone()))
            .collect();
        for (issue, target) in targets {
            let (snapshot, fp) = sample(&target);
            let now = Instant::now();
            let changed = {
                let mut entries = lock(&shared.entries);
                let Some(e) = entries.get_mut(&issue) else {
                    continue;
                };
                let mut changed = None;
                if e.last != Some(fp) {
                    if e.hung {
                        tracing::info!(%issue, "diagnostics: progress again; suspected_hung cleared");
                        changed = Some(wire::Diagnostics {
                            snapshot: Some(snapshot.clone()),
                            suspected_hung: false,
                            no_progress_since: None,
                        });
                    }
                    e.last = Some(fp);
                    e.since = now;
                    e.hung = false;
                } else if !e.hung && now.duration_since(e.since) >= shared.hung_after {
                    e.hung = true;
                    tracing::info!(%issue, "diagnostics: no observable progress; suspected_hung (diagnostic only)");
                    changed = Some(wire::Diagnostics {
                        snapshot: Some(snapshot.clone()),
                        suspected_hung: true,
                        no_progress_since: Some(wall_at(now, e.since)),
                    });
                }
                e.snapshot = Some(snapshot);
                changed
            };
            if let Some(d) = changed {
                (shared.report)(issue, d);
            }
        }
    }
}

/// The wall time of `then`, an instant at or before `now`.
fn wall_at(now: Instant, then: Instant) -> prost_types::Timestamp {
    let wall = SystemTime::now()
        .checked_sub(now.saturating_duration_since(then))
        .unwrap_or(UNIX_EPOCH);
    let d = wall.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn members(t: &Target) -> Option<Vec<u32>> {
    let all = match &t.cgroup {
        Some(dir) => procfs::cgroup_procs(dir).ok()?,
        None => procfs::group_members(t.pgid).ok()?,
    };
    Some(all.into_iter().filter(|p| *p != t.launcher_pid).collect())
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = procfs::read_bounded(Path::new(&format!("/proc/{pid}/status"))).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn io_bytes(pid: u32) -> Option<(u64, u64)> {
    let text = procfs::read_bounded(Path::new(&format!("/proc/{pid}/io"))).ok()?;
    let get = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some((get("read_bytes:")?, get("write_bytes:")?))
}

fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while end > 0 && !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

fn state(c: char) -> wire::ProcessState {
    match c {
        'R' => wire::ProcessState::Running,
        'S' => wire::ProcessState::Sleeping,
        'D' => wire::ProcessState::DiskSleep,
        'T' | 't' => wire::ProcessState::Stopped,
        'Z' => wire::ProcessState::Zombie,
        'I' => wire::ProcessState::Idle,
        _ => wire::ProcessState::Other,
    }
}

fn add(acc: &mut Option<u64>, v: Option<u64>) {
    if let Some(v) = v {
        *acc = Some(acc.unwrap_or(0).saturating_add(v));
    }
}

fn sample(t: &Target) -> (wire::ResourceSnapshot, Fingerprint) {
    let pids = members(t);
    let (mut user, mut system, mut rss, mut read, mut write) = (None, None, None, None, None);
    let mut count = None;
    if let Some(pids) = &pids {
        count = u32::try_from(pids.len()).ok();
        for &pid in pids {
            if let Ok(Some(s)) = procfs::read_stat(pid) {
                add(&mut user, Some(s.utime));
                add(&mut system, Some(s.stime));
            }
            add(
                &mut rss,
                status_kib(pid, "VmRSS:").map(|k| k.saturating_mul(1024)),
            );
            if let Some((r, w)) = io_bytes(pid) {
                add(&mut read, Some(r));
                add(&mut write, Some(w));
            }
        }
    }
    let root = procfs::read_stat(t.root_pid).ok().flatten();
    let cwd = std::fs::read_link(format!("/proc/{}/cwd", t.root_pid))
        .ok()
        .map(|p| cut(p.to_string_lossy().into_owned(), MAX_CWD_BYTES));
    let wchan = procfs::read_bounded(Path::new(&format!("/proc/{}/wchan", t.root_pid)))
        .ok()
        .map(|w| w.trim().to_owned())
        .filter(|w| !w.is_empty() && w != "0")
        .map(|w| cut(w, MAX_WCHAN_BYTES));
    let micros = |ticks: Option<u64>| ticks.map(|t| t.saturating_mul(1_000_000 / USER_HZ));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let snapshot = wire::ResourceSnapshot {
        sample_time: Some(prost_types::Timestamp {
            seconds: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
        }),
        cpu_user_micros: micros(user),
        cpu_system_micros: micros(system),
        rss_bytes: rss,
        io_read_bytes: read,
        io_write_bytes: write,
        process_state: root.map(|s| state(s.state) as i32),
        cwd,
        wait_reason: wchan,
        process_count: count,
    };
    let cpu_ticks = match (user, system) {
        (Some(u), Some(s)) => Some(u.saturating_add(s)),
        _ => None,
    };
    let io = match (read, write) {
        (Some(r), Some(w)) => Some(r.saturating_add(w)),
        _ => None,
    };
    let fp = Fingerprint {
        cpu_ticks,
        io_bytes: io,
        activity: t.activity.load(Ordering::Relaxed),
    };
    (snapshot, fp)
}
