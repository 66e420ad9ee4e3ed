//! Event ingest (plan §5.3, §6.3): a validated `CommandEvent` becomes an
//! append operation; its `EventAck` is the session's answer to the
//! append's completion, never sooner. Also the routing of every validated
//! client message.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1::command_event::Body;
use rvbox_session::{ClientMessage, EventDescriptor, Input as SessionInput};
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore, convert};

#[derive(Debug)]
pub(crate) struct Pending {
    conn: ConnId,
    issue: Uuid7,
    event_seq: u64,
    /// The event reports the command launched or ended: its script upload
    /// (if any) ends once it is durable.
    ends_upload: bool,
}

impl ServerCore {
    /// Routes a validated client message.
    pub(crate) fn deliver(&mut self, conn: ConnId, msg: ClientMessage) {
        match msg {
            ClientMessage::ClientSnapshot(chunk) => self.snapshot(conn, &chunk),
            ClientMessage::ClientCapacity(cap) => {
                let Some(client) = self.client_of(conn) else {
                    return;
                };
                let st = self.clients.entry(client.clone()).or_default();
                match st.capacity.apply_report(&cap) {
                    Ok(_) => self.mark_ready(&client),
                    Err(e) => {
                        tracing::warn!(error = %e, "capacity report refused");
                        self.close(conn, rvbox_proto::v1::CloseReason::ProtocolError);
                    }
                }
            }
            ClientMessage::CommandAccepted { issue, message } => {
                self.accepted(conn, issue, &message);
            }
            ClientMessage::CommandEvent(desc) => self.event(conn, desc),
            ClientMessage::ScriptUploadStatus { issue, message } => {
                self.upload_status(conn, issue, &message);
            }
            ClientMessage::Pty { .. } | ClientMessage::ControlError(_) => {}
        }
    }

    fn event(&mut self, conn: ConnId, desc: EventDescriptor) {
        let issue = desc.issue;
        let event_seq = desc.event_seq;
        let ends_upload = matches!(
            &desc.event.body,
            Some(Body::Lifecycle(l)) if Lifecycle::from_wire(l.lifecycle).is_ok_and(|to| to != Lifecycle::Accepted)
        );
        match convert::event_append(&desc.event) {
            Ok(ev) => {
                let issued = self.store(
                    StoreOp::AppendEvents { events: vec![ev] },
                    Any::Ingest(Pending {
                        conn,
                        issue,
                        event_seq,
                        ends_upload,
                    }),
                );
                if !issued {
                    self.session_input(conn, SessionInput::IngressQueueFull);
                }
            }
            Err(error) => self.session_input(
                conn,
                SessionInput::EventRefused {
                    issue,
                    event_seq,
                    error,
                },
            ),
        }
    }

    pub(crate) fn ingest_done(&mut self, p: Pending, result: OpResult) {
        let Pending {
            conn,
            issue,
            event_seq,
            ends_upload,
        } = p;
        let input = match result {
            Ok(Completion::Appended(report)) => match report.outcomes.first() {
                Some(EventOutcome::Appended | EventOutcome::Duplicate) => {
                    self.stats.events_durable += 1;
                    if ends_upload {
                        self.end_upload(conn, issue);
                    }
                    SessionInput::EventsDurable {
                        issue,
                        durable_seq: report
                            .acked
                            .get(issue.as_bytes())
                            .copied()
                            .unwrap_or(event_seq),
                    }
                }
                Some(EventOutcome::Refused(e)) => {
                    self.stats.events_refused += 1;
                    SessionInput::EventRefused {
                        issue,
                        event_seq,
                        error: e.clone(),
                    }
                }
                None => {
                    self.mismatch("append_events");
                    return;
                }
            },
            Ok(_) => {
                self.mismatch("append_events");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "event batch failed; nothing acknowledged");
                SessionInput::EventRefused {
                    issue,
                    event_seq,
                    error: DomainError::new(Code::Unavailable, "server store failed"),
                }
            }
        };
        self.session_input(conn, input);
    }
}
