//! One `FollowFleetRun` stream: the run's record, then every target whose
//! latest change is after the cursor (in change order, each in its latest
//! state), then live changes as the store commits them, with a fresh record
//! whenever the run's state or counters moved, until the record shows the
//! run done and every change up to it was sent.
//!
//! Must never: act on the run (a stream that stops only stops reading).

use std::sync::Arc;

use rvbox_proto::v1 as wire;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::control::{FOLLOW_BATCH, FOLLOW_POLL, Readers};

/// A follower of one run.
pub(crate) struct FleetFollower {
    pub(crate) readers: Arc<Readers>,
    pub(crate) changes: watch::Receiver<u64>,
    /// The server is stopping: the stream ends with `UNAVAILABLE`, and the
    /// follower resumes from its cursor on the next server.
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) run: String,
    pub(crate) cursor: u64,
    pub(crate) tx: mpsc::Sender<Result<wire::FollowFleetRunResponse, Status>>,
}

fn run_item(r: &wire::FleetRunRecord) -> wire::FollowFleetRunResponse {
    wire::FollowFleetRunResponse {
        item: Some(wire::follow_fleet_run_response::Item::Run(r.clone())),
    }
}

fn target_item(t: wire::FleetTarget) -> wire::FollowFleetRunResponse {
    wire::FollowFleetRunResponse {
        item: Some(wire::follow_fleet_run_response::Item::Target(t)),
    }
}

/// What of a record a follower is told again when it moves.
fn shown_of(r: &wire::FleetRunRecord) -> (i32, i32, Option<wire::FleetCounts>, u32) {
    (r.state, r.stop_reason, r.counts, r.targets)
}

impl FleetFollower {
    async fn send(&self, item: Result<wire::FollowFleetRunResponse, Status>) -> bool {
        self.tx.send(item).await.is_ok()
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    async fn restarting(&self) {
        let _ = self
            .send(Err(crate::control::status(
                &rvbox_domain::error::DomainError::new(
                    rvbox_domain::error::Code::Unavailable,
                    "rvbox-server is restarting; follow again from the last change received",
                ),
            )))
            .await;
    }

    pub(crate) async fn run(mut self, first: wire::FleetRunRecord) {
        let mut shown = shown_of(&first);
        if !self.send(Ok(run_item(&first))).await {
            return;
        }
        loop {
            if self.stopping() {
                self.restarting().await;
                return;
            }
            // note the change counter before reading, so a commit between
            // the read and the wait wakes the wait
            let _ = self.changes.borrow_and_update();
            let (run, after) = (self.run.clone(), self.cursor);
            let batch = self
                .readers
                .read(move |r| r.fleet_changes(&run, after, FOLLOW_BATCH))
                .await;
            let (record, targets) = match batch {
                Ok(b) => b,
                Err(status) => {
                    let _ = self.send(Err(status)).await;
                    return;
                }
            };
            let full = targets.len() >= FOLLOW_BATCH;
            for t in targets {
                self.cursor = self.cursor.max(t.change_seq);
                if self.stopping() {
                    self.restarting().await;
                    return;
                }
                if !self.send(Ok(target_item(t))).await {
                    return;
                }
            }
            if full {
                continue;
            }
            // every change up to the record's was read in this snapshot
            self.cursor = self.cursor.max(record.change_seq);
            if shown_of(&record) != shown {
                shown = shown_of(&record);
                if !self.send(Ok(run_item(&record))).await {
                    return;
                }
            }
            if record.state == wire::FleetRunState::Done as i32 {
                return;
            }
            let mut stopping = false;
            tokio::select! {
                _ = self.changes.changed() => {}
                () = tokio::time::sleep(FOLLOW_POLL) => {}
                () = self.tx.closed() => return,
                _ = self.stop.wait_for(|s| *s) => stopping = true,
            }
            if stopping {
                self.restarting().await;
                return;
            }
        }
    }
}
