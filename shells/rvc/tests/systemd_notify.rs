//! Both daemons under a `Type=notify` unit, as systemd runs them: the real
//! binaries with `$NOTIFY_SOCKET` naming a datagram socket this test
//! listens on (a path for the server, an abstract name for the client)
//! and `$WATCHDOG_USEC` set. Each must say `READY=1` only once it serves,
//! ping the watchdog at half the period, and say `STOPPING=1` when it is
//! stopped; no command it runs may see the variables.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::os::unix::net::{SocketAddr, UnixDatagram, UnixStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{Stack, bin, http_get};

/// The watchdog period given to the daemons (so a ping every 200 ms).
const WATCHDOG_USEC: &str = "400000";

/// Every notification the daemon sent, recorded by a thread that reads
/// the socket at once (a datagram socket's queue is short: a reader that
/// lags would make the daemon's sends fail).
struct Recorder {
    got: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn start(socket: UnixDatagram) -> Self {
        let got = Arc::new(Mutex::new(Vec::new()));
        let to = Arc::clone(&got);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                to.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        });
        Self { got }
    }

    fn all(&self) -> Vec<String> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until a message starting with `prefix` was received; the
    /// messages so far.
    fn wait_for(&self, prefix: &str, s: &Stack) -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let all = self.all();
            if all.iter().any(|m| m.starts_with(prefix)) {
                return all;
            }
            assert!(
                Instant::now() < until,
                "no {prefix:?} notification in time: {all:?}\n{}",
                s.logs()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn pings(&self) -> usize {
        self.all().iter().filter(|m| *m == "WATCHDOG=1").count()
    }

    /// Pings within 2 s at a 200 ms interval: about ten; fewer than five
    /// means the daemon does not ping at half the period.
    fn assert_pinging(&self, s: &Stack) {
        let before = self.pings();
        std::thread::sleep(Duration::from_secs(2));
        let pings = self.pings() - before;
        assert!(
            pings >= 5,
            "{pings} watchdog pings in 2 s at a 400 ms watchdog: {:?}\n{}",
            self.all(),
            s.logs()
        );
    }
}

fn log(s: &Stack, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(s.dir.path().join(name))
        .unwrap()
}

#[test]
fn the_server_says_ready_once_it_listens_pings_the_watchdog_and_says_stopping() {
    let mut s = Stack::configured();
    let path = s.dir.path().join("notify.sock");
    let notes = Recorder::start(UnixDatagram::bind(&path).unwrap());
    let child = Command::new(bin("rvbox-server"))
        .arg("--config")
        .arg(s.dir.path().join("server.toml"))
        .env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", WATCHDOG_USEC)
        .stdout(Stdio::null())
        .stderr(log(&s, "server.log"))
        .spawn()
        .unwrap();
    s.server = Some(child);
    let first = notes.wait_for("READY=1", &s);
    // at READY=1 both the agent listener and the control socket answer
    assert!(
        http_get(s.port, "/healthz").is_some_and(|(code, _)| code == 200),
        "READY=1 before the agent listener answered\n{}",
        s.logs()
    );
    assert!(
        UnixStream::connect(s.socket()).is_ok(),
        "READY=1 before the control socket listened\n{}",
        s.logs()
    );
    assert!(
        first.iter().any(|m| m.starts_with("READY=1\nSTATUS=")),
        "{first:?}"
    );
    notes.assert_pinging(&s);
    s.wait_until("the server is ready", || {
        http_get(s.port, "/readyz").is_some_and(|(code, _)| code == 200)
    });
    let status = s.stop_server();
    assert_eq!(status, Some(0), "{}", s.logs());
    let all = notes.all();
    assert!(
        all.iter().any(|m| m.starts_with("STOPPING=1\n")),
        "no STOPPING=1 at a graceful stop: {all:?}\n{}",
        s.logs()
    );
}

#[test]
fn the_client_says_ready_pings_from_its_runtime_and_hides_the_socket_from_commands() {
    use std::os::linux::net::SocketAddrExt as _;
    let mut s = Stack::configured();
    s.start_server();
    let name = format!("rvbox-notify-e2e-{}", std::process::id());
    let notes = Recorder::start(
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap(),
    );
    let child = Command::new(bin("rvbox"))
        .arg("--config")
        .arg(s.dir.path().join("client.toml"))
        .env("NOTIFY_SOCKET", format!("@{name}"))
        .env("WATCHDOG_USEC", WATCHDOG_USEC)
        .stdout(Stdio::null())
        .stderr(log(&s, "client.log"))
        .spawn()
        .unwrap();
    s.client = Some(child);
    let first = notes.wait_for("READY=1", &s);
    // at READY=1 the client store is open (its identity is written) and
    // the health listener answers
    assert!(
        http_get(s.client_health, "/healthz").is_some_and(|(code, _)| code == 200),
        "READY=1 before the health listener answered\n{}",
        s.logs()
    );
    assert!(
        std::fs::read_dir(s.dir.path().join("cstate"))
            .unwrap()
            .next()
            .is_some(),
        "READY=1 before the client store was opened"
    );
    assert!(
        first.iter().any(|m| m.starts_with("READY=1\nSTATUS=")),
        "{first:?}"
    );
    notes.assert_pinging(&s);
    s.wait_connected();
    let out = s.rvc(&["run", "web-1", "env"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let env = String::from_utf8_lossy(&out.stdout);
    assert!(env.contains("PATH="), "{env}");
    for var in ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"] {
        assert!(
            !env.lines().any(|l| l.starts_with(&format!("{var}="))),
            "a command inherited the daemon's {var}: {env}"
        );
    }
    let status = s.stop_client();
    assert_eq!(status, Some(0), "{}", s.logs());
    let all = notes.all();
    assert!(
        all.iter().any(|m| m.starts_with("STOPPING=1\n")),
        "no STOPPING=1 at a graceful stop: {all:?}\n{}",
        s.logs()
    );
}
