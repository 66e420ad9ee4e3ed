//! RVBox deterministic simulator: one `u64` seed gives one whole run of the
//! real server cores and store against simulated clients and a faulty
//! network, with invariants checked after every step (docs/architecture.md
//! "The simulator"; conventions rules 5-7).
//!
//! Owns: the seeded stream tree ([`rng`]), the simulated network and its
//! fault model ([`net`]), simulated client daemons that speak the agent
//! protocol adversarially (and as a model) ([`client`]), honest clients that
//! are the real client cores over the real client store with a simulated
//! supervisor ([`real`]), and the invariant checker ([`invariants`]).
//!
//! Must never: read the real clock, use OS randomness, spawn threads, or
//! let a `HashMap` iteration order reach anything observable (a frame, a
//! trace, a decision). Time is a `u64` of simulated milliseconds passed in
//! by the caller; every random value comes from a [`rng::SimRng`] derived
//! from the run's seed; collections that are iterated are `BTreeMap`,
//! `BTreeSet` or `VecDeque`. Every queue and map has a named bound.
#![warn(missing_docs)]

pub mod client;
pub mod invariants;
pub mod net;
pub mod real;
pub mod rng;
pub mod world;
