-- Guest configuration (cloud-init NoCloud seed) of a VM: user data, SSH
-- keys, extra meta-data, network-config and the effective hostname, as JSON;
-- NULL for a VM without any. It is kept so that a fork's children (and a
-- retried create) get the same configuration; the user data is held here in
-- the clear, so database backups need the same protection as the secrets in
-- it. forks.guest is the source VM's configuration when the fork was made.
ALTER TABLE vms ADD COLUMN guest TEXT NULL;
ALTER TABLE forks ADD COLUMN guest TEXT NULL;
