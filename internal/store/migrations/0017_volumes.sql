-- Volumes: qcow2 disks on one host that outlive the VMs they are
-- attached to. A volume holds its size on its host's alloc_disk_mib and
-- its project's used_disk_mib while holds_capacity is set: it is reserved
-- with the row's insert and released exactly once (the conditional UPDATE
-- on holds_capacity), so a host's allocation equals the rows of its VMs
-- plus the rows of its volumes that hold capacity.
--
-- state: creating (reserved; the agent may or may not have made it yet),
-- ready, deleting (the agent is asked to delete it; the row and its
-- capacity go once the agent confirmed), error. A control replica killed
-- in between leaves a creating or deleting row that the host monitor
-- finishes (owner_replica names the replica that runs the step).
--
-- Attachments: rw_vm is the VM that has the volume read-write (NULL: none)
-- and readers counts the read-only attachments; both change by
-- conditional UPDATEs of this row, so two VMs never both get it
-- read-write on any replica. volume_attachments lists them all; a VM's
-- delete detaches its volumes in its transaction (no cascade: a path that
-- forgot to would fail on the foreign key instead of leaking rw_vm).
CREATE TABLE volumes (
    id             TEXT PRIMARY KEY,
    project        TEXT NOT NULL DEFAULT 'default',
    name           TEXT NOT NULL,
    host_name      TEXT NOT NULL REFERENCES hosts (name),
    size_mib       BIGINT NOT NULL,
    source_image   TEXT NOT NULL DEFAULT '',
    source_volume  TEXT NOT NULL DEFAULT '',
    labels         TEXT NOT NULL DEFAULT '{}',
    state          TEXT NOT NULL,
    reason         TEXT NOT NULL DEFAULT '',
    holds_capacity BOOLEAN NOT NULL,
    rw_vm          TEXT NULL,
    readers        BIGINT NOT NULL DEFAULT 0,
    placement      TEXT NOT NULL DEFAULT '',
    owner_replica  TEXT NULL,
    created_at     TIMESTAMP NOT NULL,
    updated_at     TIMESTAMP NOT NULL,
    CONSTRAINT volumes_size CHECK (size_mib > 0),
    CONSTRAINT volumes_readers CHECK (readers >= 0)
);
CREATE UNIQUE INDEX volumes_project_name ON volumes (project, name);
CREATE INDEX volumes_host ON volumes (host_name);
CREATE INDEX volumes_state ON volumes (state);

CREATE TABLE volume_attachments (
    volume_id  TEXT NOT NULL REFERENCES volumes (id),
    vm_id      TEXT NOT NULL REFERENCES vms (id),
    read_only  BOOLEAN NOT NULL,
    created_at TIMESTAMP NOT NULL,
    PRIMARY KEY (volume_id, vm_id)
);
CREATE INDEX volume_attachments_vm ON volume_attachments (vm_id);
