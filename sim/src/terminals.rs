//! Terminals in the simulator (docs/terminals.md): what the operator and
//! the viewers of a terminal do, as `rvc shell` and `rvc attach` would,
//! and the oracles that compare what each model PTY really got and
//! produced ([`TerminalRecord`]) with what the server acknowledged,
//! stores and serves.
//!
//! The world drives the calls ([`crate::world`]); this module keeps their
//! state and the checks, which are pure functions of that state, the
//! PTY's record and what the store serves (`sim/tests/terminal_oracles.rs` breaks
//! each promise on purpose and watches its check fire):
//!
//! - **input** ([`check_terminal_input`]): every frame acknowledged to the
//!   operator reached the PTY exactly once, in acknowledgement order;
//!   nothing reached the PTY that no operator sent; a frame never
//!   acknowledged reached it at most once; a frame the client confirmed
//!   (the server's `input_acked`), or one before a frame that reached the
//!   PTY, did reach it;
//! - **output** ([`check_viewer`]): what a viewer was served, from the
//!   offset it attached at and across its reattachments from the offset
//!   it printed, is exactly what the PTY produced at those offsets, or a
//!   cut marker naming the range; never a byte doubled or moved;
//! - **close** ([`check_terminal_close`]): a closed terminal's stored exit
//!   result is what the shell did, with its documented reason, or an end
//!   without a status whose reason says why (the holder gone with the end
//!   it had told, the client refused the open, the operator closed it
//!   before its shell started);
//! - **one holder**: a terminal is never held twice on its client (the
//!   host checks every start, [`crate::host::SimHost`]).

use rvbox_proto::v1 as wire;

use crate::supervisor::TerminalRecord;

/// Terminals one run opens at most.
pub const MAX_TERMINALS_PER_RUN: usize = 4;
/// Viewers one run attaches at most.
pub const MAX_VIEWERS_PER_RUN: usize = 12;
/// Frames one terminal's operator types at most.
pub const MAX_FRAMES_PER_TERMINAL: u64 = 40;
/// Answered mutations kept per terminal for replays.
pub const MAX_KEPT_ANSWERS: usize = 32;
/// Items one viewer keeps (a bound; a viewer past it stops).
pub const MAX_VIEWER_ITEMS: usize = 100_000;
/// How long the operator's rvc retries a terminal call refused with a
/// transient error before it reports the refusal (a frame is then given
/// up, as rvc drops held keys it could not send).
pub const TERMINAL_RETRY_BUDGET_MS: u64 = 60_000;
/// How long, in the calm tail, the operator waits for the client to
/// confirm every frame before closing a terminal anyway.
pub const DRAIN_WAIT_MS: u64 = 30_000;

/// `PtyClosed.reason` of a shell that ended by itself.
pub use rvbox_client_core::machine::terminals::REASON_EXITED;
/// `PtyClosed.reason` of a holder that is gone.
pub use rvbox_client_core::machine::terminals::REASON_GONE;
/// `PtyClosed.reason` of an operator's close (the client's text).
pub use rvbox_client_core::machine::terminals::REASON_OPERATOR;
/// The reason the server keeps for a terminal it closed as idle.
pub use rvbox_store::pty::IDLE_TIMEOUT as REASON_IDLE;

/// One input frame the operator typed, held (as rvc's `KeyBuffer` holds
/// it) until the server answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypedFrame {
    /// Its request id, sent again with it until it is answered.
    pub request_id: String,
    /// Its bytes.
    pub data: Vec<u8>,
    /// The `input_seq` the server answered: acknowledged to the operator.
    pub acked: Option<u64>,
    /// Sent at least once (it may be stored without an answer).
    pub sent: bool,
}

/// How a terminal's plan ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The operator closes it once done typing.
    Close,
    /// Its shell exits by itself with this code.
    Exit(i32),
    /// It stays open until the calm tail, where the operator closes it.
    Tail,
}

/// A terminal call in flight: sent again with its request id until
/// answered.
#[derive(Debug, Clone, PartialEq)]
pub enum TermCall {
    /// `OpenPtySession`.
    Open,
    /// `WritePtyInput` of the typed frame at this index.
    Write(usize),
    /// `ResizePtySession`.
    Resize(wire::ResizePtySessionRequest),
    /// `ClosePtySession`.
    Close(wire::ClosePtySessionRequest),
}

/// One terminal of the workload.
#[derive(Debug, Clone)]
pub struct TermPlan {
    /// The terminal (the open's request id).
    pub id: [u8; 16],
    /// Its text form.
    pub text: String,
    /// The host it opens on.
    pub host: u32,
    /// The open request.
    pub open: wire::OpenPtySessionRequest,
    /// The open was answered.
    pub opened: bool,
    /// The open was refused (never stored): nothing more happens.
    pub refused: bool,
    /// The call in flight.
    pub pending: Option<TermCall>,
    /// A crash swallowed an answer to the call in flight (it may be
    /// stored: it is never given up).
    pub maybe_committed: bool,
    /// When the call in flight was first sent.
    pub since: u64,
    /// Every frame typed, in order.
    pub typed: Vec<TypedFrame>,
    /// Frames still to type.
    pub frames_left: u64,
    /// How it ends.
    pub ending: Ending,
    /// The world made its shell exit.
    pub exited: bool,
    /// A `ClosePtySession` was sent (it may be stored).
    pub close_sent: bool,
    /// Its next turn.
    pub at: u64,
    /// When the operator began waiting for the client to confirm every
    /// frame (calm tail).
    pub drain_since: Option<u64>,
    /// The terminal as the server first showed it closed.
    pub closed: Option<wire::PtySessionInfo>,
    /// The server no longer has it (retention removed it once closed).
    pub gone: bool,
    /// The highest `input_acked` the server showed (input its client
    /// confirmed written).
    pub input_confirmed: u64,
    /// The highest `output_offset` the server showed.
    pub output_seen: u64,
    /// Answered mutations, for replays.
    pub answered: Vec<(
        rvbox_store_port::pty::PtyMutation,
        rvbox_server_core::PtyAnswer,
    )>,
    /// Bytes its shell wrote in bursts.
    pub bursts: u64,
}

impl TermPlan {
    /// Nothing more happens to it.
    #[must_use]
    pub fn done(&self) -> bool {
        self.pending.is_none()
            && (self.refused || (self.opened && (self.closed.is_some() || self.gone)))
    }

    /// The highest `input_seq` acknowledged to the operator.
    #[must_use]
    pub fn last_acked(&self) -> u64 {
        self.typed.iter().filter_map(|f| f.acked).max().unwrap_or(0)
    }
}

/// What a viewer was served, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewerItem {
    /// The viewer attached (first, or again after a loss) from `from`.
    Attached {
        /// The offset asked from.
        from: u64,
    },
    /// Output bytes from `offset`.
    Output {
        /// Offset of the first byte.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// A cut marker: `[requested, resumes)` is not served.
    Cut {
        /// The offset the viewer needed.
        requested: u64,
        /// Where output resumes.
        resumes: u64,
    },
    /// The terminal closed; its output ended at `output_offset`.
    Closed {
        /// The terminal's end of output.
        output_offset: u64,
    },
}

/// One viewer (`rvc attach`): it prints what it is served and, after a
/// loss, attaches again from the offset it printed.
#[derive(Debug, Clone)]
pub struct ViewerState {
    /// The plan (index) of its terminal.
    pub plan: usize,
    /// The next offset it needs (what it printed ends here).
    pub want: u64,
    /// The last record read of the current attach.
    pub cursor: u64,
    /// Its stream is up.
    pub attached: bool,
    /// What it was served.
    pub items: Vec<ViewerItem>,
    /// It saw the close, or its terminal is gone.
    pub done: bool,
    /// Its next turn.
    pub at: u64,
}

/// The viewer items of the store's answer, as this module keeps them.
#[must_use]
pub fn viewer_item(item: wire::attach_pty_session_response::Item) -> ViewerItem {
    use wire::attach_pty_session_response::Item;
    match item {
        Item::Output(o) => ViewerItem::Output {
            offset: o.offset,
            data: o.data,
        },
        Item::Cut(c) => ViewerItem::Cut {
            requested: c.requested_offset,
            resumes: c.ring_start_offset,
        },
        Item::Closed(info) => ViewerItem::Closed {
            output_offset: info.output_offset,
        },
    }
}

/// Counters of the terminal oracles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TerminalCounts {
    /// Frames written to a PTY, compared.
    pub frames: u64,
    /// Frames acknowledged to an operator.
    pub acked: u64,
    /// Frames that reached the PTY without an answer to the operator.
    pub unanswered_delivered: u64,
    /// Output bytes served and compared.
    pub output_bytes: u64,
    /// Bytes covered by cut markers.
    pub cut_bytes: u64,
    /// Viewers (and whole-recording reads) checked.
    pub viewers: u64,
    /// Closes compared.
    pub closes: u64,
}

/// The input oracle of one terminal: `typed` is what the operator typed
/// and was told, `record` what its PTY really got (`None`: no holder ever
/// started), `confirmed` the highest `input_acked` the server showed, and
/// `hung_up` whether a close hung its shell up (the server sends every
/// pending frame before the close, and the holder writes them before it
/// hangs up: then every acknowledged frame reached the PTY).
pub fn check_terminal_input(
    id: &str,
    typed: &[TypedFrame],
    record: Option<&TerminalRecord>,
    confirmed: u64,
    hung_up: bool,
    counts: &mut TerminalCounts,
) -> Vec<String> {
    let mut problems = Vec::new();
    let empty = Vec::new();
    let got = record.map_or(&empty, |r| &r.frames);
    counts.frames += got.len() as u64;
    // acknowledged in the order typed: each answer's input_seq above the
    // one before
    let mut last = 0u64;
    for f in typed {
        if let Some(seq) = f.acked {
            counts.acked += 1;
            if seq <= last {
                problems.push(format!(
                    "terminal {id}: frame {} acknowledged as input_seq {seq} after input_seq {last}",
                    f.request_id
                ));
            }
            last = last.max(seq);
        }
    }
    // written once each, in order
    if got
        .windows(2)
        .any(|w| w.first().map(|a| a.0) >= w.get(1).map(|b| b.0))
    {
        let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
        problems.push(format!(
            "terminal {id}: the PTY got input_seqs {seqs:?} (each once, in order)"
        ));
    }
    // each written frame is one the operator sent: acknowledged with its
    // sequence, or sent and never answered (used once)
    let mut unanswered: Vec<&TypedFrame> = typed
        .iter()
        .filter(|f| f.sent && f.acked.is_none())
        .collect();
    for (seq, bytes) in got {
        match typed.iter().find(|f| f.acked == Some(*seq)) {
            Some(f) if f.data == *bytes => {}
            Some(f) => problems.push(format!(
                "terminal {id}: input_seq {seq} reached the PTY as {} bytes other than the {} the operator typed",
                bytes.len(),
                f.data.len()
            )),
            None => match unanswered.iter().position(|f| f.data == *bytes) {
                Some(k) => {
                    unanswered.remove(k);
                    counts.unanswered_delivered += 1;
                }
                None => problems.push(format!(
                    "terminal {id}: input_seq {seq} ({} bytes) reached the PTY, but no operator sent those bytes",
                    bytes.len()
                )),
            },
        }
    }
    // every acknowledged frame before one that reached the PTY, or that
    // the client confirmed written, reached it
    let reached = got.iter().map(|(s, _)| *s).max().unwrap_or(0);
    for f in typed {
        let Some(seq) = f.acked else {
            continue;
        };
        if got.iter().any(|(s, _)| *s == seq) {
            continue;
        }
        if seq <= confirmed {
            problems.push(format!(
                "terminal {id}: input_seq {seq}, acknowledged to the operator and confirmed written by the client, never reached the PTY"
            ));
        } else if hung_up {
            problems.push(format!(
                "terminal {id}: input_seq {seq}, acknowledged to the operator, never reached the PTY before a close hung it up"
            ));
        } else if seq < reached {
            problems.push(format!(
                "terminal {id}: input_seq {seq}, acknowledged to the operator, never reached the PTY, though input_seq {reached} did"
            ));
        }
    }
    problems
}

/// The recording's input: each frame recorded is one the operator sent,
/// with the `input_seq` it was acknowledged with (or, never answered,
/// with its bytes), once.
#[must_use]
pub fn check_recorded_input(
    id: &str,
    typed: &[TypedFrame],
    recorded: &[(u64, Vec<u8>)],
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut unanswered: Vec<&TypedFrame> = typed
        .iter()
        .filter(|f| f.sent && f.acked.is_none())
        .collect();
    if recorded
        .windows(2)
        .any(|w| w.first().map(|a| a.0) >= w.get(1).map(|b| b.0))
    {
        problems.push(format!(
            "terminal {id}: the recording holds input_seqs out of order or twice"
        ));
    }
    for (seq, bytes) in recorded {
        match typed.iter().find(|f| f.acked == Some(*seq)) {
            Some(f) if f.data == *bytes => {}
            Some(_) => problems.push(format!(
                "terminal {id}: the recording's input_seq {seq} holds other bytes than the operator typed"
            )),
            None => match unanswered.iter().position(|f| f.data == *bytes) {
                Some(k) => {
                    unanswered.remove(k);
                }
                None => problems.push(format!(
                    "terminal {id}: the recording holds input_seq {seq}, which no operator sent"
                )),
            },
        }
    }
    problems
}

/// The output oracle of one viewer: what it was served (`items`, with its
/// attachments) against what the PTY produced (`output`, offset `n` at
/// index `n`). Returns the bytes compared and the bytes cut.
///
/// # Errors
/// The first item that breaks the promise.
pub fn check_viewer(id: &str, items: &[ViewerItem], output: &[u8]) -> Result<(u64, u64), String> {
    let mut at: Option<u64> = None;
    let (mut bytes, mut cut) = (0u64, 0u64);
    let mut closed = false;
    for (k, item) in items.iter().enumerate() {
        if closed {
            return Err(format!(
                "terminal {id}: viewer item {k} ({item:?}) after the close"
            ));
        }
        match item {
            ViewerItem::Attached { from } => {
                if let Some(want) = at
                    && *from != want
                {
                    return Err(format!(
                        "terminal {id}: the viewer attached again from {from}, it had printed up to {want}"
                    ));
                }
                if *from > output.len() as u64 {
                    return Err(format!(
                        "terminal {id}: the viewer attached from {from}, past the {} bytes the PTY produced",
                        output.len()
                    ));
                }
                at = Some(*from);
            }
            ViewerItem::Output { offset, data } => {
                let Some(want) = at else {
                    return Err(format!("terminal {id}: output before an attach"));
                };
                if *offset != want {
                    return Err(format!(
                        "terminal {id}: served {} bytes at offset {offset}, the viewer needed offset {want} ({})",
                        data.len(),
                        if *offset < want {
                            "bytes doubled"
                        } else {
                            "bytes skipped without a cut marker"
                        }
                    ));
                }
                let end = offset.saturating_add(data.len() as u64);
                let produced = usize::try_from(*offset)
                    .ok()
                    .zip(usize::try_from(end).ok())
                    .and_then(|(a, b)| output.get(a..b));
                match produced {
                    Some(p) if p == data.as_slice() => {}
                    Some(p) => {
                        let first = p.iter().zip(data).position(|(a, b)| a != b).unwrap_or(0);
                        return Err(format!(
                            "terminal {id}: served bytes at offset {} differ from what the PTY produced",
                            offset + first as u64
                        ));
                    }
                    None => {
                        return Err(format!(
                            "terminal {id}: served bytes up to offset {end}, past the {} the PTY produced",
                            output.len()
                        ));
                    }
                }
                bytes += data.len() as u64;
                at = Some(end);
            }
            ViewerItem::Cut { requested, resumes } => {
                let Some(want) = at else {
                    return Err(format!("terminal {id}: a cut before an attach"));
                };
                if *requested != want || resumes <= requested {
                    return Err(format!(
                        "terminal {id}: a cut [{requested}, {resumes}) where the viewer needed offset {want}"
                    ));
                }
                if *resumes > output.len() as u64 {
                    return Err(format!(
                        "terminal {id}: a cut resumes at {resumes}, past the {} bytes the PTY produced",
                        output.len()
                    ));
                }
                cut += resumes - requested;
                at = Some(*resumes);
            }
            ViewerItem::Closed { output_offset } => {
                if at != Some(*output_offset) {
                    return Err(format!(
                        "terminal {id}: closed at output offset {output_offset}, the viewer was served up to {at:?}"
                    ));
                }
                closed = true;
            }
        }
    }
    Ok((bytes, cut))
}

/// What the operator did to end a terminal, for [`check_terminal_close`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CloseAsked {
    /// The operator sent a `ClosePtySession`.
    pub by_operator: bool,
    /// The server's idle pass may have closed it.
    pub idle: bool,
}

/// The close oracle of one terminal: the stored end (`info`) against what
/// its shell did (`record`; `None`: no holder ever started).
pub fn check_terminal_close(
    id: &str,
    info: &wire::PtySessionInfo,
    record: Option<&TerminalRecord>,
    asked: CloseAsked,
    counts: &mut TerminalCounts,
) -> Vec<String> {
    use wire::Lifecycle as L;
    let mut problems = Vec::new();
    counts.closes += 1;
    let exit = info.exit_result.as_ref();
    let lifecycle = exit.and_then(|x| L::try_from(x.lifecycle).ok());
    let code = exit.and_then(|x| x.exit_code);
    let signal = exit.and_then(|x| x.signal_number);
    let reason = info.close_reason.as_str();
    let produced = record.map_or(0, |r| r.output.len() as u64);
    if info.output_offset > produced {
        problems.push(format!(
            "terminal {id}: its output ends at {} on the server, the PTY produced {produced} bytes",
            info.output_offset
        ));
    }
    let started = record.is_some_and(|r| r.starts > 0);
    let Some(r) = record.filter(|_| started) else {
        // no shell ever ran: no status, and an end that says why
        if code.is_some() || signal.is_some() {
            problems.push(format!(
                "terminal {id}: an exit status {exit:?} for a terminal whose shell never ran"
            ));
        }
        let explained = match lifecycle {
            None => !reason.is_empty(),
            Some(L::Cancelled) => asked.by_operator || asked.idle,
            Some(L::Interrupted | L::Rejected) => !reason.is_empty(),
            Some(_) => false,
        };
        if !explained {
            problems.push(format!(
                "terminal {id}: its shell never ran, yet it closed {lifecycle:?} ({reason:?})"
            ));
        }
        return problems;
    };
    let Some(ended) = r.ended else {
        problems.push(format!(
            "terminal {id}: closed on the server ({lifecycle:?}, {reason:?}) while its shell still runs"
        ));
        return problems;
    };
    let (want_code, want_signal) = match ended {
        rvbox_client_core::process::Exit::Code(c) => (Some(c), None),
        rvbox_client_core::process::Exit::Signal(s) => (None, Some(s)),
    };
    // the end a daemon was told and died with: nobody knows it any more
    if r.exit_unrecorded
        && lifecycle == Some(L::Interrupted)
        && code.is_none()
        && signal.is_none()
        && reason == REASON_GONE
    {
        return problems;
    }
    if (code, signal) != (want_code, want_signal) {
        problems.push(format!(
            "terminal {id}: its shell ended {ended:?}, the server stores the status {exit:?} ({reason:?})"
        ));
        return problems;
    }
    if info.output_offset != produced {
        problems.push(format!(
            "terminal {id}: its shell produced {produced} bytes, the server's output ends at {}",
            info.output_offset
        ));
    }
    let asked_to_close = asked.by_operator || asked.idle;
    let close_reason_ok = |reason: &str| {
        (asked.by_operator && reason == REASON_OPERATOR) || (asked.idle && reason == REASON_IDLE)
    };
    let ok = match lifecycle {
        // its own end, before any close reached it
        Some(L::Succeeded) => !r.hung_up && want_code == Some(0) && reason == REASON_EXITED,
        Some(L::Failed) => !r.hung_up && want_code != Some(0) && reason == REASON_EXITED,
        // asked to close: the hang-up, or the shell's own end that came
        // first
        Some(L::Terminated) => {
            asked_to_close && close_reason_ok(reason)
                || r.hung_up && reason.starts_with("the client could not record")
        }
        _ => false,
    };
    if !ok {
        problems.push(format!(
            "terminal {id}: its shell ended {ended:?} (hung up {}, operator close {}, idle close possible {}), the server stores {lifecycle:?} with the reason {reason:?}",
            r.hung_up, asked.by_operator, asked.idle
        ));
    }
    problems
}
