DROP INDEX IF EXISTS idempotency_records_unknown_idx;
