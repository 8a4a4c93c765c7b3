package ledger_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// recoveryID is the record the recovery tests play with.
var recoveryID = ledger.Identity{Tenant: "t", Scope: "/payments.v1.Payments/Charge", Key: "order-7"}

// beginAs calls Begin on recoveryID as one logical attempt.
func beginAs(t *testing.T, s *ledger.Store, attemptID string, fingerprint []byte, pol statemachine.Policy) (*ledger.Result, error) {
	t.Helper()
	return s.Begin(context.Background(), &ledger.BeginParams{ID: recoveryID, Policy: pol,
		Event: statemachine.Event{Fingerprint: fingerprint, AttemptID: attemptID, TTL: 24 * time.Hour,
			FailureTTL: time.Hour, Lease: 10 * time.Second}})
}

// mustAcquire fails t unless Begin acquires with the previous state want.
func mustAcquire(t *testing.T, s *ledger.Store, attemptID string, fingerprint []byte, pol statemachine.Policy, want statemachine.State) *ledger.Result {
	t.Helper()
	res, err := beginAs(t, s, attemptID, fingerprint, pol)
	if err != nil {
		t.Fatalf("Begin %s: %v", attemptID, err)
	}
	if res.Outcome != statemachine.OutcomeAcquired || res.PreviousState != want {
		t.Fatalf("Begin %s: outcome %v, previous_state %v; want ACQUIRED after %v", attemptID, res.Outcome, res.PreviousState, want)
	}
	return res
}

func failAs(t *testing.T, s *ledger.Store, token string, kind statemachine.FailureKind) (*ledger.Result, error) {
	t.Helper()
	return s.Finish(context.Background(), &ledger.FinishParams{ID: recoveryID, Event: statemachine.Event{
		Kind: statemachine.EventFail, Token: token, FailureKind: kind, Reason: "test says " + fmt.Sprint(kind)}})
}

// storedUncertain reads the uncertain column of recoveryID as stored.
func storedUncertain(t *testing.T, url string) bool {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var u bool
	if err := conn.QueryRow(context.Background(), `SELECT uncertain FROM idempotency_records
		WHERE tenant = $1 AND scope = $2 AND key = $3`, recoveryID.Tenant, recoveryID.Scope, recoveryID.Key).Scan(&u); err != nil {
		t.Fatal(err)
	}
	return u
}

// The double-charge story (docs/go.md, "Worked example") against PostgreSQL: attempt 1
// vanishes; attempt 2 takes over, cannot check the bank and fails
// RETRYABLE; attempt 3 is still told UNKNOWN; its Fail ABANDONED returns the
// key to UNKNOWN with the fingerprint kept, so another request cannot take
// it; only a COMPLETED outcome clears the flag. Run once with the lapse
// found lazily by Begin and once with the reaper writing it down.
func TestUncertaintyIsSticky(t *testing.T) {
	t.Parallel()
	for _, reaped := range []bool{false, true} {
		t.Run(fmt.Sprintf("reaped=%v", reaped), func(t *testing.T) {
			t.Parallel()
			s, clock, url := newClockedStore(t)
			fp, other := []byte("charge 100 EUR"), []byte("charge 999 EUR")
			pol := statemachine.Policy{}

			mustAcquire(t, s, "a1", fp, pol, statemachine.StateNone)
			clock.Advance(11 * time.Second) // attempt 1's lease lapses
			if reaped {
				if res, err := s.Reap(context.Background(), &ledger.ReapParams{}); err != nil || res.Unknown != 1 {
					t.Fatalf("Reap: %+v %v", res, err)
				}
				if !storedUncertain(t, url) {
					t.Fatal("the reaper wrote UNKNOWN without uncertain")
				}
			}
			rec, _, err := s.Lookup(context.Background(), recoveryID)
			if err != nil || rec.State != statemachine.StateUnknown || !rec.Uncertain {
				t.Fatalf("Lookup after the lapse: %v uncertain=%v %v", rec.State, rec.Uncertain, err)
			}

			a2 := mustAcquire(t, s, "a2", fp, pol, statemachine.StateUnknown)
			if res, err := failAs(t, s, a2.Record.LeaseToken, statemachine.FailureRetryable); err != nil || !res.Record.Uncertain {
				t.Fatalf("Fail RETRYABLE: %+v %v", res, err)
			}
			if !storedUncertain(t, url) {
				t.Fatal("FAILED_RETRYABLE stored without uncertain")
			}
			// failure_ttl passing (and the reaper) must not expire the
			// warning into a fresh generation.
			clock.Advance(48 * time.Hour)
			if res, err := s.Reap(context.Background(), &ledger.ReapParams{}); err != nil || res.Expired != 0 {
				t.Fatalf("Reap after two days: %+v %v; an uncertain FAILED_RETRYABLE must not expire", res, err)
			}
			if rec, _, err := s.Lookup(context.Background(), recoveryID); err != nil || rec.State != statemachine.StateFailedRetryable || !rec.Uncertain {
				t.Fatalf("Lookup two days later: %v uncertain=%v %v", rec.State, rec.Uncertain, err)
			}
			// On main this answered FAILED_RETRYABLE: "nothing happened".
			a3 := mustAcquire(t, s, "a3", fp, pol, statemachine.StateUnknown)
			res, err := failAs(t, s, a3.Record.LeaseToken, statemachine.FailureAbandoned)
			if err != nil || !res.Exists || res.Record.State != statemachine.StateUnknown || !bytes.Equal(res.Record.Fingerprint, fp) {
				t.Fatalf("Fail ABANDONED after an uncertain takeover: %+v %v; want UNKNOWN with the fingerprint kept", res, err)
			}
			if _, err := beginAs(t, s, "other", other, pol); !errors.Is(err, statemachine.ErrFingerprintMismatch) {
				t.Fatalf("another request with the key: %v, want ErrFingerprintMismatch", err)
			}
			a4 := mustAcquire(t, s, "a4", fp, pol, statemachine.StateUnknown)
			completeID(t, s, recoveryID, a4.Record.LeaseToken)
			if rec, _, err := s.Lookup(context.Background(), recoveryID); err != nil || rec.State != statemachine.StateCompleted || rec.Uncertain {
				t.Fatalf("after Complete: %v uncertain=%v %v", rec.State, rec.Uncertain, err)
			}
			if storedUncertain(t, url) {
				t.Fatal("COMPLETED stored as uncertain")
			}
		})
	}
}

// Completes of uncertain records coalesced into one batch statement clear
// the flag too.
func TestBatchedCompleteClearsUncertain(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	const n = 40
	id := func(i int) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: fmt.Sprint("k", i)} }
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: 10 * time.Second}
	for i := range n {
		beginID(t, s, id(i), 10*time.Second, time.Hour)
	}
	clock.Advance(time.Minute)
	tokens := make([]string, n)
	for i := range n {
		res, err := s.Begin(ctx, &ledger.BeginParams{ID: id(i), Event: ev})
		if err != nil || res.PreviousState != statemachine.StateUnknown || !res.Record.Uncertain {
			t.Fatalf("takeover %d: %+v %v", i, res, err)
		}
		tokens[i] = res.Record.LeaseToken
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { completeID(t, s, id(i), tokens[i]) })
	}
	wg.Wait()
	for i := range n {
		if rec, _, err := s.Lookup(ctx, id(i)); err != nil || rec.State != statemachine.StateCompleted || rec.Uncertain {
			t.Fatalf("%d: %v uncertain=%v %v", i, rec.State, rec.Uncertain, err)
		}
	}
}

// A Begin repeated with the holder's attempt_id renews the lease to a full
// lease from now: a lost reply retried late does not leave the holder with
// a lease about to run out.
func TestRepeatedAttemptIDRenewsLease(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	first := mustAcquire(t, s, "a1", nil, statemachine.Policy{}, statemachine.StateNone)
	clock.Advance(8 * time.Second) // 2 s of the 10 s lease left
	again, err := beginAs(t, s, "a1", nil, statemachine.Policy{})
	if err != nil || again.Outcome != statemachine.OutcomeAcquired || again.Record.LeaseToken != first.Record.LeaseToken {
		t.Fatalf("repeated Begin: %+v %v; want ACQUIRED with the same token", again, err)
	}
	if want := clock.Now().Add(10 * time.Second); !again.Record.LeaseExpiresAt.Equal(want) {
		t.Fatalf("lease expires at %v, want a full lease from now, %v", again.Record.LeaseExpiresAt, want)
	}
	clock.Advance(5 * time.Second) // past the first lease, within the renewed one
	res, err := beginAs(t, s, "a2", nil, statemachine.Policy{})
	if err != nil || res.Outcome != statemachine.OutcomeInProgress {
		t.Fatalf("another attempt within the renewed lease: %+v %v; want IN_PROGRESS", res, err)
	}
}

// on_expired: reject protects results, not failures: a FAILED_RETRYABLE
// record past failure_ttl restarts instead of locking the key out, whether
// the reaper wrote it EXPIRED or not; an expired result is still refused.
func TestRejectAppliesToResultsNotFailures(t *testing.T) {
	t.Parallel()
	reject := statemachine.Policy{OnExpired: statemachine.ExpiredReject}
	for _, reaped := range []bool{false, true} {
		t.Run(fmt.Sprintf("reaped=%v", reaped), func(t *testing.T) {
			t.Parallel()
			s, clock, _ := newClockedStore(t)
			a1 := mustAcquire(t, s, "a1", nil, reject, statemachine.StateNone)
			if _, err := failAs(t, s, a1.Record.LeaseToken, statemachine.FailureRetryable); err != nil {
				t.Fatal(err)
			}
			clock.Advance(time.Hour + time.Second) // past failure_ttl
			if reaped {
				if res, err := s.Reap(context.Background(), &ledger.ReapParams{Retention: 24 * time.Hour}); err != nil || res.Expired != 1 {
					t.Fatalf("Reap: %+v %v", res, err)
				}
			}
			a2 := mustAcquire(t, s, "a2", nil, reject, statemachine.StateExpired)
			if a2.Record.Generation != 2 || a2.Record.Attempt != 1 {
				t.Fatalf("restart: generation %d attempt %d", a2.Record.Generation, a2.Record.Attempt)
			}
			completeID(t, s, recoveryID, a2.Record.LeaseToken)
			clock.Advance(25 * time.Hour) // past ttl: a result expired
			if _, err := beginAs(t, s, "a3", nil, reject); !errors.Is(err, statemachine.ErrKeyExpired) {
				t.Fatalf("Begin on an expired result under reject: %v, want ErrKeyExpired", err)
			}
		})
	}
}

// A Heartbeat after the attempt ended (Fail of any kind, Complete) answers
// ErrAlreadyFinished and changes nothing: it never revives a Fail UNKNOWN
// to IN_PROGRESS.
func TestHeartbeatNeverRevivesAnEndedAttempt(t *testing.T) {
	t.Parallel()
	for _, kind := range []statemachine.FailureKind{statemachine.FailureUnknown, statemachine.FailureRetryable,
		statemachine.FailureReplayable, statemachine.FailureAbandoned} {
		t.Run(fmt.Sprint(kind), func(t *testing.T) {
			t.Parallel()
			s, clock, _ := newClockedStore(t)
			mustAcquire(t, s, "a0", nil, statemachine.Policy{}, statemachine.StateNone)
			clock.Advance(11 * time.Second)
			// Attempt 2 (uncertain), so that ABANDONED keeps a record too.
			a := mustAcquire(t, s, "a1", nil, statemachine.Policy{}, statemachine.StateUnknown)
			ended, err := failAs(t, s, a.Record.LeaseToken, kind)
			if err != nil {
				t.Fatal(err)
			}
			_, err = s.Finish(context.Background(), &ledger.FinishParams{ID: recoveryID, Event: statemachine.Event{
				Kind: statemachine.EventHeartbeat, Token: a.Record.LeaseToken, Lease: time.Minute}})
			if !errors.Is(err, statemachine.ErrAlreadyFinished) {
				t.Fatalf("Heartbeat after Fail %v: %v, want ErrAlreadyFinished", kind, err)
			}
			rec, _, err := s.Lookup(context.Background(), recoveryID)
			if err != nil || rec.State != ended.Record.State || !rec.UpdatedAt.Equal(ended.Record.UpdatedAt) {
				t.Fatalf("after the Heartbeat: %v (updated %v) %v; want %v unchanged", rec.State, rec.UpdatedAt, err, ended.Record.State)
			}
			// The Fail itself may still be repeated.
			if _, err := failAs(t, s, a.Record.LeaseToken, kind); err != nil {
				t.Fatalf("repeated Fail %v: %v", kind, err)
			}
		})
	}
}

// An uncertain FAILED_RETRYABLE record needs a decision like UNKNOWN: an
// operator can Resolve it, and the next Begin after a Resolve as retryable
// reads certain again.
func TestResolveUncertainRetryable(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	fp := []byte("charge 100 EUR")
	pol := statemachine.Policy{}
	mustAcquire(t, s, "a1", fp, pol, statemachine.StateNone)
	clock.Advance(11 * time.Second) // attempt 1's lease lapses
	a2 := mustAcquire(t, s, "a2", fp, pol, statemachine.StateUnknown)
	if _, err := failAs(t, s, a2.Record.LeaseToken, statemachine.FailureRetryable); err != nil {
		t.Fatal(err)
	}
	res, err := s.Resolve(ctx, &ledger.ResolveParams{ID: recoveryID, As: statemachine.StateFailedRetryable})
	if err != nil || res.Record.State != statemachine.StateFailedRetryable || res.Record.Uncertain {
		t.Fatalf("Resolve an uncertain FAILED_RETRYABLE as retryable: %+v %v", res, err)
	}
	// Now certain: the next attempt is told FAILED_RETRYABLE, and a
	// second Resolve finds nothing to decide.
	mustAcquire(t, s, "a3", fp, pol, statemachine.StateFailedRetryable)
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: recoveryID, As: statemachine.StateCompleted}); !errors.Is(err, statemachine.ErrNotUnknown) {
		t.Fatalf("Resolve of an IN_PROGRESS record: %v, want ErrNotUnknown", err)
	}
}
