-- Interactive terminals (docs/terminals.md). A terminal is a row here and
-- a holder process on its client. Every operator mutation of it is
-- idempotent through control_mutations (owner: the client).
CREATE TABLE pty_sessions (
    pty_session_id   BLOB PRIMARY KEY CHECK (length(pty_session_id) = 16),
    client_id        TEXT NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    -- 1 opening, 2 open, 3 closed (rvbox.v1.PtyState)
    state            INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
    -- the encoded PtyOpen, sent again after each reconnect until closed
    open_frame       BLOB NOT NULL,
    shell_type       INTEGER NOT NULL,
    rows             INTEGER NOT NULL CHECK (rows BETWEEN 1 AND 1000),
    cols             INTEGER NOT NULL CHECK (cols BETWEEN 1 AND 1000),
    opened_ms        INTEGER NOT NULL,
    closed_ms        INTEGER,
    last_activity_ms INTEGER NOT NULL,
    -- the recorded end of output: every byte before it is recorded, or
    -- covered by a cut record
    output_offset    INTEGER NOT NULL DEFAULT 0 CHECK (output_offset >= 0),
    recorded_bytes   INTEGER NOT NULL DEFAULT 0 CHECK (recorded_bytes >= 0),
    next_rec_seq     INTEGER NOT NULL DEFAULT 1,
    -- the highest input_seq assigned, and acknowledged by the client
    input_seq        INTEGER NOT NULL DEFAULT 0,
    input_acked      INTEGER NOT NULL DEFAULT 0 CHECK (input_acked <= input_seq),
    close_requested  INTEGER NOT NULL DEFAULT 0 CHECK (close_requested IN (0, 1)),
    close_reason     TEXT NOT NULL DEFAULT '',
    -- the encoded ExitResult, once closed
    exit_result      BLOB
) STRICT;

CREATE INDEX pty_sessions_by_client ON pty_sessions (client_id, state);
CREATE INDEX pty_sessions_live ON pty_sessions (last_activity_ms) WHERE state <> 3;
CREATE INDEX pty_sessions_closed ON pty_sessions (closed_ms) WHERE state = 3;
CREATE INDEX pty_sessions_by_opened ON pty_sessions (opened_ms, pty_session_id);

-- Input not yet acknowledged by the client, in input_seq order.
CREATE TABLE pty_inputs (
    pty_session_id BLOB NOT NULL REFERENCES pty_sessions (pty_session_id) ON DELETE CASCADE,
    input_seq      INTEGER NOT NULL CHECK (input_seq >= 1),
    data           BLOB NOT NULL,
    PRIMARY KEY (pty_session_id, input_seq)
) STRICT, WITHOUT ROWID;

-- The recording, in order: 1 output (pos: offset of its first byte),
-- 2 input (pos: input_seq), 3 resize (pos: cols, aux: rows), 4 cut (pos:
-- where output resumes, aux: the offset asked for; the bytes between were
-- lost on the client). at_ms counts from the terminal's opening.
CREATE TABLE pty_records (
    pty_session_id BLOB NOT NULL REFERENCES pty_sessions (pty_session_id) ON DELETE CASCADE,
    rec_seq        INTEGER NOT NULL,
    at_ms          INTEGER NOT NULL CHECK (at_ms >= 0),
    kind           INTEGER NOT NULL CHECK (kind IN (1, 2, 3, 4)),
    pos            INTEGER NOT NULL,
    aux            INTEGER NOT NULL DEFAULT 0,
    data           BLOB NOT NULL,
    PRIMARY KEY (pty_session_id, rec_seq)
) STRICT, WITHOUT ROWID;
