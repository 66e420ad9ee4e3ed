//! Three `rvbox-server` replicas on one private PostgreSQL, behind the
//! shipped nginx replicas configuration (TLS, a consistent hash on the
//! client), with real `rvbox` daemons: a replica killed with SIGKILL
//! mid-stream, and one paused with SIGSTOP past its lease. Nothing runs
//! twice, every byte is stored, and `rvc follow` moves to another replica.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::{Nginx, Postgres, bin, free_port, http_get, text};

/// Lines each streaming command prints.
const LINES: u32 = 3000;

/// The command every client runs: a marker line when it starts and when
/// it ends, and `LINES` numbered lines of output over a few seconds.
fn streaming_command() -> String {
    format!(
        "echo start >> marker; i=0; while [ $i -lt {LINES} ]; do printf 'line %05d %s\\n' $i xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; i=$((i+1)); if [ $((i % 100)) -eq 0 ]; then sleep 0.25; fi; done; echo end >> marker"
    )
}

/// What [`streaming_command`] prints.
fn expected_output() -> String {
    (0..LINES)
        .map(|i| format!("line {i:05} {}\n", "x".repeat(90)))
        .collect()
}

struct Replica {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

struct Client {
    id: String,
    dir: PathBuf,
    child: Option<Child>,
}

struct Cluster {
    dir: tempfile::TempDir,
    pg: Postgres,
    replicas: Vec<Replica>,
    nginx: Option<Nginx>,
    clients: Vec<Client>,
}

impl Cluster {
    /// A database, three replicas, nginx in front, and `n` clients, all
    /// connected.
    fn start(n: usize) -> Self {
        let pg = Postgres::start();
        pg.psql("postgres", "CREATE DATABASE rvbox");
        let dir = tempfile::tempdir().unwrap();
        let mut c = Self {
            dir,
            pg,
            replicas: Vec::new(),
            nginx: None,
            clients: Vec::new(),
        };
        for i in 0..3 {
            let d = c.dir.path().join(format!("r{i}"));
            std::fs::create_dir_all(&d).unwrap();
            let port = free_port();
            std::fs::write(
                d.join("server.toml"),
                format!(
                    "[server]\nagent_listen = \"127.0.0.1:{port}\"\nstore = \"postgres\"\n[postgres]\nconninfo = \"{}\"\n[storage]\ndata_dir = \"{}\"\n[control]\nruntime_dir = \"{}\"\nsocket_path = \"{}\"\n[observability]\nmetrics_listen = \"127.0.0.1:{}\"\n",
                    c.pg.conninfo("rvbox"),
                    d.join("data").display(),
                    d.join("run").display(),
                    d.join("run/control.sock").display(),
                    free_port(),
                ),
            )
            .unwrap();
            c.replicas.push(Replica {
                dir: d,
                port,
                child: None,
            });
        }
        for i in 0..3 {
            c.start_replica(i);
        }
        let ports = [c.replicas[0].port, c.replicas[1].port, c.replicas[2].port];
        c.nginx = Some(Nginx::start_replicas(c.dir.path(), &ports));
        let (url, ca) = {
            let n = c.nginx.as_ref().unwrap();
            (
                format!("wss://localhost:{}/rvbox/agent", n.port),
                n.ca.clone(),
            )
        };
        for i in 0..n {
            let id = format!("host-{:02}", i + 1);
            let d = c.dir.path().join("clients").join(&id);
            std::fs::create_dir_all(d.join("work")).unwrap();
            std::fs::write(
                d.join("client.toml"),
                format!(
                    "[client]\nclient_id = \"{id}\"\nserver_urls = [\"{url}\"]\nca_file = \"{}\"\nstate_dir = \"{}\"\n[exec]\nallowed_cwd_roots = [\"{}\"]\ndefault_cwd = \"{}\"\ndrain_grace = \"1s\"\nkill_grace = \"2s\"\n[reconnect]\ninitial = \"1s\"\nmax = \"2s\"\n[session]\nheartbeat_idle = \"2s\"\nliveness_timeout = \"6s\"\n[observability]\nmetrics_listen = \"\"\n",
                    ca.display(),
                    d.join("state").display(),
                    d.join("work").display(),
                    d.join("work").display(),
                ),
            )
            .unwrap();
            let log = std::fs::File::create(d.join("client.log")).unwrap();
            let child = Command::new(bin("rvbox"))
                .arg("--config")
                .arg(d.join("client.toml"))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            c.clients.push(Client {
                id,
                dir: d,
                child: Some(child),
            });
        }
        c.wait_until(
            "every client has a live session",
            Duration::from_secs(90),
            |c| c.holders().len() == n,
        );
        c
    }

    fn start_replica(&mut self, i: usize) {
        let r = &mut self.replicas[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(r.dir.join("server.log"))
            .unwrap();
        let child = Command::new(bin("rvbox-server"))
            .arg("--config")
            .arg(r.dir.join("server.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        r.child = Some(child);
        let port = r.port;
        let until = Instant::now() + Duration::from_secs(60);
        while http_get(port, "/readyz").is_none_or(|(code, _)| code != 200) {
            assert!(
                Instant::now() < until,
                "replica {i} not ready: {}",
                self.replica_log(i)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn socket(&self, i: usize) -> String {
        self.replicas[i]
            .dir
            .join("run/control.sock")
            .display()
            .to_string()
    }

    fn replica_log(&self, i: usize) -> String {
        std::fs::read_to_string(self.replicas[i].dir.join("server.log")).unwrap_or_default()
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for i in 0..self.replicas.len() {
            out.push_str(&format!("--- replica {i}\n{}", self.replica_log(i)));
        }
        for c in &self.clients {
            out.push_str(&format!(
                "--- {}\n{}",
                c.id,
                std::fs::read_to_string(c.dir.join("client.log")).unwrap_or_default()
            ));
        }
        out
    }

    /// rvc against the replicas whose control sockets `sockets` names.
    fn rvc(&self, sockets: &[usize], args: &[&str]) -> Output {
        self.rvc_cmd(sockets, args).output().unwrap()
    }

    fn rvc_cmd(&self, sockets: &[usize], args: &[&str]) -> Command {
        let list: Vec<String> = sockets.iter().map(|i| self.socket(*i)).collect();
        let mut c = Command::new(bin("rvc"));
        c.env("RVC_SOCKET", list.join(",")).args(args);
        c
    }

    /// Which replica (by index) holds each client's live session.
    fn holders(&self) -> BTreeMap<String, usize> {
        let rows = self.pg.psql(
            "rvbox",
            "SELECT s.client_id || ' ' || r.peer_addr FROM sessions s
             JOIN replicas r ON r.replica_id = s.owner_replica AND r.epoch = s.owner_epoch
             WHERE s.live ORDER BY 1",
        );
        rows.lines()
            .filter_map(|l| {
                let (client, addr) = l.split_once(' ')?;
                let port: u16 = addr.rsplit(':').next()?.parse().ok()?;
                let i = self.replicas.iter().position(|r| r.port == port)?;
                Some((client.to_owned(), i))
            })
            .collect()
    }

    fn wait_until(&self, what: &str, max: Duration, mut ok: impl FnMut(&Self) -> bool) {
        let until = Instant::now() + max;
        while !ok(self) {
            assert!(Instant::now() < until, "timed out: {what}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn signal(&self, i: usize, sig: rustix::process::Signal) {
        let child = self.replicas[i].child.as_ref().unwrap();
        rustix::process::kill_process(rustix::process::Pid::from_child(child), sig).unwrap();
    }

    fn marker(&self, client: &str) -> String {
        let c = self.clients.iter().find(|c| c.id == client).unwrap();
        std::fs::read_to_string(c.dir.join("work/marker")).unwrap_or_default()
    }

    /// The replica holding the most clients, and its clients.
    fn busiest(&self) -> (usize, Vec<String>) {
        let holders = self.holders();
        let mut by: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (c, r) in holders {
            by.entry(r).or_default().push(c);
        }
        by.into_iter()
            .max_by_key(|(_, cs)| cs.len())
            .expect("some replica holds clients")
    }

    /// Starts the streaming command on every client through replica
    /// `via`; returns each client's command id.
    fn start_streams(&self, via: usize) -> BTreeMap<String, String> {
        let cmd = streaming_command();
        self.clients
            .iter()
            .map(|c| {
                let out = self.rvc(&[via], &["run", "--background", &c.id, &cmd]);
                assert!(out.status.success(), "{}", text(&out.stderr));
                (c.id.clone(), text(&out.stdout).trim().to_owned())
            })
            .collect()
    }

    /// Follows every command to its end through replica `via`; checks its
    /// exit status, its output byte for byte, and that it ran once.
    fn check_every_command_ran_once_completely(
        &self,
        via: usize,
        issues: &BTreeMap<String, String>,
    ) {
        let expected = expected_output();
        for (client, issue) in issues {
            let out = self.rvc(&[via], &["follow", issue]);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{client} {issue}: {}\n{}",
                text(&out.stderr),
                self.logs()
            );
            assert!(
                text(&out.stdout) == expected,
                "{client}: output differs ({} bytes, {} expected)\n{}",
                out.stdout.len(),
                expected.len(),
                text(&out.stderr)
            );
            assert_eq!(
                self.marker(client),
                "start\nend\n",
                "{client} ran exactly once"
            );
        }
    }
}

fn after_holder(c: &Cluster, client: &str) -> Option<usize> {
    c.holders().get(client).copied()
}

impl Cluster {
    /// Kills client `id` with SIGKILL and starts it again.
    fn restart_client(&mut self, id: &str) {
        let cl = self.clients.iter_mut().find(|c| c.id == id).unwrap();
        if let Some(mut child) = cl.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(cl.dir.join("client.log"))
            .unwrap();
        cl.child = Some(
            Command::new(bin("rvbox"))
                .arg("--config")
                .arg(cl.dir.join("client.toml"))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.clients {
            if let Some(mut child) = c.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        for r in &mut self.replicas {
            if let Some(mut child) = r.child.take() {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_child(&child),
                    rustix::process::Signal::CONT,
                );
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// One replica is killed with SIGKILL while every client streams output:
/// its clients reconnect through nginx to the others, no command runs
/// twice, every byte is stored, and an `rvc follow` that was connected to
/// the killed replica resumes on another one and prints every line once.
#[test]
fn r25_a_replica_killed_mid_stream_loses_and_repeats_nothing() {
    let mut c = Cluster::start(6);
    let (victim, moved) = c.busiest();
    let survivor = (victim + 1) % 3;
    let issues = c.start_streams(survivor);
    // a follower on the victim, with the survivor as its next socket
    let follow_out = c.dir.path().join("follow.out");
    let follow_err = c.dir.path().join("follow.err");
    let followed = &issues[&moved[0]];
    let mut follower = c
        .rvc_cmd(&[victim, survivor], &["follow", followed])
        .stdout(std::fs::File::create(&follow_out).unwrap())
        .stderr(std::fs::File::create(&follow_err).unwrap())
        .spawn()
        .unwrap();
    // mid-stream: the followed command has printed part of its output
    c.wait_until(
        "the followed command is streaming",
        Duration::from_secs(60),
        |_| std::fs::metadata(&follow_out).is_ok_and(|m| m.len() > 20_000),
    );
    c.signal(victim, rustix::process::Signal::KILL);
    let _ = c.replicas[victim].child.take().unwrap().wait();
    // its clients hold live sessions on the others
    c.wait_until(
        "the killed replica's clients reconnected elsewhere",
        Duration::from_secs(90),
        |c| {
            let h = c.holders();
            moved.iter().all(|m| h.get(m).is_some_and(|r| *r != victim))
        },
    );
    c.check_every_command_ran_once_completely(survivor, &issues);
    let status = follower.wait().unwrap();
    let err = std::fs::read_to_string(&follow_err).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("reconnecting"), "{err}");
    assert!(
        std::fs::read_to_string(&follow_out).unwrap() == expected_output(),
        "the follower moved to another replica and printed every line once: {err}"
    );
}

/// One replica is paused with SIGSTOP past its lease while its clients
/// stream output. Its clients find it silent and move, through nginx, to
/// the others. Resumed, it finds its lease lost and stops (exit 1): it
/// commits nothing for the clients that moved (their sessions and
/// generations stay as the other replicas wrote them), no command runs
/// twice, and every byte is stored.
#[test]
fn r25_a_replica_paused_past_its_lease_commits_nothing_for_clients_that_moved() {
    let mut c = Cluster::start(6);
    let (victim, moved) = c.busiest();
    let survivor = (victim + 1) % 3;
    let issues = c.start_streams(survivor);
    let streaming = |c: &Cluster| {
        moved.iter().all(|m| {
            let n = c.pg.psql(
                "rvbox",
                &format!(
                    "SELECT last_event_seq FROM commands WHERE issue_uuid = decode('{}', 'hex')",
                    issues[m].replace('-', "")
                ),
            );
            n.parse::<u64>().is_ok_and(|n| n > 20)
        })
    };
    c.wait_until(
        "the paused replica's clients stream",
        Duration::from_secs(60),
        streaming,
    );
    c.signal(victim, rustix::process::Signal::STOP);
    let paused = Instant::now();
    c.wait_until(
        "the paused replica's clients moved to the others",
        Duration::from_secs(150),
        |c| {
            let h = c.holders();
            moved.iter().all(|m| h.get(m).is_some_and(|r| *r != victim))
        },
    );
    // past the lease (10 s on the database clock), and past nginx's
    // 10 s fail_timeout, so a new connection of a moved client is sent to
    // the paused replica again (its place on the hash ring)
    std::thread::sleep(Duration::from_secs(11));
    if let Some(rest) = Duration::from_secs(12).checked_sub(paused.elapsed()) {
        std::thread::sleep(rest);
    }
    let generations = |c: &Cluster| {
        c.pg.psql(
            "rvbox",
            "SELECT string_agg(client_id || '=' || generation, ',' ORDER BY client_id) FROM clients",
        )
    };
    let before = generations(&c);
    let before_holders = c.holders();
    let resumed_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    c.signal(victim, rustix::process::Signal::CONT);
    // a moved client restarts at once: its new connection goes to the
    // resumed replica first, which must not take it
    c.restart_client(&moved[0]);
    // it finds its lease lost and stops on its own
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let child = c.replicas[victim].child.as_mut().unwrap();
        if let Some(s) = child.try_wait().unwrap() {
            c.replicas[victim].child = None;
            break s;
        }
        assert!(
            Instant::now() < until,
            "the resumed replica went on\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(1), "{}", c.replica_log(victim));
    assert!(
        c.replica_log(victim).contains("replica lease lost"),
        "{}",
        c.replica_log(victim)
    );
    c.check_every_command_ran_once_completely(survivor, &issues);
    c.wait_until(
        "the restarted client is connected again",
        Duration::from_secs(90),
        |c| c.holders().contains_key(&moved[0]),
    );
    assert_ne!(after_holder(&c, &moved[0]), Some(victim));
    // no session was opened by the resumed replica
    let opened_by_victim = c.pg.psql(
        "rvbox",
        &format!(
            "SELECT count(*) FROM sessions s JOIN replicas r ON r.replica_id = s.owner_replica
             WHERE r.peer_addr = '127.0.0.1:{}' AND s.opened_ms >= {resumed_ms}",
            c.replicas[victim].port
        ),
    );
    assert_eq!(
        opened_by_victim, "0",
        "the resumed replica registered nobody"
    );
    // the restarted client registered once more (on a live replica); no
    // other client's generation moved
    let strip = |g: String| -> String {
        g.split(',')
            .filter(|kv| !kv.starts_with(&format!("{}=", moved[0])))
            .collect::<Vec<_>>()
            .join(",")
    };
    assert_eq!(
        strip(generations(&c)),
        strip(before),
        "the resumed replica registered nobody"
    );
    let after = c.holders();
    for m in &moved[1..] {
        assert_eq!(
            after.get(m),
            before_holders.get(m),
            "{m} stayed where it moved"
        );
    }
    let log = c.replica_log(victim);
    let fenced = log
        .matches("write refused: its session is not live")
        .count()
        + log
            .matches("event refused: its session is not live")
            .count();
    eprintln!("writes the resumed replica made and the database refused: {fenced}");
}

/// The database goes silent under a replica (a blackhole between them: no
/// answer, no close), so its lease keeper hangs in a renewal that never
/// returns. The replica still fences itself on time, 7 s after the start
/// of its last good renewal, and exits 1.
#[test]
fn r25_a_replica_whose_database_goes_silent_fences_itself_on_time() {
    let pg = Postgres::start();
    pg.psql("postgres", "CREATE DATABASE rvbox");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let proxy_port = free_port();
    let control = d.join("fp.sock");
    let mut proxy = Command::new(bin("rvbox-faultproxy"))
        .arg("run")
        .arg("--route")
        .arg(format!("pg,127.0.0.1:{proxy_port},127.0.0.1:{}", pg.port))
        .arg("--control")
        .arg(&control)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join("proxy.log")).unwrap())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", proxy_port)).is_err() {
        assert!(Instant::now() < until, "the fault proxy did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let port = free_port();
    std::fs::write(
        d.join("server.toml"),
        format!(
            "[server]\nagent_listen = \"127.0.0.1:{port}\"\nstore = \"postgres\"\n[postgres]\nconninfo = \"host=127.0.0.1 port={proxy_port} user={} dbname=rvbox\"\n[storage]\ndata_dir = \"{}\"\n[control]\nruntime_dir = \"{}\"\nsocket_path = \"{}\"\n",
            pg.user,
            d.join("data").display(),
            d.join("run").display(),
            d.join("run/control.sock").display(),
        ),
    )
    .unwrap();
    let mut server = Command::new(bin("rvbox-server"))
        .arg("--config")
        .arg(d.join("server.toml"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(d.join("server.log")).unwrap_or_default();
    let until = Instant::now() + Duration::from_secs(60);
    while http_get(port, "/readyz").is_none_or(|(code, _)| code != 200) {
        assert!(Instant::now() < until, "not ready: {}", log());
        std::thread::sleep(Duration::from_millis(100));
    }
    // a few renewals go through
    std::thread::sleep(Duration::from_secs(4));
    let ctl = Command::new(bin("rvbox-faultproxy"))
        .arg("ctl")
        .arg("--control")
        .arg(&control)
        .args(["pg", "blackhole", "both"])
        .output()
        .unwrap();
    assert!(ctl.status.success(), "{}", text(&ctl.stderr));
    let silent = Instant::now();
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break s;
        }
        if silent.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            let _ = server.wait();
            let _ = proxy.kill();
            panic!("the replica went on with its database silent\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = silent.elapsed();
    let _ = proxy.kill();
    let _ = proxy.wait();
    assert_eq!(status.code(), Some(1), "{}", log());
    assert!(
        log().contains("no lease renewal succeeded within the self-fence time"),
        "{}",
        log()
    );
    // the last good renewal started at most one renewal period (3 s)
    // before the silence: the fence comes 7 s after it
    assert!(
        took <= Duration::from_secs(8),
        "fenced {took:?} after the silence"
    );
}

impl Cluster {
    /// Which replica (by index) holds `duty`'s lease now, if one does.
    fn duty_holder(&self, duty: &str) -> Option<usize> {
        let row = self.pg.psql(
            "rvbox",
            &format!(
                "SELECT r.peer_addr FROM duties d
                 JOIN replicas r ON r.replica_id = d.replica_id AND r.epoch = d.epoch
                 WHERE d.name = '{duty}' AND d.lease_expires > now()"
            ),
        );
        let port: u16 = row.trim().rsplit(':').next()?.parse().ok()?;
        self.replicas.iter().position(|r| r.port == port)
    }
}

/// A fleet run over every client, two at a time, submitted on one replica
/// and followed on another. The replica holding the release pump is killed
/// with SIGKILL after the first targets were released: another replica
/// takes the pump duty over, the run releases the rest at its rate and
/// ends, and every client ran the command exactly once.
#[test]
fn r25_a_fleet_run_survives_the_replica_holding_its_pump() {
    let mut c = Cluster::start(6);
    c.wait_until("a replica holds the pump", Duration::from_secs(30), |c| {
        c.duty_holder("fleet_pump").is_some()
    });
    let pump = c.duty_holder("fleet_pump").unwrap();
    let submit = (pump + 1) % 3;
    let watch = (pump + 2) % 3;
    let out = c.rvc(
        &[submit],
        &[
            "run",
            "--background",
            "--target",
            "host-*",
            "--max-parallel",
            "2",
            "echo ran >> marker; sleep 2",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let run = err
        .split_whitespace()
        .nth(2)
        .map(|s| s.trim_end_matches(':').to_owned())
        .unwrap_or_else(|| panic!("no fleet run id in {err:?}"));
    assert!(err.contains("6 target(s)"), "{err}");
    // the first two are released by the submission itself; once one has
    // run, kill the pump's replica
    c.wait_until("a first target ran", Duration::from_secs(60), |c| {
        c.clients
            .iter()
            .any(|cl| std::fs::read_to_string(cl.dir.join("work/marker")).is_ok())
    });
    c.signal(pump, rustix::process::Signal::KILL);
    let _ = c.replicas[pump].child.take().unwrap().wait();
    let follow_out = c.dir.path().join("fleet-follow.out");
    let mut follow = c
        .rvc_cmd(&[watch], &["fleet", "follow", &run])
        .stdout(std::fs::File::create(&follow_out).unwrap())
        .stderr(std::fs::File::create(c.dir.path().join("fleet-follow.err")).unwrap())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = follow.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > until {
            let _ = follow.kill();
            panic!(
                "the fleet run did not end: {}\n{}",
                c.pg.psql(
                    "rvbox",
                    "SELECT client_id, state FROM fleet_targets ORDER BY 1"
                ),
                c.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let err = std::fs::read_to_string(c.dir.path().join("fleet-follow.err")).unwrap();
    assert_eq!(status.code(), Some(0), "{err}\n{}", c.logs());
    let now = c.duty_holder("fleet_pump");
    assert!(
        now.is_some_and(|r| r != pump),
        "the pump moved to a live replica: {now:?}"
    );
    for cl in &c.clients {
        assert_eq!(
            std::fs::read_to_string(cl.dir.join("work/marker")).unwrap_or_default(),
            "ran\n",
            "{} ran exactly once",
            cl.id
        );
    }
    let show = c.rvc(&[watch], &["fleet", "show", &run]);
    assert!(show.status.success(), "{}", text(&show.stderr));
    assert_eq!(
        c.pg.psql(
            "rvbox",
            "SELECT state || ' ' || n_succeeded || '/' || targets FROM fleet_runs"
        )
        .trim(),
        "4 6/6",
        "{}",
        text(&show.stdout)
    );
}

/// Stdin and a signal written through one replica reach a command whose
/// client another replica holds at once, woken through the database, not
/// at the next 10 s sweep: each step is answered (stdin written to the
/// process, the command ended by the signal) within 5 s.
#[test]
fn r25_stdin_and_signals_written_on_one_replica_reach_a_client_on_another_at_once() {
    let c = Cluster::start(3);
    let holders = c.holders();
    let client = "host-01";
    let holder = holders[client];
    let via = (holder + 1) % 3;
    let out = c.rvc(
        &[via],
        &[
            "run",
            "--background",
            client,
            "while read l; do echo \"got:$l\" >> marker; done; echo eof >> marker; sleep 600",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let issue = text(&out.stdout).trim().to_owned();
    let lifecycle = |c: &Cluster| -> i32 {
        c.pg.psql("rvbox", "SELECT lifecycle FROM commands")
            .trim()
            .parse()
            .unwrap_or(0)
    };
    c.wait_until("the command runs", Duration::from_secs(30), |c| {
        lifecycle(c) == rvbox_proto::v1::Lifecycle::Running as i32
    });
    let timed = |args: &[&str]| {
        let started = Instant::now();
        let out = c.rvc(&[via], args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        started.elapsed()
    };
    let took = timed(&["append", client, &issue, "hello"]);
    assert!(took < Duration::from_secs(5), "stdin took {took:?}");
    c.wait_until(
        "the line reached the process",
        Duration::from_secs(5),
        |c| c.marker(client) == "got:hello\n",
    );
    let took = timed(&["close-stdin", client, &issue]);
    assert!(took < Duration::from_secs(5), "close took {took:?}");
    c.wait_until(
        "the process read end of file",
        Duration::from_secs(5),
        |c| c.marker(client) == "got:hello\neof\n",
    );
    let started = Instant::now();
    let out = c.rvc(&[via], &["kill", "KILL", client, &issue]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    c.wait_until(
        "the signal ended the command",
        Duration::from_secs(5),
        |c| lifecycle(c) == rvbox_proto::v1::Lifecycle::Terminated as i32,
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(c.holders()[client], holder, "the client never moved");
}
