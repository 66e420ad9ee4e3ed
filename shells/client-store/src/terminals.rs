//! The terminals' durable records (docs/terminals.md): the opening record
//! before a holder starts, the holder's record (its socket, pid and birth
//! time, the host's boot id, its token, its cgroup) before `PtyOpened`
//! is sent, and the end, kept a day so that the server's questions about
//! a closed terminal are answered from it. Each step is one committed
//! statement followed by its named crash point.

use prost::Message as _;
use rusqlite::params;
use rvbox_client_core::machine::RestoredTerminal;
use rvbox_client_core::ops::ClosedTerminal;
use rvbox_client_core::process::HolderIdentity;
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_storage::StoreError;
use rvbox_storage::db::Cached as _;

use crate::crash;
use crate::store::ClientStore;

const OPENING: i64 = 1;
const OPEN: i64 = 2;
const CLOSED: i64 = 3;

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn u64_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl ClientStore {
    /// A new terminal's opening record (or the same terminal's again while
    /// it is still opening: a holder is started anew).
    ///
    /// # Errors
    /// SQLite failures, or a terminal that is already open or closed.
    pub fn terminal_opening(
        &mut self,
        terminal: &Uuid7,
        resolved_shell: wire::ShellType,
        open: &wire::PtyOpen,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let n = self
            .conn
            .execute_cached(
                "INSERT INTO terminals (terminal_id, state, resolved_shell, open_request, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (terminal_id) DO UPDATE SET
                     resolved_shell = excluded.resolved_shell,
                     open_request = excluded.open_request
                 WHERE state = ?2",
                params![
                    terminal.as_bytes().as_slice(),
                    OPENING,
                    resolved_shell as i32,
                    open.encode_to_vec(),
                    now_ms
                ],
            )
            .map_err(|e| StoreError::sqlite("record a terminal's opening", e))?;
        if n != 1 {
            return Err(StoreError::Integrity(format!(
                "terminal {terminal} is already open or closed"
            )));
        }
        self.hook.at(crash::TERMINAL_OPENING_AFTER_COMMIT);
        Ok(())
    }

    /// The started holder's record: the terminal is open.
    ///
    /// # Errors
    /// SQLite failures, or a terminal that is not opening.
    pub fn terminal_opened(
        &mut self,
        terminal: &Uuid7,
        holder: &HolderIdentity,
    ) -> Result<(), StoreError> {
        let n = self
            .conn
            .execute_cached(
                "UPDATE terminals SET state = ?2, holder_socket = ?3, holder_pid = ?4,
                     holder_start_ticks = ?5, holder_boot_id = ?6, holder_token = ?7,
                     holder_cgroup = ?8
                 WHERE terminal_id = ?1 AND state = ?9",
                params![
                    terminal.as_bytes().as_slice(),
                    OPEN,
                    holder.socket,
                    i64::from(holder.pid),
                    i64_of(holder.start_ticks),
                    holder.boot_id,
                    holder.token.as_slice(),
                    holder.cgroup,
                    OPENING
                ],
            )
            .map_err(|e| StoreError::sqlite("record a terminal's holder", e))?;
        if n != 1 {
            return Err(StoreError::Integrity(format!(
                "terminal {terminal} is not opening"
            )));
        }
        self.hook.at(crash::TERMINAL_OPENED_AFTER_COMMIT);
        Ok(())
    }

    /// The terminal's end (its holder's record goes with it).
    ///
    /// # Errors
    /// SQLite failures, or a terminal this store does not hold.
    pub fn terminal_closed(
        &mut self,
        terminal: &Uuid7,
        closed: &ClosedTerminal,
    ) -> Result<(), StoreError> {
        let n = self
            .conn
            .execute_cached(
                "UPDATE terminals SET state = ?2, exit_result = ?3, final_offset = ?4,
                     close_reason = ?5, closed_ms = ?6, holder_token = NULL
                 WHERE terminal_id = ?1",
                params![
                    terminal.as_bytes().as_slice(),
                    CLOSED,
                    closed.exit_result.encode_to_vec(),
                    i64_of(closed.final_offset),
                    closed.reason,
                    closed.closed_at_ms
                ],
            )
            .map_err(|e| StoreError::sqlite("record a terminal's end", e))?;
        if n != 1 {
            return Err(StoreError::Integrity(format!(
                "terminal {terminal} has no record"
            )));
        }
        self.hook.at(crash::TERMINAL_CLOSED_AFTER_COMMIT);
        Ok(())
    }

    /// Forgets terminals closed at or before `closed_before_ms`, and
    /// opening records created at or before it; returns how many went.
    ///
    /// # Errors
    /// SQLite failures.
    pub fn expire_terminals(&mut self, closed_before_ms: i64) -> Result<usize, StoreError> {
        self.conn
            .execute_cached(
                "DELETE FROM terminals
                 WHERE (state = ?1 AND closed_ms <= ?3) OR (state = ?2 AND created_ms <= ?3)",
                params![CLOSED, OPENING, closed_before_ms],
            )
            .map_err(|e| StoreError::sqlite("forget old terminals", e))
    }

    /// Every terminal record, oldest first.
    ///
    /// # Errors
    /// SQLite failures, and a row that does not decode (named).
    pub fn restore_terminals(&self) -> Result<Vec<RestoredTerminal>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT terminal_id, state, resolved_shell, open_request, created_ms,
                     holder_socket, holder_pid, holder_start_ticks, holder_boot_id, holder_token,
                     holder_cgroup, exit_result, final_offset, close_reason, closed_ms
                 FROM terminals ORDER BY created_ms, terminal_id",
            )
            .map_err(|e| StoreError::sqlite("read terminals", e))?;
        type Holder = (
            Option<String>,
            Option<i64>,
            Option<i64>,
            Option<String>,
            Option<Vec<u8>>,
            Option<String>,
        );
        type Closed = (Option<Vec<u8>>, Option<i64>, Option<String>, Option<i64>);
        let rows = stmt
            .query_map([], |r| {
                let holder: Holder = (
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                    r.get(8)?,
                    r.get(9)?,
                    r.get(10)?,
                );
                let closed: Closed = (r.get(11)?, r.get(12)?, r.get(13)?, r.get(14)?);
                Ok((
                    r.get::<_, Vec<u8>>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i32>(2)?,
                    r.get::<_, Vec<u8>>(3)?,
                    r.get::<_, i64>(4)?,
                    holder,
                    closed,
                ))
            })
            .map_err(|e| StoreError::sqlite("read terminals", e))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, state, shell, open, created_ms, holder, closed) =
                row.map_err(|e| StoreError::sqlite("read terminals", e))?;
            let bad = |what: &str| StoreError::Integrity(format!("a terminal row has {what}"));
            let key = <[u8; 16]>::try_from(id.as_slice()).map_err(|_| bad("a short id"))?;
            let terminal = Uuid7::from_bytes("terminal_id", key).map_err(|_| bad("a non-v7 id"))?;
            let open = wire::PtyOpen::decode(open.as_slice())
                .map_err(|_| bad("an open request that does not decode"))?;
            let holder = match (state, holder) {
                (
                    OPEN,
                    (Some(socket), Some(pid), Some(ticks), Some(boot_id), Some(token), cgroup),
                ) => Some(HolderIdentity {
                    socket,
                    pid: u32::try_from(pid).map_err(|_| bad("a holder pid out of range"))?,
                    start_ticks: u64_of(ticks),
                    boot_id,
                    token: <[u8; 32]>::try_from(token.as_slice())
                        .map_err(|_| bad("a short holder token"))?,
                    cgroup,
                }),
                (OPEN, _) => return Err(bad("an open state without its holder")),
                _ => None,
            };
            let closed = match (state, closed) {
                (CLOSED, (Some(exit), final_offset, reason, Some(closed_at_ms))) => {
                    Some(ClosedTerminal {
                        exit_result: wire::ExitResult::decode(exit.as_slice())
                            .map_err(|_| bad("an exit result that does not decode"))?,
                        final_offset: final_offset.map_or(0, u64_of),
                        reason: reason.unwrap_or_default(),
                        closed_at_ms,
                    })
                }
                (CLOSED, _) => return Err(bad("a closed state without its end")),
                _ => None,
            };
            out.push(RestoredTerminal {
                terminal,
                resolved_shell: wire::ShellType::try_from(shell).unwrap_or_default(),
                open,
                created_ms,
                holder,
                closed,
            });
        }
        Ok(out)
    }
}
