-- Replica leases. Each control replica heartbeats its row every few
-- seconds; a replica whose heartbeat is older than the lapse is gone (killed,
-- or cut off from the database). Creates and forks record the replica that
-- runs them (owner_replica): once the owner's lease has lapsed, any replica
-- settles them from what the agents report, in seconds instead of waiting
-- out a create's whole bound. NULL owner: written before this migration, or
-- by a tool; such rows keep the old grace period.
CREATE TABLE replicas (
    id           TEXT PRIMARY KEY,
    started_at   TIMESTAMP NOT NULL,
    heartbeat_at TIMESTAMP NOT NULL
);
ALTER TABLE vms ADD COLUMN owner_replica TEXT NULL;
ALTER TABLE forks ADD COLUMN owner_replica TEXT NULL;

-- Tombstones of deleted VM rows. The host monitor deletes a VM that its
-- agent runs without a row only when the row was deleted on purpose (a
-- failed create's cleanup, a delete): a VM with neither row nor tombstone
-- may be an acknowledged create that the database lost (a power loss with
-- --sqlite-sync normal, a restore), and is kept for an operator instead.
CREATE TABLE deleted_vms (
    vm_id      TEXT PRIMARY KEY,
    host_name  TEXT NOT NULL,
    deleted_at TIMESTAMP NOT NULL
);
