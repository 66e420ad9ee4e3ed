//! `rvc terminal replay`: a terminal's recording (`ReadPtyRecording`, an
//! asciicast v2 document) played back on stdout with its pauses, or
//! written as it is (`--raw`).
//!
//! The document is read line by line as it arrives, each line checked by
//! `rvbox-terminal`'s parser, so memory stays within one line however
//! long the recording is. Output events are written as they were shown;
//! input and resizes only take their time; a marker (where output was
//! lost) is said on stderr.

use std::io::Write as _;
use std::time::Duration;

use rvbox_proto::v1 as wire;
use rvbox_terminal::asciicast::{self, Code, Event, ParseError};

use crate::conn::Control;
use crate::exit::Failure;
use crate::out::{Format, emit};

/// The longest line of a recording rvc reads (one output event of 64 KiB
/// is at most six times that once escaped as JSON).
const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

/// How a recording is played.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pace {
    /// 2.0: twice as fast; 0: no pauses at all.
    pub(crate) speed: f64,
    /// The longest pause, when given.
    pub(crate) max_pause_ms: Option<u64>,
}

/// What to do for a piece of the recording.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Wait this long.
    Pause(Duration),
    /// Write this output.
    Output(String),
    /// Say this on stderr.
    Notice(String),
}

/// Reads a recording's lines as they arrive.
#[derive(Debug)]
pub(crate) struct Reader {
    pace: Pace,
    pending: Vec<u8>,
    /// Lines read so far.
    line: usize,
    /// The header line, once read.
    header: Option<String>,
    /// The previous event (pauses are between events).
    previous: Option<Event>,
}

impl Reader {
    pub(crate) fn new(pace: Pace) -> Self {
        Self {
            pace,
            pending: Vec::new(),
            line: 0,
            header: None,
            previous: None,
        }
    }

    /// Takes the next piece; returns the steps of its whole lines.
    pub(crate) fn push(&mut self, piece: &[u8]) -> Result<Vec<Step>, Failure> {
        self.pending.extend_from_slice(piece);
        let mut steps = Vec::new();
        while let Some(at) = self.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=at).collect();
            self.line += 1;
            self.take_line(&line, &mut steps)?;
        }
        if self.pending.len() > MAX_LINE_BYTES {
            return Err(Failure::internal(format!(
                "line {} of the recording is longer than {MAX_LINE_BYTES} bytes",
                self.line + 1
            )));
        }
        Ok(steps)
    }

    /// The end of the document: a last line without its newline, and the
    /// check that there was a header.
    pub(crate) fn finish(&mut self) -> Result<Vec<Step>, Failure> {
        let mut steps = Vec::new();
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.line += 1;
            self.take_line(&line, &mut steps)?;
        }
        if self.header.is_none() {
            return Err(Failure::internal(ParseError::Empty.to_string()));
        }
        Ok(steps)
    }

    fn take_line(&mut self, line: &[u8], steps: &mut Vec<Step>) -> Result<(), Failure> {
        let n = self.line;
        let text = std::str::from_utf8(line).map_err(|e| {
            Failure::internal(format!("line {n} of the recording is not UTF-8: {e}"))
        })?;
        if text.trim().is_empty() {
            return Ok(());
        }
        let Some(header) = &self.header else {
            asciicast::parse(text).map_err(|e| Failure::internal(format!("the recording: {e}")))?;
            self.header = Some(text.trim_end().to_owned());
            return Ok(());
        };
        // the crate's parser reads a document: this line after the header
        let event = match asciicast::parse(&format!("{header}\n{text}")) {
            Ok((_, events)) => events.into_iter().next(),
            Err(ParseError::Event { reason, .. }) => {
                return Err(Failure::internal(format!(
                    "line {n} of the recording is not an asciicast event: {reason}"
                )));
            }
            Err(e) => return Err(Failure::internal(format!("the recording: {e}"))),
        };
        let Some(event) = event else { return Ok(()) };
        if self.pace.speed > 0.0 {
            let pause = match &self.previous {
                Some(p) => asciicast::pauses(
                    &[p.clone(), event.clone()],
                    self.pace.speed,
                    self.pace.max_pause_ms,
                )
                .last()
                .copied(),
                None => asciicast::pauses(
                    std::slice::from_ref(&event),
                    self.pace.speed,
                    self.pace.max_pause_ms,
                )
                .first()
                .copied(),
            }
            .unwrap_or(0);
            if pause > 0 {
                steps.push(Step::Pause(Duration::from_millis(pause)));
            }
        }
        match event.code {
            Code::Output => steps.push(Step::Output(event.data.clone())),
            Code::Marker => steps.push(Step::Notice(marker_text(&event.data))),
            // typed keys show in the output's echo; a size only takes
            // its time
            Code::Input | Code::Resize => {}
        }
        self.previous = Some(event);
        Ok(())
    }
}

/// A marker as rvc says it: `cut N bytes` as the attach says a cut.
fn marker_text(data: &str) -> String {
    match data
        .strip_prefix("cut ")
        .and_then(|r| r.strip_suffix(" bytes"))
        .and_then(|n| n.parse::<u64>().ok())
    {
        Some(n) => format!("[rvc: {n} bytes of output were cut]"),
        None => format!("[rvc: {data}]"),
    }
}

/// `rvc terminal replay`.
pub(crate) async fn replay(
    control: &mut Control,
    terminal: &str,
    pace: Pace,
    raw: bool,
    fmt: Format,
) -> Result<u8, Failure> {
    let req = wire::ReadPtyRecordingRequest {
        request_id: String::new(),
        pty_session_id: terminal.to_owned(),
    };
    let mut stream = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.read_pty_recording(req).await }
        })
        .await?;
    let mut reader = Reader::new(pace);
    loop {
        let piece = match stream.message().await {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(s) => return Err(Failure::from_status(&s)),
        };
        if fmt == Format::Json {
            emit(fmt, "ReadPtyRecordingResponse", &piece, String::new)?;
            continue;
        }
        if raw {
            if !write_out(&piece.asciicast)? {
                return Ok(0);
            }
            continue;
        }
        let steps = reader.push(&piece.asciicast)?;
        if !play(steps).await? {
            return Ok(0);
        }
    }
    if fmt == Format::Text && !raw {
        let steps = reader.finish()?;
        if !play(steps).await? {
            return Ok(0);
        }
    }
    Ok(0)
}

/// Plays steps; `false` when stdout was closed.
async fn play(steps: Vec<Step>) -> Result<bool, Failure> {
    for step in steps {
        match step {
            Step::Pause(d) => tokio::time::sleep(d).await,
            Step::Output(text) => {
                if !write_out(text.as_bytes())? {
                    return Ok(false);
                }
            }
            Step::Notice(text) => eprintln!("{text}"),
        }
    }
    Ok(true)
}

/// Writes to stdout; `false` when it was closed (`| head`).
fn write_out(bytes: &[u8]) -> Result<bool, Failure> {
    let mut o = std::io::stdout().lock();
    match o.write_all(bytes).and_then(|()| o.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(Failure::internal(format!("writing to stdout: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const DOC: &str = "{\"version\":2,\"width\":80,\"height\":24,\"timestamp\":0}\n\
                       [0.5, \"o\", \"$ \"]\n\
                       [1.0, \"i\", \"ls\\r\"]\n\
                       [1.25, \"o\", \"ls\\r\\na\\r\\n\"]\n\
                       [1.25, \"m\", \"cut 7 bytes\"]\n\
                       [3.25, \"r\", \"100x30\"]\n\
                       [4.0, \"o\", \"$ \"]\n";

    fn steps_of(pieces: &[&[u8]], pace: Pace) -> Vec<Step> {
        let mut r = Reader::new(pace);
        let mut out = Vec::new();
        for p in pieces {
            out.extend(r.push(p).unwrap());
        }
        out.extend(r.finish().unwrap());
        out
    }

    fn ms(n: u64) -> Step {
        Step::Pause(Duration::from_millis(n))
    }

    #[test]
    fn a_recording_plays_its_output_with_pauses_divided_by_the_speed() {
        let pace = Pace {
            speed: 2.0,
            max_pause_ms: None,
        };
        let whole = steps_of(&[DOC.as_bytes()], pace);
        assert_eq!(
            whole,
            vec![
                ms(250),
                Step::Output("$ ".into()),
                ms(250),
                ms(125),
                Step::Output("ls\r\na\r\n".into()),
                Step::Notice("[rvc: 7 bytes of output were cut]".into()),
                ms(1000),
                ms(375),
                Step::Output("$ ".into()),
            ]
        );
        // lines split across pieces anywhere read the same
        let bytes = DOC.as_bytes();
        let pieces: Vec<&[u8]> = bytes.chunks(7).collect();
        assert_eq!(steps_of(&pieces, pace), whole);
    }

    #[test]
    fn speed_zero_plays_without_pauses_and_a_max_pause_caps_them() {
        let none = steps_of(
            &[DOC.as_bytes()],
            Pace {
                speed: 0.0,
                max_pause_ms: None,
            },
        );
        assert!(none.iter().all(|s| !matches!(s, Step::Pause(_))));
        assert_eq!(none.len(), 4);
        let capped = steps_of(
            &[DOC.as_bytes()],
            Pace {
                speed: 1.0,
                max_pause_ms: Some(300),
            },
        );
        assert!(capped.contains(&ms(300)));
        assert!(
            !capped
                .iter()
                .any(|s| matches!(s, Step::Pause(d) if *d > Duration::from_millis(300)))
        );
    }

    #[test]
    fn a_broken_recording_names_its_line() {
        let mut r = Reader::new(Pace {
            speed: 1.0,
            max_pause_ms: None,
        });
        let bad = format!("{}[0.1, \"x\", \"a\"]\n", DOC);
        let e = r.push(bad.as_bytes()).unwrap_err();
        assert!(e.message().contains("line 8"), "{}", e.message());
        let mut r = Reader::new(Pace {
            speed: 1.0,
            max_pause_ms: None,
        });
        assert!(r.finish().unwrap_err().message().contains("empty"));
        let mut r = Reader::new(Pace {
            speed: 1.0,
            max_pause_ms: None,
        });
        assert!(
            r.push(b"{\"version\":1}\n")
                .unwrap_err()
                .message()
                .contains("header")
        );
    }
}
