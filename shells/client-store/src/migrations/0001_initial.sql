-- The client daemon's durable state (plan §7.1-§7.3). One row per accepted
-- command until its terminal event is acknowledged by the server and its
-- local files are cleaned up; then a tombstone replaces it.

-- Small facts about this installation: the instance id (a copy of the
-- identity file, used by repair), the last session generation seen.
CREATE TABLE client_meta (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
) STRICT;

-- Maintained counters: every count that gates an operation is kept here,
-- in the same transaction as the rows it counts (triggers below), and
-- checked against a recount by the store's counter check.
CREATE TABLE counters (
    id               INTEGER PRIMARY KEY CHECK (id = 1),
    running          INTEGER NOT NULL DEFAULT 0 CHECK (running >= 0),
    queued           INTEGER NOT NULL DEFAULT 0 CHECK (queued >= 0),
    commands         INTEGER NOT NULL DEFAULT 0 CHECK (commands >= 0),
    tombstones       INTEGER NOT NULL DEFAULT 0 CHECK (tombstones >= 0),
    -- worst-case metadata reserved by accepted commands (plan §7.3 step 3)
    metadata_bytes   INTEGER NOT NULL DEFAULT 0 CHECK (metadata_bytes >= 0),
    -- command-owned bytes on disk: spool payloads and script bytes (§7.2)
    stored_bytes     INTEGER NOT NULL DEFAULT 0 CHECK (stored_bytes >= 0),
    -- tombstones ever written: the FIFO position of the next one
    tombstone_serial INTEGER NOT NULL DEFAULT 0 CHECK (tombstone_serial >= 0)
) STRICT;
INSERT INTO counters (id) VALUES (1);

-- slot: 1 queued (accepted, not yet launched), 2 running (a launch slot),
-- 0 released (terminal event spooled; the row stays until the server's ack).
-- launch: 1 accepted, 2 launch_prepared, 3 launch_authorized, 4 running,
-- 5 ended (a terminal lifecycle is spooled).
-- intent: 0 none, 1 terminate (ReconcileResult), 2 discard (terminal kept
-- only until cleanup).
CREATE TABLE commands (
    issue_uuid        BLOB PRIMARY KEY CHECK (length(issue_uuid) = 16),
    request_hash      BLOB NOT NULL CHECK (length(request_hash) = 32),
    revision          INTEGER NOT NULL CHECK (revision >= 1),
    generation        INTEGER NOT NULL CHECK (generation >= 1),
    accepted_ms       INTEGER NOT NULL,
    spec              BLOB NOT NULL,
    resolved_shell    INTEGER NOT NULL,
    queue_expiry_ms   INTEGER,
    slot              INTEGER NOT NULL CHECK (slot IN (0, 1, 2)),
    metadata_charge   INTEGER NOT NULL CHECK (metadata_charge >= 0),
    lifecycle         INTEGER NOT NULL,
    launch            INTEGER NOT NULL CHECK (launch BETWEEN 1 AND 5),
    intent            INTEGER NOT NULL DEFAULT 0 CHECK (intent IN (0, 1, 2)),
    -- script upload (absent for command_text)
    script_len        INTEGER CHECK (script_len IS NULL OR script_len >= 0),
    script_sha256     BLOB CHECK (script_sha256 IS NULL OR length(script_sha256) = 32),
    script_received   INTEGER NOT NULL DEFAULT 0 CHECK (script_received >= 0),
    script_committed  INTEGER NOT NULL DEFAULT 0 CHECK (script_committed IN (0, 1)),
    -- the generated wrapper file, once materialized
    wrapper_path      TEXT,
    -- launch identity (plan §7.4): launcher pid, process group, the
    -- /proc/<pid>/stat start time, the command cgroup
    launcher_pid      INTEGER,
    process_group     INTEGER,
    birth_ticks       INTEGER,
    cgroup_path       TEXT,
    -- stdin (plan §9.1 AppendStdin): next write expected, closed flag
    stdin_next_seq    INTEGER NOT NULL DEFAULT 1 CHECK (stdin_next_seq >= 1),
    stdin_closed      INTEGER NOT NULL DEFAULT 0 CHECK (stdin_closed IN (0, 1)),
    -- spool cursors: next local ordinal, next wire sequence, the server's
    -- cumulative acknowledgement
    next_ordinal      INTEGER NOT NULL DEFAULT 1 CHECK (next_ordinal >= 1),
    next_event_seq    INTEGER NOT NULL DEFAULT 1 CHECK (next_event_seq >= 1),
    acked_event_seq   INTEGER NOT NULL DEFAULT 0 CHECK (acked_event_seq >= 0),
    CHECK (acked_event_seq < next_event_seq),
    CHECK ((script_len IS NULL) = (script_sha256 IS NULL)),
    CHECK (script_len IS NULL OR script_received <= script_len)
) STRICT;

CREATE TRIGGER commands_counted_in AFTER INSERT ON commands BEGIN
    UPDATE counters SET
        commands = commands + 1,
        running = running + (NEW.slot = 2),
        queued = queued + (NEW.slot = 1),
        metadata_bytes = metadata_bytes + NEW.metadata_charge
    WHERE id = 1;
END;
CREATE TRIGGER commands_counted_move AFTER UPDATE OF slot, metadata_charge ON commands BEGIN
    UPDATE counters SET
        running = running - (OLD.slot = 2) + (NEW.slot = 2),
        queued = queued - (OLD.slot = 1) + (NEW.slot = 1),
        metadata_bytes = metadata_bytes - OLD.metadata_charge + NEW.metadata_charge
    WHERE id = 1;
END;
CREATE TRIGGER commands_counted_out AFTER DELETE ON commands BEGIN
    UPDATE counters SET
        commands = commands - 1,
        running = running - (OLD.slot = 2),
        queued = queued - (OLD.slot = 1),
        metadata_bytes = metadata_bytes - OLD.metadata_charge
    WHERE id = 1;
END;

-- One durable command-local order for every event (plan §7.1): output,
-- lifecycle, signal results, stdin acknowledgements, truncation markers.
-- event_seq is assigned only on admission to the send window, and an
-- assigned row is immutable until the cumulative ack deletes it.
-- kind: the CommandEvent body kind; stream: 0 none, 1 stdout, 2 stderr.
-- Output payloads live in the command's spool segment (segment_ordinal,
-- segment_offset: a record of the shared segment format); every other
-- body is small and kept encoded in `body`.
CREATE TABLE spool_entries (
    issue_uuid       BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    local_ordinal    INTEGER NOT NULL CHECK (local_ordinal >= 1),
    event_seq        INTEGER CHECK (event_seq IS NULL OR event_seq >= 1),
    kind             INTEGER NOT NULL CHECK (kind >= 1),
    stream           INTEGER NOT NULL CHECK (stream IN (0, 1, 2)),
    observed_ms      INTEGER NOT NULL,
    raw_len          INTEGER NOT NULL CHECK (raw_len >= 0),
    stored_len       INTEGER NOT NULL CHECK (stored_len >= 0),
    payload_sha256   BLOB NOT NULL CHECK (length(payload_sha256) = 32),
    segment_ordinal  INTEGER,
    segment_offset   INTEGER,
    body             BLOB,
    PRIMARY KEY (issue_uuid, local_ordinal),
    CHECK ((segment_ordinal IS NULL) = (segment_offset IS NULL)),
    CHECK ((segment_ordinal IS NULL) <> (body IS NULL))
) STRICT, WITHOUT ROWID;
CREATE UNIQUE INDEX spool_by_event_seq ON spool_entries (issue_uuid, event_seq)
    WHERE event_seq IS NOT NULL;

-- Spool and script segment files with their committed ends (the
-- committed-offset discipline of plan §5.3: bytes past committed_end are
-- an uncommitted tail that recovery cuts).
-- kind: 1 output, 3 script (the segment record kinds).
CREATE TABLE segments (
    issue_uuid     BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    ordinal        INTEGER NOT NULL CHECK (ordinal >= 1),
    kind           INTEGER NOT NULL CHECK (kind IN (1, 3)),
    committed_end  INTEGER NOT NULL CHECK (committed_end >= 0),
    PRIMARY KEY (issue_uuid, kind, ordinal)
) STRICT, WITHOUT ROWID;

-- The script's received ranges: each verified chunk at its offset, and
-- where its record lies.
CREATE TABLE script_chunks (
    issue_uuid       BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    offset           INTEGER NOT NULL CHECK (offset >= 0),
    len              INTEGER NOT NULL CHECK (len >= 1),
    raw_sha256       BLOB NOT NULL CHECK (length(raw_sha256) = 32),
    segment_ordinal  INTEGER NOT NULL,
    segment_offset   INTEGER NOT NULL,
    PRIMARY KEY (issue_uuid, offset)
) STRICT, WITHOUT ROWID;

-- Stdin writes received from the server, until written to the child and
-- acknowledged (state 1 received, 2 written).
CREATE TABLE stdin_writes (
    issue_uuid  BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    write_seq   INTEGER NOT NULL CHECK (write_seq >= 1),
    len         INTEGER NOT NULL CHECK (len >= 0),
    sha256      BLOB NOT NULL CHECK (length(sha256) = 32),
    state       INTEGER NOT NULL CHECK (state IN (1, 2)),
    payload     BLOB,
    PRIMARY KEY (issue_uuid, write_seq),
    CHECK ((state = 1) = (payload IS NOT NULL))
) STRICT, WITHOUT ROWID;

-- The compact tombstone FIFO (plan §7.1): the newest N completed commands,
-- so stale server state cannot replay recently completed work. `serial`
-- is the FIFO position; the oldest goes first.
CREATE TABLE tombstones (
    serial        INTEGER PRIMARY KEY CHECK (serial >= 1),
    issue_uuid    BLOB NOT NULL UNIQUE CHECK (length(issue_uuid) = 16),
    request_hash  BLOB NOT NULL CHECK (length(request_hash) = 32),
    acked_ms      INTEGER NOT NULL
) STRICT;
CREATE TRIGGER tombstones_counted_in AFTER INSERT ON tombstones BEGIN
    UPDATE counters SET tombstones = tombstones + 1 WHERE id = 1;
END;
CREATE TRIGGER tombstones_counted_out AFTER DELETE ON tombstones BEGIN
    UPDATE counters SET tombstones = tombstones - 1 WHERE id = 1;
END;

-- Local storage incidents (OPEN 1 -> REPAIRED 2 | ACKNOWLEDGED 3; never
-- reopened). Kinds and scope kinds are the wire enums.
CREATE TABLE incidents (
    incident_id  BLOB PRIMARY KEY CHECK (length(incident_id) = 16),
    kind         INTEGER NOT NULL,
    state        INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
    scope_kind   INTEGER NOT NULL,
    scope_key    TEXT NOT NULL,
    detected_ms  INTEGER NOT NULL,
    summary      TEXT NOT NULL,
    evidence     BLOB NOT NULL,
    note         TEXT,
    resolved_ms  INTEGER,
    CHECK ((state = 1) = (resolved_ms IS NULL))
) STRICT;
CREATE INDEX incidents_open ON incidents (detected_ms, incident_id) WHERE state = 1;
CREATE TRIGGER incidents_never_reopen BEFORE UPDATE OF state ON incidents
    WHEN OLD.state <> 1 BEGIN
    SELECT RAISE(ABORT, 'a resolved incident never reopens');
END;
CREATE TRIGGER incidents_evidence_immutable BEFORE UPDATE OF evidence, kind, detected_ms ON incidents
    BEGIN
    SELECT RAISE(ABORT, 'incident evidence is immutable');
END;
