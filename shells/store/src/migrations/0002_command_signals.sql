-- Signals the server decided for a command the client may hold (plan §6.4,
-- R-6.4-36, R-6.4-11): an operator signal on dispatched, accepted or running
-- work, and the TERM after a late acceptance. Each is made durable with the
-- higher revision it carries, before the Signal frame is sent, and is sent
-- again after every reconnect (reconciliation) and every acceptance until
-- the command ends; the client ignores a revision it has already handled.
-- Like pending POSIX signals, one kind is kept once: a newer signal of the
-- same kind replaces the older row, so a command holds at most six rows.
-- Rows go with their command.
CREATE TABLE command_signals (
    issue_uuid  BLOB NOT NULL REFERENCES commands (issue_uuid) ON DELETE CASCADE,
    signal      INTEGER NOT NULL CHECK (signal BETWEEN 1 AND 6),
    revision    INTEGER NOT NULL CHECK (revision >= 2),
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (issue_uuid, signal)
) STRICT, WITHOUT ROWID;
