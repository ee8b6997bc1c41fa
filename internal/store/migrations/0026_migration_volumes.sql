-- Volumes migrate with their VM (issue 27): the read-write volumes of a
-- migrating VM move to the target with it. volumes lists them ({"id",
-- "size_mib"} each, as the reservation saw them) and the target's
-- reservation holds their sizes beside the VM's disk, taken by the same
-- conditional UPDATE (disk_mib stays the VM's own share). At the switch
-- the volume rows' host_name moves to the target and their sizes leave
-- the source's alloc_disk_mib, in the transaction that switches the VM
-- row; an undo gives the target back the VM's share and the volumes'.
ALTER TABLE vm_migrations ADD COLUMN volumes TEXT NOT NULL DEFAULT '[]';
