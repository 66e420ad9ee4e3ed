#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The audit log on real SQLite and real files (plan §5.2, §5.4 item 5):
//! append and read back, key names only, sealing and budget rotation, the
//! age trigger, and recovery of uncommitted tails, crashes and committed
//! damage.

mod support;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::audit::{AuditOutcome, AuditRecord, points};
use rvbox_store::crash::CrashHook;
use rvbox_store::fs::RealFs;
use rvbox_store::mutations::OpError;
use rvbox_store::{Store, StoreOptions};
use support::*;

fn opts(seal: u64, budget: u64) -> StoreOptions {
    let mut tiers = rvbox_retention::Tiers::server_defaults();
    tiers.free_space_floor = 0;
    StoreOptions {
        tiers,
        seal_bytes: seal,
        audit_budget_bytes: budget,
        ..StoreOptions::default()
    }
}

fn reopen(dir: &Path, o: StoreOptions) -> Store {
    open_with(dir, Arc::new(RealFs), o)
}

fn record(n: i64) -> AuditRecord {
    let env: BTreeMap<String, String> = [
        ("API_TOKEN".to_owned(), "s3cr3t-value".to_owned()),
        ("PATH".to_owned(), "/usr/bin".to_owned()),
    ]
    .into_iter()
    .collect();
    AuditRecord {
        time_ms: NOW + n,
        transport: "grpc-unix".into(),
        principal: "uid:1000".into(),
        client_id: Some("web-1".into()),
        issue_uuid: Some([7; 16]),
        action: "RunCommand".into(),
        outcome: if n % 3 == 0 {
            AuditOutcome::Refused
        } else {
            AuditOutcome::Ok
        },
        error_code: (n % 3 == 0).then_some(Code::QuotaExceeded as i32),
        command_digest: Some([n as u8; 32]),
        env_keys: Vec::new(),
        detail: if n % 2 == 0 {
            String::new()
        } else {
            format!("record {n}")
        },
        prev_hash: None,
    }
    .with_env_names(env.keys())
}

/// Records without their chain hashes (set when a record leaves the
/// outbox for its segment).
fn unchained(records: Vec<(u64, AuditRecord)>) -> Vec<(u64, AuditRecord)> {
    records
        .into_iter()
        .map(|(q, mut r)| {
            r.prev_hash = None;
            (q, r)
        })
        .collect()
}

fn audit_charged(s: &Store) -> (u64, u64) {
    s.db()
        .query_row(
            "SELECT (SELECT audit_charged FROM quota_totals),
                    (SELECT COALESCE(SUM(charged_bytes), 0) FROM audit_segments)",
            [],
            |r| {
                Ok((
                    u64::try_from(r.get::<_, i64>(0)?).unwrap(),
                    u64::try_from(r.get::<_, i64>(1)?).unwrap(),
                ))
            },
        )
        .unwrap()
}

fn audit_files(s: &Store) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(s.layout().audit_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn segment_count(s: &Store) -> u64 {
    let n: i64 = s
        .db()
        .query_row("SELECT COUNT(*) FROM audit_segments", [], |r| r.get(0))
        .unwrap();
    u64::try_from(n).unwrap()
}

#[test]
fn audit_records_append_and_read_back_with_key_names_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = reopen(dir.path(), opts(64 * 1024, 1024 * 1024));
    for n in 1..=5 {
        let ack = s.audit(&record(n), NOW + n).unwrap();
        assert_eq!(ack.seq, u64::try_from(n).unwrap());
        assert_eq!(ack.ordinal, 1);
    }
    let back = s.read_audit(0, 100).unwrap();
    assert_eq!(back.len(), 5);
    for (i, (seq, rec)) in back.iter().enumerate() {
        let n = i64::try_from(i).unwrap() + 1;
        assert_eq!(*seq, u64::try_from(n).unwrap());
        // appended, each record names the hash of the one before it
        assert!(rec.prev_hash.is_some());
        let mut unchained = rec.clone();
        unchained.prev_hash = None;
        assert_eq!(unchained, record(n));
        assert_eq!(
            rec.env_keys,
            vec!["API_TOKEN".to_owned(), "PATH".to_owned()]
        );
    }
    assert_eq!(s.read_audit(3, 1).unwrap()[0].0, 4);
    // no env value anywhere on disk or in the database
    let raw = std::fs::read(s.layout().audit_dir().join(&audit_files(&s)[0])).unwrap();
    let plain: Vec<u8> = {
        let mut out = Vec::new();
        let mut off = 0;
        let limits = rvbox_store::audit::audit_limits();
        while off < raw.len() {
            let d = rvbox_segment::decode(&raw[off..], &limits).unwrap();
            assert_eq!(d.meta.kind, rvbox_segment::Kind::Audit);
            out.extend(zstd::bulk::decompress(d.payload, d.meta.raw_len as usize).unwrap());
            off += rvbox_segment::encoded_len(u32::try_from(d.payload.len()).unwrap()) as usize;
        }
        out
    };
    assert!(!plain.windows(12).any(|w| w == b"s3cr3t-value"));
    assert!(plain.windows(9).any(|w| w == b"API_TOKEN"));
    // a key name carrying a value is refused
    let mut bad = record(9);
    bad.env_keys = vec!["API_TOKEN=s3cr3t".into()];
    match s.audit(&bad, NOW) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::InvalidArgument),
        other => panic!("{other:?}"),
    }
    let (counter, recount) = audit_charged(&s);
    assert_eq!(counter, recount);
    assert_counters(&s);

    // a restart keeps every committed record, and the sequence continues
    drop(s);
    let mut s = reopen(dir.path(), opts(64 * 1024, 1024 * 1024));
    assert_eq!(s.read_audit(0, 100).unwrap().len(), 5);
    assert_eq!(s.audit(&record(6), NOW + 6).unwrap().seq, 6);
    assert_counters(&s);
}

#[test]
fn audit_seals_and_rotates_oldest_complete_segments_under_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 8 * 1024;
    let mut s = reopen(dir.path(), opts(1024, budget));
    let mut rotated = 0;
    for n in 1..=100 {
        let ack = s.audit(&record(n), NOW + n).unwrap();
        rotated += ack.rotated;
        let (counter, recount) = audit_charged(&s);
        assert_eq!(counter, recount);
        assert!(counter <= budget, "{counter}");
    }
    assert!(rotated > 0);
    // the oldest segments went, files and rows alike; the newest survive
    let files = audit_files(&s);
    assert_eq!(files.len() as u64, segment_count(&s));
    assert!(!files.contains(&rvbox_segment::audit_file_name(1).unwrap()));
    let back = s.read_audit(0, 1000).unwrap();
    let seqs: Vec<u64> = back.iter().map(|(q, _)| *q).collect();
    assert_eq!(*seqs.last().unwrap(), 100);
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
    assert!(seqs[0] > 1);
    assert!(
        std::fs::read_dir(s.layout().trash_dir())
            .unwrap()
            .next()
            .is_none()
    );
    assert_counters(&s);
}

#[test]
fn audit_age_rotation_is_off_at_zero_and_never_takes_the_active_segment() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(1024, 100 * 1024 * 1024);
    let mut s = reopen(dir.path(), o.clone());
    for n in 1..=20 {
        s.audit(&record(n), NOW + n).unwrap();
    }
    let segments = segment_count(&s);
    assert!(segments > 2);
    // default age 0: a pass far in the future rotates nothing
    let r = s.maintain(NOW + 365 * 86_400_000).unwrap();
    assert_eq!(r.audit_rotated, 0);
    drop(s);
    o.audit_retention_ms = 1000;
    let mut s = reopen(dir.path(), o);
    let r = s.maintain(NOW + 20 + 1000).unwrap();
    assert_eq!(r.audit_rotated, segments - 1, "every complete segment");
    assert_eq!(segment_count(&s), 1);
    let last = s.read_audit(0, 100).unwrap();
    assert_eq!(last.last().unwrap().0, 20);
    assert_eq!(s.audit(&record(21), NOW + 21).unwrap().seq, 21);
    let (counter, recount) = audit_charged(&s);
    assert_eq!(counter, recount);
    assert_counters(&s);
}

#[derive(Debug)]
struct StopAt(&'static str, AtomicU32);

impl CrashHook for StopAt {
    fn at(&self, point: &'static str) {
        if point == self.0 && self.1.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("power cut at {point}");
        }
    }
}

#[test]
fn audit_recovery_cuts_uncommitted_tails_and_reports_damage() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(1024, 1024 * 1024);
    let mut s = reopen(dir.path(), o.clone());
    for n in 1..=6 {
        s.audit(&record(n), NOW + n).unwrap();
    }
    // a crash after the fsync, before committed_end moved
    s.set_crash_hook(Arc::new(StopAt(
        points::AUDIT_AFTER_FSYNC,
        AtomicU32::new(0),
    )));
    let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| s.audit(&record(7), NOW + 7)));
    assert!(crashed.is_err());
    drop(s);
    let mut s = reopen(dir.path(), o.clone());
    // the segment bytes of record 7 were never committed and are cut; the
    // record itself committed in the outbox, so it is read from there and
    // moves to its segment with the next flush, under the same sequence
    assert_eq!(s.audit_outbox_len().unwrap(), 1);
    let read = s.read_audit(0, 100).unwrap();
    let seqs: Vec<u64> = read.iter().map(|r| r.0).collect();
    assert_eq!(seqs, (1..=7).collect::<Vec<_>>());
    assert_eq!(read[6].1, record(7));
    assert_eq!(s.flush_audit(NOW + 8).unwrap(), 1);
    assert_eq!(s.audit_outbox_len().unwrap(), 0);
    // the same records; moved to its segment, record 7 now names the hash
    // of the one before it
    let moved = s.read_audit(0, 100).unwrap();
    assert!(moved[6].1.prev_hash.is_some());
    assert_eq!(unchained(moved), unchained(read));

    // garbage beyond the committed end of the active segment
    let active: i64 = s
        .db()
        .query_row(
            "SELECT ordinal FROM audit_segments WHERE state = 'active'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let active_path = s
        .layout()
        .audit_dir()
        .join(rvbox_segment::audit_file_name(u64::try_from(active).unwrap()).unwrap());
    drop(s);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&active_path)
        .unwrap();
    std::io::Write::write_all(&mut f, b"unacknowledged tail bytes").unwrap();
    drop(f);
    let s = reopen(dir.path(), o.clone());
    let committed: i64 = s
        .db()
        .query_row(
            "SELECT committed_end FROM audit_segments WHERE ordinal = ?1",
            [active],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        std::fs::metadata(&active_path).unwrap().len(),
        u64::try_from(committed).unwrap()
    );
    let all = rvbox_store::incidents::list(s.db(), None, None, 100).unwrap();
    let tail: Vec<_> = all
        .iter()
        .filter(|i| i.kind == wire::IncidentKind::UncommittedTail)
        .collect();
    assert!(!tail.is_empty());
    assert!(tail.iter().all(
        |i| i.scope_kind == wire::ScopeKind::Audit && i.state == wire::IncidentState::Repaired
    ));
    assert!(rvbox_store::incidents::open(s.db(), 10).unwrap().is_empty());
    assert_eq!(s.read_audit(0, 100).unwrap().len(), 7);

    // a corrupt committed byte in the first (sealed) segment
    let first = s
        .layout()
        .audit_dir()
        .join(rvbox_segment::audit_file_name(1).unwrap());
    drop(s);
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[140] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();
    let mut s = reopen(dir.path(), o);
    let open = rvbox_store::incidents::open(s.db(), 10).unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].scope_kind, wire::ScopeKind::Audit);
    assert_eq!(open[0].scope_key, "1");
    assert!(open[0].data_loss);
    let state: String = s
        .db()
        .query_row(
            "SELECT state FROM audit_segments WHERE ordinal = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(state, "damaged");
    // the rest stays readable and the log goes on
    let seqs: Vec<u64> = s.read_audit(0, 100).unwrap().iter().map(|r| r.0).collect();
    assert_eq!(*seqs.last().unwrap(), 7);
    assert!(!seqs.contains(&1));
    assert_eq!(s.audit(&record(8), NOW + 8).unwrap().seq, 8);
    let (counter, recount) = audit_charged(&s);
    assert_eq!(counter, recount);
    assert_counters(&s);
}

fn caller() -> rvbox_store::operator::Caller {
    rvbox_store::operator::Caller {
        transport: "grpc-unix".into(),
        principal: "uid:1000".into(),
    }
}

fn registration(
    instance: [u8; 16],
    expected: u64,
    session: u8,
    fence: Option<[u8; 16]>,
) -> rvbox_store::sessions::Registration {
    support::registration("web-1", instance, expected, [session; 16], fence)
}

fn actions(s: &Store) -> Vec<(String, AuditOutcome)> {
    s.read_audit(0, 1000)
        .unwrap()
        .into_iter()
        .map(|(_, r)| (r.action, r.outcome))
        .collect()
}

#[test]
fn control_mutations_commit_their_audit_record_with_the_effect() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = reopen(dir.path(), opts(64 * 1024, 1024 * 1024));
    let id = new_id();
    let mut req = run_request(&id, "web-1", "make deploy");
    if let Some(spec) = req.spec.as_mut() {
        spec.env.insert("API_TOKEN".into(), "s3cr3t-value".into());
    }
    s.run_command_as(&req, &caller(), NOW).unwrap();
    // the record is in the same transaction: durable before any flush
    assert_eq!(s.audit_outbox_len().unwrap(), 1);
    let (_, rec) = s.read_audit(0, 10).unwrap().remove(0);
    assert_eq!(rec.action, "RunCommand");
    assert_eq!(rec.outcome, AuditOutcome::Ok);
    assert_eq!(
        (rec.transport.as_str(), rec.principal.as_str()),
        ("grpc-unix", "uid:1000")
    );
    assert_eq!(rec.client_id.as_deref(), Some("web-1"));
    assert_eq!(rec.issue_uuid, Some(id));
    assert_eq!(
        rec.command_digest,
        Some(rvbox_segment::sha256(b"make deploy"))
    );
    assert_eq!(rec.env_keys, vec!["API_TOKEN".to_owned()]);
    let encoded = format!("{rec:?}");
    assert!(
        !encoded.contains("s3cr3t"),
        "an environment value leaked: {encoded}"
    );

    // a replay commits nothing and is audited on its own; so is a refusal
    s.run_command_as(&req, &caller(), NOW + 1).unwrap();
    let mut other = req.clone();
    other.client_id = "web-2".into();
    assert!(matches!(
        s.run_command_as(&other, &caller(), NOW + 2),
        Err(OpError::Refused(_))
    ));
    let signal = wire::SignalCommandRequest {
        request_id: text(&new_id()),
        issue_uuid: text(&id),
        signal: wire::SignalKind::Term as i32,
    };
    s.signal_command_as(
        &signal,
        &caller(),
        |_| Ok(rvbox_store::signals::SignalPlan::CancelQueued),
        NOW + 3,
    )
    .unwrap();
    let all = s.read_audit(0, 10).unwrap();
    assert_eq!(
        actions(&s),
        vec![
            ("RunCommand".to_owned(), AuditOutcome::Ok),
            ("RunCommand".to_owned(), AuditOutcome::Ok),
            ("RunCommand".to_owned(), AuditOutcome::Refused),
            ("SignalCommand".to_owned(), AuditOutcome::Ok),
        ]
    );
    assert_eq!(all[2].1.error_code, Some(Code::Conflict.to_wire() as i32));
    assert!(!all[2].1.detail.is_empty());
    assert_eq!(all[3].1.detail, "SIGNAL_KIND_TERM");
    // the flush moves them under the same sequences
    assert_eq!(s.flush_audit(NOW + 4).unwrap(), 4);
    assert_eq!(unchained(s.read_audit(0, 10).unwrap()), unchained(all));
    let (counter, recount) = audit_charged(&s);
    assert_eq!(counter, recount);
}

#[test]
fn a_crash_inside_the_command_transaction_leaves_neither_the_command_nor_its_record() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(64 * 1024, 1024 * 1024);
    let mut s = reopen(dir.path(), o.clone());
    let id = new_id();
    // a large script goes to its blob segment inside the transaction
    let script: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
    let mut req = run_request(&id, "web-1", "");
    req.spec = Some(wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::Script(
            wire::ScriptDescriptor {
                size_bytes: script.len() as u64,
                sha256: rvbox_segment::sha256(&script).to_vec(),
                display_basename: "deploy.sh".into(),
            },
        )),
        ..Default::default()
    });
    req.script = script;
    s.set_crash_hook(Arc::new(StopAt(
        rvbox_store::crash::points::BLOB_AFTER_SYNC,
        AtomicU32::new(0),
    )));
    let crashed =
        std::panic::catch_unwind(AssertUnwindSafe(|| s.run_command_as(&req, &caller(), NOW)));
    assert!(crashed.is_err(), "{crashed:?}");
    drop(s);
    let mut s = reopen(dir.path(), o);
    assert!(s.command_view(&id).is_err(), "the command must not exist");
    assert!(actions(&s).is_empty(), "nor its audit record");
    // the retry commits, and a crash right after its commit keeps both
    s.set_crash_hook(Arc::new(StopAt(
        rvbox_store::crash::points::RUN_COMMAND_AFTER_COMMIT,
        AtomicU32::new(0),
    )));
    let crashed = std::panic::catch_unwind(AssertUnwindSafe(|| {
        s.run_command_as(&req, &caller(), NOW + 1)
    }));
    assert!(crashed.is_err(), "{crashed:?}");
    drop(s);
    let s = reopen(dir.path(), opts(64 * 1024, 1024 * 1024));
    assert!(s.command_view(&id).is_ok());
    assert_eq!(
        actions(&s),
        vec![("RunCommand".to_owned(), AuditOutcome::Ok)]
    );
}

#[test]
fn a_full_outbox_refuses_control_mutations_but_never_session_bookkeeping() {
    let dir = tempfile::tempdir().unwrap();
    // an audit budget no record fits: every flush is refused
    let mut s = reopen(dir.path(), opts(64 * 1024, 1));
    let filler = record(1).encode();
    s.db()
        .execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO audit_outbox (time_ms, record) SELECT ?2, ?3 FROM n",
            rusqlite::params![rvbox_store::audit::AUDIT_OUTBOX_MAX as i64, NOW, filler],
        )
        .unwrap();
    assert_eq!(
        s.audit_outbox_len().unwrap(),
        rvbox_store::audit::AUDIT_OUTBOX_MAX
    );
    let id = new_id();
    match s.run_command_as(&run_request(&id, "web-1", "uptime"), &caller(), NOW) {
        Err(OpError::Refused(e)) => {
            assert_eq!(e.code(), Code::Unavailable);
            assert!(e.reason().contains("audit"), "{e}");
        }
        other => panic!("expected UNAVAILABLE, got {other:?}"),
    }
    assert!(s.command_view(&id).is_err(), "nothing was created");
    // session bookkeeping goes on without its record, counted
    let reg = registration([0xa; 16], 0, 1, None);
    assert_eq!(s.register_session(&reg, NOW).unwrap(), 1);
    assert!(
        s.close_session(&[1; 16], false, "connection closed", NOW)
            .unwrap()
    );
    assert!(s.metrics().audit_dropped.get() >= 2);
    assert!(s.metrics().audit_flush_failures.get() >= 1);
    // once the outbox drains, mutations are audited again
    s.db()
        .execute(
            "DELETE FROM audit_outbox WHERE id < (SELECT MAX(id) - 10 FROM audit_outbox)",
            [],
        )
        .unwrap();
    drop(s);
    let mut s = reopen(dir.path(), opts(64 * 1024, 1 << 30));
    s.flush_audit(NOW).unwrap();
    assert_eq!(s.audit_outbox_len().unwrap(), 0);
    s.run_command_as(&run_request(&id, "web-1", "uptime"), &caller(), NOW + 1)
        .unwrap();
    assert_eq!(s.audit_outbox_len().unwrap(), 1);
}

#[test]
fn session_records_commit_with_the_registration_the_fence_the_claim_and_the_close() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = reopen(dir.path(), opts(64 * 1024, 1024 * 1024));
    let reg = registration;
    s.register_session(&reg([0xa; 16], 0, 1, None), NOW)
        .unwrap();
    s.register_session(&reg([0xa; 16], 1, 2, Some([1; 16])), NOW + 1)
        .unwrap();
    s.record_pending_claim("web-1", &[0xb; 16], NOW + 2)
        .unwrap();
    s.close_session(
        &[2; 16],
        false,
        "liveness timeout; LivenessTimeout: no frame for 45 s",
        NOW + 3,
    )
    .unwrap();
    // closing again changes nothing and records nothing
    s.close_session(&[2; 16], false, "connection closed", NOW + 4)
        .unwrap();
    let all = s.read_audit(0, 100).unwrap();
    let got: Vec<(&str, &str)> = all
        .iter()
        .map(|(_, r)| (r.action.as_str(), r.detail.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("SessionRegistered", "generation 1"),
            (
                "SessionFenced",
                "fenced by the registration of generation 2"
            ),
            ("SessionRegistered", "generation 2, previous session fenced"),
            (
                "LiveConflictRefused",
                "another instance's session is live; the claim is recorded for takeover"
            ),
            (
                "SessionClosed",
                "liveness timeout; LivenessTimeout: no frame for 45 s"
            ),
        ]
    );
    for (_, r) in &all {
        assert_eq!(r.transport, "agent-wss");
        assert_eq!(r.client_id.as_deref(), Some("web-1"));
    }
    // what no effect carries is written on its own
    s.session_audits(
        &[rvbox_store_port::audit::SessionAudit::session(
            None,
            "HelloRejected",
            "hello: client_id is empty".into(),
        )],
        NOW + 5,
    )
    .unwrap();
    assert_eq!(s.read_audit(5, 10).unwrap()[0].1.action, "HelloRejected");
}

/// Every committed record of an audit segment file: (meta, raw record).
fn segment_records(path: &Path) -> Vec<(rvbox_segment::RecordMeta, Vec<u8>)> {
    let raw = std::fs::read(path).unwrap();
    let limits = rvbox_store::audit::audit_limits();
    let mut out = Vec::new();
    let mut off = 0;
    while off < raw.len() {
        let d = rvbox_segment::decode(&raw[off..], &limits).unwrap();
        out.push((
            d.meta.clone(),
            zstd::bulk::decompress(d.payload, d.meta.raw_len as usize).unwrap(),
        ));
        off += rvbox_segment::encoded_len(u32::try_from(d.payload.len()).unwrap()) as usize;
    }
    out
}

/// Rewrites an audit segment file from `records` with valid checksums,
/// sequences renumbered from `base_seq + 1`, and makes the database's
/// length and count agree: what someone who can write both the files and
/// the tables, but does not recompute the chain, leaves behind.
fn rewrite_segment(
    s: &Store,
    ordinal: u64,
    base_seq: u64,
    records: &[(rvbox_segment::RecordMeta, Vec<u8>)],
) {
    let limits = rvbox_store::audit::audit_limits();
    let mut bytes = Vec::new();
    for (k, (meta, raw)) in records.iter().enumerate() {
        let mut meta = meta.clone();
        meta.seq = base_seq + 1 + k as u64;
        meta.raw_len = u32::try_from(raw.len()).unwrap();
        meta.sha256 = rvbox_segment::sha256(raw);
        let stored = zstd::bulk::compress(raw, 3).unwrap();
        bytes.extend(rvbox_segment::encode(&meta, &stored, &limits).unwrap());
    }
    let name = rvbox_segment::audit_file_name(ordinal).unwrap();
    std::fs::write(s.layout().audit_dir().join(name), &bytes).unwrap();
    s.db()
        .execute(
            "UPDATE audit_segments SET committed_end = ?2, records = ?3 WHERE ordinal = ?1",
            rusqlite::params![
                i64::try_from(ordinal).unwrap(),
                bytes.len() as i64,
                records.len() as i64
            ],
        )
        .unwrap();
}

/// A store with 40 audit records over several sealed segments and its
/// segments (ordinal, base_seq).
fn chained_store(dir: &Path) -> (Store, Vec<(u64, u64)>) {
    let mut s = reopen(dir, opts(2048, 1024 * 1024));
    for n in 1..=40 {
        s.audit(&record(n), NOW + n).unwrap();
    }
    let segs: Vec<(u64, u64)> = {
        let mut st = s
            .db()
            .prepare("SELECT ordinal, base_seq FROM audit_segments ORDER BY ordinal")
            .unwrap();
        st.query_map([], |r| {
            Ok((
                u64::try_from(r.get::<_, i64>(0)?).unwrap(),
                u64::try_from(r.get::<_, i64>(1)?).unwrap(),
            ))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    };
    assert!(segs.len() >= 3, "{segs:?}");
    (s, segs)
}

fn segment_path(s: &Store, ordinal: u64) -> std::path::PathBuf {
    s.layout()
        .audit_dir()
        .join(rvbox_segment::audit_file_name(ordinal).unwrap())
}

/// The audit log is a hash chain the database anchors per segment: an
/// intact log verifies; a record edited with its checksums made to match,
/// a record removed, two records swapped (sequences renumbered, lengths
/// and counts fixed in the database) and a removed middle segment are
/// each found, naming the segment.
#[test]
fn the_audit_chain_finds_edited_removed_and_reordered_records() {
    let dir = tempfile::tempdir().unwrap();
    let (s, segs) = chained_store(dir.path());
    let v = s.verify_audit().unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert_eq!((v.chained, v.unchained), (40, 0));
    assert_ne!(v.head, [0; 32]);
    let (ordinal, base) = segs[1];
    let original = segment_records(&segment_path(&s, ordinal));
    assert!(original.len() >= 3);

    // an edited record: another action, checksums recomputed
    let mut edited = original.clone();
    let mut rec = AuditRecord::decode(&edited[1].1).unwrap();
    rec.action = "GetCommand".into();
    edited[1].1 = rec.encode();
    rewrite_segment(&s, ordinal, base, &edited);
    let v = s.verify_audit().unwrap();
    assert!(
        v.problems
            .iter()
            .any(|p| p.contains(&format!("audit segment {ordinal}"))),
        "{:?}",
        v.problems
    );

    // a removed record
    let mut removed = original.clone();
    removed.remove(1);
    rewrite_segment(&s, ordinal, base, &removed);
    let v = s.verify_audit().unwrap();
    assert!(!v.problems.is_empty(), "a removed record went unnoticed");

    // two records swapped
    let mut swapped = original.clone();
    swapped.swap(0, 1);
    rewrite_segment(&s, ordinal, base, &swapped);
    let v = s.verify_audit().unwrap();
    assert!(!v.problems.is_empty(), "reordered records went unnoticed");

    // put back as it was: intact again
    rewrite_segment(&s, ordinal, base, &original);
    assert!(s.verify_audit().unwrap().problems.is_empty());

    // a middle segment removed, file and row
    std::fs::remove_file(segment_path(&s, ordinal)).unwrap();
    s.db()
        .execute(
            "DELETE FROM audit_segments WHERE ordinal = ?1",
            [i64::try_from(ordinal).unwrap()],
        )
        .unwrap();
    let v = s.verify_audit().unwrap();
    let next = segs[2].0;
    assert!(
        v.problems
            .iter()
            .any(|p| p.contains(&format!("audit segment {next}"))),
        "{:?}",
        v.problems
    );
}

/// Rotation keeps the chain checkable: the oldest kept segment continues
/// the hash the rotated one ended with, and a restart continues the chain.
#[test]
fn the_audit_chain_survives_rotation_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = reopen(dir.path(), opts(1024, 8 * 1024));
    for n in 1..=100 {
        s.audit(&record(n), NOW + n).unwrap();
    }
    assert!(!audit_files(&s).contains(&rvbox_segment::audit_file_name(1).unwrap()));
    let v = s.verify_audit().unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    let head = v.head;
    drop(s);
    let mut s = reopen(dir.path(), opts(1024, 8 * 1024));
    assert_eq!(s.verify_audit().unwrap().head, head);
    s.audit(&record(101), NOW + 101).unwrap();
    let v = s.verify_audit().unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert_ne!(v.head, head);
}
