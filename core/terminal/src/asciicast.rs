//! A terminal's recording as an asciicast v2 stream: a JSON header line,
//! then one JSON array per event, `[seconds, code, data]`, with code `o`
//! for output, `i` for input, `r` for a resize (`"COLSxROWS"`) and `m` for
//! a marker (where output was lost: `"cut N bytes"`). The
//! format asciinema plays; the server stores the lines as the terminal's
//! recording, and `rvc terminal replay` reads them back.
//!
//! Event data is text. Output arrives as bytes in arbitrary pieces, so a
//! character split between two pieces is carried to the next event, and
//! bytes that are not UTF-8 become U+FFFD.

use std::fmt::Write as _;

/// The recording's first line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Columns at the start.
    pub width: u16,
    /// Rows at the start.
    pub height: u16,
    /// When the terminal opened (Unix seconds).
    pub timestamp: i64,
    /// A title (the terminal id and host), if any.
    pub title: Option<String>,
}

impl Header {
    /// The header line, newline included.
    #[must_use]
    pub fn line(&self) -> String {
        let mut v = serde_json::json!({
            "version": 2,
            "width": self.width,
            "height": self.height,
            "timestamp": self.timestamp,
        });
        if let (Some(t), Some(map)) = (&self.title, v.as_object_mut()) {
            map.insert("title".into(), serde_json::Value::String(t.clone()));
        }
        let mut s = v.to_string();
        s.push('\n');
        s
    }
}

/// What an event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Output of the terminal.
    Output,
    /// Keys typed.
    Input,
    /// A window size change.
    Resize,
    /// A marker (asciicast v2 `m`): where output was lost, `cut N bytes`.
    Marker,
}

impl Code {
    fn as_str(self) -> &'static str {
        match self {
            Self::Output => "o",
            Self::Input => "i",
            Self::Resize => "r",
            Self::Marker => "m",
        }
    }
}

/// One event read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the terminal opened.
    pub time: f64,
    /// What it records.
    pub code: Code,
    /// Its text.
    pub data: String,
}

/// Bytes to text across pieces: an incomplete character at the end of a
/// piece waits for the next.
#[derive(Debug, Clone, Default)]
struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = after.get(n..).unwrap_or_default();
                        }
                        // an incomplete character at the end: keep it
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    fn flush(&mut self) -> String {
        let out = if self.pending.is_empty() {
            String::new()
        } else {
            String::from_utf8_lossy(&self.pending).into_owned()
        };
        self.pending.clear();
        out
    }
}

/// Writes a terminal's events as asciicast v2 lines.
#[derive(Debug, Clone)]
pub struct Recorder {
    opened_ms: u64,
    output: Utf8Carry,
    input: Utf8Carry,
}

impl Recorder {
    /// A recorder for a terminal opened at monotonic time `opened_ms`.
    #[must_use]
    pub fn new(opened_ms: u64) -> Self {
        Self {
            opened_ms,
            output: Utf8Carry::default(),
            input: Utf8Carry::default(),
        }
    }

    /// The line for output `bytes` at `now_ms`; `None` when the bytes only
    /// began a character.
    pub fn output(&mut self, now_ms: u64, bytes: &[u8]) -> Option<String> {
        let text = self.output.push(bytes);
        self.line(now_ms, Code::Output, &text)
    }

    /// The line for keys typed at `now_ms`.
    pub fn input(&mut self, now_ms: u64, bytes: &[u8]) -> Option<String> {
        let text = self.input.push(bytes);
        self.line(now_ms, Code::Input, &text)
    }

    /// The line for a window size change at `now_ms`.
    #[must_use]
    pub fn resize(&self, now_ms: u64, cols: u16, rows: u16) -> String {
        self.line(now_ms, Code::Resize, &format!("{cols}x{rows}"))
            .unwrap_or_default()
    }

    /// The marker line for output lost at `now_ms`: `bytes` were cut. A
    /// character split before the cut is given up (U+FFFD).
    pub fn cut(&mut self, now_ms: u64, bytes: u64) -> String {
        let rest = self.output.flush();
        let mut s = self.line(now_ms, Code::Output, &rest).unwrap_or_default();
        s.push_str(
            &self
                .line(now_ms, Code::Marker, &format!("cut {bytes} bytes"))
                .unwrap_or_default(),
        );
        s
    }

    /// The line for what is left of a character split at the end (the
    /// terminal closed).
    pub fn finish(&mut self, now_ms: u64) -> Option<String> {
        let text = self.output.flush();
        self.line(now_ms, Code::Output, &text)
    }

    fn line(&self, now_ms: u64, code: Code, text: &str) -> Option<String> {
        if text.is_empty() {
            return None;
        }
        let us = now_ms.saturating_sub(self.opened_ms).saturating_mul(1000);
        let mut s = String::with_capacity(text.len() + 24);
        let _ = write!(
            s,
            "[{}.{:06}, \"{}\", {}]",
            us / 1_000_000,
            us % 1_000_000,
            code.as_str(),
            serde_json::Value::String(text.to_owned())
        );
        s.push('\n');
        Some(s)
    }
}

/// A recording that cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// No header line.
    #[error("the recording is empty: no asciicast header line")]
    Empty,
    /// The header is not an asciicast v2 header.
    #[error("line 1 is not an asciicast v2 header: {0}")]
    Header(String),
    /// An event line is malformed.
    #[error("line {line} is not an asciicast event: {reason}")]
    Event {
        /// Its number, from 1.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

fn header_of(line: &str) -> Result<Header, ParseError> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| ParseError::Header(e.to_string()))?;
    if v.get("version").and_then(serde_json::Value::as_u64) != Some(2) {
        return Err(ParseError::Header("its version is not 2".into()));
    }
    let dim = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| u16::try_from(n).ok())
            .ok_or_else(|| ParseError::Header(format!("{k} is missing or out of range")))
    };
    Ok(Header {
        width: dim("width")?,
        height: dim("height")?,
        timestamp: v
            .get("timestamp")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0),
        title: v
            .get("title")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned),
    })
}

fn event_of(n: usize, line: &str) -> Result<Event, ParseError> {
    let bad = |reason: &str| ParseError::Event {
        line: n,
        reason: reason.to_owned(),
    };
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
    let [t, c, d] = v.as_array().map(Vec::as_slice).unwrap_or_default() else {
        return Err(bad("not an array of three"));
    };
    let time = t
        .as_f64()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| bad("its time is not a number of seconds"))?;
    let code = match c.as_str() {
        Some("o") => Code::Output,
        Some("i") => Code::Input,
        Some("r") => Code::Resize,
        Some("m") => Code::Marker,
        _ => return Err(bad("its code is not o, i, r or m")),
    };
    let data = d.as_str().ok_or_else(|| bad("its data is not text"))?;
    Ok(Event {
        time,
        code,
        data: data.to_owned(),
    })
}

/// Reads a recording back: its header and events, in order.
///
/// # Errors
/// [`ParseError`] naming the first line that is wrong.
pub fn parse(text: &str) -> Result<(Header, Vec<Event>), ParseError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, first) = lines.next().ok_or(ParseError::Empty)?;
    let header = header_of(first)?;
    let events = lines
        .map(|(i, l)| event_of(i + 1, l))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((header, events))
}

/// The pauses of a replay at `speed` (2.0: twice as fast), each at most
/// `max_pause_ms` when given: per event, the milliseconds to wait before
/// it since the previous one.
#[must_use]
pub fn pauses(events: &[Event], speed: f64, max_pause_ms: Option<u64>) -> Vec<u64> {
    let speed = if speed.is_finite() && speed > 0.0 {
        speed
    } else {
        1.0
    };
    let mut last = 0.0_f64;
    events
        .iter()
        .map(|e| {
            let gap = ((e.time - last).max(0.0) * 1000.0 / speed).round();
            last = e.time.max(last);
            // a gap beyond u64 is clamped by the cast itself
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let ms = gap as u64;
            max_pause_ms.map_or(ms, |m| ms.min(m))
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_reads_back_as_written() {
        let h = Header {
            width: 80,
            height: 24,
            timestamp: 1_796_000_000,
            title: Some("t-1 on web-1".into()),
        };
        let mut r = Recorder::new(1_000);
        let mut text = h.line();
        // "é" split across two pieces, and a byte that is never UTF-8
        text += &r.output(1_250, b"caf\xc3").unwrap();
        text += &r.output(1_500, b"\xa9 \xff\n").unwrap();
        text += &r.input(2_000, b"ls\r").unwrap();
        text += &r.resize(3_000, 120, 40);
        let (back, events) = parse(&text).unwrap();
        assert_eq!(back, h);
        let got: Vec<(f64, Code, &str)> = events
            .iter()
            .map(|e| (e.time, e.code, e.data.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                (0.25, Code::Output, "caf"),
                (0.5, Code::Output, "\u{e9} \u{fffd}\n"),
                (1.0, Code::Input, "ls\r"),
                (2.0, Code::Resize, "120x40"),
            ]
        );
        assert_eq!(pauses(&events, 2.0, None), vec![125, 125, 250, 500]);
        assert_eq!(pauses(&events, 1.0, Some(300)), vec![250, 250, 300, 300]);
    }

    #[test]
    fn a_piece_that_only_begins_a_character_waits_for_the_next() {
        let mut r = Recorder::new(0);
        assert_eq!(r.output(1, b"\xe2\x82"), None);
        assert!(r.output(2, b"\xac").unwrap().contains('\u{20ac}'));
        assert_eq!(r.output(3, b"\xe2"), None);
        assert!(r.finish(4).unwrap().contains('\u{fffd}'));
    }

    #[test]
    fn a_cut_is_a_marker_after_what_was_pending() {
        let mut r = Recorder::new(0);
        // half of "é" then a cut: the half is given up, then the marker
        assert_eq!(r.output(1000, &[0xc3]), None);
        let lines = r.cut(2000, 7);
        let h = Header {
            width: 80,
            height: 24,
            timestamp: 0,
            title: None,
        }
        .line();
        let (_, events) = parse(&format!("{h}{lines}")).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "\u{fffd}");
        assert_eq!(events[1].code, Code::Marker);
        assert_eq!(events[1].data, "cut 7 bytes");
        assert!((events[1].time - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_broken_recording_names_its_line() {
        assert_eq!(parse(""), Err(ParseError::Empty));
        assert!(matches!(
            parse("{\"version\":1}"),
            Err(ParseError::Header(_))
        ));
        let h = Header {
            width: 1,
            height: 1,
            timestamp: 0,
            title: None,
        }
        .line();
        assert_eq!(
            parse(&format!("{h}[0.1, \"o\", \"a\"]\n[0.2, \"x\", \"a\"]\n")),
            Err(ParseError::Event {
                line: 3,
                reason: "its code is not o, i, r or m".into()
            })
        );
    }
}
