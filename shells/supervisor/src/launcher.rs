//! The blocked launcher: the internal mode `rvbox __launcher ...` (plan
//! §7.4).
//!
//! In order, before any user code: `setsid()` (a new session and process
//! group led by the launcher), child subreaper (orphans of the tree are
//! reparented here and reaped), connect to the daemon's release socket,
//! place itself into its command cgroups by writing its own pid into each
//! `cgroup.procs` (v2 first, then every v1 limit cgroup), and report
//! `Ready` with its pid, process group and `/proc/self/stat` start time.
//! Then it blocks for the one-byte release. End of stream instead of the
//! release: it exits and nothing ran.
//!
//! On release it receives the child's three pipe ends, checks the shell
//! path again (a regular, executable file that is not a symlink), starts
//! its watchdog thread (before the shell, so that a tree using up its
//! `pids.max` cannot keep the watchdog from starting), creates
//! `[shell_path, wrapper_path]` (absolute path, no `PATH` search) in its
//! own process group with the working directory and the daemon's
//! environment plus the overrides, drops its own copies of the pipe ends
//! and reports `ExecOk` or the failure. It then stays as the watchdog: it
//! reports the shell's exit, reaps every orphan of the tree, exits quietly
//! on the daemon's finish byte, and on end of stream (the daemon is gone)
//! kills the whole tree (`cgroup.kill` where it has a v2 cgroup, then
//! `killpg(SIGKILL)`), itself included.
//!
//! `clone3` with `CLONE_INTO_CGROUP` is not used: it needs unsafe code,
//! which RVBox forbids. The launcher placing itself before it reports
//! `Ready` (and the daemon verifying the placement in `/proc/<pid>/cgroup`
//! before it accepts it) is equivalent here, because no user code can run
//! before the release, and every process of the tree descends from the
//! placed launcher.
//!
//! The environment overrides reach the launcher encoded as
//! `__RVBOX_LAUNCH_ENV_<n>=KEY=VALUE`, never as themselves: an override
//! such as `LD_PRELOAD` must not act on the launcher's own loading before
//! the release. Only the shell gets them decoded.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rustix::io::Errno;
use rustix::process::{Signal, WaitOptions};

use crate::channel::{self, Received};
use crate::frame::{self, Record};
use crate::{cgroup, procfs};

/// The first argument of the `rvbox` binary that selects the launcher mode.
pub const LAUNCHER_MODE_ARG: &str = "__launcher";
/// Prefix of the launcher's encoded environment overrides.
pub(crate) const ENV_PREFIX: &str = "__RVBOX_LAUNCH_ENV_";

/// Bad arguments.
const EXIT_USAGE: i32 = 2;
/// Setup before the release failed (reported where possible).
const EXIT_SETUP: i32 = 3;
/// The shell could not be created (reported).
const EXIT_REFUSED: i32 = 4;
/// The channel was lost after release; the tree was killed.
const EXIT_CHANNEL_LOST: i32 = 5;
/// Pause of the reaper while the launcher has no child.
const ORPHAN_POLL: Duration = Duration::from_millis(50);

/// The launcher's arguments.
#[derive(Debug, Default)]
struct Args {
    socket: PathBuf,
    shell: PathBuf,
    wrapper: PathBuf,
    cwd: PathBuf,
    /// `exec.allowed_cwd_roots`: the working directory must resolve under
    /// one of them (none given: not checked).
    cwd_roots: Vec<PathBuf>,
    cgroup_v2: Option<PathBuf>,
    cgroup_v1: Vec<PathBuf>,
}

/// Builds the launcher's own arguments (after the mode argument).
pub(crate) fn launcher_args(
    socket: &Path,
    shell: &Path,
    wrapper: &Path,
    cwd: &Path,
    cwd_roots: &[PathBuf],
    cgroups: &cgroup::CommandCgroups,
) -> Vec<OsString> {
    let mut out: Vec<OsString> = Vec::new();
    let mut push = |flag: &str, v: &Path| {
        out.push(flag.into());
        out.push(v.as_os_str().to_owned());
    };
    push("--socket", socket);
    push("--shell", shell);
    push("--wrapper", wrapper);
    push("--cwd", cwd);
    for root in cwd_roots {
        push("--cwd-root", root);
    }
    if let Some(v2) = &cgroups.v2 {
        push("--cgroup-v2", v2);
    }
    for (_, dir) in &cgroups.v1 {
        push("--cgroup-v1", dir);
    }
    out
}

fn parse(args: Vec<OsString>) -> Result<Args, String> {
    let mut out = Args::default();
    let mut it = args.into_iter();
    let (mut socket, mut shell, mut wrapper, mut cwd) = (None, None, None, None);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .map(PathBuf::from)
            .ok_or_else(|| format!("{} needs a value", flag.to_string_lossy()))?;
        if !value.is_absolute() {
            return Err(format!("{} must be absolute", flag.to_string_lossy()));
        }
        match flag.to_str() {
            Some("--socket") => socket = Some(value),
            Some("--shell") => shell = Some(value),
            Some("--wrapper") => wrapper = Some(value),
            Some("--cwd") => cwd = Some(value),
            Some("--cwd-root") => out.cwd_roots.push(value),
            Some("--cgroup-v2") => out.cgroup_v2 = Some(value),
            Some("--cgroup-v1") => out.cgroup_v1.push(value),
            _ => return Err(format!("unknown argument {}", flag.to_string_lossy())),
        }
    }
    out.socket = socket.ok_or("--socket is required")?;
    out.shell = shell.ok_or("--shell is required")?;
    out.wrapper = wrapper.ok_or("--wrapper is required")?;
    out.cwd = cwd.ok_or("--cwd is required")?;
    Ok(out)
}

/// The working directory `cwd` with every symbolic link resolved, when it
/// is a directory that lies under one of `roots` (each resolved too;
/// `exec.allowed_cwd_roots`; none: not checked). The tree then starts in
/// the resolved path, so a link swapped afterwards cannot move it.
///
/// # Errors
/// The reason, naming the directory, what it resolves to and the roots.
pub(crate) fn resolved_cwd(cwd: &Path, roots: &[PathBuf]) -> Result<PathBuf, String> {
    let real = std::fs::canonicalize(cwd).map_err(|e| {
        format!(
            "working directory {} cannot be resolved: {e}",
            cwd.display()
        )
    })?;
    if !real.is_dir() {
        return Err(format!(
            "working directory {} is not a directory",
            cwd.display()
        ));
    }
    if roots.is_empty()
        || roots
            .iter()
            .any(|root| std::fs::canonicalize(root).is_ok_and(|r| real.starts_with(r)))
    {
        return Ok(real);
    }
    let listed: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    Err(format!(
        "working directory {} resolves to {}, outside every allowed root (exec.allowed_cwd_roots: {})",
        cwd.display(),
        real.display(),
        listed.join(", ")
    ))
}

/// The check immediately before the launch: the validated shell path must
/// still be a regular executable file, not a symlink. (The full identity
/// check against the validated `FileIdentity` belongs to the caller, which
/// holds it; the launch spec carries only the path.)
pub(crate) fn check_shell(path: &Path) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| format!("shell {} cannot be examined: {e}", path.display()))?;
    if meta.file_type().is_symlink() {
        return Err(format!("shell {} is now a symlink", path.display()));
    }
    if !meta.file_type().is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "shell {} is no longer an executable regular file",
            path.display()
        ));
    }
    Ok(())
}

/// Temporary spawn failures (fork, memory, file limits) may be retried.
fn is_transient(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(11 | 12 | 23 | 24)) // EAGAIN ENOMEM ENFILE EMFILE
}

fn report(sock: &UnixStream, record: &Record) -> bool {
    match record.write_to(sock) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("rvbox launcher: cannot report to the daemon: {e}");
            false
        }
    }
}

fn pid_u32(pid: rustix::process::Pid) -> u32 {
    u32::try_from(pid.as_raw_nonzero().get()).unwrap_or(0)
}

/// The decoded overrides, in their original order.
fn overrides() -> (Vec<OsString>, Vec<(String, String)>) {
    let mut encoded = Vec::new();
    let mut decoded: Vec<(u64, String, String)> = Vec::new();
    for (key, value) in std::env::vars_os() {
        let Some(index) = key.to_str().and_then(|k| k.strip_prefix(ENV_PREFIX)) else {
            continue;
        };
        let index = index.parse::<u64>().ok();
        let pair = value
            .to_str()
            .and_then(|v| v.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()));
        match (index, pair) {
            (Some(i), Some((k, v))) => decoded.push((i, k, v)),
            _ => eprintln!("rvbox launcher: ignoring a malformed environment override"),
        }
        encoded.push(key);
    }
    decoded.sort_by_key(|(i, _, _)| *i);
    (
        encoded,
        decoded.into_iter().map(|(_, k, v)| (k, v)).collect(),
    )
}

/// Watches the channel after the release: the finish byte ends the
/// launcher quietly; end of stream kills the tree.
fn watch(sock: UnixStream, cgroup_v2: Option<PathBuf>) -> ! {
    let mut byte = [0u8; 1];
    loop {
        match (&sock).read(&mut byte) {
            Ok(1) if byte == [frame::FINISH] => std::process::exit(0),
            Ok(1) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(_) | Err(_) => break,
        }
    }
    // plan §7.4 step 5: channel EOF after release terminates the group
    if let Some(dir) = cgroup_v2
        && let Err(e) = cgroup::kill(&dir)
    {
        eprintln!(
            "rvbox launcher: cgroup.kill in {} failed: {e}",
            dir.display()
        );
    }
    if let Err(e) = rustix::process::kill_current_process_group(Signal::KILL) {
        eprintln!("rvbox launcher: killpg failed: {e}");
    }
    std::process::exit(EXIT_CHANNEL_LOST)
}

/// Signals a process may inherit as ignored (a daemon started under
/// `nohup`, or as a background job of a shell, has HUP or INT and QUIT
/// ignored) and that a command must be able to receive: an ignored
/// disposition survives `exec`, and a POSIX shell cannot even trap a
/// signal that was ignored when it started. A handled one is reset to the
/// default by `exec`, so the launcher handles each (the handler only sets
/// a flag nobody reads; the launcher is never sent these, and reaps with
/// SIGCHLD handled, not ignored). Synchronous faults (BUS, ABRT, TRAP,
/// SYS) and PIPE (which the standard library resets for the child) are
/// left alone; the blocked-signal mask is inherited unchanged.
const RESET_FOR_THE_TREE: [i32; 16] = {
    use signal_hook::consts::signal::{
        SIGALRM, SIGCHLD, SIGHUP, SIGINT, SIGIO, SIGPROF, SIGQUIT, SIGTERM, SIGTSTP, SIGTTIN,
        SIGTTOU, SIGURG, SIGUSR1, SIGUSR2, SIGVTALRM, SIGWINCH,
    };
    [
        SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCHLD, SIGTSTP, SIGTTIN,
        SIGTTOU, SIGURG, SIGWINCH, SIGVTALRM, SIGPROF, SIGIO,
    ]
};

pub(crate) fn catch_inherited_signals() {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in RESET_FOR_THE_TREE {
        if let Err(e) = signal_hook::flag::register(sig, seen.clone()) {
            eprintln!("rvbox launcher: cannot reset signal {sig} for the tree: {e}");
        }
    }
}

/// The launcher's entry point: `args` are the arguments after
/// [`LAUNCHER_MODE_ARG`]. Returns the process exit status (after a release
/// it never returns: it exits from its watchdog).
#[must_use]
pub fn launcher_main(args: Vec<OsString>) -> i32 {
    let args = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rvbox launcher: {e}");
            return EXIT_USAGE;
        }
    };
    // 0. no signal the daemon's parent ignored stays ignored for the tree
    catch_inherited_signals();
    // 1. leader of a new session and process group
    if let Err(e) = rustix::process::setsid() {
        eprintln!("rvbox launcher: setsid failed: {e}");
        return EXIT_SETUP;
    }
    let me = rustix::process::getpid();
    if let Err(e) = rustix::process::set_child_subreaper(Some(me)) {
        eprintln!("rvbox launcher: cannot become the tree's subreaper: {e}");
    }
    let sock = match UnixStream::connect(&args.socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rvbox launcher: cannot connect the release channel: {e}");
            return EXIT_SETUP;
        }
    };
    let pid = pid_u32(me);
    // 2. into the command cgroups before anything else can run
    for dir in args.cgroup_v2.iter().chain(args.cgroup_v1.iter()) {
        if let Err(e) = cgroup::join(dir, pid) {
            report(
                &sock,
                &Record::Failed {
                    permanent: false,
                    reason: format!("cannot place the launcher into {}: {e}", dir.display()),
                },
            );
            return EXIT_SETUP;
        }
    }
    // 3. the positive ready message
    let stat = match procfs::read_stat(pid) {
        Ok(Some(s)) => s,
        Ok(None) | Err(_) => {
            report(
                &sock,
                &Record::Failed {
                    permanent: false,
                    reason: "the launcher cannot read its own /proc stat".into(),
                },
            );
            return EXIT_SETUP;
        }
    };
    if !report(
        &sock,
        &Record::Ready {
            pid,
            pgid: stat.pgrp,
            start_ticks: stat.start_ticks,
        },
    ) {
        return EXIT_SETUP;
    }
    // 4. blocked until the release; EOF runs nothing
    let ends = match channel::recv_release(&sock) {
        Ok(Received::Release(ends)) => ends,
        Ok(Received::Eof) => return 0,
        Err(e) => {
            eprintln!("rvbox launcher: release channel: {e}");
            return EXIT_SETUP;
        }
    };
    let fail = |permanent: bool, reason: String| {
        report(&sock, &Record::Failed { permanent, reason });
        EXIT_REFUSED
    };
    if let Err(reason) = check_shell(&args.shell) {
        return fail(true, reason);
    }
    // resolved now, immediately before the launch: the roots were
    // checked lexically at acceptance, and a symlink inside a root may
    // lead out of it
    let cwd = match resolved_cwd(&args.cwd, &args.cwd_roots) {
        Ok(cwd) => cwd,
        Err(reason) => return fail(true, reason),
    };
    // 5. the watchdog, before the shell exists: a tree that uses up its
    // pids.max cannot keep it from starting
    let watcher = match sock.try_clone() {
        Ok(s) => s,
        Err(e) => return fail(false, format!("cannot watch the release channel: {e}")),
    };
    let v2 = args.cgroup_v2.clone();
    if let Err(e) = std::thread::Builder::new()
        .name("rvbox-watchdog".into())
        .spawn(move || watch(watcher, v2))
    {
        return fail(false, format!("cannot start the watchdog: {e}"));
    }
    let (encoded, overrides) = overrides();
    let mut cmd = Command::new(&args.shell);
    cmd.arg(&args.wrapper).current_dir(&cwd);
    for key in encoded {
        cmd.env_remove(key);
    }
    cmd.envs(overrides);
    cmd.stdin(Stdio::from(ends.stdin))
        .stdout(Stdio::from(ends.stdout))
        .stderr(Stdio::from(ends.stderr));
    let spawned = cmd.spawn();
    // the launcher keeps no pipe end: EOF must follow the tree alone
    drop(cmd);
    let child_pid = match spawned {
        Ok(child) => child.id(),
        Err(e) => {
            return fail(
                !is_transient(&e),
                format!("cannot create the shell {}: {e}", args.shell.display()),
            );
        }
    };
    if !report(&sock, &Record::ExecOk { child_pid }) {
        eprintln!("rvbox launcher: the daemon is gone; the watchdog kills the tree");
    }
    let mut reported = false;
    loop {
        match rustix::process::waitpid(None, WaitOptions::empty()) {
            Ok(Some((pid, status))) => {
                if pid_u32(pid) == child_pid && !reported {
                    reported = true;
                    let record = match (status.exit_status(), status.terminating_signal()) {
                        (Some(code), _) => Record::Exited {
                            signal: false,
                            value: code,
                        },
                        (None, Some(sig)) => Record::Exited {
                            signal: true,
                            value: sig,
                        },
                        (None, None) => continue,
                    };
                    report(&sock, &record);
                }
            }
            Ok(None) | Err(Errno::INTR) => {}
            Err(Errno::CHILD) => std::thread::sleep(ORPHAN_POLL),
            Err(e) => {
                eprintln!("rvbox launcher: waitpid failed: {e}");
                std::thread::sleep(ORPHAN_POLL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `exec.allowed_cwd_roots` is checked after resolution: a symbolic
    /// link inside a root that leads out of it is refused, naming what it
    /// resolves to; a link that stays inside, and a root that is itself a
    /// link, are followed.
    #[test]
    fn the_working_directory_is_checked_under_the_roots_after_resolution() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("inner")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.join("inner"), root.join("stays")).unwrap();
        std::os::unix::fs::symlink(&root, dir.path().join("root-link")).unwrap();
        let roots = [root.clone()];
        let real_root = std::fs::canonicalize(&root).unwrap();
        assert_eq!(
            resolved_cwd(&root.join("stays"), &roots).unwrap(),
            real_root.join("inner")
        );
        let e = resolved_cwd(&root.join("escape"), &roots).unwrap_err();
        assert!(
            e.contains("resolves to") && e.contains("outside every allowed root"),
            "{e}"
        );
        // a lexical check would pass `root/escape/..`-free paths like this
        // one; and `..` through a link resolves physically
        assert!(resolved_cwd(&root.join("escape/."), &roots).is_err());
        // a root given through a link
        assert!(resolved_cwd(&root.join("inner"), &[dir.path().join("root-link")]).is_ok());
        // a sibling with the root's name as a prefix is not under it
        let sibling = dir.path().join("rootx");
        std::fs::create_dir_all(&sibling).unwrap();
        assert!(resolved_cwd(&sibling, &roots).is_err());
        // missing, or not a directory
        assert!(resolved_cwd(&root.join("missing"), &roots).is_err());
        std::fs::write(root.join("file"), b"x").unwrap();
        let e = resolved_cwd(&root.join("file"), &roots).unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
        // no roots: resolved, not checked
        assert!(resolved_cwd(&root.join("escape"), &[]).is_ok());
    }

    #[test]
    fn arguments_round_trip_and_refuse_relative_paths() {
        let cg = cgroup::CommandCgroups {
            v2: Some("/sys/fs/cgroup/unified/rvbox/x".into()),
            v1: vec![(
                cgroup::V1Controller::Pids,
                "/sys/fs/cgroup/pids/rvbox/x".into(),
            )],
        };
        let args = launcher_args(
            Path::new("/run/r/x.sock"),
            Path::new("/usr/bin/dash"),
            Path::new("/w/x.sh"),
            Path::new("/tmp"),
            &[PathBuf::from("/srv"), PathBuf::from("/tmp")],
            &cg,
        );
        let parsed = parse(args).unwrap();
        assert_eq!(parsed.shell, PathBuf::from("/usr/bin/dash"));
        assert_eq!(
            parsed.cwd_roots,
            [PathBuf::from("/srv"), PathBuf::from("/tmp")]
        );
        assert_eq!(parsed.cgroup_v1.len(), 1);
        assert!(parsed.cgroup_v2.is_some());
        assert!(parse(vec!["--socket".into(), "rel".into()]).is_err());
        assert!(parse(vec!["--bogus".into(), "/x".into()]).is_err());
        assert!(parse(vec!["--socket".into(), "/x".into()]).is_err());
    }
}
