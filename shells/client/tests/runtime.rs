//! The client runtime end to end on this host: the client core, the real
//! client store and the real Unix supervisor run a dispatched command in a
//! real `sh`, and its output comes back as sequenced events of the session;
//! a cancellation before launch never runs the command; a second dispatch
//! after the acknowledgement is refused as already executed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;
use rvbox_client_core::machine::Input;
use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::hash::command_hash;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;
use rvbox_supervisor::{SupervisorConfig, UnixSupervisor};

mod support;

use support::{SID, client_id, config};

struct Host {
    rt: Runtime<UnixSupervisor>,
    envs: Vec<wire::Envelope>,
    closes: Vec<u16>,
    dials: usize,
    /// The session the scripted server speaks for.
    session: (String, u64),
}

impl Host {
    fn start(root: &Path, cwd: &str) -> Self {
        Self::start_with(root, |_| {}, |_| config(cwd))
    }

    /// A host whose supervisor is given to `build` for the core
    /// configuration (startup compiles profiles against its layout).
    fn start_with(
        root: &Path,
        tune: impl FnOnce(&mut SupervisorConfig),
        build: impl FnOnce(&UnixSupervisor) -> rvbox_client_core::machine::ClientCoreConfig,
    ) -> Self {
        let store = ClientStore::open(
            ClientLayout::new(root.join("state")),
            Arc::new(RealFs),
            Arc::new(OsEntropy),
            ClientStoreOptions::default(),
            0,
        )
        .unwrap();
        let run = root.join("run");
        std::fs::create_dir_all(&run).unwrap();
        let mut sc = support::supervisor_config(run);
        sc.drain_grace = Duration::from_millis(500);
        tune(&mut sc);
        let sup = UnixSupervisor::new(sc).unwrap();
        let core_config = build(&sup);
        let rt = Runtime::new(core_config, store, sup, 3).unwrap();
        Self {
            rt,
            envs: Vec::new(),
            closes: Vec::new(),
            dials: 0,
            session: (SID.into(), 1),
        }
    }

    fn frame(&mut self, p: Payload) {
        let env = wire::Envelope {
            session_id: self.session.0.clone(),
            generation: self.session.1,
            payload: Some(p),
        };
        self.rt.input(Input::Frame(env.encode_to_vec()));
        self.collect();
    }

    fn collect(&mut self) {
        for w in self.rt.take_wire() {
            match w {
                Wire::Binary(b) => self
                    .envs
                    .push(wire::Envelope::decode(b.as_slice()).unwrap()),
                Wire::Close(c) => self.closes.push(c),
                Wire::Dial => self.dials += 1,
                _ => {}
            }
        }
    }

    fn connect(&mut self) {
        self.rt.input(Input::Opened);
        self.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation: 1,
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

    /// The connection is lost; after the backoff the client dials again,
    /// is welcomed into session `sid` at `generation`, and is told in the
    /// round's result to resume `resume` (command, durable sequence).
    fn reconnect(&mut self, sid: &str, generation: u64, resume: &[(&str, u64)]) {
        self.rt.input(Input::Closed(None));
        self.collect();
        let dials = self.dials;
        let until = Instant::now() + Duration::from_secs(10);
        while self.dials == dials {
            assert!(Instant::now() < until, "no dial after the backoff");
            std::thread::sleep(Duration::from_millis(20));
            self.rt.tick();
            self.collect();
        }
        self.session = (sid.into(), generation);
        self.rt.input(Input::Opened);
        self.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: sid.into(),
            generation,
            ..Default::default()
        }));
        self.frame(Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![],
        }));
        let mut r = wire::ReconcileResult {
            round: 1,
            resume: resume
                .iter()
                .map(|(issue, durable)| wire::ResumeRow {
                    issue_uuid: (*issue).into(),
                    revision: 1,
                    durable_event_seq: *durable,
                    script_resume_offset: 0,
                })
                .collect(),
            ..Default::default()
        };
        r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
        self.frame(Payload::ReconcileResult(r));
    }

    /// The events of `issue` sent in session `sid`.
    fn events_in(&self, sid: &str, issue: &str) -> Vec<wire::CommandEvent> {
        self.envs
            .iter()
            .filter(|e| e.session_id == sid)
            .filter_map(|e| match &e.payload {
                Some(Payload::CommandEvent(ev)) if ev.issue_uuid == issue => Some(ev.clone()),
                _ => None,
            })
            .collect()
    }

    fn events(&self, issue: &str) -> Vec<wire::CommandEvent> {
        self.envs
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::CommandEvent(ev)) if ev.issue_uuid == issue => Some(ev.clone()),
                _ => None,
            })
            .collect()
    }

    /// Runs processes until `issue` has spooled `RUNNING`.
    fn run_until_running(&mut self, issue: &str) {
        let until = Instant::now() + Duration::from_secs(10);
        while !self.events(issue).iter().any(|e| {
            matches!(&e.body, Some(Body::Lifecycle(l)) if l.lifecycle == wire::Lifecycle::Running as i32)
        }) {
            assert!(Instant::now() < until, "{issue} never ran");
            self.rt.pump_processes(Duration::from_millis(20));
            self.collect();
        }
    }

    /// Runs processes until `issue` has a terminal event or `limit` passes.
    fn run_until_terminal(&mut self, issue: &str, limit: Duration) {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            self.rt.pump_processes(Duration::from_millis(20));
            self.rt.tick();
            self.collect();
            let done = self.events(issue).iter().any(|e| {
                matches!(&e.body, Some(Body::Lifecycle(l))
                    if l.lifecycle != wire::Lifecycle::Running as i32)
            });
            if done {
                return;
            }
        }
        panic!("no terminal event for {issue} within {limit:?}");
    }

    fn ack(&mut self, issue: &str) {
        let last = self
            .events(issue)
            .iter()
            .map(|e| e.event_seq)
            .max()
            .unwrap();
        self.frame(Payload::EventAck(wire::EventAck {
            issue_uuid: issue.into(),
            durable_event_seq: last,
        }));
    }

    fn answers(&self, issue: &str) -> Vec<wire::CommandAccepted> {
        self.envs
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::CommandAccepted(a)) if a.issue_uuid == issue => Some(a.clone()),
                _ => None,
            })
            .collect()
    }
}

fn dispatch(issue: &str, text: &str) -> Payload {
    dispatch_with(issue, text, &[])
}

fn dispatch_with(issue: &str, text: &str, profiles: &[wire::ProfileFlag]) -> Payload {
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(text.into())),
        profile_flags: profiles.iter().map(|f| *f as i32).collect(),
        ..Default::default()
    };
    let normalized = check_execution_spec(&spec).unwrap();
    Payload::Dispatch(wire::Dispatch {
        issue_uuid: issue.into(),
        generation: 1,
        revision: 1,
        request_hash: command_hash(&client_id(), &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    })
}

fn output_of(events: &[wire::CommandEvent], stream: wire::OutputStream) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            Some(Body::Output(o)) if o.stream == stream as i32 => {
                Some(zstd::bulk::decompress(&o.payload, o.raw_length as usize).unwrap())
            }
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn a_real_shell_runs_once_and_its_output_comes_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd_s = cwd.to_str().unwrap().to_owned();
    let mut host = Host::start(dir.path(), &cwd_s);
    host.connect();
    let issue = "01890a5d-ac96-774b-bcce-b302099a8001";
    let text = "printf 'out-%s' \"$(pwd)\"; printf 'err' >&2; echo ran >> side-effects; exit 3";
    host.frame(dispatch(issue, text));
    assert_eq!(
        host.answers(issue)[0].outcome,
        wire::AcceptOutcome::Positive as i32
    );
    host.run_until_terminal(issue, Duration::from_secs(20));
    let events = host.events(issue);
    let seqs: Vec<u64> = events.iter().map(|e| e.event_seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "contiguous"
    );
    assert_eq!(
        output_of(&events, wire::OutputStream::Stdout),
        format!("out-{cwd_s}").into_bytes()
    );
    assert_eq!(output_of(&events, wire::OutputStream::Stderr), b"err");
    let last = events.last().unwrap();
    let Some(Body::Lifecycle(l)) = &last.body else {
        panic!("the terminal event is the last: {last:?}")
    };
    assert_eq!(l.lifecycle, wire::Lifecycle::Failed as i32);
    assert_eq!(l.exit_result.as_ref().unwrap().exit_code, Some(3));
    host.ack(issue);
    assert_eq!(
        std::fs::read_to_string(cwd.join("side-effects")).unwrap(),
        "ran\n"
    );
    // the same dispatch again is refused: it already ran here
    host.frame(dispatch(issue, text));
    let answers = host.answers(issue);
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[1].outcome, wire::AcceptOutcome::Permanent as i32);
    let left: Vec<_> = std::fs::read_dir(&cwd)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".rvbox-"))
        .collect();
    assert!(left.is_empty(), "the wrapper file is removed: {left:?}");
}

#[test]
fn a_signal_sent_through_rvbox_terminates_a_running_tree() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd_s = cwd.to_str().unwrap().to_owned();
    let mut host = Host::start(dir.path(), &cwd_s);
    host.connect();
    let issue = "01890a5d-ac96-774b-bcce-b302099a8002";
    host.frame(dispatch(issue, "echo started; sleep 60"));
    // wait for RUNNING and the first output
    let until = Instant::now() + Duration::from_secs(20);
    while !output_of(&host.events(issue), wire::OutputStream::Stdout).starts_with(b"started") {
        assert!(Instant::now() < until, "never started");
        host.rt.pump_processes(Duration::from_millis(20));
        host.rt.tick();
        host.collect();
    }
    host.frame(Payload::Signal(wire::Signal {
        issue_uuid: issue.into(),
        revision: 2,
        signal: wire::SignalKind::Kill as i32,
    }));
    host.run_until_terminal(issue, Duration::from_secs(20));
    let events = host.events(issue);
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.body, Some(Body::SignalResult(s))
        if s.outcome == wire::SignalOutcome::Delivered as i32))
    );
    let Some(Body::Lifecycle(l)) = &events.last().unwrap().body else {
        panic!()
    };
    assert_eq!(l.lifecycle, wire::Lifecycle::Terminated as i32);
}

/// Profiles of a client configuration, as the daemon loads them.
fn configured_profiles() -> rvbox_config::ProfilesConfig {
    let text = r#"
[client]
client_id = "web-1"
server_urls = ["ws://127.0.0.1:9/agent"]

[profiles.mem_low]
required_controls = ["memory_max"]
memory_max = "64MiB"
pids_max = 64

[profiles.mem_medium]
required_controls = ["memory_max"]
memory_max = "128MiB"
memory_high = "96MiB"

[profiles.disk_low]
required_controls = ["io_max"]

[profiles.disk_low.io."8:0"]
read_bps = "10MiB"

[profiles.cpu_medium]
required_controls = ["cpu_max"]
cpu_quota_us = 50000
cpu_period_us = 100000
cpu_weight = 50

[profiles.cpu_low]
enabled = false
required_controls = ["cpu_max"]
cpu_quota_us = 10000
cpu_period_us = 100000
"#;
    rvbox_config::load_client("client.toml", text, &[], &rvbox_daemon_common::RealHost)
        .unwrap()
        .profiles
}

/// The memory limit of the cgroup the command runs in, as the command
/// itself reads it (v1 memory controller, else the v2 tree).
const PRINT_MEMORY_LIMIT: &str = r#"p=$(grep -E '^[0-9]+:memory:' /proc/self/cgroup | cut -d: -f3)
if [ -n "$p" ]; then cat "/sys/fs/cgroup/memory$p/memory.limit_in_bytes"
else p=$(grep '^0::' /proc/self/cgroup | cut -d: -f3); cat "/sys/fs/cgroup$p/memory.max"; fi
"#;

/// The CPU controls of the cgroup the command runs in, as the command
/// reads them, after it has spun for 0.6 s: `quota period shares` (v1) or
/// `quota period weight` (v2), then the throttled-period count.
/// Prints the tree's cpu controls, then whether it was throttled: three
/// spinners (more than the quota of half a CPU, also on a machine busy
/// with other work at a lower priority) run until the cgroup counts a
/// throttled period, or for 8 s at most.
const PRINT_CPU_CONTROLS: &str = r#"p=$(grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup | cut -d: -f3)
if [ -n "$p" ]; then d="/sys/fs/cgroup/cpu$p"; c="$(cat "$d/cpu.cfs_quota_us") $(cat "$d/cpu.cfs_period_us") $(cat "$d/cpu.shares")"
else p=$(grep '^0::' /proc/self/cgroup | cut -d: -f3); d="/sys/fs/cgroup$p"; c="$(cat "$d/cpu.max") $(cat "$d/cpu.weight")"; fi
pids=""
for i in 1 2 3; do timeout 8 sh -c 'while :; do :; done' & pids="$pids $!"; done
n=0; t=0
while [ "$t" -lt 80 ]; do n=$(grep nr_throttled "$d/cpu.stat" | cut -d' ' -f2); [ "$n" -gt 0 ] && break; sleep 0.1; t=$((t+1)); done
kill $pids 2>/dev/null; wait 2>/dev/null
echo "$c"
echo "$n"
"#;

#[test]
fn configured_profiles_compile_against_this_layout_and_an_unenforceable_one_is_refused_at_acceptance()
 {
    use rvbox_client_runtime::profiles::compile_profiles;
    use rvbox_config::{Control, ProfileName};
    use rvbox_supervisor::Supervisor as _;

    let configured = configured_profiles();
    let dir = tempfile::TempDir::new().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let cwd = cwd.to_string_lossy().into_owned();

    // without controllers nothing restricting is enforceable
    {
        let root = dir.path().join("pg");
        std::fs::create_dir_all(&root).unwrap();
        let mut compiled = None;
        let _pg = Host::start_with(
            &root,
            |sc| sc.force_process_group = true,
            |sup| {
                compiled = Some(compile_profiles(&configured, |l| sup.check_limits(l)));
                config(&cwd)
            },
        );
        let compiled = compiled.unwrap();
        assert!(compiled.enforceable.is_empty(), "{compiled:?}");
        let refused: Vec<ProfileName> = compiled.unenforceable.iter().map(|u| u.profile).collect();
        assert_eq!(
            refused,
            vec![
                ProfileName::CpuMedium,
                ProfileName::MemLow,
                ProfileName::MemMedium,
                ProfileName::DiskLow
            ]
        );
    }

    // this host's layout
    let mut compiled = None;
    let cg_root = dir.path().join("cg");
    std::fs::create_dir_all(&cg_root).unwrap();
    let mut host = Host::start_with(
        &cg_root,
        |_| {},
        |sup| {
            let c = compile_profiles(&configured, |l| sup.check_limits(l));
            let mut cfg = config(&cwd);
            cfg.policy.profiles = c.enforceable.clone();
            cfg.profiles = c.limits.clone();
            cfg.hello.capabilities = Some(wire::Capabilities {
                profiles: c.advertised(),
                ..Default::default()
            });
            compiled = Some(c);
            cfg
        },
    );
    let compiled = compiled.unwrap();
    let layout = host.rt.supervisor().layout().clone();
    let v2_has = |c: &str| {
        layout
            .v2
            .as_ref()
            .is_some_and(|v| v.controllers.contains(c))
    };
    let has_memory = v2_has("memory") || layout.v1.iter().any(|l| l.controller.name() == "memory");
    if !has_memory {
        support::skip_cgroups(
            "configured_profiles_compile_against_this_layout",
            "no memory controller on this host; the memory half is skipped",
        );
        return;
    }
    // the disabled profile is neither compiled nor refused
    assert!(!compiled.enforceable.contains(&wire::ProfileFlag::CpuLow));
    assert!(
        compiled
            .unenforceable
            .iter()
            .all(|u| u.profile != ProfileName::CpuLow)
    );
    // mem_low: both controls kept
    assert!(compiled.enforceable.contains(&wire::ProfileFlag::MemLow));
    let mem_low = &compiled.limits[&(wire::ProfileFlag::MemLow as i32)];
    assert_eq!(mem_low.memory_max, Some(64 << 20));
    // mem_medium: memory.high has no v1 equivalent, so on a hybrid host
    // it is left out and named; memory.max stays
    let mem_medium = &compiled.limits[&(wire::ProfileFlag::MemMedium as i32)];
    assert_eq!(mem_medium.memory_max, Some(128 << 20));
    if v2_has("memory") {
        assert_eq!(mem_medium.memory_high, Some(96 << 20));
    } else {
        assert_eq!(mem_medium.memory_high, None);
        assert!(
            compiled
                .omitted
                .iter()
                .any(|o| o.profile == ProfileName::MemMedium && o.control == Control::MemoryHigh)
        );
    }

    host.connect();
    // an enforceable profile runs under its compiled limit
    let issue = "01890000-0000-7000-8000-0000000000e1";
    host.frame(dispatch_with(
        issue,
        PRINT_MEMORY_LIMIT,
        &[wire::ProfileFlag::MemLow],
    ));
    host.run_until_terminal(issue, Duration::from_secs(20));
    let printed = output_of(&host.events(issue), wire::OutputStream::Stdout);
    assert_eq!(
        String::from_utf8_lossy(&printed).trim(),
        (64u64 << 20).to_string()
    );

    // cpu_medium: cpu.max and cpu.weight (v1: cfs quota and period, and
    // shares = weight * 1024 / 100), and a spinning child is throttled
    let has_cpu = v2_has("cpu") || layout.v1.iter().any(|l| l.controller.name() == "cpu");
    if has_cpu {
        let cpu = &compiled.limits[&(wire::ProfileFlag::CpuMedium as i32)];
        assert_eq!(cpu.cpu_max, Some((50_000, 100_000)));
        assert_eq!(cpu.cpu_weight, Some(50));
        let issue = "01890000-0000-7000-8000-0000000000e3";
        host.frame(dispatch_with(
            issue,
            PRINT_CPU_CONTROLS,
            &[wire::ProfileFlag::CpuMedium],
        ));
        host.run_until_terminal(issue, Duration::from_secs(20));
        let printed = output_of(&host.events(issue), wire::OutputStream::Stdout);
        let text = String::from_utf8_lossy(&printed).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        let want = if v2_has("cpu") {
            "50000 100000 50"
        } else {
            "50000 100000 512"
        };
        assert_eq!(lines[0], want, "{text:?}");
        let throttled: u64 = lines[1].trim().parse().unwrap();
        assert!(
            throttled > 0,
            "a child spinning at 50% quota was never throttled: {text:?}"
        );
    } else {
        support::skip_cgroups(
            "configured_profiles_compile_against_this_layout",
            "no cpu controller on this host; the cpu half is skipped",
        );
    }

    // an unenforceable profile is refused at acceptance, permanently, as
    // unsupported: nothing is prepared
    if v2_has("io") {
        eprintln!("io.max is enforceable here; the refusal half is skipped");
        return;
    }
    assert!(
        compiled
            .unenforceable
            .iter()
            .any(|u| u.profile == ProfileName::DiskLow && u.control == Control::IoMax)
    );
    let marker = dir.path().join("ran");
    let issue = "01890000-0000-7000-8000-0000000000e2";
    host.frame(dispatch_with(
        issue,
        &format!("touch {}\n", marker.display()),
        &[wire::ProfileFlag::DiskLow],
    ));
    let answers = host.answers(issue);
    assert_eq!(answers.len(), 1, "{answers:?}");
    let a = &answers[0];
    assert_eq!(a.outcome, wire::AcceptOutcome::Permanent as i32, "{a:?}");
    let error = a.error.as_ref().unwrap();
    assert_eq!(error.code, wire::ErrorCode::Unsupported as i32, "{error:?}");
    for _ in 0..10 {
        host.rt.pump_processes(Duration::from_millis(20));
    }
    assert!(!marker.exists(), "user code ran for a refused profile");
    assert!(host.events(issue).is_empty());
}

fn stdin_write(issue: &str, seq: u64, raw: &[u8], zstd: bool, last: bool) -> Payload {
    use sha2::Digest as _;
    let payload = if zstd {
        zstd::bulk::compress(raw, 3).unwrap()
    } else {
        raw.to_vec()
    };
    Payload::StdinWrite(wire::StdinWrite {
        issue_uuid: issue.into(),
        write_seq: seq,
        compression: if zstd {
            wire::Compression::Zstd
        } else {
            wire::Compression::None
        } as i32,
        stored_length: payload.len() as u32,
        payload,
        raw_length: raw.len() as u32,
        raw_sha256: sha2::Sha256::digest(raw).to_vec(),
        newline: if last {
            wire::StdinNewline::Append
        } else {
            wire::StdinNewline::Raw
        } as i32,
        close_after: last,
    })
}

#[test]
fn stdin_writes_reach_the_child_in_order_decoded_and_acknowledged_past_the_unwritten_bound() {
    let dir = tempfile::TempDir::new().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let mut host = Host::start(dir.path(), &cwd.to_string_lossy());
    host.connect();
    let issue = "01890000-0000-7000-8000-0000000000f1";
    host.frame(dispatch(issue, "cat\n"));
    host.run_until_running(issue);
    // 5 MiB in 20 writes of 256 KiB, more than the 4 MiB the store keeps
    // unwritten: each write's durable copy goes once the child has it
    let mut expected = Vec::new();
    const WRITES: u64 = 20;
    for seq in 1..=WRITES {
        let raw: Vec<u8> = (0..256 * 1024u32)
            .map(|i| b'a' + u8::try_from((i / 1024 + u32::try_from(seq).unwrap()) % 26).unwrap())
            .collect();
        expected.extend_from_slice(&raw);
        host.frame(stdin_write(issue, seq, &raw, seq % 2 == 0, seq == WRITES));
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let acked = host
                .events(issue)
                .iter()
                .any(|e| matches!(&e.body, Some(Body::StdinAck(a)) if a.write_seq == seq));
            if acked {
                break;
            }
            assert!(Instant::now() < until, "write {seq} never acknowledged");
            host.rt.pump_processes(Duration::from_millis(10));
            host.collect();
            // the transport acknowledges what it got, as the server would
            if let Some(last) = host.events(issue).iter().map(|e| e.event_seq).max() {
                host.frame(Payload::EventAck(wire::EventAck {
                    issue_uuid: issue.into(),
                    durable_event_seq: last,
                }));
            }
        }
    }
    expected.push(b'\n');
    host.run_until_terminal(issue, Duration::from_secs(20));
    let events = host.events(issue);
    let acks: Vec<(u64, i32, bool)> = events
        .iter()
        .filter_map(|e| match &e.body {
            Some(Body::StdinAck(a)) => Some((a.write_seq, a.delivery, a.closed)),
            _ => None,
        })
        .collect();
    let want: Vec<(u64, i32, bool)> = (1..=WRITES)
        .map(|s| (s, wire::StdinDelivery::Written as i32, s == WRITES))
        .collect();
    assert_eq!(acks, want);
    let out = output_of(&events, wire::OutputStream::Stdout);
    assert_eq!(out.len(), expected.len());
    assert!(out == expected, "stdout differs from the stdin written");
    let last = events.last().unwrap();
    assert!(
        matches!(&last.body, Some(Body::Lifecycle(l)) if l.lifecycle == wire::Lifecycle::Succeeded as i32)
    );
}

#[test]
fn a_stdin_write_that_does_not_match_its_digest_is_never_written() {
    let dir = tempfile::TempDir::new().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let mut host = Host::start(dir.path(), &cwd.to_string_lossy());
    host.connect();
    let issue = "01890000-0000-7000-8000-0000000000f2";
    host.frame(dispatch(issue, "cat\n"));
    host.run_until_running(issue);
    let mut bad = stdin_write(issue, 1, b"secret\n", true, false);
    if let Payload::StdinWrite(w) = &mut bad {
        w.raw_sha256[0] ^= 1;
    }
    host.frame(bad);
    assert_eq!(
        host.closes,
        vec![1002],
        "the session ends with a protocol error"
    );
    for _ in 0..20 {
        host.rt.pump_processes(Duration::from_millis(10));
        host.collect();
    }
    let events = host.events(issue);
    assert!(
        !events
            .iter()
            .any(|e| matches!(&e.body, Some(Body::StdinAck(_)))),
        "a write that failed its digest was acknowledged"
    );
    assert!(
        output_of(&events, wire::OutputStream::Stdout).is_empty(),
        "a write that failed its digest reached the child"
    );
    assert_eq!(host.rt.core().stats().protocol_errors, 1);
}

/// Raw bytes of `stream` kept in output events, and dropped into markers.
fn accounted(events: &[wire::CommandEvent], stream: wire::OutputStream) -> (u64, u64) {
    let mut kept = 0u64;
    let mut dropped = 0u64;
    for e in events {
        match &e.body {
            Some(Body::Output(o)) if o.stream == stream as i32 => kept += u64::from(o.raw_length),
            Some(Body::Truncation(t)) if t.streams.contains(&(stream as i32)) => {
                // a marker of both streams: the test writes one stream only
                dropped += t.raw_bytes;
            }
            _ => {}
        }
    }
    (kept, dropped)
}

/// Runs until terminal, acknowledging everything sent as a server would.
fn run_acking(host: &mut Host, issue: &str, limit: Duration) {
    let until = Instant::now() + limit;
    loop {
        host.rt.pump_processes(Duration::from_millis(10));
        host.rt.tick();
        host.collect();
        let events = host.events(issue);
        if let Some(last) = events.iter().map(|e| e.event_seq).max() {
            host.frame(Payload::EventAck(wire::EventAck {
                issue_uuid: issue.into(),
                durable_event_seq: last,
            }));
        }
        if events.iter().any(|e| {
            matches!(&e.body, Some(Body::Lifecycle(l)) if l.lifecycle != wire::Lifecycle::Running as i32)
        }) {
            return;
        }
        assert!(
            Instant::now() < until,
            "no terminal event for {issue} within {limit:?}"
        );
    }
}

fn host_in(dir: &Path) -> (Host, String) {
    let cwd = dir.join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let cwd = cwd.to_string_lossy().into_owned();
    let mut host = Host::start(dir, &cwd);
    host.connect();
    (host, cwd)
}

#[test]
fn alternating_stdout_and_stderr_without_newlines_keep_each_streams_bytes_in_order() {
    let dir = tempfile::TempDir::new().unwrap();
    let (mut host, _) = host_in(dir.path());
    let issue = "01890000-0000-7000-8000-0000000000a1";
    host.frame(dispatch(
        issue,
        "i=0\nwhile [ $i -lt 3000 ]; do printf 'o%d,' $i; printf 'e%d;' $i >&2; i=$((i+1)); done\n",
    ));
    run_acking(&mut host, issue, Duration::from_secs(30));
    let events = host.events(issue);
    let want_out: String = (0..3000).map(|i| format!("o{i},")).collect();
    let want_err: String = (0..3000).map(|i| format!("e{i};")).collect();
    // each stream's kept chunks are its bytes in order: pieces of it at
    // increasing positions, with a skip only where a marker came between
    let mut pos = BTreeMap::<i32, usize>::new();
    let mut marked = false;
    let mut dropped = 0u64;
    let mut kept = 0u64;
    for e in &events {
        match &e.body {
            Some(Body::Output(o)) => {
                let raw = zstd::bulk::decompress(&o.payload, o.raw_length as usize).unwrap();
                let want = if o.stream == wire::OutputStream::Stdout as i32 {
                    want_out.as_bytes()
                } else {
                    want_err.as_bytes()
                };
                let at = pos.entry(o.stream).or_default();
                let found = (*at..=want.len().saturating_sub(raw.len()))
                    .find(|p| want[*p..].starts_with(&raw))
                    .expect("kept bytes that are not the stream's, in order");
                assert!(found == *at || marked, "bytes skipped without a marker");
                *at = found + raw.len();
                kept += raw.len() as u64;
            }
            Some(Body::Truncation(t)) => {
                marked = true;
                dropped += t.raw_bytes;
            }
            _ => {}
        }
    }
    let total = (want_out.len() + want_err.len()) as u64;
    assert_eq!(kept + dropped, total, "every byte is kept or in a marker");
    if dropped == 0 {
        assert_eq!(
            output_of(&events, wire::OutputStream::Stdout),
            want_out.as_bytes()
        );
        assert_eq!(
            output_of(&events, wire::OutputStream::Stderr),
            want_err.as_bytes()
        );
    } else {
        eprintln!("the loop stalled: {dropped} of {total} bytes dropped into markers");
    }
    let seqs: Vec<u64> = events.iter().map(|e| e.event_seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "contiguous sequences"
    );
    assert!(matches!(&events.last().unwrap().body,
        Some(Body::Lifecycle(l)) if l.lifecycle == wire::Lifecycle::Succeeded as i32));
}

#[test]
fn a_terminal_exit_above_the_high_watermark_ends_last_after_every_byte_is_accounted() {
    let dir = tempfile::TempDir::new().unwrap();
    let (mut host, _) = host_in(dir.path());
    let issue = "01890000-0000-7000-8000-0000000000a2";
    // 16 MiB at pipe speed, then a failing exit: the backlog passes the
    // 1 MiB high watermark while the child writes, and the exit comes in
    // loss mode
    host.frame(dispatch(issue, "head -c 16777216 /dev/urandom\nexit 3\n"));
    run_acking(&mut host, issue, Duration::from_secs(60));
    let events = host.events(issue);
    let (kept, dropped) = accounted(&events, wire::OutputStream::Stdout);
    assert_eq!(
        kept + dropped,
        16 * 1024 * 1024,
        "every byte is kept or in a marker"
    );
    let last = events.last().unwrap();
    match &last.body {
        Some(Body::Lifecycle(l)) => {
            assert_eq!(l.lifecycle, wire::Lifecycle::Failed as i32);
            assert_eq!(l.exit_result.as_ref().and_then(|e| e.exit_code), Some(3));
        }
        other => panic!("the terminal event is not last: {other:?}"),
    }
    let seqs: Vec<u64> = events.iter().map(|e| e.event_seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "contiguous sequences"
    );
}

#[test]
fn a_continuously_verbose_child_is_never_blocked_by_the_daemon() {
    let dir = tempfile::TempDir::new().unwrap();
    let (mut host, cwd) = host_in(dir.path());
    let issue = "01890000-0000-7000-8000-0000000000a3";
    let done = Path::new(&cwd).join("wrote-everything");
    let total: u64 = 64 * 1024 * 1024;
    host.frame(dispatch(
        issue,
        &format!("head -c {total} /dev/zero\ntouch '{}'\n", done.display()),
    ));
    // the launch needs the loop until the shell runs
    host.run_until_running(issue);
    // then the daemon's loop does nothing at all: the child still writes
    // its 64 MiB to the end (the pipe readers never wait on the loop, the
    // spool, its disk or the network)
    let until = Instant::now() + Duration::from_secs(20);
    while !done.exists() {
        assert!(
            Instant::now() < until,
            "the child was blocked while the daemon's loop was idle"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    run_acking(&mut host, issue, Duration::from_secs(60));
    let events = host.events(issue);
    let (kept, dropped) = accounted(&events, wire::OutputStream::Stdout);
    assert_eq!(kept + dropped, total, "every byte is kept or in a marker");
    assert!(dropped > 0, "an idle loop drops, it does not block");
}

/// A partition longer than the liveness timeout leaves far more pinned
/// events than one spool read-back returns (1,024); after the reconnect
/// every one of them is sent again, in order, from the server's durable
/// position, and new events follow without a gap.
#[test]
fn every_pinned_event_is_sent_again_after_a_reconnect_past_one_read_back_batch() {
    let dir = tempfile::TempDir::new().unwrap();
    let (mut host, cwd) = host_in(dir.path());
    let issue = "01890000-0000-7000-8000-0000000000a4";
    // one write per line, slower than the pipe reader, so most are events
    // of their own; the child writes until the test has seen more events
    // than one read-back batch (a loaded machine joins lines into fewer)
    let stop = Path::new(&cwd).join("stop");
    host.frame(dispatch(
        issue,
        &format!(
            "i=0; while [ ! -e '{}' ]; do i=$((i+1)); echo \"line $i\"; sleep 0.001; done\n",
            stop.display()
        ),
    ));
    // nothing is acknowledged: every event stays pinned
    let until = Instant::now() + Duration::from_secs(120);
    while host
        .events(issue)
        .iter()
        .map(|e| e.event_seq)
        .max()
        .unwrap_or(0)
        <= 1100
    {
        assert!(
            Instant::now() < until,
            "the test needs more pinned events than one read-back batch"
        );
        host.rt.pump_processes(Duration::from_millis(20));
        host.rt.tick();
        host.collect();
    }
    std::fs::write(&stop, b"").unwrap();
    host.run_until_terminal(issue, Duration::from_secs(60));
    let sent = host.events(issue);
    let last = sent.iter().map(|e| e.event_seq).max().unwrap();
    assert!(last > 1100, "{last} events");
    // the server held the first 10 durably when the path went dark
    host.reconnect("fedcba9876543210fedc", 2, &[(issue, 10)]);
    let again = host.events_in("fedcba9876543210fedc", issue);
    let seqs: Vec<u64> = again.iter().map(|e| e.event_seq).collect();
    assert!(
        seqs == (11..=last).collect::<Vec<_>>(),
        "every pinned event after the durable position, once, in order: {} sent again ({:?}..{:?}), {} expected (11..{last})",
        seqs.len(),
        seqs.first(),
        seqs.last(),
        last - 10
    );
    let first: Vec<wire::CommandEvent> =
        sent.iter().filter(|e| e.event_seq <= 10).cloned().collect();
    let mut all = first;
    all.extend(again);
    let got = output_of(&all, wire::OutputStream::Stdout);
    let lines = got.iter().filter(|b| **b == b'\n').count();
    assert!(lines > 1100, "{lines} lines");
    let want: Vec<u8> = (1..=lines)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect();
    assert_eq!(got, want, "the output sent again is every line, in order");
    assert_eq!(
        output_of(&sent, wire::OutputStream::Stdout),
        want,
        "and the same as sent the first time"
    );
    assert!(host.closes.is_empty(), "closed: {:?}", host.closes);
}
