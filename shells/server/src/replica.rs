//! A server replica on PostgreSQL (docs/scaleout.md): the connection
//! string with its password file, the lease keeper's thread (renewal,
//! self-fencing, single-runner duties, the janitor) and the listener's
//! thread (wake-ups from the other replicas, with polling as the
//! fallback). Both threads only feed inputs into the core's inbox; every
//! decision of the protocol stays in the core.
//!
//! Must never: log the connection string once a password is in it; let
//! the core go on serving past the moment its lease may have ended (the
//! keeper's self-fence is earlier than the lease's end on the database
//! clock); take a duty the PostgreSQL store does not implement.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rvbox_config::PostgresConfig;
use rvbox_server_core::Input;
use rvbox_store_pg::PgStore;
use rvbox_store_pg::notify::{Listener, WakeUp};
use rvbox_store_port::replica::{Duty, LeaseKeeper, LeaseState, LeaseTimes};
use tokio::sync::{mpsc, oneshot};

use crate::core_loop::ToCore;
use crate::metrics::ReasonLabel;

/// The duties a replica on PostgreSQL takes: every one (docs/scaleout.md).
pub(crate) const DUTIES: [Duty; 5] = Duty::ALL;

/// How long the listener waits for notifications per turn.
const LISTEN_SLICE: Duration = Duration::from_secs(1);
/// Every connected client looks for its work this often, whatever the
/// notifications said (the polling fallback).
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Most wake-ups taken per listener turn.
const WAKE_BATCH: usize = 512;
/// A listener that hears nothing for this long, not even the lease
/// heartbeats every replica's keeper sends every 3 s, has a silent
/// connection: it connects again (and polls meanwhile).
const LISTENER_SILENCE: Duration = Duration::from_secs(10);
/// The longest the keeper sleeps between looks at its stop flag.
const KEEPER_SLICE: Duration = Duration::from_millis(200);
/// How often the watchdog looks at the fence deadline.
const WATCHDOG_SLICE: Duration = Duration::from_millis(50);

/// The replica's metrics (bounded labels: an outcome, a kind, a duty).
#[derive(Debug, Default)]
pub(crate) struct ReplicaMetrics {
    /// Lease renewals, by outcome (`renewed`, `refused`, `failed`).
    renewals: Family<ReasonLabel, Counter>,
    /// 1 while the lease is live and the replica serves.
    serving: Gauge,
    /// Duties held.
    duties: Gauge,
    /// Wake-ups received, by kind (`client`, `command`, `fleet`, `sweep`).
    wakeups: Family<ReasonLabel, Counter>,
    /// Listener connections lost.
    listener_lost: Counter,
    /// Sessions of lost replicas ended by the janitor here.
    janitor_ended: Counter,
}

impl ReplicaMetrics {
    fn renewal(&self, reason: &'static str) {
        self.renewals.get_or_create(&ReasonLabel { reason }).inc();
    }

    fn wakeup(&self, reason: &'static str) {
        self.wakeups.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Registers every metric under the `rvbox_replica` prefix.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("rvbox_replica");
        r.register(
            "lease_renewals",
            "Replica lease renewals, by outcome (renewed, refused, failed)",
            self.renewals.clone(),
        );
        r.register(
            "serving",
            "1 while this replica's lease is live and it serves clients",
            self.serving.clone(),
        );
        r.register(
            "duties_held",
            "Single-runner duties this replica holds",
            self.duties.clone(),
        );
        r.register(
            "wakeups",
            "Wake-ups from other replicas, by kind (client, command, fleet, sweep)",
            self.wakeups.clone(),
        );
        r.register(
            "listener_lost",
            "Times the notification listener's connection was lost",
            self.listener_lost.clone(),
        );
        r.register(
            "janitor_sessions_ended",
            "Sessions of lost replicas ended by this replica's janitor",
            self.janitor_ended.clone(),
        );
    }
}

/// The connection string with the password from `password_file`, if any.
/// The result may hold a secret: never log it.
///
/// # Errors
/// A password file that cannot be read, is readable by others, or is
/// empty, named with its path.
pub(crate) fn conninfo(cfg: &PostgresConfig) -> Result<String, String> {
    let Some(path) = &cfg.password_file else {
        return Ok(cfg.conninfo.clone());
    };
    let password = read_password(path)?;
    Ok(with_password(&cfg.conninfo, &password))
}

fn read_password(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| format!("postgres.password_file {shown}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "postgres.password_file {shown} is readable by others (mode {mode:04o}); chmod 600 it"
        ));
    }
    if meta.len() > 4096 {
        return Err(format!(
            "postgres.password_file {shown} is {} bytes; a password file holds one line",
            meta.len()
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("postgres.password_file {shown}: {e}"))?;
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() {
        return Err(format!(
            "postgres.password_file {shown} is empty (its first line is the password)"
        ));
    }
    Ok(line.to_owned())
}

/// `conninfo` with `password` added: a quoted `password='...'` pair for
/// the key=value form, a percent-encoded query parameter for a URL.
fn with_password(conninfo: &str, password: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let mut enc = String::with_capacity(password.len() * 3);
        for b in password.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                enc.push(char::from(b));
            } else {
                enc.push_str(&format!("%{b:02X}"));
            }
        }
        let sep = if conninfo.contains('?') { '&' } else { '?' };
        format!("{conninfo}{sep}password={enc}")
    } else {
        let quoted = password.replace('\\', "\\\\").replace('\'', "\\'");
        format!("{conninfo} password='{quoted}'")
    }
}

/// What a started replica hands the daemon.
pub(crate) struct Started {
    /// The store the executor thread runs (its sessions are this
    /// replica's).
    pub(crate) store: PgStore,
    /// The server id every replica shares.
    pub(crate) server_id: [u8; 16],
    /// The keeper's own connection, the lease as joined and the instant
    /// its times count from, for [`spawn`].
    pub(crate) keeper: (PgStore, LeaseKeeper, Instant),
    /// The epoch the database gave this replica.
    pub(crate) epoch: u64,
}

impl std::fmt::Debug for Started {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Started")
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// Connects (applying migrations once, under their lock), joins as a
/// replica with a fresh epoch, and reads the shared server id. Blocking.
///
/// # Errors
/// The database cannot be reached, or refuses.
pub(crate) fn join(
    conninfo: &str,
    opts: rvbox_store_pg::StoreOptions,
    peer_addr: &str,
    times: LeaseTimes,
    wall_ms: i64,
) -> Result<Started, String> {
    let mut store = PgStore::connect(conninfo, opts.clone()).map_err(|e| e.to_string())?;
    let mut keeper_store = PgStore::connect(conninfo, opts).map_err(|e| e.to_string())?;
    let mut keeper = LeaseKeeper::new(times);
    let start = Instant::now();
    let replica = keeper_store
        .join(Some(peer_addr), times)
        .map_err(|e| e.to_string())?;
    keeper.renewed(ms_since(start, start));
    store.adopt_replica(replica, times);
    let server_id = store.server_id(wall_ms).map_err(|e| e.to_string())?;
    Ok(Started {
        store,
        server_id,
        keeper: (keeper_store, keeper, start),
        epoch: replica.epoch,
    })
}

fn ms_since(origin: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(origin).as_millis()).unwrap_or(u64::MAX)
}

/// The replica's two threads, running.
pub(crate) struct Threads {
    stop: Arc<AtomicBool>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Threads {
    /// Tells the threads to stop. They are not waited for: one may be in a
    /// database call on a connection to a host that went silent, and the
    /// daemon's exit must not wait for that; what they do is only ever
    /// inputs to a core that has stopped.
    pub(crate) fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        drop(self.handles);
    }
}

/// The keeper's and the listener's threads. The keeper's store and the
/// lease state come from [`join`]; `lost` is answered once when the lease
/// is lost.
pub(crate) fn spawn(
    keeper: (PgStore, LeaseKeeper, Instant),
    conninfo: String,
    core: mpsc::Sender<ToCore>,
    metrics: Arc<ReplicaMetrics>,
    lost: oneshot::Sender<String>,
) -> std::io::Result<Threads> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    let (store, keeper, origin) = keeper;
    let deadline = Arc::new(Deadline {
        origin,
        fence_at_ms: std::sync::atomic::AtomicU64::new(keeper.fences_at().unwrap_or(0)),
        refused: AtomicBool::new(false),
    });
    let (s, c, m, d) = (
        Arc::clone(&stop),
        core.clone(),
        Arc::clone(&metrics),
        Arc::clone(&deadline),
    );
    handles.push(
        std::thread::Builder::new()
            .name("rvbox-replica-lease".into())
            .spawn(move || keep_lease(store, keeper, &s, &c, &m, &d))?,
    );
    let (s, c, m) = (Arc::clone(&stop), core.clone(), Arc::clone(&metrics));
    handles.push(
        std::thread::Builder::new()
            .name("rvbox-replica-fence".into())
            .spawn(move || watch_fence(&deadline, &s, &c, &m, lost))?,
    );
    let (s, m) = (Arc::clone(&stop), metrics);
    handles.push(
        std::thread::Builder::new()
            .name("rvbox-replica-listen".into())
            .spawn(move || listen(&conninfo, &s, &core, &m, LISTENER_SILENCE))?,
    );
    Ok(Threads { stop, handles })
}

/// Sends an input to the core; false when the core is gone.
fn send(core: &mpsc::Sender<ToCore>, msg: ToCore) -> bool {
    core.blocking_send(msg).is_ok()
}

/// When the replica must consider itself fenced, shared by the keeper
/// (which moves it after each renewal) and the watchdog (which acts on
/// it): a keeper stuck in a database call, on a connection to a host that
/// went silent, cannot delay the fence.
struct Deadline {
    origin: Instant,
    /// Milliseconds after `origin`; 0 once the database refused a renewal.
    fence_at_ms: std::sync::atomic::AtomicU64,
    refused: AtomicBool,
}

impl Deadline {
    fn now(&self) -> u64 {
        ms_since(self.origin, Instant::now())
    }
}

/// Renews the lease on time, takes and keeps duties, runs the janitor,
/// and moves the fence deadline the watchdog enforces.
fn keep_lease(
    mut store: PgStore,
    mut keeper: LeaseKeeper,
    stop: &AtomicBool,
    core: &mpsc::Sender<ToCore>,
    metrics: &ReplicaMetrics,
    deadline: &Deadline,
) {
    let now = || deadline.now();
    let times = keeper.times();
    // duties held, with the start of their last successful hold
    let mut held: BTreeMap<Duty, u64> = BTreeMap::new();
    let mut told: Vec<Duty> = Vec::new();
    loop {
        if stop.load(Ordering::SeqCst) || keeper.state(now()) == LeaseState::Fenced {
            return;
        }
        if now() >= keeper.next_renewal() {
            let started = now();
            match store.renew() {
                Ok(true) => {
                    keeper.renewed(started);
                    metrics.renewal("renewed");
                    deadline
                        .fence_at_ms
                        .store(keeper.fences_at().unwrap_or(0), Ordering::SeqCst);
                }
                Ok(false) => {
                    metrics.renewal("refused");
                    deadline.refused.store(true, Ordering::SeqCst);
                    deadline.fence_at_ms.store(0, Ordering::SeqCst);
                    return;
                }
                Err(e) => {
                    metrics.renewal("failed");
                    tracing::warn!(error = %e, "replica lease renewal failed; trying again");
                    keeper.failed(now());
                }
            }
            if keeper.state(now()) == LeaseState::Live {
                for duty in DUTIES {
                    let at = now();
                    match store.hold_duty(duty) {
                        Ok(true) => {
                            held.insert(duty, at);
                        }
                        Ok(false) => {
                            held.remove(&duty);
                        }
                        Err(e) => {
                            tracing::warn!(duty = duty.name(), error = %e, "duty lease not renewed");
                        }
                    }
                }
            }
            // a duty whose renewal kept failing is given up before its
            // lease on the database clock can end
            let t = now();
            held.retain(|_, at| t < at.saturating_add(times.self_fence_ms));
            if held.contains_key(&Duty::Janitor) {
                match store.end_sessions_of_lost_replicas(crate::core_loop::Clock::wall_ms()) {
                    Ok(n) => {
                        metrics.janitor_ended.inc_by(n);
                    }
                    Err(e) => tracing::warn!(error = %e, "janitor pass failed"),
                }
            }
            let now_held: Vec<Duty> = held.keys().copied().collect();
            if now_held != told {
                metrics
                    .duties
                    .set(i64::try_from(now_held.len()).unwrap_or(0));
                tracing::info!(
                    duties = ?now_held.iter().map(|d| d.name()).collect::<Vec<_>>(),
                    "replica duties held"
                );
                if !send(
                    core,
                    ToCore::Replica(Input::Duties {
                        held: now_held.clone(),
                    }),
                ) {
                    return;
                }
                told = now_held;
            }
        }
        let until = keeper
            .next_renewal()
            .min(keeper.fences_at().unwrap_or(u64::MAX));
        let wait = Duration::from_millis(until.saturating_sub(now()));
        std::thread::sleep(wait.min(KEEPER_SLICE));
    }
}

/// Fences the replica at its deadline, whatever the keeper is doing:
/// the core closes every connection and runs no duty, and `lost` tells
/// the daemon to exit.
fn watch_fence(
    deadline: &Deadline,
    stop: &AtomicBool,
    core: &mpsc::Sender<ToCore>,
    metrics: &ReplicaMetrics,
    lost: oneshot::Sender<String>,
) {
    metrics.serving.set(1);
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if deadline.now() >= deadline.fence_at_ms.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(WATCHDOG_SLICE);
    }
    let why = if deadline.refused.load(Ordering::SeqCst) {
        "the database says this replica's lease had ended"
    } else {
        "no lease renewal succeeded within the self-fence time"
    };
    metrics.serving.set(0);
    metrics.duties.set(0);
    tracing::error!(
        reason = why,
        "replica lease lost: closing every connection and stopping"
    );
    let _ = send(core, ToCore::Replica(Input::Serving { serving: false }));
    let _ = lost.send(why.to_owned());
}

/// Listens for wake-ups and passes them to the core; polls while the
/// listener is not connected, and sweeps every connected client now and
/// then whatever happens.
fn listen(
    conninfo: &str,
    stop: &AtomicBool,
    core: &mpsc::Sender<ToCore>,
    m: &ReplicaMetrics,
    silence: Duration,
) {
    let mut listener: Option<Listener> = None;
    let mut last_sweep = Instant::now();
    let mut last_heard = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let Some(l) = listener.as_mut() else {
            match Listener::connect(conninfo) {
                Ok(l) => {
                    tracing::info!("listening for wake-ups from other replicas");
                    listener = Some(l);
                    last_heard = Instant::now();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "wake-up listener could not connect; polling");
                    std::thread::sleep(LISTEN_SLICE);
                }
            }
            // whatever was missed meanwhile: every client looks again,
            // and followers read again
            m.wakeup("sweep");
            last_sweep = Instant::now();
            if !send(core, ToCore::Replica(Input::WakeAll)) || !send(core, ToCore::Changed) {
                return;
            }
            continue;
        };
        match l.wait(LISTEN_SLICE, WAKE_BATCH) {
            Ok(wakes) => {
                let mut changed = false;
                if !wakes.is_empty() {
                    last_heard = Instant::now();
                }
                for w in wakes {
                    match w {
                        WakeUp::Heartbeat => {}
                        WakeUp::Client { client, issue } => {
                            m.wakeup("client");
                            if !send(core, ToCore::Replica(Input::Wake { client, issue })) {
                                return;
                            }
                        }
                        WakeUp::Command(_) => {
                            m.wakeup("command");
                            changed = true;
                        }
                        WakeUp::Fleet => {
                            m.wakeup("fleet");
                            changed = true;
                            if !send(core, ToCore::Replica(Input::FleetWake)) {
                                return;
                            }
                        }
                    }
                }
                if changed && !send(core, ToCore::Changed) {
                    return;
                }
            }
            Err(e) => {
                m.listener_lost.inc();
                tracing::warn!(error = %e, "wake-up listener lost; connecting again");
                listener = None;
                continue;
            }
        }
        if last_heard.elapsed() >= silence {
            m.listener_lost.inc();
            tracing::warn!(
                silent_ms = u64::try_from(last_heard.elapsed().as_millis()).unwrap_or(u64::MAX),
                "wake-up listener heard nothing, not even a lease heartbeat; connecting again"
            );
            listener = None;
            continue;
        }
        if last_sweep.elapsed() >= SWEEP_EVERY {
            m.wakeup("sweep");
            last_sweep = Instant::now();
            if !send(core, ToCore::Replica(Input::WakeAll)) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the listener for `for_` at a silence limit of 2 s; returns how
    /// often it found its connection lost.
    fn listener_losses(conninfo: &str, for_: Duration) -> u64 {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, mut rx) = mpsc::channel(1024);
        let m = Arc::new(ReplicaMetrics::default());
        let t = {
            let (stop, m, conninfo) = (Arc::clone(&stop), Arc::clone(&m), conninfo.to_owned());
            std::thread::spawn(move || listen(&conninfo, &stop, &tx, &m, Duration::from_secs(2)))
        };
        let until = Instant::now() + for_;
        while Instant::now() < until {
            while rx.try_recv().is_ok() {}
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::SeqCst);
        while rx.try_recv().is_ok() {}
        t.join().unwrap();
        m.listener_lost.get()
    }

    /// A listener whose connection hears nothing, not even a lease
    /// heartbeat, connects again; while some replica renews its lease
    /// (every 500 ms here), it never does.
    #[test]
    fn a_listener_that_hears_no_heartbeat_connects_again() {
        let pg = rvbox_testkit::Postgres::start();
        pg.psql("postgres", "CREATE DATABASE rvbox");
        let conninfo = pg.conninfo("rvbox");
        // nobody renews: silence, and a reconnection about every 2 s
        assert!(listener_losses(&conninfo, Duration::from_secs(5)) >= 1);
        // a replica renews: the heartbeats keep the listener
        let renewing = Arc::new(AtomicBool::new(true));
        let keeper = {
            let (conninfo, renewing) = (conninfo.clone(), Arc::clone(&renewing));
            std::thread::spawn(move || {
                let mut store = PgStore::connect(&conninfo, Default::default()).unwrap();
                store.join(None, LeaseTimes::default()).unwrap();
                while renewing.load(Ordering::SeqCst) {
                    assert!(store.renew().unwrap());
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(listener_losses(&conninfo, Duration::from_secs(5)), 0);
        renewing.store(false, Ordering::SeqCst);
        keeper.join().unwrap();
    }

    #[test]
    fn a_password_is_added_quoted_or_encoded_and_never_inline() {
        assert_eq!(
            with_password("host=db dbname=rvbox", "it's a \\ pass"),
            "host=db dbname=rvbox password='it\\'s a \\\\ pass'"
        );
        assert_eq!(
            with_password("postgres://rvbox@db/rvbox", "p@ss word"),
            "postgres://rvbox@db/rvbox?password=p%40ss%20word"
        );
        assert_eq!(
            with_password("postgres://rvbox@db/rvbox?sslmode=disable", "x"),
            "postgres://rvbox@db/rvbox?sslmode=disable&password=x"
        );
    }

    #[test]
    fn a_password_file_readable_by_others_or_empty_is_refused_by_name() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pw");
        std::fs::write(&p, "secret\nignored\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_password(&p).unwrap_err();
        assert!(e.contains("readable by others") && e.contains("pw"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password(&p).unwrap(), "secret");
        std::fs::write(&p, "\n").unwrap();
        assert!(read_password(&p).unwrap_err().contains("empty"));
        assert!(read_password(&dir.path().join("none")).is_err());
    }
}
