//! Boundary validation of what protobuf cannot express (plan §4.1).
//!
//! One validator for every transport: the gRPC service, the JSON-RPC adapter
//! and the agent protocol call these same functions, so a field limit can
//! never differ between them. Every error names the offending field.

use prost::Message as _;
use rvbox_proto::v1 as wire;
use sha2::{Digest, Sha256};

use crate::error::{Code, DomainError};
use crate::hash::normalize_spec;
use crate::ids::{ClientId, Uuid7};
use crate::limits::{
    DAY_MS, MAX_ENV_OVERRIDES, MAX_EXECUTION_SPEC_BYTES, MAX_REASON_BYTES, MAX_SCRIPT_BYTES,
};

/// Longest working-directory text.
pub const MAX_CWD_BYTES: usize = 4096;
/// Longest environment key.
pub const MAX_ENV_KEY_BYTES: usize = 256;
/// Longest script display name.
pub const MAX_SCRIPT_NAME_BYTES: usize = 255;
/// Longest queue-TTL override (365 days).
pub const MAX_QUEUE_TTL_MS: u64 = 365 * DAY_MS;

fn invalid(field: &str, reason: impl AsRef<str>) -> DomainError {
    DomainError::new(Code::InvalidArgument, reason).with_field(field)
}

fn as_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Checks a free-text reason or note: at most 4 KiB.
///
/// # Errors
/// `TOO_LARGE` naming `field`.
pub fn check_text(field: &str, text: &str, max: u64) -> Result<(), DomainError> {
    if as_u64(text.len()) > max {
        return Err(DomainError::new(
            Code::TooLarge,
            format!("{} bytes exceeds the limit of {max} bytes", text.len()),
        )
        .with_field(field));
    }
    Ok(())
}

/// The resource dimension of a profile: at most one profile per dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProfileDimension {
    /// `LIGHT`: exclusive with every other flag.
    Light,
    /// `CPU_*`.
    Cpu,
    /// `MEM_*`.
    Memory,
    /// `DISK_*`.
    Disk,
}

/// The dimension of a profile flag; `None` for `UNSPECIFIED`.
#[must_use]
pub fn flag_dimension(flag: wire::ProfileFlag) -> Option<ProfileDimension> {
    use wire::ProfileFlag as F;
    match flag {
        F::Unspecified => None,
        F::Light => Some(ProfileDimension::Light),
        F::CpuLow | F::CpuMedium | F::CpuHigh => Some(ProfileDimension::Cpu),
        F::MemLow | F::MemMedium | F::MemHigh => Some(ProfileDimension::Memory),
        F::DiskLow | F::DiskMedium | F::DiskHigh => Some(ProfileDimension::Disk),
    }
}

/// A refused profile combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProfileSetError {
    /// `UNSPECIFIED` was requested.
    #[error("profile flag UNSPECIFIED is not a profile")]
    Unspecified,
    /// `LIGHT` was combined with another profile.
    #[error("profile LIGHT is exclusive and cannot be combined with {}", .0.as_str_name())]
    LightNotExclusive(wire::ProfileFlag),
    /// Two profiles of one dimension.
    #[error(
        "profiles {} and {} are of the same dimension; at most one CPU, one MEM and one DISK profile",
        .0.as_str_name(),
        .1.as_str_name()
    )]
    SameDimension(wire::ProfileFlag, wire::ProfileFlag),
}

/// The one profile-combination rule (plan §4.1, §4.3 item 7, §7.5):
/// duplicates are dropped, `LIGHT` is exclusive, otherwise at most one CPU,
/// one memory and one disk profile. Returns the set sorted by wire value.
/// Whether each profile is configured on a client is checked there.
///
/// # Errors
/// [`ProfileSetError`] naming the profiles in conflict.
pub fn check_profile_set(
    flags: &[wire::ProfileFlag],
) -> Result<Vec<wire::ProfileFlag>, ProfileSetError> {
    let mut set = flags.to_vec();
    set.sort_unstable();
    set.dedup();
    if set.contains(&wire::ProfileFlag::Light)
        && let Some(other) = set.iter().find(|f| **f != wire::ProfileFlag::Light)
    {
        return Err(ProfileSetError::LightNotExclusive(*other));
    }
    let mut seen: Vec<(ProfileDimension, wire::ProfileFlag)> = Vec::with_capacity(set.len());
    for flag in &set {
        let dim = flag_dimension(*flag).ok_or(ProfileSetError::Unspecified)?;
        if let Some((_, first)) = seen.iter().find(|(d, _)| *d == dim) {
            return Err(ProfileSetError::SameDimension(*first, *flag));
        }
        seen.push((dim, *flag));
    }
    Ok(set)
}

/// [`check_profile_set`] on raw wire values, as a request carries them.
///
/// # Errors
/// `INVALID_ARGUMENT` on `spec.profile_flags` saying which rule failed.
pub fn check_profile_flags(flags: &[i32]) -> Result<Vec<i32>, DomainError> {
    check_profile_flags_of("spec.profile_flags", flags)
}

/// [`check_profile_flags`] for the flags of the request field `field`
/// (a terminal's `profile_flags`): the same rules, the set returned
/// deduplicated and sorted by wire value.
///
/// # Errors
/// `INVALID_ARGUMENT` on `field` saying which rule failed.
pub fn check_profile_flags_of(field: &str, flags: &[i32]) -> Result<Vec<i32>, DomainError> {
    let mut typed = Vec::with_capacity(flags.len());
    for flag in flags {
        match wire::ProfileFlag::try_from(*flag) {
            Ok(f) => typed.push(f),
            Err(_) => return Err(invalid(field, format!("unknown profile flag value {flag}"))),
        }
    }
    let set = check_profile_set(&typed).map_err(|e| invalid(field, e.to_string()))?;
    Ok(set.into_iter().map(|f| f as i32).collect())
}

fn check_script_descriptor(d: &wire::ScriptDescriptor) -> Result<(), DomainError> {
    let name = &d.display_basename;
    if name.is_empty() || name.len() > MAX_SCRIPT_NAME_BYTES {
        return Err(invalid(
            "spec.script.display_basename",
            format!("must be 1..={MAX_SCRIPT_NAME_BYTES} bytes"),
        ));
    }
    if name == "." || name == ".." || name.contains(['/', '\\', '\0']) {
        return Err(invalid(
            "spec.script.display_basename",
            "must be a plain file name (no '/', '\\', NUL, '.' or '..'); it is shown, never used as a path",
        ));
    }
    if d.size_bytes == 0 || d.size_bytes > MAX_SCRIPT_BYTES {
        return Err(DomainError::new(
            if d.size_bytes == 0 {
                Code::InvalidArgument
            } else {
                Code::TooLarge
            },
            format!(
                "script size {} must be 1..={MAX_SCRIPT_BYTES} bytes",
                d.size_bytes
            ),
        )
        .with_field("spec.script.size_bytes"));
    }
    if d.sha256.len() != 32 {
        return Err(invalid(
            "spec.script.sha256",
            format!("must be 32 bytes, got {}", d.sha256.len()),
        ));
    }
    Ok(())
}

/// Validates an `ExecutionSpec` and returns it normalized (profile flags
/// sorted and deduplicated), ready for hashing and storage.
///
/// # Errors
/// A [`DomainError`] naming the first offending field.
pub fn check_execution_spec(
    spec: &wire::ExecutionSpec,
) -> Result<wire::ExecutionSpec, DomainError> {
    let encoded = as_u64(spec.encoded_len());
    if encoded > MAX_EXECUTION_SPEC_BYTES {
        return Err(DomainError::new(
            Code::TooLarge,
            format!("serialized spec is {encoded} bytes; the limit is {MAX_EXECUTION_SPEC_BYTES}"),
        )
        .with_field("spec"));
    }
    match &spec.source {
        None => {
            return Err(invalid(
                "spec.source",
                "exactly one of command_text or script must be set",
            ));
        }
        Some(wire::execution_spec::Source::CommandText(text)) => {
            if text.is_empty() {
                return Err(invalid("spec.command_text", "is empty"));
            }
            if text.contains('\0') {
                return Err(invalid("spec.command_text", "contains a NUL byte"));
            }
        }
        Some(wire::execution_spec::Source::Script(d)) => check_script_descriptor(d)?,
    }
    match wire::ShellType::try_from(spec.shell_type) {
        Ok(_) => {}
        Err(_) => {
            return Err(invalid(
                "spec.shell_type",
                format!("unknown shell type value {}", spec.shell_type),
            ));
        }
    }
    if !spec.cwd.is_empty() {
        if spec.cwd.len() > MAX_CWD_BYTES {
            return Err(DomainError::new(
                Code::TooLarge,
                format!("is longer than {MAX_CWD_BYTES} bytes"),
            )
            .with_field("spec.cwd"));
        }
        if !spec.cwd.starts_with('/') || spec.cwd.contains('\0') {
            return Err(invalid(
                "spec.cwd",
                "must be an absolute path without NUL bytes (or empty for the client's default)",
            ));
        }
    }
    if spec.env.len() > MAX_ENV_OVERRIDES {
        return Err(DomainError::new(
            Code::TooLarge,
            format!(
                "{} environment overrides; the limit is {MAX_ENV_OVERRIDES}",
                spec.env.len()
            ),
        )
        .with_field("spec.env"));
    }
    for (key, value) in &spec.env {
        if key.is_empty() || key.len() > MAX_ENV_KEY_BYTES || key.contains(['=', '\0']) {
            return Err(invalid(
                "spec.env",
                format!(
                    "environment key {key:?} must be 1..={MAX_ENV_KEY_BYTES} bytes without '=' or NUL"
                ),
            ));
        }
        if value.contains('\0') {
            // the value itself is never echoed: it may be a secret
            return Err(invalid(
                "spec.env",
                format!("the value of environment key {key:?} contains a NUL byte"),
            ));
        }
    }
    check_profile_flags(&spec.profile_flags)?;
    Ok(normalize_spec(spec))
}

/// A validated `RunCommand` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRunCommand {
    /// The issue id (the request id).
    pub issue_uuid: Uuid7,
    /// Target client.
    pub client_id: ClientId,
    /// Normalized spec.
    pub spec: wire::ExecutionSpec,
    /// Queue TTL override in ms: `None` = configured default, `Some(0)` = indefinite.
    pub queue_ttl_ms: Option<u64>,
}

/// Validates a `RunCommand` request: ids, spec, script payload against its
/// descriptor, and the queue-TTL override.
///
/// # Errors
/// A [`DomainError`] naming the first offending field.
pub fn check_run_command(req: &wire::RunCommandRequest) -> Result<ValidRunCommand, DomainError> {
    let issue_uuid = Uuid7::parse("request_id", &req.request_id)?;
    let client_id = ClientId::parse("client_id", &req.client_id)?;
    let spec = req
        .spec
        .as_ref()
        .ok_or_else(|| invalid("spec", "is required"))?;
    let spec = check_execution_spec(spec)?;
    match &spec.source {
        Some(wire::execution_spec::Source::Script(d)) => check_script_payload(d, &req.script)?,
        _ if !req.script.is_empty() => {
            return Err(invalid(
                "script",
                "script bytes were given but spec.source is command_text",
            ));
        }
        _ => {}
    }
    let queue_ttl_ms = match &req.queue_ttl {
        None => None,
        Some(d) => Some(duration_ms("queue_ttl", d, MAX_QUEUE_TTL_MS)?),
    };
    Ok(ValidRunCommand {
        issue_uuid,
        client_id,
        spec,
        queue_ttl_ms,
    })
}

/// Checks script bytes against their descriptor: exact length, then SHA-256.
///
/// # Errors
/// `TOO_LARGE` or `INVALID_ARGUMENT` on `script`.
pub fn check_script_payload(d: &wire::ScriptDescriptor, bytes: &[u8]) -> Result<(), DomainError> {
    let len = as_u64(bytes.len());
    if len > MAX_SCRIPT_BYTES {
        return Err(DomainError::new(
            Code::TooLarge,
            format!("{len} bytes exceeds the limit of {MAX_SCRIPT_BYTES}"),
        )
        .with_field("script"));
    }
    if len != d.size_bytes {
        return Err(invalid(
            "script",
            format!("is {len} bytes but the descriptor says {}", d.size_bytes),
        ));
    }
    if Sha256::digest(bytes).as_slice() != d.sha256.as_slice() {
        return Err(invalid(
            "script",
            "SHA-256 of the bytes does not match the descriptor",
        ));
    }
    Ok(())
}

/// Converts a protobuf `Duration` to milliseconds: non-negative, nanos in
/// range, at most `max_ms`.
///
/// # Errors
/// `INVALID_ARGUMENT` naming `field`.
pub fn duration_ms(
    field: &str,
    d: &prost_types::Duration,
    max_ms: u64,
) -> Result<u64, DomainError> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return Err(invalid(field, "must be a non-negative duration"));
    }
    let secs = u64::try_from(d.seconds).map_err(|_| invalid(field, "is negative"))?;
    let nanos = u64::try_from(d.nanos).map_err(|_| invalid(field, "is negative"))?;
    let ms = secs
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(nanos / 1_000_000))
        .filter(|ms| *ms <= max_ms)
        .ok_or_else(|| invalid(field, format!("must be at most {max_ms} ms")))?;
    Ok(ms)
}

/// Checks an operator's incident acknowledgement note: 1 byte to 4 KiB.
///
/// # Errors
/// `INVALID_ARGUMENT` (empty) or `TOO_LARGE` on `note`.
pub fn check_incident_note(note: &str) -> Result<(), DomainError> {
    if note.trim().is_empty() {
        return Err(invalid(
            "note",
            "an acknowledgement needs a note saying why the loss is accepted",
        ));
    }
    check_text("note", note, MAX_REASON_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::ProfileFlag as F;
    use wire::execution_spec::Source;

    fn spec() -> wire::ExecutionSpec {
        wire::ExecutionSpec {
            source: Some(Source::CommandText("uptime".into())),
            shell_type: wire::ShellType::Unspecified as i32,
            cwd: String::new(),
            env: Default::default(),
            profile_flags: vec![],
        }
    }

    fn field_of(r: Result<impl std::fmt::Debug, DomainError>) -> String {
        r.unwrap_err().field().to_owned()
    }

    #[test]
    fn profile_rules() {
        let ok = |f: &[F]| check_profile_flags(&f.iter().map(|x| *x as i32).collect::<Vec<_>>());
        assert_eq!(ok(&[]).unwrap(), Vec::<i32>::new());
        assert_eq!(ok(&[F::Light, F::Light]).unwrap(), vec![F::Light as i32]);
        assert_eq!(
            ok(&[F::DiskLow, F::CpuHigh, F::MemLow]).unwrap(),
            vec![F::CpuHigh as i32, F::MemLow as i32, F::DiskLow as i32]
        );
        assert_eq!(
            check_profile_set(&[F::CpuLow, F::Light]),
            Err(ProfileSetError::LightNotExclusive(F::CpuLow))
        );
        assert_eq!(
            check_profile_set(&[F::CpuHigh, F::MemLow, F::CpuLow]),
            Err(ProfileSetError::SameDimension(F::CpuLow, F::CpuHigh))
        );
        assert!(ok(&[F::Light, F::CpuLow]).is_err());
        assert!(ok(&[F::CpuLow, F::CpuHigh]).is_err());
        assert!(ok(&[F::MemLow, F::MemMedium]).is_err());
        assert!(ok(&[F::DiskLow, F::DiskHigh]).is_err());
        assert!(ok(&[F::Unspecified]).is_err());
        assert!(check_profile_flags(&[99]).is_err());
        assert_eq!(
            check_profile_flags(&[0]).unwrap_err().field(),
            "spec.profile_flags"
        );
        let e = check_profile_flags_of("profile_flags", &[99]).unwrap_err();
        assert_eq!(e.field(), "profile_flags");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert_eq!(
            check_profile_flags_of(
                "profile_flags",
                &[F::MemLow as i32, F::CpuLow as i32, F::MemLow as i32]
            )
            .unwrap(),
            vec![F::CpuLow as i32, F::MemLow as i32]
        );
    }

    #[test]
    fn exactly_one_source() {
        let mut s = spec();
        s.source = None;
        assert_eq!(field_of(check_execution_spec(&s)), "spec.source");
        s.source = Some(Source::CommandText(String::new()));
        assert_eq!(field_of(check_execution_spec(&s)), "spec.command_text");
        assert!(check_execution_spec(&spec()).is_ok());
    }

    #[test]
    fn script_descriptor_rules() {
        let d = |name: &str, size: u64, sha: usize| wire::ScriptDescriptor {
            display_basename: name.into(),
            size_bytes: size,
            sha256: vec![0; sha],
        };
        let mut s = spec();
        for (desc, field) in [
            (d("", 1, 32), "spec.script.display_basename"),
            (d("../x", 1, 32), "spec.script.display_basename"),
            (d("a\\b", 1, 32), "spec.script.display_basename"),
            (d("..", 1, 32), "spec.script.display_basename"),
            (d(&"n".repeat(256), 1, 32), "spec.script.display_basename"),
            (d("x.sh", 0, 32), "spec.script.size_bytes"),
            (
                d("x.sh", MAX_SCRIPT_BYTES + 1, 32),
                "spec.script.size_bytes",
            ),
            (d("x.sh", 1, 31), "spec.script.sha256"),
        ] {
            s.source = Some(Source::Script(desc));
            assert_eq!(field_of(check_execution_spec(&s)), field);
        }
        s.source = Some(Source::Script(d("deploy.sh", MAX_SCRIPT_BYTES, 32)));
        assert!(check_execution_spec(&s).is_ok());
    }

    #[test]
    fn cwd_env_and_shell() {
        let mut s = spec();
        s.cwd = "relative/dir".into();
        assert_eq!(field_of(check_execution_spec(&s)), "spec.cwd");
        s.cwd = format!("/{}", "d".repeat(MAX_CWD_BYTES));
        assert_eq!(check_execution_spec(&s).unwrap_err().code(), Code::TooLarge);
        let mut s = spec();
        s.env.insert("A=B".into(), "x".into());
        assert_eq!(field_of(check_execution_spec(&s)), "spec.env");
        let mut s = spec();
        s.env.insert("SECRET".into(), "p\0w".into());
        let e = check_execution_spec(&s).unwrap_err();
        assert!(!e.reason().contains("p\0w"));
        let mut s = spec();
        for i in 0..=MAX_ENV_OVERRIDES {
            s.env.insert(format!("K{i}"), String::new());
        }
        assert_eq!(field_of(check_execution_spec(&s)), "spec.env");
        let mut s = spec();
        s.shell_type = 42;
        assert_eq!(field_of(check_execution_spec(&s)), "spec.shell_type");
    }

    #[test]
    fn spec_size_ceiling() {
        let mut s = spec();
        s.source = Some(Source::CommandText(
            "x".repeat(usize::try_from(MAX_EXECUTION_SPEC_BYTES).unwrap()),
        ));
        let e = check_execution_spec(&s).unwrap_err();
        assert_eq!((e.code(), e.field()), (Code::TooLarge, "spec"));
    }

    fn run(script: Vec<u8>, spec: wire::ExecutionSpec) -> wire::RunCommandRequest {
        wire::RunCommandRequest {
            request_id: "01890a5d-ac96-774b-bcce-b302099a8057".into(),
            client_id: "web-1".into(),
            spec: Some(spec),
            script,
            queue_ttl: None,
        }
    }

    #[test]
    fn run_command_checks_script_bytes_and_ttl() {
        let body = b"#!/bin/sh\necho hi\n".to_vec();
        let mut s = spec();
        s.source = Some(Source::Script(wire::ScriptDescriptor {
            display_basename: "hi.sh".into(),
            size_bytes: body.len() as u64,
            sha256: Sha256::digest(&body).to_vec(),
        }));
        assert!(check_run_command(&run(body.clone(), s.clone())).is_ok());
        let mut tampered = body.clone();
        tampered[0] = b'X';
        assert_eq!(
            field_of(check_run_command(&run(tampered, s.clone()))),
            "script"
        );
        assert_eq!(field_of(check_run_command(&run(vec![1], s))), "script");
        assert_eq!(field_of(check_run_command(&run(vec![1], spec()))), "script");

        let mut r = run(vec![], spec());
        r.request_id = "01890A5D-AC96-774B-BCCE-B302099A8057".into();
        assert_eq!(field_of(check_run_command(&r)), "request_id");
        let mut r = run(vec![], spec());
        r.client_id = String::new();
        assert_eq!(field_of(check_run_command(&r)), "client_id");
        let mut r = run(vec![], spec());
        r.queue_ttl = Some(prost_types::Duration {
            seconds: -1,
            nanos: 0,
        });
        assert_eq!(field_of(check_run_command(&r)), "queue_ttl");
        r.queue_ttl = Some(prost_types::Duration {
            seconds: 0,
            nanos: 0,
        });
        assert_eq!(check_run_command(&r).unwrap().queue_ttl_ms, Some(0));
        r.queue_ttl = Some(prost_types::Duration {
            seconds: 90,
            nanos: 500_000_000,
        });
        assert_eq!(check_run_command(&r).unwrap().queue_ttl_ms, Some(90_500));
        r.queue_ttl = Some(prost_types::Duration {
            seconds: i64::MAX,
            nanos: 0,
        });
        assert_eq!(field_of(check_run_command(&r)), "queue_ttl");
        r.spec = None;
        assert_eq!(field_of(check_run_command(&r)), "spec");
    }

    #[test]
    fn notes() {
        assert!(check_incident_note("disk replaced; loss accepted").is_ok());
        assert_eq!(field_of(check_incident_note("  ")), "note");
        assert_eq!(
            check_incident_note(&"n".repeat(4097)).unwrap_err().code(),
            Code::TooLarge
        );
        assert!(check_incident_note(&"n".repeat(4096)).is_ok());
    }
}
