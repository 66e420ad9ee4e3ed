#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The client daemon's side of the frame-size limit (plan §11.3 oversized
//! frames): the real `rvbox` binary against a stand-in server that sends
//! a frame header announcing more than the 1 MiB envelope limit. The
//! client refuses it from the header alone, before any of the payload is
//! buffered, drops that connection at once, and dials again.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_tungstenite::tungstenite;

/// Announced length: above the 1 MiB limit and below tungstenite's own
/// defaults (16 MiB frames, 64 MiB messages), so only RVBox's limit
/// refuses it.
const ANNOUNCED: u64 = 8 << 20;

struct Client(Child);

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_client(dir: &Path, port: u16) -> Client {
    std::fs::create_dir_all(dir.join("work")).unwrap();
    let config = dir.join("client.toml");
    std::fs::write(
        &config,
        format!(
            "[client]\nclient_id = \"web-1\"\nserver_urls = [\"ws://127.0.0.1:{port}/rvbox/agent\"]\nstate_dir = \"{state}\"\n[exec]\nallowed_cwd_roots = [\"{work}\"]\ndefault_cwd = \"{work}\"\n[reconnect]\ninitial = \"1s\"\nmax = \"2s\"\n[observability]\nlog_level = \"debug\"\n",
            state = dir.join("state").display(),
            work = dir.join("work").display(),
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_rvbox"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("client.log")).unwrap())
        .spawn()
        .unwrap();
    Client(child)
}

/// The next connection on `l`, within `max`.
fn accept_within(l: &TcpListener, max: Duration, log: &Path) -> TcpStream {
    let until = Instant::now() + max;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < until,
                    "the client did not dial: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

#[test]
fn a_frame_announcing_more_than_the_envelope_limit_is_refused_from_its_header() {
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let log = dir.path().join("client.log");
    let _client = start_client(dir.path(), port);

    let tcp = accept_within(&listener, Duration::from_secs(20), &log);
    let mut ws = tungstenite::accept(tcp).unwrap();
    // the client speaks first: its hello
    let hello = ws.read().unwrap();
    assert!(hello.is_binary(), "{hello:?}");
    // a binary frame header announcing ANNOUNCED bytes, and 4 KiB of them
    let mut frame = vec![0x82, 127];
    frame.extend_from_slice(&ANNOUNCED.to_be_bytes());
    frame.extend_from_slice(&[0u8; 4096]);
    let sent_at = Instant::now();
    let tcp = ws.get_mut();
    tcp.write_all(&frame).unwrap();
    tcp.flush().unwrap();
    // the client ends the connection without waiting for the rest
    tcp.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match tcp.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                assert!(
                    sent_at.elapsed() < Duration::from_secs(10),
                    "the client is still waiting for the announced payload: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            Err(_) => break,
        }
    }
    assert!(
        sent_at.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent_at.elapsed()
    );
    // and dials again
    let _again = accept_within(&listener, Duration::from_secs(10), &log);
    let text = std::fs::read_to_string(&log).unwrap();
    let refused = text
        .lines()
        .find(|l| l.contains("read failed"))
        .unwrap_or_else(|| panic!("no refused read in the log: {text}"));
    assert!(
        refused.contains("Message too long") && refused.contains(&format!("{ANNOUNCED} > 1048576")),
        "{refused}"
    );
}
