//! The proxy itself: routes (a listener and an upstream each), one task
//! per connection and direction pair, and the faults every connection of
//! a route obeys, changed at any time through [`Proxy::apply`].
//!
//! Each direction of a connection is a reader and a writer joined by a
//! bounded queue of chunks stamped with the time they were read:
//!
//! - the reader stops reading while its direction is blackholed, and
//!   while the queue holds more than [`PASS_QUEUE_BYTES`] (or
//!   [`HOLD_QUEUE_BYTES`] while held), so the sender meets backpressure
//!   as it would on a congested network;
//! - the writer writes each chunk once its delay has passed and neither
//!   a blackhole nor a hold covers its direction; an armed cut writes the
//!   exact remaining byte count of a chunk, then closes both sockets.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::command::{Command, Dir, Target, parse, valid_route_name};

/// Bytes one read takes at most.
pub const CHUNK_BYTES: usize = 16 * 1024;
/// Bytes a direction may have read and not yet written while it forwards
/// normally: about what a loopback socket buffers, so the proxy adds no
/// buffering a real path would not have.
pub const PASS_QUEUE_BYTES: u64 = 256 * 1024;
/// Bytes a held direction keeps before it stops reading.
pub const HOLD_QUEUE_BYTES: u64 = 64 * 1024 * 1024;
/// How long an upstream connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections one route keeps open; more are closed at accept.
pub const MAX_CONNECTIONS: u64 = 4096;

/// One route: where it listens and where it forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    /// Its name in commands.
    pub name: String,
    /// The listening address (port 0: any free port).
    pub listen: SocketAddr,
    /// The upstream.
    pub upstream: SocketAddr,
}

impl std::str::FromStr for RouteSpec {
    type Err = String;

    /// `NAME,LISTEN,UPSTREAM`, e.g. `a,127.0.0.1:7701,127.0.0.1:7700`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(',').collect();
        let [name, listen, upstream] = parts.as_slice() else {
            return Err(format!(
                "route `{s}`: expected NAME,LISTEN,UPSTREAM (e.g. a,127.0.0.1:7701,127.0.0.1:7700)"
            ));
        };
        if !valid_route_name(name) || *name == "*" {
            return Err(format!(
                "route name `{name}` must be 1-32 letters, digits, `-` or `_`"
            ));
        }
        let addr = |what: &str, v: &str| -> Result<SocketAddr, String> {
            v.parse()
                .map_err(|_| format!("route `{name}`: {what} `{v}` is not an IP:PORT address"))
        };
        Ok(Self {
            name: (*name).to_owned(),
            listen: addr("listen address", listen)?,
            upstream: addr("upstream", upstream)?,
        })
    }
}

/// The faults in force on a route.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Faults {
    blackhole_up: bool,
    blackhole_down: bool,
    hold_up: bool,
    hold_down: bool,
    delay_up: Duration,
    delay_down: Duration,
    /// Bytes per second (0: no limit).
    rate_up: u64,
    rate_down: u64,
    /// (arming number, bytes): a connection cuts after this many bytes
    /// counted from when it saw this arming (or from its start).
    cut_up: Option<(u64, u64)>,
    cut_down: Option<(u64, u64)>,
    refuse: bool,
    drops: u64,
    upstream: SocketAddr,
}

impl Faults {
    fn blackhole(&self, up: bool) -> bool {
        if up {
            self.blackhole_up
        } else {
            self.blackhole_down
        }
    }
    fn hold(&self, up: bool) -> bool {
        if up { self.hold_up } else { self.hold_down }
    }
    fn delay(&self, up: bool) -> Duration {
        if up { self.delay_up } else { self.delay_down }
    }
    fn rate(&self, up: bool) -> u64 {
        if up { self.rate_up } else { self.rate_down }
    }
    fn cut(&self, up: bool) -> Option<(u64, u64)> {
        if up { self.cut_up } else { self.cut_down }
    }
    fn describe(&self) -> String {
        let dirs = |u: bool, d: bool| match (u, d) {
            (true, true) => Some("both"),
            (true, false) => Some("up"),
            (false, true) => Some("down"),
            (false, false) => None,
        };
        let mut parts = Vec::new();
        if let Some(d) = dirs(self.blackhole_up, self.blackhole_down) {
            parts.push(format!("blackhole {d}"));
        }
        if let Some(d) = dirs(self.hold_up, self.hold_down) {
            parts.push(format!("hold {d}"));
        }
        if !self.delay_up.is_zero() {
            parts.push(format!("delay up {} ms", self.delay_up.as_millis()));
        }
        if !self.delay_down.is_zero() {
            parts.push(format!("delay down {} ms", self.delay_down.as_millis()));
        }
        if self.rate_up > 0 {
            parts.push(format!("rate up {} B/s", self.rate_up));
        }
        if self.rate_down > 0 {
            parts.push(format!("rate down {} B/s", self.rate_down));
        }
        if let Some((_, n)) = self.cut_up {
            parts.push(format!("cut up {n}"));
        }
        if let Some((_, n)) = self.cut_down {
            parts.push(format!("cut down {n}"));
        }
        if self.refuse {
            parts.push("refuse".into());
        }
        if parts.is_empty() {
            "pass".into()
        } else {
            parts.join(", ")
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    open: AtomicU64,
    refused: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    cuts: AtomicU64,
    dropped: AtomicU64,
    upstream_failures: AtomicU64,
    held_bytes: AtomicU64,
}

/// A route's counters at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RouteStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections open now.
    pub open: u64,
    /// Connections closed at accept (`refuse`, or the connection cap).
    pub refused: u64,
    /// Bytes written upstream.
    pub bytes_up: u64,
    /// Bytes written to clients.
    pub bytes_down: u64,
    /// Connections cut by an armed `cut`.
    pub cuts: u64,
    /// Connections closed by `drop`.
    pub dropped: u64,
    /// Upstream connects that failed.
    pub upstream_failures: u64,
    /// Bytes read and not yet written, over every connection.
    pub held_bytes: u64,
}

impl fmt::Display for RouteStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "accepted={} open={} refused={} bytes_up={} bytes_down={} cuts={} dropped={} upstream_failures={} held_bytes={}",
            self.accepted,
            self.open,
            self.refused,
            self.bytes_up,
            self.bytes_down,
            self.cuts,
            self.dropped,
            self.upstream_failures,
            self.held_bytes
        )
    }
}

impl Counters {
    fn snapshot(&self) -> RouteStats {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RouteStats {
            accepted: r(&self.accepted),
            open: r(&self.open),
            refused: r(&self.refused),
            bytes_up: r(&self.bytes_up),
            bytes_down: r(&self.bytes_down),
            cuts: r(&self.cuts),
            dropped: r(&self.dropped),
            upstream_failures: r(&self.upstream_failures),
            held_bytes: r(&self.held_bytes),
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct RouteShared {
    name: String,
    local: SocketAddr,
    faults: watch::Sender<Faults>,
    arming: AtomicU64,
    counters: Counters,
}

/// A command that could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// No route of that name.
    #[error("no route `{0}` (routes: {1})")]
    NoRoute(String, String),
    /// The line did not parse.
    #[error("{0}")]
    Parse(#[from] crate::command::ParseError),
}

/// The routes of one proxy, and the commands that change their faults.
#[derive(Debug)]
pub struct Proxy {
    routes: BTreeMap<String, Arc<RouteShared>>,
}

impl Proxy {
    /// Binds every route's listener and starts accepting (on the current
    /// tokio runtime).
    ///
    /// # Errors
    /// A listener that cannot bind, or two routes of one name.
    pub async fn bind(specs: &[RouteSpec]) -> std::io::Result<Self> {
        let mut routes = BTreeMap::new();
        for spec in specs {
            if routes.contains_key(&spec.name) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("route `{}` is named twice", spec.name),
                ));
            }
            let listener = TcpListener::bind(spec.listen).await.map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("route `{}`: bind {}: {e}", spec.name, spec.listen),
                )
            })?;
            let local = listener.local_addr()?;
            let (faults, _) = watch::channel(Faults {
                blackhole_up: false,
                blackhole_down: false,
                hold_up: false,
                hold_down: false,
                delay_up: Duration::ZERO,
                delay_down: Duration::ZERO,
                rate_up: 0,
                rate_down: 0,
                cut_up: None,
                cut_down: None,
                refuse: false,
                drops: 0,
                upstream: spec.upstream,
            });
            let shared = Arc::new(RouteShared {
                name: spec.name.clone(),
                local,
                faults,
                arming: AtomicU64::new(0),
                counters: Counters::default(),
            });
            tracing::info!(route = %spec.name, listen = %local, upstream = %spec.upstream, "route listening");
            tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
            routes.insert(spec.name.clone(), shared);
        }
        Ok(Self { routes })
    }

    /// The address route `name` listens on.
    #[must_use]
    pub fn addr(&self, name: &str) -> Option<SocketAddr> {
        self.routes.get(name).map(|r| r.local)
    }

    /// Route `name`'s counters.
    #[must_use]
    pub fn stats(&self, name: &str) -> Option<RouteStats> {
        self.routes.get(name).map(|r| r.counters.snapshot())
    }

    /// Applies `command` to the target routes; returns the report
    /// (`status`: one line per route).
    ///
    /// # Errors
    /// [`ApplyError::NoRoute`].
    pub fn apply(&self, target: &Target, command: &Command) -> Result<String, ApplyError> {
        let routes: Vec<&Arc<RouteShared>> = match target {
            Target::All => self.routes.values().collect(),
            Target::Route(name) => vec![self.routes.get(name).ok_or_else(|| {
                ApplyError::NoRoute(
                    name.clone(),
                    self.routes.keys().cloned().collect::<Vec<_>>().join(", "),
                )
            })?],
        };
        let mut report = Vec::new();
        for r in routes {
            if *command != Command::Status {
                apply_to(r, command);
                tracing::info!(route = %r.name, command = %command, "fault applied");
            }
            let faults = r.faults.borrow().describe();
            report.push(format!(
                "{} listen={} upstream={} faults=[{faults}] {}",
                r.name,
                r.local,
                r.faults.borrow().upstream,
                r.counters.snapshot()
            ));
        }
        Ok(report.join("\n"))
    }

    /// Parses and applies one command line; the answer starts with `ok`
    /// or `error:`.
    #[must_use]
    pub fn execute(&self, line: &str) -> String {
        match parse(line)
            .map_err(ApplyError::from)
            .and_then(|(t, c)| self.apply(&t, &c))
        {
            Ok(report) => format!("ok\n{report}"),
            Err(e) => format!("error: {e}"),
        }
    }
}

fn apply_to(r: &RouteShared, command: &Command) {
    let arming = r.arming.fetch_add(1, Ordering::Relaxed) + 1;
    r.faults.send_modify(|f| match command {
        Command::Pass => {
            f.blackhole_up = false;
            f.blackhole_down = false;
            f.hold_up = false;
            f.hold_down = false;
            f.delay_up = Duration::ZERO;
            f.delay_down = Duration::ZERO;
            f.rate_up = 0;
            f.rate_down = 0;
            f.cut_up = None;
            f.cut_down = None;
            f.refuse = false;
        }
        Command::Blackhole(d) => {
            f.blackhole_up |= d.up();
            f.blackhole_down |= d.down();
        }
        Command::Hold(d) => {
            f.hold_up |= d.up();
            f.hold_down |= d.down();
        }
        Command::Release => {
            f.hold_up = false;
            f.hold_down = false;
        }
        Command::Delay(t, d) => {
            if d.up() {
                f.delay_up = *t;
            }
            if d.down() {
                f.delay_down = *t;
            }
        }
        Command::Rate(n, d) => {
            if d.up() {
                f.rate_up = *n;
            }
            if d.down() {
                f.rate_down = *n;
            }
        }
        Command::Cut(d, n) => {
            if d.up() {
                f.cut_up = Some((arming, *n));
            }
            if d.down() {
                f.cut_down = Some((arming, *n));
            }
        }
        Command::Drop => f.drops = f.drops.wrapping_add(1),
        Command::Refuse => f.refuse = true,
        Command::Accept => f.refuse = false,
        Command::Upstream(a) => f.upstream = *a,
        Command::Status => {}
    });
}

async fn accept_loop(listener: TcpListener, route: Arc<RouteShared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                bump(&route.counters.accepted);
                let refuse = route.faults.borrow().refuse;
                if refuse || route.counters.open.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                    bump(&route.counters.refused);
                    tracing::debug!(route = %route.name, %peer, "connection refused");
                    drop(stream);
                    continue;
                }
                tokio::spawn(connection(stream, Arc::clone(&route)));
            }
            Err(e) => {
                // out of descriptors and the like: try again shortly
                tracing::warn!(route = %route.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Counts a connection open for as long as it lives.
struct OpenGuard(Arc<RouteShared>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection(client: TcpStream, route: Arc<RouteShared>) {
    route.counters.open.fetch_add(1, Ordering::Relaxed);
    let _open = OpenGuard(Arc::clone(&route));
    let mut faults = route.faults.subscribe();
    let drops = faults.borrow().drops;
    // a partition: the upstream never hears of the connection until it heals
    let upstream_addr = loop {
        let f = faults.borrow_and_update().clone();
        if f.drops != drops {
            bump(&route.counters.dropped);
            return;
        }
        if !f.blackhole_up && !f.blackhole_down {
            break f.upstream;
        }
        if faults.changed().await.is_err() {
            return;
        }
    };
    let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream_addr))
        .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            bump(&route.counters.upstream_failures);
            tracing::debug!(route = %route.name, upstream = %upstream_addr, error = %e, "upstream connect failed");
            return;
        }
        Err(_) => {
            bump(&route.counters.upstream_failures);
            tracing::debug!(route = %route.name, upstream = %upstream_addr, "upstream connect timed out");
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let (kill, mut killed) = watch::channel(false);
    let mut tasks = JoinSet::new();
    for (up, src, dst) in [(true, cr, uw), (false, ur, cw)] {
        let (tx, rx) = mpsc::channel::<Chunk>(1024);
        let queue = Arc::new(Queue {
            bytes: AtomicU64::new(0),
            shrunk: Notify::new(),
            route: Arc::clone(&route),
        });
        tasks.spawn(reader(
            src,
            tx,
            up,
            route.faults.subscribe(),
            Arc::clone(&queue),
            kill.clone(),
            Arc::clone(&route),
        ));
        tasks.spawn(writer(
            dst,
            rx,
            up,
            route.faults.subscribe(),
            queue,
            kill.clone(),
            Arc::clone(&route),
        ));
    }
    drop(kill);
    loop {
        tokio::select! {
            r = killed.changed() => {
                if r.is_err() || *killed.borrow() {
                    break;
                }
            }
            r = faults.changed() => {
                if r.is_err() {
                    break;
                }
                if faults.borrow_and_update().drops != drops {
                    bump(&route.counters.dropped);
                    break;
                }
            }
            done = tasks.join_next() => {
                if done.is_none() {
                    // both directions ended in order
                    break;
                }
            }
        }
    }
    // dropping the tasks' halves closes both sockets
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}

#[derive(Debug)]
enum Chunk {
    Data { at: Instant, bytes: Vec<u8> },
    Eof,
}

/// Bytes of one direction read and not yet written, and a wake-up for
/// the reader when they shrink.
#[derive(Debug)]
struct Queue {
    bytes: AtomicU64,
    shrunk: Notify,
    route: Arc<RouteShared>,
}

impl Drop for Queue {
    fn drop(&mut self) {
        // what a closed connection never wrote is no longer held
        let left = self.bytes.load(Ordering::Relaxed);
        self.route
            .counters
            .held_bytes
            .fetch_sub(left, Ordering::Relaxed);
    }
}

async fn reader(
    mut src: OwnedReadHalf,
    tx: mpsc::Sender<Chunk>,
    up: bool,
    mut faults: watch::Receiver<Faults>,
    queue: Arc<Queue>,
    kill: watch::Sender<bool>,
    route: Arc<RouteShared>,
) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        // read nothing while blackholed, or while the queue is full
        let (blackholed, limit) = {
            let f = faults.borrow_and_update();
            (
                f.blackhole(up),
                if f.hold(up) {
                    HOLD_QUEUE_BYTES
                } else {
                    PASS_QUEUE_BYTES
                },
            )
        };
        if blackholed {
            if faults.changed().await.is_err() {
                return;
            }
            continue;
        }
        if queue.bytes.load(Ordering::Relaxed) >= limit {
            tokio::select! {
                () = queue.shrunk.notified() => {}
                r = faults.changed() => if r.is_err() { return },
            }
            continue;
        }
        tokio::select! {
            r = src.read(&mut buf) => match r {
                Ok(0) => {
                    let _ = tx.send(Chunk::Eof).await;
                    return;
                }
                Ok(n) => {
                    let bytes = buf.get(..n).map(<[u8]>::to_vec).unwrap_or_default();
                    let n = n as u64;
                    queue.bytes.fetch_add(n, Ordering::Relaxed);
                    route.counters.held_bytes.fetch_add(n, Ordering::Relaxed);
                    if tx.send(Chunk::Data { at: Instant::now(), bytes }).await.is_err() {
                        return;
                    }
                }
                Err(_) => {
                    let _ = kill.send(true);
                    return;
                }
            },
            r = faults.changed() => if r.is_err() { return },
        }
    }
}

async fn writer(
    mut dst: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Chunk>,
    up: bool,
    mut faults: watch::Receiver<Faults>,
    queue: Arc<Queue>,
    kill: watch::Sender<bool>,
    route: Arc<RouteShared>,
) {
    // a cut armed before the connection counts from its first byte
    let mut cut: Option<(u64, u64)> = faults.borrow().cut(up);
    while let Some(chunk) = rx.recv().await {
        let (at, bytes) = match chunk {
            Chunk::Eof => {
                let _ = dst.shutdown().await;
                return;
            }
            Chunk::Data { at, bytes } => (at, bytes),
        };
        // wait out the delay, the blackhole and the hold
        loop {
            let (delay, stopped, armed) = {
                let f = faults.borrow_and_update();
                (f.delay(up), f.blackhole(up) || f.hold(up), f.cut(up))
            };
            match (armed, cut) {
                (Some((a, n)), Some((b, _))) if a != b => cut = Some((a, n)),
                (Some(new), None) => cut = Some(new),
                (None, _) => cut = None,
                _ => {}
            }
            let due = at + delay;
            if Instant::now() < due {
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    r = faults.changed() => if r.is_err() { return },
                }
                continue;
            }
            if stopped {
                if faults.changed().await.is_err() {
                    return;
                }
                continue;
            }
            break;
        }
        let len = bytes.len() as u64;
        let counter = if up {
            &route.counters.bytes_up
        } else {
            &route.counters.bytes_down
        };
        if let Some((arming, remaining)) = cut {
            if len >= remaining {
                let part = usize::try_from(remaining).unwrap_or(usize::MAX);
                let _ = dst.write_all(bytes.get(..part).unwrap_or(&bytes)).await;
                let _ = dst.flush().await;
                counter.fetch_add(remaining, Ordering::Relaxed);
                bump(&route.counters.cuts);
                tracing::info!(route = %route.name, dir = %if up { Dir::Up } else { Dir::Down }, "connection cut");
                let _ = kill.send(true);
                return;
            }
            cut = Some((arming, remaining - len));
        }
        let rate = faults.borrow().rate(up);
        if rate > 0 {
            // a slow link: this chunk, written at the rate, in slices
            for slice in bytes.chunks(1024) {
                if dst.write_all(slice).await.is_err() {
                    let _ = kill.send(true);
                    return;
                }
                let pace = Duration::from_secs_f64(slice.len() as f64 / rate as f64);
                tokio::time::sleep(pace).await;
            }
        } else if dst.write_all(&bytes).await.is_err() {
            let _ = kill.send(true);
            return;
        }
        counter.fetch_add(len, Ordering::Relaxed);
        queue.bytes.fetch_sub(len, Ordering::Relaxed);
        route.counters.held_bytes.fetch_sub(len, Ordering::Relaxed);
        queue.shrunk.notify_one();
    }
}

/// A proxy on a thread of its own, for tests and tools that are not
/// async: dropping it closes every listener and connection.
#[derive(Debug)]
pub struct BackgroundProxy {
    proxy: Arc<Proxy>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundProxy {
    /// Starts the routes on a new thread.
    ///
    /// # Errors
    /// A route that cannot bind, or the runtime that cannot start.
    pub fn start(specs: &[RouteSpec]) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let proxy = Arc::new(rt.block_on(Proxy::bind(specs))?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("rvbox-faultproxy".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
                // dropping the runtime ends every task and closes its sockets
                rt.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Self {
            proxy,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// One route on `127.0.0.1:0` named `name`, forwarding to `upstream`.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn loopback(name: &str, upstream: SocketAddr) -> std::io::Result<Self> {
        Self::start(&[RouteSpec {
            name: name.to_owned(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            upstream,
        }])
    }

    /// Applies `command` to route `name`.
    ///
    /// # Errors
    /// [`ApplyError::NoRoute`].
    pub fn apply(&self, name: &str, command: &Command) -> Result<String, ApplyError> {
        self.proxy.apply(&Target::Route(name.to_owned()), command)
    }
}

impl std::ops::Deref for BackgroundProxy {
    type Target = Proxy;

    fn deref(&self) -> &Proxy {
        &self.proxy
    }
}

impl Drop for BackgroundProxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Shares the proxy with a control server.
#[must_use]
pub fn shared(proxy: &BackgroundProxy) -> Arc<Proxy> {
    Arc::clone(&proxy.proxy)
}
