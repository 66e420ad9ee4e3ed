#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Every write of the PostgreSQL store, its connection killed right before
//! its commit (as a killed replica process, a failover or an operator's
//! `pg_terminate_backend` would): it answers `UNAVAILABLE`, nothing of it
//! is in the database (every table compared), and the same operation sent
//! again commits. Killed right after its commit, it stays committed and
//! the store connects again for the next operation.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use rvbox_conformance::support::{
    NOW, any_uuid_text, dispatch, lifecycle_event, live_session, new_id, output_event, run,
    run_request, running, text,
};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store_pg::{PgStore, StoreOptions, points};
use rvbox_store_port::audit::{Caller, SessionAudit};
use rvbox_store_port::commands::{ReconcileWrite, ServerTerminal};
use rvbox_store_port::incidents::NewIncident;
use rvbox_store_port::ops::{Backend, OpResult, PortError, StoreOp};
use rvbox_testkit::Postgres;

/// Kills the store's connection from another one at the armed point.
#[derive(Debug)]
struct Killer {
    point: Mutex<Option<&'static str>>,
    pid: AtomicI32,
    conninfo: String,
}

impl rvbox_store::crash::CrashHook for Killer {
    fn at(&self, point: &'static str) {
        let mut armed = self.point.lock().unwrap();
        if *armed == Some(point) {
            *armed = None;
            let mut other = postgres::Client::connect(&self.conninfo, postgres::NoTls).unwrap();
            let killed: bool = other
                .query_one(
                    "SELECT pg_terminate_backend($1)",
                    &[&self.pid.load(Ordering::SeqCst)],
                )
                .unwrap()
                .get(0);
            assert!(killed);
        }
    }
}

impl Killer {
    fn arm(&self, s: &mut PgStore, point: &'static str) {
        self.pid.store(s.backend_pid().unwrap(), Ordering::SeqCst);
        *self.point.lock().unwrap() = Some(point);
    }
}

/// Every row of every table, as text, in a stable order; but the audit
/// log, where a failed operation is recorded as failed, on its own.
fn digest(conninfo: &str, with_audit: bool) -> String {
    let mut c = postgres::Client::connect(conninfo, postgres::NoTls).unwrap();
    let tables: Vec<String> = c
        .query(
            "SELECT table_name FROM information_schema.tables
             WHERE table_schema = 'public' AND table_type = 'BASE TABLE'
               AND ($1 OR table_name <> 'audit_log')
             ORDER BY table_name",
            &[&with_audit],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = String::new();
    for t in tables {
        let rows: String = c
            .query_one(
                &format!(
                    "SELECT coalesce(string_agg(x::text, '|' ORDER BY x::text), '') FROM \"{t}\" x"
                ),
                &[],
            )
            .unwrap()
            .get(0);
        out.push_str(&t);
        out.push('=');
        out.push_str(&rows);
        out.push('\n');
    }
    out
}

type Setup = fn(&mut PgStore) -> StoreOp;

fn caller() -> Caller {
    Caller::local()
}

fn cases() -> Vec<(&'static str, Setup)> {
    vec![
        ("register", |_| {
            StoreOp::Register(rvbox_conformance::support::registration(
                "web-1", [9; 16], None,
            ))
        }),
        ("record pending claim", |s| {
            live_session(s, "web-1");
            StoreOp::RecordPendingClaim {
                client_id: "web-1".into(),
                instance_id: [7; 16],
            }
        }),
        ("close session", |s| {
            let f = live_session(s, "web-1");
            StoreOp::CloseSession {
                session_id: f.session_id,
                reason: "gone".into(),
            }
        }),
        ("session audit", |_| {
            StoreOp::Audit(vec![SessionAudit::session(
                Some("web-1".into()),
                "HelloRejected",
                "test".into(),
            )])
        }),
        ("run command", |_| StoreOp::RunCommand {
            request: run_request(&new_id(), "web-1", "uptime"),
            caller: caller(),
        }),
        ("dispatch", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            StoreOp::Dispatch {
                issue,
                revision: 1,
                write: true,
                session,
            }
        }),
        ("record accepted", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::RecordAccepted {
                issue,
                revision: 1,
                resolved_shell: 1,
                session,
            }
        }),
        ("accept late", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::AcceptLate {
                issue,
                revision: 1,
                resolved_shell: 1,
                incident: NewIncident {
                    kind: wire::IncidentKind::LateAfterExpiry,
                    scope_kind: wire::ScopeKind::Command,
                    scope_key: text(&issue),
                    client_id: Some("web-1".into()),
                    issue_uuid: Some(issue),
                    summary: "late".into(),
                    evidence: Vec::new(),
                    data_loss: false,
                },
                session,
            }
        }),
        ("requeue", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::Requeue {
                issue,
                revision: 1,
                session,
            }
        }),
        ("reject", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::FinishByServer {
                issue,
                from: vec![Lifecycle::Dispatched],
                revision: 1,
                how: ServerTerminal::Rejected,
                rejection: None,
                session: Some(session),
            }
        }),
        ("mark expired pending", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::MarkExpiredPending { issue, revision: 1 }
        }),
        ("apply reconciliation", |s| {
            let issue = run(s, "web-1");
            let session = live_session(s, "web-1");
            dispatch(s, &issue, session);
            StoreOp::ApplyReconciliation {
                client_id: "web-1".into(),
                session,
                writes: vec![ReconcileWrite::Interrupt { issue, revision: 1 }],
                incidents: Vec::new(),
            }
        }),
        ("record incident", |_| {
            StoreOp::RecordIncident(NewIncident {
                kind: wire::IncidentKind::StaleServer,
                scope_kind: wire::ScopeKind::Client,
                scope_key: "web-1".into(),
                client_id: Some("web-1".into()),
                issue_uuid: None,
                summary: "stale".into(),
                evidence: Vec::new(),
                data_loss: false,
            })
        }),
        ("append events", |s| {
            let (issue, session) = running(s, "web-1");
            let mut out = output_event(&issue, 2, b"hello\n");
            out.session = Some(session);
            let mut end = lifecycle_event(&issue, 3, Lifecycle::Succeeded);
            end.session = Some(session);
            StoreOp::AppendEvents {
                events: vec![out, end],
            }
        }),
        ("signal command", |s| {
            let issue = run(s, "web-1");
            StoreOp::SignalCommand {
                request: wire::SignalCommandRequest {
                    request_id: text(&new_id()),
                    issue_uuid: text(&issue),
                    signal: wire::SignalKind::Term as i32,
                },
                caller: caller(),
            }
        }),
        ("append stdin", |s| {
            let (issue, _) = running(s, "web-1");
            StoreOp::AppendStdin {
                request: wire::AppendStdinRequest {
                    request_id: text(&new_id()),
                    issue_uuid: text(&issue),
                    data: b"input".to_vec(),
                    newline: wire::StdinNewline::Append as i32,
                },
                caller: caller(),
            }
        }),
        ("close stdin", |s| {
            let (issue, _) = running(s, "web-1");
            StoreOp::CloseStdin {
                request: wire::CloseStdinRequest {
                    request_id: text(&new_id()),
                    issue_uuid: text(&issue),
                },
                caller: caller(),
            }
        }),
        ("authorize takeover", |s| {
            live_session(s, "web-1");
            let mut claimant = new_id();
            claimant[6] = 0x40 | (claimant[6] & 0x0f);
            s.perform(
                NOW,
                StoreOp::RecordPendingClaim {
                    client_id: "web-1".into(),
                    instance_id: claimant,
                },
            )
            .unwrap();
            StoreOp::AuthorizeTakeover {
                request: wire::AuthorizeClientTakeoverRequest {
                    request_id: text(&new_id()),
                    client_id: "web-1".into(),
                    client_instance_id: any_uuid_text(&claimant),
                },
                caller: caller(),
                ttl_ms: 60_000,
            }
        }),
        ("run fleet", |s| {
            live_session(s, "web-1");
            live_session(s, "web-2");
            StoreOp::RunFleet {
                request: fleet_request("web-*", None),
                caller: caller(),
            }
        }),
        ("pause fleet run", |s| {
            live_session(s, "web-1");
            let req = fleet_request("web-*", None);
            let run = req.request_id.clone();
            assert!(
                s.perform(
                    NOW,
                    StoreOp::RunFleet {
                        request: req,
                        caller: caller(),
                    },
                )
                .is_ok()
            );
            StoreOp::FleetAction {
                action: rvbox_store_port::fleet::FleetAction::Pause(wire::PauseFleetRunRequest {
                    request_id: text(&new_id()),
                    fleet_run_id: run,
                }),
                caller: caller(),
            }
        }),
        ("fleet release pass", |s| {
            // a late client joins a waiting run: the pass releases it
            let req = fleet_request(
                "late-*",
                Some(prost_types::Duration {
                    seconds: 3600,
                    nanos: 0,
                }),
            );
            assert!(
                s.perform(
                    NOW,
                    StoreOp::RunFleet {
                        request: req,
                        caller: caller(),
                    },
                )
                .is_ok()
            );
            live_session(s, "late-1");
            StoreOp::FleetPump { limit: 100 }
        }),
    ]
}

fn fleet_request(glob: &str, late: Option<prost_types::Duration>) -> wire::RunFleetRequest {
    wire::RunFleetRequest {
        request_id: text(&new_id()),
        selection: Some(wire::FleetSelection {
            client_glob: glob.into(),
            ..Default::default()
        }),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("uptime".into())),
            ..Default::default()
        }),
        include_late: late,
        ..Default::default()
    }
}

fn committed(r: &OpResult) -> bool {
    match r {
        Ok(rvbox_store_port::ops::Completion::Appended(a)) => a
            .outcomes
            .iter()
            .all(|o| *o == rvbox_store_port::events::EventOutcome::Appended),
        Ok(_) => true,
        Err(_) => false,
    }
}

#[test]
fn every_write_killed_before_its_commit_leaves_nothing_and_goes_through_when_sent_again() {
    let pg = Postgres::start();
    for (n, (name, setup)) in cases().into_iter().enumerate() {
        let db = format!("crash_{n}");
        pg.psql("postgres", &format!("CREATE DATABASE {db}"));
        let conninfo = pg.conninfo(&db);
        let mut s = PgStore::connect(&conninfo, StoreOptions::default()).unwrap();
        let killer = Arc::new(Killer {
            point: Mutex::new(None),
            pid: AtomicI32::new(0),
            conninfo: conninfo.clone(),
        });
        s.set_crash_hook(killer.clone());
        let op = setup(&mut s);
        let before = digest(&conninfo, false);
        let before_all = digest(&conninfo, true);

        killer.arm(&mut s, points::BEFORE_COMMIT);
        let r = s.perform(NOW, op.clone());
        assert!(
            matches!(r, Err(PortError::Unavailable(_))),
            "{name}, killed before its commit: {r:?}"
        );
        assert_eq!(
            digest(&conninfo, false),
            before,
            "{name}: a write killed before its commit left something"
        );

        // sent again (the core retries a failed operation), killed right
        // after its commit this time: it is committed all the same
        killer.arm(&mut s, points::AFTER_COMMIT);
        let r = s.perform(NOW + 1, op);
        assert!(committed(&r), "{name}, sent again: {r:?}");
        assert_ne!(
            digest(&conninfo, true),
            before_all,
            "{name}: committed nothing"
        );
        // and the next operation connects again
        let again = s.perform(
            NOW + 2,
            StoreOp::LoadClient {
                client_id: "web-1".into(),
            },
        );
        assert!(again.is_ok(), "{name}: {again:?}");
    }
}
