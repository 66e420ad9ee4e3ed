//! Interactive terminals (PTY sessions, docs/terminals.md): the operator
//! mutations, what a client reports of its terminals, and what the server
//! sends again after a reconnect.
//!
//! A terminal is a row on the server and a holder process on its client.
//! Every operator mutation (open, input, resize, close) is durable, and
//! idempotent by `request_id`, before any frame leaves. Input is numbered
//! (`input_seq`, contiguous from 1) in the mutation's transaction and
//! stays pending until the client acknowledges it. Output is recorded by
//! byte offset before the client's send window moves (`PtyOutputAck`
//! follows the commit), so the recording is exact, or carries a cut
//! marker where the client's ring had lost bytes.

use rvbox_domain::error::DomainError;
use rvbox_proto::v1 as wire;

/// Input bytes one terminal may have waiting (durable and not yet
/// acknowledged by its client): a write past it is refused with
/// `CAPACITY_EXHAUSTED` until the client catches up.
pub const MAX_PENDING_PTY_INPUT_BYTES: u64 = 256 * 1024;
/// Input writes one terminal may have waiting (see
/// [`MAX_PENDING_PTY_INPUT_BYTES`]).
pub const MAX_PENDING_PTY_INPUTS: u64 = 1024;
/// Largest input of one `WritePtyInput` (the wire limit).
pub const MAX_PTY_INPUT_BYTES: usize = 4096;
/// Largest output of one `PtyOutput` (the wire limit).
pub const MAX_PTY_OUTPUT_BYTES: usize = 64 * 1024;
/// Most client reports one [`crate::ops::StoreOp::PtyApply`] carries.
pub const MAX_PTY_APPLY_ITEMS: usize = 1024;
/// Largest `reason` a terminal's close keeps (bytes).
pub const MAX_PTY_REASON_BYTES: usize = 4096;

/// The configured bounds of terminals, checked by the store in the
/// transaction that opens one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtyLimits {
    /// Terminals not closed, per client.
    pub per_client: u32,
    /// Terminals not closed, on the whole server.
    pub per_server: u32,
    /// Recording kept per terminal (bytes): past it the oldest records
    /// go, and a replay or an attach from before them gets a cut marker.
    pub recording_bytes: u64,
}

impl Default for PtyLimits {
    fn default() -> Self {
        Self {
            per_client: 8,
            per_server: 256,
            recording_bytes: 64 * 1024 * 1024,
        }
    }
}

/// An operator mutation of a terminal.
#[derive(Debug, Clone, PartialEq)]
pub enum PtyMutation {
    /// `OpenPtySession`.
    Open(wire::OpenPtySessionRequest),
    /// `WritePtyInput`.
    Write(wire::WritePtyInputRequest),
    /// `ResizePtySession`.
    Resize(wire::ResizePtySessionRequest),
    /// `ClosePtySession`.
    Close(wire::ClosePtySessionRequest),
}

impl PtyMutation {
    /// The control method's name.
    #[must_use]
    pub fn method(&self) -> &'static str {
        match self {
            Self::Open(_) => "OpenPtySession",
            Self::Write(_) => "WritePtyInput",
            Self::Resize(_) => "ResizePtySession",
            Self::Close(_) => "ClosePtySession",
        }
    }
}

/// A terminal as the server core needs it to talk to its client.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PtyView {
    /// What operators see (`ListPtySessions`).
    pub info: wire::PtySessionInfo,
    /// The open frame, sent again after every reconnect until the
    /// terminal is closed (the client answers a repeat with the same
    /// `PtyOpened`).
    pub open: wire::PtyOpen,
    /// Highest `input_seq` assigned.
    pub input_seq: u64,
    /// Highest `input_seq` the client acknowledged.
    pub input_acked: u64,
    /// An operator (or the idle timeout) asked to close it.
    pub close_requested: bool,
}

impl PtyView {
    /// Whether the terminal ended.
    #[must_use]
    pub fn closed(&self) -> bool {
        self.info.state == wire::PtyState::Closed as i32
    }
}

/// The outcome of a [`PtyMutation`].
#[derive(Debug, Clone, PartialEq)]
pub struct PtyOutcome {
    /// The terminal as it now is.
    pub view: PtyView,
    /// The input's sequence (`WritePtyInput`).
    pub input_seq: Option<u64>,
    /// True when this was a replay of an earlier request (nothing new to
    /// send).
    pub replayed: bool,
}

/// One report of a client about one of its terminals, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub enum PtyReport {
    /// `PtyOpened`.
    Opened(wire::PtyOpened),
    /// `PtyInputAck`.
    InputAck(wire::PtyInputAck),
    /// `PtyOutput`.
    Output(wire::PtyOutput),
    /// `PtyClosed`.
    Closed(wire::PtyClosed),
}

impl PtyReport {
    /// The terminal's id, as sent.
    #[must_use]
    pub fn id(&self) -> &str {
        match self {
            Self::Opened(m) => &m.pty_session_id,
            Self::InputAck(m) => &m.pty_session_id,
            Self::Output(m) => &m.pty_session_id,
            Self::Closed(m) => &m.pty_session_id,
        }
    }
}

/// What the store made of one [`PtyReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyApplied {
    /// Recorded (or an exact repeat: nothing new); `output_offset` is the
    /// terminal's recorded end, the value of the `PtyOutputAck` to send
    /// after an output.
    Recorded {
        /// The recorded end of output.
        output_offset: u64,
        /// The terminal is closed now (nothing more goes to it).
        closed: bool,
    },
    /// Output that does not continue the recording (a gap with no cut
    /// marker): nothing stored; the server attaches again from
    /// `output_offset`, the end it has.
    Gap {
        /// The recorded end of output.
        output_offset: u64,
    },
    /// The server has no such terminal of this client (it was deleted, or
    /// the store was restored from an older backup): the client is told
    /// to close it.
    Unknown,
    /// Refused: the report breaks the protocol (the connection is closed
    /// as for any protocol error).
    Refused(DomainError),
}

/// A terminal of a client that is not closed, with what the client has
/// not acknowledged: after a reconnect the server sends the open frame,
/// an attach from the recorded end, the pending input, and a close when
/// one was asked.
#[derive(Debug, Clone, PartialEq)]
pub struct PtyResume {
    /// The terminal.
    pub view: PtyView,
    /// Pending input, in `input_seq` order (bounded by
    /// [`MAX_PENDING_PTY_INPUTS`]).
    pub inputs: Vec<wire::PtyInput>,
}

/// One record of a terminal's recording, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtyRecord {
    /// Its place in the recording (increasing from 1).
    pub rec_seq: u64,
    /// Milliseconds since the terminal opened.
    pub at_ms: u64,
    /// What it is.
    pub kind: PtyRecordKind,
    /// Output and input bytes (empty otherwise).
    pub data: Vec<u8>,
}

/// What a [`PtyRecord`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtyRecordKind {
    /// Output bytes from this offset.
    Output {
        /// Offset of the first byte.
        offset: u64,
    },
    /// Input, as numbered.
    Input {
        /// Its `input_seq`.
        input_seq: u64,
    },
    /// A window size change.
    Resize {
        /// Columns.
        cols: u32,
        /// Rows.
        rows: u32,
    },
    /// Output lost on the client: `[from, to)` was never received.
    Cut {
        /// The recorded end before the loss.
        from: u64,
        /// Where output resumes.
        to: u64,
    },
}

/// Largest output item a viewer gets (the proto's bound).
pub const VIEWER_ITEM_BYTES: usize = 64 * 1024;

/// What a viewer (`AttachPtySession`) is sent for one record of the
/// recording, given the next output offset it needs; returns the items
/// and its next offset. The rule that makes a viewer's output exact or
/// marked: bytes before `want` are skipped, bytes the recording does not
/// keep are a `PtyCut` naming the lost range, never a silent jump.
#[must_use]
pub fn viewer_items(
    want: u64,
    record: &PtyRecord,
) -> (Vec<wire::attach_pty_session_response::Item>, u64) {
    use wire::attach_pty_session_response::Item;
    let mut items = Vec::new();
    let mut want = want;
    match record.kind {
        PtyRecordKind::Output { offset } => {
            let end = offset.saturating_add(record.data.len() as u64);
            if end <= want {
                return (items, want);
            }
            if offset > want {
                // bytes before this record are not kept (trimmed to the
                // recording's cap): marked, never silent
                items.push(Item::Cut(wire::PtyCut {
                    requested_offset: want,
                    ring_start_offset: offset,
                }));
                want = offset;
            }
            let skip = usize::try_from(want - offset).unwrap_or(usize::MAX);
            let rest = record.data.get(skip..).unwrap_or_default();
            let mut at = want;
            for piece in rest.chunks(VIEWER_ITEM_BYTES) {
                items.push(Item::Output(wire::PtyOutputData {
                    offset: at,
                    data: piece.to_vec(),
                }));
                at += piece.len() as u64;
            }
            (items, end)
        }
        PtyRecordKind::Cut { to, .. } => {
            if want < to {
                items.push(Item::Cut(wire::PtyCut {
                    requested_offset: want,
                    ring_start_offset: to,
                }));
                want = to;
            }
            (items, want)
        }
        PtyRecordKind::Input { .. } | PtyRecordKind::Resize { .. } => (items, want),
    }
}

/// The marker a viewer at `want` gets before the `Closed` item of a
/// terminal whose output ended at `output_offset`, when the client's last
/// bytes were never recorded.
#[must_use]
pub fn viewer_end_cut(want: u64, output_offset: u64) -> Option<wire::PtyCut> {
    (want < output_offset).then_some(wire::PtyCut {
        requested_offset: want,
        ring_start_offset: output_offset,
    })
}

fn invalid(field: &'static str, why: impl AsRef<str>) -> DomainError {
    DomainError::new(rvbox_domain::error::Code::InvalidArgument, why).with_field(field)
}

fn check_size(rows: u32, cols: u32) -> Result<(), DomainError> {
    if !(1..=1000).contains(&rows) {
        return Err(invalid("rows", format!("is {rows}; it must be 1..=1000")));
    }
    if !(1..=1000).contains(&cols) {
        return Err(invalid("cols", format!("is {cols}; it must be 1..=1000")));
    }
    Ok(())
}

fn check_id(field: &'static str, text: &str) -> Result<[u8; 16], DomainError> {
    rvbox_domain::ids::Uuid7::parse(field, text)
        .map(|u| *u.as_bytes())
        .map_err(DomainError::from)
}

/// A checked mutation: its request id, its terminal, and for an open the
/// client and the open frame.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedMutation {
    /// The request id (for an open, also the terminal's id).
    pub request_id: [u8; 16],
    /// The terminal.
    pub pty_session_id: [u8; 16],
    /// The client (an open only).
    pub client_id: Option<String>,
}

/// An open as the server hashes and keeps it: its profile flags
/// deduplicated and sorted by wire value (they are a set), everything else
/// as given. A retry that lists the same profiles in another order is the
/// same request; the open frame carries them in this order.
#[must_use]
pub fn normalize_open(r: &wire::OpenPtySessionRequest) -> wire::OpenPtySessionRequest {
    let mut out = r.clone();
    out.profile_flags.sort_unstable();
    out.profile_flags.dedup();
    out
}

/// Checks a mutation's fields (pure: every store backend checks them so).
///
/// # Errors
/// `INVALID_ARGUMENT` (or `TOO_LARGE`) naming the first offending field.
pub fn check_mutation(m: &PtyMutation) -> Result<CheckedMutation, DomainError> {
    use rvbox_domain::validate::{MAX_CWD_BYTES, MAX_ENV_KEY_BYTES};
    match m {
        PtyMutation::Open(r) => {
            let id = check_id("request_id", &r.request_id)?;
            let client = rvbox_domain::ids::ClientId::parse("client_id", &r.client_id)
                .map_err(DomainError::from)?;
            if wire::ShellType::try_from(r.shell_type).is_err() {
                return Err(invalid(
                    "shell_type",
                    format!("unknown shell type value {}", r.shell_type),
                ));
            }
            if !r.cwd.is_empty()
                && (r.cwd.len() > MAX_CWD_BYTES || !r.cwd.starts_with('/') || r.cwd.contains('\0'))
            {
                return Err(invalid(
                    "cwd",
                    format!(
                        "must be an absolute path of at most {MAX_CWD_BYTES} bytes without NUL bytes (or empty for the client's default)"
                    ),
                ));
            }
            if r.env.len() > rvbox_domain::limits::MAX_ENV_OVERRIDES {
                return Err(invalid(
                    "env",
                    format!(
                        "{} environment overrides; the limit is {}",
                        r.env.len(),
                        rvbox_domain::limits::MAX_ENV_OVERRIDES
                    ),
                ));
            }
            for (key, value) in &r.env {
                if key.is_empty() || key.len() > MAX_ENV_KEY_BYTES || key.contains(['=', '\0']) {
                    return Err(invalid(
                        "env",
                        format!(
                            "environment key {key:?} must be 1..={MAX_ENV_KEY_BYTES} bytes without '=' or NUL"
                        ),
                    ));
                }
                if value.contains('\0') {
                    return Err(invalid(
                        "env",
                        format!("the value of environment key {key:?} contains a NUL byte"),
                    ));
                }
            }
            check_size(r.rows, r.cols)?;
            rvbox_domain::validate::check_profile_flags_of("profile_flags", &r.profile_flags)?;
            Ok(CheckedMutation {
                request_id: id,
                pty_session_id: id,
                client_id: Some(client.as_str().to_owned()),
            })
        }
        PtyMutation::Write(r) => {
            let request_id = check_id("request_id", &r.request_id)?;
            let pty = check_id("pty_session_id", &r.pty_session_id)?;
            if r.data.is_empty() || r.data.len() > MAX_PTY_INPUT_BYTES {
                return Err(invalid(
                    "data",
                    format!(
                        "is {} bytes; it must be 1..={MAX_PTY_INPUT_BYTES}",
                        r.data.len()
                    ),
                ));
            }
            Ok(CheckedMutation {
                request_id,
                pty_session_id: pty,
                client_id: None,
            })
        }
        PtyMutation::Resize(r) => {
            let request_id = check_id("request_id", &r.request_id)?;
            let pty = check_id("pty_session_id", &r.pty_session_id)?;
            check_size(r.rows, r.cols)?;
            Ok(CheckedMutation {
                request_id,
                pty_session_id: pty,
                client_id: None,
            })
        }
        PtyMutation::Close(r) => {
            let request_id = check_id("request_id", &r.request_id)?;
            let pty = check_id("pty_session_id", &r.pty_session_id)?;
            Ok(CheckedMutation {
                request_id,
                pty_session_id: pty,
                client_id: None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open() -> wire::OpenPtySessionRequest {
        wire::OpenPtySessionRequest {
            request_id: "01890a5d-ac96-774b-bcce-b302099a8057".into(),
            client_id: "web-1".into(),
            rows: 24,
            cols: 80,
            ..Default::default()
        }
    }

    #[test]
    fn an_open_is_checked_field_by_field() {
        let ok = check_mutation(&PtyMutation::Open(open())).unwrap();
        assert_eq!(ok.request_id, ok.pty_session_id);
        assert_eq!(ok.client_id.as_deref(), Some("web-1"));
        for (req, field) in [
            (wire::OpenPtySessionRequest { rows: 0, ..open() }, "rows"),
            (
                wire::OpenPtySessionRequest {
                    cols: 1001,
                    ..open()
                },
                "cols",
            ),
            (
                wire::OpenPtySessionRequest {
                    cwd: "relative".into(),
                    ..open()
                },
                "cwd",
            ),
            (
                wire::OpenPtySessionRequest {
                    request_id: "nope".into(),
                    ..open()
                },
                "request_id",
            ),
            (
                wire::OpenPtySessionRequest {
                    shell_type: 99,
                    ..open()
                },
                "shell_type",
            ),
            (
                wire::OpenPtySessionRequest {
                    profile_flags: vec![wire::ProfileFlag::Unspecified as i32],
                    ..open()
                },
                "profile_flags",
            ),
            (
                wire::OpenPtySessionRequest {
                    profile_flags: vec![99],
                    ..open()
                },
                "profile_flags",
            ),
            (
                wire::OpenPtySessionRequest {
                    profile_flags: vec![
                        wire::ProfileFlag::Light as i32,
                        wire::ProfileFlag::CpuLow as i32,
                    ],
                    ..open()
                },
                "profile_flags",
            ),
        ] {
            let e = check_mutation(&PtyMutation::Open(req)).unwrap_err();
            assert_eq!(e.field(), field, "{e}");
        }
    }

    #[test]
    fn an_open_keeps_its_profiles_as_a_sorted_set() {
        let flags = |f: &[wire::ProfileFlag]| f.iter().map(|x| *x as i32).collect::<Vec<_>>();
        let r = wire::OpenPtySessionRequest {
            profile_flags: flags(&[
                wire::ProfileFlag::MemLow,
                wire::ProfileFlag::CpuHigh,
                wire::ProfileFlag::MemLow,
            ]),
            ..open()
        };
        assert!(check_mutation(&PtyMutation::Open(r.clone())).is_ok());
        assert_eq!(
            normalize_open(&r).profile_flags,
            flags(&[wire::ProfileFlag::CpuHigh, wire::ProfileFlag::MemLow])
        );
        assert_eq!(normalize_open(&open()), open());
    }

    #[test]
    fn input_is_one_to_four_kibibytes() {
        let w = |n: usize| {
            PtyMutation::Write(wire::WritePtyInputRequest {
                request_id: "01890a5d-ac96-774b-bcce-b302099a8057".into(),
                pty_session_id: "01890a5d-ac96-774b-bcce-b302099a8058".into(),
                data: vec![b'a'; n],
            })
        };
        assert!(check_mutation(&w(1)).is_ok());
        assert!(check_mutation(&w(4096)).is_ok());
        assert_eq!(check_mutation(&w(0)).unwrap_err().field(), "data");
        assert_eq!(check_mutation(&w(4097)).unwrap_err().field(), "data");
    }
}

/// What a store records for one `PtyOutput` report, given the recorded
/// end of the terminal's output: one decision for every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPlan<'a> {
    /// The report breaks the protocol, in words.
    Protocol(String),
    /// The output starts after the recorded end: nothing is recorded,
    /// and the client is attached again from `output_offset`.
    Gap {
        /// The recorded end.
        output_offset: u64,
    },
    /// Record, in order, the cut (when the client's ring lost bytes) and
    /// the bytes not recorded yet (none when the report repeats what is
    /// recorded); the recorded end becomes `end`.
    Record {
        /// `(resume, from)`: the bytes from `from` up to `resume` were
        /// lost on the client.
        cut: Option<(u64, u64)>,
        /// The offset of the first fresh byte.
        at: u64,
        /// The bytes past the recorded end (an overlap is trimmed).
        fresh: &'a [u8],
        /// The new recorded end.
        end: u64,
    },
}

/// Decides what a `PtyOutput` report adds to a recording whose output
/// ends at `end`.
#[must_use]
pub fn plan_output(end: u64, m: &wire::PtyOutput) -> OutputPlan<'_> {
    if m.data.is_empty() || m.data.len() > MAX_PTY_OUTPUT_BYTES {
        return OutputPlan::Protocol(format!(
            "pty_output.data is {} bytes; it must be 1..={MAX_PTY_OUTPUT_BYTES}",
            m.data.len()
        ));
    }
    let mut end = end;
    let mut lost = None;
    if let Some(cut) = &m.cut {
        if cut.ring_start_offset != m.offset {
            return OutputPlan::Protocol(format!(
                "pty_output.cut resumes at {} but the output starts at {}",
                cut.ring_start_offset, m.offset
            ));
        }
        if cut.ring_start_offset > end {
            lost = Some((cut.ring_start_offset, end));
            end = cut.ring_start_offset;
        }
    }
    if m.offset > end {
        return OutputPlan::Gap { output_offset: end };
    }
    let upto = m.offset.saturating_add(m.data.len() as u64);
    if upto <= end {
        return OutputPlan::Record {
            cut: lost,
            at: end,
            fresh: &[],
            end,
        };
    }
    // what the recording has already is not recorded again
    let skip = usize::try_from(end - m.offset).unwrap_or(usize::MAX);
    OutputPlan::Record {
        cut: lost,
        at: end,
        fresh: m.data.get(skip..).unwrap_or(&[]),
        end: upto,
    }
}

#[cfg(test)]
mod output_plan_tests {
    use super::*;

    fn out(offset: u64, data: &[u8], cut: Option<u64>) -> wire::PtyOutput {
        wire::PtyOutput {
            offset,
            data: data.to_vec(),
            cut: cut.map(|ring_start_offset| wire::PtyCut {
                ring_start_offset,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn output_is_recorded_once_by_offset_and_losses_are_cuts() {
        let fresh = |at, fresh: &'static [u8], end| OutputPlan::Record {
            cut: None,
            at,
            fresh,
            end,
        };
        assert_eq!(plan_output(0, &out(0, b"abc", None)), fresh(0, b"abc", 3));
        // an overlap is trimmed, a repeat adds nothing
        assert_eq!(plan_output(2, &out(0, b"abcd", None)), fresh(2, b"cd", 4));
        assert_eq!(plan_output(4, &out(0, b"ab", None)), fresh(4, b"", 4));
        // a gap is never recorded
        assert_eq!(
            plan_output(4, &out(6, b"x", None)),
            OutputPlan::Gap { output_offset: 4 }
        );
        // bytes lost on the client are a cut, then the output
        assert_eq!(
            plan_output(4, &out(10, b"xy", Some(10))),
            OutputPlan::Record {
                cut: Some((10, 4)),
                at: 10,
                fresh: b"xy",
                end: 12
            }
        );
        // a cut the recording is already past is no loss
        assert_eq!(
            plan_output(12, &out(10, b"xyz", Some(10))),
            fresh(12, b"z", 13)
        );
        assert!(matches!(
            plan_output(0, &out(0, b"", None)),
            OutputPlan::Protocol(_)
        ));
        assert!(matches!(
            plan_output(0, &out(3, b"a", Some(2))),
            OutputPlan::Protocol(_)
        ));
    }
}
