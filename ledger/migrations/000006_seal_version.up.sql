-- How a row's sensitive columns are stored. 2: written by a version that
-- seals body, metadata and failure_reason with associated data binding the
-- record's generation, attempt, ending, state and clear response columns,
-- and stores the fingerprint as a keyed hash (when enc_key_id is set; a row
-- with enc_key_id '' is in clear). 0: written before this migration (in
-- clear, or body and metadata sealed with the v1 associated data, the
-- failure reason and fingerprint raw). With encryption on, rows other than
-- (enc_key_id <> '', seal_version 2) are read only under
-- encryption.accept_legacy_rows, which converts them.
ALTER TABLE idempotency_records ADD COLUMN seal_version smallint NOT NULL DEFAULT 0;
