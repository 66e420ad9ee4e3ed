#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The client registry (migration 4): `clients` and `sessions` rows come
//! from unauthenticated hellos, so they are counted in their own
//! transactions, charged to the server-wide tier, bounded and pruned.

mod support;

use std::sync::Arc;

use rvbox_domain::error::Code;
use rvbox_store::fs::RealFs;
use rvbox_store::mutations::OpError;
use rvbox_store::registry::{
    CLIENT_ROW_CHARGE, CLOSED_SESSIONS_KEPT, MAX_CLIENTS, SESSION_ROW_CHARGE,
};
use rvbox_store::sessions::Registration;
use rvbox_store::{Store, StoreOptions};
use support::*;

fn reg(client: &str, expected: u64, session: u16, fence: Option<[u8; 16]>) -> Registration {
    let mut session_id = [0u8; 16];
    session_id[..2].copy_from_slice(&session.to_le_bytes());
    session_id[15] = 1;
    registration(client, [0xa; 16], expected, session_id, fence)
}

fn sid(session: u16) -> [u8; 16] {
    reg("x", 0, session, None).session_id
}

fn rows(s: &Store, table: &str, client: &str) -> i64 {
    s.db()
        .query_row(
            &format!("SELECT COUNT(*) FROM {table} WHERE client_id = ?1"),
            [client],
            |r| r.get(0),
        )
        .unwrap()
}

fn consistent(s: &Store) {
    let c = s.registry_counts().unwrap();
    assert_eq!(
        c.counters, c.recount,
        "registry counters differ from a recount"
    );
    assert!(s.check_counters().unwrap().consistent());
}

fn code(e: OpError) -> Code {
    e.to_domain().code()
}

#[test]
fn each_registration_keeps_only_the_newest_closed_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg("web-1", 0, 1, None), NOW).unwrap();
    for n in 2..=30u16 {
        // a reconnect after a close, or a replacement fencing the live one
        if n % 2 == 0 {
            s.close_session(&sid(n - 1), false, "connection closed", NOW + i64::from(n))
                .unwrap();
            s.register_session(&reg("web-1", u64::from(n) - 1, n, None), NOW + i64::from(n))
                .unwrap();
        } else {
            s.register_session(
                &reg("web-1", u64::from(n) - 1, n, Some(sid(n - 1))),
                NOW + i64::from(n),
            )
            .unwrap();
        }
        assert!(rows(&s, "sessions", "web-1") <= (CLOSED_SESSIONS_KEPT + 1) as i64);
    }
    assert_eq!(
        rows(&s, "sessions", "web-1"),
        (CLOSED_SESSIONS_KEPT + 1) as i64
    );
    // the kept ones are the newest
    let oldest: i64 = s
        .db()
        .query_row(
            "SELECT MIN(opened_ms) FROM sessions WHERE client_id = 'web-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(oldest, NOW + 30 - CLOSED_SESSIONS_KEPT as i64);
    assert_eq!(
        s.metrics().sessions_pruned.get(),
        30 - 1 - CLOSED_SESSIONS_KEPT
    );
    consistent(&s);
}

#[test]
fn maintenance_prunes_idle_clients_and_keeps_every_client_with_work_or_a_session() {
    let dir = tempfile::tempdir().unwrap();
    let day: i64 = 24 * 3600 * 1000;
    let opts = StoreOptions {
        terminal_retention_ms: 30 * day as u64,
        ..StoreOptions::default()
    };
    let mut s = open_with(dir.path(), Arc::new(RealFs), opts);
    // idle: registered once, closed long ago
    s.register_session(&reg("idle", 0, 1, None), NOW).unwrap();
    s.close_session(&sid(1), false, "connection closed", NOW)
        .unwrap();
    // live: still connected
    s.register_session(&reg("live", 0, 2, None), NOW).unwrap();
    // busy: a queued command keeps it
    s.run_command(&run_request(&new_id(), "busy", "uptime"), NOW)
        .unwrap();
    // recent: closed a day ago
    s.register_session(&reg("recent", 0, 3, None), NOW + 30 * day)
        .unwrap();
    s.close_session(&sid(3), false, "connection closed", NOW + 30 * day)
        .unwrap();
    let report = s.maintain(NOW + 31 * day).unwrap();
    assert_eq!(report.clients_pruned, 1);
    for (client, kept) in [
        ("idle", false),
        ("live", true),
        ("busy", true),
        ("recent", true),
    ] {
        assert_eq!(s.client_record(client).unwrap().is_some(), kept, "{client}");
    }
    assert_eq!(rows(&s, "sessions", "idle"), 0, "its sessions go with it");
    assert_eq!(s.metrics().clients_pruned.get(), 1);
    consistent(&s);
    // an idle client that comes back is a new registration, above the
    // generation it had (1)
    assert_eq!(
        s.register_session(&reg("idle", 0, 4, None), NOW + 31 * day)
            .unwrap(),
        2
    );
    consistent(&s);
}

#[test]
fn the_registry_is_charged_to_the_server_wide_tier() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = StoreOptions::default();
    // room for three clients with one session each, where each admission
    // must find room for the client and all the sessions it may keep
    let row = CLIENT_ROW_CHARGE + SESSION_ROW_CHARGE;
    let admission = CLIENT_ROW_CHARGE + SESSION_ROW_CHARGE * (CLOSED_SESSIONS_KEPT + 1);
    o.tiers.global_total = 2 * row + admission;
    o.eviction_slack_bytes = 0;
    let mut s = open_with(dir.path(), Arc::new(RealFs), o);
    for (n, client) in ["web-1", "web-2", "web-3"].iter().enumerate() {
        s.register_session(&reg(client, 0, n as u16 + 1, None), NOW)
            .unwrap();
    }
    match s.register_session(&reg("web-4", 0, 9, None), NOW) {
        Err(OpError::Refused(e)) => {
            assert_eq!(e.code(), Code::QuotaExceeded);
            assert!(e.reason().contains("server_total"), "{e}");
        }
        other => panic!("expected QUOTA_EXCEEDED, got {other:?}"),
    }
    assert!(
        s.client_record("web-4").unwrap().is_none(),
        "nothing written"
    );
    // a known client still registers; a command for a new one is refused
    s.close_session(&sid(1), false, "connection closed", NOW)
        .unwrap();
    s.register_session(&reg("web-1", 1, 10, None), NOW).unwrap();
    assert_eq!(
        code(
            s.run_command(&run_request(&new_id(), "web-5", "uptime"), NOW)
                .unwrap_err()
        ),
        Code::QuotaExceeded
    );
    consistent(&s);
}

#[test]
fn a_full_registry_refuses_new_clients_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.register_session(&reg("known", 0, 1, None), NOW).unwrap();
    s.db()
        .execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO clients (client_id, last_seen_ms) SELECT 'filler-' || i, ?2 FROM n",
            rusqlite::params![(MAX_CLIENTS - 1) as i64, NOW],
        )
        .unwrap();
    consistent(&s);
    match s.register_session(&reg("newcomer", 0, 2, None), NOW) {
        Err(OpError::Refused(e)) => {
            assert_eq!(e.code(), Code::QuotaExceeded);
            assert!(e.reason().contains("clients"), "{e}");
        }
        other => panic!("expected QUOTA_EXCEEDED, got {other:?}"),
    }
    // the known client is not new: it reconnects
    s.close_session(&sid(1), false, "connection closed", NOW)
        .unwrap();
    assert_eq!(
        s.register_session(&reg("known", 1, 3, None), NOW).unwrap(),
        2
    );
}

#[test]
fn a_pruned_client_that_returns_never_sees_its_generation_go_back() {
    let dir = tempfile::tempdir().unwrap();
    let day: i64 = 24 * 3600 * 1000;
    let opts = StoreOptions {
        terminal_retention_ms: day as u64,
        ..StoreOptions::default()
    };
    let mut s = open_with(dir.path(), Arc::new(RealFs), opts);
    s.register_session(&reg("web-1", 0, 1, None), NOW).unwrap();
    for n in 2..=4u16 {
        s.register_session(&reg("web-1", u64::from(n) - 1, n, Some(sid(n - 1))), NOW)
            .unwrap();
    }
    s.close_session(&sid(4), false, "connection closed", NOW)
        .unwrap();
    assert_eq!(s.maintain(NOW + 2 * day).unwrap().clients_pruned, 1);
    // it comes back as a new client, above the generation it last saw
    assert_eq!(
        s.register_session(&reg("web-1", 0, 5, None), NOW + 2 * day)
            .unwrap(),
        5
    );
    // and a client first named by a command starts at the floor too
    s.run_command(&run_request(&new_id(), "web-9", "uptime"), NOW + 2 * day)
        .unwrap();
    let g = s.client_record("web-9").unwrap().unwrap().generation;
    assert_eq!(
        s.register_session(&reg("web-9", g, 6, None), NOW + 2 * day)
            .unwrap(),
        5
    );
    consistent(&s);
}
