#![cfg(unix)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The Unix supervisor with real processes: the `rvbox` binary of this
//! package is the launcher (`rvbox __launcher ...`).
//!
//! Tests that need cgroups check the detected layout at runtime and skip
//! with a message only when the facility is missing on the host.

use std::path::Path;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rvbox_client_core::process::{
    Exit, IoLimit, LaunchFailure, LaunchIdentity, LaunchSpec, ProcessEvent, ResourceLimits,
    Supervision,
};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_supervisor::{OrphanOutcome, Supervisor, SupervisorConfig, UnixSupervisor, V1Controller};
use tempfile::TempDir;

const WAIT: Duration = Duration::from_secs(15);
const GRACE: Duration = Duration::from_millis(300);

// ---- helpers -----------------------------------------------------------------

fn new_issue() -> Uuid7 {
    static COUNTER: AtomicU16 = AtomicU16::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let ms = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    let pid = std::process::id();
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6] = 0x70 | u8::try_from((n >> 8) & 0x0f).unwrap();
    b[7] = u8::try_from(n & 0xff).unwrap();
    b[8] = 0x80;
    b[9..13].copy_from_slice(&pid.to_be_bytes());
    b[13..15].copy_from_slice(&n.to_be_bytes());
    Uuid7::from_bytes("test", b).unwrap()
}

mod support;

fn config(dir: &Path, force_process_group: bool) -> SupervisorConfig {
    let mut c = support::supervisor_config(dir.join("run"));
    c.drain_grace = GRACE;
    c.kill_grace = Duration::from_secs(2);
    c.diagnostics_interval = Duration::from_millis(100);
    c.force_process_group = force_process_group;
    c
}

fn supervisor(dir: &Path, force_process_group: bool) -> UnixSupervisor {
    UnixSupervisor::new(config(dir, force_process_group)).unwrap()
}

fn sh() -> String {
    std::fs::canonicalize("/bin/sh")
        .unwrap()
        .display()
        .to_string()
}

fn spec(dir: &Path, script: &str) -> LaunchSpec {
    let issue = new_issue();
    let wrapper = dir.join(format!("{issue}.sh"));
    std::fs::write(&wrapper, script).unwrap();
    LaunchSpec {
        issue,
        shell: wire::ShellType::Sh,
        shell_path: sh(),
        wrapper_path: wrapper.display().to_string(),
        cwd: dir.display().to_string(),
        env: vec![],
        limits: ResourceLimits::default(),
    }
}

/// The next event of `issue` (others are a test failure).
fn next(sup: &mut UnixSupervisor, issue: &Uuid7) -> ProcessEvent {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no event for {issue} in time");
        if let Some(ev) = sup.next_event(left) {
            assert_eq!(ev.issue, *issue, "event of another command: {ev:?}");
            return ev.event;
        }
    }
}

fn until_ready(sup: &mut UnixSupervisor, issue: &Uuid7) -> LaunchIdentity {
    match next(sup, issue) {
        ProcessEvent::Ready(id) => id,
        other => panic!("expected Ready, got {other:?}"),
    }
}

fn release_and_run(sup: &mut UnixSupervisor, issue: &Uuid7) {
    sup.release(issue).unwrap();
    match next(sup, issue) {
        ProcessEvent::Running => {}
        other => panic!("expected Running, got {other:?}"),
    }
}

/// Every event up to and including `Drained`.
fn until_drained(sup: &mut UnixSupervisor, issue: &Uuid7) -> Vec<ProcessEvent> {
    let mut out = Vec::new();
    loop {
        let ev = next(sup, issue);
        let done = matches!(ev, ProcessEvent::Drained { .. });
        out.push(ev);
        if done {
            return out;
        }
    }
}

/// Events until one matches; all of them are returned.
fn until(
    sup: &mut UnixSupervisor,
    issue: &Uuid7,
    pred: impl Fn(&[ProcessEvent], &[u8]) -> bool,
) -> (Vec<ProcessEvent>, Vec<u8>) {
    let mut out = Vec::new();
    let mut stdout = Vec::new();
    loop {
        let ev = next(sup, issue);
        if let ProcessEvent::Output {
            stream: wire::OutputStream::Stdout,
            bytes,
            ..
        } = &ev
        {
            stdout.extend_from_slice(bytes);
        }
        assert!(
            !matches!(ev, ProcessEvent::Drained { .. }),
            "drained before the condition: {out:?}"
        );
        out.push(ev);
        if pred(&out, &stdout) {
            return (out, stdout);
        }
    }
}

fn stream_bytes(events: &[ProcessEvent], which: wire::OutputStream) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| match e {
            ProcessEvent::Output { stream, bytes, .. } if *stream == which => Some(bytes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn exits(events: &[ProcessEvent]) -> Vec<Exit> {
    events
        .iter()
        .filter_map(|e| match e {
            ProcessEvent::Exited(x) => Some(*x),
            _ => None,
        })
        .collect()
}

fn drained(events: &[ProcessEvent]) -> Vec<wire::OutputStream> {
    match events.last() {
        Some(ProcessEvent::Drained { incomplete }) => incomplete.clone(),
        other => panic!("last event is not Drained: {other:?}"),
    }
}

/// A live (non-zombie) process.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        let state = s
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        !matches!(state, Some("Z" | "X"))
    })
}

fn gone_within(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    !alive(pid)
}

/// The session of `pid` (field 6 of /proc/PID/stat), if it is alive.
fn session_of(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// Waits until `pid` leads a session of its own: a background `setsid`
/// may not have run yet when its parent has printed its pid and exited.
fn until_own_session(pid: u32) {
    let until = Instant::now() + Duration::from_secs(10);
    while session_of(pid) != Some(pid) {
        assert!(Instant::now() < until, "{pid} never left its session");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn first_pid(stdout: &[u8]) -> u32 {
    String::from_utf8_lossy(stdout)
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .expect("a pid on the first line")
}

fn modes() -> [bool; 2] {
    [false, true]
}

/// The cgroup-backed layout must be available on a Linux host with a
/// writable v2 tree; a missing one skips the cgroup half of a test (fails
/// it under `RVBOX_REQUIRE_CGROUPS=1`).
fn cgroups_or_skip(sup: &UnixSupervisor, test: &str) -> bool {
    if sup.mode() == Supervision::ProcessGroup {
        support::skip_cgroups(test, "no usable cgroup v2 tree on this host");
        return false;
    }
    true
}

// ---- tests ---------------------------------------------------------------------

#[test]
fn output_arrives_byte_for_byte_in_order_then_exit_and_drain() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        let mut spec = spec(
            dir.path(),
            "printf 'out-1'\nprintf 'err-1' >&2\nprintf 'out-2'\nprintf 'err-2' >&2\n\
             printf '\\001\\377\\000'\nprintf '%s' \"$GREETING\"\nexit 7\n",
        );
        spec.env = vec![("GREETING".into(), "hello there".into())];
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        let id = until_ready(&mut sup, &issue);
        assert_eq!(id.process_group, id.launcher_pid);
        assert!(id.birth_ticks > 0);
        assert_eq!(id.cgroup.is_some(), sup.mode() != Supervision::ProcessGroup);
        if let Some(cg) = &id.cgroup {
            let procs = std::fs::read_to_string(Path::new(cg).join("cgroup.procs")).unwrap();
            assert_eq!(procs.trim(), id.launcher_pid.to_string());
        }
        release_and_run(&mut sup, &issue);
        let events = until_drained(&mut sup, &issue);
        assert_eq!(
            stream_bytes(&events, wire::OutputStream::Stdout),
            b"out-1out-2\x01\xff\x00hello there".to_vec()
        );
        assert_eq!(
            stream_bytes(&events, wire::OutputStream::Stderr),
            b"err-1err-2".to_vec()
        );
        assert_eq!(exits(&events), vec![Exit::Code(7)]);
        assert_eq!(drained(&events), vec![]);
        // nothing but output, one exit and the final drain after Running
        assert!(events.iter().all(|e| matches!(
            e,
            ProcessEvent::Output { .. } | ProcessEvent::Exited(_) | ProcessEvent::Drained { .. }
        )));
        assert!(gone_within(id.launcher_pid, Duration::from_secs(2)));
        if let Some(cg) = &id.cgroup {
            assert!(!Path::new(cg).exists(), "command cgroup not removed");
        }
    }
}

#[test]
fn eof_before_release_runs_nothing() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let marker = dir.path().join("ran");
        let script = format!("touch {}\n", marker.display());
        // abort after Ready
        let mut sup = supervisor(dir.path(), force_pg);
        let spec1 = spec(dir.path(), &script);
        let issue = spec1.issue;
        sup.prepare(spec1).unwrap();
        let id = until_ready(&mut sup, &issue);
        assert!(alive(id.launcher_pid));
        sup.abort(&issue);
        let events = until_drained(&mut sup, &issue);
        assert_eq!(events, vec![ProcessEvent::Drained { incomplete: vec![] }]);
        assert!(!alive(id.launcher_pid), "Drained before the launcher died");
        // the daemon goes away after Ready
        let spec2 = spec(dir.path(), &script);
        let issue2 = spec2.issue;
        sup.prepare(spec2).unwrap();
        let id2 = until_ready(&mut sup, &issue2);
        drop(sup);
        assert!(gone_within(id2.launcher_pid, Duration::from_secs(3)));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!marker.exists(), "user code ran without a release");
        if let Some(cg) = &id.cgroup {
            assert!(!Path::new(cg).exists());
        }
        // the next start finds the launcher gone and removes its cgroup
        let mut fresh = supervisor(dir.path(), force_pg);
        assert_eq!(fresh.reap_orphan(&issue2, &id2), OrphanOutcome::Gone);
        if let Some(cg) = &id2.cgroup {
            assert!(!Path::new(cg).exists(), "leftover cgroup not removed");
        }
    }
}

#[test]
fn channel_loss_after_release_kills_the_tree() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        let spec = spec(dir.path(), "sleep 1000 &\necho $!\nwait\n");
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        let id = until_ready(&mut sup, &issue);
        release_and_run(&mut sup, &issue);
        let (_, stdout) = until(&mut sup, &issue, |_, out| out.ends_with(b"\n"));
        let sleeper = first_pid(&stdout);
        assert!(alive(sleeper));
        drop(sup);
        assert!(
            gone_within(sleeper, Duration::from_secs(3)),
            "the tree survived the channel loss (force_pg={force_pg})"
        );
        assert!(gone_within(id.launcher_pid, Duration::from_secs(3)));
        if let Some(cg) = &id.cgroup {
            // SIGKILLed tasks leave cgroup.procs a moment after they die
            let procs = Path::new(cg).join("cgroup.procs");
            let deadline = Instant::now() + WAIT;
            while !std::fs::read_to_string(&procs).unwrap().trim().is_empty() {
                assert!(Instant::now() < deadline, "the cgroup never emptied");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let mut fresh = supervisor(dir.path(), force_pg);
        assert_eq!(fresh.reap_orphan(&issue, &id), OrphanOutcome::Gone);
        if let Some(cg) = &id.cgroup {
            assert!(!Path::new(cg).exists(), "leftover cgroup not removed");
        }
    }
}

#[test]
fn kill_reaches_a_double_forked_grandchild() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        if !force_pg && !cgroups_or_skip(&sup, "kill_reaches_a_double_forked_grandchild") {
            continue;
        }
        let gc = dir.path().join("gc");
        let script = format!(
            "( (sleep 1000 & echo $! > {gc}.tmp && mv {gc}.tmp {gc}) & )\nsleep 1000\n",
            gc = gc.display()
        );
        let spec = spec(dir.path(), &script);
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        let id = until_ready(&mut sup, &issue);
        release_and_run(&mut sup, &issue);
        let deadline = Instant::now() + WAIT;
        while !gc.exists() {
            assert!(Instant::now() < deadline, "the grandchild never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        let grandchild: u32 = std::fs::read_to_string(&gc)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(alive(grandchild));
        assert_eq!(
            sup.signal(&issue, wire::SignalKind::Kill),
            wire::SignalOutcome::Delivered
        );
        let events = until_drained(&mut sup, &issue);
        assert_eq!(exits(&events), vec![Exit::Signal(9)]);
        assert_eq!(drained(&events), vec![]);
        assert!(
            gone_within(grandchild, Duration::from_secs(2)),
            "the double-forked grandchild survived (force_pg={force_pg})"
        );
        assert!(!alive(id.launcher_pid));
    }
}

#[test]
fn drain_grace_kills_a_residual_holding_stdout() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        let spec = spec(dir.path(), "sleep 1000 &\necho $!\nexit 3\n");
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        until_ready(&mut sup, &issue);
        release_and_run(&mut sup, &issue);
        let (_, stdout) = until(&mut sup, &issue, |evs, out| {
            evs.iter().any(|e| matches!(e, ProcessEvent::Exited(_))) && out.ends_with(b"\n")
        });
        let exited_at = Instant::now();
        let residual = first_pid(&stdout);
        assert!(alive(residual), "the residual should outlive the root");
        let events = until_drained(&mut sup, &issue);
        let waited = exited_at.elapsed();
        assert!(
            waited >= GRACE - Duration::from_millis(50),
            "drained before the grace: {waited:?}"
        );
        assert!(waited < Duration::from_secs(3), "drain took {waited:?}");
        // the residual was killed, its pipe ends closed with it: EOF came
        assert_eq!(drained(&events), vec![]);
        assert!(
            !alive(residual),
            "residual survived the grace (force_pg={force_pg})"
        );
    }
}

#[test]
fn a_setsid_escapee_is_contained_only_by_the_cgroup() {
    // docs/supervisor.md: a descendant that calls setsid leaves the process
    // group (the fallback cannot reach it), never the cgroup
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        if !force_pg && !cgroups_or_skip(&sup, "a_setsid_escapee_is_contained_only_by_the_cgroup") {
            continue;
        }
        let spec = spec(dir.path(), "setsid sleep 1000 &\necho $!\nexit 0\n");
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        until_ready(&mut sup, &issue);
        release_and_run(&mut sup, &issue);
        let (_, stdout) = until(&mut sup, &issue, |evs, out| {
            evs.iter().any(|e| matches!(e, ProcessEvent::Exited(_))) && out.ends_with(b"\n")
        });
        let escapee = first_pid(&stdout);
        until_own_session(escapee);
        if force_pg {
            // the group is empty while the escapee holds the pipes
            assert_eq!(
                sup.signal(&issue, wire::SignalKind::Term),
                wire::SignalOutcome::NoOpAfterExit
            );
        }
        let events = until_drained(&mut sup, &issue);
        if force_pg {
            assert_eq!(
                drained(&events),
                vec![wire::OutputStream::Stdout, wire::OutputStream::Stderr]
            );
            assert!(alive(escapee), "the process-group fallback cannot reach it");
            std::process::Command::new("kill")
                .args(["-9", &escapee.to_string()])
                .status()
                .unwrap();
        } else {
            assert_eq!(drained(&events), vec![]);
            assert!(!alive(escapee), "the cgroup must contain a setsid escapee");
        }
    }
}

#[test]
fn a_flat_out_writer_is_never_blocked_and_drops_are_exact() {
    const OUT: u64 = 64 * 1024 * 1024;
    const ERR: u64 = 3 * 1024 * 1024 + 17;
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let done = dir.path().join("done");
    let script = format!(
        "head -c {OUT} /dev/zero\nhead -c {ERR} /dev/zero >&2\ntouch {}\n",
        done.display()
    );
    let spec = spec(dir.path(), &script);
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    let started = Instant::now();
    release_and_run(&mut sup, &issue);
    // no event is consumed while the child writes
    while !done.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the child was blocked by an undrained consumer"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let events = until_drained(&mut sup, &issue);
    let mut got = [0u64; 2];
    let mut dropped = [0u64; 2];
    for e in &events {
        match e {
            ProcessEvent::Output { stream, bytes, .. } => {
                assert!(bytes.len() <= 64 * 1024);
                assert!(bytes.iter().all(|b| *b == 0));
                got[usize::from(*stream == wire::OutputStream::Stderr)] += bytes.len() as u64;
            }
            ProcessEvent::Dropped {
                stream,
                raw_bytes,
                first_ms,
                last_ms,
            } => {
                assert!(first_ms <= last_ms);
                dropped[usize::from(*stream == wire::OutputStream::Stderr)] += raw_bytes;
            }
            _ => {}
        }
    }
    assert_eq!(got[0] + dropped[0], OUT, "stdout: {got:?} {dropped:?}");
    assert_eq!(got[1] + dropped[1], ERR, "stderr: {got:?} {dropped:?}");
    assert!(
        dropped[0] > 0,
        "the queue never filled: the test proves nothing"
    );
    assert_eq!(exits(&events), vec![Exit::Code(0)]);
    assert_eq!(drained(&events), vec![]);
}

#[test]
fn memory_max_stops_a_large_allocation() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let layout = sup.layout().clone();
    let memory = layout
        .v1
        .iter()
        .any(|l| l.controller == V1Controller::Memory)
        || layout
            .v2
            .as_ref()
            .is_some_and(|v| v.controllers.contains("memory"));
    if !memory {
        support::skip_cgroups(
            "memory_max_stops_a_large_allocation",
            "no memory controller (v1 or delegated v2)",
        );
        return;
    }
    // doubling a shell string to 256 MiB under a 64 MiB limit
    let mut spec = spec(
        dir.path(),
        "s=x\ni=0\nwhile [ $i -lt 28 ]; do s=\"$s$s\"; i=$((i+1)); done\necho survived\n",
    );
    spec.limits.memory_max = Some(64 * 1024 * 1024);
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    let cg = sup.command_cgroups(&issue).unwrap().clone();
    let limit_file = cg
        .v1
        .iter()
        .find(|(c, _)| *c == V1Controller::Memory)
        .map(|(_, d)| d.join("memory.limit_in_bytes"))
        .or_else(|| cg.v2.as_ref().map(|d| d.join("memory.max")))
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(&limit_file).unwrap().trim(),
        (64u64 * 1024 * 1024).to_string()
    );
    release_and_run(&mut sup, &issue);
    let events = until_drained(&mut sup, &issue);
    assert!(
        !String::from_utf8_lossy(&stream_bytes(&events, wire::OutputStream::Stdout))
            .contains("survived"),
        "the allocation was not stopped"
    );
    match exits(&events).as_slice() {
        [Exit::Signal(9)] => {}
        [Exit::Code(c)] if *c != 0 => {}
        other => panic!("expected an OOM kill, got {other:?}"),
    }
    assert!(!limit_file.exists(), "memory cgroup not removed");
}

#[test]
fn pids_max_stops_a_bounded_fork_loop() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let layout = sup.layout().clone();
    let pids = layout.v1.iter().any(|l| l.controller == V1Controller::Pids)
        || layout
            .v2
            .as_ref()
            .is_some_and(|v| v.controllers.contains("pids"));
    if !pids {
        support::skip_cgroups(
            "pids_max_stops_a_bounded_fork_loop",
            "no pids controller (v1 or delegated v2)",
        );
        return;
    }
    let mut spec = spec(
        dir.path(),
        "i=0\nwhile [ $i -lt 50 ]; do i=$((i+1)); sleep 30 & echo $!; done\necho all-started\n",
    );
    spec.limits.pids_max = Some(8);
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    let cg = sup.command_cgroups(&issue).unwrap().clone();
    let pids_dir = cg
        .v1
        .iter()
        .find(|(c, _)| *c == V1Controller::Pids)
        .map(|(_, d)| d.clone())
        .or(cg.v2.clone())
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(pids_dir.join("pids.max"))
            .unwrap()
            .trim(),
        "8"
    );
    release_and_run(&mut sup, &issue);
    let (before, stdout) = until(&mut sup, &issue, |evs, _| {
        matches!(evs.last(), Some(ProcessEvent::Exited(_)))
    });
    // the fork failures were counted by the kernel, at most 8 tasks ran
    let events_file = std::fs::read_to_string(pids_dir.join("pids.events")).unwrap();
    let failures: u64 = events_file
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(failures > 0, "no fork failed under pids.max = 8");
    let current: u64 = std::fs::read_to_string(pids_dir.join("pids.current"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(current <= 8);
    let text = String::from_utf8_lossy(&stdout).into_owned();
    assert!(!text.contains("all-started"));
    assert!(text.lines().count() < 8, "{text}");
    assert!(matches!(exits(&before).as_slice(), [Exit::Code(c)] if *c != 0));
    let events = until_drained(&mut sup, &issue);
    assert_eq!(drained(&events), vec![]);
    assert!(!pids_dir.exists(), "pids cgroup not removed");
}

#[test]
fn an_unenforceable_profile_is_refused_before_user_code() {
    let dir = TempDir::new().unwrap();
    let marker = dir.path().join("ran");
    let script = format!("touch {}\n", marker.display());
    let refused = |sup: &mut UnixSupervisor, limits: ResourceLimits| {
        let mut s = spec(dir.path(), &script);
        s.limits = limits;
        let issue = s.issue;
        let dirs = sup.layout().command_dirs(&issue);
        sup.prepare(s).unwrap();
        let events = until_drained(sup, &issue);
        match events.as_slice() {
            [
                ProcessEvent::Failed(LaunchFailure::Permanent(reason)),
                ProcessEvent::Drained { incomplete },
            ] => {
                assert!(reason.contains("unsupported"), "{reason}");
                assert!(incomplete.is_empty());
            }
            other => panic!("expected a permanent refusal, got {other:?}"),
        }
        for d in dirs.dirs() {
            assert!(!d.exists(), "{} left behind", d.display());
        }
    };
    // no controllers at all
    let mut pg = supervisor(dir.path(), true);
    refused(
        &mut pg,
        ResourceLimits {
            memory_max: Some(64 << 20),
            ..ResourceLimits::default()
        },
    );
    // this host's layout: io.max needs a delegated v2 io controller, and
    // memory.high has no v1 equivalent
    let mut sup = supervisor(dir.path(), false);
    let layout = sup.layout().clone();
    let v2_has = |c: &str| {
        layout
            .v2
            .as_ref()
            .is_some_and(|v| v.controllers.contains(c))
    };
    if v2_has("io") {
        eprintln!("an_unenforceable_profile: io.max is enforceable here; that half is skipped");
    } else {
        refused(
            &mut sup,
            ResourceLimits {
                io_max: vec![IoLimit {
                    major: 8,
                    minor: 0,
                    read_bps: Some(1 << 20),
                    write_bps: None,
                    read_iops: None,
                    write_iops: None,
                }],
                ..ResourceLimits::default()
            },
        );
    }
    if !v2_has("memory") {
        refused(
            &mut sup,
            ResourceLimits {
                memory_high: Some(64 << 20),
                ..ResourceLimits::default()
            },
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(!marker.exists(), "user code ran for a refused profile");
}

#[test]
fn an_attacker_path_cannot_choose_the_shell() {
    let dir = TempDir::new().unwrap();
    let evil = dir.path().join("evil");
    std::fs::create_dir(&evil).unwrap();
    let marker = dir.path().join("pwned");
    for name in ["sh", "bash", "dash"] {
        let p = evil.join(name);
        std::fs::write(&p, format!("#!/bin/dash\ntouch {}\n", marker.display())).unwrap();
        std::process::Command::new("chmod")
            .args(["755", &p.display().to_string()])
            .status()
            .unwrap();
    }
    let mut sup = supervisor(dir.path(), false);
    let mut spec = spec(dir.path(), "echo ok\n");
    spec.env = vec![
        (
            "LD_PRELOAD".into(),
            evil.join("missing.so").display().to_string(),
        ),
        ("PATH".into(), evil.display().to_string()),
    ];
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    let events = until_drained(&mut sup, &issue);
    assert_eq!(stream_bytes(&events, wire::OutputStream::Stdout), b"ok\n");
    assert_eq!(exits(&events), vec![Exit::Code(0)]);
    assert!(
        !marker.exists(),
        "a PATH lookup picked the attacker's shell"
    );
}

#[test]
fn reap_orphan_kills_a_detached_launch_and_never_a_stranger() {
    for force_pg in modes() {
        let dir = TempDir::new().unwrap();
        let mut sup = supervisor(dir.path(), force_pg);
        let spec = spec(dir.path(), "sleep 1000 &\necho $!\nwait\n");
        let issue = spec.issue;
        sup.prepare(spec).unwrap();
        until_ready(&mut sup, &issue);
        release_and_run(&mut sup, &issue);
        let (_, stdout) = until(&mut sup, &issue, |_, out| out.ends_with(b"\n"));
        let sleeper = first_pid(&stdout);
        // the daemon "crashes": the launch stays behind, its launcher alive
        let identity = sup.detach_for_test(&issue).unwrap();
        assert!(alive(identity.launcher_pid) && alive(sleeper));
        drop(sup);

        let mut fresh = supervisor(dir.path(), force_pg);
        // a stranger: a live group leader whose birth identity differs
        let mut stranger = std::process::Command::new("setsid")
            .args(["sleep", "30"])
            .spawn()
            .unwrap();
        let leader = Instant::now() + WAIT;
        while !std::fs::read_to_string(format!("/proc/{}/stat", stranger.id())).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(2))
                == Some(stranger.id().to_string().as_str())
        }) {
            assert!(Instant::now() < leader, "the stranger never led its group");
            std::thread::sleep(Duration::from_millis(5));
        }
        let fake = LaunchIdentity {
            launcher_pid: stranger.id(),
            process_group: stranger.id(),
            birth_ticks: 1,
            cgroup: None,
        };
        assert_eq!(fresh.reap_orphan(&new_issue(), &fake), OrphanOutcome::Gone);
        let ourselves = LaunchIdentity {
            launcher_pid: std::process::id(),
            process_group: std::process::id(),
            birth_ticks: 1,
            cgroup: None,
        };
        assert_eq!(
            fresh.reap_orphan(&new_issue(), &ourselves),
            OrphanOutcome::Gone
        );
        assert!(alive(stranger.id()), "a stranger was killed");
        // the stranger's true birth, but a group that is not its own: the
        // record is inconsistent, so nothing is signalled
        let born = std::fs::read_to_string(format!("/proc/{}/stat", stranger.id()))
            .unwrap()
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(19))
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap();
        let borrowed_group = LaunchIdentity {
            launcher_pid: stranger.id(),
            process_group: std::process::id(),
            birth_ticks: born,
            cgroup: None,
        };
        assert_eq!(
            fresh.reap_orphan(&new_issue(), &borrowed_group),
            OrphanOutcome::Unverified
        );
        assert!(alive(stranger.id()), "a stranger was killed");

        assert_eq!(fresh.reap_orphan(&issue, &identity), OrphanOutcome::Killed);
        assert!(!alive(identity.launcher_pid));
        assert!(gone_within(sleeper, Duration::from_secs(2)));
        if let Some(cg) = &identity.cgroup {
            assert!(!Path::new(cg).exists(), "orphan cgroup not removed");
        }
        // already gone
        assert_eq!(fresh.reap_orphan(&issue, &identity), OrphanOutcome::Gone);
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }
}

#[test]
fn signals_map_to_the_portable_set_only() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let rec = dir.path().join("rec");
    // before release: cancelled, never launched
    let early = spec(dir.path(), "echo never\n");
    let early_issue = early.issue;
    sup.prepare(early).unwrap();
    until_ready(&mut sup, &early_issue);
    assert_eq!(
        sup.signal(&early_issue, wire::SignalKind::Term),
        wire::SignalOutcome::CancelledBeforeLaunch
    );
    assert_eq!(
        until_drained(&mut sup, &early_issue),
        vec![ProcessEvent::Drained { incomplete: vec![] }]
    );

    let script = format!(
        "for s in HUP INT TERM USR1 USR2; do trap \"echo $s >> {rec}\" $s; done\n\
         echo ready\nwhile :; do sleep 0.05; done\n",
        rec = rec.display()
    );
    let spec = spec(dir.path(), &script);
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    until(&mut sup, &issue, |_, out| out.ends_with(b"ready\n"));
    assert_eq!(
        sup.signal(&issue, wire::SignalKind::Unspecified),
        wire::SignalOutcome::Failed
    );
    let mut want = String::new();
    for (kind, name) in [
        (wire::SignalKind::Hup, "HUP"),
        (wire::SignalKind::Int, "INT"),
        (wire::SignalKind::Term, "TERM"),
        (wire::SignalKind::Usr1, "USR1"),
        (wire::SignalKind::Usr2, "USR2"),
    ] {
        assert_eq!(sup.signal(&issue, kind), wire::SignalOutcome::Delivered);
        want.push_str(name);
        want.push('\n');
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if std::fs::read_to_string(&rec).unwrap_or_default() == want {
                break;
            }
            assert!(Instant::now() < deadline, "{name} was not delivered");
            std::thread::sleep(Duration::from_millis(10));
        }
        // the shell survives every trapped signal (so does its watchdog)
        while sup.next_event(Duration::ZERO).is_some() {}
    }
    assert_eq!(
        sup.signal(&issue, wire::SignalKind::Kill),
        wire::SignalOutcome::Delivered
    );
    let events = until_drained(&mut sup, &issue);
    assert_eq!(exits(&events), vec![Exit::Signal(9)]);
    assert_eq!(
        sup.signal(&issue, wire::SignalKind::Term),
        wire::SignalOutcome::Failed,
        "a command no longer supervised"
    );
}

#[test]
fn stdin_writes_arrive_in_order_and_close_ends_input() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let spec = spec(dir.path(), "cat\necho end\n");
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    for (seq, text) in [(1u64, "one "), (2, "two "), (3, "three\n")] {
        sup.write_stdin(&issue, seq, text.as_bytes().to_vec())
            .unwrap();
    }
    sup.close_stdin(&issue);
    assert!(sup.write_stdin(&issue, 4, b"late".to_vec()).is_err());
    let events = until_drained(&mut sup, &issue);
    let acks: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            ProcessEvent::StdinWritten { write_seq } => Some(*write_seq),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![1, 2, 3]);
    assert_eq!(
        stream_bytes(&events, wire::OutputStream::Stdout),
        b"one two three\nend\n"
    );
    assert_eq!(exits(&events), vec![Exit::Code(0)]);
}

#[test]
fn diagnostics_sample_the_running_tree() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let spec = spec(dir.path(), "echo go\nsleep 1000\n");
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    until(&mut sup, &issue, |_, out| out.ends_with(b"go\n"));
    let deadline = Instant::now() + Duration::from_secs(5);
    let snap = loop {
        if let Some(s) = sup.snapshot(&issue)
            && s.process_count == Some(2)
        {
            break s;
        }
        assert!(Instant::now() < deadline, "no sample of the tree");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(snap.sample_time.is_some());
    assert!(snap.rss_bytes.is_some_and(|r| r > 0));
    assert!(snap.cpu_user_micros.is_some());
    assert_eq!(snap.cwd.as_deref(), Some(dir.path().to_str().unwrap()));
    assert_eq!(sup.suspected_hung(&issue), Some(false));
    assert_eq!(
        sup.signal(&issue, wire::SignalKind::Kill),
        wire::SignalOutcome::Delivered
    );
    until_drained(&mut sup, &issue);
    assert!(sup.snapshot(&issue).is_none());
}

#[test]
fn stop_all_terminates_every_tree() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    // one that ignores TERM, one that does not, one never released
    let stubborn = spec(
        dir.path(),
        "trap '' TERM\necho up\nwhile :; do sleep 0.05; done\n",
    );
    let plain = spec(dir.path(), "echo up\nsleep 1000\n");
    let blocked = spec(dir.path(), "echo never\n");
    let ids: Vec<Uuid7> = [&stubborn, &plain, &blocked]
        .iter()
        .map(|s| s.issue)
        .collect();
    for s in [stubborn, plain, blocked] {
        sup.prepare(s).unwrap();
    }
    let mut ready = 0;
    let mut running = 0;
    let deadline = Instant::now() + WAIT;
    while ready < 3 || running < 2 {
        assert!(Instant::now() < deadline);
        if let Some(ev) = sup.next_event(Duration::from_millis(100)) {
            match ev.event {
                ProcessEvent::Ready(_) => {
                    ready += 1;
                    if ev.issue != ids[2] {
                        sup.release(&ev.issue).unwrap();
                    }
                }
                ProcessEvent::Output { .. } => running += 1,
                _ => {}
            }
        }
    }
    let t0 = Instant::now();
    sup.stop_all();
    assert!(t0.elapsed() < Duration::from_secs(10));
    let mut drained = std::collections::BTreeSet::new();
    let mut exits_seen = Vec::new();
    while drained.len() < 3 {
        assert!(Instant::now() < deadline + WAIT);
        if let Some(ev) = sup.next_event(Duration::from_millis(100)) {
            match ev.event {
                ProcessEvent::Drained { .. } => {
                    drained.insert(ev.issue);
                }
                ProcessEvent::Exited(x) => exits_seen.push((ev.issue, x)),
                _ => {}
            }
        }
    }
    assert!(
        exits_seen.contains(&(ids[0], Exit::Signal(9))),
        "{exits_seen:?}"
    );
    assert!(
        exits_seen.contains(&(ids[1], Exit::Signal(15))),
        "{exits_seen:?}"
    );
    assert!(!exits_seen.iter().any(|(i, _)| *i == ids[2]));
}

#[test]
fn suspected_hung_follows_progress() {
    let dir = TempDir::new().unwrap();
    let mut c = config(dir.path(), false);
    c.suspected_hung_after = Duration::from_millis(400);
    c.diagnostics_interval = Duration::from_millis(50);
    let mut sup = UnixSupervisor::new(c).unwrap();
    let spec = spec(dir.path(), "while read l; do echo \"$l\"; done\n");
    let issue = spec.issue;
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    // each change of the state is also reported as a process event, once
    let mut reported: Vec<wire::Diagnostics> = Vec::new();
    let mut wait_for = |sup: &mut UnixSupervisor, want: bool| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            while let Some(ev) = sup.next_event(Duration::from_millis(10)) {
                if let ProcessEvent::Diagnostics(d) = ev.event {
                    assert_eq!(ev.issue, issue);
                    reported.push(d);
                }
            }
            if sup.suspected_hung(&issue) == Some(want)
                && reported.last().is_some_and(|d| d.suspected_hung == want)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "suspected_hung never became {want} (reported {reported:?})"
            );
        }
    };
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    wait_for(&mut sup, true);
    // it stays set while nothing progresses (its own report is not
    // progress): several sampling intervals, still handling events
    let hold = Instant::now() + Duration::from_millis(300);
    while Instant::now() < hold {
        while let Some(ev) = sup.next_event(Duration::from_millis(10)) {
            assert!(
                !matches!(ev.event, ProcessEvent::Diagnostics(_)),
                "a second report without progress: {ev:?}"
            );
        }
    }
    assert_eq!(sup.suspected_hung(&issue), Some(true));
    sup.write_stdin(&issue, 1, b"wake\n".to_vec()).unwrap();
    wait_for(&mut sup, false);
    sup.close_stdin(&issue);
    let events = until_drained(&mut sup, &issue);
    assert_eq!(exits(&events), vec![Exit::Code(0)]);
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, ProcessEvent::Diagnostics(_))),
        "diagnostics after the tree stopped running"
    );
    assert_eq!(reported.len(), 2, "{reported:?}");
    let hung = &reported[0];
    assert!(hung.suspected_hung);
    let since = hung.no_progress_since.as_ref().unwrap().seconds;
    assert!(since + 1 >= i64::try_from(before).unwrap(), "{hung:?}");
    assert!(
        hung.snapshot
            .as_ref()
            .is_some_and(|s| s.rss_bytes.is_some())
    );
    let cleared = &reported[1];
    assert!(!cleared.suspected_hung && cleared.no_progress_since.is_none());
}

#[test]
fn unsupported_shells_and_unusable_paths_are_refused() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    let plain = dir.path().join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\n").unwrap();
    type Change = Box<dyn Fn(&mut LaunchSpec)>;
    let cases: Vec<Change> = vec![
        Box::new(|s| s.shell = wire::ShellType::Cmd),
        Box::new(|s| s.shell = wire::ShellType::Powershell),
        Box::new(move |s| s.shell_path = plain.display().to_string()),
        Box::new(|s| s.shell_path = "sh".into()),
        Box::new(|s| s.cwd = "/nonexistent/dir".into()),
        Box::new(|s| s.env = vec![("A=B".into(), "x".into())]),
    ];
    for change in cases {
        let mut s = spec(dir.path(), "echo never\n");
        change(&mut s);
        let issue = s.issue;
        sup.prepare(s).unwrap();
        match until_drained(&mut sup, &issue).as_slice() {
            [
                ProcessEvent::Failed(LaunchFailure::Permanent(_)),
                ProcessEvent::Drained { incomplete },
            ] => assert!(incomplete.is_empty()),
            other => panic!("expected a permanent refusal, got {other:?}"),
        }
    }
    // "wait forever" is a valid timeout
    let mut s = spec(dir.path(), "echo never\n");
    s.shell = wire::ShellType::Cmd;
    sup.prepare(s).unwrap();
    let first = sup.next_event(Duration::MAX).unwrap().event;
    assert!(matches!(first, ProcessEvent::Failed(_)), "{first:?}");
    let second = sup.next_event(Duration::MAX).unwrap().event;
    assert!(matches!(second, ProcessEvent::Drained { .. }), "{second:?}");
}

#[test]
fn a_stale_cgroup_of_an_unrecorded_launch_is_reclaimed_before_the_retry() {
    let dir = TempDir::new().unwrap();
    let mut sup = supervisor(dir.path(), false);
    if !cgroups_or_skip(&sup, "stale cgroup") {
        return;
    }
    let spec = spec(dir.path(), "printf again\n");
    let issue = spec.issue;
    // a daemon that crashed before `launch_prepared` was durable left the
    // command's cgroup behind (empty: its blocked launcher died with the
    // channel)
    let parent = sup.layout().v2.as_ref().unwrap().parent.clone();
    let stale = parent.join(issue.to_string());
    std::fs::create_dir_all(&stale).unwrap();
    sup.prepare(spec).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    let events = until_drained(&mut sup, &issue);
    assert_eq!(
        stream_bytes(&events, wire::OutputStream::Stdout),
        b"again".to_vec()
    );
    assert!(
        !stale.exists(),
        "the command cgroup is removed after the run"
    );
}

#[test]
fn a_shell_that_changed_since_it_was_validated_or_was_never_validated_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = TempDir::new().unwrap();
    let copy = dir.path().join("validated-sh");
    std::fs::copy(sh(), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let marker = dir.path().join("ran");
    let script = format!("touch {}\n", marker.display());
    let mut c = config(dir.path(), true);
    c.validated_shell(&copy).unwrap();
    let mut sup = UnixSupervisor::new(c).unwrap();
    let refused = |sup: &mut UnixSupervisor, path: &Path, want: &str| {
        let mut s = spec(dir.path(), &script);
        s.shell_path = path.display().to_string();
        let issue = s.issue;
        sup.prepare(s).unwrap();
        match until_drained(sup, &issue).as_slice() {
            [
                ProcessEvent::Failed(LaunchFailure::Permanent(reason)),
                ProcessEvent::Drained { .. },
            ] => assert!(reason.contains(want), "{reason}"),
            other => panic!("expected a permanent refusal, got {other:?}"),
        }
    };
    // as validated, it runs
    let mut s = spec(dir.path(), &script);
    s.shell_path = copy.display().to_string();
    let issue = s.issue;
    sup.prepare(s).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    assert_eq!(exits(&until_drained(&mut sup, &issue)), vec![Exit::Code(0)]);
    assert!(marker.exists());
    std::fs::remove_file(&marker).unwrap();
    // replaced in place by another file (a new inode at the same path)
    let replacement = dir.path().join("other-sh");
    std::fs::copy(sh(), &replacement).unwrap();
    std::fs::set_permissions(&replacement, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&replacement, &copy).unwrap();
    refused(&mut sup, &copy, "changed since it was validated");
    // a shell the startup never validated
    let other = dir.path().join("never-validated-sh");
    std::fs::copy(sh(), &other).unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o755)).unwrap();
    refused(&mut sup, &other, "not one validated at startup");
    std::thread::sleep(Duration::from_millis(50));
    assert!(!marker.exists(), "a refused shell ran user code");
}

/// A daemon started under `nohup`, or as a background job of a shell,
/// inherits HUP, INT or QUIT ignored; an ignored disposition survives
/// `exec`, and a shell cannot trap a signal ignored at its start. The
/// portable-set test runs again in a process that inherited every one of
/// them ignored: each must still reach the command.
#[test]
fn signals_reach_a_command_of_a_daemon_that_inherited_them_ignored() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(
            "trap '' HUP INT QUIT TERM USR1 USR2; \
             exec \"$0\" --exact signals_map_to_the_portable_set_only --test-threads 1",
        )
        .arg(&exe)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `exec.allowed_cwd_roots` is checked after resolution, immediately
/// before the launch: a working directory inside a root that is a symbolic
/// link out of it is refused permanently, naming what it resolves to, and
/// nothing runs; one inside the root runs in its resolved path.
#[test]
fn a_working_directory_that_resolves_outside_the_roots_is_refused_before_anything_runs() {
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("root");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
    let mut c = config(dir.path(), true);
    c.cwd_roots = vec![root.clone()];
    let mut sup = UnixSupervisor::new(c).unwrap();
    let marker = dir.path().join("ran");
    let script = format!("pwd > {}\n", marker.display());

    let mut s = spec(dir.path(), &script);
    s.cwd = root.join("escape").display().to_string();
    let issue = s.issue;
    sup.prepare(s).unwrap();
    until_ready(&mut sup, &issue);
    sup.release(&issue).unwrap();
    let events = until_drained(&mut sup, &issue);
    let refused = events.iter().find_map(|e| match e {
        ProcessEvent::Failed(LaunchFailure::Permanent(reason)) => Some(reason.clone()),
        _ => None,
    });
    let reason = refused.unwrap_or_else(|| panic!("expected a permanent refusal: {events:?}"));
    assert!(
        reason.contains("outside every allowed root") && reason.contains("outside"),
        "{reason}"
    );
    assert!(!marker.exists(), "nothing ran");

    // inside the root: it runs, in the resolved directory
    std::fs::create_dir_all(root.join("inner")).unwrap();
    std::os::unix::fs::symlink(root.join("inner"), root.join("stays")).unwrap();
    let mut s = spec(dir.path(), &script);
    s.cwd = root.join("stays").display().to_string();
    let issue = s.issue;
    sup.prepare(s).unwrap();
    until_ready(&mut sup, &issue);
    release_and_run(&mut sup, &issue);
    assert_eq!(exits(&until_drained(&mut sup, &issue)), vec![Exit::Code(0)]);
    let pwd = std::fs::read_to_string(&marker).unwrap();
    assert_eq!(
        pwd.trim_end(),
        std::fs::canonicalize(root.join("inner"))
            .unwrap()
            .display()
            .to_string()
    );
}

/// Layouts detected at once in one process agree: each detection probes
/// the v2 tree with its own probe directory (with one name per process,
/// one thread removed the probe another was reading, which then fell back
/// to process groups and skipped its cgroup checks silently).
#[test]
fn layouts_detected_at_once_in_one_process_all_find_the_same_tree() {
    let alone = rvbox_supervisor::CgroupLayout::detect(None).mode;
    for _ in 0..20 {
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let modes: Vec<_> = (0..8)
            .map(|_| {
                let start = std::sync::Arc::clone(&start);
                std::thread::spawn(move || {
                    start.wait();
                    rvbox_supervisor::CgroupLayout::detect(None).mode
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(
            modes.iter().all(|m| *m == alone),
            "alone {alone:?}, at once {modes:?}"
        );
    }
}
