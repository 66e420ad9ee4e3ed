//! The R8 chaos harness: the real `rvbox-server`, `rvbox` and `rvc`
//! binaries with `rvbox-faultproxy` between the client and the server
//! (and, when asked, nginx with the shipped configuration behind the
//! proxy), and the checks every chaos test ends with, made from outside:
//! marker files count side effects, `rvc` reads back what the server
//! stores and serves, and the daemons' logs must hold no panic.
//!
//! Owns: assembling a stack with one or two proxied paths, short
//! liveness timers so a partition past them takes seconds, and the
//! outside checks.
//!
//! Must never: reach into a daemon's files or memory; everything it
//! learns comes through `rvc`, the logs, or the marker files the
//! commands write.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod tmux;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

pub use rvbox_faultproxy::{BackgroundProxy, Command, Dir, RouteSpec};
pub use rvbox_testkit::{Nginx, Stack, bin, http_get, text};
use serde_json::Value;

/// The server's heartbeat idle time in the harness.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// The server's liveness timeout in the harness (the client follows the
/// server's policy from the welcome).
pub const LIVENESS: Duration = Duration::from_secs(3);

/// How a chaos stack is built.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// nginx (the shipped configuration) between the proxy and the
    /// server: the client speaks `wss://`.
    pub nginx: bool,
    /// A second proxied path (route `b`), listed after `a` in the
    /// client's `server_urls`.
    pub second_path: bool,
    /// The server's `session.heartbeat_idle` and
    /// `session.liveness_timeout` ([`HEARTBEAT`] and [`LIVENESS`] when
    /// unset).
    pub timers: Option<(Duration, Duration)>,
    /// TOML appended to the server's configuration.
    pub server_extra: String,
    /// TOML appended to the client's configuration.
    pub client_extra: String,
}

/// A running chaos stack.
#[derive(Debug)]
pub struct Chaos {
    /// The daemons (field order: the client stops before the proxy and
    /// nginx go).
    pub stack: Stack,
    /// The fault proxy: route `a` (and `b`).
    pub proxy: BackgroundProxy,
    /// nginx, when asked for.
    pub nginx: Option<Nginx>,
}

impl Chaos {
    /// A server, the proxy (and nginx), and a connected client `web-1`.
    #[must_use]
    pub fn start(opts: &Options) -> Self {
        let mut stack = Stack::configured();
        let (heartbeat, liveness) = opts.timers.unwrap_or((HEARTBEAT, LIVENESS));
        stack.append_server_config(&format!(
            "[session]\nheartbeat_idle = \"{}ms\"\nliveness_timeout = \"{}ms\"\n{}",
            heartbeat.as_millis(),
            liveness.as_millis(),
            opts.server_extra
        ));
        stack.start_server();
        let nginx = opts
            .nginx
            .then(|| Nginx::start(stack.dir.path(), stack.port));
        let upstream: SocketAddr = match &nginx {
            Some(n) => SocketAddr::from(([127, 0, 0, 1], n.port)),
            None => SocketAddr::from(([127, 0, 0, 1], stack.port)),
        };
        let mut routes = vec![RouteSpec {
            name: "a".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            upstream,
        }];
        if opts.second_path {
            routes.push(RouteSpec {
                name: "b".into(),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                upstream,
            });
        }
        let proxy = BackgroundProxy::start(&routes).unwrap();
        let url = |route: &str| {
            let port = proxy.addr(route).unwrap().port();
            if nginx.is_some() {
                format!("wss://localhost:{port}/rvbox/agent")
            } else {
                format!("ws://127.0.0.1:{port}/rvbox/agent")
            }
        };
        let mut urls = vec![url("a")];
        if opts.second_path {
            urls.push(url("b"));
        }
        stack.client_urls(&urls, nginx.as_ref().map(|n| n.ca.as_path()));
        stack.append_client_config(&opts.client_extra);
        stack.start_client();
        let c = Self {
            stack,
            proxy,
            nginx,
        };
        // a command runs end to end before any fault: the session is
        // reconciled and the client's capacity is known to the server
        let out = c.rvc(&["run", "web-1", "true"]);
        assert!(
            out.status.success(),
            "the warm-up command failed: {}\n{}",
            text(&out.stderr),
            c.stack.logs()
        );
        c
    }

    /// Applies a fault to route `route`.
    pub fn fault(&self, route: &str, command: &Command) {
        self.proxy.apply(route, command).unwrap();
    }

    /// Runs rvc.
    #[must_use]
    pub fn rvc(&self, args: &[&str]) -> Output {
        self.stack.rvc(args)
    }

    /// `rvc run --background web-1 COMMAND`: the command's UUID.
    #[must_use]
    pub fn run_bg(&self, command: &str) -> String {
        let out = self.rvc(&["run", "--background", "web-1", command]);
        assert!(
            out.status.success(),
            "rvc run failed: {}\n{}",
            text(&out.stderr),
            self.stack.logs()
        );
        text(&out.stdout).trim().to_owned()
    }

    /// The command as `rvc -o json stat web-1 UUID` shows it.
    #[must_use]
    pub fn command(&self, uuid: &str) -> Value {
        let out = self.rvc(&["-o", "json", "stat", "web-1", uuid]);
        assert!(out.status.success(), "rvc stat: {}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v.get("command").cloned().unwrap_or(Value::Null)
    }

    /// Waits at most `max` for the command to reach a terminal lifecycle;
    /// returns the command.
    #[must_use]
    pub fn wait_ended(&self, uuid: &str, max: Duration) -> Value {
        let until = Instant::now() + max;
        loop {
            let c = self.command(uuid);
            let lifecycle = c["lifecycle"].as_str().unwrap_or_default().to_owned();
            if matches!(
                lifecycle.as_str(),
                "LIFECYCLE_SUCCEEDED"
                    | "LIFECYCLE_FAILED"
                    | "LIFECYCLE_TERMINATED"
                    | "LIFECYCLE_INTERRUPTED"
                    | "LIFECYCLE_CANCELLED"
                    | "LIFECYCLE_REJECTED"
                    | "LIFECYCLE_EXPIRED"
            ) {
                return c;
            }
            assert!(
                Instant::now() < until,
                "command {uuid} still {lifecycle} after {max:?}: {c}\n{}",
                self.stack.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// One stream of the command's stored output, read back whole
    /// through `rvc output --follow` (the server's GetOutput pages), and
    /// what rvc said on stderr (gap notices).
    #[must_use]
    pub fn output(&self, uuid: &str, stream: &str) -> (Vec<u8>, String) {
        let out = self.rvc(&["output", "--follow", "--stream", stream, "web-1", uuid]);
        assert!(
            out.status.success(),
            "rvc output failed: {}",
            text(&out.stderr)
        );
        (out.stdout, text(&out.stderr))
    }

    /// One stream of the command's stored output as the server serves it
    /// (`rvc -o json output --stream`, page after page): its bytes and
    /// every gap record between them, in event order. Call it once the
    /// command ended.
    #[must_use]
    pub fn stored_output(&self, uuid: &str, stream: &str) -> Vec<Piece> {
        use base64::Engine as _;
        let mut pieces = Vec::new();
        let mut page: Option<String> = None;
        loop {
            let mut args = vec!["-o", "json", "output", "--stream", stream, "web-1", uuid];
            if let Some(p) = &page {
                args.push("--page");
                args.push(p);
            }
            let out = self.rvc(&args);
            assert!(out.status.success(), "rvc output: {}", text(&out.stderr));
            let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
            for item in doc["items"].as_array().cloned().unwrap_or_default() {
                let n = |v: &Value| {
                    v.as_str()
                        .and_then(|s| s.parse::<u64>().ok())
                        .or_else(|| v.as_u64())
                        .unwrap_or(0)
                };
                if let Some(d) = item.get("data") {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(d["data"].as_str().unwrap_or_default())
                        .unwrap();
                    match pieces.last_mut() {
                        Some(Piece::Bytes(b)) => b.extend_from_slice(&bytes),
                        _ => pieces.push(Piece::Bytes(bytes)),
                    }
                } else if let Some(m) = item.get("marker") {
                    let ev = &m["event"];
                    if let Some(t) = ev.get("truncation") {
                        pieces.push(Piece::Gap {
                            raw_bytes: n(&t["rawBytes"]),
                            source: t["source"].as_str().unwrap_or_default().to_owned(),
                        });
                    } else if ev.get("incomplete").is_some() {
                        pieces.push(Piece::Incomplete);
                    }
                } else if let Some(r) = item.get("retention") {
                    pieces.push(Piece::Gap {
                        raw_bytes: n(&r["rawBytes"]),
                        source: r["source"].as_str().unwrap_or_default().to_owned(),
                    });
                }
            }
            match doc["nextPageToken"].as_str() {
                Some(t) if !t.is_empty() => page = Some(t.to_owned()),
                _ => return pieces,
            }
        }
    }

    /// The output oracle on one stream of an ended command: what the
    /// server stores and serves equals `wrote` byte for byte, with no gap
    /// record at all.
    pub fn assert_stream_exact(&self, uuid: &str, stream: &str, wrote: &[u8]) {
        let pieces = self.stored_output(uuid, stream);
        match check_stream(&pieces, wrote) {
            Ok(gaps) if gaps.is_empty() => {}
            Ok(gaps) => panic!(
                "{stream} of {uuid} has gap records {gaps:?}, none expected\n{}",
                self.stack.logs()
            ),
            Err(e) => panic!("{stream} of {uuid}: {e}\n{}", self.stack.logs()),
        }
    }

    /// Waits until the command's stored events reach `at_least`.
    pub fn wait_events(&self, uuid: &str, at_least: u64) {
        self.stack
            .wait_until_for("the command's events", Duration::from_secs(60), || {
                self.command(uuid)["lastEventSeq"]
                    .as_str()
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|n| n >= at_least)
            });
    }

    /// Waits until the command's stored events grew by `more` from what
    /// they are now, or it ended: progress after a fault. (How many events
    /// a command's output makes depends on how its lines were batched,
    /// which load changes, so a fixed total is no measure of progress.)
    pub fn wait_progress(&self, uuid: &str, more: u64) {
        let seq = |c: &Value| {
            c["lastEventSeq"]
                .as_str()
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let from = seq(&self.command(uuid));
        self.stack.wait_until_for(
            "the command's events to grow",
            Duration::from_secs(60),
            || {
                let c = self.command(uuid);
                seq(&c) >= from + more
                    || c["lifecycle"].as_str().is_some_and(|l| {
                        !matches!(
                            l,
                            "LIFECYCLE_RUNNING"
                                | "LIFECYCLE_ACCEPTED"
                                | "LIFECYCLE_DISPATCHED"
                                | "LIFECYCLE_QUEUED"
                        )
                    })
            },
        );
    }

    /// Waits until the command runs.
    pub fn wait_running(&self, uuid: &str) {
        self.stack.wait_until("the command runs", || {
            self.command(uuid)["lifecycle"] == "LIFECYCLE_RUNNING"
        });
    }

    /// Creates the file `go` in the client's work directory (see
    /// [`gated`]).
    pub fn go(&self) {
        std::fs::write(self.stack.work().join("go"), b"").unwrap();
    }

    /// The client daemon is the one this test started (it never exited).
    pub fn assert_client_alive(&mut self) {
        let client = self.stack.client.as_mut().unwrap();
        assert!(
            client.try_wait().unwrap().is_none(),
            "the client daemon exited:\n{}",
            self.stack.logs()
        );
    }

    /// The same command followed from its first event (`rvc follow`):
    /// stdout, stderr and exit status, as an operator sees them.
    #[must_use]
    pub fn follow(&self, uuid: &str) -> Output {
        self.rvc(&["follow", uuid])
    }

    /// A marker file in the client's work directory.
    #[must_use]
    pub fn marker(&self, name: &str) -> PathBuf {
        self.stack.work().join(format!("marker-{name}"))
    }

    /// Lines in a marker file (0 when absent): how often a side effect
    /// happened.
    #[must_use]
    pub fn marker_count(&self, name: &str) -> usize {
        std::fs::read_to_string(self.marker(name))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    /// A metric of the client's `/metrics` (0 when absent).
    #[must_use]
    pub fn client_metric(&self, name: &str) -> u64 {
        metric(self.stack.client_health, name)
    }

    /// A metric of the server's `/metrics`, summed over its labels (0
    /// when absent).
    #[must_use]
    pub fn server_metric(&self, name: &str) -> u64 {
        metric(self.stack.server_metrics, name)
    }

    /// Occurrences of `needle` in both daemons' logs.
    #[must_use]
    pub fn log_count(&self, needle: &str) -> usize {
        self.stack.server_log().matches(needle).count()
            + self.stack.client_log().matches(needle).count()
    }

    /// The checks every chaos test ends with: nothing panicked, and no
    /// session was closed as a protocol violation.
    pub fn assert_clean(&self) {
        for (name, log) in [
            ("server", self.stack.server_log()),
            ("client", self.stack.client_log()),
        ] {
            assert!(
                !log.contains("panicked"),
                "the {name} panicked:\n{}",
                self.stack.logs()
            );
            for bad in ["PROTOCOL_ERROR", "ProtocolError"] {
                assert!(
                    !log.contains(bad),
                    "the {name} log has {bad}:\n{}",
                    self.stack.logs()
                );
            }
        }
    }

    /// Waits until the server shows `web-1` connected.
    pub fn wait_connected(&self, max: Duration) {
        self.stack
            .wait_until_for("the client is connected", max, || {
                let out = self.rvc(&["stat"]);
                text(&out.stdout)
                    .lines()
                    .any(|l| l.starts_with("web-1") && l.contains("connected"))
            });
    }
}

/// A piece of a stream as the server serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Output bytes (consecutive chunks joined).
    Bytes(Vec<u8>),
    /// A truncation record: the client's (`CLIENT_OVERLOAD`,
    /// `CLIENT_SPOOL`) or the server's retention or storage loss.
    Gap {
        /// The raw bytes it says are missing.
        raw_bytes: u64,
        /// Its source (`TRUNCATION_SOURCE_...`).
        source: String,
    },
    /// An `OutputIncomplete` record.
    Incomplete,
}

/// The output oracle: `pieces` (what the server stores and serves) equal
/// `wrote` (what the process wrote) except for runs each covered by
/// exactly one gap record whose raw byte count equals the missing run;
/// no byte is duplicated, reordered or invented. Returns the gaps.
///
/// # Errors
/// Where and how the stored stream departs from what was written.
pub fn check_stream(pieces: &[Piece], wrote: &[u8]) -> Result<Vec<(u64, String)>, String> {
    let mut at = 0usize;
    let mut gaps = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        match p {
            Piece::Bytes(b) => {
                let end = at + b.len();
                let want = wrote.get(at..end).ok_or_else(|| {
                    format!(
                        "piece {i}: {} stored bytes at offset {at} run past the {} written",
                        b.len(),
                        wrote.len()
                    )
                })?;
                if want != b.as_slice() {
                    let first = want.iter().zip(b).position(|(x, y)| x != y).unwrap_or(0);
                    return Err(format!(
                        "piece {i}: stored bytes differ from the written ones at offset {}",
                        at + first
                    ));
                }
                at = end;
            }
            Piece::Gap { raw_bytes, source } => {
                if matches!(pieces.get(i + 1), Some(Piece::Gap { .. })) {
                    return Err(format!("piece {i}: two gap records in a row"));
                }
                let n = usize::try_from(*raw_bytes).unwrap_or(usize::MAX);
                if at.saturating_add(n) > wrote.len() {
                    return Err(format!(
                        "piece {i}: a {source} gap of {raw_bytes} bytes at offset {at} runs past the {} written",
                        wrote.len()
                    ));
                }
                at += n;
                gaps.push((*raw_bytes, source.clone()));
            }
            Piece::Incomplete => {}
        }
    }
    if at != wrote.len() {
        return Err(format!(
            "{at} bytes accounted for (stored or in gap records) of {} written: the rest vanished without a record",
            wrote.len()
        ));
    }
    Ok(gaps)
}

fn metric(port: u16, name: &str) -> u64 {
    let body = rvbox_testkit::http_get(port, "/metrics")
        .map(|(_, b)| b)
        .unwrap_or_default();
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// A command that prints `start`, waits for the file `go` in its working
/// directory ([`Chaos::go`]), then runs `body`: the test decides when its
/// output begins, e.g. inside a fault.
#[must_use]
pub fn gated(body: &str) -> String {
    format!("echo start; while [ ! -e go ]; do sleep 0.05; done; rm -f go; {body}")
}

/// The bytes of `echo "line $i"` for `1..=n`.
#[must_use]
pub fn lines(n: u64) -> Vec<u8> {
    (1..=n)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect()
}

/// A loop of `n` writes of `line $i`, one event each (a short sleep
/// between writes keeps the pipe reader from joining them).
#[must_use]
pub fn lines_command(n: u64) -> String {
    format!("i=0; while [ $i -lt {n} ]; do i=$((i+1)); echo \"line $i\"; sleep 0.001; done")
}

/// The bytes `printf 'line %d\n'` writes for `1..=n`.
#[must_use]
pub fn numbered_lines(n: u64) -> Vec<u8> {
    let mut v = Vec::new();
    for i in 1..=n {
        v.extend_from_slice(format!("line {i}\n").as_bytes());
    }
    v
}

/// A shell loop writing `line 1` .. `line N`, one write each, sleeping
/// `pause` seconds after every `every` lines.
#[must_use]
pub fn numbered_lines_command(n: u64, every: u64, pause: &str) -> String {
    format!(
        "i=0; while [ $i -lt {n} ]; do i=$((i+1)); echo \"line $i\"; if [ $((i % {every})) -eq 0 ]; then sleep {pause}; fi; done"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(b: &[u8]) -> Piece {
        Piece::Bytes(b.to_vec())
    }
    fn gap(n: u64) -> Piece {
        Piece::Gap {
            raw_bytes: n,
            source: "TRUNCATION_SOURCE_CLIENT_SPOOL".into(),
        }
    }

    #[test]
    fn the_output_oracle_accepts_exact_and_labelled_streams() {
        assert_eq!(check_stream(&[bytes(b"abcdef")], b"abcdef"), Ok(vec![]));
        let g = check_stream(&[bytes(b"ab"), gap(2), bytes(b"ef")], b"abcdef").unwrap();
        assert_eq!(g.len(), 1);
        assert!(check_stream(&[gap(6)], b"abcdef").is_ok());
        assert!(check_stream(&[], b"").is_ok());
    }

    #[test]
    fn the_output_oracle_sees_loss_duplication_reordering_and_invention() {
        // a silent gap
        assert!(check_stream(&[bytes(b"ab"), bytes(b"ef")], b"abcdef").is_err());
        // a lost tail
        assert!(check_stream(&[bytes(b"abcd")], b"abcdef").is_err());
        // a duplicated byte run
        assert!(check_stream(&[bytes(b"abcabcdef")], b"abcdef").is_err());
        // reordered
        assert!(check_stream(&[bytes(b"abdcef")], b"abcdef").is_err());
        // invented
        assert!(check_stream(&[bytes(b"abcdefg")], b"abcdef").is_err());
        // a record that counts the wrong number of bytes
        assert!(check_stream(&[bytes(b"ab"), gap(3), bytes(b"ef")], b"abcdef").is_err());
        assert!(check_stream(&[bytes(b"ab"), gap(1), bytes(b"ef")], b"abcdef").is_err());
        // one run covered by two records
        assert!(check_stream(&[bytes(b"ab"), gap(1), gap(1), bytes(b"ef")], b"abcdef").is_err());
    }
}
