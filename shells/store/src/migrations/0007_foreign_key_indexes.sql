-- Every foreign key's child column leads an index, so the cascade a
-- parent's deletion runs is a search, never a scan of the child table.
-- `control_mutations` holds one row per idempotent Control write (one per
-- RunCommand among them): without these, evicting one command scanned every
-- mutation the store remembers, and so did deleting an idle client or a
-- resolved incident (docs/storage.md, "Costs"). The checks
-- (`shells/store/tests/plans.rs`) plan the lookup of every foreign key in
-- the schema.
CREATE INDEX control_mutations_by_command ON control_mutations (command_uuid)
    WHERE command_uuid IS NOT NULL;
CREATE INDEX control_mutations_by_incident ON control_mutations (incident_id)
    WHERE incident_id IS NOT NULL;
CREATE INDEX control_mutations_by_client ON control_mutations (client_id)
    WHERE client_id IS NOT NULL;
CREATE INDEX takeover_authorizations_by_client ON takeover_authorizations (client_id);
