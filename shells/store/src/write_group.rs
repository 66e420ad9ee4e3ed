//! Command writes of many connections in one durable commit.
//!
//! A fleet run moves thousands of commands through `dispatched` and
//! `accepted` at once, each a one-row write. Committed one by one, each
//! costs a WAL sync, and the executor spends its time waiting on the disk.
//! A [`WriteGroup`] performs such writes inside one transaction: each is
//! its own savepoint (a refused write leaves no trace and the others go
//! on), and the group commits once. Nothing a group did is answered before
//! its commit: the executor holds every completion until
//! [`WriteGroup::commit`] returns, and when the commit fails, or any write
//! fails on a store error, none of the group's writes is kept and each of
//! them is answered `UNAVAILABLE`.
//!
//! The single writes ([`Store::mark_dispatched`], [`Store::record_accepted`])
//! are groups of one, so there is one implementation of each.
//!
//! Must never: answer a write before its group committed; keep part of a
//! group whose commit failed; run the crash point or metric of a write
//! before the commit that made it durable.

use rusqlite::Connection;
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;

use crate::StoreError;
use crate::commands::{CommandView, accept_in, expect, load_view, set_lifecycle};
use crate::crash::points;
use crate::mutations::OpError;
use crate::sessions::{SessionFence, check_fence};
use crate::store::Store;

/// What a write of the group announces once the group committed.
#[derive(Debug, Clone, Copy)]
enum Committed {
    Dispatched { revision: u64 },
    Accepted { revision: u64 },
}

/// Single-command writes sharing one transaction (see the module docs).
/// Dropped without [`WriteGroup::commit`], it rolls back.
#[derive(Debug)]
pub struct WriteGroup<'s> {
    store: &'s mut Store,
    committed: Vec<Committed>,
    /// The first store failure; the group can then only roll back.
    failed: Option<String>,
    open: bool,
}

impl Store {
    /// Opens a write group (`BEGIN IMMEDIATE`).
    ///
    /// # Errors
    /// When the transaction cannot begin.
    pub fn write_group(&mut self) -> Result<WriteGroup<'_>, StoreError> {
        self.conn
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(|e| StoreError::sqlite("begin write group", e))?;
        Ok(WriteGroup {
            store: self,
            committed: Vec::new(),
            failed: None,
            open: true,
        })
    }
}

impl WriteGroup<'_> {
    /// The store, for reads inside the group's transaction (they see the
    /// group's writes so far).
    #[must_use]
    pub fn store(&self) -> &Store {
        self.store
    }

    /// Writes performed so far (refused ones not counted).
    #[must_use]
    pub fn writes(&self) -> usize {
        self.committed.len()
    }

    /// queued -> dispatched, persisted before the frame is written (plan
    /// §6.4, R-6.4-04).
    ///
    /// # Errors
    /// `CONFLICT` when the command is no longer queued at `revision`,
    /// `NOT_FOUND`, `UNAVAILABLE`, or a store failure (which fails the
    /// whole group).
    pub fn mark_dispatched(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        revision: u64,
    ) -> Result<(), OpError> {
        self.on_command(session, issue, |conn, view| {
            expect(view, &[Lifecycle::Queued], revision)?;
            set_lifecycle(conn, issue, Lifecycle::Dispatched)?;
            Ok(())
        })?;
        self.committed.push(Committed::Dispatched { revision });
        Ok(())
    }

    /// dispatched -> accepted: a positive `CommandAccepted` at the
    /// dispatched revision; records the shell the client resolved.
    ///
    /// # Errors
    /// As [`WriteGroup::mark_dispatched`].
    pub fn record_accepted(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        revision: u64,
        resolved_shell: i32,
    ) -> Result<(), OpError> {
        self.on_command(session, issue, |conn, view| {
            accept_in(conn, view, revision, resolved_shell)
        })?;
        self.committed.push(Committed::Accepted { revision });
        Ok(())
    }

    /// One write on one command: scope check, current view, the session
    /// check, the write in a savepoint.
    fn on_command(
        &mut self,
        session: Option<SessionFence>,
        issue: &[u8; 16],
        write: impl FnOnce(&Connection, &CommandView) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        if let Some(e) = &self.failed {
            return Err(OpError::Refused(DomainError::new(
                Code::Unavailable,
                format!("an earlier write of the group failed: {e}"),
            )));
        }
        if self.store.conn.is_autocommit() {
            // SQLite ended the transaction on an error (I/O, full disk):
            // a write now would commit on its own
            return Err(self.fail(StoreError::RolledBack {
                context: "write group",
                reason: "SQLite ended the transaction early".into(),
            }));
        }
        let view = match load_view(&self.store.conn, issue) {
            Ok(v) => v,
            Err(OpError::Store(e)) => return Err(self.fail(e)),
            Err(refused) => return Err(refused),
        };
        let conn = &self.store.conn;
        let key = uuid::Uuid::from_bytes(*issue).hyphenated().to_string();
        self.store.health.check_writable(&[
            (wire::ScopeKind::Command, key.as_str()),
            (wire::ScopeKind::Client, view.client_id.as_str()),
        ])?;
        match check_fence(
            conn,
            &self.store.metrics.writes_fenced,
            session.as_ref(),
            &view.client_id,
        ) {
            Ok(()) => {}
            Err(OpError::Store(e)) => return Err(self.fail(e)),
            Err(refused) => return Err(refused),
        }
        if let Err(e) = conn.execute_batch("SAVEPOINT command_write") {
            return Err(self.fail(StoreError::sqlite("begin command write", e)));
        }
        match write(conn, &view) {
            Ok(()) => match conn.execute_batch("RELEASE command_write") {
                Ok(()) => Ok(()),
                Err(e) => Err(self.fail(StoreError::sqlite("release command write", e))),
            },
            Err(OpError::Refused(refusal)) => {
                if let Err(e) =
                    conn.execute_batch("ROLLBACK TO command_write; RELEASE command_write")
                {
                    return Err(self.fail(StoreError::sqlite("roll back a refused write", e)));
                }
                Err(OpError::Refused(refusal))
            }
            Err(OpError::Store(e)) => Err(self.fail(e)),
        }
    }

    /// Marks the group failed (it will only roll back) and returns the
    /// failure for the write that met it.
    fn fail(&mut self, e: StoreError) -> OpError {
        tracing::error!(error = %e, "a grouped command write failed; the group rolls back");
        self.failed.get_or_insert_with(|| e.to_string());
        OpError::Store(e)
    }

    /// Commits the group: one durable commit for every write in it. Then,
    /// and only then, each write's crash point, metric and log.
    ///
    /// # Errors
    /// The first store failure of a write, or the commit's; nothing of the
    /// group is kept.
    pub fn commit(mut self) -> Result<usize, StoreError> {
        if self.failed.is_none() && self.store.conn.is_autocommit() {
            self.failed = Some("SQLite ended the transaction early".into());
        }
        if let Some(reason) = self.failed.take() {
            self.rollback();
            self.store.metrics.write_groups_failed.inc();
            return Err(StoreError::RolledBack {
                context: "write group",
                reason,
            });
        }
        if let Err(e) = self.store.conn.execute_batch("COMMIT") {
            self.rollback();
            self.store.metrics.write_groups_failed.inc();
            let e = StoreError::sqlite("commit write group", e);
            tracing::error!(error = %e, writes = self.committed.len(), "write group failed; nothing kept");
            return Err(e);
        }
        self.open = false;
        let n = self.committed.len();
        self.store.metrics.write_groups_committed.inc();
        #[allow(clippy::cast_precision_loss)]
        self.store.metrics.write_group_writes.observe(n as f64);
        for c in std::mem::take(&mut self.committed) {
            match c {
                Committed::Dispatched { revision } => {
                    self.store.hook.at(points::DISPATCH_AFTER_COMMIT);
                    self.store.metrics.command_transition("dispatched");
                    tracing::debug!(revision, "command dispatched");
                }
                Committed::Accepted { revision } => {
                    self.store.hook.at(points::ACCEPT_AFTER_COMMIT);
                    self.store.metrics.command_transition("accepted");
                    tracing::info!(revision, "command accepted by its client");
                }
            }
        }
        Ok(n)
    }

    fn rollback(&mut self) {
        if self.open {
            self.open = false;
            // an I/O error may already have ended the transaction
            if self.store.conn.is_autocommit() {
                return;
            }
            if let Err(e) = self.store.conn.execute_batch("ROLLBACK") {
                tracing::error!(error = %e, "write group rollback failed");
            }
        }
    }
}

impl Drop for WriteGroup<'_> {
    fn drop(&mut self) {
        self.rollback();
    }
}

/// Whether the command is still dispatched at `revision` (a dispatch sent
/// again must not overtake a signal decided since).
///
/// # Errors
/// `CONFLICT` when it changed, `NOT_FOUND`, or a store failure.
pub fn still_dispatched(
    store: &Store,
    session: Option<SessionFence>,
    issue: &[u8; 16],
    revision: u64,
) -> Result<(), OpError> {
    let v = store.command_view(issue)?;
    check_fence(
        &store.conn,
        &store.metrics.writes_fenced,
        session.as_ref(),
        &v.client_id,
    )?;
    if v.lifecycle != Lifecycle::Dispatched || v.revision != revision {
        return Err(OpError::Refused(DomainError::new(
            Code::Conflict,
            "the command changed since the dispatch decision",
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::Store;
    use crate::entropy::OsEntropy;

    fn store(dir: &std::path::Path) -> Store {
        crate::store::test_store(dir)
    }

    fn queued(s: &mut Store, client: &str) -> [u8; 16] {
        let id = crate::entropy::uuid_v7(&OsEntropy, 1_800_000_000_000).unwrap();
        let req = wire::RunCommandRequest {
            request_id: uuid::Uuid::from_bytes(id).hyphenated().to_string(),
            client_id: client.into(),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText("true".into())),
                ..Default::default()
            }),
            ..Default::default()
        };
        s.run_command(&req, 1_800_000_000_000).unwrap();
        id
    }

    /// SQLite may end a transaction on its own (an I/O error, a full
    /// disk): the group's later writes must not commit one by one, and the
    /// group must not report success.
    #[test]
    fn a_transaction_sqlite_ended_early_fails_the_group_and_commits_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let a = queued(&mut s, "web-1");
        let b = queued(&mut s, "web-2");
        let mut group = s.write_group().unwrap();
        group.mark_dispatched(None, &a, 1).unwrap();
        // what SQLite does to the transaction after such an error
        group.store.conn.execute_batch("ROLLBACK").unwrap();
        assert!(matches!(
            group.mark_dispatched(None, &b, 1),
            Err(OpError::Store(StoreError::RolledBack { .. }))
        ));
        assert!(matches!(group.commit(), Err(StoreError::RolledBack { .. })));
        assert_eq!(s.command_view(&a).unwrap().lifecycle, Lifecycle::Queued);
        assert_eq!(
            s.command_view(&b).unwrap().lifecycle,
            Lifecycle::Queued,
            "the write after the early end did not commit on its own"
        );
        // and the store goes on
        s.mark_dispatched(&b, 1).unwrap();
        assert_eq!(s.command_view(&b).unwrap().lifecycle, Lifecycle::Dispatched);
    }
}
