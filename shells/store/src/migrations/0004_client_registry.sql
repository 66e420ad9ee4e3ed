-- The client registry is bounded, pruned and charged (plan §5.4: every
-- durable row is charged). Rows of `clients` and `sessions` come from
-- unauthenticated hellos, so their numbers are counted in the same
-- transaction as every insert and delete (triggers: no write path can
-- miss one), charged against the server-wide tier at a fixed worst-case
-- size per row, and pruned: closed sessions beyond the newest few per
-- client at each registration, idle clients (no command, no live session,
-- no live grant) by maintenance.
ALTER TABLE quota_totals ADD COLUMN clients INTEGER NOT NULL DEFAULT 0 CHECK (clients >= 0);
ALTER TABLE quota_totals ADD COLUMN sessions INTEGER NOT NULL DEFAULT 0 CHECK (sessions >= 0);
-- The highest generation of any pruned client: a client id that comes back
-- starts above it, so no client ever sees its generation go backwards
-- (plan §6.2: generations only grow; the client refuses a welcome whose
-- generation is not above the last it saw).
ALTER TABLE quota_totals ADD COLUMN generation_floor INTEGER NOT NULL DEFAULT 0
    CHECK (generation_floor >= 0);
UPDATE quota_totals SET
    clients = (SELECT COUNT(*) FROM clients),
    sessions = (SELECT COUNT(*) FROM sessions)
WHERE id = 1;

CREATE TRIGGER clients_counted_in AFTER INSERT ON clients BEGIN
    UPDATE quota_totals SET clients = clients + 1 WHERE id = 1;
END;
CREATE TRIGGER clients_counted_out AFTER DELETE ON clients BEGIN
    UPDATE quota_totals SET clients = clients - 1 WHERE id = 1;
END;
CREATE TRIGGER sessions_counted_in AFTER INSERT ON sessions BEGIN
    UPDATE quota_totals SET sessions = sessions + 1 WHERE id = 1;
END;
CREATE TRIGGER sessions_counted_out AFTER DELETE ON sessions BEGIN
    UPDATE quota_totals SET sessions = sessions - 1 WHERE id = 1;
END;

-- The closed sessions of a client, newest first (pruning at registration).
CREATE INDEX sessions_closed_by_client ON sessions (client_id, closed_ms DESC, session_id DESC)
    WHERE live = 0;
-- Idle clients, least recently seen first (pruning by maintenance).
CREATE INDEX clients_by_last_seen ON clients (COALESCE(last_seen_ms, 0), client_id);
