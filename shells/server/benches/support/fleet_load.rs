//! The simulated agent fleet of the fan-out benchmarks: agent sessions
//! that speak the real protocol over real WebSockets (accept each
//! dispatch, run it for a simulated 0-400 ms, report RUNNING, one line of
//! output and the terminal event, register again when closed), a control
//! client on the server's Unix socket, and the figures' helpers (p99,
//! median, a raw `fdatasync` probe).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_precision_loss,
    dead_code
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::{SinkExt as _, StreamExt as _};
use prost::Message as _;
use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use tokio::sync::Mutex;
use tokio_tungstenite::tungstenite::Message;

use super::agent_client::{Ws, env, register_session};

/// When set, sessions whose index is a multiple of ten fail their
/// commands (exit 1).
pub(crate) static FAIL_TENTH: AtomicBool = AtomicBool::new(false);
/// Terminal events the load tool has sent.
pub(crate) static TERMINALS: AtomicU64 = AtomicU64::new(0);
/// Sessions that ended: closed by the server, or broken.
pub(crate) static CLOSED: AtomicU64 = AtomicU64::new(0);
/// Sessions registered again after the server closed them.
pub(crate) static RECONNECTS: AtomicU64 = AtomicU64::new(0);
/// The last close reason a session was sent.
pub(crate) static LAST_CLOSE: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
/// When set, sessions record in [`TIMELINE`] when each dispatch arrived
/// and when its terminal event was sent.
pub(crate) static RECORD_TIMELINE: AtomicBool = AtomicBool::new(false);
/// (session, time, whether it is the terminal event sent rather than the
/// dispatch received), while [`RECORD_TIMELINE`] is set.
pub(crate) static TIMELINE: std::sync::Mutex<Vec<(usize, Instant, bool)>> =
    std::sync::Mutex::new(Vec::new());

fn record(i: usize, terminal: bool) {
    if RECORD_TIMELINE.load(Ordering::Relaxed)
        && let Ok(mut t) = TIMELINE.lock()
    {
        t.push((i, Instant::now(), terminal));
    }
}

pub(crate) async fn control(
    socket: std::path::PathBuf,
) -> ControlClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::try_from("http://rvbox.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let s = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap();
    ControlClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

pub(crate) fn event(issue: &str, seq: u64, body: wire::command_event::Body) -> wire::CommandEvent {
    wire::CommandEvent {
        issue_uuid: issue.to_owned(),
        event_seq: seq,
        observed_time: None,
        body: Some(body),
    }
}

/// One agent session, as a real client daemon behaves: it accepts each
/// dispatch at once, runs the command for a simulated execution time
/// (0-400 ms, spread by a hash of the session and the command), then sends
/// RUNNING, one line of output and the terminal event; it answers Pings;
/// a probe session also sends a Ping every 20 ms and records the round
/// trip. When the server closes it (an overloaded server sheds sessions,
/// close 4003), it registers again after a jittered pause, as a daemon
/// reconnects; the load tool keeps no spool, so a command it held is ended
/// by reconciliation and counted failed.
pub(crate) async fn agent(
    i: usize,
    port: u16,
    first: (Ws, String, u64),
    rtts: Option<Arc<Mutex<Vec<f64>>>>,
) {
    let mut next = Some(first);
    let mut attempt = 0u64;
    loop {
        let (ws, sid, generation) = match next.take() {
            Some(c) => c,
            None => {
                attempt += 1;
                let pause = 200 + (i as u64 * 7919 + attempt * 104_729) % 1_000;
                tokio::time::sleep(Duration::from_millis(pause)).await;
                RECONNECTS.fetch_add(1, Ordering::Relaxed);
                register_session(i, port).await
            }
        };
        session(i, ws, sid, generation, rtts.as_ref()).await;
    }
}

pub(crate) async fn session(
    i: usize,
    ws: Ws,
    sid: String,
    generation: u64,
    rtts: Option<&Arc<Mutex<Vec<f64>>>>,
) {
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Message>();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut sent_at: Option<Instant> = None;
    let line = b"ok\n".to_vec();
    let z = zstd::bulk::compress(&line, 1).unwrap();
    loop {
        let msg = tokio::select! {
            m = stream.next() => m,
            Some(f) = rx.recv() => {
                if sink.send(f).await.is_err() {
                    return;
                }
                continue;
            }
            _ = tick.tick(), if rtts.is_some() => {
                if sent_at.is_none() {
                    sent_at = Some(Instant::now());
                    if sink.send(Message::Ping(vec![1].into())).await.is_err() {
                        return;
                    }
                }
                continue;
            }
        };
        let msg = match msg {
            Some(Ok(m)) => m,
            other => {
                CLOSED.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut l) = LAST_CLOSE.lock() {
                    *l = format!("{other:?}");
                }
                return;
            }
        };
        match msg {
            Message::Pong(_) => {
                if let (Some(t), Some(r)) = (sent_at.take(), rtts) {
                    r.lock().await.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            Message::Binary(b) => {
                let Ok(envl) = wire::Envelope::decode(b.as_ref()) else {
                    continue;
                };
                let Some(Payload::Dispatch(d)) = envl.payload else {
                    continue;
                };
                record(i, false);
                let accepted = Payload::CommandAccepted(wire::CommandAccepted {
                    issue_uuid: d.issue_uuid.clone(),
                    revision: d.revision,
                    outcome: wire::AcceptOutcome::Positive as i32,
                    error: None,
                    resolved_shell: wire::ShellType::Sh as i32,
                });
                if sink.send(env(&sid, generation, accepted)).await.is_err() {
                    return;
                }
                let fail = FAIL_TENTH.load(Ordering::Relaxed) && i.is_multiple_of(10);
                let (to, code) = if fail {
                    (wire::Lifecycle::Failed, 1)
                } else {
                    (wire::Lifecycle::Succeeded, 0)
                };
                let frames = [
                    Payload::CommandEvent(event(
                        &d.issue_uuid,
                        1,
                        wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                            lifecycle: wire::Lifecycle::Running as i32,
                            revision: d.revision,
                            exit_result: None,
                            reason: String::new(),
                        }),
                    )),
                    Payload::CommandEvent(event(
                        &d.issue_uuid,
                        2,
                        wire::command_event::Body::Output(wire::OutputChunk {
                            stream: wire::OutputStream::Stdout as i32,
                            payload: z.clone(),
                            raw_length: 3,
                            stored_length: u32::try_from(z.len()).unwrap(),
                        }),
                    )),
                    Payload::CommandEvent(event(
                        &d.issue_uuid,
                        3,
                        wire::command_event::Body::Lifecycle(wire::LifecycleChange {
                            lifecycle: to as i32,
                            revision: d.revision,
                            exit_result: Some(wire::ExitResult {
                                lifecycle: to as i32,
                                exit_code: Some(code),
                                signal_number: None,
                                signal_name: String::new(),
                            }),
                            reason: String::new(),
                        }),
                    )),
                ];
                let spread = d.issue_uuid.bytes().fold(i as u64, |h, b| {
                    h.wrapping_mul(31).wrapping_add(u64::from(b))
                });
                let exec = Duration::from_millis(spread % 400);
                let tx = tx.clone();
                let sid = sid.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(exec).await;
                    for p in frames {
                        let _ = tx.send(env(&sid, generation, p));
                    }
                    TERMINALS.fetch_add(1, Ordering::Relaxed);
                    record(i, true);
                });
            }
            Message::Close(f) => {
                CLOSED.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut l) = LAST_CLOSE.lock() {
                    *l = format!("{f:?}");
                }
                return;
            }
            _ => {}
        }
    }
}

pub(crate) fn p99(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let at = ((v.len() as f64) * 0.99).ceil() as usize;
    v[at.saturating_sub(1).min(v.len() - 1)]
}

/// Times one 4 KiB write + `fdatasync` in `dir` every 50 ms until `done`.
pub(crate) fn fdatasync_probe(
    dir: std::path::PathBuf,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<f64>> {
    std::thread::spawn(move || {
        use std::io::Write as _;
        let path = dir.join("fdatasync-probe");
        let mut f = std::fs::File::create(&path).unwrap();
        let block = [0x5au8; 4096];
        let mut out = Vec::new();
        while !done.load(Ordering::Relaxed) {
            let t = Instant::now();
            f.write_all(&block).unwrap();
            f.sync_data().unwrap();
            out.push(t.elapsed().as_secs_f64() * 1e3);
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_file(&path);
        out
    })
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
