-- Interactive terminals (docs/terminals.md): the PostgreSQL form of the
-- SQLite migration 0011_pty_sessions.sql, translated as 0001_initial.sql
-- says (BLOB -> bytea, INTEGER -> bigint, TEXT -> text COLLATE "C", the
-- flag close_requested -> boolean). shells/store-pg/tests/schema_diff.py
-- compares the two.
CREATE TABLE pty_sessions (
    pty_session_id   bytea PRIMARY KEY CHECK (octet_length(pty_session_id) = 16),
    client_id        text COLLATE "C" NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    -- 1 opening, 2 open, 3 closed (rvbox.v1.PtyState)
    state            bigint NOT NULL CHECK (state IN (1, 2, 3)),
    -- the encoded PtyOpen, sent again after each reconnect until closed
    open_frame       bytea NOT NULL,
    shell_type       bigint NOT NULL,
    rows             bigint NOT NULL CHECK (rows BETWEEN 1 AND 1000),
    cols             bigint NOT NULL CHECK (cols BETWEEN 1 AND 1000),
    opened_ms        bigint NOT NULL,
    closed_ms        bigint,
    last_activity_ms bigint NOT NULL,
    -- the recorded end of output: every byte before it is recorded, or
    -- covered by a cut record
    output_offset    bigint NOT NULL DEFAULT 0 CHECK (output_offset >= 0),
    recorded_bytes   bigint NOT NULL DEFAULT 0 CHECK (recorded_bytes >= 0),
    next_rec_seq     bigint NOT NULL DEFAULT 1,
    -- the highest input_seq assigned, and acknowledged by the client
    input_seq        bigint NOT NULL DEFAULT 0,
    input_acked      bigint NOT NULL DEFAULT 0,
    close_requested  boolean NOT NULL DEFAULT false,
    close_reason     text COLLATE "C" NOT NULL DEFAULT '',
    -- the encoded ExitResult, once closed
    exit_result      bytea,
    CHECK (input_acked <= input_seq)
);

CREATE INDEX pty_sessions_by_client ON pty_sessions (client_id, state);
CREATE INDEX pty_sessions_live ON pty_sessions (last_activity_ms) WHERE state <> 3;
CREATE INDEX pty_sessions_closed ON pty_sessions (closed_ms) WHERE state = 3;
CREATE INDEX pty_sessions_by_opened ON pty_sessions (opened_ms, pty_session_id);

-- Input not yet acknowledged by the client, in input_seq order.
CREATE TABLE pty_inputs (
    pty_session_id bytea NOT NULL REFERENCES pty_sessions (pty_session_id) ON DELETE CASCADE,
    input_seq      bigint NOT NULL CHECK (input_seq >= 1),
    data           bytea NOT NULL,
    PRIMARY KEY (pty_session_id, input_seq)
);

-- The recording, in order: 1 output (pos: offset of its first byte),
-- 2 input (pos: input_seq), 3 resize (pos: cols, aux: rows), 4 cut (pos:
-- where output resumes, aux: the offset asked for; the bytes between were
-- lost on the client). at_ms counts from the terminal's opening.
CREATE TABLE pty_records (
    pty_session_id bytea NOT NULL REFERENCES pty_sessions (pty_session_id) ON DELETE CASCADE,
    rec_seq        bigint NOT NULL,
    at_ms          bigint NOT NULL CHECK (at_ms >= 0),
    kind           bigint NOT NULL CHECK (kind IN (1, 2, 3, 4)),
    pos            bigint NOT NULL,
    aux            bigint NOT NULL DEFAULT 0,
    data           bytea NOT NULL,
    PRIMARY KEY (pty_session_id, rec_seq)
);
