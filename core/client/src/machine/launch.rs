//! Acceptance and the launch sequence (plan §7.3, §7.4): a `Dispatch`
//! checked and made durable before it is acknowledged, the running slots
//! handed out in acceptance order, and each launch taken through
//! `materialize -> prepare -> launch_prepared -> launch_authorized ->
//! release`, aborted or retried when a step fails.

use std::collections::BTreeMap;

use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;

use super::{ClientCore, LAUNCH_RETRY_MS, LaunchPhase, Output, Pending, Record};
use crate::accept::{AcceptPolicy, Refusal, check_dispatch};
use crate::ops::{AcceptOutcome, ClientOp, SuperviseOp, WrapperSource};
use crate::process::{LaunchFailure, LaunchSpec, ResourceLimits};

/// The working directory of a restored record, as acceptance checked it:
/// the default when the spec names none, lexically normalized (no `.` or
/// `..`), so a restart launches in the same directory acceptance allowed.
pub(super) fn normalize_cwd(policy: &AcceptPolicy, spec: &wire::ExecutionSpec) -> String {
    let requested = if spec.cwd.is_empty() {
        policy.default_cwd.as_str()
    } else {
        spec.cwd.as_str()
    };
    crate::accept::normalize(requested).unwrap_or_else(|| requested.to_owned())
}

/// The resource controls of a launch under the requested profiles
/// (`flags`), from each enforceable profile's compiled limits
/// (`profiles`): each control is taken from the first profile that sets
/// it, `io.max` rules from all. A command and a terminal's holder are
/// limited alike; a flag with no compiled limits adds nothing (acceptance
/// refused it already).
pub(super) fn limits_of(profiles: &BTreeMap<i32, ResourceLimits>, flags: &[i32]) -> ResourceLimits {
    let mut l = ResourceLimits::default();
    for f in flags {
        if let Some(p) = profiles.get(f) {
            l.cpu_max = l.cpu_max.or(p.cpu_max);
            l.cpu_weight = l.cpu_weight.or(p.cpu_weight);
            l.memory_max = l.memory_max.or(p.memory_max);
            l.memory_high = l.memory_high.or(p.memory_high);
            l.pids_max = l.pids_max.or(p.pids_max);
            l.io_max.extend(p.io_max.iter().copied());
        }
    }
    l
}

impl ClientCore {
    // ---- acceptance ------------------------------------------------------

    pub(super) fn dispatch(&mut self, now_ms: u64, d: wire::Dispatch) {
        let generation = self.link.session().map_or(0, |s| s.generation);
        // the wall clock of the expiry check comes with the input
        match check_dispatch(&self.config.policy, generation, self.wall, &d) {
            Err(Refusal::Fence { .. }) => self.protocol_error(now_ms),
            Err(r) => self.refuse(&d, &r),
            Ok(checked) => {
                let checked = Box::new(checked);
                let op = ClientOp::Accept(checked.clone());
                self.store(op, Pending::Accept(Box::new(d), checked, generation));
            }
        }
    }

    fn refuse(&mut self, d: &wire::Dispatch, r: &Refusal) {
        if let Some(answer) = r.answer(d) {
            self.stats.refusals += 1;
            self.send(Payload::CommandAccepted(answer));
        }
    }

    /// The positive `CommandAccepted` for `d`, under `resolved_shell`.
    fn accept_positive(&mut self, d: &wire::Dispatch, resolved_shell: wire::ShellType) {
        self.send(Payload::CommandAccepted(wire::CommandAccepted {
            issue_uuid: d.issue_uuid.clone(),
            revision: d.revision,
            outcome: wire::AcceptOutcome::Positive as i32,
            error: None,
            resolved_shell: resolved_shell as i32,
        }));
    }

    pub(super) fn accepted(
        &mut self,
        d: &wire::Dispatch,
        checked: &crate::accept::CheckedDispatch,
        generation: u64,
        outcome: AcceptOutcome,
    ) {
        let same_session = self
            .link
            .session()
            .is_some_and(|s| s.generation == generation);
        match outcome {
            AcceptOutcome::Refused(r) => {
                if same_session {
                    self.refuse(d, &r);
                }
            }
            AcceptOutcome::Repeat {
                revision,
                resolved_shell,
            } => {
                if let Some(issue) = Uuid7::parse("dispatch.issue_uuid", &d.issue_uuid).ok()
                    && let Some(r) = self.records.get_mut(&issue)
                {
                    r.revision = r.revision.max(revision);
                }
                self.stats.repeats += 1;
                if same_session {
                    self.accept_positive(d, resolved_shell);
                }
            }
            AcceptOutcome::New => {
                let order = self.next_order;
                self.next_order += 1;
                if self.spool.open_command(checked.issue).is_err() {
                    return;
                }
                self.records.insert(
                    checked.issue,
                    Record {
                        request_hash: checked.request_hash,
                        revision: checked.revision,
                        resolved_shell: checked.resolved_shell,
                        cwd: checked.cwd.clone(),
                        spec: checked.spec.clone(),
                        lifecycle: wire::Lifecycle::Accepted,
                        phase: LaunchPhase::Accepted,
                        terminate: false,
                        script: checked.script,
                        script_received: 0,
                        script_committed: false,
                        script_reported: 0,
                        wrapper: None,
                        stdin_next: 1,
                        stdin_closed: false,
                        last_signal_revision: 0,
                        signalled: false,
                        cancel_pending: None,
                        exit: None,
                        retry_at: None,
                        order,
                        running_slot: false,
                        unaccountable: false,
                        terminal_attempts: 0,
                        reap_attempts: 0,
                        reap_identity: None,
                    },
                );
                self.stats.accepted += 1;
                if same_session {
                    self.accept_positive(d, checked.resolved_shell);
                }
            }
        }
    }

    // ---- the launch sequence ---------------------------------------------------

    pub(super) fn schedule(&mut self) {
        let max = usize::try_from(self.config.policy.max_running).unwrap_or(usize::MAX);
        loop {
            let running = self.records.values().filter(|r| r.running_slot).count();
            if running >= max {
                return;
            }
            let next = self
                .records
                .iter()
                .filter(|(_, r)| r.launchable() && r.retry_at.is_none())
                .min_by_key(|(_, r)| r.order)
                .map(|(id, _)| *id);
            let Some(issue) = next else {
                return;
            };
            let Some(r) = self.records.get_mut(&issue) else {
                return;
            };
            r.running_slot = true;
            r.phase = LaunchPhase::Materializing;
            let source = match &r.spec.source {
                Some(wire::execution_spec::Source::CommandText(t)) => {
                    WrapperSource::Text(t.clone())
                }
                _ => WrapperSource::Script,
            };
            let cwd = r.cwd.clone();
            self.store(
                ClientOp::Materialize { issue, cwd, source },
                Pending::Materialize(issue),
            );
        }
    }

    pub(super) fn prepare(&mut self, issue: Uuid7, wrapper_path: String) {
        let Some(r) = self.records.get(&issue) else {
            return;
        };
        if r.phase != LaunchPhase::Materializing {
            return;
        }
        let shell = r.resolved_shell;
        let Some(shell_path) = self.config.shell_paths.get(&(shell as i32)).cloned() else {
            let reason = format!("{} is not configured on this host", shell.as_str_name());
            self.launch_failed(0, self.wall, issue, LaunchFailure::Permanent(reason));
            return;
        };
        let spec = LaunchSpec {
            issue,
            shell,
            shell_path,
            wrapper_path: wrapper_path.clone(),
            cwd: r.cwd.clone(),
            env: r
                .spec
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            limits: limits_of(&self.config.profiles, &r.spec.profile_flags),
        };
        if let Some(r) = self.records.get_mut(&issue) {
            r.wrapper = Some(wrapper_path);
            r.phase = LaunchPhase::Preparing;
        }
        self.push(Output::Supervise(SuperviseOp::Prepare(Box::new(spec))));
    }

    /// `launch_prepared` is durable: recheck the revision and a pending
    /// cancellation while the launcher is blocked (plan §7.4 step 3).
    pub(super) fn prepared(&mut self, issue: Uuid7) {
        let Some(r) = self.records.get_mut(&issue) else {
            return;
        };
        let LaunchPhase::RecordingPrepared(id) = r.phase.clone() else {
            return;
        };
        if r.cancel_pending.is_some() || r.terminate || self.shutting_down {
            r.phase = LaunchPhase::Prepared(id);
            self.abort(issue);
            return;
        }
        r.phase = LaunchPhase::Authorizing(id);
        self.store(
            ClientOp::LaunchAuthorized { issue },
            Pending::Authorized(issue),
        );
    }

    pub(super) fn abort(&mut self, issue: Uuid7) {
        if let Some(r) = self.records.get_mut(&issue) {
            r.phase = LaunchPhase::Aborting;
            self.stats.aborted += 1;
            self.push(Output::Supervise(SuperviseOp::Abort(issue)));
        }
    }

    pub(super) fn launch_failed(
        &mut self,
        now_ms: u64,
        wall_ms: i64,
        issue: Uuid7,
        f: LaunchFailure,
    ) {
        match f {
            LaunchFailure::Permanent(reason) => {
                self.end(wall_ms, issue, wire::Lifecycle::Rejected, None, &reason);
            }
            LaunchFailure::Transient(_) => {
                if let Some(r) = self.records.get_mut(&issue) {
                    r.phase = LaunchPhase::Accepted;
                    r.running_slot = false;
                    r.retry_at = Some(now_ms.saturating_add(LAUNCH_RETRY_MS));
                    self.store(ClientOp::Unprepared { issue }, Pending::Unprepared(issue));
                }
            }
        }
    }
}
