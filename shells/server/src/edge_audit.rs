//! Audit records of the edges (docs/security.md, "Audit"): an operator's
//! reads on the control socket and JSON-RPC, requests refused before they
//! reached the store (a request the gRPC decoder refused, JSON-RPC
//! parameters that do not parse, an unknown method), and agent upgrades
//! refused. Writes are audited by the store with their effect; these
//! change nothing durable, so they are records of their own.
//!
//! Owns: the probe a control call carries (task-local, so the gRPC layer
//! and the JSON-RPC adapter both see what the handler noted: that it ran,
//! and the client and command it was about), the gRPC layer that turns a
//! finished call into a record, and the task that hands records to the
//! core in batches (the core writes them within their rate limits).
//!
//! Must never: wait for the core (a full queue drops the record, counted),
//! record a request's payload (only the method, the caller, the ids, the
//! outcome and a bounded reason), or audit a write twice (a write that
//! reached its handler is the store's to audit).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use rvbox_store_port::audit::{Caller, MAX_SESSION_AUDIT_DETAIL, SessionAudit};
use tokio::sync::mpsc;

use crate::core_loop::ToCore;
use crate::state::Shared;

/// Records waiting for the core before new ones are dropped.
pub(crate) const EDGE_AUDIT_QUEUE: usize = 4096;
/// Most records handed to the core at once.
const BATCH: usize = 512;

/// The control methods that only read, by their gRPC name.
pub(crate) const READS: [&str; 14] = [
    "ListClients",
    "GetClient",
    "ListCommands",
    "GetCommand",
    "FollowCommand",
    "GetOutput",
    "ListStorageIncidents",
    "GetFleetRun",
    "ListFleetRuns",
    "ListFleetTargets",
    "FollowFleetRun",
    "AttachPtySession",
    "ListPtySessions",
    "ReadPtyRecording",
];

/// The control methods that write (the store audits those that reach it).
pub(crate) const WRITES: [&str; 16] = [
    "AuthorizeClientTakeover",
    "RunCommand",
    "AppendStdin",
    "CloseStdin",
    "SignalCommand",
    "RepairStorageIncident",
    "AcknowledgeStorageIncident",
    "RunFleet",
    "SignalFleetRun",
    "CancelFleetRun",
    "PauseFleetRun",
    "ResumeFleetRun",
    "OpenPtySession",
    "WritePtyInput",
    "ResizePtySession",
    "ClosePtySession",
];

/// A method's bounded name: one of [`READS`] or [`WRITES`], else
/// `UnknownMethod`.
pub(crate) fn method_name(name: &str) -> &'static str {
    READS
        .iter()
        .chain(WRITES.iter())
        .find(|m| **m == name)
        .copied()
        .unwrap_or("UnknownMethod")
}

/// Whether `method` (a bounded name) only reads.
pub(crate) fn is_read(method: &str) -> bool {
    READS.contains(&method)
}

/// What a control call's handler noted for its audit record.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    reached: AtomicBool,
    target: Mutex<Target>,
}

#[derive(Debug, Default, Clone)]
struct Target {
    client: Option<String>,
    issue: Option<[u8; 16]>,
    detail: String,
}

tokio::task_local! {
    static PROBE: Arc<Probe>;
}

/// Runs `fut` (one control call) with a fresh probe; returns its output
/// and the probe.
pub(crate) async fn probed<F: std::future::Future>(fut: F) -> (F::Output, Arc<Probe>) {
    let probe = Arc::new(Probe::default());
    let out = PROBE.scope(Arc::clone(&probe), fut).await;
    (out, probe)
}

/// The handler of the current call ran (its request decoded).
pub(crate) fn reached() {
    let _ = PROBE.try_with(|p| p.reached.store(true, Ordering::Relaxed));
}

/// The client and command the current call is about, and anything else
/// worth naming (a fleet run or terminal id).
pub(crate) fn note(client: Option<&str>, issue: Option<[u8; 16]>, detail: &str) {
    let _ = PROBE.try_with(|p| {
        if let Ok(mut t) = p.target.lock() {
            t.client = client.map(str::to_owned);
            t.issue = issue;
            t.detail = detail.to_owned();
        }
    });
}

impl Probe {
    /// The record of a finished call of `method` by `caller` that ended
    /// with `code` (0: OK) and `message`, when it is one to keep: every
    /// read, and any call refused before its handler ran.
    pub(crate) fn record(
        &self,
        method: &'static str,
        caller: Caller,
        code: i32,
        message: &str,
    ) -> Option<SessionAudit> {
        let reached = self.reached.load(Ordering::Relaxed);
        if !is_read(method) && (code == 0 || reached) {
            return None;
        }
        let t = self.target.lock().map(|t| t.clone()).unwrap_or_default();
        let mut detail = t.detail;
        if code != 0 {
            if !detail.is_empty() {
                detail.push_str("; ");
            }
            detail.push_str(message);
        }
        let mut end = detail.len().min(MAX_SESSION_AUDIT_DETAIL);
        while !detail.is_char_boundary(end) {
            end -= 1;
        }
        detail.truncate(end);
        Some(SessionAudit {
            client_id: t.client,
            action: method,
            detail,
            caller: Some(caller),
            issue_uuid: t.issue,
            error_code: (code != 0).then_some(code),
        })
    }
}

/// Starts the task that hands edge records to the core, and gives
/// `shared` its sender.
pub(crate) fn start(shared: &Arc<Shared>) -> tokio::task::JoinHandle<()> {
    let (tx, rx) = mpsc::channel(EDGE_AUDIT_QUEUE);
    shared.set_edge_audits(tx);
    tokio::spawn(run(rx, Arc::clone(shared)))
}

async fn run(mut rx: mpsc::Receiver<SessionAudit>, shared: Arc<Shared>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        let n = batch.len();
        let handed = match shared.core() {
            Some(core) => core.send(ToCore::Audit(batch)).await.is_ok(),
            None => false,
        };
        if !handed {
            shared.metrics.edge_audits_dropped.inc_by(n as u64);
            tracing::warn!(
                records = n,
                "edge audit records dropped: the core is not serving"
            );
        }
    }
}

/// The gRPC layer: every control call runs with a probe, and its record
/// (a read, or a refusal before the handler) goes to the core.
#[derive(Debug, Clone)]
pub(crate) struct AuditLayer {
    pub(crate) shared: Arc<Shared>,
}

impl<S> tower::Layer<S> for AuditLayer {
    type Service = AuditService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuditService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// See [`AuditLayer`].
#[derive(Debug, Clone)]
pub(crate) struct AuditService<S> {
    inner: S,
    shared: Arc<Shared>,
}

/// The control service's path prefix.
const CONTROL_PREFIX: &str = "/rvbox.v1.Control/";

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B, RB> tower::Service<tonic::codegen::http::Request<B>> for AuditService<S>
where
    S: tower::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<RB>,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let Some(name) = req.uri().path().strip_prefix(CONTROL_PREFIX) else {
            return Box::pin(self.inner.call(req));
        };
        let method = method_name(name);
        let principal = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map_or_else(String::new, |c| format!("uid:{}", c.uid()));
        let caller = Caller {
            transport: "grpc-unix".into(),
            principal,
        };
        let fut = self.inner.call(req);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let (out, probe) = probed(fut).await;
            if let Ok(resp) = &out {
                let headers = resp.headers();
                let code = headers
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .unwrap_or(0);
                let message = headers
                    .get("grpc-message")
                    .map(|v| percent_decode(v.as_bytes()))
                    .unwrap_or_default();
                if let Some(record) = probe.record(method, caller, code, &message) {
                    shared.edge_audit(record);
                }
            }
            out
        })
    }
}

/// A `grpc-message` value, percent-decoded (lossy).
fn percent_decode(v: &[u8]) -> String {
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while let Some(&b) = v.get(i) {
        if b == b'%'
            && let Some(h) = v.get(i + 1..i + 3)
            && let Ok(s) = std::str::from_utf8(h)
            && let Ok(x) = u8::from_str_radix(s, 16)
        {
            out.push(x);
            i += 3;
            continue;
        }
        out.push(b);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn caller() -> Caller {
        Caller {
            transport: "grpc-unix".into(),
            principal: "uid:0".into(),
        }
    }

    #[tokio::test]
    async fn reads_are_recorded_and_writes_only_when_refused_before_their_handler() {
        // a read, with what its handler noted
        let ((), p) = probed(async {
            reached();
            note(Some("web-1"), Some([7; 16]), "");
        })
        .await;
        let r = p.record("GetCommand", caller(), 0, "").unwrap();
        assert_eq!(
            (r.action, r.client_id.as_deref(), r.issue_uuid, r.error_code),
            ("GetCommand", Some("web-1"), Some([7; 16]), None)
        );
        // a write that reached its handler is the store's to audit
        let ((), p) = probed(async { reached() }).await;
        assert!(p.record("RunCommand", caller(), 0, "").is_none());
        assert!(p.record("RunCommand", caller(), 3, "refused").is_none());
        // a write refused before its handler (the decoder) is recorded
        let ((), p) = probed(async {}).await;
        let r = p
            .record(
                "RunCommand",
                caller(),
                11,
                "decoded message length too large",
            )
            .unwrap();
        assert_eq!(r.error_code, Some(11));
        assert!(r.detail.contains("too large"));
        assert_eq!(method_name("NoSuchMethod"), "UnknownMethod");
        assert!(
            p.record("UnknownMethod", caller(), 12, "unimplemented")
                .is_some()
        );
    }

    #[test]
    fn grpc_messages_are_percent_decoded() {
        assert_eq!(percent_decode(b"a%20b%25c%zz"), "a b%c%zz");
    }
}
