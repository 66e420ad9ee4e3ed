//! The JSON-RPC 2.0 adapter (plan §9.3): off unless `jsonrpc.enabled`,
//! HTTP `POST /` on `jsonrpc.listen` (127.0.0.1:6900 by default), and
//! nothing of its own beside the envelope: each method is the unary
//! Control RPC of the same name, called on the same service with its
//! request and response in canonical proto3 JSON (`rvbox-control-api`'s
//! `json`), so results, refusals and idempotency are the gRPC ones.
//!
//! - Methods: `listClients`, `getClient`, `listCommands`, `getCommand`,
//!   `authorizeClientTakeover`, `runCommand`, `appendStdin`, `closeStdin`,
//!   `signalCommand`, `getOutput`, `listStorageIncidents`,
//!   `repairStorageIncident`, `acknowledgeStorageIncident`. There is no
//!   streaming: callers poll `getOutput` and `getCommand` by cursor.
//! - `params` is the request message (an object, or absent for an empty
//!   one). A mutation without `requestId` gets a server-made UUIDv7 (so
//!   only a caller that sends and reuses its own gets retry idempotency).
//!   The JSON-RPC `id` only correlates the answer.
//! - Errors: `-32700` parse error, `-32600` invalid request (also a batch,
//!   a notification, or a body over `jsonrpc.max_body`), `-32601` method not
//!   found, `-32602` params that are not the request message (an unknown
//!   member, a wrong type, an unknown enum name); every domain refusal is
//!   `-32000` with the gRPC `ErrorDetail` as `data`.
//! - Every call is audited as the gRPC one is, with transport `json-rpc`
//!   and the peer address as principal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rvbox_control_api::json;
use rvbox_control_api::v1::control_server::Control;
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use rvbox_server_core::Caller;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::control::ControlService;

/// JSON-RPC: the body is not JSON.
pub(crate) const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: not a valid request object (or a form this adapter refuses).
pub(crate) const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC: no such method.
pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC: `params` is not the method's request message.
pub(crate) const INVALID_PARAMS: i64 = -32602;
/// Reading a request's headers may take this long.
const HEADER_DEADLINE: Duration = Duration::from_secs(10);

/// A method and its outcome, as counted (bounded: the method names are
/// the fixed list or `unknown`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CallLabel {
    pub(crate) method: &'static str,
    pub(crate) outcome: &'static str,
}

/// The adapter's metrics.
#[derive(Debug, Default)]
pub(crate) struct JsonRpcMetrics {
    pub(crate) calls: Family<CallLabel, Counter>,
}

impl JsonRpcMetrics {
    /// Registers the adapter's metrics under the `rvbox_server` prefix.
    pub(crate) fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.sub_registry_with_prefix("rvbox_server").register(
            "jsonrpc_calls",
            "JSON-RPC requests, by method and outcome",
            self.calls.clone(),
        );
    }
}

/// The methods, lower camel case, and whether each is a mutation (which
/// gets a server-made `requestId` when the caller sends none).
const METHODS: [(&str, bool); 26] = [
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
struct RpcError {
    code: i64,
    message: String,
    data: Option<Value>,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// A domain refusal: the one server-error code, with the detail.
    fn domain(detail: &wire::ErrorDetail, message: String) -> Self {
        Self {
            code: rvbox_domain::error::JSONRPC_DOMAIN_ERROR,
            message,
            data: json::to_value("rvbox.v1.ErrorDetail", detail).ok(),
        }
    }

    fn from_status(s: &tonic::Status) -> Self {
        let detail = DomainError::detail_from_grpc(s.details()).unwrap_or_else(|| {
            // a status the service made without a detail (the transport's
            // own): the same class as a domain code
            let code = match s.code() {
                tonic::Code::InvalidArgument => Code::InvalidArgument,
                tonic::Code::NotFound => Code::NotFound,
                tonic::Code::ResourceExhausted | tonic::Code::OutOfRange => Code::TooLarge,
                tonic::Code::Unimplemented => Code::Unsupported,
                tonic::Code::Unavailable => Code::Unavailable,
                _ => Code::Internal,
            };
            DomainError::new(code, s.message()).to_detail()
        });
        Self::domain(&detail, s.message().to_owned())
    }

    /// The rvbox.v1 error code an audit record names for this error.
    fn audit_code(&self) -> i32 {
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

    fn to_value(&self) -> Value {
        let mut e = json!({ "code": self.code, "message": self.message });
        if let (Some(data), Some(obj)) = (&self.data, e.as_object_mut()) {
            obj.insert("data".into(), data.clone());
        }
        e
    }
}

/// Serves the adapter on `listener` until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    service: ControlService,
    max_body: usize,
    max_request: usize,
    metrics: Arc<JsonRpcMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "JSON-RPC accept failed; pausing the listener");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let service = service.clone();
                let metrics = Arc::clone(&metrics);
                async move {
                    Ok::<_, std::convert::Infallible>(
                        handle(req, peer, &service, max_body, max_request, &metrics).await,
                    )
                }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, %peer, "JSON-RPC connection ended with an error");
            }
        });
    }
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error_reply(status: StatusCode, id: Value, e: &RpcError) -> Response<Full<Bytes>> {
    reply(
        status,
        &json!({ "jsonrpc": "2.0", "id": id, "error": e.to_value() }),
    )
}

async fn handle(
    req: Request<Incoming>,
    peer: SocketAddr,
    service: &ControlService,
    max_body: usize,
    max_request: usize,
    metrics: &JsonRpcMetrics,
) -> Response<Full<Bytes>> {
    if req.method() != Method::POST || req.uri().path() != "/" {
        let mut r = error_reply(
            StatusCode::METHOD_NOT_ALLOWED,
            Value::Null,
            &RpcError::new(INVALID_REQUEST, "JSON-RPC requests are POST /"),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
        return r;
    }
    let body = match Limited::new(req.into_body(), max_body).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let too_large = e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some();
            metrics
                .calls
                .get_or_create(&CallLabel {
                    method: "unknown",
                    outcome: "invalid_request",
                })
                .inc();
            return if too_large {
                error_reply(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    Value::Null,
                    &RpcError::new(
                        INVALID_REQUEST,
                        format!("the request body exceeds jsonrpc.max_body ({max_body} bytes)"),
                    ),
                )
            } else {
                error_reply(
                    StatusCode::BAD_REQUEST,
                    Value::Null,
                    &RpcError::new(
                        INVALID_REQUEST,
                        format!("the request body ended early: {e}"),
                    ),
                )
            };
        }
    };
    let (id, method, outcome) = match envelope(&body) {
        Err((id, e)) => {
            // refused before any method: audited as such
            service
                .shared()
                .edge_audit(rvbox_store_port::audit::SessionAudit {
                    client_id: None,
                    action: "InvalidRequest",
                    detail: e.message.clone(),
                    caller: Some(Caller {
                        transport: "json-rpc".into(),
                        principal: peer.to_string(),
                    }),
                    issue_uuid: None,
                    error_code: Some(e.audit_code()),
                });
            metrics
                .calls
                .get_or_create(&CallLabel {
                    method: "unknown",
                    outcome: if e.code == PARSE_ERROR {
                        "parse_error"
                    } else {
                        "invalid_request"
                    },
                })
                .inc();
            return error_reply(StatusCode::OK, id, &e);
        }
        Ok((id, method, params)) => {
            let caller = Caller {
                transport: "json-rpc".into(),
                principal: peer.to_string(),
            };
            let (outcome, probe) = crate::edge_audit::probed(call(
                service,
                method,
                params,
                caller.clone(),
                max_request,
            ))
            .await;
            let (code, message) = match &outcome {
                Ok(_) => (0, String::new()),
                Err(e) => (e.audit_code(), e.message.clone()),
            };
            let action = crate::edge_audit::method_name(&pascal(method));
            if let Some(r) = probe.record(action, caller, code, &message) {
                service.shared().edge_audit(r);
            }
            (id, method, outcome)
        }
    };
    let label = METHODS
        .iter()
        .find(|(m, _)| *m == method)
        .map_or("unknown", |(m, _)| m);
    let (kind, body) = match outcome {
        Ok(result) => (
            "ok",
            json!({ "jsonrpc": "2.0", "id": id, "result": result }),
        ),
        Err(e) => {
            let kind = match e.code {
                METHOD_NOT_FOUND => "method_not_found",
                INVALID_PARAMS => "invalid_params",
                _ => "refused",
            };
            (
                kind,
                json!({ "jsonrpc": "2.0", "id": id, "error": e.to_value() }),
            )
        }
    };
    metrics
        .calls
        .get_or_create(&CallLabel {
            method: label,
            outcome: kind,
        })
        .inc();
    reply(StatusCode::OK, &body)
}

/// A JSON-RPC method name (`getCommand`) as its gRPC method (`GetCommand`).
fn pascal(method: &str) -> String {
    let mut c = method.chars();
    c.next().map_or_else(String::new, |f| {
        f.to_ascii_uppercase().to_string() + c.as_str()
    })
}

/// The request envelope: `(id, method, params)`, or the error to answer
/// with the id it carried (null when unknown).
fn envelope(body: &[u8]) -> Result<(Value, &'static str, Value), (Value, RpcError)> {
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
            p.insert(
                "requestId".into(),
                uuid::Uuid::now_v7().hyphenated().to_string().into(),
            );
        }
    }
    Ok((id, method, params))
}

fn names() -> String {
    METHODS
        .iter()
        .map(|(m, _)| *m)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `params` as the request message `rvbox.v1.<name>`, within the control
/// request size.
fn parse<M: prost::Message + Default>(
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

fn result<M: prost::Message>(name: &str, m: &M) -> Result<Value, RpcError> {
    json::to_value(&format!("rvbox.v1.{name}"), m)
        .map_err(|e| RpcError::new(-32603, format!("internal error: {e}")))
}

macro_rules! unary {
    ($service:expr, $params:expr, $caller:expr, $max:expr, $rpc:ident, $req:ident, $resp:ident) => {{
        let req: wire::$req = parse(stringify!($req), $params, $max)?;
        let mut request = tonic::Request::new(req);
        request.extensions_mut().insert($caller);
        let resp = Control::$rpc($service, request)
            .await
            .map_err(|s| RpcError::from_status(&s))?
            .into_inner();
        result(stringify!($resp), &resp)
    }};
}

async fn call(
    service: &ControlService,
    method: &str,
    params: Value,
    caller: Caller,
    max: usize,
) -> Result<Value, RpcError> {
    match method {
        "listClients" => unary!(
            service,
            params,
            caller,
            max,
            list_clients,
            ListClientsRequest,
            ListClientsResponse
        ),
        "getClient" => unary!(
            service,
            params,
            caller,
            max,
            get_client,
            GetClientRequest,
            GetClientResponse
        ),
        "listCommands" => unary!(
            service,
            params,
            caller,
            max,
            list_commands,
            ListCommandsRequest,
            ListCommandsResponse
        ),
        "getCommand" => unary!(
            service,
            params,
            caller,
            max,
            get_command,
            GetCommandRequest,
            GetCommandResponse
        ),
        "authorizeClientTakeover" => unary!(
            service,
            params,
            caller,
            max,
            authorize_client_takeover,
            AuthorizeClientTakeoverRequest,
            AuthorizeClientTakeoverResponse
        ),
        "runCommand" => unary!(
            service,
            params,
            caller,
            max,
            run_command,
            RunCommandRequest,
            RunCommandResponse
        ),
        "appendStdin" => unary!(
            service,
            params,
            caller,
            max,
            append_stdin,
            AppendStdinRequest,
            AppendStdinResponse
        ),
        "closeStdin" => unary!(
            service,
            params,
            caller,
            max,
            close_stdin,
            CloseStdinRequest,
            CloseStdinResponse
        ),
        "signalCommand" => unary!(
            service,
            params,
            caller,
            max,
            signal_command,
            SignalCommandRequest,
            SignalCommandResponse
        ),
        "getOutput" => unary!(
            service,
            params,
            caller,
            max,
            get_output,
            GetOutputRequest,
            GetOutputResponse
        ),
        "listStorageIncidents" => unary!(
            service,
            params,
            caller,
            max,
            list_storage_incidents,
            ListStorageIncidentsRequest,
            ListStorageIncidentsResponse
        ),
        "repairStorageIncident" => unary!(
            service,
            params,
            caller,
            max,
            repair_storage_incident,
            RepairStorageIncidentRequest,
            RepairStorageIncidentResponse
        ),
        "acknowledgeStorageIncident" => unary!(
            service,
            params,
            caller,
            max,
            acknowledge_storage_incident,
            AcknowledgeStorageIncidentRequest,
            AcknowledgeStorageIncidentResponse
        ),
        "runFleet" => unary!(
            service,
            params,
            caller,
            max,
            run_fleet,
            RunFleetRequest,
            RunFleetResponse
        ),
        "getFleetRun" => unary!(
            service,
            params,
            caller,
            max,
            get_fleet_run,
            GetFleetRunRequest,
            GetFleetRunResponse
        ),
        "listFleetRuns" => unary!(
            service,
            params,
            caller,
            max,
            list_fleet_runs,
            ListFleetRunsRequest,
            ListFleetRunsResponse
        ),
        "listFleetTargets" => unary!(
            service,
            params,
            caller,
            max,
            list_fleet_targets,
            ListFleetTargetsRequest,
            ListFleetTargetsResponse
        ),
        "signalFleetRun" => unary!(
            service,
            params,
            caller,
            max,
            signal_fleet_run,
            SignalFleetRunRequest,
            SignalFleetRunResponse
        ),
        "cancelFleetRun" => unary!(
            service,
            params,
            caller,
            max,
            cancel_fleet_run,
            CancelFleetRunRequest,
            CancelFleetRunResponse
        ),
        "pauseFleetRun" => unary!(
            service,
            params,
            caller,
            max,
            pause_fleet_run,
            PauseFleetRunRequest,
            PauseFleetRunResponse
        ),
        "resumeFleetRun" => unary!(
            service,
            params,
            caller,
            max,
            resume_fleet_run,
            ResumeFleetRunRequest,
            ResumeFleetRunResponse
        ),
        "openPtySession" => unary!(
            service,
            params,
            caller,
            max,
            open_pty_session,
            OpenPtySessionRequest,
            OpenPtySessionResponse
        ),
        "writePtyInput" => unary!(
            service,
            params,
            caller,
            max,
            write_pty_input,
            WritePtyInputRequest,
            WritePtyInputResponse
        ),
        "resizePtySession" => unary!(
            service,
            params,
            caller,
            max,
            resize_pty_session,
            ResizePtySessionRequest,
            ResizePtySessionResponse
        ),
        "closePtySession" => unary!(
            service,
            params,
            caller,
            max,
            close_pty_session,
            ClosePtySessionRequest,
            ClosePtySessionResponse
        ),
        "listPtySessions" => unary!(
            service,
            params,
            caller,
            max,
            list_pty_sessions,
            ListPtySessionsRequest,
            ListPtySessionsResponse
        ),
        other => Err(RpcError::new(
            METHOD_NOT_FOUND,
            format!("no method {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn err(body: &str) -> (Value, i64) {
        let (id, e) = envelope(body.as_bytes()).err().unwrap();
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
        )
        .ok()
        .unwrap();
        assert_eq!(m, "closeStdin");
        let made = p["requestId"].as_str().unwrap();
        assert!(
            rvbox_domain::ids::Uuid7::parse("requestId", made).is_ok(),
            "a mutation without requestId gets a UUIDv7: {made}"
        );
        let (_, _, p) = envelope(br#"{"jsonrpc":"2.0","id":1,"method":"getCommand"}"#)
            .ok()
            .unwrap();
        assert!(p.get("requestId").is_none(), "a read gets none");
    }
}
