package server_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// TestBeginWhoseCallerGaveUpDuringItsWriteLeavesTheKeyFree: a gRPC caller
// cancels its Begin while the coordinator's write of it waits on the key's
// row (a service's RunTx holds it), and the write then creates the key
// after all, for a caller that has gone. The coordinator releases that
// acquisition itself (Fail ABANDONED): the key is absent again, and the
// next Begin acquires it at once as attempt 1, as if the cancelled one had
// never been. Before, the key stayed IN_PROGRESS with a token nobody knew,
// and read UNKNOWN once its lease ran out.
func TestBeginWhoseCallerGaveUpDuringItsWriteLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	// handled tells when a Begin's handler has returned: the coordinator
	// has seen its caller go (a client's cancel returns at once, before
	// the cancel reaches the coordinator).
	handled := make(chan error, 1)
	e := newEnv(t, envOptions{realClock: true, serverOptions: []server.Option{server.WithUnaryInterceptors(
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			resp, err := h(ctx, req)
			if info.FullMethod == idempotencyv1.Coordinator_Begin_FullMethodName {
				select {
				case handled <- err:
				default:
				}
			}
			return resp, err
		})}})
	id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "gave-up"}
	svc, rollBack := holdNewKey(t, e.dbURL, id)

	conn, err := pgxConnect(e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	records := func() int {
		t.Helper()
		var n int
		if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_records`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	bctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	began := make(chan error, 1)
	go func() {
		_, err := e.client.Begin(bctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key, AttemptId: "gave-up"})
		began <- err
	}()
	// The coordinator's write of the Begin waits on the RunTx's row; then
	// its caller gives up, and the coordinator's handler returns.
	writers := pgtest.WaitForLockWaiters(t, conn)
	cancel()
	if err := <-began; status.Code(err) != codes.Canceled {
		t.Fatalf("Begin cancelled while its write waited: %v, want CANCELED", err)
	}
	select {
	case err := <-handled:
		if status.Code(err) != codes.Canceled {
			t.Fatalf("the coordinator's Begin handler returned %v; want CANCELED", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the coordinator's Begin handler has not returned 10 s after its caller cancelled")
	}
	rollBack()
	// The write goes on and commits (the key is then held until the
	// coordinator's release commits), or finds the key held no longer.
	pgtest.WaitForBackendsDone(t, conn, writers)
	for deadline := time.Now().Add(5 * time.Second); records() != 0; {
		if time.Now().After(deadline) {
			rec, _, _ := svc.Lookup(context.Background(), id)
			t.Fatalf("the key is held (%v, attempt_id %q) 5 s after the only Begin of it was cancelled; want no record",
				rec.State, rec.AttemptID)
		}
		time.Sleep(20 * time.Millisecond)
	}
	r := e.mustBegin(id.Scope, id.Key, idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if got := r.GetRecord().GetAttempt(); got != 1 || r.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED {
		t.Errorf("next Begin: attempt %d, previous state %v; want attempt 1 of a new key", got, r.GetPreviousState())
	}
}
