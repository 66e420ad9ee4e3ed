//! Recovery at open (plan §5.1 applied to the client, §7.1): every spool
//! segment is read back up to its committed end plus a bounded tail and
//! scanned (`rvbox_storage::segment_io`, the server's discipline). An
//! uncommitted tail, left by an append whose commit never happened, is cut
//! and counted: it was never acknowledged to anyone. Committed bytes that
//! no longer read back are damage: an incident with the exact lost ranges
//! makes local health dirty. Segment files without a row are debris of an
//! uncommitted first append, or of a removal a crash interrupted, and are
//! removed.

use std::collections::BTreeSet;

use rvbox_proto::v1 as wire;
use rvbox_segment::{Recovery, parse_segment_file_name, segment_file_name};
use rvbox_storage::StoreError;
use rvbox_storage::segment_io::{cut_tail, read_and_scan};

use crate::incidents::{self, NewLocalIncident};
use crate::metrics::StepLabel;
use crate::script::{script_limits, script_seal_bytes};
use crate::spool::spool_limits;
use crate::store::ClientStore;

/// Bytes a spool segment can legitimately hold: its fill threshold plus
/// one record at its largest (the scan reads no more than this past the
/// committed end).
pub const SPOOL_SEAL_BYTES: u64 = 2 * 1024 * 1024;
/// Most files of the spool directory examined for debris at one open.
pub const MAX_LISTED_FILES: usize = 1_000_000;

/// What recovery did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryReport {
    /// Segments whose uncommitted tail was cut.
    pub tails_truncated: u64,
    /// Bytes cut.
    pub tail_bytes: u64,
    /// Segments with committed damage (each an incident).
    pub segments_damaged: u64,
    /// Segment files without a row, removed.
    pub orphans_removed: u64,
    /// Scripts whose bytes were all durable but not yet verified, verified
    /// and made launch-eligible.
    pub scripts_committed: u64,
}

pub(crate) fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

impl ClientStore {
    pub(crate) fn recover(&mut self, now_ms: i64) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let rows: Vec<(Vec<u8>, u32, i64, i64)> = {
            let mut stmt = self
                .conn
                .prepare_cached("SELECT issue_uuid, ordinal, committed_end, kind FROM segments")
                .map_err(|e| StoreError::sqlite("list segments", e))?;
            let rows = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .map_err(|e| StoreError::sqlite("list segments", e))?;
            rows.collect::<Result<_, _>>()
                .map_err(|e| StoreError::sqlite("list segments", e))?
        };
        let spool_dir = self.layout().spool_dir();
        let scripts_dir = self.layout().scripts_dir();
        let mut known: BTreeSet<std::path::PathBuf> = BTreeSet::new();
        for (id, ordinal, committed, kind) in rows {
            let key = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| {
                StoreError::Integrity("a segment's command id is not 16 bytes".into())
            })?;
            let Some(name) = segment_file_name(&key, ordinal) else {
                return Err(StoreError::Integrity(
                    "a segment ordinal is out of range".into(),
                ));
            };
            let (dir, seal, limits) = if kind == 3 {
                (&scripts_dir, script_seal_bytes(), script_limits())
            } else {
                (&spool_dir, SPOOL_SEAL_BYTES, spool_limits())
            };
            let committed = u64::try_from(committed).unwrap_or(0);
            let path = dir.join(&name);
            known.insert(path.clone());
            let scanned = read_and_scan(self.fs.as_ref(), &path, committed, seal, &limits)?;
            match &scanned.scan.recovery {
                Recovery::Clean if !scanned.overlong() => {}
                Recovery::Clean | Recovery::TruncateTail { .. } => {
                    let cut = cut_tail(self.fs.as_ref(), &path, committed)?;
                    report.tails_truncated += 1;
                    report.tail_bytes = report.tail_bytes.saturating_add(cut);
                    self.metrics
                        .recovery
                        .get_or_create(&StepLabel {
                            step: "tail_truncated",
                        })
                        .inc();
                    tracing::info!(segment = %name, bytes = cut, "uncommitted spool tail cut");
                }
                Recovery::CommittedDamage {
                    lost,
                    tail_beyond_committed,
                } => {
                    if *tail_beyond_committed {
                        cut_tail(self.fs.as_ref(), &path, committed)?;
                    }
                    let missing = scanned.file_len < committed;
                    let kind = if missing {
                        wire::IncidentKind::MissingCommittedBytes
                    } else {
                        wire::IncidentKind::ChecksumMismatch
                    };
                    let ranges: Vec<String> = lost
                        .iter()
                        .map(|r| format!("{}..{}", r.start, r.end))
                        .collect();
                    incidents::record(
                        &self.conn,
                        self.entropy.as_ref(),
                        &NewLocalIncident {
                            kind,
                            scope_kind: wire::ScopeKind::Segment,
                            scope_key: format!("{}/{ordinal}", hex(&key)),
                            summary: format!(
                                "spool segment {name} lost committed bytes {}",
                                ranges.join(", ")
                            ),
                            evidence: format!(
                                "committed_end={committed} file_len={} lost={}",
                                scanned.file_len,
                                ranges.join(",")
                            )
                            .into_bytes(),
                        },
                        now_ms,
                    )?;
                    self.metrics.incidents.inc();
                    report.segments_damaged += 1;
                    self.metrics
                        .recovery
                        .get_or_create(&StepLabel {
                            step: "segment_damaged",
                        })
                        .inc();
                }
            }
        }
        for dir in [&spool_dir, &scripts_dir] {
            let names = self
                .fs
                .list(dir, MAX_LISTED_FILES)
                .map_err(|e| StoreError::io("list segment directory", dir, e))?;
            let mut removed = 0u64;
            for name in names {
                let path = dir.join(&name);
                if known.contains(&path) || parse_segment_file_name(&name).is_none() {
                    continue;
                }
                match self.fs.remove_file(&path) {
                    Ok(()) => {
                        removed += 1;
                        self.metrics
                            .recovery
                            .get_or_create(&StepLabel {
                                step: "orphan_removed",
                            })
                            .inc();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io("remove orphan segment", &path, e)),
                }
            }
            if removed > 0 {
                self.fs
                    .sync_dir(dir)
                    .map_err(|e| StoreError::io("sync segment directory", dir, e))?;
            }
            report.orphans_removed += removed;
        }
        let (committed, mismatched) = self.finish_complete_scripts()?;
        report.scripts_committed = committed;
        for issue in mismatched {
            incidents::record(
                &self.conn,
                self.entropy.as_ref(),
                &NewLocalIncident {
                    kind: wire::IncidentKind::ChecksumMismatch,
                    scope_kind: wire::ScopeKind::Command,
                    scope_key: issue.to_string(),
                    summary: format!(
                        "the durable script of {issue} does not match its descriptor's SHA-256"
                    ),
                    evidence: Vec::new(),
                },
                now_ms,
            )?;
            self.metrics.incidents.inc();
        }
        Ok(report)
    }
}
