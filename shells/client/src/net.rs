//! The client's transport (plan §7.1, §8): one WebSocket at a time to the
//! first server URL that answers, `wss://` through rustls with the
//! configured CA bundle or `ws://` (meant for loopback: a `ws://` URL to
//! another host is warned about loudly at startup).
//!
//! Owns: dialing when the core asks, one reader task that only hands
//! frames to the runtime thread, one writer task that writes what the
//! core released under a deadline, from three bounded lanes
//! ([`crate::outbox`]): heartbeats (pings and pongs, which reach the
//! transport on their own channel too, so no frame ahead of them can hold
//! them up), then control (every frame but terminal traffic, and the
//! close), then data (terminal traffic); and telling the core when the
//! connection it had ended (never about one it closed itself, and never
//! about an older one). Every queue is bounded: the runtime hands frames
//! over a channel of [`WIRE_CHANNEL`] entries (the rest wait in the
//! runtime, within its own bounds); a lane that cannot take a frame ends
//! the connection, and the spool resends on the next.
//!
//! Must never: decide anything of the protocol, reconnect on its own (the
//! core's backoff decides when to dial), or let a frame of an older
//! connection reach the core after it learned of a newer one.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use rvbox_client_core::machine::Input;
use rvbox_client_runtime::Wire;
use rvbox_config::ClientConfig;
use rvbox_supervisor::Waker;
use tokio::net::TcpStream;
use tokio::sync::mpsc::{self, Receiver, UnboundedSender};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Bytes, Message};
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

use crate::daemon::ToRuntime;
use crate::outbox::{Full, Lane, Next, Outbox};

/// Inputs the runtime thread's inbox holds before the reader waits.
pub(crate) const RUNTIME_INBOX: usize = 4096;
/// Frames (and link steps) the runtime hands over before it keeps the
/// rest until the transport has taken some.
pub(crate) const WIRE_CHANNEL: usize = 1024;
/// Heartbeats the runtime hands over on their own channel; more are
/// dropped (a heartbeat carries nothing).
pub(crate) const HEARTBEAT_CHANNEL: usize = 16;
/// A dial (TCP, TLS and the WebSocket handshake) that takes longer fails.
/// Longer than the 25 s nginx's replicas configuration
/// (deploy/nginx/rvbox-replicas.conf) waits for a stalled replica's
/// upgrade answer before it tries the next replica, so a client whose
/// replica is paused lands on another one within one dial.
pub(crate) const DIAL_TIMEOUT: Duration = Duration::from_secs(30);
/// A frame not written within this long ends the connection.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Most frames one writer burst takes before it flushes.
pub(crate) const WRITE_BURST: usize = 64;
/// The WebSocket read buffer.
pub(crate) const READ_BUFFER: usize = 64 * 1024;
/// The system CA bundle used for `wss://` when `client.ca_file` is unset.
pub(crate) const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Why the network configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetError {
    /// The CA bundle.
    #[error("CA bundle {path}: {why}")]
    Ca {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// TLS set-up.
    #[error("TLS: {0}")]
    Tls(String),
    /// No URL.
    #[error("client.server_urls is empty")]
    NoUrl,
}

/// What the transport dials with.
#[derive(Debug, Clone)]
pub(crate) struct NetConfig {
    urls: Vec<String>,
    tls: Option<Arc<rustls::ClientConfig>>,
    ws: WebSocketConfig,
    /// Sent as [`CLIENT_HEADER`] on the upgrade, so a proxy in front of
    /// several server replicas can keep a client on one (nginx `hash
    /// $http_x_rvbox_client consistent`). The session's identity is still
    /// the `ClientHello`'s; the header only routes.
    client_id: String,
}

/// The upgrade request header naming the client, for routing only.
pub(crate) const CLIENT_HEADER: &str = "x-rvbox-client";

fn load_roots(path: &Path) -> Result<rustls::RootCertStore, NetError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let ca = |why: String| NetError::Ca {
        path: path.display().to_string(),
        why,
    };
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path).map_err(|e| ca(e.to_string()))?;
    for cert in certs {
        let cert = cert.map_err(|e| ca(e.to_string()))?;
        roots.add(cert).map_err(|e| ca(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(ca("holds no certificate".into()));
    }
    Ok(roots)
}

/// The client certificate chain and its key (`client.tls_cert_file`,
/// `client.tls_key_file`); the key must be owner-only.
fn load_identity(
    cert: &Path,
    key: &Path,
) -> Result<
    (
        Vec<rustls::pki_types::CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ),
    NetError,
> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use std::os::unix::fs::PermissionsExt as _;
    let tls = |what: &str, path: &Path, why: String| {
        NetError::Tls(format!("{what} {}: {why}", path.display()))
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| tls("client.tls_cert_file", cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls("client.tls_cert_file", cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(tls(
            "client.tls_cert_file",
            cert,
            "holds no certificate".into(),
        ));
    }
    let mode = std::fs::metadata(key)
        .map_err(|e| tls("client.tls_key_file", key, e.to_string()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(tls(
            "client.tls_key_file",
            key,
            format!(
                "is readable by group or others (mode {:03o}); make it 0600",
                mode & 0o777
            ),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| tls("client.tls_key_file", key, e.to_string()))?;
    Ok((chain, key_der))
}

impl NetConfig {
    /// From the validated configuration.
    ///
    /// # Errors
    /// [`NetError`] when the CA bundle cannot be read or TLS set up.
    pub(crate) fn from_config(cfg: &ClientConfig) -> Result<Self, NetError> {
        if cfg.client.server_urls.is_empty() {
            return Err(NetError::NoUrl);
        }
        for url in &cfg.client.server_urls {
            if let Some(rest) = url.strip_prefix("ws://") {
                let host = match rest.strip_prefix('[') {
                    Some(v6) => v6.split(']').next(),
                    None => rest.split(['/', ':']).next(),
                }
                .unwrap_or_default();
                let loopback = host == "localhost"
                    || host
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback());
                if !loopback {
                    tracing::warn!(%url, "PLAIN ws:// TO ANOTHER HOST: commands and output cross the network unencrypted; use wss:// through nginx");
                }
            }
        }
        let needs_tls = cfg
            .client
            .server_urls
            .iter()
            .any(|u| u.starts_with("wss://"));
        let tls = if needs_tls {
            let path = cfg
                .client
                .ca_file
                .clone()
                .unwrap_or_else(|| SYSTEM_CA_BUNDLE.into());
            let roots = load_roots(&path)?;
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let builder = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| NetError::Tls(e.to_string()))?
                .with_root_certificates(roots);
            let config = match &cfg.client.tls_identity {
                Some((cert, key)) => {
                    let (chain, key) = load_identity(cert, key)?;
                    builder
                        .with_client_auth_cert(chain, key)
                        .map_err(|e| NetError::Tls(format!("client certificate: {e}")))?
                }
                None => builder.with_no_client_auth(),
            };
            Some(Arc::new(config))
        } else {
            None
        };
        let max = usize::try_from(rvbox_domain::limits::MAX_ENVELOPE_BYTES).unwrap_or(1 << 20);
        let ws = WebSocketConfig::default()
            .read_buffer_size(READ_BUFFER)
            .write_buffer_size(0)
            .max_message_size(Some(max))
            .max_frame_size(Some(max))
            .max_write_buffer_size(max.saturating_mul(2));
        Ok(Self {
            urls: cfg.client.server_urls.clone(),
            tls,
            ws,
            client_id: cfg.client.client_id.clone(),
        })
    }
}

/// Posts inputs to the runtime thread and wakes it.
#[derive(Debug, Clone)]
pub(crate) struct Poster {
    tx: SyncSender<ToRuntime>,
    waker: Waker,
}

impl Poster {
    pub(crate) fn new(tx: SyncSender<ToRuntime>, waker: Waker) -> Self {
        Self { tx, waker }
    }

    async fn send(&self, msg: ToRuntime) -> bool {
        let mut msg = msg;
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => {
                    self.waker.wake();
                    return true;
                }
                Err(TrySendError::Full(m)) => {
                    // the runtime thread is behind: the socket waits (the
                    // server's windows bound what is in flight)
                    msg = m;
                    self.waker.wake();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(TrySendError::Disconnected(_)) => return false,
            }
        }
    }

    async fn post(&self, input: Input) -> bool {
        self.send(ToRuntime::Input(input)).await
    }

    /// Asks the runtime thread to stop.
    pub(crate) async fn stop(&self) {
        let _ = self.send(ToRuntime::Stop).await;
    }
}

/// One open connection.
struct Conn {
    epoch: u64,
    /// Its lanes.
    outbox: Arc<Outbox>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Conn {
    /// Ends both tasks and waits until they are gone, so nothing of this
    /// connection reaches the core afterwards.
    async fn end(self) {
        self.reader.abort();
        self.writer.abort();
        let _ = self.reader.await;
        let _ = self.writer.await;
    }

    /// Sends a close frame, then ends.
    async fn close(self, code: u16) {
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: close_reason(code).into(),
        };
        self.reader.abort();
        let _ = self.reader.await;
        // the writer sends what the heartbeat and control lanes hold,
        // then the close, then ends
        self.outbox.close_with(Message::Close(Some(frame)));
        if tokio::time::timeout(WRITE_DEADLINE, self.writer)
            .await
            .is_err()
        {
            tracing::debug!("close frame not written within the deadline");
        }
    }
}

fn close_reason(code: u16) -> &'static str {
    match code {
        1000 => "NORMAL",
        1002 => "PROTOCOL_ERROR",
        1009 => "MESSAGE_TOO_BIG",
        1011 => "INTERNAL_ERROR",
        1012 => "SERVICE_RESTART",
        _ => "",
    }
}

/// A lane, as a metric label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LaneLabel {
    lane: &'static str,
}

/// The transport's metrics (plan §11.1), bounded labels only (a lane).
#[derive(Clone, Debug)]
pub(crate) struct TransportMetrics {
    /// Frames waiting on each lane of the current connection.
    queued_frames: Family<LaneLabel, Gauge>,
    /// Bytes waiting on each lane of the current connection.
    queued_bytes: Family<LaneLabel, Gauge>,
    /// Connections ended because a lane was full, by lane.
    overflows: Family<LaneLabel, Counter>,
    /// Heartbeats dropped because their lane or channel was full.
    heartbeats_dropped: Counter,
    /// Dials that failed.
    dial_failures: Counter,
    /// From a connection's loss (or the first dial) to the next
    /// connection opened, in seconds.
    reconnect_seconds: Histogram,
}

impl TransportMetrics {
    pub(crate) fn new() -> Self {
        Self {
            queued_frames: Family::default(),
            queued_bytes: Family::default(),
            overflows: Family::default(),
            heartbeats_dropped: Counter::default(),
            dial_failures: Counter::default(),
            reconnect_seconds: Histogram::new([
                0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
            ]),
        }
    }

    /// Registers every metric under `rvbox_client_transport_`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("rvbox_client_transport");
        r.register(
            "queued_frames",
            "Frames waiting on each lane of the current connection (heartbeat, control, data)",
            self.queued_frames.clone(),
        );
        r.register(
            "queued_bytes",
            "Bytes waiting on each lane of the current connection",
            self.queued_bytes.clone(),
        );
        r.register(
            "overflows",
            "Connections ended because a lane was full, by lane",
            self.overflows.clone(),
        );
        r.register(
            "heartbeats_dropped",
            "Pings and pongs dropped because their queue was full",
            self.heartbeats_dropped.clone(),
        );
        r.register(
            "dial_failures",
            "Dials that failed (TCP, TLS or the WebSocket upgrade)",
            self.dial_failures.clone(),
        );
        r.register(
            "reconnect_seconds",
            "From a connection's loss (or the daemon's first dial) to the next connection opened",
            self.reconnect_seconds.clone(),
        );
    }

    fn observe(&self, outbox: &Outbox) {
        for lane in [Lane::Heartbeat, Lane::Control, Lane::Data] {
            let (frames, bytes) = outbox.depth(lane);
            let label = LaneLabel { lane: lane.name() };
            self.queued_frames
                .get_or_create(&label)
                .set(i64::try_from(frames).unwrap_or(i64::MAX));
            self.queued_bytes
                .get_or_create(&label)
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }
}

/// What the runtime thread hands the transport.
#[derive(Debug)]
pub(crate) struct WireRx {
    /// Frames and link steps, in order.
    pub(crate) frames: Receiver<Wire>,
    /// Pings and pongs.
    pub(crate) heartbeats: Receiver<Wire>,
}

/// Runs the transport until the runtime's frame queue closes.
pub(crate) async fn run(cfg: NetConfig, wire: WireRx, poster: Poster, metrics: TransportMetrics) {
    let WireRx {
        frames: mut wire,
        mut heartbeats,
    } = wire;
    let mut conn: Option<Conn> = None;
    let mut next_url = 0usize;
    let mut epoch = 0u64;
    // since when no connection is open (reconnect duration)
    let mut lost_at: Option<tokio::time::Instant> = None;
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<(u64, Option<u16>)>();
    loop {
        // a frame a lane could not take ends the connection
        let mut overflow: Option<Full> = None;
        tokio::select! {
            biased;
            h = heartbeats.recv(), if conn.is_some() => {
                let Some(h) = h else { break };
                let msg = match h {
                    Wire::Ping => Message::Ping(Bytes::new()),
                    _ => Message::Pong(Bytes::new()),
                };
                if let Some(c) = conn.as_ref()
                    && c.outbox.push(Lane::Heartbeat, msg).is_err()
                {
                    metrics.heartbeats_dropped.inc();
                    tracing::debug!("heartbeat lane full; heartbeat dropped");
                }
            }
            ended = ended_rx.recv() => {
                let Some((e, code)) = ended else { continue };
                if conn.as_ref().is_some_and(|c| c.epoch == e) {
                    if let Some(c) = conn.take() {
                        c.end().await;
                    }
                    lost_at.get_or_insert_with(tokio::time::Instant::now);
                    tracing::info!(code = ?code, "connection ended");
                    if code.is_none() {
                        // a transport failure: the next dial tries the
                        // next URL
                        next_url = next_url.wrapping_add(1);
                    }
                    if !poster.post(Input::Closed(code)).await {
                        break;
                    }
                }
            }
            w = wire.recv() => {
                let Some(w) = w else { break };
                match w {
                    Wire::Dial => {
                        if let Some(c) = conn.take() {
                            c.end().await;
                        }
                        epoch += 1;
                        let since = *lost_at.get_or_insert_with(tokio::time::Instant::now);
                        let url = cfg.urls.get(next_url % cfg.urls.len()).cloned().unwrap_or_default();
                        match dial(&cfg, &url).await {
                            Ok(ws) => {
                                let waited = since.elapsed();
                                metrics.reconnect_seconds.observe(waited.as_secs_f64());
                                lost_at = None;
                                tracing::info!(%url, reconnect_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX), "connected");
                                // heartbeats meant for the last connection
                                // are not the new one's
                                while heartbeats.try_recv().is_ok() {}
                                // the core learns of the connection before
                                // any of its frames
                                if !poster.post(Input::Opened).await {
                                    break;
                                }
                                conn = Some(start(ws, epoch, poster.clone(), ended_tx.clone(), metrics.clone()));
                            }
                            Err(e) => {
                                metrics.dial_failures.inc();
                                tracing::warn!(%url, error = %e, "dial failed");
                                next_url = next_url.wrapping_add(1);
                                if !poster.post(Input::Closed(None)).await {
                                    break;
                                }
                            }
                        }
                    }
                    Wire::Binary(b) => overflow = push(conn.as_ref(), Lane::Control, Message::Binary(b.into()), &metrics),
                    Wire::Data(b) => overflow = push(conn.as_ref(), Lane::Data, Message::Binary(b.into()), &metrics),
                    Wire::Ping => overflow = push(conn.as_ref(), Lane::Heartbeat, Message::Ping(Bytes::new()), &metrics),
                    Wire::Pong => overflow = push(conn.as_ref(), Lane::Heartbeat, Message::Pong(Bytes::new()), &metrics),
                    Wire::Close(code) => {
                        if let Some(c) = conn.take() {
                            tracing::info!(code, "closing the connection");
                            c.close(code).await;
                            lost_at.get_or_insert_with(tokio::time::Instant::now);
                        }
                        if code == rvbox_client_core::link::codes::liveness_timeout() {
                            // plan R5: a stall (nothing heard for the
                            // liveness timeout, or no welcome in time)
                            // moves to the next URL like a transport error
                            next_url = next_url.wrapping_add(1);
                        }
                    }
                }
            }
        }
        if let Some(Full(lane)) = overflow {
            // the connection cannot keep up: end it rather than grow; the
            // spool resends every unacknowledged event on the next one
            metrics
                .overflows
                .get_or_create(&LaneLabel { lane: lane.name() })
                .inc();
            tracing::warn!(
                lane = lane.name(),
                "transport lane full; ending the connection"
            );
            if let Some(c) = conn.take() {
                c.end().await;
            }
            lost_at.get_or_insert_with(tokio::time::Instant::now);
            next_url = next_url.wrapping_add(1);
            if !poster.post(Input::Closed(None)).await {
                break;
            }
        }
    }
    if let Some(c) = conn.take() {
        c.end().await;
    }
}

/// Queues a frame on the current connection's `lane`; the lane that was
/// full when it is not a heartbeat's (a frame with no connection is the
/// spool's, and a heartbeat carries nothing).
fn push(conn: Option<&Conn>, lane: Lane, msg: Message, metrics: &TransportMetrics) -> Option<Full> {
    let c = conn?;
    let pushed = c.outbox.push(lane, msg);
    metrics.observe(&c.outbox);
    match pushed {
        Ok(()) => None,
        Err(_) if lane == Lane::Heartbeat => {
            metrics.heartbeats_dropped.inc();
            None
        }
        Err(full) => Some(full),
    }
}

async fn dial(cfg: &NetConfig, url: &str) -> Result<Ws, String> {
    let connector = if url.starts_with("wss://") {
        cfg.tls.as_ref().map(|t| Connector::Rustls(Arc::clone(t)))
    } else {
        Some(Connector::Plain)
    };
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let mut request = url
        .into_client_request()
        .map_err(|e| format!("server URL {url}: {e}"))?;
    // client ids are ASCII letters, digits, '.', '-' and '_'
    if let Ok(v) = tungstenite::http::HeaderValue::from_str(&cfg.client_id) {
        request.headers_mut().insert(CLIENT_HEADER, v);
    }
    let attempt =
        tokio_tungstenite::connect_async_tls_with_config(request, Some(cfg.ws), true, connector);
    match tokio::time::timeout(DIAL_TIMEOUT, attempt).await {
        Ok(Ok((ws, _response))) => Ok(ws),
        Ok(Err(tungstenite::Error::Http(r))) => {
            Err(format!("the server answered HTTP {}", r.status()))
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no connection within {} s", DIAL_TIMEOUT.as_secs())),
    }
}

/// How a writer ended.
#[derive(Debug, PartialEq, Eq)]
enum WriterEnd {
    /// The close frame was written (or the outbox closed).
    Closed,
    /// A write failed or passed its deadline: the connection is lost.
    Lost,
}

/// Writes the outbox's frames into `sink`, the highest lane first, up to
/// [`WRITE_BURST`] before each flush, each within [`WRITE_DEADLINE`];
/// after every frame the lanes are looked at again, so a heartbeat waits
/// for one frame at most.
async fn write_lanes<S>(sink: &mut S, outbox: &Outbox, metrics: &TransportMetrics) -> WriterEnd
where
    S: futures_util::Sink<Message> + Unpin,
    S::Error: std::fmt::Display,
{
    while let Next::Frame(first) = outbox.next(true).await {
        let mut item = Some(first);
        let mut n = 0;
        let mut closing = false;
        while let Some(msg) = item.take() {
            closing |= matches!(msg, Message::Close(_));
            match tokio::time::timeout(WRITE_DEADLINE, sink.feed(msg)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "write failed");
                    return WriterEnd::Lost;
                }
                Err(_) => {
                    tracing::warn!("write deadline passed");
                    return WriterEnd::Lost;
                }
            }
            n += 1;
            // the lanes are looked at again after every frame: a
            // heartbeat waits for one frame at most
            if n < WRITE_BURST
                && !closing
                && let Next::Frame(m) = outbox.next(false).await
            {
                item = Some(m);
            }
        }
        metrics.observe(outbox);
        match tokio::time::timeout(WRITE_DEADLINE, sink.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => {
                return if closing {
                    WriterEnd::Closed
                } else {
                    WriterEnd::Lost
                };
            }
        }
        if closing {
            return WriterEnd::Closed;
        }
    }
    WriterEnd::Closed
}

fn start(
    ws: Ws,
    epoch: u64,
    poster: Poster,
    ended: UnboundedSender<(u64, Option<u16>)>,
    metrics: TransportMetrics,
) -> Conn {
    let (mut sink, mut stream) = ws.split();
    let outbox = Arc::new(Outbox::default());
    metrics.observe(&outbox);
    let ended_w = ended.clone();
    let lanes = Arc::clone(&outbox);
    let writer = tokio::spawn(async move {
        if write_lanes(&mut sink, &lanes, &metrics).await == WriterEnd::Lost {
            let _ = ended_w.send((epoch, None));
        }
    });
    let reader = tokio::spawn(async move {
        loop {
            let input = match stream.next().await {
                Some(Ok(Message::Binary(b))) => Input::Frame(b.to_vec()),
                Some(Ok(Message::Ping(_))) => Input::Ping,
                Some(Ok(Message::Pong(_))) => Input::Pong,
                Some(Ok(Message::Close(frame))) => {
                    let _ = ended.send((epoch, Some(frame.map_or(1005, |f| u16::from(f.code)))));
                    return;
                }
                Some(Ok(Message::Text(_))) => {
                    tracing::warn!("text message from the server; dropping the connection");
                    let _ = ended.send((epoch, None));
                    return;
                }
                Some(Ok(Message::Frame(_))) => continue,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "read failed");
                    let _ = ended.send((epoch, None));
                    return;
                }
                None => {
                    let _ = ended.send((epoch, None));
                    return;
                }
            };
            if !poster.post(input).await {
                return;
            }
        }
    });
    Conn {
        epoch,
        outbox,
        reader,
        writer,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn name(m: &Message) -> String {
        match m {
            Message::Binary(b) => String::from_utf8_lossy(b).into_owned(),
            Message::Ping(_) => "ping".into(),
            Message::Pong(_) => "pong".into(),
            Message::Close(_) => "close".into(),
            other => format!("{other:?}"),
        }
    }

    fn bin(s: &str) -> Message {
        Message::Binary(s.as_bytes().to_vec().into())
    }

    /// A sink that keeps what it is given, or refuses everything.
    struct VecSink {
        out: Vec<Message>,
        broken: bool,
    }

    impl futures_util::Sink<Message> for VecSink {
        type Error = String;
        fn poll_ready(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), String>> {
            std::task::Poll::Ready(if self.broken {
                Err("broken pipe".into())
            } else {
                Ok(())
            })
        }
        fn start_send(mut self: std::pin::Pin<&mut Self>, m: Message) -> Result<(), String> {
            self.out.push(m);
            Ok(())
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), String>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_close(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), String>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// The writer takes the lanes in rank order and ends at the close; a
    /// sink that fails ends it as a lost connection.
    #[tokio::test]
    async fn the_writer_writes_heartbeats_first_and_ends_at_the_close() {
        let outbox = Outbox::default();
        for i in 0..100 {
            outbox
                .push(Lane::Data, bin(&format!("output {i}")))
                .unwrap();
        }
        outbox.push(Lane::Control, bin("event")).unwrap();
        outbox
            .push(Lane::Heartbeat, Message::Ping(Bytes::new()))
            .unwrap();
        outbox.close_with(Message::Close(None));
        let mut sink = VecSink {
            out: Vec::new(),
            broken: false,
        };
        let end = write_lanes(&mut sink, &outbox, &TransportMetrics::new()).await;
        assert_eq!(end, WriterEnd::Closed);
        let written: Vec<String> = sink.out.iter().map(name).collect();
        // terminal traffic still waiting at the close is dropped
        assert_eq!(written, vec!["ping", "event", "close"]);

        let outbox = Outbox::default();
        outbox.push(Lane::Control, bin("event")).unwrap();
        let mut sink = VecSink {
            out: Vec::new(),
            broken: true,
        };
        assert_eq!(
            write_lanes(&mut sink, &outbox, &TransportMetrics::new()).await,
            WriterEnd::Lost
        );
    }
}
