//! The acceptance decision for one `Dispatch` (plan §7.3).
//!
//! Acceptance is one durable state transition; this module is its pure
//! half. [`check_dispatch`] is step 1 (validate the session generation,
//! the UUIDv7, the immutable request hash against the spec, the revision,
//! the shell, profile and working-directory policy, the script descriptor
//! and the expiry). [`decide_acceptance`] is steps 2, 3 and 5: it looks at
//! what the client store holds for the command (an active record, a
//! tombstone) before capacity, and classifies every refusal as permanent
//! or transient. The client store runs it inside the transaction that
//! inserts the record and reserves the slot (step 3) and commits and syncs
//! before the positive answer leaves (step 4).
//!
//! | store holds                         | same hash                   | other hash          |
//! |-------------------------------------|-----------------------------|---------------------|
//! | an active record                    | the same acceptance again   | permanent `CONFLICT`|
//! | an active record ended by reconcile | permanent `ALREADY_EXECUTED`| permanent `CONFLICT`|
//! | a tombstone                         | permanent `ALREADY_EXECUTED`| permanent `CONFLICT`|
//! | nothing                             | capacity, then insert       |                     |
//!
//! Reasons are bounded and never quote command text or environment values.

use rvbox_domain::error::{Code, DomainError, RetryClass};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;

/// Most command records the client holds at once: the snapshot record
/// ceiling of reconciliation (`rvbox-reconcile` `MAX_SNAPSHOT_RECORDS`).
pub const MAX_COMMAND_RECORDS: u64 = 16_384;

/// The host's execution policy, compiled once from the client
/// configuration at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptPolicy {
    /// This client's id (the request hash covers it).
    pub client_id: ClientId,
    /// Shells configured on this host (resolved to absolute paths by the
    /// shell at startup).
    pub shells: Vec<wire::ShellType>,
    /// The shell an unspecified `shell_type` resolves to.
    pub default_shell: wire::ShellType,
    /// Profile flags this host can enforce (plan §7.5); any other requested
    /// flag is refused as unsupported.
    pub profiles: Vec<wire::ProfileFlag>,
    /// Allowed working-directory roots: absolute, normalized.
    pub cwd_roots: Vec<String>,
    /// The working directory of a spec that names none.
    pub default_cwd: String,
    /// Most running commands (default 16).
    pub max_running: u32,
    /// Most accepted commands waiting for a running slot (default 100).
    pub max_queued: u32,
    /// Bytes reserved in every accepted command's charge for its terminal
    /// and loss closeout metadata (`spool.closeout_reserve`).
    pub closeout_reserve: u64,
    /// Command-owned storage of the whole daemon (`spool.daemon_total`,
    /// 256 MiB by default): metadata reservations plus stored payloads.
    pub storage_budget: u64,
    /// The most one command may hold (`spool.command_total`, 32 MiB by
    /// default): a command is accepted only when its worst case fits, its
    /// metadata charge, its script, its whole output window and the stdin
    /// it may hold ([`AcceptPolicy::command_streams`]); the output window
    /// then keeps it within the total for its whole life.
    pub command_total: u64,
    /// What a command's output and held stdin take at most:
    /// `spool.command_output_window` plus `flow.command_send_window`.
    pub command_streams: u64,
    /// Free space the state directory's filesystem must keep
    /// (`spool.free_space_floor`, 64 MiB by default): below it no new
    /// command is accepted (transient), whatever the budget says.
    pub free_space_floor: u64,
}

/// Fixed per-command overhead of the metadata charge: the command row, its
/// segment rows and cursors at their largest.
pub const COMMAND_ROW_CHARGE: u64 = 4096;

/// The worst-case metadata a command is charged at acceptance (plan §7.3
/// step 3): its encoded spec, the row overhead and the closeout reserve.
#[must_use]
pub fn metadata_charge(policy: &AcceptPolicy, d: &CheckedDispatch) -> u64 {
    use prost::Message as _;
    u64::try_from(d.spec.encoded_len())
        .unwrap_or(u64::MAX)
        .saturating_add(COMMAND_ROW_CHARGE)
        .saturating_add(policy.closeout_reserve)
}

/// A dispatch that passed step 1.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedDispatch {
    /// The command.
    pub issue: Uuid7,
    /// The session generation it came on.
    pub generation: u64,
    /// Its revision.
    pub revision: u64,
    /// Its immutable request hash (checked against the spec).
    pub request_hash: [u8; 32],
    /// The normalized spec.
    pub spec: wire::ExecutionSpec,
    /// The shell it runs under.
    pub resolved_shell: wire::ShellType,
    /// The effective working directory.
    pub cwd: String,
    /// The queue expiry, wall ms.
    pub queue_expiry_ms: Option<i64>,
    /// The script's declared length and SHA-256, for a script source.
    pub script: Option<(u64, [u8; 32])>,
}

/// Why a dispatch is not accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The dispatch names another session generation: the session is
    /// closed as a protocol error (plan §6.2), nothing is answered.
    Fence {
        /// The generation the dispatch carried.
        got: u64,
        /// The session's generation.
        session: u64,
    },
    /// A `CommandAccepted` with this outcome and error.
    Answer {
        /// `PERMANENT` or `TRANSIENT`.
        outcome: wire::AcceptOutcome,
        /// What was wrong, bounded.
        error: DomainError,
    },
}

impl Refusal {
    fn permanent(code: Code, field: &str, reason: impl AsRef<str>) -> Self {
        Self::Answer {
            outcome: wire::AcceptOutcome::Permanent,
            error: DomainError::new(code, reason).with_field(field),
        }
    }

    fn transient(code: Code, reason: impl AsRef<str>) -> Self {
        Self::Answer {
            outcome: wire::AcceptOutcome::Transient,
            error: DomainError::new(code, reason).with_retry(RetryClass::Transient),
        }
    }

    /// The `CommandAccepted` answering `d` with this refusal, or `None` for
    /// a fence (no answer: the session closes).
    #[must_use]
    pub fn answer(&self, d: &wire::Dispatch) -> Option<wire::CommandAccepted> {
        match self {
            Self::Fence { .. } => None,
            Self::Answer { outcome, error } => {
                let mut error = error.clone();
                if let Ok(id) = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid) {
                    error = error.with_issue(id);
                }
                Some(wire::CommandAccepted {
                    issue_uuid: d.issue_uuid.clone(),
                    revision: d.revision,
                    outcome: *outcome as i32,
                    error: Some(error.to_detail()),
                    resolved_shell: wire::ShellType::Unspecified as i32,
                })
            }
        }
    }

    /// True for a permanent refusal.
    #[must_use]
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::Answer {
                outcome: wire::AcceptOutcome::Permanent,
                ..
            }
        )
    }
}

fn timestamp_ms(t: &prost_types::Timestamp) -> i64 {
    t.seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(t.nanos.clamp(0, 999_999_999) / 1_000_000))
}

/// A lexically normalized absolute path: no `.`/`..` components, no empty
/// components, no trailing slash (except `/`). `None` when `path` is not
/// absolute or climbs above the root.
pub(crate) fn normalize(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(format!("/{}", parts.join("/")))
}

pub(crate) fn under_root(cwd: &str, root: &str) -> bool {
    cwd == root
        || root == "/"
        || cwd
            .strip_prefix(root)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Checks that this host can enforce every profile in `flags` (plan
/// §7.5): each must be one of [`AcceptPolicy::profiles`]. Commands and
/// terminals are checked alike.
///
/// # Errors
/// `UNSUPPORTED` on `field`, naming the first profile that cannot be
/// enforced here.
pub(crate) fn check_enforceable(
    policy: &AcceptPolicy,
    field: &str,
    flags: &[i32],
) -> Result<(), DomainError> {
    for flag in flags {
        let known = wire::ProfileFlag::try_from(*flag).ok();
        if !known.is_some_and(|f| policy.profiles.contains(&f)) {
            let name = known.map_or("an unknown profile", |f| f.as_str_name());
            return Err(DomainError::new(
                Code::Unsupported,
                format!("{name} cannot be enforced on this host"),
            )
            .with_field(field));
        }
    }
    Ok(())
}

/// Step 1: validates `d`, received on a session of `generation`, at wall
/// time `wall_ms`.
///
/// The working directory is checked lexically here (absolute, normalized,
/// under an allowed root); the launch checks the canonical directory again
/// on the host before any user code runs.
///
/// # Errors
/// [`Refusal::Fence`] for another generation; otherwise a permanent
/// refusal naming the field (policy, schema, hash, unsupported shell or
/// profile), or a transient one when the queue expiry has passed by this
/// client's clock (the server then expires the command instead of marking
/// it rejected).
pub fn check_dispatch(
    policy: &AcceptPolicy,
    generation: u64,
    wall_ms: i64,
    d: &wire::Dispatch,
) -> Result<CheckedDispatch, Refusal> {
    // plan §6.2: a dispatch for another generation is a protocol error
    if d.generation != generation {
        return Err(Refusal::Fence {
            got: d.generation,
            session: generation,
        });
    }
    let issue = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid).map_err(|_| {
        Refusal::permanent(
            Code::InvalidArgument,
            "dispatch.issue_uuid",
            "is not a canonical UUIDv7",
        )
    })?;
    let request_hash = <[u8; 32]>::try_from(d.request_hash.as_slice()).map_err(|_| {
        Refusal::permanent(
            Code::InvalidArgument,
            "dispatch.request_hash",
            format!("is {} bytes, not 32", d.request_hash.len()),
        )
    })?;
    if d.revision == 0 {
        return Err(Refusal::permanent(
            Code::InvalidArgument,
            "dispatch.revision",
            "must be at least 1",
        ));
    }
    let Some(raw_spec) = d.spec.as_ref() else {
        return Err(Refusal::permanent(
            Code::InvalidArgument,
            "dispatch.spec",
            "is absent",
        ));
    };
    let spec = check_execution_spec(raw_spec).map_err(|error| Refusal::Answer {
        outcome: wire::AcceptOutcome::Permanent,
        error,
    })?;
    if command_hash(&policy.client_id, &spec).0 != request_hash {
        return Err(Refusal::permanent(
            Code::Conflict,
            "dispatch.request_hash",
            "does not match the spec",
        ));
    }
    let resolved_shell = match wire::ShellType::try_from(spec.shell_type) {
        Ok(wire::ShellType::Unspecified) => policy.default_shell,
        Ok(s) => s,
        Err(_) => {
            return Err(Refusal::permanent(
                Code::InvalidArgument,
                "spec.shell_type",
                "is not a known shell type",
            ));
        }
    };
    if !policy.shells.contains(&resolved_shell) {
        return Err(Refusal::permanent(
            Code::Unsupported,
            "spec.shell_type",
            format!(
                "{} is not configured on this host",
                resolved_shell.as_str_name()
            ),
        ));
    }
    check_enforceable(policy, "spec.profile_flags", &spec.profile_flags).map_err(|error| {
        Refusal::Answer {
            outcome: wire::AcceptOutcome::Permanent,
            error,
        }
    })?;
    let requested = if spec.cwd.is_empty() {
        policy.default_cwd.as_str()
    } else {
        spec.cwd.as_str()
    };
    let Some(cwd) = normalize(requested) else {
        return Err(Refusal::permanent(
            Code::InvalidArgument,
            "spec.cwd",
            "is not an absolute path below the root",
        ));
    };
    if !policy.cwd_roots.iter().any(|root| under_root(&cwd, root)) {
        return Err(Refusal::permanent(
            Code::InvalidArgument,
            "spec.cwd",
            "is not under an allowed working-directory root",
        ));
    }
    let script = match &spec.source {
        Some(wire::execution_spec::Source::Script(s)) => {
            // check_execution_spec verified the length of sha256
            let sha = <[u8; 32]>::try_from(s.sha256.as_slice()).map_err(|_| {
                Refusal::permanent(
                    Code::InvalidArgument,
                    "spec.script.sha256",
                    "is not 32 bytes",
                )
            })?;
            Some((s.size_bytes, sha))
        }
        _ => None,
    };
    let queue_expiry_ms = d.queue_expiry_time.as_ref().map(timestamp_ms);
    if queue_expiry_ms.is_some_and(|expiry| wall_ms >= expiry) {
        return Err(Refusal::transient(
            Code::FailedPrecondition,
            "the queue expiry has passed by this client's clock",
        ));
    }
    Ok(CheckedDispatch {
        issue,
        generation,
        revision: d.revision,
        request_hash,
        spec,
        resolved_shell,
        cwd,
        queue_expiry_ms,
        script,
    })
}

/// What the client store holds for the dispatched command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExistingCommand {
    /// Its immutable request hash.
    pub request_hash: [u8; 32],
    /// Its stored revision.
    pub revision: u64,
    /// The shell it was accepted under.
    pub resolved_shell: wire::ShellType,
    /// Reconciliation told this client to end it: it may have run, and no
    /// further event will be sent for it.
    pub terminate_intent: bool,
}

/// The client's counts, read from the store's maintained counters in the
/// same transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    /// Commands holding a running slot.
    pub running: u64,
    /// Accepted commands waiting for a running slot.
    pub queued: u64,
    /// Command records held (active and terminal-unacknowledged).
    pub records: u64,
    /// Bytes charged to the daemon's storage budget: metadata reservations
    /// plus stored payloads.
    pub charged_bytes: u64,
    /// Free bytes of the state directory's filesystem, measured with the
    /// acceptance (`None`: not measured).
    pub free_space: Option<u64>,
}

/// Steps 2, 3 and 5 of acceptance.
#[derive(Debug, Clone, PartialEq)]
pub enum AcceptDecision {
    /// Insert the record with a queued slot and answer positively once
    /// it is durable.
    Insert,
    /// An exact active duplicate: answer with the existing acceptance. The
    /// stored revision rises to `revision` when the dispatch carries a
    /// higher one; the slot is not counted again.
    Repeat {
        /// The revision to store (the higher of the two).
        revision: u64,
        /// The shell the command was accepted under.
        resolved_shell: wire::ShellType,
    },
    /// Refused; nothing is written.
    Refuse(Refusal),
}

/// Decides steps 2, 3 and 5 for a checked dispatch.
///
/// Capacity follows the server's admission rule (`rvbox-dispatch`):
/// `running + queued < max_running + max_queued`, plus the record ceiling
/// of reconciliation and the daemon's storage budget, which must hold the
/// command's [`metadata_charge`].
#[must_use]
pub fn decide_acceptance(
    policy: &AcceptPolicy,
    d: &CheckedDispatch,
    existing: Option<ExistingCommand>,
    tombstone: Option<[u8; 32]>,
    capacity: Capacity,
) -> AcceptDecision {
    if let Some(rec) = existing {
        return if rec.request_hash != d.request_hash {
            AcceptDecision::Refuse(Refusal::permanent(
                Code::Conflict,
                "dispatch.request_hash",
                "the command is held here with another request hash",
            ))
        } else if rec.terminate_intent {
            AcceptDecision::Refuse(Refusal::permanent(
                Code::AlreadyExecuted,
                "dispatch.issue_uuid",
                "the command was ended here",
            ))
        } else {
            AcceptDecision::Repeat {
                revision: rec.revision.max(d.revision),
                resolved_shell: rec.resolved_shell,
            }
        };
    }
    if let Some(hash) = tombstone {
        return AcceptDecision::Refuse(if hash == d.request_hash {
            Refusal::permanent(
                Code::AlreadyExecuted,
                "dispatch.issue_uuid",
                "the command already ran here",
            )
        } else {
            Refusal::permanent(
                Code::Conflict,
                "dispatch.request_hash",
                "the command ran here with another request hash",
            )
        });
    }
    let slots = u64::from(policy.max_running) + u64::from(policy.max_queued);
    if capacity.running.saturating_add(capacity.queued) >= slots {
        return AcceptDecision::Refuse(Refusal::transient(
            Code::CapacityExhausted,
            "no running or queued slot is free",
        ));
    }
    if capacity.records >= MAX_COMMAND_RECORDS {
        return AcceptDecision::Refuse(Refusal::transient(
            Code::CapacityExhausted,
            "the client holds the most command records it can reconcile",
        ));
    }
    if let Some(free) = capacity.free_space
        && free < policy.free_space_floor
    {
        return AcceptDecision::Refuse(Refusal::transient(
            Code::QuotaExceeded,
            format!(
                "the filesystem of the client's state directory has {free} bytes free, below spool.free_space_floor ({})",
                policy.free_space_floor
            ),
        ));
    }
    let charge = metadata_charge(policy, d);
    let script = d.script.map_or(0, |(len, _)| len);
    let worst = charge
        .saturating_add(script)
        .saturating_add(policy.command_streams);
    if worst > policy.command_total {
        // never fits here, however long it waits
        return AcceptDecision::Refuse(Refusal::permanent(
            Code::TooLarge,
            if script > 0 { "spec.script" } else { "spec" },
            format!(
                "the command needs up to {worst} bytes here ({charge} of metadata, {script} of script, {} of output and stdin), above spool.command_total ({})",
                policy.command_streams, policy.command_total
            ),
        ));
    }
    if capacity.charged_bytes.saturating_add(charge) > policy.storage_budget {
        return AcceptDecision::Refuse(Refusal::transient(
            Code::QuotaExceeded,
            "the client's local storage budget is full",
        ));
    }
    AcceptDecision::Insert
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AcceptPolicy {
        AcceptPolicy {
            client_id: ClientId::parse("c", "web-1").unwrap(),
            shells: vec![wire::ShellType::Sh, wire::ShellType::Bash],
            default_shell: wire::ShellType::Sh,
            profiles: vec![wire::ProfileFlag::Light],
            cwd_roots: vec!["/srv".into(), "/tmp".into()],
            default_cwd: "/tmp".into(),
            max_running: 2,
            max_queued: 1,
            closeout_reserve: 64 * 1024,
            storage_budget: 1 << 20,
            command_total: 32 << 20,
            command_streams: 11 << 20,
            free_space_floor: 64 << 20,
        }
    }

    const ISSUE: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    fn spec() -> wire::ExecutionSpec {
        wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("echo hi".into())),
            ..Default::default()
        }
    }

    fn dispatch(spec: wire::ExecutionSpec) -> wire::Dispatch {
        let p = policy();
        let normalized = check_execution_spec(&spec).unwrap();
        wire::Dispatch {
            issue_uuid: ISSUE.into(),
            generation: 7,
            revision: 1,
            request_hash: command_hash(&p.client_id, &normalized).0.to_vec(),
            spec: Some(spec),
            queue_expiry_time: None,
        }
    }

    fn refusal(r: Result<CheckedDispatch, Refusal>) -> (wire::AcceptOutcome, Code, String) {
        match r {
            Err(Refusal::Answer { outcome, error }) => {
                (outcome, error.code(), error.field().to_string())
            }
            other => panic!("expected an answer refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_dispatch_resolves_shell_and_cwd() {
        let c = check_dispatch(&policy(), 7, 0, &dispatch(spec())).unwrap();
        assert_eq!(c.resolved_shell, wire::ShellType::Sh);
        assert_eq!(c.cwd, "/tmp");
        assert_eq!(c.script, None);
        let mut s = spec();
        s.cwd = "/srv/app/./x/../y".into();
        s.shell_type = wire::ShellType::Bash as i32;
        let c = check_dispatch(&policy(), 7, 0, &dispatch(s)).unwrap();
        assert_eq!(c.cwd, "/srv/app/y");
        assert_eq!(c.resolved_shell, wire::ShellType::Bash);
    }

    #[test]
    fn another_generation_is_a_fence_not_an_answer() {
        let r = check_dispatch(&policy(), 8, 0, &dispatch(spec()));
        assert_eq!(r, Err(Refusal::Fence { got: 7, session: 8 }));
        assert!(r.unwrap_err().answer(&dispatch(spec())).is_none());
    }

    #[test]
    fn malformed_fields_are_permanent_and_named() {
        let mut d = dispatch(spec());
        d.issue_uuid = "not-a-uuid".into();
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &d)),
            (
                wire::AcceptOutcome::Permanent,
                Code::InvalidArgument,
                "dispatch.issue_uuid".into()
            )
        );
        let mut d = dispatch(spec());
        d.request_hash = vec![0; 31];
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &d)).2,
            "dispatch.request_hash"
        );
        let mut d = dispatch(spec());
        d.request_hash = vec![0; 32];
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &d)).1,
            Code::Conflict
        );
        let mut d = dispatch(spec());
        d.revision = 0;
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &d)).2,
            "dispatch.revision"
        );
        let mut d = dispatch(spec());
        d.spec = None;
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &d)).2,
            "dispatch.spec"
        );
    }

    #[test]
    fn policy_refusals_are_permanent() {
        let mut s = spec();
        s.shell_type = wire::ShellType::Powershell as i32;
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &dispatch(s))),
            (
                wire::AcceptOutcome::Permanent,
                Code::Unsupported,
                "spec.shell_type".into()
            )
        );
        let mut s = spec();
        s.profile_flags = vec![wire::ProfileFlag::MemLow as i32];
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 0, &dispatch(s))).1,
            Code::Unsupported
        );
        for cwd in ["/etc", "/srvx", "/srv/../etc", "/tmp/../../.."] {
            let mut s = spec();
            s.cwd = cwd.into();
            let (outcome, _, field) = refusal(check_dispatch(&policy(), 7, 0, &dispatch(s)));
            assert_eq!(outcome, wire::AcceptOutcome::Permanent, "{cwd}");
            assert_eq!(field, "spec.cwd", "{cwd}");
        }
    }

    #[test]
    fn a_passed_expiry_is_transient() {
        let mut d = dispatch(spec());
        d.queue_expiry_time = Some(prost_types::Timestamp {
            seconds: 10,
            nanos: 0,
        });
        assert!(check_dispatch(&policy(), 7, 9_999, &d).is_ok());
        assert_eq!(
            refusal(check_dispatch(&policy(), 7, 10_000, &d)).0,
            wire::AcceptOutcome::Transient
        );
    }

    #[test]
    fn duplicates_and_tombstones_come_before_capacity() {
        let p = policy();
        let c = check_dispatch(&p, 7, 0, &dispatch(spec())).unwrap();
        let full = Capacity {
            running: 2,
            queued: 1,
            records: 3,
            charged_bytes: 0,
            free_space: None,
        };
        let held = ExistingCommand {
            request_hash: c.request_hash,
            revision: 3,
            resolved_shell: wire::ShellType::Bash,
            terminate_intent: false,
        };
        assert_eq!(
            decide_acceptance(&p, &c, Some(held), None, full),
            AcceptDecision::Repeat {
                revision: 3,
                resolved_shell: wire::ShellType::Bash
            }
        );
        let other = ExistingCommand {
            request_hash: [9; 32],
            ..held
        };
        let code = |d: AcceptDecision| match d {
            AcceptDecision::Refuse(Refusal::Answer { outcome, error }) => (outcome, error.code()),
            d => panic!("{d:?}"),
        };
        assert_eq!(
            code(decide_acceptance(&p, &c, Some(other), None, full)),
            (wire::AcceptOutcome::Permanent, Code::Conflict)
        );
        let ended = ExistingCommand {
            terminate_intent: true,
            ..held
        };
        assert_eq!(
            code(decide_acceptance(&p, &c, Some(ended), None, full)),
            (wire::AcceptOutcome::Permanent, Code::AlreadyExecuted)
        );
        assert_eq!(
            code(decide_acceptance(&p, &c, None, Some(c.request_hash), full)),
            (wire::AcceptOutcome::Permanent, Code::AlreadyExecuted)
        );
        assert_eq!(
            code(decide_acceptance(&p, &c, None, Some([1; 32]), full)),
            (wire::AcceptOutcome::Permanent, Code::Conflict)
        );
        assert_eq!(
            code(decide_acceptance(&p, &c, None, None, full)),
            (wire::AcceptOutcome::Transient, Code::CapacityExhausted)
        );
        let room = Capacity {
            running: 2,
            queued: 0,
            records: 2,
            charged_bytes: 0,
            free_space: None,
        };
        assert_eq!(
            decide_acceptance(&p, &c, None, None, room),
            AcceptDecision::Insert
        );
        let records = Capacity {
            running: 0,
            queued: 0,
            records: MAX_COMMAND_RECORDS,
            charged_bytes: 0,
            free_space: None,
        };
        assert_eq!(
            code(decide_acceptance(&p, &c, None, None, records)),
            (wire::AcceptOutcome::Transient, Code::CapacityExhausted)
        );
        let charge = metadata_charge(&p, &c);
        assert!(charge > p.closeout_reserve + COMMAND_ROW_CHARGE);
        let at_budget = Capacity {
            charged_bytes: p.storage_budget - charge,
            ..room
        };
        assert_eq!(
            decide_acceptance(&p, &c, None, None, at_budget),
            AcceptDecision::Insert
        );
        let over = Capacity {
            charged_bytes: p.storage_budget - charge + 1,
            ..room
        };
        assert_eq!(
            code(decide_acceptance(&p, &c, None, None, over)),
            (wire::AcceptOutcome::Transient, Code::QuotaExceeded)
        );
        // the command's worst case against spool.command_total: at the
        // total it fits, one byte above it never will (permanent)
        let tight = AcceptPolicy {
            command_total: charge + p.command_streams,
            ..p.clone()
        };
        assert_eq!(
            decide_acceptance(&tight, &c, None, None, room),
            AcceptDecision::Insert
        );
        let small = AcceptPolicy {
            command_total: charge + p.command_streams - 1,
            ..p.clone()
        };
        let AcceptDecision::Refuse(Refusal::Answer { outcome, error }) =
            decide_acceptance(&small, &c, None, None, room)
        else {
            panic!("accepted above the command total")
        };
        assert_eq!(
            (outcome, error.code()),
            (wire::AcceptOutcome::Permanent, Code::TooLarge)
        );
        assert!(
            error.reason().contains("spool.command_total"),
            "{}",
            error.reason()
        );
        // the filesystem's free-space floor, whatever the budget says
        let at_floor = Capacity {
            free_space: Some(p.free_space_floor),
            ..room
        };
        assert_eq!(
            decide_acceptance(&p, &c, None, None, at_floor),
            AcceptDecision::Insert
        );
        let below = Capacity {
            free_space: Some(p.free_space_floor - 1),
            ..room
        };
        let AcceptDecision::Refuse(Refusal::Answer { outcome, error }) =
            decide_acceptance(&p, &c, None, None, below)
        else {
            panic!("accepted below the floor")
        };
        assert_eq!(
            (outcome, error.code()),
            (wire::AcceptOutcome::Transient, Code::QuotaExceeded)
        );
        assert!(
            error.reason().contains("spool.free_space_floor"),
            "{}",
            error.reason()
        );
    }
}
