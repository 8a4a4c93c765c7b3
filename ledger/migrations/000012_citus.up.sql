-- On Citus (a database with the citus extension, migrated through the
-- coordinator node, with the workers registered), the records and the
-- archive are spread over the workers by hash of key; on a plain
-- PostgreSQL this migration does nothing.
--
-- idempotency_records and idempotency_archive: distributed by key, and
-- co-located, so a record and its archived generations live in shards on
-- the same worker (the reaper moves rows from one to the other in one
-- statement). Their primary keys (tenant, scope, key[, archived_at])
-- include key, as Citus requires of every unique constraint.
--
-- The change trigger (idempotency_records_notify) goes with the records:
-- Citus refuses to distribute a table with triggers unless
-- citus.enable_unsafe_triggers is on, and with it on it creates the
-- trigger on every shard. A change therefore notifies on the worker that
-- holds the record, not on the coordinator node (a later trigger change on
-- these tables needs the setting too). When that worker's notification
-- queue is past the limit, the trigger's fallback counts into
-- idemcoord_notify_drops, which exists on the coordinator node only.
--
-- Small tables stay local to the coordinator node, as plain tables:
--   idemcoord_notify_drops: one row, read by the listener's pings with
--     pg_notify in the same statement, which must run on the coordinator
--     node where the replicas LISTEN; as a reference table it would be
--     replicated to the workers, and a statement reading it could run on
--     one of them.
--   idempotency_console_sessions: written on every console request and
--     read by its primary key, never joined with records; as a reference
--     table each write would be a two-phase commit on every node, and one
--     worker down would stop the console.
--   idemcoord_schema_migrations (the migration library's): read and
--     written only by the migration, under its advisory lock on the
--     coordinator node.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    PERFORM set_config('citus.enable_unsafe_triggers', 'on', true);
    EXECUTE $sql$SELECT create_distributed_table('idempotency_records', 'key')$sql$;
    EXECUTE $sql$SELECT create_distributed_table('idempotency_archive', 'key',
        colocate_with => 'idempotency_records')$sql$;
    -- Rows already there (a database that got the extension after its
    -- earlier migrations) were copied into the shards; free their local
    -- copies, which no query sees any more.
    EXECUTE $sql$SELECT truncate_local_data_after_distributing_table('idempotency_records')$sql$;
    EXECUTE $sql$SELECT truncate_local_data_after_distributing_table('idempotency_archive')$sql$;
END;
$$;
