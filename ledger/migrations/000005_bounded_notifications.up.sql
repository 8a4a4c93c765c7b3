-- Notifications wake waiting Begins and evict replay caches. They are now
-- sent only for changes a waiter or a cache cares about (state, holder,
-- generation, expiry, stored response, deletion), never for a Heartbeat,
-- and never at the price of a write: PostgreSQL's notification queue is
-- shared by every listener and only advances as fast as the slowest one,
-- and a COMMIT that notifies fails once the queue is full. Above the
-- usage limit (session setting idemcoord.notify_queue_limit, default 0.5)
-- a change is not notified but counted in idemcoord_notify_drops; every
-- replica's pings carry that count, so a replica that sees it change
-- drops its replay cache and polls instead of waiting for notifications.

CREATE TABLE idemcoord_notify_drops (
    id      boolean PRIMARY KEY DEFAULT true CHECK (id),
    dropped bigint  NOT NULL DEFAULT 0
);
INSERT INTO idemcoord_notify_drops DEFAULT VALUES;

CREATE OR REPLACE FUNCTION idempotency_records_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_notification_queue_usage() >= coalesce(
            nullif(current_setting('idemcoord.notify_queue_limit', true), '')::float8, 0.5) THEN
        UPDATE idemcoord_notify_drops SET dropped = dropped + 1;
    ELSE
        PERFORM pg_notify('idemcoord_records',
            md5(OLD.tenant || chr(31) || OLD.scope || chr(31) || OLD.key));
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER idempotency_records_notify ON idempotency_records;
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
