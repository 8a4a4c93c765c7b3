package clients_test

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TestInterceptorErrorClasses checks every row of the handler error table
// of docs/go.md, one handler error
// code at a time: the caller gets the handler's code, and the record is
// left as the class says (ABANDONED: no record; RETRYABLE:
// FAILED_RETRYABLE, and the next call runs the handler again as attempt 2;
// UNKNOWN: UNKNOWN; REPLAYABLE: FAILED_REPLAYABLE with the code stored, and
// a retry replays the stored status, message included, without running the
// handler).
func TestInterceptorErrorClasses(t *testing.T) {
	t.Parallel()
	const none = idempotencyv1.State_STATE_UNSPECIFIED
	for _, tc := range []struct {
		code codes.Code
		want idempotencyv1.State
	}{
		{codes.InvalidArgument, none},
		{codes.Unauthenticated, none},
		{codes.PermissionDenied, none},
		{codes.ResourceExhausted, none},
		{codes.Unimplemented, none},
		{codes.Unavailable, idempotencyv1.State_STATE_FAILED_RETRYABLE},
		{codes.Aborted, idempotencyv1.State_STATE_FAILED_RETRYABLE},
		{codes.DeadlineExceeded, idempotencyv1.State_STATE_UNKNOWN},
		{codes.Canceled, idempotencyv1.State_STATE_UNKNOWN},
		{codes.Internal, idempotencyv1.State_STATE_UNKNOWN},
		{codes.Unknown, idempotencyv1.State_STATE_UNKNOWN},
		{codes.DataLoss, idempotencyv1.State_STATE_UNKNOWN},
		{codes.FailedPrecondition, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
		{codes.NotFound, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
		{codes.AlreadyExists, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
		{codes.OutOfRange, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
	} {
		t.Run(tc.code.String(), func(t *testing.T) {
			t.Parallel()
			var seen attemptSeen
			f := start(t, setup{charge: failFirst(&seen, status.Error(tc.code, "handler says "+tc.code.String()))})
			key := fmt.Sprintf("class-%d", tc.code)
			wantCode(t, f.charge(t, key, chargeReq(100)).err, tc.code)
			if tc.want == none {
				if _, err := f.lookup(t, key); status.Code(err) != codes.NotFound {
					t.Fatalf("Lookup after %v: %v, want NOT_FOUND (abandoned, no record)", tc.code, err)
				}
				return
			}
			rec := f.mustState(t, key, tc.want)
			switch tc.want {
			case idempotencyv1.State_STATE_FAILED_REPLAYABLE:
				second := f.charge(t, key, chargeReq(100))
				st := wantCode(t, second.err, tc.code)
				if st.Message() != "handler says "+tc.code.String() || second.result() != "replayed" {
					t.Fatalf("replay: %v, result %q", st, second.result())
				}
				if rec.GetResponse().GetStatusCode() != int32(tc.code) {
					t.Fatalf("stored status code %d, want %d", rec.GetResponse().GetStatusCode(), tc.code)
				}
				if n := f.svc.chargeCalls.Load(); n != 1 {
					t.Fatalf("the handler ran %d times, want 1 (the stored %v is replayed)", n, tc.code)
				}
			case idempotencyv1.State_STATE_FAILED_RETRYABLE:
				second := f.charge(t, key, chargeReq(100))
				if second.err != nil || second.result() != "created" {
					t.Fatalf("second call: %v, result %q", second.err, second.result())
				}
				want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_FAILED_RETRYABLE true"}
				if got := seen.get(); !equalStrings(got, want) {
					t.Fatalf("AttemptFrom saw %v, want %v", got, want)
				}
			}
		})
	}
}
