package ledger

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestReleaseGoneLeavesAnAcquisitionTakenUp: the release of an acquisition
// whose Begin's caller had gone ends it only while it is as that Begin
// wrote it. Once a repeated Begin of the same attempt_id (a retry whose
// caller is still there) has taken it up, it is that caller's: the release
// leaves it alone, and the record stays IN_PROGRESS under the same token.
func TestReleaseGoneLeavesAnAcquisitionTakenUp(t *testing.T) {
	t.Parallel()
	s, err := Open(context.Background(), pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	p := &BeginParams{ID: Identity{Tenant: DefaultTenant, Scope: "s", Key: "taken-up"},
		Event: statemachine.Event{AttemptID: "retried", TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}}
	first, err := s.Begin(ctx, p)
	if err != nil || first.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("Begin: %+v, %v", first, err)
	}
	time.Sleep(5 * time.Millisecond) // the repeat is written at a later time
	again, err := s.Begin(ctx, p)
	if err != nil || again.Outcome != statemachine.OutcomeAcquired || again.Record.LeaseToken != first.Record.LeaseToken {
		t.Fatalf("repeated Begin of the attempt: %+v, %v; want the same acquisition", again, err)
	}

	s.releaseGone(ctx, p, first.Record)
	rec, _, err := s.Lookup(ctx, p.ID)
	if err != nil || rec.State != statemachine.StateInProgress || rec.LeaseToken != first.Record.LeaseToken {
		t.Fatalf("after releasing the acquisition as first written: %v (token %s), %v; want it IN_PROGRESS, taken up by the repeat", rec.State, rec.LeaseToken, err)
	}

	s.releaseGone(ctx, p, again.Record)
	if _, _, err := s.Lookup(ctx, p.ID); !errors.Is(err, statemachine.ErrNotFound) {
		t.Fatalf("after releasing the acquisition as last written: %v; want the record gone (ErrNotFound)", err)
	}
}
