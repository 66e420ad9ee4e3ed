//! rvc's exit statuses: one stable number per class of outcome
//! (documented in docs/cli.md).

use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;

/// A usage error (also clap's own).
pub(crate) const USAGE: u8 = 2;
/// The command was rejected by its client.
pub(crate) const REJECTED: u8 = 29;
/// The command's queue TTL elapsed before dispatch.
pub(crate) const EXPIRED: u8 = 30;
/// The command was cancelled before it was dispatched.
pub(crate) const CANCELLED: u8 = 31;
/// The command's outcome is uncertain (interrupted).
pub(crate) const INTERRUPTED: u8 = 32;
/// The command was terminated through RVBox with no exit status.
pub(crate) const TERMINATED: u8 = 33;
/// A fleet run ended with at least one target failed (non-zero exit,
/// terminated, interrupted, rejected, or refused at release).
pub(crate) const FLEET_FAILED: u8 = 34;
/// A fleet run ended with no target failed but some that never ran
/// (unreachable, cancelled, or skipped after --max-errors).
pub(crate) const FLEET_INCOMPLETE: u8 = 35;
/// rvc detached from a terminal (`~.`) that keeps running.
pub(crate) const DETACHED: u8 = 36;
/// The server could not be reached.
pub(crate) const UNREACHABLE: u8 = 69;
/// An answer rvc did not expect.
pub(crate) const INTERNAL: u8 = 70;
/// rvc was interrupted (Ctrl-C); the remote command keeps running.
pub(crate) const INTERRUPTED_BY_USER: u8 = 130;

/// Why rvc stops without the remote command's status.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    message: String,
    retry: bool,
    /// A request was sent and no answer came back.
    unanswered: bool,
}

impl Failure {
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self {
            code: USAGE,
            message: message.into(),
            retry: false,
            unanswered: false,
        }
    }

    /// A failure with the exit status `code` and its message as it is.
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry: false,
            unanswered: false,
        }
    }

    /// What went wrong, in words.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// As the server's `NOT_FOUND` (the same exit status).
    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self {
            code: Code::NotFound.exit_status(),
            message: format!("NOT_FOUND: {}", message.into()),
            retry: false,
            unanswered: false,
        }
    }

    /// A refusal rvc decides itself, with the exit status of `code`.
    pub(crate) fn refused(code: Code, message: impl Into<String>) -> Self {
        Self {
            code: code.exit_status(),
            message: format!("{}: {}", code.as_str(), message.into()),
            retry: false,
            unanswered: false,
        }
    }

    /// The exit status this failure reports.
    pub(crate) fn status(&self) -> u8 {
        self.code
    }

    pub(crate) fn unreachable(message: impl Into<String>) -> Self {
        Self {
            code: UNREACHABLE,
            message: message.into(),
            retry: false,
            unanswered: false,
        }
    }

    /// A transport failure worth retrying.
    pub(crate) fn retry(message: impl Into<String>) -> Self {
        Self {
            code: UNREACHABLE,
            message: message.into(),
            retry: true,
            unanswered: false,
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self {
            code: INTERNAL,
            message: message.into(),
            retry: false,
            unanswered: false,
        }
    }

    pub(crate) fn is_retry(&self) -> bool {
        self.retry
    }

    /// The last failure of a retried call; `sent`: a request went out
    /// and its answer never came.
    pub(crate) fn into_final(self, sent: bool) -> Self {
        Self {
            retry: false,
            unanswered: sent,
            ..self
        }
    }

    /// A mutation that never got its answer may have been applied: the
    /// message says how to find out without doing it twice.
    pub(crate) fn with_request_id(self, request_id: &str) -> Self {
        if !self.unanswered {
            return self;
        }
        Self {
            message: format!(
                "{}; the request may have been applied: repeat it with --request-id {request_id} to know (it is never applied twice)",
                self.message
            ),
            ..self
        }
    }

    /// `rvc run` that never got its answer: the command may be stored
    /// under its UUID (the request id); the message says where to look
    /// and how to retry without running it twice.
    pub(crate) fn with_run_lookup(self, issue_uuid: &str, client_id: &str) -> Self {
        if !self.unanswered {
            return self;
        }
        Self {
            message: format!(
                "{}; the command may have been stored as {issue_uuid}: `rvc stat {client_id} {issue_uuid}` shows it, and the same `rvc run` with --request-id {issue_uuid} never runs it twice",
                self.message
            ),
            ..self
        }
    }

    /// A non-OK status: the RVBox detail's code decides the exit status.
    pub(crate) fn from_status(s: &tonic::Status) -> Self {
        if let Some(detail) = DomainError::detail_from_grpc(s.details())
            && let Some(code) = Code::from_wire(detail.code)
        {
            let field = if detail.field.is_empty() {
                String::new()
            } else {
                format!("{}: ", detail.field)
            };
            return Self {
                code: code.exit_status(),
                message: format!("{}: {field}{}", code.as_str(), detail.reason),
                retry: code == Code::Unavailable,
                unanswered: false,
            };
        }
        match s.code() {
            _ if crate::conn::is_transport_failure(s) => Self::retry(format!(
                "the connection to the server broke ({:?}: {})",
                s.code(),
                s.message()
            )),
            tonic::Code::Unavailable => {
                Self::retry(format!("the server is unavailable: {}", s.message()))
            }
            _ => Self::internal(format!("{:?}: {}", s.code(), s.message())),
        }
    }

    /// Prints the failure as one JSON document on stderr (`--output
    /// json`) and returns its status.
    pub(crate) fn report_json(self) -> u8 {
        let doc = serde_json::json!({
            "error": { "exitStatus": self.code, "message": self.message }
        });
        eprintln!("{doc}");
        self.code
    }

    /// Prints the failure and returns its status.
    pub(crate) fn report(self) -> u8 {
        eprintln!("rvc: {}", self.message);
        self.code
    }
}

/// rvc's status for a command that ended with `result`.
pub(crate) fn of_result(result: &wire::ExitResult) -> u8 {
    let by_signal = |n: i32| u8::try_from(128 + n.clamp(1, 127)).unwrap_or(INTERRUPTED);
    let by_code = |c: i32| u8::try_from(c.rem_euclid(256)).unwrap_or(1);
    match wire::Lifecycle::try_from(result.lifecycle) {
        Ok(wire::Lifecycle::Succeeded) => 0,
        Ok(wire::Lifecycle::Failed) => match (result.exit_code, result.signal_number) {
            (Some(c), _) => by_code(c),
            (None, Some(n)) => by_signal(n),
            (None, None) => 1,
        },
        Ok(wire::Lifecycle::Terminated) => match (result.exit_code, result.signal_number) {
            (Some(c), _) => by_code(c),
            (None, Some(n)) => by_signal(n),
            (None, None) => TERMINATED,
        },
        Ok(wire::Lifecycle::Rejected) => REJECTED,
        Ok(wire::Lifecycle::Expired) => EXPIRED,
        Ok(wire::Lifecycle::Cancelled) => CANCELLED,
        _ => INTERRUPTED,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    /// The one table of exit statuses in docs/cli.md.
    fn table() -> Vec<(String, String)> {
        let doc = include_str!("../../../docs/cli.md");
        let section = doc.split("## Exit statuses").nth(1).unwrap();
        section
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                (cells.len() >= 4 && cells[1] != "Status" && !cells[1].starts_with("---"))
                    .then(|| (cells[1].to_owned(), cells[2].to_owned()))
            })
            .collect()
    }

    fn meaning(status: u8) -> String {
        table()
            .into_iter()
            .find(|(s, _)| *s == status.to_string())
            .map(|(_, m)| m)
            .unwrap_or_else(|| panic!("docs/cli.md has no row for exit status {status}"))
    }

    #[test]
    fn every_error_code_has_its_documented_status() {
        let refusals = table()
            .into_iter()
            .find(|(s, _)| s == "11-28")
            .map(|(_, m)| m)
            .unwrap();
        for code in Code::ALL {
            let status = code.exit_status();
            assert!((11..=28).contains(&status), "{code:?}: {status}");
            let named = format!("{status} `{}`", code.as_str());
            assert!(refusals.contains(&named), "docs/cli.md lacks {named}");
        }
    }

    #[test]
    fn every_other_class_has_its_row() {
        assert!(meaning(USAGE).contains("usage"));
        assert!(meaning(REJECTED).contains("rejected"));
        assert!(meaning(EXPIRED).contains("expired"));
        assert!(meaning(CANCELLED).contains("cancelled"));
        assert!(meaning(INTERRUPTED).contains("interrupted"));
        assert!(meaning(TERMINATED).contains("terminated"));
        assert!(meaning(UNREACHABLE).contains("could not be reached"));
        assert!(meaning(FLEET_FAILED).contains("fleet run"));
        assert!(meaning(FLEET_FAILED).contains("failed"));
        assert!(meaning(FLEET_INCOMPLETE).contains("never ran"));
        assert!(meaning(DETACHED).contains("detached"));
        assert!(meaning(DETACHED).contains("keeps running"));
        assert!(meaning(INTERNAL).contains("did not expect"));
        assert!(meaning(INTERRUPTED_BY_USER).contains("Ctrl-C"));
    }
}
