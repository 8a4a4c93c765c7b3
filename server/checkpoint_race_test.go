package server_test

import (
	"bytes"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TestCheckpointOnALapsedLease: a holder whose lease lapsed, with nobody
// having taken the key over yet, may still record a checkpoint, as it may
// heartbeat: the record is IN_PROGRESS again with the lease extended (the
// reaper having marked it UNKNOWN or not), still uncertain, and the
// attempt can no longer be abandoned.
func TestCheckpointOnALapsedLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for _, reaped := range []bool{false, true} {
		key := "lazy"
		if reaped {
			key = "reaped"
		}
		b := e.mustBegin("s", key, acq)
		e.clock.Advance(policyLease + time.Second)
		if reaped {
			if err := e.coord.Server.ReapOnce(ctx(t)); err != nil {
				t.Fatal(err)
			}
		}
		if got := e.mustLookup("s", key); got.GetState() != idempotencyv1.State_STATE_UNKNOWN {
			t.Fatalf("%s: lapsed lease reads %v", key, got.GetState())
		}
		at := e.clock.Now()
		hb, err := e.heartbeat("s", key, b.GetLeaseToken(), "charged", []byte("ch_1"))
		if err != nil {
			t.Fatalf("%s: checkpoint on a lapsed lease nobody took over: %v", key, err)
		}
		rec := hb.GetRecord()
		if rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS || !rec.GetUncertain() ||
			!rec.GetLeaseExpiresAt().AsTime().Equal(at.Add(policyLease)) {
			t.Fatalf("%s: after the checkpoint: %v uncertain %v lease until %v", key, rec.GetState(), rec.GetUncertain(),
				rec.GetLeaseExpiresAt().AsTime())
		}
		wantCheckpoint(t, key+": Lookup", e.mustLookup("s", key), "charged", []byte("ch_1"), at)
		_, err = e.fail("s", key, b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil)
		wantCode(t, err, codes.FailedPrecondition, reasonCkpt)
		if _, err := e.fail("s", key, b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil); err != nil {
			t.Fatal(err)
		}
		next := e.mustBegin("s", key, acq)
		if next.GetPreviousState() != prevUnknown {
			t.Fatalf("%s: next Begin previous_state %v, want UNKNOWN (the lapse is sticky)", key, next.GetPreviousState())
		}
		wantCheckpoint(t, key+": next Begin", next.GetRecord(), "charged", []byte("ch_1"), at)
	}
}

// TestCheckpointOnAnEndedRecord: a checkpoint with the token of an attempt
// that ended (COMPLETED, then EXPIRED) is ALREADY_FINISHED, one on a key
// with no record NOT_FOUND; neither writes anything.
func TestCheckpointOnAnEndedRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acq)
	if _, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}}); err != nil {
		t.Fatal(err)
	}
	for _, when := range []string{"completed", "expired"} {
		if when == "expired" {
			e.clock.Advance(policyTTL + time.Second)
		}
		before := e.mustLookup("s", "k")
		_, err := e.heartbeat("s", "k", b.GetLeaseToken(), "late", []byte("x"))
		wantCode(t, err, codes.FailedPrecondition, "ALREADY_FINISHED")
		if after := e.mustLookup("s", "k"); !proto.Equal(after, before) || after.GetCheckpoint() != nil {
			t.Fatalf("%s: a refused checkpoint changed the record:\n%v\nwas\n%v", when, after, before)
		}
	}
	_, err := e.heartbeat("s", "absent", b.GetLeaseToken(), "late", nil)
	wantCode(t, err, codes.NotFound, "")
	if _, err := e.lookup("s", "absent"); status.Code(err) != codes.NotFound {
		t.Fatalf("a checkpoint on an absent key: Lookup %v", err)
	}
}

// TestCheckpointsRaceATakeover: many checkpoints of one holder race the
// lapse of its lease and another attempt's takeover. Every one either
// lands or is refused LEASE_LOST; none sent after the takeover answered
// lands; the takeover gets the last one that landed before it, and the
// record keeps exactly that until the new holder records its own.
func TestCheckpointsRaceATakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	const workers, each = 8, 25
	first := e.mustBegin("s", "k", acq, withLease(time.Second))
	var takenOver atomic.Bool
	var mu sync.Mutex
	landed := map[string]bool{}
	var wg sync.WaitGroup
	errs := make(chan error, workers*each)
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				data := []byte(strconv.Itoa(w*each + i))
				after := takenOver.Load()
				_, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k",
					LeaseToken: first.GetLeaseToken(), Lease: durationpb.New(time.Second),
					Checkpoint: &idempotencyv1.Checkpoint{Phase: "a", Data: data}})
				switch {
				case err == nil && after:
					errs <- status.Errorf(codes.Internal, "checkpoint %s sent after the takeover landed", data)
				case err == nil:
					mu.Lock()
					landed[string(data)] = true
					mu.Unlock()
				case status.Code(err) != codes.FailedPrecondition:
					errs <- err
				}
			}
		})
	}
	// Let the lease lapse until the second attempt takes the key over (the
	// first's heartbeats keep extending it by a second meanwhile).
	var second *idempotencyv1.BeginResponse
	for second == nil {
		e.clock.Advance(2 * time.Second)
		b, err := e.begin("s", "k")
		if err != nil {
			t.Fatal(err)
		}
		if b.GetOutcome() == acq {
			second = b
		}
	}
	takenOver.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d of %d checkpoints landed before the takeover", len(landed), workers*each)
	got := second.GetRecord().GetCheckpoint()
	if got != nil && (got.GetPhase() != "a" || !landed[string(got.GetData())]) {
		t.Fatalf("the takeover got checkpoint %v, which no Heartbeat of the first holder was told landed", got)
	}
	if got == nil && len(landed) > 0 {
		t.Fatalf("%d checkpoints landed, the takeover got none", len(landed))
	}
	if rec := e.mustLookup("s", "k"); !proto.Equal(rec.GetCheckpoint(), got) || rec.GetAttempt() != second.GetRecord().GetAttempt() {
		t.Fatalf("after the race the record has checkpoint %v, the takeover got %v", rec.GetCheckpoint(), got)
	}
	if _, err := e.heartbeat("s", "k", second.GetLeaseToken(), "b", []byte("mine")); err != nil {
		t.Fatal(err)
	}
	if c := e.mustLookup("s", "k").GetCheckpoint(); c.GetPhase() != "b" || !bytes.Equal(c.GetData(), []byte("mine")) {
		t.Fatalf("the new holder's checkpoint: %v", c)
	}
}
