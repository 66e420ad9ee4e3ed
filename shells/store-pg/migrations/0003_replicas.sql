-- Several server replicas on one database (docs/scaleout.md).
--
-- Each replica process joins with a random id and an epoch from the
-- sequence, and holds a lease on the database clock; it renews the lease
-- while it lives, and a lease that ended is never renewed (the replica
-- joins again, with a new epoch).
CREATE SEQUENCE replica_epochs AS bigint START 1;
CREATE TABLE replicas (
    replica_id     bytea PRIMARY KEY CHECK (octet_length(replica_id) = 16),
    epoch          bigint NOT NULL UNIQUE CHECK (epoch >= 1),
    lease_expires  timestamptz NOT NULL,
    joined_at      timestamptz NOT NULL DEFAULT now(),
    peer_addr      text COLLATE "C" CHECK (peer_addr IS NULL OR char_length(peer_addr) <= 256)
);

-- The single-runner duties: each runs on the replica holding its lease.
CREATE TABLE duties (
    name           text COLLATE "C" PRIMARY KEY,
    replica_id     bytea CHECK (replica_id IS NULL OR octet_length(replica_id) = 16),
    epoch          bigint,
    lease_expires  timestamptz,
    CHECK ((replica_id IS NULL) = (epoch IS NULL) AND (epoch IS NULL) = (lease_expires IS NULL))
);
INSERT INTO duties (name) VALUES
    ('expiry'), ('maintenance'), ('scrub'), ('fleet_pump'), ('janitor');

-- The replica a live session's socket is on: the janitor ends the live
-- sessions of replicas whose lease ended.
ALTER TABLE sessions ADD COLUMN owner_replica bytea
    CHECK (owner_replica IS NULL OR octet_length(owner_replica) = 16);
ALTER TABLE sessions ADD COLUMN owner_epoch bigint;
CREATE INDEX sessions_live_by_owner ON sessions (owner_replica) WHERE live;
