//! Fleet runs (docs/fleet.md): the operator's fleet mutations and the
//! release pump.
//!
//! A fleet run is a set of ordinary commands; the store creates a target's
//! command in the transaction that releases it, under the run's rate. The
//! core only asks: a `RunFleet` or fleet action is one store operation,
//! and while any run is live a [`StoreOp::FleetPump`] pass goes every
//! [`FLEET_PUMP_INTERVAL_MS`] (at once when the last pass stopped at its
//! bound). Each completion names the clients that got new commands (looked
//! at for dispatch, as after `RunCommand`) and the signals to send (as
//! after `SignalCommand`).

use rvbox_proto::v1::envelope::Payload;
use rvbox_store_port::fleet::{FleetAnswer, FleetOutcome};
use rvbox_store_port::ops::{Completion, OpResult, PortError, StoreOp};

use crate::{ControlAnswer, Output, RequestId, ServerCore};

/// A release pass runs this often while any fleet run is live.
pub const FLEET_PUMP_INTERVAL_MS: u64 = 250;
/// Most targets one release pass releases.
pub const FLEET_PUMP_LIMIT: usize = 2_048;

#[derive(Debug)]
pub(crate) enum Pending {
    /// An operator's `RunFleet` or fleet action.
    Mutation { request: RequestId },
    /// A release pass, issued at fleet epoch `epoch`.
    Pump { epoch: u64 },
}

/// The core's view of the fleet runs.
#[derive(Debug)]
pub(crate) struct FleetState {
    /// Some run may be live (true at start: the first pass finds out).
    pub(crate) live: bool,
    /// A release pass is in flight.
    pub(crate) pumping: bool,
    /// The last pass stopped at its bound: the next goes at once.
    pub(crate) more: bool,
    /// Monotonic time the last pass was issued.
    pub(crate) last_ms: Option<u64>,
    /// Counts fleet mutations answered: a pass issued before one of them
    /// cannot say that no run is live.
    pub(crate) epoch: u64,
}

impl Default for FleetState {
    fn default() -> Self {
        Self {
            live: true,
            pumping: false,
            more: false,
            last_ms: None,
            epoch: 0,
        }
    }
}

impl FleetState {
    /// When the next release pass is due, if one is.
    pub(crate) fn due_at(&self, now_ms: u64) -> Option<u64> {
        if !self.live || self.pumping {
            return None;
        }
        if self.more {
            return Some(now_ms);
        }
        Some(
            self.last_ms
                .map_or(now_ms, |t| t.saturating_add(FLEET_PUMP_INTERVAL_MS)),
        )
    }
}

impl ServerCore {
    /// Issues a release pass when one is due.
    pub(crate) fn fleet_timeout(&mut self) {
        let now = self.now_ms;
        if self.fleet.due_at(now).is_some_and(|t| t <= now) {
            self.fleet.last_ms = Some(now);
            self.fleet.more = false;
            let epoch = self.fleet.epoch;
            self.fleet.pumping = self.store(
                StoreOp::FleetPump {
                    limit: FLEET_PUMP_LIMIT,
                },
                crate::Pending::Fleet(Pending::Pump { epoch }),
            );
        }
    }

    pub(crate) fn fleet_done(&mut self, p: Pending, result: OpResult) {
        let outcome = match result {
            Ok(Completion::Fleet(o)) => Ok(*o),
            Ok(_) => {
                self.mismatch("fleet");
                Err(PortError::Unavailable(
                    "completion does not match the fleet operation".into(),
                ))
            }
            Err(e) => Err(e),
        };
        match p {
            Pending::Mutation { request } => {
                self.fleet.epoch += 1;
                let answer = outcome.map(|o| {
                    self.fleet_applied(&o, true);
                    Box::new(o.answer)
                });
                self.out.push_back(Output::Reply {
                    request,
                    answer: ControlAnswer::Fleet(answer),
                });
            }
            Pending::Pump { epoch } => {
                self.fleet.pumping = false;
                match outcome {
                    Ok(o) => {
                        self.stats.fleet_passes += 1;
                        let fresh = epoch == self.fleet.epoch;
                        self.fleet_applied(&o, fresh);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "fleet release pass failed; retried at the next interval");
                    }
                }
            }
        }
    }

    /// Looks at released clients for dispatch and sends the signals of a
    /// fleet operation. `fresh`: no fleet mutation was answered since the
    /// operation was issued, so its word on liveness stands.
    fn fleet_applied(&mut self, o: &FleetOutcome, fresh: bool) {
        if o.live || fresh {
            self.fleet.live = o.live;
        }
        if matches!(o.answer, FleetAnswer::Run(_) | FleetAnswer::Resume(_)) && !o.replayed {
            self.fleet.live = true;
        }
        self.fleet.more |= o.more;
        self.stats.fleet_released += o.released.len() as u64;
        for client in &o.released {
            if self.clients.get(client).is_some_and(|st| st.conn.is_some()) {
                self.mark_ready(client);
            }
        }
        for (client, frame) in &o.deliver {
            self.stats.signals += 1;
            let live = self
                .clients
                .get(client)
                .filter(|st| st.ready)
                .and_then(|st| st.conn);
            if let Some(conn) = live
                && !self.send(conn, Payload::Signal(frame.clone()))
            {
                tracing::warn!("fleet signal not queued; sent after the next reconciliation");
            }
        }
    }
}
