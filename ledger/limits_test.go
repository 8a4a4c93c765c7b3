package ledger_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// incompressible returns n bytes of random base64 text.
func incompressible(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)[:n]
}

// TestIdentityBound stores an identity of exactly MaxIdentityBytes of
// incompressible text (so the bound really fits the index), alone and in
// a batch, and refuses one byte more with ErrIdentityTooLong before any
// database work.
func TestIdentityBound(t *testing.T) {
	t.Parallel()
	s, err := ledger.Open(context.Background(), pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	longest := func() ledger.Identity {
		return ledger.Identity{Tenant: incompressible(300), Scope: incompressible(300), Key: incompressible(ledger.MaxIdentityBytes - 600)}
	}
	// Several at once, so some go through a batch statement.
	errs := make(chan error, 16)
	for range cap(errs) {
		go func() {
			id := longest()
			res, err := s.Begin(ctx, &ledger.BeginParams{ID: id, Event: ev})
			if err == nil {
				_, err = s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{
					Kind: statemachine.EventComplete, Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("x")}}})
			}
			errs <- err
		}()
	}
	for range cap(errs) {
		if err := <-errs; err != nil {
			t.Fatalf("an identity of MaxIdentityBytes: %v", err)
		}
	}
	id := longest()
	id.Key += "x"
	if _, err := s.Begin(ctx, &ledger.BeginParams{ID: id, Event: ev}); !errors.Is(err, ledger.ErrIdentityTooLong) {
		t.Fatalf("Begin of MaxIdentityBytes+1: %v, want ErrIdentityTooLong", err)
	}
	complete := statemachine.Event{Kind: statemachine.EventComplete, Token: "lt1.x", Response: &statemachine.Response{}}
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: complete}); !errors.Is(err, ledger.ErrIdentityTooLong) {
		t.Fatalf("Finish of MaxIdentityBytes+1: %v, want ErrIdentityTooLong", err)
	}
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: id, As: statemachine.StateFailedRetryable}); !errors.Is(err, ledger.ErrIdentityTooLong) {
		t.Fatalf("Resolve of MaxIdentityBytes+1: %v, want ErrIdentityTooLong", err)
	}
}
