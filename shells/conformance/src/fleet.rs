//! Cases over fleet runs: the submission and its replay, the release rate,
//! the pump, the operator's actions, late targets, the reads, and
//! retention, observed through completions and the control reads only.

use rvbox_domain::error::Code;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store_port::events::EventOutcome;
use rvbox_store_port::fleet::{FleetAction, FleetAnswer, FleetOutcome};
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};

use crate::reads::WithReads;
use crate::support::*;

fn run_fleet_request(
    id: &[u8; 16],
    glob: &str,
    max_parallel: Option<u32>,
) -> wire::RunFleetRequest {
    wire::RunFleetRequest {
        request_id: text(id),
        selection: Some(wire::FleetSelection {
            client_glob: glob.into(),
            ..Default::default()
        }),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("uptime".into())),
            ..Default::default()
        }),
        max_parallel: max_parallel.map(|n| wire::FleetLimit {
            limit: Some(wire::fleet_limit::Limit::Count(n)),
        }),
        ..Default::default()
    }
}

fn fleet(r: OpResult) -> FleetOutcome {
    match r {
        Ok(Completion::Fleet(o)) => *o,
        other => panic!("fleet operation: {other:?}"),
    }
}

fn pump(b: &mut dyn WithReads, now: i64) -> FleetOutcome {
    fleet(b.perform(now, StoreOp::FleetPump { limit: 2_048 }))
}

fn action(b: &mut dyn WithReads, a: FleetAction) -> OpResult {
    b.perform(
        NOW,
        StoreOp::FleetAction {
            action: a,
            caller: rvbox_store_port::audit::Caller::local(),
        },
    )
}

fn target_id(run: &[u8; 16], client: &str) -> [u8; 16] {
    *rvbox_domain::fleet::target_issue(&Uuid7::from_bytes("run", *run).unwrap(), client).as_bytes()
}

fn get_run(b: &mut dyn WithReads, run: &[u8; 16]) -> wire::FleetRunRecord {
    b.reads()
        .get_fleet_run(&wire::GetFleetRunRequest {
            request_id: String::new(),
            fleet_run_id: text(run),
        })
        .unwrap()
        .run
        .unwrap()
}

fn targets(b: &mut dyn WithReads, run: &[u8; 16]) -> Vec<(String, i32)> {
    b.reads()
        .list_fleet_targets(&wire::ListFleetTargetsRequest {
            fleet_run_id: text(run),
            page_size: 100,
            ..Default::default()
        })
        .unwrap()
        .targets
        .into_iter()
        .map(|t| (t.client_id, t.state))
        .collect()
}

/// Moves a released target's command through running to `end` on the
/// client's live session.
fn finish(b: &mut dyn WithReads, issue: &[u8; 16], client: &str, end: Lifecycle) {
    let session = live_session(b, client);
    dispatch(b, issue, session);
    accept(b, issue, session);
    let mut events = vec![lifecycle_event(issue, 1, Lifecycle::Running)];
    if end != Lifecycle::Running {
        events.push(lifecycle_event(issue, 2, end));
    }
    for ev in &mut events {
        ev.session = Some(session);
    }
    let n = events.len();
    let r = b.perform(NOW, StoreOp::AppendEvents { events });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended; n]);
}

fn register_all(b: &mut dyn WithReads, clients: &[&str]) {
    for c in clients {
        live_session(b, c);
    }
}

const QUEUED: i32 = wire::FleetTargetState::Queued as i32;
const PENDING: i32 = wire::FleetTargetState::Pending as i32;
const RUNNING: i32 = wire::FleetTargetState::Running as i32;
const SUCCEEDED: i32 = wire::FleetTargetState::Succeeded as i32;
const CANCELLED: i32 = wire::FleetTargetState::Cancelled as i32;

/// A run releases no more targets at once than its `max_parallel`, the
/// pump releases the next as each ends, the run ends when every target
/// has, and its request id answers the same run again (another request
/// with it is `CONFLICT`). Retention deletes the done run once its
/// commands are gone, and its id is never run again.
pub fn a_fleet_run_releases_at_its_rate_and_ends_once_every_target_has(b: &mut dyn WithReads) {
    register_all(b, &["web-1", "web-2", "web-3", "db-1"]);
    let run = new_id();
    let req = run_fleet_request(&run, "web-*", Some(2));
    let submit = |b: &mut dyn WithReads, req: &wire::RunFleetRequest| {
        b.perform(
            NOW,
            StoreOp::RunFleet {
                request: req.clone(),
                caller: rvbox_store_port::audit::Caller::local(),
            },
        )
    };
    let first = fleet(submit(b, &req));
    let FleetAnswer::Run(answer) = &first.answer else {
        panic!("{first:?}")
    };
    assert_eq!(answer.targets, 3);
    assert_eq!(answer.fleet_run_id, text(&run));
    assert_eq!(first.released, vec!["web-1".to_owned(), "web-2".to_owned()]);
    assert!(first.live && !first.replayed);
    assert_eq!(
        targets(b, &run),
        vec![
            ("web-1".into(), QUEUED),
            ("web-2".into(), QUEUED),
            ("web-3".into(), PENDING)
        ]
    );
    // each released target is an ordinary queued command of its client
    let w1 = target_id(&run, "web-1");
    assert_eq!(view(b, &w1).client_id, "web-1");
    assert_eq!(view(b, &w1).lifecycle, Lifecycle::Queued);

    // the same request again: the same answer, nothing more released
    let again = fleet(submit(b, &req));
    assert!(again.replayed);
    assert_eq!(again.answer, first.answer);
    assert!(again.released.is_empty());
    let mut other = req.clone();
    other.selection = Some(wire::FleetSelection {
        client_glob: "db-*".into(),
        ..Default::default()
    });
    assert_eq!(refused(&submit(b, &other)), Some(Code::Conflict));

    // two in flight: the pump releases nothing
    let p = pump(b, NOW);
    assert!(p.released.is_empty() && p.live, "{p:?}");
    // one ends: the pump releases the third
    finish(b, &w1, "web-1", Lifecycle::Succeeded);
    let p = pump(b, NOW);
    assert_eq!(p.released, vec!["web-3".to_owned()]);
    let r = get_run(b, &run);
    let c = r.counts.unwrap();
    assert_eq!((c.succeeded, c.queued, c.pending), (1, 2, 0));
    assert_eq!(r.state, wire::FleetRunState::Running as i32);

    finish(b, &target_id(&run, "web-2"), "web-2", Lifecycle::Succeeded);
    finish(b, &target_id(&run, "web-3"), "web-3", Lifecycle::Succeeded);
    let p = pump(b, NOW);
    assert!(!p.live, "no run is live: {p:?}");
    let r = get_run(b, &run);
    assert_eq!(r.state, wire::FleetRunState::Done as i32);
    assert_eq!(r.counts.unwrap().succeeded, 3);
    assert!(r.done_time.is_some());
    assert_eq!(
        targets(b, &run),
        vec![
            ("web-1".into(), SUCCEEDED),
            ("web-2".into(), SUCCEEDED),
            ("web-3".into(), SUCCEEDED)
        ]
    );
    // FollowFleetRun: every target's latest change, in change order
    let (record, changed) = b.reads().fleet_changes(&text(&run), 0, 100).unwrap();
    assert_eq!(changed.len(), 3);
    assert!(
        changed
            .windows(2)
            .all(|w| w[0].change_seq < w[1].change_seq)
    );
    assert_eq!(record.change_seq, changed[2].change_seq);
    let (_, none) = b
        .reads()
        .fleet_changes(&text(&run), record.change_seq, 100)
        .unwrap();
    assert!(none.is_empty());
    let listed = b
        .reads()
        .list_fleet_runs(&wire::ListFleetRunsRequest {
            page_size: 10,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(listed.runs.len(), 1);
    assert_eq!(listed.runs[0].fleet_run_id, text(&run));

    // 31 days on, the commands are reclaimed and the run goes with them
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let later = NOW + 31 * DAY_MS;
    let m = match b.perform(later, StoreOp::Maintain) {
        Ok(Completion::Maintained(m)) => m,
        other => panic!("Maintain: {other:?}"),
    };
    assert_eq!(m.fleet_runs_pruned, 1, "{m:?}");
    let gone = b.reads().get_fleet_run(&wire::GetFleetRunRequest {
        request_id: String::new(),
        fleet_run_id: text(&run),
    });
    assert!(
        matches!(&gone, Err(rvbox_store::mutations::OpError::Refused(e)) if e.code() == Code::NotFound),
        "{gone:?}"
    );
    assert_eq!(
        refused(&b.perform(
            later,
            StoreOp::RunFleet {
                request: req,
                caller: rvbox_store_port::audit::Caller::local(),
            },
        )),
        Some(Code::AlreadyExecuted),
        "a reclaimed run's id is never run again"
    );
}

/// Pause stops releases and resume restarts them; a signal goes to the
/// running targets once per request; cancel ends the pending targets,
/// cancels the queued ones and signals the running ones, and the run ends
/// when they have.
pub fn fleet_actions_pause_resume_signal_and_cancel_once_each(b: &mut dyn WithReads) {
    register_all(b, &["app-1", "app-2", "app-3", "app-4"]);
    let run = new_id();
    let out = fleet(b.perform(
        NOW,
        StoreOp::RunFleet {
            request: run_fleet_request(&run, "app-*", Some(2)),
            caller: rvbox_store_port::audit::Caller::local(),
        },
    ));
    assert_eq!(out.released, vec!["app-1".to_owned(), "app-2".to_owned()]);
    let a1 = target_id(&run, "app-1");
    finish(b, &a1, "app-1", Lifecycle::Running);

    let pause = wire::PauseFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&run),
    };
    let p = fleet(action(b, FleetAction::Pause(pause)));
    let FleetAnswer::Pause(p) = p.answer else {
        panic!("{p:?}")
    };
    assert_eq!(p.run.unwrap().state, wire::FleetRunState::Paused as i32);
    // app-2 ends, yet a paused run releases nothing
    finish(b, &target_id(&run, "app-2"), "app-2", Lifecycle::Succeeded);
    assert!(pump(b, NOW).released.is_empty());
    let resume = FleetAction::Resume(wire::ResumeFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&run),
    });
    let r = fleet(action(b, resume));
    assert_eq!(r.released, vec!["app-3".to_owned()], "{r:?}");

    // a signal reaches the one running target, once per request
    let signal = FleetAction::Signal(wire::SignalFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&run),
        signal: wire::SignalKind::Int as i32,
    });
    let s = fleet(action(b, signal.clone()));
    assert_eq!(s.deliver.len(), 1, "{s:?}");
    assert_eq!(s.deliver[0].0, "app-1");
    assert_eq!(s.deliver[0].1.issue_uuid, text(&a1));
    assert_eq!(s.deliver[0].1.revision, view(b, &a1).revision);
    let again = fleet(action(b, signal));
    assert!(again.replayed && again.deliver.is_empty(), "{again:?}");
    let bad = FleetAction::Signal(wire::SignalFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&run),
        signal: 99,
    });
    assert_eq!(refused(&action(b, bad)), Some(Code::InvalidArgument));
    let unknown = FleetAction::Pause(wire::PauseFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&new_id()),
    });
    assert_eq!(refused(&action(b, unknown)), Some(Code::NotFound));

    // cancel: app-4 pending -> cancelled, app-3 queued -> cancelled,
    // app-1 running -> TERM
    let cancel = FleetAction::Cancel(wire::CancelFleetRunRequest {
        request_id: text(&new_id()),
        fleet_run_id: text(&run),
    });
    let c = fleet(action(b, cancel));
    let FleetAnswer::Cancel(ans) = &c.answer else {
        panic!("{c:?}")
    };
    assert_eq!((ans.cancelled, ans.signalled), (2, 1), "{ans:?}");
    assert_eq!(c.deliver.len(), 1);
    assert_eq!(c.deliver[0].1.signal, wire::SignalKind::Term as i32);
    assert_eq!(
        ans.run.as_ref().unwrap().state,
        wire::FleetRunState::Stopping as i32
    );
    assert_eq!(
        view(b, &target_id(&run, "app-3")).lifecycle,
        Lifecycle::Cancelled
    );
    assert_eq!(
        targets(b, &run),
        vec![
            ("app-1".into(), RUNNING),
            ("app-2".into(), SUCCEEDED),
            ("app-3".into(), CANCELLED),
            ("app-4".into(), CANCELLED)
        ]
    );
    assert!(pump(b, NOW).live, "a target still runs");
    // the running target ends: the run is done
    let session = live_session(b, "app-1");
    let mut ev = lifecycle_event(&a1, 2, Lifecycle::Terminated);
    ev.session = Some(session);
    let r = b.perform(NOW, StoreOp::AppendEvents { events: vec![ev] });
    assert_eq!(outcomes(&r), vec![EventOutcome::Appended]);
    assert!(!pump(b, NOW).live);
    assert_eq!(get_run(b, &run).state, wire::FleetRunState::Done as i32);
}

/// A run with an include_late window accepts a selection that matches no
/// client yet, takes a matching client that registers within the window,
/// and ends once the window closes and its targets ended; without a
/// window such a selection is refused.
pub fn a_client_registering_in_a_late_window_becomes_a_target(b: &mut dyn WithReads) {
    let run = new_id();
    let mut req = run_fleet_request(&run, "late-*", None);
    let submit = |b: &mut dyn WithReads, req: &wire::RunFleetRequest| {
        b.perform(
            NOW,
            StoreOp::RunFleet {
                request: req.clone(),
                caller: rvbox_store_port::audit::Caller::local(),
            },
        )
    };
    assert_eq!(
        refused(&submit(b, &req)),
        Some(Code::FailedPrecondition),
        "no client matches and no late window"
    );
    req.include_late = Some(prost_types::Duration {
        seconds: 3600,
        nanos: 0,
    });
    let out = fleet(submit(b, &req));
    let FleetAnswer::Run(a) = &out.answer else {
        panic!("{out:?}")
    };
    assert_eq!(a.targets, 0);
    assert!(out.live);
    // a client that does not match stays out; one that does joins
    live_session(b, "early-1");
    live_session(b, "late-1");
    let p = pump(b, NOW);
    assert_eq!(p.released, vec!["late-1".to_owned()]);
    let t = b
        .reads()
        .list_fleet_targets(&wire::ListFleetTargetsRequest {
            fleet_run_id: text(&run),
            page_size: 10,
            ..Default::default()
        })
        .unwrap()
        .targets;
    assert_eq!(t.len(), 1);
    assert!(t[0].late);
    finish(
        b,
        &target_id(&run, "late-1"),
        "late-1",
        Lifecycle::Succeeded,
    );
    // the window is still open: the run waits for more clients
    assert!(pump(b, NOW).live);
    // once it closed, the run is done
    assert!(!pump(b, NOW + 3_600_001).live);
    assert_eq!(get_run(b, &run).state, wire::FleetRunState::Done as i32);
}

fn open_incident(
    b: &mut dyn WithReads,
    kind: wire::ScopeKind,
    key: &str,
    client: Option<&str>,
) -> String {
    let r = b.perform(
        NOW,
        StoreOp::RecordIncident(rvbox_store_port::incidents::NewIncident {
            kind: wire::IncidentKind::ChecksumMismatch,
            scope_kind: kind,
            scope_key: key.into(),
            client_id: client.map(str::to_owned),
            issue_uuid: None,
            summary: "planted by the conformance suite".into(),
            evidence: Vec::new(),
            data_loss: true,
        }),
    );
    assert!(matches!(r, Ok(Completion::Done)), "{r:?}");
    b.reads()
        .incident_page(&wire::ListStorageIncidentsRequest {
            page_size: 1,
            state: Some(wire::IncidentState::Open as i32),
            ..Default::default()
        })
        .unwrap()
        .incidents[0]
        .incident_id
        .clone()
}

fn acknowledge(b: &mut dyn WithReads, incident_id: String) {
    let r = b.perform(
        NOW,
        StoreOp::AcknowledgeIncident {
            request: wire::AcknowledgeStorageIncidentRequest {
                request_id: text(&new_id()),
                incident_id,
                note: "seen; the loss is accepted".into(),
            },
            caller: rvbox_store_port::audit::Caller::local(),
        },
    );
    assert!(matches!(r, Ok(Completion::Incident(_))), "{r:?}");
}

/// An open storage incident refuses the writes of its scope, `UNAVAILABLE`
/// naming the incident, and only those (plan §5.1): a command's scope its
/// events, a client's scope its new commands, registrations and
/// lifecycle writes, the global scope every write; acknowledged, the
/// writes go again.
pub fn an_open_incident_refuses_the_writes_of_its_scope_until_acknowledged(b: &mut dyn WithReads) {
    let (issue, session) = running(b, "web-1");
    let run_for = |b: &mut dyn WithReads, client: &str| {
        let id = new_id();
        b.perform(
            NOW,
            StoreOp::RunCommand {
                request: run_request(&id, client, "uptime"),
                caller: rvbox_store_port::audit::Caller::local(),
            },
        )
    };
    let append = |b: &mut dyn WithReads, seq: u64| {
        let mut ev = output_event(&issue, seq, b"line\n");
        ev.session = Some(session);
        outcomes(&b.perform(NOW, StoreOp::AppendEvents { events: vec![ev] }))
    };

    // the command's scope: its events, nothing of its client's other work
    let cmd = open_incident(b, wire::ScopeKind::Command, &text(&issue), Some("web-1"));
    let refused = append(b, 2);
    assert!(
        matches!(&refused[..], [EventOutcome::Refused(e)]
            if e.code() == Code::Unavailable && e.to_detail().incident_id.as_deref() == Some(cmd.as_str())),
        "{refused:?}"
    );
    assert!(matches!(run_for(b, "web-1"), Ok(Completion::RunCommand(_))));
    // the command's record says so
    let record = b.reads().command_record(&issue).unwrap();
    assert_eq!(record.dirty_scopes.len(), 1, "{:?}", record.dirty_scopes);
    assert_eq!(record.dirty_scopes[0].scope_key, text(&issue));
    assert_eq!(record.dirty_scopes[0].incident_ids, vec![cmd.clone()]);
    acknowledge(b, cmd);
    assert!(
        b.reads()
            .command_record(&issue)
            .unwrap()
            .dirty_scopes
            .is_empty()
    );
    assert_eq!(append(b, 2), vec![EventOutcome::Appended]);

    // the client's scope: its new commands and registration
    let client = open_incident(b, wire::ScopeKind::Client, "web-1", Some("web-1"));
    assert_eq!(refused_code(&run_for(b, "web-1")), Some(Code::Unavailable));
    let seen = client_record(b, "web-1");
    let r = b.perform(
        NOW,
        StoreOp::Register(registration("web-1", INSTANCE, seen.as_ref())),
    );
    assert_eq!(refused_code(&r), Some(Code::Unavailable), "{r:?}");
    assert!(matches!(run_for(b, "web-2"), Ok(Completion::RunCommand(_))));
    // the client's detail says so
    let detail = b.reads().get_client("web-1", NOW).unwrap();
    assert_eq!(detail.dirty_scopes.len(), 1, "{:?}", detail.dirty_scopes);
    assert_eq!(detail.dirty_scopes[0].incident_ids, vec![client.clone()]);
    acknowledge(b, client);
    assert!(matches!(run_for(b, "web-1"), Ok(Completion::RunCommand(_))));

    // the global scope: every write
    let global = open_incident(b, wire::ScopeKind::GlobalStore, "", None);
    assert_eq!(refused_code(&run_for(b, "web-2")), Some(Code::Unavailable));
    assert_eq!(refused_code(&run_for(b, "web-3")), Some(Code::Unavailable));
    acknowledge(b, global);
    assert!(matches!(run_for(b, "web-3"), Ok(Completion::RunCommand(_))));
}

fn refused_code(r: &OpResult) -> Option<Code> {
    refused(r)
}

fn client_record(
    b: &mut dyn WithReads,
    id: &str,
) -> Option<rvbox_store_port::sessions::ClientRecord> {
    client(b, id)
}
