//! `ClientHello` validation and version choice (plan §6.2, R-6.2-01/02).
//!
//! Every bound below is the one documented on the field in `agent.proto` /
//! `common.proto`; the error names the offending field as a dotted path so
//! the `ControlError` sent before the `HELLO_REJECTED` close points at it.

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::{ClientId, IdError, InstanceId};
use rvbox_domain::validate::MAX_CWD_BYTES;
use rvbox_proto::v1 as wire;
use thiserror::Error;

/// The only protocol major this server speaks.
pub const PROTOCOL_MAJOR: u32 = 1;
/// Minors of major 1 this build speaks, ascending (v1.0 only so far).
pub const V1_SUPPORTED_MINORS: &[u32] = &[0];
/// Most entries in `ClientHello.supported_minors` (agent.proto: 1..=16).
pub const MAX_SUPPORTED_MINORS: usize = 16;
/// Smallest `Capabilities.max_running`.
pub const MIN_MAX_RUNNING: u32 = 1;
/// Largest `Capabilities.max_running`.
pub const MAX_MAX_RUNNING: u32 = 1024;
/// Largest `Capabilities.max_queued` (0 is allowed).
pub const MAX_MAX_QUEUED: u32 = 10_000;
/// Fewest validated shells a client may report.
pub const MIN_SHELLS: usize = 1;
/// Most validated shells a client may report.
pub const MAX_SHELLS: usize = 4;
/// Most profiles a client may report.
pub const MAX_PROFILES: usize = 10;
/// Longest `Capabilities.software_version`.
pub const MAX_SOFTWARE_VERSION_BYTES: usize = 64;
/// Longest `Platform.os` and `Platform.arch`.
pub const MAX_PLATFORM_NAME_BYTES: usize = 32;
/// Longest `Platform.os_release`.
pub const MAX_OS_RELEASE_BYTES: usize = 128;
/// Most `CwdPolicy.allowed_roots` entries.
pub const MAX_ALLOWED_ROOTS: usize = 64;

/// Why a hello was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HelloError {
    /// The client id or instance id is malformed.
    #[error(transparent)]
    Id(#[from] IdError),
    /// `protocol_major` is not 1.
    #[error(
        "client_hello.protocol_major {got} is not supported; this server speaks major {PROTOCOL_MAJOR}"
    )]
    UnsupportedMajor {
        /// Major the client asked for.
        got: u32,
    },
    /// No minor is supported by both sides.
    #[error(
        "client_hello.supported_minors {client:?} shares no minor with this server's {server:?}"
    )]
    NoSharedMinor {
        /// Minors the client offered.
        client: Vec<u32>,
        /// Minors this server speaks.
        server: Vec<u32>,
    },
    /// A field is missing or outside its documented bounds.
    #[error("{field}: {reason}")]
    Invalid {
        /// Dotted name of the field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl HelloError {
    /// The dotted name of the offending field.
    #[must_use]
    pub fn field(&self) -> &'static str {
        match self {
            Self::Id(e) => e.field(),
            Self::UnsupportedMajor { .. } => "client_hello.protocol_major",
            Self::NoSharedMinor { .. } => "client_hello.supported_minors",
            Self::Invalid { field, .. } => field,
        }
    }

    /// The stable code: `VERSION_MISMATCH` for version problems,
    /// `INVALID_ARGUMENT` otherwise.
    #[must_use]
    pub fn code(&self) -> Code {
        match self {
            Self::UnsupportedMajor { .. } | Self::NoSharedMinor { .. } => Code::VersionMismatch,
            Self::Id(_) | Self::Invalid { .. } => Code::InvalidArgument,
        }
    }

    /// The domain error carried by the `ControlError` before the close.
    #[must_use]
    pub fn to_domain(&self) -> DomainError {
        DomainError::new(self.code(), self.to_string()).with_field(self.field())
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> HelloError {
    HelloError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// A hello that passed every check, with the negotiated minor.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidHello {
    /// The client id (display and routing identity, not authentication).
    pub client_id: ClientId,
    /// The durable random instance id of the client installation.
    pub instance: InstanceId,
    /// Highest minor of major 1 both sides speak.
    pub negotiated_minor: u32,
    /// Validated capabilities.
    pub capabilities: wire::Capabilities,
    /// Validated working-directory policy.
    pub cwd_policy: wire::CwdPolicy,
    /// Validated labels.
    pub labels: rvbox_domain::labels::Labels,
}

/// The highest minor present in both lists, if any (plan §6.2: "choose the
/// highest shared minor under major v1").
#[must_use]
pub fn negotiate_minor(client: &[u32], server: &[u32]) -> Option<u32> {
    client.iter().copied().filter(|m| server.contains(m)).max()
}

/// Validates a hello against this server's supported minors of major 1.
///
/// Version problems are checked first, so a client of another major gets
/// `VERSION_MISMATCH` rather than a complaint about a field it encodes
/// differently.
///
/// # Errors
/// [`HelloError`] naming the first offending field.
pub fn validate_hello(
    hello: wire::ClientHello,
    server_minors: &[u32],
) -> Result<ValidHello, HelloError> {
    if hello.protocol_major != PROTOCOL_MAJOR {
        return Err(HelloError::UnsupportedMajor {
            got: hello.protocol_major,
        });
    }
    check_minors(&hello.supported_minors)?;
    let negotiated_minor =
        negotiate_minor(&hello.supported_minors, server_minors).ok_or_else(|| {
            HelloError::NoSharedMinor {
                client: hello.supported_minors.clone(),
                server: server_minors.to_vec(),
            }
        })?;
    let client_id = ClientId::parse("client_hello.client_id", &hello.client_id)?;
    let instance = InstanceId::parse("client_hello.client_instance_id", &hello.client_instance_id)?;
    let capabilities = hello
        .capabilities
        .ok_or_else(|| invalid("client_hello.capabilities", "is required"))?;
    check_capabilities(&capabilities)?;
    let cwd_policy = hello
        .cwd_policy
        .ok_or_else(|| invalid("client_hello.cwd_policy", "is required"))?;
    check_cwd_policy(&cwd_policy)?;
    let labels = rvbox_domain::labels::Labels::from_wire(&hello.labels)
        .map_err(|e| invalid("client_hello.labels", e.0))?;
    if hello
        .labels
        .windows(2)
        .any(|w| matches!(w, [a, b] if a.key >= b.key))
    {
        return Err(invalid("client_hello.labels", "must be sorted by key"));
    }
    Ok(ValidHello {
        client_id,
        instance,
        negotiated_minor,
        capabilities,
        cwd_policy,
        labels,
    })
}

fn check_minors(minors: &[u32]) -> Result<(), HelloError> {
    const FIELD: &str = "client_hello.supported_minors";
    if minors.is_empty() {
        return Err(invalid(FIELD, "must list at least one minor"));
    }
    if minors.len() > MAX_SUPPORTED_MINORS {
        return Err(invalid(
            FIELD,
            format!(
                "lists {} minors; the limit is {MAX_SUPPORTED_MINORS}",
                minors.len()
            ),
        ));
    }
    // agent.proto: distinct values, sorted ascending.
    if minors.windows(2).any(|w| matches!(w, [a, b] if a >= b)) {
        return Err(invalid(FIELD, "must be distinct and sorted ascending"));
    }
    Ok(())
}

fn check_len(field: &'static str, text: &str, max: usize) -> Result<(), HelloError> {
    if text.len() > max {
        return Err(invalid(
            field,
            format!("is {} bytes; the limit is {max}", text.len()),
        ));
    }
    Ok(())
}

fn check_capabilities(c: &wire::Capabilities) -> Result<(), HelloError> {
    let platform = c
        .platform
        .as_ref()
        .ok_or_else(|| invalid("client_hello.capabilities.platform", "is required"))?;
    if platform.os.is_empty() {
        return Err(invalid(
            "client_hello.capabilities.platform.os",
            "is required",
        ));
    }
    check_len(
        "client_hello.capabilities.platform.os",
        &platform.os,
        MAX_PLATFORM_NAME_BYTES,
    )?;
    if platform.arch.is_empty() {
        return Err(invalid(
            "client_hello.capabilities.platform.arch",
            "is required",
        ));
    }
    check_len(
        "client_hello.capabilities.platform.arch",
        &platform.arch,
        MAX_PLATFORM_NAME_BYTES,
    )?;
    check_len(
        "client_hello.capabilities.platform.os_release",
        &platform.os_release,
        MAX_OS_RELEASE_BYTES,
    )?;
    check_len(
        "client_hello.capabilities.software_version",
        &c.software_version,
        MAX_SOFTWARE_VERSION_BYTES,
    )?;
    check_shells(&c.shells)?;
    check_profiles(&c.profiles)?;
    if !(MIN_MAX_RUNNING..=MAX_MAX_RUNNING).contains(&c.max_running) {
        return Err(invalid(
            "client_hello.capabilities.max_running",
            format!(
                "{} is outside {MIN_MAX_RUNNING}..={MAX_MAX_RUNNING}",
                c.max_running
            ),
        ));
    }
    if c.max_queued > MAX_MAX_QUEUED {
        return Err(invalid(
            "client_hello.capabilities.max_queued",
            format!("{} is outside 0..={MAX_MAX_QUEUED}", c.max_queued),
        ));
    }
    match wire::SupervisionMode::try_from(c.supervision_mode) {
        Ok(wire::SupervisionMode::Unspecified) | Err(_) => Err(invalid(
            "client_hello.capabilities.supervision_mode",
            format!("{} is not a known supervision mode", c.supervision_mode),
        )),
        Ok(_) => Ok(()),
    }
}

fn check_shells(shells: &[wire::ShellCapability]) -> Result<(), HelloError> {
    const FIELD: &str = "client_hello.capabilities.shells";
    if !(MIN_SHELLS..=MAX_SHELLS).contains(&shells.len()) {
        return Err(invalid(
            FIELD,
            format!(
                "lists {} shells; want {MIN_SHELLS}..={MAX_SHELLS}",
                shells.len()
            ),
        ));
    }
    let mut seen: Vec<i32> = Vec::with_capacity(shells.len());
    for s in shells {
        match wire::ShellType::try_from(s.shell_type) {
            Ok(wire::ShellType::Unspecified) | Err(_) => {
                return Err(invalid(
                    FIELD,
                    format!("{} is not a known shell type", s.shell_type),
                ));
            }
            Ok(_) => {}
        }
        if seen.contains(&s.shell_type) {
            return Err(invalid(FIELD, "lists a shell type twice"));
        }
        seen.push(s.shell_type);
    }
    // common.proto: exactly one entry is the platform default.
    let defaults = shells.iter().filter(|s| s.platform_default).count();
    if defaults != 1 {
        return Err(invalid(
            FIELD,
            format!("marks {defaults} shells as the platform default; want exactly 1"),
        ));
    }
    Ok(())
}

fn check_profiles(profiles: &[i32]) -> Result<(), HelloError> {
    const FIELD: &str = "client_hello.capabilities.profiles";
    if profiles.len() > MAX_PROFILES {
        return Err(invalid(
            FIELD,
            format!(
                "lists {} profiles; the limit is {MAX_PROFILES}",
                profiles.len()
            ),
        ));
    }
    for p in profiles {
        match wire::ProfileFlag::try_from(*p) {
            Ok(wire::ProfileFlag::Unspecified) | Err(_) => {
                return Err(invalid(FIELD, format!("{p} is not a known profile")));
            }
            Ok(_) => {}
        }
    }
    if profiles.windows(2).any(|w| matches!(w, [a, b] if a >= b)) {
        return Err(invalid(FIELD, "must be distinct and sorted ascending"));
    }
    Ok(())
}

fn check_absolute(field: &'static str, path: &str) -> Result<(), HelloError> {
    check_len(field, path, MAX_CWD_BYTES)?;
    // Linux is the release target (spec-mapping R-1-04): absolute means '/'.
    if !path.starts_with('/') {
        return Err(invalid(field, "must be an absolute path"));
    }
    if path.contains('\0') {
        return Err(invalid(field, "must not contain NUL"));
    }
    Ok(())
}

fn check_cwd_policy(p: &wire::CwdPolicy) -> Result<(), HelloError> {
    check_absolute("client_hello.cwd_policy.default_cwd", &p.default_cwd)?;
    if p.allowed_roots.len() > MAX_ALLOWED_ROOTS {
        return Err(invalid(
            "client_hello.cwd_policy.allowed_roots",
            format!(
                "lists {} roots; the limit is {MAX_ALLOWED_ROOTS}",
                p.allowed_roots.len()
            ),
        ));
    }
    for root in &p.allowed_roots {
        check_absolute("client_hello.cwd_policy.allowed_roots", root)?;
    }
    Ok(())
}
