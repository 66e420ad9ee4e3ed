#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The security review's checks through the real `rvbox-server` (plan
//! §11.3, docs/security.md): an oversized control request is refused by
//! the gRPC decoder and the server keeps serving; a runtime directory
//! that others can write (or that another account owns) stops the server
//! before it binds anything; JSON-RPC on a non-loopback address is
//! warned about when it starts listening (and only then); environment
//! values and command text reach neither daemon's log nor the audit log.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use rvbox_testkit::{Stack, free_port, http_get, text};

async fn control(socket: std::path::PathBuf) -> ControlClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::try_from("http://rvbox.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let s = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap();
    ControlClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX)
}

fn new_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// A script RunCommand whose encoding is about `bytes` long.
fn run_with_script(bytes: usize) -> wire::RunCommandRequest {
    let script = vec![b'#'; bytes];
    wire::RunCommandRequest {
        request_id: new_id(),
        client_id: "web-1".into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::Script(
                wire::ScriptDescriptor {
                    display_basename: "big.sh".into(),
                    size_bytes: script.len() as u64,
                    sha256: rvbox_segment::sha256(&script).to_vec(),
                },
            )),
            ..Default::default()
        }),
        script,
        queue_ttl: None,
    }
}

/// `limits.max_control_request` is the control socket's gRPC decode
/// limit: a larger request is refused by the decoder with OUT_OF_RANGE
/// naming the limit, before any handler sees it, and the server keeps
/// serving (the same connection and new ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_control_request_is_refused_by_the_decoder_and_the_server_keeps_serving() {
    let mut s = Stack::configured();
    s.append_server_config("[limits]\nmax_control_request = \"1MiB\"\n");
    s.start_server();
    let mut c = control(s.socket()).await;

    let refused = c
        .run_command(run_with_script(2 << 20))
        .await
        .expect_err("a 2 MiB request passed a 1 MiB limit");
    assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");
    assert!(
        refused.message().contains("message length too large")
            && refused.message().contains("the limit is: 1048576 bytes"),
        "{refused:?}"
    );
    // nothing was created
    let listed = c
        .list_commands(wire::ListCommandsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.commands.is_empty(), "{listed:?}");
    // a request under the limit on the same connection is served
    let ok = c
        .run_command(run_with_script(512 << 10))
        .await
        .unwrap()
        .into_inner();
    assert!(!ok.issue_uuid.is_empty());
    // and the server is alive and ready
    assert!(s.server.as_mut().unwrap().try_wait().unwrap().is_none());
    assert_eq!(http_get(s.port, "/readyz").unwrap().0, 200);
    let mut fresh = control(s.socket()).await;
    fresh
        .list_clients(wire::ListClientsRequest::default())
        .await
        .unwrap();
}

/// Waits for `child` to exit within `max`; kills it and fails otherwise.
fn exit_of(child: &mut Child, max: Duration, log: &Path) -> i32 {
    let until = Instant::now() + max;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the server did not stop: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the server on `s`'s configuration and returns its exit status
/// and everything it wrote to stderr.
fn start_and_wait(s: &Stack) -> (i32, String) {
    let log = s.dir.path().join("refused.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rvbox-server"))
        .arg("--config")
        .arg(s.dir.path().join("server.toml"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let code = exit_of(&mut child, Duration::from_secs(20), &log);
    (code, std::fs::read_to_string(&log).unwrap())
}

/// The control runtime directory must be private to this account (or
/// root): one that group or others can write, or that another account
/// owns, stops the server at its configuration gate, before the agent
/// listener, the store or the control socket exist. A stale socket that
/// another account owns is never replaced.
#[test]
fn a_runtime_directory_others_can_write_or_own_stops_the_server_before_it_binds() {
    let s = Stack::configured();
    let run = s.dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    for (mode, why) in [
        (0o770, "group-writable"),
        (0o707, "world-writable"),
        (0o1777, "world-writable even with the sticky bit"),
    ] {
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
        let (code, err) = start_and_wait(&s);
        assert_eq!(code, rvbox_daemon_common::EXIT_CONFIG, "{why}: {err}");
        assert!(
            err.contains("control.runtime_dir") && err.contains("group- or world-writable"),
            "{why}: {err}"
        );
        assert!(!s.socket().exists(), "{why}: the socket was created");
        assert!(http_get(s.port, "/healthz").is_none(), "{why}: it bound");
        assert!(
            !s.dir.path().join("data").exists(),
            "{why}: the store was opened"
        );
    }
    // another account's directory: only root can make one here
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    if rustix::process::geteuid().is_root() {
        std::os::unix::fs::chown(&run, Some(4242), Some(4242)).unwrap();
        let (code, err) = start_and_wait(&s);
        assert_eq!(code, rvbox_daemon_common::EXIT_CONFIG, "{err}");
        assert!(
            err.contains("control.runtime_dir") && err.contains("owned by uid 4242"),
            "{err}"
        );
        assert!(!s.socket().exists());
        std::os::unix::fs::chown(&run, Some(0), Some(0)).unwrap();
        // a stale socket another account owns is never replaced
        drop(std::os::unix::net::UnixListener::bind(s.socket()).unwrap());
        std::os::unix::fs::lchown(s.socket(), Some(4242), Some(4242)).unwrap();
        let (code, err) = start_and_wait(&s);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("is a socket owned by uid 4242"), "{err}");
        let left = std::fs::symlink_metadata(s.socket()).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&left), 4242);
        std::fs::remove_file(s.socket()).unwrap();
    } else {
        // core/config/tests/validation.rs covers the owner rule for
        // every account
        eprintln!(
            "NOTE: the foreign-owner cases need root; the configuration tests check the directory's"
        );
    }
    // private: it starts, and the socket is owner-only
    let mut s = s;
    s.start_server();
    let mode = std::fs::metadata(s.socket()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// The lines of `log` that mention `what`.
fn lines_with<'a>(log: &'a str, what: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.contains(what)).collect()
}

/// JSON-RPC bound to a non-loopback address logs a WARN line when it
/// starts listening, naming the address and that it is unauthenticated;
/// on loopback the same event is an INFO line and nothing warns.
#[test]
fn json_rpc_on_a_non_loopback_address_is_warned_about_when_it_listens() {
    let port = free_port();
    let mut s = Stack::configured();
    s.append_server_config(&format!(
        "[jsonrpc]\nenabled = true\nlisten = \"0.0.0.0:{port}\"\n"
    ));
    s.start_server();
    let log = s.server_log();
    let listening = lines_with(&log, "JSON-RPC adapter listening");
    assert_eq!(listening.len(), 1, "{log}");
    let line = listening[0];
    assert!(
        line.contains(" WARN ")
            && line.contains("non-loopback address")
            && line.contains("UNAUTHENTICATED")
            && line.contains(&format!("addr=0.0.0.0:{port}")),
        "{line}"
    );
    // it really listens there
    let (code, _) = http_get(port, "/").unwrap();
    assert_eq!(code, 405);
    assert_eq!(s.stop_server(), Some(0));

    let port = free_port();
    let mut s = Stack::configured();
    s.append_server_config(&format!(
        "[jsonrpc]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\n"
    ));
    s.start_server();
    let log = s.server_log();
    let listening = lines_with(&log, "JSON-RPC adapter listening");
    assert_eq!(listening.len(), 1, "{log}");
    assert!(
        listening[0].contains(" INFO ") && listening[0].contains(&format!("addr=127.0.0.1:{port}")),
        "{}",
        listening[0]
    );
    assert!(lines_with(&log, "non-loopback").is_empty(), "{log}");
    assert!(lines_with(&log, "UNAUTHENTICATED").is_empty(), "{log}");
}

/// The audit records of the stopped server's store.
fn audit_records(data: &Path) -> Vec<rvbox_store::audit::AuditRecord> {
    let mut store = rvbox_store::Store::open(
        rvbox_store::layout::Layout::new(data),
        Arc::new(rvbox_store::fs::RealFs),
        Arc::new(rvbox_store::entropy::OsEntropy),
        rvbox_store::StoreOptions::default(),
        1_800_000_000_000,
    )
    .unwrap();
    store.recover(1_800_000_000_000).unwrap();
    store
        .read_audit(0, 100_000)
        .unwrap()
        .into_iter()
        .map(|(_, r)| r)
        .collect()
}

/// Every process's command line on this host, NUL-separated arguments
/// joined by spaces.
fn command_lines() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(b) = std::fs::read(e.path().join("cmdline")) {
            out.push(String::from_utf8_lossy(&b).replace('\0', " "));
        }
    }
    out
}

/// A command's environment values and its text are written nowhere but
/// the stores (plan §11.3 command logging and environment redaction):
/// both daemons log at debug level, a command runs with an override whose
/// value is a secret, and afterwards neither log holds the value or the
/// command text; the audit record names the key only; `rvc stat` shows
/// the command text and no environment; the running tree's command lines
/// hold neither (the text is in the private wrapper file, the values in
/// the process environment). At `trace` the WebSocket library logs whole
/// frames, so this holds up to `debug` only (docs/security.md).
#[test]
fn environment_values_and_command_text_reach_no_log_and_no_audit_record() {
    let secret = format!("env-secret-{}", uuid::Uuid::now_v7().simple());
    let mark = format!("text-mark-{}", uuid::Uuid::now_v7().simple());
    let mut s = Stack::configured();
    // both configurations end with their [observability] table; at
    // trace, the most any operator can turn on
    s.append_server_config("log_level = \"trace\"\n");
    s.append_client_config("log_level = \"trace\"\n");
    s.start_server();
    s.start_client();

    // the text checks the value arrived without holding it
    let command = format!(
        "[ ${{#RVBOX_TOKEN}} -eq {} ] && echo token-set # {mark}",
        secret.len()
    );
    // the value from rvc's own environment (`--env K`: not in its argv)
    let out = s
        .rvc_cmd(&["run", "--env", "RVBOX_TOKEN", "web-1", &command])
        .env("RVBOX_TOKEN", &secret)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        text(&out.stderr),
        s.logs()
    );
    assert_eq!(out.stdout, b"token-set\n");

    // a command that is running: its tree's command lines
    let sleeper = format!("sleep 30 # {mark}");
    let env = format!("RVBOX_TOKEN={secret}");
    let out = s.rvc(&["run", "--background", "--env", &env, "web-1", &sleeper]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let issue = text(&out.stdout).trim().to_owned();
    s.wait_until("the sleeper runs", || {
        text(&s.rvc(&["stat", "web-1", &issue]).stdout).contains("state     running")
    });
    let lines = command_lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains(".rvbox-") && l.contains(&issue)),
        "the shell runs its wrapper file: {lines:?}"
    );
    for l in &lines {
        assert!(
            !l.contains(&secret) && !l.contains(&mark),
            "a command line shows it: {l}"
        );
    }
    let stat = text(&s.rvc(&["stat", "web-1", &issue]).stdout);
    assert!(stat.contains(&mark), "stat shows the command text: {stat}");
    assert!(
        !stat.contains(&secret) && !stat.contains("RVBOX_TOKEN"),
        "{stat}"
    );
    assert_eq!(
        s.rvc(&["kill", "KILL", "web-1", &issue]).status.code(),
        Some(0)
    );

    assert_eq!(s.stop_client(), Some(0), "{}", s.logs());
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());
    for (name, log) in [("server", s.server_log()), ("client", s.client_log())] {
        assert!(
            log.lines().count() > 20 && log.contains("DEBUG"),
            "{name} logged at debug level: {log}"
        );
        for l in log.lines() {
            assert!(!l.contains(&secret), "the {name} log holds the value: {l}");
            assert!(
                !l.contains(&mark),
                "the {name} log holds the command text: {l}"
            );
        }
    }
    let records = audit_records(&s.dir.path().join("data"));
    let runs: Vec<_> = records
        .iter()
        .filter(|r| r.action == "RunCommand")
        .collect();
    assert_eq!(runs.len(), 2, "{records:?}");
    for r in &runs {
        assert_eq!(r.env_keys, vec!["RVBOX_TOKEN".to_owned()]);
    }
    let all = format!("{records:?}");
    assert!(!all.contains(&secret) && !all.contains(&mark), "{all}");
}
