-- Placement constraints (issue 16). A VM's constraints are kept as JSON for
-- reads; the group it was placed in is kept in plain columns, so that every
-- release path gives its slot back without parsing JSON.
ALTER TABLE vms ADD COLUMN constraints TEXT NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN group_name TEXT NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN spread_by TEXT NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN spread_domain TEXT NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN group_cap INTEGER NOT NULL DEFAULT 0;

ALTER TABLE forks ADD COLUMN constraints TEXT NOT NULL DEFAULT '';

-- How many VMs of a group hold capacity in each domain (a host, or a value
-- of the spread label). A reservation takes a slot with a conditional
-- upsert (vm_count < cap) in the same transaction as the capacity; the
-- database, not a replica's memory, decides the last slot of a domain.
CREATE TABLE group_domains (
    group_name TEXT NOT NULL,
    spread_by  TEXT NOT NULL,
    domain     TEXT NOT NULL,
    vm_count   INTEGER NOT NULL,
    PRIMARY KEY (group_name, spread_by, domain),
    CHECK (vm_count >= 0)
);
