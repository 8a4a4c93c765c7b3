-- uncertain: an attempt of the record's generation may have done the side
-- effect (its lease lapsed, or it ended Fail UNKNOWN). It is sticky: it
-- stays true until the generation ends COMPLETED or FAILED_REPLAYABLE or an
-- operator resolves the record (see statemachine.Record.Uncertain).
ALTER TABLE idempotency_records ADD COLUMN uncertain boolean NOT NULL DEFAULT false;

-- Records already UNKNOWN are uncertain by definition. (Records that were
-- UNKNOWN and then failed RETRYABLE before this column existed cannot be
-- told apart; they keep false.)
UPDATE idempotency_records SET uncertain = true WHERE state = 6;
