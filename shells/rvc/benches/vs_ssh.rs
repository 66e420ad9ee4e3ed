//! rvc against ssh on loopback, side by side in one run: the real
//! `rvbox-server`, `rvbox` and `rvc` (release) against a private `sshd`
//! with its own keys and configuration (nothing on the system is changed
//! beyond sshd's privilege-separation directory when it is missing).
//!
//! Printed, as medians with min and max over the rounds:
//! - the wall time of `rvc run CLIENT true` (foreground, to exit status)
//!   against `ssh 127.0.0.1 true` over a new connection and over a
//!   ControlMaster connection;
//! - 100 sequential `rvc run CLIENT 'echo hi'` (and 100 ssh ControlMaster);
//! - 8 concurrent rvc runs (and 8 concurrent ssh ControlMaster);
//! - 8 MiB of log text and 8 MiB of random data through the durable
//!   pipeline to rvc, against ssh ControlMaster `cat` and `ssh -C cat`,
//!   with the bytes rvc delivered (the rest is in loss markers: a child is
//!   never blocked);
//! - a raw fdatasync probe interleaved with the rounds, since every rvc
//!   figure is durability-bound and the disk here changes speed.
//!
//! `RVBOX_BENCH_ROUNDS` sets the rounds (default 9).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_precision_loss
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::Stack;

fn rounds() -> usize {
    std::env::var("RVBOX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9)
        .max(1)
}

/// Median, min and max of some durations, in milliseconds.
fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    (ms(v[v.len() / 2]), ms(v[0]), ms(v[v.len() - 1]))
}

struct Sshd {
    child: Child,
    dir: PathBuf,
    port: u16,
    made_privsep: bool,
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Sshd {
    fn start(dir: &Path) -> Self {
        let sshd = PathBuf::from("/usr/sbin/sshd");
        assert!(
            sshd.exists(),
            "/usr/sbin/sshd is missing; scripts/bench installs openssh-server"
        );
        let d = dir.join("sshd");
        std::fs::create_dir_all(&d).unwrap();
        for name in ["host_ed25519", "user_ed25519"] {
            run_ok(
                Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                    .arg(d.join(name)),
            );
        }
        std::fs::copy(d.join("user_ed25519.pub"), d.join("authorized_keys")).unwrap();
        let port = support::free_port();
        std::fs::write(
            d.join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_ed25519\nPidFile {d}/sshd.pid\n\
                 AuthorizedKeysFile {d}/authorized_keys\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
                 PermitRootLogin prohibit-password\nMaxStartups 100\nMaxSessions 100\n",
                d = d.display()
            ),
        )
        .unwrap();
        let privsep = Path::new("/run/sshd");
        let made_privsep = !privsep.exists();
        if made_privsep {
            std::fs::create_dir_all(privsep).unwrap();
        }
        let child = Command::new(&sshd)
            .args(["-D", "-e", "-f"])
            .arg(d.join("sshd_config"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("sshd.log")).unwrap())
            .spawn()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "sshd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            dir: d,
            port,
            made_privsep,
        }
    }

    /// An ssh command line to this sshd; `master` uses the ControlMaster
    /// socket.
    fn ssh(&self, master: bool, extra: &[&str]) -> Command {
        let mut c = Command::new("ssh");
        c.args(["-F", "/dev/null", "-p", &self.port.to_string()])
            .arg("-i")
            .arg(self.dir.join("user_ed25519"))
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "LogLevel=ERROR",
            ]);
        if master {
            c.arg("-o")
                .arg(format!("ControlPath={}/cm", self.dir.display()));
            c.args(["-o", "ControlMaster=no"]);
        }
        c.args(extra).arg("root@127.0.0.1");
        c
    }

    fn start_master(&self) {
        let mut c = self.ssh(false, &[]);
        c.arg("-o")
            .arg(format!("ControlPath={}/cm", self.dir.display()))
            .args(["-o", "ControlMaster=yes", "-o", "ControlPersist=600", "-fN"]);
        run_ok(&mut c);
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let mut c = self.ssh(true, &["-O", "exit"]);
        let _ = c.stderr(Stdio::null()).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.made_privsep {
            let _ = std::fs::remove_dir("/run/sshd");
        }
    }
}

/// Runs `cmd` to the end with stdout counted and discarded; returns the
/// wall time and the byte count.
fn timed(cmd: &mut Command) -> (Duration, u64) {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = out.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        n += k as u64;
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{cmd:?} failed");
    (started.elapsed(), n)
}

/// The wall time of `n` copies of a command run at once, each to a
/// successful end.
fn concurrently(n: usize, make: impl Fn() -> Command) -> Duration {
    let started = Instant::now();
    let kids: Vec<_> = (0..n)
        .map(|_| {
            make()
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut k in kids {
        assert!(k.wait().unwrap().success());
    }
    started.elapsed()
}

/// One fdatasync of a 4 KiB write in `dir`.
fn fsync_probe(dir: &Path) -> Duration {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("fsync-probe"))
        .unwrap();
    let started = Instant::now();
    f.write_all(&[7u8; 4096]).unwrap();
    f.sync_data().unwrap();
    started.elapsed()
}

fn row(name: &str, v: Vec<Duration>) -> f64 {
    let (med, min, max) = stats(v);
    println!("{name:<44} {med:>9.1} {min:>9.1} {max:>9.1}");
    med
}

fn main() {
    let n = rounds();
    let s = Stack::new();
    let sshd = Sshd::start(s.dir.path());
    sshd.start_master();
    let rvc = |args: &[&str]| s.rvc_cmd(args);

    // 8 MiB of log text and of random data on the client host
    let log = s.work().join("log-8m.txt");
    let mut text = String::with_capacity(8 << 20);
    let mut i = 0u64;
    while text.len() < 8 << 20 {
        text.push_str(&format!(
            "2026-12-01T12:00:{:02}.{:03}Z INFO worker={} request={i} handled in {} ms\n",
            i % 60,
            i % 1000,
            i % 16,
            i % 97
        ));
        i += 1;
    }
    text.truncate(8 << 20);
    std::fs::write(&log, text).unwrap();
    let random = s.work().join("random-8m.bin");
    let mut bytes = vec![0u8; 8 << 20];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    std::fs::write(&random, bytes).unwrap();

    let probe_dir = s.dir.path().join("data");
    let mut probe = Vec::new();
    let mut rvc_true = Vec::new();
    let mut ssh_new = Vec::new();
    let mut ssh_cm = Vec::new();
    for _ in 0..n {
        probe.push(fsync_probe(&probe_dir));
        rvc_true.push(timed(&mut rvc(&["run", "web-1", "true"])).0);
        ssh_new.push(timed(sshd.ssh(false, &[]).arg("true")).0);
        ssh_cm.push(timed(sshd.ssh(true, &[]).arg("true")).0);
    }
    println!("rvc against ssh on loopback, {n} rounds (milliseconds)");
    println!("{:<44} {:>9} {:>9} {:>9}", "", "median", "min", "max");
    let p = row("fdatasync probe (4 KiB)", probe.clone());
    let r = row("rvc run CLIENT true", rvc_true);
    let sn = row("ssh 127.0.0.1 true (new connection)", ssh_new);
    let sc = row("ssh 127.0.0.1 true (ControlMaster)", ssh_cm);
    println!(
        "ratios: rvc/ssh-new {:.2}, rvc/ssh-ControlMaster {:.2}, rvc/fdatasync {:.1}",
        r / sn,
        r / sc,
        r / p
    );

    let mut seq_rvc = Vec::new();
    let mut seq_ssh = Vec::new();
    let mut conc_rvc = Vec::new();
    let mut conc_ssh = Vec::new();
    for _ in 0..n.min(3) {
        let started = Instant::now();
        for _ in 0..100 {
            timed(&mut rvc(&["run", "web-1", "echo hi"]));
        }
        seq_rvc.push(started.elapsed());
        let started = Instant::now();
        for _ in 0..100 {
            timed(sshd.ssh(true, &[]).arg("echo hi"));
        }
        seq_ssh.push(started.elapsed());
    }
    for _ in 0..n {
        conc_rvc.push(concurrently(8, || rvc(&["run", "web-1", "true"])));
        conc_ssh.push(concurrently(8, || {
            let mut c = sshd.ssh(true, &[]);
            c.arg("true");
            c
        }));
        probe.push(fsync_probe(&probe_dir));
    }
    println!();
    let a = row("100 sequential rvc run 'echo hi'", seq_rvc);
    let b = row("100 sequential ssh ControlMaster 'echo hi'", seq_ssh);
    let c = row("8 concurrent rvc run true (wall)", conc_rvc);
    let d = row("8 concurrent ssh ControlMaster true (wall)", conc_ssh);
    println!(
        "ratios: sequential rvc/ssh {:.2}, concurrent rvc/ssh {:.2}",
        a / b,
        c / d
    );

    println!();
    println!(
        "{:<44} {:>9} {:>9} {:>9}",
        "8 MiB to the terminal (MB/s)", "median", "min", "max"
    );
    for (label, file) in [("log text", &log), ("random", &random)] {
        let path = file.display().to_string();
        let cat = format!("cat {path}");
        let mut via_rvc = Vec::new();
        let mut via_cm = Vec::new();
        let mut via_c = Vec::new();
        let mut delivered = Vec::new();
        for _ in 0..n.min(5) {
            // the child is never blocked: what the client's spool cannot
            // make durable in time is dropped into CLIENT_OVERLOAD markers
            // (said on rvc's stderr), so the bytes delivered are counted
            let (t, bytes) = timed(&mut rvc(&["run", "web-1", &cat]));
            delivered.push(bytes);
            via_rvc.push(t);
            let (t, bytes) = timed(sshd.ssh(true, &[]).arg(&cat));
            assert_eq!(bytes, 8 << 20);
            via_cm.push(t);
            let (t, bytes) = timed(sshd.ssh(false, &["-C"]).arg(&cat));
            assert_eq!(bytes, 8 << 20);
            via_c.push(t);
            probe.push(fsync_probe(&probe_dir));
        }
        let mbps = |v: Vec<Duration>| {
            let (med, min, max) = stats(v);
            // the slowest run is the lowest rate
            (
                8.0 * 1.048_576 * 1000.0 / med,
                8.0 * 1.048_576 * 1000.0 / max,
                8.0 * 1.048_576 * 1000.0 / min,
            )
        };
        let (r, rlo, rhi) = mbps(via_rvc);
        let (m, mlo, mhi) = mbps(via_cm);
        let (z, zlo, zhi) = mbps(via_c);
        println!(
            "{:<44} {r:>9.1} {rlo:>9.1} {rhi:>9.1}",
            format!("rvc run CLIENT 'cat' ({label})")
        );
        println!(
            "{:<44} {m:>9.1} {mlo:>9.1} {mhi:>9.1}",
            format!("ssh ControlMaster cat ({label})")
        );
        println!(
            "{:<44} {z:>9.1} {zlo:>9.1} {zhi:>9.1}",
            format!("ssh -C cat ({label})")
        );
        println!(
            "ratios ({label}): rvc/ssh-ControlMaster {:.2}, rvc/ssh-C {:.2}",
            r / m,
            r / z
        );
        delivered.sort_unstable();
        println!(
            "rvc delivered ({label}): median {:.2} of 8.00 MiB, the rest in CLIENT_OVERLOAD markers",
            delivered[delivered.len() / 2] as f64 / 1_048_576.0
        );
    }
    let (pm, pmin, pmax) = stats(probe);
    println!();
    println!(
        "fdatasync probe over the whole run: median {pm:.2} ms (min {pmin:.2}, max {pmax:.2})"
    );
}
