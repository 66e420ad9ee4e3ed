//! The composed client core, driven through a model store, a model
//! supervisor and a scripted server (plan §7.1-§7.4): the reconnect order,
//! acceptance before its answer, the launch sequence without shortcuts,
//! cancellation while the launcher is blocked, restarts, and replays.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, VecDeque};

use prost::Message as _;
use rvbox_client_core::accept::{
    AcceptDecision, AcceptPolicy, Capacity, ExistingCommand, decide_acceptance,
};
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{
    ClientCore, ClientCoreConfig, Input, LaunchPhase, Output, RestoredRecord,
};
use rvbox_client_core::ops::{
    AcceptOutcome, ClientCompletion, ClientOp, ScriptOutcome, StdinOutcome, SuperviseOp,
};
use rvbox_client_core::process::{CommandProcessEvent, Exit, LaunchIdentity, ProcessEvent};
use rvbox_client_core::spool::{AppendItem, SpoolCompletion, SpoolLimits, SpoolOp};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;

const SID: &str = "0123456789abcdef0123";
const GEN: u64 = 3;

fn policy() -> AcceptPolicy {
    AcceptPolicy {
        client_id: ClientId::parse("c", "web-1").unwrap(),
        shells: vec![wire::ShellType::Sh],
        default_shell: wire::ShellType::Sh,
        profiles: vec![wire::ProfileFlag::Light],
        cwd_roots: vec!["/tmp".into()],
        default_cwd: "/tmp".into(),
        max_running: 2,
        max_queued: 4,
        closeout_reserve: 1024,
        storage_budget: 1 << 30,
        command_total: 32 << 20,
        command_streams: 11 << 20,
        free_space_floor: 64 << 20,
    }
}

fn config() -> ClientCoreConfig {
    ClientCoreConfig {
        policy: policy(),
        link: LinkConfig::default(),
        spool: SpoolLimits::default(),
        shell_paths: BTreeMap::from([(wire::ShellType::Sh as i32, "/bin/sh".to_string())]),
        profiles: BTreeMap::new(),
        hello: wire::ClientHello {
            client_id: "web-1".into(),
            protocol_major: 1,
            supported_minors: vec![0],
            ..Default::default()
        },
        terminals: rvbox_client_core::machine::TerminalLimits::default(),
    }
}

fn issue(n: u8) -> Uuid7 {
    Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-b302099a80{n:02x}")).unwrap()
}

fn dispatch(n: u8, generation: u64) -> wire::Dispatch {
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(format!(
            "echo {n}"
        ))),
        ..Default::default()
    };
    let normalized = check_execution_spec(&spec).unwrap();
    wire::Dispatch {
        issue_uuid: issue(n).to_string(),
        generation,
        revision: 1,
        request_hash: command_hash(&policy().client_id, &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Row {
    seq: Option<u64>,
    body: Body,
}

/// What a client store would hold, as far as these scenarios look.
#[derive(Debug, Default)]
struct ModelStore {
    commands: BTreeMap<Uuid7, ([u8; 32], u64)>,
    launch: BTreeMap<Uuid7, u8>,
    tombstones: BTreeMap<Uuid7, [u8; 32]>,
    rows: BTreeMap<(Uuid7, u64), Row>,
    generation: u64,
}

/// Everything that happened, in order, for assertions.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Store(&'static str, Uuid7),
    Supervise(&'static str, Uuid7),
}

#[derive(Debug)]
struct World {
    core: ClientCore,
    store: ModelStore,
    now: u64,
    /// Frames the client sent, decoded.
    sent: Vec<Payload>,
    steps: Vec<Step>,
    /// Supervisor steps waiting for the test to answer.
    supervise: VecDeque<SuperviseOp>,
    /// Durable steps held back (not completed) until released.
    hold: Vec<&'static str>,
    held: VecDeque<(rvbox_client_core::ops::Token, ClientOp)>,
    closes: Vec<u16>,
    /// Appends of a terminal lifecycle event that fail, from now on.
    fail_terminal_appends: u32,
}

fn op_name(op: &ClientOp) -> &'static str {
    match op {
        ClientOp::Accept(_) => "accept",
        ClientOp::Spool(_) => "spool",
        ClientOp::Generation(_) => "generation",
        ClientOp::Tombstones { .. } => "tombstones",
        ClientOp::Reconcile { .. } => "reconcile",
        ClientOp::Materialize { .. } => "materialize",
        ClientOp::LaunchPrepared { .. } => "prepared",
        ClientOp::LaunchAuthorized { .. } => "authorized",
        ClientOp::Running { .. } => "running",
        ClientOp::Unprepared { .. } => "unprepared",
        ClientOp::Ended { .. } => "ended",
        ClientOp::ScriptChunk { .. } => "script",
        ClientOp::StdinWrite { .. } => "stdin",
        ClientOp::StdinWritten { .. } => "stdin_written",
        ClientOp::Finish { .. } => "finish",
        ClientOp::TerminalOpening { .. } => "terminal_opening",
        ClientOp::TerminalOpened { .. } => "terminal_opened",
        ClientOp::TerminalClosed { .. } => "terminal_closed",
        ClientOp::TerminalsExpire { .. } => "terminals_expire",
    }
}

fn op_issue(op: &ClientOp) -> Uuid7 {
    match op {
        ClientOp::Accept(c) => c.issue,
        ClientOp::Materialize { issue, .. }
        | ClientOp::LaunchPrepared { issue, .. }
        | ClientOp::LaunchAuthorized { issue }
        | ClientOp::Running { issue }
        | ClientOp::Unprepared { issue }
        | ClientOp::Ended { issue, .. }
        | ClientOp::ScriptChunk { issue, .. }
        | ClientOp::StdinWrite { issue, .. }
        | ClientOp::StdinWritten { issue, .. }
        | ClientOp::Finish { issue } => *issue,
        ClientOp::Spool(op) => op.issue(),
        _ => issue(0),
    }
}

impl World {
    fn new(records: Vec<RestoredRecord>) -> Self {
        let core = ClientCore::new(config(), records, vec![], GEN - 1, 42, 0).unwrap();
        let mut w = Self {
            core,
            store: ModelStore::default(),
            now: 0,
            sent: Vec::new(),
            steps: Vec::new(),
            supervise: VecDeque::new(),
            hold: Vec::new(),
            held: VecDeque::new(),
            closes: Vec::new(),
            fail_terminal_appends: 0,
        };
        w.run();
        w
    }

    fn input(&mut self, i: Input) {
        self.now += 1;
        self.core.handle(self.now, 1_800_000_000_000, i);
        self.run();
    }

    fn frame(&mut self, payload: Payload) {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: GEN,
            payload: Some(payload),
        };
        self.input(Input::Frame(env.encode_to_vec()));
    }

    /// Connects, welcomes, and reconciles with an empty result.
    fn connect(&mut self) {
        self.input(Input::Opened);
        self.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            negotiated_minor: 0,
            session_id: SID.into(),
            generation: GEN,
            server_id: "srv".into(),
            ..Default::default()
        }));
        self.frame(Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![],
        }));
        let mut r = wire::ReconcileResult {
            round: 1,
            ..Default::default()
        };
        r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
        self.frame(Payload::ReconcileResult(r));
    }

    fn run(&mut self) {
        for _ in 0..100_000 {
            let Some(o) = self.core.poll_output() else {
                return;
            };
            match o {
                Output::Dial | Output::SendPing | Output::SendPong => {}
                Output::Close(c) => self.closes.push(c),
                Output::Send(bytes) | Output::SendData(bytes) => {
                    let env = wire::Envelope::decode(bytes.as_slice()).unwrap();
                    self.sent.push(env.payload.unwrap());
                }
                Output::SendEvents {
                    issue,
                    first_seq,
                    last_seq,
                    ..
                } => {
                    for seq in first_seq..=last_seq {
                        let row = self
                            .store
                            .rows
                            .iter()
                            .find(|((i, _), r)| *i == issue && r.seq == Some(seq))
                            .map(|(_, r)| r.body.clone())
                            .unwrap_or_else(|| panic!("send of undurable seq {seq}"));
                        self.sent.push(Payload::CommandEvent(wire::CommandEvent {
                            issue_uuid: issue.to_string(),
                            event_seq: seq,
                            observed_time: None,
                            body: Some(row),
                        }));
                    }
                }
                Output::Store(token, op) => {
                    let name = op_name(&op);
                    if self.hold.contains(&name) {
                        self.held.push_back((token, op));
                        continue;
                    }
                    self.perform(token, op);
                }
                Output::Supervise(op) => {
                    let (name, id) = match &op {
                        SuperviseOp::Prepare(s) => ("prepare", s.issue),
                        SuperviseOp::Release(i) => ("release", *i),
                        SuperviseOp::Abort(i) => ("abort", *i),
                        SuperviseOp::Signal { issue, .. } => ("signal", *issue),
                        SuperviseOp::WriteStdin { issue, .. } => ("stdin", *issue),
                        SuperviseOp::CloseStdin(i) => ("close_stdin", *i),
                        SuperviseOp::Reap { issue, .. } => ("reap", *issue),
                        SuperviseOp::StopAll => ("stop_all", issue(0)),
                        SuperviseOp::StartTerminal(s) => ("start_terminal", s.terminal),
                        SuperviseOp::AdoptTerminal { terminal, .. } => {
                            ("adopt_terminal", *terminal)
                        }
                        SuperviseOp::AttachTerminal { terminal, .. } => {
                            ("attach_terminal", *terminal)
                        }
                        SuperviseOp::TerminalInput { terminal, .. } => {
                            ("terminal_input", *terminal)
                        }
                        SuperviseOp::ResizeTerminal { terminal, .. } => {
                            ("resize_terminal", *terminal)
                        }
                        SuperviseOp::CloseTerminal(t) => ("close_terminal", *t),
                    };
                    self.steps.push(Step::Supervise(name, id));
                    self.supervise.push_back(op);
                }
            }
        }
        panic!("the core never settled");
    }

    fn perform(&mut self, token: rvbox_client_core::ops::Token, op: ClientOp) {
        let name = op_name(&op);
        self.steps.push(Step::Store(name, op_issue(&op)));
        let result = match op {
            ClientOp::Accept(d) => {
                let c = &self.store;
                let existing = c.commands.get(&d.issue).map(|(h, rev)| ExistingCommand {
                    request_hash: *h,
                    revision: *rev,
                    resolved_shell: wire::ShellType::Sh,
                    terminate_intent: false,
                });
                let cap = Capacity {
                    running: 0,
                    queued: c.commands.len() as u64,
                    records: c.commands.len() as u64,
                    charged_bytes: 0,
                    free_space: None,
                };
                let outcome = match decide_acceptance(
                    &policy(),
                    &d,
                    existing,
                    c.tombstones.get(&d.issue).copied(),
                    cap,
                ) {
                    AcceptDecision::Insert => {
                        self.store
                            .commands
                            .insert(d.issue, (d.request_hash, d.revision));
                        self.store.launch.insert(d.issue, 1);
                        AcceptOutcome::New
                    }
                    AcceptDecision::Repeat {
                        revision,
                        resolved_shell,
                    } => AcceptOutcome::Repeat {
                        revision,
                        resolved_shell,
                    },
                    AcceptDecision::Refuse(r) => AcceptOutcome::Refused(r),
                };
                ClientCompletion::Accepted(outcome)
            }
            ClientOp::Spool(op)
                if self.fail_terminal_appends > 0
                    && matches!(op.as_ref(), SpoolOp::Append {
                        item: AppendItem::Event(Body::Lifecycle(l)), ..
                    } if l.lifecycle != wire::Lifecycle::Running as i32) =>
            {
                self.fail_terminal_appends -= 1;
                ClientCompletion::Spool(SpoolCompletion::Failed)
            }
            ClientOp::Spool(op) => ClientCompletion::Spool(match *op {
                SpoolOp::Append {
                    issue,
                    ordinal,
                    item,
                    ..
                } => {
                    let (body, done) = match item {
                        AppendItem::Output { stream, bytes, .. } => (
                            Body::Output(wire::OutputChunk {
                                stream: stream as i32,
                                payload: bytes.clone(),
                                raw_length: bytes.len() as u32,
                                stored_length: bytes.len() as u32,
                            }),
                            SpoolCompletion::AppendedOutput {
                                stored_len: bytes.len() as u32,
                            },
                        ),
                        AppendItem::Event(b) => (b, SpoolCompletion::Done),
                    };
                    self.store
                        .rows
                        .insert((issue, ordinal), Row { seq: None, body });
                    done
                }
                SpoolOp::Assign {
                    issue,
                    ordinals,
                    first_seq,
                    ..
                } => {
                    for (i, o) in ordinals.iter().enumerate() {
                        self.store.rows.get_mut(&(issue, *o)).unwrap().seq =
                            Some(first_seq + i as u64);
                    }
                    SpoolCompletion::Done
                }
                SpoolOp::Release {
                    issue, upto_seq, ..
                } => {
                    self.store
                        .rows
                        .retain(|(i, _), r| !(*i == issue && r.seq.is_some_and(|s| s <= upto_seq)));
                    SpoolCompletion::Done
                }
                SpoolOp::Rotate { .. } | SpoolOp::PersistLoss { .. } => SpoolCompletion::Done,
            }),
            ClientOp::Generation(g) => {
                self.store.generation = g;
                ClientCompletion::Done
            }
            ClientOp::Tombstones { issues } => ClientCompletion::Tombstones(
                issues
                    .iter()
                    .filter_map(|i| self.store.tombstones.get(i).map(|h| (*i, *h)))
                    .collect(),
            ),
            ClientOp::Materialize { issue, cwd, .. } => ClientCompletion::Materialized {
                wrapper_path: format!("{cwd}/.rvbox-{issue}.sh"),
            },
            ClientOp::LaunchPrepared { issue, .. } => {
                self.store.launch.insert(issue, 2);
                ClientCompletion::Done
            }
            ClientOp::LaunchAuthorized { issue } => {
                self.store.launch.insert(issue, 3);
                ClientCompletion::Done
            }
            ClientOp::Running { issue } => {
                self.store.launch.insert(issue, 4);
                ClientCompletion::Done
            }
            ClientOp::Ended { issue, .. } => {
                self.store.launch.insert(issue, 5);
                ClientCompletion::Done
            }
            ClientOp::Finish { issue } => {
                if let Some((h, _)) = self.store.commands.remove(&issue) {
                    self.store.tombstones.insert(issue, h);
                }
                ClientCompletion::Done
            }
            ClientOp::ScriptChunk { .. } => ClientCompletion::Script(ScriptOutcome::Committed),
            ClientOp::Reconcile { .. }
            | ClientOp::Unprepared { .. }
            | ClientOp::StdinWritten { .. }
            | ClientOp::TerminalOpening { .. }
            | ClientOp::TerminalOpened { .. }
            | ClientOp::TerminalClosed { .. }
            | ClientOp::TerminalsExpire { .. } => ClientCompletion::Done,
            ClientOp::StdinWrite { write, .. } => {
                ClientCompletion::Stdin(StdinOutcome::Stored(write.payload.clone()))
            }
        };
        self.core.handle(
            self.now,
            1_800_000_000_000,
            Input::Completion(token, result),
        );
    }

    fn release_held(&mut self) {
        self.hold.clear();
        while let Some((t, op)) = self.held.pop_front() {
            self.perform(t, op);
            self.run();
        }
    }

    fn process(&mut self, id: Uuid7, event: ProcessEvent) {
        self.input(Input::Process(CommandProcessEvent { issue: id, event }));
    }

    /// Answers pending supervisor steps like a well-behaved tree that
    /// prints one line and exits with `code`.
    fn supervise_all(&mut self, code: i32) {
        while let Some(op) = self.supervise.pop_front() {
            match op {
                SuperviseOp::Prepare(s) => self.process(s.issue, ready()),
                SuperviseOp::Release(i) => {
                    self.process(i, ProcessEvent::Running);
                    self.process(
                        i,
                        ProcessEvent::Output {
                            stream: wire::OutputStream::Stdout,
                            observed_ms: 1,
                            bytes: b"hello\n".to_vec(),
                        },
                    );
                    self.process(i, ProcessEvent::Exited(Exit::Code(code)));
                    self.process(i, ProcessEvent::Drained { incomplete: vec![] });
                }
                SuperviseOp::Abort(i) => {
                    self.process(i, ProcessEvent::Drained { incomplete: vec![] })
                }
                SuperviseOp::Reap { issue, .. } => self.input(Input::Reaped { issue, gone: true }),
                _ => {}
            }
        }
    }

    fn events_of(&self, id: Uuid7) -> Vec<wire::CommandEvent> {
        let mut by_seq = BTreeMap::new();
        for p in &self.sent {
            if let Payload::CommandEvent(e) = p
                && e.issue_uuid == id.to_string()
            {
                by_seq.insert(e.event_seq, e.clone());
            }
        }
        by_seq.into_values().collect()
    }

    fn ack_all(&mut self) {
        let mut last: BTreeMap<String, u64> = BTreeMap::new();
        for p in &self.sent {
            if let Payload::CommandEvent(e) = p {
                let v = last.entry(e.issue_uuid.clone()).or_insert(0);
                *v = (*v).max(e.event_seq);
            }
        }
        for (id, seq) in last {
            self.frame(Payload::EventAck(wire::EventAck {
                issue_uuid: id,
                durable_event_seq: seq,
            }));
        }
    }

    fn answers(&self, id: Uuid7) -> Vec<wire::CommandAccepted> {
        self.sent
            .iter()
            .filter_map(|p| match p {
                Payload::CommandAccepted(a) if a.issue_uuid == id.to_string() => Some(a.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A blocked launcher's `Ready`, as a well-behaved supervisor reports it.
fn ready() -> ProcessEvent {
    ProcessEvent::Ready(LaunchIdentity {
        launcher_pid: 100,
        process_group: 100,
        birth_ticks: 5,
        cgroup: None,
    })
}

fn lifecycles(events: &[wire::CommandEvent]) -> Vec<i32> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            Some(Body::Lifecycle(l)) => Some(l.lifecycle),
            _ => None,
        })
        .collect()
}

#[test]
fn capacity_waits_for_the_applied_result_and_a_command_runs_once() {
    let mut w = World::new(vec![]);
    w.input(Input::Opened);
    w.frame(Payload::ServerWelcome(wire::ServerWelcome {
        protocol_major: 1,
        session_id: SID.into(),
        generation: GEN,
        ..Default::default()
    }));
    assert_eq!(w.store.generation, GEN, "the generation floor is recorded");
    w.hold.push("reconcile");
    w.frame(Payload::ReconcileRequest(wire::ReconcileRequest {
        round: 1,
        rows: vec![],
    }));
    let mut r = wire::ReconcileResult {
        round: 1,
        ..Default::default()
    };
    r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
    w.frame(Payload::ReconcileResult(r));
    assert!(matches!(w.sent.last(), Some(Payload::ClientSnapshot(_))));
    assert!(
        !w.sent
            .iter()
            .any(|p| matches!(p, Payload::ClientCapacity(_))),
        "no capacity before the result is durable"
    );
    w.release_held();
    assert!(matches!(w.sent.last(), Some(Payload::ClientCapacity(_))));

    let id = issue(1);
    w.frame(Payload::Dispatch(dispatch(1, GEN)));
    let a = w.answers(id);
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].outcome, wire::AcceptOutcome::Positive as i32);
    w.supervise_all(0);
    let evs = w.events_of(id);
    assert_eq!(
        lifecycles(&evs),
        vec![
            wire::Lifecycle::Running as i32,
            wire::Lifecycle::Succeeded as i32
        ]
    );
    assert!(matches!(&evs[1].body, Some(Body::Output(o)) if o.payload == b"hello\n"));
    let seqs: Vec<u64> = evs.iter().map(|e| e.event_seq).collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    w.ack_all();
    assert!(
        w.store.tombstones.contains_key(&id),
        "acknowledged: a tombstone"
    );
    assert_eq!(w.core.record_count(), 0);
    // the same dispatch again is refused as already executed
    w.frame(Payload::Dispatch(dispatch(1, GEN)));
    let a = w.answers(id);
    assert_eq!(a.len(), 2);
    assert_eq!(a[1].outcome, wire::AcceptOutcome::Permanent as i32);
    assert_eq!(w.core.stats().launched, 1);
}

#[test]
fn the_launch_sequence_takes_no_shortcut() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(2);
    w.frame(Payload::Dispatch(dispatch(2, GEN)));
    w.supervise_all(3);
    let order: Vec<&Step> = w
        .steps
        .iter()
        .filter(|s| {
            matches!(s,
                Step::Store("accept" | "materialize" | "prepared" | "authorized" | "running" | "ended", i)
                | Step::Supervise("prepare" | "release", i) if *i == id)
        })
        .collect();
    assert_eq!(
        order,
        vec![
            &Step::Store("accept", id),
            &Step::Store("materialize", id),
            &Step::Supervise("prepare", id),
            &Step::Store("prepared", id),
            &Step::Store("authorized", id),
            &Step::Supervise("release", id),
            &Step::Store("running", id),
            &Step::Store("ended", id),
        ]
    );
    assert_eq!(
        lifecycles(&w.events_of(id)).last(),
        Some(&(wire::Lifecycle::Failed as i32)),
        "exit 3 failed"
    );
}

#[test]
fn no_answer_leaves_before_the_acceptance_is_durable() {
    let mut w = World::new(vec![]);
    w.connect();
    w.hold.push("accept");
    w.frame(Payload::Dispatch(dispatch(3, GEN)));
    assert!(w.answers(issue(3)).is_empty());
    w.release_held();
    assert_eq!(w.answers(issue(3)).len(), 1);
}

#[test]
fn a_cancellation_while_the_launcher_is_blocked_aborts_it_before_release() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(4);
    w.hold.push("prepared");
    w.frame(Payload::Dispatch(dispatch(4, GEN)));
    // answer the prepare: Ready arrives, its durable record is held back
    let prepare = w.supervise.pop_front().unwrap();
    assert!(matches!(prepare, SuperviseOp::Prepare(_)));
    w.process(
        id,
        ProcessEvent::Ready(LaunchIdentity {
            launcher_pid: 9,
            process_group: 9,
            birth_ticks: 1,
            cgroup: None,
        }),
    );
    w.frame(Payload::Signal(wire::Signal {
        issue_uuid: id.to_string(),
        revision: 2,
        signal: wire::SignalKind::Term as i32,
    }));
    w.release_held();
    w.supervise_all(0);
    assert!(
        !w.steps.contains(&Step::Supervise("release", id)),
        "never released"
    );
    assert!(!w.steps.contains(&Step::Store("authorized", id)));
    assert!(w.steps.contains(&Step::Supervise("abort", id)));
    let evs = w.events_of(id);
    assert!(
        evs.iter()
            .any(|e| matches!(&e.body, Some(Body::SignalResult(s))
        if s.outcome == wire::SignalOutcome::CancelledBeforeLaunch as i32))
    );
    assert_eq!(lifecycles(&evs), vec![wire::Lifecycle::Cancelled as i32]);
}

#[test]
fn a_dispatch_for_another_generation_closes_the_session() {
    let mut w = World::new(vec![]);
    w.connect();
    w.frame(Payload::Dispatch(dispatch(5, GEN + 1)));
    assert_eq!(w.closes, vec![1002]);
    assert!(w.answers(issue(5)).is_empty());
}

fn restored(n: u8, launch: u8) -> RestoredRecord {
    let d = dispatch(n, GEN);
    RestoredRecord {
        issue: issue(n),
        request_hash: <[u8; 32]>::try_from(d.request_hash.as_slice()).unwrap(),
        revision: 1,
        resolved_shell: wire::ShellType::Sh,
        spec: check_execution_spec(d.spec.as_ref().unwrap()).unwrap(),
        lifecycle: wire::Lifecycle::Accepted,
        launch,
        identity: (launch >= 2).then_some(LaunchIdentity {
            launcher_pid: 77,
            process_group: 77,
            birth_ticks: 3,
            cgroup: None,
        }),
        terminate_intent: false,
        discard_intent: false,
        script: None,
        script_received: 0,
        script_committed: false,
        wrapper_path: None,
        stdin_next_seq: 1,
        stdin_closed: false,
    }
}

#[test]
fn after_a_restart_an_authorized_launch_ends_interrupted_and_a_prepared_one_runs_later() {
    let mut w = World::new(vec![restored(6, 3), restored(7, 2)]);
    // both are reaped before anything else
    assert!(w.steps.contains(&Step::Supervise("reap", issue(6))));
    assert!(w.steps.contains(&Step::Supervise("reap", issue(7))));
    w.supervise_all(0);
    w.connect();
    w.supervise_all(0);
    let interrupted = w.events_of(issue(6));
    assert_eq!(
        lifecycles(&interrupted),
        vec![wire::Lifecycle::Interrupted as i32]
    );
    assert!(
        !w.steps.contains(&Step::Supervise("release", issue(6))),
        "an uncertain launch never runs again"
    );
    let rerun = w.events_of(issue(7));
    assert_eq!(
        lifecycles(&rerun),
        vec![
            wire::Lifecycle::Running as i32,
            wire::Lifecycle::Succeeded as i32
        ]
    );
    assert_eq!(w.core.phase_of(&issue(7)), Some(&LaunchPhase::Ended));
}

#[test]
fn an_orderly_shutdown_stops_every_tree_and_reports_it_interrupted() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(8);
    w.frame(Payload::Dispatch(dispatch(8, GEN)));
    // launch up to running, but the tree does not exit on its own
    while let Some(op) = w.supervise.pop_front() {
        match op {
            SuperviseOp::Prepare(s) => w.process(
                s.issue,
                ProcessEvent::Ready(LaunchIdentity {
                    launcher_pid: 5,
                    process_group: 5,
                    birth_ticks: 5,
                    cgroup: None,
                }),
            ),
            SuperviseOp::Release(i) => w.process(i, ProcessEvent::Running),
            _ => {}
        }
    }
    w.input(Input::Shutdown);
    assert!(w.steps.contains(&Step::Supervise("stop_all", issue(0))));
    w.process(id, ProcessEvent::Exited(Exit::Signal(15)));
    w.process(id, ProcessEvent::Drained { incomplete: vec![] });
    // the session is closed: the terminal event waits in the spool
    let terminal = w
        .store
        .rows
        .iter()
        .filter(|((i, _), _)| *i == id)
        .filter_map(|(_, r)| match &r.body {
            Body::Lifecycle(l) => Some(l.lifecycle),
            _ => None,
        })
        .next_back();
    assert_eq!(terminal, Some(wire::Lifecycle::Interrupted as i32));
    assert_eq!(w.core.phase_of(&id), Some(&LaunchPhase::Ended));
}

#[test]
fn diagnostics_are_spooled_in_order_only_while_the_tree_runs() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(7);
    let hung = |on: bool| wire::Diagnostics {
        snapshot: None,
        suspected_hung: on,
        no_progress_since: None,
    };
    w.frame(Payload::Dispatch(dispatch(7, GEN)));
    // before the launch runs: not a progress report of a tree
    w.process(id, ProcessEvent::Diagnostics(hung(true)));
    while let Some(op) = w.supervise.pop_front() {
        match op {
            SuperviseOp::Prepare(s) => w.process(s.issue, ready()),
            SuperviseOp::Release(i) => {
                w.process(i, ProcessEvent::Running);
                w.process(i, ProcessEvent::Diagnostics(hung(true)));
                w.process(i, ProcessEvent::Diagnostics(hung(false)));
                w.process(i, ProcessEvent::Exited(Exit::Code(0)));
                // after the root exited: the tree is draining, not running
                w.process(i, ProcessEvent::Diagnostics(hung(true)));
                w.process(i, ProcessEvent::Drained { incomplete: vec![] });
                w.process(i, ProcessEvent::Diagnostics(hung(true)));
            }
            _ => {}
        }
    }
    let kinds: Vec<String> = w
        .events_of(id)
        .iter()
        .map(|e| match &e.body {
            Some(Body::Lifecycle(l)) => format!("lifecycle {}", l.lifecycle),
            Some(Body::Diagnostics(d)) => format!("hung {}", d.suspected_hung),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            format!("lifecycle {}", wire::Lifecycle::Running as i32),
            "hung true".to_owned(),
            "hung false".to_owned(),
            format!("lifecycle {}", wire::Lifecycle::Succeeded as i32),
        ]
    );
}

#[test]
fn a_terminal_event_that_cannot_be_made_durable_ends_the_command_interrupted_and_incomplete() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(8);
    w.frame(Payload::Dispatch(dispatch(8, GEN)));
    // every attempt at the terminal event fails
    w.fail_terminal_appends = rvbox_client_core::spool::MAX_APPEND_ATTEMPTS;
    w.supervise_all(0);
    let evs = w.events_of(id);
    let kinds: Vec<String> = evs
        .iter()
        .map(|e| match &e.body {
            Some(Body::Lifecycle(l)) => format!("lifecycle {}", l.lifecycle),
            Some(Body::Output(_)) => "output".to_owned(),
            Some(Body::Incomplete(i)) => format!("incomplete {:?}", i.streams),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            format!("lifecycle {}", wire::Lifecycle::Running as i32),
            "output".to_owned(),
            format!(
                "incomplete {:?}",
                vec![
                    wire::OutputStream::Stdout as i32,
                    wire::OutputStream::Stderr as i32
                ]
            ),
            format!("lifecycle {}", wire::Lifecycle::Interrupted as i32),
        ],
        "the run is never claimed complete"
    );
    assert_eq!(w.core.stats().unaccountable, 1);
    assert_eq!(
        w.store.launch.get(&id),
        Some(&5),
        "the slot is released once the terminal is durable"
    );
    w.ack_all();
    assert!(w.store.tombstones.contains_key(&id));
    assert_eq!(w.core.record_count(), 0);
}

#[test]
fn a_store_that_keeps_failing_the_terminal_event_leaves_the_command_unfinished() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(9);
    w.frame(Payload::Dispatch(dispatch(9, GEN)));
    w.fail_terminal_appends = u32::MAX;
    w.supervise_all(0);
    w.ack_all();
    let evs = w.events_of(id);
    assert!(
        !evs.iter()
            .any(|e| matches!(&e.body, Some(Body::Lifecycle(l))
            if l.lifecycle != wire::Lifecycle::Running as i32)),
        "no terminal event was durable, so none is sent"
    );
    assert!(
        !w.store.tombstones.contains_key(&id),
        "never finished without its terminal event"
    );
    assert_eq!(w.core.record_count(), 1);
    assert_eq!(w.store.launch.get(&id), Some(&4), "the slot stays reserved");
}

#[test]
fn the_snapshot_reports_the_store_health_the_shell_set() {
    let mut w = World::new(vec![]);
    w.core.set_store_health(wire::ScopeState::Unavailable);
    w.connect();
    let health: Vec<i32> = w
        .sent
        .iter()
        .filter_map(|p| match p {
            Payload::ClientSnapshot(s) => Some(s.store_health),
            _ => None,
        })
        .collect();
    assert_eq!(health, vec![wire::ScopeState::Unavailable as i32]);
}

#[test]
fn a_tree_that_cannot_be_verified_gone_is_checked_again_then_ends_interrupted() {
    use rvbox_client_core::machine::{MAX_REAP_ATTEMPTS, REAP_RETRY_MS};
    let mut w = World::new(vec![restored(6, 3), restored(7, 2)]);
    w.connect();
    let mut reaps = 0u32;
    let mut others = Vec::new();
    for _ in 0..(MAX_REAP_ATTEMPTS + 5) {
        let ops: Vec<SuperviseOp> = w.supervise.drain(..).collect();
        for op in ops {
            match op {
                // the recorded trees cannot be verified gone
                SuperviseOp::Reap { issue: i, .. } => {
                    if i == issue(6) {
                        reaps += 1;
                    }
                    w.input(Input::Reaped {
                        issue: i,
                        gone: false,
                    });
                }
                other => others.push(other),
            }
        }
        // time passes in heartbeat-sized steps, the server answering
        for _ in 0..(REAP_RETRY_MS / 5_000) {
            w.now += 5_000;
            let now = w.now;
            w.core.handle_timeout(now, 1_800_000_000_000);
            w.run();
            w.input(Input::Pong);
        }
    }
    assert_eq!(
        reaps, MAX_REAP_ATTEMPTS,
        "checked again, a bounded number of times"
    );
    // the authorized one ends interrupted, never launched again
    assert_eq!(
        lifecycles(&w.events_of(issue(6))),
        vec![wire::Lifecycle::Interrupted as i32]
    );
    assert!(!w.steps.contains(&Step::Supervise("release", issue(6))));
    assert_eq!(w.core.stats().unverified_trees, 1);
    // the prepared one never ran user code and is launched again
    w.supervise.extend(others);
    w.supervise_all(0);
    assert_eq!(
        lifecycles(&w.events_of(issue(7))),
        vec![
            wire::Lifecycle::Running as i32,
            wire::Lifecycle::Succeeded as i32
        ]
    );
}

#[test]
fn a_terminal_event_whose_append_fails_once_is_appended_again_in_its_place() {
    let mut w = World::new(vec![]);
    w.connect();
    let id = issue(10);
    w.frame(Payload::Dispatch(dispatch(10, GEN)));
    w.fail_terminal_appends = 1;
    w.supervise_all(0);
    assert_eq!(
        lifecycles(&w.events_of(id)),
        vec![
            wire::Lifecycle::Running as i32,
            wire::Lifecycle::Succeeded as i32
        ]
    );
    assert_eq!(w.core.stats().unaccountable, 0);
    w.ack_all();
    assert!(w.store.tombstones.contains_key(&id));
}

/// plan §6.1: the server announces its windows in the welcome, and the
/// client sends within the smaller of its own and the server's; a server
/// configured below the client's default never sees a window overrun.
#[test]
fn events_are_admitted_within_the_windows_the_server_announced() {
    let mut w = World::new(vec![]);
    w.input(Input::Opened);
    w.frame(Payload::ServerWelcome(wire::ServerWelcome {
        protocol_major: 1,
        negotiated_minor: 0,
        session_id: SID.into(),
        generation: GEN,
        server_id: "srv".into(),
        limits: Some(wire::AgentLimits {
            command_window_bytes: 128 * 1024,
            session_window_bytes: 256 * 1024,
            ..Default::default()
        }),
        ..Default::default()
    }));
    w.frame(Payload::ReconcileRequest(wire::ReconcileRequest {
        round: 1,
        rows: vec![],
    }));
    let mut r = wire::ReconcileResult {
        round: 1,
        ..Default::default()
    };
    r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
    w.frame(Payload::ReconcileResult(r));
    let id = issue(1);
    w.frame(Payload::Dispatch(dispatch(1, GEN)));
    while let Some(op) = w.supervise.pop_front() {
        match op {
            SuperviseOp::Prepare(s) => w.process(s.issue, ready()),
            SuperviseOp::Release(i) => w.process(i, ProcessEvent::Running),
            _ => {}
        }
    }
    // four 64 KiB reads that do not compress
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..4 {
        let bytes: Vec<u8> = (0..64 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        w.process(
            id,
            ProcessEvent::Output {
                stream: wire::OutputStream::Stdout,
                observed_ms: 1,
                bytes,
            },
        );
    }
    let in_flight: u64 = w
        .events_of(id)
        .iter()
        .map(rvbox_session::event_window_cost)
        .sum();
    assert!(
        in_flight <= 128 * 1024,
        "{in_flight} unacknowledged bytes against the server's 128 KiB window"
    );
    let before = w.events_of(id).len();
    assert!(before >= 2, "the running event and one output chunk fit");
    w.ack_all();
    assert!(
        w.events_of(id).len() > before,
        "an acknowledgement frees room for the next"
    );
}

/// A record restored after a restart launches in the working directory
/// acceptance checked: lexically normalized, never the raw `.`/`..` form.
#[test]
fn a_restored_record_launches_in_the_normalized_working_directory() {
    let mut r = restored(8, 0);
    r.spec.cwd = "/tmp/a/../b/./c/".into();
    let mut w = World::new(vec![r]);
    w.connect();
    let cwds: Vec<String> = w
        .supervise
        .iter()
        .filter_map(|op| match op {
            SuperviseOp::Prepare(spec) if spec.issue == issue(8) => Some(spec.cwd.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(cwds, vec!["/tmp/b/c".to_string()]);
}
