package ledger_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestLockedPathHasOneWinner races many Begins to take over the same
// FAILED_RETRYABLE record, on many keys: the row lock of the locked path
// (SELECT … FOR UPDATE) lets exactly one of them acquire each key, the
// others see it IN_PROGRESS. Without the lock, two transactions read the
// same FAILED_RETRYABLE row and both write an acquisition: two valid
// tokens for one key.
func TestLockedPathHasOneWinner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, err := ledger.Open(ctx, pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	begin := func(key, aid string) (*ledger.Result, error) {
		return s.Begin(ctx, &ledger.BeginParams{ID: ledger.Identity{Tenant: "default", Scope: "lock", Key: key},
			Event: statemachine.Event{AttemptID: aid, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	}
	const keys, racers = 30, 8
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		first, err := begin(key, "first")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Finish(ctx, &ledger.FinishParams{ID: ledger.Identity{Tenant: "default", Scope: "lock", Key: key},
			Event: statemachine.Event{Kind: statemachine.EventFail, Token: first.Record.LeaseToken, FailureKind: statemachine.FailureRetryable}}); err != nil {
			t.Fatal(err)
		}
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			winners []string
		)
		start := make(chan struct{})
		for r := range racers {
			wg.Go(func() {
				<-start
				res, err := begin(key, fmt.Sprintf("racer%d", r))
				if err != nil {
					t.Errorf("%s: racer %d: %v", key, r, err)
					return
				}
				if res.Outcome == statemachine.OutcomeAcquired {
					mu.Lock()
					winners = append(winners, res.Record.LeaseToken)
					mu.Unlock()
				}
			})
		}
		close(start)
		wg.Wait()
		if len(winners) != 1 {
			t.Fatalf("%s: %d racers acquired the FAILED_RETRYABLE record (tokens %q), want exactly 1", key, len(winners), winners)
		}
	}
}
