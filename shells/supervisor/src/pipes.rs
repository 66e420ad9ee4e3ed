//! Pipe readers and the stdin writer (plan §7.4, §7.2).
//!
//! One thread per output pipe reads raw bytes, newline or not, in chunks of
//! at most [`READ_CHUNK_BYTES`], and hands each to the command's output
//! queue without ever waiting for the consumer (a full queue turns into an
//! exact `Dropped` count). One thread per command writes stdin in order.

use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{SystemTime, UNIX_EPOCH};

use rvbox_domain::ids::Uuid7;
use rvbox_domain::limits::MAX_RAW_CHUNK_BYTES;
use rvbox_proto::v1 as wire;

use crate::hub::Hub;

/// Largest chunk a reader reads at once.
pub(crate) const READ_CHUNK_BYTES: usize = 64 * 1024;
const _: () = assert!(READ_CHUNK_BYTES as u64 == MAX_RAW_CHUNK_BYTES);

/// Stdin writes one command may have queued.
pub(crate) const STDIN_QUEUE_WRITES: usize = 64;

/// Wall-clock milliseconds (a shell may read the clock).
pub(crate) fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the stdin writer reports.
pub(crate) trait StdinSink: Send + Sync + 'static {
    /// One write reached the pipe.
    fn written(&self, issue: Uuid7, write_seq: u64);
}

/// One queued stdin operation.
#[derive(Debug)]
pub(crate) enum StdinOp {
    /// Write these bytes.
    Write { write_seq: u64, bytes: Vec<u8> },
    /// Close after the writes before it.
    Close,
}

/// Starts the reader of one output pipe.
pub(crate) fn spawn_reader<C: Send + 'static>(
    hub: Arc<Hub<C>>,
    issue: Uuid7,
    stream: wire::OutputStream,
    mut pipe: File,
    activity: Arc<AtomicU64>,
) -> io::Result<()> {
    let name = match stream {
        wire::OutputStream::Stderr => "rvbox-stderr",
        _ => "rvbox-stdout",
    };
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let mut buf = vec![0u8; READ_CHUNK_BYTES];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let bytes = buf.get(..n).map(<[u8]>::to_vec).unwrap_or_default();
                        activity.fetch_add(u64::try_from(n).unwrap_or(0), Ordering::Relaxed);
                        hub.push_output(&issue, stream, bytes, wall_ms());
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!(%issue, stream = stream.as_str_name(), error = %e, "output pipe read failed; treated as end of file");
                        break;
                    }
                }
            }
            tracing::debug!(%issue, stream = stream.as_str_name(), "output pipe reached end of file");
            hub.eof(&issue, stream);
        })
        .map(|_| ())
}

/// Starts the stdin writer of one command. Each completed write is
/// reported; a broken pipe is logged, the write and every later one are
/// not reported (they did not reach the child), and the writer ends.
pub(crate) fn spawn_stdin_writer(
    sink: Arc<dyn StdinSink>,
    issue: Uuid7,
    mut pipe: File,
    ops: Receiver<StdinOp>,
    queued: Arc<AtomicUsize>,
    activity: Arc<AtomicU64>,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("rvbox-stdin".into())
        .spawn(move || {
            while let Ok(op) = ops.recv() {
                match op {
                    StdinOp::Write { write_seq, bytes } => {
                        queued.fetch_sub(1, Ordering::AcqRel);
                        match pipe.write_all(&bytes) {
                            Ok(()) => {
                                activity.fetch_add(
                                    u64::try_from(bytes.len()).unwrap_or(0),
                                    Ordering::Relaxed,
                                );
                                sink.written(issue, write_seq);
                            }
                            Err(e) => {
                                tracing::warn!(%issue, write_seq, error = %e, "stdin write failed; later writes are discarded");
                                return;
                            }
                        }
                    }
                    StdinOp::Close => {
                        tracing::debug!(%issue, "stdin closed after the queued writes");
                        return;
                    }
                }
            }
        })
        .map(|_| ())
}
