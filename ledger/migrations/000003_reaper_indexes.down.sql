DROP INDEX IF EXISTS idempotency_records_due_to_expire_idx;
DROP INDEX IF EXISTS idempotency_records_expired_idx;
CREATE INDEX idempotency_records_expires_at_idx
    ON idempotency_records (expires_at) WHERE expires_at IS NOT NULL;
