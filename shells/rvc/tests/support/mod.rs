//! A real RVBox on loopback for end-to-end tests: the built
//! `rvbox-server`, `rvbox` and `rvc` binaries, each in a private
//! directory, talking over a real WebSocket and a real Unix socket.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Where the workspace's binaries are (beside this test's own
/// executable's `deps` directory).
pub fn bin(name: &str) -> PathBuf {
    if name == "rvc" {
        return PathBuf::from(env!("CARGO_BIN_EXE_rvc"));
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run the tests with `cargo test --workspace` (or `cargo build --workspace` first)",
        path.display()
    );
    path
}

/// A free loopback port.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// One server and (optionally) one client.
pub struct Stack {
    pub dir: tempfile::TempDir,
    pub port: u16,
    /// The client's health listener (`observability.metrics_listen`).
    pub client_health: u16,
    /// The server's separate health and metrics listener.
    pub server_metrics: u16,
    pub server: Option<Child>,
    pub client: Option<Child>,
    restarts: u32,
}

impl Stack {
    /// A server on a free port, ready.
    pub fn server_only() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut s = Self {
            dir,
            port,
            client_health: free_port(),
            server_metrics: free_port(),
            server: None,
            client: None,
            restarts: 0,
        };
        s.write_configs();
        s.start_server();
        s
    }

    /// A server and a connected client `web-1`.
    pub fn new() -> Self {
        let mut s = Self::server_only();
        s.start_client();
        s
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run/control.sock")
    }

    fn write_configs(&self) {
        let d = self.dir.path();
        std::fs::create_dir_all(d.join("work")).unwrap();
        std::fs::write(
            d.join("server.toml"),
            format!(
                "[server]\nagent_listen = \"127.0.0.1:{}\"\n[storage]\ndata_dir = \"{}\"\n[control]\nruntime_dir = \"{}\"\nsocket_path = \"{}\"\n[observability]\nmetrics_listen = \"127.0.0.1:{}\"\n",
                self.port,
                d.join("data").display(),
                d.join("run").display(),
                self.socket().display(),
                self.server_metrics
            ),
        )
        .unwrap();
        std::fs::write(
            d.join("client.toml"),
            format!(
                "[client]\nclient_id = \"web-1\"\nserver_urls = [\"ws://127.0.0.1:{}/rvbox/agent\"]\nstate_dir = \"{}\"\n[exec]\nallowed_cwd_roots = [\"{}\"]\ndefault_cwd = \"{}\"\ndrain_grace = \"1s\"\nkill_grace = \"2s\"\n[reconnect]\ninitial = \"1s\"\nmax = \"2s\"\n[observability]\nmetrics_listen = \"127.0.0.1:{}\"\n",
                self.port,
                d.join("cstate").display(),
                d.join("work").display(),
                d.join("work").display(),
                self.client_health
            ),
        )
        .unwrap();
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(name))
            .unwrap()
    }

    /// A server whose soft file-descriptor limit is `limit`, ready.
    pub fn server_with_fd_limit(limit: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut s = Self {
            dir,
            port,
            client_health: free_port(),
            server_metrics: free_port(),
            server: None,
            client: None,
            restarts: 0,
        };
        s.write_configs();
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -n {limit} && exec \"$0\" --config \"$1\""))
            .arg(bin("rvbox-server"))
            .arg(s.dir.path().join("server.toml"))
            .stdout(Stdio::null())
            .stderr(s.log("server.log"))
            .spawn()
            .unwrap();
        s.server = Some(child);
        s.wait_until("the server is ready", || {
            http_get(s.port, "/readyz").is_some_and(|(code, _)| code == 200)
        });
        s
    }

    /// The server's log so far.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Starts the server and waits until it is ready.
    pub fn start_server(&mut self) {
        let child = Command::new(bin("rvbox-server"))
            .arg("--config")
            .arg(self.dir.path().join("server.toml"))
            .stdout(Stdio::null())
            .stderr(self.log("server.log"))
            .spawn()
            .unwrap();
        self.server = Some(child);
        self.wait_until("the server is ready", || {
            http_get(self.port, "/readyz").is_some_and(|(code, _)| code == 200)
        });
    }

    /// Starts the client and waits until the server lists it connected.
    pub fn start_client(&mut self) {
        let child = Command::new(bin("rvbox"))
            .arg("--config")
            .arg(self.dir.path().join("client.toml"))
            .stdout(Stdio::null())
            .stderr(self.log("client.log"))
            .spawn()
            .unwrap();
        self.client = Some(child);
        self.wait_connected();
    }

    /// Waits until `rvc stat` shows web-1 connected.
    pub fn wait_connected(&self) {
        self.wait_until("the client is connected", || {
            let out = self.rvc(&["stat"]);
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l.starts_with("web-1") && l.contains("connected"))
        });
    }

    /// Polls `ok` every 50 ms for at most 30 s.
    pub fn wait_until(&self, what: &str, mut ok: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("timed out waiting until {what}\n{}", self.logs());
    }

    /// Both daemons' logs (for failure messages).
    pub fn logs(&self) -> String {
        let read = |n: &str| std::fs::read_to_string(self.dir.path().join(n)).unwrap_or_default();
        format!(
            "--- server.log\n{}\n--- client.log\n{}",
            tail(&read("server.log")),
            tail(&read("client.log"))
        )
    }

    /// Runs rvc against this server.
    pub fn rvc(&self, args: &[&str]) -> Output {
        self.rvc_cmd(args).output().unwrap()
    }

    /// An rvc command against this server (to spawn).
    pub fn rvc_cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin("rvc"));
        c.env("RVC_SOCKET", self.socket()).args(args);
        c
    }

    /// The client's work directory (its allowed CWD root).
    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    /// Stops a daemon with SIGTERM and waits; returns its exit status.
    pub fn term(child: &mut Child) -> Option<i32> {
        let pid = rustix::process::Pid::from_child(child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        wait_exit(child, Duration::from_secs(30))
    }

    pub fn stop_server(&mut self) -> Option<i32> {
        let mut s = self.server.take().unwrap();
        Self::term(&mut s)
    }

    pub fn stop_client(&mut self) -> Option<i32> {
        let mut c = self.client.take().unwrap();
        Self::term(&mut c)
    }

    /// Kills the client with SIGKILL.
    pub fn kill_client(&mut self) {
        let mut c = self.client.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Restarts the server.
    pub fn restart_server(&mut self) {
        assert_eq!(self.stop_server(), Some(0), "{}", self.logs());
        self.restarts += 1;
        self.start_server();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for c in [self.client.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            let mut c = c;
            let _ = Self::term(&mut c).or_else(|| {
                let _ = c.kill();
                c.wait().ok().and_then(|s| s.code())
            });
        }
    }
}

fn wait_exit(child: &mut Child, max: Duration) -> Option<i32> {
    let until = Instant::now() + max;
    while Instant::now() < until {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// A plain HTTP GET on loopback: status code and body.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// The UUID `rvc run` printed first on stderr.
pub fn issue_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}
