//! The client's transport (plan §7.1, §8): one WebSocket at a time to the
//! first server URL that answers, `wss://` through rustls with the
//! configured CA bundle or `ws://` (meant for loopback: a `ws://` URL to
//! another host is warned about loudly at startup).
//!
//! Owns: dialing when the core asks, one reader task that only hands
//! frames to the runtime thread, one writer task that writes what the
//! core released under a deadline, with two lanes (agent.proto): the
//! control lane (every frame but terminal traffic, and the pings, pongs
//! and close) always goes before the data lane (terminal traffic), so a
//! terminal streaming at full speed never holds up a heartbeat; and
//! telling the core when the connection it had ended (never about one it
//! closed itself, and never about an older one).
//!
//! Must never: decide anything of the protocol, reconnect on its own (the
//! core's backoff decides when to dial), or let a frame of an older
//! connection reach the core after it learned of a newer one.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use rvbox_client_core::machine::Input;
use rvbox_client_runtime::Wire;
use rvbox_config::ClientConfig;
use rvbox_supervisor::Waker;
use tokio::net::TcpStream;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Bytes, Message};
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};

use crate::daemon::ToRuntime;

/// Inputs the runtime thread's inbox holds before the reader waits.
pub(crate) const RUNTIME_INBOX: usize = 4096;
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
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| NetError::Tls(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
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
    /// The control lane.
    out: UnboundedSender<Message>,
    /// The data lane (terminal traffic).
    data: UnboundedSender<Message>,
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
        // the writer sends what the control lane holds, then the close,
        // then ends
        let _ = self.out.send(Message::Close(Some(frame)));
        drop(self.out);
        drop(self.data);
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

/// Runs the transport until the runtime's frame queue closes.
pub(crate) async fn run(cfg: NetConfig, mut wire: UnboundedReceiver<Wire>, poster: Poster) {
    let mut conn: Option<Conn> = None;
    let mut next_url = 0usize;
    let mut epoch = 0u64;
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<(u64, Option<u16>)>();
    loop {
        tokio::select! {
            w = wire.recv() => {
                let Some(w) = w else { break };
                match w {
                    Wire::Dial => {
                        if let Some(c) = conn.take() {
                            c.end().await;
                        }
                        epoch += 1;
                        let url = cfg.urls.get(next_url % cfg.urls.len()).cloned().unwrap_or_default();
                        match dial(&cfg, &url).await {
                            Ok(ws) => {
                                tracing::info!(%url, "connected");
                                // the core learns of the connection before
                                // any of its frames
                                if !poster.post(Input::Opened).await {
                                    break;
                                }
                                conn = Some(start(ws, epoch, poster.clone(), ended_tx.clone()));
                            }
                            Err(e) => {
                                tracing::warn!(%url, error = %e, "dial failed");
                                next_url = next_url.wrapping_add(1);
                                if !poster.post(Input::Closed(None)).await {
                                    break;
                                }
                            }
                        }
                    }
                    Wire::Binary(b) => send(conn.as_ref(), Message::Binary(b.into())),
                    Wire::Data(b) => send_data(conn.as_ref(), Message::Binary(b.into())),
                    Wire::Ping => send(conn.as_ref(), Message::Ping(Bytes::new())),
                    Wire::Pong => send(conn.as_ref(), Message::Pong(Bytes::new())),
                    Wire::Close(code) => {
                        if let Some(c) = conn.take() {
                            tracing::info!(code, "closing the connection");
                            c.close(code).await;
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
            ended = ended_rx.recv() => {
                let Some((e, code)) = ended else { continue };
                if conn.as_ref().is_some_and(|c| c.epoch == e) {
                    if let Some(c) = conn.take() {
                        c.end().await;
                    }
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
        }
    }
    if let Some(c) = conn.take() {
        c.end().await;
    }
}

fn send(conn: Option<&Conn>, msg: Message) {
    if let Some(c) = conn {
        // a writer that ended has reported it; the frame is the spool's
        let _ = c.out.send(msg);
    }
}

fn send_data(conn: Option<&Conn>, msg: Message) {
    if let Some(c) = conn {
        // as `send`: a writer that ended has reported it
        let _ = c.data.send(msg);
    }
}

/// What the writer takes next.
enum Next {
    /// A frame, the control lane's first.
    Frame(Message),
    /// Nothing waits now (only when not waiting).
    Idle,
    /// The control lane closed: the connection is ending.
    Closed,
}

/// The next frame to write, the control lane's first; waits for one when
/// `wait`.
async fn next_frame(
    ctl: &mut mpsc::UnboundedReceiver<Message>,
    data: &mut mpsc::UnboundedReceiver<Message>,
    data_open: &mut bool,
    wait: bool,
) -> Next {
    use mpsc::error::TryRecvError;
    match ctl.try_recv() {
        Ok(m) => return Next::Frame(m),
        Err(TryRecvError::Disconnected) => return Next::Closed,
        Err(TryRecvError::Empty) => {}
    }
    if *data_open {
        match data.try_recv() {
            Ok(m) => return Next::Frame(m),
            Err(TryRecvError::Disconnected) => *data_open = false,
            Err(TryRecvError::Empty) => {}
        }
    }
    if !wait {
        return Next::Idle;
    }
    loop {
        let got = if *data_open {
            tokio::select! {
                biased;
                m = ctl.recv() => m.map_or(Next::Closed, Next::Frame),
                m = data.recv() => match m {
                    Some(m) => Next::Frame(m),
                    None => {
                        *data_open = false;
                        continue;
                    }
                },
            }
        } else {
            ctl.recv().await.map_or(Next::Closed, Next::Frame)
        };
        return got;
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

fn start(ws: Ws, epoch: u64, poster: Poster, ended: UnboundedSender<(u64, Option<u16>)>) -> Conn {
    let (mut sink, mut stream) = ws.split();
    let (out, mut rx) = mpsc::unbounded_channel::<Message>();
    let (data, mut data_rx) = mpsc::unbounded_channel::<Message>();
    let ended_w = ended.clone();
    let writer = tokio::spawn(async move {
        let mut data_open = true;
        while let Next::Frame(first) = next_frame(&mut rx, &mut data_rx, &mut data_open, true).await
        {
            let mut item = Some(first);
            let mut n = 0;
            let mut closing = false;
            while let Some(msg) = item.take() {
                closing |= matches!(msg, Message::Close(_));
                match tokio::time::timeout(WRITE_DEADLINE, sink.feed(msg)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "write failed");
                        let _ = ended_w.send((epoch, None));
                        return;
                    }
                    Err(_) => {
                        tracing::warn!("write deadline passed");
                        let _ = ended_w.send((epoch, None));
                        return;
                    }
                }
                n += 1;
                if n < WRITE_BURST && !closing {
                    // the control lane first again: a ping queued behind a
                    // burst of terminal output waits for one frame at most
                    if let Next::Frame(m) =
                        next_frame(&mut rx, &mut data_rx, &mut data_open, false).await
                    {
                        item = Some(m);
                    }
                }
            }
            match tokio::time::timeout(WRITE_DEADLINE, sink.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    if !closing {
                        let _ = ended_w.send((epoch, None));
                    }
                    return;
                }
            }
            if closing {
                return;
            }
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
        out,
        data,
        reader,
        writer,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn name(n: Next) -> String {
        match n {
            Next::Frame(Message::Binary(b)) => String::from_utf8_lossy(&b).into_owned(),
            Next::Frame(Message::Ping(_)) => "ping".into(),
            Next::Frame(other) => format!("{other:?}"),
            Next::Idle => "idle".into(),
            Next::Closed => "closed".into(),
        }
    }

    #[tokio::test]
    async fn the_control_lane_goes_before_terminal_traffic_already_queued() {
        let (ctl_tx, mut ctl) = mpsc::unbounded_channel::<Message>();
        let (data_tx, mut data) = mpsc::unbounded_channel::<Message>();
        let mut open = true;
        for i in 0..3 {
            data_tx
                .send(Message::Binary(format!("output {i}").into_bytes().into()))
                .unwrap();
        }
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, false).await),
            "output 0"
        );
        ctl_tx.send(Message::Ping(Bytes::new())).unwrap();
        ctl_tx
            .send(Message::Binary(b"ack".to_vec().into()))
            .unwrap();
        // a heartbeat queued behind terminal output overtakes it
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, false).await),
            "ping"
        );
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, true).await),
            "ack"
        );
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, true).await),
            "output 1"
        );
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, false).await),
            "output 2"
        );
        assert_eq!(
            name(next_frame(&mut ctl, &mut data, &mut open, false).await),
            "idle"
        );
        // the data lane closing is not the end; the control lane's is
        drop(data_tx);
        ctl_tx.send(Message::Pong(Bytes::new())).unwrap();
        assert!(matches!(
            next_frame(&mut ctl, &mut data, &mut open, true).await,
            Next::Frame(Message::Pong(_))
        ));
        drop(ctl_tx);
        assert!(matches!(
            next_frame(&mut ctl, &mut data, &mut open, true).await,
            Next::Closed
        ));
    }
}
