package ledger_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestBatchedWritesUnderConcurrency drives the coalesced Begin and Complete
// paths with many callers at once, including callers racing on the same
// key, and checks every answer and every stored record, with the default
// number of batch workers and with one (the largest batches).
func TestBatchedWritesUnderConcurrency(t *testing.T) {
	t.Parallel()
	t.Run("default workers", func(t *testing.T) {
		t.Parallel()
		batchedWritesUnderConcurrency(t)
	})
	t.Run("one worker", func(t *testing.T) {
		t.Parallel()
		batchedWritesUnderConcurrency(t, ledger.WithBatchWorkers(1))
	})
}

func batchedWritesUnderConcurrency(t *testing.T, opts ...ledger.Option) {
	url := pgtest.NewDatabase(t)
	s, err := ledger.Open(context.Background(), url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	id := func(k string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: k} }

	// 64 callers, each with its own keys: every pair completes.
	var wg sync.WaitGroup
	for w := range 64 {
		wg.Go(func() {
			for i := range 10 {
				key := fmt.Sprintf("w%d-%d", w, i)
				res, err := s.Begin(ctx, &ledger.BeginParams{ID: id(key), Event: ev})
				if err != nil || res.Outcome != statemachine.OutcomeAcquired {
					t.Errorf("Begin %s: %v %v", key, res, err)
					return
				}
				body := []byte("body of " + key)
				done, err := s.Finish(ctx, &ledger.FinishParams{ID: id(key), Event: statemachine.Event{
					Kind: statemachine.EventComplete, Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: body}}})
				if err != nil || done.Record.State != statemachine.StateCompleted || !bytes.Equal(done.Record.Response.Body, body) {
					t.Errorf("Complete %s: %+v %v", key, done, err)
					return
				}
			}
		})
	}
	wg.Wait()
	for w := range 64 {
		for i := range 10 {
			key := fmt.Sprintf("w%d-%d", w, i)
			rec, _, err := s.Lookup(ctx, id(key))
			if err != nil || rec.State != statemachine.StateCompleted || string(rec.Response.Body) != "body of "+key {
				t.Fatalf("%s: %+v %v", key, rec, err)
			}
		}
	}

	// 32 Completes of one record at once: those with the winning content
	// succeed, the others are ALREADY_FINISHED, and one content is stored.
	res, err := s.Begin(ctx, &ledger.BeginParams{ID: id("contended"), Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	results := make([]error, 32)
	for i := range results {
		wg.Go(func() {
			body := []byte{byte(i % 2)}
			_, results[i] = s.Finish(ctx, &ledger.FinishParams{ID: id("contended"), Event: statemachine.Event{
				Kind: statemachine.EventComplete, Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: body}}})
		})
	}
	wg.Wait()
	rec, _, err := s.Lookup(ctx, id("contended"))
	if err != nil || rec.State != statemachine.StateCompleted {
		t.Fatalf("contended: %+v %v", rec, err)
	}
	winner := int(rec.Response.Body[0])
	for i, err := range results {
		switch {
		case i%2 == winner && err != nil:
			t.Errorf("Complete %d with the stored content: %v", i, err)
		case i%2 != winner && !errors.Is(err, statemachine.ErrAlreadyFinished):
			t.Errorf("Complete %d with other content: %v, want ErrAlreadyFinished", i, err)
		}
	}

	// 32 Begins of one new key at once, half with the same attempt_id:
	// exactly one acquisition (repeated for that attempt_id), the rest in
	// progress.
	tokens := make([]string, 32)
	outcomes := make([]statemachine.Outcome, 32)
	for i := range tokens {
		wg.Go(func() {
			e := ev
			if i%2 == 0 {
				e.AttemptID = "same-attempt"
			}
			r, err := s.Begin(ctx, &ledger.BeginParams{ID: id("new-contended"), Event: e})
			if err != nil {
				t.Error(err)
				return
			}
			outcomes[i], tokens[i] = r.Outcome, r.Record.LeaseToken
		})
	}
	wg.Wait()
	acquiredTokens := map[string]bool{}
	for i, o := range outcomes {
		if o == statemachine.OutcomeAcquired {
			acquiredTokens[tokens[i]] = true
		}
	}
	if len(acquiredTokens) != 1 {
		t.Fatalf("%d different tokens acquired one key: %v", len(acquiredTokens), outcomes)
	}
}
