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
-- of the spread label), and the cap (max_per_domain, 0: none) the last VM
-- placed there asked for. A reservation takes a slot in the same
-- transaction (on PostgreSQL the same statement) as the capacity, and the
-- CHECK refuses a count past the cap: the database, not a replica's
-- memory, decides the last slot of a domain.
CREATE TABLE group_domains (
    group_name TEXT NOT NULL,
    spread_by  TEXT NOT NULL,
    domain     TEXT NOT NULL,
    vm_count   INTEGER NOT NULL,
    vm_cap     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (group_name, spread_by, domain),
    CHECK (vm_count >= 0),
    CONSTRAINT group_domains_cap CHECK (vm_cap = 0 OR vm_count <= vm_cap)
);
