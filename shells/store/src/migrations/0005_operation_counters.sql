-- Counts that gate an operation are maintained, never recounted with
-- COUNT(*) over a table that grows with the store's history: the queued
-- commands (lifecycle 1 queued or 2 dispatched) of each client and of the
-- whole server (the queue limits every RunCommand checks), and the replay
-- tombstones (the FIFO cap every terminal transition enforces). Triggers
-- keep them in the transaction of every write that changes them, so no
-- write path can miss one; the counter check compares them with a
-- recount, and the offline repair rebuilds them.
ALTER TABLE quota_totals ADD COLUMN queued INTEGER NOT NULL DEFAULT 0 CHECK (queued >= 0);
ALTER TABLE quota_totals ADD COLUMN tombstones INTEGER NOT NULL DEFAULT 0
    CHECK (tombstones >= 0);
-- One row per client with queued work (a row goes when its count reaches 0).
CREATE TABLE queued_by_client (
    client_id TEXT PRIMARY KEY,
    queued    INTEGER NOT NULL CHECK (queued >= 0)
) STRICT, WITHOUT ROWID;
INSERT INTO queued_by_client (client_id, queued)
    SELECT client_id, COUNT(*) FROM commands WHERE lifecycle IN (1, 2) GROUP BY client_id;
UPDATE quota_totals SET
    queued = (SELECT COUNT(*) FROM commands WHERE lifecycle IN (1, 2)),
    tombstones = (SELECT COUNT(*) FROM command_tombstones)
WHERE id = 1;

CREATE TRIGGER commands_queued_in AFTER INSERT ON commands
WHEN NEW.lifecycle IN (1, 2) BEGIN
    INSERT OR IGNORE INTO queued_by_client (client_id, queued) VALUES (NEW.client_id, 0);
    UPDATE queued_by_client SET queued = queued + 1 WHERE client_id = NEW.client_id;
    UPDATE quota_totals SET queued = queued + 1 WHERE id = 1;
END;
CREATE TRIGGER commands_queued_out AFTER DELETE ON commands
WHEN OLD.lifecycle IN (1, 2) BEGIN
    UPDATE queued_by_client SET queued = queued - 1 WHERE client_id = OLD.client_id;
    DELETE FROM queued_by_client WHERE client_id = OLD.client_id AND queued = 0;
    UPDATE quota_totals SET queued = queued - 1 WHERE id = 1;
END;
CREATE TRIGGER commands_queued_entered AFTER UPDATE OF lifecycle ON commands
WHEN NEW.lifecycle IN (1, 2) AND OLD.lifecycle NOT IN (1, 2) BEGIN
    INSERT OR IGNORE INTO queued_by_client (client_id, queued) VALUES (NEW.client_id, 0);
    UPDATE queued_by_client SET queued = queued + 1 WHERE client_id = NEW.client_id;
    UPDATE quota_totals SET queued = queued + 1 WHERE id = 1;
END;
CREATE TRIGGER commands_queued_left AFTER UPDATE OF lifecycle ON commands
WHEN OLD.lifecycle IN (1, 2) AND NEW.lifecycle NOT IN (1, 2) BEGIN
    UPDATE queued_by_client SET queued = queued - 1 WHERE client_id = OLD.client_id;
    DELETE FROM queued_by_client WHERE client_id = OLD.client_id AND queued = 0;
    UPDATE quota_totals SET queued = queued - 1 WHERE id = 1;
END;
CREATE TRIGGER tombstones_counted_in AFTER INSERT ON command_tombstones BEGIN
    UPDATE quota_totals SET tombstones = tombstones + 1 WHERE id = 1;
END;
CREATE TRIGGER tombstones_counted_out AFTER DELETE ON command_tombstones BEGIN
    UPDATE quota_totals SET tombstones = tombstones - 1 WHERE id = 1;
END;

-- A client's sessions by client id: the foreign-key checks of a client row
-- (its insert's, and the cascade when maintenance deletes an idle client)
-- look them up instead of scanning every session.
CREATE INDEX sessions_by_client ON sessions (client_id);

-- Commands marked for eviction, oldest first: the sweep at every start and
-- every maintenance pass rolls an interrupted eviction forward by reading
-- these few rows, never by walking every command.
CREATE INDEX commands_evicting ON commands (issue_time_ms, issue_uuid)
    WHERE retention = 'evicting';
