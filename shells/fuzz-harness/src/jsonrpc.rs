//! Target `jsonrpc`: the JSON-RPC 2.0 adapter's reading of a request body
//! (`rvbox_control_api::jsonrpc::envelope`) and of its `params` as the
//! method's request message (`jsonrpc::parse`, over
//! `rvbox_control_api::json::from_value`, the canonical proto3 JSON
//! mapping).
//!
//! Checks:
//!
//! - no panic; a refused body gets a JSON-RPC error code of the envelope
//!   (parse error with a null id, invalid request, method not found,
//!   invalid params), and the error object serializes;
//! - an accepted body names a listed method, carries an id that is a
//!   string, a number or null, and an object of params, and a mutation's
//!   params carry a `requestId`;
//! - params read as a request message are the canonical JSON of that
//!   message: written back and read again they give the same message, and
//!   the written form is a fixed point.

use rvbox_control_api::jsonrpc::{
    INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, METHODS, PARSE_ERROR, RpcError, envelope,
    parse, pascal,
};
use rvbox_proto::v1 as wire;
use serde_json::Value;

/// The control request ceiling (`limits.max_control_request` default).
const MAX_REQUEST: usize = 4 << 20;

fn round_trip<M: prost::Message + Default + PartialEq>(name: &str, params: Value) {
    let Ok(m) = parse::<M>(name, params, MAX_REQUEST) else {
        return;
    };
    let full = format!("rvbox.v1.{name}");
    let written = rvbox_control_api::json::to_value(&full, &m).expect("a read message writes");
    let again: M = rvbox_control_api::json::from_value(&full, written.clone())
        .expect("a written message reads back");
    assert!(
        again == m,
        "{name}: the canonical JSON reads back to the same message"
    );
    let rewritten = rvbox_control_api::json::to_value(&full, &again).expect("writes again");
    assert_eq!(
        rewritten, written,
        "{name}: the written form is a fixed point"
    );
}

fn params_of(method: &str, params: Value) {
    let name = format!("{}Request", pascal(method));
    macro_rules! by_name {
        ($($t:ident),* $(,)?) => {
            match name.as_str() {
                $(stringify!($t) => round_trip::<wire::$t>(&name, params),)*
                other => panic!("method {method} has no request message {other}"),
            }
        };
    }
    by_name!(
        ListClientsRequest,
        GetClientRequest,
        ListCommandsRequest,
        GetCommandRequest,
        AuthorizeClientTakeoverRequest,
        RunCommandRequest,
        AppendStdinRequest,
        CloseStdinRequest,
        SignalCommandRequest,
        GetOutputRequest,
        ListStorageIncidentsRequest,
        RepairStorageIncidentRequest,
        AcknowledgeStorageIncidentRequest,
        RunFleetRequest,
        GetFleetRunRequest,
        ListFleetRunsRequest,
        ListFleetTargetsRequest,
        SignalFleetRunRequest,
        CancelFleetRunRequest,
        PauseFleetRunRequest,
        ResumeFleetRunRequest,
        OpenPtySessionRequest,
        WritePtyInputRequest,
        ResizePtySessionRequest,
        ClosePtySessionRequest,
        ListPtySessionsRequest,
    );
}

fn check_error(id: &Value, e: &RpcError) {
    assert!(
        [
            PARSE_ERROR,
            INVALID_REQUEST,
            METHOD_NOT_FOUND,
            INVALID_PARAMS
        ]
        .contains(&e.code),
        "an envelope refusal uses an envelope code: {}",
        e.code
    );
    if e.code == PARSE_ERROR {
        assert_eq!(
            *id,
            Value::Null,
            "a body that is not JSON is answered with a null id"
        );
    }
    assert!(matches!(
        id,
        Value::Null | Value::String(_) | Value::Number(_)
    ));
    let v = e.to_value();
    assert_eq!(v.get("code").and_then(Value::as_i64), Some(e.code));
    let _ = e.audit_code();
}

/// Runs one input.
pub fn run(data: &[u8]) {
    match envelope(data, || "01890a5d-ac96-774b-bcce-b30209a0ffff".into()) {
        Err((id, e)) => check_error(&id, &e),
        Ok((id, method, params)) => {
            assert!(matches!(
                id,
                Value::Null | Value::String(_) | Value::Number(_)
            ));
            let (_, mutation) = METHODS
                .iter()
                .find(|(m, _)| *m == method)
                .copied()
                .expect("an accepted method is listed");
            let obj = params.as_object().expect("params are an object");
            if mutation {
                assert!(obj.contains_key("requestId"), "a mutation has a requestId");
            }
            params_of(method, params);
        }
    }
    // the params mapping alone, for any JSON document
    if let Ok(v) = serde_json::from_slice::<Value>(data) {
        let method = METHODS
            .get(data.len() % METHODS.len())
            .map_or("getCommand", |(m, _)| *m);
        params_of(method, v);
    }
}
