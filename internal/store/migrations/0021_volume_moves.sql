-- Volume moves: a detached volume moves to another host (POST
-- /v1/volumes/{id}/move). While it moves (state moving) its row holds its
-- size on two hosts' alloc_disk_mib, never on its project twice:
--
--   copy phase:    host_name is the source, move_target the host that
--                  pulls it (reserved in the transaction that set moving);
--   cleanup phase: host_name is the target (the switch), move_source the
--                  host whose copy is still to be deleted; its share goes
--                  in the transaction that clears move_source, once that
--                  host's agent confirmed the delete.
--
-- move_digest is the sha256 of the source's export, which the target's
-- pull checked: a copy on the target with that digest is the complete
-- volume, so the host monitor finishes a move a dead replica left in its
-- copy phase when the target has it, and undoes it otherwise.
ALTER TABLE volumes ADD COLUMN move_target TEXT NULL;
ALTER TABLE volumes ADD COLUMN move_source TEXT NULL;
ALTER TABLE volumes ADD COLUMN move_digest TEXT NOT NULL DEFAULT '';
CREATE INDEX volumes_move_target ON volumes (move_target);
CREATE INDEX volumes_move_source ON volumes (move_source);
