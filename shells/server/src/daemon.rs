//! The server daemon's start, run and stop (plan §6.1, §11.1, R7).
//!
//! Start: read the file-descriptor limit; bind the agent listener (so
//! liveness answers at once); open and recover the store on a blocking
//! thread while `/readyz` says so; then start the executor thread and the
//! core's thread and let agent upgrades in.
//!
//! Stop, on SIGTERM or SIGINT: stop accepting; close every agent
//! connection with 1012 so its client reconnects at once; let the store
//! operations in flight finish (bounded); stop the executor, which checkpoints
//! the store on drop; exit 0.
//!
//! Must never: open the store before the configuration validated (the
//! caller's gate), or acknowledge anything the store has not made durable
//! (the core's rule; the shell only carries completions back).

use std::sync::Arc;

use rvbox_config::{ServerConfig, StoreBackend};
use rvbox_daemon_common::notify::Notifier;
use rvbox_domain::ids::Uuid7;
use rvbox_engine::{ServerSettings, server_settings};
use rvbox_server_core::{Input, ServerCore};
use rvbox_session::ServerIdentity;
use rvbox_store::entropy::OsEntropy;
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::reader::ReaderSource;
use rvbox_store::{Store, StoreError};
use rvbox_store_pg::PgReaders;
use rvbox_store_port::replica::LeaseTimes;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use crate::core_loop::{Clock, CoreThread, ToCore};
use crate::state::Shared;

/// How long a replica's stop waits for its core and store executor.
const REPLICA_JOIN: std::time::Duration = std::time::Duration::from_secs(15);
/// How long a stop waits for a listener's tasks.
const LISTENER_STOP: std::time::Duration = std::time::Duration::from_secs(5);

/// The control server's task as a plain unit task.
fn control_task_handle(
    task: tokio::task::JoinHandle<Result<(), crate::control::ServeError>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = %e, "control socket server ended with an error");
        }
    })
}

/// Exit status: a clean stop.
pub(crate) const EXIT_OK: i32 = 0;
/// Exit status: the daemon could not start (listener, store, runtime).
pub(crate) const EXIT_START: i32 = 1;

/// Runs the daemon until a stop signal; returns the exit status.
pub(crate) fn run(config: ServerConfig) -> i32 {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rvbox-server-io")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "the async runtime could not start");
            return EXIT_START;
        }
    };
    let status = rt.block_on(serve(config));
    // blocking tasks still running (a read on a database that went
    // silent) are not waited for long
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    status
}

/// The soft and hard limits on open file descriptors.
fn fd_limits() -> (Option<u64>, Option<u64>) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (l.current, l.maximum)
}

/// A well-formed UUIDv7 standing in for the server id until the store
/// gives the real one (the store's options do not depend on it).
const PLACEHOLDER_ID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0x70, 0, 0x80, 0, 0, 0, 0, 0, 0, 0];

fn identity(server_id: [u8; 16]) -> Result<ServerIdentity, String> {
    Ok(ServerIdentity {
        server_id: Uuid7::from_bytes("server_id", server_id)
            .map_err(|e| format!("server id: {e}"))?,
        software_version: env!("CARGO_PKG_VERSION").into(),
        supported_minors: vec![0],
    })
}

/// Sends `WATCHDOG=1` every half of `WatchdogSec=` from the daemon's
/// runtime, for as long as the runtime schedules its tasks.
fn spawn_watchdog(notifier: &Notifier) {
    if let Some(every) = notifier.watchdog_interval() {
        tracing::info!(every_ms = every.as_millis(), "systemd watchdog enabled");
        let n = notifier.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            loop {
                ticks.tick().await;
                n.watchdog();
            }
        });
    }
}

async fn serve(config: ServerConfig) -> i32 {
    let notifier = Notifier::from_env();
    spawn_watchdog(&notifier);
    let (soft, hard) = fd_limits();
    let soft_text = soft.map_or_else(|| "unlimited".to_owned(), |v| v.to_string());
    let hard_text = hard.map_or_else(|| "unlimited".to_owned(), |v| v.to_string());
    tracing::info!(soft = %soft_text, hard = %hard_text, "open file descriptor limit");
    let shared = Arc::new(Shared::new(
        config.agent.path.clone(),
        config.agent.allowed_origins.clone(),
        usize::try_from(config.limits.max_envelope).unwrap_or(usize::MAX),
        config.agent.identity.clone(),
    ));
    if let rvbox_config::ClientIdentity::TlsClientCert {
        header,
        trusted_proxies,
    } = &config.agent.identity
    {
        tracing::info!(%header, proxies = trusted_proxies.len(), "client identity: the TLS client certificate's CN, from the trusted proxies only");
    } else {
        tracing::warn!(
            "client identity is self-reported: any host that reaches the agent endpoint can claim any client id (server.client_identity; docs/security.md)"
        );
    }
    shared
        .metrics
        .fd_limit
        .set(soft.map_or(i64::MAX, |v| i64::try_from(v).unwrap_or(i64::MAX)));
    // audit records of reads and edge refusals, handed to the core
    let _edge_audits = crate::edge_audit::start(&shared);

    let listener = match TcpListener::bind(config.agent.listen).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(addr = %config.agent.listen, error = %e, "agent listener could not bind");
            eprintln!(
                "rvbox-server: cannot listen on {} (server.agent_listen): {e}",
                config.agent.listen
            );
            return EXIT_START;
        }
    };
    let local = listener
        .local_addr()
        .map_or_else(|_| config.agent.listen.to_string(), |a| a.to_string());
    tracing::info!(addr = %local, path = %config.agent.path, "agent endpoint listening (liveness at /healthz)");
    let (stop_tx, stop_rx) = watch::channel(false);
    let agent = tokio::spawn(crate::agent::serve(
        listener,
        Arc::clone(&shared),
        crate::agent::Routes::Agent,
        stop_rx.clone(),
    ));
    // a separate health and metrics listener when configured
    if let Some(addr) = config.observability.metrics_listen {
        match TcpListener::bind(addr).await {
            Ok(l) => {
                tracing::info!(%addr, "health and metrics listening (/healthz, /readyz, /metrics)");
                tokio::spawn(crate::agent::serve(
                    l,
                    Arc::clone(&shared),
                    crate::agent::Routes::Observability,
                    stop_rx.clone(),
                ));
            }
            Err(e) => {
                tracing::error!(%addr, error = %e, "observability.metrics_listen could not bind");
                eprintln!(
                    "rvbox-server: cannot listen on {addr} (observability.metrics_listen): {e}"
                );
                return EXIT_START;
            }
        }
    }

    let mut settings = match identity(PLACEHOLDER_ID)
        .and_then(|id| server_settings(&config, id).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "configuration refused by the server core");
            return EXIT_START;
        }
    };
    let store_opts = settings.store.clone();
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "signal handlers could not be installed");
            return EXIT_START;
        }
    };
    // SQLite: opening takes the instance lock and applies migrations
    // (short); recovery scans segments (long) and runs while liveness
    // answers and the control socket serves reads and incident inspection.
    // PostgreSQL: connecting applies migrations once, under their lock;
    // the replica joins with a fresh epoch; the database's own recovery
    // is all there is.
    let opened = match &config.store {
        StoreBackend::Sqlite => {
            let layout = Layout::new(config.storage.data_dir.clone());
            tokio::task::spawn_blocking(move || {
                open_store(layout, store_opts)
                    .map(|s| Opened::Sqlite(Box::new(s)))
                    .map_err(|e| e.to_string())
            })
            .await
        }
        StoreBackend::Postgres(pg) => {
            let conninfo = match crate::replica::conninfo(pg) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "the PostgreSQL password could not be read");
                    eprintln!("rvbox-server: {e}");
                    return EXIT_START;
                }
            };
            let peer = local.clone();
            tokio::task::spawn_blocking(move || {
                crate::replica::join(
                    &conninfo,
                    store_opts,
                    &peer,
                    LeaseTimes::default(),
                    Clock::wall_ms(),
                )
                .map(|started| Opened::Postgres(Box::new(started), conninfo))
            })
            .await
        }
    };
    let opened = match opened {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "the store could not be opened");
            eprintln!("rvbox-server: {e}");
            shared.set_failed(e);
            let _ = stop_tx.send(true);
            let _ = agent.await;
            return EXIT_START;
        }
        Err(e) => {
            tracing::error!(error = %e, "the store opening task failed");
            let _ = stop_tx.send(true);
            let _ = agent.await;
            return EXIT_START;
        }
    };
    let readers: Arc<dyn ReaderSource> = match &opened {
        Opened::Sqlite(store) => {
            shared.set_health(store.health());
            shared.register(|r| store.metrics().register(r));
            Arc::new(store.read_handle())
        }
        Opened::Postgres(started, conninfo) => {
            tracing::info!(epoch = started.epoch, "serving as a replica on PostgreSQL");
            let health = rvbox_store::health::Health::default();
            health.ready_without_recovery();
            shared.set_health(health);
            Arc::new(PgReaders::new(conninfo))
        }
    };
    let (changes_tx, changes_rx) = watch::channel(0u64);
    let control =
        match crate::control::bind(&config.control.runtime_dir, &config.control.socket_path) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "the control socket could not be created");
                eprintln!("rvbox-server: control socket: {e}");
                let _ = stop_tx.send(true);
                let _ = agent.await;
                return EXIT_START;
            }
        };
    tracing::info!(path = %config.control.socket_path.display(), mode = "0600", "control socket listening");
    // systemd: the listeners are bound and the store is open, so a unit
    // ordered after this one finds both sockets answering; recovery goes
    // on in the background (/readyz tells when it ended)
    notifier.ready(match opened {
        Opened::Sqlite(_) => "listening; store open, recovering",
        Opened::Postgres(..) => "listening; replica joined",
    });
    let service = crate::control::ControlService::new(
        Arc::clone(&shared),
        readers,
        changes_rx,
        stop_rx.clone(),
        crate::control::Paging::of(&config.control),
    );
    let max_request = usize::try_from(config.limits.max_control_request).unwrap_or(usize::MAX);
    // the JSON-RPC adapter, only when enabled (plan §9.3); a non-loopback
    // bind was warned about with the configuration summary
    if config.jsonrpc.enabled {
        let addr = config.jsonrpc.listen;
        match TcpListener::bind(addr).await {
            Ok(l) => {
                if addr.ip().is_loopback() {
                    tracing::info!(%addr, "JSON-RPC adapter listening (POST /)");
                } else {
                    tracing::warn!(%addr, "JSON-RPC adapter listening on a non-loopback address: it is UNAUTHENTICATED, anyone who can reach it can run commands on every client");
                }
                let metrics = Arc::new(crate::jsonrpc::JsonRpcMetrics::default());
                shared.register(|r| metrics.register(r));
                tokio::spawn(crate::jsonrpc::serve(
                    l,
                    service.clone(),
                    usize::try_from(config.jsonrpc.max_body).unwrap_or(usize::MAX),
                    max_request,
                    metrics,
                    stop_rx.clone(),
                ));
            }
            Err(e) => {
                tracing::error!(%addr, error = %e, "jsonrpc.listen could not bind");
                eprintln!("rvbox-server: cannot listen on {addr} (jsonrpc.listen): {e}");
                let _ = stop_tx.send(true);
                let _ = agent.await;
                return EXIT_START;
            }
        }
    }
    let control_task = tokio::spawn(crate::control::serve(
        control,
        service,
        max_request,
        stop_rx.clone(),
    ));

    let replica_metrics = Arc::new(crate::replica::ReplicaMetrics::default());
    let (thread, fatal, keeper) = match opened {
        Opened::Sqlite(store) => {
            let (store, startup_check) =
                match recover(*store, &mut signals, &shared, &notifier).await {
                    Ok(r) => r,
                    Err(status) => {
                        let _ = stop_tx.send(true);
                        let _ = agent.await;
                        let _ = control_task.await;
                        return status;
                    }
                };
            let core = match build_core(store.server_id(), &mut settings) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "the server core could not start");
                    return EXIT_START;
                }
            };
            // the start-up integrity check: a finding leaves the store
            // unavailable (incident inspection goes on); a failure to read
            // the database stops the server so a supervisor starts it again
            let fatal: Fatal = Box::pin(async move {
                match tokio::task::spawn_blocking(move || startup_check.wait()).await {
                    Ok(Err(e)) => format!("recovery: {e}"),
                    Ok(Ok(_)) | Err(_) => std::future::pending::<String>().await,
                }
            });
            let thread = CoreThread::spawn(
                core,
                rvbox_engine::Executor::new(store),
                Clock::new(),
                Arc::clone(&shared.metrics),
                changes_tx,
            );
            (thread, fatal, None)
        }
        Opened::Postgres(started, conninfo) => {
            let started = *started;
            let mut core = match build_core(started.server_id, &mut settings) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "the server core could not start");
                    return EXIT_START;
                }
            };
            // a replica holds no duty until its keeper has taken one
            core.handle(0, Clock::wall_ms(), Input::Duties { held: Vec::new() });
            shared.register(|r| replica_metrics.register(r));
            let (lost_tx, lost_rx) = oneshot::channel::<String>();
            let fatal: Fatal = Box::pin(async move {
                match lost_rx.await {
                    Ok(why) => format!("replica lease lost: {why}"),
                    Err(_) => std::future::pending::<String>().await,
                }
            });
            let thread = CoreThread::spawn(
                core,
                started.store,
                Clock::new(),
                Arc::clone(&shared.metrics),
                changes_tx,
            );
            (thread, fatal, Some((started.keeper, conninfo, lost_tx)))
        }
    };
    let mut thread = match thread {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "the server core's thread could not start");
            return EXIT_START;
        }
    };
    let core_tx = thread.sender();
    let replica = match keeper {
        None => None,
        Some((keeper, conninfo, lost_tx)) => {
            match crate::replica::spawn(
                keeper,
                conninfo,
                core_tx.clone(),
                Arc::clone(&replica_metrics),
                lost_tx,
            ) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::error!(error = %e, "the replica threads could not start");
                    return EXIT_START;
                }
            }
        }
    };
    shared.set_core(Some(core_tx.clone()));
    tracing::info!("serving");
    notifier.status("serving");
    let mut status = EXIT_OK;
    let ended = thread.ended();
    let core_ended = async {
        match ended {
            Some(e) => {
                let _ = e.await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = signals.wait() => {
            tracing::info!(
                "stop requested: closing agent connections with 1012 and finishing durable writes"
            );
            notifier.stopping("stopping: closing agent connections, finishing durable writes");
        }
        () = core_ended => {
            tracing::error!(
                "the server core stopped on its own (the store executor failed); exiting so a supervisor restarts the server"
            );
            shared.set_failed("the store executor failed".into());
            status = EXIT_START;
        }
        e = fatal => {
            tracing::error!(error = %e, "exiting so a supervisor restarts the server");
            eprintln!("rvbox-server: {e}");
            shared.set_failed(e);
            status = EXIT_START;
            if replica.is_some() {
                // a replica whose lease is lost has closed every connection
                // already, and whatever its store is still doing is fenced
                // by the database; its executor may be stuck in a call to a
                // database that went silent, so nothing is waited for
                shared.set_core(None);
                let _ = stop_tx.send(true);
                return status;
            }
        }
    }
    // no new work: mutations answer UNAVAILABLE (rvc retries with the
    // same request_id), listeners stop accepting, follows end so their
    // clients resume on the next server
    shared.set_core(None);
    let _ = stop_tx.send(true);
    let (done_tx, done_rx) = oneshot::channel();
    if core_tx
        .send(ToCore::Shutdown { done: done_tx })
        .await
        .is_ok()
    {
        match done_rx.await {
            Ok(report) if report.unfinished > 0 => tracing::warn!(
                unfinished = report.unfinished,
                "store operations still in flight at the end of the wait; their senders retry"
            ),
            Ok(report) => tracing::info!(closed = report.closed, "agent connections closed"),
            Err(_) => tracing::error!("the server core ended without a shutdown report"),
        }
    }
    drop(core_tx);
    // every connection's writer sends its close frame before the runtime
    // goes
    let unclosed = shared.sockets_ended(LISTENER_STOP).await;
    if unclosed > 0 {
        tracing::warn!(unclosed, "agent connections not closed within the wait");
    }
    for (name, task) in [
        ("agent listener", agent),
        ("control socket", control_task_handle(control_task)),
    ] {
        if tokio::time::timeout(LISTENER_STOP, task).await.is_err() {
            tracing::warn!(
                listener = name,
                "did not stop within the wait; stopping anyway"
            );
        }
    }
    let bounded_join = replica.is_some();
    if let Some(r) = replica {
        r.stop();
    }
    // the core's thread stops the executor, and the store checkpoints as
    // it closes
    let join = tokio::task::spawn_blocking(move || thread.join());
    if bounded_join {
        // a replica's executor may be stuck in a call to a database that
        // went silent: its writes are fenced by the database, so the
        // stop does not wait for it for ever
        if tokio::time::timeout(REPLICA_JOIN, join).await.is_err() {
            tracing::warn!("the store executor did not stop in time; exiting anyway");
        }
    } else {
        let _ = join.await;
    }
    tracing::info!("stopped");
    status
}

fn open_store(layout: Layout, opts: rvbox_store::StoreOptions) -> Result<Store, StoreError> {
    Store::open(
        layout,
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        opts,
        Clock::wall_ms(),
    )
}

/// A failure after the start that ends the daemon (the SQLite start-up
/// integrity check could not read the database; a replica lost its
/// lease), as its message.
type Fatal = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

/// The opened store.
enum Opened {
    Sqlite(Box<Store>),
    /// The replica as joined, and its connection string (it may hold a
    /// password: never logged).
    Postgres(Box<crate::replica::Started>, String),
}

/// The bounded part of SQLite recovery; the integrity check goes on
/// beside the core, and global readiness waits for it
/// (docs/storage.md). Otherwise the exit status: a stop was asked
/// ([`EXIT_OK`]), or recovery failed ([`EXIT_START`]).
async fn recover(
    mut store: Store,
    signals: &mut Signals,
    shared: &Arc<Shared>,
    notifier: &Notifier,
) -> Result<(Store, rvbox_store::recovery::StartupCheck), i32> {
    let recovering = tokio::task::spawn_blocking(move || {
        let wall = Clock::wall_ms();
        let report = store.begin_recovery(wall);
        (store, report)
    });
    // a stop signal during recovery waits for recovery to end (it holds
    // the store), then stops without serving
    let recovered = tokio::select! {
        r = recovering => r,
        () = signals.wait() => {
            tracing::info!("stop requested during recovery; stopping");
            notifier.stopping("stopping during recovery");
            return Err(EXIT_OK);
        }
    };
    match recovered {
        Ok((store, Ok((report, check)))) => {
            tracing::info!(report = ?report, "store scopes recovered");
            Ok((store, check))
        }
        Ok((_, Err(e))) => {
            tracing::error!(error = %e, "store recovery failed");
            eprintln!("rvbox-server: recovery: {e}");
            shared.set_failed(e.to_string());
            Err(EXIT_START)
        }
        Err(e) => {
            tracing::error!(error = %e, "the recovery task failed");
            shared.set_failed(e.to_string());
            Err(EXIT_START)
        }
    }
}

fn build_core(server_id: [u8; 16], settings: &mut ServerSettings) -> Result<ServerCore, String> {
    settings.session.identity = identity(server_id)?;
    settings
        .session
        .validate()
        .map_err(|e| format!("session configuration: {e}"))?;
    let mut core = ServerCore::new(
        Arc::new(OsEntropy),
        settings.session.clone(),
        settings.retry,
    );
    core.set_ingress_watermarks(settings.ingress.0, settings.ingress.1)
        .map_err(|e| format!("ingress watermarks: {e}"))?;
    core.set_group_policy(settings.group);
    core.set_takeover_ttl(settings.takeover_ttl_ms);
    core.set_pty_policy(settings.pty);
    Ok(core)
}

/// SIGTERM and SIGINT.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn wait(&mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!(signal = "SIGTERM", "stop signal"),
            _ = self.int.recv() => tracing::info!(signal = "SIGINT", "stop signal"),
        }
    }
}
