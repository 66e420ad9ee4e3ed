//! One simulated run: the real engine over the real store (temporary
//! directory behind the fault-injecting filesystem), simulated clients, the
//! faulty network, server crashes at named store crash points and between
//! steps, power cuts that lose or tear unsynced bytes, and wall-clock jumps;
//! every invariant is checked after every step.
//!
//! One `u64` seed decides everything ([`crate::rng::Seeds`]); the same seed
//! gives a byte-identical [`Report::trace`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use prost::Message as _;
use rvbox_domain::error::Code;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_engine::{Engine, Output};
use rvbox_proto::v1 as wire;
use rvbox_session::{ServerIdentity, SessionConfig};
use rvbox_store::crash::{CrashHook, points};
use rvbox_store::fs::{CrashMode, FaultyFs, StoreFs};
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};
use rvbox_store_port::ops::PortError;

use crate::host::{Adversary, ClientConfig, ClientEffect, ClientInput, SimHost};
use crate::invariants::Checker;
use crate::net::{ClientSlot, ConnId, Delivery, Dir, Item, Net, NetConfig, NetEvent, Side};
use crate::oracles::{OracleCounts, Requests};
use crate::rng::{SeededEntropy, Seeds, SimRng};
use crate::supervisor::{Programs, SharedLog};
use crate::terminals::{
    CloseAsked, DRAIN_WAIT_MS, Ending, MAX_FRAMES_PER_TERMINAL, MAX_KEPT_ANSWERS,
    MAX_TERMINALS_PER_RUN, MAX_VIEWER_ITEMS, MAX_VIEWERS_PER_RUN, TERMINAL_RETRY_BUDGET_MS,
    TermCall, TermPlan, TerminalCounts, TypedFrame, ViewerItem, ViewerState,
};

/// The store crash points a run arms: every step of the append path, and
/// every metadata commit the server core's operations reach (each at its
/// own site, so a trace names exactly which commit the crash followed).
pub const CRASH_POINTS: [&str; 32] = [
    points::EVENT_BEFORE_FSYNC,
    points::EVENT_MID_RECORD,
    points::EVENT_AFTER_FSYNC,
    points::EVENT_AFTER_COMMIT,
    points::SEGMENT_CREATED,
    points::BLOB_AFTER_SYNC,
    points::DISPATCH_AFTER_COMMIT,
    points::REQUEUE_AFTER_COMMIT,
    points::ACCEPT_AFTER_COMMIT,
    points::ACCEPT_LATE_AFTER_COMMIT,
    points::ADVANCE_AFTER_COMMIT,
    points::EXPIRED_PENDING_AFTER_COMMIT,
    points::REVISION_AFTER_COMMIT,
    points::FINISH_AFTER_COMMIT,
    points::RECONCILE_AFTER_COMMIT,
    points::INCIDENT_AFTER_COMMIT,
    points::REGISTER_AFTER_COMMIT,
    points::CLAIM_AFTER_COMMIT,
    points::SESSION_CLOSE_AFTER_COMMIT,
    points::TAKEOVER_AFTER_COMMIT,
    points::SIGNAL_AFTER_COMMIT,
    points::STDIN_AFTER_COMMIT,
    points::RUN_COMMAND_AFTER_COMMIT,
    points::TRANSITION_AFTER_COMMIT,
    points::RUN_FLEET_AFTER_COMMIT,
    points::FLEET_PASS_AFTER_COMMIT,
    points::FLEET_ACTION_AFTER_COMMIT,
    rvbox_store::retention::points::ROTATE_AFTER_MARK,
    rvbox_store::retention::points::EVICT_AFTER_MARK,
    rvbox_store::retention::points::EVICT_AFTER_MOVE,
    rvbox_store::retention::points::EVICT_AFTER_DELETE,
    rvbox_store::audit::points::AUDIT_AFTER_FSYNC,
];

/// Chance a host's positive acceptance is followed by the same
/// `Dispatch` again.
const REPEAT_DISPATCH_PERMILLE: u32 = 150;
/// `Dispatch` frames kept for repeating.
const MAX_KEPT_DISPATCHES: usize = 256;

/// Server crash points few runs pass, armed at their first pass in every
/// faulty run.
const RARE_POINTS: &[&str] = &[
    points::ACCEPT_LATE_AFTER_COMMIT,
    points::FLEET_ACTION_AFTER_COMMIT,
    points::EXPIRED_PENDING_AFTER_COMMIT,
    points::CLAIM_AFTER_COMMIT,
    rvbox_store::retention::points::ROTATE_AFTER_MARK,
    rvbox_store::retention::points::EVICT_AFTER_MARK,
    rvbox_store::retention::points::EVICT_AFTER_MOVE,
    rvbox_store::retention::points::EVICT_AFTER_DELETE,
];

/// Client crash points few runs pass, armed on every host of a faulty run.
const RARE_CLIENT_POINTS: &[&str] = &[
    rvbox_client_store::crash::SPOOL_ROTATE_BEFORE_COMMIT,
    rvbox_client_store::crash::SPOOL_ROTATE_AFTER_COMMIT,
    rvbox_client_store::crash::SPOOL_LOSS_AFTER_COMMIT,
    rvbox_client_store::crash::TOMBSTONE_ROTATE_BEFORE_COMMIT,
];

/// Client spool output kept per command and per daemon (compressed) in a
/// run with tight quotas.
pub const TIGHT_SPOOL: (u64, u64) = (2 << 20, 4 << 20);

/// Simulated time after the workload (faults off, every client
/// reachable) within which every command must be terminal.
pub const CALM_TAIL_MS: u64 = 600_000;
/// Server closes of one honest client the calm tail allows (a session
/// already past its liveness timeout when the tail begins, say).
pub const CALM_TAIL_CLOSES: u64 = 3;

/// Wall-clock epoch of every run (ms).
pub const WALL_EPOCH_MS: i64 = 1_800_000_000_000;
/// Most trace lines kept (a run longer than this is cut, and says so).
pub const MAX_TRACE_LINES: usize = 200_000;
/// Most steps of one run.
pub const MAX_STEPS: u64 = 400_000;
/// Longest simulated run after the workload ends (ms) before a run that
/// still has unfinished commands counts as stuck.
pub const DRAIN_MS: u64 = 1_800_000;
/// Connection numbers of second instances start here (the network's own
/// connections stay far below).
const TWIN_CONN_BASE: u64 = 1 << 40;
/// Most answered `SignalCommand` requests one run keeps for replays.
const MAX_KEPT_SIGNALS: usize = 256;
/// Most fleet runs one run keeps for replays and cancels.
const MAX_KEPT_FLEETS: usize = 64;
/// Largest script the workload creates (a script command is 1 in 10).
const MAX_WORKLOAD_SCRIPT_BYTES: u64 = 1_500_000;
/// The idle timeout of terminals in runs that shorten it.
const TERMINAL_IDLE_MS: u64 = 90_000;
/// The recording cap of terminals with tight quotas.
const TIGHT_RECORDING_BYTES: u64 = 256 * 1024;
/// Largest burst of output a model shell writes at once.
const MAX_TERMINAL_BURST: u64 = 2_500_000;
/// Bursts one terminal's shell writes at most, in bytes.
const MAX_TERMINAL_BURST_TOTAL: u64 = 5_000_000;

/// What a run does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Honest clients.
    pub clients: u32,
    /// Commands the workload creates.
    pub commands: u32,
    /// Simulated time over which they are created (ms).
    pub workload_ms: u64,
    /// Inject faults (network, crashes, clock jumps, adversaries).
    pub faults: bool,
    /// A deliberate break of the world, for the tests that watch a check
    /// of the run fire; `None` in every real run.
    pub breach: Option<Breach>,
}

/// A deliberate break of the simulated world (see [`SimConfig::breach`]):
/// each one is what a real bug would leave behind, made at the one moment
/// its check must see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breach {
    /// From the calm tail on, the network carries nothing: the commands
    /// still running never end (the calm tail's bound).
    DeadNetwork,
    /// Once every command ended, one that succeeded is stored as failed
    /// (agreement, and the exit oracle).
    FlippedOutcome,
    /// Once every command ended, one whose process ran is stored as
    /// addressed to another client (the exit oracle's which-client check).
    Readdressed,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            clients: 3,
            commands: 12,
            workload_ms: 60_000,
            faults: true,
            breach: None,
        }
    }
}

/// The outcome of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Steps taken.
    pub steps: u64,
    /// The trace (deterministic: no paths, no real time).
    pub trace: Vec<String>,
    /// Fault and recovery-path counters (`kind` -> count).
    pub counters: BTreeMap<String, u64>,
    /// The first violated invariant or run failure, if any.
    pub failure: Option<String>,
    /// Binary frames recorded on the network (empty unless
    /// [`World::record_frames`] asked for them).
    pub frames: Vec<crate::net::RecordedFrame>,
}

impl Report {
    /// The trace as one text, first line `seed N`.
    #[must_use]
    pub fn trace_text(&self) -> String {
        let mut s = format!("seed {}\n", self.seed);
        for l in &self.trace {
            s.push_str(l);
            s.push('\n');
        }
        s
    }
}

/// Most crash points armed at once.
const MAX_ARMED_POINTS: usize = CRASH_POINTS.len();

/// Panics at the `after`-th time the store passes any of its armed points:
/// a server crash at that effect boundary (caught by the world). Several
/// points are armed at once, so a rarely passed one stays armed while
/// others come and go.
#[derive(Debug)]
struct StopAt {
    arms: Vec<(&'static str, u32, AtomicU32)>,
    /// Every point the store passed this run, armed or not (shared by
    /// every hook of the run: the seed batch's coverage).
    passed: Arc<std::sync::Mutex<std::collections::BTreeSet<&'static str>>>,
}

impl StopAt {
    /// What is still armed, with the passes each still waits for.
    fn remaining(&self) -> Vec<(&'static str, u32)> {
        self.arms
            .iter()
            .filter_map(|(p, after, hits)| {
                let left = after.saturating_sub(hits.load(Ordering::SeqCst));
                (left > 0).then_some((*p, left))
            })
            .collect()
    }
}

impl CrashHook for StopAt {
    // the simulated crash unwinds out of the store mid-step on purpose; the
    // world catches exactly this payload and restarts the server
    #[allow(clippy::panic)]
    fn at(&self, point: &'static str) {
        if let Ok(mut p) = self.passed.lock() {
            p.insert(point);
        }
        for (p, after, hits) in &self.arms {
            if *p == point && hits.fetch_add(1, Ordering::SeqCst) + 1 == *after {
                std::panic::panic_any(CrashedAt(point));
            }
        }
    }
}

/// Whether the server must close the connection while handling the
/// adversary's first frame (the others close once a later frame or a
/// store answer arrives).
fn adversary_closes_at_once(kind: Adversary) -> bool {
    // a stale or malformed frame is answered in the step that delivers it
    matches!(kind, Adversary::StaleGeneration | Adversary::MalformedBytes)
}

/// The payload of an envelope, if `bytes` decode as one.
fn payload_of(bytes: &[u8]) -> Option<wire::envelope::Payload> {
    wire::Envelope::decode(bytes).ok().and_then(|e| e.payload)
}

/// Whether an incident names the command.
fn has_incident(store: &Store, issue: &[u8; 16]) -> bool {
    use rvbox_store::db::Cached as _;
    store
        .db()
        .query_row_cached(
            "SELECT EXISTS (SELECT 1 FROM storage_incidents WHERE issue_uuid = ?1)",
            [issue.as_slice()],
            |r| r.get::<_, bool>(0),
        )
        .unwrap_or(false)
}

/// The panic payload of a simulated crash.
#[derive(Debug)]
pub(crate) struct CrashedAt(pub(crate) &'static str);

/// Simulated crashes unwind by design; only other panics are reported.
fn quiet_crash_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<CrashedAt>().is_none() {
                default(info);
            }
        }));
    });
}

/// The run's data directory: on tmpfs when the host has one. The simulator
/// models durability itself (the fault-injecting filesystem decides what a
/// power cut keeps), so real flushes would only cost time.
fn sim_tempdir() -> Result<tempfile::TempDir, String> {
    let shm = std::path::Path::new("/dev/shm");
    let r = if shm.is_dir() {
        tempfile::Builder::new()
            .prefix("rvbox-sim-")
            .tempdir_in(shm)
    } else {
        tempfile::Builder::new().prefix("rvbox-sim-").tempdir()
    };
    r.map_err(|e| format!("temp dir: {e}"))
}

struct Server {
    /// The store's quotas are tight (see [`store_options`]).
    tight: bool,
    /// The send windows are small ([`TIGHT_WINDOWS`]): seeds with a
    /// window-overrun adversary, so it exceeds them with a bounded number
    /// of frames.
    small_windows: bool,
    dir: tempfile::TempDir,
    fs: FaultyFs,
    engine: Option<Engine>,
    entropy: Arc<SeededEntropy>,
    /// The terminal policy (`terminals.*`): a short idle timeout in some
    /// runs, a small recording cap with tight quotas.
    pty: rvbox_server_core::PtyPolicy,
}

/// What the operator still writes to one command's stdin.
#[derive(Debug, Clone)]
struct StdinPlan {
    id: [u8; 16],
    at: u64,
    appends_left: u32,
    /// The call in flight whose answer a crash swallowed (sent again with
    /// its request id, as rvc does).
    pending: Option<StdinCall>,
    /// When the call in flight was first sent.
    since: u64,
    /// A crash swallowed an answer to the call in flight, so it may have
    /// committed: it is never given up (a refusal before the store looks
    /// the request up, say an unavailable scope, proves nothing).
    maybe_committed: bool,
}

/// How long the operator's rvc retries a stdin call refused with a
/// transient error (its documented retry budget) before it reports the
/// refusal: an append is then given up (the plan goes on to its close).
const STDIN_RETRY_BUDGET_MS: u64 = 60_000;

#[derive(Debug, Clone)]
enum StdinCall {
    Append(wire::AppendStdinRequest),
    Close(wire::CloseStdinRequest),
}

/// Most stdin plans a run keeps (one per command).
const MAX_STDIN_PLANS: usize = 100_000;

/// One run in progress.
pub struct World {
    seed: u64,
    config: SimConfig,
    now: u64,
    wall_offset: i64,
    net: Net,
    server: Server,
    clients: Vec<SimHost>,
    /// What every process tree really did (the oracles' side of truth).
    process_log: SharedLog,
    /// What the operator asked for and the server acknowledged (the other
    /// side the oracles compare with).
    requests: Requests,
    /// Signal requests that may have been applied (answered, or never
    /// answered), by request id: their command and kind.
    signal_may_apply: BTreeMap<String, ([u8; 16], wire::SignalKind)>,
    /// Each command's stdin plan: appends, then the close.
    stdin_plans: Vec<StdinPlan>,
    /// The stdin workload's choices.
    stdin_rng: SimRng,
    /// The oracles' choices (page sizes, cursors).
    oracle_rng: SimRng,
    workload: SimRng,
    faults: SimRng,
    checker: Checker,
    trace: Vec<String>,
    counters: BTreeMap<String, u64>,
    created: u32,
    created_ids: Vec<[u8; 16]>,
    /// How many of `created_ids`, from the front, are known terminal (a
    /// terminal command stays terminal, so they are not read again).
    known_done: usize,
    /// Answered `SignalCommand` requests, for replays.
    signals: Vec<(wire::SignalCommandRequest, wire::SignalCommandResponse)>,
    /// Answered `RunFleet` requests, for replays and cancels.
    fleets: Vec<(wire::RunFleetRequest, wire::RunFleetResponse)>,
    /// Fleet target commands already tracked in `created_ids`.
    fleet_seen: BTreeSet<[u8; 16]>,
    /// The fleet workload's choices.
    fleet_rng: SimRng,
    /// The replica faults' choices (their own stream: the other faults of
    /// a seed stay what they were).
    replica_rng: SimRng,
    /// `SignalCommand` requests whose answer a server crash swallowed.
    unanswered: Vec<wire::SignalCommandRequest>,
    /// Second instances sent so far (their connections are numbered from
    /// [`TWIN_CONN_BASE`]).
    twins: u64,
    /// Engine outputs addressed to a second instance's connection.
    twin_outputs: Vec<Output>,
    next_workload_at: u64,
    next_fault_at: u64,
    /// When a server that lost its replica lease (or some duties) serves
    /// again and holds every duty, as a replica that joined again does.
    replica_restore_at: Option<u64>,
    /// When the simulated executor next performs queued store operations
    /// and hands completions to the core.
    exec_at: Option<u64>,
    /// The executor's delays and batch sizes.
    exec: SimRng,
    /// Which store crash points are armed, beyond the fault turns' own.
    crash_points: SimRng,
    /// The crash hook of the running store (a restart disarms it).
    armed: Option<Arc<StopAt>>,
    /// The operator's takeover grants.
    takeover_rng: SimRng,
    /// Holds that make an acceptance arrive after its queue expiry.
    late_rng: SimRng,
    /// Dispatches sent to a host again.
    repeat_rng: SimRng,
    /// Partitions of a host while a chatty tree writes there.
    chatty_rng: SimRng,
    /// Chatty trees already considered for such a partition.
    chatty_seen: BTreeSet<Uuid7>,
    /// Hosts spared from crashes until the given time: a chatty tree on a
    /// partitioned host that crashed would die with its daemon before the
    /// long replay this scenario is for.
    spared: BTreeMap<u32, u64>,
    /// The last `Dispatch` frame per (connection, command), bounded.
    dispatches: BTreeMap<(u64, String), Vec<u8>>,
    /// Pending claims of refused second instances: client id, instance.
    claims: Vec<(String, String)>,
    /// Grants answered, kept for replays.
    takeovers: Vec<(
        wire::AuthorizeClientTakeoverRequest,
        wire::AuthorizeClientTakeoverResponse,
    )>,
    /// Every store point the server passed this run.
    points_passed: Arc<std::sync::Mutex<std::collections::BTreeSet<&'static str>>>,
    /// The command of the `SignalCommand` whose call is being flushed.
    signalled_now: Option<String>,
    /// The calm tail has begun (faults off).
    calm: bool,
    /// Server stores opened this run (the first and every restart).
    server_opens: u64,
    /// The store as the invariant checker last read it: (opens, rows the
    /// store's connection has changed). A step that changed nothing in
    /// the store skips the store's checks (they would read what the last
    /// one read).
    store_checked: Option<(u64, u64)>,
    /// When it began.
    calm_from: u64,
    /// Server closes of each client during the calm tail.
    calm_closes: BTreeMap<u32, u64>,
    /// Connections the server acknowledged events on (a session that
    /// stored something).
    acked_conns: BTreeSet<u64>,
    /// How much longer the calm tail runs: a backward correction of the
    /// server's wall clock that retries scheduled on it wait out.
    calm_extra: u64,
    /// Adversary frames sent and not yet delivered, per connection.
    adversary_sent: BTreeMap<u64, (Adversary, Vec<u8>)>,
    /// Connections whose adversary frame reached the server: the kind
    /// whose answer the connection's close must be.
    adversary_awaiting: BTreeMap<u64, Adversary>,
    /// The server's crash was armed at the commit of the incident a
    /// contradictory snapshot records (once per run).
    incident_armed: bool,
    /// Connections the server has closed (a run has a few hundred).
    server_closed: std::collections::BTreeSet<u64>,
    /// The terminals of the workload (sim/src/terminals.rs).
    terms: Vec<TermPlan>,
    /// Their viewers.
    viewers: Vec<ViewerState>,
    /// When the terminals not yet planned open, earliest first.
    term_opens: VecDeque<u64>,
    /// The terminal workload's choices (its own stream).
    term_rng: SimRng,
    /// The store as the terminal observation last read it (see
    /// `store_checked`).
    terms_observed: Option<(u64, u64)>,
    failure: Option<String>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("seed", &self.seed)
            .field("now", &self.now)
            .finish_non_exhaustive()
    }
}

/// The store's options; `tight` ones (one faulty seed in four) are small
/// enough that a run reaches output rotation, quota and age eviction, the
/// tombstone FIFO and the ingress watermarks.
fn store_options(tight: bool) -> StoreOptions {
    let mut opts = StoreOptions::default();
    // the free-space floor reads the real disk: keep it out of decisions
    opts.tiers.free_space_floor = 0;
    if tight {
        opts.tiers.command_output_window = TIGHT_OUTPUT_WINDOW;
        opts.tiers.command_total = 2 * 1024 * 1024;
        opts.tiers.per_owner_total = 3 * 1024 * 1024;
        opts.tiers.global_total = 6 * 1024 * 1024;
        opts.tombstone_cap = TIGHT_TOMBSTONES;
        opts.terminal_retention_ms = 20_000;
        // segments seal often, so the output window has whole segments to
        // rotate
        opts.seal_bytes = 2 * 1024;
    }
    opts
}

/// A tight store's per-command output window: its active segment (sealed
/// at 2 KiB) and an incoming 64 KiB chunk that does not compress fit, as
/// the configuration floor demands of the real sizes, so rotation can
/// always make room; bursts rotate through it.
const TIGHT_OUTPUT_WINDOW: u64 = 160 * 1024;
/// A tight store's tombstone FIFO (the server's, and each client's).
const TIGHT_TOMBSTONES: u64 = 3;
/// A tight server's ingress watermarks.
const TIGHT_INGRESS: (u64, u64) = (4 * 1024, 2 * 1024);
/// Send windows (per command, per session) of seeds with a window-overrun
/// adversary: a few of the largest events fit, so honest clients wait for
/// acknowledgements and the adversary exceeds them with a bounded number of
/// frames.
/// How long past its partition a host running a chatty tree is spared
/// from crashes (the reconnect's backoff and the replay).
const SPARE_AFTER_MS: u64 = 20_000;

const TIGHT_WINDOWS: (u64, u64) = (
    rvbox_domain::limits::MIN_SEND_WINDOW_BYTES,
    2 * rvbox_domain::limits::MIN_SEND_WINDOW_BYTES,
);

fn open_store(
    dir: &std::path::Path,
    fs: &FaultyFs,
    entropy: &Arc<SeededEntropy>,
    wall: i64,
    tight: bool,
) -> Result<(Store, rvbox_store::recovery::RecoveryReport), String> {
    let fs_dyn: Arc<dyn StoreFs> = Arc::new(fs.clone());
    let mut store = Store::open(
        Layout::new(dir),
        fs_dyn,
        entropy.clone(),
        store_options(tight),
        wall,
    )
    .map_err(|e| format!("store open: {e}"))?;
    let report = store.recover(wall).map_err(|e| format!("recovery: {e}"))?;
    Ok((store, report))
}

fn engine_over(
    store: Store,
    entropy: &Arc<SeededEntropy>,
    tight: bool,
    small_windows: bool,
    pty: rvbox_server_core::PtyPolicy,
) -> Result<Engine, String> {
    let server_id =
        Uuid7::from_bytes("server_id", store.server_id()).map_err(|e| format!("server id: {e}"))?;
    let mut config = SessionConfig::new(ServerIdentity {
        server_id,
        software_version: "0.1.0".into(),
        supported_minors: vec![0],
    });
    if small_windows {
        config.limits.command_window_bytes = TIGHT_WINDOWS.0;
        config.limits.session_window_bytes = TIGHT_WINDOWS.1;
    }
    config
        .validate()
        .map_err(|e| format!("session config: {e}"))?;
    let mut engine = Engine::new(store, entropy.clone(), config);
    // appends wait for their group by the configured policy on the world's
    // clock (a maximum batching delay; the timer is the core's deadline)
    engine.set_group_policy(rvbox_engine::GroupPolicy::default());
    // the world performs store operations and hands their completions to
    // the core later, so a crash can fall between them
    engine.set_deferred(true);
    // frames count as written when the client takes them off the wire
    engine.set_auto_written(false);
    engine.set_pty_policy(pty);
    if tight {
        engine
            .set_ingress_watermarks(TIGHT_INGRESS.0, TIGHT_INGRESS.1)
            .map_err(|e| format!("ingress watermarks: {e}"))?;
    }
    Ok(engine)
}

fn payload_name(bytes: &[u8]) -> String {
    use rvbox_proto::v1::envelope::Payload;
    match payload_of(bytes) {
        None => "malformed".into(),
        Some(Payload::ControlError(e)) => format!(
            "control_error [{}]",
            e.detail.map(|d| d.reason).unwrap_or_default()
        ),
        Some(Payload::CommandEvent(e)) => {
            let body = match e.body {
                Some(wire::command_event::Body::Output(_)) => "output".to_owned(),
                Some(wire::command_event::Body::Lifecycle(l)) => {
                    format!("lifecycle {}", l.lifecycle)
                }
                Some(wire::command_event::Body::StdinAck(a)) => {
                    format!("stdin_ack {:?}", a)
                }
                Some(wire::command_event::Body::SignalResult(r)) => {
                    format!("signal_result rev {} outcome {}", r.revision, r.outcome)
                }
                Some(wire::command_event::Body::Truncation(_)) => "truncation".to_owned(),
                Some(_) => "other".to_owned(),
                None => "unset".to_owned(),
            };
            format!(
                "command_event {} #{} {body}",
                &e.issue_uuid.get(28..).unwrap_or_default(),
                e.event_seq
            )
        }
        Some(Payload::CommandAccepted(a)) => format!(
            "command_accepted {} outcome {}{}",
            &a.issue_uuid.get(28..).unwrap_or_default(),
            a.outcome,
            a.error
                .map(|e| format!(" [{}]", e.reason))
                .unwrap_or_default()
        ),
        Some(Payload::Dispatch(d)) => {
            format!(
                "dispatch {} rev {}",
                &d.issue_uuid.get(28..).unwrap_or_default(),
                d.revision
            )
        }
        Some(Payload::StdinWrite(w)) => format!(
            "stdin_write {} #{} raw {}{}",
            &w.issue_uuid.get(28..).unwrap_or_default(),
            w.write_seq,
            w.raw_length,
            if w.close_after { " close" } else { "" }
        ),
        Some(Payload::Signal(s)) => format!(
            "signal {} rev {} kind {}",
            &s.issue_uuid.get(28..).unwrap_or_default(),
            s.revision,
            s.signal
        ),
        Some(Payload::EventAck(a)) => {
            format!(
                "event_ack {} #{}",
                &a.issue_uuid.get(28..).unwrap_or_default(),
                a.durable_event_seq
            )
        }
        Some(Payload::PtyOutput(o)) => format!(
            "pty_output {} @{} +{}{}",
            tail(&o.pty_session_id),
            o.offset,
            o.data.len(),
            o.cut
                .map(|c| format!(" cut [{}, {})", c.requested_offset, c.ring_start_offset))
                .unwrap_or_default()
        ),
        Some(Payload::PtyOutputAck(a)) => {
            format!("pty_output_ack {} @{}", tail(&a.pty_session_id), a.offset)
        }
        Some(Payload::PtyAttach(a)) => {
            format!(
                "pty_attach {} from {}",
                tail(&a.pty_session_id),
                a.from_offset
            )
        }
        Some(Payload::PtyClosed(c)) => format!(
            "pty_closed {} end {} [{}]",
            tail(&c.pty_session_id),
            c.final_offset,
            c.reason
        ),
        Some(Payload::PtyInput(i)) => {
            format!("pty_input {} #{}", tail(&i.pty_session_id), i.input_seq)
        }
        Some(Payload::PtyInputAck(a)) => {
            format!("pty_input_ack {} #{}", tail(&a.pty_session_id), a.input_seq)
        }
        Some(Payload::PtyOpen(o)) => format!("pty_open {}", tail(&o.pty_session_id)),
        Some(Payload::PtyOpened(o)) => format!(
            "pty_opened {} outcome {}",
            tail(&o.pty_session_id),
            o.outcome
        ),
        Some(Payload::PtyClose(c)) => format!("pty_close {}", tail(&c.pty_session_id)),
        Some(p) => rvbox_session::payload_name(&p).to_owned(),
    }
}

/// The last 8 characters of an id, as the trace names it.
fn tail(id: &str) -> &str {
    id.get(id.len().saturating_sub(8)..).unwrap_or_default()
}

impl World {
    /// A new run for `seed`.
    ///
    /// # Errors
    /// When the temporary store cannot be created.
    pub fn new(seed: u64, config: SimConfig) -> Result<Self, String> {
        let seeds = Seeds::new(seed);
        let mut faults = seeds.faults();
        let net_config = if config.faults {
            NetConfig::random(&mut faults)
        } else {
            NetConfig::calm()
        };
        quiet_crash_panics();
        let dir = sim_tempdir()?;
        let fs = FaultyFs::new();
        let entropy = Arc::new(SeededEntropy::new(seeds.server()));
        let tight = config.faults
            && seeds
                .stream(crate::rng::Stream::Named("retention"))
                .chance(250);
        let (store, _) = open_store(dir.path(), &fs, &entropy, WALL_EPOCH_MS, tight)?;
        // one adversarial client in every other faulty run, the kinds in
        // turn (so any ten consecutive seeds hold each kind once)
        const KINDS: [Adversary; 5] = [
            Adversary::ExactDuplicate,
            Adversary::StaleGeneration,
            Adversary::ConflictingDuplicate,
            Adversary::WindowOverrun,
            Adversary::MalformedBytes,
        ];
        let adversary = (config.faults && seed.is_multiple_of(2))
            .then(|| {
                KINDS
                    .get(usize::try_from(seed / 2 % 5).unwrap_or(0))
                    .copied()
            })
            .flatten()
            // and one seed in forty a client whose reconciliation
            // snapshot contradicts the server (a residue no earlier seed
            // kept as a fixture has, so each still runs its own world)
            .or((config.faults && seed % 40 == 11).then_some(Adversary::ContradictorySnapshot));
        let small_windows = adversary == Some(Adversary::WindowOverrun);
        let process_log = SharedLog::default();
        let mut clients = Vec::new();
        let mut births = seeds.stream(crate::rng::Stream::Named("births"));
        for i in 0..config.clients {
            let mut c = ClientConfig::new(format!("host-{i}"));
            c.max_running = 2;
            c.max_queued = 2;
            c.programs = Programs::default();
            c.wall_epoch_ms = WALL_EPOCH_MS;
            if small_windows {
                c.server_command_window_bytes = TIGHT_WINDOWS.0;
            }
            if i == 0 && adversary.is_some() {
                c.adversary = adversary;
                // once per session at most, at one of its first events
                c.adversary_permille = 250;
            }
            if config.faults {
                // local storage failures before an acceptance commits
                c.transient_permille = 40;
            }
            // some hosts die in their very first start
            c.crash_at_birth = config.faults && births.chance(150);
            if tight {
                // a short tombstone FIFO and a small spool: rotations of
                // both happen within a run
                c.tombstone_cap = TIGHT_TOMBSTONES;
                c.spool_output = Some(TIGHT_SPOOL);
                // and bursts often enough that one outgrows that window
                c.programs.burst_permille = 150;
                // and the smallest send windows: more of a backlog stays
                // unsequenced, where the spool may rotate it
                c.command_window_bytes = TIGHT_WINDOWS.0;
                c.session_window_bytes = TIGHT_WINDOWS.1;
            }
            clients.push(SimHost::new(
                i,
                c,
                seeds.client(i),
                dir.path().join(format!("client-{i}")),
                process_log.clone(),
            )?);
        }
        // terminals: their own stream, so the other draws of a seed stay
        // what they were; a few opened over the workload, a short idle
        // timeout in one faulty run in four (a wall clock that jumps ahead
        // closes idle terminals), and with tight quotas a small recording
        // cap (trimmed recordings serve cut markers)
        let mut term_rng = seeds.stream(crate::rng::Stream::Named("terminals"));
        let mut pty = rvbox_server_core::PtyPolicy::default();
        if config.faults && term_rng.chance(250) {
            pty.idle_timeout_ms = TERMINAL_IDLE_MS;
        }
        if tight {
            pty.limits.recording_bytes = TIGHT_RECORDING_BYTES;
        }
        let mut term_opens: Vec<u64> = (0..term_rng.below(MAX_TERMINALS_PER_RUN as u64))
            .map(|_| term_rng.range_inclusive(2_000..=(config.workload_ms * 3 / 4).max(2_000)))
            .collect();
        term_opens.sort_unstable();
        let engine = engine_over(store, &entropy, tight, small_windows, pty)?;
        Ok(Self {
            seed,
            config,
            now: 0,
            wall_offset: 0,
            net: Net::new(seeds.network(), net_config),
            server: Server {
                tight,
                small_windows,
                dir,
                fs,
                engine: Some(engine),
                entropy,
                pty,
            },
            clients,
            process_log,
            requests: Requests::default(),
            signal_may_apply: BTreeMap::new(),
            stdin_plans: Vec::new(),
            stdin_rng: seeds.stream(crate::rng::Stream::Named("stdin")),
            oracle_rng: seeds.stream(crate::rng::Stream::Named("oracles")),
            takeover_rng: seeds.stream(crate::rng::Stream::Named("takeovers")),
            late_rng: seeds.stream(crate::rng::Stream::Named("late_acceptances")),
            repeat_rng: seeds.stream(crate::rng::Stream::Named("repeated_dispatches")),
            chatty_rng: seeds.stream(crate::rng::Stream::Named("chatty_partitions")),
            chatty_seen: BTreeSet::new(),
            spared: BTreeMap::new(),
            dispatches: BTreeMap::new(),
            takeovers: Vec::new(),
            claims: Vec::new(),
            workload: seeds.workload(),
            faults,
            checker: {
                let mut c = Checker::new();
                c.set_tombstone_cap(store_options(tight).tombstone_cap);
                c
            },
            trace: Vec::new(),
            counters: BTreeMap::new(),
            created: 0,
            created_ids: Vec::new(),
            known_done: 0,
            signals: Vec::new(),
            fleets: Vec::new(),
            fleet_seen: BTreeSet::new(),
            fleet_rng: seeds.stream(crate::rng::Stream::Named("fleets")),
            replica_rng: seeds.stream(crate::rng::Stream::Named("replica")),
            unanswered: Vec::new(),
            twins: 0,
            twin_outputs: Vec::new(),
            next_workload_at: 0,
            next_fault_at: 5_000,
            replica_restore_at: None,
            exec_at: None,
            exec: seeds.stream(crate::rng::Stream::Named("executor")),
            crash_points: seeds.stream(crate::rng::Stream::Named("crash_points")),
            armed: None,
            points_passed: Arc::default(),
            signalled_now: None,
            calm: false,
            server_opens: 1,
            store_checked: None,
            calm_from: 0,
            calm_closes: BTreeMap::new(),
            acked_conns: BTreeSet::new(),
            calm_extra: 0,
            adversary_sent: BTreeMap::new(),
            adversary_awaiting: BTreeMap::new(),
            incident_armed: false,
            server_closed: std::collections::BTreeSet::new(),
            terms: Vec::new(),
            viewers: Vec::new(),
            term_opens: term_opens.into(),
            term_rng,
            terms_observed: None,
            failure: None,
        })
    }

    fn wall(&self) -> i64 {
        WALL_EPOCH_MS
            .saturating_add(i64::try_from(self.now).unwrap_or(i64::MAX))
            .saturating_add(self.wall_offset)
    }

    fn log(&mut self, line: String) {
        if self.trace.len() < MAX_TRACE_LINES {
            self.trace.push(format!("{:>9} {line}", self.now));
        }
    }

    fn count(&mut self, key: &str) {
        *self.counters.entry(key.to_owned()).or_default() += 1;
    }

    fn add(&mut self, key: &str, n: u64) {
        if n > 0 {
            *self.counters.entry(key.to_owned()).or_default() += n;
        }
    }

    /// Runs the engine call `f`; a crash-point panic becomes a server crash.
    fn with_engine(&mut self, f: impl FnOnce(&mut Engine, u64, i64)) {
        let (now, wall) = (self.now, self.wall());
        let Some(engine) = self.server.engine.as_mut() else {
            return;
        };
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(engine, now, wall)));
        if let Err(payload) = r {
            let at = payload
                .downcast_ref::<CrashedAt>()
                .map_or("unexpected panic", |c| c.0);
            if at == "unexpected panic" {
                self.failure = Some(format!("the engine panicked at t={now}"));
                return;
            }
            self.count(&format!("crash_point {at}"));
            self.crash_server(at);
            return;
        }
        self.flush_engine();
    }

    fn flush_engine(&mut self) {
        let mut outs = Vec::new();
        if let Some(e) = self.server.engine.as_mut() {
            while let Some(o) = e.poll_output() {
                outs.push(o);
            }
        }
        for o in outs {
            let to = match &o {
                Output::Frame { conn, .. }
                | Output::Ping { conn }
                | Output::Pong { conn }
                | Output::Close { conn, .. } => *conn,
                // the driver hands out connection outputs only
                _ => continue,
            };
            if to >= TWIN_CONN_BASE {
                self.twin_outputs.push(o);
                continue;
            }
            match o {
                Output::Frame { conn, bytes, .. } => {
                    if matches!(
                        payload_of(&bytes),
                        Some(wire::envelope::Payload::EventAck(_))
                    ) {
                        self.acked_conns.insert(conn);
                    }
                    self.check_dispatch(&bytes);
                    self.keep_dispatch(conn, &bytes);
                    // a contradictory snapshot is never reconciled
                    if self.adversary_awaiting.get(&conn) == Some(&Adversary::ContradictorySnapshot)
                        && matches!(
                            payload_of(&bytes),
                            Some(wire::envelope::Payload::ReconcileResult(_))
                        )
                        && self.failure.is_none()
                    {
                        self.failure = Some(format!(
                            "the adversary's contradictory snapshot on c{conn} was reconciled"
                        ));
                    }
                    let name = payload_name(&bytes);
                    self.log(format!("s>c{conn} {name} {}B", bytes.len()));
                    let _ =
                        self.net
                            .send(ConnId(conn), Dir::ToClient, Item::Binary(bytes), self.now);
                }
                Output::Ping { conn } => {
                    let _ = self
                        .net
                        .send(ConnId(conn), Dir::ToClient, Item::Ping, self.now);
                }
                Output::Pong { conn } => {
                    let _ = self
                        .net
                        .send(ConnId(conn), Dir::ToClient, Item::Pong, self.now);
                }
                Output::Close { conn, reason } => {
                    self.log(format!("s>c{conn} close {}", reason.as_str_name()));
                    self.count(&format!("server_close {}", reason.as_str_name()));
                    self.check_honest_close(conn, reason);
                    self.check_adversary_answer(conn, reason);
                    self.server_closed.insert(conn);
                    let code = rvbox_session::close_code(reason).unwrap_or(1000);
                    let _ =
                        self.net
                            .send(ConnId(conn), Dir::ToClient, Item::Close { code }, self.now);
                }
                _ => {}
            }
        }
    }

    /// Every adversary action gets exactly the answer the plan names: a
    /// stale generation `STALE_SESSION`; malformed bytes `PROTOCOL_ERROR`
    /// (or `STALE_SESSION` when the noise happens to decode as an envelope
    /// of another session); a conflicting duplicate event and a window
    /// overrun `PROTOCOL_ERROR` (the duplicate is refused by the store's
    /// comparison, and the overrun's copies may be spread by the network
    /// with acknowledgements between them, so a liveness timeout, a fence
    /// or a restart may close the session first: counted as preempted).
    fn check_adversary_answer(&mut self, conn: u64, reason: wire::CloseReason) {
        use wire::CloseReason as R;
        let Some(kind) = self.adversary_awaiting.remove(&conn) else {
            return;
        };
        let ok = match kind {
            Adversary::StaleGeneration => reason == R::StaleSession,
            Adversary::MalformedBytes => matches!(reason, R::ProtocolError | R::StaleSession),
            // the copies travel over the faulty network: acknowledgements
            // arriving between them free the window, and then there is no
            // overrun to answer until something else ends the session
            // the contradiction is found once the server read what it
            // knows of the snapshot's commands: only a restart or a fence
            // may come first
            Adversary::ContradictorySnapshot => matches!(
                reason,
                R::ProtocolError | R::SessionFenced | R::ServiceRestart
            ),
            Adversary::WindowOverrun | Adversary::ConflictingDuplicate => matches!(
                reason,
                R::ProtocolError | R::LivenessTimeout | R::SessionFenced | R::ServiceRestart
            ),
            // an exact repeat is never a protocol error: a close in the
            // step that delivered it has another cause (a restart, a fence)
            Adversary::ExactDuplicate => !matches!(reason, R::ProtocolError | R::StaleSession),
            Adversary::SecondInstance => true,
        };
        let exact = match kind {
            Adversary::StaleGeneration => reason == R::StaleSession,
            Adversary::ExactDuplicate => false,
            Adversary::SecondInstance => true,
            _ => reason == R::ProtocolError || reason == R::StaleSession,
        };
        if exact {
            self.count(&format!("adversary answered {kind:?}"));
        } else {
            self.count(&format!("adversary preempted {kind:?}"));
        }
        if !ok && self.failure.is_none() {
            self.failure = Some(format!(
                "the adversary's {kind:?} on c{conn} was answered with {}",
                reason.as_str_name()
            ));
        }
    }

    /// Makes the [`Breach`] due once every command ended, if any: on the
    /// first command that fits it, straight in the server's store.
    fn breach_at_the_end(&mut self) {
        let (Some(breach), Some(engine)) = (self.config.breach, self.server.engine.as_ref()) else {
            return;
        };
        let hosts: Vec<String> = self
            .clients
            .iter()
            .map(|c| c.client_id().to_owned())
            .collect();
        for id in &self.created_ids {
            let Ok(view) = engine.command(id) else {
                continue;
            };
            let sql = match breach {
                Breach::FlippedOutcome if view.lifecycle == Lifecycle::Succeeded => format!(
                    "UPDATE commands SET lifecycle = {}, exit_code = 1 WHERE issue_uuid = ?1",
                    Lifecycle::Failed.to_wire() as i32
                ),
                Breach::Readdressed => match hosts.iter().find(|h| **h != view.client_id) {
                    Some(other) if view.lifecycle == Lifecycle::Succeeded => {
                        format!("UPDATE commands SET client_id = '{other}' WHERE issue_uuid = ?1")
                    }
                    _ => continue,
                },
                _ => continue,
            };
            let done = engine.store().db().execute(&sql, [id.as_slice()]);
            self.log(format!(
                "BREACH {breach:?} of {}: {done:?}",
                crate::rng::uuid_text(id)
            ));
            return;
        }
    }

    /// Agreement (conventions rule 16): every command's terminal outcome
    /// on the server is what the client that ended it reported, and a
    /// command no client ended was ended by a server decision the history
    /// explains: expired, rejected or cancelled before any client held it,
    /// or interrupted with its incident.
    fn check_agreement(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let mut problems = Vec::new();
        for id in &self.created_ids {
            let Ok(view) = engine.command(id) else {
                continue; // reclaimed by retention
            };
            let Ok(issue) = Uuid7::from_bytes("issue_uuid", *id) else {
                continue;
            };
            let observed = self
                .clients
                .iter()
                .find_map(|c| c.ledger().outcomes().get(&issue).copied());
            let server = view.lifecycle;
            let explained = match observed {
                Some(seen) => seen == server || server == Lifecycle::Interrupted,
                None => matches!(
                    server,
                    Lifecycle::Expired
                        | Lifecycle::Rejected
                        | Lifecycle::Cancelled
                        | Lifecycle::Interrupted
                ),
            };
            // a server-decided interruption (stale server, client state
            // loss) has its incident; one the client reported is its own
            if server == Lifecycle::Interrupted
                && observed != Some(Lifecycle::Interrupted)
                && !has_incident(engine.store(), id)
            {
                problems.push(format!(
                    "{} interrupted without an incident",
                    crate::rng::uuid_text(id)
                ));
            } else if !explained {
                problems.push(format!(
                    "{} is {} on the server, the client reported {}",
                    crate::rng::uuid_text(id),
                    server.as_str(),
                    observed.map_or("nothing", |l| l.as_str())
                ));
            }
        }
        self.add("agreement commands_checked", self.created_ids.len() as u64);
        if let Some(first) = problems.first()
            && self.failure.is_none()
        {
            self.failure = Some(format!(
                "agreement: {} command(s) disagree, first: {first}",
                problems.len()
            ));
        }
    }

    /// An honest client's session is never closed as a protocol violation
    /// or for a store that is unavailable: the simulated store has no
    /// faults but crashes, so either is a server bug (conventions rule 16:
    /// a server that is safe because it refuses everyone fails the run).
    fn check_honest_close(&mut self, conn: u64, reason: wire::CloseReason) {
        let slot = self
            .net
            .connections()
            .into_iter()
            .find(|(c, _)| c.0 == conn)
            .map(|(_, slot)| slot);
        let Some(slot) = slot else {
            return;
        };
        let honest = self
            .clients
            .get(usize::try_from(slot.0).unwrap_or(usize::MAX))
            // a host that repeats events is not honest either: a repeat
            // costs window bytes its runtime does not know it spent, so
            // its next events may overrun the window (the repeat itself
            // must never close: see check_adversary_answer)
            .is_some_and(|c| c.config().adversary.is_none());
        // an overload close (a full quota tier, a closed ingress gate) is
        // transient by design: one that ends a session which stored
        // something is progress, not a loop (the tail's time bound still
        // holds); one that stored nothing counts
        let progressed = self.acked_conns.remove(&conn);
        let transient = reason == wire::CloseReason::IngressOverload && progressed;
        if honest && self.calm && !transient {
            let n = self.calm_closes.entry(slot.0).or_default();
            *n += 1;
            if *n > CALM_TAIL_CLOSES && self.failure.is_none() {
                self.failure = Some(format!(
                    "liveness: honest client {} closed {} times in the calm tail (last {})",
                    slot.0,
                    *n,
                    reason.as_str_name()
                ));
            }
        }
        if !matches!(
            reason,
            wire::CloseReason::ProtocolError | wire::CloseReason::StorageUnavailable
        ) {
            return;
        }
        if honest && self.failure.is_none() {
            self.failure = Some(format!(
                "honest client {} closed with {} (c{conn})",
                slot.0,
                reason.as_str_name()
            ));
        }
    }

    /// Keeps the last `Dispatch` frame sent on each connection per
    /// command (bounded), for [`Self::maybe_repeat_dispatch`].
    fn keep_dispatch(&mut self, conn: u64, bytes: &[u8]) {
        if self.calm || !self.config.faults {
            return;
        }
        if let Some(wire::envelope::Payload::Dispatch(d)) = payload_of(bytes) {
            if self.dispatches.len() >= MAX_KEPT_DISPATCHES {
                self.dispatches.pop_first();
            }
            self.dispatches.insert((conn, d.issue_uuid), bytes.to_vec());
        }
    }

    /// Now and then, once a host accepted a command, the server's
    /// `Dispatch` of it reaches the host again on the same connection (a
    /// replica taking over, a retried send): the host finds the command in
    /// its store, answers with the same acceptance and does nothing else;
    /// the server takes the repeated answer as a repeat.
    fn maybe_repeat_dispatch(&mut self, conn: u64, bytes: &[u8]) {
        if self.calm || !self.config.faults {
            return;
        }
        let Some(wire::envelope::Payload::CommandAccepted(a)) = payload_of(bytes) else {
            return;
        };
        if a.outcome != wire::AcceptOutcome::Positive as i32 {
            return;
        }
        let Some(frame) = self.dispatches.remove(&(conn, a.issue_uuid.clone())) else {
            return;
        };
        if !self.repeat_rng.chance(REPEAT_DISPATCH_PERMILLE) {
            return;
        }
        self.log(format!("REPEAT dispatch of {} on c{conn}", a.issue_uuid));
        self.count("dispatch_repeated");
        let _ = self
            .net
            .send(ConnId(conn), Dir::ToClient, Item::Binary(frame), self.now);
    }

    /// Now and then the link of a host goes silent just as it takes a
    /// `Dispatch` with a queue expiry still ahead, until a little past
    /// that expiry: the host accepts in time by its clock, and the
    /// acceptance reaches the server late (plan §6.4: accepted, an
    /// incident, and a termination at a higher revision).
    fn maybe_hold_acceptance(&mut self, client: ClientSlot, bytes: &[u8]) {
        if self.calm || !self.config.faults {
            return;
        }
        let Some(wire::envelope::Payload::Dispatch(d)) = payload_of(bytes) else {
            return;
        };
        let Some(expiry) = d
            .queue_expiry_time
            .map(|t| t.seconds.saturating_mul(1000) + i64::from(t.nanos / 1_000_000))
        else {
            return;
        };
        let left = u64::try_from(expiry.saturating_sub(self.wall())).unwrap_or(0);
        // short of a liveness timeout, so the session survives the hold
        if left == 0 || left > 20_000 || !self.late_rng.chance(600) {
            return;
        }
        let hold = left + 500 + self.late_rng.below(2_000);
        self.log(format!(
            "HOLD client {} for {hold} ms past the dispatch of {}",
            client.0, d.issue_uuid
        ));
        self.count("late_acceptance_provoked");
        self.net
            .partition(client, self.now.saturating_add(hold), self.now);
    }

    /// A `Dispatch` never carries work with a pending signal: such work
    /// was never held by the client, and a signal before launch cancels it
    /// (plan §6.4, R-6.4-37), so sending it again would let a killed
    /// command start.
    fn check_dispatch(&mut self, bytes: &[u8]) {
        let Some(wire::envelope::Payload::Dispatch(d)) = payload_of(bytes) else {
            return;
        };
        // A Dispatch committed before the signal of the same call (both
        // completions arrive in one flush, the Dispatch first on the wire)
        // is the order the store decided: the Signal frame follows it.
        if self.signalled_now.as_deref() == Some(d.issue_uuid.as_str()) {
            return;
        }
        let Ok(issue) = Uuid7::parse("issue_uuid", &d.issue_uuid) else {
            self.failure = Some(format!("a dispatch with issue_uuid {:?}", d.issue_uuid));
            return;
        };
        let pending = self
            .server
            .engine
            .as_ref()
            .and_then(|e| e.store().pending_signals(issue.as_bytes()).ok())
            .unwrap_or_default();
        if let Some(p) = pending.first() {
            self.failure = Some(format!(
                "{} dispatched at revision {} with a pending signal at revision {}",
                d.issue_uuid, d.revision, p.revision
            ));
        }
    }

    /// The server process dies: open connections die with it, unsynced
    /// bytes are lost or torn, and the store is reopened and recovered.
    fn crash_server(&mut self, at: &str) {
        let mode = if self.faults.chance(500) {
            CrashMode::LoseUnsynced
        } else {
            CrashMode::Tear {
                keep: self.faults.below(4096),
            }
        };
        self.log(format!("CRASH server at {at} ({mode:?})"));
        self.count("server_crash");
        // every viewer's stream ends ("restarting"): each attaches again
        // from the offset it printed
        for v in &mut self.viewers {
            v.attached = false;
        }
        if let Some(e) = self.server.engine.take() {
            // what the core had issued and not yet learned is lost with it
            if e.queued_ops() > 0 {
                self.count("crash_with ops_queued");
            }
            if e.undelivered() > 0 {
                self.count("crash_with completions_undelivered");
            }
            let stats = e.stats().clone();
            self.absorb_engine_stats(&stats, e.group_stats());
            e.into_store().close_as_crashed();
        }
        self.exec_at = None;
        // points armed and not yet reached stay armed after the restart
        let still_armed = self.armed.take().map(|h| h.remaining()).unwrap_or_default();
        for (conn, _) in self.net.connections() {
            self.net.crash(conn, Side::Server, self.now);
        }
        match self.server.fs.crash(mode) {
            Ok(lost) => {
                if lost > 0 {
                    self.count("unsynced_bytes_lost");
                }
            }
            Err(e) => {
                self.failure = Some(format!("power cut simulation failed: {e}"));
                return;
            }
        }
        let wall = self.wall();
        match open_store(
            self.server.dir.path(),
            &self.server.fs,
            &self.server.entropy,
            wall,
            self.server.tight,
        ) {
            Ok((store, report)) => {
                self.add("recovery tail_truncated", report.tails_truncated);
                self.add("recovery journal_redone", report.journal_segments_redone);
                self.add("recovery segments_damaged", report.segments_damaged);
                self.add("recovery orphans_removed", report.orphans_removed);
                self.add("recovery sessions_closed", report.sessions_closed);
                if report.segments_damaged > 0 {
                    // a journal or sync bug, never an honest power cut
                    self.failure = Some(format!(
                        "recovery found {} damaged committed segment(s) after a power cut",
                        report.segments_damaged
                    ));
                }
                match engine_over(
                    store,
                    &self.server.entropy,
                    self.server.tight,
                    self.server.small_windows,
                    self.server.pty,
                ) {
                    Ok(e) => {
                        self.server.engine = Some(e);
                        self.server_opens += 1;
                        self.rearm(still_armed);
                    }
                    Err(e) => self.failure = Some(e),
                }
            }
            Err(e) => self.failure = Some(format!("restart failed: {e}")),
        }
        self.checker_reset_generation();
    }

    /// What retention did in the run, read from the store at its end; and
    /// its one bound: the tombstone FIFO never holds more than its cap.
    fn retention_counters(&mut self) {
        use rvbox_store::db::Cached as _;
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let count = |sql: &str| -> u64 {
            engine
                .store()
                .db()
                .query_row_cached(sql, [], |r| r.get::<_, i64>(0))
                .map_or(0, |n| u64::try_from(n).unwrap_or(0))
        };
        let tombstones = count("SELECT COUNT(*) FROM command_tombstones");
        // what the contradictory snapshots left for the operator
        let contradictions = count(&format!(
            "SELECT COUNT(*) FROM storage_incidents WHERE kind = {}",
            wire::IncidentKind::ReconciliationContradiction as i32
        ));
        let truncations = count("SELECT COUNT(*) FROM output_truncations");
        // output dropped on arrival under quota pressure nothing relieved
        let dropped = count(
            "SELECT COUNT(*) FROM output_truncations WHERE reason LIKE '%dropped on arrival%'",
        );
        // the client registry's bounds: kept sessions per client, and its
        // counters equal to a recount
        let most_sessions = count(
            "SELECT COALESCE(MAX(n), 0) FROM (SELECT COUNT(*) AS n FROM sessions GROUP BY client_id)",
        );
        let kept = rvbox_store::registry::CLOSED_SESSIONS_KEPT + 1;
        if most_sessions > kept && self.failure.is_none() {
            self.failure = Some(format!(
                "a client holds {most_sessions} session rows, above the kept {kept}"
            ));
        }
        if let Ok(c) = engine.store().registry_counts()
            && c.counters != c.recount
            && self.failure.is_none()
        {
            self.failure = Some(format!(
                "registry counters {:?} differ from the recount {:?}",
                c.counters, c.recount
            ));
        }
        let cap = store_options(self.server.tight).tombstone_cap;
        if self.server.tight {
            self.count("retention tight_quotas");
            if tombstones == cap {
                self.count("retention tombstone_fifo_full");
            }
        }
        self.add("retention output_truncations", truncations);
        self.add("retention output_dropped", dropped);
        self.add("adversary contradiction_incidents", contradictions);

        if tombstones > cap && self.failure.is_none() {
            self.failure = Some(format!(
                "{tombstones} tombstones kept, above the FIFO cap {cap}"
            ));
        }
    }

    /// Every created command not yet terminal, and every fleet run not
    /// done, described for a failure.
    fn unfinished(&self) -> Vec<String> {
        let mut runs: Vec<String> = self
            .server
            .engine
            .as_ref()
            .and_then(|e| {
                let mut st = e
                    .store()
                    .db()
                    .prepare(
                        "SELECT hex(run_id), state, n_pending, n_queued, n_running FROM fleet_runs WHERE state < 4",
                    )
                    .ok()?;
                let rows = st
                    .query_map([], |r| {
                        Ok(format!(
                            "fleet run {} in state {} ({} pending, {} queued, {} running)",
                            r.get::<_, String>(0)?,
                            r.get::<_, i64>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, i64>(4)?
                        ))
                    })
                    .ok()?;
                Some(rows.filter_map(Result::ok).collect())
            })
            .unwrap_or_default();
        runs.extend(
            self.created_ids
                .iter()
                .filter_map(|id| {
                    let v = self.server.engine.as_ref()?.command(id).ok()?;
                    (!v.lifecycle.is_terminal()).then(|| {
                        format!(
                            "{} {} on {} (revision {}, expired_pending {})",
                            crate::rng::uuid_text(id),
                            v.lifecycle.as_str(),
                            v.client_id,
                            v.revision,
                            v.expired_pending
                        )
                    })
                })
                .collect::<Vec<_>>(),
        );
        runs.extend(self.terms.iter().filter(|p| !p.done()).map(|p| {
            format!(
                "terminal {} on host-{} (opened {}, call in flight {:?}, close sent {}, {} frames typed, input confirmed to {})",
                p.text,
                p.host,
                p.opened,
                p.pending,
                p.close_sent,
                p.typed.len(),
                p.input_confirmed
            )
        }));
        let viewers = self.viewers.iter().filter(|v| !v.done).count();
        if viewers > 0 {
            runs.push(format!(
                "{viewers} terminal viewer(s) never saw their terminal end"
            ));
        }
        runs
    }

    /// Adds an engine's counters to the run's: they survive a crash.
    fn absorb_engine_stats(&mut self, stats: &rvbox_engine::EngineStats, groups: (u64, u64)) {
        self.add("executor append_groups", groups.0);
        // appends that shared a durable group with another connection's
        self.add(
            "executor appends_grouped",
            groups.1.saturating_sub(groups.0),
        );
        for (k, v) in [
            ("engine fenced", stats.fenced),
            ("engine writes_fenced", stats.writes_fenced),
            ("engine live_conflicts", stats.live_conflicts),
            ("engine reconciled", stats.reconciled),
            ("engine requeued", stats.requeued),
            ("engine expired", stats.expired),
            ("engine events_refused", stats.events_refused),
            ("engine signals_sent_again", stats.signals_sent_again),
            ("engine late_acceptances", stats.late_acceptances),
            ("engine script_uploads", stats.script_uploads),
            ("engine store_failures", stats.store_failures),
            ("engine foreign_completions", stats.foreign_completions),
            ("engine control_lane_full", stats.control_lane_full),
            ("engine data_lane_waits", stats.data_lane_waits),
            ("engine ingest_queue_full", stats.ingest_queue_full),
            ("engine gate_changes", stats.gate_changes),
            ("engine maintenance_passes", stats.maintenance_passes),
            ("engine maintenance_hastened", stats.maintenance_hastened),
            ("engine scrub_slices", stats.scrub_slices),
            (
                "engine scrub_segments_verified",
                stats.scrub_segments_verified,
            ),
            ("engine evicted", stats.evicted),
            ("engine rotations", stats.rotations),
            ("engine clients_pruned", stats.clients_pruned),
            ("engine audits_flushed", stats.audits_flushed),
            ("engine audits_written", stats.audits_written),
            ("engine audits_suppressed", stats.audits_suppressed),
            ("engine rounds_restarted", stats.rounds_restarted),
        ] {
            self.add(k, v);
        }
    }

    /// The simulated executor: store operations are performed a little
    /// after the core issued them, several at once (appends of many
    /// connections in one group), and their completions reach the core
    /// later still; a crash in between loses the completions.
    fn executor_step(&mut self) {
        let Some(e) = self.server.engine.as_ref() else {
            return;
        };
        let (queued, undelivered) = (e.queued_ops(), e.undelivered());
        if queued == 0 && undelivered == 0 {
            self.exec_at = None;
            return;
        }
        match self.exec_at {
            None => {
                let delay = if self.exec.chance(100) {
                    self.exec.range_inclusive(5..=40)
                } else {
                    self.exec.below(3)
                };
                self.exec_at = Some(self.now.saturating_add(delay.max(1)));
                return;
            }
            Some(t) if t > self.now => return,
            Some(_) => {}
        }
        self.exec_at = None;
        // a group of any size; completions of what was performed earlier
        // may still be in transit
        let perform = if self.exec.chance(700) {
            usize::MAX
        } else {
            usize::try_from(self.exec.range_inclusive(1..=8)).unwrap_or(1)
        };
        let deliver = if self.exec.chance(800) {
            usize::MAX
        } else {
            usize::try_from(self.exec.below(4)).unwrap_or(0)
        };
        let mut moved = (0, 0);
        // completions of an earlier step reach the core first; what is
        // performed now is answered at a later step, so a crash between
        // steps can fall after the commit and before the core learns of it
        self.with_engine(|e, now, wall| {
            moved.1 = e.deliver(now, wall, deliver);
            moved.0 = e.perform(perform);
        });
        self.log(format!("exec performed {} delivered {}", moved.0, moved.1));
        if self
            .server
            .engine
            .as_ref()
            .is_some_and(|e| e.queued_ops() > 0 || e.undelivered() > 0)
        {
            self.exec_at = Some(self.now.saturating_add(1));
        }
    }

    fn checker_reset_generation(&mut self) {
        // sessions were closed by recovery; nothing else to reset: the
        // checker's memory of lifecycles, revisions and generations must
        // survive the crash, that is the point
    }

    fn deliver(&mut self, d: Delivery) {
        match d.dir {
            Dir::ToServer => {
                let conn = d.conn.0;
                match d.event {
                    NetEvent::Opened => {
                        self.log(format!("c{conn} open (client {})", d.client.0));
                        self.with_engine(|e, now, _| e.connect(now, conn));
                    }
                    NetEvent::Item(Item::Binary(b)) => {
                        let name = payload_name(&b);
                        self.log(format!("c{conn}>s {name} {}B", b.len()));
                        // the adversary's frame reached the server: its
                        // answer is checked at the connection's close
                        if self
                            .adversary_sent
                            .get(&conn)
                            .is_some_and(|(_, sent)| *sent == b)
                            && let Some((kind, _)) = self.adversary_sent.remove(&conn)
                            // a connection the server already closed
                            // discards whatever still arrives on it
                            && !self.server_closed.contains(&conn)
                        {
                            self.adversary_awaiting.insert(conn, kind);
                            // the incident the contradiction records is the
                            // one commit of the server no other path reaches
                            if kind == Adversary::ContradictorySnapshot && !self.incident_armed {
                                self.incident_armed = true;
                                self.arm_at(points::INCIDENT_AFTER_COMMIT, 1);
                            }
                        }
                        self.maybe_repeat_dispatch(conn, &b);
                        self.with_engine(|e, now, wall| e.frame(now, wall, conn, b));
                        // an exact repeat is answered by not closing: it
                        // was taken (and acknowledged) like the first copy
                        if self.adversary_awaiting.get(&conn) == Some(&Adversary::ExactDuplicate)
                            && self.server.engine.is_some()
                        {
                            self.adversary_awaiting.remove(&conn);
                            self.count("adversary answered ExactDuplicate");
                        }
                        if let Some(kind) = self.adversary_awaiting.get(&conn).copied()
                            && adversary_closes_at_once(kind)
                            && self.server.engine.is_some()
                            && self.failure.is_none()
                        {
                            self.failure = Some(format!(
                                "the adversary's {kind:?} frame on c{conn} was not answered with a close"
                            ));
                        }
                    }
                    NetEvent::Item(Item::Pong) => {
                        self.with_engine(|e, now, wall| e.pong(now, wall, conn));
                    }
                    NetEvent::Item(Item::Ping) => {
                        self.with_engine(|e, now, wall| e.ping(now, wall, conn));
                    }
                    NetEvent::Item(Item::Close { .. }) | NetEvent::Closed { .. } => {
                        self.log(format!("c{conn} closed at server"));
                        self.with_engine(|e, now, wall| e.disconnected(now, wall, conn));
                    }
                }
            }
            Dir::ToClient => {
                let idx = usize::try_from(d.client.0).unwrap_or(usize::MAX);
                // the client took an engine frame off the wire: the
                // server's writer has room for the next (a slow or stalled
                // reader leaves frames waiting in the server's lanes)
                let from_engine = matches!(
                    d.event,
                    NetEvent::Item(Item::Binary(_) | Item::Ping | Item::Pong)
                );
                let conn = d.conn.0;
                if from_engine {
                    self.with_engine(|e, now, wall| e.written(now, wall, conn));
                }
                if let NetEvent::Item(Item::Binary(b)) = &d.event {
                    self.maybe_hold_acceptance(d.client, b);
                }
                if let Some(c) = self.clients.get_mut(idx) {
                    c.handle(
                        self.now,
                        ClientInput::Delivered {
                            conn: d.conn,
                            event: d.event,
                        },
                    );
                }
            }
        }
    }

    fn drain_clients(&mut self) {
        for _ in 0..10_000 {
            let mut any = false;
            for i in 0..self.clients.len() {
                while let Some(e) = self.clients.get_mut(i).and_then(SimHost::poll_effect) {
                    any = true;
                    match e {
                        ClientEffect::Connect => {
                            let slot = ClientSlot(u32::try_from(i).unwrap_or(u32::MAX));
                            let r = self.net.connect(slot, self.now);
                            if let Some(c) = self.clients.get_mut(i) {
                                match r {
                                    Ok(conn) => c.handle(self.now, ClientInput::Connected(conn)),
                                    Err(_) => c.handle(self.now, ClientInput::ConnectFailed),
                                }
                            }
                        }
                        ClientEffect::Send { conn, item } => {
                            let _ = self.net.send(conn, Dir::ToServer, item, self.now);
                        }
                    }
                }
            }
            for i in 0..self.clients.len() {
                while let Some((conn, point)) =
                    self.clients.get_mut(i).and_then(SimHost::take_crashed)
                {
                    any = true;
                    self.log(format!("CRASH client {i} at {point}"));
                    self.count("client_crash_point");
                    self.count(&format!("client_crash_point {point}"));
                    if let Some(conn) = conn {
                        self.net.crash(conn, Side::Client, self.now);
                    }
                }
            }
            for i in 0..self.clients.len() {
                if let Some((conn, kind, bytes)) =
                    self.clients.get_mut(i).and_then(SimHost::take_misbehaviour)
                {
                    self.count(&format!("adversary sent {kind:?}"));
                    if kind != Adversary::SecondInstance {
                        self.adversary_sent.insert(conn.0, (kind, bytes));
                    }
                }
            }
            if !any {
                return;
            }
        }
        self.failure = Some("clients never stopped producing effects".into());
    }

    fn create_command(&mut self) {
        let n = u32::try_from(self.clients.len()).unwrap_or(1).max(1);
        let i = self.workload.below(u64::from(n));
        let id = self
            .workload
            .uuid_v7(u64::try_from(self.wall()).unwrap_or(0));
        let text = format!("job-{}", self.workload.next_u32());
        let ttl = if self.workload.chance(250) {
            // a short TTL now and then, so expiry paths run: half of them
            // a second or two, which a stalled link or a partition between
            // the dispatch and the acceptance outlasts (a late acceptance)
            let seconds = if self.workload.chance(500) {
                1 + self.workload.below(3)
            } else {
                5 + self.workload.below(60)
            };
            Some(prost_types::Duration {
                seconds: i64::try_from(seconds).unwrap_or(5),
                nanos: 0,
            })
        } else {
            None
        };
        // drawn before the script choice (and its bytes) so that the
        // earlier draws keep their values; the signal is still sent after
        // the command is created
        let signal = self.workload.chance(150);
        let (source, script) = if self.workload.chance(100) {
            // a script upload now and then: incompressible bytes, so one
            // over 64 KiB goes to the store's blob segment and the client
            // receives it in several chunks
            let size = self.workload.range_inclusive(1..=MAX_WORKLOAD_SCRIPT_BYTES);
            let bytes = self
                .workload
                .bytes(usize::try_from(size).unwrap_or(1).max(1));
            let descriptor = wire::ScriptDescriptor {
                display_basename: "job.sh".into(),
                size_bytes: u64::try_from(bytes.len()).unwrap_or(size),
                sha256: rvbox_segment::sha256(&bytes).to_vec(),
            };
            (wire::execution_spec::Source::Script(descriptor), bytes)
        } else {
            (wire::execution_spec::Source::CommandText(text), Vec::new())
        };
        let script_bytes = script.len();
        // now and then a profile no client here can enforce: refused
        // permanently at acceptance, ended by the server as rejected
        let profile_flags = if self.workload.chance(40) {
            vec![wire::ProfileFlag::CpuLow as i32]
        } else {
            Vec::new()
        };
        let req = wire::RunCommandRequest {
            request_id: crate::rng::uuid_text(&id),
            client_id: format!("host-{i}"),
            spec: Some(wire::ExecutionSpec {
                source: Some(source),
                profile_flags,
                ..Default::default()
            }),
            script,
            queue_ttl: ttl,
        };
        // a crash that swallows the answer is answered by rvc's retry with
        // the same request id: the stored result if the first call
        // committed (else the command would run untracked by the oracles
        // and its stdin never closed: seed 101294), a new command if not
        let mut created = false;
        for attempt in 0..8 {
            let mut answer = None;
            self.with_engine(|e, _, wall| answer = Some(e.run_command(&req, wall)));
            match answer {
                Some(Ok(r)) => {
                    created = true;
                    if attempt > 0 {
                        self.count("run_command retried");
                    }
                    if r.issue_uuid != req.request_id {
                        self.failure = Some(format!(
                            "RunCommand {} answered with command {}",
                            req.request_id, r.issue_uuid
                        ));
                    }
                    break;
                }
                Some(Err(e)) => {
                    // a retry of a call that may have committed is
                    // answered with its stored result, never refused as
                    // a conflict with itself (the first call either
                    // committed, or did nothing)
                    let code = e.to_domain().code();
                    if attempt > 0
                        && matches!(
                            code,
                            rvbox_domain::error::Code::Conflict
                                | rvbox_domain::error::Code::AlreadyExecuted
                        )
                    {
                        self.failure = Some(format!(
                            "RunCommand {} retried with its request id after a lost answer was refused: {:?}",
                            req.request_id,
                            e.to_domain()
                        ));
                    }
                    break;
                }
                None => self.count("run_command unanswered"),
            }
        }
        if !created
            && self
                .server
                .engine
                .as_ref()
                .is_some_and(|e| e.command(&id).is_ok())
        {
            // a retry refused before the store looked the request up (an
            // unavailable scope after the restart): the first call had
            // committed, and the operator finds the command by its id
            self.count("run_command found after a refusal");
            created = true;
        }
        if created {
            self.created += 1;
            self.created_ids.push(id);
            self.requests.client.insert(id, format!("host-{i}"));
            self.plan_stdin(id);
            if script_bytes > 0 {
                self.count("workload scripts");
                self.log(format!(
                    "run {} on host-{i} (script of {script_bytes} bytes)",
                    crate::rng::uuid_text(&id)
                ));
            } else {
                self.log(format!("run {} on host-{i}", crate::rng::uuid_text(&id)));
            }
            self.with_engine(|e, now, wall| e.tick(now, wall));
        }
        if signal {
            self.operator_signal();
        }
        if self.takeover_rng.chance(40) {
            self.operator_takeover();
        }
        if self.fleet_rng.chance(120) {
            self.operator_fleet();
        }
    }

    /// Plans an operator's stdin writes and close for a new command.
    fn plan_stdin(&mut self, id: [u8; 16]) {
        if self.stdin_plans.len() < MAX_STDIN_PLANS {
            let appends_left = u32::try_from(self.stdin_rng.below(4)).unwrap_or(0);
            let at = self.now.saturating_add(self.stdin_rng.below(20_000));
            self.stdin_plans.push(StdinPlan {
                id,
                at,
                appends_left,
                pending: None,
                since: at,
                maybe_committed: false,
            });
        }
    }

    /// An operator's fleet run (all hosts, a glob, a label selector or a
    /// list of hosts, now and then with `max_parallel` and `max_errors`),
    /// the replay of an earlier one (answered as the first time), or the
    /// cancel of a live one.
    fn operator_fleet(&mut self) {
        if self.fleet_rng.chance(200)
            && let Some((req, first)) = self.fleet_rng.pick(&self.fleets).cloned()
        {
            // a run retention reclaimed is refused by its tombstone while
            // the FIFO keeps it (a store test); past that bound, as for a
            // command, its id is not guarded: never replayed here
            let kept = self.server.engine.as_ref().is_some_and(|e| {
                Uuid7::parse("fleet_run_id", &req.request_id).is_ok_and(|id| {
                    e.store()
                        .db()
                        .query_row(
                            "SELECT EXISTS (SELECT 1 FROM fleet_runs WHERE run_id = ?1)",
                            [id.as_bytes().as_slice()],
                            |r| r.get::<_, bool>(0),
                        )
                        .unwrap_or(false)
                })
            });
            if !kept {
                self.count("fleet replay of a reclaimed run skipped");
                return;
            }
            self.log(format!("fleet {} replayed", req.request_id));
            let mut again = None;
            self.with_engine(|e, _, wall| again = Some(e.run_fleet(&req, wall)));
            match again {
                Some(Ok(resp)) => {
                    self.count("fleet replayed");
                    if resp != first {
                        self.failure = Some(format!(
                            "RunFleet {} replayed as {resp:?}, first answered {first:?}",
                            req.request_id
                        ));
                    }
                }
                Some(Err(e)) if e.to_domain().code() != Code::Unavailable => {
                    self.failure = Some(format!(
                        "RunFleet {} replayed was refused: {:?}",
                        req.request_id,
                        e.to_domain()
                    ));
                }
                _ => {}
            }
            return;
        }
        if self.fleet_rng.chance(350) {
            self.operator_fleet_cancel();
            return;
        }
        let wall = u64::try_from(self.wall()).unwrap_or(0);
        let id = self.fleet_rng.uuid_v7(wall);
        let n = u64::from(self.config.clients);
        let selection = match self.fleet_rng.below(4) {
            0 => wire::FleetSelection {
                all: true,
                ..Default::default()
            },
            1 => wire::FleetSelection {
                client_glob: "host-*".into(),
                ..Default::default()
            },
            2 => wire::FleetSelection {
                selector: format!("parity={}", self.fleet_rng.below(2)),
                ..Default::default()
            },
            _ => {
                let a = self.fleet_rng.below(n.max(1));
                let b = (a + 1 + self.fleet_rng.below(n.max(2) - 1)) % n.max(1);
                let mut ids = vec![format!("host-{a}"), format!("host-{b}")];
                ids.sort();
                ids.dedup();
                wire::FleetSelection {
                    client_ids: ids,
                    ..Default::default()
                }
            }
        };
        let count = |v: u64| wire::FleetLimit {
            limit: Some(wire::fleet_limit::Limit::Count(
                u32::try_from(v).unwrap_or(1),
            )),
        };
        let max_parallel = self
            .fleet_rng
            .chance(600)
            .then(|| count(1 + self.fleet_rng.below(2)));
        let max_errors = self
            .fleet_rng
            .chance(300)
            .then(|| count(1 + self.fleet_rng.below(2)));
        let req = wire::RunFleetRequest {
            request_id: crate::rng::uuid_text(&id),
            selection: Some(selection),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText(format!(
                    "job-{}",
                    self.fleet_rng.next_u32()
                ))),
                ..Default::default()
            }),
            max_parallel,
            max_errors,
            ..Default::default()
        };
        // a crash that swallows the answer is answered by rvc's retry with
        // the same request id: the stored result, never a second run
        for attempt in 0..8 {
            let mut answer = None;
            self.with_engine(|e, _, wall| answer = Some(e.run_fleet(&req, wall)));
            match answer {
                Some(Ok(r)) => {
                    self.count("fleet runs");
                    if attempt > 0 {
                        self.count("fleet retried");
                    }
                    self.log(format!(
                        "fleet {} on {} target(s)",
                        req.request_id, r.targets
                    ));
                    if self.fleets.len() < MAX_KEPT_FLEETS {
                        self.fleets.push((req, r));
                    }
                    break;
                }
                Some(Err(e)) => {
                    let code = e.to_domain().code();
                    if attempt > 0 && matches!(code, Code::Conflict | Code::AlreadyExecuted) {
                        self.failure = Some(format!(
                            "RunFleet {} retried after a lost answer was refused: {:?}",
                            req.request_id,
                            e.to_domain()
                        ));
                    }
                    self.log(format!("fleet {} refused: {e:?}", req.request_id));
                    break;
                }
                None => self.count("fleet unanswered"),
            }
        }
        self.with_engine(|e, now, wall| e.tick(now, wall));
    }

    /// `CancelFleetRun` of a kept run: every target may get a TERM (the
    /// signal oracle is told so).
    fn operator_fleet_cancel(&mut self) {
        let Some((run, _)) = self.fleet_rng.pick(&self.fleets).cloned() else {
            return;
        };
        let issues: Vec<[u8; 16]> = self.server.engine.as_ref().map_or_else(Vec::new, |e| {
            let Ok(run_id) = Uuid7::parse("fleet_run_id", &run.request_id) else {
                return Vec::new();
            };
            let Ok(mut st) = e
                .store()
                .db()
                .prepare("SELECT issue_uuid FROM fleet_targets WHERE run_id = ?1")
            else {
                return Vec::new();
            };
            st.query_map([run_id.as_bytes().as_slice()], |r| r.get::<_, Vec<u8>>(0))
                .map(|rows| {
                    rows.filter_map(Result::ok)
                        .filter_map(|b| <[u8; 16]>::try_from(b.as_slice()).ok())
                        .collect()
                })
                .unwrap_or_default()
        });
        let wall = u64::try_from(self.wall()).unwrap_or(0);
        let request_id = crate::rng::uuid_text(&self.fleet_rng.uuid_v7(wall));
        for issue in &issues {
            self.signal_may_apply.insert(
                format!("{request_id}/{}", crate::rng::uuid_text(issue)),
                (*issue, wire::SignalKind::Term),
            );
        }
        let action = rvbox_store_port::fleet::FleetAction::Cancel(wire::CancelFleetRunRequest {
            request_id,
            fleet_run_id: run.request_id.clone(),
        });
        // a lost answer is asked again with the same request id: the
        // stored answer, and no second TERM
        let mut first: Option<rvbox_store_port::fleet::FleetAnswer> = None;
        for attempt in 0..8 {
            let mut answer = None;
            let a = action.clone();
            self.with_engine(|e, _, wall| answer = Some(e.fleet_action(a, wall)));
            match answer {
                Some(Ok(a)) => {
                    if attempt > 0 {
                        self.count("fleet cancel retried");
                    }
                    self.count("fleet cancelled");
                    self.log(format!("fleet {} cancelled", run.request_id));
                    first = Some(a);
                    break;
                }
                Some(Err(e)) => {
                    self.log(format!("fleet {} cancel refused: {e:?}", run.request_id));
                    break;
                }
                None => self.count("fleet cancel unanswered"),
            }
        }
        // the same cancel once more: the same answer
        if let Some(first) = first {
            let mut again = None;
            self.with_engine(|e, _, wall| again = Some(e.fleet_action(action, wall)));
            if let Some(Ok(a)) = again
                && a != first
                && self.failure.is_none()
            {
                self.failure = Some(format!(
                    "CancelFleetRun of {} replayed as {a:?}, first answered {first:?}",
                    run.request_id
                ));
            }
        }
    }

    /// Tracks every released fleet target's command like a created one
    /// (the oracles, agreement and liveness then cover it).
    fn sync_fleet_targets(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let rows: Vec<(Vec<u8>, String)> = match engine.store().db().prepare_cached(
            "SELECT issue_uuid, client_id FROM fleet_targets WHERE lifecycle IS NOT NULL",
        ) {
            Ok(mut st) => st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .map(|rows| rows.filter_map(Result::ok).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        for (issue, client) in rows {
            let Ok(id) = <[u8; 16]>::try_from(issue.as_slice()) else {
                continue;
            };
            if self.fleet_seen.insert(id) {
                self.created_ids.push(id);
                self.requests.client.insert(id, client);
                self.count("fleet targets released");
                // an operator writes to its stdin and closes it, as to any
                // command (a tree may read stdin to its end before it exits)
                self.plan_stdin(id);
            }
        }
    }

    /// The rate a fleet run promises, against the processes really
    /// running: never more of a run's targets running at once than its
    /// `max_parallel` (counting those the server has not ended).
    fn check_fleet_parallel(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let Ok(limits) = rvbox_store::fleet::parallel_limits(engine.store().db()) else {
            return;
        };
        if limits.is_empty() {
            return;
        }
        let log = self
            .process_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut problem = None;
        for (limit, issues) in &limits {
            let running = issues
                .iter()
                .filter(|id| {
                    Uuid7::from_bytes("issue_uuid", **id).is_ok_and(|u| {
                        log.records()
                            .get(&u)
                            .is_some_and(|r| r.starts > 0 && r.ended.is_none())
                    }) && engine.command(id).is_ok_and(|v| !v.lifecycle.is_terminal())
                })
                .count() as u64;
            if running > *limit {
                problem = Some(format!(
                    "fleet: {running} targets of one run run at once, above its max_parallel {limit}"
                ));
            }
        }
        drop(log);
        self.count("fleet parallel_checks");
        if let Some(p) = problem
            && self.failure.is_none()
        {
            self.failure = Some(p);
        }
    }

    /// `AuthorizeClientTakeover` for a client, with an instance id no
    /// host uses (the grant expires unused), or the replay of an earlier
    /// grant, which must be answered exactly as the first time.
    fn operator_takeover(&mut self) {
        if self.takeover_rng.chance(300)
            && let Some((req, first)) = self.takeover_rng.pick(&self.takeovers).cloned()
        {
            let mut again = None;
            self.with_engine(|e, now, wall| again = Some(e.authorize_takeover(now, wall, &req)));
            if let Some(Ok(resp)) = again {
                self.count("operator_takeover_replayed");
                if resp != first {
                    self.failure = Some(format!(
                        "AuthorizeClientTakeover {} replayed as {resp:?}, first answered {first:?}",
                        req.request_id
                    ));
                }
            }
            return;
        }
        // mostly a refused second instance's pending claim (the grant
        // waits for a connection that never comes), else an instance that
        // never claimed (refused)
        let wall = u64::try_from(self.wall()).unwrap_or(0);
        let request_id = self.takeover_rng.uuid_v7(wall);
        let (client_id, instance) = match self.takeover_rng.pick(&self.claims).cloned() {
            Some(claim) if self.takeover_rng.chance(700) => claim,
            _ => {
                let i = self.takeover_rng.below(u64::from(self.config.clients));
                let instance = self.takeover_rng.uuid_v4();
                (format!("host-{i}"), crate::rng::uuid_text(&instance))
            }
        };
        let req = wire::AuthorizeClientTakeoverRequest {
            request_id: crate::rng::uuid_text(&request_id),
            client_id,
            client_instance_id: instance,
        };
        let mut answer = None;
        self.with_engine(|e, now, wall| answer = Some(e.authorize_takeover(now, wall, &req)));
        match answer {
            Some(Ok(resp)) => {
                self.count("operator_takeover");
                self.log(format!("takeover of {} authorized", req.client_id));
                if self.takeovers.len() < MAX_KEPT_SIGNALS {
                    self.takeovers.push((req, resp));
                }
            }
            Some(Err(e)) => {
                self.log(format!("takeover of {} refused: {e:?}", req.client_id));
                self.count("operator_takeover_refused");
            }
            None => {}
        }
    }

    /// An operator's `SignalCommand` on a command created earlier, at any
    /// stage; now and then an earlier request is replayed, which must be
    /// answered exactly as the first time (across crashes too).
    fn operator_signal(&mut self) {
        // a request whose answer a server crash swallowed is sent again,
        // as an operator's retry would: the stored answer, or the first
        if let Some(req) = self.unanswered.pop() {
            let mut again = None;
            self.signalled_now = Some(req.issue_uuid.clone());
            self.with_engine(|e, now, wall| again = Some(e.signal_command(now, wall, &req)));
            self.signalled_now = None;
            match again {
                None => self.unanswered.push(req),
                Some(Err(e))
                    if matches!(
                        e.to_domain().code(),
                        Code::NotFound | Code::FailedPrecondition
                    ) =>
                {
                    // never committed: the retry would have answered it
                    self.signal_may_apply.remove(&req.request_id);
                    self.check_replay_refusal(&req, &e);
                }
                Some(Ok(resp)) => {
                    self.count("operator_signal_retried");
                    if self.signals.len() < MAX_KEPT_SIGNALS {
                        self.signals.push((req, resp));
                    }
                }
                Some(Err(e)) => self.check_replay_refusal(&req, &e),
            }
            return;
        }
        if self.workload.chance(250)
            && let Some((req, first)) = self.workload.pick(&self.signals).cloned()
        {
            let mut again = None;
            self.signalled_now = Some(req.issue_uuid.clone());
            self.with_engine(|e, now, wall| again = Some(e.signal_command(now, wall, &req)));
            self.signalled_now = None;
            match again {
                Some(Ok(resp)) => {
                    self.count("operator_signal_replayed");
                    if resp != first {
                        self.failure = Some(format!(
                            "SignalCommand {} replayed as {resp:?}, first answered {first:?}",
                            req.request_id
                        ));
                    }
                }
                Some(Err(e)) => self.check_replay_refusal(&req, &e),
                None => {}
            }
            return;
        }
        // mostly work that has not ended, where a signal does something
        let live: Vec<[u8; 16]> = self
            .server
            .engine
            .as_ref()
            .map(|e| {
                self.created_ids
                    .iter()
                    .filter(|id| e.command(id).is_ok_and(|v| !v.lifecycle.is_terminal()))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        let pool = if live.is_empty() || self.workload.chance(100) {
            &self.created_ids
        } else {
            &live
        };
        let Some(id) = self.workload.pick(pool).copied() else {
            return;
        };
        let kinds = [
            wire::SignalKind::Term,
            wire::SignalKind::Kill,
            wire::SignalKind::Int,
            wire::SignalKind::Hup,
        ];
        let kind = self
            .workload
            .pick(&kinds)
            .copied()
            .unwrap_or(wire::SignalKind::Term);
        let request_id = self
            .workload
            .uuid_v7(u64::try_from(self.wall()).unwrap_or(0));
        let req = wire::SignalCommandRequest {
            request_id: crate::rng::uuid_text(&request_id),
            issue_uuid: crate::rng::uuid_text(&id),
            signal: kind as i32,
        };
        let mut answer = None;
        self.signalled_now = Some(req.issue_uuid.clone());
        self.with_engine(|e, now, wall| answer = Some(e.signal_command(now, wall, &req)));
        self.signalled_now = None;
        if matches!(answer, None | Some(Ok(_))) {
            self.signal_may_apply
                .insert(req.request_id.clone(), (id, kind));
        }
        match answer {
            Some(Ok(resp)) => {
                self.count("operator_signal");
                self.log(format!(
                    "signal {} {} -> revision {}",
                    req.issue_uuid,
                    kind.as_str_name(),
                    resp.revision
                ));
                if self.signals.len() < MAX_KEPT_SIGNALS {
                    self.signals.push((req, resp));
                }
            }
            Some(Err(e)) => {
                self.count("operator_signal_refused");
                self.log(format!("signal {} refused: {e}", req.issue_uuid));
            }
            None => {
                if self.unanswered.len() < MAX_KEPT_SIGNALS {
                    self.unanswered.push(req);
                }
            }
        }
    }

    /// A repeated `SignalCommand` may only fail transiently (the store is
    /// unavailable), because its command is gone, or because the first
    /// attempt never committed and the command has ended since; never
    /// with a conflict or anything else.
    fn check_replay_refusal(&mut self, req: &wire::SignalCommandRequest, e: &PortError) {
        let code = e.to_domain().code();
        let acceptable = matches!(
            code,
            Code::Unavailable | Code::NotFound | Code::FailedPrecondition
        );
        self.log(format!(
            "signal {} again refused: {}",
            req.request_id,
            code.as_str()
        ));
        if !acceptable {
            self.failure = Some(format!(
                "SignalCommand {} sent again was refused with {}: {e}",
                req.request_id,
                code.as_str()
            ));
        }
    }

    /// Arms a crash at the `after`-th next pass of a named store point,
    /// chosen by `rng`.
    fn arm_crash_point(&mut self, from_crash_stream: bool) {
        // half the time a point this run passed and never crashed at, so
        // that rarely passed points fire too
        let passed: Vec<&'static str> = self
            .points_passed
            .lock()
            .map(|p| {
                CRASH_POINTS
                    .iter()
                    .copied()
                    .filter(|c| p.contains(c))
                    .filter(|c| !self.counters.contains_key(&format!("crash_point {c}")))
                    .collect()
            })
            .unwrap_or_default();
        let rng = if from_crash_stream {
            &mut self.crash_points
        } else {
            &mut self.faults
        };
        let from = if !passed.is_empty() && rng.chance(750) {
            &passed[..]
        } else {
            &CRASH_POINTS[..]
        };
        let point = rng.pick(from).copied().unwrap_or(points::EVENT_AFTER_FSYNC);
        let after = u32::try_from(1 + rng.below(3)).unwrap_or(1);
        self.arm_at(point, after);
    }

    /// Arms the seed's focus points: of the server's store, armed at
    /// their first pass, and of every client's store.
    fn focus_crash_points(&mut self) {
        // two of each side, half the list apart: a batch of as many seeds
        // as points arms each point twice
        let n = CRASH_POINTS.len() as u64;
        for k in [self.seed % n, (self.seed + n / 2) % n] {
            if let Some(point) = CRASH_POINTS.get(usize::try_from(k).unwrap_or(0)) {
                self.arm_at(point, 1);
            }
        }
        // one seed in four, one host crashes once at every named point of
        // its store (at the first pass of each), and one in four the
        // server does at every point of its own
        if self.seed % 4 == 3 {
            let i = usize::try_from(self.seed / 4).unwrap_or(0) % self.clients.len().max(1);
            if let Some(c) = self.clients.get_mut(i) {
                for point in rvbox_client_store::crash::ALL {
                    c.arm_crash(point);
                }
            }
            self.log(format!("ARM client {i} at every point"));
        }
        if self.seed % 4 == 1 {
            for point in CRASH_POINTS {
                self.arm_at(point, 1);
            }
        }
        // points few runs pass at all (an expiry, a late acceptance, a
        // retention pass, a rotation): armed in every run, so the one pass
        // a run makes is a crash
        for point in RARE_POINTS {
            // a crash at the expiry mark ends the session whose acceptance
            // would come late: one run in three
            if *point != points::EXPIRED_PENDING_AFTER_COMMIT || self.seed.is_multiple_of(3) {
                self.arm_at(point, 1);
            }
        }
        for c in &mut self.clients {
            for point in RARE_CLIENT_POINTS {
                c.arm_crash(point);
            }
        }
        let all = rvbox_client_store::crash::ALL;
        let m = all.len() as u64;
        for k in [self.seed % m, (self.seed + m / 2) % m] {
            if let Some(point) = all.get(usize::try_from(k).unwrap_or(0)).copied() {
                for c in &mut self.clients {
                    c.arm_crash(point);
                }
                self.log(format!("ARM every client at {point}"));
            }
        }
    }

    /// Arms a crash at the `after`-th next pass of `point`, beside what is
    /// armed already.
    fn arm_at(&mut self, point: &'static str, after: u32) {
        self.log(format!("arm crash at {point} after {after}"));
        let mut arms = self
            .armed
            .as_ref()
            .map(|h| h.remaining())
            .unwrap_or_default();
        arms.retain(|(p, _)| *p != point);
        arms.push((point, after));
        if arms.len() > MAX_ARMED_POINTS {
            arms.remove(0);
        }
        self.rearm(arms);
    }

    /// Installs a crash hook armed at `arms` on the running store.
    fn rearm(&mut self, arms: Vec<(&'static str, u32)>) {
        let hook = Arc::new(StopAt {
            passed: self.points_passed.clone(),
            arms: arms
                .into_iter()
                .map(|(p, a)| (p, a, AtomicU32::new(0)))
                .collect(),
        });
        if let Some(e) = self.server.engine.as_mut() {
            e.store_mut().set_crash_hook(hook.clone());
            self.armed = Some(hook);
        }
    }

    /// A host running a chatty tree loses its link, silently, for longer
    /// than the liveness timeout: what it writes meanwhile is sequenced
    /// and sent into the hole, and after the reconnect the whole run of
    /// pinned events (more than one read-back of the spool) is replayed.
    fn maybe_partition_chatty(&mut self) {
        let fresh: Vec<(Uuid7, u32)> = {
            let log = self
                .process_log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            log.records()
                .iter()
                .filter(|(id, r)| {
                    r.chatty_lines > 0 && r.ended.is_none() && !self.chatty_seen.contains(id)
                })
                .map(|(id, r)| (*id, r.host))
                .collect()
        };
        for (id, host) in fresh {
            self.chatty_seen.insert(id);
            if !self.chatty_rng.chance(850) {
                continue;
            }
            let ms = 32_000 + self.chatty_rng.below(13_000);
            self.log(format!(
                "PARTITION client {host} for {ms} ms while {id} is chatty"
            ));
            self.count("chatty_partition");
            self.net
                .partition(ClientSlot(host), self.now.saturating_add(ms), self.now);
            // no crash of that host until the replay after the partition
            // has had its time
            self.spared.insert(
                host,
                self.now.saturating_add(ms).saturating_add(SPARE_AFTER_MS),
            );
            if let Some(c) = self.clients.get_mut(usize::try_from(host).unwrap_or(0)) {
                c.disarm_crash();
            }
        }
    }

    /// Whether host `i` is spared from crashes now (logged when it is).
    fn spared(&mut self, i: u64) -> bool {
        let spared = u32::try_from(i)
            .ok()
            .and_then(|i| self.spared.get(&i))
            .is_some_and(|until| *until > self.now);
        if spared {
            self.log(format!("client {i} spared (a long replay ahead)"));
        }
        spared
    }

    fn inject_fault(&mut self) {
        // most fault turns also arm a crash point (its own stream: the
        // other faults of a seed stay what they were)
        if self.crash_points.chance(600) {
            self.arm_crash_point(true);
        }
        // and a named point of one client's store, beside what it has
        // armed already (each fires once, at its next pass)
        if self.crash_points.chance(350) {
            let i = self.crash_points.below(self.clients.len() as u64);
            let passed: std::collections::BTreeSet<&'static str> = self
                .clients
                .iter()
                .flat_map(SimHost::passed_points)
                .filter(|p| {
                    !self
                        .counters
                        .contains_key(&format!("client_crash_point {p}"))
                })
                .collect();
            let passed: Vec<&'static str> = passed.into_iter().collect();
            let from = if !passed.is_empty() && self.crash_points.chance(750) {
                &passed[..]
            } else {
                rvbox_client_store::crash::ALL
            };
            let point = self
                .crash_points
                .pick(from)
                .copied()
                .unwrap_or(rvbox_client_store::crash::ACCEPT_AFTER_COMMIT);
            if !self.spared(i)
                && let Some(c) = self.clients.get_mut(usize::try_from(i).unwrap_or(0))
            {
                c.arm_crash(point);
                self.log(format!("ARM client {i} at {point}"));
                self.count("client_crash_point armed");
            }
        }
        if self.replica_rng.chance(250) {
            self.replica_fault();
        }
        let roll = self.faults.below(100);
        match roll {
            0..=14 => self.arm_crash_point(false),
            15..=24 => self.crash_server("between steps"),
            25..=31 => {
                // a real client crashes the next time it passes a named
                // commit point of its store
                let i = self.faults.below(self.clients.len() as u64);
                let point = self
                    .faults
                    .pick(rvbox_client_store::crash::ALL)
                    .copied()
                    .unwrap_or(rvbox_client_store::crash::ACCEPT_AFTER_COMMIT);
                if !self.spared(i)
                    && let Some(c) = self.clients.get_mut(usize::try_from(i).unwrap_or(0))
                {
                    c.arm_crash(point);
                    self.log(format!("ARM client {i} at {point}"));
                    self.count("client_crash_point armed");
                }
            }
            32..=39 => {
                let i = self.faults.below(self.clients.len() as u64);
                if !self.spared(i) {
                    self.log(format!("CRASH client {i}"));
                    self.count("client_crash");
                    let now = self.now;
                    let conn = self
                        .clients
                        .get_mut(usize::try_from(i).unwrap_or(0))
                        .and_then(|c| c.crash_restart(now));
                    if let Some(conn) = conn {
                        self.net.crash(conn, Side::Client, self.now);
                    }
                }
            }
            40..=49 => {
                let i = self.faults.below(self.clients.len() as u64);
                let ms = 5_000 + self.faults.below(40_000);
                self.log(format!("PARTITION client {i} for {ms} ms"));
                self.count("partition");
                self.net.partition(
                    ClientSlot(u32::try_from(i).unwrap_or(0)),
                    self.now.saturating_add(ms),
                    self.now,
                );
            }
            50..=57 => {
                // the wall clock steps (NTP): liveness must not care
                // up to ten minutes either way: the client's clock does not
                // move, so this is also clock skew between the two ends
                let jump = i64::try_from(self.faults.below(1_200_000)).unwrap_or(0) - 600_000;
                self.wall_offset = self.wall_offset.saturating_add(jump);
                self.log(format!("WALL CLOCK jumps {jump} ms"));
                self.count("wall_clock_jump");
            }
            66..=71 => self.second_instance(),
            72..=74 => {
                // an orderly stop and start of a client daemon (SIGTERM, as
                // an upgrade does): its session closes with 1012, every tree
                // gets TERM, then KILL if it ignores TERM
                let i = self.faults.below(self.clients.len() as u64);
                if !self.spared(i) {
                    self.log(format!("STOP client {i} (orderly) and start it again"));
                    self.count("client_orderly_restart");
                    let now = self.now;
                    let conn = self
                        .clients
                        .get_mut(usize::try_from(i).unwrap_or(0))
                        .and_then(|c| c.stop_restart(now));
                    // what it sent before it exited (the close) goes out,
                    // then the socket closes with the process
                    self.drain_clients();
                    if let Some(conn) = conn {
                        self.net.crash(conn, Side::Client, self.now);
                    }
                }
            }
            58..=65 => {
                let conns = self.net.connections();
                if let Some((conn, _)) = self.faults.pick(&conns).copied() {
                    self.log(format!("CUT c{}", conn.0));
                    self.count("connection_cut");
                    self.net.cut(conn, self.now);
                }
            }
            _ => {}
        }
    }

    /// The server as one replica among several, from its own stream: it
    /// loses its lease, gives duties to another replica for a while, or
    /// gets wake-ups with nothing behind them.
    fn replica_fault(&mut self) {
        match self.replica_rng.below(3) {
            0 => {
                // a replica that lost its lease closes every connection,
                // refuses new ones and runs no duty until it joined again
                let ms = 1_000 + self.replica_rng.below(15_000);
                self.log(format!("LEASE LOST: the server stops serving for {ms} ms"));
                self.count("lease_lost");
                self.with_engine(|e, now, wall| {
                    e.tick(now, wall);
                    e.set_serving(false);
                });
                self.replica_restore_at = Some(self.now.saturating_add(ms));
            }
            1 => {
                // another replica holds some duties for a while (it runs
                // them elsewhere; here they wait)
                let held: Vec<rvbox_store_port::replica::Duty> =
                    rvbox_store_port::replica::Duty::ALL
                        .into_iter()
                        .filter(|_| self.replica_rng.chance(500))
                        .collect();
                let ms = 1_000 + self.replica_rng.below(9_000);
                self.log(format!("DUTIES {held:?} for {ms} ms"));
                self.count("duties_moved");
                self.with_engine(|e, now, wall| {
                    e.tick(now, wall);
                    e.set_duties(&held);
                });
                self.replica_restore_at = Some(self.now.saturating_add(ms));
            }
            _ => {
                // wake-ups from other replicas, with nothing new behind them
                self.count("spurious_wake");
                let client = self
                    .replica_rng
                    .pick(&self.clients)
                    .map(|c| c.client_id().to_owned());
                let which = self.replica_rng.below(3);
                self.with_engine(|e, now, wall| {
                    e.tick(now, wall);
                    match (which, client) {
                        (0, Some(c)) => e.wake(&c, None),
                        (1, _) => e.fleet_wake(),
                        _ => e.wake_all(),
                    }
                });
            }
        }
    }

    /// A second installation claims a client id whose first instance has
    /// a live session (plan §6.2): it must be refused with `LIVE_CONFLICT`
    /// and recorded as the pending claim, and the live session must stay.
    /// It hellos straight into the engine, in the same step as the check
    /// that the first instance is live: over the faulty network it could
    /// arrive after that session ended, be admitted as a new instance, and
    /// legitimately run again what the first instance ran.
    fn second_instance(&mut self) {
        let i = self.faults.below(self.clients.len() as u64);
        let Some(first) = self.clients.get(usize::try_from(i).unwrap_or(usize::MAX)) else {
            return;
        };
        let client_id = first.client_id().to_owned();
        self.twins = self.twins.wrapping_add(1);
        let twin_root = self.server.dir.path().join(format!("twin-{}", self.twins));
        let Ok((twin_instance, hello)) =
            first.twin_hello(SimRng::new(self.faults.next_u64()), twin_root)
        else {
            self.failure = Some("a second instance could not start".into());
            return;
        };
        // operations in flight (a session's end, a registration) settle
        // first: the check compares with the live session as it stands
        self.with_engine(|e, now, wall| e.run_until_idle(now, wall));
        let live_before = self
            .server
            .engine
            .as_ref()
            .and_then(|e| e.store().client_record(&client_id).ok().flatten())
            .and_then(|r| r.live);
        let Some(live_before) = live_before else {
            return;
        };
        self.flush_engine();
        self.twin_outputs.clear();
        let conn = TWIN_CONN_BASE + self.twins;
        self.log(format!(
            "c{conn} second instance {twin_instance} of {client_id} says hello"
        ));
        // a refused claim is a rare commit: a quarter of the attempts arm
        // its crash point (own stream), so a crash right after the claim's
        // commit is reached in every seed batch
        if self.crash_points.chance(250) {
            self.arm_at(rvbox_store::crash::points::CLAIM_AFTER_COMMIT, 1);
        }
        let crashes = self.counters.get("server_crash").copied();
        self.with_engine(|e, now, wall| {
            e.connect(now, conn);
            e.frame(now, wall, conn, hello);
            // the registration's reads and writes complete in this step:
            // the check below compares with the live session as it is now
            e.run_until_idle(now, wall);
        });
        if self.server.engine.is_none() || self.counters.get("server_crash").copied() != crashes {
            // the server crashed mid-registration (a crash point after the
            // claim's commit): its restart closed every session, so there
            // is nothing left to compare
            self.twin_outputs.clear();
            self.count("second_instance_crashed");
            return;
        }
        let outputs = std::mem::take(&mut self.twin_outputs);
        let welcomed = outputs.iter().any(|o| {
            matches!(o, Output::Frame { bytes, .. } if matches!(
                payload_of(bytes),
                Some(wire::envelope::Payload::ServerWelcome(_))
            ))
        });
        let rejected = outputs.iter().any(|o| {
            matches!(o, Output::Close { reason, .. } if *reason == wire::CloseReason::HelloRejected)
        });
        let record = self
            .server
            .engine
            .as_ref()
            .and_then(|e| e.store().client_record(&client_id).ok().flatten());
        let claim_recorded = record
            .as_ref()
            .and_then(|r| r.pending_claim)
            .is_some_and(|(inst, _)| crate::rng::uuid_text(&inst) == twin_instance);
        let still_live = record
            .as_ref()
            .and_then(|r| r.live)
            .is_some_and(|l| l.session_id == live_before.session_id);
        if welcomed || !rejected || !claim_recorded || !still_live {
            self.failure = Some(format!(
                "a second instance of {client_id} against a live session: welcomed {welcomed}, rejected {rejected}, claim recorded {claim_recorded}, first session kept {still_live}"
            ));
            return;
        }
        self.count("second_instance_refused");
        if self.claims.len() < MAX_KEPT_SIGNALS {
            self.claims.push((client_id.clone(), twin_instance.clone()));
        }
        // the operator often answers a refused claim with a grant
        if self.takeover_rng.chance(500) {
            self.operator_takeover();
        }
        if !outputs.iter().any(|o| matches!(o, Output::Close { .. })) {
            self.with_engine(|e, now, wall| e.disconnected(now, wall, conn));
        }
        self.twin_outputs.clear();
    }

    /// The operator's stdin: every command gets some appends (now and
    /// then several writes' worth) and then its close, each call retried
    /// with its request id when a crash swallowed its answer. What the
    /// server acknowledged is what the process must get.
    fn stdin_turn(&mut self) {
        let due: Vec<usize> = self
            .stdin_plans
            .iter()
            .enumerate()
            .filter(|(_, p)| p.at <= self.now)
            .map(|(i, _)| i)
            .collect();
        let mut done = Vec::new();
        for i in due {
            let Some(plan) = self.stdin_plans.get(i).cloned() else {
                continue;
            };
            let call = match plan.pending.clone() {
                Some(c) => c,
                None => {
                    let request_id = crate::rng::uuid_text(
                        &self
                            .stdin_rng
                            .uuid_v7(u64::try_from(self.wall()).unwrap_or(0)),
                    );
                    let issue_uuid = crate::rng::uuid_text(&plan.id);
                    if plan.appends_left > 0 {
                        let len = if self.stdin_rng.chance(80) {
                            self.stdin_rng.range_inclusive(200_000..=700_000)
                        } else {
                            self.stdin_rng.range_inclusive(0..=2_000)
                        };
                        let data = self.stdin_rng.bytes(usize::try_from(len).unwrap_or(0));
                        let newline = if self.stdin_rng.chance(500) || data.is_empty() {
                            wire::StdinNewline::Append
                        } else {
                            wire::StdinNewline::Raw
                        };
                        StdinCall::Append(wire::AppendStdinRequest {
                            request_id,
                            issue_uuid,
                            data,
                            newline: newline as i32,
                        })
                    } else {
                        StdinCall::Close(wire::CloseStdinRequest {
                            request_id,
                            issue_uuid,
                        })
                    }
                }
            };
            let mut answer: Option<Result<(u64, u64), PortError>> = None;
            match &call {
                StdinCall::Append(req) => self.with_engine(|e, now, wall| {
                    answer = Some(
                        e.append_stdin(now, wall, req)
                            .map(|r| (r.first_write_seq, r.last_write_seq)),
                    );
                }),
                StdinCall::Close(req) => self.with_engine(|e, now, wall| {
                    answer = Some(
                        e.close_stdin(now, wall, req)
                            .map(|r| (r.write_seq, r.write_seq)),
                    );
                }),
            }
            let next = self
                .now
                .saturating_add(self.stdin_rng.range_inclusive(100..=10_000));
            let Some(plan) = self.stdin_plans.get_mut(i) else {
                continue;
            };
            plan.at = next;
            let line = format!(
                "stdin {} of {}{}: {}",
                match &call {
                    StdinCall::Append(_) => "append",
                    StdinCall::Close(_) => "close",
                },
                crate::rng::uuid_text(&plan.id),
                if plan.pending.is_some() {
                    " (a retry)"
                } else {
                    ""
                },
                match &answer {
                    Some(Ok((a, b))) => format!("writes {a}..={b}"),
                    Some(Err(_)) => "refused".to_owned(),
                    None => "unanswered".to_owned(),
                }
            );
            self.log(line);
            let Some(plan) = self.stdin_plans.get_mut(i) else {
                continue;
            };
            match answer {
                Some(Ok((first, last))) => {
                    plan.pending = None;
                    plan.maybe_committed = false;
                    let entry = self.requests.stdin.entry(plan.id).or_default();
                    match &call {
                        StdinCall::Append(req) => {
                            plan.appends_left = plan.appends_left.saturating_sub(1);
                            // the server's writes: pieces of at most
                            // 256 KiB, the newline on the last one
                            let size = usize::try_from(rvbox_domain::limits::MAX_STDIN_WRITE_BYTES)
                                .unwrap_or(usize::MAX);
                            let mut pieces: Vec<Vec<u8>> =
                                req.data.chunks(size).map(<[u8]>::to_vec).collect();
                            if pieces.is_empty() {
                                pieces.push(Vec::new());
                            }
                            if req.newline == wire::StdinNewline::Append as i32
                                && let Some(l) = pieces.last_mut()
                            {
                                l.push(b'\n');
                            }
                            if last.saturating_sub(first) + 1 != pieces.len() as u64 {
                                self.failure = Some(format!(
                                    "AppendStdin {} of {} bytes got writes {first}..={last}",
                                    req.request_id,
                                    req.data.len()
                                ));
                            }
                            if entry.last().is_none_or(|(s, _, _)| *s < first) {
                                for (k, p) in pieces.into_iter().enumerate() {
                                    entry.push((first + k as u64, p, false));
                                }
                            }
                            self.count("stdin appended");
                        }
                        StdinCall::Close(_) => {
                            if entry.last().is_none_or(|(s, _, _)| *s < first) {
                                entry.push((first, Vec::new(), true));
                            }
                            self.count("stdin closed");
                            done.push(i);
                        }
                    }
                }
                Some(Err(e)) => {
                    let line = format!(
                        "stdin of {} refused{}: {:?}",
                        crate::rng::uuid_text(&plan.id),
                        if plan.pending.is_some() {
                            " (a retry)"
                        } else {
                            ""
                        },
                        e.to_domain()
                    );
                    self.log(line);
                    let Some(plan) = self.stdin_plans.get_mut(i) else {
                        continue;
                    };
                    if plan.pending.is_none() {
                        plan.since = self.now;
                    }
                    let transient =
                        e.to_domain().retry_class() == rvbox_domain::error::RetryClass::Transient;
                    if transient
                        && matches!(call, StdinCall::Append(_))
                        && !plan.maybe_committed
                        && self.now.saturating_sub(plan.since) >= STDIN_RETRY_BUDGET_MS
                    {
                        // rvc's retries are spent: the append failed (it
                        // never committed: a committed request is answered
                        // with its result), the operator goes on to the
                        // close (a command whose own output fills its
                        // quota refuses appends until it ends: seed 21553)
                        plan.pending = None;
                        plan.appends_left = 0;
                        self.count("stdin append given up");
                    } else if transient {
                        // transient (unavailable, capacity, a quota that
                        // may free up): the same request again later, as
                        // an operator's retry would (a close refused for
                        // a full quota left a process waiting for its end
                        // of file for ever: seed 60012)
                        plan.pending = Some(call);
                        self.count("stdin refused transiently");
                    } else {
                        // the command ended, or its stdin is closed: the
                        // plan is over (a retried call that committed
                        // would have been answered with its result)
                        self.count("stdin refused");
                        done.push(i);
                    }
                }
                None => {
                    // a crash swallowed the answer
                    if plan.pending.is_none() {
                        plan.since = self.now;
                    }
                    plan.maybe_committed = true;
                    plan.pending = Some(call);
                    self.count("stdin unanswered");
                }
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            if i < self.stdin_plans.len() {
                self.stdin_plans.remove(i);
            }
        }
    }

    /// Every stdin call whose answer a crash swallowed is sent once more
    /// with its request id, as the operator's retry would: a committed
    /// write is answered with its result even after its command ended, so
    /// the oracle knows every write the process may have got.
    fn settle_stdin(&mut self) {
        self.stdin_plans.retain(|p| p.pending.is_some());
        let now = self.now;
        for p in &mut self.stdin_plans {
            p.at = now;
        }
        self.stdin_turn();
    }

    /// The oracles over every command, once all are terminal.
    fn check_oracles(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        self.requests.signals.clear();
        for (id, kind) in self.signal_may_apply.values() {
            self.requests.signals.entry(*id).or_default().push(*kind);
        }
        let hosts: Vec<String> = self
            .clients
            .iter()
            .map(|c| c.client_id().to_owned())
            .collect();
        let log = self
            .process_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut counts = OracleCounts::default();
        let mut problems = Vec::new();
        if log.overflowed {
            problems.push("the process log overflowed".to_owned());
        }
        let chatty = log
            .records()
            .values()
            .filter(|r| r.chatty_lines > 0)
            .count() as u64;
        let escalations = log
            .records()
            .values()
            .filter(|r| r.stop_signals.contains(&wire::SignalKind::Kill))
            .count() as u64;
        for id in &self.created_ids {
            problems.extend(crate::oracles::check_command(
                engine.store(),
                &log,
                &self.requests,
                &hosts,
                id,
                &mut self.oracle_rng,
                &mut counts,
            ));
        }
        drop(log);
        for (k, v) in [
            ("oracle output_commands", counts.output_commands),
            ("oracle output_bytes", counts.output_bytes),
            ("oracle gap_bytes", counts.gap_bytes),
            ("oracle exits", counts.exits),
            ("oracle stdin_writes", counts.stdin_writes),
            ("oracle eofs", counts.eofs),
            ("oracle signals", counts.signals),
            ("oracle cursor_reads", counts.cursor_reads),
            ("workload chatty_trees", chatty),
            ("workload kill_escalations", escalations),
        ] {
            self.add(k, v);
        }
        // coverage: every named point either store passed this run
        let server: Vec<&'static str> = self
            .points_passed
            .lock()
            .map(|p| p.iter().copied().collect())
            .unwrap_or_default();
        for p in server {
            self.count(&format!("passed {p}"));
        }
        let client: std::collections::BTreeSet<&'static str> = self
            .clients
            .iter()
            .flat_map(SimHost::passed_points)
            .collect();
        for p in client {
            self.count(&format!("client_passed {p}"));
        }
        if let Some(first) = problems.first()
            && self.failure.is_none()
        {
            self.failure = Some(format!(
                "oracle: {} problem(s), first: {first}",
                problems.len()
            ));
        }
    }

    fn check(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let names: Vec<String> = self
            .clients
            .iter()
            .map(|c| c.client_id().to_owned())
            .collect();
        let pairs = names
            .iter()
            .map(String::as_str)
            .zip(self.clients.iter_mut().map(SimHost::ledger_mut));
        let state = (self.server_opens, engine.store().db().total_changes());
        let result = if self.store_checked == Some(state) {
            Ok(pairs
                .flat_map(|(client, ledger)| self.checker.absorb(client, ledger))
                .collect())
        } else {
            self.store_checked = Some(state);
            self.checker.check(engine.store(), pairs)
        };
        match result {
            Ok(v) if v.is_empty() => {}
            Ok(v) => {
                if let Some(first) = v.first() {
                    self.failure = Some(format!("invariant violated: {first:?}"));
                }
            }
            Err(e) => self.failure = Some(format!("checker failed: {e:?}")),
        }
        for c in &self.clients {
            if let Some(msg) = c.panicked() {
                self.failure = Some(format!("client {} panicked: {msg}", c.client_id()));
            } else if let Some(note) = c.violation_notes().first() {
                self.failure = Some(format!(
                    "client {} saw a server violation: {note}",
                    c.client_id()
                ));
            }
        }
    }

    fn all_done(&mut self) -> bool {
        let Some(engine) = self.server.engine.as_ref() else {
            return false;
        };
        if self.created < self.config.commands {
            return false;
        }
        if !self.terminals_settled() {
            return false;
        }
        // every fleet run ended (its released targets are tracked below)
        let live: i64 = engine
            .store()
            .db()
            .query_row("SELECT COUNT(*) FROM fleet_runs WHERE state < 4", [], |r| {
                r.get(0)
            })
            .unwrap_or(1);
        if live > 0 {
            return false;
        }
        while let Some(id) = self.created_ids.get(self.known_done) {
            let done = engine
                .command(id)
                .map(|v| v.lifecycle.is_terminal())
                .unwrap_or(true);
            if !done {
                return false;
            }
            self.known_done += 1;
        }
        true
    }

    /// Records the first `limit` binary frames either side sends, into
    /// [`Report::frames`] (the fuzz seed corpora; nothing else changes).
    pub fn record_frames(&mut self, limit: usize) {
        self.net.record(limit);
    }

    /// Runs to the end; returns the report.
    pub fn run(mut self) -> Report {
        let mut steps = 0u64;
        let spacing = self.config.workload_ms / u64::from(self.config.commands.max(1));
        while steps < MAX_STEPS && self.failure.is_none() {
            steps += 1;
            if self.created < self.config.commands && self.now >= self.next_workload_at {
                self.create_command();
                self.next_workload_at = self.now.saturating_add(spacing.max(1));
            }
            if self.config.faults && !self.calm {
                self.maybe_partition_chatty();
            }
            if self.config.faults
                && self.now >= self.next_fault_at
                && self.created < self.config.commands
            {
                self.inject_fault();
                self.next_fault_at = self.now.saturating_add(2_000 + self.faults.below(8_000));
            }
            if let Some(t) = self.replica_restore_at
                && (self.now >= t || (self.created >= self.config.commands && !self.calm))
            {
                self.replica_restore_at = None;
                self.log("the server serves again and holds every duty".into());
                self.with_engine(|e, now, wall| {
                    e.tick(now, wall);
                    e.set_serving(true);
                    e.set_duties(&rvbox_store_port::replica::Duty::ALL);
                });
            }
            if self.created >= self.config.commands && !self.calm {
                // the calm tail: faults stop, every client stays reachable
                self.calm = true;
                self.calm_from = self.now;
                self.net.set_config(crate::net::NetConfig::calm());
                self.log("CALM tail begins".into());
                for c in &mut self.clients {
                    c.disarm_crash();
                    c.behave();
                }
                // and the server's clock is put right (as time sync would):
                // a queue expiry is decided on it
                if self.wall_offset != 0 {
                    self.log(format!("WALL CLOCK corrected by {} ms", -self.wall_offset));
                    // a dispatch retry is scheduled on the server's wall
                    // clock (it survives restarts): a clock put back waits
                    // it out, so the tail is that much longer
                    self.calm_extra = u64::try_from(self.wall_offset.max(0)).unwrap_or(0);
                    self.wall_offset = 0;
                }
            }
            if self.calm && self.config.breach == Some(Breach::DeadNetwork) {
                for i in 0..self.clients.len() {
                    let slot = ClientSlot(u32::try_from(i).unwrap_or(u32::MAX));
                    self.net.partition(slot, u64::MAX, self.now);
                }
            }
            if self.all_done() {
                self.breach_at_the_end();
                self.check_agreement();
                self.settle_stdin();
                self.check_oracles();
                self.check_terminal_oracles();
                break;
            }
            let tail = CALM_TAIL_MS.saturating_add(self.calm_extra);
            if self.calm && self.now > self.calm_from.saturating_add(tail) {
                let stuck = self.unfinished();
                self.failure = Some(format!(
                    "liveness: {} of {} commands not terminal {tail} ms into the calm tail: {}",
                    stuck.len(),
                    self.created,
                    stuck.join("; ")
                ));
                break;
            }
            if self.now > self.config.workload_ms.saturating_add(DRAIN_MS) {
                let stuck = self.unfinished();
                self.failure = Some(format!(
                    "stuck: {} of {} commands not terminal after {} ms: {}",
                    stuck.len(),
                    self.created,
                    self.now,
                    stuck.join("; ")
                ));
                break;
            }
            let next = [
                self.net.next_due(),
                self.clients
                    .iter()
                    .filter_map(|c| c.next_wake_after(self.now))
                    .min(),
                self.server.engine.as_ref().and_then(Engine::next_deadline),
                self.exec_at,
                self.stdin_plans.iter().map(|p| p.at).min(),
                self.terminal_due(),
                self.replica_restore_at,
                Some(self.next_workload_at),
                Some(self.now.saturating_add(1_000)),
            ]
            .into_iter()
            .flatten()
            // everything due at `now` was handled in the previous step
            .filter(|t| *t > self.now)
            .min()
            .unwrap_or(self.now + 1);
            self.now = next.max(self.now);
            for d in self.net.deliver_due(self.now) {
                self.deliver(d);
                if self.failure.is_some() {
                    break;
                }
            }
            let now = self.now;
            for c in &mut self.clients {
                if c.poll_timeout().is_some_and(|t| t <= now) {
                    c.handle_timeout(now);
                }
            }
            self.drain_clients();
            self.stdin_turn();
            self.drain_clients();
            self.terminal_turns();
            self.drain_clients();
            self.with_engine(|e, now, wall| e.tick(now, wall));
            self.executor_step();
            self.check();
            self.observe_terminals();
            self.sync_fleet_targets();
            self.check_fleet_parallel();
        }
        if self.failure.is_none() && steps >= MAX_STEPS {
            self.failure = Some(format!("no end after {MAX_STEPS} steps"));
        }
        let (mut chunks, mut replays, mut committed) = (0u64, 0u64, 0u64);
        let mut long_replays = 0u64;
        for c in &self.clients {
            let k = c.counters();
            long_replays = long_replays.saturating_add(k.long_replays);
            chunks = chunks.saturating_add(k.script_chunks_accepted);
            replays = replays.saturating_add(k.script_chunk_replays);
            committed = committed.saturating_add(k.scripts_committed);
        }
        let real = self.clients.len() as u64;
        let store_faults: u64 = self
            .clients
            .iter()
            .map(|c| c.counters().transient_refusals)
            .sum();
        for (k, v) in [
            ("clients real", real),
            ("client store_faults", store_faults),
            ("client script_chunks", chunks),
            ("client script_chunk_replays", replays),
            ("client scripts_committed", committed),
            ("client long_replays", long_replays),
        ] {
            self.add(k, v);
        }
        let nc = *self.net.counters();
        for (k, v) in [
            ("net delayed", nc.delayed),
            ("net stalled", nc.stalls),
            ("net reordered", nc.reordered),
            ("net lost", nc.lost),
            ("net duplicated", nc.dup_cuts),
            ("net partitions", nc.partitions),
            ("net overflow_cuts", nc.overflow_cuts),
            ("net cuts", nc.cuts),
        ] {
            self.add(k, v);
        }
        self.retention_counters();
        if let Some((stats, groups)) = self
            .server
            .engine
            .as_ref()
            .map(|e| (e.stats().clone(), e.group_stats()))
        {
            self.absorb_engine_stats(&stats, groups);
        }
        Report {
            seed: self.seed,
            steps,
            frames: self.net.take_recorded(),
            trace: self.trace,
            counters: self.counters,
            failure: self.failure,
        }
    }
}

/// A whole recording as a viewer from offset 0 gets it, and the input
/// frames it recorded (`input_seq`, bytes).
type Recording = (Vec<ViewerItem>, Vec<(u64, Vec<u8>)>);

/// The terminal workload and its oracles (docs/terminals.md;
/// `sim/src/terminals.rs` keeps their state and checks).
impl World {
    /// When the terminal workload is next due.
    fn terminal_due(&self) -> Option<u64> {
        let opens = self.term_opens.front().copied().filter(|_| !self.calm);
        let plans = self.terms.iter().filter(|p| !p.done()).map(|p| p.at).min();
        let viewers = self.viewers.iter().filter(|v| !v.done).map(|v| v.at).min();
        [opens, plans, viewers].into_iter().flatten().min()
    }

    /// Every terminal ended (or was never stored), every call answered,
    /// and every viewer saw its terminal's end.
    fn terminals_settled(&self) -> bool {
        (self.calm || self.term_opens.is_empty())
            && self.terms.iter().all(TermPlan::done)
            && self.viewers.iter().all(|v| v.done)
    }

    /// The operators' and viewers' turns that are due.
    fn terminal_turns(&mut self) {
        if self.calm {
            self.term_opens.clear();
        }
        while self.term_opens.front().is_some_and(|t| *t <= self.now) {
            self.term_opens.pop_front();
            self.plan_terminal();
        }
        for i in 0..self.terms.len() {
            let due = self
                .terms
                .get(i)
                .is_some_and(|p| !p.done() && p.at <= self.now);
            if due {
                self.terminal_turn(i);
                self.drain_clients();
            }
            if self.failure.is_some() {
                return;
            }
        }
        for v in 0..self.viewers.len() {
            let due = self
                .viewers
                .get(v)
                .is_some_and(|x| !x.done && x.at <= self.now);
            if due {
                self.viewer_turn(v);
            }
            if self.failure.is_some() {
                return;
            }
        }
    }

    /// A new terminal: an operator's `rvc shell` on one of the hosts.
    fn plan_terminal(&mut self) {
        if self.terms.len() >= MAX_TERMINALS_PER_RUN {
            return;
        }
        let n = self.clients.len() as u64;
        let host = u32::try_from(self.term_rng.below(n.max(1))).unwrap_or(0);
        let wall = u64::try_from(self.wall()).unwrap_or(0);
        let id = self.term_rng.uuid_v7(wall);
        let text = crate::rng::uuid_text(&id);
        let shell_type = if self.term_rng.chance(300) {
            wire::ShellType::Bash
        } else {
            wire::ShellType::Unspecified
        };
        let mut env = BTreeMap::new();
        if self.term_rng.chance(500) {
            env.insert("TERM".to_owned(), "xterm-256color".to_owned());
        }
        let rows = u32::try_from(self.term_rng.range_inclusive(10..=80)).unwrap_or(24);
        let cols = u32::try_from(self.term_rng.range_inclusive(40..=250)).unwrap_or(80);
        // a profile the hosts enforce now and then, and rarely one they
        // cannot (the client refuses the open: closed without a shell)
        let profile_flags = match self.term_rng.below(100) {
            0..=14 => vec![wire::ProfileFlag::Light as i32],
            15..=19 => vec![wire::ProfileFlag::CpuLow as i32],
            _ => Vec::new(),
        };
        let frames_left = self.term_rng.range_inclusive(3..=MAX_FRAMES_PER_TERMINAL);
        let ending = match self.term_rng.below(100) {
            0..=44 => Ending::Close,
            45..=79 => Ending::Exit(if self.term_rng.chance(600) {
                0
            } else {
                i32::try_from(self.term_rng.range_inclusive(1..=255)).unwrap_or(1)
            }),
            _ => Ending::Tail,
        };
        // one terminal in two (in faulty runs) arms a crash of its host at
        // a point of the client store's terminal records
        if self.config.faults && self.term_rng.chance(500) {
            let point = self
                .term_rng
                .pick(rvbox_client_store::crash::TERMINAL_POINTS)
                .copied()
                .unwrap_or(rvbox_client_store::crash::TERMINAL_OPENING_AFTER_COMMIT);
            if !self.spared(u64::from(host))
                && let Some(c) = self.clients.get_mut(usize::try_from(host).unwrap_or(0))
            {
                c.arm_crash(point);
                self.log(format!("ARM client {host} at {point}"));
                self.count("client_crash_point armed");
            }
        }
        self.log(format!(
            "terminal {text} planned on host-{host} ({frames_left} frames, then {ending:?})"
        ));
        self.count("terminal planned");
        self.terms.push(TermPlan {
            id,
            text: text.clone(),
            host,
            open: wire::OpenPtySessionRequest {
                request_id: text,
                client_id: format!("host-{host}"),
                shell_type: shell_type as i32,
                cwd: String::new(),
                env,
                rows,
                cols,
                profile_flags,
            },
            opened: false,
            refused: false,
            pending: None,
            maybe_committed: false,
            since: self.now,
            typed: Vec::new(),
            frames_left,
            ending,
            exited: false,
            close_sent: false,
            at: self.now,
            drain_since: None,
            closed: None,
            gone: false,
            input_confirmed: 0,
            output_seen: 0,
            answered: Vec::new(),
            bursts: 0,
        });
    }

    /// One turn of terminal `i`'s operator: the call in flight again, or
    /// the open, or typing (and the shell writing by itself), or its end.
    fn terminal_turn(&mut self, i: usize) {
        let next = self
            .now
            .saturating_add(self.term_rng.range_inclusive(100..=2_500));
        let Some(plan) = self.terms.get_mut(i) else {
            return;
        };
        plan.at = next;
        if let Some(call) = plan.pending.clone() {
            self.terminal_call(i, call);
            return;
        }
        if !plan.opened {
            self.terminal_call(i, TermCall::Open);
            return;
        }
        if plan.closed.is_some() || plan.gone {
            return;
        }
        if !self.calm && plan.frames_left > 0 {
            self.terminal_action(i);
        } else {
            self.terminal_end(i);
        }
    }

    /// The operator types, or the shell writes, resizes, a request is
    /// sent again, a viewer attaches.
    fn terminal_action(&mut self, i: usize) {
        let roll = self.term_rng.below(100);
        match roll {
            0..=61 => {
                let wall = u64::try_from(self.wall()).unwrap_or(0);
                let Some(plan) = self.terms.get_mut(i) else {
                    return;
                };
                let k = plan.typed.len();
                let len = if self.term_rng.chance(60) {
                    self.term_rng.range_inclusive(1_000..=4_096)
                } else {
                    self.term_rng.range_inclusive(1..=64)
                };
                let mut data = format!("t{i}k{k} ").into_bytes();
                if self.term_rng.chance(100) {
                    // control keys and raw bytes travel as they are
                    data.extend(self.term_rng.bytes(usize::try_from(len).unwrap_or(1)));
                } else {
                    for _ in 0..len {
                        let c = b'a' + u8::try_from(self.term_rng.below(26)).unwrap_or(0);
                        data.push(c);
                    }
                }
                data.truncate(rvbox_store_port::pty::MAX_PTY_INPUT_BYTES - 1);
                data.push(b'\r');
                let request_id = crate::rng::uuid_text(&self.term_rng.uuid_v7(wall));
                plan.typed.push(TypedFrame {
                    request_id,
                    data,
                    acked: None,
                    sent: false,
                });
                plan.frames_left = plan.frames_left.saturating_sub(1);
                self.terminal_call(i, TermCall::Write(k));
            }
            62..=78 => {
                // the shell writes by itself: a prompt, a program's lines
                let lines = self.term_rng.range_inclusive(1..=20);
                let mut bytes = Vec::new();
                for _ in 0..lines {
                    let n = self.term_rng.next_u32();
                    bytes.extend_from_slice(format!("t{i} output line {n}\r\n").as_bytes());
                }
                self.shell_writes(i, &bytes);
            }
            79..=81 => {
                // a program floods the terminal, now and then past the
                // rings (the holder's and the client's copy, 1 MiB each)
                let Some(plan) = self.terms.get(i) else {
                    return;
                };
                if plan.bursts >= MAX_TERMINAL_BURST_TOTAL {
                    return;
                }
                let len = self
                    .term_rng
                    .range_inclusive(64 * 1024..=MAX_TERMINAL_BURST);
                let bytes = self.term_rng.bytes(usize::try_from(len).unwrap_or(0));
                if let Some(plan) = self.terms.get_mut(i) {
                    plan.bursts = plan.bursts.saturating_add(len);
                }
                self.count("terminal output bursts");
                self.shell_writes(i, &bytes);
            }
            82..=86 => {
                let Some(plan) = self.terms.get(i) else {
                    return;
                };
                let pty_session_id = plan.text.clone();
                let wall = u64::try_from(self.wall()).unwrap_or(0);
                let req = wire::ResizePtySessionRequest {
                    request_id: crate::rng::uuid_text(&self.term_rng.uuid_v7(wall)),
                    pty_session_id,
                    rows: u32::try_from(self.term_rng.range_inclusive(10..=80)).unwrap_or(24),
                    cols: u32::try_from(self.term_rng.range_inclusive(40..=250)).unwrap_or(80),
                };
                self.terminal_call(i, TermCall::Resize(req));
            }
            87..=92 => self.terminal_replay(i),
            _ => self.new_viewer(i),
        }
    }

    /// The shell of terminal `i` writes `bytes` by itself.
    fn shell_writes(&mut self, i: usize, bytes: &[u8]) {
        let Some(plan) = self.terms.get(i) else {
            return;
        };
        let Ok(id) = Uuid7::from_bytes("pty_session_id", plan.id) else {
            return;
        };
        let now = self.now;
        if let Some(c) = self
            .clients
            .get_mut(usize::try_from(plan.host).unwrap_or(usize::MAX))
        {
            c.terminal_writes(now, &id, bytes);
        }
        self.drain_clients();
    }

    /// Terminal `i`'s end: its shell exits by itself, or (once the client
    /// confirmed what was typed, in the calm tail) the operator closes it.
    fn terminal_end(&mut self, i: usize) {
        let Some(plan) = self.terms.get(i) else {
            return;
        };
        let (host, ending, exited, close_sent) =
            (plan.host, plan.ending, plan.exited, plan.close_sent);
        let Ok(id) = Uuid7::from_bytes("pty_session_id", plan.id) else {
            return;
        };
        let idx = usize::try_from(host).unwrap_or(usize::MAX);
        if let Ending::Exit(code) = ending
            && !exited
        {
            let runs = self.clients.get(idx).is_some_and(|c| c.shell_runs(&id));
            if runs {
                let now = self.now;
                if let Some(c) = self.clients.get_mut(idx) {
                    c.terminal_exits(now, &id, code);
                }
                if let Some(p) = self.terms.get_mut(i) {
                    p.exited = true;
                }
                self.log(format!("terminal {id}: its shell exits with {code}"));
                self.count("terminal shell exits");
                self.drain_clients();
                return;
            }
            if !self.calm {
                // its holder has not started yet
                return;
            }
        }
        if exited || close_sent {
            // the end comes from the client
            return;
        }
        if !self.calm && ending == Ending::Tail {
            return;
        }
        if self.calm {
            // the operator waits for every acknowledged frame to be
            // confirmed written (bounded), then closes
            let now = self.now;
            let Some(plan) = self.terms.get_mut(i) else {
                return;
            };
            let since = *plan.drain_since.get_or_insert(now);
            if plan.input_confirmed < plan.last_acked() && now.saturating_sub(since) < DRAIN_WAIT_MS
            {
                return;
            }
        }
        let wall = u64::try_from(self.wall()).unwrap_or(0);
        let req = wire::ClosePtySessionRequest {
            request_id: crate::rng::uuid_text(&self.term_rng.uuid_v7(wall)),
            pty_session_id: id.to_string(),
        };
        self.terminal_call(i, TermCall::Close(req));
    }

    /// Sends a terminal call (again, with its request id, after a lost
    /// answer or a transient refusal) and takes its answer as rvc would.
    fn terminal_call(&mut self, i: usize, call: TermCall) {
        use rvbox_server_core::PtyAnswer;
        use rvbox_store_port::pty::PtyMutation;
        let Some(plan) = self.terms.get_mut(i) else {
            return;
        };
        let retry = plan.pending.is_some();
        let mutation = match &call {
            TermCall::Open => PtyMutation::Open(plan.open.clone()),
            TermCall::Write(k) => {
                let Some(f) = plan.typed.get_mut(*k) else {
                    return;
                };
                f.sent = true;
                PtyMutation::Write(wire::WritePtyInputRequest {
                    request_id: f.request_id.clone(),
                    pty_session_id: plan.text.clone(),
                    data: f.data.clone(),
                })
            }
            TermCall::Resize(r) => PtyMutation::Resize(r.clone()),
            TermCall::Close(r) => {
                plan.close_sent = true;
                PtyMutation::Close(r.clone())
            }
        };
        let text = plan.text.clone();
        let mut answer = None;
        let m = mutation.clone();
        self.with_engine(|e, now, wall| answer = Some(e.pty(now, wall, m)));
        let now = self.now;
        let line = format!(
            "terminal {text} {}{}: {}",
            mutation.method(),
            if retry { " (again)" } else { "" },
            match &answer {
                Some(Ok(PtyAnswer::Write(w))) => format!("input_seq {}", w.input_seq),
                Some(Ok(_)) => "done".to_owned(),
                Some(Err(e)) => format!("refused {}", e.to_domain().code().as_str()),
                None => "unanswered".to_owned(),
            }
        );
        self.log(line);
        let Some(plan) = self.terms.get_mut(i) else {
            return;
        };
        let mut failure = None;
        let mut counted: Vec<&'static str> = Vec::new();
        if retry {
            counted.push("terminal calls sent again");
        }
        match answer {
            Some(Ok(a)) => {
                plan.pending = None;
                plan.maybe_committed = false;
                match (&call, &a) {
                    (TermCall::Open, PtyAnswer::Open(r)) => {
                        if r.pty_session_id != plan.text {
                            failure = Some(format!(
                                "OpenPtySession {} answered with terminal {}",
                                plan.text, r.pty_session_id
                            ));
                        }
                        plan.opened = true;
                        counted.push("terminal opened");
                    }
                    (TermCall::Write(k), PtyAnswer::Write(r)) => {
                        let before = plan.last_acked();
                        if let Some(f) = plan.typed.get_mut(*k) {
                            f.acked = Some(r.input_seq);
                        }
                        if r.input_seq <= before {
                            failure = Some(format!(
                                "terminal {}: a frame typed after input_seq {before} was acknowledged as input_seq {}",
                                plan.text, r.input_seq
                            ));
                        }
                        counted.push("terminal frames acknowledged");
                    }
                    (TermCall::Resize(_), PtyAnswer::Resize(_)) => {
                        counted.push("terminal resized");
                    }
                    (TermCall::Close(_), PtyAnswer::Close(_)) => {
                        counted.push("terminal close answered");
                    }
                    _ => {
                        failure = Some(format!(
                            "terminal {}: {} answered with {a:?}",
                            plan.text,
                            mutation.method()
                        ));
                    }
                }
                if plan.answered.len() < MAX_KEPT_ANSWERS {
                    plan.answered.push((mutation, a));
                }
            }
            Some(Err(e)) => {
                let d = e.to_domain();
                let code = d.code();
                if plan.maybe_committed && matches!(code, Code::Conflict | Code::AlreadyExecuted) {
                    failure = Some(format!(
                        "terminal {}: {} sent again after a lost answer was refused: {d:?}",
                        plan.text,
                        mutation.method()
                    ));
                }
                if plan.pending.is_none() {
                    plan.since = now;
                }
                let transient = d.retry_class() == rvbox_domain::error::RetryClass::Transient;
                let spent = now.saturating_sub(plan.since) >= TERMINAL_RETRY_BUDGET_MS;
                if transient && (!spent || plan.maybe_committed) {
                    // the same request again later
                    plan.pending = Some(call);
                    counted.push("terminal calls refused transiently");
                } else {
                    // refused for good (never stored: a stored request is
                    // answered with its result), or rvc's retries spent
                    plan.pending = None;
                    plan.maybe_committed = false;
                    counted.push("terminal calls refused");
                    match call {
                        TermCall::Open => plan.refused = true,
                        // the terminal is closing or closed: nothing more
                        // is typed
                        TermCall::Write(_) => plan.frames_left = 0,
                        TermCall::Resize(_) => {}
                        TermCall::Close(_) => {
                            if code == Code::NotFound {
                                plan.gone = true;
                            } else {
                                // sent again at the next turn
                                plan.close_sent = false;
                            }
                        }
                    }
                    if code == Code::NotFound && plan.opened {
                        plan.gone = true;
                    }
                }
            }
            None => {
                // a crash swallowed the answer: it may be stored
                if plan.pending.is_none() {
                    plan.since = now;
                }
                plan.pending = Some(call);
                plan.maybe_committed = true;
                counted.push("terminal calls unanswered");
            }
        }
        for k in counted {
            self.count(k);
        }
        if let Some(f) = failure
            && self.failure.is_none()
        {
            self.failure = Some(f);
        }
    }

    /// An answered terminal request sent again with its request id: the
    /// same answer, and nothing done twice (the input oracle sees a frame
    /// written twice).
    fn terminal_replay(&mut self, i: usize) {
        let Some(plan) = self.terms.get(i) else {
            return;
        };
        let Some((m, first)) = self.term_rng.pick(&plan.answered).cloned() else {
            return;
        };
        let text = plan.text.clone();
        let mut again = None;
        let call = m.clone();
        self.with_engine(|e, now, wall| again = Some(e.pty(now, wall, call)));
        match again {
            Some(Ok(a)) => {
                self.count("terminal requests replayed");
                if a != first && self.failure.is_none() {
                    self.failure = Some(format!(
                        "terminal {text}: {} replayed as {a:?}, first answered {first:?}",
                        m.method()
                    ));
                }
            }
            Some(Err(e)) => {
                let code = e.to_domain().code();
                if !matches!(code, Code::Unavailable | Code::NotFound) && self.failure.is_none() {
                    self.failure = Some(format!(
                        "terminal {text}: {} replayed was refused: {:?}",
                        m.method(),
                        e.to_domain()
                    ));
                }
            }
            None => {}
        }
    }

    /// A viewer (`rvc attach`) of terminal `i`, from its start, from
    /// somewhere in its output, or from its end.
    fn new_viewer(&mut self, i: usize) {
        if self.viewers.len() >= MAX_VIEWERS_PER_RUN {
            return;
        }
        let (Some(engine), Some(plan)) = (self.server.engine.as_ref(), self.terms.get(i)) else {
            return;
        };
        let Ok(info) = rvbox_store::pty::info(engine.store().db(), &plan.id) else {
            return;
        };
        let end = info.output_offset;
        let from = match self.term_rng.below(3) {
            0 => 0,
            1 => self.term_rng.range_inclusive(0..=end),
            _ => end,
        };
        self.viewers.push(ViewerState {
            plan: i,
            want: from,
            cursor: 0,
            attached: false,
            items: Vec::new(),
            done: false,
            at: self.now,
        });
        self.count("terminal viewers");
    }

    /// The viewer's audit call (attach or detach) through the core.
    fn viewer_audit(&mut self, plan: usize, attach: bool, offset: u64) {
        let Some(p) = self.terms.get(plan) else {
            return;
        };
        let (text, client) = (p.text.clone(), p.open.client_id.clone());
        self.with_engine(|e, now, wall| {
            let _ = e.pty_viewer(now, wall, &text, &client, attach, offset);
        });
    }

    /// One turn of viewer `v`: it attaches (again, from the offset it
    /// printed), reads what the store serves through the same rule as
    /// `AttachPtySession`, and now and then loses its stream.
    fn viewer_turn(&mut self, v: usize) {
        use rvbox_store_port::pty::{viewer_end_cut, viewer_items};
        let next = self
            .now
            .saturating_add(self.term_rng.range_inclusive(50..=2_000));
        let Some(viewer) = self.viewers.get_mut(v) else {
            return;
        };
        viewer.at = next;
        let (plan, attached) = (viewer.plan, viewer.attached);
        let Some(id) = self.terms.get(plan).map(|p| p.id) else {
            return;
        };
        if self.server.engine.is_none() {
            return;
        }
        if !attached {
            let info = self
                .server
                .engine
                .as_ref()
                .map(|e| rvbox_store::pty::info(e.store().db(), &id));
            let want = self.viewers.get(v).map_or(0, |x| x.want);
            match info {
                Some(Ok(info)) if want > info.output_offset => {
                    if self.failure.is_none() {
                        self.failure = Some(format!(
                            "terminal {}: a viewer printed up to offset {want}, the server's output now ends at {}",
                            info.pty_session_id, info.output_offset
                        ));
                    }
                    return;
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => {
                    // the terminal is gone (retention removed it)
                    if let Some(x) = self.viewers.get_mut(v) {
                        x.done = true;
                    }
                    self.count("terminal viewers found no terminal");
                    return;
                }
            }
            let crashes = self.server_opens;
            self.viewer_audit(plan, true, want);
            if self.server_opens != crashes || self.server.engine.is_none() {
                return;
            }
            let again = self.viewers.get(v).is_some_and(|x| !x.items.is_empty());
            if let Some(x) = self.viewers.get_mut(v) {
                x.attached = true;
                x.cursor = 0;
                x.items.push(ViewerItem::Attached { from: want });
            }
            self.count(if again {
                "terminal viewers attached again"
            } else {
                "terminal viewers attached"
            });
        }
        let reads = self.term_rng.range_inclusive(1..=3);
        let mut ended = None;
        for _ in 0..reads {
            let max = if self.term_rng.chance(300) {
                self.term_rng.range_inclusive(1..=4_096)
            } else {
                self.term_rng.range_inclusive(4_096..=1 << 20)
            };
            let (Some(engine), Some(x)) = (self.server.engine.as_ref(), self.viewers.get_mut(v))
            else {
                return;
            };
            let db = engine.store().db();
            let records = match rvbox_store::pty::records_after(
                db,
                &id,
                x.cursor,
                usize::try_from(max).unwrap_or(4_096),
            ) {
                Ok(r) => r,
                Err(_) => {
                    x.done = true;
                    return;
                }
            };
            if records.is_empty() {
                match rvbox_store::pty::info(db, &id) {
                    Ok(info) if info.state == wire::PtyState::Closed as i32 => {
                        if let Some(cut) = viewer_end_cut(x.want, info.output_offset) {
                            x.items.push(ViewerItem::Cut {
                                requested: cut.requested_offset,
                                resumes: cut.ring_start_offset,
                            });
                            x.want = cut.ring_start_offset;
                        }
                        x.items.push(ViewerItem::Closed {
                            output_offset: info.output_offset,
                        });
                        x.done = true;
                        ended = Some(x.want);
                    }
                    Ok(_) => {}
                    Err(_) => x.done = true,
                }
                break;
            }
            for r in &records {
                x.cursor = r.rec_seq;
                let (items, want) = viewer_items(x.want, r);
                x.items
                    .extend(items.into_iter().map(crate::terminals::viewer_item));
                x.want = want;
            }
            if x.items.len() >= MAX_VIEWER_ITEMS {
                x.done = true;
                return;
            }
        }
        if let Some(at) = ended {
            self.count("terminal viewers saw the end");
            self.viewer_audit(plan, false, at);
            return;
        }
        // the viewer's stream breaks now and then (rvc killed, a network
        // blip): it attaches again from the offset it printed
        if self.term_rng.chance(60) {
            let want = self.viewers.get(v).map_or(0, |x| x.want);
            if let Some(x) = self.viewers.get_mut(v) {
                x.attached = false;
            }
            self.count("terminal viewers lost their stream");
            self.viewer_audit(plan, false, want);
        }
    }

    /// What the server shows of each terminal, whenever the store changed:
    /// its first closed state (retention removes it later), the input its
    /// client confirmed, and an output end that never goes back.
    fn observe_terminals(&mut self) {
        let Some(engine) = self.server.engine.as_ref() else {
            return;
        };
        let state = (self.server_opens, engine.store().db().total_changes());
        if self.terms_observed == Some(state) {
            return;
        }
        self.terms_observed = Some(state);
        let mut problems = Vec::new();
        let mut closed = Vec::new();
        for p in &mut self.terms {
            if !p.opened || p.closed.is_some() || p.gone {
                continue;
            }
            match rvbox_store::pty::load_view(engine.store().db(), &p.id) {
                Ok(None) => {
                    p.gone = true;
                    problems.push(format!(
                        "terminal {} vanished from the server without being closed",
                        p.text
                    ));
                }
                Ok(Some(view)) => {
                    if view.info.output_offset < p.output_seen {
                        problems.push(format!(
                            "terminal {}: the server's output end went back from {} to {}",
                            p.text, p.output_seen, view.info.output_offset
                        ));
                    }
                    p.output_seen = p.output_seen.max(view.info.output_offset);
                    p.input_confirmed = p.input_confirmed.max(view.input_acked);
                    if view.closed() {
                        closed.push(format!(
                            "terminal {} closed: {:?} ({:?}) at output offset {}",
                            p.text,
                            view.info.exit_result,
                            view.info.close_reason,
                            view.info.output_offset
                        ));
                        p.closed = Some(view.info);
                    }
                }
                Err(_) => {}
            }
        }
        for line in closed {
            self.log(line);
            self.count("terminal closed");
        }
        if let Some(first) = problems.into_iter().next()
            && self.failure.is_none()
        {
            self.failure = Some(first);
        }
    }

    /// The whole recording of terminal `id` as a viewer from offset 0
    /// gets it, and the input it recorded.
    fn read_recording(&self, id: &[u8; 16]) -> Option<Recording> {
        use rvbox_store_port::pty::{PtyRecordKind, viewer_end_cut, viewer_items};
        let db = self.server.engine.as_ref()?.store().db();
        let mut items = vec![ViewerItem::Attached { from: 0 }];
        let mut inputs = Vec::new();
        let (mut want, mut cursor) = (0u64, 0u64);
        for _ in 0..crate::oracles::MAX_READS {
            let records = rvbox_store::pty::records_after(db, id, cursor, 1 << 20).ok()?;
            if records.is_empty() {
                let info = rvbox_store::pty::info(db, id).ok()?;
                if info.state == wire::PtyState::Closed as i32 {
                    if let Some(cut) = viewer_end_cut(want, info.output_offset) {
                        items.push(ViewerItem::Cut {
                            requested: cut.requested_offset,
                            resumes: cut.ring_start_offset,
                        });
                    }
                    items.push(ViewerItem::Closed {
                        output_offset: info.output_offset,
                    });
                }
                return Some((items, inputs));
            }
            for r in records {
                cursor = r.rec_seq;
                if let PtyRecordKind::Input { input_seq } = r.kind {
                    inputs.push((input_seq, r.data.clone()));
                }
                let (got, next) = viewer_items(want, &r);
                items.extend(got.into_iter().map(crate::terminals::viewer_item));
                want = next;
            }
        }
        None
    }

    /// The terminal oracles, once every terminal ended: input, output
    /// (every viewer, and the whole recording read from the start), the
    /// close, and one holder per terminal.
    fn check_terminal_oracles(&mut self) {
        use crate::terminals::{
            check_recorded_input, check_terminal_close, check_terminal_input, check_viewer,
        };
        let mut counts = TerminalCounts::default();
        let mut problems = Vec::new();
        let mut skipped = 0u64;
        let idle = self.server.pty.idle_timeout_ms
            < rvbox_server_core::PtyPolicy::default().idle_timeout_ms;
        let recordings: Vec<Option<Recording>> = self
            .terms
            .iter()
            .map(|p| p.opened.then(|| self.read_recording(&p.id)).flatten())
            .collect();
        let current: Vec<Option<wire::PtySessionInfo>> = self
            .terms
            .iter()
            .map(|p| {
                self.server.engine.as_ref().and_then(|e| {
                    rvbox_store::pty::load_view(e.store().db(), &p.id)
                        .ok()
                        .flatten()
                        .map(|v| v.info)
                })
            })
            .collect();
        let log = self
            .process_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, plan) in self.terms.iter().enumerate() {
            if !plan.opened {
                continue;
            }
            let Ok(uuid) = Uuid7::from_bytes("pty_session_id", plan.id) else {
                continue;
            };
            let record = log.terminal(&uuid);
            if record.is_some_and(|r| r.truncated) {
                skipped += 1;
                continue;
            }
            // the close
            match (&plan.closed, current.get(i).cloned().flatten()) {
                (Some(first), now) => {
                    if let Some(now) = now
                        && (now.exit_result != first.exit_result
                            || now.close_reason != first.close_reason
                            || now.output_offset != first.output_offset)
                    {
                        problems.push(format!(
                            "terminal {}: its closed record changed from {:?} ({:?}, offset {}) to {:?} ({:?}, offset {})",
                            plan.text,
                            first.exit_result,
                            first.close_reason,
                            first.output_offset,
                            now.exit_result,
                            now.close_reason,
                            now.output_offset
                        ));
                    }
                    let asked = CloseAsked {
                        by_operator: plan.close_sent,
                        idle,
                    };
                    problems.extend(check_terminal_close(
                        &plan.text,
                        first,
                        record,
                        asked,
                        &mut counts,
                    ));
                }
                (None, _) => problems.push(format!(
                    "terminal {}: the run ended without the server showing it closed",
                    plan.text
                )),
            }
            // input
            let hung_up = record.is_some_and(|r| r.hung_up && !r.exit_unrecorded);
            problems.extend(check_terminal_input(
                &plan.text,
                &plan.typed,
                record,
                plan.input_confirmed,
                hung_up,
                &mut counts,
            ));
            // output, as each viewer was served it and as the whole
            // recording serves it now
            if record.is_some_and(|r| r.replaced > 0) {
                skipped += 1;
                continue;
            }
            let output: &[u8] = record.map_or(&[], |r| r.output.as_slice());
            let mut cut = 0u64;
            let mut served: Vec<&[ViewerItem]> = self
                .viewers
                .iter()
                .filter(|v| v.plan == i)
                .map(|v| v.items.as_slice())
                .collect();
            if let Some(Some((items, inputs))) = recordings.get(i) {
                served.push(items.as_slice());
                problems.extend(check_recorded_input(&plan.text, &plan.typed, inputs));
            }
            for items in served {
                counts.viewers += 1;
                match check_viewer(&plan.text, items, output) {
                    Ok((b, c)) => {
                        counts.output_bytes += b;
                        counts.cut_bytes += c;
                        cut += c;
                    }
                    Err(e) => problems.push(e),
                }
            }
            // bytes are cut only when the PTY produced more than its rings
            // hold, when quotas trimmed the recording, or when a daemon
            // died with the only copy of output after the shell's end
            if cut > 0
                && !self.server.tight
                && output.len() <= crate::supervisor::MODEL_RING_BYTES
                && !record.is_some_and(|r| r.copy_lost_after_end)
            {
                let cuts: Vec<String> = recordings
                    .get(i)
                    .and_then(Option::as_ref)
                    .map(|(items, _)| {
                        items
                            .iter()
                            .filter_map(|x| match x {
                                ViewerItem::Cut { requested, resumes } => {
                                    Some(format!("[{requested}, {resumes})"))
                                }
                                _ => None,
                            })
                            .take(4)
                            .collect()
                    })
                    .unwrap_or_default();
                problems.push(format!(
                    "terminal {}: {cut} bytes served as cut, though its PTY produced only {} bytes (less than a ring); the recording's cuts: {}",
                    plan.text,
                    output.len(),
                    cuts.join(" ")
                ));
            }
        }
        drop(log);
        for (k, v) in [
            ("oracle terminal_frames", counts.frames),
            ("oracle terminal_frames_acked", counts.acked),
            (
                "oracle terminal_frames_unanswered_delivered",
                counts.unanswered_delivered,
            ),
            ("oracle terminal_output_bytes", counts.output_bytes),
            ("oracle terminal_cut_bytes", counts.cut_bytes),
            ("oracle terminal_viewers", counts.viewers),
            ("oracle terminal_closes", counts.closes),
            ("oracle terminals_skipped", skipped),
        ] {
            self.add(k, v);
        }
        let replaced: u64 = self
            .clients
            .iter()
            .map(|c| c.counters().holders_replaced)
            .sum();
        self.add("client terminal_holders_replaced", replaced);
        // what the running cores saw since their start (a restart resets
        // them): repeats filtered before a holder, ends held for an attach
        let stats: Vec<_> = self
            .clients
            .iter()
            .filter_map(crate::host::SimHost::terminal_stats)
            .collect();
        for (k, v) in [
            (
                "client terminal_input_repeats",
                stats.iter().map(|s| s.input_repeats).sum::<u64>(),
            ),
            (
                "client terminal_closes_awaiting_attach",
                stats.iter().map(|s| s.closes_awaiting_attach).sum(),
            ),
            (
                "client terminal_output_cuts",
                stats.iter().map(|s| s.output_cuts).sum(),
            ),
        ] {
            self.add(k, v);
        }
        if let Some(first) = problems.first()
            && self.failure.is_none()
        {
            self.failure = Some(format!(
                "terminal oracle: {} problem(s), first: {first}",
                problems.len()
            ));
        }
    }
}

/// Runs one seed.
///
/// # Errors
/// When the run cannot even start (temporary directory).
pub fn run(seed: u64, config: &SimConfig) -> Result<Report, String> {
    let mut world = World::new(seed, config.clone())?;
    // a hook from the start: every point passed counts; and each seed
    // arms one point of each side from its start (the seed picks which),
    // so that a batch of as many seeds as points reaches even those a run
    // passes once
    world.rearm(Vec::new());
    if config.faults {
        world.focus_crash_points();
    }
    Ok(world.run())
}
