DROP TRIGGER IF EXISTS idempotency_records_notify_delete ON idempotency_records;
DROP TRIGGER IF EXISTS idempotency_records_notify ON idempotency_records;
CREATE OR REPLACE FUNCTION idempotency_records_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idemcoord_records',
        md5(OLD.tenant || chr(31) || OLD.scope || chr(31) || OLD.key));
    RETURN NULL;
END;
$$;
CREATE TRIGGER idempotency_records_notify
    AFTER UPDATE OR DELETE ON idempotency_records
    FOR EACH ROW EXECUTE FUNCTION idempotency_records_notify();
DROP TABLE IF EXISTS idemcoord_notify_drops;
