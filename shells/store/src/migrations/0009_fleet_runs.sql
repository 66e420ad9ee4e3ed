-- Fleet runs: one command on every client a selection resolves to, with
-- rate control (docs/fleet.md). A run is a set of ordinary commands; its
-- targets follow their commands' lifecycles, and its counters follow its
-- targets, through triggers, so every write that moves a command moves its
-- target and its run's counters in the same transaction, whatever the
-- write path (events, reconciliation, expiry, signals, recovery).

CREATE TABLE fleet_runs (
    run_id          BLOB PRIMARY KEY CHECK (length(run_id) = 16),
    -- rvbox.v1.FleetRunState: 1 running, 2 paused, 3 stopping, 4 done
    state           INTEGER NOT NULL CHECK (state BETWEEN 1 AND 4),
    -- rvbox.v1.FleetStopReason: 0 none, 1 max errors, 2 cancelled
    stop_reason     INTEGER NOT NULL DEFAULT 0 CHECK (stop_reason BETWEEN 0 AND 2),
    selection       BLOB NOT NULL,                  -- encoded rvbox.v1.FleetSelection
    spec_zstd       BLOB NOT NULL,                  -- zstd of the encoded, normalized ExecutionSpec
    spec_raw_len    INTEGER NOT NULL CHECK (spec_raw_len > 0),
    script_zstd     BLOB,                           -- the script (<= 256 KiB raw), for late releases
    queue_ttl_ms    INTEGER NOT NULL CHECK (queue_ttl_ms >= 0),   -- 0: indefinite
    max_parallel    BLOB,                           -- encoded rvbox.v1.FleetLimit; NULL: none
    max_errors      BLOB,                           -- encoded rvbox.v1.FleetLimit; NULL: none
    created_ms      INTEGER NOT NULL,
    late_until_ms   INTEGER,                        -- NULL: no include_late window
    done_ms         INTEGER,
    targets         INTEGER NOT NULL DEFAULT 0 CHECK (targets >= 0),
    n_pending       INTEGER NOT NULL DEFAULT 0 CHECK (n_pending >= 0),
    n_queued        INTEGER NOT NULL DEFAULT 0 CHECK (n_queued >= 0),
    n_running       INTEGER NOT NULL DEFAULT 0 CHECK (n_running >= 0),
    n_succeeded     INTEGER NOT NULL DEFAULT 0 CHECK (n_succeeded >= 0),
    n_failed        INTEGER NOT NULL DEFAULT 0 CHECK (n_failed >= 0),
    n_unreachable   INTEGER NOT NULL DEFAULT 0 CHECK (n_unreachable >= 0),
    n_cancelled     INTEGER NOT NULL DEFAULT 0 CHECK (n_cancelled >= 0),
    n_skipped       INTEGER NOT NULL DEFAULT 0 CHECK (n_skipped >= 0),
    -- position of the latest target change (FollowFleetRun's cursor)
    change_seq      INTEGER NOT NULL DEFAULT 0 CHECK (change_seq >= 0),
    CHECK ((state = 4) = (done_ms IS NOT NULL)),
    CHECK (targets = n_pending + n_queued + n_running + n_succeeded + n_failed
                     + n_unreachable + n_cancelled + n_skipped)
) STRICT;
-- ListFleetRuns, newest first.
CREATE INDEX fleet_runs_by_created ON fleet_runs (created_ms DESC, run_id DESC);
-- The runs the release pump and late registrations look at.
CREATE INDEX fleet_runs_live ON fleet_runs (state) WHERE state < 4;

CREATE TABLE fleet_targets (
    run_id       BLOB NOT NULL REFERENCES fleet_runs (run_id) ON DELETE CASCADE,
    client_id    TEXT NOT NULL CHECK (length(client_id) BETWEEN 1 AND 128),
    -- the target's command id, derived from the run id and the client id;
    -- the command row exists from release until retention removes it
    issue_uuid   BLOB NOT NULL CHECK (length(issue_uuid) = 16),
    -- rvbox.v1.FleetTargetState 1..8
    state        INTEGER NOT NULL CHECK (state BETWEEN 1 AND 8),
    lifecycle    INTEGER CHECK (lifecycle IS NULL OR lifecycle BETWEEN 1 AND 11),
    exit_code    INTEGER,
    exit_signal  INTEGER,
    rejection    BLOB,                               -- encoded rvbox.v1.ErrorDetail
    released_ms  INTEGER,
    ended_ms     INTEGER,
    late         INTEGER NOT NULL DEFAULT 0 CHECK (late IN (0, 1)),
    change_seq   INTEGER NOT NULL DEFAULT 0 CHECK (change_seq >= 0),
    PRIMARY KEY (run_id, client_id),
    CHECK ((state = 1) = (released_ms IS NULL) OR state IN (7, 8))
) STRICT, WITHOUT ROWID;
CREATE UNIQUE INDEX fleet_targets_by_issue ON fleet_targets (issue_uuid);
CREATE INDEX fleet_targets_by_state ON fleet_targets (run_id, state, client_id);
CREATE INDEX fleet_targets_by_change ON fleet_targets (run_id, change_seq);

-- A command's lifecycle moves its target (docs/fleet.md: the mapping is
-- rvbox_domain::fleet::target_state, and a store test holds the two equal).
CREATE TRIGGER fleet_target_follows_command AFTER UPDATE OF lifecycle ON commands
WHEN NEW.lifecycle <> OLD.lifecycle BEGIN
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
END;

-- An exit code recorded after the lifecycle (never today; kept in step).
CREATE TRIGGER fleet_target_follows_exit AFTER UPDATE OF exit_code, exit_signal ON commands
WHEN NEW.lifecycle = OLD.lifecycle
     AND (NEW.exit_code IS NOT OLD.exit_code OR NEW.exit_signal IS NOT OLD.exit_signal) BEGIN
    UPDATE fleet_targets SET exit_code = NEW.exit_code, exit_signal = NEW.exit_signal
    WHERE issue_uuid = NEW.issue_uuid;
END;

-- A target's state moves its run's counters and change position.
CREATE TRIGGER fleet_counts_follow_targets AFTER UPDATE OF state ON fleet_targets
WHEN NEW.state <> OLD.state BEGIN
    UPDATE fleet_runs SET
        n_pending = n_pending - (OLD.state = 1) + (NEW.state = 1),
        n_queued = n_queued - (OLD.state = 2) + (NEW.state = 2),
        n_running = n_running - (OLD.state = 3) + (NEW.state = 3),
        n_succeeded = n_succeeded - (OLD.state = 4) + (NEW.state = 4),
        n_failed = n_failed - (OLD.state = 5) + (NEW.state = 5),
        n_unreachable = n_unreachable - (OLD.state = 6) + (NEW.state = 6),
        n_cancelled = n_cancelled - (OLD.state = 7) + (NEW.state = 7),
        n_skipped = n_skipped - (OLD.state = 8) + (NEW.state = 8),
        change_seq = change_seq + 1
    WHERE run_id = NEW.run_id;
    UPDATE fleet_targets SET
        change_seq = (SELECT change_seq FROM fleet_runs WHERE run_id = NEW.run_id)
    WHERE run_id = NEW.run_id AND client_id = NEW.client_id;
END;

CREATE TRIGGER fleet_counts_follow_new_targets AFTER INSERT ON fleet_targets BEGIN
    UPDATE fleet_runs SET
        targets = targets + 1,
        n_pending = n_pending + (NEW.state = 1),
        n_queued = n_queued + (NEW.state = 2),
        n_running = n_running + (NEW.state = 3),
        n_succeeded = n_succeeded + (NEW.state = 4),
        n_failed = n_failed + (NEW.state = 5),
        n_unreachable = n_unreachable + (NEW.state = 6),
        n_cancelled = n_cancelled + (NEW.state = 7),
        n_skipped = n_skipped + (NEW.state = 8),
        change_seq = change_seq + 1
    WHERE run_id = NEW.run_id;
    UPDATE fleet_targets SET
        change_seq = (SELECT change_seq FROM fleet_runs WHERE run_id = NEW.run_id)
    WHERE run_id = NEW.run_id AND client_id = NEW.client_id;
END;

-- Idempotency rows of fleet mutations belong to their run: the table is
-- rebuilt with a fourth owner column (SQLite cannot change a CHECK).
CREATE TABLE control_mutations_v9 (
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
    fleet_run_id    BLOB REFERENCES fleet_runs (run_id) ON DELETE CASCADE,
    CHECK ((command_uuid IS NOT NULL) + (incident_id IS NOT NULL) + (client_id IS NOT NULL)
           + (fleet_run_id IS NOT NULL) = 1)
) STRICT;
INSERT INTO control_mutations_v9 (request_id, method, request_hash, command_uuid, incident_id,
        client_id, write_seq, revision, result, result_is_error, created_ms)
    SELECT request_id, method, request_hash, command_uuid, incident_id, client_id, write_seq,
        revision, result, result_is_error, created_ms FROM control_mutations;
DROP TABLE control_mutations;
ALTER TABLE control_mutations_v9 RENAME TO control_mutations;
CREATE INDEX control_mutations_by_command ON control_mutations (command_uuid)
    WHERE command_uuid IS NOT NULL;
CREATE INDEX control_mutations_by_incident ON control_mutations (incident_id)
    WHERE incident_id IS NOT NULL;
CREATE INDEX control_mutations_by_client ON control_mutations (client_id)
    WHERE client_id IS NOT NULL;
CREATE INDEX control_mutations_by_fleet_run ON control_mutations (fleet_run_id)
    WHERE fleet_run_id IS NOT NULL;
