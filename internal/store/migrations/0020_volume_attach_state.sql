-- Hot attach and detach of volumes (POST and DELETE /v1/vms/{id}/volumes):
-- an attachment row now says how far its step got, so that a control
-- replica killed between the database and the agent leaves a row the
-- host monitor settles against the agent's view of the VM.
--
-- state: attached (the agent has it; every row before this migration),
-- attaching (the volume is claimed for the VM, rw_vm or readers counted,
-- and the agent may or may not have it yet: finished when the agent lists
-- it on the VM, undone otherwise), detaching (the agent is asked to
-- detach it; the row and its claim go once the agent confirmed).
-- owner_replica is the replica that runs the step; updated_at when the
-- step began.
ALTER TABLE volume_attachments ADD COLUMN state TEXT NOT NULL DEFAULT 'attached';
ALTER TABLE volume_attachments ADD COLUMN owner_replica TEXT NULL;
ALTER TABLE volume_attachments ADD COLUMN updated_at TIMESTAMP NULL;
CREATE INDEX volume_attachments_state ON volume_attachments (state);
