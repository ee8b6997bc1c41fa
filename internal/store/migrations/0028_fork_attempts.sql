-- Bounded retries of failed fork passes. attempts counts the passes that
-- failed in a row (a ready pass sets it back to 0); retry_at is when the
-- host monitor runs the next one (NULL: none is due). Phase "retrying" is
-- a failed pass that will be retried; "failed" is terminal: only a request
-- (a retried POST, a PATCH) or a DELETE touches the fork again. Forks that
-- were "failed" before this migration were retried at every start-up; they
-- are terminal now.
ALTER TABLE forks ADD COLUMN attempts BIGINT NOT NULL DEFAULT 0;
ALTER TABLE forks ADD COLUMN retry_at TIMESTAMP NULL;
