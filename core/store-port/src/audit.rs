//! Who an audit record names, and the session records that have no store
//! effect of their own (plan §5.2 `audit_events`, §6.2 "stale or unknown
//! session traffic is discarded/audited").
//!
//! Audit records of effects are written by the backend inside the
//! effect's own transaction (a registration, a fence, a refused live
//! claim, a session close, every control mutation). Only what changes
//! nothing durable (a hello that failed validation, traffic of an unknown
//! session) is a record of its own, [`SessionAudit`].

/// Transport name of the agent WebSocket endpoint.
pub const AGENT_TRANSPORT: &str = "agent-wss";
/// Largest `detail` a session record keeps.
pub const MAX_SESSION_AUDIT_DETAIL: usize = 1024;

/// Who asked for an action, as recorded in the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Transport (`grpc-unix`, `json-rpc`, `offline-repair`, `agent-wss`,
    /// `local`).
    pub transport: String,
    /// Principal as the transport knows it (e.g. `uid:0`); may be empty.
    pub principal: String,
}

impl Caller {
    /// A caller inside the server process itself (tools, tests, the
    /// simulator): transport `local`, no principal.
    #[must_use]
    pub fn local() -> Self {
        Self {
            transport: "local".into(),
            principal: String::new(),
        }
    }
}

/// An audit record that no store effect carries: session traffic that
/// changed nothing, an operator's read, a request refused at an edge
/// before it reached the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionAudit {
    /// The client, once the hello named one (or the client a read was
    /// about).
    pub client_id: Option<String>,
    /// What happened (a bounded name, e.g. `HelloRejected`, `GetCommand`).
    pub action: &'static str,
    /// Bounded, payload-free explanation.
    pub detail: String,
    /// Who asked, when not a client daemon on the agent endpoint (an
    /// operator on the control socket or JSON-RPC).
    pub caller: Option<Caller>,
    /// The command concerned.
    pub issue_uuid: Option<[u8; 16]>,
    /// The rvbox.v1 error code of a refusal; `None`: it was not refused.
    pub error_code: Option<i32>,
}

impl SessionAudit {
    /// A record of session traffic on the agent endpoint.
    #[must_use]
    pub fn session(client_id: Option<String>, action: &'static str, detail: String) -> Self {
        Self {
            client_id,
            action,
            detail,
            caller: None,
            issue_uuid: None,
            error_code: None,
        }
    }
}
