//! The client core over the real client store (plan §7.1-§7.4): a command
//! and a script command run end to end with their events read back from
//! the spool, a restart in the middle of a launch, and a power cut at every
//! launch, acceptance and script commit point with the same dispatch sent
//! again: exactly one of a refusal, one run, or an interrupted launch.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Arc;

use prost::Message as _;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{ClientCore, ClientCoreConfig, Input, Output};
use rvbox_client_core::ops::SuperviseOp;
use rvbox_client_core::process::{CommandProcessEvent, Exit, LaunchIdentity, ProcessEvent};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions, crash};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::crash::{CrashHook, NoCrash};
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::{CrashMode, FaultyFs, StoreFs};
use support::{NOW, StopAt, issue, policy};

const SID: &str = "0123456789abcdef0123";

fn config(cwd: &str) -> ClientCoreConfig {
    let mut p = policy();
    p.cwd_roots = vec![cwd.into()];
    p.default_cwd = cwd.into();
    ClientCoreConfig {
        policy: p,
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

fn text_spec(text: &str) -> wire::ExecutionSpec {
    wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(text.into())),
        ..Default::default()
    }
}

fn dispatch(n: u32, spec: wire::ExecutionSpec, generation: u64) -> wire::Dispatch {
    let normalized = check_execution_spec(&spec).unwrap();
    wire::Dispatch {
        issue_uuid: issue(n),
        generation,
        revision: 1,
        request_hash: command_hash(&policy().client_id, &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    }
}

/// The daemon side: the core, its store, and a model supervisor whose
/// tree "runs" the wrapper by recording its content to a side-effect file.
struct Daemon {
    core: ClientCore,
    store: ClientStore,
    cwd: String,
    now: u64,
    generation: u64,
    sent: Vec<Payload>,
    supervise: VecDeque<SuperviseOp>,
    side_effects: std::path::PathBuf,
    wrappers: BTreeMap<Uuid7, String>,
}

impl Daemon {
    fn open(
        root: &Path,
        fs: Arc<dyn StoreFs>,
        hook: Arc<dyn CrashHook>,
        cwd: &str,
        generation: u64,
    ) -> Self {
        let store = ClientStore::open_with_hook(
            ClientLayout::new(root),
            fs,
            Arc::new(OsEntropy),
            hook,
            ClientStoreOptions::default(),
            NOW,
        )
        .unwrap();
        let records = store.restore_records().unwrap();
        let spool = store.restore_spool().unwrap();
        let floor = store.last_generation().unwrap();
        let core = ClientCore::new(config(cwd), records, spool, floor, 7, 0).unwrap();
        let mut d = Self {
            core,
            store,
            cwd: cwd.into(),
            now: 0,
            generation,
            sent: Vec::new(),
            supervise: VecDeque::new(),
            side_effects: Path::new(cwd).join("side-effects"),
            wrappers: BTreeMap::new(),
        };
        d.run();
        d
    }

    fn input(&mut self, i: Input) {
        self.now += 1;
        self.core.handle(self.now, NOW, i);
        self.run();
    }

    fn frame(&mut self, payload: Payload) {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: self.generation,
            payload: Some(payload),
        };
        self.input(Input::Frame(env.encode_to_vec()));
    }

    fn connect(&mut self) {
        self.connect_with(&[], &[]);
    }

    /// Connects; the reconciliation result terminates `terminate` and
    /// discards `discard`.
    fn connect_with(&mut self, terminate: &[String], discard: &[String]) {
        self.input(Input::Opened);
        self.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation: self.generation,
            ..Default::default()
        }));
        self.frame(Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![],
        }));
        let mut r = wire::ReconcileResult {
            round: 1,
            terminate_local_issue_uuids: terminate.to_vec(),
            discard_local_terminal_issue_uuids: discard.to_vec(),
            ..Default::default()
        };
        r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
        self.frame(Payload::ReconcileResult(r));
    }

    fn run(&mut self) {
        let policy = config(&self.cwd).policy;
        for _ in 0..1_000_000 {
            let Some(o) = self.core.poll_output() else {
                return;
            };
            match o {
                Output::Send(b) | Output::SendData(b) => {
                    let env = wire::Envelope::decode(b.as_slice()).unwrap();
                    self.sent.push(env.payload.unwrap());
                }
                Output::SendEvents {
                    issue,
                    first_seq,
                    last_seq,
                    ..
                } => {
                    for e in self.store.read_events(&issue, first_seq, last_seq).unwrap() {
                        self.sent.push(Payload::CommandEvent(e));
                    }
                }
                Output::Store(t, op) => {
                    let done = self.store.perform(&policy, &op, NOW);
                    self.core.handle(self.now, NOW, Input::Completion(t, done));
                }
                Output::Supervise(op) => self.supervise.push_back(op),
                Output::Dial | Output::SendPing | Output::SendPong | Output::Close(_) => {}
            }
        }
        panic!("the core never settled");
    }

    fn process(&mut self, id: Uuid7, event: ProcessEvent) {
        self.input(Input::Process(CommandProcessEvent { issue: id, event }));
    }

    /// The model tree: running the wrapper appends one line to the
    /// side-effect file, and its output is the wrapper's content.
    fn supervise_all(&mut self) {
        while let Some(op) = self.supervise.pop_front() {
            match op {
                SuperviseOp::Prepare(s) => {
                    self.wrappers.insert(s.issue, s.wrapper_path.clone());
                    self.process(
                        s.issue,
                        ProcessEvent::Ready(LaunchIdentity {
                            launcher_pid: 4242,
                            process_group: 4242,
                            birth_ticks: 9,
                            cgroup: None,
                        }),
                    );
                }
                SuperviseOp::Release(i) => {
                    let wrapper = self.wrappers.get(&i).cloned().unwrap();
                    let content = std::fs::read(&wrapper).unwrap();
                    let mut f = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&self.side_effects)
                        .unwrap();
                    use std::io::Write as _;
                    writeln!(f, "ran {i}").unwrap();
                    self.process(i, ProcessEvent::Running);
                    for part in content.chunks(64 * 1024) {
                        self.process(
                            i,
                            ProcessEvent::Output {
                                stream: wire::OutputStream::Stdout,
                                observed_ms: NOW,
                                bytes: part.to_vec(),
                            },
                        );
                    }
                    self.process(i, ProcessEvent::Exited(Exit::Code(0)));
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

    fn events_of(&self, id: &str) -> Vec<wire::CommandEvent> {
        let mut by_seq = BTreeMap::new();
        for p in &self.sent {
            if let Payload::CommandEvent(e) = p
                && e.issue_uuid == id
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

    fn side_effects(&self) -> Vec<String> {
        std::fs::read_to_string(&self.side_effects)
            .map(|s| s.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }
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

fn answers(sent: &[Payload], id: &str) -> Vec<wire::CommandAccepted> {
    sent.iter()
        .filter_map(|p| match p {
            Payload::CommandAccepted(a) if a.issue_uuid == id => Some(a.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_command_and_a_script_command_run_end_to_end_over_the_real_store() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let mut d = Daemon::open(
        &dir.path().join("state"),
        Arc::new(rvbox_storage::fs::RealFs),
        Arc::new(NoCrash),
        &cwd,
        1,
    );
    d.connect();
    // a text command
    d.frame(Payload::Dispatch(dispatch(1, text_spec("echo one"), 1)));
    assert_eq!(
        answers(&d.sent, &issue(1))[0].outcome,
        wire::AcceptOutcome::Positive as i32
    );
    // its wrapper holds the command text: private to the daemon's account
    let wrapper = format!("{cwd}/.rvbox-{}.sh", issue(1));
    assert_eq!(mode(std::path::Path::new(&wrapper)), 0o600, "{wrapper}");
    // a script command, uploaded in two chunks
    let script = b"echo from a script\n".repeat(20_000);
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::Script(
            wire::ScriptDescriptor {
                display_basename: "job.sh".into(),
                size_bytes: script.len() as u64,
                sha256: rvbox_segment::sha256(&script).to_vec(),
            },
        )),
        ..Default::default()
    };
    d.frame(Payload::Dispatch(dispatch(2, spec, 1)));
    assert_eq!(
        answers(&d.sent, &issue(2))[0].outcome,
        wire::AcceptOutcome::Positive as i32
    );
    d.supervise_all();
    let half = 200_000usize;
    for (offset, part) in [(0usize, &script[..half]), (half, &script[half..])] {
        d.frame(Payload::ScriptChunk(wire::ScriptChunk {
            issue_uuid: issue(2),
            offset: offset as u64,
            declared_size: script.len() as u64,
            compression: wire::Compression::None as i32,
            payload: part.to_vec(),
            raw_length: part.len() as u32,
            stored_length: part.len() as u32,
            raw_sha256: rvbox_segment::sha256(part).to_vec(),
        }));
    }
    let statuses: Vec<i32> = d
        .sent
        .iter()
        .filter_map(|p| match p {
            Payload::ScriptUploadStatus(s) => Some(s.state),
            _ => None,
        })
        .collect();
    assert_eq!(
        statuses.last(),
        Some(&(wire::ScriptUploadState::Committed as i32))
    );
    // the stored script: a 0600 segment in 0700 directories
    let state = dir.path().join("state");
    let scripts = state.join("scripts");
    let stored: Vec<_> = std::fs::read_dir(&scripts)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(mode(&stored[0]), 0o600, "{}", stored[0].display());
    assert_eq!(mode(&scripts), 0o700);
    assert_eq!(mode(&state), 0o700);
    d.supervise_all();
    for id in [issue(1), issue(2)] {
        let evs = d.events_of(&id);
        assert_eq!(
            lifecycles(&evs),
            vec![
                wire::Lifecycle::Running as i32,
                wire::Lifecycle::Succeeded as i32
            ],
            "{id}"
        );
    }
    // the script ran as uploaded: its output is the script itself
    let out: Vec<u8> = d
        .events_of(&issue(2))
        .iter()
        .filter_map(|e| match &e.body {
            Some(Body::Output(o)) => {
                Some(zstd::bulk::decompress(&o.payload, o.raw_length as usize).unwrap())
            }
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(out, script);
    d.ack_all();
    d.ack_all();
    let c = d.store.counters().unwrap();
    assert_eq!((c.commands, c.tombstones, c.stored_bytes), (0, 2, 0));
    assert_eq!(c, d.store.recount().unwrap());
    assert_eq!(d.side_effects().len(), 2);
    // no wrapper file is left behind
    let left: Vec<_> = std::fs::read_dir(&cwd)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".rvbox-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// One dispatch, a power cut at `point`, a restart, the same dispatch
/// again: the side effect happens at most once, and the command's fate is
/// one of a durable refusal, one run, or an interrupted launch.
fn crash_and_redispatch(point: &'static str) {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let mut d = Daemon::open(&root, fs.clone(), Arc::new(NoCrash), &cwd, 1);
    d.store.set_crash_hook(Arc::new(StopAt::new(point)));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        d.connect();
        d.frame(Payload::Dispatch(dispatch(1, text_spec("echo once"), 1)));
        d.supervise_all();
        d.ack_all();
        d.ack_all();
    }));
    assert!(crashed.is_err(), "{point} was never reached");
    let Daemon { store, .. } = d;
    store.close_as_crashed();
    fs.crash(CrashMode::LoseUnsynced).unwrap();

    let mut d = Daemon::open(&root, fs.clone(), Arc::new(NoCrash), &cwd, 2);
    d.supervise_all();
    d.connect();
    d.frame(Payload::Dispatch(dispatch(1, text_spec("echo once"), 2)));
    d.supervise_all();
    for _ in 0..3 {
        d.ack_all();
        d.supervise_all();
    }
    let runs = d.side_effects().len();
    assert!(runs <= 1, "{point}: the command ran {runs} times");
    let fates = lifecycles(&d.events_of(&issue(1)));
    let answer = answers(&d.sent, &issue(1));
    let refused = answer
        .last()
        .is_some_and(|a| a.outcome == wire::AcceptOutcome::Permanent as i32);
    let ok = match (runs, fates.last().copied()) {
        (1, Some(l)) => {
            l == wire::Lifecycle::Succeeded as i32 || l == wire::Lifecycle::Interrupted as i32
        }
        (1, None) => refused, // it ran and was acknowledged before the cut
        (0, Some(l)) => l == wire::Lifecycle::Interrupted as i32,
        _ => false,
    };
    assert!(
        ok,
        "{point}: runs {runs}, lifecycles {fates:?}, answers {answer:?}"
    );
    assert_eq!(
        d.store.counters().unwrap(),
        d.store.recount().unwrap(),
        "{point}"
    );
}

#[test]
fn a_power_cut_at_every_acceptance_launch_spool_and_acknowledgement_point_runs_a_command_at_most_once()
 {
    for point in [
        crash::ACCEPT_BEFORE_COMMIT,
        crash::ACCEPT_AFTER_COMMIT,
        crash::RECONCILE_AFTER_COMMIT,
        crash::MATERIALIZE_BEFORE_RENAME,
        crash::LAUNCH_PREPARED_AFTER_FSYNC,
        crash::LAUNCH_AUTHORIZED_AFTER_FSYNC,
        crash::LAUNCH_RUNNING_AFTER_COMMIT,
        crash::SPOOL_EVENT_AFTER_COMMIT,
        crash::SPOOL_APPEND_AFTER_FSYNC,
        crash::SPOOL_APPEND_AFTER_COMMIT,
        crash::SPOOL_ASSIGN_AFTER_COMMIT,
        crash::LAUNCH_ENDED_AFTER_COMMIT,
        crash::SPOOL_RELEASE_AFTER_COMMIT,
        crash::TERMINAL_ACK_AFTER_COMMIT,
    ] {
        crash_and_redispatch(point);
    }
}

/// The permission bits of `p`.
fn mode(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// The wrapper files in `cwd`.
fn wrappers_in(cwd: &str) -> Vec<String> {
    std::fs::read_dir(cwd)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".rvbox-"))
        .collect()
}

#[test]
fn a_command_reconciliation_terminates_before_it_ran_leaves_no_wrapper_behind() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let root = dir.path().join("state");
    let fs: Arc<dyn StoreFs> = Arc::new(FaultyFs::new());
    let mut d = Daemon::open(&root, fs.clone(), Arc::new(NoCrash), &cwd, 1);
    d.connect();
    d.frame(Payload::Dispatch(dispatch(1, text_spec("echo never"), 1)));
    assert_eq!(
        answers(&d.sent, &issue(1))[0].outcome,
        wire::AcceptOutcome::Positive as i32
    );
    assert_eq!(wrappers_in(&cwd).len(), 1, "materialized before the launch");
    // the daemon restarts before the launch; the server no longer holds
    // the command, so reconciliation terminates it
    d.store.close_as_crashed();
    let mut d = Daemon::open(&root, fs, Arc::new(NoCrash), &cwd, 2);
    d.connect_with(&[issue(1)], &[]);
    d.supervise_all();
    let c = d.store.counters().unwrap();
    assert_eq!((c.commands, c.tombstones), (0, 1));
    assert!(d.side_effects().is_empty(), "it never ran");
    assert!(wrappers_in(&cwd).is_empty(), "{:?}", wrappers_in(&cwd));
}

#[test]
fn a_discard_intent_is_durable_with_the_reconciliation_and_finishes_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let mut d = Daemon::open(&root, fs.clone(), Arc::new(NoCrash), &cwd, 1);
    d.connect();
    d.frame(Payload::Dispatch(dispatch(1, text_spec("echo once"), 1)));
    d.supervise_all();
    assert_eq!(
        lifecycles(&d.events_of(&issue(1))).last(),
        Some(&(wire::Lifecycle::Succeeded as i32))
    );
    // the acknowledgement never arrives; after a restart the server says
    // it holds the terminal record, and the daemon dies right after
    // committing that
    d.store.close_as_crashed();
    let mut d = Daemon::open(&root, fs.clone(), Arc::new(NoCrash), &cwd, 2);
    d.store
        .set_crash_hook(Arc::new(StopAt::new(crash::RECONCILE_AFTER_COMMIT)));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        d.connect_with(&[], &[issue(1)]);
    }));
    assert!(
        crashed.is_err(),
        "the reconciliation commit was never reached"
    );
    d.store.close_as_crashed();
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    // the next start finishes it without a session
    let d = Daemon::open(&root, fs, Arc::new(NoCrash), &cwd, 3);
    let c = d.store.counters().unwrap();
    assert_eq!((c.commands, c.tombstones), (0, 1));
    assert_eq!(d.side_effects().len(), 1, "it ran once");
}

/// The reason of the terminal lifecycle change in `events`.
fn end_reason(events: &[wire::CommandEvent]) -> Option<(i32, String)> {
    events.iter().find_map(|e| match &e.body {
        Some(Body::Lifecycle(l)) if l.exit_result.is_some() || !l.reason.is_empty() => {
            Some((l.lifecycle, l.reason.clone()))
        }
        _ => None,
    })
}

/// `exec.allowed_cwd_roots` holds for the wrapper file too: a working
/// directory inside an allowed root that is a symbolic link out of it is
/// accepted (the path is lexically under the root) but no wrapper file is
/// ever written where it leads; the launch fails permanently, naming what
/// it resolves to, and nothing runs. A link that stays inside the root gets
/// its wrapper in the resolved directory.
#[test]
fn no_wrapper_is_written_where_a_symlinked_working_directory_leads_outside_the_roots() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(cwd.join("inner")).unwrap();
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, cwd.join("escape")).unwrap();
    std::os::unix::fs::symlink(cwd.join("inner"), cwd.join("stays")).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let mut d = Daemon::open(
        &dir.path().join("state"),
        Arc::new(rvbox_storage::fs::RealFs),
        Arc::new(NoCrash),
        &cwd,
        1,
    );
    d.connect();
    let mut escaping = text_spec("echo escaped");
    escaping.cwd = format!("{cwd}/escape");
    d.frame(Payload::Dispatch(dispatch(1, escaping, 1)));
    assert_eq!(
        answers(&d.sent, &issue(1))[0].outcome,
        wire::AcceptOutcome::Positive as i32,
        "lexically under the root"
    );
    d.supervise_all();
    let (lifecycle, reason) = end_reason(&d.events_of(&issue(1))).expect("it ended");
    assert_eq!(lifecycle, wire::Lifecycle::Rejected as i32);
    assert!(
        reason.contains("outside every allowed root")
            && reason.contains(&outside.canonicalize().unwrap().display().to_string()),
        "{reason}"
    );
    assert!(
        wrappers_in(outside.to_str().unwrap()).is_empty(),
        "a wrapper was written outside the roots"
    );
    assert!(d.side_effects().is_empty(), "nothing ran");

    let mut staying = text_spec("echo stayed");
    staying.cwd = format!("{cwd}/stays");
    d.frame(Payload::Dispatch(dispatch(2, staying, 1)));
    // materialized: the wrapper is in the resolved directory
    let inner = format!("{cwd}/inner");
    assert_eq!(wrappers_in(&inner).len(), 1, "{:?}", wrappers_in(&inner));
    d.supervise_all();
    assert_eq!(
        lifecycles(&d.events_of(&issue(2))),
        vec![
            wire::Lifecycle::Running as i32,
            wire::Lifecycle::Succeeded as i32
        ]
    );
    assert_eq!(d.side_effects().len(), 1);
}
