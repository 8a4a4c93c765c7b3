DROP TABLE IF EXISTS idempotency_records;
DROP FUNCTION IF EXISTS idempotency_records_notify();
