//! The client daemon's health (plan §11.1): reconnect state, spool
//! health, unresolved local incidents and supervisor health, never any
//! command output. The runtime thread publishes a [`HealthView`] at most
//! every [`PUBLISH_EVERY`]; when `observability.metrics_listen` is set, a
//! small HTTP listener serves it as JSON at `/healthz`, readiness at
//! `/readyz` (200 only while the session is active and the local store is
//! ready) and Prometheus text at `/metrics`. Every metric label is a
//! bounded word.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rvbox_client_core::link::Phase;
use rvbox_client_core::machine::TerminalStats;
use rvbox_client_runtime::Runtime;
use rvbox_client_store::LocalHealth;
use rvbox_supervisor::{Supervisor as _, UnixSupervisor};

/// The runtime thread publishes at most this often.
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(500);
/// An HTTP request whose header has not arrived within this long is
/// dropped.
const HEADER_DEADLINE: Duration = Duration::from_secs(10);

/// What the daemon says about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HealthView {
    /// `backoff`, `connecting`, `hello`, `reconciling`, `active`, `closing`.
    pub(crate) link: &'static str,
    /// Dials so far.
    pub(crate) dials: u64,
    /// Sessions lost (transport ends after a welcome).
    pub(crate) sessions_lost: u64,
    /// Raw bytes waiting in the spool for the network.
    pub(crate) spool_backlog_bytes: u64,
    /// Raw output bytes dropped into loss markers so far.
    pub(crate) spool_dropped_bytes: u64,
    /// Spooled events given a wire sequence so far.
    pub(crate) events_assigned: u64,
    /// Sequenced events sent again after a reconnect so far.
    pub(crate) events_replayed: u64,
    /// `ready`, or `dirty` while a local incident is unresolved.
    pub(crate) store: &'static str,
    /// `cgroup_v2`, `hybrid` or `process_group`.
    pub(crate) supervision: &'static str,
    /// Commands holding a running slot.
    pub(crate) running: u32,
    /// Accepted commands waiting for a slot.
    pub(crate) queued: u32,
    /// Trees recorded before a restart that could not be verified gone.
    pub(crate) unverified_trees: u64,
    /// Terminals open or opening (or closed with output not yet
    /// delivered).
    pub(crate) terminals_open: u64,
    /// The terminals' counters since start.
    pub(crate) terminals: TerminalStats,
}

/// A terminal event, by a bounded name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabel {
    event: &'static str,
}

/// Each terminal counter by its bounded name.
fn terminal_counts(t: &TerminalStats) -> [(&'static str, u64); 14] {
    [
        ("opened", t.opened),
        ("refused", t.refused),
        ("start_failed", t.start_failures),
        ("adopted", t.adopted),
        ("lost", t.lost),
        ("closed", t.closed),
        ("unknown", t.unknown),
        ("input_relayed", t.inputs_relayed),
        ("input_repeat", t.input_repeats),
        ("held_input_dropped", t.held_input_dropped),
        ("output_cut", t.output_cuts),
        ("window_full", t.window_pauses),
        ("close_record_failed", t.close_failures),
        ("close_awaits_attach", t.closes_awaiting_attach),
    ]
}

impl HealthView {
    fn ready(&self) -> bool {
        self.link == "active" && self.store == "ready"
    }

    fn json(&self) -> String {
        serde_json::json!({
            "live": true,
            "ready": self.ready(),
            "link": { "state": self.link, "dials": self.dials, "sessions_lost": self.sessions_lost },
            "spool": {
                "backlog_bytes": self.spool_backlog_bytes,
                "dropped_bytes": self.spool_dropped_bytes,
                "events_sequenced": self.events_assigned,
                "events_replayed": self.events_replayed,
                "store": self.store,
            },
            "supervisor": {
                "mode": self.supervision,
                "running": self.running,
                "queued": self.queued,
                "unverified_trees": self.unverified_trees,
            },
            "terminals": {
                "open": self.terminals_open,
                "events": terminal_counts(&self.terminals)
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), serde_json::json!(v)))
                    .collect::<serde_json::Map<_, _>>(),
            },
        })
        .to_string()
    }
}

fn link_name(p: &Phase) -> &'static str {
    match p {
        Phase::Backoff { .. } => "backoff",
        Phase::Connecting { .. } => "connecting",
        Phase::Hello { .. } => "hello",
        Phase::Reconciling { .. } => "reconciling",
        Phase::Active { .. } => "active",
        Phase::Closing => "closing",
    }
}

/// The view of a runtime now.
pub(crate) fn view_of(rt: &Runtime<UnixSupervisor>) -> HealthView {
    let core = rt.core();
    let link = core.link_stats();
    let spool = core.spool_stats();
    let (running, queued) = core.capacity();
    let store = match rt.store().health() {
        Ok(LocalHealth::Ready) => "ready",
        Ok(_) | Err(_) => "dirty",
    };
    HealthView {
        link: link_name(&core.link_phase()),
        dials: link.dials,
        sessions_lost: link.sessions_lost,
        spool_backlog_bytes: core.spool_backlog(),
        spool_dropped_bytes: spool.raw_bytes_dropped,
        events_assigned: spool.assigned,
        events_replayed: spool.replayed,
        store,
        supervision: match rt.supervisor().mode() {
            rvbox_client_core::process::Supervision::CgroupV2 => "cgroup_v2",
            rvbox_client_core::process::Supervision::Hybrid => "hybrid",
            rvbox_client_core::process::Supervision::ProcessGroup => "process_group",
        },
        running,
        queued,
        unverified_trees: core.stats().unverified_trees,
        terminals_open: core.open_terminals() as u64,
        terminals: core.terminal_stats(),
    }
}

/// The gauges `/metrics` shows, set from each published view.
#[derive(Debug, Default)]
struct Gauges {
    active: Gauge,
    ready: Gauge,
    dials: Gauge,
    sessions_lost: Gauge,
    backlog: Gauge,
    dropped: Gauge,
    assigned: Gauge,
    replayed: Gauge,
    dirty: Gauge,
    running: Gauge,
    queued: Gauge,
    unverified: Gauge,
    terminals_open: Gauge,
    terminal_events: Family<EventLabel, Gauge>,
    wire_frames: Gauge,
    wire_bytes: Gauge,
    wire_overflows: Gauge,
    heartbeats_dropped: Gauge,
}

fn g(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Where the runtime thread publishes and the listener reads.
#[derive(Debug)]
pub(crate) struct Health {
    view: Mutex<HealthView>,
    gauges: Gauges,
    registry: Mutex<Registry>,
    last: Mutex<Option<Instant>>,
}

impl Health {
    pub(crate) fn new(
        store_metrics: &rvbox_client_store::metrics::ClientStoreMetrics,
        transport: &crate::net::TransportMetrics,
    ) -> Arc<Self> {
        let gauges = Gauges::default();
        let mut registry = Registry::default();
        {
            let r = registry.sub_registry_with_prefix("rvbox_client");
            r.register(
                "session_active",
                "1 while the session is active",
                gauges.active.clone(),
            );
            r.register(
                "ready",
                "1 while the session is active and the local store is ready",
                gauges.ready.clone(),
            );
            r.register("dials", "Dials since start", gauges.dials.clone());
            r.register(
                "sessions_lost",
                "Sessions lost since start",
                gauges.sessions_lost.clone(),
            );
            r.register(
                "spool_backlog_bytes",
                "Raw bytes waiting in the spool for the network",
                gauges.backlog.clone(),
            );
            r.register(
                "spool_dropped_bytes",
                "Raw output bytes dropped into loss markers since start",
                gauges.dropped.clone(),
            );
            r.register(
                "events_sequenced",
                "Spooled events given a wire sequence since start",
                gauges.assigned.clone(),
            );
            r.register(
                "events_replayed",
                "Sequenced events sent again after a reconnect since start",
                gauges.replayed.clone(),
            );
            r.register(
                "store_dirty",
                "1 while a local incident is unresolved",
                gauges.dirty.clone(),
            );
            r.register(
                "commands_running",
                "Commands holding a running slot",
                gauges.running.clone(),
            );
            r.register(
                "commands_queued",
                "Accepted commands waiting for a slot",
                gauges.queued.clone(),
            );
            r.register(
                "unverified_trees",
                "Recorded trees that could not be verified gone",
                gauges.unverified.clone(),
            );
            r.register(
                "terminals_open",
                "Terminals open or opening on this host",
                gauges.terminals_open.clone(),
            );
            r.register(
                "terminal_events",
                "Terminal events since start, by event (opened, refused, start_failed, adopted, lost, closed, unknown, input_relayed, input_repeat, held_input_dropped, output_cut, window_full, close_record_failed, close_awaits_attach)",
                gauges.terminal_events.clone(),
            );
        }
        {
            let r = registry.sub_registry_with_prefix("rvbox_client_runtime");
            r.register(
                "wire_queued_frames",
                "Frames released by the core and waiting for room in the transport",
                gauges.wire_frames.clone(),
            );
            r.register(
                "wire_queued_bytes",
                "Bytes of the frames waiting for room in the transport",
                gauges.wire_bytes.clone(),
            );
            r.register(
                "wire_overflows",
                "Connections ended because the runtime's transport queue was full, since start",
                gauges.wire_overflows.clone(),
            );
            r.register(
                "heartbeats_dropped",
                "Heartbeats dropped because their queue was full, since start",
                gauges.heartbeats_dropped.clone(),
            );
        }
        store_metrics.register(&mut registry);
        transport.register(&mut registry);
        Arc::new(Self {
            view: Mutex::new(HealthView::default()),
            gauges,
            registry: Mutex::new(registry),
            last: Mutex::new(None),
        })
    }

    /// Publishes the runtime's view, at most every [`PUBLISH_EVERY`]
    /// unless `force`.
    pub(crate) fn publish(&self, rt: &Runtime<UnixSupervisor>, force: bool) {
        if let Ok(mut last) = self.last.lock() {
            if !force && last.is_some_and(|t| t.elapsed() < PUBLISH_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let v = view_of(rt);
        let gs = &self.gauges;
        gs.active.set(i64::from(v.link == "active"));
        gs.ready.set(i64::from(v.ready()));
        gs.dials.set(g(v.dials));
        gs.sessions_lost.set(g(v.sessions_lost));
        gs.backlog.set(g(v.spool_backlog_bytes));
        gs.dropped.set(g(v.spool_dropped_bytes));
        gs.assigned.set(g(v.events_assigned));
        gs.replayed.set(g(v.events_replayed));
        gs.dirty.set(i64::from(v.store != "ready"));
        gs.running.set(i64::from(v.running));
        gs.queued.set(i64::from(v.queued));
        gs.unverified.set(g(v.unverified_trees));
        gs.terminals_open.set(g(v.terminals_open));
        let (frames, bytes) = rt.wire_pending();
        let (dropped, overflows) = rt.wire_stats();
        gs.wire_frames.set(g(frames as u64));
        gs.wire_bytes.set(g(bytes as u64));
        gs.wire_overflows.set(g(overflows));
        gs.heartbeats_dropped.set(g(dropped));
        for (event, n) in terminal_counts(&v.terminals) {
            gs.terminal_events
                .get_or_create(&EventLabel { event })
                .set(g(n));
        }
        if let Ok(mut view) = self.view.lock() {
            if view.link != v.link {
                tracing::info!(from = view.link, to = v.link, "client link state");
            }
            if view.terminals_open != v.terminals_open {
                tracing::info!(
                    from = view.terminals_open,
                    to = v.terminals_open,
                    "terminals open"
                );
            }
            *view = v;
        }
    }

    fn view(&self) -> HealthView {
        self.view.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        let Ok(r) = self.registry.lock() else {
            return String::new();
        };
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

fn answer(status: StatusCode, kind: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    r
}

fn route(req: &Request<Incoming>, health: &Health) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
    const TEXT: &str = "text/plain; charset=utf-8";
    match req.uri().path() {
        "/healthz" => answer(StatusCode::OK, JSON, health.view().json()),
        "/readyz" => {
            let v = health.view();
            if v.ready() {
                answer(StatusCode::OK, TEXT, "ready\n".into())
            } else {
                answer(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    format!("not ready: link {}, store {}\n", v.link, v.store),
                )
            }
        }
        "/metrics" => answer(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            health.metrics(),
        ),
        _ => answer(StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener`.
pub(crate) async fn serve(listener: tokio::net::TcpListener, health: Arc<Health>) {
    loop {
        let (stream, peer): (tokio::net::TcpStream, SocketAddr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "health listener accept failed; pausing");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let health = Arc::clone(&health);
                async move { Ok::<_, std::convert::Infallible>(route(&req, &health)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, %peer, "health connection ended with an error");
            }
        });
    }
}
