-- Networks and IPAM. A network is named; its mode decides who makes the
-- addresses: nat (and bridge with a cidr) take them from the control
-- plane's IPAM below, user mode needs none (each VM has its own slirp).

CREATE TABLE networks (
    name        TEXT PRIMARY KEY,
    mode        TEXT NOT NULL,
    cidr        TEXT NOT NULL DEFAULT '',
    gateway     TEXT NOT NULL DEFAULT '',
    dhcp        BOOLEAN NOT NULL DEFAULT FALSE,
    bridge      TEXT NOT NULL DEFAULT '',
    -- hosts the network is limited to (JSON list; [] = every host)
    hosts       TEXT NOT NULL DEFAULT '[]',
    -- the IPAM range as integers: first and last assignable host address
    -- (network, broadcast excluded; the gateway is skipped inside it)
    range_first BIGINT NOT NULL DEFAULT 0,
    range_last  BIGINT NOT NULL DEFAULT 0,
    gateway_num BIGINT NOT NULL DEFAULT 0,
    created_at  TIMESTAMP NOT NULL,
    updated_at  TIMESTAMP NOT NULL
);

-- The network every VM without a NIC block is attached to.
INSERT INTO networks (name, mode, created_at, updated_at) VALUES ('default', 'user', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP);

-- The NICs of the VMs that hold capacity: one row per NIC, written in the
-- same statement or transaction as the VM's reservation and deleted with
-- its release. The unique indexes are the arbiters: no address is handed
-- out twice on a network (address is NULL where IPAM does not assign one,
-- and NULLs never collide) and no MAC is used by two live VMs. network has
-- no foreign key on purpose: on PostgreSQL every reservation would take a
-- KEY SHARE lock on the same networks row ("default" for most VMs), and
-- concurrent share locks on one row cost a MultiXact each; a network's
-- delete checks vm_nics instead.
CREATE TABLE vm_nics (
    vm_id       TEXT NOT NULL REFERENCES vms (id) ON DELETE CASCADE,
    nic_index   INTEGER NOT NULL,
    network     TEXT NOT NULL,
    mac_address TEXT NOT NULL,
    address     BIGINT NULL,
    PRIMARY KEY (vm_id, nic_index)
);
CREATE UNIQUE INDEX vm_nics_mac ON vm_nics (mac_address);
CREATE UNIQUE INDEX vm_nics_address ON vm_nics (network, address);

-- What a VM's NICs are (JSON list, as the API shows them): kept after a
-- release, so a missing VM still shows what it had.
ALTER TABLE vms ADD COLUMN nics TEXT NOT NULL DEFAULT '[]';
-- The networks (and forwarded guest ports) of a fork's source: each child
-- gets NICs of its own on them.
ALTER TABLE forks ADD COLUMN nics TEXT NOT NULL DEFAULT '[]';
