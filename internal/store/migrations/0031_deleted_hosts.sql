-- A tombstone per deleted host, written in the transaction of the delete,
-- so that a replica refreshing its host view from the rows changed since
-- its last read (Store.HostChanges) also learns which hosts went away.
-- Expand only: a replica of the release before deletes hosts without a
-- tombstone, and the periodic full reload of the view catches those.
CREATE TABLE deleted_hosts (
    name       TEXT NOT NULL,
    deleted_at TIMESTAMP NOT NULL
);
CREATE INDEX deleted_hosts_deleted_at ON deleted_hosts (deleted_at);
