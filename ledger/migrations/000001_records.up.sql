-- One row per (tenant, scope, key): the idempotency record.
-- The primary key is what decides races between concurrent Begins.
CREATE TABLE idempotency_records (
    tenant           text        NOT NULL,
    scope            text        NOT NULL,
    key              text        NOT NULL,
    state            smallint    NOT NULL CHECK (state BETWEEN 1 AND 6),
    fingerprint      bytea       NOT NULL DEFAULT '\x',
    attempt          integer     NOT NULL CHECK (attempt >= 1),
    generation       integer     NOT NULL CHECK (generation >= 1),
    lease_token      text        NOT NULL,
    attempt_id       text        NOT NULL DEFAULT '',
    acquired_from    smallint    NOT NULL DEFAULT 0,
    ended_by         smallint    NOT NULL DEFAULT 0,
    has_response     boolean     NOT NULL DEFAULT false,
    schema_version   text        NOT NULL DEFAULT '',
    content_type     text        NOT NULL DEFAULT '',
    status_code      integer     NOT NULL DEFAULT 0,
    body             bytea,
    metadata         bytea,
    failure_reason   text        NOT NULL DEFAULT '',
    ttl_us           bigint      NOT NULL,
    failure_ttl_us   bigint      NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    lease_expires_at timestamptz,
    expires_at       timestamptz,
    CONSTRAINT idempotency_records_pkey PRIMARY KEY (tenant, scope, key)
);

-- The reaper finds terminal records past expires_at and stale leases by these.
CREATE INDEX idempotency_records_expires_at_idx
    ON idempotency_records (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX idempotency_records_lease_idx
    ON idempotency_records (lease_expires_at) WHERE state = 1;

-- Every change of an existing record is announced on channel
-- idemcoord_records (delivered at commit), so waiting Begins wake without
-- polling. The payload identifies the record without carrying its key.
CREATE FUNCTION idempotency_records_notify() RETURNS trigger
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
