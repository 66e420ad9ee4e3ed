//! The audit log (plan §5.2 `audit_events`, §5.4 item 5): one record per
//! audited action, zstd-compressed in `Kind::Audit` segment records under
//! `audit/`, with the same committed-offset protocol as command segments
//! (append, fsync, then one transaction advancing `committed_end`), sealed
//! at the segment seal size, charged against the separate audit budget
//! (`reserve_audit`), and rotated oldest complete segment first
//! (`plan_audit_rotation`; the age trigger is off at 0).
//!
//! A record carries who did what and how it ended: time, transport,
//! principal, client and command ids, action, outcome, error code, the
//! command text/script digest and environment key NAMES. The type has no
//! place for environment values, stdin or output bytes, so none can leak
//! into the log.

use crate::db::Cached as _;
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;
use rvbox_retention::{
    AuditSegment, CHARGE_VERSION, ChargeKind, Tier, charge, plan_audit_rotation, release_audit,
    reserve_audit,
};
use rvbox_segment::{
    Compression, Kind, Limits, RecordMeta, Recovery, Stream, audit_file_name,
    parse_audit_file_name, scan, sha256,
};

use crate::error::StoreError;
use crate::incidents::NewIncident;
use crate::mutations::OpError;
use crate::retention::{Origin, queue_deletion};
use crate::store::{Store, to_i64, to_u64};

/// Largest text field (transport, principal, action, one env key name).
pub const MAX_AUDIT_TEXT_BYTES: usize = 256;
/// Most environment key names in one record.
pub const MAX_AUDIT_ENV_KEYS: usize = rvbox_domain::limits::MAX_ENV_OVERRIDES;
/// Largest explanation in one record.
pub const MAX_AUDIT_DETAIL_BYTES: usize = 1024;
/// Largest encoded (raw) audit record.
pub const MAX_AUDIT_RAW_BYTES: u32 = 512 * 1024;
/// Records the outbox holds before strict audited writes are refused
/// (reached only when flushing keeps failing, e.g. below the free-space
/// floor).
pub const AUDIT_OUTBOX_MAX: u64 = 16_384;
/// Outbox records beyond which best-effort (session) records are dropped,
/// so control mutations keep room: three quarters of the outbox.
pub const AUDIT_OUTBOX_BEST_EFFORT_MAX: u64 = AUDIT_OUTBOX_MAX / 4 * 3;
/// Largest record the outbox takes: environment key names beyond it are
/// left out (the record says how many), so the outbox holds at most
/// `AUDIT_OUTBOX_MAX` x 16 KiB.
pub const MAX_OUTBOX_RECORD_BYTES: usize = 16 * 1024;
/// How long audited writes leave flushing to maintenance after a flush
/// failed.
pub const AUDIT_FLUSH_BACKOFF_MS: i64 = 10_000;
/// Outbox records that trigger a flush after an audited write.
pub const AUDIT_FLUSH_AT: u64 = 256;
/// Most records one flush moves with one append and one fsync.
pub const AUDIT_FLUSH_BATCH: usize = 256;
/// Most audit segment files recovery lists.
pub const MAX_AUDIT_FILES: usize = 1_000_000;

/// Crash points of the audit append.
pub mod points {
    /// The record is appended and synced; `committed_end` not yet advanced.
    pub const AUDIT_AFTER_FSYNC: &str = "store.audit.after_fsync";
}

/// Record limits of audit segments.
#[must_use]
pub fn audit_limits() -> Limits {
    let stored = rvbox_retention::zstd_bound(u64::from(MAX_AUDIT_RAW_BYTES));
    Limits {
        max_stored_len: u32::try_from(stored).unwrap_or(u32::MAX),
        max_raw_len: MAX_AUDIT_RAW_BYTES,
    }
}

/// How an audited action ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditOutcome {
    /// Done.
    Ok,
    /// Refused (validation, conflict, quota, precondition).
    Refused,
    /// Failed inside the server.
    Failed,
}

impl AuditOutcome {
    const fn as_u8(self) -> u8 {
        match self {
            Self::Ok => 1,
            Self::Refused => 2,
            Self::Failed => 3,
        }
    }

    const fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Ok),
            2 => Some(Self::Refused),
            3 => Some(Self::Failed),
            _ => None,
        }
    }
}

/// One audit record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// When the action happened (Unix ms).
    pub time_ms: i64,
    /// Transport (`grpc-unix`, `json-rpc`, `agent-wss`, `offline-repair`).
    pub transport: String,
    /// Principal as the transport knows it (e.g. `uid:1000`); may be empty.
    pub principal: String,
    /// Client concerned.
    pub client_id: Option<String>,
    /// Command concerned.
    pub issue_uuid: Option<[u8; 16]>,
    /// Action (the RPC method, e.g. `RunCommand`).
    pub action: String,
    /// Outcome.
    pub outcome: AuditOutcome,
    /// rvbox.v1 error code of a refusal or failure.
    pub error_code: Option<i32>,
    /// SHA-256 of the command text or script.
    pub command_digest: Option<[u8; 32]>,
    /// Environment key names (never values), sorted.
    pub env_keys: Vec<String>,
    /// A bounded, payload-free explanation (a session's close reason, a
    /// refusal's reason); at most [`MAX_AUDIT_DETAIL_BYTES`].
    pub detail: String,
    /// SHA-256 of the encoded record before this one in the audit log
    /// (the hash chain); set when the record is appended to an audit
    /// segment, `None` before that (the outbox) and in records written
    /// before the chain existed.
    pub prev_hash: Option<[u8; 32]>,
}

impl AuditRecord {
    /// Sets `env_keys` from an environment map's keys only.
    #[must_use]
    pub fn with_env_names<'a>(mut self, keys: impl IntoIterator<Item = &'a String>) -> Self {
        let mut names: Vec<String> = keys.into_iter().cloned().collect();
        names.sort();
        names.dedup();
        self.env_keys = names;
        self
    }

    fn check(&self) -> Result<(), DomainError> {
        let bad = |field: &str, why: &str| {
            Err(
                DomainError::new(Code::InvalidArgument, format!("audit {field}: {why}"))
                    .with_field(field),
            )
        };
        for (field, v) in [
            ("transport", &self.transport),
            ("principal", &self.principal),
            ("action", &self.action),
        ] {
            if v.len() > MAX_AUDIT_TEXT_BYTES {
                return bad(field, "too long");
            }
        }
        if self.action.is_empty() {
            return bad("action", "empty");
        }
        if self.detail.len() > MAX_AUDIT_DETAIL_BYTES {
            return bad("detail", "too long");
        }
        if let Some(c) = &self.client_id
            && (c.is_empty() || c.len() > rvbox_domain::limits::MAX_CLIENT_ID_LEN)
        {
            return bad("client_id", "empty or too long");
        }
        if self.env_keys.len() > MAX_AUDIT_ENV_KEYS {
            return bad("env_keys", "too many");
        }
        for k in &self.env_keys {
            // a name containing '=' or NUL would smuggle a value in
            if k.is_empty() || k.len() > MAX_AUDIT_TEXT_BYTES || k.contains(['=', '\0']) {
                return bad("env_keys", "not an environment key name");
            }
        }
        Ok(())
    }

    /// The record with every text cut to its limit (at a character
    /// boundary) and at most [`MAX_AUDIT_ENV_KEYS`] key names: what an
    /// audited write records, so its own audit never refuses it.
    #[must_use]
    pub fn bounded(mut self) -> Self {
        fn cut(s: &mut String, max: usize) {
            if s.len() > max {
                let mut end = max;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                s.truncate(end);
            }
        }
        cut(&mut self.transport, MAX_AUDIT_TEXT_BYTES);
        cut(&mut self.principal, MAX_AUDIT_TEXT_BYTES);
        cut(&mut self.action, MAX_AUDIT_TEXT_BYTES);
        cut(&mut self.detail, MAX_AUDIT_DETAIL_BYTES);
        if self.action.is_empty() {
            self.action.push_str("unnamed");
        }
        if self
            .client_id
            .as_ref()
            .is_some_and(|c| c.is_empty() || c.len() > rvbox_domain::limits::MAX_CLIENT_ID_LEN)
        {
            self.client_id = None;
        }
        self.env_keys.retain(|k| {
            !k.is_empty() && k.len() <= MAX_AUDIT_TEXT_BYTES && !k.contains(['=', '\0'])
        });
        self.env_keys.truncate(MAX_AUDIT_ENV_KEYS);
        self
    }

    /// The record with environment key names left out from the end until
    /// it encodes to at most `max` bytes; the detail then says how many.
    #[must_use]
    pub fn fit(mut self, max: usize) -> Self {
        let mut dropped = 0usize;
        while self.encode().len() > max && !self.env_keys.is_empty() {
            let keep = self.env_keys.len() / 2;
            dropped += self.env_keys.len() - keep;
            self.env_keys.truncate(keep);
        }
        if dropped > 0 {
            let note = format!(" ({dropped} more environment key names not recorded)");
            let room = MAX_AUDIT_DETAIL_BYTES.saturating_sub(note.len());
            let mut end = self.detail.len().min(room);
            while !self.detail.is_char_boundary(end) {
                end -= 1;
            }
            self.detail.truncate(end);
            self.detail.push_str(&note);
        }
        self
    }

    /// Encodes the record (little-endian, length-prefixed text): format
    /// version 3 when it carries `prev_hash` (flag 32, the hash last),
    /// else version 2 (version 1 had no `detail`).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        fn text(out: &mut Vec<u8>, s: &str) {
            let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(s.as_bytes().get(..usize::from(len)).unwrap_or_default());
        }
        let mut out = Vec::with_capacity(160);
        out.push(if self.prev_hash.is_some() { 3u8 } else { 2u8 });
        out.extend_from_slice(&self.time_ms.to_le_bytes());
        text(&mut out, &self.transport);
        text(&mut out, &self.principal);
        text(&mut out, &self.action);
        out.push(self.outcome.as_u8());
        let flags = u8::from(self.client_id.is_some())
            | (u8::from(self.issue_uuid.is_some()) << 1)
            | (u8::from(self.error_code.is_some()) << 2)
            | (u8::from(self.command_digest.is_some()) << 3)
            | (u8::from(!self.detail.is_empty()) << 4)
            | (u8::from(self.prev_hash.is_some()) << 5);
        out.push(flags);
        if let Some(c) = &self.client_id {
            text(&mut out, c);
        }
        if let Some(u) = &self.issue_uuid {
            out.extend_from_slice(u);
        }
        if let Some(e) = self.error_code {
            out.extend_from_slice(&e.to_le_bytes());
        }
        if let Some(d) = &self.command_digest {
            out.extend_from_slice(d);
        }
        let n = u16::try_from(self.env_keys.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&n.to_le_bytes());
        for k in self.env_keys.iter().take(usize::from(n)) {
            text(&mut out, k);
        }
        if !self.detail.is_empty() {
            text(&mut out, &self.detail);
        }
        if let Some(h) = &self.prev_hash {
            out.extend_from_slice(h);
        }
        out
    }

    /// Decodes [`AuditRecord::encode`] output; `None` when malformed.
    #[must_use]
    pub fn decode(buf: &[u8]) -> Option<Self> {
        struct R<'a>(&'a [u8]);
        impl<'a> R<'a> {
            fn take(&mut self, n: usize) -> Option<&'a [u8]> {
                let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
                self.0 = b;
                Some(a)
            }
            fn u8(&mut self) -> Option<u8> {
                self.take(1)?.first().copied()
            }
            fn u16(&mut self) -> Option<u16> {
                Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
            }
            fn text(&mut self) -> Option<String> {
                let n = usize::from(self.u16()?);
                String::from_utf8(self.take(n)?.to_vec()).ok()
            }
        }
        let mut r = R(buf);
        let version = r.u8()?;
        if !(1..=3).contains(&version) {
            return None;
        }
        let time_ms = i64::from_le_bytes(r.take(8)?.try_into().ok()?);
        let transport = r.text()?;
        let principal = r.text()?;
        let action = r.text()?;
        let outcome = AuditOutcome::from_u8(r.u8()?)?;
        let flags = r.u8()?;
        let client_id = if flags & 1 != 0 {
            Some(r.text()?)
        } else {
            None
        };
        let issue_uuid = if flags & 2 != 0 {
            Some(<[u8; 16]>::try_from(r.take(16)?).ok()?)
        } else {
            None
        };
        let error_code = if flags & 4 != 0 {
            Some(i32::from_le_bytes(r.take(4)?.try_into().ok()?))
        } else {
            None
        };
        let command_digest = if flags & 8 != 0 {
            Some(<[u8; 32]>::try_from(r.take(32)?).ok()?)
        } else {
            None
        };
        let n = usize::from(r.u16()?);
        if n > MAX_AUDIT_ENV_KEYS {
            return None;
        }
        let mut env_keys = Vec::with_capacity(n);
        for _ in 0..n {
            env_keys.push(r.text()?);
        }
        let detail = if version >= 2 && flags & 16 != 0 {
            r.text()?
        } else {
            String::new()
        };
        let prev_hash = if version >= 3 && flags & 32 != 0 {
            Some(<[u8; 32]>::try_from(r.take(32)?).ok()?)
        } else {
            None
        };
        if !r.0.is_empty() || detail.len() > MAX_AUDIT_DETAIL_BYTES {
            return None;
        }
        Some(Self {
            time_ms,
            transport,
            principal,
            client_id,
            issue_uuid,
            action,
            outcome,
            error_code,
            command_digest,
            env_keys,
            detail,
            prev_hash,
        })
    }
}

/// Where an appended audit record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditAck {
    /// The record's audit sequence (global, from 1).
    pub seq: u64,
    /// The audit segment ordinal.
    pub ordinal: u64,
    /// Audit segments rotated to make room.
    pub rotated: u64,
}

/// What [`Store::verify_audit`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditVerification {
    /// Audit segments read.
    pub segments: u64,
    /// Records checked against the chain.
    pub chained: u64,
    /// Records written before the chain existed (not covered by it).
    pub unchained: u64,
    /// The hash of the newest chained record (the chain's head), to keep
    /// elsewhere and compare later; zeros when there is none.
    pub head: [u8; 32],
    /// Each problem found, naming the segment and the record sequence;
    /// empty when the log is intact.
    pub problems: Vec<String>,
}

/// What audit recovery did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditRecoveryReport {
    /// Segments scanned.
    pub segments_scanned: u64,
    /// Segments whose uncommitted tail was cut.
    pub tails_truncated: u64,
    /// Segments damaged inside their committed range.
    pub segments_damaged: u64,
    /// Orphan audit files (no row) removed.
    pub orphans_removed: u64,
}

/// How an audited write treats a full outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strictness {
    /// Refuse the write (`UNAVAILABLE`): control mutations, whose audit
    /// is part of their contract.
    Must,
    /// Write without the record, counted and logged: session bookkeeping,
    /// which must follow the socket whatever the audit log can take.
    BestEffort,
}

/// Queues an audit record in the outbox, inside the caller's transaction
/// when it has one (plan §5.2: the audit record commits with its effect).
/// The record is cut to its limits first. Returns the outbox id, or `None`
/// when a best-effort record was dropped because the outbox is full.
///
/// # Errors
/// `UNAVAILABLE` when a [`Strictness::Must`] record meets a full outbox;
/// [`StoreError`] when the database failed.
pub(crate) fn outbox_insert(
    conn: &rusqlite::Connection,
    rec: &AuditRecord,
    strictness: Strictness,
) -> Result<Option<i64>, OpError> {
    let len = outbox_len(conn)?;
    if strictness == Strictness::BestEffort && len >= AUDIT_OUTBOX_BEST_EFFORT_MAX {
        tracing::warn!(action = %rec.action, "audit outbox nearly full: session record dropped");
        return Ok(None);
    }
    if len >= AUDIT_OUTBOX_MAX {
        tracing::error!(action = %rec.action, "audit outbox full: the audit log cannot be written");
        return match strictness {
            Strictness::Must => Err(DomainError::new(
                Code::Unavailable,
                "the audit log cannot take records (its outbox is full and cannot be flushed); see the storage incidents",
            )
            .into()),
            Strictness::BestEffort => Ok(None),
        };
    }
    let raw = rec.clone().bounded().fit(MAX_OUTBOX_RECORD_BYTES).encode();
    let id = conn
        .query_row_cached(
            "INSERT INTO audit_outbox (time_ms, record) VALUES (?1, ?2) RETURNING id",
            params![rec.time_ms, raw],
            |r| r.get(0),
        )
        .map_err(|e| StoreError::sqlite("queue audit record", e))?;
    Ok(Some(id))
}

/// Records in the outbox. Rows are inserted with increasing ids and
/// removed oldest first, so the span of ids is their count (two index
/// lookups, however large the outbox).
fn outbox_len(conn: &rusqlite::Connection) -> Result<u64, StoreError> {
    let (lo, hi): (Option<i64>, Option<i64>) = conn
        .query_row_cached("SELECT MIN(id), MAX(id) FROM audit_outbox", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .map_err(|e| StoreError::sqlite("measure audit outbox", e))?;
    Ok(match (lo, hi) {
        (Some(lo), Some(hi)) => to_u64(hi.saturating_sub(lo).saturating_add(1)),
        _ => 0,
    })
}

/// The audit record of one audited write, written at most once: inside
/// the write's own transaction when it commits an effect
/// ([`AuditIntent::write_in`]), else on its own afterwards (a refusal
/// that commits nothing, an idempotent replay; [`Store::audit_unwritten`]).
#[derive(Debug, Clone)]
pub struct AuditIntent {
    record: AuditRecord,
    strictness: Strictness,
    written: bool,
    dropped: bool,
}

impl AuditIntent {
    /// The intent of a control mutation: its record must be written.
    #[must_use]
    pub fn control(record: AuditRecord) -> Self {
        Self {
            record,
            strictness: Strictness::Must,
            written: false,
            dropped: false,
        }
    }

    /// The intent of session bookkeeping: written when the outbox can take
    /// it.
    #[must_use]
    pub(crate) fn session(record: AuditRecord) -> Self {
        Self {
            record,
            strictness: Strictness::BestEffort,
            written: false,
            dropped: false,
        }
    }

    /// Whether the record was written.
    #[must_use]
    pub fn written(&self) -> bool {
        self.written
    }

    /// Writes the record with `outcome` inside the caller's transaction.
    ///
    /// # Errors
    /// `UNAVAILABLE` for a control record that meets a full outbox, or a
    /// database failure: either way the caller's transaction must not
    /// commit.
    pub(crate) fn write_in(
        &mut self,
        tx: &rusqlite::Connection,
        outcome: Result<(), &DomainError>,
    ) -> Result<(), OpError> {
        if self.written {
            return Ok(());
        }
        set_outcome(&mut self.record, outcome);
        if outbox_insert(tx, &self.record, self.strictness)?.is_none() {
            tracing::warn!(action = %self.record.action, "session audit record dropped: the audit outbox is full");
            self.dropped = true;
        }
        self.written = true;
        Ok(())
    }
}

/// Sets a record's outcome (and error code, and a refusal's reason as
/// its detail when it has none) from what its operation answered.
pub fn set_outcome(rec: &mut AuditRecord, outcome: Result<(), &DomainError>) {
    match outcome {
        Ok(()) => {
            rec.outcome = AuditOutcome::Ok;
            rec.error_code = None;
        }
        Err(e) => {
            rec.outcome = if e.code() == Code::Internal {
                AuditOutcome::Failed
            } else {
                AuditOutcome::Refused
            };
            rec.error_code = Some(e.code().to_wire() as i32);
            if rec.detail.is_empty() {
                rec.detail = e.reason().to_owned();
            }
        }
    }
}

impl Store {
    /// Writes an intent that its write did not write (a refusal that
    /// committed nothing, a replay, a failure), on its own, with the
    /// outcome the caller saw. Never fails the caller: a record that
    /// cannot be written is logged and counted.
    pub fn audit_unwritten<T>(
        &mut self,
        intent: &mut AuditIntent,
        result: &Result<T, OpError>,
        now_ms: i64,
    ) {
        // an error after the record was written in the transaction means
        // the transaction rolled back, taking the record with it
        if intent.written && result.is_err() {
            intent.written = false;
            intent.dropped = false;
        }
        if intent.written {
            if std::mem::take(&mut intent.dropped) {
                self.metrics.audit_dropped.inc();
            }
            self.after_audited(now_ms);
            return;
        }
        let failed;
        let outcome = match result {
            Ok(_) => Ok(()),
            Err(OpError::Refused(e)) => Err(e),
            Err(OpError::Store(e)) => {
                failed = DomainError::new(Code::Internal, e.to_string());
                Err(&failed)
            }
        };
        set_outcome(&mut intent.record, outcome);
        match outbox_insert(&self.conn, &intent.record, Strictness::BestEffort) {
            Ok(Some(_)) => intent.written = true,
            Ok(None) => {
                self.metrics.audit_dropped.inc();
            }
            Err(e) => {
                self.metrics.audit_dropped.inc();
                tracing::error!(action = %intent.record.action, error = %e, "audit record not written");
            }
        }
        self.after_audited(now_ms);
    }
}

impl AuditRecord {
    /// The record of a control request before its outcome is known.
    #[must_use]
    pub fn control(caller: &crate::operator::Caller, action: &str, now_ms: i64) -> Self {
        Self {
            time_ms: now_ms,
            transport: caller.transport.clone(),
            principal: caller.principal.clone(),
            client_id: None,
            issue_uuid: None,
            action: action.to_owned(),
            outcome: AuditOutcome::Ok,
            error_code: None,
            command_digest: None,
            env_keys: Vec::new(),
            detail: String::new(),
            prev_hash: None,
        }
    }

    /// The record of an audit that no store effect carries: session
    /// traffic on the agent endpoint, or (with its caller) an operator's
    /// read or a request refused at an edge, with its outcome.
    #[must_use]
    pub fn of_edge(r: &rvbox_store_port::audit::SessionAudit, now_ms: i64) -> Self {
        let mut rec = match &r.caller {
            Some(c) => Self::control(
                &crate::operator::Caller {
                    transport: c.transport.clone(),
                    principal: c.principal.clone(),
                },
                r.action,
                now_ms,
            ),
            None => Self::session(None, r.action, String::new(), now_ms),
        };
        rec.client_id.clone_from(&r.client_id);
        rec.issue_uuid = r.issue_uuid;
        rec.detail.clone_from(&r.detail);
        if let Some(code) = r.error_code {
            rec.outcome = AuditOutcome::Refused;
            rec.error_code = Some(code);
        }
        rec
    }

    /// The record of a `RunCommand` request: the client, the command, the
    /// digest of its text or script, and its environment key names (never
    /// values).
    #[must_use]
    pub fn run_command(
        caller: &crate::operator::Caller,
        req: &wire::RunCommandRequest,
        now_ms: i64,
    ) -> Self {
        let mut rec = Self::control(caller, "RunCommand", now_ms);
        rec.client_id = Some(req.client_id.clone());
        rec.issue_uuid = rvbox_domain::ids::Uuid7::parse("request_id", &req.request_id)
            .ok()
            .map(|u| *u.as_bytes());
        if let Some(spec) = &req.spec {
            rec.command_digest = match &spec.source {
                Some(wire::execution_spec::Source::CommandText(t)) => Some(sha256(t.as_bytes())),
                Some(wire::execution_spec::Source::Script(d)) => {
                    <[u8; 32]>::try_from(d.sha256.as_slice()).ok()
                }
                None => None,
            };
            rec = rec.with_env_names(spec.env.keys());
        }
        rec
    }

    /// A session record of the agent endpoint.
    #[must_use]
    pub fn session(
        client_id: Option<&str>,
        action: &str,
        detail: impl Into<String>,
        now_ms: i64,
    ) -> Self {
        let mut rec = Self::control(
            &crate::operator::Caller {
                transport: rvbox_store_port::audit::AGENT_TRANSPORT.into(),
                principal: String::new(),
            },
            action,
            now_ms,
        );
        rec.client_id = client_id.map(str::to_owned);
        rec.detail = detail.into();
        rec
    }
}

/// What one outbox flush batch moved.
#[derive(Debug, Clone, Copy)]
struct FlushedBatch {
    first_outbox_id: i64,
    last_outbox_id: i64,
    first_seq: u64,
    ordinal: u64,
    records: u64,
    rotated: u64,
}

/// The transaction that commits one appended batch.
#[derive(Debug, Clone, Copy)]
struct AuditCommit {
    ordinal: u64,
    base_seq: u64,
    new_file: bool,
    seal_prev: Option<u64>,
    len: u64,
    records: u64,
    charged: u64,
    first_ms: i64,
    last_ms: i64,
    outbox_upto: i64,
    /// The hash the batch's first record continues.
    chain_start: [u8; 32],
    /// The hash of the batch's last record.
    chain_end: [u8; 32],
}

fn hash32(v: &[u8], what: &str) -> Result<[u8; 32], StoreError> {
    <[u8; 32]>::try_from(v).map_err(|_| StoreError::Integrity(format!("{what} is not 32 bytes")))
}

#[derive(Debug, Clone, Copy)]
struct ActiveAudit {
    ordinal: u64,
    committed: u64,
    records: u64,
    base_seq: u64,
}

impl Store {
    fn audit_active(&self) -> Result<Option<ActiveAudit>, StoreError> {
        self.conn
            .query_row_cached(
                "SELECT ordinal, committed_end, records, base_seq FROM audit_segments WHERE state = 'active'",
                [],
                |r| {
                    Ok(ActiveAudit {
                        ordinal: to_u64(r.get(0)?),
                        committed: to_u64(r.get(1)?),
                        records: to_u64(r.get(2)?),
                        base_seq: to_u64(r.get(3)?),
                    })
                },
            )
            .optional()
            .map_err(|e| StoreError::sqlite("find active audit segment", e))
    }

    /// The hash the next audit record continues: the newest segment's
    /// last chained record, else the hash the oldest kept segment
    /// continues after rotation, else zeros (the chain's start).
    fn audit_chain_head(&self) -> Result<[u8; 32], StoreError> {
        let newest: Option<Option<Vec<u8>>> = self
            .conn
            .query_row_cached(
                "SELECT chain_end FROM audit_segments ORDER BY ordinal DESC LIMIT 1",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read audit chain head", e))?;
        if let Some(h) = newest.flatten() {
            return hash32(&h, "audit_segments.chain_end");
        }
        match self.audit_chain_floor()? {
            Some(h) => Ok(h),
            None => Ok([0; 32]),
        }
    }

    /// `store_meta.audit_chain_floor`: the hash of the last record of the
    /// newest rotated segment.
    fn audit_chain_floor(&self) -> Result<Option<[u8; 32]>, StoreError> {
        let v: Option<Vec<u8>> = self
            .conn
            .query_row_cached(
                "SELECT value FROM store_meta WHERE key = 'audit_chain_floor'",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read audit chain floor", e))?;
        v.map(|h| hash32(&h, "store_meta.audit_chain_floor"))
            .transpose()
    }

    /// The ordinal and base sequence a new audit segment gets.
    fn audit_next(&self) -> Result<(u64, u64), StoreError> {
        let last: Option<(i64, i64, i64)> = self
            .conn
            .query_row_cached(
                "SELECT ordinal, base_seq, records FROM audit_segments ORDER BY ordinal DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("last audit segment", e))?;
        Ok(match last {
            Some((o, b, n)) => (
                to_u64(o).saturating_add(1),
                to_u64(b).saturating_add(to_u64(n)),
            ),
            None => (1, 0),
        })
    }

    fn audit_used(&self) -> Result<u64, StoreError> {
        let v: i64 = self
            .conn
            .query_row_cached(
                "SELECT audit_charged FROM quota_totals WHERE id = 1",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read audit usage", e))?;
        Ok(to_u64(v))
    }

    /// Appends one audit record on its own (see the module docs): through
    /// the outbox, which it then flushes. Returns only once the record is
    /// in its segment, with the sequence it got.
    ///
    /// # Errors
    /// [`OpError::Refused`] for an invalid record or when the audit budget
    /// (after rotation) or the free-space floor cannot hold it (the record
    /// then stays in the outbox, durable, for a later flush);
    /// [`OpError::Store`] when a file or the database failed (nothing
    /// committed; the uncommitted bytes are cut back).
    pub fn audit(&mut self, rec: &AuditRecord, now_ms: i64) -> Result<AuditAck, OpError> {
        rec.check()?;
        let id = outbox_insert(&self.conn, rec, Strictness::Must)?
            .ok_or_else(|| StoreError::Integrity("the audit record was not queued".into()))?;
        let mut ack = None;
        let mut rotated = 0;
        while let Some(batch) = self.flush_audit_batch(now_ms)? {
            rotated += batch.rotated;
            if batch.last_outbox_id >= id && ack.is_none() {
                ack = Some(AuditAck {
                    seq: batch.first_seq + (id - batch.first_outbox_id).unsigned_abs(),
                    ordinal: batch.ordinal,
                    rotated: 0,
                });
            }
        }
        let mut ack =
            ack.ok_or_else(|| StoreError::Integrity("the audit record was not flushed".into()))?;
        ack.rotated = rotated;
        Ok(ack)
    }

    /// Records waiting in the audit outbox.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn audit_outbox_len(&self) -> Result<u64, StoreError> {
        outbox_len(&self.conn)
    }

    /// Moves every record of the audit outbox into audit segments, in
    /// batches of at most [`AUDIT_FLUSH_BATCH`] records: one append, one
    /// fsync and one transaction each, which also deletes the moved rows.
    /// Returns how many moved.
    ///
    /// # Errors
    /// As [`Store::audit`]; what was not moved stays in the outbox.
    pub fn flush_audit(&mut self, now_ms: i64) -> Result<u64, OpError> {
        let mut moved = 0;
        while let Some(batch) = self.flush_audit_batch(now_ms)? {
            moved += batch.records;
        }
        if moved > 0 {
            tracing::debug!(moved, "audit outbox flushed");
        }
        Ok(moved)
    }

    /// After an audited write: flushes the outbox once it holds
    /// [`AUDIT_FLUSH_AT`] records. A failure is logged and counted; the
    /// records stay durable in the outbox.
    pub(crate) fn after_audited(&mut self, now_ms: i64) {
        if now_ms < self.audit_flush_backoff_until {
            return;
        }
        match outbox_len(&self.conn) {
            Ok(n) if n >= AUDIT_FLUSH_AT => {
                if let Err(e) = self.flush_audit(now_ms) {
                    self.audit_flush_backoff_until = now_ms.saturating_add(AUDIT_FLUSH_BACKOFF_MS);
                    self.metrics.audit_flush_failures.inc();
                    tracing::warn!(error = %e, waiting = n, "audit outbox not flushed; it stays durable");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "audit outbox length unreadable"),
        }
    }

    /// Moves the oldest outbox records that fit one segment. `None` when
    /// the outbox is empty.
    fn flush_audit_batch(&mut self, now_ms: i64) -> Result<Option<FlushedBatch>, OpError> {
        let rows: Vec<(i64, Vec<u8>)> = {
            let mut stmt = self
                .conn
                .prepare_cached("SELECT id, record FROM audit_outbox ORDER BY id LIMIT ?1")
                .map_err(|e| StoreError::sqlite("read audit outbox", e))?;
            let rows = stmt
                .query_map(params![AUDIT_FLUSH_BATCH as i64], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .map_err(|e| StoreError::sqlite("read audit outbox", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("read audit outbox", e))?
        };
        let Some(&(first_id, _)) = rows.first() else {
            return Ok(None);
        };
        // chain each record to the one before it, then compress it; the
        // segment choice depends on their sizes. A record's hash is the
        // SHA-256 of its encoding, which its segment record carries too
        let chain_start = self.audit_chain_head()?;
        let mut head = chain_start;
        let mut prepared = Vec::with_capacity(rows.len());
        for (id, outboxed) in &rows {
            let mut rec = AuditRecord::decode(outboxed).ok_or_else(|| {
                StoreError::Integrity(format!("audit outbox row {id} does not decode"))
            })?;
            rec.prev_hash = Some(head);
            let raw = rec.encode();
            let raw_len = u32::try_from(raw.len())
                .ok()
                .filter(|n| *n <= MAX_AUDIT_RAW_BYTES)
                .ok_or_else(|| {
                    StoreError::Integrity(format!("audit outbox row {id} is too large"))
                })?;
            let stored = zstd::bulk::compress(&raw, 3)
                .map_err(|e| StoreError::io("compress audit record", "", e))?;
            let len = rvbox_segment::encoded_len(u32::try_from(stored.len()).unwrap_or(u32::MAX));
            head = sha256(&raw);
            prepared.push((*id, raw_len, head, stored, len, rec.time_ms));
        }

        let active = self.audit_active()?;
        let seal = self.opts.seal_bytes;
        // how many of `prepared` fit from `start` bytes (at least one)
        let fitting = |start: u64| -> usize {
            let mut used = start;
            let mut n = 0;
            for p in &prepared {
                if n > 0 && used.saturating_add(p.4) > seal {
                    break;
                }
                used = used.saturating_add(p.4);
                n += 1;
            }
            n
        };
        let first_len = prepared.first().map_or(0, |p| p.4);
        // (ordinal, base_seq, records, committed, new file?, sealing previous?)
        let (ordinal, base_seq, records, committed, new_file, seal_prev) = match active {
            Some(a) if a.committed == 0 || a.committed.saturating_add(first_len) <= seal => {
                (a.ordinal, a.base_seq, a.records, a.committed, false, None)
            }
            Some(a) => {
                let base = a.base_seq.saturating_add(a.records);
                (
                    a.ordinal.saturating_add(1),
                    base,
                    0,
                    0,
                    true,
                    Some(a.ordinal),
                )
            }
            None => {
                let (o, b) = self.audit_next()?;
                (o, b, 0, 0, true, None)
            }
        };
        let take = fitting(committed).min(prepared.len());
        let batch = prepared.get(..take).unwrap_or_default();
        let first_seq = base_seq.saturating_add(records).saturating_add(1);
        let limits = audit_limits();
        let mut bytes = Vec::new();
        let mut charged = 0u64;
        let (mut first_ms, mut last_ms) = (i64::MAX, i64::MIN);
        for (k, (_, raw_len, digest, stored, _, time_ms)) in batch.iter().enumerate() {
            let meta = RecordMeta {
                issue_uuid: [0; 16],
                seq: first_seq.saturating_add(k as u64),
                observed_unix_ms: *time_ms,
                receipt_unix_ms: now_ms,
                kind: Kind::Audit,
                stream: Stream::None,
                compression: Compression::Zstd,
                raw_len: *raw_len,
                sha256: *digest,
            };
            let one = rvbox_segment::encode(&meta, stored, &limits).map_err(|e| {
                StoreError::Integrity(format!("audit record does not encode: {}", e.code()))
            })?;
            charged = charged.saturating_add(
                charge(CHARGE_VERSION, ChargeKind::AuditRecord, one.len() as u64)
                    .map_err(|e| StoreError::Integrity(e.to_string()))?,
            );
            bytes.extend_from_slice(&one);
            first_ms = first_ms.min(*time_ms);
            last_ms = last_ms.max(*time_ms);
        }
        let last_id = batch.last().map_or(first_id, |p| p.0);

        // the separate audit budget, rotating oldest complete segments
        let free = self.free_space()?;
        let budget = self.opts.audit_budget_bytes;
        let mut rotated = 0;
        let used = self.audit_used()?;
        if let Err(refusal) = reserve_audit(
            &self.opts.tiers,
            budget,
            used,
            free,
            ChargeKind::AuditRecord,
            charged,
        ) {
            if refusal.tier == Tier::AuditBudget {
                rotated = self.rotate_audit(charged, now_ms)?;
            }
            let used = self.audit_used()?;
            if let Err(refusal) = reserve_audit(
                &self.opts.tiers,
                budget,
                used,
                free,
                ChargeKind::AuditRecord,
                charged,
            ) {
                tracing::warn!(tier = refusal.tier.name(), "audit records refused");
                return Err(DomainError::new(Code::QuotaExceeded, refusal.to_string()).into());
            }
        }

        // append + fsync under the committed-offset protocol
        let dir = self.layout.audit_dir();
        let name = audit_file_name(ordinal)
            .ok_or_else(|| StoreError::Integrity("audit ordinal out of range".into()))?;
        let path = dir.join(&name);
        let write = (|| -> Result<(), StoreError> {
            let mut f = if new_file {
                self.fs
                    .create_new(&path)
                    .map_err(|e| StoreError::io("create audit segment", &path, e))?
            } else {
                let mut f = self
                    .fs
                    .open(&path)
                    .map_err(|e| StoreError::io("open audit segment", &path, e))?;
                if f.len()
                    .map_err(|e| StoreError::io("stat audit segment", &path, e))?
                    > committed
                {
                    f.truncate(committed)
                        .map_err(|e| StoreError::io("truncate uncommitted audit tail", &path, e))?;
                }
                f
            };
            f.append(&bytes)
                .map_err(|e| StoreError::io("append audit record", &path, e))?;
            f.sync_data()
                .map_err(|e| StoreError::io("sync audit segment", &path, e))?;
            if new_file {
                self.fs
                    .sync_dir(&dir)
                    .map_err(|e| StoreError::io("sync audit directory", &dir, e))?;
            }
            Ok(())
        })();
        if let Err(e) = write {
            self.audit_rollback(&path, new_file, committed);
            tracing::error!(ordinal, error = %e, "audit append failed; nothing committed");
            return Err(e.into());
        }
        self.hook.at(points::AUDIT_AFTER_FSYNC);
        let commit = AuditCommit {
            ordinal,
            base_seq,
            new_file,
            seal_prev,
            len: bytes.len() as u64,
            records: take as u64,
            charged,
            first_ms,
            last_ms,
            outbox_upto: last_id,
            chain_start,
            chain_end: batch.last().map_or(chain_start, |p| p.2),
        };
        if let Err(e) = self.audit_commit(&commit, now_ms) {
            self.audit_rollback(&path, new_file, committed);
            tracing::error!(ordinal, error = %e, "audit commit failed; nothing committed");
            return Err(e.into());
        }
        self.metrics.audit_records.inc_by(take as u64);
        tracing::debug!(first_seq, records = take, ordinal, "audit records appended");
        Ok(Some(FlushedBatch {
            first_outbox_id: first_id,
            last_outbox_id: last_id,
            first_seq,
            ordinal,
            records: take as u64,
            rotated,
        }))
    }

    fn audit_commit(&mut self, c: &AuditCommit, now_ms: i64) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin audit commit", e))?;
        if let Some(prev) = c.seal_prev {
            tx.execute_cached(
                "UPDATE audit_segments SET state = 'sealed' WHERE ordinal = ?1 AND state = 'active'",
                params![to_i64(prev)],
            )
            .map_err(|e| StoreError::sqlite("seal audit segment", e))?;
        }
        if c.new_file {
            tx.execute_cached(
                "INSERT INTO audit_segments (ordinal, base_seq, created_ms) VALUES (?1, ?2, ?3)",
                params![to_i64(c.ordinal), to_i64(c.base_seq), now_ms],
            )
            .map_err(|e| StoreError::sqlite("insert audit segment", e))?;
        }
        tx.execute_cached(
            "UPDATE audit_segments SET committed_end = committed_end + ?2, records = records + ?3,
                 charged_bytes = charged_bytes + ?4,
                 first_ms = COALESCE(first_ms, ?5),
                 last_ms = MAX(COALESCE(last_ms, ?6), ?6),
                 chain_start = COALESCE(chain_start, ?7),
                 chain_end = ?8
             WHERE ordinal = ?1",
            params![
                to_i64(c.ordinal),
                to_i64(c.len),
                to_i64(c.records),
                to_i64(c.charged),
                c.first_ms,
                c.last_ms,
                c.chain_start.as_slice(),
                c.chain_end.as_slice()
            ],
        )
        .map_err(|e| StoreError::sqlite("advance audit committed_end", e))?;
        tx.execute_cached(
            "UPDATE quota_totals SET audit_charged = audit_charged + ?1 WHERE id = 1",
            params![to_i64(c.charged)],
        )
        .map_err(|e| StoreError::sqlite("charge audit", e))?;
        tx.execute_cached(
            "DELETE FROM audit_outbox WHERE id <= ?1",
            params![c.outbox_upto],
        )
        .map_err(|e| StoreError::sqlite("empty audit outbox", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit audit record", e))
    }

    /// Cuts a failed append back (or removes the new file); a cut that
    /// fails is left to recovery, which truncates beyond `committed_end`.
    fn audit_rollback(&self, path: &std::path::Path, new_file: bool, committed: u64) {
        let ok = if new_file {
            self.fs.remove_file(path).is_ok()
        } else {
            self.fs
                .open(path)
                .and_then(|mut f| f.truncate(committed))
                .is_ok()
        };
        if !ok {
            tracing::warn!(path = %path.display(), "audit tail not cut back; recovery will");
        }
    }

    /// Rotates the oldest complete audit segments so the audit bytes plus
    /// `incoming` fit the budget, plus those past the audit age (0 = off).
    /// Returns how many rotated.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn rotate_audit(&mut self, incoming: u64, now_ms: i64) -> Result<u64, StoreError> {
        let segments: Vec<AuditSegment> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT ordinal, charged_bytes, state, COALESCE(last_ms, created_ms)
                     FROM audit_segments ORDER BY ordinal",
                )
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            let rows = stmt
                .query_map([], |r| {
                    let state: String = r.get(2)?;
                    Ok(AuditSegment {
                        ordinal: u32::try_from(r.get::<_, i64>(0)?).unwrap_or(u32::MAX),
                        charged: to_u64(r.get(1)?),
                        // a damaged segment keeps its incident; its bytes
                        // still rotate with the rest of the old history
                        sealed: state != "active",
                        newest_unix_ms: r.get(3)?,
                    })
                })
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("list audit segments", e))?
        };
        let plan = plan_audit_rotation(
            &segments,
            self.opts.audit_budget_bytes,
            self.opts.audit_retention_ms,
            now_ms,
            incoming,
        );
        if plan.drop.is_empty() {
            return Ok(0);
        }
        let entropy = std::sync::Arc::clone(&self.entropy);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin audit rotation", e))?;
        let mut freed = 0u64;
        for ordinal in &plan.drop {
            let charged: Option<i64> = tx
                .query_row_cached(
                    "SELECT charged_bytes FROM audit_segments WHERE ordinal = ?1 AND state <> 'active'",
                    params![ordinal],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| StoreError::sqlite("recheck audit segment", e))?;
            let Some(charged) = charged else {
                return Ok(0);
            };
            freed = freed.saturating_add(to_u64(charged));
            // the oldest kept segment continues this one's last record
            let end: Option<Vec<u8>> = tx
                .query_row_cached(
                    "SELECT chain_end FROM audit_segments WHERE ordinal = ?1",
                    params![ordinal],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::sqlite("read rotated audit chain", e))?;
            if let Some(end) = end {
                tx.execute_cached(
                    "INSERT INTO store_meta (key, value) VALUES ('audit_chain_floor', ?1)
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    params![end],
                )
                .map_err(|e| StoreError::sqlite("record audit chain floor", e))?;
            }
            tx.execute_cached(
                "DELETE FROM audit_segments WHERE ordinal = ?1",
                params![ordinal],
            )
            .map_err(|e| StoreError::sqlite("drop audit segment", e))?;
            let name = audit_file_name(u64::from(*ordinal))
                .ok_or_else(|| StoreError::Integrity("audit ordinal out of range".into()))?;
            queue_deletion(&tx, entropy.as_ref(), Origin::Audit, &name, None, now_ms)?;
        }
        let used: i64 = tx
            .query_row_cached(
                "SELECT audit_charged FROM quota_totals WHERE id = 1",
                [],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read audit usage", e))?;
        let after = release_audit(to_u64(used), freed)
            .map_err(|e| StoreError::Integrity(format!("audit release: {e}")))?;
        tx.execute_cached(
            "UPDATE quota_totals SET audit_charged = ?1 WHERE id = 1",
            params![to_i64(after)],
        )
        .map_err(|e| StoreError::sqlite("release audit", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit audit rotation", e))?;
        let n = plan.drop.len() as u64;
        tracing::info!(segments = n, freed, "audit segments rotated");
        if let Err(e) = self.finish_pending(None) {
            tracing::warn!(error = %e, "rotated audit files not yet removed; the sweeper finishes them");
        }
        Ok(n)
    }

    /// Recovers audit segments the way command segments are recovered:
    /// bytes beyond `committed_end` are cut (an `UNCOMMITTED_TAIL` incident
    /// recorded already repaired), a missing or corrupt committed range
    /// marks the segment `damaged` with an open `AUDIT`-scope incident, and
    /// audit files without a row are removed. Idempotent.
    ///
    /// # Errors
    /// [`StoreError`] when the database failed.
    pub fn recover_audit(&mut self, now_ms: i64) -> Result<AuditRecoveryReport, StoreError> {
        let mut report = AuditRecoveryReport::default();
        let rows: Vec<(u64, u64)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT ordinal, committed_end FROM audit_segments
                     WHERE state IN ('active', 'sealed') ORDER BY ordinal",
                )
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            let rows = stmt
                .query_map([], |r| Ok((to_u64(r.get(0)?), to_u64(r.get(1)?))))
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("list audit segments", e))?
        };
        for (ordinal, committed) in rows {
            report.segments_scanned += 1;
            if let Err(e) = self.recover_audit_segment(ordinal, committed, now_ms, &mut report) {
                tracing::error!(ordinal, error = %e, "audit segment recovery failed");
            }
        }
        // orphans: canonical audit names with no row (a segment created by
        // an append that never committed, or rotated before its move)
        let dir = self.layout.audit_dir();
        let names = self
            .fs
            .list(&dir, MAX_AUDIT_FILES)
            .map_err(|e| StoreError::io("list audit segments", &dir, e))?;
        for name in names {
            let Some(ordinal) = parse_audit_file_name(&name) else {
                tracing::warn!(file = %name, "unrecognised file in the audit directory left alone");
                continue;
            };
            let known: bool = self
                .conn
                .query_row_cached(
                    "SELECT EXISTS (SELECT 1 FROM audit_segments WHERE ordinal = ?1)",
                    params![to_i64(ordinal)],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::sqlite("check audit row", e))?;
            if !known {
                let path = dir.join(&name);
                self.fs
                    .remove_file(&path)
                    .map_err(|e| StoreError::io("remove orphan audit segment", &path, e))?;
                report.orphans_removed += 1;
            }
        }
        if report.orphans_removed > 0 {
            self.fs
                .sync_dir(&dir)
                .map_err(|e| StoreError::io("sync audit directory", &dir, e))?;
        }
        Ok(report)
    }

    fn recover_audit_segment(
        &mut self,
        ordinal: u64,
        committed: u64,
        now_ms: i64,
        report: &mut AuditRecoveryReport,
    ) -> Result<(), StoreError> {
        let name = audit_file_name(ordinal)
            .ok_or_else(|| StoreError::Integrity("audit ordinal out of range".into()))?;
        let path = self.layout.audit_dir().join(&name);
        let limits = audit_limits();
        let max_len = self
            .opts
            .seal_bytes
            .saturating_add(u64::from(limits.max_stored_len))
            .saturating_add(rvbox_segment::RECORD_OVERHEAD)
            .max(committed);
        let (buf, file_len) = match self.fs.open(&path) {
            Ok(f) => {
                let len = f
                    .len()
                    .map_err(|e| StoreError::io("stat audit segment", &path, e))?;
                let mut buf = vec![0u8; usize::try_from(len.min(max_len)).unwrap_or(0)];
                f.read_exact_at(&mut buf, 0)
                    .map_err(|e| StoreError::io("read audit segment", &path, e))?;
                (buf, len)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), 0),
            Err(e) => return Err(StoreError::io("open audit segment", &path, e)),
        };
        let key = ordinal.to_string();
        let evidence = format!("committed_end={committed} file_len={file_len}").into_bytes();
        match scan(&buf, committed, &limits).recovery {
            Recovery::Clean if file_len <= max_len => Ok(()),
            Recovery::Clean | Recovery::TruncateTail { .. } => {
                let mut f = self
                    .fs
                    .open(&path)
                    .map_err(|e| StoreError::io("open audit segment", &path, e))?;
                f.truncate(committed)
                    .map_err(|e| StoreError::io("truncate uncommitted audit tail", &path, e))?;
                report.tails_truncated += 1;
                self.record_incident(
                    &NewIncident {
                        kind: wire::IncidentKind::UncommittedTail,
                        scope_kind: wire::ScopeKind::Audit,
                        scope_key: key,
                        client_id: None,
                        issue_uuid: None,
                        summary: format!(
                            "{} unacknowledged audit bytes beyond the committed end were truncated",
                            file_len.saturating_sub(committed)
                        ),
                        evidence,
                        data_loss: false,
                    },
                    now_ms,
                    true,
                )?;
                tracing::warn!(ordinal, "audit uncommitted tail truncated");
                Ok(())
            }
            Recovery::CommittedDamage {
                tail_beyond_committed,
                lost,
            } => {
                if tail_beyond_committed {
                    let mut f = self
                        .fs
                        .open(&path)
                        .map_err(|e| StoreError::io("open audit segment", &path, e))?;
                    f.truncate(committed)
                        .map_err(|e| StoreError::io("truncate uncommitted audit tail", &path, e))?;
                }
                let kind = if file_len < committed {
                    wire::IncidentKind::MissingCommittedBytes
                } else {
                    wire::IncidentKind::ChecksumMismatch
                };
                let lost_bytes: u64 = lost.iter().map(rvbox_segment::ByteRange::len).sum();
                // the incident and the damaged mark commit together
                let id = crate::entropy::uuid_v7(self.entropy.as_ref(), now_ms)
                    .map_err(|e| StoreError::io("mint incident id", "", e))?;
                let tx = self
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(|e| StoreError::sqlite("begin audit damage record", e))?;
                crate::incidents::insert(
                    &tx,
                    id,
                    &NewIncident {
                        kind,
                        scope_kind: wire::ScopeKind::Audit,
                        scope_key: key,
                        client_id: None,
                        issue_uuid: None,
                        summary: format!(
                            "audit segment {ordinal} lost {lost_bytes} committed bytes; the records there are unreadable"
                        ),
                        evidence,
                        data_loss: true,
                    },
                    now_ms,
                )?;
                tx.execute_cached(
                    "UPDATE audit_segments SET state = 'damaged' WHERE ordinal = ?1",
                    params![to_i64(ordinal)],
                )
                .map_err(|e| StoreError::sqlite("mark audit segment damaged", e))?;
                tx.commit()
                    .map_err(|e| StoreError::sqlite("commit audit damage record", e))?;
                report.segments_damaged += 1;
                tracing::error!(ordinal, lost_bytes, "audit committed range lost");
                Ok(())
            }
        }
    }

    /// Checks the audit log against its hash chain, offline, reading
    /// every committed record of every audit segment in order: each
    /// record's checksum, that it decodes, that it names the hash of the
    /// record before it, that each segment continues the one before it
    /// (the oldest kept one continuing `store_meta.audit_chain_floor`), and
    /// that each segment's recomputed last hash and record count are the
    /// ones the database keeps. An edited record (its checksums made to
    /// match or not), a removed or reordered record, and a replaced or
    /// removed segment are each a problem naming where. Records written
    /// before the chain existed are counted apart. Changes nothing.
    ///
    /// # Errors
    /// [`StoreError`] when the database cannot be read; what the files
    /// hold is reported as problems.
    pub fn verify_audit(&self) -> Result<AuditVerification, StoreError> {
        type Row = (u64, u64, u64, u64, String, Option<Vec<u8>>, Option<Vec<u8>>);
        let rows: Vec<Row> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT ordinal, committed_end, base_seq, records, state, chain_start, chain_end
                     FROM audit_segments ORDER BY ordinal",
                )
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        to_u64(r.get(0)?),
                        to_u64(r.get(1)?),
                        to_u64(r.get(2)?),
                        to_u64(r.get(3)?),
                        r.get(4)?,
                        r.get(5)?,
                        r.get(6)?,
                    ))
                })
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("list audit segments", e))?
        };
        let limits = audit_limits();
        let mut v = AuditVerification::default();
        // the hash the next chained record must name
        let mut expect = self.audit_chain_floor()?.unwrap_or([0; 32]);
        let mut chain_began = false;
        for (ordinal, committed, base_seq, records, state, start, end) in rows {
            v.segments += 1;
            let at = format!("audit segment {ordinal}");
            let start = start
                .map(|h| hash32(&h, "audit_segments.chain_start"))
                .transpose()?;
            let end = end
                .map(|h| hash32(&h, "audit_segments.chain_end"))
                .transpose()?;
            if state == "damaged" {
                v.problems.push(format!(
                    "{at} is marked damaged (see the storage incidents); not checked"
                ));
                chain_began |= end.is_some();
                if let Some(e) = end {
                    expect = e;
                }
                continue;
            }
            let name = audit_file_name(ordinal)
                .ok_or_else(|| StoreError::Integrity("audit ordinal out of range".into()))?;
            let path = self.layout.audit_dir().join(name);
            let buf = match self.fs.open(&path).and_then(|f| {
                let len = f.len()?;
                if committed > len {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the file holds {len} bytes, {committed} are committed"),
                    ));
                }
                let mut buf = vec![0u8; usize::try_from(committed).unwrap_or(0)];
                f.read_exact_at(&mut buf, 0)?;
                Ok(buf)
            }) {
                Ok(b) => b,
                Err(e) => {
                    v.problems
                        .push(format!("{at} cannot be read ({}): {e}", path.display()));
                    continue;
                }
            };
            let mut off = 0usize;
            let mut seen = 0u64;
            let mut first_in_segment = true;
            while off < buf.len() {
                let seq = base_seq.saturating_add(seen).saturating_add(1);
                let rest = buf.get(off..).unwrap_or_default();
                let rec = match rvbox_segment::decode(rest, &limits) {
                    Ok(r) => r,
                    Err(e) => {
                        v.problems.push(format!(
                            "{at}: the record after sequence {} fails its checksum or framing ({}); the rest of the segment is not checked",
                            seq.saturating_sub(1),
                            e.code()
                        ));
                        break;
                    }
                };
                let len = usize::try_from(rvbox_segment::encoded_len(
                    u32::try_from(rec.payload.len()).unwrap_or(u32::MAX),
                ))
                .unwrap_or(usize::MAX);
                off = off.saturating_add(len.max(1));
                seen += 1;
                if rec.meta.seq != seq {
                    v.problems.push(format!(
                        "{at}: record {seen} has sequence {}, expected {seq} (records removed or reordered)",
                        rec.meta.seq
                    ));
                }
                let raw = match zstd::bulk::decompress(rec.payload, rec.meta.raw_len as usize) {
                    Ok(r) if sha256(&r) == rec.meta.sha256 => r,
                    _ => {
                        v.problems.push(format!(
                            "{at}: record {} does not decompress to its checksum",
                            rec.meta.seq
                        ));
                        continue;
                    }
                };
                let Some(decoded) = AuditRecord::decode(&raw) else {
                    v.problems
                        .push(format!("{at}: record {} does not decode", rec.meta.seq));
                    continue;
                };
                let Some(prev) = decoded.prev_hash else {
                    if chain_began {
                        v.problems.push(format!(
                            "{at}: record {} carries no chain hash after the chain began (replaced by an older record?)",
                            rec.meta.seq
                        ));
                    }
                    v.unchained += 1;
                    continue;
                };
                if first_in_segment && start.is_some_and(|s| s != prev) {
                    v.problems.push(format!(
                        "{at}: its first chained record does not continue the hash the database keeps for the segment"
                    ));
                }
                first_in_segment = false;
                if prev != expect {
                    v.problems.push(format!(
                        "{at}: record {} does not name the hash of the record before it (a record before it was edited, removed or reordered{})",
                        rec.meta.seq,
                        if chain_began { "" } else { ", or an older segment is missing" }
                    ));
                }
                chain_began = true;
                v.chained += 1;
                expect = sha256(&raw);
            }
            if seen != records {
                v.problems.push(format!(
                    "{at} holds {seen} committed records; the database says {records}"
                ));
            }
            if let Some(e) = end
                && e != expect
            {
                v.problems.push(format!(
                    "{at}: the hash of its last record is not the one the database keeps (its records were edited, removed or reordered)"
                ));
                // go on from what the database says, so one damaged
                // segment is not reported again in every later one
                expect = e;
            }
        }
        v.head = if chain_began { expect } else { [0; 32] };
        Ok(v)
    }

    /// Reads committed audit records with a sequence above `after_seq`, in
    /// order, at most `limit` (damaged segments are skipped: their loss is
    /// an incident).
    ///
    /// # Errors
    /// [`StoreError`] when a file or the database failed, or a committed
    /// record does not decode.
    pub fn read_audit(
        &self,
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<(u64, AuditRecord)>, StoreError> {
        let rows: Vec<(u64, u64)> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT ordinal, committed_end FROM audit_segments
                     WHERE state IN ('active', 'sealed') AND base_seq + records > ?1 ORDER BY ordinal",
                )
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            let rows = stmt
                .query_map(params![to_i64(after_seq)], |r| {
                    Ok((to_u64(r.get(0)?), to_u64(r.get(1)?)))
                })
                .map_err(|e| StoreError::sqlite("list audit segments", e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::sqlite("list audit segments", e))?
        };
        let limits = audit_limits();
        let mut out = Vec::new();
        for (ordinal, committed) in rows {
            let name = audit_file_name(ordinal)
                .ok_or_else(|| StoreError::Integrity("audit ordinal out of range".into()))?;
            let path = self.layout.audit_dir().join(name);
            let f = self
                .fs
                .open(&path)
                .map_err(|e| StoreError::io("open audit segment", &path, e))?;
            // the committed length comes from the database: bound it by the
            // file before allocating
            let file_len = f
                .len()
                .map_err(|e| StoreError::io("stat audit segment", &path, e))?;
            if committed > file_len {
                return Err(StoreError::Integrity(format!(
                    "audit segment {ordinal} is shorter than its committed length"
                )));
            }
            let mut buf = vec![0u8; usize::try_from(committed).unwrap_or(0)];
            f.read_exact_at(&mut buf, 0)
                .map_err(|e| StoreError::io("read audit segment", &path, e))?;
            let mut off = 0usize;
            while off < buf.len() {
                let rest = buf.get(off..).unwrap_or_default();
                let rec = rvbox_segment::decode(rest, &limits).map_err(|e| {
                    StoreError::Integrity(format!("audit record does not decode: {}", e.code()))
                })?;
                let len = usize::try_from(rvbox_segment::encoded_len(
                    u32::try_from(rec.payload.len()).unwrap_or(u32::MAX),
                ))
                .unwrap_or(usize::MAX);
                if rec.meta.seq > after_seq {
                    let raw = zstd::bulk::decompress(rec.payload, rec.meta.raw_len as usize)
                        .map_err(|e| StoreError::io("decompress audit record", &path, e))?;
                    let decoded = AuditRecord::decode(&raw).ok_or_else(|| {
                        StoreError::Integrity("audit record payload does not decode".into())
                    })?;
                    out.push((rec.meta.seq, decoded));
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
                off = off.saturating_add(len.max(1));
            }
        }
        // then the outbox: committed records not yet in a segment, with
        // the sequences their flush gives them
        let (_, next_base) = self.audit_next()?;
        let skip = after_seq.saturating_sub(next_base);
        let room = limit.saturating_sub(out.len());
        if room == 0 {
            return Ok(out);
        }
        let mut stmt = self
            .conn
            .prepare_cached("SELECT record FROM audit_outbox ORDER BY id LIMIT ?1 OFFSET ?2")
            .map_err(|e| StoreError::sqlite("read audit outbox", e))?;
        let rows = stmt
            .query_map(params![to_i64(room as u64), to_i64(skip)], |r| {
                r.get::<_, Vec<u8>>(0)
            })
            .map_err(|e| StoreError::sqlite("read audit outbox", e))?;
        for (k, raw) in rows.enumerate() {
            let raw = raw.map_err(|e| StoreError::sqlite("read audit outbox", e))?;
            let seq = next_base
                .saturating_add(skip)
                .saturating_add(k as u64)
                .saturating_add(1);
            let decoded = AuditRecord::decode(&raw).ok_or_else(|| {
                StoreError::Integrity("audit outbox record does not decode".into())
            })?;
            out.push((seq, decoded));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use crate::Store;
    use crate::operator::Caller;

    fn store(dir: &std::path::Path) -> Store {
        crate::store::test_store(dir)
    }

    #[test]
    fn a_record_written_in_a_transaction_that_rolled_back_is_written_again_with_the_failure() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let mut intent =
            AuditIntent::control(AuditRecord::control(&Caller::local(), "RunCommand", 5));
        {
            let tx = s.conn.transaction().unwrap();
            intent.write_in(&tx, Ok(())).unwrap();
            // the transaction fails after the record went in: rolled back
        }
        assert_eq!(s.audit_outbox_len().unwrap(), 0);
        let failed: Result<(), OpError> = Err(OpError::Store(StoreError::Integrity(
            "commit failed".into(),
        )));
        s.audit_unwritten(&mut intent, &failed, 5);
        let read = s.read_audit(0, 10).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].1.outcome, AuditOutcome::Failed);
        assert!(
            read[0].1.detail.contains("commit failed"),
            "{:?}",
            read[0].1
        );
    }

    #[test]
    fn a_record_too_large_for_the_outbox_keeps_its_key_count_not_every_name() {
        let mut rec = AuditRecord::control(&Caller::local(), "RunCommand", 5);
        rec.env_keys = (0..MAX_AUDIT_ENV_KEYS)
            .map(|n| format!("KEY_{n:0>200}"))
            .collect();
        let fitted = rec.clone().bounded().fit(MAX_OUTBOX_RECORD_BYTES);
        assert!(fitted.encode().len() <= MAX_OUTBOX_RECORD_BYTES);
        assert!(!fitted.env_keys.is_empty());
        let left = MAX_AUDIT_ENV_KEYS - fitted.env_keys.len();
        assert!(
            fitted
                .detail
                .contains(&format!("{left} more environment key names")),
            "{}",
            fitted.detail
        );
        assert!(fitted.check().is_ok());
        // a small record is unchanged
        let small = AuditRecord::control(&Caller::local(), "RunCommand", 5);
        assert_eq!(small.clone().fit(MAX_OUTBOX_RECORD_BYTES), small);
    }
}
