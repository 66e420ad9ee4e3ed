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
use rvbox_store::reader::ReadHandle;
use rvbox_store_port::ops::{OpResult, OpToken, StoreOp};

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

/// Where completions go: the core's inbox.
pub trait CompletionSink: Send + 'static {
    /// Delivers the completions of one pass, in order. False when the
    /// inbox is gone (the thread then stops).
    fn deliver(&mut self, done: Vec<(OpToken, OpResult)>) -> bool;
}

impl CompletionSink for SyncSender<Vec<(OpToken, OpResult)>> {
    fn deliver(&mut self, done: Vec<(OpToken, OpResult)>) -> bool {
        self.send(done).is_ok()
    }
}

/// The executor thread.
#[derive(Debug)]
pub struct ExecutorThread {
    tx: SyncSender<Batch>,
    thread: JoinHandle<Executor>,
    reads: ReadHandle,
}

impl ExecutorThread {
    /// Starts the thread over a recovered store.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn(store: Store, sink: impl CompletionSink) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(EXECUTOR_QUEUE);
        let reads = store.read_handle();
        let thread = std::thread::Builder::new()
            .name("rvbox-store-executor".into())
            .spawn(move || run(Executor::new(store), &rx, sink))?;
        Ok(Self { tx, thread, reads })
    }

    /// What opens read-only connections for control reads (`GetCommand`,
    /// `FollowCommand` history, `GetOutput`, incident lists): they are
    /// served beside the executor, never queued behind its writes.
    #[must_use]
    pub fn read_handle(&self) -> ReadHandle {
        self.reads.clone()
    }

    /// Hands a batch to the executor. Blocks only while its queue is full.
    ///
    /// # Errors
    /// The batch back when the thread has stopped.
    pub fn submit(&self, batch: Batch) -> Result<(), Batch> {
        self.tx.send(batch).map_err(|e| e.0)
    }

    /// Stops taking work, performs what is queued, and returns the
    /// executor (with its store).
    ///
    /// # Errors
    /// When the thread panicked.
    pub fn stop(self) -> Result<Executor, String> {
        drop(self.tx);
        self.thread
            .join()
            .map_err(|_| "the store executor thread panicked".to_owned())
    }
}

fn run(mut exec: Executor, rx: &Receiver<Batch>, mut sink: impl CompletionSink) -> Executor {
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
        let done = exec.perform_batch(ops);
        if !sink.deliver(done) {
            break;
        }
    }
    exec
}
