//! The executor on its own thread (architecture: "executor thread: owns
//! the Store; groups appends from all connections into one durable commit
//! per group; posts Completion(token) back to the inbox").
//!
//! The core's thread hands batches of operations over a bounded channel and
//! never waits for them; the executor thread takes everything queued at
//! once, performs it in order (each run of appends one durable group, see
//! [`Executor::perform_batch`]) and posts the completions back through the
//! caller's completion sink. So the thread that answers heartbeats never
//! waits on a disk, and appends that arrive while a group is being made
//! durable form the next group.

use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::thread::JoinHandle;

use rvbox_store::Store;
use rvbox_store_port::ops::{Backend, OpResult, OpToken, PortError, StoreOp};

use crate::Executor;

/// Batches the executor thread's queue holds before the core's sends wait
/// (the core's own bounds keep it far below: at most two append groups
/// and the operations of its bounded tables are in flight).
pub const EXECUTOR_QUEUE: usize = 4096;
/// Most operations one pass of the executor thread performs before it
/// posts their completions.
pub const MAX_OPS_PER_PASS: usize = 4096;

/// One batch of operations, in the order the core issued them.
pub type Batch = Vec<(OpToken, i64, StoreOp)>;

/// What one pass of the executor thread did, for metrics (plan §11.1:
/// store write latency and failures, the executor's queue depth).
#[derive(Debug, Clone, PartialEq)]
pub struct PassReport {
    /// How long the pass took: its operations, their transactions and
    /// their durable commits.
    pub elapsed: std::time::Duration,
    /// Operations performed.
    pub ops: usize,
    /// The operations answered `UNAVAILABLE` (a store failure, not a
    /// refusal), by their bounded name ([`StoreOp::name`]).
    pub failed: Vec<&'static str>,
    /// Operations still queued for the next passes.
    pub queued: usize,
}

/// Where completions go: the core's inbox.
pub trait CompletionSink: Send + 'static {
    /// Delivers the completions of one pass, in order. False when the
    /// inbox is gone (the thread then stops).
    fn deliver(&mut self, done: Vec<(OpToken, OpResult)>) -> bool;

    /// Sees what a pass did, before its completions are delivered.
    fn observe(&mut self, _pass: &PassReport) {}
}

impl CompletionSink for SyncSender<Vec<(OpToken, OpResult)>> {
    fn deliver(&mut self, done: Vec<(OpToken, OpResult)>) -> bool {
        self.send(done).is_ok()
    }
}

/// The executor thread, over any backend of the store port (the SQLite
/// [`Executor`] by default; the PostgreSQL store on replicas).
#[derive(Debug)]
pub struct ExecutorThread<B = Executor> {
    tx: SyncSender<Batch>,
    thread: JoinHandle<B>,
    /// Operations submitted and not yet performed.
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ExecutorThread<Executor> {
    /// Starts the thread over a recovered SQLite store.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn(store: Store, sink: impl CompletionSink) -> std::io::Result<Self> {
        Self::spawn_backend(Executor::new(store), sink)
    }
}

impl<B: Backend + Send + 'static> ExecutorThread<B> {
    /// Starts the thread over `backend`.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn_backend(backend: B, sink: impl CompletionSink) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(EXECUTOR_QUEUE);
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let depth = std::sync::Arc::clone(&queued);
        let thread = std::thread::Builder::new()
            .name("rvbox-store-executor".into())
            .spawn(move || run(backend, &rx, sink, &depth))?;
        Ok(Self { tx, thread, queued })
    }

    /// Hands a batch to the executor. Blocks only while its queue is full.
    ///
    /// # Errors
    /// The batch back when the thread has stopped.
    pub fn submit(&self, batch: Batch) -> Result<(), Batch> {
        let n = batch.len();
        self.queued
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        self.tx.send(batch).map_err(|e| {
            self.queued
                .fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
            e.0
        })
    }

    /// Stops taking work, performs what is queued, and returns the
    /// backend (the SQLite executor with its store).
    ///
    /// # Errors
    /// When the thread panicked.
    pub fn stop(self) -> Result<B, String> {
        drop(self.tx);
        self.thread
            .join()
            .map_err(|_| "the store executor thread panicked".to_owned())
    }
}

fn run<B: Backend>(
    mut exec: B,
    rx: &Receiver<Batch>,
    mut sink: impl CompletionSink,
    queued: &std::sync::atomic::AtomicUsize,
) -> B {
    while let Ok(first) = rx.recv() {
        let mut ops = first;
        // everything queued meanwhile joins this pass: appends arriving
        // while the previous group was being made durable share one commit
        while ops.len() < MAX_OPS_PER_PASS {
            match rx.try_recv() {
                Ok(more) => ops.extend(more),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        let names: Vec<&'static str> = ops.iter().map(|(_, _, op)| op.name()).collect();
        let n = ops.len();
        let started = std::time::Instant::now();
        let done = exec.perform_batch(ops);
        let elapsed = started.elapsed();
        let left = queued
            .fetch_sub(n, std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(n);
        let failed = done
            .iter()
            .zip(names)
            .filter(|((_, r), _)| matches!(r, Err(PortError::Unavailable(_))))
            .map(|(_, name)| name)
            .collect();
        sink.observe(&PassReport {
            elapsed,
            ops: n,
            failed,
            queued: left,
        });
        if !sink.deliver(done) {
            break;
        }
    }
    exec
}
