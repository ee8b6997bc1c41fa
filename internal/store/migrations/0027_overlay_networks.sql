-- Overlay networks (mode overlay): one L2 segment across the hosts, carried
-- in VXLAN. vni is the network's VXLAN network identifier (NULL for every
-- other mode; the unique index is the arbiter of two creates that chose
-- the same one). mtu is the MTU of the network's bridges, VXLAN devices,
-- taps and guests (0: the mode's default).
ALTER TABLE networks ADD COLUMN vni BIGINT NULL;
ALTER TABLE networks ADD COLUMN mtu BIGINT NOT NULL DEFAULT 0;
CREATE UNIQUE INDEX networks_vni ON networks (vni) WHERE vni IS NOT NULL;

-- The host's address on the underlay (IPv4) that the VXLAN tunnels of
-- overlay networks run between; '' for a host that takes no overlay NIC.
-- Its agent proves it in the identity challenge, like the agent address.
ALTER TABLE hosts ADD COLUMN underlay_address TEXT NOT NULL DEFAULT '';
