//! Fleet runs (docs/fleet.md): what a fleet operation answers and what the
//! core does next.

use rvbox_proto::v1 as wire;

/// The answer of a fleet mutation, for the caller.
#[derive(Debug, Clone, PartialEq)]
pub enum FleetAnswer {
    /// A release pass of the pump: no caller.
    None,
    /// `RunFleet`.
    Run(wire::RunFleetResponse),
    /// `SignalFleetRun`.
    Signal(wire::SignalFleetRunResponse),
    /// `CancelFleetRun`.
    Cancel(wire::CancelFleetRunResponse),
    /// `PauseFleetRun`.
    Pause(wire::PauseFleetRunResponse),
    /// `ResumeFleetRun`.
    Resume(wire::ResumeFleetRunResponse),
}

/// The outcome of a fleet operation.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetOutcome {
    /// The answer.
    pub answer: FleetAnswer,
    /// Clients that got a newly queued command (sorted, each once): the
    /// core looks at them for dispatch.
    pub released: Vec<String>,
    /// Signals to send now, with the client each goes to.
    pub deliver: Vec<(String, wire::Signal)>,
    /// Some run is not done: the core keeps pumping.
    pub live: bool,
    /// A release stopped at its batch bound: pump again at once.
    pub more: bool,
    /// True when this was a replay of an earlier request.
    pub replayed: bool,
}

impl FleetOutcome {
    /// An outcome with only an answer.
    #[must_use]
    pub fn answer(answer: FleetAnswer) -> Self {
        Self {
            answer,
            released: Vec::new(),
            deliver: Vec::new(),
            live: true,
            more: false,
            replayed: false,
        }
    }
}

/// A fleet mutation other than `RunFleet`.
#[derive(Debug, Clone, PartialEq)]
pub enum FleetAction {
    /// `SignalFleetRun`.
    Signal(wire::SignalFleetRunRequest),
    /// `CancelFleetRun`.
    Cancel(wire::CancelFleetRunRequest),
    /// `PauseFleetRun`.
    Pause(wire::PauseFleetRunRequest),
    /// `ResumeFleetRun`.
    Resume(wire::ResumeFleetRunRequest),
}

impl FleetAction {
    /// The RPC method name (audit, idempotency).
    #[must_use]
    pub fn method(&self) -> &'static str {
        match self {
            Self::Signal(_) => "SignalFleetRun",
            Self::Cancel(_) => "CancelFleetRun",
            Self::Pause(_) => "PauseFleetRun",
            Self::Resume(_) => "ResumeFleetRun",
        }
    }

    /// The request id and the run it names, as sent.
    #[must_use]
    pub fn ids(&self) -> (&str, &str) {
        match self {
            Self::Signal(r) => (&r.request_id, &r.fleet_run_id),
            Self::Cancel(r) => (&r.request_id, &r.fleet_run_id),
            Self::Pause(r) => (&r.request_id, &r.fleet_run_id),
            Self::Resume(r) => (&r.request_id, &r.fleet_run_id),
        }
    }
}
