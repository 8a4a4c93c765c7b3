-- Back to tables local to the coordinator node (on Citus; nothing on a
-- plain PostgreSQL). undistribute_table copies the rows back.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    PERFORM set_config('citus.enable_unsafe_triggers', 'on', true);
    IF EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'idempotency_archive'::regclass) THEN
        EXECUTE $sql$SELECT undistribute_table('idempotency_archive', cascade_via_foreign_keys => false)$sql$;
    END IF;
    IF EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'idempotency_records'::regclass) THEN
        EXECUTE $sql$SELECT undistribute_table('idempotency_records', cascade_via_foreign_keys => false)$sql$;
    END IF;
END;
$$;
