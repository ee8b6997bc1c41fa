-- The QEMU guest agent channel of a VM (guest_agent on its create), fixed
-- at create like its guest configuration; forks.guest_agent is the source
-- VM's when the fork was made, which its children inherit (their devices
-- must match the snapshot's).
ALTER TABLE vms ADD COLUMN guest_agent BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE forks ADD COLUMN guest_agent BOOLEAN NOT NULL DEFAULT FALSE;
