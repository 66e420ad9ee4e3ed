-- Terminals (docs/terminals.md): one row per PTY session of this client,
-- from the open request until a day after it closed.
--
-- state 1 (opening): the open request is checked and recorded; its holder
--   may or may not have started (a crash before state 2 leaves no way to
--   prove a holder, and a new start reclaims the terminal's cgroup).
-- state 2 (open): the holder's record, durable before PtyOpened is sent:
--   socket, pid and its /proc start time, the host's boot id, the token it
--   proves itself with, and the terminal's cgroup.
-- state 3 (closed): how it ended, answered to the server for a day.
CREATE TABLE terminals (
    terminal_id         BLOB PRIMARY KEY CHECK (length(terminal_id) = 16),
    state               INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
    resolved_shell      INTEGER NOT NULL,
    open_request        BLOB NOT NULL,
    created_ms          INTEGER NOT NULL,
    holder_socket       TEXT,
    holder_pid          INTEGER CHECK (holder_pid IS NULL OR holder_pid >= 1),
    holder_start_ticks  INTEGER,
    holder_boot_id      TEXT,
    holder_token        BLOB CHECK (holder_token IS NULL OR length(holder_token) = 32),
    holder_cgroup       TEXT,
    exit_result         BLOB,
    final_offset        INTEGER CHECK (final_offset IS NULL OR final_offset >= 0),
    close_reason        TEXT,
    closed_ms           INTEGER,
    CHECK (state <> 2 OR (holder_pid IS NOT NULL AND holder_token IS NOT NULL)),
    CHECK (state <> 3 OR (exit_result IS NOT NULL AND closed_ms IS NOT NULL))
) STRICT;

CREATE INDEX terminals_by_state ON terminals (state, closed_ms, created_ms);
