DROP TABLE IF EXISTS idempotency_console_sessions;
