//! Operator views of commands and clients (plan §9.1: `GetCommand`,
//! `ListCommands`, `ListClients`, `GetClient`), read from one snapshot of
//! the metadata.
//!
//! Lists page by an authenticated token holding the last row's sort key
//! (never SQL OFFSET): commands by issue time descending, then UUID
//! descending; clients by id ascending. A token is bound to the listing
//! and its filters, so reusing it with another `client_id` is refused.
//!
//! Every statement here is served by an index: the command's primary key,
//! `commands_by_client_issue` or `commands_by_issue`, the events' and
//! truncations' per-command keys, and the clients' primary key.

use rusqlite::{Connection, OptionalExtension, params};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::labels::{Labels, Selector, check_client_glob, glob_match};
use rvbox_domain::limits;
use rvbox_domain::token::{PagePosition, TokenCodec, TokenKey, TokenKind, encode_filters};
use rvbox_proto::v1 as wire;

use crate::error::StoreError;
use crate::health::Health;
use crate::mutations::OpError;
use crate::store::{to_timestamp, to_u64};

/// Most dirty scopes one record or client lists.
pub const MAX_DIRTY_SCOPES: usize = 100;

const RECORD_COLUMNS: &str = "c.issue_uuid, c.client_id, c.lifecycle, c.revision, \
     c.issue_time_ms, c.queue_expiry_ms, c.terminal_time_ms, c.exit_code, c.exit_signal, \
     c.rejection, c.resolved_shell, c.last_event_seq, c.expired_pending, c.retention, \
     c.request_hash, c.spec_zstd";

/// One `commands` row as a record is built from it (every store backend
/// reads these columns).
#[derive(Debug, Clone)]
pub struct Raw {
    /// Id.
    pub issue: Vec<u8>,
    /// Client.
    pub client_id: String,
    /// Lifecycle (wire number).
    pub lifecycle: i32,
    /// Revision.
    pub revision: i64,
    /// Issue time.
    pub issue_ms: i64,
    /// Queue expiry.
    pub expiry_ms: Option<i64>,
    /// Terminal time.
    pub terminal_ms: Option<i64>,
    /// Exit code.
    pub exit_code: Option<i64>,
    /// Terminating signal.
    pub exit_signal: Option<i64>,
    /// Encoded rejection.
    pub rejection: Option<Vec<u8>>,
    /// The shell the client resolved.
    pub resolved_shell: Option<i32>,
    /// Last stored event.
    pub last_event_seq: i64,
    /// Expired pending reconciliation.
    pub expired_pending: bool,
    /// `retained` or `evicting`.
    pub retention: String,
    /// Request hash.
    pub request_hash: Vec<u8>,
    /// The compressed execution spec.
    pub spec_zstd: Vec<u8>,
}

/// What a record needs besides its row: the first and last stored event,
/// whether the server removed output, and whether the client reported a
/// gap (a truncation or incomplete marker).
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordFacts {
    /// First stored event.
    pub first_event_seq: Option<i64>,
    /// Last stored event.
    pub last_event_seq: Option<i64>,
    /// The server removed output.
    pub removed: bool,
    /// The client reported a gap (only asked of an ended command).
    pub client_gap: bool,
}

fn raw_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<Raw> {
    Ok(Raw {
        issue: r.get(0)?,
        client_id: r.get(1)?,
        lifecycle: r.get(2)?,
        revision: r.get(3)?,
        issue_ms: r.get(4)?,
        expiry_ms: r.get(5)?,
        terminal_ms: r.get(6)?,
        exit_code: r.get(7)?,
        exit_signal: r.get(8)?,
        rejection: r.get(9)?,
        resolved_shell: r.get(10)?,
        last_event_seq: r.get(11)?,
        expired_pending: r.get(12)?,
        retention: r.get(13)?,
        request_hash: r.get(14)?,
        spec_zstd: r.get(15)?,
    })
}

fn sqlite(what: &'static str) -> impl Fn(rusqlite::Error) -> StoreError {
    move |e| StoreError::sqlite(what, e)
}

fn uuid_text(bytes: &[u8]) -> String {
    <[u8; 16]>::try_from(bytes)
        .map(|b| uuid::Uuid::from_bytes(b).hyphenated().to_string())
        .unwrap_or_default()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(32), |mut s, b| {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `GetCommand`: one command's record.
///
/// # Errors
/// `NOT_FOUND`, or a store failure (a stored spec that does not decode is
/// an integrity failure).
pub fn command_record(
    conn: &Connection,
    health: &Health,
    issue: &[u8; 16],
) -> Result<wire::CommandRecord, OpError> {
    let raw = conn
        .prepare_cached(&format!(
            "SELECT {RECORD_COLUMNS} FROM commands c WHERE c.issue_uuid = ?1"
        ))
        .and_then(|mut st| st.query_row(params![issue.as_slice()], raw_of).optional())
        .map_err(sqlite("read command"))?
        .ok_or_else(|| OpError::Refused(DomainError::new(Code::NotFound, "no such command")))?;
    Ok(finish(conn, health, raw)?)
}

fn is_terminal(lifecycle: wire::Lifecycle) -> bool {
    rvbox_domain::lifecycle::Lifecycle::from_wire(lifecycle as i32).is_ok_and(|l| l.is_terminal())
}

fn finish(conn: &Connection, health: &Health, raw: Raw) -> Result<wire::CommandRecord, StoreError> {
    let lifecycle =
        wire::Lifecycle::try_from(raw.lifecycle).unwrap_or(wire::Lifecycle::Unspecified);
    let (first, last): (Option<i64>, Option<i64>) = conn
        .prepare_cached(
            "SELECT MIN(event_seq), MAX(event_seq) FROM command_events WHERE issue_uuid = ?1",
        )
        .and_then(|mut st| st.query_row(params![raw.issue], |r| Ok((r.get(0)?, r.get(1)?))))
        .map_err(sqlite("read retained range"))?;
    let removed: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM output_truncations WHERE issue_uuid = ?1)")
        .and_then(|mut st| st.query_row(params![raw.issue], |r| r.get(0)))
        .map_err(sqlite("read truncations"))?;
    let terminal = is_terminal(lifecycle);
    // a client-side gap is a sequenced marker event of the command
    let client_gap: bool = if terminal && !removed {
        conn.prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM command_events WHERE issue_uuid = ?1 AND body_kind IN (?2, ?3))",
        )
        .and_then(|mut st| {
            st.query_row(
                params![
                    raw.issue,
                    crate::events::body_kind::TRUNCATION,
                    crate::events::body_kind::INCOMPLETE
                ],
                |r| r.get(0),
            )
        })
        .map_err(sqlite("read output markers"))?
    } else {
        false
    };
    let key = uuid_text(&raw.issue);
    let seg_prefix = format!("{}/", hex(&raw.issue));
    let dirty_scopes = health.dirty_scopes(
        |kind, k| match kind {
            wire::ScopeKind::Command => k == key,
            wire::ScopeKind::Segment => {
                k.starts_with(&seg_prefix) || k.starts_with(&format!("{key}/"))
            }
            wire::ScopeKind::Client => k == raw.client_id,
            wire::ScopeKind::GlobalStore => true,
            _ => false,
        },
        MAX_DIRTY_SCOPES,
    );
    record_of(
        raw,
        RecordFacts {
            first_event_seq: first,
            last_event_seq: last,
            removed,
            client_gap,
        },
        dirty_scopes,
    )
}

/// A command's record from its row, its facts and its dirty scopes (pure:
/// every store backend builds records so).
///
/// # Errors
/// [`StoreError::Integrity`] when the stored spec does not decode.
pub fn record_of(
    raw: Raw,
    facts: RecordFacts,
    dirty_scopes: Vec<wire::ScopeHealth>,
) -> Result<wire::CommandRecord, StoreError> {
    let lifecycle =
        wire::Lifecycle::try_from(raw.lifecycle).unwrap_or(wire::Lifecycle::Unspecified);
    let (first, last, removed) = (facts.first_event_seq, facts.last_event_seq, facts.removed);
    let terminal = is_terminal(lifecycle);
    let client_gap = terminal && !removed && facts.client_gap;
    let retention_status = if raw.retention == "evicting" {
        wire::RetentionStatus::Evicting
    } else if removed {
        wire::RetentionStatus::Partial
    } else {
        wire::RetentionStatus::Complete
    };
    let exit_result = terminal.then(|| wire::ExitResult {
        lifecycle: lifecycle as i32,
        exit_code: raw.exit_code.and_then(|c| i32::try_from(c).ok()),
        signal_number: raw.exit_signal.and_then(|c| i32::try_from(c).ok()),
        signal_name: String::new(),
    });
    let rejection = raw
        .rejection
        .as_deref()
        .and_then(|b| <wire::ErrorDetail as prost::Message>::decode(b).ok());
    let expiry = if lifecycle == wire::Lifecycle::Expired {
        Some(wire::ExpiryRecord {
            expired_time: raw.terminal_ms.map(to_timestamp),
            reason: "the queue TTL elapsed before the command was dispatched".into(),
        })
    } else if raw.expired_pending {
        Some(wire::ExpiryRecord {
            expired_time: raw.expiry_ms.map(to_timestamp),
            reason: "the queue TTL elapsed after dispatch; the client's answer decides the outcome"
                .into(),
        })
    } else {
        None
    };
    let cap = usize::try_from(limits::MAX_EXECUTION_SPEC_BYTES).unwrap_or(0);
    let spec = zstd::bulk::decompress(&raw.spec_zstd, cap)
        .ok()
        .and_then(|b| <wire::ExecutionSpec as prost::Message>::decode(b.as_slice()).ok())
        .ok_or_else(|| {
            StoreError::Integrity(format!(
                "the stored execution spec of {} does not decode",
                uuid_text(&raw.issue)
            ))
        })?;
    let key = uuid_text(&raw.issue);
    Ok(wire::CommandRecord {
        issue_uuid: key,
        client_id: raw.client_id,
        lifecycle: lifecycle as i32,
        revision: to_u64(raw.revision),
        issue_time: Some(to_timestamp(raw.issue_ms)),
        queue_expiry_time: raw.expiry_ms.map(to_timestamp),
        terminal_time: raw.terminal_ms.map(to_timestamp),
        exit_result,
        last_event_seq: to_u64(raw.last_event_seq),
        retention_status: retention_status as i32,
        retained_range: Some(wire::RetainedRange {
            first_event_seq: first.map_or(0, to_u64),
            last_event_seq: last.map_or(0, to_u64),
        }),
        rejection,
        expiry,
        expired_pending_reconciliation: raw.expired_pending,
        terminal_output_incomplete: terminal && (removed || client_gap),
        dirty_scopes,
        spec: Some(spec),
        request_hash: raw.request_hash,
        resolved_shell: raw.resolved_shell.unwrap_or(0),
    })
}

/// The page size a request asks for, checked.
///
/// # Errors
/// `INVALID_ARGUMENT` above [`limits::MAX_PAGE_SIZE`].
pub fn page_size(asked: u32) -> Result<u32, DomainError> {
    match u64::from(asked) {
        0 => Ok(u32::try_from(limits::DEFAULT_PAGE_SIZE).unwrap_or(100)),
        n if n > limits::MAX_PAGE_SIZE => Err(DomainError::new(
            Code::InvalidArgument,
            format!(
                "page_size {n} is above the maximum of {}",
                limits::MAX_PAGE_SIZE
            ),
        )),
        n => Ok(u32::try_from(n).unwrap_or(100)),
    }
}

pub(crate) fn token_error(e: &rvbox_domain::token::TokenError) -> OpError {
    OpError::Refused(DomainError::new(Code::InvalidArgument, e.to_string()))
}

/// Most rows one filtered page examines (a selector or a glob is matched
/// here, not in SQL): a page may come back short, or empty, with a token
/// to go on from.
pub const MAX_FILTER_SCAN: usize = 10_000;

/// The selector of a list request; `None` for the empty text.
pub(crate) fn selector_of(text: &str) -> Result<Option<Selector>, OpError> {
    if text.is_empty() {
        return Ok(None);
    }
    Selector::parse(text).map(Some).map_err(|e| {
        OpError::Refused(DomainError::new(Code::InvalidArgument, e.0).with_field("selector"))
    })
}

/// One page of a filtered scan: from `scanned` (ids in order, each with
/// what the filter reads; at most [`MAX_FILTER_SCAN`] of them), the first
/// `limit` ids that `hit`, whether a further page may hold more, and the
/// last id examined (where the next page starts).
pub(crate) fn pick_page<T>(
    scanned: Vec<(String, T)>,
    limit: usize,
    hit: impl Fn(&str, &T) -> bool,
) -> (Vec<String>, bool, Option<String>) {
    let exhausted = scanned.len() < MAX_FILTER_SCAN;
    let mut picked = Vec::new();
    let mut last = None;
    let mut more = false;
    for (id, data) in scanned {
        let matched = hit(&id, &data);
        if matched && picked.len() == limit {
            more = true;
            break;
        }
        if matched {
            picked.push(id.clone());
        }
        last = Some(id);
    }
    (picked, more || !exhausted, last)
}

/// The labels a `clients` row keeps. A row that does not parse (never
/// written so) matches no selector term that needs a label.
pub fn stored_labels(text: &str) -> Labels {
    Labels::parse_stored(text).unwrap_or_else(|e| {
        tracing::error!(error = %e, "stored client labels do not parse");
        Labels::default()
    })
}

/// Where the command listing finds its rows: one rule for the page,
/// one source per store backend.
pub trait RecordSource {
    /// Rows after the position `(after_ms, after_id)` (newest first), of
    /// `client` or of all, at most `limit`.
    ///
    /// # Errors
    /// A store failure.
    fn commands_after(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<Raw>, StoreError>;
    /// The sort keys and client labels of the commands after the position,
    /// at most `max` (a filtered page matches labels here, not in SQL).
    ///
    /// # Errors
    /// A store failure.
    fn scan_commands(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        max: usize,
    ) -> Result<Vec<(i64, Vec<u8>, String)>, StoreError>;
    /// One command's row.
    ///
    /// # Errors
    /// A store failure (the row must exist).
    fn command_row(&mut self, id: &[u8]) -> Result<Raw, StoreError>;
    /// The record of a row.
    ///
    /// # Errors
    /// A store failure.
    fn record(&mut self, raw: Raw) -> Result<wire::CommandRecord, StoreError>;
}

struct SqliteRecords<'c> {
    conn: &'c Connection,
    health: &'c Health,
}

impl RecordSource for SqliteRecords<'_> {
    fn commands_after(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<Raw>, StoreError> {
        let sql = if client.is_some() {
            format!(
                "SELECT {RECORD_COLUMNS} FROM commands c
                 WHERE c.client_id = ?1
                   AND (c.issue_time_ms < ?2 OR (c.issue_time_ms = ?2 AND c.issue_uuid < ?3))
                 ORDER BY c.issue_time_ms DESC, c.issue_uuid DESC LIMIT ?4"
            )
        } else {
            format!(
                "SELECT {RECORD_COLUMNS} FROM commands c
                 WHERE ?1 IS NULL
                   AND (c.issue_time_ms < ?2 OR (c.issue_time_ms = ?2 AND c.issue_uuid < ?3))
                 ORDER BY c.issue_time_ms DESC, c.issue_uuid DESC LIMIT ?4"
            )
        };
        let mut st = self
            .conn
            .prepare_cached(&sql)
            .map_err(sqlite("list commands"))?;
        let it = st
            .query_map(
                params![
                    client,
                    after_ms,
                    after_id.as_slice(),
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                raw_of,
            )
            .map_err(sqlite("list commands"))?;
        it.collect::<Result<_, _>>()
            .map_err(sqlite("list commands"))
    }

    fn scan_commands(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        max: usize,
    ) -> Result<Vec<(i64, Vec<u8>, String)>, StoreError> {
        let sql = if client.is_some() {
            "SELECT c.issue_time_ms, c.issue_uuid, COALESCE(cl.labels, '') FROM commands c
             LEFT JOIN clients cl ON cl.client_id = c.client_id
             WHERE c.client_id = ?1
               AND (c.issue_time_ms < ?2 OR (c.issue_time_ms = ?2 AND c.issue_uuid < ?3))
             ORDER BY c.issue_time_ms DESC, c.issue_uuid DESC LIMIT ?4"
        } else {
            "SELECT c.issue_time_ms, c.issue_uuid, COALESCE(cl.labels, '') FROM commands c
             LEFT JOIN clients cl ON cl.client_id = c.client_id
             WHERE ?1 IS NULL
               AND (c.issue_time_ms < ?2 OR (c.issue_time_ms = ?2 AND c.issue_uuid < ?3))
             ORDER BY c.issue_time_ms DESC, c.issue_uuid DESC LIMIT ?4"
        };
        let mut st = self
            .conn
            .prepare_cached(sql)
            .map_err(sqlite("scan commands"))?;
        let it = st
            .query_map(
                params![
                    client,
                    after_ms,
                    after_id.as_slice(),
                    i64::try_from(max).unwrap_or(i64::MAX)
                ],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map_err(sqlite("scan commands"))?;
        it.collect::<Result<_, _>>()
            .map_err(sqlite("scan commands"))
    }

    fn command_row(&mut self, id: &[u8]) -> Result<Raw, StoreError> {
        self.conn
            .prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM commands c WHERE c.issue_uuid = ?1"
            ))
            .and_then(|mut st| st.query_row(params![id], raw_of))
            .map_err(sqlite("read command"))
    }

    fn record(&mut self, raw: Raw) -> Result<wire::CommandRecord, StoreError> {
        finish(self.conn, self.health, raw)
    }
}

/// `ListCommands`: a page of commands, newest first, of one client or of
/// all, optionally only of clients whose labels match a selector.
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size, selector or token, or a store
/// failure.
pub fn list_commands(
    conn: &Connection,
    health: &Health,
    key: [u8; 32],
    req: &wire::ListCommandsRequest,
) -> Result<wire::ListCommandsResponse, OpError> {
    commands_page(&mut SqliteRecords { conn, health }, key, req)
}

/// [`list_commands`] over any [`RecordSource`].
///
/// # Errors
/// As [`list_commands`].
pub fn commands_page(
    src: &mut dyn RecordSource,
    key: [u8; 32],
    req: &wire::ListCommandsRequest,
) -> Result<wire::ListCommandsResponse, OpError> {
    let limit = page_size(req.page_size).map_err(OpError::Refused)?;
    let client = req.client_id.as_deref();
    let selector = selector_of(&req.selector)?;
    let mut filter_items: Vec<(&str, &[u8])> =
        vec![("client_id", client.unwrap_or("\u{0}all").as_bytes())];
    if selector.is_some() {
        filter_items.push(("selector", req.selector.as_bytes()));
    }
    let filters = encode_filters(&filter_items);
    let codec = TokenCodec::new(TokenKey::new(key));
    let after = if req.page_token.is_empty() {
        None
    } else {
        let pos = codec
            .open(TokenKind::CommandPage, &filters, &req.page_token)
            .map_err(|e| token_error(&e))?;
        Some(PagePosition::decode(&pos).map_err(|e| token_error(&e))?)
    };
    let (after_ms, after_id) = after.map_or((i64::MAX, [0xffu8; 16]), |p| (p.sort_key, p.id));
    // the rows of the page, whether another follows, and where it starts
    type Page = (Vec<Raw>, bool, Option<(i64, Vec<u8>)>);
    let (rows, more, last): Page = match &selector {
        None => {
            // one more row than the page says whether another page follows
            let mut rows = src.commands_after(client, after_ms, &after_id, limit as usize + 1)?;
            let more = rows.len() > limit as usize;
            rows.truncate(limit as usize);
            let last = rows.last().map(|r| (r.issue_ms, r.issue.clone()));
            (rows, more, last)
        }
        Some(sel) => {
            let scanned = src.scan_commands(client, after_ms, &after_id, MAX_FILTER_SCAN)?;
            let exhausted = scanned.len() < MAX_FILTER_SCAN;
            let mut picked: Vec<(i64, Vec<u8>)> = Vec::new();
            let mut last = None;
            let mut more = false;
            for (ms, id, labels) in scanned {
                if !sel.matches(&stored_labels(&labels)) {
                    last = Some((ms, id));
                    continue;
                }
                if picked.len() == limit as usize {
                    more = true;
                    break;
                }
                last = Some((ms, id.clone()));
                picked.push((ms, id));
            }
            if !more && !exhausted {
                // the scan bound ended the page: go on after the last row seen
                more = true;
            }
            let mut rows = Vec::with_capacity(picked.len());
            for (_, id) in &picked {
                rows.push(src.command_row(id)?);
            }
            (rows, more, last)
        }
    };
    let mut commands = Vec::with_capacity(rows.len());
    for raw in rows {
        commands.push(src.record(raw)?);
    }
    let next_page_token = match (more, last) {
        (true, Some((ms, id))) => {
            let id = <[u8; 16]>::try_from(id.as_slice()).unwrap_or([0; 16]);
            codec
                .seal(
                    TokenKind::CommandPage,
                    &filters,
                    &PagePosition { sort_key: ms, id }.encode(),
                )
                .map_err(|e| token_error(&e))?
        }
        _ => String::new(),
    };
    Ok(wire::ListCommandsResponse {
        commands,
        next_page_token,
    })
}

const CLIENT_COLUMNS: &str = "c.client_id, c.instance_id, c.generation, c.capabilities, \
     c.cwd_policy, c.connected_ms, c.last_seen_ms, c.pending_instance_id, c.pending_seen_ms, \
     EXISTS (SELECT 1 FROM sessions s WHERE s.client_id = c.client_id AND s.live = 1), c.labels";

/// One `clients` row as a client summary is built from it (every store
/// backend reads these columns).
#[derive(Debug, Clone, Default)]
pub struct ClientRow {
    /// Client id.
    pub client_id: String,
    /// The registered instance.
    pub instance_id: Option<Vec<u8>>,
    /// Registration generation.
    pub generation: i64,
    /// Encoded `Capabilities`.
    pub capabilities: Option<Vec<u8>>,
    /// Encoded `CwdPolicy`.
    pub cwd_policy: Option<Vec<u8>>,
    /// When the client last registered.
    pub connected_ms: Option<i64>,
    /// When the client was last heard from.
    pub last_seen_ms: Option<i64>,
    /// The instance of a refused live claim.
    pub pending_instance_id: Option<Vec<u8>>,
    /// When that claim was seen.
    pub pending_seen_ms: Option<i64>,
    /// Whether the client has a live session.
    pub live: bool,
    /// The stored labels text.
    pub labels: String,
}

fn client_row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<ClientRow> {
    Ok(ClientRow {
        client_id: r.get(0)?,
        instance_id: r.get(1)?,
        generation: r.get(2)?,
        capabilities: r.get(3)?,
        cwd_policy: r.get(4)?,
        connected_ms: r.get(5)?,
        last_seen_ms: r.get(6)?,
        pending_instance_id: r.get(7)?,
        pending_seen_ms: r.get(8)?,
        live: r.get(9)?,
        labels: r.get(10)?,
    })
}

/// A client's summary and its pending claim, from its row.
fn client_of(row: ClientRow) -> (wire::ClientSummary, Option<wire::PendingClaim>) {
    let summary = wire::ClientSummary {
        client_id: row.client_id,
        connected: row.live,
        connected_time: row.connected_ms.map(to_timestamp),
        last_seen_time: row.last_seen_ms.map(to_timestamp),
        client_instance_id: row
            .instance_id
            .as_deref()
            .map(uuid_text)
            .unwrap_or_default(),
        generation: to_u64(row.generation),
        capabilities: row
            .capabilities
            .as_deref()
            .and_then(|b| <wire::Capabilities as prost::Message>::decode(b).ok()),
        cwd_policy: row
            .cwd_policy
            .as_deref()
            .and_then(|b| <wire::CwdPolicy as prost::Message>::decode(b).ok()),
        labels: stored_labels(&row.labels).to_wire(),
    };
    let pending = row.pending_instance_id.map(|p| wire::PendingClaim {
        client_instance_id: uuid_text(&p),
        observed_time: row.pending_seen_ms.map(to_timestamp),
    });
    (summary, pending)
}

/// Where the client reads find their rows: one rule for `ListClients` and
/// `GetClient`, one source per store backend.
pub trait ClientSource {
    /// The rows of the clients whose id sorts after `after` (bytewise), in
    /// id order, at most `limit`.
    ///
    /// # Errors
    /// A store failure.
    fn clients_after(&mut self, after: &str, limit: usize) -> Result<Vec<ClientRow>, StoreError>;
    /// The ids and stored labels of the clients after `after`, in id
    /// order, at most `max` (a filtered page matches them here, not in
    /// SQL).
    ///
    /// # Errors
    /// A store failure.
    fn scan_clients(
        &mut self,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, String)>, StoreError>;
    /// One client's row, if it exists.
    ///
    /// # Errors
    /// A store failure.
    fn client(&mut self, client_id: &str) -> Result<Option<ClientRow>, StoreError>;
    /// When the client's live takeover grant (neither consumed nor voided)
    /// expires, if it has one still live at `now_ms`.
    ///
    /// # Errors
    /// A store failure.
    fn takeover_grant(&mut self, client_id: &str, now_ms: i64) -> Result<Option<i64>, StoreError>;
    /// The dirty scopes that concern the client: its own and the store's
    /// global one, at most [`MAX_DIRTY_SCOPES`].
    ///
    /// # Errors
    /// A store failure.
    fn dirty_scopes(&mut self, client_id: &str) -> Result<Vec<wire::ScopeHealth>, StoreError>;
}

impl ClientSource for SqliteRecords<'_> {
    fn clients_after(&mut self, after: &str, limit: usize) -> Result<Vec<ClientRow>, StoreError> {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT {CLIENT_COLUMNS} FROM clients c WHERE c.client_id > ?1
                         ORDER BY c.client_id LIMIT ?2"
            ))
            .map_err(sqlite("list clients"))?;
        let it = st
            .query_map(
                params![after, i64::try_from(limit).unwrap_or(i64::MAX)],
                client_row_of,
            )
            .map_err(sqlite("list clients"))?;
        it.collect::<Result<_, _>>().map_err(sqlite("list clients"))
    }

    fn scan_clients(
        &mut self,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT client_id, labels FROM clients WHERE client_id > ?1
                         ORDER BY client_id LIMIT ?2",
            )
            .map_err(sqlite("scan clients"))?;
        let it = st
            .query_map(
                params![after, i64::try_from(max).unwrap_or(i64::MAX)],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(sqlite("scan clients"))?;
        it.collect::<Result<_, _>>().map_err(sqlite("scan clients"))
    }

    fn client(&mut self, client_id: &str) -> Result<Option<ClientRow>, StoreError> {
        self.conn
            .prepare_cached(&format!(
                "SELECT {CLIENT_COLUMNS} FROM clients c WHERE c.client_id = ?1"
            ))
            .and_then(|mut st| st.query_row(params![client_id], client_row_of).optional())
            .map_err(sqlite("read client"))
    }

    fn takeover_grant(&mut self, client_id: &str, now_ms: i64) -> Result<Option<i64>, StoreError> {
        self.conn
            .prepare_cached(
                "SELECT expires_ms FROM takeover_authorizations
             WHERE client_id = ?1 AND consumed_ms IS NULL AND voided_ms IS NULL AND expires_ms > ?2",
            )
            .and_then(|mut st| st.query_row(params![client_id, now_ms], |r| r.get(0)).optional())
            .map_err(sqlite("read takeover grant"))
    }

    fn dirty_scopes(&mut self, client_id: &str) -> Result<Vec<wire::ScopeHealth>, StoreError> {
        Ok(self.health.dirty_scopes(
            |kind, k| match kind {
                wire::ScopeKind::Client => k == client_id,
                wire::ScopeKind::GlobalStore => true,
                _ => false,
            },
            MAX_DIRTY_SCOPES,
        ))
    }
}

/// `ListClients`: a page of clients by id, optionally only those whose
/// labels match a selector and whose id matches a glob.
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size, selector, glob or token, or a
/// store failure.
pub fn list_clients(
    conn: &Connection,
    health: &Health,
    key: [u8; 32],
    req: &wire::ListClientsRequest,
) -> Result<wire::ListClientsResponse, OpError> {
    clients_page(&mut SqliteRecords { conn, health }, key, req)
}

/// [`list_clients`] over any [`ClientSource`]: pages in id order, the
/// page token sealed with `key` and bound to the selector and the glob.
///
/// # Errors
/// As [`list_clients`].
pub fn clients_page(
    src: &mut dyn ClientSource,
    key: [u8; 32],
    req: &wire::ListClientsRequest,
) -> Result<wire::ListClientsResponse, OpError> {
    let limit = page_size(req.page_size).map_err(OpError::Refused)?;
    let selector = selector_of(&req.selector)?;
    if !req.client_glob.is_empty() {
        check_client_glob(&req.client_glob).map_err(|e| {
            OpError::Refused(DomainError::new(Code::InvalidArgument, e.0).with_field("client_glob"))
        })?;
    }
    let codec = TokenCodec::new(TokenKey::new(key));
    let mut filter_items: Vec<(&str, &[u8])> = Vec::new();
    if selector.is_some() {
        filter_items.push(("selector", req.selector.as_bytes()));
    }
    if !req.client_glob.is_empty() {
        filter_items.push(("client_glob", req.client_glob.as_bytes()));
    }
    let filters = encode_filters(&filter_items);
    let after = if req.page_token.is_empty() {
        String::new()
    } else {
        let pos = codec
            .open(TokenKind::ClientPage, &filters, &req.page_token)
            .map_err(|e| token_error(&e))?;
        String::from_utf8(pos).map_err(|_| {
            OpError::Refused(DomainError::new(
                Code::InvalidArgument,
                "page_token is malformed",
            ))
        })?
    };
    let (clients, more, last): (Vec<wire::ClientSummary>, bool, Option<String>) =
        if selector.is_none() && req.client_glob.is_empty() {
            // one more row than the page says whether another page follows
            let rows = src.clients_after(&after, limit as usize + 1)?;
            let more = rows.len() > limit as usize;
            let clients: Vec<wire::ClientSummary> = rows
                .into_iter()
                .take(limit as usize)
                .map(|c| client_of(c).0)
                .collect();
            let last = clients.last().map(|c| c.client_id.clone());
            (clients, more, last)
        } else {
            let scanned = src.scan_clients(&after, MAX_FILTER_SCAN)?;
            let (picked, more, last) = pick_page(scanned, limit as usize, |id, labels| {
                (req.client_glob.is_empty() || glob_match(&req.client_glob, id))
                    && selector
                        .as_ref()
                        .is_none_or(|s| s.matches(&stored_labels(labels)))
            });
            let mut clients = Vec::with_capacity(picked.len());
            for id in &picked {
                let row = src.client(id)?.ok_or_else(|| {
                    StoreError::Integrity(format!(
                        "client {id} was scanned but has no row in the same snapshot"
                    ))
                })?;
                clients.push(client_of(row).0);
            }
            (clients, more, last)
        };
    let next_page_token = match (more, last) {
        (true, Some(last)) => codec
            .seal(TokenKind::ClientPage, &filters, last.as_bytes())
            .map_err(|e| token_error(&e))?,
        _ => String::new(),
    };
    Ok(wire::ListClientsResponse {
        clients,
        next_page_token,
    })
}

/// `GetClient`: one client with its pending claim, its live takeover
/// grant and its dirty scopes.
///
/// # Errors
/// `NOT_FOUND`, or a store failure.
pub fn get_client(
    conn: &Connection,
    health: &Health,
    client_id: &str,
    now_ms: i64,
) -> Result<wire::GetClientResponse, OpError> {
    client_detail(&mut SqliteRecords { conn, health }, client_id, now_ms)
}

/// [`get_client`] over any [`ClientSource`].
///
/// # Errors
/// As [`get_client`].
pub fn client_detail(
    src: &mut dyn ClientSource,
    client_id: &str,
    now_ms: i64,
) -> Result<wire::GetClientResponse, OpError> {
    let row = src
        .client(client_id)?
        .ok_or_else(|| OpError::Refused(DomainError::new(Code::NotFound, "no such client")))?;
    let (summary, pending) = client_of(row);
    let grant = src.takeover_grant(client_id, now_ms)?;
    let dirty_scopes = src.dirty_scopes(client_id)?;
    Ok(wire::GetClientResponse {
        client: Some(summary),
        pending_claim: pending,
        takeover_grant_expiry_time: grant.map(to_timestamp),
        dirty_scopes,
    })
}

/// Where the incident listing finds its rows: one rule for the page, one
/// source per store backend.
pub trait IncidentSource {
    /// Incidents newest first by `(detected_ms, id)`, strictly after
    /// `after` (the last row of the previous page), optionally in one
    /// state only, at most `limit`.
    ///
    /// # Errors
    /// A store failure.
    fn incidents_after(
        &mut self,
        state: Option<wire::IncidentState>,
        after: Option<(i64, [u8; 16])>,
        limit: u32,
    ) -> Result<Vec<crate::incidents::Incident>, StoreError>;
}

struct SqliteIncidents<'c> {
    conn: &'c Connection,
}

impl IncidentSource for SqliteIncidents<'_> {
    fn incidents_after(
        &mut self,
        state: Option<wire::IncidentState>,
        after: Option<(i64, [u8; 16])>,
        limit: u32,
    ) -> Result<Vec<crate::incidents::Incident>, StoreError> {
        crate::incidents::list(self.conn, state, after, limit)
    }
}

/// `ListStorageIncidents`: a page of incidents, newest first, optionally
/// in one state. The page token is bound to the state filter.
///
/// # Errors
/// `INVALID_ARGUMENT` for a bad page size, state or token, or a store
/// failure.
pub fn list_incidents(
    conn: &Connection,
    key: [u8; 32],
    req: &wire::ListStorageIncidentsRequest,
) -> Result<wire::ListStorageIncidentsResponse, OpError> {
    incidents_page(&mut SqliteIncidents { conn }, key, req)
}

/// [`list_incidents`] over any [`IncidentSource`].
///
/// # Errors
/// As [`list_incidents`].
pub fn incidents_page(
    src: &mut dyn IncidentSource,
    key: [u8; 32],
    req: &wire::ListStorageIncidentsRequest,
) -> Result<wire::ListStorageIncidentsResponse, OpError> {
    let limit = page_size(req.page_size).map_err(OpError::Refused)?;
    let state = match req.state {
        None => None,
        Some(v) => Some(
            wire::IncidentState::try_from(v)
                .ok()
                .filter(|s| *s != wire::IncidentState::Unspecified)
                .ok_or_else(|| {
                    OpError::Refused(
                        DomainError::new(
                            Code::InvalidArgument,
                            format!("state {v} is not an incident state"),
                        )
                        .with_field("state"),
                    )
                })?,
        ),
    };
    let state_bytes = state.map_or_else(Vec::new, |s| (s as i32).to_be_bytes().to_vec());
    let filters = encode_filters(&[("state", &state_bytes)]);
    let codec = TokenCodec::new(TokenKey::new(key));
    let after = if req.page_token.is_empty() {
        None
    } else {
        let pos = codec
            .open(TokenKind::IncidentPage, &filters, &req.page_token)
            .map_err(|e| token_error(&e))?;
        let malformed = || {
            OpError::Refused(DomainError::new(
                Code::InvalidArgument,
                "page_token is malformed",
            ))
        };
        Some(time_and_id(&pos).ok_or_else(malformed)?)
    };
    // one more row than the page says whether another page follows
    let mut rows = src
        .incidents_after(state, after, limit.saturating_add(1))
        .map_err(OpError::Store)?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next_page_token = match (more, rows.last()) {
        (true, Some(last)) => {
            let mut pos = last.detected_ms.to_be_bytes().to_vec();
            pos.extend_from_slice(&last.id);
            codec
                .seal(TokenKind::IncidentPage, &filters, &pos)
                .map_err(|e| token_error(&e))?
        }
        _ => String::new(),
    };
    Ok(wire::ListStorageIncidentsResponse {
        incidents: rows
            .iter()
            .map(crate::incidents::Incident::to_wire)
            .collect(),
        next_page_token,
    })
}

/// The position of a page token that orders by a time in milliseconds and
/// then a 16-byte id: `(ms, id)`, or `None` when the bytes are not that.
pub(crate) fn time_and_id(pos: &[u8]) -> Option<(i64, [u8; 16])> {
    let ms = pos
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(i64::from_be_bytes)?;
    let id = pos.get(8..24).and_then(|b| <[u8; 16]>::try_from(b).ok())?;
    Some((ms, id))
}
