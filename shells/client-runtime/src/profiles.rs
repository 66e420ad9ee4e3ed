//! Resource profiles compiled at startup into immutable launch policies
//! (plan §7.5), against the supervision layout the supervisor detected.
//!
//! Each enabled profile of the configuration becomes the
//! [`ResourceLimits`] its flag launches with. A control the host cannot
//! apply decides the profile's fate by whether it is essential
//! (`required_controls`):
//! - an essential control that cannot be applied makes the profile
//!   unenforceable here: it is neither advertised nor accepted, and a
//!   dispatch that asks for it is refused at acceptance as `UNSUPPORTED`;
//! - any other control that cannot be applied is left out of the policy,
//!   once, at startup, with a warning naming it, so that what a launch
//!   writes and reads back is exactly the compiled policy.
//!
//! A disabled profile is neither advertised nor accepted. `light` with no
//! controls is always enforceable (it restricts nothing).

use std::collections::BTreeMap;

use rvbox_client_core::process::{IoLimit, ResourceLimits};
use rvbox_config::{Control, ProfileName, ProfilesConfig, ResourceProfile};
use rvbox_proto::v1 as wire;

/// A profile this host cannot enforce, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unenforceable {
    /// The profile.
    pub profile: ProfileName,
    /// The essential control that cannot be applied.
    pub control: Control,
    /// The supervisor's reason.
    pub reason: String,
}

/// An optional control left out of a profile's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Omitted {
    /// The profile.
    pub profile: ProfileName,
    /// The control.
    pub control: Control,
    /// The supervisor's reason.
    pub reason: String,
}

/// The compiled profiles of this host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompiledProfiles {
    /// The launch policy of every enforceable profile, by wire flag.
    pub limits: BTreeMap<i32, ResourceLimits>,
    /// The enforceable profiles, in flag order: advertised in the hello
    /// and accepted.
    pub enforceable: Vec<wire::ProfileFlag>,
    /// Enabled profiles refused here.
    pub unenforceable: Vec<Unenforceable>,
    /// Optional controls left out.
    pub omitted: Vec<Omitted>,
}

impl CompiledProfiles {
    /// The enforceable flags as the hello carries them.
    #[must_use]
    pub fn advertised(&self) -> Vec<i32> {
        self.enforceable.iter().map(|f| *f as i32).collect()
    }
}

/// The limits of `profile` restricted to the controls `keep` accepts.
fn limits_of(profile: &ResourceProfile, keep: impl Fn(Control) -> bool) -> ResourceLimits {
    let pick = |c: Control| keep(c);
    ResourceLimits {
        cpu_max: profile
            .cpu_max
            .filter(|_| pick(Control::CpuMax))
            .map(|c| (c.quota_us, c.period_us)),
        cpu_weight: profile.cpu_weight.filter(|_| pick(Control::CpuWeight)),
        memory_max: profile.memory_max.filter(|_| pick(Control::MemoryMax)),
        memory_high: profile.memory_high.filter(|_| pick(Control::MemoryHigh)),
        pids_max: profile.pids_max.filter(|_| pick(Control::PidsMax)),
        io_max: if pick(Control::IoMax) {
            profile
                .io
                .iter()
                .map(|r| IoLimit {
                    major: r.major,
                    minor: r.minor,
                    read_bps: r.read_bps,
                    write_bps: r.write_bps,
                    read_iops: r.read_iops,
                    write_iops: r.write_iops,
                })
                .collect()
        } else {
            Vec::new()
        },
    }
}

/// Compiles every enabled profile against `check` (the supervisor's
/// [`check_limits`](rvbox_supervisor::Supervisor::check_limits)), logging
/// each profile's outcome.
pub fn compile_profiles(
    config: &ProfilesConfig,
    check: impl Fn(&ResourceLimits) -> Result<(), String>,
) -> CompiledProfiles {
    let mut out = CompiledProfiles::default();
    for profile in config.all().filter(|p| p.enabled) {
        let name = profile.name;
        let mut refused = None;
        let mut kept = Vec::new();
        for control in profile.configured_controls() {
            match check(&limits_of(profile, |c| c == control)) {
                Ok(()) => kept.push(control),
                Err(reason) if profile.required.contains(&control) => {
                    refused = Some(Unenforceable {
                        profile: name,
                        control,
                        reason,
                    });
                    break;
                }
                Err(reason) => {
                    tracing::warn!(profile = %name, %control, %reason,
                        "optional resource control cannot be applied on this host; left out of the profile");
                    out.omitted.push(Omitted {
                        profile: name,
                        control,
                        reason,
                    });
                }
            }
        }
        // the kept controls together (one controller may take one control
        // but not a pair, as v1 memory takes `memory.max` only)
        let limits = limits_of(profile, |c| kept.contains(&c));
        if refused.is_none()
            && let Err(reason) = check(&limits)
        {
            refused = Some(Unenforceable {
                profile: name,
                control: kept.first().copied().unwrap_or(Control::PidsMax),
                reason,
            });
        }
        match refused {
            Some(r) => {
                tracing::warn!(profile = %name, control = %r.control, reason = %r.reason,
                    "resource profile cannot be enforced on this host; not advertised, and dispatches asking for it are refused as unsupported");
                out.unenforceable.push(r);
            }
            None => {
                tracing::info!(profile = %name, controls = kept.len(), "resource profile compiled");
                let flag = name.to_wire();
                out.limits.insert(flag as i32, limits);
                out.enforceable.push(flag);
            }
        }
    }
    out.enforceable.sort_by_key(|f| *f as i32);
    out
}
