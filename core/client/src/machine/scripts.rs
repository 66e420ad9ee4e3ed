//! Script uploads: each `ScriptChunk` checked against the declared size
//! and the server's window, made durable, and only then reported back in a
//! `ScriptUploadStatus`.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::MAX_SCRIPT_CHUNK_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;

use super::{ClientCore, Pending, SCRIPT_STATUS_EVERY_BYTES, SCRIPT_WINDOW_BYTES};
use crate::ops::{ClientCompletion, ClientOp, ScriptOutcome};

impl ClientCore {
    // ---- scripts ------------------------------------------------------------------

    pub(super) fn script_chunk(&mut self, now_ms: u64, c: wire::ScriptChunk) {
        let Ok(issue) = Uuid7::parse("script_chunk.issue_uuid", &c.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let Some(r) = self.records.get(&issue).filter(|r| !r.terminate) else {
            // not held (or ended by reconciliation): refuse, so the server
            // ends its upload
            self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid,
                received_bytes: 0,
                state: wire::ScriptUploadState::Rejected as i32,
                error: Some(
                    DomainError::new(Code::NotFound, "the client does not hold this command")
                        .to_detail(),
                ),
            }));
            return;
        };
        let Some((size, _)) = r.script else {
            self.protocol_error(now_ms);
            return;
        };
        if r.script_committed {
            self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                issue_uuid: c.issue_uuid,
                received_bytes: size,
                state: wire::ScriptUploadState::Committed as i32,
                error: None,
            }));
            return;
        }
        let raw = u64::from(c.raw_length);
        let end = c.offset.checked_add(raw);
        // placement and window: at the prefix or an exact replay below it,
        // within the declared size and the server's 1 MiB window
        let ok = (1..=MAX_SCRIPT_CHUNK_BYTES).contains(&raw)
            && c.declared_size == size
            && end.is_some_and(|e| e <= size)
            && c.offset <= r.script_received
            && end.is_some_and(|e| e <= r.script_reported.saturating_add(SCRIPT_WINDOW_BYTES));
        if !ok {
            self.protocol_error(now_ms);
            return;
        }
        let prefix = r.script_received;
        let offset = c.offset;
        self.store(
            ClientOp::ScriptChunk {
                issue,
                chunk: Box::new(c),
            },
            Pending::Script(issue, offset, prefix),
        );
    }

    pub(super) fn script_stored(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        issue: Uuid7,
        replay: bool,
        result: ClientCompletion,
    ) {
        let outcome = match result {
            ClientCompletion::Script(o) => o,
            // a local write failure: nothing advanced; the server resends
            _ => return,
        };
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let id = issue.to_string();
        match outcome {
            ScriptOutcome::Invalid(_) => self.protocol_error(now_ms),
            ScriptOutcome::Mismatch(reason) => {
                self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                    issue_uuid: id,
                    received_bytes: 0,
                    state: wire::ScriptUploadState::Rejected as i32,
                    error: Some(DomainError::new(Code::InvalidArgument, &reason).to_detail()),
                }));
                self.end(wall_ms, issue, wire::Lifecycle::Rejected, None, &reason);
            }
            ScriptOutcome::Committed => {
                let size = r.script.map_or(0, |(s, _)| s);
                r.script_received = size;
                r.script_committed = true;
                r.script_reported = size;
                self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                    issue_uuid: id,
                    received_bytes: size,
                    state: wire::ScriptUploadState::Committed as i32,
                    error: None,
                }));
            }
            ScriptOutcome::Received { received } => {
                r.script_received = r.script_received.max(received);
                // a replay is answered at once: the server may be resending
                // what this client holds and must learn to skip ahead
                let due = received.saturating_sub(r.script_reported) >= SCRIPT_STATUS_EVERY_BYTES;
                if due || replay {
                    r.script_reported = r.script_received;
                    let received = r.script_received;
                    self.send(Payload::ScriptUploadStatus(wire::ScriptUploadStatus {
                        issue_uuid: id,
                        received_bytes: received,
                        state: wire::ScriptUploadState::Receiving as i32,
                        error: None,
                    }));
                }
            }
        }
    }
}
