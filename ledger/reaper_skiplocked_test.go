package ledger_test

import (
	"context"
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
	tag, err := tx.Exec(context.Background(), `SELECT 1 FROM idempotency_records WHERE key = ANY(
		SELECT 'k' || i FROM generate_series(1, $1) AS i) FOR UPDATE`, locked)
	if err != nil || tag.RowsAffected() != locked {
		t.Fatalf("locking %d rows: %v %v", locked, tag, err)
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
