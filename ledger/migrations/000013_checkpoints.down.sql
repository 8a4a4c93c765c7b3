-- See the up migration for why a DO block.
DO $$
BEGIN
    ALTER TABLE idempotency_archive
        DROP COLUMN IF EXISTS checkpoint_attempt,
        DROP COLUMN IF EXISTS checkpoint_at,
        DROP COLUMN IF EXISTS checkpoint_data,
        DROP COLUMN IF EXISTS checkpoint_phase;
    ALTER TABLE idempotency_records
        DROP COLUMN IF EXISTS checkpoint_attempt,
        DROP COLUMN IF EXISTS checkpoint_at,
        DROP COLUMN IF EXISTS checkpoint_data,
        DROP COLUMN IF EXISTS checkpoint_phase;
END;
$$;
