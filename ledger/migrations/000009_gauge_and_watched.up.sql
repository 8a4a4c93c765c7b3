-- The idempotency_records gauge counts UNKNOWN records exactly without
-- scanning the table: this partial index holds only UNKNOWN rows, so the
-- count costs in proportion to the records that need a decision. (The
-- archive's migration creates the same index for the reaper; whichever
-- runs first creates it.)
CREATE INDEX IF NOT EXISTS idempotency_records_unknown_idx
    ON idempotency_records (updated_at) WHERE state = 6;
