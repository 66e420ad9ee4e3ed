//! The agent endpoint (plan §6.1): HTTP/1.1 with a WebSocket upgrade on
//! `server.agent_path`, for nginx to proxy, plus `/healthz`, `/readyz`
//! and `/metrics` on the same listener.
//!
//! Owns: the upgrade checks (path, method, headers, `Origin` against
//! `server.allowed_origins`, readiness), the WebSocket limits (binary
//! messages only; message and frame size at most `limits.max_envelope`,
//! checked by the WebSocket layer before anything is decoded; explicit,
//! small read and write buffers), and per connection one reader task and
//! one writer task.
//!
//! - The reader only validates and hands off: each binary message goes to
//!   the core's inbox as it is. A message that finds the inbox full (65,536
//!   messages, or 256 MiB of frames) closes the connection (4003, nothing
//!   acknowledged) instead of waiting.
//! - The writer owns the socket's sending half. The core has already put
//!   the frames in lane order (a bounded burst of control before one data
//!   frame) and hands it at most its writer window; the writer writes
//!   each under a deadline and reports it written.
//!
//! Must never: decode an envelope (the core does), hold a lock across
//! I/O, or outlive its connection (both tasks end when either side ends).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rvbox_config::ClientIdentity;
use rvbox_proto::v1 as wire;
use rvbox_server_core::{ConnId, Input};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message};

use crate::core_loop::{ToCore, ToWriter, WRITER_QUEUE};
use crate::state::Shared;
use crate::writer_queue::{WriterRx, writer_queue};

/// A frame not written within this long ends its connection.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// An HTTP request whose header has not arrived within this long is
/// dropped (a peer that opens connections and sends nothing).
pub(crate) const HEADER_DEADLINE: Duration = Duration::from_secs(10);
/// The WebSocket read buffer of a connection. An agent connection is
/// mostly idle, and messages larger than this are read in several steps;
/// the library's default (128 KiB) would cost that much per connection.
pub(crate) const READ_BUFFER: usize = 4 * 1024;
/// Bytes the writer gathers before writing to the socket (0 would write
/// every message at once; the writer flushes after each burst anyway).
pub(crate) const WRITE_BUFFER: usize = 0;
/// Most frames one writer burst takes before it flushes.
pub(crate) const WRITE_BURST: usize = 16;
/// The longest pause of the listener after `accept` failed for lack of
/// file descriptors (it starts at 10 ms and doubles).
pub(crate) const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

type Body = Full<Bytes>;
type Ws = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// The WebSocket limits of every agent connection.
pub(crate) fn ws_config(max_envelope: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER)
        .write_buffer_size(WRITE_BUFFER)
        // a frame or message above the envelope limit is refused before
        // it is buffered whole (close 1009)
        .max_message_size(Some(max_envelope))
        .max_frame_size(Some(max_envelope))
        // room for one largest message beyond what the writer gathers
        .max_write_buffer_size(max_envelope.saturating_mul(2).max(64 * 1024))
        .accept_unmasked_frames(false)
}

/// Which routes a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routes {
    /// The agent upgrade and health (`server.agent_listen`).
    Agent,
    /// Health and metrics only (`observability.metrics_listen`).
    Observability,
}

/// Serves a listener until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    routes: Routes,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(10);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                let shared = Arc::clone(&shared);
                tokio::spawn(connection(stream, peer, shared, routes));
            }
            Err(e) => {
                let fd_limit = matches!(e.raw_os_error(), Some(EMFILE | ENFILE));
                let reason = if fd_limit { "fd_limit" } else { "other" };
                shared
                    .metrics
                    .accept_errors
                    .get_or_create(&crate::metrics::ReasonLabel { reason })
                    .inc();
                tracing::warn!(error = %e, reason, pause_ms = backoff.as_millis() as u64, "agent accept failed; pausing the listener");
                // existing sessions keep being served; the listener waits
                // instead of spinning on an error that repeats at once
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => return,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
            }
        }
    }
}

/// `EMFILE` (this process is out of file descriptors).
const EMFILE: i32 = 24;
/// `ENFILE` (the system is).
const ENFILE: i32 = 23;

async fn connection(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, routes: Routes) {
    let _ = stream.set_nodelay(true);
    let svc_shared = Arc::clone(&shared);
    let service = hyper::service::service_fn(move |req| {
        let shared = Arc::clone(&svc_shared);
        async move { Ok::<_, std::convert::Infallible>(route(req, peer, &shared, routes)) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_DEADLINE)
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades()
        .await;
    if let Err(e) = served {
        tracing::debug!(error = %e, %peer, "HTTP connection ended with an error");
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn route(
    req: Request<Incoming>,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    routes: Routes,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    match path.as_str() {
        "/healthz" => text(StatusCode::OK, "live\n"),
        "/readyz" => match shared.readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        "/metrics" => match shared.render_metrics() {
            Ok(body) => {
                let mut r = text(StatusCode::OK, body);
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                r
            }
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("metrics: {e}\n")),
        },
        p if p == shared.agent_path && routes == Routes::Agent => upgrade(req, peer, shared),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// Why an upgrade request is refused, with its status and metric label.
fn refuse(
    shared: &Shared,
    status: StatusCode,
    reason: &'static str,
    peer: SocketAddr,
) -> Response<Body> {
    shared.metrics.upgrade_refused(reason);
    tracing::info!(%peer, reason, "agent upgrade refused");
    // unauthenticated: the core writes it within the session records'
    // rate limit
    shared.edge_audit(rvbox_store_port::audit::SessionAudit::session(
        None,
        "UpgradeRefused",
        format!("{reason} (HTTP {}) from {peer}", status.as_u16()),
    ));
    text(status, format!("{reason}\n"))
}

/// The CN of a subject DN as nginx's `$ssl_client_s_dn` gives it (RFC
/// 2253: `CN=web-1,OU=ops,O=Example`, `\` escaping special characters).
/// `None` when there is no CN, or more than one.
pub(crate) fn subject_cn(dn: &str) -> Option<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = dn.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => cur.push(chars.next()?),
            ',' | '+' => parts.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    parts.push(cur);
    let mut cns = parts.iter().filter_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("CN")
            .then(|| v.trim().to_owned())
    });
    let cn = cns.next()?;
    if cns.next().is_some() || cn.is_empty() {
        return None;
    }
    Some(cn)
}

fn header_has_token(req: &Request<Incoming>, name: header::HeaderName, token: &str) -> bool {
    req.headers().get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

fn upgrade(mut req: Request<Incoming>, peer: SocketAddr, shared: &Arc<Shared>) -> Response<Body> {
    if req.method() != Method::GET {
        return refuse(shared, StatusCode::METHOD_NOT_ALLOWED, "method", peer);
    }
    if !header_has_token(&req, header::UPGRADE, "websocket")
        || !header_has_token(&req, header::CONNECTION, "upgrade")
    {
        return refuse(shared, StatusCode::UPGRADE_REQUIRED, "not_websocket", peer);
    }
    if req.headers().get(header::SEC_WEBSOCKET_VERSION) != Some(&HeaderValue::from_static("13")) {
        return refuse(shared, StatusCode::BAD_REQUEST, "websocket_version", peer);
    }
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY) else {
        return refuse(shared, StatusCode::BAD_REQUEST, "websocket_key", peer);
    };
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        // agents send no Origin; a browser page must be listed
        let allowed = origin
            .to_str()
            .is_ok_and(|o| shared.allowed_origins.iter().any(|a| a == o));
        if !allowed {
            return refuse(shared, StatusCode::FORBIDDEN, "origin", peer);
        }
    }
    // the identity a verified client certificate gives, when that is how
    // identities are established (docs/security.md)
    let certified = match &shared.identity {
        ClientIdentity::SelfReported => None,
        ClientIdentity::TlsClientCert {
            header,
            trusted_proxies,
        } => {
            if !trusted_proxies.contains(&peer.ip()) {
                return refuse(shared, StatusCode::FORBIDDEN, "untrusted_proxy", peer);
            }
            let Some(subject) = req
                .headers()
                .get(header.as_str())
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
            else {
                return refuse(shared, StatusCode::FORBIDDEN, "no_client_certificate", peer);
            };
            let Some(cn) = subject_cn(subject) else {
                return refuse(
                    shared,
                    StatusCode::FORBIDDEN,
                    "certificate_without_cn",
                    peer,
                );
            };
            Some(cn)
        }
    };
    let Some(core) = shared.core() else {
        return refuse(shared, StatusCode::SERVICE_UNAVAILABLE, "recovering", peer);
    };
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    let config = ws_config(shared.max_envelope);
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let metrics = Arc::clone(shared);
    // the upgrade completes after this response is written. The handshake
    // holds only the upgrade's handle (not the request) in its own task,
    // which starts the connection's task and ends: an idle connection
    // keeps none of the handshake's state.
    let on_upgrade = hyper::upgrade::on(&mut req);
    drop(req);
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let ws = WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    Some(config),
                )
                .await;
                let (sink, stream) = ws.split();
                tokio::spawn(run_socket(sink, stream, conn, certified, core, metrics));
            }
            Err(e) => tracing::info!(error = %e, %peer, "agent upgrade did not complete"),
        }
    });
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    r
}

async fn run_socket(
    sink: futures_util::stream::SplitSink<Ws, Message>,
    stream: futures_util::stream::SplitStream<Ws>,
    conn: ConnId,
    certified: Option<String>,
    core: mpsc::Sender<ToCore>,
    shared: Arc<Shared>,
) {
    let _live = shared.socket_started();
    let (writer_tx, writer_rx) = writer_queue(WRITER_QUEUE);
    if core
        .send(ToCore::Open {
            conn,
            writer: writer_tx,
            certified,
        })
        .await
        .is_err()
    {
        return;
    }
    tracing::debug!(conn, "agent connection open");
    let (close_tx, close_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let writer = tokio::spawn(write_loop(
        sink,
        writer_rx,
        close_rx,
        done_tx,
        conn,
        core.clone(),
        Arc::clone(&shared),
    ));
    let close = read_loop(stream, done_rx, conn, &core, &shared).await;
    // the writer sends the reader's close (if any) and ends
    let _ = close_tx.send(close);
    let _ = writer.await;
    // the core forgets the connection (ignored when it closed it first)
    let _ = core.send(ToCore::Conn(Input::Disconnected { conn })).await;
    tracing::debug!(conn, "agent connection ended");
}

/// A close the reader decided: code and reason text.
type ReaderClose = Option<(u16, &'static str)>;

fn reason_close(reason: wire::CloseReason) -> ReaderClose {
    Some((
        rvbox_session::close_code(reason).unwrap_or(1000),
        rvbox_session::close_text(reason),
    ))
}

async fn read_loop(
    mut stream: futures_util::stream::SplitStream<Ws>,
    mut writer_done: oneshot::Receiver<()>,
    conn: ConnId,
    core: &mpsc::Sender<ToCore>,
    shared: &Shared,
) -> ReaderClose {
    loop {
        let next = tokio::select! {
            m = stream.next() => m,
            _ = &mut writer_done => return None,
        };
        let input = match next {
            None | Some(Ok(Message::Close(_))) => return None,
            Some(Ok(Message::Binary(bytes))) => Input::Frame {
                conn,
                bytes: bytes.to_vec(),
            },
            Some(Ok(Message::Text(_))) => {
                shared.metrics.message_refused("text");
                tracing::info!(conn, "text message refused; closing");
                return reason_close(wire::CloseReason::ProtocolError);
            }
            Some(Ok(Message::Ping(_))) => Input::Ping { conn },
            Some(Ok(Message::Pong(_))) => Input::Pong { conn },
            Some(Ok(Message::Frame(_))) => continue,
            Some(Err(tungstenite::Error::Capacity(e))) => {
                shared.metrics.message_refused("too_big");
                tracing::info!(conn, error = %e, "oversized message refused; closing");
                return reason_close(wire::CloseReason::MessageTooBig);
            }
            Some(Err(tungstenite::Error::Protocol(e))) => {
                shared.metrics.message_refused("websocket_protocol");
                tracing::info!(conn, error = %e, "WebSocket protocol violation; closing");
                return reason_close(wire::CloseReason::ProtocolError);
            }
            Some(Err(e)) => {
                tracing::debug!(conn, error = %e, "agent connection read failed");
                return None;
            }
        };
        // the inbox's byte bound: counted before the send, given back by
        // the core when it takes the frame, or here when the send fails
        let size = match &input {
            Input::Frame { bytes, .. } => i64::try_from(bytes.len()).unwrap_or(i64::MAX),
            _ => 0,
        };
        if size > 0
            && shared.metrics.inbox_bytes.inc_by(size).saturating_add(size)
                > crate::core_loop::INBOX_BYTES
        {
            shared.metrics.inbox_bytes.dec_by(size);
            shared.metrics.inbox_full.inc();
            tracing::warn!(
                conn,
                "the core's inbox is over its byte bound; closing the connection"
            );
            return reason_close(wire::CloseReason::IngressOverload);
        }
        let sent = core.try_send(ToCore::Conn(input));
        if sent.is_err() {
            shared.metrics.inbox_bytes.dec_by(size);
        }
        match sent {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                // never wait with the socket unread: nothing of this
                // message was acknowledged, and the client's spool
                // resends it after a jittered reconnect
                shared.metrics.inbox_full.inc();
                tracing::warn!(conn, "the core's inbox is full; closing the connection");
                return reason_close(wire::CloseReason::IngressOverload);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                return reason_close(wire::CloseReason::ServiceRestart);
            }
        }
    }
}

async fn write_loop(
    mut sink: futures_util::stream::SplitSink<Ws, Message>,
    mut rx: WriterRx<ToWriter>,
    mut reader_close: oneshot::Receiver<ReaderClose>,
    _done: oneshot::Sender<()>,
    conn: ConnId,
    core: mpsc::Sender<ToCore>,
    shared: Arc<Shared>,
) {
    loop {
        let first = tokio::select! {
            biased;
            close = &mut reader_close => {
                if let Ok(Some((code, reason))) = close {
                    send_close(&mut sink, code, reason, conn).await;
                }
                return;
            }
            item = rx.recv() => item,
        };
        let Some(first) = first else {
            // the core forgot the connection without a close (shutdown
            // sends its close first)
            return;
        };
        let mut written = 0usize;
        let mut item = Some(first);
        let mut closing = None;
        while let Some(it) = item.take() {
            let msg = match it {
                ToWriter::Binary(b) => Message::Binary(b.into()),
                ToWriter::Ping => Message::Ping(Bytes::new()),
                ToWriter::Pong => Message::Pong(Bytes::new()),
                ToWriter::Close(code, reason) => {
                    closing = Some((code, reason));
                    break;
                }
            };
            match tokio::time::timeout(WRITE_DEADLINE, sink.feed(msg)).await {
                Ok(Ok(())) => written += 1,
                Ok(Err(e)) => {
                    tracing::debug!(conn, error = %e, "agent write failed");
                    return;
                }
                Err(_) => {
                    shared.metrics.write_timeouts.inc();
                    tracing::warn!(conn, "agent write deadline passed; closing");
                    return;
                }
            }
            if written < WRITE_BURST {
                item = rx.try_recv();
            }
        }
        if written > 0 {
            match tokio::time::timeout(WRITE_DEADLINE, sink.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(conn, error = %e, "agent flush failed");
                    return;
                }
                Err(_) => {
                    shared.metrics.write_timeouts.inc();
                    tracing::warn!(conn, "agent write deadline passed; closing");
                    return;
                }
            }
            for _ in 0..written {
                // during a stop the inbox is closed: the close that follows
                // must still be written
                let _ = core.send(ToCore::Conn(Input::Written { conn })).await;
            }
        }
        if let Some((code, reason)) = closing {
            send_close(&mut sink, code, reason, conn).await;
            return;
        }
    }
}

async fn send_close(
    sink: &mut futures_util::stream::SplitSink<Ws, Message>,
    code: u16,
    reason: &'static str,
    conn: ConnId,
) {
    let frame = CloseFrame {
        code: CloseCode::from(code),
        reason: reason.into(),
    };
    match tokio::time::timeout(WRITE_DEADLINE, sink.send(Message::Close(Some(frame)))).await {
        Ok(Ok(())) => tracing::debug!(conn, code, reason, "agent connection closed"),
        Ok(Err(e)) => tracing::debug!(conn, error = %e, "close frame not sent"),
        Err(_) => tracing::debug!(conn, "close frame not sent within the deadline"),
    }
}

#[cfg(test)]
mod subject_tests {
    use super::subject_cn;

    #[test]
    fn the_cn_of_a_subject_dn_as_nginx_gives_it() {
        assert_eq!(subject_cn("CN=web-1").as_deref(), Some("web-1"));
        assert_eq!(
            subject_cn("CN=web-1,OU=ops,O=Example Corp").as_deref(),
            Some("web-1")
        );
        assert_eq!(subject_cn("O=Example,cn=db-2").as_deref(), Some("db-2"));
        // an escaped comma is part of a value, not a separator
        assert_eq!(
            subject_cn("O=Example\\, Inc.,CN=web-1").as_deref(),
            Some("web-1")
        );
        assert_eq!(subject_cn("O=Example\\,CN=web-1").as_deref(), None);
        // none, two, or an empty one: no identity
        assert_eq!(subject_cn("O=Example"), None);
        assert_eq!(subject_cn("CN=a,CN=b"), None);
        assert_eq!(subject_cn("CN="), None);
        assert_eq!(subject_cn(""), None);
    }
}
