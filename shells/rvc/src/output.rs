//! `rvc output CLIENT UUID`: a command's stored output read by pages
//! (`GetOutput`), with stream selection, `--timestamped` lines, paging by
//! token, and `--follow` to read on until the command ends.
//!
//! The bytes are written as they were stored. `--timestamped` puts the
//! time the client observed an event before each line that starts in it;
//! a line that continues across events is kept whole (the display buffers
//! nothing but the knowledge of being mid-line, and invents no line
//! boundary). Gaps are said on stderr as `rvc: [...]` notices, as
//! `follow` says them.

use std::time::Duration;

use rvbox_proto::v1 as wire;
use rvbox_proto::v1::output_item::Item;

use crate::conn::{Control, FIRST_PAUSE, MAX_PAUSE};
use crate::exit::Failure;
use crate::out::Format;

/// Which streams to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Streams {
    /// stdout and stderr, interleaved in event order.
    #[default]
    Both,
    /// stdout only.
    Stdout,
    /// stderr only.
    Stderr,
}

impl Streams {
    fn wire(self) -> Vec<i32> {
        match self {
            Self::Both => vec![
                wire::OutputStream::Stdout as i32,
                wire::OutputStream::Stderr as i32,
            ],
            Self::Stdout => vec![wire::OutputStream::Stdout as i32],
            Self::Stderr => vec![wire::OutputStream::Stderr as i32],
        }
    }
}

/// What `rvc output` was asked.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) client: String,
    pub(crate) issue: String,
    pub(crate) streams: Streams,
    pub(crate) timestamped: bool,
    pub(crate) max_bytes: Option<u32>,
    pub(crate) page: Option<String>,
    pub(crate) follow: bool,
}

/// Puts a time before each line.
#[derive(Debug, Default)]
struct Stamper {
    mid_line: bool,
}

impl Stamper {
    fn stamp(&mut self, data: &[u8], time: &str, out: &mut Vec<u8>) {
        for piece in data.split_inclusive(|b| *b == b'\n') {
            if !self.mid_line {
                out.extend_from_slice(time.as_bytes());
                out.push(b' ');
            }
            out.extend_from_slice(piece);
            self.mid_line = piece.last() != Some(&b'\n');
        }
    }
}

fn time_of(t: Option<&prost_types::Timestamp>) -> String {
    t.map_or_else(|| "-".to_owned(), ToString::to_string)
}

/// Writes one page; returns whether it held any item.
fn show(
    page: &wire::GetOutputResponse,
    timestamped: bool,
    stamper: &mut Stamper,
    fmt: Format,
) -> Result<bool, Failure> {
    if fmt == Format::Json {
        let mut line = crate::out::json("GetOutputResponse", page)?;
        line.push('\n');
        crate::out::write_stdout(&line)?;
        return Ok(!page.items.is_empty());
    }
    let mut buf = Vec::new();
    for item in &page.items {
        match &item.item {
            Some(Item::Data(d)) => {
                if timestamped {
                    stamper.stamp(&d.data, &time_of(d.observed_time.as_ref()), &mut buf);
                } else {
                    buf.extend_from_slice(&d.data);
                }
            }
            Some(Item::Marker(m)) => {
                let body = m.event.as_ref().and_then(|e| e.body.as_ref());
                if let Some(n) = crate::follow::marker_notice(body) {
                    flush(&mut buf)?;
                    eprintln!("{n}");
                }
            }
            Some(Item::Retention(r)) => {
                flush(&mut buf)?;
                eprintln!("{}", crate::follow::retention_notice(r));
            }
            None => {}
        }
    }
    flush(&mut buf)?;
    Ok(!page.items.is_empty())
}

fn flush(buf: &mut Vec<u8>) -> Result<(), Failure> {
    if !buf.is_empty() {
        let text = std::mem::take(buf);
        let mut o = std::io::stdout().lock();
        match std::io::Write::write_all(&mut o, &text).and_then(|()| std::io::Write::flush(&mut o))
        {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
            Err(e) => return Err(Failure::internal(format!("writing output: {e}"))),
        }
    }
    Ok(())
}

/// `rvc output`.
pub(crate) async fn output(control: &mut Control, r: Request, fmt: Format) -> Result<u8, Failure> {
    // the command must be the client's
    crate::command_of(control, &r.issue, Some(&r.client)).await?;
    let mut token = r.page.clone().unwrap_or_default();
    let mut stamper = Stamper::default();
    let mut pause = FIRST_PAUSE;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let req = wire::GetOutputRequest {
            request_id: String::new(),
            issue_uuid: r.issue.clone(),
            streams: r.streams.wire(),
            max_bytes: r.max_bytes.unwrap_or(0),
            page_token: token.clone(),
        };
        let page = tokio::select! {
            p = control.retrying(|mut c| {
                let req = req.clone();
                async move { c.get_output(req).await }
            }) => p?,
            _ = &mut interrupted => return Ok(crate::exit::INTERRUPTED_BY_USER),
        };
        let any = show(&page, r.timestamped, &mut stamper, fmt)?;
        if page.next_page_token.is_empty() {
            // the command ended and its last event was read
            if stamper.mid_line && fmt == Format::Text {
                flush(&mut b"\n".to_vec())?;
            }
            return Ok(0);
        }
        if !r.follow {
            if fmt == Format::Text {
                if stamper.mid_line {
                    flush(&mut b"\n".to_vec())?;
                }
                eprintln!(
                    "more: rvc output {} {} --page {}",
                    r.client, r.issue, page.next_page_token
                );
            }
            return Ok(0);
        }
        token = page.next_page_token;
        if any {
            pause = FIRST_PAUSE;
        } else {
            // at the end of a running command's log: look again shortly
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = &mut interrupted => return Ok(crate::exit::INTERRUPTED_BY_USER),
            }
            pause = (pause * 2).min(MAX_PAUSE.min(Duration::from_secs(1)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_goes_before_each_line_and_a_split_line_stays_whole() {
        let mut s = Stamper::default();
        let mut out = Vec::new();
        s.stamp(b"one\ntw", "T1", &mut out);
        s.stamp(b"o\nthree\n", "T2", &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "T1 one\nT1 two\nT2 three\n"
        );
        assert!(!s.mid_line);
    }
}
