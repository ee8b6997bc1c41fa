-- Registered images (bring your own): where the hosts fetch each one and
-- the digest they check. Per-host state lives on the agents (their image
-- cache), not here.

CREATE TABLE images (
    name         TEXT PRIMARY KEY,
    source_url   TEXT NOT NULL,
    sha256       TEXT NOT NULL,
    format       TEXT NOT NULL,
    min_disk_mib BIGINT NOT NULL DEFAULT 0,
    prefetch     BOOLEAN NOT NULL DEFAULT FALSE,
    created_at   TIMESTAMP NOT NULL,
    updated_at   TIMESTAMP NOT NULL
);
CREATE INDEX images_sha256 ON images (sha256);
CREATE INDEX vms_image ON vms (image);
