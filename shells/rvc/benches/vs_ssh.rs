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
//!   pipeline to rvc, against ssh ControlMaster `cat` and `ssh -C cat`, as
//!   rates of the bytes delivered, with what rvc delivered (the rest is in
//!   loss markers: a child is never blocked), both with the default raw
//!   backlog (1 MiB per command) and with one of 32 MiB;
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
                 PermitRootLogin prohibit-password\nMaxStartups 100\nMaxSessions 100\n\
                 AcceptEnv SHLVL\n",
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
    ///
    /// The remote shell runs bare, like rvc's `/bin/sh`: `SHLVL` is sent
    /// as 1, so bash does not read the user's rc files for a command run
    /// by sshd (root's `.bashrc` on a host can take far longer than the
    /// command; [`Self::ssh_rc`] keeps them).
    fn ssh(&self, master: bool, extra: &[&str]) -> Command {
        let mut c = self.ssh_rc(master, extra);
        c.env("SHLVL", "1");
        c
    }

    /// The same, with the remote user's shell reading its rc files as it
    /// does for an operator's own `ssh host command`.
    fn ssh_rc(&self, master: bool, extra: &[&str]) -> Command {
        let mut c = Command::new("ssh");
        c.env_remove("SHLVL").args(["-o", "SendEnv=SHLVL"]);
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

/// The client configuration of the large-backlog rows.
const BIG_BACKLOG: &str = "[flow]\ncommand_high_watermark = \"32MiB\"\ncommand_low_watermark = \"16MiB\"\ndaemon_high_watermark = \"64MiB\"\ndaemon_low_watermark = \"32MiB\"\n";

/// Prints the median, min and max rate (MB/s of the bytes delivered) of
/// some runs; returns the median.
fn rate_row(name: &str, runs: &[(Duration, u64)]) -> f64 {
    let mut v: Vec<f64> = runs
        .iter()
        .map(|(t, b)| *b as f64 / 1e6 / t.as_secs_f64())
        .collect();
    v.sort_by(f64::total_cmp);
    let (med, min, max) = (v[v.len() / 2], v[0], v[v.len() - 1]);
    println!("{name:<44} {med:>9.1} {min:>9.1} {max:>9.1}");
    med
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
    let mut ssh_new_rc = Vec::new();
    let mut ssh_cm_rc = Vec::new();
    for _ in 0..n {
        probe.push(fsync_probe(&probe_dir));
        rvc_true.push(timed(&mut rvc(&["run", "web-1", "true"])).0);
        ssh_new.push(timed(sshd.ssh(false, &[]).arg("true")).0);
        ssh_cm.push(timed(sshd.ssh(true, &[]).arg("true")).0);
        ssh_new_rc.push(timed(sshd.ssh_rc(false, &[]).arg("true")).0);
        ssh_cm_rc.push(timed(sshd.ssh_rc(true, &[]).arg("true")).0);
    }
    println!("rvc against ssh on loopback, {n} rounds (milliseconds)");
    println!("{:<44} {:>9} {:>9} {:>9}", "", "median", "min", "max");
    let p = row("fdatasync probe (4 KiB)", probe.clone());
    let r = row("rvc run CLIENT true", rvc_true);
    let sn = row("ssh 127.0.0.1 true (new connection)", ssh_new);
    let sc = row("ssh 127.0.0.1 true (ControlMaster)", ssh_cm);
    let snr = row("  same, with root's shell rc files", ssh_new_rc);
    let scr = row("  same (ControlMaster), with rc files", ssh_cm_rc);
    println!(
        "ratios: rvc/ssh-new {:.2}, rvc/ssh-ControlMaster {:.2} (with rc files {:.2}, {:.2}), rvc/fdatasync {:.1}",
        r / sn,
        r / sc,
        r / snr,
        r / scr,
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
        "8 MiB to the terminal (MB/s delivered)", "median", "min", "max"
    );
    // the same client with a raw backlog larger than the 8 MiB burst
    // (the defaults keep 1 MiB per command; see docs/benchmarks.md)
    let big = Stack::with_client_config(BIG_BACKLOG);
    for (label, file) in [("log text", &log), ("random", &random)] {
        let path = file.display().to_string();
        let cat = format!("cat {path}");
        let mut via_rvc = Vec::new();
        let mut via_big = Vec::new();
        let mut via_cm = Vec::new();
        let mut via_c = Vec::new();
        for _ in 0..n.min(5) {
            // the child is never blocked: what the client's spool cannot
            // make durable in time is dropped into CLIENT_OVERLOAD markers
            // (said on rvc's stderr), so the rate is of the bytes delivered
            via_rvc.push(timed(&mut rvc(&["run", "web-1", &cat])));
            via_big.push(timed(&mut big.rvc_cmd(&["run", "web-1", &cat])));
            let (t, bytes) = timed(sshd.ssh(true, &[]).arg(&cat));
            assert_eq!(bytes, 8 << 20);
            via_cm.push((t, bytes));
            let (t, bytes) = timed(sshd.ssh(false, &["-C"]).arg(&cat));
            assert_eq!(bytes, 8 << 20);
            via_c.push((t, bytes));
            probe.push(fsync_probe(&probe_dir));
        }
        let r = rate_row(&format!("rvc run CLIENT 'cat' ({label})"), &via_rvc);
        let b = rate_row(&format!("  same, 32 MiB backlog ({label})"), &via_big);
        let m = rate_row(&format!("ssh ControlMaster cat ({label})"), &via_cm);
        let z = rate_row(&format!("ssh -C cat ({label})"), &via_c);
        println!(
            "ratios ({label}): rvc/ssh-ControlMaster {:.2} (32 MiB backlog {:.2}), rvc/ssh-C {:.2} ({:.2})",
            r / m,
            b / m,
            r / z,
            b / z
        );
        for (name, v) in [("defaults", &via_rvc), ("32 MiB backlog", &via_big)] {
            let mut d: Vec<u64> = v.iter().map(|(_, b)| *b).collect();
            d.sort_unstable();
            println!(
                "rvc delivered ({label}, {name}): median {:.2} of 8.00 MiB (min {:.2}), the rest in CLIENT_OVERLOAD markers",
                d[d.len() / 2] as f64 / 1_048_576.0,
                d[0] as f64 / 1_048_576.0
            );
        }
    }
    let (pm, pmin, pmax) = stats(probe);
    println!();
    println!(
        "fdatasync probe over the whole run: median {pm:.2} ms (min {pmin:.2}, max {pmax:.2})"
    );
}
