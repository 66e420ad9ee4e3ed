//! A client host in the simulator: the real client runtime
//! (`rvbox_client_runtime::Runtime`, the same loop the `rvbox` daemon
//! runs) over the real client store on the fault-injecting filesystem,
//! with the simulated supervisor ([`crate::supervisor`]) behind the real
//! `Supervisor` trait, the simulator's clocks through the runtime's `Env`,
//! and its frames on the simulated network. An adversarial host is the
//! same real client with the [`crate::adversary`] layer on its outgoing
//! frames.
//!
//! The host adds only what the simulator observes: the ledger the
//! invariant checker reads (fresh acceptances, starts, acknowledged events
//! and the digests of what was sent under them, outcomes), counters, and
//! the violations the real client sees (a protocol violation by the
//! server, a store failure or incident that no injected fault explains).
//!
//! A crash loses everything but the store and the simulator's
//! observations: the store closes as a crash leaves it, the filesystem
//! loses what was not synced (or tears the last write), the trees die, and
//! a new runtime starts from what the store holds.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{ClientCoreConfig, Input};
use rvbox_client_core::ops::{AcceptOutcome, ClientCompletion, ClientOp, ScriptOutcome};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_client_runtime::{Env, Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_domain::limits::{
    DEFAULT_CLIENT_MAX_QUEUED, DEFAULT_CLIENT_MAX_RUNNING, DEFAULT_COMMAND_SEND_WINDOW_BYTES,
    DEFAULT_SESSION_SEND_WINDOW_BYTES,
};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::fs::{CrashMode, FaultyFs, StoreFs};

pub use crate::adversary::Adversary;
use crate::adversary::AdversaryLayer;
use crate::invariants::content_digest;
use crate::net::{ConnId, Item, NetEvent};
use crate::rng::SimRng;
use crate::supervisor::{Programs, SharedLog, SimSupervisor};
use crate::world::CrashedAt;

/// Most UUIDs the ledger tracks for acceptances and starts.
pub const MAX_LEDGER_COMMANDS: usize = 1_000_000;
/// Most acknowledged events waiting in the ledger for the checker.
pub const MAX_LEDGER_NEW_ACKS: usize = 1_000_000;
/// Most sent-event digests kept for acknowledgements.
pub const MAX_SENT_DIGESTS: usize = 1_000_000;
/// Most server-violation notes kept for the report.
pub const MAX_VIOLATION_NOTES: usize = 16;
/// Most process events one drain of the supervisor hands the runtime.
pub const MAX_PUMPS: usize = 100_000;

/// Configuration of one simulated host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// The client id (host-name text).
    pub client_id: String,
    /// `exec.max_running`.
    pub max_running: u32,
    /// `exec.max_queued`.
    pub max_queued: u32,
    /// Chance (per mille) that an acceptance's transaction fails before it
    /// commits (a local storage failure; the refusal is transient).
    pub transient_permille: u32,
    /// The programs the supervisor runs.
    pub programs: Programs,
    /// Wall-clock UTC milliseconds at simulated time 0.
    pub wall_epoch_ms: i64,
    /// Own per-command send window.
    pub command_window_bytes: u64,
    /// Own per-session send window.
    pub session_window_bytes: u64,
    /// The server's per-command window (an overrun is sized to it).
    pub server_command_window_bytes: u64,
    /// Misbehaviour, if any.
    pub adversary: Option<Adversary>,
    /// Chance per opportunity that the misbehaviour fires.
    pub adversary_permille: u32,
    /// Tombstone FIFO length of the client's store.
    pub tombstone_cap: u64,
    /// The first start crashes while it writes the new identity.
    pub crash_at_birth: bool,
    /// Durable compressed output one command and the daemon keep in the
    /// spool before the oldest segment rotates into a `CLIENT_SPOOL`
    /// record (None: the real defaults). A host with its own caps also
    /// takes a per-command raw backlog up to the daemon's high watermark
    /// before it drops output, so a burst reaches the spool whole and the
    /// rolling cap, not loss mode, bounds it.
    pub spool_output: Option<(u64, u64)>,
}

impl ClientConfig {
    /// Defaults: the real client's capacity and windows, short commands.
    #[must_use]
    pub fn new(client_id: impl Into<String>) -> Self {
        Self {
            client_id: client_id.into(),
            max_running: u32::try_from(DEFAULT_CLIENT_MAX_RUNNING).unwrap_or(16),
            max_queued: u32::try_from(DEFAULT_CLIENT_MAX_QUEUED).unwrap_or(100),
            transient_permille: 0,
            programs: Programs::default(),
            wall_epoch_ms: 1_800_000_000_000,
            command_window_bytes: DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            session_window_bytes: DEFAULT_SESSION_SEND_WINDOW_BYTES,
            server_command_window_bytes: DEFAULT_COMMAND_SEND_WINDOW_BYTES,
            adversary: None,
            tombstone_cap: 100_000,
            crash_at_birth: false,
            spool_output: None,
            adversary_permille: 0,
        }
    }
}

/// What the world tells a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientInput {
    /// The [`ClientEffect::Connect`] succeeded with this connection.
    Connected(ConnId),
    /// The [`ClientEffect::Connect`] failed (partition, refused).
    ConnectFailed,
    /// The network delivered something to this host.
    Delivered {
        /// The connection.
        conn: ConnId,
        /// What arrived.
        event: NetEvent,
    },
}

/// What a host asks the world to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEffect {
    /// Open a connection and answer with [`ClientInput::Connected`] or
    /// [`ClientInput::ConnectFailed`].
    Connect,
    /// Send an item on a connection (client to server).
    Send {
        /// The connection.
        conn: ConnId,
        /// The item.
        item: Item,
    },
}

/// One command acknowledgement recorded for the invariant checker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckedEvent {
    /// The command.
    pub issue: Uuid7,
    /// The acknowledged sequence.
    pub event_seq: u64,
    /// Content digest of what the client sent under that sequence.
    pub digest: [u8; 32],
}

/// What the invariant checker needs to know about a host. It is the
/// simulator's observation, not client state: it survives crashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    outcomes: BTreeMap<Uuid7, Lifecycle>,
    accepted: BTreeMap<Uuid7, u32>,
    starts: BTreeMap<Uuid7, u32>,
    new_accepts: Vec<Uuid7>,
    new_starts: Vec<Uuid7>,
    new_acks: Vec<AckedEvent>,
    acked_total: u64,
    overflowed: bool,
}

/// What a [`Ledger`] recorded since the last [`Ledger::take_new`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerDelta {
    /// Fresh positive acceptances, in order.
    pub accepts: Vec<Uuid7>,
    /// Process starts, in order.
    pub starts: Vec<Uuid7>,
    /// Acknowledged events, in order.
    pub acks: Vec<AckedEvent>,
}

impl Ledger {
    /// Fresh (non-repeat) positive acceptances per command; must be <= 1.
    #[must_use]
    pub fn accepted(&self) -> &BTreeMap<Uuid7, u32> {
        &self.accepted
    }

    /// Process starts per command; must be <= 1.
    #[must_use]
    pub fn starts(&self) -> &BTreeMap<Uuid7, u32> {
        &self.starts
    }

    /// The terminal lifecycle the client reported per command it ended.
    #[must_use]
    pub fn outcomes(&self) -> &BTreeMap<Uuid7, Lifecycle> {
        &self.outcomes
    }

    /// Acknowledged events not yet taken by the checker.
    #[must_use]
    pub fn pending_acks(&self) -> &[AckedEvent] {
        &self.new_acks
    }

    /// Takes everything recorded since the last call.
    pub fn take_new(&mut self) -> LedgerDelta {
        LedgerDelta {
            accepts: std::mem::take(&mut self.new_accepts),
            starts: std::mem::take(&mut self.new_starts),
            acks: std::mem::take(&mut self.new_acks),
        }
    }

    /// Every event ever acknowledged to this host.
    #[must_use]
    pub fn acked_total(&self) -> u64 {
        self.acked_total
    }

    /// True once a bound was hit and something went unrecorded.
    #[must_use]
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    fn bump(
        map: &mut BTreeMap<Uuid7, u32>,
        delta: &mut Vec<Uuid7>,
        issue: Uuid7,
        overflowed: &mut bool,
    ) {
        if (!map.contains_key(&issue) && map.len() >= MAX_LEDGER_COMMANDS)
            || delta.len() >= MAX_LEDGER_NEW_ACKS
        {
            *overflowed = true;
            return;
        }
        let n = map.entry(issue).or_insert(0);
        *n = n.saturating_add(1);
        delta.push(issue);
    }

    /// A fresh positive acceptance.
    pub fn note_accept(&mut self, issue: Uuid7) {
        Self::bump(
            &mut self.accepted,
            &mut self.new_accepts,
            issue,
            &mut self.overflowed,
        );
    }

    /// A process start (user code ran).
    pub fn note_start(&mut self, issue: Uuid7) {
        Self::bump(
            &mut self.starts,
            &mut self.new_starts,
            issue,
            &mut self.overflowed,
        );
    }

    /// An acknowledged event and the digest of what was sent under it.
    pub fn note_ack(&mut self, issue: Uuid7, event_seq: u64, digest: [u8; 32]) {
        self.acked_total = self.acked_total.saturating_add(1);
        if self.new_acks.len() >= MAX_LEDGER_NEW_ACKS {
            self.overflowed = true;
            return;
        }
        self.new_acks.push(AckedEvent {
            issue,
            event_seq,
            digest,
        });
    }

    /// The terminal lifecycle the client reported (the first one).
    pub fn note_outcome(&mut self, issue: Uuid7, to: Lifecycle) {
        self.outcomes.entry(issue).or_insert(to);
    }
}

/// Counters of what a host did and saw (conventions rule 7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientCounters {
    /// Connection attempts answered.
    pub connects: u64,
    /// Failed connection attempts.
    pub connect_failures: u64,
    /// Fresh positive acceptances.
    pub accepted: u64,
    /// Acceptances refused by an injected local storage failure.
    pub transient_refusals: u64,
    /// Processes started.
    pub started: u64,
    /// Events sent (replays included).
    pub events_sent: u64,
    /// Events acknowledged.
    pub events_acked: u64,
    /// Pings sent.
    pub pings: u64,
    /// Crash-restarts.
    pub crashes: u64,
    /// Orderly stops and restarts.
    pub restarts: u64,
    /// Misbehaviours performed (adversarial hosts).
    pub misbehaviours: u64,
    /// Server violations and unexplained local failures this host saw.
    pub server_violations: u64,
    /// Script chunks accepted (appending or exact replays).
    pub script_chunks_accepted: u64,
    /// Accepted script chunks that started below the durable prefix.
    pub script_chunk_replays: u64,
    /// Scripts whose whole length and SHA-256 were verified (committed).
    pub scripts_committed: u64,
    /// Replays of pinned events longer than one read-back of the spool.
    pub long_replays: u64,
    /// Terminal holders started while an earlier holder of the same
    /// terminal still ran (an unrecorded one, reclaimed).
    pub holders_replaced: u64,
}

/// Crashes the client the next time its store passes one of the armed
/// points (each fires once; several may be armed, so a rarely passed one
/// stays armed while others come and go), and remembers every point the
/// store passed, armed or not (the seed batch's coverage).
#[derive(Debug, Default)]
pub struct ClientCrashHook {
    armed: std::sync::Mutex<Vec<&'static str>>,
    passed: std::sync::Mutex<std::collections::BTreeSet<&'static str>>,
}

impl rvbox_storage::crash::CrashHook for ClientCrashHook {
    // the simulated crash unwinds out of the client store mid-step on
    // purpose; the host catches exactly this payload and restarts
    #[allow(clippy::panic)]
    fn at(&self, point: &'static str) {
        if let Ok(mut p) = self.passed.lock() {
            p.insert(point);
        }
        let hit = self
            .armed
            .lock()
            .map(|mut a| {
                let before = a.len();
                a.retain(|p| *p != point);
                a.len() != before
            })
            .unwrap_or(false);
        if hit {
            std::panic::panic_any(CrashedAt(point));
        }
    }
}

/// The simulator's environment of one runtime: its clocks, the storage
/// failures it injects before an acceptance commits, and what it observes
/// of each store operation.
#[derive(Debug, Clone)]
pub struct SimEnv {
    now: u64,
    wall_epoch_ms: i64,
    rng: SimRng,
    transient_permille: u32,
    /// Fresh acceptances since the last take.
    accepted: Vec<Uuid7>,
    /// Injected acceptance failures so far.
    injected: u64,
    script_prefix: BTreeMap<Uuid7, u64>,
    script_chunks_accepted: u64,
    script_chunk_replays: u64,
    scripts_committed: u64,
    /// Commands whose terminal event the spool made durable.
    ended_durable: BTreeSet<Uuid7>,
    /// Signal results the spool made durable since this daemon started,
    /// per command.
    results_durable: BTreeMap<Uuid7, u32>,
    /// Terminals whose holder record the store made durable.
    holders_recorded: BTreeSet<Uuid7>,
    /// Terminals whose closed record the store made durable.
    terminals_closed: BTreeSet<Uuid7>,
}

impl Env for SimEnv {
    fn now_ms(&self) -> u64 {
        self.now
    }

    fn wall_ms(&self) -> i64 {
        self.wall_epoch_ms
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
    }

    fn intercept(&mut self, op: &ClientOp) -> Option<ClientCompletion> {
        if matches!(op, ClientOp::Accept(_)) && self.rng.chance(self.transient_permille) {
            // a local storage failure before the acceptance commits: the
            // step leaves nothing, the refusal is transient
            self.injected = self.injected.saturating_add(1);
            return Some(ClientCompletion::Failed(
                "injected local storage failure".into(),
            ));
        }
        None
    }

    fn completed(&mut self, op: &ClientOp, done: &ClientCompletion) {
        match (op, done) {
            (ClientOp::Accept(d), ClientCompletion::Accepted(AcceptOutcome::New)) => {
                self.accepted.push(d.issue);
            }
            (ClientOp::Ended { issue, .. }, ClientCompletion::Done) => {
                self.ended_durable.insert(*issue);
            }
            (ClientOp::TerminalOpened { terminal, .. }, ClientCompletion::Done) => {
                self.holders_recorded.insert(*terminal);
            }
            (ClientOp::TerminalClosed { terminal, .. }, ClientCompletion::Done) => {
                self.terminals_closed.insert(*terminal);
            }
            (ClientOp::Spool(op), ClientCompletion::Spool(done))
                if !matches!(done, rvbox_client_core::spool::SpoolCompletion::Failed) =>
            {
                if let rvbox_client_core::spool::SpoolOp::Append {
                    issue,
                    item:
                        rvbox_client_core::spool::AppendItem::Event(
                            wire::command_event::Body::SignalResult(_),
                        ),
                    ..
                } = op.as_ref()
                {
                    *self.results_durable.entry(*issue).or_default() += 1;
                }
            }
            (ClientOp::ScriptChunk { issue, chunk }, ClientCompletion::Script(o)) => match o {
                ScriptOutcome::Received { received } => {
                    self.script_chunks_accepted += 1;
                    let prefix = self.script_prefix.get(issue).copied().unwrap_or(0);
                    if chunk.offset < prefix {
                        self.script_chunk_replays += 1;
                    }
                    self.script_prefix.insert(*issue, prefix.max(*received));
                }
                ScriptOutcome::Committed => {
                    self.script_chunks_accepted += 1;
                    self.scripts_committed += 1;
                    self.script_prefix.remove(issue);
                }
                _ => {}
            },
            _ => {}
        }
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

type Rt = Runtime<SimSupervisor, SimEnv>;

/// The core's failure counts the host watches for violations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Watched {
    violations: u64,
    protocol_errors: u64,
    store_failures: u64,
    stray_completions: u64,
    unaccountable: u64,
}

/// One simulated client host.
#[derive(Debug)]
pub struct SimHost {
    index: u32,
    config: ClientConfig,
    client_id: ClientId,
    root: PathBuf,
    work: PathBuf,
    fs: Arc<FaultyFs>,
    hook: Arc<ClientCrashHook>,
    core_config: ClientCoreConfig,
    rng: SimRng,
    rt: Option<Rt>,
    conn: Option<ConnId>,
    effects: VecDeque<ClientEffect>,
    ledger: Ledger,
    counters: ClientCounters,
    sent: BTreeMap<(Uuid7, u64), [u8; 32]>,
    acked: BTreeMap<Uuid7, u64>,
    adversary: Option<AdversaryLayer>,
    misbehaviour: Option<(ConnId, Adversary, Vec<u8>)>,
    crashed: VecDeque<(Option<ConnId>, &'static str)>,
    /// Unexpected panic (not a crash point): the world fails the run.
    panicked: Option<String>,
    watched: Watched,
    injected_before: u64,
    notes: Vec<String>,
    now: u64,
}

fn core_config(c: &ClientConfig, client_id: &ClientId, work: &Path) -> ClientCoreConfig {
    let cwd = work.to_string_lossy().into_owned();
    ClientCoreConfig {
        policy: AcceptPolicy {
            client_id: client_id.clone(),
            shells: vec![wire::ShellType::Sh, wire::ShellType::Bash],
            default_shell: wire::ShellType::Sh,
            profiles: vec![wire::ProfileFlag::Light],
            cwd_roots: vec![cwd.clone()],
            default_cwd: cwd,
            max_running: c.max_running,
            max_queued: c.max_queued,
            closeout_reserve: 64 * 1024,
            storage_budget: 256 << 20,
            // the simulated disk is never short of space
            command_total: 32 << 20,
            command_streams: 11 << 20,
            free_space_floor: 0,
        },
        link: LinkConfig {
            command_window: c.command_window_bytes,
            session_window: c.session_window_bytes,
            ..LinkConfig::default()
        },
        spool: SpoolLimits {
            command_window: c.command_window_bytes,
            session_window: c.session_window_bytes,
            output_window: c
                .spool_output
                .map_or(SpoolLimits::default().output_window, |o| o.0),
            daemon_output: c
                .spool_output
                .map_or(SpoolLimits::default().daemon_output, |o| o.1),
            command_high: c
                .spool_output
                .map_or(SpoolLimits::default().command_high, |_| {
                    SpoolLimits::default().daemon_high
                }),
            ..SpoolLimits::default()
        },
        shell_paths: BTreeMap::from([
            (wire::ShellType::Sh as i32, "/bin/sh".into()),
            (wire::ShellType::Bash as i32, "/bin/bash".into()),
        ]),
        profiles: BTreeMap::new(),
        hello: wire::ClientHello::default(),
        terminals: rvbox_client_core::machine::TerminalLimits::default(),
    }
}

fn hello(client_id: &ClientId, instance: &str, c: &ClientConfig, work: &Path) -> wire::ClientHello {
    let cwd = work.to_string_lossy().into_owned();
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
            default_cwd: cwd.clone(),
            allowed_roots: vec![cwd],
        }),
        // host-N: parity=N%2, for the fleet workload's label selectors
        labels: client_id
            .as_str()
            .strip_prefix("host-")
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| {
                vec![wire::Label {
                    key: "parity".into(),
                    value: (n % 2).to_string(),
                }]
            })
            .unwrap_or_default(),
    }
}

fn open_store(
    root: &Path,
    fs: &Arc<FaultyFs>,
    seed: u64,
    hook: Arc<ClientCrashHook>,
    tombstone_cap: u64,
) -> Result<ClientStore, String> {
    ClientStore::open_with_hook(
        ClientLayout::new(root.join("state")),
        fs.clone() as Arc<dyn StoreFs>,
        Arc::new(SeedEntropy(std::sync::Mutex::new(SimRng::new(seed)))),
        hook,
        ClientStoreOptions {
            tombstone_cap,
            ..ClientStoreOptions::default()
        },
        0,
    )
    .map_err(|e| format!("client store: {e}"))
}

/// What a runtime call panicked with.
enum Unwound {
    Crash(&'static str),
    Other(String),
}

fn catch<T>(f: impl FnOnce() -> T) -> Result<T, Unwound> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        if let Some(c) = payload.downcast_ref::<CrashedAt>() {
            Unwound::Crash(c.0)
        } else if let Some(s) = payload.downcast_ref::<String>() {
            Unwound::Other(s.clone())
        } else if let Some(s) = payload.downcast_ref::<&str>() {
            Unwound::Other((*s).to_owned())
        } else {
            Unwound::Other("a panic without a message".into())
        }
    })
}

impl SimHost {
    /// A fresh installation of host `index` in `root`, its trees' records
    /// going to `log`.
    ///
    /// # Errors
    /// When the store cannot be opened or the runtime cannot start.
    pub fn new(
        index: u32,
        config: ClientConfig,
        mut rng: SimRng,
        root: PathBuf,
        log: SharedLog,
    ) -> Result<Self, String> {
        let client_id =
            ClientId::parse("client_id", &config.client_id).map_err(|e| e.to_string())?;
        let work = root.join("work");
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let fs = Arc::new(FaultyFs::new());
        let hook = Arc::new(ClientCrashHook::default());
        // the first start may die while it writes its new identity: the
        // next start finds no identity and makes one
        let mut born_crashed = VecDeque::new();
        if config.crash_at_birth {
            let point = rvbox_client_store::crash::IDENTITY_BEFORE_RENAME;
            if let Ok(mut a) = hook.armed.lock() {
                a.push(point);
            }
            let first = catch(|| {
                open_store(
                    &root,
                    &fs,
                    rng.next_u64(),
                    hook.clone(),
                    config.tombstone_cap,
                )
            });
            if let Ok(mut a) = hook.armed.lock() {
                a.clear();
            }
            match first {
                Err(Unwound::Crash(p)) => {
                    let keep = rng.range_inclusive(0..=512);
                    let _ = fs.crash(CrashMode::Tear { keep });
                    born_crashed.push_back((None, p));
                }
                Err(Unwound::Other(e)) => return Err(format!("client store: {e}")),
                Ok(opened) => drop(opened?),
            }
        }
        let store = open_store(
            &root,
            &fs,
            rng.next_u64(),
            hook.clone(),
            config.tombstone_cap,
        )?;
        let instance = store
            .instance_id()
            .map(|i| i.to_string())
            .ok_or("the fresh store has no identity")?;
        let mut cc = core_config(&config, &client_id, &work);
        cc.hello = hello(&client_id, &instance, &config, &work);
        let sup = SimSupervisor::new(
            index,
            SimRng::new(rng.next_u64()),
            config.programs,
            config.wall_epoch_ms,
            log,
        );
        let env = SimEnv {
            now: 0,
            wall_epoch_ms: config.wall_epoch_ms,
            rng: SimRng::new(rng.next_u64()),
            transient_permille: config.transient_permille,
            accepted: Vec::new(),
            injected: 0,
            script_prefix: BTreeMap::new(),
            script_chunks_accepted: 0,
            script_chunk_replays: 0,
            scripts_committed: 0,
            ended_durable: BTreeSet::new(),
            results_durable: BTreeMap::new(),
            holders_recorded: BTreeSet::new(),
            terminals_closed: BTreeSet::new(),
        };
        let adversary = config
            .adversary
            .filter(|k| *k != Adversary::SecondInstance)
            .map(|k| {
                AdversaryLayer::new(
                    k,
                    config.adversary_permille,
                    config.server_command_window_bytes,
                    SimRng::new(rng.next_u64()),
                )
            });
        let rt = Runtime::with_env(cc.clone(), store, sup, env, rng.next_u64())
            .map_err(|e| format!("client runtime: {e}"))?;
        let mut h = Self {
            index,
            config,
            client_id,
            root,
            work,
            fs,
            hook,
            core_config: cc,
            rng,
            rt: Some(rt),
            conn: None,
            effects: VecDeque::new(),
            ledger: Ledger::default(),
            counters: ClientCounters::default(),
            sent: BTreeMap::new(),
            acked: BTreeMap::new(),
            adversary,
            misbehaviour: None,
            crashed: born_crashed,
            panicked: None,
            watched: Watched::default(),
            injected_before: 0,
            notes: Vec::new(),
            now: 0,
        };
        h.after_step();
        Ok(h)
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

    /// The host's working directory (its commands' cwd).
    #[must_use]
    pub fn work_dir(&self) -> &Path {
        &self.work
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

    /// Server violations and unexplained local failures seen, first ones.
    #[must_use]
    pub fn violation_notes(&self) -> &[String] {
        &self.notes
    }

    /// A panic of the real client that was no simulated crash.
    #[must_use]
    pub fn panicked(&self) -> Option<&str> {
        self.panicked.as_deref()
    }

    /// The runtime (its core and store, for counters and tests).
    #[must_use]
    pub fn runtime(&self) -> Option<&Rt> {
        self.rt.as_ref()
    }

    /// The next effect.
    pub fn poll_effect(&mut self) -> Option<ClientEffect> {
        self.effects.pop_front()
    }

    /// When [`Self::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        let rt = self.rt.as_ref()?;
        let core = rt.core().poll_timeout();
        let sup = rt.supervisor().next_due();
        let events = rt.supervisor().has_events().then_some(self.now);
        [core, sup, events].into_iter().flatten().min()
    }

    /// The earliest of the host's timers strictly after `now`: a timer
    /// already due (the core's, after it fired and stayed due) must not
    /// hide the trees' next write.
    #[must_use]
    pub fn next_wake_after(&self, now: u64) -> Option<u64> {
        let rt = self.rt.as_ref()?;
        let core = rt.core().poll_timeout();
        let sup = rt.supervisor().next_due();
        [core, sup].into_iter().flatten().filter(|t| *t > now).min()
    }

    fn wall(&self) -> i64 {
        self.config
            .wall_epoch_ms
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
    }

    fn set_now(&mut self, now: u64) {
        self.now = now;
        if let Some(rt) = self.rt.as_mut() {
            rt.env_mut().now = now;
            rt.supervisor_mut().set_now(now);
        }
    }

    /// Runs `f` on the runtime; a crash point's panic restarts the host.
    fn run(&mut self, f: impl FnOnce(&mut Rt)) {
        let Some(rt) = self.rt.as_mut() else {
            return;
        };
        match catch(|| f(rt)) {
            Ok(()) => {}
            Err(Unwound::Crash(point)) => {
                let conn = self.crash_restart(self.now);
                self.crashed.push_back((conn, point));
            }
            Err(Unwound::Other(msg)) => {
                if self.panicked.is_none() {
                    self.panicked = Some(msg);
                }
            }
        }
    }

    /// Hands the runtime every process event waiting, until none is left.
    fn pump(&mut self) {
        for _ in 0..MAX_PUMPS {
            let has = self
                .rt
                .as_ref()
                .is_some_and(|rt| rt.supervisor().has_events());
            if !has {
                return;
            }
            self.run(|rt| {
                rt.pump_processes(Duration::ZERO);
            });
        }
    }

    /// Feeds one input at `now`.
    pub fn handle(&mut self, now: u64, input: ClientInput) {
        self.set_now(now);
        let input = match input {
            ClientInput::Connected(conn) => {
                self.conn = Some(conn);
                self.counters.connects = self.counters.connects.saturating_add(1);
                if let Some(a) = self.adversary.as_mut() {
                    a.new_connection();
                }
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
        self.run(|rt| rt.input(input));
        self.pump();
        self.after_step();
    }

    /// Runs every timer due at `now`: the trees move on, their events go
    /// to the runtime, the core's timer fires.
    pub fn handle_timeout(&mut self, now: u64) {
        self.set_now(now);
        if let Some(rt) = self.rt.as_mut() {
            rt.supervisor_mut().advance(now);
        }
        self.pump();
        self.run(Rt::tick);
        self.pump();
        self.after_step();
    }

    /// An orderly stop (SIGTERM): the runtime closes its session with
    /// 1012 and stops every tree (TERM, then KILL for those that ignore
    /// it); the store closes cleanly and the daemon starts again. Returns
    /// the connection that was open.
    pub fn stop_restart(&mut self, now: u64) -> Option<ConnId> {
        self.set_now(now);
        self.counters.restarts = self.counters.restarts.saturating_add(1);
        self.run(|rt| rt.input(Input::Shutdown));
        self.pump();
        self.take_wire();
        let conn = self.conn.take();
        let Some(rt) = self.rt.take() else {
            return conn;
        };
        // what the stop spooled is durable; the store closes cleanly
        let (store, mut sup, mut env) = rt.into_parts();
        sup.daemon_died(
            &env.ended_durable,
            &env.results_durable,
            &env.terminals_closed,
        );
        env.results_durable.clear();
        drop(store);
        if let Err(e) = self.start_again(sup, env) {
            self.note(format!("restart after a stop failed: {e}"));
        }
        conn
    }

    fn start_again(&mut self, sup: SimSupervisor, env: SimEnv) -> Result<(), String> {
        let store_seed = self.rng.next_u64();
        // the store's recovery passes named points too
        let opened = catch(|| {
            open_store(
                &self.root,
                &self.fs,
                store_seed,
                self.hook.clone(),
                self.config.tombstone_cap,
            )
        });
        let store = match opened {
            Ok(r) => r?,
            Err(Unwound::Crash(point)) => {
                self.crashed.push_back((None, point));
                self.counters.crashes = self.counters.crashes.saturating_add(1);
                let keep = self.rng.range_inclusive(0..=512);
                let _ = self.fs.crash(CrashMode::Tear { keep });
                return self.start_again(sup, env);
            }
            Err(Unwound::Other(msg)) => return Err(msg),
        };
        let seed = self.rng.next_u64();
        let (sup2, env2) = (sup.clone(), env.clone());
        let started = catch(|| Runtime::with_env(self.core_config.clone(), store, sup, env, seed));
        if let Err(Unwound::Crash(point)) = &started {
            // the daemon died while it started (recovery passes named
            // points too): the next start recovers from that
            self.crashed.push_back((None, *point));
            self.counters.crashes = self.counters.crashes.saturating_add(1);
            let keep = self.rng.range_inclusive(0..=512);
            let _ = self.fs.crash(CrashMode::Tear { keep });
            return self.start_again(sup2, env2);
        }
        match started {
            Ok(Ok(rt)) => {
                self.rt = Some(rt);
                self.watched = Watched::default();
                self.effects.clear();
                self.sent.clear();
                self.acked.clear();
                self.pump();
                self.after_step();
                Ok(())
            }
            Ok(Err(e)) => Err(format!("client runtime: {e}")),
            Err(Unwound::Crash(point)) => Err(format!("crash point {point} armed at start")),
            Err(Unwound::Other(msg)) => Err(msg),
        }
    }

    fn note(&mut self, text: String) {
        self.counters.server_violations = self.counters.server_violations.saturating_add(1);
        if self.notes.len() < MAX_VIOLATION_NOTES {
            self.notes.push(text);
        }
    }

    /// After every step: the runtime's frames to the network, its new
    /// observations to the ledger, and what the real client saw go wrong.
    fn after_step(&mut self) {
        self.take_wire();
        let Some(rt) = self.rt.as_mut() else {
            return;
        };
        self.counters.long_replays = self
            .counters
            .long_replays
            .saturating_add(rt.take_long_replays());
        for issue in rt.supervisor_mut().take_started() {
            self.ledger.note_start(issue);
            self.counters.started = self.counters.started.saturating_add(1);
        }
        let replaced = rt.supervisor_mut().take_replaced();
        let mut second_holders = Vec::new();
        for id in replaced {
            self.counters.holders_replaced = self.counters.holders_replaced.saturating_add(1);
            let env = rt.env();
            // an unrecorded holder (its start died before its record) is
            // reclaimed by the next start; a recorded one is adopted, never
            // started again beside it
            if env.holders_recorded.contains(&id) && !env.terminals_closed.contains(&id) {
                second_holders.push(id);
            }
        }
        let env = rt.env_mut();
        for issue in std::mem::take(&mut env.accepted) {
            self.ledger.note_accept(issue);
            self.counters.accepted = self.counters.accepted.saturating_add(1);
        }
        self.counters.transient_refusals = env.injected;
        self.counters.script_chunks_accepted = env.script_chunks_accepted;
        self.counters.script_chunk_replays = env.script_chunk_replays;
        self.counters.scripts_committed = env.scripts_committed;
        let injected = env.injected;
        let core = rt.core();
        let link = core.link_stats();
        let stats = core.stats();
        let now = Watched {
            violations: link.violations,
            protocol_errors: stats.protocol_errors,
            store_failures: stats.store_failures,
            stray_completions: stats.stray_completions,
            unaccountable: stats.unaccountable,
        };
        let health = rt.store().health();
        let before = self.watched;
        let injected_now = injected.saturating_sub(self.injected_before);
        self.injected_before = injected;
        self.watched = now;
        if now.violations > before.violations {
            self.note("the server broke the protocol (the client closed its session)".into());
        }
        if now.protocol_errors > before.protocol_errors {
            self.note("the client found a protocol error in a server message".into());
        }
        if now.store_failures.saturating_sub(before.store_failures) > injected_now {
            self.note("a client store step failed with no injected fault to explain it".into());
        }
        if now.stray_completions > before.stray_completions {
            self.note("a completion the client core never asked for".into());
        }
        if now.unaccountable > before.unaccountable {
            self.note("a command's output could no longer be accounted for".into());
        }
        for id in second_holders {
            self.note(format!(
                "terminal {id} got a second holder while its recorded one ran"
            ));
        }
        match health {
            Ok(rvbox_client_store::LocalHealth::Ready) => {}
            Ok(_) => self.note("the client store has an open incident".into()),
            Err(e) => self.note(format!("the client store's health is unreadable: {e}")),
        }
    }

    fn take_wire(&mut self) {
        let Some(rt) = self.rt.as_mut() else {
            return;
        };
        let wire = rt.take_wire();
        for w in wire {
            match w {
                Wire::Dial => {
                    self.conn = None;
                    self.effects.push_back(ClientEffect::Connect);
                }
                // the simulated network has one ordered stream per
                // connection: the data lane goes in order with the rest
                Wire::Binary(b) | Wire::Data(b) => self.send_binary(b),
                Wire::Ping => {
                    self.counters.pings = self.counters.pings.saturating_add(1);
                    self.send(Item::Ping);
                }
                Wire::Pong => self.send(Item::Pong),
                Wire::Close(code) => {
                    self.send(Item::Close { code });
                    self.conn = None;
                }
            }
        }
    }

    fn send(&mut self, item: Item) {
        if let Some(conn) = self.conn {
            self.effects.push_back(ClientEffect::Send { conn, item });
        }
    }

    fn send_binary(&mut self, bytes: Vec<u8>) {
        let Some(conn) = self.conn else {
            return;
        };
        self.observe_outbound(&bytes);
        let frames = match self.adversary.as_mut() {
            Some(a) => {
                let m = a.outgoing(bytes);
                if let Some(first) = m.misbehaviour {
                    self.counters.misbehaviours = self.counters.misbehaviours.saturating_add(1);
                    self.misbehaviour = Some((conn, a.kind(), first));
                }
                m.frames
            }
            None => vec![bytes],
        };
        for f in frames {
            self.effects.push_back(ClientEffect::Send {
                conn,
                item: Item::Binary(f),
            });
        }
    }

    /// An event frame the real client sends: the digest of what it sent
    /// under each sequence, and the terminal outcome it reports.
    fn observe_outbound(&mut self, bytes: &[u8]) {
        let Ok(env) = wire::Envelope::decode(bytes) else {
            return;
        };
        let Some(Payload::CommandEvent(e)) = env.payload else {
            return;
        };
        let Ok(issue) = Uuid7::parse("issue_uuid", &e.issue_uuid) else {
            return;
        };
        self.counters.events_sent = self.counters.events_sent.saturating_add(1);
        if let Ok(d) = content_digest(&e)
            && self.sent.len() < MAX_SENT_DIGESTS
        {
            self.sent.insert((issue, e.event_seq), d);
        }
        if let Some(Body::Lifecycle(l)) = &e.body
            && let Ok(lc) = Lifecycle::from_wire(l.lifecycle)
            && lc.is_terminal()
        {
            self.ledger.note_outcome(issue, lc);
        }
    }

    /// Acknowledgements the server sent: the ledger records each
    /// acknowledged event with the digest of what was sent under it.
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
                    self.ledger.note_ack(issue, seq, d);
                    self.counters.events_acked = self.counters.events_acked.saturating_add(1);
                }
            }
            if upto > from {
                self.acked.insert(issue, upto);
            }
        }
    }

    /// A misbehaviour frame sent since the last call: the connection,
    /// the kind, and its first frame (the world checks the answer).
    pub fn take_misbehaviour(&mut self) -> Option<(ConnId, Adversary, Vec<u8>)> {
        self.misbehaviour.take()
    }

    /// Arms a crash at `point` (the next time the store passes it).
    pub fn arm_crash(&mut self, point: &'static str) {
        if let Ok(mut a) = self.hook.armed.lock()
            && !a.contains(&point)
        {
            a.push(point);
        }
    }

    /// Every named point this host's store passed so far.
    #[must_use]
    pub fn passed_points(&self) -> Vec<&'static str> {
        self.hook
            .passed
            .lock()
            .map(|p| p.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Ends any misbehaviour that closes sessions (the calm tail has no
    /// faults: an adversary that broke every session would keep its
    /// commands from ending).
    pub fn behave(&mut self) {
        // an exact repeat breaks nothing: it may go on
        if self
            .adversary
            .as_ref()
            .is_some_and(|a| a.kind().expects_close())
        {
            self.adversary = None;
        }
    }

    /// Disarms any armed crash point (the calm tail has no faults).
    pub fn disarm_crash(&mut self) {
        if let Ok(mut a) = self.hook.armed.lock() {
            a.clear();
        }
    }

    /// A crash at an armed point since the last call, with the
    /// connection that was open.
    pub fn take_crashed(&mut self) -> Option<(Option<ConnId>, &'static str)> {
        self.crashed.pop_front()
    }

    /// The daemon crashes (and the host may lose power) at `now`: the
    /// store closes as a crash leaves it, un-synced bytes go (some of the
    /// last write may stay), the trees die, and a new runtime starts from
    /// the store. Returns the connection that was open.
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
        let Some(rt) = self.rt.take() else {
            return conn;
        };
        // a crashed store closes without a checkpoint, as a power cut
        // leaves it
        let (mut sup, mut env) = rt.crash_into_parts();
        sup.daemon_died(
            &env.ended_durable,
            &env.results_durable,
            &env.terminals_closed,
        );
        env.results_durable.clear();
        let _ = self.fs.crash(mode);
        if let Err(e) = self.start_again(sup, env) {
            self.note(format!("restart after a crash failed: {e}"));
        }
        conn
    }

    /// A second installation of this host's client id: a fresh store (its
    /// own instance id) in `root`. Returns its instance id and the hello
    /// frame it sends on its first connection.
    ///
    /// # Errors
    /// When its store or runtime cannot start.
    pub fn twin_hello(&self, rng: SimRng, root: PathBuf) -> Result<(String, Vec<u8>), String> {
        let mut config = self.config.clone();
        config.adversary = Some(Adversary::SecondInstance);
        let log: SharedLog = Arc::default();
        let mut twin = Self::new(self.index, config, rng, root, log)?;
        // it dials at once; its first frame on the connection is the hello
        let instance = twin.core_config.hello.client_instance_id.clone();
        let _ = twin.poll_effect();
        twin.handle(0, ClientInput::Connected(ConnId(u64::MAX)));
        while let Some(e) = twin.poll_effect() {
            if let ClientEffect::Send {
                item: Item::Binary(b),
                ..
            } = e
            {
                return Ok((instance, b));
            }
        }
        Err("the second instance sent no hello".into())
    }

    /// The shell of terminal `id` writes `bytes` by itself (a prompt, a
    /// program's output): its holder keeps them and the daemon relays
    /// them.
    pub fn terminal_writes(&mut self, now: u64, id: &Uuid7, bytes: &[u8]) {
        self.set_now(now);
        if let Some(rt) = self.rt.as_mut() {
            rt.supervisor_mut().terminal_writes(id, bytes);
        }
        self.pump();
        self.after_step();
    }

    /// The shell of terminal `id` exits by itself with `code`.
    pub fn terminal_exits(&mut self, now: u64, id: &Uuid7, code: i32) {
        self.set_now(now);
        if let Some(rt) = self.rt.as_mut() {
            rt.supervisor_mut().terminal_exits(id, code);
        }
        self.pump();
        self.after_step();
    }

    /// Whether terminal `id` has a holder here whose shell still runs.
    #[must_use]
    pub fn shell_runs(&self, id: &Uuid7) -> bool {
        self.rt
            .as_ref()
            .is_some_and(|rt| rt.supervisor().shell_runs(id))
    }

    /// The client core's phase of terminal `id`.
    #[must_use]
    pub fn terminal_phase(&self, id: &Uuid7) -> Option<rvbox_client_core::machine::TerminalPhase> {
        self.rt.as_ref().and_then(|rt| rt.core().terminal_phase(id))
    }

    /// The running client core's terminal counters (since its start).
    #[must_use]
    pub fn terminal_stats(&self) -> Option<rvbox_client_core::machine::TerminalStats> {
        self.rt.as_ref().map(|rt| rt.core().terminal_stats())
    }

    /// The host index.
    #[must_use]
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The installation's instance id.
    #[must_use]
    pub fn instance_id(&self) -> &str {
        &self.core_config.hello.client_instance_id
    }

    /// Where the link is.
    #[must_use]
    pub fn phase(&self) -> Option<rvbox_client_core::link::Phase> {
        self.rt.as_ref().map(|rt| rt.core().link_phase())
    }

    /// The client core's counters.
    #[must_use]
    pub fn core_stats(&self) -> rvbox_client_core::machine::CoreStats {
        self.rt
            .as_ref()
            .map(|rt| rt.core().stats())
            .unwrap_or_default()
    }

    /// The link's counters.
    #[must_use]
    pub fn link_stats(&self) -> rvbox_client_core::link::LinkStats {
        self.rt
            .as_ref()
            .map(|rt| rt.core().link_stats())
            .unwrap_or_default()
    }

    /// Records the client holds (active and terminal-unacknowledged).
    #[must_use]
    pub fn records(&self) -> usize {
        self.rt.as_ref().map_or(0, |rt| rt.core().record_count())
    }

    /// (running, queued) as the client reports them.
    #[must_use]
    pub fn capacity(&self) -> (u32, u32) {
        self.rt.as_ref().map_or((0, 0), |rt| rt.core().capacity())
    }

    /// The launch phase of `issue`, while the client holds it.
    #[must_use]
    pub fn launch_phase(&self, issue: &Uuid7) -> Option<rvbox_client_core::machine::LaunchPhase> {
        self.rt
            .as_ref()
            .and_then(|rt| rt.core().phase_of(issue).cloned())
    }

    /// Whether the client's store holds a tombstone of `issue`.
    #[must_use]
    pub fn tombstoned(&self, issue: &Uuid7) -> bool {
        self.rt
            .as_ref()
            .is_some_and(|rt| rt.store().tombstone(issue).ok().flatten().is_some())
    }

    /// The wall clock of this host now.
    #[must_use]
    pub fn wall_now(&self) -> i64 {
        self.wall()
    }
}
