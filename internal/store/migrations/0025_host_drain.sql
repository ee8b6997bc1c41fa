-- Host drain: a draining host takes no new VM (reservations check
-- drain_state = '') and its VMs are migrated off it, a few at a time.
-- drain_state: '' (in service), draining (the pass runs), drained (no VM
-- left), incomplete (the pass ended with VMs it could not move: see
-- drain_failed). Undrain sets it back to ''. drain_owner is the replica
-- that runs the pass; once its lease lapses the host monitor of another
-- replica (or of the restarted one) resumes it.
ALTER TABLE hosts ADD COLUMN drain_state TEXT NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN drain_total BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN drain_moved BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN drain_failed TEXT NOT NULL DEFAULT '[]';
ALTER TABLE hosts ADD COLUMN drain_owner TEXT NULL;
ALTER TABLE hosts ADD COLUMN drain_started_at TIMESTAMP NULL;
