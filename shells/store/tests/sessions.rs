#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Client registration, fencing and takeover grants on real SQLite (plan
//! §6.2).

mod support;

use rvbox_domain::error::Code;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_store::mutations::OpError;
use rvbox_store::sessions::Registration;
use support::*;

const A: [u8; 16] = [0xa; 16];
const B: [u8; 16] = [0xb; 16];
const C: [u8; 16] = [0xc; 16];

fn caps() -> wire::Capabilities {
    wire::Capabilities {
        software_version: "1.0.0".into(),
        max_running: 4,
        max_queued: 10,
        ..Default::default()
    }
}

fn reg(
    instance: [u8; 16],
    expected: u64,
    session: u8,
    fence: Option<[u8; 16]>,
    grant: Option<i64>,
) -> Registration {
    Registration {
        client_id: "web-1".into(),
        instance_id: instance,
        expected_generation: expected,
        session_id: [session; 16],
        fence,
        consume_grant: grant,
        capabilities: caps(),
        cwd_policy: None,
        labels: String::new(),
    }
}

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

fn live_sessions(s: &rvbox_store::Store) -> i64 {
    s.db()
        .query_row(
            "SELECT COUNT(*) FROM sessions WHERE client_id = 'web-1' AND live = 1",
            [],
            |r| r.get(0),
        )
        .unwrap()
}

fn request_id() -> Uuid7 {
    Uuid7::from_bytes("request_id", new_id()).unwrap()
}

#[test]
fn first_registration_installs_generation_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    assert!(s.client_record("web-1").unwrap().is_none());
    assert_eq!(
        s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap(),
        1
    );
    let r = s.client_record("web-1").unwrap().unwrap();
    assert_eq!(r.generation, 1);
    assert_eq!(r.instance_id, Some(A));
    let live = r.live.unwrap();
    assert_eq!(
        (live.session_id, live.instance_id, live.generation),
        ([1; 16], A, 1)
    );
    assert_eq!(s.metrics().sessions_registered.get(), 1);
}

#[test]
fn same_instance_replacement_fences_the_prior_session_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    assert_eq!(
        s.register_session(&reg(A, 1, 2, Some([1; 16]), None), NOW + 5)
            .unwrap(),
        2
    );
    assert_eq!(live_sessions(&s), 1);
    let (live, fenced): (i64, Option<i64>) = s
        .db()
        .query_row(
            "SELECT live, fenced_ms FROM sessions WHERE session_id = ?1",
            [[1u8; 16].as_slice()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((live, fenced), (0, Some(NOW + 5)));
    assert_eq!(
        s.client_record("web-1")
            .unwrap()
            .unwrap()
            .live
            .unwrap()
            .session_id,
        [2; 16]
    );
    assert_eq!(s.metrics().sessions_fenced.get(), 1);
}

#[test]
fn a_decision_taken_on_a_stale_view_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    // another registration won in between: generation 1 is gone
    s.register_session(&reg(A, 1, 2, Some([1; 16]), None), NOW)
        .unwrap();
    let before = s.client_record("web-1").unwrap();
    assert_eq!(
        code(
            s.register_session(&reg(A, 1, 3, Some([1; 16]), None), NOW)
                .unwrap_err()
        ),
        Code::Conflict
    );
    // right generation, but it names a session that is no longer live
    assert_eq!(
        code(
            s.register_session(&reg(A, 2, 3, Some([1; 16]), None), NOW)
                .unwrap_err()
        ),
        Code::Conflict
    );
    // and a decision that missed a live session entirely
    assert_eq!(
        code(
            s.register_session(&reg(A, 2, 3, None, None), NOW)
                .unwrap_err()
        ),
        Code::Conflict
    );
    assert_eq!(s.client_record("web-1").unwrap(), before);
    assert_eq!(live_sessions(&s), 1);
}

#[test]
fn a_live_conflict_claim_is_recorded_and_a_takeover_grant_admits_exactly_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    // instance B arrives while A's session is live: rejected, claim durable
    s.record_pending_claim("web-1", &B, NOW + 1).unwrap();
    let r = s.client_record("web-1").unwrap().unwrap();
    assert_eq!(r.pending_claim, Some((B, NOW + 1)));
    assert_eq!(s.metrics().live_conflicts.get(), 1);

    // a grant for anything but the exact pending instance is refused
    let wrong = request_id();
    assert_eq!(
        code(
            s.authorize_takeover(&wrong, "web-1", &C, 300_000, NOW + 2)
                .unwrap_err()
        ),
        Code::FailedPrecondition
    );
    // ... and that refusal is the stable result of that request id
    assert_eq!(
        code(
            s.authorize_takeover(&wrong, "web-1", &C, 300_000, NOW + 3)
                .unwrap_err()
        ),
        Code::FailedPrecondition
    );
    let rid = request_id();
    let grant = s
        .authorize_takeover(&rid, "web-1", &B, 300_000, NOW + 2)
        .unwrap();
    assert_eq!(grant.instance_id, B);
    assert_eq!(grant.expires_ms, NOW + 2 + 300_000);
    // idempotent replay, and the same id with another request conflicts
    assert_eq!(
        s.authorize_takeover(&rid, "web-1", &B, 300_000, NOW + 9)
            .unwrap(),
        grant
    );
    assert_eq!(
        code(
            s.authorize_takeover(&rid, "web-2", &B, 300_000, NOW + 9)
                .unwrap_err()
        ),
        Code::Conflict
    );
    // granting fenced nothing
    assert_eq!(live_sessions(&s), 1);

    // B reconnects: one transaction consumes the grant and fences A
    assert_eq!(
        s.register_session(&reg(B, 1, 2, Some([1; 16]), Some(grant.id)), NOW + 10)
            .unwrap(),
        2
    );
    let r = s.client_record("web-1").unwrap().unwrap();
    assert_eq!(r.instance_id, Some(B));
    assert_eq!(r.pending_claim, None, "the claim was this instance's");
    assert_eq!(r.grant, None, "consumed");
    // the grant is one-shot
    assert_eq!(
        code(
            s.register_session(&reg(B, 2, 3, Some([2; 16]), Some(grant.id)), NOW + 11)
                .unwrap_err()
        ),
        Code::Conflict
    );
}

#[test]
fn an_expired_grant_admits_nobody() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    s.record_pending_claim("web-1", &B, NOW).unwrap();
    let grant = s
        .authorize_takeover(&request_id(), "web-1", &B, 1_000, NOW)
        .unwrap();
    assert_eq!(
        code(
            s.register_session(&reg(B, 1, 2, Some([1; 16]), Some(grant.id)), NOW + 1_000)
                .unwrap_err()
        ),
        Code::Conflict,
        "a grant at its expiry instant is expired"
    );
    // a grant naming B never admits C
    assert_eq!(
        code(
            s.register_session(&reg(C, 1, 2, Some([1; 16]), Some(grant.id)), NOW + 1)
                .unwrap_err()
        ),
        Code::Conflict
    );
    assert_eq!(s.client_record("web-1").unwrap().unwrap().generation, 1);
}

#[test]
fn a_new_grant_voids_the_earlier_one_and_closing_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    s.record_pending_claim("web-1", &B, NOW).unwrap();
    let first = s
        .authorize_takeover(&request_id(), "web-1", &B, 300_000, NOW)
        .unwrap();
    let second = s
        .authorize_takeover(&request_id(), "web-1", &B, 300_000, NOW + 1)
        .unwrap();
    assert_ne!(first.id, second.id);
    assert_eq!(
        s.client_record("web-1").unwrap().unwrap().grant,
        Some(second)
    );

    assert!(
        s.close_session(&[1; 16], false, "client went away", NOW + 2)
            .unwrap()
    );
    assert!(!s.close_session(&[1; 16], false, "again", NOW + 3).unwrap());
    assert_eq!(live_sessions(&s), 0);
    // with nothing live, a different instance registers without a grant
    assert_eq!(
        s.register_session(&reg(C, 1, 2, None, None), NOW + 4)
            .unwrap(),
        2
    );
    assert_eq!(
        s.client_record("web-1").unwrap().unwrap().grant,
        Some(second),
        "a registration with no live session neither creates nor consumes a grant"
    );
}

#[test]
fn an_operator_grant_and_an_operator_refusal_are_audited_with_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg(A, 0, 1, None, None), NOW).unwrap();
    s.record_pending_claim("web-1", &B, NOW + 1).unwrap();
    let caller = rvbox_store::operator::Caller {
        transport: "grpc-unix".into(),
        principal: "uid:0".into(),
    };
    let refused = s.authorize_takeover_as(&request_id(), "web-1", &C, 300_000, &caller, NOW + 2);
    assert_eq!(code(refused.unwrap_err()), Code::FailedPrecondition);
    s.authorize_takeover_as(&request_id(), "web-1", &B, 300_000, &caller, NOW + 3)
        .unwrap();
    s.flush_audit(NOW + 4).unwrap();
    let records: Vec<_> = s
        .read_audit(0, 100)
        .unwrap()
        .into_iter()
        .map(|(_, r)| r)
        .filter(|r| r.action == "AuthorizeClientTakeover")
        .collect();
    assert_eq!(records.len(), 2, "{records:?}");
    for r in &records {
        assert_eq!(r.principal, "uid:0");
        assert_eq!(r.transport, "grpc-unix");
        assert_eq!(r.client_id.as_deref(), Some("web-1"));
    }
    assert_eq!(
        records[0].error_code,
        Some(Code::FailedPrecondition.to_wire() as i32),
        "{records:?}"
    );
    assert_eq!(records[1].error_code, None, "{records:?}");
}
