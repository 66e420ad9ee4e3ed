//! The client's side of the terminals (docs/terminals.md), driven through
//! a model store, a model supervisor and a scripted server: an open
//! answered only after its holder's record is durable, the checks and the
//! bound, output only after an attach and within the window, a cut where
//! the ring lost bytes, input relayed once and acknowledged cumulatively,
//! the close reported after the output before it, the closed record's
//! answers for a day, unknown terminals, reconnects and adoption.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, VecDeque};

use prost::Message as _;
use rvbox_client_core::accept::AcceptPolicy;
use rvbox_client_core::link::LinkConfig;
use rvbox_client_core::machine::terminals::{
    CLOSED_TERMINAL_KEEP_MS, PTY_OUTPUT_PIECE_BYTES, PTY_WINDOW_BYTES, REASON_EXITED, REASON_GONE,
    REASON_HOST_RESTARTED, REASON_OPERATOR, REASON_UNKNOWN,
};
use rvbox_client_core::machine::{
    ClientCore, ClientCoreConfig, Input, Output, RestoredTerminal, TerminalLimits, TerminalPhase,
};
use rvbox_client_core::ops::{ClientCompletion, ClientOp, SuperviseOp, Token};
use rvbox_client_core::process::{
    Exit, HolderIdentity, HolderLoss, IoLimit, LaunchFailure, ResourceLimits, TerminalEvent,
    TerminalProcessEvent,
};
use rvbox_client_core::spool::SpoolLimits;
use rvbox_domain::ids::{ClientId, Uuid7};
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;

const SID: &str = "0123456789abcdef0123";
const GEN: u64 = 3;
const WALL: i64 = 1_800_000_000_000;
const KIB: usize = 1024;

fn config(max_open: u32) -> ClientCoreConfig {
    ClientCoreConfig {
        policy: AcceptPolicy {
            client_id: ClientId::parse("c", "web-1").unwrap(),
            shells: vec![wire::ShellType::Sh, wire::ShellType::Bash],
            default_shell: wire::ShellType::Sh,
            // MEM_HIGH and the others are not enforceable on this host
            profiles: vec![wire::ProfileFlag::CpuLow, wire::ProfileFlag::MemLow],
            cwd_roots: vec!["/tmp".into(), "/srv".into()],
            default_cwd: "/tmp".into(),
            max_running: 2,
            max_queued: 4,
            closeout_reserve: 1024,
            storage_budget: 1 << 30,
            command_total: 32 << 20,
            command_streams: 11 << 20,
            free_space_floor: 64 << 20,
        },
        link: LinkConfig::default(),
        spool: SpoolLimits::default(),
        // bash is allowed by the policy but has no executable here
        shell_paths: BTreeMap::from([(wire::ShellType::Sh as i32, "/bin/sh".to_string())]),
        profiles: BTreeMap::from([
            (wire::ProfileFlag::CpuLow as i32, cpu_low()),
            (wire::ProfileFlag::MemLow as i32, mem_low()),
        ]),
        hello: wire::ClientHello {
            client_id: "web-1".into(),
            protocol_major: 1,
            supported_minors: vec![0],
            ..Default::default()
        },
        terminals: TerminalLimits { max_open },
    }
}

/// The compiled limits of profile `cpu_low` here.
fn cpu_low() -> ResourceLimits {
    ResourceLimits {
        cpu_max: Some((25_000, 100_000)),
        cpu_weight: Some(50),
        ..ResourceLimits::default()
    }
}

/// The compiled limits of profile `mem_low` here.
fn mem_low() -> ResourceLimits {
    ResourceLimits {
        memory_max: Some(256 << 20),
        memory_high: Some(192 << 20),
        pids_max: Some(64),
        io_max: vec![IoLimit {
            major: 8,
            minor: 0,
            read_bps: Some(1 << 20),
            write_bps: None,
            read_iops: None,
            write_iops: Some(100),
        }],
        ..ResourceLimits::default()
    }
}

fn term(n: u8) -> Uuid7 {
    Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-b302099a81{n:02x}")).unwrap()
}

fn open_req(n: u8) -> wire::PtyOpen {
    wire::PtyOpen {
        pty_session_id: term(n).to_string(),
        shell_type: wire::ShellType::Unspecified as i32,
        cwd: String::new(),
        env: BTreeMap::from([("LANG".to_string(), "C.UTF-8".to_string())]),
        rows: 24,
        cols: 80,
        profile_flags: Vec::new(),
    }
}

fn holder(n: u8) -> HolderIdentity {
    HolderIdentity {
        socket: format!("/run/rvbox/pty-{n}.sock"),
        pid: 4000 + u32::from(n),
        start_ticks: 77,
        boot_id: "boot-a".into(),
        token: [n; 32],
        cgroup: None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Control,
    Data,
}

/// The core over a store that completes every step at once (unless told
/// to hold or fail a kind of step) and a supervisor that records what it
/// is asked.
struct World {
    core: ClientCore,
    now: u64,
    wall: i64,
    sent: Vec<(Lane, Payload)>,
    stores: Vec<ClientOp>,
    supervise: Vec<SuperviseOp>,
    fail: Vec<&'static str>,
    hold: Vec<&'static str>,
    held: VecDeque<(Token, ClientOp)>,
    closes: Vec<u16>,
}

fn op_name(op: &ClientOp) -> &'static str {
    match op {
        ClientOp::TerminalOpening { .. } => "opening",
        ClientOp::TerminalOpened { .. } => "opened",
        ClientOp::TerminalClosed { .. } => "closed",
        ClientOp::TerminalsExpire { .. } => "expire",
        _ => "other",
    }
}

impl World {
    fn new(max_open: u32) -> Self {
        let core = ClientCore::new(config(max_open), vec![], vec![], GEN - 1, 7, 0).unwrap();
        let mut w = Self {
            core,
            now: 0,
            wall: WALL,
            sent: Vec::new(),
            stores: Vec::new(),
            supervise: Vec::new(),
            fail: Vec::new(),
            hold: Vec::new(),
            held: VecDeque::new(),
            closes: Vec::new(),
        };
        w.run();
        w
    }

    fn input(&mut self, i: Input) {
        self.now += 1;
        self.core.handle(self.now, self.wall, i);
        self.run();
    }

    fn frame(&mut self, payload: Payload) {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: GEN,
            payload: Some(payload),
        };
        self.input(Input::Frame(env.encode_to_vec()));
    }

    fn event(&mut self, terminal: Uuid7, event: TerminalEvent) {
        self.input(Input::Terminal(TerminalProcessEvent { terminal, event }));
    }

    /// Connects and welcomes; `reconcile` finishes the round too.
    fn connect_with(&mut self, generation: u64, reconcile: bool) {
        self.input(Input::Opened);
        let env = wire::Envelope {
            session_id: SID.into(),
            generation,
            payload: Some(Payload::ServerWelcome(wire::ServerWelcome {
                protocol_major: 1,
                negotiated_minor: 0,
                session_id: SID.into(),
                generation,
                server_id: "srv".into(),
                ..Default::default()
            })),
        };
        self.input(Input::Frame(env.encode_to_vec()));
        if reconcile {
            let mut r = wire::ReconcileResult {
                round: 1,
                ..Default::default()
            };
            r.result_digest = rvbox_reconcile::result_digest(&r).to_vec();
            for p in [
                Payload::ReconcileRequest(wire::ReconcileRequest {
                    round: 1,
                    rows: vec![],
                }),
                Payload::ReconcileResult(r),
            ] {
                let env = wire::Envelope {
                    session_id: SID.into(),
                    generation,
                    payload: Some(p),
                };
                self.input(Input::Frame(env.encode_to_vec()));
            }
        }
    }

    fn connect(&mut self) {
        self.connect_with(GEN, true);
        self.sent.clear();
    }

    /// Fires the core's timer at `now`.
    fn tick(&mut self, now: u64) {
        self.now = now;
        self.core.handle_timeout(now, self.wall);
        self.run();
    }

    fn run(&mut self) {
        for _ in 0..1_000_000 {
            let Some(o) = self.core.poll_output() else {
                return;
            };
            match o {
                Output::Dial | Output::SendPing | Output::SendPong | Output::SendEvents { .. } => {}
                Output::Close(c) => self.closes.push(c),
                Output::Send(b) => {
                    let env = wire::Envelope::decode(b.as_slice()).unwrap();
                    self.sent.push((Lane::Control, env.payload.unwrap()));
                }
                Output::SendData(b) => {
                    let env = wire::Envelope::decode(b.as_slice()).unwrap();
                    self.sent.push((Lane::Data, env.payload.unwrap()));
                }
                Output::Store(token, op) => {
                    let name = op_name(&op);
                    if self.hold.contains(&name) {
                        self.held.push_back((token, op));
                        continue;
                    }
                    self.complete(token, op);
                }
                Output::Supervise(op) => self.supervise.push(op),
            }
        }
        panic!("the core never settled");
    }

    fn complete(&mut self, token: Token, op: ClientOp) {
        let name = op_name(&op);
        let result = if self.fail.contains(&name) {
            ClientCompletion::Failed("disk full (test)".into())
        } else if let ClientOp::Tombstones { .. } = op {
            ClientCompletion::Tombstones(vec![])
        } else {
            ClientCompletion::Done
        };
        if name != "other" {
            self.stores.push(op);
        }
        self.core
            .handle(self.now, self.wall, Input::Completion(token, result));
    }

    fn release_held(&mut self) {
        while let Some((t, op)) = self.held.pop_front() {
            self.complete(t, op);
        }
        self.run();
    }

    fn take_sent(&mut self) -> Vec<(Lane, Payload)> {
        std::mem::take(&mut self.sent)
    }

    fn take_supervise(&mut self) -> Vec<SuperviseOp> {
        std::mem::take(&mut self.supervise)
    }

    /// Opens terminal `n` through its holder's start; returns what was
    /// sent for it.
    fn open(&mut self, n: u8) -> Vec<(Lane, Payload)> {
        self.frame(Payload::PtyOpen(open_req(n)));
        let started = self
            .take_supervise()
            .into_iter()
            .any(|op| matches!(op, SuperviseOp::StartTerminal(s) if s.terminal == term(n)));
        assert!(started, "the holder is asked for");
        self.event(term(n), TerminalEvent::Started(holder(n)));
        self.take_supervise();
        self.take_sent()
    }

    /// Output of `len` bytes from the holder at `offset`, in its 16 KiB
    /// records.
    fn output(&mut self, n: u8, offset: u64, bytes: &[u8]) {
        let mut at = offset;
        for c in bytes.chunks(16 * KIB) {
            self.event(
                term(n),
                TerminalEvent::Output {
                    offset: at,
                    bytes: c.to_vec(),
                    cut: 0,
                },
            );
            at += c.len() as u64;
        }
    }
}

fn outputs(sent: &[(Lane, Payload)]) -> Vec<wire::PtyOutput> {
    sent.iter()
        .filter_map(|(lane, p)| match p {
            Payload::PtyOutput(o) => {
                assert_eq!(*lane, Lane::Data, "output goes on the data lane");
                Some(o.clone())
            }
            _ => None,
        })
        .collect()
}

fn closed(sent: &[(Lane, Payload)]) -> Vec<wire::PtyClosed> {
    sent.iter()
        .filter_map(|(lane, p)| match p {
            Payload::PtyClosed(c) => {
                assert_eq!(*lane, Lane::Data);
                Some(c.clone())
            }
            _ => None,
        })
        .collect()
}

fn opened(sent: &[(Lane, Payload)]) -> Vec<wire::PtyOpened> {
    sent.iter()
        .filter_map(|(lane, p)| match p {
            Payload::PtyOpened(o) => {
                assert_eq!(*lane, Lane::Data);
                Some(o.clone())
            }
            _ => None,
        })
        .collect()
}

fn acks(sent: &[(Lane, Payload)]) -> Vec<u64> {
    sent.iter()
        .filter_map(|(lane, p)| match p {
            Payload::PtyInputAck(a) => {
                assert_eq!(*lane, Lane::Control, "input acks go on the control lane");
                Some(a.input_seq)
            }
            _ => None,
        })
        .collect()
}

/// The bytes of contiguous outputs, checked to follow each other from
/// `from` and to be each at most 64 KiB.
fn stream_bytes(outs: &[wire::PtyOutput], from: u64) -> Vec<u8> {
    let mut at = from;
    let mut all = Vec::new();
    for o in outs {
        assert!(!o.data.is_empty() && o.data.len() <= PTY_OUTPUT_PIECE_BYTES);
        assert_eq!(o.offset, at, "outputs follow each other");
        at += o.data.len() as u64;
        all.extend_from_slice(&o.data);
    }
    all
}

/// `a == b`, reported by length and first difference (never the bytes).
#[track_caller]
fn same(a: &[u8], b: &[u8], what: &str) {
    if a != b {
        let at = a.iter().zip(b).position(|(x, y)| x != y);
        panic!(
            "{what}: {} bytes against {} expected, first difference at {at:?}",
            a.len(),
            b.len()
        );
    }
}

/// The `PtyClosed` of `sent` comes after its last `PtyOutput`.
fn assert_end_follows_output(sent: &[(Lane, Payload)]) {
    let last_output = sent
        .iter()
        .rposition(|(_, p)| matches!(p, Payload::PtyOutput(_)))
        .unwrap();
    let close_at = sent
        .iter()
        .position(|(_, p)| matches!(p, Payload::PtyClosed(_)))
        .unwrap();
    assert!(close_at > last_output, "the end follows the output");
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| b'a' + ((i / 7 + usize::from(seed)) % 26) as u8)
        .collect()
}

#[test]
fn an_open_is_answered_only_after_its_holder_record_is_durable_and_a_repeat_answers_the_same() {
    let mut w = World::new(16);
    w.connect();
    w.hold = vec!["opening", "opened"];
    w.frame(Payload::PtyOpen(open_req(1)));
    assert!(
        w.take_supervise().is_empty(),
        "no holder before the opening record"
    );
    assert_eq!(
        w.core.terminal_phase(&term(1)),
        Some(TerminalPhase::Recording)
    );
    w.hold.clear();
    w.hold.push("opened");
    w.release_held();
    let ops = w.take_supervise();
    let [SuperviseOp::StartTerminal(spec)] = ops.as_slice() else {
        panic!("one start: {ops:?}")
    };
    assert_eq!(spec.shell, wire::ShellType::Sh);
    assert_eq!(spec.shell_path, "/bin/sh");
    assert_eq!(spec.cwd, "/tmp");
    assert_eq!((spec.rows, spec.cols), (24, 80));
    assert_eq!(spec.env, vec![("LANG".to_string(), "C.UTF-8".to_string())]);
    // a repeat while it starts: no answer yet, no second holder
    w.frame(Payload::PtyOpen(open_req(1)));
    assert!(w.take_sent().is_empty() && w.take_supervise().is_empty());
    w.event(term(1), TerminalEvent::Started(holder(1)));
    assert!(
        opened(&w.take_sent()).is_empty(),
        "not before the holder record"
    );
    assert_eq!(
        w.take_supervise(),
        vec![SuperviseOp::AttachTerminal {
            terminal: term(1),
            from: 0
        }],
        "the holder's output is kept from the start"
    );
    w.release_held();
    let stored: Vec<&str> = w.stores.iter().map(op_name).collect();
    assert_eq!(stored, ["opening", "opened"]);
    let ClientOp::TerminalOpened { holder: h, .. } = &w.stores[1] else {
        panic!()
    };
    assert_eq!(**h, holder(1), "the holder's record, token included");
    let answers = opened(&w.take_sent());
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].outcome, wire::AcceptOutcome::Positive as i32);
    assert_eq!(answers[0].resolved_shell, wire::ShellType::Sh as i32);
    assert!(answers[0].error.is_none());
    // a repeat of an open terminal: the same answer, no second holder
    w.frame(Payload::PtyOpen(open_req(1)));
    assert_eq!(opened(&w.take_sent()), answers);
    assert!(w.take_supervise().is_empty());
    assert_eq!(w.core.terminal_stats().opened, 1);
}

#[test]
fn opens_that_break_a_rule_are_refused_permanently_naming_the_field() {
    let mut w = World::new(16);
    w.connect();
    type Case = (Box<dyn Fn(&mut wire::PtyOpen)>, &'static str, &'static str);
    let cases: Vec<Case> = vec![
        (
            Box::new(|p| p.shell_type = 99),
            "pty_open.shell_type",
            "unknown shell type",
        ),
        (
            Box::new(|p| p.shell_type = wire::ShellType::Bash as i32),
            "pty_open.shell_type",
            "not configured",
        ),
        (
            Box::new(|p| p.shell_type = wire::ShellType::Powershell as i32),
            "pty_open.shell_type",
            "not configured",
        ),
        (
            Box::new(|p| p.cwd = "tmp/x".into()),
            "pty_open.cwd",
            "absolute",
        ),
        (
            Box::new(|p| p.cwd = "/etc".into()),
            "pty_open.cwd",
            "allowed",
        ),
        (
            Box::new(|p| p.cwd = "/tmp/../etc".into()),
            "pty_open.cwd",
            "allowed",
        ),
        (
            Box::new(|p| p.cwd = format!("/tmp/{}", "d".repeat(4096))),
            "pty_open.cwd",
            "4096",
        ),
        (
            Box::new(|p| {
                p.env.insert("A=B".into(), "x".into());
            }),
            "pty_open.env",
            "key",
        ),
        (
            Box::new(|p| {
                p.env.insert("SECRET".into(), "p\0w".into());
            }),
            "pty_open.env",
            "NUL",
        ),
        (
            Box::new(|p| p.profile_flags = vec![wire::ProfileFlag::MemHigh as i32]),
            "pty_open.profile_flags",
            "PROFILE_FLAG_MEM_HIGH cannot be enforced on this host",
        ),
        (
            Box::new(|p| p.profile_flags = vec![99]),
            "pty_open.profile_flags",
            "unknown profile flag value 99",
        ),
        (
            Box::new(|p| {
                p.profile_flags = vec![
                    wire::ProfileFlag::CpuLow as i32,
                    wire::ProfileFlag::MemLow as i32,
                    wire::ProfileFlag::MemLow as i32,
                    wire::ProfileFlag::CpuHigh as i32,
                ];
            }),
            "pty_open.profile_flags",
            "same dimension",
        ),
        (Box::new(|p| p.rows = 0), "pty_open.rows", "1..=1000"),
        (Box::new(|p| p.cols = 1001), "pty_open.cols", "1..=1000"),
        (
            Box::new(|p| p.pty_session_id = "not-a-uuid".into()),
            "pty_open.pty_session_id",
            "UUIDv7",
        ),
    ];
    for (i, (break_it, field, says)) in cases.iter().enumerate() {
        let mut p = open_req(u8::try_from(i).unwrap() + 10);
        break_it(&mut p);
        w.frame(Payload::PtyOpen(p.clone()));
        let answers = opened(&w.take_sent());
        assert_eq!(answers.len(), 1, "case {field}");
        let a = &answers[0];
        assert_eq!(a.pty_session_id, p.pty_session_id);
        assert_eq!(a.outcome, wire::AcceptOutcome::Permanent as i32, "{field}");
        assert_eq!(a.resolved_shell, wire::ShellType::Unspecified as i32);
        let e = a.error.as_ref().unwrap();
        assert_eq!(e.field, *field);
        assert!(e.reason.contains(says), "{field}: {}", e.reason);
        // the secret value is never echoed
        assert!(!e.reason.contains("p\0w"));
    }
    assert!(w.take_supervise().is_empty(), "nothing started");
    assert!(w.stores.is_empty(), "nothing recorded");
    assert_eq!(w.core.open_terminals(), 0);
}

#[test]
fn an_open_with_profiles_starts_its_holder_under_their_limits() {
    let mut w = World::new(16);
    w.connect();
    // none asked: no restriction
    w.frame(Payload::PtyOpen(open_req(1)));
    let ops = w.take_supervise();
    let [SuperviseOp::StartTerminal(plain)] = ops.as_slice() else {
        panic!("one start: {ops:?}")
    };
    assert!(plain.limits.is_empty(), "{:?}", plain.limits);
    w.event(term(1), TerminalEvent::Started(holder(1)));
    w.take_supervise();
    w.take_sent();
    // two profiles of this host: the controls of both
    let mut p = open_req(2);
    p.profile_flags = vec![
        wire::ProfileFlag::CpuLow as i32,
        wire::ProfileFlag::MemLow as i32,
    ];
    w.frame(Payload::PtyOpen(p.clone()));
    let ops = w.take_supervise();
    let [SuperviseOp::StartTerminal(spec)] = ops.as_slice() else {
        panic!("one start: {ops:?}")
    };
    assert_eq!(spec.terminal, term(2));
    let want = ResourceLimits {
        cpu_max: cpu_low().cpu_max,
        cpu_weight: cpu_low().cpu_weight,
        ..mem_low()
    };
    assert_eq!(spec.limits, want);
    // the opening record keeps the profiles (a restart starts it alike)
    let kept = w.stores.iter().any(|op| {
        matches!(op, ClientOp::TerminalOpening { terminal, open, .. }
            if *terminal == term(2) && open.profile_flags == p.profile_flags)
    });
    assert!(kept, "{:?}", w.stores);
    w.event(term(2), TerminalEvent::Started(holder(2)));
    w.take_supervise();
    let answers = opened(&w.take_sent());
    let [a] = answers.as_slice() else {
        panic!("one answer: {answers:?}")
    };
    assert_eq!(a.outcome, wire::AcceptOutcome::Positive as i32, "{a:?}");
    // one this host cannot enforce: PERMANENT UNSUPPORTED, nothing started
    let mut p = open_req(3);
    p.profile_flags = vec![
        wire::ProfileFlag::CpuLow as i32,
        wire::ProfileFlag::MemHigh as i32,
    ];
    w.frame(Payload::PtyOpen(p));
    let answers = opened(&w.take_sent());
    let [a] = answers.as_slice() else {
        panic!("one answer: {answers:?}")
    };
    assert_eq!(a.outcome, wire::AcceptOutcome::Permanent as i32);
    let e = a.error.as_ref().unwrap();
    assert_eq!(e.code, wire::ErrorCode::Unsupported as i32);
    assert_eq!(e.field, "pty_open.profile_flags");
    assert!(e.reason.contains("PROFILE_FLAG_MEM_HIGH"), "{}", e.reason);
    assert!(w.take_supervise().is_empty(), "no holder for it");
    assert_eq!(w.core.terminal_phase(&term(3)), None);
    assert_eq!(w.core.open_terminals(), 2);
}

#[test]
fn an_open_past_max_open_is_transient_and_names_the_limit() {
    let mut w = World::new(2);
    w.connect();
    w.open(1);
    w.open(2);
    w.frame(Payload::PtyOpen(open_req(3)));
    let a = opened(&w.take_sent());
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].outcome, wire::AcceptOutcome::Transient as i32);
    let e = a[0].error.as_ref().unwrap();
    assert_eq!(e.code, wire::ErrorCode::CapacityExhausted as i32);
    assert_eq!(e.retry_class, wire::RetryClass::Transient as i32);
    assert!(e.reason.contains("terminals.max_open (2)"), "{}", e.reason);
    assert!(w.take_supervise().is_empty());
    // a closed one gives its slot back
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 0,
    }));
    w.event(
        term(1),
        TerminalEvent::Exited {
            exit: Exit::Code(0),
            final_offset: 0,
        },
    );
    assert_eq!(w.core.open_terminals(), 1);
    w.take_sent();
    w.open(3);
    assert_eq!(w.core.terminal_phase(&term(3)), Some(TerminalPhase::Open));
}

#[test]
fn a_holder_that_cannot_start_is_answered_with_its_reason_and_never_started_twice() {
    let mut w = World::new(16);
    w.connect();
    w.frame(Payload::PtyOpen(open_req(1)));
    w.take_supervise();
    w.event(
        term(1),
        TerminalEvent::Failed(LaunchFailure::Transient(
            "fork: resource temporarily unavailable".into(),
        )),
    );
    let sent = w.take_sent();
    let a = opened(&sent);
    assert_eq!(a[0].outcome, wire::AcceptOutcome::Transient as i32);
    assert!(
        a[0].error
            .as_ref()
            .unwrap()
            .reason
            .contains("fork: resource")
    );
    assert_eq!(w.core.terminal_phase(&term(1)), Some(TerminalPhase::Closed));
    // its record answers a repeat: no second start
    w.frame(Payload::PtyOpen(open_req(1)));
    let c = closed(&w.take_sent());
    assert_eq!(c.len(), 1);
    assert_eq!(
        c[0].exit_result.as_ref().unwrap().lifecycle,
        wire::Lifecycle::Rejected as i32
    );
    assert!(w.take_supervise().is_empty());
    // a store that cannot record the opening: transient, nothing started
    w.fail = vec!["opening"];
    w.frame(Payload::PtyOpen(open_req(2)));
    let a = opened(&w.take_sent());
    assert_eq!(a[0].outcome, wire::AcceptOutcome::Transient as i32);
    assert!(a[0].error.as_ref().unwrap().reason.contains("disk full"));
    assert!(w.take_supervise().is_empty());
    assert_eq!(w.core.terminal_phase(&term(2)), None);
    // a holder whose record cannot be made durable is hung up
    w.fail = vec!["opened"];
    w.frame(Payload::PtyOpen(open_req(3)));
    w.take_supervise();
    w.event(term(3), TerminalEvent::Started(holder(3)));
    let a = opened(&w.take_sent());
    assert_eq!(a[0].outcome, wire::AcceptOutcome::Transient as i32);
    assert!(
        w.take_supervise()
            .contains(&SuperviseOp::CloseTerminal(term(3)))
    );
}

#[test]
fn nothing_streams_before_an_attach_then_pieces_within_the_window_resume_on_acks() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    let data = pattern(1536 * KIB, 1);
    w.output(1, 0, &data[..700 * KIB]);
    assert!(
        outputs(&w.take_sent()).is_empty(),
        "no output before the server's attach"
    );
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 0,
    }));
    let first = outputs(&w.take_sent());
    same(&stream_bytes(&first, 0), &data[..700 * KIB], "the stream");
    assert!(first.iter().all(|o| o.cut.is_none()));
    // live output runs into the window and stops there
    w.output(1, 700 * KIB as u64, &data[700 * KIB..]);
    let second = outputs(&w.take_sent());
    let window = usize::try_from(PTY_WINDOW_BYTES).unwrap();
    same(
        &stream_bytes(&second, 700 * KIB as u64),
        &data[700 * KIB..window],
        "exactly the window is in flight",
    );
    assert_eq!(w.core.terminal_stats().window_pauses, 1);
    // an acknowledgement past what was streamed opens nothing
    w.frame(Payload::PtyOutputAck(wire::PtyOutputAck {
        pty_session_id: term(1).to_string(),
        offset: 5 << 20,
    }));
    assert!(outputs(&w.take_sent()).is_empty());
    assert_eq!(w.core.terminal_stats().stray_acks, 1);
    // a partial ack opens as much room as it acknowledged
    w.frame(Payload::PtyOutputAck(wire::PtyOutputAck {
        pty_session_id: term(1).to_string(),
        offset: 100 * KIB as u64,
    }));
    let third = outputs(&w.take_sent());
    same(
        &stream_bytes(&third, PTY_WINDOW_BYTES),
        &data[window..window + 100 * KIB],
        "the stream",
    );
    w.frame(Payload::PtyOutputAck(wire::PtyOutputAck {
        pty_session_id: term(1).to_string(),
        offset: PTY_WINDOW_BYTES,
    }));
    let rest = outputs(&w.take_sent());
    same(
        &stream_bytes(&rest, PTY_WINDOW_BYTES + 100 * KIB as u64),
        &data[window + 100 * KIB..],
        "the rest, byte-exact",
    );
}

#[test]
fn an_attach_from_an_offset_that_left_the_ring_gets_the_whole_ring_and_a_cut() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    let data = pattern(1536 * KIB, 2);
    w.output(1, 0, &data);
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 100,
    }));
    let outs = outputs(&w.take_sent());
    let first = &outs[0];
    let cut = first.cut.unwrap();
    assert_eq!(cut.requested_offset, 100);
    assert_eq!(cut.ring_start_offset, first.offset);
    assert_eq!(
        first.offset,
        512 * KIB as u64,
        "the ring keeps the last 1 MiB"
    );
    assert!(
        outs[1..].iter().all(|o| o.cut.is_none()),
        "only on the first piece"
    );
    same(
        &stream_bytes(&outs, first.offset),
        &data[512 * KIB..],
        "the stream",
    );
    assert_eq!(w.core.terminal_stats().output_cuts, 1);
    // an exact attach from inside the ring: no cut
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 1_500_000,
    }));
    let outs = outputs(&w.take_sent());
    assert!(outs[0].cut.is_none());
    same(
        &stream_bytes(&outs, 1_500_000),
        &data[1_500_000..],
        "the stream",
    );
}

#[test]
fn input_is_relayed_once_and_acknowledged_cumulatively_on_the_control_lane() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    w.take_supervise();
    let input = |seq: u64, data: &[u8]| {
        Payload::PtyInput(wire::PtyInput {
            pty_session_id: term(1).to_string(),
            input_seq: seq,
            data: data.to_vec(),
        })
    };
    w.frame(input(1, b"ls"));
    w.frame(input(2, b"\r"));
    assert_eq!(
        w.take_supervise(),
        vec![
            SuperviseOp::TerminalInput {
                terminal: term(1),
                seq: 1,
                bytes: b"ls".to_vec()
            },
            SuperviseOp::TerminalInput {
                terminal: term(1),
                seq: 2,
                bytes: b"\r".to_vec()
            },
        ]
    );
    assert!(
        acks(&w.take_sent()).is_empty(),
        "not before the holder wrote it"
    );
    w.event(term(1), TerminalEvent::InputAcked { seq: 2 });
    assert_eq!(acks(&w.take_sent()), vec![2]);
    // a repeat after a reconnect: acknowledged again, not relayed
    w.frame(input(1, b"ls"));
    w.frame(input(2, b"\r"));
    assert_eq!(acks(&w.take_sent()), vec![2, 2]);
    assert!(w.take_supervise().is_empty(), "never written twice");
    assert_eq!(w.core.terminal_input_acked(&term(1)), Some(2));
    // an old acknowledgement never moves it back
    w.event(term(1), TerminalEvent::InputAcked { seq: 1 });
    assert_eq!(acks(&w.take_sent()), vec![2]);
    // a frame out of the wire's bounds closes the session
    w.frame(input(3, &[b'x'; 4097]));
    assert_eq!(w.closes.len(), 1, "a protocol error");
}

#[test]
fn input_and_a_resize_before_the_holder_starts_wait_for_it() {
    let mut w = World::new(16);
    w.connect();
    w.hold = vec!["opening"];
    w.frame(Payload::PtyOpen(open_req(1)));
    w.frame(Payload::PtyInput(wire::PtyInput {
        pty_session_id: term(1).to_string(),
        input_seq: 1,
        data: b"x".to_vec(),
    }));
    w.frame(Payload::PtyResize(wire::PtyResize {
        pty_session_id: term(1).to_string(),
        rows: 50,
        cols: 132,
    }));
    assert!(w.take_supervise().is_empty());
    w.hold.clear();
    w.release_held();
    let ops = w.take_supervise();
    let SuperviseOp::StartTerminal(spec) = &ops[0] else {
        panic!("{ops:?}")
    };
    assert_eq!((spec.rows, spec.cols), (50, 132), "the size asked last");
    assert_eq!(
        ops[1],
        SuperviseOp::TerminalInput {
            terminal: term(1),
            seq: 1,
            bytes: b"x".to_vec()
        }
    );
}

#[test]
fn a_close_hangs_up_and_the_end_is_reported_after_the_output_before_it() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 0,
    }));
    let data = pattern(1200 * KIB, 3);
    w.output(1, 0, &data);
    let streamed = outputs(&w.take_sent());
    w.take_supervise();
    w.frame(Payload::PtyClose(wire::PtyClose {
        pty_session_id: term(1).to_string(),
    }));
    assert_eq!(
        w.take_supervise(),
        vec![SuperviseOp::CloseTerminal(term(1))]
    );
    // asked again: nothing more
    w.frame(Payload::PtyClose(wire::PtyClose {
        pty_session_id: term(1).to_string(),
    }));
    assert!(w.take_supervise().is_empty());
    w.hold = vec!["closed"];
    w.event(
        term(1),
        TerminalEvent::Exited {
            exit: Exit::Signal(1),
            final_offset: data.len() as u64,
        },
    );
    assert!(
        closed(&w.take_sent()).is_empty(),
        "not before the record is durable"
    );
    w.hold.clear();
    w.release_held();
    assert_eq!(w.core.terminal_phase(&term(1)), Some(TerminalPhase::Closed));
    assert!(
        closed(&w.take_sent()).is_empty(),
        "output before the end is still in the window"
    );
    w.frame(Payload::PtyOutputAck(wire::PtyOutputAck {
        pty_session_id: term(1).to_string(),
        offset: PTY_WINDOW_BYTES,
    }));
    let sent = w.take_sent();
    let tail = outputs(&sent);
    let mut all = stream_bytes(&streamed, 0);
    all.extend(stream_bytes(&tail, PTY_WINDOW_BYTES));
    same(&all, &data, "every byte before the end, once");
    let c = closed(&sent);
    assert_eq!(c.len(), 1);
    assert_end_follows_output(&sent);
    assert_eq!(c[0].reason, REASON_OPERATOR);
    assert_eq!(c[0].final_offset, data.len() as u64);
    let exit = c[0].exit_result.as_ref().unwrap();
    assert_eq!(exit.lifecycle, wire::Lifecycle::Terminated as i32);
    assert_eq!(exit.signal_number, Some(1));
    assert_eq!(exit.signal_name, "SIGHUP");
    let ClientOp::TerminalClosed { closed: rec, .. } = w.stores.last().unwrap() else {
        panic!()
    };
    assert_eq!(rec.final_offset, data.len() as u64);
    assert_eq!(rec.closed_at_ms, WALL);
}

#[test]
fn an_end_between_connections_waits_for_the_attach_and_the_output_before_it() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    let id = term(1).to_string();
    // output the server never got: its connection went first
    let data = pattern(185, 9);
    w.input(Input::Closed(None));
    w.output(1, 0, &data);
    w.tick(w.now + 120_000);
    w.connect_with(GEN + 1, true);
    w.sent.clear();
    // the shell exits before the server's attach on the new connection
    w.event(
        term(1),
        TerminalEvent::Exited {
            exit: Exit::Code(126),
            final_offset: data.len() as u64,
        },
    );
    assert_eq!(w.core.terminal_phase(&term(1)), Some(TerminalPhase::Closed));
    assert!(
        closed(&w.take_sent()).is_empty(),
        "the end waits for the attach: the server may lack the output"
    );
    assert_eq!(w.core.terminal_stats().closes_awaiting_attach, 1);
    // a server that still has it opening sends its open (and input)
    // before the attach: the answer is the end, after the output
    for p in [
        Payload::PtyOpen(open_req(1)),
        Payload::PtyInput(wire::PtyInput {
            pty_session_id: id.clone(),
            input_seq: 1,
            data: b"x".to_vec(),
        }),
    ] {
        let env = wire::Envelope {
            session_id: SID.into(),
            generation: GEN + 1,
            payload: Some(p),
        };
        w.input(Input::Frame(env.encode_to_vec()));
    }
    assert!(
        closed(&w.take_sent()).is_empty(),
        "no end before the output the server may lack"
    );
    let env = wire::Envelope {
        session_id: SID.into(),
        generation: GEN + 1,
        payload: Some(Payload::PtyAttach(wire::PtyAttach {
            pty_session_id: id,
            from_offset: 0,
        })),
    };
    w.input(Input::Frame(env.encode_to_vec()));
    let sent = w.take_sent();
    same(
        &stream_bytes(&outputs(&sent), 0),
        &data,
        "the output before the end",
    );
    let c = closed(&sent);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].final_offset, data.len() as u64);
    assert_end_follows_output(&sent);
}

#[test]
fn a_shell_that_ends_by_itself_is_reported_as_exited() {
    let mut w = World::new(16);
    w.connect();
    for (n, code, lifecycle) in [
        (1u8, 0, wire::Lifecycle::Succeeded),
        (2, 3, wire::Lifecycle::Failed),
    ] {
        w.open(n);
        w.event(
            term(n),
            TerminalEvent::Exited {
                exit: Exit::Code(code),
                final_offset: 0,
            },
        );
        // not attached on this connection: reported at once
        let c = closed(&w.take_sent());
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].reason, REASON_EXITED);
        let exit = c[0].exit_result.as_ref().unwrap();
        assert_eq!(exit.lifecycle, lifecycle as i32);
        assert_eq!(exit.exit_code, Some(code));
    }
}

#[test]
fn a_closed_terminal_answers_from_its_record_for_a_day_then_is_unknown() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    let id = term(1).to_string();
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: id.clone(),
        from_offset: 0,
    }));
    w.output(1, 0, b"bye\r\n");
    w.event(
        term(1),
        TerminalEvent::Exited {
            exit: Exit::Code(0),
            final_offset: 5,
        },
    );
    let first = closed(&w.take_sent());
    assert_eq!(first.len(), 1);
    // the output before the end is recorded: the copy goes
    w.frame(Payload::PtyOutputAck(wire::PtyOutputAck {
        pty_session_id: id.clone(),
        offset: 5,
    }));
    let asks = [
        Payload::PtyOpen(open_req(1)),
        Payload::PtyAttach(wire::PtyAttach {
            pty_session_id: id.clone(),
            from_offset: 0,
        }),
        Payload::PtyInput(wire::PtyInput {
            pty_session_id: id.clone(),
            input_seq: 1,
            data: b"x".to_vec(),
        }),
        Payload::PtyResize(wire::PtyResize {
            pty_session_id: id.clone(),
            rows: 10,
            cols: 10,
        }),
        Payload::PtyClose(wire::PtyClose {
            pty_session_id: id.clone(),
        }),
    ];
    for a in &asks {
        w.frame(a.clone());
        let c = closed(&w.take_sent());
        assert_eq!(c, first, "answered from the record: {a:?}");
    }
    assert!(w.take_supervise().is_empty(), "nothing reaches a holder");
    // a day later the record is gone (memory and store)
    w.wall = WALL + CLOSED_TERMINAL_KEEP_MS + 1;
    w.frame(asks[1].clone());
    let c = closed(&w.take_sent());
    assert_eq!(c[0].reason, REASON_UNKNOWN);
    assert!(w.stores.iter().any(
        |op| matches!(op, ClientOp::TerminalsExpire { closed_before_ms } if *closed_before_ms == WALL + 1)
    ));
}

#[test]
fn every_message_for_an_unknown_terminal_is_answered_closed() {
    let mut w = World::new(16);
    w.connect();
    let id = term(9).to_string();
    let asks = [
        Payload::PtyAttach(wire::PtyAttach {
            pty_session_id: id.clone(),
            from_offset: 7,
        }),
        Payload::PtyInput(wire::PtyInput {
            pty_session_id: id.clone(),
            input_seq: 1,
            data: b"x".to_vec(),
        }),
        Payload::PtyResize(wire::PtyResize {
            pty_session_id: id.clone(),
            rows: 10,
            cols: 10,
        }),
        Payload::PtyOutputAck(wire::PtyOutputAck {
            pty_session_id: id.clone(),
            offset: 0,
        }),
        Payload::PtyDetach(wire::PtyDetach {
            pty_session_id: id.clone(),
        }),
        Payload::PtyClose(wire::PtyClose {
            pty_session_id: id.clone(),
        }),
    ];
    for a in asks {
        w.frame(a);
        let c = closed(&w.take_sent());
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].pty_session_id, id);
        assert_eq!(c[0].reason, REASON_UNKNOWN);
        assert_eq!(c[0].final_offset, 0);
    }
    assert!(w.take_supervise().is_empty());
    assert!(w.closes.is_empty(), "not a protocol error");
    assert_eq!(w.core.terminal_stats().unknown, 6);
    // a peer that closes what it is told is closed cannot make the two
    // loop: the same close is answered once per connection
    w.frame(Payload::PtyClose(wire::PtyClose {
        pty_session_id: id.clone(),
    }));
    assert!(closed(&w.take_sent()).is_empty());
    assert_eq!(w.core.terminal_stats().close_repeats, 1);
    // other questions are still answered
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: id.clone(),
        from_offset: 0,
    }));
    assert_eq!(closed(&w.take_sent()).len(), 1);
}

#[test]
fn a_new_connection_streams_nothing_until_the_servers_attach_and_a_detach_stops_it() {
    let mut w = World::new(16);
    w.connect();
    w.open(1);
    let id = term(1).to_string();
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: id.clone(),
        from_offset: 0,
    }));
    let data = pattern(300 * KIB, 4);
    w.output(1, 0, &data[..100 * KIB]);
    same(
        &stream_bytes(&outputs(&w.take_sent()), 0),
        &data[..100 * KIB],
        "the stream",
    );
    w.input(Input::Closed(None));
    w.output(1, 100 * KIB as u64, &data[100 * KIB..200 * KIB]);
    assert!(outputs(&w.take_sent()).is_empty());
    // the next session: welcomed, terminal frames before the round is
    // applied are taken (not a protocol error), and nothing streams before
    // the attach
    w.tick(w.now + 120_000);
    w.connect_with(GEN + 1, false);
    w.sent.clear();
    w.output(1, 200 * KIB as u64, &data[200 * KIB..]);
    assert!(outputs(&w.take_sent()).is_empty());
    let env = wire::Envelope {
        session_id: SID.into(),
        generation: GEN + 1,
        payload: Some(Payload::PtyAttach(wire::PtyAttach {
            pty_session_id: id.clone(),
            from_offset: 60 * KIB as u64,
        })),
    };
    w.input(Input::Frame(env.encode_to_vec()));
    assert!(w.closes.is_empty(), "taken while reconciling");
    let outs = outputs(&w.take_sent());
    same(
        &stream_bytes(&outs, 60 * KIB as u64),
        &data[60 * KIB..],
        "the stream",
    );
    let env = wire::Envelope {
        session_id: SID.into(),
        generation: GEN + 1,
        payload: Some(Payload::PtyDetach(wire::PtyDetach {
            pty_session_id: id.clone(),
        })),
    };
    w.input(Input::Frame(env.encode_to_vec()));
    w.output(1, data.len() as u64, b"more");
    assert!(outputs(&w.take_sent()).is_empty(), "detached");
}

#[test]
fn restored_terminals_are_adopted_or_closed_by_name() {
    let mut w = World::new(16);
    let now = |n: u8| RestoredTerminal {
        terminal: term(n),
        resolved_shell: wire::ShellType::Sh,
        open: open_req(n),
        created_ms: WALL - 1000,
        holder: Some(holder(n)),
        closed: None,
    };
    let old_closed = RestoredTerminal {
        closed: Some(rvbox_client_core::ops::ClosedTerminal {
            exit_result: wire::ExitResult {
                lifecycle: wire::Lifecycle::Succeeded as i32,
                exit_code: Some(0),
                ..Default::default()
            },
            final_offset: 9,
            reason: REASON_EXITED.into(),
            closed_at_ms: WALL - CLOSED_TERMINAL_KEEP_MS - 1,
        }),
        holder: None,
        ..now(4)
    };
    w.core
        .restore_terminals(vec![now(1), now(2), now(3), old_closed], WALL);
    w.run();
    let ops = w.take_supervise();
    assert_eq!(
        ops,
        (1..=3)
            .map(|n| SuperviseOp::AdoptTerminal {
                terminal: term(n),
                holder: Box::new(holder(n)),
            })
            .collect::<Vec<_>>()
    );
    assert_eq!(w.core.terminal_phase(&term(4)), None, "past its day");
    w.connect();
    w.event(term(1), TerminalEvent::Adopted);
    assert_eq!(
        w.take_supervise(),
        vec![SuperviseOp::AttachTerminal {
            terminal: term(1),
            from: 0
        }]
    );
    // the holder's replay: its ring from where it starts now
    w.event(
        term(1),
        TerminalEvent::Output {
            offset: 5000,
            bytes: b"$ ".to_vec(),
            cut: 5000,
        },
    );
    w.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: term(1).to_string(),
        from_offset: 5000,
    }));
    let outs = outputs(&w.take_sent());
    same(&stream_bytes(&outs, 5000), b"$ ", "the stream");
    for (n, loss, reason) in [
        (2, HolderLoss::HostRestarted, REASON_HOST_RESTARTED),
        (3, HolderLoss::Gone, REASON_GONE),
    ] {
        w.event(
            term(n),
            TerminalEvent::Lost {
                loss,
                detail: "test".into(),
            },
        );
        let c = closed(&w.take_sent());
        assert_eq!(c[0].reason, reason);
        assert_eq!(
            c[0].exit_result.as_ref().unwrap().lifecycle,
            wire::Lifecycle::Interrupted as i32
        );
        // and again when the server asks
        w.frame(Payload::PtyAttach(wire::PtyAttach {
            pty_session_id: term(n).to_string(),
            from_offset: 0,
        }));
        assert_eq!(closed(&w.take_sent())[0].reason, reason);
    }
    assert_eq!(w.core.terminal_stats().lost, 2);
    assert_eq!(w.core.terminal_stats().adopted, 1);
}

#[test]
fn a_restored_opening_record_starts_its_holder_on_the_next_open() {
    let mut w = World::new(16);
    w.core.restore_terminals(
        vec![RestoredTerminal {
            terminal: term(1),
            resolved_shell: wire::ShellType::Sh,
            open: open_req(1),
            created_ms: WALL,
            holder: None,
            closed: None,
        }],
        WALL,
    );
    w.run();
    assert!(w.take_supervise().is_empty());
    assert_eq!(w.core.open_terminals(), 0, "it holds no slot until opened");
    w.connect();
    w.frame(Payload::PtyOpen(open_req(1)));
    let ops = w.take_supervise();
    assert!(matches!(&ops[..], [SuperviseOp::StartTerminal(s)] if s.terminal == term(1)));
    assert!(
        !w.stores.iter().any(|o| op_name(o) == "opening"),
        "its opening record is there already"
    );
    w.event(term(1), TerminalEvent::Started(holder(1)));
    assert_eq!(
        opened(&w.take_sent())[0].outcome,
        wire::AcceptOutcome::Positive as i32
    );
}
