//! A connection's writer queue (plan §6.1): the core hands frames to it
//! without ever waiting (`try_send`), and the connection's writer task
//! awaits them.
//!
//! Made for the many idle connections a server holds: a tokio `mpsc`
//! channel allocates its shared state and a first block of 32 slots up
//! front (about 1.5 KiB per connection), while this queue is one small
//! shared cell whose buffer exists only while frames wait, and is freed
//! once they are taken.
//!
//! Must never: block the core (a full or closed queue is answered at
//! once), or lose the wakeup of a frame handed just before the writer
//! waits.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// Why a frame was not queued; it is handed back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TrySendError<T> {
    /// The queue holds its capacity already.
    Full(T),
    /// The writer ended.
    Closed(T),
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    sender_alive: bool,
    receiver_alive: bool,
}

#[derive(Debug)]
struct Shared<T> {
    state: Mutex<State<T>>,
    notify: Notify,
    capacity: usize,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // a panic while holding the lock leaves the queue consistent
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The core's end. Dropping it ends the writer once it took what waits.
#[derive(Debug)]
pub(crate) struct WriterTx<T>(Arc<Shared<T>>);

/// The writer's end. Dropping it discards what waits.
#[derive(Debug)]
pub(crate) struct WriterRx<T>(Arc<Shared<T>>);

/// A queue that holds at most `capacity` items.
pub(crate) fn writer_queue<T>(capacity: usize) -> (WriterTx<T>, WriterRx<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            sender_alive: true,
            receiver_alive: true,
        }),
        notify: Notify::new(),
        capacity,
    });
    (WriterTx(Arc::clone(&shared)), WriterRx(shared))
}

impl<T> WriterTx<T> {
    /// Queues `item` unless the queue is full or the writer ended.
    pub(crate) fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        {
            let mut st = self.0.lock();
            if !st.receiver_alive {
                return Err(TrySendError::Closed(item));
            }
            if st.items.len() >= self.0.capacity {
                return Err(TrySendError::Full(item));
            }
            st.items.push_back(item);
        }
        // stores a permit when the writer is not waiting yet
        self.0.notify.notify_one();
        Ok(())
    }
}

impl<T> Drop for WriterTx<T> {
    fn drop(&mut self) {
        self.0.lock().sender_alive = false;
        self.0.notify.notify_one();
    }
}

impl<T> WriterRx<T> {
    fn take(&self) -> Option<T> {
        let mut st = self.0.lock();
        let item = st.items.pop_front();
        if st.items.is_empty() && st.items.capacity() > 0 {
            st.items = VecDeque::new();
        }
        item
    }

    /// The next item; `None` once the core's end is gone and nothing is
    /// left. Cancel-safe: an item is taken only when it is returned.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        loop {
            if let Some(item) = self.take() {
                return Some(item);
            }
            if !self.0.lock().sender_alive {
                return None;
            }
            self.0.notify.notified().await;
        }
    }

    /// The next item if one waits.
    pub(crate) fn try_recv(&mut self) -> Option<T> {
        self.take()
    }
}

impl<T> Drop for WriterRx<T> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.receiver_alive = false;
        st.items = VecDeque::new();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn items_come_in_order_and_the_capacity_holds() {
        let (tx, mut rx) = writer_queue::<u32>(3);
        for i in 0..3 {
            tx.try_send(i).unwrap();
        }
        assert_eq!(tx.try_send(9), Err(TrySendError::Full(9)));
        assert_eq!(rx.recv().await, Some(0));
        assert_eq!(rx.try_recv(), Some(1));
        tx.try_send(3).unwrap();
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, Some(3));
        assert_eq!(rx.try_recv(), None);
        // drained: the buffer is gone
        assert_eq!(rx.0.lock().items.capacity(), 0);
    }

    #[tokio::test]
    async fn a_waiting_writer_wakes_for_each_item_and_ends_with_the_sender() {
        let (tx, mut rx) = writer_queue::<u32>(4);
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let writer = tokio::spawn(async move {
            while let Some(i) = rx.recv().await {
                let _ = seen_tx.send(i);
            }
        });
        let within = std::time::Duration::from_secs(5);
        for i in 1..=3 {
            // the writer is waiting by now: the item itself must wake it
            tokio::task::yield_now().await;
            tx.try_send(i).unwrap();
            let got = tokio::time::timeout(within, seen.recv()).await;
            assert_eq!(got.ok().flatten(), Some(i), "the writer woke for item {i}");
        }
        drop(tx);
        tokio::time::timeout(within, writer)
            .await
            .expect("the writer ends with the sender")
            .unwrap();
    }

    #[test]
    fn a_gone_writer_refuses_at_once() {
        let (tx, rx) = writer_queue::<u32>(4);
        tx.try_send(1).unwrap();
        drop(rx);
        assert_eq!(tx.try_send(2), Err(TrySendError::Closed(2)));
    }
}
