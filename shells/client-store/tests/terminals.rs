//! The terminals' records in the client store (docs/terminals.md): each
//! step read back after a reopen, the ones past their day forgotten, a
//! step out of order refused, and a power cut at every terminal commit
//! point with the real client core on top: after the restart the opening
//! record waits for the server's open again (no second holder while one
//! is recorded), the holder's record is adopted with its token, and the
//! end answers the server from the record.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use prost::Message as _;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::{
    ClientCore, ClientCoreConfig, Input, Output, TerminalLimits, TerminalPhase,
};
use rvbox_client_core::ops::{ClosedTerminal, SuperviseOp};
use rvbox_client_core::process::{Exit, HolderIdentity, TerminalEvent, TerminalProcessEvent};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_client_store::{ClientStore, crash};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::crash::NoCrash;
use rvbox_storage::fs::{CrashMode, FaultyFs};
use support::{NOW, StopAt, open, open_on, policy};

const SID: &str = "0123456789abcdef0123";
const DAY: i64 = 24 * 3600 * 1000;

fn term(n: u8) -> Uuid7 {
    Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-b302099a82{n:02x}")).unwrap()
}

fn open_req(n: u8) -> wire::PtyOpen {
    wire::PtyOpen {
        pty_session_id: term(n).to_string(),
        shell_type: wire::ShellType::Sh as i32,
        cwd: "/tmp".into(),
        env: BTreeMap::from([("TERM".to_string(), "xterm".to_string())]),
        rows: 30,
        cols: 100,
        // kept with the record, so a restarted daemon knows them
        profile_flags: vec![wire::ProfileFlag::Light as i32],
    }
}

fn holder(n: u8) -> HolderIdentity {
    HolderIdentity {
        socket: format!("/var/lib/rvbox/run/pty-{n}.sock"),
        pid: 5000 + u32::from(n),
        start_ticks: 123_456,
        boot_id: "0c2a4e4e-1d7c-4f0e-9e0a-3f7c1b2d4e5f".into(),
        token: [n ^ 0x5a; 32],
        cgroup: Some("/sys/fs/cgroup/rvbox/pty-x".into()),
    }
}

fn ended(reason: &str, at: i64) -> ClosedTerminal {
    ClosedTerminal {
        exit_result: wire::ExitResult {
            lifecycle: wire::Lifecycle::Terminated as i32,
            signal_number: Some(1),
            signal_name: "SIGHUP".into(),
            ..Default::default()
        },
        final_offset: 4321,
        reason: reason.into(),
        closed_at_ms: at,
    }
}

#[test]
fn every_terminal_step_is_read_back_after_a_reopen_and_old_records_go() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = open(dir.path());
        s.terminal_opening(&term(1), wire::ShellType::Sh, &open_req(1), NOW)
            .unwrap();
        s.terminal_opened(&term(1), &holder(1)).unwrap();
        s.terminal_opening(&term(2), wire::ShellType::Sh, &open_req(2), NOW + 1)
            .unwrap();
        s.terminal_opening(&term(3), wire::ShellType::Sh, &open_req(3), NOW + 2)
            .unwrap();
        s.terminal_opened(&term(3), &holder(3)).unwrap();
        s.terminal_closed(&term(3), &ended("closed by an operator", NOW + 5))
            .unwrap();
        // out of order: refused, naming the terminal
        let e = s.terminal_opened(&term(3), &holder(3)).unwrap_err();
        assert!(e.to_string().contains(&term(3).to_string()), "{e}");
        let e = s
            .terminal_opening(&term(1), wire::ShellType::Sh, &open_req(1), NOW)
            .unwrap_err();
        assert!(e.to_string().contains("already open or closed"), "{e}");
        assert!(s.terminal_closed(&term(9), &ended("x", NOW)).is_err());
    }
    let s = open(dir.path());
    let got = s.restore_terminals().unwrap();
    assert_eq!(got.len(), 3);
    let by: BTreeMap<Uuid7, _> = got.into_iter().map(|r| (r.terminal, r)).collect();
    let one = &by[&term(1)];
    assert_eq!(
        one.holder,
        Some(holder(1)),
        "the holder's record, token included"
    );
    assert_eq!(one.open, open_req(1));
    assert_eq!(one.resolved_shell, wire::ShellType::Sh);
    assert!(one.closed.is_none());
    let two = &by[&term(2)];
    assert!(two.holder.is_none() && two.closed.is_none(), "opening");
    assert_eq!(two.created_ms, NOW + 1);
    let three = &by[&term(3)];
    assert_eq!(three.closed, Some(ended("closed by an operator", NOW + 5)));
    assert!(three.holder.is_none(), "a closed terminal keeps no token");
    // a day later the closed and the never-opened go; the open one stays
    let mut s = s;
    assert_eq!(s.expire_terminals(NOW + 10).unwrap(), 2);
    let left: Vec<Uuid7> = s
        .restore_terminals()
        .unwrap()
        .into_iter()
        .map(|r| r.terminal)
        .collect();
    assert_eq!(left, vec![term(1)]);
}

fn config() -> ClientCoreConfig {
    ClientCoreConfig {
        policy: policy(),
        link: LinkConfig::default(),
        spool: SpoolLimits::default(),
        shell_paths: BTreeMap::from([(wire::ShellType::Sh as i32, "/bin/sh".to_string())]),
        profiles: BTreeMap::new(),
        hello: wire::ClientHello {
            client_id: "web-1".into(),
            protocol_major: 1,
            supported_minors: vec![0],
            ..Default::default()
        },
        terminals: TerminalLimits::default(),
    }
}

/// The real core over the real store; supervisor steps are recorded.
struct Daemon {
    core: ClientCore,
    store: ClientStore,
    now: u64,
    generation: u64,
    sent: Vec<Payload>,
    supervise: Vec<SuperviseOp>,
}

impl Daemon {
    fn start(store: ClientStore, generation: u64) -> Self {
        let records = store.restore_records().unwrap();
        let spool = store.restore_spool().unwrap();
        let floor = store.last_generation().unwrap();
        let terminals = store.restore_terminals().unwrap();
        let mut core = ClientCore::new(config(), records, spool, floor, 7, 0).unwrap();
        core.restore_terminals(terminals, NOW);
        let mut d = Self {
            core,
            store,
            now: 0,
            generation,
            sent: Vec::new(),
            supervise: Vec::new(),
        };
        d.run();
        d
    }

    fn input(&mut self, i: Input) {
        self.now += 1;
        self.core.handle(self.now, NOW, i);
        self.run();
    }

    fn frame(&mut self, payload: Payload) {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: self.generation,
            payload: Some(payload),
        };
        self.input(Input::Frame(env.encode_to_vec()));
    }

    fn event(&mut self, terminal: Uuid7, event: TerminalEvent) {
        self.input(Input::Terminal(TerminalProcessEvent { terminal, event }));
    }

    fn connect(&mut self) {
        self.input(Input::Opened);
        self.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: SID.into(),
            generation: self.generation,
            ..Default::default()
        }));
    }

    fn run(&mut self) {
        let policy = config().policy;
        for _ in 0..100_000 {
            let Some(o) = self.core.poll_output() else {
                return;
            };
            match o {
                Output::Send(b) | Output::SendData(b) => {
                    let env = wire::Envelope::decode(b.as_slice()).unwrap();
                    self.sent.push(env.payload.unwrap());
                }
                Output::Store(t, op) => {
                    let done = self.store.perform(&policy, &op, NOW);
                    self.core.handle(self.now, NOW, Input::Completion(t, done));
                }
                Output::Supervise(op) => self.supervise.push(op),
                _ => {}
            }
        }
        panic!("the core never settled");
    }

    fn starts(&self) -> usize {
        self.supervise
            .iter()
            .filter(|op| matches!(op, SuperviseOp::StartTerminal(_)))
            .count()
    }

    fn closed(&self) -> Vec<wire::PtyClosed> {
        self.sent
            .iter()
            .filter_map(|p| match p {
                Payload::PtyClosed(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }
}

/// Opens terminal 1 and ends it by a close, with a power cut at `point`;
/// returns the store as the restart finds it.
fn cut_at(root: &Path, fs: &Arc<FaultyFs>, point: &'static str) -> ClientStore {
    let store = open_on(root, fs.clone(), Arc::new(NoCrash));
    let mut d = Daemon::start(store, 1);
    d.store.set_crash_hook(Arc::new(StopAt::new(point)));
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        d.connect();
        d.frame(Payload::PtyOpen(open_req(1)));
        assert_eq!(d.starts(), 1);
        d.event(term(1), TerminalEvent::Started(holder(1)));
        d.event(
            term(1),
            TerminalEvent::Output {
                offset: 0,
                bytes: b"$ ".to_vec(),
                cut: 0,
            },
        );
        d.frame(Payload::PtyClose(wire::PtyClose {
            pty_session_id: term(1).to_string(),
        }));
        d.event(
            term(1),
            TerminalEvent::Exited {
                exit: Exit::Signal(1),
                final_offset: 2,
            },
        );
    }));
    assert!(crashed.is_err(), "{point} was never reached");
    let answered = d
        .sent
        .iter()
        .any(|p| matches!(p, Payload::PtyOpened(_) | Payload::PtyClosed(_)));
    if point != crash::TERMINAL_CLOSED_AFTER_COMMIT {
        assert!(
            !answered,
            "{point}: nothing is answered before its step commits"
        );
    }
    let Daemon { store, .. } = d;
    store.close_as_crashed();
    fs.crash(CrashMode::LoseUnsynced).unwrap();
    open_on(root, fs.clone(), Arc::new(NoCrash))
}

#[test]
fn a_power_cut_at_every_terminal_point_keeps_the_step_and_the_restart_goes_on_from_it() {
    assert_eq!(crash::TERMINAL_POINTS.len(), 3);
    for point in crash::TERMINAL_POINTS {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("state");
        let fs = Arc::new(FaultyFs::new());
        let store = cut_at(&root, &fs, point);
        let mut d = Daemon::start(store, 2);
        d.connect();
        match *point {
            crash::TERMINAL_OPENING_AFTER_COMMIT => {
                // no holder was recorded: none is adopted; the server's
                // open (it still has the terminal as opening) starts one
                assert!(d.supervise.is_empty(), "{point}: {:?}", d.supervise);
                assert_eq!(
                    d.core.terminal_phase(&term(1)),
                    Some(TerminalPhase::Opening)
                );
                d.frame(Payload::PtyOpen(open_req(1)));
                assert_eq!(d.starts(), 1, "{point}");
                d.event(term(1), TerminalEvent::Started(holder(1)));
                let opened = d
                    .sent
                    .iter()
                    .any(|p| matches!(p, Payload::PtyOpened(o) if o.outcome == wire::AcceptOutcome::Positive as i32));
                assert!(opened, "{point}");
            }
            crash::TERMINAL_OPENED_AFTER_COMMIT => {
                // the holder's record is durable: it is adopted, never
                // started again
                assert_eq!(
                    d.supervise,
                    vec![SuperviseOp::AdoptTerminal {
                        terminal: term(1),
                        holder: Box::new(holder(1)),
                    }],
                    "{point}"
                );
                d.frame(Payload::PtyOpen(open_req(1)));
                assert_eq!(d.starts(), 0, "{point}: no second holder");
                d.event(term(1), TerminalEvent::Adopted);
                assert_eq!(d.core.terminal_phase(&term(1)), Some(TerminalPhase::Open));
            }
            _ => {
                // the end is durable: the server's questions are answered
                // from it, and nothing is adopted
                assert!(d.supervise.is_empty(), "{point}: {:?}", d.supervise);
                d.frame(Payload::PtyAttach(wire::PtyAttach {
                    pty_session_id: term(1).to_string(),
                    from_offset: 0,
                }));
                let c = d.closed();
                assert_eq!(c.len(), 1, "{point}");
                assert_eq!(c[0].reason, "closed by an operator");
                assert_eq!(c[0].final_offset, 2);
                assert_eq!(
                    c[0].exit_result.as_ref().unwrap().lifecycle,
                    wire::Lifecycle::Terminated as i32
                );
            }
        }
    }
}

#[test]
fn a_closed_record_is_forgotten_a_day_after_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    s.terminal_opening(&term(1), wire::ShellType::Sh, &open_req(1), NOW - 2 * DAY)
        .unwrap();
    s.terminal_opened(&term(1), &holder(1)).unwrap();
    s.terminal_closed(&term(1), &ended("shell exited", NOW - DAY - 1))
        .unwrap();
    s.terminal_opening(&term(2), wire::ShellType::Sh, &open_req(2), NOW - 2 * DAY)
        .unwrap();
    s.terminal_opened(&term(2), &holder(2)).unwrap();
    s.terminal_closed(&term(2), &ended("shell exited", NOW - DAY + 60_000))
        .unwrap();
    // the core forgets the first at start and the store follows
    let mut d = Daemon::start(s, 1);
    assert_eq!(d.core.terminal_phase(&term(1)), None);
    assert_eq!(d.core.terminal_phase(&term(2)), Some(TerminalPhase::Closed));
    d.connect();
    d.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 0,
    }));
    assert_eq!(d.closed()[0].reason, "unknown terminal on this client");
    let left: Vec<Uuid7> = d
        .store
        .restore_terminals()
        .unwrap()
        .into_iter()
        .map(|r| r.terminal)
        .collect();
    assert_eq!(left, vec![term(2)], "the store forgot it too");
}
