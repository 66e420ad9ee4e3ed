#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Fleet runs in the store: resolution, deterministic target commands,
//! idempotent submission, max_parallel and max_errors, cancel, pause and
//! resume, late targets, counters that follow the commands (triggers)
//! and equal a recount.

mod support;

use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::fleet::target_state;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::Store;
use rvbox_store::mutations::OpError;
use rvbox_store_port::commands::CommandView;
use rvbox_store_port::fleet::{FleetAction, FleetAnswer, FleetOutcome};
use rvbox_store_port::signals::SignalPlan;
use support::*;

fn caller() -> rvbox_store::operator::Caller {
    rvbox_store::operator::Caller::local()
}

fn register(s: &mut Store, client: &str, n: u8, labels: &str) {
    let mut reg = registration(client, [n; 16], 0, [n; 16], None);
    reg.labels = labels.into();
    s.register_session(&reg, NOW).unwrap();
}

/// Five web clients and two db clients.
fn fleet_store(dir: &std::path::Path) -> Store {
    let mut s = open(dir);
    for i in 1..=5u8 {
        register(&mut s, &format!("web-{i}"), i, "role=web,zone=eu-west");
    }
    register(&mut s, "db-1", 10, "role=db,zone=eu-west");
    register(&mut s, "db-2", 11, "role=db,zone=us-east");
    s
}

fn request(id: &[u8; 16], selector: &str, command: &str) -> wire::RunFleetRequest {
    wire::RunFleetRequest {
        request_id: text(id),
        selection: Some(wire::FleetSelection {
            selector: selector.into(),
            ..Default::default()
        }),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(command.into())),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn count(n: u32) -> Option<wire::FleetLimit> {
    Some(wire::FleetLimit {
        limit: Some(wire::fleet_limit::Limit::Count(n)),
    })
}

fn run(s: &Store, id: &[u8; 16]) -> wire::FleetRunRecord {
    s.reader()
        .unwrap()
        .get_fleet_run(&wire::GetFleetRunRequest {
            fleet_run_id: text(id),
            ..Default::default()
        })
        .unwrap()
        .run
        .unwrap()
}

fn targets(s: &Store, id: &[u8; 16]) -> Vec<wire::FleetTarget> {
    s.reader()
        .unwrap()
        .list_fleet_targets(&wire::ListFleetTargetsRequest {
            fleet_run_id: text(id),
            ..Default::default()
        })
        .unwrap()
        .targets
}

fn issue_of(t: &wire::FleetTarget) -> [u8; 16] {
    *Uuid7::parse("x", &t.issue_uuid).unwrap().as_bytes()
}

fn plan(v: &CommandView, _signal: i32) -> Result<SignalPlan, DomainError> {
    Ok(if v.lifecycle == Lifecycle::Queued {
        SignalPlan::CancelQueued
    } else {
        SignalPlan::Deliver
    })
}

/// Runs a target's command to its end through the path a client takes:
/// dispatched, accepted, then the terminal event.
fn finish(s: &mut Store, issue: &[u8; 16], to: Lifecycle) {
    s.record_transition(issue, Lifecycle::Dispatched).unwrap();
    s.record_transition(issue, Lifecycle::Accepted).unwrap();
    s.append_events(&[lifecycle(issue, 1, Lifecycle::Running)], NOW)
        .unwrap();
    s.append_events(&[lifecycle(issue, 2, to)], NOW).unwrap();
}

fn counts(r: &wire::FleetRunRecord) -> wire::FleetCounts {
    r.counts.unwrap()
}

#[test]
fn a_fleet_run_creates_one_command_per_matching_client_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let req = request(&id, "role=web", "uptime");
    let out = s.run_fleet_as(&req, &caller(), NOW).unwrap();
    let FleetAnswer::Run(resp) = &out.answer else {
        panic!("{out:?}")
    };
    assert_eq!(resp.targets, 5);
    assert_eq!(out.released, ["web-1", "web-2", "web-3", "web-4", "web-5"]);
    assert!(out.live && !out.replayed);
    let ts = targets(&s, &id);
    assert_eq!(ts.len(), 5);
    let run_id = Uuid7::from_bytes("x", id).unwrap();
    for t in &ts {
        assert_eq!(t.state, wire::FleetTargetState::Queued as i32);
        let want = rvbox_domain::fleet::target_issue(&run_id, &t.client_id);
        assert_eq!(t.issue_uuid, want.to_string());
        let view = s.command_view(&issue_of(t)).unwrap();
        assert_eq!(view.client_id, t.client_id);
        assert_eq!(view.lifecycle, Lifecycle::Queued);
    }
    let commands = |s: &Store| -> i64 {
        s.db()
            .query_row("SELECT COUNT(*) FROM commands", [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(commands(&s), 5);

    // a retry is answered from the stored result and creates nothing
    let again = s.run_fleet_as(&req, &caller(), NOW + 5).unwrap();
    assert!(again.replayed && again.released.is_empty());
    assert_eq!(again.answer, out.answer);
    assert_eq!(commands(&s), 5);
    // the same request_id with another spec is a conflict
    let other = request(&id, "role=web", "reboot");
    match s.run_fleet_as(&other, &caller(), NOW + 6) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::Conflict),
        other => panic!("{other:?}"),
    }
    assert_counters(&s);
    let r = run(&s, &id);
    assert_eq!(r.targets, 5);
    assert_eq!(counts(&r).queued, 5);
    assert_eq!(r.state, wire::FleetRunState::Running as i32);
}

#[test]
fn bad_requests_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let cases: Vec<(wire::RunFleetRequest, &str, Code)> = vec![
        (
            request(&new_id(), "role=a b", "x"),
            "selection.selector",
            Code::InvalidArgument,
        ),
        (
            {
                let mut r = request(&new_id(), "", "x");
                r.selection = Some(wire::FleetSelection::default());
                r
            },
            "selection",
            Code::InvalidArgument,
        ),
        (
            {
                let mut r = request(&new_id(), "role=web", "x");
                r.selection.as_mut().unwrap().all = true;
                r
            },
            "selection.all",
            Code::InvalidArgument,
        ),
        (
            {
                let mut r = request(&new_id(), "role=web", "x");
                r.max_parallel = Some(wire::FleetLimit {
                    limit: Some(wire::fleet_limit::Limit::Percent(101)),
                });
                r
            },
            "max_parallel",
            Code::InvalidArgument,
        ),
        (
            request(&new_id(), "role=cache", "x"),
            "selection",
            Code::FailedPrecondition,
        ),
    ];
    for (req, field, code) in cases {
        match s.run_fleet_as(&req, &caller(), NOW) {
            Err(OpError::Refused(e)) => {
                assert_eq!(e.code(), code, "{field}: {e}");
                assert_eq!(e.field(), field, "{e}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
}

#[test]
fn max_parallel_releases_as_targets_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let mut req = request(&id, "role=web", "deploy");
    req.max_parallel = count(2);
    let out = s.run_fleet_as(&req, &caller(), NOW).unwrap();
    assert_eq!(out.released, ["web-1", "web-2"]);
    let r = run(&s, &id);
    assert_eq!((counts(&r).queued, counts(&r).pending), (2, 3));
    // nothing ended: a pass releases nothing
    let pass = s.fleet_pump(100, NOW + 1).unwrap();
    assert!(pass.released.is_empty() && pass.live);
    // one ends: the next pass releases one
    let first = issue_of(&targets(&s, &id)[0]);
    finish(&mut s, &first, Lifecycle::Succeeded);
    let r = run(&s, &id);
    assert_eq!((counts(&r).succeeded, counts(&r).queued), (1, 1));
    let pass = s.fleet_pump(100, NOW + 2).unwrap();
    assert_eq!(pass.released, ["web-3"]);
    // the pass budget bounds a release, and says there is more
    for t in targets(&s, &id) {
        if t.state == wire::FleetTargetState::Queued as i32 {
            finish(&mut s, &issue_of(&t), Lifecycle::Succeeded);
        }
    }
    let pass = s.fleet_pump(1, NOW + 3).unwrap();
    assert_eq!(pass.released, ["web-4"]);
    assert!(pass.more, "room for two, budget for one");
    assert_counters(&s);
    // run every target to its end: the run is done at the pass after
    for t in targets(&s, &id) {
        if t.state == wire::FleetTargetState::Queued as i32 {
            finish(&mut s, &issue_of(&t), Lifecycle::Succeeded);
        }
    }
    for n in 0..5 {
        let pass = s.fleet_pump(100, NOW + 10 + n).unwrap();
        for c in &pass.released {
            let t = targets(&s, &id)
                .into_iter()
                .find(|t| &t.client_id == c)
                .unwrap();
            finish(&mut s, &issue_of(&t), Lifecycle::Succeeded);
        }
    }
    let r = run(&s, &id);
    assert_eq!(r.state, wire::FleetRunState::Done as i32, "{r:?}");
    assert_eq!(counts(&r).succeeded, 5);
    assert!(r.done_time.is_some());
    assert_counters(&s);
}

#[test]
fn max_errors_stops_releasing_and_skips_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let mut req = request(&id, "role=web", "deploy");
    req.max_parallel = count(2);
    req.max_errors = count(1);
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    let ts = targets(&s, &id);
    finish(&mut s, &issue_of(&ts[0]), Lifecycle::Failed);
    let pass = s.fleet_pump(100, NOW + 1).unwrap();
    assert!(pass.released.is_empty(), "{pass:?}");
    let r = run(&s, &id);
    assert_eq!(r.state, wire::FleetRunState::Stopping as i32);
    assert_eq!(r.stop_reason, wire::FleetStopReason::MaxErrors as i32);
    let c = counts(&r);
    assert_eq!((c.failed, c.queued, c.skipped, c.pending), (1, 1, 3, 0));
    // the released one finishes; then the run is done
    finish(&mut s, &issue_of(&ts[1]), Lifecycle::Succeeded);
    s.fleet_pump(100, NOW + 2).unwrap();
    let r = run(&s, &id);
    assert_eq!(r.state, wire::FleetRunState::Done as i32);
    assert_counters(&s);
}

#[test]
fn cancel_pause_and_resume_are_idempotent_actions() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let mut req = request(&id, "role=web", "deploy");
    req.max_parallel = count(3);
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    let action = |kind: &str, request: &[u8; 16]| {
        let (request_id, fleet_run_id) = (text(request), text(&id));
        match kind {
            "pause" => FleetAction::Pause(wire::PauseFleetRunRequest {
                request_id,
                fleet_run_id,
            }),
            "resume" => FleetAction::Resume(wire::ResumeFleetRunRequest {
                request_id,
                fleet_run_id,
            }),
            _ => FleetAction::Cancel(wire::CancelFleetRunRequest {
                request_id,
                fleet_run_id,
            }),
        }
    };
    let act = |s: &mut Store, a: &FleetAction| -> FleetOutcome {
        s.fleet_action_as(a, &caller(), plan, NOW + 1).unwrap()
    };
    // pause: nothing is released even when room opens
    let ts = targets(&s, &id);
    finish(&mut s, &issue_of(&ts[0]), Lifecycle::Succeeded);
    act(&mut s, &action("pause", &new_id()));
    assert!(s.fleet_pump(100, NOW + 2).unwrap().released.is_empty());
    assert_eq!(run(&s, &id).state, wire::FleetRunState::Paused as i32);
    // resume releases at once
    let resumed = act(&mut s, &action("resume", &new_id()));
    assert_eq!(resumed.released, ["web-4"]);
    // one target runs, the rest are queued or pending
    let running = issue_of(&targets(&s, &id)[1]);
    s.record_transition(&running, Lifecycle::Dispatched)
        .unwrap();
    s.record_transition(&running, Lifecycle::Accepted).unwrap();
    let cancel_id = new_id();
    let out = act(&mut s, &action("cancel", &cancel_id));
    let FleetAnswer::Cancel(resp) = &out.answer else {
        panic!("{out:?}")
    };
    // web-3 and web-4 queued are cancelled, web-5 pending is cancelled,
    // web-2 (accepted) is sent TERM
    assert_eq!((resp.cancelled, resp.signalled), (3, 1), "{resp:?}");
    assert_eq!(out.deliver.len(), 1);
    assert_eq!(out.deliver[0].0, "web-2");
    assert_eq!(out.deliver[0].1.signal, wire::SignalKind::Term as i32);
    let r = resp.run.clone().unwrap();
    assert_eq!(r.state, wire::FleetRunState::Stopping as i32);
    assert_eq!(r.stop_reason, wire::FleetStopReason::Cancelled as i32);
    // the same cancel again: the stored answer, no second signal
    let again = act(&mut s, &action("cancel", &cancel_id));
    assert!(again.replayed && again.deliver.is_empty());
    assert_eq!(again.answer, out.answer);
    // a new cancel of a stopping run changes nothing
    let more = act(&mut s, &action("cancel", &new_id()));
    let FleetAnswer::Cancel(more) = more.answer else {
        panic!()
    };
    assert_eq!((more.cancelled, more.signalled), (0, 0));
    // the TERMed target ends: the run is done
    s.append_events(&[lifecycle(&running, 1, Lifecycle::Running)], NOW)
        .unwrap();
    s.append_events(&[lifecycle(&running, 2, Lifecycle::Terminated)], NOW)
        .unwrap();
    s.fleet_pump(100, NOW + 3).unwrap();
    let r = run(&s, &id);
    assert_eq!(r.state, wire::FleetRunState::Done as i32);
    let c = counts(&r);
    assert_eq!((c.succeeded, c.failed, c.cancelled), (1, 1, 3), "{c:?}");
    assert_counters(&s);
}

#[test]
fn late_clients_join_while_the_window_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let mut req = request(&id, "role=db", "x");
    req.include_late = Some(prost_types::Duration {
        seconds: 60,
        nanos: 0,
    });
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    assert_eq!(run(&s, &id).targets, 2);
    register(&mut s, "db-3", 20, "role=db");
    register(&mut s, "web-9", 21, "role=web");
    let ts = targets(&s, &id);
    assert_eq!(ts.len(), 3);
    assert!(ts.iter().any(|t| t.client_id == "db-3" && t.late));
    let pass = s.fleet_pump(100, NOW + 1).unwrap();
    assert_eq!(pass.released, ["db-3"]);
    // every target ends; the run stays open until the window closes
    for t in targets(&s, &id) {
        finish(&mut s, &issue_of(&t), Lifecycle::Succeeded);
    }
    s.fleet_pump(100, NOW + 2).unwrap();
    assert_eq!(run(&s, &id).state, wire::FleetRunState::Running as i32);
    s.fleet_pump(100, NOW + 61_000).unwrap();
    assert_eq!(run(&s, &id).state, wire::FleetRunState::Done as i32);
    // after the window, a new db client is not added
    let mut reg = registration("db-4", [30; 16], 0, [30; 16], None);
    reg.labels = "role=db".into();
    s.register_session(&reg, NOW + 62_000).unwrap();
    assert_eq!(run(&s, &id).targets, 3);
    assert_counters(&s);
}

#[test]
fn the_trigger_maps_every_lifecycle_as_the_domain_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let mut req = request(&id, "", "x");
    req.selection = Some(wire::FleetSelection {
        all: true,
        ..Default::default()
    });
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    let ts = targets(&s, &id);
    let issue = issue_of(&ts[0]);
    for l in Lifecycle::ALL {
        let terminal = l.is_terminal().then_some(NOW + 1);
        s.db()
            .execute(
                "UPDATE commands SET lifecycle = 1, terminal_time_ms = NULL WHERE issue_uuid = ?1",
                [issue.as_slice()],
            )
            .unwrap();
        s.db()
            .execute(
                "UPDATE commands SET lifecycle = ?2, terminal_time_ms = ?3 WHERE issue_uuid = ?1",
                rusqlite::params![issue.as_slice(), l.to_wire() as i32, terminal],
            )
            .unwrap();
        let t = targets(&s, &id)
            .into_iter()
            .find(|t| t.client_id == ts[0].client_id)
            .unwrap();
        assert_eq!(t.state, target_state(l) as i32, "{l:?}");
        assert_eq!(t.lifecycle, l.to_wire() as i32);
    }
    assert_counters(&s);
}

#[test]
fn a_counter_that_drifts_is_caught_by_the_recount() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    s.run_fleet_as(&request(&id, "role=web", "x"), &caller(), NOW)
        .unwrap();
    assert_counters(&s);
    s.db()
        .execute(
            "UPDATE fleet_runs SET n_queued = n_queued - 1, n_failed = n_failed + 1",
            [],
        )
        .unwrap();
    let c = s.check_counters().unwrap();
    assert!(!c.consistent());
    assert_eq!(c.operations.fleet_runs.len(), 1);
}

#[test]
fn follow_reads_targets_after_a_cursor_in_change_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    s.run_fleet_as(&request(&id, "role=db", "x"), &caller(), NOW)
        .unwrap();
    let r = s.reader().unwrap();
    let (rec, all) = r.fleet_changes(&text(&id), 0, 100).unwrap();
    assert_eq!(all.len(), 2);
    let cursor = rec.change_seq;
    assert!(all.iter().all(|t| t.change_seq <= cursor));
    drop(r);
    let db1 = issue_of(&all[0]);
    finish(&mut s, &db1, Lifecycle::Succeeded);
    let r = s.reader().unwrap();
    let (rec2, changed) = r.fleet_changes(&text(&id), cursor, 100).unwrap();
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].state, wire::FleetTargetState::Succeeded as i32);
    assert_eq!(changed[0].exit_result.as_ref().unwrap().exit_code, Some(0));
    assert!(rec2.change_seq > cursor);
}

#[test]
fn retention_deletes_a_done_run_once_its_commands_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    let req = request(&id, "role=db", "x");
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    for t in targets(&s, &id) {
        finish(&mut s, &issue_of(&t), Lifecycle::Succeeded);
    }
    s.fleet_pump(10, NOW + 1).unwrap();
    assert_eq!(run(&s, &id).state, wire::FleetRunState::Done as i32);
    // the commands are kept: the run stays
    s.maintain(NOW + 2).unwrap();
    assert!(
        s.reader()
            .unwrap()
            .get_fleet_run(&wire::GetFleetRunRequest {
                fleet_run_id: text(&id),
                ..Default::default()
            })
            .is_ok()
    );
    // past the terminal retention its commands are reclaimed, and the run
    // goes with them
    let later = NOW + 400 * 24 * 3_600_000;
    s.maintain(later).unwrap();
    s.maintain(later + 1).unwrap();
    match s
        .reader()
        .unwrap()
        .get_fleet_run(&wire::GetFleetRunRequest {
            fleet_run_id: text(&id),
            ..Default::default()
        }) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::NotFound),
        other => panic!("{other:?}"),
    }
    // its id stays refused: a replay never makes the run again
    match s.run_fleet_as(&req, &caller(), later + 2) {
        Err(OpError::Refused(e)) => assert_eq!(e.code(), Code::AlreadyExecuted, "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn targets_list_by_their_clients_labels_page_by_page() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = fleet_store(dir.path());
    let id = new_id();
    // every client: five web in eu-west, db-1 in eu-west, db-2 in us-east
    let mut req = request(&id, "", "uptime");
    req.selection = Some(wire::FleetSelection {
        all: true,
        ..Default::default()
    });
    s.run_fleet_as(&req, &caller(), NOW).unwrap();
    assert_eq!(targets(&s, &id).len(), 7);
    let reader = s.reader().unwrap();
    let page = |selector: &str, size: u32, token: &str| {
        reader.list_fleet_targets(&wire::ListFleetTargetsRequest {
            fleet_run_id: text(&id),
            selector: selector.into(),
            page_size: size,
            page_token: token.into(),
            ..Default::default()
        })
    };
    let ids = |r: &wire::ListFleetTargetsResponse| -> Vec<String> {
        r.targets.iter().map(|t| t.client_id.clone()).collect()
    };
    let all = page("zone=eu-*,role=db", 0, "").unwrap();
    assert_eq!(ids(&all), vec!["db-1"]);
    assert!(all.next_page_token.is_empty());
    let all = page("!canary,role!=db", 0, "").unwrap();
    assert_eq!(ids(&all), vec!["web-1", "web-2", "web-3", "web-4", "web-5"]);
    // two at a time, each page continuing where the last one stopped
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let p = page("zone=eu-west", 2, &token).unwrap();
        assert!(p.targets.len() <= 2);
        seen.extend(ids(&p));
        if p.next_page_token.is_empty() {
            break;
        }
        token = p.next_page_token;
    }
    assert_eq!(
        seen,
        vec!["db-1", "web-1", "web-2", "web-3", "web-4", "web-5"]
    );
    // a token is bound to its selector
    let first = page("zone=eu-west", 2, "").unwrap();
    let e = page("zone=us-east", 2, &first.next_page_token).unwrap_err();
    assert!(
        matches!(e, OpError::Refused(ref d) if d.code() == rvbox_domain::error::Code::InvalidArgument),
        "{e:?}"
    );
    // a bad selector is refused, naming the field
    let e = page("role=a b", 0, "").unwrap_err();
    match e {
        OpError::Refused(d) => assert_eq!(d.field(), "selector", "{d:?}"),
        other => panic!("{other:?}"),
    }
}
