//! The client daemon's start, run and stop (plan §7, R7).
//!
//! Start: open the client store (its instance lock, migrations and
//! identity; a damaged identity refuses to start and names `rvbox
//! repair`), start the supervisor, compile the resource profiles against
//! what it detected, and run the client runtime on its own thread. The
//! network lives in [`crate::net`] on tokio.
//!
//! The runtime thread is the client's thin loop: take every input the
//! network posted, fire the timer when due, hand the frames the core
//! released to the network, then wait for process events until the
//! deadline or until the network wakes it.
//!
//! Stop, on SIGTERM or SIGINT: the core closes the connection with 1012
//! and terminates every supervised tree; the loop keeps spooling their
//! last output and terminal events (bounded by the drain and kill grace),
//! and the store closes. Everything spooled is sent after the next start.
//! Interactive terminals are not stopped: their holders outlive the
//! daemon, and the next start adopts each from its record
//! (docs/terminals.md).
//!
//! Must never: wait on the network (frames go to a bounded channel while
//! it has room, and wait in the runtime's own bounded queue otherwise;
//! heartbeats have their own channel), or launch anything before the
//! configuration validated (the caller's gate).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use rvbox_client_core::machine::Input;
use rvbox_client_runtime::profiles::compile_profiles;
use rvbox_client_runtime::settings::{client_core_config, supervisor_config};
use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_config::ClientConfig;
use rvbox_daemon_common::notify::Notifier;
use rvbox_storage::entropy::{Entropy as _, OsEntropy};
use rvbox_storage::fs::RealFs;
use rvbox_supervisor::{Supervisor as _, UnixSupervisor};
use tokio::sync::mpsc::Sender;

use crate::net::{self, NetConfig};

/// Exit status: a clean stop.
pub(crate) const EXIT_OK: i32 = 0;
/// Exit status: the daemon could not start.
pub(crate) const EXIT_START: i32 = 1;
/// The longest wait of the runtime thread between looks at its inputs.
const MAX_WAIT: Duration = Duration::from_secs(1);
/// Beyond the drain and kill grace, how long a stop waits for the trees
/// it terminated to be drained and their terminal events spooled.
const STOP_SLACK: Duration = Duration::from_secs(5);
/// The runtime thread's longest wait while frames wait for room in the
/// transport's channel.
const BACKLOG_WAIT: Duration = Duration::from_millis(2);

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the network and the signal handler post to the runtime thread
/// (inputs are moved through a bounded channel once each; boxing them
/// would cost an allocation per frame).
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum ToRuntime {
    /// An input for the core.
    Input(Input),
    /// Stop.
    Stop,
}

/// Runs the daemon until a stop signal; returns the exit status.
pub(crate) fn run(cfg: ClientConfig) -> i32 {
    let notifier = Notifier::from_env();
    let opts = ClientStoreOptions {
        tombstone_cap: cfg.spool.tombstones,
        ..ClientStoreOptions::default()
    };
    let store = match ClientStore::open(
        ClientLayout::new(cfg.client.state_dir.clone()),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        opts,
        wall_ms(),
    ) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "the client store could not be opened");
            eprintln!(
                "rvbox: client store {}: {e}",
                cfg.client.state_dir.display()
            );
            return EXIT_START;
        }
    };
    let Some(instance) = store.instance_id() else {
        tracing::error!("the installation identity is damaged; not registering");
        eprintln!(
            "rvbox: the identity file in {} is damaged; run `rvbox repair --state-dir {}` (a new identity would look like a different installation)",
            cfg.client.state_dir.display(),
            cfg.client.state_dir.display()
        );
        return EXIT_START;
    };
    let launcher = match std::env::current_exe().and_then(std::fs::canonicalize) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "the daemon's own executable cannot be found");
            return EXIT_START;
        }
    };
    let supervisor = match UnixSupervisor::new(supervisor_config(&cfg, launcher)) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "the supervisor could not start");
            eprintln!("rvbox: supervisor: {e}");
            return EXIT_START;
        }
    };
    tracing::info!(mode = ?supervisor.mode(), "process supervision");
    let compiled = compile_profiles(&cfg.profiles, |l| supervisor.check_limits(l));
    let core_config = match client_core_config(&cfg, &instance, supervisor.mode(), &compiled) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "configuration refused by the client core");
            return EXIT_START;
        }
    };
    let mut seed = [0u8; 8];
    if let Err(e) = OsEntropy.fill(&mut seed) {
        tracing::error!(error = %e, "the OS random generator failed");
        return EXIT_START;
    }
    let waker = supervisor.waker();
    let runtime = match Runtime::new(core_config, store, supervisor, u64::from_le_bytes(seed)) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "the client runtime could not start");
            eprintln!("rvbox: {e}");
            return EXIT_START;
        }
    };
    tracing::info!(client_id = %cfg.client.client_id, instance = %instance, "client runtime started");
    let transport_metrics = net::TransportMetrics::new();
    let health = crate::health::Health::new(runtime.store().metrics(), &transport_metrics);
    health.publish(&runtime, true);

    let tokio_rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("rvbox-net")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "the async runtime could not start");
            return EXIT_START;
        }
    };
    let (to_rt, from_net) = std::sync::mpsc::sync_channel(net::RUNTIME_INBOX);
    let (wire_tx, wire_rx) = tokio::sync::mpsc::channel(net::WIRE_CHANNEL);
    let (beat_tx, beat_rx) = tokio::sync::mpsc::channel(net::HEARTBEAT_CHANNEL);
    let wire_out = WireTx {
        frames: wire_tx,
        heartbeats: beat_tx,
    };
    let net_config = match NetConfig::from_config(&cfg) {
        Ok(n) => n,
        Err(e) => {
            tracing::error!(error = %e, "the network configuration could not be used");
            eprintln!("rvbox: {e}");
            return EXIT_START;
        }
    };
    let poster = net::Poster::new(to_rt.clone(), waker.clone());
    let stop_grace = cfg.exec.drain_grace + cfg.exec.kill_grace + STOP_SLACK;
    let published = Arc::clone(&health);
    let pinger = Watchdog::new(notifier.clone());
    let thread = match std::thread::Builder::new()
        .name("rvbox-runtime".into())
        .spawn(move || {
            runtime_loop(
                runtime, &from_net, &wire_out, stop_grace, &published, pinger,
            );
        }) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "the runtime thread could not start");
            return EXIT_START;
        }
    };
    let metrics_listen = cfg.observability.metrics_listen;
    let status = tokio_rt.block_on(async {
        let health_task = match metrics_listen {
            Some(addr) => match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => {
                    tracing::info!(%addr, "health listening (/healthz, /readyz, /metrics)");
                    Some(tokio::spawn(crate::health::serve(l, Arc::clone(&health))))
                }
                Err(e) => {
                    tracing::error!(%addr, error = %e, "observability.metrics_listen could not bind");
                    eprintln!("rvbox: cannot listen on {addr} (observability.metrics_listen): {e}");
                    poster.stop().await;
                    return EXIT_START;
                }
            },
            None => None,
        };
        let wire_rx = net::WireRx {
            frames: wire_rx,
            heartbeats: beat_rx,
        };
        let net = tokio::spawn(net::run(
            net_config,
            wire_rx,
            poster.clone(),
            transport_metrics,
        ));
        // systemd: the store is open, the supervisor detected its layout,
        // the runtime runs and the network dials
        notifier.ready("running; dialing the server");
        wait_for_stop().await;
        notifier.stopping("stopping: terminating supervised trees");
        poster.stop().await;
        // the runtime closes the connection (1012) and drains the trees
        let joined = tokio::task::spawn_blocking(move || thread.join()).await;
        if !matches!(joined, Ok(Ok(()))) {
            tracing::error!("the runtime thread ended abnormally");
        }
        net.abort();
        if let Some(h) = health_task {
            h.abort();
        }
        EXIT_OK
    });
    tokio_rt.shutdown_timeout(Duration::from_secs(2));
    tracing::info!("stopped");
    status
}

async fn wait_for_stop() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("signal handlers could not be installed; stopping");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!(signal = "SIGTERM", "stop signal"),
        _ = int.recv() => tracing::info!(signal = "SIGINT", "stop signal"),
    }
}

/// The runtime's side of the channels to the transport.
struct WireTx {
    frames: Sender<Wire>,
    heartbeats: Sender<Wire>,
}

/// Hands the transport what the core released: every heartbeat on its
/// own channel (dropped when it is full: a heartbeat carries nothing),
/// then frames while the frame channel has room; the rest wait in the
/// runtime, within its bounds, for the next call. True when frames wait.
fn ship(rt: &mut Runtime<UnixSupervisor>, wire: &WireTx) -> bool {
    use tokio::sync::mpsc::error::TrySendError;
    for h in rt.take_heartbeats() {
        if let Err(TrySendError::Full(_)) = wire.heartbeats.try_send(h) {
            tracing::debug!("heartbeat channel full; heartbeat dropped");
        }
    }
    loop {
        let permit = match wire.frames.try_reserve() {
            Ok(p) => p,
            Err(TrySendError::Full(())) => return rt.wire_pending().0 > 0,
            // the network task ends only with the daemon
            Err(TrySendError::Closed(())) => {
                while rt.pop_wire().is_some() {}
                return false;
            }
        };
        let Some(w) = rt.pop_wire() else {
            return false;
        };
        permit.send(w);
    }
}

/// The systemd watchdog, pinged by the runtime thread: a loop that stops
/// turning (a store write that never returns, a deadlock) stops the pings,
/// and systemd restarts the daemon.
struct Watchdog {
    notifier: Notifier,
    every: Option<Duration>,
    next: Instant,
}

impl Watchdog {
    fn new(notifier: Notifier) -> Self {
        let every = notifier.watchdog_interval();
        if let Some(every) = every {
            tracing::info!(every_ms = every.as_millis(), "systemd watchdog enabled");
        }
        Self {
            notifier,
            every,
            next: Instant::now(),
        }
    }

    /// Pings when due.
    fn tick(&mut self) {
        if let Some(every) = self.every {
            let now = Instant::now();
            if now >= self.next {
                self.notifier.watchdog();
                self.next = now + every;
            }
        }
    }

    /// The longest the loop may wait before the next ping is due.
    fn until_due(&self) -> Duration {
        match self.every {
            Some(_) => self.next.saturating_duration_since(Instant::now()),
            None => MAX_WAIT,
        }
    }
}

fn runtime_loop(
    mut rt: Runtime<UnixSupervisor>,
    inbox: &Receiver<ToRuntime>,
    wire: &WireTx,
    stop_grace: Duration,
    health: &crate::health::Health,
    mut watchdog: Watchdog,
) {
    let mut stopping: Option<Instant> = None;
    loop {
        watchdog.tick();
        loop {
            match inbox.try_recv() {
                Ok(ToRuntime::Input(i)) => rt.input(i),
                Ok(ToRuntime::Stop) | Err(TryRecvError::Disconnected) if stopping.is_some() => {
                    break;
                }
                Ok(ToRuntime::Stop) | Err(TryRecvError::Disconnected) => {
                    tracing::info!(
                        "stopping: closing the session with 1012 and terminating supervised trees"
                    );
                    rt.input(Input::Shutdown);
                    stopping = Some(Instant::now() + stop_grace);
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        rt.tick();
        let backlog = ship(&mut rt, wire);
        if let Some(until) = stopping {
            let (running, _) = rt.core().capacity();
            if running == 0 || Instant::now() >= until {
                if running > 0 {
                    tracing::warn!(
                        running,
                        "trees still running at the end of the stop wait; the next start reaps them"
                    );
                }
                ship(&mut rt, wire);
                return;
            }
        }
        health.publish(&rt, false);
        let wait = rt
            .until_deadline()
            .unwrap_or(MAX_WAIT)
            .min(MAX_WAIT)
            .min(crate::health::PUBLISH_EVERY)
            .min(watchdog.until_due());
        // frames the transport has no room for yet are offered again soon
        let wait = if backlog {
            wait.min(BACKLOG_WAIT)
        } else {
            wait
        };
        rt.pump_processes(wait);
        ship(&mut rt, wire);
    }
}
