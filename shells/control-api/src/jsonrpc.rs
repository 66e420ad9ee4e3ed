//! The JSON-RPC 2.0 request envelope of the server's adapter (plan §9.3),
//! as pure functions of the request body: the method table, the error
//! codes, the envelope rules and the reading of `params` as the method's
//! request message. The adapter in `rvbox-server` serves HTTP and calls
//! the Control service; everything it decides about a body before that
//! call is here, so it can be tested and fuzzed without a server.

use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use serde_json::{Value, json};

use crate::json;

/// JSON-RPC: the body is not JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: not a valid request object (or a form this adapter refuses).
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC: no such method.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC: `params` is not the method's request message.
pub const INVALID_PARAMS: i64 = -32602;
/// JSON-RPC: the answer could not be written.
pub const INTERNAL_ERROR: i64 = -32603;

/// The methods, lower camel case, and whether each is a mutation (which
/// gets a server-made `requestId` when the caller sends none).
pub const METHODS: [(&str, bool); 26] = [
    ("listClients", false),
    ("getClient", false),
    ("listCommands", false),
    ("getCommand", false),
    ("authorizeClientTakeover", true),
    ("runCommand", true),
    ("appendStdin", true),
    ("closeStdin", true),
    ("signalCommand", true),
    ("getOutput", false),
    ("listStorageIncidents", false),
    ("repairStorageIncident", true),
    ("acknowledgeStorageIncident", true),
    ("runFleet", true),
    ("getFleetRun", false),
    ("listFleetRuns", false),
    ("listFleetTargets", false),
    ("signalFleetRun", true),
    ("cancelFleetRun", true),
    ("pauseFleetRun", true),
    ("resumeFleetRun", true),
    ("openPtySession", true),
    ("writePtyInput", true),
    ("resizePtySession", true),
    ("closePtySession", true),
    ("listPtySessions", false),
];

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    /// The JSON-RPC error code.
    pub code: i64,
    /// The message.
    pub message: String,
    /// The `data` member: the gRPC `ErrorDetail` of a domain refusal.
    pub data: Option<Value>,
}

impl RpcError {
    /// An error without data.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// A domain refusal: the one server-error code, with the detail.
    #[must_use]
    pub fn domain(detail: &wire::ErrorDetail, message: String) -> Self {
        Self {
            code: rvbox_domain::error::JSONRPC_DOMAIN_ERROR,
            message,
            data: json::to_value("rvbox.v1.ErrorDetail", detail).ok(),
        }
    }

    /// The rvbox.v1 error code an audit record names for this error.
    #[must_use]
    pub fn audit_code(&self) -> i32 {
        let domain = self
            .data
            .as_ref()
            .and_then(|d| d.get("code"))
            .and_then(Value::as_str)
            .and_then(wire::ErrorCode::from_str_name);
        domain.map_or_else(
            || {
                let code = if self.code == METHOD_NOT_FOUND {
                    Code::Unsupported
                } else if self.code == rvbox_domain::error::JSONRPC_DOMAIN_ERROR {
                    Code::Internal
                } else {
                    Code::InvalidArgument
                };
                code.to_wire() as i32
            },
            |c| c as i32,
        )
    }

    /// The error object as JSON.
    #[must_use]
    pub fn to_value(&self) -> Value {
        let mut e = json!({ "code": self.code, "message": self.message });
        if let (Some(data), Some(obj)) = (&self.data, e.as_object_mut()) {
            obj.insert("data".into(), data.clone());
        }
        e
    }
}

/// A JSON-RPC method name (`getCommand`) as its gRPC method (`GetCommand`).
#[must_use]
pub fn pascal(method: &str) -> String {
    let mut c = method.chars();
    c.next().map_or_else(String::new, |f| {
        f.to_ascii_uppercase().to_string() + c.as_str()
    })
}

/// The request envelope: `(id, method, params)`, or the error to answer
/// with the id it carried (null when unknown). A mutation whose `params`
/// carry no `requestId` (or an empty one) gets `new_request_id()`.
///
/// # Errors
/// The JSON-RPC error to answer with, and the id to answer it under.
pub fn envelope(
    body: &[u8],
    new_request_id: impl FnOnce() -> String,
) -> Result<(Value, &'static str, Value), (Value, RpcError)> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        (
            Value::Null,
            RpcError::new(PARSE_ERROR, format!("parse error: {e}")),
        )
    })?;
    let obj = match v {
        Value::Array(_) => {
            return Err((
                Value::Null,
                RpcError::new(
                    INVALID_REQUEST,
                    "batch requests are not supported: send one request per HTTP request",
                ),
            ));
        }
        Value::Object(o) => o,
        _ => {
            return Err((
                Value::Null,
                RpcError::new(INVALID_REQUEST, "the request must be a JSON object"),
            ));
        }
    };
    let id = match obj.get("id") {
        None => {
            return Err((
                Value::Null,
                RpcError::new(
                    INVALID_REQUEST,
                    "notifications are not supported: every request needs an id",
                ),
            ));
        }
        Some(id @ (Value::String(_) | Value::Number(_) | Value::Null)) => id.clone(),
        Some(_) => {
            return Err((
                Value::Null,
                RpcError::new(INVALID_REQUEST, "id must be a string, a number or null"),
            ));
        }
    };
    if obj.get("jsonrpc") != Some(&Value::String("2.0".into())) {
        return Err((
            id,
            RpcError::new(INVALID_REQUEST, "jsonrpc must be \"2.0\""),
        ));
    }
    let Some(Value::String(name)) = obj.get("method") else {
        return Err((
            id,
            RpcError::new(INVALID_REQUEST, "method must be a string"),
        ));
    };
    let Some((method, mutation)) = METHODS.iter().find(|(m, _)| m == name).copied() else {
        return Err((
            id,
            RpcError::new(
                METHOD_NOT_FOUND,
                format!("no method {name:?}; the methods are {}", names()),
            ),
        ));
    };
    let mut params = match obj.get("params") {
        None => Value::Object(serde_json::Map::new()),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err((
                id,
                RpcError::new(
                    INVALID_PARAMS,
                    "params must be an object: the method's request message",
                ),
            ));
        }
    };
    if mutation && let Some(p) = params.as_object_mut() {
        let missing = p
            .get("requestId")
            .is_none_or(|r| r.as_str().is_some_and(str::is_empty));
        if missing {
            p.insert("requestId".into(), new_request_id().into());
        }
    }
    Ok((id, method, params))
}

/// The method names, comma separated.
#[must_use]
pub fn names() -> String {
    METHODS
        .iter()
        .map(|(m, _)| *m)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `params` as the request message `rvbox.v1.<name>`, within the control
/// request size.
///
/// # Errors
/// `INVALID_PARAMS` naming what is wrong, or the `TOO_LARGE` refusal.
pub fn parse<M: prost::Message + Default>(
    name: &str,
    params: Value,
    max_request: usize,
) -> Result<M, RpcError> {
    let m: M = json::from_value(&format!("rvbox.v1.{name}"), params)
        .map_err(|e| RpcError::new(INVALID_PARAMS, format!("params are not a {name}: {e}")))?;
    if m.encoded_len() > max_request {
        let e = DomainError::new(
            Code::TooLarge,
            format!(
                "the request is {} bytes; limits.max_control_request is {max_request}",
                m.encoded_len()
            ),
        );
        return Err(RpcError::domain(&e.to_detail(), e.to_string()));
    }
    Ok(m)
}

/// `m` as the JSON of `rvbox.v1.<name>`.
///
/// # Errors
/// `-32603` when the message cannot be written (a type and name mismatch).
pub fn result<M: prost::Message>(name: &str, m: &M) -> Result<Value, RpcError> {
    json::to_value(&format!("rvbox.v1.{name}"), m)
        .map_err(|e| RpcError::new(INTERNAL_ERROR, format!("internal error: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn err(body: &str) -> (Value, i64) {
        let (id, e) = envelope(body.as_bytes(), || "made".into()).err().unwrap();
        (id, e.code)
    }

    #[test]
    fn the_envelope_rules() {
        assert_eq!(err("{nope").1, PARSE_ERROR);
        assert_eq!(err("[]").1, INVALID_REQUEST, "no batches");
        assert_eq!(
            err(r#"{"jsonrpc":"2.0","method":"getCommand"}"#).1,
            INVALID_REQUEST,
            "no notifications"
        );
        assert_eq!(
            err(r#"{"jsonrpc":"1.0","id":7,"method":"getCommand"}"#),
            (json!(7), INVALID_REQUEST)
        );
        assert_eq!(
            err(r#"{"jsonrpc":"2.0","id":"a","method":"followCommand"}"#),
            (json!("a"), METHOD_NOT_FOUND),
            "no streaming method"
        );
        assert_eq!(
            err(r#"{"jsonrpc":"2.0","id":1,"method":"getCommand","params":[1]}"#).1,
            INVALID_PARAMS
        );
        let (_, m, p) = envelope(
            br#"{"jsonrpc":"2.0","id":1,"method":"closeStdin","params":{"issueUuid":"x"}}"#,
            || "made".into(),
        )
        .ok()
        .unwrap();
        assert_eq!(m, "closeStdin");
        assert_eq!(
            p["requestId"], "made",
            "a mutation without requestId gets one"
        );
        let (_, _, p) = envelope(br#"{"jsonrpc":"2.0","id":1,"method":"getCommand"}"#, || {
            "made".into()
        })
        .ok()
        .unwrap();
        assert!(p.get("requestId").is_none(), "a read gets none");
    }

    #[test]
    fn every_method_has_a_request_message() {
        for (m, _) in METHODS {
            let name = format!("{}Request", pascal(m));
            let r: Result<wire::GetCommandRequest, _> = parse(&name, json!({}), 1 << 20);
            // a message of another type may refuse `{}` only for its name
            if let Err(e) = r {
                assert!(!e.message.contains("no message"), "{m}: {}", e.message);
            }
        }
    }
}
