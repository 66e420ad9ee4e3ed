#![cfg(unix)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Terminals through the Unix supervisor with the real holder (`rvbox
//! __terminal-holder`) on a real PTY running `sh`: a start, input written
//! once though sent twice, output by offset, a supervisor dropped (as a
//! daemon that stops) and a new one adopting the holder with its record,
//! the replay from offset 0, the close, and a holder that is gone or
//! cannot prove itself.

use std::path::Path;
use std::time::{Duration, Instant};

use rvbox_client_core::process::{
    Exit, HolderIdentity, HolderLoss, ResourceLimits, TerminalEvent, TerminalSpec,
};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_supervisor::{Supervisor, SupervisorError, UnixSupervisor};

mod support;

const WAIT: Duration = Duration::from_secs(20);

fn terminal(n: u8) -> Uuid7 {
    let pid = std::process::id();
    Uuid7::parse("t", &format!("01890a5d-ac96-774b-bcce-{pid:08x}{n:04x}")).unwrap()
}

fn sh() -> String {
    std::fs::canonicalize("/bin/sh")
        .unwrap()
        .display()
        .to_string()
}

fn supervisor(dir: &Path) -> UnixSupervisor {
    UnixSupervisor::new(support::supervisor_config(dir.join("run"))).unwrap()
}

fn spec(id: Uuid7, dir: &Path) -> TerminalSpec {
    TerminalSpec {
        terminal: id,
        shell: wire::ShellType::Sh,
        shell_path: sh(),
        cwd: dir.display().to_string(),
        env: vec![("PS1".into(), "$ ".into()), ("RVBOX_T".into(), "t1".into())],
        rows: 30,
        cols: 100,
        limits: ResourceLimits::default(),
    }
}

/// What one supervisor handed over of one terminal.
#[derive(Default)]
struct Seen {
    /// Output bytes by offset from the first output's offset.
    start: Option<u64>,
    output: Vec<u8>,
    cuts: Vec<u64>,
    acked: u64,
    ack_events: usize,
    exit: Option<(Exit, u64)>,
}

impl Seen {
    fn end(&self) -> u64 {
        self.start.unwrap_or(0) + self.output.len() as u64
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output).into_owned()
    }

    fn count(&self, needle: &str) -> usize {
        self.text().matches(needle).count()
    }
}

/// Takes terminal events of `id` until `done` holds (others are a test
/// failure).
fn until(
    sup: &mut UnixSupervisor,
    id: &Uuid7,
    seen: &mut Seen,
    what: &str,
    done: impl Fn(&Seen, &[TerminalEvent]) -> bool,
) -> Vec<TerminalEvent> {
    let deadline = Instant::now() + WAIT;
    let mut events = Vec::new();
    loop {
        while let Some(ev) = sup.next_terminal_event() {
            assert_eq!(ev.terminal, *id, "an event of another terminal: {ev:?}");
            match &ev.event {
                TerminalEvent::Output { offset, bytes, cut } => {
                    let start = *seen.start.get_or_insert(*offset);
                    assert_eq!(
                        *offset,
                        start + seen.output.len() as u64,
                        "output follows by offset"
                    );
                    if *cut > 0 {
                        seen.cuts.push(*cut);
                    }
                    seen.output.extend_from_slice(bytes);
                }
                TerminalEvent::InputAcked { seq } => {
                    assert!(*seq >= seen.acked, "acknowledgements are cumulative");
                    seen.acked = *seq;
                    seen.ack_events += 1;
                }
                TerminalEvent::Exited { exit, final_offset } => {
                    seen.exit = Some((*exit, *final_offset));
                }
                _ => {}
            }
            events.push(ev.event);
        }
        if done(seen, &events) {
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {WAIT:?}; output so far {:?}",
            seen.text()
        );
        // a terminal event makes it return at once
        assert!(sup.next_event(Duration::from_millis(50)).is_none());
    }
}

fn started(events: &[TerminalEvent]) -> Option<HolderIdentity> {
    events.iter().find_map(|e| match e {
        TerminalEvent::Started(h) => Some(h.clone()),
        _ => None,
    })
}

#[test]
fn a_holder_is_started_written_once_adopted_by_a_new_supervisor_replayed_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let id = terminal(1);
    let mut sup = supervisor(dir.path());
    sup.start_terminal(spec(id, dir.path())).unwrap();
    let mut seen = Seen::default();
    let events = until(&mut sup, &id, &mut seen, "the start", |_, ev| {
        started(ev).is_some()
    });
    let record = started(&events).unwrap();
    assert!(record.socket.ends_with(&format!("pty-{id}.sock")));
    assert_ne!(record.token, [0; 32]);
    assert!(!record.boot_id.is_empty());
    let dbg = format!("{record:?}");
    assert!(
        !dbg.contains("token"),
        "the record's Debug never shows the token"
    );
    // with cgroups the holder (and so its shell) is in the terminal's own
    let cgroup = if sup.mode() == rvbox_client_core::process::Supervision::ProcessGroup {
        support::skip_cgroups(
            "a_holder_is_started_written_once_adopted",
            "no usable cgroup v2 tree on this host",
        );
        None
    } else {
        let dir = record
            .cgroup
            .clone()
            .expect("the terminal's cgroup is recorded");
        assert!(dir.ends_with(&format!("pty-{id}")), "{dir}");
        let placed = std::fs::read_to_string(format!("/proc/{}/cgroup", record.pid)).unwrap();
        assert!(placed.contains(&format!("pty-{id}")), "{placed}");
        Some(dir)
    };
    // the holder's output is kept from offset 0
    sup.attach_terminal(&id, 0).unwrap();
    until(&mut sup, &id, &mut seen, "the prompt", |s, _| {
        s.text().contains("$ ")
    });
    assert_eq!(seen.start, Some(0));

    // input once: the shell writes its result once, the ack comes back
    sup.terminal_input(&id, 1, b"echo one-$((6*7)) $RVBOX_T\n".to_vec())
        .unwrap();
    until(&mut sup, &id, &mut seen, "input 1", |s, _| {
        s.acked == 1 && s.text().contains("one-42 t1")
    });
    // the same frame again (a resend after a reconnect): acknowledged,
    // never written twice
    sup.terminal_input(&id, 1, b"echo one-$((6*7)) $RVBOX_T\n".to_vec())
        .unwrap();
    let acks_before = seen.ack_events;
    until(&mut sup, &id, &mut seen, "the repeat's ack", |s, _| {
        s.ack_events > acks_before
    });
    std::thread::sleep(Duration::from_millis(300));
    until(&mut sup, &id, &mut seen, "quiet", |_, _| true);
    assert_eq!(
        seen.count("one-42 t1"),
        1,
        "written once: {:?}",
        seen.text()
    );
    assert_eq!(seen.acked, 1);
    sup.resize_terminal(&id, 40, 120).unwrap();
    sup.terminal_input(&id, 2, b"stty size\n".to_vec()).unwrap();
    until(&mut sup, &id, &mut seen, "the new size", |s, _| {
        s.acked == 2 && s.text().contains("40 120")
    });
    let end_before = seen.end();

    // the daemon stops: its supervisor goes, the holder and its shell stay
    drop(sup);
    assert!(
        Path::new(&record.socket).exists(),
        "the holder outlives its supervisor"
    );

    // a new supervisor adopts it with the record, and replays from 0
    let mut sup = supervisor(dir.path());
    let mut forged = record.clone();
    forged.token = [9; 32];
    let other = terminal(2);
    sup.adopt_terminal(&other, &forged).unwrap();
    let ev = until(
        &mut sup,
        &other,
        &mut Seen::default(),
        "the forged adoption",
        |_, ev| !ev.is_empty(),
    );
    assert!(
        matches!(&ev[0], TerminalEvent::Lost { loss: HolderLoss::Gone, detail } if detail.contains("proof")),
        "a wrong token is refused: {ev:?}"
    );
    sup.adopt_terminal(&id, &record).unwrap();
    let mut again = Seen::default();
    let ev = until(&mut sup, &id, &mut again, "the adoption", |_, ev| {
        !ev.is_empty()
    });
    assert_eq!(ev[0], TerminalEvent::Adopted);
    sup.attach_terminal(&id, 0).unwrap();
    until(&mut sup, &id, &mut again, "the replay", |s, _| {
        s.end() >= end_before
    });
    assert_eq!(
        again.start,
        Some(0),
        "the whole output is still in the ring"
    );
    assert!(again.cuts.is_empty());
    assert_eq!(
        &again.output[..usize::try_from(end_before).unwrap()],
        &seen.output[..],
        "the replay is byte-exact by offset"
    );
    // the adopted holder remembers what it wrote: a resend of both frames
    // writes nothing, the next frame is written
    sup.terminal_input(&id, 1, b"echo one-$((6*7)) $RVBOX_T\n".to_vec())
        .unwrap();
    sup.terminal_input(&id, 2, b"stty size\n".to_vec()).unwrap();
    sup.terminal_input(&id, 3, b"echo three-$((1+2))\n".to_vec())
        .unwrap();
    until(&mut sup, &id, &mut again, "input 3", |s, _| {
        s.acked == 3 && s.text().contains("three-3")
    });
    std::thread::sleep(Duration::from_millis(300));
    until(&mut sup, &id, &mut again, "quiet", |_, _| true);
    assert_eq!(again.count("one-42 t1"), 1, "{:?}", again.text());
    assert_eq!(again.count("40 120"), 1, "{:?}", again.text());

    // the close hangs the shell up; the exit names the final offset
    sup.close_terminal(&id).unwrap();
    until(&mut sup, &id, &mut again, "the exit", |s, _| {
        s.exit.is_some()
    });
    let (exit, final_offset) = again.exit.unwrap();
    assert_eq!(final_offset, again.end(), "every byte before the end came");
    assert!(
        matches!(exit, Exit::Signal(1) | Exit::Code(129)),
        "a hang-up: {exit:?}"
    );
    assert!(matches!(
        sup.terminal_input(&id, 4, b"x".to_vec()),
        Err(SupervisorError::UnknownTerminal(_))
    ));
    // the holder is gone: a later adoption finds it so
    let deadline = Instant::now() + WAIT;
    while Path::new(&record.socket).exists() {
        assert!(
            Instant::now() < deadline,
            "the holder did not exit: {:?}",
            std::fs::read_to_string(format!("/proc/{}/stat", record.pid))
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // its cgroup goes with it
    if let Some(cg) = &cgroup {
        while Path::new(cg).exists() {
            assert!(
                Instant::now() < deadline,
                "the terminal's cgroup {cg} stayed"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    drop(sup);
    let mut sup = supervisor(dir.path());
    sup.adopt_terminal(&id, &record).unwrap();
    let ev = until(
        &mut sup,
        &id,
        &mut Seen::default(),
        "the adoption of a gone holder",
        |_, ev| !ev.is_empty(),
    );
    assert!(
        matches!(
            &ev[0],
            TerminalEvent::Lost {
                loss: HolderLoss::Gone,
                ..
            }
        ),
        "{ev:?}"
    );
}

#[test]
fn a_holder_of_another_boot_is_closed_as_a_host_restart_and_a_bad_start_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sup = supervisor(dir.path());
    let id = terminal(3);
    let record = HolderIdentity {
        socket: dir.path().join("run/none.sock").display().to_string(),
        pid: std::process::id(),
        start_ticks: 1,
        boot_id: "another-boot".into(),
        token: [1; 32],
        cgroup: None,
    };
    sup.adopt_terminal(&id, &record).unwrap();
    let ev = until(
        &mut sup,
        &id,
        &mut Seen::default(),
        "the adoption",
        |_, ev| !ev.is_empty(),
    );
    assert!(
        matches!(
            &ev[0],
            TerminalEvent::Lost {
                loss: HolderLoss::HostRestarted,
                ..
            }
        ),
        "{ev:?}"
    );
    // a shell not validated at startup never starts
    let mut bad = spec(terminal(4), dir.path());
    bad.shell_path = "/usr/bin/env".into();
    sup.start_terminal(bad).unwrap();
    let ev = until(
        &mut sup,
        &terminal(4),
        &mut Seen::default(),
        "the refusal",
        |_, ev| !ev.is_empty(),
    );
    assert!(
        matches!(&ev[0], TerminalEvent::Failed(rvbox_client_core::process::LaunchFailure::Permanent(r)) if r.contains("validated")),
        "{ev:?}"
    );
}

/// A terminal's working directory is checked under
/// `exec.allowed_cwd_roots` after resolution: a link inside a root that
/// leads out of it never starts a holder.
#[test]
fn a_terminal_whose_working_directory_resolves_outside_the_roots_never_starts() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    std::os::unix::fs::symlink("/", root.join("escape")).unwrap();
    let mut c = support::supervisor_config(dir.path().join("run"));
    c.cwd_roots = vec![root.clone()];
    let mut sup = UnixSupervisor::new(c).unwrap();
    let mut s = spec(terminal(7), &root.join("escape"));
    s.cwd = root.join("escape").display().to_string();
    sup.start_terminal(s).unwrap();
    let ev = until(
        &mut sup,
        &terminal(7),
        &mut Seen::default(),
        "the refusal",
        |_, ev| !ev.is_empty(),
    );
    assert!(
        matches!(&ev[0], TerminalEvent::Failed(rvbox_client_core::process::LaunchFailure::Permanent(r)) if r.contains("outside every allowed root")),
        "{ev:?}"
    );
}

// ---- the whole daemon loop: core, store and supervisor -------------------------

use std::sync::Arc;

use prost::Message as _;
use rvbox_client_core::machine::Input;
use rvbox_client_runtime::{Runtime, Wire};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_proto::v1::envelope::Payload;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;

/// The runtime with the real store and supervisor, and what it sent, by
/// lane.
struct Daemon {
    rt: Runtime<UnixSupervisor>,
    control: Vec<Payload>,
    data: Vec<Payload>,
    generation: u64,
}

impl Daemon {
    fn start(root: &Path, cwd: &str, generation: u64) -> Self {
        let store = ClientStore::open(
            ClientLayout::new(root.join("state")),
            Arc::new(RealFs),
            Arc::new(OsEntropy),
            ClientStoreOptions::default(),
            1_800_000_000_000,
        )
        .unwrap();
        let sup = supervisor(root);
        let rt = Runtime::new(support::config(cwd), store, sup, 5).unwrap();
        let mut d = Self {
            rt,
            control: Vec::new(),
            data: Vec::new(),
            generation,
        };
        d.input(Input::Opened);
        d.frame(Payload::ServerWelcome(wire::ServerWelcome {
            protocol_major: 1,
            session_id: support::SID.into(),
            generation,
            ..Default::default()
        }));
        d
    }

    fn input(&mut self, i: Input) {
        self.rt.input(i);
        self.collect();
    }

    fn frame(&mut self, p: Payload) {
        let env = wire::Envelope {
            session_id: support::SID.into(),
            generation: self.generation,
            payload: Some(p),
        };
        self.input(Input::Frame(env.encode_to_vec()));
    }

    fn collect(&mut self) {
        for w in self.rt.take_wire() {
            match w {
                Wire::Binary(b) => self.control.push(
                    wire::Envelope::decode(b.as_slice())
                        .unwrap()
                        .payload
                        .unwrap(),
                ),
                Wire::Data(b) => self.data.push(
                    wire::Envelope::decode(b.as_slice())
                        .unwrap()
                        .payload
                        .unwrap(),
                ),
                _ => {}
            }
        }
    }

    /// Runs the loop until `done` holds.
    fn until(&mut self, what: &str, done: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !done(self) {
            assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
            self.rt.pump_processes(Duration::from_millis(50));
            self.rt.tick();
            self.collect();
        }
    }

    /// Output of the terminal streamed so far, checked by offset from
    /// `from`.
    fn output_from(&self, from: u64) -> Vec<u8> {
        let mut all = Vec::new();
        let mut at = from;
        for p in &self.data {
            if let Payload::PtyOutput(o) = p {
                assert!(o.data.len() <= 64 * 1024);
                if o.offset + o.data.len() as u64 <= at {
                    continue;
                }
                assert_eq!(o.offset, at, "output follows by offset");
                at += o.data.len() as u64;
                all.extend_from_slice(&o.data);
            }
        }
        all
    }

    fn text(&self, from: u64) -> String {
        String::from_utf8_lossy(&self.output_from(from)).into_owned()
    }

    fn input_acks(&self) -> Vec<u64> {
        self.control
            .iter()
            .filter_map(|p| match p {
                Payload::PtyInputAck(a) => Some(a.input_seq),
                _ => None,
            })
            .collect()
    }

    fn closed(&self) -> Vec<wire::PtyClosed> {
        self.data
            .iter()
            .filter_map(|p| match p {
                Payload::PtyClosed(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn the_daemon_opens_a_terminal_streams_it_and_adopts_it_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("work");
    std::fs::create_dir(&cwd).unwrap();
    let cwd = cwd.display().to_string();
    let id = terminal(7);
    let open = wire::PtyOpen {
        pty_session_id: id.to_string(),
        shell_type: wire::ShellType::Sh as i32,
        cwd: String::new(),
        env: std::collections::BTreeMap::from([("PS1".to_string(), "$ ".to_string())]),
        rows: 24,
        cols: 80,
        profile_flags: Vec::new(),
    };
    let mut d = Daemon::start(dir.path(), &cwd, 1);
    d.frame(Payload::PtyOpen(open.clone()));
    d.until("the answer", |d| {
        d.data.iter().any(|p| matches!(p, Payload::PtyOpened(_)))
    });
    let Some(Payload::PtyOpened(answer)) = d.data.first() else {
        panic!("{:?}", d.data)
    };
    assert_eq!(
        answer.outcome,
        wire::AcceptOutcome::Positive as i32,
        "{answer:?}"
    );
    assert_eq!(answer.resolved_shell, wire::ShellType::Sh as i32);
    d.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: id.to_string(),
        from_offset: 0,
    }));
    d.frame(Payload::PtyInput(wire::PtyInput {
        pty_session_id: id.to_string(),
        input_seq: 1,
        data: b"echo rt-$((2*21))\n".to_vec(),
    }));
    d.until("input 1", |d| {
        d.input_acks().contains(&1) && d.text(0).contains("rt-42")
    });
    let seen = d.output_from(0).len() as u64;

    // the daemon dies; the holder does not
    let sup = d.rt.crash();
    drop(sup);
    let mut d = Daemon::start(dir.path(), &cwd, 2);
    // the server's resume: the attach from what it recorded, the input
    // not acknowledged (it lost the ack), the next frame
    d.frame(Payload::PtyAttach(wire::PtyAttach {
        pty_session_id: id.to_string(),
        from_offset: seen,
    }));
    d.frame(Payload::PtyInput(wire::PtyInput {
        pty_session_id: id.to_string(),
        input_seq: 1,
        data: b"echo rt-$((2*21))\n".to_vec(),
    }));
    d.frame(Payload::PtyInput(wire::PtyInput {
        pty_session_id: id.to_string(),
        input_seq: 2,
        data: b"echo after-$((5+5)); exit 3\n".to_vec(),
    }));
    d.until("the end", |d| !d.closed().is_empty());
    let after = d.text(seen);
    assert!(after.contains("after-10"), "{after:?}");
    assert!(
        !after.contains("rt-42"),
        "input 1 was not written again: {after:?}"
    );
    assert!(d.input_acks().contains(&2));
    let c = &d.closed()[0];
    assert_eq!(c.reason, "shell exited");
    assert_eq!(
        c.exit_result.as_ref().unwrap().lifecycle,
        wire::Lifecycle::Failed as i32
    );
    assert_eq!(c.exit_result.as_ref().unwrap().exit_code, Some(3));
    assert_eq!(
        c.final_offset,
        seen + d.output_from(seen).len() as u64,
        "the end follows every byte"
    );
    let last_output = d
        .data
        .iter()
        .rposition(|p| matches!(p, Payload::PtyOutput(_)))
        .unwrap();
    let close_at = d
        .data
        .iter()
        .position(|p| matches!(p, Payload::PtyClosed(_)))
        .unwrap();
    assert!(close_at > last_output);
    // its record answers a repeated open
    d.data.clear();
    d.frame(Payload::PtyOpen(open));
    assert_eq!(d.closed().len(), 1);
    assert!(!d.data.iter().any(|p| matches!(p, Payload::PtyOpened(_))));
}
