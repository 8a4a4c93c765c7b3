DROP INDEX IF EXISTS idempotency_records_unknown_idx;
DROP TRIGGER IF EXISTS idempotency_records_notify ON idempotency_records;
DROP TRIGGER IF EXISTS idempotency_records_notify_delete ON idempotency_records;
CREATE TRIGGER idempotency_records_notify
    AFTER UPDATE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
        OR OLD.lease_token IS DISTINCT FROM NEW.lease_token
        OR OLD.generation IS DISTINCT FROM NEW.generation
        OR OLD.expires_at IS DISTINCT FROM NEW.expires_at
        OR OLD.has_response IS DISTINCT FROM NEW.has_response)
    EXECUTE FUNCTION idempotency_records_notify();
CREATE TRIGGER idempotency_records_notify_delete
    AFTER DELETE ON idempotency_records
    FOR EACH ROW EXECUTE FUNCTION idempotency_records_notify();
ALTER TABLE idempotency_records DROP COLUMN watched;
