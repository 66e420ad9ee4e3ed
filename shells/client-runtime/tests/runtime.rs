//! The runtime loop over the real client store and a model supervisor: a
//! dispatch becomes a durable acceptance, a launch in order, and events
//! read back from the spool and framed for this session; a restart reaps.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{ClientCoreConfig, Input};
use rvbox_client_core::process::{
    CommandProcessEvent, Exit, LaunchIdentity, LaunchSpec, ProcessEvent, Supervision,
};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::command_event::Body;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;
use rvbox_supervisor::{OrphanOutcome, Supervisor, SupervisorError};

const SID: &str = "0123456789abcdef0123";

/// A supervisor whose trees print their wrapper's content and exit 0.
#[derive(Debug, Default)]
struct ModelSupervisor {
    events: VecDeque<CommandProcessEvent>,
    specs: BTreeMap<Uuid7, LaunchSpec>,
    released: Vec<Uuid7>,
    reaped: Vec<Uuid7>,
}

impl Supervisor for ModelSupervisor {
    fn mode(&self) -> Supervision {
        Supervision::ProcessGroup
    }
    fn prepare(&mut self, spec: LaunchSpec) -> Result<(), SupervisorError> {
        let issue = spec.issue;
        self.specs.insert(issue, spec);
        self.events.push_back(CommandProcessEvent {
            issue,
            event: ProcessEvent::Ready(LaunchIdentity {
                launcher_pid: 1,
                process_group: 1,
                birth_ticks: 1,
                cgroup: None,
            }),
        });
        Ok(())
    }
    fn release(&mut self, issue: &Uuid7) -> Result<(), SupervisorError> {
        let spec = self
            .specs
            .get(issue)
            .ok_or(SupervisorError::Unknown(*issue))?;
        let content = std::fs::read(&spec.wrapper_path).unwrap();
        self.released.push(*issue);
        for event in [
            ProcessEvent::Running,
            ProcessEvent::Output {
                stream: wire::OutputStream::Stdout,
                observed_ms: 1,
                bytes: content,
            },
            ProcessEvent::Exited(Exit::Code(0)),
            ProcessEvent::Drained { incomplete: vec![] },
        ] {
            self.events.push_back(CommandProcessEvent {
                issue: *issue,
                event,
            });
        }
        Ok(())
    }
    fn abort(&mut self, issue: &Uuid7) {
        self.events.push_back(CommandProcessEvent {
            issue: *issue,
            event: ProcessEvent::Drained { incomplete: vec![] },
        });
    }
    fn signal(&mut self, _issue: &Uuid7, _kind: wire::SignalKind) -> wire::SignalOutcome {
        wire::SignalOutcome::Delivered
    }
    fn write_stdin(&mut self, _: &Uuid7, _: u64, _: Vec<u8>) -> Result<(), SupervisorError> {
        Ok(())
    }
    fn close_stdin(&mut self, _: &Uuid7) {}
    fn snapshot(&self, _: &Uuid7) -> Option<wire::ResourceSnapshot> {
        None
    }
    fn reap_orphan(&mut self, issue: &Uuid7, _: &LaunchIdentity) -> OrphanOutcome {
        self.reaped.push(*issue);
        OrphanOutcome::Gone
    }
    fn stop_all(&mut self) {}
    fn next_event(&mut self, _timeout: Duration) -> Option<CommandProcessEvent> {
        self.events.pop_front()
    }
}

fn config(cwd: &str) -> ClientCoreConfig {
    ClientCoreConfig {
        policy: AcceptPolicy {
            client_id: ClientId::parse("c", "web-1").unwrap(),
            shells: vec![wire::ShellType::Sh],
            default_shell: wire::ShellType::Sh,
            profiles: vec![],
            cwd_roots: vec![cwd.into()],
            default_cwd: cwd.into(),
            max_running: 4,
            max_queued: 4,
            closeout_reserve: 4096,
            storage_budget: 1 << 30,
            command_total: 32 << 20,
            command_streams: 11 << 20,
            free_space_floor: 0,
        },
        link: LinkConfig::default(),
        spool: SpoolLimits::default(),
        shell_paths: BTreeMap::from([(wire::ShellType::Sh as i32, "/bin/sh".into())]),
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

fn frame(rt: &mut Runtime<ModelSupervisor>, generation: u64, p: Payload) {
    let env = wire::Envelope {
        session_id: SID.into(),
        generation,
        payload: Some(p),
    };
    rt.input(Input::Frame(env.encode_to_vec()));
}

fn decoded(wire: Vec<Wire>) -> Vec<wire::Envelope> {
    wire.into_iter()
        .filter_map(|w| match w {
            Wire::Binary(b) => Some(wire::Envelope::decode(b.as_slice()).unwrap()),
            _ => None,
        })
        .collect()
}

fn connect(rt: &mut Runtime<ModelSupervisor>, generation: u64) {
    assert!(rt.take_wire().contains(&Wire::Dial));
    rt.input(Input::Opened);
    frame(
        rt,
        generation,
        Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation,
            ..Default::default()
        }),
    );
    frame(
        rt,
        generation,
        Payload::ReconcileRequest(wire::ReconcileRequest {
            round: 1,
            rows: vec![],
        }),
    );
    let mut r = wire::ReconcileResult {
        round: 1,
        ..Default::default()
    };
    r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
    frame(rt, generation, Payload::ReconcileResult(r));
}

#[test]
fn a_dispatch_runs_and_its_events_are_framed_for_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.to_str().unwrap().to_owned();
    let open = || {
        ClientStore::open(
            ClientLayout::new(dir.path().join("state")),
            Arc::new(RealFs),
            Arc::new(OsEntropy),
            ClientStoreOptions::default(),
            0,
        )
        .unwrap()
    };
    let mut rt = Runtime::new(config(&cwd), open(), ModelSupervisor::default(), 1).unwrap();
    connect(&mut rt, 1);
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText("echo hi".into())),
        ..Default::default()
    };
    let normalized = check_execution_spec(&spec).unwrap();
    let issue = "01890a5d-ac96-774b-bcce-b302099a8001";
    frame(
        &mut rt,
        1,
        Payload::Dispatch(wire::Dispatch {
            issue_uuid: issue.into(),
            generation: 1,
            revision: 1,
            request_hash: command_hash(&ClientId::parse("c", "web-1").unwrap(), &normalized)
                .0
                .to_vec(),
            spec: Some(spec),
            queue_expiry_time: None,
        }),
    );
    while rt.pump_processes(Duration::ZERO) {}
    let envs = decoded(rt.take_wire());
    assert!(
        envs.iter()
            .filter(|e| !matches!(e.payload, Some(Payload::ClientHello(_))))
            .all(|e| e.session_id == SID && e.generation == 1)
    );
    let accepted = envs
        .iter()
        .position(|e| matches!(&e.payload, Some(Payload::CommandAccepted(a)) if a.outcome == wire::AcceptOutcome::Positive as i32))
        .expect("accepted");
    let events: Vec<&wire::CommandEvent> = envs
        .iter()
        .filter_map(|e| match &e.payload {
            Some(Payload::CommandEvent(ev)) => Some(ev),
            _ => None,
        })
        .collect();
    assert_eq!(events.len(), 3, "running, output, succeeded");
    assert!(matches!(&events[1].body, Some(Body::Output(o))
        if zstd::bulk::decompress(&o.payload, 64).unwrap() == b"echo hi"));
    let first_event = envs
        .iter()
        .position(|e| matches!(e.payload, Some(Payload::CommandEvent(_))))
        .unwrap();
    assert!(accepted < first_event);
    assert_eq!(rt.supervisor().released.len(), 1);
}
