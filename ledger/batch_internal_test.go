package ledger

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// plantUnreadable writes a COMPLETED record whose response is sealed under
// a key id no keyring holds, as a replica that lacks a rotated key sees it.
func plantUnreadable(t *testing.T, url string, id Identity) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), `INSERT INTO idempotency_records (tenant, scope, key, state,
		attempt, generation, lease_token, has_response, body, ttl_us, failure_ttl_us, created_at, updated_at,
		expires_at, enc_key_id)
		VALUES ($1, $2, $3, 2, 1, 1, 'lt1.old', true, '\x0102030405060708090a0b0c0d0e0f10111213141516171819', 3600000000,
			3600000000, now(), now(), now() + interval '1 day', 'rotated-away')`, id.Tenant, id.Scope, id.Key); err != nil {
		t.Fatal(err)
	}
}

// TestBeginBatchUnreadableRowFailsOnlyItsCaller runs one batch (no timing
// involved) that holds fresh keys of several tenants and one record that
// cannot be decrypted: only that record's caller fails, with
// ErrUnreadable; every other caller gets its own acquisition.
func TestBeginBatchUnreadableRowFailsOnlyItsCaller(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	s, err := Open(context.Background(), url, WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	skipWithoutBatching(t, s)
	bad := Identity{Tenant: "victim", Scope: "s", Key: "sealed-by-a-lost-key"}
	plantUnreadable(t, url, bad)

	ctx := context.Background()
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	var batch []*beginReq
	for i := range 12 {
		id := Identity{Tenant: fmt.Sprintf("other-%d", i%4), Scope: "s", Key: fmt.Sprintf("k%d", i)}
		if i == 5 {
			id = bad
		}
		e := ev
		e.NewToken = newToken()
		batch = append(batch, &beginReq{ctx: ctx, p: &BeginParams{ID: id, Event: e}, ev: e, out: make(chan beginRes, 1)})
	}
	s.runBeginBatch(ctx, batch)
	for _, r := range batch {
		out := <-r.out
		if r.p.ID == bad {
			if !errors.Is(out.err, ErrUnreadable) {
				t.Errorf("the unreadable record's caller: %+v, want ErrUnreadable", out)
			}
			continue
		}
		if out.err != nil || !out.inserted || out.rec.LeaseToken != r.ev.NewToken {
			t.Errorf("%v: %+v, want its own acquisition", r.p.ID, out)
		}
	}
}

// TestBeginBatchFailingAsAWhole feeds a batch statement a row the index
// cannot hold (past the Store's own identity check), so the statement
// fails for everyone: each caller is sent back to run on its own, where
// the others acquire. A caller whose row a failed batch had committed
// (its token is in the record) acquires it as its own when it runs again.
func TestBeginBatchFailingAsAWhole(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	s, err := Open(context.Background(), url, WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	skipWithoutBatching(t, s)
	ctx := context.Background()
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	huge := Identity{Tenant: "t", Scope: "s", Key: randomKey(4000)}
	var batch []*beginReq
	for i := range 8 {
		id := Identity{Tenant: "t", Scope: "s", Key: fmt.Sprintf("k%d", i)}
		if i == 3 {
			id = huge
		}
		e := ev
		e.NewToken = newToken()
		batch = append(batch, &beginReq{ctx: ctx, p: &BeginParams{ID: id, Event: e}, ev: e, out: make(chan beginRes, 1)})
	}
	s.runBeginBatch(ctx, batch)
	for _, r := range batch {
		if out := <-r.out; out.err != nil || out.found {
			t.Fatalf("%.20s after the batch failed: %+v, want to run on its own", r.p.ID.Key, out)
		}
		if r.p.ID == huge {
			continue
		}
		res, err := s.begin(ctx, r.p, &r.ev)
		if err != nil || res.Outcome != statemachine.OutcomeAcquired || res.Record.LeaseToken != r.ev.NewToken {
			t.Fatalf("%s on its own: %+v %v", r.p.ID.Key, res, err)
		}
		// As if that had been the batch, committed, and this the retry.
		again, err := s.begin(ctx, r.p, &r.ev)
		if err != nil || again.Outcome != statemachine.OutcomeAcquired || again.Record.LeaseToken != r.ev.NewToken {
			t.Fatalf("%s run again with its committed token: %+v %v", r.p.ID.Key, again, err)
		}
	}
}

// randomKey returns n printable bytes that do not compress.
func randomKey(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('!' + rand.IntN(94))
	}
	return string(b)
}

// TestBeginBatchDropsGoneCallers runs one batch (no timing involved) in
// which one caller's context ended while it was queued: that caller is
// answered with its context's error and its key is not written; the
// others acquire theirs.
func TestBeginBatchDropsGoneCallers(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	s, err := Open(context.Background(), url, WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	skipWithoutBatching(t, s)
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	var batch []*beginReq
	for i := range 6 {
		e := ev
		e.NewToken = newToken()
		ctx := context.Background()
		if i == 2 {
			ctx = gone
		}
		batch = append(batch, &beginReq{ctx: ctx, p: &BeginParams{ID: Identity{Tenant: "t", Scope: "s", Key: fmt.Sprintf("k%d", i)}, Event: e},
			ev: e, out: make(chan beginRes, 1)})
	}
	s.runBeginBatch(context.Background(), batch)
	for i, r := range batch {
		out := <-r.out
		if i == 2 {
			if !errors.Is(out.err, context.Canceled) || out.found {
				t.Errorf("the gone caller: %+v, want context.Canceled", out)
			}
			continue
		}
		if out.err != nil || !out.inserted || out.rec.LeaseToken != r.ev.NewToken {
			t.Errorf("%v: %+v, want its own acquisition", r.p.ID, out)
		}
	}
	if _, _, err := s.Lookup(context.Background(), batch[2].p.ID); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("the gone caller's key: %v, want not found (nothing written)", err)
	}
	// A Begin whose context ended before it was sent writes nothing either,
	// whether it was queued for a batch or refused.
	for range 20 {
		id := Identity{Tenant: "t", Scope: "s", Key: "late-" + newToken()}
		if _, err := s.Begin(gone, &BeginParams{ID: id, Event: ev}); !errors.Is(err, context.Canceled) {
			t.Fatalf("Begin with an ended context: %v, want context.Canceled", err)
		}
		if _, _, err := s.Lookup(context.Background(), id); !errors.Is(err, statemachine.ErrNotFound) {
			t.Fatalf("Begin with an ended context wrote its key: %v", err)
		}
	}
}

// skipWithoutBatching skips a test of the batch statements on a store that
// runs every Begin and Complete alone (on Citus).
func skipWithoutBatching(t *testing.T, s *Store) {
	t.Helper()
	if s.writes == nil {
		t.Skip("this store does not batch (on Citus every Begin and Complete runs alone)")
	}
}
