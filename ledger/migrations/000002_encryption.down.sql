ALTER TABLE idempotency_records DROP COLUMN enc_key_id;
