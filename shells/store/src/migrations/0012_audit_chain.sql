-- The audit log as a hash chain (docs/storage.md, "The audit chain"):
-- every record appended to an audit segment carries the SHA-256 of the
-- record before it, and the database keeps, per segment, the hash its
-- first chained record continues (`chain_start`) and the hash of its last
-- committed record (`chain_end`). `rvbox-server audit verify` recomputes
-- the chain from the files and compares it with these columns, so an
-- edited, removed or reordered record is found. Segments written before
-- this migration have neither (NULL): their records are reported
-- unchained. The hash the oldest kept segment continues after rotation is
-- `store_meta.audit_chain_floor`.
ALTER TABLE audit_segments ADD COLUMN chain_start BLOB
    CHECK (chain_start IS NULL OR length(chain_start) = 32);
ALTER TABLE audit_segments ADD COLUMN chain_end BLOB
    CHECK (chain_end IS NULL OR length(chain_end) = 32);
