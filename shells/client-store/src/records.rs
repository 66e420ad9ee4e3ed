//! Command records beyond acceptance (plan §7.1, §7.3-§7.4): the session
//! generation floor, tombstone lookups for a snapshot, a reconciliation
//! result applied durably, the launch journal (`launch_prepared` with the
//! launcher's identity, `launch_authorized`, running, ended) with one
//! named crash point after each commit, the private wrapper file, stdin
//! writes, and the records read back at startup.

use prost::Message as _;
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use rvbox_client_core::machine::RestoredRecord;
use rvbox_client_core::ops::StdinOutcome;
use rvbox_client_core::process::LaunchIdentity;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_storage::StoreError;
use rvbox_storage::db::Cached as _;

use crate::crash;
use crate::store::ClientStore;

/// Prefix of generated wrapper files (`$0` of the shell shows it; plan
/// §7.3: documented behaviour).
pub const WRAPPER_PREFIX: &str = ".rvbox-";
/// Most stdin bytes one command keeps durable while unwritten.
pub const MAX_STDIN_PENDING_BYTES: u64 = 4 * 1024 * 1024;

const META_GENERATION: &str = "last_generation";

/// What [`ClientStore::materialize`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Materialize {
    /// The wrapper file is durable at this path.
    Written(String),
    /// No file was written, and none will be: the working directory does
    /// not resolve to a directory under an allowed root (the reason names
    /// it, what it resolves to and the roots).
    Refused(String),
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn u64_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl ClientStore {
    /// The highest session generation this installation has seen.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn last_generation(&self) -> Result<u64, StoreError> {
        let v: Option<Vec<u8>> = self
            .conn
            .query_row_cached(
                "SELECT value FROM client_meta WHERE key = ?1",
                params![META_GENERATION],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read generation", e))?;
        Ok(v.and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map_or(0, u64::from_le_bytes))
    }

    /// Raises the generation floor to `generation` (never lowers it).
    ///
    /// # Errors
    /// SQLite failures.
    pub fn record_generation(&mut self, generation: u64) -> Result<(), StoreError> {
        if generation <= self.last_generation()? {
            return Ok(());
        }
        self.conn
            .execute_cached(
                "INSERT INTO client_meta (key, value) VALUES (?1, ?2)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                params![META_GENERATION, generation.to_le_bytes().to_vec()],
            )
            .map_err(|e| StoreError::sqlite("record generation", e))?;
        Ok(())
    }

    /// The tombstones held for `issues`.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn tombstones_of(&self, issues: &[Uuid7]) -> Result<Vec<(Uuid7, [u8; 32])>, StoreError> {
        let mut out = Vec::new();
        for id in issues {
            if let Some(h) = self.tombstone(id)? {
                out.push((*id, h));
            }
        }
        Ok(out)
    }

    /// A checked `ReconcileResult`, durably: terminate intents and the
    /// server's revisions, in one transaction, before capacity is reported.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn apply_reconcile(
        &mut self,
        terminate: &[Uuid7],
        discard: &[Uuid7],
        revisions: &[(Uuid7, u64)],
    ) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin reconciliation", e))?;
        for id in terminate {
            tx.execute_cached(
                "UPDATE commands SET intent = 1 WHERE issue_uuid = ?1",
                params![id.as_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("record terminate intent", e))?;
        }
        for id in discard {
            // only a terminal record is discarded; a restart finishes it
            tx.execute_cached(
                "UPDATE commands SET intent = 2 WHERE issue_uuid = ?1 AND launch = 5 AND intent = 0",
                params![id.as_bytes().as_slice()],
            )
            .map_err(|e| StoreError::sqlite("record discard intent", e))?;
        }
        for (id, rev) in revisions {
            tx.execute_cached(
                "UPDATE commands SET revision = MAX(revision, ?2) WHERE issue_uuid = ?1",
                params![id.as_bytes().as_slice(), i64_of(*rev)],
            )
            .map_err(|e| StoreError::sqlite("adopt revision", e))?;
        }
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit reconciliation", e))?;
        self.hook.at(crash::RECONCILE_AFTER_COMMIT);
        Ok(())
    }

    fn launch_step(
        &mut self,
        issue: &Uuid7,
        sql: &str,
        extra: &[&dyn rusqlite::ToSql],
        point: &'static str,
    ) -> Result<(), StoreError> {
        let key = issue.as_bytes().to_vec();
        let mut all: Vec<&dyn rusqlite::ToSql> = vec![&key];
        all.extend_from_slice(extra);
        let n = self
            .conn
            .execute_cached(sql, all.as_slice())
            .map_err(|e| StoreError::sqlite("record launch step", e))?;
        if n != 1 {
            return Err(StoreError::Integrity(format!(
                "command {issue} is not in the launch phase this step follows"
            )));
        }
        self.hook.at(point);
        Ok(())
    }

    /// `launch_prepared`: the blocked launcher's identity, committed (and,
    /// with `synchronous=FULL`, synced) before anything is released. The
    /// command takes a running slot.
    ///
    /// # Errors
    /// SQLite failures, or a command not in `accepted`.
    pub fn launch_prepared(
        &mut self,
        issue: &Uuid7,
        id: &LaunchIdentity,
    ) -> Result<(), StoreError> {
        let pid = i64::from(id.launcher_pid);
        let pgid = i64::from(id.process_group);
        let birth = i64_of(id.birth_ticks);
        let cgroup = id.cgroup.clone();
        self.launch_step(
            issue,
            "UPDATE commands SET launch = 2, slot = 2, launcher_pid = ?2, process_group = ?3,
                 birth_ticks = ?4, cgroup_path = ?5
             WHERE issue_uuid = ?1 AND launch = 1",
            &[&pid, &pgid, &birth, &cgroup],
            crash::LAUNCH_PREPARED_AFTER_FSYNC,
        )
    }

    /// `launch_authorized`, committed and synced before the release byte.
    ///
    /// # Errors
    /// SQLite failures, or a command not prepared.
    pub fn launch_authorized(&mut self, issue: &Uuid7) -> Result<(), StoreError> {
        self.launch_step(
            issue,
            "UPDATE commands SET launch = 3 WHERE issue_uuid = ?1 AND launch = 2",
            &[],
            crash::LAUNCH_AUTHORIZED_AFTER_FSYNC,
        )
    }

    /// The launcher reported `exec`.
    ///
    /// # Errors
    /// SQLite failures, or a command not authorized.
    pub fn launch_running(&mut self, issue: &Uuid7) -> Result<(), StoreError> {
        let running = wire::Lifecycle::Running as i32;
        self.launch_step(
            issue,
            "UPDATE commands SET launch = 4, lifecycle = ?2 WHERE issue_uuid = ?1 AND launch = 3",
            &[&running],
            crash::LAUNCH_RUNNING_AFTER_COMMIT,
        )
    }

    /// Back to `accepted` after a transient failure, the launcher verified
    /// dead (never after authorization).
    ///
    /// # Errors
    /// SQLite failures, or a command already authorized.
    pub fn launch_unprepared(&mut self, issue: &Uuid7) -> Result<(), StoreError> {
        self.launch_step(
            issue,
            "UPDATE commands SET launch = 1, slot = 1, launcher_pid = NULL, process_group = NULL,
                 birth_ticks = NULL, cgroup_path = NULL
             WHERE issue_uuid = ?1 AND launch IN (1, 2)",
            &[],
            crash::LAUNCH_UNPREPARED_AFTER_COMMIT,
        )
    }

    /// The terminal event is spooled: the slot is released, and the wrapper
    /// file is removed once that is committed.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn launch_ended(
        &mut self,
        issue: &Uuid7,
        lifecycle: wire::Lifecycle,
    ) -> Result<(), StoreError> {
        let wrapper: Option<String> = self
            .conn
            .query_row_cached(
                "SELECT wrapper_path FROM commands WHERE issue_uuid = ?1",
                params![issue.as_bytes().as_slice()],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| StoreError::sqlite("read wrapper", e))?
            .flatten();
        let l = lifecycle as i32;
        self.launch_step(
            issue,
            "UPDATE commands SET launch = 5, slot = 0, lifecycle = ?2, wrapper_path = NULL
             WHERE issue_uuid = ?1",
            &[&l],
            crash::LAUNCH_ENDED_AFTER_COMMIT,
        )?;
        if let Some(path) = wrapper {
            self.remove_wrapper(std::path::Path::new(&path));
        }
        Ok(())
    }

    pub(crate) fn remove_wrapper(&self, path: &std::path::Path) {
        match self.fs.remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a wrapper file")
            }
        }
    }

    /// Writes the private wrapper file of `issue` under `cwd` (plan §7.3):
    /// owner-only, written to a temporary name, synced, renamed, and the
    /// directory synced; its path is recorded with the command.
    ///
    /// `cwd` is resolved first (symbolic links, `.` and `..`), and the
    /// file is written only into a resolved directory under one of `roots`
    /// (`exec.allowed_cwd_roots`; none: not checked): a link inside an
    /// allowed root that leads outside it never gets a file written there.
    /// The launcher checks the resolved directory again before the tree
    /// starts.
    ///
    /// # Errors
    /// I/O failures (a transient launch failure), SQLite failures.
    pub fn materialize(
        &mut self,
        issue: &Uuid7,
        cwd: &str,
        roots: &[String],
        content: &[u8],
    ) -> Result<Materialize, StoreError> {
        let dir = match self.fs.resolve_dir(std::path::Path::new(cwd)) {
            Ok(d) => d,
            Err(e) => {
                let reason = format!("working directory {cwd} cannot be resolved: {e}");
                tracing::warn!(%issue, %reason, "wrapper not written");
                return Ok(Materialize::Refused(reason));
            }
        };
        let allowed = roots.is_empty()
            || roots.iter().any(|root| {
                self.fs
                    .resolve_dir(std::path::Path::new(root))
                    .is_ok_and(|r| dir.starts_with(r))
            });
        if !allowed {
            let reason = format!(
                "working directory {cwd} resolves to {}, outside every allowed root (exec.allowed_cwd_roots: {})",
                dir.display(),
                roots.join(", ")
            );
            tracing::warn!(%issue, %reason, "wrapper not written");
            return Ok(Materialize::Refused(reason));
        }
        let path = dir.join(format!("{WRAPPER_PREFIX}{issue}.sh"));
        rvbox_storage::atomic::write_new(
            self.fs.as_ref(),
            &path,
            content,
            self.hook.as_ref(),
            crash::MATERIALIZE_BEFORE_RENAME,
        )?;
        let text = path.to_string_lossy().into_owned();
        self.conn
            .execute_cached(
                "UPDATE commands SET wrapper_path = ?2 WHERE issue_uuid = ?1",
                params![issue.as_bytes().as_slice(), text],
            )
            .map_err(|e| StoreError::sqlite("record wrapper", e))?;
        Ok(Materialize::Written(text))
    }

    /// One stdin write, durable until the child has it: decoded, checked
    /// against its raw length and SHA-256, and the newline appended when
    /// it asks for one. A payload that fails the checks is
    /// [`StdinOutcome::Invalid`] and nothing is stored.
    ///
    /// # Errors
    /// SQLite failures, or more unwritten stdin than the bound.
    pub fn stdin_write(
        &mut self,
        issue: &Uuid7,
        w: &wire::StdinWrite,
    ) -> Result<StdinOutcome, StoreError> {
        let mut bytes = match decode_stdin(w) {
            Ok(b) => b,
            Err(reason) => {
                tracing::warn!(%issue, write_seq = w.write_seq, %reason, "stdin write refused");
                return Ok(StdinOutcome::Invalid(reason));
            }
        };
        if w.newline == wire::StdinNewline::Append as i32 {
            bytes.push(b'\n');
        }
        let (write_seq, close_after) = (w.write_seq, w.close_after);
        let key = issue.as_bytes().as_slice();
        // only the next write: one after a write that failed is refused,
        // so a gap never reaches the child
        let next: i64 = self
            .conn
            .query_row_cached(
                "SELECT stdin_next_seq FROM commands WHERE issue_uuid = ?1",
                params![key],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("read stdin cursor", e))?;
        if u64_of(next) != write_seq {
            return Err(StoreError::Integrity(format!(
                "stdin write {write_seq} of {issue} is not the next one ({next})"
            )));
        }
        let pending: i64 = self
            .conn
            .query_row_cached(
                "SELECT COALESCE(SUM(len), 0) FROM stdin_writes WHERE issue_uuid = ?1 AND state = 1",
                params![key],
                |r| r.get(0),
            )
            .map_err(|e| StoreError::sqlite("sum pending stdin", e))?;
        if u64_of(pending).saturating_add(bytes.len() as u64) > MAX_STDIN_PENDING_BYTES {
            return Err(StoreError::Integrity(format!(
                "command {issue} holds {pending} unwritten stdin bytes; the bound is {MAX_STDIN_PENDING_BYTES}"
            )));
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite("begin stdin write", e))?;
        tx.execute_cached(
            "INSERT INTO stdin_writes (issue_uuid, write_seq, len, sha256, state, payload)
             VALUES (?1, ?2, ?3, ?4, 1, ?5) ON CONFLICT DO NOTHING",
            params![
                key,
                i64_of(write_seq),
                i64_of(bytes.len() as u64),
                rvbox_segment::sha256(&bytes).as_slice(),
                bytes.as_slice()
            ],
        )
        .map_err(|e| StoreError::sqlite("record stdin write", e))?;
        tx.execute_cached(
            "UPDATE commands SET stdin_next_seq = MAX(stdin_next_seq, ?2),
                 stdin_closed = stdin_closed OR ?3
             WHERE issue_uuid = ?1",
            params![key, i64_of(write_seq.saturating_add(1)), close_after],
        )
        .map_err(|e| StoreError::sqlite("advance stdin", e))?;
        tx.commit()
            .map_err(|e| StoreError::sqlite("commit stdin write", e))?;
        self.hook.at(crash::STDIN_AFTER_COMMIT);
        Ok(StdinOutcome::Stored(bytes))
    }

    /// A stdin write reached the child: its durable copy is removed, so
    /// that the unwritten bound counts only what still waits.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn stdin_written(&mut self, issue: &Uuid7, write_seq: u64) -> Result<(), StoreError> {
        self.conn
            .execute_cached(
                "DELETE FROM stdin_writes WHERE issue_uuid = ?1 AND write_seq = ?2",
                params![issue.as_bytes().as_slice(), i64_of(write_seq)],
            )
            .map_err(|e| StoreError::sqlite("remove written stdin", e))?;
        self.hook.at(crash::STDIN_WRITTEN_AFTER_COMMIT);
        Ok(())
    }

    /// Every command record, for the client core at startup.
    ///
    /// # Errors
    /// SQLite failures, and a row that does not decode.
    pub fn restore_records(&self) -> Result<Vec<RestoredRecord>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT issue_uuid, request_hash, revision, resolved_shell, spec, lifecycle, launch,
                     launcher_pid, process_group, birth_ticks, cgroup_path, intent, script_len,
                     script_sha256, script_received, script_committed, wrapper_path,
                     stdin_next_seq, stdin_closed
                 FROM commands ORDER BY accepted_ms, issue_uuid",
            )
            .map_err(|e| StoreError::sqlite("read commands", e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, Vec<u8>>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i32>(3)?,
                    r.get::<_, Vec<u8>>(4)?,
                    r.get::<_, i32>(5)?,
                    r.get::<_, i64>(6)?,
                    (
                        r.get::<_, Option<i64>>(7)?,
                        r.get::<_, Option<i64>>(8)?,
                        r.get::<_, Option<i64>>(9)?,
                        r.get::<_, Option<String>>(10)?,
                    ),
                    r.get::<_, i64>(11)?,
                    (
                        r.get::<_, Option<i64>>(12)?,
                        r.get::<_, Option<Vec<u8>>>(13)?,
                        r.get::<_, i64>(14)?,
                        r.get::<_, i64>(15)?,
                    ),
                    r.get::<_, Option<String>>(16)?,
                    (r.get::<_, i64>(17)?, r.get::<_, i64>(18)?),
                ))
            })
            .map_err(|e| StoreError::sqlite("read commands", e))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, hash, rev, shell, spec, lifecycle, launch, ident, intent, up, wrapper, stdin) =
                row.map_err(|e| StoreError::sqlite("read commands", e))?;
            let bad = |what: &str| StoreError::Integrity(format!("a command row has {what}"));
            let key = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| bad("a short id"))?;
            let issue = Uuid7::from_bytes("issue_uuid", key).map_err(|_| bad("a non-v7 id"))?;
            let request_hash =
                <[u8; 32]>::try_from(hash.as_slice()).map_err(|_| bad("a short hash"))?;
            let spec =
                wire::ExecutionSpec::decode(spec.as_slice()).map_err(|_| bad("a bad spec"))?;
            let identity = match ident {
                (Some(pid), Some(pgid), Some(birth), cgroup) => Some(LaunchIdentity {
                    launcher_pid: u32::try_from(pid).unwrap_or(0),
                    process_group: u32::try_from(pgid).unwrap_or(0),
                    birth_ticks: u64_of(birth),
                    cgroup,
                }),
                _ => None,
            };
            let script = match (up.0, up.1.clone()) {
                (Some(len), Some(sha)) => Some((
                    u64_of(len),
                    <[u8; 32]>::try_from(sha.as_slice()).map_err(|_| bad("a short script hash"))?,
                )),
                _ => None,
            };
            out.push(RestoredRecord {
                issue,
                request_hash,
                revision: u64_of(rev),
                resolved_shell: wire::ShellType::try_from(shell).unwrap_or_default(),
                spec,
                lifecycle: wire::Lifecycle::try_from(lifecycle).unwrap_or_default(),
                launch: u8::try_from(launch).unwrap_or(1),
                identity,
                terminate_intent: intent == 1,
                discard_intent: intent == 2,
                script,
                script_received: u64_of(up.2),
                script_committed: up.3 != 0,
                wrapper_path: wrapper,
                stdin_next_seq: u64_of(stdin.0).max(1),
                stdin_closed: stdin.1 != 0,
            });
        }
        Ok(out)
    }
}

/// The raw bytes of a stdin write, checked against its raw length and
/// SHA-256; the reason names what is wrong.
fn decode_stdin(w: &wire::StdinWrite) -> Result<Vec<u8>, String> {
    let raw_length = u64::from(w.raw_length);
    if raw_length > rvbox_domain::limits::MAX_STDIN_WRITE_BYTES {
        return Err(format!(
            "stdin_write.raw_length {raw_length} exceeds {}",
            rvbox_domain::limits::MAX_STDIN_WRITE_BYTES
        ));
    }
    let compression = wire::Compression::try_from(w.compression)
        .map_err(|_| format!("stdin_write.compression {} is unknown", w.compression))?;
    crate::script::decode_payload(compression, &w.payload, w.raw_length, &w.raw_sha256)
        .map_err(|e| format!("stdin_write.payload: {e}"))
}
