package server_test

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

const (
	acquired   = idempotencyv1.Outcome_OUTCOME_ACQUIRED
	replay     = idempotencyv1.Outcome_OUTCOME_REPLAY
	inProgress = idempotencyv1.Outcome_OUTCOME_IN_PROGRESS
)

func sampleResponse() *idempotencyv1.StoredResponse {
	return &idempotencyv1.StoredResponse{
		SchemaVersion: "payments.v1.ChargeResponse/3",
		ContentType:   "application/x-protobuf",
		Body:          []byte{0, 1, 2, 0xff, 'o', 'k', 0},
		StatusCode:    201,
		Metadata:      map[string]string{"location": "/charges/42", "x-empty": ""},
	}
}

func (e *testEnv) complete(scope, key, token string, resp *idempotencyv1.StoredResponse) (*idempotencyv1.CompleteResponse, error) {
	return e.client.Complete(ctx(e.t), &idempotencyv1.CompleteRequest{Scope: scope, Key: key, LeaseToken: token, Response: resp})
}

func (e *testEnv) fail(scope, key, token string, kind idempotencyv1.FailureKind, resp *idempotencyv1.StoredResponse) (*idempotencyv1.FailResponse, error) {
	return e.client.Fail(ctx(e.t), &idempotencyv1.FailRequest{Scope: scope, Key: key, LeaseToken: token, Kind: kind, Response: resp, Reason: "test says " + kind.String()})
}

func (e *testEnv) lookup(scope, key string) (*idempotencyv1.Record, error) {
	resp, err := e.client.Lookup(ctx(e.t), &idempotencyv1.LookupRequest{Scope: scope, Key: key})
	return resp.GetRecord(), err
}

func (e *testEnv) mustComplete(scope, key, token string, resp *idempotencyv1.StoredResponse) *idempotencyv1.CompleteResponse {
	e.t.Helper()
	r, err := e.complete(scope, key, token, resp)
	if err != nil {
		e.t.Fatalf("Complete(%s, %s): %v", scope, key, err)
	}
	return r
}

func (e *testEnv) mustFail(scope, key, token string, kind idempotencyv1.FailureKind, resp *idempotencyv1.StoredResponse) *idempotencyv1.FailResponse {
	e.t.Helper()
	r, err := e.fail(scope, key, token, kind, resp)
	if err != nil {
		e.t.Fatalf("Fail(%s, %s, %v): %v", scope, key, kind, err)
	}
	return r
}

func (e *testEnv) mustLookup(scope, key string) *idempotencyv1.Record {
	e.t.Helper()
	r, err := e.lookup(scope, key)
	if err != nil {
		e.t.Fatalf("Lookup(%s, %s): %v", scope, key, err)
	}
	return r
}

func (e *testEnv) mustHeartbeat(req *idempotencyv1.HeartbeatRequest) *idempotencyv1.HeartbeatResponse {
	e.t.Helper()
	r, err := e.client.Heartbeat(ctx(e.t), req)
	if err != nil {
		e.t.Fatalf("Heartbeat(%s, %s): %v", req.GetScope(), req.GetKey(), err)
	}
	return r
}

func TestNewKeyAcquiresAndHeldKeyIsInProgress(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	first := e.mustBegin("build", "k1", acquired)
	if first.GetLeaseToken() == "" || first.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED {
		t.Fatalf("first Begin = %v", first)
	}
	rec := first.GetRecord()
	if rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS || rec.GetAttempt() != 1 || rec.GetGeneration() != 1 {
		t.Fatalf("record = %v", rec)
	}
	if got := rec.GetLeaseExpiresAt().AsTime().Sub(e.clock.Now()); got != 30*time.Second {
		t.Fatalf("default lease = %v, want 30s", got)
	}
	if rec.GetExpiresAt() != nil {
		t.Fatalf("expires_at set while in progress: %v", rec.GetExpiresAt())
	}
	second := e.mustBegin("build", "k1", inProgress)
	if second.GetLeaseToken() != "" {
		t.Fatal("an in-progress answer carries a lease token")
	}
	if ra := second.GetRetryAfter().AsDuration(); ra <= 0 || ra > time.Second {
		t.Fatalf("retry_after = %v", ra)
	}
	// Another scope is another record.
	e.mustBegin("deploy", "k1", acquired)
}

func TestCompleteThenReplayByteForByte(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("pay", "k", acquired, withFingerprint("fp1"))
	want := sampleResponse()
	done := e.mustComplete("pay", "k", b.GetLeaseToken(), want)
	if done.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("after Complete: %v", done.GetRecord())
	}
	for range 3 {
		r := e.mustBegin("pay", "k", replay, withFingerprint("fp1"))
		if got := r.GetRecord().GetResponse(); !proto.Equal(got, want) {
			t.Fatalf("replayed %v, want %v", got, want)
		}
		if r.GetLeaseToken() != "" {
			t.Fatal("a replay carries a lease token")
		}
	}
	// An empty fingerprint skips the check.
	e.mustBegin("pay", "k", replay)
	// Any bytes in body and metadata come back as they were stored.
	odd := &idempotencyv1.StoredResponse{Body: []byte{0, 0xc3, 0x28}, StatusCode: -1,
		Metadata: map[string]string{"nul\x00key": "nul\x00value\n", "émoji": "✓"}}
	b3 := e.mustBegin("pay", "odd", acquired)
	e.mustComplete("pay", "odd", b3.GetLeaseToken(), odd)
	if r := e.mustBegin("pay", "odd", replay); !proto.Equal(r.GetRecord().GetResponse(), odd) {
		t.Fatalf("replayed %v, want %v", r.GetRecord().GetResponse(), odd)
	}
	// An empty response is a valid result and is replayed as such.
	b2 := e.mustBegin("pay", "empty", acquired)
	e.mustComplete("pay", "empty", b2.GetLeaseToken(), nil)
	r := e.mustBegin("pay", "empty", replay)
	if r.GetRecord().GetResponse() == nil || !proto.Equal(r.GetRecord().GetResponse(), &idempotencyv1.StoredResponse{}) {
		t.Fatalf("empty response replayed as %v", r.GetRecord().GetResponse())
	}
}

func TestFailKinds(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})

	b := e.mustBegin("s", "retryable", acquired)
	e.mustFail("s", "retryable", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	b2 := e.mustBegin("s", "retryable", acquired)
	if b2.GetRecord().GetAttempt() != 2 || b2.GetPreviousState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || b2.GetLeaseToken() == b.GetLeaseToken() {
		t.Fatalf("after a retryable failure: %v", b2)
	}

	b = e.mustBegin("s", "replayable", acquired)
	failResp := &idempotencyv1.StoredResponse{StatusCode: 9, Body: []byte("card declined")}
	e.mustFail("s", "replayable", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, failResp)
	r := e.mustBegin("s", "replayable", replay)
	if !proto.Equal(r.GetRecord().GetResponse(), failResp) || r.GetRecord().GetState() != idempotencyv1.State_STATE_FAILED_REPLAYABLE {
		t.Fatalf("replayable failure replayed as %v", r.GetRecord())
	}

	b = e.mustBegin("s", "unknown", acquired)
	e.mustFail("s", "unknown", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	rec := e.mustLookup("s", "unknown")
	if rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("after Fail UNKNOWN: %v", rec)
	}
	b2 = e.mustBegin("s", "unknown", acquired)
	if b2.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN || b2.GetRecord().GetAttempt() != 2 {
		t.Fatalf("takeover of UNKNOWN: %v", b2)
	}
	// The old token lost its lease to the takeover: it changes nothing.
	_, err := e.complete("s", "unknown", b.GetLeaseToken(), sampleResponse())
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	if rec := e.mustLookup("s", "unknown"); rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS || rec.GetAttempt() != 2 {
		t.Fatalf("a stale token changed the record: %v", rec)
	}
}

func TestAbandonedFirstAttemptLeavesNoRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired, withFingerprint("a"))
	resp := e.mustFail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil)
	if resp.GetRecord() != nil {
		t.Fatalf("abandoned first attempt left %v", resp.GetRecord())
	}
	_, err := e.lookup("s", "k")
	wantCode(t, err, codes.NotFound, "")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("%d rows left", n)
	}
	// The key is new again, with any fingerprint.
	b = e.mustBegin("s", "k", acquired, withFingerprint("b"))
	if b.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED || b.GetRecord().GetAttempt() != 1 {
		t.Fatalf("after abandon: %v", b)
	}

	// A later attempt that abandons goes back to FAILED_RETRYABLE with its
	// fingerprint cleared.
	e.mustFail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	b = e.mustBegin("s", "k", acquired, withFingerprint("b"))
	e.mustFail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil)
	rec := e.mustLookup("s", "k")
	if rec.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || len(rec.GetFingerprint()) != 0 {
		t.Fatalf("abandoned second attempt: %v", rec)
	}
	e.mustBegin("s", "k", acquired, withFingerprint("c"))
}

func TestLeaseExpiryMakesUnknownAndTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired, withLease(10*time.Second))
	e.clock.Advance(9 * time.Second)
	e.mustBegin("s", "k", inProgress)
	e.clock.Advance(time.Second)
	if rec := e.mustLookup("s", "k"); rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("record past its lease reads %v, want UNKNOWN", rec.GetState())
	}
	// Before any takeover, the latest token still completes.
	done := e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	if done.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("late Complete: %v", done.GetRecord())
	}

	b = e.mustBegin("s", "k2", acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Second)
	b2 := e.mustBegin("s", "k2", acquired)
	if b2.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN || b2.GetRecord().GetAttempt() != 2 {
		t.Fatalf("takeover after lease expiry: %v", b2)
	}
	_, err := e.complete("s", "k2", b.GetLeaseToken(), nil)
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	_, err = e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k2", LeaseToken: b.GetLeaseToken()})
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
}

func TestHeartbeatExtendsLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired, withLease(10*time.Second))
	for range 5 {
		e.clock.Advance(8 * time.Second)
		hb, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken(), Lease: durationpb.New(10 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		if got := hb.GetRecord().GetLeaseExpiresAt().AsTime(); !got.Equal(e.clock.Now().Add(10 * time.Second)) {
			t.Fatalf("lease_expires_at = %v, want now+10s", got)
		}
		e.mustBegin("s", "k", inProgress)
	}
	// Without a lease in the request, the policy's (30s) applies.
	hb := e.mustHeartbeat(&idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken()})
	if got := hb.GetRecord().GetLeaseExpiresAt().AsTime().Sub(e.clock.Now()); got != 30*time.Second {
		t.Fatalf("heartbeat without lease extends by %v", got)
	}
	// A heartbeat revives a lapsed lease that nobody took over.
	e.clock.Advance(time.Minute)
	hb = e.mustHeartbeat(&idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken()})
	if hb.GetRecord().GetState() != idempotencyv1.State_STATE_IN_PROGRESS {
		t.Fatalf("heartbeat after lapse: %v", hb.GetRecord())
	}
}

func TestTTLCountsFromEndingCallAndExpiryRestarts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired, withTTL(time.Hour), withFingerprint("one"))
	e.clock.Advance(20 * time.Second)
	done := e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	if got := done.GetRecord().GetExpiresAt().AsTime(); !got.Equal(e.clock.Now().Add(time.Hour)) {
		t.Fatalf("expires_at = %v, want the Complete's time + 1h", got)
	}
	e.clock.Advance(time.Hour - time.Second)
	e.mustBegin("s", "k", replay)
	e.clock.Advance(time.Second)
	rec := e.mustLookup("s", "k")
	if rec.GetState() != idempotencyv1.State_STATE_EXPIRED || rec.GetResponse() != nil {
		t.Fatalf("past expires_at: %v", rec)
	}
	// A restart takes a new generation and the new fingerprint.
	b2 := e.mustBegin("s", "k", acquired, withFingerprint("two"))
	if b2.GetPreviousState() != idempotencyv1.State_STATE_EXPIRED || b2.GetRecord().GetGeneration() != 2 || b2.GetRecord().GetAttempt() != 1 {
		t.Fatalf("restart after expiry: %v", b2)
	}

	// Failures use failure_ttl (1h by default), never more than ttl.
	b = e.mustBegin("s", "f", acquired, withTTL(24*time.Hour))
	f := e.mustFail("s", "f", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, sampleResponse())
	if got := f.GetRecord().GetExpiresAt().AsTime().Sub(e.clock.Now()); got != time.Hour {
		t.Fatalf("failure expires after %v, want 1h", got)
	}
	b = e.mustBegin("s", "g", acquired, withTTL(10*time.Minute))
	f = e.mustFail("s", "g", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	if got := f.GetRecord().GetExpiresAt().AsTime().Sub(e.clock.Now()); got != 10*time.Minute {
		t.Fatalf("failure with ttl 10m expires after %v, want 10m", got)
	}
}

func TestSameAttemptIDGetsSameToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired, withAttemptID("att-1"))
	again := e.mustBegin("s", "k", acquired, withAttemptID("att-1"))
	if again.GetLeaseToken() != b.GetLeaseToken() {
		t.Fatalf("same attempt_id got token %q, first %q", again.GetLeaseToken(), b.GetLeaseToken())
	}
	e.mustBegin("s", "k", inProgress, withAttemptID("att-2"))
	e.mustBegin("s", "k", inProgress)
}

func TestRepeatedEndingCalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acquired)
	first := e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	again := e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	if !proto.Equal(first.GetRecord(), again.GetRecord()) {
		t.Fatalf("a repeated Complete changed the record:\n%v\n%v", first.GetRecord(), again.GetRecord())
	}
	other := sampleResponse()
	other.Body = []byte("different")
	_, err := e.complete("s", "k", b.GetLeaseToken(), other)
	wantCode(t, err, codes.FailedPrecondition, "ALREADY_FINISHED")
	_, err = e.fail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	wantCode(t, err, codes.FailedPrecondition, "ALREADY_FINISHED")
	_, err = e.complete("s", "k", "lt1.not-the-token", sampleResponse())
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	_, err = e.complete("s", "missing", "lt1.x", sampleResponse())
	wantCode(t, err, codes.NotFound, "")
	if rec := e.mustLookup("s", "k"); !proto.Equal(rec.GetResponse(), sampleResponse()) {
		t.Fatalf("stored response changed: %v", rec.GetResponse())
	}
}

func TestWaitRunsOutAnswersInProgress(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{realClock: true})
	e.mustBegin("s", "k", acquired)
	start := time.Now()
	r := e.mustBegin("s", "k", inProgress, withWait(300*time.Millisecond))
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Fatalf("Begin with wait 300ms answered after %v", el)
	}
	if r.GetRetryAfter() == nil {
		t.Fatal("no retry_after")
	}
}

func TestWaitWakesWhenHolderCompletes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{realClock: true})
	b := e.mustBegin("s", "k", acquired)
	got := make(chan *idempotencyv1.BeginResponse, 1)
	errc := make(chan error, 1)
	go func() {
		r, err := e.begin("s", "k", withWait(20*time.Second))
		errc <- err
		got <- r
	}()
	e.coord.WaitInFlight(t, "Begin", 1) // the waiter is in the server, not merely sent
	e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.GetOutcome() != replay || !proto.Equal(r.GetRecord().GetResponse(), sampleResponse()) {
		t.Fatalf("waiter got %v", r)
	}
}

func TestWaitWakesAtLeaseExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{realClock: true})
	e.mustBegin("s", "k", acquired, withLease(time.Second))
	r := e.mustBegin("s", "k", acquired, withWait(20*time.Second))
	if r.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("waiter after lease expiry: %v", r)
	}
}

// TestAbandonedRestartUnderRejectRestartsAgain: under on_expired: reject
// only an expired failure restarts, so a restart that is abandoned goes
// back to an expired failure, and the next Begin restarts again rather
// than answering KEY_EXPIRED. Fail must therefore decide with the scope's
// policy, not a zero one (the chaos reference test found the difference).
func TestAbandonedRestartUnderRejectRestartsAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `
scopes:
  - { match: "strict", ttl: 1m, failure_ttl: 1m, on_expired: reject }
`})
	b := e.mustBegin("strict", "k", acquired)
	e.mustFail("strict", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	e.clock.Advance(2 * time.Minute)
	b = e.mustBegin("strict", "k", acquired)
	if b.GetPreviousState() != idempotencyv1.State_STATE_EXPIRED || b.GetRecord().GetGeneration() != 2 {
		t.Fatalf("restart of an expired failure: %v", b)
	}
	e.mustFail("strict", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil)
	if rec := e.mustLookup("strict", "k"); rec.GetState() != idempotencyv1.State_STATE_EXPIRED || rec.GetGeneration() != 1 {
		t.Fatalf("after the abandoned restart: %v", rec)
	}
	b = e.mustBegin("strict", "k", acquired)
	if b.GetPreviousState() != idempotencyv1.State_STATE_EXPIRED {
		t.Fatalf("restart after the abandoned one: %v", b)
	}
}
