-- The reaper asks two different questions of expires_at: which ended
-- records are due to expire, and which EXPIRED records are due for
-- deletion. One partial index each keeps both from walking the other's rows.
DROP INDEX IF EXISTS idempotency_records_expires_at_idx;
CREATE INDEX idempotency_records_due_to_expire_idx
    ON idempotency_records (expires_at) WHERE state IN (2, 3, 4);
CREATE INDEX idempotency_records_expired_idx
    ON idempotency_records (expires_at) WHERE state = 5;
