//! Typed domain errors with stable codes, and their one mapping to every
//! transport (plan §4.2, §9.1, §9.3; conventions rule 10).
//!
//! A [`DomainError`] becomes:
//! - a canonical non-OK gRPC status whose details carry an encoded
//!   `google.rpc.Status` holding one `rvbox.v1.ErrorDetail` ([`DomainError::to_grpc`]);
//! - a JSON-RPC 2.0 error object with the stable server-error code
//!   [`JSONRPC_DOMAIN_ERROR`] and the same detail in protobuf-JSON form
//!   ([`DomainError::to_jsonrpc`]);
//! - an agent-protocol `ControlError` ([`DomainError::to_control_error`]);
//! - a stable `rvc` exit status ([`Code::exit_status`]).

use std::fmt;

use prost::Message as _;
use rvbox_proto::v1 as wire;

use crate::ids::{IdError, Uuid7};
use crate::lifecycle::TransitionError;
use crate::limits::MAX_REASON_BYTES;
use crate::token::TokenError;

/// JSON-RPC error code used for every domain failure (the standard
/// parse / invalid-request / method-not-found codes keep their meaning).
pub const JSONRPC_DOMAIN_ERROR: i64 = -32000;

/// Type URL of `rvbox.v1.ErrorDetail` inside a `google.rpc.Status`.
pub const ERROR_DETAIL_TYPE_URL: &str = "type.googleapis.com/rvbox.v1.ErrorDetail";

/// Whether a caller may retry the same request later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryClass {
    /// Capacity, storage, recovery or local I/O: retry with backoff.
    Transient,
    /// Policy, schema, hash mismatch, unsupported: retrying cannot help.
    Permanent,
}

/// gRPC canonical status codes (numbers fixed by the gRPC spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    /// 3
    InvalidArgument = 3,
    /// 5
    NotFound = 5,
    /// 6
    AlreadyExists = 6,
    /// 8
    ResourceExhausted = 8,
    /// 9
    FailedPrecondition = 9,
    /// 10
    Aborted = 10,
    /// 12
    Unimplemented = 12,
    /// 13
    Internal = 13,
    /// 14
    Unavailable = 14,
}

/// Stable RVBox error codes. Their names and numbers are part of the wire
/// contract (`rvbox.v1.ErrorCode`) and never change meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Code {
    /// A field is missing, malformed or out of range.
    InvalidArgument,
    /// The named command, client or incident does not exist.
    NotFound,
    /// The same id was reused with a different request (hash, method or owner).
    Conflict,
    /// The client already executed this exact command (tombstone hit).
    AlreadyExecuted,
    /// The lifecycle edge is not legal from the current state.
    IllegalTransition,
    /// The decision was based on an older revision; re-read and retry.
    StaleRevision,
    /// The target is not in a state that allows the operation.
    FailedPrecondition,
    /// The repair would discard committed data; acknowledge the loss instead.
    RequiresAcknowledgement,
    /// The scope is recovering, dirty or unavailable; retry later.
    Unavailable,
    /// A storage quota tier or the free-space floor refused the bytes.
    QuotaExceeded,
    /// A queue or running/queued slot limit is full.
    CapacityExhausted,
    /// A size ceiling was exceeded.
    TooLarge,
    /// A required shell, profile or control cannot be applied here.
    Unsupported,
    /// The peer broke the agent protocol (bad frame, conflicting duplicate, wrong direction).
    ProtocolError,
    /// The session id or generation is not the live one.
    StaleSession,
    /// No shared protocol version.
    VersionMismatch,
    /// Another instance holds the client id; a takeover grant is needed.
    LiveConflict,
    /// An invariant failed inside RVBox.
    Internal,
}

impl Code {
    /// Every code, in wire order.
    pub const ALL: [Self; 18] = [
        Self::InvalidArgument,
        Self::NotFound,
        Self::Conflict,
        Self::AlreadyExecuted,
        Self::IllegalTransition,
        Self::StaleRevision,
        Self::FailedPrecondition,
        Self::RequiresAcknowledgement,
        Self::Unavailable,
        Self::QuotaExceeded,
        Self::CapacityExhausted,
        Self::TooLarge,
        Self::Unsupported,
        Self::ProtocolError,
        Self::StaleSession,
        Self::VersionMismatch,
        Self::LiveConflict,
        Self::Internal,
    ];

    /// Stable upper-case name (the wire enum value without its prefix).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::NotFound => "NOT_FOUND",
            Self::Conflict => "CONFLICT",
            Self::AlreadyExecuted => "ALREADY_EXECUTED",
            Self::IllegalTransition => "ILLEGAL_TRANSITION",
            Self::StaleRevision => "STALE_REVISION",
            Self::FailedPrecondition => "FAILED_PRECONDITION",
            Self::RequiresAcknowledgement => "REQUIRES_ACKNOWLEDGEMENT",
            Self::Unavailable => "UNAVAILABLE",
            Self::QuotaExceeded => "QUOTA_EXCEEDED",
            Self::CapacityExhausted => "CAPACITY_EXHAUSTED",
            Self::TooLarge => "TOO_LARGE",
            Self::Unsupported => "UNSUPPORTED",
            Self::ProtocolError => "PROTOCOL_ERROR",
            Self::StaleSession => "STALE_SESSION",
            Self::VersionMismatch => "VERSION_MISMATCH",
            Self::LiveConflict => "LIVE_CONFLICT",
            Self::Internal => "INTERNAL",
        }
    }

    /// The default retry class (plan §6.4, §7.3: capacity, storage and local
    /// I/O are transient; policy, schema, hash and unsupported are permanent).
    #[must_use]
    pub fn retry_class(self) -> RetryClass {
        match self {
            Self::StaleRevision
            | Self::Unavailable
            | Self::QuotaExceeded
            | Self::CapacityExhausted
            | Self::StaleSession
            | Self::LiveConflict
            | Self::Internal => RetryClass::Transient,
            Self::InvalidArgument
            | Self::NotFound
            | Self::Conflict
            | Self::AlreadyExecuted
            | Self::IllegalTransition
            | Self::FailedPrecondition
            | Self::RequiresAcknowledgement
            | Self::TooLarge
            | Self::Unsupported
            | Self::ProtocolError
            | Self::VersionMismatch => RetryClass::Permanent,
        }
    }

    /// The canonical gRPC status code. A request-id reuse with another
    /// request is `ALREADY_EXISTS` carrying `CONFLICT` (spec-mapping).
    #[must_use]
    pub fn grpc_code(self) -> GrpcCode {
        match self {
            Self::InvalidArgument | Self::TooLarge | Self::ProtocolError => {
                GrpcCode::InvalidArgument
            }
            Self::NotFound => GrpcCode::NotFound,
            Self::Conflict | Self::AlreadyExecuted => GrpcCode::AlreadyExists,
            Self::QuotaExceeded | Self::CapacityExhausted => GrpcCode::ResourceExhausted,
            Self::IllegalTransition
            | Self::FailedPrecondition
            | Self::RequiresAcknowledgement
            | Self::StaleSession
            | Self::VersionMismatch
            | Self::LiveConflict => GrpcCode::FailedPrecondition,
            Self::StaleRevision => GrpcCode::Aborted,
            Self::Unsupported => GrpcCode::Unimplemented,
            Self::Unavailable => GrpcCode::Unavailable,
            Self::Internal => GrpcCode::Internal,
        }
    }

    /// The wire enum value.
    #[must_use]
    pub fn to_wire(self) -> wire::ErrorCode {
        use wire::ErrorCode as W;
        match self {
            Self::InvalidArgument => W::InvalidArgument,
            Self::NotFound => W::NotFound,
            Self::Conflict => W::Conflict,
            Self::AlreadyExecuted => W::AlreadyExecuted,
            Self::IllegalTransition => W::IllegalTransition,
            Self::StaleRevision => W::StaleRevision,
            Self::FailedPrecondition => W::FailedPrecondition,
            Self::RequiresAcknowledgement => W::RequiresAcknowledgement,
            Self::Unavailable => W::Unavailable,
            Self::QuotaExceeded => W::QuotaExceeded,
            Self::CapacityExhausted => W::CapacityExhausted,
            Self::TooLarge => W::TooLarge,
            Self::Unsupported => W::Unsupported,
            Self::ProtocolError => W::ProtocolError,
            Self::StaleSession => W::StaleSession,
            Self::VersionMismatch => W::VersionMismatch,
            Self::LiveConflict => W::LiveConflict,
            Self::Internal => W::Internal,
        }
    }

    /// Reads a wire value; unspecified or unknown numbers become `None`.
    #[must_use]
    pub fn from_wire(raw: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.to_wire() as i32 == raw)
    }

    /// Stable `rvc` exit status for this code: 10 + its wire number, so
    /// 11..=28. (0 is success, 1 an unexpected local failure, 2 a usage
    /// error, 3..=9 are left to local conditions such as "cannot connect".)
    #[must_use]
    pub fn exit_status(self) -> u8 {
        // wire numbers are 1..=18, so this stays in 11..=28
        u8::try_from(10 + self.to_wire() as i32).unwrap_or(1)
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A domain failure with everything a caller needs to act on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainError {
    code: Code,
    retry: RetryClass,
    reason: String,
    field: String,
    issue_uuid: Option<Uuid7>,
    incident_id: Option<String>,
}

/// Cuts `text` to at most [`MAX_REASON_BYTES`] bytes on a character boundary.
#[must_use]
pub fn bound_reason(text: &str) -> String {
    let max = usize::try_from(MAX_REASON_BYTES).unwrap_or(usize::MAX);
    if text.len() <= max {
        return text.to_owned();
    }
    let marker = " [truncated]";
    let mut end = max.saturating_sub(marker.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = text.get(..end).unwrap_or_default().to_owned();
    out.push_str(marker);
    out
}

impl DomainError {
    /// A new error; `reason` is bounded to 4 KiB and must not contain
    /// command text or environment values.
    #[must_use]
    pub fn new(code: Code, reason: impl AsRef<str>) -> Self {
        Self {
            code,
            retry: code.retry_class(),
            reason: bound_reason(reason.as_ref()),
            field: String::new(),
            issue_uuid: None,
            incident_id: None,
        }
    }

    /// Names the offending field (dotted path).
    #[must_use]
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }

    /// Names the command concerned.
    #[must_use]
    pub fn with_issue(mut self, issue_uuid: Uuid7) -> Self {
        self.issue_uuid = Some(issue_uuid);
        self
    }

    /// Names the storage incident concerned.
    #[must_use]
    pub fn with_incident(mut self, incident_id: impl Into<String>) -> Self {
        self.incident_id = Some(incident_id.into());
        self
    }

    /// Overrides the retry class (e.g. a local I/O failure reported with a
    /// code whose default is permanent).
    #[must_use]
    pub fn with_retry(mut self, retry: RetryClass) -> Self {
        self.retry = retry;
        self
    }

    /// The stable code.
    #[must_use]
    pub fn code(&self) -> Code {
        self.code
    }

    /// The retry class.
    #[must_use]
    pub fn retry_class(&self) -> RetryClass {
        self.retry
    }

    /// The bounded reason text.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The offending field, empty when none.
    #[must_use]
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The structured detail shared by every transport.
    #[must_use]
    pub fn to_detail(&self) -> wire::ErrorDetail {
        wire::ErrorDetail {
            code: self.code.to_wire() as i32,
            retry_class: match self.retry {
                RetryClass::Transient => wire::RetryClass::Transient,
                RetryClass::Permanent => wire::RetryClass::Permanent,
            } as i32,
            reason: self.reason.clone(),
            field: self.field.clone(),
            issue_uuid: self.issue_uuid.map(|u| u.to_string()),
            incident_id: self.incident_id.clone(),
            ..Default::default()
        }
    }

    /// The agent-protocol rejection message.
    #[must_use]
    pub fn to_control_error(&self) -> wire::ControlError {
        wire::ControlError {
            detail: Some(self.to_detail()),
        }
    }

    /// The gRPC status: canonical code, message, and the encoded
    /// `google.rpc.Status` for the `grpc-status-details-bin` trailer.
    #[must_use]
    pub fn to_grpc(&self) -> GrpcStatus {
        let code = self.code.grpc_code();
        let message = self.to_string();
        let status = RpcStatus {
            code: code as i32,
            message: message.clone(),
            details: vec![prost_types::Any {
                type_url: ERROR_DETAIL_TYPE_URL.to_owned(),
                value: self.to_detail().encode_to_vec(),
            }],
        };
        GrpcStatus {
            code,
            message,
            details: status.encode_to_vec(),
        }
    }

    /// Reads the detail back out of a status-details payload made by
    /// [`Self::to_grpc`] (used by `rvc`). `None` when absent or foreign.
    #[must_use]
    pub fn detail_from_grpc(details: &[u8]) -> Option<wire::ErrorDetail> {
        let status = RpcStatus::decode(details).ok()?;
        status
            .details
            .into_iter()
            .find(|a| a.type_url == ERROR_DETAIL_TYPE_URL)
            .and_then(|a| wire::ErrorDetail::decode(a.value.as_slice()).ok())
    }

    /// The JSON-RPC 2.0 error object (`error` member), with the detail in
    /// protobuf-JSON form (lower-camel names, enum names as strings).
    #[must_use]
    pub fn to_jsonrpc(&self) -> serde_json::Value {
        let mut data = serde_json::Map::new();
        data.insert(
            "code".into(),
            format!("ERROR_CODE_{}", self.code.as_str()).into(),
        );
        data.insert(
            "retryClass".into(),
            match self.retry {
                RetryClass::Transient => "RETRY_CLASS_TRANSIENT",
                RetryClass::Permanent => "RETRY_CLASS_PERMANENT",
            }
            .into(),
        );
        data.insert("reason".into(), self.reason.clone().into());
        if !self.field.is_empty() {
            data.insert("field".into(), self.field.clone().into());
        }
        if let Some(u) = self.issue_uuid {
            data.insert("issueUuid".into(), u.to_string().into());
        }
        if let Some(i) = &self.incident_id {
            data.insert("incidentId".into(), i.clone().into());
        }
        serde_json::json!({
            "code": JSONRPC_DOMAIN_ERROR,
            "message": self.to_string(),
            "data": data,
        })
    }
}

impl fmt::Display for DomainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.code, self.reason)
        } else {
            write!(f, "{}: {}: {}", self.code, self.field, self.reason)
        }
    }
}

impl std::error::Error for DomainError {}

impl From<IdError> for DomainError {
    fn from(e: IdError) -> Self {
        Self::new(Code::InvalidArgument, e.to_string()).with_field(e.field())
    }
}

impl From<TransitionError> for DomainError {
    fn from(e: TransitionError) -> Self {
        let code = match e {
            TransitionError::StaleRevision { .. } => Code::StaleRevision,
            TransitionError::RevisionWentBack { .. } | TransitionError::UnknownLifecycle(_) => {
                Code::ProtocolError
            }
            TransitionError::RevisionExhausted => Code::Internal,
            TransitionError::Illegal { .. } | TransitionError::FromTerminal { .. } => {
                Code::IllegalTransition
            }
        };
        Self::new(code, e.to_string())
    }
}

impl From<TokenError> for DomainError {
    fn from(e: TokenError) -> Self {
        Self::new(Code::InvalidArgument, e.to_string()).with_field("page_token")
    }
}

/// A gRPC status built from a [`DomainError`]; the shell turns it into a
/// `tonic::Status` with `Status::with_details(code, message, details)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcStatus {
    /// Canonical code.
    pub code: GrpcCode,
    /// Human-readable message (`CODE: field: reason`).
    pub message: String,
    /// Encoded `google.rpc.Status`.
    pub details: Vec<u8>,
}

/// `google.rpc.Status`, declared here field-for-field (the well-known
/// google/rpc/status.proto) so the core needs no gRPC dependency.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_numbers_are_stable_and_round_trip() {
        for (i, code) in Code::ALL.into_iter().enumerate() {
            assert_eq!(code.to_wire() as usize, i + 1, "{code}");
            assert_eq!(Code::from_wire(code.to_wire() as i32), Some(code));
            assert_eq!(
                code.to_wire().as_str_name(),
                format!("ERROR_CODE_{}", code.as_str())
            );
            assert_eq!(usize::from(code.exit_status()), i + 11);
        }
        assert_eq!(Code::from_wire(0), None);
        assert_eq!(Code::from_wire(1000), None);
    }

    #[test]
    fn request_conflict_is_already_exists() {
        let e = DomainError::new(Code::Conflict, "request_id reused with a different request")
            .with_field("request_id");
        let g = e.to_grpc();
        assert_eq!(g.code, GrpcCode::AlreadyExists);
        let d = DomainError::detail_from_grpc(&g.details).unwrap();
        assert_eq!(d.code, wire::ErrorCode::Conflict as i32);
        assert_eq!(d.retry_class, wire::RetryClass::Permanent as i32);
        assert_eq!(d.field, "request_id");
        assert_eq!(d, e.to_detail());
    }

    #[test]
    fn all_transports_carry_the_same_detail() {
        let issue = Uuid7::parse("x", "01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
        let e = DomainError::new(Code::Unavailable, "scope is recovering")
            .with_issue(issue)
            .with_incident("01890a5d-ac96-774b-bcce-b302099a8058");
        let detail = e.to_detail();
        assert_eq!(e.to_control_error().detail.as_ref(), Some(&detail));
        let j = e.to_jsonrpc();
        assert_eq!(j["code"], JSONRPC_DOMAIN_ERROR);
        assert_eq!(j["data"]["code"], "ERROR_CODE_UNAVAILABLE");
        assert_eq!(j["data"]["retryClass"], "RETRY_CLASS_TRANSIENT");
        assert_eq!(j["data"]["issueUuid"], issue.to_string());
        assert_eq!(e.to_grpc().code, GrpcCode::Unavailable);
    }

    #[test]
    fn reasons_are_bounded_on_a_char_boundary() {
        let long = "\u{e9}".repeat(5000);
        let e = DomainError::new(Code::Internal, &long);
        assert!(e.reason().len() as u64 <= MAX_REASON_BYTES);
        assert!(e.reason().ends_with("[truncated]"));
        assert_eq!(bound_reason("short"), "short");
    }

    #[test]
    fn conversions_keep_the_field() {
        let e: DomainError = Uuid7::parse("issue_uuid", "nope").unwrap_err().into();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert_eq!(e.field(), "issue_uuid");
        let e: DomainError = TransitionError::StaleRevision {
            expected: 1,
            current: 2,
        }
        .into();
        assert_eq!(e.code(), Code::StaleRevision);
        assert_eq!(e.retry_class(), RetryClass::Transient);
        let e: DomainError = TokenError::FilterMismatch.into();
        assert_eq!(e.field(), "page_token");
    }

    #[test]
    fn foreign_details_are_ignored() {
        assert!(DomainError::detail_from_grpc(b"\xff\xff").is_none());
        assert!(DomainError::detail_from_grpc(&[]).is_none());
    }
}
