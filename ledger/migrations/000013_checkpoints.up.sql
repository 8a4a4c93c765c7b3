-- Recovery points: the generation's last checkpoint, recorded by a
-- Heartbeat of the holder (the step it finished). All NULL when no
-- attempt of the generation recorded one. checkpoint_data is sealed like
-- the body when the row's enc_key_id is set (bound to the generation and
-- to checkpoint_attempt, the attempt that recorded it, which may not end
-- Fail ABANDONED). The archive keeps the columns of the records it moves.
--
-- Nullable columns without a default: adding them rewrites nothing. On
-- Citus, ALTER TABLE of a distributed table is propagated to its shards,
-- one command at a time: hence the DO block (a query string of several
-- commands cannot be propagated).
DO $$
BEGIN
    ALTER TABLE idempotency_records
        ADD COLUMN IF NOT EXISTS checkpoint_phase text,
        ADD COLUMN IF NOT EXISTS checkpoint_data bytea,
        ADD COLUMN IF NOT EXISTS checkpoint_at timestamptz,
        ADD COLUMN IF NOT EXISTS checkpoint_attempt integer;
    ALTER TABLE idempotency_archive
        ADD COLUMN IF NOT EXISTS checkpoint_phase text,
        ADD COLUMN IF NOT EXISTS checkpoint_data bytea,
        ADD COLUMN IF NOT EXISTS checkpoint_at timestamptz,
        ADD COLUMN IF NOT EXISTS checkpoint_attempt integer;
END;
$$;
