package ledger_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestReplayCacheFreshnessGuard freezes the PostgreSQL backend of a store's
// LISTEN connection (SIGSTOP), so no notification reaches the store while
// its connection stays up, then deletes a cached record with SQL: the
// store must stop serving its cache (its pings no longer come back) and
// answer from the database, where the key is new. Without the guard the
// cache would replay the deleted record for as long as the listener is
// stuck.
func TestReplayCacheFreshnessGuard(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	s, err := ledger.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ledger.SkipWithoutNotifications(t, s)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	id := ledger.Identity{Tenant: "t", Scope: "s", Key: "cached"}
	res, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("x")}}}); err != nil {
		t.Fatal(err)
	}
	waitFresh(t, s, id, ev)

	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	// The listener's backend: the last statement it ran is its LISTEN or
	// the read of the drop count that follows it (notify.go).
	var pid int
	if err := conn.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND (query ILIKE 'listen %' OR query = 'SELECT dropped FROM idemcoord_notify_drops')`).Scan(&pid); err != nil {
		t.Fatalf("the store's LISTEN backend: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Kill(pid, syscall.SIGCONT) }() // before s.Close
	if _, err := conn.Exec(context.Background(), `DELETE FROM idempotency_records WHERE key = 'cached'`); err != nil {
		t.Fatal(err)
	}

	// The cache may still answer until its freshness lapses (900 ms); after
	// that, only the database does. A generous minute, polled.
	deadline := time.Now().Add(time.Minute)
	for {
		r, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome == statemachine.OutcomeAcquired && r.PreviousState == statemachine.StateNone {
			break
		}
		if r.Outcome != statemachine.OutcomeReplay {
			t.Fatalf("Begin of the deleted record: %v", r.Outcome)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cache kept replaying a deleted record while notifications could not arrive: %+v", s.CacheStats())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
