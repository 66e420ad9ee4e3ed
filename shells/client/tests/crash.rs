//! The crash suite of plan §7.6: the client daemon, a real process (this
//! test binary re-run as a child: the client runtime over the real client
//! store and the Unix supervisor), is killed at each acceptance, launch,
//! event-spool, script-upload, terminal-acknowledgement and tombstone-rotation
//! commit point;
//! after a restart the same dispatch is sent again. The command appends one
//! line to a side-effect file each time it runs. Every case must show
//! exactly one of: a durable refusal before authorization (nothing ran), one
//! supervised run, or an interrupted uncertain launch; never a second run.
//!
//! The parent plays the server over a Unix socket the child connects to
//! (away from the test harness's own output): each frame is a
//! little-endian `u32` length and an encoded envelope. Every event is
//! acknowledged as it arrives.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use prost::Message as _;

use rvbox_client_core::machine::Input;

use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions, crash};
use rvbox_domain::hash::command_hash;

use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::crash::CrashHook;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;
use rvbox_supervisor::UnixSupervisor;

mod support;

use support::{SID, client_id, config};

const CHILD_ENV: &str = "RVBOX_CLIENT_CRASH_CHILD";
const DIR_ENV: &str = "RVBOX_CLIENT_CRASH_DIR";
const ISSUE: &str = "01890a5d-ac96-774b-bcce-b302099a8001";

/// Aborts the process the `after`-th time `point` is reached.
#[derive(Debug)]
struct AbortAt {
    point: String,
    after: u32,
    hits: AtomicU32,
}

impl CrashHook for AbortAt {
    fn at(&self, point: &'static str) {
        if point == self.point && self.hits.fetch_add(1, Ordering::SeqCst) + 1 >= self.after {
            std::process::abort();
        }
    }
}

fn write_frame(w: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(&u32::try_from(bytes.len()).unwrap().to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).ok()?;
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut buf).ok()?;
    Some(buf)
}

/// The child: the daemon. Frames from the parent are inputs; frames the
/// runtime releases go to the parent.
#[test]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return; // only meaningful as a child process of the suite below
    };
    let dir = std::path::PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let cwd = dir.join("work");
    let mut store = ClientStore::open(
        ClientLayout::new(dir.join("state")),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        ClientStoreOptions {
            tombstone_cap: 1,
            ..ClientStoreOptions::default()
        },
        0,
    )
    .unwrap();
    if let Some((point, after)) = spec.split_once('@') {
        store.set_crash_hook(Arc::new(AbortAt {
            point: point.to_owned(),
            after: after.parse().unwrap(),
            hits: AtomicU32::new(0),
        }));
    }
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let mut sc = support::supervisor_config(run);
    sc.drain_grace = Duration::from_millis(300);
    let sup = UnixSupervisor::new(sc).unwrap();
    let mut rt = Runtime::new(config(cwd.to_str().unwrap()), store, sup, 5).unwrap();
    let sock = std::os::unix::net::UnixStream::connect(dir.join("server.sock")).unwrap();
    let mut reader = sock.try_clone().unwrap();
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        while let Some(f) = read_frame(&mut reader) {
            if tx.send(f).is_err() {
                return;
            }
        }
    });
    rt.input(Input::Opened);
    let mut out = sock;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        for w in rt.take_wire() {
            if let Wire::Binary(b) = w {
                write_frame(&mut out, &b).unwrap();
            }
        }
        match rx.recv_timeout(Duration::from_millis(5)) {
            Ok(f) => rt.input(Input::Frame(f)),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        rt.pump_processes(Duration::from_millis(5));
        rt.tick();
    }
}

/// The parent's view of one daemon process: the server end of its
/// connection (a Unix socket, away from the test harness's own output).
struct Daemon {
    child: std::process::Child,
    stream: std::os::unix::net::UnixStream,
    rx: mpsc::Receiver<wire::Envelope>,
    generation: u64,
    seen: Vec<wire::Envelope>,
}

impl Daemon {
    fn spawn(dir: &Path, crash: Option<(&str, u32)>, generation: u64) -> Self {
        let path = dir.join("server.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(
                CHILD_ENV,
                crash.map_or("none".to_owned(), |(p, n)| format!("{p}@{n}")),
            )
            .env(DIR_ENV, dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let (stream, _) = listener.accept().unwrap();
        let mut reader = stream.try_clone().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            while let Some(f) = read_frame(&mut reader) {
                match wire::Envelope::decode(f.as_slice()) {
                    Ok(env) => {
                        if tx.send(env).is_err() {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
        });
        Self {
            child,
            stream,
            rx,
            generation,
            seen: Vec::new(),
        }
    }

    fn send(&mut self, p: Payload) -> bool {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: self.generation,
            payload: Some(p),
        };
        write_frame(&mut self.stream, &env.encode_to_vec()).is_ok()
    }

    /// Collects frames for up to `wait`, acknowledging events as they come.
    fn drive(&mut self, wait: Duration, stop: impl Fn(&[wire::Envelope]) -> bool) -> bool {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            match self.rx.recv_timeout(Duration::from_millis(20)) {
                Ok(env) => {
                    if let Some(Payload::CommandEvent(e)) = &env.payload {
                        let ack = Payload::EventAck(wire::EventAck {
                            issue_uuid: e.issue_uuid.clone(),
                            durable_event_seq: e.event_seq,
                        });
                        self.seen.push(env.clone());
                        if !self.send(ack) {
                            return false;
                        }
                    } else {
                        self.seen.push(env);
                    }
                    if stop(&self.seen) {
                        return true;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(_)) = self.child.try_wait() {
                        return false;
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        false
    }

    fn connect(&mut self) -> bool {
        if !self.drive(Duration::from_secs(10), |s| {
            s.iter()
                .any(|e| matches!(e.payload, Some(Payload::ClientHello(_))))
        }) {
            return false;
        }
        let g = self.generation;
        let ok = self.send(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation: g,
            ..Default::default()
        })) && self.send(Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![wire::ReconcileRow {
                issue_uuid: ISSUE.into(),
                ..Default::default()
            }],
        }));
        if !ok
            || !self.drive(Duration::from_secs(10), |s| {
                s.iter().any(
                    |e| matches!(&e.payload, Some(Payload::ClientSnapshot(c)) if c.final_chunk),
                )
            })
        {
            return false;
        }
        let mut r = wire::ReconcileResult {
            round: 1,
            ..Default::default()
        };
        // the server holds no record of the command in this suite: a
        // record the client holds is terminated, a tombstone kept
        if let Some(Payload::ClientSnapshot(c)) = self
            .seen
            .iter()
            .rev()
            .find(|e| matches!(e.payload, Some(Payload::ClientSnapshot(_))))
            .and_then(|e| e.payload.clone())
        {
            for rec in c.records {
                r.resume.push(wire::ResumeRow {
                    issue_uuid: rec.issue_uuid,
                    revision: rec.revision.max(1),
                    durable_event_seq: 0,
                    script_resume_offset: 0,
                });
            }
        }
        r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
        self.send(Payload::ReconcileResult(r))
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SCRIPT: &[u8] = b"echo ran >> side-effects\necho out\n";

fn spec_of(script: bool) -> wire::ExecutionSpec {
    let source = if script {
        wire::execution_spec::Source::Script(wire::ScriptDescriptor {
            display_basename: "job.sh".into(),
            size_bytes: SCRIPT.len() as u64,
            sha256: rvbox_segment_sha(SCRIPT),
        })
    } else {
        wire::execution_spec::Source::CommandText("echo ran >> side-effects; echo out".into())
    };
    wire::ExecutionSpec {
        source: Some(source),
        ..Default::default()
    }
}

fn rvbox_segment_sha(b: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(b).to_vec()
}

fn dispatch_of(issue: &str, generation: u64, script: bool) -> Payload {
    let spec = spec_of(script);
    let normalized = check_execution_spec(&spec).unwrap();
    Payload::Dispatch(wire::Dispatch {
        issue_uuid: issue.into(),
        generation,
        revision: 1,
        request_hash: command_hash(&client_id(), &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    })
}

/// The script upload of `issue`, in two chunks (the server's resend after a
/// restart sends them again from the start: an exact replay).
fn chunks(issue: &str) -> Vec<Payload> {
    let half = SCRIPT.len() / 2;
    [(0, &SCRIPT[..half]), (half, &SCRIPT[half..])]
        .into_iter()
        .map(|(offset, part)| {
            Payload::ScriptChunk(wire::ScriptChunk {
                issue_uuid: issue.into(),
                offset: offset as u64,
                declared_size: SCRIPT.len() as u64,
                compression: wire::Compression::None as i32,
                payload: part.to_vec(),
                raw_length: part.len() as u32,
                stored_length: part.len() as u32,
                raw_sha256: rvbox_segment_sha(part),
            })
        })
        .collect()
}

fn accepted(seen: &[wire::Envelope], issue: &str) -> bool {
    seen.iter().any(|e| {
        matches!(&e.payload, Some(Payload::CommandAccepted(a))
            if a.issue_uuid == issue && a.outcome == wire::AcceptOutcome::Positive as i32)
    })
}

fn terminal(seen: &[wire::Envelope]) -> Option<i32> {
    seen.iter().rev().find_map(|e| match &e.payload {
        Some(Payload::CommandEvent(ev)) => match &ev.body {
            Some(Body::Lifecycle(l)) if l.lifecycle != wire::Lifecycle::Running as i32 => {
                Some(l.lifecycle)
            }
            _ => None,
        },
        _ => None,
    })
}

fn refused(seen: &[wire::Envelope]) -> bool {
    seen.iter().any(|e| {
        matches!(&e.payload, Some(Payload::CommandAccepted(a))
            if a.outcome == wire::AcceptOutcome::Permanent as i32)
    })
}

/// What a case dispatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A command text.
    Text,
    /// A script, uploaded after the acceptance.
    Script,
    /// A command text after another command finished, so that the
    /// tombstone FIFO (cap 1) rotates.
    Rotation,
}

const WARMUP: &str = "01890a5d-ac96-774b-bcce-b302099a80ff";

/// Dispatches the case's command (and its script) on `d`.
fn start(d: &mut Daemon, kind: Kind, generation: u64) {
    d.send(dispatch_of(ISSUE, generation, kind == Kind::Script));
    if kind == Kind::Script {
        let _ = d.drive(Duration::from_secs(10), |s| accepted(s, ISSUE));
        for c in chunks(ISSUE) {
            d.send(c);
        }
    }
}

/// One case: crash at `point`, restart, dispatch again.
fn case(point: &'static str, kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("work")).unwrap();
    let mut d = Daemon::spawn(dir.path(), Some((point, 1)), 1);
    assert!(d.connect(), "{point}: the first daemon did not connect");
    if kind == Kind::Rotation {
        // a first command runs and is acknowledged: its tombstone fills
        // the FIFO; it writes no side effect
        let spec = wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("true".into())),
            ..Default::default()
        };
        let normalized = check_execution_spec(&spec).unwrap();
        d.send(Payload::Dispatch(wire::Dispatch {
            issue_uuid: WARMUP.into(),
            generation: 1,
            revision: 1,
            request_hash: command_hash(&client_id(), &normalized).0.to_vec(),
            spec: Some(spec),
            queue_expiry_time: None,
        }));
        let _ = d.drive(Duration::from_secs(20), |s| {
            s.iter().any(|e| {
                matches!(&e.payload, Some(Payload::CommandEvent(ev))
                if ev.issue_uuid == WARMUP && matches!(&ev.body, Some(Body::Lifecycle(l))
                    if l.lifecycle != wire::Lifecycle::Running as i32))
            })
        });
        let _ = d.drive(Duration::from_millis(300), |_| false);
        d.seen.clear();
    }
    start(&mut d, kind, 1);
    // run until it dies at the point (or finishes the command)
    let finished = d.drive(Duration::from_secs(20), |s| terminal(s).is_some());
    let _ = d.drive(Duration::from_millis(300), |_| false);
    // the connection can close before the exit is visible: wait for it
    let until = Instant::now() + Duration::from_secs(5);
    let mut crashed = false;
    while Instant::now() < until {
        if let Ok(Some(_)) = d.child.try_wait() {
            crashed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    d.kill();
    assert!(crashed || finished, "{point}: neither a crash nor an end");
    assert!(crashed, "{point} was never reached");

    let mut d = Daemon::spawn(dir.path(), None, 2);
    assert!(d.connect(), "{point}: the restarted daemon did not connect");
    start(&mut d, kind, 2);
    let _ = d.drive(Duration::from_secs(20), |s| {
        terminal(s).is_some() || refused(s)
    });
    let _ = d.drive(Duration::from_millis(500), |_| false);
    let seen = std::mem::take(&mut d.seen);
    d.kill();

    let runs = std::fs::read_to_string(dir.path().join("work/side-effects"))
        .map(|s| s.lines().count())
        .unwrap_or(0);
    assert!(runs <= 1, "{point}: the command ran {runs} times");
    let fate = terminal(&seen);
    let ok = match (runs, fate) {
        (1, Some(l)) => {
            l == wire::Lifecycle::Succeeded as i32 || l == wire::Lifecycle::Interrupted as i32
        }
        // ran and was acknowledged before the kill: refused as executed
        (1, None) => refused(&seen),
        // an authorized launch whose child never got to run
        (0, Some(l)) => l == wire::Lifecycle::Interrupted as i32,
        (0, None) => false,
        _ => false,
    };
    assert!(ok, "{point}: runs {runs}, fate {fate:?}");
}

#[test]
fn a_killed_daemon_runs_a_command_at_most_once_at_every_commit_point() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    for point in [
        crash::RECONCILE_AFTER_COMMIT,
        crash::ACCEPT_BEFORE_COMMIT,
        crash::ACCEPT_AFTER_COMMIT,
        crash::MATERIALIZE_BEFORE_RENAME,
        crash::LAUNCH_PREPARED_AFTER_FSYNC,
        crash::LAUNCH_AUTHORIZED_AFTER_FSYNC,
        crash::LAUNCH_RUNNING_AFTER_COMMIT,
        crash::SPOOL_SEGMENT_AFTER_CREATE,
        crash::SPOOL_EVENT_BEFORE_COMMIT,
        crash::SPOOL_EVENT_AFTER_COMMIT,
        crash::SPOOL_APPEND_BEFORE_FSYNC,
        crash::SPOOL_APPEND_AFTER_FSYNC,
        crash::SPOOL_APPEND_AFTER_COMMIT,
        crash::SPOOL_ASSIGN_AFTER_COMMIT,
        crash::LAUNCH_ENDED_AFTER_COMMIT,
        crash::SPOOL_RELEASE_AFTER_COMMIT,
        crash::TERMINAL_ACK_AFTER_COMMIT,
    ] {
        case(point, Kind::Text);
    }
    for point in [
        crash::SCRIPT_CHUNK_AFTER_FSYNC,
        crash::SCRIPT_CHUNK_AFTER_COMMIT,
        crash::SCRIPT_COMMIT_AFTER_COMMIT,
        crash::MATERIALIZE_BEFORE_RENAME,
        crash::LAUNCH_AUTHORIZED_AFTER_FSYNC,
    ] {
        case(point, Kind::Script);
    }
    case(crash::TOMBSTONE_ROTATE_BEFORE_COMMIT, Kind::Rotation);
    case(crash::TERMINAL_ACK_AFTER_COMMIT, Kind::Rotation);
}
