#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Property tests over generated rounds: determinism, sorted distinct
//! lists, one action per server row against an independent oracle,
//! all-or-nothing validation, and independence from the chunk split.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use proptest::prelude::*;
use prost::Message as _;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use rvbox_reconcile::limits::MAX_INCIDENT_SUMMARY_BYTES;
use rvbox_reconcile::{
    Action, InterruptReason, ReconcileError, ServerCommand, ServerKnown, Source, check_result,
};

const LISTED_PHASES: [Phase; 6] = [
    Phase::Queued,
    Phase::Dispatched,
    Phase::Accepted,
    Phase::LaunchPrepared,
    Phase::LaunchAuthorized,
    Phase::Running,
];
const LOCAL: [Lifecycle; 8] = [
    Lifecycle::Accepted,
    Lifecycle::Running,
    Lifecycle::Succeeded,
    Lifecycle::Failed,
    Lifecycle::Terminated,
    Lifecycle::Interrupted,
    Lifecycle::Rejected,
    Lifecycle::Cancelled,
];
/// What a client may hold after the server saw `running` (written out,
/// not derived from the crate's reachability search).
const AFTER_RUNNING: [Lifecycle; 5] = [
    Lifecycle::Running,
    Lifecycle::Succeeded,
    Lifecycle::Failed,
    Lifecycle::Terminated,
    Lifecycle::Interrupted,
];
const TERMINAL: [Lifecycle; 6] = [
    Lifecycle::Succeeded,
    Lifecycle::Failed,
    Lifecycle::Terminated,
    Lifecycle::Interrupted,
    Lifecycle::Rejected,
    Lifecycle::Cancelled,
];

/// Raw choices for one uuid of a round.
#[derive(Debug, Clone)]
struct Item {
    server: u8,
    client: u8,
    n: [u16; 8],
}

fn items() -> impl Strategy<Value = Vec<Item>> {
    prop::collection::vec(
        (0u8..10, 0u8..3, prop::array::uniform8(any::<u16>()))
            .prop_map(|(server, client, n)| Item { server, client, n }),
        0..40,
    )
}

/// The client evidence the generator chose (the oracle's view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evidence {
    Absent,
    Tombstone,
    Record(Lifecycle),
}

#[derive(Debug, Clone)]
struct Round {
    rows: Vec<ServerCommand>,
    known: BTreeMap<Uuid7, ServerKnown>,
    records: Vec<wire::SnapshotRecord>,
    tombstones: Vec<wire::SnapshotTombstone>,
    evidence: BTreeMap<Uuid7, Evidence>,
}

/// Builds a valid round: every record respects the validation rules.
fn build(items: &[Item]) -> Round {
    let mut round = Round {
        rows: vec![],
        known: BTreeMap::new(),
        records: vec![],
        tombstones: vec![],
        evidence: BTreeMap::new(),
    };
    for (i, item) in items.iter().enumerate() {
        let i = u32::try_from(i).unwrap();
        let id = uuid(i);
        let n = item.n.map(u64::from);
        if usize::from(item.server) < LISTED_PHASES.len() {
            let phase = LISTED_PHASES[usize::from(item.server)];
            let revision = 1 + n[0] % 5;
            let durable = n[1] % 6;
            let source = match n[2] % 3 {
                0 => Source::CommandText,
                k => Source::Script {
                    size_bytes: 1 + n[3] % 1000,
                    upload_committed: k == 2,
                },
            };
            round.rows.push(ServerCommand {
                issue_uuid: id,
                request_hash: hash(i),
                phase,
                revision: Revision(revision),
                durable_event_seq: durable,
                source,
            });
            let evidence = match item.client {
                0 => Evidence::Absent,
                1 => {
                    round.tombstones.push(tomb(i));
                    Evidence::Tombstone
                }
                _ => {
                    let lc = if phase == Phase::Running {
                        AFTER_RUNNING[usize::try_from(n[4]).unwrap() % AFTER_RUNNING.len()]
                    } else {
                        LOCAL[usize::try_from(n[4]).unwrap() % LOCAL.len()]
                    };
                    let assigned = durable + n[5] % 4;
                    let mut r = rec(i, lc, 1 + n[6] % revision, assigned, n[7] % (durable + 1));
                    if let Source::Script { size_bytes, .. } = source {
                        r.script_received_bytes = n[7] % (size_bytes + 1);
                    }
                    round.records.push(r);
                    Evidence::Record(lc)
                }
            };
            round.evidence.insert(id, evidence);
        } else {
            // Unlisted: the client holds a record the server no longer lists.
            let lc = LOCAL[usize::try_from(n[4]).unwrap() % LOCAL.len()];
            let durable = n[1] % 6;
            let k = match item.server {
                6 | 7 => ServerKnown::Missing,
                8 => tombstoned(i),
                _ => terminal(
                    i,
                    TERMINAL[usize::try_from(n[2]).unwrap() % TERMINAL.len()],
                    durable,
                ),
            };
            let assigned = durable + n[5] % 2;
            round
                .records
                .push(rec(i, lc, 1 + n[6] % 7, assigned, n[7] % (durable + 1)));
            round.known.insert(id, k);
            round.evidence.insert(id, Evidence::Record(lc));
        }
    }
    round
}

fn reconcile_round(r: &Round) -> Result<rvbox_reconcile::Outcome, ReconcileError> {
    run(
        &r.rows,
        &r.known,
        &snap(r.records.clone(), r.tombstones.clone()),
    )
}

fn strictly_ascending(v: &[String]) -> bool {
    v.windows(2).all(|w| w[0] < w[1])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every valid round reconciles; exactly one action per server row,
    /// matching an independent oracle; sorted, distinct, disjoint lists;
    /// the client's own check accepts the result.
    #[test]
    fn valid_rounds_follow_the_matrix(items in items()) {
        let round = build(&items);
        let out = reconcile_round(&round).unwrap();

        let action_ids: Vec<Uuid7> = out.actions().iter().map(|a| a.issue_uuid).collect();
        let row_ids: BTreeSet<Uuid7> = round.rows.iter().map(|r| r.issue_uuid).collect();
        prop_assert!(action_ids.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(action_ids.iter().copied().collect::<BTreeSet<_>>(), row_ids);

        let mut expect_resume = Vec::new();
        for (row, a) in round.rows.iter().zip(out.actions()) {
            prop_assert_eq!(row.issue_uuid, a.issue_uuid);
            let evidence = round.evidence[&row.issue_uuid];
            let active = !matches!(row.phase, Phase::Queued | Phase::Dispatched);
            match (evidence, a.action) {
                (Evidence::Absent, Action::Requeue { from }) => {
                    prop_assert!(!active);
                    prop_assert_eq!(from, row.phase);
                }
                (Evidence::Absent, Action::Interrupt { reason, .. }) => {
                    prop_assert!(active);
                    prop_assert_eq!(reason, InterruptReason::ClientStateLoss);
                }
                (Evidence::Tombstone, Action::Interrupt { reason, from }) => {
                    prop_assert_eq!(reason, InterruptReason::StaleServer);
                    prop_assert_eq!(from, row.phase);
                }
                (Evidence::Record(lc), Action::Keep { resume, advance_to, .. }) => {
                    prop_assert_eq!(resume.revision, row.revision);
                    prop_assert_eq!(resume.durable_event_seq, row.durable_event_seq);
                    if let Some(to) = advance_to {
                        prop_assert!(to == Lifecycle::Accepted || to == Lifecycle::Running);
                        // strictly further along than the server
                        let order = [Lifecycle::Queued, Lifecycle::Dispatched, Lifecycle::Accepted, Lifecycle::Running];
                        let pos = |l| order.iter().position(|o| *o == l).unwrap();
                        prop_assert!(pos(to) > pos(row.phase.lifecycle()));
                    } else {
                        // no advance: the server is already at least as far
                        let proves_running = matches!(lc, Lifecycle::Running | Lifecycle::Succeeded | Lifecycle::Failed | Lifecycle::Terminated);
                        prop_assert!(row.phase.lifecycle() == Lifecycle::Running
                            || (!proves_running && row.phase.lifecycle() == Lifecycle::Accepted));
                    }
                    if matches!(lc, Lifecycle::Running | Lifecycle::Succeeded | Lifecycle::Failed | Lifecycle::Terminated) {
                        prop_assert!(row.phase == Phase::Running || advance_to == Some(Lifecycle::Running));
                    }
                    expect_resume.push(row.issue_uuid.to_string());
                }
                (e, a) => prop_assert!(false, "evidence {:?} got {:?}", e, a),
            }
        }

        let res = out.result();
        let resume_ids: Vec<String> = res.resume.iter().map(|r| r.issue_uuid.clone()).collect();
        prop_assert_eq!(&resume_ids, &expect_resume);
        prop_assert!(strictly_ascending(&resume_ids));
        prop_assert!(strictly_ascending(&res.terminate_local_issue_uuids));
        prop_assert!(strictly_ascending(&res.discard_local_terminal_issue_uuids));

        // Unlisted records: active -> terminate, terminal -> discard.
        let mut terminate = Vec::new();
        let mut discard = Vec::new();
        for id in round.known.keys() {
            match round.evidence[id] {
                Evidence::Record(lc) if lc.is_terminal() => discard.push(id.to_string()),
                Evidence::Record(_) => terminate.push(id.to_string()),
                _ => unreachable!(),
            }
        }
        prop_assert_eq!(&res.terminate_local_issue_uuids, &terminate);
        prop_assert_eq!(&res.discard_local_terminal_issue_uuids, &discard);

        // Incidents: an independent oracle per uuid.
        let mut expected = BTreeMap::new();
        for row in &round.rows {
            let kind = match (round.evidence[&row.issue_uuid], row.phase) {
                (Evidence::Absent, Phase::Queued | Phase::Dispatched) => None,
                (Evidence::Absent, _) => Some(wire::IncidentKind::ClientStateLoss),
                (Evidence::Tombstone, _) => Some(wire::IncidentKind::StaleServer),
                (Evidence::Record(_), Phase::Queued) => Some(wire::IncidentKind::ReconciliationContradiction),
                (Evidence::Record(_), _) => None,
            };
            if let Some(kind) = kind {
                expected.insert(row.issue_uuid, kind);
            }
        }
        for r in &round.records {
            let id = Uuid7::parse("t", &r.issue_uuid).unwrap();
            let Some(k) = round.known.get(&id) else { continue };
            let lc = Lifecycle::from_wire(r.lifecycle).unwrap();
            let contradiction = !lc.is_terminal()
                || matches!(k, ServerKnown::Terminal { lifecycle, durable_event_seq, .. }
                    if *lifecycle != lc || r.last_assigned_event_seq > *durable_event_seq);
            if contradiction {
                expected.insert(id, wire::IncidentKind::ReconciliationContradiction);
            }
        }
        let got: BTreeMap<Uuid7, wire::IncidentKind> =
            out.incidents().iter().map(|i| (i.issue_uuid, i.kind)).collect();
        prop_assert_eq!(got.len(), out.incidents().len());
        prop_assert_eq!(got, expected);

        let incident_ids: Vec<Uuid7> = out.incidents().iter().map(|i| i.issue_uuid).collect();
        prop_assert!(incident_ids.windows(2).all(|w| w[0] < w[1]));
        for i in out.incidents() {
            prop_assert!(i.summary.len() <= MAX_INCIDENT_SUMMARY_BYTES);
        }
        prop_assert!(check_result(res, ROUND).is_ok());
    }

    /// Same inputs -> same bytes, whatever the chunk split and the order
    /// the server queried its rows in.
    #[test]
    fn the_result_does_not_depend_on_chunking_or_row_order(
        items in items(),
        rec_cuts in prop::collection::vec(any::<bool>(), 40),
        tomb_cuts in prop::collection::vec(any::<bool>(), 40),
        empty_final in any::<bool>(),
        order in prop::collection::vec(any::<u32>(), 40),
    ) {
        let round = build(&items);
        let baseline = reconcile_round(&round).unwrap();
        let again = reconcile_round(&round).unwrap();
        prop_assert_eq!(baseline.result().encode_to_vec(), again.result().encode_to_vec());

        let chunks = split(ROUND, &round.records, &round.tombstones, &rec_cuts, &tomb_cuts, empty_final);
        let snapshot = assemble(ROUND, &chunks).unwrap();
        let mut rows: Vec<(u32, ServerCommand)> =
            round.rows.iter().enumerate().map(|(i, r)| (order[i % order.len()], *r)).collect();
        rows.sort_by_key(|(k, _)| *k);
        let rows: Vec<ServerCommand> = rows.into_iter().map(|(_, r)| r).collect();
        let split_out = run(&rows, &round.known, &snapshot).unwrap();
        prop_assert_eq!(baseline.result().encode_to_vec(), split_out.result().encode_to_vec());
        prop_assert_eq!(baseline.digest(), split_out.digest());
        prop_assert_eq!(baseline, split_out);
    }

    /// One invalid row anywhere means no outcome at all, and the error
    /// names that row.
    #[test]
    fn any_invalid_row_means_no_outcome(items in items(), pick in any::<prop::sample::Index>(), how in 0u8..4) {
        let mut round = build(&items);
        // Targets: evidence that carries a hash the server can compare.
        let mut targets: Vec<(Uuid7, bool)> = Vec::new(); // (uuid, is_record)
        for r in &round.records {
            let id = Uuid7::parse("t", &r.issue_uuid).unwrap();
            if !matches!(round.known.get(&id), Some(ServerKnown::Missing)) {
                targets.push((id, true));
            }
        }
        for t in &round.tombstones {
            targets.push((Uuid7::parse("t", &t.issue_uuid).unwrap(), false));
        }
        prop_assume!(!targets.is_empty());
        let (target, is_record) = *pick.get(&targets);
        let text = target.to_string();
        let listed = round.rows.iter().find(|r| r.issue_uuid == target).copied();
        let durable = match (listed, round.known.get(&target)) {
            (Some(row), _) => Some(row.durable_event_seq),
            (None, Some(ServerKnown::Terminal { durable_event_seq, .. })) => Some(*durable_event_seq),
            _ => None,
        };
        if is_record {
            let r = round.records.iter_mut().find(|r| r.issue_uuid == text).unwrap();
            match (how, listed, durable) {
                // revision monotonicity
                (1, Some(row), _) => r.revision = row.revision.0 + 1,
                // event-sequence bounds: acknowledged beyond a terminal
                // command's durable events (for a live command that is a
                // recorded loss, not an invalid snapshot)
                (2, None, Some(d)) => {
                    r.acked_event_seq = d + 1;
                    r.last_assigned_event_seq = r.last_assigned_event_seq.max(d + 1);
                }
                // event-sequence bounds: fewer events assigned than the
                // server holds
                (2, Some(_), Some(d)) if d > 0 => {
                    r.last_assigned_event_seq = d - 1;
                    r.acked_event_seq = r.acked_event_seq.min(d - 1);
                }
                // lifecycle went backwards
                (3, Some(row), _) if row.phase == Phase::Running => {
                    r.lifecycle = Lifecycle::Accepted.to_wire() as i32;
                }
                // immutable request hash
                _ => r.request_hash[0] ^= 0xff,
            }
        } else {
            let t = round.tombstones.iter_mut().find(|t| t.issue_uuid == text).unwrap();
            t.request_hash[0] ^= 0xff;
        }
        match reconcile_round(&round) {
            Err(ReconcileError::InvalidSnapshot(e)) => prop_assert_eq!(e.issue_uuid(), target),
            other => prop_assert!(false, "expected an invalid snapshot for {}, got {:?}", target, other),
        }
    }
}
