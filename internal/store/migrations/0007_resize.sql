-- In-place resize of a VM's vCPUs and memory. A resize reserves its growth
-- on the VM's host and records the shape it is applying here, in one
-- transaction, before it asks the agent; while pending_vcpus is set the
-- host's allocation holds the larger of the two shapes for each resource,
-- so either outcome is covered. The resize (or, after a crash, the host
-- monitor, from the shape the agent reports) then settles it: vcpus and
-- memory_mib take the shape the VM has, pending_* go back to NULL and the
-- host gives back what that shape does not use.
ALTER TABLE vms ADD COLUMN pending_vcpus BIGINT NULL;
ALTER TABLE vms ADD COLUMN pending_memory_mib BIGINT NULL;
ALTER TABLE vms ADD COLUMN resize_started_at TIMESTAMP NULL;
