//! Stdin: a `StdinWrite` checked, made durable in order, and only then
//! written to the tree (or acknowledged as discarded when stdin is not
//! open).

use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::MAX_STDIN_WRITE_BYTES;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;

use super::{ClientCore, LaunchPhase, Output, Pending};
use crate::ops::{ClientOp, SuperviseOp};

impl ClientCore {
    // ---- stdin --------------------------------------------------------------------

    pub(super) fn stdin(&mut self, now_ms: u64, w: wire::StdinWrite) {
        let Ok(issue) = Uuid7::parse("stdin_write.issue_uuid", &w.issue_uuid) else {
            self.protocol_error(now_ms);
            return;
        };
        let wall = self.wall;
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        if w.write_seq < r.stdin_next || r.terminate {
            return; // a replay: acknowledged already (or being)
        }
        if w.write_seq != r.stdin_next {
            self.protocol_error(now_ms);
            return;
        }
        // the store decodes the payload and checks it against the raw
        // length and digest; the envelope's fields are checked here
        let compression = wire::Compression::try_from(w.compression).ok();
        let newline = wire::StdinNewline::try_from(w.newline).ok();
        if u64::from(w.raw_length) > MAX_STDIN_WRITE_BYTES
            || usize::try_from(w.stored_length).ok() != Some(w.payload.len())
            || w.raw_sha256.len() != 32
            || !matches!(
                compression,
                Some(wire::Compression::None | wire::Compression::Zstd)
            )
            || !matches!(
                newline,
                Some(wire::StdinNewline::Append | wire::StdinNewline::Raw)
            )
        {
            self.protocol_error(now_ms);
            return;
        }
        r.stdin_next = w.write_seq.saturating_add(1);
        let open = matches!(
            r.phase,
            LaunchPhase::Running(_) | LaunchPhase::Released(_) | LaunchPhase::Authorizing(_)
        ) && !r.stdin_closed;
        if w.close_after {
            r.stdin_closed = true;
        }
        if !open {
            let closed = r.stdin_closed;
            self.spool_event(
                issue,
                wall,
                Body::StdinAck(wire::StdinAck {
                    write_seq: w.write_seq,
                    delivery: wire::StdinDelivery::Discarded as i32,
                    closed,
                    reason: "stdin is not open".into(),
                }),
            );
            return;
        }
        let (write_seq, close_after) = (w.write_seq, w.close_after);
        self.store(
            ClientOp::StdinWrite {
                issue,
                write: Box::new(w),
            },
            Pending::Stdin(issue, write_seq, close_after),
        );
    }

    pub(super) fn stdin_durable(
        &mut self,
        issue: Uuid7,
        write_seq: u64,
        bytes: Vec<u8>,
        close_after: bool,
    ) {
        if !self.records.contains_key(&issue) {
            return;
        }
        self.push(Output::Supervise(SuperviseOp::WriteStdin {
            issue,
            write_seq,
            bytes,
        }));
        // this write's own close: a later write's close waits for it
        if close_after {
            self.push(Output::Supervise(SuperviseOp::CloseStdin(issue)));
        }
    }
}
