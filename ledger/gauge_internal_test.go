package ledger

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestStateCountsWithoutScanning checks the gauge's reading on a table it
// treats as large: IN_PROGRESS and UNKNOWN (with a lapsed lease counted as
// UNKNOWN) exact, the other states from the planner's statistics, and none
// of those estimated before the table has statistics.
func TestStateCountsWithoutScanning(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	s, err := Open(ctx, url, WithClock(func() time.Time { return now }), WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.dialect == citus {
		t.Skip("on Citus the gauge has no estimate from the planner's statistics (TestCitusReaperAndGauge)")
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// 3 held, 2 of them past their lease; 4 UNKNOWN; 1000 COMPLETED; 500 EXPIRED.
	if _, err := conn.Exec(ctx, `INSERT INTO idempotency_records
		(tenant, scope, key, state, attempt, generation, lease_token, ttl_us, failure_ttl_us,
		 created_at, updated_at, lease_expires_at, expires_at)
		SELECT 't', 's', 'k' || i,
			CASE WHEN i <= 3 THEN 1 WHEN i <= 7 THEN 6 WHEN i <= 1007 THEN 2 ELSE 5 END,
			1, 1, 'tok', 1, 1, $1::timestamptz, $1::timestamptz,
			CASE WHEN i = 1 THEN $1::timestamptz + interval '1 minute' WHEN i <= 3 THEN $1::timestamptz - interval '1 minute' END,
			CASE WHEN i > 7 THEN $1::timestamptz + interval '1 day' END
		FROM generate_series(1, 1507) AS i`, now); err != nil {
		t.Fatal(err)
	}

	exact, err := s.StateCounts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[statemachine.State]int64{1: 1, 2: 1000, 3: 0, 4: 0, 5: 500, 6: 6}
	if exact.Estimated || !equalCounts(exact.Counts, want) {
		t.Fatalf("small table: %+v, want exact %v", exact, want)
	}

	s.exactCountBytes = 0 // treat the table as large
	early, err := s.StateCounts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !early.Estimated || !equalCounts(early.Counts, map[statemachine.State]int64{1: 1, 6: 6}) {
		t.Fatalf("before ANALYZE: %+v, want only the exact in_progress 1 and unknown 6", early)
	}
	if _, err := conn.Exec(ctx, `ANALYZE idempotency_records`); err != nil {
		t.Fatal(err)
	}
	est, err := s.StateCounts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// ANALYZE reads all 1507 rows of so small a table: its estimates are exact.
	if !est.Estimated || !equalCounts(est.Counts, want) {
		t.Fatalf("after ANALYZE: %+v, want %v", est, want)
	}

	// The estimated path reads no row of the table: its plan has no
	// sequential scan of idempotency_records.
	q := s.sql.stateCounts(&now)
	rows, err := conn.Query(ctx, "EXPLAIN "+q.sql, q.args...)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range plan {
		if containsSeqScan(line) {
			t.Fatalf("the gauge's statement scans the table:\n%v", plan)
		}
	}
}

func containsSeqScan(line string) bool {
	const s = "Seq Scan on idempotency_records"
	for i := 0; i+len(s) <= len(line); i++ {
		if line[i:i+len(s)] == s {
			return true
		}
	}
	return false
}

func equalCounts(got, want map[statemachine.State]int64) bool {
	if len(got) != len(want) {
		return false
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			return false
		}
	}
	return true
}
