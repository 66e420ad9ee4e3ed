-- RVBox server store on PostgreSQL 15: the PostgreSQL form of the SQLite
-- schema as it stands after migration 0010 (shells/store/src/migrations/
-- 0001_initial.sql .. 0010_fleet_run_tombstones.sql, all applied). Same
-- tables, columns (names and order), keys, foreign keys and their ON DELETE
-- actions, UNIQUE and CHECK constraints, indexes (same names, partial ones
-- with the same predicates), triggers (same names, timing, events, WHEN)
-- and the quota_totals singleton row. It runs once, on an empty database,
-- inside one transaction. shells/store-pg/migrations/difftest.py runs the
-- same writes on both engines and compares every table after each one.
--
-- Translation: BLOB -> bytea (length() -> octet_length), TEXT -> text
-- (length() -> char_length: SQLite counts characters of text),
-- INTEGER -> bigint, STRICT / WITHOUT ROWID dropped (the keys stay), each
-- trigger -> one plpgsql function (<trigger>_fn) plus a FOR EACH ROW
-- trigger; boolean arithmetic -> ::int; IS NOT -> IS DISTINCT FROM;
-- INSERT OR IGNORE -> ON CONFLICT DO NOTHING; RAISE(ABORT, m) -> RAISE
-- EXCEPTION m. Multi-column CHECKs written on a column in SQLite are table
-- constraints here (same expression).
--
-- What differs from SQLite, and why:
-- * Flag columns (CHECK (x IN (0, 1))) are boolean, default 0 -> false,
--   1 -> true: sessions.live, commands.expired_pending,
--   commands.essential_trusted, command_segments.verified,
--   stdin_writes.newline, stdin_writes.close, storage_incidents.repairable,
--   storage_incidents.data_loss, control_mutations.result_is_error,
--   fleet_targets.late. Predicates on them read `live` / `NOT live`.
--   NOT boolean: command_payloads.compression and stdin_writes.compression
--   hold the rvbox-segment codec number (0 none, 1 zstd), an enum like the
--   other wire numbers: bigint with the same CHECK (compression IN (0, 1)).
-- * Generated ids: audit_outbox.id, command_tombstones.seq,
--   fleet_run_tombstones.seq (AUTOINCREMENT) and output_truncations.id,
--   takeover_authorizations.id (rowid aliases) are GENERATED ALWAYS AS
--   IDENTITY (the store never writes them). Like AUTOINCREMENT they only
--   grow and are never reused (a SQLite rowid alias may reuse the highest
--   id after its row is deleted). Unlike AUTOINCREMENT, a rolled-back
--   insert and a refused one consume a value here (INSERT .. ON CONFLICT
--   DO NOTHING consumes one on both engines), and an explicit id is
--   refused. Code that derives a count from the id span must not (SQLite
--   store: audit.rs outbox_len `MAX(id) - MIN(id) + 1`; fleet.rs trims
--   fleet_run_tombstones with `seq <= MAX(seq) - cap`, approximate on both
--   engines); count or order by the id instead.
-- * Every text column is COLLATE "C", so ORDER BY, range scans and the
--   text-keyed indexes order by bytes, as SQLite's BINARY collation does.
-- * output_truncations_no_overlap: PostgreSQL's WHEN takes no subquery;
--   the WHEN keeps `NEW.first_seq IS NOT NULL`, the EXISTS is in the body.
-- * RAISE carries SQLSTATE 23000 (integrity_constraint_violation), as
--   SQLite's RAISE(ABORT) is a constraint error (SQLITE_CONSTRAINT_TRIGGER).
--   As with every PostgreSQL error, it aborts the transaction, not only
--   the statement (use a savepoint to go on after one).
-- * Trigger order: SQLite fires triggers of one event newest first,
--   PostgreSQL by name. The only triggers of one event whose order shows
--   are storage_incidents_immutable and storage_incidents_no_reopen: an
--   UPDATE that breaks both is refused by both engines, but SQLite reports
--   no_reopen's message and PostgreSQL immutable's. (The AFTER triggers on
--   commands write disjoint tables; their order does not matter.)
-- * Foreign keys are checked by PostgreSQL's own triggers, which fire
--   before the user triggers of the same event; SQLite checks them at the
--   end of the statement, after its triggers. A fleet_targets row of no
--   run is refused by both, but SQLite reports the NOT NULL change_seq its
--   AFTER INSERT trigger computes, PostgreSQL the foreign key.
-- * Row-level AFTER triggers fire at the end of their statement here, per
--   row in SQLite, in the order the statement processed the rows. The final
--   state is the same; which target of one multi-row fleet_targets UPDATE
--   gets which change_seq follows that row order, plan-dependent in both.
-- * schema_migrations is the SQLite runner's table, not a migration's; the
--   PostgreSQL runner keeps its own.
--
-- Conventions (from the SQLite schema): ids are fixed-size blobs (UUID 16
-- bytes, SHA-256 32 bytes); canonical text exists only at protocol and log
-- boundaries. Times are Unix milliseconds (UTC wall clock, as persisted
-- observations). Byte counters are charged bytes under charge formula
-- `charge_version` and never negative. Enum columns hold the rvbox.v1 wire
-- numbers. Every foreign key says what a delete does.

-- One row: store identity and format facts.
CREATE TABLE store_meta (
    key   text COLLATE "C" PRIMARY KEY,
    value bytea NOT NULL
);

-- One row: global charged totals (plan §5.4), the registry counts
-- (migration 4) and the counts that gate an operation (migration 5). Counts
-- that gate an operation are maintained by triggers, never recounted with
-- COUNT(*) over a table that grows with the store's history.
CREATE TABLE quota_totals (
    id               bigint PRIMARY KEY CHECK (id = 1),
    command_charged  bigint NOT NULL DEFAULT 0 CHECK (command_charged >= 0),
    audit_charged    bigint NOT NULL DEFAULT 0 CHECK (audit_charged >= 0),
    clients          bigint NOT NULL DEFAULT 0 CHECK (clients >= 0),
    sessions         bigint NOT NULL DEFAULT 0 CHECK (sessions >= 0),
    -- The highest generation of any pruned client: a client id that comes
    -- back starts above it, so no client ever sees its generation go
    -- backwards (plan §6.2).
    generation_floor bigint NOT NULL DEFAULT 0 CHECK (generation_floor >= 0),
    -- queued commands (lifecycle 1 queued or 2 dispatched) of the server
    queued           bigint NOT NULL DEFAULT 0 CHECK (queued >= 0),
    -- rows of command_tombstones (the FIFO cap every terminal transition enforces)
    tombstones       bigint NOT NULL DEFAULT 0 CHECK (tombstones >= 0)
);
INSERT INTO quota_totals (id) VALUES (1);

CREATE TABLE clients (
    client_id            text COLLATE "C" PRIMARY KEY CHECK (char_length(client_id) BETWEEN 1 AND 128),
    instance_id          bytea CHECK (instance_id IS NULL OR octet_length(instance_id) = 16),
    generation           bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    platform             text COLLATE "C",
    software_version     text COLLATE "C",
    capabilities         bytea,            -- encoded rvbox.v1.Capabilities
    cwd_policy           bytea,            -- encoded rvbox.v1.CwdPolicy
    connected_ms         bigint,
    last_seen_ms         bigint,
    pending_instance_id  bytea CHECK (pending_instance_id IS NULL OR octet_length(pending_instance_id) = 16),
    pending_seen_ms      bigint,
    charged_bytes        bigint NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    -- Client labels: the normalized `key=value,key=value` text, sorted by
    -- key, empty for a client without labels or one that never registered.
    labels               text COLLATE "C" NOT NULL DEFAULT '' CHECK (char_length(labels) <= 8192),
    CHECK ((pending_instance_id IS NULL) = (pending_seen_ms IS NULL))
);
-- Idle clients, least recently seen first (pruning by maintenance).
CREATE INDEX clients_by_last_seen ON clients ((COALESCE(last_seen_ms, 0)), client_id);

CREATE TABLE sessions (
    session_id    bytea PRIMARY KEY CHECK (octet_length(session_id) = 16),
    client_id     text COLLATE "C" NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    instance_id   bytea NOT NULL CHECK (octet_length(instance_id) = 16),
    generation    bigint NOT NULL CHECK (generation >= 1),
    opened_ms     bigint NOT NULL,
    fenced_ms     bigint,
    closed_ms     bigint,
    close_reason  text COLLATE "C" CHECK (close_reason IS NULL OR char_length(close_reason) <= 4096),
    live          boolean NOT NULL,
    CHECK (NOT live OR (closed_ms IS NULL AND fenced_ms IS NULL)),
    CHECK (live OR closed_ms IS NOT NULL)
);
-- At most one live session per client (plan §5.2).
CREATE UNIQUE INDEX sessions_one_live ON sessions (client_id) WHERE live;
-- The closed sessions of a client, newest first (pruning at registration).
CREATE INDEX sessions_closed_by_client ON sessions (client_id, closed_ms DESC, session_id DESC)
    WHERE NOT live;
-- A client's sessions by client id: the foreign-key checks of a client row
-- look them up instead of scanning every session.
CREATE INDEX sessions_by_client ON sessions (client_id);

CREATE TABLE commands (
    issue_uuid        bytea PRIMARY KEY CHECK (octet_length(issue_uuid) = 16),
    client_id         text COLLATE "C" NOT NULL REFERENCES clients (client_id) ON DELETE RESTRICT,
    issue_time_ms     bigint NOT NULL,
    queue_expiry_ms   bigint,                        -- NULL: indefinite TTL
    terminal_time_ms  bigint,
    lifecycle         bigint NOT NULL CHECK (lifecycle BETWEEN 1 AND 11),
    revision          bigint NOT NULL CHECK (revision >= 1),
    request_hash      bytea NOT NULL CHECK (octet_length(request_hash) = 32),
    spec_zstd         bytea NOT NULL,                -- zstd of the encoded, normalized ExecutionSpec
    spec_raw_len      bigint NOT NULL CHECK (spec_raw_len > 0),
    exit_code         bigint,
    exit_signal       bigint,
    rejection         bytea,                         -- encoded rvbox.v1.ErrorDetail
    resolved_shell    bigint,
    last_event_seq    bigint NOT NULL DEFAULT 0 CHECK (last_event_seq >= 0),
    expired_pending   boolean NOT NULL DEFAULT false,
    retention         text COLLATE "C" NOT NULL DEFAULT 'retained' CHECK (retention IN ('retained', 'evicting')),
    essential_trusted boolean NOT NULL DEFAULT true,
    charged_bytes     bigint NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    output_charged    bigint NOT NULL DEFAULT 0,
    -- closeout headroom still held inside charged_bytes (plan §5.4: 64 KiB per accepted command)
    closeout_held     bigint NOT NULL DEFAULT 0,
    charge_version    bigint NOT NULL CHECK (charge_version >= 1),
    CHECK (output_charged >= 0 AND output_charged <= charged_bytes),
    CHECK (closeout_held >= 0 AND closeout_held <= charged_bytes),
    -- terminal lifecycles (SUCCEEDED..CANCELLED = 5..11) and only they carry a terminal time
    CHECK ((lifecycle >= 5) = (terminal_time_ms IS NOT NULL)),
    CHECK (terminal_time_ms IS NULL OR terminal_time_ms >= issue_time_ms),
    CHECK (exit_code IS NULL OR exit_signal IS NULL)
);
CREATE INDEX commands_by_client_issue ON commands (client_id, issue_time_ms DESC, issue_uuid DESC);
CREATE INDEX commands_by_client_lifecycle ON commands (client_id, lifecycle, issue_time_ms);
CREATE INDEX commands_by_issue ON commands (issue_time_ms, issue_uuid);
CREATE INDEX commands_queue_expiry ON commands (queue_expiry_ms) WHERE lifecycle IN (1, 2) AND queue_expiry_ms IS NOT NULL;
CREATE INDEX commands_terminal ON commands (terminal_time_ms, issue_uuid) WHERE terminal_time_ms IS NOT NULL;
-- Commands marked for eviction, oldest first: the sweep at every start and
-- every maintenance pass rolls an interrupted eviction forward by reading
-- these few rows, never by walking every command.
CREATE INDEX commands_evicting ON commands (issue_time_ms, issue_uuid)
    WHERE retention = 'evicting';
-- The commands a start checks (essential state of every non-terminal
-- command) and reconciles: the live ones only.
CREATE INDEX commands_live ON commands (issue_uuid) WHERE lifecycle < 5;

-- Command-owned blobs other than output: script chunks, stdin payloads kept
-- out of line, large specs (plan §5.2 command_payloads).
CREATE TABLE command_payloads (
    issue_uuid       bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    kind             bigint NOT NULL CHECK (kind BETWEEN 1 AND 6),   -- rvbox-segment Kind
    ordinal          bigint NOT NULL CHECK (ordinal >= 0),
    compression      bigint NOT NULL CHECK (compression IN (0, 1)),  -- rvbox-segment Compression
    raw_len          bigint NOT NULL CHECK (raw_len >= 0),
    stored_len       bigint NOT NULL CHECK (stored_len >= 0),
    sha256           bytea NOT NULL CHECK (octet_length(sha256) = 32),
    inline_bytes     bytea,
    segment_ordinal  bigint,
    segment_offset   bigint CHECK (segment_offset IS NULL OR segment_offset >= 0),
    PRIMARY KEY (issue_uuid, kind, ordinal),
    CHECK ((inline_bytes IS NULL) <> (segment_ordinal IS NULL)),
    CHECK ((segment_ordinal IS NULL) = (segment_offset IS NULL))
);

-- Segment files of one command (output and blobs), with the committed-offset
-- protocol: bytes beyond committed_end are unacknowledged (plan §5.3).
CREATE TABLE command_segments (
    issue_uuid      bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    -- output segments are 1, 2, ...; ordinal 0 is the command's blob
    -- segment (large scripts), written whole before the command commits
    ordinal         bigint NOT NULL CHECK (ordinal >= 0),
    committed_end   bigint NOT NULL DEFAULT 0 CHECK (committed_end >= 0),
    state           text COLLATE "C" NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'sealed', 'rotated', 'damaged', 'blob')),
    first_seq       bigint,
    last_seq        bigint,
    stream_mask     bigint NOT NULL DEFAULT 0 CHECK (stream_mask BETWEEN 0 AND 3),
    stored_bytes    bigint NOT NULL DEFAULT 0 CHECK (stored_bytes >= 0),
    raw_bytes       bigint NOT NULL DEFAULT 0 CHECK (raw_bytes >= 0),
    charged_bytes   bigint NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    created_ms      bigint NOT NULL,
    -- The durable "verified at seal" fact: true once the segment's committed
    -- range was read back and every record checked (at seal by the writer,
    -- by a start's recovery, or by the background scrub). An active segment
    -- is never verified (it may still grow); a segment the group journal
    -- re-appends to loses the fact until it is scanned again.
    verified        boolean NOT NULL DEFAULT false,
    PRIMARY KEY (issue_uuid, ordinal),
    CHECK ((first_seq IS NULL) = (last_seq IS NULL)),
    CHECK (first_seq IS NULL OR first_seq <= last_seq),
    CHECK ((state = 'blob') <= (ordinal = 0)),
    CHECK (ordinal > 0 OR state IN ('blob', 'damaged'))
);
-- At most one active segment per command.
CREATE UNIQUE INDEX command_segments_one_active ON command_segments (issue_uuid) WHERE state = 'active';
-- What a start reads: live segments without the fact (active ones, and
-- sealed or blob ones not yet verified), a few rows however long the
-- history.
CREATE INDEX command_segments_unverified ON command_segments (issue_uuid, ordinal)
    WHERE NOT verified AND state IN ('active', 'sealed', 'blob');

CREATE TABLE command_events (
    issue_uuid       bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    event_seq        bigint NOT NULL CHECK (event_seq >= 1),
    observed_ms      bigint NOT NULL,
    receipt_ms       bigint NOT NULL,
    body_kind        bigint NOT NULL CHECK (body_kind >= 1),
    stream           bigint NOT NULL DEFAULT 0 CHECK (stream IN (0, 1, 2)),
    raw_len          bigint NOT NULL DEFAULT 0 CHECK (raw_len >= 0),
    stored_len       bigint NOT NULL DEFAULT 0 CHECK (stored_len >= 0),
    content_sha256   bytea NOT NULL CHECK (octet_length(content_sha256) = 32),   -- duplicate checksum
    segment_ordinal  bigint,
    segment_offset   bigint CHECK (segment_offset IS NULL OR segment_offset >= 0),
    inline_body      bytea,
    PRIMARY KEY (issue_uuid, event_seq),
    CHECK ((segment_ordinal IS NULL) = (segment_offset IS NULL))
);

CREATE TABLE output_truncations (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    issue_uuid      bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    first_seq       bigint CHECK (first_seq IS NULL OR first_seq >= 1),
    last_seq        bigint,
    raw_bytes       bigint CHECK (raw_bytes IS NULL OR raw_bytes >= 0),
    stored_bytes    bigint CHECK (stored_bytes IS NULL OR stored_bytes >= 0),
    source          bigint NOT NULL CHECK (source >= 1),
    reason          text COLLATE "C" NOT NULL CHECK (char_length(reason) <= 4096),
    incident_id     bytea CHECK (incident_id IS NULL OR octet_length(incident_id) = 16),
    recorded_ms     bigint NOT NULL,
    -- streams of the removed output (1 stdout, 2 stderr, 3 both); NULL when unknown
    stream_mask     bigint CHECK (stream_mask IS NULL OR stream_mask BETWEEN 1 AND 3),
    CHECK ((first_seq IS NULL) = (last_seq IS NULL)),
    CHECK (first_seq IS NULL OR first_seq <= last_seq)
);
CREATE INDEX output_truncations_by_command ON output_truncations (issue_uuid, first_seq);

CREATE TABLE stdin_writes (
    issue_uuid   bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    write_seq    bigint NOT NULL CHECK (write_seq >= 1),
    compression  bigint NOT NULL CHECK (compression IN (0, 1)),      -- rvbox-segment Compression
    raw_len      bigint NOT NULL CHECK (raw_len >= 0),
    stored_len   bigint NOT NULL CHECK (stored_len >= 0),
    sha256       bytea NOT NULL CHECK (octet_length(sha256) = 32),
    payload      bytea NOT NULL,
    newline      boolean NOT NULL,
    close        boolean NOT NULL,
    delivery     bigint NOT NULL DEFAULT 1 CHECK (delivery >= 1),
    PRIMARY KEY (issue_uuid, write_seq)
);

CREATE TABLE storage_incidents (
    incident_id    bytea PRIMARY KEY CHECK (octet_length(incident_id) = 16),
    kind           bigint NOT NULL CHECK (kind BETWEEN 1 AND 12),
    state          bigint NOT NULL CHECK (state IN (1, 2, 3)),     -- OPEN, REPAIRED, ACKNOWLEDGED
    scope_kind     bigint NOT NULL CHECK (scope_kind BETWEEN 1 AND 5),
    scope_key      text COLLATE "C" NOT NULL CHECK (char_length(scope_key) <= 256),
    client_id      text COLLATE "C",
    issue_uuid     bytea CHECK (issue_uuid IS NULL OR octet_length(issue_uuid) = 16),
    detected_ms    bigint NOT NULL,
    resolved_ms    bigint,
    summary        text COLLATE "C" NOT NULL CHECK (char_length(summary) <= 4096),
    evidence       bytea NOT NULL,
    repairable     boolean NOT NULL,
    data_loss      boolean NOT NULL,
    note           text COLLATE "C" CHECK (note IS NULL OR char_length(note) BETWEEN 1 AND 4096),
    CHECK ((state = 1) = (resolved_ms IS NULL)),
    CHECK (state <> 3 OR note IS NOT NULL)
);
CREATE INDEX storage_incidents_open ON storage_incidents (scope_kind, scope_key) WHERE state = 1;
CREATE INDEX storage_incidents_by_time ON storage_incidents (detected_ms DESC, incident_id DESC);

-- Fleet runs: one command on every client a selection resolves to, with
-- rate control (docs/fleet.md). A run is a set of ordinary commands; its
-- targets follow their commands' lifecycles, and its counters follow its
-- targets, through triggers, so every write that moves a command moves its
-- target and its run's counters in the same transaction, whatever the
-- write path (events, reconciliation, expiry, signals, recovery).
CREATE TABLE fleet_runs (
    run_id          bytea PRIMARY KEY CHECK (octet_length(run_id) = 16),
    -- rvbox.v1.FleetRunState: 1 running, 2 paused, 3 stopping, 4 done
    state           bigint NOT NULL CHECK (state BETWEEN 1 AND 4),
    -- rvbox.v1.FleetStopReason: 0 none, 1 max errors, 2 cancelled
    stop_reason     bigint NOT NULL DEFAULT 0 CHECK (stop_reason BETWEEN 0 AND 2),
    selection       bytea NOT NULL,                  -- encoded rvbox.v1.FleetSelection
    spec_zstd       bytea NOT NULL,                  -- zstd of the encoded, normalized ExecutionSpec
    spec_raw_len    bigint NOT NULL CHECK (spec_raw_len > 0),
    script_zstd     bytea,                           -- the script (<= 256 KiB raw), for late releases
    queue_ttl_ms    bigint NOT NULL CHECK (queue_ttl_ms >= 0),   -- 0: indefinite
    max_parallel    bytea,                           -- encoded rvbox.v1.FleetLimit; NULL: none
    max_errors      bytea,                           -- encoded rvbox.v1.FleetLimit; NULL: none
    created_ms      bigint NOT NULL,
    late_until_ms   bigint,                          -- NULL: no include_late window
    done_ms         bigint,
    targets         bigint NOT NULL DEFAULT 0 CHECK (targets >= 0),
    n_pending       bigint NOT NULL DEFAULT 0 CHECK (n_pending >= 0),
    n_queued        bigint NOT NULL DEFAULT 0 CHECK (n_queued >= 0),
    n_running       bigint NOT NULL DEFAULT 0 CHECK (n_running >= 0),
    n_succeeded     bigint NOT NULL DEFAULT 0 CHECK (n_succeeded >= 0),
    n_failed        bigint NOT NULL DEFAULT 0 CHECK (n_failed >= 0),
    n_unreachable   bigint NOT NULL DEFAULT 0 CHECK (n_unreachable >= 0),
    n_cancelled     bigint NOT NULL DEFAULT 0 CHECK (n_cancelled >= 0),
    n_skipped       bigint NOT NULL DEFAULT 0 CHECK (n_skipped >= 0),
    -- position of the latest target change (FollowFleetRun's cursor)
    change_seq      bigint NOT NULL DEFAULT 0 CHECK (change_seq >= 0),
    CHECK ((state = 4) = (done_ms IS NOT NULL)),
    CHECK (targets = n_pending + n_queued + n_running + n_succeeded + n_failed
                     + n_unreachable + n_cancelled + n_skipped)
);
-- ListFleetRuns, newest first.
CREATE INDEX fleet_runs_by_created ON fleet_runs (created_ms DESC, run_id DESC);
-- The runs the release pump and late registrations look at.
CREATE INDEX fleet_runs_live ON fleet_runs (state) WHERE state < 4;

CREATE TABLE fleet_targets (
    run_id       bytea NOT NULL REFERENCES fleet_runs (run_id) ON DELETE CASCADE,
    client_id    text COLLATE "C" NOT NULL CHECK (char_length(client_id) BETWEEN 1 AND 128),
    -- the target's command id, derived from the run id and the client id;
    -- the command row exists from release until retention removes it
    issue_uuid   bytea NOT NULL CHECK (octet_length(issue_uuid) = 16),
    -- rvbox.v1.FleetTargetState 1..8
    state        bigint NOT NULL CHECK (state BETWEEN 1 AND 8),
    lifecycle    bigint CHECK (lifecycle IS NULL OR lifecycle BETWEEN 1 AND 11),
    exit_code    bigint,
    exit_signal  bigint,
    rejection    bytea,                               -- encoded rvbox.v1.ErrorDetail
    released_ms  bigint,
    ended_ms     bigint,
    late         boolean NOT NULL DEFAULT false,
    change_seq   bigint NOT NULL DEFAULT 0 CHECK (change_seq >= 0),
    PRIMARY KEY (run_id, client_id),
    CHECK ((state = 1) = (released_ms IS NULL) OR state IN (7, 8))
);
CREATE UNIQUE INDEX fleet_targets_by_issue ON fleet_targets (issue_uuid);
CREATE INDEX fleet_targets_by_state ON fleet_targets (run_id, state, client_id);
CREATE INDEX fleet_targets_by_change ON fleet_targets (run_id, change_seq);

-- Idempotency rows of Control writes; each belongs to exactly one owner
-- (a command, an incident, a client or a fleet run) and goes with it.
CREATE TABLE control_mutations (
    request_id      bytea PRIMARY KEY CHECK (octet_length(request_id) = 16),
    method          text COLLATE "C" NOT NULL,
    request_hash    bytea NOT NULL CHECK (octet_length(request_hash) = 32),
    command_uuid    bytea REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    incident_id     bytea REFERENCES storage_incidents (incident_id) ON DELETE CASCADE,
    client_id       text COLLATE "C" REFERENCES clients (client_id) ON DELETE CASCADE,
    write_seq       bigint,
    revision        bigint,
    result          bytea NOT NULL,        -- encoded response, or encoded ErrorDetail
    result_is_error boolean NOT NULL,
    created_ms      bigint NOT NULL,
    fleet_run_id    bytea REFERENCES fleet_runs (run_id) ON DELETE CASCADE,
    CHECK ((command_uuid IS NOT NULL)::int + (incident_id IS NOT NULL)::int + (client_id IS NOT NULL)::int
           + (fleet_run_id IS NOT NULL)::int = 1)
);
-- Every foreign key's child column leads an index, so the cascade a
-- parent's deletion runs is a search, never a scan of the child table.
CREATE INDEX control_mutations_by_command ON control_mutations (command_uuid)
    WHERE command_uuid IS NOT NULL;
CREATE INDEX control_mutations_by_incident ON control_mutations (incident_id)
    WHERE incident_id IS NOT NULL;
CREATE INDEX control_mutations_by_client ON control_mutations (client_id)
    WHERE client_id IS NOT NULL;
CREATE INDEX control_mutations_by_fleet_run ON control_mutations (fleet_run_id)
    WHERE fleet_run_id IS NOT NULL;

CREATE TABLE takeover_authorizations (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id    text COLLATE "C" NOT NULL REFERENCES clients (client_id) ON DELETE CASCADE,
    instance_id  bytea NOT NULL CHECK (octet_length(instance_id) = 16),
    created_ms   bigint NOT NULL,
    expires_ms   bigint NOT NULL,
    consumed_ms  bigint,
    voided_ms    bigint,
    request_id   bytea NOT NULL UNIQUE CHECK (octet_length(request_id) = 16),
    CHECK (expires_ms > created_ms),
    CHECK (consumed_ms IS NULL OR voided_ms IS NULL)
);
-- One live, one-shot grant per client.
CREATE UNIQUE INDEX takeover_one_live ON takeover_authorizations (client_id)
    WHERE consumed_ms IS NULL AND voided_ms IS NULL;
CREATE INDEX takeover_authorizations_by_client ON takeover_authorizations (client_id);

-- Compact replay guard, a global FIFO in insertion order (plan §5.4).
CREATE TABLE command_tombstones (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    issue_uuid    bytea NOT NULL UNIQUE CHECK (octet_length(issue_uuid) = 16),
    request_hash  bytea NOT NULL CHECK (octet_length(request_hash) = 32),
    client_id     text COLLATE "C" NOT NULL,
    lifecycle     bigint NOT NULL CHECK (lifecycle BETWEEN 5 AND 11),
    terminal_ms   bigint NOT NULL
);

-- Audit records live in compressed audit segments under their own budget;
-- this table holds the committed-offset state of each segment.
CREATE TABLE audit_segments (
    ordinal        bigint PRIMARY KEY CHECK (ordinal >= 1),
    committed_end  bigint NOT NULL DEFAULT 0 CHECK (committed_end >= 0),
    state          text COLLATE "C" NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'sealed', 'damaged')),
    records        bigint NOT NULL DEFAULT 0 CHECK (records >= 0),
    charged_bytes  bigint NOT NULL DEFAULT 0 CHECK (charged_bytes >= 0),
    first_ms       bigint,
    last_ms        bigint,
    -- audit record sequence before this segment's first record (records are base_seq+1..)
    base_seq       bigint NOT NULL DEFAULT 0 CHECK (base_seq >= 0),
    created_ms     bigint NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX audit_segments_one_active ON audit_segments (state) WHERE state = 'active';

-- Crash-safe deletion: files moved into the tombstone directory are listed
-- here until the sweeper removes them (plan §5.4). `file_name` is the
-- collision-proof name inside trash/; `source_name` the canonical segment
-- name the file had in its `origin` directory (both store-made, never a
-- client path), so the sweeper can finish a move that had not happened yet.
CREATE TABLE pending_deletions (
    file_name    text COLLATE "C" PRIMARY KEY CHECK (char_length(file_name) BETWEEN 1 AND 128),
    issue_uuid   bytea CHECK (issue_uuid IS NULL OR octet_length(issue_uuid) = 16),
    queued_ms    bigint NOT NULL,
    origin       text COLLATE "C" NOT NULL DEFAULT 'segments' CHECK (origin IN ('segments', 'audit')),
    source_name  text COLLATE "C" CHECK (source_name IS NULL OR char_length(source_name) BETWEEN 1 AND 128)
);
CREATE INDEX pending_deletions_by_command ON pending_deletions (issue_uuid) WHERE issue_uuid IS NOT NULL;

-- Signals the server decided for a command the client may hold (plan §6.4):
-- each is made durable with the higher revision it carries, before the
-- Signal frame is sent, and is sent again after every reconnect and every
-- acceptance until the command ends. One kind is kept once: a newer signal
-- of the same kind replaces the older row, so a command holds at most six
-- rows. Rows go with their command.
CREATE TABLE command_signals (
    issue_uuid  bytea NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    signal      bigint NOT NULL CHECK (signal BETWEEN 1 AND 6),
    revision    bigint NOT NULL CHECK (revision >= 2),
    created_ms  bigint NOT NULL,
    PRIMARY KEY (issue_uuid, signal)
);

-- The audit outbox (plan §5.2: every mutation transaction records its
-- audit intent/result consistently). Records move to the compressed audit
-- segments in batches. Ids only grow and rows leave oldest first (ids are
-- not dense here: see the header).
CREATE TABLE audit_outbox (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    time_ms  bigint NOT NULL,
    record   bytea NOT NULL CHECK (octet_length(record) <= 524288)
);

-- One row per client with queued work (a row goes when its count reaches 0).
CREATE TABLE queued_by_client (
    client_id text COLLATE "C" PRIMARY KEY,
    queued    bigint NOT NULL CHECK (queued >= 0)
);

-- The replay guard of fleet runs: when retention deletes a done run (with
-- its targets and its idempotency rows), its id stays here, so a RunFleet
-- replayed with that request_id is refused ALREADY_EXECUTED instead of
-- creating the run again. A FIFO in insertion order, trimmed to the same
-- cap as the command tombstones (retention.tombstones).
CREATE TABLE fleet_run_tombstones (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id        bytea NOT NULL UNIQUE CHECK (octet_length(run_id) = 16),
    pruned_ms     bigint NOT NULL
);

-- ---------------------------------------------------------------------------
-- Triggers. Each SQLite trigger is one function plus one FOR EACH ROW
-- trigger of the same name, timing, event and WHEN.
-- ---------------------------------------------------------------------------

-- Removed ranges of one command never overlap (plan §5.2).
CREATE FUNCTION output_truncations_no_overlap_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- the EXISTS half of SQLite's WHEN (a PostgreSQL WHEN takes no subquery)
    IF EXISTS (
        SELECT 1 FROM output_truncations t
        WHERE t.issue_uuid = NEW.issue_uuid AND t.first_seq IS NOT NULL
          AND t.first_seq <= NEW.last_seq AND NEW.first_seq <= t.last_seq
    ) THEN
        RAISE EXCEPTION 'output_truncations: overlapping removed range'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER output_truncations_no_overlap
BEFORE INSERT ON output_truncations
FOR EACH ROW WHEN (NEW.first_seq IS NOT NULL)
EXECUTE FUNCTION output_truncations_no_overlap_fn();

-- Evidence is immutable; a resolved incident never reopens (plan §5.5).
CREATE FUNCTION storage_incidents_immutable_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'storage_incidents: evidence is immutable'
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;
CREATE TRIGGER storage_incidents_immutable
BEFORE UPDATE OF incident_id, kind, scope_kind, scope_key, client_id, issue_uuid, detected_ms, summary, evidence, data_loss
ON storage_incidents
FOR EACH ROW
EXECUTE FUNCTION storage_incidents_immutable_fn();

CREATE FUNCTION storage_incidents_no_reopen_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'storage_incidents: a resolved incident never changes'
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;
CREATE TRIGGER storage_incidents_no_reopen
BEFORE UPDATE OF state ON storage_incidents
FOR EACH ROW WHEN (OLD.state <> 1)
EXECUTE FUNCTION storage_incidents_no_reopen_fn();

-- The client registry is bounded, pruned and charged (plan §5.4): rows of
-- `clients` and `sessions` come from unauthenticated hellos, so their
-- numbers are counted in the same transaction as every insert and delete
-- (triggers: no write path can miss one).
CREATE FUNCTION clients_counted_in_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET clients = clients + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER clients_counted_in AFTER INSERT ON clients
FOR EACH ROW EXECUTE FUNCTION clients_counted_in_fn();

CREATE FUNCTION clients_counted_out_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET clients = clients - 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER clients_counted_out AFTER DELETE ON clients
FOR EACH ROW EXECUTE FUNCTION clients_counted_out_fn();

CREATE FUNCTION sessions_counted_in_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET sessions = sessions + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER sessions_counted_in AFTER INSERT ON sessions
FOR EACH ROW EXECUTE FUNCTION sessions_counted_in_fn();

CREATE FUNCTION sessions_counted_out_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET sessions = sessions - 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER sessions_counted_out AFTER DELETE ON sessions
FOR EACH ROW EXECUTE FUNCTION sessions_counted_out_fn();

-- Counts that gate an operation are maintained, never recounted: the
-- queued commands (lifecycle 1 queued or 2 dispatched) of each client and
-- of the whole server, and the replay tombstones. Triggers keep them in
-- the transaction of every write that changes them, so no write path can
-- miss one; the counter check compares them with a recount, and the
-- offline repair rebuilds them.
CREATE FUNCTION commands_queued_in_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queued_by_client (client_id, queued) VALUES (NEW.client_id, 0)
        ON CONFLICT (client_id) DO NOTHING;
    UPDATE queued_by_client SET queued = queued + 1 WHERE client_id = NEW.client_id;
    UPDATE quota_totals SET queued = queued + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER commands_queued_in AFTER INSERT ON commands
FOR EACH ROW WHEN (NEW.lifecycle IN (1, 2))
EXECUTE FUNCTION commands_queued_in_fn();

CREATE FUNCTION commands_queued_out_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE queued_by_client SET queued = queued - 1 WHERE client_id = OLD.client_id;
    DELETE FROM queued_by_client WHERE client_id = OLD.client_id AND queued = 0;
    UPDATE quota_totals SET queued = queued - 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER commands_queued_out AFTER DELETE ON commands
FOR EACH ROW WHEN (OLD.lifecycle IN (1, 2))
EXECUTE FUNCTION commands_queued_out_fn();

CREATE FUNCTION commands_queued_entered_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queued_by_client (client_id, queued) VALUES (NEW.client_id, 0)
        ON CONFLICT (client_id) DO NOTHING;
    UPDATE queued_by_client SET queued = queued + 1 WHERE client_id = NEW.client_id;
    UPDATE quota_totals SET queued = queued + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER commands_queued_entered AFTER UPDATE OF lifecycle ON commands
FOR EACH ROW WHEN (NEW.lifecycle IN (1, 2) AND OLD.lifecycle NOT IN (1, 2))
EXECUTE FUNCTION commands_queued_entered_fn();

CREATE FUNCTION commands_queued_left_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE queued_by_client SET queued = queued - 1 WHERE client_id = OLD.client_id;
    DELETE FROM queued_by_client WHERE client_id = OLD.client_id AND queued = 0;
    UPDATE quota_totals SET queued = queued - 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER commands_queued_left AFTER UPDATE OF lifecycle ON commands
FOR EACH ROW WHEN (OLD.lifecycle IN (1, 2) AND NEW.lifecycle NOT IN (1, 2))
EXECUTE FUNCTION commands_queued_left_fn();

CREATE FUNCTION tombstones_counted_in_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET tombstones = tombstones + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER tombstones_counted_in AFTER INSERT ON command_tombstones
FOR EACH ROW EXECUTE FUNCTION tombstones_counted_in_fn();

CREATE FUNCTION tombstones_counted_out_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE quota_totals SET tombstones = tombstones - 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER tombstones_counted_out AFTER DELETE ON command_tombstones
FOR EACH ROW EXECUTE FUNCTION tombstones_counted_out_fn();

-- A command's output ends with its terminal transition, whichever path
-- makes it terminal: its active segment is sealed then, so the active
-- segments are those of the commands still running (bounded by the queue
-- and the running limits), never the store's whole history. The writer
-- marks it verified in the same transaction when it read it back.
CREATE FUNCTION commands_terminal_seals_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE command_segments SET state = 'sealed'
        WHERE issue_uuid = NEW.issue_uuid AND state = 'active';
    RETURN NULL;
END
$$;
CREATE TRIGGER commands_terminal_seals AFTER UPDATE OF lifecycle ON commands
FOR EACH ROW WHEN (NEW.lifecycle >= 5 AND OLD.lifecycle < 5)
EXECUTE FUNCTION commands_terminal_seals_fn();

-- A command's lifecycle moves its target (docs/fleet.md: the mapping is
-- rvbox_domain::fleet::target_state, and a store test holds the two equal).
CREATE FUNCTION fleet_target_follows_command_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fleet_targets SET
        state = CASE NEW.lifecycle
            WHEN 1 THEN 2 WHEN 2 THEN 2
            WHEN 3 THEN 3 WHEN 4 THEN 3
            WHEN 5 THEN 4
            WHEN 9 THEN 6
            WHEN 11 THEN 7
            ELSE 5 END,
        lifecycle = NEW.lifecycle,
        exit_code = NEW.exit_code,
        exit_signal = NEW.exit_signal,
        ended_ms = CASE WHEN NEW.lifecycle >= 5 THEN NEW.terminal_time_ms ELSE NULL END
    WHERE issue_uuid = NEW.issue_uuid;
    RETURN NULL;
END
$$;
CREATE TRIGGER fleet_target_follows_command AFTER UPDATE OF lifecycle ON commands
FOR EACH ROW WHEN (NEW.lifecycle <> OLD.lifecycle)
EXECUTE FUNCTION fleet_target_follows_command_fn();

-- An exit code recorded after the lifecycle (never today; kept in step).
CREATE FUNCTION fleet_target_follows_exit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fleet_targets SET exit_code = NEW.exit_code, exit_signal = NEW.exit_signal
    WHERE issue_uuid = NEW.issue_uuid;
    RETURN NULL;
END
$$;
CREATE TRIGGER fleet_target_follows_exit AFTER UPDATE OF exit_code, exit_signal ON commands
FOR EACH ROW WHEN (NEW.lifecycle = OLD.lifecycle
     AND (NEW.exit_code IS DISTINCT FROM OLD.exit_code OR NEW.exit_signal IS DISTINCT FROM OLD.exit_signal))
EXECUTE FUNCTION fleet_target_follows_exit_fn();

-- A target's state moves its run's counters and change position.
CREATE FUNCTION fleet_counts_follow_targets_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fleet_runs SET
        n_pending = n_pending - (OLD.state = 1)::int + (NEW.state = 1)::int,
        n_queued = n_queued - (OLD.state = 2)::int + (NEW.state = 2)::int,
        n_running = n_running - (OLD.state = 3)::int + (NEW.state = 3)::int,
        n_succeeded = n_succeeded - (OLD.state = 4)::int + (NEW.state = 4)::int,
        n_failed = n_failed - (OLD.state = 5)::int + (NEW.state = 5)::int,
        n_unreachable = n_unreachable - (OLD.state = 6)::int + (NEW.state = 6)::int,
        n_cancelled = n_cancelled - (OLD.state = 7)::int + (NEW.state = 7)::int,
        n_skipped = n_skipped - (OLD.state = 8)::int + (NEW.state = 8)::int,
        change_seq = change_seq + 1
    WHERE run_id = NEW.run_id;
    UPDATE fleet_targets SET
        change_seq = (SELECT change_seq FROM fleet_runs WHERE run_id = NEW.run_id)
    WHERE run_id = NEW.run_id AND client_id = NEW.client_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER fleet_counts_follow_targets AFTER UPDATE OF state ON fleet_targets
FOR EACH ROW WHEN (NEW.state <> OLD.state)
EXECUTE FUNCTION fleet_counts_follow_targets_fn();

CREATE FUNCTION fleet_counts_follow_new_targets_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fleet_runs SET
        targets = targets + 1,
        n_pending = n_pending + (NEW.state = 1)::int,
        n_queued = n_queued + (NEW.state = 2)::int,
        n_running = n_running + (NEW.state = 3)::int,
        n_succeeded = n_succeeded + (NEW.state = 4)::int,
        n_failed = n_failed + (NEW.state = 5)::int,
        n_unreachable = n_unreachable + (NEW.state = 6)::int,
        n_cancelled = n_cancelled + (NEW.state = 7)::int,
        n_skipped = n_skipped + (NEW.state = 8)::int,
        change_seq = change_seq + 1
    WHERE run_id = NEW.run_id;
    UPDATE fleet_targets SET
        change_seq = (SELECT change_seq FROM fleet_runs WHERE run_id = NEW.run_id)
    WHERE run_id = NEW.run_id AND client_id = NEW.client_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER fleet_counts_follow_new_targets AFTER INSERT ON fleet_targets
FOR EACH ROW EXECUTE FUNCTION fleet_counts_follow_new_targets_fn();
