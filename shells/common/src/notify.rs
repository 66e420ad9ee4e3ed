//! The systemd service notification protocol (`sd_notify(3)`), spoken by
//! both daemons under `Type=notify` units: `READY=1` once the daemon
//! serves, `WATCHDOG=1` every half of `WatchdogSec=`, `STOPPING=1` when a
//! graceful stop begins, and `STATUS=` lines for `systemctl status`.
//!
//! A message is one datagram to the `AF_UNIX` socket named by
//! `$NOTIFY_SOCKET`: a path, or with a leading `@` a name in the abstract
//! namespace. Without `$NOTIFY_SOCKET` (a daemon not started by systemd)
//! every call does nothing. A message that cannot be sent is logged and
//! never stops the daemon: systemd then acts on what it did not hear (a
//! start timeout, a watchdog restart).
//!
//! The variables are read once, at start-up; every process the daemon
//! starts must have them removed ([`ENVIRONMENT`]), so that a command
//! cannot speak for the daemon or take its watchdog for its own.

use std::ffi::OsStr;
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::Arc;
use std::time::Duration;

/// The environment variables of the protocol: every child the daemon
/// starts has them removed.
pub const ENVIRONMENT: [&str; 3] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// Where notifications go, and the watchdog the service manager expects.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    target: Option<Target>,
    watchdog: Option<Duration>,
}

#[derive(Debug, Clone)]
struct Target {
    socket: Arc<UnixDatagram>,
    addr: SocketAddr,
    /// As `$NOTIFY_SOCKET` named it (for logs).
    name: String,
}

impl Notifier {
    /// The notifier this process was started with: `$NOTIFY_SOCKET`,
    /// `$WATCHDOG_USEC` and `$WATCHDOG_PID` as systemd sets them.
    #[must_use]
    pub fn from_env() -> Self {
        let socket = std::env::var_os("NOTIFY_SOCKET");
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let pid = std::env::var("WATCHDOG_PID").ok();
        Self::from_values(
            socket.as_deref(),
            usec.as_deref(),
            pid.as_deref(),
            std::process::id(),
        )
    }

    /// The notifier for these values of the variables, in process `own_pid`
    /// (as [`Self::from_env`] reads them).
    #[must_use]
    pub fn from_values(
        notify_socket: Option<&OsStr>,
        watchdog_usec: Option<&str>,
        watchdog_pid: Option<&str>,
        own_pid: u32,
    ) -> Self {
        let target = notify_socket.and_then(|name| match target(name) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(notify_socket = %name.to_string_lossy(), error = %e, "cannot use NOTIFY_SOCKET: systemd will not hear readiness or watchdog pings");
                None
            }
        });
        // sd_watchdog_enabled(3): the watchdog is ours only when
        // WATCHDOG_PID is unset or names this process
        let ours = watchdog_pid.is_none_or(|p| p.trim().parse::<u32>() == Ok(own_pid));
        let watchdog = watchdog_usec
            .and_then(|u| u.trim().parse::<u64>().ok())
            .filter(|&u| u > 0 && ours && target.is_some())
            .map(Duration::from_micros);
        Self { target, watchdog }
    }

    /// Whether a service manager listens (`$NOTIFY_SOCKET` was usable).
    #[must_use]
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to send [`Self::watchdog`]: half of `WatchdogSec=`, as
    /// `sd_watchdog_enabled(3)` advises; `None` without a watchdog.
    #[must_use]
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.map(|w| w / 2)
    }

    /// `READY=1` with a status line: the daemon serves.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `STATUS=`: a line `systemctl status` shows.
    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={}", one_line(status)));
    }

    /// `WATCHDOG=1`: the daemon's main loop is alive.
    pub fn watchdog(&self) {
        if self.watchdog.is_some() {
            self.send("WATCHDOG=1");
        }
    }

    /// `STOPPING=1` with a status line: a graceful stop has begun.
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    fn send(&self, message: &str) {
        let Some(t) = &self.target else {
            return;
        };
        match t.socket.send_to_addr(message.as_bytes(), &t.addr) {
            Ok(n) if n == message.len() => {
                tracing::debug!(notify_socket = %t.name, message, "notified the service manager");
            }
            Ok(n) => {
                tracing::warn!(notify_socket = %t.name, sent = n, len = message.len(), "service manager notification cut short");
            }
            Err(e) => {
                tracing::warn!(notify_socket = %t.name, message, error = %e, "cannot notify the service manager");
            }
        }
    }
}

/// A status line: one line, as systemd shows one.
fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

fn target(name: &OsStr) -> io::Result<Target> {
    let bytes = name.as_encoded_bytes();
    let addr = match bytes.split_first() {
        Some((b'@', rest)) if !rest.is_empty() => abstract_addr(rest)?,
        Some((b'/', _)) => SocketAddr::from_pathname(name)?,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "neither an absolute path nor an abstract name (@...)",
            ));
        }
    };
    let socket = UnixDatagram::unbound()?;
    // a notification never blocks the daemon: a service manager that does
    // not read its queue loses a message, it does not stall a main loop
    socket.set_nonblocking(true)?;
    Ok(Target {
        socket: Arc::new(socket),
        addr,
        name: name.to_string_lossy().into_owned(),
    })
}

#[cfg(target_os = "linux")]
fn abstract_addr(name: &[u8]) -> io::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt as _;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(target_os = "linux"))]
fn abstract_addr(_name: &[u8]) -> io::Result<SocketAddr> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract socket names exist only on Linux",
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).unwrap();
        String::from_utf8(buf.get(..n).unwrap().to_vec()).unwrap()
    }

    #[test]
    fn messages_reach_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        listener
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let n = Notifier::from_values(Some(path.as_os_str()), Some("4000000"), None, 7);
        assert!(n.enabled());
        assert_eq!(n.watchdog_interval(), Some(Duration::from_secs(2)));
        n.ready("serving\nnow");
        assert_eq!(receive(&listener), "READY=1\nSTATUS=serving now");
        n.watchdog();
        assert_eq!(receive(&listener), "WATCHDOG=1");
        n.status("recovering");
        assert_eq!(receive(&listener), "STATUS=recovering");
        n.stopping("stopping");
        assert_eq!(receive(&listener), "STOPPING=1\nSTATUS=stopping");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn messages_reach_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("rvbox-notify-test-{}", std::process::id());
        let listener =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        listener
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let env = format!("@{name}");
        let n = Notifier::from_values(Some(OsStr::new(&env)), None, None, 7);
        assert!(n.enabled());
        n.ready("up");
        assert_eq!(receive(&listener), "READY=1\nSTATUS=up");
    }

    #[test]
    fn the_watchdog_is_ours_only_for_our_pid_and_a_positive_period() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let _listener = UnixDatagram::bind(&path).unwrap();
        let sock = Some(path.as_os_str());
        let interval = |usec: Option<&str>, pid: Option<&str>| {
            Notifier::from_values(sock, usec, pid, 42).watchdog_interval()
        };
        assert_eq!(
            interval(Some("30000000"), Some("42")),
            Some(Duration::from_secs(15))
        );
        assert_eq!(interval(Some("30000000"), Some("43")), None);
        assert_eq!(interval(Some("0"), None), None);
        assert_eq!(interval(Some("soon"), None), None);
        assert_eq!(interval(None, None), None);
        // no socket: no watchdog either
        assert_eq!(
            Notifier::from_values(None, Some("30000000"), None, 42).watchdog_interval(),
            None
        );
    }

    #[test]
    fn without_a_usable_socket_nothing_is_sent() {
        for name in [None, Some(""), Some("relative/path"), Some("@")] {
            let n = Notifier::from_values(name.map(OsStr::new), Some("1000000"), None, 1);
            assert!(!n.enabled(), "{name:?}");
            // no panic, no error: a daemon started by hand
            n.ready("x");
            n.watchdog();
        }
    }
}
