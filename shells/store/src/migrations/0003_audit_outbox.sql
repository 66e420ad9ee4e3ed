-- The audit outbox (plan §5.2: every mutation transaction records its
-- audit intent/result consistently). An audited write inserts its record
-- here inside its own transaction, so the record commits with the effect
-- or not at all, without an extra fsync per write. Records move to the
-- compressed audit segments in batches (one append, one fsync, one
-- transaction that also deletes the moved rows); a crash between the two
-- leaves the rows here and an uncommitted segment tail that recovery cuts.
-- Ids only grow and rows leave oldest first.
CREATE TABLE audit_outbox (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms  INTEGER NOT NULL,
    record   BLOB NOT NULL CHECK (length(record) <= 524288)
) STRICT;
