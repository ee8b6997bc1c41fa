-- Projects: a team's share of the fleet. Every VM, fork and network
-- belongs to one; tokens belong to one or (NULL) are fleet-wide.
--
-- A quota is NULL for unlimited. used_* is what the project's VMs that
-- hold capacity hold now: it changes in the same statement (PostgreSQL) or
-- transaction (SQLite) as the host's allocation, so it always equals the
-- rows. The CHECKs are the quota: a reservation that would take used past
-- its quota fails whole, the host's share with it, on every replica.
--
-- above_quota_* lets a quota be set below the usage (it refuses growth,
-- stops nothing): it is the usage when the quota was set, lowered with
-- every release, never raised by a reservation. So usage above the quota
-- may only shrink until it is under the quota again.
CREATE TABLE projects (
    name                  TEXT PRIMARY KEY,
    description           TEXT NOT NULL DEFAULT '',
    -- JSON object: the labels a host must have to take the project's VMs
    host_labels           TEXT NOT NULL DEFAULT '{}',
    quota_vcpus           BIGINT NULL,
    quota_memory_mib      BIGINT NULL,
    quota_disk_mib        BIGINT NULL,
    quota_vms             BIGINT NULL,
    used_vcpus            BIGINT NOT NULL DEFAULT 0,
    used_memory_mib       BIGINT NOT NULL DEFAULT 0,
    used_disk_mib         BIGINT NOT NULL DEFAULT 0,
    used_vms              BIGINT NOT NULL DEFAULT 0,
    above_quota_vcpus     BIGINT NOT NULL DEFAULT 0,
    above_quota_memory_mib BIGINT NOT NULL DEFAULT 0,
    above_quota_disk_mib  BIGINT NOT NULL DEFAULT 0,
    above_quota_vms       BIGINT NOT NULL DEFAULT 0,
    created_at            TIMESTAMP NOT NULL,
    updated_at            TIMESTAMP NOT NULL,
    CONSTRAINT projects_vcpus_quota CHECK (quota_vcpus IS NULL OR used_vcpus <= quota_vcpus OR used_vcpus <= above_quota_vcpus),
    CONSTRAINT projects_memory_mib_quota CHECK (quota_memory_mib IS NULL OR used_memory_mib <= quota_memory_mib OR used_memory_mib <= above_quota_memory_mib),
    CONSTRAINT projects_disk_mib_quota CHECK (quota_disk_mib IS NULL OR used_disk_mib <= quota_disk_mib OR used_disk_mib <= above_quota_disk_mib),
    CONSTRAINT projects_vms_quota CHECK (quota_vms IS NULL OR used_vms <= quota_vms OR used_vms <= above_quota_vms)
);

ALTER TABLE vms ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
ALTER TABLE forks ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
ALTER TABLE networks ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
ALTER TABLE tokens ADD COLUMN project TEXT NULL;
CREATE INDEX vms_project ON vms (project);
CREATE INDEX forks_project ON forks (project);
CREATE INDEX networks_project ON networks (project);
CREATE INDEX tokens_project ON tokens (project);

-- VM names are unique within a project: one team's names neither block
-- nor reveal another's.
DROP INDEX vms_name;
CREATE UNIQUE INDEX vms_project_name ON vms (project, name);

-- Everything that exists belongs to default, with usage equal to its rows.
INSERT INTO projects (name, description, created_at, updated_at,
        used_vcpus, used_memory_mib, used_disk_mib, used_vms)
    SELECT 'default', 'Everything made without a project', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP,
        COALESCE(SUM(CASE WHEN pending_vcpus IS NOT NULL AND pending_vcpus > vcpus THEN pending_vcpus ELSE vcpus END), 0),
        COALESCE(SUM(CASE WHEN pending_memory_mib IS NOT NULL AND pending_memory_mib > memory_mib THEN pending_memory_mib ELSE memory_mib END), 0),
        COALESCE(SUM(disk_mib), 0),
        COUNT(*)
    FROM vms WHERE holds_capacity;

-- Tokens of before: a token that can act on hosts (admin) stays
-- fleet-wide; a user-only token now acts on default's objects, which is
-- everything it could act on before.
UPDATE tokens SET project = 'default' WHERE scopes NOT LIKE '%"admin"%';
