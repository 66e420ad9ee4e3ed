//! Group commit across concurrent writers (plan §5.3: "The writer
//! serializes appends per active segment but group-commits independent
//! commands together. A group-commit timer is a maximum batching delay,
//! never permission to acknowledge before file sync.").
//!
//! One thread owns the [`Store`]. Writers hand it event batches through a
//! bounded channel and block until their events are durable; the thread
//! gathers everything that arrives within `max_delay` of the first request
//! (up to `max_batch` events) and makes it durable with one
//! [`Store::append_events`] call: one fsync per touched segment and one
//! metadata transaction for the whole group.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::events::{AppendReport, EventAppend};
use crate::store::Store;

/// Why a grouped append did not complete.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GroupError {
    /// The store failed; none of the group's events are durable.
    #[error("store failure, nothing acknowledged: {0}")]
    Store(String),
    /// The committer has stopped.
    #[error("the group committer has stopped")]
    Stopped,
}

/// A group stops waiting for more writers after this long without one.
const IDLE_GAP: Duration = Duration::from_micros(200);
/// Once a group has as many requests as the previous one, it ends after
/// this long without another.
const TAIL_GAP: Duration = Duration::from_micros(20);

/// Where a group's outcome for one request goes.
enum Reply {
    /// A blocked writer's own channel.
    Direct(SyncSender<Result<AppendReport, GroupError>>),
    /// A shared channel of a driver multiplexing many writers, with the
    /// writer's tag.
    Tagged(u64, SyncSender<(u64, Result<AppendReport, GroupError>)>),
}

impl Reply {
    fn send(&self, r: Result<AppendReport, GroupError>) {
        // a writer that went away no longer needs its answer
        let _ = match self {
            Self::Direct(tx) => tx.send(r).map_err(|_| ()),
            Self::Tagged(tag, tx) => tx.send((*tag, r)).map_err(|_| ()),
        };
    }
}

struct Request {
    events: Vec<EventAppend>,
    reply: Reply,
}

/// How the committer batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupOptions {
    /// Most events in one group.
    pub max_batch: usize,
    /// Longest the first request of a group waits for company.
    pub max_delay: Duration,
    /// Requests that may wait in the queue (writers block beyond it).
    pub queue: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            max_batch: usize::try_from(rvbox_domain::limits::DEFAULT_GROUP_COMMIT_MAX_BATCH)
                .unwrap_or(256),
            max_delay: Duration::from_millis(
                rvbox_domain::limits::DEFAULT_GROUP_COMMIT_MAX_DELAY_MS,
            ),
            queue: 1024,
        }
    }
}

/// A writer's handle: cheap to clone, one per writer thread.
#[derive(Clone, Debug)]
pub struct CommitHandle {
    tx: SyncSender<Request>,
}

impl CommitHandle {
    /// Appends `events` and returns once they are durable (or refused).
    ///
    /// # Errors
    /// [`GroupError`] when the group failed or the committer stopped.
    pub fn append(&self, events: Vec<EventAppend>) -> Result<AppendReport, GroupError> {
        let (reply, wait) = mpsc::sync_channel(1);
        self.tx
            .send(Request {
                events,
                reply: Reply::Direct(reply),
            })
            .map_err(|_| GroupError::Stopped)?;
        wait.recv().map_err(|_| GroupError::Stopped)?
    }

    /// Queues `events` without waiting; the outcome arrives on `replies`
    /// tagged with `tag`. One driver can keep many writers' appends in
    /// flight this way (as an async runtime's tasks would), each writer
    /// still waiting for its own acknowledgement before sending more.
    ///
    /// # Errors
    /// [`GroupError::Stopped`] when the committer has stopped.
    pub fn submit(
        &self,
        events: Vec<EventAppend>,
        tag: u64,
        replies: &SyncSender<(u64, Result<AppendReport, GroupError>)>,
    ) -> Result<(), GroupError> {
        self.tx
            .send(Request {
                events,
                reply: Reply::Tagged(tag, replies.clone()),
            })
            .map_err(|_| GroupError::Stopped)
    }
}

/// The committer thread.
#[derive(Debug)]
pub struct GroupCommitter {
    handle: CommitHandle,
    thread: JoinHandle<Store>,
}

impl GroupCommitter {
    /// Starts the committer thread, which owns `store` until
    /// [`GroupCommitter::stop`]. `now_ms` supplies the receipt time.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn(store: Store, opts: GroupOptions, now_ms: fn() -> i64) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(opts.queue.max(1));
        let thread = std::thread::Builder::new()
            .name("rvbox-group-commit".into())
            .spawn(move || run(store, &rx, opts, now_ms))?;
        Ok(Self {
            handle: CommitHandle { tx },
            thread,
        })
    }

    /// A handle for one writer.
    #[must_use]
    pub fn handle(&self) -> CommitHandle {
        self.handle.clone()
    }

    /// Stops accepting work once every handle is dropped, finishes what is
    /// queued, and returns the store.
    ///
    /// # Errors
    /// When the committer thread panicked.
    pub fn stop(self) -> Result<Store, GroupError> {
        drop(self.handle);
        self.thread.join().map_err(|_| GroupError::Stopped)
    }
}

fn run(mut store: Store, rx: &Receiver<Request>, opts: GroupOptions, now_ms: fn() -> i64) -> Store {
    // requests in the previous group: the writers that will most likely
    // come back for the next one
    let mut expected = 0usize;
    while let Ok(first) = rx.recv() {
        let deadline = Instant::now() + opts.max_delay;
        let mut group = vec![first];
        let mut count = group.first().map_or(0, |r| r.events.len());
        // Gather until the group is full, the batching delay is spent, or
        // writers stop arriving (none within IDLE_GAP): a lone writer never
        // waits out the whole delay. Once as many requests as last time
        // are in, a much shorter gap ends the group: waiting out the idle
        // gap for a writer that is not coming would delay every one, while
        // writers still arriving back to back keep joining.
        while count < opts.max_batch {
            let gap = if expected > 0 && group.len() >= expected {
                TAIL_GAP
            } else {
                IDLE_GAP
            };
            let left = deadline.saturating_duration_since(Instant::now()).min(gap);
            match rx.recv_timeout(left) {
                Ok(r) => {
                    count += r.events.len();
                    group.push(r);
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
        expected = group.len();
        let all: Vec<EventAppend> = group
            .iter()
            .flat_map(|r| r.events.iter().cloned())
            .collect();
        match store.append_events(&all, now_ms()) {
            Ok(report) => {
                let mut outcomes = report.outcomes.into_iter();
                for r in group {
                    let mine: Vec<_> = outcomes.by_ref().take(r.events.len()).collect();
                    let acked = r
                        .events
                        .iter()
                        .filter_map(|e| report.acked.get(&e.issue_uuid).map(|s| (e.issue_uuid, *s)))
                        .collect();
                    r.reply.send(Ok(AppendReport {
                        outcomes: mine,
                        acked,
                    }));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, events = all.len(), "group commit failed; nothing acknowledged");
                let msg = e.to_string();
                for r in group {
                    r.reply.send(Err(GroupError::Store(msg.clone())));
                }
            }
        }
    }
    store
}
