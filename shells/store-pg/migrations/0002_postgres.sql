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

-- Output bytes (the database output store, shells/store-pg/src/output.rs):
-- one row per output event, the bytes exactly as the client compressed
-- them, with the SHA-256 of the raw bytes that every read checks. The
-- event's metadata row in command_events comes first; the chunk goes with
-- it.
CREATE TABLE output_chunks (
    issue_uuid   bytea NOT NULL,
    event_seq    bigint NOT NULL,
    stream       bigint NOT NULL CHECK (stream IN (1, 2)),
    compression  bigint NOT NULL CHECK (compression IN (0, 1)),
    raw_len      bigint NOT NULL CHECK (raw_len BETWEEN 0 AND 65536),
    sha256       bytea NOT NULL CHECK (octet_length(sha256) = 32),
    stored       bytea NOT NULL,
    PRIMARY KEY (issue_uuid, event_seq),
    FOREIGN KEY (issue_uuid, event_seq)
        REFERENCES command_events (issue_uuid, event_seq) ON DELETE CASCADE
);
-- the bytes are compressed by the client already: stored out of line
-- without a second compression attempt
ALTER TABLE output_chunks ALTER COLUMN stored SET STORAGE EXTERNAL;
