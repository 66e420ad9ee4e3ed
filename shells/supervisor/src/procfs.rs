//! What the supervisor reads from `/proc` (plan §7.4-§7.5): process stat
//! lines, cgroup membership, the cgroup mounts, process-group members.
//! Every read is bounded; a vanished process is `None`, never an error.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// `now + d`, saturating far in the future instead of overflowing (a
/// caller may pass `Duration::MAX` as "wait forever").
pub(crate) fn after(d: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Largest `/proc` or cgroup file the supervisor reads.
pub(crate) const MAX_PROC_FILE_BYTES: u64 = 1024 * 1024;

/// Reads at most [`MAX_PROC_FILE_BYTES`] of a text file.
pub(crate) fn read_bounded(path: &Path) -> io::Result<String> {
    let mut text = String::new();
    File::open(path)?
        .take(MAX_PROC_FILE_BYTES)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// True for the errors that mean "the process (or file) is gone".
pub(crate) fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(3 /* ESRCH */)
}

/// The fields of `/proc/<pid>/stat` the supervisor uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// Field 3.
    pub state: char,
    /// Field 4.
    pub ppid: u32,
    /// Field 5.
    pub pgrp: u32,
    /// Field 6.
    pub session: u32,
    /// Field 14, clock ticks.
    pub utime: u64,
    /// Field 15, clock ticks.
    pub stime: u64,
    /// Field 22, clock ticks since boot.
    pub start_ticks: u64,
}

/// Parses a stat line; the command name may hold spaces and parentheses,
/// so fields are counted after its last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<ProcStat> {
    let after = text.get(text.rfind(')')? + 1..)?;
    let f: Vec<&str> = after.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
    let id = |i: usize| f.get(i).and_then(|s| s.parse::<u32>().ok());
    Some(ProcStat {
        state: f.first()?.chars().next()?,
        ppid: id(1)?,
        pgrp: id(2)?,
        session: id(3)?,
        utime: num(11)?,
        stime: num(12)?,
        start_ticks: num(19)?,
    })
}

/// `/proc/<pid>/stat`, `None` when the process is gone.
pub(crate) fn read_stat(pid: u32) -> io::Result<Option<ProcStat>> {
    match read_bounded(&PathBuf::from(format!("/proc/{pid}/stat"))) {
        Ok(text) => parse_stat(&text).map(Some).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/proc/{pid}/stat does not parse"),
            )
        }),
        Err(e) if is_gone(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// True when `pid` is a live (non-zombie) process born at `start_ticks`.
pub(crate) fn is_alive_as(pid: u32, start_ticks: u64) -> bool {
    matches!(read_stat(pid), Ok(Some(s)) if s.start_ticks == start_ticks && s.state != 'Z' && s.state != 'X')
}

/// One line of `/proc/<pid>/cgroup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupLine {
    /// Hierarchy id (0 for v2).
    pub hierarchy: u32,
    /// Controllers bound to the hierarchy (empty for v2).
    pub controllers: Vec<String>,
    /// Path relative to the hierarchy's (namespace) root.
    pub path: String,
}

/// Parses `/proc/<pid>/cgroup`.
pub(crate) fn parse_cgroup_file(text: &str) -> Vec<CgroupLine> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let hierarchy = parts.next()?.parse().ok()?;
            let controllers = parts
                .next()?
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect();
            let path = parts.next()?.to_owned();
            Some(CgroupLine {
                hierarchy,
                controllers,
                path,
            })
        })
        .collect()
}

/// A mounted cgroup hierarchy from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupMount {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// The hierarchy path mounted there.
    pub root: String,
    /// True for cgroup2.
    pub v2: bool,
    /// v1 controllers from the super options.
    pub controllers: Vec<String>,
}

fn unescape_mount(field: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'\\'
            && let Some(oct) = bytes.get(i + 1..i + 4)
            && let Ok(text) = std::str::from_utf8(oct)
            && let Ok(v) = u8::from_str_radix(text, 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses the cgroup mounts of a mountinfo text.
pub(crate) fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let _source = post.next()?;
            let options = post.next().unwrap_or("");
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                options
                    .split(',')
                    .filter(|o| !matches!(*o, "rw" | "ro") && !o.contains('='))
                    .map(str::to_owned)
                    .collect()
            };
            Some(CgroupMount {
                mount_point: PathBuf::from(unescape_mount(pre.get(4)?)),
                root: unescape_mount(pre.get(3)?),
                v2,
                controllers,
            })
        })
        .collect()
}

/// Non-zombie members of process group `pgid`, found by scanning `/proc`.
pub(crate) fn group_members(pgid: u32) -> io::Result<Vec<u32>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(Some(s)) = read_stat(pid)
            && s.pgrp == pgid
            && s.state != 'Z'
            && s.state != 'X'
        {
            out.push(pid);
        }
    }
    Ok(out)
}

/// Pids listed in a cgroup's `cgroup.procs` (zombies are not listed).
pub(crate) fn cgroup_procs(dir: &Path) -> io::Result<Vec<u32>> {
    Ok(read_bounded(&dir.join("cgroup.procs"))?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn stat_with_a_hostile_command_name_parses() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 10 0 0 0 7 3 0 0 20 0 1 0 123456 1000 50 18446744073709551615";
        let s = parse_stat(line).unwrap();
        assert_eq!(
            (
                s.state,
                s.ppid,
                s.pgrp,
                s.session,
                s.utime,
                s.stime,
                s.start_ticks
            ),
            ('S', 1, 4242, 4242, 7, 3, 123456)
        );
        assert!(parse_stat("12 (x) S 1").is_none());
    }

    #[test]
    fn cgroup_lines_of_a_hybrid_host() {
        let lines = parse_cgroup_file("4:memory:/process_api/fb01\n1:cpu,cpuacct:/\n0::/rvbox/x\n");
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].controllers, vec!["memory"]);
        assert_eq!(lines[1].controllers, vec!["cpu", "cpuacct"]);
        assert_eq!(
            (lines[2].hierarchy, lines[2].path.as_str()),
            (0, "/rvbox/x")
        );
    }

    #[test]
    fn mountinfo_cgroup_entries() {
        let text = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
32 31 0:29 / /sys/fs/cgroup/cpu\\040x rw,relatime shared:5 - cgroup cgroup rw,cpu,cpuacct\n\
41 31 0:38 /sub /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].controllers, vec!["memory"]);
        assert_eq!(m[1].mount_point, PathBuf::from("/sys/fs/cgroup/cpu x"));
        assert_eq!(m[1].controllers, vec!["cpu", "cpuacct"]);
        assert!(m[2].v2 && m[2].root == "/sub");
    }
}
