//! The JSON-RPC 2.0 adapter against a running server and client: every
//! unary method sent through gRPC (the Unix socket) and through JSON-RPC
//! (HTTP on loopback) answers the same, field by field, results and
//! errors alike; the envelope's own rules (parse error, batches,
//! notifications, unknown methods, bad params, the body limit, a
//! server-made `requestId`) answer with the standard codes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::io::{Read as _, Write as _};

use rvbox_control_api::json;
use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use serde_json::{Value, json};
use support::{Stack, free_port};
use tonic::transport::Channel;

/// One HTTP request to the adapter; (status, body).
fn http(port: u16, method: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "{method} / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // a refused body may close the connection before all of it is sent
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let at = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |p| p + 4);
    (status, out[at..].to_vec())
}

/// A JSON-RPC call: the whole response object.
fn rpc(port: u16, method: &str, params: &Value) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let (status, out) = http(port, "POST", body.to_string().as_bytes());
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], 1);
    v
}

async fn grpc(s: &Stack) -> ControlClient<Channel> {
    ControlClient::new(support::control_channel(s.socket()).await)
}

/// The same request through both transports: equal answers, field by
/// field (a read whose state moved between the two calls is asked again).
macro_rules! parity {
    ($c:expr, $port:expr, $rpc:ident, $method:literal, $resp:literal, $req:expr) => {{
        let req = $req;
        let mut tries = 0;
        loop {
            let g = $c.$rpc(req.clone()).await;
            let params = json::to_value(
                &format!(
                    "rvbox.v1.{}",
                    std::any::type_name_of_val(&req)
                        .rsplit("::")
                        .next()
                        .unwrap()
                ),
                &req,
            )
            .unwrap();
            let j = rpc($port, $method, &params);
            let same = match (&g, j.get("result"), j.get("error")) {
                (Ok(r), Some(result), None) => {
                    let back =
                        json::from_value(concat!("rvbox.v1.", $resp), result.clone()).unwrap();
                    assert_eq!(
                        result,
                        &json::to_value(concat!("rvbox.v1.", $resp), r.get_ref()).unwrap()
                    );
                    r.get_ref() == &back
                }
                (Err(status), None, Some(error)) => {
                    let detail =
                        rvbox_domain::error::DomainError::detail_from_grpc(status.details())
                            .unwrap_or_else(|| panic!("{} without a detail: {status:?}", $method));
                    assert_eq!(error["code"], -32000, "{}: {error}", $method);
                    let data: wire::ErrorDetail =
                        json::from_value("rvbox.v1.ErrorDetail", error["data"].clone()).unwrap();
                    assert_eq!(data, detail, "{}: the same detail", $method);
                    true
                }
                _ => false,
            };
            if same {
                break (g, j);
            }
            tries += 1;
            assert!(tries < 5, "{}: gRPC {g:?} but JSON-RPC {j}", $method);
        }
    }};
}

fn uuid7() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

#[test]
fn every_unary_method_answers_the_same_through_grpc_and_json_rpc() {
    let port = free_port();
    let s = Stack::with_server_config(&format!(
        "[jsonrpc]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\nmax_body = \"2MiB\"\n"
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = grpc(&s).await;

        // mutations: the same requestId through both (the second is a
        // replay, so both answers are the stored one)
        let run = wire::RunCommandRequest {
            request_id: uuid7(),
            client_id: "web-1".into(),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText("cat".into())),
                ..Default::default()
            }),
            script: Vec::new(),
            queue_ttl: None,
        };
        let (g, _) = parity!(
            c,
            port,
            run_command,
            "runCommand",
            "RunCommandResponse",
            run.clone()
        );
        let issue = g.unwrap().into_inner().issue_uuid;
        s.wait_until("cat runs", || {
            String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &issue]).stdout)
                .contains("state     running")
        });
        let append = wire::AppendStdinRequest {
            request_id: uuid7(),
            issue_uuid: issue.clone(),
            data: b"from both\n".to_vec(),
            newline: wire::StdinNewline::Raw as i32,
        };
        let _ = parity!(
            c,
            port,
            append_stdin,
            "appendStdin",
            "AppendStdinResponse",
            append
        );
        let signal = wire::SignalCommandRequest {
            request_id: uuid7(),
            issue_uuid: issue.clone(),
            signal: wire::SignalKind::Usr1 as i32 + 100,
        };
        let _ = parity!(
            c,
            port,
            signal_command,
            "signalCommand",
            "SignalCommandResponse",
            signal
        );
        let close = wire::CloseStdinRequest {
            request_id: uuid7(),
            issue_uuid: issue.clone(),
        };
        let _ = parity!(
            c,
            port,
            close_stdin,
            "closeStdin",
            "CloseStdinResponse",
            close
        );
        s.wait_until("cat ends", || {
            String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &issue]).stdout).contains("succeeded")
        });

        // a fleet run and its reads and actions
        let fleet = wire::RunFleetRequest {
            request_id: uuid7(),
            selection: Some(wire::FleetSelection {
                selector: "role=web".into(),
                ..Default::default()
            }),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText(
                    "echo fleet".into(),
                )),
                ..Default::default()
            }),
            max_parallel: Some(wire::FleetLimit {
                limit: Some(wire::fleet_limit::Limit::Percent(50)),
            }),
            ..Default::default()
        };
        let (g, _) = parity!(c, port, run_fleet, "runFleet", "RunFleetResponse", fleet);
        let run_id = g.unwrap().into_inner().fleet_run_id;
        let get = wire::GetFleetRunRequest {
            request_id: String::new(),
            fleet_run_id: run_id.clone(),
        };
        let mut done = false;
        for _ in 0..300 {
            let r = c.get_fleet_run(get.clone()).await.unwrap().into_inner();
            if r.run.unwrap().state == wire::FleetRunState::Done as i32 {
                done = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(done, "the fleet run ends");
        let _ = parity!(
            c,
            port,
            get_fleet_run,
            "getFleetRun",
            "GetFleetRunResponse",
            get.clone()
        );
        let _ = parity!(
            c,
            port,
            list_fleet_runs,
            "listFleetRuns",
            "ListFleetRunsResponse",
            wire::ListFleetRunsRequest::default()
        );
        let (g, _) = parity!(
            c,
            port,
            list_fleet_targets,
            "listFleetTargets",
            "ListFleetTargetsResponse",
            wire::ListFleetTargetsRequest {
                fleet_run_id: run_id.clone(),
                state: wire::FleetTargetState::Succeeded as i32,
                ..Default::default()
            }
        );
        assert_eq!(g.unwrap().into_inner().targets.len(), 1);
        let _ = parity!(
            c,
            port,
            signal_fleet_run,
            "signalFleetRun",
            "SignalFleetRunResponse",
            wire::SignalFleetRunRequest {
                request_id: uuid7(),
                fleet_run_id: run_id.clone(),
                signal: wire::SignalKind::Hup as i32,
            }
        );
        let _ = parity!(
            c,
            port,
            pause_fleet_run,
            "pauseFleetRun",
            "PauseFleetRunResponse",
            wire::PauseFleetRunRequest {
                request_id: uuid7(),
                fleet_run_id: run_id.clone(),
            }
        );
        let _ = parity!(
            c,
            port,
            resume_fleet_run,
            "resumeFleetRun",
            "ResumeFleetRunResponse",
            wire::ResumeFleetRunRequest {
                request_id: uuid7(),
                fleet_run_id: run_id.clone(),
            }
        );
        let _ = parity!(
            c,
            port,
            cancel_fleet_run,
            "cancelFleetRun",
            "CancelFleetRunResponse",
            wire::CancelFleetRunRequest {
                request_id: uuid7(),
                fleet_run_id: run_id.clone(),
            }
        );
        // fleet errors
        let _ = parity!(
            c,
            port,
            get_fleet_run,
            "getFleetRun",
            "GetFleetRunResponse",
            wire::GetFleetRunRequest {
                request_id: String::new(),
                fleet_run_id: uuid7(),
            }
        );
        let _ = parity!(
            c,
            port,
            run_fleet,
            "runFleet",
            "RunFleetResponse",
            wire::RunFleetRequest {
                request_id: uuid7(),
                selection: Some(wire::FleetSelection {
                    selector: "role=a b".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }
        );

        // reads
        let _ = parity!(
            c,
            port,
            get_command,
            "getCommand",
            "GetCommandResponse",
            wire::GetCommandRequest {
                request_id: String::new(),
                issue_uuid: issue.clone(),
            }
        );
        let _ = parity!(
            c,
            port,
            list_commands,
            "listCommands",
            "ListCommandsResponse",
            wire::ListCommandsRequest {
                request_id: String::new(),
                client_id: Some("web-1".into()),
                page_size: 10,
                page_token: String::new(),
                selector: "role=web".into(),
            }
        );
        let _ = parity!(
            c,
            port,
            list_clients,
            "listClients",
            "ListClientsResponse",
            wire::ListClientsRequest {
                selector: "role=web,zone=eu-*".into(),
                client_glob: "web-*".into(),
                ..Default::default()
            }
        );
        let _ = parity!(
            c,
            port,
            get_client,
            "getClient",
            "GetClientResponse",
            wire::GetClientRequest {
                request_id: String::new(),
                client_id: "web-1".into(),
            }
        );
        let (g, j) = parity!(
            c,
            port,
            get_output,
            "getOutput",
            "GetOutputResponse",
            wire::GetOutputRequest {
                issue_uuid: issue.clone(),
                streams: vec![wire::OutputStream::Stdout as i32],
                ..Default::default()
            }
        );
        assert!(g.is_ok(), "{j}");
        let _ = parity!(
            c,
            port,
            list_storage_incidents,
            "listStorageIncidents",
            "ListStorageIncidentsResponse",
            wire::ListStorageIncidentsRequest::default()
        );

        // errors, field by field
        let _ = parity!(
            c,
            port,
            get_command,
            "getCommand",
            "GetCommandResponse",
            wire::GetCommandRequest {
                request_id: String::new(),
                issue_uuid: "not-a-uuid".into(),
            }
        );
        let _ = parity!(
            c,
            port,
            get_command,
            "getCommand",
            "GetCommandResponse",
            wire::GetCommandRequest {
                request_id: String::new(),
                issue_uuid: uuid7(),
            }
        );
        let _ = parity!(
            c,
            port,
            authorize_client_takeover,
            "authorizeClientTakeover",
            "AuthorizeClientTakeoverResponse",
            wire::AuthorizeClientTakeoverRequest {
                request_id: uuid7(),
                client_id: "web-1".into(),
                client_instance_id: "6f1c2a4e-8d3b-4f5a-9c7e-2b1d0e3f4a5b".into(),
            }
        );
        let _ = parity!(
            c,
            port,
            repair_storage_incident,
            "repairStorageIncident",
            "RepairStorageIncidentResponse",
            wire::RepairStorageIncidentRequest {
                request_id: uuid7(),
                incident_id: uuid7(),
            }
        );
        let _ = parity!(
            c,
            port,
            acknowledge_storage_incident,
            "acknowledgeStorageIncident",
            "AcknowledgeStorageIncidentResponse",
            wire::AcknowledgeStorageIncidentRequest {
                request_id: uuid7(),
                incident_id: uuid7(),
                note: "checked".into(),
            }
        );
        let _ = parity!(
            c,
            port,
            append_stdin,
            "appendStdin",
            "AppendStdinResponse",
            wire::AppendStdinRequest {
                request_id: uuid7(),
                issue_uuid: issue.clone(),
                data: b"late".to_vec(),
                newline: wire::StdinNewline::Raw as i32,
            }
        );
        let _ = parity!(
            c,
            port,
            run_command,
            "runCommand",
            "RunCommandResponse",
            run.clone().tap_conflict()
        );
        // a signal that is answered: a command queued for a client that
        // never connected is cancelled
        let queued = wire::RunCommandRequest {
            request_id: uuid7(),
            client_id: "nobody".into(),
            ..run.clone()
        };
        let (g, _) = parity!(
            c,
            port,
            run_command,
            "runCommand",
            "RunCommandResponse",
            queued
        );
        let queued = g.unwrap().into_inner().issue_uuid;
        let (g, _) = parity!(
            c,
            port,
            signal_command,
            "signalCommand",
            "SignalCommandResponse",
            wire::SignalCommandRequest {
                request_id: uuid7(),
                issue_uuid: queued,
                signal: wire::SignalKind::Term as i32,
            }
        );
        assert_eq!(
            g.unwrap().into_inner().lifecycle,
            wire::Lifecycle::Cancelled as i32
        );
    });

    // the envelope's own rules
    let call = |body: &str| -> Value {
        let (status, out) = http(port, "POST", body.as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        serde_json::from_slice(&out).unwrap()
    };
    assert_eq!(call("{not json")["error"]["code"], -32700);
    assert_eq!(call("[]")["error"]["code"], -32600, "no batches");
    assert_eq!(
        call(r#"{"jsonrpc":"2.0","method":"listClients"}"#)["error"]["code"],
        -32600,
        "no notifications"
    );
    let unknown = call(r#"{"jsonrpc":"2.0","id":"x","method":"followCommand"}"#);
    assert_eq!(unknown["error"]["code"], -32601);
    assert_eq!(unknown["id"], "x");
    let bad = call(r#"{"jsonrpc":"2.0","id":2,"method":"getCommand","params":{"issueUuid":1}}"#);
    assert_eq!(bad["error"]["code"], -32602, "{bad}");
    let unknown_enum = call(
        r#"{"jsonrpc":"2.0","id":3,"method":"signalCommand","params":{"issueUuid":"x","signal":"SIGNAL_KIND_STOP"}}"#,
    );
    assert_eq!(unknown_enum["error"]["code"], -32602, "{unknown_enum}");
    assert!(
        unknown_enum["error"]["message"]
            .as_str()
            .unwrap()
            .contains("SIGNAL_KIND_STOP"),
        "{unknown_enum}"
    );
    // a body over jsonrpc.max_body
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":4,"method":"getCommand","params":{{"issueUuid":"{}"}}}}"#,
        "x".repeat(3 * 1024 * 1024)
    );
    let (status, out) = http(port, "POST", big.as_bytes());
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&out));
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["code"], -32600);
    // not POST
    assert_eq!(http(port, "GET", b"").0, 405);
    // no requestId: the server makes one, so each call is a new command
    let params = json!({"clientId": "web-1", "spec": {"commandText": "true"}});
    let a = rpc(port, "runCommand", &params);
    let b = rpc(port, "runCommand", &params);
    let (a, b) = (
        a["result"]["issueUuid"].as_str().unwrap().to_owned(),
        b["result"]["issueUuid"].as_str().unwrap().to_owned(),
    );
    assert_ne!(a, b);
    assert!(rvbox_domain::ids::Uuid7::parse("issueUuid", &a).is_ok());
    // and the audit names the transport
    let metrics = support::http_get(s.server_metrics, "/metrics").unwrap().1;
    assert!(
        metrics.contains("rvbox_server_jsonrpc_calls_total{method=\"runCommand\",outcome=\"ok\"}"),
        "{metrics}"
    );
}

/// A request with the same `requestId` as an earlier one but another
/// command: `CONFLICT` through both transports.
trait Conflict {
    fn tap_conflict(self) -> Self;
}

impl Conflict for wire::RunCommandRequest {
    fn tap_conflict(mut self) -> Self {
        self.spec = Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("false".into())),
            ..Default::default()
        });
        self
    }
}
