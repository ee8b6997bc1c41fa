-- A project's generation grows by one on every change of the row's
-- settings (description, host labels, quotas). A control replica keeps
-- the projects it places VMs in and names the generation it read in the
-- reservation: a project changed or deleted since then places nothing, and
-- the replica reads it again, so a cached host label selector is never
-- applied after it changed.
ALTER TABLE projects ADD COLUMN generation BIGINT NOT NULL DEFAULT 1;
