-- RVBox server store, schema version 1 (plan §5.2).
--
-- Conventions: ids are fixed-size blobs (UUID 16 bytes, SHA-256 32 bytes);
-- canonical text exists only at protocol and log boundaries. Times are Unix
-- milliseconds (UTC wall clock, as persisted observations). Byte counters
-- are charged bytes under charge formula `charge_version` and never
-- negative. Enum columns hold the rvbox.v1 wire numbers. Every table is
-- STRICT and every foreign key says what a delete does.

-- One row: store identity and format facts.
CREATE TABLE store_meta (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
) STRICT;

-- One row: global charged totals (plan §5.4).
CREATE TABLE quota_totals (
    id               INTEGER PRIMARY KEY CHECK (id = 1),
    command_charged  INTEGER NOT NULL DEFAULT 0 CHECK (command_charged >= 0),
    audit_charged    INTEGER NOT NULL DEFAULT 0 CHECK (audit_charged >= 0)
) STRICT;
INSERT INTO quota_totals (id) VALUES (1);

CREATE TABLE clients (
    client_id            TEXT PRIMARY KEY CHECK (length(client_id) BETWEEN 1 AND 128),
    instance_id          BLOB CHECK (instance_id IS NULL OR length(instance_id) = 16),
    generation           INTEGER NOT NULL DEFAULT 0 CHECK (generation >= 0),
    platform             TEXT,
    software_version     TEXT,
    capabilities         BLOB,            -- encoded rvbox.v1.Capabilities
    cwd_policy           BLOB,            -- encoded rvbox.v1.CwdPolicy
    connected_ms         INTEGER,
    last_seen_ms         INTEGER,
    pending_instance_id  BLOB CHECK (pending_instance_id IS NULL OR length(pending_instance_id) = 16),
    pending_seen_ms      INTEGER,
    charged_bytes        INTEGER NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    CHECK ((pending_instance_id IS NULL) = (pending_seen_ms IS NULL))
) STRICT;

CREATE TABLE sessions (
    session_id    BLOB PRIMARY KEY CHECK (length(session_id) = 16),
    client_id     TEXT NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    instance_id   BLOB NOT NULL CHECK (length(instance_id) = 16),
    generation    INTEGER NOT NULL CHECK (generation >= 1),
    opened_ms     INTEGER NOT NULL,
    fenced_ms     INTEGER,
    closed_ms     INTEGER,
    close_reason  TEXT CHECK (close_reason IS NULL OR length(close_reason) <= 4096),
    live          INTEGER NOT NULL CHECK (live IN (0, 1)),
    CHECK (live = 0 OR (closed_ms IS NULL AND fenced_ms IS NULL)),
    CHECK (live = 1 OR closed_ms IS NOT NULL)
) STRICT;
-- At most one live session per client (plan §5.2).
CREATE UNIQUE INDEX sessions_one_live ON sessions (client_id) WHERE live = 1;

CREATE TABLE commands (
    issue_uuid        BLOB PRIMARY KEY CHECK (length(issue_uuid) = 16),
    client_id         TEXT NOT NULL REFERENCES clients (client_id) ON DELETE RESTRICT,
    issue_time_ms     INTEGER NOT NULL,
    queue_expiry_ms   INTEGER,                       -- NULL: indefinite TTL
    terminal_time_ms  INTEGER,
    lifecycle         INTEGER NOT NULL CHECK (lifecycle BETWEEN 1 AND 11),
    revision          INTEGER NOT NULL CHECK (revision >= 1),
    request_hash      BLOB NOT NULL CHECK (length(request_hash) = 32),
    spec_zstd         BLOB NOT NULL,                 -- zstd of the encoded, normalized ExecutionSpec
    spec_raw_len      INTEGER NOT NULL CHECK (spec_raw_len > 0),
    exit_code         INTEGER,
    exit_signal       INTEGER,
    rejection         BLOB,                          -- encoded rvbox.v1.ErrorDetail
    resolved_shell    INTEGER,
    last_event_seq    INTEGER NOT NULL DEFAULT 0 CHECK (last_event_seq >= 0),
    expired_pending   INTEGER NOT NULL DEFAULT 0 CHECK (expired_pending IN (0, 1)),
    retention         TEXT NOT NULL DEFAULT 'retained' CHECK (retention IN ('retained', 'evicting')),
    essential_trusted INTEGER NOT NULL DEFAULT 1 CHECK (essential_trusted IN (0, 1)),
    charged_bytes     INTEGER NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    output_charged    INTEGER NOT NULL DEFAULT 0 CHECK (output_charged >= 0 AND output_charged <= charged_bytes),
    -- closeout headroom still held inside charged_bytes (plan §5.4: 64 KiB per accepted command)
    closeout_held     INTEGER NOT NULL DEFAULT 0 CHECK (closeout_held >= 0 AND closeout_held <= charged_bytes),
    charge_version    INTEGER NOT NULL CHECK (charge_version >= 1),
    -- terminal lifecycles (SUCCEEDED..CANCELLED = 5..11) and only they carry a terminal time
    CHECK ((lifecycle >= 5) = (terminal_time_ms IS NOT NULL)),
    CHECK (terminal_time_ms IS NULL OR terminal_time_ms >= issue_time_ms),
    CHECK (exit_code IS NULL OR exit_signal IS NULL)
) STRICT;
CREATE INDEX commands_by_client_issue ON commands (client_id, issue_time_ms DESC, issue_uuid DESC);
CREATE INDEX commands_by_client_lifecycle ON commands (client_id, lifecycle, issue_time_ms);
CREATE INDEX commands_by_issue ON commands (issue_time_ms, issue_uuid);
CREATE INDEX commands_queue_expiry ON commands (queue_expiry_ms) WHERE lifecycle IN (1, 2) AND queue_expiry_ms IS NOT NULL;
CREATE INDEX commands_terminal ON commands (terminal_time_ms, issue_uuid) WHERE terminal_time_ms IS NOT NULL;

-- Command-owned blobs other than output: script chunks, stdin payloads kept
-- out of line, large specs (plan §5.2 command_payloads).
CREATE TABLE command_payloads (
    issue_uuid       BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    kind             INTEGER NOT NULL CHECK (kind BETWEEN 1 AND 6),   -- rvbox-segment Kind
    ordinal          INTEGER NOT NULL CHECK (ordinal >= 0),
    compression      INTEGER NOT NULL CHECK (compression IN (0, 1)),
    raw_len          INTEGER NOT NULL CHECK (raw_len >= 0),
    stored_len       INTEGER NOT NULL CHECK (stored_len >= 0),
    sha256           BLOB NOT NULL CHECK (length(sha256) = 32),
    inline_bytes     BLOB,
    segment_ordinal  INTEGER,
    segment_offset   INTEGER CHECK (segment_offset IS NULL OR segment_offset >= 0),
    PRIMARY KEY (issue_uuid, kind, ordinal),
    CHECK ((inline_bytes IS NULL) <> (segment_ordinal IS NULL)),
    CHECK ((segment_ordinal IS NULL) = (segment_offset IS NULL))
) STRICT, WITHOUT ROWID;

-- Segment files of one command (output and blobs), with the committed-offset
-- protocol: bytes beyond committed_end are unacknowledged (plan §5.3).
CREATE TABLE command_segments (
    issue_uuid      BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    -- output segments are 1, 2, ...; ordinal 0 is the command's blob
    -- segment (large scripts), written whole before the command commits
    ordinal         INTEGER NOT NULL CHECK (ordinal >= 0),
    committed_end   INTEGER NOT NULL DEFAULT 0 CHECK (committed_end >= 0),
    state           TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'sealed', 'rotated', 'damaged', 'blob')),
    first_seq       INTEGER,
    last_seq        INTEGER,
    stream_mask     INTEGER NOT NULL DEFAULT 0 CHECK (stream_mask BETWEEN 0 AND 3),
    stored_bytes    INTEGER NOT NULL DEFAULT 0 CHECK (stored_bytes >= 0),
    raw_bytes       INTEGER NOT NULL DEFAULT 0 CHECK (raw_bytes >= 0),
    charged_bytes   INTEGER NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    created_ms      INTEGER NOT NULL,
    PRIMARY KEY (issue_uuid, ordinal),
    CHECK ((first_seq IS NULL) = (last_seq IS NULL)),
    CHECK (first_seq IS NULL OR first_seq <= last_seq),
    CHECK ((state = 'blob') <= (ordinal = 0)),
    CHECK (ordinal > 0 OR state IN ('blob', 'damaged'))
) STRICT, WITHOUT ROWID;
-- At most one active segment per command.
CREATE UNIQUE INDEX command_segments_one_active ON command_segments (issue_uuid) WHERE state = 'active';

CREATE TABLE command_events (
    issue_uuid       BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    event_seq        INTEGER NOT NULL CHECK (event_seq >= 1),
    observed_ms      INTEGER NOT NULL,
    receipt_ms       INTEGER NOT NULL,
    body_kind        INTEGER NOT NULL CHECK (body_kind >= 1),
    stream           INTEGER NOT NULL DEFAULT 0 CHECK (stream IN (0, 1, 2)),
    raw_len          INTEGER NOT NULL DEFAULT 0 CHECK (raw_len >= 0),
    stored_len       INTEGER NOT NULL DEFAULT 0 CHECK (stored_len >= 0),
    content_sha256   BLOB NOT NULL CHECK (length(content_sha256) = 32),   -- duplicate checksum
    segment_ordinal  INTEGER,
    segment_offset   INTEGER CHECK (segment_offset IS NULL OR segment_offset >= 0),
    inline_body      BLOB,
    PRIMARY KEY (issue_uuid, event_seq),
    CHECK ((segment_ordinal IS NULL) = (segment_offset IS NULL))
) STRICT, WITHOUT ROWID;

CREATE TABLE output_truncations (
    id              INTEGER PRIMARY KEY,
    issue_uuid      BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    first_seq       INTEGER CHECK (first_seq IS NULL OR first_seq >= 1),
    last_seq        INTEGER,
    raw_bytes       INTEGER CHECK (raw_bytes IS NULL OR raw_bytes >= 0),
    stored_bytes    INTEGER CHECK (stored_bytes IS NULL OR stored_bytes >= 0),
    source          INTEGER NOT NULL CHECK (source >= 1),
    reason          TEXT NOT NULL CHECK (length(reason) <= 4096),
    incident_id     BLOB CHECK (incident_id IS NULL OR length(incident_id) = 16),
    recorded_ms     INTEGER NOT NULL,
    -- streams of the removed output (1 stdout, 2 stderr, 3 both); NULL when unknown
    stream_mask     INTEGER CHECK (stream_mask IS NULL OR stream_mask BETWEEN 1 AND 3),
    CHECK ((first_seq IS NULL) = (last_seq IS NULL)),
    CHECK (first_seq IS NULL OR first_seq <= last_seq)
) STRICT;
CREATE INDEX output_truncations_by_command ON output_truncations (issue_uuid, first_seq);
-- Removed ranges of one command never overlap (plan §5.2).
CREATE TRIGGER output_truncations_no_overlap
BEFORE INSERT ON output_truncations
WHEN NEW.first_seq IS NOT NULL AND EXISTS (
    SELECT 1 FROM output_truncations t
    WHERE t.issue_uuid = NEW.issue_uuid AND t.first_seq IS NOT NULL
      AND t.first_seq <= NEW.last_seq AND NEW.first_seq <= t.last_seq
)
BEGIN
    SELECT RAISE(ABORT, 'output_truncations: overlapping removed range');
END;

CREATE TABLE stdin_writes (
    issue_uuid   BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    write_seq    INTEGER NOT NULL CHECK (write_seq >= 1),
    compression  INTEGER NOT NULL CHECK (compression IN (0, 1)),
    raw_len      INTEGER NOT NULL CHECK (raw_len >= 0),
    stored_len   INTEGER NOT NULL CHECK (stored_len >= 0),
    sha256       BLOB NOT NULL CHECK (length(sha256) = 32),
    payload      BLOB NOT NULL,
    newline      INTEGER NOT NULL CHECK (newline IN (0, 1)),
    close        INTEGER NOT NULL CHECK (close IN (0, 1)),
    delivery     INTEGER NOT NULL DEFAULT 1 CHECK (delivery >= 1),
    PRIMARY KEY (issue_uuid, write_seq)
) STRICT, WITHOUT ROWID;

CREATE TABLE storage_incidents (
    incident_id    BLOB PRIMARY KEY CHECK (length(incident_id) = 16),
    kind           INTEGER NOT NULL CHECK (kind BETWEEN 1 AND 12),
    state          INTEGER NOT NULL CHECK (state IN (1, 2, 3)),     -- OPEN, REPAIRED, ACKNOWLEDGED
    scope_kind     INTEGER NOT NULL CHECK (scope_kind BETWEEN 1 AND 5),
    scope_key      TEXT NOT NULL CHECK (length(scope_key) <= 256),
    client_id      TEXT,
    issue_uuid     BLOB CHECK (issue_uuid IS NULL OR length(issue_uuid) = 16),
    detected_ms    INTEGER NOT NULL,
    resolved_ms    INTEGER,
    summary        TEXT NOT NULL CHECK (length(summary) <= 4096),
    evidence       BLOB NOT NULL,
    repairable     INTEGER NOT NULL CHECK (repairable IN (0, 1)),
    data_loss      INTEGER NOT NULL CHECK (data_loss IN (0, 1)),
    note           TEXT CHECK (note IS NULL OR length(note) BETWEEN 1 AND 4096),
    CHECK ((state = 1) = (resolved_ms IS NULL)),
    CHECK (state <> 3 OR note IS NOT NULL)
) STRICT;
CREATE INDEX storage_incidents_open ON storage_incidents (scope_kind, scope_key) WHERE state = 1;
CREATE INDEX storage_incidents_by_time ON storage_incidents (detected_ms DESC, incident_id DESC);
-- Evidence is immutable; a resolved incident never reopens (plan §5.5).
CREATE TRIGGER storage_incidents_immutable
BEFORE UPDATE OF incident_id, kind, scope_kind, scope_key, client_id, issue_uuid, detected_ms, summary, evidence, data_loss
ON storage_incidents
BEGIN
    SELECT RAISE(ABORT, 'storage_incidents: evidence is immutable');
END;
CREATE TRIGGER storage_incidents_no_reopen
BEFORE UPDATE OF state ON storage_incidents
WHEN OLD.state <> 1
BEGIN
    SELECT RAISE(ABORT, 'storage_incidents: a resolved incident never changes');
END;

CREATE TABLE control_mutations (
    request_id      BLOB PRIMARY KEY CHECK (length(request_id) = 16),
    method          TEXT NOT NULL,
    request_hash    BLOB NOT NULL CHECK (length(request_hash) = 32),
    command_uuid    BLOB REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    incident_id     BLOB REFERENCES storage_incidents (incident_id) ON DELETE CASCADE,
    client_id       TEXT REFERENCES clients (client_id) ON DELETE CASCADE,
    write_seq       INTEGER,
    revision        INTEGER,
    result          BLOB NOT NULL,        -- encoded response, or encoded ErrorDetail
    result_is_error INTEGER NOT NULL CHECK (result_is_error IN (0, 1)),
    created_ms      INTEGER NOT NULL,
    CHECK ((command_uuid IS NOT NULL) + (incident_id IS NOT NULL) + (client_id IS NOT NULL) = 1)
) STRICT;

CREATE TABLE takeover_authorizations (
    id           INTEGER PRIMARY KEY,
    client_id    TEXT NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    instance_id  BLOB NOT NULL CHECK (length(instance_id) = 16),
    created_ms   INTEGER NOT NULL,
    expires_ms   INTEGER NOT NULL CHECK (expires_ms > created_ms),
    consumed_ms  INTEGER,
    voided_ms    INTEGER,
    request_id   BLOB NOT NULL UNIQUE CHECK (length(request_id) = 16),
    CHECK (consumed_ms IS NULL OR voided_ms IS NULL)
) STRICT;
-- One live, one-shot grant per client.
CREATE UNIQUE INDEX takeover_one_live ON takeover_authorizations (client_id)
    WHERE consumed_ms IS NULL AND voided_ms IS NULL;

-- Compact replay guard, a global FIFO in insertion order (plan §5.4).
CREATE TABLE command_tombstones (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    issue_uuid    BLOB NOT NULL UNIQUE CHECK (length(issue_uuid) = 16),
    request_hash  BLOB NOT NULL CHECK (length(request_hash) = 32),
    client_id     TEXT NOT NULL,
    lifecycle     INTEGER NOT NULL CHECK (lifecycle BETWEEN 5 AND 11),
    terminal_ms   INTEGER NOT NULL
) STRICT;

-- Audit records live in compressed audit segments under their own budget;
-- this table holds the committed-offset state of each segment.
CREATE TABLE audit_segments (
    ordinal        INTEGER PRIMARY KEY CHECK (ordinal >= 1),
    committed_end  INTEGER NOT NULL DEFAULT 0 CHECK (committed_end >= 0),
    state          TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'sealed', 'damaged')),
    records        INTEGER NOT NULL DEFAULT 0 CHECK (records >= 0),
    charged_bytes  INTEGER NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    first_ms       INTEGER,
    last_ms        INTEGER,
    -- audit record sequence before this segment's first record (records are base_seq+1..)
    base_seq       INTEGER NOT NULL DEFAULT 0 CHECK (base_seq >= 0),
    created_ms     INTEGER NOT NULL DEFAULT 0
) STRICT;
CREATE UNIQUE INDEX audit_segments_one_active ON audit_segments (state) WHERE state = 'active';

-- Crash-safe deletion: files moved into the tombstone directory are listed
-- here until the sweeper removes them (plan §5.4). `file_name` is the
-- collision-proof name inside trash/; `source_name` the canonical segment
-- name the file had in its `origin` directory (both store-made, never a
-- client path), so the sweeper can finish a move that had not happened yet.
CREATE TABLE pending_deletions (
    file_name    TEXT PRIMARY KEY CHECK (length(file_name) BETWEEN 1 AND 128),
    issue_uuid   BLOB CHECK (issue_uuid IS NULL OR length(issue_uuid) = 16),
    queued_ms    INTEGER NOT NULL,
    origin       TEXT NOT NULL DEFAULT 'segments' CHECK (origin IN ('segments', 'audit')),
    source_name  TEXT CHECK (source_name IS NULL OR length(source_name) BETWEEN 1 AND 128)
) STRICT;
CREATE INDEX pending_deletions_by_command ON pending_deletions (issue_uuid) WHERE issue_uuid IS NOT NULL;
