ALTER TABLE idempotency_records DROP COLUMN IF EXISTS uncertain;
