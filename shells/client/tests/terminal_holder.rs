#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The terminal holder as a real process (`rvbox __terminal-holder`) on a
//! real PTY with `/bin/sh`, driven over its socket as the client daemon
//! drives it: the token proof, output by offset across a daemon that went
//! away, every key written once though sent twice, Ctrl-C, Ctrl-\ and Ctrl-Z reaching the
//! shell's foreground job, a malformed record, and the close.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rvbox_terminal::local::{FromHolder, ToHolder, take_record, verify};

const TOKEN: [u8; 32] = [0x5a; 32];
const VIEWER: [u8; 16] = [7; 16];

fn start(dir: &Path) -> (Child, PathBuf) {
    let socket = dir.join("t.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rvbox"))
        .args(["__terminal-holder", "--socket"])
        .arg(&socket)
        .args(["--shell", "/bin/sh", "--cwd"])
        .arg(dir)
        .args(["--cols", "100", "--rows", "30", "--linger", "60"])
        .env("PS1", "$ ")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("holder.log")).unwrap())
        .spawn()
        .unwrap();
    let hex: String = TOKEN.iter().map(|b| format!("{b:02x}")).collect();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{hex}").unwrap();
    drop(stdin);
    let until = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < until, "the holder's socket did not appear");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, socket)
}

/// One connection, as a daemon holds it.
struct Daemon {
    stream: UnixStream,
    buf: Vec<u8>,
    /// Output bytes received, and the offset after the last of them.
    output: Vec<u8>,
    end: u64,
}

impl Daemon {
    fn connect(socket: &Path) -> Self {
        let stream = UnixStream::connect(socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        Self {
            stream,
            buf: Vec::new(),
            output: Vec::new(),
            end: 0,
        }
    }

    fn send(&mut self, m: &ToHolder) {
        self.stream.write_all(&m.encode()).unwrap();
    }

    fn input(&mut self, seq: u64, keys: &str) {
        self.send(&ToHolder::Input {
            viewer: VIEWER,
            seq,
            bytes: keys.as_bytes().to_vec(),
        });
    }

    /// The next message, or `None` once the holder closed the connection.
    fn next(&mut self, within: Duration) -> Option<FromHolder> {
        let until = Instant::now() + within;
        loop {
            if let Some(body) = take_record(&mut self.buf).unwrap() {
                let m = FromHolder::decode(&body).unwrap();
                if let FromHolder::Output { offset, bytes } = &m {
                    assert_eq!(*offset, self.end, "output with a hole or an overlap");
                    self.end += bytes.len() as u64;
                    self.output.extend_from_slice(bytes);
                }
                return Some(m);
            }
            assert!(
                Instant::now() < until,
                "nothing from the holder in {within:?}; the output so far: {:?}",
                String::from_utf8_lossy(&self.output)
            );
            let mut b = [0u8; 4096];
            match self.stream.read(&mut b) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Reads until the output shows `text`; every message on the way.
    fn until_output(&mut self, text: &str) -> Vec<FromHolder> {
        let mut seen = Vec::new();
        let until = Instant::now() + Duration::from_secs(20);
        while !String::from_utf8_lossy(&self.output).contains(text) {
            assert!(
                Instant::now() < until,
                "no {text:?} in the output: {:?}",
                String::from_utf8_lossy(&self.output)
            );
            let left = until.saturating_duration_since(Instant::now());
            if let Some(m) = self.next(left.max(Duration::from_secs(1))) {
                seen.push(m);
            }
        }
        seen
    }

    fn prove(&mut self, pid: u32) {
        let nonce = [0x11; 32];
        self.send(&ToHolder::Challenge { nonce });
        let Some(FromHolder::Proof { mac, pid: p, .. }) = self.next(Duration::from_secs(5)) else {
            panic!("no proof")
        };
        assert!(verify(&TOKEN, &nonce, &mac), "the proof does not verify");
        assert!(!verify(&[0; 32], &nonce, &mac));
        assert_eq!(p, pid);
    }

    /// Attaches from `from`; input acknowledgements may come first.
    fn attach(&mut self, from: u64) {
        self.end = from;
        self.send(&ToHolder::Attach { from });
        loop {
            match self.next(Duration::from_secs(5)) {
                Some(FromHolder::Replay { offset, cut }) => {
                    assert_eq!(
                        (offset, cut),
                        (from, 0),
                        "a reattach inside the ring is exact"
                    );
                    return;
                }
                Some(FromHolder::InputAck { .. }) => {}
                other => panic!("no replay: {other:?}"),
            }
        }
    }
}

fn count(hay: &[u8], needle: &str) -> usize {
    String::from_utf8_lossy(hay).matches(needle).count()
}

#[test]
fn a_terminal_outlives_its_daemon_and_writes_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut holder, socket) = start(dir.path());
    let mode = std::fs::metadata(&socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
    let mut d1 = Daemon::connect(&socket);
    d1.prove(holder.id());
    d1.attach(0);
    d1.input(1, "echo one$((1+1))\n");
    let acks = d1.until_output("one2");
    d1.input(2, "stty size\n");
    d1.until_output("30 100");
    assert!(
        acks.iter().any(|m| matches!(
            m,
            FromHolder::InputAck {
                acked: 1,
                refused: None,
                ..
            }
        )),
        "the first frame is acknowledged: {acks:?}"
    );
    let seen = d1.end;
    // the daemon goes away; the shell goes on
    drop(d1);
    std::thread::sleep(Duration::from_millis(300));
    let mut d2 = Daemon::connect(&socket);
    d2.prove(holder.id());
    // the new daemon resends what it did not see acknowledged, once more
    d2.input(1, "echo one$((1+1))\n");
    d2.input(2, "stty size\n");
    d2.input(3, "echo two$((2+1))\n");
    d2.attach(seen);
    d2.until_output("two3");
    assert_eq!(
        count(&d2.output, "one2"),
        0,
        "a resent frame was written again"
    );
    // Ctrl-C reaches the foreground job, not the holder
    // (once the job is surely running: a Ctrl-C before it would only
    // clear the shell's line)
    d2.input(4, "echo started$((5+5)); sleep 60\n");
    d2.until_output("started10");
    std::thread::sleep(Duration::from_millis(500));
    d2.input(5, "\u{3}");
    d2.input(6, "echo after$((3+4))\n");
    // within 20 s, well before the sleep would end by itself
    d2.until_output("after7");
    // Ctrl-\ quits the foreground job (SIGQUIT), Ctrl-Z stops it
    // (SIGTSTP) and gives the terminal back to the shell
    d2.input(7, "echo quitting$((6+6)); sleep 60\n");
    d2.until_output("quitting12");
    std::thread::sleep(Duration::from_millis(500));
    d2.input(8, "\u{1c}");
    d2.input(9, "echo quit$((4+4))\n");
    d2.until_output("quit8");
    d2.input(10, "echo stopping$((7+7)); sleep 60\n");
    d2.until_output("stopping14");
    std::thread::sleep(Duration::from_millis(500));
    d2.input(11, "\u{1a}");
    d2.input(12, "echo stopped$((8+1))\n");
    d2.until_output("stopped9");
    // a gap is refused, not written
    d2.input(15, "echo gap$((4+5))\n");
    let m = loop {
        match d2.next(Duration::from_secs(5)) {
            Some(
                m @ FromHolder::InputAck {
                    refused: Some(_), ..
                },
            ) => break m,
            Some(_) => {}
            None => panic!("closed"),
        }
    };
    assert_eq!(
        m,
        FromHolder::InputAck {
            viewer: VIEWER,
            acked: 12,
            refused: Some(rvbox_terminal::local::Refused::Gap)
        }
    );
    // the close hangs the shell up; its end is told and the holder exits
    d2.send(&ToHolder::Close);
    let exited = loop {
        match d2.next(Duration::from_secs(10)) {
            Some(FromHolder::Exited { signal, value }) => break (signal, value),
            Some(_) => {}
            None => panic!("closed before the exit was told"),
        }
    };
    assert_eq!(exited, (true, 1), "the shell ends on SIGHUP");
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = holder.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "the holder did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists(), "the socket is left behind");
    assert_eq!(count(&d2.output, "gap9"), 0);
}

#[test]
fn a_malformed_record_closes_the_connection_not_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let (mut holder, socket) = start(dir.path());
    let mut d1 = Daemon::connect(&socket);
    let mut bad = ToHolder::Attach { from: 0 }.encode();
    bad[9] ^= 0xff;
    d1.stream.write_all(&bad).unwrap();
    assert!(d1.next(Duration::from_secs(5)).is_none(), "still connected");
    let mut d2 = Daemon::connect(&socket);
    d2.prove(holder.id());
    d2.attach(0);
    d2.input(1, "echo still$((20+1))\n");
    d2.until_output("still21");
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        std::fs::read_to_string(dir.path().join("holder.log"))
            .unwrap()
            .contains("checksum"),
        "the holder names what was wrong"
    );
}

fn spec(dir: &Path) -> rvbox_supervisor::terminal::HolderSpec {
    rvbox_supervisor::terminal::HolderSpec {
        socket: dir.join("adopt.sock"),
        shell: "/bin/sh".into(),
        shell_args: Vec::new(),
        env: Vec::new(),
        cwd: dir.to_path_buf(),
        cols: 80,
        rows: 24,
        ring: 1 << 20,
        linger: Duration::from_secs(60),
    }
}

/// A restarted daemon adopts its holder only with the recorded token,
/// pid, birth time and boot id; each mismatch is refused and named.
#[test]
fn a_holder_is_adopted_only_after_it_proves_its_identity() {
    use rvbox_supervisor::terminal::{TerminalError, adopt, start_holder};
    let dir = tempfile::tempdir().unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_rvbox"));
    let (record, mut child) = start_holder(&exe, &spec(dir.path())).unwrap();
    assert_eq!(record.pid, child.id());
    // the record's Debug never shows the token
    assert!(!format!("{record:?}").contains("token"));
    // adopted: the connection works as a daemon's
    let stream = adopt(&record).unwrap();
    let mut d = Daemon {
        stream,
        buf: Vec::new(),
        output: Vec::new(),
        end: 0,
    };
    d.stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    d.attach(0);
    d.input(1, "echo adopted$((40+2))\n");
    d.until_output("adopted42");
    drop(d);
    // another token: whoever answers is not our holder
    let mut wrong = record.clone();
    wrong.token[0] ^= 1;
    let e = adopt(&wrong).unwrap_err();
    assert!(
        matches!(&e, TerminalError::NotTheHolder { why, .. } if why.contains("token")),
        "{e}"
    );
    // the pid born at another time is not the holder (pid reuse)
    let mut reborn = record.clone();
    reborn.start_ticks += 1;
    assert!(matches!(adopt(&reborn), Err(TerminalError::Gone(_))));
    // another boot: the terminal ended with the host
    let mut rebooted = record.clone();
    rebooted.boot_id = "00000000-0000-0000-0000-000000000000".into();
    let e = adopt(&rebooted).unwrap_err();
    assert!(
        e.to_string().starts_with("terminal closed: host restarted"),
        "{e}"
    );
    // still adoptable after all that, by the right record
    drop(adopt(&record).unwrap());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(matches!(adopt(&record), Err(TerminalError::Gone(_))));
}
