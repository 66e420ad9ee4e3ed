-- The replay guard of fleet runs: when retention deletes a done run (with
-- its targets and its idempotency rows), its id stays here, so a RunFleet
-- replayed with that request_id is refused ALREADY_EXECUTED instead of
-- creating the run again. A FIFO in insertion order, trimmed to the same
-- cap as the command tombstones (retention.tombstones).
CREATE TABLE fleet_run_tombstones (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id        BLOB NOT NULL UNIQUE CHECK (length(run_id) = 16),
    pruned_ms     INTEGER NOT NULL
) STRICT;
