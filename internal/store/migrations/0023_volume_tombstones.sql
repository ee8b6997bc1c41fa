-- Tombstones of deleted volume rows, like deleted_vms for VMs. The host
-- monitor deletes a volume that its agent has without a row only when the
-- row was deleted on purpose (a delete, or the undo of a create that never
-- finished): a volume with neither row nor tombstone may hold the data of
-- an acknowledged create that the database lost (a power loss with
-- --sqlite-sync normal, a restored backup, a row removed by hand), and is
-- kept for an operator instead.
CREATE TABLE deleted_volumes (
    volume_id  TEXT PRIMARY KEY,
    host_name  TEXT NOT NULL,
    deleted_at TIMESTAMP NOT NULL
);
