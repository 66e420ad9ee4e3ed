//! Named crash points (conventions rule 8).
//!
//! Every durability step of a store calls [`CrashHook::at`] with a stable
//! name (the names live with each store). Production installs [`NoCrash`];
//! crash tests install a hook that kills the process at one chosen point,
//! and the simulator one that stops the run there, so "crash between the
//! segment fsync and the metadata commit" is a reachable, named state.

/// Observes a store passing a named durability step.
pub trait CrashHook: Send + Sync + std::fmt::Debug {
    /// Called when the store reaches `point`. Returning means "carry on".
    fn at(&self, point: &'static str);
}

/// The production hook: does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCrash;

impl CrashHook for NoCrash {
    fn at(&self, _point: &'static str) {}
}
