//! Terminal viewers and recordings, served from the store's copy of a
//! terminal (docs/terminals.md).
//!
//! A viewer (`AttachPtySession`) gets exactly the output bytes after its
//! `from_offset`, in order, from the recording the server keeps of every
//! open terminal, then live output as the store commits it, until the
//! terminal closes. Where the recording lost bytes (the client's ring had
//! moved on, or the recording was trimmed to its cap) the viewer gets a
//! `PtyCut` naming the lost range before the bytes that follow it: the
//! output is exact, or it carries its marker.
//!
//! A recording (`ReadPtyRecording`) is the same records as an asciicast
//! v2 document: output, input, resizes, and a marker where output was
//! lost.
//!
//! Must never: act on the terminal (a stream that stops only stops
//! reading), or send a byte twice or out of order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use rvbox_store_port::pty::{PtyRecord, PtyRecordKind, viewer_end_cut, viewer_items};
use rvbox_terminal::asciicast::{Header, Recorder};
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::control::{FOLLOW_POLL, Readers, status};

/// Record bytes one read of a viewer or a recording takes.
pub(crate) const PTY_READ_BYTES: usize = 1024 * 1024;
/// Largest piece of a recording stream (the proto allows 1 MiB).
pub(crate) const RECORDING_PIECE_BYTES: usize = 256 * 1024;
/// Terminals whose viewers are counted at once (the server's terminal
/// bound is far below).
pub(crate) const MAX_COUNTED_TERMINALS: usize = 65_536;

/// Viewers attached to each terminal on this server.
#[derive(Debug, Default)]
pub(crate) struct Viewers {
    map: Mutex<HashMap<[u8; 16], u32>>,
}

impl Viewers {
    /// The viewers of `id`.
    pub(crate) fn of(&self, id: &[u8; 16]) -> u32 {
        self.map
            .lock()
            .ok()
            .and_then(|m| m.get(id).copied())
            .unwrap_or(0)
    }

    /// Counts one viewer of `id` until the guard drops.
    pub(crate) fn enter(self: &Arc<Self>, id: [u8; 16]) -> ViewerGuard {
        if let Ok(mut m) = self.map.lock()
            && (m.len() < MAX_COUNTED_TERMINALS || m.contains_key(&id))
        {
            *m.entry(id).or_insert(0) += 1;
        }
        ViewerGuard {
            viewers: Arc::clone(self),
            id,
        }
    }

    /// Fills `viewers` of each session.
    pub(crate) fn fill(&self, sessions: &mut [wire::PtySessionInfo]) {
        for s in sessions {
            if let Ok(u) = rvbox_domain::ids::Uuid7::parse("pty_session_id", &s.pty_session_id) {
                s.viewers = self.of(u.as_bytes());
            }
        }
    }
}

/// One counted viewer.
#[derive(Debug)]
pub(crate) struct ViewerGuard {
    viewers: Arc<Viewers>,
    id: [u8; 16],
}

impl Drop for ViewerGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = self.viewers.map.lock()
            && let Some(n) = m.get_mut(&self.id)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.id);
            }
        }
    }
}

/// One `AttachPtySession` stream.
pub(crate) struct PtyViewer {
    pub(crate) readers: Arc<Readers>,
    pub(crate) changes: watch::Receiver<u64>,
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) id: [u8; 16],
    /// The next output offset the viewer needs.
    pub(crate) want: u64,
    pub(crate) tx: mpsc::Sender<Result<wire::AttachPtySessionResponse, Status>>,
    pub(crate) viewers: Arc<Viewers>,
}

impl PtyViewer {
    async fn send(&self, item: wire::attach_pty_session_response::Item) -> bool {
        self.tx
            .send(Ok(wire::AttachPtySessionResponse { item: Some(item) }))
            .await
            .is_ok()
    }

    async fn restarting(&self) {
        let _ = self
            .tx
            .send(Err(status(&DomainError::new(
                Code::Unavailable,
                "rvbox-server is restarting; attach again from the last offset received",
            ))))
            .await;
    }

    /// Streams until the terminal closed and every byte was sent, the
    /// viewer left, or the server stops. Returns the offset reached.
    pub(crate) async fn run(mut self) -> u64 {
        let _counted = self.viewers.enter(self.id);
        let mut cursor = 0u64;
        loop {
            if *self.stop.borrow() {
                self.restarting().await;
                return self.want;
            }
            let _ = self.changes.borrow_and_update();
            let id = self.id;
            let read = self
                .readers
                .read(move |r| {
                    let records = r.pty_records(&id, cursor, PTY_READ_BYTES)?;
                    // the state after the records: a close seen here has
                    // every output record before it
                    let info = if records.is_empty() {
                        Some(r.pty_session(&id)?)
                    } else {
                        None
                    };
                    Ok((records, info))
                })
                .await;
            let (records, info) = match read {
                Ok(r) => r,
                Err(s) => {
                    let _ = self.tx.send(Err(s)).await;
                    return self.want;
                }
            };
            for record in &records {
                cursor = record.rec_seq;
                let (items, want) = viewer_items(self.want, record);
                self.want = want;
                for item in items {
                    if !self.send(item).await {
                        return self.want;
                    }
                }
            }
            if let Some(mut info) = info {
                if info.state == wire::PtyState::Closed as i32 {
                    // the client's last bytes were never recorded
                    if let Some(cut) = viewer_end_cut(self.want, info.output_offset) {
                        let cut = wire::attach_pty_session_response::Item::Cut(cut);
                        if !self.send(cut).await {
                            return self.want;
                        }
                        self.want = info.output_offset;
                    }
                    info.viewers = self.viewers.of(&self.id);
                    let _ = self
                        .send(wire::attach_pty_session_response::Item::Closed(info))
                        .await;
                    return self.want;
                }
                let mut stopping = false;
                tokio::select! {
                    _ = self.changes.changed() => {}
                    () = tokio::time::sleep(FOLLOW_POLL) => {}
                    () = self.tx.closed() => return self.want,
                    _ = self.stop.wait_for(|s| *s) => stopping = true,
                }
                if stopping {
                    self.restarting().await;
                    return self.want;
                }
            }
        }
    }
}

/// The asciicast lines of one record (record times count from the
/// terminal's open).
pub(crate) fn recording_lines(rec: &mut Recorder, record: &PtyRecord) -> String {
    match record.kind {
        PtyRecordKind::Output { .. } => rec.output(record.at_ms, &record.data).unwrap_or_default(),
        PtyRecordKind::Input { .. } => rec.input(record.at_ms, &record.data).unwrap_or_default(),
        PtyRecordKind::Resize { cols, rows } => rec.resize(
            record.at_ms,
            u16::try_from(cols).unwrap_or(u16::MAX),
            u16::try_from(rows).unwrap_or(u16::MAX),
        ),
        PtyRecordKind::Cut { from, to } => rec.cut(record.at_ms, to.saturating_sub(from)),
    }
}

/// One `ReadPtyRecording` stream: the header (the size at open: the
/// recording's first record), then the lines of every record kept, in
/// pieces of whole lines.
pub(crate) async fn stream_recording(
    readers: Arc<Readers>,
    id: [u8; 16],
    info: wire::PtySessionInfo,
    tx: mpsc::Sender<Result<wire::ReadPtyRecordingResponse, Status>>,
) {
    let mut rec = Recorder::new(0);
    let mut piece = Vec::new();
    let mut cursor = 0u64;
    let mut last_ms = 0u64;
    let mut header = Some(Header {
        width: u16::try_from(info.cols).unwrap_or(u16::MAX),
        height: u16::try_from(info.rows).unwrap_or(u16::MAX),
        timestamp: info.opened_time.map_or(0, |t| t.seconds),
        title: Some(format!(
            "terminal {} on {}",
            info.pty_session_id, info.client_id
        )),
    });
    loop {
        let read = readers
            .read(move |r| r.pty_records(&id, cursor, PTY_READ_BYTES))
            .await;
        let records = match read {
            Ok(r) => r,
            Err(s) => {
                let _ = tx.send(Err(s)).await;
                return;
            }
        };
        if records.is_empty() {
            break;
        }
        for record in &records {
            cursor = record.rec_seq;
            last_ms = last_ms.max(record.at_ms);
            if let Some(mut h) = header.take() {
                if let (1, PtyRecordKind::Resize { cols, rows }) = (record.rec_seq, record.kind) {
                    h.width = u16::try_from(cols).unwrap_or(u16::MAX);
                    h.height = u16::try_from(rows).unwrap_or(u16::MAX);
                    piece.extend_from_slice(h.line().as_bytes());
                    continue;
                }
                piece.extend_from_slice(h.line().as_bytes());
            }
            piece.extend_from_slice(recording_lines(&mut rec, record).as_bytes());
            if piece.len() >= RECORDING_PIECE_BYTES {
                let out = std::mem::take(&mut piece);
                if tx
                    .send(Ok(wire::ReadPtyRecordingResponse { asciicast: out }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
    if let Some(h) = header.take() {
        piece.extend_from_slice(h.line().as_bytes());
    }
    if let Some(rest) = rec.finish(last_ms) {
        piece.extend_from_slice(rest.as_bytes());
    }
    if !piece.is_empty() {
        let _ = tx
            .send(Ok(wire::ReadPtyRecordingResponse { asciicast: piece }))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::attach_pty_session_response::Item;

    fn out(offset: u64, data: &[u8]) -> PtyRecord {
        PtyRecord {
            rec_seq: 1,
            at_ms: 0,
            kind: PtyRecordKind::Output { offset },
            data: data.to_vec(),
        }
    }

    /// What a viewer from `from` gets over `records`: the bytes with
    /// their offsets, and the cuts.
    fn view(from: u64, records: &[PtyRecord]) -> (Vec<u8>, Vec<(u64, u64)>) {
        let mut want = from;
        let mut bytes = Vec::new();
        let mut cuts: Vec<(u64, u64)> = Vec::new();
        let mut expect = from;
        for r in records {
            let (items, next) = viewer_items(want, r);
            for i in items {
                match i {
                    Item::Output(o) => {
                        assert_eq!(o.offset, expect, "contiguous or marked");
                        assert!(o.data.len() <= rvbox_store_port::pty::VIEWER_ITEM_BYTES);
                        expect = o.offset + o.data.len() as u64;
                        bytes.extend_from_slice(&o.data);
                    }
                    Item::Cut(c) => {
                        assert_eq!(c.requested_offset, expect);
                        expect = c.ring_start_offset;
                        cuts.push((c.requested_offset, c.ring_start_offset));
                    }
                    Item::Closed(_) => unreachable!(),
                }
            }
            want = next;
        }
        (bytes, cuts)
    }

    #[test]
    fn a_viewer_gets_exactly_the_bytes_after_its_offset() {
        let records = [out(0, b"hello "), out(6, b"world"), out(11, b"!")];
        assert_eq!(view(0, &records).0, b"hello world!");
        assert_eq!(view(3, &records).0, b"lo world!");
        assert_eq!(view(6, &records).0, b"world!");
        assert_eq!(view(12, &records).0, b"");
        assert!(view(3, &records).1.is_empty());
    }

    #[test]
    fn lost_bytes_are_marked_never_silent() {
        // trimmed: the first record kept starts at 100
        let (bytes, cuts) = view(10, &[out(100, b"abc")]);
        assert_eq!(bytes, b"abc");
        assert_eq!(cuts, vec![(10, 100)]);
        // a cut record inside the recording
        let cut = PtyRecord {
            rec_seq: 2,
            at_ms: 0,
            kind: PtyRecordKind::Cut { from: 3, to: 50 },
            data: Vec::new(),
        };
        let (bytes, cuts) = view(0, &[out(0, b"abc"), cut.clone(), out(50, b"xyz")]);
        assert_eq!(bytes, b"abcxyz");
        assert_eq!(cuts, vec![(3, 50)]);
        // a viewer past the cut sees no marker
        let (bytes, cuts) = view(51, &[out(0, b"abc"), cut, out(50, b"xyz")]);
        assert_eq!(bytes, b"yz");
        assert!(cuts.is_empty());
    }

    #[test]
    fn a_large_record_goes_in_bounded_items() {
        let big = vec![b'x'; rvbox_store_port::pty::VIEWER_ITEM_BYTES * 2 + 5];
        let (bytes, _) = view(1, &[out(0, &big)]);
        assert_eq!(bytes.len(), big.len() - 1);
    }

    #[test]
    fn viewers_are_counted_while_attached() {
        let v = Arc::new(Viewers::default());
        let id = [7u8; 16];
        let a = v.enter(id);
        let b = v.enter(id);
        assert_eq!(v.of(&id), 2);
        drop(a);
        assert_eq!(v.of(&id), 1);
        drop(b);
        assert_eq!(v.of(&id), 0);
    }
}
