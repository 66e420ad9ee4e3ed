//! The group journal: one sequential flush for a group that touches many
//! segment files (plan §5.3, "append and fsync (possibly as a configured
//! group commit)").
//!
//! Flushing 64 segment files that each grew by one small record costs the
//! filesystem 64 inode updates and 64 scattered data blocks: several times
//! one sequential write. So a group that touches [`SYNCFS_THRESHOLD`]
//! segment files or more, and whose records fit in [`JOURNAL_FRAME_MAX`],
//! appends its records to the segment files as always (page cache only),
//! appends the same bytes, with where each run went, as one checksummed
//! frame to `journal/groups.journal`, and makes that one file durable. Only
//! then does the metadata transaction commit, and only then is anything
//! acknowledged: the committed-offset protocol is unchanged, the durable
//! copy of a group's bytes is simply in the journal until the next
//! checkpoint.
//!
//! A *checkpoint* ([`Store::checkpoint_journal`]) runs when the journal
//! would pass [`JOURNAL_CAPACITY`] and at the end of recovery: one
//! filesystem sync makes every segment byte durable in its own file, the
//! journal epoch in `store_meta` is advanced (so frames of the old epoch
//! are never applied again) and the file is emptied.
//!
//! Recovery replays the frames of the current epoch before it scans the
//! segments: for each live segment a frame wrote to, it finds where the
//! file's valid records end and, when that is short of `committed_end`,
//! re-appends the journal's copy from the run covering that point. Only
//! runs that end at or before `committed_end` are applied (a frame whose
//! group never committed is ignored), later frames win over earlier ones
//! for the same offset, and the ordinary scan then verifies every record.
//! Replay is idempotent: a crash during it is recovered by running it again.

use crate::db::Cached as _;
use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};
use rvbox_segment::journal::{JournalEntry, decode_frames, encode_frame, frame_len};
use rvbox_segment::scan;

use crate::error::StoreError;
use crate::fs::{SegmentFile, StoreFs};
use crate::layout::Layout;
use crate::store::{Store, record_limits, to_u64};

pub use crate::events::SYNCFS_THRESHOLD;

/// The journal is checkpointed before it would grow past this many bytes.
pub const JOURNAL_CAPACITY: u64 = 16 * 1024 * 1024;
/// Largest frame written to the journal; a larger group syncs its segment
/// files directly (its data then outweighs the per-file cost anyway).
pub const JOURNAL_FRAME_MAX: u64 = 1024 * 1024;

const EPOCH_KEY: &str = "journal_epoch";

/// The open journal file and its epoch.
#[derive(Debug)]
pub(crate) struct GroupJournal {
    file: Box<dyn SegmentFile>,
    /// Bytes of whole frames in the file.
    len: u64,
    epoch: u64,
}

/// What journal replay did at recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JournalReplay {
    /// Valid frames of the current epoch found.
    pub frames: u64,
    /// Segments whose lost committed bytes were re-appended.
    pub segments_redone: u64,
    /// Bytes re-appended.
    pub bytes_redone: u64,
}

fn read_epoch(conn: &rusqlite::Connection) -> Result<u64, StoreError> {
    let v: Option<Vec<u8>> = conn
        .query_row_cached(
            "SELECT value FROM store_meta WHERE key = ?1",
            params![EPOCH_KEY],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("read journal epoch", e))?;
    match v {
        Some(b) => <[u8; 8]>::try_from(b.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| StoreError::Integrity("store_meta.journal_epoch is not 8 bytes".into())),
        None => {
            conn.execute_cached(
                "INSERT INTO store_meta (key, value) VALUES (?1, ?2)",
                params![EPOCH_KEY, 1u64.to_le_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("create journal epoch", e))?;
            Ok(1)
        }
    }
}

/// Opens (creating on first use) the journal file of `layout`.
pub(crate) fn open(
    fs: &dyn StoreFs,
    layout: &Layout,
    conn: &rusqlite::Connection,
) -> Result<GroupJournal, StoreError> {
    let epoch = read_epoch(conn)?;
    let path = layout.journal_file();
    let file = match fs.open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let f = fs
                .create_new(&path)
                .map_err(|e| StoreError::io("create group journal", &path, e))?;
            let dir = layout.journal_dir();
            fs.sync_dir(&dir)
                .map_err(|e| StoreError::io("sync journal directory", &dir, e))?;
            f
        }
        Err(e) => return Err(StoreError::io("open group journal", &path, e)),
    };
    let len = file
        .len()
        .map_err(|e| StoreError::io("stat group journal", &path, e))?;
    Ok(GroupJournal { file, len, epoch })
}

impl Store {
    /// Makes a group durable through the journal (see the module docs).
    /// `Ok(false)`: the journal does not apply (disabled, or the frame is
    /// larger than [`JOURNAL_FRAME_MAX`]) and the caller syncs the segment
    /// files instead.
    ///
    /// # Errors
    /// [`StoreError`] when the journal could not be written or synced; the
    /// frame is cut off again, and nothing of the group is acknowledged.
    pub(crate) fn journal_group(
        &mut self,
        entries: &[JournalEntry<'_>],
        created: &std::collections::BTreeSet<std::path::PathBuf>,
    ) -> Result<bool, StoreError> {
        if self.journal.is_none() || frame_len(entries) > JOURNAL_FRAME_MAX {
            return Ok(false);
        }
        let need = frame_len(entries);
        if self
            .journal
            .as_ref()
            .is_some_and(|j| j.len.saturating_add(need) > JOURNAL_CAPACITY)
        {
            self.checkpoint_journal()?;
        }
        let path = self.layout.journal_file();
        let Some(j) = self.journal.as_mut() else {
            return Ok(false);
        };
        let frame = encode_frame(j.epoch, entries)
            .map_err(|e| StoreError::Integrity(format!("journal frame: {e}")))?;
        let written = j
            .file
            .append(&frame)
            .map_err(|e| StoreError::io("append group journal", &path, e))
            .and_then(|()| {
                j.file
                    .sync_data()
                    .map_err(|e| StoreError::io("sync group journal", &path, e))
            });
        if let Err(e) = written {
            // cut the frame off again: frames after a broken one would never
            // be replayed, so a journal that cannot be cut is not used again
            if j.file.truncate(j.len).is_err() {
                tracing::error!(error = %e, "group journal could not be cut back; groups now sync their segment files");
                self.journal = None;
            }
            return Err(e);
        }
        j.len = j.len.saturating_add(frame.len() as u64);
        // R-5.3-11: a new segment's directory entry is durable before the
        // metadata that names it commits
        let dirs: Vec<&std::path::Path> = created.iter().map(std::path::PathBuf::as_path).collect();
        self.fs
            .sync_dirs(&dirs)
            .map_err(|(dir, e)| StoreError::io("sync segment directory", dir, e))?;
        self.metrics.journal_groups.inc();
        Ok(true)
    }

    /// Checkpoints the group journal: one filesystem sync makes every
    /// segment byte durable in its own file, the epoch advances (old frames
    /// are never applied again), and the journal is emptied. Nothing to do
    /// when the journal is empty.
    ///
    /// # Errors
    /// [`StoreError`] when the sync or the epoch update failed; the journal
    /// then keeps its frames and stays the durable copy.
    pub fn checkpoint_journal(&mut self) -> Result<(), StoreError> {
        let Some(j) = self.journal.as_ref() else {
            return Ok(());
        };
        if j.len == 0 {
            return Ok(());
        }
        let next = j.epoch.saturating_add(1);
        let dir = self.layout.segments_dir();
        self.fs
            .sync_filesystem(&dir)
            .map_err(|e| StoreError::io("checkpoint: sync segment filesystem", &dir, e))?;
        self.conn
            .execute_cached(
                "UPDATE store_meta SET value = ?2 WHERE key = ?1",
                params![EPOCH_KEY, next.to_le_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("advance journal epoch", e))?;
        let Some(j) = self.journal.as_mut() else {
            return Ok(());
        };
        j.epoch = next;
        let dropped = j.len;
        if let Err(e) = j.file.truncate(0) {
            // the old frames can never apply again (their epoch is gone),
            // but new ones appended after them would never be reached
            tracing::error!(error = %e, "group journal could not be emptied; groups now sync their segment files");
            self.journal = None;
        } else {
            j.len = 0;
        }
        self.metrics.journal_checkpoints.inc();
        tracing::debug!(epoch = next, bytes = dropped, "group journal checkpointed");
        Ok(())
    }

    /// Re-appends committed segment bytes the filesystem lost from the
    /// journal's frames of the current epoch (see the module docs).
    ///
    /// # Errors
    /// [`StoreError`] when the journal or the database cannot be read; a
    /// segment that cannot be redone is left to the scan, which records it.
    pub(crate) fn replay_journal(&mut self) -> Result<JournalReplay, StoreError> {
        let mut out = JournalReplay::default();
        let path = self.layout.journal_file();
        let Some(j) = self.journal.as_ref() else {
            return Ok(out);
        };
        let len = j
            .file
            .len()
            .map_err(|e| StoreError::io("stat group journal", &path, e))?;
        // bounded: the journal never holds more than its capacity plus one frame
        let read = len.min(JOURNAL_CAPACITY.saturating_add(JOURNAL_FRAME_MAX));
        let mut buf = vec![0u8; usize::try_from(read).unwrap_or(0)];
        j.file
            .read_exact_at(&mut buf, 0)
            .map_err(|e| StoreError::io("read group journal", &path, e))?;
        let max = u32::try_from(JOURNAL_FRAME_MAX).unwrap_or(u32::MAX);
        let frames = decode_frames(&buf, j.epoch, max);
        out.frames = frames.frames as u64;
        if let Some(stop) = frames.stop {
            tracing::info!(
                ?stop,
                valid = frames.valid_len,
                len,
                "group journal ends early"
            );
        }
        // per segment: offset -> bytes, a later frame winning
        let mut runs: BTreeMap<([u8; 16], u32), BTreeMap<u64, std::ops::Range<usize>>> =
            BTreeMap::new();
        for e in &frames.entries {
            runs.entry((e.issue_uuid, e.ordinal))
                .or_default()
                .insert(e.offset, e.range.clone());
        }
        for ((issue, ordinal), runs) in &runs {
            match self.redo_segment(issue, *ordinal, runs, &buf) {
                Ok(0) => {}
                Ok(n) => {
                    out.segments_redone += 1;
                    out.bytes_redone = out.bytes_redone.saturating_add(n);
                }
                Err(e) => {
                    tracing::error!(error = %e, ordinal, "journal replay of a segment failed; the scan records it");
                }
            }
        }
        Ok(out)
    }

    /// Redoes one segment; returns the bytes re-appended.
    fn redo_segment(
        &mut self,
        issue: &[u8; 16],
        ordinal: u32,
        runs: &BTreeMap<u64, std::ops::Range<usize>>,
        buf: &[u8],
    ) -> Result<u64, StoreError> {
        let committed_end: Option<i64> = self
            .conn
            .query_row_cached(
                "SELECT s.committed_end FROM command_segments s
                 JOIN commands c ON c.issue_uuid = s.issue_uuid
                 WHERE s.issue_uuid = ?1 AND s.ordinal = ?2
                   AND s.state IN ('active', 'sealed') AND c.retention = 'retained'",
                params![issue.as_slice(), ordinal],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("load segment for journal replay", e))?;
        let Some(committed_end) = committed_end.map(to_u64) else {
            return Ok(0); // evicted, rotated or never committed
        };
        let path = self
            .layout
            .segment_path(issue, ordinal)
            .ok_or_else(|| StoreError::Integrity("segment ordinal out of range".into()))?;
        let mut file = match self.fs.open(&path) {
            Ok(f) => f,
            // a committed segment's entry was synced before its metadata:
            // a missing file is loss for the scan to record, not to redo
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(StoreError::io("open segment", &path, e)),
        };
        let file_len = file
            .len()
            .map_err(|e| StoreError::io("stat segment", &path, e))?;
        let mut data = vec![0u8; usize::try_from(file_len.min(committed_end)).unwrap_or(0)];
        file.read_exact_at(&mut data, 0)
            .map_err(|e| StoreError::io("read segment", &path, e))?;
        let valid = scan(&data, committed_end, &record_limits()).valid_prefix_end;
        if valid >= committed_end {
            return Ok(0);
        }
        // the run that covers the first invalid byte (or starts there)
        let Some((&start, _)) = runs
            .range(..=valid)
            .next_back()
            .filter(|(s, r)| s.saturating_add(r.len() as u64) > valid || **s == valid)
        else {
            return Ok(0); // not in the journal: the scan records the loss
        };
        file.truncate(start)
            .map_err(|e| StoreError::io("truncate segment for journal replay", &path, e))?;
        let mut pos = start;
        while pos < committed_end {
            let Some(range) = runs.get(&pos) else { break };
            let end = pos.saturating_add(range.len() as u64);
            if end > committed_end {
                break; // a group that never committed
            }
            let Some(bytes) = buf.get(range.clone()) else {
                break;
            };
            file.append(bytes)
                .map_err(|e| StoreError::io("journal replay append", &path, e))?;
            pos = end;
        }
        // the bytes changed under any earlier verification: scan it again
        self.conn
            .execute_cached(
                "UPDATE command_segments SET verified = 0 WHERE issue_uuid = ?1 AND ordinal = ?2",
                params![issue.as_slice(), ordinal],
            )
            .map_err(|e| StoreError::sqlite("clear the verified fact", e))?;
        tracing::warn!(
            ordinal,
            from = start,
            to = pos,
            committed_end,
            "segment bytes lost by the filesystem re-appended from the group journal"
        );
        Ok(pos.saturating_sub(start))
    }
}
