//! The one shape of a lifecycle/revision write this crate asks for.

use rvbox_domain::lifecycle::{CommandState, Edge, Phase, Revision, TransitionError};

/// A compare-and-set write of one command's `(phase, revision)`: the store
/// applies it only if the row is still at `from`, inside the transaction
/// that also writes whatever else the decision carries (plan §6.4 "recheck
/// lifecycle/revision transactionally"). When the row moved, the write does
/// nothing and the caller re-reads and decides again; it never forces.
///
/// Built only through the domain's [`CommandState`] helpers, so every write
/// follows legal edges and revisions only grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateWrite {
    from: CommandState,
    to: CommandState,
    edges: Vec<Edge>,
}

impl StateWrite {
    /// Starts a write at `from` with no change yet.
    pub(crate) fn at(from: CommandState) -> Self {
        Self {
            from,
            to: from,
            edges: Vec::new(),
        }
    }

    /// Adds one legal edge at the current revision.
    pub(crate) fn then(mut self, to: Phase) -> Result<Self, TransitionError> {
        let edge = self.to.compare_and_transition(self.to.revision(), to)?;
        self.edges.push(edge);
        Ok(self)
    }

    /// Takes the next revision (a signal, a cancel, a termination).
    pub(crate) fn bump(mut self) -> Result<(Self, Revision), TransitionError> {
        let revision = self.to.bump_revision()?;
        Ok((self, revision))
    }

    /// The state the row must still be in.
    #[must_use]
    pub fn from(&self) -> CommandState {
        self.from
    }

    /// The state the row becomes.
    #[must_use]
    pub fn to(&self) -> CommandState {
        self.to
    }

    /// The lifecycle edges taken, in order (empty for a revision-only write).
    #[must_use]
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// True when the phase changes.
    #[must_use]
    pub fn changes_phase(&self) -> bool {
        self.from.phase() != self.to.phase()
    }
}
