package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// TestReaperSkipsLockedRows holds row locks on part of an expired backlog,
// as another replica's reaper (or a caller) would: a reaper pass expires
// every other record without waiting for the locked ones, and a pass after
// the locks are released expires exactly the rest (none twice).
func TestReaperSkipsLockedRows(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	clock := coordtest.NewClock()
	const n, locked = 300, 40
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	seedCompleted(t, url, clock.Now(), n)
	clock.Advance(time.Second)
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	// One key at a time: on Citus, a row lock names its key.
	for i := 1; i <= locked; i++ {
		tag, err := tx.Exec(context.Background(), `SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE`, fmt.Sprint("k", i))
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("locking row k%d: %v %v", i, tag, err)
		}
	}

	s := openStore(t, url, clock)
	reapAll := func() int64 {
		t.Helper()
		// A reaper that waited for the locks would run into this generous
		// deadline instead of returning.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var total int64
		for {
			r, err := s.Reap(ctx, &ledger.ReapParams{BatchSize: 50, MaxBatches: 5, Retention: time.Hour})
			if err != nil {
				t.Fatalf("reap with %d rows locked elsewhere: %v", locked, err)
			}
			total += int64(r.Expired)
			if r.Expired == 0 {
				return total
			}
		}
	}
	if got := reapAll(); got != n-locked {
		t.Fatalf("with %d rows locked, the reaper expired %d, want %d", locked, got, n-locked)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := reapAll(); got != locked {
		t.Fatalf("after the locks were released, the reaper expired %d, want the %d it skipped", got, locked)
	}
}

// TestArchivePruningReplicas: replicas pruning the archive at the same time
// delete every old archived record exactly once between them, and skip the
// rows another transaction holds instead of waiting for them.
func TestArchivePruningReplicas(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	clock := coordtest.NewClock()
	const n, locked = 600, 40
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	// n UNKNOWN records, archived by a reaper pass an hour later.
	if _, err := conn.Exec(context.Background(), `INSERT INTO idempotency_records
		(tenant, scope, key, state, attempt, generation, lease_token, has_response, ttl_us, failure_ttl_us,
		 created_at, updated_at, uncertain)
		SELECT 't', 's', 'k' || i, 6, 1, 1, 'tok', false, 1, 1, $1, $1, true
		FROM generate_series(1, $2) AS i`, clock.Now(), n); err != nil {
		t.Fatal(err)
	}
	clock.Advance(2 * time.Hour)
	if r, err := openStore(t, url, clock).Reap(context.Background(), &ledger.ReapParams{BatchSize: n,
		UnknownRetention: time.Hour}); err != nil || r.Archived != n {
		t.Fatalf("archiving: %+v %v", r, err)
	}
	clock.Advance(48 * time.Hour)
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	for i := 1; i <= locked; i++ {
		tag, err := tx.Exec(context.Background(), `SELECT 1 FROM idempotency_archive WHERE key = $1 FOR UPDATE`, fmt.Sprint("k", i))
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("locking archived row k%d: %v %v", i, tag, err)
		}
	}

	prune := func(s *ledger.Store, total *int) func() error {
		return func() error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for {
				r, err := s.Reap(ctx, &ledger.ReapParams{BatchSize: 20, MaxBatches: 3, ArchiveRetention: 24 * time.Hour})
				if err != nil {
					return err
				}
				*total += r.ArchivePruned
				if r.ArchivePruned == 0 {
					return nil
				}
			}
		}
	}
	var a, b int
	errs := make(chan error, 2)
	for _, f := range []func() error{prune(openStore(t, url, clock), &a), prune(openStore(t, url, clock), &b)} {
		go func() { errs <- f() }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("pruning with %d rows locked elsewhere: %v", locked, err)
		}
	}
	if a+b != n-locked {
		t.Fatalf("two replicas pruned %d and %d, want %d between them", a, b, n-locked)
	}
	if err := tx.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
	var rest int
	if err := prune(openStore(t, url, clock), &rest)(); err != nil || rest != locked {
		t.Fatalf("after the locks were released: pruned %d (%v), want %d", rest, err, locked)
	}
}
