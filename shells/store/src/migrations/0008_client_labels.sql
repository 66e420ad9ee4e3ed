-- Client labels (client.labels in the client's configuration, carried in
-- the hello): the normalized `key=value,key=value` text, sorted by key,
-- empty for a client without labels or one that never registered. Fleet
-- runs and list filters match selectors against it.
ALTER TABLE clients ADD COLUMN labels TEXT NOT NULL DEFAULT '' CHECK (length(labels) <= 8192);
