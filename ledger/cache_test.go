package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// waitFresh replays key until the store serves it from its cache (the
// notification round trip is established and the record cached).
func waitFresh(t *testing.T, s *ledger.Store, id ledger.Identity, ev statemachine.Event) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		before := s.CacheStats().Hits
		res, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
		if err != nil || res.Outcome != statemachine.OutcomeReplay {
			t.Fatalf("replay: %+v %v", res, err)
		}
		if s.CacheStats().Hits > before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("never served from the cache: %+v", s.CacheStats())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReplayCacheForgetOnAnotherReplica caches a record on replica A,
// deletes it through replica B (and, for a second record, with plain SQL):
// one second later A no longer replays either.
func TestReplayCacheForgetOnAnotherReplica(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	a, err := ledger.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := ledger.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ledger.SkipWithoutNotifications(t, b)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	for _, key := range []string{"forgotten", "deleted"} {
		id := ledger.Identity{Tenant: "t", Scope: "s", Key: key}
		res, err := a.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
			Kind: statemachine.EventComplete, Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("x")}}}); err != nil {
			t.Fatal(err)
		}
		waitFresh(t, a, id, ev)
	}

	forgotten := ledger.Identity{Tenant: "t", Scope: "s", Key: "forgotten"}
	if _, err := b.Forget(context.Background(), &ledger.ForgetParams{ID: forgotten}); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(context.Background(), `DELETE FROM idempotency_records WHERE key = 'deleted'`); err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
	time.Sleep(time.Second) // the promise: no replay more than 1 s after Forget returns
	for _, key := range []string{"forgotten", "deleted"} {
		res, err := a.Begin(context.Background(), &ledger.BeginParams{ID: ledger.Identity{Tenant: "t", Scope: "s", Key: key}, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != statemachine.OutcomeAcquired || res.PreviousState != statemachine.StateNone {
			t.Fatalf("%s 1 s after it was deleted elsewhere: %v (previous %v)", key, res.Outcome, res.PreviousState)
		}
	}
}

// TestReplayCacheHonoursExpiry never replays a cached record at or past its
// expires_at.
func TestReplayCacheHonoursExpiry(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	clock := coordtest.NewClock()
	s := openStore(t, url, clock)
	ledger.SkipWithoutNotifications(t, s)
	id := ledger.Identity{Tenant: "t", Scope: "s", Key: "k"}
	ev := statemachine.Event{TTL: 10 * time.Second, FailureTTL: 10 * time.Second, Lease: time.Minute}
	res, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: res.Record.LeaseToken}}); err != nil {
		t.Fatal(err)
	}
	waitFresh(t, s, id, ev)
	clock.Advance(10*time.Second - time.Microsecond)
	if r, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev}); err != nil || r.Outcome != statemachine.OutcomeReplay {
		t.Fatalf("1 µs before expiry: %+v %v", r, err)
	}
	clock.Advance(time.Microsecond)
	r, err := s.Begin(context.Background(), &ledger.BeginParams{ID: id, Event: ev})
	if err != nil || r.Outcome != statemachine.OutcomeAcquired || r.PreviousState != statemachine.StateExpired {
		t.Fatalf("at expires_at: %+v %v", r, err)
	}
}
