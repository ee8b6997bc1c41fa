-- API tokens. Only the SHA-256 of a token's secret is stored: the secret
-- is 256 random bits, so the digest cannot be reversed or guessed (a slow
-- password hash buys nothing at that entropy), and a digest lookup is one
-- indexed read. Revoking a token deletes its row.

CREATE TABLE tokens (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    -- hex SHA-256 of the secret
    secret_sha256 TEXT NOT NULL,
    -- JSON list of scopes: "admin", "user"
    scopes        TEXT NOT NULL,
    expires_at    TIMESTAMP NULL,
    -- written at most about once a minute per token (see control/tokens.go)
    last_used_at  TIMESTAMP NULL,
    created_at    TIMESTAMP NOT NULL
);
CREATE UNIQUE INDEX tokens_secret_sha256 ON tokens (secret_sha256);
