-- Live and cold migration of a VM from its host (the source) to another
-- (the target). While a VM moves, both hosts hold its resources: the VM row
-- keeps the source's share (host_name is still the source), and this row
-- holds the target's, reserved with the same conditional UPDATE as a
-- create (and the group slot in the target's domain when that is another
-- domain) in the transaction that inserts the row. One row per VM: the
-- primary key refuses a second migration of the same VM on any replica.
--
-- state: reserved (the target's share is held; the agents may or may not
-- have been asked yet), moving (the source was asked to migrate), switched
-- (the VM runs on the target: the VM row points there and the source's
-- share was released in the same transaction; the source's stopped copy is
-- still to be deleted). The row goes when the migration is undone (the
-- target's share released in the same transaction) or, after the switch,
-- once the source confirmed the delete. owner_replica names the replica
-- that runs it; once its lease lapses the host monitor finishes or undoes
-- it from what the agents report.
CREATE TABLE vm_migrations (
    vm_id          TEXT PRIMARY KEY,
    source_host    TEXT NOT NULL,
    target_host    TEXT NOT NULL REFERENCES hosts (name),
    state          TEXT NOT NULL,
    live           BOOLEAN NOT NULL,
    vcpus          BIGINT NOT NULL,
    memory_mib     BIGINT NOT NULL,
    disk_mib       BIGINT NOT NULL,
    target_domain  TEXT NOT NULL DEFAULT '',
    drain_host     TEXT NOT NULL DEFAULT '',
    phase          TEXT NOT NULL DEFAULT '',
    transferred    BIGINT NOT NULL DEFAULT 0,
    total          BIGINT NOT NULL DEFAULT 0,
    owner_replica  TEXT NULL,
    started_at     TIMESTAMP NOT NULL,
    updated_at     TIMESTAMP NOT NULL
);
CREATE INDEX vm_migrations_target ON vm_migrations (target_host);
CREATE INDEX vm_migrations_source ON vm_migrations (source_host);
