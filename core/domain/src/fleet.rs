//! Fleet runs: one command on every client a selection resolves to, with
//! rate control (plan extension; docs/fleet.md).
//!
//! A fleet run is a set of ordinary commands, one per target client; the
//! protocol, durability and at-most-once promises are those of a command.
//! This module holds the rules the store applies inside its transactions:
//! the validated request, the deterministic command id of each target,
//! the target state a command lifecycle maps to, and the release decision
//! (`max_parallel`, `max_errors`), all pure.

use rvbox_proto::v1 as wire;
use sha2::{Digest as _, Sha256};

use crate::error::{Code, DomainError};
use crate::ids::{ClientId, Uuid7};
use crate::labels::{Selector, check_client_glob};
use crate::lifecycle::Lifecycle;

/// Most targets one fleet run holds (submission and late additions).
pub const MAX_FLEET_TARGETS: usize = 100_000;
/// Largest script a fleet run carries (each target's command keeps a copy).
pub const MAX_FLEET_SCRIPT_BYTES: u64 = 256 * 1024;
/// Longest `include_late` window.
pub const MAX_INCLUDE_LATE_MS: u64 = 7 * 24 * 3_600_000;

/// A rate limit: a count, or a percentage of the run's targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// At most this many (>= 1).
    Count(u32),
    /// At most this percentage (1..=100) of the targets, rounded up, at
    /// least one.
    Percent(u32),
}

impl Limit {
    /// The limit for a run of `targets` targets.
    #[must_use]
    pub fn resolve(self, targets: u64) -> u64 {
        match self {
            Limit::Count(n) => u64::from(n),
            Limit::Percent(p) => targets.saturating_mul(u64::from(p)).div_ceil(100).max(1),
        }
    }

    /// Parses `10` or `10%` (the form `rvc` takes).
    ///
    /// # Errors
    /// Text naming what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (digits, percent) = match text.strip_suffix('%') {
            Some(d) => (d, true),
            None => (text, false),
        };
        let n: u32 = digits
            .parse()
            .map_err(|_| format!("{text:?} is not a count or a percentage (10 or 10%)"))?;
        if n == 0 {
            return Err(format!("{text:?} must be at least 1"));
        }
        if percent {
            if n > 100 {
                return Err(format!("{text:?} is more than 100%"));
            }
            Ok(Limit::Percent(n))
        } else {
            Ok(Limit::Count(n))
        }
    }

    /// From the wire; `None` for an absent limit.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` naming `field` for an empty or out-of-range
    /// limit.
    pub fn from_wire(
        field: &'static str,
        l: Option<&wire::FleetLimit>,
    ) -> Result<Option<Self>, DomainError> {
        let Some(l) = l else { return Ok(None) };
        let bad = |m: String| DomainError::new(Code::InvalidArgument, m).with_field(field);
        match l.limit {
            None => Err(bad("must hold a count or a percent".into())),
            Some(wire::fleet_limit::Limit::Count(0)) => Err(bad("count must be at least 1".into())),
            Some(wire::fleet_limit::Limit::Count(n)) => Ok(Some(Limit::Count(n))),
            Some(wire::fleet_limit::Limit::Percent(p)) if (1..=100).contains(&p) => {
                Ok(Some(Limit::Percent(p)))
            }
            Some(wire::fleet_limit::Limit::Percent(p)) => {
                Err(bad(format!("percent {p} is outside 1..=100")))
            }
        }
    }

    /// To the wire.
    #[must_use]
    pub fn to_wire(self) -> wire::FleetLimit {
        wire::FleetLimit {
            limit: Some(match self {
                Limit::Count(n) => wire::fleet_limit::Limit::Count(n),
                Limit::Percent(p) => wire::fleet_limit::Limit::Percent(p),
            }),
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Count(n) => write!(f, "{n}"),
            Limit::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// A validated fleet selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Explicit client ids, sorted and distinct (empty: no list).
    pub client_ids: Vec<ClientId>,
    /// Client-id glob (`None`: any).
    pub glob: Option<String>,
    /// Label selector (`None`: any).
    pub selector: Option<Selector>,
    /// Every known client.
    pub all: bool,
}

impl Selection {
    /// Validates a selection: at least one criterion, or `all` alone.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` naming the field.
    pub fn from_wire(s: Option<&wire::FleetSelection>) -> Result<Self, DomainError> {
        let bad = |field: &'static str, m: String| {
            DomainError::new(Code::InvalidArgument, m).with_field(field)
        };
        let Some(s) = s else {
            return Err(bad("selection", "is required".into()));
        };
        if s.client_ids.len() > MAX_FLEET_TARGETS {
            return Err(bad(
                "selection.client_ids",
                format!(
                    "lists {} clients; the limit is {MAX_FLEET_TARGETS}",
                    s.client_ids.len()
                ),
            ));
        }
        let mut ids = Vec::with_capacity(s.client_ids.len());
        for id in &s.client_ids {
            ids.push(ClientId::parse("selection.client_ids", id)?);
        }
        ids.sort();
        let before = ids.len();
        ids.dedup();
        if ids.len() != before {
            return Err(bad(
                "selection.client_ids",
                "lists a client id twice".into(),
            ));
        }
        let glob = if s.client_glob.is_empty() {
            None
        } else {
            check_client_glob(&s.client_glob).map_err(|e| bad("selection.client_glob", e.0))?;
            Some(s.client_glob.clone())
        };
        let selector = if s.selector.is_empty() {
            None
        } else {
            Some(Selector::parse(&s.selector).map_err(|e| bad("selection.selector", e.0))?)
        };
        let criteria = !ids.is_empty() || glob.is_some() || selector.is_some();
        if s.all && criteria {
            return Err(bad(
                "selection.all",
                "all selects every client and takes no other criterion".into(),
            ));
        }
        if !s.all && !criteria {
            return Err(bad(
                "selection",
                "names no clients: give client ids, a glob, a selector, or all".into(),
            ));
        }
        Ok(Self {
            client_ids: ids,
            glob,
            selector,
            all: s.all,
        })
    }

    /// Whether a known client with these labels is selected.
    #[must_use]
    pub fn matches(&self, client_id: &str, labels: &crate::labels::Labels) -> bool {
        if self.all {
            return true;
        }
        (self.client_ids.is_empty()
            || self
                .client_ids
                .binary_search_by(|c| c.as_str().cmp(client_id))
                .is_ok())
            && self
                .glob
                .as_deref()
                .is_none_or(|g| crate::labels::glob_match(g, client_id))
            && self.selector.as_ref().is_none_or(|s| s.matches(labels))
    }
}

/// The command id of `client`'s target in run `run`: the run's timestamp,
/// then bits of SHA-256 over the run id and the client id, with the UUIDv7
/// version and variant. The same run and client always give the same id,
/// so a retried `RunFleet`, or a release repeated after a crash, never
/// creates a second command.
#[must_use]
pub fn target_issue(run: &Uuid7, client: &str) -> Uuid7 {
    let mut h = Sha256::new();
    h.update(b"rvbox fleet target v1\0");
    h.update(run.as_bytes());
    h.update(client.as_bytes());
    let digest = h.finalize();
    let run_bytes = run.as_bytes();
    let mut b = [0u8; 16];
    for (i, slot) in b.iter_mut().enumerate() {
        *slot = if i < 6 {
            run_bytes.get(i).copied().unwrap_or(0)
        } else {
            digest.get(i - 6).copied().unwrap_or(0)
        };
    }
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    // the bytes carry the v7 version and variant set just above
    Uuid7::from_bytes("issue_uuid", b).unwrap_or(*run)
}

/// The state of a released target whose command is in `lifecycle`.
#[must_use]
pub fn target_state(lifecycle: Lifecycle) -> wire::FleetTargetState {
    use wire::FleetTargetState as T;
    match lifecycle {
        Lifecycle::Queued | Lifecycle::Dispatched => T::Queued,
        Lifecycle::Accepted | Lifecycle::Running => T::Running,
        Lifecycle::Succeeded => T::Succeeded,
        Lifecycle::Expired => T::Unreachable,
        Lifecycle::Cancelled => T::Cancelled,
        Lifecycle::Failed
        | Lifecycle::Terminated
        | Lifecycle::Interrupted
        | Lifecycle::Rejected => T::Failed,
    }
}

/// Targets of a run by state (the run row's counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Not released.
    pub pending: u64,
    /// Queued or dispatched.
    pub queued: u64,
    /// Accepted or running.
    pub running: u64,
    /// Succeeded.
    pub succeeded: u64,
    /// Failed.
    pub failed: u64,
    /// Expired in the queue.
    pub unreachable: u64,
    /// Cancelled before running.
    pub cancelled: u64,
    /// Never released (max_errors).
    pub skipped: u64,
}

impl Counts {
    /// Every target.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.pending
            + self.queued
            + self.running
            + self.succeeded
            + self.failed
            + self.unreachable
            + self.cancelled
            + self.skipped
    }

    /// Targets that count against `max_errors`.
    #[must_use]
    pub fn errors(&self) -> u64 {
        self.failed + self.unreachable
    }

    /// Released targets that have not ended.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.queued + self.running
    }

    /// Adds one target in `state`.
    pub fn add(&mut self, state: wire::FleetTargetState) {
        self.add_n(state, 1);
    }

    /// Adds `n` targets in `state`.
    pub fn add_n(&mut self, state: wire::FleetTargetState, n: u64) {
        use wire::FleetTargetState as T;
        match state {
            T::Pending => self.pending += n,
            T::Queued => self.queued += n,
            T::Running => self.running += n,
            T::Succeeded => self.succeeded += n,
            T::Failed => self.failed += n,
            T::Unreachable => self.unreachable += n,
            T::Cancelled => self.cancelled += n,
            T::Skipped => self.skipped += n,
            T::Unspecified => {}
        }
    }

    /// To the wire.
    #[must_use]
    pub fn to_wire(&self) -> wire::FleetCounts {
        let n = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        wire::FleetCounts {
            pending: n(self.pending),
            queued: n(self.queued),
            running: n(self.running),
            succeeded: n(self.succeeded),
            failed: n(self.failed),
            unreachable: n(self.unreachable),
            cancelled: n(self.cancelled),
            skipped: n(self.skipped),
        }
    }
}

/// What one step of a run does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Stop releasing: `max_errors` is reached (pending targets become
    /// skipped).
    pub stop_for_errors: bool,
    /// Pending targets to release now.
    pub release: u64,
    /// The run is done (after this step's changes).
    pub done: bool,
}

/// The release rule, with SSM's semantics: at most `max_parallel` targets
/// queued or running at once; once `max_errors` targets failed or were
/// unreachable, no new target is released and the released ones finish. A
/// run is done when nothing is pending or in flight and its late window
/// (if any) has closed; a stopped run takes no late targets.
#[must_use]
pub fn step(
    state: wire::FleetRunState,
    counts: &Counts,
    max_parallel: Option<Limit>,
    max_errors: Option<Limit>,
    late_open: bool,
) -> Step {
    use wire::FleetRunState as R;
    let total = counts.total();
    let live = matches!(state, R::Running | R::Paused);
    let stop_for_errors = live && max_errors.is_some_and(|m| counts.errors() >= m.resolve(total));
    let release = if state == R::Running && !stop_for_errors {
        let room = max_parallel.map_or(u64::MAX, |p| {
            p.resolve(total).saturating_sub(counts.in_flight())
        });
        counts.pending.min(room)
    } else {
        0
    };
    let pending_after = if stop_for_errors { 0 } else { counts.pending };
    let stopped = stop_for_errors || state == R::Stopping;
    let done = state != R::Done
        && pending_after == 0
        && counts.in_flight() == 0
        && release == 0
        && (stopped || !late_open);
    Step {
        stop_for_errors,
        release,
        done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::FleetRunState as R;

    fn counts(pending: u64, queued: u64, running: u64, failed: u64) -> Counts {
        Counts {
            pending,
            queued,
            running,
            failed,
            ..Counts::default()
        }
    }

    #[test]
    fn limits_parse_and_resolve() {
        assert_eq!(Limit::parse("10"), Ok(Limit::Count(10)));
        assert_eq!(Limit::parse("10%"), Ok(Limit::Percent(10)));
        assert!(Limit::parse("0").is_err());
        assert!(Limit::parse("0%").is_err());
        assert!(Limit::parse("101%").is_err());
        assert!(Limit::parse("x").is_err());
        assert_eq!(Limit::Percent(10).resolve(19_000), 1_900);
        assert_eq!(Limit::Percent(10).resolve(5), 1);
        assert_eq!(Limit::Percent(5).resolve(20), 1);
        assert_eq!(Limit::Percent(5).resolve(21), 2);
        assert_eq!(Limit::Count(3).resolve(1), 3);
    }

    #[test]
    fn release_respects_parallel_and_errors() {
        let p = Some(Limit::Count(2));
        // room for two
        assert_eq!(
            step(R::Running, &counts(5, 0, 0, 0), p, None, false).release,
            2
        );
        // one in flight: room for one
        assert_eq!(
            step(R::Running, &counts(4, 0, 1, 0), p, None, false).release,
            1
        );
        // full
        assert_eq!(
            step(R::Running, &counts(3, 1, 1, 0), p, None, false).release,
            0
        );
        // paused: nothing
        assert_eq!(
            step(R::Paused, &counts(5, 0, 0, 0), p, None, false).release,
            0
        );
        // no limit: all pending
        assert_eq!(
            step(R::Running, &counts(5, 0, 0, 0), None, None, false).release,
            5
        );
        // max errors reached: stop, nothing released, done once in flight ends
        let e = Some(Limit::Count(2));
        let s = step(R::Running, &counts(5, 0, 1, 2), p, e, false);
        assert!(s.stop_for_errors && s.release == 0 && !s.done);
        let s = step(R::Running, &counts(5, 0, 0, 2), p, e, false);
        assert!(s.stop_for_errors && s.done);
        // below max errors: goes on
        assert!(!step(R::Running, &counts(5, 0, 0, 1), p, e, false).stop_for_errors);
    }

    #[test]
    fn done_waits_for_in_flight_and_the_late_window() {
        assert!(step(R::Running, &counts(0, 0, 0, 0), None, None, false).done);
        assert!(!step(R::Running, &counts(0, 1, 0, 0), None, None, false).done);
        assert!(!step(R::Running, &counts(0, 0, 0, 0), None, None, true).done);
        // a stopped run takes no late targets
        assert!(step(R::Stopping, &counts(0, 0, 0, 0), None, None, true).done);
        assert!(!step(R::Done, &counts(0, 0, 0, 0), None, None, false).done);
    }

    #[test]
    fn target_ids_are_deterministic_v7_and_distinct() {
        let run = Uuid7::parse("x", "019ae2f0-0000-7000-8000-000000000001").unwrap();
        let a = target_issue(&run, "web-1");
        assert_eq!(a, target_issue(&run, "web-1"));
        assert_ne!(a, target_issue(&run, "web-2"));
        assert_eq!(a.unix_millis(), run.unix_millis());
        let other = Uuid7::parse("x", "019ae2f0-0000-7000-8000-000000000002").unwrap();
        assert_ne!(a, target_issue(&other, "web-1"));
    }

    #[test]
    fn every_lifecycle_maps_to_a_target_state() {
        for l in Lifecycle::ALL {
            let t = target_state(l);
            assert_ne!(t, wire::FleetTargetState::Unspecified);
            assert_ne!(t, wire::FleetTargetState::Pending);
            assert_eq!(
                l.is_terminal(),
                !matches!(
                    t,
                    wire::FleetTargetState::Queued | wire::FleetTargetState::Running
                ),
                "{l:?}"
            );
        }
    }
}
