package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// deadlocks reads the deadlocks PostgreSQL counted in the database at url.
// The statistics arrive late, so it can only under-count: it backs up the
// test's own count of UNAVAILABLE answers, never replaces it.
func deadlocks(t *testing.T, url string) int64 {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int64
	if err := conn.QueryRow(context.Background(),
		`SELECT coalesce(deadlocks, 0) FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestContendedFreshKeysNeverDeadlock: 96
// callers Begin 24 shared fresh keys in random order through two stores
// (two coordinators) on one database, for many rounds; then every holder
// Completes through both stores at once, in random order. The batches take
// their row locks in one global order, so nothing deadlocks: no caller is
// answered UNAVAILABLE, and every key ends with exactly one holder.
func TestContendedFreshKeysNeverDeadlock(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	var stores [2]*ledger.Store
	for i := range stores {
		s, err := ledger.Open(ctx, url, ledger.WithReplayCache(0))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close() //nolint:gocritic // every store stays open until the test ends
		stores[i] = s
	}
	before := deadlocks(t, url)
	const (
		callers = 96
		keys    = 24
		rounds  = 40
	)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	var unavailable, other int
	var mu sync.Mutex
	fail := func(what string, err error) {
		mu.Lock()
		defer mu.Unlock()
		if errors.Is(err, ledger.ErrUnavailable) {
			unavailable++
		} else {
			other++
		}
		if unavailable+other <= 5 {
			t.Errorf("%s: %v", what, err)
		}
	}
	for round := range rounds {
		ids := make([]ledger.Identity, keys)
		for k := range ids {
			// Several tenants, so one batch spans tenants as well.
			ids[k] = ledger.Identity{Tenant: fmt.Sprintf("tenant-%d", k%3), Scope: "race", Key: fmt.Sprintf("r%d-k%d", round, k)}
		}
		// Each caller Begins every key of its own random order of the
		// round's keys, four callers per key at each step.
		tokens := make([][]string, keys) // per key, the tokens acquired
		start := make(chan struct{})
		var wg sync.WaitGroup
		for c := range callers {
			wg.Go(func() {
				// A random order in which the caller's own key c%keys
				// comes among the first four: every key is begun.
				order := rand.Perm(keys)
				for i, k := range order {
					if k == c%keys {
						j := rand.IntN(4)
						order[i], order[j] = order[j], order[i]
					}
				}
				s := stores[c%2]
				<-start
				for _, k := range order[:4] {
					res, err := s.Begin(ctx, &ledger.BeginParams{ID: ids[k], Event: ev})
					if err != nil {
						fail(fmt.Sprintf("round %d Begin %s", round, ids[k].Key), err)
						continue
					}
					if res.Outcome == statemachine.OutcomeAcquired {
						mu.Lock()
						tokens[k] = append(tokens[k], res.Record.LeaseToken)
						mu.Unlock()
					}
				}
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			break
		}
		// Every holder Completes through both stores at once, the keys in
		// a random order per store: two batches of the same rows.
		start = make(chan struct{})
		for k, toks := range tokens {
			if len(toks) != 1 {
				t.Fatalf("round %d: key %s acquired %d times: %v", round, ids[k].Key, len(toks), toks)
			}
		}
		for c := range 2 * keys {
			wg.Go(func() {
				k := c % keys
				<-start
				_, err := stores[c/keys].Finish(ctx, &ledger.FinishParams{ID: ids[k], Event: statemachine.Event{
					Kind: statemachine.EventComplete, Token: tokens[k][0], Response: &statemachine.Response{Body: []byte("done")}}})
				if err != nil {
					fail(fmt.Sprintf("round %d Complete %s", round, ids[k].Key), err)
				}
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			break
		}
		for _, id := range ids {
			rec, _, err := stores[0].Lookup(ctx, id)
			if err != nil || rec.State != statemachine.StateCompleted {
				t.Fatalf("round %d: %s after Complete: %+v %v", round, id.Key, rec, err)
			}
		}
	}
	if unavailable+other > 0 {
		t.Fatalf("%d callers answered UNAVAILABLE, %d other errors", unavailable, other)
	}
	if n := deadlocks(t, url) - before; n != 0 {
		t.Fatalf("PostgreSQL counted %d deadlocks", n)
	}
}

// TestCloseAnswersQueuedCalls closes a store while many Begins and
// Completes without a deadline are queued or in flight: every call
// returns, each with its own answer or ErrUnavailable, and calls after
// Close return ErrUnavailable.
func TestCloseAnswersQueuedCalls(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	s, err := ledger.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	ledger.SkipWithoutBatching(t, s)
	ctx := context.Background() // a library caller without a deadline
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	const callers = 2000
	errs := make(chan error, callers)
	started := make(chan struct{}, callers)
	for i := range callers {
		go func() {
			id := ledger.Identity{Tenant: "t", Scope: "s", Key: fmt.Sprintf("close-%d", i)}
			started <- struct{}{}
			res, err := s.Begin(ctx, &ledger.BeginParams{ID: id, Event: ev})
			if err == nil {
				_, err = s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{
					Kind: statemachine.EventComplete, Token: res.Record.LeaseToken}})
			}
			errs <- err
		}()
	}
	for range callers / 2 {
		<-started
	}
	s.Close()
	// A generous watchdog: without it a regression hangs the test binary.
	watchdog := time.After(2 * time.Minute)
	for i := range callers {
		select {
		case err := <-errs:
			if err != nil && !errors.Is(err, ledger.ErrUnavailable) {
				t.Errorf("call %d: %v, want success or ErrUnavailable", i, err)
			}
		case <-watchdog:
			t.Fatalf("%d of %d calls still blocked after Close", callers-i, callers)
		}
	}
	_, err = s.Begin(ctx, &ledger.BeginParams{ID: ledger.Identity{Tenant: "t", Scope: "s", Key: "after"}, Event: ev})
	if !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Begin after Close: %v, want ErrUnavailable", err)
	}
}

// TestUnreadableRowAmongConcurrentBegins plants a record sealed with a key
// the store lacks (a replica during a key rotation) and Begins it among
// many concurrent Begins of other tenants, round after round: only its
// caller fails (ErrUnreadable); every other caller acquires, and its token
// completes the record.
func TestUnreadableRowAmongConcurrentBegins(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	keyring, err := ledger.NewKeyring("new", map[string][]byte{"new": make([]byte, ledger.KeySize)})
	if err != nil {
		t.Fatal(err)
	}
	s, err := ledger.Open(ctx, url, ledger.WithKeyring(keyring), ledger.WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	bad := ledger.Identity{Tenant: "victim", Scope: "s", Key: "sealed-by-a-lost-key"}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO idempotency_records (tenant, scope, key, state, attempt, generation,
		lease_token, has_response, body, ttl_us, failure_ttl_us, created_at, updated_at, expires_at, enc_key_id)
		VALUES ($1, $2, $3, 2, 1, 1, 'lt1.old', true, '\x0102030405060708090a0b0c0d0e0f10111213141516171819',
			3600000000, 3600000000, now(), now(), now() + interval '1 day', 'old')`, bad.Tenant, bad.Scope, bad.Key); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	for round := range 10 {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for c := range 64 {
			wg.Go(func() {
				id := ledger.Identity{Tenant: fmt.Sprintf("tenant-%d", c%8), Scope: "s", Key: fmt.Sprintf("r%d-c%d", round, c)}
				if c == 0 {
					id = bad
				}
				<-start
				res, err := s.Begin(ctx, &ledger.BeginParams{ID: id, Event: ev})
				if id == bad {
					if !errors.Is(err, ledger.ErrUnreadable) {
						t.Errorf("round %d: the unreadable record's caller: %+v %v, want ErrUnreadable", round, res, err)
					}
					return
				}
				if err != nil || res.Outcome != statemachine.OutcomeAcquired {
					t.Errorf("round %d: %s: %+v %v, want acquired", round, id.Key, res, err)
					return
				}
				if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{
					Kind: statemachine.EventComplete, Token: res.Record.LeaseToken}}); err != nil {
					t.Errorf("round %d: Complete %s with its token: %v", round, id.Key, err)
				}
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
	}
}
