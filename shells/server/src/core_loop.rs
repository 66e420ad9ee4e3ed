//! The server core's thread (architecture: "one thread: inbox (bounded) ->
//! server core -> poll_output"): a thin loop that receives one input,
//! hands it to one `ServerCore::handle`, drains every output and performs
//! it, and re-arms the one timer at `poll_timeout`.
//!
//! Owns: the core, the map from connections to their writers, the control
//! calls waiting for an answer, and the executor thread's handle.
//!
//! Must never: call the store (every store operation goes to the executor
//! thread as a batch and comes back as a completion), wait on a socket (a
//! writer's queue is given a frame with `try_send`, and its room is the
//! core's own writer window), or decide anything of the protocol.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rvbox_engine::ExecutorThread;
use rvbox_engine::thread::CompletionSink;
use rvbox_proto::v1 as wire;
use rvbox_server_core::{
    Caller, ConnId, ControlAnswer, ControlCall, Input, Output, RequestId, ServerCore, WRITER_WINDOW,
};
use rvbox_store_port::ops::{Backend, OpResult, OpToken};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::ServerMetrics;
use crate::writer_queue::{TrySendError, WriterTx};

/// Messages the core's inbox holds before senders wait (readers never
/// wait: a frame that finds it full closes its connection). Sized for a
/// fleet run's fan-out: each of many thousand sessions answers its
/// dispatch with a handful of frames within the same second.
pub(crate) const INBOX: usize = 65_536;
/// Agent frame bytes the core's inbox holds: a frame that would pass it
/// closes its connection as a full inbox does.
pub(crate) const INBOX_BYTES: i64 = 256 << 20;
/// Most inbox messages one turn takes before it performs their outputs.
pub(crate) const MAX_INPUTS_PER_TURN: usize = 256;
/// Frames a connection's writer queue holds: the core hands a writer at
/// most [`WRITER_WINDOW`] frames not yet reported written, and the close
/// always finds the one slot left.
pub(crate) const WRITER_QUEUE: usize = WRITER_WINDOW + 1;
/// How long a shutdown waits for store operations in flight.
pub(crate) const SHUTDOWN_DRAIN: Duration = Duration::from_secs(10);

/// What a connection's writer is given, in order.
#[derive(Debug)]
pub(crate) enum ToWriter {
    /// One binary message (an encoded envelope).
    Binary(Vec<u8>),
    /// A WebSocket Ping.
    Ping,
    /// A WebSocket Pong.
    Pong,
    /// A close frame with this code and reason text; the writer ends.
    Close(u16, &'static str),
}

/// What the core's thread receives.
#[derive(Debug)]
pub(crate) enum ToCore {
    /// A connection upgraded; its frames go to `writer`.
    Open {
        /// The connection.
        conn: ConnId,
        /// Its writer's queue.
        writer: WriterTx<ToWriter>,
        /// The client its verified TLS client certificate names
        /// (`server.client_identity = "tls-client-cert"`).
        certified: Option<String>,
    },
    /// An input about a connection (frame, ping, pong, written,
    /// disconnected).
    Conn(Input),
    /// A control call; the answer goes to `reply`.
    Control {
        /// Who called.
        caller: Caller,
        /// The call.
        call: ControlCall,
        /// Where the answer goes.
        reply: oneshot::Sender<ControlAnswer>,
    },
    /// An input from the replica machinery (docs/scaleout.md): duties
    /// held, serving or not, a wake-up for a client's work.
    Replica(Input),
    /// Another replica stored events: followers read again.
    Changed,
    /// Audit records of the edges (`edge_audit`): the core writes them
    /// within their rate limits.
    Audit(Vec<rvbox_store_port::audit::SessionAudit>),
    /// Stop: close every connection with 1012, finish the store
    /// operations in flight (bounded), and answer `done`.
    Shutdown {
        /// Answered when the core has stopped.
        done: oneshot::Sender<ShutdownReport>,
    },
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShutdownReport {
    /// Connections closed with 1012.
    pub(crate) closed: usize,
    /// Store operations still in flight when the wait ended (0: all
    /// finished).
    pub(crate) unfinished: usize,
}

/// The clock every input carries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
}

impl Clock {
    pub(crate) fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// Monotonic milliseconds since the server started.
    pub(crate) fn now_ms(self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant of a monotonic deadline.
    fn instant(self, ms: u64) -> Instant {
        self.start + Duration::from_millis(ms)
    }

    /// Wall-clock milliseconds since the Unix epoch.
    pub(crate) fn wall_ms() -> i64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// Completions from the executor thread, into the core's own channel (it
/// is read before the inbox, so it never fills while the core waits on
/// the executor's queue).
struct Completions(mpsc::Sender<Vec<(OpToken, OpResult)>>, Arc<ServerMetrics>);

impl CompletionSink for Completions {
    fn deliver(&mut self, done: Vec<(OpToken, OpResult)>) -> bool {
        self.0.blocking_send(done).is_ok()
    }

    fn observe(&mut self, pass: &rvbox_engine::PassReport) {
        self.1.store_pass(pass);
        if !pass.failed.is_empty() {
            tracing::warn!(
                failed = pass.failed.len(),
                ops = pass.ops,
                first = pass.failed.first().copied().unwrap_or(""),
                "store operations failed"
            );
        }
    }
}

/// The core's thread, running.
#[derive(Debug)]
pub(crate) struct CoreThread {
    tx: mpsc::Sender<ToCore>,
    thread: std::thread::JoinHandle<()>,
    /// Resolves when the thread ends (a stop, or the executor failed).
    ended: Option<oneshot::Receiver<()>>,
}

impl CoreThread {
    /// Starts the executor thread over `backend` (the SQLite executor,
    /// or the PostgreSQL store of a replica) and the core's thread.
    pub(crate) fn spawn<B: Backend + Send + 'static>(
        core: ServerCore,
        backend: B,
        clock: Clock,
        metrics: Arc<ServerMetrics>,
        changes: tokio::sync::watch::Sender<u64>,
    ) -> std::io::Result<Self> {
        let (tx, inbox) = mpsc::channel(INBOX);
        let (ctx, completions) = mpsc::channel(2 * rvbox_engine::thread::EXECUTOR_QUEUE);
        let exec = ExecutorThread::spawn_backend(backend, Completions(ctx, Arc::clone(&metrics)))?;
        let (ended_tx, ended) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("rvbox-server-core".into())
            .spawn(move || {
                // dropped when the thread ends, however it ends
                let _ended = ended_tx;
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "the core's timer runtime could not start");
                        return;
                    }
                };
                let mut lp = Loop {
                    core,
                    exec: Some(exec),
                    clock,
                    writers: BTreeMap::new(),
                    replies: BTreeMap::new(),
                    next_request: 1,
                    batch: Vec::new(),
                    metrics,
                    changes,
                    executor_failed: false,
                };
                rt.block_on(lp.run(inbox, completions));
                lp.stop_executor();
            })?;
        Ok(Self {
            tx,
            thread,
            ended: Some(ended),
        })
    }

    /// Resolves when the thread ends; the first call takes it.
    pub(crate) fn ended(&mut self) -> Option<oneshot::Receiver<()>> {
        self.ended.take()
    }

    /// A sender into the core's inbox.
    pub(crate) fn sender(&self) -> mpsc::Sender<ToCore> {
        self.tx.clone()
    }

    /// Waits for the thread to end (after a shutdown).
    pub(crate) fn join(self) {
        drop(self.tx);
        if self.thread.join().is_err() {
            tracing::error!("the server core's thread panicked");
        }
    }
}

struct Loop<B> {
    core: ServerCore,
    exec: Option<ExecutorThread<B>>,
    clock: Clock,
    writers: BTreeMap<ConnId, WriterTx<ToWriter>>,
    replies: BTreeMap<RequestId, oneshot::Sender<ControlAnswer>>,
    next_request: u64,
    batch: rvbox_engine::thread::Batch,
    metrics: Arc<ServerMetrics>,
    /// Bumped after every batch of completions: followers read again.
    changes: tokio::sync::watch::Sender<u64>,
    /// The executor thread is gone: nothing can become durable any more.
    executor_failed: bool,
}

impl<B: Backend + Send + 'static> Loop<B> {
    async fn run(
        &mut self,
        mut inbox: mpsc::Receiver<ToCore>,
        mut completions: mpsc::Receiver<Vec<(OpToken, OpResult)>>,
    ) {
        loop {
            let deadline = self.core.poll_timeout().map(|t| self.clock.instant(t));
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                Some(done) = completions.recv() => self.completions(done),
                msg = inbox.recv() => {
                    let Some(msg) = msg else { return };
                    if let Some(done) = self.message(msg) {
                        self.shutdown(&mut inbox, &mut completions, done).await;
                        return;
                    }
                    // take what else is waiting, so its store operations
                    // share one batch (and its appends one group)
                    for _ in 1..MAX_INPUTS_PER_TURN {
                        let Ok(msg) = inbox.try_recv() else { break };
                        if let Some(done) = self.message(msg) {
                            self.shutdown(&mut inbox, &mut completions, done).await;
                            return;
                        }
                    }
                }
                () = sleep => self.input(Input::Timeout),
            }
            self.submit();
            if self.executor_failed {
                // nothing more can be acknowledged: stop, so the daemon
                // exits and is restarted (its recovery repairs the rest)
                tracing::error!("the server core stops: the store executor failed");
                return;
            }
        }
    }

    fn completions(&mut self, done: Vec<(OpToken, OpResult)>) {
        for (token, result) in done {
            self.input(Input::Completion { token, result });
        }
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Handles one inbox message; a shutdown is returned to the caller.
    fn message(&mut self, msg: ToCore) -> Option<oneshot::Sender<ShutdownReport>> {
        match msg {
            ToCore::Open {
                conn,
                writer,
                certified,
            } => {
                self.writers.insert(conn, writer);
                self.metrics.connections.set(gauge(self.writers.len()));
                self.input(Input::Connected { conn });
                if let Some(client_id) = certified {
                    self.input(Input::Certified { conn, client_id });
                }
            }
            ToCore::Conn(input) => {
                if let Input::Frame { bytes, .. } = &input {
                    self.metrics
                        .inbox_bytes
                        .dec_by(i64::try_from(bytes.len()).unwrap_or(0));
                }
                if let Input::Disconnected { conn } = &input
                    && self.writers.remove(conn).is_none()
                {
                    // the core closed it first and has forgotten it
                    return None;
                }
                self.metrics.connections.set(gauge(self.writers.len()));
                self.input(input);
            }
            ToCore::Control {
                caller,
                call,
                reply,
            } => {
                let request = RequestId(self.next_request);
                self.next_request += 1;
                self.replies.insert(request, reply);
                self.input(Input::Control {
                    request,
                    caller,
                    call,
                });
            }
            ToCore::Replica(input) => self.input(input),
            ToCore::Audit(records) => self.input(Input::Audit(records)),
            ToCore::Changed => self.changes.send_modify(|n| *n = n.wrapping_add(1)),
            ToCore::Shutdown { done } => return Some(done),
        }
        None
    }

    fn input(&mut self, input: Input) {
        self.core
            .handle(self.clock.now_ms(), Clock::wall_ms(), input);
        self.drain();
        self.metrics.terminal_stats(self.core.stats());
        let waits = self.core.take_dispatch_waits();
        self.metrics
            .dispatch_waits(&waits, self.core.stats().dispatch_waits_dropped);
    }

    /// Performs every output of the core, in order. Inputs the outputs
    /// cause at once (a writer queue that could not take a frame) are
    /// handled before returning.
    fn drain(&mut self) {
        let mut again = Vec::new();
        loop {
            while let Some(out) = self.core.poll_output() {
                if let Some(input) = self.perform(out) {
                    again.push(input);
                }
            }
            if again.is_empty() {
                return;
            }
            for input in std::mem::take(&mut again) {
                self.core
                    .handle(self.clock.now_ms(), Clock::wall_ms(), input);
            }
        }
    }

    fn perform(&mut self, out: Output) -> Option<Input> {
        match out {
            Output::Store { token, wall_ms, op } => {
                self.batch.push((token, wall_ms, op));
                None
            }
            Output::Frame {
                conn,
                control,
                bytes,
            } => self.hand_to_writer(conn, ToWriter::Binary(bytes), control),
            Output::Ping { conn } => self.hand_to_writer(conn, ToWriter::Ping, true),
            Output::Pong { conn } => self.hand_to_writer(conn, ToWriter::Pong, true),
            Output::Close { conn, reason } => {
                self.close(conn, reason);
                None
            }
            Output::Reply { request, answer } => {
                if let Some(reply) = self.replies.remove(&request) {
                    // a caller that gave up has dropped its end
                    let _ = reply.send(answer);
                }
                None
            }
            Output::Audit {
                conn,
                client,
                audit,
            } => {
                tracing::info!(
                    conn,
                    client = client.as_deref().unwrap_or(""),
                    kind = ?audit.kind,
                    detail = %audit.detail,
                    "session audit"
                );
                None
            }
            Output::Metric(m) => {
                self.metrics.session(m.name, m.reason);
                None
            }
        }
    }

    fn hand_to_writer(&mut self, conn: ConnId, item: ToWriter, control: bool) -> Option<Input> {
        let writer = self.writers.get(&conn)?;
        match writer.try_send(item) {
            Ok(()) => None,
            // the writer ended (its socket failed): the reader reports
            // the disconnection
            Err(TrySendError::Closed(_)) => None,
            Err(TrySendError::Full(_)) => {
                // the core's writer window makes this unreachable; named,
                // not assumed
                tracing::error!(conn, control, "writer queue full");
                Some(Input::LaneFull { conn, control })
            }
        }
    }

    fn close(&mut self, conn: ConnId, reason: wire::CloseReason) {
        let Some(writer) = self.writers.remove(&conn) else {
            return;
        };
        self.metrics.connections.set(gauge(self.writers.len()));
        let code = rvbox_session::close_code(reason).unwrap_or(1000);
        let text = rvbox_session::close_text(reason);
        self.metrics.closed(text);
        // the queue keeps one slot for the close; a writer that is gone
        // has dropped its socket already
        let _ = writer.try_send(ToWriter::Close(code, text));
    }

    /// Hands the batch gathered this turn to the executor thread.
    fn submit(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        let n = batch.len();
        let Some(exec) = &self.exec else { return };
        if exec.submit(batch).is_err() {
            // the executor stopped (it panicked): nothing more can become
            // durable, so nothing more is acknowledged
            tracing::error!(ops = n, "the store executor is gone");
            self.metrics.executor_gone.inc();
            self.executor_failed = true;
        }
    }

    async fn shutdown(
        &mut self,
        inbox: &mut mpsc::Receiver<ToCore>,
        completions: &mut mpsc::Receiver<Vec<(OpToken, OpResult)>>,
        done: oneshot::Sender<ShutdownReport>,
    ) {
        // no new work: control calls still queued are refused, and every
        // connection is closed so that its peer reconnects at once
        inbox.close();
        let conns: Vec<ConnId> = self.writers.keys().copied().collect();
        let closed = conns.len();
        for conn in conns {
            if let Some(writer) = self.writers.remove(&conn) {
                let _ = writer.try_send(ToWriter::Close(
                    1012,
                    rvbox_session::close_text(wire::CloseReason::ServiceRestart),
                ));
            }
            self.input(Input::Disconnected { conn });
        }
        self.submit();
        // store operations in flight finish, with a bounded wait
        let until = tokio::time::Instant::now() + SHUTDOWN_DRAIN;
        while self.core.pending_ops() > 0 {
            match tokio::time::timeout_at(until, completions.recv()).await {
                Ok(Some(d)) => {
                    self.completions(d);
                    // the core may answer a completion with more work of
                    // the closed sessions (their last rows)
                    self.writers.clear();
                    self.submit();
                }
                Ok(None) | Err(_) => break,
            }
        }
        let unfinished = self.core.pending_ops();
        // anything still queued in the inbox gets no answer: its senders
        // see their reply dropped (control calls answer UNAVAILABLE)
        while inbox.try_recv().is_ok() {}
        self.replies.clear();
        tracing::info!(closed, unfinished, "server core stopped");
        let _ = done.send(ShutdownReport { closed, unfinished });
    }

    fn stop_executor(&mut self) {
        if let Some(exec) = self.exec.take() {
            match exec.stop() {
                // the SQLite store checkpoints as it drops
                Ok(mut backend) => {
                    backend.close(Clock::wall_ms());
                    drop(backend);
                }
                Err(e) => tracing::error!(error = %e, "store executor"),
            }
        }
    }
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
