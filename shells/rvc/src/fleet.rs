//! Fleet runs from rvc: `rvc run --target/--label/--clients/--all` and
//! `rvc fleet list|show|targets|follow|cancel|pause|resume|kill`.
//!
//! A run is followed through `FollowFleetRun` (resumed from its cursor
//! after a broken stream or a server restart, quietly, as `follow` does).
//! When a target ends, its output is read with `GetOutput` and shown:
//! prefixed per host (`host: line`, pdsh style), grouped by identical
//! output and exit (`--group`, clush -b style), or written to one file per
//! host and stream (`--output-dir`). On a terminal a status line shows the
//! counts as they move, and a table with the slowest hosts ends the run.
//! One summary line closes it; the exit status is 0 only when every target
//! succeeded (docs/cli.md).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::time::Instant;

use rvbox_proto::v1 as wire;
use rvbox_proto::v1::output_item::Item;
use sha2::{Digest as _, Sha256};

use crate::conn::{Control, FIRST_PAUSE, MAX_PAUSE, retryable};
use crate::exit::{self, Failure};
use crate::out::{Format, emit, write_stdout};

/// Output of one host kept for `--group` (beyond it, the group shows a
/// note of how much more there was).
pub(crate) const GROUP_KEEP_BYTES: usize = 1 << 20;
/// Hosts the end table lists as the slowest.
pub(crate) const SLOWEST: usize = 5;

/// How a run's output is shown.
#[derive(Debug, Clone, Default)]
pub(crate) struct View {
    /// Collapse hosts with identical output and exit status.
    pub(crate) group: bool,
    /// One file per host and stream in this directory.
    pub(crate) output_dir: Option<PathBuf>,
}

/// Targets, rates and windows of `rvc run` for a fleet.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct FleetFlags {
    /// Run on every client whose id matches this glob (`web-*`; `*` and
    /// `?`).
    #[arg(long, value_name = "GLOB")]
    pub(crate) target: Option<String>,
    /// Run on every client whose labels match this selector (`role=web`,
    /// `zone=eu-*`, `role!=db`, `canary`, `!canary`); repeat it or join
    /// terms with commas (all must hold).
    #[arg(long = "label", value_name = "SELECTOR")]
    pub(crate) labels: Vec<String>,
    /// Run on these clients (comma-separated, repeatable).
    #[arg(long = "clients", value_name = "ID,...", value_delimiter = ',')]
    pub(crate) clients: Vec<String>,
    /// Run on every known client.
    #[arg(long, conflicts_with_all = ["target", "labels", "clients"])]
    pub(crate) all: bool,
    /// At most this many targets queued or running at once: a count, or a
    /// percentage of the targets (`10%`).
    #[arg(long, value_name = "N|P%")]
    pub(crate) max_parallel: Option<String>,
    /// Stop starting targets once this many failed or were unreachable (a
    /// count or a percentage); the running ones finish.
    #[arg(long, value_name = "N|P%")]
    pub(crate) max_errors: Option<String>,
    /// Also run on clients that register and match within this long
    /// (e.g. 10m).
    #[arg(long, value_name = "DURATION")]
    pub(crate) include_late: Option<String>,
    /// Collapse hosts with identical output and exit status into one
    /// block (clush -b style).
    #[arg(long)]
    pub(crate) group: bool,
    /// Write each host's output to DIR/HOST.stdout and DIR/HOST.stderr
    /// (and its exit to DIR/HOST.exit) instead of the terminal.
    #[arg(long, value_name = "DIR", conflicts_with = "group")]
    pub(crate) output_dir: Option<PathBuf>,
}

impl FleetFlags {
    /// True when the flags name a fleet (the run has no CLIENT).
    pub(crate) fn is_fleet(&self) -> bool {
        self.target.is_some() || !self.labels.is_empty() || !self.clients.is_empty() || self.all
    }

    /// The selection the flags name.
    pub(crate) fn selection(&self) -> wire::FleetSelection {
        wire::FleetSelection {
            client_ids: self.clients.clone(),
            client_glob: self.target.clone().unwrap_or_default(),
            selector: self.labels.join(","),
            all: self.all,
        }
    }

    /// Fills the fleet fields of `req`.
    pub(crate) fn apply(&self, req: &mut wire::RunFleetRequest) -> Result<(), Failure> {
        req.selection = Some(self.selection());
        let limit =
            |flag: &str, text: &Option<String>| -> Result<Option<wire::FleetLimit>, Failure> {
                text.as_deref()
                    .map(|t| {
                        rvbox_domain::fleet::Limit::parse(t)
                            .map(rvbox_domain::fleet::Limit::to_wire)
                            .map_err(|e| Failure::usage(format!("{flag}: {e}")))
                    })
                    .transpose()
            };
        req.max_parallel = limit("--max-parallel", &self.max_parallel)?;
        req.max_errors = limit("--max-errors", &self.max_errors)?;
        if let Some(text) = &self.include_late {
            let ms = rvbox_config::units::parse_duration(text)
                .map_err(|e| Failure::usage(format!("--include-late {text:?}: {e}")))?;
            req.include_late = Some(prost_types::Duration {
                seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
                nanos: i32::try_from((ms % 1000) * 1_000_000).unwrap_or(0),
            });
        }
        Ok(())
    }

    /// How the output is shown.
    pub(crate) fn view(&self) -> View {
        View {
            group: self.group,
            output_dir: self.output_dir.clone(),
        }
    }
}

fn state_name(s: i32) -> String {
    wire::FleetTargetState::try_from(s).map_or_else(
        |_| "unknown".into(),
        |s| {
            s.as_str_name()
                .strip_prefix("FLEET_TARGET_STATE_")
                .unwrap_or("UNKNOWN")
                .to_ascii_lowercase()
        },
    )
}

fn run_state_name(s: i32) -> String {
    wire::FleetRunState::try_from(s).map_or_else(
        |_| "unknown".into(),
        |s| {
            s.as_str_name()
                .strip_prefix("FLEET_RUN_STATE_")
                .unwrap_or("UNKNOWN")
                .to_ascii_lowercase()
        },
    )
}

fn ended(state: i32) -> bool {
    use wire::FleetTargetState as T;
    matches!(
        wire::FleetTargetState::try_from(state),
        Ok(T::Succeeded | T::Failed | T::Unreachable | T::Cancelled | T::Skipped)
    )
}

fn seconds_between(
    a: Option<&prost_types::Timestamp>,
    b: Option<&prost_types::Timestamp>,
) -> Option<f64> {
    let (a, b) = (a?, b?);
    let ms = |t: &prost_types::Timestamp| t.seconds as f64 + f64::from(t.nanos) / 1e9;
    Some((ms(b) - ms(a)).max(0.0))
}

/// What a target ended with, in words (`exit 3`, `signal 9`, `expired`).
fn outcome_text(t: &wire::FleetTarget) -> String {
    if let Some(r) = &t.rejection {
        return format!("refused: {}", r.reason);
    }
    match &t.exit_result {
        Some(wire::ExitResult {
            exit_code: Some(c), ..
        }) => format!("exit {c}"),
        Some(wire::ExitResult {
            signal_number: Some(n),
            ..
        }) => format!("signal {n}"),
        _ if t.lifecycle == 0 => "-".into(),
        _ => crate::render::lifecycle_name(t.lifecycle),
    }
}

/// The counts line: `pending 3 · running 5 · succeeded 10 · failed 2 ·
/// unreachable 0`.
pub(crate) fn counts_text(c: &wire::FleetCounts) -> String {
    let mut parts = vec![
        format!("pending {}", c.pending + c.queued),
        format!("running {}", c.running),
        format!("succeeded {}", c.succeeded),
        format!("failed {}", c.failed),
        format!("unreachable {}", c.unreachable),
    ];
    if c.cancelled > 0 {
        parts.push(format!("cancelled {}", c.cancelled));
    }
    if c.skipped > 0 {
        parts.push(format!("skipped {}", c.skipped));
    }
    parts.join(" · ")
}

/// The end table: each state with its count, then the slowest hosts.
pub(crate) fn table(r: &wire::FleetRunRecord, targets: &[wire::FleetTarget]) -> String {
    let c = r.counts.unwrap_or_default();
    let mut out = String::new();
    let rows = [
        ("pending", c.pending + c.queued),
        ("running", c.running),
        ("succeeded", c.succeeded),
        ("failed", c.failed),
        ("unreachable", c.unreachable),
        ("cancelled", c.cancelled),
        ("skipped", c.skipped),
    ];
    out.push_str("STATE        HOSTS\n");
    for (name, n) in rows {
        if n > 0
            || matches!(
                name,
                "pending" | "running" | "succeeded" | "failed" | "unreachable"
            )
        {
            out.push_str(&format!("{name:<12} {n}\n"));
        }
    }
    let mut timed: Vec<(f64, &wire::FleetTarget)> = targets
        .iter()
        .filter_map(|t| {
            seconds_between(t.release_time.as_ref(), t.end_time.as_ref()).map(|s| (s, t))
        })
        .collect();
    timed.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then_with(|| a.1.client_id.cmp(&b.1.client_id))
    });
    if !timed.is_empty() {
        let list: Vec<String> = timed
            .iter()
            .take(SLOWEST)
            .map(|(s, t)| format!("{} {s:.1}s", t.client_id))
            .collect();
        out.push_str(&format!("slowest      {}\n", list.join(", ")));
    }
    out
}

/// `rvc fleet pause|resume`: the run's state now.
pub(crate) fn state_line(r: &wire::FleetRunRecord) -> String {
    format!(
        "fleet run {}: {}\n",
        r.fleet_run_id,
        run_state_name(r.state)
    )
}

/// The summary line.
pub(crate) fn summary(r: &wire::FleetRunRecord) -> String {
    let c = r.counts.unwrap_or_default();
    let mut parts = vec![format!("{} succeeded", c.succeeded)];
    for (n, name) in [
        (c.failed, "failed"),
        (c.unreachable, "unreachable"),
        (c.cancelled, "cancelled"),
        (c.skipped, "skipped"),
        (c.pending + c.queued + c.running, "not ended"),
    ] {
        if n > 0 {
            parts.push(format!("{n} {name}"));
        }
    }
    let stop = match wire::FleetStopReason::try_from(r.stop_reason) {
        Ok(wire::FleetStopReason::MaxErrors) => " (stopped at --max-errors)",
        Ok(wire::FleetStopReason::Cancelled) => " (cancelled)",
        _ => "",
    };
    format!(
        "fleet run {}: {} host(s): {}{stop}",
        r.fleet_run_id,
        r.targets,
        parts.join(", ")
    )
}

/// The exit status of a run that ended: 0 when every target succeeded,
/// [`exit::FLEET_FAILED`] when any failed, [`exit::FLEET_INCOMPLETE`] when
/// none failed but some never ran (unreachable, cancelled, skipped).
pub(crate) fn exit_status(r: &wire::FleetRunRecord) -> u8 {
    let c = r.counts.unwrap_or_default();
    if c.failed > 0 {
        exit::FLEET_FAILED
    } else if c.succeeded == r.targets {
        0
    } else {
        exit::FLEET_INCOMPLETE
    }
}

/// A host's output, as the view needs it.
struct HostOutput {
    /// Interleaved in event order: (is stderr, bytes).
    pieces: Vec<(bool, Vec<u8>)>,
    /// Bytes beyond what was kept.
    dropped: u64,
    digest: Sha256,
}

/// One block of `--group`: the hosts, the output they share (kept up to
/// [`GROUP_KEEP_BYTES`]), the bytes not kept, and the result.
struct Block {
    hosts: Vec<String>,
    pieces: Vec<(bool, Vec<u8>)>,
    dropped: u64,
    exit: String,
}

/// The output blocks of `--group`: one per distinct (output, exit).
#[derive(Default)]
struct Groups {
    blocks: BTreeMap<[u8; 32], Block>,
}

/// Following state of one run.
struct Watch {
    view: View,
    fmt: Format,
    tty: bool,
    reported: BTreeSet<String>,
    ended: Vec<wire::FleetTarget>,
    groups: Groups,
    status_shown: bool,
    last: Option<wire::FleetRunRecord>,
}

impl Watch {
    fn clear_status(&mut self) {
        if self.status_shown {
            eprint!("\r\x1b[K");
            self.status_shown = false;
        }
    }

    fn show_status(&mut self, r: &wire::FleetRunRecord) {
        if !self.tty || self.fmt != Format::Text {
            return;
        }
        let c = r.counts.unwrap_or_default();
        let done = r.targets - (c.pending + c.queued + c.running);
        eprint!("\r\x1b[K[{done}/{}] {}", r.targets, counts_text(&c));
        let _ = std::io::stderr().flush();
        self.status_shown = true;
    }

    /// Reads a target's whole output and shows it as the view says.
    async fn report(&mut self, control: &mut Control, t: wire::FleetTarget) -> Result<(), Failure> {
        let released = t.release_time.is_some() && t.rejection.is_none();
        let mut out = HostOutput {
            pieces: Vec::new(),
            dropped: 0,
            digest: Sha256::new(),
        };
        if released && (self.fmt == Format::Text || self.view.output_dir.is_some()) {
            self.read_output(control, &t, &mut out).await?;
        }
        if self.fmt == Format::Json {
            emit(self.fmt, "FleetTarget", &t, String::new)?;
        } else if let Some(dir) = self.view.output_dir.clone() {
            write_files(&dir, &t, &out)?;
        } else if self.view.group {
            let exit = outcome_text(&t);
            out.digest.update(exit.as_bytes());
            let key: [u8; 32] = out.digest.finalize().into();
            let entry = self.groups.blocks.entry(key).or_insert_with(|| Block {
                hosts: Vec::new(),
                pieces: out.pieces,
                dropped: out.dropped,
                exit,
            });
            entry.hosts.push(t.client_id.clone());
        } else {
            self.clear_status();
            print_prefixed(&t, &out)?;
        }
        self.ended.push(t);
        Ok(())
    }

    async fn read_output(
        &mut self,
        control: &mut Control,
        t: &wire::FleetTarget,
        out: &mut HostOutput,
    ) -> Result<(), Failure> {
        let mut token = String::new();
        let mut kept = 0usize;
        loop {
            let req = wire::GetOutputRequest {
                request_id: String::new(),
                issue_uuid: t.issue_uuid.clone(),
                streams: vec![
                    wire::OutputStream::Stdout as i32,
                    wire::OutputStream::Stderr as i32,
                ],
                max_bytes: 0,
                page_token: token.clone(),
            };
            let page = match control
                .retrying(|mut c| {
                    let req = req.clone();
                    async move { c.get_output(req).await }
                })
                .await
            {
                Ok(p) => p,
                // evicted since it ended: nothing to show
                Err(f) if f.status() == rvbox_domain::error::Code::NotFound.exit_status() => {
                    return Ok(());
                }
                Err(f) => return Err(f),
            };
            for item in &page.items {
                if let Some(Item::Data(d)) = &item.item {
                    let stderr = d.stream == wire::OutputStream::Stderr as i32;
                    out.digest.update([u8::from(stderr)]);
                    out.digest.update((d.data.len() as u64).to_le_bytes());
                    out.digest.update(&d.data);
                    if self.view.group && kept + d.data.len() > GROUP_KEEP_BYTES {
                        out.dropped += d.data.len() as u64;
                        continue;
                    }
                    kept += d.data.len();
                    match out.pieces.last_mut() {
                        Some((s, bytes)) if *s == stderr => bytes.extend_from_slice(&d.data),
                        _ => out.pieces.push((stderr, d.data.clone())),
                    }
                }
            }
            if page.next_page_token.is_empty() {
                return Ok(());
            }
            token = page.next_page_token;
        }
    }

    fn finish(&mut self, r: &wire::FleetRunRecord) -> Result<u8, Failure> {
        self.clear_status();
        if self.view.group && self.fmt == Format::Text {
            print_groups(&self.groups)?;
        }
        if self.fmt == Format::Json {
            emit(
                self.fmt,
                "GetFleetRunResponse",
                &wire::GetFleetRunResponse {
                    run: Some(r.clone()),
                },
                String::new,
            )?;
        } else {
            if self.tty {
                eprint!("{}", table(r, &self.ended));
            }
            eprintln!("{}", summary(r));
        }
        Ok(exit_status(r))
    }
}

fn print_prefixed(t: &wire::FleetTarget, out: &HostOutput) -> Result<(), Failure> {
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    for (is_err, bytes) in &out.pieces {
        let sink = if *is_err { &mut stderr } else { &mut stdout };
        for line in bytes.split_inclusive(|b| *b == b'\n') {
            sink.extend_from_slice(t.client_id.as_bytes());
            sink.extend_from_slice(b": ");
            sink.extend_from_slice(line);
            if line.last() != Some(&b'\n') {
                sink.push(b'\n');
            }
        }
    }
    write_bytes(&stdout)?;
    if !stderr.is_empty() {
        let _ = std::io::stderr().write_all(&stderr);
    }
    if t.state != wire::FleetTargetState::Succeeded as i32 {
        eprintln!(
            "{}: [{}: {}]",
            t.client_id,
            state_name(t.state),
            outcome_text(t)
        );
    }
    Ok(())
}

fn print_groups(g: &Groups) -> Result<(), Failure> {
    let mut blocks: Vec<(Vec<String>, &Block)> = g
        .blocks
        .values()
        .map(|b| {
            let mut hosts = b.hosts.clone();
            hosts.sort();
            (hosts, b)
        })
        .collect();
    // the largest group first, then by its first host
    blocks.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    for (hosts, b) in blocks {
        let header = format!(
            "{} ({} host{})",
            hosts.join(","),
            hosts.len(),
            if hosts.len() == 1 { "" } else { "s" }
        );
        let rule = "-".repeat(header.chars().count().clamp(15, 78));
        let mut text = format!("{rule}\n{header}\n{rule}\n");
        if b.exit != "exit 0" {
            text.push_str(&format!("[{}]\n", b.exit));
        }
        let mut body = Vec::new();
        for (_, bytes) in &b.pieces {
            body.extend_from_slice(bytes);
        }
        if body.last().is_some_and(|c| *c != b'\n') {
            body.push(b'\n');
        }
        write_stdout(&text)?;
        write_bytes(&body)?;
        if b.dropped > 0 {
            write_stdout(&format!("[... {} more bytes not shown]\n", b.dropped))?;
        }
    }
    Ok(())
}

fn write_bytes(b: &[u8]) -> Result<(), Failure> {
    if b.is_empty() {
        return Ok(());
    }
    let mut o = std::io::stdout().lock();
    match o.write_all(b).and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(Failure::internal(format!("writing output: {e}"))),
    }
}

fn write_files(
    dir: &std::path::Path,
    t: &wire::FleetTarget,
    out: &HostOutput,
) -> Result<(), Failure> {
    // a client id is letters, digits, '.', '-', '_' (never a path)
    let io = |e: std::io::Error| Failure::internal(format!("--output-dir {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    for (is_err, bytes) in &out.pieces {
        if *is_err {
            stderr.extend_from_slice(bytes);
        } else {
            stdout.extend_from_slice(bytes);
        }
    }
    std::fs::write(dir.join(format!("{}.stdout", t.client_id)), stdout).map_err(io)?;
    std::fs::write(dir.join(format!("{}.stderr", t.client_id)), stderr).map_err(io)?;
    std::fs::write(
        dir.join(format!("{}.exit", t.client_id)),
        format!("{} {}\n", state_name(t.state), outcome_text(t)),
    )
    .map_err(io)?;
    Ok(())
}

/// Follows run `run` from `after` to its end, showing each target's output
/// as it ends; the exit status says how the run went.
pub(crate) async fn watch(
    control: &mut Control,
    run: &str,
    after: u64,
    view: View,
    fmt: Format,
) -> Result<u8, Failure> {
    let mut w = Watch {
        view,
        fmt,
        tty: std::io::stderr().is_terminal(),
        reported: BTreeSet::new(),
        ended: Vec::new(),
        groups: Groups::default(),
        status_shown: false,
        last: None,
    };
    let mut cursor = after;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    let mut progress_at = Instant::now();
    let mut pause = FIRST_PAUSE;
    let mut first = true;
    loop {
        if !first {
            if progress_at.elapsed() >= crate::conn::retry_for() {
                w.clear_status();
                return Err(Failure::unreachable(format!(
                    "no progress following fleet run {run} for {} s; follow it again with: rvc fleet follow {run}",
                    crate::conn::retry_for().as_secs()
                )));
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = &mut interrupted => return Ok(stopped(&mut w, run)),
            }
            pause = (pause * 2).min(MAX_PAUSE);
        }
        first = false;
        let req = wire::FollowFleetRunRequest {
            request_id: String::new(),
            fleet_run_id: run.to_owned(),
            after_change_seq: cursor,
        };
        let mut stream = tokio::select! {
            s = control.retrying(|mut c| {
                let req = req.clone();
                async move { c.follow_fleet_run(req).await }
            }) => s?,
            _ = &mut interrupted => return Ok(stopped(&mut w, run)),
        };
        loop {
            let next = tokio::select! {
                m = stream.message() => m,
                _ = &mut interrupted => return Ok(stopped(&mut w, run)),
            };
            match next {
                Ok(Some(resp)) => match resp.item {
                    Some(wire::follow_fleet_run_response::Item::Run(r)) => {
                        w.show_status(&r);
                        w.last = Some(r);
                    }
                    Some(wire::follow_fleet_run_response::Item::Target(t)) => {
                        if t.change_seq > cursor {
                            cursor = t.change_seq;
                            progress_at = Instant::now();
                            pause = FIRST_PAUSE;
                        }
                        if ended(t.state) && w.reported.insert(t.client_id.clone()) {
                            w.report(control, t).await?;
                            if let Some(r) = w.last.clone() {
                                w.show_status(&r);
                            }
                        }
                    }
                    None => {}
                },
                Ok(None) => {
                    if let Some(r) = w.last.clone()
                        && r.state == wire::FleetRunState::Done as i32
                    {
                        return w.finish(&r);
                    }
                    // the stream ended before the run did: resume
                    control.reconnecting();
                    control.reset();
                    break;
                }
                Err(s) if retryable(&s) => {
                    control.reconnecting();
                    control.reset();
                    break;
                }
                Err(s) => {
                    w.clear_status();
                    return Err(Failure::from_status(&s));
                }
            }
        }
    }
}

fn stopped(w: &mut Watch, run: &str) -> u8 {
    w.clear_status();
    eprintln!(
        "rvc: stopped following; fleet run {run} keeps going.\n  follow it again: rvc fleet follow {run}\n  stop it:         rvc fleet cancel {run}"
    );
    exit::INTERRUPTED_BY_USER
}

/// `rvc run` for a fleet: submit, then follow unless `background`.
pub(crate) async fn run(
    control: &mut Control,
    req: wire::RunFleetRequest,
    view: View,
    background: bool,
    fmt: Format,
) -> Result<u8, Failure> {
    let resp = control
        .retrying(|mut c| {
            let req = req.clone();
            async move { c.run_fleet(req).await }
        })
        .await
        .map_err(|f| f.with_request_id(&req.request_id))?;
    if fmt == Format::Text {
        eprintln!(
            "fleet run {}: {} target(s)",
            resp.fleet_run_id, resp.targets
        );
    }
    if background {
        emit(fmt, "RunFleetResponse", &resp, || {
            format!("{}\n", resp.fleet_run_id)
        })?;
        return Ok(0);
    }
    if fmt == Format::Json {
        emit(fmt, "RunFleetResponse", &resp, String::new)?;
    }
    watch(control, &resp.fleet_run_id, 0, view, fmt).await
}

/// Every target of a run (all pages).
pub(crate) async fn all_targets(
    control: &mut Control,
    run: &str,
    state: i32,
    selector: &str,
) -> Result<Vec<wire::FleetTarget>, Failure> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let req = wire::ListFleetTargetsRequest {
            request_id: String::new(),
            fleet_run_id: run.to_owned(),
            page_size: 1000,
            page_token: token.clone(),
            state,
            selector: selector.to_owned(),
        };
        let page = control
            .retrying(|mut c| {
                let req = req.clone();
                async move { c.list_fleet_targets(req).await }
            })
            .await?;
        out.extend(page.targets);
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        token = page.next_page_token;
    }
}

/// `rvc fleet list`: runs, newest first.
pub(crate) fn runs_table(runs: &[wire::FleetRunRecord]) -> String {
    let mut out = String::from(
        "RUN                                   STATE     HOSTS  OK     FAILED  COMMAND\n",
    );
    for r in runs {
        let c = r.counts.unwrap_or_default();
        out.push_str(&format!(
            "{:<37} {:<9} {:<6} {:<6} {:<7} {}\n",
            r.fleet_run_id,
            run_state_name(r.state),
            r.targets,
            c.succeeded,
            c.failed + c.unreachable,
            crate::render::command_summary(r.spec.as_ref(), 30)
        ));
    }
    out
}

/// `rvc fleet show`: the run's record, its table and summary.
pub(crate) fn record_text(r: &wire::FleetRunRecord, targets: &[wire::FleetTarget]) -> String {
    let s = r.selection.clone().unwrap_or_default();
    let mut sel = Vec::new();
    if s.all {
        sel.push("all".to_owned());
    }
    if !s.client_glob.is_empty() {
        sel.push(format!("target {}", s.client_glob));
    }
    if !s.selector.is_empty() {
        sel.push(format!("label {}", s.selector));
    }
    if !s.client_ids.is_empty() {
        sel.push(format!("clients {}", s.client_ids.join(",")));
    }
    let limit = |l: &Option<wire::FleetLimit>| -> String {
        match l.as_ref().and_then(|l| l.limit) {
            Some(wire::fleet_limit::Limit::Count(n)) => n.to_string(),
            Some(wire::fleet_limit::Limit::Percent(p)) => format!("{p}%"),
            None => "none".into(),
        }
    };
    let mut out = String::new();
    out.push_str(&format!("fleet run   {}\n", r.fleet_run_id));
    out.push_str(&format!(
        "run         {}\n",
        crate::render::command_summary(r.spec.as_ref(), 60)
    ));
    out.push_str(&format!("selection   {}\n", sel.join(", ")));
    out.push_str(&format!(
        "rate        max-parallel {}, max-errors {}\n",
        limit(&r.max_parallel),
        limit(&r.max_errors)
    ));
    out.push_str(&format!("state       {}\n", run_state_name(r.state)));
    out.push_str(&format!(
        "created     {}\n",
        crate::render::time_text(r.create_time.as_ref())
    ));
    if r.late_until_time.is_some() {
        out.push_str(&format!(
            "late until  {}\n",
            crate::render::time_text(r.late_until_time.as_ref())
        ));
    }
    if r.done_time.is_some() {
        out.push_str(&format!(
            "done        {}\n",
            crate::render::time_text(r.done_time.as_ref())
        ));
    }
    out.push('\n');
    out.push_str(&table(r, targets));
    out.push_str(&summary(r));
    out.push('\n');
    out
}

/// `rvc fleet targets`: one row per target.
pub(crate) fn targets_table(targets: &[wire::FleetTarget]) -> String {
    let mut out = String::from("CLIENT           STATE        RESULT      TIME    UUID\n");
    for t in targets {
        let time = seconds_between(t.release_time.as_ref(), t.end_time.as_ref())
            .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s"));
        let result = if ended(t.state) {
            outcome_text(t)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<16} {:<12} {:<11} {:<7} {}\n",
            t.client_id,
            state_name(t.state),
            result,
            time,
            t.issue_uuid
        ));
    }
    out
}

/// Parses a target state name for `--state`.
pub(crate) fn parse_state(text: &str) -> Result<i32, Failure> {
    let upper = format!("FLEET_TARGET_STATE_{}", text.to_ascii_uppercase());
    wire::FleetTargetState::from_str_name(&upper)
        .filter(|s| *s != wire::FleetTargetState::Unspecified)
        .map(|s| s as i32)
        .ok_or_else(|| {
            Failure::usage(format!(
                "--state {text:?}: one of pending, queued, running, succeeded, failed, unreachable, cancelled, skipped"
            ))
        })
}
