-- Agent identity (agents join): the ed25519 public key a host's agent
-- proved when it was registered (base64). The control plane sends the agent
-- token only to an address where this key signed a fresh challenge; a host
-- with an empty key (registered before this migration) is challenged by
-- the host monitor, and joins, before it gets the token again. One agent,
-- one host: a key is pinned to at most one host.
ALTER TABLE hosts ADD COLUMN agent_key TEXT NOT NULL DEFAULT '';
CREATE UNIQUE INDEX hosts_agent_key ON hosts (agent_key) WHERE agent_key <> '';
-- Until the host monitor has challenged them, hosts registered before this
-- migration get no calls with the agent token: they read not alive (no
-- placements) until their agent proves itself and is pinned.
UPDATE hosts SET alive = FALSE WHERE agent_key = '';
