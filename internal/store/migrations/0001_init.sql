-- Hosts, VMs, their labels and idempotency keys. Plain SQL that SQLite and
-- PostgreSQL (and PostgreSQL-compatible distributed databases) both accept.
-- Migrations are append-only: change the schema with a new numbered file.

CREATE TABLE hosts (
    name                 TEXT PRIMARY KEY,
    address              TEXT NOT NULL,
    labels               TEXT NOT NULL DEFAULT '{}',
    schedulable          BOOLEAN NOT NULL DEFAULT TRUE,
    alive                BOOLEAN NOT NULL DEFAULT FALSE,
    missed_syncs         INTEGER NOT NULL DEFAULT 0,
    last_seen            TIMESTAMP NULL,
    accel                TEXT NOT NULL DEFAULT '',
    driver               TEXT NOT NULL DEFAULT '',
    images               TEXT NOT NULL DEFAULT '[]',
    cpu_allocation_ratio DOUBLE PRECISION NOT NULL DEFAULT 1,
    memory_reserved_mib  BIGINT NOT NULL DEFAULT 0,
    -- physical totals as the agent reports them
    total_vcpus          BIGINT NOT NULL DEFAULT 0,
    total_memory_mib     BIGINT NOT NULL DEFAULT 0,
    total_disk_mib       BIGINT NOT NULL DEFAULT 0,
    -- usable capacity: (total - reserved) x ratio, kept here so that the
    -- reservation's conditional UPDATE compares plain columns
    cap_vcpus            BIGINT NOT NULL DEFAULT 0,
    cap_memory_mib       BIGINT NOT NULL DEFAULT 0,
    cap_disk_mib         BIGINT NOT NULL DEFAULT 0,
    -- the sum of the VMs that hold capacity here
    alloc_vcpus          BIGINT NOT NULL DEFAULT 0,
    alloc_memory_mib     BIGINT NOT NULL DEFAULT 0,
    alloc_disk_mib       BIGINT NOT NULL DEFAULT 0,
    warm_pool            TEXT NOT NULL DEFAULT '[]',
    created_at           TIMESTAMP NOT NULL,
    updated_at           TIMESTAMP NOT NULL,
    CHECK (alloc_vcpus >= 0 AND alloc_memory_mib >= 0 AND alloc_disk_mib >= 0)
);

CREATE TABLE vms (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    host_name      TEXT NOT NULL REFERENCES hosts (name),
    image          TEXT NOT NULL,
    vcpus          BIGINT NOT NULL,
    memory_mib     BIGINT NOT NULL,
    disk_mib       BIGINT NOT NULL,
    power_state    TEXT NOT NULL,
    observed_state TEXT NOT NULL,
    reason         TEXT NOT NULL DEFAULT '',
    started_from   TEXT NOT NULL DEFAULT '',
    -- true while the VM's resources are counted in its host's alloc_*;
    -- every release flips it with a conditional UPDATE, so it happens once
    holds_capacity BOOLEAN NOT NULL DEFAULT TRUE,
    fork_id        TEXT NULL,
    labels         TEXT NOT NULL DEFAULT '{}',
    placement      TEXT NOT NULL DEFAULT '',
    created_at     TIMESTAMP NOT NULL,
    updated_at     TIMESTAMP NOT NULL
);
CREATE UNIQUE INDEX vms_name ON vms (name);
CREATE INDEX vms_host_name ON vms (host_name, id);
-- Partial: VMs outside forks (most of them) cost no write in this index.
CREATE INDEX vms_fork_id ON vms (fork_id, id) WHERE fork_id IS NOT NULL;

-- One row per VM label, so that lists filter by label with plain SQL.
CREATE TABLE vm_labels (
    vm_id       TEXT NOT NULL REFERENCES vms (id) ON DELETE CASCADE,
    label_key   TEXT NOT NULL,
    label_value TEXT NOT NULL,
    PRIMARY KEY (vm_id, label_key)
);
CREATE INDEX vm_labels_key_value ON vm_labels (label_key, label_value, vm_id);

-- Idempotency-Key records. The primary key makes a retry on another
-- replica find the first request's row instead of starting a second one.
CREATE TABLE idempotency_keys (
    scope        TEXT NOT NULL,
    idem_key     TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status       INTEGER NOT NULL DEFAULT 0, -- 0 while in flight
    response     TEXT NOT NULL DEFAULT '',
    lease_until  BIGINT NOT NULL,            -- unix ms: in flight past this = abandoned
    expires_at   BIGINT NOT NULL,            -- unix ms
    created_at   TIMESTAMP NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
