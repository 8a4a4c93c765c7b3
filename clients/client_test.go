package clients_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// newClient starts a coordinator and returns a Client of it whose
// background work must be done when the test ends.
func newClient(t *testing.T, o coordtest.Options, opts ...clients.Option) (*coordtest.Coordinator, *clients.Client) {
	t.Helper()
	coord := coordtest.Start(t, o)
	c := clients.New(coord.Dial(t), fixtureOptions(opts...)...)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := c.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return coord, c
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// A Begin repeated with the holder's attempt_id gets the same token back;
// one without gets its own attempt_id and finds the key in progress.
func TestBeginAttemptID(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{})
	ctx := testCtx(t)
	req := &idempotencyv1.BeginRequest{Scope: "build", Key: "b1", AttemptId: "attempt-1"}
	first, err := c.Begin(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Begin(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if again.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || again.GetLeaseToken() != first.GetLeaseToken() {
		t.Fatalf("repeated Begin: %v with token %q, want ACQUIRED with %q", again.GetOutcome(), again.GetLeaseToken(), first.GetLeaseToken())
	}
	other := &idempotencyv1.BeginRequest{Scope: "build", Key: "b1"}
	res, err := c.Begin(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS {
		t.Fatalf("Begin of another attempt: %v, want IN_PROGRESS", res.GetOutcome())
	}
	if other.GetAttemptId() != "" {
		t.Fatalf("Begin changed the caller's request: attempt_id %q", other.GetAttemptId())
	}
}

// Calls are retried while the coordinator is unavailable.
func TestCallsRetryWhileUnavailable(t *testing.T) {
	t.Parallel()
	coord, c := newClient(t, coordtest.Options{},
		clients.WithMaxAttempts(200), clients.WithBackoff(retry.BackoffLinear(100*time.Millisecond)))
	coord.Stop()
	restarted := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		coord.Restart()
		close(restarted)
	}()
	res, err := c.Begin(testCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: "r1"})
	<-restarted
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin across a restart: %v, %v", res.GetOutcome(), err)
	}
}

// A repeated ABANDONED Fail of a first attempt succeeds although the first
// one deleted the record.
func TestFailAbandonedRepeated(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{})
	ctx := testCtx(t)
	res, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "ab"})
	if err != nil {
		t.Fatal(err)
	}
	fail := &idempotencyv1.FailRequest{Scope: "build", Key: "ab", LeaseToken: res.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED}
	for i := range 2 {
		if _, err := c.Fail(ctx, fail); err != nil {
			t.Fatalf("Fail ABANDONED #%d: %v", i+1, err)
		}
	}
	if _, err := c.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "build", Key: "ab"}); status.Code(err) != codes.NotFound {
		t.Fatalf("Lookup: %v, want NOT_FOUND", err)
	}
	// Other kinds still report NOT_FOUND.
	fail.Kind = idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE
	if _, err := c.Fail(ctx, fail); status.Code(err) != codes.NotFound {
		t.Fatalf("Fail RETRYABLE on no record: %v, want NOT_FOUND", err)
	}
}

func stored(body string) *idempotencyv1.StoredResponse {
	return &idempotencyv1.StoredResponse{SchemaVersion: "test/1", Body: []byte(body)}
}

// Once runs fn once; later calls, concurrent or not, get its response.
func TestOnceRunsOnce(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{})
	ctx := testCtx(t)
	var runs atomic.Int32
	fn := func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		runs.Add(1)
		time.Sleep(200 * time.Millisecond)
		return stored("built"), nil
	}
	results := make([]*clients.Result, 10)
	errs := make([]error, 10)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() { results[i], errs[i] = c.Once(ctx, "build", "commit-abc", []byte("fp"), fn) })
	}
	wg.Wait()
	fresh := 0
	for i, r := range results {
		if errs[i] != nil {
			t.Fatalf("Once #%d: %v", i, errs[i])
		}
		if !r.Replayed {
			fresh++
		}
		if !proto.Equal(r.Response, stored("built")) || r.State != idempotencyv1.State_STATE_COMPLETED || r.Attempt != 1 {
			t.Fatalf("Once #%d: %+v", i, r)
		}
	}
	if runs.Load() != 1 || fresh != 1 {
		t.Fatalf("fn ran %d times, %d results not replayed; want 1 and 1", runs.Load(), fresh)
	}
	if _, err := c.Once(ctx, "build", "commit-abc", []byte("other"), fn); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Once with another fingerprint: %v, want FAILED_PRECONDITION", err)
	}
}

// Once records fn's failures by kind and replays replayable ones.
func TestOnceFailures(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{Config: `scopes: [{ match: "held", on_unknown: hold }]`})
	ctx := testCtx(t)
	fail := func(err error) func(context.Context) (*idempotencyv1.StoredResponse, error) {
		return func(context.Context) (*idempotencyv1.StoredResponse, error) { return nil, err }
	}
	never := fail(errors.New("fn must not run"))

	declined := status.Error(codes.FailedPrecondition, "declined")
	res, err := c.Once(ctx, "pay", "status", nil, fail(declined))
	if !errors.Is(err, declined) || res.State != idempotencyv1.State_STATE_FAILED_REPLAYABLE {
		t.Fatalf("first: %+v, %v", res, err)
	}
	res, err = c.Once(ctx, "pay", "status", nil, never)
	if !res.Replayed || status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "declined" {
		t.Fatalf("replay: %+v, %v", res, err)
	}

	own := &clients.FailureError{Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE,
		Response: stored("no such repo"), Err: errors.New("no such repo")}
	if _, err := c.Once(ctx, "build", "own", nil, fail(own)); !errors.Is(err, own) {
		t.Fatalf("first: %v", err)
	}
	_, err = c.Once(ctx, "build", "own", nil, never)
	var fe *clients.FailureError
	if !errors.As(err, &fe) || !proto.Equal(fe.Response, stored("no such repo")) {
		t.Fatalf("replay: %v", err)
	}

	var seen attemptSeen
	retryable := &clients.FailureError{Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Err: errors.New("runner busy")}
	for i := range 2 {
		_, err := c.Once(ctx, "build", "retry", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			seen.record(ctx)
			if i == 0 {
				return nil, retryable
			}
			return stored("ok"), nil
		})
		if (i == 0) != errors.Is(err, retryable) {
			t.Fatalf("run %d: %v", i, err)
		}
	}
	if got, want := seen.get(), []string{"1 STATE_UNSPECIFIED true", "2 STATE_FAILED_RETRYABLE true"}; !equalStrings(got, want) {
		t.Fatalf("AttemptFrom saw %v, want %v", got, want)
	}

	// A plain error may hide a side effect: UNKNOWN; under hold, the next
	// Once is refused with ErrUnknownHeld.
	if _, err := c.Once(ctx, "held", "u", nil, fail(errors.New("lost connection to the bank"))); err == nil {
		t.Fatal("no error")
	}
	_, err = c.Once(ctx, "held", "u", nil, never)
	if !errors.Is(err, clients.ErrUnknownHeld) || errorReason(status.Convert(err)) != clients.ReasonUnknownHeld {
		t.Fatalf("held: %v", err)
	}
}

// When another attempt takes the key over (the lease ran out meanwhile),
// Once cancels fn with ErrLeaseLost and records nothing.
func TestOnceLeaseLost(t *testing.T) {
	t.Parallel()
	coord, c := newClient(t, coordtest.Options{FakeClock: true}, clients.WithLease(time.Second))
	ctx := testCtx(t)
	started := make(chan struct{})
	done := make(chan error, 1)
	var cause error
	go func() {
		_, err := c.Once(ctx, "deploy", "d1", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			close(started)
			<-ctx.Done()
			cause = context.Cause(ctx)
			return nil, ctx.Err()
		})
		done <- err
	}()
	<-started
	// Let the lease run out and take the key over; a heartbeat landing
	// between the two revives the lease, so repeat until the takeover wins.
	var taken *idempotencyv1.BeginResponse
	eventually(t, "a takeover", func() bool {
		coord.Clock.Advance(2 * time.Second)
		res, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "deploy", Key: "d1", AttemptId: "successor"})
		if err != nil {
			t.Fatal(err)
		}
		taken = res
		return res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED
	})
	if taken.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("takeover from %v, want UNKNOWN", taken.GetPreviousState())
	}
	if err := <-done; !errors.Is(err, clients.ErrLeaseLost) || !errors.Is(cause, clients.ErrLeaseLost) {
		t.Fatalf("Once: %v, cause %v; want ErrLeaseLost", err, cause)
	}
	if _, err := c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "deploy", Key: "d1",
		LeaseToken: taken.GetLeaseToken(), Response: stored("v2")}); err != nil {
		t.Fatalf("the successor's Complete: %v", err)
	}
}

// Shutdown bounds the background work: with the coordinator gone for
// good, it cancels the retries when its context ends.
func TestShutdownCancelsBackgroundWork(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	c := clients.New(coord.Dial(t), clients.WithMaxAttempts(2))
	res, err := c.Once(testCtx(t), "build", "gone", nil, func(context.Context) (*idempotencyv1.StoredResponse, error) {
		coord.Stop()
		return stored("built"), nil
	})
	if err != nil || res.Replayed || !proto.Equal(res.Response, stored("built")) {
		t.Fatalf("Once: %+v, %v", res, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with the coordinator gone: %v, want DeadlineExceeded", err)
	}
	if err := c.Shutdown(context.Background()); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
}

// Once whose context ends while its Begin is in flight (the coordinator
// acquired the key; the answer never arrived) does not run fn and, by the
// time it returns, has released the key: the record is gone, and the next
// Once runs fn as the first attempt.
func TestOnceCallerGivesUpDuringBegin(t *testing.T) {
	t.Parallel()
	lost := &lostAcquisitions{}
	lost.armed.Store(true)
	_, c := newClient(t, coordtest.Options{ServerOptions: []server.Option{lost.option()}})
	var runs atomic.Int32
	fn := func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		runs.Add(1)
		return stored("done"), nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := c.Once(ctx, "build", "gave-up", nil, fn); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Once: %v, want DEADLINE_EXCEEDED", err)
	}
	lost.armed.Store(false)
	if runs.Load() != 0 || lost.held.Load() != 1 {
		t.Fatalf("fn ran %d times, %d Begin answers kept back; want 0 and 1", runs.Load(), lost.held.Load())
	}
	if rec, err := c.Lookup(testCtx(t), &idempotencyv1.LookupRequest{Scope: "build", Key: "gave-up"}); status.Code(err) != codes.NotFound {
		t.Fatalf("after Once returned: %v %v, want NOT_FOUND", rec.GetRecord(), err)
	}
	res, err := c.Once(testCtx(t), "build", "gave-up", nil, fn)
	if err != nil || res.Replayed || res.Attempt != 1 || runs.Load() != 1 {
		t.Fatalf("next Once: %+v %v, fn ran %d times; want attempt 1 run once", res, err, runs.Load())
	}
}

// Once whose context ends while it waits for another attempt (its waiting
// Begin acquired the key as the holder failed; the answer never arrived)
// releases the acquisition before it returns: the key is FAILED_RETRYABLE
// attempt 1 as the holder left it, and under max_attempts 2 the next Once
// still runs fn, as attempt 2 after FAILED_RETRYABLE.
func TestOnceCallerGivesUpWhileWaiting(t *testing.T) {
	t.Parallel()
	lost := &lostAcquisitions{}
	coord, c := newClient(t, coordtest.Options{Config: `scopes: [{ match: "build", max_attempts: 2 }]`,
		ServerOptions: []server.Option{lost.option()}})
	holder, err := c.Begin(testCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: "w"})
	if err != nil {
		t.Fatal(err)
	}
	lost.armed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	done := make(chan error, 1)
	var runs atomic.Int32
	go func() {
		_, err := c.Once(ctx, "build", "w", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			runs.Add(1)
			return stored("done"), nil
		})
		done <- err
	}()
	coord.WaitInFlight(t, "Begin", 1) // Once's Begin waits for the holder
	if _, err := c.Fail(testCtx(t), &idempotencyv1.FailRequest{Scope: "build", Key: "w", LeaseToken: holder.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: "upstream down"}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Once: %v, want DEADLINE_EXCEEDED", err)
	}
	lost.armed.Store(false)
	if runs.Load() != 0 || lost.held.Load() != 1 {
		t.Fatalf("fn ran %d times, %d Begin answers kept back; want 0 and 1", runs.Load(), lost.held.Load())
	}
	look, err := c.Lookup(testCtx(t), &idempotencyv1.LookupRequest{Scope: "build", Key: "w"})
	if rec := look.GetRecord(); err != nil || rec.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || rec.GetAttempt() != 1 {
		t.Fatalf("after Once returned: %v %v, want FAILED_RETRYABLE attempt 1", rec, err)
	}
	var attempt int32
	var prev idempotencyv1.State
	res, err := c.Once(testCtx(t), "build", "w", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		attempt, prev, _ = clients.AttemptFrom(ctx)
		return stored("done"), nil
	})
	if err != nil || res.Replayed || attempt != 2 || prev != idempotencyv1.State_STATE_FAILED_RETRYABLE {
		t.Fatalf("next Once: %+v %v, attempt %d after %v; want attempt 2 after FAILED_RETRYABLE", res, err, attempt, prev)
	}
}

// cancelAfterBegin cancels the caller's context as soon as a Begin has
// answered, and then delivers the answer: the caller gives up just after
// the key was acquired, before the function would start.
type cancelAfterBegin struct {
	grpc.ClientConnInterface
	cancel context.CancelFunc
}

func (c *cancelAfterBegin) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if _, ok := args.(*idempotencyv1.BeginRequest); ok && err == nil {
		c.cancel()
	}
	return err
}

// Once whose context ends after Begin answered ACQUIRED but before fn
// starts does not run fn and releases the key before it returns.
func TestOnceCallerGoneBeforeFunctionStarts(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gate := &cancelAfterBegin{ClientConnInterface: coord.Dial(t)}
	c := clients.New(gate)
	t.Cleanup(func() {
		sctx, scancel := context.WithTimeout(context.Background(), time.Minute)
		defer scancel()
		_ = c.Shutdown(sctx)
	})
	gate.cancel = cancel
	var runs atomic.Int32
	_, err := c.Once(ctx, "build", "gone", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		runs.Add(1)
		return stored("done"), nil
	})
	if status.Code(err) != codes.Canceled || runs.Load() != 0 {
		t.Fatalf("Once: %v, fn ran %d times; want CANCELED and no run", err, runs.Load())
	}
	if _, err := c.Lookup(testCtx(t), &idempotencyv1.LookupRequest{Scope: "build", Key: "gone"}); status.Code(err) != codes.NotFound {
		t.Fatalf("after Once returned: %v, want NOT_FOUND", err)
	}
}

// lossyConn delivers the first Begin to the coordinator and then reports
// UNAVAILABLE, as when the reply is lost on the way back; it records the
// attempt_id of every Begin it forwards.
type lossyConn struct {
	grpc.ClientConnInterface
	mu       sync.Mutex
	attempts []string
	dropped  bool
}

func (l *lossyConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := l.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	req, ok := args.(*idempotencyv1.BeginRequest)
	if !ok {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.attempts = append(l.attempts, req.GetAttemptId())
	if err == nil && !l.dropped {
		l.dropped = true
		return status.Error(codes.Unavailable, "reply lost")
	}
	return err
}

// TestBeginAttemptIDSurvivesLostReply: the Go client's Begin fills in an
// attempt_id when the caller leaves it empty and keeps it across its own
// retries, so a Begin whose reply was lost gets the same lease on retry
// instead of finding its own key IN_PROGRESS.
func TestBeginAttemptIDSurvivesLostReply(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	conn := &lossyConn{ClientConnInterface: coord.Dial(t)}
	c := clients.New(conn, clients.WithMaxAttempts(5), clients.WithBackoff(retry.BackoffLinear(10*time.Millisecond)))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = c.Shutdown(ctx)
	})
	req := &idempotencyv1.BeginRequest{Scope: "build", Key: "lost-reply"}
	res, err := c.Begin(testCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || res.GetLeaseToken() == "" {
		t.Fatalf("retried Begin after a lost reply: %v, want ACQUIRED with a token", res.GetOutcome())
	}
	conn.mu.Lock()
	attempts := append([]string(nil), conn.attempts...)
	conn.mu.Unlock()
	if len(attempts) != 2 || attempts[0] == "" || attempts[0] != attempts[1] {
		t.Fatalf("attempt_ids sent: %q, want the same non-empty one twice", attempts)
	}
	if req.GetAttemptId() != "" {
		t.Fatalf("Begin changed the caller's request")
	}
	// The token works: the record completes.
	if _, err := c.Complete(testCtx(t), &idempotencyv1.CompleteRequest{Scope: "build", Key: "lost-reply", LeaseToken: res.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}}); err != nil {
		t.Fatal(err)
	}
	again, err := c.Begin(testCtx(t), proto.CloneOf(req))
	if err != nil || again.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
		t.Fatalf("after Complete: %v %v", again.GetOutcome(), err)
	}
}
