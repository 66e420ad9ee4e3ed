//! Resource profiles (plan §4.3 item 7, §7.5): compiled at startup into
//! immutable launch policies; requests are checked by dimension.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::decode::{Entry, RawProfile, Value};
use crate::error::{ConfigError, ConfigErrors, Origin};
use crate::units::describe_bytes;
use rvbox_domain::validate::{ProfileSetError, check_profile_set, flag_dimension};
use rvbox_proto::v1::ProfileFlag;

/// A profile name, one per protocol profile flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProfileName {
    /// `light`: exclusive.
    Light,
    /// `cpu_low`.
    CpuLow,
    /// `cpu_medium`.
    CpuMedium,
    /// `cpu_high`.
    CpuHigh,
    /// `mem_low`.
    MemLow,
    /// `mem_medium`.
    MemMedium,
    /// `mem_high`.
    MemHigh,
    /// `disk_low`.
    DiskLow,
    /// `disk_medium`.
    DiskMedium,
    /// `disk_high`.
    DiskHigh,
}

/// The dimension of a profile: at most one profile per dimension (the
/// domain's one definition).
pub use rvbox_domain::validate::ProfileDimension as Dimension;

impl ProfileName {
    /// Every profile, in summary order.
    pub const ALL: [ProfileName; 10] = [
        ProfileName::Light,
        ProfileName::CpuLow,
        ProfileName::CpuMedium,
        ProfileName::CpuHigh,
        ProfileName::MemLow,
        ProfileName::MemMedium,
        ProfileName::MemHigh,
        ProfileName::DiskLow,
        ProfileName::DiskMedium,
        ProfileName::DiskHigh,
    ];

    /// The configuration table name.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileName::Light => "light",
            ProfileName::CpuLow => "cpu_low",
            ProfileName::CpuMedium => "cpu_medium",
            ProfileName::CpuHigh => "cpu_high",
            ProfileName::MemLow => "mem_low",
            ProfileName::MemMedium => "mem_medium",
            ProfileName::MemHigh => "mem_high",
            ProfileName::DiskLow => "disk_low",
            ProfileName::DiskMedium => "disk_medium",
            ProfileName::DiskHigh => "disk_high",
        }
    }

    /// Parses a configuration table name.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == text)
    }

    /// The wire value of this profile (`rvbox.v1.ProfileFlag`); the names
    /// match 1:1 (`cpu_low` is `PROFILE_FLAG_CPU_LOW`).
    pub fn to_wire(self) -> ProfileFlag {
        match self {
            ProfileName::Light => ProfileFlag::Light,
            ProfileName::CpuLow => ProfileFlag::CpuLow,
            ProfileName::CpuMedium => ProfileFlag::CpuMedium,
            ProfileName::CpuHigh => ProfileFlag::CpuHigh,
            ProfileName::MemLow => ProfileFlag::MemLow,
            ProfileName::MemMedium => ProfileFlag::MemMedium,
            ProfileName::MemHigh => ProfileFlag::MemHigh,
            ProfileName::DiskLow => ProfileFlag::DiskLow,
            ProfileName::DiskMedium => ProfileFlag::DiskMedium,
            ProfileName::DiskHigh => ProfileFlag::DiskHigh,
        }
    }

    /// The profile of a wire value; `None` for `UNSPECIFIED`.
    pub fn from_wire(flag: ProfileFlag) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.to_wire() == flag)
    }

    /// The profile's dimension.
    pub fn dimension(self) -> Dimension {
        // Every named profile has a dimension; `Light` is the safe fallback
        // for the unreachable `None` (it conflicts with everything).
        flag_dimension(self.to_wire()).unwrap_or(Dimension::Light)
    }
}

impl fmt::Display for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A cgroup control a profile can set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Control {
    /// `cpu.max` (quota and period).
    CpuMax,
    /// `cpu.weight`.
    CpuWeight,
    /// `memory.max`.
    MemoryMax,
    /// `memory.high`.
    MemoryHigh,
    /// `pids.max`.
    PidsMax,
    /// `io.max` device rules.
    IoMax,
}

impl Control {
    /// Every control.
    pub const ALL: [Control; 6] = [
        Control::CpuMax,
        Control::CpuWeight,
        Control::MemoryMax,
        Control::MemoryHigh,
        Control::PidsMax,
        Control::IoMax,
    ];

    /// The name used in `required_controls`.
    pub fn as_str(self) -> &'static str {
        match self {
            Control::CpuMax => "cpu_max",
            Control::CpuWeight => "cpu_weight",
            Control::MemoryMax => "memory_max",
            Control::MemoryHigh => "memory_high",
            Control::PidsMax => "pids_max",
            Control::IoMax => "io_max",
        }
    }

    /// Parses a `required_controls` entry.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == text)
    }

    /// True when a profile of `dimension` may set this control. `pids_max`
    /// fits every profile; `light` may set anything.
    pub fn allowed_in(self, dimension: Dimension) -> bool {
        matches!(
            (self, dimension),
            (_, Dimension::Light)
                | (Control::PidsMax, _)
                | (Control::CpuMax | Control::CpuWeight, Dimension::Cpu)
                | (Control::MemoryMax | Control::MemoryHigh, Dimension::Memory)
                | (Control::IoMax, Dimension::Disk)
        )
    }
}

impl fmt::Display for Control {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `cpu.max`: quota per period, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuMax {
    /// Quota in microseconds.
    pub quota_us: u64,
    /// Period in microseconds.
    pub period_us: u64,
}

/// One `io.max` rule for a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRule {
    /// Device major number.
    pub major: u32,
    /// Device minor number.
    pub minor: u32,
    /// Read bytes per second.
    pub read_bps: Option<u64>,
    /// Write bytes per second.
    pub write_bps: Option<u64>,
    /// Read operations per second.
    pub read_iops: Option<u64>,
    /// Write operations per second.
    pub write_iops: Option<u64>,
}

impl IoRule {
    /// The canonical `major:minor` key.
    pub fn device(&self) -> String {
        format!("{}:{}", self.major, self.minor)
    }
}

/// A validated resource profile: an immutable launch policy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResourceProfile {
    /// The profile.
    pub name: ProfileName,
    /// Advertised and accepted.
    pub enabled: bool,
    /// Essential controls: a launch is rejected rather than run without them.
    pub required: BTreeSet<Control>,
    /// `cpu.max`.
    pub cpu_max: Option<CpuMax>,
    /// `cpu.weight`.
    pub cpu_weight: Option<u64>,
    /// `memory.max` in bytes.
    pub memory_max: Option<u64>,
    /// `memory.high` in bytes.
    pub memory_high: Option<u64>,
    /// `pids.max`.
    pub pids_max: Option<u64>,
    /// `io.max` rules, sorted by device.
    pub io: Vec<IoRule>,
}

impl ResourceProfile {
    /// The controls this profile sets.
    pub fn configured_controls(&self) -> BTreeSet<Control> {
        let mut set = BTreeSet::new();
        if self.cpu_max.is_some() {
            set.insert(Control::CpuMax);
        }
        if self.cpu_weight.is_some() {
            set.insert(Control::CpuWeight);
        }
        if self.memory_max.is_some() {
            set.insert(Control::MemoryMax);
        }
        if self.memory_high.is_some() {
            set.insert(Control::MemoryHigh);
        }
        if self.pids_max.is_some() {
            set.insert(Control::PidsMax);
        }
        if !self.io.is_empty() {
            set.insert(Control::IoMax);
        }
        set
    }
}

/// The validated profiles of a client.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProfilesConfig {
    profiles: BTreeMap<ProfileName, ResourceProfile>,
}

/// Why a request's profile set is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileRequestError {
    /// `light` was combined with another profile.
    #[error("profile light is exclusive and cannot be combined with {0}")]
    LightNotExclusive(ProfileName),
    /// Two profiles of one dimension.
    #[error(
        "profiles {0} and {1} are of the same dimension; at most one CPU, one MEM and one DISK profile"
    )]
    SameDimension(ProfileName, ProfileName),
    /// Not configured (or disabled) on this client.
    #[error("profile {0} is not configured on this client")]
    NotConfigured(ProfileName),
}

/// Checks a profile flag set without looking at configuration: duplicates
/// are dropped, `light` is exclusive, and at most one profile per
/// dimension. Returns the deduplicated set.
pub fn check_profile_combination(
    requested: &[ProfileName],
) -> Result<BTreeSet<ProfileName>, ProfileRequestError> {
    let flags: Vec<ProfileFlag> = requested.iter().map(|p| p.to_wire()).collect();
    let name = |f: ProfileFlag| ProfileName::from_wire(f).unwrap_or(ProfileName::Light);
    match check_profile_set(&flags) {
        Ok(set) => Ok(set.into_iter().filter_map(ProfileName::from_wire).collect()),
        Err(ProfileSetError::LightNotExclusive(other)) => {
            Err(ProfileRequestError::LightNotExclusive(name(other)))
        }
        Err(ProfileSetError::SameDimension(a, b)) => {
            Err(ProfileRequestError::SameDimension(name(a), name(b)))
        }
        // `ProfileName` has no unspecified value, so this cannot be reached.
        Err(ProfileSetError::Unspecified) => Ok(BTreeSet::new()),
    }
}

impl ProfilesConfig {
    /// A configured profile (enabled or not).
    pub fn get(&self, name: ProfileName) -> Option<&ResourceProfile> {
        self.profiles.get(&name)
    }

    /// The enabled profiles, advertised to the server.
    pub fn advertised(&self) -> Vec<ProfileName> {
        self.profiles
            .values()
            .filter(|p| p.enabled)
            .map(|p| p.name)
            .collect()
    }

    /// Every configured profile, in order.
    pub fn all(&self) -> impl Iterator<Item = &ResourceProfile> {
        self.profiles.values()
    }

    /// Validates a request's profile flags: the combination rules, then each
    /// profile must be configured and enabled here. Returns the policies to
    /// apply, deduplicated and in order.
    pub fn validate_request(
        &self,
        requested: &[ProfileName],
    ) -> Result<Vec<&ResourceProfile>, ProfileRequestError> {
        let set = check_profile_combination(requested)?;
        let mut out = Vec::with_capacity(set.len());
        for name in set {
            match self.profiles.get(&name) {
                Some(p) if p.enabled => out.push(p),
                _ => return Err(ProfileRequestError::NotConfigured(name)),
            }
        }
        Ok(out)
    }
}

/// Largest device major number (12 bits in `dev_t` encoding on Linux).
const MAX_DEVICE_MAJOR: u64 = (1 << 12) - 1;
/// Largest device minor number (20 bits).
const MAX_DEVICE_MINOR: u64 = (1 << 20) - 1;

/// Parses a canonical `major:minor` device key: decimal, no sign, no
/// leading zeros, no spaces, within Linux's ranges.
pub fn parse_device_key(text: &str) -> Result<(u32, u32), String> {
    let Some((major, minor)) = text.split_once(':') else {
        return Err(format!(
            "device {text:?} must be written MAJOR:MINOR, e.g. \"8:0\""
        ));
    };
    let part = |s: &str, max: u64, what: &str| -> Result<u32, String> {
        let canonical = !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'));
        if !canonical {
            return Err(format!(
                "device {text:?} is not canonical: {what} must be a decimal number without sign or leading zeros"
            ));
        }
        let n: u64 = s
            .parse()
            .map_err(|_| format!("device {text:?}: {what} is out of range"))?;
        if n > max {
            return Err(format!("device {text:?}: {what} {n} exceeds {max}"));
        }
        u32::try_from(n).map_err(|_| format!("device {text:?}: {what} is out of range"))
    };
    Ok((
        part(major, MAX_DEVICE_MAJOR, "major")?,
        part(minor, MAX_DEVICE_MINOR, "minor")?,
    ))
}

fn num(values: &BTreeMap<&'static str, Entry>, key: &str) -> Option<u64> {
    match values.get(key).map(|e| &e.value) {
        Some(Value::Num(n)) => Some(*n),
        _ => None,
    }
}

fn origin_of(values: &BTreeMap<&'static str, Entry>, key: &str, fallback: &Origin) -> Origin {
    values
        .get(key)
        .map_or_else(|| fallback.clone(), |e| e.origin.clone())
}

/// Validates the decoded profiles.
pub(crate) fn build_profiles(raw: &[RawProfile], errors: &mut ConfigErrors) -> ProfilesConfig {
    let mut profiles = BTreeMap::new();
    for rp in raw {
        let base = format!("profiles.{}", rp.name);
        let err = |errors: &mut ConfigErrors, key: &str, origin: Origin, msg: String| {
            let path = if key.is_empty() {
                base.clone()
            } else {
                format!("{base}.{key}")
            };
            errors.push(ConfigError::new(path, origin, msg));
        };
        let enabled = !matches!(
            rp.values.get("enabled").map(|e| &e.value),
            Some(Value::Bool(false))
        );
        let mut required = BTreeSet::new();
        let req_origin = origin_of(&rp.values, "required_controls", &rp.origin);
        if let Some(Value::List(items)) = rp.values.get("required_controls").map(|e| &e.value) {
            for item in items {
                match Control::parse(item) {
                    Some(c) => {
                        if !required.insert(c) {
                            err(
                                errors,
                                "required_controls",
                                req_origin.clone(),
                                format!("{item} is listed twice"),
                            );
                        }
                    }
                    None => {
                        let known: Vec<&str> = Control::ALL.iter().map(|c| c.as_str()).collect();
                        err(
                            errors,
                            "required_controls",
                            req_origin.clone(),
                            format!(
                                "unknown control {item:?}; expected one of: {}",
                                known.join(", ")
                            ),
                        );
                    }
                }
            }
        }
        let quota = num(&rp.values, "cpu_quota_us");
        let period = num(&rp.values, "cpu_period_us");
        let cpu_max = match (quota, period) {
            (Some(q), Some(p)) => Some(CpuMax {
                quota_us: q,
                period_us: p,
            }),
            (None, None) => None,
            (Some(_), None) => {
                err(
                    errors,
                    "cpu_period_us",
                    origin_of(&rp.values, "cpu_quota_us", &rp.origin),
                    "cpu_quota_us needs cpu_period_us (cpu.max is quota per period)".to_owned(),
                );
                None
            }
            (None, Some(_)) => {
                err(
                    errors,
                    "cpu_quota_us",
                    origin_of(&rp.values, "cpu_period_us", &rp.origin),
                    "cpu_period_us needs cpu_quota_us (cpu.max is quota per period)".to_owned(),
                );
                None
            }
        };
        let memory_max = num(&rp.values, "memory_max");
        let memory_high = num(&rp.values, "memory_high");
        if let (Some(high), Some(max)) = (memory_high, memory_max)
            && high > max
        {
            err(
                errors,
                "memory_high",
                origin_of(&rp.values, "memory_high", &rp.origin),
                format!(
                    "memory_high ({}) must not exceed memory_max ({})",
                    describe_bytes(high),
                    describe_bytes(max)
                ),
            );
        }
        let mut io = Vec::new();
        let mut devices = BTreeSet::new();
        for rule in &rp.io {
            let dkey = format!("io.\"{}\"", rule.device);
            let (major, minor) = match parse_device_key(&rule.device) {
                Ok(d) => d,
                Err(msg) => {
                    err(errors, &dkey, rule.origin.clone(), msg);
                    continue;
                }
            };
            if !devices.insert((major, minor)) {
                err(
                    errors,
                    &dkey,
                    rule.origin.clone(),
                    "device listed twice".to_owned(),
                );
                continue;
            }
            let r = IoRule {
                major,
                minor,
                read_bps: num(&rule.values, "read_bps"),
                write_bps: num(&rule.values, "write_bps"),
                read_iops: num(&rule.values, "read_iops"),
                write_iops: num(&rule.values, "write_iops"),
            };
            if r.read_bps.is_none()
                && r.write_bps.is_none()
                && r.read_iops.is_none()
                && r.write_iops.is_none()
            {
                err(errors, &dkey, rule.origin.clone(),
                    "a device rule needs at least one of read_bps, write_bps, read_iops, write_iops".to_owned());
                continue;
            }
            io.push(r);
        }
        io.sort_by_key(|r| (r.major, r.minor));
        let profile = ResourceProfile {
            name: rp.name,
            enabled,
            required,
            cpu_max,
            cpu_weight: num(&rp.values, "cpu_weight"),
            memory_max,
            memory_high,
            pids_max: num(&rp.values, "pids_max"),
            io,
        };
        let configured = profile.configured_controls();
        for control in &configured {
            if !control.allowed_in(rp.name.dimension()) {
                err(
                    errors,
                    "",
                    rp.origin.clone(),
                    format!("control {control} does not belong to a {} profile", rp.name),
                );
            }
        }
        if enabled {
            if profile.required.is_empty() {
                err(
                    errors,
                    "required_controls",
                    req_origin.clone(),
                    "an enabled profile must list at least one required control".to_owned(),
                );
            }
            for control in &profile.required {
                if !configured.contains(control) {
                    err(
                        errors,
                        "required_controls",
                        req_origin.clone(),
                        format!("required control {control} has no nonzero value in this profile"),
                    );
                }
            }
        }
        profiles.insert(rp.name, profile);
    }
    ProfilesConfig { profiles }
}
