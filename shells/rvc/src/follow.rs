//! Following a command (`rvc run` in the foreground, `rvc follow`): the
//! stored history from a cursor, then live events, to the end.
//!
//! Output bytes go to rvc's stdout and stderr exactly as the command
//! wrote them, chunk by chunk, never re-split into lines. Gaps are said on
//! stderr as `rvc: [...]` notices. When the server goes away the stream
//! resumes after the last event received, so no byte is shown twice or
//! skipped (events at or below the cursor are dropped by sequence). Ctrl-C
//! stops only rvc: the command keeps running.

use std::io::Write as _;

use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::follow_command_response::Item;

use std::time::Instant;

use crate::conn::{Control, FIRST_PAUSE, MAX_PAUSE, retryable};
use crate::exit::{self, Failure};
use crate::out::Format;
use crate::render;

/// The largest raw output chunk (`OutputChunk.raw_length`, 64 KiB).
const MAX_CHUNK: usize = 64 * 1024;

fn stream_name(s: i32) -> &'static str {
    match wire::OutputStream::try_from(s) {
        Ok(wire::OutputStream::Stdout) => "stdout",
        Ok(wire::OutputStream::Stderr) => "stderr",
        _ => "output",
    }
}

fn streams(list: &[i32]) -> String {
    let names: Vec<&str> = list.iter().map(|s| stream_name(*s)).collect();
    if names.is_empty() {
        "output".into()
    } else {
        names.join("+")
    }
}

fn source_name(s: i32) -> &'static str {
    wire::TruncationSource::try_from(s).map_or("UNKNOWN", |t| {
        t.as_str_name()
            .strip_prefix("TRUNCATION_SOURCE_")
            .unwrap_or("UNKNOWN")
    })
}

/// Writes one output chunk where it belongs.
fn write_chunk(c: &wire::OutputChunk) -> Result<(), Failure> {
    // the server checked these when it stored the chunk; rvc does not
    // size an allocation by a field it has not checked itself
    if c.raw_length as usize > MAX_CHUNK || c.stored_length as usize != c.payload.len() {
        return Err(Failure::internal(format!(
            "an output chunk declares {} raw bytes and {} stored bytes for a payload of {}",
            c.raw_length,
            c.stored_length,
            c.payload.len()
        )));
    }
    let raw = zstd::bulk::decompress(&c.payload, c.raw_length as usize)
        .map_err(|e| Failure::internal(format!("an output chunk did not decompress: {e}")))?;
    if raw.len() != c.raw_length as usize {
        return Err(Failure::internal(
            "an output chunk's length differs from its declared length",
        ));
    }
    let written = if c.stream == wire::OutputStream::Stderr as i32 {
        let mut e = std::io::stderr().lock();
        e.write_all(&raw).and_then(|()| e.flush())
    } else {
        let mut o = std::io::stdout().lock();
        o.write_all(&raw).and_then(|()| o.flush())
    };
    // a closed pipe (rvc ... | head) ends rvc quietly, like cat
    if let Err(e) = written {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        return Err(Failure::internal(format!("writing output: {e}")));
    }
    Ok(())
}

/// The notice of a range the server removed.
pub(crate) fn retention_notice(r: &wire::RetentionTruncation) -> String {
    let bytes = r
        .raw_bytes
        .map_or_else(String::new, |b| format!("{b} bytes, "));
    format!(
        "rvc: [events {}-{} of {} removed by the server ({}{}): {}]",
        r.first_event_seq,
        r.last_event_seq,
        streams(&r.streams),
        bytes,
        source_name(r.source),
        r.reason
    )
}

/// The notice of a marker event (bytes lost on the client, incomplete
/// output), if it is one.
pub(crate) fn marker_notice(body: Option<&Body>) -> Option<String> {
    match body {
        Some(Body::Truncation(t)) => Some(format!(
            "rvc: [{} bytes of {} lost on the client ({}): {}]",
            t.raw_bytes,
            streams(&t.streams),
            source_name(t.source),
            t.reason
        )),
        Some(Body::Incomplete(i)) => Some(format!(
            "rvc: [{} is incomplete: {}]",
            streams(&i.streams),
            i.reason
        )),
        _ => None,
    }
}

/// What the follow knows of the end.
#[derive(Debug, Default)]
struct End {
    result: Option<wire::ExitResult>,
}

/// Handles one streamed item; in JSON mode it is printed as its
/// `FollowCommandResponse` document instead of being rendered.
fn handle(
    resp: wire::FollowCommandResponse,
    cursor: &mut u64,
    end: &mut End,
    fmt: Format,
) -> Result<(), Failure> {
    let Some(item) = resp.item.clone() else {
        return Ok(());
    };
    let fresh = match &item {
        Item::Event(ev) => ev.event.as_ref().is_some_and(|e| e.event_seq > *cursor),
        _ => true,
    };
    let json = fmt == Format::Json;
    if json && fresh {
        let mut line = crate::out::json("FollowCommandResponse", &resp)?;
        line.push('\n');
        crate::out::write_stdout(&line)?;
    }
    match item {
        Item::Event(ev) => {
            let Some(ev) = ev.event else { return Ok(()) };
            if ev.event_seq <= *cursor {
                // already shown before a reconnect
                return Ok(());
            }
            *cursor = ev.event_seq;
            if json {
                if let Some(Body::Lifecycle(l)) = ev.body
                    && l.exit_result.is_some()
                {
                    end.result = l.exit_result;
                }
                return Ok(());
            }
            match ev.body {
                Some(Body::Output(c)) => write_chunk(&c)?,
                Some(Body::Lifecycle(l)) if l.exit_result.is_some() => {
                    end.result = l.exit_result;
                    if !l.reason.is_empty() {
                        eprintln!(
                            "rvc: [{}: {}]",
                            render::lifecycle_name(l.lifecycle),
                            l.reason
                        );
                    }
                }
                Some(b @ (Body::Truncation(_) | Body::Incomplete(_))) => {
                    if let Some(n) = marker_notice(Some(&b)) {
                        eprintln!("{n}");
                    }
                }
                Some(Body::SignalResult(s)) => eprintln!(
                    "rvc: [signal {} (revision {}): {}{}]",
                    render::signal_name(
                        wire::SignalKind::try_from(s.signal)
                            .unwrap_or(wire::SignalKind::Unspecified)
                    ),
                    s.revision,
                    wire::SignalOutcome::try_from(s.outcome).map_or("UNKNOWN", |o| o
                        .as_str_name()
                        .strip_prefix("SIGNAL_OUTCOME_")
                        .unwrap_or("UNKNOWN")),
                    if s.reason.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", s.reason)
                    }
                ),
                _ => {}
            }
        }
        Item::Retention(_) | Item::Reset(_) if json => {
            if let Item::Reset(r) = item {
                *cursor = r.resumed_after_event_seq;
            }
        }
        Item::Retention(r) => eprintln!("{}", retention_notice(&r)),
        Item::Reset(r) => {
            eprintln!(
                "rvc: [the server has no events after {}; continuing after {}: {}]",
                r.requested_after_event_seq, r.resumed_after_event_seq, r.reason
            );
            // the stream continues after the named position; a reconnect
            // resumes there too
            *cursor = r.resumed_after_event_seq;
        }
        Item::Status(s) => {
            if s.exit_result.is_some() && end.result.is_none() {
                end.result = s.exit_result;
            }
        }
    }
    Ok(())
}

/// Follows `issue` after `after` to its end; returns rvc's exit status.
pub(crate) async fn follow(
    control: &mut Control,
    issue: &str,
    after: u64,
    client: Option<&str>,
    fmt: Format,
) -> Result<u8, Failure> {
    let mut cursor = after;
    let mut end = End::default();
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    // a stream that keeps ending without progress is retried with a
    // growing pause, and given up after the retry window without progress
    let mut progress_at = Instant::now();
    let mut pause = FIRST_PAUSE;
    let mut first = true;
    loop {
        if !first {
            if progress_at.elapsed() >= crate::conn::retry_for() {
                return Err(Failure::unreachable(format!(
                    "no progress following {issue} for {} s; follow it again with: rvc follow {issue}",
                    crate::conn::retry_for().as_secs()
                )));
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = &mut interrupted => return Ok(stopped(issue, client)),
            }
            pause = (pause * 2).min(MAX_PAUSE);
        }
        first = false;
        let req = wire::FollowCommandRequest {
            request_id: String::new(),
            issue_uuid: issue.to_owned(),
            after_event_seq: cursor,
        };
        let mut stream = tokio::select! {
            s = control.retrying(|mut c| {
                let req = req.clone();
                async move { c.follow_command(req).await }
            }) => s?,
            _ = &mut interrupted => return Ok(stopped(issue, client)),
        };
        loop {
            let next = tokio::select! {
                m = stream.message() => m,
                _ = &mut interrupted => return Ok(stopped(issue, client)),
            };
            match next {
                Ok(Some(resp)) => {
                    let before = cursor;
                    handle(resp, &mut cursor, &mut end, fmt)?;
                    if cursor > before {
                        progress_at = Instant::now();
                        pause = FIRST_PAUSE;
                    }
                }
                Ok(None) => {
                    if let Some(r) = &end.result {
                        return Ok(exit::of_result(r));
                    }
                    // the stream ended before the command did: resume
                    control.reconnecting();
                    control.reset();
                    break;
                }
                Err(s) if retryable(&s) => {
                    control.reconnecting();
                    control.reset();
                    break;
                }
                Err(s) => return Err(Failure::from_status(&s)),
            }
        }
    }
}

fn stopped(issue: &str, client: Option<&str>) -> u8 {
    let client = client.unwrap_or("CLIENT");
    eprintln!(
        "rvc: stopped following; {issue} keeps running.\n  follow it again: rvc follow {issue}\n  stop it:         rvc kill {client} {issue}"
    );
    exit::INTERRUPTED_BY_USER
}
