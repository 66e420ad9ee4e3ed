//! The real `rvbox-server` for the benchmarks that start one.

/// Starts the real `rvbox-server` on `port` with its data and runtime
/// directories under `dir`, `server_lines` added to its `[server]` table
/// and `sections` (whole TOML sections) appended, logging warnings only;
/// with `nofile`, its file-descriptor limit raised to that first (through
/// `sh -c "ulimit -n ..."`, which then execs the server). Waits until it
/// is ready.
pub(crate) fn start_server(
    dir: &std::path::Path,
    port: u16,
    server_lines: &str,
    sections: &str,
    nofile: Option<u32>,
) -> std::process::Child {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("server.toml"),
        format!(
            "[server]\nagent_listen = \"127.0.0.1:{port}\"\n{server_lines}\n{sections}[storage]\ndata_dir = \"{d}/data\"\n[control]\nruntime_dir = \"{d}/run\"\nsocket_path = \"{d}/run/control.sock\"\n[observability]\nlog_level = \"warn\"\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let mut command = match nofile {
        Some(n) => {
            let mut c = std::process::Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -n {n} && exec \"$0\" --config \"$1\""))
                .arg(env!("CARGO_BIN_EXE_rvbox-server"));
            c
        }
        None => {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_rvbox-server"));
            c.arg("--config");
            c
        }
    };
    let child = command
        .arg(dir.join("server.toml"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !super::agent_client::http_ok(port, "/readyz") {
        assert!(std::time::Instant::now() < until, "server not ready");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child
}
