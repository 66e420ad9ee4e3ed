//! The reads the server core makes through the port, and the one write
//! that only sets an indicator, on PostgreSQL (as the SQLite store's
//! `commands`, `signals`, `stdin` and `blobs` reads).

use postgres::Transaction;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::commands::MAX_LISTED_COMMANDS;
use rvbox_store::signals::MAX_PENDING_SIGNALS;
use rvbox_store_port::commands::{CommandView, Knowledge};
use rvbox_store_port::stdin::{MAX_PENDING_STDIN_WRITES, StdinWrites};

use crate::commands::{VIEW_COLUMNS, load_view, view_of};
use crate::sessions::{to_i64, to_u64};
use crate::{Fail, PgStore};

fn uuid_text(b: &[u8; 16]) -> String {
    rvbox_domain::ids::Uuid7::from_bytes("issue_uuid", *b)
        .map(|u| u.to_string())
        .unwrap_or_default()
}

fn list_views(
    tx: &mut Transaction<'_>,
    filter: &str,
    client_id: &str,
    limit: usize,
) -> Result<Vec<CommandView>, Fail> {
    let limit = limit.min(MAX_LISTED_COMMANDS);
    let sql = format!("SELECT {VIEW_COLUMNS} FROM commands c WHERE {filter} LIMIT $2");
    Ok(tx
        .query(sql.as_str(), &[&client_id, &to_i64(limit as u64)])
        .map_err(Fail::db("list commands"))?
        .iter()
        .map(view_of)
        .collect())
}

/// One stored script chunk: raw length, compressed bytes, raw digest.
type ScriptChunk = (u64, Vec<u8>, [u8; 32]);

/// The stored chunks of a command's script in order: raw length,
/// compressed bytes, raw digest (none for a command that runs text).
fn script_chunks(tx: &mut Transaction<'_>, issue: &[u8; 16]) -> Result<Vec<ScriptChunk>, Fail> {
    let rows = crate::prep::query(
        tx,
        "SELECT ordinal, raw_len, sha256, inline_bytes FROM command_payloads
             WHERE issue_uuid = $1 AND kind = $2 ORDER BY ordinal",
        &[
            &issue.as_slice(),
            &i64::from(rvbox_segment::Kind::Script.as_u8()),
        ],
    )
    .map_err(Fail::db("read script"))?;
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            let ordinal = to_u64(r.get(0));
            if ordinal != i as u64 {
                return Err(Fail::Integrity("a script chunk is missing".into()));
            }
            let sha: Vec<u8> = r.get(2);
            let sha = <[u8; 32]>::try_from(sha.as_slice())
                .map_err(|_| Fail::Integrity("script chunk digest length".into()))?;
            let stored: Option<Vec<u8>> = r.get(3);
            Ok((
                to_u64(r.get(1)),
                stored.ok_or_else(|| Fail::Integrity("script chunk without bytes".into()))?,
                sha,
            ))
        })
        .collect()
}

/// One script chunk's raw bytes, verified.
fn chunk_raw(raw_len: u64, stored: &[u8], sha: &[u8; 32]) -> Result<Vec<u8>, Fail> {
    let cap = usize::try_from(rvbox_domain::limits::MAX_SCRIPT_CHUNK_BYTES).unwrap_or(0);
    let raw = zstd::bulk::decompress(stored, cap)
        .map_err(|_| Fail::Integrity("a script chunk does not decompress".into()))?;
    if raw.len() as u64 != raw_len || rvbox_segment::sha256(&raw) != *sha {
        return Err(Fail::Integrity(
            "a script chunk does not match its length and digest".into(),
        ));
    }
    Ok(raw)
}

impl PgStore {
    /// Every non-terminal command of the client, by id.
    pub(crate) fn non_terminal_commands(
        &mut self,
        client_id: &str,
    ) -> Result<Vec<CommandView>, Fail> {
        self.in_tx("list commands", |tx, _| {
            list_views(
                tx,
                "c.client_id = $1 AND c.lifecycle < 5 ORDER BY c.issue_uuid",
                client_id,
                MAX_LISTED_COMMANDS,
            )
        })
    }

    /// Queued commands of the client in dispatch order, then its
    /// dispatched ones.
    pub(crate) fn dispatch_candidates(
        &mut self,
        client_id: &str,
        limit: usize,
    ) -> Result<Vec<CommandView>, Fail> {
        self.in_tx("list dispatch candidates", |tx, _| {
            let mut rows = list_views(
                tx,
                "c.client_id = $1 AND c.lifecycle = 1 ORDER BY c.issue_time_ms, c.issue_uuid",
                client_id,
                limit,
            )?;
            rows.extend(list_views(
                tx,
                "c.client_id = $1 AND c.lifecycle = 2 ORDER BY c.issue_uuid",
                client_id,
                limit,
            )?);
            Ok(rows)
        })
    }

    /// What the server knows of each command, in request order.
    pub(crate) fn knowledge(
        &mut self,
        issues: &[[u8; 16]],
    ) -> Result<Vec<([u8; 16], Knowledge)>, Fail> {
        self.in_tx("read command knowledge", |tx, _| {
            let mut out = Vec::with_capacity(issues.len());
            for issue in issues {
                let row = crate::prep::query_opt(
                    tx,
                    "SELECT request_hash, lifecycle, last_event_seq FROM commands
                         WHERE issue_uuid = $1",
                    &[&issue.as_slice()],
                )
                .map_err(Fail::db("load command"))?;
                let known = if let Some(r) = row {
                    let hash: Vec<u8> = r.get(0);
                    Knowledge::Terminal {
                        request_hash: <[u8; 32]>::try_from(hash.as_slice()).unwrap_or([0; 32]),
                        lifecycle: Lifecycle::from_wire(
                            i32::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                        )
                        .unwrap_or(Lifecycle::Interrupted),
                        last_event_seq: to_u64(r.get(2)),
                    }
                } else {
                    match crate::prep::query_opt(
                        tx,
                        "SELECT request_hash FROM command_tombstones WHERE issue_uuid = $1",
                        &[&issue.as_slice()],
                    )
                    .map_err(Fail::db("load tombstone"))?
                    {
                        Some(r) => Knowledge::Tombstoned {
                            request_hash: <[u8; 32]>::try_from(r.get::<_, Vec<u8>>(0).as_slice())
                                .unwrap_or([0; 32]),
                        },
                        None => Knowledge::Missing,
                    }
                };
                out.push((*issue, known));
            }
            Ok(out)
        })
    }

    /// Commands whose queue expiry passed while queued, or dispatched and
    /// not yet marked, oldest first.
    pub(crate) fn expiry_due(
        &mut self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<CommandView>, Fail> {
        let limit = limit.min(MAX_LISTED_COMMANDS);
        self.in_tx("list expired commands", |tx, _| {
            let sql = format!(
                "SELECT {VIEW_COLUMNS} FROM commands c
                 WHERE c.lifecycle IN (1, 2) AND c.queue_expiry_ms IS NOT NULL
                   AND c.queue_expiry_ms <= $1
                   AND (c.lifecycle = 1 OR NOT c.expired_pending)
                 ORDER BY c.queue_expiry_ms LIMIT $2"
            );
            Ok(tx
                .query(sql.as_str(), &[&now_ms, &to_i64(limit as u64)])
                .map_err(Fail::db("list expired commands"))?
                .iter()
                .map(view_of)
                .collect())
        })
    }

    /// The signals still pending for commands that have not ended, per
    /// command oldest first.
    pub(crate) fn pending_signals(
        &mut self,
        issues: &[[u8; 16]],
    ) -> Result<Vec<wire::Signal>, Fail> {
        self.in_tx("read pending signals", |tx, _| {
            let mut out = Vec::new();
            for issue in issues {
                let rows = crate::prep::query(
                    tx,
                    "SELECT s.revision, s.signal FROM command_signals s
                         JOIN commands c ON c.issue_uuid = s.issue_uuid
                         WHERE s.issue_uuid = $1 AND c.lifecycle < 5
                         ORDER BY s.revision LIMIT $2",
                    &[&issue.as_slice(), &to_i64(MAX_PENDING_SIGNALS)],
                )
                .map_err(Fail::db("read pending signals"))?;
                let text = uuid_text(issue);
                for r in rows {
                    out.push(wire::Signal {
                        issue_uuid: text.clone(),
                        revision: to_u64(r.get(0)),
                        signal: i32::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                    });
                }
            }
            Ok(out)
        })
    }

    /// A command's lifecycle and raw script size (`None`: command text).
    pub(crate) fn script_info(
        &mut self,
        issue: &[u8; 16],
    ) -> Result<(Lifecycle, Option<u64>), Fail> {
        self.in_tx("read script size", |tx, _| {
            let view = load_view(tx, issue, false)?;
            let chunks = script_chunks(tx, issue)?;
            let size = (!chunks.is_empty()).then(|| chunks.iter().map(|c| c.0).sum());
            Ok((view.lifecycle, size))
        })
    }

    /// Raw script bytes from `offset`, at most `len`, decompressing and
    /// verifying only the chunks that overlap the range; empty past the
    /// end.
    pub(crate) fn script_range(
        &mut self,
        issue: &[u8; 16],
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Fail> {
        self.in_tx("read script", |tx, _| {
            let chunks = script_chunks(tx, issue)?;
            let size: u64 = chunks.iter().map(|c| c.0).sum();
            let end = offset.saturating_add(len).min(size);
            let mut out = Vec::new();
            let mut at = 0u64;
            for (raw_len, stored, sha) in &chunks {
                if at >= end {
                    break;
                }
                let next = at.saturating_add(*raw_len);
                if next > offset {
                    let raw = chunk_raw(*raw_len, stored, sha)?;
                    let lo = usize::try_from(offset.saturating_sub(at)).unwrap_or(usize::MAX);
                    let hi = usize::try_from(end.min(next).saturating_sub(at)).unwrap_or(0);
                    out.extend_from_slice(
                        raw.get(lo..hi)
                            .ok_or_else(|| Fail::Integrity("script chunk length".into()))?,
                    );
                }
                at = next;
            }
            Ok(out)
        })
    }

    /// The pending stdin writes of a running command after `after_seq`,
    /// as many as fit `max_bytes` of payload and `max_writes`.
    pub(crate) fn pending_stdin(
        &mut self,
        issue: &[u8; 16],
        after_seq: u64,
        max_bytes: u64,
        max_writes: u64,
    ) -> Result<StdinWrites, Fail> {
        self.in_tx("read pending stdin", |tx, _| {
            let limit = max_writes.min(MAX_PENDING_STDIN_WRITES).saturating_add(1);
            let rows = crate::prep::query(
                tx,
                "SELECT s.write_seq, s.compression, s.raw_len, s.stored_len, s.sha256,
                            s.payload, s.newline, s.close
                     FROM stdin_writes s JOIN commands c ON c.issue_uuid = s.issue_uuid
                     WHERE s.issue_uuid = $1 AND s.write_seq > $2 AND s.delivery = 1
                       AND c.lifecycle = 4
                     ORDER BY s.write_seq LIMIT $3",
                &[&issue.as_slice(), &to_i64(after_seq), &to_i64(limit)],
            )
            .map_err(Fail::db("read pending stdin"))?;
            let text = uuid_text(issue);
            let mut out = StdinWrites::default();
            let mut bytes = 0u64;
            for r in rows {
                let raw_len = to_u64(r.get(2));
                if out.writes.len() as u64 >= max_writes
                    || bytes.saturating_add(raw_len.max(1)) > max_bytes
                {
                    out.more = true;
                    break;
                }
                bytes = bytes.saturating_add(raw_len.max(1));
                out.writes.push(wire::StdinWrite {
                    issue_uuid: text.clone(),
                    write_seq: to_u64(r.get(0)),
                    compression: if r.get::<_, i64>(1) == 1 {
                        wire::Compression::Zstd as i32
                    } else {
                        wire::Compression::None as i32
                    },
                    payload: r.get(5),
                    raw_length: u32::try_from(raw_len).unwrap_or(u32::MAX),
                    stored_length: u32::try_from(r.get::<_, i64>(3)).unwrap_or(u32::MAX),
                    raw_sha256: r.get(4),
                    newline: if r.get::<_, bool>(6) {
                        wire::StdinNewline::Append as i32
                    } else {
                        wire::StdinNewline::Raw as i32
                    },
                    close_after: r.get(7),
                });
            }
            Ok(out)
        })
    }

    /// Sets the "expired pending reconciliation" indicator of a command
    /// still dispatched at `revision`.
    pub(crate) fn mark_expired_pending(
        &mut self,
        issue: &[u8; 16],
        revision: u64,
    ) -> Result<(), Fail> {
        self.in_tx("mark expired pending", |tx, _| {
            let view = load_view(tx, issue, true)?;
            if view.lifecycle != Lifecycle::Dispatched || view.revision != revision {
                return Err(Fail::refused(
                    rvbox_domain::error::Code::Conflict,
                    format!(
                        "the command is {} at revision {}, not what the decision saw",
                        view.lifecycle.as_str(),
                        view.revision
                    ),
                ));
            }
            crate::prep::execute(
                tx,
                "UPDATE commands SET expired_pending = true WHERE issue_uuid = $1",
                &[&issue.as_slice()],
            )
            .map_err(Fail::db("mark expired pending"))?;
            Ok(())
        })?;
        tracing::warn!(
            revision,
            "dispatched command past its queue TTL; expired pending reconciliation"
        );
        Ok(())
    }
}
