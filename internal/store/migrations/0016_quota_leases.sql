-- Quota leases (PostgreSQL): each reservation committer of a control
-- replica holds a share of its projects' quotas, granted from the
-- project's row (its used_* count the lease as used) and spent by its
-- reservation batches without touching that row, so that a project's
-- batches no longer commit one at a time. A project's reported usage is
-- used_* minus its leases. A lease row only ever shrinks by spending (the
-- CHECK refuses spending more than it holds) or by a reclaim that gives
-- it back to the project (on a refusal for the quota, on a change of the
-- project's quotas, on the holder's close).
CREATE TABLE quota_leases (
    project    TEXT NOT NULL,
    holder     TEXT NOT NULL,
    vcpus      BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    disk_mib   BIGINT NOT NULL,
    vms        BIGINT NOT NULL,
    renewed_at TIMESTAMP NOT NULL,
    PRIMARY KEY (project, holder),
    CONSTRAINT quota_leases_spent CHECK (vcpus >= 0 AND memory_mib >= 0 AND disk_mib >= 0 AND vms >= 0)
);
