-- The PostgreSQL form of SQLite migration 0012 (the audit chain columns
-- of audit segments). The PostgreSQL store keeps its audit records in
-- `audit_log` and has no audit segments; the table mirrors the SQLite
-- schema so the two stay comparable (shells/store-pg/tests/schema_diff.py).
ALTER TABLE audit_segments ADD COLUMN chain_start bytea
    CHECK (chain_start IS NULL OR octet_length(chain_start) = 32);
ALTER TABLE audit_segments ADD COLUMN chain_end bytea
    CHECK (chain_end IS NULL OR octet_length(chain_end) = 32);
