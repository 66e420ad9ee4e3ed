//! `rvc append` and `rvc close-stdin`: data for a command's stdin.
//!
//! Every append is durable on the server before rvc says so, and each has
//! its own `request_id` (reused by every retry of that append), so a
//! retried append is never written twice. rvc then waits (unless
//! `--no-wait`) for the client's acknowledgement, read from the command's
//! own event history: written, or discarded because stdin had closed or
//! the process had gone.
//!
//! A TEXT argument gets a newline unless `--raw`; `--file` and `--attach`
//! write the bytes exactly as they are. An input of more than 1 MiB goes
//! as several appends, in order. While the client has the pending maximum
//! unacknowledged, rvc waits and sends the next append when it catches up.

use std::time::{Duration, Instant};

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::follow_command_response::Item;

use crate::conn::{Control, FIRST_PAUSE, MAX_PAUSE};
use crate::exit::Failure;
use crate::out::Format;

/// Bytes of one `AppendStdin` (the server's per-request ceiling).
const APPEND_BYTES: usize = 1024 * 1024;
/// Bytes `--attach` reads at once: what a terminal line or a pipe gives
/// in one read goes as one append.
const ATTACH_READ_BYTES: usize = 64 * 1024;

/// Where the data comes from.
#[derive(Debug)]
pub(crate) enum Source {
    /// The TEXT argument; `newline`: a newline follows it.
    Text { text: String, newline: bool },
    /// A file's bytes, as they are.
    File(std::path::PathBuf),
    /// rvc's own stdin until end of file, as it is.
    Attach,
}

/// What the client did with the writes.
enum Settled {
    Written,
    Discarded(String),
    Ended(String),
    Waiting,
}

/// `rvc append`.
pub(crate) async fn append(
    control: &mut Control,
    given_id: Option<String>,
    client: &str,
    issue: &str,
    source: Source,
    wait: Option<Duration>,
    fmt: Format,
) -> Result<u8, Failure> {
    let record = crate::command_of(control, issue, Some(client)).await?;
    let from = record.last_event_seq;
    let mut total = 0u64;
    let mut last = None;
    match source {
        Source::Text { text, newline } => {
            let data = text.into_bytes();
            if data.len() > APPEND_BYTES {
                return Err(Failure::usage(format!(
                    "TEXT is {} bytes; one append takes at most {APPEND_BYTES}: use --file",
                    data.len()
                )));
            }
            let id = crate::request_id(given_id)?;
            total = data.len() as u64;
            last = Some(send(control, id, issue, data, newline).await?);
        }
        Source::File(path) => {
            let mut file = std::fs::File::open(&path)
                .map_err(|e| Failure::usage(format!("--file {}: {e}", path.display())))?;
            let mut given = given_id;
            let mut first = true;
            loop {
                let data = read_up_to(&mut file, APPEND_BYTES)
                    .map_err(|e| Failure::usage(format!("--file {}: {e}", path.display())))?;
                if data.is_empty() {
                    break;
                }
                if !first && given.is_some() {
                    return Err(Failure::usage(
                        "--request-id names one append, and this file needs more than one (over 1 MiB)",
                    ));
                }
                first = false;
                let id = crate::request_id(given.take())?;
                total += data.len() as u64;
                last = Some(send(control, id, issue, data, false).await?);
            }
        }
        Source::Attach => {
            if given_id.is_some() {
                return Err(Failure::usage(
                    "--request-id names one append; --attach sends one per read",
                ));
            }
            // a thread reads (a terminal read blocks), the runtime sends
            let (tx, mut rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(4);
            std::thread::spawn(move || {
                let mut input = std::io::stdin().lock();
                let mut buf = vec![0u8; ATTACH_READ_BYTES];
                loop {
                    let read = match std::io::Read::read(&mut input, &mut buf) {
                        Ok(0) => break,
                        Ok(n) => Ok(buf.get(..n).unwrap_or_default().to_vec()),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => Err(e),
                    };
                    let failed = read.is_err();
                    if tx.blocking_send(read).is_err() || failed {
                        break;
                    }
                }
            });
            while let Some(read) = rx.recv().await {
                let data = read.map_err(|e| Failure::internal(format!("reading stdin: {e}")))?;
                let id = crate::request_id(None)?;
                total += data.len() as u64;
                last = Some(send(control, id, issue, data, false).await?);
            }
        }
    }
    let Some(mut resp) = last else {
        eprintln!("rvc: nothing to append (the input was empty)");
        return Ok(0);
    };
    if fmt == Format::Text {
        eprintln!(
            "rvc: {total} bytes recorded for {issue}'s stdin (writes up to {})",
            resp.last_write_seq
        );
    }
    let settled = settle(
        control,
        issue,
        from,
        resp.last_write_seq,
        resp.delivery,
        wait,
    )
    .await?;
    resp.delivery = settled.delivery(resp.delivery);
    if fmt == Format::Json {
        crate::out::emit(fmt, "AppendStdinResponse", &resp, String::new)?;
    }
    report(settled, wait, fmt)
}

/// `rvc close-stdin`.
pub(crate) async fn close(
    control: &mut Control,
    given_id: Option<String>,
    client: &str,
    issue: &str,
    wait: Option<Duration>,
    fmt: Format,
) -> Result<u8, Failure> {
    let record = crate::command_of(control, issue, Some(client)).await?;
    let req = wire::CloseStdinRequest {
        request_id: crate::request_id(given_id)?,
        issue_uuid: issue.to_owned(),
    };
    let mut resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.close_stdin(req).await }
        })
        .await
        .map_err(|f| f.with_request_id(&req.request_id))?;
    if fmt == Format::Text {
        eprintln!(
            "rvc: close of {issue}'s stdin recorded (write {})",
            resp.write_seq
        );
    }
    let settled = settle(
        control,
        issue,
        record.last_event_seq,
        resp.write_seq,
        resp.delivery,
        wait,
    )
    .await?;
    resp.delivery = settled.delivery(resp.delivery);
    if fmt == Format::Json {
        crate::out::emit(fmt, "CloseStdinResponse", &resp, String::new)?;
    }
    report(settled, wait, fmt)
}

fn read_up_to(file: &mut std::fs::File, max: usize) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(max.min(64 * 1024));
    std::io::Read::read_to_end(&mut std::io::Read::take(file, max as u64), &mut out)?;
    Ok(out)
}

/// One append, retried with its own request id; a full pending window
/// (`CAPACITY_EXHAUSTED`, nothing stored) is waited out.
async fn send(
    control: &mut Control,
    request_id: String,
    issue: &str,
    data: Vec<u8>,
    newline: bool,
) -> Result<wire::AppendStdinResponse, Failure> {
    let req = wire::AppendStdinRequest {
        request_id,
        issue_uuid: issue.to_owned(),
        data,
        newline: if newline {
            wire::StdinNewline::Append as i32
        } else {
            wire::StdinNewline::Raw as i32
        },
    };
    let give_up = Instant::now() + crate::conn::retry_for();
    let mut pause = FIRST_PAUSE;
    loop {
        match control
            .retrying(|mut c| {
                let req = req.clone();
                async move { c.append_stdin(req).await }
            })
            .await
        {
            Ok(r) => return Ok(r),
            Err(f)
                if f.status() == Code::CapacityExhausted.exit_status()
                    && Instant::now() < give_up =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            Err(f) => return Err(f.with_request_id(&req.request_id)),
        }
    }
}

impl Settled {
    /// The delivery a response reports once this is known.
    fn delivery(&self, stored: i32) -> i32 {
        match self {
            Self::Written => wire::StdinDelivery::Written as i32,
            Self::Discarded(_) | Self::Ended(_) => wire::StdinDelivery::Discarded as i32,
            Self::Waiting => stored,
        }
    }
}

/// Waits up to `wait` for the client's acknowledgement of `write_seq`,
/// reading the command's events after `from`.
async fn settle(
    control: &mut Control,
    issue: &str,
    from: u64,
    write_seq: u64,
    delivery: i32,
    wait: Option<Duration>,
) -> Result<Settled, Failure> {
    let known = match wire::StdinDelivery::try_from(delivery) {
        Ok(wire::StdinDelivery::Written) => Settled::Written,
        Ok(wire::StdinDelivery::Discarded) => Settled::Discarded(String::new()),
        _ => Settled::Waiting,
    };
    let settled = match (known, wait) {
        (Settled::Waiting, Some(wait)) => {
            match tokio::time::timeout(wait, watch(control, issue, from, write_seq)).await {
                Ok(r) => r?,
                Err(_) => Settled::Waiting,
            }
        }
        (known, _) => known,
    };
    Ok(settled)
}

/// Says what the client did and returns rvc's status.
fn report(settled: Settled, wait: Option<Duration>, fmt: Format) -> Result<u8, Failure> {
    match settled {
        Settled::Written => {
            if fmt == Format::Text {
                eprintln!("rvc: written to the process's stdin");
            }
            Ok(0)
        }
        Settled::Discarded(reason) => Err(Failure::refused(
            Code::FailedPrecondition,
            format!(
                "the client discarded the write: {}",
                if reason.is_empty() {
                    "its stdin was closed or the process had exited"
                } else {
                    reason.as_str()
                }
            ),
        )),
        Settled::Ended(lifecycle) => Err(Failure::refused(
            Code::FailedPrecondition,
            format!("the command ended ({lifecycle}) before its client wrote the data"),
        )),
        Settled::Waiting => {
            if wait.is_some() && fmt == Format::Text {
                eprintln!(
                    "rvc: not acknowledged by the client yet; it is written once the client has it (durable on the server)"
                );
            }
            Ok(0)
        }
    }
}

/// Follows the command's events after `from` until the acknowledgement of
/// `write_seq` (acknowledgements come in order) or the command's end.
async fn watch(
    control: &mut Control,
    issue: &str,
    from: u64,
    write_seq: u64,
) -> Result<Settled, Failure> {
    let mut cursor = from;
    loop {
        let req = wire::FollowCommandRequest {
            request_id: String::new(),
            issue_uuid: issue.to_owned(),
            after_event_seq: cursor,
        };
        let mut stream = control
            .retrying(|mut c| {
                let req = req.clone();
                async move { c.follow_command(req).await }
            })
            .await?;
        loop {
            match stream.message().await {
                Ok(Some(resp)) => match resp.item {
                    Some(Item::Event(ev)) => {
                        let Some(ev) = ev.event else { continue };
                        cursor = cursor.max(ev.event_seq);
                        match ev.body {
                            Some(Body::StdinAck(a)) if a.write_seq >= write_seq => {
                                return Ok(if a.delivery == wire::StdinDelivery::Written as i32 {
                                    Settled::Written
                                } else {
                                    Settled::Discarded(a.reason)
                                });
                            }
                            Some(Body::Lifecycle(l)) if l.exit_result.is_some() => {
                                return Ok(Settled::Ended(crate::render::lifecycle_name(
                                    l.lifecycle,
                                )));
                            }
                            _ => {}
                        }
                    }
                    Some(Item::Reset(r)) => cursor = r.resumed_after_event_seq,
                    Some(Item::Status(s)) if s.exit_result.is_some() => {
                        return Ok(Settled::Ended(crate::render::lifecycle_name(s.lifecycle)));
                    }
                    _ => {}
                },
                Ok(None) | Err(_) => {
                    control.reset();
                    tokio::time::sleep(FIRST_PAUSE).await;
                    break;
                }
            }
        }
    }
}
