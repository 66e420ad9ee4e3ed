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
use rvbox_control_api::jsonrpc::{
    INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, METHODS, PARSE_ERROR, RpcError, envelope,
    parse, pascal, result,
};
use rvbox_control_api::v1::control_server::Control;
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use rvbox_server_core::Caller;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::control::ControlService;

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

/// A refusal the Control service answered, as a JSON-RPC error.
fn from_status(s: &tonic::Status) -> RpcError {
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
    RpcError::domain(&detail, s.message().to_owned())
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
    let (id, method, outcome) =
        match envelope(&body, || uuid::Uuid::now_v7().hyphenated().to_string()) {
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

macro_rules! unary {
    ($service:expr, $params:expr, $caller:expr, $max:expr, $rpc:ident, $req:ident, $resp:ident) => {{
        let req: wire::$req = parse(stringify!($req), $params, $max)?;
        let mut request = tonic::Request::new(req);
        request.extensions_mut().insert($caller);
        let resp = Control::$rpc($service, request)
            .await
            .map_err(|s| from_status(&s))?
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
