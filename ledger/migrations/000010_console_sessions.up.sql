-- Operator console sessions, shared by every replica. A signed-in browser
-- holds a random session id in a cookie; this table holds only the id's
-- SHA-256, so reading the table does not let anyone act as a session.
-- credential is opaque to the database: the console seals what it needs
-- to act for the session under a key derived from the session id, which
-- only the browser holds. token_sha256 is the SHA-256 of the bearer token
-- the operator signed in with (as the config lists it), so a reload that
-- removes the token revokes its sessions.
--
-- A session is live while now < expires_at, which every use moves to
-- least(now + idle_timeout, absolute_expires_at): idle expiry and
-- absolute expiry in one indexed column.
CREATE TABLE idempotency_console_sessions (
    id_sha256           bytea PRIMARY KEY CHECK (length(id_sha256) = 32),
    tenant              text NOT NULL,
    token_sha256        bytea NOT NULL CHECK (length(token_sha256) = 32),
    credential          bytea NOT NULL,
    created_at          timestamptz NOT NULL,
    last_seen_at        timestamptz NOT NULL,
    idle_timeout        interval NOT NULL,
    absolute_expires_at timestamptz NOT NULL,
    expires_at          timestamptz NOT NULL
);

CREATE INDEX idempotency_console_sessions_expires_idx ON idempotency_console_sessions (expires_at);
CREATE INDEX idempotency_console_sessions_token_idx ON idempotency_console_sessions (token_sha256);
