DROP INDEX IF EXISTS idempotency_records_unknown_idx;
DROP TABLE IF EXISTS idempotency_archive;
