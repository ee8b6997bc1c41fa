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
