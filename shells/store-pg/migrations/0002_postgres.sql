-- What only the PostgreSQL store has.
--
-- The audit log. Each audited effect writes its record here in its own
-- transaction, so a record commits with its effect or not at all; the
-- records stay in the database (there are no audit segment files on
-- PostgreSQL). `seq` is the order of insertion, not of commit: readers
-- order by it and accept that a concurrent transaction may commit a lower
-- number a moment later.
CREATE TABLE audit_log (
    seq      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    time_ms  bigint NOT NULL,
    record   bytea NOT NULL CHECK (octet_length(record) <= 524288)
);
CREATE INDEX audit_log_by_time ON audit_log (time_ms, seq);
