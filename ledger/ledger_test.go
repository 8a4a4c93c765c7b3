package ledger_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Main(m, ledger.Migrate))
}

// TestMigrateConcurrently starts migrations from several replicas at once
// on an empty database: the advisory lock makes them apply once, and every
// replica ends up with the schema.
func TestMigrateConcurrently(t *testing.T) {
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	var wg sync.WaitGroup
	errs := make([]error, 5)
	for i := range errs {
		wg.Go(func() {
			errs[i] = ledger.Migrate(context.Background(), url)
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var version int
	var dirty bool
	if err := conn.QueryRow(context.Background(), `SELECT version, dirty FROM `+ledger.MigrationsTable).Scan(&version, &dirty); err != nil {
		t.Fatal(err)
	}
	if version < 1 || dirty {
		t.Fatalf("schema version %d dirty=%v", version, dirty)
	}
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatalf("migrating an up-to-date database: %v", err)
	}
	// A URL that sizes the pool works for both migration and the store.
	sized := url + "&pool_max_conns=7"
	if err := ledger.Migrate(context.Background(), sized); err != nil {
		t.Fatalf("migrating with pool_max_conns in the URL: %v", err)
	}
	s, err := ledger.Open(context.Background(), sized)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestUnreachableDatabaseIsUnavailable checks the error a stopped database
// produces: ErrUnavailable, never anything else.
func TestUnreachableDatabaseIsUnavailable(t *testing.T) {
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	store, err := ledger.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	id := ledger.Identity{Tenant: "t", Scope: "s", Key: "k"}
	begin := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := store.Begin(ctx, &ledger.BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
		return err
	}
	if err := begin(); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := begin(); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Begin with the database down: %v, want ErrUnavailable", err)
	}
	if _, _, err := store.Lookup(context.Background(), id); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Lookup with the database down: %v", err)
	}
	if err := ledger.Migrate(context.Background(), url); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Migrate with the database down: %v", err)
	}
	if err := cluster.Start(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Lookup(context.Background(), id); err != nil {
		t.Fatalf("Lookup after the database came back: %v", err)
	}
}
