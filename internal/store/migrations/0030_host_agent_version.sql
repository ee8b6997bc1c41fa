-- The kvmd release and API level a host's agent reports (GET /v1/info), and
-- why the control plane refuses the agent when its level is outside the
-- skew contract (internal/version): agent_refused is '' for an agent in
-- the contract. Expand only: a replica of the release before ignores them.
ALTER TABLE hosts ADD COLUMN agent_release TEXT NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN agent_api_level BIGINT NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN agent_refused TEXT NOT NULL DEFAULT '';
