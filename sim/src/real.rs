//! An honest simulated client that is the real client: the client cores
//! (`rvbox-client-core`) over the real client store (`rvbox-client-store`)
//! on the fault-injecting filesystem, with process execution by a
//! simulated supervisor behind the same `Supervisor` trait. The wrapper
//! adds only the ledger the invariant checker reads (acceptances, starts,
//! acknowledged events and their digests, outcomes) and the translation
//! between the simulated network and the core's inputs and outputs.
//!
//! A crash loses everything but the store: the store closes as a crash
//! leaves it, the filesystem loses what was not synced (or tears the last
//! write), and a new core starts from what the store holds, reaping every
//! recorded launch (the simulated trees died with the daemon).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{ClientCore, ClientCoreConfig, Input, Output};
use rvbox_client_core::ops::{AcceptOutcome, ClientCompletion, ClientOp, SuperviseOp};
use rvbox_client_core::process::{
    CommandProcessEvent, Exit, LaunchIdentity, LaunchSpec, ProcessEvent, Supervision,
};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::fs::{CrashMode, FaultyFs, StoreFs};
use rvbox_supervisor::{OrphanOutcome, Supervisor, SupervisorError};

use crate::client::{ClientConfig, ClientCounters, ClientEffect, ClientInput, Ledger};
use crate::invariants::content_digest;
use crate::net::{ConnId, Item, NetEvent};
use crate::rng::SimRng;
use crate::world::CrashedAt;

/// Crashes the client the next time its store passes the armed point.
#[derive(Debug, Default)]
pub struct ClientCrashHook {
    armed: std::sync::Mutex<Option<&'static str>>,
}

impl rvbox_storage::crash::CrashHook for ClientCrashHook {
    // the simulated crash unwinds out of the client store mid-step on
    // purpose; the real client catches exactly this payload and restarts
    #[allow(clippy::panic)]
    fn at(&self, point: &'static str) {
        let hit = self
            .armed
            .lock()
            .map(|mut a| {
                if *a == Some(point) {
                    *a = None;
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        if hit {
            std::panic::panic_any(CrashedAt(point));
        }
    }
}

/// Most sent-event digests kept for acknowledgements.
pub const MAX_SENT_DIGESTS: usize = 1_000_000;

#[derive(Debug, Clone)]
struct Proc {
    next_at: u64,
    chunks_left: u32,
    exit: Exit,
    running: bool,
}

/// Process execution in the simulator: a tree prints a few chunks over
/// simulated time and exits; signals end it at once.
#[derive(Debug)]
pub struct SimSupervisor {
    rng: SimRng,
    procs: BTreeMap<Uuid7, Proc>,
    ready: VecDeque<CommandProcessEvent>,
    now: u64,
    wall_epoch_ms: i64,
    max_chunks: u32,
    max_chunk: u32,
    max_step_ms: u64,
    fail_permille: u32,
    /// Commands released (user code ran), for the ledger.
    started: Vec<Uuid7>,
}

impl SimSupervisor {
    fn new(rng: SimRng, c: &ClientConfig) -> Self {
        Self {
            rng,
            procs: BTreeMap::new(),
            ready: VecDeque::new(),
            now: 0,
            wall_epoch_ms: c.wall_epoch_ms,
            max_chunks: c.max_output_chunks,
            max_chunk: c.max_chunk_raw_bytes.max(1),
            max_step_ms: c.max_step_ms,
            fail_permille: c.fail_permille,
            started: Vec::new(),
        }
    }

    fn wall(&self) -> i64 {
        self.wall_epoch_ms
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
    }

    fn push(&mut self, issue: Uuid7, event: ProcessEvent) {
        self.ready.push_back(CommandProcessEvent { issue, event });
    }

    /// The next time a tree does something.
    fn next_due(&self) -> Option<u64> {
        self.procs
            .values()
            .filter(|p| p.running)
            .map(|p| p.next_at)
            .min()
    }

    /// Moves every tree to `now`.
    fn advance(&mut self, now: u64) {
        self.now = now;
        let due: Vec<Uuid7> = self
            .procs
            .iter()
            .filter(|(_, p)| p.running && p.next_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for issue in due {
            for _ in 0..=self.max_chunks {
                let Some(p) = self.procs.get(&issue).cloned() else {
                    break;
                };
                if !p.running || p.next_at > now {
                    break;
                }
                if p.chunks_left > 0 {
                    let len =
                        usize::try_from(self.rng.range_inclusive(1..=u64::from(self.max_chunk)))
                            .unwrap_or(1);
                    let bytes = if self.rng.chance(500) {
                        b"sim output line 0123456789 abcdefghijklmnopqrstuvwxyz\n"
                            .iter()
                            .copied()
                            .cycle()
                            .take(len)
                            .collect()
                    } else {
                        self.rng.bytes(len)
                    };
                    let stream = if self.rng.chance(750) {
                        wire::OutputStream::Stdout
                    } else {
                        wire::OutputStream::Stderr
                    };
                    let step = self.rng.range_inclusive(0..=self.max_step_ms);
                    let observed_ms = self.wall();
                    self.push(
                        issue,
                        ProcessEvent::Output {
                            stream,
                            observed_ms,
                            bytes,
                        },
                    );
                    // now and then a pipe reader had to discard bytes (its
                    // hand-over was full): a loss run the spool records and
                    // closes into a CLIENT_OVERLOAD marker
                    if self.rng.chance(60) {
                        let raw_bytes = self.rng.range_inclusive(1..=256 * 1024);
                        let at = self.wall();
                        self.push(
                            issue,
                            ProcessEvent::Dropped {
                                stream,
                                raw_bytes,
                                first_ms: at,
                                last_ms: at,
                            },
                        );
                    }
                    // now and then the diagnostics sampler reports a
                    // change of the tree's progress state
                    if self.rng.chance(20) {
                        let suspected_hung = self.rng.chance(500);
                        self.push(
                            issue,
                            ProcessEvent::Diagnostics(wire::Diagnostics {
                                snapshot: None,
                                suspected_hung,
                                no_progress_since: None,
                            }),
                        );
                    }
                    if let Some(p) = self.procs.get_mut(&issue) {
                        p.chunks_left -= 1;
                        p.next_at = now.saturating_add(step);
                    }
                } else {
                    self.procs.remove(&issue);
                    self.push(issue, ProcessEvent::Exited(p.exit));
                    self.push(issue, ProcessEvent::Drained { incomplete: vec![] });
                }
            }
        }
    }
}

impl Supervisor for SimSupervisor {
    fn mode(&self) -> Supervision {
        Supervision::ProcessGroup
    }

    fn prepare(&mut self, spec: LaunchSpec) -> Result<(), SupervisorError> {
        let birth = self.rng.next_u64();
        self.push(
            spec.issue,
            ProcessEvent::Ready(LaunchIdentity {
                launcher_pid: 1000,
                process_group: 1000,
                birth_ticks: birth,
                cgroup: None,
            }),
        );
        Ok(())
    }

    fn release(&mut self, issue: &Uuid7) -> Result<(), SupervisorError> {
        let chunks =
            u32::try_from(self.rng.range_inclusive(0..=u64::from(self.max_chunks))).unwrap_or(0);
        let exit = if self.rng.chance(self.fail_permille) {
            Exit::Code(i32::try_from(self.rng.range_inclusive(1..=255)).unwrap_or(1))
        } else {
            Exit::Code(0)
        };
        let step = self.rng.range_inclusive(0..=self.max_step_ms);
        self.started.push(*issue);
        self.procs.insert(
            *issue,
            Proc {
                next_at: self.now.saturating_add(step),
                chunks_left: chunks,
                exit,
                running: true,
            },
        );
        self.push(*issue, ProcessEvent::Running);
        Ok(())
    }

    fn abort(&mut self, issue: &Uuid7) {
        self.procs.remove(issue);
        self.push(*issue, ProcessEvent::Drained { incomplete: vec![] });
    }

    fn signal(&mut self, issue: &Uuid7, kind: wire::SignalKind) -> wire::SignalOutcome {
        let n = match kind {
            wire::SignalKind::Hup => 1,
            wire::SignalKind::Int => 2,
            wire::SignalKind::Term => 15,
            wire::SignalKind::Kill => 9,
            wire::SignalKind::Usr1 => 10,
            wire::SignalKind::Usr2 => 12,
            wire::SignalKind::Unspecified => return wire::SignalOutcome::Failed,
        };
        if self.procs.remove(issue).is_some() {
            self.push(*issue, ProcessEvent::Exited(Exit::Signal(n)));
            self.push(*issue, ProcessEvent::Drained { incomplete: vec![] });
            wire::SignalOutcome::Delivered
        } else {
            wire::SignalOutcome::NoOpAfterExit
        }
    }

    fn write_stdin(
        &mut self,
        issue: &Uuid7,
        write_seq: u64,
        _: Vec<u8>,
    ) -> Result<(), SupervisorError> {
        if self.procs.contains_key(issue) {
            self.push(*issue, ProcessEvent::StdinWritten { write_seq });
        }
        Ok(())
    }

    fn close_stdin(&mut self, _: &Uuid7) {}

    fn snapshot(&self, _: &Uuid7) -> Option<wire::ResourceSnapshot> {
        None
    }

    fn reap_orphan(&mut self, _: &Uuid7, _: &LaunchIdentity) -> OrphanOutcome {
        // simulated trees die with the daemon
        OrphanOutcome::Gone
    }

    fn stop_all(&mut self) {
        self.procs.clear();
    }

    fn next_event(&mut self, _: Duration) -> Option<CommandProcessEvent> {
        self.ready.pop_front()
    }
}

/// The real client in the simulator.
#[derive(Debug)]
pub struct RealClient {
    config: ClientConfig,
    client_id: ClientId,
    root: PathBuf,
    fs: Arc<FaultyFs>,
    core: ClientCore,
    store: Option<ClientStore>,
    core_config: ClientCoreConfig,
    sup: SimSupervisor,
    rng: SimRng,
    conn: Option<ConnId>,
    effects: VecDeque<ClientEffect>,
    ledger: Ledger,
    counters: ClientCounters,
    sent: BTreeMap<(Uuid7, u64), [u8; 32]>,
    acked: BTreeMap<Uuid7, u64>,
    script_prefix: BTreeMap<Uuid7, u64>,
    hook: Arc<ClientCrashHook>,
    crashed: Option<(Option<ConnId>, &'static str)>,
    now: u64,
}

fn core_config(c: &ClientConfig, client_id: &ClientId) -> ClientCoreConfig {
    ClientCoreConfig {
        policy: AcceptPolicy {
            client_id: client_id.clone(),
            shells: vec![wire::ShellType::Sh, wire::ShellType::Bash],
            default_shell: wire::ShellType::Sh,
            profiles: vec![wire::ProfileFlag::Light],
            cwd_roots: vec!["/srv".into(), "/tmp".into()],
            default_cwd: "/srv".into(),
            max_running: c.max_running,
            max_queued: c.max_queued,
            closeout_reserve: 64 * 1024,
            storage_budget: 256 << 20,
        },
        link: LinkConfig {
            command_window: c.command_window_bytes,
            session_window: c.session_window_bytes,
            ..LinkConfig::default()
        },
        spool: SpoolLimits {
            command_window: c.command_window_bytes,
            session_window: c.session_window_bytes,
            ..SpoolLimits::default()
        },
        shell_paths: BTreeMap::from([
            (wire::ShellType::Sh as i32, "/bin/sh".into()),
            (wire::ShellType::Bash as i32, "/bin/bash".into()),
        ]),
        profiles: BTreeMap::new(),
        hello: wire::ClientHello::default(),
    }
}

fn hello(client_id: &ClientId, instance: &str, c: &ClientConfig) -> wire::ClientHello {
    wire::ClientHello {
        client_id: client_id.as_str().to_owned(),
        client_instance_id: instance.to_owned(),
        protocol_major: 1,
        supported_minors: vec![0],
        capabilities: Some(wire::Capabilities {
            platform: Some(wire::Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                os_release: "rvbox-sim".into(),
            }),
            software_version: concat!(env!("CARGO_PKG_VERSION"), "-sim").into(),
            shells: vec![
                wire::ShellCapability {
                    shell_type: wire::ShellType::Sh as i32,
                    platform_default: true,
                },
                wire::ShellCapability {
                    shell_type: wire::ShellType::Bash as i32,
                    platform_default: false,
                },
            ],
            profiles: vec![wire::ProfileFlag::Light as i32],
            max_running: c.max_running,
            max_queued: c.max_queued,
            supervision_mode: wire::SupervisionMode::Fallback as i32,
        }),
        cwd_policy: Some(wire::CwdPolicy {
            default_cwd: "/srv".into(),
            allowed_roots: vec!["/srv".into(), "/tmp".into()],
        }),
    }
}

/// A fixed entropy source from the seed, so one seed gives one run.
#[derive(Debug)]
struct SeedEntropy(std::sync::Mutex<SimRng>);

impl rvbox_storage::entropy::Entropy for SeedEntropy {
    fn fill(&self, buf: &mut [u8]) -> std::io::Result<()> {
        let mut r = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("entropy lock poisoned"))?;
        let bytes = r.bytes(buf.len());
        buf.copy_from_slice(&bytes);
        Ok(())
    }
}

impl RealClient {
    /// A fresh installation in `root` (its own state directory).
    ///
    /// # Errors
    /// When the store cannot be opened.
    pub fn new(config: ClientConfig, mut rng: SimRng, root: PathBuf) -> Result<Self, String> {
        let client_id =
            ClientId::parse("client_id", &config.client_id).map_err(|e| e.to_string())?;
        let fs = Arc::new(FaultyFs::new());
        let entropy = Arc::new(SeedEntropy(std::sync::Mutex::new(SimRng::new(
            rng.next_u64(),
        ))));
        let hook = Arc::new(ClientCrashHook::default());
        let store = Self::open_store(&root, &fs, entropy, hook.clone())?;
        let sup = SimSupervisor::new(SimRng::new(rng.next_u64()), &config);
        let mut cc = core_config(&config, &client_id);
        let instance = store
            .instance_id()
            .map(|i| i.to_string())
            .ok_or("the fresh store has no identity")?;
        cc.hello = hello(&client_id, &instance, &config);
        let core = Self::start_core(&cc, &store, rng.next_u64())?;
        let mut c = Self {
            config,
            client_id,
            root,
            fs,
            core,
            store: Some(store),
            core_config: cc,
            sup,
            rng,
            conn: None,
            effects: VecDeque::new(),
            ledger: Ledger::default(),
            counters: ClientCounters::default(),
            sent: BTreeMap::new(),
            acked: BTreeMap::new(),
            script_prefix: BTreeMap::new(),
            hook,
            crashed: None,
            now: 0,
        };
        c.settle();
        Ok(c)
    }

    fn open_store(
        root: &std::path::Path,
        fs: &Arc<FaultyFs>,
        entropy: Arc<SeedEntropy>,
        hook: Arc<ClientCrashHook>,
    ) -> Result<ClientStore, String> {
        ClientStore::open_with_hook(
            ClientLayout::new(root),
            fs.clone() as Arc<dyn StoreFs>,
            entropy,
            hook,
            ClientStoreOptions {
                tombstone_cap: 100_000,
                ..ClientStoreOptions::default()
            },
            0,
        )
        .map_err(|e| format!("client store: {e}"))
    }

    fn start_core(
        cc: &ClientCoreConfig,
        store: &ClientStore,
        seed: u64,
    ) -> Result<ClientCore, String> {
        let records = store.restore_records().map_err(|e| e.to_string())?;
        let spool = store.restore_spool().map_err(|e| e.to_string())?;
        let floor = store.last_generation().map_err(|e| e.to_string())?;
        ClientCore::new(cc.clone(), records, spool, floor, seed, 0).map_err(|e| e.to_string())
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The client id.
    #[must_use]
    pub fn client_id(&self) -> &str {
        self.client_id.as_str()
    }

    /// The ledger.
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The ledger, to take new records from.
    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// The counters.
    #[must_use]
    pub fn counters(&self) -> &ClientCounters {
        &self.counters
    }

    /// The next effect.
    pub fn poll_effect(&mut self) -> Option<ClientEffect> {
        self.effects.pop_front()
    }

    /// When [`Self::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        match (self.core.poll_timeout(), self.sup.next_due()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn wall(&self) -> i64 {
        self.config
            .wall_epoch_ms
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
    }

    /// Feeds one input at `now`.
    pub fn handle(&mut self, now: u64, input: ClientInput) {
        self.now = now;
        let input = match input {
            ClientInput::Connected(conn) => {
                self.conn = Some(conn);
                self.counters.connects = self.counters.connects.saturating_add(1);
                Input::Opened
            }
            ClientInput::ConnectFailed => {
                self.counters.connect_failures = self.counters.connect_failures.saturating_add(1);
                Input::Closed(None)
            }
            ClientInput::Delivered { conn, event } => {
                if self.conn != Some(conn) {
                    return;
                }
                match event {
                    NetEvent::Opened => return,
                    NetEvent::Closed { .. } => {
                        self.conn = None;
                        Input::Closed(None)
                    }
                    NetEvent::Item(Item::Close { code }) => {
                        self.conn = None;
                        Input::Closed(Some(code))
                    }
                    NetEvent::Item(Item::Ping) => Input::Ping,
                    NetEvent::Item(Item::Pong) => Input::Pong,
                    NetEvent::Item(Item::Binary(bytes)) => {
                        self.observe_inbound(&bytes);
                        Input::Frame(bytes)
                    }
                }
            }
        };
        self.core.handle(now, self.wall(), input);
        self.settle();
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: u64) {
        self.now = now;
        self.sup.advance(now);
        self.core.handle_timeout(now, self.wall());
        self.settle();
    }

    /// Acknowledgements the server sent: the ledger records each
    /// acknowledged event with the digest of what was sent under its
    /// sequence.
    fn observe_inbound(&mut self, bytes: &[u8]) {
        let Ok(env) = wire::Envelope::decode(bytes) else {
            return;
        };
        let acks: Vec<(String, u64)> = match env.payload {
            Some(Payload::EventAck(a)) => vec![(a.issue_uuid, a.durable_event_seq)],
            Some(Payload::ReconcileResult(r)) => r
                .resume
                .into_iter()
                .map(|row| (row.issue_uuid, row.durable_event_seq))
                .collect(),
            _ => return,
        };
        for (id, upto) in acks {
            let Ok(issue) = Uuid7::parse("ack", &id) else {
                continue;
            };
            let from = self.acked.get(&issue).copied().unwrap_or(0);
            for seq in from.saturating_add(1)..=upto {
                if let Some(d) = self.sent.remove(&(issue, seq)) {
                    self.ledger.note_ack_pub(issue, seq, d);
                    self.counters.events_acked = self.counters.events_acked.saturating_add(1);
                }
            }
            if upto > from {
                self.acked.insert(issue, upto);
            }
        }
    }

    fn send(&mut self, item: Item) {
        if let Some(conn) = self.conn {
            self.effects.push_back(ClientEffect::Send { conn, item });
        }
    }

    fn settle(&mut self) {
        for _ in 0..1_000_000 {
            if let Some(ev) = self.sup.next_event(Duration::ZERO) {
                self.core.handle(self.now, self.wall(), Input::Process(ev));
                continue;
            }
            for issue in std::mem::take(&mut self.sup.started) {
                self.ledger.note_start_pub(issue);
                self.counters.started = self.counters.started.saturating_add(1);
            }
            let Some(out) = self.core.poll_output() else {
                if self.sup.ready.is_empty() {
                    return;
                }
                continue;
            };
            self.perform(out);
        }
    }

    fn perform(&mut self, out: Output) {
        match out {
            Output::Dial => {
                self.conn = None;
                self.effects.push_back(ClientEffect::Connect);
            }
            Output::Send(b) => self.send(Item::Binary(b)),
            Output::SendPing => {
                self.counters.pings = self.counters.pings.saturating_add(1);
                self.send(Item::Ping);
            }
            Output::SendPong => self.send(Item::Pong),
            Output::Close(code) => {
                self.send(Item::Close { code });
                self.conn = None;
            }
            Output::SendEvents {
                issue,
                first_seq,
                last_seq,
                session_id,
                generation,
            } => match self
                .store
                .as_mut()
                .ok_or(())
                .and_then(|s| s.read_events(&issue, first_seq, last_seq).map_err(|_| ()))
            {
                Ok(events) => {
                    for e in events {
                        if let Ok(d) = content_digest(&e)
                            && self.sent.len() < MAX_SENT_DIGESTS
                        {
                            self.sent.insert((issue, e.event_seq), d);
                        }
                        if let Some(Body::Lifecycle(l)) = &e.body
                            && let Ok(lc) = Lifecycle::from_wire(l.lifecycle)
                            && lc.is_terminal()
                        {
                            self.ledger.note_outcome_pub(issue, lc);
                        }
                        let env = wire::Envelope {
                            session_id: session_id.clone(),
                            generation,
                            payload: Some(Payload::CommandEvent(e)),
                        };
                        self.counters.events_sent = self.counters.events_sent.saturating_add(1);
                        self.send(Item::Binary(env.encode_to_vec()));
                    }
                }
                Err(_) => {
                    self.core.handle(self.now, self.wall(), Input::Closed(None));
                }
            },
            Output::Store(token, op) => {
                let done = match &op {
                    // process execution is simulated: no wrapper file
                    ClientOp::Materialize { issue, .. } => ClientCompletion::Materialized {
                        wrapper_path: format!("/srv/.rvbox-{issue}.sh"),
                    },
                    // a local storage failure before the acceptance commits
                    // (the step leaves nothing; the core answers it as a
                    // transient refusal)
                    ClientOp::Accept(_) if self.rng.chance(self.config.transient_permille) => {
                        self.counters.transient_refusals =
                            self.counters.transient_refusals.saturating_add(1);
                        ClientCompletion::Failed("injected local storage failure".into())
                    }
                    _ => {
                        let wall = self.wall();
                        let policy = &self.core_config.policy;
                        let store = &mut self.store;
                        let r =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match store
                                .as_mut()
                            {
                                Some(s) => s.perform(policy, &op, wall),
                                None => ClientCompletion::Failed("no store".into()),
                            }));
                        match r {
                            Ok(done) => done,
                            Err(payload) => {
                                let point = payload
                                    .downcast_ref::<CrashedAt>()
                                    .map_or("unknown", |c| c.0);
                                self.crash_at_point(point);
                                return;
                            }
                        }
                    }
                };
                if let (ClientOp::Accept(d), ClientCompletion::Accepted(AcceptOutcome::New)) =
                    (&op, &done)
                {
                    self.ledger.note_accept_pub(d.issue);
                    self.counters.accepted = self.counters.accepted.saturating_add(1);
                }
                if let ClientCompletion::Script(rvbox_client_core::ops::ScriptOutcome::Committed) =
                    &done
                {
                    self.counters.scripts_committed =
                        self.counters.scripts_committed.saturating_add(1);
                }
                if let (
                    ClientOp::ScriptChunk { issue, chunk },
                    ClientCompletion::Script(
                        o @ (rvbox_client_core::ops::ScriptOutcome::Received { .. }
                        | rvbox_client_core::ops::ScriptOutcome::Committed),
                    ),
                ) = (&op, &done)
                {
                    self.counters.script_chunks_accepted =
                        self.counters.script_chunks_accepted.saturating_add(1);
                    let prefix = self.script_prefix.get(issue).copied().unwrap_or(0);
                    if chunk.offset < prefix {
                        self.counters.script_chunk_replays =
                            self.counters.script_chunk_replays.saturating_add(1);
                    }
                    if let rvbox_client_core::ops::ScriptOutcome::Received { received } = o {
                        self.script_prefix.insert(*issue, prefix.max(*received));
                    } else {
                        self.script_prefix.remove(issue);
                    }
                }
                self.core
                    .handle(self.now, self.wall(), Input::Completion(token, done));
            }
            Output::Supervise(op) => self.supervise(op),
        }
    }

    fn supervise(&mut self, op: SuperviseOp) {
        match op {
            SuperviseOp::Prepare(spec) => {
                let _ = self.sup.prepare(*spec);
            }
            SuperviseOp::Release(issue) => {
                let _ = self.sup.release(&issue);
            }
            SuperviseOp::Abort(issue) => self.sup.abort(&issue),
            SuperviseOp::Signal {
                issue,
                kind,
                revision,
            } => {
                let outcome = self.sup.signal(&issue, kind);
                self.core.handle(
                    self.now,
                    self.wall(),
                    Input::Signalled {
                        issue,
                        kind,
                        revision,
                        outcome,
                    },
                );
            }
            SuperviseOp::WriteStdin {
                issue,
                write_seq,
                bytes,
            } => {
                let _ = self.sup.write_stdin(&issue, write_seq, bytes);
            }
            SuperviseOp::CloseStdin(issue) => self.sup.close_stdin(&issue),
            SuperviseOp::Reap { issue, identity } => {
                let gone = matches!(
                    self.sup.reap_orphan(&issue, &identity),
                    OrphanOutcome::Gone | OrphanOutcome::Killed
                );
                self.core
                    .handle(self.now, self.wall(), Input::Reaped { issue, gone });
            }
            SuperviseOp::StopAll => self.sup.stop_all(),
        }
    }

    /// The store panicked at a crash point: the daemon dies there (the
    /// world is told through [`Self::take_crashed`]).
    fn crash_at_point(&mut self, point: &'static str) {
        let now = self.now;
        let conn = self.crash_restart(now);
        self.crashed = Some((conn, point));
    }

    /// Arms a crash at `point` (the next time the store passes it).
    pub fn arm_crash(&mut self, point: &'static str) {
        if let Ok(mut a) = self.hook.armed.lock() {
            *a = Some(point);
        }
    }

    fn arm_crash_none(&mut self) {
        if let Ok(mut a) = self.hook.armed.lock() {
            *a = None;
        }
    }

    /// A crash at an armed point since the last call, with the connection
    /// that was open.
    pub fn take_crashed(&mut self) -> Option<(Option<ConnId>, &'static str)> {
        self.crashed.take()
    }

    /// The daemon crashes (and the host may lose power) at `now`: the
    /// store closes as a crash leaves it, un-synced bytes go (some of the
    /// last write may stay), and a new core starts from the store. Returns
    /// the connection that was open.
    pub fn crash_restart(&mut self, now: u64) -> Option<ConnId> {
        self.now = now;
        let conn = self.conn.take();
        self.counters.crashes = self.counters.crashes.saturating_add(1);
        let mode = if self.rng.chance(500) {
            CrashMode::LoseUnsynced
        } else {
            CrashMode::Tear {
                keep: self.rng.range_inclusive(0..=512),
            }
        };
        let entropy = Arc::new(SeedEntropy(std::sync::Mutex::new(SimRng::new(
            self.rng.next_u64(),
        ))));
        // a crashed store closes without a checkpoint, as a power cut
        // leaves it
        if let Some(old) = self.store.take() {
            old.close_as_crashed();
        }
        let _ = self.fs.crash(mode);
        match Self::open_store(&self.root, &self.fs, entropy, self.hook.clone()) {
            Ok(s) => self.store = Some(s),
            Err(_) => {
                self.counters.server_violations = self.counters.server_violations.saturating_add(1);
                return conn;
            }
        }
        self.sup.procs.clear();
        self.sup.ready.clear();
        let started = match self.store.as_ref() {
            Some(store) => Self::start_core(&self.core_config, store, self.rng.next_u64()),
            None => return conn,
        };
        match started {
            Ok(core) => self.core = core,
            Err(_) => return conn,
        }
        self.effects.clear();
        self.sent.clear();
        self.acked.clear();
        self.script_prefix.clear();
        self.settle();
        conn
    }
}

/// A client of the world: the model (adversaries, second instances) or the
/// real client cores (honest clients).
#[derive(Debug)]
pub enum AnyClient {
    /// The model client of `crate::client`.
    Model(Box<crate::client::SimClient>),
    /// The real client.
    Real(Box<RealClient>),
}

impl AnyClient {
    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ClientConfig {
        match self {
            Self::Model(c) => c.config(),
            Self::Real(c) => c.config(),
        }
    }

    /// True for the real client.
    #[must_use]
    pub fn is_real(&self) -> bool {
        matches!(self, Self::Real(_))
    }

    /// The client id.
    #[must_use]
    pub fn client_id(&self) -> &str {
        match self {
            Self::Model(c) => c.client_id(),
            Self::Real(c) => c.client_id(),
        }
    }

    /// The ledger.
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        match self {
            Self::Model(c) => c.ledger(),
            Self::Real(c) => c.ledger(),
        }
    }

    /// The ledger, mutably.
    pub fn ledger_mut(&mut self) -> &mut Ledger {
        match self {
            Self::Model(c) => c.ledger_mut(),
            Self::Real(c) => c.ledger_mut(),
        }
    }

    /// The counters.
    #[must_use]
    pub fn counters(&self) -> &ClientCounters {
        match self {
            Self::Model(c) => c.counters(),
            Self::Real(c) => c.counters(),
        }
    }

    /// Notes on server violations seen.
    #[must_use]
    pub fn violation_notes(&self) -> &[String] {
        match self {
            Self::Model(c) => c.violation_notes(),
            Self::Real(_) => &[],
        }
    }

    /// The next effect.
    pub fn poll_effect(&mut self) -> Option<ClientEffect> {
        match self {
            Self::Model(c) => c.poll_effect(),
            Self::Real(c) => c.poll_effect(),
        }
    }

    /// The next deadline.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        match self {
            Self::Model(c) => c.poll_timeout(),
            Self::Real(c) => c.poll_timeout(),
        }
    }

    /// One input.
    pub fn handle(&mut self, now: u64, input: ClientInput) {
        match self {
            Self::Model(c) => c.handle(now, input),
            Self::Real(c) => c.handle(now, input),
        }
    }

    /// Timers.
    pub fn handle_timeout(&mut self, now: u64) {
        match self {
            Self::Model(c) => c.handle_timeout(now),
            Self::Real(c) => c.handle_timeout(now),
        }
    }

    /// A crash and restart.
    pub fn crash_restart(&mut self, now: u64) -> Option<ConnId> {
        match self {
            Self::Model(c) => c.crash_restart(now),
            Self::Real(c) => c.crash_restart(now),
        }
    }

    /// A misbehaviour frame just sent (model adversaries only).
    pub fn take_misbehaviour(&mut self) -> Option<(ConnId, crate::client::Adversary, Vec<u8>)> {
        match self {
            Self::Model(c) => c.take_misbehaviour(),
            Self::Real(_) => None,
        }
    }

    /// Arms a crash at a named commit point (real clients only).
    pub fn arm_crash(&mut self, point: &'static str) -> bool {
        match self {
            Self::Model(_) => false,
            Self::Real(c) => {
                c.arm_crash(point);
                true
            }
        }
    }

    /// Disarms any armed crash point (the calm tail has no faults).
    pub fn disarm_crash(&mut self) {
        if let Self::Real(c) = self {
            c.arm_crash_none();
        }
    }

    /// A crash at an armed point since the last call.
    pub fn take_crashed(&mut self) -> Option<(Option<ConnId>, &'static str)> {
        match self {
            Self::Model(_) => None,
            Self::Real(c) => c.take_crashed(),
        }
    }

    /// A second installation claiming this client's id (always the model).
    ///
    /// # Errors
    /// When the configuration is out of bounds.
    pub fn second_instance(&self, rng: SimRng) -> Result<crate::client::SimClient, String> {
        match self {
            Self::Model(c) => Ok(c.second_instance(rng)),
            Self::Real(c) => {
                let mut config = c.config().clone();
                config.adversary = Some(crate::client::Adversary::SecondInstance);
                crate::client::SimClient::new(config, rng).map_err(|e| e.to_string())
            }
        }
    }
}
