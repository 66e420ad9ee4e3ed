//! Script uploads (plan §7.3 "script dispatch"): after a positive
//! acceptance the server streams a script in `ScriptChunk`s read from the
//! store range by range, never more than [`SCRIPT_WINDOW_BYTES`] per
//! command nor [`SCRIPT_SESSION_WINDOW_BYTES`] per connection beyond the
//! client's durable prefix. `ScriptUploadStatus` moves the window (and
//! skips what the client already holds); `COMMITTED` or `REJECTED` ends
//! the upload, and the room it held goes to the others.
//!
//! [`Uploads`] is the pure window bookkeeping of one connection; the
//! server core turns its ranges into store reads and chunks.

use std::collections::BTreeMap;

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore};

/// Raw bytes of one `ScriptChunk` (the protocol's per-chunk ceiling).
pub const SCRIPT_CHUNK_BYTES: u64 = 256 * 1024;
/// Script bytes in flight per command beyond the client's durable prefix:
/// the server never streams a script without progress acknowledgements.
pub const SCRIPT_WINDOW_BYTES: u64 = 1024 * 1024;
/// Script bytes in flight on one connection, over all its uploads (the
/// 8 MiB per-session data window).
pub const SCRIPT_SESSION_WINDOW_BYTES: u64 = 8 * 1024 * 1024;
/// Most script uploads one connection runs at once (a client's accepted
/// commands are bounded far below this).
pub const MAX_UPLOADS_PER_CONNECTION: usize = 1024;

/// One script upload to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upload {
    /// Total raw size.
    pub size: u64,
    /// Next raw offset to read and send (a read in flight counts as sent).
    pub sent: u64,
    /// The client's durable contiguous prefix, as last reported.
    pub received: u64,
    /// The offset of the store read in flight, if any (one at a time, so
    /// chunks leave in order).
    pub reading: Option<u64>,
}

impl Upload {
    fn in_flight(&self) -> u64 {
        self.sent.saturating_sub(self.received)
    }
}

/// Why an upload did not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartError {
    /// [`MAX_UPLOADS_PER_CONNECTION`] uploads are running.
    TooMany,
}

/// What a `ScriptUploadStatus` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// No upload of that command runs here (it ended, or a restart lost
    /// it: the next reconciliation resumes it from the client's prefix).
    Unknown,
    /// The window moved.
    Progress,
    /// The client holds the whole script, verified.
    Committed {
        /// Its size.
        size: u64,
    },
    /// The client refused the script.
    Rejected,
    /// A prefix beyond the script, a commit short of it, or an unset
    /// state: a protocol error.
    Invalid,
}

/// The uploads of one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uploads {
    map: BTreeMap<Uuid7, Upload>,
}

impl Uploads {
    /// The upload of `issue`.
    #[must_use]
    pub fn get(&self, issue: &Uuid7) -> Option<&Upload> {
        self.map.get(issue)
    }

    /// Uploads running.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none runs.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes sent (or being read) beyond the clients' prefixes, over all.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.map.values().map(Upload::in_flight).sum()
    }

    /// Commands with an upload, in order.
    #[must_use]
    pub fn issues(&self) -> Vec<Uuid7> {
        self.map.keys().copied().collect()
    }

    /// Starts (or restarts) the upload of a `size`-byte script from raw
    /// offset `from`. `Ok(false)`: nothing to send (the client holds it
    /// whole).
    ///
    /// # Errors
    /// [`StartError::TooMany`] at the per-connection bound.
    pub fn start(&mut self, issue: Uuid7, size: u64, from: u64) -> Result<bool, StartError> {
        if from >= size {
            return Ok(false);
        }
        if self.map.len() >= MAX_UPLOADS_PER_CONNECTION && !self.map.contains_key(&issue) {
            return Err(StartError::TooMany);
        }
        self.map.insert(
            issue,
            Upload {
                size,
                sent: from,
                received: from,
                reading: None,
            },
        );
        Ok(true)
    }

    /// The next range of `issue` to read, `(offset, len)`, reserved in
    /// both windows; `None` while a read is in flight, the script is all
    /// sent, or either window is full.
    pub fn next_read(&mut self, issue: &Uuid7) -> Option<(u64, u64)> {
        let session_room = SCRIPT_SESSION_WINDOW_BYTES.saturating_sub(self.in_flight());
        let up = self.map.get_mut(issue)?;
        if up.reading.is_some() {
            return None;
        }
        let limit = up.size.min(up.received.saturating_add(SCRIPT_WINDOW_BYTES));
        if up.sent >= limit || session_room == 0 {
            return None;
        }
        let len = SCRIPT_CHUNK_BYTES.min(limit - up.sent).min(session_room);
        let offset = up.sent;
        up.reading = Some(offset);
        up.sent = offset + len;
        debug_assert!(self.in_flight() <= SCRIPT_SESSION_WINDOW_BYTES);
        Some((offset, len))
    }

    /// The read at `offset` of `issue` finished; true when its bytes are
    /// still wanted (the upload runs and that read is its current one).
    pub fn read_done(&mut self, issue: &Uuid7, offset: u64) -> bool {
        match self.map.get_mut(issue) {
            Some(up) if up.reading == Some(offset) => {
                up.reading = None;
                true
            }
            _ => false,
        }
    }

    /// A chunk read at `offset` could not be queued (a full data lane):
    /// it is read and sent again from there.
    pub fn rewind(&mut self, issue: &Uuid7, offset: u64) {
        if let Some(up) = self.map.get_mut(issue) {
            up.sent = up.sent.min(offset).max(up.received);
            up.reading = None;
        }
    }

    /// Ends the upload of `issue`; true when one ran.
    pub fn end(&mut self, issue: &Uuid7) -> bool {
        self.map.remove(issue).is_some()
    }

    /// Applies a `ScriptUploadStatus`. A durable prefix never shrinks: an
    /// older report changes nothing. The client may hold more than this
    /// upload sent (an earlier connection's chunks), never more than the
    /// script.
    pub fn status(
        &mut self,
        issue: &Uuid7,
        received: u64,
        state: wire::ScriptUploadState,
    ) -> Status {
        let Some(up) = self.map.get_mut(issue) else {
            return Status::Unknown;
        };
        let valid = received <= up.size
            && match state {
                wire::ScriptUploadState::Receiving | wire::ScriptUploadState::Rejected => true,
                wire::ScriptUploadState::Committed => received == up.size,
                wire::ScriptUploadState::Unspecified => false,
            };
        if !valid {
            return Status::Invalid;
        }
        match state {
            wire::ScriptUploadState::Committed => {
                let size = up.size;
                self.map.remove(issue);
                Status::Committed { size }
            }
            wire::ScriptUploadState::Rejected => {
                self.map.remove(issue);
                Status::Rejected
            }
            _ => {
                up.received = up.received.max(received);
                up.sent = up.sent.max(up.received);
                Status::Progress
            }
        }
    }
}

#[derive(Debug)]
pub(crate) enum Pending {
    /// The command's lifecycle and script size, to start an upload.
    Info {
        conn: ConnId,
        issue: Uuid7,
        from: u64,
    },
    /// One range of the script.
    Range {
        conn: ConnId,
        issue: Uuid7,
        offset: u64,
        len: u64,
    },
}

impl ServerCore {
    /// Starts (or restarts) the script upload of `issue` on `conn` from raw
    /// offset `from`, once the store says the command is accepted (a
    /// launched command's script is whole, an ended one needs none) and
    /// runs a script.
    pub(crate) fn start_upload(&mut self, conn: ConnId, issue: Uuid7, from: u64) {
        self.store(
            StoreOp::ScriptInfo {
                issue: *issue.as_bytes(),
            },
            Any::Upload(Pending::Info { conn, issue, from }),
        );
    }

    pub(crate) fn upload_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Info { conn, issue, from } => {
                let size = match result {
                    Ok(Completion::Script {
                        lifecycle: rvbox_domain::lifecycle::Lifecycle::Accepted,
                        size: Some(size),
                    }) => size,
                    Ok(Completion::Script { .. }) => return,
                    Ok(_) => return self.mismatch("script_info"),
                    // the command is gone (reclaimed): nothing to upload
                    Err(rvbox_store_port::ops::PortError::Refused(_)) => return,
                    Err(e) => {
                        tracing::error!(error = %e, "script not readable for upload; the connection closes");
                        self.stats.script_upload_failures += 1;
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                        return;
                    }
                };
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                match c.uploads.start(issue, size, from) {
                    Ok(true) => {
                        self.stats.script_uploads += 1;
                        tracing::info!(offset = from, size, "script upload started");
                        self.pump_upload(conn, issue);
                    }
                    Ok(false) => {}
                    Err(StartError::TooMany) => tracing::warn!(
                        "too many script uploads on one connection; this one waits for a reconnect"
                    ),
                }
            }
            Pending::Range {
                conn,
                issue,
                offset,
                len,
            } => {
                let wanted = self
                    .conns
                    .get_mut(&conn)
                    .is_some_and(|c| c.uploads.read_done(&issue, offset));
                if !wanted {
                    return;
                }
                let bytes = match result {
                    Ok(Completion::ScriptBytes(b))
                        if !b.is_empty() && u64::try_from(b.len()).is_ok_and(|n| n == len) =>
                    {
                        b
                    }
                    Ok(Completion::ScriptBytes(_)) => {
                        tracing::error!(
                            "script shorter than its descriptor; the connection closes"
                        );
                        self.stats.script_upload_failures += 1;
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                        return;
                    }
                    Ok(_) => return self.mismatch("script_range"),
                    Err(e) => {
                        // the upload resumes from the client's prefix after
                        // it reconnects; a damaged script is found by the
                        // store's verification and recovery
                        tracing::error!(error = %e, "script chunk not readable; the connection closes");
                        self.stats.script_upload_failures += 1;
                        self.close(conn, wire::CloseReason::StorageUnavailable);
                        return;
                    }
                };
                let Some(size) = self
                    .conns
                    .get(&conn)
                    .and_then(|c| c.uploads.get(&issue))
                    .map(|u| u.size)
                else {
                    return;
                };
                let raw_length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                let chunk = wire::ScriptChunk {
                    issue_uuid: issue.to_string(),
                    offset,
                    declared_size: size,
                    compression: wire::Compression::None as i32,
                    raw_sha256: rvbox_segment::sha256(&bytes).to_vec(),
                    raw_length,
                    stored_length: raw_length,
                    payload: bytes,
                };
                if self.send(conn, Payload::ScriptChunk(chunk)) {
                    self.stats.script_chunks += 1;
                    self.pump_upload(conn, issue);
                } else if self.conns.get(&conn).is_some_and(|c| c.data_blocked) {
                    // a full data lane: this range goes again once the
                    // writer frees room
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.uploads.rewind(&issue, offset);
                    }
                } else {
                    // a closing or not yet reconciled session: the upload
                    // resumes after the next reconciliation
                    tracing::warn!("script chunk not queued; the upload resumes after a reconnect");
                    self.end_upload(conn, issue);
                }
            }
        }
    }

    /// Reads the next range of `issue` while its window has room.
    fn pump_upload(&mut self, conn: ConnId, issue: Uuid7) {
        if !self.data_room(conn) {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.data_blocked = true;
            }
            return;
        }
        let Some((offset, len)) = self
            .conns
            .get_mut(&conn)
            .and_then(|c| c.uploads.next_read(&issue))
        else {
            return;
        };
        self.store(
            StoreOp::ScriptRange {
                issue: *issue.as_bytes(),
                offset,
                len,
            },
            Any::Upload(Pending::Range {
                conn,
                issue,
                offset,
                len,
            }),
        );
    }

    /// Pumps every upload of `conn`, in command order.
    pub(crate) fn pump_uploads(&mut self, conn: ConnId) {
        let issues = self
            .conns
            .get(&conn)
            .map(|c| c.uploads.issues())
            .unwrap_or_default();
        for issue in issues {
            self.pump_upload(conn, issue);
        }
        // room an upload freed in the session window may let stdin on
        self.pump_stdins(conn);
    }

    /// Ends an upload and lets the room it held go to the others.
    pub(crate) fn end_upload(&mut self, conn: ConnId, issue: Uuid7) {
        if self
            .conns
            .get_mut(&conn)
            .is_some_and(|c| c.uploads.end(&issue))
        {
            self.pump_uploads(conn);
        }
    }

    /// `ScriptUploadStatus`.
    pub(crate) fn upload_status(
        &mut self,
        conn: ConnId,
        issue: Uuid7,
        m: &wire::ScriptUploadStatus,
    ) {
        let state = wire::ScriptUploadState::try_from(m.state)
            .unwrap_or(wire::ScriptUploadState::Unspecified);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        match c.uploads.status(&issue, m.received_bytes, state) {
            Status::Unknown => {}
            Status::Invalid => {
                tracing::warn!(
                    received = m.received_bytes,
                    state = state.as_str_name(),
                    "script upload status refused"
                );
                self.close(conn, wire::CloseReason::ProtocolError);
            }
            Status::Committed { size } => {
                self.stats.scripts_committed += 1;
                tracing::info!(size, "script upload committed by the client");
                self.pump_uploads(conn);
            }
            Status::Rejected => {
                self.stats.scripts_refused += 1;
                tracing::warn!(
                    reason = m.error.as_ref().map_or("", |e| e.reason.as_str()),
                    "script upload rejected by the client"
                );
                self.pump_uploads(conn);
            }
            // the freed window may let any upload of this connection on
            Status::Progress => self.pump_uploads(conn),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> Uuid7 {
        let mut b = [0u8; 16];
        b[0] = 0x01;
        b[6] = 0x70;
        b[8] = 0x80;
        b[15] = n;
        Uuid7::from_bytes("t", b).unwrap()
    }

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn a_script_goes_in_chunks_within_the_command_window() {
        let mut u = Uploads::default();
        assert!(u.start(id(1), 3 * MIB, 0).unwrap());
        let mut reads = Vec::new();
        while let Some((off, len)) = u.next_read(&id(1)) {
            reads.push((off, len));
            assert!(u.read_done(&id(1), off));
        }
        // 1 MiB window = four 256 KiB chunks, then it waits for progress
        assert_eq!(
            reads,
            vec![
                (0, 262_144),
                (262_144, 262_144),
                (524_288, 262_144),
                (786_432, 262_144)
            ]
        );
        assert_eq!(u.in_flight(), MIB);
        assert_eq!(
            u.status(&id(1), 512 * 1024, wire::ScriptUploadState::Receiving),
            Status::Progress
        );
        assert_eq!(u.next_read(&id(1)), Some((MIB, 262_144)));
    }

    #[test]
    fn one_read_at_a_time_keeps_chunks_in_order() {
        let mut u = Uploads::default();
        u.start(id(1), MIB, 0).unwrap();
        assert_eq!(u.next_read(&id(1)), Some((0, SCRIPT_CHUNK_BYTES)));
        assert_eq!(u.next_read(&id(1)), None);
        assert!(
            !u.read_done(&id(1), 5),
            "a read that is not the current one is stale"
        );
        assert!(u.read_done(&id(1), 0));
        assert_eq!(
            u.next_read(&id(1)),
            Some((SCRIPT_CHUNK_BYTES, SCRIPT_CHUNK_BYTES))
        );
    }

    #[test]
    fn the_connection_window_is_shared_and_an_ended_upload_frees_its_room() {
        let mut u = Uploads::default();
        for n in 0..9 {
            u.start(id(n), 2 * MIB, 0).unwrap();
            while let Some((off, _)) = u.next_read(&id(n)) {
                u.read_done(&id(n), off);
            }
        }
        assert_eq!(u.in_flight(), SCRIPT_SESSION_WINDOW_BYTES);
        assert_eq!(
            u.get(&id(8)).unwrap().sent,
            0,
            "the ninth upload has no room"
        );
        assert!(u.end(&id(0)));
        assert_eq!(u.next_read(&id(8)), Some((0, SCRIPT_CHUNK_BYTES)));
    }

    #[test]
    fn a_status_skips_ahead_never_back_and_validates() {
        let mut u = Uploads::default();
        u.start(id(1), 1000, 0).unwrap();
        assert_eq!(
            u.status(&id(1), 600, wire::ScriptUploadState::Receiving),
            Status::Progress
        );
        assert_eq!(
            u.get(&id(1)).unwrap().sent,
            600,
            "the client held more than was sent"
        );
        assert_eq!(
            u.status(&id(1), 100, wire::ScriptUploadState::Receiving),
            Status::Progress
        );
        assert_eq!(
            u.get(&id(1)).unwrap().received,
            600,
            "a prefix never shrinks"
        );
        assert_eq!(
            u.status(&id(1), 1001, wire::ScriptUploadState::Receiving),
            Status::Invalid
        );
        assert_eq!(
            u.status(&id(1), 999, wire::ScriptUploadState::Committed),
            Status::Invalid
        );
        assert_eq!(
            u.status(&id(1), 600, wire::ScriptUploadState::Unspecified),
            Status::Invalid
        );
        assert_eq!(
            u.status(&id(1), 1000, wire::ScriptUploadState::Committed),
            Status::Committed { size: 1000 }
        );
        assert_eq!(
            u.status(&id(1), 1000, wire::ScriptUploadState::Receiving),
            Status::Unknown
        );
    }

    #[test]
    fn nothing_to_send_and_the_upload_bound() {
        let mut u = Uploads::default();
        assert!(!u.start(id(1), 10, 10).unwrap());
        assert!(u.is_empty());
        for n in 0..MAX_UPLOADS_PER_CONNECTION {
            let mut b = [0u8; 16];
            b[0] = 1;
            b[6] = 0x70;
            b[8] = 0x80;
            b[13..16].copy_from_slice(&u32::try_from(n).unwrap().to_be_bytes()[1..]);
            u.start(Uuid7::from_bytes("t", b).unwrap(), 10, 0).unwrap();
        }
        let mut other = *id(1).as_bytes();
        other[2] = 0xee;
        let other = Uuid7::from_bytes("t", other).unwrap();
        assert_eq!(u.start(other, 10, 0), Err(StartError::TooMany));
    }
}
