//! The command lifecycle (plan §4.2) and revisioned transitions.
//!
//! [`Lifecycle`] is the public value every peer and `rvc` shows. [`Phase`]
//! adds the two durable internal launch phases, `launch_prepared` and
//! `launch_authorized`, that never appear on the wire: both render as
//! `accepted`. The transition table lives in [`Phase::edge`]; the public
//! table is its projection, so the two can never disagree.

use std::fmt;

use thiserror::Error;

/// The public lifecycle of a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lifecycle {
    /// Durable on the server, waiting for client capacity.
    Queued,
    /// Sent to the client; acceptance not yet confirmed.
    Dispatched,
    /// The client durably accepted it; not running yet.
    Accepted,
    /// The requested shell was created (`exec` reported by the launcher).
    Running,
    /// Ran and exited 0.
    Succeeded,
    /// Ran and exited non-zero, or died of a signal not sent through RVBox.
    Failed,
    /// Ended by a signal sent through RVBox (kill, cancel, shutdown).
    Terminated,
    /// Outcome uncertain (crash, lost state, recovery invariant failure).
    Interrupted,
    /// Never dispatched before its queue TTL ran out.
    Expired,
    /// Permanently refused before launch.
    Rejected,
    /// Cancelled before launch was authorized.
    Cancelled,
}

impl Lifecycle {
    /// Every public value, in wire order.
    pub const ALL: [Self; 11] = [
        Self::Queued,
        Self::Dispatched,
        Self::Accepted,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Terminated,
        Self::Interrupted,
        Self::Expired,
        Self::Rejected,
        Self::Cancelled,
    ];

    /// True for the seven terminal values; no edge leaves them.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded
                | Self::Failed
                | Self::Terminated
                | Self::Interrupted
                | Self::Expired
                | Self::Rejected
                | Self::Cancelled
        )
    }

    /// Stable lower-case name used in logs, metrics labels and `rvc`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Dispatched => "dispatched",
            Self::Accepted => "accepted",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Terminated => "terminated",
            Self::Interrupted => "interrupted",
            Self::Expired => "expired",
            Self::Rejected => "rejected",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether a peer may move a command from `self` to `to` as seen on the
    /// wire. Internal launch phases are invisible, so `accepted -> running`
    /// is one public edge.
    ///
    /// # Errors
    /// [`TransitionError::Illegal`] (or `FromTerminal`) naming both ends.
    pub fn check_transition(self, to: Self) -> Result<(), TransitionError> {
        let legal = Phase::ALL.iter().any(|a| {
            a.lifecycle() == self
                && Phase::ALL
                    .iter()
                    .any(|b| b.lifecycle() == to && a.edge(*b).is_some() && self != to)
        });
        if legal {
            Ok(())
        } else if self.is_terminal() {
            Err(TransitionError::FromTerminal {
                from: self.as_str(),
                to: to.as_str(),
            })
        } else {
            Err(TransitionError::Illegal {
                from: self.as_str(),
                to: to.as_str(),
            })
        }
    }

    /// The wire enum value (`rvbox.v1.Lifecycle`).
    #[must_use]
    pub fn to_wire(self) -> rvbox_proto::v1::Lifecycle {
        use rvbox_proto::v1::Lifecycle as W;
        match self {
            Self::Queued => W::Queued,
            Self::Dispatched => W::Dispatched,
            Self::Accepted => W::Accepted,
            Self::Running => W::Running,
            Self::Succeeded => W::Succeeded,
            Self::Failed => W::Failed,
            Self::Terminated => W::Terminated,
            Self::Interrupted => W::Interrupted,
            Self::Expired => W::Expired,
            Self::Rejected => W::Rejected,
            Self::Cancelled => W::Cancelled,
        }
    }

    /// Reads the wire enum value; `UNSPECIFIED` and unknown numbers are refused.
    ///
    /// # Errors
    /// [`TransitionError::UnknownLifecycle`] with the raw number.
    pub fn from_wire(raw: i32) -> Result<Self, TransitionError> {
        use rvbox_proto::v1::Lifecycle as W;
        match W::try_from(raw) {
            Ok(W::Queued) => Ok(Self::Queued),
            Ok(W::Dispatched) => Ok(Self::Dispatched),
            Ok(W::Accepted) => Ok(Self::Accepted),
            Ok(W::Running) => Ok(Self::Running),
            Ok(W::Succeeded) => Ok(Self::Succeeded),
            Ok(W::Failed) => Ok(Self::Failed),
            Ok(W::Terminated) => Ok(Self::Terminated),
            Ok(W::Interrupted) => Ok(Self::Interrupted),
            Ok(W::Expired) => Ok(Self::Expired),
            Ok(W::Rejected) => Ok(Self::Rejected),
            Ok(W::Cancelled) => Ok(Self::Cancelled),
            Ok(W::Unspecified) | Err(_) => Err(TransitionError::UnknownLifecycle(raw)),
        }
    }
}

impl fmt::Display for Lifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lifecycle value plus the client's two durable internal launch phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// See [`Lifecycle::Queued`].
    Queued,
    /// See [`Lifecycle::Dispatched`].
    Dispatched,
    /// See [`Lifecycle::Accepted`].
    Accepted,
    /// The blocked launcher is ready and its identity is durable; no user
    /// code has run. Renders as `accepted`.
    LaunchPrepared,
    /// The release is durably authorized; user code may run from here on,
    /// so this UUID is never dispatched or launched again. Renders as
    /// `accepted`.
    LaunchAuthorized,
    /// See [`Lifecycle::Running`].
    Running,
    /// See [`Lifecycle::Succeeded`].
    Succeeded,
    /// See [`Lifecycle::Failed`].
    Failed,
    /// See [`Lifecycle::Terminated`].
    Terminated,
    /// See [`Lifecycle::Interrupted`].
    Interrupted,
    /// See [`Lifecycle::Expired`].
    Expired,
    /// See [`Lifecycle::Rejected`].
    Rejected,
    /// See [`Lifecycle::Cancelled`].
    Cancelled,
}

/// Why an edge exists: one reason per legal transition (plan §4.2, §7.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    /// queued -> dispatched: the dispatcher sent it to a live session.
    Dispatch,
    /// queued -> expired: the queue TTL ran out before any dispatch.
    Expire,
    /// dispatched -> accepted: a positive `CommandAccepted`.
    Accept,
    /// dispatched -> queued: a transient negative acceptance (backoff), or a
    /// reconciliation that found it absent from a healthy snapshot.
    Requeue,
    /// dispatched|accepted|launch_prepared -> rejected: a permanent failure
    /// before launch authorization.
    Reject,
    /// queued|dispatched|accepted|launch_prepared -> cancelled: a cancel won
    /// the race against launch authorization.
    Cancel,
    /// dispatched|accepted|launch_prepared|launch_authorized|running ->
    /// interrupted: an invariant failed or the outcome is uncertain; also
    /// queued -> interrupted when reconciliation finds the client's matching
    /// tombstone (plan §6.4: a stale server must not run it again).
    Interrupt,
    /// accepted -> launch_prepared: the blocked launcher's identity is durable.
    Prepare,
    /// launch_prepared -> accepted: the unreleased launcher died (verified);
    /// preparation may be retried because no user code ran.
    RetryPrepare,
    /// launch_prepared -> launch_authorized: release durably authorized.
    Authorize,
    /// launch_authorized -> running: the launcher reported the shell exec.
    Exec,
    /// running -> succeeded|failed|terminated: the process tree ended.
    Exit,
}

impl Phase {
    /// Every phase, for exhaustive tables.
    pub const ALL: [Self; 13] = [
        Self::Queued,
        Self::Dispatched,
        Self::Accepted,
        Self::LaunchPrepared,
        Self::LaunchAuthorized,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Terminated,
        Self::Interrupted,
        Self::Expired,
        Self::Rejected,
        Self::Cancelled,
    ];

    /// The public value of this phase.
    #[must_use]
    pub fn lifecycle(self) -> Lifecycle {
        match self {
            Self::Queued => Lifecycle::Queued,
            Self::Dispatched => Lifecycle::Dispatched,
            Self::Accepted | Self::LaunchPrepared | Self::LaunchAuthorized => Lifecycle::Accepted,
            Self::Running => Lifecycle::Running,
            Self::Succeeded => Lifecycle::Succeeded,
            Self::Failed => Lifecycle::Failed,
            Self::Terminated => Lifecycle::Terminated,
            Self::Interrupted => Lifecycle::Interrupted,
            Self::Expired => Lifecycle::Expired,
            Self::Rejected => Lifecycle::Rejected,
            Self::Cancelled => Lifecycle::Cancelled,
        }
    }

    /// True when no edge leaves this phase.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        self.lifecycle().is_terminal()
    }

    /// True from `launch_authorized` on: user code may have run, so no
    /// recovery path may dispatch or launch this UUID again; an uncertain
    /// outcome becomes `interrupted` (plan §4.2).
    #[must_use]
    pub fn launch_may_have_happened(self) -> bool {
        matches!(
            self,
            Self::LaunchAuthorized
                | Self::Running
                | Self::Succeeded
                | Self::Failed
                | Self::Terminated
                | Self::Interrupted
        )
    }

    /// Stable lower-case name (internal phases included).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LaunchPrepared => "launch_prepared",
            Self::LaunchAuthorized => "launch_authorized",
            other => other.lifecycle().as_str(),
        }
    }

    /// The transition table: the reason `self -> to` is legal, or `None`.
    #[must_use]
    pub fn edge(self, to: Self) -> Option<Edge> {
        use Phase as P;
        let edge = match (self, to) {
            (P::Queued, P::Dispatched) => Edge::Dispatch,
            (P::Queued, P::Expired) => Edge::Expire,
            (P::Dispatched, P::Accepted) => Edge::Accept,
            (P::Dispatched, P::Queued) => Edge::Requeue,
            (P::Dispatched | P::Accepted | P::LaunchPrepared, P::Rejected) => Edge::Reject,
            (P::Queued | P::Dispatched | P::Accepted | P::LaunchPrepared, P::Cancelled) => {
                Edge::Cancel
            }
            // plan §6.4: a queued command too, when reconciliation finds the
            // client's matching tombstone (a stale server: it already ran)
            (
                P::Queued
                | P::Dispatched
                | P::Accepted
                | P::LaunchPrepared
                | P::LaunchAuthorized
                | P::Running,
                P::Interrupted,
            ) => Edge::Interrupt,
            (P::Accepted, P::LaunchPrepared) => Edge::Prepare,
            (P::LaunchPrepared, P::Accepted) => Edge::RetryPrepare,
            (P::LaunchPrepared, P::LaunchAuthorized) => Edge::Authorize,
            (P::LaunchAuthorized, P::Running) => Edge::Exec,
            (P::Running, P::Succeeded | P::Failed | P::Terminated) => Edge::Exit,
            _ => return None,
        };
        Some(edge)
    }

    /// Checks `self -> to` against the table.
    ///
    /// # Errors
    /// [`TransitionError`] naming both phases.
    pub fn check_transition(self, to: Self) -> Result<Edge, TransitionError> {
        match self.edge(to) {
            Some(edge) => Ok(edge),
            None if self.is_terminal() => Err(TransitionError::FromTerminal {
                from: self.as_str(),
                to: to.as_str(),
            }),
            None => Err(TransitionError::Illegal {
                from: self.as_str(),
                to: to.as_str(),
            }),
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused transition or revision.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransitionError {
    /// The edge is not in the table.
    #[error("illegal lifecycle transition {from} -> {to}")]
    Illegal {
        /// Phase name.
        from: &'static str,
        /// Phase name.
        to: &'static str,
    },
    /// The command is already terminal; terminal states never change.
    #[error("command is already {from}; a terminal lifecycle never changes (asked for {to})")]
    FromTerminal {
        /// Terminal phase name.
        from: &'static str,
        /// Requested phase name.
        to: &'static str,
    },
    /// The caller acted on an older revision than the current one.
    #[error("stale revision {expected}: the command is at revision {current}")]
    StaleRevision {
        /// Revision the caller based its decision on.
        expected: u64,
        /// Current revision.
        current: u64,
    },
    /// An incoming revision is older than the one already recorded.
    #[error("revision {incoming} is older than the recorded revision {current}")]
    RevisionWentBack {
        /// Revision offered.
        incoming: u64,
        /// Current revision.
        current: u64,
    },
    /// The revision counter would overflow.
    #[error("revision counter exhausted")]
    RevisionExhausted,
    /// A wire lifecycle value that is unspecified or unknown.
    #[error("lifecycle value {0} is unspecified or unknown")]
    UnknownLifecycle(i32),
}

/// A command revision: a per-command counter that only grows. Every signal
/// or cancel takes the next revision; launch authorization is a
/// compare-and-transition against the revision the launcher was prepared
/// under, so a cancel that raced it is never lost (plan §6.4, §7.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub u64);

impl Revision {
    /// The revision a command is created with.
    pub const INITIAL: Self = Self(1);

    /// The next revision.
    ///
    /// # Errors
    /// [`TransitionError::RevisionExhausted`] on overflow.
    pub fn next(self) -> Result<Self, TransitionError> {
        self.0
            .checked_add(1)
            .map(Self)
            .ok_or(TransitionError::RevisionExhausted)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How an incoming revisioned message relates to the recorded revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevisionOrder {
    /// Higher than recorded: adopt it.
    Newer,
    /// Equal: an exact repeat, harmless if its content is identical.
    Same,
}

/// What a cancel (a revisioned signal sent before or during launch) does in
/// the current phase (plan §6.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelResolution {
    /// Launch was not authorized: the command becomes `cancelled`.
    Cancel,
    /// Launch was authorized: deliver the signal to the process tree and
    /// keep the actual outcome.
    DeliverSignal,
    /// Already terminal: nothing to do; report the terminal value.
    AlreadyTerminal(Lifecycle),
}

/// The lifecycle phase of one command together with its revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandState {
    phase: Phase,
    revision: Revision,
}

impl CommandState {
    /// A freshly created command: queued at the initial revision.
    #[must_use]
    pub fn queued() -> Self {
        Self {
            phase: Phase::Queued,
            revision: Revision::INITIAL,
        }
    }

    /// Rebuilds a state from stored values.
    #[must_use]
    pub fn from_parts(phase: Phase, revision: Revision) -> Self {
        Self { phase, revision }
    }

    /// Current phase.
    #[must_use]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Current public lifecycle.
    #[must_use]
    pub fn lifecycle(&self) -> Lifecycle {
        self.phase.lifecycle()
    }

    /// Current revision.
    #[must_use]
    pub fn revision(&self) -> Revision {
        self.revision
    }

    /// Moves to `to` only if the revision is still `expected`: the check
    /// that makes a prepare/authorize decision lose to a concurrent cancel.
    ///
    /// # Errors
    /// `StaleRevision` when the revision moved; `Illegal`/`FromTerminal`
    /// when the edge is not in the table. Nothing changes on error.
    pub fn compare_and_transition(
        &mut self,
        expected: Revision,
        to: Phase,
    ) -> Result<Edge, TransitionError> {
        if self.revision != expected {
            return Err(TransitionError::StaleRevision {
                expected: expected.0,
                current: self.revision.0,
            });
        }
        let edge = self.phase.check_transition(to)?;
        self.phase = to;
        Ok(edge)
    }

    /// Takes the next revision for a signal or cancel. Terminal commands
    /// take no new revisions.
    ///
    /// # Errors
    /// `FromTerminal` when terminal; `RevisionExhausted` on overflow.
    pub fn bump_revision(&mut self) -> Result<Revision, TransitionError> {
        if self.phase.is_terminal() {
            return Err(TransitionError::FromTerminal {
                from: self.phase.as_str(),
                to: "a new revision",
            });
        }
        self.revision = self.revision.next()?;
        Ok(self.revision)
    }

    /// Records a revision carried by a peer's message. Revisions only grow:
    /// an older one is refused, an equal one is a repeat.
    ///
    /// # Errors
    /// `RevisionWentBack` when `incoming` is older than recorded.
    pub fn observe_revision(
        &mut self,
        incoming: Revision,
    ) -> Result<RevisionOrder, TransitionError> {
        match incoming.cmp(&self.revision) {
            std::cmp::Ordering::Less => Err(TransitionError::RevisionWentBack {
                incoming: incoming.0,
                current: self.revision.0,
            }),
            std::cmp::Ordering::Equal => Ok(RevisionOrder::Same),
            std::cmp::Ordering::Greater => {
                self.revision = incoming;
                Ok(RevisionOrder::Newer)
            }
        }
    }

    /// Resolves a cancel against the launch race: before authorization the
    /// command is cancelled; from authorization on the signal is delivered.
    #[must_use]
    pub fn resolve_cancel(&self) -> CancelResolution {
        match self.phase {
            Phase::Queued | Phase::Dispatched | Phase::Accepted | Phase::LaunchPrepared => {
                CancelResolution::Cancel
            }
            Phase::LaunchAuthorized | Phase::Running => CancelResolution::DeliverSignal,
            terminal => CancelResolution::AlreadyTerminal(terminal.lifecycle()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Phase as P;

    /// The legal edges, written out independently of `Phase::edge`.
    const LEGAL: &[(Phase, Phase)] = &[
        (P::Queued, P::Dispatched),
        (P::Queued, P::Expired),
        (P::Queued, P::Cancelled),
        (P::Queued, P::Interrupted),
        (P::Dispatched, P::Accepted),
        (P::Dispatched, P::Queued),
        (P::Dispatched, P::Rejected),
        (P::Dispatched, P::Cancelled),
        (P::Dispatched, P::Interrupted),
        (P::Accepted, P::LaunchPrepared),
        (P::Accepted, P::Rejected),
        (P::Accepted, P::Cancelled),
        (P::Accepted, P::Interrupted),
        (P::LaunchPrepared, P::LaunchAuthorized),
        (P::LaunchPrepared, P::Accepted),
        (P::LaunchPrepared, P::Rejected),
        (P::LaunchPrepared, P::Cancelled),
        (P::LaunchPrepared, P::Interrupted),
        (P::LaunchAuthorized, P::Running),
        (P::LaunchAuthorized, P::Interrupted),
        (P::Running, P::Succeeded),
        (P::Running, P::Failed),
        (P::Running, P::Terminated),
        (P::Running, P::Interrupted),
    ];

    #[test]
    fn every_phase_pair_matches_the_table() {
        let mut legal_seen = 0;
        for from in Phase::ALL {
            for to in Phase::ALL {
                let expected = LEGAL.contains(&(from, to));
                let got = from.check_transition(to);
                assert_eq!(got.is_ok(), expected, "{from} -> {to}");
                if expected {
                    legal_seen += 1;
                } else if from.is_terminal() {
                    assert!(matches!(got, Err(TransitionError::FromTerminal { .. })));
                } else {
                    assert!(matches!(got, Err(TransitionError::Illegal { .. })));
                }
            }
        }
        assert_eq!(legal_seen, LEGAL.len());
    }

    /// The public edges of plan §4.2, written out.
    const PUBLIC_LEGAL: &[(Lifecycle, Lifecycle)] = {
        use Lifecycle as L;
        &[
            (L::Queued, L::Dispatched),
            (L::Queued, L::Expired),
            (L::Queued, L::Cancelled),
            (L::Queued, L::Interrupted),
            (L::Dispatched, L::Accepted),
            (L::Dispatched, L::Queued),
            (L::Dispatched, L::Rejected),
            (L::Dispatched, L::Cancelled),
            (L::Dispatched, L::Interrupted),
            (L::Accepted, L::Running),
            (L::Accepted, L::Rejected),
            (L::Accepted, L::Cancelled),
            (L::Accepted, L::Interrupted),
            (L::Running, L::Succeeded),
            (L::Running, L::Failed),
            (L::Running, L::Terminated),
            (L::Running, L::Interrupted),
        ]
    };

    #[test]
    fn every_public_pair_matches_the_plan() {
        for from in Lifecycle::ALL {
            for to in Lifecycle::ALL {
                let expected = PUBLIC_LEGAL.contains(&(from, to));
                assert_eq!(
                    from.check_transition(to).is_ok(),
                    expected,
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn terminal_predicate() {
        let terminal: Vec<_> = Lifecycle::ALL
            .into_iter()
            .filter(|l| l.is_terminal())
            .collect();
        assert_eq!(
            terminal,
            vec![
                Lifecycle::Succeeded,
                Lifecycle::Failed,
                Lifecycle::Terminated,
                Lifecycle::Interrupted,
                Lifecycle::Expired,
                Lifecycle::Rejected,
                Lifecycle::Cancelled
            ]
        );
        for p in Phase::ALL {
            if p.is_terminal() {
                assert!(Phase::ALL.iter().all(|to| p.edge(*to).is_none()));
            }
        }
    }

    #[test]
    fn internal_phases_render_as_accepted_and_never_reach_the_wire() {
        assert_eq!(P::LaunchPrepared.lifecycle(), Lifecycle::Accepted);
        assert_eq!(P::LaunchAuthorized.lifecycle(), Lifecycle::Accepted);
        for l in Lifecycle::ALL {
            assert_eq!(Lifecycle::from_wire(l.to_wire() as i32), Ok(l));
        }
        assert_eq!(
            Lifecycle::from_wire(0),
            Err(TransitionError::UnknownLifecycle(0))
        );
        assert_eq!(
            Lifecycle::from_wire(99),
            Err(TransitionError::UnknownLifecycle(99))
        );
    }

    #[test]
    fn no_path_back_to_dispatch_after_authorization() {
        // From launch_authorized on, every reachable phase keeps
        // `launch_may_have_happened`, so nothing can requeue or redispatch.
        let mut frontier = vec![P::LaunchAuthorized];
        let mut seen = Vec::new();
        while let Some(p) = frontier.pop() {
            if seen.contains(&p) {
                continue;
            }
            seen.push(p);
            assert!(p.launch_may_have_happened(), "{p}");
            for to in Phase::ALL {
                if p.edge(to).is_some() {
                    frontier.push(to);
                }
            }
        }
        assert!(!seen.contains(&P::Queued));
        assert!(!seen.contains(&P::Dispatched));
        assert!(!seen.contains(&P::Cancelled));
    }

    #[test]
    fn compare_and_transition_loses_to_a_racing_cancel() {
        let mut s = CommandState::from_parts(P::LaunchPrepared, Revision(3));
        let prepared_under = s.revision();
        // a cancel arrives while the launcher is blocked
        assert_eq!(s.bump_revision(), Ok(Revision(4)));
        assert_eq!(
            s.compare_and_transition(prepared_under, P::LaunchAuthorized),
            Err(TransitionError::StaleRevision {
                expected: 3,
                current: 4
            })
        );
        assert_eq!(s.phase(), P::LaunchPrepared);
        assert_eq!(s.resolve_cancel(), CancelResolution::Cancel);
        assert_eq!(
            s.compare_and_transition(Revision(4), P::Cancelled),
            Ok(Edge::Cancel)
        );
        assert_eq!(s.lifecycle(), Lifecycle::Cancelled);
        assert!(s.bump_revision().is_err());
    }

    #[test]
    fn cancel_after_authorization_delivers_a_signal() {
        let mut s = CommandState::from_parts(P::LaunchPrepared, Revision(1));
        assert_eq!(
            s.compare_and_transition(Revision(1), P::LaunchAuthorized),
            Ok(Edge::Authorize)
        );
        assert_eq!(s.resolve_cancel(), CancelResolution::DeliverSignal);
        s.bump_revision().unwrap();
        // a late cancel cannot turn authorized work into `cancelled`
        assert!(s.compare_and_transition(Revision(2), P::Cancelled).is_err());
        assert_eq!(
            CommandState::from_parts(P::Failed, Revision(9)).resolve_cancel(),
            CancelResolution::AlreadyTerminal(Lifecycle::Failed)
        );
    }

    #[test]
    fn revisions_only_grow() {
        let mut s = CommandState::queued();
        assert_eq!(s.revision(), Revision::INITIAL);
        assert_eq!(s.observe_revision(Revision(1)), Ok(RevisionOrder::Same));
        assert_eq!(s.observe_revision(Revision(5)), Ok(RevisionOrder::Newer));
        assert_eq!(
            s.observe_revision(Revision(4)),
            Err(TransitionError::RevisionWentBack {
                incoming: 4,
                current: 5
            })
        );
        assert_eq!(s.revision(), Revision(5));
        assert_eq!(
            Revision(u64::MAX).next(),
            Err(TransitionError::RevisionExhausted)
        );
    }

    #[test]
    fn failed_transition_changes_nothing() {
        let mut s = CommandState::from_parts(P::Queued, Revision(2));
        assert!(s.compare_and_transition(Revision(2), P::Running).is_err());
        assert_eq!(s, CommandState::from_parts(P::Queued, Revision(2)));
    }
}
