//! `ServerWelcome` construction and the per-session limits it announces
//! (plan §6.2, R-6.2-09).

use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::{
    DEFAULT_COMMAND_SEND_WINDOW_BYTES, DEFAULT_HEARTBEAT_IDLE_MS, DEFAULT_LIVENESS_TIMEOUT_MS,
    DEFAULT_SESSION_SEND_WINDOW_BYTES, MAX_ENVELOPE_BYTES, MAX_EXECUTION_SPEC_BYTES,
    MAX_RAW_CHUNK_BYTES, MAX_REASON_BYTES, MAX_SCRIPT_BYTES, MAX_SCRIPT_CHUNK_BYTES, SECOND_MS,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use thiserror::Error;

use crate::hello::{MAX_SOFTWARE_VERSION_BYTES, MAX_SUPPORTED_MINORS, PROTOCOL_MAJOR};
use crate::registration::SessionId;

/// A configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field}: {reason}")]
pub struct ConfigError {
    /// The offending setting.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn config_error(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        reason: reason.into(),
    }
}

/// Who this server is, as announced in every welcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerIdentity {
    /// Stable identity of the server's data directory (UUIDv7).
    pub server_id: Uuid7,
    /// Server software version (semver text); <= 64 bytes.
    pub software_version: String,
    /// Minors of major 1 this server speaks; non-empty, ascending, distinct.
    pub supported_minors: Vec<u32>,
}

impl ServerIdentity {
    /// Checks the bounds.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.software_version.len() > MAX_SOFTWARE_VERSION_BYTES {
            return Err(config_error(
                "software_version",
                format!("longer than {MAX_SOFTWARE_VERSION_BYTES} bytes"),
            ));
        }
        if self.supported_minors.is_empty() || self.supported_minors.len() > MAX_SUPPORTED_MINORS {
            return Err(config_error(
                "supported_minors",
                format!("want 1..={MAX_SUPPORTED_MINORS} minors"),
            ));
        }
        if self
            .supported_minors
            .windows(2)
            .any(|w| matches!(w, [a, b] if a >= b))
        {
            return Err(config_error(
                "supported_minors",
                "must be distinct and ascending",
            ));
        }
        Ok(())
    }
}

/// The limits one session enforces and announces in `AgentLimits`. The
/// configurable ones may be lowered from the v1 ceilings, never raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Inbound silence before a Ping (plan §6.3: 10 s).
    pub heartbeat_idle_ms: u64,
    /// Inbound silence before the close (plan §6.3: 30 s).
    pub liveness_timeout_ms: u64,
    /// Largest binary message accepted (ceiling 1 MiB).
    pub max_envelope_bytes: u64,
    /// Unacknowledged event bytes per command (ceiling 1 MiB).
    pub command_window_bytes: u64,
    /// Unacknowledged event bytes per session (ceiling 8 MiB).
    pub session_window_bytes: u64,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            heartbeat_idle_ms: DEFAULT_HEARTBEAT_IDLE_MS,
            liveness_timeout_ms: DEFAULT_LIVENESS_TIMEOUT_MS,
            max_envelope_bytes: MAX_ENVELOPE_BYTES,
            command_window_bytes: DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            session_window_bytes: DEFAULT_SESSION_SEND_WINDOW_BYTES,
        }
    }
}

impl SessionLimits {
    /// Checks `0 < idle < timeout`, ceilings, and command <= session window.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.heartbeat_idle_ms == 0 || self.heartbeat_idle_ms >= self.liveness_timeout_ms {
            return Err(config_error(
                "heartbeat_idle_ms",
                "must be above 0 and below liveness_timeout_ms",
            ));
        }
        if self.max_envelope_bytes == 0 || self.max_envelope_bytes > MAX_ENVELOPE_BYTES {
            return Err(config_error(
                "max_envelope_bytes",
                format!("want 1..={MAX_ENVELOPE_BYTES}"),
            ));
        }
        if self.command_window_bytes == 0
            || self.command_window_bytes > DEFAULT_COMMAND_SEND_WINDOW_BYTES
        {
            return Err(config_error(
                "command_window_bytes",
                format!("want 1..={DEFAULT_COMMAND_SEND_WINDOW_BYTES}"),
            ));
        }
        if self.session_window_bytes < self.command_window_bytes
            || self.session_window_bytes > DEFAULT_SESSION_SEND_WINDOW_BYTES
        {
            return Err(config_error(
                "session_window_bytes",
                format!("want command_window_bytes..={DEFAULT_SESSION_SEND_WINDOW_BYTES}"),
            ));
        }
        Ok(())
    }

    /// The wire form announced in the welcome.
    #[must_use]
    pub fn to_agent_limits(&self) -> wire::AgentLimits {
        let mut limits = wire::AgentLimits {
            max_envelope_bytes: to_u32(self.max_envelope_bytes),
            max_output_chunk_bytes: to_u32(MAX_RAW_CHUNK_BYTES),
            max_data_chunk_bytes: to_u32(MAX_SCRIPT_CHUNK_BYTES),
            max_script_bytes: MAX_SCRIPT_BYTES,
            max_execution_spec_bytes: to_u32(MAX_EXECUTION_SPEC_BYTES),
            command_window_bytes: self.command_window_bytes,
            session_window_bytes: self.session_window_bytes,
            max_reason_bytes: to_u32(MAX_REASON_BYTES),
            heartbeat_idle: Some(Default::default()),
            liveness_timeout: Some(Default::default()),
        };
        // The Duration type is inferred so this crate needs no prost-types.
        if let Some(d) = limits.heartbeat_idle.as_mut() {
            (d.seconds, d.nanos) = split_ms(self.heartbeat_idle_ms);
        }
        if let Some(d) = limits.liveness_timeout.as_mut() {
            (d.seconds, d.nanos) = split_ms(self.liveness_timeout_ms);
        }
        limits
    }
}

fn to_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

fn split_ms(ms: u64) -> (i64, i32) {
    let seconds = i64::try_from(ms / SECOND_MS).unwrap_or(i64::MAX);
    // (ms % 1000) * 1_000_000 < 1e9 always fits in i32
    let nanos = i32::try_from((ms % SECOND_MS) * 1_000_000).unwrap_or(0);
    (seconds, nanos)
}

/// Builds the `ServerWelcome` for a committed registration. Its session
/// fields are the ones the outer envelope carries (R-6.2-09).
#[must_use]
pub fn build_welcome(
    identity: &ServerIdentity,
    limits: &SessionLimits,
    negotiated_minor: u32,
    session_id: &SessionId,
    generation: u64,
) -> wire::ServerWelcome {
    wire::ServerWelcome {
        protocol_major: PROTOCOL_MAJOR,
        negotiated_minor,
        session_id: session_id.as_str().to_owned(),
        generation,
        server_id: identity.server_id.to_string(),
        server_software_version: identity.software_version.clone(),
        limits: Some(limits.to_agent_limits()),
    }
}

/// Wraps `payload` in an envelope carrying the live session fields.
#[must_use]
pub fn envelope(session_id: &SessionId, generation: u64, payload: Payload) -> wire::Envelope {
    wire::Envelope {
        session_id: session_id.as_str().to_owned(),
        generation,
        payload: Some(payload),
    }
}

/// The welcome envelope: outer and inner session fields are equal by
/// construction.
#[must_use]
pub fn welcome_envelope(
    identity: &ServerIdentity,
    limits: &SessionLimits,
    negotiated_minor: u32,
    session_id: &SessionId,
    generation: u64,
) -> wire::Envelope {
    let welcome = build_welcome(identity, limits, negotiated_minor, session_id, generation);
    envelope(session_id, generation, Payload::ServerWelcome(welcome))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_valid_and_announced() {
        let l = SessionLimits::default();
        assert_eq!(l.validate(), Ok(()));
        let w = l.to_agent_limits();
        assert_eq!(w.max_envelope_bytes, 1_048_576);
        assert_eq!(w.command_window_bytes, 1_048_576);
        assert_eq!(w.session_window_bytes, 8_388_608);
        assert_eq!(
            w.heartbeat_idle.map(|d| (d.seconds, d.nanos)),
            Some((10, 0))
        );
        assert_eq!(
            w.liveness_timeout.map(|d| (d.seconds, d.nanos)),
            Some((30, 0))
        );
        assert_eq!(split_ms(1_500), (1, 500_000_000));
    }

    #[test]
    fn limits_cannot_exceed_ceilings() {
        let mut l = SessionLimits {
            command_window_bytes: DEFAULT_COMMAND_SEND_WINDOW_BYTES + 1,
            ..SessionLimits::default()
        };
        assert_eq!(l.validate().unwrap_err().field, "command_window_bytes");
        l = SessionLimits {
            heartbeat_idle_ms: 30_000,
            ..SessionLimits::default()
        };
        assert_eq!(l.validate().unwrap_err().field, "heartbeat_idle_ms");
        l = SessionLimits {
            max_envelope_bytes: MAX_ENVELOPE_BYTES + 1,
            ..SessionLimits::default()
        };
        assert!(l.validate().is_err());
    }
}
