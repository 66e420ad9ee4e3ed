//! The control socket: a Unix socket (mode 0600) taking one command line
//! at a time (`ROUTE VERB [ARGS]`, see [`crate::command`]) and answering
//! `ok` plus the routes' state, or `error: ...`, then a blank line.

use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::proxy::Proxy;

/// Longest command line.
pub const MAX_LINE: u64 = 1024;

/// Binds the control socket at `path` (a stale socket there is replaced;
/// any other file is left alone and refused).
///
/// # Errors
/// The path holds something else, or the socket cannot be bound.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{} is in use by a running proxy", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves control connections for ever.
pub async fn serve(listener: UnixListener, proxy: Arc<Proxy>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(session(stream, Arc::clone(&proxy)));
            }
            Err(e) => {
                tracing::warn!(error = %e, "control accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

async fn session(stream: UnixStream, proxy: Arc<Proxy>) {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r.take(MAX_LINE * 64));
    let mut line = String::new();
    loop {
        line.clear();
        match (&mut lines).take(MAX_LINE).read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let answer = if line.ends_with('\n')
            || line.len() < usize::try_from(MAX_LINE).unwrap_or(usize::MAX)
        {
            proxy.execute(line.trim())
        } else {
            format!("error: command longer than {MAX_LINE} bytes")
        };
        if w.write_all(format!("{answer}\n\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Sends one command line to the control socket at `path`; returns the
/// answer (without its closing blank line).
///
/// # Errors
/// The socket cannot be reached.
pub async fn send(path: &Path, line: &str) -> std::io::Result<String> {
    let stream = UnixStream::connect(path).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("control socket {}: {e}", path.display()))
    })?;
    let (r, mut w) = stream.into_split();
    w.write_all(format!("{}\n", line.trim()).as_bytes()).await?;
    let mut reader = BufReader::new(r.take(1 << 20));
    let mut answer = String::new();
    let mut l = String::new();
    loop {
        l.clear();
        if reader.read_line(&mut l).await? == 0 || l == "\n" {
            break;
        }
        answer.push_str(&l);
    }
    Ok(answer.trim_end().to_owned())
}
