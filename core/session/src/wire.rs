//! Static facts about agent envelopes: who may send each payload, which
//! writer lane carries it, and how a [`CloseReason`] maps to a WebSocket
//! close code and reason text (agent.proto).

use rvbox_proto::v1::CloseReason;
use rvbox_proto::v1::envelope::Payload;

/// Who may send a payload (agent.proto comments on `Envelope.payload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Only the client daemon sends it.
    ClientToServer,
    /// Only the server sends it.
    ServerToClient,
    /// Either side (`ControlError`).
    Both,
}

/// One of the two bounded writer lanes (plan §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lane {
    /// Reserved lane: Ping/Pong/Close, welcome/fencing, protocol errors,
    /// acknowledgements and reconciliation. Always drained first.
    Control,
    /// Dispatch, script, stdin/signal, events and PTY data.
    Data,
}

/// The payload's oneof member name, for logs and audit (never its content).
#[must_use]
pub fn payload_name(payload: &Payload) -> &'static str {
    match payload {
        Payload::ClientHello(_) => "client_hello",
        Payload::ServerWelcome(_) => "server_welcome",
        Payload::ControlError(_) => "control_error",
        Payload::Dispatch(_) => "dispatch",
        Payload::CommandAccepted(_) => "command_accepted",
        Payload::ScriptChunk(_) => "script_chunk",
        Payload::ScriptUploadStatus(_) => "script_upload_status",
        Payload::StdinWrite(_) => "stdin_write",
        Payload::Signal(_) => "signal",
        Payload::CommandEvent(_) => "command_event",
        Payload::EventAck(_) => "event_ack",
        Payload::ClientCapacity(_) => "client_capacity",
        Payload::ReconcileRequest(_) => "reconcile_request",
        Payload::ClientSnapshot(_) => "client_snapshot",
        Payload::ReconcileResult(_) => "reconcile_result",
        Payload::PtyOpen(_) => "pty_open",
        Payload::PtyOpened(_) => "pty_opened",
        Payload::PtyInput(_) => "pty_input",
        Payload::PtyInputAck(_) => "pty_input_ack",
        Payload::PtyResize(_) => "pty_resize",
        Payload::PtyAttach(_) => "pty_attach",
        Payload::PtyOutput(_) => "pty_output",
        Payload::PtyOutputAck(_) => "pty_output_ack",
        Payload::PtyDetach(_) => "pty_detach",
        Payload::PtyClose(_) => "pty_close",
        Payload::PtyClosed(_) => "pty_closed",
    }
}

/// Who may send `payload` (agent.proto).
#[must_use]
pub fn payload_direction(payload: &Payload) -> Direction {
    match payload {
        Payload::ControlError(_) => Direction::Both,
        Payload::ClientHello(_)
        | Payload::CommandAccepted(_)
        | Payload::ScriptUploadStatus(_)
        | Payload::CommandEvent(_)
        | Payload::ClientCapacity(_)
        | Payload::ClientSnapshot(_)
        | Payload::PtyOpened(_)
        | Payload::PtyInputAck(_)
        | Payload::PtyOutput(_)
        | Payload::PtyClosed(_) => Direction::ClientToServer,
        Payload::ServerWelcome(_)
        | Payload::Dispatch(_)
        | Payload::ScriptChunk(_)
        | Payload::StdinWrite(_)
        | Payload::Signal(_)
        | Payload::EventAck(_)
        | Payload::ReconcileRequest(_)
        | Payload::ReconcileResult(_)
        | Payload::PtyOpen(_)
        | Payload::PtyInput(_)
        | Payload::PtyResize(_)
        | Payload::PtyAttach(_)
        | Payload::PtyOutputAck(_)
        | Payload::PtyDetach(_)
        | Payload::PtyClose(_) => Direction::ServerToClient,
    }
}

/// The writer lane that carries `payload` (agent.proto header comment).
#[must_use]
pub fn payload_lane(payload: &Payload) -> Lane {
    match payload {
        Payload::ClientHello(_)
        | Payload::ServerWelcome(_)
        | Payload::ControlError(_)
        | Payload::CommandAccepted(_)
        | Payload::EventAck(_)
        | Payload::ScriptUploadStatus(_)
        | Payload::ReconcileRequest(_)
        | Payload::ClientSnapshot(_)
        | Payload::ReconcileResult(_)
        | Payload::ClientCapacity(_)
        | Payload::PtyInputAck(_)
        | Payload::PtyOutputAck(_) => Lane::Control,
        Payload::Dispatch(_)
        | Payload::ScriptChunk(_)
        | Payload::StdinWrite(_)
        | Payload::Signal(_)
        | Payload::CommandEvent(_)
        | Payload::PtyOpen(_)
        | Payload::PtyOpened(_)
        | Payload::PtyInput(_)
        | Payload::PtyResize(_)
        | Payload::PtyAttach(_)
        | Payload::PtyOutput(_)
        | Payload::PtyDetach(_)
        | Payload::PtyClose(_)
        | Payload::PtyClosed(_) => Lane::Data,
    }
}

/// The WebSocket close code of `reason` (agent.proto `CloseReason`);
/// `None` for `UNSPECIFIED`, which is never sent.
#[must_use]
pub fn close_code(reason: CloseReason) -> Option<u16> {
    Some(match reason {
        CloseReason::Unspecified => return None,
        CloseReason::Normal => 1000,
        CloseReason::ProtocolError => 1002,
        CloseReason::MessageTooBig => 1009,
        CloseReason::InternalError => 1011,
        CloseReason::ServiceRestart => 1012,
        CloseReason::SessionFenced => 4000,
        CloseReason::StaleSession => 4001,
        CloseReason::LivenessTimeout => 4002,
        CloseReason::IngressOverload => 4003,
        CloseReason::StorageUnavailable => 4004,
        CloseReason::HelloRejected => 4005,
        CloseReason::ReconcileTimeout => 4006,
    })
}

/// The close frame's reason text: the value name without `CLOSE_REASON_`
/// (e.g. `"SESSION_FENCED"`).
#[must_use]
pub fn close_text(reason: CloseReason) -> &'static str {
    let name = reason.as_str_name();
    name.strip_prefix("CLOSE_REASON_").unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rvbox_proto::v1 as wire;

    #[test]
    fn close_codes_and_texts() {
        assert_eq!(close_code(CloseReason::SessionFenced), Some(4000));
        assert_eq!(close_code(CloseReason::ProtocolError), Some(1002));
        assert_eq!(close_code(CloseReason::MessageTooBig), Some(1009));
        assert_eq!(close_code(CloseReason::HelloRejected), Some(4005));
        assert_eq!(close_code(CloseReason::ReconcileTimeout), Some(4006));
        assert_eq!(close_code(CloseReason::Unspecified), None);
        assert_eq!(close_text(CloseReason::SessionFenced), "SESSION_FENCED");
        assert_eq!(close_text(CloseReason::LivenessTimeout), "LIVENESS_TIMEOUT");
    }

    #[test]
    fn directions_and_lanes() {
        let hello = Payload::ClientHello(wire::ClientHello::default());
        assert_eq!(payload_direction(&hello), Direction::ClientToServer);
        let ack = Payload::EventAck(wire::EventAck::default());
        assert_eq!(payload_direction(&ack), Direction::ServerToClient);
        assert_eq!(payload_lane(&ack), Lane::Control);
        let ev = Payload::CommandEvent(wire::CommandEvent::default());
        assert_eq!(payload_lane(&ev), Lane::Data);
        let err = Payload::ControlError(wire::ControlError::default());
        assert_eq!(payload_direction(&err), Direction::Both);
        assert_eq!(payload_name(&err), "control_error");
    }
}
