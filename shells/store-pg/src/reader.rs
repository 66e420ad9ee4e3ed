//! Control reads on PostgreSQL: the same rules as the SQLite store, each
//! over a source that reads this database, in one read-only REPEATABLE
//! READ transaction (one snapshot per read): output pages and follow
//! history (`rvbox_store::output::{output_page, history}` over event rows,
//! removed ranges and output chunks), command records and listings
//! (`record_of`, `commands_page`), clients (`clients_page`,
//! `client_detail`), incidents (`incidents_page`), and interactive
//! terminals with their recordings (`rvbox_store::pty::{list_page,
//! info_of, records_of}`).
//!
//! Page tokens are sealed with the database's token key (in `store_meta`,
//! created once by the first replica), so a page token from one replica is
//! honoured by every other.

use postgres::{Client, IsolationLevel, NoTls, Transaction};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_domain::token::{TokenCodec, TokenKey};
use rvbox_proto::v1 as wire;
use rvbox_store::StoreError;
use rvbox_store::fleet::{FleetSource, RunRow};
use rvbox_store::identity::TOKEN_KEY_LEN;
use rvbox_store::incidents::Incident;
use rvbox_store::mutations::OpError;
use rvbox_store::output::{
    EventRow, HistoryItem, OutputCommand, OutputSource, RemovedRow, Verified, history,
    missing_command, output_command, output_page,
};
use rvbox_store::pty::{PtyRow, PtySource, RecordRow};
use rvbox_store::reader::{ControlReads, ReaderSource};
use rvbox_store::records::{
    ClientRow, ClientSource, IncidentSource, MAX_DIRTY_SCOPES, Raw, RecordFacts, RecordSource,
    client_detail, clients_page, commands_page, incidents_page, record_of,
};

use crate::output::OutputStore;
use crate::sessions::{to_i64, to_u64};
use crate::{Fail, PgStore};

fn store_error(e: Fail) -> StoreError {
    StoreError::Integrity(e.to_string())
}

fn db(context: &'static str) -> impl Fn(postgres::Error) -> StoreError {
    move |e| store_error(Fail::Db { context, source: e })
}

/// The database's token key, created by the first caller.
pub(crate) fn token_key(client: &mut Client) -> Result<[u8; TOKEN_KEY_LEN], Fail> {
    let mut fresh = [0u8; TOKEN_KEY_LEN];
    rvbox_store::entropy::Entropy::fill(&rvbox_store::entropy::OsEntropy, &mut fresh)
        .map_err(|e| Fail::Integrity(format!("random token key: {e}")))?;
    client
        .execute(
            "INSERT INTO store_meta (key, value) VALUES ('token_key', $1)
             ON CONFLICT (key) DO NOTHING",
            &[&fresh.as_slice()],
        )
        .map_err(Fail::db("create the token key"))?;
    let v: Vec<u8> = client
        .query_one("SELECT value FROM store_meta WHERE key = 'token_key'", &[])
        .map_err(Fail::db("read the token key"))?
        .get(0);
    <[u8; TOKEN_KEY_LEN]>::try_from(v.as_slice()).map_err(|_| {
        Fail::Integrity(format!(
            "the token key is {} bytes, expected {TOKEN_KEY_LEN}",
            v.len()
        ))
    })
}

/// The output source over one read transaction.
struct PgSource<'a, 't> {
    tx: &'a mut Transaction<'t>,
    /// Where the output bytes are.
    output: &'a mut dyn OutputStore,
}

impl OutputSource for PgSource<'_, '_> {
    fn command(&mut self, issue: &Uuid7) -> Result<OutputCommand, OpError> {
        let id = issue.as_bytes().as_slice();
        let row = self
            .tx
            .query_opt(
                "SELECT last_event_seq, lifecycle, retention FROM commands WHERE issue_uuid = $1",
                &[&id],
            )
            .map_err(db("load command for output"))?;
        match row {
            Some(r) => output_command(issue, r.get(0), r.get(1), &r.get::<_, String>(2)),
            None => {
                let reclaimed = self
                    .tx
                    .query_opt(
                        "SELECT 1 FROM command_tombstones WHERE issue_uuid = $1",
                        &[&id],
                    )
                    .map_err(db("check tombstone"))?
                    .is_some();
                Err(missing_command(issue, reclaimed))
            }
        }
    }

    fn events(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        all_bodies: bool,
        limit: usize,
    ) -> Result<Vec<EventRow>, StoreError> {
        let rows = self
            .tx
            .query(
                "SELECT event_seq, observed_ms, receipt_ms, body_kind, stream, raw_len, stored_len,
                        content_sha256,
                        CASE WHEN $4 OR body_kind IN (6, 7) THEN inline_body END
                 FROM command_events WHERE issue_uuid = $1 AND event_seq >= $2 AND event_seq <= $3
                 ORDER BY event_seq LIMIT $5",
                &[
                    &issue.as_slice(),
                    &to_i64(first),
                    &to_i64(last),
                    &all_bodies,
                    &to_i64(limit as u64),
                ],
            )
            .map_err(db("read output events"))?;
        Ok(rows
            .iter()
            .map(|r| EventRow {
                seq: to_u64(r.get(0)),
                observed_ms: r.get(1),
                receipt_ms: r.get(2),
                kind: u8::try_from(r.get::<_, i64>(3)).unwrap_or(0),
                stream: u8::try_from(r.get::<_, i64>(4)).unwrap_or(0),
                raw_len: to_u64(r.get(5)),
                stored_len: to_u64(r.get(6)),
                digest: r.get(7),
                segment: None,
                inline: r.get(8),
            })
            .collect())
    }

    fn removed(
        &mut self,
        issue: &[u8; 16],
        seq: u64,
        after: bool,
    ) -> Result<Option<RemovedRow>, StoreError> {
        let sql = if after {
            "SELECT source, first_seq, last_seq, stream_mask, raw_bytes, stored_bytes, recorded_ms,
                    reason, incident_id
             FROM output_truncations
             WHERE issue_uuid = $1 AND first_seq IS NOT NULL AND first_seq > $2
             ORDER BY first_seq LIMIT 1"
        } else {
            "SELECT source, first_seq, last_seq, stream_mask, raw_bytes, stored_bytes, recorded_ms,
                    reason, incident_id
             FROM output_truncations
             WHERE issue_uuid = $1 AND first_seq IS NOT NULL AND first_seq <= $2
             ORDER BY first_seq DESC LIMIT 1"
        };
        Ok(self
            .tx
            .query_opt(sql, &[&issue.as_slice(), &to_i64(seq)])
            .map_err(db("read output truncations"))?
            .map(|r| {
                (
                    i32::try_from(r.get::<_, i64>(0)).unwrap_or(0),
                    r.get(1),
                    r.get(2),
                    r.get(3),
                    r.get(4),
                    r.get(5),
                    r.get(6),
                    r.get(7),
                    r.get(8),
                )
            }))
    }

    fn output_streams(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<u8, StoreError> {
        let m: i32 = self
            .tx
            .query_one(
                "SELECT (COALESCE(bool_or(stream = 1), false)::int
                         | (COALESCE(bool_or(stream = 2), false)::int << 1))
                 FROM command_events WHERE issue_uuid = $1 AND event_seq >= $2 AND event_seq <= $3
                   AND body_kind = 4",
                &[&issue.as_slice(), &to_i64(first), &to_i64(last)],
            )
            .map_err(db("read removed streams"))?
            .get(0);
        Ok(u8::try_from(m & 3).unwrap_or(0))
    }

    fn first_non_output(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
    ) -> Result<Option<u64>, StoreError> {
        Ok(self
            .tx
            .query_opt(
                "SELECT event_seq FROM command_events
                 WHERE issue_uuid = $1 AND event_seq >= $2 AND event_seq <= $3 AND body_kind <> 4
                 ORDER BY event_seq LIMIT 1",
                &[&issue.as_slice(), &to_i64(first), &to_i64(last)],
            )
            .map_err(db("find resume point"))?
            .map(|r| to_u64(r.get(0))))
    }

    fn output_event(
        &mut self,
        issue: &[u8; 16],
        first: u64,
        last: u64,
        sel: u8,
        last_one: bool,
    ) -> Result<Option<u64>, StoreError> {
        let sql = if last_one {
            "SELECT event_seq FROM command_events
             WHERE issue_uuid = $1 AND event_seq >= $2 AND event_seq <= $3 AND body_kind = 4
               AND (stream & $4) <> 0 ORDER BY event_seq DESC LIMIT 1"
        } else {
            "SELECT event_seq FROM command_events
             WHERE issue_uuid = $1 AND event_seq >= $2 AND event_seq <= $3 AND body_kind = 4
               AND (stream & $4) <> 0 ORDER BY event_seq LIMIT 1"
        };
        Ok(self
            .tx
            .query_opt(
                sql,
                &[
                    &issue.as_slice(),
                    &to_i64(first),
                    &to_i64(last),
                    &i64::from(sel),
                ],
            )
            .map_err(db("read retained range"))?
            .map(|r| to_u64(r.get(0))))
    }

    fn output(&mut self, issue: &[u8; 16], row: &EventRow) -> Result<Verified, StoreError> {
        let fail = |what: &str| {
            StoreError::Integrity(format!(
                "stored output of command {} event {} failed verification: {what}",
                Uuid7::from_bytes("issue_uuid", *issue)
                    .map(|u| u.to_string())
                    .unwrap_or_default(),
                row.seq
            ))
        };
        let chunk = self
            .output
            .get(self.tx, issue, row.seq, 1)
            .map_err(store_error)?
            .into_iter()
            .next()
            .filter(|c| c.event_seq == row.seq)
            .ok_or_else(|| fail("its output chunk is missing"))?;
        if chunk.stream.as_u8() != row.stream
            || u64::from(chunk.raw_len) != row.raw_len
            || chunk.stored.len() as u64 != row.stored_len
            || chunk.sha256.as_slice() != row.digest.as_slice()
        {
            return Err(fail("its output chunk does not match its event row"));
        }
        let raw = chunk.raw().map_err(store_error)?;
        Ok(Verified {
            stream: chunk.stream,
            compression: chunk.compression,
            raw_len: chunk.raw_len,
            stored: chunk.stored,
            raw,
        })
    }
}

const RECORD_COLUMNS: &str = "issue_uuid, client_id, lifecycle, revision, issue_time_ms,
    queue_expiry_ms, terminal_time_ms, exit_code, exit_signal, rejection, resolved_shell,
    last_event_seq, expired_pending, retention, request_hash, spec_zstd";

fn raw_of(r: &postgres::Row) -> Raw {
    let narrow = |v: i64| i32::try_from(v).unwrap_or(0);
    Raw {
        issue: r.get(0),
        client_id: r.get(1),
        lifecycle: narrow(r.get(2)),
        revision: r.get(3),
        issue_ms: r.get(4),
        expiry_ms: r.get(5),
        terminal_ms: r.get(6),
        exit_code: r.get(7),
        exit_signal: r.get(8),
        rejection: r.get(9),
        resolved_shell: r.get::<_, Option<i64>>(10).map(narrow),
        last_event_seq: r.get(11),
        expired_pending: r.get(12),
        retention: r.get(13),
        request_hash: r.get(14),
        spec_zstd: r.get(15),
    }
}

/// The scopes among `scopes` (and the server store's global scope) that
/// an open incident makes dirty, each with its open incidents' ids (at
/// most 100), at most [`MAX_DIRTY_SCOPES`]: what the write gate of the
/// PostgreSQL store refuses (`crate::incidents::gate`).
fn dirty_of(
    tx: &mut Transaction<'_>,
    scopes: &[(wire::ScopeKind, &str)],
) -> Result<Vec<wire::ScopeHealth>, StoreError> {
    let kinds: Vec<i64> = scopes.iter().map(|(k, _)| i64::from(*k as i32)).collect();
    let keys: Vec<&str> = scopes.iter().map(|(_, k)| *k).collect();
    let rows = tx
        .query(
            "SELECT scope_kind, scope_key,
                    (array_agg(incident_id ORDER BY incident_id))[1:100]
             FROM storage_incidents
             WHERE state = 1
               AND ((scope_kind = $1 AND scope_key = '')
                    OR (scope_kind, scope_key) IN (SELECT * FROM unnest($2::bigint[], $3::text[])))
             GROUP BY scope_kind, scope_key ORDER BY scope_kind, scope_key LIMIT $4",
            &[
                &i64::from(wire::ScopeKind::GlobalStore as i32),
                &kinds,
                &keys,
                &to_i64(MAX_DIRTY_SCOPES as u64),
            ],
        )
        .map_err(db("read dirty scopes"))?;
    Ok(rows
        .iter()
        .map(|r| wire::ScopeHealth {
            scope_kind: i32::try_from(r.get::<_, i64>(0)).unwrap_or(0),
            scope_key: r.get(1),
            state: wire::ScopeState::DirtyReadable as i32,
            incident_ids: r
                .get::<_, Vec<Vec<u8>>>(2)
                .iter()
                .filter_map(|id| <[u8; 16]>::try_from(id.as_slice()).ok())
                .map(|id| rvbox_store::fleet::uuid_text(&id))
                .collect(),
        })
        .collect())
}

/// A command's record, built by the same rule as the SQLite store's
/// (`rvbox_store::records::record_of`), with the dirty scopes that gate
/// its writes: its own, its client's, the server store's.
fn record(tx: &mut Transaction<'_>, raw: Raw) -> Result<wire::CommandRecord, StoreError> {
    let span = tx
        .query_one(
            "SELECT MIN(event_seq), MAX(event_seq),
                    EXISTS (SELECT 1 FROM output_truncations WHERE issue_uuid = $1),
                    EXISTS (SELECT 1 FROM command_events
                            WHERE issue_uuid = $1 AND body_kind IN (6, 7))
             FROM command_events WHERE issue_uuid = $1",
            &[&raw.issue],
        )
        .map_err(db("read retained range"))?;
    let facts = RecordFacts {
        first_event_seq: span.get(0),
        last_event_seq: span.get(1),
        removed: span.get(2),
        client_gap: span.get(3),
    };
    let key = <[u8; 16]>::try_from(raw.issue.as_slice())
        .map(|id| rvbox_store::fleet::uuid_text(&id))
        .unwrap_or_default();
    let dirty = dirty_of(
        tx,
        &[
            (wire::ScopeKind::Command, key.as_str()),
            (wire::ScopeKind::Client, raw.client_id.as_str()),
        ],
    )?;
    record_of(raw, facts, dirty)
}

/// `GetCommand`: one command's record.
fn command_record(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
) -> Result<wire::CommandRecord, OpError> {
    let sql = format!("SELECT {RECORD_COLUMNS} FROM commands WHERE issue_uuid = $1");
    let raw = tx
        .query_opt(sql.as_str(), &[&issue.as_slice()])
        .map_err(db("read command"))?
        .map(|r| raw_of(&r))
        .ok_or_else(|| OpError::Refused(DomainError::new(Code::NotFound, "no such command")))?;
    record(tx, raw).map_err(OpError::Store)
}

impl RecordSource for PgSource<'_, '_> {
    fn commands_after(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<Raw>, StoreError> {
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM commands
             WHERE ($1::text IS NULL OR client_id = $1)
               AND (issue_time_ms < $2 OR (issue_time_ms = $2 AND issue_uuid < $3))
             ORDER BY issue_time_ms DESC, issue_uuid DESC LIMIT $4"
        );
        Ok(self
            .tx
            .query(
                sql.as_str(),
                &[
                    &client,
                    &after_ms,
                    &after_id.as_slice(),
                    &to_i64(limit as u64),
                ],
            )
            .map_err(db("list commands"))?
            .iter()
            .map(raw_of)
            .collect())
    }

    fn scan_commands(
        &mut self,
        client: Option<&str>,
        after_ms: i64,
        after_id: &[u8; 16],
        max: usize,
    ) -> Result<Vec<(i64, Vec<u8>, String)>, StoreError> {
        Ok(self
            .tx
            .query(
                "SELECT c.issue_time_ms, c.issue_uuid, COALESCE(cl.labels, '') FROM commands c
                 LEFT JOIN clients cl ON cl.client_id = c.client_id
                 WHERE ($1::text IS NULL OR c.client_id = $1)
                   AND (c.issue_time_ms < $2 OR (c.issue_time_ms = $2 AND c.issue_uuid < $3))
                 ORDER BY c.issue_time_ms DESC, c.issue_uuid DESC LIMIT $4",
                &[
                    &client,
                    &after_ms,
                    &after_id.as_slice(),
                    &to_i64(max as u64),
                ],
            )
            .map_err(db("scan commands"))?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }

    fn command_row(&mut self, id: &[u8]) -> Result<Raw, StoreError> {
        let sql = format!("SELECT {RECORD_COLUMNS} FROM commands WHERE issue_uuid = $1");
        self.tx
            .query_one(sql.as_str(), &[&id])
            .map(|r| raw_of(&r))
            .map_err(db("read command"))
    }

    fn record(&mut self, raw: Raw) -> Result<wire::CommandRecord, StoreError> {
        record(self.tx, raw)
    }
}

const CLIENT_COLUMNS: &str = "c.client_id, c.instance_id, c.generation, c.capabilities,
    c.cwd_policy, c.connected_ms, c.last_seen_ms, c.pending_instance_id, c.pending_seen_ms,
    EXISTS (SELECT 1 FROM sessions s WHERE s.client_id = c.client_id AND s.live), c.labels";

fn client_row_of(r: &postgres::Row) -> ClientRow {
    ClientRow {
        client_id: r.get(0),
        instance_id: r.get(1),
        generation: r.get(2),
        capabilities: r.get(3),
        cwd_policy: r.get(4),
        connected_ms: r.get(5),
        last_seen_ms: r.get(6),
        pending_instance_id: r.get(7),
        pending_seen_ms: r.get(8),
        live: r.get(9),
        labels: r.get(10),
    }
}

impl ClientSource for PgSource<'_, '_> {
    fn clients_after(&mut self, after: &str, limit: usize) -> Result<Vec<ClientRow>, StoreError> {
        let sql = format!(
            "SELECT {CLIENT_COLUMNS} FROM clients c WHERE c.client_id > $1
             ORDER BY c.client_id LIMIT $2"
        );
        Ok(self
            .tx
            .query(sql.as_str(), &[&after, &to_i64(limit as u64)])
            .map_err(db("list clients"))?
            .iter()
            .map(client_row_of)
            .collect())
    }

    fn scan_clients(
        &mut self,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, String)>, StoreError> {
        Ok(self
            .tx
            .query(
                "SELECT client_id, labels FROM clients WHERE client_id > $1
                 ORDER BY client_id LIMIT $2",
                &[&after, &to_i64(max as u64)],
            )
            .map_err(db("scan clients"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
    }

    fn client(&mut self, client_id: &str) -> Result<Option<ClientRow>, StoreError> {
        let sql = format!("SELECT {CLIENT_COLUMNS} FROM clients c WHERE c.client_id = $1");
        Ok(self
            .tx
            .query_opt(sql.as_str(), &[&client_id])
            .map_err(db("read client"))?
            .map(|r| client_row_of(&r)))
    }

    fn takeover_grant(&mut self, client_id: &str, now_ms: i64) -> Result<Option<i64>, StoreError> {
        Ok(self
            .tx
            .query_opt(
                "SELECT expires_ms FROM takeover_authorizations
                 WHERE client_id = $1 AND consumed_ms IS NULL AND voided_ms IS NULL
                   AND expires_ms > $2",
                &[&client_id, &now_ms],
            )
            .map_err(db("read takeover grant"))?
            .map(|r| r.get(0)))
    }

    fn dirty_scopes(&mut self, client_id: &str) -> Result<Vec<wire::ScopeHealth>, StoreError> {
        dirty_of(self.tx, &[(wire::ScopeKind::Client, client_id)])
    }
}

impl IncidentSource for PgSource<'_, '_> {
    fn incidents_after(
        &mut self,
        state: Option<wire::IncidentState>,
        after: Option<(i64, [u8; 16])>,
        limit: u32,
    ) -> Result<Vec<Incident>, StoreError> {
        let (after_ms, after_id) = after.unwrap_or((i64::MAX, [0xff; 16]));
        let sql = format!(
            "SELECT {} FROM storage_incidents
             WHERE (detected_ms < $1 OR (detected_ms = $1 AND incident_id < $2))
               AND ($3::bigint IS NULL OR state = $3)
             ORDER BY detected_ms DESC, incident_id DESC LIMIT $4",
            crate::incidents::COLUMNS
        );
        self.tx
            .query(
                sql.as_str(),
                &[
                    &after_ms,
                    &after_id.as_slice(),
                    &state.map(|s| i64::from(s as i32)),
                    &i64::from(limit),
                ],
            )
            .map_err(db("list incidents"))?
            .iter()
            .map(|r| crate::incidents::from_row(r).map_err(store_error))
            .collect()
    }
}

/// A control reader on its own connection.
pub struct PgReader {
    /// `None` only while dropping.
    client: Option<Client>,
    /// This connection's id for the prepared statements (see `prep`).
    conn_id: u64,
    /// Where the output bytes are.
    output: Box<dyn OutputStore>,
    codec: TokenCodec,
    key: [u8; TOKEN_KEY_LEN],
}

impl std::fmt::Debug for PgReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgReader").finish_non_exhaustive()
    }
}

impl PgReader {
    /// Connects a reader.
    ///
    /// # Errors
    /// When the database cannot be reached or its token key is malformed.
    pub fn connect(conninfo: &str) -> Result<Self, Fail> {
        let mut client = Client::connect(conninfo, NoTls).map_err(Fail::db("connect a reader"))?;
        let key = token_key(&mut client)?;
        Ok(Self {
            client: Some(client),
            conn_id: crate::next_conn(),
            output: Box::new(crate::output::DatabaseChunks),
            codec: TokenCodec::new(TokenKey::new(key)),
            key,
        })
    }

    /// Reads output bytes from `output` instead of the database's
    /// `output_chunks` table (the store's writers use the same, see
    /// [`crate::PgStore::set_output_store`]).
    pub fn set_output_store(&mut self, output: Box<dyn OutputStore>) {
        self.output = output;
    }

    /// Runs `read` in one read-only snapshot.
    fn snapshot<T>(
        &mut self,
        read: impl FnOnce(&mut PgSource<'_, '_>, &TokenCodec) -> Result<T, OpError>,
    ) -> Result<T, OpError> {
        crate::prep::enter(self.conn_id);
        let client = self.client.as_mut().ok_or_else(op_error_closed)?;
        let mut tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(db("begin a read"))?;
        let out = read(
            &mut PgSource {
                tx: &mut tx,
                output: self.output.as_mut(),
            },
            &self.codec,
        );
        // a read-only transaction: nothing to keep
        drop(tx);
        if out.is_err() {
            // a cached statement may be what failed
            crate::prep::forget(self.conn_id);
        }
        out
    }
}

fn op_error_closed() -> OpError {
    OpError::Store(StoreError::Integrity(
        "the reader's connection is closed".into(),
    ))
}

impl Drop for PgReader {
    /// The blocking client's close runs its own runtime: dropped on a
    /// thread of the server's async runtime (the control service at
    /// shutdown), it would panic there, so it is closed on a thread of
    /// its own.
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            let closing = std::thread::Builder::new()
                .name("rvbox-reader-close".into())
                .spawn(move || drop(client));
            if let Err(e) = closing {
                tracing::warn!(error = %e, "a reader's connection could not be closed on its own thread");
            }
        }
    }
}

impl ControlReads for PgReader {
    fn list_clients(
        &mut self,
        req: &wire::ListClientsRequest,
    ) -> Result<wire::ListClientsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| clients_page(src, key, req))
    }
    fn get_client(
        &mut self,
        client_id: &str,
        now_ms: i64,
    ) -> Result<wire::GetClientResponse, OpError> {
        self.snapshot(|src, _| client_detail(src, client_id, now_ms))
    }
    fn list_commands(
        &mut self,
        req: &wire::ListCommandsRequest,
    ) -> Result<wire::ListCommandsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| commands_page(src, key, req))
    }
    fn command_record(&mut self, issue: &[u8; 16]) -> Result<wire::CommandRecord, OpError> {
        self.snapshot(|src, _| command_record(src.tx, issue))
    }
    fn get_output(
        &mut self,
        req: &wire::GetOutputRequest,
    ) -> Result<wire::GetOutputResponse, OpError> {
        self.snapshot(|src, codec| output_page(src, codec, req))
    }
    fn events_after(
        &mut self,
        issue: &[u8; 16],
        after_event_seq: u64,
        limit: usize,
    ) -> Result<Vec<HistoryItem>, OpError> {
        self.snapshot(|src, _| history(src, issue, after_event_seq, limit))
    }
    fn incident_page(
        &mut self,
        req: &wire::ListStorageIncidentsRequest,
    ) -> Result<wire::ListStorageIncidentsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| incidents_page(src, key, req))
    }
    fn get_fleet_run(
        &mut self,
        req: &wire::GetFleetRunRequest,
    ) -> Result<wire::GetFleetRunResponse, OpError> {
        self.snapshot(|src, _| rvbox_store::fleet::get_fleet_run(src, req))
    }
    fn list_fleet_runs(
        &mut self,
        req: &wire::ListFleetRunsRequest,
    ) -> Result<wire::ListFleetRunsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| rvbox_store::fleet::list_fleet_runs(src, key, req))
    }
    fn list_fleet_targets(
        &mut self,
        req: &wire::ListFleetTargetsRequest,
    ) -> Result<wire::ListFleetTargetsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| rvbox_store::fleet::list_fleet_targets(src, key, req))
    }
    fn fleet_changes(
        &mut self,
        run: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<(wire::FleetRunRecord, Vec<wire::FleetTarget>), OpError> {
        self.snapshot(|src, _| rvbox_store::fleet::fleet_changes(src, run, after_seq, limit))
    }
    fn list_pty_sessions(
        &mut self,
        req: &wire::ListPtySessionsRequest,
    ) -> Result<wire::ListPtySessionsResponse, OpError> {
        let key = self.key;
        self.snapshot(|src, _| rvbox_store::pty::list_page(src, key, req))
    }
    fn pty_session(&mut self, id: &[u8; 16]) -> Result<wire::PtySessionInfo, OpError> {
        self.snapshot(|src, _| rvbox_store::pty::info_of(src, id))
    }
    fn pty_records(
        &mut self,
        id: &[u8; 16],
        after_rec_seq: u64,
        max_bytes: usize,
    ) -> Result<Vec<rvbox_store_port::pty::PtyRecord>, OpError> {
        self.snapshot(|src, _| rvbox_store::pty::records_of(src, id, after_rec_seq, max_bytes))
    }
}

impl PtySource for PgSource<'_, '_> {
    fn pty_row(&mut self, id: &[u8; 16]) -> Result<Option<PtyRow>, StoreError> {
        self.tx
            .query_opt(
                concat!(
                    "SELECT ",
                    crate::pty::view_columns!(),
                    " FROM pty_sessions WHERE pty_session_id = $1"
                ),
                &[&id.as_slice()],
            )
            .map_err(db("read terminal"))?
            .map(|r| crate::pty::row_of(&r).map_err(db("read terminal")))
            .transpose()
    }

    fn pty_rows_before(
        &mut self,
        client: &str,
        before_ms: i64,
        before_id: &[u8],
        limit: usize,
    ) -> Result<Vec<PtyRow>, StoreError> {
        self.tx
            .query(
                concat!(
                    "SELECT ",
                    crate::pty::view_columns!(),
                    " FROM pty_sessions
                      WHERE ($1::text = '' OR client_id = $1)
                        AND (opened_ms, pty_session_id) < ($2, $3)
                      ORDER BY opened_ms DESC, pty_session_id DESC LIMIT $4"
                ),
                &[&client, &before_ms, &before_id, &to_i64(limit as u64)],
            )
            .map_err(db("list terminals"))?
            .iter()
            .map(|r| crate::pty::row_of(r).map_err(db("list terminals")))
            .collect()
    }

    fn pty_records(
        &mut self,
        id: &[u8; 16],
        after_rec_seq: u64,
        limit: usize,
    ) -> Result<Vec<RecordRow>, StoreError> {
        self.tx
            .query(
                "SELECT rec_seq, at_ms, kind, pos, aux, data FROM pty_records
                 WHERE pty_session_id = $1 AND rec_seq > $2 ORDER BY rec_seq LIMIT $3",
                &[
                    &id.as_slice(),
                    &to_i64(after_rec_seq),
                    &to_i64(limit as u64),
                ],
            )
            .map_err(db("read terminal records"))?
            .iter()
            .map(|r| crate::pty::record_row_of(r).map_err(db("read terminal records")))
            .collect()
    }
}

const TARGET_SELECT: &str = "SELECT client_id, issue_uuid, state, lifecycle, exit_code, \
     exit_signal, rejection, released_ms, ended_ms, late, change_seq FROM fleet_targets";

impl FleetSource for PgSource<'_, '_> {
    fn fleet_run(&mut self, run: &[u8; 16]) -> Result<Option<RunRow>, StoreError> {
        let sql = format!(
            "SELECT {} FROM fleet_runs WHERE run_id = $1",
            rvbox_store::fleet::RUN_COLUMNS
        );
        self.tx
            .query_opt(sql.as_str(), &[&run.as_slice()])
            .map_err(db("load fleet run"))?
            .map(|r| rvbox_store::fleet::decode_run(crate::fleet::run_of(&r)))
            .transpose()
    }

    fn runs_before(
        &mut self,
        after_ms: i64,
        after_id: &[u8; 16],
        limit: usize,
    ) -> Result<Vec<([u8; 16], i64)>, StoreError> {
        self.tx
            .query(
                "SELECT run_id, created_ms FROM fleet_runs
                 WHERE created_ms < $1 OR (created_ms = $1 AND run_id < $2)
                 ORDER BY created_ms DESC, run_id DESC LIMIT $3",
                &[&after_ms, &after_id.as_slice(), &to_i64(limit as u64)],
            )
            .map_err(db("list fleet runs"))?
            .iter()
            .map(|r| {
                <[u8; 16]>::try_from(r.get::<_, Vec<u8>>(0).as_slice())
                    .map(|id| (id, r.get(1)))
                    .map_err(|_| {
                        StoreError::Integrity("a stored fleet run id is not 16 bytes".into())
                    })
            })
            .collect()
    }

    fn targets_after(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError> {
        let sql = format!(
            "{TARGET_SELECT} WHERE run_id = $1 AND ($2::bigint IS NULL OR state = $2)
               AND client_id > $3 ORDER BY client_id LIMIT $4"
        );
        Ok(self
            .tx
            .query(
                sql.as_str(),
                &[
                    &run.as_slice(),
                    &state.map(i64::from),
                    &after,
                    &to_i64(limit as u64),
                ],
            )
            .map_err(db("list fleet targets"))?
            .iter()
            .map(crate::fleet::target_of)
            .collect())
    }

    fn scan_targets(
        &mut self,
        run: &[u8; 16],
        state: Option<i32>,
        after: &str,
        max: usize,
    ) -> Result<Vec<(String, Option<String>)>, StoreError> {
        Ok(self
            .tx
            .query(
                "SELECT t.client_id, c.labels FROM fleet_targets t
                 LEFT JOIN clients c ON c.client_id = t.client_id
                 WHERE t.run_id = $1 AND ($2::bigint IS NULL OR t.state = $2)
                   AND t.client_id > $3
                 ORDER BY t.client_id LIMIT $4",
                &[
                    &run.as_slice(),
                    &state.map(i64::from),
                    &after,
                    &to_i64(max as u64),
                ],
            )
            .map_err(db("scan fleet targets"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
    }

    fn target(&mut self, run: &[u8; 16], client: &str) -> Result<wire::FleetTarget, StoreError> {
        let sql = format!("{TARGET_SELECT} WHERE run_id = $1 AND client_id = $2");
        self.tx
            .query_opt(sql.as_str(), &[&run.as_slice(), &client])
            .map_err(db("read fleet target"))?
            .map(|r| crate::fleet::target_of(&r))
            .ok_or_else(|| {
                StoreError::Integrity("a fleet target vanished inside a snapshot".into())
            })
    }

    fn changes(
        &mut self,
        run: &[u8; 16],
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<wire::FleetTarget>, StoreError> {
        let sql = format!(
            "{TARGET_SELECT} WHERE run_id = $1 AND change_seq > $2 ORDER BY change_seq LIMIT $3"
        );
        Ok(self
            .tx
            .query(
                sql.as_str(),
                &[&run.as_slice(), &to_i64(after_seq), &to_i64(limit as u64)],
            )
            .map_err(db("read fleet changes"))?
            .iter()
            .map(crate::fleet::target_of)
            .collect())
    }
}

/// Opens [`PgReader`]s on one database.
pub struct PgReaders {
    conninfo: String,
}

impl std::fmt::Debug for PgReaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgReaders").finish_non_exhaustive()
    }
}

impl PgReaders {
    /// Readers of the database `conninfo` names.
    #[must_use]
    pub fn new(conninfo: &str) -> Self {
        Self {
            conninfo: conninfo.to_owned(),
        }
    }
}

impl PgReaders {
    /// A reader, as its own type.
    ///
    /// # Errors
    /// As [`PgReader::connect`].
    pub fn open_pg(&self) -> Result<PgReader, Fail> {
        PgReader::connect(&self.conninfo)
    }
}

impl ReaderSource for PgReaders {
    fn open_reader(&self) -> Result<Box<dyn ControlReads>, StoreError> {
        Ok(Box::new(
            PgReader::connect(&self.conninfo).map_err(store_error)?,
        ))
    }
}

impl PgStore {
    /// A reader source on this store's database.
    #[must_use]
    pub fn readers(&self) -> PgReaders {
        PgReaders::new(&self.conninfo)
    }
}
