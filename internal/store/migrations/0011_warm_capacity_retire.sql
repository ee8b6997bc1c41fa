-- What each host's warm pool holds (ready and booting warm VMs), as its
-- agent last reported it: the host's allocation shows it beside the user
-- VMs' (alloc_*), and its free capacity leaves it out. The reservation
-- does not count it: a create that needs the warm VMs' share makes the
-- agent evict them first. isolation is how the agent holds each VM to its
-- shape ("cgroup v2 ..." or "none: <why>").
ALTER TABLE hosts ADD COLUMN warm_vcpus BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN warm_memory_mib BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN warm_disk_mib BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN isolation TEXT NOT NULL DEFAULT '';

-- A retired host: its agent is gone for good. Retiring marks its VMs lost
-- and releases their capacity in one transaction; a retired host takes no
-- VM and is not synced.
ALTER TABLE hosts ADD COLUMN retired_at TIMESTAMP NULL;
