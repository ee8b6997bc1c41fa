-- UEFI guests. images.firmware is what a registered image boots with:
-- bios (SeaBIOS, every image registered before) or uefi (OVMF).
-- vms.secure_boot says a VM boots with Secure Boot on (uefi only);
-- forks.secure_boot is the source's, which its children keep.
ALTER TABLE images ADD COLUMN firmware TEXT NOT NULL DEFAULT 'bios';
ALTER TABLE vms ADD COLUMN secure_boot BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE forks ADD COLUMN secure_boot BOOLEAN NOT NULL DEFAULT FALSE;
