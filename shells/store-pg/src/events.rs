//! The event append path on PostgreSQL: one transaction for a whole
//! append group (issue 25's "group commit as one transaction per group"),
//! with the same rules as the SQLite store's append (`rvbox_store::events`):
//! content identity and validation, the sequence rules, lifecycle edges,
//! stdin acknowledgements, quota reservation, closeout release and the
//! replay tombstone of a terminal event.
//!
//! The commands a group touches are locked `FOR UPDATE` in one statement,
//! in id order (so two groups never deadlock on them), and each event's
//! session `FOR SHARE`: a replica that lost the client can no longer
//! commit its events.
//!
//! Not yet on PostgreSQL: dropping output on arrival under quota pressure
//! (the SQLite store records a truncation in its place; here the event is
//! refused `QUOTA_EXCEEDED`, transient, and the client sends it again),
//! and the rotation of old output an append may trigger. Both need the
//! retention pass of the PostgreSQL store.

use std::collections::{BTreeMap, BTreeSet};

use postgres::Transaction;
use prost::Message as _;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::events::{SeqVerdict, check_event_seq};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_retention::{
    CHARGE_VERSION, ChargeKind, Class, Usage, charge, release_closeout, reserve,
};
use rvbox_store::events::{MAX_INLINE_BODY_BYTES, check_output, other_digest};
use rvbox_store_port::events::{AppendReport, EventAppend, EventBody, EventOutcome, body_kind};
use rvbox_store_port::sessions::SessionFence;

use crate::output::{OutputChunk, OutputStore};
use crate::sessions::{global_charged, to_i64, to_u64};
use crate::{Fail, PgStore, StoreOptions};

/// What a group reads of a command, and carries forward event by event.
#[derive(Debug, Clone)]
struct CmdView {
    client_id: String,
    lifecycle: Lifecycle,
    last_seq: u64,
    charged: u64,
    output_charged: u64,
    held_closeout: u64,
    request_hash: Vec<u8>,
    /// Its stored state is under an open storage incident.
    dirty: bool,
}

/// One event the group stores.
#[derive(Debug)]
struct Accepted {
    issue: [u8; 16],
    seq: u64,
    observed_ms: i64,
    kind: u8,
    stream: u8,
    raw_len: u64,
    stored_len: u64,
    digest: [u8; 32],
    inline: Option<Vec<u8>>,
    lifecycle: Option<(Lifecycle, Option<i32>, Option<i32>)>,
    stdin_ack: Option<(u64, i32)>,
}

fn refuse(code: Code, reason: impl AsRef<str>) -> EventOutcome {
    EventOutcome::Refused(DomainError::new(code, reason))
}

fn lifecycle_of(raw: i64) -> Lifecycle {
    Lifecycle::from_wire(i32::try_from(raw).unwrap_or(0)).unwrap_or(Lifecycle::Interrupted)
}

/// The group's commands, locked in id order.
fn lock_views(
    tx: &mut Transaction<'_>,
    issues: &BTreeSet<[u8; 16]>,
) -> Result<BTreeMap<[u8; 16], CmdView>, Fail> {
    let ids: Vec<&[u8]> = issues.iter().map(<[u8; 16]>::as_slice).collect();
    let rows = tx
        .query(
            "SELECT issue_uuid, client_id, lifecycle, last_event_seq, charged_bytes,
                    output_charged, closeout_held, request_hash, essential_trusted
             FROM commands WHERE issue_uuid = ANY($1)
             ORDER BY issue_uuid FOR UPDATE",
            &[&ids],
        )
        .map_err(Fail::db("lock the group's commands"))?;
    let mut out = BTreeMap::new();
    for r in rows {
        let id: Vec<u8> = r.get(0);
        let Ok(id) = <[u8; 16]>::try_from(id.as_slice()) else {
            continue;
        };
        out.insert(
            id,
            CmdView {
                client_id: r.get(1),
                lifecycle: lifecycle_of(r.get(2)),
                last_seq: to_u64(r.get(3)),
                charged: to_u64(r.get(4)),
                output_charged: to_u64(r.get(5)),
                held_closeout: to_u64(r.get(6)),
                request_hash: r.get(7),
                dirty: !r.get::<_, bool>(8),
            },
        );
    }
    Ok(out)
}

/// The live owner of a session, locked `FOR SHARE` (`None`: not live).
fn session_owner(tx: &mut Transaction<'_>, fence: &SessionFence) -> Result<Option<String>, Fail> {
    Ok(tx
        .query_opt(
            "SELECT client_id FROM sessions WHERE session_id = $1 AND live FOR SHARE",
            &[&fence.session_id.as_slice()],
        )
        .map_err(Fail::db("check the event's session"))?
        .map(|r| r.get(0)))
}

fn stored_digest(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    seq: u64,
) -> Result<Option<[u8; 32]>, Fail> {
    Ok(tx
        .query_opt(
            "SELECT content_sha256 FROM command_events WHERE issue_uuid = $1 AND event_seq = $2",
            &[&issue.as_slice(), &to_i64(seq)],
        )
        .map_err(Fail::db("load event digest"))?
        .and_then(|r| <[u8; 32]>::try_from(r.get::<_, Vec<u8>>(0).as_slice()).ok()))
}

/// A `StdinAck` checked against its write: the write's stored length
/// while it is pending, `None` once settled.
fn check_ack(
    tx: &mut Transaction<'_>,
    issue: &[u8; 16],
    ack: &rvbox_proto::v1::StdinAck,
) -> Result<Result<Option<u64>, DomainError>, Fail> {
    use rvbox_proto::v1::StdinDelivery;
    if !matches!(
        StdinDelivery::try_from(ack.delivery),
        Ok(StdinDelivery::Written | StdinDelivery::Discarded)
    ) {
        return Ok(Err(DomainError::new(
            Code::ProtocolError,
            "stdin_ack.delivery must be WRITTEN or DISCARDED",
        )));
    }
    let row = tx
        .query_opt(
            "SELECT delivery, stored_len FROM stdin_writes WHERE issue_uuid = $1 AND write_seq = $2",
            &[&issue.as_slice(), &to_i64(ack.write_seq)],
        )
        .map_err(Fail::db("read stdin write"))?;
    Ok(match row {
        None => Err(DomainError::new(
            Code::ProtocolError,
            format!(
                "stdin_ack.write_seq {} names a write the server never assigned",
                ack.write_seq
            ),
        )),
        Some(r) if r.get::<_, i64>(0) == 1 => Ok(Some(to_u64(r.get(1)))),
        Some(_) => Ok(None),
    })
}

fn integrity(e: impl std::fmt::Display) -> Fail {
    Fail::Integrity(e.to_string())
}

/// The group's decisions, event by event, and what they leave behind.
struct Plan {
    outcomes: Vec<EventOutcome>,
    accepted: Vec<Accepted>,
    chunks: Vec<OutputChunk>,
    views: BTreeMap<[u8; 16], CmdView>,
    /// Per client: charged bytes before the group and after it.
    owners: BTreeMap<String, (u64, u64)>,
    global_before: u64,
    global: u64,
}

/// Decides every event of the batch (the SQLite store's planning rules).
#[allow(clippy::too_many_lines)]
fn plan(
    tx: &mut Transaction<'_>,
    dctx: &mut zstd::bulk::Decompressor<'static>,
    opts: &StoreOptions,
    batch: &[EventAppend],
) -> Result<Plan, Fail> {
    let issues: BTreeSet<[u8; 16]> = batch.iter().map(|e| e.issue_uuid).collect();
    let mut views = lock_views(tx, &issues)?;
    let global_before = global_charged(tx)?;
    let mut global = global_before;
    let mut owners: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut sessions_seen: BTreeMap<[u8; 16], Option<String>> = BTreeMap::new();
    let mut batch_digests: BTreeMap<([u8; 16], u64), [u8; 32]> = BTreeMap::new();
    let mut stdin_settled: BTreeSet<([u8; 16], u64)> = BTreeSet::new();
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut accepted = Vec::new();
    let mut chunks = Vec::new();
    for ev in batch {
        let issue = ev.issue_uuid;
        let Some(view) = views.get_mut(&issue) else {
            outcomes.push(refuse(Code::ProtocolError, "event for an unknown command"));
            continue;
        };
        if view.dirty {
            outcomes.push(refuse(
                Code::Unavailable,
                "the command's stored state is under an open storage incident",
            ));
            continue;
        }
        if let Some(fence) = &ev.session {
            let owner = match sessions_seen.get(&fence.session_id) {
                Some(o) => o.clone(),
                None => {
                    let o = session_owner(tx, fence)?;
                    sessions_seen.insert(fence.session_id, o.clone());
                    o
                }
            };
            let refusal = match owner {
                Some(o) if o == view.client_id => None,
                Some(_) => Some("the write's session belongs to another client"),
                None => Some("the write's session is no longer its client's live session"),
            };
            if let Some(reason) = refusal {
                tracing::warn!(reason, "event refused: its session is not live");
                outcomes.push(refuse(Code::StaleSession, reason));
                continue;
            }
        }
        let (kind, digest) = match &ev.body {
            EventBody::Output {
                compression,
                raw_len,
                stored,
                ..
            } => match check_output(dctx, *compression, *raw_len, stored) {
                Ok(d) => (body_kind::OUTPUT, d),
                Err(e) => {
                    outcomes.push(EventOutcome::Refused(e));
                    continue;
                }
            },
            EventBody::Lifecycle { encoded, .. } => (
                body_kind::LIFECYCLE,
                other_digest(body_kind::LIFECYCLE, encoded),
            ),
            EventBody::Other { kind, encoded } => (*kind, other_digest(*kind, encoded)),
        };
        if let EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } = &ev.body
            && encoded.len() > MAX_INLINE_BODY_BYTES
        {
            outcomes.push(refuse(Code::ProtocolError, "event body exceeds 16 KiB"));
            continue;
        }
        if !(body_kind::OUTPUT..=body_kind::PROFILE_RESULT).contains(&kind) {
            outcomes.push(refuse(
                Code::ProtocolError,
                format!("unknown event body kind {kind}"),
            ));
            continue;
        }
        // sequence rules
        let stored = if ev.event_seq <= view.last_seq {
            match batch_digests.get(&(issue, ev.event_seq)) {
                Some(d) => Some(*d),
                None => stored_digest(tx, &issue, ev.event_seq)?,
            }
        } else {
            None
        };
        match check_event_seq(view.last_seq, ev.event_seq, stored.as_ref(), &digest) {
            Ok(SeqVerdict::Duplicate) => {
                outcomes.push(EventOutcome::Duplicate);
                continue;
            }
            Ok(SeqVerdict::Append) => {}
            Err(e) => {
                outcomes.push(refuse(Code::ProtocolError, e.to_string()));
                continue;
            }
        }
        if view.lifecycle.is_terminal() {
            outcomes.push(refuse(
                Code::ProtocolError,
                "event after the command's terminal event",
            ));
            continue;
        }
        let lifecycle = match &ev.body {
            EventBody::Lifecycle {
                to,
                exit_code,
                exit_signal,
                ..
            } => {
                // reconciliation may already have advanced the command to
                // this lifecycle; the event itself is still stored
                if *to != view.lifecycle
                    && let Err(e) = view.lifecycle.check_transition(*to)
                {
                    outcomes.push(refuse(Code::ProtocolError, e.to_string()));
                    continue;
                }
                Some((*to, *exit_code, *exit_signal))
            }
            _ => None,
        };
        let mut stdin_ack = None;
        if let EventBody::Other { kind, encoded } = &ev.body
            && *kind == body_kind::STDIN_ACK
        {
            let Ok(ack) = rvbox_proto::v1::StdinAck::decode(encoded.as_slice()) else {
                outcomes.push(refuse(Code::ProtocolError, "stdin_ack does not decode"));
                continue;
            };
            match check_ack(tx, &issue, &ack)? {
                Err(e) => {
                    outcomes.push(EventOutcome::Refused(e));
                    continue;
                }
                Ok(Some(stored)) if !stdin_settled.contains(&(issue, ack.write_seq)) => {
                    stdin_ack = Some((
                        ack.write_seq,
                        ack.delivery,
                        rvbox_store::stdin::settled_release(stored).map_err(integrity)?,
                    ));
                }
                Ok(_) => {}
            }
        }
        // quota
        let (charge_kind, class, bytes) = match &ev.body {
            EventBody::Output { stored, .. } => (
                ChargeKind::OutputRecord,
                Class::Ordinary,
                rvbox_segment::RECORD_OVERHEAD + stored.len() as u64,
            ),
            EventBody::Lifecycle { encoded, .. } => {
                (ChargeKind::EventRow, Class::Essential, encoded.len() as u64)
            }
            EventBody::Other { kind, encoded } => {
                let class = if *kind == body_kind::DIAGNOSTICS || *kind == body_kind::PROFILE_RESULT
                {
                    Class::Ordinary
                } else {
                    Class::Essential
                };
                (ChargeKind::EventRow, class, encoded.len() as u64)
            }
        };
        let charged = charge(CHARGE_VERSION, charge_kind, bytes).map_err(integrity)?;
        let owner_used = match owners.get(&view.client_id) {
            Some(v) => v.1,
            None => {
                let v: i64 = tx
                    .query_opt(
                        "SELECT charged_bytes FROM clients WHERE client_id = $1",
                        &[&view.client_id],
                    )
                    .map_err(Fail::db("read client usage"))?
                    .map_or(0, |r| r.get(0));
                owners.insert(view.client_id.clone(), (to_u64(v), to_u64(v)));
                to_u64(v)
            }
        };
        let usage = Usage {
            command: view.charged,
            held_closeout: view.held_closeout,
            owner: owner_used,
            global,
            free_space: u64::MAX,
        };
        let r = match reserve(&opts.tiers, &usage, charge_kind, class, charged, true) {
            Ok(r) => r,
            Err(refusal) => {
                tracing::warn!(
                    tier = refusal.tier.name(),
                    kind = charge_kind.name(),
                    "event refused by quota"
                );
                outcomes.push(refuse(Code::QuotaExceeded, refusal.to_string()));
                continue;
            }
        };
        view.charged = r.command_after;
        view.held_closeout = r.held_closeout_after;
        let mut owner_after = r.owner_after;
        global = r.global_after;
        if let Some((write_seq, _, freed)) = stdin_ack {
            let after = rvbox_store::stdin::usage_after_settle(
                &Usage {
                    command: view.charged,
                    held_closeout: view.held_closeout,
                    owner: owner_after,
                    global,
                    free_space: u64::MAX,
                },
                freed,
            )
            .map_err(integrity)?;
            view.charged = after.command;
            owner_after = after.owner;
            global = after.global;
            stdin_settled.insert((issue, write_seq));
        }
        if let Some(o) = owners.get_mut(&view.client_id) {
            o.1 = owner_after;
        }
        view.last_seq = ev.event_seq;
        batch_digests.insert((issue, ev.event_seq), digest);
        if let Some((to, _, _)) = lifecycle {
            view.lifecycle = to;
        }
        let mut a = Accepted {
            issue,
            seq: ev.event_seq,
            observed_ms: ev.observed_ms,
            kind,
            stream: 0,
            raw_len: 0,
            stored_len: 0,
            digest,
            inline: None,
            lifecycle,
            stdin_ack: stdin_ack.map(|(seq, delivery, _)| (seq, delivery)),
        };
        match &ev.body {
            EventBody::Output {
                stream,
                compression,
                raw_len,
                stored,
            } => {
                view.output_charged = view.output_charged.saturating_add(charged);
                a.stream = stream.as_u8();
                a.raw_len = u64::from(*raw_len);
                a.stored_len = stored.len() as u64;
                chunks.push(OutputChunk {
                    issue_uuid: issue,
                    event_seq: ev.event_seq,
                    stream: *stream,
                    compression: *compression,
                    raw_len: *raw_len,
                    sha256: digest,
                    stored: stored.clone(),
                });
            }
            EventBody::Lifecycle { encoded, .. } | EventBody::Other { encoded, .. } => {
                a.inline = Some(encoded.clone());
                a.stored_len = encoded.len() as u64;
                a.raw_len = encoded.len() as u64;
            }
        }
        accepted.push(a);
        outcomes.push(EventOutcome::Appended);
    }
    Ok(Plan {
        outcomes,
        accepted,
        chunks,
        views,
        owners,
        global_before,
        global,
    })
}

/// Writes what the plan accepted, in the plan's transaction.
#[allow(clippy::too_many_lines)]
fn write(
    tx: &mut Transaction<'_>,
    output: &mut dyn OutputStore,
    plan: &mut Plan,
    now_ms: i64,
    tombstone_cap: u64,
) -> Result<(), Fail> {
    let insert = tx
        .prepare(
            "INSERT INTO command_events (issue_uuid, event_seq, observed_ms, receipt_ms, body_kind,
                 stream, raw_len, stored_len, content_sha256, inline_body)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .map_err(Fail::db("prepare event insert"))?;
    for a in &plan.accepted {
        tx.execute(
            &insert,
            &[
                &a.issue.as_slice(),
                &to_i64(a.seq),
                &a.observed_ms,
                &now_ms,
                &i64::from(a.kind),
                &i64::from(a.stream),
                &to_i64(a.raw_len),
                &to_i64(a.stored_len),
                &a.digest.as_slice(),
                &a.inline,
            ],
        )
        .map_err(Fail::db("insert event"))?;
        if let Some((to, code, signal)) = a.lifecycle {
            let terminal = to.is_terminal().then_some(now_ms);
            // a terminal time never before the issue time; a non-terminal
            // lifecycle keeps the one it has
            tx.execute(
                "UPDATE commands SET lifecycle = $2,
                     terminal_time_ms = CASE WHEN $3::bigint IS NULL THEN terminal_time_ms
                                             ELSE GREATEST($3, issue_time_ms) END,
                     exit_code = COALESCE($4, exit_code), exit_signal = COALESCE($5, exit_signal)
                 WHERE issue_uuid = $1",
                &[
                    &a.issue.as_slice(),
                    &i64::from(to.to_wire() as i32),
                    &terminal,
                    &code.map(i64::from),
                    &signal.map(i64::from),
                ],
            )
            .map_err(Fail::db("apply lifecycle"))?;
            if to.is_terminal() {
                tx.execute(
                    "UPDATE stdin_writes SET delivery = 3, payload = '\\x'::bytea
                     WHERE issue_uuid = $1 AND delivery = 1",
                    &[&a.issue.as_slice()],
                )
                .map_err(Fail::db("discard pending stdin"))?;
            }
        }
        if let Some((write_seq, delivery)) = a.stdin_ack {
            let to: i64 = if delivery == rvbox_proto::v1::StdinDelivery::Written as i32 {
                2
            } else {
                3
            };
            tx.execute(
                "UPDATE stdin_writes SET delivery = $3, payload = '\\x'::bytea
                 WHERE issue_uuid = $1 AND write_seq = $2 AND delivery = 1",
                &[&a.issue.as_slice(), &to_i64(write_seq), &to],
            )
            .map_err(Fail::db("settle stdin write"))?;
        }
    }
    output.put(tx, &plan.chunks)?;
    let mut global = plan.global;
    let touched: BTreeSet<[u8; 16]> = plan.accepted.iter().map(|a| a.issue).collect();
    for issue in touched {
        let Some(v) = plan.views.get(&issue) else {
            continue;
        };
        let (mut charged, mut held) = (v.charged, v.held_closeout);
        if v.lifecycle.is_terminal() && held > 0 {
            // the command is closed: its unused closeout headroom goes back
            let owner = plan.owners.get(&v.client_id).map_or(0, |o| o.1);
            let usage = Usage {
                command: charged,
                held_closeout: held,
                owner,
                global,
                free_space: 0,
            };
            if let Ok(after) = release_closeout(&usage) {
                charged = after.command;
                held = after.held_closeout;
                if let Some(o) = plan.owners.get_mut(&v.client_id) {
                    o.1 = after.owner;
                }
                global = after.global;
            }
        }
        tx.execute(
            "UPDATE commands SET last_event_seq = $2, charged_bytes = $3, output_charged = $4,
                 closeout_held = $5 WHERE issue_uuid = $1",
            &[
                &issue.as_slice(),
                &to_i64(v.last_seq),
                &to_i64(charged),
                &to_i64(v.output_charged.min(charged)),
                &to_i64(held),
            ],
        )
        .map_err(Fail::db("update command"))?;
        if v.lifecycle.is_terminal() {
            crate::commands::insert_tombstone(
                tx,
                &issue,
                &v.request_hash,
                &v.client_id,
                v.lifecycle,
                now_ms,
                tombstone_cap,
            )?;
        }
    }
    // the followers of each command that has new events, on any replica
    let touched: BTreeSet<[u8; 16]> = plan.accepted.iter().map(|a| a.issue).collect();
    for issue in &touched {
        crate::notify::command(tx, issue)?;
    }
    for (client, (before, after)) in &plan.owners {
        let d = to_i64(*after).saturating_sub(to_i64(*before));
        if d != 0 {
            tx.execute(
                "UPDATE clients SET charged_bytes = charged_bytes + $2 WHERE client_id = $1",
                &[client, &d],
            )
            .map_err(Fail::db("update client usage"))?;
        }
    }
    let d = to_i64(global).saturating_sub(to_i64(plan.global_before));
    if d != 0 {
        tx.execute(
            "UPDATE quota_totals SET command_charged = command_charged + $1 WHERE id = 1",
            &[&d],
        )
        .map_err(Fail::db("update global usage"))?;
    }
    Ok(())
}

impl PgStore {
    /// Appends a group of events in one transaction; refused events are
    /// reported per event and store nothing, the rest commit together.
    pub(crate) fn append_events(
        &mut self,
        batch: &[EventAppend],
        now_ms: i64,
    ) -> Result<AppendReport, Fail> {
        let mut dctx = zstd::bulk::Decompressor::new()
            .map_err(|e| Fail::Integrity(format!("zstd decompression context: {e}")))?;
        let mut output =
            std::mem::replace(&mut self.output, Box::new(crate::output::DatabaseChunks));
        let result = self.in_tx("append events", |tx, opts| {
            let mut plan = plan(tx, &mut dctx, opts, batch)?;
            write(tx, output.as_mut(), &mut plan, now_ms, opts.tombstone_cap)?;
            // per command of the batch: its highest contiguous durable
            // sequence (a cumulative EventAck)
            let acked = batch
                .iter()
                .filter_map(|e| {
                    plan.views
                        .get(&e.issue_uuid)
                        .map(|v| (e.issue_uuid, v.last_seq))
                })
                .collect();
            Ok(AppendReport {
                outcomes: std::mem::take(&mut plan.outcomes),
                acked,
            })
        });
        self.output = output;
        result
    }
}
