ALTER TABLE idempotency_records DROP COLUMN seal_version;
