//! Pieces shared by both daemons' validation.

use core::net::SocketAddr;

use crate::decode::describe_num;
use crate::error::ConfigErrors;
use crate::registry::{self, KeyDef};
use crate::resolve::Resolved;

/// Log level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// error
    Error,
    /// warn
    Warn,
    /// info
    Info,
    /// debug
    Debug,
    /// trace
    Trace,
}

impl LogLevel {
    /// The configuration word.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }

    fn parse(text: &str) -> Self {
        match text {
            "error" => LogLevel::Error,
            "warn" => LogLevel::Warn,
            "debug" => LogLevel::Debug,
            "trace" => LogLevel::Trace,
            _ => LogLevel::Info,
        }
    }
}

/// Log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// `[observability]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObservabilityConfig {
    /// Log level.
    pub log_level: LogLevel,
    /// Log format.
    pub log_format: LogFormat,
    /// Metrics/health listener; `None` when disabled.
    pub metrics_listen: Option<SocketAddr>,
}

pub(crate) fn observability(r: &Resolved, errors: &mut ConfigErrors) -> ObservabilityConfig {
    let metrics_text = r.text("observability.metrics_listen");
    let metrics_listen = if metrics_text.is_empty() {
        None
    } else {
        socket_addr(r, "observability.metrics_listen", errors)
    };
    ObservabilityConfig {
        log_level: LogLevel::parse(&r.text("observability.log_level")),
        log_format: if r.text("observability.log_format") == "json" {
            LogFormat::Json
        } else {
            LogFormat::Text
        },
        metrics_listen,
    }
}

/// Parses an `ip:port` socket address (no host names: no resolver runs at
/// validation).
pub(crate) fn socket_addr(
    r: &Resolved,
    key: &str,
    errors: &mut ConfigErrors,
) -> Option<SocketAddr> {
    let text = r.text(key);
    match text.parse::<SocketAddr>() {
        Ok(addr) if addr.port() == 0 => {
            errors.push(r.error(key, format!("{text:?}: port 0 is not allowed")));
            None
        }
        Ok(addr) => Some(addr),
        Err(_) => {
            errors.push(r.error(
                key,
                format!(
                    "{text:?} is not an IP socket address such as 127.0.0.1:6900 or [::1]:6900"
                ),
            ));
            None
        }
    }
}

fn def(r: &Resolved, key: &str) -> Option<&'static KeyDef> {
    registry::find(r.daemon, key)
}

fn describe(r: &Resolved, key: &str) -> String {
    let n = r.num(key);
    def(r, key).map_or_else(|| n.to_string(), |d| describe_num(d.kind, n))
}

/// Invariant `small < big` (strictly below).
pub(crate) fn require_below(r: &Resolved, small: &str, big: &str, errors: &mut ConfigErrors) {
    if r.failed(small) || r.failed(big) {
        return;
    }
    if r.num(small) >= r.num(big) {
        errors.push(r.pair_error(
            small,
            big,
            format!(
                "{small} ({}) must be below {big} ({})",
                describe(r, small),
                describe(r, big)
            ),
        ));
    }
}

/// Invariant `small <= big`.
pub(crate) fn require_at_most(r: &Resolved, small: &str, big: &str, errors: &mut ConfigErrors) {
    if r.failed(small) || r.failed(big) {
        return;
    }
    if r.num(small) > r.num(big) {
        errors.push(r.pair_error(
            small,
            big,
            format!(
                "{small} ({}) must not exceed {big} ({})",
                describe(r, small),
                describe(r, big)
            ),
        ));
    }
}
