//! Session audit records (plan §5.2, §6.2 "stale or unknown session
//! traffic is discarded/audited").
//!
//! A record of something with a durable effect is written by the store in
//! that effect's own transaction: the registration, the session it
//! fences, a refused live claim, and the close of a registered session
//! (whose reason then names what the session core reported). What changes
//! nothing durable (a hello that failed validation, traffic of a
//! connection that never registered) becomes a [`SessionAudit`] of its
//! own. Those come from unauthenticated input, so they are rate-limited
//! (a token bucket of [`AUDIT_BURST`] records refilled at
//! [`AUDIT_PER_SECOND`] a second): the rest are counted, and the next
//! admitted record says how many were suppressed.

use rvbox_session::{Audit, AuditKind};
use rvbox_store_port::audit::{MAX_SESSION_AUDIT_DETAIL, SessionAudit};

/// Records the bucket holds.
pub const AUDIT_BURST: u32 = 100;
/// Records the bucket regains per second.
pub const AUDIT_PER_SECOND: u32 = 10;

/// The audit action of a session record.
#[must_use]
pub const fn action(kind: AuditKind) -> &'static str {
    match kind {
        AuditKind::HelloRejected => "HelloRejected",
        AuditKind::LiveConflict => "LiveConflictRefused",
        AuditKind::Registered => "SessionRegistered",
        AuditKind::StaleSession => "StaleSession",
        AuditKind::ProtocolError => "ProtocolError",
        AuditKind::Fenced => "SessionFenced",
        AuditKind::LivenessTimeout => "LivenessTimeout",
        AuditKind::ReconcileTimeout => "ReconcileTimeout",
        AuditKind::IngressOverload => "IngressOverload",
        AuditKind::ClientError => "ClientError",
        AuditKind::StorageUnavailable => "StorageUnavailable",
        AuditKind::InternalError => "InternalError",
    }
}

/// Whether the store already writes this kind with its effect.
#[must_use]
pub const fn written_with_effect(kind: AuditKind) -> bool {
    matches!(
        kind,
        AuditKind::Registered | AuditKind::Fenced | AuditKind::LiveConflict
    )
}

/// `detail` cut to at most `max` bytes at a character boundary.
#[must_use]
pub fn bounded(detail: &str, max: usize) -> String {
    let mut end = detail.len().min(max);
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    detail.get(..end).unwrap_or_default().to_owned()
}

/// Operator records (reads, refusals at the control edge) the operator
/// bucket holds: the control socket is authenticated, so its bucket is
/// larger than the agent endpoint's.
pub const OPERATOR_AUDIT_BURST: u32 = 2000;
/// Operator records the bucket regains per second.
pub const OPERATOR_AUDIT_PER_SECOND: u32 = 200;

/// The rate limit of records without an effect.
#[derive(Debug, Clone)]
pub(crate) struct AuditLimiter {
    tokens: u32,
    refilled_ms: u64,
    suppressed: u64,
    burst: u32,
    per_second: u32,
}

impl Default for AuditLimiter {
    fn default() -> Self {
        Self::new(AUDIT_BURST, AUDIT_PER_SECOND)
    }
}

impl AuditLimiter {
    fn new(burst: u32, per_second: u32) -> Self {
        Self {
            tokens: burst,
            refilled_ms: 0,
            suppressed: 0,
            burst,
            per_second,
        }
    }

    /// The bucket of operator records.
    pub(crate) fn operator() -> Self {
        Self::new(OPERATOR_AUDIT_BURST, OPERATOR_AUDIT_PER_SECOND)
    }

    /// The records to write for `audit` at `now_ms`: none when the bucket
    /// is empty (counted), else the record, preceded by a summary of what
    /// was suppressed since the last admitted one.
    pub(crate) fn admit(
        &mut self,
        now_ms: u64,
        client_id: Option<String>,
        audit: &Audit,
    ) -> Vec<SessionAudit> {
        self.admit_record(
            now_ms,
            SessionAudit::session(
                client_id,
                action(audit.kind),
                bounded(&audit.detail, MAX_SESSION_AUDIT_DETAIL),
            ),
        )
    }

    /// As [`AuditLimiter::admit`], for a record made elsewhere (its
    /// detail is bounded here).
    pub(crate) fn admit_record(
        &mut self,
        now_ms: u64,
        mut record: SessionAudit,
    ) -> Vec<SessionAudit> {
        let earned = now_ms.saturating_sub(self.refilled_ms) * u64::from(self.per_second) / 1000;
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(earned).min(self.burst);
            self.refilled_ms = now_ms;
        }
        if self.tokens == 0 {
            self.suppressed += 1;
            return Vec::new();
        }
        self.tokens -= 1;
        let mut out = Vec::with_capacity(2);
        if self.suppressed > 0 {
            let mut summary = SessionAudit::session(
                None,
                "AuditsSuppressed",
                format!(
                    "{} audit records suppressed by the rate limit",
                    self.suppressed
                ),
            );
            summary.caller.clone_from(&record.caller);
            out.push(summary);
            self.suppressed = 0;
        }
        record.detail = bounded(&record.detail, MAX_SESSION_AUDIT_DETAIL);
        out.push(record);
        out
    }

    /// Records suppressed and not yet summarised.
    #[cfg(test)]
    pub(crate) fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected() -> Audit {
        Audit {
            kind: AuditKind::HelloRejected,
            detail: "hello: client_id empty".into(),
        }
    }

    #[test]
    fn a_flood_is_cut_to_the_burst_and_the_next_record_counts_the_rest() {
        let mut l = AuditLimiter::default();
        let admitted: usize = (0..1000).map(|_| l.admit(0, None, &rejected()).len()).sum();
        assert_eq!(admitted, AUDIT_BURST as usize);
        assert_eq!(l.suppressed(), 900);
        // a second later the bucket holds ten more; the first says 900
        let next = l.admit(1000, Some("web-1".into()), &rejected());
        assert_eq!(next.len(), 2);
        assert_eq!(next[0].action, "AuditsSuppressed");
        assert!(next[0].detail.starts_with("900 "), "{}", next[0].detail);
        assert_eq!(next[1].action, "HelloRejected");
        assert_eq!(next[1].client_id.as_deref(), Some("web-1"));
        assert_eq!(l.suppressed(), 0);
        let more: usize = (0..20)
            .map(|_| l.admit(1000, None, &rejected()).len())
            .sum();
        assert_eq!(more, 9);
    }

    #[test]
    fn details_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_SESSION_AUDIT_DETAIL);
        let cut = bounded(&long, MAX_SESSION_AUDIT_DETAIL);
        assert!(cut.len() <= MAX_SESSION_AUDIT_DETAIL);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
