//! The fault proxy against real loopback sockets: an echo upstream, a
//! client, and each fault seen from the client's side.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rvbox_faultproxy::{BackgroundProxy, Command, Dir};

/// An upstream that echoes every byte back, and counts connections.
fn echo_server() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let c = std::sync::Arc::clone(&count);
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, count)
}

fn connect(p: &BackgroundProxy) -> TcpStream {
    let s = TcpStream::connect(p.addr("a").unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn read_exact(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

/// Reads what arrives within `wait`.
fn read_for(s: &mut TcpStream, wait: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
    }
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    out
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

#[test]
fn pass_forwards_every_byte_both_ways() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    let data = pattern(1 << 20);
    let mut w = s.try_clone().unwrap();
    let sent = data.clone();
    let t = std::thread::spawn(move || w.write_all(&sent).unwrap());
    assert_eq!(read_exact(&mut s, data.len()), data);
    t.join().unwrap();
    // the proxy counts a chunk after writing it: the reader can have it
    // before the count moves
    wait_for("every byte counted", || {
        let st = p.stats("a").unwrap();
        st.bytes_up == 1 << 20 && st.bytes_down == 1 << 20
    });
    let st = p.stats("a").unwrap();
    assert_eq!((st.bytes_up, st.bytes_down), (1 << 20, 1 << 20));
    assert_eq!(st.accepted, 1);
}

#[test]
fn blackhole_withholds_without_closing_and_loses_nothing_when_healed() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    s.write_all(b"before").unwrap();
    assert_eq!(read_exact(&mut s, 6), b"before");
    p.apply("a", &Command::Blackhole(Dir::Both)).unwrap();
    s.write_all(b"during the hole").unwrap();
    assert!(
        read_for(&mut s, Duration::from_millis(500)).is_empty(),
        "nothing crosses a blackhole"
    );
    // the connection is still open: a new one is accepted but never
    // reaches the upstream while the hole lasts
    let mut s2 = connect(&p);
    s2.write_all(b"new").unwrap();
    assert!(read_for(&mut s2, Duration::from_millis(300)).is_empty());
    assert_eq!(p.stats("a").unwrap().open, 2);
    p.apply("a", &Command::Pass).unwrap();
    assert_eq!(read_exact(&mut s, 15), b"during the hole");
    assert_eq!(read_exact(&mut s2, 3), b"new");
}

#[test]
fn a_one_way_blackhole_stops_only_that_way() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    s.write_all(b"x").unwrap();
    assert_eq!(read_exact(&mut s, 1), b"x");
    p.apply("a", &Command::Blackhole(Dir::Down)).unwrap();
    s.write_all(b"up still flows").unwrap();
    wait_for("the upstream to get the bytes", || {
        p.stats("a").unwrap().bytes_up == 15
    });
    assert!(read_for(&mut s, Duration::from_millis(300)).is_empty());
    p.apply("a", &Command::Pass).unwrap();
    assert_eq!(read_exact(&mut s, 14), b"up still flows");
}

#[test]
fn hold_reads_on_and_release_writes_everything_in_order() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    p.apply("a", &Command::Hold(Dir::Up)).unwrap();
    // far more than a socket buffer: the proxy takes it all
    let data = pattern(4 << 20);
    s.write_all(&data).unwrap();
    wait_for("the proxy to hold everything", || {
        p.stats("a").unwrap().held_bytes == 4 << 20
    });
    assert_eq!(p.stats("a").unwrap().bytes_up, 0);
    p.apply("a", &Command::Release).unwrap();
    assert_eq!(read_exact(&mut s, data.len()), data);
    wait_for("nothing held", || p.stats("a").unwrap().held_bytes == 0);
}

#[test]
fn cut_forwards_exactly_the_armed_byte_count_then_closes() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    s.write_all(b"abc").unwrap();
    assert_eq!(read_exact(&mut s, 3), b"abc");
    p.apply("a", &Command::Cut(Dir::Down, 10)).unwrap();
    s.write_all(&pattern(100)).unwrap();
    let got = read_for(&mut s, Duration::from_secs(3));
    assert_eq!(
        got,
        pattern(100)[..10].to_vec(),
        "exactly 10 bytes, then EOF"
    );
    assert_eq!(p.stats("a").unwrap().cuts, 1);
    // still armed for new connections, counted from their first byte
    let mut s2 = connect(&p);
    s2.write_all(&pattern(50)).unwrap();
    assert_eq!(
        read_for(&mut s2, Duration::from_secs(3)),
        pattern(50)[..10].to_vec()
    );
    p.apply("a", &Command::Pass).unwrap();
    let mut s3 = connect(&p);
    s3.write_all(&pattern(50)).unwrap();
    assert_eq!(read_exact(&mut s3, 50), pattern(50));
}

#[test]
fn drop_closes_open_connections_and_refuse_closes_new_ones() {
    let (up, count) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    s.write_all(b"1").unwrap();
    assert_eq!(read_exact(&mut s, 1), b"1");
    p.apply("a", &Command::Drop).unwrap();
    assert!(read_for(&mut s, Duration::from_secs(3)).is_empty());
    wait_for("the drop to be counted", || {
        p.stats("a").unwrap().dropped == 1
    });
    p.apply("a", &Command::Refuse).unwrap();
    let mut s2 = connect(&p);
    let _ = s2.write_all(b"2");
    assert!(read_for(&mut s2, Duration::from_secs(3)).is_empty());
    assert_eq!(p.stats("a").unwrap().refused, 1);
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
    p.apply("a", &Command::Accept).unwrap();
    let mut s3 = connect(&p);
    s3.write_all(b"3").unwrap();
    assert_eq!(read_exact(&mut s3, 1), b"3");
}

#[test]
fn delay_holds_each_chunk_back_at_least_that_long() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    p.apply("a", &Command::Delay(Duration::from_millis(300), Dir::Up))
        .unwrap();
    let t0 = Instant::now();
    s.write_all(b"slow").unwrap();
    assert_eq!(read_exact(&mut s, 4), b"slow");
    assert!(t0.elapsed() >= Duration::from_millis(300));
}

#[test]
fn upstream_switches_new_connections_only() {
    let (first, first_count) = echo_server();
    let (second, second_count) = echo_server();
    let p = BackgroundProxy::loopback("a", first).unwrap();
    let mut s = connect(&p);
    s.write_all(b"1").unwrap();
    assert_eq!(read_exact(&mut s, 1), b"1");
    p.apply("a", &Command::Upstream(second)).unwrap();
    let mut s2 = connect(&p);
    s2.write_all(b"2").unwrap();
    assert_eq!(read_exact(&mut s2, 1), b"2");
    s.write_all(b"3").unwrap();
    assert_eq!(read_exact(&mut s, 1), b"3");
    assert_eq!(first_count.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(second_count.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn the_binary_takes_commands_on_its_control_socket() {
    let (up, _) = echo_server();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ctl.sock");
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bin = env!("CARGO_BIN_EXE_rvbox-faultproxy");
    let mut child = std::process::Command::new(bin)
        .args([
            "run",
            "--route",
            &format!("a,127.0.0.1:{port},{up}"),
            "--control",
        ])
        .arg(&sock)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the control socket", || sock.exists());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&sock).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let ctl = |args: &[&str]| {
        std::process::Command::new(bin)
            .arg("ctl")
            .arg("--control")
            .arg(&sock)
            .args(args)
            .output()
            .unwrap()
    };
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let out = ctl(&["a", "blackhole"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("faults=[blackhole both]"), "{text}");
    s.write_all(b"held").unwrap();
    assert!(read_for(&mut s, Duration::from_millis(300)).is_empty());
    let out = ctl(&["a", "pass"]);
    assert!(out.status.success());
    assert_eq!(read_exact(&mut s, 4), b"held");
    let out = ctl(&["nope", "drop"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("error: no route `nope` (routes: a)"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = ctl(&["a", "cut", "sideways", "3"]);
    assert!(!out.status.success());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn rate_slows_a_direction_down_to_about_that_many_bytes_a_second() {
    let (up, _) = echo_server();
    let p = BackgroundProxy::loopback("a", up).unwrap();
    let mut s = connect(&p);
    p.apply("a", &Command::Rate(100_000, Dir::Down)).unwrap();
    let data = pattern(50_000);
    let t0 = Instant::now();
    s.write_all(&data).unwrap();
    assert_eq!(read_exact(&mut s, data.len()), data);
    // 50 kB at 100 kB/s: at least about half a second
    assert!(
        t0.elapsed() >= Duration::from_millis(450),
        "{:?}",
        t0.elapsed()
    );
}
