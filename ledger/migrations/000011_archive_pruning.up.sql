-- The reaper deletes archived records older than the archive retention,
-- oldest first, in batches: this index finds them without reading the
-- whole archive.
CREATE INDEX IF NOT EXISTS idempotency_archive_archived_at_idx
    ON idempotency_archive (archived_at);
