-- Restart does bounded work (docs/storage.md, "Start-up"): only segments
-- that could hold an uncommitted tail, or that nobody has verified since
-- they were sealed, are read at a start; everything else is re-verified in
-- the background after the store is ready.
--
-- `verified` is the durable "verified at seal" fact: 1 once the segment's
-- committed range was read back and every record checked (at seal by the
-- writer, by a start's recovery, or by the background scrub). An active
-- segment is never verified (it may still grow); a segment the group
-- journal re-appends to loses the fact until it is scanned again.
ALTER TABLE command_segments ADD COLUMN verified INTEGER NOT NULL DEFAULT 0
    CHECK (verified IN (0, 1));

-- A command's output ends with its terminal transition, whichever path
-- makes it terminal: its active segment is sealed then, so the active
-- segments are those of the commands still running (bounded by the queue
-- and the running limits), never the store's whole history. The writer
-- marks it verified in the same transaction when it read it back.
CREATE TRIGGER commands_terminal_seals AFTER UPDATE OF lifecycle ON commands
WHEN NEW.lifecycle >= 5 AND OLD.lifecycle < 5 BEGIN
    UPDATE command_segments SET state = 'sealed'
        WHERE issue_uuid = NEW.issue_uuid AND state = 'active';
END;
UPDATE command_segments SET state = 'sealed'
    WHERE state = 'active'
      AND issue_uuid IN (SELECT issue_uuid FROM commands WHERE lifecycle >= 5);

-- What a start reads: live segments without the fact (active ones, and
-- sealed or blob ones not yet verified), a few rows however long the
-- history.
CREATE INDEX command_segments_unverified ON command_segments (issue_uuid, ordinal)
    WHERE verified = 0 AND state IN ('active', 'sealed', 'blob');

-- The commands a start checks (essential state of every non-terminal
-- command) and reconciles: the live ones only.
CREATE INDEX commands_live ON commands (issue_uuid) WHERE lifecycle < 5;
