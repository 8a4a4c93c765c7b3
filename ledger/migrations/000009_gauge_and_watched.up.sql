-- The idempotency_records gauge counts UNKNOWN records exactly without
-- scanning the table: this partial index holds only UNKNOWN rows, so the
-- count costs in proportion to the records that need a decision. (The
-- archive's migration creates the same index for the reaper; whichever
-- runs first creates it.)
CREATE INDEX IF NOT EXISTS idempotency_records_unknown_idx
    ON idempotency_records (updated_at) WHERE state = 6;

-- Notifications only where a waiter or a replay cache can care. A commit
-- that notified holds PostgreSQL's database-wide notification lock until
-- it has flushed its WAL, so notifying commits cannot share a flush; most
-- Completes end records nobody waits for. A Begin that is about to wait
-- for a held record sets watched first (ledger.Store.Watch), so the change
-- that ends the attempt is announced; changes of COMPLETED and
-- FAILED_REPLAYABLE records (which replay caches hold) always are. Other
-- records (IN_PROGRESS nobody waits for, FAILED_RETRYABLE, EXPIRED,
-- UNKNOWN) change silently: no Begin waits for them and no cache holds
-- them. The column conditions are those of migration 000005 (changes that
-- matter; never a Heartbeat).
ALTER TABLE idempotency_records ADD COLUMN watched boolean NOT NULL DEFAULT false;

DROP TRIGGER IF EXISTS idempotency_records_notify ON idempotency_records;
DROP TRIGGER IF EXISTS idempotency_records_notify_delete ON idempotency_records;
CREATE TRIGGER idempotency_records_notify
    AFTER UPDATE ON idempotency_records
    FOR EACH ROW
    WHEN ((OLD.state IN (2, 4) OR OLD.watched)
        AND (OLD.state IS DISTINCT FROM NEW.state
        OR OLD.lease_token IS DISTINCT FROM NEW.lease_token
        OR OLD.generation IS DISTINCT FROM NEW.generation
        OR OLD.expires_at IS DISTINCT FROM NEW.expires_at
        OR OLD.has_response IS DISTINCT FROM NEW.has_response))
    EXECUTE FUNCTION idempotency_records_notify();
CREATE TRIGGER idempotency_records_notify_delete
    AFTER DELETE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.state IN (2, 4) OR OLD.watched)
    EXECUTE FUNCTION idempotency_records_notify();
