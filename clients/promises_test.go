package clients_test

// Tests of README promises that no other test pinned down (issue 19, item 6).

import (
	"context"
	"sync"
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
)

// TestHandlerErrorClassesByCode covers the README's table for the codes no
// other test names: ABORTED is RETRYABLE (the next call runs the handler
// again as attempt 2), NOT_FOUND, ALREADY_EXISTS and OUT_OF_RANGE are
// REPLAYABLE (stored, and replayed without running the handler).
func TestHandlerErrorClassesByCode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		code  codes.Code
		state idempotencyv1.State
	}{
		{codes.Aborted, idempotencyv1.State_STATE_FAILED_RETRYABLE},
		{codes.NotFound, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
		{codes.AlreadyExists, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
		{codes.OutOfRange, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
	} {
		t.Run(tc.code.String(), func(t *testing.T) {
			t.Parallel()
			var seen attemptSeen
			f := start(t, setup{charge: failFirst(&seen, status.Error(tc.code, "first run: "+tc.code.String()))})
			wantCode(t, f.charge(t, "k", chargeReq(100)).err, tc.code)
			rec := f.mustState(t, "k", tc.state)
			second := f.charge(t, "k", chargeReq(100))
			if tc.state == idempotencyv1.State_STATE_FAILED_REPLAYABLE {
				st := wantCode(t, second.err, tc.code)
				if st.Message() != "first run: "+tc.code.String() || second.result() != "replayed" {
					t.Fatalf("replay: %v, result %q", st, second.result())
				}
				if rec.GetResponse().GetStatusCode() != int32(tc.code) {
					t.Fatalf("stored status code %d, want %d", rec.GetResponse().GetStatusCode(), tc.code)
				}
				if n := f.svc.chargeCalls.Load(); n != 1 {
					t.Fatalf("handler ran %d times, want 1", n)
				}
				return
			}
			if second.err != nil || second.result() != "created" {
				t.Fatalf("second call: %v, result %q", second.err, second.result())
			}
			want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_FAILED_RETRYABLE true"}
			if got := seen.get(); !equalStrings(got, want) {
				t.Fatalf("AttemptFrom saw %v, want %v", got, want)
			}
		})
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
