DROP INDEX IF EXISTS idempotency_archive_archived_at_idx;
