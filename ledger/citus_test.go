package ledger_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// TestMigrationsDistributeRecordsOnCitus migrates a Citus database through
// its coordinator node from several replicas at once: golang-migrate's
// advisory lock holds there, the records and the archive end up
// distributed by hash of key and co-located, with the change trigger on
// their shards, and the small tables stay local to the coordinator node.
func TestMigrationsDistributeRecordsOnCitus(t *testing.T) {
	cc := pgtest.StartCitusCluster(t, pgtest.ClusterOptions{})
	ctx := t.Context()
	if err := cc.CreateDatabase(ctx, "idemcoord"); err != nil {
		t.Fatal(err)
	}
	url := cc.URL("idemcoord")
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = ledger.Migrate(ctx, url) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("migrate on the coordinator node: %v", err)
		}
	}
	if err := ledger.Migrate(ctx, url); err != nil {
		t.Fatalf("migrating an up-to-date database: %v", err)
	}

	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var version int
	var dirty bool
	if err := conn.QueryRow(ctx, `SELECT version, dirty FROM `+ledger.MigrationsTable).Scan(&version, &dirty); err != nil {
		t.Fatal(err)
	}
	if version != 13 || dirty {
		t.Errorf("schema version %d dirty=%v, want 13 clean", version, dirty)
	}

	type table struct {
		Name, Kind, Column string
		Colocation         int
	}
	rows, _ := conn.Query(ctx, `SELECT logicalrelid::text, partmethod::text,
		coalesce(column_to_column_name(logicalrelid, partkey), ''), colocationid
		FROM pg_dist_partition ORDER BY 1`)
	tables, err := pgx.CollectRows(rows, pgx.RowToStructByPos[table])
	if err != nil {
		t.Fatal(err)
	}
	if len(tables) != 2 || tables[0].Name != "idempotency_archive" || tables[1].Name != "idempotency_records" {
		t.Fatalf("Citus tables = %+v, want exactly idempotency_archive and idempotency_records", tables)
	}
	for _, tb := range tables {
		if tb.Kind != "h" || tb.Column != "key" {
			t.Errorf("%s is distributed by %s of %q, want by hash (h) of key", tb.Name, tb.Kind, tb.Column)
		}
	}
	if tables[0].Colocation != tables[1].Colocation {
		t.Errorf("archive and records are not co-located: %+v", tables)
	}

	// Every worker holds shards of the records, each with the trigger.
	var workers, shards, withTrigger int
	if err := conn.QueryRow(ctx, `SELECT count(DISTINCT nodeport), count(*), count(*) FILTER (WHERE result = '2')
		FROM run_command_on_shards('idempotency_records',
			$$SELECT count(*) FROM pg_trigger WHERE tgrelid = '%s'::regclass AND NOT tgisinternal$$)
		JOIN pg_dist_shard_placement USING (shardid)`).Scan(&workers, &shards, &withTrigger); err != nil {
		t.Fatal(err)
	}
	if workers != len(cc.Workers) || shards == 0 || withTrigger != shards {
		t.Errorf("records shards: %d on %d workers, %d with the update and delete triggers; want shards on all %d workers, every one with both",
			shards, workers, withTrigger, len(cc.Workers))
	}

	// The small tables are plain tables of the coordinator node, and work.
	if _, err := conn.Exec(ctx, `UPDATE idemcoord_notify_drops SET dropped = dropped`); err != nil {
		t.Errorf("idemcoord_notify_drops: %v", err)
	}
	if _, err := conn.Exec(ctx, `SELECT count(*) FROM idempotency_console_sessions`); err != nil {
		t.Errorf("idempotency_console_sessions: %v", err)
	}
}
