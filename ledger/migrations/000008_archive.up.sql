-- The archive: UNKNOWN records (and IN_PROGRESS ones whose lease lapsed)
-- older than their policy's unknown_retention are moved here by the
-- reaper, with all their columns, so the live table stays bounded by the
-- live keys without losing evidence. A key may be archived more than once
-- (it is new again once archived), hence archived_at in the key.
CREATE TABLE idempotency_archive (LIKE idempotency_records INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE idempotency_archive ADD COLUMN archived_at timestamptz NOT NULL;
ALTER TABLE idempotency_archive ADD CONSTRAINT idempotency_archive_pkey
    PRIMARY KEY (tenant, scope, key, archived_at);

-- The reaper finds UNKNOWN records by the time they became UNKNOWN.
CREATE INDEX idempotency_records_unknown_idx
    ON idempotency_records (updated_at) WHERE state = 6;
