//! A real RVBox on loopback for end-to-end tests: the built
//! `rvbox-server`, `rvbox` and `rvc` binaries, each in a private
//! directory, talking over a real WebSocket and a real Unix socket, and
//! nginx terminating TLS with the shipped `deploy/nginx/rvbox.conf`.
//!
//! Owns: starting, stopping and killing the daemons of one test, their
//! configurations and logs, free ports, polling with a deadline.
//!
//! Must never: be a dependency of anything but tests and benchmarks.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::new_without_default
)]

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Where the workspace's binaries are (beside this test's own
/// executable's `deps` directory).
pub fn bin(name: &str) -> PathBuf {
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

/// A free loopback port, never one this process handed out before: a
/// port is picked long before the daemon that is given it binds it (a
/// client's health listener starts with the client), and the kernel may
/// offer the same free port twice in the meantime.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// One server and (optionally) one client.
#[derive(Debug)]
pub struct Stack {
    pub dir: tempfile::TempDir,
    pub port: u16,
    /// The client's health listener (`observability.metrics_listen`).
    pub client_health: u16,
    /// The server's separate health and metrics listener.
    pub server_metrics: u16,
    pub server: Option<Child>,
    pub client: Option<Child>,
    pub restarts: u32,
}

impl Stack {
    /// Free ports and a private directory with both configurations;
    /// nothing started.
    pub fn configured() -> Self {
        let s = Self {
            dir: tempfile::tempdir().unwrap(),
            port: free_port(),
            client_health: free_port(),
            server_metrics: free_port(),
            server: None,
            client: None,
            restarts: 0,
        };
        s.write_configs();
        s
    }

    /// A server on a free port, ready.
    pub fn server_only() -> Self {
        let mut s = Self::configured();
        s.start_server();
        s
    }

    /// A server and a connected client `web-1`.
    pub fn new() -> Self {
        let mut s = Self::server_only();
        s.start_client();
        s
    }

    /// A server and a connected client `web-1` whose configuration has
    /// `extra` (TOML sections) appended.
    pub fn with_client_config(extra: &str) -> Self {
        let mut s = Self::configured();
        s.append_client_config(extra);
        s.start_server();
        s.start_client();
        s
    }

    /// A server whose configuration has `extra` (TOML sections) appended,
    /// and a connected client `web-1`.
    pub fn with_server_config(extra: &str) -> Self {
        let mut s = Self::configured();
        s.append_server_config(extra);
        s.start_server();
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
                "[client]\nclient_id = \"web-1\"\nserver_urls = [\"ws://127.0.0.1:{}/rvbox/agent\"]\nstate_dir = \"{}\"\nlabels = {{ role = \"web\", zone = \"eu-west\" }}\n[exec]\nallowed_cwd_roots = [\"{}\"]\ndefault_cwd = \"{}\"\ndrain_grace = \"1s\"\nkill_grace = \"2s\"\n[reconnect]\ninitial = \"1s\"\nmax = \"2s\"\n[observability]\nmetrics_listen = \"127.0.0.1:{}\"\n",
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
        let mut s = Self::configured();
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
        self.spawn_client();
        self.wait_connected();
    }

    /// Starts the client without waiting for anything.
    pub fn spawn_client(&mut self) {
        let child = Command::new(bin("rvbox"))
            .arg("--config")
            .arg(self.dir.path().join("client.toml"))
            .stdout(Stdio::null())
            .stderr(self.log("client.log"))
            .spawn()
            .unwrap();
        self.client = Some(child);
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
    pub fn wait_until(&self, what: &str, ok: impl FnMut() -> bool) {
        self.wait_until_for(what, Duration::from_secs(30), ok);
    }

    /// Polls `ok` every 50 ms for at most `max`.
    pub fn wait_until_for(&self, what: &str, max: Duration, mut ok: impl FnMut() -> bool) {
        let until = Instant::now() + max;
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

    /// The running server's process id (None when it is not running).
    pub fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().map(Child::id)
    }

    /// Kills the server with SIGKILL.
    pub fn kill_server(&mut self) {
        let mut c = self.server.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Appends `extra` (TOML sections) to the client's configuration;
    /// takes effect at the next client start.
    pub fn append_client_config(&self, extra: &str) {
        append(&self.dir.path().join("client.toml"), extra);
    }

    /// Appends `extra` (TOML sections) to the server's configuration;
    /// takes effect at the next server start.
    pub fn append_server_config(&self, extra: &str) {
        append(&self.dir.path().join("server.toml"), extra);
    }

    /// Points the client at `urls` in order (trusting `ca` for `wss://`);
    /// takes effect at the next client start.
    pub fn client_urls(&self, urls: &[String], ca: Option<&Path>) {
        let path = self.dir.path().join("client.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let plain = format!(
            "server_urls = [\"ws://127.0.0.1:{}/rvbox/agent\"]",
            self.port
        );
        assert!(
            text.contains(&plain),
            "the client's URL was changed already"
        );
        let list = urls
            .iter()
            .map(|u| format!("\"{u}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut with = format!("server_urls = [{list}]");
        if let Some(ca) = ca {
            with.push_str(&format!("\nca_file = \"{}\"", ca.display()));
        }
        std::fs::write(path, text.replace(&plain, &with)).unwrap();
    }

    /// The client's log so far.
    pub fn client_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("client.log")).unwrap_or_default()
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

fn append(path: &Path, extra: &str) {
    let mut toml = std::fs::read_to_string(path).unwrap();
    toml.push_str(extra);
    std::fs::write(path, toml).unwrap();
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
/// Bytes as text, for assertions and their messages.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn issue_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The nginx configuration RVBox ships.
pub fn shipped_nginx_conf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/rvbox.conf")
}

/// nginx terminating TLS in front of a server's agent endpoint, as in a
/// real deployment (the shipped `deploy/nginx/rvbox.conf`): a private CA, a certificate for `localhost`, and
/// nginx in the foreground with its own configuration and prefix.
#[derive(Debug)]
pub struct Nginx {
    child: Child,
    /// The TLS port.
    pub port: u16,
    /// The CA bundle the client trusts.
    pub ca: PathBuf,
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The certificate nginx presents: the names it is valid for (a
/// `subjectAltName` value) and its validity in days from now (negative:
/// it expired that many days ago).
#[derive(Debug, Clone)]
pub struct ServerCert {
    /// `subjectAltName`, e.g. `DNS:localhost,IP:127.0.0.1`.
    pub names: String,
    /// Days valid; below 0, already expired.
    pub days: i32,
}

impl Default for ServerCert {
    fn default() -> Self {
        Self {
            names: "DNS:localhost,IP:127.0.0.1".into(),
            days: 2,
        }
    }
}

/// A CA of its own in `dir` (`<name>.crt`, `<name>.key`), for tests that
/// trust the wrong one; returns the certificate's path.
pub fn make_ca(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let (crt, key) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    run_ok(
        Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
            .args(["-subj", &format!("/CN={name}")])
            .args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&crt),
    );
    crt
}

impl Nginx {
    /// Starts nginx in `dir` proxying `wss://localhost:PORT/rvbox/agent`
    /// to the agent endpoint on `agent_port`.
    pub fn start(dir: &Path, agent_port: u16) -> Self {
        Self::start_with_cert(dir, agent_port, &ServerCert::default())
    }

    /// As [`Nginx::start`], presenting `cert` (signed by the test CA).
    pub fn start_with_cert(dir: &Path, agent_port: u16, cert: &ServerCert) -> Self {
        Self::start_shipped(
            dir,
            cert,
            &shipped_nginx_conf(),
            vec![(
                "server 127.0.0.1:7700;".into(),
                format!("server 127.0.0.1:{agent_port};"),
            )],
        )
    }

    /// Starts nginx in `dir` with the shipped client-certificate variant
    /// (`deploy/nginx/rvbox-mtls.conf`): client certificates from its own
    /// client CA (`client_cert` makes them) are required, and the verified
    /// subject goes upstream from `proxy_from` (a loopback address).
    pub fn start_mtls(dir: &Path, agent_port: u16, proxy_from: &str) -> Self {
        let d = dir.join("nginx");
        let clients_ca = make_ca(&d, "clients-ca");
        let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/rvbox-mtls.conf");
        Self::start_shipped(
            dir,
            &ServerCert::default(),
            &conf,
            vec![
                (
                    "server 127.0.0.1:7700;".into(),
                    format!("server 127.0.0.1:{agent_port};"),
                ),
                (
                    "/etc/nginx/tls/rvbox-clients-ca.crt".into(),
                    clients_ca.display().to_string(),
                ),
                (
                    "proxy_bind 127.0.0.1;".into(),
                    format!("proxy_bind {proxy_from};"),
                ),
            ],
        )
    }

    /// A client certificate whose subject is `/CN={cn}`, issued by the
    /// client CA of [`Nginx::start_mtls`]: (certificate, key 0600).
    pub fn client_cert(&self, cn: &str) -> (PathBuf, PathBuf) {
        let d = self.ca.parent().unwrap().to_path_buf();
        let (crt, key, csr) = (
            d.join(format!("client-{cn}.crt")),
            d.join(format!("client-{cn}.key")),
            d.join(format!("client-{cn}.csr")),
        );
        run_ok(
            Command::new("openssl")
                .args([
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                ])
                .args(["-nodes", "-subj", &format!("/CN={cn}")])
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&csr),
        );
        let ext = d.join(format!("client-{cn}.cnf"));
        std::fs::write(
            &ext,
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        run_ok(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "2", "-CAcreateserial"])
                .arg("-in")
                .arg(&csr)
                .arg("-CA")
                .arg(d.join("clients-ca.crt"))
                .arg("-CAkey")
                .arg(d.join("clients-ca.key"))
                .arg("-extfile")
                .arg(&ext)
                .arg("-out")
                .arg(&crt),
        );
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        (crt, key)
    }

    /// Starts nginx in `dir` with the shipped replicas configuration
    /// (`deploy/nginx/rvbox-replicas.conf`): a consistent hash on the
    /// client over the agent endpoints on `agent_ports` (three).
    pub fn start_replicas(dir: &Path, agent_ports: &[u16; 3]) -> Self {
        let conf =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/rvbox-replicas.conf");
        let upstreams = agent_ports
            .iter()
            .enumerate()
            .map(|(i, p)| {
                (
                    format!("server 127.0.0.1:{} max_fails", 7701 + i),
                    format!("server 127.0.0.1:{p} max_fails"),
                )
            })
            .collect();
        Self::start_shipped(dir, &ServerCert::default(), &conf, upstreams)
    }

    fn start_shipped(
        dir: &Path,
        cert: &ServerCert,
        shipped_conf: &Path,
        upstreams: Vec<(String, String)>,
    ) -> Self {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .expect(
                "nginx is not installed; scripts/test installs it (apt-get install nginx-light)",
            );
        let d = dir.join("nginx");
        std::fs::create_dir_all(d.join("logs")).unwrap();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        run_ok(
            Command::new("openssl")
                .args(["req", "-x509"])
                .args(ec)
                .args(["-days", "2", "-subj", "/CN=RVBox test CA"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
                .arg("-keyout")
                .arg(d.join("ca.key"))
                .arg("-out")
                .arg(d.join("ca.crt")),
        );
        run_ok(
            Command::new("openssl")
                .arg("req")
                .args(ec)
                .args(["-subj", "/CN=localhost"])
                .arg("-keyout")
                .arg(d.join("server.key"))
                .arg("-out")
                .arg(d.join("server.csr")),
        );
        std::fs::write(
            d.join("ext.cnf"),
            format!("subjectAltName={}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n", cert.names),
        )
        .unwrap();
        run_ok(
            Command::new("openssl")
                .args([
                    "x509",
                    "-req",
                    "-days",
                    &cert.days.to_string(),
                    "-CAcreateserial",
                ])
                .arg("-in")
                .arg(d.join("server.csr"))
                .arg("-CA")
                .arg(d.join("ca.crt"))
                .arg("-CAkey")
                .arg(d.join("ca.key"))
                .arg("-extfile")
                .arg(d.join("ext.cnf"))
                .arg("-out")
                .arg(d.join("server.crt")),
        );
        let port = free_port();
        // the shipped server block, with this test's addresses and files
        let shipped = std::fs::read_to_string(shipped_conf).unwrap();
        let site = [
            ("    listen [::]:443 ssl;\n".to_owned(), String::new()),
            (
                "listen 443 ssl;".into(),
                format!("listen 127.0.0.1:{port} ssl;"),
            ),
            (
                "server_name rvbox.example.net;".into(),
                "server_name localhost;".into(),
            ),
            (
                "/etc/nginx/tls/rvbox.crt".into(),
                d.join("server.crt").display().to_string(),
            ),
            (
                "/etc/nginx/tls/rvbox.key".into(),
                d.join("server.key").display().to_string(),
            ),
        ]
        .into_iter()
        .chain(upstreams)
        .fold(shipped, |text, (from, to)| {
            assert_eq!(
                text.matches(from.as_str()).count(),
                1,
                "{} no longer has `{from}` exactly once; update the test kit",
                shipped_conf.display()
            );
            text.replace(from.as_str(), &to)
        });
        std::fs::write(d.join("rvbox.conf"), site).unwrap();
        let conf = format!(
            r#"daemon off;
user root;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/logs/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/tmp-body;
    proxy_temp_path {d}/tmp-proxy;
    fastcgi_temp_path {d}/tmp-fastcgi;
    uwsgi_temp_path {d}/tmp-uwsgi;
    scgi_temp_path {d}/tmp-scgi;
    include {d}/rvbox.conf;
}}
"#,
            d = d.display()
        );
        std::fs::write(d.join("nginx.conf"), conf).unwrap();
        let child = Command::new(nginx)
            .arg("-p")
            .arg(&d)
            .arg("-c")
            .arg(d.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < until,
                "nginx did not start: {}",
                std::fs::read_to_string(d.join("logs/error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            port,
            ca: d.join("ca.crt"),
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = Stack::term(&mut self.child);
    }
}

impl Stack {
    /// Points the client at `url` (trusting `ca`) instead of the plain
    /// loopback endpoint; takes effect at the next client start.
    pub fn client_url(&self, url: &str, ca: &Path) {
        let path = self.dir.path().join("client.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let plain = format!("ws://127.0.0.1:{}/rvbox/agent", self.port);
        let text = text.replace(
            &format!("server_urls = [\"{plain}\"]"),
            &format!("server_urls = [\"{url}\"]\nca_file = \"{}\"", ca.display()),
        );
        std::fs::write(path, text).unwrap();
    }
}

/// One client daemon of a [`Fleet`]: its own configuration, state and work
/// directory under the fleet's directory.
#[derive(Debug)]
pub struct FleetClient {
    pub id: String,
    pub dir: PathBuf,
    pub child: Option<Child>,
}

/// A server and many real `rvbox` daemons on loopback, each with its own
/// client id, labels, state directory and work directory.
#[derive(Debug)]
pub struct Fleet {
    pub stack: Stack,
    pub clients: Vec<FleetClient>,
}

impl Fleet {
    /// A server and `n` clients `host-01`.. with `labels(i)` (TOML inline
    /// table text, e.g. `{ role = "web" }`), all started and connected.
    pub fn start(n: usize, labels: impl Fn(usize) -> String) -> Self {
        let stack = Stack::server_only();
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let id = format!("host-{:02}", i + 1);
            let dir = stack.dir.path().join("clients").join(&id);
            std::fs::create_dir_all(dir.join("work")).unwrap();
            std::fs::write(
                dir.join("client.toml"),
                format!(
                    "[client]\nclient_id = \"{id}\"\nserver_urls = [\"ws://127.0.0.1:{}/rvbox/agent\"]\nstate_dir = \"{}\"\nlabels = {}\n[exec]\nallowed_cwd_roots = [\"{}\"]\ndefault_cwd = \"{}\"\ndrain_grace = \"1s\"\nkill_grace = \"2s\"\n[reconnect]\ninitial = \"1s\"\nmax = \"2s\"\n[observability]\nmetrics_listen = \"\"\n",
                    stack.port,
                    dir.join("state").display(),
                    labels(i),
                    dir.join("work").display(),
                    dir.join("work").display(),
                ),
            )
            .unwrap();
            clients.push(FleetClient {
                id,
                dir,
                child: None,
            });
        }
        let mut f = Self { stack, clients };
        for i in 0..n {
            f.start_client(i);
        }
        f.wait_all_connected();
        f
    }

    /// Starts client `i` (not waiting for it).
    pub fn start_client(&mut self, i: usize) {
        let c = &mut self.clients[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(c.dir.join("client.log"))
            .unwrap();
        let child = Command::new(bin("rvbox"))
            .arg("--config")
            .arg(c.dir.join("client.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        c.child = Some(child);
    }

    /// Kills client `i` with SIGKILL.
    pub fn kill_client(&mut self, i: usize) {
        if let Some(mut c) = self.clients[i].child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// Waits until the server lists every running client connected.
    pub fn wait_all_connected(&self) {
        let want: Vec<&str> = self
            .clients
            .iter()
            .filter(|c| c.child.is_some())
            .map(|c| c.id.as_str())
            .collect();
        self.stack
            .wait_until_for("every client is connected", Duration::from_secs(60), || {
                let out = self.stack.rvc(&["stat", "--per-page", "1000"]);
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                want.iter().all(|id| {
                    text.lines()
                        .any(|l| l.starts_with(id) && l.contains("connected"))
                })
            });
    }

    /// Client `i`'s work directory (its commands' default CWD).
    pub fn work(&self, i: usize) -> PathBuf {
        self.clients[i].dir.join("work")
    }

    /// Runs rvc against the fleet's server.
    pub fn rvc(&self, args: &[&str]) -> Output {
        self.stack.rvc(args)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for c in &mut self.clients {
            if let Some(mut child) = c.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A private PostgreSQL instance on loopback, for tests with a real
/// database: `initdb` into a temporary directory, then `postgres` in the
/// foreground with its socket in that directory and a free TCP port on
/// 127.0.0.1. As root (CI), both run as the `postgres` user the Debian
/// package creates (or `nobody`): PostgreSQL refuses to run as root.
/// Stopped (immediate shutdown) when dropped.
#[derive(Debug)]
pub struct Postgres {
    dir: tempfile::TempDir,
    child: Child,
    /// The TCP port on 127.0.0.1.
    pub port: u16,
    /// The database user (the instance's superuser).
    pub user: String,
    bin: PathBuf,
}

/// The newest PostgreSQL 15+ server binaries installed (Debian keeps them
/// in `/usr/lib/postgresql/<major>/bin`).
fn postgres_bin() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (major >= 15 && bin.join("postgres").exists()).then_some((major, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b).expect(
        "PostgreSQL 15 or newer is not installed; scripts/test installs it (apt-get install postgresql)",
    )
}

/// Who runs the instance: `None` to run as ourselves (not root), else the
/// user to switch to.
fn postgres_user() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let exists = |u: &str| {
        Command::new("id")
            .arg("-u")
            .arg(u)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    ["postgres", "nobody"]
        .into_iter()
        .find(|u| exists(u))
        .map(str::to_owned)
}

impl Postgres {
    /// Creates and starts the instance; waits until it accepts
    /// connections (at most 60 s).
    pub fn start() -> Self {
        let bin = postgres_bin();
        let dir = tempfile::tempdir().unwrap();
        let runas = postgres_user();
        let as_user = |program: &Path| {
            let mut c = match &runas {
                Some(u) => {
                    // setpriv execs the program itself (no process in
                    // between), so signals reach the server
                    let mut c = Command::new("setpriv");
                    c.arg(format!("--reuid={u}"))
                        .arg(format!("--regid={u}"))
                        .arg("--init-groups")
                        .arg("--")
                        .arg(program);
                    c
                }
                None => Command::new(program),
            };
            c.env("LC_ALL", "C").env("TZ", "UTC");
            c
        };
        if let Some(u) = &runas {
            // the instance's user owns its directory, and nothing else
            run_ok(Command::new("chown").arg(u).arg(dir.path()));
        }
        let data = dir.path().join("data");
        let user = runas
            .clone()
            .unwrap_or_else(|| std::env::var("USER").unwrap_or_else(|_| "postgres".into()));
        run_ok(as_user(&bin.join("initdb")).arg("-D").arg(&data).args([
            "-U",
            &user,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-instructions",
        ]));
        let port = free_port();
        let child = as_user(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(dir.path())
            .arg("-p")
            .arg(port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=on"])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("postgres.log")).unwrap())
            .spawn()
            .unwrap();
        let pg = Self {
            dir,
            child,
            port,
            user,
            bin,
        };
        let until = Instant::now() + Duration::from_secs(60);
        while !pg.ready() {
            assert!(Instant::now() < until, "PostgreSQL did not start in 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        pg
    }

    fn ready(&self) -> bool {
        Command::new(self.bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// A libpq connection string for database `db` over TCP on loopback.
    #[must_use]
    pub fn conninfo(&self, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={} dbname={db}",
            self.port, self.user
        )
    }

    /// Runs `sql` with psql against database `db`; its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .arg(self.conninfo(db))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The instance's directory (data directory and socket).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGQUIT: immediate shutdown; the directory goes with the TempDir
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::QUIT);
        let _ = wait_exit(&mut self.child, Duration::from_secs(30));
    }
}
