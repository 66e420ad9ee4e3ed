//! `rvc run --script PATH`: the script's bytes go in the `RunCommand`
//! request with a descriptor (display name, size, SHA-256) the server and
//! then the client check them against; the client runs the script only
//! once it holds it whole and verified.
//!
//! On a terminal, a progress bar shows the request's bytes as they leave
//! on the control socket (counted by the connection), then that the
//! server stored them; when stderr is not a terminal nothing is drawn.

use std::io::IsTerminal as _;
use std::path::Path;
use std::time::Duration;

use rvbox_domain::limits::MAX_SCRIPT_BYTES;
use rvbox_proto::v1 as wire;
use sha2::Digest as _;

use crate::conn::Control;
use crate::exit::Failure;

/// A script read from the operator's file.
pub(crate) struct Script {
    pub(crate) descriptor: wire::ScriptDescriptor,
    pub(crate) bytes: Vec<u8>,
}

/// Reads and describes the script at `path` (at most 10 MiB).
pub(crate) fn load(path: &Path) -> Result<Script, Failure> {
    let shown = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| Failure::usage(format!("--script {shown}: {e}")))?;
    if !meta.is_file() {
        return Err(Failure::usage(format!(
            "--script {shown}: not a regular file"
        )));
    }
    if meta.len() > MAX_SCRIPT_BYTES {
        return Err(Failure::usage(format!(
            "--script {shown}: {} bytes; a script is at most {MAX_SCRIPT_BYTES} bytes (10 MiB)",
            meta.len()
        )));
    }
    // read at most one byte past the ceiling: a file that grew meanwhile
    // is refused, never read without bound
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    let file =
        std::fs::File::open(path).map_err(|e| Failure::usage(format!("--script {shown}: {e}")))?;
    std::io::Read::read_to_end(
        &mut std::io::Read::take(file, MAX_SCRIPT_BYTES + 1),
        &mut bytes,
    )
    .map_err(|e| Failure::usage(format!("--script {shown}: {e}")))?;
    if bytes.is_empty() || bytes.len() as u64 > MAX_SCRIPT_BYTES {
        return Err(Failure::usage(format!(
            "--script {shown}: {} bytes; a script is 1 to {MAX_SCRIPT_BYTES} bytes",
            bytes.len()
        )));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| !n.is_empty() && n.len() <= 255)
        .unwrap_or_else(|| "script".to_owned());
    Ok(Script {
        descriptor: wire::ScriptDescriptor {
            display_basename: name,
            size_bytes: bytes.len() as u64,
            sha256: sha2::Sha256::digest(&bytes).to_vec(),
        },
        bytes,
    })
}

/// The progress bar of an upload, or nothing off a terminal.
fn bar(size: u64, name: &str) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(size),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let style =
        indicatif::ProgressStyle::with_template("rvc: {msg} [{wide_bar}] {bytes}/{total_bytes}")
            .map_or_else(
                |_| indicatif::ProgressStyle::default_bar(),
                |s| s.progress_chars("=> "),
            );
    bar.set_style(style);
    bar.set_message(format!("uploading {name}"));
    Some(bar)
}

/// Sends `req` (whose script is `size` bytes) with a progress bar on a
/// terminal; retried like every mutation.
pub(crate) async fn run_command(
    control: &mut Control,
    req: wire::RunCommandRequest,
    size: u64,
    name: &str,
) -> Result<wire::RunCommandResponse, Failure> {
    let progress = bar(size, name);
    let sent = control.sent_counter();
    let start = sent.load(std::sync::atomic::Ordering::Relaxed);
    let call = control.retrying(|mut c| {
        let req = req.clone();
        async move { c.run_command(req).await }
    });
    tokio::pin!(call);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let result = loop {
        tokio::select! {
            r = &mut call => break r,
            _ = tick.tick() => {
                if let Some(b) = &progress {
                    // the socket also carries framing: what left is at
                    // least the script once the count passes its size
                    let n = sent.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(start);
                    if n >= size && b.position() < size {
                        b.set_message(format!("storing {name}"));
                    }
                    b.set_position(n.min(size));
                }
            }
        }
    };
    if let Some(b) = progress {
        match &result {
            Ok(_) => {
                b.set_position(size);
                b.abandon_with_message(format!("{name}: stored on the server"));
            }
            Err(_) => b.abandon_with_message(format!("{name}: not stored")),
        }
    }
    result
}
