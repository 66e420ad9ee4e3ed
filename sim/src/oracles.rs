//! The oracles (conventions rule 17): after the calm tail, every promise
//! RVBox makes about a command is checked by comparing what its process
//! really did (the [`ProcessLog`] of the simulated supervisor) with what
//! the server stores and serves, read back through the same store reads
//! the control service answers `GetOutput` and `FollowCommand` with:
//!
//! - **output**: per stream, the bytes served equal the bytes the process
//!   wrote, except runs each covered by exactly one truncation record
//!   whose raw byte count equals the missing run; nothing duplicated,
//!   reordered or invented. A process that died with its daemon may miss
//!   a tail (its `OutputIncomplete` says so). `GetOutput` (pages of random
//!   sizes, resuming inside events), the follow history from the start and
//!   the follow history from a random cursor must all agree;
//! - **exit**: the terminal outcome (lifecycle, exit code or signal) is
//!   what the process did, on the client the command was addressed to,
//!   unless the history explains a server decision;
//! - **stdin**: the process got exactly the acknowledged writes, in order,
//!   once each, their bytes as appended, and end of file once after the
//!   close; the stored acknowledgements say so;
//! - **signals**: each `SignalCommand` reached the process at most once,
//!   and the stored results match what was delivered.
//!
//! Each check returns the problems it found; a test breaks each promise
//! on purpose and watches its oracle fire (`sim/tests/oracles.rs`).

use std::collections::BTreeMap;

use rvbox_client_core::process::Exit;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_store::Store;
use rvbox_store::output::HistoryItem;

use crate::rng::SimRng;
use crate::supervisor::{Ended, ProcessLog, ProcessRecord};

/// Largest raw length of one output event the oracles decompress.
pub const MAX_EVENT_RAW: usize = 4 * 1024 * 1024;
/// Events one history read asks for.
pub const HISTORY_BATCH: usize = 256;
/// Most pages or batches one read takes before it gives up (a bound).
pub const MAX_READS: usize = 100_000;

const STDOUT: u8 = 1;
const STDERR: u8 = 2;

/// One item of a stream pair as served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Served {
    /// Output bytes of one stream (0 stdout, 1 stderr).
    Data {
        /// 0 stdout, 1 stderr.
        stream: usize,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// A truncation record (the client's or the server's): the streams it
    /// covers (bit 1 stdout, bit 2 stderr) and its raw byte count.
    Gap {
        /// Streams.
        mask: u8,
        /// Raw bytes, when the record knows them.
        raw: Option<u64>,
        /// Its source.
        source: i32,
    },
    /// An `OutputIncomplete` record.
    Incomplete,
}

fn mask_of(streams: &[i32]) -> u8 {
    streams.iter().fold(0u8, |m, s| {
        m | match wire::OutputStream::try_from(*s) {
            Ok(wire::OutputStream::Stdout) => STDOUT,
            Ok(wire::OutputStream::Stderr) => STDERR,
            _ => 0,
        }
    })
}

fn stream_of(s: i32) -> Option<usize> {
    match wire::OutputStream::try_from(s) {
        Ok(wire::OutputStream::Stdout) => Some(0),
        Ok(wire::OutputStream::Stderr) => Some(1),
        _ => None,
    }
}

/// Joins consecutive data of one stream (pages and events split a stream
/// at arbitrary points; the promise is about the bytes).
fn normalize(items: Vec<Served>) -> Vec<Served> {
    let mut out: Vec<Served> = Vec::with_capacity(items.len());
    for it in items {
        if let Served::Data { stream, bytes } = &it
            && let Some(Served::Data {
                stream: s,
                bytes: b,
            }) = out.last_mut()
            && s == stream
        {
            b.extend_from_slice(bytes);
            continue;
        }
        if matches!(&it, Served::Data { bytes, .. } if bytes.is_empty()) {
            continue;
        }
        out.push(it);
    }
    out
}

/// `GetOutput` of both streams from the start, page after page, each page
/// at most a random number of bytes (so pages resume inside events).
///
/// # Errors
/// A refused request or a read that does not end.
pub fn read_get_output(
    store: &Store,
    issue: &Uuid7,
    rng: &mut SimRng,
) -> Result<Vec<Served>, String> {
    let mut items = Vec::new();
    let mut token = String::new();
    for _ in 0..MAX_READS {
        let max_bytes = if rng.chance(300) {
            u32::try_from(rng.range_inclusive(1..=4096)).unwrap_or(4096)
        } else {
            u32::try_from(rng.range_inclusive(4096..=1 << 20)).unwrap_or(1 << 20)
        };
        let req = wire::GetOutputRequest {
            request_id: String::new(),
            issue_uuid: issue.to_string(),
            streams: vec![
                wire::OutputStream::Stdout as i32,
                wire::OutputStream::Stderr as i32,
            ],
            max_bytes,
            page_token: token.clone(),
        };
        let page = store
            .get_output(&req)
            .map_err(|e| format!("GetOutput of {issue}: {e}"))?;
        for item in page.items {
            match item.item {
                Some(wire::output_item::Item::Data(d)) => {
                    let stream = stream_of(d.stream)
                        .ok_or_else(|| format!("GetOutput of {issue}: data of no stream"))?;
                    items.push(Served::Data {
                        stream,
                        bytes: d.data,
                    });
                }
                Some(wire::output_item::Item::Marker(m)) => match m.event.and_then(|e| e.body) {
                    Some(Body::Truncation(t)) => items.push(Served::Gap {
                        mask: mask_of(&t.streams),
                        raw: Some(t.raw_bytes),
                        source: t.source,
                    }),
                    Some(Body::Incomplete(_)) => items.push(Served::Incomplete),
                    _ => {}
                },
                Some(wire::output_item::Item::Retention(r)) => items.push(Served::Gap {
                    mask: mask_of(&r.streams),
                    raw: r.raw_bytes,
                    source: r.source,
                }),
                None => {}
            }
        }
        if page.next_page_token.is_empty() {
            return Ok(normalize(items));
        }
        token = page.next_page_token;
    }
    Err(format!("GetOutput of {issue} did not end"))
}

/// One event of the follow history, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryRead {
    /// The stream pair as served.
    pub served: Vec<Served>,
    /// Every event (sequence and body), in order.
    pub events: Vec<(u64, Body)>,
}

/// The follow history after `after`, batch after batch (the reads the
/// follow stream serves its history with).
///
/// # Errors
/// A refused read, an event that does not decode, or a read that does not
/// end.
pub fn read_history(store: &Store, issue: &Uuid7, after: u64) -> Result<HistoryRead, String> {
    let key = *issue.as_bytes();
    let mut cursor = after;
    let mut served = Vec::new();
    let mut events = Vec::new();
    for _ in 0..MAX_READS {
        let batch = store
            .events_after(&key, cursor, HISTORY_BATCH)
            .map_err(|e| format!("history of {issue}: {e}"))?;
        let mut caught_up = batch.is_empty();
        for item in batch {
            match item {
                HistoryItem::Event(ev) => {
                    cursor = ev.event_seq;
                    let w = ev
                        .to_wire(issue)
                        .map_err(|e| format!("history of {issue}: {e}"))?;
                    let Some(body) = w.event.and_then(|e| e.body) else {
                        continue;
                    };
                    match &body {
                        Body::Output(o) => {
                            let raw = usize::try_from(o.raw_length).unwrap_or(usize::MAX);
                            if raw > MAX_EVENT_RAW {
                                return Err(format!("{issue} event {cursor}: {raw} raw bytes"));
                            }
                            let bytes = zstd::bulk::decompress(&o.payload, raw)
                                .map_err(|e| format!("{issue} event {cursor}: {e}"))?;
                            let stream = stream_of(o.stream)
                                .ok_or_else(|| format!("{issue} event {cursor}: no stream"))?;
                            served.push(Served::Data { stream, bytes });
                        }
                        Body::Truncation(t) => served.push(Served::Gap {
                            mask: mask_of(&t.streams),
                            raw: Some(t.raw_bytes),
                            source: t.source,
                        }),
                        Body::Incomplete(_) => served.push(Served::Incomplete),
                        _ => {}
                    }
                    events.push((cursor, body));
                }
                HistoryItem::Retention(r) => served.push(Served::Gap {
                    mask: r.stream_mask,
                    raw: r.raw_bytes,
                    source: r.source as i32,
                }),
                HistoryItem::Reset(_) => {
                    return Err(format!(
                        "history of {issue} after {after}: the cursor was reset"
                    ));
                }
                HistoryItem::CaughtUp { .. } => caught_up = true,
            }
        }
        if caught_up {
            return Ok(HistoryRead {
                served: normalize(served),
                events,
            });
        }
    }
    Err(format!("history of {issue} did not end"))
}

/// The output oracle over both streams of one command: `served` (in event
/// order) against what the process wrote. `tail_may_miss`: the process
/// died with its daemon, so what it wrote after the last captured chunk
/// may be missing at the end. Returns the gaps' raw bytes.
///
/// Each stream's served bytes must be what the process wrote, in order,
/// each at a position where it follows: the runs skipped between them
/// (and at the end) are the missing runs. Every missing run must be
/// covered by records between its neighbours in the event order whose
/// streams include its stream, and every record must cover exactly its
/// raw byte count; a record of both streams may cover runs of both. The
/// runs are matched to the records by a maximum flow, which finds a
/// covering whenever one exists.
///
/// A short served chunk may occur at several positions of what was
/// written (a line prefix, a byte that recurs): the oracle accepts when
/// some choice of positions is covered, trying the earliest first and
/// backtracking (a bounded search; past the bound the first choice's
/// verdict stands).
///
/// # Errors
/// Where the served streams depart from what was written.
pub fn check_output(
    served: &[Served],
    wrote: &[Vec<u8>; 2],
    tail_may_miss: bool,
) -> Result<u64, String> {
    let mut gaps: Vec<(usize, u8, u64)> = Vec::new();
    let mut gap_bytes = 0u64;
    for (i, item) in served.iter().enumerate() {
        let Served::Gap { mask, raw, source } = item else {
            continue;
        };
        let Some(raw) = raw else {
            return Err(format!(
                "item {i}: a gap record (source {source}) without a byte count"
            ));
        };
        gap_bytes = gap_bytes.saturating_add(*raw);
        if *raw > 0 {
            gaps.push((i, *mask, *raw));
        }
    }
    let data: Vec<(usize, usize, &[u8])> = served
        .iter()
        .enumerate()
        .filter_map(|(i, item)| match item {
            Served::Data { stream, bytes } => Some((i, *stream, bytes.as_slice())),
            Served::Gap { .. } | Served::Incomplete => None,
        })
        .collect();
    let check = Coverage {
        wrote,
        gaps: &gaps,
        tail_may_miss,
    };
    // the skip the records explain before each item: the raw bytes of the
    // records of its stream between it and the previous item of its
    // stream (a placement that far ahead is tried first: a short chunk
    // that recurs every few bytes would otherwise take tens of thousands
    // of tries to reach it: seed 464922)
    let mut prefer: Vec<u64> = Vec::with_capacity(data.len());
    let mut prev: [Option<usize>; 2] = [None, None];
    for &(i, s, _) in &data {
        let after = prev.get(s).copied().flatten();
        let explained: u64 = gaps
            .iter()
            .filter(|g| g.1 & (1 << s) != 0 && after.is_none_or(|a| a < g.0) && g.0 < i)
            .map(|g| g.2)
            .sum();
        prefer.push(explained);
        if let Some(x) = prev.get_mut(s) {
            *x = Some(i);
        }
    }
    // depth-first over the positions of the data items: `starts[k]` is
    // where item k begins in its stream (`ascending[k]`: found by the scan
    // from the stream's position, not as the preferred place); `at` per
    // stream after each item
    let mut starts: Vec<usize> = Vec::with_capacity(data.len());
    let mut ascending: Vec<bool> = Vec::with_capacity(data.len());
    let mut at_after: Vec<[usize; 2]> = Vec::with_capacity(data.len());
    let mut first_error: Option<String> = None;
    let mut budget: u32 = 20_000;
    // where the next try for item `starts.len()` resumes: `None` first
    // (the preferred place, then the scan), `Some(None)` the scan from the
    // stream's position, `Some(Some(p))` the scan from `p`
    let mut resume: Option<Option<usize>> = None;
    loop {
        let k = starts.len();
        if k == data.len() {
            match check.verdict(&data, &starts, true) {
                Ok(()) => return Ok(gap_bytes),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        } else if let Some(&(i, s, bytes)) = data.get(k) {
            let at = at_after.last().copied().unwrap_or([0, 0]);
            let here = at.get(s).copied().unwrap_or(0);
            let w = wrote.get(s).map(Vec::as_slice).unwrap_or_default();
            let skip = prefer.get(k).copied().unwrap_or(0);
            let preferred = usize::try_from(skip)
                .ok()
                .filter(|x| *x > 0)
                .and_then(|x| here.checked_add(x))
                .filter(|p| w.get(*p..).is_some_and(|r| r.starts_with(bytes)));
            let (scan, lo) = match resume.take() {
                None if preferred.is_some() => (false, here),
                None | Some(None) => (true, here),
                Some(Some(lo)) => (true, lo),
            };
            let found = if !scan {
                preferred
            } else if bytes.is_empty() && lo != here {
                // an empty chunk has one place only
                None
            } else {
                match find_at_or_after(w, bytes, lo) {
                    // the preferred place was tried already
                    Some(p) if Some(p) == preferred => find_at_or_after(w, bytes, p + 1),
                    f => f,
                }
            };
            match found {
                Some(p) => {
                    starts.push(p);
                    ascending.push(scan);
                    let mut next = at;
                    if let Some(a) = next.get_mut(s) {
                        *a = p + bytes.len();
                    }
                    at_after.push(next);
                    // a new missing run before this item: the runs so far
                    // must still be coverable
                    if p == here {
                        continue;
                    }
                    match check.verdict(&data, &starts, false) {
                        Ok(()) => continue,
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                None if scan && lo == here && preferred.is_none() => {
                    first_error.get_or_insert(format!(
                        "item {i}: {} bytes of {} served after offset {here} are not anywhere in what the process wrote after it (invented, duplicated or reordered)",
                        bytes.len(),
                        stream_name(s)
                    ));
                }
                None => {}
            }
        }
        // backtrack: the deepest item to its next position
        budget = budget.saturating_sub(1);
        if budget == 0 {
            break;
        }
        let Some(p) = starts.pop() else {
            break;
        };
        at_after.pop();
        resume = Some(if ascending.pop().unwrap_or(true) {
            Some(p + 1)
        } else {
            None
        });
    }
    Err(first_error.unwrap_or_else(|| "no placement of the served output found".to_string()))
}

fn stream_name(s: usize) -> &'static str {
    if s == 0 { "stdout" } else { "stderr" }
}

/// The first position at or after `lo` where `bytes` occurs in `w`.
fn find_at_or_after(w: &[u8], bytes: &[u8], lo: usize) -> Option<usize> {
    let rest = w.get(lo..)?;
    if rest.starts_with(bytes) {
        return Some(lo);
    }
    if bytes.is_empty() {
        return None;
    }
    rest.windows(bytes.len())
        .position(|win| win == bytes)
        .map(|p| lo + p)
}

/// The covering check of one placement of the served data items.
struct Coverage<'a> {
    wrote: &'a [Vec<u8>; 2],
    gaps: &'a [(usize, u8, u64)],
    tail_may_miss: bool,
}

impl Coverage<'_> {
    /// Whether the missing runs of the placement `starts` (of the first
    /// `starts.len()` data items) are covered. `complete`: every item is
    /// placed, so the tails and the records' exact counts are checked too.
    fn verdict(
        &self,
        data: &[(usize, usize, &[u8])],
        starts: &[usize],
        complete: bool,
    ) -> Result<(), String> {
        struct Run {
            stream: usize,
            left: u64,
            after: Option<usize>,
            before: usize,
            tail: bool,
        }
        let mut runs: Vec<Run> = Vec::new();
        let mut at = [0usize; 2];
        let mut last_data: [Option<usize>; 2] = [None, None];
        for (&(i, s, bytes), &p) in data.iter().zip(starts) {
            let here = at.get(s).copied().unwrap_or(0);
            if p > here {
                runs.push(Run {
                    stream: s,
                    left: (p - here) as u64,
                    after: last_data.get(s).copied().flatten(),
                    before: i,
                    tail: false,
                });
            }
            if let Some(a) = at.get_mut(s) {
                *a = p + bytes.len();
            }
            if let Some(l) = last_data.get_mut(s) {
                *l = Some(i);
            }
        }
        if complete {
            for s in 0..2 {
                let w = self.wrote.get(s).map_or(0, Vec::len);
                let here = at.get(s).copied().unwrap_or(0);
                if w > here {
                    runs.push(Run {
                        stream: s,
                        left: (w - here) as u64,
                        after: last_data.get(s).copied().flatten(),
                        before: usize::MAX,
                        tail: true,
                    });
                }
            }
        }
        // which record may cover which run: one of its streams, between
        // the run's neighbours in the event order
        let fits = |g: &(usize, u8, u64), r: &Run| {
            g.1 & (1 << r.stream) != 0 && r.after.is_none_or(|a| a < g.0) && g.0 < r.before
        };
        let mut flow = Flow::new(self.gaps.len(), runs.len());
        for (gi, g) in self.gaps.iter().enumerate() {
            flow.source_edge(gi, g.2);
            for (ri, r) in runs.iter().enumerate() {
                if fits(g, r) {
                    flow.link(gi, ri);
                }
            }
        }
        // the runs between served bytes first: each must be covered whole
        for (ri, r) in runs.iter().enumerate() {
            if !r.tail {
                flow.sink_edge(ri, r.left);
            }
        }
        flow.run();
        for (ri, r) in runs.iter().enumerate() {
            if !r.tail && flow.flow_into_sink(ri) < r.left {
                return Err(format!(
                    "a run of {} bytes of {} before item {} is covered by no record",
                    r.left - flow.flow_into_sink(ri),
                    stream_name(r.stream),
                    r.before
                ));
            }
        }
        if !complete {
            return Ok(());
        }
        // then the tails: covered whole unless the process died under them
        for (ri, r) in runs.iter().enumerate() {
            if r.tail {
                flow.sink_edge(ri, r.left);
            }
        }
        flow.run();
        for (ri, r) in runs.iter().enumerate() {
            if r.tail && !self.tail_may_miss && flow.flow_into_sink(ri) < r.left {
                return Err(format!(
                    "the last {} bytes the process wrote on {} vanished without a record",
                    r.left - flow.flow_into_sink(ri),
                    stream_name(r.stream)
                ));
            }
        }
        for (gi, g) in self.gaps.iter().enumerate() {
            let used = flow.out_of_source(gi);
            if used < g.2 {
                return Err(format!(
                    "item {}: a record (streams {}) counts {} more bytes than went missing around it",
                    g.0,
                    g.1,
                    g.2 - used
                ));
            }
        }
        Ok(())
    }
}

/// A small maximum flow from the gap records (their raw bytes) to the
/// missing runs (their lengths): Edmonds-Karp over an adjacency matrix,
/// enough for the tens of records and runs of one command.
struct Flow {
    gaps: usize,
    runs: usize,
    cap: Vec<Vec<u64>>,
}

impl Flow {
    fn new(gaps: usize, runs: usize) -> Self {
        let n = gaps + runs + 2;
        Self {
            gaps,
            runs,
            cap: vec![vec![0; n]; n],
        }
    }

    fn source(&self) -> usize {
        self.gaps + self.runs
    }

    fn sink(&self) -> usize {
        self.gaps + self.runs + 1
    }

    fn set(&mut self, a: usize, b: usize, c: u64) {
        if let Some(x) = self.cap.get_mut(a).and_then(|row| row.get_mut(b)) {
            *x = c;
        }
    }

    fn get(&self, a: usize, b: usize) -> u64 {
        self.cap
            .get(a)
            .and_then(|row| row.get(b))
            .copied()
            .unwrap_or(0)
    }

    fn source_edge(&mut self, g: usize, c: u64) {
        let s = self.source();
        self.set(s, g, c);
    }

    fn link(&mut self, g: usize, r: usize) {
        self.set(g, self.gaps + r, u64::MAX);
    }

    fn sink_edge(&mut self, r: usize, c: u64) {
        let t = self.sink();
        self.set(self.gaps + r, t, c);
    }

    /// The flow into the sink from run `r` (the reverse capacity).
    fn flow_into_sink(&self, r: usize) -> u64 {
        self.get(self.sink(), self.gaps + r)
    }

    /// The flow out of the source into gap `g`.
    fn out_of_source(&self, g: usize) -> u64 {
        self.get(g, self.source())
    }

    fn run(&mut self) {
        let n = self.cap.len();
        let (s, t) = (self.source(), self.sink());
        loop {
            let mut prev = vec![usize::MAX; n];
            if let Some(p) = prev.get_mut(s) {
                *p = s;
            }
            let mut queue = std::collections::VecDeque::from([s]);
            while let Some(u) = queue.pop_front() {
                for v in 0..n {
                    if prev.get(v) == Some(&usize::MAX) && self.get(u, v) > 0 {
                        if let Some(p) = prev.get_mut(v) {
                            *p = u;
                        }
                        queue.push_back(v);
                    }
                }
            }
            if prev.get(t) == Some(&usize::MAX) {
                return;
            }
            let mut push = u64::MAX;
            let mut v = t;
            while v != s {
                let u = prev.get(v).copied().unwrap_or(s);
                push = push.min(self.get(u, v));
                v = u;
            }
            let mut v = t;
            while v != s {
                let u = prev.get(v).copied().unwrap_or(s);
                let fwd = self.get(u, v);
                self.set(u, v, fwd - push);
                let back = self.get(v, u);
                self.set(v, u, back.saturating_add(push));
                v = u;
            }
        }
    }
}

/// What the world knows the operator asked for, per command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requests {
    /// The client id each command was addressed to.
    pub client: BTreeMap<[u8; 16], String>,
    /// Stdin writes the server acknowledged to the operator, by write
    /// sequence: the bytes the process must get, and whether the write
    /// closes stdin (the close is a write of no bytes).
    pub stdin: BTreeMap<[u8; 16], Vec<AckedWrite>>,
    /// `SignalCommand` requests the server answered, per command: the
    /// kinds, one per distinct request.
    pub signals: BTreeMap<[u8; 16], Vec<wire::SignalKind>>,
}

/// One acknowledged stdin write: its sequence, its bytes, and whether it
/// closes stdin (the close is a write of no bytes).
pub type AckedWrite = (u64, Vec<u8>, bool);

/// Counters of one oracle pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OracleCounts {
    /// Commands whose output was compared.
    pub output_commands: u64,
    /// Bytes compared.
    pub output_bytes: u64,
    /// Bytes the records said were missing.
    pub gap_bytes: u64,
    /// Exit outcomes compared.
    pub exits: u64,
    /// Stdin writes compared.
    pub stdin_writes: u64,
    /// Ends of file seen.
    pub eofs: u64,
    /// Signals compared.
    pub signals: u64,
    /// Reads from a random cursor compared.
    pub cursor_reads: u64,
}

fn expected_outcome(
    record: &ProcessRecord,
    operator_signal_delivered: bool,
) -> Option<(Lifecycle, Option<i32>, Option<i32>)> {
    match record.ended? {
        Ended::WithDaemon | Ended::Stopped => Some((Lifecycle::Interrupted, None, None)),
        Ended::Aborted => None,
        Ended::Exit(e) => Some(match (e, operator_signal_delivered) {
            (Exit::Code(0), false) => (Lifecycle::Succeeded, Some(0), None),
            (Exit::Code(c), false) => (Lifecycle::Failed, Some(c), None),
            (Exit::Code(c), true) => (Lifecycle::Terminated, Some(c), None),
            (Exit::Signal(n), true) => (Lifecycle::Terminated, None, Some(n)),
            (Exit::Signal(n), false) => (Lifecycle::Failed, None, Some(n)),
        }),
    }
}

fn late_after_expiry(store: &Store, id: &[u8; 16]) -> bool {
    use rvbox_store::db::Cached as _;
    store
        .db()
        .query_row_cached(
            "SELECT EXISTS (SELECT 1 FROM storage_incidents WHERE issue_uuid = ?1 AND kind = ?2)",
            rusqlite_params(id),
            |r| r.get::<_, bool>(0),
        )
        .unwrap_or(false)
}

fn rusqlite_params(id: &[u8; 16]) -> (&[u8], i32) {
    (id.as_slice(), wire::IncidentKind::LateAfterExpiry as i32)
}

/// Checks one terminal command; returns the problems.
pub fn check_command(
    store: &Store,
    log: &ProcessLog,
    requests: &Requests,
    hosts: &[String],
    id: &[u8; 16],
    rng: &mut SimRng,
    counts: &mut OracleCounts,
) -> Vec<String> {
    let mut problems = Vec::new();
    let Ok(issue) = Uuid7::from_bytes("issue_uuid", *id) else {
        return problems;
    };
    let Ok(view) = store.command_view(id) else {
        // reclaimed by retention: nothing left to compare
        return problems;
    };
    let record = log.get(&issue);
    let history = match read_history(store, &issue, 0) {
        Ok(h) => h,
        Err(e) => {
            problems.push(e);
            return problems;
        }
    };
    // the same reads must agree: GetOutput pages and the follow history
    match read_get_output(store, &issue, rng) {
        Ok(pages) if pages != history.served => problems.push(format!(
            "{issue}: GetOutput serves other output than the follow history ({} against {} items)",
            pages.len(),
            history.served.len()
        )),
        Ok(_) => {}
        Err(e) => problems.push(e),
    }
    if let Some(last) = history.events.last().map(|(s, _)| *s)
        && last > 0
    {
        let r = rng.range_inclusive(0..=last);
        counts.cursor_reads += 1;
        match read_history(store, &issue, r) {
            Ok(from) => {
                let want: Vec<&(u64, Body)> =
                    history.events.iter().filter(|(s, _)| *s > r).collect();
                let got: Vec<&(u64, Body)> = from.events.iter().collect();
                if want != got {
                    problems.push(format!(
                        "{issue}: the history after event {r} is not the rest of the history from the start"
                    ));
                }
            }
            Err(e) => problems.push(e),
        }
    }
    let terminal_change = history.events.iter().rev().find_map(|(_, b)| match b {
        Body::Lifecycle(l)
            if Lifecycle::from_wire(l.lifecycle).is_ok_and(Lifecycle::is_terminal) =>
        {
            Some(l.clone())
        }
        _ => None,
    });
    let Some(record) = record else {
        // never released: no user code ran, nothing was written
        if let Some(l) = &terminal_change
            && let Some(x) = &l.exit_result
            && (x.exit_code.is_some() || x.signal_number.is_some())
        {
            problems.push(format!(
                "{issue}: an exit result for a command whose process never ran"
            ));
        }
        return problems;
    };
    // the client it was addressed to ran it
    let ran_on = hosts.get(usize::try_from(record.host).unwrap_or(usize::MAX));
    if ran_on != Some(&view.client_id) {
        problems.push(format!(
            "{issue}: addressed to {} but ran on {}",
            view.client_id,
            ran_on.map_or("an unknown host", String::as_str)
        ));
    }
    if record.starts > 1 {
        problems.push(format!(
            "{issue}: its process started {} times",
            record.starts
        ));
    }
    // output
    let tail_may_miss = matches!(record.ended, Some(Ended::WithDaemon) | None);
    counts.output_commands += 1;
    counts.output_bytes += record.wrote.iter().map(|w| w.len() as u64).sum::<u64>();
    match check_output(&history.served, &record.wrote, tail_may_miss) {
        Ok(g) => counts.gap_bytes += g,
        Err(e) => {
            if std::env::var_os("RVBOX_SIM_DEBUG").is_some() {
                for (k, it) in history.served.iter().enumerate() {
                    match it {
                        Served::Data { stream, bytes } => eprintln!(
                            "  {k}: data s{stream} {} {:?}",
                            bytes.len(),
                            bytes.get(..bytes.len().min(8))
                        ),
                        other => eprintln!("  {k}: {other:?}"),
                    }
                }
                eprintln!(
                    "  wrote {} / {}; dropped {:?}; ended {:?}",
                    record.wrote[0].len(),
                    record.wrote[1].len(),
                    record.dropped,
                    record.ended
                );
                eprintln!(
                    "  wrote0 {:?} wrote1 {:?}",
                    record.wrote[0].get(..record.wrote[0].len().min(8)),
                    record.wrote[1].get(..record.wrote[1].len().min(8))
                );
            }
            problems.push(format!("{issue} output: {e}"))
        }
    }
    let asked = requests.signals.get(id).cloned().unwrap_or_default();
    let operator_delivered = check_signals(
        &issue,
        &history.events,
        record,
        &asked,
        late_after_expiry(store, id),
        counts,
        &mut problems,
    );
    check_exit(
        &issue,
        record,
        operator_delivered,
        view.lifecycle,
        terminal_change.as_ref(),
        || {
            rvbox_store::records::command_record(store.db(), &store.health(), id)
                .ok()
                .and_then(|r| r.exit_result)
        },
        counts,
        &mut problems,
    );
    let truth = requests.stdin.get(id).cloned().unwrap_or_default();
    check_stdin(
        &issue,
        &truth,
        &history.events,
        record,
        counts,
        &mut problems,
    );
    problems
}

/// The signal oracle: each kind reached the process at most as often as
/// the operator's requests (and the server's own TERM after a late
/// acceptance, `late_after_expiry`) asked for it, beyond the daemon's
/// orderly stop; the stored results count no more than the requests, and
/// say delivered exactly as often as it reached the process (less the
/// results a dying daemon had not made durable). Returns whether an
/// operator's signal reached the process.
pub fn check_signals(
    issue: &Uuid7,
    events: &[(u64, Body)],
    record: &ProcessRecord,
    asked: &[wire::SignalKind],
    late_after_expiry: bool,
    counts: &mut OracleCounts,
    problems: &mut Vec<String>,
) -> bool {
    // signals: what was delivered, against the stored results
    let mut results: BTreeMap<i32, (u64, u64)> = BTreeMap::new();
    for (_, b) in events {
        if let Body::SignalResult(s) = b {
            let e = results.entry(s.signal).or_default();
            e.0 += 1;
            if s.outcome == wire::SignalOutcome::Delivered as i32 {
                e.1 += 1;
            }
        }
    }
    let mut asked = asked.to_vec();
    // plan §6.4: a late acceptance after the queue expiry is answered by
    // the server itself with a best-effort TERM (its incident says so)
    if late_after_expiry {
        asked.push(wire::SignalKind::Term);
    }
    let mut operator_delivered = false;
    for kind in [
        wire::SignalKind::Hup,
        wire::SignalKind::Int,
        wire::SignalKind::Term,
        wire::SignalKind::Kill,
        wire::SignalKind::Usr1,
        wire::SignalKind::Usr2,
    ] {
        let delivered = record.signals.iter().filter(|k| **k == kind).count() as u64;
        let by_stop = record.stop_signals.iter().filter(|k| **k == kind).count() as u64;
        let by_operator = delivered.saturating_sub(by_stop);
        let (stored, stored_delivered) = results.get(&(kind as i32)).copied().unwrap_or_default();
        let requested = asked.iter().filter(|k| **k == kind).count() as u64;
        counts.signals += delivered;
        if stored > requested {
            problems.push(format!(
                "{issue}: {stored} results of {} for {requested} requests",
                kind.as_str_name()
            ));
        }
        if by_operator > requested {
            problems.push(format!(
                "{issue}: {} reached the process {by_operator} times for {requested} requests",
                kind.as_str_name()
            ));
        }
        // results lost with a daemon that died before they were durable
        let lost = u64::from(record.signals_unrecorded);
        if stored_delivered > by_operator || stored_delivered.saturating_add(lost) < by_operator {
            problems.push(format!(
                "{issue}: {} reached the process {by_operator} times, the stored results say delivered {stored_delivered} times",
                kind.as_str_name()
            ));
        }
        operator_delivered |= by_operator > 0;
    }
    operator_delivered
}

/// The exit oracle: the terminal outcome, exit code or signal the server
/// stores (in the terminal event, and in what `GetCommand` serves:
/// `get_command_exit`) is what the process did, unless the server ended
/// the command itself (`INTERRUPTED` with no terminal change from a
/// client, or a client that lost the end in a crash).
#[allow(clippy::too_many_arguments)]
pub fn check_exit(
    issue: &Uuid7,
    record: &ProcessRecord,
    operator_delivered: bool,
    server: Lifecycle,
    terminal_change: Option<&wire::LifecycleChange>,
    get_command_exit: impl FnOnce() -> Option<wire::ExitResult>,
    counts: &mut OracleCounts,
    problems: &mut Vec<String>,
) {
    // exit
    if let Some((lifecycle, code, signal)) = expected_outcome(record, operator_delivered) {
        counts.exits += 1;
        let reported = terminal_change.as_ref().and_then(|l| l.exit_result.clone());
        // the server ended it (no terminal change from a client), or the
        // client lost the end in a crash before it was durable
        let explained_by_server = server == Lifecycle::Interrupted
            && (terminal_change.is_none() || record.end_unrecorded);
        if !explained_by_server {
            if server != lifecycle {
                problems.push(format!(
                    "{issue}: the process {:?} but the server says {}",
                    record.ended,
                    server.as_str()
                ));
            } else if lifecycle != Lifecycle::Interrupted
                && reported
                    .as_ref()
                    .is_none_or(|x| x.exit_code != code || x.signal_number != signal)
            {
                problems.push(format!(
                    "{issue}: the process {:?} but the stored exit result is {reported:?}",
                    record.ended
                ));
            } else if lifecycle != Lifecycle::Interrupted {
                // and what GetCommand serves (`rvc stat`), from the
                // command's row
                let served = get_command_exit();
                if served
                    .as_ref()
                    .is_none_or(|x| x.exit_code != code || x.signal_number != signal)
                {
                    problems.push(format!(
                        "{issue}: the process {:?} but GetCommand serves the exit result {served:?}",
                        record.ended
                    ));
                }
            }
        }
    }
}

/// The stdin oracle: the process got the acknowledged writes (`truth`),
/// contiguous from 1, once each, in order, with exactly their bytes; a
/// write acknowledged written reached it, and one it got is acknowledged
/// written (a daemon that died may leave a suffix unconfirmed); it read
/// end of file once, exactly when the close was acknowledged.
pub fn check_stdin(
    issue: &Uuid7,
    truth: &[AckedWrite],
    events: &[(u64, Body)],
    record: &ProcessRecord,
    counts: &mut OracleCounts,
    problems: &mut Vec<String>,
) {
    // stdin
    let mut acks: BTreeMap<u64, (i32, bool)> = BTreeMap::new();
    for (_, b) in events {
        if let Body::StdinAck(a) = b
            && acks.insert(a.write_seq, (a.delivery, a.closed)).is_some()
        {
            problems.push(format!("{issue}: write {} acknowledged twice", a.write_seq));
        }
    }
    // the writes the process got: contiguous from 1, once each, in order,
    // and their bytes exactly those acknowledged
    let got = &record.stdin_writes;
    counts.stdin_writes += got.len() as u64;
    let contiguous = got.iter().enumerate().all(|(k, s)| *s == k as u64 + 1);
    if !contiguous || got.len() > truth.len() {
        problems.push(format!(
            "{issue}: the process got stdin writes {got:?} of the {} acknowledged (each once, in order, from 1)",
            truth.len()
        ));
    } else {
        let bytes: Vec<u8> = truth
            .iter()
            .take(got.len())
            .flat_map(|(_, b, _)| b.iter().copied())
            .collect();
        if bytes != record.stdin {
            problems.push(format!(
                "{issue}: the process read {} stdin bytes other than the {} of the writes it got",
                record.stdin.len(),
                bytes.len()
            ));
        }
    }
    // a daemon that died between giving a write to the process and making
    // its acknowledgement durable leaves that write, and every later one,
    // reported otherwise than written: only a suffix of what the process
    // got may be unconfirmed, and only then
    let died = matches!(record.ended, Some(Ended::WithDaemon));
    let mut unconfirmed_from: Option<u64> = None;
    for (seq, data, close) in truth {
        let written = acks
            .get(seq)
            .is_some_and(|(d, _)| *d == wire::StdinDelivery::Written as i32);
        let received = got.contains(seq);
        // a close of no bytes reaches the process as its end of file
        if *close && data.is_empty() {
            continue;
        }
        if written && !received {
            problems.push(format!(
                "{issue}: write {seq} acknowledged written but the process never got it"
            ));
        } else if received && !written {
            if !died {
                problems.push(format!(
                    "{issue}: the process got write {seq} but it is not acknowledged written"
                ));
            }
            unconfirmed_from.get_or_insert(*seq);
        } else if written && let Some(from) = unconfirmed_from {
            problems.push(format!(
                "{issue}: write {seq} acknowledged written after write {from} was not"
            ));
        }
    }
    let close = truth.iter().find(|(_, _, c)| *c).map(|(s, _, _)| *s);
    let closed_ack = close.is_some_and(|s| {
        acks.get(&s)
            .is_some_and(|(d, c)| *d == wire::StdinDelivery::Written as i32 && *c)
    });
    counts.eofs += u64::from(record.eofs);
    if record.eofs > 1 {
        problems.push(format!(
            "{issue}: the process read end of file {} times",
            record.eofs
        ));
    }
    if (record.eofs == 1) != closed_ack && !(died && record.eofs == 1) {
        problems.push(format!(
            "{issue}: end of file read {} times, the close acknowledged {closed_ack}",
            record.eofs
        ));
    }
}
