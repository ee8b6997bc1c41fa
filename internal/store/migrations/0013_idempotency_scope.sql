-- Idempotency-Keys belong to the caller that sent them (the token id, or
-- "bootstrap" for the --token flag's token): one caller's key never
-- replays or blocks another's request. The primary key takes the caller,
-- so the table is made again (SQLite cannot change a primary key). Rows of
-- before keep an empty caller, which no request has: they only expire.
CREATE TABLE idempotency_keys_scoped (
    scope        TEXT NOT NULL,
    caller       TEXT NOT NULL,
    idem_key     TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status       INTEGER NOT NULL DEFAULT 0, -- 0 while in flight
    response     TEXT NOT NULL DEFAULT '',
    lease_until  BIGINT NOT NULL,            -- unix ms: in flight past this = abandoned
    expires_at   BIGINT NOT NULL,            -- unix ms
    created_at   TIMESTAMP NOT NULL,
    PRIMARY KEY (scope, caller, idem_key)
);
INSERT INTO idempotency_keys_scoped (scope, caller, idem_key, request_hash, status, response, lease_until, expires_at, created_at)
    SELECT scope, '', idem_key, request_hash, status, response, lease_until, expires_at, created_at FROM idempotency_keys;
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_scoped RENAME TO idempotency_keys;
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- A fork remembers the key of the POST that made it, so that a retry
-- resumes it: the key is unique per caller, not across callers.
ALTER TABLE forks ADD COLUMN idempotency_caller TEXT NOT NULL DEFAULT '';
DROP INDEX forks_idempotency_key;
CREATE UNIQUE INDEX forks_idempotency_key ON forks (idempotency_caller, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Fleet page sessions that signed out (POST /ui/logout). A session is a
-- signed cookie; this row is what makes a copy of it stop working on every
-- replica. Kept until the session would have expired anyway.
CREATE TABLE ui_session_revocations (
    session_id TEXT PRIMARY KEY,
    expires_at BIGINT NOT NULL -- unix ms
);
CREATE INDEX ui_session_revocations_expires_at ON ui_session_revocations (expires_at);
