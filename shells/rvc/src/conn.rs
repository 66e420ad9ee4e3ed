//! The connection to `rvbox-server`'s control socket, and the retry rule:
//! a call that fails because the server is unreachable or says it is
//! unavailable (restarting, recovering) is sent again, with the same
//! request, after a short pause, for a bounded time. Because every
//! mutation carries the invocation's one `request_id`, a retry of a call
//! that did reach the store returns the stored answer and does nothing
//! twice. Only one short "reconnecting" line is printed however many
//! retries it takes (R3).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use hyper_util::rt::TokioIo;
use rvbox_control_api::v1::control_client::ControlClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

use rvbox_domain::error::DomainError;

use crate::exit::Failure;

/// How long a call keeps being retried while the server is unreachable,
/// unless `--retry-for` says otherwise.
pub(crate) const RETRY_FOR: Duration = Duration::from_secs(60);
/// The longest `--retry-for`.
pub(crate) const MAX_RETRY_FOR: Duration = Duration::from_secs(24 * 3600);

static RETRY_WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// Sets this invocation's retry window (`--retry-for`), once.
pub(crate) fn set_retry_for(d: Duration) {
    let _ = RETRY_WINDOW.set(d);
}

/// This invocation's retry window.
pub(crate) fn retry_for() -> Duration {
    RETRY_WINDOW.get().copied().unwrap_or(RETRY_FOR)
}
/// The first pause between retries (doubling up to [`MAX_PAUSE`]).
pub(crate) const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between retries.
pub(crate) const MAX_PAUSE: Duration = Duration::from_secs(2);
/// How long one attempt of a unary call waits for its answer before it is
/// sent again (with the same request, so a mutation that did commit
/// answers what it stored).
pub(crate) const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// A lazily dialed control connection.
#[derive(Debug)]
pub(crate) struct Control {
    /// The control sockets to try, in order: one server, or several
    /// replicas of one database (`--socket A,B,C`); a failure moves to the
    /// next.
    sockets: Vec<String>,
    /// The one in use.
    at: usize,
    client: Option<ControlClient<Channel>>,
    said_reconnecting: bool,
    /// A connection succeeded once: a missing socket is then a server
    /// restarting (systemd removes its runtime directory), not a typo.
    connected_once: bool,
    /// Bytes written to the control socket, over every connection (an
    /// upload's progress).
    sent: Arc<AtomicU64>,
}

/// A stream that counts the bytes written to it.
struct Counting<S> {
    inner: S,
    sent: Arc<AtomicU64>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counting<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counting<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.sent.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &r {
            self.sent.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether a status is the transport's rather than an answer of the
/// service: the connection broke before, while or after the request went
/// out (the server was killed or restarted in the middle of the call).
/// rvbox-server gives every refusal an RVBox detail; a status without one
/// that tonic raised here (it keeps the underlying error as its source),
/// or that HTTP/2 reported as a reset or a cancellation, is a transport
/// failure, and the request may or may not have been applied.
pub(crate) fn is_transport_failure(s: &Status) -> bool {
    if DomainError::detail_from_grpc(s.details()).is_some() {
        return false;
    }
    std::error::Error::source(s).is_some()
        || matches!(s.code(), tonic::Code::Unknown | tonic::Code::Cancelled)
}

/// Whether a status means "try again with the same request": the server
/// said it is unavailable, or the transport failed.
pub(crate) fn retryable(s: &Status) -> bool {
    s.code() == tonic::Code::Unavailable || is_transport_failure(s)
}

impl Control {
    /// `socket` is one path, or several separated by commas (replicas).
    pub(crate) fn new(socket: &str) -> Self {
        let mut sockets: Vec<String> = socket
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if sockets.is_empty() {
            sockets.push(socket.to_owned());
        }
        Self {
            sockets,
            at: 0,
            client: None,
            said_reconnecting: false,
            connected_once: false,
            sent: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The count of bytes written to the control socket.
    pub(crate) fn sent_counter(&self) -> Arc<AtomicU64> {
        self.sent.clone()
    }

    async fn client(&mut self) -> Result<ControlClient<Channel>, Failure> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let path = self.socket().to_owned();
        let sent = self.sent.clone();
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // before any connection, a path that names no socket is a
                // mistake to report at once, unless another of several
                // does name one (that replica may be restarting)
                let none_exists = self
                    .sockets
                    .iter()
                    .all(|p| std::fs::symlink_metadata(p).is_err());
                if !self.connected_once && none_exists {
                    let paths = self.sockets.join(", ");
                    return Err(Failure::unreachable(format!(
                        "no control socket at {paths}; is rvbox-server running? (set --socket or RVC_SOCKET)"
                    )));
                }
                return Err(Failure::retry(format!(
                    "no control socket at {path}; is rvbox-server running? (set --socket or RVC_SOCKET)"
                )));
            }
            _ => {}
        }
        let endpoint = Endpoint::try_from("http://rvbox-server.invalid")
            .map_err(|e| Failure::internal(format!("endpoint: {e}")))?;
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                let sent = sent.clone();
                async move {
                    let inner = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(Counting { inner, sent }))
                }
            }))
            .await
            .map_err(|e| Failure::retry(format!("{}: {e}", self.socket())))?;
        let client = ControlClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        self.client = Some(client.clone());
        self.connected_once = true;
        Ok(client)
    }

    /// A client for single attempts made outside [`Self::retrying`] (the
    /// terminal viewer, which keeps its own retry rule): it dials on its
    /// first request, so getting it never waits on the server; a failed
    /// call says why, and [`Self::reset`] forgets it.
    pub(crate) fn lazy_client(&mut self) -> Result<ControlClient<Channel>, Failure> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let path = self.socket().to_owned();
        let sent = self.sent.clone();
        let endpoint = Endpoint::try_from("http://rvbox-server.invalid")
            .map_err(|e| Failure::internal(format!("endpoint: {e}")))?;
        let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
            let path = path.clone();
            let sent = sent.clone();
            async move {
                let inner = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(Counting { inner, sent }))
            }
        }));
        let client = ControlClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Says once that rvc is reconnecting.
    pub(crate) fn reconnecting(&mut self) {
        if !self.said_reconnecting {
            eprintln!("rvc: lost the server at {}; reconnecting…", self.socket());
            self.said_reconnecting = true;
        }
    }

    /// The control socket in use.
    fn socket(&self) -> &str {
        self.sockets.get(self.at).map_or("", String::as_str)
    }

    /// Forgets the connection after a failure: the next call dials again,
    /// the next socket of several (another replica).
    pub(crate) fn reset(&mut self) {
        self.client = None;
        if self.sockets.len() > 1 {
            self.at = (self.at + 1) % self.sockets.len();
        }
    }

    /// Runs `call` until it answers, fails for good, or the retry window
    /// ([`retry_for`]) passes without the server; an attempt without an answer within
    /// [`CALL_DEADLINE`] is sent again.
    pub(crate) async fn retrying<T, F, Fut>(&mut self, mut call: F) -> Result<T, Failure>
    where
        F: FnMut(ControlClient<Channel>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let give_up = Instant::now() + retry_for();
        let mut pause = FIRST_PAUSE;
        // a request went out without an answer (it may have been applied)
        let mut unanswered = false;
        loop {
            let failure = match self.client().await {
                Ok(c) => match tokio::time::timeout(CALL_DEADLINE, call(c)).await {
                    Ok(Ok(r)) => return Ok(r.into_inner()),
                    Ok(Err(s)) if retryable(&s) => {
                        // the service's UNAVAILABLE answer is a refusal
                        // before the store; a broken connection may not be
                        unanswered |= DomainError::detail_from_grpc(s.details()).is_none();
                        self.reset();
                        Failure::from_status(&s)
                    }
                    Ok(Err(s)) => return Err(Failure::from_status(&s)),
                    Err(_) => {
                        unanswered = true;
                        self.reset();
                        Failure::retry(format!(
                            "no answer from the server within {} s",
                            CALL_DEADLINE.as_secs()
                        ))
                    }
                },
                Err(f) if f.is_retry() => {
                    self.reset();
                    f
                }
                Err(f) => return Err(f),
            };
            if Instant::now() >= give_up {
                return Err(failure.into_final(unanswered));
            }
            self.reconnecting();
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}
