-- Forks (DESIGN.md section 7). The fork id is also the snapshot id on the
-- agents. Children are ordinary rows of vms with fork_id set and the fixed
-- name <fork>-<slot>; the unique index below makes a slot hold one child.

CREATE TABLE forks (
    id              TEXT PRIMARY KEY,
    source_vm_id    TEXT NOT NULL,
    -- the source's host and shape when the fork was made: children and the
    -- snapshot delete need them even after the source VM is gone
    source_host     TEXT NOT NULL,
    image           TEXT NOT NULL,
    vcpus           BIGINT NOT NULL,
    memory_mib      BIGINT NOT NULL,
    disk_mib        BIGINT NOT NULL,
    child_count     INTEGER NOT NULL,
    pause_source    BOOLEAN NOT NULL DEFAULT FALSE,
    placement       TEXT NOT NULL,
    -- durable before any child exists (row, reservation or agent call)
    snapshot_taken  BOOLEAN NOT NULL DEFAULT FALSE,
    -- every host that may hold the snapshot (JSON list): the source's and
    -- each host a child was sent to (they pull a copy)
    snapshot_hosts  TEXT NOT NULL DEFAULT '[]',
    phase           TEXT NOT NULL,
    error           TEXT NOT NULL DEFAULT '',
    idempotency_key TEXT NULL,
    created_at      TIMESTAMP NOT NULL,
    updated_at      TIMESTAMP NOT NULL
);
CREATE UNIQUE INDEX forks_idempotency_key ON forks (idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX forks_phase ON forks (phase);

ALTER TABLE vms ADD COLUMN fork_slot INTEGER NULL;
CREATE UNIQUE INDEX vms_fork_slot ON vms (fork_id, fork_slot) WHERE fork_id IS NOT NULL AND fork_slot IS NOT NULL;
