//! RVBox deterministic simulator: one `u64` seed gives one whole run of the
//! real server cores and store against simulated clients and a faulty
//! network, with invariants checked after every step (docs/architecture.md
//! "The simulator"; conventions rules 5-7).
//!
//! Owns: the seeded stream tree ([`rng`]), the simulated network and its
//! fault model ([`net`]), client hosts that run the real client runtime
//! over the real client store ([`host`]) with simulated process trees
//! behind the real supervisor trait ([`supervisor`]), the adversary layer
//! on a real client's outgoing frames ([`adversary`]), and the invariant
//! checker and oracles ([`invariants`], [`oracles`]), and the operator's
//! and viewers' side of terminals with their oracles ([`terminals`]). It
//! has no client implementation of its own.
//!
//! Must never: read the real clock, use OS randomness, spawn threads, or
//! let a `HashMap` iteration order reach anything observable (a frame, a
//! trace, a decision). Time is a `u64` of simulated milliseconds passed in
//! by the caller; every random value comes from a [`rng::SimRng`] derived
//! from the run's seed; collections that are iterated are `BTreeMap`,
//! `BTreeSet` or `VecDeque`. Every queue and map has a named bound.
#![warn(missing_docs)]

pub mod adversary;
pub mod host;
pub mod invariants;
pub mod net;
pub mod oracles;
pub mod rng;
pub mod supervisor;
pub mod terminals;
pub mod world;
