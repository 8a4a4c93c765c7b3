-- The id of the key that encrypted body and metadata ('' = stored in clear).
ALTER TABLE idempotency_records ADD COLUMN enc_key_id text NOT NULL DEFAULT '';
