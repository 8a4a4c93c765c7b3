package ledger_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// recordCheckpoint records phase/data with token's Heartbeat.
func recordCheckpoint(t *testing.T, s *ledger.Store, id ledger.Identity, token, phase, data string) {
	t.Helper()
	if _, err := s.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
		Kind: statemachine.EventHeartbeat, Token: token, Lease: time.Hour,
		Checkpoint: &statemachine.Checkpoint{Phase: phase, Data: []byte(data)}}}); err != nil {
		t.Fatalf("Heartbeat with checkpoint %v: %v", id, err)
	}
}

func wantStoredCheckpoint(t *testing.T, what string, got *statemachine.Checkpoint, phase, data string, attempt int32) {
	t.Helper()
	if got == nil || got.Phase != phase || !bytes.Equal(got.Data, []byte(data)) || got.Attempt != attempt || got.At.IsZero() {
		t.Fatalf("%s: checkpoint %+v, want %q %q by attempt %d", what, got, phase, data, attempt)
	}
}

// TestCheckpointStoredAcrossWrites: a checkpoint is written by the
// Heartbeat that carries it and kept by every later write of the row that
// does not carry one: a takeover (locked path), the holder's Complete
// (the one-statement path, which does not read it), the reaper's archiving
// (the archive keeps it). Listing shows it without its data and filters by
// its phase; an expired record is not listed by phase.
func TestCheckpointStoredAcrossWrites(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	id := func(k string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: k} }

	tok := beginID(t, s, id("done"), time.Second, time.Hour)
	recordCheckpoint(t, s, id("done"), tok, "charged", "ch_1")
	rec, _, err := s.Lookup(ctx, id("done"))
	if err != nil {
		t.Fatal(err)
	}
	wantStoredCheckpoint(t, "Lookup", rec.Checkpoint, "charged", "ch_1", 1)
	clock.Advance(2 * time.Hour) // the lease of an hour lapses
	res, err := s.Begin(ctx, &ledger.BeginParams{ID: id("done"), Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	if err != nil || res.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("takeover: %+v %v", res, err)
	}
	wantStoredCheckpoint(t, "takeover", res.Record.Checkpoint, "charged", "ch_1", 1)
	completeID(t, s, id("done"), res.Record.LeaseToken)
	rec, _, err = s.Lookup(ctx, id("done"))
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != statemachine.StateCompleted {
		t.Fatalf("state %v", rec.State)
	}
	wantStoredCheckpoint(t, "completed", rec.Checkpoint, "charged", "ch_1", 1)

	tok = beginID(t, s, id("lapsed"), time.Second, time.Hour)
	recordCheckpoint(t, s, id("lapsed"), tok, "reserved", "r_1")
	tok = beginID(t, s, id("plain"), time.Hour, time.Hour)
	recordCheckpoint(t, s, id("plain"), tok, "reserved", "r_2")
	beginID(t, s, id("none"), time.Hour, 2*time.Hour)

	list := func(p ledger.ListParams) []string {
		t.Helper()
		p.Tenant, p.Limit = "t", 100
		page, err := s.ListRecords(ctx, &p)
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, r := range page.Records {
			if c := r.Record.Checkpoint; c != nil {
				if c.Data != nil || c.Phase == "" || c.At.IsZero() {
					t.Fatalf("listed checkpoint of %s: %+v, want phase and time without data", r.Key, c)
				}
				keys = append(keys, r.Key+"="+c.Phase)
			} else {
				keys = append(keys, r.Key)
			}
		}
		return keys
	}
	if got, want := list(ledger.ListParams{}), []string{"done=charged", "lapsed=reserved", "none", "plain=reserved"}; !slices.Equal(got, want) {
		t.Fatalf("listed %v, want %v", got, want)
	}
	if got, want := list(ledger.ListParams{CheckpointPhase: "reserved"}), []string{"lapsed=reserved", "plain=reserved"}; !slices.Equal(got, want) {
		t.Fatalf("listed by phase %v, want %v", got, want)
	}
	clock.Advance(90 * time.Minute) // "done" expires
	if got, want := list(ledger.ListParams{CheckpointPhase: "charged"}), []string(nil); !slices.Equal(got, want) {
		t.Fatalf("listed by phase after expiry %v, want none", got)
	}

	clock.Advance(48 * time.Hour)
	for range 2 { // mark the lapsed leases UNKNOWN, then archive them
		if _, err := s.Reap(ctx, &ledger.ReapParams{BatchSize: 10, UnknownRetention: 24 * time.Hour}); err != nil {
			t.Fatal(err)
		}
		clock.Advance(25 * time.Hour)
	}
	if got := list(ledger.ListParams{Archived: true, CheckpointPhase: "reserved"}); !slices.Equal(got, []string{"lapsed=reserved", "plain=reserved"}) {
		t.Fatalf("archive by phase: %v", got)
	}
}

// TestCheckpointInOwnAcquisitionAnswer: a Begin repeated with the token of
// an acquisition whose answer was lost (a takeover that found a
// checkpoint) is answered that acquisition with its checkpoint, although
// the one-statement Begin it runs first does not read checkpoints.
func TestCheckpointInOwnAcquisitionAnswer(t *testing.T) {
	t.Parallel()
	s, _, _ := newClockedStore(t)
	ctx := context.Background()
	id := ledger.Identity{Tenant: "t", Scope: "s", Key: "k"}
	tok := beginID(t, s, id, time.Minute, time.Hour)
	recordCheckpoint(t, s, id, tok, "charged", "ch_1")
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: tok, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	p := &ledger.BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute,
		NewToken: ledger.NewLeaseToken(), AttemptID: "a2"}}
	for i := range 2 { // the takeover, then its repeat after a lost answer
		res, err := s.Begin(ctx, p)
		if err != nil || res.Outcome != statemachine.OutcomeAcquired || res.Record.LeaseToken != p.Event.NewToken {
			t.Fatalf("Begin #%d: %+v %v", i+1, res, err)
		}
		wantStoredCheckpoint(t, fmt.Sprintf("Begin #%d", i+1), res.Record.Checkpoint, "charged", "ch_1", 1)
	}
}
