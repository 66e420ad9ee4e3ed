-- The audit log's counted size, kept by the maintenance pass alone (never
-- by the writes, which would make one row every audited operation of
-- every replica contends for): the bytes of the rows up to counted_seq.
-- Rows above it are added by the next pass once they are a minute old, so
-- a transaction still open then is never skipped.
CREATE TABLE audit_usage (
    id          bigint PRIMARY KEY CHECK (id = 1),
    counted_seq bigint NOT NULL CHECK (counted_seq >= 0),
    bytes       bigint NOT NULL CHECK (bytes >= 0)
);
INSERT INTO audit_usage (id, counted_seq, bytes) VALUES (1, 0, 0);
